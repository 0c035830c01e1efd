"""Keep an engine pod's LoRA adapters in step with the list the operator writes (started by launch.py).

  lora_sync.py   runs until the pod stops: a pass every LOCKSTEP_LORA_POLL_SECONDS (default 10).

LOCKSTEP_LORA_ADAPTERS_FILE is the ConfigMap's lora-adapters.json, mounted; the kubelet replaces it, without
restarting the pod, when the LLMService's spec.loraAdapters changes:
    {"adapters": [{"name": "sql", "source": "hf://org/sql-lora@v2", "path": "/var/cache/lockstep/lora-adapters/<hash>"},
                  {"name": "chat", "source": "pvc://adapters/chat", "path": "/models/adapters/chat"}]}
Every pod, each pass: fetches the hf:// and http(s):// adapters that are not in their path yet with fetch.py
(beside this file; LOCKSTEP_LORA_HF_ENDPOINT and LOCKSTEP_MODEL_TOKEN_FILE as for the model), and removes
fetched adapters no longer listed. pvc:// adapters are on volumes the pod mounted at start.
Pod 0 (whose engine serves HTTP on 127.0.0.1:LOCKSTEP_HTTP_PORT) also, once GET /health answers 200: learns
the adapters the engine has (GET /v1/models), then each pass POSTs /v1/unload_lora_adapter {"lora_name"} for
adapters no longer listed or listed with another path, and /v1/load_lora_adapter {"lora_name", "lora_path"}
for listed ones the engine does not have. A failed fetch, load or unload is logged (once per error) and
tried again on the next pass. After its first pass the program creates LOCKSTEP_LORA_READY_FILE: the
leader's readiness probe waits for it, so a new group takes requests with its adapters loaded.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

FETCH_TIMEOUT_S = 3600


def log(message):
    print(f"lora_sync.py: {message}", file=sys.stderr, flush=True)


def is_fetched(source):
    return source.startswith(("hf://", "http://", "https://"))


class Engine:
    """The leader engine's HTTP routes on loopback."""

    def __init__(self, url, api_key=None, timeout=30):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def call(self, method, route, body=None):
        """(status, text); status 0 when the engine could not be reached."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")
        except OSError as error:
            return 0, str(error)

    def healthy(self):
        return self.call("GET", "/health")[0] == 200

    def loaded_adapters(self):
        """{name: path} of the adapters the engine serves (the /v1/models entries with a parent)."""
        status, text = self.call("GET", "/v1/models")
        if status != 200:
            return None
        return {m["id"]: m.get("root") for m in json.loads(text).get("data", []) if m.get("parent")}


class AdapterSync:
    """One pod's view: what is fetched here, and (leader only) what the engine has loaded."""

    def __init__(self, adapters_file, engine, fetch_program, fetch_env):
        self.adapters_file = adapters_file
        self.engine = engine  # None outside pod 0
        self.fetch_program = fetch_program
        self.fetch_env = fetch_env
        self.loaded = None  # {name: path} the engine has, once known
        self.fetched = set()  # paths this program fetched or found fetched
        self.reported = {}  # what -> the last error logged for it

    def report(self, what, error):
        if error is None:
            self.reported.pop(what, None)
        elif self.reported.get(what) != error:
            self.reported[what] = error
            log(f"{what}: {error}")

    def read(self):
        """{name: adapter} from the adapters file, or None when it cannot be read (then nothing changes)."""
        try:
            with open(self.adapters_file) as handle:
                adapters = {a["name"]: a for a in json.load(handle)["adapters"]}
        except (OSError, ValueError, KeyError, TypeError) as error:
            self.report(f"read {self.adapters_file}", str(error))
            return None
        self.report(f"read {self.adapters_file}", None)
        return adapters

    def fetch(self, adapter):
        """Whether the adapter's files are in its path (fetched now if they were not)."""
        path = adapter["path"]
        if os.path.isdir(path):
            self.fetched.add(path)
            return True
        env = dict(self.fetch_env, LOCKSTEP_MODEL_SOURCE=adapter["source"], LOCKSTEP_MODEL_DIR=path)
        try:
            done = subprocess.run([sys.executable, self.fetch_program], env=env, timeout=FETCH_TIMEOUT_S,
                                  capture_output=True, text=True)
            error = None if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            error = f"not fetched within {FETCH_TIMEOUT_S}s"
        self.report(f"fetch {adapter['name']} ({adapter['source']})", error)
        if error is None:
            self.fetched.add(path)
        return error is None

    def update_engine(self, wanted, ready):
        if self.loaded is None:
            if not self.engine.healthy():
                return False
            self.loaded = self.engine.loaded_adapters()
            if self.loaded is None:
                return False
        for name, path in sorted(self.loaded.items()):
            if name not in wanted or wanted[name]["path"] != path:
                status, text = self.engine.call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
                if status in (200, 404):  # 404: the engine no longer has it either
                    del self.loaded[name]
                    log(f"unloaded {name}")
                self.report(f"unload {name}", None if status in (200, 404) else f"HTTP {status}: {text.strip()}")
        for name in sorted(set(wanted) - set(self.loaded)):
            if name not in ready:
                continue
            path = wanted[name]["path"]
            status, text = self.engine.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            if status == 200:
                self.loaded[name] = path
                log(f"loaded {name} from {path}")
            self.report(f"load {name}", None if status == 200 else f"HTTP {status}: {text.strip()}")
        return True

    def sync_once(self):
        """One pass; whether it is complete (the leader's engine answered; elsewhere always)."""
        wanted = self.read()
        if wanted is None:
            return False
        ready = {name for name, a in wanted.items() if not is_fetched(a["source"]) or self.fetch(a)}
        done = True if self.engine is None else self.update_engine(wanted, ready)
        in_use = {a["path"] for a in wanted.values()} | set((self.loaded or {}).values())
        for path in sorted(self.fetched - in_use):
            shutil.rmtree(path, ignore_errors=True)
            self.fetched.discard(path)
        return done


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    fetch_env = dict(os.environ)
    if os.environ.get("LOCKSTEP_LORA_HF_ENDPOINT"):
        fetch_env["HF_ENDPOINT"] = os.environ["LOCKSTEP_LORA_HF_ENDPOINT"]
    engine = None
    if os.environ.get("LOCKSTEP_POD_INDEX") == "0":
        port = os.environ.get("LOCKSTEP_HTTP_PORT", "8000")
        engine = Engine(f"http://127.0.0.1:{port}", os.environ.get("LOCKSTEP_API_KEY"))
    sync = AdapterSync(os.environ["LOCKSTEP_LORA_ADAPTERS_FILE"], engine, os.path.join(here, "fetch.py"), fetch_env)
    ready_file = os.environ.get("LOCKSTEP_LORA_READY_FILE")
    interval = float(os.environ.get("LOCKSTEP_LORA_POLL_SECONDS", "10"))
    synced = False
    while True:
        if sync.sync_once() and not synced:
            synced = True
            if ready_file:
                with open(ready_file, "w") as handle:
                    handle.write("synced\n")
        # Until the first complete pass (the engine is still loading its model), look again soon.
        time.sleep(interval if synced else min(interval, 1.0))


if __name__ == "__main__":
    sys.exit(main())
