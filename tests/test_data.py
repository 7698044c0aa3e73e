"""cudist.data.Dataset against tf.data's observed behaviour (TF 2.21) and NumPy references."""

from __future__ import annotations

import collections
import gc
import threading
import time

import numpy as np
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
    # Nested prefetch over an infinite dataset, abandoned mid-way.
    it = iter(Dataset.range(3).repeat().prefetch(1).batch(2).prefetch(AUTOTUNE))
    assert next(it).tolist() == [0, 1]
    assert _prefetch_threads()
    del it
    assert _wait_no_prefetch_threads() == []


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
