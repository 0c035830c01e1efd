"""`lockstep bench serve`'s report: per-request results -> vLLM's metrics, its table and an error summary.

The keys and the percentile method are vLLM's (`request_throughput`, `mean_ttft_ms`, `p99_itl_ms`,
numpy's linear interpolation), so numbers compare across tools.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from lockstep.bench.serve_client import RequestResult

# metric name in JSON keys -> heading in the printed table
_LATENCY_METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/percentiles of a latency list in seconds, as vLLM's `*_ms` keys (0 if empty)."""
    values_ms = [v * 1000 for v in values_s]
    summary = {
        f"mean_{name}_ms": statistics.fmean(values_ms) if values_ms else 0.0,
        f"median_{name}_ms": statistics.median(values_ms) if values_ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(values_ms) if values_ms else 0.0,
    }
    for p in percentiles:
        summary[f"{percentile_key(p)}_{name}_ms"] = percentile(values_ms, p)
    return summary


def calculate_metrics(
    results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float] = (99.0,)
) -> dict[str, Any]:
    """Aggregate per-request results the way `vllm bench serve` does; failed requests count zero tokens."""
    completed = [r for r in results if r.success]
    ttfts = [r.ttft for r in completed]
    e2els = [r.latency for r in completed]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in completed if r.output_tokens > 1]
    itls = [gap for r in completed for gap in r.itl]
    total_input = sum(r.prompt_len for r in completed)
    output_lens = [r.output_tokens if r.success else 0 for r in results]
    total_output = sum(output_lens)
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(completed),
        "failed": len(results) - len(completed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(summarize_ms(name, values, percentiles))
    metrics.update(
        {
            "input_lens": [r.prompt_len for r in results],
            "output_lens": output_lens,
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "errors": [r.error for r in results],
        }
    )
    return metrics


def format_table(result: dict[str, Any], percentiles: Sequence[float] = (99.0,)) -> str:
    """The result as `vllm bench serve` prints it."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Request rate configured (RPS):", result["request_rate"])
    row("Benchmark duration (s):", float(result["duration"]))
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", float(result["request_throughput"]))
    row("Output token throughput (tok/s):", float(result["output_throughput"]))
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", float(result["total_token_throughput"]))
    for name, (short, heading) in _LATENCY_METRICS.items():
        lines.append("{s:{c}^{n}}".format(s=heading, n=50, c="-"))
        row(f"Mean {short} (ms):", float(result[f"mean_{name}_ms"]))
        row(f"Median {short} (ms):", float(result[f"median_{name}_ms"]))
        for p in percentiles:
            row(f"P{percentile_key(p)[1:]} {short} (ms):", float(result[f"{percentile_key(p)}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def format_errors(errors: Sequence[str], limit: int = 5) -> str:
    """The most common request errors, with counts, most frequent first."""
    counts = Counter(e for e in errors if e)
    lines = [f"{count} x {error}" for error, count in counts.most_common(limit)]
    if len(counts) > limit:
        lines.append(f"... and {len(counts) - limit} other distinct errors")
    return "\n".join(lines)
