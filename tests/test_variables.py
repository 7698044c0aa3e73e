"""cudist.Variable and the distributed variables, against TF 2.21's observed behaviour.

Every expectation here was checked in TF 2.21 with 4 logical CPUs (tf.Variable under the default
strategy, OneDeviceStrategy, MirroredStrategy with 1-3 replicas and CentralStorageStrategy with 2).
"""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist import VariableAggregation as VA
from cudist import VariableSynchronization as VS
from cudist._arrays import to_host
from cudist._variables import AggregatingVariable

from conftest import make_strategy

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"
FLOAT_DTYPES = ["float16", "float32", "float64"]
DTYPES = FLOAT_DTYPES + ["int32", "int64"]


def _rng(seed=0):
    return np.random.default_rng(seed)


def _random(shape, dtype, seed=0):
    rng = _rng(seed)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(shape) * 4).astype(dtype)
    return rng.integers(-50, 50, size=shape).astype(dtype)


def _n(strategy) -> int:
    return strategy.num_replicas_in_sync


def _kind(strategy) -> str:
    if isinstance(strategy, cudist.MirroredStrategy):
        return "mirrored"
    if isinstance(strategy, cudist.CentralStorageStrategy):
        return "central"
    return "plain"


def _components(v):
    return list(v.values) if isinstance(v, cudist.DistributedValues) else [v]


def _rid():
    return cudist.get_replica_context().replica_id_in_sync_group


def _local(strategy, result):
    return [to_host(x) for x in strategy.experimental_local_results(result)]


# ---------------------------------------------------------------------------- plain variables
class TestPlainVariable:
    def test_repr_name_device_defaults(self):
        v = cudist.Variable(1.0)
        assert repr(v) == "<cudist.Variable 'Variable:0' shape=() dtype=float32, numpy=1.0>"
        assert str(v) == repr(v)
        # TF prints a scalar through Python's float: float32 0.1 is not rounded back to 0.1
        assert repr(cudist.Variable(0.1)).endswith("numpy=0.10000000149011612>")
        assert repr(cudist.Variable(True)).endswith("dtype=bool, numpy=True>")
        assert repr(cudist.Variable(3)).endswith("dtype=int32, numpy=3>")
        assert v.name == "Variable:0"
        assert v.device == CPU.format(0)
        assert v.dtype == np.float32 and isinstance(v.dtype, np.dtype)
        assert v.shape == ()
        assert v.trainable is True
        assert v.synchronization is VS.AUTO and v.aggregation is VA.NONE
        assert v._distribute_strategy is None
        m = cudist.Variable([[1.0, 2.0], [3.0, 4.0]], name="m")
        assert repr(m) == (
            "<cudist.Variable 'm:0' shape=(2, 2) dtype=float32, numpy=\n"
            "array([[1., 2.],\n       [3., 4.]], dtype=float32)>"
        )

    def test_names_are_not_uniquified_but_unique_ids_are(self):
        # TF eager gives two variables named "v" the same name "v:0".
        a, b = cudist.Variable(1.0, name="v"), cudist.Variable(2.0, name="v")
        assert a.name == b.name == "v:0"
        assert a._unique_id != b._unique_id

    @pytest.mark.parametrize(
        "value, dtype",
        [(1.0, "float32"), (3, "int32"), (2**40, "int64"), (True, "bool"), ([1.0, 2], "float32"),
         (np.ones(2), "float64"), (np.float16(1), "float16"), (np.arange(3, dtype=np.int64), "int64")],
    )
    def test_dtype_inference(self, value, dtype):
        v = cudist.Variable(value)
        assert v.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(v.numpy(), np.asarray(value, dtype=dtype))

    def test_dtype_argument_and_callable_initial_value(self):
        v = cudist.Variable(1, dtype=np.float32)
        assert v.dtype == np.float32 and v.numpy() == 1.0
        w = cudist.Variable(lambda: np.full((2, 3), 3.0), name="w", dtype="float64")
        assert w.shape == (2, 3) and w.dtype == np.float64
        np.testing.assert_array_equal(w.numpy(), np.full((2, 3), 3.0))
        # the variable owns its storage: changing the source does not change it
        src = np.ones(3, np.float32)
        u = cudist.Variable(src)
        src[:] = 7
        np.testing.assert_array_equal(u.numpy(), np.ones(3))

    def test_creation_errors(self):
        with pytest.raises(ValueError, match="initial_value"):
            cudist.Variable()
        with pytest.raises(TypeError, match="int32"):
            cudist.Variable(1.5, dtype=np.int32)
        with pytest.raises(ValueError, match="Invalid variable aggregation mode: sum for variable: None"):
            cudist.Variable(1.0, aggregation="sum")
        with pytest.raises(ValueError, match="Invalid variable synchronization mode: on_read for variable: x"):
            cudist.Variable(1.0, synchronization="on_read", name="x")
        with pytest.raises(ValueError, match=r"initial value's shape \(\(2,\)\) is not compatible .* \(\(3,\)\)"):
            cudist.Variable([1.0, 2.0], shape=(3,))
        with pytest.raises(TypeError, match="unsupported dtype"):
            cudist.Variable(np.array(["a"]))
        with pytest.raises(TypeError, match="trainable"):
            cudist.Variable(1.0, trainable="yes")

    def test_outside_strategies_sync_none_and_mean_int_are_allowed(self):
        # TF accepts these outside MirroredStrategy (the checks belong to the distributed variables).
        assert cudist.Variable(1.0, synchronization=VS.NONE).synchronization is VS.NONE
        assert cudist.Variable(1, aggregation=VA.MEAN).dtype == np.int32
        assert cudist.Variable(1.0, synchronization=VS.ON_READ).trainable is False
        assert cudist.Variable(1.0, synchronization=VS.ON_READ, trainable=True).trainable is True

    def test_reads_are_snapshots(self):
        x = _random((3, 5), "float32")
        v = cudist.Variable(x)
        r, val, n, arr = v.read_value(), v.value(), v.numpy(), np.asarray(v)
        for a in (r, val, n, arr):
            np.testing.assert_array_equal(a, x)
        v.assign_add(np.ones((3, 5), np.float32))
        for a in (r, val, n, arr):
            np.testing.assert_array_equal(a, x)  # unchanged by the update
        arr[:] = 0  # writing a read result does not write the variable
        np.testing.assert_array_equal(v.numpy(), x + 1)
        assert isinstance(cudist.Variable(2.5).numpy(), np.float32)

    def test_assign_returns_the_variable(self):
        v = cudist.Variable(1.0)
        assert v.assign(2.0) is v
        assert float(v.assign_add(1.0)) == 3.0
        assert float(v.assign_sub(0.5)) == 2.5
        assert v.assign(4.0, read_value=False) is None
        assert v.numpy() == 4.0

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("shape", [(), (7,), (3, 5)])
    def test_updates_match_numpy(self, dtype, shape):
        x, d = _random(shape, dtype, 1), _random(shape, dtype, 2)
        v = cudist.Variable(x)
        assert v.dtype == np.dtype(dtype)
        v.assign_add(d)
        np.testing.assert_array_equal(v.numpy(), x + d)
        v.assign_sub(d)
        v.assign_sub(d)
        np.testing.assert_array_equal(v.numpy(), (x + d) - d - d)
        v.assign(d)
        np.testing.assert_array_equal(v.numpy(), d)

    def test_update_errors(self):
        v = cudist.Variable([1.0, 2.0], name="v")
        with pytest.raises(ValueError, match=r"'v:0': Shape mismatch.*\(2,\).*\(3,\)"):
            v.assign([1.0, 2.0, 3.0])
        with pytest.raises(ValueError, match=r"Shape mismatch.*\(2,\).*\(\)"):
            v.assign(1.0)  # TF does not broadcast in assign
        with pytest.raises(ValueError, match=r"shape \(2,\).*shape \(\).*shapes must be equal"):
            v.assign_add(1.0)
        with pytest.raises(TypeError, match="float32"):
            v.assign(["a", "b"])
        i = cudist.Variable([1, 2])
        with pytest.raises(TypeError, match="int32"):
            i.assign([1.5, 2.0])  # a Python float does not convert to int32 (TF: TypeError)
        with pytest.raises(ValueError, match="out of range"):
            i.assign([2**40, 1])
        np.testing.assert_array_equal(i.numpy(), [1, 2])  # failed updates change nothing
        # what TF allows: Python ints into floats, NumPy values of other numeric dtypes
        v.assign([3, 4])
        np.testing.assert_array_equal(v.numpy(), [3.0, 4.0])
        i.assign(np.array([5.0, 6.0], np.float32))
        np.testing.assert_array_equal(i.numpy(), [5, 6])
        assert cudist.Variable(1).assign(np.int64(2)).numpy() == 2

    def test_partially_known_shape_allows_reshaping_assign(self):
        v = cudist.Variable([1.0, 2.0], shape=(None,))
        assert v.shape == (None,)
        v.assign([1.0, 2.0, 3.0])
        np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0])
        with pytest.raises(ValueError, match="Shape mismatch"):
            v.assign([[1.0]])

    def test_operators(self):
        x = _random((4,), "float32", 3)
        v, w = cudist.Variable(x), cudist.Variable(x * 2)
        np.testing.assert_array_equal(v + 1, x + 1)
        np.testing.assert_array_equal(1 - v, 1 - x)
        np.testing.assert_array_equal(v * w, x * (x * 2))
        np.testing.assert_array_equal(v / 2, x / 2)
        np.testing.assert_array_equal(2 ** cudist.Variable(3.0), 8.0)
        np.testing.assert_array_equal(-v, -x)
        np.testing.assert_array_equal(abs(v), abs(x))
        np.testing.assert_array_equal(v @ w, x @ (x * 2))
        np.testing.assert_array_equal(v > 0, x > 0)
        np.testing.assert_array_equal(v == x, np.ones(4, bool))
        np.testing.assert_array_equal(v != w, x != x * 2)
        np.testing.assert_array_equal(np.add(v, w), x + x * 2)
        np.testing.assert_array_equal(x + v, x + x)  # ndarray on the left
        assert (v + 1).dtype == np.float32  # Python scalars keep the variable's dtype, as in TF
        assert v[1] == x[1]
        np.testing.assert_array_equal(v[1:3], x[1:3])
        np.testing.assert_array_equal(list(v), list(x))
        assert len(v) == 4
        assert float(cudist.Variable(2.5)) == 2.5 and int(cudist.Variable(3)) == 3
        assert bool(cudist.Variable(True))
        assert f"{cudist.Variable(2.5):.2f}" == "2.50"
        sl = v[1:3]
        sl[:] = 0  # slices are copies
        np.testing.assert_array_equal(v.numpy(), x)
        with pytest.raises(TypeError, match="assign"):
            np.add(x, 1, out=v)
        assert {v: 1}[v] == 1  # hashable by identity

    def test_distributed_classes_are_not_constructed_directly(self):
        with pytest.raises(TypeError, match="cudist.Variable"):
            cudist.MirroredVariable([1.0])


# ---------------------------------------------------------------------------- creation per strategy
def test_creation_in_scope(strategy):
    x = _random((3, 2), "float32", 4)
    with strategy.scope():
        v = cudist.Variable(x, name="v")
    n, kind = _n(strategy), _kind(strategy)
    assert isinstance(v, cudist.Variable)
    assert v._distribute_strategy is strategy
    assert v.name == "v:0" and v.shape == (3, 2) and v.dtype == np.float32 and v.trainable
    np.testing.assert_array_equal(v.numpy(), x)
    np.testing.assert_array_equal(to_host(v.read_value()), x)
    local = strategy.experimental_local_results(v)
    assert len(local) == (n if kind == "mirrored" else 1)
    assert all(a is b for a, b in zip(local, _components(v), strict=True))
    assert strategy.run(lambda: v) is v  # returned whole from every replica, as in TF
    if kind == "mirrored":
        assert isinstance(v, cudist.MirroredVariable) and isinstance(v, cudist.DistributedValues)
        assert v.synchronization is VS.ON_WRITE
        assert [c.name for c in v.values] == ["v:0"] + [f"v/replica_{i}:0" for i in range(1, n)]
        assert [c.device for c in v.values] == list(strategy.extended.worker_devices)
        assert v.device == strategy.extended.worker_devices[0]
        if any("GPU" in d for d in strategy.extended.worker_devices):
            assert len({id(c.storage.array) for c in v.values}) == n  # one buffer per device
            assert all(not np.shares_memory(a.storage.array, b.storage.array) for a in v.values for b in v.values if a is not b)
        else:  # host copies share one array until one is written alone (test_variable_snapshots.py)
            assert len({id(c.storage.array) for c in v.values}) == 1
        for c in v.values:
            np.testing.assert_array_equal(c.numpy(), x)
        assert repr(v).startswith("MirroredVariable:{\n  0: <cudist.Variable 'v:0' shape=(3, 2) dtype=float32")
        assert len(v) == 3  # a variable's len is its first dimension, not the replica count
    elif kind == "central":
        assert isinstance(v, AggregatingVariable) and not isinstance(v, cudist.DistributedValues)
        assert v.device == CPU.format(0) == strategy.extended.parameter_devices[0]
        assert repr(v).startswith("<cudist.Variable 'v:0' shape=(3, 2)")
        assert v.synchronization is VS.AUTO
    else:
        assert type(v) is cudist.Variable
        assert v.device == strategy.extended.worker_devices[0]
        assert v.synchronization is VS.AUTO


def test_one_device_places_on_its_device():
    s = cudist.OneDeviceStrategy("/cpu:2")
    with s.scope():
        v = cudist.Variable(1.0)
    assert type(v) is cudist.Variable and v.device == CPU.format(2)
    assert v._distribute_strategy is s


def test_central_storage_parameter_device():
    s = cudist.CentralStorageStrategy(compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:1")
    with s.scope():
        v = cudist.Variable(1.0, aggregation=VA.SUM)
    assert isinstance(v, AggregatingVariable) and v.device == CPU.format(1)
    assert v.aggregation is VA.SUM


def test_mirrored_creation_rules():
    s = make_strategy("mirrored2")
    with s.scope():
        with pytest.raises(ValueError, match="`NONE` variable synchronization mode is not supported"):
            cudist.Variable(1.0, synchronization=VS.NONE)
        for sync in (VS.ON_WRITE, VS.ON_READ):
            with pytest.raises(ValueError, match="aggregation=MEAN and a non-floating dtype is not supported"):
                cudist.Variable(1, aggregation=VA.MEAN, synchronization=sync)
        assert cudist.Variable(1, aggregation=VA.SUM).dtype == np.int32  # SUM of ints is fine
        r = cudist.Variable(1.0, synchronization=VS.ON_READ, aggregation=VA.SUM, name="r")
        assert isinstance(r, cudist.SyncOnReadVariable) and isinstance(r, cudist.Variable)
        assert not isinstance(r, cudist.MirroredVariable)
        assert r.trainable is False and r.synchronization is VS.ON_READ
        assert [c.name for c in r.values] == ["r:0", "r/replica_1:0"]
        assert cudist.Variable(1.0, synchronization=VS.ON_READ, trainable=True).trainable is True
        assert repr(r).startswith("SyncOnReadVariable:{\n  0: <cudist.Variable 'r:0' shape=() dtype=float32")


@pytest.mark.parametrize("kind", ["one_device", "central2"])
def test_non_mirrored_strategies_accept_sync_none_and_mean_int(kind):
    s = make_strategy(kind)
    with s.scope():
        assert cudist.Variable(1.0, synchronization=VS.NONE).numpy() == 1.0
        assert cudist.Variable(1, aggregation=VA.MEAN).dtype == np.int32
        assert cudist.Variable(1.0, synchronization=VS.ON_READ).trainable is False


# ---------------------------------------------------------------------------- cross-replica updates
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_replica_updates_write_every_component(strategy, dtype):
    shape = (5, 3)
    x, d = _random(shape, dtype, 5), _random(shape, dtype, 6)
    with strategy.scope():
        v = cudist.Variable(x, aggregation=VA.SUM)
        r = v.assign_add(d)
        want = x + d
        for c in _components(v):
            np.testing.assert_array_equal(c.numpy(), want)
        if _kind(strategy) == "mirrored":
            # TF returns a Mirrored of the updated values
            assert isinstance(r, cudist.Mirrored) and len(r.values) == _n(strategy)
            for a in r.values:
                np.testing.assert_array_equal(to_host(a), want)
        v.assign_sub(d)
        v.assign_sub(d)
        want = want - d - d
        for c in _components(v):
            np.testing.assert_array_equal(c.numpy(), want)
    v.assign(d)  # after the scope closed: still updates every component
    for c in _components(v):
        np.testing.assert_array_equal(c.numpy(), d)
    assert v.assign(x, read_value=False) is None
    for c in _components(v):
        np.testing.assert_array_equal(c.numpy(), x)


def test_cross_replica_update_errors(strategy):
    with strategy.scope():
        v = cudist.Variable(np.zeros((2, 3), np.float32), name="v")
    with pytest.raises(ValueError, match=r"Shape mismatch.*\(2, 3\).*\(3, 2\)"):
        v.assign(np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="shapes must be equal"):
        v.assign_add(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="float32"):
        v.assign([["a"] * 3] * 2)
    for c in _components(v):
        np.testing.assert_array_equal(c.numpy(), np.zeros((2, 3)))


def test_assign_component_to_all():
    s = make_strategy("mirrored3")
    with s.scope():
        v = cudist.Variable(np.arange(4.0, dtype=np.float32))
    v.values[1].storage.array[:] = 9  # desynchronise on purpose, then resynchronise from component 1
    v.assign(v.values[1])
    for c in v.values:
        np.testing.assert_array_equal(c.numpy(), np.full(4, 9.0))


# ---------------------------------------------------------------------------- replica context
def _expected(agg, x0, per_replica, method):
    """What every component holds after a replica-context update with aggregation agg."""
    if agg is VA.ONLY_FIRST_REPLICA:
        val = per_replica[0]
    elif agg is VA.SUM:
        val = sum(per_replica[1:], per_replica[0].copy())
    else:
        val = sum(per_replica[1:], per_replica[0].copy()) / per_replica[0].dtype.type(len(per_replica))
    return {"assign": val, "assign_add": x0 + val, "assign_sub": x0 - val}[method]


# MEAN of integers is rejected at creation (test_mirrored_creation_rules).
_AGG_DTYPES = [(a, d) for a in (VA.SUM, VA.MEAN, VA.ONLY_FIRST_REPLICA) for d in ("float32", "float64", "int32")
               if not (a is VA.MEAN and d == "int32")]


@pytest.mark.parametrize("agg, dtype", _AGG_DTYPES)
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_replica_context_aggregated_updates(strategy, agg, method, dtype):
    n = _n(strategy)
    x0 = _random((2, 3), dtype, 7)
    per_replica = [_random((2, 3), dtype, 10 + i) for i in range(n)]
    with strategy.scope():
        v = cudist.Variable(x0, aggregation=agg)

    def step():
        return getattr(v, method)(per_replica[_rid()])

    result = strategy.run(step)
    want = _expected(agg, x0, per_replica, method)
    if _kind(strategy) == "plain":  # a plain variable: one replica, no aggregation
        want = {"assign": per_replica[0], "assign_add": x0 + per_replica[0], "assign_sub": x0 - per_replica[0]}[method]
    for c in _components(v):
        assert c.dtype == np.dtype(dtype)
        np.testing.assert_allclose(c.numpy(), want, rtol=1e-6)
    for r in _local(strategy, result):
        np.testing.assert_allclose(r, want, rtol=1e-6)


def test_replica_context_aggregation_none(strategy):
    n, kind = _n(strategy), _kind(strategy)
    with strategy.scope():
        v = cudist.Variable(1.0)
    if kind == "central":
        with pytest.raises(ValueError, match="You must specify an aggregation method to update a AggregatingVariable"):
            strategy.run(lambda: v.assign(np.float32(_rid() + 10)))
        assert v.numpy() == 1.0
        return
    result = strategy.run(lambda: v.assign(np.float32(_rid() + 10)))
    # each replica wrote its own component only; TF returns the local component
    assert [c.numpy() for c in _components(v)] == [10.0 + i for i in range(n)]
    locals_ = strategy.experimental_local_results(result)
    assert [float(r) for r in locals_] == [10.0 + i for i in range(n)]
    if kind == "mirrored":
        assert all(r is c for r, c in zip(locals_, v.values))
    strategy.run(lambda: v.assign_add(np.float32(_rid() + 1)))
    assert [c.numpy() for c in _components(v)] == [11.0 + 2 * i for i in range(n)]
    reads = strategy.run(lambda: v.read_value())
    assert [float(r) for r in _local(strategy, reads)] == [11.0 + 2 * i for i in range(n)]


def test_replica_context_sum_of_constant(strategy):
    n = _n(strategy)
    with strategy.scope():
        v = cudist.Variable(1.0, aggregation=VA.SUM)
        m = cudist.Variable(1.0, aggregation=VA.MEAN)
    if n > 1:
        with pytest.raises(ValueError, match=r"A non-DistributedValues value 7.0 cannot be reduced with the given reduce op ReduceOp.SUM"):
            strategy.run(lambda: v.assign(7.0))
        for c in _components(v):
            assert c.numpy() == 1.0
    else:  # one replica: nothing to reduce (TF assigns)
        strategy.run(lambda: v.assign(7.0))
        assert v.numpy() == 7.0
    strategy.run(lambda: m.assign_add(2.0))  # MEAN of the same value is the value
    for c in _components(m):
        assert c.numpy() == 3.0


def test_replica_reads_see_local_component():
    s = make_strategy("mirrored3")
    with s.scope():
        w = cudist.Variable(np.full(2, 3.0, np.float32), name="w")
    devices = s.run(lambda: w.device)
    assert list(s.experimental_local_results(devices)) == [CPU.format(i) for i in range(3)]
    plus = s.run(lambda: w + 1)
    for r in _local(s, plus):
        np.testing.assert_array_equal(r, [4.0, 4.0])
    assert s.run(lambda: w.name) == "w:0"


def test_tf_docs_variable_aggregation_mean_example():
    # tf.VariableAggregation's docstring: two replicas, MEAN, assign_add(1.0) -> 6.0 on both.
    s = make_strategy("mirrored2")
    with s.scope():
        v = cudist.Variable(5.0, aggregation=VA.MEAN)
    result = s.run(lambda: v.assign_add(1.0))
    assert isinstance(result, cudist.PerReplica)
    assert [float(r) for r in result.values] == [6.0, 6.0]
    assert [c.numpy() for c in v.values] == [6.0, 6.0]


def test_tf_docs_aggregation_sum_update_example():
    # StrategyExtended.update's docstring: v = 5.0 (SUM) assigned 1.0 -> 1.0 on every component.
    s = make_strategy("mirrored2")
    with s.scope():
        v = cudist.Variable(5.0, aggregation=VA.SUM)
    result = v.assign(1.0)
    assert [float(r) for r in result.values] == [1.0, 1.0]
    assert [c.numpy() for c in v.values] == [1.0, 1.0]


@pytest.mark.parametrize("agg", [VA.SUM, VA.MEAN, VA.ONLY_FIRST_REPLICA])
def test_central_storage_replica_updates_apply_once(agg):
    s = make_strategy("central2")
    with s.scope():
        v = cudist.Variable(1.0, aggregation=agg)
    result = s.run(lambda: v.assign(np.float32(_rid() + 10)))
    want = {VA.SUM: 21.0, VA.MEAN: 10.5, VA.ONLY_FIRST_REPLICA: 10.0}[agg]
    assert v.numpy() == want
    assert result is v  # TF returns one (unread) view of the variable, not a PerReplica
    s.run(lambda: v.assign_add(np.float32(_rid() + 1)))
    want += {VA.SUM: 3.0, VA.MEAN: 1.5, VA.ONLY_FIRST_REPLICA: 1.0}[agg]
    assert v.numpy() == want
    reads = s.run(lambda: v.read_value())
    assert [float(r) for r in _local(s, reads)] == [want, want]


def test_central_storage_on_read_aggregates_replica_updates():
    # TF's AggregatingVariable ignores ON_READ for updates: replica updates are still aggregated.
    s = make_strategy("central2")
    with s.scope():
        r = cudist.Variable(1.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
    assert r.synchronization is VS.ON_READ and r.trainable is False
    s.run(lambda: r.assign(np.float32(_rid() + 10)))
    assert r.numpy() == 21.0


# ---------------------------------------------------------------------------- sync on read
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sync_on_read(n):
    s = make_strategy(f"mirrored{n}")
    with s.scope():
        vs = {agg: cudist.Variable(1.0, synchronization=VS.ON_READ, aggregation=agg) for agg in VA}
    assert vs[VA.SUM].numpy() == n  # n components of 1.0
    assert vs[VA.MEAN].numpy() == 1.0
    for agg, v in vs.items():
        result = s.run(lambda v=v: v.assign(np.float32(_rid() + 10)))
        # replica-context writes stay local; TF returns the local component
        assert [c.numpy() for c in v.values] == [10.0 + i for i in range(n)]
        assert all(a is b for a, b in zip(s.experimental_local_results(result), v.values, strict=True))
        reads = s.run(lambda v=v: v.read_value())
        assert [float(r) for r in _local(s, reads)] == [10.0 + i for i in range(n)]
        s.run(lambda v=v: v.assign_add(1.0))  # a constant is fine: nothing is reduced
        assert [c.numpy() for c in v.values] == [11.0 + i for i in range(n)]
    total = sum(11.0 + i for i in range(n))
    assert vs[VA.SUM].numpy() == total
    assert float(vs[VA.SUM].read_value()) == total and float(vs[VA.SUM].value()) == total
    assert float(vs[VA.SUM] + 0) == total and float(np.asarray(vs[VA.SUM])) == total
    assert vs[VA.MEAN].numpy() == np.float32(total) / np.float32(n)
    assert vs[VA.ONLY_FIRST_REPLICA].numpy() == 11.0
    with pytest.raises(ValueError, match="Could not convert from `tf.VariableAggregation` VariableAggregation.NONE"):
        vs[VA.NONE].numpy()
    with pytest.raises(ValueError, match="Could not convert"):  # written, then read back (as TF 2.21)
        vs[VA.NONE].assign(6.0)
    assert [float(c.numpy()) for c in vs[VA.NONE].values] == [6.0] * n

    # cross-replica assign: SUM writes value / N to each component so the sum reads back as value
    assert float(vs[VA.SUM].assign(6.0)) == pytest.approx(6.0)
    np.testing.assert_allclose([c.numpy() for c in vs[VA.SUM].values], [6.0 / n] * n, rtol=1e-6)
    for agg in (VA.MEAN, VA.ONLY_FIRST_REPLICA):
        assert float(vs[agg].assign(6.0)) == 6.0
        assert [c.numpy() for c in vs[agg].values] == [6.0] * n
        assert float(vs[agg].assign_add(3.0)) == 9.0
        assert float(vs[agg].assign_sub(1.0)) == 8.0
        assert [c.numpy() for c in vs[agg].values] == [8.0] * n
    for method in ("assign_add", "assign_sub"):
        with pytest.raises(ValueError, match=f"SyncOnReadVariable does not support `{method}` in cross-replica context"):
            getattr(vs[VA.SUM], method)(1.0)


def test_sync_on_read_int_sum_assign_truncates():
    s = make_strategy("mirrored3")
    with s.scope():
        v = cudist.Variable(3, synchronization=VS.ON_READ, aggregation=VA.SUM)
    assert v.numpy() == 9
    assert int(v.assign(7)) == 6  # TF: 7 / 3 -> 2 per component, reads back 6
    assert [int(c.numpy()) for c in v.values] == [2, 2, 2]


def test_sync_on_read_cross_replica_assign_add_with_different_components():
    s = make_strategy("mirrored2")
    with s.scope():
        v = cudist.Variable(np.zeros(3, np.float32), synchronization=VS.ON_READ, aggregation=VA.MEAN)
    s.run(lambda: v.assign(np.full(3, _rid() + 1.0, np.float32)))
    v.assign_add(np.array([1.0, 2.0, 3.0], np.float32))  # each component gets the delta
    np.testing.assert_array_equal(v.values[0].numpy(), [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(v.values[1].numpy(), [3.0, 4.0, 5.0])
    np.testing.assert_array_equal(v.numpy(), [2.5, 3.5, 4.5])


def test_tf_docs_sync_on_read_example():
    # Strategy docs: ON_READ SUM variable read in replica context is the local, non-aggregated value.
    s = make_strategy("mirrored2")
    with s.scope():
        v = cudist.Variable(1.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
    non_aggregated = s.run(lambda: v + 10.0)
    assert [float(x) for x in s.experimental_local_results(non_aggregated)] == [11.0, 11.0]
    assert float(v + 10.0) == 12.0  # cross-replica: the aggregated value


def test_tf_docs_temp_grad_example(strategy):
    with strategy.scope():
        temp_grad = [cudist.Variable([0.0], trainable=False, synchronization=VS.ON_READ, aggregation=VA.MEAN)]
    g = temp_grad[0]
    assert g.trainable is False and g.synchronization is VS.ON_READ and g.aggregation is VA.MEAN
    strategy.run(lambda: g.assign_add(np.array([_rid() + 1.0], np.float32)))
    n = _n(strategy)
    if _kind(strategy) == "mirrored":  # the mean of the per-replica accumulations
        np.testing.assert_allclose(g.numpy(), [np.mean([i + 1.0 for i in range(n)])])
    elif _kind(strategy) == "central":  # AggregatingVariable: aggregated on write
        np.testing.assert_allclose(g.numpy(), [np.mean([i + 1.0 for i in range(n)])])
    else:
        np.testing.assert_allclose(g.numpy(), [1.0])


# ---------------------------------------------------------------------------- TF docs CentralStorage example
def test_tf_docs_central_storage_example():
    # CentralStorageStrategy's docstring, with a variable created in scope as a training step would.
    strategy = cudist.experimental.CentralStorageStrategy()
    ds = cudist.data.Dataset.range(5).batch(2)
    dist_dataset = strategy.experimental_distribute_dataset(ds)
    with strategy.scope():
        total = cudist.Variable(0, aggregation=VA.SUM, name="total")

        def train_step(val):
            total.assign_add(np.sum(val).astype(np.int32))
            return val + 1

        outs = []
        for x in dist_dataset:
            outs.append(strategy.run(train_step, args=(x,)))
    got = [np.concatenate([np.atleast_1d(np.asarray(r)) for r in strategy.experimental_local_results(o)]) for o in outs]
    assert [g.tolist() for g in got] == [[1, 2], [3, 4], [5]]
    assert total.numpy() == 10
    # Without GPUs CentralStorageStrategy() has one compute device: TF 2.21 makes a plain variable
    # (see test_tf_parity.py), on the parameter device.
    assert type(total) is cudist.Variable
    assert total.device == CPU.format(0)


@pytest.mark.parametrize("kind", ["mirrored2", "mirrored3", "central2"])
def test_variable_created_inside_run_is_created_once(kind):
    # TF creates one variable from replica 0's initial value; every replica gets the same object.
    s = make_strategy(kind)
    created = []

    def fn():
        v = cudist.Variable(lambda: np.float32(_rid() + 1.0), name="inrun")
        created.append(v)
        return v

    with s.scope():
        v = s.run(fn)
    assert isinstance(v, cudist.Variable)
    assert len(created) == _n(s) and all(c is v for c in created)
    assert v.name == "inrun:0"
    for c in _components(v):
        assert c.numpy() == 1.0
