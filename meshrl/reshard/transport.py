"""Running a plan in one process: same-process copies, broadcasts and point-to-point messages.

Every process of the transfer group runs ``run_plan`` with the same plan; each does its own part:

* a transfer whose source and destination ranks live in this process is a direct copy
  (``torch._foreach_copy_`` of views: no serialisation, no staging of the payload);
* a *message* (one source box, with every destination that needs it) whose receivers plus its
  sender make up the whole group is a ``broadcast`` from the sender (one trainer rank feeding
  replicated engines; with two ranks it is exactly a raw broadcast);
* everything else goes point to point (``batch_isend_irecv``: NCCL groups the calls, gloo runs
  them on its own threads).

Payloads are the source views themselves when they are contiguous and already in the wire dtype
(zero copy), else packed into a contiguous tensor of the wire dtype; receivers write straight into
the destination view when it is contiguous, else into a temporary copied in afterwards. Buckets
are pipelined: bucket ``b + 1`` is packed and posted before bucket ``b`` is waited for, so packing
overlaps sending, and at most ``depth`` buckets of temporaries are alive.

Every wait is bounded (``Work.wait(timeout)``; NCCL work is further bounded by the group's own
timeout and watchdog) and a timeout names the bucket and what it was waiting for.
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

    def payload(self, t: Transfer) -> torch.Tensor:
        v = self.src_view(t)
        if v.is_contiguous() and v.dtype == self.dtype and v.device == self.device:
            return v
        return torch.empty(v.shape, dtype=self.dtype, device=self.device).copy_(v)  # pack

    def landing(self, t: Transfer, post: _Posted) -> torch.Tensor:
        """Where a message for ``t`` is received: the destination view itself, or a temporary."""
        v = self.dst_view(t)
        if v.is_contiguous() and v.device == self.device:
            return v
        tmp = torch.empty(box_shape(t.dst_box), dtype=self.dtype, device=self.device)
        post.unpack.append((v, tmp))
        return tmp

    def post(self, index: int, msgs: list[_Msg]) -> _Posted:
        post = _Posted(index=index, works=[], unpack=[], keep=[])
        local_dst, local_src, ops, what = [], [], [], []
        for m in msgs:
            mine = [t for t in m.transfers if t.dst in self.my_dst]
            sending = m.src_group == self.me
            if sending:
                for t in mine:  # receivers in this process: a direct copy
                    local_dst.append(self.dst_view(t))
                    local_src.append(self.src_view(t))
            if m.broadcast:
                if sending:
                    buf = self.payload(m.transfers[0])
                    post.keep.append(buf)
                    self.sent += buf.numel() * buf.element_size()
                else:
                    buf = self.landing(mine[0], post)
                    self.received += buf.numel() * buf.element_size()
                work = dist.broadcast(buf, src=m.src_group, group=self.group, async_op=True)
                post.works.append((work, f"broadcast of {m.transfers[0].hf_name} from group rank {m.src_group}"))
            else:
                for t in m.transfers:
                    peer = self.ranks.dst[t.dst]
                    if sending and peer != self.me:
                        buf = self.payload(t)
                        post.keep.append(buf)
                        ops.append(dist.P2POp(dist.isend, buf, peer, self.group, m.tag))
                        what.append(f"send of {t.hf_name} to group rank {peer}")
                        self.sent += buf.numel() * buf.element_size()
                    elif peer == self.me and not sending:
                        buf = self.landing(t, post)
                        ops.append(dist.P2POp(dist.irecv, buf, m.src_group, self.group, m.tag))
                        what.append(f"receive of {t.hf_name} from group rank {m.src_group}")
                        self.received += buf.numel() * buf.element_size()
        if local_dst:
            torch._foreach_copy_(local_dst, local_src)
        if ops:
            works = dist.batch_isend_irecv(ops)
            post.works.extend(zip(works, what) if len(works) == len(what) else [(w, what[0]) for w in works])
        return post

    def complete(self, post: _Posted, deadline: float) -> None:
        n = len(self.plan.buckets)
        for work, what in post.works:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not work.wait(timeout=timedelta(seconds=left)):
                    raise TimeoutError("Work.wait returned False")
            except Exception as exc:  # gloo raises on timeout; a dead peer raises too
                raise TimeoutError(f"reshard bucket {post.index + 1}/{n}, group rank {self.me}: the {what} did not "
                                   f"complete within the push's timeout ({type(exc).__name__}: {exc})") from exc
        if post.unpack:
            torch._foreach_copy_([d for d, _ in post.unpack], [s for _, s in post.unpack])


def run_plan(plan: Plan, ranks: GroupRanks, me: int, group: Any, *, sources: Mapping[str, torch.Tensor] | None = None,
             buffers: Mapping[str, torch.Tensor] | None = None, device: torch.device | str = "cpu",
             timeout_s: float = 300.0, depth: int = 2) -> tuple[int, int]:
    """This process's share of ``plan``; returns (bytes sent, bytes received).

    ``me``: this process's group rank. ``sources``: the local tensors of its source rank, by HF
    name (``layout.local_tensors``). ``buffers``: the local parameters (or their staging copies)
    of its destination rank, by engine name. Blocks until its part is done or ``timeout_s``.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this may run in a worker thread
    runner = _Runner(plan, ranks, me, group, sources, buffers, device)
    deadline = time.monotonic() + timeout_s
    in_flight: list[_Posted] = []
    for i, msgs in enumerate(_schedule(plan, ranks)):
        in_flight.append(runner.post(i, msgs))  # packs bucket i while bucket i-1 is on the wire
        if len(in_flight) >= depth:
            runner.complete(in_flight.pop(0), deadline)
    for post in in_flight:
        runner.complete(post, deadline)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # copies and unpacks are done when we return
    return runner.sent, runner.received
