"""Pushing one policy version: the participant object each process of a push holds.

A ``Resharder`` lives in every process that takes part in a push: the trainer's ranks (sources)
and the engines' ranks (destinations), or both at once when they are colocated. All of them
build it from the same ``SourceLayout``, ``DestLayout`` and ``GroupRanks`` (so they compute the
same cached plan without talking), join one process group built SGLang's way
(``meshrl.mesh.join_process_group``), and then, per version:

```text
trainer rank i:   resharder.send(local_tensors(model.named_parameters()))          (blocks)
engine rank j:    await resharder.receive(engine, version)
                    engine.begin_weight_update()       stage; generation continues on v
                    run_plan(...) in a worker thread   slices land in engine.staged_params()
                    engine.end_weight_update(version)  one synchronous copy between two steps
                  on any failure or timeout: engine.abort_weight_update() -> still on v, and
                  ReshardError says which bucket/peer and why
```

Armed receive (``arm``, staged only): the engine posts its receive of ``version`` ahead of time,
while the trainer is still computing it. A worker thread stages the copy and waits on the
group's store for the trainer's "sending v" key (``send``, or ``receive`` with ``sources`` on a
colocated trainer rank, sets it first), then runs the plan at
once, so the trainer's send no longer waits for the engine's event loop to get round to a
``receive`` call between decode steps and result handling (≈ 50 ms at 1.5B under load); the
``receive`` that follows only waits for that thread and flips. On CUDA a staged receive runs on
a stream of its own, ordered only after its staging copy: NCCL orders a collective after the
caller's current stream, and the engine's stream holds every decode step its host loop has queued.

Versioned and atomic: a version becomes visible only in ``end_weight_update``, which runs on the
engine's event loop between two decode steps, so no step mixes versions; a failed push leaves
the staging copy behind and the engine on v. ``write_in_place`` is the colocated shortcut when a
destination rank's sources all live in its own process: one ``_foreach_copy_`` into the live
parameters, run synchronously between steps (no staging; nothing remote can fail midway).

Simplifications, on purpose: the engine side stages a full copy of its parameters (memory:
weights x 2 during a push); a timed-out transfer thread cannot be killed, it ends with the
group's own timeout, and the group should then be rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import threading
import time
from typing import Any, Callable, Literal, Mapping, Protocol

import msgspec
import torch

from meshrl.reshard.layout import DestLayout, SourceLayout, to_slices
from meshrl.reshard.plan import Plan, plan_transfers
from meshrl.reshard.transport import GroupRanks, run_plan


class ReshardConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How weights move from the trainer to the engines."""

    transport: Literal["distributed", "object_store"] = "distributed"
    """distributed: each trainer rank sends its shards into the engines' layout over a process
    group (the plan below); object_store: full tensors gathered on trainer rank 0 and fetched by
    every engine from Ray's object store (no process group needed)."""
    bucket_bytes: int = 512 * 2**20
    """Most bytes in one bucket (the unit of pipelining and of temporary memory)."""
    timeout_s: float = 300.0
    """Bound on one push in each process, and on the group's rendezvous and collectives."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto: NCCL when the device is CUDA, else gloo."""
    group_name: str = "meshrl_reshard"
    """Name of the transfer group (its store prefix); unique per concurrent group."""
    depth: int = 2
    """Buckets in flight per process (2: pack the next while the last sends)."""
    receive_depth: int = 0
    """Buckets in flight on a rank that only receives; 0: all of them, posted at once. Its thread
    then needs the GIL only to post and to unpack, not between buckets, where the sender would wait
    for it while the engine's event loop holds the GIL (result pickling in one long C call, which no
    switch interval interrupts; bench/push_gil_probe.py: 408 vs 586 ms on gloo). Costs the
    temporaries of every packed message at once (the small tensors: large ones land in place)."""
    apply: Literal["staged", "in_place"] = "staged"
    """How an engine takes a version. staged: received into a staging copy while it keeps generating
    on v, then one copy into the live weights between two steps (a failed push leaves v intact;
    costs a copy of the weights in memory and time). in_place: the engine pauses (its sequences
    kept), receives straight into its live weights and resumes on v+1 (SGLang's way: no copy, no
    extra memory, but generation waits for the transfer, and a push that fails midway leaves the
    engine paused on a mix of versions, never generating from it)."""

    high_priority_stream: bool = True
    """NCCL: the group's kernels run on high-priority CUDA streams, so a transfer into a busy engine
    gets SMs ahead of its queued kernels (1.5B on two H200s at max_staleness=1: the transfer's wait
    fell from 57-66 ms to 36-38 ms; 6 ms into an idle engine)."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1 or not 0 < self.timeout_s < math.inf or self.depth < 1 or self.receive_depth < 0:
            raise ValueError(f"reshard: bucket_bytes and depth must be >= 1, receive_depth >= 0 and timeout_s a finite "
                             f"number of seconds > 0, got {self.bucket_bytes}, {self.depth}, {self.receive_depth} and "
                             f"{self.timeout_s}")


class PushStats(msgspec.Struct):
    """What one push did, as seen by one process (or summed by the controller)."""

    version: int
    """The policy version pushed."""
    seconds: float
    """Wall time of the push."""
    bytes: int
    """Bytes this process sent or received (summed over engines by the controller)."""
    phases: dict[str, float] = {}
    """Seconds of the push's parts as this process saw them (e.g. transfer_s, apply_s; the
    controller keeps the slowest process's value of each, plus send_s and receive_s)."""


class ReshardError(RuntimeError):
    """A push failed; the engine that raised it still serves its previous version."""


class ReshardTarget(Protocol):
    """The engine side of a push (``TorchEngine`` implements it)."""

    @property
    def version(self) -> int: ...

    async def begin_weight_update(self) -> None: ...

    def staged_params(self) -> dict[str, torch.Tensor]: ...

    async def end_weight_update(self, version: int) -> None: ...

    async def abort_weight_update(self) -> None: ...

    def write_params(self, write: Callable[[dict[str, torch.Tensor]], None], version: int) -> None: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    def live_params(self) -> dict[str, torch.Tensor]: ...

    def set_version(self, version: int) -> None: ...


@dataclasses.dataclass
class _Receive:
    """A staged receive under way (started by ``receive`` or by ``arm``): its transfer thread."""

    version: int
    task: asyncio.Future  # of run_plan's (sent, received)
    stop: threading.Event
    timings: dict[str, float]
    started_at: float
    armed: bool
    wake: threading.Event
    """Set by ``receive`` (the push is under way: the trainer signals any moment) and by a withdrawal."""


_SIGNAL_POLL_S = 0.002
"""How often an armed receive looks for the trainer's signal once the push is under way (one store
round trip each)."""
_IDLE_POLL_S = 0.05
"""How often it looks before (a store round trip every 2 ms for the whole step cost an engine 5% of
a core, and the trainer's process, which serves the store, as much again)."""


class Resharder:
    """One process's part in pushing versions from a source layout to a destination layout."""

    def __init__(self, source: SourceLayout, dest: DestLayout, ranks: GroupRanks, group_rank: int, group: Any = None,
                 config: ReshardConfig = ReshardConfig(), device: torch.device | str = "cpu"):
        if source.num_ranks != len(ranks.src) or dest.num_ranks != len(ranks.dst):
            raise ValueError(f"GroupRanks has {len(ranks.src)} source / {len(ranks.dst)} destination ranks, the "
                             f"layouts {source.num_ranks} / {dest.num_ranks}")
        if group is None and ranks.world_size > 1:
            raise ValueError("a group of more than one process needs a process group: use Resharder.join")
        self.source, self.dest, self.ranks, self.group_rank = source, dest, ranks, group_rank
        self.group, self.config, self.device = group, config, torch.device(device)
        self.plan: Plan = plan_transfers(source, dest, config.bucket_bytes, ranks.same_process())
        self.src_rank = next((s for s, g in enumerate(ranks.src) if g == group_rank), None)
        self.dst_rank = next((d for d, g in enumerate(ranks.dst) if g == group_rank), None)
        self._receiving: _Receive | None = None
        self._broken: str | None = None  # why a transfer failed: the group cannot carry another (_run)
        self._stream: Any = None  # staged receives' CUDA stream (_run)
        self._signals: Any = None  # the group's store, under "push/": "v<N>" means "sending v<N> now"
        if group is not None:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _get_process_group_store

            self._signals = dist.PrefixStore("push/", _get_process_group_store(group))

    @classmethod
    def join(cls, source: SourceLayout, dest: DestLayout, ranks: GroupRanks, group_rank: int, master_addr: str,
             master_port: int, config: ReshardConfig = ReshardConfig(), device: torch.device | str = "cpu"
             ) -> "Resharder":
        """Join the transfer group (group rank 0 hosts its store at ``master_addr:master_port``)."""
        import torch.distributed as dist

        from meshrl.groups import join_process_group

        device = torch.device(device)
        backend = config.backend if config.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        pg = join_process_group(config.group_name, group_rank, ranks.world_size, master_addr, master_port,
                                backend=backend, timeout=config.timeout_s, high_priority=config.high_priority_stream)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        probe = torch.ones(1, device=device)
        # Every rank at once: NCCL builds its communicator here, not inside the first bucket's p2p.
        dist.all_reduce(probe, group=pg)
        if probe.item() != ranks.world_size:
            raise RuntimeError(f"reshard group {config.group_name!r}: warm-up all-reduce gave {probe.item()}")
        return cls(source, dest, ranks, group_rank, pg, config, device)

    def close(self) -> None:
        """Leave the transfer group (an armed receive still waiting for its signal gives up, but its
        staging copy stays open on the engine: ``disarm`` first drops it)."""
        import torch.distributed as dist

        if self._receiving is not None:
            self._receiving.stop.set()
            self._receiving.wake.set()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def _check_sources(self, sources: Mapping[str, torch.Tensor]) -> None:
        bad = []
        for t in self.source.tensors:
            box = t.owned[self.src_rank]
            want = tuple(b - a for a, b in box) if box else (0,)
            got = sources.get(t.name)
            if got is None or (box and tuple(got.shape) != want):
                bad.append((t.name, None if got is None else tuple(got.shape), want))
        if bad:
            raise ReshardError(f"source rank {self.src_rank}: local tensors differ from the layout (name, got, "
                               f"expected): {bad[:3]}")

    def _run(self, sources: Mapping[str, torch.Tensor] | None, buffers: Mapping[str, torch.Tensor] | None,
             timings: dict[str, float] | None = None, after: Any = None) -> tuple[int, int]:
        """Run this process's share of the plan. ``after``: a CUDA event recorded when the staging copy
        was made; the transfer then runs on a stream of its own that waits only for that event."""
        self._check_intact()
        run = functools.partial(run_plan, self.plan, self.ranks, self.group_rank, self.group, sources=sources,
                                buffers=buffers, device=self.device, timeout_s=self.config.timeout_s,
                                depth=self._depth(sources), timings=timings)
        try:
            return self._run_on_stream(run, after)
        except Exception as exc:
            # a collective failed or timed out (gloo then closes the pair), or this rank stopped between
            # two of them: either way the ranks are out of step, and every later push would fail too,
            # naming a timeout or a crashed peer that are not the cause
            self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def _check_intact(self) -> None:
        if self._broken is not None:
            raise ReshardError(f"the transfer group {self.config.group_name!r} broke in an earlier push "
                               f"({self._broken[:300]}); a process group does not recover from a failed or "
                               "timed-out collective: restart the run (run.resume=latest continues it)")

    def _run_on_stream(self, run: Callable[[], tuple[int, int]], after: Any) -> tuple[int, int]:
        if after is None:
            return run()
        # NCCL orders each collective after the current stream's queued work. On the engine's stream
        # that is every decode step its host loop has queued (15-40 ms at 1.5B with fixed-length
        # outputs, when the loop never waits on the device): the first bucket waited for all of
        # them. The staging copy needs nothing from that stream beyond what `after` marks.
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(after)
            return run()

    def _depth(self, sources: Mapping[str, torch.Tensor] | None) -> int:
        if sources is not None or self.src_rank is not None:
            return self.config.depth  # a sender packs every bucket in flight: keep that memory bounded
        return self.config.receive_depth or max(1, len(self.plan.buckets))

    def send(self, sources: Mapping[str, torch.Tensor], version: int = -1) -> PushStats:
        """The trainer side: this rank's local tensors (``layout.local_tensors``) to the engines. Blocks."""
        if self.src_rank is None:
            raise ReshardError(f"group rank {self.group_rank} holds no source rank")
        self._check_intact()
        start = time.perf_counter()
        self._check_sources(sources)
        checked = time.perf_counter()
        try:
            self._signal(version)
            timings: dict[str, float] = {}
            sent, _ = self._run(sources, None, timings)
        except Exception as exc:
            raise ReshardError(f"push of v{version} failed on source rank {self.src_rank}: {exc}") from exc
        end = time.perf_counter()
        return PushStats(version=version, seconds=end - start, bytes=sent,
                         phases={"send_check_s": checked - start, "send_transfer_s": end - checked,
                                 **{f"send_{k}": v for k, v in timings.items()}})

    async def receive(self, target: ReshardTarget, version: int, *, sources: Mapping[str, torch.Tensor] | None = None
                      ) -> PushStats:
        """The engine side: stage the whole version, then make it visible at once (module docstring).

        ``sources``: this process's own source tensors when it is also a trainer rank.
        """
        if self.dst_rank is None:
            raise ReshardError(f"group rank {self.group_rank} holds no destination rank")
        if self._receiving is None:  # (an armed receive that failed has its own error for finish to raise)
            self._check_intact()  # before an in-place receive pauses the engine
        if sources is not None:
            if self.src_rank is None:
                raise ReshardError(f"group rank {self.group_rank} holds no source rank: receive(sources=None)")
            self._check_sources(sources)
            self._signal(version)  # a source rank, as in send: armed receivers of other processes wait for it
        start = time.perf_counter()
        if self._receiving is None and self.config.apply == "in_place":
            received, phases = await self._receive_in_place(target, version, sources)
        else:
            if self._receiving is None:  # not armed: start it now
                self._receiving = await self._start_receive(target, version, sources=sources)
            received, phases = await self._finish_receive(target, version)
        return PushStats(version=version, seconds=time.perf_counter() - start, bytes=received, phases=phases)

    async def arm(self, target: ReshardTarget, version: int, *, timeout_s: float) -> None:
        """Post this engine's receive of ``version`` now, for a ``send`` that comes later (module docstring).

        Returns at once: staging buffers are ready and a thread waits (up to ``timeout_s``) for the
        trainer's signal. The ``receive(target, version)`` that follows completes it; ``disarm``
        withdraws it. Staged apply and pure destination ranks only (a rank that also sends would
        need its sources now). Costs the staging copy's memory from now on rather than from the push.
        """
        self._check_intact()
        if self.config.apply != "staged":
            raise ReshardError(f"arm: needs reshard.apply=staged, not {self.config.apply!r} (in place would pause "
                               "the engine from now until the push)")
        if self.dst_rank is None or self.src_rank is not None or self._signals is None:
            raise ReshardError(f"arm: group rank {self.group_rank} must be a destination rank only, in a group of "
                               "several processes")
        if self._receiving is not None:
            raise ReshardError(f"arm v{version}: already armed for v{self._receiving.version}")
        self._receiving = await self._start_receive(target, version, signal_deadline=time.monotonic() + timeout_s)

    async def disarm(self, target: ReshardTarget) -> None:
        """Withdraw an armed receive whose signal has not come (a transfer already running finishes or
        times out first); the engine keeps its version. No-op when nothing is armed."""
        armed, self._receiving = self._receiving, None
        if armed is None:
            return
        armed.stop.set()
        armed.wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(armed.task), self.config.timeout_s + 5.0)
        except BaseException:
            pass  # withdrawn or failed: either way nothing is applied
        finally:
            await target.abort_weight_update()

    def _signal(self, version: int) -> None:
        """Tell armed receivers that ``version`` is being sent now (every source rank sets the same key)."""
        if self._signals is not None:
            self._signals.set(f"v{version}", repr(time.time()).encode())  # when: the receivers' signal_lag_s
            with contextlib.suppress(Exception):
                self._signals.delete_key(f"v{version - 1}")  # read by every engine before v was armed

    def _run_when_signalled(self, version: int, buffers: Mapping[str, torch.Tensor], timings: dict[str, float],
                            stop: threading.Event, wake: threading.Event, deadline: float, after: Any) -> tuple[int, int]:
        """The armed receive's thread: wait for the trainer's "sending v" key, then run the plan at once."""
        t0 = time.perf_counter()
        # check() polls without blocking: a timed-out store wait logs a warning each time. Slowly
        # until the controller's receive call wakes this thread (it comes with the trainer's send)
        while not self._signals.check([f"v{version}"]):
            if not wake.is_set():
                wake.wait(_IDLE_POLL_S)
            else:
                stop.wait(_SIGNAL_POLL_S)
            if stop.is_set():
                raise ReshardError(f"the armed receive of v{version} was withdrawn before the trainer sent it")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer did not start sending v{version} within the armed receive's "
                                   "timeout")
        timings["signal_wait_s"] = time.perf_counter() - t0
        with contextlib.suppress(Exception):  # the trainer's clock: the same host, or near enough to show a lag
            timings["signal_lag_s"] = max(0.0, time.time() - float(self._signals.get(f"v{version}")))
        return self._run(None, buffers, timings, after)

    async def _start_receive(self, target: ReshardTarget, version: int, *,
                             sources: Mapping[str, torch.Tensor] | None = None,
                             signal_deadline: float | None = None) -> _Receive:
        """Stage the engine's copy and start the transfer thread: at once, or (armed) when the trainer's
        signal comes, waiting for it until ``signal_deadline``. Generation goes on meanwhile."""
        t0 = time.perf_counter()
        await target.begin_weight_update()
        try:
            buffers = target.staged_params()
            self._check_buffers(buffers)
        except BaseException:
            await target.abort_weight_update()
            raise
        after = None
        if self.device.type == "cuda":  # the staging copy (and any sources) are ready as of now
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        stop, wake, timings = threading.Event(), threading.Event(), {"stage_s": time.perf_counter() - t0}
        if signal_deadline is None:
            run = functools.partial(self._run, sources, buffers, timings, after)
        else:
            run = functools.partial(self._run_when_signalled, version, buffers, timings, stop, wake, signal_deadline,
                                    after)
        # The transfer blocks on the group: run it off the event loop, which keeps generating on v.
        return _Receive(version, asyncio.ensure_future(asyncio.to_thread(run)), stop, timings,
                        time.perf_counter(), signal_deadline is not None, wake)

    async def _finish_receive(self, target: ReshardTarget, version: int) -> tuple[int, dict[str, float]]:
        """Wait for the started receive's thread, then flip between two steps; on any failure the
        staging copy is dropped and the engine stays on its version."""
        rec, self._receiving, old = self._receiving, None, target.version
        rec.wake.set()  # an armed thread: the trainer is sending now
        if rec.version != version:
            self._receiving = rec
            await self.disarm(target)
            raise ReshardError(f"receive v{version}: this engine was armed for v{rec.version}; disarmed it, the "
                               f"engine stays on v{old}")
        t0 = time.perf_counter()
        try:
            _, received = await asyncio.wait_for(asyncio.shield(rec.task), self.config.timeout_s + 5.0)
        except BaseException as exc:
            rec.stop.set()
            await target.abort_weight_update()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ReshardError(f"push of v{version} failed on destination rank {self.dst_rank}: {self._why(exc)}; "
                               f"the engine stays on v{old}") from exc
        t1 = time.perf_counter()
        await target.end_weight_update(version)
        t2 = time.perf_counter()
        stage = rec.timings.pop("stage_s")
        # armed_s: from arming to this call (the trainer computing the version); recv_signal_wait_s:
        # the thread waiting for the trainer's signal
        return received, {"stage_s": stage, **({"armed_s": t0 - rec.started_at} if rec.armed else {}),
                          "transfer_s": t1 - t0, "apply_s": t2 - t1,
                          **{f"recv_{k}": v for k, v in rec.timings.items()}}

    async def _receive_in_place(self, target: ReshardTarget, version: int,
                                sources: Mapping[str, torch.Tensor] | None) -> tuple[int, dict[str, float]]:
        """Pause (keeping sequences), receive into the live weights, label them ``version``, resume."""
        old, t0 = target.version, time.perf_counter()
        await target.pause("keep")  # from here no step runs until resume: none can read a half-written model
        try:
            buffers = target.live_params()
            self._check_buffers(buffers)
        except BaseException:
            await target.resume()  # nothing written yet: still exactly v
            raise
        t1 = time.perf_counter()
        try:
            _, received = await asyncio.wait_for(asyncio.to_thread(self._run, sources, buffers),
                                                 self.config.timeout_s + 5.0)
        except asyncio.CancelledError:
            raise  # the engine stays paused: the transfer thread may still be writing
        except BaseException as exc:
            why = self._why(exc)
            raise ReshardError(f"in-place push of v{version} failed on destination rank {self.dst_rank}: {why}; "
                               f"its weights are now a mix of v{old} and v{version}, so the engine stays paused "
                               "(push a whole version again over a new transfer group, or restart the run)") from exc
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the next step reads complete weights
        t2 = time.perf_counter()
        target.set_version(version)
        await target.resume()
        return received, {"pause_s": t1 - t0, "transfer_s": t2 - t1}

    def _why(self, exc: BaseException) -> Any:
        # asyncio.wait_for's own TimeoutError has no message; a transfer's TimeoutError says what it waited for
        return exc if str(exc) else f"timed out after {self.config.timeout_s + 5.0}s"

    def _check_buffers(self, buffers: Mapping[str, torch.Tensor]) -> None:
        want = self.dest.ranks[self.dst_rank].params
        bad = [(n, s, None if n not in buffers else tuple(buffers[n].shape)) for n, s in want
               if n not in buffers or tuple(buffers[n].shape) != s]
        if bad:
            raise ReshardError(f"destination rank {self.dst_rank}: engine parameters differ from the layout (name, "
                               f"expected, got): {bad[:3]}")

    def write_in_place(self, target: ReshardTarget, sources: Mapping[str, torch.Tensor], version: int) -> PushStats:
        """Colocated shortcut: every transfer into this destination rank comes from ``sources`` in this
        process; copy them into the live parameters in one synchronous call (between two steps)."""
        if self.dst_rank is None or self.src_rank is None:
            raise ReshardError(f"write_in_place needs a source and a destination rank in group rank {self.group_rank}")
        mine = [t for b in self.plan.buckets for t in b.transfers if t.dst == self.dst_rank]
        remote = [t for t in mine if t.src != self.src_rank]
        if remote:
            raise ReshardError(f"write_in_place: {len(remote)} transfers into destination rank {self.dst_rank} come "
                               f"from other processes (e.g. {remote[0].hf_name} from source rank {remote[0].src}); "
                               "use receive")
        self._check_sources(sources)
        start = time.perf_counter()

        def write(params: dict[str, torch.Tensor]) -> None:
            dst = [params[t.param][to_slices(t.dst_box)] for t in mine]
            src = [sources[t.hf_name][to_slices(t.src_box)] for t in mine]
            torch._foreach_copy_(dst, src)

        target.write_params(write, version)
        nbytes = sum(t.numel for t in mine) * torch.empty((), dtype=getattr(torch, self.plan.dtype)).element_size()
        return PushStats(version=version, seconds=time.perf_counter() - start, bytes=nbytes)
