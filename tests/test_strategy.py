"""Strategy: construction, run, reduce, gather, local results, extended, TF1-era methods."""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist import PerReplica
from cudist._arrays import to_host

#: Every test twice: replicas on greenlets, then on replica threads.
pytestmark = pytest.mark.usefixtures("replica_execution")

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"


def per_replica(strategy, make):
    """A PerReplica of make(i) for each replica (or the single value for one replica)."""
    vals = [make(i) for i in range(strategy.num_replicas_in_sync)]
    return PerReplica(vals)


# ----------------------------------------------------------------------------- construction
def test_mirrored_devices_and_repr():
    s = cudist.MirroredStrategy(["/cpu:0", "CPU:1"])
    assert s.num_replicas_in_sync == 2
    assert s.extended.worker_devices == (CPU.format(0), CPU.format(1))
    assert s.extended.parameter_devices == s.extended.worker_devices
    assert "MirroredStrategy" in repr(s) and CPU.format(1) in repr(s)
    assert s.cluster_resolver is None
    with s.scope():
        assert type(cudist.Variable(1.0)) is cudist.MirroredVariable


def test_mirrored_default_devices_are_every_logical_cpu_without_gpus():
    # As TF 2.21 (see test_tf_parity.py): MirroredStrategy() and MirroredStrategy([]) take every
    # logical CPU when there is no GPU (conftest configures four).
    from tests.conftest import gpu_count

    for s in (cudist.MirroredStrategy(), cudist.MirroredStrategy([])):
        if gpu_count() == 0:
            assert s.extended.worker_devices == tuple(CPU.format(i) for i in range(4))
        else:
            assert all("GPU" in d for d in s.extended.worker_devices)


@pytest.mark.parametrize(
    "devices, exc, match",
    [
        (["/cpu:0", "/device:CPU:0"], ValueError, "duplicates"),
        (["/cpu:0", "/cpu:99"], ValueError, "CPU:99' does not exist: 4 logical CPU"),
        (["/tpu:0"], ValueError, "invalid device"),
        ("/cpu:0", ValueError, "list or tuple"),
    ],
)
def test_mirrored_bad_devices(devices, exc, match):
    with pytest.raises(exc, match=match):
        cudist.MirroredStrategy(devices)


def test_one_device_strategy():
    s = cudist.OneDeviceStrategy("/cpu:1")
    assert s.num_replicas_in_sync == 1
    assert s.extended.worker_devices == (CPU.format(1),)
    assert s.extended.parameter_devices == (CPU.format(1),)
    assert CPU.format(1) in repr(s)
    with s.scope():
        assert type(cudist.Variable(1.0)) is cudist.Variable
    with pytest.raises(ValueError, match="invalid device"):
        cudist.OneDeviceStrategy("/job:worker/task:1/device:CPU:0")


def test_central_storage_defaults():
    s = cudist.CentralStorageStrategy(["/cpu:1", "/cpu:2"])
    assert s.extended.worker_devices == (CPU.format(1), CPU.format(2))
    assert s.extended.parameter_devices == (CPU.format(0),)  # several compute devices: the CPU
    one = cudist.CentralStorageStrategy(["/cpu:3"])
    assert one.extended.parameter_devices == (CPU.format(3),)  # one compute device: that device
    p = cudist.CentralStorageStrategy(["/cpu:0", "/cpu:1"], parameter_device="/cpu:2")
    assert p.extended.parameter_devices == (CPU.format(2),)
    with p.scope():
        v = cudist.Variable(1.0)
    assert type(v).__name__ == "AggregatingVariable" and v.device == CPU.format(2)
    assert cudist.experimental.CentralStorageStrategy is cudist.CentralStorageStrategy
    assert "parameter_device" in repr(p)


def test_cross_device_ops_argument():
    with pytest.raises(TypeError, match="CrossDeviceOps"):
        cudist.MirroredStrategy(["/cpu:0"], cross_device_ops="nccl")
    with pytest.raises(ValueError, match="NcclAllReduce needs GPU devices"):
        cudist.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=cudist.NcclAllReduce())


# ----------------------------------------------------------------------------- run
def test_one_device_docstring_example_sums_to_90():
    # tf.distribute.OneDeviceStrategy's docstring example.
    strategy = cudist.OneDeviceStrategy(device="/cpu:0")

    def step_fn(x):
        return x * 2

    result = 0
    for i in range(10):
        result += strategy.run(step_fn, args=(i,))
    assert result == 90


def test_run_replica_ids(strategy):
    out = strategy.run(lambda: cudist.get_replica_context().replica_id_in_sync_group)
    n = strategy.num_replicas_in_sync
    if n == 1:
        assert out == 0
    else:
        assert isinstance(out, PerReplica)
        assert out.values == tuple(range(n))


def test_run_same_object_stays_unwrapped(strategy):
    token = object()
    assert strategy.run(lambda: token) is token
    assert strategy.run(lambda x: x, args=(7,)) == 7
    assert strategy.run(lambda: None) is None


def test_run_nested_results_keep_structure(strategy):
    def fn(scale):
        i = cudist.get_replica_context().replica_id_in_sync_group
        return {"a": np.float32(i) * scale, "b": (scale, [i, "const"])}

    out = strategy.run(fn, kwargs={"scale": 2.0})
    n = strategy.num_replicas_in_sync
    local = strategy.experimental_local_results(out)
    assert len(local) == n
    for i, o in enumerate(local):
        assert o["a"] == 2.0 * i
        assert o["b"] == (2.0, [i, "const"])
    if n > 1:
        assert isinstance(out["a"], PerReplica)
        assert out["b"][0] == 2.0  # the same object from every replica stays unwrapped
        assert out["b"][1][1] == "const"


def test_run_splits_per_replica_arguments(strategy):
    n = strategy.num_replicas_in_sync
    x = per_replica(strategy, lambda i: np.full(3, float(i + 1)))
    out = strategy.run(lambda a, b=None: a * b, args=(x,), kwargs={"b": 10.0})
    local = strategy.experimental_local_results(out)
    for i in range(n):
        np.testing.assert_array_equal(local[i], np.full(3, 10.0 * (i + 1)))


def test_run_with_too_few_components_raises():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with pytest.raises(ValueError, match="with 2 component\\(s\\), but the strategy has 3 replicas"):
        s.run(lambda x: x, args=(PerReplica([1, 2]),))


def test_run_args_must_be_a_sequence(strategy):
    with pytest.raises(ValueError, match="positional args must be a list or tuple"):
        strategy.run(lambda x: x, args=5)


def test_run_inside_run_raises(strategy):
    def fn():
        return strategy.run(lambda: 1)

    with pytest.raises(RuntimeError, match="cannot be called inside strategy.run"):
        strategy.run(fn)
    assert strategy.run(lambda: 3) == 3  # still usable


def test_run_accepts_run_options(strategy):
    assert strategy.run(lambda: 1, options=cudist.RunOptions(experimental_enable_dynamic_batch_size=False)) == 1


# ----------------------------------------------------------------------------- reduce
def test_reduce_docstring_example(strategy):
    # tf.distribute.Strategy.reduce's example: the sum of the replica ids.
    def step_fn():
        return np.int32(cudist.get_replica_context().replica_id_in_sync_group)

    n = strategy.num_replicas_in_sync
    total = strategy.reduce("SUM", strategy.run(step_fn), axis=None)
    assert total == n * (n - 1) // 2


def test_reduce_axis_docstring_example():
    # [0..3] on replica 0 and [4..7] on replica 1, from Strategy.reduce's docstring.
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    v = PerReplica([np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)])
    np.testing.assert_array_equal(s.reduce("sum", v, axis=None), [4, 6, 8, 10])
    assert s.reduce("sum", v, axis=0) == 28
    assert s.reduce("mean", v, axis=0) == 3.5
    np.testing.assert_array_equal(s.reduce("mean", v, axis=None), [2, 3, 4, 5])


def test_reduce_values_observed_in_tf():
    # Values TF 2.21 printed for [[1,2],[3,4]] * (replica_id + 1) on 2 replicas.
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    base = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    res = s.run(lambda: base * (cudist.get_replica_context().replica_id_in_sync_group + 1))
    np.testing.assert_array_equal(s.reduce("SUM", res, axis=None), [[3, 6], [9, 12]])
    np.testing.assert_array_equal(s.reduce("MEAN", res, axis=0), [3, 4.5])
    np.testing.assert_array_equal(s.reduce("mean", res, axis=-1), [2.25, 5.25])
    np.testing.assert_array_equal(s.reduce("sum", res, axis=1), [9, 21])
    out = s.reduce(cudist.ReduceOp.SUM, res, axis=None)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32


@pytest.mark.parametrize("sizes", [[3, 1], [3, 0], [2, 2, 1, 0], [0, 5, 1]])
def test_reduce_mean_axis_weights_partial_batches(sizes):
    # TF: partial mean [1,2,3] & [10] -> 4.0; [1,2,3] & [] -> 2.0.
    rng = np.random.default_rng(len(sizes) * 10 + sizes[0])
    s = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(len(sizes))])
    parts = [rng.standard_normal((k, 3)).astype(np.float64) for k in sizes]
    v = PerReplica(parts)
    allv = np.concatenate(parts)
    np.testing.assert_allclose(s.reduce("mean", v, axis=0), allv.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(s.reduce("sum", v, axis=0), allv.sum(axis=0), rtol=1e-12)


def test_reduce_observed_partial_means():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert s.reduce("MEAN", PerReplica([np.array([1.0, 2.0, 3.0]), np.array([10.0])]), axis=0) == 4.0
    empty = PerReplica([np.array([1.0, 2.0, 3.0], np.float32), np.zeros(0, np.float32)])
    assert s.reduce("MEAN", empty, axis=0) == 2.0
    assert s.reduce("SUM", empty, axis=0) == 6.0


def test_reduce_over_fixture_matches_numpy(strategy):
    rng = np.random.default_rng(3)
    n = strategy.num_replicas_in_sync
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        parts = [(rng.standard_normal((5, 7)) * 100).astype(dtype) for _ in range(n)]
        v = PerReplica(parts)
        ref = parts[0].copy()
        for p in parts[1:]:
            ref = ref + p
        out = strategy.reduce("sum", v, axis=None)
        np.testing.assert_array_equal(out, ref)
        assert out.dtype == dtype
        mean = strategy.reduce("mean", v, axis=None)
        if np.dtype(dtype).kind == "f":
            np.testing.assert_allclose(mean, ref / dtype(n), rtol=1e-6)
        else:  # integer MEAN divides truly, as TF's x / n does
            assert mean.dtype == np.float64
            np.testing.assert_allclose(mean, ref / n)
        ax = strategy.reduce("sum", v, axis=1)
        np.testing.assert_allclose(ax, sum(p.sum(axis=1) for p in parts), rtol=1e-5)


def test_reduce_errors():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    v = PerReplica([np.ones((2, 2)), np.ones((2, 2))])
    with pytest.raises(ValueError, match="unknown reduce op 'MAX'"):
        s.reduce("MAX", v, axis=None)
    for axis in (2, -3):
        with pytest.raises(ValueError, match=f"invalid reduction axis {axis}.*2 dimensions"):
            s.reduce("SUM", v, axis=axis)
    with pytest.raises(TypeError, match="axis must be an int"):
        s.reduce("SUM", v, axis=1.0)
    with pytest.raises(ValueError, match="replica 1 has shape \\(3,\\)"):
        s.reduce("SUM", PerReplica([np.ones(2), np.ones(3)]), axis=None)
    with pytest.raises(ValueError, match="A non-DistributedValues value 3.0 cannot be reduced"):
        s.reduce("SUM", 3.0, axis=None)
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(lambda: s.reduce("sum", 1.0, axis=None))


def test_reduce_non_distributed_values():
    ms = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    od = cudist.OneDeviceStrategy("/cpu:0")
    # TF 2.21: MEAN of a plain value is the value; SUM is allowed with one replica only.
    assert ms.reduce("MEAN", 3.0, axis=None) == 3.0
    assert od.reduce("SUM", 3.0, axis=None) == 3.0
    assert ms.reduce("MEAN", np.array([1.0, 2.0], np.float32), axis=0) == 1.5
    assert od.reduce("MEAN", np.array([1.0, 2.0], np.float32), axis=0) == 1.5
    # with an axis each replica reduces its own copy first: SUM counts the value once per replica
    assert ms.reduce("SUM", np.array([1.0, 2.0], np.float32), axis=0) == 6.0
    np.testing.assert_array_equal(ms.gather(np.array([1.0, 2.0]), axis=0), [1.0, 2.0])
    int_mean = ms.reduce("MEAN", PerReplica([np.array([1, 2], np.int32)] * 2), axis=0)
    assert int_mean == 1.5 and int_mean.dtype == np.float64
    with pytest.raises(ValueError, match="0-d"):
        ms.run(lambda: cudist.get_replica_context().all_gather(np.float32(1.0), axis=0))


def test_reduce_inside_scope_is_allowed(strategy):
    v = strategy.run(lambda: np.float64(cudist.get_replica_context().replica_id_in_sync_group + 1))
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        assert strategy.reduce("sum", v, axis=None) == n * (n + 1) / 2


# ----------------------------------------------------------------------------- gather / local results
def test_gather_in_replica_order_with_partial_sizes():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal((k, 2)).astype(np.float32) for k in (3, 1, 0)]
    out = s.gather(PerReplica(parts), axis=0)
    np.testing.assert_array_equal(out, np.concatenate(parts))
    parts2 = [rng.standard_normal((2, k)) for k in (1, 2, 3)]
    np.testing.assert_array_equal(s.gather(PerReplica(parts2), axis=-1), np.concatenate(parts2, axis=1))
    with pytest.raises(ValueError, match="outside the gather axis"):
        s.gather(PerReplica([np.ones((2, 2)), np.ones((2, 3)), np.ones((2, 2))]), axis=0)
    with pytest.raises(ValueError, match="out of range"):
        s.gather(PerReplica([np.ones(2)] * 3), axis=1)


def test_experimental_local_results(strategy):
    n = strategy.num_replicas_in_sync
    assert strategy.experimental_local_results(5) == (5,)
    v = per_replica(strategy, lambda i: i * 10)
    assert strategy.experimental_local_results(v) == tuple(i * 10 for i in range(n))
    nest = (v, {"k": 2})
    local = strategy.experimental_local_results(nest)
    if n > 1:
        assert local == tuple((i * 10, {"k": 2}) for i in range(n))


# ----------------------------------------------------------------------------- extended
def test_extended_reduce_to_and_batch_reduce_to():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    v = PerReplica([np.float32(1.0), np.float32(2.0)])
    one = s.extended.reduce_to("sum", v, "/cpu:0")
    assert isinstance(one, np.ndarray) and one == 3.0
    both = s.extended.reduce_to("sum", v, ["/cpu:0", "/cpu:1"])
    assert isinstance(both, cudist.Mirrored) and [float(x) for x in both.values] == [3.0, 3.0]
    assert both.values[0] is not both.values[1]
    outs = s.extended.batch_reduce_to("mean", [(v, "/cpu:0"), (PerReplica([np.ones(3), np.zeros(3)]), "/cpu:1")])
    assert float(outs[0]) == 1.5
    np.testing.assert_array_equal(outs[1], [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="cannot be reduced"):
        s.extended.reduce_to("sum", 1.0, "/cpu:0")
    assert float(s.extended.reduce_to("mean", 1.0, "/cpu:0")) == 1.0
    with pytest.raises(RuntimeError, match="cross-replica"):
        s.run(lambda: s.extended.reduce_to("sum", v, "/cpu:0"))


class _FakeComponent:
    def __init__(self, device, value):
        self.device = device
        self.value = value

    def add(self, x):
        self.value += x
        return self.value


class _FakeDistVar(cudist.DistributedValues):
    _keep_in_replica = True


def test_extended_update_splits_args_per_component():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    var = _FakeDistVar([_FakeComponent("/cpu:0", 1.0), _FakeComponent("/cpu:1", 1.0)])
    out = s.extended.update(var, lambda c, x: c.add(x), args=(PerReplica([10.0, 20.0]),))
    assert isinstance(out, cudist.Mirrored) and out.values == (11.0, 21.0)
    out = s.extended.update(var, lambda c, x: c.add(x), args=(1.0,), group=False)
    assert out == (12.0, 22.0)
    plain = _FakeComponent("/cpu:0", 0.0)
    assert s.extended.update(plain, lambda c, x: c.add(x), args=(cudist.Mirrored([5.0, 5.0]),)) == 5.0
    with pytest.raises(ValueError, match="reduce it first"):
        s.extended.update(plain, lambda c, x: c.add(x), args=(PerReplica([1.0, 2.0]),))
    # TF 2.21 allows update in replica context: it goes through merge_call, so a value every
    # replica passes (the same object) is applied once.
    assert s.run(lambda: s.extended.update(plain, lambda c, x: c.add(x), args=(1.0,))) == 6.0
    assert plain.value == 6.0
    other = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(RuntimeError, match="cross-replica"):
        other.run(lambda: s.extended.update(plain, lambda c: None))


def test_extended_colocate_vars_with_and_variable_devices():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert s.extended._variable_devices() == (CPU.format(0), CPU.format(1))
    other = _FakeDistVar([_FakeComponent("/cpu:2", 0), _FakeComponent("/cpu:3", 0)])
    with s.scope():
        with s.extended.colocate_vars_with(other):
            assert s.extended._variable_devices() == (CPU.format(2), CPU.format(3))
        assert s.extended._variable_devices() == (CPU.format(0), CPU.format(1))
    c = cudist.CentralStorageStrategy(["/cpu:0", "/cpu:1"], parameter_device="/cpu:3")
    assert c.extended._variable_devices() == (CPU.format(3),)
    with c.extended.colocate_vars_with(_FakeComponent("/cpu:1", 0)):
        assert c.extended._variable_devices() == (CPU.format(1),)


def test_extended_value_container_and_created_in_scope():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    comp = _FakeComponent("/cpu:0", 0)
    var = _FakeDistVar([comp, _FakeComponent("/cpu:1", 0)])
    assert s.extended.value_container(comp) is comp
    comp._distributed_container = lambda: var
    assert s.extended.value_container(comp) is var
    var._distribute_strategy = s
    assert s.extended.variable_created_in_scope(var)
    assert not cudist.OneDeviceStrategy("/cpu:0").extended.variable_created_in_scope(var)
    assert not s.extended.variable_created_in_scope(comp)


def test_value_container_of_real_variable_components(strategy):
    with strategy.scope():
        v = cudist.Variable(np.float32(1.0), name="vc")
    for comp in getattr(v, "values", (v,)):
        assert strategy.extended.value_container(comp) is v


def test_extended_flags_and_call_for_each_replica(strategy):
    ext = strategy.extended
    assert ext.experimental_require_static_shapes is False
    assert ext.should_checkpoint is True
    assert len(ext.worker_devices) == strategy.num_replicas_in_sync
    out = ext.call_for_each_replica(lambda x: x + cudist.get_replica_context().replica_id_in_sync_group, args=(1,))
    assert strategy.experimental_local_results(out) == tuple(1 + i for i in range(strategy.num_replicas_in_sync))


# ----------------------------------------------------------------------------- TF1-era methods
def test_update_config_proto_warns_and_copies(strategy):
    cfg = {"allow_soft_placement": True, "nested": {"a": 1}}
    with pytest.warns(DeprecationWarning, match="update_config_proto"):
        out = strategy.update_config_proto(cfg)
    assert out == cfg and out is not cfg and out["nested"] is not cfg["nested"]


def test_experimental_run_warns_and_feeds_iterator(strategy):
    class It:
        def get_next(self):
            return per_replica(strategy, lambda i: i + 100)

    with pytest.warns(DeprecationWarning, match="experimental_run"):
        out = strategy.experimental_run(lambda x: x * 2, It())
    assert strategy.experimental_local_results(out) == tuple(2 * (i + 100) for i in range(strategy.num_replicas_in_sync))
    with pytest.warns(DeprecationWarning):
        assert strategy.experimental_run(lambda: 4) == 4


def test_tf1_iterators_warn(strategy):
    pytest.importorskip("cudist._input_lib")
    with pytest.warns(DeprecationWarning, match="make_dataset_iterator"):
        it = strategy.make_dataset_iterator(cudist.data.Dataset.range(8).batch(4))
    it.initialize()
    first = strategy.experimental_local_results(it.get_next())
    got = np.concatenate([np.atleast_1d(to_host(x)) for x in first])
    np.testing.assert_array_equal(got, [0, 1, 2, 3])
    with pytest.warns(DeprecationWarning, match="experimental_make_numpy_dataset"):
        ds = strategy.experimental_make_numpy_dataset(np.arange(3))
    assert [int(x) for x in ds] == [0, 1, 2]


# ----------------------------------------------------------------------------- the seeds' examples with data/variables
def test_central_storage_docstring_example():
    # tf.distribute.experimental.CentralStorageStrategy's docstring example.
    strategy = cudist.experimental.CentralStorageStrategy()
    ds = cudist.data.Dataset.range(5).batch(2)
    dist_dataset = strategy.experimental_distribute_dataset(ds)
    with strategy.scope():

        def train_step(val):
            return val + 1

        outs = [strategy.run(train_step, args=(x,)) for x in dist_dataset]
    assert [np.asarray(o).tolist() for o in outs] == [[1, 2], [3, 4], [5]]


def test_central_storage_two_replicas_one_variable():
    strategy = cudist.CentralStorageStrategy(["/cpu:0", "/cpu:1"], parameter_device="/cpu:2")
    with strategy.scope():
        v = cudist.Variable(1.0)
    assert v.device == CPU.format(2)
    assert strategy.extended.variable_created_in_scope(v)
    ds = cudist.data.Dataset.range(4).batch(4)  # replica 0 gets [0, 1], replica 1 gets [2, 3]
    out = [strategy.run(lambda x: np.sum(x) * 2, args=(b,)) for b in strategy.experimental_distribute_dataset(ds)]
    assert len(out) == 1
    assert strategy.reduce("sum", out[0], axis=None) == 12


def test_one_device_variable_is_plain_on_the_device():
    strategy = cudist.OneDeviceStrategy("/cpu:1")
    with strategy.scope():
        v = cudist.Variable(1.0)
    assert v.device == CPU.format(1)
    assert not isinstance(v, cudist.DistributedValues)


def test_mirrored_variable_update_in_run_and_read_var():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        v = cudist.Variable(1.0, aggregation=cudist.VariableAggregation.SUM)
        assert isinstance(v, cudist.MirroredVariable)
        assert [c.device for c in v.values] == [CPU.format(0), CPU.format(1)]
        assert float(s.extended.read_var(v)) == 1.0

    def step(x):
        v.assign_add(x)
        return v.read_value()

    out = s.run(step, args=(PerReplica([np.float32(1.0), np.float32(2.0)]),))
    assert [float(o) for o in s.experimental_local_results(out)] == [4.0, 4.0]
    with s.scope():
        res = s.extended.update(v, lambda c, d: c.assign_add(d), args=(1.0,), group=False)
    assert len(res) == 2
    assert [float(np.asarray(c.read_value())) for c in v.values] == [5.0, 5.0]


def test_update_non_slot_runs_once_per_non_slot_device(strategy):
    calls = []
    devices = strategy.extended.non_slot_devices([])
    out = strategy.extended.update_non_slot(devices, lambda x: calls.append(x) or x + 1, args=(np.float32(2),))
    n = 1 if isinstance(devices, str) else len(devices)
    assert calls == [np.float32(2)] * n
    vals = strategy.experimental_local_results(out)
    assert all(v == 3 for v in vals)
    assert strategy.extended.update_non_slot(devices, lambda: 7, group=False) == (7,) * n


def test_update_non_slot_needs_cross_replica_context():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(RuntimeError, match="update_non_slot"):
        s.run(lambda: s.extended.update_non_slot(s.extended.non_slot_devices([]), lambda: 1))
