"""Pipeline micro-batches: how a window's rows are split and how their step outputs are joined."""

from types import SimpleNamespace

from lockstep_engine.runner.outputs import StepOutput
from lockstep_engine.runner.pipelined import StepMerger, split_micro_batches


def _rows(*specs):
    return [SimpleNamespace(num_new_tokens=n, samples=s, name=i) for i, (n, s) in enumerate(specs)]


def test_split_keeps_order_leaves_no_part_empty_and_balances_work():
    rows = _rows(*[(1, True)] * 10)
    parts = split_micro_batches(rows, 2, 8)
    assert [r.name for part in parts for r in part] == list(range(10))
    assert [len(p) for p in parts] == [5, 5]
    # a long prefill chunk weighs as much as many decode rows
    rows = _rows((100, False), *[(1, True)] * 12)
    parts = split_micro_batches(rows, 2, 8)
    assert [len(p) for p in parts] == [1, 12]
    assert len(split_micro_batches(_rows((1, True)), 4, 8)) == 1
    for count in (2, 3, 4):
        for n in range(1, 9):
            parts = split_micro_batches(_rows(*[(1 + (i * 37) % 50, i % 3 > 0) for i in range(n)]), count, 8)
            assert len(parts) == min(count, n) and all(parts)
            assert sum(len(p) for p in parts) == n


def test_merger_joins_parts_in_row_order_and_delivers_steps_in_order():
    got = []
    merger = StepMerger(got.append, [2, 0, 1])
    merger.add(1, 0, StepOutput(step=1, tokens=[5, 6], logprobs=[-1.0, -2.0], ranks=[1, 2]))
    assert got == []  # part 2 missing
    merger.add(1, 2, StepOutput(step=1, tokens=[7]))
    assert [o.tokens for o in got] == [[5, 6, 7]]
    assert got[0].logprobs == [-1.0, -2.0, 0.0] and got[0].ranks == [1, 2, 0]
    merger.add(2, 2, None)  # that micro-batch finished: its rows emit nothing
    merger.add(2, 0, StepOutput(step=2, tokens=[8, -1], top_ids=[[8], [1]], top_logprobs=[[-0.5], [-0.7]]))
    assert got[1].tokens == [8, -1, -1] and got[1].top_ids == [[8], [1], []]
    assert got[1].logprobs is None


def test_stage_layers_balance_the_lm_head_and_honour_an_explicit_partition():
    import pytest

    from lockstep_engine.parallel import stage_layers

    def layout(num_layers, pp, head=0.0, partition=None):
        ranges = [stage_layers(num_layers, r, pp, head, partition) for r in range(pp)]
        assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, each layer once
        return [len(r) for r in ranges]

    assert layout(30, 1, 8.0) == [30]
    assert layout(30, 2) == [15, 15]
    assert layout(30, 2, 8.0) == [19, 11]  # SmolLM2: the tied head weighs 8 layers
    assert layout(32, 2, 2.41) == [17, 15]  # Llama-3-8B
    assert layout(4, 4, 10.0) == [1, 1, 1, 1]  # never an empty stage
    assert layout(30, 2, partition=(20, 10)) == [20, 10]
    with pytest.raises(ValueError, match="pipeline_layer_partition='20,11' is invalid: expected layer counts "
                                         "summing to the model's 30 layers"):
        stage_layers(30, 0, 2, 0.0, (20, 11))


def test_layer_partition_is_an_engine_argument_checked_once():
    import pytest

    from lockstep_engine.config import ConfigError, EngineConfig

    config = EngineConfig(model="random:tiny", pipeline_parallel_size=2, pipeline_layer_partition="20,10")
    assert config.pipeline_layer_partition == (20, 10)
    assert EngineConfig(model="random:tiny", pipeline_parallel_size=2,
                        pipeline_layer_partition=[20, 10]).pipeline_layer_partition == (20, 10)  # from JSON
    assert EngineConfig(model="random:tiny").pipeline_layer_partition is None
    for bad in ("30", "a,b", "30,0", "10,10,10"):
        with pytest.raises(ConfigError, match=f"pipeline_layer_partition='{bad}' is invalid: expected 2 "
                                              "comma-separated layer counts, each >= 1"):
            EngineConfig(model="random:tiny", pipeline_parallel_size=2, pipeline_layer_partition=bad)
