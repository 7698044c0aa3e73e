"""State of the emulated CUDA machine behind the fake ``cupy``: devices, peer access, memory.

Device memory is host memory (NumPy buffers) tagged with the device that owns it, so the emulated
kernels (plain C++ compiled for the host) can run on it through ctypes. Every live allocation is
kept in a registry (address range -> owner), which lets the fake do what real hardware does and
the plain NumPy world cannot: refuse a kernel that touches memory its device may not reach
(another GPU's memory without enabled peer access), like CUDA's illegal address error.

Configuration (environment, read once at import):
    CUDIST_EMU_DEVICES: number of GPUs (default 4).
    CUDIST_EMU_PEER: which GPU pairs may access each other's memory: ``all`` (default), ``none``,
        or groups such as ``0,1;2,3`` (peer access only within a group).
    CUDIST_EMU_SMS: multiprocessors per GPU (default 2: small grids make the kernels' grid-stride
        loops take several turns on the test sizes).
    CUDIST_EMU_NCCL: ``0`` makes ``cupy.cuda.nccl.available`` False.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref

import numpy as np

ALIGN = 256  # CuPy's allocator hands out 256-byte aligned blocks (the pool rounds to 512 bytes)
GUARD = 64  # bytes after each allocation, checked after every kernel for out-of-bounds writes
GUARD_BYTE = 0xA5


def _device_count() -> int:
    raw = os.environ.get("CUDIST_EMU_DEVICES", "4")
    try:
        n = int(raw)
    except ValueError:
        raise RuntimeError(f"CUDIST_EMU_DEVICES must be an integer, got {raw!r}") from None
    if n < 0:
        raise RuntimeError(f"CUDIST_EMU_DEVICES must be >= 0, got {n}")
    return n


DEVICE_COUNT = _device_count()
SMS = int(os.environ.get("CUDIST_EMU_SMS", "2"))
NCCL_AVAILABLE = os.environ.get("CUDIST_EMU_NCCL", "1") != "0"


def _peer_groups():
    spec = os.environ.get("CUDIST_EMU_PEER", "all").strip().lower()
    if spec == "all":
        return [set(range(DEVICE_COUNT))]
    if spec == "none":
        return []
    return [{int(x) for x in g.split(",") if x.strip()} for g in spec.split(";")]


_PEER_GROUPS = _peer_groups()


def can_access_peer(device: int, peer: int) -> bool:
    """cudaDeviceCanAccessPeer: whether ``device`` could map ``peer``'s memory (never itself)."""
    if device == peer:
        return False
    return any(device in g and peer in g for g in _PEER_GROUPS)


# --------------------------------------------------------------------------------------- threads
class _ThreadState(threading.local):
    def __init__(self):
        self.device = 0
        self.streams = {}  # device -> current Stream (absent: the null stream)


THREAD = _ThreadState()

# (device, peer) pairs with peer access enabled on `device` (cudaDeviceEnablePeerAccess).
PEER_ENABLED: set[tuple[int, int]] = set()


def current_device() -> int:
    return THREAD.device


def check_device_id(device: int) -> None:
    from cupy.cuda.runtime import CUDARuntimeError, cudaErrorInvalidDevice

    if not isinstance(device, (int, np.integer)) or not 0 <= int(device) < DEVICE_COUNT:
        raise CUDARuntimeError(cudaErrorInvalidDevice)


# --------------------------------------------------------------------------------------- memory
class Allocation:
    """One live block: device memory (``device`` set) or pinned host memory (``device`` None)."""

    __slots__ = ("ptr", "size", "device", "_raw", "guard_at", "__weakref__")

    def __init__(self, ptr, size, device, raw, guard_at):
        # Weak: the memory lives exactly as long as some array (a view of `raw`) uses it.
        self.ptr, self.size, self.device, self._raw, self.guard_at = ptr, size, device, weakref.ref(raw), guard_at

    @property
    def raw(self) -> np.ndarray:
        raw = self._raw()
        if raw is None:
            raise IllegalAddress(f"allocation at {self.ptr:#x} was freed")
        return raw

    @property
    def pinned(self) -> bool:
        return self.device is None

    def guard_intact(self) -> bool:
        g = self.raw[self.guard_at : self.guard_at + GUARD]
        return bool(np.all(g == GUARD_BYTE))

    def where(self) -> str:
        return "pinned host memory" if self.device is None else f"device {self.device}"


_LOCK = threading.RLock()
_STARTS: list[int] = []
_ALLOCS: dict[int, Allocation] = {}


def _forget(ptr: int) -> None:
    with _LOCK:
        if _ALLOCS.pop(ptr, None) is not None:
            i = bisect.bisect_left(_STARTS, ptr)
            if i < len(_STARTS) and _STARTS[i] == ptr:
                del _STARTS[i]


def allocate(nbytes: int, device: int | None) -> tuple[np.ndarray, Allocation | None]:
    """A fresh block of ``nbytes`` on ``device`` (None: pinned host memory).

    Returns the block as a uint8 NumPy array (its memory stays registered while any view of it is
    alive) and its Allocation; a zero-byte block is unregistered and has address 0, as in CuPy.
    """
    nbytes = int(nbytes)
    if nbytes == 0:
        return np.empty(0, np.uint8), None
    raw = np.empty(nbytes + ALIGN + GUARD, np.uint8)
    base = raw.__array_interface__["data"][0]
    off = (-base) % ALIGN
    raw[off + nbytes : off + nbytes + GUARD] = GUARD_BYTE
    block = raw[off : off + nbytes]
    ptr = base + off
    alloc = Allocation(ptr, nbytes, device, raw, off + nbytes)
    with _LOCK:
        _ALLOCS[ptr] = alloc
        bisect.insort(_STARTS, ptr)
    weakref.finalize(raw, _forget, ptr)
    return block, alloc


def find(ptr: int) -> Allocation | None:
    """The live allocation containing address ``ptr`` (None when there is none)."""
    with _LOCK:
        i = bisect.bisect_right(_STARTS, ptr) - 1
        if i < 0:
            return None
        a = _ALLOCS.get(_STARTS[i])
        if a is None or not (a.ptr <= ptr < a.ptr + a.size):
            return None
        return a


def may_access(device: int, alloc: Allocation) -> bool:
    """Whether a kernel running on ``device`` may touch ``alloc``."""
    return alloc.device is None or alloc.device == device or (device, alloc.device) in PEER_ENABLED


def check_range(ptr: int, nbytes: int, what: str, *, device: int | None = None) -> Allocation | None:
    """Checks that [ptr, ptr + nbytes) lies in one live allocation (usable from ``device`` if given).

    Raises:
        RuntimeError: with CUDA's wording (illegal memory access / invalid argument) and the reason.
    """
    if nbytes <= 0:
        return None
    a = find(ptr)
    if a is None:
        raise IllegalAddress(f"{what}: address {ptr:#x} is not in any live GPU or pinned allocation")
    if ptr + nbytes > a.ptr + a.size:
        raise IllegalAddress(
            f"{what}: {nbytes} bytes at {ptr:#x} run {ptr + nbytes - a.ptr - a.size} bytes past the end of "
            f"the {a.size}-byte allocation on {a.where()}"
        )
    if device is not None and not may_access(device, a):
        why = (
            "peer access to it was never enabled (cudaDeviceEnablePeerAccess)"
            if can_access_peer(device, a.device)
            else "the devices cannot access each other's memory"
        )
        raise IllegalAddress(f"{what}: a kernel on device {device} touched memory of device {a.device}, but {why}")
    return a


class IllegalAddress(RuntimeError):
    """What CUDA reports as cudaErrorIllegalAddress (700): the context is then unusable."""

    def __init__(self, msg):
        super().__init__(f"cudaErrorIllegalAddress: an illegal memory access was encountered (emulator: {msg})")


def host_array(ptr: int, shape, dtype, strides=None) -> np.ndarray:
    """A NumPy view of live registered memory at ``ptr`` (C order unless ``strides`` is given)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return np.empty(shape, dtype)
    if strides is None:
        a = check_range(ptr, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, "memory view")
    else:
        a = check_range(ptr, dtype.itemsize, "memory view")
    return np.ndarray(shape, dtype, buffer=a.raw, offset=ptr - a.ptr + (a.guard_at - a.size), strides=strides)
