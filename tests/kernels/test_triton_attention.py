"""Triton paged attention against the torch reference (TorchPagedAttention) on random inputs.

On a machine without CUDA these run in Triton's interpreter (tests/kernels/conftest.py sets
TRITON_INTERPRET=1) at tiny sizes; the larger cases and CUDA-graph capture are GPU-only.
"""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from lockstep_engine.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from lockstep_engine.kernels.triton_attention import TritonPagedAttention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu_only = pytest.mark.skipif(not CUDA, reason="GPU-only size (CPU runs use Triton's interpreter at tiny sizes)")

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}


# ---------------------------------------------------------------------------------------------
# Random batches
# ---------------------------------------------------------------------------------------------

class Batch:
    """A paged cache filled with random data, random (shuffled) block tables, and this step's q, k, v.

    `rows` is a list of (context, q_len): `context` tokens already cached, `q_len` new tokens.
    """

    def __init__(self, rows, heads, kv_heads, head_dim, block_size, dtype, seed=0, extra_table_cols=1,
                 decode=False):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.rows, self.block_size = rows, block_size
        seq_lens = [c + n for c, n in rows]
        blocks_per_row = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_row) + 3  # a few unused blocks
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.sink = num_blocks
        cols = max(blocks_per_row) + extra_table_cols
        table = torch.full((len(rows), cols), self.sink, dtype=torch.int64)
        cursor = 0
        for i, count in enumerate(blocks_per_row):
            table[i, :count] = torch.tensor(ids[cursor:cursor + count])
            cursor += count
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        tokens = sum(n for _, n in rows)
        self.q = torch.randn((tokens, heads, head_dim), generator=gen).to(dtype)
        self.k = torch.randn((tokens, kv_heads, head_dim), generator=gen).to(dtype)
        self.v = torch.randn((tokens, kv_heads, head_dim), generator=gen).to(dtype)
        slots, starts = [], [0]
        for i, (context, q_len) in enumerate(rows):
            for p in range(context, context + q_len):
                slots.append(int(table[i, p // block_size]) * block_size + p % block_size)
            starts.append(starts[-1] + q_len)
        self.table, self.slots, self.starts, self.seq_lens = table, slots, starts, seq_lens
        self.decode = decode
        if decode:
            assert all(n == 1 for _, n in rows)

    def meta(self, device=DEVICE, table_dtype=torch.int64, max_seq_len=None) -> AttentionMetadata:
        t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        return AttentionMetadata(
            slot_mapping=t(self.slots), block_tables=self.table.to(device=device, dtype=table_dtype),
            seq_lens=t(self.seq_lens),
            query_start_loc=None if self.decode else t(self.starts),
            query_start_loc_host=self.starts, seq_lens_host=self.seq_lens,
            max_seq_len=max(self.seq_lens) if max_seq_len is None else max_seq_len)

    def tensors(self, device=DEVICE, dtype=None):
        conv = (lambda x: x.to(device=device, dtype=dtype or x.dtype).clone())
        return [conv(x) for x in (self.q, self.k, self.v, self.k_cache, self.v_cache)]


def run_both(batch: Batch, heads, kv_heads, head_dim, dtype, backend=None, **meta_kwargs):
    """The triton backend on `dtype` data, and the torch reference on the same values in fp32."""
    backend = backend or TritonPagedAttention(heads, kv_heads, head_dim, batch.block_size)
    q, k, v, kc, vc = batch.tensors()
    out = backend(q, k, v, kc, vc, batch.meta(**meta_kwargs))
    reference = TorchPagedAttention(heads, kv_heads, head_dim, batch.block_size)
    rq, rk, rv, rkc, rvc = batch.tensors(device=torch.device("cpu"), dtype=torch.float32)
    expected = reference(rq, rk, rv, rkc, rvc, batch.meta(device=torch.device("cpu"), **meta_kwargs))
    return out, expected, (kc, vc), (rkc, rvc)


def assert_close(out, expected, dtype):
    assert out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def assert_cache_written(caches, ref_caches, batch: Batch):
    """Every real slot holds exactly this step's k / v (sink block excluded: nothing writes there here)."""
    for cache, ref in zip(caches, ref_caches):
        got = cache[:-1].float().cpu()
        assert torch.equal(got, ref[:-1]), "KV cache write differs from index_copy_"


def random_rows(rng: random.Random, count, max_context, max_q, decode_share=0.5):
    rows = []
    for _ in range(count):
        if rng.random() < decode_share:
            rows.append((rng.randint(0, max_context), 1))
        else:
            rows.append((rng.randint(0, max_context), rng.randint(1, max_q)))
    return rows


# ---------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: tiny sizes
# ---------------------------------------------------------------------------------------------

SHAPES = [(4, 4, 16), (6, 2, 16), (8, 2, 32)]  # GQA ratios 1, 3, 4


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_matches_index_copy(heads, kv_heads, head_dim, block_size):
    batch = Batch([(3, 5), (0, 17), (40, 1)], heads, kv_heads, head_dim, block_size, torch.float32, seed=1)
    backend = TritonPagedAttention(heads, kv_heads, head_dim, block_size)
    q, k, v, kc, vc = batch.tensors()
    backend.write_kv(k, v, kc, vc, batch.meta().slot_mapping)
    _, rk, rv, rkc, rvc = batch.tensors(device=torch.device("cpu"))
    TorchPagedAttention.write_kv(rk, rv, rkc, rvc, batch.meta(device=torch.device("cpu")).slot_mapping)
    assert torch.equal(kc.cpu(), rkc) and torch.equal(vc.cpu(), rvc)


# each GQA ratio with both dtypes and both block sizes, without the full product (interpreter time)
CASES = [(*SHAPES[0], 16, torch.float32), (*SHAPES[0], 32, torch.bfloat16), (*SHAPES[1], 16, torch.bfloat16),
         (*SHAPES[1], 32, torch.float32), (*SHAPES[2], 16, torch.float32), (*SHAPES[2], 32, torch.bfloat16)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", CASES)
def test_decode(heads, kv_heads, head_dim, block_size, dtype):
    # lengths 1, a block boundary +-1, more than one 64-key tile, none a multiple of block_size but one
    rows = [(0, 1), (block_size - 1, 1), (block_size, 1), (70, 1), (block_size * 3 + 4, 1)]
    batch = Batch(rows, heads, kv_heads, head_dim, block_size, dtype, seed=2, decode=True)
    out, expected, caches, ref_caches = run_both(batch, heads, kv_heads, head_dim, dtype)
    assert_close(out, expected, dtype)
    assert_cache_written(caches, ref_caches, batch)


@pytest.mark.parametrize("splits,heads,kv_heads,head_dim", [(2, 6, 2, 16), (7, 8, 2, 32)])
def test_decode_split_kv(splits, heads, kv_heads, head_dim):
    """Flash-decoding: several programs per row, including splits whose chunk is empty."""
    rows = [(0, 1), (20, 1), (129, 1)]
    batch = Batch(rows, heads, kv_heads, head_dim, 16, torch.float32, seed=3, decode=True)
    backend = TritonPagedAttention(heads, kv_heads, head_dim, 16, decode_splits=splits)
    out, expected, _, _ = run_both(batch, heads, kv_heads, head_dim, torch.float32, backend=backend)
    assert_close(out, expected, torch.float32)


def test_decode_split_heuristic(monkeypatch):
    """Splits only while the (row, kv head) programs are too few for the device: more waves for light
    programs (K and V under 512 bytes a token), no more chunks than MIN_SPLIT_TOKENS allows, never more than
    MAX_SPLITS; the bytes a token decide, not the head size alone."""
    import lockstep_engine.kernels.triton_attention as module

    monkeypatch.setattr(module, "_sm_count", lambda device: 132)
    heavy = TritonPagedAttention(32, 8, 128, 16)  # Llama-3-8B: 512 bytes a token in 16 bits
    light = TritonPagedAttention(9, 3, 64, 16)  # SmolLM2-135M: 256
    cuda = torch.device("cuda", 0)
    assert heavy.decode_splits(48, 330, cuda) == 1  # 384 programs: two waves of 132
    assert heavy.decode_splits(32, 330, cuda) == 2
    assert light.decode_splits(128, 330, cuda) == 2  # 384 programs: under four waves
    assert light.decode_splits(256, 330, cuda) == 1
    assert light.decode_splits(64, 330, cuda) > heavy.decode_splits(64 * 8 // 3, 330, cuda)
    # fp32: 512 bytes a token again, so the same split as the heavy shape at the same program count
    assert light.decode_splits(64, 330, cuda, element_size=4) == heavy.decode_splits(24, 330, cuda) == 2
    for rows in (1, 2, 8, 16, 32, 64):
        for length in (1, 63, 64, 330, 4096, 100_000):
            splits = light.decode_splits(rows, length, cuda)
            assert 1 <= splits <= light.MAX_SPLITS
            assert splits <= -(-length // light.MIN_SPLIT_TOKENS)  # no more chunks than MIN_SPLIT_TOKENS allows


def test_decode_respects_max_seq_len_and_int32_tables():
    """Like the reference, decode reads at most meta.max_seq_len keys; block tables may be int32."""
    rows = [(30, 1), (50, 1), (9, 1)]
    batch = Batch(rows, 4, 2, 16, 16, torch.float32, seed=4, decode=True, extra_table_cols=3)
    out, expected, _, _ = run_both(batch, 4, 2, 16, torch.float32, table_dtype=torch.int32, max_seq_len=40)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", CASES)
def test_prefill_mixed(heads, kv_heads, head_dim, block_size, dtype):
    # fresh prefill, a chunk after cached context (not block-aligned), decode rows, a long chunk
    rows = [(0, 19), (block_size + 5, 1), (37, 12), (0, 1), (3, 40)]
    batch = Batch(rows, heads, kv_heads, head_dim, block_size, dtype, seed=5)
    out, expected, caches, ref_caches = run_both(batch, heads, kv_heads, head_dim, dtype)
    assert_close(out, expected, dtype)
    assert_cache_written(caches, ref_caches, batch)


def test_prefill_fp16_and_random_rows():
    rng = random.Random(6)
    rows = random_rows(rng, 6, 50, 30)
    batch = Batch(rows, 6, 2, 16, 16, torch.float16, seed=6)
    out, expected, _, _ = run_both(batch, 6, 2, 16, torch.float16)
    assert_close(out, expected, torch.float16)


def test_rejects_unsupported_head_dim():
    with pytest.raises(ValueError, match="head_dim=80"):
        TritonPagedAttention(8, 2, 80, 16)


# ---------------------------------------------------------------------------------------------
# GPU only: model shapes, long contexts, many rows, CUDA graphs
# ---------------------------------------------------------------------------------------------

MODEL_SHAPES = [(9, 3, 64), (32, 8, 128), (8, 4, 16), (8, 8, 128)]  # SmolLM2, Llama-3-8B, random:tiny, MHA


@gpu_only
@pytest.mark.parametrize("heads,kv_heads,head_dim", MODEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_seqs,max_context", [(1, 3000), (7, 1500), (64, 700), (256, 300)])
def test_decode_gpu(heads, kv_heads, head_dim, dtype, num_seqs, max_context):
    rng = random.Random(num_seqs * 1000 + head_dim)
    rows = [(rng.randint(0, max_context), 1) for _ in range(num_seqs)]
    batch = Batch(rows, heads, kv_heads, head_dim, 16, dtype, seed=num_seqs, decode=True)
    out, expected, caches, ref_caches = run_both(batch, heads, kv_heads, head_dim, dtype)
    assert_close(out, expected, dtype)
    assert_cache_written(caches, ref_caches, batch)


@gpu_only
@pytest.mark.parametrize("heads,kv_heads,head_dim", MODEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_gpu(heads, kv_heads, head_dim, dtype, block_size):
    rng = random.Random(head_dim + block_size)
    rows = random_rows(rng, 12, 900, 600, decode_share=0.4) + [(0, 1000), (1234, 1)]
    batch = Batch(rows, heads, kv_heads, head_dim, block_size, dtype, seed=7)
    out, expected, caches, ref_caches = run_both(batch, heads, kv_heads, head_dim, dtype)
    assert_close(out, expected, dtype)
    assert_cache_written(caches, ref_caches, batch)


def replay_at_new_lengths(batch, tensors, meta, graph, out, heads, rng, rounds=3):
    """Writes new q, k, v, lengths and slots into a captured decode step's tensors `rounds` times; each
    replay's `out` must equal the torch reference over the cache as it was before the step's write."""
    q, k, v, kc, vc = tensors
    kv_heads, head_dim, bs = kc.shape[2], kc.shape[3], batch.block_size
    gen = torch.Generator().manual_seed(9)
    for _ in range(rounds):
        lens = [rng.randint(1, c + 1) for c, _ in batch.rows]
        slots = [int(batch.table[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        meta.seq_lens.copy_(torch.tensor(lens))
        meta.slot_mapping.copy_(torch.tensor(slots))
        ref_inputs = [x.float().cpu() for x in tensors]  # cache before this step's write
        graph.replay()
        torch.cuda.synchronize()
        ref_meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=batch.table,
                                     seq_lens=torch.tensor(lens), query_start_loc=None, max_seq_len=max(lens))
        assert_close(out, TorchPagedAttention(heads, kv_heads, head_dim, bs)(*ref_inputs, ref_meta), q.dtype)


@gpu_only
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_decode_cuda_graph_replays_at_new_lengths(splits):
    """Capture decode once, then change q/k/v, seq_lens and slots in place and replay."""
    heads, kv_heads, head_dim, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    rng = random.Random(8)
    rows = [(rng.randint(100, 900), 1) for _ in range(8)]
    batch = Batch(rows, heads, kv_heads, head_dim, bs, dtype, seed=8, decode=True)
    backend = TritonPagedAttention(heads, kv_heads, head_dim, bs, decode_splits=splits)
    q, k, v, kc, vc = batch.tensors()
    cap = batch.table.shape[1] * bs
    meta = batch.meta(max_seq_len=cap)
    backend(q, k, v, kc, vc, meta)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend(q, k, v, kc, vc, meta)
    replay_at_new_lengths(batch, (q, k, v, kc, vc), meta, graph, out, heads, rng)
