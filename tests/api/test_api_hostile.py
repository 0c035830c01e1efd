"""Hostile input and dead cores: every bad request is a 4xx naming the field and the engine
serves the next request; a dead or frozen core makes `lockstep serve` exit non-zero within seconds;
bounds (queue, header and body read time) and secrets (key files, query-string keys) hold."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from api_harness import Server
from polling import wait_until

INT64_OVER = 2**63
HUGE = 10**20


def post(server, path, body=None, content=None, headers=None, timeout=60):
    headers = {**server.headers(), "Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=headers, timeout=timeout)


def assert_400(response, param: str | None):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if param is not None:
        assert (error["param"] or "").split(".")[0] == param, error
    assert "Traceback" not in response.text
    assert response.headers["x-request-id"]
    return error


def serves_next_request(server) -> None:
    reply = server.client().completions.create(model=server.model, prompt=[1, 2, 3], max_tokens=3)
    assert reply.usage.completion_tokens == 3


@pytest.mark.parametrize("fields, param", [
    ({"top_k": INT64_OVER}, "top_k"),  # killed the core before (OverflowError building the window)
    ({"min_tokens": INT64_OVER, "max_tokens": None}, "min_tokens"),
    ({"min_tokens": 5000, "max_tokens": None}, "min_tokens"),  # past max_model_len
    ({"max_tokens": HUGE}, "max_tokens"),
    ({"seed": HUGE}, "seed"),
    ({"n": HUGE}, "n"),
    ({"stop_token_ids": [INT64_OVER]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
    ({"logit_bias": {str(INT64_OVER): 1.0}}, "logit_bias"),
    ({"logit_bias": {str(i): 1.0 for i in range(1100)}}, "logit_bias"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["x" * 5000]}, "stop"),
    ({"temperature": 1e300}, "temperature"),
    ({"presence_penalty": HUGE}, "presence_penalty"),
    ({"prompt": [[1, 2]] * 1025}, "prompt"),
    ({"prompt": [[1, 2]] * 64, "n": 32}, "n"),  # prompts x n
    ({"prompt": [INT64_OVER]}, "prompt"),
])
def test_out_of_range_fields_are_400_and_the_engine_goes_on(tiny, fields, param):
    body = {"model": "random:tiny", "prompt": [1, 2, 3], **fields}
    body = {key: value for key, value in body.items() if value is not None}
    error = assert_400(post(tiny, "/v1/completions", body), param)
    assert len(error["message"]) < 600  # a 20-digit value is shown, not echoed without bound
    serves_next_request(tiny)


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "random:tiny", "prompt": [1, 2], "temperature": NaN}', "temperature"),
    (b'{"model": "random:tiny", "prompt": [1, 2], "top_p": -Infinity}', "top_p"),
    (b'{"model": "random:tiny", "prompt": "\\ud800 lone"}', "prompt"),
    (b'{"model": "\\udc00", "prompt": [1, 2]}', "model"),
    (b'{"model": "random:tiny", "messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages"),
    (b'{"model": "random:tiny", "prompt": [1, 2], "stop": ["\\ud83d"]}', "stop"),
    (b'5', None),
    (b'[1, 2]', None),
    (b'"text"', None),
    (b'{"model": "random:tiny", "messages": 5}', "messages"),
    (b'{"model": "random:tiny", "prompt": [1, 2], "n": "two"}', "n"),
    (b'{"model": "random:tiny", "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}", None),
])
def test_undecodable_text_and_wrong_shapes_are_400(tiny, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    assert_400(post(tiny, path, content=raw), param)
    serves_next_request(tiny)


def test_a_paired_surrogate_escape_is_text(tiny):
    # "\ud83d\ude00" is one emoji: valid, and the token-id prompt is served.
    raw = b'{"model": "random:tiny", "prompt": [1, 2], "max_tokens": 2, "user": "\\ud83d\\ude00"}'
    assert post(tiny, "/v1/completions", content=raw).status_code == 200


def test_too_many_messages_is_400(smol8):
    messages = [{"role": "user", "content": "hi"}] * 4097
    assert_400(post(smol8, "/v1/chat/completions", {"messages": messages}), "messages")


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"chat_template": "{{ 'x' * 10 }}"}}, "chat_template_kwargs"),
    ({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}, "chat_template"),
])
def test_request_supplied_chat_templates_are_refused(smol8, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    error = assert_400(post(smol8, "/v1/chat/completions", body), param)
    assert "--trust-request-chat-template" in error["message"]


def test_health_answers_while_a_huge_prompt_is_tokenized(smol8):
    # 10 MB of text with no space to cut a prefix at, so the worker encodes all of it.
    prompt = "lorem\nipsum\ndolor\nsit\namet\n" * (10_000_000 // 27)
    result = {}

    def send():
        started = time.monotonic()
        result["response"] = post(smol8, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, timeout=300)
        result["seconds"] = time.monotonic() - started

    sender = threading.Thread(target=send)
    sender.start()
    latencies = []
    with httpx.Client(timeout=30) as client:
        while sender.is_alive() and len(latencies) < 2000:
            started = time.monotonic()
            assert client.get(f"{smol8.url}/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
    sender.join(300)
    error = assert_400(result["response"], "prompt")  # far past max_model_len, once tokenized
    tokens = int(re.search(r"<(\d+) tokens>", error["message"]).group(1))  # the count, from the worker process
    assert tokens > 1_000_000 and "max_model_len=1024" in error["message"], error["message"]
    latencies.sort()
    print(f"10 MB prompt answered in {result['seconds']:.2f} s; /health p50 {latencies[len(latencies) // 2] * 1000:.0f} "
          f"ms, max {latencies[-1] * 1000:.0f} ms, {len(latencies)} probes")
    assert len(latencies) >= 3, "the prompt was handled too fast to observe /health meanwhile"
    # The bound leaves room for other test runs on two shared cores (docs/RELIABILITY.md has the figures).
    assert latencies[-1] < 1.0, f"/health took {latencies[-1]:.2f} s while a prompt was tokenized"


def test_a_text_far_past_the_context_is_refused_on_its_prefix(smol8):
    prompt = "lorem ipsum dolor sit amet " * (15_000_000 // 27)  # 15 MB; it took 18-21 s to count whole
    started = time.monotonic()
    error = assert_400(post(smol8, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, timeout=300), "prompt")
    took = time.monotonic() - started
    assert f"a text of {len(prompt)} characters" in error["message"], error["message"]
    assert "exceed max_model_len=1024" in error["message"], error["message"]
    print(f"15 MB text refused in {took:.2f} s")


def test_the_large_text_worker_encodes_as_the_tokenizer_does():
    from lockstep_engine.api.large_text import (LARGE_TEXT_CHARS, PREFIX_CHARS_PER_TOKEN, PREFIX_MARGIN,
                                                LargeTextEncoder)
    from lockstep_engine.sources import resolve

    tokenizer = resolve("smollm2").load_tokenizer()
    encoder = LargeTextEncoder(tokenizer)
    try:
        text = "Ünïcode, code `x = 1`, numbers 12345 and\n\ttabs. " * (LARGE_TEXT_CHARS // 40)
        assert len(text) >= LARGE_TEXT_CHARS
        for add_special in (True, False):
            whole, ids = encoder.encode(text, add_special)
            assert whole and ids.tolist() == tokenizer.encode(text, add_special_tokens=add_special)
        # Far past a context of 1024: judged on a prefix whose ids are the text's own first ids.
        full = tokenizer.encode(text, add_special_tokens=True)
        whole, prefix = encoder.encode(text, True, 1024)
        assert not whole and 1024 + PREFIX_MARGIN <= len(prefix) < len(full), (len(prefix), len(full))
        assert prefix.tolist() == full[: len(prefix)]
        # A text that is long in characters but short in tokens (a run of one character) is encoded whole.
        run = "a" * (1024 * PREFIX_CHARS_PER_TOKEN + 10) + " b"
        whole, ids = encoder.encode(run, True, 1024)
        assert whole and ids.tolist() == tokenizer.encode(run, add_special_tokens=True)
    finally:
        encoder.shutdown()


# ---- a dedicated server: bounds and secrets --------------------------------------------------------
KEY = "file-key-0123456789"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(KEY + "\n")
    server = Server("random:tiny", "--api-key-file", str(key_file), "--uvicorn-log-level", "info",
                    "--max-num-seqs", "2", "--max-queued-requests", "2", "--max-model-len", "1024",
                    "--num-gpu-blocks-override", "1024", "--header-read-timeout", "1", "--body-read-timeout", "1",
                    name="guarded")
    server.api_key = KEY
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def test_the_key_comes_from_a_file(guarded):
    assert httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    assert guarded.client().models.list().data[0].id == "random:tiny"


def test_query_string_keys_are_refused_and_redacted(guarded):
    response = httpx.get(f"{guarded.url}/v1/models?api_key={KEY}", headers=guarded.headers(), timeout=10)
    assert_400(response, "api_key")
    wait_until(lambda: "api_key=REDACTED" in guarded.log_tail(200), 10, what="the access log line")
    assert KEY not in guarded.log_tail(2000)


def test_requests_past_the_queue_limit_get_503_with_retry_after(guarded):
    # 2 running + 2 queued are allowed; the rest are refused at once instead of waiting.
    async def one(client):
        try:
            await client.completions.create(model="random:tiny", prompt=[1, 2, 3], max_tokens=200,
                                            extra_body={"ignore_eos": True})
            return 200
        except openai.APIStatusError as error:
            assert error.status_code == 503, error
            assert error.response.headers["retry-after"] == "1"
            assert "--max-queued-requests" in error.message
            return 503

    async def burst():
        async with guarded.async_client() as client:
            return await asyncio.gather(*(one(client) for _ in range(10)))

    statuses = asyncio.run(burst())
    assert statuses.count(200) >= 4 and statuses.count(503) >= 1, statuses
    serves_next_request(guarded)


def test_connections_that_never_finish_their_headers_are_closed(guarded):
    sockets = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", guarded.port), timeout=10)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: headers never end
            sockets.append(sock)
        deadline = time.monotonic() + 20
        for sock in sockets:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            assert sock.recv(1024) == b""  # closed by the server (no response: there was no request)
        assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200
    finally:
        for sock in sockets:
            sock.close()


def test_a_body_that_never_arrives_is_408(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=15) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply


# ---- fatal means exit ----------------------------------------------------------------------------
EXIT_DEADLINE_S = 10.0


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_serve_exits_non_zero_when_its_core_dies_or_freezes(how):
    server = Server("random:tiny", "--num-gpu-blocks-override", "256", name=f"doomed-{how}").wait_healthy()
    core = server.core_pid()
    client = server.client()
    try:
        # About 20 s of decoding on this machine: still running when the core goes.
        stream = client.completions.create(model="random:tiny", prompt=[1, 2, 3], max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        started = time.monotonic()
        os.kill(core, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:  # the error arrives as an SSE error event or as a closed connection
                pass
        try:
            code = server.process.wait(EXIT_DEADLINE_S + 5)
        except subprocess.TimeoutExpired:
            code = None
        seconds = time.monotonic() - started
        print(f"{how}: exit code {code} after {seconds:.2f} s")
        assert code is not None and code != 0, server.log_tail()
        assert seconds < EXIT_DEADLINE_S, f"exited after {seconds:.1f} s"
    finally:
        if how == "stop":
            try:
                os.kill(core, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()


def _raw_exchange(server, request: bytes, timeout_s: float = 10.0) -> bytes:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    answer = b""
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(request)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
])
def test_protocol_level_400s_are_openai_shaped(tiny, request_bytes):
    head, _, body = _raw_exchange(tiny, request_bytes).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, head
    error = json.loads(body)["error"]
    assert error["type"] == "BadRequestError" and "not valid HTTP/1.1" in error["message"]
    serves_next_request(tiny)


def test_two_authorization_headers_are_refused(tiny):
    key = tiny.headers()["Authorization"]
    response = httpx.post(f"{tiny.url}/v1/completions", timeout=30, content=b'{"prompt": [1], "max_tokens": 1}',
                          headers=[("Authorization", key), ("Authorization", key),
                                   ("Content-Type", "application/json")])
    error = assert_400(response, "authorization")
    assert "send exactly one" in error["message"]


def test_a_json_decode_error_names_no_byte_offset_as_param(tiny):
    error = assert_400(post(tiny, "/v1/completions", content=b'{"model": "random:tiny", "prompt": [1], '), None)
    assert error["param"] is None and "not valid JSON" in error["message"] and "at byte" in error["message"]
