"""cudist's CUDA kernels and C++ launchers, run on the CPU by the host emulation in tests/emu.

The real ``<cudist/kernels/*.cuh>`` and ``<cudist/cuda/launch_impl.cuh>`` are compiled by the system
C++ compiler against fake CUDA headers (tests/emu/include) that run every thread of a launch in
turn; the results must equal the NumPy reference backend bit for bit. Kernels are called in the
pointer-table form CuPy launches, over several grid shapes (one thread; fewer threads than
elements; the cupy backend's grid), with 16-byte aligned buffers (vector path plus scalar tail) and
with buffers offset by one element (scalar path). Launchers are checked up to 11 replicas (several
passes of at most 8) and for their argument validation. Needs only a C++ compiler.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from pathlib import Path

import ml_dtypes  # noqa: F401 - a test dependency: np.dtype("bfloat16") is then the kernels' bfloat16
import numpy as np
import pytest

import cudist
from cudist._kernels._base import bias_corrected_lr
from cudist._kernels._cuda_launch import kernel_list
from cudist._kernels._numpy import NumpyBackend
from cudist._kernels._split import split_sizes
from cudist._reduce_util import ReduceOp

_BUILD_PY = Path(__file__).resolve().parent / "emu" / "build.py"
_spec = importlib.util.spec_from_file_location("cudist_tests_emu_build", _BUILD_PY)
emu_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu_build)

pytestmark = pytest.mark.skipif(emu_build.compiler() is None, reason="needs a C++ compiler (c++ or g++)")



# The cupy backend's KERNELS: the kernel list of <cudist/kernels/kernel_list.cuh>.
KERNELS = kernel_list(cudist.get_include())
REF = NumpyBackend()
#: bfloat16 (ml_dtypes, a test dependency): the collectives, scatter and assign_add, no updates.
DTYPES = ("float16", "float32", "float64", "int32", "int64", "bfloat16")
HALVES = ("float16", "bfloat16")  # summed in float32, rounded once
FLOATS = ("float16", "float32", "float64")
SIZES = (0, 1, 7, 165, 1031)
KERNEL_REPLICAS = (1, 2, 3, 5, 8)
LAUNCH_REPLICAS = (1, 2, 3, 5, 8, 9, 11, 17)  # 9..15: two passes of at most 8; 17: three
MAX_REPLICAS = 8
THREADS = 256  # threads per block of the cupy backend and the launchers
# cudaError_t values the launchers return.
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_SUPPORTED = 801


def _launch_rc(dtype, n, count):
    """What a launcher summing ``n`` buffers returns: float16 / bfloat16 sums over more than
    MAX_REPLICAS buffers are refused (they would round at every pass; the contract rounds once)."""
    return CUDA_ERROR_NOT_SUPPORTED if dtype in HALVES and n > MAX_REPLICAS and count > 0 else CUDA_SUCCESS
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_INVALID_CONFIGURATION = 9
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705
# Buffer layouts: all 16-byte aligned (vector path + tail), every buffer one element off a 16-byte
# boundary (scalar path), or only the last one off (the kernel must notice and go scalar).
LAYOUTS = ("aligned", "offset", "last_offset")


@pytest.fixture(scope="module")
def lib():
    """The emulation library, built (or found in the cache) once per module."""
    return emu_build.load()


# ------------------------------------------------------------------------------------- helpers
def _cupy_grid(count: int, itemsize: int) -> int:
    """Blocks the cupy backend launches (CupyBackend._grid on a 132-SM GPU)."""
    groups = -(-count * itemsize // 16)
    return max(1, min(-(-groups // THREADS), 132 * 8))


def _grids(count: int, itemsize: int):
    """(blocks, threads per block): one thread; fewer threads than elements; the cupy backend's."""
    return ((1, 1), (3, 5), (_cupy_grid(count, itemsize), THREADS))


def _empty(count: int, dtype, offset: int) -> np.ndarray:
    """A 1-D array whose data starts `offset` elements after a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty((count + offset) * dtype.itemsize + 64, dtype=np.uint8)
    skip = (-raw.ctypes.data) % 64 + offset * dtype.itemsize
    a = raw[skip : skip + count * dtype.itemsize].view(dtype)
    assert count == 0 or a.ctypes.data % 16 == (offset * dtype.itemsize) % 16
    return a


def _random(rng, count: int, dtype, *, offset: int = 0, positive: bool = False) -> np.ndarray:
    """Random nonzero data: floats with full mantissas over several binades, integers over the
    whole range (so that sums wrap around)."""
    dtype = np.dtype(dtype)
    a = _empty(count, dtype, offset)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        scale = 4.0 if dtype == np.float16 else 2.0 ** rng.integers(-8, 9, size=count)
        v = rng.uniform(-1.0, 1.0, size=count) * scale
        if positive:
            v = np.abs(v)
        v = v.astype(dtype)
        v[v == 0] = dtype.type(0.5)
    else:
        info = np.iinfo(dtype)
        v = rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
        v[v == 0] = 1
    a[...] = v
    return a


def _buffers(rng, n: int, count: int, dtype, layout: str, **kw) -> list[np.ndarray]:
    offsets = {
        "aligned": [0] * n,
        "offset": [1] * n,
        "last_offset": [0] * (n - 1) + [1],
    }[layout]
    return [_random(rng, count, dtype, offset=o, **kw) for o in offsets]


def _like(arrays, layout: str = "aligned", last: bool = True) -> list[np.ndarray]:
    """Copies of `arrays` laid out like `layout`."""
    n = len(arrays)
    out = []
    for i, a in enumerate(arrays):
        off = 1 if layout == "offset" or (layout == "last_offset" and last and i == n - 1) else 0
        b = _empty(a.size, a.dtype, off)
        b[...] = a
        out.append(b)
    return out


def _table(arrays) -> ctypes.Array:
    """A host array of the arrays' data pointers (the kernels' `T* const*`)."""
    return (ctypes.c_void_p * max(1, len(arrays)))(*(a.ctypes.data for a in arrays))


def _ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


def _assert_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.tobytes() != want.tobytes():
        g = got.view(f"u{got.itemsize}")
        w = want.view(f"u{want.itemsize}")
        bad = np.flatnonzero(g != w)
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.size} of {got.size} elements differ; first at [{i}]: got {got[i]!r}, want {want[i]!r}"
        )


def _compute(dtype: str):
    return ctypes.c_double if dtype == "float64" else ctypes.c_float


def _kernel(lib, name: str, dtype: str):
    if name in ("mirrored_adam", "mirrored_all_reduce_adam"):
        return _adam_kernel(lib, name, dtype)
    """The emulated kernel entry point with its ctypes signature."""
    P, I, L, C = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, _compute(dtype)
    params = {
        "all_reduce_one_shot": (P, I, P, I, L, I),
        "reduce_scatter": (P, I, L, L, L, I),
        "all_gather_chunks": (P, I, L, L, L),
        "broadcast": (P, P, I, L),
        "scatter_batch": (P, P, I, L, L),
        "mirrored_assign_add": (P, I, P, L, I),
        "mirrored_all_reduce_sgd": (P, I, P, I, C, C, L),
        "mirrored_all_reduce_momentum": (P, P, I, P, I, C, C, C, L),
        "mirrored_all_reduce_nesterov": (P, P, I, P, I, C, C, C, L),
        "mirrored_all_reduce_adamw": (P, P, P, I, P, I, C, C, C, C, C, L),
    }[name]
    fn = getattr(lib, f"cudist_emu_{name}_{dtype}")
    fn.argtypes = (ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, *params)
    fn.restype = None
    return fn


def _launcher(lib, name: str, dtype: str):
    if name in ("adam", "all_reduce_adam"):
        return _adam_launcher(lib, name, dtype)
    """The emulated C++ launcher (cudist::cuda::<name><T>) with its ctypes signature."""
    P, I, L, D = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_double
    params = {
        "all_reduce": (P, I, L, I, P),
        "all_reduce_two_shot": (P, I, L, I, P),
        "reduce_to_one": (P, I, P, L, I, P),
        "broadcast": (P, P, I, L, P),
        "scatter_batch": (P, P, I, L, L, P),
        "assign_add": (P, I, P, L, I, P),
        "sgd": (P, I, P, D, D, L, P),
        "momentum": (P, P, I, P, D, D, D, L, P),
        "nesterov": (P, P, I, P, D, D, D, L, P),
        "all_reduce_into": (P, P, I, L, I, P),
        "all_reduce_sgd": (P, I, P, I, D, D, L, P),
        "all_reduce_momentum": (P, P, I, P, I, D, D, D, L, P),
        "all_reduce_nesterov": (P, P, I, P, I, D, D, D, L, P),
        "adamw": (P, P, P, I, P, D, D, D, D, D, L, P),
        "all_reduce_adamw": (P, P, P, I, P, I, D, D, D, D, D, L, P),
        "reduce_unscale_finite": (P, I, P, L, D, P, P),
    }[name]
    fn = getattr(lib, f"cudist_emu_launch_{name}_{dtype}")
    fn.argtypes = params
    fn.restype = ctypes.c_int
    return fn


def _adam_kernel(lib, name: str, dtype: str):
    """Adam's kernel as the tests below call it (plain: one gradient; fused: the gradient table):
    the adamw row's kernel with the weight decay 0 (Keras 3's Adam is that row)."""
    fn = _kernel(lib, "mirrored_all_reduce_adamw", dtype)
    if name == "mirrored_all_reduce_adam":
        return lambda gx, gy, bx, *args: fn(gx, gy, bx, *args[:-1], 0.0, args[-1])

    def plain(gx, gy, bx, copies, ms, vs, n, grad, lr_t, b1, b2, eps, count):
        return fn(gx, gy, bx, copies, ms, vs, n, _table_of_ptrs([grad]), 1, lr_t, b1, b2, eps, 0.0, count)

    return plain


def _adam_launcher(lib, name: str, dtype: str):
    """Adam's launchers as the tests below call them: the adamw row's with the weight decay 0."""
    fn = _launcher(lib, name + "w", dtype)
    return lambda *args: fn(*args[:-2], 0.0, *args[-2:])


def _table_of_ptrs(ptrs):
    """A device pointer table of raw pointers (ctypes.c_void_p or ints)."""
    vals = [p.value if isinstance(p, ctypes.c_void_p) else p for p in ptrs]
    return (ctypes.c_void_p * len(vals))(*vals)


def _cases(replicas, layouts=LAYOUTS, sizes=SIZES):
    """(n, count, layout) combinations; single-buffer layouts skip the redundant last_offset."""
    for n in replicas:
        for count in sizes:
            for layout in layouts:
                if layout == "last_offset" and n == 1:
                    continue
                yield n, count, layout


# ------------------------------------------------------------------------------------- library
def test_every_kernel_and_launcher_has_an_entry_point(lib):
    """One entry point per (kernel, dtype) of the cupy backend's KERNELS and per (launcher, dtype)."""
    for kernel, dtypes in KERNELS.items():
        for dt in dtypes:
            assert hasattr(lib, f"cudist_emu_{kernel}_{dt}"), (kernel, dt)
    for launcher in ("all_reduce", "all_reduce_into", "all_reduce_two_shot", "reduce_to_one", "broadcast",
                     "scatter_batch", "assign_add"):
        for dt in DTYPES:
            assert hasattr(lib, f"cudist_emu_launch_{launcher}_{dt}"), (launcher, dt)
    for launcher in ("sgd", "momentum", "nesterov", "adamw", "all_reduce_sgd", "all_reduce_momentum",
                     "all_reduce_nesterov", "all_reduce_adamw"):
        for dt in FLOATS:
            assert hasattr(lib, f"cudist_emu_launch_{launcher}_{dt}"), (launcher, dt)


def test_library_is_cached_by_source_hash():
    path = emu_build.library_path()
    assert path.is_file() and path.parent.name.startswith("cudist-emu-")
    assert emu_build.library_path() == path  # no rebuild for unchanged sources
    ours = {_BUILD_PY.with_name("emu_kernels.cpp"), _BUILD_PY.with_name("emu_launchers.cpp")}
    assert ours <= set(emu_build.sources())


def test_compile_error_raises_runtime_error_with_compiler_output(tmp_path, monkeypatch):
    (tmp_path / "broken.cpp").write_text("int cudist_emu_broken() { return undeclared_name; }\n")
    monkeypatch.setattr(emu_build, "EMU_DIR", tmp_path)
    with pytest.raises(RuntimeError, match="(?s)building the CUDA emulation failed.*undeclared_name"):
        emu_build.library_path()


def test_integer_sums_wrap_around(lib):
    """SUM in the buffer dtype: int32/int64 overflow wraps (two's complement), as NumPy's does."""
    for dtype in ("int32", "int64"):
        info = np.iinfo(dtype)
        a = np.array([info.max, info.min, info.max, -1], dtype=dtype)
        b = np.array([1, -1, info.max, info.min], dtype=dtype)
        fn = _kernel(lib, "all_reduce_one_shot", dtype)
        fn(1, 1, THREADS, _table([a, b]), 2, _table([a, b]), 2, a.size, 0)
        want = np.array([info.min, info.max, -2, info.max], dtype=dtype)
        _assert_bits(a, want, f"{dtype} wrap-around")
        _assert_bits(b, want, f"{dtype} wrap-around")


def test_bad_launch_configuration_sets_the_last_error(lib):
    a = np.arange(1, 9, dtype=np.float32)
    fn = _kernel(lib, "broadcast", "float32")
    dst = a.copy()
    assert lib.cudist_emu_get_last_error() == CUDA_SUCCESS
    for gx, bx in ((0, 32), (1, 0), (1, 1025)):
        dst[...] = 7
        fn(gx, 1, bx, _ptr(a), _table([dst]), 1, a.size)
        assert (dst == 7).all(), "a launch with a bad configuration must run nothing"
        assert lib.cudist_emu_get_last_error() == CUDA_ERROR_INVALID_CONFIGURATION
        assert lib.cudist_emu_get_last_error() == CUDA_SUCCESS  # read and cleared


def test_emulated_runtime_devices_and_peer_access(lib, monkeypatch):
    monkeypatch.setenv("CUDIST_EMU_DEVICES", "3")
    lib.cudist_emu_reset()
    try:
        assert lib.cudist_emu_device_count() == 3
        assert lib.cudist_emu_set_device(3) == CUDA_ERROR_INVALID_DEVICE
        assert lib.cudist_emu_set_device(-1) == CUDA_ERROR_INVALID_DEVICE
        can = ctypes.c_int(-1)
        assert lib.cudist_emu_device_can_access_peer(ctypes.byref(can), 0, 2) == CUDA_SUCCESS and can.value == 1
        assert lib.cudist_emu_device_can_access_peer(ctypes.byref(can), 1, 1) == CUDA_SUCCESS and can.value == 0
        assert lib.cudist_emu_device_can_access_peer(ctypes.byref(can), 0, 3) == CUDA_ERROR_INVALID_DEVICE
        assert lib.cudist_emu_set_device(1) == CUDA_SUCCESS and lib.cudist_emu_get_device() == 1
        assert lib.cudist_emu_peer_enabled(1, 2) == 0
        assert lib.cudist_emu_device_enable_peer_access(2, 0) == CUDA_SUCCESS
        assert lib.cudist_emu_peer_enabled(1, 2) == 1 and lib.cudist_emu_peer_enabled(2, 1) == 0
        assert lib.cudist_emu_device_enable_peer_access(2, 0) == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        assert lib.cudist_emu_device_enable_peer_access(1, 0) == CUDA_ERROR_INVALID_DEVICE  # itself
        assert lib.cudist_emu_device_enable_peer_access(5, 0) == CUDA_ERROR_INVALID_DEVICE
        assert lib.cudist_emu_device_enable_peer_access(0, 1) == CUDA_ERROR_INVALID_VALUE  # flags must be 0
        assert lib.cudist_emu_get_last_error() == CUDA_ERROR_INVALID_VALUE
        assert lib.cudist_emu_device_disable_peer_access(2) == CUDA_SUCCESS
        assert lib.cudist_emu_device_disable_peer_access(2) == CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
        # The current device is per host thread.
        seen = []
        t = threading.Thread(target=lambda: seen.append((lib.cudist_emu_get_device(), lib.cudist_emu_set_device(2))))
        t.start()
        t.join()
        assert seen == [(0, CUDA_SUCCESS)] and lib.cudist_emu_get_device() == 1
    finally:
        lib.cudist_emu_reset()


# ------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_one_shot_kernel(lib, dtype):
    """In place over all buffers (all-reduce) and into a separate output (reduce-to-one), SUM and MEAN."""
    rng = np.random.default_rng(1)
    fn = _kernel(lib, "all_reduce_one_shot", dtype)
    item = np.dtype(dtype).itemsize
    for n, count, layout in _cases(KERNEL_REPLICAS):
        for op, divisor in ((ReduceOp.SUM, 0), (ReduceOp.MEAN, n)):
            for gx, bx in _grids(count, item):
                what = f"{dtype} n={n} count={count} {layout} {op.name} grid={gx}x{bx}"
                bufs = _buffers(rng, n, count, dtype, layout)
                want = [b.copy() for b in bufs]
                REF.all_reduce(want, op)
                t = _table(bufs)
                fn(gx, 1, bx, t, n, t, n, count, divisor)
                for r in range(n):
                    _assert_bits(bufs[r], want[r], f"all-reduce {what} replica {r}")
                # Reduce-to-one into a separate output, then into input 0 (aliasing).
                bufs = _buffers(rng, n, count, dtype, layout)
                orig = [b.copy() for b in bufs]
                want = REF.reduce_to_one(orig, op)
                out = _like([bufs[-1]], layout)[0]
                fn(gx, 1, bx, _table(bufs), n, _table([out]), 1, count, divisor)
                _assert_bits(out, want, f"reduce-to-one {what}")
                for r in range(n):
                    _assert_bits(bufs[r], orig[r], f"reduce-to-one {what}: input {r} modified")
                fn(gx, 1, bx, _table(bufs), n, _table(bufs[:1]), 1, count, divisor)
                _assert_bits(bufs[0], want, f"reduce-to-one {what} into input 0")


def _two_shot_ranges(n: int, count: int, width: int):
    """Per-owner [begin, end) ranges and the chunk, as CupyBackend._all_reduce_two_shot cuts them."""
    chunk = -(-count // n)
    chunk = -(-chunk // width) * width
    ranges = []
    for r in range(n):
        begin, end = min(r * chunk, count), (count if r == n - 1 else min((r + 1) * chunk, count))
        ranges.append((begin, end))
    return chunk, ranges


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_shot_kernels(lib, dtype):
    """reduce_scatter then all_gather_chunks per owner range: phase 1 writes each reduced chunk into
    its owner's buffer only; after phase 2 every buffer holds the all-reduce."""
    rng = np.random.default_rng(2)
    scatter = _kernel(lib, "reduce_scatter", dtype)
    gather = _kernel(lib, "all_gather_chunks", dtype)
    item = np.dtype(dtype).itemsize
    width = 16 // item
    for n, count, layout in _cases(KERNEL_REPLICAS):
        for op in (ReduceOp.SUM, ReduceOp.MEAN):
            divisor = n if op is ReduceOp.MEAN else 0
            chunk, ranges = _two_shot_ranges(n, count, width)
            for gx, bx in _grids(count, item):
                what = f"{dtype} n={n} count={count} {layout} {op.name} grid={gx}x{bx}"
                bufs = _buffers(rng, n, count, dtype, layout)
                orig = [b.copy() for b in bufs]
                want = REF.reduce_to_one(orig, op)
                t = _table(bufs)
                for begin, end in ranges:
                    if begin < end:
                        scatter(gx, 1, bx, t, n, chunk, begin, end, divisor)
                for r in range(n):
                    begin, end = ranges[r]
                    expect = orig[r].copy()
                    expect[begin:end] = want[begin:end]
                    _assert_bits(bufs[r], expect, f"reduce-scatter {what} replica {r}")
                for begin, end in ranges:
                    if begin < end:
                        gather(gx, 1, bx, t, n, chunk, begin, end)
                for r in range(n):
                    _assert_bits(bufs[r], want, f"all-gather {what} replica {r}")
                # The launcher's form: one range over everything per phase.
                bufs = _like(orig, layout)
                t = _table(bufs)
                scatter(gx, 1, bx, t, n, chunk, 0, count, divisor)
                gather(gx, 1, bx, t, n, chunk, 0, count)
                for r in range(n):
                    _assert_bits(bufs[r], want, f"two-shot (whole range) {what} replica {r}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_kernel(lib, dtype):
    rng = np.random.default_rng(3)
    fn = _kernel(lib, "broadcast", dtype)
    item = np.dtype(dtype).itemsize
    for n, count, layout in _cases(KERNEL_REPLICAS):
        for gx, bx in _grids(count, item):
            what = f"{dtype} n={n} count={count} {layout} grid={gx}x{bx}"
            src = _random(rng, count, dtype, offset=1 if layout == "offset" else 0)
            dsts = _buffers(rng, n, count, dtype, layout)
            fn(gx, 1, bx, _ptr(src), _table(dsts), n, count)
            for r in range(n):
                _assert_bits(dsts[r], src, f"broadcast {what} destination {r}")
            # A destination that is the source itself (exact aliasing) is harmless.
            dsts = _buffers(rng, n, count, dtype, layout)
            want = dsts[0].copy()
            fn(gx, 1, bx, _ptr(dsts[0]), _table(dsts), n, count)
            for r in range(n):
                _assert_bits(dsts[r], want, f"broadcast from destination 0 {what} destination {r}")


# (batch, row elements): ceil splits with a short last piece, empty last replicas, an empty batch.
SCATTER_SHAPES = ((0, 3), (1, 1), (5, 1), (7, 3), (13, 5), (165, 1), (103, 10))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_batch_kernel(lib, dtype):
    """One launch with grid (x, n), as CupyBackend._scatter_leaf does it, against the ceil split."""
    rng = np.random.default_rng(4)
    fn = _kernel(lib, "scatter_batch", dtype)
    item = np.dtype(dtype).itemsize
    for n in KERNEL_REPLICAS:
        for batch, row in SCATTER_SHAPES:
            for layout in ("aligned", "offset"):
                total = batch * row
                src = _random(rng, total, dtype, offset=1 if layout == "offset" else 0)
                want = REF.split(src.reshape(batch, row), n)
                sizes = split_sizes(batch, n)
                assert [w.shape[0] for w in want] == sizes
                per = sizes[0] * row
                for gx, bx in _grids(per, item):
                    what = f"{dtype} n={n} batch={batch}x{row} {layout} grid={gx}x{bx}x{n}"
                    outs = [_random(rng, s * row, dtype, offset=1 if layout == "offset" else 0) for s in sizes]
                    if total:
                        fn(gx, n, bx, _ptr(src), _table(outs), n, per, total)
                    for r in range(n):
                        _assert_bits(outs[r], want[r].ravel(), f"scatter {what} replica {r}")


def _fresh_mirrors(rng, n, count, dtype, layout, *, positive=False):
    """n copies of a variable (or slot): copy 0 is the value, the others random garbage that the
    update must overwrite."""
    return _buffers(rng, n, count, dtype, layout, positive=positive)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mirrored_assign_add_kernel(lib, dtype):
    rng = np.random.default_rng(5)
    fn = _kernel(lib, "mirrored_assign_add", dtype)
    item = np.dtype(dtype).itemsize
    for n, count, layout in _cases(KERNEL_REPLICAS):
        for negate in (0, 1):
            for gx, bx in _grids(count, item):
                what = f"{dtype} n={n} count={count} {layout} negate={negate} grid={gx}x{bx}"
                copies = _fresh_mirrors(rng, n, count, dtype, layout)
                value = _random(rng, count, dtype, offset=1 if layout == "offset" else 0)
                want = [c.copy() for c in copies]
                (REF.assign_sub if negate else REF.assign_add)(want, value)
                fn(gx, 1, bx, _table(copies), n, _ptr(value), count, negate)
                for r in range(n):
                    _assert_bits(copies[r], want[r], f"assign_add {what} copy {r}")


@pytest.mark.parametrize("dtype", FLOATS)
def test_mirrored_adam_kernel(lib, dtype):
    rng = np.random.default_rng(8)
    fn = _kernel(lib, "mirrored_adam", dtype)
    item = np.dtype(dtype).itemsize
    for n, count, layout in _cases(KERNEL_REPLICAS):
        lr, b1, b2, eps = float(rng.uniform(1e-3, 0.1)), 0.9, 0.999, 1e-7
        step = int(rng.integers(1, 50))
        lr_t = bias_corrected_lr(lr, b1, b2, step)  # what NumpyBackend.adam passes to its _adam
        for gx, bx in _grids(count, item):
            what = f"{dtype} n={n} count={count} {layout} step={step} grid={gx}x{bx}"
            copies = _fresh_mirrors(rng, n, count, dtype, layout)
            ms = _fresh_mirrors(rng, n, count, dtype, layout)
            vs = _fresh_mirrors(rng, n, count, dtype, layout, positive=True)
            grad = _random(rng, count, dtype, offset=1 if layout == "offset" else 0)
            want = [[a.copy() for a in group] for group in (copies, ms, vs)]
            REF.adam(*want, grad, lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=step)
            fn(gx, 1, bx, _table(copies), _table(ms), _table(vs), n, _ptr(grad), lr_t, b1, b2, eps, count)
            for name, got, exp in zip(("copy", "m", "v"), (copies, ms, vs), want):
                for r in range(n):
                    _assert_bits(got[r], exp[r], f"adam {what} {name} {r}")


# ------------------------------------------------------------------------------------- launchers
LAUNCH_LAYOUTS = ("aligned", "offset")


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_launchers(lib, dtype):
    """all_reduce (one pass, or several above 8 replicas) and all_reduce_two_shot, in place."""
    rng = np.random.default_rng(9)
    fns = {name: _launcher(lib, name, dtype) for name in ("all_reduce", "all_reduce_two_shot")}
    for n, count, layout in _cases(LAUNCH_REPLICAS, LAUNCH_LAYOUTS):
        for op in (ReduceOp.SUM, ReduceOp.MEAN):
            bufs0 = _buffers(rng, n, count, dtype, layout)
            want = [b.copy() for b in bufs0]
            REF.all_reduce(want, op)
            for name, fn in fns.items():
                bufs = _like(bufs0, layout)
                rc = fn(_table(bufs), n, count, int(op is ReduceOp.MEAN), None)
                assert rc == _launch_rc(dtype, n, count)
                if rc != CUDA_SUCCESS:
                    continue
                for r in range(n):
                    _assert_bits(bufs[r], want[r], f"{name} {dtype} n={n} count={count} {layout} {op.name} replica {r}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_to_one_launcher(lib, dtype):
    """Into a separate output, into input 0 and into input 7 (allowed: consumed by the first pass)."""
    rng = np.random.default_rng(10)
    fn = _launcher(lib, "reduce_to_one", dtype)
    for n, count, layout in _cases(LAUNCH_REPLICAS, LAUNCH_LAYOUTS):
        for op in (ReduceOp.SUM, ReduceOp.MEAN):
            bufs0 = _buffers(rng, n, count, dtype, layout)
            want = REF.reduce_to_one([b.copy() for b in bufs0], op)
            what = f"{dtype} n={n} count={count} {layout} {op.name}"
            bufs = _like(bufs0, layout)
            out = _like([bufs0[0]], layout)[0]
            rc = fn(_table(bufs), n, _ptr(out), count, int(op is ReduceOp.MEAN), None)
            assert rc == _launch_rc(dtype, n, count)
            if rc != CUDA_SUCCESS:
                continue
            _assert_bits(out, want, f"reduce_to_one {what}")
            for r in range(n):
                _assert_bits(bufs[r], bufs0[r], f"reduce_to_one {what}: input {r} modified")
            for alias in sorted({0, min(n, MAX_REPLICAS) - 1}):
                bufs = _like(bufs0, layout)
                rc = fn(_table(bufs), n, _ptr(bufs[alias]), count, int(op is ReduceOp.MEAN), None)
                assert rc == CUDA_SUCCESS
                _assert_bits(bufs[alias], want, f"reduce_to_one {what} into input {alias}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_launcher(lib, dtype):
    rng = np.random.default_rng(11)
    fn = _launcher(lib, "broadcast", dtype)
    for n, count, layout in _cases(LAUNCH_REPLICAS, LAUNCH_LAYOUTS):
        src = _random(rng, count, dtype, offset=1 if layout == "offset" else 0)
        dsts = _buffers(rng, n, count, dtype, layout)
        assert fn(_ptr(src), _table(dsts), n, count, None) == CUDA_SUCCESS
        for r in range(n):
            _assert_bits(dsts[r], src, f"broadcast {dtype} n={n} count={count} {layout} destination {r}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_batch_launcher(lib, dtype):
    rng = np.random.default_rng(12)
    fn = _launcher(lib, "scatter_batch", dtype)
    for n in LAUNCH_REPLICAS:
        for batch, row in SCATTER_SHAPES + ((9, 2), (17, 3)):
            for layout in LAUNCH_LAYOUTS:
                off = 1 if layout == "offset" else 0
                src = _random(rng, batch * row, dtype, offset=off)
                want = REF.split(src.reshape(batch, row), n)
                outs = [_random(rng, w.size, dtype, offset=off) for w in want]
                assert fn(_ptr(src), _table(outs), n, batch, row, None) == CUDA_SUCCESS
                for r in range(n):
                    what = f"scatter_batch {dtype} n={n} batch={batch}x{row} {layout} replica {r}"
                    _assert_bits(outs[r], want[r].ravel(), what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mirrored_update_launchers(lib, dtype):
    """assign_add (+/-), and for floats sgd, momentum (plain and nesterov) and adam, on up to 11 copies."""
    rng = np.random.default_rng(13)
    is_float = dtype in FLOATS
    assign_add = _launcher(lib, "assign_add", dtype)
    if is_float:
        sgd, adam = (_launcher(lib, name, dtype) for name in ("sgd", "adam"))
        moms = {False: _launcher(lib, "momentum", dtype), True: _launcher(lib, "nesterov", dtype)}
    for n, count, layout in _cases(LAUNCH_REPLICAS, LAUNCH_LAYOUTS):
        off = 1 if layout == "offset" else 0
        what = f"{dtype} n={n} count={count} {layout}"
        grad = _random(rng, count, dtype, offset=off)
        for negate in (0, 1):
            copies = _fresh_mirrors(rng, n, count, dtype, layout)
            want = [c.copy() for c in copies]
            (REF.assign_sub if negate else REF.assign_add)(want, grad)
            assert assign_add(_table(copies), n, _ptr(grad), count, negate, None) == CUDA_SUCCESS
            for r in range(n):
                _assert_bits(copies[r], want[r], f"assign_add negate={negate} {what} copy {r}")
        if not is_float:
            continue
        lr = float(rng.uniform(1e-3, 0.5))
        copies = _fresh_mirrors(rng, n, count, dtype, layout)
        want = [c.copy() for c in copies]
        REF.sgd(want, grad, lr=lr)
        assert sgd(_table(copies), n, _ptr(grad), lr, 0.0, count, None) == CUDA_SUCCESS
        for r in range(n):
            _assert_bits(copies[r], want[r], f"sgd {what} copy {r}")
        for nesterov in (False, True):
            mom = float(rng.uniform(0.5, 0.99))
            copies = _fresh_mirrors(rng, n, count, dtype, layout)
            vels = _fresh_mirrors(rng, n, count, dtype, layout)
            want_w, want_v = [c.copy() for c in copies], [v.copy() for v in vels]
            REF.momentum(want_w, want_v, grad, lr=lr, momentum=mom, nesterov=nesterov)
            rc = moms[nesterov](_table(copies), _table(vels), n, _ptr(grad), lr, mom, 0.0, count, None)
            assert rc == CUDA_SUCCESS
            for r in range(n):
                _assert_bits(vels[r], want_v[r], f"momentum nesterov={nesterov} {what} velocity {r}")
                _assert_bits(copies[r], want_w[r], f"momentum nesterov={nesterov} {what} copy {r}")
        step = int(rng.integers(1, 50))
        b1, b2, eps = 0.9, 0.999, 1e-7
        groups = (
            _fresh_mirrors(rng, n, count, dtype, layout),
            _fresh_mirrors(rng, n, count, dtype, layout),
            _fresh_mirrors(rng, n, count, dtype, layout, positive=True),
        )
        want = [[a.copy() for a in g] for g in groups]
        REF.adam(*want, grad, lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=step)
        lr_t = bias_corrected_lr(lr, b1, b2, step)
        rc = adam(*(_table(g) for g in groups), n, _ptr(grad), lr_t, b1, b2, eps, count, None)
        assert rc == CUDA_SUCCESS
        for name, got, exp in zip(("copy", "m", "v"), groups, want):
            for r in range(n):
                _assert_bits(got[r], exp[r], f"adam {what} {name} {r}")


def test_launchers_reject_bad_arguments(lib):
    """cudaErrorInvalidValue, and nothing written, for null pointers, n < 1, negative sizes, an unknown
    reduce op, and an output that a later pass would read as an input."""
    rng = np.random.default_rng(14)
    dtype, count = "float32", 33
    bufs = _buffers(rng, 9, count, dtype, "aligned")
    orig = [b.copy() for b in bufs]
    t = _table(bufs)
    x = _ptr(bufs[0])
    L = {name: _launcher(lib, name, dtype) for name in (
        "all_reduce", "all_reduce_two_shot", "reduce_to_one", "broadcast", "scatter_batch", "assign_add", "sgd",
        "momentum", "nesterov", "adam")}  # fmt: skip
    bad = {
        "all_reduce null bufs": lambda: L["all_reduce"](None, 2, count, 0, None),
        "all_reduce n=0": lambda: L["all_reduce"](t, 0, count, 0, None),
        "all_reduce n=-1": lambda: L["all_reduce"](t, -1, count, 0, None),
        "all_reduce count=-1": lambda: L["all_reduce"](t, 2, -1, 0, None),
        "all_reduce op=2": lambda: L["all_reduce"](t, 2, count, 2, None),
        "all_reduce op=-1": lambda: L["all_reduce"](t, 9, count, -1, None),
        "two_shot null bufs": lambda: L["all_reduce_two_shot"](None, 2, count, 0, None),
        "two_shot n=0": lambda: L["all_reduce_two_shot"](t, 0, count, 1, None),
        "two_shot count=-5": lambda: L["all_reduce_two_shot"](t, 2, -5, 1, None),
        "two_shot op=3": lambda: L["all_reduce_two_shot"](t, 2, count, 3, None),
        "reduce_to_one null bufs": lambda: L["reduce_to_one"](None, 2, x, count, 0, None),
        "reduce_to_one null out": lambda: L["reduce_to_one"](t, 2, None, count, 0, None),
        "reduce_to_one n=0": lambda: L["reduce_to_one"](t, 0, x, count, 0, None),
        "reduce_to_one count=-1": lambda: L["reduce_to_one"](t, 2, x, -1, 0, None),
        "reduce_to_one op=7": lambda: L["reduce_to_one"](t, 2, x, count, 7, None),
        "reduce_to_one out = input 8 of 9": lambda: L["reduce_to_one"](t, 9, _ptr(bufs[8]), count, 0, None),
        "broadcast null src": lambda: L["broadcast"](None, t, 2, count, None),
        "broadcast null dsts": lambda: L["broadcast"](x, None, 2, count, None),
        "broadcast n=0": lambda: L["broadcast"](x, t, 0, count, None),
        "broadcast count=-1": lambda: L["broadcast"](x, t, 2, -1, None),
        "scatter null src": lambda: L["scatter_batch"](None, t, 2, 4, 3, None),
        "scatter null dsts": lambda: L["scatter_batch"](x, None, 2, 4, 3, None),
        "scatter n=0": lambda: L["scatter_batch"](x, t, 0, 4, 3, None),
        "scatter batch=-1": lambda: L["scatter_batch"](x, t, 2, -1, 3, None),
        "scatter row_elems=-1": lambda: L["scatter_batch"](x, t, 2, 4, -1, None),
        "assign_add null copies": lambda: L["assign_add"](None, 2, x, count, 0, None),
        "assign_add null value": lambda: L["assign_add"](t, 2, None, count, 0, None),
        "assign_add n=0": lambda: L["assign_add"](t, 0, x, count, 0, None),
        "assign_add count=-1": lambda: L["assign_add"](t, 2, x, -1, 1, None),
        "sgd null grad": lambda: L["sgd"](t, 2, None, 0.1, 0.0, count, None),
        "sgd null copies": lambda: L["sgd"](None, 2, x, 0.1, 0.0, count, None),
        "sgd n=0": lambda: L["sgd"](t, 0, x, 0.1, 0.0, count, None),
        "sgd count=-1": lambda: L["sgd"](t, 2, x, 0.1, 0.0, -1, None),
        "momentum null velocities": lambda: L["momentum"](t, None, 2, x, 0.1, 0.9, 0.0, count, None),
        "momentum null grad": lambda: L["momentum"](t, t, 2, None, 0.1, 0.9, 0.0, count, None),
        "nesterov n=0": lambda: L["nesterov"](t, t, 0, x, 0.1, 0.9, 0.0, count, None),
        "adam null ms": lambda: L["adam"](t, None, t, 2, x, 0.1, 0.9, 0.999, 1e-7, count, None),
        "adam null vs": lambda: L["adam"](t, t, None, 2, x, 0.1, 0.9, 0.999, 1e-7, count, None),
        "adam null grad": lambda: L["adam"](t, t, t, 2, None, 0.1, 0.9, 0.999, 1e-7, count, None),
        "adam count=-1": lambda: L["adam"](t, t, t, 2, x, 0.1, 0.9, 0.999, 1e-7, -1, None),
    }
    for what, call in bad.items():
        assert call() == CUDA_ERROR_INVALID_VALUE, what
        for r in range(len(bufs)):
            _assert_bits(bufs[r], orig[r], f"{what}: buffer {r} written")
    # Edge cases that are valid and do nothing.
    assert L["scatter_batch"](None, t, 2, 0, 3, None) == CUDA_SUCCESS  # empty batch: no source needed
    assert L["scatter_batch"](None, t, 2, 4, 0, None) == CUDA_SUCCESS  # zero-size rows
    assert L["all_reduce"](t, 9, 0, 1, None) == CUDA_SUCCESS
    assert L["all_reduce"](t, 1, count, 1, None) == CUDA_SUCCESS
    for r in range(len(bufs)):
        _assert_bits(bufs[r], orig[r], f"no-op call: buffer {r} written")
    assert lib.cudist_emu_get_last_error() == CUDA_SUCCESS


# ------------------------------------------------------------------------------------- out of place and fused
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_one_shot_kernel_out_of_place(lib, dtype):
    """N inputs -> N separate outputs in one launch (the inputs untouched), and with every other
    output being its own input."""
    rng = np.random.default_rng(21)
    fn = _kernel(lib, "all_reduce_one_shot", dtype)
    item = np.dtype(dtype).itemsize
    for n, count, layout in _cases(KERNEL_REPLICAS):
        for op, divisor in ((ReduceOp.SUM, 0), (ReduceOp.MEAN, n)):
            for gx, bx in _grids(count, item):
                what = f"{dtype} n={n} count={count} {layout} {op.name} grid={gx}x{bx}"
                ins = _buffers(rng, n, count, dtype, layout)
                orig = [b.copy() for b in ins]
                want = REF.reduce_to_one(orig, op)
                outs = _buffers(rng, n, count, dtype, layout)
                fn(gx, 1, bx, _table(ins), n, _table(outs), n, count, divisor)
                for r in range(n):
                    _assert_bits(outs[r], want, f"out of place {what} output {r}")
                    _assert_bits(ins[r], orig[r], f"out of place {what}: input {r} modified")
                mixed = [ins[r] if r % 2 else outs[r] for r in range(n)]
                ins = _like(orig, layout)
                mixed = [ins[r] if r % 2 else _like([orig[r]], layout)[0] for r in range(n)]
                fn(gx, 1, bx, _table(ins), n, _table(mixed), n, count, divisor)
                for r in range(n):
                    _assert_bits(mixed[r], want, f"half in place {what} output {r}")


FUSED_GRADS = (1, 2, 3, 5, 8)


def _fused_case(rng, n, m, count, dtype, layout):
    off = 1 if layout == "offset" else 0
    grads = [_random(rng, count, dtype, offset=off if (layout != "last_offset" or i == m - 1) else 0) for i in range(m)]
    groups = (
        _fresh_mirrors(rng, n, count, dtype, layout),
        _fresh_mirrors(rng, n, count, dtype, layout),
        _fresh_mirrors(rng, n, count, dtype, layout, positive=True),
    )
    return grads, groups


@pytest.mark.parametrize("dtype", FLOATS)
def test_mirrored_all_reduce_update_kernels(lib, dtype):
    """The fused all-reduce + gradient descent / momentum (plain and nesterov: two rows) / adam kernels:
    bit for bit the reference's reduce_to_one(grads, SUM) followed by the update, for 1..8 gradients
    and copies (one gradient: the plain update, which launches the same kernel)."""
    rng = np.random.default_rng(22)
    sgd = _kernel(lib, "mirrored_all_reduce_sgd", dtype)
    moms = {False: _kernel(lib, "mirrored_all_reduce_momentum", dtype),
            True: _kernel(lib, "mirrored_all_reduce_nesterov", dtype)}
    adam = _kernel(lib, "mirrored_all_reduce_adam", dtype)
    item = np.dtype(dtype).itemsize
    for n, count, layout in _cases(KERNEL_REPLICAS, sizes=(0, 1, 7, 165)):
        for m in FUSED_GRADS:
            lr, mu = float(rng.uniform(1e-3, 0.5)), float(rng.uniform(0.5, 0.99))
            step = int(rng.integers(1, 50))
            b1, b2, eps = 0.9, 0.999, 1e-7
            lr_t = bias_corrected_lr(lr, b1, b2, step)
            for gx, bx in _grids(count, item)[1:]:
                what = f"{dtype} n={n} m={m} count={count} {layout} grid={gx}x{bx}"
                grads, (w, v, s2) = _fused_case(rng, n, m, count, dtype, layout)
                g = REF.reduce_to_one([x.copy() for x in grads], "sum") if count else grads[0].copy()
                want = [[a.copy() for a in x] for x in (w, v, s2)]
                REF.adam(*want, g, lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=step)
                adam(gx, 1, bx, _table(w), _table(v), _table(s2), n, _table(grads), m, lr_t, b1, b2, eps, count)
                for name, got, exp in zip(("copy", "m", "v"), (w, v, s2), want):
                    for r in range(n):
                        _assert_bits(got[r], exp[r], f"all_reduce_adam {what} {name} {r}")
                for nesterov in (False, True):
                    want = [[a.copy() for a in x] for x in (w, v)]
                    REF.momentum(*want, g, lr=lr, momentum=mu, nesterov=nesterov)
                    moms[nesterov](gx, 1, bx, _table(w), _table(v), n, _table(grads), m, lr, mu, 0.0, count)
                    for name, got, exp in zip(("copy", "velocity"), (w, v), want):
                        for r in range(n):
                            _assert_bits(got[r], exp[r], f"all_reduce_momentum nesterov={nesterov} {what} {name} {r}")
                want = [a.copy() for a in w]
                REF.sgd(want, g, lr=lr)
                sgd(gx, 1, bx, _table(w), n, _table(grads), m, lr, 0.0, count)
                for r in range(n):
                    _assert_bits(w[r], want[r], f"all_reduce_sgd {what} copy {r}")


def test_mirrored_all_reduce_float16_sums_in_float32(lib):
    """2048 + 1 + 1 + 1 is summed in float32 (2051) and rounded once (2052), not 2048 (rounding after each addition)."""
    grads = [np.array([2048.0, 1.0], np.float16)] + [np.array([1.0, 2048.0], np.float16) for _ in range(3)]
    w = [np.zeros(2, np.float16) for _ in range(2)]
    _kernel(lib, "mirrored_all_reduce_sgd", "float16")(1, 1, THREADS, _table(w), 2, _table(grads), 4, 1.0, 0.0, 2)
    assert w[0].tolist() == [-2052.0, -6144.0] and w[1].tolist() == [-2052.0, -6144.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_into_launcher(lib, dtype):
    """Out of place over 1..17 replicas (several passes above 8), SUM and MEAN; also with some
    outputs being their inputs."""
    rng = np.random.default_rng(23)
    fn = _launcher(lib, "all_reduce_into", dtype)
    for n, count, layout in _cases(LAUNCH_REPLICAS, LAUNCH_LAYOUTS):
        for op in (ReduceOp.SUM, ReduceOp.MEAN):
            what = f"{dtype} n={n} count={count} {layout} {op.name}"
            ins = _buffers(rng, n, count, dtype, layout)
            orig = [b.copy() for b in ins]
            want = REF.reduce_to_one(orig, op)
            outs = _buffers(rng, n, count, dtype, layout)
            rc = fn(_table(ins), _table(outs), n, count, int(op is ReduceOp.MEAN), None)
            assert rc == _launch_rc(dtype, n, count)
            if rc != CUDA_SUCCESS:
                continue
            for r in range(n):
                _assert_bits(outs[r], want, f"all_reduce_into {what} output {r}")
                _assert_bits(ins[r], orig[r], f"all_reduce_into {what}: input {r} modified")
            ins = _like(orig, layout)
            mixed = [ins[r] if r % 3 == 0 else _like([orig[r]], layout)[0] for r in range(n)]
            assert fn(_table(ins), _table(mixed), n, count, int(op is ReduceOp.MEAN), None) == CUDA_SUCCESS
            for r in range(n):
                _assert_bits(mixed[r], want, f"all_reduce_into (outputs 0, 3, ... in place) {what} output {r}")


@pytest.mark.parametrize("dtype", FLOATS)
def test_fused_update_launchers(lib, dtype):
    """all_reduce_sgd / _momentum / _adam on 1..17 copies with 1..17 gradients (more than 8: a
    stream-ordered temporary, freed again), bit for bit reduce_to_one + the update."""
    rng = np.random.default_rng(24)
    sgd, mom, adam = (_launcher(lib, name, dtype) for name in ("all_reduce_sgd", "all_reduce_nesterov", "all_reduce_adam"))
    live = lib.cudist_emu_async_allocations
    live.restype = ctypes.c_longlong
    before = live()
    for n, count, layout in _cases((1, 3, 9, 17), LAUNCH_LAYOUTS, sizes=(0, 7, 165)):
        for m in (1, 3, 8, 9, 11, 17):
            what = f"{dtype} n={n} m={m} count={count} {layout}"
            grads, (w, v, s2) = _fused_case(rng, n, m, count, dtype, layout)
            g = REF.reduce_to_one([x.copy() for x in grads], "sum")
            lr, mu, step = float(rng.uniform(1e-3, 0.5)), float(rng.uniform(0.5, 0.99)), int(rng.integers(1, 50))
            want = [[a.copy() for a in x] for x in (w, v, s2)]
            REF.adam(*want, g, lr=lr, step=step)
            rc = adam(_table(w), _table(v), _table(s2), n, _table(grads), m, bias_corrected_lr(lr, 0.9, 0.999, step), 0.9,
                      0.999, 1e-7, count, None)
            refused = _launch_rc(dtype, m, count)
            assert rc == refused, what
            if refused != CUDA_SUCCESS:  # float16 over more than 8 gradients: every fused launcher refuses
                assert mom(_table(w), _table(v), n, _table(grads), m, lr, mu, 0.0, count, None) == refused
                assert sgd(_table(w), n, _table(grads), m, lr, 0.0, count, None) == refused
                continue
            for name, got, exp in zip(("copy", "m", "v"), (w, v, s2), want):
                for r in range(n):
                    _assert_bits(got[r], exp[r], f"all_reduce_adam {what} {name} {r}")
            want = [[a.copy() for a in x] for x in (w, v)]
            REF.momentum(*want, g, lr=lr, momentum=mu, nesterov=True)
            assert mom(_table(w), _table(v), n, _table(grads), m, lr, mu, 0.0, count, None) == CUDA_SUCCESS
            for name, got, exp in zip(("copy", "velocity"), (w, v), want):
                for r in range(n):
                    _assert_bits(got[r], exp[r], f"all_reduce_nesterov {what} {name} {r}")
            want = [a.copy() for a in w]
            REF.sgd(want, g, lr=lr)
            assert sgd(_table(w), n, _table(grads), m, lr, 0.0, count, None) == CUDA_SUCCESS
            for r in range(n):
                _assert_bits(w[r], want[r], f"all_reduce_sgd {what} copy {r}")
    assert live() == before, "a launcher left a cudaMallocAsync temporary behind"


def test_new_launchers_reject_bad_arguments(lib):
    rng = np.random.default_rng(25)
    count = 33
    bufs = _buffers(rng, 4, count, "float32", "aligned")
    orig = [b.copy() for b in bufs]
    t = _table(bufs)
    into = _launcher(lib, "all_reduce_into", "float32")
    sgd, mom, adam = (_launcher(lib, name, "float32") for name in ("all_reduce_sgd", "all_reduce_momentum", "all_reduce_adam"))
    bad = {
        "into null in": lambda: into(None, t, 2, count, 0, None),
        "into null out": lambda: into(t, None, 2, count, 0, None),
        "into n=0": lambda: into(t, t, 0, count, 0, None),
        "into count=-1": lambda: into(t, t, 2, -1, 0, None),
        "into op=2": lambda: into(t, t, 2, count, 2, None),
        "sgd null grads": lambda: sgd(t, 2, None, 1, 0.1, 0.0, count, None),
        "sgd m=0": lambda: sgd(t, 2, t, 0, 0.1, 0.0, count, None),
        "sgd null copies": lambda: sgd(None, 2, t, 1, 0.1, 0.0, count, None),
        "momentum null velocities": lambda: mom(t, None, 2, t, 1, 0.1, 0.9, 0.0, count, None),
        "momentum m=-1": lambda: mom(t, t, 2, t, -1, 0.1, 0.9, 0.0, count, None),
        "adam null vs": lambda: adam(t, t, None, 2, t, 1, 0.1, 0.9, 0.999, 1e-7, count, None),
        "adam count=-1": lambda: adam(t, t, t, 2, t, 1, 0.1, 0.9, 0.999, 1e-7, -1, None),
    }
    for what, call in bad.items():
        assert call() == CUDA_ERROR_INVALID_VALUE, what
        for r in range(len(bufs)):
            _assert_bits(bufs[r], orig[r], f"{what}: buffer {r} written")
    assert lib.cudist_emu_get_last_error() == CUDA_SUCCESS


# ------------------------------------------------------------------------------------- bfloat16 specials
def _bf16_specials(rng, n: int, count: int) -> list[np.ndarray]:
    """n bfloat16 buffers of mixed magnitudes with subnormals, +-inf, NaNs (payloads, both signs),
    -0 and the largest finite value (two of them overflow to inf), at random positions."""
    out = []
    for _ in range(n):
        a = _empty(count, "bfloat16", 0)
        v = rng.standard_normal(count).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 6, count)
        u = v.astype("bfloat16").view(np.uint16)
        k = rng.permutation(count)[:9]
        u[k] = (0x0001 + rng.integers(0, 0x7F), 0x8001 + rng.integers(0, 0x7F), 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
                0x7FFF, 0xFFC1, 0x8000)
        a.view(np.uint16)[...] = u
        out.append(a)
    return out


def _assert_bf16_sum_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit, except a computed NaN's sign (the hardware's: x86, here, gives inf + -inf as
    -NaN, a GPU +NaN); every NaN must be ml_dtypes' 0x7fc0 | sign, never CUDA's 0x7fff."""
    g, w = got.view(np.uint16), want.view(np.uint16)
    nan = (w & 0x7FFF) > 0x7F80
    assert np.array_equal((g & 0x7FFF) > 0x7F80, nan), f"{what}: NaN positions differ"
    assert np.all(g[nan] & 0x7FFF == 0x7FC0), f"{what}: NaNs {g[nan]}"
    _assert_bits(np.where(nan, 0, g), np.where(nan, 0, w), what)


@pytest.mark.parametrize("ftz", [0, 1], ids=["ieee", "ftz"])
def test_bfloat16_nan_inf_subnormal_sums(lib, ftz):
    """The kernel and the launchers round float32 to bfloat16 themselves: nearest even, ml_dtypes'
    NaN, subnormal sums kept. The emulation's ftz mode (float32 intrinsics flushing subnormals, as
    CuPy's -ftz does on a GPU) must change nothing: the sums avoid those intrinsics and the rounding
    is integer arithmetic."""
    rng = np.random.default_rng(31)
    kernel = _kernel(lib, "all_reduce_one_shot", "bfloat16")
    launcher = _launcher(lib, "all_reduce", "bfloat16")
    lib.cudist_emu_set_modes(0, ftz, 0)
    try:
        for n in (2, 3, 8):
            for count in (9, 165, 1031):
                bufs = _bf16_specials(rng, n, count)
                for op in (ReduceOp.SUM, ReduceOp.MEAN):
                    with np.errstate(over="ignore", invalid="ignore"):
                        want = REF.reduce_to_one([b.copy() for b in bufs], op)
                    divisor = n if op is ReduceOp.MEAN else 0
                    out = _empty(count, "bfloat16", 0)
                    kernel(_cupy_grid(count, 2), 1, THREADS, _table(bufs), n, _table([out]), 1, count, divisor)
                    _assert_bf16_sum_bits(out, want, f"kernel n={n} count={count} {op.name} ftz={ftz}")
                    copies = _like(bufs)
                    assert launcher(_table(copies), n, count, int(op is ReduceOp.MEAN), None) == CUDA_SUCCESS
                    for r in range(n):
                        _assert_bf16_sum_bits(copies[r], want, f"launcher n={n} count={count} {op.name} replica {r}")
    finally:
        lib.cudist_emu_set_modes(0, 0, 0)
    # Each case on its own, so the bits are known: a subnormal sum, overflow, a tie to even, NaNs.
    a = np.array([0x0003, 0x7F7F, 0x3F80, 0x7FA5, 0xFFFF, 0x7F80], np.uint16).view("bfloat16")
    b = np.array([0x0004, 0x7F7F, 0x3B80, 0x3F80, 0xBF80, 0xFF80], np.uint16).view("bfloat16")
    x, y = _like([a, b])
    kernel(1, 1, THREADS, _table([x, y]), 2, _table([x]), 1, a.size, 0)
    got = x.view(np.uint16)
    assert got[0] == 0x0007 and got[1] == 0x7F80 and got[2] == 0x3F80  # 1 + 2**-8: the tie rounds to even
    assert all(v & 0x7FFF == 0x7FC0 for v in got[3:])  # NaN in, inf - inf: 0x7fc0 | sign


@pytest.mark.parametrize("dtype", (*FLOATS, "bfloat16"))
def test_reduce_unscale_finite_launcher(lib, dtype):
    """LossScaleOptimizer's launcher: out = the m gradients' sum (1..17: more than 8 pre-summed into
    a stream-ordered temporary, freed again; float16 / bfloat16 refused there) / scale, bit for bit
    the host kernels' (the CPU backends' definition), and the flag set by a non-finite element only,
    never cleared; bad arguments refused."""
    rng = np.random.default_rng(31)
    fn = _launcher(lib, "reduce_unscale_finite", dtype)
    live = lib.cudist_emu_async_allocations
    live.restype = ctypes.c_longlong
    before = live()
    host = REF.trusted
    dt = np.dtype(dtype)
    for m, count, layout in _cases((1, 3, 8, 9, 17), LAUNCH_LAYOUTS, sizes=(0, 7, 165, 1031)):
        for bad in (None, np.inf, np.nan):
            what = f"{dtype} m={m} count={count} {layout} bad={bad}"
            grads = _buffers(rng, m, count, dtype, layout)
            if bad is not None and count:
                grads[-1][count // 2] = bad
            out = _random(rng, count, dtype, offset=1 if layout == "offset" else 0)
            flag = np.zeros(1, np.int32)
            rc = fn(_table(grads), m, _ptr(out), count, 64.0, _ptr(flag), None)
            assert rc == _launch_rc(dtype, m, count), what
            if rc != CUDA_SUCCESS:
                continue
            want = np.empty(count, dt)
            finite = host.reduce_unscale_finite([g.view(dt) for g in grads], 64.0, want)
            assert flag[0] == (0 if finite else 1), what
            assert finite == (bad is None or count == 0), what
            keep = np.isfinite(want.astype(np.float64))
            _assert_bits(out.view(dt)[keep], want[keep], what)
            if not finite:  # never cleared by a finite launch after it
                ok = _buffers(rng, m, count, dtype, layout)
                assert fn(_table(ok), m, _ptr(out), count, 64.0, _ptr(flag), None) == CUDA_SUCCESS
                assert flag[0] == 1, what
    assert live() == before, "the launcher left a cudaMallocAsync temporary behind"
    g = _buffers(rng, 2, 7, dtype, "aligned")
    out, flag = _random(rng, 7, dtype), np.zeros(1, np.int32)
    for what, call in {
        "null grads": lambda: fn(None, 2, _ptr(out), 7, 2.0, _ptr(flag), None),
        "m=0": lambda: fn(_table(g), 0, _ptr(out), 7, 2.0, _ptr(flag), None),
        "null out": lambda: fn(_table(g), 2, None, 7, 2.0, _ptr(flag), None),
        "null flag": lambda: fn(_table(g), 2, _ptr(out), 7, 2.0, None, None),
        "count=-1": lambda: fn(_table(g), 2, _ptr(out), -1, 2.0, _ptr(flag), None),
    }.items():
        assert call() == CUDA_ERROR_INVALID_VALUE, what
