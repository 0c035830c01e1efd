"""A window's first-step inputs, built on the host with numpy and sent to the device in one copy per dtype.

On CUDA every `torch.tensor(list)` is a synchronous host-to-device copy of its own, and the first step
of a window needs about fifteen small per-row tensors: at batch 256, building them from Python lists
one by one kept the GPU idle for milliseconds at every window boundary. Here the per-row fields are
read once per row into numpy arrays (a decode row has one new token: no loop runs over its context),
on CUDA the arrays are packed into one pinned int64 and one float32 host buffer, and each buffer goes
to the device with one non-blocking copy; the runner's tensors are views of the device buffers.

A sequence's sampling constants (seed, stop ids, parameters) are converted once and kept with the
sequence; a window's block table is built from the previous window's (`BlockTables`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, getitem, is_
from typing import NamedTuple

import numpy as np
import torch

from lockstep_engine.sampler import ANY_TOKEN, SamplingTensors, row_seed

_ALIGN = 16  # elements: every packed array starts 128-byte aligned (int64), as a separate allocation would
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Device tensors of host arrays, under the same names: on the CPU the arrays themselves (no copy),
    elsewhere views of one device buffer per dtype (`packed_to_device`)."""
    if device.type == "cpu":
        return {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in arrays.items()}
    return packed_to_device(arrays, device)


def packed_to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Packs the arrays into one host buffer per dtype, copies each buffer to the device at once, and
    returns views of the device buffers under the arrays' names and shapes.

    On CUDA the host buffer is pinned and the copy non-blocking: PyTorch's caching host allocator does
    not hand a pinned block out again before the copies that read it have run.
    """
    groups: dict[np.dtype, list[str]] = {}
    for name, host in arrays.items():
        groups.setdefault(host.dtype, []).append(name)
    views = {}
    for dtype, names in groups.items():
        offsets = [0]
        for name in names:
            offsets.append(offsets[-1] + -(-arrays[name].size // _ALIGN) * _ALIGN)
        staging = torch.empty(offsets[-1], dtype=_TORCH_DTYPES[dtype], pin_memory=device.type == "cuda")
        flat = staging.numpy()
        for name, offset in zip(names, offsets):
            flat[offset:offset + arrays[name].size] = arrays[name].ravel()
        on_device = staging.to(device, non_blocking=True)
        for name, offset in zip(names, offsets):
            array = arrays[name]
            views[name] = on_device[offset:offset + array.size].view(array.shape)
    return views


def pad_rows(lists: list, fill: int) -> np.ndarray:
    """[len(lists), longest] int64 from ragged rows of ints, padded on the right with `fill`."""
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    table = np.full((len(lists), int(lengths.max(initial=0))), fill, np.int64)
    # The mask's true cells, in row-major order, are exactly the rows' entries in order.
    table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(chain.from_iterable(lists), np.int64,
                                                                     int(lengths.sum()))
    return table


_start = attrgetter("start_computed")
_num_new = attrgetter("num_new_tokens")
_samples = attrgetter("samples")
_seq = attrgetter("seq")
_max_steps = attrgetter("max_steps")
_remaining = attrgetter("remaining_tokens")
_prompt_ids = attrgetter("seq.request.prompt_token_ids")
_token_ids = attrgetter("seq.token_ids")
_num_pending = attrgetter("seq.num_pending")
_lora_slot = attrgetter("seq.lora_slot")


class BlockTables:
    """Builds each window's [rows, max_blocks] block table from the previous window's.

    Converting every row's block ids (Python ints) to int64 at every window boundary cost about 0.3 ms
    at batch 256, nearly all of it for blocks that had not changed. A sequence's `block_ids` list is
    only ever appended to (any other change assigns a new list: `Sequence.block_ids`), so a row found in
    the previous table under the same list object keeps that row, and only the blocks appended since are
    read. Tables are never written once built (an earlier window's tensors may be views of one).
    """

    def __init__(self, sink_block: int):
        self.sink_block = sink_block
        self._index: dict = {}  # sequence -> its row in the previous table
        self._lists: list = []  # the previous rows' block lists (the objects themselves)
        self._lengths = np.zeros(0, np.int64)
        self._table = np.zeros((0, 0), np.int64)

    def build(self, rows) -> np.ndarray:
        """`rows`' block table, padded with the sink block."""
        num_rows = len(rows)
        seqs = list(map(_seq, rows))
        lists = [seq.block_ids for seq in seqs]
        lengths = np.fromiter(map(len, lists), np.int64, num_rows)
        table = np.full((num_rows, int(lengths.max(initial=0))), self.sink_block, np.int64)
        first = np.zeros(num_rows, np.int64)  # the first entry each row reads from its list
        previous = np.fromiter(map(self._index.get, seqs, repeat(-1)), np.int64, num_rows)
        if self._lists:
            # A row new to the table gets the previous table's last list here, never its own.
            same = np.fromiter(map(is_, lists, map(self._lists.__getitem__, previous.tolist())), bool, num_rows)
            kept = np.flatnonzero(same)
            old = previous[kept]
            width = min(table.shape[1], self._table.shape[1])
            table[kept, :width] = self._table[old, :width]
            first[kept] = self._lengths[old]
        grown = np.flatnonzero(lengths > first)
        if grown.size:
            starts, counts = first[grown], lengths[grown] - first[grown]
            total = int(counts.sum())
            fresh = np.fromiter(chain.from_iterable(map(getitem, map(lists.__getitem__, grown.tolist()),
                                                        map(slice, starts.tolist(), repeat(None)))), np.int64, total)
            # Entry k of `fresh` goes to row grown[i], column starts[i] + (k - its offset in `fresh`).
            row = np.repeat(grown, counts)
            shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
            table[row, shift + np.arange(total)] = fresh
        self._index = dict(zip(seqs, range(num_rows)))
        self._lists, self._lengths, self._table = lists, lengths, table
        return table


def first_step_arrays(rows, block_size: int, sink_block: int, tables: BlockTables | None = None) -> dict[str, np.ndarray]:
    """Host arrays of a window's first step. Tokens of all rows are flattened in row order.

    input_ids, positions, slots: [tokens]; query_start: [rows + 1]; seq_lens: [rows] after step 1;
    block_table: [rows, max_blocks] padded with the sink block (from `tables` when given); sample_index
    (flattened index of each sampling row's last token), sample_sel (its row), num_generated, max_steps,
    budget (tokens it may still sample before max_tokens or max_model_len end it): [sampling rows].
    lora_tokens [tokens] and lora_rows [sampling rows]: LoRA weight slots, only when a row has an adapter.
    Rows whose sequence has a token pending on the device (`Sequence.num_pending`) are carried: they are
    decode rows, and carry_token / carry_sample [carried rows] say where their device tokens go.
    """
    num_rows = len(rows)
    start = np.fromiter(map(_start, rows), np.int64, num_rows)
    num_new = np.fromiter(map(_num_new, rows), np.int64, num_rows)
    sample_sel = np.flatnonzero(np.fromiter(map(_samples, rows), bool, num_rows))
    query_start = np.zeros(num_rows + 1, np.int64)
    np.cumsum(num_new, out=query_start[1:])
    num_tokens = int(query_start[-1])
    if tables is not None:
        block_table = tables.build(rows)
    else:
        block_table = pad_rows([row.seq.block_ids for row in rows], sink_block)
    carried = np.flatnonzero(np.fromiter(map(_num_pending, rows), bool, num_rows))
    if num_tokens == num_rows and not carried.size:  # decode rows only: one token each, the sequence's last
        input_ids = np.fromiter(map(getitem, map(_token_ids, rows), start.tolist()), np.int64, num_rows)
        token_row = np.arange(num_rows)
        positions = start
    else:
        # A carried row's one token is still on the device (0 here: `carry_index` says where it goes).
        input_ids = np.fromiter(chain.from_iterable(
            row.seq.token_ids[row.start_computed:row.start_computed + row.num_new_tokens] or (0,) for row in rows),
            np.int64, num_tokens)
        token_row = np.repeat(np.arange(num_rows), num_new)
        positions = start[token_row] + np.arange(num_tokens) - query_start[token_row]
    slots = block_table[token_row, positions // block_size] * block_size + positions % block_size
    seq_lens = start + num_new
    sampling_rows = rows if sample_sel.size == num_rows else [rows[i] for i in sample_sel.tolist()]
    count = len(sampling_rows)
    # A sampling row's tokens end where its step 1 ends: its outputs so far are seq_lens - prompt length.
    prompt_lens = np.fromiter(map(len, map(_prompt_ids, sampling_rows)), np.int64, count)
    arrays = {
        "input_ids": input_ids, "positions": positions, "slots": slots, "query_start": query_start,
        "seq_lens": seq_lens, "block_table": block_table,
        "sample_index": query_start[1:][sample_sel] - 1, "sample_sel": sample_sel,
        "num_generated": seq_lens[sample_sel] - prompt_lens,
        "max_steps": np.fromiter(map(_max_steps, sampling_rows), np.int64, count),
        "budget": np.fromiter(map(_remaining, sampling_rows), np.int64, count),
    }
    lora = np.fromiter(map(_lora_slot, rows), np.int64, num_rows)
    if lora.any():  # LoRA weight slots: per token, and per sampling row for the decode steps (0: the base model)
        arrays["lora_tokens"] = lora[token_row]
        arrays["lora_rows"] = lora[sample_sel]
    if carried.size:
        # Where each carried row's token goes: its flattened token index, and its index among the sampling
        # rows (whose device state starts from the previous window's: `Steps.first_step`).
        arrays["carry_token"] = query_start[carried]
        arrays["carry_sample"] = np.searchsorted(sample_sel, carried)
    return arrays


class PromptRows(NamedTuple):
    """Step-1 tokens whose logits give prompt logprobs, and the rows they belong to."""

    rows: list[tuple[int, int, int]]  # (plan row index, first position, number of positions)
    k: int  # the largest prompt_logprobs of those rows
    arrays: dict[str, np.ndarray]  # prompt_index: flattened token index; prompt_targets: the token it predicts


def prompt_logprob_rows(rows, query_start: np.ndarray, sample_sel: np.ndarray) -> PromptRows | None:
    """The step-1 positions of rows that asked for prompt logprobs: each position of the row's chunk
    before the prompt's last token (whose logits sample the first output). A sequence that already has
    outputs (recomputed after a preemption) delivered its prompt logprobs before."""
    # Only prompt chunks can predict prompt tokens: a sampling row of one token is a decode (or the
    # prompt's last token), so the mixed windows' decode rows are skipped without a look at their request.
    chunk = np.ones(len(rows), bool)
    chunk[sample_sel] = False
    chunk |= np.diff(query_start) > 1
    picked, k = [], 0
    for index in np.flatnonzero(chunk).tolist():
        row = rows[index]
        seq = row.seq
        want = seq.request.params.prompt_logprobs
        if want is None:
            continue
        end = min(row.start_computed + row.num_new_tokens, seq.prompt_len - 1)
        if row.start_computed < end and len(seq.token_ids) == seq.prompt_len:
            picked.append((index, row.start_computed, end - row.start_computed))
            k = max(k, want)
    if not picked:
        return None
    flat = np.concatenate([query_start[index] + np.arange(count) for index, _, count in picked])
    targets = np.fromiter(chain.from_iterable(rows[index].seq.token_ids[start + 1:start + 1 + count]
                                              for index, start, count in picked), np.int64, flat.size)
    return PromptRows(picked, k, {"prompt_index": flat, "prompt_targets": targets})


class RowSampling(NamedTuple):
    """What a sequence's sampling rows carry, fixed for the sequence's lifetime."""

    ints: bytes  # int64 top_k (vocab size when off), seed, min_tokens
    floats: bytes  # float32 temperature (0 for greedy), top_p, min_p
    stop_ids: tuple[int, ...]  # EOS (unless ignore_eos) and stop_token_ids, sorted
    stop_bytes: bytes  # stop_ids as int64
    filtered: bool  # top-k/top-p/min-p apply (a sampled row with a filter)
    num_logprobs: int  # -1: no logprobs
    penalties: tuple[float, float, float] | None  # presence, frequency, repetition
    logit_bias: dict[int, float] | None
    bad_words: list[tuple[int, ...]]  # bad words of several tokens (one-token ones are in logit_bias)
    plain: bool  # none of filtered, logprobs, penalties, logit_bias, bad_words: a window of such rows skips their flags


_INT_FIELDS = ("top_k", "seeds", "min_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p")
_ints, _floats, _stop_bytes, _plain = (attrgetter(name) for name in ("ints", "floats", "stop_bytes", "plain"))


class SamplingCache:
    """`RowSampling` per sequence, computed on a sequence's first window and kept with the sequence
    (`Sequence.sampling_row`: an attribute read per row and window, where a weak dictionary's lookup
    cost ten times more; a sequence runs on one runner)."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    def get(self, seq) -> RowSampling:
        row = seq.sampling_row
        if row is None:
            row = seq.sampling_row = self._build(seq)
        return row

    def get_all(self, seqs) -> list[RowSampling]:
        rows = [seq.sampling_row for seq in seqs]
        if None in rows:
            rows = list(map(self.get, seqs))
        return rows

    def _build(self, seq) -> RowSampling:
        p = seq.request.params
        ints = (p.top_k if p.top_k > 0 else self.vocab_size, row_seed(seq.request.seed, seq.index), p.min_tokens)
        floats = (0.0 if p.is_greedy else p.temperature, p.top_p, p.min_p)
        stop_ids = tuple(sorted(set(p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids))))
        filtered = p.needs_filtering and not p.is_greedy
        num_logprobs = -1 if p.logprobs is None else p.logprobs
        penalties = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) if p.has_penalties else None
        logit_bias = p.masked_logit_bias(self.vocab_size)  # allowed_token_ids and one-token bad words at -inf
        bad_words = p.multi_token_bad_words
        return RowSampling(
            ints=array("q", ints).tobytes(), floats=array("f", floats).tobytes(), stop_ids=stop_ids,
            stop_bytes=array("q", stop_ids).tobytes(), filtered=filtered, num_logprobs=num_logprobs,
            penalties=penalties, logit_bias=logit_bias, bad_words=bad_words,
            plain=not filtered and num_logprobs < 0 and penalties is None and logit_bias is None and not bad_words)


@dataclass
class HostSampling:
    """The sampling rows' parameters on the host: arrays for `to_device`, flags for `SamplingTensors`."""

    arrays: dict[str, np.ndarray]
    all_greedy: bool
    any_filter: bool
    num_logprobs: int
    penalties: bool
    biases: bool
    bad_words: bool = False


def sampling_arrays(sampling_rows, cache: SamplingCache) -> HostSampling:
    """temperature, top_p, min_p (float32), top_k, seeds, min_tokens: [rows]; stop_ids: [rows, S] padded with
    -1. With penalties: presence, frequency, repetition [rows], and the (row, token) pairs of the prompt
    masks and output counts; with logit bias: its (row, token, bias) entries; with bad words of several
    tokens: `bad_word_arrays`."""
    seqs = list(map(_seq, sampling_rows))
    params = cache.get_all(seqs)
    count = len(params)
    # [fields, rows], one contiguous (and writable) row per field
    ints = np.frombuffer(b"".join(map(_ints, params)), np.int64).reshape(count, len(_INT_FIELDS)).T.copy()
    floats = np.frombuffer(b"".join(map(_floats, params)), np.float32).reshape(count, len(_FLOAT_FIELDS)).T.copy()
    arrays = dict(zip(_INT_FIELDS, ints)) | dict(zip(_FLOAT_FIELDS, floats))
    stops = list(map(_stop_bytes, params))
    if len(set(map(len, stops))) == 1:  # every row has as many stop ids: no padding
        arrays["stop_ids"] = np.frombuffer(b"".join(stops), np.int64).reshape(count, len(stops[0]) // 8).copy()
    else:
        arrays["stop_ids"] = pad_rows([p.stop_ids for p in params], -1)
    all_greedy = not arrays["temperature"].any()
    if all(map(_plain, params)):
        return HostSampling(arrays, all_greedy, any_filter=False, num_logprobs=-1, penalties=False, biases=False)
    penalties = any(p.penalties is not None for p in params)
    if penalties:
        values = np.array([p.penalties or (0.0, 0.0, 1.0) for p in params], np.float32).reshape(count, 3)
        arrays.update(presence=values[:, 0], frequency=values[:, 1], repetition=values[:, 2])
        arrays.update(_row_token_pairs("prompt", [seq.token_ids[:seq.prompt_len] for seq in seqs]))
        arrays.update(_row_token_pairs("output", [seq.token_ids[seq.prompt_len:] for seq in seqs]))
    biases = any(p.logit_bias for p in params)
    if biases:
        maps = [p.logit_bias or {} for p in params]
        arrays.update(_row_token_pairs("bias", [list(m) for m in maps]))
        arrays["bias_values"] = np.fromiter(chain.from_iterable(m.values() for m in maps), np.float32,
                                            arrays["bias_tokens"].size)
    bad_words = any(p.bad_words for p in params)
    if bad_words:
        arrays.update(bad_word_arrays([p.bad_words for p in params], seqs))
    return HostSampling(arrays, all_greedy, any_filter=any(p.filtered for p in params),
                        num_logprobs=max((p.num_logprobs for p in params), default=-1), penalties=penalties,
                        biases=biases, bad_words=bad_words)


def bad_word_arrays(words_by_row: list[list[tuple[int, ...]]], seqs) -> dict[str, np.ndarray]:
    """The window's bad words of several tokens, one entry per (row, word): bad_rows, bad_last [words];
    bad_prefix [words, H] the tokens before the last, right-aligned, ANY_TOKEN before a shorter word's
    first; and recent [rows, H], each row's last H outputs so far, right-aligned, -1 before its first
    (no token matches it: a word is banned only after all its other tokens were generated, as vLLM).
    H is the longest prefix. The window appends each sampled token to `recent` on the device."""
    entries = [(row, word) for row, words in enumerate(words_by_row) for word in words]
    width = max(len(word) - 1 for _, word in entries)
    prefix = np.full((len(entries), width), ANY_TOKEN, np.int64)
    for index, (_, word) in enumerate(entries):
        prefix[index, width - len(word) + 1:] = word[:-1]
    recent = np.full((len(seqs), width), -1, np.int64)
    for row, seq in enumerate(seqs):
        outputs = seq.token_ids[max(seq.prompt_len, len(seq.token_ids) - width):]
        if outputs:
            recent[row, width - len(outputs):] = outputs
    return {"bad_rows": np.fromiter((row for row, _ in entries), np.int64, len(entries)),
            "bad_last": np.fromiter((word[-1] for _, word in entries), np.int64, len(entries)),
            "bad_prefix": prefix, "recent": recent}


def _row_token_pairs(prefix: str, lists: list) -> dict[str, np.ndarray]:
    """`{prefix}_rows`, `{prefix}_tokens`: every (row, token) of ragged per-row token lists, flattened."""
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    tokens = np.fromiter(chain.from_iterable(lists), np.int64, int(lengths.sum()))
    return {f"{prefix}_rows": np.repeat(np.arange(len(lists)), lengths), f"{prefix}_tokens": tokens}


def sampling_tensors(host: HostSampling, views: dict[str, torch.Tensor], num_rows: int, vocab_size: int,
                     device: torch.device) -> SamplingTensors:
    """The window's `SamplingTensors` from the device views of `sampling_arrays`' arrays."""
    t = SamplingTensors(
        temperature=views["temperature"], top_k=views["top_k"], top_p=views["top_p"], min_p=views["min_p"],
        seeds=views["seeds"], stop_ids=views["stop_ids"], min_tokens=views["min_tokens"],
        presence=views.get("presence"), frequency=views.get("frequency"), repetition=views.get("repetition"),
        prompt_mask=None, logit_bias=None, all_greedy=host.all_greedy, any_filter=host.any_filter,
        num_logprobs=host.num_logprobs)
    if host.penalties:
        t.prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        t.prompt_mask[views["prompt_rows"], views["prompt_tokens"]] = True
    if host.biases:
        t.logit_bias = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        t.logit_bias[views["bias_rows"], views["bias_tokens"]] = views["bias_values"]
    if host.bad_words:
        t.bad_rows, t.bad_last, t.bad_prefix = views["bad_rows"], views["bad_last"], views["bad_prefix"]
    return t


def output_counts(views: dict[str, torch.Tensor], num_rows: int, vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each sampling row's output so far."""
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    rows, tokens = views["output_rows"], views["output_tokens"]
    counts.index_put_((rows, tokens), torch.ones(tokens.shape[0], dtype=torch.float32, device=device),
                      accumulate=True)
    return counts
