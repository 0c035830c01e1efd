"""One API surface wherever it is called: `lockstep up smollm2 --api-key KEY` serves every route the
engine serves, as the engine serves it, and both name the OpenAI routes they do not implement.

The route table is the engine's own FastAPI app: a route added there fails this test until it has a
sample request here (and so a decision about the gateway).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import httpx
import openai
import pytest
from gateway_harness import ENGINE_START_TIMEOUT_S, FakeEngine, free_port, start_up, wait_up
from starlette.routing import Route

MODEL = "smollm2"
KEY = "surface-key"
FAKE_MODEL = "fake-model"
AUTH = {"authorization": f"Bearer {KEY}"}
# The engine's interactive docs pages: the gateway serves the OpenAPI document, not a docs UI.
NOT_PROXIED = {("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc"), ("HEAD", "/docs"),
               ("HEAD", "/docs/oauth2-redirect"), ("HEAD", "/redoc"), ("HEAD", "/openapi.json")}
# Answered by the gateway itself: the same status as the engine's, a body of its own.
LOCAL = {"/health", "/ping", "/metrics", "/version", "/openapi.json"}
GREEDY = {"temperature": 0, "seed": 0}
SAMPLES = {
    ("POST", "/v1/completions"): {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, **GREEDY},
    ("POST", "/v1/chat/completions"): {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}],
                                       "max_tokens": 6, **GREEDY},
    ("POST", "/v1/responses"): {"model": MODEL, "input": "Say hi", "max_output_tokens": 6, **GREEDY},
    ("POST", "/v1/messages"): {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
                               **GREEDY},
    ("POST", "/v1/messages/count_tokens"): {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}]},
    ("GET", "/v1/responses/{response_id}"): None,
    ("DELETE", "/v1/responses/{response_id}"): None,
    ("POST", "/v1/responses/{response_id}/cancel"): None,
    ("GET", "/v1/responses/{response_id}/input_items"): None,
    ("POST", "/tokenize"): {"model": MODEL, "prompt": "Hello world"},
    ("POST", "/detokenize"): {"model": MODEL, "tokens": [19556, 905]},
    ("GET", "/v1/models"): None,
    ("GET", "/v1/models/{model_id}"): None,
    ("GET", "/health"): None,
    ("GET", "/ping"): None,
    ("POST", "/ping"): None,
    ("GET", "/metrics"): None,
    ("GET", "/version"): None,
    ("GET", "/openapi.json"): None,
}
PATH_VALUES = {"{response_id}": "resp_0123", "{model_id}": MODEL, "{model_id:path}": MODEL}


def engine_routes() -> set[tuple[str, str]]:
    from lockstep_engine.api.app import ServerSettings, build_app
    from lockstep_engine.config import EngineConfig

    app = build_app(EngineConfig(model=MODEL), ServerSettings(served_model_names=[MODEL]))
    return {(method, route.path.replace("{model_id:path}", "{model_id}"))
            for route in app.routes if isinstance(route, Route) for method in route.methods or ()}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`lockstep up smollm2 --api-key KEY`: (gateway URL, engine URL)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("surface") / "up.log"
    up = start_up(MODEL, port, log_path, "--api-key", KEY, "--skip-warmup")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(up, url, log_path, 1, timeout=2 * ENGINE_START_TIMEOUT_S)
        engines = httpx.get(url + "/gateway/engines", headers=AUTH, timeout=5).json()["engines"]
        yield url, engines[0]["url"], log_path
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
            up.kill()
            up.wait()


def _call(base: str, method: str, path: str) -> httpx.Response:
    body = SAMPLES[(method, path)]
    for placeholder, value in PATH_VALUES.items():
        path = path.replace(placeholder, value)
    return httpx.request(method, base + path, json=body, headers=AUTH, timeout=120)


def test_every_engine_route_has_a_sample_here():
    assert engine_routes() - NOT_PROXIED == set(SAMPLES), "add the new engine route to SAMPLES (and the gateway)"


@pytest.mark.parametrize(("method", "path"), sorted(SAMPLES), ids=lambda value: str(value))
def test_the_gateway_answers_each_engine_route_as_the_engine_does(stack, method, path):
    gateway, engine, _ = stack
    through, direct = _call(gateway, method, path), _call(engine, method, path)
    assert through.status_code == direct.status_code, (through.text, direct.text)
    if path in LOCAL:
        return
    assert through.headers["content-type"] == direct.headers["content-type"]
    got, want = through.json(), direct.json()
    if want.get("error") is not None:
        assert got == want
        return
    for volatile in ("id", "created", "created_at"):
        got.pop(volatile, None)
        want.pop(volatile, None)
    if isinstance(want.get("data"), list):  # /v1/models
        for card in got["data"] + want["data"]:
            card.pop("created")
    if isinstance(want.get("output"), list):  # /v1/responses: item ids are random
        for item in got["output"] + want["output"]:
            item.pop("id", None)
    if want.get("type") == "message":  # /v1/messages: the second call reads its prompt from the prefix cache
        for usage in (got["usage"], want["usage"]):
            usage["input_tokens"] += usage.pop("cache_read_input_tokens")
    if "choices" in want:
        assert [c.get("text") or c["message"]["content"] for c in got["choices"]] == \
               [c.get("text") or c["message"]["content"] for c in want["choices"]]
        got.pop("choices"), want.pop("choices")
    assert got == want


def test_models_carry_what_the_engine_reports(stack):
    gateway, engine, _ = stack
    reported = openai.OpenAI(base_url=engine + "/v1", api_key=KEY, max_retries=0).models.retrieve(MODEL)
    client = openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.model_dump(exclude={"created"}) == reported.model_dump(exclude={"created"})
    assert card.model_extra["max_model_len"] == 8192, card  # SmolLM2's context length
    assert [m.model_extra["max_model_len"] for m in client.models.list().data] == [8192]
    with pytest.raises(openai.NotFoundError, match="nosuchmodel"):
        client.models.retrieve("nosuchmodel")


def test_responses_stream_through_the_gateway_as_from_the_engine(stack):
    gateway, engine, _ = stack
    streams = []
    for base in (gateway, engine):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        events = list(client.responses.create(model=MODEL, input="Say hi", max_output_tokens=6, temperature=0,
                                              stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        streams.append(([e.type for e in events], text))
    assert streams[0] == streams[1], streams
    assert streams[0][0][-1] == "response.incomplete" and streams[0][1]  # 6 tokens: cut by max_output_tokens


def test_unimplemented_openai_routes_say_so_on_both_servers(stack):
    gateway, engine, _ = stack
    for base in (gateway, engine):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.NotFoundError) as refused:
            client.embeddings.create(model=MODEL, input="hello")
        assert "/v1/embeddings: this OpenAI API route is not implemented here" in refused.value.message
        typo = httpx.get(base + "/v1/chat/completion", headers=AUTH, timeout=10)
        assert typo.status_code == 404
        assert typo.json()["error"]["message"].startswith("Invalid URL (GET /v1/chat/completion)")
        wrong_method = httpx.get(base + "/v1/completions", headers=AUTH, timeout=10)
        assert wrong_method.status_code == 405 and "allowed POST" in wrong_method.json()["error"]["message"]


def test_up_api_key_is_required_by_the_gateway_and_the_engines(stack):
    gateway, engine, _ = stack
    for base in (gateway, engine):
        anonymous = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    client = openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


def test_start_up_logs_no_framework_warnings(stack):
    _, engine, log_path = stack
    httpx.get(engine + "/openapi.json", timeout=30).raise_for_status()  # FastAPI builds its operation ids here
    log = log_path.read_text()
    assert "Duplicate Operation ID" not in log and "UserWarning" not in log, log[-3000:]


def test_a_503_is_logged_once_until_a_request_is_served_again(start_gateway):
    """While engines load, every request gets a 503: the gateway logs the first, not each (once per state
    change), and logs the next run of 503s after a request was served."""
    with FakeEngine([FAKE_MODEL], behaviour="status:503:retryable") as fake:
        gateway = start_gateway(f"--engine={fake.url}", "--max-queue-length=0", expect_healthy={fake.url})
        body = {"model": FAKE_MODEL, "prompt": "x", "max_tokens": 1}

        def send(times: int) -> list[int]:
            return [httpx.post(gateway.url + "/v1/completions", json=body, timeout=30).status_code
                    for _ in range(times)]

        def logged_503s() -> int:
            return gateway.log_path.read_text(errors="replace").count(": 503 ")

        assert set(send(6)) == {503}
        assert logged_503s() == 1
        fake.behaviour = "ok"
        assert send(1) == [200]
        fake.behaviour = "status:503:retryable"
        assert set(send(4)) == {503}
        assert logged_503s() == 2, gateway.log_tail()
