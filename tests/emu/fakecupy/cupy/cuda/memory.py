"""Fake ``cupy.cuda.memory``: device and pinned memory over the emulator's registry."""

from __future__ import annotations

import ctypes

from cupy import _emu
from cupy.cuda import runtime

_peer_access_checked: set[tuple[int, int]] = set()


def _set_peer_access(device: int, peer: int) -> None:
    """As CuPy's MemoryPointer._set_peer_access: a cross-device copy enables peer access once."""
    pair = (device, peer)
    if pair in _peer_access_checked:
        return
    can = runtime.deviceCanAccessPeer(device, peer) if device != peer else 0
    _peer_access_checked.add(pair)
    if not can:
        return
    current = runtime.getDevice()
    runtime.setDevice(device)
    try:
        runtime.deviceEnablePeerAccess(peer)
    except runtime.CUDARuntimeError as e:
        if e.status != runtime.cudaErrorPeerAccessAlreadyEnabled:
            raise
    finally:
        runtime.setDevice(current)


class Memory:
    """A device allocation (``cupy.cuda.Memory``), from the emulated pool of the current stream."""

    def __init__(self, size: int):
        self.size = int(size)
        self.device_id = runtime.getDevice()
        s = _emu.THREAD.streams.get(self.device_id)
        self._block, self._alloc, self._owner = _emu.allocate(self.size, self.device_id, 0 if s is None else s.ptr)
        self.ptr = 0 if self._alloc is None else self._alloc.ptr

    @property
    def device(self):
        from cupy.cuda import Device

        return Device(self.device_id)


class UnownedMemory:
    """Memory owned by someone else (``cupy.cuda.UnownedMemory``), kept alive through ``owner``."""

    def __init__(self, ptr: int, size: int, owner, device_id: int | None = None):
        self.ptr, self.size, self.owner = int(ptr), int(size), owner
        if device_id is None:
            a = _emu.find(self.ptr)
            device_id = a.device if a is not None and a.device is not None else runtime.getDevice()
        self.device_id = device_id


class MemoryAsync(UnownedMemory):
    """What ``ndarray.data.mem`` is for memory of a stream-ordered pool (``cupy.cuda.MemoryAsync``)."""


class MemoryAsyncPool:
    """Stand-in for ``cupy.cuda.MemoryAsyncPool`` (cudaMallocAsync): ``set_allocator(pool.malloc)``
    makes later device allocations come from a stream-ordered pool, which peers cannot touch."""

    def __init__(self, pool_handles="current"):
        self.pool_handles = pool_handles

    def malloc(self, size: int) -> MemoryPointer:
        return MemoryPointer(Memory(size), 0)


def _addr(mem) -> int:
    if isinstance(mem, int):
        return mem
    if isinstance(mem, ctypes.c_void_p):
        return int(mem.value or 0)
    raise TypeError(f"expected an int or ctypes.c_void_p address, got {type(mem).__name__}")


def _stream_queue(stream):
    """The queue a copy on ``stream`` (None: the current stream) goes to."""
    if stream is None:
        return _emu.current_queue()
    ptr = int(getattr(stream, "ptr", 0) or 0)
    if ptr in (0, 1):
        return _emu.queue(runtime.getDevice(), 0)
    return _emu.queue(stream.device_id, ptr, getattr(stream, "non_blocking", False))


def _memmove_op(dst: int, src: int, size: int, keep):
    """Queued ``memmove``; ``keep`` (the Allocations involved) keeps the bytes mapped until it runs."""

    def run():
        _ = keep
        ctypes.memmove(dst, src, size)

    return run


def _enqueue_copy(q, dst: int, src: int, size: int, what: str, *, host_src=False, host_dst=False) -> int:
    """Queues a copy of ``size`` bytes; device ends are checked now (live memory), as the driver does.

    A pageable host source is read now (the driver stages it); pinned host memory is read or
    written when the copy runs.
    """
    keep = []
    for p, end, host in ((dst, "destination", host_dst), (src, "source", host_src)):
        if host:
            a = _emu.find(p)
            if a is None:
                continue  # pageable
            keep.append(a)
        else:
            keep.append(_emu.check_range(p, size, f"{what} {end}"))
    if host_src and _emu.find(src) is None:
        staged = ctypes.create_string_buffer(ctypes.string_at(src, size), size)
        keep.append(staged)
        src = ctypes.addressof(staged)
    return _emu.enqueue(q, _memmove_op(dst, src, size, keep), what)


class MemoryPointer:
    """A pointer into device memory (``cupy.cuda.MemoryPointer``).

    Copies are queued like on a GPU: ``*_async`` ones on the given (default: current) stream, the
    synchronous ones (cudaMemcpy/cudaMemset) on the legacy null stream of the current device, and
    those involving host memory then wait for that stream where CUDA makes the host wait.
    """

    def __init__(self, mem, offset: int):
        self.mem = mem
        self.device_id = mem.device_id
        self.ptr = mem.ptr + int(offset)

    @property
    def device(self):
        from cupy.cuda import Device

        return Device(self.device_id)

    def __int__(self):
        return self.ptr

    def __add__(self, offset):
        assert self.ptr != 0 or offset == 0
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

    __radd__ = __add__

    def __sub__(self, offset):
        return self + (-int(offset))

    def _null(self):
        return _emu.queue(runtime.getDevice(), 0)

    def copy_from_device(self, src: MemoryPointer, size: int) -> None:
        self.copy_from_device_async(src, size, _NULL)

    def copy_from_device_async(self, src: MemoryPointer, size: int, stream=None) -> None:
        if not isinstance(src, MemoryPointer):
            raise TypeError(f"Argument 'src' has incorrect type (expected cupy.cuda.memory.MemoryPointer, got {type(src).__name__})")
        if size > 0:
            _set_peer_access(src.device_id, self.device_id)
            with _emu.LOCK:
                _enqueue_copy(_stream_queue(stream), self.ptr, src.ptr, size, "cudaMemcpyAsync")

    def copy_from_host(self, mem, size: int) -> None:
        if size > 0:
            with _emu.LOCK:
                q = self._null()
                _emu.synchronize_queue(q)  # CUDA: a stream sync before a copy from host memory
                seq = _enqueue_copy(q, self.ptr, _addr(mem), size, "cudaMemcpy", host_src=True)
                if _emu.find(_addr(mem)) is not None:
                    _emu.run_until(q, seq)  # from pinned memory cudaMemcpy returns when it is done

    def copy_from_host_async(self, mem, size: int, stream=None) -> None:
        if size > 0:
            with _emu.LOCK:
                _enqueue_copy(_stream_queue(stream), self.ptr, _addr(mem), size, "cudaMemcpyAsync", host_src=True)

    def copy_from(self, mem, size: int) -> None:
        if isinstance(mem, MemoryPointer):
            self.copy_from_device(mem, size)
        else:
            self.copy_from_host(mem, size)

    def copy_from_async(self, mem, size: int, stream=None) -> None:
        if isinstance(mem, MemoryPointer):
            self.copy_from_device_async(mem, size, stream)
        else:
            self.copy_from_host_async(mem, size, stream)

    def copy_to_host(self, mem, size: int) -> None:
        if size > 0:
            with _emu.LOCK:
                q = self._null()
                _emu.run_until(q, _enqueue_copy(q, _addr(mem), self.ptr, size, "cudaMemcpy", host_dst=True))

    def copy_to_host_async(self, mem, size: int, stream=None) -> None:
        if size > 0:
            with _emu.LOCK:
                q = _stream_queue(stream)
                seq = _enqueue_copy(q, _addr(mem), self.ptr, size, "cudaMemcpyAsync", host_dst=True)
                if _emu.find(_addr(mem)) is None:
                    _emu.run_until(q, seq)  # into pageable memory it returns once the copy is done

    def memset(self, value: int, size: int) -> None:
        self.memset_async(value, size, _NULL)

    def memset_async(self, value: int, size: int, stream=None) -> None:
        if size > 0:
            with _emu.LOCK:
                a = _emu.check_range(self.ptr, size, "cudaMemset")
                ptr, v = self.ptr, int(value)

                def run():
                    _ = a
                    ctypes.memset(ptr, v, size)

                _emu.enqueue(_stream_queue(stream), run, "cudaMemset")


class _NullStream:
    ptr = 0


_NULL = _NullStream()


def alloc(size: int) -> MemoryPointer:
    return MemoryPointer(Memory(size), 0)


# ----------------------------------------------------------------------------------- pinned memory
class PinnedMemory:
    """Page-locked host memory: every device may read and write it (unified addressing)."""

    def __init__(self, size: int, flags: int = 0):
        self.size = int(size)
        self._block, self._alloc, self._owner = _emu.allocate(self.size, None)
        self.ptr = 0 if self._alloc is None else self._alloc.ptr


class PinnedMemoryPointer:
    """A pointer into pinned memory with the buffer protocol, like CuPy's (``np.frombuffer(mem, ...)``).

    Python 3.11 has no pure-Python buffer protocol, so each instance is really a ctypes byte array
    over the memory (a per-size subclass mixing this class in).
    """

    def __new__(cls, mem: PinnedMemory, offset: int = 0):
        offset = int(offset)
        n = mem.size - offset
        sub = _pinned_classes.get(n)
        if sub is None:
            sub = _pinned_classes[n] = type("PinnedMemoryPointer", (PinnedMemoryPointer, ctypes.c_ubyte * n), {})
        self = sub.from_address(mem.ptr + offset) if n else sub()
        self.mem, self.ptr, self._offset = mem, mem.ptr + offset, offset
        return self

    def __init__(self, mem=None, offset=0):
        pass

    def size(self) -> int:
        return self.mem.size - self._offset

    def __int__(self):
        return self.ptr


_pinned_classes: dict[int, type] = {}


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    return PinnedMemoryPointer(PinnedMemory(size), 0)


class MemoryPool:
    """Stand-in for ``cupy.cuda.MemoryPool`` over the emulator's stream-ordered pool."""

    def malloc(self, size: int) -> MemoryPointer:
        return alloc(size)

    def free_all_blocks(self, stream=None) -> None:
        _emu.free_all_blocks(runtime.getDevice())

    def used_bytes(self) -> int:
        dev = runtime.getDevice()
        return sum(a.capacity for a in list(_emu._ALLOCS.values()) if a.device == dev and a.live)

    def total_bytes(self) -> int:
        dev = runtime.getDevice()
        return sum(a.capacity for a in list(_emu._ALLOCS.values()) if a.device == dev)


class PinnedMemoryPool:
    def malloc(self, size: int) -> PinnedMemoryPointer:
        return alloc_pinned_memory(size)

    def free_all_blocks(self) -> None:
        _emu.free_all_blocks(pinned=True)
