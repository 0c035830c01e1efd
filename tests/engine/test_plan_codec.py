"""Window plans as deltas: a worker's mirrors must equal the leader's sequences after every window."""

import json
import pickle
import random
import subprocess
import sys

import pytest

from lockstep_engine.block_manager import BlockManager
from lockstep_engine.group.plan_codec import PlanCodecError, PlanDecoder, PlanEncoder
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import ScheduledSeq, Scheduler, SchedulerLimits, WindowPlan
from lockstep_engine.sequence import Request, Sequence, SequenceStatus

VOCAB = 128256  # Llama 3: most token ids need 5 bytes in a pickle
MAX_MODEL_LEN = 4096


class Leader:
    """The engine core's loop on plain data: schedule, sample, stop, abort, release."""

    def __init__(self, *, num_blocks=48, block_size=4, budget=32, max_seqs=8, steps=4, seed=0):
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        limits = SchedulerLimits(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
                                 num_scheduler_steps=steps)
        self.scheduler = Scheduler(limits, self.blocks)
        self.requests: dict[str, Request] = {}
        self.rng = random.Random(seed)
        self.num_aborts = 0
        self._finished: list[Sequence] = []

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def schedule(self) -> WindowPlan | None:
        self.scheduler.fork_ready_requests([r for r in self.requests.values() if not r.forked])
        return self.scheduler.schedule()

    def run(self, plan: WindowPlan, stop_probability: float = 0.0) -> None:
        """Samples like the device (a row ends at a stop or at max_steps), then completes the rows."""
        accepted = {id(row): 0 for row in plan.sampling_rows}
        for _ in range(plan.num_steps):
            for row in plan.sampling_rows:
                seq = row.seq
                if seq.is_finished or accepted[id(row)] == row.max_steps:
                    continue
                seq.token_ids.append(self.rng.randrange(VOCAB))
                accepted[id(row)] += 1
                if self.rng.random() < stop_probability:
                    self._finish(seq, SequenceStatus.FINISHED_STOPPED)
                elif seq.remaining_tokens <= 0:
                    self._finish(seq, SequenceStatus.FINISHED_LENGTH)
        for row in plan.rows:
            self.scheduler.complete_row(row, accepted.get(id(row), 0))
        self._release()

    def abort(self, request: Request) -> None:
        self.num_aborts += 1
        request.aborted = True
        for seq in request.sequences:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._release()

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self._finished.append(seq)

    def _release(self) -> None:
        for seq in self._finished:
            self.scheduler.finish(seq, seq.status)
        self._finished = []
        for request in list(self.requests.values()):
            if all(seq.is_finished for seq in request.sequences) and (request.forked or request.aborted):
                del self.requests[request.request_id]

    @property
    def num_unfinished(self) -> int:
        return sum(not seq.is_finished for r in self.requests.values() for seq in r.sequences)


def assert_same_plan(decoded: WindowPlan, plan: WindowPlan) -> None:
    assert decoded.num_steps == plan.num_steps
    assert decoded.block_copies == plan.block_copies
    assert len(decoded.rows) == len(plan.rows)
    mirrors = {}
    for got, want in zip(decoded.rows, plan.rows):
        assert (got.num_new_tokens, got.samples, got.max_steps, got.start_computed, got.remaining_tokens) == \
            (want.num_new_tokens, want.samples, want.max_steps, want.start_computed, want.remaining_tokens)
        g, w = got.seq, want.seq
        assert g.token_ids == w.token_ids
        assert g.block_ids == w.block_ids
        assert (g.index, g.prompt_len, g.num_output_tokens, g.compute_target, g.num_computed) == \
            (w.index, w.prompt_len, w.num_output_tokens, w.compute_target, w.num_computed)
        gr, wr = g.request, w.request
        assert (gr.request_id, gr.prompt_token_ids, gr.params, gr.seed, gr.max_model_len, gr.forked) == \
            (wr.request_id, wr.prompt_token_ids, wr.params, wr.seed, wr.max_model_len, wr.forked)
        # Siblings share one mirror request, which holds exactly the mirrored siblings, in index order.
        assert mirrors.setdefault(gr.request_id, gr) is gr
        assert g in gr.sequences and [s.index for s in gr.sequences] == sorted(s.index for s in gr.sequences)


def make_request(rng: random.Random, name: str, prefixes: list[list[int]], arrival: float) -> Request:
    prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 48))]
    params = SamplingParams(n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 0.8]),
                            max_tokens=rng.randrange(2, 40), stop_token_ids=[rng.randrange(VOCAB)])
    return Request(name, prompt, params, MAX_MODEL_LEN, seed=rng.randrange(2**32), arrival_time=arrival)


@pytest.mark.parametrize("steps, seed", [(4, 0), ("auto", 1), (1, 2)])
def test_mirrors_match_the_leader_through_preemption_forks_aborts_and_stops(steps, seed):
    leader = Leader(steps=steps, seed=seed)
    rng = random.Random(seed + 100)
    prefixes = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(3)]  # shared: prefix cache hits
    encoder, decoder = PlanEncoder(), PlanDecoder()
    num_requests, num_windows, saw_chunk, saw_copy, saw_fork = 0, 0, False, False, False
    for _ in range(5000):  # a bound instead of a hang if the scheduler ever stalls
        if num_requests == 80 and not leader.requests:
            break
        if num_requests < 80 and rng.random() < 0.5:
            leader.add(make_request(rng, f"req-{num_requests}", prefixes, arrival=num_windows))
            num_requests += 1
        if leader.requests and rng.random() < 0.05:
            leader.abort(rng.choice(list(leader.requests.values())))
        if rng.random() < 0.1 and (data := encoder.encode_releases()) is not None:
            assert decoder.decode(data) is None
        plan = leader.schedule()
        if plan is None:
            continue
        decoded = decoder.decode(encoder.encode(plan))
        assert_same_plan(decoded, plan)
        assert decoder.num_sequences == encoder.num_sequences <= leader.num_unfinished
        assert decoder.num_requests == encoder.num_requests
        saw_chunk |= any(not row.samples and row.seq.request.forked for row in plan.rows)
        saw_copy |= bool(plan.block_copies)
        saw_fork |= any(row.seq.index > 0 for row in plan.rows)
        leader.run(plan, stop_probability=0.03)
        num_windows += 1
    assert num_requests == 80 and not leader.requests
    assert leader.scheduler.num_preemptions > 0 and leader.blocks.prefix_cache_hits > 0 and leader.num_aborts > 0
    assert saw_chunk and saw_copy and saw_fork
    decoder.decode(encoder.encode_releases())
    assert (encoder.num_sequences, encoder.num_requests, decoder.num_sequences, decoder.num_requests) == (0, 0, 0, 0)


def _decoding_batch(num_seqs: int, context: int, steps: int = 8) -> tuple[Leader, PlanEncoder, PlanDecoder]:
    """A leader whose batch has prefilled and decoded once, with an encoder and decoder in step."""
    leader = Leader(num_blocks=num_seqs * (context // 16 + 8), block_size=16, budget=num_seqs * context,
                    max_seqs=num_seqs, steps=steps)
    rng = random.Random(0)
    for i in range(num_seqs):
        prompt = [rng.randrange(VOCAB) for _ in range(context)]
        leader.add(Request(f"cmpl-{i:032x}", prompt, SamplingParams(max_tokens=1000), MAX_MODEL_LEN, seed=i))
    encoder, decoder = PlanEncoder(), PlanDecoder()
    for _ in range(2):
        plan = leader.schedule()
        decoder.decode(encoder.encode(plan))
        leader.run(plan)
    return leader, encoder, decoder


@pytest.mark.parametrize("num_seqs, context", [(64, 1000), (256, 1000), (64, 4000)])
def test_a_decode_window_message_is_at_least_20x_smaller_than_the_pickled_plan(num_seqs, context):
    leader, encoder, decoder = _decoding_batch(num_seqs, context)
    plan = leader.schedule()
    data = encoder.encode(plan)
    full = len(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
    print(f"\n{num_seqs} seqs x {context} tokens, {plan.num_steps} steps: delta {len(data)} B, "
          f"pickled plan {full} B ({full / len(data):.0f}x)")
    assert_same_plan(decoder.decode(data), plan)
    assert full >= 20 * len(data)


def test_new_requests_are_sent_once_then_only_their_deltas():
    leader, encoder, _ = _decoding_batch(8, 1000)
    plan = leader.schedule()
    assert len(encoder.encode(plan)) < 8 * 200  # no prompt inside: about 100 bytes a row


def test_release_only_message_empties_the_worker_when_the_engine_goes_idle():
    leader = Leader()
    leader.add(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3), MAX_MODEL_LEN, seed=0))
    encoder, decoder = PlanEncoder(), PlanDecoder()
    assert encoder.encode_releases() is None
    while (plan := leader.schedule()) is not None:
        decoder.decode(encoder.encode(plan))
        leader.run(plan)
    assert decoder.num_sequences == 1  # finished after its last window: nothing has told the worker yet
    assert decoder.decode(encoder.encode_releases()) is None
    assert decoder.num_sequences == decoder.num_requests == 0
    assert encoder.encode_releases() is None


def test_a_reused_request_id_gets_a_fresh_mirror():
    leader = Leader()
    encoder, decoder = PlanEncoder(), PlanDecoder()
    for prompt in ([1, 2, 3, 4, 5], [9, 8, 7]):
        leader.add(Request("same", prompt, SamplingParams(max_tokens=2), MAX_MODEL_LEN, seed=0))
        while (plan := leader.schedule()) is not None:
            decoded = decoder.decode(encoder.encode(plan))
            assert_same_plan(decoded, plan)
            leader.run(plan)
    assert decoded.rows[0].seq.request.prompt_token_ids == [9, 8, 7]


def _two_messages() -> tuple[bytes, bytes]:
    leader = Leader()
    leader.add(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20), MAX_MODEL_LEN, seed=0))
    encoder = PlanEncoder()
    first = encoder.encode(plan := leader.schedule())
    leader.run(plan)
    return first, encoder.encode(leader.schedule())


def test_a_worker_that_missed_a_message_refuses_the_next():
    _, second = _two_messages()
    with pytest.raises(PlanCodecError, match="plan message 1 arrived where 0 was expected"):
        PlanDecoder().decode(second)


def test_a_delta_for_a_sequence_the_worker_does_not_mirror_names_the_key():
    other_first, _ = _two_messages()
    leader = Leader()
    leader.add(Request("b", [1, 2, 3], SamplingParams(max_tokens=20), MAX_MODEL_LEN, seed=0))
    encoder = PlanEncoder()
    encoder.encode(plan := leader.schedule())  # never reaches the decoder, which saw another leader's first
    leader.run(plan)
    decoder = PlanDecoder()
    decoder.decode(other_first)
    with pytest.raises(PlanCodecError, match=r"sequence \('b', 0\): a delta arrived for a sequence this worker"):
        decoder.decode(encoder.encode(leader.schedule()))


def test_a_mirror_shorter_than_the_delta_expects_is_an_error_not_wrong_tokens():
    first, second = _two_messages()
    decoder = PlanDecoder()
    decoder.decode(first).rows[0].seq.token_ids.pop()
    with pytest.raises(PlanCodecError, match=r"sequence \('a', 0\): the token_ids delta keeps 5 entries but the "
                                             r"mirror holds 4"):
        decoder.decode(second)


def test_a_message_that_fails_to_load_changes_nothing():
    first, _ = _two_messages()
    decoder = PlanDecoder()
    with pytest.raises(PlanCodecError, match="not valid JSON"):
        decoder.decode(b"garbage")
    assert decoder.decode(first).rows[0].seq.token_ids == [1, 2, 3, 4, 5]


def test_after_a_message_fails_to_apply_the_decoder_refuses_every_message():
    first, second = _two_messages()
    decoder = PlanDecoder()
    decoder.decode(first).rows[0].seq.token_ids.pop()
    with pytest.raises(PlanCodecError, match="token_ids delta"):
        decoder.decode(second)
    with pytest.raises(PlanCodecError, match="an earlier plan message failed"):
        decoder.decode(second)


def _json(*message) -> bytes:
    return json.dumps(message).encode()


NEW_REQUEST = ["a", [1, 2, 3], SamplingParams().to_dict(), 64, 0, True]
ROW = ["a", 0, True, 3, [], 0, [4], 3, True, 1, 0, 16, 0]


@pytest.mark.parametrize("data, error", [
    (b"garbage", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (pickle.dumps(("lockstep-plan/3", 0, [], [], [], [], None)), "not valid JSON"),
    (_json(1, 2, 3), "is not a lockstep-plan/3 message"),
    (_json("lockstep-plan/1", 0, [], [], [], [], None), "is not a lockstep-plan/3 message"),
    (_json("lockstep-plan/3", 0.0, [], [], [], [], None), "is not a lockstep-plan/3 message"),
    (_json("lockstep-plan/3", 0, [], [], [], [["a", 0, True]], None), "plan message 0 is malformed"),
    (_json("lockstep-plan/3", 0, [["a", 0]], [], [], [], None), r"sequence \('a', 0\): released"),
    (_json("lockstep-plan/3", 0, [], [NEW_REQUEST], [], [ROW[:3] + [3.0] + ROW[4:]], [1, [], []]),
     r"sequence \('a', 0\): expected integers, got 3.0"),
    (_json("lockstep-plan/3", 0, [], [NEW_REQUEST], [], [ROW[:8] + [1] + ROW[9:]], [1, [], []]),
     r"sequence \('a', 0\): the row's flags must be booleans"),
    (_json("lockstep-plan/3", 0, [], [NEW_REQUEST[:1] + [[1, "2"]] + NEW_REQUEST[2:]], [], [ROW], [1, [], []]),
     r"request 'a': expected integers, got '2'"),
    (_json("lockstep-plan/3", 0, [], [NEW_REQUEST[:2] + [{"top_k": "x"}] + NEW_REQUEST[3:]], [], [ROW], [1, [], []]),
     r"request 'a': invalid sampling parameters"),
    (_json("lockstep-plan/3", 0, [], [NEW_REQUEST], [], [ROW], [1, [[1, True]], []]), "the window: expected integers"),
    (_json("lockstep-plan/3", 0, [], [NEW_REQUEST], [], [ROW], [1, [], [["1", "a", "/p"]]]),
     "the window: expected integers"),
    (_json("lockstep-plan/3", 0, [], [NEW_REQUEST], [], [ROW], [1, [], [[1, "a"]]]), r"\[slot, name, path\]"),
    (_json("lockstep-plan/3", 0, [], [NEW_REQUEST], [], [ROW[:12] + [True]], [1, [], []]),
     r"sequence \('a', 0\): expected integers, got True"),
])
def test_malformed_messages_raise_value_errors(data, error):
    with pytest.raises(ValueError, match=error):
        PlanDecoder().decode(data)


def test_a_truncated_message_is_refused():
    first, _ = _two_messages()
    with pytest.raises(PlanCodecError, match="not valid JSON"):
        PlanDecoder().decode(first[:-10])


@pytest.mark.parametrize("second_index, error", [(0, r"sequence \('a', 0\): two unfinished sequences share this key"),
                                                 (1, r"sequence \('a', 1\): two unfinished requests share request_id")])
def test_two_unfinished_requests_with_one_id_stop_the_encoder(second_index, error):
    one, two = (Request("a", [1, 2, 3], SamplingParams(max_tokens=4), MAX_MODEL_LEN, seed=0) for _ in range(2))
    two.sequences[0].index = second_index
    rows = [ScheduledSeq(r.sequences[0], 3, True, 1, 0, 4) for r in (one, two)]
    encoder = PlanEncoder()
    with pytest.raises(PlanCodecError, match=error):
        encoder.encode(WindowPlan(rows=rows, num_steps=1))
    with pytest.raises(PlanCodecError, match="an earlier plan failed to encode"):
        encoder.encode(WindowPlan(rows=rows[:1], num_steps=1))


def test_the_codec_imports_no_torch():
    code = "import sys, lockstep_engine.group.plan_codec; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_well_formed_json_message_decodes():
    window = [1, [[2, 3]], [[1, "a", "/adapters/a"]]]
    plan = PlanDecoder().decode(_json("lockstep-plan/3", 0, [], [NEW_REQUEST], [], [ROW], window))
    [row] = plan.rows
    assert (row.seq.token_ids, row.seq.block_ids, row.remaining_tokens, row.seq.lora_slot, plan.block_copies,
            plan.lora_loads) == ([1, 2, 3], [4], 16, 0, [(2, 3)], [(1, "a", "/adapters/a")])


def test_every_sampling_parameter_survives_the_wire():
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=2**64 - 1, stop=["\n\n"],
                            stop_token_ids=[7, 9], max_tokens=5, min_tokens=1, presence_penalty=0.5,
                            frequency_penalty=-0.25, repetition_penalty=1.1, logprobs=3, ignore_eos=True,
                            logit_bias={5: 1.5, 1000: -100.0}, json_schema={"type": "object", "properties": {}},
                            priority=1)
    request = Request("p", [1, 2, 3], params, MAX_MODEL_LEN, seed=2**63)
    plan = WindowPlan(rows=[ScheduledSeq(request.sequences[0], 2, False, 0, 0, 0)], num_steps=4)
    mirror = PlanDecoder().decode(PlanEncoder().encode(plan)).rows[0].seq.request
    assert mirror.params == params and mirror.params.logit_bias == {5: 1.5, 1000: -100.0}
    assert mirror.seed == 2**63


def test_the_codec_never_unpickles(monkeypatch):
    """The wire format is JSON: decoding a message runs no pickle (and the module does not import it)."""
    import lockstep_engine.group.plan_codec as plan_codec

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used by the plan codec")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "dumps", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    test_mirrors_match_the_leader_through_preemption_forks_aborts_and_stops(4, 3)
    assert not hasattr(plan_codec, "pickle")
    with open(plan_codec.__file__) as handle:
        assert "pickle" not in handle.read().replace("no pickle", "").replace("Pickling a", "")
