"""A window's first step with prompt tokens as one replay of its token bucket's graph
(runner/prefill_graphs.py): the step's tokens padded to the bucket, its sequences to max_seqs, its block
table to max_model_len's width. On the CPU `capture_graphs=False` runs each replay's operations directly on
the static buffers, so the padding and loading are checked against eager steps; on CUDA the graphs are
captured for real with the Triton backend."""

import gc
import random
from dataclasses import replace

import pytest
import torch

from lockstep_engine.llm import LLM
from lockstep_engine.runner.prefill_graphs import PrefillGraphs, token_buckets
from lockstep_engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
COMMON = dict(num_gpu_blocks_override=256, max_num_seqs=8, max_num_batched_tokens=320, dtype="float32")


def _workload(seed: int = 3, count: int = 12):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 250) for _ in range(40)]  # a prefix some prompts share (prefix-cache hits)
    prompts = []
    for i in range(count):
        own = [rng.randrange(1, 250) for _ in range(rng.randrange(2, 300))]
        prompts.append({"prompt_token_ids": (shared + own) if i % 3 == 0 else own})
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), ignore_eos=True) for _ in range(count)]
    return prompts, params


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def _graphed(llm: LLM, monkeypatch) -> list:
    """Puts prefill graphs on the runner (captured on CUDA, replayed eagerly on the CPU); returns the token
    counts of the steps they ran."""
    runner = llm.engine.executor.runner
    if runner.device.type == "cuda":
        monkeypatch.setattr(runner, "config", replace(runner.config, prefill_cuda_graphs="on"))
        assert runner.use_prefill_graphs(print) == len(runner.prefill_graphs.buckets)
    else:
        config = llm.engine.config
        runner.prefill_graphs = PrefillGraphs(runner.steps, config.max_num_batched_tokens, config.max_num_seqs,
                                              capture_graphs=False)
    ran = []
    forward = runner.prefill_graphs.forward
    monkeypatch.setattr(runner.prefill_graphs, "forward", lambda first: ran.append(first.input_ids.shape[0])
                        or forward(first))
    return ran


def test_token_buckets_cover_the_budget_in_steps():
    assert token_buckets(8192) == [16, 32, 64, 128, 256] + list(range(512, 8193, 512))
    assert token_buckets(640) == [16, 32, 64, 128, 256, 512, 640]
    assert token_buckets(100) == [16, 32, 64, 100]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("steps", [1, 8])
def test_replayed_first_steps_give_the_eager_tokens(device, steps, monkeypatch):
    prompts, params = _workload()
    eager = _tokens(LLM("random:tiny", device=device, num_scheduler_steps=steps, enforce_eager=True, **COMMON),
                    prompts, params)
    llm = LLM("random:tiny", device=device, num_scheduler_steps=steps, **COMMON)
    ran = _graphed(llm, monkeypatch)
    assert _tokens(llm, prompts, params) == eager
    # Chunked prompts, several prompts per step, prompts beside decode rows: many token counts, padded.
    assert len(ran) >= 4 and len(set(ran)) >= 3 and max(ran) <= 320, ran
    assert any(n not in token_buckets(320) for n in ran)  # padded to a larger bucket
    assert [len(t) for t in eager] == [p.max_tokens for p in params]


def test_steps_the_graphs_cannot_hold_stay_eager():
    llm = LLM("random:tiny", device="cpu", **COMMON)
    runner, config = llm.engine.executor.runner, llm.engine.config
    graphs = PrefillGraphs(runner.steps, 64, config.max_num_seqs, capture_graphs=False)

    class First:
        def __init__(self, tokens, seqs, query_start=True, lora=None):
            self.input_ids = torch.zeros(tokens, dtype=torch.int64)
            self.meta = type("Meta", (), {"query_start_loc": torch.zeros(seqs + 1) if query_start else None,
                                          "seq_lens": torch.zeros(seqs), "lora_slots": lora})()

    assert graphs.usable(First(tokens=40, seqs=3))
    assert not graphs.usable(First(tokens=65, seqs=3))  # past the largest bucket (the 64-token budget)
    assert not graphs.usable(First(tokens=40, seqs=9))  # more sequences than max_num_seqs
    assert not graphs.usable(First(tokens=4, seqs=4, query_start=False))  # decode rows only: the decode graphs
    assert not graphs.usable(First(tokens=40, seqs=3, lora=torch.zeros(40)))  # adapters among the rows
    assert not runner.prefill_graphs_possible()  # the CPU: no CUDA graphs
    assert runner.use_prefill_graphs(print) == 0 and runner.prefill_graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="timing a replay needs a CUDA device")
def test_auto_uses_the_graphs_when_a_replay_is_at_most_half_the_eager_step():
    llm = LLM("random:tiny", **COMMON)
    runner = llm.engine.executor.runner
    graphs = PrefillGraphs(runner.steps, 320, 8, runner.graphs.pool)
    wins, eager_ms, replay_ms = graphs.launch_bound()
    assert eager_ms > 0 and replay_ms > 0
    assert wins == (replay_ms <= 0.5 * eager_ms)
    assert wins  # a 2-layer model's eager step is kernel launches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the graph pool is CUDA's")
def test_decode_graphs_capture_after_auto_leaves_the_prefill_graphs_unused(monkeypatch):
    """The probe's graph shares the decode graphs' pool: when auto does not use the prefill graphs, the decode
    windows the warm-up captures next still capture into that pool (a freed probe left it unusable)."""
    from lockstep_engine.runner import prefill_graphs

    prompts, params = _workload(seed=7, count=6)
    llm = LLM("random:tiny", **COMMON)
    runner = llm.engine.executor.runner
    assert not runner.graphs.graphs  # the probe is the pool's first capture, as in the warm-up
    monkeypatch.setattr(prefill_graphs, "WIN_RATIO", 0.0)  # no replay wins
    logged = []
    assert runner.use_prefill_graphs(logged.append) == 0 and runner.prefill_graphs is None
    assert len(logged) == 1 and logged[0].endswith("not used (the eager step is device time)")
    gc.collect()
    tokens = _tokens(llm, prompts, params)
    assert runner.graphs.graphs and all(tokens)


def test_on_captures_every_bucket_and_a_failed_capture_leaves_the_first_steps_eager(monkeypatch):
    """`use_prefill_graphs` as the warm-up calls it, on the CPU's emulated graphs: "on" takes every bucket and the
    tokens stay the eager ones; a capture that raises is logged and the first steps run eagerly."""
    from lockstep_engine.runner import prefill_graphs
    from lockstep_engine.runner.cuda_graphs import DecodeGraphs

    prompts, params = _workload(seed=5, count=6)
    llm = LLM("random:tiny", device="cpu", **COMMON)
    eager = _tokens(llm, prompts, params)
    runner = llm.engine.executor.runner
    runner.graphs = DecodeGraphs(runner.steps, capture=False)
    monkeypatch.setattr(runner.backend, "prefill_graph_safe", True, raising=False)
    monkeypatch.setattr(runner, "config", replace(runner.config, prefill_cuda_graphs="on"))
    logged = []
    assert runner.use_prefill_graphs(logged.append) == len(token_buckets(320)) and not logged
    assert _tokens(llm, prompts, params) == eager

    runner.prefill_graphs = None

    def fail(self):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(prefill_graphs.PrefillGraphs, "capture_all", fail)
    assert runner.use_prefill_graphs(logged.append) == 0 and runner.prefill_graphs is None
    assert logged == ["prefill graphs: not used, a capture failed: CUDA error: operation not permitted when stream "
                      "is capturing"]
    assert _tokens(llm, prompts, params) == eager
