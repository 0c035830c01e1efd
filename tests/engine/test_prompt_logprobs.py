"""Prompt logprobs (vLLM's `prompt_logprobs`) against Hugging Face transformers on the real SmolLM2 weights,
through chunked prefill, the prefix cache, n > 1 and window lengths N=1 and N=8."""

import dataclasses

import pytest
import torch

from lockstep_engine.sampling_params import SamplingParams, SamplingParamsError
from lockstep_engine.validation import validate_request

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a screw press adapted from wine making. Before that, books were "
    "copied by hand in monasteries and workshops, a slow and expensive process that kept literacy rare.",
]
K = 3


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(reference, prompts) -> list[torch.Tensor]:
    """The reference's log-softmax at every prompt position, [prompt_len, vocab]."""
    with torch.inference_mode():
        return [torch.log_softmax(reference.model(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in prompts]


def _prompt_logprobs(llm, prompts, **params) -> list[list]:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K, **params)
    return [out.prompt_logprobs for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _assert_matches(results, prompts, expected):
    for entries, ids, ref in zip(results, prompts, expected):
        assert len(entries) == len(ids) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            row = ref[position - 1]  # the logits before prompt token `position` predict it
            assert entry.token_id == ids[position]
            assert abs(entry.logprob - row[ids[position]].item()) < 1e-3
            assert abs(row.sort(descending=True).values[entry.rank - 1].item() - entry.logprob) < 1e-3
            top_ids = [token for token, _ in entry.top]
            assert len(top_ids) == K
            assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
            assert all(abs(lp - row[token].item()) < 1e-3 for token, lp in entry.top)
            assert abs(entry.top[0][1] - row.max().item()) < 1e-3


@pytest.mark.parametrize("steps", [1, 8])
def test_prompt_logprobs_match_transformers(make_llm, prompts, expected, steps):
    _assert_matches(_prompt_logprobs(make_llm(num_scheduler_steps=steps), prompts), prompts, expected)


def test_chunked_prefill_prefix_cache_and_n(make_llm, prompts, expected):
    """A prompt split over windows of 16 tokens, a second request over the same (cached) prompt, and n=2
    all give the reference's prompt logprobs."""
    llm = make_llm(num_scheduler_steps=8, max_num_batched_tokens=16)
    _assert_matches(_prompt_logprobs(llm, prompts), prompts, expected)
    again = _prompt_logprobs(llm, prompts[2:])  # its prefix is in the cache now: it is computed anyway
    _assert_matches(again, prompts[2:], expected[2:])
    params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=3, prompt_logprobs=K)
    [out] = llm.generate({"prompt_token_ids": prompts[1]}, params)
    _assert_matches([out.prompt_logprobs], prompts[1:2], expected[1:2])
    assert len(out.outputs) == 2


def test_window_lengths_give_identical_prompt_logprobs(make_llm, prompts):
    runs = [_prompt_logprobs(make_llm(num_scheduler_steps=n), prompts) for n in (1, 8)]
    assert runs[0] == runs[1]


def test_requests_without_prompt_logprobs_get_none(smollm2, prompts):
    [out] = smollm2.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0.0, max_tokens=2))
    assert out.prompt_logprobs is None
    [one] = _prompt_logprobs(smollm2, [prompts[0][:1]])
    assert one == [None]


def test_prompt_logprobs_bounds(smollm2, prompts):
    engine = smollm2.engine
    for bad in (-1, 21, 1.5):
        with pytest.raises(SamplingParamsError) as error:
            validate_request(engine.config, engine.model_config, prompts[0], SamplingParams(prompt_logprobs=bad))
        assert error.value.param == "prompt_logprobs" and "[0, 20]" in str(error.value)
    # Their logits stay on the last pipeline stage.
    staged = dataclasses.replace(engine.config, pipeline_parallel_size=2)
    with pytest.raises(SamplingParamsError) as error:
        validate_request(staged, engine.model_config, prompts[0], SamplingParams(prompt_logprobs=1))
    assert error.value.param == "prompt_logprobs" and "pipeline_parallel_size=2" in str(error.value)
