"""`BlockManager`: the paged KV cache's bookkeeping. Plain Python, no torch.

Blocks hold `block_size` token slots. A block is shared by reference count (the n samples of one
prompt, or requests with a common prefix). Full blocks of computed tokens are registered in the
prefix cache under a chained hash (parent hash, token ids); a released cached block stays
reusable until its slot is needed (least recently released first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from lockstep_engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions


def _chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def _root_hash(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: its LoRA adapter's registration (None: the base model), so
    KV computed with one adapter's weights never serves another's prefix."""
    adapter = seq.request.adapter
    return None if adapter is None else hash(("lora", adapter.adapter_id))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: expected a positive integer")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # no cached content
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached content, LRU first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- allocation -----------------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            block_id, _ = self._free.popitem(last=False)
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self._blocks[block_id]
            del self._cached[block.block_hash]
            block.block_hash, block.token_ids = None, None
        else:
            raise NoFreeBlocksError("no free KV cache blocks")
        self._blocks[block_id].ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released twice"
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[block_id] = None
            else:
                self._free[block_id] = None

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Gives a sequence with no blocks the longest cached prefix of its tokens; returns its length.

        At least one token is always left to compute (its logits are needed), and the hit stops at a
        block boundary so that no shared cached block is ever written.
        """
        assert not seq.block_ids and seq.num_computed == 0
        if seq.request.params.prompt_logprobs is not None:
            return 0  # its prompt's logits are needed at every position, so all of it is computed (as in vLLM)
        limit = seq.compute_target - 1
        if not self.enable_prefix_caching or limit < self.block_size:
            if self.enable_prefix_caching:
                self.prefix_cache_queries += max(limit, 0)
            return 0
        self.prefix_cache_queries += limit
        parent_hash = _root_hash(seq)
        size = self.block_size
        for start in range(0, limit - size + 1, size):
            token_ids = tuple(seq.token_ids[start:start + size])
            block_hash = _chain_hash(parent_hash, token_ids)
            block_id = self._cached.get(block_hash)
            if block_id is None or self._blocks[block_id].token_ids != token_ids:
                break
            self._ref(block_id)
            seq.block_ids.append(block_id)
            seq.block_hashes.append(block_hash)
            parent_hash = block_hash
        seq.num_hashed_blocks = len(seq.block_ids)
        seq.num_computed = len(seq.block_ids) * size
        self.prefix_cache_hits += seq.num_computed
        return seq.num_computed

    def try_reserve(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]] | None:
        """Makes slots [num_computed, num_tokens) writable; returns (src, dst) block copies to run first,
        or None (and nothing changed) when too few blocks are free.

        This is the lookahead reservation of a multi-step window: every slot the window may write is
        owned before the window starts, so the device never waits for the host mid-window. A decoding
        sequence needs a new block only every `block_size` tokens: most calls take nothing and return
        at once.
        """
        size, held = self.block_size, len(seq.block_ids)
        num_new = -(-num_tokens // size) - held
        # Copy-on-write when the first slot to write lies in a shared, partly filled block. Only a fork
        # shares a block that is written to (a prefix-cache hit shares full blocks, which no sequence
        # writes again), so only the blocks the sequence held when it forked are looked at.
        first_write = seq.num_computed // size
        copy = (first_write < seq.num_forked_blocks and num_tokens > seq.num_computed
                and self._blocks[seq.block_ids[first_write]].ref_count > 1)
        if num_new <= 0 and not copy:
            return []
        num_new = max(num_new, 0)
        if num_new + copy > self.num_free_blocks:
            return None
        copies = []
        if copy:
            shared = seq.block_ids[first_write]
            fresh = self._take_block()
            self._unref(shared)
            seq.block_ids = seq.block_ids[:first_write] + [fresh] + seq.block_ids[first_write + 1:]  # a new list
            copies.append((shared, fresh))
        for _ in range(num_new):
            seq.block_ids.append(self._take_block())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent."""
        for block_id in parent.block_ids:
            self._ref(block_id)
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.num_computed = parent.num_computed
        parent.num_forked_blocks = child.num_forked_blocks = len(parent.block_ids)

    def free(self, seq: Sequence) -> None:
        # Released back to front, so a prefix's tail is evicted before its head.
        for block_id in reversed(seq.block_ids):
            self._unref(block_id)
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_forked_blocks = 0

    # ---- prefix cache -----------------------------------------------------------------------
    def register_computed_blocks(self, seq: Sequence) -> None:
        """Adds the sequence's newly completed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        # A block's last tokens may be computed on the device and not on the host yet (`Sequence.num_pending`):
        # it is hashed once they are. A finished sequence's last token may never have been fed (its slot
        # holds no KV), and its `num_computed` may count steps planned past its end: it stops before that token.
        on_host = len(seq.token_ids) - seq.is_finished
        num_full = min(min(seq.num_computed, on_host) // size, len(seq.block_ids))
        while seq.num_hashed_blocks < num_full:
            index = seq.num_hashed_blocks
            parent_hash = seq.block_hashes[index - 1] if index else _root_hash(seq)
            token_ids = tuple(seq.token_ids[index * size:(index + 1) * size])
            block_hash = _chain_hash(parent_hash, token_ids)
            block = self._blocks[seq.block_ids[index]]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash, block.token_ids = block_hash, token_ids
                self._cached[block_hash] = block.block_id
            seq.block_hashes.append(block_hash)
            seq.num_hashed_blocks += 1
