"""Writes images/requirements/<extra>.txt: every package each image installs, pinned with `==`.

Resolved by pip against PyPI, constrained to the versions installed in the current environment (the
one `make test` ran with), so an image carries the versions the tests ran against. Run it after
changing the extras in pyproject.toml:  python3 images/lock.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("engine", "gateway", "operator")


def installed_constraints() -> str:
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return (
        "\n".join(
            line
            for line in freeze.splitlines()
            if "==" in line and not line.startswith("-e")
        )
        + "\n"
    )


def resolve(extra: str, constraints: Path) -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--report", str(report), "-c", str(constraints), f"{ROOT}[{extra}]"],
            check=True,
        )  # fmt: skip
        items = json.loads(report.read_text())["install"]
    return sorted(
        (
            item["metadata"]["name"].lower().replace("_", "-"),
            item["metadata"]["version"],
        )
        for item in items
        if item["metadata"]["name"] != "lockstep"
    )


def main() -> int:
    out = ROOT / "images" / "requirements"
    out.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write(installed_constraints())
        constraints.flush()
        for extra in EXTRAS:
            pins = resolve(extra, Path(constraints.name))
            header = f"# The `{extra}` extra of lockstep, pinned by images/lock.py (python {sys.version.split()[0]}).\n"
            (out / f"{extra}.txt").write_text(
                header + "".join(f"{name}=={version}\n" for name, version in pins)
            )
            print(f"{extra}: {len(pins)} packages -> {out / f'{extra}.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
