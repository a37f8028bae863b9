"""Weight layouts on both sides of a push: who holds which box of which tensor.

A *box* is a half-open range per dim, ``((start, stop), ...)``, in the coordinates of the full
(global, unsharded) Hugging Face tensor, or of one rank's local tensor.

* **Source** (the trainer): ``source_layout(named)`` reads each parameter's DTensor spec — mesh
  shape, placements, global shape, dtype — and computes the box every mesh rank owns, with
  DTensor's own uneven-chunk rule (``torch.chunk``: ``ceil(n / k)`` rows per rank, the last ranks
  shorter or empty; dp=3 over 64 rows gives 22, 22, 20). Source rank = the flat (row-major) index
  of a coordinate in the DTensor's mesh. Plain tensors count as replicated on every rank.
* **Destination** (the engines): ``dest_layout(engine_layout, tp_size, replicas, dtype)`` reads
  the engine's declared tensor-parallel plan (``meshrl.engines.layout.EngineLayout``: fused
  q/k/v and gate/up, column/row shards, replicated tensors, tied embeddings) — the one place that
  maps HF names to engine names; nothing here repeats it. It is taken duck-typed so that this
  package stays below ``meshrl.engines`` in the layering.

Simplifications, on purpose: ``Partial`` and ``_StridedShard`` placements (FSDP2 + TP on the same
dim) are rejected with a message; every tensor of a source must live on meshes of one size.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import msgspec

Box = tuple[tuple[int, int], ...]
"""Half-open ``[start, stop)`` per dim."""


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when it is empty."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def shift(box: Box, delta: Sequence[int]) -> Box:
    """``box`` translated by ``delta`` per dim."""
    return tuple((a + d, b + d) for (a, b), d in zip(box, delta))


def to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _box_from_slices(slices: Sequence[slice], shape: Sequence[int]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(slices, shape))


# ---- source side --------------------------------------------------------------------------------


class SourceTensor(msgspec.Struct, frozen=True):
    """One trainer tensor: its global shape and dtype, and the box each source rank holds."""

    name: str
    """Hugging Face name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    shape: tuple[int, ...]
    """Global (unsharded) shape."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``"float32"``)."""
    owned: tuple[Box | None, ...]
    """Per source rank: the global box of its local tensor, None when it holds nothing."""


class SourceLayout(msgspec.Struct, frozen=True):
    """Every trainer tensor's placement over ``num_ranks`` source ranks."""

    num_ranks: int
    """Ranks of the source mesh (e.g. the FSDP dp size)."""
    tensors: tuple[SourceTensor, ...]
    """In the trainer's parameter order."""

    def index(self) -> dict[str, SourceTensor]:
        return {t.name: t for t in self.tensors}


def shard_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[int | None]) -> Box | None:
    """The global box at mesh coordinate ``coord``; ``placements[i]`` is the tensor dim that mesh
    dim ``i`` shards (DTensor's ``Shard(d)``), or None (``Replicate``). Mesh dims that shard the
    same tensor dim nest left to right, as in DTensor. None when the box is empty."""
    lo, hi = [0] * len(shape), [int(n) for n in shape]
    for mesh_dim, dim in enumerate(placements):
        if dim is None:
            continue
        if not 0 <= dim < len(shape):
            raise ValueError(f"Shard({dim}) on a tensor of shape {tuple(shape)}")
        size, k, r = hi[dim] - lo[dim], mesh_shape[mesh_dim], coord[mesh_dim]
        chunk = -(-size // k)  # torch.chunk: ceil, the tail ranks shorter or empty
        start = min(size, r * chunk)
        lo[dim], hi[dim] = lo[dim] + start, lo[dim] + min(size, start + chunk)
    box = tuple(zip(lo, hi))
    return box if all(a < b for a, b in box) else None


def _coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in mesh_shape:
        out = [c + (i,) for c in out for i in range(n)]
    return out  # row-major: flat rank order


def source_tensor(name: str, shape: Sequence[int], dtype: str, mesh_shape: Sequence[int],
                  placements: Sequence[int | None]) -> SourceTensor:
    """A tensor placed on a mesh (``placements`` as in ``shard_box``)."""
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{name}: {len(placements)} placements for a {len(mesh_shape)}-d mesh")
    owned = tuple(shard_box(shape, mesh_shape, c, placements) for c in _coords(mesh_shape))
    return SourceTensor(name=name, shape=tuple(int(n) for n in shape), dtype=dtype, owned=owned)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _placements(name: str, dt: Any) -> tuple[int | None, ...]:
    from torch.distributed.tensor import Replicate, Shard

    out: list[int | None] = []
    for p in dt.placements:
        if type(p) is Shard:
            out.append(p.dim if p.dim >= 0 else p.dim + dt.ndim)
        elif isinstance(p, Replicate):
            out.append(None)
        else:
            raise ValueError(f"{name}: placement {p} is not supported by reshard (only Shard and Replicate; "
                             "a Partial weight must be reduced first, _StridedShard means FSDP2+TP on one dim)")
    return tuple(out)


def source_layout(named: Iterable[tuple[str, Any]] | Mapping[str, Any], *, num_ranks: int | None = None
                  ) -> SourceLayout:
    """Read a trainer's layout from its (possibly FSDP2-sharded) parameters, e.g.
    ``source_layout(model.named_parameters())``. Every rank computes the same layout without
    communicating. ``num_ranks``: the source mesh size when no tensor is a DTensor (default 1).
    """
    from torch.distributed.tensor import DTensor

    items = list(named.items() if isinstance(named, Mapping) else named)
    tensors, size = [], None
    for name, t in items:
        if isinstance(t, DTensor):
            mesh_shape = tuple(t.device_mesh.shape)
            placements = _placements(name, t)
            st = source_tensor(name, t.shape, _dtype_name(t.dtype), mesh_shape, placements)
            n = math.prod(mesh_shape)
            coord = t.device_mesh.get_coordinate()
            if coord is not None:  # check our rule against what DTensor actually holds here
                mine = shard_box(t.shape, mesh_shape, coord, placements)
                got, want = tuple(t.to_local().shape), box_shape(mine) if mine else None
                if (want is None and t.to_local().numel()) or (want is not None and got != want):
                    raise ValueError(f"{name}: local shard {got} at mesh coordinate {coord} differs from "
                                     f"the chunk rule's {want} (placements {t.placements}, global {tuple(t.shape)})")
        else:
            n = None
            st = None
        if n is not None:
            if size is not None and size != n:
                raise ValueError(f"{name}: lives on a mesh of {n} ranks, other tensors on {size}")
            size = n
        tensors.append((name, t, st))
    size = size or num_ranks or 1
    if num_ranks is not None and num_ranks != size:
        raise ValueError(f"num_ranks={num_ranks}, but the DTensors live on meshes of {size} ranks")
    out = [st or source_tensor(name, t.shape, _dtype_name(t.dtype), (size,), (None,)) for name, t, st in tensors]
    return SourceLayout(num_ranks=size, tensors=tuple(out))


def local_tensors(named: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> dict[str, Any]:
    """This rank's local pieces (``DTensor.to_local()``), by name: what ``send`` reads from."""
    from torch.distributed.tensor import DTensor

    items = named.items() if isinstance(named, Mapping) else named
    return {n: (t.to_local() if isinstance(t, DTensor) else t).detach() for n, t in items}


# ---- destination side ---------------------------------------------------------------------------


class DestPiece(msgspec.Struct, frozen=True):
    """One box of an HF tensor that one destination rank stores in one of its parameters."""

    hf_name: str
    """Hugging Face name of the source tensor."""
    hf_box: Box
    """The region of the full HF tensor."""
    param: str
    """Engine parameter name (e.g. ``layers.0.qkv.weight``)."""
    local_box: Box
    """The region of this rank's local parameter; same extents as ``hf_box``."""


class DestRank(msgspec.Struct, frozen=True):
    """What one engine rank holds: its local parameters and where each HF box goes."""

    params: tuple[tuple[str, tuple[int, ...]], ...]
    """``(engine name, local shape)`` of every parameter, in engine order."""
    pieces: tuple[DestPiece, ...]


class DestLayout(msgspec.Struct, frozen=True):
    """Every engine rank of every engine replica; rank = replica * tp_size + tp_rank."""

    dtype: str
    """The engines' parameter dtype (what travels on the wire)."""
    tp_size: int
    """Ranks per engine replica."""
    hf_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """Global shape of every HF tensor the engines need."""
    ranks: tuple[DestRank, ...]

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)


def dest_layout(engine_layout: Any, tp_size: int = 1, replicas: int = 1, dtype: Any = "float32") -> DestLayout:
    """Destination layout of ``replicas`` engines of ``tp_size`` ranks each, from an
    ``EngineLayout`` (``meshrl.engines.layout``; its TP plan and HF name mapping)."""
    if tp_size < 1 or replicas < 1:
        raise ValueError(f"tp_size and replicas must be >= 1, got {tp_size}, {replicas}")
    engine_layout.validate_tp(tp_size)
    hf_shapes = {name: tuple(engine_layout.hf_shape(name)) for name in engine_layout.hf_index}
    per_tp = []
    for tp_rank in range(tp_size):
        params, pieces = [], []
        for pl in engine_layout.params.values():
            local = tuple(pl.local_shape(tp_size))
            params.append((pl.name, local))
            for hf_name, src, dst in pl.local_slices(tp_rank, tp_size):
                hf_box, local_box = _box_from_slices(src, hf_shapes[hf_name]), _box_from_slices(dst, local)
                if box_shape(hf_box) != box_shape(local_box):
                    raise AssertionError(f"{pl.name}: plan maps {hf_box} of {hf_name} onto {local_box}")
                pieces.append(DestPiece(hf_name=hf_name, hf_box=hf_box, param=pl.name, local_box=local_box))
        per_tp.append(DestRank(params=tuple(params), pieces=tuple(pieces)))
    return DestLayout(dtype=_dtype_name(dtype), tp_size=tp_size, hf_shapes=tuple(hf_shapes.items()),
                      ranks=tuple(per_tp) * replicas)
