"""`lockstep bench serve` against a real OpenAI-compatible HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter

import pytest

from lockstep.bench import serve, serve_processes
from lockstep.bench.serve import run_benchmark
from lockstep.bench.serve_client import BenchmarkError, RequestResult, completion_payload
from lockstep.bench.serve_report import calculate_metrics, percentile
from lockstep.bench.workload import WorkloadRequest, poisson_arrivals, sharegpt_synth

VLLM_KEYS = {
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
    "input_lens", "output_lens", "ttfts", "itls", "errors",
    "model_id", "num_prompts", "request_rate", "max_concurrency", "max_concurrent_requests",
}  # fmt: skip


def make_requests(output_lens: list[int], first_token: int = 1000, prompt_len: int = 5) -> list[WorkloadRequest]:
    return [WorkloadRequest([first_token] + [1001] * (prompt_len - 1), n) for n in output_lens]


def bench(url: str, requests: list[WorkloadRequest], **kwargs) -> dict:
    return asyncio.run(run_benchmark(url, requests, **kwargs))


def test_counts_tokens_from_the_usage_chunk(fake_server):
    server = fake_server()
    result = bench(server.url, make_requests([5, 17, 40]))
    assert result["completed"] == 3
    assert result["failed"] == 0
    assert result["output_lens"] == [5, 17, 40]
    assert result["total_output_tokens"] == 62
    assert result["total_input_tokens"] == 15


def test_counts_chunks_when_the_server_sends_no_usage(fake_server):
    server = fake_server(send_usage=False)
    result = bench(server.url, make_requests([6, 9]))
    assert result["output_lens"] == [6, 9]


def test_sends_vllm_style_completion_requests(fake_server):
    server = fake_server()
    requests = make_requests([12])
    result = bench(server.url, requests)
    assert result["model_id"] == server.MODEL_ID
    assert server.payloads == [
        {
            "model": server.MODEL_ID,
            "prompt": requests[0].prompt_token_ids,
            "max_tokens": 12,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]


def test_timings_include_the_server_delays(fake_server):
    server = fake_server(first_token_delay_s=0.05, inter_chunk_delay_s=0.01)
    result = bench(server.url, make_requests([4]))
    assert result["ttfts"][0] >= 0.05
    # the server cannot send the last of 4 chunks before 50 ms + 3 x 10 ms
    assert result["mean_e2el_ms"] >= 80
    # client-side gaps jitter around the server's 10 ms; half of it is a safe floor
    assert len(result["itls"][0]) == 3
    assert result["mean_itl_ms"] >= 5
    assert result["mean_tpot_ms"] >= 5


def test_a_multi_token_chunk_is_one_itl_sample(fake_server):
    server = fake_server(tokens_per_chunk=4)
    result = bench(server.url, make_requests([12, 10]))
    assert [len(gaps) for gaps in result["itls"]] == [2, 2]
    assert result["output_lens"] == [12, 10]


def test_tpot_spreads_decode_time_over_tokens_after_the_first():
    results = [
        RequestResult(prompt_len=10, success=True, output_tokens=11, ttft=0.5, latency=1.5, itl=[0.5, 0.5]),
        RequestResult(prompt_len=10, success=True, output_tokens=1, ttft=0.2, latency=0.2),
        RequestResult(prompt_len=10, error="HTTP 500: boom"),
    ]
    metrics = calculate_metrics(results, duration_s=2.0)
    assert metrics["mean_tpot_ms"] == pytest.approx(100.0)
    assert metrics["mean_ttft_ms"] == pytest.approx(350.0)
    assert metrics["mean_itl_ms"] == pytest.approx(500.0)
    assert metrics["completed"] == 2
    assert metrics["failed"] == 1
    assert metrics["output_lens"] == [11, 1, 0]
    assert metrics["request_throughput"] == pytest.approx(1.0)
    assert metrics["output_throughput"] == pytest.approx(6.0)
    assert metrics["total_token_throughput"] == pytest.approx(16.0)


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 99) == 0.0


def test_http_errors_are_counted_with_their_message(fake_server):
    server = fake_server()
    requests = make_requests([5, 5]) + make_requests([5], first_token=server.HTTP_500_TOKEN) * 2
    result = bench(server.url, requests)
    assert result["completed"] == 2
    assert result["failed"] == 2
    assert result["output_lens"] == [5, 5, 0, 0]
    assert result["errors"][2:] == ["HTTP 500: injected failure"] * 2
    assert result["total_output_tokens"] == 10


def test_an_error_inside_the_stream_fails_the_request(fake_server):
    server = fake_server()
    requests = make_requests([5]) + make_requests([5], first_token=server.IN_STREAM_ERROR_TOKEN)
    result = bench(server.url, requests)
    assert (result["completed"], result["failed"]) == (1, 1)
    assert "engine died" in result["errors"][1]


def test_a_silent_server_times_out_the_request(fake_server):
    server = fake_server()
    requests = make_requests([3]) + make_requests([3], first_token=server.STALL_TOKEN)
    result = bench(server.url, requests, timeout_s=0.3)
    assert (result["completed"], result["failed"]) == (1, 1)
    assert result["errors"][1].startswith("timeout")


def test_max_concurrency_bounds_requests_in_flight(fake_server):
    server = fake_server(first_token_delay_s=0.02)
    result = bench(server.url, make_requests([3] * 8), max_concurrency=2)
    assert result["completed"] == 8
    assert server.max_in_flight <= 2
    assert result["max_concurrent_requests"] <= 2


def test_a_finite_rate_spaces_requests_as_poisson_arrivals(fake_server):
    server = fake_server()
    result = bench(server.url, make_requests([3] * 6), request_rate=40.0, seed=5)
    assert result["duration"] >= sum(poisson_arrivals(6, 40.0, seed=5))
    assert result["request_rate"] == 40.0


def test_api_key_is_sent_as_a_bearer_token(fake_server):
    server = fake_server(required_api_key="sekrit")
    assert bench(server.url, make_requests([3]), api_key="sekrit")["completed"] == 1
    assert bench(server.url, make_requests([3]), api_key="wrong", model="m")["errors"] == ["HTTP 401: bad key"]


def test_base_url_may_end_in_v1(fake_server):
    server = fake_server()
    assert bench(server.url + "/v1/", make_requests([3]))["completed"] == 1


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_server_is_named_in_the_error():
    url = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(BenchmarkError, match=f"cannot reach server at {url}/v1/models"):
        bench(url, make_requests([3]))


def test_cli_reports_an_unreachable_server(capsys):
    url = f"http://127.0.0.1:{unused_port()}"
    assert serve.main(["--base-url", url, "--num-prompts", "2"]) == 1
    assert f"cannot reach server at {url}" in capsys.readouterr().err


def test_cli_rejects_a_bad_flag_value_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--base-url", "http://127.0.0.1:1", "--max-concurrency", "0"])
    assert exit_info.value.code == 2
    assert "--max-concurrency must be >= 1, got 0" in capsys.readouterr().err


def test_cli_runs_the_workload_and_writes_vllm_json(fake_server, tmp_path, capsys):
    server = fake_server()
    path = tmp_path / "result.json"
    argv = ["--base-url", server.url, "--num-prompts", "10", "--max-concurrency", "4",
            "--result-json", str(path), "--metric-percentiles", "50,99"]  # fmt: skip
    assert serve.main(argv) == 0
    result = json.loads(path.read_text())
    assert result.keys() >= VLLM_KEYS
    assert {"p50_ttft_ms", "p99_itl_ms", "workload", "workload_stats"} <= result.keys()
    assert (result["completed"], result["failed"]) == (10, 0)
    assert result["request_rate"] == "inf"
    assert result["output_lens"] == [r.output_len for r in sharegpt_synth(num_prompts=10, seed=0)]
    assert result["total_output_tokens"] == result["workload_stats"]["total_output_tokens"]
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out
    assert "Mean TTFT (ms):" in captured.out
    assert "P99 E2EL (ms):" in captured.out
    assert "10/10 requests done (100%)" in captured.err


def test_progress_prints_a_line_per_tenth(fake_server, capsys):
    server = fake_server()
    result = asyncio.run(run_benchmark(server.url, make_requests([3] * 20), progress=sys.stderr))
    lines = [line for line in capsys.readouterr().err.splitlines() if "requests done" in line]
    assert len(lines) == 10, lines
    assert lines[-1].startswith("bench serve: 20/20 requests done (100%), 0 failed"), (lines, result["errors"])


def test_bench_modules_import_no_torch_numpy_or_web_framework():
    code = (
        "import sys, lockstep.bench.serve, lockstep.bench.workload; "
        "print(sorted(m for m in ('torch', 'numpy', 'fastapi', 'uvicorn', 'lockstep_engine') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_request_rate_flag_accepts_inf():
    assert math.isinf(serve.parse_config(["--base-url", "http://h:1", "--request-rate", "inf"]).request_rate)
    assert serve.parse_config(["--base-url", "http://h:1", "--request-rate", "2.5"]).request_rate == 2.5


# ---------------------------------------------------------------------------------------------
# --num-client-processes


def distinct_requests(n: int) -> list[WorkloadRequest]:
    """n requests no two alike, so the server's record shows which were sent how often."""
    return [WorkloadRequest([1000 + i, 1001, 1002], 3 + i % 7) for i in range(n)]


def test_two_client_processes_send_each_request_once_and_count_like_one(fake_server):
    requests = distinct_requests(20)
    one = bench(fake_server().url, requests)
    server = fake_server()
    two = bench(server.url, requests, num_client_processes=2)
    assert (two["completed"], two["failed"]) == (20, 0), two["errors"]
    for key in ("total_input_tokens", "total_output_tokens", "input_lens", "output_lens", "num_prompts"):
        assert two[key] == one[key], key
    assert two.keys() == one.keys()
    assert (one["num_client_processes"], two["num_client_processes"]) == (1, 2)
    assert [len(gaps) for gaps in two["itls"]] == [n - 1 for n in two["output_lens"]]
    seen = Counter(json.dumps(payload, sort_keys=True) for payload in server.payloads)
    expected = Counter(json.dumps(completion_payload(r, server.MODEL_ID), sort_keys=True) for r in requests)
    assert seen == expected
    assert 0 < two["duration"] and 1 <= two["max_concurrent_requests"] <= 20


def test_client_processes_split_max_concurrency(fake_server):
    server = fake_server(first_token_delay_s=0.02)
    result = bench(server.url, make_requests([3] * 12), max_concurrency=3, num_client_processes=2)
    assert (result["completed"], result["max_concurrency"]) == (12, 3)
    assert server.max_in_flight <= 3
    assert result["max_concurrent_requests"] <= 3


def test_concurrency_shares_are_ceil_and_floor():
    assert serve_processes.concurrency_shares(7, 3) == [3, 2, 2]
    assert serve_processes.concurrency_shares(4, 4) == [1, 1, 1, 1]
    assert serve_processes.concurrency_shares(None, 2) == [None, None]


def test_max_overlap_counts_intervals_open_at_once():
    assert serve_processes.max_overlap([(0, 2), (1, 3), (2, 4)]) == 2
    assert serve_processes.max_overlap([(0, 1), (1, 2)]) == 1
    assert serve_processes.max_overlap([]) == 0


def test_cli_rejects_a_bad_number_of_client_processes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--base-url", "http://127.0.0.1:1", "--num-client-processes", "0"])
    assert exit_info.value.code == 2
    assert "--num-client-processes must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.main(["--base-url", "http://127.0.0.1:1", "--num-client-processes", "3", "--max-concurrency", "2"])
    assert "--num-client-processes must be <= --max-concurrency (2), got 3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--num-client-processes must be >= 1, got 0"):
        bench("http://127.0.0.1:1", make_requests([3]), num_client_processes=0)


def test_progress_prints_a_line_per_tenth_over_client_processes(fake_server, capsys):
    server = fake_server()
    result = bench(server.url, make_requests([3] * 20), progress=sys.stderr, num_client_processes=2)
    lines = [line for line in capsys.readouterr().err.splitlines() if "requests done" in line]
    assert len(lines) == 10, lines
    assert [line.split()[2] for line in lines] == [f"{2 * k}/20" for k in range(1, 11)]
    assert lines[-1].startswith("bench serve: 20/20 requests done (100%), 0 failed"), (lines, result["errors"])


def test_cli_runs_with_two_client_processes(fake_server, tmp_path, capsys):
    server = fake_server()
    path = tmp_path / "result.json"
    argv = ["--base-url", server.url, "--num-prompts", "10", "--num-client-processes", "2", "--result-json", str(path)]
    assert serve.main(argv) == 0
    result = json.loads(path.read_text())
    assert result.keys() >= VLLM_KEYS | {"workload", "workload_stats", "num_client_processes"}
    assert (result["completed"], result["failed"], result["num_client_processes"]) == (10, 0, 2)
    assert result["output_lens"] == [r.output_len for r in sharegpt_synth(num_prompts=10, seed=0)]
    assert "Serving Benchmark Result" in capsys.readouterr().out


def spawned_children() -> list[int]:
    """Pids of this process's multiprocessing-spawned children, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


class _NotifyingList(list):
    """The fake server's payload record, setting an event as each request arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = threading.Event()

    def append(self, item: object) -> None:
        super().append(item)
        self.arrived.set()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the client processes through /proc")
def test_a_client_process_that_dies_fails_the_run_naming_it(fake_server):
    server = fake_server()
    server.payloads = _NotifyingList()
    killed: list[int] = []

    def kill_one_client_process() -> None:
        # The requests stall at the server, so the client processes are alive once one has arrived.
        if server.payloads.arrived.wait(timeout=60) and (pids := spawned_children()):
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    killer = threading.Thread(target=kill_one_client_process, daemon=True)
    killer.start()
    requests = make_requests([3] * 4, first_token=server.STALL_TOKEN)
    named = r"client process \d of 2 \(pid \d+\) was killed by signal SIGKILL"
    with pytest.raises(BenchmarkError, match=named) as info:
        bench(server.url, requests, timeout_s=30, num_client_processes=2)
    killer.join(timeout=5)
    assert killed and f"(pid {killed[0]})" in str(info.value)
    assert spawned_children() == []


def test_a_client_process_that_raises_sends_its_error():
    import multiprocessing

    parent, child = multiprocessing.Pipe()
    # offsets and requests of different lengths: sending them raises inside the process body
    plan = serve_processes.ClientPlan(url="http://127.0.0.1:1/v1/completions", headers={}, model="m", timeout_s=1.0,
                            indices=[0], requests=make_requests([3]), offsets=[])  # fmt: skip
    body = threading.Thread(target=lambda: pytest.raises(SystemExit, serve_processes.client_process_main, child, plan))
    body.start()
    assert parent.poll(30) and parent.recv() == ("ready",)
    parent.send(("start", 0.0))
    assert parent.poll(30)
    kind, message = parent.recv()
    body.join(timeout=30)
    assert kind == "error" and message.startswith("ValueError: zip()"), message
