"""`lockstep up MODEL`: the local stack — the gateway on :8000 and R engine groups as child processes.

Every option `up` does not know itself goes to each `lockstep serve` unchanged (vLLM's flag names:
`--num-scheduler-steps`, `--tensor-parallel-size`, `--max-model-len`, ...). `--api-key KEY` is
required by the engines and by the gateway, which sends it on to the engines. Engines listen on
free ports of 127.0.0.1; their output is shown prefixed with `[engine i]`, so model loading
progress is visible. The gateway runs in this process (its `/health` answered by a health listener
process, as `lockstep gateway`'s) and answers 503 until an engine is ready; a gateway port that is taken
stops `up` before any engine starts.

Supervision: an engine that exits after it was once ready (a crash, a kill, its core dying) is
started again on the same port after a back-off (1, 2, 5, 10, 30 s; back to 1 s once it stayed
ready for a minute), and the gateway's health checks readmit it. One that was ready and then fails
its health checks for `--liveness-timeout` seconds (a hung or core-less API server) is killed and
restarted the same way. An engine that dies while it starts is restarted the same way too, wherever
start-up was (loading, or ready and admitted by the gateway before `up` saw it ready): after
`MAX_FAILED_STARTS` starts in a row that ended before `up` saw it ready, the stack stops with its exit
code (a wrong model or flag would only crash again).

Ctrl-C or SIGTERM stops everything: the gateway closes, every engine gets SIGTERM (it drains), and
after `--shutdown-timeout` its whole process group gets SIGKILL; a second Ctrl-C kills at once.
Engines run in their own process groups with a parent-death signal, so none outlives `up`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time

import httpx
from lockstep_gateway.config import ROUTING_POLICIES, ConfigError, GatewayConfig
from lockstep_gateway.main import add_flow_control_flags

from lockstep_common.argparsing import ArgumentParser, port_number
from lockstep_common.sockets import die_with_parent

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
MAX_FAILED_STARTS = 3  # starts in a row that died before they were ready: then `up` stops
STABLE_AFTER_S = 60.0  # ready this long: the next crash restarts after the first back-off again


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="lockstep up", description=__doc__.split("\n")[0],
        epilog="Other options (e.g. --num-scheduler-steps 8 --tensor-parallel-size 2 --max-model-len 4096) are "
               "passed to every `lockstep serve`.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model", help="smollm2, random:<shape>, a .gguf file or a Hugging Face directory")
    parser.add_argument("--replicas", type=int, default=1, help="engine groups")
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    parser.add_argument("--port", type=port_number, default=8000, help="the gateway's port (1-65535)")
    parser.add_argument("--routing", default=GatewayConfig.routing, choices=ROUTING_POLICIES)
    # The gateway's routing and affinity flags (lockstep gateway --help), with its defaults.
    parser.add_argument("--session-header", default=GatewayConfig.session_header,
                        help="requests with this header (else with the same 'user') stick to one engine")
    parser.add_argument("--session-affinity", action=argparse.BooleanOptionalAction,
                        default=GatewayConfig.session_affinity, help="route a session's requests to the same engine")
    parser.add_argument("--saturation-queue-depth", type=int, default=GatewayConfig.saturation_queue_depth,
                        help="an engine with this many waiting requests takes no more (0 = no limit)")
    parser.add_argument("--max-in-flight-per-engine", type=int, default=GatewayConfig.max_in_flight_per_engine,
                        help="requests the gateway keeps open per engine (0 = no limit)")
    parser.add_argument("--api-key-file", action="append", default=[], metavar="PATH",
                        help="require these keys at the gateway (see `lockstep gateway --help`)")
    add_flow_control_flags(parser)  # the gateway's queue, with its defaults
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds engines get to drain on shutdown before they are killed")
    parser.add_argument("--liveness-timeout", type=float, default=30.0,
                        help="seconds a once-ready engine may fail its health checks before it is restarted")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    args, engine_args = parser.parse_known_args(argv)
    if args.replicas < 1:
        parser.error(f"--replicas={args.replicas} is out of range: allowed >= 1")
    if args.liveness_timeout <= 0:
        parser.error(f"--liveness-timeout={args.liveness_timeout} is out of range: allowed > 0 seconds")
    for flag in ("--host", "--port"):
        if any(a == flag or a.startswith(flag + "=") for a in engine_args):
            parser.error(f"{flag} belongs to the gateway here; engines listen on free ports of 127.0.0.1")
    _check_engine_flags(parser, engine_args)
    try:
        gateway_config(args, (), engine_args)
    except ConfigError as error:  # before any engine starts
        parser.error(str(error))
    return args, engine_args


def gateway_config(args: argparse.Namespace, engine_urls: tuple[str, ...], engine_args: list[str]) -> GatewayConfig:
    """The in-process gateway's configuration: `up`'s gateway flags, in front of `engine_urls`."""
    key = engine_key(engine_args)
    return GatewayConfig(host=args.host, port=args.port, routing=args.routing, session_header=args.session_header,
                         session_affinity=args.session_affinity, saturation_queue_depth=args.saturation_queue_depth,
                         max_in_flight_per_engine=args.max_in_flight_per_engine, max_queue_length=args.max_queue_length,
                         queue_timeout_s=args.queue_timeout, max_queue_bytes=args.max_queue_bytes, engines=engine_urls,
                         api_key_files=tuple(args.api_key_file), health_check_interval_s=0.5, engine_api_key=key,
                         api_keys=tuple(filter(None, [key])))


def _check_engine_flags(parser: ArgumentParser, engine_args: list[str]) -> None:
    """A flag neither `up` nor `lockstep serve` takes is refused here, with a "did you mean" over both,
    instead of by each engine after the stack started."""
    from lockstep_engine.entrypoints.serve import build_parser as serve_parser  # no torch: argument parsing only

    parser.other_flags = {flag for action in serve_parser()._actions for flag in action.option_strings}
    for arg in engine_args:
        if arg.startswith("--") and arg.split("=", 1)[0] not in parser.other_flags:
            parser.error(f"unrecognized arguments: {arg}")


def served_name(model: str, engine_args: list[str]) -> str:
    """The name clients send in 'model': the first --served-model-name given to the engines, else MODEL."""
    for i, arg in enumerate(engine_args):
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
        if arg == "--served-model-name" and i + 1 < len(engine_args) and not engine_args[i + 1].startswith("-"):
            return engine_args[i + 1]
    return model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def say(message: str) -> None:
    print(f"[lockstep up] {message}", file=sys.stderr, flush=True)


class EngineProcess:
    """One engine group's leader: `lockstep serve` on a fixed port, restarted on the same port."""

    def __init__(self, index: int, model: str, engine_args: list[str]):
        self.index = index
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "lockstep.cli", "serve", model, "--host", "127.0.0.1",
                     "--port", str(self.port), *engine_args]
        self.process: asyncio.subprocess.Process | None = None
        self.ready = False
        self.failed_starts = 0  # starts in a row that died before `up` saw them ready
        self.ready_since: float | None = None  # this run
        self.failing_since: float | None = None  # this run, after it was ready
        self.restarts = 0
        self._output: asyncio.Task | None = None

    async def start(self) -> None:
        self.ready = False
        self.ready_since = self.failing_since = None
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent)
        self._output = asyncio.create_task(self._relay_output())

    async def _relay_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        prefix = f"[engine {self.index}] ".encode()
        async for line in self.process.stdout:
            sys.stderr.buffer.write(prefix + line)
            sys.stderr.flush()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def terminate(self) -> None:
        """SIGTERM to the API server only: it drains, then stops its own engine core in order."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL to the engine's whole process group: its engine core (and TP ranks) too."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    async def wait(self) -> int:
        assert self.process is not None
        code = await self.process.wait()
        if self._output is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._output, 5)
        return code


class Stack:
    def __init__(self, args: argparse.Namespace, engine_args: list[str]):
        self.args = args
        self.engine_args = engine_args
        self.engines = [EngineProcess(i, args.model, engine_args) for i in range(args.replicas)]
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self.server = None

    async def run(self) -> int:
        from lockstep_gateway.app import build_app
        from lockstep_gateway.main import configure_logging, gateway_server

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        config = gateway_config(self.args, tuple(e.url for e in self.engines), self.engine_args)
        configure_logging("warning")

        try:  # the gateway's socket first: a taken port stops `up` before any engine starts
            listener = socket.create_server((self.args.host, self.args.port), backlog=4096)
        except OSError as error:
            reason = os.strerror(error.errno) if error.errno else str(error)
            say(f"the gateway cannot listen on {self.args.host}:{self.args.port}: {reason} (is the port taken?)")
            return 1
        # `up` handles the signals for the whole stack; the gateway's health listener takes the socket.
        self.server = gateway_server(build_app(config), config, handle_signals=False)
        self.server.prebound = [listener]
        say(f"starting {len(self.engines)} engine(s) for {self.args.model!r}; gateway on "
            f"http://{self.args.host}:{self.args.port}")
        for engine in self.engines:
            await engine.start()
        gateway = asyncio.create_task(self.server.serve())
        supervisors = [asyncio.create_task(self._supervise(e)) for e in self.engines]
        progress = asyncio.create_task(self._progress())
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait([gateway, stop], return_when=asyncio.FIRST_COMPLETED)
        if gateway.done() and not self.stopping.is_set():
            if self.server.exit_code:  # its log line says why
                say("the gateway's health listener process died; stopping")
            else:
                say(f"the gateway could not serve on {self.args.host}:{self.args.port} (is the port taken?)")
            self.exit_code = 1
        for task in (progress, *supervisors):
            task.cancel()
        await self._shutdown(gateway)
        return self.exit_code

    def _on_signal(self, sig: int) -> None:
        if self.stopping.is_set():
            say("second signal: killing the engines now")
            for engine in self.engines:
                engine.kill_group()
            return
        say(f"{signal.Signals(sig).name}: shutting down")
        self.stopping.set()

    async def _supervise(self, engine: EngineProcess) -> None:
        while True:
            code = await engine.wait()
            if self.stopping.is_set():
                return
            engine.kill_group()  # what the dead API server leaves behind (its engine core) goes too
            if engine.ready_since is None:
                engine.failed_starts += 1
                if engine.failed_starts >= MAX_FAILED_STARTS:
                    say(f"engine {engine.index} exited with code {code} before it was ready, {engine.failed_starts} "
                        f"starts in a row; stopping")
                    self.exit_code = code or 1
                    self.stopping.set()
                    return
            if engine.ready_since is not None and time.monotonic() - engine.ready_since >= STABLE_AFTER_S:
                engine.restarts = 0
            delay = RESTART_BACKOFF_S[min(engine.restarts, len(RESTART_BACKOFF_S) - 1)]
            say(f"engine {engine.index} exited with code {code}; restarting it in {delay:g}s")
            engine.restarts += 1
            await asyncio.sleep(delay)
            if self.stopping.is_set():
                return
            await engine.start()

    async def _progress(self) -> None:
        """Print who is ready as it changes, and a heartbeat line while models load."""
        started = time.monotonic()
        last_note = started
        announced = False
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                for engine in self.engines:
                    ready = False
                    if engine.running:
                        with contextlib.suppress(httpx.HTTPError):
                            ready = (await client.get(engine.url + "/health")).status_code == 200
                    if ready and not engine.ready:
                        engine.failed_starts = 0
                        if engine.ready_since is None:
                            engine.ready_since = time.monotonic()
                        say(f"engine {engine.index} ready on {engine.url} ({time.monotonic() - started:.0f}s)")
                    engine.ready = ready
                    self._check_liveness(engine, ready)
                num_ready = sum(e.ready for e in self.engines)
                if num_ready == len(self.engines) and not announced:
                    announced = True
                    say(f"ready: OpenAI API at http://{self.args.host}:{self.args.port}/v1 "
                        f"(model {served_name(self.args.model, self.engine_args)!r}, {num_ready} engine(s)); "
                        f"Ctrl-C stops")
                elif num_ready < len(self.engines) and time.monotonic() - last_note >= 10:
                    last_note = time.monotonic()
                    say(f"{num_ready}/{len(self.engines)} engine(s) ready after {last_note - started:.0f}s; "
                        "loading...")
                await asyncio.sleep(0.5)

    def _check_liveness(self, engine: EngineProcess, ready: bool) -> None:
        """Kill a once-ready engine that stays unhealthy: the supervisor then restarts it."""
        if ready or engine.ready_since is None or not engine.running or self.stopping.is_set():
            engine.failing_since = None
            return
        now = time.monotonic()
        if engine.failing_since is None:
            engine.failing_since = now
        elif now - engine.failing_since >= self.args.liveness_timeout:
            say(f"engine {engine.index} failed its health checks for {self.args.liveness_timeout:g}s: killing it")
            engine.failing_since = None
            engine.kill_group()

    async def _shutdown(self, gateway: asyncio.Task) -> None:
        """The gateway first (no new requests reach a draining engine), then the engines."""
        assert self.server is not None
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(gateway, 10)
        for engine in self.engines:
            engine.terminate()
        waits = [asyncio.create_task(e.wait()) for e in self.engines if e.process is not None]
        _, pending = await asyncio.wait(waits, timeout=self.args.shutdown_timeout) if waits else (set(), set())
        if pending:
            say(f"{len(pending)} engine(s) still running after {self.args.shutdown_timeout:g}s: killing them")
        for engine in self.engines:
            engine.kill_group()  # an engine core left behind by its API server goes too
        if pending:
            await asyncio.wait(pending, timeout=10)
        say("stopped")


def engine_key(engine_args: list[str]) -> str | None:
    """The `--api-key` given to the engines, so the gateway can authenticate to them."""
    for i, arg in enumerate(engine_args):
        if arg == "--api-key" and i + 1 < len(engine_args):
            return engine_args[i + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    args, engine_args = parse_args(list(sys.argv[1:] if argv is None else argv))
    return asyncio.run(Stack(args, engine_args).run())


if __name__ == "__main__":
    sys.exit(main())
