"""Fake ``cupy.cuda``: devices, streams and events of the emulated machine (work is queued per stream, see :mod:`cupy._emu`)."""

from __future__ import annotations

import itertools
import time

from cupy import _emu
from cupy.cuda import driver, memory, runtime  # noqa: F401 - submodules, as in CuPy
from cupy.cuda.memory import (  # noqa: F401
    Memory,
    MemoryAsync,
    MemoryAsyncPool,
    MemoryPointer,
    MemoryPool,
    PinnedMemory,
    PinnedMemoryPointer,
    PinnedMemoryPool,
    UnownedMemory,
    alloc,
    alloc_pinned_memory,
)


def is_available() -> bool:
    return _emu.DEVICE_COUNT > 0


class Device:
    """A CUDA device; as a context manager it makes itself current and restores the previous one."""

    def __init__(self, device=None):
        if device is None:
            device = runtime.getDevice()
        elif isinstance(device, Device):
            device = device.id
        self.id = int(device)
        self._prev: list[int] = []

    def __int__(self):
        return self.id

    def __index__(self):
        return self.id

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(("cupy.cuda.Device", self.id))

    def __repr__(self):
        return f"<CUDA Device {self.id}>"

    def __enter__(self):
        prev = runtime.getDevice()
        self._prev.append(prev)
        if prev != self.id:
            runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc):
        runtime.setDevice(self._prev.pop())

    def use(self) -> None:
        runtime.setDevice(self.id)

    def synchronize(self) -> None:
        _emu.check_device_id(self.id)
        _emu.synchronize_device(self.id)

    @property
    def compute_capability(self) -> str:
        _emu.check_device_id(self.id)
        return "90"

    @property
    def pci_bus_id(self) -> str:
        return f"0000:{0x10 + self.id:02x}:00.0"

    @property
    def mem_info(self):
        with self:
            return runtime.memGetInfo()

    def can_access_peer(self, peer) -> bool:
        return bool(runtime.deviceCanAccessPeer(self.id, int(peer)))


def get_device_id() -> int:
    return runtime.getDevice()


# ----------------------------------------------------------------------------------- streams
_stream_ids = itertools.count(0x7000)
_STREAM_DEVICE: dict[int, int] = {}  # stream ptr -> device it was created on


class Stream:
    """A CUDA stream: a queue of device work (see :mod:`cupy._emu`) that runs when something waits for it.

    The null stream (``Stream.null``, ptr 0) is the legacy default stream of whichever device is
    current; it orders against that device's blocking streams. ``non_blocking=True`` streams do not.
    """

    null: Stream  # set below

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False, priority=None):
        if ptds:
            raise NotImplementedError("emulator: per-thread default streams are not emulated")
        self.non_blocking = bool(non_blocking)
        if null:
            self.ptr = 0
            self.device_id = -1  # the legacy null stream belongs to whichever device is current
        else:
            self.ptr = next(_stream_ids)
            self.device_id = runtime.getDevice()
            _STREAM_DEVICE[self.ptr] = self.device_id
            _emu.queue(self.device_id, self.ptr, self.non_blocking)
        self._prev: list = []

    def __repr__(self):
        return f"<Stream {self.ptr} (device {self.device_id})>"

    def __eq__(self, other):
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self):
        return hash(self.ptr)

    def _device(self) -> int:
        return runtime.getDevice() if self.ptr == 0 else self.device_id

    @property
    def _queue(self) -> _emu.Queue:
        return _emu.queue(self._device(), self.ptr, self.non_blocking)

    def use(self) -> Stream:
        _emu.THREAD.streams[self._device()] = self
        return self

    def __enter__(self):
        dev = self._device()
        self._prev.append((dev, _emu.THREAD.streams.get(dev)))
        _emu.THREAD.streams[dev] = self
        return self

    def __exit__(self, *exc):
        dev, prev = self._prev.pop()
        if prev is None:
            _emu.THREAD.streams.pop(dev, None)
        else:
            _emu.THREAD.streams[dev] = prev

    def synchronize(self) -> None:
        _emu.synchronize_queue(self._queue)

    @property
    def done(self) -> bool:
        # cudaStreamQuery: the emulator runs the work when asked (else a polling loop never ends);
        # only work waiting for another process (a cross-process NCCL collective) stays pending.
        try:
            _emu.synchronize_queue(self._queue, block=False)
        except _emu.NotReady:
            return False
        return True

    def record(self, event: Event | None = None) -> Event:
        if event is None:
            event = Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Later work on this stream runs after the work ``event`` was recorded behind."""
        if not isinstance(event, _EVENT_CLASS):  # the class itself, even where a test replaces cupy.cuda.Event
            raise TypeError(f"wait_event expects a cupy.cuda.Event, got {type(event).__name__}")
        if event._pos is None:
            # Waiting on a never-recorded event is a no-op in CUDA; in cudist it is always a bug.
            raise RuntimeError("emulator: Stream.wait_event on an event that was never recorded")
        _emu.enqueue(self._queue, _noop, f"wait on event {event.ptr:#x}", deps=[event._pos])

    def add_callback(self, callback, arg) -> None:
        _emu.enqueue(self._queue, lambda: callback(self, None, arg), "host callback")

    def launch_host_func(self, callback, arg) -> None:
        _emu.enqueue(self._queue, lambda: callback(arg), "host function")


def _noop() -> None:
    pass


Stream.null = Stream(null=True)


class ExternalStream(Stream):
    def __init__(self, ptr: int, device_id: int = -1):
        ptr = int(ptr)
        if ptr in (1, 2):  # cudaStreamLegacy / cudaStreamPerThread: the null stream here
            ptr = 0
        if device_id < 0 and ptr:
            device_id = _STREAM_DEVICE.get(ptr, -1)
        q = _emu._QUEUES.get((device_id, ptr)) if ptr else None
        self.ptr, self.device_id, self._prev = ptr, device_id, []
        self.non_blocking = q.non_blocking if q is not None else False


def get_current_stream(device_id: int | None = None) -> Stream:
    dev = runtime.getDevice() if device_id is None else int(device_id)
    return _emu.THREAD.streams.get(dev, Stream.null)


def stream_device(ptr: int) -> int:
    """The device a stream pointer belongs to (the null stream: the current device)."""
    return runtime.getDevice() if ptr == 0 else _STREAM_DEVICE.get(ptr, -1)


class Event:
    """A CUDA event, created on the current device; it can only be recorded on that device's streams.

    Recording captures the stream's queue position: synchronizing or querying the event runs the
    work before it; a stream waiting on it runs that work first.
    """

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.device_id = runtime.getDevice()
        self.ptr = next(_stream_ids)
        self._pos = None  # (queue, position) of the last record
        self._timing = not disable_timing
        self._time = None  # host clock when the queue reached the record

    @property
    def _recorded(self) -> bool:
        return self._pos is not None

    def record(self, stream: Stream | None = None) -> None:
        if stream is None:
            stream = get_current_stream()
        dev = stream._device()
        if dev != self.device_id:
            # cudaEventRecord with an event and a stream of different devices.
            raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidResourceHandle)
        q = stream._queue
        self._time = None
        # A marker op (not just the position): on the legacy null stream it also waits for the
        # device's blocking streams, as recording there does in CUDA.
        seq = _emu.enqueue(q, self._stamp if self._timing else _noop, f"record event {self.ptr:#x}")
        self._pos = (q, seq)

    def _stamp(self) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        if self._pos is not None:
            _emu.run_until(*self._pos)

    @property
    def done(self) -> bool:
        # cudaEventQuery: the emulator runs the work when asked (else a polling loop never ends);
        # only work waiting for another process (a cross-process NCCL collective) stays pending.
        if self._pos is not None:
            try:
                _emu.run_until(*self._pos, block=False)
            except _emu.NotReady:
                return False
        return True


_EVENT_CLASS = Event


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Milliseconds between two recorded timing events (host time when the queue reached them)."""
    for ev in (start_event, end_event):
        if not ev._timing or ev._pos is None:
            # cudaEventElapsedTime on a disable_timing or never-recorded event.
            raise runtime.CUDARuntimeError(runtime.cudaErrorInvalidResourceHandle)
        q, seq = ev._pos
        if q.done < seq:
            # cudaEventElapsedTime before the events completed: the caller forgot to synchronize.
            raise runtime.CUDARuntimeError(runtime.cudaErrorNotReady)
    return (end_event._time - start_event._time) * 1e3


def _is_async_allocator(allocator) -> bool:
    return isinstance(getattr(allocator, "__self__", None), memory.MemoryAsyncPool)


def using_allocator(allocator=None):
    import contextlib

    @contextlib.contextmanager
    def use():
        prev = _emu.ASYNC_ALLOCATOR
        _emu.ASYNC_ALLOCATOR = _is_async_allocator(allocator)
        try:
            yield
        finally:
            _emu.ASYNC_ALLOCATOR = prev

    return use()


def set_allocator(allocator=None) -> None:
    """Only which kind of pool matters here: ``MemoryAsyncPool().malloc`` or any other."""
    _emu.ASYNC_ALLOCATOR = _is_async_allocator(allocator)


def set_pinned_memory_allocator(allocator=None) -> None:
    pass


class _Compiler:
    pass


def __getattr__(name):
    if name == "nccl":
        import importlib

        return importlib.import_module("cupy.cuda.nccl")
    raise AttributeError(f"module 'cupy.cuda' has no attribute {name!r}")
