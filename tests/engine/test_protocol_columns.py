"""A window's token-batch columns cross the core's pipe once: later batches of the window carry only
their tokens, and the reader puts the columns back."""

import pickle

import pytest

from lockstep_engine import protocol as p


def _batch(window: int, tokens: list[int]) -> p.TokenBatch:
    return p.TokenBatch(["r1", "r2"], [0, 0], [16, 0], [1.5, 2.5], tokens, window)


def _across_the_pipe(writer: p.ColumnCache, reader: p.ColumnCache, batch: p.TokenBatch) -> tuple[p.TokenBatch, int]:
    data = pickle.dumps(writer.strip(batch))
    return reader.restore(pickle.loads(data)), len(data)


def test_later_batches_of_a_window_travel_without_columns_and_come_back_whole():
    writer, reader = p.ColumnCache(), p.ColumnCache()
    first, first_size = _across_the_pipe(writer, reader, _batch(1, [5, 6]))
    second, second_size = _across_the_pipe(writer, reader, _batch(1, [7, -1]))
    third, _ = _across_the_pipe(writer, reader, p.TokenBatch(["r3"], [1], [0], [None], [9], 2))
    assert second_size < first_size
    assert [(o.request_id, o.token_ids, o.num_cached_tokens, o.scheduled_at) for o in second.outputs()] == \
        [("r1", [7], 16, 1.5)]
    assert [o.request_id for o in first.outputs()] == ["r1", "r2"] and [o.request_id for o in third.outputs()] == ["r3"]


def test_a_stripped_batch_of_another_window_is_an_error_not_wrong_ids():
    reader = p.ColumnCache()
    reader.restore(_batch(1, [5, 6]))
    with pytest.raises(ValueError, match="window 2 came without its columns"):
        reader.restore(p.TokenBatch(None, None, None, None, [1, 2], 2))
