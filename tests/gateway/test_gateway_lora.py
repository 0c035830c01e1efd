"""LoRA adapters at the gateway: learnt from each engine's /v1/models (and again while the engine has adapter
slots, so adapters loaded or unloaded at run time are seen), requests for an adapter routed only to its
engines, preferring one where it runs, then one with a free slot, unless that engine is much busier; the
models union lists adapters once. Real gateway processes in front of fake engines that show adapters as vLLM
does (the official `openai` client), and the parsing and scoring on plain data."""

from __future__ import annotations

import httpx
import openai
import pytest
from gateway_harness import FakeEngine, wait_for
from lockstep_gateway.engine_metrics import parse_engine_load
from lockstep_gateway.routing.candidate import Ask, Candidate, EngineLoad, Settings
from lockstep_gateway.routing.lora import FREE_SLOT, RUNNING, LoraAffinity

BASE = "base-model"
SQL, CHAT = "sql-lora", "chat-lora"
PATHS = {SQL: "/adapters/sql", CHAT: "/adapters/chat"}
NUM_REQUESTS = 12


def _client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _complete(gateway, model: str) -> str:
    stream = _client(gateway).completions.create(model=model, prompt="hi", max_tokens=1, stream=True)
    return "".join(chunk.choices[0].text for chunk in stream)


def _fake(*adapters: str, max_loras: int = 2) -> FakeEngine:
    return FakeEngine([BASE], behaviour="ok", adapters={name: PATHS[name] for name in adapters}, max_loras=max_loras)


def _wait_scraped(gateway, fake: FakeEngine) -> None:
    """Until the gateway's latest scrape of `fake` shows its adapters and load as they are now."""
    def seen():
        load = gateway.engines()[fake.url]["load"]
        return load is not None and load["running_adapters"] == sorted(fake.running_adapters) \
            and load["num_running"] == fake.num_running
    wait_for(f"the gateway to scrape {fake.url}'s adapters and load", seen, timeout=10)


def _listed(gateway) -> list[str]:
    return [model.id for model in _client(gateway).models.list()]


def test_adapter_requests_go_only_to_the_engines_serving_the_adapter(start_gateway):
    with _fake(SQL) as sql, _fake() as plain, _fake(CHAT) as chat:
        gateway = start_gateway(*(f"--engine={f.url}" for f in (sql, plain, chat)),
                                expect_healthy={sql.url, plain.url, chat.url})
        for fake in (sql, plain, chat):
            _wait_scraped(gateway, fake)
        for _ in range(NUM_REQUESTS):
            assert _complete(gateway, SQL) == "fake"
        assert (sql.posted_models, plain.num_posts, chat.num_posts) == ([SQL] * NUM_REQUESTS, 0, 0)
        for _ in range(NUM_REQUESTS):
            _complete(gateway, CHAT)
        assert (sql.num_posts, plain.num_posts, chat.posted_models) == (NUM_REQUESTS, 0, [CHAT] * NUM_REQUESTS)


def test_an_adapter_no_engine_serves_is_a_404_naming_it(start_gateway):
    with _fake(SQL) as fake:
        gateway = start_gateway(f"--engine={fake.url}", expect_healthy={fake.url})
        with pytest.raises(openai.NotFoundError, match="`no-such-lora` does not exist"):
            _complete(gateway, "no-such-lora")
        assert fake.num_posts == 0


def test_the_engine_running_the_adapter_is_preferred(start_gateway):
    with _fake(SQL) as running, _fake(SQL) as idle:
        running.running_adapters = [SQL]
        gateway = start_gateway(f"--engine={running.url}", f"--engine={idle.url}",
                                expect_healthy={running.url, idle.url})
        _wait_scraped(gateway, running)
        _wait_scraped(gateway, idle)
        for _ in range(NUM_REQUESTS):
            _complete(gateway, SQL)
        assert (running.num_posts, idle.num_posts) == (NUM_REQUESTS, 0)


def test_an_engine_with_a_free_adapter_slot_is_preferred_to_one_whose_slots_are_full(start_gateway):
    with _fake(SQL, CHAT, max_loras=1) as full, _fake(SQL, max_loras=2) as free:
        full.running_adapters = [CHAT]  # its one slot holds another adapter
        free.running_adapters = ["other-lora"]  # one of its two slots taken
        gateway = start_gateway(f"--engine={full.url}", f"--engine={free.url}", expect_healthy={full.url, free.url})
        _wait_scraped(gateway, full)
        _wait_scraped(gateway, free)
        for _ in range(NUM_REQUESTS):
            _complete(gateway, SQL)
        assert (full.num_posts, free.num_posts) == (0, NUM_REQUESTS)


def test_load_still_wins_over_a_running_adapter(start_gateway):
    with _fake(SQL) as running, _fake(SQL) as idle:
        running.running_adapters = [SQL]
        running.num_running = 40  # far past the lightest engine's load plus the slack
        gateway = start_gateway(f"--engine={running.url}", f"--engine={idle.url}",
                                expect_healthy={running.url, idle.url})
        _wait_scraped(gateway, running)
        _wait_scraped(gateway, idle)
        for _ in range(NUM_REQUESTS):
            _complete(gateway, SQL)
        assert (running.num_posts, idle.num_posts) == (0, NUM_REQUESTS)
        running.num_running = 1  # back within the slack: the running adapter wins again
        _wait_scraped(gateway, running)
        for _ in range(NUM_REQUESTS):
            _complete(gateway, SQL)
        assert (running.num_posts, idle.num_posts) == (NUM_REQUESTS, NUM_REQUESTS)


def test_an_adapter_loaded_and_unloaded_at_run_time_is_picked_up(start_gateway):
    with _fake(max_loras=1) as fake:
        gateway = start_gateway(f"--engine={fake.url}", expect_healthy={fake.url})
        with pytest.raises(openai.NotFoundError, match=SQL):
            _complete(gateway, SQL)
        fake.adapters[SQL] = PATHS[SQL]  # as after POST /v1/load_lora_adapter on the engine
        wait_for(f"{SQL} in the gateway's /v1/models", lambda: SQL in _listed(gateway), timeout=10)
        assert _complete(gateway, SQL) == "fake" and fake.posted_models == [SQL]
        assert gateway.engines()[fake.url]["adapters"] == [SQL]
        del fake.adapters[SQL]  # as after POST /v1/unload_lora_adapter
        wait_for(f"{SQL} gone from the gateway's /v1/models", lambda: _listed(gateway) == [BASE], timeout=10)
        with pytest.raises(openai.NotFoundError, match=SQL):
            _complete(gateway, SQL)
        assert fake.num_posts == 1


def test_models_lists_each_adapter_once_with_its_parent_and_root(start_gateway):
    with _fake(SQL, CHAT) as first, _fake(SQL) as second:
        gateway = start_gateway(f"--engine={first.url}", f"--engine={second.url}",
                                expect_healthy={first.url, second.url})
        cards = {model.id: model.model_dump() for model in _client(gateway).models.list()}
        assert sorted(_listed(gateway)) == sorted([BASE, SQL, CHAT])
        assert {name: (cards[name]["parent"], cards[name]["root"]) for name in (SQL, CHAT)} == \
               {SQL: (BASE, PATHS[SQL]), CHAT: (BASE, PATHS[CHAT])}
        assert "parent" not in cards[BASE]
        assert _client(gateway).models.retrieve(SQL).model_dump()["parent"] == BASE


def test_a_request_without_a_model_goes_to_the_base_model_not_an_adapter(start_gateway):
    with _fake(SQL) as fake:
        gateway = start_gateway(f"--engine={fake.url}", expect_healthy={fake.url})
        response = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=30)
        assert response.status_code == 200, response.text
        assert fake.num_posts == 1


@pytest.mark.parametrize("route", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_adapter_admin_routes_are_the_engines_a_404_at_the_gateway(start_gateway, route):
    with _fake() as fake:
        gateway = start_gateway(f"--engine={fake.url}", expect_healthy={fake.url})
        response = httpx.post(gateway.url + route, json={"lora_name": SQL, "lora_path": PATHS[SQL]}, timeout=10)
        assert response.status_code == 404
        message = response.json()["error"]["message"]
        assert message.startswith(f"POST {route}: the gateway does not load LoRA adapters") and "engines" in message
        assert fake.num_posts == 0


# ---- on plain data -----------------------------------------------------------------------------------------
def test_the_latest_lora_sample_gives_the_adapter_slots():
    text = ('vllm:num_requests_running 3\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 100.0\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="x"} 200.5\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="chat",waiting_lora_adapters=""} 150.0\n')
    assert parse_engine_load(text) == EngineLoad(num_running=3.0, max_loras=2, running_adapters=("chat", "sql"),
                                                 waiting_adapters=("x",))
    assert parse_engine_load("vllm:num_requests_running 3\n").max_loras == 0


def test_lora_affinity_scores_running_then_free_slot_and_only_adapters():
    def engine(url, running=(), waiting=(), num_running=0.0, max_loras=2):
        load = EngineLoad(num_running=num_running, max_loras=max_loras, running_adapters=running,
                          waiting_adapters=waiting)
        return Candidate(url, load=load, load_age_s=0.1, models=(BASE, SQL), adapters=(SQL,))
    candidates = [engine("http://running", running=(SQL,)), engine("http://free", running=(CHAT,)),
                  engine("http://full", running=(CHAT,), waiting=("x",)), engine("http://off", max_loras=0)]
    scorer, settings = LoraAffinity(), Settings()
    assert scorer.score(candidates, Ask(SQL), settings) == [RUNNING, FREE_SLOT, 0.0, 0.0]
    assert scorer.score(candidates, Ask(BASE), settings) == [0.0] * 4
    busy = [engine("http://running", running=(SQL,), num_running=10.0), engine("http://free")]
    assert scorer.score(busy, Ask(SQL), settings) == [0.0, FREE_SLOT]
