"""bfloat16 in the cupy backend's CUDA kernels (issue #28): the ``__nv_bfloat16`` forms of the
collectives, the batch scatter and assign_add against the NumPy reference, bit for bit.

CuPy arrays of dtype ``ml_dtypes.bfloat16`` (what CuPy >= 14 holds with ml_dtypes installed). The
reference's rule: accumulate in float32 in replica order, divide the float32 sum by float32(n) for
MEAN, round to bfloat16 once (nearest even; a NaN becomes ml_dtypes' 0x7fc0 with its sign, where
CUDA's own __float2bfloat16_rn gives 0x7fff). The data mixes magnitudes (a rounding per addition
would give other bits), subnormals (CuPy compiles with -ftz: the kernels must keep them), inf, NaNs
with payloads, and sums past the largest finite value. Marker ``gpu``: on a GPU, and on the CPU
under the fake CuPy (tests/test_gpu_emulated.py) on both launch paths (NVRTC, and cudist._core's
C++ launchers in ``CUDIST_EMU_MODE=core``) and in its ftz / shuffle / streams modes.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import cudist
from cudist._kernels import UPDATE_KERNELS, update_variants

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs the optional ml_dtypes package")

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
# The GPU kernel tests' replica counts (11: past one launch's 8 buffers, summed on the host with one
# rounding), odd sizes and reference backend.
from test_gpu_kernels import NS, REF, SHAPES  # noqa: E402  (the cp and be fixtures: conftest.py)


def bits(a):
    return np.asarray(a).view(np.uint16)


def values(rng, shape, *, specials: bool = True) -> np.ndarray:
    """Random bfloat16 values; with ``specials`` (and room) subnormals, +-inf, NaNs with payloads
    and values near the largest finite one (their sums overflow to inf)."""
    size = int(np.prod(shape, dtype=np.int64))
    v = rng.standard_normal(size).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 6, size)
    b = v.astype(BF16)
    u = b.view(np.uint16)
    if specials and size >= 16:
        idx = rng.permutation(size)[:8]
        u[idx[0]] = rng.integers(1, 0x80)  # positive subnormal
        u[idx[1]] = 0x8000 | int(rng.integers(1, 0x80))  # negative subnormal
        u[idx[2]] = 0x7F7F  # largest finite: two of them sum to inf
        u[idx[3]] = 0x7F80  # inf
        u[idx[4]] = 0xFF80  # -inf
        u[idx[5]] = 0x7FFF  # NaN, CUDA's canonical one
        u[idx[6]] = 0xFFC1  # negative NaN with a payload
        u[idx[7]] = 0x8000  # -0
    return np.asarray(b.reshape(shape))


def assert_bits(got, want, what=""):
    """Bit for bit, except a computed NaN's sign: the hardware's float32 NaN decides it (x86 gives
    inf + -inf as -NaN and keeps a NaN operand's sign, a GPU gives +NaN), the kernels' rounding only
    its bits past the sign, which must be ml_dtypes' quiet NaN 0x7fc0 (CUDA's would be 0x7fff).
    What is only copied (broadcast, gather, scatter) is checked with :func:`assert_copy`."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == BF16 and got.shape == want.shape, what
    g, w = bits(got).ravel(), bits(want).ravel()
    nan = (w & 0x7FFF) > 0x7F80
    assert np.array_equal((g & 0x7FFF) > 0x7F80, nan), f"{what}: NaN positions differ"
    assert np.all(g[nan] & 0x7FFF == 0x7FC0), f"{what}: a NaN other than 0x7fc0 | sign: {g[nan]}"
    g, w = np.where(nan, 0, g), np.where(nan, 0, w)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"{what}: {bad.size} of {g.size} differ, first [{bad[0]}]: got {g[bad[0]]:#06x} want {w[bad[0]]:#06x}"


def assert_copy(got, want, what=""):
    """Exactly the same bits, NaN payloads and signs included (nothing is computed)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == BF16 and got.shape == want.shape, what
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)


def reference(host, op):
    out = np.empty_like(host[0])
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are part of the data
        REF.reduce_to_one([h.copy() for h in host], op, out=out)
    return out


def _rng(*key):
    return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def test_backend_takes_bfloat16_arrays(cp, be):
    assert be.bfloat16 and be.computes(BF16)
    assert be.bfloat16_updates  # bfloat16 variables: the update kernels' __nv_bfloat16 forms
    assert be.mixed_gradients  # 16-bit gradients of float32 variables: the fused kernels' <float, G> forms
    x = cp.asarray(np.arange(5).astype(BF16))
    assert x.dtype == BF16


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_in_place(cp, be, n, op):
    rng = _rng("in_place", n, op)
    for shape in SHAPES:
        host = [values(rng, shape) for _ in range(n)]
        dev = [cp.asarray(h) for h in host]
        be.all_reduce(dev, op)
        # One replica: the value itself, untouched (NaN payloads too).
        check, want = (assert_bits, reference(host, op)) if n > 1 else (assert_copy, host[0])
        for r, d in enumerate(dev):
            check(cp.asnumpy(d), want, f"replica {r} shape {shape}")


@pytest.mark.parametrize("n", [2, 3, 8, 11])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_out_of_place_and_reduce_to_one(cp, be, n, op):
    rng = _rng("out_of_place", n, op)
    host = [values(rng, (1031,)) for _ in range(n)]
    want = reference(host, op)
    dev = [cp.asarray(h) for h in host]
    outs = [cp.empty_like(d) for d in dev]
    be.all_reduce(dev, op, outputs=outs)
    for r, (d, h, o) in enumerate(zip(dev, host, outs)):
        assert_bits(cp.asnumpy(o), want, f"output {r}")
        assert_copy(cp.asnumpy(d), h, f"input {r} untouched")
    assert_bits(cp.asnumpy(be.reduce_to_one(dev, op)), want, "reduce_to_one, new out")
    be.reduce_to_one(dev, op, out=dev[0])  # out aliasing the first input
    assert_bits(cp.asnumpy(dev[0]), want, "reduce_to_one into input 0")


def test_nan_inf_subnormal_and_overflow_bits(cp, be):
    """Each special case on its own column, so every result's bits are known exactly."""
    f32 = np.float32
    cols = [
        (1e-39, 2e-39),  # subnormal + subnormal: a subnormal (ftz would give 0)
        (3.0e38, 3.0e38),  # overflow to inf
        (np.inf, -np.inf),  # NaN
        (np.nan, 1.0),  # NaN in
        (-np.nan, -1.0),  # negative NaN in
        (1.0, 2.0 ** -8),  # a tie: rounds to even (1.0)
        (1.0, 3 * 2.0 ** -8),  # a tie: rounds to even (1.0 + 2**-6)
    ]
    host = [np.array([c[r] for c in cols], f32).astype(BF16) for r in range(2)]
    # Payload NaNs ml_dtypes would canonicalise anyway; here the raw bits go in.
    host[0].view(np.uint16)[3] = 0x7FA5
    host[0].view(np.uint16)[4] = 0xFFFF
    dev = [cp.asarray(h) for h in host]
    be.all_reduce(dev, "sum")
    assert_bits(cp.asnumpy(dev[0]), reference(host, "sum"), "specials")
    got = bits(cp.asnumpy(dev[0]))
    assert 0 < got[0] < 0x80  # kept subnormal
    assert got[1] == 0x7F80
    assert all(x & 0x7FFF == 0x7FC0 for x in got[2:5])  # ml_dtypes' NaN, not CUDA's 0x7fff
    assert got[5] == 0x3F80 and got[6] == bits(np.array([1.0 + 2.0 ** -6], f32).astype(BF16))[0]


def test_broadcast_copies_bits(cp, be):
    rng = _rng("broadcast")
    src_h = values(rng, (1031,))
    src_h.view(np.uint16)[:3] = (0x7FA5, 0xFFFF, 0x0001)  # NaN payloads and a subnormal, copied as they are
    src = cp.asarray(src_h)
    dsts = [cp.zeros((1031,), BF16) for _ in range(11)]
    be.broadcast(src, dsts)
    for d in dsts:
        assert_copy(cp.asnumpy(d), src_h, "broadcast")


def test_all_gather(cp, be):
    rng = _rng("gather")
    host = [values(rng, (k, 3)) for k in (5, 0, 2, 7)]
    got = be.all_gather([cp.asarray(h) for h in host], axis=0)
    assert_copy(cp.asnumpy(got), np.concatenate(host, axis=0), "all_gather")


@pytest.mark.parametrize("n", [1, 3, 4, 9])
def test_scatter_device_and_host_batches(cp, be, n):
    rng = _rng("scatter", n)
    batch = values(rng, (37, 3))
    want = np.array_split(batch, np.cumsum([-(-37 // n)] * (n - 1)))
    for src in (cp.asarray(batch), batch):
        parts = be.scatter(src, [0] * n)
        assert len(parts) == n
        for r, p in enumerate(parts):
            assert_copy(cp.asnumpy(p), want[r].reshape((-1, 3)), f"piece {r}")


def test_scatter_runs_the_kernel(cp, be, monkeypatch):
    """A device batch of bfloat16 is split by the scatter_batch kernel, not by plain copies."""
    launched = []
    real = be._launch

    def spy(device, kernel, dtype, *args, **kw):
        launched.append((kernel, np.dtype(dtype)))
        return real(device, kernel, dtype, *args, **kw)

    monkeypatch.setattr(be, "_launch", spy)
    be.scatter(cp.asarray(values(_rng("k"), (16, 2))), [0, 0, 0])
    assert ("scatter_batch", BF16) in launched


@pytest.mark.parametrize("n", [1, 2, 9])
def test_assign_add_and_sub(cp, be, n):
    rng = _rng("assign", n)
    init, value = values(rng, (1031,)), values(rng, (1031,))
    for method in ("assign_add", "assign_sub"):
        want = [init.copy() for _ in range(n)]
        with np.errstate(over="ignore", invalid="ignore"):
            getattr(REF, method)(want, value.copy())
        copies = [cp.asarray(init) for _ in range(n)]
        getattr(be, method)(copies, cp.asarray(value))
        for c in copies:
            assert_bits(cp.asnumpy(c), want[0], method)


# Hyper-parameters by name for every row of UPDATE_KERNELS (decay non-zero: its path runs too).
HYPER = {
    "lr": 0.01, "lr_t": 0.003, "momentum": 0.9, "beta_1": 0.9, "beta_2": 0.999,
    "epsilon": 1e-7, "decay": 0.004, "rho": 0.9, "c_m": 0.11, "c_g": 0.3, "c_v": 0.05,
}


def _update_state(name, dtype, n, size, rng):
    """n copies of a variable and of each of its slots (positive where a sqrt reads them)."""
    from cudist._kernels import UPDATE_KERNELS

    w = (rng.standard_normal(size) * 3).astype(np.float32)
    slots = [
        (np.abs(rng.standard_normal(size)) * (0.01 if s == "average_gradient" else 1.0) + (s != "average_gradient"))
        .astype(np.float32)
        for s in UPDATE_KERNELS[name][0]
    ]
    return [[x.astype(dtype) for _ in range(n)] for x in (w, *slots)]


def _run_update(backend, name, groups, grads, fused):
    """``backend``'s update ``name`` (fused: ``all_reduce_<name>`` over ``grads``; else the plain one)."""
    from cudist._kernels import UPDATE_KERNELS

    hyper = [HYPER[h] for h in UPDATE_KERNELS[name][1]]
    entry = getattr(backend.trusted, f"all_reduce_{name}" if fused else name)
    with np.errstate(all="ignore"):
        entry(groups[0], *groups[1:], grads if fused else grads[0], *hyper)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("name", list(UPDATE_KERNELS))
def test_bfloat16_variables_match_the_reference(cp, be, name, fused):
    """bfloat16 variables (and slots) on the GPU: every optimizer's kernel, plain and fused (3
    gradients summed in float32 and rounded once), float32 arithmetic rounded once per stored
    value: the NumPy reference's bits (what every CPU backend gives), on 2 and 9 copies (past one
    launch: broadcast) and odd sizes."""
    for n, size in ((2, 1031), (9, 37)):
        rng = _rng("bf16_update", name, fused, n)
        host = _update_state(name, BF16, n, size, rng)
        grads = [values(rng, (size,), specials=False) for _ in range(3 if fused else 1)]
        want = [[x.copy() for x in g] for g in host]
        _run_update(REF, name, want, [g.copy() for g in grads], fused)
        dev = [[cp.asarray(x) for x in g] for g in host]
        _run_update(be, name, dev, [cp.asarray(g) for g in grads], fused)
        for j, (dg, wg) in enumerate(zip(dev, want)):
            for r, d in enumerate(dg):
                assert_bits(cp.asnumpy(d), wg[0], f"{name} n={n} group {j} copy {r}")
        # The test can fail: the update moved the weights.
        assert not np.array_equal(bits(cp.asnumpy(dev[0][0])), bits(host[0][0]))


@pytest.mark.parametrize("gdtype", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(UPDATE_KERNELS))
@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_fused_update_widens_narrow_gradients_in_the_kernel(cp, be, name, gdtype, m, monkeypatch):
    """float32 variables from bfloat16 / float16 gradients: the fused kernel's <float, G> form reads
    the 16-bit gradients and sums them widened in float32 (replica order): bit for bit the reference
    updating from the gradients cast to float32, which is the CPU backends' mixed path. Up to 8
    gradients no float32 copy is made (the mixed kernel is the one launched); 11 are widened first
    and pre-summed in float32 (the same bits)."""
    import cudist._kernels._cupy as cupy_mod

    launched = []
    real = cupy_mod.CupyBackend._launch

    def spy(self, device, kernel, dtype, count, args, **kw):
        launched.append((kernel, np.dtype(dtype), kw.get("grad_dtype")))
        return real(self, device, kernel, dtype, count, args, **kw)

    monkeypatch.setattr(cupy_mod.CupyBackend, "_launch", spy)
    size = 1031
    rng = _rng("mixed_kernel", name, gdtype, m)
    host = _update_state(name, np.float32, 2, size, rng)
    grads = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3, size)).astype(gdtype) for _ in range(m)]
    grads[0][5] = np.nan
    grads[-1][9] = -np.inf
    want = [[x.copy() for x in g] for g in host]
    _run_update(REF, name, want, [g.astype(np.float32) for g in grads], True)
    dev = [[cp.asarray(x) for x in g] for g in host]
    _run_update(be, name, dev, [cp.asarray(g) for g in grads], True)
    for j, (dg, wg) in enumerate(zip(dev, want)):
        for r, d in enumerate(dg):
            got = cp.asnumpy(d)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32), wg[0].view(np.uint32), err_msg=f"{name} group {j} copy {r}")
    kernel = "mirrored_all_reduce_" + name
    # A rule with optional slots launches the row of the slots it has (rmsprop_momentum_...).
    variants = {"mirrored_all_reduce_" + v for v, (row, _, _) in update_variants().items() if row == name}
    mixed = [g for k, dt, g in launched if k in {kernel} | variants and dt == np.float32]
    assert mixed == ([np.dtype(gdtype)] if m <= 8 else [None]), launched


def test_narrow_gradients_refused_where_no_kernel_reads_them(cp, be):
    """Only the kernel list's pairs (float32 copies; bfloat16 / float16 gradients): other pairs are a
    TypeError naming both dtypes, never a misread. Every update is a row of the rules' table, whose
    plain form launches the fused kernel with one gradient, so a pair of the list is read exactly
    there too (the bits of the cast gradient)."""
    g = [cp.asarray(values(_rng("g"), (7,), specials=False))]
    with pytest.raises(TypeError, match="gradients have dtype bfloat16 but the copies have dtype float64"):
        be.trusted.all_reduce_sgd([cp.zeros(7, np.float64)], g, 0.1, 0.0)
    with pytest.raises(TypeError, match="gradients have dtype bfloat16 but the copies have dtype float16"):
        be.trusted.all_reduce_sgd([cp.zeros(7, np.float16)], g, 0.1, 0.0)
    with pytest.raises(TypeError, match="gradients have dtype bfloat16 but the copies have dtype float16"):
        be.trusted.sgd([cp.zeros(7, np.float16)], g[0], 0.1, 0.0)
    w0 = cp.asarray(np.linspace(-1.0, 1.0, 7, dtype=np.float32))
    got, want = [w0.copy()], [w0.copy()]
    be.trusted.sgd(got, g[0], 0.1, 0.0)
    be.trusted.sgd(want, g[0].astype(np.float32), 0.1, 0.0)
    assert cp.asnumpy(got[0]).tobytes() == cp.asnumpy(want[0]).tobytes()
    assert not np.array_equal(cp.asnumpy(got[0]), cp.asnumpy(w0))


def test_mixed_precision_apply_gradients_matches_the_cpu_fused_pass(cp):
    """float32 variables on logical GPUs updated from bfloat16 gradients (SGD with momentum, 3
    steps): the bits of the CPU backends, whose fused pass widens the gradients itself."""
    from conftest import gpu0_split

    n, size = 3, 1031
    init = np.random.default_rng(3).standard_normal(size).astype(np.float32)
    steps = [[values(_rng("mixed", s, r), (size,), specials=False) for r in range(n)] for s in range(3)]

    def train(devices, to_device):
        strategy = cudist.MirroredStrategy(devices)
        with strategy.scope():
            w = cudist.Variable(init, name="w")
            opt = cudist.optimizers.SGD(0.01, momentum=0.9)
        for grads in steps:
            def step(grads=grads):
                g = grads[cudist.get_replica_context().replica_id_in_sync_group]
                opt.apply_gradients([(to_device(g), w)])

            strategy.run(step)
        return w.numpy(), [v.numpy() for v in opt.variables[1:]]

    with gpu0_split(n, memory_limit=1024):
        got_w, got_slots = train([f"/gpu:{i}" for i in range(n)], cp.asarray)
    want_w, want_slots = train([f"/cpu:{i}" for i in range(n)], lambda g: g)
    assert got_w.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got_w).view(np.uint32), np.asarray(want_w).view(np.uint32))
    for g, w in zip(got_slots, want_slots):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))
    # The test can fail: the float32 variable keeps more than bfloat16 holds.
    assert not np.array_equal(got_w, got_w.astype(BF16).astype(np.float32))


@pytest.mark.multi_gpu
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_across_gpus_two_shot(cp, be, op):
    """One buffer per GPU, 1 MiB each: the two-shot path (reduce-scatter, then all-gather)."""
    from cudist._kernels._cupy import _TWO_SHOT_MIN_BYTES

    k = min(cp.cuda.runtime.getDeviceCount(), 4)
    count = _TWO_SHOT_MIN_BYTES // 2 + 9  # past the threshold, and not a whole number of vectors
    rng = _rng("two_shot", op)
    host = [values(rng, (count,)) for _ in range(k)]
    want = reference(host, op)
    dev = []
    for d, h in enumerate(host):
        with cp.cuda.Device(d):
            dev.append(cp.asarray(h))
    be.all_reduce(dev, op)
    for i, d in enumerate(dev):
        assert d.device.id == i
        assert_bits(cp.asnumpy(d), want, f"GPU {i}")


@pytest.mark.parametrize("n", [2, 4])
def test_strategy_run_all_reduce_on_logical_gpus(cp, n):
    """bfloat16 all-reduce through strategy.run on logical GPUs (odd sizes, a nest of leaves): the
    NumPy reference's bits, the same the CPU backends give."""
    from conftest import gpu0_split

    rng = _rng("strategy", n)
    parts = [[values(rng, (1031,)), values(rng, (7, 3))] for _ in range(n)]
    with gpu0_split(n, memory_limit=1024):
        strategy = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(n)])

        def step():
            ctx = cudist.get_replica_context()
            xs = [cp.asarray(p) for p in parts[ctx.replica_id_in_sync_group]]
            return ctx.all_reduce("sum", xs), ctx.all_reduce("mean", xs[0])

        sums, means = strategy.run(step)
        for leaf in range(2):
            want = reference([p[leaf] for p in parts], "sum")
            for s in strategy.experimental_local_results(sums):
                assert isinstance(s[leaf], cp.ndarray) and s[leaf].dtype == BF16
                assert_bits(cp.asnumpy(s[leaf]), want, f"sum leaf {leaf}")
        want = reference([p[0] for p in parts], "mean")
        for m in strategy.experimental_local_results(means):
            assert_bits(cp.asnumpy(m), want, "mean")


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_bfloat16_variables_train_on_gpus_as_on_the_cpu(cp, opt_name):
    """bfloat16 variables under a MirroredStrategy on logical GPUs (refused before the kernels had
    bfloat16 update forms): 3 steps of bfloat16 gradients give the CPU backends' bits (the NumPy
    reference's), weights and slots."""
    from conftest import gpu0_split

    n, size = 3, 1031
    init = values(_rng("bf16_var_init"), (size,), specials=False)
    steps = [[values(_rng("bf16_var", s, r), (size,), specials=False) for r in range(n)] for s in range(3)]
    make = {"sgd_momentum": lambda: cudist.optimizers.SGD(0.01, momentum=0.9),
            "adam": lambda: cudist.optimizers.Adam(0.01)}[opt_name]

    def train(devices, to_device):
        strategy = cudist.MirroredStrategy(devices)
        with strategy.scope():
            w = cudist.Variable(init, name="w")
            opt = make()
        for grads in steps:
            def step(grads=grads):
                g = grads[cudist.get_replica_context().replica_id_in_sync_group]
                opt.apply_gradients([(to_device(g), w)])

            strategy.run(step)
        return [np.asarray(x) for x in strategy.experimental_local_results(w)], [np.asarray(v.numpy()) for v in opt.variables[1:]]

    with gpu0_split(n, memory_limit=1024):
        got_w, got_slots = train([f"/gpu:{i}" for i in range(n)], cp.asarray)
    want_w, want_slots = train([f"/cpu:{i}" for i in range(n)], lambda g: g)
    assert got_w[0].dtype == BF16
    for r, g in enumerate(got_w):
        assert_bits(g, want_w[0], f"weights, replica {r}")
    assert len(got_slots) == len(want_slots) and sum(s.dtype == BF16 for s in want_slots) == (1 if opt_name == "sgd_momentum" else 2)
    for g, w in zip(got_slots, want_slots):  # the bfloat16 slots, and the optimizer's float32 scalars
        if w.dtype == BF16:
            assert_bits(g, w, "slot")
        else:
            np.testing.assert_array_equal(g, w)
    assert not np.array_equal(bits(got_w[0]), bits(init))  # the weights moved
