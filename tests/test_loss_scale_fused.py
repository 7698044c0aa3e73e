"""LossScaleOptimizer's finiteness check fused into the all-reduce (issue #28, item 3).

The kernel ``reduce_unscale_finite(grads, scale, out)`` sums the per-replica gradients (replica
order, narrow gradients of a float32 ``out`` widened exactly), divides by the scale and reports
whether every element of ``out`` is finite, in the pass that reads the gradients. Every CPU backend
must give the NumPy reference's bits and decision; the optimizer then updates from the sums or skips
the whole step on every replica.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist import optimizers
from cudist._kernels import cpu_backend, get_backend

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs the optional ml_dtypes package")
BF16 = np.dtype(ml_dtypes.bfloat16)
BACKENDS = ["native", "numba", "numpy"]
#: (out dtype, gradient dtype): same-dtype reductions and the mixed-precision ones.
PAIRS = [
    (np.dtype(np.float32), np.dtype(np.float32)),
    (np.dtype(np.float64), np.dtype(np.float64)),
    (np.dtype(np.float16), np.dtype(np.float16)),
    (np.dtype(np.float32), BF16),
    (np.dtype(np.float32), np.dtype(np.float16)),
]
IDS = ["f32", "f64", "f16", "bf16->f32", "f16->f32"]


def _grads(gdt, m, size, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-2, 3, size)).astype(gdt) for _ in range(m)]


def _run(backend, grads, scale, odt):
    out = np.full(grads[0].shape, 7, odt)  # not zeros: every element must be written
    finite = get_backend(backend).trusted.reduce_unscale_finite(grads, scale, out)
    assert type(finite) is bool
    return out, finite


def _want(grads, scale, odt):
    """The definition: the gradients cast to out's dtype, summed in replica order in the compute
    type (float16: float32, rounded once), divided by the scale, rounded to out's dtype."""
    ct = np.float32 if odt == np.float16 else odt.type
    with np.errstate(all="ignore"):
        s = grads[0].astype(ct)
        for g in grads[1:]:
            s = s + g.astype(ct)
        if odt == np.float16:
            s = s.astype(np.float16).astype(np.float32)
        out = (s / ct(scale)).astype(odt)
    return out, bool(np.isfinite(out).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("odt,gdt", PAIRS, ids=IDS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 37, 4099, 300007])
def test_sum_and_flag_of_finite_gradients(backend, odt, gdt, m, size):
    """Finite gradients: the unscaled sum bit for bit as the definition, and True."""
    grads = _grads(gdt, m, size, seed=size + m)
    out, finite = _run(backend, grads, 1024.0, odt)
    want, want_finite = _want(grads, 1024.0, odt)
    assert want_finite and finite
    assert out.dtype == odt
    assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("odt,gdt", PAIRS, ids=IDS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["first", "last", "middle"])
@pytest.mark.parametrize("size", [1, 37, 300007])
def test_flag_of_one_non_finite_gradient(backend, odt, gdt, bad, where, size):
    """One inf, -inf or NaN in one replica's gradient, at the first, last or a middle element
    (odd sizes, one element, a size the threads split): False on every backend."""
    grads = _grads(gdt, 3, size, seed=size)
    i = {"first": 0, "last": size - 1, "middle": size // 2}[where]
    grads[1][i] = bad
    out, finite = _run(backend, grads, 4.0, odt)
    assert finite is False
    assert not np.isfinite(out[i])
    if size > 1:  # the rest is still the sum (the same pass wrote it)
        want, _ = _want(grads, 4.0, odt)
        mask = np.arange(size) != i
        assert out[mask].tobytes() == want[mask].tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("odt,gdt", PAIRS, ids=IDS)
def test_the_flag_form_keeps_the_verdict_in_a_flag(backend, odt, gdt):
    """``reduce_unscale_flag`` (the form a GPU backend serves without a read-back per variable):
    the same sums, the flag set by a non-finite one and kept through finite ones after it."""
    trusted = get_backend(backend).trusted
    flag = np.zeros(1, np.int32)
    for k, bad in enumerate((False, True, False)):
        grads = _grads(gdt, 3, 37, seed=k)
        if bad:
            grads[2][36] = np.nan
        out = np.full(37, 7, odt)
        assert trusted.reduce_unscale_flag(grads, 4.0, out, flag) is None
        want, finite = _want(grads, 4.0, odt)
        assert finite is not bad and flag[0] == (0 if k == 0 else 1)
        keep = np.arange(37) != 36
        assert out[keep].tobytes() == want[keep].tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["first", "last"])
def test_flag_of_a_sum_that_overflows(backend, where):
    """Finite gradients whose sum overflows to inf (float32; float16 in its own dtype; bfloat16
    widened to a float32 out) or that overflow when divided by a scale below 1: False."""
    size = 1001
    i = 0 if where == "first" else size - 1
    cases = [
        (np.float32, np.float32, 3e38, 1.0),
        (np.float16, np.float16, 40000.0, 1.0),
        (np.float32, BF16, 2e38, 1.0),
        (np.float32, np.float32, 1e38, 0.5),  # finite sum, inf once unscaled
    ]
    for odt, gdt, big, scale in cases:
        grads = _grads(np.dtype(gdt), 2, size, seed=1)
        grads[0][i] = big
        grads[1][i] = big
        assert np.isfinite(grads[0]).all() and np.isfinite(grads[1]).all()
        out, finite = _run(backend, grads, scale, np.dtype(odt))
        assert finite is False, (odt, gdt, scale)
        assert out[i] == np.inf
        out2, finite2 = _run(backend, [grads[0]], scale, np.dtype(odt))  # one replica: no overflow
        assert finite2 is True


def test_backends_agree_bit_for_bit_on_mixed_signs():
    """inf + -inf (NaN), NaNs of both signs, huge values: the three backends store the same
    finite elements and give the same decision."""
    rng = np.random.default_rng(11)
    size = 5003
    grads = [(rng.standard_normal(size) * 1e37).astype(np.float32) for _ in range(4)]
    grads[0][10], grads[1][10] = np.inf, -np.inf
    grads[2][20] = np.nan
    results = [_run(b, grads, 2.0, np.dtype(np.float32)) for b in BACKENDS]
    for out, finite in results:
        assert finite is False
        fin = np.isfinite(results[0][0])
        assert np.array_equal(np.isfinite(out), fin)
        assert out[fin].tobytes() == results[0][0][fin].tobytes()


def test_native_refuses_bad_arguments():
    native = get_backend("native").trusted
    g = [np.ones(5, np.float32)]
    with pytest.raises(TypeError, match="gradients have dtype float64 but the copies have dtype float32"):
        native.reduce_unscale_finite([np.ones(5)], 2.0, np.empty(5, np.float32))
    with pytest.raises(ValueError, match="elements"):
        native.reduce_unscale_finite(g, 2.0, np.empty(4, np.float32))
    buf = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="shares memory"):
        native.reduce_unscale_finite([buf[:5]], 2.0, buf[3:8])


# ------------------------------------------------------------------------ through the optimizer
def _train(steps, gdt, replicas=4, inner=lambda: optimizers.SGD(0.25, momentum=0.5), growth=2):
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    init = np.random.default_rng(3).standard_normal(101).astype(np.float32)
    with strategy.scope():
        w = cudist.Variable(init, name="w")
        opt = optimizers.LossScaleOptimizer(inner(), initial_scale=8.0, dynamic_growth_steps=growth)
    trace = []
    for grads in steps:
        def fn(grads=grads):
            r = cudist.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(grads[r].astype(gdt), w)])

        strategy.run(fn)
        trace.append((float(np.asarray(opt.dynamic_scale.read_value())), int(np.asarray(opt.iterations.read_value())),
                      np.asarray(w.read_value()).copy()))
    return trace


def _steps():
    rng = np.random.default_rng(4)
    steps = [[rng.standard_normal(101).astype(np.float32) * 8 for _ in range(4)] for _ in range(8)]
    steps[1][2][0] = np.inf  # replica 2 only, first element
    steps[3][0][100] = np.nan  # replica 0 only, last element
    steps[5][1][50] = 3e38  # finite everywhere, but the sum overflows
    steps[5][3][50] = 3e38
    return steps


@pytest.mark.parametrize("gdt", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_step_skips_and_scales_on_every_backend(each_cpu_backend, monkeypatch, gdt):
    """4 replicas, 8 steps, inf / NaN on one replica, a sum that overflows: the fused path runs,
    the skipped steps change nothing, the scale halves on them and doubles after 2 finite steps,
    and the trajectory is the one of the inner optimizer on the unscaled sums."""
    calls = []
    trusted = cpu_backend().trusted
    real = trusted.reduce_unscale_finite
    monkeypatch.setattr(trusted, "reduce_unscale_finite", lambda *a: (calls.append(1), real(*a))[1])
    steps = _steps()
    trace = _train(steps, gdt)
    assert calls  # the fused reduce ran (no per-replica sweep)
    scales = [t[0] for t in trace]
    iters = [t[1] for t in trace]
    assert scales == [8.0, 4.0, 4.0, 2.0, 2.0, 1.0, 1.0, 2.0]
    assert iters == [1, 1, 2, 2, 3, 3, 4, 5]
    for k in (1, 3, 5):  # skipped: the variable did not move
        assert trace[k][2].tobytes() == trace[k - 1][2].tobytes()
    # The reference: the inner optimizer alone on the unscaled sums of the finite steps.
    w = cudist.Variable(np.random.default_rng(3).standard_normal(101).astype(np.float32), name="w")
    inner = optimizers.SGD(0.25, momentum=0.5)
    scale = 8.0
    for k, grads in enumerate(steps):
        if k in (1, 3, 5):
            scale /= 2
            continue
        s = grads[0].astype(gdt).astype(np.float32)
        for g in grads[1:]:
            s = s + g.astype(gdt).astype(np.float32)
        inner.apply_gradients([(s / np.float32(scale), w)])
        assert np.asarray(w.read_value()).tobytes() == trace[k][2].tobytes(), k


def test_backends_agree_through_the_optimizer(select_cpu_backend):
    """The same run on native, numba and the NumPy reference: the same bits every step."""
    runs = []
    for name in BACKENDS:
        select_cpu_backend(name)
        runs.append(_train(_steps(), BF16, inner=lambda: optimizers.Adam(0.01)))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a[0] == b[0] and a[1] == b[1] and a[2].tobytes() == b[2].tobytes()


def test_clipping_inner_optimizer_keeps_the_per_replica_path(monkeypatch):
    """An inner optimizer that clips each replica's gradient (Keras: before the sum) is not fused:
    the per-replica check decides, as before."""
    calls = []
    trusted = cpu_backend().trusted
    monkeypatch.setattr(trusted, "reduce_unscale_finite", lambda *a: calls.append(1))
    trace = _train(_steps()[:3], np.float32, inner=lambda: optimizers.SGD(0.25, clipnorm=1.0))
    assert not calls
    assert [t[0] for t in trace] == [8.0, 4.0, 4.0]
    assert [t[1] for t in trace] == [1, 1, 2]
