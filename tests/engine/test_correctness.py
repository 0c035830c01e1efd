"""Greedy tokens and logprobs against Hugging Face transformers on the real SmolLM2 weights."""

import pytest

from lockstep_engine.sampling_params import SamplingParams

NEW_TOKENS = 64
LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a screw press adapted from wine making. Before that, books were "
    "copied by hand in monasteries and workshops, a slow and expensive process that kept literacy rare. "
    "Within fifty years presses had spread to more than two hundred cities across Europe, and millions of "
    "volumes had been printed. Scholars could now compare identical copies of a text, errors could be "
    "corrected in later editions, and ideas travelled faster than ever before. The Reformation, the "
    "scientific revolution and the rise of newspapers all owe something to this invention. Historians still "
    "debate how quickly ordinary people gained access to printed material, since books remained costly "
    "for decades, but pamphlets, broadsheets and almanacs reached far wider audiences. In the centuries "
    "that followed, steam power, rotary presses and eventually offset lithography made printing cheaper "
    "still, until the digital age transformed publishing once again. Typewriters, photocopiers and laser "
    "printers each changed offices in their turn, and desktop publishing put typesetting on every desk. "
    "Today most text is read on screens, yet printed books still sell in the hundreds of millions each year, "
    "and the craft of fine printing survives in small studios around the world. "
    "Summarise this history in one sentence:"
)
PLAIN_PROMPTS = [
    "The",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Les montagnes les plus hautes du monde sont",
    "<html>\n<head>\n<title>",
    LONG_TEXT,
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Explain recursion to a child."}],
    [{"role": "user", "content": LONG_TEXT[:600]}],
]
STEP_COUNTS = [1, 4, 8, "auto"]


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tokenizer = smollm2.tokenizer
    ids = [tokenizer.encode(p) for p in PLAIN_PROMPTS] + [smollm2.apply_chat_template(c) for c in CHATS]
    assert len(ids) == 16
    lengths = sorted(len(p) for p in ids)
    assert lengths[0] == 1 and 250 <= lengths[-1] <= 300, lengths
    return ids


def _assert_matches(outputs, prompts, reference):
    for output, prompt in zip(outputs, prompts):
        ref_tokens, ref_logprobs = reference.greedy(prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        for position, entry in enumerate(completion.logprobs):
            assert entry.token_id == ref_tokens[position]
            assert abs(entry.logprob - ref_logprobs[position][entry.token_id].item()) < 1e-3


@pytest.mark.parametrize("steps", STEP_COUNTS)
def test_batched_greedy_matches_transformers(make_llm, prompts, reference, steps):
    llm = make_llm(num_scheduler_steps=steps)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _assert_matches(outputs, prompts, reference)


@pytest.mark.parametrize("steps", STEP_COUNTS)
def test_one_at_a_time_greedy_matches_transformers(make_llm, prompts, reference, steps):
    llm = make_llm(num_scheduler_steps=steps)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1)
    # A few prompts alone per step count keeps the suite short; together they cover all 16.
    chosen = [p for index, p in enumerate(prompts) if index % len(STEP_COUNTS) == STEP_COUNTS.index(steps)]
    for prompt in chosen:
        _assert_matches(llm.generate({"prompt_token_ids": prompt}, params), [prompt], reference)


def test_window_lengths_give_identical_tokens(make_llm, prompts):
    """On one backend, changing N must not change a single greedy token."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in make_llm(num_scheduler_steps=n).generate(
        [{"prompt_token_ids": p} for p in prompts[:8]], params)] for n in (1, 3, 8, 16)]
    assert all(run == runs[0] for run in runs[1:])


def test_text_prompt_and_chat_api(smollm2, reference):
    tokenizer = smollm2.tokenizer
    [out] = smollm2.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    expected, _ = reference.greedy(tokenizer.encode("The capital of France is"), NEW_TOKENS)
    assert out.outputs[0].token_ids == expected[:8]
    assert out.outputs[0].text == tokenizer.decode(expected[:8])
    [chat] = smollm2.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=64))
    ref, _ = reference.greedy(smollm2.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]), NEW_TOKENS)
    assert chat.outputs[0].token_ids == ref
    assert chat.outputs[0].finish_reason == "stop"  # ends with the EOS token <|im_end|>
