"""Cross-GPU ordering and aliasing of the cupy backend: the cases a sequential emulator used to let
through (issue 15), each written so that the fake CuPy fails it deterministically when the order is
missing. On a real GPU these are races: they pass by luck or fail now and then.

* all_gather: the gathering GPU copies the sources; each source GPU must wait for those copies
  before it overwrites or frees its buffer (under the fake the ``streams`` mode, which runs other
  streams' queued work first, is switched on for these tests).
* packing a replica's leaves when one sits on another GPU: an ordered cross-device copy.
* reduce_to_one into an output that partially overlaps an input, for every replica count.
* buffers from a stream-ordered pool (cudaMallocAsync, CuPy's MemoryAsyncPool) are not mapped for
  peers by cudaDeviceEnablePeerAccess: kernels on another GPU must not touch them.
* float32 subnormals: CuPy compiles with -ftz=true, which makes the __f*_rn intrinsics flush them
  (the fake's ``ftz`` mode does the same); the kernels must keep them, as NumPy does.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from cudist._reduce_util import ReduceOp

cupy = pytest.importorskip("cupy")


@pytest.fixture
def backend():
    from cudist._kernels import get_backend

    return get_backend("cupy")


@pytest.fixture
def streams_out_of_order(monkeypatch):
    """Under the fake CuPy: other streams' queued work runs first whenever work must run."""
    emu = getattr(cupy, "_emu", None)
    if emu is not None:
        monkeypatch.setattr(emu, "MODES", emu.MODES | {"streams"})
    yield


def _on(device, host):
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("count", [5, 1000])
def test_all_gather_sources_may_be_overwritten_right_after(backend, streams_out_of_order, count):
    n = min(cupy.cuda.runtime.getDeviceCount(), 3)
    hosts = [np.arange(count, dtype=np.float32) + 1000 * r for r in range(n)]
    bufs = [_on(r, h) for r, h in enumerate(hosts)]
    for b in bufs:
        b.device.synchronize()
    out = backend.all_gather(bufs, 0)
    for r in range(1, n):  # each source GPU reuses its buffer at once, on its own stream
        with cupy.cuda.Device(r):
            bufs[r].fill(-1)
    np.testing.assert_array_equal(cupy.asnumpy(out), np.concatenate(hosts))


@pytest.mark.multi_gpu
def test_all_gather_sources_may_be_freed_right_after(backend, streams_out_of_order):
    count = 4096
    hosts = [np.full(count, r + 1, np.float32) for r in range(2)]
    bufs = [_on(r, h) for r, h in enumerate(hosts)]
    for b in bufs:
        b.device.synchronize()
    out = backend.all_gather(bufs, 0)
    del bufs[1]  # back to GPU 1's pool: the next allocation of that size on its stream gets it
    with cupy.cuda.Device(1):
        reuse = cupy.empty(count, np.float32)
        reuse.fill(-7)
    np.testing.assert_array_equal(cupy.asnumpy(out), np.concatenate(hosts))
    del reuse


@pytest.mark.multi_gpu
def test_packing_orders_the_copy_of_a_leaf_on_another_gpu():
    """GPU 1 is still computing the leaf when replica 0's pack copies it to GPU 0 (the fake's lazy
    order runs GPU 0's queue first unless the copy waits for GPU 1)."""
    from cudist._dataplane import reduce as reductions

    count = 777
    with cupy.cuda.Device(1):
        far = cupy.arange(count, dtype=cupy.float32)  # queued on GPU 1, not yet run
        far *= 2
    near = _on(0, np.ones(count, np.float32))
    other = [_on(1, np.full(count, 3, np.float32)), _on(1, np.full(count, 5, np.float32))]
    out = reductions.batch_reduce("test", ReduceOp.SUM, [[near, far], other])
    with cupy.cuda.Device(1):
        far.fill(-1)  # GPU 1 overwrites the leaf right after
    np.testing.assert_array_equal(cupy.asnumpy(out[0]), np.full(count, 4, np.float32))
    np.testing.assert_array_equal(cupy.asnumpy(out[1]), np.arange(count, dtype=np.float32) * 2 + 5)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3, 8, 9])
@pytest.mark.parametrize("shift", [-8, -1, 1, 8])
def test_reduce_to_one_into_a_partially_overlapping_output(backend, n, shift):
    """The output overlaps one input at another offset: the result is as if written to a temporary."""
    from cudist._kernels._numpy import reference_reduce

    count = 3000
    rng = np.random.default_rng(n * 100 + shift)
    hosts = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    big = cupy.zeros(count + 2 * abs(shift) + 16, np.float32)
    at = abs(shift) + 8
    big[at : at + count] = cupy.asarray(hosts[n - 1])
    bufs = [cupy.asarray(h) for h in hosts[:-1]] + [big[at : at + count]]
    out = big[at + shift : at + shift + count]
    want = reference_reduce(hosts, ReduceOp.SUM)
    backend.reduce_to_one(bufs, ReduceOp.SUM, out)
    np.testing.assert_array_equal(cupy.asnumpy(out), want)


@pytest.mark.multi_gpu
def test_buffers_of_an_async_pool_are_staged_not_touched_by_peers(backend):
    if not hasattr(cupy.cuda, "MemoryAsyncPool"):
        pytest.skip("this CuPy has no MemoryAsyncPool")
    pool = cupy.cuda.MemoryAsyncPool()
    cupy.cuda.set_allocator(pool.malloc)
    try:
        count = 1 << 19  # large enough for the two-shot path between GPUs
        hosts = [np.full(count, r + 1, np.float32) for r in range(2)]
        bufs = [_on(r, h) for r, h in enumerate(hosts)]
        backend.all_reduce(bufs, ReduceOp.SUM)
        for b in bufs:
            np.testing.assert_array_equal(cupy.asnumpy(b), np.full(count, 3, np.float32))
        gathered = backend.all_gather(bufs, 0)
        assert gathered.shape == (2 * count,)
        batch = _on(0, np.arange(16, dtype=np.float32))
        pieces = backend.scatter(batch, [0, 1])
        np.testing.assert_array_equal(cupy.asnumpy(pieces[1]), np.arange(8, 16, dtype=np.float32))
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


@pytest.fixture
def flush_to_zero():
    """Under the fake CuPy: float32 intrinsics flush subnormals, as CuPy's -ftz=true makes them."""
    raw = getattr(cupy, "_raw", None)
    if raw is None:
        yield  # a real GPU: CuPy compiles with -ftz=true anyway
        return
    lib = raw._library()
    modes = os.environ.get("CUDIST_EMU_MODE", "").split(",")
    seed = int(os.environ.get("CUDIST_EMU_SEED", "0"))
    lib.cudist_emu_set_modes(int("shuffle" in modes), 1, seed)
    try:
        yield
    finally:
        lib.cudist_emu_set_modes(int("shuffle" in modes), int("ftz" in modes), seed)


_TINY = np.float32(np.finfo(np.float32).smallest_subnormal)


@pytest.mark.gpu
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_float32_subnormals_survive_all_reduce(backend, flush_to_zero, op):
    from cudist._kernels._numpy import reference_reduce

    hosts = [np.array([3, -1, 1000, 7e5, 1], np.float32) * _TINY * np.float32(k + 1) for k in range(3)]
    hosts[0][-1] = np.float32(1e-30)
    want = reference_reduce(hosts, op)
    assert np.count_nonzero(want) and np.any(np.abs(want) < np.finfo(np.float32).tiny)
    bufs = [cupy.asarray(h) for h in hosts]
    backend.all_reduce(bufs, op)
    for b in bufs:
        np.testing.assert_array_equal(cupy.asnumpy(b).view(np.uint32), want.view(np.uint32))


@pytest.mark.gpu
def test_float32_subnormals_survive_the_updates(backend, flush_to_zero):
    from cudist._kernels import get_backend

    ref = get_backend("numpy")
    count = 37
    w0 = (np.arange(count, dtype=np.float32) - 18) * _TINY * np.float32(100)
    g = (np.arange(count, dtype=np.float32) % 5) * _TINY * np.float32(30)
    host = [w0.copy(), w0.copy()]
    ref.sgd(host, g, lr=0.5)
    dev = [cupy.asarray(w0), cupy.asarray(w0)]
    backend.sgd(dev, cupy.asarray(g), lr=0.5)
    for d in dev:
        np.testing.assert_array_equal(cupy.asnumpy(d).view(np.uint32), host[0].view(np.uint32))


# ------------------------------------------------------------------------- launch overheads on paper
@pytest.fixture
def nvrtc_backend(monkeypatch):
    """A cupy backend launching everything through NVRTC (CUDIST_CUDA_LAUNCHERS=nvrtc): the C++
    launchers of cudist._core size their grids and join their streams themselves."""
    from cudist._kernels._cupy import CupyBackend

    monkeypatch.setenv("CUDIST_CUDA_LAUNCHERS", "nvrtc")
    return CupyBackend()


@pytest.mark.multi_gpu
def test_joins_reuse_one_event_per_device_and_stream(nvrtc_backend, monkeypatch):
    """Two-shot all-reduce over k GPUs joins their streams twice. Each join records one event per
    GPU, reused across calls: no event is created after the first call (it used to create one per
    (waiter, source) pair: 2·k·(k-1) per call, 112 for 8 GPUs)."""
    from cudist import _arrays

    backend = nvrtc_backend

    k = min(cupy.cuda.runtime.getDeviceCount(), 4)
    created, recorded = [], []
    real_event, real_after = cupy.cuda.Event, _arrays._event_after

    class Counting(real_event):
        def __init__(self, *a, **kw):
            created.append(1)
            super().__init__(*a, **kw)

    def after(cp, device):
        recorded.append(device)
        return real_after(cp, device)

    monkeypatch.setattr(cupy.cuda, "Event", Counting)
    monkeypatch.setattr(_arrays, "_event_after", after)
    count = (1 << 20) // 4 * k  # 1 MiB per buffer and more: the two-shot path
    bufs = [_on(d, np.full(count, d + 1, np.float32)) for d in range(k)]
    backend.all_reduce(bufs, ReduceOp.SUM)
    assert len(created) <= k
    created.clear(), recorded.clear()
    backend.all_reduce(bufs, ReduceOp.SUM)
    assert created == [] and sorted(recorded) == sorted(list(range(k)) * 2)
    want = np.full(count, k * (k + 1) // 2 * k, np.float32)
    for b in bufs:
        np.testing.assert_array_equal(cupy.asnumpy(b), want)


@pytest.mark.gpu
def test_grid_is_sms_times_the_kernels_occupancy(monkeypatch):
    """The grid of an NVRTC launch fills one wave: SMs x the resident blocks per SM the driver
    computes for the kernel (asked once per device, dtype and kernel), not a fixed 8 per SM."""
    from cudist._kernels._cupy import CupyBackend

    monkeypatch.setenv("CUDIST_CUDA_LAUNCHERS", "nvrtc")
    calls = []
    real = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor

    def occupancy(func, block, smem):
        calls.append((func, block, smem))
        return 3

    monkeypatch.setattr(cupy.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", occupancy)
    be = CupyBackend()
    n = 1 << 22
    bufs = [cupy.ones(n, np.float32) for _ in range(2)]
    be.all_reduce(bufs, ReduceOp.SUM)
    be.all_reduce(bufs, ReduceOp.SUM)
    assert len(calls) == 1 and calls[0][1:] == (256, 0)
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    assert be._grid(0, n, 4, "all_reduce_one_shot", np.float32) == sms * 3
    assert be._grid(0, 10, 4, "all_reduce_one_shot", np.float32) == 1
    np.testing.assert_array_equal(cupy.asnumpy(bufs[0][:4]), np.full(4, 4, np.float32))
    assert real is not occupancy
