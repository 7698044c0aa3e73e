"""GPU input: a pinned host staging ring, copies to each replica's GPU on a copy stream, events.

A background thread reads the dataset and packs each step into a pinned host staging buffer from a
small reused ring; the copies to the GPUs run asynchronously on a dedicated copy stream per GPU,
``experimental_per_replica_buffer_size`` steps ahead, and the consumer's stream waits on the copy's
event before the arrays are handed out (:class:`DeviceSteps`). Used by :mod:`cudist._input_lib`;
imports CuPy only when a GPU feeder is made.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import optree

from cudist._arrays import is_device_array, to_gpu
from cudist._values import PerReplica, regroup

__all__ = ["GpuFeeder", "DeviceSteps", "DeviceBatch", "InFlight", "group_step", "STAGE_ALIGN", "STAGE_GRANULE"]


def group_step(values: list, n: int):
    """One step from the ``n`` per-replica values (each already on its replica's device)."""
    if n == 1:
        return values[0]
    return regroup(values, PerReplica, always_wrap=True)





#: Byte alignment of each leaf inside a staging buffer (full-speed DMA, aligned dtype views).
STAGE_ALIGN = 256
#: Staging buffers grow in steps of this many bytes, so slightly varying steps reuse them.
STAGE_GRANULE = 64 << 10

_copy_streams: dict = {}
_copy_streams_lock = threading.Lock()


def _copy_stream(gpu: int):
    """The process-wide non-blocking stream input copies to ``gpu`` run on (made on first use).

    Non-blocking: it never synchronizes implicitly with the legacy default stream, which is where
    compute runs unless the user picked another stream, so copies overlap compute.
    """
    s = _copy_streams.get(gpu)
    if s is None:
        import cupy  # noqa: PLC0415 - GPU input only

        with _copy_streams_lock:
            s = _copy_streams.get(gpu)
            if s is None:
                with cupy.cuda.Device(gpu):
                    s = _copy_streams[gpu] = cupy.cuda.Stream(non_blocking=True)
    return s


def _alloc_pinned(size: int):
    """A page-locked host buffer of ``size`` bytes: (the allocation, a uint8 NumPy view of it).

    Copies from pinned memory are true DMA transfers that run asynchronously at full bus speed;
    from pageable memory the driver stages them and the host waits.
    """
    import cupy  # noqa: PLC0415 - GPU input only

    mem = cupy.cuda.alloc_pinned_memory(size)
    return mem, np.ndarray((size,), np.uint8, buffer=mem)


class _Slot:
    """One pinned host staging buffer of the ring, and the copy events that still read it."""

    __slots__ = ("mem", "buf", "events")

    def __init__(self):
        self.mem = None  # the pinned allocation (kept alive here)
        self.buf = np.empty(0, np.uint8)  # a NumPy view of it
        self.events = ()

    def wait(self) -> None:
        """Blocks until no copy reads this buffer any more."""
        for ev in self.events:
            ev.synchronize()
        self.events = ()


class _Staged:
    """A step packed into a staging slot: per replica, its treedef and leaf entries.

    An entry is ``("h", offset, shape, dtype)`` for a host array in the slot, ``("d", array)`` for
    a GPU array, ``("v", value)`` for anything else (kept as it is).
    """

    __slots__ = ("slot", "replicas")

    def __init__(self, slot, replicas):
        self.slot, self.replicas = slot, replicas


class DeviceBatch:
    """A global batch whose leaves (some of them) are already GPU arrays: split by scatter."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch


class InFlight:
    """A step whose copies are enqueued: the arrays, and per GPU the event of its copies."""

    __slots__ = ("step", "events")

    def __init__(self, step, events):
        self.step, self.events = step, events


class GpuFeeder:
    """Moves each step's per-replica values to the replicas' GPUs.

    Host side (:meth:`stage`, in the prefetch thread): the step's host array leaves are packed into
    one pinned buffer taken from a ring of reusable slots; a slot is written only after the copies
    that read it last time have finished (its events), so the ring never overwrites data in flight.
    The ring grows only while every slot is held by a step not yet copied, so its size is bounded
    by the prefetch depth (``experimental_per_replica_buffer_size`` + 2).

    Device side (:meth:`enqueue` and :meth:`hand_out`, in the consumer's thread): each replica's
    arrays are allocated on its GPU while the consumer's current stream is current -- so CuPy's
    memory pool associates them with the stream that computes on them, the standard CuPy rule --
    then an event recorded on that stream makes the GPU's copy stream wait for the work already
    queued there (which may still use memory the pool just handed out again), the asynchronous
    host-to-device copies run on the copy stream, and an event is recorded after them. The step is
    handed out only after the consumer's stream was made to wait on that event: compute never
    reads a half-copied batch, while the copies of the next steps overlap the current step.

    The arrays handed out are fresh allocations the pipeline never touches again; the user may
    keep them.
    """

    def __init__(self, gpus: Sequence[int]) -> None:
        self.gpus = tuple(int(g) for g in gpus)
        self._free = collections.deque()  # slots ready for reuse, oldest first
        self.slots: list = []  # every slot made (what close() waits for)
        self.pinned_allocations = 0  # pinned buffers allocated so far (tests check the ring is reused)

    # ---------------------------------------------------------------- host side (any thread)
    def _acquire(self, nbytes: int) -> _Slot:
        try:
            slot = self._free.popleft()
        except IndexError:
            slot = _Slot()
            self.slots.append(slot)
        slot.wait()
        if slot.buf.nbytes < nbytes:
            size = -(-nbytes // STAGE_GRANULE) * STAGE_GRANULE
            slot.mem = None  # the old buffer's copies are done (waited above): give it back first
            slot.mem, slot.buf = _alloc_pinned(size)
            self.pinned_allocations += 1
        return slot

    def stage(self, values) -> _Staged:
        """Packs one step (a list of per-replica nested values) into a staging slot."""
        plans, copies, total = [], [], 0
        for v in values:
            leaves, treedef = optree.tree_flatten(v, none_is_leaf=True)
            entries = []
            for leaf in leaves:
                if isinstance(leaf, np.generic):
                    leaf = np.asarray(leaf)
                if isinstance(leaf, np.ndarray):
                    if leaf.dtype.kind not in "biufc":
                        raise TypeError(
                            f"cannot copy an array of dtype {leaf.dtype} to a GPU: only numeric and bool arrays "
                            "can be fetched to GPU devices (use InputOptions(experimental_fetch_to_device=False) "
                            "to keep the input on the host)"
                        )
                    dtype = leaf.dtype.newbyteorder("=")  # CuPy arrays are native-endian
                    total = -(-total // STAGE_ALIGN) * STAGE_ALIGN
                    entries.append(["h", total, leaf.shape, dtype])
                    copies.append((total, leaf, dtype))
                    total += leaf.nbytes
                elif is_device_array(leaf):
                    entries.append(("d", leaf))
                else:
                    entries.append(("v", leaf))
            plans.append((treedef, entries))
        slot = self._acquire(total)
        buf = slot.buf
        for off, leaf, dtype in copies:
            if leaf.nbytes:
                np.copyto(buf[off : off + leaf.nbytes].view(dtype).reshape(leaf.shape), leaf)
        return _Staged(slot, plans)

    # ---------------------------------------------------------------- device side (consumer thread)
    def enqueue(self, item) -> InFlight:
        """Allocates a staged step's arrays and enqueues its copies; returns it in flight."""
        import cupy  # noqa: PLC0415 - GPU input only

        n = len(self.gpus)
        if isinstance(item, DeviceBatch):
            from cudist._kernels import get_backend

            # The scatter kernel runs on the current streams: already in the consumer's order.
            pieces = get_backend("cupy").scatter(item.batch, self.gpus)
            return InFlight(group_step(pieces, n), ())
        slot = item.slot
        buf = slot.buf
        per_gpu: dict = {}  # gpu -> [(out, staged view)]
        values = []
        for r, (treedef, entries) in enumerate(item.replicas):
            gpu = self.gpus[r]
            leaves = []
            with cupy.cuda.Device(gpu):
                for e in entries:
                    kind = e[0]
                    if kind == "h":
                        _, off, shape, dtype = e
                        out = cupy.empty(shape, dtype=dtype)
                        if out.nbytes:
                            view = buf[off : off + out.nbytes].view(dtype).reshape(shape)
                            per_gpu.setdefault(gpu, []).append((out, view))
                        leaves.append(out)
                    elif kind == "d":
                        leaves.append(to_gpu(e[1], gpu))
                    else:
                        leaves.append(e[1])
            values.append(treedef.unflatten(leaves))
        events = []
        for gpu, pairs in per_gpu.items():
            with cupy.cuda.Device(gpu):
                ready = cupy.cuda.Event(disable_timing=True)
                ready.record(cupy.cuda.get_current_stream())  # after the allocations above
                stream = _copy_stream(gpu)
                stream.wait_event(ready)
                for out, view in pairs:
                    out.set(view, stream=stream)
                done = cupy.cuda.Event(disable_timing=True)
                done.record(stream)
            events.append((gpu, done))
        slot.events = tuple(ev for _, ev in events)
        self._free.append(slot)  # the producer waits on its events before packing into it again
        return InFlight(group_step(values, n), tuple(events))

    @staticmethod
    def hand_out(flight: InFlight):
        """Makes the consumer's current stream on each GPU wait for the step's copies; the step."""
        if flight.events:
            import cupy  # noqa: PLC0415 - GPU input only

            for gpu, ev in flight.events:
                with cupy.cuda.Device(gpu):
                    cupy.cuda.get_current_stream().wait_event(ev)
        return flight.step


def _drain(inflight: collections.deque, feeder: GpuFeeder) -> None:
    """Waits for every copy still running before the buffers it touches can be freed or reused.

    Arrays of steps never handed out go back to CuPy's pool (a later allocation must not receive
    memory a copy still writes), and pinned slots go back to CuPy's pinned pool (a later user of
    that host memory must not change what a copy still reads).
    """
    for flight in inflight:
        for _, ev in flight.events:
            ev.synchronize()
    inflight.clear()
    for slot in feeder.slots:
        slot.wait()


class DeviceSteps:
    """The consumer side of GPU input: keeps ``depth`` steps' copies in flight ahead of the one
    handed out (``experimental_per_replica_buffer_size``), copying in the consumer's thread."""

    def __init__(self, source, feeder: GpuFeeder, depth: int):
        self._source = source
        self._feeder = feeder
        self._depth = int(depth)
        self._inflight: collections.deque = collections.deque()
        self._exhausted = False
        self._error = None
        self._finalizer = weakref.finalize(self, _drain, self._inflight, feeder)

    def __iter__(self):
        return self

    def __next__(self):
        inflight = self._inflight
        while not self._exhausted and len(inflight) <= self._depth:
            try:
                item = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            except Exception as e:  # raised after the steps before it were handed out
                self._exhausted = True
                self._error = e
                break
            inflight.append(self._feeder.enqueue(item))
        if inflight:
            return self._feeder.hand_out(inflight.popleft())
        if self._error is not None:
            err, self._error = self._error, None
            self.close()
            raise err
        self.close()
        raise StopIteration

    def close(self) -> None:
        """Stops the source and waits for the copies in flight (see :func:`_drain`)."""
        self._exhausted = True
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
        self._finalizer()
