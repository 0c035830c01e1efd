"""The GPU benchmark scripts' logic, run on the CPU so that a device call is not spent finding their bugs.

benchmarks/gpu_run.py and benchmarks/gpu_parallel_run.py run on an H200 a few times a session; here
their workload accounting, the roofline driver, `--extra-runs` parsing and the TP/PP layout runner
run on `random:tiny` (CUDA synchronisation is a no-op on the CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from lockstep.bench.workload import make_workload
from lockstep.bench.offline import greedy_requests
from lockstep_engine.llm import LLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def gpu_run(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.syspath_prepend(BENCHMARKS)
    spec = importlib.util.spec_from_file_location("gpu_run_under_test", os.path.join(BENCHMARKS, "gpu_run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workload_breakdown_accounts_for_the_wall_time(gpu_run, tiny):
    llm = LLM("random:tiny", share_model_with=tiny, num_scheduler_steps=8, max_num_seqs=64)
    prompts, params = greedy_requests(make_workload("sharegpt-synth", 6, seed=0, vocab_size=1024))
    result = gpu_run.run_workload(llm, prompts, params, "test")
    stats, b = llm.engine.core.stats, result["breakdown"]
    assert result["requests"] == 6 and not llm.engine.has_unfinished_requests()
    assert b["first_step_device_s"] + b["decode_device_s"] == pytest.approx(stats.forward_s)
    assert b["host_s"] == pytest.approx(result["elapsed_s"] - stats.forward_s)
    assert b["decode_device_s"] > 0 and b["first_step_device_s"] > 0
    assert sum(bucket["steps"] for bucket in b["decode_step_by_batch"].values()) == len(stats.decode_step_s)
    assert b["prompt_tokens_computed"] >= sum(map(len, prompts))
    assert result["forced_syncs"] == 0 and result["steps"] == stats.num_steps


def test_roofline_times_decode_steps_with_every_row_present(gpu_run, tiny):
    args = types.SimpleNamespace(model="random:tiny", max_model_len=2048, roofline_context=32)
    rows = gpu_run.roofline(tiny, args, bandwidth=1e11, batches=(1, 8))
    assert [row["batch"] for row in rows] == [1, 8]
    for row in rows:
        # three 16-step windows after admission: each has 15 decode steps, harvested by the next
        assert row["steps_timed"] >= 15
        assert row["context"] > args.roofline_context
        assert row["step_ms"] > 0 and row["ratio"] == pytest.approx(row["step_ms"] / row["roofline_ms"])


def test_extra_runs_override_n_admission_seats_and_policy(gpu_run):
    args = types.SimpleNamespace(max_num_batched_tokens=4096, max_num_seqs=256, scheduling_policy="fcfs")
    assert gpu_run.extra_run("seqs=512,mbt=16384", args) == ("N=8 mbt=16384 seqs=512", 8, 16384, 512, "fcfs")
    assert gpu_run.extra_run("n=auto", args) == ("N=auto mbt=4096 seqs=256", "auto", 4096, 256, "fcfs")
    assert gpu_run.extra_run("policy=lof", args) == ("N=8 mbt=4096 seqs=256 lof", 8, 4096, 256, "lof")
    with pytest.raises(SystemExit, match="'steps=4' is invalid: expected n=, mbt=, seqs= or policy="):
        gpu_run.extra_run("steps=4", args)


def test_parallel_runner_compares_layouts_in_separate_processes(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), LOCKSTEP_CPU_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "engine"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, os.path.join(BENCHMARKS, "gpu_parallel_run.py"), "--model", "random:tiny",
               "--layouts", "1x1", "2x1", "--steps", "8", "--num-prompts", "4", "--max-num-seqs", "16",
               "--timeout", "240"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.load(open(tmp_path / "parallel.json"))
    assert summary["errors"] == {}
    assert set(summary["results"]) == {"TP=1 PP=1 N=8", "TP=2 PP=1 N=8"}
    for result in summary["results"].values():
        assert result["run"]["requests"] == 4 and result["run"]["req_per_s"] > 0
    # fp32 on the CPU: TP=2 gives the single process's greedy tokens exactly
    assert summary["greedy_vs_tp1"]["TP=2 PP=1 N=8"]["identical"] == 64
    assert "TP=2 PP=1 N=8" in done.stdout


def test_greedy_match_compares_backends_steps_fusion_and_graphs(gpu_run, tiny):
    args = types.SimpleNamespace(model="random:tiny", max_model_len=512)
    with pytest.raises(ValueError, match="attention_backend='triton' needs device='cuda'"):
        LLM("random:tiny", share_model_with=tiny, attention_backend="triton")
    gpu_run.FAST_BACKEND = "torch"  # the CPU has no Triton backend: the script's logic, torch against itself
    result = gpu_run.greedy_match(tiny, args)
    assert "error" not in result and result["prompts"] == 64
    # On the CPU in fp32 every variant computes the same numbers (Triton, fusion and graphs are CUDA-only)
    assert result["identical"] == result["triton_n1_vs_n8_identical"] == 64
    assert result["fused_vs_unfused_identical"] == result["graphs_vs_eager_identical"] == 64


def test_prefill_warm_up_leaves_the_timed_prompts_uncached(gpu_run, tiny):
    llm = LLM("random:tiny", share_model_with=tiny, num_scheduler_steps=8, max_num_seqs=64)
    prompts, params = greedy_requests(make_workload("sharegpt-synth", 4, seed=0, vocab_size=1024))
    gpu_run.prefill_warm_up(llm, prompts)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.num_cached_tokens for o in outs] == [0] * 4
    again = llm.generate([{"prompt_token_ids": prompts[0]}], params[0])
    assert again[0].num_cached_tokens > 0  # the check can see a hit: the prefix cache is on


def test_first_divergences_report_position_gap_and_the_near_tie_rule(gpu_run):
    from lockstep_engine.protocol import TokenLogprobs

    def result(tokens, tops):  # a generate() result's fields that the comparison reads
        logprobs = [TokenLogprobs(t, top[0][1], 1, top) for t, top in zip(tokens, tops)] if tops else []
        return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens, logprobs=logprobs)])

    tie = [(5, -0.5), (6, -0.53125)]
    reference = [result([1, 5], [[(1, -0.1), (2, -3.0)], tie]), result([4, 4], [[(4, -0.2), (9, -2.0)]] * 2)]
    other = [result([1, 6], [[(1, -0.1), (2, -3.0)], [(6, -0.5), (5, -0.51)]]), result([4, 4], None)]
    same, found = gpu_run.first_divergences(reference, other)
    assert same == 1
    assert found == [{"prompt": 0, "position": 1, "gap": pytest.approx(0.03125), "cross_top2": True}]
    assert gpu_run.rounded_gaps(found, 16) == [0.03125]
    _, without_logprobs = gpu_run.first_divergences(reference[:1], [result([1, 6], None)])
    assert "cross_top2" not in without_logprobs[0]
