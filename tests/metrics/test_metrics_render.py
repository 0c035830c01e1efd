"""`CoreMetrics` on known windows, and what a /metrics scrape costs at realistic series counts.

A GIE-style endpoint picker scrapes every 50 ms, so rendering must stay a small fraction of that.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import httpx
import pytest
from lockstep_engine.engine_core import CoreStats
from lockstep_engine.metrics import CoreMetrics
from lockstep_engine.runner.outputs import StepTag, StepTiming, WindowTimings

from lockstep_common import metrics_names as n
from lockstep_engine import protocol as p

N = 8


def _fake_core() -> SimpleNamespace:
    return SimpleNamespace(stats=CoreStats(), scheduler=SimpleNamespace(num_preemptions=2),
                           blocks=SimpleNamespace(prefix_cache_queries=90, prefix_cache_hits=32))


def _window(core, metrics: CoreMetrics, prompt_tokens: int, batch: int, boundary_gap: float | None) -> None:
    """What `EngineCore.step` leaves behind for one window of N steps, then `record_window`."""
    stats = core.stats
    stats.num_prompt_tokens_computed += prompt_tokens
    stats.first_step_tokens.append(prompt_tokens + (0 if prompt_tokens else batch))
    stats.step_batch_sizes += [batch] * N
    stats.later_step_batches += [batch] * (N - 1)
    stats.schedule_s += 1e-4
    stats.update_s += 2e-5
    if prompt_tokens:
        stats.queue_times_s.append(0.003)
    first = StepTiming(StepTag(1, "prefill" if prompt_tokens else "decode", batch), 0.004, boundary_gap)
    steps = [first] + [StepTiming(StepTag(k, "decode", batch), 0.001, 3e-6) for k in range(2, N + 1)]
    timings = WindowTimings(prepare_s=5e-5, output_s=3e-4, num_steps=N, steps=steps)
    metrics.record_window(core.stats.take(), timings)


def test_record_window_splits_phases_boundaries_and_tokens():
    core, metrics = _fake_core(), CoreMetrics()
    _window(core, metrics, prompt_tokens=40, batch=1, boundary_gap=None)  # first window after idle
    _window(core, metrics, prompt_tokens=0, batch=1, boundary_gap=4e-4)
    snapshot = metrics.snapshot(core)
    hist, counters = snapshot.histograms, snapshot.counters
    assert counters[n.STEPS] == {("prefill", "window_start"): 1, ("decode", "window_start"): 1,
                                 ("decode", "intra"): 2 * (N - 1)}
    gaps = hist[n.STEP_GAP]
    assert set(gaps) == {("decode", "intra"), ("decode", "window_start")}  # no gap before the first window
    counts, total = gaps[("decode", "window_start")]
    assert sum(counts) == 1 and total == 4e-4
    assert counts[n.GAP_BUCKETS.index(5e-4)] == 1  # 400 us lands in the (200 us, 500 us] bucket
    assert sum(gaps[("decode", "intra")][0]) == 2 * (N - 1)
    assert counters[n.GPU_IDLE][("decode",)] == pytest.approx(4e-4 + 2 * (N - 1) * 3e-6)
    assert counters[n.GPU_BUSY][("prefill",)] == 0.004
    assert hist[n.STEP_TOKENS][("prefill",)][1] == 40
    assert hist[n.STEP_TOKENS][("decode",)][1] == 1 + 2 * (N - 1)
    assert hist[n.WINDOW_STEPS][()][1] == 2 * N
    assert sum(hist[n.QUEUE_TIME][()][0]) == 1
    assert {phase for (phase,) in hist[n.HOST_PHASE]} == {"schedule", "prepare", "pythonize", "update"}
    assert counters[n.PREEMPTIONS] == {(): 2.0} and counters[n.PREFIX_CACHE_HITS] == {(): 32.0}
    assert not core.stats.gaps_s and not core.stats.step_batch_sizes  # drained: memory stays flat


def _attached_registry():
    """The API server's real registry, attached to a fake client holding a full core snapshot."""
    from lockstep_engine.api import metrics as api_metrics

    core, metrics = _fake_core(), CoreMetrics()
    for i in range(50):
        _window(core, metrics, prompt_tokens=64 if i % 5 == 0 else 0, batch=32, boundary_gap=2e-4 if i else None)
    ready = p.CoreReady(pid=1, max_model_len=8192, num_blocks=4096, block_size=16, vocab_size=49152,
                        num_scheduler_steps=N, guided_decoding=False, device="cuda:0", model_config={})
    client = SimpleNamespace(ready=ready, config=SimpleNamespace(enable_prefix_caching=True, gpu_memory_utilization=0.9,
                                                                     enable_lora=False, max_loras=1),
                             stats=p.EngineStats(num_running=32, num_waiting=3, kv_cache_usage=0.4),
                             core_metrics=metrics.snapshot(core))
    engine = api_metrics.register_engine(client, "smollm2")
    for r in range(64):
        engine.request_started(f"r{r}", 0.0, 100 + r, 1, 64)
        for t in range(1, 20):
            engine.tokens_received(f"r{r}", 0, t, 0.05 + 0.01 * t, 0.01)
        engine.request_finished(f"r{r}", [n.FINISH_REASONS[r % 4]], 0.3)
    for phase in ("detokenize", "output_ipc"):
        engine.observe_host_phase(phase, 3e-5)
    api_metrics.observe_stream_delay(1e-4)
    return api_metrics, engine


def test_render_time_at_a_full_series_set():
    api_metrics, engine = _attached_registry()
    try:
        text = api_metrics.render().decode()
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        timings = []
        for _ in range(300):
            started = time.perf_counter()
            api_metrics.render()
            timings.append(time.perf_counter() - started)
    finally:
        api_metrics.unregister(engine)
    timings.sort()
    p50, p99 = statistics.median(timings), timings[int(len(timings) * 0.99)]
    print(f"\n/metrics render: {len(samples)} samples, {len(text)} bytes, p50 {p50 * 1e3:.2f} ms, "
          f"p99 {p99 * 1e3:.2f} ms")
    assert len(samples) > 400  # every family populated, as on a busy engine
    assert p50 < 0.003, f"render p50 {p50 * 1e3:.2f} ms"


def test_scrape_latency_of_a_real_server(server):
    with httpx.Client(timeout=10.0) as client:
        text = client.get(f"{server.url}/metrics").text
        timings = []
        for _ in range(100):
            started = time.perf_counter()
            assert client.get(f"{server.url}/metrics").status_code == 200
            timings.append(time.perf_counter() - started)
    timings.sort()
    p50, p99 = statistics.median(timings), timings[98]
    samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    print(f"\nGET /metrics over HTTP: {samples} samples, p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
    assert p50 < 0.025, f"scrape p50 {p50 * 1e3:.2f} ms: a 50 ms scrape interval would not keep up"


def test_an_output_of_several_tokens_is_one_itl_observation_per_token_and_one_per_output_for_vllm():
    """A step that hands over three tokens of a sample at once (speculation, --stream-interval's batching
    upstream): lockstep's ITL series gets three observations of a third of the gap each, vLLM's
    inter-token and per-output series one of the whole gap."""
    from lockstep_engine.metrics import ServerMetrics

    from lockstep_common import vllm_metrics as v

    engine = ServerMetrics()
    engine.request_started("r", 0.0, 10, 1, 16)
    engine.tokens_received("r", 0, 1, 1.0)
    engine.tokens_received("r", 0, 4, 1.3)
    engine.tokens_received("r", 0, 4, 1.4)  # no new token: nothing observed
    itl = engine.series.histograms[n.ITL][()]
    assert sum(itl.counts) == 3 and itl.sum == pytest.approx(0.3)
    for name in (v.INTER_TOKEN_LATENCY, v.TIME_PER_OUTPUT_TOKEN):
        (buckets,) = engine.series.histograms[name].values()
        assert sum(buckets.counts) == 1 and buckets.sum == pytest.approx(0.3)
    assert engine.series.counters[n.GENERATION_TOKENS][()] == 4
