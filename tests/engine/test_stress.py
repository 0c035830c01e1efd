"""1,000 requests with random parameters and random aborts: every one ends, every block comes back."""

import random

from lockstep_engine.sampling_params import SamplingParams


def test_random_requests_and_aborts_free_every_block(tiny):
    engine = tiny.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    ids = []
    for i in range(1000):
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2, 3]), temperature=rng.choice([0.0, 0.7, 1.0]),
            top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]), seed=rng.choice([None, i]),
            max_tokens=rng.randint(2, 40), min_tokens=rng.choice([0, 0, 2]) if i % 2 else 0,
            stop_token_ids=rng.choice([[], [rng.randrange(vocab)]]), ignore_eos=rng.random() < 0.5,
            logprobs=rng.choice([None, 0, 3]), repetition_penalty=rng.choice([1.0, 1.2]),
            presence_penalty=rng.choice([0.0, 0.5]))
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 120))]
        ids.append(engine.add_request(prompt, params))
    finished, aborted = set(), set()

    def abort_some(outputs):
        # Called after every step: some aborts land in the middle of a window.
        for output in outputs:
            if rng.random() < 0.01 and output.request_id not in aborted:
                aborted.add(output.request_id)
                engine.abort_request(output.request_id)

    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 20000
        if rng.random() < 0.05:
            victim = rng.choice(ids)
            aborted.add(victim)
            engine.abort_request(victim)
        for output in engine.step(on_step=abort_some):
            if output.finished:
                finished.add(output.request_id)
                for completion in output.outputs:
                    assert completion.finish_reason in ("stop", "length", "abort")
    assert finished | aborted >= set(ids)
    assert finished >= set(ids) - aborted
    assert any(r in finished for r in aborted)  # aborted requests report finish_reason abort
    core = engine.core
    assert not core.requests and core.scheduler.num_running == 0 and core.scheduler.num_waiting == 0
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
