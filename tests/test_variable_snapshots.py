"""Host variable reads (``value()``/``read_value()``) are copy-on-write snapshots.

A snapshot is a read-only NumPy array sharing the variable's memory; the first in-place write
while any array derived from a snapshot is still referenced moves the variable to fresh memory,
so every snapshot keeps the value it was read at (TF: a tensor read from a variable never
changes). A snapshot dropped before the write costs no copy. Every writer is covered: assign*,
cross-replica and replica-context updates of each variable kind, the fused optimizer kernels
(variables and slots), sync-on-read writes, checkpoint restore.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import cudist
from cudist import VariableAggregation as VA
from cudist import VariableSynchronization as VS
import cudist.optimizers as optimizers

from conftest import make_strategy


def _rand(shape=(7, 5), dtype="float32", seed=0):
    """Random integer-valued floats (never zeros), so adding 1 twice or 2 once agree exactly."""
    return np.random.default_rng(seed).integers(1, 50, shape).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_snapshot_keeps_its_value_across_writes(dtype, method):
    a = _rand(dtype="float64").astype(dtype)
    v = cudist.Variable(a)
    snap = v.read_value()
    val = v.value()
    assert not snap.flags.writeable and not val.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        snap[0, 0] = 1
    delta = (np.ones_like(a) * 3).astype(dtype)
    getattr(v, method)(delta)
    want = {"assign": delta, "assign_add": a + delta, "assign_sub": a - delta}[method].astype(dtype)
    np.testing.assert_array_equal(v.numpy(), want)
    np.testing.assert_array_equal(snap, a)
    np.testing.assert_array_equal(val, a)
    assert np.dtype(snap.dtype) == np.dtype(dtype) and snap.shape == a.shape


def test_derived_views_of_a_dropped_snapshot_still_protect_it():
    a = _rand()
    v = cudist.Variable(a)
    tail = v.read_value().T[1:]  # the snapshot object itself is gone; only a view of it lives
    row = v.value()[2]
    v.assign_add(np.ones_like(a))
    np.testing.assert_array_equal(tail, a.T[1:])
    np.testing.assert_array_equal(row, a[2])
    np.testing.assert_array_equal(v.numpy(), a + 1)


def test_dropped_snapshots_cost_no_copy():
    a = _rand()
    v = cudist.Variable(a)
    live = np.from_dlpack(v)  # the live storage: sees in-place writes only
    for i in range(3):
        float(v.read_value()[0, 0])  # read, then dropped
        v.assign_add(np.ones_like(a))
        np.testing.assert_array_equal(live, a + (i + 1))
    held = v.read_value()
    v.assign_add(np.ones_like(a))  # held snapshot: the variable moves, the old memory stays with it
    np.testing.assert_array_equal(held, a + 3)
    np.testing.assert_array_equal(live, a + 3)
    np.testing.assert_array_equal(v.numpy(), a + 4)


def test_each_read_is_a_new_object_and_numpy_stays_a_writable_copy():
    v = cudist.Variable(_rand())
    r1, r2 = v.read_value(), v.read_value()
    assert r1 is not r2 and np.shares_memory(r1, r2)
    n = v.numpy()
    assert n.flags.writeable and not np.shares_memory(n, r1)
    w = np.asarray(v)
    assert w.flags.writeable and not np.shares_memory(w, r1)  # as TF: np.asarray(tf.Variable) is a copy


def test_scalar_and_copy_and_pickle_after_reads():
    v = cudist.Variable(np.float32(2.5))
    s = v.read_value()
    v.assign(np.float32(4.0))
    assert float(s) == 2.5 and float(v.numpy()) == 4.0
    d = copy.deepcopy(v)
    d.assign(np.float32(1.0))
    assert float(v.numpy()) == 4.0 and float(d.numpy()) == 1.0
    p = pickle.loads(pickle.dumps(v))
    assert float(p.numpy()) == 4.0


@pytest.mark.parametrize("kind", ["mirrored2", "central2", "one_device", "mirrored3"])
def test_replica_reads_survive_an_optimizer_step(kind):
    strategy = make_strategy(kind)
    a, b = _rand(seed=1), _rand((5,), seed=2)
    with strategy.scope():
        vs = [cudist.Variable(a), cudist.Variable(b)]
        opt = optimizers.SGD(learning_rate=0.1, momentum=0.9)
    held = []

    def step():
        ps = [v.read_value() for v in vs]  # held across apply_gradients
        held.append(ps)
        grads = [p * np.float32(0.5) for p in ps]
        opt.apply_gradients(zip(grads, vs))
        return ps[0]

    out = strategy.run(step)
    n = strategy.num_replicas_in_sync
    for ps in held:
        np.testing.assert_array_equal(ps[0], a)
        np.testing.assert_array_equal(ps[1], b)
    if n > 1:
        assert isinstance(out, cudist.DistributedValues)  # distinct objects per replica, as TF's tensors
    # Sum of the replicas' gradients (SUM aggregation of apply_gradients), one momentum step from 0.
    for v, x in zip(vs, (a, b)):
        want = x - np.float32(0.1) * (np.float32(0.5) * x * n)
        for c in strategy.experimental_local_results(v):
            np.testing.assert_allclose(np.asarray(c), want, rtol=1e-6)
    after1 = [np.array(v.read_value()) for v in vs]
    strategy.run(step)  # the second step reads the updated values
    for ps in held[n:]:
        np.testing.assert_array_equal(ps[0], after1[0])
        np.testing.assert_array_equal(ps[1], after1[1])
    del out


def test_gradient_that_is_a_snapshot_of_the_variable_itself():
    a = _rand()
    v = cudist.Variable(a)
    opt = optimizers.SGD(learning_rate=0.5)
    g = v.read_value()
    opt.apply_gradients([(g, v)])
    np.testing.assert_allclose(v.numpy(), a - np.float32(0.5) * a, rtol=1e-6)
    np.testing.assert_array_equal(g, a)


def test_optimizer_slots_are_copy_on_write_too():
    strategy = make_strategy("mirrored2")
    a = _rand()
    with strategy.scope():
        v = cudist.Variable(a)
        opt = optimizers.Adam(learning_rate=0.01)
    g = np.ones_like(a)
    strategy.run(lambda: opt.apply_gradients([(g, v)]))
    m = opt.get_slot(v, "momentum")
    m_before = m.read_value()
    kept = m_before.copy()
    strategy.run(lambda: opt.apply_gradients([(g, v)]))
    np.testing.assert_array_equal(m_before, kept)
    assert not np.array_equal(np.asarray(m.read_value()), kept)


@pytest.mark.parametrize("agg", [VA.SUM, VA.MEAN, VA.ONLY_FIRST_REPLICA])
def test_sync_on_read_local_snapshots(agg):
    strategy = make_strategy("mirrored2")
    with strategy.scope():
        v = cudist.Variable(np.zeros(4, np.float32), synchronization=VS.ON_READ, aggregation=agg)
    reads = []

    def step():
        reads.append(v.read_value())
        v.assign_add(np.ones(4, np.float32))

    strategy.run(step)
    for r in reads:
        np.testing.assert_array_equal(r, np.zeros(4, np.float32))
    total = v.read_value()  # cross-replica: the aggregate, a fresh array
    want = {VA.SUM: 2.0, VA.MEAN: 1.0, VA.ONLY_FIRST_REPLICA: 1.0}[agg]
    np.testing.assert_array_equal(total, np.full(4, want, np.float32))
    v.assign(np.full(4, 8.0, np.float32))
    np.testing.assert_array_equal(total, np.full(4, want, np.float32))


def test_cross_replica_update_results_are_snapshots():
    strategy = make_strategy("mirrored2")
    a = _rand()
    with strategy.scope():
        v = cudist.Variable(a)
    res = v.assign_add(np.ones_like(a))
    first = [np.array(x) for x in strategy.experimental_local_results(res)]
    v.assign_add(np.ones_like(a))
    for x, f in zip(strategy.experimental_local_results(res), first):
        np.testing.assert_array_equal(x, f)
        np.testing.assert_array_equal(x, a + 1)
    np.testing.assert_array_equal(v.numpy(), a + 2)


def test_checkpoint_restore_keeps_held_snapshots(tmp_path):
    a = _rand()
    v = cudist.Variable(a)
    ckpt = cudist.train.Checkpoint(v=v)
    path = ckpt.save(str(tmp_path / "c"))
    v.assign(np.zeros_like(a))
    held = v.read_value()
    ckpt.restore(path)
    np.testing.assert_array_equal(held, np.zeros_like(a))
    np.testing.assert_array_equal(v.numpy(), a)


# ------------------------------------------------------------------ host mirrored copies share storage
def _storages(v):
    return len({id(c.storage.array) for c in v.values})


def test_host_mirrored_copies_share_one_storage_until_one_is_written_alone():
    strategy = make_strategy("mirrored3")
    a = _rand()
    with strategy.scope():
        v = cudist.Variable(a, aggregation=VA.NONE)
    assert _storages(v) == 1
    v.assign_add(np.ones_like(a))  # cross-replica: every copy, written once
    assert _storages(v) == 1
    for c in v.values:
        np.testing.assert_array_equal(c.numpy(), a + 1)

    def local_write():
        rid = cudist.get_replica_context().replica_id_in_sync_group
        if rid == 1:
            v.assign_add(np.full_like(a, 10))  # aggregation NONE: replica 1's copy alone

    strategy.run(local_write)
    got = [c.numpy() for c in v.values]
    np.testing.assert_array_equal(got[0], a + 1)
    np.testing.assert_array_equal(got[1], a + 11)
    np.testing.assert_array_equal(got[2], a + 1)
    assert _storages(v) == 2  # replicas 0 and 2 still share
    v.assign(a)  # every copy again, each storage written
    for c in v.values:
        np.testing.assert_array_equal(c.numpy(), a)


def test_cross_replica_per_replica_assign_splits_the_copies():
    strategy = make_strategy("mirrored2")
    a = _rand()
    with strategy.scope():
        v = cudist.Variable(a)
    v.assign(cudist.PerReplica([a * 2, a * 3]))  # as TF: each component its own replica's value
    np.testing.assert_array_equal(v.values[0].numpy(), a * 2)
    np.testing.assert_array_equal(v.values[1].numpy(), a * 3)


def test_all_write_with_a_snapshot_held_on_one_copy_moves_every_sharing_copy():
    strategy = make_strategy("mirrored2")
    a = _rand()
    with strategy.scope():
        v = cudist.Variable(a)
    held = strategy.run(lambda: v.read_value())
    snaps = strategy.experimental_local_results(held)
    v.assign_add(np.ones_like(a))
    for s in snaps:
        np.testing.assert_array_equal(s, a)
    assert _storages(v) == 1
    for c in v.values:
        np.testing.assert_array_equal(c.numpy(), a + 1)


@pytest.mark.parametrize("opt_name", ["momentum", "adam"])
def test_optimizer_after_the_copies_diverged(opt_name):
    """Slots still shared while the variable's copies went their own ways: every copy gets its own
    storage, and the fused pass does what it always does (reads copy 0 of the variable and slots,
    writes every copy; reference: the same two steps on a plain variable)."""
    strategy = make_strategy("mirrored2")
    a = _rand()
    with strategy.scope():
        v = cudist.Variable(a, aggregation=VA.NONE)
        opt = optimizers.SGD(0.1, momentum=0.9) if opt_name == "momentum" else optimizers.Adam(0.01)
    g = [np.full_like(a, 0.5), np.full_like(a, 1.5)]
    strategy.run(lambda: opt.apply_gradients([(g[cudist.get_replica_context().replica_id_in_sync_group], v)]))
    shared_once = [c.numpy() for c in v.values]
    np.testing.assert_array_equal(shared_once[0], shared_once[1])

    def diverge():
        if cudist.get_replica_context().replica_id_in_sync_group == 0:
            v.assign_add(np.ones_like(a))

    strategy.run(diverge)
    assert _storages(v) == 2
    strategy.run(lambda: opt.apply_gradients([(g[cudist.get_replica_context().replica_id_in_sync_group], v)]))
    r = cudist.Variable(a)
    ropt = optimizers.SGD(0.1, momentum=0.9) if opt_name == "momentum" else optimizers.Adam(0.01)
    ropt.apply_gradients([(g[0] + g[1], r)])
    r.assign(shared_once[0] + 1)
    ropt.apply_gradients([(g[0] + g[1], r)])
    for c in v.values:
        np.testing.assert_array_equal(c.numpy(), r.numpy())
    for slot in opt.variables:
        if isinstance(slot, cudist.MirroredVariable) and slot.shape == v.shape:
            assert _storages(slot) == 2


def test_restore_keeps_the_copies_sharing(tmp_path):
    strategy = make_strategy("mirrored3")
    a = _rand()
    with strategy.scope():
        v = cudist.Variable(a)
    ckpt = cudist.train.Checkpoint(v=v)
    path = ckpt.save(str(tmp_path / "c"))
    v.assign(np.zeros_like(a))
    ckpt.restore(path)
    assert _storages(v) == 1
    for c in v.values:
        np.testing.assert_array_equal(c.numpy(), a)
