"""Where the files a spec names come from (the model's, each LoRA adapter's): the source forms the
operator mounts (pvc://) or has fetched into the pod (hf://, http(s):// URLs), checked."""

from __future__ import annotations

import re

from lockstep_operator.errors import SpecError

PVC_RE = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?P<path>/[^/].*)?$")
# hf://<org>/<repo>[@<revision>]: fetched from the Hugging Face hub (or a mirror).
HF_RE = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][-._A-Za-z0-9]*/[A-Za-z0-9][-._A-Za-z0-9]*)(@(?P<revision>[-._/A-Za-z0-9]+))?$")
URL_RE = re.compile(r"^https?://[^/\s]+/\S+$")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def check_form(source: str, field: str) -> None:
    """A pvc://, hf:// or http(s):// source must be well formed (other sources are not checked here)."""
    if source.startswith("pvc://") and not PVC_RE.match(source):
        raise SpecError(field, f"must look like pvc://<claim-name>/<path inside the claim>, got {source!r}")
    if source.startswith("hf://") and not HF_RE.match(source):
        raise SpecError(field, f"must look like hf://<org>/<repo> or hf://<org>/<repo>@<revision>, got {source!r}")
    if source.startswith(("http://", "https://")) and not URL_RE.match(source):
        raise SpecError(field, f"must be a URL with a host and a path, got {source!r}")


def pvc_claim(source: str) -> str | None:
    match = PVC_RE.match(source)
    return match.group("claim") if match else None


def is_fetched(source: str) -> bool:
    """Whether the source is downloaded into the pod (hf:// or a URL) rather than found or mounted there."""
    return source.startswith(("hf://", "http://", "https://"))


def url_file_name(source: str) -> str:
    """The file name a URL source downloads to (its path's last part, the query left out)."""
    return source.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
