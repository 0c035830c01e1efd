"""BlockManager on plain Python data: reference counts, copy-on-write, prefix cache, eviction."""

from lockstep_engine.block_manager import BlockManager
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sequence import Request, SequenceStatus


def _seq(tokens, n=1, request_id="r"):
    request = Request(request_id, list(tokens), SamplingParams(n=n, max_tokens=8), max_model_len=4096, seed=0)
    return request.sequences[0]


def test_reserve_takes_lookahead_blocks_and_free_returns_them():
    blocks = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(range(10))
    assert blocks.try_reserve(seq, 10 + 7) == []  # prompt plus an 8-step window's lookahead
    assert len(seq.block_ids) == 5 and blocks.num_free_blocks == 3
    blocks.free(seq)
    assert blocks.num_free_blocks == 8 and seq.block_ids == []


def test_reserve_fails_cleanly_when_blocks_run_out():
    blocks = BlockManager(num_blocks=2, block_size=4)
    seq = _seq(range(10))
    assert blocks.try_reserve(seq, 10) is None
    assert blocks.num_free_blocks == 2 and seq.block_ids == []


def test_fork_shares_blocks_and_copies_on_write():
    blocks = BlockManager(num_blocks=8, block_size=4)
    parent = _seq(range(6), n=2)
    blocks.try_reserve(parent, 6)
    parent.num_computed = 5
    child = _seq(range(6), request_id="c")
    blocks.fork(parent, child)
    assert child.block_ids == parent.block_ids and blocks.num_free_blocks == 6
    # The child writes slot 5, inside the shared partial block 1: it gets its own copy.
    copies = blocks.try_reserve(child, 6)
    assert copies == [(parent.block_ids[1], child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0] and child.block_ids[1] != parent.block_ids[1]
    assert blocks.try_reserve(parent, 6) == []  # now the parent owns its block alone
    blocks.free(parent)
    blocks.free(child)
    assert blocks.num_free_blocks == 8


def test_prefix_cache_hits_full_blocks_and_always_leaves_a_token():
    blocks = BlockManager(num_blocks=8, block_size=4)
    first = _seq(range(12))
    blocks.try_reserve(first, 12)
    first.num_computed = 12
    blocks.register_computed_blocks(first)
    blocks.free(first)
    assert blocks.num_free_blocks == 8  # cached blocks stay reusable
    again = _seq(range(12), request_id="again")
    assert blocks.allocate_cached_prefix(again) == 8  # 12 tokens: 2 blocks, the third holds the last token
    assert again.num_computed == 8
    other = _seq([0, 1, 2, 3, 9, 9, 9, 9, 9], request_id="other")
    assert blocks.allocate_cached_prefix(other) == 4
    assert blocks.prefix_cache_hits == 12


def test_cached_blocks_are_evicted_least_recently_released_first():
    blocks = BlockManager(num_blocks=3, block_size=2)
    seq = _seq(range(6))
    blocks.try_reserve(seq, 6)
    seq.num_computed = 6
    blocks.register_computed_blocks(seq)
    blocks.free(seq)
    big = _seq(range(100, 106), request_id="big")
    blocks.try_reserve(big, 6)  # needs every block: the cache is emptied
    assert blocks.num_free_blocks == 0
    blocks.free(big)
    assert blocks.allocate_cached_prefix(_seq(range(6), request_id="late")) == 0


def test_a_finished_sequences_last_token_never_enters_the_prefix_cache():
    """A sequence that ended in a step still pending when its window closed had steps planned past its
    end counted (`num_computed` 10 here), and its last token was sampled, never fed: the block it ends
    holds no KV for that slot, so only the blocks before it are cached. Running, every token on the host
    counts (the next step feeds the last one)."""
    blocks = BlockManager(num_blocks=8, block_size=4)
    ended = _seq(range(8), request_id="ended")
    blocks.try_reserve(ended, 10)
    ended.num_computed = 10
    ended.status = SequenceStatus.FINISHED_STOPPED
    blocks.register_computed_blocks(ended)
    assert ended.num_hashed_blocks == 1
    running = _seq(range(8), request_id="running")
    blocks.try_reserve(running, 10)
    running.num_computed = 8
    blocks.register_computed_blocks(running)
    assert running.num_hashed_blocks == 2
