"""The offline benchmark loop shared by `lockstep bench throughput` and benchmarks/gpu_run.py."""

from lockstep.bench.workload import WorkloadRequest
from lockstep.bench.offline import greedy_requests, run_offline

WORKLOAD = [WorkloadRequest([5, 6, 7], 9), WorkloadRequest([8] * 20, 3), WorkloadRequest([9] * 40, 1)]


def test_greedy_requests_ask_for_exactly_each_output_len():
    prompts, params = greedy_requests(WORKLOAD)
    assert prompts == [[5, 6, 7], [8] * 20, [9] * 40]
    assert [(p.max_tokens, p.temperature, p.ignore_eos) for p in params] == [(9, 0.0, True), (3, 0.0, True),
                                                                               (1, 0.0, True)]


def test_run_offline_counts_the_tokens_of_its_own_run_only(tiny):
    prompts, params = greedy_requests(WORKLOAD)
    run_offline(tiny, prompts, params, progress=print, progress_every_s=3600)
    step_tokens = []
    run = run_offline(tiny, prompts, params, progress=print, progress_every_s=3600,
                      on_step=lambda outputs: step_tokens.extend(len(o.token_ids) for o in outputs))
    assert len(run.request_ids) == 3 and not tiny.engine.has_unfinished_requests()
    assert run.num_prompt_tokens == 63
    assert run.num_output_tokens == sum(step_tokens) == 13
    assert run.total_tokens_per_s == 76 / run.elapsed_s
