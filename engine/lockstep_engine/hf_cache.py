"""Hugging Face hub ids (`org/name`) resolved offline, from the local Hugging Face cache layout.

Standard library only: the engine core loads the weights from the directory this returns, and the
API server reads the same directory's generation_config.json, without torch. Nothing is downloaded:
a model that is not in the cache is an error naming every place that was looked at.

The layout (huggingface_hub's): `<cache>/models--<org>--<name>/snapshots/<commit>/` holds the
files, `<cache>/models--<org>--<name>/refs/<ref>` holds the commit a branch or tag points at.
"""

from __future__ import annotations

import os
import re

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
DEFAULT_REVISION = "main"


class HubCacheError(ValueError):
    """The hub id is not in any cache looked at; the message names the paths."""


def is_hub_id(spec: str) -> bool:
    """`org/name` that is not an existing local path (a relative directory wins, as in transformers)."""
    return bool(_HUB_ID.fullmatch(spec)) and not os.path.exists(spec)


def cache_roots(download_dir: str | None) -> list[str]:
    """Where a hub model may sit, in the order huggingface_hub looks: `--download-dir` alone when
    given (vLLM passes it as cache_dir), else HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if download_dir:
        return [download_dir]
    if os.environ.get("HF_HUB_CACHE"):
        return [os.environ["HF_HUB_CACHE"]]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return [os.path.join(home, "hub")]


def resolve_hub_id(repo_id: str, download_dir: str | None = None, revision: str | None = None) -> str:
    """The snapshot directory of `repo_id` at `revision` (a branch, tag or commit; default main)."""
    revision = revision or DEFAULT_REVISION
    looked = []
    for root in cache_roots(download_dir):
        repo_dir = os.path.join(root, "models--" + repo_id.replace("/", "--"))
        snapshots = os.path.join(repo_dir, "snapshots")
        ref_file = os.path.join(repo_dir, "refs", revision)
        if os.path.isfile(ref_file):
            with open(ref_file) as handle:
                commit = handle.read().strip()
            looked.append(f"{ref_file} -> {commit}")
            candidate = os.path.join(snapshots, commit)
        else:
            looked.append(f"{ref_file} (no such ref)")
            candidate = os.path.join(snapshots, revision)  # a commit hash given directly
        if os.path.isdir(candidate):
            return candidate
        looked.append(f"{candidate} (no such snapshot)")
        if revision != DEFAULT_REVISION or not os.path.isdir(snapshots):
            continue
        # No refs/main (a cache copied by hand): a single snapshot is unambiguous.
        entries = sorted(os.listdir(snapshots))
        if len(entries) == 1:
            return os.path.join(snapshots, entries[0])
        looked.append(f"{snapshots} holds {len(entries)} snapshots and no refs/main: pass --revision")
    raise HubCacheError(
        f"model {repo_id!r} (revision {revision!r}) is not in the local Hugging Face cache and nothing is "
        f"downloaded here; looked at: {'; '.join(looked)}. Set HF_HOME or --download-dir to the cache holding "
        f"it, or pass a model directory")


def local_model_dir(spec: str, download_dir: str | None = None, revision: str | None = None) -> str | None:
    """The directory holding `spec`'s config files, or None for sources without one (smollm2,
    random:, a .gguf file). Raises `HubCacheError` for a hub id missing from the cache."""
    if os.path.isdir(spec):
        return spec
    if is_hub_id(spec):
        return resolve_hub_id(spec, download_dir, revision)
    return None
