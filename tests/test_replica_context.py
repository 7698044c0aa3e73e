"""ReplicaContext: all_reduce, all_gather, merge_call and the replica's identity."""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist import PerReplica

#: Every test twice: replicas on greenlets, then on replica threads.
pytestmark = pytest.mark.usefixtures("replica_execution")


def rid():
    return cudist.get_replica_context().replica_id_in_sync_group


def local(strategy, out):
    return strategy.experimental_local_results(out)


# ----------------------------------------------------------------------------- all_reduce
def test_all_reduce_docstring_examples():
    # ReplicaContext.all_reduce's examples: 1. -> 2. on both replicas; [1., 2.] -> [2., 4.].
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def step_fn():
        ctx = cudist.get_replica_context()
        return ctx.all_reduce(cudist.ReduceOp.SUM, np.float32(1.0))

    assert [float(x) for x in local(s, s.run(step_fn))] == [2.0, 2.0]

    def step_fn2():
        ctx = cudist.get_replica_context()
        return ctx.all_reduce(cudist.ReduceOp.SUM, [np.float32(1.0), np.float32(2.0)])

    assert [[float(a) for a in x] for x in local(s, s.run(step_fn2))] == [[2.0, 4.0], [2.0, 4.0]]


def test_all_reduce_of_replica_ids_via_distributed_values():
    # Strategy.run's example 3: all-reduce of the replica ids gives 1 on both of 2 replicas.
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    ids = PerReplica([np.int32(0), np.int32(1)])
    out = s.run(lambda x: cudist.get_replica_context().all_reduce("sum", x), args=(ids,))
    assert [int(v) for v in local(s, out)] == [1, 1]
    assert all(v.dtype == np.int32 for v in local(s, out))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "int8", "complex64"])
def test_all_reduce_matches_numpy_over_fixture(strategy, dtype):
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(7)
    shape = (5, 3)
    raw = [rng.standard_normal(shape) * (1 if dtype.startswith(("float", "complex")) else 20) for _ in range(n)]
    parts = [r.astype(dtype) for r in raw]
    originals = [p.copy() for p in parts]
    # Replica order; float16 accumulates in float32 and rounds once (the contract), the others round
    # to their dtype after each addition.
    acc_dtype = np.float32 if dtype == "float16" else dtype
    acc = parts[0].astype(acc_dtype)
    for p in parts[1:]:
        acc = (acc + p.astype(acc_dtype)).astype(acc_dtype)
    ref = acc.astype(dtype)
    for op in ("sum", "mean"):
        out = strategy.run(lambda x: cudist.get_replica_context().all_reduce(op, x), args=(PerReplica(parts),))
        res = local(strategy, out)
        assert len(res) == n
        if op == "sum":
            want = ref
        elif np.dtype(dtype).kind in "iu":
            # Integer MEAN is a true division, as TF's: float32 for 8/16-bit ints, else float64.
            want = np.true_divide(ref, n, dtype=np.float32 if ref.dtype.itemsize <= 2 else np.float64)
        else:
            want = (acc / np.dtype(acc_dtype).type(n)).astype(dtype)
        for r in res:
            assert r.dtype == want.dtype and r.shape == shape
            np.testing.assert_array_equal(r, want)
        if n > 1:
            assert all(res[i] is not res[0] for i in range(1, n))  # each replica owns its result
    for p, o in zip(parts, originals):
        np.testing.assert_array_equal(p, o)  # inputs are never written


def test_all_reduce_nested_structure(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        i = rid()
        value = {
            "a": 1.0,
            "b": (np.arange(3, dtype=np.int32) * (i + 1), None),
            "c": [np.full((2, 2), i, np.float32), np.float64(i)],
        }
        return cudist.get_replica_context().all_reduce("sum", value)

    for r in local(strategy, strategy.run(fn)):
        assert set(r) == {"a", "b", "c"}
        assert r["a"] == n and isinstance(r["a"], np.floating)
        assert r["b"][1] is None
        np.testing.assert_array_equal(r["b"][0], np.arange(3) * sum(range(1, n + 1)))
        assert r["b"][0].dtype == np.int32
        np.testing.assert_array_equal(r["c"][0], np.full((2, 2), sum(range(n)), np.float32))
        assert r["c"][1] == sum(range(n))


def test_all_reduce_int_mean_is_float64():
    # TF 2.21: all_reduce("mean", int32 3 + replica_id) on 2 replicas -> 3.5 (float64).
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = s.run(lambda: cudist.get_replica_context().all_reduce("mean", np.int32(3) + np.int32(rid())))
    for v in local(s, out):
        assert v == 3.5 and v.dtype == np.float64


def test_all_reduce_bad_inputs():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(ValueError, match="unknown reduce op 'max'"):
        s.run(lambda: cudist.get_replica_context().all_reduce("max", 1.0))
    with pytest.raises(TypeError, match="cannot reduce values of dtype <U"):
        s.run(lambda: cudist.get_replica_context().all_reduce("sum", "text"))
    with pytest.raises(TypeError, match="dtype bool"):
        s.run(lambda: cudist.get_replica_context().all_reduce("sum", np.array([True])))
    assert s.run(lambda: 1) == 1  # the strategy still works afterwards


def test_collectives_outside_run_raise(strategy):
    holder = []
    strategy.run(lambda: holder.append(cudist.get_replica_context()))
    ctx = holder[0]
    with pytest.raises(RuntimeError, match="must be called inside strategy.run"):
        ctx.all_reduce("sum", 1.0)
    with pytest.raises(RuntimeError, match="must be called inside strategy.run"):
        ctx.merge_call(lambda s: None)
    with strategy.scope():
        with pytest.raises(RuntimeError, match="must be called inside strategy.run"):
            ctx.all_gather(np.ones(2), axis=0)


# ----------------------------------------------------------------------------- all_gather
def test_all_gather_replica_order_and_partial_sizes(strategy):
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(11)
    parts = [rng.standard_normal((i % 3, 4)).astype(np.float32) for i in range(n)]
    out = strategy.run(lambda x: cudist.get_replica_context().all_gather(x, axis=0), args=(PerReplica(parts),))
    want = np.concatenate(parts)
    res = local(strategy, out)
    for r in res:
        np.testing.assert_array_equal(r, want)
    if n > 1:
        assert isinstance(out, PerReplica)
        assert res[0] is not res[1]


def test_all_gather_nested_and_negative_axis():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        i = rid()
        v = {"x": np.full((2, i + 1), i, np.int64), "y": (np.array([float(i)]),)}
        return cudist.get_replica_context().all_gather(v, axis=-1)

    for r in local(s, s.run(fn)):
        np.testing.assert_array_equal(r["x"], [[0, 1, 1], [0, 1, 1]])
        np.testing.assert_array_equal(r["y"][0], [0.0, 1.0])


def test_all_gather_errors():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(ValueError, match="outside the gather axis"):
        s.run(lambda: cudist.get_replica_context().all_gather(np.ones((2, rid() + 1)), axis=0))
    with pytest.raises(ValueError, match="replica 1 has dtype float32"):
        s.run(lambda: cudist.get_replica_context().all_gather(np.ones(2, [np.float64, np.float32][rid()]), axis=0))
    with pytest.raises(ValueError, match="out of range"):
        s.run(lambda: cudist.get_replica_context().all_gather(np.ones(2), axis=1))
    with pytest.raises(TypeError, match="axis must be an int"):
        s.run(lambda: cudist.get_replica_context().all_gather(np.ones(2), axis=None))


# ----------------------------------------------------------------------------- merge_call
def test_merge_call_runs_once_cross_replica(strategy):
    n = strategy.num_replicas_in_sync
    calls = []

    def merge_fn(s, value, *, scale):
        calls.append((s, cudist.in_cross_replica_context(), cudist.get_replica_context()))
        vals = strategy.experimental_local_results(value)
        assert vals == tuple(range(n))
        return strategy.reduce("sum", value, axis=None) * scale if n > 1 else value * scale

    def fn():
        i = rid()
        out = cudist.get_replica_context().merge_call(merge_fn, args=(i,), kwargs={"scale": 10})
        assert cudist.get_replica_context().replica_id_in_sync_group == i  # back in replica context
        return out

    out = strategy.run(fn)
    assert len(calls) == 1
    assert calls[0] == (strategy, True, None)
    assert out == 10 * sum(range(n))


def test_merge_call_per_replica_result_is_selected():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])

    def merge_fn(strategy, v):
        assert isinstance(v, PerReplica)
        return PerReplica([x * 100 for x in v.values])

    out = s.run(lambda: cudist.get_replica_context().merge_call(merge_fn, args=(rid() + 1,)))
    assert local(s, out) == (100, 200, 300)
    # TF's example: merge_call with the replica ids returns each replica's own id.
    out = s.run(lambda: cudist.get_replica_context().merge_call(lambda st, v: v, args=(rid(),)))
    assert local(s, out) == (0, 1, 2)


def test_merge_call_same_argument_stays_unwrapped():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    seen = []
    s.run(lambda: cudist.get_replica_context().merge_call(lambda st, v: seen.append(v), args=(3,)))
    assert seen == [3]


def test_merge_call_bad_arguments():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(TypeError, match="merge_fn must be callable"):
        s.run(lambda: cudist.get_replica_context().merge_call(5))
    with pytest.raises(ValueError, match="args must be a list or tuple"):
        s.run(lambda: cudist.get_replica_context().merge_call(lambda st, v: v, args=3))


def test_replica_context_properties(strategy):
    def fn():
        ctx = cudist.get_replica_context()
        return ctx.devices, ctx.strategy is strategy, ctx.num_replicas_in_sync

    res = local(strategy, strategy.run(fn))
    for i, (devices, same, n) in enumerate(res):
        assert devices == (strategy.extended.worker_devices[i],)
        assert same and n == strategy.num_replicas_in_sync
