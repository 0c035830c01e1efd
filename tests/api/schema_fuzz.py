"""A bounded schemathesis run against a server's /openapi.json: several `st` processes for a fixed time.

Where the time goes (measured with a per-thread profile of `st run` against `lockstep serve random:tiny` on
the 2-core dev machine): `st` spends about 18 ms of CPU per case, two thirds of it generating the case
in Hypothesis, the rest in its HTTP client and checks; the server's answer takes about 10 ms. So the
run is CPU-bound in the generator, and it is spread over several `st` processes (schemathesis's own
`--workers` are threads under one GIL, and crashed with 4 of them).
Three more costs are cut: Hypothesis builds its table of encodable characters (tens of seconds) in
`.hypothesis` under the working directory, so the runs share one persistent directory; the example
database and shrinking are off, since every case is new and a failure is reported, not minimised.

Each process fuzzes its share of the operations for the same time budget (with `--max-time`,
schemathesis repeats the fuzzing phase until the budget is spent): chat completions (the largest
schema, about 2.5x slower to generate per case than completions), completions, tokenize and
detokenize, and everything else; Hypothesis drops duplicates, so the parameterless routes
(`/health`, `/version`, ...) contribute a few cases each.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHARDS = (
    ("--include-path-regex", r"^/v1/chat/completions$"),
    ("--include-path-regex", r"^/v1/completions$"),
    ("--include-path-regex", r"^/(de)?tokenize$"),
    ("--exclude-path-regex", r"^/v1/(chat/)?completions$|^/(de)?tokenize$"),  # models/{id}, ping, health, ...
)
HYPOTHESIS_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lockstep" / "schemathesis"


def schemathesis_cli() -> str | None:
    return shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")


def run_fuzz(openapi_url: str, seed: int, seconds: int) -> tuple[int, float, str]:
    """Runs the shards in parallel for `seconds`; returns (generated requests, seconds taken, the outputs'
    summaries). Fails on any 5xx."""
    cli = schemathesis_cli()
    assert cli is not None, f"schemathesis is not installed for {sys.executable} (pip install -e .[dev])"
    HYPOTHESIS_HOME.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    processes = []
    for index, selection in enumerate(SHARDS):
        command = [cli, "run", openapi_url, "--checks", "not_a_server_error", "--phases", "fuzzing",
                   "--max-time", str(seconds), "--max-examples", "100000", "--seed", str(seed + index),
                   "--workers", "1", "--request-timeout", "30", "--generation-database", "none", "--no-shrink",
                   "--warnings", "off", "--no-color", *selection]
        processes.append(subprocess.Popen(command, cwd=HYPOTHESIS_HOME, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs, generated = [], 0
    try:
        for process in processes:
            deadline = max(1.0, seconds + 120 - (time.monotonic() - started))  # its start and last answers
            output, _ = process.communicate(timeout=deadline)
            outputs.append(output)
            assert process.returncode == 0, output[-6000:]
            count = re.search(r"(\d+) generated", output)
            assert count is not None, output[-3000:]
            generated += int(count.group(1))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    return generated, time.monotonic() - started, "\n".join(output[-700:] for output in outputs)
