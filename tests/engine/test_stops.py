"""Stops that land inside a window truncate exactly; the wasted-token count moves."""

import pytest

from lockstep_engine.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def greedy(make_llm):
    llm = make_llm(num_scheduler_steps=8)
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    return llm, out.outputs[0]


def test_stop_string_split_across_tokens_truncates_exactly(greedy):
    llm, full = greedy
    tokenizer = llm.tokenizer
    # A stop string made of the end of one token and the start of the next, occurring once, and
    # completed by a token in the middle of an 8-step window.
    for boundary_token in range(9, 30):
        left = tokenizer.decode(full.token_ids[:boundary_token])
        right = tokenizer.decode(full.token_ids[:boundary_token + 1])
        stop = right[len(left) - 2:len(left) + 2]
        if len(stop) == 4 and full.text.count(stop) == 1 and (boundary_token + 1) % 8 not in (0, 1):
            break
    assert stop[:2] == left[-2:] and stop[2:] != ""
    wasted_before = llm.engine.core.stats.num_wasted_tokens
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True))
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full.text[:full.text.index(stop)]
    assert completion.token_ids == full.token_ids[:len(completion.token_ids)]
    assert llm.engine.core.stats.num_wasted_tokens > wasted_before
    [kept] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                 include_stop_str_in_output=True, ignore_eos=True))
    assert kept.outputs[0].text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_id_inside_a_window(greedy):
    llm, full = greedy
    stop_token = full.token_ids[5]
    first = full.token_ids.index(stop_token)
    wasted_before = llm.engine.core.stats.num_wasted_tokens
    # A second row keeps the window running after the first one stops on the device.
    out, _ = llm.generate([PROMPT, "Another prompt"], [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)])
    completion = out.outputs[0]
    assert completion.token_ids == full.token_ids[:first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_token
    assert completion.text == llm.tokenizer.decode(full.token_ids[:first])
    assert llm.engine.core.stats.num_wasted_tokens > wasted_before


def test_max_tokens_inside_a_window(greedy):
    llm, full = greedy
    for max_tokens in (1, 5, 13):
        [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert out.outputs[0].token_ids == full.token_ids[:max_tokens]
        assert out.outputs[0].finish_reason == "length"


def test_eos_inside_a_window_and_ignore_eos(make_llm, smollm2):
    llm = make_llm(num_scheduler_steps=16)
    chat = smollm2.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    [out] = llm.generate({"prompt_token_ids": chat}, SamplingParams(temperature=0, max_tokens=64))
    tokens = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "stop" and tokens[-1] == 2 and 2 not in tokens[:-1]
    assert len(tokens) % 16 != 0  # the EOS landed inside a window
    assert "<|im_end|>" not in out.outputs[0].text
    [more] = llm.generate({"prompt_token_ids": chat}, SamplingParams(temperature=0, max_tokens=len(tokens) + 3,
                                                                     ignore_eos=True))
    assert more.outputs[0].token_ids[:len(tokens)] == tokens
    assert more.outputs[0].finish_reason == "length"


def test_max_model_len_stops_generation(make_llm):
    llm = make_llm(num_scheduler_steps=8, max_model_len=32)
    [out] = llm.generate({"prompt_token_ids": list(range(100, 120))}, SamplingParams(temperature=0, max_tokens=None,
                                                                                     ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_incremental_text_never_breaks_utf8(smollm2):
    from lockstep_engine.output_processor import IncrementalDetokenizer

    tokenizer = smollm2.tokenizer
    text = " 漢字と東京 emoji 🎉🎉 café naïve"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "some characters must span tokens"
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    deltas = [detokenizer.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)
