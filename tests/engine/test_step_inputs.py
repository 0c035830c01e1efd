"""A window's first-step inputs on the host (numpy) and their one-copy-per-dtype transfer, on plain data."""

import numpy as np
import torch

from lockstep_engine.sampler import row_seed
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import ScheduledSeq
from lockstep_engine.sequence import Request
from lockstep_engine.runner.step_inputs import (SamplingCache, first_step_arrays, packed_to_device, pad_rows,
                                         sampling_arrays, to_device)

BLOCK_SIZE = 4
SINK_BLOCK = 99


def _row(tokens, block_ids, start, num_new, samples, max_steps=0, params=None, num_prompt=None):
    request = Request("r", list(tokens[:num_prompt or len(tokens)]), params or SamplingParams(), 512, seed=5)
    seq = request.sequences[0]
    seq.token_ids, seq.block_ids, seq.num_computed = list(tokens), list(block_ids), start
    return ScheduledSeq(seq, num_new, samples, max_steps, start, seq.remaining_tokens if samples else 0)


def _mixed_rows():
    return [
        _row(range(100, 110), [7, 3, 8], 0, 6, False),  # a prefill chunk: tokens 0..5, samples nothing yet
        _row(range(200, 213), [1, 2, 4, 5], 9, 4, True, max_steps=3),  # the last prefill chunk, then decodes
        _row(range(300, 306), [6, 9], 5, 1, True, max_steps=8, num_prompt=3),  # a decode row
    ]


def test_pad_rows_pads_ragged_rows_on_the_right():
    assert pad_rows([[1, 2, 3], [], [4]], -1).tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]]
    assert pad_rows([(), ()], 0).shape == (2, 0)


def test_first_step_arrays_match_the_rows_token_by_token():
    rows = _mixed_rows()
    host = first_step_arrays(rows, BLOCK_SIZE, SINK_BLOCK)
    tokens = [(row, p) for row in rows for p in range(row.start_computed, row.start_computed + row.num_new_tokens)]
    assert host["input_ids"].tolist() == [row.seq.token_ids[p] for row, p in tokens]
    assert host["positions"].tolist() == [p for _, p in tokens]
    assert host["slots"].tolist() == [row.seq.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                      for row, p in tokens]
    assert host["query_start"].tolist() == [0, 6, 10, 11]
    assert host["seq_lens"].tolist() == [6, 13, 6]
    assert host["block_table"].tolist() == [[7, 3, 8, 99], [1, 2, 4, 5], [6, 9, 99, 99]]
    assert host["sample_index"].tolist() == [9, 10] and host["sample_sel"].tolist() == [1, 2]
    assert host["num_generated"].tolist() == [0, 3] and host["max_steps"].tolist() == [3, 8]


def test_decode_only_rows_take_one_token_each():
    rows = [_row(range(10 * i, 10 * i + 7), [i, 10 + i], 6, 1, True, max_steps=4) for i in range(3)]
    host = first_step_arrays(rows, BLOCK_SIZE, SINK_BLOCK)
    assert host["input_ids"].tolist() == [6, 16, 26]
    assert host["slots"].tolist() == [(10 + i) * BLOCK_SIZE + 2 for i in range(3)]


def test_packed_to_device_gives_views_of_one_buffer_per_dtype():
    arrays = {"a": np.arange(5), "b": np.array([[1, 2], [3, 4]]), "c": np.array([0.5, 1.5], np.float32),
              "empty": np.zeros((3, 0), np.int64), "d": np.array([7])}
    views = packed_to_device(arrays, torch.device("cpu"))
    for name, array in arrays.items():
        assert views[name].shape == array.shape and views[name].tolist() == array.tolist()
    assert views["a"].dtype == torch.int64 and views["c"].dtype == torch.float32
    assert views["a"].untyped_storage().data_ptr() == views["d"].untyped_storage().data_ptr()


def test_to_device_on_the_cpu_shares_the_arrays():
    array = np.arange(4)
    assert to_device({"x": array}, torch.device("cpu"))["x"].data_ptr() == array.ctypes.data


def test_sampling_arrays_carry_each_sequence_parameters_and_reuse_them():
    greedy = SamplingParams(temperature=0, stop_token_ids=[9, 4], max_tokens=8)
    sampled = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, min_tokens=2, ignore_eos=True,
                             logprobs=3, presence_penalty=0.5, logit_bias={3: 1.5})
    rows = [_row(range(6), [0, 1], 5, 1, True, 4, params=greedy),
            _row(range(8), [2, 3], 7, 1, True, 4, params=sampled, num_prompt=6)]
    cache = SamplingCache(vocab_size=50, eos_token_ids=(2,))
    host = sampling_arrays(rows, cache)
    arrays = host.arrays
    assert arrays["temperature"].tolist() == [0.0, np.float32(0.7)]
    assert arrays["top_k"].tolist() == [50, 5] and arrays["min_tokens"].tolist() == [0, 2]
    assert arrays["top_p"].tolist() == [1.0, np.float32(0.9)] and arrays["min_p"].tolist() == [0.0, np.float32(0.1)]
    assert arrays["seeds"].tolist() == [row_seed(5, 0)] * 2
    assert arrays["stop_ids"].tolist() == [[2, 4, 9], [-1, -1, -1]]
    assert arrays["presence"].tolist() == [0.0, 0.5] and arrays["repetition"].tolist() == [1.0, 1.0]
    assert arrays["output_rows"].tolist() == [1, 1] and arrays["output_tokens"].tolist() == [6, 7]
    assert arrays["bias_rows"].tolist() == [1] and arrays["bias_tokens"].tolist() == [3]
    assert not host.all_greedy and host.any_filter and host.num_logprobs == 3 and host.penalties and host.biases
    assert cache.get(rows[0].seq) is cache.get(rows[0].seq)
