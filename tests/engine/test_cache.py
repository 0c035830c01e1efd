"""Prefix caching and preemption leave outputs unchanged."""

import pytest

from lockstep_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_repeated_prompt_hits_the_prefix_cache(make_llm):
    llm = make_llm(num_scheduler_steps=8)
    prompt = {"prompt_token_ids": list(range(1000, 1100))}
    blocks = llm.engine.core.blocks
    [first] = llm.generate(prompt, GREEDY)
    hits_before = blocks.prefix_cache_hits
    [second] = llm.generate(prompt, GREEDY)
    assert blocks.prefix_cache_hits - hits_before == 96  # six full blocks; the last token is always recomputed
    assert second.num_cached_tokens == 96
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # A prompt sharing only the first 40 tokens reuses two blocks.
    hits_before = blocks.prefix_cache_hits
    llm.generate({"prompt_token_ids": list(range(1000, 1040)) + [5] * 30}, GREEDY)
    assert blocks.prefix_cache_hits - hits_before == 32


def test_preemption_leaves_greedy_outputs_unchanged(make_llm):
    prompts = [{"prompt_token_ids": [100 + i] + list(range(200, 240 + 7 * i))} for i in range(6)]
    roomy = make_llm(num_scheduler_steps=8)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY)]
    cramped = make_llm(num_scheduler_steps=8, num_gpu_blocks_override=24, enable_prefix_caching=False)
    outputs = cramped.generate(prompts, GREEDY)
    assert cramped.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert cramped.engine.core.blocks.num_free_blocks == 24


def test_chunked_prefill_gives_the_same_tokens(make_llm):
    prompt = {"prompt_token_ids": list(range(2000, 2300))}
    whole = make_llm(num_scheduler_steps=8).generate(prompt, GREEDY)[0].outputs[0].token_ids
    chunked = make_llm(num_scheduler_steps=8, max_num_batched_tokens=64, max_num_seqs=4)
    assert chunked.generate(prompt, GREEDY)[0].outputs[0].token_ids == whole


@pytest.mark.parametrize("num_steps", [1, 8])
def test_a_request_that_ends_in_its_prompts_window_leaves_its_prompt_blocks_cached(make_llm, num_steps):
    # 150 prompt tokens: 9 full blocks of 16 below the last token, which is always recomputed.
    llm = make_llm(num_scheduler_steps=num_steps)
    blocks = llm.engine.core.blocks
    for max_tokens in (1, 4, 8):
        prompt = {"prompt_token_ids": [3000 + max_tokens] + list(range(1000, 1149))}
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        [first] = llm.generate(prompt, params)
        assert first.num_cached_tokens == 0
        hits_before = blocks.prefix_cache_hits
        [second] = llm.generate(prompt, params)
        assert blocks.prefix_cache_hits - hits_before == 144, f"max_tokens={max_tokens}"
        assert second.num_cached_tokens == 144
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
