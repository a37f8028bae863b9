"""Shapes, slicing and ValueMesh, without Ray: coordinates and ranks must survive every view."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshrl.mesh.shape import Shape, ValueMesh


def test_coords_are_row_major():
    shape = Shape.from_dims({"hosts": 2, "gpus": 3})
    assert [shape.coords(p) for p in range(6)] == [
        {"hosts": h, "gpus": g} for h, g in itertools.product(range(2), range(3))
    ]
    assert shape.position({"hosts": 1, "gpus": 2}) == 5


def test_int_drops_a_dim_and_slice_keeps_it():
    shape = Shape.from_dims({"dp": 2, "tp": 4})
    dropped, positions = shape.slice(dp=1)
    assert dropped.dims == {"tp": 4}
    assert dropped.ranks == (4, 5, 6, 7) and positions == [4, 5, 6, 7]
    kept, _ = shape.slice(tp=slice(1, 3))
    assert kept.dims == {"dp": 2, "tp": 2}
    assert kept.ranks == (1, 2, 5, 6)
    assert shape.slice(tp=-1)[0].ranks == (3, 7)
    # A slice of a slice still reports ranks of the original mesh.
    assert kept.slice(dp=1, tp=0)[0].ranks == (5,)


def test_flatten_keeps_order():
    shape, _ = Shape.from_dims({"a": 2, "b": 3}).slice(b=slice(1, None))
    flat = shape.flatten("all")
    assert flat.dims == {"all": 4} and flat.ranks == (1, 2, 4, 5)


@pytest.mark.parametrize(
    "selection, error, words",
    [
        ({"nope": 0}, KeyError, "no dim named 'nope'"),
        ({"a": 2}, IndexError, "dim 'a' has size 2"),
        ({"a": slice(5, 9)}, IndexError, "is empty"),
        ({"a": "0"}, TypeError, "takes an int or a slice"),
    ],
)
def test_bad_slices_name_the_problem(selection, error, words):
    with pytest.raises(error, match=words):
        Shape.from_dims({"a": 2, "b": 2}).slice(**selection)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="size >= 1"):
        Shape.from_dims({"a": 0})
    with pytest.raises(ValueError, match="unique"):
        Shape(("a", "a"), (1, 1))


def test_value_mesh_accessors():
    shape, _ = Shape.from_dims({"dp": 2, "tp": 2}).slice(tp=slice(0, 2))
    vm = ValueMesh(shape, ["a", "b", "c", "d"])
    assert len(vm) == 4 and vm.sizes == {"dp": 2, "tp": 2}
    assert vm.values() == ["a", "b", "c", "d"]
    assert list(vm.items())[2] == ({"dp": 1, "tp": 0}, "c")
    assert vm.item(dp=1, tp=1) == "d"
    with pytest.raises(KeyError, match="missing"):
        vm.item(dp=1)
    with pytest.raises(ValueError, match="3 values for a mesh of 4"):
        ValueMesh(shape, [1, 2, 3])
    one = ValueMesh(Shape.from_dims({"x": 1}), [42])
    assert one.item() == 42


dims_strategy = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(
    lambda sizes: {f"d{i}": s for i, s in enumerate(sizes)}
)


@given(dims_strategy, st.data())
def test_slicing_selects_exactly_the_matching_coordinates(dims, data):
    shape = Shape.from_dims(dims)
    selection = {}
    for label, size in dims.items():
        kind = data.draw(st.sampled_from(["all", "int", "slice"]))
        if kind == "int":
            selection[label] = data.draw(st.integers(0, size - 1))
        elif kind == "slice":
            start = data.draw(st.integers(0, size - 1))
            selection[label] = slice(start, data.draw(st.integers(start + 1, size)))
    sub, positions = shape.slice(**selection)

    def selected(coords):
        for label, sel in selection.items():
            index = coords[label]
            if isinstance(sel, int) and index != sel:
                return False
            if isinstance(sel, slice) and index not in range(dims[label])[sel]:
                return False
        return True

    expected = [p for p in range(len(shape)) if selected(shape.coords(p))]
    assert positions == expected
    assert sub.ranks == tuple(expected)
    assert set(sub.labels) == {l for l in dims if not isinstance(selection.get(l), int)}
