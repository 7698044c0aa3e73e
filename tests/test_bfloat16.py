"""bfloat16 on the NumPy reference backend (issue #28): collectives through strategy.run.

The contract: a bfloat16 reduction accumulates in float32 in replica order and rounds once, so it
equals ``sum(float32(x_r) for r in replicas)`` rounded to bfloat16 (the mean divides that float32 sum).
"""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist._kernels import available_backends, get_backend

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs the optional ml_dtypes package")
BF16 = np.dtype(ml_dtypes.bfloat16)
REPLICAS = 4


def replica_values(size, seed=0):
    rng = np.random.default_rng(seed)
    # Mixed magnitudes, so rounding after every addition would differ from one rounding at the end.
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3, size)).astype(BF16) for _ in range(REPLICAS)]


def expected(values, op):
    s = values[0].astype(np.float32)
    for v in values[1:]:
        s = s + v.astype(np.float32)
    if op == "mean":
        s = s / np.float32(len(values))
    return s.astype(BF16)


@pytest.mark.parametrize("size", [1, 7, 1000, 4099])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_through_run_rounds_once(each_cpu_backend, size, op):
    values = replica_values(size, seed=size)
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    reduce_op = cudist.ReduceOp.SUM if op == "sum" else cudist.ReduceOp.MEAN

    def step():
        ctx = cudist.get_replica_context()
        return ctx.all_reduce(reduce_op, values[ctx.replica_id_in_sync_group])

    out = strategy.run(step)
    want = expected(values, op)
    for r, local in enumerate(strategy.experimental_local_results(out)):
        got = np.asarray(local)
        assert got.dtype == BF16, r
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # The test can fail: rounding after every addition gives other bits on this data.
    naive = values[0].copy()
    for v in values[1:]:
        naive = (naive.astype(np.float32) + v.astype(np.float32)).astype(BF16)
    if op == "sum" and size >= 1000:
        assert not np.array_equal(naive.view(np.uint16), want.view(np.uint16))


def test_strategy_reduce_and_gather(each_cpu_backend):
    values = replica_values(33, seed=3)
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])

    def step():
        return values[cudist.get_replica_context().replica_id_in_sync_group]

    per_replica = strategy.run(step)
    total = np.asarray(strategy.reduce(cudist.ReduceOp.SUM, per_replica, axis=None))
    np.testing.assert_array_equal(total.view(np.uint16), expected(values, "sum").view(np.uint16))
    gathered = np.asarray(strategy.gather(per_replica, axis=0))
    np.testing.assert_array_equal(gathered.view(np.uint16), np.concatenate(values).view(np.uint16))


def test_kernel_collectives():
    be = get_backend("numpy")
    values = replica_values(100, seed=5)
    bufs = [v.copy() for v in values]
    be.all_reduce(bufs, cudist.ReduceOp.SUM)
    for b in bufs:
        np.testing.assert_array_equal(b.view(np.uint16), expected(values, "sum").view(np.uint16))
    out = np.empty_like(values[0])
    be.reduce_to_one([v.copy() for v in values], cudist.ReduceOp.MEAN, out=out)
    np.testing.assert_array_equal(out.view(np.uint16), expected(values, "mean").view(np.uint16))
    dsts = [np.zeros_like(values[0]) for _ in range(3)]
    be.broadcast(values[1], dsts)
    for d in dsts:
        np.testing.assert_array_equal(d.view(np.uint16), values[1].view(np.uint16))


def test_backends_without_bfloat16_refuse_it_clearly():
    from cudist._kernels._numpy import NumpyBackend

    class NoBfloat16(NumpyBackend):
        name = "no-bf16"
        bfloat16 = False

    with pytest.raises(TypeError, match="does not support dtype bfloat16"):
        NoBfloat16().all_reduce([np.ones(4, BF16), np.ones(4, BF16)])


def test_every_cpu_backend_computes_bfloat16():
    for name in ("numpy", "native", "numba"):
        assert name in available_backends()
        assert get_backend(name).computes(BF16), name


def _train(make_opt, grads, steps=3):
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    with strategy.scope():
        w = cudist.Variable(np.linspace(-1, 1, grads[0].size, dtype=np.float32), name="w")
        opt = make_opt()

    def step():
        opt.apply_gradients([(grads[cudist.get_replica_context().replica_id_in_sync_group], w)])

    for _ in range(steps):
        strategy.run(step)
    return np.asarray(w.read_value()), opt


@pytest.mark.parametrize(
    "make_opt",
    [lambda: cudist.optimizers.SGD(0.01, momentum=0.9), lambda: cudist.optimizers.Adam(0.01)],
    ids=["sgd_momentum", "adam"],
)
def test_float32_variables_from_bfloat16_gradients(each_cpu_backend, make_opt):
    """Mixed precision: bfloat16 gradients update float32 variables and slots as their exact float32
    values do (bfloat16 -> float32 is exact), the sum over replicas in float32."""
    grads = replica_values(37, seed=11)
    w_bf16, opt = _train(make_opt, grads)
    w_f32, _ = _train(make_opt, [g.astype(np.float32) for g in grads])
    assert w_bf16.dtype == np.float32
    np.testing.assert_array_equal(w_bf16.view(np.uint32), w_f32.view(np.uint32))
    assert all(np.asarray(v.read_value()).dtype == np.float32 for v in opt.variables[1:])
    # The test can fail: the variable keeps float32 precision (a bfloat16 variable could not hold it).
    assert not np.array_equal(w_bf16, w_bf16.astype(BF16).astype(np.float32))
