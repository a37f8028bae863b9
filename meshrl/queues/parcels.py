"""Samples by reference: the queue's data plane through Ray's object store.

A producer (the reward worker, or the reference worker after it) puts its ``encode_samples`` blob
into Ray's object store once and sends the queue only the blob's ``ObjectRef`` and each sample's
``SampleMeta`` (what admission schedules by). The queue holds one ``Parcel`` per sample (the ref
and the sample's index in the blob) and hands a batch out as a ``Batch``: the refs, in batch
order, with the indices each one contributes, or as ``Shares``: one ``Batch`` per trainer dp
rank, whole groups each (``to_shares``): a producer's blob holds whole groups (a request's) and
goes to one rank, so a rank fetches its own blobs from the producers' nodes and nothing else,
and the process that drives the run (and the queue actor) move ids, counts and refs, never a
sample's tokens: what they carry per step does not grow with the tokens.

Ray's distributed reference counting keeps a blob alive while any parcel, batch or fetch holds
its ref (the producer owns it: a producer that dies takes its unconsumed blobs with it, which
fails the step that needed them, naming the object). A snapshot for exact resume fetches the
blobs of the queued parcels and stores their samples verbatim, as for ``put_encoded``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import msgspec

from meshrl.queues.sample import Sample
from meshrl.queues.wire import decode_samples, encode_samples, split_encoded

__all__ = ["Batch", "Parcel", "SamplesLost", "Shares", "fetch_batch", "materialize", "share_groups", "to_batch", "to_shares"]


class SamplesLost(RuntimeError):
    """Blobs a batch needs are gone with the process that put them (a reward or reference worker
    that died): the step cannot train them. ``run.auto_resume`` resumes from the newest checkpoint,
    whose queue snapshot holds the samples accepted until then (the later ones are generated again)."""


class Parcel:
    """One sample inside a producer's blob in Ray's object store."""

    __slots__ = ("ref", "index")

    def __init__(self, ref: Any, index: int) -> None:
        self.ref, self.index = ref, index

    def __repr__(self) -> str:
        return f"Parcel({self.ref!r}, {self.index})"


class Batch(msgspec.Struct, frozen=True):
    """A batch by reference: ``parts[i] = [ref]`` holds the samples ``indices[i]`` of that blob, in
    order (a ref in a list: Ray hands a nested ref over as a ref and resolves only top-level ones)."""

    parts: list[list[Any]]
    indices: list[list[int]]

    def __len__(self) -> int:
        return sum(len(i) for i in self.indices)


def to_batch(items: Sequence[Any]) -> Batch:
    """A ``Batch`` of queued items in their order: runs of parcels of one blob become one part;
    samples held in the queue itself (put whole or encoded, or restored from a snapshot) are put
    into the object store as one blob per run."""
    import ray

    parts: list[list[Any]] = []
    indices: list[list[int]] = []
    local: list[Any] = []

    def flush_local() -> None:
        if local:
            parts.append([ray.put(encode_samples(list(local)))])
            indices.append(list(range(len(local))))
            local.clear()

    for item in items:
        if isinstance(item, Parcel):
            flush_local()
            if parts and parts[-1][0] == item.ref:
                indices[-1].append(item.index)
            else:
                parts.append([item.ref])
                indices.append([item.index])
        else:
            local.append(item)
    flush_local()
    return Batch(parts, indices)


class Shares(msgspec.Struct, frozen=True):
    """One step's batch split over the trainer's dp ranks (``to_shares``): rank ``r`` fetches
    ``batches[r]`` only, the step's samples ``starts[r] : starts[r] + counts[r]`` in the step's
    order (groups by id). A rank with no group (fewer groups than ranks) gets the step's first
    sample as padding, to train nothing (``counts[r] == 0``)."""

    batches: list[Batch]
    starts: list[int]
    counts: list[int]
    total: int
    groups: list[tuple[int, int]] = []
    """``(group_id, samples)`` of every group of the step, in the step's order (the run's audit)."""

    def of(self, rank: int) -> tuple[Batch, int, int]:
        """``(batch, start, count)`` of dp rank ``rank``."""
        if not 0 <= rank < len(self.batches):
            raise ValueError(f"Shares.of({rank}): the step was split for {len(self.batches)} dp ranks")
        return self.batches[rank], self.starts[rank], self.counts[rank]


def share_groups(tokens: Sequence[int], ranks: int) -> list[range]:
    """Contiguous runs of groups, one per rank, near-equal in tokens (``tokens[g]``: group ``g``'s).

    Each cut is the group boundary nearest its ideal share of the tokens, keeping at least one
    group per rank while there are enough; a rank past the last group gets an empty run. Trainer
    ranks that hold the whole batch compute the same split (``PolicyTrainer.train_step``)."""
    if ranks < 1:
        raise ValueError(f"share_groups: ranks must be >= 1, got {ranks}")
    n = len(tokens)
    prefix = [0]
    for t in tokens:
        prefix.append(prefix[-1] + t)
    total, cuts = prefix[-1], [0]
    for k in range(1, ranks):
        lo = min(cuts[-1] + 1, n)  # at least one group for the rank before this cut
        hi = max(lo, n - (ranks - k))  # and one left for each rank after it
        ideal = total * k / ranks
        cuts.append(min(range(lo, hi + 1), key=lambda j: (abs(prefix[j] - ideal), j)))
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def to_shares(groups: Sequence[tuple[int, int, Sequence[Any]]], ranks: int) -> Shares:
    """``Shares`` of ``groups`` (``(group_id, tokens, items)`` each, any order) for ``ranks`` dp ranks.

    The groups go in id order, and the split (``share_groups``) is over runs of groups that share
    one blob (a producer's request), so each rank fetches its own blobs only; with fewer such
    runs than ranks, over single groups (then a blob may go to two ranks)."""
    ordered = sorted(groups, key=lambda g: g[0])

    def blob(g: tuple[int, int, Sequence[Any]]) -> Any:
        """The one blob all of the group's parcels are in, else None."""
        first = g[2][0]
        same = isinstance(first, Parcel) and all(isinstance(it, Parcel) and it.ref == first.ref for it in g[2])
        return first.ref if same else None

    units: list[list[int]] = []  # runs of group indices, one blob each
    for i, g in enumerate(ordered):
        if units and blob(g) is not None and blob(g) == blob(ordered[units[-1][-1]]):
            units[-1].append(i)
        else:
            units.append([i])
    if len(units) < ranks:
        units = [[i] for i in range(len(ordered))]
    batches, starts, counts, start = [], [], [], 0
    for run in share_groups([sum(ordered[i][1] for i in u) for u in units], ranks):
        items = [item for u in units[run.start : run.stop] for i in u for item in ordered[i][2]]
        starts.append(start)
        counts.append(len(items))
        start += len(items)
        batches.append(to_batch(items if items else list(ordered[0][2][:1])))
    return Shares(batches, starts, counts, start, [(g[0], len(g[2])) for g in ordered])


def fetch_batch(batch: Batch | bytes, timeout_s: float | None = None) -> list[Sample]:
    """The samples of ``batch`` in order (an encoded blob decodes as it is): each blob is fetched
    once, straight from the node that holds it. Raises ``TimeoutError`` naming what it waited for."""
    if isinstance(batch, (bytes, bytearray, memoryview)):
        return decode_samples(bytes(batch))
    import ray

    refs = [part[0] for part in batch.parts]
    try:
        blobs = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"gave up after {timeout_s:g}s fetching a batch's {len(refs)} sample blob(s) from the "
                           "object store (their producers' nodes)") from None
    except ray.exceptions.ObjectLostError as exc:
        raise SamplesLost(f"a batch's sample blobs were lost with the worker that put them: {str(exc)[:300]}") from None
    out: list[Sample] = []
    for blob, wanted in zip(blobs, batch.indices):
        samples = decode_samples(blob)
        out.extend(samples[i] for i in wanted)
    return out


async def materialize(items: Sequence[Any]) -> list[Any]:
    """``items`` with every parcel replaced by its raw sample (a snapshot stores the bytes)."""
    import ray

    refs = list(dict.fromkeys(p.ref for p in items if isinstance(p, Parcel)))
    try:
        blobs = await asyncio.gather(*refs)
    except ray.exceptions.ObjectLostError as exc:
        raise SamplesLost(f"queued sample blobs were lost with the worker that put them: {str(exc)[:300]}") from None
    raws = {ref: split_encoded(blob)[0] for ref, blob in zip(refs, blobs)}
    return [raws[item.ref][item.index] if isinstance(item, Parcel) else item for item in items]
