"""Distributed input: datasets and iterators that hand each replica its part of every step.

``Strategy.experimental_distribute_dataset`` wraps a dataset of *global* batches and splits each
batch across the replicas (ceil rule: each replica gets ceil(B/N) rows in order, the last ones fewer
or none, so nothing is dropped); ``Strategy.distribute_datasets_from_function`` calls the user's
function with an :class:`InputContext` and hands out the *per-replica* batches its dataset yields,
one replica after another. Either way a step is a ``PerReplica`` at each leaf of the element (the
plain value when there is one replica), each component already on its replica's device.

CPU replicas share host memory: their pieces are views of the batch (:func:`device_putter` is the
identity for them). GPU replicas get their pieces through :class:`_GpuFeeder` (see its docstring):
a background thread reads the dataset and packs each step into a pinned host staging buffer from a
small reused ring, the copies to the GPUs run asynchronously on a dedicated copy stream per GPU,
``experimental_per_replica_buffer_size`` steps ahead, and the consumer's stream waits on the copy's
event before the arrays are handed out. A batch already on a GPU is split by the CuPy backend's
``scatter`` kernel instead.
"""

from __future__ import annotations

import collections
import enum
import functools
import threading
import weakref

import numpy as np
import optree

from cudist import data as _data
from cudist._arrays import is_array, is_device_array, physical_gpu, to_gpu
from cudist._devices import any_gpu, parse_device
from cudist._values import PerReplica, regroup

__all__ = [
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "ValueContext",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "DistributedOptional",
    "PerReplicaSpec",
    "OutOfRangeError",
    "DatasetIterator",
    "InputFunctionIterator",
    "distribute_values_from_function",
    "device_putter",
]


class OutOfRangeError(StopIteration):
    """``get_next()`` was called on an exhausted iterator (TF's ``tf.errors.OutOfRangeError``).

    It is a ``StopIteration``, so code that catches either works.
    """


# ---------------------------------------------------------------------------------------------
# contexts and options


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` replicates the input function.

    PER_WORKER: the function runs once per worker (once here) and its dataset's batches go to the
    replicas in turn. PER_REPLICA: the function runs once per replica, each replica iterating its
    own dataset.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class InputContext:
    """What an input function needs to know to build its part of the input.

    Args:
        num_input_pipelines: how many input pipelines the function is called for.
        input_pipeline_id: which of them this call builds, in [0, num_input_pipelines).
        num_replicas_in_sync: the number of replicas consuming the input.
    """

    def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
        self._num_input_pipelines = int(num_input_pipelines)
        self._input_pipeline_id = int(input_pipeline_id)
        self._num_replicas_in_sync = int(num_replicas_in_sync)

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync."""
        return self._num_replicas_in_sync

    @property
    def input_pipeline_id(self) -> int:
        """The id of the input pipeline this call builds."""
        return self._input_pipeline_id

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines."""
        return self._num_input_pipelines

    def get_per_replica_batch_size(self, global_batch_size) -> int:
        """The per-replica batch size: ``global_batch_size // num_replicas_in_sync``.

        Raises:
            ValueError: ``num_replicas_in_sync`` does not divide ``global_batch_size``.
        """
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync!r} "
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})"
        )


class ValueContext:
    """What a value function (``experimental_distribute_values_from_function``) gets per replica."""

    def __init__(self, replica_id_in_sync_group=0, num_replicas_in_sync=1):
        self._replica_id_in_sync_group = int(replica_id_in_sync_group)
        self._num_replicas_in_sync = int(num_replicas_in_sync)

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync."""
        return self._num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """The replica the value is for, in [0, num_replicas_in_sync)."""
        return self._replica_id_in_sync_group

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


class InputOptions(
    collections.namedtuple(
        "InputOptions",
        [
            "experimental_fetch_to_device",
            "experimental_replication_mode",
            "experimental_place_dataset_on_device",
            "experimental_per_replica_buffer_size",
        ],
    )
):
    """Options for distributing input (``tf.distribute.InputOptions``).

    Attributes:
        experimental_fetch_to_device: copy each replica's batch to its device (True) or leave it
            in host memory (False). No effect for CPU replicas.
        experimental_replication_mode: an :class:`InputReplicationMode`; PER_REPLICA is only for
            ``distribute_datasets_from_function``.
        experimental_place_dataset_on_device: run the input function's dataset on the device
            (PER_REPLICA only); here the datasets always run on the host.
        experimental_per_replica_buffer_size: how many steps to prefetch to GPU devices (0: none).
    """

    __slots__ = ()

    def __new__(
        cls,
        experimental_fetch_to_device=None,
        experimental_replication_mode=InputReplicationMode.PER_WORKER,
        experimental_place_dataset_on_device=False,
        experimental_per_replica_buffer_size=1,
    ):
        if experimental_fetch_to_device is None:
            experimental_fetch_to_device = True
        if not isinstance(experimental_replication_mode, InputReplicationMode):
            raise TypeError(
                "InputOptions: experimental_replication_mode must be an InputReplicationMode, got "
                f"{experimental_replication_mode!r}"
            )
        size = experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"InputOptions: experimental_per_replica_buffer_size must be an int >= 0, got {size!r}")
        return super().__new__(
            cls, bool(experimental_fetch_to_device), experimental_replication_mode,
            bool(experimental_place_dataset_on_device), int(size),
        )


def _check_options(options, where: str) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"{where}: options must be a cudist.InputOptions, got {type(options).__name__}")
    return options


def _check_placement(options: InputOptions, where: str) -> None:
    # TF checks these only for distribute_datasets_from_function.
    if not options.experimental_place_dataset_on_device:
        return
    if options.experimental_replication_mode != InputReplicationMode.PER_REPLICA:
        raise ValueError(
            f"{where}: when `experimental_place_dataset_on_device` is set for dataset placement, you must "
            "also specify `PER_REPLICA` for the replication mode"
        )
    if options.experimental_fetch_to_device:
        raise ValueError(
            f"{where}: `experimental_place_dataset_on_device` can not be set to True when "
            "experimental_fetch_to_device is True and replication mode is set to `PER_REPLICA`"
        )


# ---------------------------------------------------------------------------------------------
# specs and optionals


class PerReplicaSpec:
    """The ``element_spec`` of a distributed leaf: one :class:`~cudist.data.TensorSpec` per replica."""

    def __init__(self, *component_specs):
        self._component_specs = tuple(component_specs)

    def __eq__(self, other) -> bool:
        return isinstance(other, PerReplicaSpec) and self._component_specs == other._component_specs

    def __hash__(self) -> int:
        return hash(self._component_specs)

    def __repr__(self) -> str:
        return f"PerReplicaSpec({', '.join(map(repr, self._component_specs))})"


def _per_replica_spec(spec, n: int, split: bool):
    """Wraps each TensorSpec of ``spec`` for ``n`` replicas (identity for one replica)."""
    if n == 1:
        return spec

    def wrap(s):
        if split and s.shape:
            b = s.shape[0]
            s = _data.TensorSpec((b // n if b is not None and b % n == 0 else None, *s.shape[1:]), s.dtype, s.name)
        return PerReplicaSpec(*([s] * n))

    return _data.map_specs(wrap, spec)


class DistributedOptional:
    """An optional step (``get_next_as_optional``): ``has_value()`` then ``get_value()``."""

    def __init__(self, value, has_value: bool, element_spec):
        self._value = value
        self._has_value = bool(has_value)
        self._element_spec = element_spec

    def has_value(self) -> bool:
        """Whether there was a next step."""
        return self._has_value

    def get_value(self):
        """The step.

        Raises:
            ValueError: there was no next step.
        """
        if not self._has_value:
            raise ValueError("The given optional does not have a value.")
        return self._value

    @property
    def element_spec(self):
        return self._element_spec

    def __repr__(self) -> str:
        return f"DistributedOptional(has_value={self._has_value})"


# ---------------------------------------------------------------------------------------------
# devices


def _identity(x):
    return x


@functools.lru_cache(maxsize=None)
def device_putter(device, fetch_to_device: bool = True):
    """The function that moves one replica's (nested) value onto ``device``.

    Identity for CPU devices: logical CPUs share host memory, so no copy is made. For a GPU it
    copies every NumPy/CuPy array leaf into that GPU's memory (other leaves, such as Python
    numbers, stay as they are); with ``fetch_to_device=False`` values stay on the host.
    """
    spec = parse_device(device)
    if not spec.is_gpu or not fetch_to_device:
        return _identity
    return functools.partial(_put_on_gpu, spec)


def _put_on_gpu(spec, value):
    gpu = physical_gpu(spec)
    return optree.tree_map(lambda leaf: to_gpu(leaf, gpu) if is_array(leaf) else leaf, value, none_is_leaf=True)


def _putters(strategy, fetch_to_device: bool):
    devices = tuple(strategy.extended.worker_devices)
    n = strategy.num_replicas_in_sync
    if len(devices) != n:
        raise ValueError(
            f"the strategy has {n} replicas in sync but {len(devices)} worker devices {devices}; expected one each"
        )
    return [device_putter(d, fetch_to_device) for d in devices]


def _placer(strategy, fetch_to_device: bool):
    """What a new iterator places each step with: a :class:`_GpuFeeder` for GPU replicas when
    fetching to the device, else the per-replica putters (identity on CPUs)."""
    putters = _putters(strategy, fetch_to_device)
    devices = strategy.extended.worker_devices
    if fetch_to_device and any_gpu(devices):
        return _GpuFeeder([physical_gpu(parse_device(d)) for d in devices])
    return putters


# ---------------------------------------------------------------------------------------------
# step producers: each yields steps, a PerReplica at each leaf (the plain value for one replica)


def _group(values: list, n: int):
    """One step from the ``n`` per-replica values (each already on its replica's device)."""
    if n == 1:
        return values[0]
    return regroup(values, PerReplica, always_wrap=True)


def _make_step(putters, values: list, n: int):
    """A step from per-replica host values: placed now, or staged for a :class:`_GpuFeeder`."""
    if type(putters) is _GpuFeeder:
        return putters.stage(values)
    return _group([put(v) for put, v in zip(putters, values)], n)


def _split_steps(dataset, n: int, putters, where: str):
    """Each global batch split across the ``n`` replicas with the ceil rule."""
    feeder = putters if type(putters) is _GpuFeeder else None
    if n == 1:
        if feeder is not None:
            for batch in dataset:
                yield feeder.stage([batch])
            return
        put = putters[0]
        for batch in dataset:
            yield put(batch)
        return
    from cudist._kernels._split import split_sizes

    # Host replicas (identity putters) take their rows as views straight into one PerReplica per
    # leaf; devices need each replica's whole piece to copy it. Either way a step is the same as
    # regroup(split(batch, n)) -- the kernel contract's split -- would make.
    on_host = feeder is None and all(put is _identity for put in putters)
    bounds_of: dict = {}
    for batch in dataset:
        leaves, treedef = optree.tree_flatten(batch)
        try:
            arrays = _batch_leaves(leaves)
        except ValueError as e:
            raise ValueError(
                f"{where}: cannot split the element across {n} replicas ({e}); the dataset must yield "
                "batches with a leading batch dimension: use dataset.batch(global_batch_size)"
            ) from None
        bsz = arrays[0].shape[0]
        bounds = bounds_of.get(bsz)
        if bounds is None:
            ends = np.cumsum([0, *split_sizes(bsz, n)]).tolist()
            bounds = bounds_of[bsz] = list(zip(ends[:-1], ends[1:]))
        if on_host:
            yield treedef.unflatten([PerReplica([a[s:e] for s, e in bounds]) for a in arrays])
        elif feeder is not None and any(is_device_array(a) for a in arrays):
            # Already on a GPU: split there by the scatter kernel (in the consumer's stream order).
            yield _DeviceBatch(treedef.unflatten(arrays))
        else:
            pieces = [treedef.unflatten([a[s:e] for a in arrays]) for s, e in bounds]
            yield _make_step(putters, pieces, n)


def _batch_leaves(leaves) -> list:
    """The leaves of a batch as arrays with one batch size (the checks of the kernels' split).

    Raises:
        ValueError: a leaf is a scalar, leaves disagree on the batch size, or there is no leaf.
    """
    if leaves and all(type(leaf) is np.ndarray and leaf.ndim for leaf in leaves):
        bsz = leaves[0].shape[0]
        if all(leaf.shape[0] == bsz for leaf in leaves):
            return leaves  # the common case, checked with the fewest Python operations
    from cudist._kernels._split import split

    # Anything else goes through the kernel contract's own checks and conversions: a "split" into
    # one piece is every leaf as an array (a view of all of it), or the error naming the leaf.
    return split(list(leaves), 1)[0]


def _empty_like(value):
    """A batch of zero rows shaped like ``value`` (what a replica gets when the data ran out)."""

    def empty(leaf):
        if np.ndim(leaf) == 0:
            raise ValueError(
                "distribute_datasets_from_function: the dataset ran out in the middle of a step and its "
                "elements have no batch dimension, so the remaining replicas can't get an empty batch; "
                "batch the dataset (dataset.batch(per_replica_batch_size))"
            )
        return leaf[:0]

    return optree.tree_map(empty, value, is_leaf=_data._is_list)


def _turn_steps(dataset, n: int, putters, partial: bool):
    """The dataset's elements dealt to the replicas in turn, one each per step.

    If the data runs out in the middle of a step the remaining replicas get empty batches
    (``partial``) or the step is dropped (TF1 iterators); iteration ends when no replica gets data.
    """
    it = iter(dataset)
    try:
        while True:
            values = []
            for _ in range(n):
                try:
                    values.append(next(it))
                except StopIteration:
                    break
            if not values or (len(values) < n and not partial):
                return
            while len(values) < n:
                values.append(_empty_like(values[0]))
            yield _make_step(putters, values, n)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _per_replica_steps(datasets, putters):
    """One dataset per replica; an exhausted replica gets empty batches until all are exhausted."""
    its = [iter(d) for d in datasets]
    last = [None] * len(its)
    try:
        while True:
            values = []
            for i, it in enumerate(its):
                if it is None:
                    values.append(None)
                    continue
                try:
                    values.append(next(it))
                except StopIteration:
                    its[i] = None
                    values.append(None)
            if all(v is None for v in values):
                return
            like = next(v for v in values if v is not None)
            for i, v in enumerate(values):
                if v is None:
                    values[i] = _empty_like(last[i] if last[i] is not None else like)
                else:
                    last[i] = v
            yield _make_step(putters, values, len(its))
    finally:
        for it in its:
            close = getattr(it, "close", None)
            if close is not None:
                close()


# ---------------------------------------------------------------------------------------------
# GPU input: pinned staging ring, copy streams, events


#: Byte alignment of each leaf inside a staging buffer (full-speed DMA, aligned dtype views).
_STAGE_ALIGN = 256
#: Staging buffers grow in steps of this many bytes, so slightly varying steps reuse them.
_STAGE_GRANULE = 64 << 10

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


class _DeviceBatch:
    """A global batch whose leaves (some of them) are already GPU arrays: split by scatter."""

    __slots__ = ("batch",)

    def __init__(self, batch):
        self.batch = batch


class _InFlight:
    """A step whose copies are enqueued: the arrays, and per GPU the event of its copies."""

    __slots__ = ("step", "events")

    def __init__(self, step, events):
        self.step, self.events = step, events


class _GpuFeeder:
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

    def __init__(self, gpus):
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
            size = -(-nbytes // _STAGE_GRANULE) * _STAGE_GRANULE
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
                    total = -(-total // _STAGE_ALIGN) * _STAGE_ALIGN
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
    def enqueue(self, item) -> _InFlight:
        """Allocates a staged step's arrays and enqueues its copies; returns it in flight."""
        import cupy  # noqa: PLC0415 - GPU input only

        n = len(self.gpus)
        if isinstance(item, _DeviceBatch):
            from cudist._kernels import get_backend

            # The scatter kernel runs on the current streams: already in the consumer's order.
            pieces = get_backend("cupy").scatter(item.batch, self.gpus)
            return _InFlight(_group(pieces, n), ())
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
        return _InFlight(_group(values, n), tuple(events))

    @staticmethod
    def hand_out(flight: _InFlight):
        """Makes the consumer's current stream on each GPU wait for the step's copies; the step."""
        if flight.events:
            import cupy  # noqa: PLC0415 - GPU input only

            for gpu, ev in flight.events:
                with cupy.cuda.Device(gpu):
                    cupy.cuda.get_current_stream().wait_event(ev)
        return flight.step


def _drain(inflight: collections.deque, feeder: _GpuFeeder) -> None:
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


class _DeviceSteps:
    """The consumer side of GPU input: keeps ``depth`` steps' copies in flight ahead of the one
    handed out (``experimental_per_replica_buffer_size``), copying in the consumer's thread."""

    def __init__(self, source, feeder: _GpuFeeder, depth: int):
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


# ---------------------------------------------------------------------------------------------
# iterators and datasets


class DistributedIterator:
    """Iterates a distributed dataset: each step is a PerReplica per leaf (plain for one replica)."""

    def __init__(self, steps, n: int, element_spec, prefetch: int = 0, feeder=None):
        # ``steps`` yields whole steps (see _group), or, with a GPU ``feeder``, steps staged in
        # pinned host memory that the feeder copies to the devices here, in the consumer's thread.
        if prefetch > 0:
            # Read (and stage) the next steps in a background thread while the current one trains.
            steps = _data._PrefetchIterator(steps, prefetch, name="cudist-device-prefetch")
        if feeder is not None:
            steps = _DeviceSteps(steps, feeder, prefetch)
        self._steps = steps
        self._n = n
        self._element_spec = element_spec

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._steps)

    next = __next__

    def get_next(self):
        """The next step.

        Raises:
            OutOfRangeError: the input is exhausted (it is also a StopIteration).
        """
        try:
            return self.__next__()
        except StopIteration:
            raise OutOfRangeError("End of sequence") from None

    def get_next_as_optional(self) -> DistributedOptional:
        """The next step as a :class:`DistributedOptional` (without a value once exhausted)."""
        try:
            return DistributedOptional(self.__next__(), True, self._element_spec)
        except StopIteration:
            return DistributedOptional(None, False, self._element_spec)

    @property
    def element_spec(self):
        """The structure of a step, with a PerReplicaSpec per leaf for several replicas."""
        return self._element_spec

    def close(self) -> None:
        """Stops the input early (a background device prefetch thread, a generator)."""
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()


def _new_iterator(strategy, fetch_to_device: bool, make_steps, n: int, element_spec, prefetch: int = 0):
    """A :class:`DistributedIterator` over ``make_steps(placer)`` (see :func:`_placer`).

    Each iterator gets its own GPU feeder (staging ring), so iterators never share buffers.
    """
    placer = _placer(strategy, fetch_to_device)
    feeder = placer if type(placer) is _GpuFeeder else None
    return DistributedIterator(make_steps(placer), n, element_spec, prefetch, feeder)


class _DistributedBase:
    def __init__(self, strategy, options, where):
        self._strategy = strategy
        self._options = _check_options(options, where)
        self._n = int(strategy.num_replicas_in_sync)
        _putters(strategy, self._options.experimental_fetch_to_device)  # bad worker devices fail here, not later
        self._prefetch = (
            self._options.experimental_per_replica_buffer_size
            if self._options.experimental_fetch_to_device and any_gpu(strategy.extended.worker_devices)
            else 0
        )

    def _steps(self, putters):
        raise NotImplementedError

    def __iter__(self) -> DistributedIterator:
        return _new_iterator(
            self._strategy, self._options.experimental_fetch_to_device, self._steps, self._n, self.element_spec,
            self._prefetch,
        )

    def reduce(self, initial_state, reduce_func):
        """Folds the steps: ``state = reduce_func(state, step)`` for each step."""
        state = initial_state
        for step in self:
            state = reduce_func(state, step)
        return state

    def build(self):
        """Nothing to build ahead of time; kept for API compatibility."""


class DistributedDataset(_DistributedBase):
    """A dataset of global batches, each split across the strategy's replicas.

    Built by ``Strategy.experimental_distribute_dataset(dataset, options)``. ``dataset`` is a
    :class:`cudist.data.Dataset` or any Python iterable of batches. Every ``iter()`` starts over
    (a one-pass iterable, such as a generator, can be iterated once).
    """

    def __init__(self, dataset, strategy, options=None):
        where = "experimental_distribute_dataset"
        super().__init__(strategy, options, where)
        if self._options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            raise NotImplementedError(
                "InputReplicationMode.PER_REPLICA is only supported in `distribute_datasets_from_function`."
            )
        self._dataset = _data.as_dataset(dataset, where)
        self._spec = None

    def _steps(self, putters):
        return _split_steps(self._dataset, self._n, putters, "experimental_distribute_dataset")

    @property
    def element_spec(self):
        """The dataset's element_spec with a PerReplicaSpec per leaf (unchanged for one replica)."""
        if self._spec is None:
            self._spec = _per_replica_spec(self._dataset.element_spec, self._n, split=True)
        return self._spec

    def cardinality(self) -> int:
        """The number of steps (the global batches), or -1 (infinite) / -2 (unknown)."""
        return self._dataset.cardinality()


class DistributedDatasetsFromFunction(_DistributedBase):
    """The datasets an input function builds, handing out per-replica batches.

    Built by ``Strategy.distribute_datasets_from_function(dataset_fn, options)``. ``dataset_fn`` is
    called here, once, with an :class:`InputContext` (once per replica with PER_REPLICA
    replication), and must return a Dataset or an iterable of per-replica batches.
    """

    def __init__(self, dataset_fn, strategy, options=None):
        where = "distribute_datasets_from_function"
        super().__init__(strategy, options, where)
        _check_placement(self._options, where)
        if not callable(dataset_fn):
            raise TypeError(f"{where}: dataset_fn must be callable, got {type(dataset_fn).__name__}")
        n = self._n
        if self._options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            contexts = [InputContext(n, i, n) for i in range(n)]
        else:
            contexts = [InputContext(1, 0, n)]
        what = f"{where} (the value dataset_fn returned)"
        self._datasets = [_data.as_dataset(dataset_fn(ctx), what) for ctx in contexts]
        self._spec = None

    def _steps(self, putters):
        if len(self._datasets) > 1:
            return _per_replica_steps(self._datasets, putters)
        return _turn_steps(self._datasets[0], self._n, putters, partial=True)

    @property
    def element_spec(self):
        """The function's dataset element_spec, with a PerReplicaSpec per leaf for several replicas."""
        if self._spec is None:
            self._spec = _per_replica_spec(self._datasets[0].element_spec, self._n, split=False)
        return self._spec


def distribute_values_from_function(value_fn, strategy, *, wrap_single: bool = True):
    """Calls ``value_fn(ValueContext(i, N))`` for each replica and places each result on its device.

    Returns a PerReplica at each leaf of the results; with one replica, the plain result unless
    ``wrap_single`` (TF: OneDeviceStrategy gives the plain value, a one-replica MirroredStrategy a
    one-component PerReplica).
    """
    if not callable(value_fn):
        raise TypeError(
            f"experimental_distribute_values_from_function: value_fn must be callable, got {type(value_fn).__name__}"
        )
    n = int(strategy.num_replicas_in_sync)
    putters = _putters(strategy, True)
    values = [putters[i](value_fn(ValueContext(i, n))) for i in range(n)]
    if n == 1 and not wrap_single:
        return values[0]
    return regroup(values, PerReplica, always_wrap=True)


# ---------------------------------------------------------------------------------------------
# TF1-era iterators (make_dataset_iterator / make_input_fn_iterator)


class _V1Iterator:
    def __init__(self, strategy):
        self._strategy = strategy
        self._n = int(strategy.num_replicas_in_sync)
        self._iterator = None
        self.initialize()

    def _make_steps(self, putters):
        raise NotImplementedError

    def initialize(self) -> list:
        """(Re)starts the iteration from the beginning. Returns the (empty) list of init ops."""
        if self._iterator is not None:
            self._iterator.close()
        self._iterator = _new_iterator(self._strategy, True, self._make_steps, self._n, None)
        return []

    def get_next(self):
        """The next step.

        Raises:
            OutOfRangeError: the input is exhausted.
        """
        return self._iterator.get_next()

    def __iter__(self):
        return self._iterator


class DatasetIterator(_V1Iterator):
    """``make_dataset_iterator(dataset)``: global batches split across the replicas, TF1 style."""

    def __init__(self, dataset, strategy):
        self._dataset = _data.as_dataset(dataset, "make_dataset_iterator")
        super().__init__(strategy)

    def _make_steps(self, putters):
        return _split_steps(self._dataset, self._n, putters, "make_dataset_iterator")


class InputFunctionIterator(_V1Iterator):
    """``make_input_fn_iterator(input_fn)``: the function's per-replica batches dealt in turn, TF1 style.

    As in TF1, a step for which some replica has no batch left ends the iteration.
    """

    def __init__(self, input_fn, strategy, replication_mode=InputReplicationMode.PER_WORKER):
        if replication_mode != InputReplicationMode.PER_WORKER:
            raise ValueError(f"Input replication mode not supported: {replication_mode!r}")
        if not callable(input_fn):
            raise TypeError(f"make_input_fn_iterator: input_fn must be callable, got {type(input_fn).__name__}")
        n = int(strategy.num_replicas_in_sync)
        self._dataset = _data.as_dataset(input_fn(InputContext(1, 0, n)), "make_input_fn_iterator")
        super().__init__(strategy)

    def _make_steps(self, putters):
        return _turn_steps(self._dataset, self._n, putters, partial=False)
