"""Speculative decoding inside windows (--speculative-config): the target's tokens, exactly.

Greedy text is the text without speculation at N=1 and N=8 (random:tiny and SmolLM2), a draft identical
to the target has every draft accepted, an unrelated draft almost none, a copying prompt has n-gram
drafts accepted; sampling keeps the target's distribution (a broken acceptance rule fails the same
bound); max_tokens, stop tokens and stop strings cut the accepted tokens exactly; bad flags are refused
by name.
"""

import collections

import pytest
import torch

from lockstep_engine.config import ConfigError, EngineConfig, parse_speculative_config
from lockstep_engine.llm import LLM
from lockstep_engine.runner import spec_window
from lockstep_engine.runner.cuda_graphs import DecodeGraphs
from lockstep_engine.runner.host_stream import HostRing
from lockstep_engine.sampler import SamplingTensors
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sequence import Request
from lockstep_engine.spec_decode.draft import DraftModel
from lockstep_engine.spec_decode.rejection import verify

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SELF_DRAFT = {"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 3}
TINY_PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(10, 60)), [3], [9, 9, 9, 9], list(range(200, 217))]
COPY_TEXT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
             "Repeat the code above exactly:\n\ndef add(a, b):\n")


def _tiny(steps, spec=None, **kwargs) -> LLM:
    return LLM("random:tiny", num_scheduler_steps=steps, device="cpu", speculative_config=spec,
               **{"num_gpu_blocks_override": 256, **kwargs})


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _acceptance_rate(counts) -> float:
    return counts.num_accepted_tokens / counts.num_draft_tokens if counts.num_draft_tokens else 0.0


def _rate(llm) -> float:
    return _acceptance_rate(llm.engine.core.stats.spec)


# ---- greedy: the target's tokens ----------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 8])
@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self-draft"])
def test_greedy_tokens_are_the_targets_on_a_random_model(steps, spec):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    expected = _token_ids(_tiny(steps).generate(prompts, params))
    llm = _tiny(steps, spec)
    assert _token_ids(llm.generate(prompts, params)) == expected
    counts = llm.engine.core.stats.spec
    assert counts.num_drafts > 0 and len(counts.accepted_per_pos) == 3
    if spec is SELF_DRAFT:
        assert _acceptance_rate(counts) == 1.0  # the draft is the target: every draft is its argmax
        # 40 tokens of 5 rows at up to 4 per verify forward: far fewer forwards than tokens
        assert llm.engine.core.stats.num_steps <= 5 * 40 // 4 + 2 * 5


def test_rows_accept_different_counts_in_one_step():
    llm = _tiny(8, NGRAM)
    accepted = []
    real_verify = spec_window.verify

    def spy(*args):
        tokens, count = real_verify(*args)
        accepted.append(count.tolist())
        return tokens, count

    spec_window.verify = spy
    try:
        llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], SamplingParams(temperature=0, max_tokens=24))
    finally:
        spec_window.verify = real_verify
    assert any(len(set(step)) > 1 for step in accepted), accepted


@pytest.mark.parametrize("steps", [1, 8])
def test_greedy_smollm2_with_ngram_is_the_targets_and_copying_accepts_many(make_llm, smollm2, steps):
    prompts = [smollm2.tokenizer.encode(text) for text in (COPY_TEXT, "The capital of France is")]
    prompts.append(smollm2.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}]))
    params = SamplingParams(temperature=0.0, max_tokens=32)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    expected = _token_ids(make_llm(num_scheduler_steps=steps).generate(inputs, params))
    llm = make_llm(num_scheduler_steps=steps, speculative_config=NGRAM)
    assert _token_ids(llm.generate(inputs, params)) == expected
    copier = make_llm(num_scheduler_steps=steps, speculative_config=NGRAM)
    copier.generate(inputs[:1], params)
    assert _rate(copier) > 0.5, copier.engine.core.stats.spec
    # Alone, a row whose suffix is rarely found earlier runs plain decode steps where it finds none.
    chat = make_llm(num_scheduler_steps=steps, speculative_config=NGRAM)
    assert _token_ids(chat.generate(inputs[2:], params)) == expected[2:]
    assert chat.engine.core.stats.spec.num_drafts < 32


@pytest.mark.parametrize("steps", [1, 8])
def test_smollm2_drafting_for_itself_accepts_every_draft(make_llm, smollm2, steps):
    inputs = [{"prompt_token_ids": smollm2.tokenizer.encode(t)} for t in ("Once upon a time,", COPY_TEXT)]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = _token_ids(make_llm(num_scheduler_steps=steps).generate(inputs, params))
    llm = make_llm(num_scheduler_steps=steps, speculative_config={"method": "draft_model", "model": "smollm2",
                                                                   "num_speculative_tokens": 4})
    assert _token_ids(llm.generate(inputs, params)) == expected
    assert _rate(llm) == 1.0


def test_an_unrelated_random_draft_of_the_same_vocabulary_is_almost_never_accepted(make_llm, smollm2):
    inputs = [{"prompt_token_ids": smollm2.tokenizer.encode("The history of the printing press")}]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = _token_ids(make_llm(num_scheduler_steps=8).generate(inputs, params))
    llm = make_llm(num_scheduler_steps=8, speculative_config={"method": "draft_model", "model": "random:smollm2-135m",
                                                               "num_speculative_tokens": 2})
    assert _token_ids(llm.generate(inputs, params)) == expected
    assert _rate(llm) < 0.1, llm.engine.core.stats.spec


# ---- sampling: the target's distribution --------------------------------------------------------
SAMPLES = 600
POSITIONS = 3


def _frequencies(llm, prompt) -> list[collections.Counter]:
    params = [SamplingParams(temperature=1.0, top_k=6, seed=seed, max_tokens=POSITIONS, ignore_eos=True)
              for seed in range(SAMPLES)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLES, params)
    return [collections.Counter(o.outputs[0].token_ids[j] for o in outputs) for j in range(POSITIONS)]


def _max_total_variation(a: list[collections.Counter], b: list[collections.Counter]) -> float:
    return max(sum(abs(x[t] - y[t]) for t in set(x) | set(y)) / (2 * SAMPLES) for x, y in zip(a, b))


# Two empirical distributions of 600 draws over at most 6 tokens differ by about 0.05 in total variation;
# accepting every draft moves a whole position's mass onto the drafted token.
TV_BOUND = 0.12
UNRELATED_DRAFT = {"method": "draft_model", "model": "random:tiny", "seed": 7, "num_speculative_tokens": 2}


def test_rows_without_an_ngram_match_verify_one_position(monkeypatch):
    """A verify forward runs K + 1 positions for the rows that found a match and one for the rest, and the
    greedy tokens stay the target's."""
    from lockstep_engine.runner.steps import Steps

    forwarded, verified = [], []
    real_forward, real_verify = Steps.forward, spec_window.verify

    def forward(self, ids, *args, **kwargs):
        forwarded.append(ids.shape[0])
        return real_forward(self, ids, *args, **kwargs)

    def spy(logits, drafts, q, t, counters, proposed=None):
        found = drafts.shape[0] if proposed is None else int(proposed.sum())
        verified.append((forwarded[-1], drafts.shape[0], drafts.shape[1], found))
        return real_verify(logits, drafts, q, t, counters, proposed)

    monkeypatch.setattr(Steps, "forward", forward)
    monkeypatch.setattr(spec_window, "verify", spy)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    assert _token_ids(_tiny(8, NGRAM).generate(prompts, params)) == _token_ids(_tiny(8).generate(prompts, params))
    for tokens, rows, k, found in verified:
        assert tokens == rows + k * found, (tokens, rows, k, found)
    assert any(0 < found < rows for _, rows, k, found in verified if k), verified  # some steps were ragged

# ---- captured speculative steps (CUDA graphs) ---------------------------------------------------
class _LandedEvent:
    """A host copy that has always landed by the time it is asked about."""

    def record(self):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


def _captured(llm: LLM, device: str) -> LLM:
    """On "cpu-cuda-paths" the CUDA path runs on the CPU: each captured step replayed eagerly on its static
    buffers, its outputs copied into a host ring whose copies have always landed."""
    if device == "cpu-cuda-paths":
        runner = llm.engine.core.executor.runner
        runner.graphs = DecodeGraphs(runner.steps, capture=False)
        runner.host_ring = HostRing(allocate=lambda numel, dtype: torch.empty(numel, dtype=dtype),
                                    event_factory=_LandedEvent)
    return llm


GRAPH_DEVICES = ["cpu-cuda-paths"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", GRAPH_DEVICES)
@pytest.mark.parametrize("steps", [1, 8])
@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT, UNRELATED_DRAFT], ids=["ngram", "self-draft", "unrelated-draft"])
def test_captured_steps_give_the_eager_windows_tokens_and_counts(device, steps, spec, monkeypatch):
    """A window of captured speculative steps (n-gram: every row verifies K + 1 positions; a draft model:
    its K forwards inside the graph), its outputs streamed through the host ring, gives the eager window's
    tokens, finishes and draft counters: greedy, seeded sampling with and without top-p, stop tokens and
    max_tokens inside accepted drafts."""
    if device == "cpu-cuda-paths":  # the draft's CPU backend stands in for a capturable one
        monkeypatch.setattr(DraftModel, "graph_safe", property(lambda self: True))

    def make(**kwargs) -> LLM:
        return LLM("random:tiny", num_scheduler_steps=steps, device=device.removesuffix("-cuda-paths"), dtype="float32",
                   num_gpu_blocks_override=256, speculative_config=spec, **kwargs)

    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS] * 2
    free = _token_ids(make(enforce_eager=True).generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))[0]
    params = ([SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 7, 23, 1, 40)]
              + [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[free[9]])]
              + [SamplingParams(temperature=0.8, seed=s, max_tokens=25, ignore_eos=True) for s in (1, 2)]
              + [SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=25, ignore_eos=True)] * 2)
    eager = make(enforce_eager=True)
    expected = eager.generate(prompts, params)
    captured = _captured(make(), device)
    got = captured.generate(prompts, params)
    assert _token_ids(got) == _token_ids(expected)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    assert got[5].outputs[0].token_ids[-1] == free[9] and got[5].outputs[0].finish_reason == "stop"
    assert captured.engine.core.stats.spec == eager.engine.core.stats.spec
    spec_graphs = captured.engine.core.executor.runner.graphs.spec
    assert spec_graphs is not None and len(spec_graphs.captured) >= 2  # greedy and sampling buckets replayed


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_captured_steps_near_max_model_len_stop_at_it(device):
    """A window's reservation of K + 1 tokens a step reaches past max_model_len (its table is wider than a
    graph's); rows end with "length" at max_model_len with the eager windows' tokens."""
    def make(**kwargs) -> LLM:
        return LLM("random:tiny", num_scheduler_steps=8, device=device.removesuffix("-cuda-paths"), dtype="float32",
                   num_gpu_blocks_override=64, max_model_len=64, speculative_config=NGRAM, **kwargs)

    prompts = [{"prompt_token_ids": (p * 20)[:50]} for p in TINY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    expected = make(enforce_eager=True).generate(prompts, params)
    got = _captured(make(), device).generate(prompts, params)
    assert _token_ids(got) == _token_ids(expected)
    assert all(len(o.outputs[0].token_ids) == 14 and o.outputs[0].finish_reason == "length" for o in got)


@pytest.mark.parametrize("device", GRAPH_DEVICES)
def test_captured_steps_of_a_window_cut_mid_way_keep_the_tokens(device):
    """An arrival cut asked with one captured step in flight ends the window there (three steps here); the
    rows go on in the next windows with the tokens of uncut eager windows, and every block comes back."""
    def make(**kwargs) -> LLM:
        return LLM("random:tiny", num_scheduler_steps=16, device=device.removesuffix("-cuda-paths"), dtype="float32",
                   num_gpu_blocks_override=256, speculative_config=NGRAM, **kwargs)

    lengths = {"a": 40, "b": 29}
    prompts = {"a": TINY_PROMPTS[0], "b": TINY_PROMPTS[1]}
    expected = make(enforce_eager=True).generate([{"prompt_token_ids": prompts[r]} for r in lengths],
                                                 [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                                  for m in lengths.values()])
    core = _captured(make(), device).engine.core
    free = core.blocks.num_free_blocks
    tokens: dict[str, list[int]] = {}

    def emit(step) -> None:
        for output in step.all_outputs():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)

    for request_id, max_tokens in lengths.items():
        core.add_request(Request(request_id, prompts[request_id],
                                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                 core.config.max_model_len, 0))
    windows = []
    while core.has_unfinished() and len(windows) < 100:
        asked = 0

        def should_cut() -> bool:
            nonlocal asked
            asked += 1
            return asked == 3

        windows.append(core.step(emit, should_cut).num_steps)
    assert [tokens["a"], tokens["b"]] == _token_ids(expected)
    assert windows[:-1] == [3] * (len(windows) - 1) and core.stats.num_cut_windows >= len(windows) - 1
    assert core.blocks.num_free_blocks == free
    assert core.executor.runner.graphs.spec.captured  # the windows' speculative steps were replays


def test_a_failed_capture_leaves_the_windows_eager_and_the_tokens_exact(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(spec_window.SpecGraph, "__init__", refuse)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    llm = _captured(_tiny(8, NGRAM), "cpu-cuda-paths")
    assert _token_ids(llm.generate(prompts, params)) == _token_ids(_tiny(8).generate(prompts, params))
    spec_graphs = llm.engine.core.executor.runner.graphs.spec
    assert "not permitted" in spec_graphs.failed and not spec_graphs.captured


def test_captured_steps_are_used_while_their_history_stays_small():
    spec = parse_speculative_config(NGRAM)
    assert spec_window.SpecGraphs.fits(256, 8192, spec) and spec_window.SpecGraphs.fits(512, 32768, spec)
    assert not spec_window.SpecGraphs.fits(256, 200_000, spec)  # 400 MB of history: eager windows instead


@pytest.fixture(scope="module")
def reference_frequencies():
    return _frequencies(_tiny(4, max_num_seqs=128), TINY_PROMPTS[0])


@pytest.mark.parametrize("spec", [NGRAM, UNRELATED_DRAFT], ids=["ngram", "unrelated-draft"])
def test_sampling_keeps_the_targets_distribution(reference_frequencies, spec):
    llm = _tiny(4, spec, max_num_seqs=128)
    got = _frequencies(llm, TINY_PROMPTS[0])
    assert _max_total_variation(got, reference_frequencies) < TV_BOUND
    if spec is NGRAM:
        assert 0 < _rate(llm) < 1  # drafts were both accepted and rejected: the rule was exercised
    # (the unrelated draft's top-6 rarely meets the target's: nearly every draft is rejected, and the
    # tokens come from the residual max(p - q, 0); partial acceptance against a draft distribution is
    # `test_rejection_sampling_against_a_draft_distribution_gives_the_targets`)


def test_rejection_sampling_against_a_draft_distribution_gives_the_targets():
    rows, vocab = 40000, 5
    p = torch.tensor([0.05, 0.15, 0.3, 0.4, 0.1])
    q = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1])
    drafts = torch.multinomial(q, rows, replacement=True, generator=torch.Generator().manual_seed(0)).unsqueeze(1)
    logits = p.log().expand(rows, 2, vocab).contiguous()
    per_position = 2 * rows
    t = SamplingTensors(
        temperature=torch.ones(per_position), top_k=torch.full((per_position,), vocab), top_p=torch.ones(per_position),
        min_p=torch.zeros(per_position), seeds=torch.arange(rows).repeat_interleave(2),
        stop_ids=torch.zeros(per_position, 0, dtype=torch.int64), min_tokens=torch.zeros(per_position, dtype=torch.int64),
        presence=None, frequency=None, repetition=None, prompt_mask=None, logit_bias=None, all_greedy=False,
        any_filter=False, num_logprobs=-1)
    tokens, accepted = verify(logits, drafts, q.expand(rows, 1, vocab), t, torch.zeros(per_position, dtype=torch.int64))
    first = torch.bincount(tokens[:, 0], minlength=vocab) / rows
    assert (first - p).abs().sum() / 2 < 0.01  # the target's distribution
    assert (q - p).abs().sum() / 2 > 0.3  # which the drafts alone are far from
    expected_rate = torch.minimum(p, q).sum()  # P(accept) = sum_x min(p(x), q(x))
    assert abs(accepted.float().mean() - expected_rate) < 0.01


def test_a_broken_acceptance_rule_fails_the_same_bound(reference_frequencies, monkeypatch):
    real_verify = spec_window.verify

    def accept_every_draft(logits, drafts, q, t, counters, proposed=None):
        tokens, _ = real_verify(logits, drafts, q, t, counters, proposed)
        tokens[:, :-1] = drafts
        return tokens, drafts.new_full((drafts.shape[0],), drafts.shape[1])

    monkeypatch.setattr(spec_window, "verify", accept_every_draft)
    got = _frequencies(_tiny(4, NGRAM, max_num_seqs=128), TINY_PROMPTS[0])
    assert _max_total_variation(got, reference_frequencies) > TV_BOUND


def test_seeded_sampling_is_reproducible_with_speculation():
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True)
    first = _token_ids(_tiny(8, NGRAM).generate({"prompt_token_ids": TINY_PROMPTS[0]}, params))
    again = _token_ids(_tiny(1, NGRAM).generate({"prompt_token_ids": TINY_PROMPTS[0]}, params))
    assert first == again


# ---- limits and stops cut the accepted tokens ---------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_is_never_exceeded(max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    expected = _token_ids(_tiny(8).generate(prompts, params))
    outputs = _tiny(8, SELF_DRAFT).generate(prompts, params)
    assert _token_ids(outputs) == expected
    assert all(len(o.outputs[0].token_ids) == max_tokens and o.outputs[0].finish_reason == "length" for o in outputs)


def test_a_stop_token_inside_accepted_drafts_ends_the_row_there():
    prompt = {"prompt_token_ids": TINY_PROMPTS[0]}
    free = _token_ids(_tiny(8).generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))[0]
    stop = free[6]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True)
    [out] = _tiny(8, SELF_DRAFT).generate(prompt, params)
    assert out.outputs[0].token_ids == free[:free.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_stop_strings_and_logprobs_stay_exact_on_smollm2(make_llm, smollm2):
    prompt = {"prompt_token_ids": smollm2.tokenizer.encode(COPY_TEXT)}
    params = SamplingParams(temperature=0, max_tokens=24, stop=["sub"], logprobs=2)
    [plain] = make_llm(num_scheduler_steps=8).generate(prompt, params)
    [spec] = make_llm(num_scheduler_steps=8, speculative_config=NGRAM).generate(prompt, params)
    assert spec.outputs[0].text == plain.outputs[0].text and spec.outputs[0].finish_reason == "stop"
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    for a, b in zip(spec.outputs[0].logprobs, plain.outputs[0].logprobs):
        assert a.token_id == b.token_id and a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-3


def test_prefix_caching_and_chunked_prefill_keep_the_tokens():
    long_prompt = {"prompt_token_ids": list(range(100, 180)) + TINY_PROMPTS[0]}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _token_ids(_tiny(8).generate([long_prompt], params))
    llm = _tiny(8, SELF_DRAFT, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    assert _token_ids(llm.generate([long_prompt], params)) == expected
    assert _token_ids(llm.generate([long_prompt], params)) == expected  # the prompt's blocks come from the cache
    assert llm.engine.core.blocks.prefix_cache_hits > 0
    assert _rate(llm) == 1.0


def test_forked_samples_and_preemption_keep_the_tokens():
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(300, 340))}
    [expected] = _token_ids(_tiny(8).generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    [pair] = _tiny(8, SELF_DRAFT).generate(prompt, params)
    assert [c.token_ids for c in pair.outputs] == [expected, expected]
    # 16 blocks of 16 slots: rows reserving 8 x 4 more tokens per window outgrow them and are preempted
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    plain = _token_ids(_tiny(8, num_gpu_blocks_override=16).generate(prompts, params))
    llm = _tiny(8, SELF_DRAFT, num_gpu_blocks_override=16)
    assert _token_ids(llm.generate(prompts, params)) == plain
    assert llm.engine.core.scheduler.num_preemptions > 0


# ---- what is refused --------------------------------------------------------------------------
@pytest.mark.parametrize("value, words", [
    ('{"method": "ngram", "num_speculative_tokens": 3', "expected a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method='eagle' is not supported"),
    ('{"method": "mtp", "num_speculative_tokens": 1}', "method='mtp' is not supported"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0 is invalid: expected an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "prompt_lookup_min=5 is invalid: expected an integer in [1, 3]"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "speculative_config.model=None is invalid"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}',
     "draft_tensor_parallel_size=2 is invalid"),
    ('{"method": "typo", "num_speculative_tokens": 2}', "method='typo' is invalid: expected one of ngram, draft_model"),
])
def test_bad_speculative_configs_name_the_field(value, words):
    with pytest.raises(ConfigError) as error:
        parse_speculative_config(value)
    assert words in str(error.value)


def test_the_serve_flag_parses_and_refuses(capsys):
    from lockstep_engine.entrypoints import serve

    _, config, _ = serve.parse_args(["random:tiny", "--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 2}'])
    spec = config.speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (2, 5, 5)  # vLLM's
    with pytest.raises(SystemExit) as caught:
        serve.parse_args(["random:tiny", "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'])
    assert caught.value.code == 2
    assert "--speculative-config" in (err := capsys.readouterr().err) and "method='eagle3' is not supported" in err


def test_groups_and_requests_speculation_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="speculative_config is not supported with tensor_parallel_size=2"):
        EngineConfig(model="random:tiny", tensor_parallel_size=2, speculative_config=NGRAM)
    llm = _tiny(8, NGRAM)
    with pytest.raises(ValueError, match="presence_penalty.*not supported with speculative decoding"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(presence_penalty=0.5))
    with pytest.raises(ValueError, match="response_format: guided decoding"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(guided={"choice": ["a", "b"]}))


def test_a_draft_of_another_vocabulary_is_refused_with_both_sizes(make_llm):
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens, the target model 'smollm2' one of 49152"):
        make_llm(speculative_config={"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 2})


def test_the_draft_models_cache_shares_the_kv_memory_budget():
    """A draft model loads before the KV cache is sized, and its cache's bytes per block count: a draft of
    the target's shape halves the blocks a fixed budget buys."""
    budget = 8 << 20
    plain = LLM("random:tiny", device="cpu", kv_cache_memory_bytes=budget)
    drafted = LLM("random:tiny", device="cpu", kv_cache_memory_bytes=budget,
                  speculative_config={"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 2})
    target, with_draft = plain.engine.executor.runner, drafted.engine.executor.runner
    per_block = target._kv_bytes_per_block()
    assert with_draft._kv_bytes_per_block() == 2 * per_block
    assert target.num_blocks == budget // per_block and with_draft.num_blocks == budget // (2 * per_block)
    [draft] = with_draft._drafts.values()
    assert draft.attention_layers()[0].k_cache.shape[0] == with_draft.num_blocks + 1
    out = drafted.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == \
        plain.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
