"""Mixed precision inside the fused all-reduce + update (issue #28, item 2): float32 variables take
bfloat16 or float16 gradients straight into the fused pass, which widens them while it sums (no
float32 copy of the gradients), on the backends with ``mixed_gradients``.

The contract: the same bits as casting each replica's gradient to float32 first, then the float32
fused update (bfloat16/float16 -> float32 is exact; the sum is in float32 in replica order either way),
which is what the NumPy reference does.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist._kernels import UPDATE_KERNELS, cpu_backend, get_backend

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs the optional ml_dtypes package")
BF16 = np.dtype(ml_dtypes.bfloat16)
NARROW = [BF16, np.dtype(np.float16)]

#: Hyper-parameters by name for every row of the table (decay non-zero: its path is exercised too).
HYPER = {
    "lr": 0.01, "lr_t": 0.003, "momentum": 0.9, "beta_1": 0.9, "beta_2": 0.999,
    "epsilon": 1e-7, "decay": 0.004, "rho": 0.9, "c_m": 0.11, "c_g": 0.3, "c_v": 0.05,
}


def _grads(dtype, m, size, seed):
    rng = np.random.default_rng(seed)
    # Mixed magnitudes: a sum rounded to the narrow type (or added in it) would differ.
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3, size)).astype(dtype) for _ in range(m)]


def _state(name, n, size, seed):
    rng = np.random.default_rng(seed)
    slots = UPDATE_KERNELS[name][0]
    w = rng.standard_normal(size).astype(np.float32)
    # Positive slot values: v / v_hat / accumulators / RMSprop velocities are under a sqrt.
    # The centered RMSprop's average gradient small, so v - a * a stays positive.
    s = [
        (np.abs(rng.standard_normal(size)) * (0.01 if slot == "average_gradient" else 1.0) + (slot != "average_gradient"))
        .astype(np.float32)
        for slot in slots
    ]
    return [w.copy() for _ in range(n)], [[x.copy() for _ in range(n)] for x in s]


@pytest.mark.parametrize("backend", ["native", "numba"])
@pytest.mark.parametrize("name", sorted(UPDATE_KERNELS))
@pytest.mark.parametrize("dtype", NARROW, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 37, 20011])
def test_fused_kernels_take_narrow_gradients(backend, name, dtype, m, size):
    """Every fused kernel of the table on the native and Numba backends: narrow gradients for
    float32 copies equal the NumPy reference's update from the gradients cast to float32, bit for
    bit (20011 elements: several of Numba's blocks, split over its threads)."""
    native = get_backend(backend)
    assert native.mixed_gradients
    ref = get_backend("numpy")
    hyper = [HYPER[h] for h in UPDATE_KERNELS[name][1]]
    grads = _grads(dtype, m, size, seed=size + m)
    if size > 1:  # a NaN and an inf among the gradients: the widened sums carry them as the cast ones
        grads[0][size // 3] = np.nan
        grads[-1][size // 2] = -np.inf
    n = 2  # two mirrored copies: every one is written
    got_w, got_s = _state(name, n, size, seed=size)
    want_w, want_s = _state(name, n, size, seed=size)
    getattr(native.trusted, f"all_reduce_{name}")(got_w, *got_s, grads, *hyper)
    with np.errstate(all="ignore"):  # (the NaN and the inf: the reference's NumPy warnings)
        getattr(ref.trusted, f"all_reduce_{name}")(want_w, *want_s, [g.astype(np.float32) for g in grads], *hyper)
    for got, want in zip([got_w, *got_s], [want_w, *want_s]):
        for g, w in zip(got, want):
            assert g.dtype == np.float32
            np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_fused_kernels_refuse_other_gradient_dtypes():
    """Only float32 copies take narrow gradients, and only bfloat16 / float16 ones; anything else
    is a TypeError naming both dtypes."""
    trusted = get_backend("native")
    w64 = [np.zeros(5)]
    with pytest.raises(TypeError, match="gradients have dtype bfloat16 but the copies have dtype float64"):
        trusted.all_reduce_sgd(w64, [np.zeros(5, BF16)], lr=0.1)
    with pytest.raises(TypeError, match="gradients have dtype float64 but the copies have dtype float32"):
        trusted.all_reduce_sgd([np.zeros(5, np.float32)], [np.zeros(5)], lr=0.1)
    w16 = [np.zeros(5, np.float16)]
    with pytest.raises(TypeError, match="gradients have dtype bfloat16 but the copies have dtype float16"):
        trusted.all_reduce_sgd(w16, [np.zeros(5, BF16)], lr=0.1)


def test_gradient_overlapping_a_copy_is_read_before_the_write():
    """A narrow gradient whose bytes lie inside a float32 copy it updates is read as it was before
    the pass (snapshot), as for same-type gradients."""
    native = get_backend("native").trusted
    rng = np.random.default_rng(3)
    buf = rng.standard_normal(1000).astype(np.float32)
    g = buf.view(np.float16)[:1000]  # the first half of the copy's bytes
    g[:] = rng.standard_normal(1000).astype(np.float16)
    want = buf.copy() - np.float32(0.5) * g.astype(np.float32)
    native.all_reduce_sgd([buf], [g], lr=0.5, decay=0.0)
    np.testing.assert_array_equal(buf.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------------ through apply_gradients
OPTIMIZERS = {
    "sgd": lambda: cudist.optimizers.SGD(0.01),
    "sgd_wd": lambda: cudist.optimizers.SGD(0.01, weight_decay=0.01),
    "momentum": lambda: cudist.optimizers.SGD(0.01, momentum=0.9),
    "nesterov": lambda: cudist.optimizers.SGD(0.01, momentum=0.9, nesterov=True),
    "adam": lambda: cudist.optimizers.Adam(0.01),
    "adamw": lambda: cudist.optimizers.AdamW(0.01),
    "amsgrad": lambda: cudist.optimizers.Adam(0.01, amsgrad=True),
    "rmsprop": lambda: cudist.optimizers.RMSprop(0.01),
    "rmsprop_centered_momentum": lambda: cudist.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: cudist.optimizers.Adagrad(0.01),
    "adamax": lambda: cudist.optimizers.Adamax(0.01),
    "nadam": lambda: cudist.optimizers.Nadam(0.01),
    "lion": lambda: cudist.optimizers.Lion(0.001),
}


@pytest.fixture(params=["native", "numba"])
def backend_named(request, select_cpu_backend):
    select_cpu_backend(request.param)
    return request.param


def _train(make_opt, init, steps_grads, replicas):
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        w = cudist.Variable(init, name="w")
        opt = make_opt()
    for grads in steps_grads:
        def step(grads=grads):
            opt.apply_gradients([(grads[cudist.get_replica_context().replica_id_in_sync_group], w)])

        strategy.run(step)
    return np.asarray(w.read_value()), [np.asarray(v.read_value()) for v in opt.variables[1:]]


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", NARROW, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_apply_gradients_with_narrow_gradients(backend_named, select_cpu_backend, opt_name, dtype, replicas):
    """MirroredStrategy, float32 variable, narrow gradients from every replica for 3 steps: the
    variable and slots equal the NumPy reference trained on the gradients cast to float32."""
    size = 1031
    init = np.random.default_rng(9).standard_normal(size).astype(np.float32)
    steps = [_grads(dtype, replicas, size, seed=40 + s) for s in range(3)]
    got_w, got_slots = _train(OPTIMIZERS[opt_name], init, steps, replicas)
    select_cpu_backend("numpy")
    want_w, want_slots = _train(OPTIMIZERS[opt_name], init, [[g.astype(np.float32) for g in gs] for gs in steps], replicas)
    assert got_w.dtype == np.float32
    np.testing.assert_array_equal(got_w.view(np.uint32), want_w.view(np.uint32))
    assert len(got_slots) == len(want_slots)
    for g, w in zip(got_slots, want_slots):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()
    # The test can fail: the float32 variable keeps more than the narrow type holds.
    assert not np.array_equal(got_w, got_w.astype(dtype).astype(np.float32))


@pytest.mark.parametrize("backend", ["native", "numba"])
@pytest.mark.parametrize("dtype", NARROW, ids=["bfloat16", "float16"])
def test_narrow_gradients_reach_the_fused_kernel_uncast(monkeypatch, select_cpu_backend, backend, dtype):
    """On a backend with ``mixed_gradients`` the fused kernel receives the replicas' narrow
    gradients themselves (no float32 copy); on one without, float32 casts of them."""
    select_cpu_backend(backend)
    trusted = cpu_backend().trusted
    seen = []
    real = trusted.all_reduce_momentum

    def spy(copies, velocities, grads, *args):
        seen.append([g.dtype for g in grads])
        return real(copies, velocities, grads, *args)

    monkeypatch.setattr(trusted, "all_reduce_momentum", spy)
    steps = [_grads(dtype, 4, 257, seed=1)]
    _train(OPTIMIZERS["momentum"], np.ones(257, np.float32), steps, 4)
    assert seen == [[dtype] * 4]
    monkeypatch.setattr(type(cpu_backend()), "mixed_gradients", False)
    seen.clear()
    _train(OPTIMIZERS["momentum"], np.ones(257, np.float32), steps, 4)
    assert seen == [[np.dtype(np.float32)] * 4]


@pytest.mark.parametrize("mix", [("f32", "bf16", "f32"), ("bf16", "f16", "bf16"), ("f16", "f32", "f32")])
def test_replicas_passing_different_gradient_dtypes_for_one_variable(backend_named, select_cpu_backend, mix):
    """Replicas may pass one variable's gradient in different dtypes (one bf16, another float32):
    each is cast as Keras does and the step equals the reference on the float32-cast gradients
    (the fused kernels take one gradient dtype per variable; this once raised TypeError)."""
    dts = {"f32": np.dtype(np.float32), "bf16": BF16, "f16": np.dtype(np.float16)}
    size = 517
    init = np.random.default_rng(5).standard_normal(size).astype(np.float32)
    steps = []
    for s in range(2):
        gs = _grads(np.float32, len(mix), size, seed=70 + s)
        steps.append([g.astype(dts[k]) for g, k in zip(gs, mix)])

    def make_opt():
        return cudist.optimizers.SGD(0.01, momentum=0.9)

    got_w, got_slots = _train(make_opt, init, steps, len(mix))
    select_cpu_backend("numpy")
    want_w, want_slots = _train(make_opt, init, [[g.astype(np.float32) for g in gs] for gs in steps], len(mix))
    assert got_w.tobytes() == want_w.tobytes()
    assert [g.tobytes() for g in got_slots] == [w.tobytes() for w in want_slots]
    assert not np.array_equal(got_w, init)


@pytest.mark.parametrize("dtype", NARROW, ids=["bfloat16", "float16"])
def test_numba_mixed_falls_back_to_the_cast_definition(monkeypatch, dtype):
    """A Numba mixed-precision call its driver refuses (two gradients partially overlapping: the
    NumPy reference takes the call) still gives the bits of casting the gradients first."""
    from cudist._kernels._numpy import NumpyBackend

    numba_be = get_backend("numba").trusted
    ref = get_backend("numpy").trusted
    calls = []
    real = NumpyBackend._hook_sgd
    monkeypatch.setattr(NumpyBackend, "_hook_sgd", lambda self, *a: (calls.append(a[1].dtype), real(self, *a)))
    rng = np.random.default_rng(5)
    size = 1001
    raw = (rng.standard_normal(size + 1) * 10.0 ** rng.integers(-3, 3, size + 1)).astype(dtype)
    grads = [raw[:size], raw[1:]]  # one element apart: the blocks of one would overlap the other's
    init = rng.standard_normal(size).astype(np.float32)
    got, want = [init.copy()], [init.copy()]
    numba_be.all_reduce_sgd(got, grads, 0.25, 0.0)
    assert calls == [np.dtype(np.float32)]  # the reference ran, on float32 casts
    ref.all_reduce_sgd(want, [g.astype(np.float32) for g in grads], 0.25, 0.0)
    assert got[0].tobytes() == want[0].tobytes()
    # The test can fail: the narrow sum rounded to the gradients' dtype gives other bits.
    narrow = init - np.float32(0.25) * (grads[0] + grads[1]).astype(np.float32)
    assert narrow.tobytes() != want[0].tobytes()
