"""Each class of bad input gets its status and the OpenAI error object; the small endpoints answer."""

import httpx
import openai
import pytest

from api_harness import API_KEY, MAX_BODY_BYTES


def post(server, path, body=None, content=None, headers=None):
    headers = {**server.headers(), "Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=headers, timeout=60)


def assert_error(response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_malformed_json_is_400(tiny):
    error = assert_error(post(tiny, "/v1/completions", content=b'{"model": "random:tiny", "prompt": [1, 2'), 400)
    assert error["type"] == "BadRequestError"


@pytest.mark.parametrize("body, param", [
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": "many"}, "max_tokens"),
    ({"prompt": [1, 2], "stream": "yes please"}, "stream"),
    ({"prompt": [1, 2], "stop": 7}, "stop"),
])
def test_wrong_types_are_400_naming_the_field(tiny, body, param):
    error = assert_error(post(tiny, "/v1/completions", {"model": "random:tiny", **body}), 400)
    assert error["param"].split(".")[0] == param


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_k", -3), ("n", 0), ("max_tokens", 0), ("logprobs", 50),
    ("presence_penalty", 3.0), ("min_p", 1.5), ("seed", 2**70), ("stop_token_ids", [5000]),
])
def test_out_of_range_values_are_400_naming_the_field(tiny, field, value):
    assert_error(post(tiny, "/v1/completions", {"model": "random:tiny", "prompt": [1, 2, 3], field: value}),
                 400, field)


def test_prompt_over_max_model_len_is_400(tiny):
    too_long = list(range(3, 1027))  # max_model_len is 1024
    assert_error(post(tiny, "/v1/completions", {"model": "random:tiny", "prompt": too_long}), 400, "prompt")
    fits = list(range(3, 1003))
    assert_error(post(tiny, "/v1/completions", {"model": "random:tiny", "prompt": fits, "max_tokens": 100}),
                 400, "max_tokens")


def test_text_prompt_without_a_tokenizer_is_400(tiny):
    assert_error(post(tiny, "/v1/completions", {"model": "random:tiny", "prompt": "hello"}), 400, "prompt")
    assert_error(post(tiny, "/v1/chat/completions",
                      {"model": "random:tiny", "messages": [{"role": "user", "content": "hi"}]}), 400, "messages")


def test_stream_options_without_stream_is_400(tiny):
    assert_error(post(tiny, "/v1/completions", {"model": "random:tiny", "prompt": [1, 2],
                                                "stream_options": {"include_usage": True}}), 400, "stream_options")


def test_unknown_model_is_404(tiny):
    with pytest.raises(openai.NotFoundError) as caught:
        tiny.client().completions.create(model="gpt-4", prompt=[1, 2, 3], max_tokens=2)
    assert caught.value.body["param"] == "model"


def test_missing_or_wrong_key_is_401_but_health_and_metrics_stay_open(tiny):
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(f"{tiny.url}/v1/completions", json={"prompt": [1, 2]}, headers=headers, timeout=30)
        assert_error(response, 401)
    client = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert httpx.get(f"{tiny.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{tiny.url}/metrics", timeout=10).status_code == 200
    assert tiny.client().models.list().data[0].id == "random:tiny"
    assert API_KEY == tiny.api_key


def test_oversized_body_is_413(tiny):
    body = b'{"model": "random:tiny", "prompt": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
    assert_error(post(tiny, "/v1/completions", content=body), 413)


def test_unknown_route_is_404_in_the_openai_shape(tiny):
    assert_error(httpx.get(f"{tiny.url}/v1/nothing-here", headers=tiny.headers(), timeout=10), 404)


def test_models_version_and_metrics(tiny):
    card = httpx.get(f"{tiny.url}/v1/models", headers=tiny.headers(), timeout=10).json()["data"][0]
    assert card["id"] == "random:tiny" and card["max_model_len"] == 1024 and card["object"] == "model"
    assert httpx.get(f"{tiny.url}/version", timeout=10).json()["version"]
    exposition = httpx.get(f"{tiny.url}/metrics", timeout=10).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{model_name="random:tiny",engine="0"}}' in exposition  # vLLM V1's labels


def test_tokenize_and_detokenize_round_trip(smol8):
    tokens = post(smol8, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    assert "".join(tokens["token_strs"]) == "Hello world"
    assert post(smol8, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    chat = post(smol8, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tokens["count"]
    assert_error(post(smol8, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
