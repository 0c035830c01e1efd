"""Every user error on the command line is one or two lines naming the flag, the value and what is
allowed, with no traceback: usage errors exit 2, a model that does not load or a taken port exit 1.
The commands run as a user runs them, `python -m lockstep.cli ...` in a process of their own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from api_harness import REPO


def lockstep(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lockstep.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "LOCKSTEP_CPU_THREADS": "1"})


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr, result.stderr
    return lines


@pytest.mark.parametrize(("argv", "expected"), [
    (["serve", "smollm2", "--max-modl-len", "32"], ["--max-modl-len", "did you mean --max-model-len"]),
    (["serve", "smollm2", "--port", "99999"], ["--port", "99999", "allowed 1-65535"]),
    (["serve", "smollm2", "--num-scheduler-steps", "many"], ["--num-scheduler-steps", "'many'", "[1, 64]"]),
    (["serve", "smollm2", "--stream-interval", "0"], ["--stream-interval=0", "an integer >= 1"]),
    (["up", "smollm2", "--port", "0"], ["lockstep up", "--port", "0 is out of range: allowed 1-65535"]),
    (["up", "smollm2", "--replicsa", "2"], ["lockstep up", "did you mean --replicas"]),
    (["up", "smollm2", "--max-modl-len", "64"], ["lockstep up", "did you mean --max-model-len"]),  # an engine flag
    (["gateway", "--engin", "http://127.0.0.1:1"], ["--engin", "did you mean --engine"]),
    (["gateway", "--engine", "http://127.0.0.1:1", "--port", "http"], ["--port", "'http' is not a port number"]),
    (["srve", "smollm2"], ["unknown command 'srve'", "did you mean 'serve'"]),
])
def test_a_usage_error_is_two_lines_and_exit_code_2(argv, expected):
    result = lockstep(*argv)
    lines = error_lines(result)
    assert result.returncode == 2 and len(lines) <= 2, result.stderr
    for words in expected:
        assert words in result.stderr, result.stderr


def test_flags_are_whole_names_not_prefixes():
    """argparse's prefix matching read `--api-key KEY` as `--api-key-file KEY`; `--api-k` is no flag at all."""
    result = lockstep("serve", "smollm2", "--api-k", "secret")
    assert result.returncode == 2 and "unrecognized arguments: --api-k" in result.stderr
    assert "did you mean --api-key" in error_lines(result)[1]


def test_a_model_that_does_not_load_is_one_error_line():
    result = lockstep("serve", "nosuchmodel", "--host", "127.0.0.1", "--port", str(_free_port()), timeout=120)
    errors = [line for line in error_lines(result) if "error" in line]
    assert result.returncode == 1, result.stderr
    assert len(errors) == 1 and "'nosuchmodel' is not a known source" in errors[0], result.stderr


def test_a_context_length_beyond_the_model_names_both():
    result = lockstep("serve", "random:tiny", "--host", "127.0.0.1", "--port", str(_free_port()),
                      "--max-model-len", "32k", "--skip-warmup", timeout=240)
    errors = [line for line in error_lines(result) if "error" in line]
    assert result.returncode == 1, result.stderr
    assert len(errors) == 1 and "max_model_len=32000" in errors[0] and "2048" in errors[0], result.stderr


def test_a_tensor_split_the_model_cannot_take_is_one_error_line_naming_the_sizes_that_fit():
    # SmolLM2 has 9 attention heads and 3 KV heads: -tp 2 cannot split it (was: the error, then a traceback).
    result = lockstep("serve", "smollm2", "--host", "127.0.0.1", "--port", str(_free_port()), "-tp", "2",
                      timeout=240)
    errors = [line for line in error_lines(result) if "error" in line]
    assert result.returncode == 1, result.stderr
    assert len(errors) == 1 and "tensor_parallel_size=2 does not divide the model's 9 attention heads (expected " \
        "one of 1, 3)" in errors[0], result.stderr


def test_up_on_a_taken_port_says_so_before_starting_engines():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = lockstep("up", "random:tiny", "--port", str(port))
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use (is the port taken?)" in lines[0]
    assert "[engine" not in result.stderr  # no engine was started


def test_serve_on_a_taken_port_says_so_before_loading_the_model():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = lockstep("serve", "random:tiny", "--host", "127.0.0.1", "--port", str(port))
    lines = error_lines(result)
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert f"--port {port}: cannot listen on 127.0.0.1: Address already in use (is the port taken?)" in lines[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
