"""`lockstep` command line: dispatches each subcommand to the component that owns it.

Imports are deferred so `lockstep gateway` and `lockstep operator` never load torch.
"""

from __future__ import annotations

import difflib
import importlib
import sys

# subcommand -> (module, function taking argv and returning an exit code)
_COMMANDS = {
    "serve": ("lockstep_engine.entrypoints.serve", "main"),
    "worker": ("lockstep_engine.entrypoints.worker", "main"),
    "generate": ("lockstep_engine.entrypoints.generate", "main"),
    "fetch": ("lockstep_engine.entrypoints.fetch", "main"),
    "gateway": ("lockstep_gateway.main", "main"),
    "up": ("lockstep.up", "main"),
    "operator": ("lockstep_operator.main", "main"),
}
# `lockstep bench <kind>`
_BENCH = {
    "throughput": ("lockstep.bench.throughput", "main"),
    "serve": ("lockstep.bench.serve", "main"),
    "gateway": ("lockstep.bench.gateway", "main"),
    "health": ("lockstep.bench.health_flood", "main"),
}

_USAGE = """usage: lockstep <command> [options]

commands:
  serve MODEL           OpenAI-compatible engine server
  worker                join an engine group as a non-leader rank (env LOCKSTEP_*)
  generate MODEL        generate text offline
  fetch MODEL           download/cache a model source (e.g. smollm2)
  gateway               OpenAI-compatible gateway over engine groups
  up MODEL              local stack: gateway + engine groups as processes
  operator              Kubernetes operator for LLMService resources
  bench throughput      offline engine throughput on a synthetic workload
  bench serve           load-test any OpenAI-compatible server
  bench gateway         the gateway's CPU and latency per relayed chunk, against a fake engine
  bench health          the gateway's /health latency under a flood of streams
"""


def _run(target: tuple[str, str], argv: list[str]) -> int:
    module_name, func_name = target
    module = importlib.import_module(module_name)
    return int(getattr(module, func_name)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from lockstep import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] not in _BENCH:
            print(f"lockstep bench: expected one of {sorted(_BENCH)}, got {rest[:1]}", file=sys.stderr)
            return 2
        return _run(_BENCH[rest[0]], rest[1:])
    if command not in _COMMANDS:
        close = difflib.get_close_matches(command, [*_COMMANDS, "bench"], n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(f"lockstep: unknown command {command!r}\n{hint}(`lockstep --help` lists the commands)", file=sys.stderr)
        return 2
    return _run(_COMMANDS[command], rest)


if __name__ == "__main__":
    sys.exit(main())
