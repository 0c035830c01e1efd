"""Engine metrics: step timing from `CoreStats`, request latencies from the token stream, one /metrics.

Two halves, one per process of `lockstep serve`:
* `CoreMetrics` lives in the engine-core process. After each window it turns a `CoreStats` snapshot
  (`EngineCore.take_stats()`: the counters, and the per-step samples since the previous snapshot)
  and the window's `WindowTimings` into cumulative histogram buckets and counters (a bisect and an add
  per observation, nothing on the device); `snapshot()` packs them into a `protocol.CoreMetrics`
  message. Snapshots are cumulative: the API server keeps the latest, a late one loses nothing.
* `ServerMetrics` lives in the API-server process, where requests arrive and tokens are counted as
  `usage` counts them. It observes TTFT, per-token ITL, e2e latency and lengths; `render()` writes the
  /metrics text at scrape time: its state, the core's latest snapshot, the scheduler gauges.

Names, labels and buckets come from `lockstep_common.metrics_names` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from lockstep_common import metrics_names as n
from lockstep_engine import protocol as p
from lockstep_engine.metric_series import Buckets, Series, Spec
from lockstep_common import vllm_metrics as v


OCCUPANCY_WINDOW_S = 5.0  # the span of lockstep_gpu_occupancy_ratio


# Label `model_name` comes first on every engine series; the labels below follow it.
CORE_SPECS = {s.name: s for s in (
    Spec(n.STEP_GAP, "histogram", "Idle time of the device between the end of one forward and the start of the "
         "next (CUDA events on GPU, host clock on CPU); boundary=window_start: before a window's first step, "
         "intra: between steps of a window. The first step after idle has no gap.", ("phase", "boundary"),
         n.GAP_BUCKETS),
    Spec(n.GPU_IDLE, "counter", "Sum of lockstep_step_gap_seconds: device idle time between back-to-back forwards",
         ("phase",)),
    Spec(n.GPU_BUSY, "counter", "Device time spent in forwards (forward + sample), summed over steps", ("phase",)),
    Spec(n.STEP_DURATION, "histogram", "Device time of one forward (forward + sample)", ("phase",),
         n.STEP_DURATION_BUCKETS),
    Spec(n.STEPS, "counter", "Forwards executed; boundary=window_start for each window's first", ("phase", "boundary")),
    Spec(n.STEP_TOKENS, "histogram", "Tokens one forward computed (prompt chunks + one per decoding sequence)",
         ("phase",), n.STEP_TOKENS_BUCKETS),
    Spec(n.WINDOW_STEPS, "histogram", "Steps a multi-step window executed", (), n.WINDOW_STEPS_BUCKETS),
    Spec(n.HOST_PHASE, "histogram", "Host time of one phase of the serving loop: schedule, prepare, pythonize "
         "(step outputs to messages) and update once per window in the engine core; detokenize and output_ipc "
         "(core -> API server) once per step message in the API server", ("phase",), n.HOST_PHASE_BUCKETS),
    Spec(n.WINDOW_CUTS, "counter", "Windows ended before their planned steps (--arrival-cuts): an arrival or a prompt's next chunk"),
    Spec(n.OVERLAPPED_WINDOWS, "counter", "Windows whose last step was handed to the host while the next window ran "
         "(--async-scheduling); the others handed every step over themselves (a row whose sampling needs its "
         "tokens on the host: a grammar, penalties, bad words of several tokens; or overlap off)"),
    Spec(n.WASTED_TOKENS, "counter", "Tokens computed past a stop inside a window (the price of multi-step decode)"),
    Spec(n.QUEUE_TIME, "histogram", "Request arrival -> first scheduled", (), n.QUEUE_TIME_BUCKETS),
    Spec(n.PREEMPTIONS, "counter", "Sequences preempted (KV blocks freed, recomputed later)"),
    Spec(n.PREFIX_CACHE_QUERIES, "counter", "Prompt tokens looked up in the prefix cache"),
    Spec(n.PREFIX_CACHE_HITS, "counter", "Prompt tokens found in the prefix cache"),
    *(Spec(name, "counter", help_text, labels) for name, help_text, labels in n.SPEC_DECODE_SERIES),
)}


# ---- engine-core process --------------------------------------------------------------------
class CoreMetrics:
    """Step timing and scheduler counters of one `EngineCore`, fed once per window."""

    def __init__(self):
        self.series = Series(CORE_SPECS)
        self._prompt_tokens = 0
        self._wasted = 0
        self._cuts = 0
        self._overlapped = 0
        self._schedule_s = 0.0
        self._update_s = 0.0
        self._recent_steps: deque[tuple[float, float, float]] = deque()  # (recorded at, busy, idle before it)
        self._recent_busy = self._recent_idle = 0.0  # their sums: the gauge is read 20 times a second
        self.changed = False

    @property
    def occupancy(self) -> float:
        """Busy over busy + idle time of the forwards recorded in the last OCCUPANCY_WINDOW_S seconds (0
        before any): SGLang's forward occupancy. A forward after the engine idled has no gap: waiting for
        requests is not the device waiting for the host."""
        recent, horizon = self._recent_steps, time.monotonic() - OCCUPANCY_WINDOW_S
        while recent and recent[0][0] < horizon:
            _, busy, idle = recent.popleft()
            self._recent_busy -= busy
            self._recent_idle -= idle
        if not recent:  # no rounding left over in the sums
            self._recent_busy = self._recent_idle = 0.0
            return 0.0
        busy, idle = max(self._recent_busy, 0.0), max(self._recent_idle, 0.0)
        return busy / (busy + idle) if busy > 0 else 0.0

    def record_window(self, stats, timings) -> None:
        """Observes the window `EngineCore.step` just ran: its `WindowTimings` and `stats`, the core's
        `CoreStats` snapshot taken after it (counters are cumulative, their deltas are observed)."""
        s = self.series
        prompt_delta = stats.num_prompt_tokens_computed - self._prompt_tokens
        first = "prefill" if prompt_delta > 0 else "decode"
        # Device timings, harvested as the device finishes them (a step may land a window late): each
        # carries its own phase and place in its window.
        now = time.monotonic()
        for timed in (*timings.steps, *stats.idle_steps):
            phase, boundary = timed.tag.phase, "window_start" if timed.tag.step == 1 else "intra"
            idle = max(timed.gap_s or 0.0, 0.0)
            self._recent_steps.append((now, timed.forward_s, idle))
            self._recent_busy += timed.forward_s
            self._recent_idle += idle
            s.observe(n.STEP_DURATION, (phase,), timed.forward_s)
            s.inc(n.GPU_BUSY, (phase,), timed.forward_s)
            s.inc(n.STEPS, (phase, boundary), 1)
            if timed.gap_s is not None:
                self._gap(phase, boundary, timed.gap_s)
        for tokens in stats.first_step_tokens:
            s.observe(n.STEP_TOKENS, (first,), tokens)
        for batch in stats.later_step_batches:  # each delivered step after its window's first
            s.observe(n.STEP_TOKENS, ("decode",), batch)
        if timings.num_steps:
            s.observe(n.WINDOW_STEPS, (), timings.num_steps)
        for seconds in stats.queue_times_s:
            s.observe(n.QUEUE_TIME, (), max(seconds, 0.0))
        for phase, seconds in (("schedule", stats.schedule_s - self._schedule_s), ("prepare", timings.prepare_s),
                               ("pythonize", timings.output_s), ("update", stats.update_s - self._update_s)):
            if timings.num_steps:  # not for steps a finished window's tail delivered with no window after it
                s.observe(n.HOST_PHASE, (phase,), max(seconds, 0.0))
        s.inc(n.WASTED_TOKENS, (), stats.num_wasted_tokens - self._wasted)
        s.inc(n.WINDOW_CUTS, (), stats.num_cut_windows - self._cuts)
        s.inc(n.OVERLAPPED_WINDOWS, (), stats.num_overlapped_windows - self._overlapped)
        self._prompt_tokens, self._wasted = stats.num_prompt_tokens_computed, stats.num_wasted_tokens
        self._cuts, self._overlapped = stats.num_cut_windows, stats.num_overlapped_windows
        self._schedule_s, self._update_s = stats.schedule_s, stats.update_s
        self.changed = True

    def _gap(self, phase: str, boundary: str, seconds: float) -> None:
        seconds = max(seconds, 0.0)  # timer rounding must never make a negative observation
        self.series.observe(n.STEP_GAP, (phase, boundary), seconds)
        self.series.inc(n.GPU_IDLE, (phase,), seconds)

    def snapshot(self, core) -> p.CoreMetrics:
        s = self.series
        counters = {name: dict(values) for name, values in s.counters.items()}
        counters[n.PREEMPTIONS] = {(): float(core.scheduler.num_preemptions)}
        counters[n.PREFIX_CACHE_QUERIES] = {(): float(core.blocks.prefix_cache_queries)}
        counters[n.PREFIX_CACHE_HITS] = {(): float(core.blocks.prefix_cache_hits)}
        if core.stats.spec is not None:  # cumulative, as the core counts them (`runner.outputs.SpecCounts`)
            counters.update(core.stats.spec.counters())
        histograms = {name: {labels: b.state() for labels, b in values.items()}
                      for name, values in s.histograms.items()}
        self.changed = False
        return p.CoreMetrics(counters=counters, histograms=histograms, taken_at=time.monotonic())


# ---- API-server process ---------------------------------------------------------------------
def _request_specs(max_model_len: int) -> dict[str, Spec]:
    lengths = n.token_buckets(max_model_len)
    return {s.name: s for s in (
        Spec(n.TTFT, "histogram", "Request arrival at the API server -> its first token there", (), n.TTFT_BUCKETS),
        Spec(n.ITL, "histogram", "Time between tokens of one sample, per token: an interval that brought k tokens "
             "counts k times interval/k", (), n.ITL_BUCKETS),
        Spec(n.E2E_LATENCY, "histogram", "Request arrival -> its last token (or abort)", (), n.REQUEST_LATENCY_BUCKETS),
        Spec(n.REQUEST_PROMPT_TOKENS, "histogram", "Prompt length of finished requests", (), lengths),
        Spec(n.REQUEST_GENERATION_TOKENS, "histogram", "Tokens generated per finished request (all samples)", (),
             lengths),
        Spec(n.PROMPT_TOKENS, "counter", "Prompt tokens of requests that got their first token (as usage counts)"),
        Spec(n.GENERATION_TOKENS, "counter", "Tokens generated and returned (as usage counts them)"),
        Spec(n.REQUESTS_FINISHED, "counter", "Samples (choices) that ended, by how: stop, length, abort (client gone "
             "or shutdown) or error (engine core lost)", ("reason",)),
        # vLLM's series observed here (lockstep_common.vllm_metrics); label `engine` after `model_name`, as vLLM.
        *(Spec(m.name, m.kind, m.help, ("engine",), v.buckets_of(m, max_model_len))
          for m in v.METRICS if m.name in v.OBSERVED_HISTOGRAMS),
    )}


@dataclass
class _Tracked:
    arrival: float
    prompt_len: int
    n: int = 1
    max_tokens: int | None = None
    scheduled_at: float | None = None  # the core's first schedule of the request (same host clock)
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)  # per sample index
    num_tokens: dict[int, int] = field(default_factory=dict)  # per sample index, as counted so far


class ServerMetrics:
    """The engine server's collector: request metrics observed here, the core's from its snapshots."""

    def __init__(self, model_name: str = "", max_model_len: int = 2048):
        self.model_name = model_name
        self.specs = {**CORE_SPECS, **_request_specs(max_model_len)}
        self.series = Series(self.specs)
        self.ready: p.CoreReady | None = None
        self.enable_prefix_caching = True
        self.gpu_memory_utilization = 0.9
        self.max_loras = 0  # LoRA adapter slots (0: LoRA off)
        self._stats: Callable[[], p.EngineStats | None] = lambda: None
        self._core: Callable[[], p.CoreMetrics | None] = lambda: None
        self._requests: dict[str, _Tracked] = {}
        self._headers: dict[str, str] = {}
        self._label_text: dict[tuple, str] = {}
        self._gap_buckets: tuple[Buckets, Buckets, Buckets] | None = None  # ITL, inter-token, per-output time
        self._bucket_text: dict[tuple, list[str]] = {}

    def attach(self, model_name: str, ready: p.CoreReady, enable_prefix_caching: bool,
               stats: Callable[[], p.EngineStats | None], core: Callable[[], p.CoreMetrics | None],
               gpu_memory_utilization: float = 0.9) -> None:
        """Called once the core is ready: names the model, fixes the length buckets, and says where the
        scheduler gauges (`stats`) and the core's latest snapshot (`core`) are read at scrape time."""
        self.model_name, self.ready, self.enable_prefix_caching = model_name, ready, enable_prefix_caching
        self.gpu_memory_utilization = gpu_memory_utilization
        self._stats, self._core = stats, core
        self.specs.update(_request_specs(ready.max_model_len))
        for name in (n.REQUEST_PROMPT_TOKENS, n.REQUEST_GENERATION_TOKENS, v.REQUEST_MAX_NUM_GENERATION_TOKENS,
                     v.REQUEST_PARAMS_MAX_TOKENS):  # their buckets follow max_model_len
            self.series.histograms.pop(name, None)

    def detach(self) -> None:
        self._stats, self._core = (lambda: None), (lambda: None)

    # ---- request lifecycle (API server's event loop) -----------------------------------------
    def request_started(self, request_id: str, arrival: float, prompt_len: int, n: int = 1,
                        max_tokens: int | None = None) -> None:
        self._requests[request_id] = _Tracked(arrival, prompt_len, n, max_tokens)

    def tokens_received(self, request_id: str, index: int, num_tokens: int, now: float,
                        scheduled_at: float | None = None) -> None:
        """`num_tokens`: the sample's token count after this output (what `usage` will report);
        `scheduled_at`: when the core first scheduled the request (vLLM's queue / prefill split)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        new = num_tokens - tracked.num_tokens.get(index, 0)
        if new <= 0:
            return
        s = self.series
        if tracked.first_token_at is None:
            tracked.first_token_at = now
            s.observe(n.TTFT, (), now - tracked.arrival)
            s.inc(n.PROMPT_TOKENS, (), tracked.prompt_len)
            s.observe(v.REQUEST_PARAMS_N, _ENGINE, tracked.n)
            if scheduled_at is not None:
                tracked.scheduled_at = scheduled_at
                s.observe(v.REQUEST_QUEUE_TIME, _ENGINE, max(scheduled_at - tracked.arrival, 0.0))
        last = tracked.last_token_at.get(index)
        if last is not None:
            gap = now - last
            if self._gap_buckets is None:  # per token: the series' states kept, not looked up each time
                self._gap_buckets = (s.buckets(n.ITL, ()), s.buckets(v.INTER_TOKEN_LATENCY, _ENGINE),
                                     s.buckets(v.TIME_PER_OUTPUT_TOKEN, _ENGINE))
            itl, inter_token, per_output = self._gap_buckets
            itl.observe_many(gap / new, new)
            # vLLM: one observation per output of a request, the time since its previous one.
            inter_token.observe(gap)
            per_output.observe(gap)
        tracked.last_token_at[index] = now
        tracked.num_tokens[index] = num_tokens
        s.inc(n.GENERATION_TOKENS, (), new)

    def request_finished(self, request_id: str, reasons: list[str], now: float) -> None:
        for reason in reasons:
            self.series.inc(n.REQUESTS_FINISHED, (reason,), 1)
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        s = self.series
        s.observe(n.E2E_LATENCY, (), now - tracked.arrival)
        if tracked.first_token_at is not None:
            s.observe(n.REQUEST_PROMPT_TOKENS, (), tracked.prompt_len)
            s.observe(n.REQUEST_GENERATION_TOKENS, (), sum(tracked.num_tokens.values()))
            s.observe(v.REQUEST_MAX_NUM_GENERATION_TOKENS, _ENGINE, max(tracked.num_tokens.values()))
            if tracked.max_tokens is not None:
                s.observe(v.REQUEST_PARAMS_MAX_TOKENS, _ENGINE, tracked.max_tokens)
            last = max(tracked.last_token_at.values())
            s.observe(v.REQUEST_DECODE_TIME, _ENGINE, last - tracked.first_token_at)
            if tracked.scheduled_at is not None:
                s.observe(v.REQUEST_PREFILL_TIME, _ENGINE, max(tracked.first_token_at - tracked.scheduled_at, 0.0))
                s.observe(v.REQUEST_INFERENCE_TIME, _ENGINE, max(last - tracked.scheduled_at, 0.0))

    def observe_host_phase(self, phase: str, seconds: float) -> None:
        self.series.observe(n.HOST_PHASE, (phase,), max(seconds, 0.0))

    # ---- scrape -----------------------------------------------------------------------------
    def api_state(self) -> tuple[dict, dict]:
        """The series this API server observed itself (not the core's): counters, and histograms as (per-bucket
        counts, sum); what another API server of the same engine adds to its own in `render` (api/peers.py)."""
        return ({name: dict(values) for name, values in self.series.counters.items()},
                {name: {key: b.state() for key, b in values.items()} for name, values in self.series.histograms.items()})

    def render(self, peers: list[tuple[dict, dict]] = ()) -> str:
        """The Prometheus text exposition of every engine series; `peers`: the `api_state` of the other API
        servers of this engine, added to this one's.

        Written directly, not through prometheus_client's metric families: a busy engine exports ~450
        samples, the family objects cost ~10x the formatting, and a picker may scrape every 50 ms.
        """
        out: list[str] = []
        self._render_gauges(out)
        histograms: dict[str, dict[tuple, tuple[list[int], float]]] = {}
        counters: dict[str, dict[tuple, float]] = {}
        core = self._core()
        if core is not None:
            for name, values in core.histograms.items():
                histograms.setdefault(name, {}).update(values)
            for name, values in core.counters.items():
                counters.setdefault(name, {}).update(values)
        for name, values in self.series.histograms.items():
            histograms.setdefault(name, {}).update({k: b.state() for k, b in values.items()})
        for name, values in self.series.counters.items():
            counters.setdefault(name, {}).update(values)
        for peer_counters, peer_histograms in peers:
            _add_state(counters, histograms, peer_counters, peer_histograms)
        attached = self.ready is not None
        for name, spec in self.specs.items():
            out.append(self._header(name, spec.help, spec.kind))
            # Series without labels exist from the start (0), so rate() and absent() work before traffic.
            if spec.kind == "counter":
                values = counters.get(name, {})
                if attached and not spec.labels:
                    values.setdefault((), 0.0)
                for key, value in sorted(values.items()):
                    out.append(f"{name}{{{self._labels(spec, key)}}} {float(value)!r}\n")
                continue
            values = histograms.get(name, {})
            if attached and spec.labels in ((), ("engine",)):
                values.setdefault(_ENGINE if spec.labels else (), ([0] * (len(spec.buckets) + 1), 0.0))
            for key, (counts, total) in sorted(values.items()):
                lines = self._bucket_lines(name, spec, key)
                if len(counts) != len(lines):
                    continue  # buckets of another configuration (a restarted core): skip, never mislabel
                running = 0
                for line, count in zip(lines, counts):
                    running += count
                    out.append(f"{line}{running}\n")
                labels = self._labels(spec, key)
                out.append(f"{name}_count{{{labels}}} {running}\n{name}_sum{{{labels}}} {float(total)!r}\n")
        self._render_vllm_aliases(out, histograms, counters, attached)
        return "".join(out)

    def _render_vllm_aliases(self, out: list[str], histograms: dict, counters: dict, attached: bool) -> None:
        """vLLM's series that share a lockstep_ series' observations (summed over its labels, e.g. the
        phase of lockstep_step_tokens), and vllm:request_success from lockstep_requests_finished_total."""
        labels = f'model_name="{_escape(self.model_name)}",engine="{v.ENGINE_INDEX}"'
        for metric in v.METRICS:
            if metric.kind == "counter":
                out.append(self._header(metric.name + "_total", metric.help, "counter"))  # as prometheus_client
                if metric.name == v.REQUEST_SUCCESS:
                    by_reason = dict.fromkeys(v.FINISHED_REASONS, 0.0) if attached else {}
                    for (reason,), value in counters.get(n.REQUESTS_FINISHED, {}).items():
                        key = reason if reason in v.FINISHED_REASONS else "abort"  # error: the core was lost
                        by_reason[key] = by_reason.get(key, 0.0) + value
                    for reason, value in by_reason.items():
                        out.append(f'{metric.name}_total{{{labels},finished_reason="{reason}"}} {float(value)!r}\n')
                    continue
                values = counters.get(metric.alias, {})
                if len(metric.labels) > len(v.ENGINE_LABELS):  # one sample per value of the alias' own label
                    for (value_of_label,), value in sorted(values.items()):
                        out.append(f'{metric.name}_total{{{labels},{metric.labels[-1]}="{value_of_label}"}} {value!r}\n')
                    continue
                if values or attached:
                    out.append(f"{metric.name}_total{{{labels}}} {float(sum(values.values()))!r}\n")
                continue
            if metric.kind != "histogram" or metric.alias is None:
                continue
            bounds = self.specs[metric.alias].buckets
            out.append(self._header(metric.name, metric.help, "histogram"))
            values = histograms.get(metric.alias, {})
            if not values and not attached:
                continue
            counts, total = [0] * (len(bounds) + 1), 0.0
            for series_counts, series_sum in values.values():
                if len(series_counts) == len(counts):
                    counts = [a + b for a, b in zip(counts, series_counts)]
                    total += series_sum
            running = 0
            for line, count in zip(self._bucket_lines(metric.name, Spec(metric.name, "histogram", "", ("engine",),
                                                                       bounds), _ENGINE), counts):
                running += count
                out.append(f"{line}{running}\n")
            out.append(f"{metric.name}_count{{{labels}}} {running}\n{metric.name}_sum{{{labels}}} {float(total)!r}\n")

    def _header(self, name: str, help_text: str, kind: str) -> str:
        header = self._headers.get(name)
        if header is None:
            escaped = help_text.replace("\\", "\\\\").replace("\n", "\\n")
            header = self._headers[name] = f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"
        return header

    def _labels(self, spec: Spec, key: tuple[str, ...]) -> str:
        cache_key = (spec.name, key, self.model_name)
        text = self._label_text.get(cache_key)
        if text is None:
            pairs = zip(("model_name", *spec.labels), (self.model_name, *key))
            text = self._label_text[cache_key] = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
        return text

    def _bucket_lines(self, name: str, spec: Spec, key: tuple[str, ...]) -> list[str]:
        cache_key = (name, key, self.model_name, spec.buckets)
        lines = self._bucket_text.get(cache_key)
        if lines is None:
            labels = self._labels(spec, key)
            les = [floatToGoString(b) for b in spec.buckets] + ["+Inf"]
            lines = self._bucket_text[cache_key] = [f'{name}_bucket{{{labels},le="{le}"}} ' for le in les]
        return lines

    def _render_gauges(self, out: list[str]) -> None:
        model = _escape(self.model_name)
        stats = self._stats() or p.EngineStats()
        for name, help_text, value in (
            (n.REQUESTS_RUNNING, "Sequences in the running batch", stats.num_running),
            (n.REQUESTS_WAITING, "Sequences waiting to be scheduled", stats.num_waiting),
            (n.KV_CACHE_USAGE, "Fraction of KV-cache blocks in use, 0..1", stats.kv_cache_usage),
            (n.GPU_OCCUPANCY, "Device busy time over busy + idle time of the forwards of the last "
             f"{OCCUPANCY_WINDOW_S:g} s (idle: gaps between back-to-back forwards), 0..1", stats.gpu_occupancy),
            (v.NUM_REQUESTS_RUNNING, v.BY_NAME[v.NUM_REQUESTS_RUNNING].help, stats.num_running),
            (v.NUM_REQUESTS_WAITING, v.BY_NAME[v.NUM_REQUESTS_WAITING].help, stats.num_waiting),
            (v.KV_CACHE_USAGE, v.BY_NAME[v.KV_CACHE_USAGE].help, stats.kv_cache_usage),
        ):
            engine = f',engine="{v.ENGINE_INDEX}"' if name.startswith("vllm:") else ""
            out.append(f'{self._header(name, help_text, "gauge")}{name}{{model_name="{model}"{engine}}} '
                       f'{float(value)!r}\n')
        ready = self.ready
        if ready is None:
            return
        info = {"block_size": ready.block_size, "cache_dtype": "auto",
                "enable_prefix_caching": self.enable_prefix_caching, "engine": v.ENGINE_INDEX,
                "gpu_memory_utilization": self.gpu_memory_utilization, "model_name": self.model_name,
                "num_gpu_blocks": ready.num_blocks, "num_scheduler_steps": ready.num_scheduler_steps}
        labels = ",".join(f'{k}="{_escape(str(value))}"' for k, value in info.items())
        cache = v.BY_NAME[v.CACHE_CONFIG_INFO]
        out.append(f"{self._header(cache.name, cache.help, 'gauge')}{cache.name}{{{labels}}} 1.0\n")
        lora, stats = v.BY_NAME[v.LORA_REQUESTS_INFO], self._stats() or p.EngineStats()
        waiting, running = (_escape(",".join(names)) for names in (stats.waiting_adapters, stats.running_adapters))
        out.append(f'{self._header(lora.name, lora.help, "gauge")}{lora.name}{{max_lora="{self.max_loras}",'
                   f'waiting_lora_adapters="{waiting}",running_lora_adapters="{running}"}} {time.time()!r}\n')
        method = "cuda_events" if ready.device.startswith("cuda") else "host_clock"
        help_text = "How step durations and gaps are timed (value 1): cuda_events on the compute stream, or host_clock"
        out.append(f'{self._header(n.STEP_TIMER_INFO, help_text, "gauge")}'
                   f'{n.STEP_TIMER_INFO}{{model_name="{model}",method="{method}"}} 1.0\n')


_ENGINE = (v.ENGINE_INDEX,)  # the label values of vLLM's engine series after model_name


def _add_state(counters: dict, histograms: dict, more_counters: dict, more_histograms: dict) -> None:
    """Adds another API server's series to these (new tuples: the core snapshot's lists stay as they are)."""
    for name, values in more_counters.items():
        into = counters.setdefault(name, {})
        for key, value in values.items():
            into[key] = into.get(key, 0.0) + value
    for name, values in more_histograms.items():
        into = histograms.setdefault(name, {})
        for key, (counts, total) in values.items():
            mine = into.get(key)
            if mine is None:
                into[key] = (list(counts), total)
            elif len(mine[0]) == len(counts):
                into[key] = ([a + b for a, b in zip(mine[0], counts)], mine[1] + total)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
