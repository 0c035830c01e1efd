"""One request must never crash the server: llguidance's compile of a user's constraint runs in worker
processes (api/grammar_worker.py); a worker that crashes fails its request with a 400, the next request
gets a new worker, and every worker dies with the process that started it. The acceptance cases (a
`$ref` chain of 2500 and of 10,000, a cycle) and the fuzzed constraints (hostile_constraints.py) run
beside a stream that must reach its end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import llguidance
import openai
import pytest

from api_harness import Server
from polling import wait_until
from hostile_constraints import ref_chain, ref_cycle, response_format, send_all
from planted_grammar_crash import PLANTED_REGEX

from lockstep_common.worker_process import WorkerCrashed, WorkerProcess


def compile_without_bounds(lark: str) -> str:
    """llguidance's validation of a Lark grammar, with none of guided_limits.py's bounds before it."""
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))


def test_a_real_llguidance_crash_fails_that_call_and_the_next_call_gets_a_new_worker():
    worker = WorkerProcess("test grammar worker", compile_without_bounds, stack_bytes=2 << 20)
    chain = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(10_000)) + 'r10000: "x"\n'
    try:
        with pytest.raises(WorkerCrashed, match="SIGSEGV"):
            worker.call(chain, 60)
        assert worker.call('start: "A" DIGIT\nDIGIT: /[0-9]/', 60) == ""
        assert worker.starts == 2
    finally:
        worker.close()


# Starts a worker, prints its pid, then waits to be killed.
_PARENT = """
import sys, time
from lockstep_common.worker_process import WorkerProcess
worker = WorkerProcess("orphan test", len)
assert worker.call("abc", 60) == 3
print(worker.pid, flush=True)
time.sleep(600)
"""


def test_a_worker_dies_with_the_process_that_started_it():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        worker_pid = int(parent.stdout.readline())
        assert Path(f"/proc/{worker_pid}").exists()
    finally:
        parent.kill()
        parent.wait(10)
    wait_until(lambda: not _alive(worker_pid), 10, what=f"the worker {worker_pid} gone after its parent's kill -9")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


class Stream:
    """A streamed completion of `max_tokens` tokens, read one chunk at a time by the test."""

    def __init__(self, server: Server, max_tokens: int = 60):
        self.max_tokens = max_tokens
        self.chunks = iter(server.client().completions.create(
            model="smollm2", prompt="Once upon a time", max_tokens=max_tokens, stream=True,
            extra_body={"ignore_eos": True}))
        self.text = next(self.chunks).choices[0].text

    def finish(self) -> None:
        last = None
        for chunk in self.chunks:
            last = chunk
        assert last is not None and last.choices[0].finish_reason == "length", last


@pytest.mark.parametrize("name, schema", [("$ref chain of 2500", ref_chain(2500)),
                                          ("$ref chain of 10000", ref_chain(10_000)),
                                          ("$ref cycle", ref_cycle(2))])
def test_a_hostile_ref_graph_is_a_400_naming_response_format_beside_a_stream(smol1, name, schema):
    stream = Stream(smol1)
    with pytest.raises(openai.BadRequestError) as refused:
        smol1.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, extra_body=response_format(schema))
    error = refused.value.body
    assert error["param"] == "response_format", error
    assert re.search(r"definitions|\$ref cycle", error["message"]), error
    stream.finish()
    assert smol1.process.poll() is None


def test_fuzzed_constraints_get_200_or_400_and_the_stream_beside_them_ends(smol1):
    stream = Stream(smol1, max_tokens=100)
    answers = send_all(smol1.url, "smollm2", seed=1)
    server_errors = [(name, status) for name, status, _, _ in answers if status not in (200, 400)]
    assert not server_errors, server_errors
    misnamed = [(name, error["param"], param) for name, status, error, param in answers
                if status == 400 and error["param"] != param]
    assert not misnamed, misnamed
    assert all(len(error["message"]) < 700 for _, status, error, _ in answers if status == 400)
    stream.finish()
    assert smol1.process.poll() is None
    print(f"{len(answers)} constraints: {sum(status == 400 for _, status, _, _ in answers)} refused, "
          f"{sum(status == 200 for _, status, _, _ in answers)} served")


@pytest.fixture(scope="module")
def planted_server():
    server = Server("smollm2", "--num-scheduler-steps", "1", "--max-model-len", "512", "--kv-cache-memory-bytes",
                    str(64 << 20), name="planted-grammar-crash",
                    launcher=(str(Path(__file__).with_name("planted_grammar_crash.py")),))
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def test_a_crash_in_a_grammar_worker_fails_only_its_request(planted_server):
    stream = Stream(planted_server)
    client = planted_server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="smollm2", prompt="Call me at", max_tokens=8,
                                  extra_body={"guided_regex": PLANTED_REGEX})
    assert refused.value.body["param"] == "guided_regex"
    assert "crashed" in refused.value.body["message"]
    for _ in range(3):  # as many as the workers and one more: the crashed one is started again
        reply = client.completions.create(model="smollm2", prompt="Call me at", max_tokens=12,
                                          extra_body={"guided_regex": r"\d{3}-\d{4}"})
        assert re.fullmatch(r"\d{3}-\d{4}", reply.choices[0].text), reply.choices[0]
    stream.finish()
    assert planted_server.process.poll() is None
    assert "grammar worker" in planted_server.log_tail(200) and "SIGSEGV" in planted_server.log_tail(200)
    assert httpx.get(f"{planted_server.url}/health", timeout=10).status_code == 200


def test_a_killed_api_process_leaves_no_worker_behind():
    """kill -9 of `lockstep serve` after a large body started its reader worker: neither it nor the resource
    tracker outlives the server (the large-text tokenizer worker and a resource tracker did before; the
    large-text worker is the same kind of worker now)."""
    server = Server("random:tiny", "--num-gpu-blocks-override", "64", "--max-model-len", "256",
                    name="killed-api").wait_healthy()
    try:
        body = {"model": "random:tiny", "prompt": [5] * 700_000, "max_tokens": 1}  # 1.4 MB or more: read by a worker
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 400
        children = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True,
                                  check=False).stdout.split()
        commands = {int(pid): Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children}
        workers = [pid for pid, command in commands.items() if pid != server.core_pid()
                   and (b"spawn_main" in command or b"resource_tracker" in command)]
        assert len(workers) >= 2, commands  # the large-body reader and multiprocessing's resource tracker
        server.process.kill()
        server.process.wait(10)
        wait_until(lambda: not any(map(_alive, workers)), 10, what=f"workers {workers} gone after the kill -9")
    finally:
        server.stop()
