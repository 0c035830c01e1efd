"""docs/ARCHITECTURE.md's claims that a test can check: the files its change recipes name exist, the
routing policies it lists are the gateway's, and the modules its noun table names exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end != -1 else len(DOC)]


RECIPES = _section("Three common changes, and the files each touches")
PACKAGE_DIRS = {"lockstep_engine": "engine", "lockstep_gateway": "gateway", "lockstep_operator": "operator"}


def _repo_path(name: str) -> Path:
    """A path as the doc writes it: from the repository root, or from a package (`lockstep_engine/x.py`)."""
    top = name.split("/", 1)[0]
    return ROOT / PACKAGE_DIRS[top] / name if top in PACKAGE_DIRS else ROOT / name


def test_every_file_the_change_recipes_name_exists():
    paths = set(re.findall(r"`((?:engine|gateway|operator|charts|docs|lockstep|lockstep_common)/[\w./-]+)`",
                           RECIPES))
    assert len(paths) >= 15, sorted(paths)
    missing = sorted(path for path in paths if not (ROOT / path).exists())
    assert not missing, missing


def test_the_recipes_short_lists_stay_short():
    """Each change names at most six product files: the seams keep a change in few places."""
    for title in ("A new sampling parameter", "A new routing policy", "A new `LLMService` field"):
        start = RECIPES.index(f"**{title}")
        end = RECIPES.find("\n**", start + 1)
        block = RECIPES[start:end if end != -1 else len(RECIPES)]
        files = set(re.findall(r"`((?:engine|gateway|operator|charts)/[\w./-]+\.(?:py|yaml))`", block.split("\n\n")[1]))
        assert 2 <= len(files) <= 7, (title, sorted(files))


def test_the_listed_routing_policies_are_the_gateways():
    from lockstep_gateway.routing.registry import POLICIES

    listed = re.search(r"The policies today: (.*?);", RECIPES, re.S).group(1)
    assert set(re.findall(r"`([\w-]+)`", listed)) == set(POLICIES)


def test_every_module_of_the_noun_table_exists():
    table = _section("Packages and where each noun lives")
    names = set(re.findall(r"`((?:lockstep\w*)/[\w./]+)`", table))
    assert len(names) >= 20, sorted(names)
    missing = sorted(name for name in names if not _repo_path(name).exists())
    assert not missing, missing
