"""The train loop, run by the trainer itself: chunks of steps that the controller hands out.

```text
run_steps(until)   on every dp rank, up to train step `until` (the next checkpoint, evaluation, the
                   end, or run.chunk_steps), or to a STOP from the sampler:
  sampler.step_batch(s)  waits for: samples_per_step samples within max_staleness of the step's
                         version; unblocked by: the rollout workers' puts. Asked while step s - 1
                         trains; every rank gets the same Shares and fetches only its own share
  train_step             each rank its share; the metrics are global
  every sync_interval steps: version += 1, the weights to every engine (the transport chosen at start)
    distributed    every rank sends its own shards; rank 0 armed the engines' receives while the
                   step computed; at max_staleness >= 1 (staged, separate engines) the loop goes on
                   once sent and the engines flip on their own time (settled before the next arm)
    object_store   (gathered onto rank 0) rank 0 exports, one ray.put, every engine loads it
    sglang         every rank gathers, rank 0 sends into every server
    colocated      each rank hands its weights to its own engine, in place
  sampler.set_version(v) by rank 0, once every engine serves v; not the version before a checkpoint
                         (the controller publishes it after the checkpoint)
returns: each step's record (metrics, waits, wall-clock spans, the groups trained), the step and the
         version, whether a STOP ended it; a step or a push that failed ends the chunk with its failure (the controller restarts a
         rollout worker in place and pushes again, or the run ends)
```

The chunk runs synchronously on the trainer's thread (``ChunkRunner``); rank 0 waits for the engines
and the sampler on an event loop (``EngineSide``): a thread of its own in a ``Trainer``, the actor's
loop in a ``HybridWorker``. Between chunks the controller checkpoints, evaluates, restarts rollout
workers and stops; the batch asked for the step after a chunk stays asked into the next one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Literal

import msgspec

from meshrl.mesh import ActorFailure, bounded
from meshrl.mesh.errors import find_cause
from meshrl.reshard import PushStats
from meshrl.reshard.meshes import pushed
from meshrl.reshard.object_store import apply_weights
from meshrl.reshard.push import ReshardError

__all__ = ["ChunkRunner", "ControlLoop", "EngineSide", "LoopPlan"]


class LoopPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the trainer's loop needs to know of the run (the controller builds it once)."""

    samples_per_step: int
    sync_interval: int
    dp: int
    step_timeout_s: float
    transport: Literal["distributed", "object_store", "sglang", "colocated"]
    arms: bool = False
    """distributed: the engines post their receives while the step computes (staged, separate engines)."""
    detached: bool = False
    """distributed, armed, max_staleness >= 1: a push returns once sent; the engines flip on their own."""
    gathers: bool = False
    """object_store: the full tensors are gathered onto rank 0 first (dp > 1 or CUDA)."""
    reshard_timeout_s: float = 300.0
    chunk_s: float = 2.0
    """A chunk also ends after about this long, at a step that pushed (run.chunk_s)."""


class ControlLoop:
    """An event loop on a thread of its own (a ``Trainer`` is a sync actor): where rank 0 awaits the
    engines' and the sampler's calls while its own thread computes."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="trainer-control", daemon=True).start()
        self.loop = loop

    def run(self, coro: Any, timeout_s: float, what: str) -> Any:
        """``coro`` on the loop; its result (this thread waits at most ``timeout_s``)."""
        done = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return done.result(timeout_s)
        except concurrent.futures.TimeoutError:
            done.cancel()
            raise TimeoutError(f"the trainer gave up after {timeout_s:.0f}s waiting for {what}") from None


class EngineSide:
    """Trainer rank 0's half of a push: the engines' calls and the sampler's ``set_version``
    (coroutines on the ``ControlLoop``)."""

    def __init__(self, plan: LoopPlan, sampler: Any, engines: Any) -> None:
        self.plan, self.sampler, self.engines = plan, sampler, engines
        self.timeout_s = plan.step_timeout_s
        self._armed: asyncio.Task | None = None
        self._receiving: asyncio.Future | None = None
        self._flipping: asyncio.Future | None = None
        """A detached push whose engines may not all serve its version yet."""
        self._flip_error: BaseException | None = None
        self.published = 0
        self.phases: dict[str, float] = {}
        """The last finished push's parts (``sync/send_s``, ...), taken by the record that follows it."""

    async def publish(self, version: int) -> None:
        await bounded(self.sampler.set_version.call_one(version), self.timeout_s, "the sampler to take the new version")
        self.published = max(self.published, version)

    async def arm(self, version: int) -> None:
        """Start posting the engines' receives of ``version`` (returns at once; ``plan.arms``)."""
        self._armed = asyncio.ensure_future(self._arm(version))

    async def _arm(self, version: int) -> None:
        await self.settle()  # the engines take one version at a time
        t = self.timeout_s + self.plan.reshard_timeout_s
        await bounded(self.engines.reshard_arm.call(version, t), t, f"the engines to post their receives of v{version}")

    async def begin(self, version: int) -> None:
        """Before this rank sends ``version``: the engines' receives are posted (distributed)."""
        if self._armed is not None:
            armed, self._armed = self._armed, None
            await armed
        else:
            await self.settle()
        if self.plan.transport == "distributed":
            self._receiving = asyncio.ensure_future(bounded(self.engines.reshard_receive.call(version), self.timeout_s,
                                                            f"the engines to receive v{version}"))

    async def end(self, version: int, sent: PushStats | None, started: float, *, publish: bool) -> None:
        """After every rank sent ``version`` (or handed it over, colocated): the engines serve it
        (detached: on their own time), then the sampler learns it if ``publish``."""
        if self.plan.transport == "distributed":
            receiving, self._receiving = self._receiving, None
            flip = self._flip(receiving, version, sent, started, publish)
            if self.plan.detached:
                self._flipping = asyncio.ensure_future(flip)
                return
            await flip
        elif publish:
            await self.publish(version)

    async def _flip(self, receiving: Any, version: int, sent: PushStats | None, started: float, publish: bool) -> None:
        try:
            got = await receiving
        except Exception as exc:
            raise _death_or(exc, ReshardError(f"push of v{version} failed: {type(exc).__name__}: {exc}")) from exc
        stats = pushed(version, [] if sent is None else [sent], list(got.values()), started)
        self.phases = {f"sync/{k}": v for k, v in stats.phases.items()} | {"sync/push_s": stats.seconds}
        if publish:
            await self.publish(version)

    async def load(self, named: dict[str, Any], version: int, *, publish: bool) -> None:
        """object_store: ``named`` (rank 0's full tensors) into every engine as ``version``."""
        await self.settle()
        stats = await apply_weights(named, self.engines, version, timeout_s=self.timeout_s)
        self.phases = {"sync/push_s": stats.seconds, "sync/bytes": float(stats.bytes)}
        if publish:
            await self.publish(version)

    async def pushed_sglang(self, version: int, stats: PushStats, started: float, *, publish: bool) -> None:
        """After a push into the SGLang servers: its parts, with the samples its pause made the
        engines send again; then the sampler learns ``version`` if ``publish``."""
        reissued = await bounded(self.engines.reissued.call(), self.timeout_s, "the rollout workers' re-issued counts")
        self.phases = {"sync/push_s": time.perf_counter() - started, "sync/bytes": float(stats.bytes),
                       "sync/reissued_samples": float(sum(reissued.values())),
                       **{f"sync/{k}": v for k, v in stats.phases.items()}}
        if publish:
            await self.publish(version)

    async def settle(self) -> None:
        """Until every engine serves the newest pushed version; a failed detached push raises here,
        for every caller."""
        if self._flip_error is not None:
            raise self._flip_error
        if self._flipping is None:
            return
        flipping = self._flipping
        try:
            await flipping
        except BaseException as exc:
            self._flip_error = exc
            raise
        finally:
            if self._flipping is flipping:
                self._flipping = None

    async def blame(self, version: int, exc: BaseException) -> BaseException:
        """What a failed push of ``version`` raises: an engine's death (the receive that failed with
        it, waited for a little), which the controller answers (a restart in place, a resume), or
        ``exc`` (the send's own failure: a peer that closed the connection, ...)."""
        if self.plan.transport == "sglang":  # a server that exited says so, naming its log
            try:
                await bounded(self.engines.check_engine.call(), 60, "the rollout workers to check their servers")
            except Exception as dead:
                return RuntimeError(f"push of v{version} failed: {dead}")
        receiving = self._receiving
        if receiving is not None:
            await asyncio.wait([receiving], timeout=10)
            if receiving.done() and not receiving.cancelled() and receiving.exception() is not None:
                return _death_or(receiving.exception(), exc)
        return _death_or(exc, exc)

    async def disarm(self) -> None:
        """Undo an ``arm`` or a receive whose send never came (a step or a push failed)."""
        for task in (self._armed, self._receiving):
            if task is not None:
                task.cancel()
        if self._armed is not None or self._receiving is not None:
            self._armed = self._receiving = None
            try:
                await self.engines.reshard_disarm.call().within(10)
            except Exception:
                pass

    async def forget(self) -> None:
        """A rollout worker was re-created (the controller rejoins the group): the failed push is pushed again."""
        await self.disarm()
        self._flipping, self._flip_error = None, None


class ChunkRunner:
    """One trainer rank's train loop (module docstring). ``host`` is the process's trainer: its
    ``rank``, ``train(shares, version)``, ``send(version)`` (distributed: its shards; colocated: the
    hand-over), ``gather()``, ``export()``, ``sglang_push(version)`` and ``agree(failed)`` (whether
    any dp rank failed)."""

    def __init__(self, host: Any, plan: LoopPlan, sampler: Any, engines: Any, control: ControlLoop) -> None:
        self.host, self.plan, self.sampler, self.control = host, plan, sampler, control
        self.engine_side = EngineSide(plan, sampler, engines) if host.rank == 0 else None
        self.step = self.version = 0
        self._asked: tuple[int, int, Any] | None = None
        """(step, version, the sampler's answer to come) of the batch asked for and not yet trained."""

    def place(self, step: int, version: int) -> None:
        """The run's position (a resume's, or the start's); a batch asked for earlier is dropped."""
        self.step, self.version, self._asked = step, version, None

    def _on_loop(self, coro: Any, what: str) -> Any:
        return self.control.run(coro, self.plan.step_timeout_s + self.plan.reshard_timeout_s + 60, what)

    def _ask(self, step: int, version: int) -> None:
        pausable = (step - 1) % self.plan.sync_interval == 0
        self._asked = (step, version, self.sampler.step_batch.call_one(
            step, self.plan.samples_per_step, version, shares=self.plan.dp, timeout=self.plan.step_timeout_s,
            pausable=pausable))

    def _take(self, step: int, version: int) -> Any:
        """Step ``step``'s batch (asked now unless it was); None: STOP."""
        if self._asked is None or self._asked[0] != step:
            self._ask(step, version)
        asked_step, asked_at, answer = self._asked
        self._asked = None
        if asked_at != version:
            raise RuntimeError(f"the batch of step {asked_step} was asked for at version {asked_at}, the step trains at {version}")
        return answer.get(timeout=self.plan.step_timeout_s + 30)

    def run(self, until: int, *, prefetch: bool, settle: bool, publish_last: bool) -> dict[str, Any]:
        """Train steps up to ``until`` (module docstring). ``prefetch``: ask for the batch of the step
        after ``until`` while it trains; ``settle``: return once every engine serves the last
        version; ``publish_last``: tell the sampler the version pushed after step ``until`` (not
        when a checkpoint follows it)."""
        sync, records, failure, began, held = self.plan.sync_interval, [], None, time.time(), False
        while self.step < until:
            t0 = time.time()
            shares = self._take(self.step + 1, self.version)
            if shares is None:  # the controller holds the batches: the chunk ends here
                until, held = self.step, True
                break
            t1 = time.time()
            pushes = (self.step + 1) % sync == 0
            if pushes and self.plan.arms and self.engine_side is not None:
                self._on_loop(self.engine_side.arm(self.version + 1), "the engines' receives to be posted")
            if self.step + 1 < until or prefetch:
                self._ask(self.step + 2, self.version + pushes)  # found while this step trains
            try:
                metrics = self.host.train(shares, self.version)
            except Exception as exc:  # the records so far are the run's; the controller raises it
                if self.engine_side is not None:
                    self._on_loop(self.engine_side.disarm(), "the engines to withdraw their receives")
                failure = exc
                break
            t2 = time.time()
            self.step += 1
            if pushes:
                try:
                    self.push(self.version + 1, publish=publish_last or self.step < until)
                except Exception as exc:
                    failure = exc
                else:
                    self.version += 1
            phases = self.phases()  # the last push that finished (a detached one's come with a later step)
            t3 = time.time()
            records.append({"step": self.step, "version": self.version, **metrics, "batch_wait_s": t1 - t0,
                            "sync_time_s": t3 - t2, "step_time_s": t3 - t0, **phases, "spans": (t0, t1, t2, t3),
                            "groups": list(shares.groups)})
            if failure is not None:
                break
            if self.step % sync == 0 and time.time() - began > self.plan.chunk_s:
                break  # records now; the batch of the next step stays asked for
        if settle and failure is None and self.step >= until:
            try:
                self.settle()
            except Exception as exc:
                failure = exc
        published = self.engine_side.published if self.engine_side is not None else 0
        return {"records": records, "step": self.step, "version": self.version, "failure": failure,
                "published": published, "held": held}

    def phases(self) -> dict[str, float]:
        """The parts of the last push that finished since the last call (rank 0; ``sync/send_s``, ...)."""
        if self.engine_side is None:
            return {}
        phases, self.engine_side.phases = self.engine_side.phases, {}
        return phases

    def push(self, version: int, *, publish: bool) -> None:
        """The current weights to every engine as ``version`` (every rank). A failure on any rank
        raises on every rank."""
        side, plan, started = self.engine_side, self.plan, time.perf_counter()
        failed: BaseException | None = None
        try:
            if plan.transport in ("distributed", "colocated"):
                if side is not None:
                    self._on_loop(side.begin(version), f"the engines to post their receives of v{version}")
                sent = self.host.send(version)
                if side is not None:
                    self._on_loop(side.end(version, sent, started, publish=publish), f"the engines to take v{version}")
            elif plan.transport == "object_store":
                if plan.gathers:
                    self.host.gather()
                if side is not None:
                    self._on_loop(side.load(self.host.export(), version, publish=publish), f"the engines to load v{version}")
            else:
                stats = self.host.sglang_push(version)
                if side is not None:
                    self._on_loop(side.pushed_sglang(version, stats, started, publish=publish),
                                  "the SGLang servers' count of re-issued samples")
        except BaseException as exc:
            failed = exc
            if side is not None and isinstance(exc, Exception):
                failed = self._on_loop(side.blame(version, exc), f"the engines' side of the failed push of v{version}")
        if plan.dp > 1 and self.host.agree(failed is not None) and failed is None:
            failed = RuntimeError(f"push of v{version} failed on another trainer rank")
        if failed is not None:
            if side is not None:
                self._on_loop(side.disarm(), "the engines to withdraw their receives")
            raise failed

    def settle(self) -> None:
        """Until every engine serves the newest pushed version (rank 0; the others have nothing to wait for)."""
        if self.engine_side is not None:
            self._on_loop(self.engine_side.settle(), "the engines to serve the last pushed version")

    def forget(self) -> None:
        if self.engine_side is not None:
            self._on_loop(self.engine_side.forget(), "the engines to withdraw their receives")


def _death_or(exc: BaseException, otherwise: BaseException) -> BaseException:
    """The ``ActorFailure`` behind ``exc``, noted as the push's; else ``otherwise``. Raised as it is:
    a cause does not survive the trip to the controller."""
    dead = find_cause(exc, (ActorFailure,))
    if dead is None:
        return otherwise
    dead.add_note(f"found by the trainer's weight push ({type(otherwise).__name__}: {str(otherwise)[:200]})")
    return dead
