"""The static-buffer path of decode graphs, on the CPU: `DecodeGraphs(capture=False)` runs each replay's
operations directly on the graph's buffers, so the CPU checks what CUDA replays would compute —
including windows of decode rows only, which replay from their first step on."""

import pytest
import torch

from lockstep_engine.runner.cuda_graphs import DecodeGraphs
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * k) % 250 + 1 for k in range(5 + 3 * i)]} for i in range(6)]


def _params():
    greedy = [SamplingParams(temperature=0, max_tokens=11 + 4 * i, ignore_eos=True) for i in range(4)]
    sampled = [SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=17, ignore_eos=True),
               SamplingParams(temperature=1.0, seed=9, max_tokens=9, ignore_eos=True)]
    return greedy + sampled


def _tokens(llm: LLM, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:len(params)], params)]


@pytest.mark.parametrize("steps", [1, 8])
def test_replayed_windows_give_the_eager_tokens(steps, monkeypatch):
    llm = LLM("random:tiny", device="cpu", num_scheduler_steps=steps, num_gpu_blocks_override=256, max_num_seqs=8)
    runner = llm.engine.executor.runner
    assert runner.graphs is None  # the CPU runs eagerly
    eager = _tokens(llm, _params())

    runner.graphs = DecodeGraphs(runner.steps, capture=False)
    replayed = []
    replay_window = runner._replay_window
    monkeypatch.setattr(runner, "_replay_window",
                        lambda graph, num_steps, *rest: replayed.append(num_steps) or replay_window(graph, num_steps, *rest))
    assert _tokens(llm, _params()) == eager
    # Once every prompt is in, windows hold decode rows only and run entirely as replays.
    assert replayed and all(n == steps for n in replayed)
    assert [len(t) for t in eager] == [p.max_tokens for p in _params()]


def test_windows_needing_the_host_per_step_stay_eager(monkeypatch):
    llm = LLM("random:tiny", device="cpu", num_scheduler_steps=4, num_gpu_blocks_override=256, max_num_seqs=8)
    runner = llm.engine.executor.runner
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)]
    eager = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    runner.graphs = DecodeGraphs(runner.steps, capture=False)
    replayed = []
    monkeypatch.setattr(runner, "_replay_window", lambda *args: replayed.append(args))
    again = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert not replayed  # logprobs: no graph
    assert again.token_ids == eager.token_ids
    assert [p.logprob for p in again.logprobs] == pytest.approx([p.logprob for p in eager.logprobs])
    assert len(again.logprobs) == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("steps", [1, 8])
def test_captured_graphs_give_the_eager_tokens_on_cuda(steps):
    """Real captures (fp32, so both paths round alike): every window, decode-only ones replayed from step 1."""
    common = dict(num_scheduler_steps=steps, num_gpu_blocks_override=256, max_num_seqs=8, dtype="float32")
    eager = LLM("random:tiny", enforce_eager=True, **common)
    graphed = LLM("random:tiny", **common)
    assert eager.engine.executor.runner.graphs is None and graphed.engine.executor.runner.graphs is not None
    assert _tokens(graphed, _params()) == _tokens(eager, _params())
    assert graphed.engine.executor.runner.graphs.graphs  # captured at least one bucket


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton backend needs a CUDA device")
def test_engines_sharing_a_model_run_the_attention_backend_they_ask_for():
    base = LLM("random:tiny", num_gpu_blocks_override=256, max_num_seqs=8, dtype="float32")
    runner = base.engine.executor.runner
    assert runner.backend.name == "triton" and runner.graphs is not None
    triton_tokens = _tokens(base, _params())
    reference = LLM("random:tiny", share_model_with=base, attention_backend="torch", max_num_seqs=8)
    assert runner.backend.name == "torch" and runner.graphs is None
    assert all(attn.backend is runner.backend for attn in runner.model.attention_layers())
    torch_tokens = _tokens(reference, _params())
    same = sum(a == b for a, b in zip(triton_tokens, torch_tokens))
    assert same >= len(triton_tokens) - 1, (triton_tokens, torch_tokens)  # fp32: at most a rare near-tie
    LLM("random:tiny", share_model_with=base, max_num_seqs=8)  # auto: the runner's own backend and graphs
    assert runner.backend.name == "triton" and runner.graphs is not None
    assert _tokens(base, _params()) == triton_tokens


def test_windows_with_a_logit_bias_or_bad_words_give_the_eager_tokens():
    # The graphs hold no logit bias: replaying such a window sampled as if allowed_token_ids, logit_bias and
    # bad words were not there (on CUDA, before it ran such windows eagerly).
    llm = LLM("random:tiny", device="cpu", num_scheduler_steps=8, num_gpu_blocks_override=256, max_num_seqs=8)
    runner = llm.engine.executor.runner
    free = _tokens(llm, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=[5, 9]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias={7: 100.0}),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             bad_words_token_ids=[free[2][3:5], free[2][10:11]])]
    eager = _tokens(llm, params)
    runner.graphs = DecodeGraphs(runner.steps, capture=False)
    assert _tokens(llm, params) == eager
    assert set(eager[0]) <= {5, 9} and set(eager[1]) == {7} and free[2][10] not in eager[2]
