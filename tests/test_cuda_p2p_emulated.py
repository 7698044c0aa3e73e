"""cudist::cuda::p2p_all_reduce (the multi-GPU orchestration of <cudist/cuda/p2p_impl.cuh>) on the CPU.

The real C++ code is compiled against the host emulation of the CUDA runtime in tests/emu (devices
whose memory is host memory, per-thread current device, a peer-access table, streams and events
that remember their device, launches run on the host), so the orchestration itself is checked:
the chunking into whole 16-byte vectors with one reduce-scatter and one all-gather launch per
buffer on its own device and stream, peer access between every pair of distinct devices, the
stream joins, the fallbacks (one device; more than 8 buffers), the caller's current device put
back, and the argument checks. Results must equal the NumPy reference bit for bit. Needs only a
C++ compiler.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from cudist._kernels._numpy import reference_reduce
from cudist._reduce_util import ReduceOp

_BUILD_PY = Path(__file__).resolve().parent / "emu" / "build.py"
_spec = importlib.util.spec_from_file_location("cudist_tests_emu_build_p2p", _BUILD_PY)
emu_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu_build)

pytestmark = pytest.mark.skipif(emu_build.compiler() is None, reason="needs a C++ compiler (c++ or g++)")

DTYPES = ("float16", "float32", "float64", "int32", "int64")
OPS = {ReduceOp.SUM: 0, ReduceOp.MEAN: 1}
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_RESOURCE_HANDLE = 400


@pytest.fixture(scope="module")
def lib():
    lib = emu_build.load()
    for dt in DTYPES:
        f = getattr(lib, f"cudist_emu_launch_p2p_all_reduce_{dt}")
        f.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_longlong,
            ctypes.c_int,
        ]
        f.restype = ctypes.c_int
    lib.cudist_emu_stream_create.argtypes = [ctypes.c_int]
    lib.cudist_emu_stream_create.restype = ctypes.c_void_p
    lib.cudist_emu_stream_destroy.argtypes = [ctypes.c_void_p]
    lib.cudist_emu_stream_destroy.restype = ctypes.c_int
    lib.cudist_emu_get_device.restype = ctypes.c_int
    lib.cudist_emu_set_device.argtypes = [ctypes.c_int]
    lib.cudist_emu_peer_enabled.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


@pytest.fixture(autouse=True)
def machine(lib, monkeypatch):
    """Eight emulated peer-capable devices, no peer access enabled yet, device 0 current."""
    monkeypatch.setenv("CUDIST_EMU_DEVICES", "8")
    monkeypatch.setenv("CUDIST_EMU_PEER", "1")
    lib.cudist_emu_reset()
    yield
    lib.cudist_emu_reset()


def _random(rng, dtype, count):
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        info = np.iinfo(dtype)  # the full range, so that sums wrap around
        return rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
    scale = 20.0 if dtype == np.float16 else 100.0
    return (rng.standard_normal(count) * scale).astype(dtype)


def _buffer(data, offset_elems=0):
    """A copy of ``data`` starting 64-byte aligned (plus ``offset_elems`` elements), kept alive by the caller."""
    pad = 64 // data.itemsize + offset_elems
    raw = np.zeros(data.size + pad, data.dtype)
    start = (-(raw.ctypes.data % 64) // data.itemsize) % (64 // data.itemsize) + offset_elems
    buf = raw[start : start + data.size]
    buf[...] = data
    assert (buf.ctypes.data - offset_elems * data.itemsize) % 64 == 0
    return buf


def _p2p(lib, dtype, bufs, devices, count=None, op=0, streams=None, table=None, devs=None):
    n = len(bufs)
    table = table if table is not None else (ctypes.c_void_p * n)(*[b.ctypes.data for b in bufs])
    devs = devs if devs is not None else (ctypes.c_int * len(devices))(*devices)
    st = None if streams is None else (ctypes.c_void_p * n)(*streams)
    count = bufs[0].size if count is None else count
    return getattr(lib, f"cudist_emu_launch_p2p_all_reduce_{dtype}")(table, devs, st, n, count, op)


def _check(lib, rng, dtype, devices, count, op, offset=0, streams=None):
    data = [_random(rng, dtype, count) for _ in devices]
    bufs = [_buffer(d, offset) for d in data]
    expected = reference_reduce([d.copy() for d in data], op)
    rc = _p2p(lib, dtype, bufs, devices, op=OPS[op], streams=streams)
    if dtype == "float16" and len(devices) > 8 and count > 0:
        # float16 over more than a kernel's 8 buffers would round between passes: refused, untouched.
        assert rc == 801
        assert all(np.array_equal(b.view(np.uint8), d.view(np.uint8)) for b, d in zip(bufs, data))
        return
    assert rc == CUDA_SUCCESS
    for r, b in enumerate(bufs):
        assert np.array_equal(b.view(np.uint8), expected.view(np.uint8)), f"buffer {r} differs from the reference"
    assert lib.cudist_emu_get_last_error() == CUDA_SUCCESS


# ------------------------------------------------------------------------------------- results
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 33, 1031])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_one_buffer_per_device_matches_reference(lib, dtype, n, count, op):
    rng = np.random.default_rng([n, count, DTYPES.index(dtype), OPS[op]])
    _check(lib, rng, dtype, list(range(n)), count, op)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_unaligned_buffers_take_the_scalar_path(lib, dtype, n):
    # Chunks stay whole vectors of the element index space; with buffers off a 16-byte boundary
    # the kernels go scalar and must still cover every element exactly once.
    rng = np.random.default_rng(n)
    _check(lib, rng, dtype, list(range(n)), 517, ReduceOp.SUM, offset=1)


@pytest.mark.parametrize(
    "devices",
    [
        [0, 1, 0, 1],  # logical replicas sharing GPUs
        [3, 3, 3],  # one GPU: the one-shot fallback, no peer access needed
        [5, 2, 7, 2, 0, 6, 1, 4],
        [i % 4 for i in range(9)],  # more buffers than a kernel takes: the one-shot fallback, in passes
        [i % 8 for i in range(11)],
    ],
)
@pytest.mark.parametrize("dtype", ["float16", "float64", "int32"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_any_device_assignment(lib, devices, dtype, op):
    rng = np.random.default_rng(len(devices))
    _check(lib, rng, dtype, devices, 299, op)


def test_fewer_elements_than_chunks(lib):
    # 3 float32 elements over 8 buffers: chunk = 4 elements, so buffer 0 owns them all and the
    # other buffers' launches are skipped.
    rng = np.random.default_rng(3)
    _check(lib, rng, "float32", list(range(8)), 3, ReduceOp.MEAN)


def test_count_zero_touches_nothing(lib):
    bufs = [_buffer(np.arange(5, dtype=np.float32) + r) for r in range(3)]
    before = [b.copy() for b in bufs]
    assert _p2p(lib, "float32", bufs, [0, 1, 2], count=0) == CUDA_SUCCESS
    for b, a in zip(bufs, before):
        assert np.array_equal(b, a)
    assert not lib.cudist_emu_peer_enabled(0, 1)


# ------------------------------------------------------------------------------------- runtime
def test_peer_access_enabled_between_every_pair_and_already_enabled_is_fine(lib):
    # Pre-enable one pair: the call meets cudaErrorPeerAccessAlreadyEnabled and must leave no error.
    assert lib.cudist_emu_set_device(2) == CUDA_SUCCESS
    assert lib.cudist_emu_device_enable_peer_access(0, 0) == CUDA_SUCCESS
    assert lib.cudist_emu_set_device(0) == CUDA_SUCCESS
    rng = np.random.default_rng(0)
    devices = [0, 2, 5]
    _check(lib, rng, "float32", devices, 100, ReduceOp.SUM)
    for a in devices:
        for b in devices:
            if a != b:
                assert lib.cudist_emu_peer_enabled(a, b), (a, b)
    assert not lib.cudist_emu_peer_enabled(0, 1)
    # A second call finds every pair enabled.
    _check(lib, rng, "float32", devices, 100, ReduceOp.MEAN)


@pytest.mark.parametrize("devices", [[0, 1, 2, 3], [2, 2], [i % 3 for i in range(10)]])
def test_current_device_is_restored(lib, devices):
    assert lib.cudist_emu_set_device(6) == CUDA_SUCCESS
    _check(lib, np.random.default_rng(1), "int64", devices, 64, ReduceOp.SUM)
    assert lib.cudist_emu_get_device() == 6


def test_streams_of_the_buffers_devices(lib):
    devices = [1, 3, 0]
    streams = [lib.cudist_emu_stream_create(d) for d in devices]
    assert all(streams)
    try:
        _check(lib, np.random.default_rng(2), "float32", devices, 1000, ReduceOp.SUM, streams=streams)
        # Two buffers sharing one stream of their device.
        shared = lib.cudist_emu_stream_create(4)
        try:
            _check(lib, np.random.default_rng(3), "float64", [4, 4, 5], 77, ReduceOp.MEAN,
                   streams=[shared, shared, 0])  # fmt: skip
        finally:
            lib.cudist_emu_stream_destroy(shared)
    finally:
        for s in streams:
            lib.cudist_emu_stream_destroy(s)


@pytest.mark.parametrize("handle", [0, 1, 2], ids=["null", "cudaStreamLegacy", "cudaStreamPerThread"])
def test_default_stream_handles_of_different_devices_are_joined(lib, handle):
    """The same default-stream handle on two devices names two streams: they must be joined (events
    recorded on one, waited for on the other) before and after the kernels. The handles 1 and 2
    (cudaStreamLegacy, cudaStreamPerThread) used to count as one stream, skipping every join."""
    lib.cudist_emu_cross_device_waits.restype = ctypes.c_longlong
    before = lib.cudist_emu_cross_device_waits()
    _check(lib, np.random.default_rng(4), "float32", [0, 1, 2], 1000, ReduceOp.SUM, streams=[handle] * 3)
    # Two joins of 3 streams, each stream waiting for the 2 others.
    assert lib.cudist_emu_cross_device_waits() - before == 2 * 3 * 2
    # One device: one stream, nothing to join.
    before = lib.cudist_emu_cross_device_waits()
    _check(lib, np.random.default_rng(5), "float32", [3, 3], 100, ReduceOp.SUM, streams=[handle] * 2)
    assert lib.cudist_emu_cross_device_waits() == before


def test_stream_of_another_device_fails_before_any_launch(lib):
    # The stream given for buffer 1 belongs to device 0, not 1: recording an event of device 1 on
    # it fails, as it would on a GPU, before anything is launched.
    s0 = lib.cudist_emu_stream_create(0)
    try:
        bufs = [_buffer(np.full(40, r + 1, np.int32)) for r in range(2)]
        assert lib.cudist_emu_set_device(5) == CUDA_SUCCESS
        assert _p2p(lib, "int32", bufs, [0, 1], streams=[0, s0]) == CUDA_ERROR_INVALID_RESOURCE_HANDLE
        assert lib.cudist_emu_get_device() == 5
        assert np.all(bufs[0] == 1) and np.all(bufs[1] == 2)
    finally:
        lib.cudist_emu_stream_destroy(s0)


def test_without_peer_access_distinct_devices_fail_and_one_device_works(lib, monkeypatch):
    monkeypatch.setenv("CUDIST_EMU_PEER", "0")
    bufs = [_buffer(np.full(40, r + 1.5, np.float32)) for r in range(3)]
    assert _p2p(lib, "float32", bufs, [0, 1, 2]) == CUDA_ERROR_INVALID_DEVICE
    for r, b in enumerate(bufs):
        assert np.all(b == r + 1.5), "nothing may run when the devices cannot reach each other"
    assert not lib.cudist_emu_peer_enabled(0, 1)
    assert lib.cudist_emu_get_device() == 0
    lib.cudist_emu_get_last_error()
    _check(lib, np.random.default_rng(4), "float16", [1, 1, 1], 50, ReduceOp.MEAN)


def test_no_device(lib, monkeypatch):
    monkeypatch.setenv("CUDIST_EMU_DEVICES", "0")
    bufs = [_buffer(np.ones(8, np.float32)) for _ in range(2)]
    assert _p2p(lib, "float32", bufs, [0, 1]) == CUDA_ERROR_NO_DEVICE
    assert _p2p(lib, "float32", bufs[:1], [0]) == CUDA_ERROR_NO_DEVICE  # even with nothing to do
    assert lib.cudist_emu_get_last_error() == CUDA_SUCCESS


# ------------------------------------------------------------------------------------- arguments
def test_bad_arguments(lib):
    bufs = [_buffer(np.ones(8, np.float64)) for _ in range(2)]
    f = lib.cudist_emu_launch_p2p_all_reduce_float64
    table = (ctypes.c_void_p * 2)(*[b.ctypes.data for b in bufs])
    devs = (ctypes.c_int * 2)(0, 1)
    assert f(None, devs, None, 2, 8, 0) == CUDA_ERROR_INVALID_VALUE
    assert f(table, None, None, 2, 8, 0) == CUDA_ERROR_INVALID_VALUE
    assert f(table, devs, None, 0, 8, 0) == CUDA_ERROR_INVALID_VALUE
    assert f(table, devs, None, 2, -1, 0) == CUDA_ERROR_INVALID_VALUE
    assert f(table, devs, None, 2, 8, 2) == CUDA_ERROR_INVALID_VALUE
    assert f((ctypes.c_void_p * 2)(bufs[0].ctypes.data, None), devs, None, 2, 8, 0) == CUDA_ERROR_INVALID_VALUE
    assert f(table, (ctypes.c_int * 2)(0, -1), None, 2, 8, 0) == CUDA_ERROR_INVALID_DEVICE
    assert f(table, (ctypes.c_int * 2)(0, 8), None, 2, 8, 0) == CUDA_ERROR_INVALID_DEVICE
    for b in bufs:
        assert np.all(b == 1.0)
    assert lib.cudist_emu_get_device() == 0
