"""One engine core, several API servers (`--api-server-count`): each request's outputs go to the API server
that sent it, one batch holds all of them, and an API server that leaves has its requests aborted and
their KV blocks freed while the others are served on.

The router on plain data first, then the core process itself over its per-API-server pipes.
"""

import multiprocessing
import time

import pytest

from lockstep_engine import core_process
from lockstep_engine import protocol as p
from lockstep_engine.config import EngineConfig
from lockstep_engine.core_clients import ClientRouter
from lockstep_engine.core_process import run_engine_core_for_api_servers
from lockstep_engine.sampling_params import SamplingParams


class _Writer:
    def __init__(self):
        self.sent = []
        self.closed = False

    def send(self, message):
        self.sent.append(message)

    def close(self):
        self.closed = True


def _router(count: int = 2) -> tuple[ClientRouter, list[_Writer]]:
    writers = [_Writer() for _ in range(count)]
    return ClientRouter(writers), writers


COLUMNS = (["a", "b", "c"], [0, 0, 0], [0, 4, 0], [1.0, 2.0, 3.0])  # one window's, shared by its steps


def _batch(window: int, tokens: list[int]) -> p.TokenBatch:
    return p.TokenBatch(*COLUMNS, tokens, window)


def test_a_step_goes_to_each_api_server_with_its_own_rows():
    router, writers = _router()
    assert router.own("a", 0) and router.own("b", 1) and router.own("c", 0)
    done = p.SequenceOutput("b", 0, [7], None, "length")
    router.send(p.StepOutputs([done], 5.0, _batch(1, [10, 11, 12])))
    router.send(p.StepOutputs([], 6.0, _batch(1, [20, -1, 22])))
    first, second = writers[0].sent, writers[1].sent
    assert [[(o.request_id, o.token_ids) for o in step.all_outputs()] for step in first] == [
        [("a", [10]), ("c", [12])], [("a", [20]), ("c", [22])]]
    assert [[(o.request_id, o.token_ids, o.finish_reason) for o in step.all_outputs()] for step in second] == [
        [("b", [7], "length"), ("b", [11], None)], []]
    assert second[0].batch.num_cached_tokens == [4] and second[1].emitted_at == 6.0
    # One window's columns are the same lists at every step, so each pipe still sends them once.
    assert first[0].batch.request_ids is first[1].batch.request_ids


def test_failures_go_to_the_owner_and_what_concerns_all_goes_to_all():
    router, writers = _router()
    router.own("a", 1)
    router.send(p.RequestFailed("a", "no"))
    router.send(p.EngineStats(num_running=3))
    assert [type(m) for m in writers[0].sent] == [p.EngineStats]
    assert [type(m) for m in writers[1].sent] == [p.RequestFailed, p.EngineStats]


def test_a_request_id_another_api_server_uses_is_refused():
    router, _ = _router()
    assert router.own("x", 0)
    assert not router.own("x", 1)
    assert router.owner("x") == 0


def test_an_api_server_that_leaves_gets_nothing_more_and_its_requests_are_returned():
    router, writers = _router(3)
    for rid, client in (("a", 0), ("b", 1), ("c", 1)):
        router.own(rid, client)
    assert sorted(router.remove(1)) == ["b", "c"]
    assert writers[1].closed and router.live == {0, 2}
    router.send(p.StepOutputs([p.SequenceOutput("b", 0, [], None, "abort")], 1.0))
    router.send(p.EngineStats())
    assert writers[1].sent == [] and len(writers[2].sent) == 1


def test_owners_are_forgotten_one_round_after_the_core_forgot_the_request():
    router, writers = _router()
    router.own("a", 0)
    router.prune(lambda rid: False)
    assert router.owner("a") == 0  # its window's last step may still come
    router.send(p.StepOutputs([p.SequenceOutput("a", 0, [1], None, "stop")], 1.0))
    router.prune(lambda rid: False)
    assert router.owner("a") is None and len(writers[0].sent) == 1


def test_an_api_server_that_stops_reading_is_dropped_not_waited_for(monkeypatch):
    """Its backlog in the core is bounded: past it, its pipe is shut (it reads the end) and it leaves."""
    monkeypatch.setattr(core_process, "MAX_CLIENT_BACKLOG", 3)
    ours, theirs = multiprocessing.Pipe(duplex=True)
    lost = []
    writer = core_process._Writer(ours, None, 1, lost.append)  # its thread never runs: nothing is sent
    for _ in range(5):
        writer.send(p.EngineStats())
    assert lost == [1] and writer.outbox.qsize() == 3
    assert theirs.poll(5)
    with pytest.raises(EOFError):
        theirs.recv()


# ---- the core process ---------------------------------------------------------------------------------------
class _ApiServer:
    """One API server's end of its pipe to the core: what it received, by request."""

    def __init__(self, conn):
        self.conn = conn
        self.columns = p.ColumnCache()
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.failed: dict[str, p.RequestFailed] = {}
        self.last = None
        self.stats: p.EngineStats | None = None

    def receive_until(self, done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.conn.poll(remaining), f"nothing more after {self.last}"
            message = self.last = self.conn.recv()
            assert not isinstance(message, p.CoreFailed), message.message
            if isinstance(message, p.StepOutputs):
                if message.batch is not None:
                    message.batch = self.columns.restore(message.batch)
                for output in message.all_outputs():
                    self.tokens.setdefault(output.request_id, []).extend(output.token_ids)
                    if output.finish_reason is not None:
                        self.finish[output.request_id] = output.finish_reason
            elif isinstance(message, p.RequestFailed):
                self.failed[message.request_id] = message
            elif isinstance(message, (p.EngineStats, p.Heartbeat)):
                self.stats = message if isinstance(message, p.EngineStats) else message.stats

    def idle(self) -> bool:
        stats = self.stats
        return stats is not None and stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0


def test_the_core_serves_two_api_servers_in_one_batch_and_frees_what_a_lost_one_leaves():
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=True) for _ in range(2)]
    config = EngineConfig(model="random:tiny", skip_warmup=True, num_gpu_blocks_override=256, num_scheduler_steps=4,
                          device="cpu")
    process = ctx.Process(target=run_engine_core_for_api_servers, args=(config, [core for core, _ in pipes]),
                          daemon=True)
    process.start()
    for core, _ in pipes:
        core.close()
    first, second = (_ApiServer(conn) for _, conn in pipes)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True).to_dict()
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True).to_dict()
    try:
        for server in (first, second):
            server.receive_until(lambda s=server: isinstance(s.last, p.CoreReady), 120)
        now = time.monotonic()
        first.conn.send(p.AddRequest("first-long", [3, 1, 4, 1, 5], long, now))
        first.receive_until(lambda: "first-long" in first.tokens, 60)
        first.conn.send(p.AddRequest("first-short", [2, 7, 1, 8], greedy, now))
        second.conn.send(p.AddRequest("second-short", [2, 7, 1, 8], greedy, now))
        second.conn.send(p.AddRequest("second-long", [9, 9, 9], long, now))
        second.conn.send(p.AddRequest("first-long", [1, 1], greedy, now))  # the other server's id
        first.receive_until(lambda: "first-short" in first.finish, 60)
        second.receive_until(lambda: "second-short" in second.finish and "first-long" in second.failed, 60)
        assert set(first.tokens) == {"first-long", "first-short"}
        assert set(second.tokens) == {"second-long", "second-short"}
        assert first.tokens["first-short"] == second.tokens["second-short"]  # same prompt, same batch: greedy
        assert "already in use" in second.failed["first-long"].message
        second.conn.send(p.AbortRequests(["first-long"]))  # not its request: the first server's goes on
        so_far = len(first.tokens["first-long"])
        first.receive_until(lambda: len(first.tokens["first-long"]) > so_far + 20, 60)
        assert "first-long" not in first.finish
        first.conn.close()  # the first API server is lost: its long request must go, the second's goes on
        at_loss = len(second.tokens["second-long"])
        second.receive_until(lambda: len(second.tokens["second-long"]) > at_loss + 40, 60)
        second.conn.send(p.AbortRequests(["second-long"]))
        second.receive_until(lambda: second.finish.get("second-long") == "abort", 30)
        second.receive_until(second.idle, 30)  # nothing running, no KV block held: the lost one's freed too
        # The lost server's long request stopped when it was lost, far from its 2000 tokens.
        seen = sum(len(tokens) for tokens in (*first.tokens.values(), *second.tokens.values()))
        assert second.stats.num_generated_tokens - seen < 2000 - len(first.tokens["first-long"])
        second.conn.send(p.Shutdown())
        process.join(30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(10)
