"""The transfer plan: source boxes intersected with destination boxes, grouped into buckets.

For every destination piece (an HF box one engine rank stores) and every distinct source box
that overlaps it, one ``Transfer`` moves exactly the overlap: from source rank ``src`` (a box of
its *local* tensor) to destination rank ``dst`` (a box of its *local* parameter). Each destination
element is received exactly once, from one owner, so the bytes moved equal the bytes the engines
store: no rank gathers a whole tensor when the destination is sharded. When several source ranks
hold the same box (replication), the owner is the one in the destination's own process if there
is one (``same_process``), else they take turns by destination rank.

Transfers are listed piece by piece, interleaving destination ranks (so every bucket keeps all
ranks busy), split along their first dim when one is larger than ``bucket_bytes``, and packed
greedily into buckets of at most ``bucket_bytes`` (a transfer is cut into row blocks, and a row
too big into pieces of the row). Plans are cached per (source layout, destination layout, bucket
size, same_process).
"""

from __future__ import annotations

import collections
import itertools

import msgspec
import torch

from meshrl.reshard.layout import Box, DestLayout, SourceLayout, box_numel, box_shape, intersect, shift

_CACHE_SIZE = 8
_cache: collections.OrderedDict[tuple, "Plan"] = collections.OrderedDict()


class Transfer(msgspec.Struct, frozen=True, array_like=True):
    """One box copied from a source rank's local tensor to a destination rank's local parameter."""

    src: int
    """Source rank (flat index in the trainer mesh)."""
    dst: int
    """Destination rank (replica * tp_size + tp_rank)."""
    hf_name: str
    src_box: Box
    """Box of the source rank's local tensor."""
    param: str
    """Engine parameter name."""
    dst_box: Box
    """Box of the destination rank's local parameter (same extents as ``src_box``)."""

    @property
    def numel(self) -> int:
        return box_numel(self.src_box)


class Bucket(msgspec.Struct, frozen=True):
    transfers: tuple[Transfer, ...]
    nbytes: int
    """Bytes on the wire (destination dtype)."""


class Plan(msgspec.Struct, frozen=True):
    """Everything one push moves, bucket by bucket."""

    buckets: tuple[Bucket, ...]
    nbytes: int
    """Total bytes moved (= bytes the destination ranks store)."""
    dtype: str
    """Wire and destination dtype; the sender converts."""
    num_src: int
    num_dst: int


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _split(t: Transfer, max_numel: int) -> list[Transfer]:
    """Cut ``t`` along its first dim longer than 1 into parts of at most ``max_numel`` elements."""
    if t.numel <= max_numel:
        return [t]
    shape = box_shape(t.src_box)
    d = next(i for i, n in enumerate(shape) if n > 1)
    inner = t.numel // shape[d]
    step = max(1, max_numel // inner)
    out = []
    for lo in range(0, shape[d], step):
        hi = min(shape[d], lo + step)

        def cut(box: Box, lo: int = lo, hi: int = hi) -> Box:
            return box[:d] + ((box[d][0] + lo, box[d][0] + hi),) + box[d + 1:]

        part = Transfer(src=t.src, dst=t.dst, hf_name=t.hf_name, src_box=cut(t.src_box), param=t.param,
                        dst_box=cut(t.dst_box))
        # a part still too big is one slice of dim d (step == 1): cut it along a later dim
        out.extend(_split(part, max_numel) if part.numel > max_numel else [part])
    return out


def plan_transfers(source: SourceLayout, dest: DestLayout, bucket_bytes: int,
                   same_process: frozenset[tuple[int, int]] = frozenset()) -> Plan:
    """The (cached) plan moving ``source`` into ``dest``; ``same_process`` holds (src, dst) rank
    pairs that share a process, preferred as owners of replicated boxes."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    key = (source, dest, bucket_bytes, same_process)
    plan = _cache.get(key)
    if plan is None:
        plan = _make_plan(source, dest, bucket_bytes, same_process)
        _cache[key] = plan
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return plan


def _owners(source: SourceLayout) -> dict[str, list[tuple[Box, list[int]]]]:
    """Per tensor: its distinct source boxes, each with the ranks holding it; checks coverage."""
    out = {}
    for t in source.tensors:
        boxes: dict[Box, list[int]] = {}
        for rank, box in enumerate(t.owned):
            if box is not None:
                boxes.setdefault(box, []).append(rank)
        covered = sum(box_numel(b) for b in boxes)
        if covered != box_numel(tuple((0, n) for n in t.shape)):
            raise ValueError(f"{t.name}: the source ranks' boxes cover {covered} of {t.shape} elements "
                             "(boxes must tile the tensor)")
        out[t.name] = list(boxes.items())
    return out


def _make_plan(source: SourceLayout, dest: DestLayout, bucket_bytes: int,
               same_process: frozenset[tuple[int, int]]) -> Plan:
    owners = _owners(source)
    src_shapes = {t.name: t.shape for t in source.tensors}
    missing = sorted({n for n, _ in dest.hf_shapes} - set(owners))
    if missing:
        extra = sorted(set(owners) - {n for n, _ in dest.hf_shapes})
        raise ValueError(f"the trainer has no tensor for {len(missing)} engine weights, e.g. {missing[:3]}; "
                         f"unused trainer names: {extra[:3]} (a prefix such as '_orig_mod.' or 'module.'?)")
    bad = [(n, src_shapes[n], s) for n, s in dest.hf_shapes if src_shapes[n] != s]
    if bad:
        raise ValueError(f"shape mismatch (name, trainer, engine): {bad[:3]}")
    itemsize = _itemsize(dest.dtype)
    transfers: list[Transfer] = []
    for pieces in itertools.zip_longest(*(r.pieces for r in dest.ranks)):
        for dst, piece in enumerate(pieces):
            if piece is None:
                continue
            for box, ranks in owners[piece.hf_name]:
                common = intersect(box, piece.hf_box)
                if common is None:
                    continue
                local = [r for r in ranks if (r, dst) in same_process]
                src = local[0] if local else ranks[dst % len(ranks)]
                transfers.append(Transfer(
                    src=src, dst=dst, hf_name=piece.hf_name, src_box=shift(common, [-a for a, _ in box]),
                    param=piece.param, dst_box=shift(common, [lb[0] - hb[0] for lb, hb in
                                                              zip(piece.local_box, piece.hf_box)]),
                ))
    max_numel = max(1, bucket_bytes // itemsize)
    buckets, current, nbytes = [], [], 0
    for t in (p for t in transfers for p in _split(t, max_numel)):
        size = t.numel * itemsize
        if current and nbytes + size > bucket_bytes:
            buckets.append(Bucket(transfers=tuple(current), nbytes=nbytes))
            current, nbytes = [], 0
        current.append(t)
        nbytes += size
    if current:
        buckets.append(Bucket(transfers=tuple(current), nbytes=nbytes))
    return Plan(buckets=tuple(buckets), nbytes=sum(b.nbytes for b in buckets), dtype=dest.dtype,
                num_src=source.num_ranks, num_dst=dest.num_ranks)
