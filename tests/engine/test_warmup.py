"""Warm-up before ready (`lockstep_engine.warmup`): it runs the serving code paths and leaves the core
as if nothing ran."""

from lockstep_engine.engine_core import EngineCore
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sequence import Request
from lockstep_engine.warmup import _Plan, decode_batch_sizes, warm_up


def test_decode_batch_sizes_hit_every_graph_bucket_up_to_max_num_seqs():
    assert decode_batch_sizes(256) == [256, 224, 192, 160, 128, 96, 64, 48, 32, 24, 16, 8, 4, 2, 1]
    # 200 rows replay the 224 bucket: a batch of 200 captures it
    assert decode_batch_sizes(200)[:2] == [200, 192] and decode_batch_sizes(1) == [1]


def test_warm_up_runs_windows_then_serves_from_a_core_with_nothing_left_over(tiny):
    executor = tiny.engine.executor
    core = EngineCore(tiny.engine.config, executor)
    logged = []
    serving = warm_up(core, logged.append)
    assert core.stats.num_windows > 0 and core.stats.num_generated_tokens > 0  # the warm-up did run
    assert any(line.startswith("warm-up: prefill shapes") for line in logged) and logged[-1].startswith("warm-up: done")
    assert serving is not core and serving.executor is executor
    assert serving.blocks.num_free_blocks == serving.blocks.num_blocks
    assert serving.stats.num_windows == serving.stats.num_steps == serving.stats.num_generated_tokens == 0
    assert serving.blocks.prefix_cache_queries == 0 and not serving.has_unfinished()
    # A warm-up prompt sent again finds nothing cached.
    prompt = _Plan(EngineCore(tiny.engine.config, executor), small=True).request(64, 2).prompt_token_ids
    request = Request("after", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                      serving.config.max_model_len, seed=0)
    serving.add_request(request)
    while serving.has_unfinished():
        serving.step(lambda outputs: None)
    assert request.num_cached_tokens == 0 and serving.blocks.prefix_cache_hits == 0
    assert len(request.sequences[0].output_token_ids) == 4
