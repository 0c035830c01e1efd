"""Acceptance: what clients see — keys, rate limits, body limit, unknown models, OpenAI error shape,
session affinity, the models union and the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest
from gateway_harness import MODEL, FakeEngine

KEYS = ("sk-alpha-0123456789", "sk-beta-9876543210", "sk-gamma-5555555555")


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.fixture
def guarded(engines, start_gateway, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# gateway keys\n" + "\n".join(KEYS) + "\n")
    return start_gateway(f"--engine={engines[0].url}", f"--api-key-file={key_file}", "--rate-limit-rpm=3",
                         "--rate-limit-tpm=60", "--max-request-body-bytes=65536",
                         env_headers={"Authorization": f"Bearer {KEYS[0]}"}, expect_healthy={engines[0].url})


def _post(gateway, key: str | None, body: dict | None = None, headers: dict | None = None) -> httpx.Response:
    headers = {**(headers or {}), **({"Authorization": f"Bearer {key}"} if key else {})}
    body = body if body is not None else {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    return httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=30)


def test_401_without_a_key_or_with_a_wrong_one(guarded):
    assert _error(_post(guarded, None), 401)["type"] == "AuthenticationError"
    _error(_post(guarded, "sk-alpha-012345678"), 401)  # a prefix of a real key
    _error(httpx.get(guarded.url + "/v1/models", timeout=10), 401)
    assert _post(guarded, KEYS[0]).status_code == 200
    assert KEYS[0] not in guarded.log_tail(1000)


def test_429_with_retry_after_past_the_requests_per_minute_of_a_key(guarded):
    assert [_post(guarded, KEYS[1]).status_code for _ in range(3)] == [200] * 3
    refused = _post(guarded, KEYS[1])
    assert _error(refused, 429)["type"] == "RateLimitError"
    assert int(refused.headers["retry-after"]) >= 1 and "requests" in refused.json()["error"]["message"]
    assert _post(guarded, KEYS[0]).status_code == 200  # another key has its own budget
    assert guarded.metric("lockstep_gateway_rate_limited_requests_total", limit="requests") == 1


def test_429_past_the_tokens_per_minute_of_a_key(guarded):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 25}  # ~28 tokens each of a 60/min budget
    assert [_post(guarded, KEYS[2], body).status_code for _ in range(2)] == [200, 200]
    refused = _post(guarded, KEYS[2], body)
    assert _error(refused, 429) and "tokens" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert guarded.metric("lockstep_gateway_rate_limited_requests_total", limit="tokens") == 1


def test_413_for_a_body_over_the_limit(guarded):
    body = {"model": MODEL, "prompt": [1] * 40000, "max_tokens": 1}  # ~80 kB
    assert _error(_post(guarded, KEYS[0], body), 413)["type"] == "RequestTooLargeError"


def test_404_for_an_unknown_model_and_400_for_a_broken_body(guarded):
    error = _error(_post(guarded, KEYS[0], {"model": "no-such-model", "prompt": [1]}), 404)
    assert error["param"] == "model" and error["type"] == "NotFoundError"
    broken = httpx.post(guarded.url + "/v1/completions", content=b"{not json", timeout=10,
                        headers={"Authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"})
    _error(broken, 400)
    _error(httpx.get(guarded.url + "/v1/nothing-here", timeout=10), 404)


def test_engine_errors_pass_through_in_the_openai_shape(guarded):
    error = _error(_post(guarded, KEYS[0], {"model": MODEL, "prompt": [1], "max_tokens": -1}), 400)
    assert error["type"] == "BadRequestError"


def test_the_openai_client_streams_and_completes_through_the_gateway(guarded):
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEYS[0], max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt=[4, 5], max_tokens=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_session_affinity_by_header_and_by_user(engines, start_gateway):
    gateway = start_gateway(*[f"--engine={e.url}" for e in engines], expect_healthy={e.url for e in engines})

    def counts():
        return {e.url: gateway.metric("lockstep_gateway_upstream_requests_total", engine=e.url, outcome="ok")
                for e in engines}

    for session in ("session-1", "session-2", "session-3"):
        before = counts()
        for _ in range(6):
            assert _post(gateway, None, headers={"x-session-id": session}).status_code == 200
        moved = {url: counts()[url] - before[url] for url in before}
        assert sorted(moved.values()) == [0, 6], (session, moved)
    before = counts()
    for user in [f"user-{i}" for i in range(16)]:
        body = {"model": MODEL, "prompt": [1], "max_tokens": 1, "user": user}
        assert _post(gateway, None, body).status_code == 200
        assert _post(gateway, None, body).status_code == 200
    moved = {url: counts()[url] - before[url] for url in before}
    assert min(moved.values()) >= 4 and sum(moved.values()) == 32  # users spread, each stays put (even counts)
    assert all(count % 2 == 0 for count in moved.values())


def test_models_are_the_union_of_the_engines_and_route_by_name(engines, start_gateway):
    with FakeEngine(["other-model"], behaviour="ok") as fake:
        gateway = start_gateway(f"--engine={engines[0].url}", f"--engine={fake.url}",
                                expect_healthy={engines[0].url, fake.url})
        listed = httpx.get(gateway.url + "/v1/models", timeout=10).json()
        assert sorted(m["id"] for m in listed["data"]) == sorted([MODEL, "other-model"])
        for _ in range(3):
            response = _post(gateway, None, {"model": "other-model", "prompt": "hi", "stream": True})
            assert response.status_code == 200 and '"text": "fake"' in response.text
            assert _post(gateway, None).status_code == 200
        assert fake.num_posts == 3
        missing = _post(gateway, None, {"prompt": [1]})  # two models: the name is required
        assert _error(missing, 400)["param"] == "model"
