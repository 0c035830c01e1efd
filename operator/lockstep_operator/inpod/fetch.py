"""Fetch the model of an LLMService into a volume before the engine starts (init container).

Environment (set by the Lockstep operator):
  LOCKSTEP_MODEL_SOURCE      hf://<org>/<repo>[@<revision>], or an http(s):// URL of one file
                             (.tar, .tar.gz and .tgz archives are unpacked)
  LOCKSTEP_MODEL_DIR         where the model goes; present = complete (it appears by one rename)
  HF_ENDPOINT                the Hugging Face hub or a mirror (default https://huggingface.co)
  LOCKSTEP_MODEL_TOKEN_FILE  optional: a file holding a bearer token (a mounted Secret)

A model already in LOCKSTEP_MODEL_DIR (a cache volume kept across restarts) is not fetched again.
Pods of one group fetch in parallel into private directories; the first to finish renames its
copy into place and the others drop theirs.
"""
import json
import os
import shutil
import socket
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request

ATTEMPTS = 4
TIMEOUT_S = 60
# Files a Hugging Face model directory needs to serve: configs, weights, tokenizer.
HF_SUFFIXES = (".json", ".safetensors", ".model", ".txt")


def log(message):
    print(f"fetch.py: {message}", file=sys.stderr, flush=True)


def request(url, token):
    req = urllib.request.Request(url, headers={"User-Agent": "lockstep-fetch"})
    if token:
        # Not forwarded on redirects: hubs redirect to pre-signed storage URLs on other hosts.
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    return req


def open_with_retries(url, token):
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return urllib.request.urlopen(request(url, token), timeout=TIMEOUT_S)
        except urllib.error.HTTPError as error:
            if error.code < 500 or attempt == ATTEMPTS:
                raise SystemExit(f"fetch.py: GET {url}: HTTP {error.code} {error.reason}") from None
            log(f"GET {url}: HTTP {error.code}; retrying ({attempt}/{ATTEMPTS})")
        except (urllib.error.URLError, socket.timeout, ConnectionError) as error:
            if attempt == ATTEMPTS:
                raise SystemExit(f"fetch.py: GET {url}: {error}") from None
            log(f"GET {url}: {error}; retrying ({attempt}/{ATTEMPTS})")
        time.sleep(2 ** attempt)
    raise AssertionError("unreachable")


def download(url, token, path):
    with open_with_retries(url, token) as response, open(path, "wb") as out:
        shutil.copyfileobj(response, out, 1 << 22)
    log(f"{url} -> {path} ({os.path.getsize(path)} bytes)")


def fetch_hf(repo, revision, endpoint, token, into):
    quoted = urllib.parse.quote(revision, safe="")
    with open_with_retries(f"{endpoint}/api/models/{repo}/revision/{quoted}", token) as response:
        info = json.load(response)
    names = sorted(
        s["rfilename"] for s in info.get("siblings", [])
        if "/" not in s["rfilename"] and s["rfilename"].endswith(HF_SUFFIXES)
    )
    if not any(name.endswith(".safetensors") for name in names):
        raise SystemExit(f"fetch.py: hf://{repo}@{revision} has no *.safetensors weights at its top level")
    for name in names:
        download(f"{endpoint}/{repo}/resolve/{quoted}/{urllib.parse.quote(name)}", token, os.path.join(into, name))


def fetch_url(url, token, into):
    name = os.path.basename(urllib.parse.urlparse(url).path)
    path = os.path.join(into, name)
    download(url, token, path)
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        with tarfile.open(path) as archive:
            for member in archive.getmembers():
                parts = member.name.split("/")
                if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                    raise SystemExit(f"fetch.py: {url}: refusing archive member {member.name!r} "
                                     "(only plain files and directories inside the archive)")
            # Python's "data" filter where the interpreter has it (3.11.4+): the same rules again.
            archive.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        os.remove(path)


def main():
    source = os.environ["LOCKSTEP_MODEL_SOURCE"]
    target = os.environ["LOCKSTEP_MODEL_DIR"].rstrip("/")
    if os.path.isdir(target):
        log(f"{source} is already in {target}")
        return 0
    token = None
    token_file = os.environ.get("LOCKSTEP_MODEL_TOKEN_FILE")
    if token_file:
        with open(token_file) as handle:
            token = handle.read().strip()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        if source.startswith("hf://"):
            repo, _, revision = source[len("hf://"):].partition("@")
            endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
            fetch_hf(repo, revision or "main", endpoint, token, partial)
        else:
            fetch_url(source, token, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # a cache volume keeps no half-fetched copy
        raise
    try:
        os.rename(partial, target)
    except OSError:
        if not os.path.isdir(target):
            raise
        log(f"another pod put {source} in {target} first")
        shutil.rmtree(partial, ignore_errors=True)
    log(f"{source} is in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
