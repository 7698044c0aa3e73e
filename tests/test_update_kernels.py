"""The optimizer update kernels beyond SGD / momentum / Adam (AdamW, AMSGrad, RMSprop, Adagrad, Adamax,
Nadam, Lion) on every CPU backend against the NumPy reference, bit for bit.

Same rules as tests/test_kernels.py: random data (several binades, no zeros), float16/32/64, 1 to 8
copies, 1 to 8 gradients for the fused all-reduce forms (M != N included), sizes 0, 1, primes and
sizes past one thread's block, fresh / offset / unaligned buffers, read-only gradients. The fused
form must equal ``reduce_to_one`` + the plain form of the reference, and the trusted entry points
the public methods.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudist._kernels import UPDATE_KERNELS, bias_corrected_lr, get_backend, momentum_schedule_step
from cudist._kernels._numpy import NumpyBackend

CPU_BACKENDS = ["numpy", "numba", "native"]
FLOATS = ["float16", "float32", "float64"]
SIZES = [0, 1, 2, 3, 5, 7, 13, 31, 127, 1021, 8191, 8209, 65537]
LAYOUTS = ["fresh", "offset", "unaligned"]
REF = NumpyBackend()
FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])

OPTIMIZERS = ["adamw", "amsgrad", "rmsprop", "adagrad", "adamax", "nadam", "lion"]


@pytest.fixture(params=CPU_BACKENDS, scope="module")
def backend(request):
    return get_backend(request.param)


def random_array(rng, shape, dtype, *, positive=False, scale=None):
    dt = np.dtype(dtype)
    scale = {2: 8.0, 4: 1e3, 8: 1e6}[dt.itemsize] if scale is None else scale
    a = rng.uniform(0.5, 1.0, size=shape)
    if not positive:
        a *= rng.choice([-1.0, 1.0], size=shape)
    a *= scale ** rng.uniform(-1.0, 1.0, size=shape)
    return np.asarray(a.astype(dt))


def placed(a, layout):
    """A copy of ``a`` laid out fresh, one element past a 64-byte boundary, or one byte past it."""
    a = np.asarray(a)
    if layout == "fresh":
        return a.copy()
    skip = a.itemsize if layout == "offset" else 1
    raw = np.empty(a.nbytes + 64 + skip, np.uint8)
    start = (-raw.ctypes.data) % 64 + skip
    out = np.ndarray(a.shape, a.dtype, raw.data, start)
    out[...] = a
    return out


def assert_bitwise(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if actual.tobytes() != expected.tobytes():
        u = f"u{actual.itemsize}"
        bad = np.flatnonzero(actual.reshape(-1).view(u) != expected.reshape(-1).view(u))
        i = bad[0]
        raise AssertionError(
            f"{what}: {bad.size} of {actual.size} elements differ bitwise; first at {i}: "
            f"{actual.reshape(-1)[i]!r} != {expected.reshape(-1)[i]!r}"
        )


@st.composite
def shapes(draw):
    size = draw(st.sampled_from(SIZES))
    if size > 1 and draw(st.booleans()):
        return draw(st.sampled_from([(size, 1), (1, size, 1)]))
    if draw(st.booleans()):
        return draw(st.sampled_from([(3, 4), (2, 3, 5), (16, 1024, 3)]))
    return (size,)


@st.composite
def hypers(draw, name):
    """Public keyword arguments of kernel ``name`` (weight decay 0 half of the time)."""
    lr = draw(st.floats(1e-4, 0.1))
    wd = draw(st.sampled_from([0.0, 0.004, 0.1]))
    b1 = draw(st.floats(0.5, 0.99))
    b2 = draw(st.floats(0.9, 0.9999))
    eps = draw(st.sampled_from([1e-7, 1e-3]))
    step = draw(st.integers(1, 1000))
    if name in ("adamw", "amsgrad", "adamax"):
        return dict(lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=step, weight_decay=wd)
    if name == "nadam":
        u = 1.0
        for t in range(1, min(step, 50)):
            u = momentum_schedule_step(b1, b2, t, u)[0]
        return dict(lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=min(step, 50), u_product=u, weight_decay=wd)
    if name == "rmsprop":
        return dict(lr=lr, rho=draw(st.floats(0.5, 0.99)), momentum=draw(st.sampled_from([0.0, 0.9])), epsilon=eps,
                    weight_decay=wd)
    if name == "adagrad":
        return dict(lr=lr, epsilon=eps, weight_decay=wd)
    return dict(lr=lr, beta_1=b1, beta_2=b2, weight_decay=wd)  # lion


def state(rng, name, shape, dtype, n, layout, *, momentum=True, centered=True):
    """The variable's copies and its slot groups (None for an absent rmsprop slot), mirrored."""
    w = random_array(rng, shape, dtype)
    slots = UPDATE_KERNELS[name][0]
    values = []
    for s in slots:
        if s in ("velocity", "v", "v_hat", "accumulator", "u"):
            values.append(random_array(rng, shape, dtype, positive=True))
        elif s == "average_gradient":  # small enough that v - a*a stays positive
            v = values[0].astype(np.float64)
            values.append((np.sqrt(v) * rng.uniform(-0.5, 0.5, size=shape)).astype(dtype))
        else:
            values.append(random_array(rng, shape, dtype))
    groups = [[placed(w, layout) for _ in range(n)]]
    for s, v in zip(slots, values):
        absent = (s == "momentum" and name == "rmsprop" and not momentum) or (s == "average_gradient" and not centered)
        groups.append(None if absent else [placed(v, layout) for _ in range(n)])
    return groups


def clone(groups):
    return [None if g is None else [a.copy() for a in g] for g in groups]


def check(backend, what, got, want):
    for gi, (gg, wg) in enumerate(zip(got, want)):
        if wg is None:
            assert gg is None
            continue
        for i, (a, b) in enumerate(zip(gg, wg)):
            assert_bitwise(a, b, f"{backend.name} {what}: group {gi} copy {i}")


def grads_of(rng, shape, dtype, m, layout, ro):
    grads = [placed(random_array(rng, shape, dtype), layout) for _ in range(m)]
    if ro:
        for g in grads:
            g.flags.writeable = False
    return grads


def call(b, name, groups, g, kw, *, fused):
    fn = getattr(b, f"all_reduce_{name}" if fused else name)
    return fn(*groups, g, **kw)


fused_case = dict(
    dtype=st.sampled_from(FLOATS),
    n=st.integers(1, 8),
    m=st.integers(1, 8),
    shape=shapes(),
    seed=st.integers(0, 2**32 - 1),
    layout=st.sampled_from(LAYOUTS),
    ro=st.booleans(),
    flags=st.tuples(st.booleans(), st.booleans()),
)


def _run_case(backend, name, kw, dtype, n, m, shape, seed, layout, ro, flags):
    rng = np.random.default_rng(seed)
    momentum, centered = flags
    if name == "rmsprop":
        momentum = kw["momentum"] > 0
    groups = state(rng, name, shape, dtype, n, layout, momentum=momentum, centered=centered)
    grads = grads_of(rng, shape, dtype, m, layout, ro)
    # The definition: the reference's sum, then the reference's plain update.
    want = clone(groups)
    call(REF, name, want, REF.reduce_to_one(grads, "sum"), kw, fused=False)
    plain = clone(groups)
    out = call(backend, name, plain, grads[0] if m == 1 else backend.reduce_to_one(grads, "sum"), kw, fused=False)
    assert isinstance(out, tuple) and all(o is c for o, c in zip(out, plain[0]))
    check(backend, f"{name} (reduce, then {name})", plain, want)
    fused = clone(groups)
    out = call(backend, name, fused, grads, kw, fused=True)
    assert all(o is c for o, c in zip(out, fused[0]))
    check(backend, f"all_reduce_{name}", fused, want)


def _make_test(name):
    @FAST
    @given(kw=hypers(name), **fused_case)
    def test(backend, kw, dtype, n, m, shape, seed, layout, ro, flags):
        _run_case(backend, name, kw, dtype, n, m, shape, seed, layout, ro, flags)

    test.__name__ = f"test_{name}_matches_reference"
    test.__doc__ = f"{name} and all_reduce_{name} against the reference, bit for bit."
    return test


for _name in OPTIMIZERS:
    globals()[f"test_{_name}_matches_reference"] = _make_test(_name)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n, m", [(4, 4), (1, 3), (3, 1)])
def test_large_multithreaded(backend, name, dtype, n, m):
    """Past the backends' parallel thresholds (several threads, streaming stores)."""
    rng = np.random.default_rng(11)
    kw = {
        "adamw": dict(lr=0.01, step=7, weight_decay=0.01),
        "amsgrad": dict(lr=0.01, step=7, weight_decay=0.01),
        "rmsprop": dict(lr=0.01, rho=0.9, momentum=0.9, weight_decay=0.01),
        "adagrad": dict(lr=0.01, weight_decay=0.0),
        "adamax": dict(lr=0.01, step=3, weight_decay=0.1),
        "nadam": dict(lr=0.01, step=5, u_product=0.7),
        "lion": dict(lr=0.01, weight_decay=0.004),
    }[name]
    _run_case(backend, name, kw, dtype, n, m, (700001,), 11, "fresh", False, (True, True))


def test_rmsprop_every_slot_combination(backend):
    for momentum in (0.0, 0.5):
        for centered in (False, True):
            kw = dict(lr=0.05, rho=0.8, momentum=momentum, weight_decay=0.0)
            _run_case(backend, "rmsprop", kw, "float32", 3, 2, (1021,), 5, "fresh", False, (momentum > 0, centered))


def test_trusted_matches_public(backend):
    """The trusted entry points take the derived scalars (lr_t, decay = weight_decay * lr, Nadam's
    coefficients) and give the public methods' results."""
    t = backend.trusted
    rng = np.random.default_rng(3)
    shape, n, lr, wd = (5, 41), 3, 0.02, 0.1
    for dtype in FLOATS:
        grads = [random_array(rng, shape, dtype) for _ in range(2)]
        u_prev = momentum_schedule_step(0.9, 0.999, 1, 1.0)[0]
        _, c_m, c_g, c_v = momentum_schedule_step(0.9, 0.999, 2, u_prev)
        cases = {
            "adamw": (dict(lr=lr, step=2, weight_decay=wd), (bias_corrected_lr(lr, 0.9, 0.999, 2), 0.9, 0.999, 1e-7, wd * lr)),
            "amsgrad": (dict(lr=lr, step=2, weight_decay=wd), (bias_corrected_lr(lr, 0.9, 0.999, 2), 0.9, 0.999, 1e-7, wd * lr)),
            "rmsprop": (dict(lr=lr, momentum=0.5, weight_decay=wd), (lr, 0.9, 0.5, 1e-7, wd * lr)),
            "adagrad": (dict(lr=lr, weight_decay=wd), (lr, 1e-7, wd * lr)),
            "adamax": (dict(lr=lr, step=2, weight_decay=wd), (bias_corrected_lr(lr, 0.9, 0.0, 2), 0.9, 0.999, 1e-7, wd * lr)),
            "nadam": (dict(lr=lr, step=2, u_product=u_prev, weight_decay=wd), (lr, 0.9, 0.999, 1e-7, c_m, c_g, c_v, wd * lr)),
            "lion": (dict(lr=lr, weight_decay=wd), (lr, 0.9, 0.99, wd * lr)),
        }
        for name, (kw, hyper) in cases.items():
            groups = state(rng, name, shape, dtype, n, "fresh", centered=True)
            for fused in (False, True):
                want, got = clone(groups), clone(groups)
                g = grads if fused else grads[0]
                call(REF, name, want, g, kw, fused=fused)
                fn = getattr(t, f"all_reduce_{name}" if fused else name)
                assert fn(*(tuple(x) if x is not None else None for x in got), tuple(g) if fused else g, *hyper) is None
                check(backend, f"trusted {name} fused={fused}", got, want)


def test_weight_decay_is_decoupled(backend):
    """``w - w * (weight_decay * lr)`` first, then the update from the decayed weights: Adagrad
    with a zero gradient leaves exactly the decayed weights."""
    w = [np.full(7, 2.0, np.float64) for _ in range(2)]
    acc = [np.ones(7) for _ in range(2)]
    backend.adagrad(w, acc, np.zeros(7), lr=0.5, weight_decay=0.1)
    np.testing.assert_array_equal(w[0], 2.0 - 2.0 * (0.1 * 0.5))
    np.testing.assert_array_equal(w[1], w[0])


def test_known_values(backend):
    """One float64 step of each against Keras 3's formulas written out."""
    g = np.array([0.5, -2.0, 0.0])
    w0 = np.array([1.0, -1.0, 0.5])
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.999, 1e-7, 0.01

    def run(name, nslots, init=0.0, **kw):
        w = [w0.copy() for _ in range(2)]
        slots = [[np.full(3, init) for _ in range(2)] for _ in range(nslots)]
        getattr(backend, name)(w, *slots, g, **kw)
        return w[0], [s[0] for s in slots]

    w, (m, v) = run("adamw", 2, lr=lr, step=1, weight_decay=wd)
    wd_w = w0 - w0 * (wd * lr)
    m_e, v_e = g * (1 - b1), g * g * (1 - b2)
    np.testing.assert_allclose(w, wd_w - bias_corrected_lr(lr, b1, b2, 1) * m_e / (np.sqrt(v_e) + eps), rtol=1e-13)
    w = [w0.copy() for _ in range(2)]
    ms, vs = [[np.zeros(3) for _ in range(2)] for _ in range(2)]
    v_hats = [np.array([1e-4, 0.0, 0.0]) for _ in range(2)]  # above v_e for element 0, below for 1
    backend.amsgrad(w, ms, vs, v_hats, g, lr=lr, step=1)
    v_hat = np.maximum([1e-4, 0.0, 0.0], v_e)
    np.testing.assert_array_equal(v_hats[0], v_hat)
    np.testing.assert_allclose(w[0], w0 - bias_corrected_lr(lr, b1, b2, 1) * m_e / (np.sqrt(v_hat) + eps), rtol=1e-13)
    w, (acc,) = run("adagrad", 1, init=0.1, lr=lr)
    np.testing.assert_allclose(w, w0 - lr * g / np.sqrt(0.1 + g * g + eps), rtol=1e-13)
    w, (m, u) = run("adamax", 2, lr=lr, step=1)
    np.testing.assert_allclose(u, np.abs(g))
    np.testing.assert_allclose(w, w0 - lr * m_e / ((1 - b1) * (np.abs(g) + eps)), rtol=1e-13)
    w, (mm,) = run("lion", 1, lr=lr, beta_1=b1, beta_2=0.99)
    np.testing.assert_array_equal(w, w0 - lr * np.sign(g))
    np.testing.assert_allclose(mm, g * (1 - 0.99))
    w = [w0.copy() for _ in range(2)]
    v = [np.zeros(3) for _ in range(2)]
    backend.rmsprop(w, v, None, None, g, lr=lr, rho=0.9)
    np.testing.assert_allclose(w[0], w0 - lr * g / np.sqrt(0.1 * g * g + eps), rtol=1e-13)
    w, (m, v) = run("nadam", 2, lr=lr, step=1, u_product=1.0)
    u1, u2 = b1 * (1 - 0.5 * 0.96), b1 * (1 - 0.5 * 0.96**2)
    m_hat = u2 * m_e / (1 - u1 * u2) + (1 - u1) * g / (1 - u1)
    np.testing.assert_allclose(w, w0 - m_hat * lr / (np.sqrt(v_e / (1 - b2)) + eps), rtol=1e-13)


def test_errors_name_the_problem(backend):
    a = [np.ones(4, np.float32) for _ in range(2)]
    s = [np.zeros(4, np.float32) for _ in range(2)]
    g = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="adamw: step must be >= 1"):
        backend.adamw(a, s, [x.copy() for x in s], g, lr=0.1, step=0)
    with pytest.raises(TypeError, match="lion: the grad has dtype|lion: grad has dtype"):
        backend.lion(a, s, g.astype(np.float64), lr=0.1)
    with pytest.raises(ValueError, match="rmsprop: got 2 variable copies but 1 momentum copies"):
        backend.rmsprop(a, s, [np.zeros(4, np.float32)], None, g, lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="adagrad: needs a floating-point dtype"):
        backend.adagrad([np.ones(4, np.int32)], [np.ones(4, np.int32)], np.ones(4, np.int32), lr=0.1)
    with pytest.raises(ValueError, match="all_reduce_nadam: .*gradient"):
        backend.all_reduce_nadam(a, s, [x.copy() for x in s], [a[0]], lr=0.1, step=1, u_product=1.0)


# ---------------------------------------------------------------------------- the cupy backend
@pytest.mark.gpu
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n, m", [(1, 1), (3, 1), (2, 3), (11, 2), (2, 11)])
def test_cupy_matches_reference(name, dtype, n, m):
    """The CUDA kernels through the cupy backend (plain form with one gradient, fused form with m;
    11: more than one launch's worth), bit for bit the reference, on one GPU."""
    cp = pytest.importorskip("cupy")
    be = get_backend("cupy")
    rng = np.random.default_rng(n * 100 + m)
    kw = {
        "adamw": dict(lr=0.01, step=7, weight_decay=0.01),
        "amsgrad": dict(lr=0.01, step=7, weight_decay=0.01),
        "rmsprop": dict(lr=0.01, rho=0.9, momentum=0.9 if n % 2 else 0.0, weight_decay=0.01),
        "adagrad": dict(lr=0.01, weight_decay=0.0),
        "adamax": dict(lr=0.01, step=3, weight_decay=0.1),
        "nadam": dict(lr=0.01, step=5, u_product=0.7),
        "lion": dict(lr=0.01, weight_decay=0.004),
    }[name]
    for shape in [(), (7,), (33, 5), (1031,)]:
        groups = state(rng, name, shape, dtype, n, "fresh", momentum=kw.get("momentum", 0) > 0, centered=m % 2 == 1)
        grads = [random_array(rng, shape, dtype) for _ in range(m)]
        for fused in (m > 1, True):
            want = clone(groups)
            call(REF, name, want, REF.reduce_to_one(grads, "sum"), kw, fused=False)
            dev = [None if g is None else [cp.asarray(a) for a in g] for g in groups]
            dgrads = [cp.asarray(g) for g in grads]
            call(be, name, dev, dgrads if fused else dgrads[0], kw, fused=fused)
            for gi, (dg, wg) in enumerate(zip(dev, want)):
                for r, (a, b) in enumerate(zip(dg or (), wg or ())):
                    assert_bitwise(cp.asnumpy(a), b, f"cupy {name} fused={fused} {shape} group {gi} copy {r}")
            for x, h in zip(dgrads, grads):
                assert_bitwise(cp.asnumpy(x), h, "a gradient was written")


@given(
    lr=st.floats(1e-6, 10.0),
    beta_1=st.floats(0.0, 0.999),
    step=st.integers(1, 10_000),
)
def test_adam_lr_t_without_beta_2_is_the_first_moment_correction(lr, beta_1, step):
    """beta_2 = 0 is the step size of the rules that correct only m (Adamax): lr / (1 - beta_1**step), bit for bit."""
    assert bias_corrected_lr(lr, beta_1, 0.0, step) == lr / (1.0 - beta_1**step)
