"""/v1/completions through a real server and the official openai client, against SmolLM2."""

import httpx
import pytest

from lockstep_engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def tokenize(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_greedy_text_equals_the_offline_api(smol8, offline_smollm2):
    client = smol8.client()
    expected = offline_smollm2.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    response = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.text for choice in response.choices] == [out.outputs[0].text for out in expected]
    assert response.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in expected)
    assert response.usage.completion_tokens == sum(len(out.outputs[0].token_ids) for out in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_token_id_prompts_give_the_same_text_as_their_text(smol8, offline_smollm2):
    client = smol8.client()
    ids = [offline_smollm2.tokenizer.encode(p) for p in PROMPTS[:2]]
    by_text = client.completions.create(model="smollm2", prompt=PROMPTS[:2], max_tokens=12, temperature=0)
    by_ids = client.completions.create(model="smollm2", prompt=ids, max_tokens=12, temperature=0)
    one = client.completions.create(model="smollm2", prompt=ids[0], max_tokens=12, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert one.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_prompts_read_on_the_loop_and_in_a_worker_give_the_same_text(smol8, offline_smollm2):
    """Short prompts are read on the event loop, long ones in a worker thread: same tokens either way."""
    from lockstep_engine.api.tokenize import INLINE_PROMPT_CHARS, INLINE_PROMPT_IDS, inline_prompt

    long_text = " ".join(["The quick brown fox jumps over the lazy dog."] * (INLINE_PROMPT_CHARS // 40))
    assert len(long_text) > INLINE_PROMPT_CHARS and not inline_prompt(long_text)
    assert not inline_prompt([PROMPTS[0], long_text]) and inline_prompt(PROMPTS) and inline_prompt([1, 2])
    ids = offline_smollm2.tokenizer.encode(long_text)
    assert not inline_prompt([ids] * (INLINE_PROMPT_IDS // len(ids) + 1)) and inline_prompt(ids)
    client = smol8.client()
    by_text = client.completions.create(model="smollm2", prompt=[long_text, PROMPTS[0]], max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="smollm2", prompt=[ids, offline_smollm2.tokenizer.encode(PROMPTS[0])],
                                       max_tokens=8, temperature=0)
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens > len(ids)


def test_streamed_text_equals_the_response_and_arrives_per_step(smol8):
    client = smol8.client()
    whole = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert len(chunks) > 2  # streamed per step, not per request or per window
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stream_include_usage_ends_with_a_usage_chunk(smol8):
    stream = smol8.client().completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=7, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.completion_tokens, usage.prompt_tokens) == (7, len(tokenize(smol8, PROMPTS[1])))
    assert chunks[-2].choices[0].finish_reason == "length"


def test_finish_reason_length_at_max_tokens(smol8):
    response = smol8.client().completions.create(model="smollm2", prompt=PROMPTS[2], max_tokens=5, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5


def test_batched_prompts_with_n_2(smol8):
    response = smol8.client().completions.create(model="smollm2", prompt=PROMPTS[:2], n=2, max_tokens=8,
                                                 temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 4 * 8
    by_index = {c.index: c.text for c in response.choices}
    assert by_index[0] != by_index[1] or by_index[2] != by_index[3]  # samples of one prompt differ


def test_streamed_n_2_gives_every_choice_a_finish(smol8):
    chunks = list(smol8.client().completions.create(model="smollm2", prompt=PROMPTS[:2], n=2, max_tokens=6,
                                                    temperature=0.9, seed=3, stream=True,
                                                    extra_body={"ignore_eos": True}))
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason == "length"]
    assert sorted(finished) == [0, 1, 2, 3]


def test_seed_makes_sampling_reproducible(smol8):
    client = smol8.client()

    def sample(seed):
        return client.completions.create(model="smollm2", prompt=PROMPTS[2], max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_stop_string_truncates_exactly_and_matches_offline(smol8, offline_smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["\n"])
    expected = offline_smollm2.generate(PROMPTS[0], params)[0].outputs[0]
    response = smol8.client().completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                                 stop=["\n"])
    choice = response.choices[0]
    assert choice.text == expected.text
    assert "\n" not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "\n"


def test_stop_string_in_a_stream(smol8):
    chunks = list(smol8.client().completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=30,
                                                    temperature=0, stop=["answer"], stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert "answer" not in text and text.startswith(" Paris")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(smol8):
    response = smol8.client().completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                 logprobs=3, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_prepends_the_prompt(smol8):
    client = smol8.client()
    plain = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    echoed = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = list(client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
