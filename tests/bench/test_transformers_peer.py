"""benchmarks/transformers_peer.py on the CPU, on `random:tiny`: its token accounting, its time limit, its
command line, and that its greedy tokens are lockstep's (the same weights in a transformers model)."""

from __future__ import annotations

import json
import os
import sys
import time
import types

import pytest
import torch

from lockstep.bench.workload import make_workload
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sources import resolve

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def peer():
    sys.path.insert(0, BENCHMARKS)
    try:
        import transformers_peer
    finally:
        sys.path.remove(BENCHMARKS)
    return transformers_peer


@pytest.fixture(scope="module")
def model(peer):
    torch.set_num_threads(1)  # the tests' CPU budget; a tiny model gains nothing from more
    return peer.load_model(resolve("random:tiny"), CPU, torch.float32)


def requests(peer, output_lens: list[int]) -> list:
    """sharegpt-synth's first prompts (random:tiny's vocabulary) with short outputs."""
    workload = make_workload("sharegpt-synth", len(output_lens), seed=0, vocab_size=1024)
    return [peer.Request(i, r.prompt_token_ids, n) for i, (r, n) in enumerate(zip(workload, output_lens))]


def options(batch_size: int, order: str = "arrival") -> types.SimpleNamespace:
    return types.SimpleNamespace(batch_size=batch_size, order=order, cache_implementation="dynamic")


def test_each_request_gets_exactly_its_output_length(peer, model):
    lens = [5, 3, 6, 2, 4]
    batch = requests(peer, lens)
    result = peer.run(model, batch, options(2), CPU, deadline=time.perf_counter() + 120)
    assert [len(r.token_ids) for r in batch] == lens
    assert [len(r.step_times) for r in batch] == lens
    assert not result["partial"] and result["completed"] == 5 and result["batches_run"] == 3
    assert result["total_output_tokens"] == sum(lens)
    # Static batches [5, 3], [6, 2], [4] run to their longest: 5 + 6 + 4 steps; the shorter rows' extra
    # steps are surplus work, not output.
    assert result["steps"] == 15 and result["surplus_tokens"] == 2 + 4
    assert result["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in batch)
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert result["request_throughput"] == pytest.approx(5 / result["duration"])


def test_prompt_length_order_batches_the_longest_prompts_together(peer, model):
    batch = requests(peer, [2, 2, 2, 2])
    groups = peer.batches_of(batch, 2, "prompt-length")
    widths = [[len(r.prompt_token_ids) for r in group] for group in groups]
    assert sorted(sum(widths, []), reverse=True) == sum(widths, [])
    assert [r.index for r in peer.batches_of(batch, 2, "arrival")[0]] == [0, 1]


def test_the_time_limit_ends_the_batch_in_flight_at_its_next_step(peer, model):
    batch = requests(peer, [5, 6])
    assert peer.generate_batch(model, batch, CPU, "dynamic", deadline=time.perf_counter()) == 1
    assert [len(r.token_ids) for r in batch] == [1, 1] and not any(r.complete for r in batch)


def test_past_the_time_limit_no_batch_starts_and_the_result_says_partial(peer, model):
    batch = requests(peer, [5, 6, 7])
    result = peer.run(model, batch, options(2), CPU, deadline=time.perf_counter())
    assert result["partial"] and result["completed"] == result["started"] == result["batches_run"] == 0
    assert result["requests"] == 3 and result["total_output_tokens"] == 0


def test_greedy_tokens_equal_lockstep_generate(peer, model):
    lens = [6, 4, 8]
    batch = requests(peer, lens)
    peer.run(model, batch, options(3), CPU, deadline=time.perf_counter() + 120)  # left padding for two rows
    llm = LLM("random:tiny", num_scheduler_steps=8, num_gpu_blocks_override=64, max_num_seqs=8)
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in batch],
                           [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens])
    assert [r.token_ids for r in batch] == [list(o.outputs[0].token_ids) for o in outputs]


def test_command_line_prints_one_json_line_and_a_table(peer, model, tmp_path, capsys):
    path = tmp_path / "peer.json"
    # Workload seed 239's first request is short (51 prompt, 7 output tokens): a quick whole run.
    assert peer.main(["--model", "random:tiny", "--seed", "239", "--num-prompts", "3", "--max-requests", "1",
                      "--vocab-size", "1024", "--device", "cpu", "--result-json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[0])
    assert result == json.loads(path.read_text())
    assert result["completed"] == 1 and result["total_output_tokens"] == 7 and not result["partial"]
    assert result["model"] == "random:tiny" and result["dtype"] == "float32"
    assert lines[1].startswith("| run | req/s | out tok/s") and "batch 64, arrival order (1)" in lines[3]
