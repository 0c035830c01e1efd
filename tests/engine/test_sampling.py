"""Device-side sampling: seeds independent of batch and window, n > 1, filters, penalties, bias."""

import pickle

from lockstep_engine import protocol as p
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sequence import Request

PROMPTS = [[1, 5, 9, 13], [100, 200, 300], [7] * 20, [42, 43]]


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_seeded_sampling_is_the_same_for_any_window_and_batch(make_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    target = {"prompt_token_ids": [504, 3575, 282, 4649, 314]}
    others = [{"prompt_token_ids": p} for p in PROMPTS]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    results = []
    for steps, batch in ((1, []), (8, []), (8, others), (3, others[:2]), ("auto", others)):
        llm = make_llm(num_scheduler_steps=steps)
        outputs = llm.generate([target] + batch, [params] + [unseeded] * len(batch))
        results.append(outputs[0].outputs[0].text)
    assert all(text == results[0] for text in results), results
    assert len(set(results[0].split())) > 3  # it really sampled something


def test_different_seeds_differ_and_n_samples_differ(make_llm):
    llm = make_llm(num_scheduler_steps=8)
    prompt = {"prompt_token_ids": [504, 3575, 282, 4649, 314]}
    a = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True))
    b = llm.generate(prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True))
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids
    [many] = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) == 3
    assert all(len(c.token_ids) == 16 for c in many.outputs)
    [again] = make_llm(num_scheduler_steps=1).generate(
        prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    assert _tokens([again]) == _tokens([many])


def test_greedy_n_samples_share_the_prompt_and_agree(make_llm):
    llm = make_llm(num_scheduler_steps=4)
    prompt = {"prompt_token_ids": list(range(300, 340))}
    [single] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    free_before = llm.engine.core.blocks.num_free_blocks
    [pair] = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True))
    assert pair.outputs[0].token_ids == pair.outputs[1].token_ids == single.outputs[0].token_ids
    assert llm.engine.core.blocks.num_free_blocks == free_before


def test_top_k_one_is_greedy_and_logit_bias_forces_a_token(make_llm):
    llm = make_llm(num_scheduler_steps=8)
    prompt = {"prompt_token_ids": [504, 3575, 282, 4649, 314]}
    [greedy] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    [top1] = llm.generate(prompt, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=12, ignore_eos=True))
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids
    [biased] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logit_bias={1000: 100.0}))
    assert biased.outputs[0].token_ids == [1000] * 5


def test_penalties_change_repetitive_output(make_llm):
    llm = make_llm(num_scheduler_steps=8)
    prompt = {"prompt_token_ids": [33, 28, 216, 34, 28, 216, 35, 28, 216]}  # "1, 2, 3, "
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8),
                   SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0),
                   SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=2.0)):
        penalised = llm.generate(prompt, params)[0].outputs[0]
        assert penalised.token_ids != plain.token_ids
        # fewer repeats of the most repeated token
        assert max(penalised.token_ids.count(t) for t in set(penalised.token_ids)) <= \
            max(plain.token_ids.count(t) for t in set(plain.token_ids))


def test_min_tokens_holds_back_eos(make_llm, smollm2):
    llm = make_llm(num_scheduler_steps=8)
    chat = smollm2.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    [short] = llm.generate({"prompt_token_ids": chat}, SamplingParams(temperature=0, max_tokens=64))
    natural = len(short.outputs[0].token_ids)
    assert short.outputs[0].finish_reason == "stop"
    [longer] = llm.generate({"prompt_token_ids": chat},
                            SamplingParams(temperature=0, max_tokens=natural + 20, min_tokens=natural + 5))
    assert len(longer.outputs[0].token_ids) >= natural + 5
    assert 2 not in longer.outputs[0].token_ids[:natural + 4]


def test_logprobs_and_top_logprobs(make_llm):
    llm = make_llm(num_scheduler_steps=8)
    [out] = llm.generate({"prompt_token_ids": [504, 3575, 282, 4649, 314]},
                         SamplingParams(temperature=0.8, seed=5, max_tokens=10, logprobs=5, ignore_eos=True))
    completion = out.outputs[0]
    assert len(completion.logprobs) == 10
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert entry.token_id == token and entry.logprob <= 0
        assert len(entry.top) == 5
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        if entry.rank <= 5:
            assert entry.top[entry.rank - 1][0] == token


def test_core_emits_protocol_outputs_that_cross_the_pipe_as_they_are(tiny):
    """The core process sends what `EngineCore` emits, logprobs included, without a copy per token."""
    engine = tiny.engine
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True))
    emitted = []
    while engine.has_unfinished_requests():
        engine.step(on_step=emitted.extend)
    assert [type(o) for o in emitted] == [p.SequenceOutput] * 3
    assert [type(e) for o in emitted for e in o.logprobs] == [p.TokenLogprobs] * 3
    assert [o.finish_reason for o in emitted] == [None, None, "length"]
    assert pickle.loads(pickle.dumps(p.StepOutputs(emitted, 0.0))).outputs == emitted


def test_a_steps_common_rows_cross_the_pipe_as_one_batch_and_the_others_as_outputs(tiny):
    """Rows needing only their token go out as the step's `TokenBatch`; a row with logprobs, a finish or
    a first window takes the per-row path. Either way each request gets the tokens it gets alone."""
    core = tiny.engine.core
    params = {"plain": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              "logprobs": SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True),
              "short": SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)}
    prompts = {"plain": [5, 6, 7], "logprobs": [8, 9, 10, 11], "short": [12, 13]}
    for request_id, sampling in params.items():
        core.add_request(Request(request_id, prompts[request_id], sampling, core.config.max_model_len, 0))
    steps = []
    while core.has_unfinished():
        core.step(lambda step: steps.append(pickle.loads(pickle.dumps(step))))
    tokens, finishes = {}, {}
    for step in steps:
        for output in step.all_outputs():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            finishes[output.request_id] = output.finish_reason
    for request_id, sampling in params.items():
        assert tokens[request_id] == tiny.generate([prompts[request_id]], sampling)[0].outputs[0].token_ids
        assert finishes[request_id] == "length"
    batched = [b.request_ids[i] for b in (s.batch for s in steps if s.batch) for i, t in enumerate(b.token_ids) if t >= 0]
    assert set(batched) == {"plain", "short"}  # after their first window, before their last token
    per_row = [o for s in steps for o in s.outputs]
    assert all(o.logprobs for o in per_row if o.request_id == "logprobs")
    assert sum(o.request_id == "logprobs" for o in per_row) == 12
