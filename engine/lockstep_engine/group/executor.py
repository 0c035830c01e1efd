"""`Executor`: where an engine's ranks run, as the engine core sees them; `load_engine` builds one.

A `LocalExecutor` runs windows on this process's `ModelRunner` (one rank, or a worker's shard). A
`GroupExecutor` is the leader of a TP x PP group: before each window it broadcasts the window plan,
as a delta (`plan_codec`: a request's prompt and sampling parameters once, then per window only the
tokens and blocks each row gained and the row's step-1 work), and every rank runs the same window
on its shard. The plan travels on the group channel (`channel`: frames authenticated with the group
secret, no pickle). Tensor-parallel ranks draw the same tokens without a broadcast (logits are gathered on
every rank and the sampler's randomness is a function of seed, position and token); pipeline stages
adopt the last stage's samples by broadcast inside the window (`runner.steps`).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Protocol

from lockstep_engine import guided
from lockstep_engine.config import EngineConfig
from lockstep_engine.group.channel import STOP, WINDOW, GroupChannel, load_secret, new_secret
from lockstep_engine.group.plan_codec import PlanEncoder
from lockstep_engine.group.rendezvous import (DEFAULT_PORT, GroupError, check_layout, init_group,
                                              listen_on_loopback, spawn_local_workers, stop_workers, world_size)
from lockstep_engine.model_config import ModelConfig
from lockstep_engine.runner.model_runner import ModelRunner, resolve_device
from lockstep_engine.runner.outputs import GuideFactory, StepOutput, StepTiming, WindowTimings
from lockstep_engine.runner.step_inputs import sampling_arrays
from lockstep_engine.scheduler import ScheduledSeq, WindowPlan
from lockstep_engine.sources import resolve


class Executor(Protocol):
    """What the engine core needs of the ranks that run its windows."""

    model_config: ModelConfig
    device: object  # torch.device of this process's rank
    num_blocks: int  # KV blocks every rank holds
    micro_batches: int  # micro-batches in flight per window (pipeline stages), 1 without PP
    guide_factory: GuideFactory | None  # grammar masks for guided rows; None: guided decoding unavailable

    def prepare(self, row: ScheduledSeq) -> None: ...  # raises for this row's request alone (see LocalExecutor)

    def execute_window(self, plan: WindowPlan, on_step: Callable[[StepOutput], None],
                       continuing: bool = False, should_cut: Callable[[], bool] | None = None,
                       tail: object = None, defer_tail: bool = False) -> WindowTimings: ...

    @property
    def can_cut_windows(self) -> bool: ...  # whether execute_window heeds should_cut

    @property
    def can_defer_tail(self) -> bool: ...  # whether a window's last step may be handed over by the next (overlap)

    def use_attention_backend(self, name: str) -> None: ...  # "auto": the runner's own

    def check_health(self) -> None: ...  # raises GroupError when a rank is lost

    def on_idle(self) -> None: ...  # the engine has no window to run now

    def idle_timings(self) -> list[StepTiming]: ...  # device timings no later window would harvest (idle now)

    def shutdown(self) -> None: ...


class LocalExecutor:
    """Windows run on this process's runner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.model_config = runner.model_config
        self.device = runner.device
        self.num_blocks = runner.num_blocks
        self.micro_batches = runner.micro_batches

    @property
    def guide_factory(self) -> GuideFactory | None:
        return self.runner.guide_factory

    @guide_factory.setter
    def guide_factory(self, factory: GuideFactory | None) -> None:
        self.runner.guide_factory = factory

    def prepare(self, row: ScheduledSeq) -> None:
        """Builds a sequence's own window state once, before its first window: its sampling constants
        and arrays, its grammar matcher. What one request's state cannot represent (an integer past
        int64, a logit_bias token outside the vocabulary, a grammar that fails) then raises here, for
        that request, instead of inside a window every row shares, after the plan went to the group,
        or as a device-side assert on CUDA that no request survives."""
        params, vocab = row.seq.request.params, self.model_config.vocab_size
        outside = [token for token in params.logit_bias or () if not 0 <= token < vocab]
        if outside:
            raise ValueError(f"logit_bias: token id {outside[0]} is outside the vocabulary (0..{vocab - 1})")
        runner = self.runner
        sampling_arrays([row], runner.steps.sampling_cache)
        if params.guided_spec is not None and runner.state.is_last_stage:
            if runner.guide_factory is None:
                raise ValueError("response_format: guided decoding is not available in this engine")
            runner.guide_factory([row])

    def execute_window(self, plan: WindowPlan, on_step: Callable[[StepOutput], None],
                       continuing: bool = False, should_cut: Callable[[], bool] | None = None,
                       tail: object = None, defer_tail: bool = False) -> WindowTimings:
        return self.runner.execute_window(plan, on_step, continuing, should_cut if self.can_cut_windows else None,
                                          tail, defer_tail and self.can_defer_tail)

    @property
    def can_cut_windows(self) -> bool:
        """One rank without pipeline micro-batches: nobody else runs this window's steps."""
        return self.micro_batches == 1

    @property
    def can_defer_tail(self) -> bool:
        """One rank without pipeline micro-batches: the next window's inputs can come from this rank's
        device state alone."""
        return self.micro_batches == 1

    def use_attention_backend(self, name: str) -> None:
        self.runner.use_attention_backend(name)

    def check_health(self) -> None:
        pass

    def on_idle(self) -> None:
        pass

    def idle_timings(self) -> list[StepTiming]:
        return self.runner.clock.harvest()

    def shutdown(self) -> None:
        pass


class GroupExecutor(LocalExecutor):
    """The leader of an engine group: mirrors every window to the workers, then runs it on its own shard."""

    def __init__(self, runner: ModelRunner, workers: list[subprocess.Popen], channel: GroupChannel):
        super().__init__(runner)
        self.workers = workers  # the local workers it spawned (none when the ranks run elsewhere)
        self._channel = channel
        self._encoder = PlanEncoder()

    def execute_window(self, plan: WindowPlan, on_step: Callable[[StepOutput], None],
                       continuing: bool = False, should_cut: Callable[[], bool] | None = None,
                       tail: object = None, defer_tail: bool = False) -> WindowTimings:
        """Every rank runs all the plan's steps (their collectives pair up step by step): no cuts, and
        every step is handed over in its own window (the workers' plans carry tokens from the host)."""
        if tail is not None:
            raise RuntimeError("an engine group's window cannot take a window tail")
        self.check_health()
        self._send(WINDOW, self._encoder.encode(plan), "the window plan")
        return self.runner.execute_window(plan, on_step, continuing)

    @property
    def can_cut_windows(self) -> bool:
        return False

    @property
    def can_defer_tail(self) -> bool:
        return False

    def use_attention_backend(self, name: str) -> None:
        if name != "auto":
            raise ValueError(f"attention_backend={name!r}: an engine sharing a parallel group's model runs the "
                             "group's backend (expected auto)")

    def check_health(self) -> None:
        dead = [w.pid for w in self.workers if w.poll() is not None]
        if dead:
            raise GroupError(f"engine group worker process(es) {dead} exited")

    def on_idle(self) -> None:
        """Lets the workers forget the sequences that finished in the last window now, not at the next one."""
        data = self._encoder.encode_releases()
        if data is not None:
            self.check_health()
            self._send(WINDOW, data, "a release message")

    def shutdown(self) -> None:
        """Tells the workers to stop (unless one is gone already: the group is broken) and reaps local ones."""
        if all(w.poll() is None for w in self.workers):
            try:
                self._channel.send(STOP)
            except RuntimeError:
                pass
        stop_workers(self.workers)

    def _send(self, kind: int, data: bytes, what: str) -> None:
        try:
            self._channel.send(kind, data)
        except RuntimeError as error:
            raise GroupError(f"broadcasting {what} to the engine group failed: {error}") from error


@dataclass
class LoadedEngine:
    """A loaded model, ready to run windows."""

    config: EngineConfig  # with max_model_len and max_num_batched_tokens resolved against the model
    model_config: ModelConfig
    tokenizer: object | None  # the Hugging Face tokenizer, None for models without one
    executor: Executor
    guided_decoding: bool  # whether guided decoding (llguidance) is installed on the executor
    channel: GroupChannel | None = None  # a group's control channel (workers receive on it); None: one rank


def load_engine(config: EngineConfig, rank: int | None = None) -> LoadedEngine:
    """Resolves the model, loads this rank's shard and installs guided decoding. `rank` None: the
    process that serves (one rank, or rank 0 of a group, spawning local workers when the environment
    names no rank, as `lockstep serve --tensor-parallel-size T` does); a rank >= 1: a group's worker."""
    source = resolve(config.model, seed=config.seed, download_dir=config.download_dir, revision=config.revision,
                     load_format=config.load_format, tokenizer=config.tokenizer)
    config = config.with_model_limits(source.config.max_position_embeddings)
    tokenizer = source.load_tokenizer() if source.load_tokenizer is not None else None
    world = world_size(config)
    channel = None
    if world == 1:
        executor: Executor = LocalExecutor(ModelRunner(config, source))
    else:
        check_layout(config, source.config)
        device = resolve_device(config.device).type
        leader = os.environ.get("LOCKSTEP_LEADER_ADDR", "127.0.0.1")
        port = int(os.environ.get("LOCKSTEP_RENDEZVOUS_PORT", DEFAULT_PORT))
        workers, listener = [], None
        secret = load_secret()
        if rank is None:
            if "LOCKSTEP_RANK" in os.environ:
                rank = int(os.environ["LOCKSTEP_RANK"])
                if rank != 0:
                    raise GroupError(f"LOCKSTEP_RANK={rank}: only rank 0 serves; other ranks run `lockstep worker`")
            else:
                listener = listen_on_loopback()
                # gloo's connections too stay on loopback (unless the user chose an interface);
                # the spawned workers inherit this.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
                rank, leader, port = 0, "127.0.0.1", listener.getsockname()[1]
                secret = secret or new_secret()  # a group of this process's own: its own secret
                workers = spawn_local_workers(config, port, secret)
        try:
            state, channel = init_group(rank, world, leader, port, device, secret, config.tensor_parallel_size,
                                        listener)
        except GroupError:
            stop_workers(workers)
            raise
        runner = ModelRunner(config, source, state)
        executor = GroupExecutor(runner, workers, channel) if rank == 0 else LocalExecutor(runner)
    # Every rank that samples builds the grammar masks itself (workers install guides too).
    has_guides = guided.install(executor, tokenizer)
    return LoadedEngine(config, source.config, tokenizer, executor, has_guides, channel)
