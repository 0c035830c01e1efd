"""Bad words of several tokens, as vLLM bans them: a word's last token is never sampled right after the
word's other tokens. The check runs on the device inside a window, so every N gives the same tokens."""

import json
import os
import subprocess
import sys

import pytest
import torch

from lockstep_engine.llm import LLM
from lockstep_engine.sampler import ANY_TOKEN, SamplingTensors, ban_bad_words
from lockstep_engine.sampling_params import SamplingParams, SamplingParamsError

STORY = "Once upon a time"  # greedy: ", the city of Nova Haven was a thriving metropolis, with towering ..."


def _tensors(rows, last, prefix) -> SamplingTensors:
    t = SamplingTensors(*([None] * 12), all_greedy=True, any_filter=False, num_logprobs=-1)
    t.bad_rows, t.bad_last, t.bad_prefix = (torch.tensor(x) for x in (rows, last, prefix))
    return t


def test_a_last_token_is_banned_only_right_after_the_other_tokens():
    recent = torch.tensor([[-1, -1], [3, 4], [5, 4]])  # row 0 has no outputs yet
    # (row, word): (0, 4 7), (1, 3 4 7), (1, 4 7): the same ban twice, (1, 3 8): not after 3 4, (2, 3 4 9)
    t = _tensors([0, 1, 1, 1, 2], [7, 7, 7, 8, 9],
                 [[ANY_TOKEN, 4], [3, 4], [ANY_TOKEN, 4], [ANY_TOKEN, 3], [3, 4]])
    logits = ban_bad_words(torch.zeros(3, 10), t, recent)
    banned = {(row, token) for row, token in (logits == float("-inf")).nonzero().tolist()}
    assert banned == {(1, 7)}
    assert not logits.isnan().any()


def _words(tokenizer, *words) -> list[list[int]]:
    return [tokenizer.encode(spelling, add_special_tokens=False) for word in words for spelling in (word, " " + word)]


def test_a_banned_word_never_appears_and_every_step_count_gives_the_same_text(make_llm):
    free = make_llm(num_scheduler_steps=8).generate(STORY, SamplingParams(temperature=0, max_tokens=40))
    assert "the city of Nova" in free[0].outputs[0].text and "a thriving" in free[0].outputs[0].text
    results = []
    for steps in (1, 3, 8, "auto"):
        llm = make_llm(num_scheduler_steps=steps)
        words = _words(llm.tokenizer, "the city of Nova", "a thriving")
        greedy = SamplingParams(temperature=0, max_tokens=40, bad_words_token_ids=words)
        sampled = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=40, bad_words_token_ids=words)
        outputs = llm.generate([STORY, STORY], [greedy, sampled])
        results.append([c.token_ids for o in outputs for c in o.outputs])
        texts = [c.text for o in outputs for c in o.outputs]
        assert not any("city of Nova" in text or "a thriving" in text for text in texts), texts
        assert texts[0].startswith(", the city of ") and " a " in texts[0], texts[0]  # the prefixes may appear
    assert all(tokens == results[0] for tokens in results)


@pytest.fixture(scope="module")
def tiny1() -> LLM:
    return LLM("random:tiny", num_scheduler_steps=1, num_gpu_blocks_override=256, max_num_seqs=64)


def _has(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_random_model_repeats_no_banned_sequence_at_n1_and_n8(tiny, tiny1):
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": list(range(40, 60))}]
    free = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    words = []
    for output in free:
        tokens = output.outputs[0].token_ids
        words += [tokens[10:12], tokens[20:23], tokens[5:6] + tokens[30:31]]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, bad_words_token_ids=words)
    results = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in (tiny, tiny1)]
    assert results[0] == results[1]
    assert results[0] != [o.outputs[0].token_ids for o in free]
    for tokens in results[0]:
        assert not any(_has(tokens, word) for word in words), (tokens, words)


@pytest.mark.parametrize("words,allowed", [
    ([[]], "lists of 1 to 32"), ([[1] * 33], "lists of 1 to 32"), ([[1, -1]], "non-negative"),
    ([[1]] * 257, "at most 256"), ([1, 2], "lists of 1 to 32")])
def test_bad_word_token_ids_out_of_range_are_refused_by_name(words, allowed):
    with pytest.raises(SamplingParamsError) as refused:
        SamplingParams(bad_words_token_ids=words)
    assert refused.value.param == "bad_words_token_ids" and allowed in str(refused.value)


def test_a_bad_word_token_outside_the_vocabulary_is_refused(tiny):
    vocab = tiny.engine.core.executor.model_config.vocab_size
    with pytest.raises(SamplingParamsError) as refused:
        tiny.generate({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words_token_ids=[[1, vocab]]))
    assert refused.value.param == "bad_words_token_ids" and str(vocab) in str(refused.value)


PIPELINED = r"""
import json, sys
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams
prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3], list(range(40, 60)), [7, 7, 7])]
def run(llm, words):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, bad_words_token_ids=words)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
single = LLM("random:tiny", device="cpu", num_scheduler_steps=8, num_gpu_blocks_override=256)
free = run(single, None)
words = [tokens[12:14] for tokens in free] + [free[0][20:23]]
staged = LLM("random:tiny", device="cpu", pipeline_parallel_size=2, num_scheduler_steps=8, num_gpu_blocks_override=256)
print(json.dumps({"words": words, "single": run(single, words), "staged": run(staged, words)}))
"""


def test_pipeline_stages_ban_the_same_words():
    """PP=2 over gloo runs each window as micro-batches in flight; every stage feeds the samples back."""
    result = subprocess.run([sys.executable, "-c", PIPELINED], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, LOCKSTEP_CPU_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["staged"] == out["single"]
    assert not any(_has(tokens, word) for tokens in out["single"] for word in out["words"])
