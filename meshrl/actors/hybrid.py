"""Colocated placement: the trainer and a TorchEngine in one process, taking turns on one device.

``placement=colocated`` spawns one ``HybridWorker`` per trainer rank (``{"procs": trainer.dp}``,
one GPU each on CUDA). Each holds a ``Trainer`` (its FSDP2 shard) and a ``RolloutWorker`` (a
full engine replica), and the controller points both ``Roles.rollouts`` and ``Roles.trainer`` at
that one mesh. The two modes share the device memory instead of holding it twice:

```text
rollout mode  generate / run_episodes run on the engine (the gate is open)
  train_step  close the gate: new generate calls wait (switch_timeout_s), the calls in flight finish
              engine.release_memory: KV cache (and with release_weights the weights) go back to
              torch's caching allocator, so the step's activations and gradients reuse that memory
train mode    PolicyTrainer.train_step on a worker thread (the event loop stays responsive)
  hand-over   at the push that follows (reshard_receive), or at once after a step without one:
              engine.restore_memory (same sizes, mostly the same addresses: CUDA graphs are
              re-captured only if one moved) → LocalHandover: foreach_copy of the trainer's
              parameters, cast to the engine's dtype, into the live engine weights → version
rollout mode  the gate opens; generation resumes at the new version
```

The trainer's persistent memory (parameters, AdamW state, created eagerly here) is allocated
before the engine's, so a KV cache released to training is one free segment afterwards and comes
back at the same address. Metrics of every phase (``colocated/*``: peak GiB allocated, switch
seconds, graph re-captures) ride along in ``train_step``'s metrics: the rollout phase and the
hand-over are those that ended before this step.

With ``colocated.overlap=true`` the two modes become one: the gate stays open and nothing is
released, so the engine keeps generating (the previous version's rollouts, which max_staleness >= 1
admits) while the step trains, on its own CUDA stream in the trainer thread; the hand-over is the
in-place push between two decode steps. Both phases' memory is resident at once (size the KV cache
for it). Measured on one H100 (bench/RESULTS.md) it gains little: while the step runs, the
engine's decode loop, sharing this process's interpreter and the device, moves at a seventh of its
pace.

Simplifications, on purpose: one engine replica per trainer rank, without engine tensor
parallelism; ``release_weights`` needs a push after every step (trainer.sync_interval = 1: the
old weights are gone) and takes turns (no overlap).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import msgspec
import torch

from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.policy_trainer import PolicyTrainer, TrainerConfig
from meshrl.actors.rollout import RolloutWorker
from meshrl.actors.rollout_loops import LoopSettings, RolloutLoops
from meshrl.actors.train_loop import ChunkRunner, ControlLoop, LoopPlan
from meshrl.actors.trainer import Trainer
from meshrl.actors.trainer_checkpoint import init_optimizer_state
from meshrl.cpu import compute_process
from meshrl.engines.torch_engine import TorchEngine, TorchEngineConfig
from meshrl.envs import EnvFactory, EpisodeConfig
from meshrl.mesh import Actor, endpoint
from meshrl.reshard import PushStats, ReshardConfig
from meshrl.reshard.colocated import LocalHandover

__all__ = ["ColocatedConfig", "Colocated", "HybridWorker", "init_optimizer_state"]

_GIB = 2**30


class ColocatedConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The colocated placement's switch between rollout and training (placement=colocated)."""

    release_weights: bool = False
    """rollout → train also frees the engine's weights (not only its KV cache); the hand-over writes
    them back. Saves the engine weights' memory in the train phase; needs trainer.sync_interval=1."""
    switch_timeout_s: float = 600.0
    """Longest wait for the generate calls in flight before a train step, and of a generate call
    for the rollout mode to come back (train step and hand-over)."""
    overlap: bool = False
    """Generation goes on while the trainer steps (the previous version's rollouts, as with
    disaggregated roles): no switch, both phases' memory resident, the step on its own CUDA stream.
    Needs queue.max_staleness >= 1 to gain anything; not with release_weights."""

    def __post_init__(self) -> None:
        if not self.switch_timeout_s > 0:
            raise ValueError(f"colocated.switch_timeout_s must be > 0, got {self.switch_timeout_s}")
        if self.overlap and self.release_weights:
            raise ValueError("colocated.overlap keeps the engine generating through the train step, so its weights "
                             "cannot be released: set colocated.release_weights=false or colocated.overlap=false")


class Colocated:
    """The mode switch of one process: a ``PolicyTrainer`` and a ``TorchEngine`` on one device.

    No Ray and no event loop: ``HybridWorker`` drives it from its actor, ``bench/gpu_colocated.py``
    directly. ``to_train`` → the trainer's step → ``finish_train`` → ``to_rollout(version)``.
    """

    def __init__(self, trainer: PolicyTrainer, engine: TorchEngine, *, release_weights: bool = False,
                 bucket_bytes: int = 512 * 2**20):
        self.trainer, self.engine, self.release_weights = trainer, engine, release_weights
        fresh = trainer.lora is not None  # merged afresh on each push: no stable tensors to keep views of
        self.handover = LocalHandover(trainer.export_parameters, engine, ReshardConfig(bucket_bytes=bucket_bytes),
                                      layout_parameters=trainer.layout_parameters if fresh else None)
        self.mode = "rollout"
        self.device = engine.device
        self._cuda = self.device.type == "cuda"
        self._carry: dict[str, float] = {}  # metrics of the rollout phase, reported by the next step
        self.switches = 0
        self._reset_peak()

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)  # switch times include the device work they queued

    def _reset_peak(self) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / _GIB

    def to_train(self) -> float:
        """Rollout → train (the engine must be idle): free the KV cache (and weights); returns seconds."""
        if self.mode == "train":
            return 0.0
        self._sync()
        start = time.perf_counter()
        if self._cuda:
            self._carry["colocated/rollout_peak_gib"] = self._peak_gib()
        self.engine.release_memory(weights=self.release_weights)
        self._sync()
        seconds = time.perf_counter() - start
        self._carry["colocated/switch_to_train_s"] = seconds
        self._reset_peak()
        self.mode = "train"
        return seconds

    def finish_train(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` of the step just run, with this cycle's ``colocated/*`` ones added."""
        out = {**metrics, **self._carry}
        self._carry = {}
        if self._cuda:
            out["colocated/train_peak_gib"] = self._peak_gib()
            out["colocated/engine_resident_gib"] = self.engine_resident_bytes() / _GIB
        out["colocated/graph_recaptures"] = float(self.engine.graph_recaptures)
        out["colocated/kv_cache_gib"] = self.engine.cache.nbytes / _GIB
        return out

    def engine_resident_bytes(self) -> int:
        """Engine memory held through the train phase (weights unless released; not the KV cache)."""
        if self.release_weights:
            return 0
        return sum(p.numel() * p.element_size() for p in self.engine.model.params.values())

    def to_rollout(self, version: int | None) -> PushStats | None:
        """Train → rollout: restore the engine's memory and, with ``version``, hand the trainer's weights
        over as that version. Without one the engine serves its old weights again (a step with no push
        after it), unless they were released: then the trainer's are written back under the old
        version (only after a failed step, whose update was skipped). In rollout mode it is the
        in-place push alone (between two decode steps)."""
        if self.mode == "rollout":
            return self.handover.write(self.engine, version) if version is not None else None
        self._sync()
        start = time.perf_counter()
        self._reset_peak()  # the rollout phase's peak includes the restore and the hand-over
        released_weights = self.engine.weights_released
        self.engine.restore_memory()
        stats = None
        if version is not None:
            stats = self.handover.write(self.engine, version)
        elif released_weights:
            self.handover.write(self.engine, self.engine.version)
        self._sync()
        self._carry["colocated/switch_to_rollout_s"] = time.perf_counter() - start
        self.mode = "rollout"
        self.switches += 1
        return stats


def _warm_up_matmuls(device: torch.device) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.ones(64, 64, device=device, dtype=dtype)
        (a @ a).sum().item()


class _Gate:
    """Rollout calls run while it is open; closing it waits for the calls in flight (event-loop only)."""

    def __init__(self, timeout_s: float, describe: Callable[[], str] = lambda: ""):
        self.timeout_s = timeout_s
        self.describe = describe  # the engine's state, for the timeout's message
        self.open = asyncio.Event()
        self.open.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.in_flight = 0

    @contextlib.asynccontextmanager
    async def rollout(self, what: str) -> AsyncIterator[None]:
        deadline = time.monotonic() + self.timeout_s
        # The check and the count happen with no await between them: a close() that cleared the
        # gate after wait() returned here is seen (wait_for resumes us an iteration later).
        while not self.open.is_set():
            try:
                # waits for: rollout mode; unblocked by: the hand-over after a train step (or the step alone)
                await asyncio.wait_for(self.open.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise TimeoutError(f"{what} waited {self.timeout_s:g}s (colocated.switch_timeout_s) for the colocated "
                                   "worker to return to rollout mode (its train step and the weight hand-over)") from None
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()

    async def close(self) -> None:
        self.open.clear()
        deadline = time.monotonic() + self.timeout_s
        try:
            while self.in_flight:  # (re-checked: a call may have entered while wait_for handed back)
                # waits for: the generate calls in flight; unblocked by: their completion in the engine
                await asyncio.wait_for(self.idle.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.open.set()
            raise TimeoutError(f"train_step waited {self.timeout_s:g}s (colocated.switch_timeout_s) for {self.in_flight} "
                               f"generate calls in flight to finish before switching to training ({self.describe()})") from None


class HybridWorker(Actor):
    """One rank of the colocated mesh: the ``Trainer`` and ``RolloutWorker`` endpoints the controller
    uses, over one process and one device (module docstring)."""

    def __init__(self, model_path: str, trainer: TrainerConfig, algo: AlgoConfig, engine: TorchEngineConfig,
                 colocated: ColocatedConfig, *, rollout_threads: int = 1, temperature: float, max_new_tokens: int,
                 total_steps: int, environment: EnvFactory | None = None,
                 episode: EpisodeConfig = EpisodeConfig(), scorer: tuple[Any, float] | None = None) -> None:
        if colocated.release_weights and trainer.sync_interval != 1:
            raise ValueError("colocated.release_weights needs trainer.sync_interval=1 (a push after every step)")
        # the trainer's persistent memory first (parameters, optimiser state), then the engine's
        self.trainer = Trainer(model_path, trainer, algo, temperature=temperature, max_new_tokens=max_new_tokens,
                               total_steps=total_steps)
        for opt in (self.trainer.core.optimizer, self.trainer.core.critic_optimizer):
            if opt is not None:
                init_optimizer_state(opt)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer")  # every trainer call, in order
        device = self.trainer.core.dp.device
        self.overlap = colocated.overlap
        # overlap on CUDA: the trainer's kernels on a stream of their own, beside the engine's (the default)
        self._stream = torch.cuda.Stream(device) if self.overlap and device.type == "cuda" else None
        if device.type == "cuda":
            # the trainer thread's cuBLAS workspace is persistent: allocate it now, not inside the KV
            # cache's freed segment during the first step (which would move the cache for good)
            self._pool.submit(_warm_up_matmuls, device).result(timeout=colocated.switch_timeout_s)
        engine = msgspec.structs.replace(engine, contiguous_weights=engine.contiguous_weights or colocated.release_weights)
        self.rollout = RolloutWorker(model_path, engine, rollout_threads, environment=environment, episode=episode,
                                     scorer=scorer)
        compute_process(max(trainer.threads, rollout_threads))
        self.colo = Colocated(self.trainer.core, self.rollout.engine, release_weights=colocated.release_weights)
        self.sync_interval = trainer.sync_interval
        eng = self.rollout.engine
        self._gate = _Gate(colocated.switch_timeout_s, lambda: f"engine: paused={eng.is_paused}, running={eng.num_running}, "
                                                              f"waiting={eng.num_waiting}, version={eng.version}")
        self._switch = asyncio.Lock()  # one train step or hand-over at a time

    async def _on_trainer(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._stream is not None:
            fn = functools.partial(self._on_stream, fn)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _on_stream(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn`` on the trainer's stream, after what the engine's stream has queued (a hand-over's
        copy out of the parameters this step updates), and finished on the device when it returns
        (the next hand-over, on the engine's stream, reads what it wrote)."""
        self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))  # the engine's steps and copies
        with torch.cuda.stream(self._stream):
            out = fn(*args)
        self._stream.synchronize()
        return out

    # ---- rollout side: RolloutWorker's generate, run_episodes and version (composed below) -----

    # ---- train side -----------------------------------------------------------------------------

    @endpoint
    async def train_step(self, batch: Any, version: int) -> dict[str, float]:
        """Switch to training, run one step; switch back now unless a push follows (module docstring)."""
        async with self._switch:
            if self.overlap:  # the engine goes on generating; the push that follows writes in place
                return self.colo.finish_train(await self._on_trainer(self.trainer.train_step, batch, version))
            if self.colo.mode == "rollout":
                await self._gate.close()
                try:
                    self.colo.to_train()
                except BaseException:
                    self._gate.open.set()  # still in rollout mode: let generation go on
                    raise
            try:
                metrics = await self._on_trainer(self.trainer.train_step, batch, version)
            except BaseException:
                self.colo.to_rollout(None)  # (if this fails too, the gate stays closed: see reshard_receive)
                self._gate.open.set()
                raise
            metrics = self.colo.finish_train(metrics)
            if self.trainer.core.steps % self.sync_interval:  # no push after this step: back to rollout
                self.colo.to_rollout(None)
                self._gate.open.set()
            return metrics

    @endpoint
    async def reshard_send(self, version: int) -> PushStats:
        """The trainer's half of ``meshrl.reshard.meshes.push``: nothing to send, ``reshard_receive``
        reads the parameters in this process."""
        return PushStats(version=version, seconds=0.0, bytes=0)

    @endpoint
    async def reshard_receive(self, version: int) -> PushStats:
        """The hand-over: the trainer's weights into the engine as ``version``, and back to rollout mode."""
        async with self._switch:
            # A failed hand-over keeps the gate closed: the engine may hold restored-but-unwritten or half-
            # written weights, so rollout calls wait (and time out naming the switch) until one succeeds
            in_rollout = self.colo.mode == "rollout"
            try:
                stats = self.colo.to_rollout(version)
            except BaseException:
                if in_rollout:  # an in-place push with the gate open (a resume's, the run's last): close it,
                    self._gate.open.clear()  # and end what generates on weights that may mix two versions
                    self.colo.engine.abort_all()
                raise
            self._gate.open.set()
            return stats

    # gather_weights, export_weights, save_hf, save_checkpoint: Trainer's, on the trainer thread (below)

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        steps = await self._on_trainer(self.trainer.load_checkpoint, path)
        self.colo.handover.refresh()  # in case loading replaced parameter tensors instead of writing them
        return steps

    @endpoint
    async def colocated_state(self) -> dict[str, Any]:
        """Mode, switches done, in-flight rollout calls, KV cache released or not, graph re-captures."""
        return {"mode": self.colo.mode, "switches": self.colo.switches, "in_flight": self._gate.in_flight,
                "kv_released": self.rollout.engine.memory_released, "graph_recaptures": self.rollout.engine.graph_recaptures,
                "version": self.rollout.engine.version}


def _on_trainer_thread(method: Callable[..., Any]) -> Any:
    """``Trainer``'s endpoint ``method`` as HybridWorker's: the same call, on the trainer thread."""

    @functools.wraps(method)
    async def call(self: HybridWorker, *args: Any) -> Any:
        return await self._on_trainer(functools.partial(method, self.trainer), *args)

    return endpoint(call)


def _gated(method: Callable[..., Any]) -> Any:
    """``RolloutWorker``'s endpoint ``method`` as HybridWorker's: the same call, in rollout mode only
    (it waits while the process trains; ``_Gate``)."""

    @functools.wraps(method)
    async def call(self: HybridWorker, *args: Any) -> Any:
        async with self._gate.rollout(method.__name__):
            return await method(self.rollout, *args)

    return endpoint(call)


async def _play_scored(self: HybridWorker, job: Any, requests: Any, *, within_s: float | None = None,
                       by_ref: bool | int = False) -> Any:
    """``RolloutWorker.play_scored``: generated in rollout mode (``_Gate``), scored outside it (a train
    step may begin meanwhile)."""
    async with self._gate.rollout("play_scored"):
        generations = await self.rollout.play(requests)
    return await self.rollout.score(job, within_s, by_ref, **generations)


async def _run_loops(self: HybridWorker, sampler: Any, rewards: Any, reference: Any, settings: LoopSettings,
                     rollout: Any, seed: int) -> None:
    """``RolloutWorker.run_loops``: the loops generate in rollout mode only (``_Gate``), and score
    outside it."""

    async def play(requests: Any) -> Any:
        async with self._gate.rollout("play"):
            return await self.rollout.play(requests)

    loops = RolloutLoops(play, functools.partial(_play_scored, self), self.rollout.request_maker(rollout, seed), sampler,
                         rewards, reference, settings)
    await self.rollout.loop_host.run(loops)


class _Host:
    """The colocated process's trainer as ``ChunkRunner`` sees it: its calls run on the actor's loop
    (the switch between the modes), the chunk on a thread of its own."""

    def __init__(self, worker: HybridWorker, loop: asyncio.AbstractEventLoop) -> None:
        self.worker, self.loop = worker, loop
        self.rank = worker.trainer.core.dp.rank

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def train(self, shares: Any, version: int) -> dict[str, float]:
        return self._call(self.worker.train_step(shares, version))

    def send(self, version: int) -> PushStats:
        return self._call(self.worker.reshard_receive(version))  # the hand-over, in place

    def agree(self, failed: bool) -> bool:
        return self.worker.trainer.agree(failed)


async def _train_connect(self: HybridWorker, sampler: Any, engines: Any, plan: LoopPlan) -> None:
    """``Trainer.train_connect``: the chunks run on a thread, the switches on this actor's loop."""
    self.train_loop = ChunkRunner(_Host(self, asyncio.get_running_loop()), plan, sampler, engines,
                            ControlLoop(asyncio.get_running_loop()))


async def _place(self: HybridWorker, step: int, version: int) -> None:
    self.train_loop.place(step, version)


async def _run_steps(self: HybridWorker, until: int, *, prefetch: bool = True, settle: bool = False,
                     publish_last: bool = True) -> dict[str, Any]:
    """``Trainer.run_steps``."""
    return await asyncio.to_thread(self.train_loop.run, until, prefetch=prefetch, settle=settle, publish_last=publish_last)


async def _push_version(self: HybridWorker, version: int, publish: bool = False) -> dict[str, float]:
    """``Trainer.push_version``."""

    def push() -> dict[str, float]:
        self.train_loop.push(version, publish=publish)
        self.train_loop.version = version
        return self.train_loop.phases()

    return await asyncio.to_thread(push)


async def _settle_push(self: HybridWorker) -> None:
    """``Trainer.settle_push``: a colocated push is done when it returns."""


async def _pause_loops(self: HybridWorker, timeout_s: float) -> int:
    """``RolloutWorker.pause_loops``."""
    return await self.rollout.loop_host.pause(timeout_s)


async def _version(self: HybridWorker) -> int:
    """The policy version the engine serves."""
    return self.rollout.engine.version


for _name in ("gather_weights", "export_weights", "save_hf", "save_checkpoint"):
    setattr(HybridWorker, _name, _on_trainer_thread(getattr(Trainer, _name)))
for _name in ("generate", "run_episodes"):
    setattr(HybridWorker, _name, _gated(getattr(RolloutWorker, _name)))
HybridWorker.version = endpoint(_version)
HybridWorker.play_scored = endpoint(_play_scored)
HybridWorker.run_loops = endpoint(_run_loops)
HybridWorker.pause_loops = endpoint(_pause_loops)
for _fn in (_train_connect, _place, _run_steps, _push_version, _settle_push):
    setattr(HybridWorker, _fn.__name__[1:], endpoint(_fn))
