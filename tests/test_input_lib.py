"""Distributed input with the real strategies, against TF 2.21's observed behaviour."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import STRATEGY_PARAMS, make_strategy

import cudist
from cudist import _gpu_feeder, _input_lib
from cudist._arrays import is_device_array, to_host
from cudist._kernels._split import split_sizes
from cudist.data import Dataset, TensorSpec


def _local(strategy, value):
    """Per-replica components as a list (a plain value for one replica becomes [value]), on the host."""
    return [to_host(x) if is_device_array(x) else x for x in strategy.experimental_local_results(value)]


@pytest.fixture(autouse=True)
def _no_leaked_threads(no_leaked_threads):
    yield


# --------------------------------------------------------------------------------- contexts & options
def test_input_context():
    ctx = cudist.InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    ctx = cudist.InputContext(2, 1, 4)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 4)
    assert ctx.get_per_replica_batch_size(8) == 2
    with pytest.raises(ValueError, match=r"The `global_batch_size` 4 is not divisible by `num_replicas_in_sync` 3"):
        cudist.InputContext(1, 0, 3).get_per_replica_batch_size(4)


def test_value_context_and_options():
    vc = cudist.ValueContext()
    assert (vc.replica_id_in_sync_group, vc.num_replicas_in_sync) == (0, 1)
    assert cudist.ValueContext(1, 2).replica_id_in_sync_group == 1
    opts = cudist.InputOptions()
    assert opts.experimental_fetch_to_device is True
    assert opts.experimental_replication_mode is cudist.InputReplicationMode.PER_WORKER
    assert opts.experimental_place_dataset_on_device is False
    assert opts.experimental_per_replica_buffer_size == 1
    assert [m.value for m in cudist.InputReplicationMode] == ["PER_WORKER", "PER_REPLICA"]
    with pytest.raises(TypeError, match="must be an InputReplicationMode"):
        cudist.InputOptions(experimental_replication_mode="PER_REPLICA")
    with pytest.raises(ValueError, match="experimental_per_replica_buffer_size must be an int >= 0"):
        cudist.InputOptions(experimental_per_replica_buffer_size=-1)


# --------------------------------------------------------------------------------- experimental_distribute_dataset
def test_seeds_example_range4_batch2(strategy):
    """The TF docs example: Dataset.range(4).batch(2), each global batch split across replicas."""
    dist = strategy.experimental_distribute_dataset(Dataset.range(4).batch(2))
    n = strategy.num_replicas_in_sync
    steps = [_local(strategy, x) for x in dist]
    assert len(steps) == 2
    for step, expect in zip(steps, ([0, 1], [2, 3])):
        assert [len(v) for v in step] == split_sizes(2, n)
        assert np.concatenate(step).tolist() == expect
        assert all(v.dtype == np.int64 for v in step)
    doubled = [strategy.run(lambda x: x * 2, args=(x,)) for x in dist]
    assert [np.concatenate(_local(strategy, d)).tolist() for d in doubled] == [[0, 2], [4, 6]]


def test_one_replica_gets_the_plain_batch():
    for kind in ("one_device", "mirrored1"):
        s = make_strategy(kind)
        steps = list(s.experimental_distribute_dataset(Dataset.range(4).batch(2)))
        assert all(type(x) is np.ndarray for x in steps)
        assert [x.tolist() for x in steps] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("b,n,sizes", [(3, 2, [2, 1]), (4, 3, [2, 2, 0]), (8, 3, [3, 3, 2]), (5, 4, [2, 2, 1, 0])])
@pytest.mark.parametrize("drop", [False, True])
def test_ceil_split_rule(b, n, sizes, drop):
    s = make_strategy(f"mirrored{n}")
    x = np.random.default_rng(b * n).standard_normal((b, 3)).astype(np.float32)
    (step,) = list(s.experimental_distribute_dataset(Dataset.from_tensor_slices(x).batch(b, drop_remainder=drop)))
    assert isinstance(step, cudist.PerReplica)
    parts = _local(s, step)
    assert [p.shape for p in parts] == [(k, 3) for k in sizes]
    assert all(p.dtype == np.float32 for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), x)


@pytest.mark.parametrize("n_rows,b", [(11, 4), (7, 3), (5, 5), (2, 8)])
def test_random_nested_batches_round_trip(strategy, n_rows, b):
    rng = np.random.default_rng(n_rows * 100 + b)
    x = rng.standard_normal((n_rows, 2, 3))
    y = rng.integers(-50, 50, n_rows).astype(np.int32)
    w = rng.standard_normal(n_rows).astype(np.float16)
    ds = Dataset.from_tensor_slices({"x": x, "t": (y, w)}).batch(b)
    n = strategy.num_replicas_in_sync
    got = {"x": [], "y": [], "w": []}
    for step in strategy.experimental_distribute_dataset(ds):
        xs, ys, ws = _local(strategy, step["x"]), _local(strategy, step["t"][0]), _local(strategy, step["t"][1])
        assert len(xs) == len(ys) == len(ws) == n
        for a, c, d in zip(xs, ys, ws):  # leaves split leaf by leaf, consistently
            assert len(a) == len(c) == len(d)
            assert a.shape[1:] == (2, 3) and c.dtype == np.int32 and d.dtype == np.float16
        got["x"] += xs
        got["y"] += ys
        got["w"] += ws
    np.testing.assert_array_equal(np.concatenate(got["x"]), x)
    np.testing.assert_array_equal(np.concatenate(got["y"]), y)
    np.testing.assert_array_equal(np.concatenate(got["w"]), w)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_split_steps_equal_regroup_of_the_kernel_split(n):
    # _split_steps builds each step directly (views into one PerReplica per leaf for host
    # replicas); it must equal regrouping the kernel contract's split, for host and device putters.
    import collections

    import optree

    from cudist._kernels import get_backend
    from cudist._values import PerReplica, regroup

    Pair = collections.namedtuple("Pair", "a b")
    rng = np.random.default_rng(n)
    batches = []
    for b in (1, 2, 3, 5, 7, 8, 0):
        batches.append((rng.standard_normal((b, 2)).astype(np.float32), {"z": rng.integers(0, 9, b), "w": Pair(
            rng.standard_normal((b, 1, 3)), rng.integers(0, 2, b).astype(bool))}))
    tagged = lambda v: optree.tree_map(lambda a: a.copy(), v)  # noqa: E731  (a device-style putter: copies)
    for putters in ([_input_lib._identity] * n, [tagged] * n):
        got = list(_input_lib.split_steps(batches, n, putters, "where"))
        want = [regroup(get_backend().split(batch, n), PerReplica, always_wrap=True) for batch in batches]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            gl, gt = optree.tree_flatten(g, is_leaf=lambda v: isinstance(v, PerReplica))
            wl, wt = optree.tree_flatten(w, is_leaf=lambda v: isinstance(v, PerReplica))
            assert gt == wt
            for gp, wp in zip(gl, wl):
                assert type(gp) is PerReplica and len(gp.values) == n
                for ga, wa in zip(gp.values, wp.values):
                    assert ga.dtype == wa.dtype and ga.shape == wa.shape
                    np.testing.assert_array_equal(ga, wa)
    with pytest.raises(ValueError, match=r"where: cannot split.*leaf 1 has batch size 3 but leaf 0 has batch size 2"):
        list(_input_lib.split_steps([(np.zeros(2), np.zeros(3))], n, [_input_lib._identity] * n, "where"))


def test_partial_and_empty_batches_three_replicas():
    s = make_strategy("mirrored3")
    steps = [[v.tolist() for v in _local(s, x)] for x in s.experimental_distribute_dataset(Dataset.range(5).batch(4))]
    assert steps == [[[0, 1], [2, 3], []], [[4], [], []]]
    empty = _local(s, next(iter(s.experimental_distribute_dataset(Dataset.range(5).batch(4)))))[2]
    assert empty.shape == (0,) and empty.dtype == np.int64
    # Empty pieces keep the trailing dims of a 2-D batch.
    x = np.arange(10.0).reshape(5, 2)
    last = list(s.experimental_distribute_dataset(Dataset.from_tensor_slices(x).batch(4)))[-1]
    assert [p.shape for p in _local(s, last)] == [(1, 2), (0, 2), (0, 2)]


def test_run_and_reduce_over_steps(strategy):
    x = np.random.default_rng(9).standard_normal(13).astype(np.float64)
    total = 0.0
    for step in strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(x).batch(4)):
        per_replica = strategy.run(lambda v: np.sum(v), args=(step,))
        total += float(strategy.reduce(cudist.ReduceOp.SUM, per_replica, axis=None))
    np.testing.assert_allclose(total, x.sum(), rtol=1e-12)


def test_element_spec():
    ds = Dataset.range(8).batch(4)
    assert make_strategy("one_device").experimental_distribute_dataset(ds).element_spec == ds.element_spec
    s = make_strategy("mirrored2")
    spec = s.experimental_distribute_dataset(ds).element_spec
    one = TensorSpec((None,), np.dtype(np.int64))
    assert spec == _input_lib.PerReplicaSpec(one, one)
    assert repr(spec).startswith("PerReplicaSpec(TensorSpec(shape=(None,), dtype=int64")
    # drop_remainder with B divisible by N: TF reports the per-replica size.
    dropped = s.experimental_distribute_dataset(Dataset.range(8).batch(4, drop_remainder=True))
    two = TensorSpec((2,), np.dtype(np.int64))
    assert dropped.element_spec == _input_lib.PerReplicaSpec(two, two)
    nested = s.experimental_distribute_dataset(
        Dataset.from_tensor_slices({"a": np.arange(6), "b": np.zeros((6, 2), np.float32)}).batch(3)
    )
    it = iter(nested)
    assert it.element_spec == nested.element_spec
    assert nested.element_spec["b"] == _input_lib.PerReplicaSpec(*[TensorSpec((None, 2), np.dtype(np.float32))] * 2)
    assert s.experimental_distribute_dataset(ds).cardinality == 2  # a property, as in TF


def test_reiterable_and_iterators(strategy):
    dist = strategy.experimental_distribute_dataset(Dataset.range(6).batch(3))
    first = [np.concatenate(_local(strategy, x)).tolist() for x in dist]
    second = [np.concatenate(_local(strategy, x)).tolist() for x in dist]
    assert first == second == [[0, 1, 2], [3, 4, 5]]
    it = iter(dist)
    assert iter(it) is it
    assert np.concatenate(_local(strategy, it.get_next())).tolist() == [0, 1, 2]
    assert np.concatenate(_local(strategy, next(it))).tolist() == [3, 4, 5]
    with pytest.raises(_input_lib.OutOfRangeError, match="End of sequence"):
        it.get_next()
    with pytest.raises(StopIteration):
        next(it)


def test_get_next_as_optional():
    s = make_strategy("mirrored2")
    it = iter(s.experimental_distribute_dataset(Dataset.range(3).batch(2)))
    opt = it.get_next_as_optional()
    assert opt.has_value() is True
    assert [v.tolist() for v in _local(s, opt.get_value())] == [[0], [1]]
    opt = it.get_next_as_optional()
    assert [v.tolist() for v in _local(s, opt.get_value())] == [[2], []]
    opt = it.get_next_as_optional()
    assert opt.has_value() is False
    assert opt.element_spec == it.element_spec
    with pytest.raises(ValueError, match="The given optional does not have a value."):
        opt.get_value()


def test_python_iterables(strategy):
    rng = np.random.default_rng(4)
    batches = [rng.standard_normal((5, 2)) for _ in range(3)]
    n = strategy.num_replicas_in_sync
    for source in (batches, (b for b in batches)):
        steps = [_local(strategy, x) for x in strategy.experimental_distribute_dataset(source)]
        assert len(steps) == 3
        for step, b in zip(steps, batches):
            assert [len(p) for p in step] == split_sizes(5, n)
            np.testing.assert_array_equal(np.concatenate(step), b)

    class Loader:  # a torch-DataLoader-like object yielding (x, y) pairs
        def __iter__(self):
            for b in batches:
                yield b, b[:, 0] > 0

    dist = strategy.experimental_distribute_dataset(Loader())
    for _ in range(2):
        xs, ys = zip(*[(np.concatenate(_local(strategy, x)), np.concatenate(_local(strategy, y))) for x, y in dist])
        np.testing.assert_array_equal(np.concatenate(xs), np.concatenate(batches))
        assert np.concatenate(ys).dtype == np.bool_


def test_distribute_dataset_errors():
    s = make_strategy("mirrored2")
    with pytest.raises(ValueError, match=r"cannot split the element across 2 replicas.*dataset\.batch"):
        list(s.experimental_distribute_dataset(Dataset.range(3)))
    # One replica needs no split: the unbatched elements pass through (as in TF).
    assert [int(v) for v in make_strategy("one_device").experimental_distribute_dataset(Dataset.range(3))] == [0, 1, 2]
    with pytest.raises(TypeError, match="expected a cudist.data.Dataset or an iterable of batches"):
        s.experimental_distribute_dataset(np.arange(4))
    opts = cudist.InputOptions(experimental_replication_mode=cudist.InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="PER_REPLICA is only supported in `distribute_datasets_from_"):
        s.experimental_distribute_dataset(Dataset.range(4).batch(2), options=opts)
    with pytest.raises(TypeError, match="options must be a cudist.InputOptions"):
        s.experimental_distribute_dataset(Dataset.range(4).batch(2), options={"x": 1})


def test_prefetched_dataset_early_break(strategy):
    ds = Dataset.range(10**9).batch(4).prefetch(2)
    for i, step in enumerate(strategy.experimental_distribute_dataset(ds)):
        assert np.concatenate(_local(strategy, step)).tolist() == list(range(4 * i, 4 * i + 4))
        if i == 3:
            break
    # the autouse fixture checks that the prefetch thread is gone


# --------------------------------------------------------------------------------- distribute_datasets_from_function
def test_datasets_from_function_deals_per_replica_batches(strategy):
    n = strategy.num_replicas_in_sync
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return Dataset.range(11).batch(ctx.get_per_replica_batch_size(2 * n))

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert len(contexts) == 1  # called once, at construction
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, n)
    batches = [b.tolist() for b in Dataset.range(11).batch(2)]
    batches += [[]] * (-len(batches) % n)  # the last step's missing replicas get empty batches
    got = [[v.tolist() for v in _local(strategy, x)] for x in dist]
    assert got == [batches[i : i + n] for i in range(0, len(batches), n)]
    assert len(contexts) == 1


def test_datasets_from_function_spec_and_one_replica():
    s = make_strategy("mirrored2")
    dist = s.distribute_datasets_from_function(lambda c: Dataset.range(5).batch(2, drop_remainder=True))
    two = TensorSpec((2,), np.dtype(np.int64))
    assert dist.element_spec == _input_lib.PerReplicaSpec(two, two)
    m1 = make_strategy("mirrored1")
    steps = list(m1.distribute_datasets_from_function(lambda c: Dataset.range(4).batch(2)))
    assert all(type(x) is np.ndarray for x in steps) and [x.tolist() for x in steps] == [[0, 1], [2, 3]]


def test_datasets_from_function_per_replica_mode():
    s = make_strategy("mirrored3")
    opts = cudist.InputOptions(experimental_replication_mode=cudist.InputReplicationMode.PER_REPLICA)
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        i = ctx.input_pipeline_id
        x = np.arange(100 * i, 100 * i + 2 * (i + 1), dtype=np.float32).reshape(-1, 2)
        return Dataset.from_tensor_slices(x).batch(1)

    steps = [[v.tolist() for v in _local(s, x)] for x in s.distribute_datasets_from_function(dataset_fn, opts)]
    assert seen == [(3, 0, 3), (3, 1, 3), (3, 2, 3)]
    assert steps == [
        [[[0.0, 1.0]], [[100.0, 101.0]], [[200.0, 201.0]]],
        [[], [[102.0, 103.0]], [[202.0, 203.0]]],
        [[], [], [[204.0, 205.0]]],
    ]


def test_datasets_from_function_errors():
    s = make_strategy("mirrored2")
    with pytest.raises(TypeError, match="dataset_fn must be callable"):
        s.distribute_datasets_from_function(3)
    with pytest.raises(TypeError, match="the value dataset_fn returned"):
        s.distribute_datasets_from_function(lambda c: 5)
    bad = cudist.InputOptions(experimental_place_dataset_on_device=True)
    with pytest.raises(ValueError, match="you must also specify `PER_REPLICA`"):
        s.distribute_datasets_from_function(lambda c: Dataset.range(2).batch(1), bad)
    # Unbatched elements: one per replica per step, the incomplete last step dropped (as TF; see
    # tests/test_tf_parity.py), where this used to raise.
    steps = list(s.distribute_datasets_from_function(lambda c: Dataset.range(3)))
    assert [[int(v) for v in _local(s, x)] for x in steps] == [[0, 1]]


# --------------------------------------------------------------------------------- values from function
def test_distribute_values_from_function(strategy):
    n = strategy.num_replicas_in_sync
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: {"a": np.full(2, ctx.replica_id_in_sync_group, np.float32), "n": ctx.num_replicas_in_sync}
    )
    a = _local(strategy, v["a"])
    assert [x.tolist() for x in a] == [[float(i)] * 2 for i in range(n)]
    assert _local(strategy, v["n"]) == [n] * n
    result = strategy.run(lambda d: d["a"] * 2, args=(v,))
    assert [x.tolist() for x in _local(strategy, result)] == [[2.0 * i] * 2 for i in range(n)]


def test_distribute_values_one_replica_wrapping():
    # TF: OneDeviceStrategy returns the plain value, a 1-replica MirroredStrategy a PerReplica.
    assert make_strategy("one_device").experimental_distribute_values_from_function(lambda c: 7) == 7
    v = make_strategy("mirrored1").experimental_distribute_values_from_function(lambda c: 7)
    assert isinstance(v, cudist.PerReplica) and v.values == (7,)
    with pytest.raises(TypeError, match="value_fn must be callable"):
        make_strategy("mirrored2").experimental_distribute_values_from_function(None)


# --------------------------------------------------------------------------------- TF1-era iterators
def test_make_dataset_iterator():
    s = make_strategy("mirrored2")
    with pytest.warns(DeprecationWarning):
        it = s.make_dataset_iterator(Dataset.range(5).batch(4))
    assert it.initialize() == []
    assert [v.tolist() for v in _local(s, it.get_next())] == [[0, 1], [2, 3]]
    assert [v.tolist() for v in _local(s, it.get_next())] == [[4], []]
    with pytest.raises(_input_lib.OutOfRangeError):
        it.get_next()
    it.initialize()  # starts over
    assert [v.tolist() for v in _local(s, it.get_next())] == [[0, 1], [2, 3]]


def test_make_input_fn_iterator():
    s = make_strategy("mirrored2")
    seen = []

    def input_fn(ctx):
        seen.append(ctx.num_replicas_in_sync)
        return Dataset.range(5).batch(2)

    with pytest.warns(DeprecationWarning):
        it = s.make_input_fn_iterator(input_fn)
    assert seen == [2] and it.initialize() == []
    assert [v.tolist() for v in _local(s, it.get_next())] == [[0, 1], [2, 3]]
    with pytest.raises(_input_lib.OutOfRangeError):  # TF1: a step some replica can't fill ends it
        it.get_next()
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="Input replication mode not supported"):
        s.make_input_fn_iterator(input_fn, cudist.InputReplicationMode.PER_REPLICA)


def test_experimental_make_numpy_dataset():
    s = make_strategy("mirrored2")
    with pytest.warns(DeprecationWarning):
        ds = s.experimental_make_numpy_dataset(np.arange(3.0))
    assert ds.element_spec == TensorSpec((), np.dtype(np.float64))
    assert [float(v) for v in ds] == [0.0, 1.0, 2.0]


# --------------------------------------------------------------------------------- devices
@pytest.mark.parametrize("kind", [k for k in STRATEGY_PARAMS if isinstance(k, str)])  # the CPU kinds
def test_cpu_device_put_is_identity(kind):
    strategy = make_strategy(kind)
    for d in strategy.extended.worker_devices:
        x = np.arange(3)
        assert _input_lib.device_putter(d)(x) is x
    x = np.arange(8.0).reshape(4, 2)
    step = next(iter(strategy.experimental_distribute_dataset([x])))
    parts = _local(strategy, step)
    # CPU replicas share host memory: the pieces are views of the batch, not copies.
    assert all(np.shares_memory(p, x) for p in parts if p.size)


@pytest.mark.gpu
def test_gpu_device_put_and_prefetch():
    import cupy

    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    y = _input_lib.device_putter("/gpu:0")({"x": x, "k": 3})
    assert isinstance(y["x"], cupy.ndarray) and y["x"].device.id == 0 and y["k"] == 3
    np.testing.assert_array_equal(cupy.asnumpy(y["x"]), x)
    assert _input_lib.device_putter("/gpu:0", fetch_to_device=False)(x) is x


# --------------------------------------------------------------------------------- GPU staging (host side)
class _FakeEvent:
    """Stands in for a CUDA event: records that the host waited on it."""

    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


@pytest.fixture
def host_pinned(monkeypatch):
    """Pinned allocations replaced by NumPy memory (the staging logic is host-only); records sizes."""
    sizes = []

    def alloc(size):
        sizes.append(size)
        buf = np.full(size, 0xEE, dtype=np.uint8)  # not zeros: packing must overwrite what it uses
        return buf, buf

    monkeypatch.setattr(_gpu_feeder, "_alloc_pinned", alloc)
    return sizes


def _staged_leaf(staged, r, j):
    treedef, entries = staged.replicas[r]
    kind, off, shape, dtype = entries[j]
    assert kind == "h"
    return staged.slot.buf[off : off + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)


def test_gpu_feeder_stage_packs_leaves_aligned(host_pinned):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 3)).astype(np.float32)
    y = rng.integers(-50, 50, size=(7,)).astype(">i8")  # non-native byte order: staged native
    feeder = _gpu_feeder.GpuFeeder([0, 0])
    values = [{"x": x[:4], "y": y[:4], "k": 3}, {"x": x[4:, ::2], "y": y[4:], "k": np.float64(2.5)}]
    staged = feeder.stage(values)
    assert len(host_pinned) == 1 and host_pinned[0] % _gpu_feeder.STAGE_GRANULE == 0
    for r, v in enumerate(values):
        treedef, entries = staged.replicas[r]
        assert treedef.unflatten(list(range(treedef.num_leaves))) == {"k": 0, "x": 1, "y": 2}
        kinds = [e[0] for e in entries]
        assert kinds == (["v", "h", "h"] if r == 0 else ["h", "h", "h"])  # a NumPy scalar is a 0-d array
        for j, name in ((1, "x"), (2, "y")):
            assert entries[j][1] % _gpu_feeder.STAGE_ALIGN == 0
            got = _staged_leaf(staged, r, j)
            assert got.dtype.isnative and got.dtype == np.dtype(v[name].dtype).newbyteorder("=")
            np.testing.assert_array_equal(got, v[name])
    np.testing.assert_array_equal(_staged_leaf(staged, 1, 0), np.float64(2.5))


def test_gpu_feeder_stage_rejects_non_numeric(host_pinned):
    feeder = _gpu_feeder.GpuFeeder([0])
    with pytest.raises(TypeError, match=r"cannot copy an array of dtype <U3 to a GPU.*experimental_fetch_to_device=False"):
        feeder.stage([np.array(["abc", "de"])])


def test_gpu_feeder_ring_waits_before_reuse_and_stays_bounded(host_pinned):
    feeder = _gpu_feeder.GpuFeeder([0])
    rng = np.random.default_rng(4)
    events = []
    for step in range(40):
        x = rng.standard_normal((5 + step % 3, 4)).astype(np.float32)
        staged = feeder.stage([x])
        slot = staged.slot
        # The slot is handed to the consumer, which enqueues the copies and returns it with their event.
        ev = _FakeEvent()
        events.append(ev)
        np.testing.assert_array_equal(_staged_leaf(staged, 0, 0), x)
        slot.events = (ev,)
        feeder._free.append(slot)
    # One slot suffices when each step is copied before the next is staged; it was reused every time
    # and the host waited for each copy's event before overwriting the buffer.
    assert len(feeder.slots) == 1 and len(host_pinned) == 1
    assert [e.synchronized for e in events] == [1] * 39 + [0]


def test_gpu_feeder_ring_grows_only_while_slots_are_held(host_pinned):
    feeder = _gpu_feeder.GpuFeeder([0])
    held = [feeder.stage([np.arange(4.0)]) for _ in range(3)]  # e.g. queued in the prefetch thread
    assert len({id(s.slot) for s in held}) == 3 and len(feeder.slots) == 3
    for s in held:
        feeder._free.append(s.slot)
    for _ in range(10):
        feeder._free.append(feeder.stage([np.arange(4.0)]).slot)
    assert len(feeder.slots) == 3
    # A bigger step regrows one slot's buffer (the old one is released), nothing else.
    big = feeder.stage([np.zeros(_gpu_feeder.STAGE_GRANULE, np.float64)])
    assert len(feeder.slots) == 3 and big.slot.buf.nbytes >= _gpu_feeder.STAGE_GRANULE * 8
    assert feeder.pinned_allocations == 4


def test_gpu_steps_drain_waits_for_copies_in_flight(host_pinned):
    feeder = _gpu_feeder.GpuFeeder([0])
    pending, copy_ev = _FakeEvent(), _FakeEvent()
    flight = _gpu_feeder.InFlight("step", ((0, copy_ev),))
    staged = feeder.stage([np.arange(3)])
    staged.slot.events = (pending,)
    feeder._free.append(staged.slot)
    src = iter([])
    steps = _gpu_feeder.DeviceSteps(src, feeder, 2)
    steps._inflight.append(flight)
    steps.close()
    assert copy_ev.synchronized == 1 and pending.synchronized == 1 and not steps._inflight
    with pytest.raises(StopIteration):
        next(steps)


def test_gpu_steps_keep_depth_in_flight_and_raise_errors_in_order(host_pinned, monkeypatch):
    enqueued = []

    def enqueue(self, item):
        enqueued.append(item)
        return _gpu_feeder.InFlight(item, ())

    monkeypatch.setattr(_gpu_feeder.GpuFeeder, "enqueue", enqueue)

    def source():
        yield from range(5)
        raise RuntimeError("dataset broke")

    steps = _gpu_feeder.DeviceSteps(source(), _gpu_feeder.GpuFeeder([0]), 2)
    assert next(steps) == 0
    assert enqueued == [0, 1, 2]  # step 0 handed out, steps 1 and 2 already copying
    assert [next(steps) for _ in range(4)] == [1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="dataset broke"):
        next(steps)
    with pytest.raises(StopIteration):
        next(steps)
