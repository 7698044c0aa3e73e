"""cudist.data.Dataset against tf.data's observed behaviour (TF 2.21) and NumPy references."""

from __future__ import annotations

import collections
import gc
import threading
import time

import numpy as np
import optree
import pytest

from cudist import data
from cudist.data import AUTOTUNE, Dataset, TensorSpec


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("cudist-") and t.is_alive()]


def _wait_no_prefetch_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while _prefetch_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return _prefetch_threads()


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    yield
    assert _wait_no_prefetch_threads() == []


def _eq_elements(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# --------------------------------------------------------------------------------- sources
@pytest.mark.parametrize("args", [(5,), (2, 10), (2, 10, 3), (10, 2, -3), (0,), (3, 3)])
def test_range_matches_python_range(args):
    ds = Dataset.range(*args)
    got = list(ds)
    assert [int(x) for x in got] == list(range(*args))
    assert all(type(x) is np.int64 for x in got)
    assert ds.cardinality() == len(range(*args)) == len(ds)
    assert ds.element_spec == TensorSpec((), np.dtype(np.int64))


def test_range_output_type_and_errors():
    assert list(Dataset.range(3, output_type=np.int32))[2].dtype == np.int32
    with pytest.raises(ValueError, match="step must be a non-zero integer"):
        Dataset.range(0, 5, 0)
    with pytest.raises(TypeError, match="must be an int"):
        Dataset.range(2.5)
    with pytest.raises(TypeError, match="1 to 3 positional"):
        Dataset.range()


def test_from_tensor_slices_nested_random():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 3)).astype(np.float32)
    y = rng.integers(-5, 5, size=7).astype(np.int16)
    z = rng.standard_normal((7, 2, 2))
    ds = Dataset.from_tensor_slices((x, {"y": y, "z": z}))
    assert ds.element_spec == (
        TensorSpec((3,), np.dtype(np.float32)),
        {"y": TensorSpec((), np.dtype(np.int16)), "z": TensorSpec((2, 2), np.dtype(np.float64))},
    )
    elements = list(ds)
    assert len(elements) == 7 == ds.cardinality()
    for i, (a, d) in enumerate(elements):
        np.testing.assert_array_equal(a, x[i])
        assert d["y"] == y[i] and d["y"].dtype == np.int16
        np.testing.assert_array_equal(d["z"], z[i])
    # Elements are read-only, as tensors are immutable.
    with pytest.raises(ValueError):
        elements[0][0][0] = 1.0


def test_from_tensor_slices_python_lists_use_tf_dtypes():
    # TF converts Python ints to int32 and floats to float32; a list is one component.
    assert Dataset.from_tensor_slices([1.5, 2.5]).element_spec == TensorSpec((), np.dtype(np.float32))
    ds = Dataset.from_tensor_slices([[1, 2], [3, 4]])
    assert ds.element_spec == TensorSpec((2,), np.dtype(np.int32))
    _eq_elements(list(ds), [[1, 2], [3, 4]])
    assert Dataset.from_tensor_slices(([1, 2], [3, 4])).element_spec == (
        TensorSpec((), np.dtype(np.int32)),
        TensorSpec((), np.dtype(np.int32)),
    )
    # NumPy values keep their dtype.
    assert Dataset.from_tensor_slices([np.float64(1), np.float64(2)]).element_spec.dtype == np.float64


def test_from_tensor_slices_errors():
    with pytest.raises(ValueError, match="component 1 has 3 rows but component 0 has 2"):
        Dataset.from_tensor_slices(([1, 2], [3, 4, 5]))
    with pytest.raises(ValueError, match="component 0 is a scalar"):
        Dataset.from_tensor_slices(5)
    with pytest.raises(ValueError, match="non-rectangular"):
        Dataset.from_tensor_slices([[1, 2], [3]])
    with pytest.raises(ValueError, match="no components"):
        Dataset.from_tensor_slices(())
    with pytest.raises(TypeError, match="can't convert a object to an array"):
        Dataset.from_tensor_slices((np.arange(2), object()))


def test_from_tensors():
    ds = Dataset.from_tensors([[1, 2], [3, 4]])
    assert ds.element_spec == TensorSpec((2, 2), np.dtype(np.int32))
    assert ds.cardinality() == 1
    (only,) = list(ds)
    np.testing.assert_array_equal(only, [[1, 2], [3, 4]])
    assert Dataset.from_tensors(3).element_spec == TensorSpec((), np.dtype(np.int32))
    assert Dataset.from_tensors(np.float64(3)).element_spec == TensorSpec((), np.dtype(np.float64))
    assert Dataset.from_tensors(1).batch(2).element_spec == TensorSpec((None,), np.dtype(np.int32))


def test_from_generator_reruns_each_iteration():
    calls = []

    def gen(n):
        calls.append(n)
        for i in range(n):
            yield (np.full(2, i, np.float32), i)

    ds = Dataset.from_generator(gen, args=(3,))
    assert ds.cardinality() == data.UNKNOWN_CARDINALITY
    first, second = list(ds), list(ds)
    assert [int(b) for _, b in first] == [0, 1, 2] == [int(b) for _, b in second]
    assert ds.element_spec == (TensorSpec((2,), np.dtype(np.float32)), TensorSpec((), np.dtype(np.int32)))
    sig = TensorSpec((None,), np.dtype(np.float32))
    assert Dataset.from_generator(gen, args=(1,), output_signature=sig).element_spec == sig
    with pytest.raises(TypeError, match="must be callable"):
        Dataset.from_generator(gen(2))


# --------------------------------------------------------------------------------- batch
@pytest.mark.parametrize("n,b", [(10, 3), (9, 3), (1, 4), (5, 1), (0, 2)])
@pytest.mark.parametrize("drop", [False, True])
def test_batch_matches_numpy(n, b, drop):
    rng = np.random.default_rng(n * 10 + b)
    x = rng.standard_normal((n, 2)).astype(np.float32)
    y = rng.integers(0, 100, size=n)
    ds = Dataset.from_tensor_slices({"x": x, "y": y}).batch(b, drop_remainder=drop)
    ends = list(range(b, n + 1, b)) + ([] if drop or n % b == 0 else [n])
    starts = [e - b if e % b == 0 else e - n % b for e in ends]
    got = list(ds)
    assert len(got) == len(ends) == ds.cardinality()
    for el, s, e in zip(got, starts, ends):
        np.testing.assert_array_equal(el["x"], x[s:e])
        np.testing.assert_array_equal(el["y"], y[s:e])
        assert el["x"].dtype == np.float32
    assert ds.element_spec["x"] == TensorSpec((b if drop else None, 2), np.dtype(np.float32))


def test_batch_scalars_and_nested_batch_spec():
    assert [b.tolist() for b in Dataset.range(5).batch(2)] == [[0, 1], [2, 3], [4]]
    assert Dataset.range(4).batch(2).batch(2).element_spec == TensorSpec((None, None), np.dtype(np.int64))
    assert Dataset.range(4).batch(2, True).batch(2).element_spec == TensorSpec((None, 2), np.dtype(np.int64))
    assert Dataset.range(3).repeat().batch(2).cardinality() == data.INFINITE_CARDINALITY


def test_batch_errors():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="batch_size must be greater than zero"):
            Dataset.range(4).batch(bad)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        Dataset.range(4).batch(2.0)
    ragged = Dataset.range(1, 4).map(lambda i: np.zeros(int(i), np.float32)).batch(3)
    with pytest.raises(ValueError, match=r"different shapes in component 0: element 0 has shape \(1,\)"):
        list(ragged)


# --------------------------------------------------------------------------------- shard/repeat/take
@pytest.mark.parametrize("n", [0, 1, 7, 10])
@pytest.mark.parametrize("shards", [1, 3])
def test_shard(n, shards):
    for index in range(shards):
        ds = Dataset.range(n).shard(shards, index)
        assert [int(v) for v in ds] == list(range(index, n, shards))
        assert ds.cardinality() == len(range(index, n, shards))


def test_shard_errors():
    with pytest.raises(ValueError, match=r"index must be between 0 and 1 \(currently index = 2\)"):
        Dataset.range(4).shard(2, 2)
    with pytest.raises(ValueError, match=r"index must be between 0 and 1 \(currently index = -1\)"):
        Dataset.range(4).shard(2, -1)
    with pytest.raises(ValueError, match=r"num_shards must be greater than zero \(currently num_shards = 0\)"):
        Dataset.range(4).shard(0, 0)


def test_repeat_take_skip():
    assert [int(v) for v in Dataset.range(3).repeat(2)] == [0, 1, 2, 0, 1, 2]
    assert Dataset.range(3).repeat(2).cardinality() == 6
    assert Dataset.range(3).repeat(0).cardinality() == 0 and list(Dataset.range(3).repeat(0)) == []
    forever = Dataset.range(3).repeat()
    assert forever.cardinality() == data.INFINITE_CARDINALITY
    assert [int(v) for v in forever.take(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert forever.take(7).cardinality() == 7
    # Repeating an empty dataset forever ends instead of spinning.
    assert list(Dataset.range(0).repeat().take(3)) == []
    assert Dataset.range(3).take(-1).cardinality() == 3 and len(list(Dataset.range(3).take(-2))) == 3
    assert Dataset.range(3).take(5).cardinality() == 3
    assert [int(v) for v in Dataset.range(5).skip(3)] == [3, 4]
    assert Dataset.range(5).skip(9).cardinality() == 0


def test_len_like_tf():
    assert len(Dataset.range(4).batch(3)) == 2
    with pytest.raises(TypeError, match="The dataset is infinite."):
        len(Dataset.range(3).repeat())
    with pytest.raises(TypeError, match="The dataset length is unknown."):
        len(Dataset.range(3).filter(lambda x: x > 0))


def test_reiterable_starts_over():
    ds = Dataset.range(6).map(lambda x: x * 2).batch(4).prefetch(1)
    a = [v.tolist() for v in ds]
    b = [v.tolist() for v in ds]
    assert a == b == [[0, 2, 4, 6], [8, 10]]
    it1, it2 = iter(ds), iter(ds)
    assert next(it1).tolist() == next(it2).tolist()


# --------------------------------------------------------------------------------- map & co
def test_map_unpacks_tuples_only():
    ds = Dataset.from_tensor_slices(([1, 2], [3, 4])).map(lambda a, b: a + b)
    assert [int(v) for v in ds] == [4, 6]
    ds = Dataset.from_tensor_slices({"a": [1, 2], "b": [3, 4]}).map(lambda d: d["a"] * d["b"])
    assert [int(v) for v in ds] == [3, 8]
    Point = collections.namedtuple("Point", "x y")
    ds = Dataset.from_tensor_slices(Point(np.arange(2.0), np.arange(2.0) + 5)).map(lambda p: p.y - p.x)
    assert [float(v) for v in ds] == [5.0, 5.0]


def test_map_output_conversion_and_spec():
    ds = Dataset.from_tensor_slices(np.arange(3.0)).map(lambda x: (x, 1))
    assert ds.element_spec == (TensorSpec((), np.dtype(np.float64)), TensorSpec((), np.dtype(np.int32)))
    assert ds.cardinality() == 3
    # A varying batch dimension stays unknown through map.
    assert Dataset.range(5).batch(2).map(lambda x: x * 2).element_spec == TensorSpec((None,), np.dtype(np.int64))
    out = list(Dataset.range(2).map(lambda x: [x, x]))
    assert out[1].tolist() == [1, 1]
    with pytest.raises(TypeError, match="must be callable"):
        Dataset.range(2).map(3)


def test_filter_enumerate_zip_unbatch():
    assert [int(v) for v in Dataset.range(10).filter(lambda x: x % 3 == 0)] == [0, 3, 6, 9]
    en = list(Dataset.range(3, 5).enumerate(start=10))
    assert [(int(i), int(v)) for i, v in en] == [(10, 3), (11, 4)]
    z = Dataset.zip((Dataset.range(3), Dataset.range(10, 20)))
    assert z.cardinality() == 3 and [(int(a), int(b)) for a, b in z] == [(0, 10), (1, 11), (2, 12)]
    x = np.random.default_rng(1).standard_normal((5, 2))
    rows = list(Dataset.from_tensor_slices(x).batch(2).unbatch())
    np.testing.assert_array_equal(np.stack(rows), x)
    with pytest.raises(ValueError, match="scalar boolean"):
        list(Dataset.range(2).batch(2).filter(lambda x: x > 0))


def test_shuffle_is_a_seeded_permutation():
    ds = Dataset.range(50).shuffle(10, seed=3)
    a, b = [int(v) for v in ds], [int(v) for v in ds]
    assert sorted(a) == list(range(50)) and a != list(range(50))
    assert a != b  # reshuffled each iteration
    fixed = Dataset.range(50).shuffle(10, seed=3, reshuffle_each_iteration=False)
    assert [int(v) for v in fixed] == [int(v) for v in fixed]
    assert [int(v) for v in Dataset.range(50).shuffle(10, seed=3)] == a  # the seed fixes the sequence
    with pytest.raises(ValueError, match="buffer_size must be greater than zero"):
        Dataset.range(3).shuffle(0)


# --------------------------------------------------------------------------------- prefetch
def test_prefetch_same_elements_and_sizes():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((23, 3)).astype(np.float32)
    ref = list(Dataset.from_tensor_slices(x).batch(4))
    for size in (AUTOTUNE, 0, 1, 3, 100):
        got = list(Dataset.from_tensor_slices(x).batch(4).prefetch(size))
        _eq_elements(got, ref)
        # Through map the elements are made in a prefetch thread.
        got = list(Dataset.from_tensor_slices(x).map(lambda r: r).batch(4).prefetch(size))
        _eq_elements(got, ref)
    assert data.AUTOTUNE == -1
    with pytest.raises(ValueError, match="buffer_size must be >= 0 or AUTOTUNE"):
        Dataset.range(3).prefetch(-2)


def test_prefetch_early_break_stops_thread():
    ds = Dataset.range(10**9).map(lambda x: x + 1).prefetch(2)
    for i, v in enumerate(ds):
        assert int(v) == i + 1
        if i == 5:
            break
    assert _wait_no_prefetch_threads() == []
    # Nested prefetch over an infinite dataset, abandoned mid-way (map: elements worth a thread).
    it = iter(Dataset.range(3).repeat().map(lambda v: v).prefetch(1).batch(2).prefetch(AUTOTUNE))
    assert next(it).tolist() == [0, 1]
    assert len(_prefetch_threads()) == 2
    del it
    assert _wait_no_prefetch_threads() == []
    # Rows of arrays and batches gathered from them cost less than a hand-off: no thread.
    it = iter(Dataset.range(3).repeat().prefetch(1).batch(2).prefetch(AUTOTUNE))
    assert next(it).tolist() == [0, 1] and _prefetch_threads() == []


def test_prefetch_propagates_errors():
    def boom(x):
        if x == 3:
            raise KeyError("bad element 3")
        return x

    it = iter(Dataset.range(6).map(boom).prefetch(2))
    assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad element 3"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


# --------------------------------------------------------------------------------- iterables
class _FakeLoader:
    """A torch DataLoader-like object: re-iterable, has __len__, yields (x, y) batches."""

    def __init__(self, x, y, b):
        self.x, self.y, self.b = x, y, b

    def __len__(self):
        return -(-len(self.x) // self.b)

    def __iter__(self):
        for s in range(0, len(self.x), self.b):
            yield self.x[s : s + self.b], self.y[s : s + self.b]


class _ArrayLike:
    """Has only __array__, like a CPU torch tensor."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a


def test_as_dataset_iterables():
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((7, 2)), rng.integers(0, 3, 7)
    loader = data.as_dataset(_FakeLoader(x, y, 3))
    assert loader.cardinality() == 3
    assert loader.element_spec == (TensorSpec((3, 2), np.dtype(np.float64)), TensorSpec((3,), y.dtype))
    for _ in range(2):  # re-iterable
        got = list(loader)
        np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), x)
    batches = [np.arange(4), np.arange(4, 6)]
    assert [b.tolist() for b in data.as_dataset(batches)] == [[0, 1, 2, 3], [4, 5]]
    gen = data.as_dataset(iter([_ArrayLike(np.ones(2)), _ArrayLike(np.zeros(2))]))
    assert gen.element_spec == TensorSpec((2,), np.dtype(np.float64))  # peeking loses nothing
    assert [b.tolist() for b in gen] == [[1.0, 1.0], [0.0, 0.0]]
    assert list(gen) == []  # a one-pass iterator
    assert data.as_dataset(Dataset.range(2)) is not None


@pytest.mark.parametrize("bad", [np.arange(4), {"a": 1}, 3, "abc"])
def test_as_dataset_rejects(bad):
    with pytest.raises(TypeError, match="expected a cudist.data.Dataset or an iterable of batches"):
        data.as_dataset(bad)


# --------------------------------------------------------------------------------- vectorized batch
# Batches of row sources (from_tensor_slices / from_tensors / range through shuffle, take, skip,
# shard, repeat) are gathered at once; everything else stacks element by element. Every test
# below compares the two paths (data._VECTORIZE toggles the fast one) on the same pipelines.
_DTYPES = [
    np.float32, np.float64, np.float16, np.int8, np.int32, np.int64, np.uint8, np.uint16, np.bool_, np.complex64
]
Pair = collections.namedtuple("Pair", "a b")


def _random_leaf(rng, n):
    dtype = np.dtype(_DTYPES[rng.integers(len(_DTYPES))])
    shape = (n, *rng.integers(0, 4, size=rng.integers(0, 3)))
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape, endpoint=True).astype(dtype)
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    if a.ndim == 2 and a.shape[1] > 1 and rng.random() < 0.3:
        a = np.asfortranarray(a)  # a non-C-contiguous source
    return a


def _random_structure(rng, n, depth=0):
    kind = rng.integers(0, 5 if depth < 2 else 1)
    if kind == 0:
        return _random_leaf(rng, n)
    if kind == 1:
        return tuple(_random_structure(rng, n, depth + 1) for _ in range(rng.integers(1, 4)))
    if kind == 2:
        return {k: _random_structure(rng, n, depth + 1) for k in rng.permutation(["x", "y", "z"])[: rng.integers(1, 4)]}
    if kind == 3:
        return Pair(_random_structure(rng, n, depth + 1), _random_leaf(rng, n))
    return (_random_leaf(rng, n), {"m": _random_leaf(rng, n)})


def _random_pipeline(seed):
    """(factory, description): the factory builds the same pipeline (same seeds) on every call."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 30))
    kind = rng.integers(0, 4)
    if kind == 0:
        start, step = int(rng.integers(-20, 20)), int(rng.choice([-3, -1, 1, 2, 5]))
        dtype = [np.int64, np.int32, np.int16, np.uint32][rng.integers(4)]
        if np.dtype(dtype).kind == "u":
            start, step = abs(start), abs(step)
        src_args = (start, start + step * n, step)
        desc = f"range{src_args} {dtype.__name__}"
        source = lambda: Dataset.range(*src_args, output_type=dtype)  # noqa: E731
    elif kind == 1:
        struct = _random_structure(rng, 1)
        source, desc = lambda: Dataset.from_tensors(_row0(struct)), "from_tensors"  # noqa: E731
    else:
        struct = _random_structure(rng, n)
        source, desc = lambda: Dataset.from_tensor_slices(struct), f"from_tensor_slices(n={n})"  # noqa: E731
    ops = []
    for _ in range(rng.integers(0, 5)):
        op = rng.integers(0, 6)
        if op == 0:
            ops.append(("shuffle", int(rng.integers(1, 40)), int(rng.integers(1000)), bool(rng.random() < 0.7)))
        elif op == 1:
            ops.append(("take", int(rng.integers(-1, 40))))
        elif op == 2:
            ops.append(("skip", int(rng.integers(-1, 12))))
        elif op == 3:
            k = int(rng.integers(1, 5))
            ops.append(("shard", k, int(rng.integers(k))))
        elif op == 4:
            ops.append(("repeat", int(rng.integers(0, 4))))
        else:
            ops.append(("repeat_take", int(rng.integers(0, 60))))
    b, drop = int(rng.integers(1, 12)), bool(rng.random() < 0.5)
    after = ["", "repeat", "take"][rng.integers(3)]

    def build():
        ds = source()
        for op in ops:
            if op[0] == "shuffle":
                ds = ds.shuffle(op[1], seed=op[2], reshuffle_each_iteration=op[3])
            elif op[0] == "take":
                ds = ds.take(op[1])
            elif op[0] == "skip":
                ds = ds.skip(op[1])
            elif op[0] == "shard":
                ds = ds.shard(op[1], op[2])
            elif op[0] == "repeat":
                ds = ds.repeat(op[1])
            else:
                ds = ds.repeat().take(op[1])
        ds = ds.batch(b, drop_remainder=drop)
        if after == "repeat":
            ds = ds.repeat(2)
        elif after == "take":
            ds = ds.take(2)
        return ds

    return build, f"{desc} {ops} batch({b}, drop={drop}) {after}"


def _row0(struct):
    """Row 0 of every leaf of a structure (the element of a from_tensors source)."""
    return optree.tree_map(lambda a: a[0], struct)


def _epochs(ds, vectorize, monkeypatch, partial):
    """Three passes: the first stopped after ``partial`` batches, the others complete."""
    monkeypatch.setattr(data, "_VECTORIZE", vectorize)
    out = []
    it = iter(ds)
    out.append([b for _, b in zip(range(partial), it)])
    del it
    out.append(list(ds))
    out.append(list(ds))
    return out


def _assert_same_batches(fast, slow, what):
    assert len(fast) == len(slow), f"{what}: {len(fast)} vs {len(slow)} batches"
    for i, (f, s) in enumerate(zip(fast, slow)):
        fl, ft = optree.tree_flatten(f)
        sl, st = optree.tree_flatten(s)
        assert ft == st, f"{what}: batch {i} structure {ft} vs {st}"
        assert type(f) is type(s)
        for fa, sa in zip(fl, sl):
            assert type(fa) is type(sa) is np.ndarray, what
            assert fa.dtype == sa.dtype and fa.shape == sa.shape, (
                f"{what}: batch {i} {fa.dtype}{fa.shape} vs {sa.dtype}{sa.shape}"
            )
            np.testing.assert_array_equal(fa, sa, err_msg=f"{what}: batch {i}")
            assert not fa.flags.writeable and not sa.flags.writeable, what
            assert fa.flags.c_contiguous and sa.flags.c_contiguous, what


@pytest.mark.parametrize("block", range(8))
def test_vectorized_batch_matches_elementwise_on_random_pipelines(block, monkeypatch):
    if block % 2:
        monkeypatch.setattr(data, "_SHUFFLE_CHUNK", 3)  # long runs shuffled in several steps
    # Repeated static passes are tiled up to _TILE positions; small values stream long passes.
    monkeypatch.setattr(data, "_TILE", [1, 7, 4096, 12][block % 4])
    for seed in range(block * 40, block * 40 + 40):
        build, what = _random_pipeline(seed)
        fast_ds, slow_ds = build(), build()
        assert fast_ds.element_spec == slow_ds.element_spec and fast_ds.cardinality() == slow_ds.cardinality()
        partial = seed % 4
        fast = _epochs(fast_ds, True, monkeypatch, partial)
        slow = _epochs(slow_ds, False, monkeypatch, partial)
        for e, (f, s) in enumerate(zip(fast, slow)):
            _assert_same_batches(f, s, f"seed {seed} epoch {e}: {what}")
        if fast_ds.cardinality() >= 0:
            assert len(fast[1]) == fast_ds.cardinality(), what


def test_vectorized_batch_is_used_and_slices_views():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((20, 3)).astype(np.float32)
    y = rng.integers(0, 9, 20).astype(np.int32)
    ds = Dataset.from_tensor_slices((x, y))
    for pipeline in (ds, ds.shuffle(5, seed=1), ds.take(7), ds.skip(2), ds.shard(3, 1), ds.repeat(2), ds.prefetch(1)):
        assert pipeline._rows is not None
    assert Dataset.range(5)._rows is not None and Dataset.from_tensors(x)._rows is not None
    for pipeline in (ds.map(lambda a, b: (a, b)), ds.filter(lambda a, b: b > 0), ds.batch(2), ds.enumerate()):
        assert pipeline._rows is None
    xb, yb = next(iter(ds.batch(8)))
    # Consecutive rows of a contiguous source are views of it (no copy), read-only like elements.
    assert np.shares_memory(xb, x) and np.shares_memory(yb, y)
    np.testing.assert_array_equal(xb, x[:8])
    with pytest.raises(ValueError):
        xb[0, 0] = 1.0
    xs, _ = next(iter(ds.shuffle(20, seed=3).batch(8)))
    assert not np.shares_memory(xs, x) and not xs.flags.writeable


def test_vectorized_batch_repeat_boundaries():
    x = np.arange(5, dtype=np.int32)
    ds = Dataset.from_tensor_slices(x)
    # repeat().batch() batches across epoch boundaries; batch().repeat() does not.
    assert [b.tolist() for b in ds.repeat(2).batch(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4]]
    assert [b.tolist() for b in ds.batch(3).repeat(2)] == [[0, 1, 2], [3, 4], [0, 1, 2], [3, 4]]
    assert [b.tolist() for b in ds.repeat().batch(4, drop_remainder=True).take(3)] == [
        [0, 1, 2, 3], [4, 0, 1, 2], [3, 4, 0, 1]
    ]
    assert [b.tolist() for b in Dataset.from_tensors(np.int32(7)).repeat(5).batch(2)] == [[7, 7], [7, 7], [7]]
    assert [b.tolist() for b in Dataset.range(10, 0, -3).batch(2)] == [[10, 7], [4, 1]]


@pytest.mark.parametrize("reshuffle", [True, False])
def test_vectorized_shuffle_same_order_every_epoch_as_elementwise(reshuffle, monkeypatch):
    x = np.arange(200, dtype=np.int64)

    def build():
        ds = Dataset.from_tensor_slices(x).shuffle(17, seed=5, reshuffle_each_iteration=reshuffle)
        return ds.repeat(2).shuffle(9, seed=2, reshuffle_each_iteration=reshuffle).batch(16)

    fast, slow = build(), build()
    for epoch in range(3):
        monkeypatch.setattr(data, "_VECTORIZE", True)
        f = np.concatenate(list(fast))
        monkeypatch.setattr(data, "_VECTORIZE", False)
        s = np.concatenate(list(slow))
        np.testing.assert_array_equal(f, s)
        assert sorted(f.tolist()) == sorted(list(range(200)) * 2)
        if epoch == 0:
            first = f
    assert (not np.array_equal(first, f)) == reshuffle


def test_vectorized_shuffle_step_matches_the_buffer_loop(monkeypatch):
    monkeypatch.setattr(data, "_SHUFFLE_CHUNK", 7)  # runs split into several vectorized steps
    rng = np.random.default_rng(4)
    for size in (1, 2, 5, 33):
        buf = rng.permutation(1000)[:size].astype(np.int64)
        incoming = rng.integers(1000, 2000, 50).astype(np.int64)
        slots = rng.integers(size, size=50)
        ref_buf, ref_out = buf.tolist(), []
        for e, j in zip(incoming.tolist(), slots.tolist()):
            ref_out.append(ref_buf[j])
            ref_buf[j] = e
        out = data._shuffle_step(buf, incoming, slots)
        assert out.tolist() == ref_out and buf.tolist() == ref_buf
    got = np.concatenate(list(Dataset.range(100).shuffle(10, seed=9).batch(13)))
    monkeypatch.setattr(data, "_VECTORIZE", False)
    np.testing.assert_array_equal(got, np.concatenate(list(Dataset.range(100).shuffle(10, seed=9).batch(13))))
    assert got.tolist() != list(range(100)) and sorted(got.tolist()) == list(range(100))


def test_elementwise_batch_kept_for_other_sources():
    # Strings stack to the widest element *in the batch*, so they keep the element-wise path.
    s = np.array([b"a", b"abcde", b"ab"])
    ds = Dataset.from_tensor_slices(s)
    assert ds._rows is None
    assert [b.dtype for b in ds.batch(2)] == [np.dtype("S5"), np.dtype("S2")]
    big_endian = np.arange(4, dtype=">i4")
    assert Dataset.from_tensor_slices(big_endian)._rows is None
    assert next(iter(Dataset.from_tensor_slices(big_endian).batch(4))).dtype == np.dtype("<i4")
    # Out of the output type's range: elements raise at iteration, so range has no fast path.
    assert Dataset.range(2**40, 2**40 + 2, output_type=np.int32)._rows is None
    assert Dataset.range(3, output_type=np.float32)._rows is None
    mapped = Dataset.range(6).map(lambda v: v * 2).batch(4)
    assert [b.tolist() for b in mapped] == [[0, 2, 4, 6], [8, 10]]
    assert not next(iter(mapped)).flags.writeable
