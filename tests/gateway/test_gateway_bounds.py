"""Acceptance: the gateway's edges under hostile clients — 400s (never 5xx) for broken bodies,
admission under a burst, slowloris connections closed, query-string keys refused, and a gateway
that authenticates to engines started with --api-key."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
from gateway_harness import MODEL, Engine, FakeEngine, wait_for

HOSTILE_BODIES = {
    "messages is a number": b'{"model": "random:tiny", "messages": 5}',
    "nested 1000 deep": b'{"model": "random:tiny", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    "nested 100000 deep": b"[" * 100000,
    "not UTF-8": b'{"model": "random:tiny", "prompt": "\xff\xfe"}',
    "lone surrogate in the prompt": b'{"model": "random:tiny", "prompt": "a\\ud800b"}',
    "lone surrogate in the model": b'{"model": "\\udfff", "prompt": "a"}',
    "a list": b"[1, 2]",
    "a string": b'"hello"',
    "null": b"null",
}


def test_hostile_bodies_get_an_openai_400_and_both_engines_serve_after(engines, start_gateway):
    gateway = start_gateway(*[f"--engine={e.url}" for e in engines], expect_healthy={e.url for e in engines})
    for name, body in HOSTILE_BODIES.items():
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = httpx.post(gateway.url + path, content=body, headers={"content-type": "application/json"},
                                  timeout=30)
            assert 400 <= response.status_code < 500, (name, path, response.status_code, response.text[:300])
            error = response.json()["error"]
            assert error["code"] == response.status_code and "Traceback" not in response.text, name
    lone = httpx.post(gateway.url + "/v1/completions", content=HOSTILE_BODIES["lone surrogate in the prompt"],
                      timeout=30).json()["error"]
    assert lone["param"] == "prompt" and "surrogate" in lone["message"]
    before = {e.url: gateway.metric("lockstep_gateway_upstream_requests_total", engine=e.url, outcome="ok")
              for e in engines}
    for _ in range(8):
        response = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 1},
                              timeout=30)
        assert response.status_code == 200
    after = {e.url: gateway.metric("lockstep_gateway_upstream_requests_total", engine=e.url, outcome="ok")
             for e in engines}
    assert all(after[url] > before[url] for url in before), (before, after)


def test_a_burst_past_max_in_flight_gets_503_at_once_and_the_count_is_exact(start_gateway):
    limit, burst = 8, 48
    with FakeEngine([MODEL], behaviour="hang") as fake:
        gateway = start_gateway(f"--engine={fake.url}", f"--max-in-flight={limit}", "--retry-after=2",
                                expect_healthy={fake.url})

        async def scenario():
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=burst)) as client:
                body = {"model": MODEL, "prompt": [1], "max_tokens": 1}
                tasks = [asyncio.create_task(client.post(gateway.url + "/v1/completions", json=body))
                         for _ in range(burst)]
                started = time.monotonic()
                refused = []
                while len(refused) < burst - limit and time.monotonic() - started < 20:
                    done = [t for t in tasks if t.done()]
                    refused = [t.result() for t in done]
                    await asyncio.sleep(0.01)
                took = time.monotonic() - started
                deadline = time.monotonic() + 10
                while fake.num_posts < limit and time.monotonic() < deadline:  # the admitted ones arriving
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # a ninth would have arrived by now
                posts = fake.num_posts
                fake.release.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                return refused, took, posts

        refused, took, posts = asyncio.run(scenario())
    assert len(refused) == burst - limit and posts == limit
    for response in refused:
        assert response.status_code == 503 and response.headers["retry-after"] == "2"
        assert "--max-in-flight" in response.json()["error"]["message"]
    assert gateway.metric("lockstep_gateway_admission_refused_total") == burst - limit
    print(f"burst of {burst} over --max-in-flight={limit}: {burst - limit} refused with 503 in {took:.2f}s")


def test_slowloris_connections_are_closed_after_the_header_timeout(start_gateway):
    connections, header_timeout = 300, 1.0
    with FakeEngine([MODEL], behaviour="ok") as fake:
        gateway = start_gateway(f"--engine={fake.url}", f"--header-timeout={header_timeout}", "--body-timeout=1",
                                expect_healthy={fake.url})
        sockets = []
        try:
            for _ in range(connections):
                sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
                sockets.append(sock)
            opened = time.monotonic()
            started = time.monotonic()
            assert httpx.get(gateway.url + "/health", timeout=5).status_code == 200  # still serving meanwhile
            assert time.monotonic() - started < 1.0
            for sock in sockets:
                sock.settimeout(header_timeout + 5)
                assert sock.recv(1024) == b""  # closed by the gateway
            closed_after = time.monotonic() - opened
        finally:
            for sock in sockets:
                sock.close()
        # A body that never arrives: 408 after the body timeout, and the connection closed (a client trickling
        # the rest would otherwise hold it).
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\"")
            answer = b""
            while chunk := sock.recv(4096):  # until the gateway closes; a socket timeout fails the test
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert b"connection: close" in answer.lower(), answer[:300]
    assert closed_after <= header_timeout + 2.0
    print(f"{connections} slowloris connections closed {closed_after:.2f}s after opening (--header-timeout=1)")


def test_query_string_keys_are_refused(start_gateway):
    with FakeEngine([MODEL], behaviour="ok") as fake:
        gateway = start_gateway(f"--engine={fake.url}", expect_healthy={fake.url})
        for path in ("/v1/completions?api_key=sk-secret-123", "/v1/models?key=sk-secret-123"):
            method = httpx.post if path.startswith("/v1/completions") else httpx.get
            response = method(gateway.url + path, timeout=10)
            assert response.status_code == 401 and "Authorization: Bearer" in response.json()["error"]["message"]
            assert "sk-secret-123" not in response.text
        assert fake.num_posts == 0
    assert "sk-secret-123" not in gateway.log_tail(1000)


def test_the_gateway_authenticates_to_an_engine_started_with_an_api_key(start_gateway, log_dir, tmp_path):
    key = "sk-engine-4242"
    engine = Engine("keyed-engine", log_dir)
    engine.argv += ["--api-key", key]
    engine.start()
    try:
        engine.wait_healthy()
        key_file = tmp_path / "engine-key"
        key_file.write_text(key + "\n")
        keyed = start_gateway(f"--engine={engine.url}", f"--engine-api-key-file={key_file}",
                              expect_healthy={engine.url})
        response = httpx.post(keyed.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 2},
                              timeout=30)
        assert response.status_code == 200, response.text
        unkeyed = start_gateway(f"--engine={engine.url}")
        wait_for("the unkeyed gateway to say why", lambda: "--engine-api-key-file" in unkeyed.log_tail(50), timeout=20)
        assert unkeyed.engines()[engine.url]["healthy"] is False
    finally:
        engine.stop()
    assert key not in keyed.log_tail(1000)
