"""`vllm serve`'s flags on `lockstep serve`: value syntaxes, the catalogue's notices and refusals,
--config YAML, and one real server started the way a vLLM user would start it: a hub id read from a
Hugging Face cache the test builds, TLS with a self-signed certificate, --root-path, CORS, a chat
template file, --response-role and the model's generation_config.json as sampling defaults.
"""

from __future__ import annotations

import datetime
import json
import os
import ssl
import subprocess
import sys

import httpx
import openai
import pytest
from api_harness import REPO, free_port
from polling import wait_until

from lockstep_engine.entrypoints import serve, vllm_flags
from lockstep_engine.hf_cache import HubCacheError, resolve_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "test-org/tiny-chat"
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


# ---- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("2048", 2048), ("32k", 32000), ("32K", 32768), ("1m", 1_000_000),
                                         ("1M", 1 << 20), ("25.6k", 25600), ("1g", 10**9), ("2G", 2 << 30)])
def test_human_readable_ints_follow_vllm(text, value):
    assert vllm_flags.human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "12x", "k", ""])
def test_bad_human_readable_ints_say_what_is_allowed(text, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["random:tiny", "--max-model-len", text])
    assert "--max-model-len" in capsys.readouterr().err


@pytest.mark.parametrize("spelled, dtype", [("half", "float16"), ("float", "float32"), ("float16", "float16"),
                                            ("bfloat16", "bfloat16"), ("auto", "auto")])
def test_vllm_dtype_spellings(spelled, dtype):
    _, config, _ = serve.parse_args(["random:tiny", "--dtype", spelled, "--max-model-len", "1k"])
    assert config.dtype == dtype and config.max_model_len == 1000


def _given(flag: vllm_flags.Flag) -> list[str]:
    if flag.kind in ("bool", "bool_optional"):
        return [flag.name]
    return [flag.name, "x"]


@pytest.mark.parametrize("flag", [f for f in vllm_flags.FLAGS if f.status != vllm_flags.SUPPORTED],
                         ids=lambda f: f.name)
def test_every_unsupported_flag_gets_a_notice_or_a_refusal_that_says_why(flag, capsys):
    argv = ["random:tiny", *_given(flag)]
    if ("True" if len(argv) == 2 else "x") in flag.accepted:  # --disable-log-requests: what happens anyway
        serve.parse_args(argv)
        assert capsys.readouterr().err == ""
    elif flag.status == vllm_flags.REFUSED:
        with pytest.raises(SystemExit) as caught:
            serve.parse_args(argv)
        err = capsys.readouterr().err
        assert caught.value.code == 2 and f"{flag.name}" in err and "is not supported: " + flag.note in err
    else:
        serve.parse_args(argv)
        err = capsys.readouterr().err
        assert f"{flag.name}" in err and "accepted, no effect here: " + flag.note in err


def test_refusals_name_the_reason_and_defaults_pass_silently(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["random:tiny", "--enable-lora-bias", "--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err
    assert "--enable-lora-bias is not supported: LoRA adapters without bias only" in err
    assert "--kv-cache-dtype fp8 is not supported: the KV cache is kept in the model's dtype" in err
    serve.parse_args(["random:tiny", "--kv-cache-dtype", "auto", "--data-parallel-size", "1", "-q", "None",
                      "--lora-dtype", "auto", "--disable-log-requests", "-tp", "1"])
    assert capsys.readouterr().err == ""


def test_every_supported_flag_is_defined_by_the_parser():
    parser = serve.build_parser()
    for flag in vllm_flags.FLAGS:
        action = parser._option_string_actions.get(flag.name)
        assert action is not None, flag.name
        assert action.dest.startswith("vllm_") == (flag.status != vllm_flags.SUPPORTED), flag.name


def test_config_yaml_takes_flag_names_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: random:tiny\nport: 9001\nmax-model-len: 32k\nenable-prefix-caching: false\n"
                      "served_model_name: [a, b]\ndtype: half\ntrust-remote-code: true\n")
    args, engine, settings = serve.parse_args(["--config", str(config), "--port", "9002"])
    assert args.port == 9002 and engine.model == "random:tiny" and engine.dtype == "float16"
    assert engine.max_model_len == 32000 and engine.enable_prefix_caching is False
    assert settings.served_model_names == ["a", "b"]
    args, engine, _ = serve.parse_args(["random:tiny", "--config", str(config)])
    assert args.port == 9001


def test_config_yaml_errors_name_the_file_and_key(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        serve.parse_args(["random:tiny", "--config", str(config)])
    assert f"{config}: unknown flag 'no-such-flag'" in capsys.readouterr().err


def test_chat_template_as_string_file_or_missing_path(tmp_path, capsys):
    _, _, settings = serve.parse_args(["random:tiny", "--chat-template", TEMPLATE])
    assert settings.defaults.chat_template == TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    _, _, settings = serve.parse_args(["random:tiny", "--chat-template", str(path), "--response-role", "bot"])
    assert settings.defaults.chat_template == TEMPLATE and settings.defaults.response_role == "bot"
    for bad, message in ((str(tmp_path / "missing.jinja"), "looks like a file path, but it cannot be opened"),
                         ("{% for %}", "not a valid Jinja template")):
        with pytest.raises(SystemExit):
            serve.parse_args(["random:tiny", "--chat-template", bad])
        assert message in capsys.readouterr().err


def test_a_hub_id_missing_from_the_cache_names_where_it_looked(tmp_path, capsys):
    with pytest.raises(HubCacheError) as caught:
        resolve_hub_id("org/absent", str(tmp_path))
    assert str(tmp_path / "models--org--absent" / "refs" / "main") in str(caught.value)
    with pytest.raises(SystemExit):
        serve.parse_args(["org/absent", "--download-dir", str(tmp_path)])
    assert "is not in the local Hugging Face cache" in capsys.readouterr().err


# ---- a Hugging Face cache and a real server ----------------------------------------------------
def _hf_cache(root) -> str:
    """A random Llama (SmolLM2's tokenizer and vocabulary, 2 layers) at refs/main of REPO_ID."""
    import torch
    from safetensors.torch import save_file

    from lockstep_engine.model_config import ModelConfig
    from lockstep_engine.sources import _cached_gguf_tokenizer, _weight_names, fetch_smollm2

    repo = root / ("models--" + REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    hf = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "float32"}
    (snapshot / "config.json").write_text(json.dumps(hf))
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in
               _weight_names(ModelConfig.from_hf_dict(hf))}
    save_file(weights, str(snapshot / "model.safetensors"))
    (snapshot / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "temperature": 0.0}))
    _cached_gguf_tokenizer(fetch_smollm2()).save_pretrained(str(snapshot))
    return str(snapshot)


def _self_signed(directory) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = os.path.join(directory, "key.pem"), os.path.join(directory, "cert.pem")
    with open(key_path, "wb") as handle:
        handle.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    with open(cert_path, "wb") as handle:
        handle.write(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hub = root / "hub"
    hub.mkdir()
    snapshot = _hf_cache(hub)
    key, cert = _self_signed(str(root))
    (root / "chat.jinja").write_text(TEMPLATE)
    (root / "serve.yaml").write_text(f"chat-template: {root / 'chat.jinja'}\nresponse-role: bot\n"
                                     f"root-path: /api\ngeneration-config: auto\nrevision: main\n")
    port = free_port()
    log_path = root / "serve.log"
    command = [sys.executable, "-m", "lockstep.cli", "serve", REPO_ID, "--host", "127.0.0.1", "--port", str(port),
               "--download-dir", str(hub), "--config", str(root / "serve.yaml"), "--ssl-keyfile", key,
               "--ssl-certfile", cert, "--allowed-origins", '["https://ui.example"]', "--max-model-len", "512",
               "--num-gpu-blocks-override", "128", "--max-num-seqs", "8", "--skip-warmup", "--trust-remote-code"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "LOCKSTEP_CPU_THREADS": "1"})
    url = f"https://127.0.0.1:{port}"
    context = ssl.create_default_context(cafile=cert)

    def healthy():
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", verify=context, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 240, what="the hub-id server to be healthy")
        yield {"url": url, "cert": cert, "log": log_path, "snapshot": snapshot}
    finally:
        process.terminate()
        process.wait(60)


def _tls(server) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=server["cert"])


def _client(server, base: str = "/api/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + base, api_key="unused", max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=_tls(server)))


def test_a_hub_id_is_served_from_the_cache_over_tls(hub_server):
    models = _client(hub_server).models.list()
    assert [m.id for m in models.data] == [REPO_ID]
    assert "--trust-remote-code: accepted, no effect here" in hub_server["log"].read_text()
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
        httpx.get(hub_server["url"].replace("https", "http") + "/health", timeout=5)


def test_root_path_routes_with_and_without_the_prefix(hub_server):
    for base in ("/api/v1", "/v1"):
        assert [m.id for m in _client(hub_server, base).models.list().data] == [REPO_ID]


def test_generation_config_supplies_sampling_defaults(hub_server):
    client = _client(hub_server)
    unset = client.completions.create(model=REPO_ID, prompt="Hello", n=2, extra_body={"ignore_eos": True})
    assert unset.usage.completion_tokens == 2 * 5  # max_new_tokens of generation_config.json
    assert unset.choices[0].text == unset.choices[1].text  # temperature 0.0 from it: greedy
    capped = client.completions.create(model=REPO_ID, prompt="Hello", max_tokens=9, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 5  # vLLM caps a request's max_tokens by max_new_tokens
    sampled = client.completions.create(model=REPO_ID, prompt="Hello", n=2, temperature=1.5, seed=3,
                                        extra_body={"ignore_eos": True})
    assert sampled.choices[0].text != sampled.choices[1].text  # the request's temperature wins


def test_chat_template_file_and_response_role(hub_server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hub_server["snapshot"])
    chat = _client(hub_server).chat.completions.create(model=REPO_ID, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "bot"
    assert chat.usage.prompt_tokens == len(tokenizer.encode("<<hi>>", add_special_tokens=False))
    stream = _client(hub_server).chat.completions.create(model=REPO_ID, messages=[{"role": "user", "content": "x"}],
                                                         stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "bot"


def test_cors_allows_the_configured_origin_only(hub_server):
    headers = {"Access-Control-Request-Method": "POST"}
    with httpx.Client(verify=_tls(hub_server)) as client:
        allowed = client.options(f"{hub_server['url']}/v1/completions", headers={**headers, "Origin": "https://ui.example"})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
        other = client.options(f"{hub_server['url']}/v1/completions", headers={**headers, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


# ---- docs/API.md's tables against the code ------------------------------------------------------
def _doc_rows(header: str) -> list[list[str]]:
    text = open(os.path.join(REPO, "docs", "API.md")).read()
    lines = text[text.index(header):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _names(cell: str) -> list[str]:
    return [part.strip().strip("`") for part in cell.split(",")]


def test_the_flag_table_is_the_catalogue():
    rows = _doc_rows("| flag | status | here |")
    table = {}
    for names, status, _ in rows:
        table[_names(names)[0]] = (status, _names(names)[1:])
    assert list(table) == [flag.name for flag in vllm_flags.FLAGS]
    for flag in vllm_flags.FLAGS:
        assert table[flag.name] == (flag.status, list(flag.aliases)), flag.name


def test_the_request_parameter_table_covers_the_request_models():
    from lockstep_engine.api.openai_models import ChatCompletionRequest, CompletionRequest, StreamOptions

    rows = _doc_rows("| parameter | endpoints | status | here |")
    table = {}
    for names, endpoints, status, _ in rows:
        assert status in vllm_flags.STATUSES, names
        for name in _names(names):
            table[name] = (endpoints, status)
    declared = {"completions": set(CompletionRequest.model_fields), "chat": set(ChatCompletionRequest.model_fields)}
    declared_any = declared["completions"] | declared["chat"]
    declared_any |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
    missing = {name for name in declared_any - {"stream_options"} if name not in table}
    assert not missing, f"declared request fields missing from docs/API.md: {sorted(missing)}"
    for name, (endpoints, status) in table.items():
        if name not in declared_any:
            assert status != vllm_flags.SUPPORTED, f"{name} is marked supported but no request model declares it"
        elif endpoints != "both" and "." not in name:
            assert name in declared[endpoints], f"{name}: not a field of the {endpoints} request"


def test_tokenizer_flag_takes_a_directory_or_a_cached_hub_id(hub_server):
    from pathlib import Path

    from lockstep_engine.sources import ModelSourceError, resolve

    snapshot = Path(hub_server["snapshot"])
    hub = snapshot.parents[2]
    by_dir = resolve("random:tiny", tokenizer=str(snapshot)).load_tokenizer()
    by_id = resolve("random:tiny", tokenizer=REPO_ID, download_dir=str(hub)).load_tokenizer()
    assert by_dir.encode("hello world") == by_id.encode("hello world") != []
    with pytest.raises(ModelSourceError, match="tokenizer: model 'org/absent'"):
        resolve("random:tiny", tokenizer="org/absent", download_dir=str(hub))


def test_disable_fastapi_docs_drops_the_openapi_routes():
    import asyncio

    from lockstep_engine.api.app import build_app

    async def status(app, path: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return (await client.get(path)).status_code

    args, config, settings = serve.parse_args(["random:tiny", "--disable-fastapi-docs"])
    app = build_app(config, settings)
    assert asyncio.run(status(app, "/openapi.json")) == 200
    vllm_flags.without_docs(app)
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert asyncio.run(status(app, path)) == 404, path
    assert asyncio.run(status(app, "/version")) == 200
