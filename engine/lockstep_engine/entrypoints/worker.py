"""`lockstep worker`: a non-leader rank of an engine group (environment: LOCKSTEP_RANK, ...).

Takes the same engine arguments as `lockstep serve` (server-only flags are ignored), or the
leader's configuration as JSON in LOCKSTEP_ENGINE_CONFIG when the leader spawned it locally.
"""

from __future__ import annotations

import json
import os
import sys

from lockstep_engine.config import ConfigError, EngineConfig


def main(argv: list[str]) -> int:
    """Returns 2 on a bad configuration; a rank that ran ends its process with run_worker's code."""
    if "LOCKSTEP_RANK" not in os.environ:
        print("lockstep worker: LOCKSTEP_RANK is not set (expected the rank of this process in its engine group)",
              file=sys.stderr)
        return 2
    try:
        if os.environ.get("LOCKSTEP_ENGINE_CONFIG"):
            config = EngineConfig(**json.loads(os.environ["LOCKSTEP_ENGINE_CONFIG"]))
        else:
            from lockstep_engine.entrypoints.serve import build_parser, engine_config_from_args

            args, _ = build_parser().parse_known_args(argv)
            config = engine_config_from_args(args)
    except ConfigError as error:
        print(f"lockstep worker: {error}", file=sys.stderr)
        return 2
    from lockstep_engine.group.rendezvous import exit_rank
    from lockstep_engine.group.worker import run_worker

    exit_rank(run_worker(config))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
