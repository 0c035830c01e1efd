"""API keys and per-key rate limits, on plain data with an injected clock."""

from __future__ import annotations

import pytest
from lockstep_gateway.auth import KeyChecker, key_id, load_keys
from lockstep_gateway.config import ConfigError, GatewayConfig
from lockstep_gateway.main import parse_args
from lockstep_gateway.ratelimit import RateLimiter, estimate_tokens


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_refuse_past_the_budget_and_refill_over_time():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=2, tokens_per_minute=0, clock=clock)
    assert limiter.admit("k", 10) is None and limiter.admit("k", 10) is None
    assert limiter.admit("k", 10) == ("requests", 30)  # one request every 30 s
    assert limiter.admit("other", 10) is None
    clock.now += 30
    assert limiter.admit("k", 10) is None


def test_tokens_per_minute_with_settlement_of_the_real_usage():
    clock = Clock()
    limiter = RateLimiter(requests_per_minute=0, tokens_per_minute=600, clock=clock)  # 10 tokens/s
    assert limiter.admit("k", 500) is None
    assert limiter.admit("k", 200) == ("tokens", 10)
    limiter.settle("k", estimated_tokens=500, actual_tokens=100)  # the engine used far less
    assert limiter.admit("k", 200) is None


def test_a_request_larger_than_the_whole_budget_waits_for_a_full_bucket_only():
    clock = Clock()
    limiter = RateLimiter(0, 100, clock=clock)
    assert limiter.admit("k", 1000) is None  # full bucket: admitted, now deep in debt
    kind, retry_after = limiter.admit("k", 1000)
    assert kind == "tokens" and retry_after == 600  # 900 owed + 100 to refill, at 100/min


def test_token_estimates_count_prompt_ids_text_and_the_output_budget():
    assert estimate_tokens({"prompt": [1, 2, 3], "max_tokens": 10}) == 13
    assert estimate_tokens({"prompt": [[1, 2], [3]], "max_tokens": 5, "n": 2}) == 13
    assert estimate_tokens({"prompt": "x" * 40}) == 11 + 16  # ~4 characters a token; default max_tokens 16
    assert estimate_tokens({"messages": [{"role": "user", "content": "abcd" * 5}], "max_completion_tokens": 3}) == 12


def test_keys_come_from_files_secret_directories_and_the_environment(tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# comment\nsk-one\n\nsk-two\n")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "alice").write_text("sk-three\n")
    (secret / "..data").write_text("ignored")  # how a mounted Secret links its files
    keys = load_keys([str(key_file), str(secret)], environ={"LOCKSTEP_API_KEYS": "sk-four, sk-one"})
    assert keys == ("sk-four", "sk-one", "sk-two", "sk-three")


def test_key_check_accepts_only_exact_bearer_keys():
    checker = KeyChecker(["sk-one", "sk-two"])
    assert checker.check("Bearer sk-two") == key_id("sk-two")
    assert checker.check("bearer sk-one") == key_id("sk-one")
    for bad in (None, "", "sk-one", "Bearer sk-on", "Bearer sk-one2", "Basic sk-one"):
        assert checker.check(bad) is None
    assert not KeyChecker([]).enabled


def test_gateway_config_refuses_bad_values_by_flag_name():
    with pytest.raises(ConfigError, match="--idle-timeout=0"):
        GatewayConfig(idle_timeout_s=0)
    with pytest.raises(ConfigError, match="--routing='fastest'"):
        GatewayConfig(routing="fastest")
    with pytest.raises(ConfigError, match="--engine='127.0.0.1:8001'"):
        GatewayConfig(engines=("127.0.0.1:8001",))
    with pytest.raises(SystemExit):
        parse_args([])  # no discovery at all
    config = parse_args(["--kubernetes-namespace=ns1", "--kubernetes-namespace=ns2", "--rate-limit-rpm=5"])
    assert config.kubernetes_namespaces == ("ns1", "ns2") and config.rate_limit_rpm == 5
    assert "sk-secret" not in repr(GatewayConfig(api_keys=("sk-secret",)))
