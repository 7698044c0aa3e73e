"""CentralStorageStrategy with GPU compute devices and the variables in host memory (TF's default
with several GPUs): replicas read CuPy copies on their GPUs, updates land on the host.

Needs CuPy and a GPU (marker ``gpu``), or the fake CuPy of tests/emu.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import gpu0_split

import cudist
from cudist.optimizers import SGD, Adam

pytestmark = pytest.mark.gpu
CPU0 = "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.fixture(params=[2, 3], ids=["2logical", "3logical"])
def strategy(request):
    """CentralStorageStrategy over ``n`` logical GPUs of physical GPU 0, parameters on the CPU."""
    n = request.param
    with gpu0_split(n):
        yield cudist.CentralStorageStrategy([f"/gpu:{i}" for i in range(n)])


def test_defaults_place_variables_on_the_cpu(strategy):
    assert strategy.extended.parameter_devices == (CPU0,)
    assert type(strategy.extended._cross_device_ops) is cudist.ReductionToOneDevice  # as TF
    with strategy.scope():
        v = cudist.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert isinstance(v, cudist.Variable) and v.device == CPU0
    assert type(v.storage.array) is np.ndarray
    np.testing.assert_array_equal(v.numpy(), np.arange(6).reshape(2, 3))
    assert type(v.value()) is np.ndarray  # cross-replica reads stay on the parameter device


def test_replica_reads_are_cupy_copies_on_the_replica_gpu(strategy):
    import cupy

    init = np.random.default_rng(0).standard_normal((4,)).astype(np.float32)
    with strategy.scope():
        v = cudist.Variable(init)

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        x = cupy.full((4,), r + 1, dtype=np.float32)
        outs = {"value": v.value(), "read": v.read_value(), "mul": v * x, "add": v + 1.0, "ufunc": np.multiply(v, x)}
        live = v._read_live()
        return outs, live, v.numpy(), np.asarray(v)

    outs, live, as_np, arr = strategy.run(step)
    n = strategy.num_replicas_in_sync
    for r in range(n):
        got = {k: strategy.experimental_local_results(o)[r] for k, o in outs.items()}
        for k, a in got.items():
            assert isinstance(a, cupy.ndarray) and a.device.id == 0, k
        np.testing.assert_array_equal(cupy.asnumpy(got["value"]), init)
        np.testing.assert_array_equal(cupy.asnumpy(got["read"]), init)
        np.testing.assert_array_equal(cupy.asnumpy(got["mul"]), init * (r + 1))
        np.testing.assert_array_equal(cupy.asnumpy(got["add"]), init + 1)
        np.testing.assert_array_equal(cupy.asnumpy(got["ufunc"]), init * (r + 1))
        assert type(strategy.experimental_local_results(as_np)[r]) is np.ndarray
        assert type(strategy.experimental_local_results(arr)[r]) is np.ndarray
    # Reads are copies: writing what a replica got leaves the variable unchanged.
    strategy.experimental_local_results(outs["value"])[0].fill(0)
    np.testing.assert_array_equal(v.numpy(), init)


@pytest.mark.parametrize(
    "aggregation", [cudist.VariableAggregation.SUM, cudist.VariableAggregation.MEAN, cudist.VariableAggregation.ONLY_FIRST_REPLICA]
)
def test_replica_updates_aggregate_onto_the_host(strategy, aggregation):
    import cupy

    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(1)
    init = rng.standard_normal((3, 2)).astype(np.float32)
    deltas = [rng.standard_normal((3, 2)).astype(np.float32) for _ in range(n)]
    with strategy.scope():
        v = cudist.Variable(init, aggregation=aggregation)

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        v.assign_add(cupy.asarray(deltas[r]))

    strategy.run(step)
    if aggregation is cudist.VariableAggregation.SUM:
        want = init + (deltas[0] + deltas[1] + (deltas[2] if n > 2 else 0))
    elif aggregation is cudist.VariableAggregation.MEAN:
        s = deltas[0].copy()
        for d in deltas[1:]:
            s = s + d
        want = init + s / np.float32(n)
    else:
        want = init + deltas[0]
    assert type(v.storage.array) is np.ndarray
    np.testing.assert_allclose(v.numpy(), want, rtol=1e-6)
    # Cross-replica assigns of GPU values land on the host too.
    v.assign(cupy.asarray(init * 2))
    assert type(v.storage.array) is np.ndarray
    np.testing.assert_array_equal(v.numpy(), init * 2)


def test_reduce_of_gpu_values_to_the_parameter_device(strategy):
    import cupy

    n = strategy.num_replicas_in_sync
    parts = [np.random.default_rng(10 + r).standard_normal((5,)).astype(np.float32) for r in range(n)]

    def step():
        return cupy.asarray(parts[cudist.get_replica_context().replica_id_in_sync_group])

    per_replica = strategy.run(step)
    red = strategy.extended.reduce_to("sum", per_replica, CPU0)
    assert type(red) is np.ndarray
    want = parts[0].copy()
    for p in parts[1:]:
        want = want + p
    np.testing.assert_array_equal(red, want)
    np.testing.assert_array_equal(strategy.reduce("sum", per_replica), want)


def _linear_data(seed, steps, batch, features):
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal((features, 1)).astype(np.float32)
    xs = [rng.standard_normal((batch, features)).astype(np.float32) for _ in range(steps)]
    ys = [(x @ w_true + 0.1 * rng.standard_normal((batch, 1))).astype(np.float32) for x in xs]
    return list(zip(xs, ys))


def _train(strategy, data, make_opt, global_batch):
    """A linear model trained by a custom loop; returns the final weights and bias on the host."""
    with strategy.scope():
        w = cudist.Variable(np.full((data[0][0].shape[1], 1), 0.25, np.float32), name="w")
        b = cudist.Variable(np.zeros((1,), np.float32), name="b")
        opt = make_opt()

    def step(batch):
        x, y = batch
        xp = cudist._arrays.array_module(x)
        err = x @ w.value() + b.value() - y  # per-replica: MSE over the global batch
        scale = np.float32(2.0 / global_batch)
        gw = (x.T @ err) * scale
        gb = xp.sum(err, axis=0) * scale
        opt.apply_gradients([(gw, w), (gb, b)])

    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(batch,))
    return w.numpy(), b.numpy()


@pytest.mark.parametrize("make_opt", [lambda: SGD(0.1), lambda: SGD(0.05, momentum=0.9), lambda: Adam(0.05)], ids=["sgd", "momentum", "adam"])
def test_training_matches_mirrored_on_cpus(strategy, make_opt):
    n = strategy.num_replicas_in_sync
    data = _linear_data(3, 12, 13, 4)  # 13 rows: uneven per-replica batches
    w_gpu, b_gpu = _train(strategy, data, make_opt, 13)
    cpu = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    w_cpu, b_cpu = _train(cpu, data, make_opt, 13)
    assert not np.allclose(w_gpu, 0.25)  # it trained
    np.testing.assert_allclose(w_gpu, w_cpu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b_gpu, b_cpu, rtol=1e-5, atol=1e-6)


@pytest.mark.multi_gpu
def test_physical_gpus_read_on_their_own_gpu():
    import cupy

    count = min(cupy.cuda.runtime.getDeviceCount(), 4)
    strategy = cudist.CentralStorageStrategy([f"/gpu:{i}" for i in range(count)])
    with strategy.scope():
        v = cudist.Variable(np.arange(4, dtype=np.float32), aggregation=cudist.VariableAggregation.SUM)

    def step():
        val = v.value()
        v.assign_add(val * 2)
        return val, cupy.cuda.runtime.getDevice()

    vals, devs = strategy.run(step)
    assert list(strategy.experimental_local_results(devs)) == list(range(count))
    for r, a in enumerate(strategy.experimental_local_results(vals)):
        assert a.device.id == r
        np.testing.assert_array_equal(cupy.asnumpy(a), np.arange(4))
    np.testing.assert_array_equal(v.numpy(), np.arange(4) * (1 + 2 * count))
    assert type(v.storage.array) is np.ndarray
