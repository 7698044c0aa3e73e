"""Regression tests for differences from TF 2.21 found by a side-by-side parity audit.

Each test states the TF 2.21 behaviour it pins; every expectation was observed by running the same
snippet under TensorFlow 2.21 with 4 logical CPUs (``tf.config.set_logical_device_configuration``).
TF itself is never imported here.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import cudist
from cudist import VariableAggregation as VA
from cudist import VariableSynchronization as VS

Pair = collections.namedtuple("Pair", ["a", "b"])


def _mirrored(n=2):
    return cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


def _per_replica(strategy, fn):
    return strategy.experimental_distribute_values_from_function(lambda c: fn(c.replica_id_in_sync_group))


# ------------------------------------------------------------------ Strategy.reduce / gather over nests
def test_reduce_nested_structure_axis_none():
    # TF: strategy.reduce("SUM", (pr, {"k": pr}), axis=None) reduces every leaf and keeps the nest:
    # (array([3., 3.]), {'k': array([3., 3.])}) for replicas holding [1, 1] and [2, 2].
    s = _mirrored(2)
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal(3).astype(np.float32) for _ in range(2)]
    pr = _per_replica(s, lambda i: parts[i])
    out = s.reduce("SUM", (pr, {"k": pr}), axis=None)
    assert isinstance(out, tuple) and isinstance(out[1], dict)
    np.testing.assert_allclose(out[0], parts[0] + parts[1], rtol=1e-6)
    np.testing.assert_allclose(out[1]["k"], parts[0] + parts[1], rtol=1e-6)
    (single,) = s.reduce("MEAN", (pr,), axis=None)  # TF: a 1-tuple in, a 1-tuple out
    np.testing.assert_allclose(single, (parts[0] + parts[1]) / 2, rtol=1e-6)


def test_reduce_nested_structure_with_axis_and_namedtuple():
    # TF reduces each leaf with the axis rule (sum within replicas, divide by the global count).
    s = _mirrored(2)
    a = [np.arange(3, dtype=np.float32) + 1, np.arange(1, dtype=np.float32) + 7]  # partial batch: 3 + 1 rows
    pr = _per_replica(s, lambda i: a[i])
    out = s.reduce("MEAN", Pair(pr, [pr]), axis=0)
    assert isinstance(out, Pair) and isinstance(out.b, list)
    np.testing.assert_allclose(out.a, (1 + 2 + 3 + 7) / 4)
    np.testing.assert_allclose(out.b[0], (1 + 2 + 3 + 7) / 4)


def test_gather_nested_structure():
    # TF 2.21's Strategy.gather on a nest silently returns replica 0's components only ([1, 1] for
    # replicas [1, 1] and [2, 2]); we gather every leaf, which is what the docs describe per value.
    s = _mirrored(3)
    pr = _per_replica(s, lambda i: np.full((2, i + 1), i, np.float32))
    ipr = _per_replica(s, lambda i: np.array([i, 10 * i], np.int32))
    out = s.gather({"x": pr, "y": [pr]}, axis=1)
    assert set(out) == {"x", "y"} and isinstance(out["y"], list)
    want = np.concatenate([np.full((2, i + 1), i, np.float32) for i in range(3)], 1)
    np.testing.assert_array_equal(out["x"], want)
    np.testing.assert_array_equal(out["y"][0], want)
    with pytest.raises(ValueError, match="axis 1"):
        s.gather({"y": [ipr]}, axis=1)  # rank-1 leaves have no axis 1
    np.testing.assert_array_equal(s.gather((ipr,), axis=0)[0], np.array([0, 0, 1, 10, 2, 20], np.int32))


# ------------------------------------------------------------------ variables used under another strategy
@pytest.mark.parametrize("sync", ["on_write", "on_read"])
def test_variable_of_another_strategy_raises_in_its_run_and_scope(sync):
    # TF: reading or updating a MirroredVariable / SyncOnReadVariable inside another strategy's run
    # or scope raises RuntimeError("Mixing different tf.distribute.Strategy objects: ...").
    # (Before the fix each replica of the other strategy applied assign_add to the shared variable.)
    s, other = _mirrored(2), _mirrored(2)
    kw = {} if sync == "on_write" else {"synchronization": VS.ON_READ, "aggregation": VA.SUM}
    with s.scope():
        v = cudist.Variable(np.array([1.0, 2.0], np.float32), **kw)
    with pytest.raises(RuntimeError, match="Mixing different cudist.Strategy objects"):
        other.run(lambda: v.assign_add(np.ones(2, np.float32)))
    with pytest.raises(RuntimeError, match="Mixing different cudist.Strategy objects"):
        other.run(lambda: v.read_value())
    with other.scope():
        with pytest.raises(RuntimeError, match="Mixing different cudist.Strategy objects"):
            v.assign(np.zeros(2, np.float32))
        with pytest.raises(RuntimeError, match="Mixing different cudist.Strategy objects"):
            v.read_value()
        assert v.device == "/job:localhost/replica:0/task:0/device:CPU:0"  # metadata stays readable
    # Nothing was written; outside any scope the variable works (TF enters its strategy).
    np.testing.assert_array_equal(v.read_value(), np.array([1.0, 2.0], np.float32) * (2 if kw else 1))
    v.assign(np.array([4.0, 6.0], np.float32))
    np.testing.assert_array_equal(v.read_value(), [4.0, 6.0])


def test_central_storage_variable_in_another_strategy_raises():
    cs = cudist.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with cs.scope():
        v = cudist.Variable(np.array([1.0], np.float32), aggregation=VA.SUM)
    with pytest.raises(RuntimeError, match="Mixing different cudist.Strategy objects"):
        _mirrored(2).run(lambda: v.assign_add(np.ones(1, np.float32)))
    np.testing.assert_array_equal(v.numpy(), [1.0])


# ------------------------------------------------------------------ extended.update in replica context
def test_extended_update_in_replica_context_goes_through_merge_call():
    # TF: strategy.run(lambda: strategy.extended.update(v, lambda var, x: var.assign(x), args=(x,)))
    # works in replica context (via merge_call); per-replica args reach the matching component
    # (replica r's value is written to component r) and run returns a PerReplica.
    s = _mirrored(3)
    with s.scope():
        v = cudist.Variable(np.zeros(2, np.float32))
    rng = np.random.default_rng(5)
    vals = [rng.standard_normal(2).astype(np.float32) for _ in range(3)]

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        return s.extended.update(v, lambda var, x: var.assign(x), args=(vals[r],))

    out = s.run(step)
    assert isinstance(out, cudist.PerReplica) and len(out.values) == 3
    for r in range(3):
        np.testing.assert_array_equal(np.asarray(out.values[r]), vals[r])
        np.testing.assert_array_equal(v.values[r].numpy(), vals[r])

    same = rng.standard_normal(2).astype(np.float32)
    s.run(lambda: s.extended.update(v, lambda var, x: var.assign_add(x), args=(same,), group=False))
    for r in range(3):
        np.testing.assert_allclose(v.values[r].numpy(), vals[r] + same, rtol=1e-6)


def test_extended_update_still_rejects_other_strategy_replica_context():
    s, other = _mirrored(2), _mirrored(2)
    with s.scope():
        v = cudist.Variable(np.zeros(1, np.float32))
    with pytest.raises(RuntimeError):
        other.run(lambda: s.extended.update(v, lambda var: var.assign(np.ones(1, np.float32))))
    np.testing.assert_array_equal(v.numpy(), [0.0])


# ------------------------------------------------------------------ behaviours the audit found matching TF
def test_partial_and_empty_batches_reduce_with_axis_like_tf():
    # TF 2.21: range(5) as one batch over 2 replicas splits 3 + 2; reduce(MEAN, x * 2, axis=0) = 4.0.
    # One element over 2 replicas splits 1 + 0; MEAN and SUM with axis=0 give 0.0 for x = [0].
    s = _mirrored(2)
    ds = cudist.data.Dataset.from_tensor_slices(np.arange(5, dtype=np.float32)).batch(5)
    (batch,) = list(s.experimental_distribute_dataset(ds))
    assert [c.shape for c in batch.values] == [(3,), (2,)]
    assert s.reduce("MEAN", s.run(lambda x: x * 2, args=(batch,)), axis=0) == pytest.approx(4.0)
    ds1 = cudist.data.Dataset.from_tensor_slices(np.arange(1, dtype=np.float32) + 3).batch(1)
    (b1,) = list(s.experimental_distribute_dataset(ds1))
    assert [c.shape for c in b1.values] == [(1,), (0,)]
    assert s.reduce("MEAN", b1, axis=0) == pytest.approx(3.0)
    assert s.reduce("SUM", b1, axis=0) == pytest.approx(3.0)


def test_iterator_exhaustion_like_tf():
    # TF: next() past the end raises StopIteration; get_next() raises OutOfRangeError;
    # get_next_as_optional() gives an optional whose has_value() is False.
    s = _mirrored(2)
    dds = s.experimental_distribute_dataset(cudist.data.Dataset.range(4).batch(4))
    it = iter(dds)
    next(it)
    with pytest.raises(StopIteration):
        next(it)
    it = iter(dds)
    it.get_next()
    with pytest.raises(cudist.errors.OutOfRangeError):
        it.get_next()
    it = iter(dds)
    assert it.get_next_as_optional().has_value()
    assert not it.get_next_as_optional().has_value()
