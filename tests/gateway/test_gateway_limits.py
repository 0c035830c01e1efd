"""API keys and per-key rate limits, on plain data with an injected clock."""

from __future__ import annotations

import pytest
from lockstep_gateway.auth import KeyChecker, key_id, load_keys
from lockstep_gateway.breaker import CircuitBreaker, RetryBudget
from lockstep_gateway.config import ConfigError, GatewayConfig
from lockstep_gateway.main import parse_args
from lockstep_gateway.ratelimit import ClientAddress, RateLimiter, estimate_tokens


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


def test_token_estimates_count_every_prompt_n_and_what_the_context_leaves():
    assert estimate_tokens({"prompt": [1, 2, 3], "max_tokens": 10}) == 13
    assert estimate_tokens({"prompt": [[1, 2], [3]], "max_tokens": 5, "n": 2}) == (7 + 6) * 2
    assert estimate_tokens({"prompt": ["a", "b", "c"] * 3, "max_tokens": 10}) == 9 * 11  # 9 prompts
    assert estimate_tokens({"prompt": "x" * 40}) == 11 + 16  # ~4 characters a token; default max_tokens 16
    assert estimate_tokens({"messages": [{"role": "user", "content": "abcd" * 5}], "max_completion_tokens": 3}) == 12
    # max_tokens far past the context: only what the context leaves counts
    assert estimate_tokens({"prompt": [1] * 48, "max_tokens": 10**9}, max_model_len=2048) == 2048
    for hostile in ({"messages": 5}, {"messages": [5, None]}, {"prompt": {"a": 1}}, {"n": "x", "max_tokens": 1.5},
                    {"prompt": [[1], "a", 3]}, {"n": 10**30, "max_tokens": 10**30}):
        assert estimate_tokens(hostile, max_model_len=2048) >= 1


def test_a_refund_makes_a_refused_request_cost_nothing():
    limiter = RateLimiter(requests_per_minute=1, tokens_per_minute=100, clock=Clock())
    for _ in range(5):
        assert limiter.admit("k", 100) is None
        limiter.refund("k", 100)  # e.g. the engine answered 400
    assert limiter.admit("k", 100) is None
    assert limiter.admit("k", 1) == ("requests", 60)


def test_x_forwarded_for_names_the_client_only_behind_a_trusted_proxy():
    trusting = ClientAddress(("10.0.0.0/8",))
    assert trusting.of("10.1.2.3", "203.0.113.7, 10.9.9.9") == "203.0.113.7"
    assert trusting.of("10.1.2.3", "198.51.100.1, 203.0.113.7") == "203.0.113.7"  # the nearest untrusted hop
    assert trusting.of("192.0.2.1", "203.0.113.7") == "192.0.2.1"  # not a trusted peer: its header is ignored
    assert ClientAddress(()).of("10.1.2.3", "203.0.113.7") == "10.1.2.3"
    with pytest.raises(ConfigError, match="--trusted-proxies"):
        GatewayConfig(trusted_proxies=("not-an-address",))


def test_the_breaker_opens_after_consecutive_failures_and_one_probe_decides():
    breaker = CircuitBreaker(threshold=3, cooldown_s=5.0)
    for now in (0.0, 1.0):
        assert not breaker.on_failure(now)
    breaker.on_success()  # not consecutive any more
    assert [breaker.on_failure(t) for t in (2.0, 3.0, 4.0)] == [False, False, True]
    assert not breaker.allows(8.9)
    assert breaker.allows(9.0)
    breaker.on_attempt(9.0)
    assert not breaker.allows(9.1)  # one probe at a time
    assert breaker.on_failure(9.5) and not breaker.allows(14.0)  # the probe failed: another cool-down
    assert breaker.allows(14.5)
    breaker.on_attempt(14.5)
    breaker.on_success()
    assert breaker.allows(14.6) and not breaker.is_open


def test_the_retry_budget_is_a_share_of_the_requests_in_progress_with_a_floor():
    budget = RetryBudget(ratio=0.2, minimum=3)
    budget.retrying = 2
    assert budget.allows(0)
    budget.retrying = 3
    assert not budget.allows(10) and budget.allows(100)  # 20 % of 100 = 20


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
    lists = parse_args(["--kubernetes-namespace=a, b", "--kubernetes-namespace=c,", "--engine=http://127.0.0.1:1",
                        "--trusted-proxies=10.0.0.0/8, ,127.0.0.1/32"])
    assert lists.kubernetes_namespaces == ("a", "b", "c") and lists.trusted_proxies == ("10.0.0.0/8", "127.0.0.1/32")
    assert "sk-secret" not in repr(GatewayConfig(api_keys=("sk-secret",)))
