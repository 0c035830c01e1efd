"""One-shot GPU run: correctness checks, the sharegpt-synth headline for several N, the transformers
continuous-batching peer, and a decode roofline. Prints one table; writes JSON and logs to $OUT.

    PYTHONPATH=.:engine python benchmarks/gpu_run.py --num-prompts 1000 --steps 1 8 auto
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import traceback

import torch

from lockstep.bench.workload import make_workload
from lockstep_engine.config import SCHEDULING_POLICIES, num_scheduler_steps_arg
from lockstep.bench.offline import greedy_requests, run_offline
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams

OUT = os.environ.get("OUT", ".bench")
RESULTS: dict = {}


def log(message: str) -> None:
    print(f"[gpu_run] {message}", file=sys.stderr, flush=True)


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(round(q / 100 * (len(values) - 1))), len(values) - 1)]


def summary(values_s):
    ms = [v * 1e3 for v in values_s]
    return {"mean": statistics.fmean(ms) if ms else float("nan"), "median": percentile(ms, 50),
            "p99": percentile(ms, 99)}


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - start)  # read + write bytes/s


def prefill_warm_up(llm: LLM, prompts, count: int = 64) -> None:
    """Prefills prompts of the workload's first `count` lengths (other tokens: no prefix-cache hits for
    the timed run) so that kernels compile before any timed run. Triton compiles a kernel per
    specialisation on first use; in a fresh process the first timed run otherwise pays for it
    (measured: TP=1 N=8 on 300 requests, 5.93 s of first-step device time cold, 2.76 s warm)."""
    vocab = llm.engine.model_config.vocab_size
    shifted = [{"prompt_token_ids": [(t + 7) % (vocab - 1) + 1 for t in p]} for p in prompts[:count]]
    llm.generate(shifted, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


def run_workload(llm: LLM, prompts, params, label: str) -> dict:
    stats = llm.engine.core.stats
    first, last, counts, gaps = {}, {}, {}, []

    def on_step(outputs):
        now = time.perf_counter()
        for o in outputs:
            if not o.token_ids:
                continue
            rid = o.request_id
            if rid not in first:
                first[rid] = now
            elif rid in last:
                gaps.append(now - last[rid])
            last[rid] = now
            counts[rid] = counts.get(rid, 0) + len(o.token_ids)

    run = run_offline(llm, prompts, params, progress=lambda message: log(f"{label}: {message}"),
                      progress_every_s=15, on_step=on_step)
    ids, t0 = run.request_ids, run.started_s
    ttft = [first[r] - t0 for r in ids]
    tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in ids if counts[r] > 1]
    intra = [g for g in stats.gaps_s]
    busy = stats.forward_s
    return {
        "requests": len(ids), "elapsed_s": run.elapsed_s, "req_per_s": run.requests_per_s,
        "output_tok_per_s": run.output_tokens_per_s,
        "total_tok_per_s": run.total_tokens_per_s,
        "ttft_ms": summary(ttft), "tpot_ms": summary(tpot), "itl_ms": summary(gaps),
        "mean_gap_us": 1e6 * statistics.fmean(intra) if intra else float("nan"),
        "mean_boundary_gap_us": 1e6 * statistics.fmean(stats.boundary_gaps_s) if stats.boundary_gaps_s else float("nan"),
        "idle_fraction": 1 - busy / run.elapsed_s,
        "steps": stats.num_steps, "windows": stats.num_windows,
        "window_steps": dict(sorted(collections.Counter(stats.window_steps).items())),  # planned N: windows
        "median_boundary_gap_us": 1e6 * statistics.median(stats.boundary_gaps_s) if stats.boundary_gaps_s else float("nan"),
        "mean_batch": statistics.fmean(stats.step_batch_sizes) if stats.step_batch_sizes else 0,
        "step_ms": 1e3 * busy / max(stats.num_steps, 1),
        # the step timer never waits on the device in steady state; the pinned output ring stops growing
        "forced_syncs": llm.engine.executor.runner.clock.num_forced_syncs,
        "host_ring_slots": llm.engine.executor.runner.host_ring.num_slots if llm.engine.executor.runner.host_ring else 0,
        "breakdown": breakdown(stats, run.elapsed_s),
    }


def breakdown(stats, elapsed_s: float) -> dict:
    """Where the wall time went: device time of windows' first steps (which carry the prefill chunks)
    and of their decode steps 2..N, host time, and the decode step time by batch size."""
    decode_s = sum(stats.decode_step_s)
    by_batch = {}
    for low, high in ((1, 16), (17, 64), (65, 160), (161, 512)):
        times = [t for t, b in zip(stats.decode_step_s, stats.decode_step_batch) if low <= b <= high]
        if times:
            by_batch[f"{low}-{high}"] = {"steps": len(times), "median_ms": 1e3 * statistics.median(times),
                                         "total_s": sum(times)}
    return {"first_step_device_s": stats.forward_s - decode_s, "decode_device_s": decode_s,
            "host_s": elapsed_s - stats.forward_s, "prompt_tokens_computed": stats.num_prompt_tokens_computed,
            "wasted_tokens": stats.num_wasted_tokens, "schedule_s": stats.schedule_s,
            "prepare_s": stats.prepare_s, "update_s": stats.update_s, "output_s": stats.output_s,
            "decode_step_by_batch": by_batch}


def decode_batch(base: LLM, args, batch: int, steps: int, eager: bool = False) -> LLM:
    """An engine whose `batch` rows have all finished their prompts (`roofline_context` tokens each) and
    are decoding, so its next windows time pure decode steps with every row present."""
    llm = LLM(args.model, share_model_with=base, num_scheduler_steps=steps, max_num_seqs=batch,
              max_model_len=args.max_model_len, max_num_batched_tokens=16384, enforce_eager=eager)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request([(97 * i + k) % (vocab - 1) + 1 for k in range(args.roofline_context)],
                           SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True))
    while engine.core.scheduler.waiting:
        engine.step()
    engine.step()  # the last prompts' prefill ends; this bucket's graph is captured
    return llm


def device_kernels(prof, per: int) -> tuple[float, float, list]:
    """Device time (us), kernel launches and the 12 costliest kernels of a profile, each divided by
    `per` (steps or windows). Device kernels only: CPU-side aten ops report their kernels' time too."""
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0 and not e.key.startswith("aten::")]
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    return (sum(e.self_device_time_total for e in events) / per, sum(e.count for e in events) / per,
            [(e.key[:90], round(e.self_device_time_total / per), e.count // per) for e in top])


def kernel_profile(base: LLM, args) -> dict:
    """torch.profiler over one pure-decode window (graph replays, and eager) at a few batch sizes:
    the kernels that take the device time, written to $OUT/profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    report, lines = {}, []
    for batch in (4, 256):
        for eager in (False, True):
            engine = decode_batch(base, args, batch, 8, eager).engine
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            key = f"batch {batch} {'eager' if eager else 'graphs'}"
            total_us, kernels, top = device_kernels(prof, per=8)
            report[key] = {"device_ms_per_step": total_us / 1e3, "kernels_per_step": kernels, "top": top}
            lines.append(f"== {key}: {total_us / 1e3:.3f} ms device time per step (8-step window)")
            lines.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=80))
            log(f"profile {key}: {total_us / 8 / 1e3:.3f} ms/step; top: {report[key]['top'][:4]}")
    # Windows 20-22 of the N=8 workload: their first steps carry prefill chunks next to ~256 decode rows.
    llm = LLM(args.model, share_model_with=base, num_scheduler_steps=8, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    for prompt, param in zip(args.workload_prompts, args.workload_params):
        engine.add_request(prompt, param)
    for _ in range(20):
        engine.step()
    stats = engine.core.stats
    tokens_before, windows = stats.num_prompt_tokens_computed, 3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(windows):
            engine.step()
        torch.cuda.synchronize()
    key = "workload windows 20-22"
    total_us, _, top = device_kernels(prof, per=windows)
    report[key] = {"device_ms_per_window": total_us / 1e3,
                   "prefill_tokens": stats.num_prompt_tokens_computed - tokens_before, "top": top}
    lines.append(f"== {key}: {total_us / 1e3:.3f} ms device time per window, "
                 f"{report[key]['prefill_tokens']} prefill tokens in the {windows} windows")
    lines.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=80))
    log(f"profile {key}: {report[key]}")
    for request_id in list(engine.core.requests):
        engine.abort_request(request_id)
    with open(os.path.join(OUT, "profile.txt"), "w") as f:
        f.write("\n".join(lines))
    return report


def roofline(base: LLM, args, bandwidth: float, batches=(1, 32, 128, 256)) -> list[dict]:
    """Decode step time with every row present vs (weight bytes + KV bytes read) / copy bandwidth."""
    mc = base.engine.model_config
    weight_bytes = mc.num_parameters * 2
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    rows = []
    for batch in batches:
        llm = decode_batch(base, args, batch, 16)
        engine = llm.engine
        stats, running = engine.core.stats, engine.core.scheduler.running
        first = len(stats.decode_step_s)
        lengths = []
        for _ in range(3):  # timings arrive as the device finishes them: the third window harvests the second
            lengths.append(statistics.fmean(len(seq.token_ids) for seq in running) + 8)
            engine.step()
        times = sorted(t for t, b in zip(stats.decode_step_s[first:], stats.decode_step_batch[first:]) if b == batch)
        step_s = times[len(times) // 2]
        kv_bytes = batch * statistics.fmean(lengths) * kv_per_token
        ideal = (weight_bytes + kv_bytes) / bandwidth
        rows.append({"batch": batch, "context": statistics.fmean(lengths), "steps_timed": len(times),
                     "step_ms": step_s * 1e3, "roofline_ms": ideal * 1e3, "ratio": step_s / ideal})
        log(f"roofline {rows[-1]}")
    return rows


FAST_BACKEND = "triton"  # compared with the torch reference backend (the CPU tests swap in torch)


def greedy_match(base: LLM, args) -> dict:
    """Triton vs torch attention on the same weights: first 32 greedy tokens of 64 prompts."""
    vocab = base.engine.model_config.vocab_size
    prompts = [[(7919 * i + 31 * k) % (vocab - 1000) + 1000 for k in range(16 + 5 * i)] for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    # Without logprobs the decode steps run as CUDA graph replays (decode-only windows from step 1 on);
    # with them, eagerly: triton_graphs vs triton compares the two paths.
    plain = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    fast = FAST_BACKEND
    for name, backend, steps, fused, sampling in (
            ("torch", "torch", 8, True, params), ("triton", fast, 8, True, params),
            ("triton_n1", fast, 1, True, params), ("triton_unfused", fast, 8, False, params),
            ("triton_graphs", fast, 8, True, plain)):
        try:
            set_fused_kernels(fused)
            llm = LLM(args.model, share_model_with=base, attention_backend=backend, num_scheduler_steps=steps,
                      max_model_len=args.max_model_len)
            assert llm.engine.executor.runner.backend.name == backend, (llm.engine.executor.runner.backend.name, backend)
            results[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
        except Exception as error:  # the report says which variant failed and why
            results[name] = repr(error)
            log(f"{name} failed: {traceback.format_exc()}")
        finally:
            set_fused_kernels(True)
    if any(isinstance(v, str) for v in results.values()):
        return {"error": {k: v for k, v in results.items() if isinstance(v, str)}}
    same, torch_found = first_divergences(results["torch"], results["triton"])
    n_same, n_found = first_divergences(results["triton_n1"], results["triton"])
    fused_same, fused_found = first_divergences(results["triton_unfused"], results["triton"])
    graphs_same, graphs_found = first_divergences(results["triton"], results["triton_graphs"])
    first = torch_found[0] if torch_found else None
    total = len(results["torch"])
    return {"prompts": total, "identical": same, "match_rate": same / total,
            "first_divergence": first and {"prompt": first["prompt"], "position": first["position"],
                                           "torch_top2_gap": first["gap"]},
            "triton_vs_torch_first_divergence_top2_gaps": rounded_gaps(torch_found, 32),
            "triton_vs_torch_cross_top2": {"divergences": len(torch_found),
                                           "each_token_in_the_others_top2": sum(d["cross_top2"] for d in torch_found)},
            "triton_n1_vs_n8_identical": n_same, "n1_vs_n8_first_divergence_top2_gaps": rounded_gaps(n_found, 16),
            "fused_vs_unfused_identical": fused_same,
            "fused_vs_unfused_first_divergence_top2_gaps": rounded_gaps(fused_found, 16),
            "graphs_vs_eager_identical": graphs_same,
            "graphs_vs_eager_first_divergence_top2_gaps": rounded_gaps(graphs_found, 16)}


def first_divergences(reference, other) -> tuple[int, list[dict]]:
    """(prompts with identical tokens, and for each prompt whose tokens differ: the prompt, the first
    position where they differ, the reference's top-2 logprob gap there and, when `other` has logprobs
    too, whether each side's token is among the other's top 2: the near-tie rule of docs/ARCHITECTURE.md).
    `reference` was generated with logprobs."""
    same, found = 0, []
    for index, (a, b) in enumerate(zip(reference, other)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ta == tb:
            same += 1
            continue
        k = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        top = a.outputs[0].logprobs[k].top
        entry = {"prompt": index, "position": k, "gap": top[0][1] - top[1][1] if len(top) > 1 else None}
        if b.outputs[0].logprobs:
            entry["cross_top2"] = tb[k] in [t for t, _ in top] and \
                ta[k] in [t for t, _ in b.outputs[0].logprobs[k].top]
        found.append(entry)
    return same, found


def rounded_gaps(found: list[dict], limit: int) -> list:
    return [None if d["gap"] is None else round(d["gap"], 5) for d in found[:limit]]


def set_fused_kernels(on: bool) -> None:
    """Fused Triton RMSNorm/rotary/SiLU-mul on or off for the forwards that follow (layers reads the
    switch once and caches it; clearing the cache makes it read the switch again)."""
    from lockstep_engine import layers

    if on:
        os.environ.pop(layers.FUSED_KERNELS_ENV, None)
    else:
        os.environ[layers.FUSED_KERNELS_ENV] = "0"
    layers._fused_kernels.cache_clear()


def peer(args, prompts, lengths) -> dict:
    """Hugging Face transformers continuous batching (paged|sdpa) on the same requests."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from lockstep_engine.model_config import RANDOM_SHAPES

    shape = RANDOM_SHAPES[args.model.split(":", 1)[1]]
    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
                         num_attention_heads=shape.num_attention_heads,
                         num_key_value_heads=shape.num_key_value_heads, rope_theta=shape.rope_theta,
                         max_position_embeddings=shape.max_position_embeddings)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "paged|sdpa"
    model.eval()
    gen = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=0,
                           use_cuda_graph=False)
    t0 = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    out_tokens = done = 0
    deadline = t0 + args.peer_timeout  # the whole peer run; past it, report what finished
    for _ in ids:
        result = manager.get_result(timeout=max(deadline - time.perf_counter(), 0.1))
        if result is None:
            break
        done += 1
        out_tokens += len(result.generated_tokens)
    elapsed = time.perf_counter() - t0
    manager.stop(block=done == len(ids))  # a stuck peer is left behind, not waited for
    del model
    torch.cuda.empty_cache()
    return {"requests": len(ids), "finished": done, "elapsed_s": elapsed, "req_per_s": done / elapsed,
            "output_tok_per_s": out_tokens / elapsed, "output_tokens": out_tokens,
            "partial": done < len(ids)}


def extra_run(spec: str, args) -> tuple[str, int | str, int, int, str]:
    """(name, N, max_num_batched_tokens, max_num_seqs, scheduling_policy) of an --extra-runs entry such
    as 'n=8,seqs=512,policy=lof'."""
    values = {"n": "8", "mbt": str(args.max_num_batched_tokens), "seqs": str(args.max_num_seqs),
              "policy": args.scheduling_policy}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key not in values or not value:
            raise SystemExit(f"--extra-runs: {item!r} is invalid: expected n=, mbt=, seqs= or policy= with a value")
        values[key] = value
    n = num_scheduler_steps_arg(values["n"])
    name = f"N={n} mbt={values['mbt']} seqs={values['seqs']}" + \
        (f" {values['policy']}" if values["policy"] != "fcfs" else "")
    return name, n, int(values["mbt"]), int(values["seqs"]), values["policy"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--peer-prompts", type=int, default=200)
    parser.add_argument("--steps", type=num_scheduler_steps_arg, nargs="+", default=[1, 8, "auto"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--roofline-context", type=int, default=512)
    parser.add_argument("--peer-timeout", type=float, default=600)
    parser.add_argument("--skip", nargs="*", default=[], help="any of: peer match runs roofline profile")
    parser.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES))
    parser.add_argument("--extra-runs", nargs="*", default=[], metavar="KEY=VALUE,...",
                        help="more runs, each overriding n (default 8), mbt (max_num_batched_tokens), "
                             "seqs (max_num_seqs) or policy (scheduling_policy), e.g. 'seqs=512' 'n=8,policy=lof'")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    workload = make_workload("sharegpt-synth", args.num_prompts, seed=0, vocab_size=128256)
    prompts, params = greedy_requests(workload)
    args.workload_prompts, args.workload_params = prompts, params
    lengths = [r.output_len for r in workload]
    if args.peer_prompts and "peer" not in args.skip:
        # First, while the whole GPU is free for its paged cache.
        try:
            RESULTS["peer"] = peer(args, prompts[:args.peer_prompts], lengths[:args.peer_prompts])
        except Exception:
            RESULTS["peer"] = {"error": traceback.format_exc()[-2000:]}
        log(f"peer: {RESULTS['peer']}")
        torch.cuda.empty_cache()
    bandwidth = copy_bandwidth()
    RESULTS["copy_bandwidth_TBps"] = bandwidth / 1e12
    log(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if {"match", "runs", "roofline", "profile"} <= set(args.skip):  # the peer alone (e.g. on another GPU)
        json.dump(RESULTS, open(os.path.join(OUT, "results.json"), "w"), indent=2)
        print_table()
        sys.stdout.flush()
        os._exit(0)  # a peer cut off at its deadline may leave its generation thread running
    base = LLM(args.model, num_scheduler_steps=1, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens)
    RESULTS["backend"] = base.engine.executor.runner.backend.name
    RESULTS["kv_blocks"] = base.engine.executor.runner.num_blocks
    if "match" not in args.skip:
        RESULTS["greedy_match_triton_vs_torch"] = greedy_match(base, args)
        log(f"greedy match: {RESULTS['greedy_match_triton_vs_torch']}")
    RESULTS["runs"] = {}
    if "runs" not in args.skip:
        prefill_warm_up(base, prompts)
    variants = [] if "runs" in args.skip else \
        [(f"N={n}", n, args.max_num_batched_tokens, args.max_num_seqs, args.scheduling_policy)
         for n in args.steps] + [extra_run(spec, args) for spec in args.extra_runs]
    for name, n, batched, seqs, policy in variants:
        llm = LLM(args.model, share_model_with=base, num_scheduler_steps=n, max_model_len=args.max_model_len,
                  max_num_seqs=seqs, max_num_batched_tokens=batched, scheduling_policy=policy)
        if llm.engine.executor.runner.graphs is not None:
            llm.engine.executor.runner.graphs.warmup(seqs)
        log(f"sharegpt-synth {name}")
        try:
            RESULTS["runs"][name] = run_workload(llm, prompts, params, name)
        except Exception:
            RESULTS.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            log(RESULTS["errors"][name])
            continue
        log(json.dumps(RESULTS["runs"][name]))
        json.dump(RESULTS, open(os.path.join(OUT, "results.json"), "w"), indent=2)
    for part, function in (("roofline", lambda: roofline(base, args, bandwidth)),
                           ("profile", lambda: kernel_profile(base, args))):
        if part in args.skip:
            continue
        try:
            RESULTS[part] = function()
        except Exception:
            RESULTS.setdefault("errors", {})[part] = traceback.format_exc()[-3000:]
            log(RESULTS["errors"][part])
        json.dump(RESULTS, open(os.path.join(OUT, "results.json"), "w"), indent=2)
    if args.peer_prompts and "runs" not in args.skip:
        llm = LLM(args.model, share_model_with=base, num_scheduler_steps=8, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  scheduling_policy=args.scheduling_policy)
        RESULTS["runs"][f"N=8 first {args.peer_prompts}"] = run_workload(
            llm, prompts[:args.peer_prompts], params[:args.peer_prompts], "N=8 peer-sized")
    json.dump(RESULTS, open(os.path.join(OUT, "results.json"), "w"), indent=2)
    print_table()
    return 0


def print_table() -> None:
    print(f"device: {RESULTS['device']}  backend: {RESULTS.get('backend')}  copy bw: "
          f"{RESULTS['copy_bandwidth_TBps']:.2f} TB/s")
    head = f"{'run':<10}{'req/s':>8}{'out tok/s':>10}{'tot tok/s':>10}" \
           f"{'TTFT mean/med/p99 ms':>24}{'TPOT mean/med/p99':>22}{'ITL mean/med/p99':>22}{'gap us':>8}{'bnd us':>8}{'idle':>7}"
    print(head)
    for name, r in RESULTS.get("runs", {}).items():
        f = lambda d: f"{d['mean']:.0f}/{d['median']:.0f}/{d['p99']:.0f}"
        g = lambda d: f"{d['mean']:.1f}/{d['median']:.1f}/{d['p99']:.1f}"
        print(f"{name:<10}{r['req_per_s']:>8.2f}{r['output_tok_per_s']:>10.0f}{r['total_tok_per_s']:>10.0f}"
              f"{f(r['ttft_ms']):>24}{g(r['tpot_ms']):>22}{g(r['itl_ms']):>22}{r['mean_gap_us']:>8.1f}{r['mean_boundary_gap_us']:>8.0f}"
              f"{r['idle_fraction']:>7.1%}")
        b = r.get("breakdown")
        if b:
            batches = ", ".join(f"{k}: {v['steps']} steps x {v['median_ms']:.2f} ms"
                                for k, v in b["decode_step_by_batch"].items())
            print(f"{'':<10}device: first steps {b['first_step_device_s']:.1f} s, decode steps "
                  f"{b['decode_device_s']:.1f} s; host {b['host_s']:.1f} s; windows {r['windows']}, steps "
                  f"{r['steps']}, mean batch {r['mean_batch']:.0f}; decode step by batch: {batches}")
    if "peer" in RESULTS:
        print("peer:", json.dumps(RESULTS["peer"])[:400])
    for row in RESULTS.get("roofline", []):
        print(f"roofline batch {row['batch']:>4}: step {row['step_ms']:.2f} ms vs ideal {row['roofline_ms']:.2f} ms "
              f"({row['ratio']:.2f}x)")
    for name, p in RESULTS.get("profile", {}).items():
        per = f"{p['device_ms_per_step']:.3f} ms/step" if "device_ms_per_step" in p else \
            f"{p['device_ms_per_window']:.1f} ms/window, {p['prefill_tokens']} prefill tokens in 3"
        print(f"profile {name}: {per}; " +
              "; ".join(f"{k[:40]} {us} us x{c}" for k, us, c in p["top"][:6]))
    if "greedy_match_triton_vs_torch" in RESULTS:
        print("greedy match:", RESULTS["greedy_match_triton_vs_torch"])
    for name, error in RESULTS.get("errors", {}).items():
        print(f"ERROR {name}: {error[-600:]}")


if __name__ == "__main__":
    sys.exit(main())
