"""Window plans for engine groups as deltas: the leader encodes, each worker keeps mirror sequences.

Pickling a `WindowPlan` sends every row's whole `Sequence` and `Request` (all tokens, siblings,
logprobs) on every window: bytes grow with the total context. Here the leader sends a request once
(prompt, sampling params, seed) and a sequence's tokens once; afterwards a window's message holds
per row only what changed since the last message that carried that sequence, plus the row fields.
Workers apply the deltas to mirror `Request`/`Sequence` objects and get back a real `WindowPlan`, so
the model runner runs it unchanged. A sequence's tokens are assumed to only grow on the leader (the
scheduler and the engine core only append); a list that was replaced or shortened is resent whole.
Plain Python, no torch.

The wire format is JSON (no pickle): a message is data, never code, so a worker decodes nothing but
ints, strings, lists and the fields of `SamplingParams.to_dict`, and checks their types before it
applies them. The group channel (`group/channel.py`) authenticates every message before it gets here.

Leader (one encoder per engine group, for the group's lifetime)::

    encoder = PlanEncoder()
    data = encoder.encode(plan)           # before every window; send `data` to every worker
    data = encoder.encode_releases()      # when the engine goes idle: None or a message

Worker (one decoder per rank)::

    decoder = PlanDecoder()
    plan = decoder.decode(data)           # None for a release-only message: nothing to run
    if plan is not None:
        runner.execute_window(plan, on_step)

Releasing needs no call from the leader: the encoder keeps a reference to each sequence it has
sent, and the first message after that sequence finished (stop, length or abort; its status says
so) tells workers to forget it; a request goes when its last sequence goes. Both sides therefore
hold only sequences that were scheduled at least once and were unfinished at the last message.
Those of the last window before the engine went idle would stay until the next message:
`GroupExecutor.on_idle` sends `encode_releases()` when the engine core has no window to run, which
drops them at once.

Every message carries its number. A decoder accepts only the next one, so a worker that missed a
message, joined late or outlived its leader's encoder raises `PlanCodecError` (a ValueError naming
the sequence and what disagreed) instead of running on stale mirrors. A message that fails to load
changes nothing; one that fails while being applied leaves the decoder refusing every later message,
and an encoder that failed mid-plan refuses to encode again. Recovery is a new group: a fresh
`PlanEncoder` on the leader and a fresh `PlanDecoder` on every worker, started together. The
encoder records each message as delivered: a message it produced must reach every worker.

What the mirrors hold: per request `request_id`, `prompt_token_ids`, `params`, `max_model_len`,
`seed` and `forked` (siblings of an n > 1 request share one mirror `Request`, whose `sequences` are
the mirrored siblings in index order); per sequence `index`, `token_ids`, `block_ids`, and, as of
the latest window, `status` RUNNING, `num_computed` = the row's `start_computed` and its LoRA weight slot
`lora_slot`; a window also carries the LoRA adapters to load into slots before it runs. That is what
the model runner and guided decoding read; a guided matcher set on a mirror sequence stays with it.
Logprobs, prefix-cache hashes and timings stay on the leader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import ScheduledSeq, WindowPlan
from lockstep_engine.sequence import Request, Sequence, SequenceStatus

FORMAT = "lockstep-plan/3"
Key = tuple[str, int]  # (request_id, index of the sequence within its request)


class PlanCodecError(ValueError):
    """A plan message that cannot be encoded or applied; the text names the key and what disagreed."""


# ---- leader -----------------------------------------------------------------------------------
@dataclass
class _SentSequence:
    seq: Sequence
    token_ids: list[int]  # the leader's list object when last sent; a different object forces a resend
    num_tokens: int  # leading tokens the mirror holds
    last_token: int | None  # token_ids[num_tokens - 1] when last sent
    block_ids: list[int]  # copy of the mirror's block list


@dataclass
class _SentRequest:
    request: Request
    forked: bool  # as the mirror has it
    num_sequences: int  # sequences of this request the workers mirror


class _Tracked:
    """What each side keeps per sequence and per request, and how much of it there is."""

    _sequences: dict
    _requests: dict

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def num_requests(self) -> int:
        return len(self._requests)


class PlanEncoder(_Tracked):
    """Leader side: turns each `WindowPlan` into a message of deltas against the workers' mirrors."""

    def __init__(self) -> None:
        self._sequences: dict[Key, _SentSequence] = {}
        self._requests: dict[str, _SentRequest] = {}
        self._next_message: int | None = 0  # None after an error: the mirrors may not match any more

    def encode(self, plan: WindowPlan) -> bytes:
        """The message for one window; every message must reach every worker, in order."""
        number = self._take_number()
        released = self._release_finished()
        new_requests: list[tuple] = []
        forks: list[tuple[str, bool]] = []
        rows = [self._encode_row(row, new_requests, forks) for row in plan.rows]
        return self._message(number, released, new_requests, forks, rows,
                             (plan.num_steps, plan.block_copies, plan.lora_loads))

    def encode_releases(self) -> bytes | None:
        """A message that only forgets finished sequences, or None when there is nothing to forget."""
        if not any(sent.seq.is_finished for sent in self._sequences.values()):
            return None
        number = self._take_number()
        return self._message(number, self._release_finished(), [], [], [], None)

    def _take_number(self) -> int:
        number = self._next_message
        if number is None:
            raise PlanCodecError("an earlier plan failed to encode after its deltas were recorded, so the workers' "
                                 "mirrors no longer match; restart the engine group")
        self._next_message = None  # until the message is complete
        return number

    def _message(self, number: int, released, new_requests, forks, rows, window) -> bytes:
        # Lists of ints and strings (and each new request's parameters as a dict): a window of decodes
        # is about 130 bytes a row (1000-token contexts of Llama 3 ids, 37-character request ids). `window` is
        # (num_steps, block_copies, lora_loads), None for release-only.
        try:
            data = json.dumps([FORMAT, number, released, new_requests, forks, rows, window], separators=(",", ":"),
                              allow_nan=False).encode()
        except (TypeError, ValueError) as error:
            raise PlanCodecError(f"plan message {number} holds a value JSON cannot carry: {error}") from error
        self._next_message = number + 1
        return data

    def _release_finished(self) -> list[Key]:
        released = [key for key, sent in self._sequences.items() if sent.seq.is_finished]
        for key in released:
            del self._sequences[key]
            request = self._requests[key[0]]
            request.num_sequences -= 1
            if not request.num_sequences:
                del self._requests[key[0]]
        return released

    def _encode_row(self, row: ScheduledSeq, new_requests: list[tuple], forks: list[tuple[str, bool]]) -> tuple:
        seq, request = row.seq, row.seq.request
        key = (request.request_id, seq.index)
        sent = self._sequences.get(key)
        is_new = sent is None
        if is_new:
            sent = self._track(key, seq, new_requests)
        elif sent.seq is not seq:
            raise PlanCodecError(f"sequence {key}: two unfinished sequences share this key")
        mirror = self._requests[request.request_id]
        if mirror.forked != request.forked:
            mirror.forked = request.forked
            forks.append((request.request_id, request.forked))
        token_keep, new_tokens = _token_delta(sent)
        block_keep, new_blocks = _block_delta(sent)
        # The layout `PlanDecoder._apply_row` takes.
        return (request.request_id, seq.index, is_new, token_keep, new_tokens, block_keep, new_blocks,
                row.num_new_tokens, row.samples, row.max_steps, row.start_computed, row.remaining_tokens,
                seq.lora_slot)

    def _track(self, key: Key, seq: Sequence, new_requests: list[tuple]) -> _SentSequence:
        request = seq.request
        mirror = self._requests.get(request.request_id)
        if mirror is None:
            mirror = self._requests[request.request_id] = _SentRequest(request, request.forked, 0)
            new_requests.append((request.request_id, request.prompt_token_ids, _params_to_wire(request.params),
                                 request.max_model_len, request.seed, request.forked))
        elif mirror.request is not request:
            raise PlanCodecError(f"sequence {key}: two unfinished requests share request_id {request.request_id!r}")
        mirror.num_sequences += 1
        self._sequences[key] = sent = _SentSequence(seq, seq.token_ids, 0, None, [])
        # A new mirror starts as its prompt, which went with the request: send only the rest.
        prompt = request.prompt_token_ids
        if prompt and seq.token_ids[:len(prompt)] == prompt:
            sent.num_tokens, sent.last_token = len(prompt), prompt[-1]
        return sent


def _token_delta(sent: _SentSequence) -> tuple[int, list[int]]:
    """(tokens the mirror keeps, tokens it appends). Token lists only grow on the leader, so the
    list object, its length and the last token sent are checked, not the whole context."""
    tokens, keep = sent.seq.token_ids, sent.num_tokens
    if tokens is not sent.token_ids or len(tokens) < keep or (keep and tokens[keep - 1] != sent.last_token):
        keep = 0
    sent.token_ids, sent.num_tokens = tokens, len(tokens)
    sent.last_token = tokens[-1] if tokens else None
    return keep, tokens[keep:]


def _block_delta(sent: _SentSequence) -> tuple[int, list[int]]:
    """(blocks the mirror keeps, blocks it appends). Block lists change in place: a copy-on-write
    replaces one, preemption frees them all, so the common prefix is computed (lists are short)."""
    blocks, old = sent.seq.block_ids, sent.block_ids
    keep = len(old)
    if blocks[:keep] != old:
        keep = next((i for i, (a, b) in enumerate(zip(old, blocks)) if a != b), min(len(old), len(blocks)))
    sent.block_ids = list(blocks)
    return keep, blocks[keep:]


# ---- worker -----------------------------------------------------------------------------------
class PlanDecoder(_Tracked):
    """Worker side: applies each message to mirror sequences and returns the window to run."""

    def __init__(self) -> None:
        self._sequences: dict[Key, Sequence] = {}
        self._requests: dict[str, Request] = {}
        self._next_message: int | None = 0  # None after an error: the mirrors cannot be trusted

    def decode(self, data: bytes) -> WindowPlan | None:
        """The window of this message (its sequences are the mirrors), or None for a release-only message."""
        number, body = self._open(data)
        self._next_message = None
        try:
            plan = self._apply(*body)
        except PlanCodecError:
            raise
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as error:
            raise PlanCodecError(f"plan message {number} is malformed: {error!r}") from error
        self._next_message = number + 1
        return plan

    def _open(self, data: bytes) -> tuple[int, tuple]:
        if self._next_message is None:
            raise PlanCodecError("an earlier plan message failed, so this worker's mirrors cannot be trusted; "
                                 "restart the engine group")
        try:
            message = json.loads(data)
        except (ValueError, TypeError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise PlanCodecError(f"plan message is not valid JSON: {error!r}") from error
        if not (isinstance(message, list) and len(message) == 7 and message[0] == FORMAT
                and _is_int(message[1])):
            raise PlanCodecError(f"plan message is not a {FORMAT} message: {str(message)[:80]}")
        if message[1] != self._next_message:
            raise PlanCodecError(f"plan message {message[1]} arrived where {self._next_message} was expected: this "
                                 f"worker missed messages or joined late; restart the engine group")
        return message[1], message[2:]

    def _apply(self, released, new_requests, forks, rows, window) -> WindowPlan | None:
        for key in released:
            self._release(tuple(key))
        for record in new_requests:
            self._add_request(*record)
        for request_id, forked in forks:
            self._mirror_request(request_id, "a fork flag").forked = forked
        scheduled = [self._apply_row(*row) for row in rows]
        for record in new_requests:
            if not self._requests[record[0]].sequences:
                raise PlanCodecError(f"request {record[0]!r} was sent without any of its sequences")
        if window is None:
            return None
        num_steps, block_copies, lora_loads = window
        _check_ints("the window", num_steps, *(b for pair in block_copies for b in pair),
                    *(load[0] for load in lora_loads))
        if not all(len(load) == 3 and isinstance(load[1], str) and isinstance(load[2], str) for load in lora_loads):
            raise PlanCodecError("the window's LoRA loads must be [slot, name, path] each")
        return WindowPlan(rows=scheduled, num_steps=num_steps, block_copies=[(src, dst) for src, dst in block_copies],
                          lora_loads=[(slot, name, path) for slot, name, path in lora_loads])

    def _mirror_request(self, request_id: str, what: str) -> Request:
        request = self._requests.get(request_id)
        if request is None:
            raise PlanCodecError(f"request {request_id!r}: {what} arrived for a request this worker does not mirror")
        return request

    def _release(self, key: Key) -> None:
        seq = self._sequences.pop(key, None)
        if seq is None:
            raise PlanCodecError(f"sequence {key}: released, but this worker does not mirror it")
        request = seq.request
        request.sequences.remove(seq)
        if not request.sequences:
            del self._requests[request.request_id]

    def _add_request(self, request_id, prompt_token_ids, params, max_model_len, seed, forked) -> None:
        if request_id in self._requests:
            raise PlanCodecError(f"request {request_id!r}: sent as new, but this worker already mirrors it")
        _check_ints(f"request {request_id!r}", max_model_len, seed, *prompt_token_ids)
        if not isinstance(request_id, str) or not isinstance(forked, bool):
            raise PlanCodecError(f"request {request_id!r}: the id must be a string and the fork flag a boolean")
        request = Request(request_id, prompt_token_ids, _params_from_wire(request_id, params), max_model_len, seed)
        request.sequences.clear()  # Request() made a first sequence; mirrors are added by key
        request.forked = forked
        self._requests[request_id] = request

    def _add_sequence(self, key: Key) -> Sequence:
        if key in self._sequences:
            raise PlanCodecError(f"sequence {key}: sent as new, but this worker already mirrors it")
        request_id, index = key
        request = self._mirror_request(request_id, f"new sequence {index}")
        seq = Sequence(request=request, token_ids=list(request.prompt_token_ids), index=index)
        position = sum(sibling.index < index for sibling in request.sequences)
        request.sequences.insert(position, seq)
        self._sequences[key] = seq
        return seq

    def _apply_row(self, request_id, index, is_new, token_keep, new_tokens, block_keep, new_blocks,
                   num_new_tokens, samples, max_steps, start_computed, remaining_tokens, lora_slot) -> ScheduledSeq:
        key = (request_id, index)
        _check_ints(f"sequence {key}", index, token_keep, block_keep, num_new_tokens, max_steps, start_computed,
                    remaining_tokens, lora_slot, *new_tokens, *new_blocks)
        if not isinstance(is_new, bool) or not isinstance(samples, bool):
            raise PlanCodecError(f"sequence {key}: the row's flags must be booleans")
        seq = self._add_sequence(key) if is_new else self._sequences.get(key)
        if seq is None:
            raise PlanCodecError(f"sequence {key}: a delta arrived for a sequence this worker does not mirror")
        _apply_delta(key, "token_ids", seq.token_ids, token_keep, new_tokens)
        if 0 <= block_keep < len(seq.block_ids):  # not only appended: a new list (see Sequence.block_ids)
            seq.block_ids = seq.block_ids[:block_keep]
        _apply_delta(key, "block_ids", seq.block_ids, block_keep, new_blocks)
        end = start_computed + num_new_tokens
        if start_computed < 0 or num_new_tokens < 0 or end > seq.num_tokens:
            raise PlanCodecError(f"sequence {key}: the row computes tokens [{start_computed}, {end}) but the "
                                 f"mirror holds {seq.num_tokens}")
        seq.status, seq.num_computed, seq.lora_slot = SequenceStatus.RUNNING, start_computed, lora_slot
        return ScheduledSeq(seq, num_new_tokens, samples, max_steps, start_computed, remaining_tokens)


def _apply_delta(key: Key, field: str, values: list[int], keep: int, new: list[int]) -> None:
    if not 0 <= keep <= len(values):
        raise PlanCodecError(f"sequence {key}: the {field} delta keeps {keep} entries but the mirror holds "
                             f"{len(values)}")
    values[keep:] = new


def _is_int(value) -> bool:
    return type(value) is int  # not bool, not float: JSON keeps the difference


def _check_ints(what: str, *values) -> None:
    if not all(type(value) is int for value in values):
        bad = next(value for value in values if type(value) is not int)
        raise PlanCodecError(f"{what}: expected integers, got {bad!r}")


def _params_to_wire(params: SamplingParams) -> dict:
    """`SamplingParams.to_dict` with logit_bias as [token, bias] pairs: JSON object keys are strings."""
    data = params.to_dict()
    if data["logit_bias"]:
        data["logit_bias"] = [[token, bias] for token, bias in data["logit_bias"].items()]
    return data


def _params_from_wire(request_id: str, data) -> SamplingParams:
    if not isinstance(data, dict):
        raise PlanCodecError(f"request {request_id!r}: the sampling parameters must be an object")
    data = dict(data)
    if data.get("logit_bias"):
        data["logit_bias"] = {token: bias for token, bias in data["logit_bias"]}
    try:
        return SamplingParams.from_dict(data)
    except (TypeError, ValueError) as error:  # SamplingParamsError is a ValueError
        raise PlanCodecError(f"request {request_id!r}: invalid sampling parameters: {error}") from error
