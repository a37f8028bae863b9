"""Leader-driven tensor parallelism: rank 0 broadcasts each step's schedule, the other ranks follow it.

Why: TP ranks must run the same steps on the same batches (``tp.py``), but calls reach processes at
different times. So, as in SGLang, callers talk to rank 0 only. Rank 0's engine records every change
of its schedule between two steps (``TorchEngine._record``: request added, abort, pause, resume,
version flip or label, checkpoint load, drop) and, before each step, sends them with the step
(``ScheduleChannel``); a follower applies them in the same order (``_apply``, through the same
engine methods) and runs the same step. Admission and sampling are deterministic functions of that state, so the batches
agree by construction. An idle rank 0 sends heartbeats instead (every ``heartbeat_s``).

Weights are each rank's own shard: a follower stages and ends its update whenever its caller does,
and the stage goes live when rank 0's flip to that version arrives (``_flip_sealed``), waiting for
the follower's own ``end_weight_update`` if rank 0 got there first.

Simplifications, on purpose: messages are msgpack over the TP group (or ``control_group``), header
and payload as two broadcasts; there is no acknowledgement (the steps' all-reduces are the
rendezvous); a follower's results are computed and dropped (rank 0 answers the callers).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from meshrl.engines.tp import TensorParallel
from meshrl.engines.types import GenerateRequest, SamplingParams
from meshrl.engines.weights import stage_checkpoint

_STEP, _STOP = 1, 2  # header flags


class ScheduleChannel:
    """Rank 0 -> the other ranks of a TP group: one message per step (and per heartbeat).

    A message is a header ``[payload bytes, flags]`` (one small broadcast), then, only when something
    changed, the events as msgpack bytes (a second one). Events are lists of plain values; what they
    mean is ``_apply``'s business. Every broadcast is bounded by the group's timeout; a follower that
    waits past it fails naming the leader.
    """

    def __init__(self, tp: TensorParallel, device: torch.device):
        self.tp, self.group = tp, tp.control_group if tp.control_group is not None else tp.group
        cuda = dist.get_backend(self.group) == "nccl"
        self.device = device if cuda else torch.device("cpu")
        self._encode, self._decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(list).decode
        self.messages = 0  # sent or received (a metric)

    def send(self, events: list, *, step: bool, stop: bool = False) -> None:
        """Leader: publish ``events`` and whether a step follows them."""
        payload = self._encode(events) if events else b""
        header = torch.tensor([len(payload), (_STEP if step else 0) | (_STOP if stop else 0)], dtype=torch.int64)
        dist.broadcast(header.to(self.device), group=self.group, group_src=0)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data.to(self.device), group=self.group, group_src=0)
        self.messages += 1

    def agree(self, ok: bool) -> bool:
        """Every rank's ``ok``, and-ed (an all-reduce over the group): for all-or-nothing steps."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def recv(self) -> tuple[list, bool, bool]:
        """Follower: the next message as ``(events, step, stop)``; blocks (call it from a thread)."""
        try:
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                header = torch.zeros(2, dtype=torch.int64, device=self.device)
                dist.broadcast(header, group=self.group, group_src=0)
                nbytes, flags = header.tolist()  # (a host sync on CUDA: the step needs the events anyway)
                events: list = []
                if nbytes:
                    data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    dist.broadcast(data, group=self.group, group_src=0)
                    events = self._decode(data.cpu().numpy().tobytes())
        except Exception as exc:
            raise RuntimeError(f"TP follower rank {self.tp.rank}: no schedule message from the leader (rank 0) "
                               f"within the process group's timeout, or the group broke ({type(exc).__name__}: "
                               f"{exc}); is rank 0 alive, and has it started (a first call, or "
                               f"`await engine.start()`)?") from exc
        self.messages += 1
        return events, bool(flags & _STEP), bool(flags & _STOP)


async def follow(engine: Any) -> None:
    """Run rank 0's schedule on a follower ``TorchEngine`` until rank 0 shuts down.

    A failed step drops what this rank runs and goes on, as rank 0 does (its ``drop`` follows); only
    a broken channel (no message within the group's timeout) or a schedule this rank cannot apply
    ends it, with the error."""
    loop = asyncio.get_running_loop()
    engine._loop = loop
    try:
        while True:
            events, step, stop = await asyncio.to_thread(engine._channel.recv)
            for event in events:
                await _apply(engine, event, loop)
            if stop:
                engine.abort_all()
                return
            if step:
                try:
                    engine.step()
                except Exception as exc:  # the same step most likely failed on rank 0: it drops its requests too
                    print(f"TP rank {engine.tp.rank}: step failed ({type(exc).__name__}: {exc}); its requests are "
                          "dropped, following on", file=sys.stderr, flush=True)
                    engine._drop_all()
    except BaseException:
        engine._drop_all()
        raise


async def _apply(engine: Any, event: list, loop: asyncio.AbstractEventLoop) -> None:
    """Follower: one change recorded by rank 0, applied between the same two steps as there."""
    kind = event[0]
    if kind == "add":
        _, rid, ids, sampling, seed = event
        req = GenerateRequest(input_ids=ids, sampling=msgspec.convert(sampling, SamplingParams), request_id=rid)
        engine._enqueue(req, rid, seed, loop.create_future())  # nobody awaits it: rank 0 answers the caller
    elif kind == "abort":
        engine._abort(event[1])  # aborted on rank 0
    elif kind == "pause":
        engine._paused = True  # (the aborts of pause(mode="abort") come as events of their own)
    elif kind == "resume":
        engine._paused = False
    elif kind == "flip":
        await _flip_sealed(engine, event[1])
    elif kind == "version":
        engine._set_version(event[1])
    elif kind == "load":  # rank 0 staged the same checkpoint: all apply it, or none does
        _, path, version = event
        try:
            stage, ok = stage_checkpoint(engine.model, path), True
        except Exception as exc:
            print(f"TP rank {engine.tp.rank}: could not read its shard of {path!r}: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            stage, ok = None, False
        if engine._channel.agree(ok):
            stage.apply()
            engine._set_version(version)
    elif kind == "drop":
        engine._drop_all()
    else:
        raise RuntimeError(f"TP follower rank {engine.tp.rank}: unknown schedule event {kind!r} from rank 0")


async def _flip_sealed(engine: Any, version: int) -> None:
    """Follower: make this rank's ended stage of ``version`` live, waiting for its end if need be."""
    loop_time = asyncio.get_running_loop().time
    deadline = loop_time() + engine.tp.flip_timeout_s
    while engine._sealed is None or engine._sealed[1] != version:
        if engine._sealed is not None:
            raise RuntimeError(f"TP follower rank {engine.tp.rank}: rank 0 flipped to version {version}, but this "
                               f"rank's ended weight update is version {engine._sealed[1]}")
        engine._sealed_event.clear()
        try:
            await asyncio.wait_for(engine._sealed_event.wait(), max(0.0, deadline - loop_time()))
        except asyncio.TimeoutError:
            raise RuntimeError(f"TP follower rank {engine.tp.rank}: rank 0 flipped to version {version}, but this "
                               f"rank's weights for it were not ended (end_weight_update) within "
                               f"{engine.tp.flip_timeout_s:g} s (staging: {engine._stage is not None})") from None
    stage, _ = engine._sealed
    engine._sealed = None
    stage.apply()
    engine._set_version(version)
    engine._flipped_event.set()
