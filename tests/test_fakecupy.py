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


def test_operators_dispatch_like_cupy(cp):
    """CuPy's operators: an operand with __array_ufunc__ gets the NumPy ufunc (NEP 13) after CuPy's
    own __array_ufunc__ declines it; __array_ufunc__ = None defers to its reflected operator; an
    operand without either is an unsupported type."""
    a = cp.asarray(np.arange(4.0))

    class Ufuncs:  # like cudist.Variable: takes part in ufuncs by unwrapping itself
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            calls.append(ufunc.__name__)
            inputs = tuple(a if x is self else x for x in inputs)
            return getattr(ufunc, method)(*inputs, **kwargs)

    class OptOut:
        __array_ufunc__ = None

        def __rmul__(self, other):
            return "reflected"

    calls = []
    r = a * Ufuncs()
    assert calls == ["multiply"] and isinstance(r, cp.ndarray) and cp.asnumpy(r).tolist() == [0, 1, 4, 9]
    assert a * OptOut() == "reflected"
    with pytest.raises(TypeError):
        a * object()


def test_new_arrays_land_on_the_current_device(cp):
    a = cp.arange(4, dtype=cp.float32)
    cp.cuda.Device(0).synchronize()  # a copy on device 3 is not ordered after device 0's queued work
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
        cp.cuda.runtime.deviceSynchronize()  # copies on device 0 are not ordered after device 2's work
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


def test_nccl_bfloat16_rounds_after_every_addition_as_nccl_does(cp):
    """ncclBfloat16 SUM as NCCL computes it (FuncSum<__nv_bfloat16>: each addition rounded to
    bfloat16, rank order here; a NaN is CUDA's 0x7fff), not the kernels' float32 accumulation."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = ml_dtypes.bfloat16
    nccl = cp.cuda.nccl
    assert nccl.get_version() >= 21000 and nccl.NCCL_BFLOAT16 == 9
    # 256 + 1 + 1: rounded after each addition 256 + 1 -> 256 (ties to even), twice; in float32 258.
    vals = [np.array([256.0, 1.0, np.nan], np.float32).astype(bf),
            np.array([1.0, 2.0**-9, 1.0], np.float32).astype(bf),
            np.array([1.0, 2.0**-9, 1.0], np.float32).astype(bf)]
    vals[0].view(np.uint16)[2] = 0xFFC1  # a negative NaN with a payload
    comms = nccl.NcclCommunicator.initAll([0, 1, 2])
    bufs = []
    for d, v in enumerate(vals):
        with cp.cuda.Device(d):
            bufs.append(cp.asarray(v))
    nccl.groupStart()
    for d, (c, b) in enumerate(zip(comms, bufs)):
        with cp.cuda.Device(d):
            c.allReduce(b.data.ptr, b.data.ptr, 3, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM, cp.cuda.get_current_stream().ptr)
    nccl.groupEnd()
    once = sum(v.astype(np.float32) for v in vals).astype(bf)  # the kernels' rule, for contrast
    for b in bufs:
        got = cp.asnumpy(b)
        assert got.dtype == bf
        assert got.view(np.uint16).tolist() == [np.array(256.0, bf).view(np.uint16), np.array(1.0, bf).view(np.uint16), 0x7FFF]
        assert got.view(np.uint16)[0] != once.view(np.uint16)[0]


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
        cp.cuda.Device(3).synchronize()  # kernels on device 2 are not ordered after device 3's work
    # Pointer-table entries are checked when the kernel runs, so the error comes at the next
    # synchronization, as CUDA reports illegal addresses.
    one_shot((1,), (256,), _args(cp, [a, far], [a], 100))
    with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress.*device 0 touched memory of device 2"):
        cp.cuda.Device(0).synchronize()
    one_shot((1,), (256,), _args(cp, [a], [a], 101))
    with pytest.raises(RuntimeError, match="past the end"):
        cp.cuda.Device(0).synchronize()
    with pytest.raises(TypeError, match="int64"):
        one_shot((1,), (256,), (_table(cp, [a]), np.int32(1), _table(cp, [a]), np.int32(1), 100, np.int32(0)))
    with pytest.raises(ValueError, match="kMaxReplicas"):
        one_shot((1,), (256,), _args(cp, [a] * 9, [a], 100))
    with cp.cuda.Device(2):
        args = _args(cp, [far, peer], [far], 100)
        if (2, 3) not in cp._emu.PEER_ENABLED:
            one_shot((1,), (256,), args)
            with pytest.raises(RuntimeError, match="peer access to it was never enabled"):
                cp.cuda.Device(2).synchronize()
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


# ----------------------------------------------------------------------------- asynchronous work
# The fake queues device work per stream and runs it only when something waits for it, so the
# races GPU code is prone to give wrong data every time instead of once in a while on a busy GPU.


def _pinned(cp, values):
    import cupyx

    p = cupyx.empty_pinned(len(values), np.float32)
    p[:] = values
    return p


def test_async_copy_reads_a_pinned_buffer_when_it_runs(cp):
    s = cp.cuda.Stream(non_blocking=True)
    host = _pinned(cp, [1, 2, 3])
    d = cp.empty(3, cp.float32)
    d.set(host, stream=s)
    host[:] = 7  # the host overwrites the staging buffer before the copy ran: the race
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(d), [7, 7, 7])
    host[:] = [4, 5, 6]
    d.set(host, stream=s)
    ev = s.record()
    ev.synchronize()  # the right way: wait for the copy before reusing the buffer
    host[:] = 9
    np.testing.assert_array_equal(cp.asnumpy(d), [4, 5, 6])
    # From pageable memory the driver stages the data at once: no race.
    d.set(np.array([1, 1, 2], np.float32), stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(d), [1, 1, 2])


def test_a_consumer_stream_must_wait_for_the_copy_streams_event(cp):
    copy_s = cp.cuda.Stream(non_blocking=True)
    d = cp.zeros(4, cp.float32)
    cp.cuda.Device(0).synchronize()
    d.set(_pinned(cp, [1, 2, 3, 4]), stream=copy_s)
    done = copy_s.record()
    stale = d * 10  # on the null stream: a non-blocking stream's copy is not ordered before it
    np.testing.assert_array_equal(cp.asnumpy(stale), [0, 0, 0, 0])
    assert copy_s.done  # querying runs the queue (a polling loop terminates)
    d2 = cp.zeros(4, cp.float32)
    cp.cuda.Device(0).synchronize()
    d2.set(_pinned(cp, [1, 2, 3, 4]), stream=copy_s)
    done = copy_s.record()
    cp.cuda.get_current_stream().wait_event(done)
    np.testing.assert_array_equal(cp.asnumpy(d2 * 10), [10, 20, 30, 40])


def test_legacy_null_stream_orders_against_blocking_streams_only(cp):
    blocking, free = cp.cuda.Stream(), cp.cuda.Stream(non_blocking=True)
    for s, want in ((blocking, [2, 4]), (free, [0, 0])):
        d = cp.zeros(2, cp.float32)
        cp.cuda.Device(0).synchronize()
        d.set(_pinned(cp, [1, 2]), stream=s)
        np.testing.assert_array_equal(cp.asnumpy(d * 2), want)  # get() syncs the null stream only
        s.synchronize()
    # ... and a blocking stream's work waits for the null stream's earlier work.
    d = cp.zeros(2, cp.float32)
    d += 5
    with blocking:
        e = d * 3
    blocking.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(e), [15, 15])


def test_get_synchronizes_only_the_current_stream(cp):
    s = cp.cuda.Stream(non_blocking=True)
    d = cp.zeros(3, cp.float32)
    cp.cuda.Device(0).synchronize()
    with s:
        d += 1
    np.testing.assert_array_equal(d.get(), [0, 0, 0])  # the null stream knows nothing of s
    with s:
        np.testing.assert_array_equal(d.get(), [1, 1, 1])  # get() on s syncs s
    with s:
        d += 1
        assert float(d.sum()) == 6.0  # item()/float() sync the current stream too


def test_pool_reuses_a_freed_block_on_its_stream_and_queued_work_on_another_races(cp):
    copy_s = cp.cuda.Stream(non_blocking=True)
    x = cp.asarray(np.arange(256, dtype=np.float32))
    cp.cuda.Device(0).synchronize()
    ptr = x.data.ptr
    y = x * 2  # queued on the null stream, reads x when it runs
    del x  # CuPy's pool takes the block back at once (stream-ordered for the null stream)
    z = cp.empty(256, cp.float32)
    assert z.data.ptr == ptr  # the next allocation of that size on the same stream gets it
    z.set(_pinned(cp, np.full(256, -1)), stream=copy_s)  # written without waiting for y's kernel
    copy_s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y), np.full(256, -2))  # y read the new owner's data
    # The fix: the copy stream waits for the work queued on the allocating stream first.
    x = cp.asarray(np.arange(256, dtype=np.float32))
    y = x * 2
    del x
    z = cp.empty(256, cp.float32)
    copy_s.wait_event(cp.cuda.get_current_stream().record())
    z.set(_pinned(cp, np.full(256, -1)), stream=copy_s)
    copy_s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y), np.arange(256) * 2)
    with copy_s:
        w = cp.empty(256, cp.float32)  # another stream's allocation never gets a block freed on this one
    assert w.data.ptr != z.data.ptr


def test_sync_mode_runs_everything_at_once(cp):
    cp._emu.SYNC = True
    try:
        s = cp.cuda.Stream(non_blocking=True)
        host = _pinned(cp, [1, 2])
        d = cp.empty(2, cp.float32)
        d.set(host, stream=s)
        host[:] = 0  # too late: the copy ran already
        np.testing.assert_array_equal(cp.asnumpy(d), [1, 2])
    finally:
        cp._emu.SYNC = False


def test_elapsed_time_needs_completed_events(cp):
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    cp.ones(10) * 2
    b.record()
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="NotReady"):
        cp.cuda.get_elapsed_time(a, b)
    b.synchronize()
    assert cp.cuda.get_elapsed_time(a, b) >= 0


class _MiniFeeder:
    """A small copy of cudist's GPU input pattern (_gpu_feeder.GpuFeeder): host batches packed
    into a ring of pinned slots, copied on a non-blocking copy stream into arrays allocated on the
    consumer's stream, handed out after the consumer waits for the copy's event. ``bug`` drops
    one of its three waits."""

    def __init__(self, cp, bug=None, ring=2):
        self.cp, self.bug = cp, bug
        self.copy = cp.cuda.Stream(non_blocking=True)
        self.slots = [[None, None] for _ in range(ring)]  # [pinned buffer, event of its last copy]
        self.i = 0

    def put(self, batch):
        cp = self.cp
        slot = self.slots[self.i % len(self.slots)]
        self.i += 1
        if slot[1] is not None and self.bug != "slot_wait":
            slot[1].synchronize()  # the copy that read this buffer last time is done
        if slot[0] is None:
            import cupyx

            slot[0] = cupyx.empty_pinned(batch.shape, batch.dtype)
        slot[0][...] = batch
        out = cp.empty(batch.shape, batch.dtype)
        if self.bug != "ready_wait":
            self.copy.wait_event(cp.cuda.get_current_stream().record())
        out.set(slot[0], stream=self.copy)
        slot[1] = self.copy.record()
        return out, slot[1]

    def hand_out(self, flight):
        out, ev = flight
        if self.bug != "consumer_wait":
            self.cp.cuda.get_current_stream().wait_event(ev)
        return out


@pytest.mark.parametrize("bug", [None, "consumer_wait", "slot_wait", "ready_wait"])
def test_a_race_planted_in_the_input_pipeline_pattern_is_caught(cp, bug):
    feeder = _MiniFeeder(cp, bug)
    batches = [np.arange(512, dtype=np.float32) + 1000 * k for k in range(6)]
    ahead = [feeder.put(batches[0])]  # one step in flight ahead of the consumer, as cudist does
    results = []
    for k in range(len(batches)):
        if k + 1 < len(batches):
            ahead.append(feeder.put(batches[k + 1]))
        x = feeder.hand_out(ahead.pop(0))
        results.append(x * 2)  # the training step: queued on the consumer's stream
        del x  # the batch is dropped: its block goes back to the pool for the next step
    got = [cp.asnumpy(r) for r in results]
    ok = all(np.array_equal(g, b * 2) for g, b in zip(got, batches))
    assert ok == (bug is None), f"planted race {bug!r} {'went unnoticed' if ok else 'broke a correct pipeline'}"
