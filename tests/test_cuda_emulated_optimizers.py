"""The CUDA kernels and C++ launchers of the rules' table (every row of CUDIST_UPDATE_RULE_LIST: a
rule, or one variant of a rule with optional slots), run on the CPU by the host emulation (tests/emu, see tests/test_cuda_emulated.py), bit for bit against the
NumPy reference: ``reduce_to_one(grads, SUM)`` then the reference's update.

Kernels are called in the pointer-table form CuPy launches (1..8 copies and gradients, several grid
shapes, aligned and offset buffers); launchers up to 17 copies and gradients (several passes; more
than 8 gradients go through a stream-ordered temporary that must be freed) in both their plain
(``adamw``) and fused (``all_reduce_adamw``) forms, and their argument validation.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from cudist._kernels import UPDATE_KERNELS, update_variants, bias_corrected_lr, momentum_schedule_step
from cudist._kernels._cuda_launch import parse_update_rules
from cudist._kernels._numpy import NumpyBackend

_BUILD_PY = Path(__file__).resolve().parent / "emu" / "build.py"
_spec = importlib.util.spec_from_file_location("cudist_tests_emu_build_opt", _BUILD_PY)
emu_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu_build)

pytestmark = pytest.mark.skipif(emu_build.compiler() is None, reason="needs a C++ compiler (c++ or g++)")

REF = NumpyBackend()
FLOATS = ("float16", "float32", "float64")
#: The kernels of the C++ table: its rows (each a variant of an UPDATE_KERNELS row, update_variants()).
OPTIMIZERS = tuple(parse_update_rules((Path(__file__).resolve().parents[1] / "csrc" / "include" / "cudist" / "detail"
                                       / "update_rules.hpp").read_text()))
THREADS = 256
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_INVALID_VALUE = 1


@pytest.fixture(scope="module")
def lib():
    return emu_build.load()


# ------------------------------------------------------------------------------------- helpers
def _empty(count, dtype, offset):
    """A 1-D array starting ``offset`` elements after a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty((count + offset) * dtype.itemsize + 64, dtype=np.uint8)
    skip = (-raw.ctypes.data) % 64 + offset * dtype.itemsize
    return raw[skip : skip + count * dtype.itemsize].view(dtype)


def _placed(v, offset):
    a = _empty(v.size, v.dtype, offset)
    a[...] = v
    return a


def _values(rng, count, dtype, kind):
    dtype = np.dtype(dtype)
    scale = 4.0 if dtype == np.float16 else 2.0 ** rng.integers(-8, 9, size=count)
    v = rng.uniform(-1.0, 1.0, size=count) * scale
    if kind == "positive":
        v = np.abs(v)
    v = v.astype(dtype)
    v[v == 0] = dtype.type(0.5)
    return v


def _case(rng, name, n, m, count, dtype, layout):
    """(gradients, groups): the variable's n copies and each slot's of variant ``name``, mirrored."""
    offsets = {"aligned": [0] * n, "offset": [1] * n, "last_offset": [0] * (n - 1) + [1]}[layout]
    goff = {"aligned": [0] * m, "offset": [1] * m, "last_offset": [0] * (m - 1) + [1]}[layout]
    grads = [_placed(_values(rng, count, dtype, "any"), o) for o in goff]
    values = [_values(rng, count, dtype, "any")]
    for s in update_variants()[name][1]:
        if s in ("velocity", "v", "v_hat", "accumulator", "u"):
            values.append(_values(rng, count, dtype, "positive"))
        elif s == "average_gradient":
            v = values[1].astype(np.float64)
            values.append((np.sqrt(v) * rng.uniform(-0.5, 0.5, size=count)).astype(dtype))
        else:
            values.append(_values(rng, count, dtype, "any"))
    return grads, [[_placed(v, o) for o in offsets] for v in values]


def _table(arrays):
    return (ctypes.c_void_p * max(1, len(arrays)))(*(a.ctypes.data for a in arrays))


def _assert_bits(got, want, what):
    if got.tobytes() != want.tobytes():
        u = f"u{got.itemsize}"
        bad = np.flatnonzero(got.view(u) != want.view(u))
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.size} of {got.size} differ; first [{i}]: got {got[i]!r}, want {want[i]!r}")


def _check(groups, want, what):
    for gi, (g, w) in enumerate(zip(groups, want)):
        if w is None:
            continue
        for r, (a, b) in enumerate(zip(g, w)):
            _assert_bits(a, b, f"{what} group {gi} copy {r}")


def _params(rng, name):
    """(public keyword arguments, the trusted hyper-parameters they make), as KernelBackend does."""
    name = update_variants()[name][0]
    lr, b1, b2 = float(rng.uniform(1e-3, 0.1)), float(rng.uniform(0.5, 0.99)), float(rng.uniform(0.9, 0.9999))
    eps, wd, step = float(rng.choice([1e-7, 1e-3])), float(rng.choice([0.0, 0.004, 0.1])), int(rng.integers(1, 40))
    if name in ("adamw", "amsgrad"):
        return (dict(lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=step, weight_decay=wd),
                (bias_corrected_lr(lr, b1, b2, step), b1, b2, eps, wd * lr))
    if name == "adamax":
        return (dict(lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=step, weight_decay=wd),
                (bias_corrected_lr(lr, b1, 0.0, step), b1, b2, eps, wd * lr))
    if name == "nadam":
        u = 1.0
        for t in range(1, step):
            u = momentum_schedule_step(b1, b2, t, u)[0]
        _, c_m, c_g, c_v = momentum_schedule_step(b1, b2, step, u)
        return (dict(lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=step, u_product=u, weight_decay=wd),
                (lr, b1, b2, eps, c_m, c_g, c_v, wd * lr))
    if name == "rmsprop":
        rho, mom = float(rng.uniform(0.5, 0.99)), float(rng.choice([0.0, 0.9]))
        return dict(lr=lr, rho=rho, momentum=mom, epsilon=eps, weight_decay=wd), (lr, rho, mom, eps, wd * lr)
    if name == "adagrad":
        return dict(lr=lr, epsilon=eps, weight_decay=wd), (lr, eps, wd * lr)
    if name == "sgd":
        return dict(lr=lr, weight_decay=wd), (lr, wd * lr)
    if name in ("momentum", "nesterov"):
        mom = float(rng.uniform(0.5, 0.99))
        return dict(lr=lr, momentum=mom, weight_decay=wd), (lr, mom, wd * lr)
    return dict(lr=lr, beta_1=b1, beta_2=b2, weight_decay=wd), (lr, b1, b2, wd * lr)


def _kernel(lib, name, dtype):
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    C = ctypes.c_double if dtype == "float64" else ctypes.c_float
    _, slots, hyper = update_variants()[name]
    params = (P,) * (1 + len(slots)) + (I, P, I) + (C,) * len(hyper) + (L,)
    fn = getattr(lib, f"cudist_emu_mirrored_all_reduce_{name}_{dtype}")
    fn.argtypes = (ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, *params)
    fn.restype = None
    return fn


def _launcher(lib, name, dtype, fused):
    P, I, L, D = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_double
    _, slots, hyper = update_variants()[name]
    params = (P,) * (1 + len(slots)) + ((I, P, I) if fused else (I, P)) + (D,) * len(hyper) + (L, P)
    fn = getattr(lib, f"cudist_emu_launch_{'all_reduce_' if fused else ''}{name}_{dtype}")
    fn.argtypes = params
    fn.restype = ctypes.c_int
    return fn


def _want(name, groups, grads, kw):
    """The reference's update of variant ``name``: its row's public method, the absent slots None."""
    row, kept, _ = update_variants()[name]
    want = [[a.copy() for a in g] for g in groups]
    given = iter(want[1:])
    slots = [next(given) if s in kept else None for s in UPDATE_KERNELS[row][0]]
    g = REF.reduce_to_one([x.copy() for x in grads], "sum")
    getattr(REF, row)(want[0], *slots, g, **kw)
    return want


# ------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_kernel_matches_reference(lib, name, dtype):
    rng = np.random.default_rng(hash((name, dtype)) % 2**32)
    fn = _kernel(lib, name, dtype)
    item = np.dtype(dtype).itemsize
    for n in (1, 3, 8):
        for m in (1, 4, 8):
            for count in (0, 1, 7, 165):
                for layout in ("aligned", "offset", "last_offset"):
                    if layout == "last_offset" and n == 1:
                        continue
                    blocks = max(1, min(-(-(-(-count * item // 16)) // THREADS), 132 * 8))
                    for gx, bx in ((3, 5), (blocks, THREADS)):
                        kw, hyper = _params(rng, name)
                        grads, groups = _case(rng, name, n, m, count, dtype, layout)
                        what = f"{name} {dtype} n={n} m={m} count={count} {layout} grid={gx}x{bx}"
                        want = _want(name, groups, grads, kw) if count else groups
                        tables = [_table(g) for g in groups]
                        fn(gx, 1, bx, *tables, n, _table(grads), m, *hyper, count)
                        _check(groups, want, what)


# ------------------------------------------------------------------------------------- launchers
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_launchers_match_reference(lib, name, dtype):
    rng = np.random.default_rng(hash((name, dtype, "launch")) % 2**32)
    plain, fused = _launcher(lib, name, dtype, False), _launcher(lib, name, dtype, True)
    live = lib.cudist_emu_async_allocations
    live.restype = ctypes.c_longlong
    before = live()
    for n in (1, 3, 9, 17):
        for m in (1, 3, 9, 17):
            for count in (0, 7, 165):
                for layout in ("aligned", "offset"):
                    kw, hyper = _params(rng, name)
                    grads, groups = _case(rng, name, n, m, count, dtype, layout)
                    what = f"launch all_reduce_{name} {dtype} n={n} m={m} count={count} {layout}"
                    want = _want(name, groups, grads, kw)
                    tables = [_table(g) for g in groups]
                    rc = fused(*tables, n, _table(grads), m, *hyper, count, None)
                    if dtype == "float16" and m > 8 and count > 0:
                        # float16 sums over more than 8 gradients would round between passes: refused.
                        assert rc == CUDA_ERROR_NOT_SUPPORTED, what
                        continue
                    assert rc == CUDA_SUCCESS, what
                    _check(groups, want, what)
                    if m == 1:
                        want = _want(name, groups, grads, kw)
                        rc = plain(*tables, n, ctypes.c_void_p(grads[0].ctypes.data), *hyper, count, None)
                        assert rc == CUDA_SUCCESS
                        _check(groups, want, f"launch {name} {dtype} n={n} count={count} {layout}")
    assert live() == before, "a launcher left a cudaMallocAsync temporary behind"
    assert lib.cudist_emu_get_last_error() == CUDA_SUCCESS


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_launchers_reject_bad_arguments(lib, name):
    rng = np.random.default_rng(5)
    count, n = 33, 2
    grads, groups = _case(rng, name, n, 1, count, "float32", "aligned")
    orig = [[a.copy() for a in g] for g in groups]
    tables = [_table(g) for g in groups]
    _, hyper = _params(rng, name)
    plain, fused = _launcher(lib, name, "float32", False), _launcher(lib, name, "float32", True)
    gt = _table(grads)
    g0 = ctypes.c_void_p(grads[0].ctypes.data)
    bad = {
        "null copies": lambda: fused(None, *tables[1:], n, gt, 1, *hyper, count, None),
        "n=0": lambda: fused(*tables, 0, gt, 1, *hyper, count, None),
        "null grads": lambda: fused(*tables, n, None, 1, *hyper, count, None),
        "m=0": lambda: fused(*tables, n, gt, 0, *hyper, count, None),
        "count=-1": lambda: fused(*tables, n, gt, 1, *hyper, -1, None),
        "plain null grad": lambda: plain(*tables, n, None, *hyper, count, None),
    }
    if len(tables) > 1:  # a rule with slots (plain gradient descent has none)
        bad["null first slot"] = lambda: fused(tables[0], None, *tables[2:], n, gt, 1, *hyper, count, None)
    for what, call in bad.items():
        assert call() == CUDA_ERROR_INVALID_VALUE, what
        _check(groups, orig, f"{name} {what}: written")
    assert plain(*tables, n, g0, *hyper, count, None) == CUDA_SUCCESS
    assert lib.cudist_emu_get_last_error() == CUDA_SUCCESS
