"""Isolation in the engine core: an error while preparing or finishing one request fails that request
(an error to its client, its blocks freed) and every other request is served as if it were alone.

The failures are real ones: a request the core accepted whose state its window preparation cannot
represent (a logit_bias token outside the vocabulary: the core takes sampling parameters from its
pipe as they come, and on CUDA that index would be a device-side assert that no request survives),
a request whose output processing breaks mid-window, and a stop string for a sample that does not exist.
"""

import multiprocessing
import time

import pytest

from lockstep_engine import protocol as p
from lockstep_engine.config import EngineConfig
from lockstep_engine.core_process import run_engine_core
from lockstep_engine.output_processor import IncrementalDetokenizer
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sequence import Request

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 3, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def _run(engine, bad=None) -> dict:
    """Runs the healthy prompts (and `bad`: (request_id, prompt, params), added as the core process adds
    what its pipe brings: without the server's vocabulary checks) to the end; the last output of each."""
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(**GREEDY), request_id=f"ok-{index}")
    if bad is not None:
        request_id, prompt, params = bad
        engine.core.add_request(Request(request_id, prompt, params, engine.config.max_model_len, seed=0))
        engine.processor.add_request(request_id, None, prompt, params)
    last = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            last[output.request_id] = output
    assert not engine.has_unfinished_requests()
    return last


def _healthy_tokens(outputs: dict) -> list[list[int]]:
    return [outputs[f"ok-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def alone(tiny) -> list[list[int]]:
    """The healthy requests' greedy tokens when nothing else runs."""
    outputs = _run(tiny.engine)
    assert all(len(tokens) == GREEDY["max_tokens"] for tokens in _healthy_tokens(outputs))
    return _healthy_tokens(outputs)


@pytest.mark.parametrize("n", [1, 3])
def test_a_request_whose_preparation_fails_fails_alone_and_frees_its_blocks(tiny, alone, n):
    engine = tiny.engine
    vocab = engine.model_config.vocab_size
    free_before = engine.core.blocks.num_free_blocks
    bad = SamplingParams(temperature=0.0, max_tokens=12, n=n, logit_bias={vocab + 7: 5.0})
    outputs = _run(engine, ("bad", [4, 4, 4, 4, 4, 4, 4, 4, 4, 4], bad))
    assert _healthy_tokens(outputs) == alone
    assert all(outputs[f"ok-{i}"].outputs[0].finish_reason == "length" for i in range(len(PROMPTS)))
    failed = outputs["bad"]
    assert failed.finished and [c.finish_reason for c in failed.outputs] == ["error"] * n
    assert engine.core.blocks.num_free_blocks == free_before
    assert "bad" not in engine.core.requests and not engine.core.scheduler.has_work()


def test_a_request_whose_output_processing_breaks_mid_window_fails_alone(tiny, alone):
    """Its window has run a step with it when it fails: its blocks are freed when the window ends."""
    engine = tiny.engine
    free_before = engine.core.blocks.num_free_blocks
    engine.add_request([6, 6, 6, 6, 6], SamplingParams(**GREEDY), request_id="breaks")
    # Its text state gets a detokenizer without a tokenizer: its first token cannot be decoded.
    engine.processor.states["breaks"].sequences[0].detokenizer = IncrementalDetokenizer(None, [6, 6, 6, 6, 6])
    outputs = _run(engine)
    assert _healthy_tokens(outputs) == alone
    assert [c.finish_reason for c in outputs["breaks"].outputs] == ["error"]
    assert outputs["breaks"].finished and "breaks" not in engine.core.requests
    assert engine.core.blocks.num_free_blocks == free_before


def test_the_core_process_tells_the_client_and_serves_the_others():
    """Through the core's own pipe protocol: a request whose preparation fails, and one whose stop
    string names a sample it does not have, each get an internal `RequestFailed` (a 500 at the API);
    the others finish, the cache ends empty and the process goes on until told to stop."""
    ctx = multiprocessing.get_context("spawn")
    to_core_recv, to_core_send = ctx.Pipe(duplex=False)
    from_core_recv, from_core_send = ctx.Pipe(duplex=False)
    config = EngineConfig(model="random:tiny", skip_warmup=True, num_gpu_blocks_override=64, num_scheduler_steps=4)
    process = ctx.Process(target=run_engine_core, args=(config, to_core_recv, from_core_send), daemon=True)
    process.start()
    to_core_recv.close()
    from_core_send.close()
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    failed: dict[str, p.RequestFailed] = {}
    last = []

    columns = p.ColumnCache()

    def receive_until(done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            assert remaining > 0 and from_core_recv.poll(remaining), f"nothing more after {last[-3:]}"
            message = from_core_recv.recv()
            last.append(message)
            assert not isinstance(message, p.CoreFailed), message.message
            if isinstance(message, p.StepOutputs):
                if message.batch is not None:  # a window's columns come with its first batch only
                    message.batch = columns.restore(message.batch)
                for output in message.all_outputs():
                    tokens.setdefault(output.request_id, []).extend(output.token_ids)
                    if output.finish_reason is not None:
                        finish[output.request_id] = output.finish_reason
            elif isinstance(message, p.RequestFailed):
                failed[message.request_id] = message

    try:
        receive_until(lambda: last and isinstance(last[-1], p.CoreReady), 120)
        vocab = last[-1].vocab_size
        now = time.monotonic()
        bad = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={vocab: 1.0}).to_dict()
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True).to_dict()
        to_core_send.send(p.AddRequest("bad", [3, 1, 4, 1, 5], bad, now))
        to_core_send.send(p.AddRequest("bad-stop", [2, 7, 1, 8], long, now))
        for index, prompt in enumerate(PROMPTS):
            to_core_send.send(p.AddRequest(f"ok-{index}", prompt, SamplingParams(**GREEDY).to_dict(), now))
        receive_until(lambda: "bad-stop" in tokens, 60)
        to_core_send.send(p.StopSequence("bad-stop", 3, "stop"))  # n=1: there is no sample 3
        receive_until(lambda: {"bad", "bad-stop"} <= set(failed) and len(finish) >= len(PROMPTS), 60)
        assert failed["bad"].internal and "ValueError" in failed["bad"].message
        assert failed["bad-stop"].internal and "IndexError" in failed["bad-stop"].message
        assert "bad" not in tokens and "bad-stop" not in finish and len(tokens["bad-stop"]) < 200
        assert all(len(tokens[f"ok-{i}"]) == GREEDY["max_tokens"] for i in range(len(PROMPTS)))
        assert {f"ok-{i}": "length" for i in range(len(PROMPTS))} == finish
        receive_until(lambda: isinstance(last[-1], (p.EngineStats, p.Heartbeat)) and _idle(last[-1]), 30)
        to_core_send.send(p.Shutdown())
        process.join(30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(10)


def _idle(message) -> bool:
    stats = message if isinstance(message, p.EngineStats) else message.stats
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
