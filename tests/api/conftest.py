"""Shared `lockstep serve` processes: starting one costs seconds, so modules share them per session.

Servers that several modules use start together on first use (their model loads overlap), and
each waits for `/health` with a deadline.
"""

import pytest

from api_harness import API_KEY, MAX_BODY_BYTES, Server
from directory_scope import at_directory_end


@pytest.fixture(scope="session")
def servers():
    """Lazily started shared servers; all are stopped when the run leaves tests/api (and started again
    should a later test ask), else at the end of the session."""
    started: dict[str, Server] = {}

    def stop_all() -> None:
        for server in started.values():
            server.stop()
        started.clear()

    at_directory_end(__file__, stop_all)

    def get(key: str) -> Server:
        if key not in started:
            for spec_key in _GROUPS[key]:
                if spec_key not in started:
                    model, args, kwargs = _SPECS[spec_key]
                    started[spec_key] = Server(model, *args, name=spec_key, **kwargs)
        return started[key].wait_healthy()

    yield get
    stop_all()


_SPECS = {
    # SmolLM2 where text matters; N=8 (the default) and N=1 for the same requests.
    "smol8": ("smollm2", ("--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20)), {}),
    "smol1": ("smollm2", ("--num-scheduler-steps", "1", "--max-model-len", "128",
                          "--kv-cache-memory-bytes", str(128 << 20)), {}),
    # tool_choice "auto" with the hermes parser, and request chat templates (test_api_tools.py).
    "smoltools": ("smollm2", ("--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
                              "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                              "--trust-request-chat-template"), {}),
    # A tiny random model where only token counts matter; guarded by an API key.
    "tiny": ("random:tiny", ("--num-gpu-blocks-override", "512", "--max-num-seqs", "128", "--max-model-len", "1024",
                             "--max-request-body-bytes", str(MAX_BODY_BYTES)), {"api_key": API_KEY}),
}
# Starting one SmolLM2 server starts the other too, so their model loads overlap.
_GROUPS = {"smol8": ("smol8", "smol1"), "smol1": ("smol8", "smol1"), "tiny": ("tiny",), "smoltools": ("smoltools",)}


@pytest.fixture(scope="session")
def smol8(servers) -> Server:
    return servers("smol8")


@pytest.fixture(scope="session")
def smol1(servers) -> Server:
    return servers("smol1")


@pytest.fixture(scope="session")
def tiny(servers) -> Server:
    return servers("tiny")


@pytest.fixture(scope="session")
def offline_smollm2():
    """The offline engine on the same model: what greedy text through the API must equal."""
    from lockstep_engine.llm import LLM

    return LLM("smollm2", num_scheduler_steps=8, max_model_len=1024, kv_cache_memory_bytes=128 << 20)
