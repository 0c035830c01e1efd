"""LoRA in the benchmarks: `lockstep bench serve --lora-modules` spreads the requests evenly over the
adapters (a fake OpenAI server records what each request named), benchmarks/make_lora_adapters.py writes
PEFT adapters the engine reads, and a real `lockstep serve random:tiny --enable-lora` on 127.0.0.1 serves
them to the official openai client and to `lockstep bench serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx
import openai
import pytest
from safetensors import safe_open

from lockstep.bench import serve
from lockstep.bench.serve import run_benchmark
from lockstep.bench.workload import WorkloadRequest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAKER = os.path.join(REPO, "benchmarks", "make_lora_adapters.py")
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "engine"), os.path.join(REPO, "gateway")]),
    "PYTHONUNBUFFERED": "1",
    "LOCKSTEP_CPU_THREADS": "1",
}
START_TIMEOUT_S = 180.0
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def distinct_requests(count: int) -> list[WorkloadRequest]:
    """Request i's prompt starts with token 1000 + i, so the fake server's record tells them apart."""
    return [WorkloadRequest([1000 + i, 1001, 1002], 3) for i in range(count)]


def named_by_request(server, count: int) -> list[str]:
    by_first_token = {payload["prompt"][0]: payload["model"] for payload in server.payloads}
    assert len(by_first_token) == len(server.payloads) == count
    return [by_first_token[1000 + i] for i in range(count)]


@pytest.mark.parametrize("processes", [1, 2])
def test_lora_modules_spread_requests_evenly_in_request_order(fake_server, processes):
    server = fake_server()
    names = ["a", "b", "c"]
    result = asyncio.run(
        run_benchmark(server.url, distinct_requests(8), lora_modules=names, num_client_processes=processes)
    )
    assert named_by_request(server, 8) == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert result["completed"] == 8 and result["model_id"] == server.MODEL_ID
    assert result["lora_modules"] == names
    assert result["lora_requests"] == {"a": 3, "b": 3, "c": 2}
    assert result["lora_completed"] == {"a": 3, "b": 3, "c": 2}


def test_failed_requests_count_against_their_adapter(fake_server):
    server = fake_server()
    requests = distinct_requests(4)
    requests[1] = WorkloadRequest([server.HTTP_500_TOKEN, 1001], 3)  # the second request: adapter "b"
    result = asyncio.run(run_benchmark(server.url, requests, lora_modules=["a", "b"]))
    assert result["lora_requests"] == {"a": 2, "b": 2}
    assert result["lora_completed"] == {"a": 2, "b": 1}


def test_without_lora_modules_every_request_names_the_model_and_no_lora_keys(fake_server):
    server = fake_server()
    result = asyncio.run(run_benchmark(server.url, distinct_requests(3), num_client_processes=2))
    assert named_by_request(server, 3) == [server.MODEL_ID] * 3
    assert not [key for key in result if key.startswith("lora")]


def test_the_command_line_takes_lora_modules_and_writes_the_counts(fake_server, tmp_path, capsys):
    server = fake_server()
    path = tmp_path / "result.json"
    argv = ["--base-url", server.url, "--num-prompts", "6", "--vocab-size", "2000", "--workload", "sharegpt-synth",
            "--lora-modules", "x", "y", "--num-client-processes", "2", "--result-json", str(path)]  # fmt: skip
    assert serve.main(argv) == 0
    result = json.loads(path.read_text())
    assert result["lora_modules"] == ["x", "y"] and result["lora_requests"] == {"x": 3, "y": 3}
    assert Counter(payload["model"] for payload in server.payloads) == {"x": 3, "y": 3}
    assert "LoRA adapters (requests completed/sent): x 3/3, y 3/3" in capsys.readouterr().out


@pytest.mark.parametrize("names", [["a", "a"], ["a", ""], [" a"]])
def test_bad_lora_module_names_are_refused(names, capsys):
    with pytest.raises(SystemExit):
        serve.parse_config(["--base-url", "http://127.0.0.1:1", "--lora-modules", *names])
    assert "--lora-modules" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# benchmarks/make_lora_adapters.py


def make_adapters(model: str, out: str, *args: str) -> list[tuple[str, str]]:
    """Runs the maker; returns the (name, path) pairs of the `--lora-modules` line it prints."""
    done = subprocess.run([sys.executable, MAKER, "--model", model, "--out", out, *args], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    return [tuple(module.split("=", 1)) for module in lines[0].split()]


def test_adapters_have_peft_layout_and_the_model_shapes(tmp_path):
    modules = make_adapters("random:tiny", str(tmp_path), "--rank", "8", "--count", "2", "--targets", "all")
    assert modules == [("lora0", str(tmp_path / "lora0")), ("lora1", str(tmp_path / "lora1"))]
    config = json.loads((tmp_path / "lora0" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["bias"] == "none"
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "random:tiny"
    assert config["target_modules"] == SEVEN
    from lockstep_engine.model_config import RANDOM_SHAPES

    tiny = RANDOM_SHAPES["tiny"]
    h, i = tiny.hidden_size, tiny.intermediate_size
    q, kv = tiny.num_attention_heads * tiny.head_dim, tiny.num_key_value_heads * tiny.head_dim
    io = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
          "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
    tensors = {}
    for name in ("lora0", "lora1"):
        with safe_open(str(tmp_path / name / "adapter_model.safetensors"), "pt") as f:
            tensors[name] = {key: f.get_tensor(key) for key in f.keys()}
    expected = set()
    for layer in range(tiny.num_hidden_layers):
        for module, (fan_in, fan_out) in io.items():
            block = "self_attn" if module in SEVEN[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            expected |= {f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"}
            assert tuple(tensors["lora0"][f"{prefix}.lora_A.weight"].shape) == (8, fan_in)
            assert tuple(tensors["lora0"][f"{prefix}.lora_B.weight"].shape) == (fan_out, 8)
    assert set(tensors["lora0"]) == expected
    b = tensors["lora0"]["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert 0.005 < float(b.std()) < 0.02  # small, not PEFT's zero start
    a0 = tensors["lora0"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert not a0.equal(tensors["lora1"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    # seeded: the same seed writes the same adapter again
    again = make_adapters("random:tiny", str(tmp_path / "again"), "--rank", "8", "--count", "1")
    with safe_open(os.path.join(again[0][1], "adapter_model.safetensors"), "pt") as f:
        assert f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").equal(a0)


def test_adapters_written_for_smollm2_are_read_by_the_engine(tmp_path):
    from lockstep_engine.lora.adapters import read_adapter
    from lockstep_engine.sources import resolve

    modules = make_adapters("smollm2", str(tmp_path), "--rank", "16", "--count", "1", "--targets", "all")
    adapter = read_adapter(modules[0][0], modules[0][1], resolve("smollm2").config, max_rank=16)
    assert adapter.rank == 16 and adapter.scale == 2.0
    assert len(adapter.weights) == 30 * 7  # SmolLM2-135M: 30 layers, the seven targets each


def test_maker_refuses_unknown_targets_and_sources(tmp_path):
    for args in (["--model", "random:tiny", "--targets", "lm_head"], ["--model", "random:no-such-shape"]):
        done = subprocess.run([sys.executable, MAKER, *args, "--out", str(tmp_path)], env=ENV, cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2 and done.stdout == ""
        assert ("lm_head" if "lm_head" in args else "no-such-shape") in done.stderr


# ---------------------------------------------------------------------------------------------
# a real server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """`lockstep serve random:tiny --enable-lora --max-loras 4` with four rank-16 adapters on all seven targets."""
    out = tmp_path_factory.mktemp("adapters")
    modules = make_adapters("random:tiny", str(out), "--rank", "16", "--count", "4", "--targets", "all")
    port = free_port()
    log_path = out / "serve.log"
    command = [sys.executable, "-m", "lockstep.cli", "serve", "random:tiny", "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--max-model-len", "2048", "--enable-lora", "--max-loras", "4",
               "--max-lora-rank", "16", "--lora-modules", *(f"{name}={path}" for name, path in modules)]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, f"server exited {process.returncode}:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not up in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url, [name for name, _ in modules]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_the_engine_serves_each_made_adapter_to_the_openai_client(lora_server):
    url, names = lora_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
    assert [m.id for m in client.models.list().data] == ["random:tiny", *names]
    first_logprobs = {}
    for model in ["random:tiny", *names]:
        completion = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0,
                                               logprobs=1)  # fmt: skip
        assert completion.model == model and completion.usage.completion_tokens == 4
        first_logprobs[model] = completion.choices[0].logprobs.token_logprobs[0]
    # each adapter changes the model's output: no two first-token log-probabilities agree
    assert len(set(first_logprobs.values())) == len(first_logprobs), first_logprobs


def test_bench_serve_spreads_requests_over_the_served_adapters(lora_server, tmp_path):
    url, names = lora_server
    path = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "bench", "serve", "--base-url", url, "--num-prompts", "8",
         "--vocab-size", "1024", "--request-rate", "inf", "--num-client-processes", "2",
         "--lora-modules", *names, "--result-json", str(path)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["failed"] == 0, result["errors"]
    assert result["lora_requests"] == dict.fromkeys(names, 2) and result["lora_completed"] == dict.fromkeys(names, 2)


def test_h200_lora_script_runs_its_three_runs_on_the_cpu(tmp_path):
    """benchmarks/h200_lora.sh's CPU dry run: both servers started, warmed, measured and stopped, the table."""
    env = {**ENV, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], "OUT": str(tmp_path / "out"),
           "LOGS": str(tmp_path / "logs"), "MODEL": "random:tiny", "SERVER_ARGS": "--device cpu --max-model-len 2048",
           "PROMPTS": "8", "WARM": "4", "CLIENTS": "2", "VOCAB": "1024", "STEP": "4", "PORT": str(free_port()),
           "START_S": "180", "BENCH_S": "120", "STOP_S": "30"}  # fmt: skip
    done = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "h200_lora.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["base.json", "logs.tgz", "lora.json", "lora_base.json"]
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.split()}
    for run in ("base", "lora_base", "lora"):
        assert lines[run].split()[1] == "8/8", done.stdout
    assert "within 15%" in lines["lora"] or "OVER 15%" in lines["lora"]
    assert "per adapter (completed/sent): lora0 2/2, lora1 2/2, lora2 2/2, lora3 2/2" in done.stdout
    assert done.stdout.count("== server stopped") == 2
    lora = json.loads((tmp_path / "out" / "lora.json").read_text())
    assert lora["lora_requests"] == {"lora0": 2, "lora1": 2, "lora2": 2, "lora3": 2}
    assert "lora_modules" not in json.loads((tmp_path / "out" / "lora_base.json").read_text())
