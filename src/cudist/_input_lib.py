"""Distributed input: datasets and iterators that hand each replica its part of every step.

``Strategy.experimental_distribute_dataset`` wraps a dataset of *global* batches and splits each
batch across the replicas (ceil rule: each replica gets ceil(B/N) rows in order, the last ones fewer
or none, so nothing is dropped); ``Strategy.distribute_datasets_from_function`` calls the user's
function with an :class:`InputContext` and hands out the *per-replica* batches its dataset yields,
one replica after another. Either way a step is a ``PerReplica`` at each leaf of the element (the
plain value when there is one replica), each component already on its replica's device.

CPU replicas share host memory: their pieces are views of the batch (:func:`device_putter` is the
identity for them). GPU replicas get their pieces through :class:`cudist._gpu_feeder.GpuFeeder`:
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar
import logging

import numpy as np
import optree

from cudist import data as _data
from cudist._arrays import is_array, is_device_array, physical_gpu, to_gpu
from cudist._devices import DeviceLike, DeviceSpec, any_gpu, parse_device
from cudist.errors import InvalidArgumentError, NotFoundError, OutOfRangeError
from cudist._gpu_feeder import DeviceBatch, DeviceSteps, GpuFeeder, group_step
from cudist._values import PerReplica, regroup

_T = TypeVar("_T")
_S = TypeVar("_S")

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
    "distribute_values_from_function",
    "device_putter",
]


# ---------------------------------------------------------------------------------------------
# contexts and options


class _ExtendedLike(Protocol):
    @property
    def _devices(self) -> tuple[str, ...]: ...  # the worker devices (the default strategy's too)

    @property
    def _num_workers(self) -> int: ...

    @property
    def worker_devices(self) -> tuple[str, ...]: ...  # this worker's replicas' devices

    @property
    def _worker_index(self) -> int: ...

    @property
    def _per_replica_input_supported(self) -> bool: ...

    def _any_worker(self, has_value: bool) -> bool: ...


class StrategyLike(Protocol):
    """What distributed input needs of a strategy (a :class:`cudist.Strategy`; this module sits below
    the strategies, so it names the attributes it reads instead of the class)."""

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas over every worker."""
        ...

    @property
    def extended(self) -> _ExtendedLike:
        """The strategy's extended part: its devices and worker hooks."""
        ...


#: Moves one replica's (nested) value onto its device (see :func:`device_putter`).
Putter: TypeAlias = "Callable[[Any], Any]"
#: How an iterator places its steps: a :class:`GpuFeeder` (GPU replicas) or one putter per replica.
Placer: TypeAlias = "GpuFeeder | list[Putter]"


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

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1) -> None:
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

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The per-replica batch size: ``global_batch_size // num_replicas_in_sync``.

        Args:
            global_batch_size: the batch size over all replicas.

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
    """What a value function (``experimental_distribute_values_from_function``) gets per replica.

    Args:
        replica_id_in_sync_group: the replica the value is for.
        num_replicas_in_sync: the number of replicas in sync.
    """

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
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

    if TYPE_CHECKING:  # the fields' types (the namedtuple base declares them untyped)

        @property
        def experimental_fetch_to_device(self) -> bool: ...

        @property
        def experimental_replication_mode(self) -> InputReplicationMode: ...

        @property
        def experimental_place_dataset_on_device(self) -> bool: ...

        @property
        def experimental_per_replica_buffer_size(self) -> int: ...

    def __new__(
        cls,
        experimental_fetch_to_device: bool | None = None,
        experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
        experimental_place_dataset_on_device: bool = False,
        experimental_per_replica_buffer_size: int = 1,
    ) -> InputOptions:
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


def _check_options(options: InputOptions | None, where: str) -> InputOptions:
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
    """The ``element_spec`` of a distributed leaf: one :class:`~cudist.data.TensorSpec` per replica.

    Args:
        *component_specs: each replica's :class:`~cudist.data.TensorSpec`.
    """

    def __init__(self, *component_specs: _data.TensorSpec) -> None:
        self._component_specs = tuple(component_specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerReplicaSpec) and self._component_specs == other._component_specs

    def __hash__(self) -> int:
        return hash(self._component_specs)

    def __repr__(self) -> str:
        return f"PerReplicaSpec({', '.join(map(repr, self._component_specs))})"


def _per_replica_spec(spec: Any, n: int, split: bool, workers: int = 1) -> Any:
    """Wraps each TensorSpec of ``spec`` for ``n`` replicas (identity for one replica of a one-worker job).

    Over several workers, as TF 2.21's MultiWorkerMirroredStrategy: always wrapped (one local
    replica too), and a split batch dimension is None (the pieces' sizes vary by worker and step).
    """
    if n == 1 and workers == 1:
        return spec

    def wrap(s: _data.TensorSpec) -> PerReplicaSpec:
        if split and s.shape and workers > 1:
            s = _data.TensorSpec((None, *s.shape[1:]), s.dtype, s.name)
        elif split and s.shape:
            b = s.shape[0]
            s = _data.TensorSpec((b // n if b is not None and b % n == 0 else None, *s.shape[1:]), s.dtype, s.name)
        return PerReplicaSpec(*([s] * n))

    return _data.map_specs(wrap, spec)


class DistributedOptional:
    """An optional step (``get_next_as_optional``): ``has_value()`` then ``get_value()``.

    Args:
        value: the step (None without one).
        has_value: whether there was a step.
        element_spec: the iterator's ``element_spec``.
    """

    def __init__(self, value: Any, has_value: bool, element_spec: Any) -> None:
        self._value = value
        self._has_value = bool(has_value)
        self._element_spec = element_spec

    def has_value(self) -> bool:
        """Whether there was a next step."""
        return self._has_value

    def get_value(self) -> Any:
        """The step.

        Returns:
            The step: a PerReplica at each leaf of the element (the plain value for one replica).

        Raises:
            InvalidArgumentError: (a ValueError, as TF) there was no next step.
        """
        if not self._has_value:
            raise InvalidArgumentError("The given optional does not have a value.")
        return self._value

    @property
    def element_spec(self) -> Any:
        """The structure of the step, as the iterator's ``element_spec``."""
        return self._element_spec

    def __repr__(self) -> str:
        return f"DistributedOptional(has_value={self._has_value})"


# ---------------------------------------------------------------------------------------------
# devices


def _identity(x: _T) -> _T:
    return x


@functools.lru_cache(maxsize=None)
def device_putter(device: DeviceLike, fetch_to_device: bool = True) -> Putter:
    """The function that moves one replica's (nested) value onto ``device``.

    Identity for CPU devices: logical CPUs share host memory, so no copy is made. For a GPU it
    copies every NumPy/CuPy array leaf into that GPU's memory (other leaves, such as Python
    numbers, stay as they are); with ``fetch_to_device=False`` values stay on the host.
    """
    spec = parse_device(device)
    if not spec.is_gpu or not fetch_to_device:
        return _identity
    return functools.partial(_put_on_gpu, spec)


def _put_on_gpu(spec: DeviceSpec, value: Any) -> Any:
    gpu = physical_gpu(spec)
    return optree.tree_map(lambda leaf: to_gpu(leaf, gpu) if is_array(leaf) else leaf, value, none_is_leaf=True)


def _putters(strategy: StrategyLike, fetch_to_device: bool) -> list[Putter]:
    devices = tuple(strategy.extended._devices)
    n = strategy.num_replicas_in_sync // strategy.extended._num_workers  # this worker's replicas
    if len(devices) != n:
        raise ValueError(
            f"the strategy has {n} replicas in sync but {len(devices)} worker devices {devices}; expected one each"
        )
    return [device_putter(d, fetch_to_device) for d in devices]


def _placer(strategy: StrategyLike, fetch_to_device: bool) -> Placer:
    """What a new iterator places each step with: a :class:`GpuFeeder` for GPU replicas when
    fetching to the device, else the per-replica putters (identity on CPUs)."""
    putters = _putters(strategy, fetch_to_device)
    devices = strategy.extended._devices
    if fetch_to_device and any_gpu(devices):
        return GpuFeeder([physical_gpu(parse_device(d)) for d in devices])
    return putters


# ---------------------------------------------------------------------------------------------
# step producers: each yields steps, a PerReplica at each leaf (the plain value for one replica)


def _make_step(putters: Placer, values: list[Any], n: int) -> Any:
    """A step from per-replica host values: placed now, or staged for a :class:`GpuFeeder`."""
    if type(putters) is GpuFeeder:
        return putters.stage(values)
    return group_step([put(v) for put, v in zip(putters, values)], n)  # type: ignore[arg-type]  # putters: a list here


def split_steps(
    dataset: Iterable[Any],
    n: int,
    putters: Placer,
    where: str,
    total: int | None = None,
    offsets: Sequence[int] = (0,),
) -> Iterator[Any]:
    """Each global batch split across the ``n`` replicas with the ceil rule.

    Multi-worker: the batch is split over ``total`` replicas (every worker's) and this worker's
    ``n`` take the pieces from each replica offset of ``offsets`` (one step per offset).
    """
    feeder = putters if type(putters) is GpuFeeder else None
    if total is not None and total != n:
        yield from _worker_split_steps(dataset, n, putters, where, total, offsets)
        return
    if n == 1:
        if feeder is not None:
            for batch in dataset:
                yield feeder.stage([batch])
            return
        put = putters[0]  # type: ignore[index]  # a list here (no feeder)
        for batch in dataset:
            yield put(batch)
        return
    from cudist._kernels import split_sizes

    # Host replicas (identity putters) take their rows as views straight into one PerReplica per
    # leaf; devices need each replica's whole piece to copy it. Either way a step is the same as
    # regroup(split(batch, n)) -- the kernel contract's split -- would make.
    on_host = feeder is None and all(put is _identity for put in putters)  # type: ignore[union-attr]  # a list unless feeder
    bounds_of: dict[int, list[tuple[int, int]]] = {}
    for batch in dataset:
        arrays, treedef = _split_leaves(batch, where, n)
        bsz = arrays[0].shape[0]
        bounds = bounds_of.get(bsz)
        if bounds is None:
            ends = np.cumsum([0, *split_sizes(bsz, n)]).tolist()
            bounds = bounds_of[bsz] = list(zip(ends[:-1], ends[1:]))
        if on_host:
            yield treedef.unflatten([PerReplica([a[s:e] for s, e in bounds]) for a in arrays])
        elif feeder is not None and any(is_device_array(a) for a in arrays):
            # Already on a GPU: split there by the scatter kernel (in the consumer's stream order).
            yield DeviceBatch(treedef.unflatten(arrays))
        else:
            pieces = [treedef.unflatten([a[s:e] for a in arrays]) for s, e in bounds]
            yield _make_step(putters, pieces, n)


def _worker_split_steps(
    dataset: Iterable[Any], n: int, putters: Placer, where: str, total: int, offsets: Sequence[int]
) -> Iterator[Any]:
    """This worker's replicas' pieces of each global batch split over ``total`` replicas (see split_steps)."""
    from cudist._kernels import split_sizes

    feeder = putters if type(putters) is GpuFeeder else None
    on_host = feeder is None and all(put is _identity for put in putters)  # type: ignore[union-attr]  # a list unless feeder
    bounds_of: dict[int, list[tuple[int, int]]] = {}
    for batch in dataset:
        arrays, treedef = _split_leaves(batch, where, total)
        bsz = arrays[0].shape[0]
        bounds = bounds_of.get(bsz)
        if bounds is None:
            ends = np.cumsum([0, *split_sizes(bsz, total)]).tolist()
            bounds = bounds_of[bsz] = list(zip(ends[:-1], ends[1:]))
        for off in offsets:
            mine = bounds[off : off + n]
            if n == 1 and on_host:
                s, e = mine[0]
                yield treedef.unflatten([a[s:e] for a in arrays])
            elif on_host:
                yield treedef.unflatten([PerReplica([a[s:e] for s, e in mine]) for a in arrays])
            else:
                pieces = [treedef.unflatten([a[s:e] for a in arrays]) for s, e in mine]
                yield _make_step(putters, pieces, n)


def batch_sizes_for_worker(global_batch_size: int, num_workers: int, replicas_per_worker: int, worker_index: int) -> list[int]:
    """TF's ``tf.data.experimental.service``-era ``batch_sizes_for_worker``: the per-replica batch
    sizes that worker ``worker_index`` re-splits its data into, so that every global step takes
    ``global_batch_size`` elements over all replicas (sizes floor or ceil of G / (W * R); worker 0's
    list starts with the ceilings, each later worker's is rotated by its replicas' offset).

    >>> batch_sizes_for_worker(7, 2, 2, 0), batch_sizes_for_worker(7, 2, 2, 1), batch_sizes_for_worker(3, 2, 1, 1)
    ([2, 2, 2, 1], [2, 1, 2, 2], [1, 2])
    """
    n = num_workers * replicas_per_worker
    floor, num_ceil = divmod(global_batch_size, n)
    worker_0 = [floor + 1] * num_ceil + [floor] * (n - num_ceil)
    offset = worker_index * replicas_per_worker
    return worker_0[offset:] + worker_0[:offset]


def rebatch_steps(dataset: Iterable[Any], n: int, putters: Placer, where: str, workers: int, index: int) -> Iterator[Any]:
    """Steps of a multi-worker dataset with AutoShardPolicy.OFF, as TF 2.21 makes them.

    Every worker reads the whole dataset; its rows are re-split (across the global batches) into
    per-replica batches of :func:`batch_sizes_for_worker` sizes, cycled, the global batch size
    being the pipeline's last ``batch`` size (else the first batch's); each step gives ``n`` of them to this worker's replicas. The last
    piece may be partial, and a last step short of pieces gets empty ones. So ``range(10).batch(4)``
    over 2 one-replica workers is ``[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]`` on each, and
    ``range(6).batch(3)`` is ``[0, 1], [2], [3, 4], [5]`` on worker 0 and ``[0], [1, 2], [3], [4, 5]`` on
    worker 1.
    """
    sizes: list[int] = []
    static = _data.static_batch_size(dataset)
    chunks: list[list[Any]] = []  # rows not yet given out, as per-leaf lists of arrays, in order
    buffered = 0
    treedef: Any = None
    k = 0
    pieces: list[list[Any]] = []  # this step's pieces so far, each the leaves of one replica's batch

    def take(count: int) -> list[Any]:
        nonlocal buffered
        out, need = [], count
        while need:
            head = chunks[0]
            rows = head[0].shape[0]
            if rows <= need:
                out.append(head)
                chunks.pop(0)
                need -= rows
            else:
                out.append([a[:need] for a in head])
                chunks[0] = [a[need:] for a in head]
                need = 0
        buffered -= count
        if not out:  # an empty piece, shaped as the rows around it
            return [a[:0] for a in chunks[0]]
        if len(out) == 1:
            return out[0]
        from cudist._arrays import array_module  # noqa: PLC0415 - only for pieces spanning two batches

        return [array_module(parts[0]).concatenate(parts) for parts in zip(*out)]

    def step() -> Any:
        if n == 1 and type(putters) is not GpuFeeder and putters[0] is _identity:  # type: ignore[index]  # a list here
            return treedef.unflatten(pieces[0])
        return _make_step(putters, [treedef.unflatten(p) for p in pieces], n)

    for batch in dataset:
        arrays, treedef = _split_leaves(batch, where, workers * n)
        if not any(sizes):  # the pipeline's batch size (as TF's compute_batch_size), else the first batch's rows
            sizes = batch_sizes_for_worker(static or int(arrays[0].shape[0]), workers, n, index)
        chunks.append(list(arrays))
        buffered += int(arrays[0].shape[0])
        while buffered and buffered >= sizes[k]:
            pieces.append(take(sizes[k]))
            k = (k + 1) % len(sizes)
            if len(pieces) == n:
                yield step()
                pieces = []
    if buffered:
        pieces.append(take(buffered))
    if pieces:
        last = pieces[-1]
        pieces.extend([a[:0] for a in last] for _ in range(n - len(pieces)))
        yield step()


def _split_leaves(batch: Any, where: str, replicas: int) -> tuple[list[Any], Any]:
    """(the batch's leaves as arrays of one batch size, its treedef), or a ValueError for ``where``
    saying the element cannot be split across ``replicas`` replicas."""
    leaves, treedef = optree.tree_flatten(batch)
    try:
        return _batch_leaves(leaves), treedef
    except ValueError as e:
        raise ValueError(
            f"{where}: cannot split the element across {replicas} replicas ({e}); the dataset must yield "
            "batches with a leading batch dimension: use dataset.batch(global_batch_size)"
        ) from None


def _batch_leaves(leaves: list[Any]) -> list[Any]:
    """The leaves of a batch as arrays with one batch size (the checks of the kernels' split).

    Raises:
        ValueError: a leaf is a scalar, leaves disagree on the batch size, or there is no leaf.
    """
    if leaves and all(type(leaf) is np.ndarray and leaf.ndim for leaf in leaves):
        bsz = leaves[0].shape[0]
        if all(leaf.shape[0] == bsz for leaf in leaves):
            return leaves  # the common case, checked with the fewest Python operations
    from cudist._kernels import split

    # Anything else goes through the kernel contract's own checks and conversions: a "split" into
    # one piece is every leaf as an array (a view of all of it), or the error naming the leaf.
    return split(list(leaves), 1)[0]  # type: ignore[no-any-return]  # _kernels' split: list


def _empty_like(value: Any) -> Any:
    """A batch of zero rows shaped like ``value`` (what a replica gets when the data ran out)."""

    def empty(leaf: Any) -> Any:
        if np.ndim(leaf) == 0:
            raise ValueError(
                "distribute_datasets_from_function: the dataset ran out in the middle of a step and its "
                "elements have no batch dimension, so the remaining replicas can't get an empty batch; "
                "batch the dataset (dataset.batch(per_replica_batch_size))"
            )
        return leaf[:0]

    return optree.tree_map(empty, value, is_leaf=_data.is_list_leaf)


def _paddable(value: Any) -> bool:
    """Whether a replica's empty batch can be made like ``value`` (no leaf is a scalar)."""
    return all(np.ndim(leaf) > 0 for leaf in optree.tree_leaves(value, is_leaf=_data.is_list_leaf))


def turn_steps(
    dataset: Iterable[Any], n: int, putters: Placer, partial: bool | Callable[[], bool]
) -> Iterator[Any]:
    """The dataset's elements dealt to the replicas in turn, one each per step.

    If the data runs out in the middle of a step the remaining replicas get empty batches
    (``partial``: True, or a function asked then) or the step is dropped (TF1 iterators, datasets
    of static shapes); elements without a batch dimension (a scalar leaf) cannot be padded, so
    such a step is dropped too. Iteration ends when no replica gets data.
    """
    it = iter(dataset)
    try:
        while True:
            values: list[Any] = []
            for _ in range(n):
                try:
                    values.append(next(it))
                except StopIteration:
                    break
            if not values:
                return
            if len(values) < n and (
                not (partial() if callable(partial) else partial) or not _paddable(values[0])
            ):
                return
            while len(values) < n:
                values.append(_empty_like(values[0]))
            yield _make_step(putters, values, n)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _per_replica_steps(datasets: Sequence[Iterable[Any]], putters: Placer) -> Iterator[Any]:
    """One dataset per replica; an exhausted replica gets empty batches until all are exhausted."""
    its: list[Iterator[Any] | None] = [iter(d) for d in datasets]
    last: list[Any] = [None] * len(its)
    try:
        while True:
            values: list[Any] = []
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
# iterators and datasets


class DistributedIterator:
    """Iterates a distributed dataset: each step is a PerReplica per leaf (plain for one replica).

    Made by ``iter()`` of a distributed dataset.

    Args:
        steps: the steps (see ``group_step``), or, with a GPU ``feeder``, steps staged for it.
        n: this worker's number of replicas.
        element_spec: the structure of a step (see :attr:`element_spec`).
        prefetch: how many steps to read ahead in a background thread (0: none).
        feeder: the :class:`cudist._gpu_feeder.GpuFeeder` that copies staged steps to the GPUs.
        any_worker: multi-worker: ``any_worker(has_step)`` tells whether any worker has a step
            (steps then end together on every worker); None with one worker.
    """

    def __init__(
        self,
        steps: Iterator[Any],
        n: int,
        element_spec: Any,
        prefetch: int = 0,
        feeder: GpuFeeder | None = None,
        any_worker: Callable[[bool], bool] | None = None,
    ) -> None:
        # ``steps`` yields whole steps (see group_step), or, with a GPU ``feeder``, steps staged in
        # pinned host memory that the feeder copies to the devices here, in the consumer's thread.
        if prefetch > 0:
            # Read (and stage) the next steps in a background thread while the current one trains.
            steps = _data.PrefetchIterator(steps, prefetch, name="cudist-device-prefetch")
        if feeder is not None:
            steps = DeviceSteps(steps, feeder, prefetch)
        if any_worker is not None:
            # Multi-worker: steps end together on every worker (a worker out of data gets empty batches).
            steps = _synced_steps(steps, any_worker, element_spec)
        self._steps = steps
        self._n = n
        self._element_spec = element_spec
        self._consumed = 0  # steps handed out: the position cudist.train.Checkpoint saves
        self._broken: BaseException | None = None  # what interrupted a step's read (see __next__)
        # builds a fresh iterator over the same input (set by the dataset's __iter__)
        self._remake: Callable[[], DistributedIterator] | None = None

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._broken is not None:
            raise RuntimeError(
                f"this distributed iterator was interrupted by {type(self._broken).__name__} while it read step "
                f"{self._consumed + 1}; its input pipeline cannot resume from there. Create a new iterator "
                "(iter(dataset)), or restore a cudist.train.Checkpoint that tracks the iterator to continue "
                "from a saved position"
            ) from self._broken
        try:
            step = next(self._steps)
        except StopIteration:
            raise
        except BaseException as e:
            # An exception escaping a generator finishes it: without this, the next call would
            # end the iteration silently and a training loop would stop early without an error.
            self._broken = e
            raise
        self._consumed += 1
        return step

    next = __next__

    def get_next(self) -> Any:
        """The next step.

        Returns:
            A PerReplica at each leaf of the element (the plain value for one replica); typed
            ``Any``, as the element's structure is the dataset's.

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
    def element_spec(self) -> Any:
        """The structure of a step, with a PerReplicaSpec per leaf for several replicas."""
        return self._element_spec

    def close(self) -> None:
        """Stops the input early (a background device prefetch thread, a generator)."""
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()

    # -- checkpoints: cudist.train.Checkpoint saves and restores the position through these
    def _checkpoint_state(self) -> dict[str, int]:
        """The iterator's position: how many steps it has handed out."""
        return {"position": self._consumed}

    def _restore_state(self, state: dict[str, Any]) -> None:
        """Moves the iterator to ``state["position"]`` steps from the start (:meth:`_prepare_restore`, then its commit)."""
        self._prepare_restore(state)()

    def _prepare_restore(self, state: dict[str, Any]) -> Callable[[], None]:
        """Replays the input up to ``state["position"]`` and returns the function that moves this iterator there.

        The replay runs on a fresh iterator over the same input, so a position the input cannot reach
        raises before this iterator changes (a checkpoint restore checks every object before it assigns
        any). Only an iterator that cannot be re-created and has handed out nothing is advanced in
        place, as the replay. Skipped steps are read, split and placed like any other, then dropped: the
        position is exact for a deterministic input pipeline (a shuffle needs a seed), and restoring
        costs reading that many steps.

        Raises:
            ValueError: the input ends before that position, or this iterator cannot be re-created.
        """
        target = state["position"]
        if isinstance(target, bool) or not isinstance(target, int) or target < 0:
            raise ValueError(f"an iterator position must be an integer >= 0, got {target!r}")
        broken = getattr(self, "_broken", None) is not None  # an input that raised cannot resume
        if target == self._consumed and not broken:
            return lambda: None
        if self._remake is not None:
            fresh = self._remake()
            try:
                fresh._skip_to(target)
            except BaseException:
                fresh.close()
                raise

            def commit() -> None:
                self.close()
                self._steps, self._consumed, self._broken = fresh._steps, fresh._consumed, None

            return commit
        if self._consumed or broken:
            raise ValueError("this iterator cannot be re-created to restore an earlier position")
        self._skip_to(target)
        return lambda: None

    def _skip_to(self, target: int) -> None:
        while self._consumed < target:
            try:
                next(self._steps)
            except StopIteration:
                raise ValueError(
                    f"cannot restore the iterator to step {target}: its input ends after {self._consumed} steps"
                ) from None
            self._consumed += 1


def new_iterator(
    strategy: StrategyLike,
    fetch_to_device: bool,
    make_steps: Callable[[Placer], Iterator[Any]],
    n: int,
    element_spec: Any,
    prefetch: int = 0,
) -> DistributedIterator:
    """A :class:`DistributedIterator` over ``make_steps(placer)`` (see :func:`_placer`).

    Each iterator gets its own GPU feeder (staging ring), so iterators never share buffers.
    """
    placer = _placer(strategy, fetch_to_device)
    feeder = placer if type(placer) is GpuFeeder else None
    ext = strategy.extended
    any_worker = ext._any_worker if ext._num_workers > 1 else None
    return DistributedIterator(make_steps(placer), n, element_spec, prefetch, feeder, any_worker)


def _synced_steps(steps: Iterator[Any], any_worker: Callable[[bool], bool], element_spec: Any) -> Iterator[Any]:
    """``steps`` ending on every worker together: while any worker has a step, one without gets empty batches."""
    last: Any = None
    it = iter(steps)
    try:
        while True:
            try:
                step = next(it)
                has = True
            except StopIteration:
                step, has = None, False
            if not any_worker(has):
                return
            if has:
                last = step
                yield step
            else:
                yield _empty_step(last, element_spec)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _empty_step(last: Any, element_spec: Any) -> Any:
    """A step of empty batches shaped like ``last`` (or, before any step, like ``element_spec``)."""

    def empty(x: Any) -> Any:
        if isinstance(x, PerReplica):
            return PerReplica([empty(v) for v in x.values])
        if np.ndim(x) == 0:
            raise ValueError(
                "multi-worker input: this worker ran out of data before the others and its elements have no "
                "batch dimension, so it cannot take part with an empty batch; batch the dataset"
            )
        return x[:0]

    if last is not None:
        return optree.tree_map(empty, last, is_leaf=lambda x: isinstance(x, PerReplica))

    def from_spec(s: Any) -> Any:
        if isinstance(s, PerReplicaSpec):
            return PerReplica([from_spec(c) for c in s._component_specs])
        shape = tuple(0 if d is None else d for d in s.shape)
        return np.zeros((0, *shape[1:]) if shape else (0,), s.dtype)

    return optree.tree_map(
        from_spec, element_spec, is_leaf=lambda x: isinstance(x, (PerReplicaSpec, _data.TensorSpec))
    )


class _Cardinality(int):
    """A distributed dataset's cardinality: an int that may still be called, as the old method was."""

    def __call__(self) -> int:
        import warnings

        warnings.warn(
            "DistributedDataset.cardinality is a property (as in TF); drop the call parentheses",
            DeprecationWarning,
            stacklevel=2,
        )
        return int(self)


class _DistributedBase:
    def __init__(self, strategy: StrategyLike, options: InputOptions | None, where: str) -> None:
        self._strategy = strategy
        self._options = _check_options(options, where)
        ext = strategy.extended
        self._workers, self._worker_index = ext._num_workers, ext._worker_index
        self._n = int(strategy.num_replicas_in_sync) // self._workers  # this worker's replicas
        _putters(strategy, self._options.experimental_fetch_to_device)  # bad worker devices fail here, not later
        self._prefetch = (
            self._options.experimental_per_replica_buffer_size
            if self._options.experimental_fetch_to_device and any_gpu(strategy.extended._devices)
            else 0
        )

    def _steps(self, putters: Placer) -> Iterator[Any]:
        raise NotImplementedError

    if TYPE_CHECKING:

        @property
        def element_spec(self) -> Any: ...  # each dataset's own

    def __iter__(self) -> DistributedIterator:
        it = new_iterator(
            self._strategy, self._options.experimental_fetch_to_device, self._steps, self._n, self.element_spec,
            self._prefetch,
        )
        it._remake = self.__iter__  # for restoring a checkpointed position
        return it

    def reduce(self, initial_state: _S, reduce_func: Callable[[_S, Any], _S]) -> _S:
        """Folds the steps: ``state = reduce_func(state, step)`` for each step.

        Args:
            initial_state: the state before the first step.
            reduce_func: ``(state, step) -> state``.

        Returns:
            The state after the last step.
        """
        state = initial_state
        for step in self:
            state = reduce_func(state, step)
        return state

    def build(self) -> None:
        """Nothing to build ahead of time; kept for API compatibility."""


class DistributedDataset(_DistributedBase):
    """A dataset of global batches, each split across the strategy's replicas.

    Built by ``Strategy.experimental_distribute_dataset(dataset, options)``. ``dataset`` is a
    :class:`cudist.data.Dataset` or any Python iterable of batches. Every ``iter()`` starts over
    (a one-pass iterable, such as a generator, can be iterated once).

    Args:
        dataset: a :class:`cudist.data.Dataset` of global batches, or any iterable of them.
        strategy: the :class:`cudist.Strategy` whose replicas get the pieces.
        options: a :class:`cudist.InputOptions`.

    Raises:
        NotImplementedError: PER_REPLICA replication (only ``distribute_datasets_from_function``).
        TypeError: ``options`` is not an InputOptions.
    """

    def __init__(self, dataset: Iterable[Any], strategy: StrategyLike, options: InputOptions | None = None) -> None:
        where = "experimental_distribute_dataset"
        super().__init__(strategy, options, where)
        if self._options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            raise NotImplementedError(
                "InputReplicationMode.PER_REPLICA is only supported in `distribute_datasets_from_function`."
            )
        self._dataset = _data.as_dataset(dataset, where)
        self._spec: Any = None
        #: The AutoShardPolicy used over the workers (None in a one-worker job).
        self.auto_shard_policy = None
        if self._workers > 1:
            self.auto_shard_policy = _resolve_shard_policy(self._dataset, self._workers, self._worker_index)

    def _steps(self, putters: Placer) -> Iterator[Any]:
        where = "experimental_distribute_dataset"
        if self._workers == 1:
            return split_steps(self._dataset, self._n, putters, where)
        if self.auto_shard_policy is _data.AutoShardPolicy.OFF:
            return rebatch_steps(self._dataset, self._n, putters, where, self._workers, self._worker_index)
        total = self._n * self._workers
        offsets = (self._worker_index * self._n,)  # DATA: this worker's share of each global batch
        return split_steps(self._dataset, self._n, putters, where, total, offsets)

    @property
    def element_spec(self) -> Any:
        """The dataset's element_spec with a PerReplicaSpec per leaf (unchanged for one replica)."""
        if self._spec is None:
            self._spec = _per_replica_spec(self._dataset.element_spec, self._n, split=True, workers=self._workers)
        return self._spec

    @property
    def cardinality(self) -> int:
        """The number of steps (the global batches), or -1 (infinite) / -2 (unknown).

        A property, as in TF 2.21 (calling it, the old form, still works and warns).
        """
        return _Cardinality(self._dataset.cardinality())


class DistributedDatasetsFromFunction(_DistributedBase):
    """The datasets an input function builds, handing out per-replica batches.

    Built by ``Strategy.distribute_datasets_from_function(dataset_fn, options)``. ``dataset_fn`` is
    called here, once, with an :class:`InputContext` (once per replica with PER_REPLICA
    replication), and must return a Dataset or an iterable of per-replica batches.

    Args:
        dataset_fn: returns a :class:`cudist.data.Dataset` (or an iterable) of per-replica batches
            for the :class:`InputContext` it gets.
        strategy: the :class:`cudist.Strategy` whose replicas get the batches.
        options: a :class:`cudist.InputOptions`.

    Raises:
        TypeError: ``dataset_fn`` is not callable, or ``options`` is not an InputOptions.
        ValueError: inconsistent placement options.
    """

    def __init__(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        strategy: StrategyLike,
        options: InputOptions | None = None,
    ) -> None:
        where = "distribute_datasets_from_function"
        super().__init__(strategy, options, where)
        _check_placement(self._options, where)
        if not callable(dataset_fn):
            raise TypeError(f"{where}: dataset_fn must be callable, got {type(dataset_fn).__name__}")
        n = self._n
        total = n * self._workers
        if self._options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            if not strategy.extended._per_replica_input_supported:
                raise NotImplementedError(  # TF 2.21's error and message
                    "InputReplicationMode.PER_REPLICA is only supported in `distribute_datasets_from_function` of "
                    "tf.distribute.MirroredStrategy"
                )
            first = self._worker_index * n
            contexts = [InputContext(total, first + i, total) for i in range(n)]
        else:  # once per worker
            contexts = [InputContext(self._workers, self._worker_index, total)]
        what = f"{where} (the value dataset_fn returned)"
        returned = [dataset_fn(ctx) for ctx in contexts]
        self._datasets = [_data.as_dataset(r, what) for r in returned]
        self._given_datasets = isinstance(returned[0], _data.Dataset)
        self._spec: Any = None

    def _pads_partial_steps(self) -> bool:
        """Whether a step the data runs out in gets empty batches for the remaining replicas.

        As TF 2.21: only if the dataset's element_spec has an unknown dimension (batches that may
        be partial) or the job has several workers; a dataset of static shapes (unbatched
        elements, ``drop_remainder`` batches) drops that last, incomplete step. A Python iterable
        (which has no element_spec of its own) is padded wherever its elements have a batch dimension.
        """
        if self._workers > 1 or not self._given_datasets:
            return True
        specs = _data.flatten_specs(self._datasets[0].element_spec)[0]
        return any(d is None for s in specs for d in s.shape)

    def _steps(self, putters: Placer) -> Iterator[Any]:
        if len(self._datasets) > 1:
            return _per_replica_steps(self._datasets, putters)
        return turn_steps(self._datasets[0], self._n, putters, partial=self._pads_partial_steps)

    @property
    def cardinality(self) -> int:
        """The cardinality of the dataset ``dataset_fn`` returned (TF 2.21 gives that, not the steps).

        -1 is infinite, -2 unknown; a property, as in TF.
        """
        return _Cardinality(self._datasets[0].cardinality())

    @property
    def element_spec(self) -> Any:
        """The function's dataset element_spec, with a PerReplicaSpec per leaf for several replicas.

        Over several workers, as TF 2.21: always per replica, the batch dimension None (even with
        ``drop_remainder``).
        """
        if self._spec is None:
            many = self._workers > 1
            self._spec = _per_replica_spec(self._datasets[0].element_spec, self._n, split=many, workers=self._workers)
        return self._spec


_log = logging.getLogger("cudist")


def _resolve_shard_policy(dataset: _data.Dataset, workers: int, index: int) -> _data.AutoShardPolicy:
    """The AutoShardPolicy a multi-worker DistributedDataset uses (AUTO is DATA: no file sources here)."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    P = _data.AutoShardPolicy
    if policy is P.FILE:  # TF 2.21: NotFoundError ("Found an unshardable source dataset")
        raise NotFoundError(
            "experimental_distribute_dataset: AutoShardPolicy.FILE needs a dataset that reads files, but this "
            "dataset has no file source (an unshardable source dataset, as TF says); use AutoShardPolicy.DATA "
            "(or AUTO), or OFF"
        )
    used = P.DATA if policy in (P.AUTO, P.HINT) else policy
    _log.info(
        "experimental_distribute_dataset: worker %d of %d: auto_shard_policy %s%s", index, workers, policy.name,
        f" -> {used.name} (the dataset has no file source)" if used is not policy else "",
    )
    return used


def distribute_values_from_function(
    value_fn: Callable[[ValueContext], Any], strategy: StrategyLike, *, wrap_single: bool = True
) -> Any:
    """Calls ``value_fn(ValueContext(i, N))`` for each replica and places each result on its device.

    Returns a PerReplica at each leaf of the results; with one replica, the plain result unless
    ``wrap_single`` (TF: OneDeviceStrategy gives the plain value, a one-replica MirroredStrategy a
    one-component PerReplica).
    """
    if not callable(value_fn):
        raise TypeError(
            f"experimental_distribute_values_from_function: value_fn must be callable, got {type(value_fn).__name__}"
        )
    total = int(strategy.num_replicas_in_sync)
    ext = strategy.extended
    n = total // ext._num_workers  # this worker's replicas; their ids count over every worker
    first = ext._worker_index * n
    putters = _putters(strategy, True)
    values = [putters[i](value_fn(ValueContext(first + i, total))) for i in range(n)]
    if n == 1 and not wrap_single:
        return values[0]
    return regroup(values, PerReplica, always_wrap=True)
