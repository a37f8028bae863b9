"""``run.loops=roles``: the rollout worker and the trainer run the loops themselves, and trade samples
and weights over a channel of their own (``meshrl.mesh.channel``), with no controller call per step.

```text
LaneRollout (async actor: engine, reward, Sampler)                       LaneTrainer (sync actor)
  rollout loop × rollout.requests_in_flight:                           lane_steps(step, version, count):
    sampler.take(k)     waits for: admission within max_staleness         BATCH(n, v) ───► queue.get_batch_encoded
                        unblocked by: WEIGHTS' set_version                 ◄─── the batch's bytes (or the error)
    generate → score, in this process                                      the next step's BATCH, then train_step
    sampler.put_encoded waits for: room under queue.capacity_tokens        every sync_interval steps: version += 1
                        unblocked by: a BATCH                              WEIGHTS(v) ───► engine.update_weights(v),
  the channel: BATCHes answered concurrently, WEIGHTS one at a time          queue.set_version(v) ───► ACK(v)
  in order (the trainer sends the next only after the ACK of the last);
  after lane_pause (Pipeline.stop) a BATCH is answered with STOP           STOP: the chunk ends there
```

The weights of a version go through a file in /dev/shm that both map when they share a node
(``create_shared``: the trainer casts into it, the engine copies out of it), else in the message.

The controller starts both (``meshrl.pipeline.lanes``), hands the trainer chunks of steps (up to
the next checkpoint, evaluation or ``run.lane_chunk_steps``) and writes their records; it reaches
the sampler through the rollout worker's endpoints (``close``, ``metrics``, ``lane_state`` for a
checkpoint, ``lane_restore``). A Ray actor call costs about a millisecond of
CPU on a 2-core machine, and the controller's loops make about ten a step: at a few milliseconds a
step that is most of the machine. Here a step costs two round trips over the channel and no call.

The queue, admission, the ledger, the requests, scoring and the train step are the same code as the
controller's loops (``Sampler``, ``RequestMaker``, ``Scorer``,
``PolicyTrainer.train_step``), so a run's samples, staleness and checkpoints mean the same; what
differs is only who calls them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Sequence

import msgspec
import torch

from meshrl import faults
from meshrl.actors.algo_config import AlgoConfig
from meshrl.actors.policy_trainer import TrainerConfig
from meshrl.actors.requests import RequestMaker
from meshrl.actors.rollout import RolloutWorker
from meshrl.actors.trainer import Trainer
from meshrl.engines import TorchEngineConfig
from meshrl.mesh import endpoint
from meshrl.mesh.channel import Channel, ChannelClosed, read_message, serve, write_message
from meshrl.queues import QueueConfig, Sampler, SamplerState
from meshrl.queues.wire import decode_samples
from meshrl.tasks import Problem

__all__ = ["LaneRollout", "LaneSettings", "LaneTrainer"]

logger = logging.getLogger(__name__)

LAYOUT, BATCH, WEIGHTS, ACK, ERROR, STOP = 1, 2, 3, 4, 5, 6
"""Message kinds. LAYOUT (trainer → rollout, tag 0): the weights' names, shapes and dtype, and the
path of a shared-memory file holding them (``create_shared``), once; answered with ACK, whose payload
says whether the rollout worker mapped that file (same node). BATCH (tag: a request id): asks for
``[n, version]``, answered with the batch's bytes under the same tag. WEIGHTS (tag: the version):
the tensors' bytes in LAYOUT's order, or nothing when they are in the shared file; answered with
ACK once applied. ERROR (the tag it answers): the failure's text. STOP (a BATCH's tag): the rollout
worker paused (``Pipeline.stop``): no batch comes, the trainer ends its chunk there."""

_QUEUE_ENDPOINTS = ("close", "metrics", "state", "set_version", "cancel", "held_groups", "ledger")


class WeightFrame:
    """The weights' tensors laid end to end in one buffer, in the order of ``layout`` ([name, shape,
    dtype] each, one dtype for all: the engine's)."""

    def __init__(self, layout: list) -> None:
        self.layout = [(name, list(shape), dtype) for name, shape, dtype in layout]
        self.nbytes = sum(math.prod(shape) * getattr(torch, dtype).itemsize for _, shape, dtype in self.layout)

    def views(self, buffer: bytes | bytearray | torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of each weight over ``buffer`` (bytes of a message, or the shared uint8 tensor)."""
        if not isinstance(buffer, torch.Tensor):
            with warnings.catch_warnings():  # read-only bytes: the engine only copies from them
                warnings.simplefilter("ignore", UserWarning)
                buffer = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
        if buffer.numel() != self.nbytes:
            raise ValueError(f"{buffer.numel()} bytes of weights for a layout of {self.nbytes}")
        out, offset = [], 0
        for name, shape, dtype in self.layout:
            dt = getattr(torch, dtype)
            size = math.prod(shape) * dt.itemsize
            out.append((name, buffer[offset:offset + size].view(dt).view(shape)))
            offset += size
        return out


SHM_DIR = Path("/dev/shm")


def create_shared(nbytes: int) -> tuple[str | None, int, torch.Tensor | None]:
    """A file of ``nbytes`` in shared memory, its pages reserved (a full /dev/shm refuses here, not
    with a SIGBUS at the first write), mapped, a random nonce in its first 8 bytes: (path, nonce,
    the mapping). (None, 0, None) where there is no room: the weights then go in the messages."""
    if not SHM_DIR.is_dir() or nbytes < 8:
        return None, 0, None
    path, nonce = SHM_DIR / f"meshrl-lane-{os.getpid()}-{uuid.uuid4().hex[:12]}", int.from_bytes(os.urandom(7), "little")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        mapping = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:
        logger.info("no shared memory for the lane's weights (%s): they go over the channel", exc)
        path.unlink(missing_ok=True)
        return None, 0, None
    mapping[:8].view(torch.int64)[0] = nonce
    return str(path), nonce, mapping


def open_shared(path: str, nbytes: int, nonce: int) -> torch.Tensor | None:
    """The trainer's shared file mapped here, if this process sees the same file (same node: its size
    and nonce match); None otherwise, and nothing is created."""
    try:
        if os.stat(path).st_size != nbytes:
            return None
        mapping = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    return mapping if int(mapping[:8].view(torch.int64)[0]) == nonce else None


class LaneSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What a ``LaneRollout`` needs of the run's config to send its own requests."""

    queue: QueueConfig
    rollout: Any
    """The run's ``RolloutConfig`` (sampling settings, prompts_per_request, requests_in_flight)."""
    samples_per_prompt: int
    samples_per_step: int
    sync_interval: int
    seed: int
    step_timeout_s: float
    audit: bool = False
    """run.audit: the queue keeps the ledger of the groups it took."""


class LaneRollout(RolloutWorker):
    """A rollout worker that runs its own rollout loop and holds the run's queue and prompt ledger
    (module docstring). Spawned instead of the queue and the rollout worker with ``run.loops=roles``."""

    def __init__(self, model_path: str, engine: TorchEngineConfig, threads: int = 1, *, scorer: tuple[Any, float],
                 lane: LaneSettings, problems: Sequence[Problem]) -> None:
        super().__init__(model_path, engine, threads, scorer=scorer)
        self.lane = lane
        self.sampler = Sampler(lane.queue, problems, lane.seed, samples_per_prompt=lane.samples_per_prompt,
                               samples_per_step=lane.samples_per_step, steps_per_version=lane.sync_interval,
                               audit=lane.audit)
        self.queue = self.sampler.queue
        self.maker = RequestMaker(lane.rollout, lane.seed, None, self.tokenizer, environment=False)
        self.taking = asyncio.Event()
        """Set while the loops take new prompts (``lane_start``; cleared by ``lane_pause``)."""
        self.pausing = asyncio.Event()
        """Set by ``lane_pause``: the trainer's batches are answered with STOP."""
        self.generated_tokens = 0
        self.active = 0
        """Requests being generated (taken, not parked by a pause, not yet put)."""
        self.spans: list[tuple[str, str, float, float]] = []
        """(role, what, start, end) by ``time.time()`` since the last ``lane_report``."""
        self.failure: BaseException | None = None
        self._loops: list[asyncio.Task] = []
        self._server: Any = None
        self._applying = asyncio.Lock()

    # -- the channel ------------------------------------------------------------------------------

    @endpoint
    async def lane_open(self) -> tuple[str, int, str]:
        """Listen for the trainer (on this node's routable address): (host, port, the engine's dtype)."""
        from meshrl.groups import routable_ip

        if self._server is None:
            self._server, self._port = await serve(routable_ip(), self._serve)
        return self._server.sockets[0].getsockname()[0], self._port, str(self.engine.dtype).removeprefix("torch.")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frame: WeightFrame | None = None
        shared: torch.Tensor | None = None
        answering: set[asyncio.Task] = set()
        try:
            while True:
                kind, tag, payload = await read_message(reader)
                if kind == LAYOUT:
                    spec = msgspec.msgpack.decode(payload)
                    frame = WeightFrame(spec["tensors"])
                    shared = open_shared(spec["shm"], frame.nbytes, spec["nonce"]) if spec["shm"] else None
                    write_message(writer, ACK, tag, b"shm" if shared is not None else b"")
                elif kind == BATCH:
                    n, version = msgspec.msgpack.decode(payload)
                    task = asyncio.ensure_future(self._answer_batch(writer, tag, n, version))
                    answering.add(task)
                    task.add_done_callback(answering.discard)
                elif kind == WEIGHTS:
                    try:
                        if frame is None:
                            raise RuntimeError("weights before their layout")
                        await self._apply(frame.views(payload if payload else shared), tag)
                        write_message(writer, ACK, tag)
                    except Exception as exc:
                        logger.exception("applying version %d failed", tag)
                        write_message(writer, ERROR, tag, f"the rollout worker could not apply version {tag}: "
                                                          f"{type(exc).__name__}: {exc}".encode())
                else:
                    raise ChannelClosed(f"the trainer sent a message of unknown kind {kind}")
                await writer.drain()
        except ChannelClosed:
            pass  # the trainer's process ended (the run ends, or resumes in new processes)
        finally:
            for task in answering:
                task.cancel()
            writer.close()

    async def _answer_batch(self, writer: asyncio.StreamWriter, tag: int, n: int, version: int) -> None:
        getting = asyncio.ensure_future(self.queue.get_batch_encoded(n, version, timeout=self.lane.step_timeout_s))
        pausing = asyncio.ensure_future(self.pausing.wait())
        try:
            # waits for: n samples within max_staleness of `version`, or lane_pause;
            # unblocked by: this worker's loops' puts
            await asyncio.wait([getting, pausing], return_when=asyncio.FIRST_COMPLETED)
            if not getting.done():  # stopping: the samples stay in the queue for the checkpoint
                getting.cancel()
                # a get already woken by a put takes its batch despite the cancel (asyncio.wait_for
                # returns a result that came first): then that batch goes to the trainer
                await asyncio.wait([getting])
            if getting.cancelled() or (self.pausing.is_set() and getting.exception() is not None):
                write_message(writer, STOP, tag)  # (a queue closed after the pause: the run stops)
            else:
                write_message(writer, BATCH, tag, getting.result())  # (or raises its failure)
        except asyncio.CancelledError:
            getting.cancel()
            raise
        except Exception as exc:
            why = self.failure if self.failure is not None else exc
            write_message(writer, ERROR, tag, f"no batch from the rollout worker: {type(why).__name__}: {why}".encode())
        finally:
            pausing.cancel()
        await writer.drain()

    async def _apply(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """A WEIGHTS message's tensors into the engine, whole, as ``version``; then admission follows it."""
        t0 = time.time()
        async with self._applying:
            await self.engine.update_weights(tensors, version)
            await self.queue.set_version(version)
        self.spans.append(("sync", "apply_weights", t0, time.time()))

    # -- the rollout loop -------------------------------------------------------------------------

    @endpoint
    async def lane_start(self) -> None:
        """Start (or go on with) the rollout loops: ``rollout.requests_in_flight`` of them."""
        self.pausing.clear()
        self.taking.set()
        if not self._loops:
            self._loops = [asyncio.ensure_future(self._loop(i)) for i in range(self.lane.rollout.requests_in_flight)]

    @endpoint
    async def lane_pause(self, timeout_s: float) -> int:
        """Take no new prompts, answer the trainer's batches with STOP (what is queued stays for the
        checkpoint), and wait (at most ``timeout_s``) for the requests in flight to put their
        samples; returns how many were still in flight (a checkpoint records them)."""
        self.taking.clear()
        self.pausing.set()
        deadline = time.monotonic() + timeout_s
        # waits for: the requests in flight to put their samples; unblocked by: this worker's loops
        while self.active and time.monotonic() < deadline and self.failure is None:
            await asyncio.sleep(0.01)
        return self.active

    async def _loop(self, index: int) -> None:
        lane, sampler = self.lane, self.sampler
        n, k = lane.samples_per_prompt, lane.rollout.prompts_per_request
        try:
            while True:
                await self.taking.wait()
                # waits for: admission within max_staleness; unblocked by: a pushed version (set_version)
                job, problems = await sampler.take(k, timeout=lane.queue.reserve_timeout_s)
                if not self.taking.is_set():  # paused (Pipeline.stop) meanwhile: recorded, re-issued on resume
                    await self.taking.wait()
                self.active += 1
                group_ids = list(range(job.first_group, job.first_group + job.count))
                rjob, requests = self.maker.job(problems, greedy=False, n=n, group_ids=group_ids)
                t0 = time.time()
                scored = await self.play_scored(rjob, requests, within_s=lane.step_timeout_s)
                t1 = time.time()
                # waits for: room under capacity_tokens; unblocked by: a BATCH
                await sampler.put_encoded(scored.encoded, job.reservation_id, timeout=lane.queue.put_timeout_s)
                self.active -= 1
                self.generated_tokens += scored.completion_tokens
                self.spans += [("rollout", "generate", t0, scored.received), ("reward", "score", scored.received, t1)]
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            from meshrl.queues import QueueClosed

            if isinstance(exc, QueueClosed):
                return  # the run stops
            if self.failure is None:
                self.failure = exc
                logger.exception("rollout loop %d failed", index)
            await sampler.close()  # wakes the trainer's batch and every other loop (lane_report raises it)

    @endpoint
    async def lane_report(self) -> dict[str, Any]:
        """The queue's metrics, tokens generated so far and the spans since the last report; raises
        the rollout loops' failure, if one failed."""
        if self.failure is not None:
            raise RuntimeError(f"the rollout worker's loop failed: {type(self.failure).__name__}: {self.failure}"
                               ) from self.failure
        spans, self.spans = self.spans, []
        return {"queue": await self.queue.metrics(), "generated_tokens": self.generated_tokens, "spans": spans}

    @endpoint
    async def lane_state(self) -> tuple[SamplerState, int]:
        """What a checkpoint keeps of the rollout side: the sampler's state (read at one instant) and
        the tokens generated so far."""
        generated = self.generated_tokens
        return await self.sampler.state(), generated

    @endpoint
    async def lane_restore(self, state: SamplerState, generated_tokens: int, version: int) -> int:
        """Continue from a checkpoint's sampler state (before ``lane_start``) at ``version``; returns
        how many requests that were in flight are taken again first."""
        pending = await self.sampler.restore(state)
        await self.sampler.set_version(version)
        self.generated_tokens = generated_tokens
        return pending


def _queue_endpoint(name: str) -> Any:
    async def call(self: LaneRollout, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.sampler, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``Sampler.{name}`` of this worker's sampler (the controller's ``roles.queue``)."
    return endpoint(call)


for _name in _QUEUE_ENDPOINTS:
    setattr(LaneRollout, _name, _queue_endpoint(_name))


class LaneTrainer(Trainer):
    """A trainer that takes its batches from a ``LaneRollout`` and pushes its weights to it over the
    lane's channel, a chunk of steps per controller call (module docstring)."""

    def __init__(self, model_path: str, cfg: TrainerConfig, algo: AlgoConfig, *, temperature: float,
                 max_new_tokens: int, total_steps: int) -> None:
        super().__init__(model_path, cfg, algo, temperature=temperature, max_new_tokens=max_new_tokens,
                         total_steps=total_steps)
        self._lane: Channel | None = None
        self._dtype = torch.float32
        self._timeout_s = 600.0
        self._asked: tuple[int, int] | None = None
        """(tag, version) of the batch asked for and not yet taken."""
        self._tag = 0
        self._unacked: int | None = None
        """The version sent and not yet acknowledged."""
        self._inbox: dict[tuple[int, int], bytes] = {}
        """Replies that came before the one waited for (a batch before an ACK, or the other way)."""
        self._views: list[torch.Tensor] | None = None
        """The weights' tensors in the memory shared with the rollout worker, which they keep mapped
        (None: the weights go in the messages)."""

    @endpoint
    def lane_connect(self, host: str, port: int, dtype: str, timeout_s: float, shared_memory: bool = True) -> bool:
        """Connect to the rollout worker's lane and send the weights' layout; True when the weights go
        through shared memory (``shared_memory`` and the rollout worker on this node), False when in
        the messages."""
        if self._lane is not None:
            self._lane.close()
        self._lane = Channel(host, port, timeout_s=timeout_s, what="the rollout worker's lane")
        self._dtype, self._timeout_s = getattr(torch, dtype), timeout_s
        self._asked, self._unacked, self._inbox = None, None, {}
        frame = WeightFrame([(name, list(t.shape), dtype) for name, t in self.core.policy_state().items()])
        path, nonce, mapping = create_shared(frame.nbytes) if shared_memory else (None, 0, None)
        try:
            self._lane.send(LAYOUT, 0, [msgspec.msgpack.encode({"tensors": frame.layout, "shm": path, "nonce": nonce})])
            shared = bytes(self._expect((ACK,), 0, "the layout's acknowledgement")[1]) == b"shm"
        finally:
            if path:
                os.unlink(path)  # mapped by both sides (or not used): nothing to leave behind
        self._views = [t for _, t in frame.views(mapping)] if shared else None
        return shared

    @endpoint
    def lane_push(self, version: int) -> None:
        """The current policy to the rollout worker as ``version``; returns once it serves it."""
        self._push(version)
        self._settle()

    @endpoint
    def lane_steps(self, step: int, version: int, count: int, sync_interval: int, *, prefetch: bool = False,
                   settle: bool = True) -> tuple[list[dict[str, Any]], int]:
        """``count`` train steps from ``step`` at ``version``, each on a batch from the lane, pushing
        every ``sync_interval`` steps; the steps' records and the version after them. ``prefetch``: ask
        for the batch of the step after the last while it trains (the next chunk trains it: not before
        a checkpoint, whose queue snapshot must hold every sample not trained). ``settle``: return once
        the rollout worker serves the last version (before an evaluation, a checkpoint or the end)."""
        if self._lane is None:
            raise RuntimeError("lane_steps before lane_connect")
        records = []
        for i in range(count):
            t0 = time.time()
            if self._asked is None:
                self._ask(version)
            blob = self._take_batch(version)
            if blob is None:  # the rollout worker paused (the run stops): the chunk ends here
                settle = True
                break
            t1 = time.time()
            pushes = (step + 1) % sync_interval == 0
            if i < count - 1 or prefetch:
                self._ask(version + pushes)  # the next step's batch is found while this one trains
            self._staged = None
            faults.point("trainer.train_step")
            samples = decode_samples(blob)
            metrics = self.core.train_step(samples, version)
            t2 = time.time()
            step += 1
            if pushes:
                version += 1
                self._push(version)
            t3 = time.time()
            records.append({"step": step, "version": version, **metrics, "batch_wait_s": t1 - t0,
                            "sync_time_s": t3 - t2, "step_time_s": t3 - t0, "spans": (t0, t1, t2, t3),
                            "groups": sorted(collections.Counter(s.group_id for s in samples).items())})
        if settle:
            self._settle()
        return records, version

    def _ask(self, version: int) -> None:
        self._tag += 1
        self._asked = (self._tag, version)
        self._lane.send(BATCH, self._tag, [msgspec.msgpack.encode([self.core.cfg.samples_per_step, version])])

    def _take_batch(self, version: int) -> bytes | None:
        """The batch asked for (None: STOP, the rollout worker paused)."""
        tag, asked_at = self._asked
        if asked_at != version:
            raise RuntimeError(f"the lane's batch was asked for at version {asked_at}, the step trains at {version}")
        self._asked = None
        kind, blob = self._expect((BATCH, STOP), tag, f"a batch of {self.core.cfg.samples_per_step} samples for version {version}")
        return blob if kind == BATCH else None

    def _push(self, version: int) -> None:
        self._settle()  # one version in flight at most: the rollout worker has copied the last one
        tensors = self.core.policy_state().values()
        if self._views is not None:  # shared memory: cast straight into the rollout worker's view of it
            with torch.no_grad():
                for view, t in zip(self._views, tensors, strict=True):
                    view.copy_(t)
            self._lane.send(WEIGHTS, version)
        else:
            self._lane.send(WEIGHTS, version, [t.detach().to(self._dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
                                               for t in tensors])
        self._unacked = version

    def _settle(self) -> None:
        if self._unacked is not None:
            version, self._unacked = self._unacked, None
            self._expect((ACK,), version, f"the rollout worker to apply version {version}")

    def _expect(self, kinds: tuple[int, ...], tag: int, what: str) -> tuple[int, bytes]:
        """The reply of one of ``kinds`` under ``tag``: (its kind, its payload); replies to other
        messages that come first are kept for their turn."""
        while True:
            for kind in kinds:
                if (kind, tag) in self._inbox:
                    return kind, self._inbox.pop((kind, tag))
            got, got_tag, payload = self._lane.receive(self._timeout_s, what)
            if got == ERROR:
                raise RuntimeError(bytes(payload).decode(errors="replace"))
            self._inbox[got, got_tag] = payload
