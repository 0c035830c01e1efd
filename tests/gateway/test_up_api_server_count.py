"""`lockstep up --api-server-count N`: an engine flag like any other, so every engine it starts gets it (each
engine then runs N API servers on its port, docs/ARCHITECTURE.md)."""

from __future__ import annotations

from lockstep import up


def test_up_passes_the_api_server_count_to_every_engine():
    args, engine_args = up.parse_args(["random:tiny", "--replicas", "2", "--api-server-count", "3"])
    assert engine_args == ["--api-server-count", "3"]
    engines = [up.EngineProcess(index, args.model, engine_args) for index in range(args.replicas)]
    assert [engine.argv[-2:] for engine in engines] == [["--api-server-count", "3"]] * 2
