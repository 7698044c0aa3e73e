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
    CUDIST_EMU_DRIVER / CUDIST_EMU_RUNTIME: the CUDA versions the driver supports and CuPy was built
        for (default 12080 both, e.g. 13000 for CUDA 13.0); a driver of an older major version makes
        ``getDeviceCount`` raise cudaErrorInsufficientDriver, as CUDA does.
    CUDIST_EMU_SYNC: ``1`` runs every operation as soon as it is queued (for debugging: a test that
        passes only with it set has a missing stream/event wait or a host buffer race).
    CUDIST_EMU_MODE: harder modes, comma-separated (tests/test_gpu_emulated.py runs the suite in each):
        ``streams`` -- whenever work must run, every *other* stream's queued work runs first (in a
        random order), so independent streams really run out of order: a GPU that overwrites or
        frees a buffer while a peer's queued copy or kernel still reads it is caught (the default
        lazy order only catches readers that did not wait for their writers);
        ``shuffle`` -- each kernel launch runs its (block, thread) pairs in a random order instead
        of one after the other (exposes aliasing races between elements of one launch);
        ``ftz`` -- float32 ``__f*_rn`` intrinsics flush subnormal inputs and results to zero, as
        CuPy's forced ``-ftz=true`` makes them do on a GPU;
        ``core`` -- cudist's cupy backend launches its collectives through ``cudist._core``'s C++
        CUDA launchers, emulated by :mod:`cupy._launchers` (tests/conftest.py installs them and sets
        CUDIST_CUDA_LAUNCHERS=core), instead of through NVRTC.
        ``shuffle`` and ``ftz`` act in the C++ emulation library (tests/emu/include), which reads
        the same variable. CUDIST_EMU_SEED (default 0) seeds the random orders.

Work is asynchronous as on a GPU: every device operation is queued on a stream (:class:`Queue`)
and runs only when something forces it (a synchronize, an event query, a host read that syncs,
a queue that waits on it). So a missing wait gives stale data deterministically instead of by luck.
Streams follow CUDA: one stream runs in order; ``wait_event`` orders against the prefix recorded
by the event; the legacy null stream of a device and that device's *blocking* streams order
against each other, non-blocking streams do not.

An op may wait for something outside this process (a cross-process NCCL collective of the fake
``cupy.cuda.nccl`` waits for its peer processes' data): its ``ready()`` says whether it can run.
Until it can, a query (``Event.done``, ``Stream.done``) answers False and a synchronize waits
(at most ``CUDIST_EMU_WAIT_SECONDS``, default 60: a GPU would wait forever, the emulator raises).

Memory is pooled as CuPy's pools do it: a freed device block goes back to the free list of the
stream that was current when it was allocated and is reused first by the next allocation of the
same rounded size on that stream (stream-ordered reuse, so a block still used by queued work of
*another* stream is really overwritten -- the race CuPy's pool leaves to the user); a freed pinned
block is reused by the next pinned allocation of that size regardless of streams, as in CuPy's
pinned pool. Queued operations keep the memory itself (not its ownership) alive.
"""

from __future__ import annotations

import bisect
import collections
import os
import random
import threading
import time
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
SYNC = os.environ.get("CUDIST_EMU_SYNC", "0") == "1"
MODES = frozenset(m.strip() for m in os.environ.get("CUDIST_EMU_MODE", "").split(",") if m.strip())
_UNKNOWN_MODES = MODES - {"streams", "shuffle", "ftz", "core"}
if _UNKNOWN_MODES:
    raise RuntimeError(f"CUDIST_EMU_MODE: unknown mode(s) {sorted(_UNKNOWN_MODES)}; known: streams, shuffle, ftz, core")
_RNG = random.Random(int(os.environ.get("CUDIST_EMU_SEED", "0")))
WAIT_SECONDS = float(os.environ.get("CUDIST_EMU_WAIT_SECONDS", "60"))
DRIVER_VERSION = int(os.environ.get("CUDIST_EMU_DRIVER", "12080"))
RUNTIME_VERSION = int(os.environ.get("CUDIST_EMU_RUNTIME", "12080"))


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
    """One block: device memory (``device`` set) or pinned host memory (``device`` None).

    ``live`` while its owner (a :class:`Owner` token held by the arrays/Memory objects using it)
    exists; afterwards it sits in the pool's free list until it is handed out again. The bytes
    (``raw``) stay valid as long as the Allocation object exists, so queued work holding it never
    touches unmapped memory.
    """

    __slots__ = ("ptr", "size", "capacity", "device", "stream", "raw", "guard_at", "base_off", "live", "stamp",
                 "async_pool", "__weakref__")

    def __init__(self, ptr, capacity, device, stream, raw, base_off):
        self.ptr, self.capacity, self.device, self.stream, self.raw = ptr, capacity, device, stream, raw
        self.base_off = base_off
        self.size = 0
        self.guard_at = base_off
        self.live = False
        self.stamp = 0  # HANDOUTS when it was last handed out
        self.async_pool = False  # from a stream-ordered pool (cudaMallocAsync): peers need pool access

    def _hand_out(self, nbytes: int) -> None:
        global HANDOUTS
        HANDOUTS += 1
        self.stamp = HANDOUTS
        if self.size != nbytes:  # a fresh block (the pool reuses blocks of the same size only)
            self.size = nbytes
            self.guard_at = self.base_off + nbytes
            self.raw[self.guard_at : self.guard_at + GUARD] = GUARD_BYTE
        self.live = True

    @property
    def pinned(self) -> bool:
        return self.device is None

    def block(self) -> np.ndarray:
        return self.raw[self.base_off : self.base_off + self.size]

    def guard_intact(self) -> bool:
        g = self.raw[self.guard_at : self.guard_at + GUARD]
        return bool(np.all(g == GUARD_BYTE))

    def where(self) -> str:
        return "pinned host memory" if self.device is None else f"device {self.device}"


class Owner:
    """Ownership of an Allocation: when the last holder drops it, the block returns to the pool."""

    __slots__ = ("alloc", "__weakref__")

    def __init__(self, alloc: Allocation):
        self.alloc = alloc
        weakref.finalize(self, _release, alloc)


_LOCK = threading.RLock()
LOCK = _LOCK  # one lock for the whole machine: queues, pools, registry (several host threads use it)
_STARTS: list[int] = []
_ALLOCS: dict[int, Allocation] = {}
_FREE: dict[tuple, list[Allocation]] = {}  # (device, stream key, size) -> free blocks, last freed last
# CuPy's pools round sizes up to 512 bytes and reuse a block for any size that rounds alike; the
# emulator reuses a block for the same size only: its guard bytes (checked after every kernel)
# sit right after the data and must not move while queued work may still use the block.
POOL_UNIT = 512
HANDOUTS = 0  # blocks handed out so far: tells queued work whether a block changed owner since
# Whether device allocations come from a stream-ordered pool (cupy.cuda.set_allocator(
# MemoryAsyncPool().malloc)): cudaDeviceEnablePeerAccess does not map such memory for other GPUs
# (cudaMemPoolSetAccess on the pool would; CuPy does not expose it, so the emulator never grants it).
ASYNC_ALLOCATOR = False


def _pool_key(device, stream, size):
    # Pinned memory: CuPy's pinned pool does not track streams.
    return (device, None if device is None else stream, size)


def _release(alloc: Allocation) -> None:
    with _LOCK:
        if alloc.live and _ALLOCS.get(alloc.ptr) is alloc:
            alloc.live = False
            _FREE.setdefault(_pool_key(alloc.device, alloc.stream, alloc.size), []).append(alloc)


def free_all_blocks(device=..., pinned: bool = False) -> None:
    """Gives the pool's free blocks back (``cudaFree``/``cudaFreeHost``); queued work keeps the bytes."""
    with _LOCK:
        for key in list(_FREE):
            if (key[0] is None) == pinned and (device is ... or key[0] == device):
                for a in _FREE.pop(key):
                    _ALLOCS.pop(a.ptr, None)
                    i = bisect.bisect_left(_STARTS, a.ptr)
                    if i < len(_STARTS) and _STARTS[i] == a.ptr:
                        del _STARTS[i]


def allocate(nbytes: int, device: int | None, stream_ptr: int = 0) -> tuple[np.ndarray, Allocation | None, Owner | None]:
    """A block of ``nbytes`` on ``device`` (None: pinned host memory), from the pool when it can.

    ``stream_ptr`` is the stream current when allocating (the pool's reuse key for device memory).
    Returns the block as a uint8 NumPy array, its Allocation and the Owner token whose lifetime is
    the block's ownership; a zero-byte block is unregistered and has address 0, as in CuPy.
    """
    nbytes = int(nbytes)
    if nbytes == 0:
        return np.empty(0, np.uint8), None, None
    capacity = -(-nbytes // POOL_UNIT) * POOL_UNIT
    with _LOCK:
        free = _FREE.get(_pool_key(device, stream_ptr, nbytes))
        if free:
            alloc = free.pop()
        else:
            raw = np.empty(capacity + ALIGN + GUARD, np.uint8)
            base = raw.__array_interface__["data"][0]
            off = (-base) % ALIGN
            alloc = Allocation(base + off, capacity, device, stream_ptr, raw, off)
            _ALLOCS[alloc.ptr] = alloc
            bisect.insort(_STARTS, alloc.ptr)
        alloc._hand_out(nbytes)
        alloc.async_pool = ASYNC_ALLOCATOR and device is not None
        return alloc.block(), alloc, Owner(alloc)


def find(ptr: int, *, pooled: bool = False) -> Allocation | None:
    """The allocation containing address ``ptr``: live ones, and with ``pooled`` freed ones too."""
    with _LOCK:
        i = bisect.bisect_right(_STARTS, ptr) - 1
        if i < 0:
            return None
        a = _ALLOCS.get(_STARTS[i])
        if a is None or not (a.live or pooled) or not (a.ptr <= ptr < a.ptr + (a.size if a.live else a.capacity)):
            return None
        return a


def may_access(device: int, alloc: Allocation) -> bool:
    """Whether a kernel running on ``device`` may touch ``alloc``."""
    if alloc.device is None or alloc.device == device:
        return True
    return (device, alloc.device) in PEER_ENABLED and not alloc.async_pool


def check_range(ptr: int, nbytes: int, what: str, *, device: int | None = None, pooled: bool = False,
                since: int | None = None) -> Allocation | None:
    """Checks that [ptr, ptr + nbytes) lies in one allocation (usable from ``device`` if given).

    Live allocations only, unless ``pooled``: queued work runs after its operands may have been
    freed (legal in CuPy: the pool reuses them in stream order), so run-time checks accept those,
    and a block handed out again after ``since`` (a HANDOUTS value) is checked against its whole
    capacity (the work was launched against its previous owner).

    Raises:
        RuntimeError: with CUDA's wording (illegal memory access / invalid argument) and the reason.
    """
    if nbytes <= 0:
        return None
    a = find(ptr, pooled=pooled)
    if a is None:
        raise IllegalAddress(f"{what}: address {ptr:#x} is not in any live GPU or pinned allocation")
    size = a.size if a.live and (since is None or a.stamp <= since) else a.capacity
    if ptr + nbytes > a.ptr + size:
        raise IllegalAddress(
            f"{what}: {nbytes} bytes at {ptr:#x} run {ptr + nbytes - a.ptr - size} bytes past the end of "
            f"the {size}-byte allocation on {a.where()}"
        )
    if device is not None and not may_access(device, a):
        if a.async_pool and (device, a.device) in PEER_ENABLED:
            why = ("it comes from a stream-ordered pool (cudaMallocAsync), which peer access does not map "
                   "(that takes cudaMemPoolSetAccess)")
        elif can_access_peer(device, a.device):
            why = "peer access to it was never enabled (cudaDeviceEnablePeerAccess)"
        else:
            why = "the devices cannot access each other's memory"
        raise IllegalAddress(f"{what}: a kernel on device {device} touched memory of device {a.device}, but {why}")
    return a


class IllegalAddress(RuntimeError):
    """What CUDA reports as cudaErrorIllegalAddress (700): the context is then unusable."""

    def __init__(self, msg):
        super().__init__(f"cudaErrorIllegalAddress: an illegal memory access was encountered (emulator: {msg})")


def host_array(ptr: int, shape, dtype, strides=None, *, pooled: bool = False) -> np.ndarray:
    """A NumPy view of registered memory at ``ptr`` (C order unless ``strides`` is given)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return np.empty(shape, dtype)
    if strides is None:
        a = check_range(ptr, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, "memory view", pooled=pooled)
    else:
        a = check_range(ptr, dtype.itemsize, "memory view", pooled=pooled)
    return np.ndarray(shape, dtype, buffer=a.raw, offset=ptr - a.ptr + a.base_off, strides=strides)


# --------------------------------------------------------------------------------------- streams
class Op:
    __slots__ = ("seq", "fn", "deps", "what", "ready")

    def __init__(self, seq, fn, deps, what, ready=None):
        self.seq, self.fn, self.deps, self.what, self.ready = seq, fn, deps, what, ready


class NotReady(Exception):
    """A queued op waits for another process (its ``ready()`` said no): the queue stops there."""


class Queue:
    """The work queued on one stream of one device, in order; ``done`` ops of ``enqueued`` ran."""

    __slots__ = ("device", "ptr", "non_blocking", "ops", "enqueued", "done")

    def __init__(self, device: int, ptr: int, non_blocking: bool):
        self.device, self.ptr, self.non_blocking = device, ptr, non_blocking
        self.ops: collections.deque = collections.deque()
        self.enqueued = 0
        self.done = 0

    @property
    def pending(self) -> bool:
        return self.done < self.enqueued

    def __repr__(self):
        return f"<emulated stream {self.ptr:#x} of device {self.device}: {self.enqueued - self.done} queued>"


_QUEUES: dict[tuple[int, int], Queue] = {}


def queue(device: int, ptr: int, non_blocking: bool = False) -> Queue:
    """The queue of stream ``ptr`` (0: the legacy null stream) on ``device`` (made on first use)."""
    key = (int(device), int(ptr))
    q = _QUEUES.get(key)
    if q is None:
        with _LOCK:
            q = _QUEUES.get(key)
            if q is None:
                q = _QUEUES[key] = Queue(int(device), int(ptr), bool(non_blocking))
    return q


def current_queue(device: int | None = None) -> Queue:
    """The queue of the current stream of ``device`` (default: the current device) in this thread."""
    dev = THREAD.device if device is None else int(device)
    s = THREAD.streams.get(dev)
    if s is None or s.ptr == 0:
        return queue(dev, 0)
    return queue(s.device_id, s.ptr, s.non_blocking)


def enqueue(q: Queue, fn, what: str, deps=(), ready=None) -> int:
    """Queues ``fn`` on ``q``; returns its position. ``deps``: (queue, position) prefixes it waits for;
    ``ready``: None, or a function telling whether the op can run yet (it may be asked many times)."""
    with _LOCK:
        deps = [d for d in deps if d[0].done < d[1]]
        if q.ptr == 0:
            # Legacy null stream: waits for the device's blocking streams...
            for (dev, ptr), other in _QUEUES.items():
                if dev == q.device and ptr != 0 and not other.non_blocking and other.pending:
                    deps.append((other, other.enqueued))
        elif not q.non_blocking:
            # ...and a blocking stream waits for the null stream.
            null = _QUEUES.get((q.device, 0))
            if null is not None and null.pending:
                deps.append((null, null.enqueued))
        q.enqueued += 1
        q.ops.append(Op(q.enqueued, fn, deps, what, ready))
        if SYNC:
            run_until(q, q.enqueued)
        return q.enqueued


_DEPTH = 0  # nesting of run_until (guarded by _LOCK): the ``streams`` mode acts at the outermost call


def run_until(q: Queue, seq: int, *, block: bool = True) -> None:
    """Runs ``q``'s work up to position ``seq``, first running what each op waits for.

    In the ``streams`` mode (CUDIST_EMU_MODE) every other stream's queued work runs before any of
    ``q``'s (what an op waits for still runs before it): a legal CUDA order in which independent
    streams overtake each other. An op waiting for another process (see :class:`NotReady`) stops
    the run: with ``block`` it is retried until it can run (a synchronize), else NotReady is
    raised (a query).
    """
    global _DEPTH
    waited = None
    while True:
        with _LOCK:
            if q.done >= seq:
                return
            _DEPTH += 1
            try:
                if _DEPTH == 1 and "streams" in MODES:
                    others = [o for o in list(_QUEUES.values()) if o is not q and o.pending]
                    _RNG.shuffle(others)
                    for o in others:
                        try:
                            _run_plain(o, o.enqueued)
                        except NotReady:
                            pass  # that stream waits for another process; it may overtake nothing
                _run_plain(q, seq)
                return
            except NotReady as e:
                if _DEPTH > 1 or not block:
                    raise
                blocked_on = str(e)
            finally:
                _DEPTH -= 1
        # Outermost synchronize, blocked on another process: wait for it (a GPU would, forever).
        now = time.monotonic()
        if waited is None:
            waited = now
        elif now - waited > WAIT_SECONDS:
            raise RuntimeError(
                f"emulator: a synchronize waited {WAIT_SECONDS:g} s (CUDIST_EMU_WAIT_SECONDS) for {blocked_on}; "
                "on a GPU it would hang"
            )
        time.sleep(0.0005)


def _run_plain(q: Queue, seq: int) -> None:
    while q.done < seq:
        op = q.ops[0]
        for dq, ds in op.deps:
            run_until(dq, ds)
        if op.ready is not None and not op.ready():
            raise NotReady(op.what)
        q.ops.popleft()
        q.done = op.seq
        op.fn()


def synchronize_queue(q: Queue, *, block: bool = True) -> None:
    run_until(q, q.enqueued, block=block)


def synchronize_device(device: int) -> None:
    """cudaDeviceSynchronize: every stream of ``device``."""
    with _LOCK:
        for (dev, _), q in list(_QUEUES.items()):
            if dev == device:
                run_until(q, q.enqueued)


def synchronize_all() -> None:
    with _LOCK:
        for q in list(_QUEUES.values()):
            run_until(q, q.enqueued)


def idle() -> bool:
    return not any(q.pending for q in list(_QUEUES.values()))
