"""`--request-idle-timeout` counts the engine's silence, not a request's wait in a busy engine's queue."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from api_harness import Server
from openai import OpenAI

IDLE_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def one_seat():
    server = Server("random:tiny", "--max-num-seqs", "1", "--request-idle-timeout", str(IDLE_TIMEOUT_S),
                    "--max-model-len", "2048", "--num-gpu-blocks-override", "512", name="one-seat")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def _stream(url: str, max_tokens: int) -> tuple[int, str | None, float]:
    """(tokens generated, finish reason, seconds to the first chunk) of one streamed completion (random:tiny
    has no tokenizer: its chunks carry no text, so the usage counts the tokens)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    started = time.monotonic()
    first = None
    tokens, finish = 0, None
    for chunk in client.completions.create(model="random:tiny", prompt=[5, 6, 7], max_tokens=max_tokens, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        first = first if first is not None else time.monotonic() - started
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    return tokens, finish, first if first is not None else float("nan")


def test_requests_queued_behind_a_long_one_outlast_the_idle_timeout_and_are_served(one_seat):
    """One seat: each request waits in the queue while the ones before it stream, longer than the idle
    timeout. Before, the timeout ran while they waited and they ended with 'no output from the engine'."""
    max_tokens = 2000
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: _stream(one_seat.url, max_tokens), range(3)))
    waits = sorted(first for _, _, first in results)
    assert waits[-1] > 2 * IDLE_TIMEOUT_S, f"no request waited past the idle timeout ({waits}); make them longer"
    assert all(finish == "length" for _, finish, _ in results), results
    assert all(tokens == max_tokens for tokens, _, _ in results), results


def test_a_stream_fails_once_the_engine_is_silent_for_the_idle_timeout(one_seat):
    """The engine core frozen (SIGSTOP) for less than the 5-s heartbeat timeout: it is not declared dead,
    but the stream waiting on it ends with an error event once no token came for the idle timeout; the
    core, running again, serves the next request."""
    core = one_seat.core_pid()
    stream = one_seat.client().completions.create(model="random:tiny", prompt=[1, 2, 3], max_tokens=2000,
                                                  stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(core, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIError) as raised:
            for _ in stream:
                pass
        waited = time.monotonic() - started
    finally:
        os.kill(core, signal.SIGCONT)
    assert "no output from the engine" in str(raised.value), raised.value
    assert IDLE_TIMEOUT_S <= waited < 4.0, waited
    assert _stream(one_seat.url, 5) == (5, "length", pytest.approx(0.0, abs=60))
