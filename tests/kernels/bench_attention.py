"""Decode (and a little prefill) attention timings for the Triton backend on the GPU. A script, not a test.

    python tests/kernels/bench_attention.py [--sweep-splits] [--no-torch] [--no-prefill]

Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128), bf16, block_size 16, every
row at the full context length, block ids shuffled. Bytes moved counts the KV read (the floor of
decode attention) plus q, out and this step's KV write; GB/s is that over the time. Times come from
triton.testing.do_bench (L2 flushed between calls), eager and as a replayed CUDA graph; the torch
reference (gather + SDPA) is timed eagerly for comparison.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "engine"))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from lockstep_engine.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from lockstep_engine.kernels.triton_attention import TritonPagedAttention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


def decode_case(batch: int, context: int, device):
    blocks_per_row = -(-context // BLOCK)
    num_blocks = batch * blocks_per_row
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    table = torch.tensor(ids, dtype=torch.int64, device=device).view(batch, blocks_per_row)
    shape = (num_blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)
    q = torch.randn((batch, HEADS, HEAD_DIM), dtype=DTYPE, device=device)
    k = torch.randn((batch, KV_HEADS, HEAD_DIM), dtype=DTYPE, device=device)
    v = torch.randn((batch, KV_HEADS, HEAD_DIM), dtype=DTYPE, device=device)
    pos = context - 1
    slots = table[:, pos // BLOCK] * BLOCK + pos % BLOCK
    meta = AttentionMetadata(slot_mapping=slots, block_tables=table,
                             seq_lens=torch.full((batch,), context, dtype=torch.int64, device=device),
                             query_start_loc=None, max_seq_len=context)
    return q, k, v, k_cache, v_cache, meta


def decode_bytes(batch: int, context: int) -> int:
    elem = torch.finfo(DTYPE).bits // 8
    kv_read = 2 * batch * context * KV_HEADS * HEAD_DIM * elem
    q_out = 2 * batch * HEADS * HEAD_DIM * elem
    kv_write = 2 * batch * KV_HEADS * HEAD_DIM * elem
    return kv_read + q_out + kv_write


def graph_of(fn):
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_decode(args, device):
    print(f"decode, Llama-3-8B attention (H={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}), {DTYPE}, block_size {BLOCK}")
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} {'MB moved':>9} {'eager us':>9} {'GB/s':>7} "
          f"{'graph us':>9} {'GB/s':>7} {'torch us':>9} {'speedup':>7}")
    for context in (512, 2048):
        for batch in (1, 32, 128, 256):
            q, k, v, kc, vc, meta = decode_case(batch, context, device)
            moved = decode_bytes(batch, context)
            backend = TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, BLOCK)
            splits = backend.decode_splits(batch, context, device)
            choices = [splits]
            if args.sweep_splits:
                choices = sorted({1, 2, 4, 8, 16, 32, splits})
            for s in choices:
                backend.fixed_decode_splits = s
                fn = lambda: backend(q, k, v, kc, vc, meta)  # noqa: E731
                eager_ms = do_bench(fn, warmup=25, rep=100)
                graph = graph_of(fn)
                graph_ms = do_bench(graph.replay, warmup=25, rep=100)
                torch_col = ""
                if not args.no_torch and s == splits:
                    ref = TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM, BLOCK)
                    torch_ms = do_bench(lambda: ref(q, k, v, kc, vc, meta), warmup=5, rep=30)
                    torch_col = f"{torch_ms * 1e3:9.1f} {torch_ms / graph_ms:6.1f}x"
                mark = "*" if s == splits else " "
                print(f"{batch:5d} {context:5d} {s:5d}{mark} {moved / 1e6:9.1f} {eager_ms * 1e3:9.1f} "
                      f"{moved / eager_ms / 1e6:7.0f} {graph_ms * 1e3:9.1f} {moved / graph_ms / 1e6:7.0f} {torch_col}")
                del graph
            del q, k, v, kc, vc, meta
            torch.cuda.empty_cache()
    print("(* = the heuristic's split count; GB/s = bytes moved / time; the H200's copy rate is ~4.3 TB/s)")


def bench_prefill(device):
    print("\nprefill, same shape: sequences x new tokens after a cached context; TFLOP/s counts causal QK^T + PV")
    print(f"{'seqs':>5} {'q_len':>6} {'context':>7} {'ms':>8} {'TFLOP/s':>8} {'torch ms':>9}")
    for seqs, q_len, context in ((1, 2048, 0), (4, 2048, 0), (8, 512, 1536), (16, 256, 0)):
        seq_len = q_len + context
        blocks_per_row = -(-seq_len // BLOCK)
        num_blocks = seqs * blocks_per_row
        ids = list(range(num_blocks))
        random.Random(1).shuffle(ids)
        table = torch.tensor(ids, dtype=torch.int64, device=device).view(seqs, blocks_per_row)
        shape = (num_blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
        kc = torch.randn(shape, dtype=DTYPE, device=device)
        vc = torch.randn(shape, dtype=DTYPE, device=device)
        tokens = seqs * q_len
        q = torch.randn((tokens, HEADS, HEAD_DIM), dtype=DTYPE, device=device)
        k = torch.randn((tokens, KV_HEADS, HEAD_DIM), dtype=DTYPE, device=device)
        v = torch.randn((tokens, KV_HEADS, HEAD_DIM), dtype=DTYPE, device=device)
        pos = torch.arange(context, seq_len, device=device)
        slots = (table[:, pos // BLOCK] * BLOCK + pos % BLOCK).reshape(-1)
        starts = [i * q_len for i in range(seqs + 1)]
        meta = AttentionMetadata(slot_mapping=slots, block_tables=table,
                                 seq_lens=torch.full((seqs,), seq_len, dtype=torch.int64, device=device),
                                 query_start_loc=torch.tensor(starts, device=device), query_start_loc_host=starts,
                                 seq_lens_host=[seq_len] * seqs, max_seq_len=seq_len)
        backend = TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, BLOCK)
        ms = do_bench(lambda: backend(q, k, v, kc, vc, meta), warmup=10, rep=50)
        ref = TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM, BLOCK)
        torch_ms = do_bench(lambda: ref(q, k, v, kc, vc, meta), warmup=3, rep=20)
        # causal: each query sees context + (its index + 1) keys on average ~ context + q_len / 2
        flops = 4 * seqs * HEADS * HEAD_DIM * q_len * (context + (q_len + 1) / 2)
        print(f"{seqs:5d} {q_len:6d} {context:7d} {ms:8.3f} {flops / ms / 1e9:8.1f} {torch_ms:9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep-splits", action="store_true", help="time several split-KV counts per case")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch reference timings")
    parser.add_argument("--no-prefill", action="store_true", help="decode only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}, triton {triton.__version__}")
    bench_decode(args, device)
    if not args.no_prefill:
        bench_prefill(device)


if __name__ == "__main__":
    main()
