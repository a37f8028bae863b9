"""Running a plan in one process: same-process copies, broadcasts and point-to-point messages.

Every process of the transfer group runs ``run_plan`` with the same plan; each does its own part:

* a transfer whose source and destination ranks live in this process is a direct copy
  (``torch._foreach_copy_`` of views: no serialisation, no staging of the payload);
* a *message* (one source box, with every destination that needs it) whose receivers plus its
  sender make up the whole group goes by ``broadcast`` from the sender (one trainer rank feeding
  replicated engines; with two ranks it is exactly a raw broadcast);
* everything else goes point to point (``batch_isend_irecv``: NCCL groups the calls, gloo runs
  them on its own threads).

Within a bucket, messages are coalesced: one broadcast per sender and one send/receive per
(sender, receiver) pair carry all their boxes back to back, so a push of a few hundred tensors
costs a few collectives (per-call overhead, not bandwidth, is what dominated small models: 42 ms
of posting for a 1.5B model's 338 tensors on an H200, against 10 ms on the wire). Payloads are the
source view itself when a message is one contiguous box already in the wire dtype (zero copy),
else packed into one buffer by a single ``_foreach_copy_`` (casting fp32 to bf16 on the way);
receivers land straight in the destination views when those are one contiguous span of memory,
else in a temporary unpacked by one ``_foreach_copy_`` afterwards. Buckets
are pipelined: bucket ``b + 1`` is packed and posted before bucket ``b`` is waited for, so packing
overlaps sending, and at most ``depth`` buckets of temporaries are alive.

Every wait is bounded (``wait_work``: gloo's ``Work.wait(timeout)``, NCCL's completion polled
finely up to the push's deadline; NCCL work is further bounded by the group's own timeout and
watchdog) and a timeout names the bucket and what it was waiting for.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from typing import Any, Mapping

import msgspec
import torch
import torch.distributed as dist

from meshrl.reshard.layout import box_shape, to_slices
from meshrl.reshard.plan import Plan, Transfer


class GroupRanks(msgspec.Struct, frozen=True):
    """Where each source and destination rank sits in the transfer group (one process per group rank)."""

    src: tuple[int, ...]
    """Group rank of each source rank."""
    dst: tuple[int, ...]
    """Group rank of each destination rank."""
    world_size: int
    """Processes in the group."""

    def __post_init__(self) -> None:
        for what, ranks in (("source", self.src), ("destination", self.dst)):
            if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
                raise ValueError(f"{what} group ranks {ranks} must be distinct and in [0, {self.world_size})")

    @classmethod
    def disjoint(cls, num_src: int, num_dst: int) -> "GroupRanks":
        """Trainer ranks 0..S-1, then engine ranks S..S+D-1 (separate processes)."""
        return cls(src=tuple(range(num_src)), dst=tuple(range(num_src, num_src + num_dst)),
                   world_size=num_src + num_dst)

    @classmethod
    def colocated(cls, num: int) -> "GroupRanks":
        """Source rank i and destination rank i share process i."""
        return cls(src=tuple(range(num)), dst=tuple(range(num)), world_size=num)

    def same_process(self) -> frozenset[tuple[int, int]]:
        where = {g: s for s, g in enumerate(self.src)}
        return frozenset((where[g], d) for d, g in enumerate(self.dst) if g in where)


@dataclasses.dataclass
class _Msg:
    src_group: int
    transfers: list[Transfer]  # same source box, one per receiver
    tag: int
    broadcast: bool


@dataclasses.dataclass
class _Posted:
    index: int
    works: list[tuple[Any, str]]  # (Work, what it moves)
    unpack: list[tuple[torch.Tensor, torch.Tensor]]  # (destination view, received temporary)
    keep: list[torch.Tensor]  # payloads that must outlive the sends


def _messages(plan: Plan, ranks: GroupRanks, bucket: int, first_tag: int) -> list[_Msg]:
    groups: dict[tuple, list[Transfer]] = {}
    for t in plan.buckets[bucket].transfers:
        groups.setdefault((t.src, t.hf_name, t.src_box), []).append(t)
    everyone = set(range(ranks.world_size))
    out = []
    for i, ((src, _, _), ts) in enumerate(groups.items()):
        gs = ranks.src[src]
        receivers = {ranks.dst[t.dst] for t in ts}
        out.append(_Msg(src_group=gs, transfers=ts, tag=first_tag + i,
                        broadcast=ranks.world_size > 1 and receivers | {gs} == everyone and receivers != {gs}))
    return out


_schedules: dict[tuple, tuple[Plan, list[list[_Msg]]]] = {}


DIRECT_BYTES = 64 * 2**20
"""Boxes at least this large travel as messages of their own; smaller ones of one bucket share one."""


def _split(flat: torch.Tensor, ts: list[Transfer]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each transfer's box, back to back."""
    return [v.view(box_shape(t.src_box)) for v, t in zip(flat.split([t.numel for t in ts]), ts)]


def _span(views: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """``views`` as one flat tensor if they are contiguous, of ``dtype``, and adjacent in one
    storage in this order (then a message can land in them directly); else None."""
    first = views[0]
    if first.dtype != dtype or first.device != device:
        return None
    end = first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    for v in views:
        if not v.is_contiguous() or v.dtype != dtype or v.data_ptr() != end or v.untyped_storage().data_ptr() != storage:
            return None
        end += v.numel() * v.element_size()
    if len(views) == 1:
        return first.view(-1)
    total = sum(v.numel() for v in views)
    return torch.empty(0, dtype=dtype, device=device).set_(first.untyped_storage(), first.storage_offset(), (total,))


def _schedule(plan: Plan, ranks: GroupRanks) -> list[list[_Msg]]:
    key = (id(plan), ranks)
    hit = _schedules.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    out, tag = [], 0
    for b in range(len(plan.buckets)):
        out.append(_messages(plan, ranks, b, tag))
        tag += len(out[-1])
    if len(_schedules) > 16:
        _schedules.clear()
    _schedules[key] = (plan, out)
    return out


class _Runner:
    def __init__(self, plan: Plan, ranks: GroupRanks, me: int, group: Any, sources: Mapping[str, torch.Tensor] | None,
                 buffers: Mapping[str, torch.Tensor] | None, device: torch.device):
        self.plan, self.ranks, self.me, self.group, self.device = plan, ranks, me, group, device
        self.dtype = getattr(torch, plan.dtype)
        self.sources, self.buffers = sources or {}, buffers or {}
        self.my_src = {s for s, g in enumerate(ranks.src) if g == me}
        self.my_dst = {d for d, g in enumerate(ranks.dst) if g == me}
        self.sent = self.received = 0

    def src_view(self, t: Transfer) -> torch.Tensor:
        try:
            return self.sources[t.hf_name][to_slices(t.src_box)]
        except KeyError:
            raise KeyError(f"source rank {t.src} has no local tensor {t.hf_name!r}") from None

    def dst_view(self, t: Transfer) -> torch.Tensor:
        return self.buffers[t.param][to_slices(t.dst_box)]

    def payload(self, ts: list[Transfer], post: _Posted) -> torch.Tensor:
        """One contiguous tensor of the wire dtype holding the boxes of ``ts`` back to back: the
        source view itself for a single contiguous box already in that dtype (zero copy), else a
        buffer packed with one ``_foreach_copy_`` (casting on the way)."""
        views = [self.src_view(t) for t in ts]
        if len(views) == 1 and views[0].is_contiguous() and views[0].dtype == self.dtype and views[0].device == self.device:
            return views[0]
        flat = torch.empty(sum(t.numel for t in ts), dtype=self.dtype, device=self.device)
        torch._foreach_copy_(_split(flat, ts), views)
        post.keep.append(flat)
        return flat

    def landing(self, ts: list[Transfer], post: _Posted) -> torch.Tensor:
        """Where the message for ``ts`` (back to back) is received: the destination views
        themselves when they are one contiguous span of memory in this order, else a temporary
        unpacked into them after the receive."""
        views = [self.dst_view(t) for t in ts]
        span = _span(views, self.dtype, self.device)
        if span is not None:
            return span
        flat = torch.empty(sum(t.numel for t in ts), dtype=self.dtype, device=self.device)
        post.unpack.extend(zip(views, _split(flat, ts)))
        return flat

    def _messages(self, items: list, transfer_of) -> list[list]:
        """Split one sender's (or one pair's) items of a bucket into messages: each box of at least
        ``DIRECT_BYTES`` alone (zero copy when the source allows it: large tensors gain nothing from
        packing), the rest together in one. Sender and receivers split alike (sizes only)."""
        size = self.dtype.itemsize
        big = [[x] for x in items if transfer_of(x).numel * size >= DIRECT_BYTES]
        small = [x for x in items if transfer_of(x).numel * size < DIRECT_BYTES]
        return big + ([small] if small else [])

    def post(self, index: int, msgs: list[_Msg]) -> _Posted:
        """Post bucket ``index``: its messages coalesced into one broadcast per sender and one
        send/receive per (sender, receiver) pair, so a push costs a few collectives, not one per
        tensor (per-call overhead is what dominates small models)."""
        post = _Posted(index=index, works=[], unpack=[], keep=[])
        local_dst, local_src = [], []
        bcasts: dict[int, list[tuple[Transfer, Transfer | None]]] = {}  # sender -> (its box, my receiving transfer)
        sends: dict[tuple[int, int], list[Transfer]] = {}  # (sender, receiver) -> transfers, in plan order
        for m in msgs:
            mine = [t for t in m.transfers if t.dst in self.my_dst]
            sending = m.src_group == self.me
            if sending:
                for t in mine:  # receivers in this process: a direct copy
                    local_dst.append(self.dst_view(t))
                    local_src.append(self.src_view(t))
            if m.broadcast:
                bcasts.setdefault(m.src_group, []).append((m.transfers[0], None if sending else mine[0]))
                continue
            for t in m.transfers:
                peer = self.ranks.dst[t.dst]
                if peer != m.src_group and (sending or peer == self.me):
                    sends.setdefault((m.src_group, peer), []).append(t)
        if local_dst:
            torch._foreach_copy_(local_dst, local_src)
        for src in sorted(bcasts):  # every rank takes part in every broadcast, in the same order
            for pairs in self._messages(bcasts[src], lambda pair: pair[0]):
                if src == self.me:
                    buf = self.payload([box for box, _ in pairs], post)
                    self.sent += buf.numel() * buf.element_size()
                else:
                    buf = self.landing([t for _, t in pairs], post)
                    self.received += buf.numel() * buf.element_size()
                work = dist.broadcast(buf, src=src, group=self.group, async_op=True)
                post.works.append((work, f"broadcast of {len(pairs)} tensors ({pairs[0][0].hf_name}, ...) from group rank {src}"))
        ops, what = [], []
        for (src, peer), ts in [(key, part) for key in sorted(sends) for part in self._messages(sends[key], lambda t: t)]:
            if src == self.me:
                buf = self.payload(ts, post)
                ops.append(dist.P2POp(dist.isend, buf, peer, self.group, index))
                what.append(f"send of {len(ts)} tensors ({ts[0].hf_name}, ...) to group rank {peer}")
                self.sent += buf.numel() * buf.element_size()
            else:
                buf = self.landing(ts, post)
                ops.append(dist.P2POp(dist.irecv, buf, src, self.group, index))
                what.append(f"receive of {len(ts)} tensors ({ts[0].hf_name}, ...) from group rank {src}")
                self.received += buf.numel() * buf.element_size()
        if ops:
            works = dist.batch_isend_irecv(ops)
            post.works.extend(zip(works, what) if len(works) == len(what) else [(w, what[0]) for w in works])
        return post

    def complete(self, post: _Posted, deadline: float) -> None:
        n = len(self.plan.buckets)
        for work, what in post.works:
            try:
                if not wait_work(work, deadline, cuda=self.device.type == "cuda"):
                    raise TimeoutError("Work.wait returned False")
            except Exception as exc:  # gloo raises on timeout; a dead peer raises too
                raise TimeoutError(f"reshard bucket {post.index + 1}/{n}, group rank {self.me}: the {what} did not "
                                   f"complete within the push's timeout ({type(exc).__name__}: {exc})") from exc
        if post.unpack:
            torch._foreach_copy_([d for d, _ in post.unpack], [s for _, s in post.unpack])


_POLL_FIRST_S, _POLL_MAX_S = 2e-5, 5e-4


def wait_work(work: Any, deadline: float, *, cuda: bool) -> bool:
    """Block until ``work`` is done or ``deadline`` (``time.monotonic``) passes; False on timeout.

    On CUDA, completion is polled with sleeps growing from 20 us to 0.5 ms (each poll holds the GIL
    for a microsecond), then ``wait()`` without a timeout orders this thread's stream after the
    work (the unpack copies that follow are safe) and returns at once. NCCL's own
    ``Work.wait(timeout)`` polls with coarser sleeps: 12.5 against 11.0 ms for 13 buckets of 240 MB
    on two H200s (``bench/nccl_wait_probe.py``). Gloo's wait blocks on the work itself.
    """
    if not cuda:
        left = deadline - time.monotonic()
        return left > 0 and work.wait(timeout=timedelta(seconds=left))
    pause = _POLL_FIRST_S
    while not work.is_completed():  # a failed NCCL work reads completed too: its watchdog aborts the group
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    work.wait()  # done: this only orders this thread's stream after it, for the unpack copies that follow
    return True


def run_plan(plan: Plan, ranks: GroupRanks, me: int, group: Any, *, sources: Mapping[str, torch.Tensor] | None = None,
             buffers: Mapping[str, torch.Tensor] | None = None, device: torch.device | str = "cpu",
             timeout_s: float = 300.0, depth: int = 2, timings: dict[str, float] | None = None) -> tuple[int, int]:
    """This process's share of ``plan``; returns (bytes sent, bytes received).

    ``me``: this process's group rank. ``sources``: the local tensors of its source rank, by HF
    name (``layout.local_tensors``). ``buffers``: the local parameters (or their staging copies)
    of its destination rank, by engine name. Blocks until its part is done or ``timeout_s``.
    ``timings``, when given, receives its parts: seconds posting (packing and enqueueing), seconds
    waiting for completion, the number of works waited on, and the first and the longest bucket's
    wait (``post_s``, ``wait_s``, ``works``, ``first_wait_s``, ``wait_max_s``).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this may run in a worker thread
    runner = _Runner(plan, ranks, me, group, sources, buffers, device)
    deadline = time.monotonic() + timeout_s
    in_flight: list[_Posted] = []
    clock, post_s, works, waits = time.perf_counter, 0.0, 0, []

    def complete(post: _Posted) -> None:
        t = clock()
        runner.complete(post, deadline)
        waits.append(clock() - t)

    for i, msgs in enumerate(_schedule(plan, ranks)):
        t0 = clock()
        in_flight.append(runner.post(i, msgs))  # packs bucket i while bucket i-1 is on the wire
        works += len(in_flight[-1].works)
        post_s += clock() - t0
        if len(in_flight) >= depth:
            complete(in_flight.pop(0))
    for post in in_flight:
        complete(post)
    t1 = clock()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # copies and unpacks are done when we return
    if timings is not None:
        # first_wait_s: bucket 1's (it includes the peers' late start), wait_max_s: the longest one's
        timings.update(post_s=post_s, wait_s=sum(waits) + clock() - t1, works=float(works),
                       first_wait_s=waits[0] if waits else 0.0, wait_max_s=max(waits, default=0.0))
    return runner.sent, runner.received
