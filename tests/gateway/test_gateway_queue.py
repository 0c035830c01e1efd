"""Flow control: requests no engine can take yet wait in the gateway's per-model queue (by priority,
then arrival, round robin over API keys), bounded by --max-queue-length and --queue-timeout (429 +
Retry-After), and leave it when their client goes away. The queue's order on plain data first, then
real gateway and engine processes; saturation is made exact with --max-in-flight-per-engine=1 and
one long stream holding the engine's only place."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path

import httpx
import pytest
from gateway_harness import MODEL, Engine
from test_gateway_failures import LONG, Stream, poll

from lockstep_gateway.errors import GatewayError
from lockstep_gateway.flow_control import ModelQueue, PriorityTrust, Waiter, request_priority

DEPTH = "lockstep_gateway_queue_depth"
REFUSED = "lockstep_gateway_requests_refused_total"


# ---- the queue's order, on plain data ---------------------------------------------------------
def _waiter(name: str, priority: int = 0, tenant: str = "a") -> Waiter:
    return Waiter(job=name, priority=priority, tenant=tenant, arrival=0.0, granted=None)


def _drain(queue: ModelQueue) -> list[str]:
    order = []
    while queue:
        assert queue.head() is not None
        order.append(queue.pop_head().job)
    return order


def test_lower_priority_first_then_arrival():
    queue = ModelQueue()
    for name, priority in (("late-low", 5), ("first", 0), ("urgent", -3), ("second", 0)):
        queue.push(_waiter(name, priority))
    assert _drain(queue) == ["urgent", "first", "second", "late-low"]


def test_tenants_take_turns_within_a_priority():
    queue = ModelQueue()
    for i in range(4):
        queue.push(_waiter(f"a{i}", tenant="a"))
    queue.push(_waiter("b0", tenant="b"))
    queue.push(_waiter("c0", tenant="c"))
    queue.push(_waiter("b1", tenant="b"))
    assert _drain(queue) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_a_removed_waiter_leaves_its_place_and_the_count():
    queue = ModelQueue()
    waiters = [_waiter(f"a{i}") for i in range(3)]
    for waiter in waiters:
        queue.push(waiter)
    assert queue.remove(waiters[1]) and len(queue) == 2
    assert not queue.remove(waiters[1])
    assert _drain(queue) == ["a0", "a2"]


def test_the_header_priority_is_the_negated_body_priority_and_negative_is_sheddable():
    assert request_priority({}, {}) == (0, False)
    assert request_priority({}, {"priority": 7}) == (7, False)
    assert request_priority({}, {"priority": -2}) == (-2, False)  # a body priority is never sheddable
    assert request_priority({"x-gateway-priority": "10"}, {"priority": 7}) == (-10, False)
    assert request_priority({"x-gateway-priority": "-1"}, {}) == (1, True)
    for headers, body, param in (({"x-gateway-priority": "high"}, {}, "x-gateway-priority"),
                                 ({}, {"priority": "1"}, "priority"), ({}, {"priority": 1.5}, "priority"),
                                 ({}, {"priority": 2**63}, "priority")):
        with pytest.raises(GatewayError) as refused:
            request_priority(headers, body)
        assert refused.value.status == 400 and refused.value.param == param


def test_an_untrusted_source_cannot_make_its_request_more_urgent():
    untrusted = functools.partial(request_priority, trusted=False)
    assert untrusted({"x-gateway-priority": "1000"}, {}) == (0, False)  # the header is ignored
    assert untrusted({"x-gateway-priority": "-1"}, {}) == (0, False)  # also when it would shed the request
    assert untrusted({"x-gateway-priority": "high"}, {}) == (0, False)  # ignored, not checked
    assert untrusted({}, {"priority": -5}) == (0, False)  # more urgent than the default: counts as 0
    assert untrusted({}, {"priority": 5}) == (5, False)  # less urgent: as asked
    assert untrusted({"x-gateway-priority": "9"}, {"priority": 3}) == (3, False)


def test_priority_is_trusted_from_configured_keys_and_proxies_only():
    trust = PriorityTrust(key_ids=["k-batch"], proxies=["10.0.0.0/8", "::1"])
    assert trust.trusts("k-batch", "192.0.2.7")
    assert not trust.trusts("k-other", "192.0.2.7")
    assert trust.trusts("k-other", "10.1.2.3") and trust.trusts(None, "::1")
    assert not trust.trusts(None, "11.0.0.1") and not trust.trusts(None, None) and not trust.trusts(None, "not-an-ip")
    assert not PriorityTrust().trusts("addr:127.0.0.1", "127.0.0.1")


# ---- real gateway and engines ----------------------------------------------------------------------
async def _post(client: httpx.AsyncClient, gateway, body: dict | None = None, headers=None) -> httpx.Response:
    body = body or {"model": MODEL, "prompt": [1, 2], "max_tokens": 4, "ignore_eos": True}
    return await client.post(gateway.url + "/v1/completions", json=body, headers=headers)


def _depth(gateway) -> float:
    return gateway.metric(DEPTH, model=MODEL)


async def _queued(client, gateway, order: list[str], name: str, body=None, headers=None) -> httpx.Response:
    """Send one request and wait until it is queued; its name is appended to `order` when it is answered."""
    before = _depth(gateway)

    async def send():
        response = await _post(client, gateway, body, headers)
        order.append(name)
        return response

    task = asyncio.create_task(send())
    await poll(f"{name} to be queued", lambda: _depth(gateway) == before + 1, 20)
    return task


async def _hold(client, gateway, headers=None) -> tuple[Stream, asyncio.Task]:
    """A long stream on the engine's only place."""
    holder = Stream()
    task = asyncio.create_task(holder.run(client, gateway.url, LONG, headers))
    await poll("the holding stream's first token", lambda: holder.events > 0, 60)
    return holder, task


async def _release(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_burst_past_seats_and_saturation_depth_is_served_in_full(log_dir, start_gateway):
    seats, depth, burst, tokens = 2, 2, 32, 16
    engine = Engine("two-seat-engine", log_dir)
    engine.argv += ["--max-num-seqs", str(seats)]
    engine.start()
    try:
        engine.wait_healthy()
        gateway = start_gateway(f"--engine={engine.url}", f"--saturation-queue-depth={depth}",
                                expect_healthy={engine.url})

        async def scenario():
            limits = httpx.Limits(max_connections=burst)
            async with httpx.AsyncClient(timeout=180, limits=limits) as client:
                streams = [Stream() for _ in range(burst)]
                await asyncio.gather(*(s.run(client, gateway.url, tokens) for s in streams))
                return streams

        started = time.monotonic()
        streams = asyncio.run(scenario())
        took = time.monotonic() - started
    finally:
        engine.stop()
    assert all(s.done and s.error is None and s.events >= 1 for s in streams), [(s.done, s.error) for s in streams]
    assert gateway.metric(REFUSED) == 0
    queued = gateway.metric("lockstep_gateway_queue_wait_seconds_count", model=MODEL)
    assert queued >= 1  # the saturation depth was passed: some waited at the gateway
    assert _depth(gateway) == 0
    print(f"burst of {burst} over {seats} seats + depth {depth}: all served in {took:.1f}s, {queued:.0f} queued")


def test_queued_requests_go_by_priority_and_the_first_byte_timeout_starts_at_dispatch(engines, start_gateway):
    first_byte_timeout = 2.0
    gateway = start_gateway(f"--engine={engines[0].url}", "--max-in-flight-per-engine=1",
                            f"--first-byte-timeout={first_byte_timeout}", "--priority-trusted-proxies=127.0.0.1",
                            expect_healthy={engines[0].url})

    async def scenario():
        order: list[str] = []
        async with httpx.AsyncClient(timeout=60) as client:
            _, holder = await _hold(client, gateway)
            # Header priorities: a body `priority` other than 0 needs an engine with --scheduling-policy priority.
            tasks = [await _queued(client, gateway, order, "none"),
                     await _queued(client, gateway, order, "1", headers={"x-gateway-priority": "1"}),
                     await _queued(client, gateway, order, "5", headers={"x-gateway-priority": "5"}),
                     await _queued(client, gateway, order, "3", headers={"x-gateway-priority": "3"})]
            # Every one queued longer than the first-byte timeout: it must not count.
            await asyncio.sleep(first_byte_timeout + 0.6)
            await _release(holder)
            responses = await asyncio.gather(*tasks)
        return order, responses

    order, responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert order == ["5", "3", "1", "none"]
    assert gateway.metric("lockstep_gateway_queue_wait_seconds_count", model=MODEL) == 4
    assert gateway.metric("lockstep_gateway_queue_wait_seconds_bucket", model=MODEL, le="2.5") == 0
    assert _depth(gateway) == 0


def test_api_keys_take_turns_so_one_burst_cannot_starve_another_key(engines, start_gateway, tmp_path: Path):
    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n")
    a, b = ({"authorization": f"Bearer {key}"} for key in ("key-a", "key-b"))
    gateway = start_gateway(f"--engine={engines[0].url}", "--max-in-flight-per-engine=1", f"--api-key-file={keys}",
                            expect_healthy={engines[0].url}, env_headers=a)

    async def scenario():
        order: list[str] = []
        async with httpx.AsyncClient(timeout=60) as client:
            _, holder = await _hold(client, gateway, a)
            tasks = [await _queued(client, gateway, order, f"a{i}", headers=a) for i in range(3)]
            tasks.append(await _queued(client, gateway, order, "b0", headers=b))
            await _release(holder)
            responses = await asyncio.gather(*tasks)
        return order, responses

    order, responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 4
    assert order == ["a0", "b0", "a1", "a2"]


def test_queue_bounds_answer_429_with_retry_after_and_sheddable_requests_503(engines, start_gateway):
    timeout = 3.0  # long enough to see it queued on a loaded machine
    gateway = start_gateway(f"--engine={engines[0].url}", "--max-in-flight-per-engine=1", "--max-queue-length=1",
                            f"--queue-timeout={timeout}", "--retry-after=4", "--priority-trusted-proxies=127.0.0.1",
                            expect_healthy={engines[0].url})

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            _, holder = await _hold(client, gateway)
            started = time.monotonic()
            waiting = await _queued(client, gateway, [], "waiting")
            full = await _post(client, gateway)
            shed = await _post(client, gateway, headers={"x-gateway-priority": "-1"})
            timed_out = await waiting
            waited = time.monotonic() - started
            await _release(holder)
        return full, shed, timed_out, waited

    full, shed, timed_out, waited = asyncio.run(scenario())
    for response, flag in ((full, "--max-queue-length"), (timed_out, "--queue-timeout")):
        assert response.status_code == 429 and response.headers["retry-after"] == "4", response.text
        error = response.json()["error"]
        assert error["type"] == "RateLimitError" and error["code"] == 429 and flag in error["message"]
    assert timeout <= waited < timeout + 10
    assert shed.status_code == 503 and shed.headers["retry-after"] == "4"
    assert "sheddable" in shed.json()["error"]["message"]
    assert [gateway.metric(REFUSED, reason=reason) for reason in ("queue_full", "queue_timeout", "sheddable")] \
        == [1, 1, 1]
    assert _depth(gateway) == 0


def test_a_client_that_disconnects_while_queued_leaves_the_queue_at_once(engines, start_gateway):
    engine = engines[0]
    gateway = start_gateway(f"--engine={engine.url}", "--max-in-flight-per-engine=1", expect_healthy={engine.url})

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client, httpx.AsyncClient(timeout=60) as leaving:
            _, holder = await _hold(client, gateway)
            gone = await _queued(leaving, gateway, [], "leaving")
            await _release(gone)
            await leaving.aclose()
            left_at = time.monotonic()
            await poll("the queue to empty", lambda: _depth(gateway) == 0, 10)
            took = time.monotonic() - left_at
            await _release(holder)
            served = await _post(client, gateway)
            return took, served

    took, served = asyncio.run(scenario())
    assert took < 5.0
    assert served.status_code == 200  # the place is free: the one that left holds nothing
    # The holder's attempt and the last request's: the one that left never reached the engine.
    assert gateway.metric("lockstep_gateway_upstream_requests_total", engine=engine.url) == 2
    assert gateway.metric(REFUSED) == 0
    assert gateway.engines()[engine.url]["in_flight"] == 0


def _write_engines(path: Path, urls: list[str]) -> None:
    path.write_text(json.dumps({"engines": urls}))


def test_a_queued_request_is_dispatched_when_a_second_engine_comes_up(engines, start_gateway, tmp_path: Path):
    first, second = engines
    config = tmp_path / "engines.json"
    _write_engines(config, [first.url])
    gateway = start_gateway(f"--config={config}", "--max-in-flight-per-engine=1", expect_healthy={first.url})

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            holder, holding = await _hold(client, gateway)
            waiting = await _queued(client, gateway, [], "waiting")
            _write_engines(config, [first.url, second.url])
            served = await waiting
            still_holding = holder.ended_at is None
            await _release(holding)
            return served, still_holding

    served, still_holding = asyncio.run(scenario())
    assert served.status_code == 200 and still_holding
    assert gateway.metric("lockstep_gateway_upstream_requests_total", engine=second.url, outcome="ok") == 1


def test_a_known_model_with_no_engine_waits_in_the_queue_for_one(engines, start_gateway, tmp_path: Path):
    engine = engines[1]
    config = tmp_path / "engines.json"
    _write_engines(config, [engine.url])
    gateway = start_gateway(f"--config={config}", expect_healthy={engine.url})

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            assert (await _post(client, gateway)).status_code == 200  # the model is known from now on
            _write_engines(config, [])
            await poll("the engine to be forgotten", lambda: not gateway.engines(), 20)
            waiting = await _queued(client, gateway, [], "waiting")
            _write_engines(config, [engine.url])  # scaled up from zero
            return await waiting

    served = asyncio.run(scenario())
    assert served.status_code == 200, served.text
