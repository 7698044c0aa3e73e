"""``cudist._core``'s CUDA launchers on the emulated machine: a stand-in for the extension's bindings.

:class:`EmulatedLaunchers` has the extension's ``cuda_*`` functions, with the same parameters
(integer addresses, a stream handle, a device), and runs the real C++ launchers of
<cudist/cuda/launch_impl.cuh> and <cudist/cuda/p2p_impl.cuh> compiled for the host into the
emulation library (tests/emu/emu_launchers.cpp, emu_p2p.cpp: ``cudist_emu_launch_<launcher>_<dtype>``).
Where the extension enqueues the launches on the CUDA stream it is given, this queues them on the
emulated stream that handle names (:mod:`cupy._emu`), so they run in order with CuPy's work: a
missing event join around them gives stale data here as it would on a GPU. p2p_all_reduce joins
its streams before and after, as the real one does with events.

It checks what the bindings check (ValueError for malformed arguments, RuntimeError naming the
CUDA error, as the extension raises them) and what a GPU punishes: every buffer must lie in a live
allocation that the launching device may touch (its own memory, or a peer's with peer access
enabled), aligned to its element size, and a stream handle must belong to the launching device
(cudaErrorInvalidResourceHandle otherwise). Guard bytes are checked after each launch.

``calls`` records every launch (:class:`Call`) so that tests can see which path ran, on which
device and stream. tests/conftest.py installs an instance as the cupy backend's ``_core`` under
``CUDIST_EMU_MODE=core``; tests/test_cuda_launch_paths.py uses it directly.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

import numpy as np

from cupy import _emu

__all__ = ["Call", "EmulatedLaunchers"]

_DTYPES = ("float16", "float32", "float64", "int32", "int64", "bfloat16")
_ERRORS = {
    1: ("cudaErrorInvalidValue", "invalid argument"),
    9: ("cudaErrorInvalidConfiguration", "invalid configuration argument"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    801: ("cudaErrorNotSupported", "operation not supported"),
}


class Call(NamedTuple):
    """One launcher call: the binding's name, the launching device (-1: several, for p2p), the
    stream handle(s) it was given, the dtype's name and the number of buffers."""

    name: str
    device: int
    streams: tuple[int, ...]
    dtype: str
    n: int


def _cuda_error(where: str, code: int) -> RuntimeError:
    name, desc = _ERRORS.get(code, (f"cudaError{code}", "unknown error"))
    return RuntimeError(f"{where}: CUDA error {name} ({desc})")


def _noop() -> None:
    pass


def _library():
    from cupy._raw import _library as lib  # noqa: PLC0415 - builds the emulation library on first use

    return lib()


class EmulatedLaunchers:
    """The ``cuda_*`` functions of a CUDA build of ``cudist._core``, over the emulated GPUs."""

    cuda_built = True
    cuda_architectures = "90"  # the emulated GPUs are compute capability 9.0
    SUM = 0
    MEAN = 1

    def __init__(self):
        self.cuda_runtime_version = _emu.RUNTIME_VERSION
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def cuda_device_count(self) -> int:
        return _emu.DEVICE_COUNT

    # ----------------------------------------------------------------------------- the bindings
    def cuda_all_reduce(self, ptrs, count, dtype, op, stream=0, device=-1, two_shot=False):
        where = "cuda_all_reduce"
        op, count, dt = self._common(where, op, count, dtype)
        p = self._pointers(ptrs, where, "ptrs", "pointer")
        dev = self._device(device, where)
        entry = "all_reduce_two_shot" if two_shot else "all_reduce"
        self._launch(where, entry, dt, dev, stream, [(x, count) for x in p],
                     lambda fn: fn(self._table(p), ctypes.c_int(len(p)), ctypes.c_longlong(count), ctypes.c_int(op),
                                   None), len(p))

    def cuda_all_reduce_into(self, inputs, outputs, count, dtype, op, stream=0, device=-1):
        where = "cuda_all_reduce_into"
        op, count, dt = self._common(where, op, count, dtype)
        ins = self._pointers(inputs, where, "inputs", "input")
        outs = self._pointers(outputs, where, "outputs", "output")
        if len(ins) != len(outs):
            raise ValueError(f"{where}: got {len(ins)} inputs but {len(outs)} outputs")
        dev = self._device(device, where)
        self._launch(where, "all_reduce_into", dt, dev, stream, [(x, count) for x in ins + outs],
                     lambda fn: fn(self._table(ins), self._table(outs), ctypes.c_int(len(ins)),
                                   ctypes.c_longlong(count), ctypes.c_int(op), None), len(ins))

    def cuda_reduce_to_one(self, ptrs, out, count, dtype, op, stream=0, device=-1):
        where = "cuda_reduce_to_one"
        op, count, dt = self._common(where, op, count, dtype)
        p = self._pointers(ptrs, where, "ptrs", "pointer")
        o = self._pointer(out, where, "out")
        dev = self._device(device, where)
        self._launch(where, "reduce_to_one", dt, dev, stream, [(x, count) for x in p + [o]],
                     lambda fn: fn(self._table(p), ctypes.c_int(len(p)), ctypes.c_void_p(o),
                                   ctypes.c_longlong(count), ctypes.c_int(op), None), len(p))

    def cuda_broadcast(self, src, dsts, count, dtype, stream=0, device=-1):
        where = "cuda_broadcast"
        count, dt = self._count(where, count), self._dtype(where, dtype)
        s = self._pointer(src, where, "src")
        d = self._pointers(dsts, where, "dsts", "destination")
        dev = self._device(device, where)
        self._launch(where, "broadcast", dt, dev, stream, [(x, count) for x in [s] + d],
                     lambda fn: fn(ctypes.c_void_p(s), self._table(d), ctypes.c_int(len(d)),
                                   ctypes.c_longlong(count), None), len(d))

    def cuda_p2p_all_reduce(self, bufs, count, dtype, op, streams=None):
        where = "cuda_p2p_all_reduce"
        op, count, dt = self._common(where, op, count, dtype)
        ptrs, devices = [], []
        for i, pair in enumerate(self._items(bufs, where, "bufs")):
            if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
                raise ValueError(f"{where}: bufs {i} must be a (pointer, device) pair")
            ptrs.append(self._pointer(pair[0], where, f"pointer {i}"))
            devices.append(self._address(pair[1], where, f"device of buffer {i}"))
        if not ptrs:
            raise ValueError(f"{where}: expected at least one (pointer, device) pair, got none")
        handles = [0] * len(ptrs) if streams is None else [self._address(s, where, f"stream {i}")
                                                            for i, s in enumerate(self._items(streams, where, "streams"))]
        if len(handles) != len(ptrs):
            raise ValueError(f"{where}: got {len(handles)} streams for {len(ptrs)} buffers")
        if any(d >= _emu.DEVICE_COUNT for d in devices):
            raise _cuda_error(where, 101)
        distinct = list(dict.fromkeys(devices))
        # As the launcher: every pair of distinct devices must be able to peer (checked first, so
        # that nothing changes when one cannot), then peer access is enabled both ways.
        if any(a != b and not _emu.can_access_peer(a, b) for a in distinct for b in distinct):
            raise _cuda_error(where, 101)
        with _emu.LOCK:
            _emu.PEER_ENABLED.update((a, b) for a in distinct for b in distinct if a != b)
        queues = [self._queue(where, h, d) for h, d in zip(handles, devices)]
        touched = [(p, count) for p in ptrs]
        for d in distinct:  # every GPU reads (and writes) a chunk of every buffer
            self._check(where, touched, dt, d, pooled=False)
        devs = (ctypes.c_int * len(devices))(*devices)
        table = self._table(ptrs)
        fn = getattr(_library(), f"cudist_emu_launch_p2p_all_reduce_{dt.name}")
        fn.restype = ctypes.c_int
        run = self._runner(where, touched, dt, distinct[0],
                           lambda: fn(table, devs, None, ctypes.c_int(len(ptrs)), ctypes.c_longlong(count),
                                      ctypes.c_int(op)))
        # The launcher's joins: its work starts after what every stream holds, and every stream's
        # later work comes after it.
        first, others = queues[0], list(dict.fromkeys(q for q in queues[1:] if q is not queues[0]))
        with _emu.LOCK:
            seq = _emu.enqueue(first, run, where, deps=[(q, q.enqueued) for q in others])
            for q in others:
                _emu.enqueue(q, _noop, f"{where}: join", deps=[(first, seq)])
        self._record(Call(where, -1, tuple(handles), dt.name, len(ptrs)))

    # ----------------------------------------------------------------------------- helpers
    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    @staticmethod
    def _items(seq, where, what):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
            raise ValueError(f"{where}: {what} must be a sequence")
        return list(seq)

    @staticmethod
    def _address(v, where, what) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{where}: {what} is not an integer")
        if v < 0:
            raise ValueError(f"{where}: {what} is negative")
        return int(v)

    def _pointer(self, v, where, what) -> int:
        a = self._address(v, where, what)
        if a == 0:
            raise ValueError(f"{where}: {what} is null")
        return a

    def _pointers(self, seq, where, what, item) -> list[int]:
        ptrs = [self._pointer(v, where, f"{item} {i}") for i, v in enumerate(self._items(seq, where, what))]
        if not ptrs:
            raise ValueError(f"{where}: expected at least one device {item}, got none")
        return ptrs

    @staticmethod
    def _count(where, count) -> int:
        count = int(count)
        if count < 0:
            raise ValueError(f"{where}: count must be >= 0, got {count}")
        return count

    @staticmethod
    def _dtype(where, dtype) -> np.dtype:
        if isinstance(dtype, str) and dtype == "bfloat16":
            # The extension takes this name without ml_dtypes; NumPy knows it only once ml_dtypes is imported.
            import ml_dtypes  # noqa: PLC0415, F401 - registers the name

        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"{where}: dtype {dtype!r} is not a dtype") from None
        if dt.name not in _DTYPES:
            raise ValueError(f"{where}: unsupported dtype '{dt.name}' (supported: {', '.join(_DTYPES)})")
        return dt

    def _common(self, where, op, count, dtype):
        if op not in (0, 1) or isinstance(op, bool):
            raise ValueError(f"op must be 0 (SUM) or 1 (MEAN), got {op}")
        return int(op), self._count(where, count), self._dtype(where, dtype)

    @staticmethod
    def _device(device, where) -> int:
        if device < -1:
            raise ValueError(f"{where}: device must be >= 0 (or -1 for the current one)")
        dev = _emu.THREAD.device if device == -1 else int(device)
        if not 0 <= dev < _emu.DEVICE_COUNT:
            raise _cuda_error(where, 101)
        return dev

    @staticmethod
    def _queue(where, handle, device) -> _emu.Queue:
        """The emulated stream a handle names for work on ``device``: 0, 1 (legacy) and 2 (per-thread,
        which the fake has none of) are that device's null stream; any other must be a stream of it."""
        if handle in (0, 1, 2):
            return _emu.queue(device, 0)
        from cupy.cuda import _STREAM_DEVICE  # noqa: PLC0415

        owner = _STREAM_DEVICE.get(handle)
        q = _emu._QUEUES.get((device, handle))
        if owner != device or q is None:
            raise RuntimeError(f"{where}: CUDA error cudaErrorInvalidResourceHandle (invalid resource handle): "
                               f"stream {handle:#x} belongs to device {owner}, the launch is on device {device}")
        return q

    @staticmethod
    def _table(ptrs):
        return (ctypes.c_void_p * len(ptrs))(*ptrs)

    @staticmethod
    def _check(where, touched, dt, device, *, pooled, since=None):
        allocs = []
        for i, (p, count) in enumerate(touched):
            if count <= 0:
                continue
            if p % dt.itemsize:
                raise RuntimeError(f"cudaErrorMisalignedAddress: {where} buffer {i} = {p:#x} is not "
                                   f"{dt.itemsize}-byte aligned")
            allocs.append(_emu.check_range(p, count * dt.itemsize, f"{where} buffer {i}", device=device,
                                           pooled=pooled, since=since))
        return allocs

    def _runner(self, where, touched, dt, device, call):
        """The queued operation: the pointers checked again when it runs (they may have gone back to
        the pool since, which stream order makes legal), the launcher, its status, the guards."""
        launched = _emu.HANDOUTS
        keep = [_emu.find(p) for p, _ in touched]  # noqa: F841 - the bytes stay mapped while queued

        def run():
            allocs = self._check(where, touched, dt, device, pooled=True, since=launched)
            status = call()
            if status != 0:
                raise _cuda_error(where, status)
            for a in allocs:
                if a is not None and a.live and a.stamp <= launched and not a.guard_intact():
                    raise _emu.IllegalAddress(f"{where} wrote past the end of a {a.size}-byte allocation on {a.where()}")
            return keep

        return run

    def _launch(self, where, entry, dt, device, stream, touched, call, n):
        handle = self._address(stream, where, "stream")
        q = self._queue(where, handle, device)
        self._check(where, touched, dt, device, pooled=False)
        fn = getattr(_library(), f"cudist_emu_launch_{entry}_{dt.name}")
        fn.restype = ctypes.c_int
        _emu.enqueue(q, self._runner(where, touched, dt, device, lambda: call(fn)), f"{where} ({entry})")
        self._record(Call(where, device, (handle,), dt.name, n))
