"""The fake CuPy (tests/emu/fakecupy) behaves like CuPy 13 where cudist relies on it, and its
emulated GPU refuses what a real one would (so that the GPU suite passing under it means something).

The fake is imported in isolation (4 GPUs; peer access only within {0, 1} and {2, 3}) and removed
from ``sys.modules`` afterwards, so the rest of the CPU suite still sees no CuPy.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

FAKE = str(Path(__file__).resolve().parent / "emu" / "fakecupy")


def _fake_modules():
    return [k for k in sys.modules if k in ("cupy", "cupyx") or k.startswith(("cupy.", "cupyx."))]


@pytest.fixture(scope="module")
def cp():
    saved = {k: sys.modules.pop(k) for k in _fake_modules()}
    env = {k: os.environ.get(k) for k in ("CUDIST_EMU_DEVICES", "CUDIST_EMU_PEER")}
    os.environ.update(CUDIST_EMU_DEVICES="4", CUDIST_EMU_PEER="0,1;2,3")
    sys.path.insert(0, FAKE)
    try:
        import cupy

        assert cupy.__fake__
        yield cupy
    finally:
        sys.path.remove(FAKE)
        for k in _fake_modules():
            del sys.modules[k]
        sys.modules.update(saved)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_arrays_are_device_tagged_wrappers_like_cupy(cp):
    h = np.arange(10, dtype=np.float32)
    a = cp.asarray(h)
    assert type(a).__module__ == "cupy" and type(a).__name__ == "ndarray" and not isinstance(a, np.ndarray)
    assert a.device.id == 0 and a.data.device_id == 0 and a.data.ptr % 256 == 0
    v = a[3:]
    assert v.data.ptr == a.data.ptr + 12 and v.device.id == 0
    v[0] = 42  # a view writes through
    assert cp.asnumpy(a)[3] == 42 and a[3].ndim == 0 and float(a[3]) == 42.0
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Unsupported type"):
        a + h
    with pytest.raises(TypeError):
        h + a
    assert (a * np.float32(2) + 1).dtype == np.float32
    assert isinstance(a.sum(), cp.ndarray) and a.sum().ndim == 0
    assert a.astype(np.float32, copy=False) is a and cp.asarray(a) is a
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
        cp.copyto(a, h)
    cai = a.__cuda_array_interface__
    assert cai["data"][0] == a.data.ptr and cai["shape"] == (10,) and cai["typestr"] == "<f4"


def test_new_arrays_land_on_the_current_device(cp):
    a = cp.arange(4, dtype=cp.float32)
    with cp.cuda.Device(3):
        assert cp.empty_like(a).device.id == 3  # CuPy: *_like use the current device, not a's
        assert a.copy().device.id == 3 and a[1:].device.id == 0  # a view stays where its memory is
        b = cp.asarray(a)  # another device's array is copied over
        assert b.device.id == 3 and b is not a
        np.testing.assert_array_equal(cp.asnumpy(b), [0, 1, 2, 3])
    assert cp.cuda.runtime.getDevice() == 0


def test_operands_on_other_devices_follow_cupys_peer_rules(cp):
    with cp.cuda.Device(1):
        x = cp.ones(3, cp.float32)
    with cp.cuda.Device(2):
        y = cp.ones(3, cp.float32)
    with pytest.warns(cp._util.PerformanceWarning, match="Peer access has been activated automatically"):
        z = x + 1  # device 0 may reach device 1: CuPy enables peer access and warns
    assert z.device.id == 0
    with pytest.raises(ValueError, match="Peer access is unavailable"):
        y * 2  # devices 0 and 2 cannot reach each other
    with pytest.raises(ValueError, match="Peer access is unavailable"):
        y.fill(3)
    np.testing.assert_array_equal(cp.asnumpy(y.copy()), [1, 1, 1])  # plain copies always work
    dst = cp.zeros(3, cp.float32)
    cp.copyto(dst, y)
    np.testing.assert_array_equal(cp.asnumpy(dst), [1, 1, 1])


def test_runtime_devices_and_peer_access(cp):
    rt = cp.cuda.runtime
    assert rt.getDeviceCount() == 4
    assert rt.deviceCanAccessPeer(2, 3) == 1 and rt.deviceCanAccessPeer(0, 3) == 0 and rt.deviceCanAccessPeer(1, 1) == 0
    assert rt.getDeviceProperties(0)["multiProcessorCount"] >= 1
    with cp.cuda.Device(2):
        rt.deviceEnablePeerAccess(3)
        with pytest.raises(rt.CUDARuntimeError) as e:
            rt.deviceEnablePeerAccess(3)
        assert e.value.status == 704
        with pytest.raises(rt.CUDARuntimeError) as e:
            rt.deviceEnablePeerAccess(0)
        assert e.value.status == 217
        with cp.cuda.Device(1):
            assert rt.getDevice() == 1
        assert rt.getDevice() == 2
    with pytest.raises(rt.CUDARuntimeError) as e:
        rt.setDevice(4)
    assert e.value.status == 101


def test_events_belong_to_their_device(cp):
    with cp.cuda.Device(1):
        ev = cp.cuda.Event(disable_timing=True)
        s1 = cp.cuda.Stream(non_blocking=True)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
        ev.record()  # the current stream is device 0's
    ev.record(s1)
    cp.cuda.get_current_stream().wait_event(ev)
    with s1:
        assert cp.cuda.get_current_stream(1) is s1
    assert cp.cuda.get_current_stream(1) is cp.cuda.Stream.null


def test_pinned_memory_is_usable_as_a_numpy_buffer(cp):
    import cupyx

    mem = cp.cuda.alloc_pinned_memory(64)
    buf = np.ndarray((16,), np.float32, buffer=mem)
    buf[:] = 5
    assert mem.ptr == buf.__array_interface__["data"][0]
    pinned = cupyx.zeros_pinned((4,), np.int64)
    assert isinstance(pinned, np.ndarray) and cp._emu.find(pinned.ctypes.data).pinned


def test_nccl_all_reduce_needs_a_group(cp):
    nccl = cp.cuda.nccl
    comms = nccl.NcclCommunicator.initAll([0, 1])
    bufs = []
    for d in (0, 1):
        with cp.cuda.Device(d):
            bufs.append(cp.asarray(np.arange(5, dtype=np.float32) * (d + 1)))
    with pytest.raises(nccl.NcclError, match="groupStart"):
        comms[0].allReduce(bufs[0].data.ptr, bufs[0].data.ptr, 5, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    nccl.groupStart()
    for d, (c, b) in enumerate(zip(comms, bufs)):
        with cp.cuda.Device(d):
            c.allReduce(b.data.ptr, b.data.ptr, 5, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, cp.cuda.get_current_stream().ptr)
    nccl.groupEnd()
    for b in bufs:
        np.testing.assert_array_equal(cp.asnumpy(b), np.arange(5) * 3.0)


@pytest.fixture(scope="module")
def one_shot(cp):
    if shutil.which(os.environ.get("CXX") or "c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the CUDA emulation cannot be built")
    import cudist

    inc = cudist.get_include()
    names = ["cudist::kernels::all_reduce_one_shot<float>"]
    mod = cp.RawModule(code="#include <cudist/kernels/kernels.cuh>\n", options=("-std=c++17", f"-I{inc}"), name_expressions=names)
    with pytest.raises(cp.cuda.driver.CUDADriverError, match="NOT_FOUND"):
        mod.get_function("cudist::kernels::broadcast<float>")
    return mod.get_function(names[0])


def _table(cp, arrays):
    return cp.asarray(np.array([a.data.ptr for a in arrays], dtype=np.uint64))


def _args(cp, ins, outs, count):
    return (_table(cp, ins), np.int32(len(ins)), _table(cp, outs), np.int32(len(outs)), np.int64(count), np.int32(0))


def test_raw_kernel_runs_the_real_kernel(cp, one_shot):
    rng = np.random.default_rng(0)
    hs = [rng.standard_normal(1001).astype(np.float32) for _ in range(3)]
    ds = [cp.asarray(h) for h in hs]
    one_shot((2,), (256,), _args(cp, ds, ds, 1001))
    want = (hs[0] + hs[1]) + hs[2]
    for d in ds:
        assert cp.asnumpy(d).tobytes() == want.tobytes()


def test_raw_kernel_refuses_what_a_gpu_would(cp, one_shot):
    a = cp.ones(100, cp.float32)
    with cp.cuda.Device(2):
        far = cp.ones(100, cp.float32)  # device 0 can never reach device 2
    with cp.cuda.Device(3):
        peer = cp.ones(100, cp.float32)  # device 2 can reach device 3 once access is enabled
    with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress.*device 0 touched memory of device 2"):
        one_shot((1,), (256,), _args(cp, [a, far], [a], 100))
    with pytest.raises(RuntimeError, match="past the end"):
        one_shot((1,), (256,), _args(cp, [a], [a], 101))
    with pytest.raises(TypeError, match="int64"):
        one_shot((1,), (256,), (_table(cp, [a]), np.int32(1), _table(cp, [a]), np.int32(1), 100, np.int32(0)))
    with pytest.raises(ValueError, match="kMaxReplicas"):
        one_shot((1,), (256,), _args(cp, [a] * 9, [a], 100))
    with cp.cuda.Device(2):
        args = _args(cp, [far, peer], [far], 100)
        if (2, 3) not in cp._emu.PEER_ENABLED:
            with pytest.raises(RuntimeError, match="peer access to it was never enabled"):
                one_shot((1,), (256,), args)
            cp.cuda.runtime.deviceEnablePeerAccess(3)
        one_shot((1,), (256,), args)
    np.testing.assert_array_equal(cp.asnumpy(far), np.full(100, 2, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import cupyx

        pinned = cupyx.empty_pinned((100,), np.float32)
        pinned[:] = 4
        host_table = cp.asarray(np.array([pinned.ctypes.data, a.data.ptr], dtype=np.uint64))
        one_shot((1,), (256,), (host_table, np.int32(2), _table(cp, [a]), np.int32(1), np.int64(100), np.int32(0)))
    np.testing.assert_array_equal(cp.asnumpy(a), np.full(100, 5, np.float32))
