"""SampleQueue: the bounded, staleness-aware queue between rollout producers and the trainer.

Producers ``reserve`` positions before they generate (admission control, ``admission.py``), then
``put`` the samples under that reservation; the trainer ``get_batch``-es whole GRPO groups, oldest
behaviour version first. Samples that still end up older than ``max_staleness`` (a slow engine)
are dropped or kept by ``stale_policy``, and counted either way. Memory is bounded in tokens.

It is a plain class with ``async`` methods and no Ray import, so tests drive it in-process; the
pipeline runs it as an async Ray actor (``ray.remote(SampleQueue)``), where all calls share one
event loop. Every method runs without awaiting between reading and changing state, so no locks
are needed; the only awaits are the waits, each bounded by a timeout whose error says what it
waited for and what would have unblocked it.

Simplifications on purpose: one queue per pipeline (no sharding); exactly-once holds across
``snapshot``/``restore`` of the queue itself — a producer that dies mid-``put`` must ``cancel``
(or the controller after ``restore``) and regenerate, as the queue does not de-duplicate replays
of already consumed groups.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Any, Callable, TypeVar

import msgspec

from meshrl.queues.admission import Admission
from meshrl.queues.config import QueueConfig
from meshrl.queues.groups import Group, GroupStore
from meshrl.queues.parcels import Batch, Parcel, Shares, materialize, to_batch, to_shares
from meshrl.queues.reservations import Reservation, ReservationState, check_put
from meshrl.queues.sample import Sample
from meshrl.queues.snapshot import FORMAT as SNAPSHOT_FORMAT
from meshrl.queues.snapshot import QueueSnapshot, SnapshotGroup, SnapshotReservation
from meshrl.queues.stats import QueueCounters, ThroughputWindow
from meshrl.queues.wire import SampleMeta, check_sample, decode_one, encode_samples, meta_of, split_encoded

__all__ = ["QueueClosed", "QueueTimeout", "SampleQueue"]

T = TypeVar("T")


class QueueTimeout(TimeoutError):
    """A queue wait ran out of time; the message names what it waited for and what unblocks it."""


class QueueClosed(RuntimeError):
    """The queue was closed (pipeline shutdown) while a call waited or before it started."""


class SampleQueue:
    """Bounded, staleness-aware, checkpointable sample queue (module docstring)."""

    def __init__(self, config: QueueConfig, *, samples_per_step: int, steps_per_version: int = 1,
                 ledger: bool = False) -> None:
        self.config = config
        self._adm = Admission(max_staleness=config.max_staleness, samples_per_step=samples_per_step,
                              steps_per_version=steps_per_version)
        self._store = GroupStore()
        self._res: dict[int, ReservationState] = {}
        self._next_res_id = 0
        self._unfilled = 0  # reserved samples not yet put
        self._reserve_line: list[object] = []  # FIFO tickets: a large reservation is not starved
        self._counters = QueueCounters()
        self._throughput = ThroughputWindow()
        self._waiters: set[asyncio.Future] = set()
        self._closed = False
        self._ledger: list[tuple[int, int, bool]] | None = [] if ledger else None
        """(group_id, samples, dropped) of every group taken by a put, or dropped (stale, or left
        incomplete by a cancel), in order: what ``ledger`` hands out (run.audit)."""
        self._ledger_base = 0  # the position of _ledger[0]

    # -- producers ---------------------------------------------------------------------------

    async def reserve(self, n: int, *, timeout: float | None = None) -> Reservation:
        """Reserve ``n`` positions; waits while they could not train within ``max_staleness``.

        Unblocked by ``set_version`` (the trainer published and every engine applied it) or by
        ``cancel`` of another reservation.
        """
        most = (self._adm.max_staleness + 1) * self._adm.samples_per_version
        if not 1 <= n <= most:
            raise ValueError(f"reserve(n={n}): n must be in [1, {most}] = (max_staleness + 1) * "
                             f"samples_per_step * steps_per_version; a larger reservation never fits")
        ticket = object()
        self._reserve_line.append(ticket)

        def grantable() -> bool | None:
            return (self._reserve_line[0] is ticket and self._adm.free(self._live) >= n) or None

        def what() -> str:
            a = self._adm
            return (f"reserve(n={n}) waited for admission: positions {a.consumed_position}.."
                    f"{a.bound} are within max_staleness={a.max_staleness} of published version "
                    f"{a.published_version}, {self._live} of them live ({self._store.num_samples} "
                    f"queued, {self._unfilled} reserved unfilled), "
                    f"{self._reserve_line.index(ticket)} reservations ahead in line; unblocked by "
                    f"set_version({a.published_version + 1}) once the trainer publishes and every "
                    f"engine applied it, or by cancel() of an outstanding reservation")

        try:
            await self._wait(grantable, timeout, self.config.reserve_timeout_s, what, "reserve_wait_s")
        finally:
            self._reserve_line.remove(ticket)
            self._notify()  # the next in line may fit now
        start = self._adm.consumed_position + self._live
        info = Reservation(id=self._next_res_id, n=n, slots=(start, start + n),
                           min_version=self._adm.published_version,
                           train_version=self._adm.train_version_of(start + n - 1))
        self._next_res_id += 1
        self._res[info.id] = ReservationState(info)
        self._unfilled += n
        self._counters.reservations_granted += 1
        self._counters.slots_granted += n
        return info

    async def put(self, samples: list[Sample], reservation_id: int, *, timeout: float | None = None) -> None:
        """Add samples generated under a reservation (which may be filled in several puts).

        All-or-nothing: a bad batch raises ``ValueError`` and changes nothing. Waits while the
        batch would exceed ``capacity_tokens``; unblocked by ``get_batch``. A put that only adds to
        groups already queued is never held: those groups must complete before ``get_batch`` can
        take them and free capacity.
        """
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"put: expected Sample, got {type(s).__name__}; encoded batches go "
                                "through put_encoded")
            try:  # a field of the wrong type would otherwise fail get_batch_encoded and every snapshot later
                check_sample(s)
            except (TypeError, ValueError, msgspec.MsgspecError) as exc:
                raise ValueError(f"put: sample {i} (group {s.group_id}) is not a valid Sample: {exc}; "
                                 "nothing was put") from None
        await self._put(samples, [meta_of(s) for s in samples], reservation_id, timeout)

    async def put_encoded(self, blob: bytes, reservation_id: int, *, timeout: float | None = None) -> None:
        """``put`` of an ``encode_samples`` blob: the pipeline's way through Ray (wire.py).

        Only what admission needs is read (group, size, version, token counts); the token and
        log-prob arrays pass through undecoded (checking them element by element would cost about
        a quarter of the queue's time), so the blob must come from ``encode_samples`` of valid
        ``Sample``s: a malformed array surfaces when the batch holding it is decoded."""
        items, metas = split_encoded(blob)
        await self._put(items, metas, reservation_id, timeout)

    async def put_ref(self, blobs: list[Any], metas: list[SampleMeta], reservation_id: int, *,
                      timeout: float | None = None) -> None:
        """``put`` by reference (parcels.py): ``blobs``, ``ObjectRef``s of ``encode_samples`` blobs
        in Ray's object store, either one holding every sample of ``metas`` or one per group, in
        the order the groups' samples come in ``metas`` (each sample's ``SampleMeta``; a group's
        samples one run); the queue keeps the refs, never the bytes."""
        runs = [i for i, m in enumerate(metas) if i == 0 or m.group_id != metas[i - 1].group_id]
        if len(blobs) == 1:
            runs = runs[:1]
        elif len(runs) != len(blobs) or len({metas[i].group_id for i in runs}) != len(runs):
            raise ValueError(f"put_ref: {len(blobs)} blob refs for samples of {len(runs)} runs of group ids "
                             f"{[metas[i].group_id for i in runs]}: give one blob, or one per group with each "
                             "group's samples one run")
        items, bounds = [], runs + [len(metas)]
        for ref, a, b in zip(blobs, bounds, bounds[1:]):
            items += [Parcel(ref, i) for i in range(b - a)]
        await self._put(items, metas, reservation_id, timeout)

    async def _put(self, items: list[Sample | msgspec.Raw | Parcel], metas: list[SampleMeta], rid: int,
                   timeout: float | None) -> None:
        if self._closed:
            raise QueueClosed(f"put({len(items)} samples) to reservation {rid}: the queue is closed; "
                              "the samples were not taken")
        if not items:
            return
        check_put(metas, rid, self._res.get(rid), self._store.groups)
        tokens = sum(m.num_tokens for m in metas)
        cap = self.config.capacity_tokens
        if tokens > cap:
            raise ValueError(f"put: a batch of {tokens} tokens can never fit capacity_tokens={cap}; "
                             "put it in smaller batches or raise capacity_tokens")

        groups = self._store.groups
        continues = all(m.group_id in groups for m in metas)  # check_put has refused complete ones

        def fits() -> bool | None:
            return continues or self._store.num_tokens + tokens <= cap or None

        def what() -> str:
            return (f"put({len(items)} samples, {tokens} tokens) waited for token capacity: "
                    f"{self._store.num_tokens} of capacity_tokens={cap} held by "
                    f"{self._store.num_samples} queued samples ({self._store.ready_samples} in "
                    f"complete groups); unblocked by get_batch() consuming samples")

        if not fits():
            await self._wait(fits, timeout, self.config.put_timeout_s, what, "put_wait_s")
            # The reservation may have been cancelled or filled by another put meanwhile.
            check_put(metas, rid, self._res.get(rid), self._store.groups)
        res = self._res[rid]
        self._store.add(rid, items, metas)
        for gid in {m.group_id for m in metas}:
            g = self._store.groups.get(gid)
            if g is not None and not g.complete:
                res.open_groups.add(gid)
            else:
                res.open_groups.discard(gid)
        res.filled += len(items)
        self._unfilled -= len(items)
        if res.filled == res.info.n:
            del self._res[rid]
        self._counters.samples_put += len(items)
        if self._ledger is not None:
            self._ledger += [(gid, n, False) for gid, n in collections.Counter(m.group_id for m in metas).items()]
        self._notify()

    async def cancel(self, reservation_id: int) -> int:
        """Release a reservation's unfilled remainder and drop its unfinished groups (counted).

        Returns the positions released; 0 when the reservation was already filled or cancelled.
        """
        if not 0 <= reservation_id < self._next_res_id:
            raise ValueError(f"cancel({reservation_id}): no reservation with that id was ever granted")
        res = self._res.pop(reservation_id, None)
        if res is None:
            return 0
        remaining = res.unfilled
        self._unfilled -= remaining
        self._counters.slots_cancelled += remaining
        for gid in res.open_groups:
            dropped = len(self._store.remove_incomplete(gid).items)
            self._counters.dropped_incomplete += dropped
            self._note_dropped(gid, dropped)
        self._notify()
        return remaining

    # -- the trainer ---------------------------------------------------------------------------

    async def get_batch(self, n: int, current_version: int, *, timeout: float | None = None) -> list[Sample]:
        """The ``n`` oldest admissible samples, as whole groups, oldest behaviour version first.

        ``current_version`` is the trainer's policy version for the step these samples train.
        Waits for enough samples in complete groups within ``max_staleness``; unblocked by
        ``put`` from rollout producers.
        """
        groups = await self._get_groups(n, current_version, timeout)
        out = []
        for g in groups:
            try:
                out.extend(decode_one(item) for item in await materialize(g.items))
            except msgspec.MsgspecError as exc:  # only put_encoded's blobs get here undecoded
                raise ValueError(f"get_batch: a sample of group {g.group_id} (reservation {g.reservation_id}) is not a "
                                 f"valid Sample ({exc}); put_encoded checks a blob's headers only, so its producer "
                                 "sent a malformed one; this batch is lost") from None
        return out

    async def get_batch_encoded(self, n: int, current_version: int, *, timeout: float | None = None) -> bytes:
        """``get_batch`` as one ``encode_samples`` blob; encoded puts pass through undecoded."""
        groups = await self._get_groups(n, current_version, timeout)
        return encode_samples(await materialize([item for g in groups for item in g.items]))

    async def get_batch_refs(self, n: int, current_version: int, *, timeout: float | None = None,
                             shares: int | None = None) -> Batch | Shares:
        """``get_batch`` by reference (parcels.py): the blobs' refs and indices, for the trainer
        to fetch itself; with ``shares=dp``, split into whole groups per dp rank (``Shares``:
        each rank fetches only its own)."""
        if shares is not None and shares < 1:
            raise ValueError(f"get_batch_refs(shares={shares}): shares must be >= 1 (the trainer's dp size)")
        groups = await self._get_groups(n, current_version, timeout)
        if shares is None:
            return to_batch([item for g in groups for item in g.items])
        return to_shares([(g.group_id, g.tokens, g.items) for g in groups], shares)

    async def _get_groups(self, n: int, current_version: int, timeout: float | None) -> list[Group]:
        if n < 1 or current_version < 0:
            raise ValueError(f"get_batch(n={n}, current_version={current_version}): n must be >= 1 "
                             "and current_version >= 0")
        self._adm.observe_trainer_version(current_version)

        def what() -> str:
            s = self._store
            return (f"get_batch(n={n}, current_version={current_version}) waited for {n} samples in "
                    f"complete groups with behaviour version >= "
                    f"{max(0, current_version - self._adm.max_staleness)}: {s.ready_samples} ready, "
                    f"{s.num_samples - s.ready_samples} in unfinished groups, {self._unfilled} "
                    f"reserved but not yet put; unblocked by put() from rollout producers")

        taken = await self._wait(lambda: self._try_take(n, current_version), timeout,
                                 self.config.get_timeout_s, what, "get_wait_s")
        self._counters.record_consumed(taken, current_version, self._adm.max_staleness, time.time())
        self._adm.consume(n)
        self._throughput.add(n)
        self._notify()
        return taken

    # -- the controller --------------------------------------------------------------------------

    async def set_version(self, version: int) -> None:
        """``version`` is published: every engine has applied it (call after, never before)."""
        self._adm.publish(version)
        self._notify()

    async def close(self) -> None:
        """Wake every waiter with ``QueueClosed``; later reserves, puts and gets fail the same way.

        ``snapshot`` and ``metrics`` keep working, so a shutdown can still checkpoint the queue.
        """
        self._closed = True
        self._notify()

    async def held_groups(self) -> dict[int, int]:
        """``{group_id: samples}`` of every group the queue holds (taken, not handed out yet)."""
        return {gid: len(g.items) for gid, g in self._store.groups.items()}

    async def ledger(self, since: int, upto: int | None = None) -> tuple[list[tuple[int, int, bool]], int]:
        """The ledger's entries from position ``since`` up to ``upto`` (a snapshot's
        ``ledger_mark``; default: all) and the position after them; those before ``since`` are
        forgotten (the caller has them). Only for a queue made with ``ledger=True``."""
        if self._ledger is None:
            raise ValueError("ledger: this queue keeps no ledger; make it with SampleQueue(..., ledger=True) (run.audit)")
        end = self._ledger_base + len(self._ledger)
        upto = end if upto is None else upto
        if not self._ledger_base <= since <= upto <= end:
            raise ValueError(f"ledger(since={since}, upto={upto}): the ledger holds positions "
                             f"{self._ledger_base}..{end}; ask from where the last answer ended")
        del self._ledger[:since - self._ledger_base]
        self._ledger_base = since
        return self._ledger[:upto - since], upto

    def _note_dropped(self, group_id: int, samples: int) -> None:
        if self._ledger is not None and samples:
            self._ledger.append((group_id, samples, True))

    async def metrics(self) -> dict[str, float]:
        c, s, a = self._counters, self._store, self._adm
        hist_total = sum(c.staleness_hist.values())
        out: dict[str, float] = {
            "depth_samples": s.num_samples,
            "ready_samples": s.ready_samples,
            "queued_tokens": s.num_tokens,
            "capacity_tokens": self.config.capacity_tokens,
            "reservations_outstanding": len(self._res),
            "reserved_unfilled_samples": self._unfilled,
            "admission_free_slots": a.free(self._live),
            "published_version": a.published_version,
            "consumed_position": a.consumed_position,
            "throughput_samples_per_s": self._throughput.rate(),
            "producer_wait_s": c.reserve_wait_s + c.put_wait_s,
            "consumer_wait_s": c.get_wait_s,
            "staleness_mean": (sum(k * v for k, v in c.staleness_hist.items()) / hist_total
                               if hist_total else 0.0),
            "staleness_max": max(c.staleness_hist, default=0),
            "age_at_consume_s_mean": c.age_s_sum / c.age_count if c.age_count else 0.0,
        }
        for name in QueueCounters.__struct_fields__:
            if name != "staleness_hist":
                out[name] = float(getattr(c, name))
        for k, v in sorted(c.staleness_hist.items()):
            out[f"staleness/{k}"] = v
        return {k: float(v) for k, v in out.items()}

    async def snapshot(self) -> bytes:
        """Queued samples, outstanding reservations, counters and version, msgpack-encoded: the
        state as this call began (puts applied while it reads the samples are not in it)."""
        groups = self._store.ready_in_order()
        groups += [g for g in self._store.groups.values() if not g.complete]
        snap = QueueSnapshot(
            published_version=self._adm.published_version,
            consumed_position=self._adm.consumed_position,
            next_reservation_id=self._next_res_id,
            ledger_mark=self._ledger_base + len(self._ledger or ()),
            counters=msgspec.structs.replace(self._counters),  # a copy: puts go on while the samples are read
            reservations=[SnapshotReservation(reservation=r.info, filled=r.filled)
                          for r in self._res.values()],
            # Raw members encode verbatim, so the snapshot decodes as plain Samples.
            groups=[SnapshotGroup(reservation_id=g.reservation_id, samples=await materialize(g.items)) for g in groups],
        )
        return msgspec.msgpack.encode(snap)

    async def restore(self, blob: bytes) -> list[Reservation]:
        """Load a ``snapshot`` into this fresh queue; returns the reservations still outstanding.

        The caller either has producers fill those (same ids) or ``cancel``s them and regenerates.
        """
        if self._counters.samples_put or self._res or self._next_res_id:
            raise ValueError("restore: this queue already has state; restore into a fresh SampleQueue "
                             "so two runs' samples never mix")
        try:
            snap = msgspec.msgpack.decode(blob, type=QueueSnapshot)
        except msgspec.MsgspecError as e:
            raise ValueError(f"restore: the blob is not a SampleQueue snapshot: {e}") from None
        if snap.format != SNAPSHOT_FORMAT:
            raise ValueError(f"restore: snapshot format {snap.format}, this meshrl reads {SNAPSHOT_FORMAT}")
        self._adm.published_version = snap.published_version
        self._adm.consumed_position = snap.consumed_position
        self._next_res_id = snap.next_reservation_id
        self._counters = snap.counters
        for r in snap.reservations:
            self._res[r.reservation.id] = ReservationState(r.reservation, filled=r.filled)
            self._unfilled += r.reservation.n - r.filled
        for g in snap.groups:
            self._store.add(g.reservation_id, g.samples, [meta_of(x) for x in g.samples])
            if not self._store.groups[g.samples[0].group_id].complete:
                self._res[g.reservation_id].open_groups.add(g.samples[0].group_id)
        self._notify()
        return [r.info for r in self._res.values()]

    # -- internals -----------------------------------------------------------------------------

    @property
    def _live(self) -> int:
        """Samples that will still reach the trainer: queued plus reserved but not yet put."""
        return self._store.num_samples + self._unfilled

    def _try_take(self, n: int, version: int) -> list[Group] | None:
        """Whole groups totalling ``n``, oldest first, after dropping stale ones; None if short."""
        store, eta = self._store, self._adm.max_staleness
        if self.config.stale_policy == "drop":
            dropped = False
            while (g := store.oldest_ready()) is not None and version - g.min_behavior_version > eta:
                self._counters.dropped_stale += store.pop_oldest_ready().group_size
                self._note_dropped(g.group_id, g.group_size)
                dropped = True
            if dropped:
                self._notify()  # the dropped groups' positions are free for new reservations
        if store.ready_samples < n:
            return None
        taken: list[Group] = []
        skipped: list[Group] = []
        need = n
        while need and store.oldest_ready() is not None:
            g = store.pop_oldest_ready()
            if n % g.group_size:
                store.put_back(taken + skipped + [g])
                raise ValueError(f"get_batch(n={n}): n is not a multiple of group_size "
                                 f"{g.group_size}; groups are trained whole")
            if g.group_size <= need:
                taken.append(g)
                need -= g.group_size
            else:
                skipped.append(g)
        store.put_back(skipped)
        if need:  # mixed group sizes: the oldest-first pick fell short; another pick may add up to n
            store.put_back(taken)
            return self._take_subset(n)
        return taken

    def _take_subset(self, n: int) -> list[Group] | None:
        """Whole groups adding up to exactly ``n`` from the shortest run of oldest ready groups (a
        subset sum over group sizes), or None. Only for mixed group sizes, where taking the oldest
        groups that fit can fall short while a batch is queued (sizes 2 then 4, ``n`` = 4)."""
        ready = self._store.ready_in_order()
        parent: dict[int, tuple[int, int] | None] = {0: None}  # reachable sum -> (previous sum, group index)
        for i, g in enumerate(ready):
            for total in sorted(parent, reverse=True):
                if (t := total + g.group_size) <= n and t not in parent:
                    parent[t] = (total, i)
            if n in parent:
                break
        else:
            return None
        chosen, total = set(), n
        while (step := parent[total]) is not None:
            total, i = step
            chosen.add(i)
        popped = [self._store.pop_oldest_ready() for _ in range(max(chosen) + 1)]
        self._store.put_back([g for i, g in enumerate(popped) if i not in chosen])
        return [g for i, g in enumerate(popped) if i in chosen]

    def _notify(self) -> None:
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def _wait(self, poll: Callable[[], T | None], timeout: float | None, default_s: float,
                    what: Callable[[], str], wait_counter: str) -> T:
        """Poll until it returns a result, re-polling after every state change.

        The time spent, timed out or not, is added to ``wait_counter``: idle time per role.
        """
        timeout = default_s if timeout is None else timeout
        if not (timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
        if self._closed:
            raise QueueClosed(f"the queue is closed: {what()}")
        if (r := poll()) is not None:
            return r
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            while True:
                remaining = t0 + timeout - time.monotonic()
                if remaining <= 0:
                    raise QueueTimeout(f"timed out after {timeout:g} s: {what()}")
                fut = loop.create_future()
                self._waiters.add(fut)
                try:
                    await asyncio.wait_for(fut, remaining)
                except TimeoutError:
                    pass
                finally:
                    self._waiters.discard(fut)
                if self._closed:
                    raise QueueClosed(f"the queue was closed while waiting: {what()}")
                if (r := poll()) is not None:
                    return r
        finally:
            c = self._counters
            setattr(c, wait_counter, getattr(c, wait_counter) + time.monotonic() - t0)
