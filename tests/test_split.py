"""Batch splitting across replicas: TF's ceil rule, leaf by leaf, as views."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cudist._kernels import get_backend
from cudist._kernels._split import split, split_sizes


@pytest.mark.parametrize(
    "b, n, expected",
    [(3, 2, [2, 1]), (4, 3, [2, 2, 0]), (8, 3, [3, 3, 2]), (5, 4, [2, 2, 1, 0]), (0, 3, [0, 0, 0]), (7, 1, [7]),
     (2, 4, [1, 1, 0, 0]), (9, 3, [3, 3, 3])],
)
def test_split_sizes_ceil_rule(b, n, expected):
    assert split_sizes(b, n) == expected


@settings(max_examples=200, deadline=None)
@given(b=st.integers(0, 1000), n=st.integers(1, 16))
def test_split_sizes_properties(b, n):
    sizes = split_sizes(b, n)
    per = -(-b // n)
    assert len(sizes) == n and sum(sizes) == b
    assert all(0 <= s <= per for s in sizes)
    # Full replicas first, then at most one partial one, then empty ones.
    full = [s == per for s in sizes]
    assert full == sorted(full, reverse=True)
    assert sum(0 < s < per for s in sizes) <= 1


@pytest.mark.parametrize("b, n, expected", [(3, 2, [2, 1]), (4, 3, [2, 2, 0]), (8, 3, [3, 3, 2]), (5, 4, [2, 2, 1, 0])])
def test_split_array_pieces_are_ordered_views(b, n, expected):
    x = np.random.default_rng(0).standard_normal((b, 3)).astype(np.float32)
    pieces = split(x, n)
    assert [p.shape for p in pieces] == [(s, 3) for s in expected]
    np.testing.assert_array_equal(np.concatenate(pieces), x)
    for p in pieces:
        if p.size:
            assert np.shares_memory(p, x), "pieces must be views, not copies"
        assert p.dtype == x.dtype


def test_split_nested_structures_leaf_by_leaf():
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal((5, 2)), "y": (np.arange(1, 6), {"w": rng.standard_normal(5)})}
    pieces = split(batch, 4)
    assert len(pieces) == 4
    sizes = [2, 2, 1, 0]
    start = 0
    for piece, s in zip(pieces, sizes):
        assert set(piece) == {"x", "y"} and isinstance(piece["y"], tuple) and set(piece["y"][1]) == {"w"}
        np.testing.assert_array_equal(piece["x"], batch["x"][start : start + s])
        np.testing.assert_array_equal(piece["y"][0], batch["y"][0][start : start + s])
        np.testing.assert_array_equal(piece["y"][1]["w"], batch["y"][1]["w"][start : start + s])
        if s:
            assert np.shares_memory(piece["x"], batch["x"])
            assert np.shares_memory(piece["y"][1]["w"], batch["y"][1]["w"])
        start += s


def test_split_via_backend_method():
    x = np.arange(1, 9, dtype=np.int64)
    pieces = get_backend("numpy").split(x, 3)
    assert [p.tolist() for p in pieces] == [[1, 2, 3], [4, 5, 6], [7, 8]]


def test_split_scalar_leaf_is_an_error():
    with pytest.raises(ValueError, match="leaf 1 is a scalar"):
        split((np.ones(4), 3.0), 2)
    with pytest.raises(ValueError, match="scalar"):
        split(np.float32(2.0), 2)


def test_split_mismatched_batch_sizes_is_an_error():
    with pytest.raises(ValueError, match="leaf 1 has batch size 3 but leaf 0 has batch size 4"):
        split({"a": np.ones((4, 2)), "b": np.ones(3)}, 2)


def test_split_bad_replica_count():
    with pytest.raises(ValueError, match="must be >= 1"):
        split(np.ones(4), 0)
    with pytest.raises(TypeError, match="n must be an int"):
        split(np.ones(4), 2.0)
