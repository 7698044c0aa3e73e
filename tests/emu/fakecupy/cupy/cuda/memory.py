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
    """A device allocation (``cupy.cuda.Memory``)."""

    def __init__(self, size: int):
        self.size = int(size)
        self.device_id = runtime.getDevice()
        self._block, self._alloc = _emu.allocate(self.size, self.device_id)
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


def _addr(mem) -> int:
    if isinstance(mem, int):
        return mem
    if isinstance(mem, ctypes.c_void_p):
        return int(mem.value or 0)
    raise TypeError(f"expected an int or ctypes.c_void_p address, got {type(mem).__name__}")


def _memmove(dst: int, src: int, size: int, what: str) -> None:
    if size <= 0:
        return
    _emu.check_range(dst, size, f"{what} destination")
    _emu.check_range(src, size, f"{what} source")
    ctypes.memmove(dst, src, size)


class MemoryPointer:
    """A pointer into device memory (``cupy.cuda.MemoryPointer``)."""

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

    def copy_from_device(self, src: MemoryPointer, size: int) -> None:
        if not isinstance(src, MemoryPointer):
            raise TypeError(f"Argument 'src' has incorrect type (expected cupy.cuda.memory.MemoryPointer, got {type(src).__name__})")
        if size > 0:
            _set_peer_access(src.device_id, self.device_id)
            _memmove(self.ptr, src.ptr, size, "cudaMemcpy")

    def copy_from_device_async(self, src: MemoryPointer, size: int, stream=None) -> None:
        self.copy_from_device(src, size)

    def copy_from_host(self, mem, size: int) -> None:
        if size > 0:
            src = _addr(mem)
            _emu.check_range(self.ptr, size, "cudaMemcpy destination")
            ctypes.memmove(self.ptr, src, size)

    def copy_from_host_async(self, mem, size: int, stream=None) -> None:
        self.copy_from_host(mem, size)

    def copy_from(self, mem, size: int) -> None:
        if isinstance(mem, MemoryPointer):
            self.copy_from_device(mem, size)
        else:
            self.copy_from_host(mem, size)

    def copy_from_async(self, mem, size: int, stream=None) -> None:
        self.copy_from(mem, size)

    def copy_to_host(self, mem, size: int) -> None:
        if size > 0:
            dst = _addr(mem)
            _emu.check_range(self.ptr, size, "cudaMemcpy source")
            ctypes.memmove(dst, self.ptr, size)

    def copy_to_host_async(self, mem, size: int, stream=None) -> None:
        self.copy_to_host(mem, size)

    def memset(self, value: int, size: int) -> None:
        if size > 0:
            _emu.check_range(self.ptr, size, "cudaMemset")
            ctypes.memset(self.ptr, int(value), size)

    def memset_async(self, value: int, size: int, stream=None) -> None:
        self.memset(value, size)


def alloc(size: int) -> MemoryPointer:
    return MemoryPointer(Memory(size), 0)


# ----------------------------------------------------------------------------------- pinned memory
class PinnedMemory:
    """Page-locked host memory: every device may read and write it (unified addressing)."""

    def __init__(self, size: int, flags: int = 0):
        self.size = int(size)
        self._block, self._alloc = _emu.allocate(self.size, None)
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
    """Stand-in for ``cupy.cuda.MemoryPool`` (allocation goes straight to the emulator)."""

    def malloc(self, size: int) -> MemoryPointer:
        return alloc(size)

    def free_all_blocks(self, stream=None) -> None:
        pass

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0


class PinnedMemoryPool:
    def malloc(self, size: int) -> PinnedMemoryPointer:
        return alloc_pinned_memory(size)

    def free_all_blocks(self) -> None:
        pass
