"""Admission sized by what the engines serve: bursts of hundreds at once against deliberately small
engines, served or refused on arrival (429 + Retry-After from the measured drain rate), never timed
out for having waited their turn, in the gateway's queue or the engine's; one key's deep burst does
not starve another key, and only a trusted source raises priority. The decisions on plain data
first (`DrainRate`, `FlowControl.admission`, the queue timeout that measures the queue's progress),
then real gateway and engine processes. The 10,000-request burst is a benchmark, not a test:
benchmarks/burst_at_once.py (docs/GATEWAY.md, "Admission")."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from gateway_harness import MODEL, Engine

from lockstep_gateway.flow_control import MIN_DRAINED, DrainRate, FlowControl, ModelQueue, QueueRefused, Waiter
from lockstep_gateway.routing.candidate import Candidate, EngineLoad, is_saturated

REFUSED = "lockstep_gateway_requests_refused_total"


# ---- decisions on plain data ---------------------------------------------------------------------
def _queued(n: int, priority: int = 0, tenant: str = "a") -> list[Waiter]:
    return [Waiter(job=f"{tenant}{i}", priority=priority, tenant=tenant, arrival=0.0, granted=None, size=100)
            for i in range(n)]


def _flow(timeout_s: float = 10.0, max_length: int = 0, max_bytes: int = 0, choose=lambda job: None) -> FlowControl:
    return FlowControl(max_length, timeout_s, retry_after_s=7, choose=choose, hold=lambda b: None,
                       unhold=lambda b: None, on_depth=lambda m, d: None, on_wait=lambda m, w: None,
                       max_bytes=max_bytes)


def _with_rate(flow: FlowControl, model: str, per_second: float, queued: list[Waiter]) -> None:
    """`model`'s queue holding `queued`, drained so far at `per_second`."""
    queue = flow.queues.setdefault(model, ModelQueue())
    for waiter in queued:
        queue.push(waiter)
        flow.queued_bytes += waiter.size
    drain = flow.drains[model] = DrainRate(0.0)
    drain.count, drain.span = per_second * 10, 10.0


def test_the_drain_rate_counts_backlogged_time_from_the_first_departure():
    drain = DrainRate(0.0)
    drain.advance(5.0, backlogged=True)  # a backlog waiting for the batch's first answers: not the pace
    assert drain.span == 0.0
    for second in range(1, 11):  # then 4 requests a second leave it
        drain.advance(5.0 + second, backlogged=True)
        drain.departed(5.0 + second, 4)
    assert drain.per_second() == pytest.approx(4.0 * 10 / 9, rel=0.1)  # 40 left over the 9 s since the first
    drain.advance(100.0, backlogged=False)
    drain.emptied()
    assert drain.per_second() is None  # decayed away after a long idle spell: not a measurement any more


def test_no_rate_before_enough_requests_left_a_backlog():
    drain = DrainRate(0.0)
    drain.departed(0.0, 1)
    drain.advance(5.0, backlogged=True)
    drain.departed(5.0, MIN_DRAINED - 2)
    assert drain.per_second() is None


def test_a_request_the_engines_would_not_reach_within_the_timeout_is_refused_on_arrival_with_the_drain_time():
    flow = _flow(timeout_s=10.0)
    _with_rate(flow, MODEL, 10.0, _queued(150))
    refused = flow.admission(MODEL, priority=0, size=100)
    assert isinstance(refused, QueueRefused) and refused.reason == "queue_wait"
    assert refused.error.status == 429
    assert refused.error.retry_after == 6  # 151 places at 10/s is 15.1 s: a retry fits in 5.1 s
    assert "--queue-timeout" in refused.error.message and "150 requests" in refused.error.message
    assert flow.admission(MODEL, priority=-1, size=100) is None  # nobody is ahead of a more urgent one
    assert flow.admission("other-model", priority=0, size=100) is None  # no rate measured: the bounds decide


def test_the_length_and_memory_bounds_refuse_with_a_retry_after_from_the_drain_rate():
    flow = _flow(max_length=100)
    _with_rate(flow, MODEL, 20.0, _queued(100))
    full = flow.admission(MODEL, 0, 100)
    assert full.reason == "queue_full" and full.error.retry_after == 1 and "--max-queue-length" in full.error.message
    flow = _flow(max_bytes=100 * 100)
    _with_rate(flow, MODEL, 2.0, _queued(100))
    memory = flow.admission(MODEL, 0, 1000)  # 10 queued requests' worth must leave first: 5 s at 2/s
    assert memory.reason == "queue_memory" and memory.error.retry_after == 5
    assert "--max-queue-bytes" in memory.error.message
    assert _flow(max_length=1).admission(MODEL, 0, 100) is None
    unmeasured = _flow(max_length=1)
    unmeasured.queues[MODEL] = ModelQueue()
    unmeasured.queues[MODEL].push(_queued(1)[0])
    assert unmeasured.admission(MODEL, 0, 100).error.retry_after == 7  # no rate: --retry-after


def test_a_deep_queue_keeps_its_order_and_counts_when_waiters_leave_out_of_turn():
    queue = ModelQueue()
    a, b = _queued(5000, tenant="a"), _queued(5000, tenant="b")
    for pair in zip(a, b):
        for waiter in pair:
            queue.push(waiter)
    for waiter in a[::2]:
        assert queue.remove(waiter) and waiter.job is None  # a client that left holds no body
    assert len(queue) == 7500 and queue.ahead_of(0) == 7500 and queue.ahead_of(-1) == 0
    order = [queue.pop_head().job for _ in range(6)]
    assert order == ["a1", "b0", "a3", "b1", "a5", "b2"]


def test_a_queued_request_waits_as_long_as_the_queue_moves_and_times_out_only_when_it_stops():
    """One seat freed every 50 ms: the last of 40 queued waits about 2 s, twice the 1 s timeout, and is
    served; once nothing leaves for the timeout, a queued request gets 429."""

    async def scenario():
        seats = [0]
        flow = _flow(timeout_s=1.0, choose=lambda job: "engine" if seats[0] else None)

        def hold(backend):
            seats[0] -= 1

        flow._hold = hold
        waits = [asyncio.create_task(flow.wait(f"r{i}", MODEL, 0, "a", None)) for i in range(40)]
        started = time.monotonic()
        while not all(w.done() for w in waits) and time.monotonic() - started < 30:
            await asyncio.sleep(0.05)  # the engine's pace: one request ends every 50 ms
            seats[0] += 1
            flow.dispatch(MODEL)
        served = [w.result() for w in waits]
        took = time.monotonic() - started
        seats[0] = 0  # the engine stops answering
        stalled_at = time.monotonic()
        with pytest.raises(QueueRefused) as stalled:
            await flow.wait("late", MODEL, 0, "a", None)
        return served, took, stalled.value, time.monotonic() - stalled_at

    served, took, stalled, stalled_after = asyncio.run(scenario())
    assert served == ["engine"] * 40 and took > 1.5
    assert stalled.reason == "queue_timeout" and stalled.error.status == 429 and 0.9 < stalled_after < 5


def test_this_gateway_keeps_at_most_the_engines_seen_batch_plus_the_depth_open_on_it_whatever_its_scrapes_say():
    """Requests in transit to a busy engine are in no scraped queue, and its scrapes go stale: before,
    a burst of 10,000 was sent on whole and ran the gateway out of file descriptors."""
    idle_scrape = EngineLoad(num_running=256, num_waiting=0)
    fresh = Candidate("http://a", in_flight=511, load=idle_scrape, load_age_s=0.1, in_flight_at_scrape=511, seats=256)
    assert not is_saturated(fresh, 3.0, queue_depth=256, max_in_flight=0)
    assert is_saturated(replace(fresh, in_flight=512), 3.0, queue_depth=256, max_in_flight=0)
    assert is_saturated(replace(fresh, in_flight=512, load_age_s=60.0), 3.0, queue_depth=256, max_in_flight=0)
    assert is_saturated(Candidate("http://a", in_flight=256), 3.0, queue_depth=256, max_in_flight=0)  # no scrape yet
    assert not is_saturated(Candidate("http://a", in_flight=10**6), 3.0, queue_depth=0, max_in_flight=0)  # no limit


# ---- real gateway and engines -------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    took: float
    finished_at: float

    @property
    def complete_stream(self) -> bool:
        return self.status == 200 and b"data: [DONE]" in self.body and b'"error"' not in self.body


async def _stream(url: str, max_tokens: int, headers: dict | None = None) -> Answer:
    """One streamed completion over a connection of its own (`Connection: close`): hundreds at once cost
    the client little."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n".encode() + body)
        data = await asyncio.wait_for(reader.read(-1), 300)
    finally:
        writer.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    now = time.monotonic()
    return Answer(int(lines[0].split()[1]), fields, payload, now - started, now)


async def _burst(url: str, count: int, max_tokens: int, headers: dict | None = None) -> list[Answer]:
    return await asyncio.gather(*(_stream(url, max_tokens, headers) for _ in range(count)))


@pytest.fixture
def small_engine(log_dir: Path):
    """Start an engine with extra flags (a small batch, a small queue budget); stopped after the test."""
    started = []

    def start(name: str, *flags: str) -> Engine:
        engine = Engine(name, log_dir)
        engine.argv += list(flags)
        engine.start()
        started.append(engine)
        engine.wait_healthy()
        return engine

    yield start
    for engine in started:
        engine.stop()


def test_streams_waiting_in_the_engines_own_queue_are_not_timed_out_as_an_unanswering_engine(small_engine,
                                                                                            start_gateway):
    """300 streams of 48 tokens at once to an engine of 4 seats, all sent on (a saturation depth above the
    burst): 75 rounds of 48 tokens, so most wait in the engine's queue far longer than the 2 s first-byte
    timeout while the engine streams to the others, even on a fast machine. Before, the timeout ran while
    they waited: 504s."""
    engine = small_engine("four-seat-engine", "--max-num-seqs", "4")
    gateway = start_gateway(f"--engine={engine.url}", "--saturation-queue-depth=1000", "--first-byte-timeout=2",
                            expect_healthy={engine.url})
    started = time.monotonic()
    answers = asyncio.run(_burst(gateway.url, 300, 48))
    took = time.monotonic() - started
    broken = [(a.status, a.body[-200:]) for a in answers if not a.complete_stream]
    assert not broken, broken[:5]
    assert took > 2 * 2  # the engine's queue held some of them well past the first-byte timeout
    assert gateway.metric("lockstep_gateway_upstream_requests_total", engine=engine.url, outcome="timeout") == 0
    assert gateway.metric("lockstep_gateway_queue_wait_seconds_count", model=MODEL) == 0  # none waited here


def test_a_burst_is_admitted_or_refused_on_arrival_and_no_admitted_request_times_out(engines, start_gateway):
    """300 streams at once, 4 at a time on the engine, a 4 s queue timeout, while the whole burst takes
    longer to drain: each request is served or refused at once (429, Retry-After from the drain rate);
    none is admitted and then timed out. Before, everything past what 4 s drained got 429 after waiting."""
    engine = engines[0]
    timeout = 4.0
    gateway = start_gateway(f"--engine={engine.url}", "--max-in-flight-per-engine=4", f"--queue-timeout={timeout}",
                            expect_healthy={engine.url})
    started = time.monotonic()
    answers = asyncio.run(_burst(gateway.url, 300, 32))
    took = time.monotonic() - started
    served = [a for a in answers if a.complete_stream]
    refused = [a for a in answers if a.status == 429]
    assert len(served) + len(refused) == 300, [(a.status, a.body[-200:]) for a in answers if a not in served][:5]
    assert all(int(a.headers["retry-after"]) >= 1 and a.took < timeout for a in refused)
    assert gateway.metric(REFUSED, reason="queue_timeout") == 0
    assert gateway.metric(REFUSED, reason="queue_wait") == len(refused)
    assert max(a.took for a in served) > timeout  # admitted requests waited longer than the timeout, and were served
    print(f"300 at once: {len(served)} served, {len(refused)} refused on arrival, {took:.1f}s")


def test_one_keys_deep_burst_does_not_starve_another_and_only_a_trusted_key_jumps_the_queue(engines, start_gateway,
                                                                                           tmp_path: Path):
    engine = engines[1]
    keys, priority_keys = tmp_path / "keys", tmp_path / "priority-keys"
    keys.write_text("key-a\nkey-b\n")
    priority_keys.write_text("key-platform\n")
    a, b, platform = ({"authorization": f"Bearer {key}"} for key in ("key-a", "key-b", "key-platform"))
    gateway = start_gateway(f"--engine={engine.url}", "--max-in-flight-per-engine=2", f"--api-key-file={keys}",
                            f"--priority-api-key-file={priority_keys}", expect_healthy={engine.url}, env_headers=a)
    urgent = {"x-gateway-priority": "10"}

    async def scenario():
        burst = asyncio.ensure_future(_burst(gateway.url, 300, 16, a))
        deadline = time.monotonic() + 60
        while gateway.metric("lockstep_gateway_queue_depth", model=MODEL) < 250 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        b_answers = asyncio.gather(*(_stream(gateway.url, 16, b) for _ in range(2)))
        a_urgent = asyncio.ensure_future(_stream(gateway.url, 16, {**a, **urgent}))  # not trusted: ignored
        p_urgent = asyncio.ensure_future(_stream(gateway.url, 16, {**platform, **urgent}))
        return await burst, await b_answers, await a_urgent, await p_urgent

    burst, b_answers, a_urgent, p_urgent = asyncio.run(scenario())
    assert all(x.complete_stream for x in [*burst, *b_answers, a_urgent, p_urgent])

    def after(answer: Answer) -> int:
        """How many of key A's burst finished after `answer`."""
        return sum(x.finished_at > answer.finished_at for x in burst)

    # Key B's requests were served in turn with A's, not after A's 250 queued: most of A's burst came later.
    assert all(after(x) > 200 for x in b_answers), [after(x) for x in b_answers]
    assert after(p_urgent) > 200  # the trusted key's priority put it ahead of everything queued
    assert after(a_urgent) < 50  # key A's own header was ignored: it waited behind A's burst


def test_an_engine_refuses_what_does_not_fit_its_memory_budget_for_waiting_requests_at_once(small_engine):
    """An engine given a 1 MiB budget for requests waiting beyond its 2 seats serves its seats and what
    fits, and refuses the rest at once: 503, retryable (the gateway tries another engine), Retry-After.
    (A burst past the old fixed 1024 sent to an engine directly is the benchmark's: it can also meet the
    engine's limit on messages not yet written to its core, docs/GATEWAY.md.)"""
    tight = small_engine("tight-engine", "--max-num-seqs", "2", "--max-queued-memory-bytes", "1M")
    answers = asyncio.run(_burst(tight.url, 100, 64))
    served = [a for a in answers if a.complete_stream]
    refused = [a for a in answers if a.status == 503]
    assert len(served) + len(refused) == 100
    assert 2 <= len(served) <= 2 + (1 << 20) // (46 << 10) and refused
    assert all(a.headers["retry-after"] == "1" and a.headers["x-lockstep-retryable"] == "1" for a in refused)
    assert "--max-queued-memory-bytes" in refused[0].body.decode()
