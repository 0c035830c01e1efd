"""The served headline (requests/s at rate inf) on one H200, in one device call of under nine minutes.

`lockstep bench serve` (sharegpt-synth seed 0, token-id prompts, ignore_eos, streamed) against
`lockstep serve random:llama-3-8b --dtype bfloat16` with default flags, then with
`--num-scheduler-steps 1`:

1. default server, fresh: start-up time (launch -> /health 200; the server's own load / warm-up
   split from its log), then rate inf, 1000 requests: its first run;
2. the same lengths again with other token ids (`--vocab-size`, so nothing hits the prefix cache):
   the warm run the first must be within 3% of;
3. Poisson 10 and 25 req/s (400 requests each);
4. the N=1 server: Poisson 10 and 25, then rate inf.

Each run reports req/s, output tok/s, TTFT p50/p99, TPOT p50, ITL p99/max from the client, the
engine's idle fraction and median window-boundary gap from /metrics deltas, the load client's CPU
(user + system over wall: it is one asyncio process, so 1.0 is its ceiling), and the Triton kernels
compiled during the run (files added to a fresh TRITON_CACHE_DIR: 0 when the warm-up compiled all).
Results go to $OUT/served.json, plots to $OUT/served_throughput.png and $OUT/served_latency.png.
A phase that would not fit the time left (`--budget`) is skipped and says so.

    bash benchmarks/h200_session.sh served           # on the H200, wheels from .whl (fetch_gpu_wheels.sh)
    bash benchmarks/h200_session.sh sweep            # --settings: server settings side by side, rate inf only
    bash benchmarks/h200_session.sh poisson          # --poisson-settings: a Poisson sweep over --rates per setting
    LOCKSTEP_SERVED_SMALL=1 OUT=/tmp/served python benchmarks/h200_served.py   # CPU dry run, random:tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SMALL = os.environ.get("LOCKSTEP_SERVED_SMALL") == "1"
GAP = "lockstep_step_gap_seconds"


def log(message: str) -> None:
    print(f"[h200_served] {message}", file=sys.stderr, flush=True)


CLIENT_PROCESSES = 1  # --client-processes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:tiny" if SMALL else "random:llama-3-8b")
    parser.add_argument("--server-args", default="--device cpu --max-model-len 2048" if SMALL else "--dtype bfloat16",
                        help="flags every server gets (the rest are defaults)")
    parser.add_argument("--num-prompts", type=int, default=12 if SMALL else 1000)
    parser.add_argument("--sweep-prompts", type=int, default=8 if SMALL else 400)
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 25.0])
    parser.add_argument("--vocab-sizes", type=int, nargs=2, default=[1024, 1020] if SMALL else [32000, 64000],
                        help="prompt ids below these: first and warm run (other ids, same lengths)")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET_S", 510)),
                        help="seconds for everything; phases that would not fit are skipped")
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes per run (`bench serve --num-client-processes`): one saturates a core "
                             "near 10k chunks/s, below what a small model is served at")
    parser.add_argument("--settings", nargs="+", default=None, metavar="NAME=FLAGS",
                        help='instead of the headline plan: one rate-inf run per server setting, e.g. '
                             '"seqs512=--max-num-seqs 512" (NAME=, nothing after it: default flags)')
    parser.add_argument("--poisson-settings", nargs="+", default=None, metavar="NAME=FLAGS",
                        help="instead of the headline plan: per server setting (as --settings), one Poisson run "
                             "per --rates, each --arrival-s seconds of arrivals (rate x that many requests)")
    parser.add_argument("--arrival-s", type=float, default=3.0 if SMALL else 15.0,
                        help="with --poisson-settings: seconds of arrivals per rate")
    parser.add_argument("--extra-settings", nargs="+", default=[], metavar="NAME=FLAGS",
                        help="after the headline plan: one rate-inf run per server setting, as --settings")
    return parser.parse_args()


# ---- the server ----------------------------------------------------------------------------
class Server:
    started_count = 0  # each server its own port: a stopped one's may linger in TIME_WAIT

    def __init__(self, model: str, flags: list[str], name: str, out: str, env: dict):
        self.name = name
        Server.started_count += 1
        self.port = 18000 + Server.started_count
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(out, f"server_{name}.log")
        self._log = open(self.log_path, "wb")
        command = [sys.executable, "-m", "lockstep.cli", "serve", model, "--host", "127.0.0.1", "--port",
                   str(self.port), *flags]
        log(f"{name}: {' '.join(command[2:])}")
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=False)
        self.startup_s = None

    def wait_healthy(self, timeout_s: float) -> float:
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - self.started
                    return self.startup_s
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as handle:
            return handle.read().decode(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def startup_line(self) -> str | None:
        return next((line for line in self.log_text().splitlines() if "[lockstep] start-up:" in line), None)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


# /metrics samples summed over their labels, by the key scrape() files them under
_SUMMED = {
    "lockstep_gpu_busy_seconds_total": "busy",
    "lockstep_gpu_idle_seconds_total": "idle",
    "lockstep_prefix_cache_hits_total": "prefix_hits",
    "lockstep_prefix_cache_queries_total": "prefix_queries",
    "lockstep_scheduler_window_steps_count": "windows",
    "lockstep_scheduler_window_steps_sum": "steps",
    "lockstep_scheduler_window_cuts_total": "cuts",
    "lockstep_scheduler_overlapped_windows_total": "overlapped",
}


def scrape(url: str) -> dict:
    """The engine counters the runs are judged by, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    values = {"busy": 0.0, "idle": 0.0, "prefix_hits": 0.0, "prefix_queries": 0.0, "boundary_buckets": {},
              "windows": 0.0, "steps": 0.0, "cuts": 0.0, "overlapped": 0.0, "occupancy": None, "host": {},
              "busy_by_phase": {}, "forwards_by_phase": {}, "gap_by_boundary": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("lockstep_gpu_busy_seconds_total", "lockstep_step_duration_seconds_count"):
                # device time and forwards per step phase (prefill: steps with prompt tokens)
                split = "busy_by_phase" if sample.name.startswith("lockstep_gpu") else "forwards_by_phase"
                phase = sample.labels.get("phase", "")
                values[split][phase] = values[split].get(phase, 0.0) + sample.value
            key = _SUMMED.get(sample.name)
            if key is not None:
                values[key] += sample.value
            elif sample.name == "lockstep_gpu_occupancy_ratio":
                values["occupancy"] = sample.value
            elif sample.name == "lockstep_host_phase_seconds_sum":  # the core's host work, per phase
                phase = sample.labels.get("phase", "")
                values["host"][phase] = values["host"].get(phase, 0.0) + sample.value
            elif sample.name == f"{GAP}_sum":  # idle before a window's first step, and between its steps
                boundary = sample.labels.get("boundary", "")
                values["gap_by_boundary"][boundary] = values["gap_by_boundary"].get(boundary, 0.0) + sample.value
            elif sample.name == f"{GAP}_bucket" and sample.labels.get("boundary") == "window_start":
                le = float(sample.labels["le"])
                values["boundary_buckets"][le] = values["boundary_buckets"].get(le, 0.0) + sample.value
    return values


def histogram_median(before: dict, after: dict) -> float | None:
    """Median of the observations between two scrapes of a cumulative histogram, interpolated linearly
    inside its bucket (Prometheus' histogram_quantile)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    target, lower, below = counts[-1] / 2, 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= target:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (target - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return None


def kernel_files(cache_dir: str) -> int:
    return sum(len(files) for _, _, files in os.walk(cache_dir))


# ---- one client run ------------------------------------------------------------------------
def bench(server: Server, label: str, out: str, num_prompts: int, rate: float, vocab_size: int, env: dict,
          cache_dir: str, timeout_s: float) -> dict:
    path = os.path.join(tempfile.gettempdir(), f"served_{label}.json")
    command = [sys.executable, "-m", "lockstep.cli", "bench", "serve", "--base-url", server.url, "--num-prompts",
               str(num_prompts), "--seed", "0", "--request-rate", str(rate), "--vocab-size", str(vocab_size),
               "--result-json", path, "--num-client-processes", str(CLIENT_PROCESSES)]
    before, kernels_before = scrape(server.url), kernel_files(cache_dir)
    log(f"{label}: {num_prompts} requests at rate {rate} (timeout {timeout_s:.0f}s)")
    cpu_before = _children_cpu_s()
    started = time.monotonic()
    client = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = client.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        client.kill()
        output, _ = client.communicate()
        raise RuntimeError(f"{label}: the client ran past {timeout_s:.0f}s:\n{output.decode()[-2000:]}") from None
    wall = time.monotonic() - started
    # The client's CPU time: the only child reaped since cpu_before (the server is reaped when it stops).
    usage = _children_cpu_s() - cpu_before
    after, kernels_after = scrape(server.url), kernel_files(cache_dir)
    if client.returncode != 0:
        raise RuntimeError(f"{label}: bench serve exited {client.returncode}:\n{output.decode()[-3000:]}")
    with open(path) as handle:
        result = json.load(handle)
    busy, idle = after["busy"] - before["busy"], after["idle"] - before["idle"]
    itl_max = max((gap for gaps in result["itls"] for gap in gaps), default=0.0)
    median_gap = histogram_median(before["boundary_buckets"], after["boundary_buckets"])
    queries = after["prefix_queries"] - before["prefix_queries"]
    # The request with the most output tokens: at rate inf its own chain of decode steps can set the run's length
    longest = max(range(len(result["output_lens"])), key=result["output_lens"].__getitem__, default=None)
    # Per request, for the intake question (when each request's first token came against its length):
    # output tokens, TTFT and end-to-end seconds, in the client's order.
    with open(os.path.join(out, f"requests_{_slug(label)}.json"), "w") as handle:
        json.dump({"output_lens": result["output_lens"], "ttfts": [round(t, 4) for t in result["ttfts"]],
                   "e2els": [round(t + sum(gaps), 4) for t, gaps in zip(result["ttfts"], result["itls"])]}, handle)
    row = {
        "label": label, "requests": result["completed"], "failed": result["failed"], "rate": rate,
        "duration_s": result["duration"], "req_per_s": result["request_throughput"],
        "output_tok_per_s": result["output_throughput"], "total_tok_per_s": result["total_token_throughput"],
        "ttft_p50_ms": result["median_ttft_ms"], "ttft_p99_ms": result["p99_ttft_ms"],
        "tpot_p50_ms": result["median_tpot_ms"], "itl_p50_ms": result["median_itl_ms"],
        "itl_p99_ms": result["p99_itl_ms"], "itl_max_ms": 1e3 * itl_max,
        "engine_busy_s": busy, "engine_gap_s": idle,
        "idle_fraction": 1 - busy / result["duration"] if result["duration"] else None,
        "gap_share_of_busy_time": idle / (busy + idle) if busy + idle else None,
        "median_boundary_gap_us": None if median_gap is None else 1e6 * median_gap,
        "prefix_cache_hit_share": (after["prefix_hits"] - before["prefix_hits"]) / queries if queries else None,
        "client_cpu_s": usage, "client_wall_s": wall, "client_cpu_share": usage / wall if wall else None,
        "kernels_compiled_during_run": kernels_after - kernels_before,
        "windows": after["windows"] - before["windows"], "steps": after["steps"] - before["steps"],
        "cut_windows": after["cuts"] - before["cuts"],
        "overlapped_windows": after["overlapped"] - before["overlapped"],
        "occupancy_gauge_at_end": after["occupancy"],
        "longest_output_tokens": None if longest is None else result["output_lens"][longest],
        "longest_output_ttft_s": None if longest is None else result["ttfts"][longest],
        "longest_output_e2el_s": None if longest is None else result["ttfts"][longest] + sum(result["itls"][longest]),
        "host_s": {phase: seconds - before["host"].get(phase, 0.0) for phase, seconds in after["host"].items()},
        **{key: {phase: value - before[key].get(phase, 0.0) for phase, value in after[key].items()}
           for key in ("busy_by_phase", "forwards_by_phase", "gap_by_boundary")},
    }
    log(f"{label}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "label"))
    return row


def _parse_settings(specs: list[str]) -> list[tuple[str, list[str]]]:
    """"NAME=FLAGS" strings as (name, flags)."""
    return [(spec.split("=", 1)[0], spec.split("=", 1)[1].split()) for spec in specs]


def _sweep_vocab(first_vocab: int, index: int) -> int:
    """The prompt-id bound of a server's index-th Poisson run. The workload is prefix-stable (n requests
    are the first n of n + 1), so with one bound a run would find its predecessors' prompts in the prefix
    cache; another bound gives other ids for the same lengths."""
    return first_vocab - 7 * (index + 1)


def _slug(label: str) -> str:
    """A label as a file-name part (server logs and result JSON)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label).strip("_")


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's reaped children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---- plots ---------------------------------------------------------------------------------
def plot(results: dict, out: str) -> list[str]:
    try:
        import matplotlib
    except ImportError:  # the results are saved either way; plots can be drawn from served.json later
        log("plots skipped: matplotlib is not installed")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    bars = [r for r in results["runs"] if math.isinf(r["rate"])]
    if bars:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [r["label"] for r in bars]
        ax.bar(names, [r["output_tok_per_s"] for r in bars], color="tab:blue")
        for i, r in enumerate(bars):
            ax.annotate(f"{r['req_per_s']:.1f} req/s", (i, r["output_tok_per_s"]), ha="center", va="bottom")
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")  # long setting names would overlap
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{results['model']}, sharegpt-synth, rate inf, {results['device']}")
        written.append(_save_figure(fig, out, "served_throughput.png"))
    sweeps = {}
    for r in results["runs"]:
        if not math.isinf(r["rate"]):
            sweeps.setdefault(r["label"].split(" @")[0], []).append(r)
    if sweeps:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for setting, rows in sweeps.items():
            rows.sort(key=lambda r: r["rate"])
            rates = [r["rate"] for r in rows]
            axes[0].plot(rates, [r["ttft_p50_ms"] for r in rows], "o-", label=f"{setting} p50")
            axes[0].plot(rates, [r["ttft_p99_ms"] for r in rows], "o--", label=f"{setting} p99")
            axes[1].plot(rates, [r["tpot_p50_ms"] for r in rows], "o-", label=f"{setting} p50")
            axes[2].plot(rates, [r["itl_p99_ms"] for r in rows], "o-", label=f"{setting} p99")
            axes[2].plot(rates, [r["itl_max_ms"] for r in rows], "o--", label=f"{setting} max")
        for ax, title in zip(axes, ("TTFT ms", "TPOT ms", "inter-token gap ms")):
            ax.set_xlabel("request rate (Poisson, req/s)")
            ax.set_title(title)
            ax.legend(fontsize=8)
        fig.suptitle(f"{results['model']}, sharegpt-synth, {results['device']}")
        written.append(_save_figure(fig, out, "served_latency.png"))
    return written


def _save_figure(fig, out: str, name: str) -> str:
    """Lays the figure out, writes it to out/name and closes it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def table(results: dict) -> str:
    lines = ["| run | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p99 / max ms | idle | "
             "median boundary gap | client CPU | kernels compiled |", "|" + "---|" * 10]
    for r in results["runs"]:
        gap = r["median_boundary_gap_us"]
        lines.append(
            f"| {r['label']} | {r['req_per_s']:.2f} | {r['output_tok_per_s']:.0f} | {r['ttft_p50_ms']:.0f} / "
            f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['itl_p99_ms']:.0f} / {r['itl_max_ms']:.0f} | "
            f"{100 * r['idle_fraction']:.1f}% | {'-' if gap is None else f'{gap:.0f} µs'} | "
            f"{100 * r['client_cpu_share']:.0f}% | {r['kernels_compiled_during_run']} |")
    for name, s in results["servers"].items():
        lines.append(f"\nserver {name}: /health 200 after {s['startup_s']:.1f}s; {s['startup_line']}")
    return "\n".join(lines)


# ---- the session ---------------------------------------------------------------------------
def main() -> int:
    global CLIENT_PROCESSES
    args = parse_args()
    if args.client_processes < 1:
        raise SystemExit(f"--client-processes must be >= 1, got {args.client_processes}")
    CLIENT_PROCESSES = args.client_processes
    out = os.environ.get("OUT") or os.path.join(REPO, ".bench")
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    cache_dir = tempfile.mkdtemp(prefix="triton-cache-")  # fresh: the first server compiles everything
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": cache_dir,
           "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "engine"), os.environ.get("PYTHONPATH", "")])}
    try:  # not torch: a CUDA context in this process would take GPU memory from the servers
        device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        device = "cpu"
    results = {"model": args.model, "server_args": args.server_args, "device": device, "servers": {}, "runs": [],
               "skipped": [], "errors": []}
    first_vocab, warm_vocab = args.vocab_sizes
    settings = [("default", []), ("N=1", ["--num-scheduler-steps", "1"])]
    if args.settings or args.poisson_settings:
        settings = _parse_settings(args.settings or args.poisson_settings)
    extras = _parse_settings(args.extra_settings)
    settings += extras
    inf_only = {name for name, _ in extras} | ({name for name, _ in settings} if args.settings else set())
    # Seconds each phase is expected to need at most on the H200 (start-up includes a cold Triton cache).
    expect = ({"start": 120, "warm_start": 40, "inf": 60, 10.0: 70, 25.0: 45} if not SMALL else
              {"start": 60, "warm_start": 60, "inf": 60, 10.0: 30, 25.0: 30})
    if args.poisson_settings:
        # Arrivals plus the drain of the longest request (about 10 s on the H200 at N=8) and the client's start.
        expect |= {"start": 45, "warm_start": 45, "inf": args.arrival_s + 15} | {
            rate: args.arrival_s + 15 for rate in args.rates}

    def left() -> float:
        return args.budget - (time.monotonic() - started)

    def save() -> None:
        results["elapsed_s"] = time.monotonic() - started
        with open(os.path.join(out, "served.json"), "w") as handle:
            json.dump(results, handle, indent=2)

    def run_setting(name: str, flags: list[str]) -> None:
        """One server: started (again without warm-up if the warm-up fails), its phases, stopped."""
        server = Server(args.model, args.server_args.split() + flags, _slug(name), out, env)
        try:
            try:
                server.wait_healthy(min(args.start_timeout, left()))
            except RuntimeError as error:
                if "warm-up failed" not in server.log_text():
                    raise
                # A failed warm-up is a finding, not a reason to lose the call's runs: record it and go on
                # without (the first run then pays for compilation, as before the warm-up existed).
                results["errors"].append(f"{name}: {str(error)[-3000:]}")
                server.stop()
                name = f"{name} (skip-warmup)"
                server = Server(args.model, args.server_args.split() + flags + ["--skip-warmup"],
                                _slug(name), out, env)
                server.wait_healthy(min(args.start_timeout, left()))
            results["servers"][name] = {"startup_s": server.startup_s, "startup_line": server.startup_line(),
                                        "kernel_files_at_ready": kernel_files(cache_dir)}
            log(f"{name}: healthy after {server.startup_s:.1f}s; {server.startup_line()}")
            for label, rate, count, vocab in phases_of(name):
                need = expect["inf"] if math.isinf(rate) else expect.get(rate, 90)
                if left() < need:
                    results["skipped"].append(f"{label} ({left():.0f}s left, needs about {need}s)")
                    continue
                try:
                    results["runs"].append(bench(server, _slug(label), out, count, rate, vocab, env, cache_dir,
                                                 left()) | {"label": label})
                except RuntimeError as error:
                    results["errors"].append(str(error)[-3000:])
                    log(str(error)[-3000:])
                save()
        except RuntimeError as error:
            results["errors"].append(str(error)[-3000:])
            log(str(error)[-3000:])
        finally:
            server.stop()
        save()

    def phases_of(name: str) -> list[tuple[str, float, int, int]]:
        """(label, rate, requests, vocab) in order of need: the default's first and warm runs, then the
        sweeps, N=1's rate inf last; a --settings or --extra-settings variant runs rate inf once."""
        if args.poisson_settings:
            counts = [max(1, round(rate * args.arrival_s)) for rate in args.rates]
            return [(f"{name} @{rate:g} ({count})", rate, count, _sweep_vocab(first_vocab, index))
                    for index, (rate, count) in enumerate(zip(args.rates, counts))]
        inf = [(f"{name} @inf", math.inf, args.num_prompts, first_vocab)]
        if name in inf_only:
            return inf
        sweep = [(f"{name} @{rate:g}", rate, args.sweep_prompts, _sweep_vocab(first_vocab, index))
                 for index, rate in enumerate(args.rates)]
        if name == "default":
            return inf + [(f"{name} @inf, warm", math.inf, args.num_prompts, warm_vocab)] + sweep
        return sweep + inf

    for name, flags in settings:
        # A server after the first finds the kernels compiled (the Triton cache is shared): a shorter start.
        if left() < (expect["start"] if not results["servers"] else expect["warm_start"]) + expect["inf"]:
            results["skipped"].append(f"{name}: all runs ({left():.0f}s left)")
            continue
        run_setting(name, flags)
    results["plots"] = [os.path.basename(p) for p in plot(results, out)]
    save()
    print(table(results))
    for line in results["skipped"]:
        print(f"skipped: {line}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
