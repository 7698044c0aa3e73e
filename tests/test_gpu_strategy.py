"""Strategies on GPUs: the common strategy cases on 2 and 4 logical GPUs split from physical GPU 0,
and over several physical GPUs (``multi_gpu``), checked against NumPy.

Needs CuPy and a GPU (marker ``gpu``; skipped otherwise). The GPU-free parts of the device logic
(parsing, the default op's choice, error messages) are in ``test_cross_device_ops.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import gpu0_split

import cudist
from cudist import PerReplica
from cudist._kernels._numpy import reference_reduce
from cudist._kernels._split import split_sizes
from cudist._reduce_util import ReduceOp

pytestmark = pytest.mark.gpu
GPU = "/job:localhost/replica:0/task:0/device:GPU:{}"


def ref_sum(parts):
    """The contract's SUM in replica order (float16 accumulated in float32, rounded once)."""
    return reference_reduce([np.asarray(p) for p in parts], ReduceOp.SUM)


@pytest.fixture(params=[2, 4], ids=["2logical", "4logical"])
def strategy(request):
    """MirroredStrategy over ``n`` logical GPUs, all on physical GPU 0."""
    n = request.param
    with gpu0_split(n, memory_limit=1024):
        yield cudist.MirroredStrategy([f"/gpu:{i}" for i in range(n)])


def _rng_parts(n, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 20).astype(dtype) for _ in range(n)]


def test_defaults_on_logical_gpus(strategy):
    n = strategy.num_replicas_in_sync
    assert strategy.extended.worker_devices == tuple(GPU.format(i) for i in range(n))
    ops = strategy.extended._cross_device_ops
    assert type(ops) is cudist.P2PAllReduce
    assert f"default for {n} logical GPUs on 1 physical GPU" in repr(ops)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
def test_run_all_reduce_sum_mean(strategy, dtype):
    import cupy

    n = strategy.num_replicas_in_sync
    parts = _rng_parts(n, (37,), dtype, 1)

    def step():
        ctx = cudist.get_replica_context()
        x = cupy.asarray(parts[ctx.replica_id_in_sync_group])
        return ctx.all_reduce("sum", x), ctx.all_reduce(cudist.ReduceOp.MEAN, {"a": x, "b": [x * 2, 3.0]})

    sums, means = strategy.run(step)
    want_sum = ref_sum(parts)
    tol = dict(rtol=2e-3, atol=1e-2) if dtype == np.float16 else dict(rtol=1e-6)
    for r, (s, m) in enumerate(zip(strategy.experimental_local_results(sums), strategy.experimental_local_results(means))):
        assert isinstance(s, cupy.ndarray) and s.device.id == 0 and s.dtype == dtype
        np.testing.assert_allclose(cupy.asnumpy(s), want_sum, **tol)
        a = cupy.asnumpy(m["a"])
        if np.dtype(dtype).kind == "i":  # integer MEAN is a true division, as in TF
            assert a.dtype == np.float64
            np.testing.assert_allclose(a, want_sum / n)
        else:
            np.testing.assert_allclose(a, (want_sum / dtype(n)).astype(dtype), **tol)
        np.testing.assert_allclose(cupy.asnumpy(m["b"][0]).astype(np.float64), 2 * a.astype(np.float64), **tol)
        assert float(m["b"][1]) == 3.0  # a host number stays a host number


def test_all_gather_partial_batches(strategy):
    import cupy

    n = strategy.num_replicas_in_sync
    sizes = split_sizes(2 * n + 1, n)
    rng = np.random.default_rng(2)
    parts = [rng.standard_normal((k, 3)).astype(np.float32) for k in sizes]

    def step():
        ctx = cudist.get_replica_context()
        x = cupy.asarray(parts[ctx.replica_id_in_sync_group])
        return ctx.all_gather(x, axis=0), ctx.all_gather(x.T, axis=-1)

    rows, cols = strategy.run(step)
    want = np.concatenate(parts, axis=0)
    for g, c in zip(strategy.experimental_local_results(rows), strategy.experimental_local_results(cols)):
        assert isinstance(g, cupy.ndarray) and g.device.id == 0
        np.testing.assert_array_equal(cupy.asnumpy(g), want)
        np.testing.assert_array_equal(cupy.asnumpy(c), want.T)
    gathered = strategy.gather(rows, axis=0)
    assert isinstance(gathered, np.ndarray) and gathered.shape == (n * want.shape[0], 3)


def test_merge_call_and_reduce_return_host_arrays(strategy):
    import cupy

    n = strategy.num_replicas_in_sync
    parts = _rng_parts(n, (5, 4), np.float32, 3)

    def merge(s, v):
        assert isinstance(v, PerReplica) and all(isinstance(c, cupy.ndarray) for c in v.values)
        return s.reduce("sum", v, axis=None)

    def step():
        ctx = cudist.get_replica_context()
        x = cupy.asarray(parts[ctx.replica_id_in_sync_group])
        return ctx.merge_call(merge, args=(x,)), x

    merged, xs = strategy.run(step)
    np.testing.assert_allclose(merged, ref_sum(parts), rtol=1e-6)
    assert isinstance(merged, np.ndarray)
    total = strategy.reduce("sum", xs, axis=None)
    assert isinstance(total, np.ndarray)
    np.testing.assert_allclose(total, ref_sum(parts), rtol=1e-6)
    mean0 = strategy.reduce("mean", xs, axis=0)
    assert isinstance(mean0, np.ndarray)
    np.testing.assert_allclose(mean0, np.concatenate(parts).mean(axis=0), rtol=1e-5)
    one = strategy.extended.reduce_to("mean", xs, "/gpu:1")
    assert isinstance(one, cupy.ndarray) and one.device.id == 0
    np.testing.assert_allclose(cupy.asnumpy(one), ref_sum(parts) / n, rtol=1e-6)
    mirrored = strategy.extended.reduce_to("sum", xs, [f"/gpu:{i}" for i in range(n)])
    assert len(mirrored.values) == n and len({id(v) for v in mirrored.values}) == n
    for m in mirrored.values:
        assert isinstance(m, cupy.ndarray) and m.device.id == 0
        np.testing.assert_allclose(cupy.asnumpy(m), ref_sum(parts), rtol=1e-6)


def test_mirrored_variables_live_on_their_devices_and_update_fused(strategy, monkeypatch):
    import cupy

    from cudist._kernels import get_backend

    n = strategy.num_replicas_in_sync
    init = np.linspace(-1, 1, 11).astype(np.float32)
    with strategy.scope():
        v = cudist.Variable(init, aggregation=cudist.VariableAggregation.MEAN)
    assert isinstance(v, cudist.MirroredVariable)
    for i, c in enumerate(v.values):
        assert c.device == GPU.format(i)
        assert isinstance(c.value(), cupy.ndarray) and c.value().device.id == 0
    backend = get_backend("cupy")
    calls = []
    real = backend.assign_add

    def spy(copies, value):
        calls.append(len(copies))
        return real(copies, value)

    monkeypatch.setattr(backend, "assign_add", spy)
    v.assign_add(np.full(11, 0.5, np.float32))
    assert calls == [n]  # one fused pass over all n copies
    for c in v.values:
        np.testing.assert_allclose(cupy.asnumpy(c.value()), init + 0.5, rtol=1e-6)

    grads = _rng_parts(n, (11,), np.float32, 4)

    def step():
        ctx = cudist.get_replica_context()
        v.assign_sub(cupy.asarray(grads[ctx.replica_id_in_sync_group]))

    strategy.run(step)
    want = init + 0.5 - ref_sum(grads) / np.float32(n)
    for c in v.values:
        np.testing.assert_allclose(cupy.asnumpy(c.value()), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v.numpy(), want, rtol=1e-5, atol=1e-6)


def test_distribute_dataset_delivers_device_arrays(strategy):
    import cupy

    n = strategy.num_replicas_in_sync
    data = np.arange(30, dtype=np.float32).reshape(10, 3)
    ds = cudist.data.Dataset.from_tensor_slices((data, np.arange(10, dtype=np.int64))).batch(5)
    steps = list(strategy.experimental_distribute_dataset(ds))
    assert len(steps) == 2
    for b, (x, y) in enumerate(steps):
        xs, ys = strategy.experimental_local_results(x), strategy.experimental_local_results(y)
        assert [a.shape[0] for a in xs] == split_sizes(5, n)
        start = 5 * b
        for xr, yr in zip(xs, ys):
            assert isinstance(xr, cupy.ndarray) and xr.device.id == 0 and isinstance(yr, cupy.ndarray)
            k = xr.shape[0]
            np.testing.assert_array_equal(cupy.asnumpy(xr), data[start : start + k])
            np.testing.assert_array_equal(cupy.asnumpy(yr), np.arange(start, start + k))
            start += k


def test_nccl_on_logical_gpus_falls_back_to_p2p(strategy):
    import cupy

    n = strategy.num_replicas_in_sync
    ops = cudist.NcclAllReduce()
    with pytest.warns(UserWarning, match="cannot share an NCCL communicator"):
        s = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(n)], cross_device_ops=ops)
    assert "falls back to P2P" in repr(ops)
    parts = _rng_parts(n, (1001,), np.float32, 5)
    out = s.run(lambda: cudist.get_replica_context().all_reduce("mean", cupy.asarray(parts[cudist.get_replica_context().replica_id_in_sync_group])))
    for o in s.experimental_local_results(out):
        np.testing.assert_allclose(cupy.asnumpy(o), ref_sum(parts) / np.float32(n), rtol=1e-6)


def test_one_device_strategy_on_a_logical_gpu(strategy):
    import cupy

    n = strategy.num_replicas_in_sync
    s = cudist.OneDeviceStrategy(f"/gpu:{n - 1}")
    with s.scope():
        v = cudist.Variable(np.ones(3, np.float32))
    assert v.device == GPU.format(n - 1) and isinstance(v.value(), cupy.ndarray)
    out = s.run(lambda: cudist.get_replica_context().all_reduce("sum", cupy.arange(3, dtype=cupy.float32)))
    np.testing.assert_array_equal(cupy.asnumpy(out), [0, 1, 2])


# ---------------------------------------------------------------------------------------------- several physical GPUs
def _nccl_or_skip():
    from cudist._dataplane.transports.nccl import load as _nccl_module

    nccl, why = _nccl_module()
    if nccl is None:
        pytest.skip(why)
    return nccl


@pytest.mark.multi_gpu
@pytest.mark.parametrize("make_ops", [None, cudist.P2PAllReduce, cudist.NcclAllReduce], ids=["default", "p2p", "nccl"])
@pytest.mark.parametrize("count", [1001, (8 << 20) // 4 + 7], ids=["small", "large"])
def test_physical_gpus_all_reduce_matches_numpy(make_ops, count):
    import cupy

    from cudist._cross_device_ops import AutoGpuAllReduce

    if make_ops is not cudist.P2PAllReduce:
        _nccl_or_skip()
    k = min(cupy.cuda.runtime.getDeviceCount(), 4)
    s = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(k)], cross_device_ops=None if make_ops is None else make_ops())
    if make_ops is None:
        assert type(s.extended._cross_device_ops) is AutoGpuAllReduce
        assert f"default for {k} GPUs" in repr(s.extended._cross_device_ops)
    parts = _rng_parts(k, (count,), np.float32, 6)

    def step():
        ctx = cudist.get_replica_context()
        x = cupy.asarray(parts[ctx.replica_id_in_sync_group])
        assert x.device.id == ctx.replica_id_in_sync_group  # the replica's GPU is current
        return ctx.all_reduce("sum", x), ctx.all_reduce("mean", [x, x.astype(cupy.int32)])

    sums, means = s.run(step)
    want = ref_sum(parts)
    for r, (a, m) in enumerate(zip(s.experimental_local_results(sums), s.experimental_local_results(means))):
        assert a.device.id == r and m[0].device.id == r
        np.testing.assert_allclose(cupy.asnumpy(a), want, rtol=1e-5, atol=1e-4)  # NCCL sums in its own order
        np.testing.assert_allclose(cupy.asnumpy(m[0]), want / np.float32(k), rtol=1e-5, atol=1e-4)
        ints = [p.astype(np.int32) for p in parts]
        np.testing.assert_allclose(cupy.asnumpy(m[1]), ref_sum(ints) / k)


@pytest.mark.multi_gpu
def test_physical_gpus_variables_and_input():
    import cupy

    k = min(cupy.cuda.runtime.getDeviceCount(), 4)
    s = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(k)])
    with s.scope():
        v = cudist.Variable(np.zeros(7, np.float32), aggregation=cudist.VariableAggregation.SUM)
    assert [c.value().device.id for c in v.values] == list(range(k))
    grads = _rng_parts(k, (7,), np.float32, 7)
    s.run(lambda: v.assign_add(cupy.asarray(grads[cudist.get_replica_context().replica_id_in_sync_group])))
    for c in v.values:
        np.testing.assert_allclose(cupy.asnumpy(c.value()), ref_sum(grads), rtol=1e-6)
    ds = cudist.data.Dataset.from_tensor_slices(np.arange(12, dtype=np.float32)).batch(6)
    for step in s.experimental_distribute_dataset(ds):
        for r, x in enumerate(s.experimental_local_results(step)):
            assert x.device.id == r and x.shape[0] == split_sizes(6, k)[r]
