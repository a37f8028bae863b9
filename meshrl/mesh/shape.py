"""Named, row-major shapes of meshes, their slices, and ``ValueMesh`` (one value per rank).

A ``Shape`` is an ordered list of dims (name → size) plus, for each position in row-major order,
the flat rank that position had in the mesh it was cut from. Slicing keeps those ranks, so
``mesh.slice(gpus=1)`` still knows it holds rank 1, 3, 5, ... of the spawned mesh.

Simplifications: shapes are small (hundreds of ranks at most), so slicing walks every position
instead of doing stride arithmetic; a slice of a slice is just another explicit list of ranks.
"""

from __future__ import annotations

import itertools
import math
from typing import Generic, Iterator, Mapping, TypeVar

R = TypeVar("R")


class Shape:
    """Dims (ordered name → size) and the flat rank held at each row-major position."""

    __slots__ = ("labels", "sizes", "ranks")

    def __init__(self, labels: tuple[str, ...], sizes: tuple[int, ...], ranks: tuple[int, ...] | None = None):
        if len(labels) != len(sizes):
            raise ValueError(f"{len(labels)} dim names for {len(sizes)} sizes")
        if len(set(labels)) != len(labels):
            raise ValueError(f"dim names must be unique, got {labels}")
        for label, size in zip(labels, sizes):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"dim {label!r} must have an integer size >= 1, got {size!r}")
        n = math.prod(sizes)
        self.labels = tuple(labels)
        self.sizes = tuple(sizes)
        self.ranks = tuple(range(n)) if ranks is None else tuple(ranks)
        if len(self.ranks) != n:
            raise ValueError(f"shape {dict(zip(labels, sizes))} needs {n} ranks, got {len(self.ranks)}")

    @classmethod
    def from_dims(cls, dims: Mapping[str, int]) -> Shape:
        return cls(tuple(dims), tuple(dims.values()))

    def __len__(self) -> int:
        return len(self.ranks)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Shape)
            and (self.labels, self.sizes, self.ranks) == (other.labels, other.sizes, other.ranks)
        )

    def __hash__(self) -> int:
        return hash((self.labels, self.sizes, self.ranks))

    def __repr__(self) -> str:
        return f"Shape({self.dims})"

    @property
    def dims(self) -> dict[str, int]:
        return dict(zip(self.labels, self.sizes))

    def coords(self, position: int) -> dict[str, int]:
        """Coordinates (dim → index) of the row-major ``position``."""
        out: dict[str, int] = {}
        for label, size in zip(reversed(self.labels), reversed(self.sizes)):
            position, out[label] = divmod(position, size)
        return {label: out[label] for label in self.labels}

    def position(self, coords: Mapping[str, int]) -> int:
        """Row-major position of ``coords``, which must name every dim."""
        missing = [label for label in self.labels if label not in coords]
        unknown = [key for key in coords if key not in self.labels]
        if missing or unknown:
            raise KeyError(
                f"coordinates {dict(coords)} must name exactly the dims {self.labels}"
                + (f"; missing {missing}" if missing else "")
                + (f"; unknown {unknown}" if unknown else "")
            )
        pos = 0
        for label, size in zip(self.labels, self.sizes):
            index = coords[label]
            if not 0 <= index < size:
                raise IndexError(f"dim {label!r} has size {size}; index {index} is out of range")
            pos = pos * size + index
        return pos

    def slice(self, **selection: int | slice) -> tuple[Shape, list[int]]:
        """The sub-shape and the positions (into this shape) it keeps.

        ``dim=int`` drops the dim (negative indices count from the end); ``dim=slice(...)`` keeps it.
        """
        unknown = [key for key in selection if key not in self.labels]
        if unknown:
            raise KeyError(f"no dim named {unknown[0]!r}; this mesh has dims {self.labels}")
        kept: list[range | int] = []
        labels: list[str] = []
        sizes: list[int] = []
        for label, size in zip(self.labels, self.sizes):
            sel = selection.get(label, slice(None))
            if isinstance(sel, slice):
                indices = range(size)[sel]
                if len(indices) == 0:
                    raise IndexError(f"slice {sel} of dim {label!r} (size {size}) is empty")
                kept.append(indices)
                labels.append(label)
                sizes.append(len(indices))
            elif isinstance(sel, int) and not isinstance(sel, bool):
                if not -size <= sel < size:
                    raise IndexError(f"dim {label!r} has size {size}; index {sel} is out of range")
                kept.append(sel % size)
            else:
                raise TypeError(f"dim {label!r} takes an int or a slice, got {sel!r}")
        axes = [k if isinstance(k, range) else (k,) for k in kept]
        positions = []
        for idx in itertools.product(*axes):
            pos = 0
            for i, size in zip(idx, self.sizes):
                pos = pos * size + i
            positions.append(pos)
        return Shape(tuple(labels), tuple(sizes), tuple(self.ranks[p] for p in positions)), positions

    def flatten(self, name: str) -> Shape:
        """All dims merged into one named ``name`` (row-major order is unchanged)."""
        return Shape((name,), (len(self.ranks),), self.ranks)


class ValueMesh(Generic[R]):
    """One value per actor of a mesh, in the mesh's row-major order, addressable by coordinates."""

    def __init__(self, shape: Shape, values: list[R]):
        if len(values) != len(shape):
            raise ValueError(f"{len(values)} values for a mesh of {len(shape)}")
        self._shape = shape
        self._values = values

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.dims

    @property
    def ranks(self) -> tuple[int, ...]:
        """The flat rank (in the spawned mesh) that produced each value, row-major."""
        return self._shape.ranks

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> list[R]:
        """The values in row-major order."""
        return list(self._values)

    def items(self) -> Iterator[tuple[dict[str, int], R]]:
        """(coordinates, value) pairs in row-major order."""
        for pos, value in enumerate(self._values):
            yield self._shape.coords(pos), value

    def item(self, **coords: int) -> R:
        """The value at ``coords`` (every dim named); no arguments on a one-element mesh."""
        if not coords and len(self._values) == 1:
            return self._values[0]
        return self._values[self._shape.position(coords)]

    def __repr__(self) -> str:
        return f"ValueMesh({self.sizes}, {self._values!r})"
