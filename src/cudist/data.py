"""A small ``tf.data``: input pipelines over NumPy arrays (and CuPy arrays, passed through).

``cudist.data.Dataset`` has the ``tf.data.Dataset`` methods a custom training loop uses (range,
from_tensor_slices, from_tensors, from_generator, batch, shard, repeat, map, filter, take, skip,
shuffle, unbatch, enumerate, zip, prefetch) with TensorFlow 2.21's semantics, except that elements
are NumPy arrays and NumPy scalars instead of tensors.

Element structures follow ``tf.data``: tuples, namedtuples and dicts are structure; a Python list is
*one* value (converted to an array), as ``tf.data`` converts lists to tensors. Python scalars and
lists convert with TensorFlow's dtypes (int -> int32, float -> float32); NumPy values keep theirs.
Elements sliced out of arrays are read-only views, as tensors are immutable, and batches are
read-only too (as ``tf.data``'s ``as_numpy_iterator`` gives them).

``batch`` over rows of in-memory arrays (``from_tensor_slices``, ``from_tensors`` or ``range``,
through any of ``shuffle``, ``take``, ``skip``, ``shard``, ``repeat``) gathers each batch at once
-- a view of the source for consecutive rows -- instead of stacking its elements one by one; the
batches are the same either way.

Every method returns a new Dataset; iterating a Dataset (``iter(ds)``) always starts over.
Any Python iterable of batches (a list of arrays, a generator, a DataLoader) can be wrapped with
:func:`as_dataset`, which is what ``Strategy.experimental_distribute_dataset`` does.
"""

from __future__ import annotations

import builtins
import enum
import itertools
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar, cast

import numpy as np
import optree
from numpy.typing import DTypeLike, NDArray

from cudist._arrays import array_module, is_array, is_device_array, python_dtype
from cudist.errors import InvalidArgumentError, OutOfRangeError

__all__ = [
    "AUTOTUNE",
    "AutoShardPolicy",
    "DistributeOptions",
    "Options",
    "experimental",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Dataset",
    "DatasetIterator",
    "TensorSpec",
    "as_dataset",
]

#: ``prefetch(AUTOTUNE)`` lets cudist choose the buffer size (as ``tf.data.AUTOTUNE``).
AUTOTUNE = -1
#: ``cardinality()`` of a dataset that never ends.
INFINITE_CARDINALITY = -1
#: ``cardinality()`` of a dataset whose length is not known without iterating it.
UNKNOWN_CARDINALITY = -2

# The buffer size prefetch(AUTOTUNE) uses: enough to overlap one step's input with the step.
_AUTOTUNE_BUFFER = 2
_INT32 = np.iinfo(np.int32)
_INT64 = np.iinfo(np.int64)

#: An int argument: a Python int or a NumPy integer (bools are refused).
_IntLike: TypeAlias = "int | np.integer[Any]"
#: One run of row positions (see ``_Rows``): a range with a positive step, or an int64 array.
_Run: TypeAlias = "builtins.range | NDArray[np.int64]"
#: A fresh iterator of runs each time it is called.
_Positions: TypeAlias = "Callable[[], Iterator[_Run]]"
_T = TypeVar("_T")


class _ShapedLike(Protocol):
    """An array, array scalar or :class:`TensorSpec`: anything with a shape and a dtype."""

    @property
    def shape(self) -> tuple[int | None, ...]: ...

    @property
    def dtype(self) -> Any: ...


class TensorSpec(NamedTuple):
    """The shape and dtype of one component of a dataset element (``None`` for an unknown dim)."""

    shape: tuple[int | None, ...]
    dtype: DTypeLike
    name: str | None = None

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape!r}, dtype={np.dtype(self.dtype).name}, name={self.name!r})"

    def is_compatible_with(self, value: _ShapedLike) -> bool:
        """Whether ``value`` (an array or a spec) has this spec's dtype and a matching shape."""
        shape = tuple(getattr(value, "shape", ()))
        if np.dtype(value.dtype) != np.dtype(self.dtype) or len(shape) != len(self.shape):
            return False
        return all(a is None or b is None or a == b for a, b in zip(self.shape, shape))


# ---------------------------------------------------------------------------------------------
# structures and conversion


def is_list_leaf(x: object) -> bool:
    """Lists are values in dataset elements (as in TF), not nested structures: optree `is_leaf`."""
    return isinstance(x, list)


def _flatten(structure: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves and treedef of an element; lists are leaves (one value each), as in tf.data."""
    return optree.tree_flatten(structure, is_leaf=is_list_leaf)


def _map(fn: Callable[[Any], Any], structure: Any) -> Any:
    return optree.tree_map(fn, structure, is_leaf=is_list_leaf)


def _is_spec(x: object) -> bool:
    # TensorSpec is a namedtuple, which optree would otherwise open up as structure.
    return isinstance(x, TensorSpec)


def map_specs(fn: Callable[[TensorSpec], Any], spec_structure: Any) -> Any:
    """Applies ``fn`` to each :class:`TensorSpec` of an ``element_spec`` structure."""
    return optree.tree_map(fn, spec_structure, is_leaf=_is_spec)


def flatten_specs(spec_structure: Any) -> tuple[list[TensorSpec], optree.PyTreeSpec]:
    """The :class:`TensorSpec` leaves and treedef of an ``element_spec`` structure."""
    return optree.tree_flatten(spec_structure, is_leaf=_is_spec)


def _only_python_scalars(seq: Sequence[Any]) -> bool:
    """True if a nested list holds only Python numbers (TF then picks int32/float32)."""
    stack: list[Any] = [seq]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif type(item) not in (bool, int, float, complex):  # np.float64 subclasses float
            return False
    return True


def _to_value(x: Any, where: str) -> Any:
    """Converts one leaf to what elements hold: a NumPy array/scalar (a device array stays)."""
    if is_array(x):  # GPU arrays pass through untouched: they are already what a replica wants
        return x
    if isinstance(x, bool):
        return np.bool_(x)
    if isinstance(x, int):
        return np.int32(x) if _INT32.min <= x <= _INT32.max else np.int64(x)
    if isinstance(x, float):
        return np.float32(x)
    if isinstance(x, complex):
        return np.complex128(x)
    if isinstance(x, (str, bytes)):
        return np.bytes_(x.encode() if isinstance(x, str) else x)
    if isinstance(x, list):
        try:
            arr = np.asarray(x)
        except ValueError as e:
            raise ValueError(f"{where}: can't convert a non-rectangular Python list to an array: {e}") from None
        if arr.dtype == object:
            raise ValueError(f"{where}: can't convert a non-rectangular Python list (or one of objects) to an array")
        return python_dtype(arr) if _only_python_scalars(x) else arr
    if x is None:
        raise TypeError(f"{where}: an element component is None; dataset elements must be arrays or numbers")
    try:
        arr = np.asarray(x)  # torch CPU tensors and other __array__ objects
    except Exception as e:
        raise TypeError(f"{where}: can't convert a {type(x).__name__} to an array: {e}") from None
    if arr.dtype == object:
        raise TypeError(f"{where}: can't convert a {type(x).__name__} to an array (got an object array)")
    return arr


def _normalize(element: Any, where: str) -> Any:
    """Converts every leaf of an element; lists become arrays."""
    return _map(lambda leaf: _to_value(leaf, where), element)


def _readonly(a: _T) -> _T:
    if isinstance(a, np.ndarray) and a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _readonly_new(a: _T) -> _T:
    """Makes a freshly made array (nothing else refers to it) read-only in place."""
    if isinstance(a, np.ndarray):
        a.flags.writeable = False
    return a


def _spec_of(leaf: Any) -> TensorSpec:
    return TensorSpec(tuple(int(d) for d in getattr(leaf, "shape", ())), np.dtype(leaf.dtype))


def _structure_spec(element: Any) -> Any:
    return _map(_spec_of, element)


def _check_int(value: object, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# prefetch: a background producer thread that never outlives its consumer


class _End:
    pass


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = _End()
_POLL_S = 0.05


def _put_unless_stopped(q: queue.Queue[Any], item: object, stop: threading.Event) -> bool:
    """Puts ``item`` on ``q``, polling ``stop`` while ``q`` is full; returns False once ``stop`` is set."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            break
        except queue.Full:
            pass
    return not stop.is_set()


def _prefetch_worker(source: Iterator[Any], q: queue.Queue[Any], stop: threading.Event) -> None:
    # Holds no reference to the consuming iterator, so dropping that iterator (a ``break``) lets its
    # finalizer set ``stop``; every blocking put polls ``stop`` so the thread then exits promptly.
    try:
        try:
            msg: _End | _Raised = _END
            for item in source:
                if not _put_unless_stopped(q, item, stop):
                    return
        except BaseException as e:  # handed to the consumer, which re-raises it in its thread
            msg = _Raised(e)
        _put_unless_stopped(q, msg, stop)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            try:
                close()  # a generator source releases its own resources (nested prefetchers) now
            except Exception:
                pass


def _stop_prefetch(stop: threading.Event, q: queue.Queue[Any]) -> None:
    stop.set()
    try:  # unblock a producer waiting on a full queue
        while True:
            q.get_nowait()
    except queue.Empty:
        pass


class PrefetchIterator:
    """Iterates ``source`` in a daemon thread, up to ``size`` elements ahead of the consumer.

    The thread stops when the source ends, when :meth:`close` is called, or when this iterator is
    garbage collected (an early ``break``), so it never hangs the program or outlives its use.
    """

    def __init__(self, source: Iterator[Any], size: int, name: str = "cudist-prefetch") -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max(1, size))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_prefetch_worker, args=(source, self._q, self._stop), name=name, daemon=True
        )
        self._finalizer = weakref.finalize(self, _stop_prefetch, self._stop, self._q)
        self._thread.start()

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._q.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    self.close()
                    raise StopIteration from None
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Raised):
            self.close()
            raise item.exc
        return item

    def close(self, timeout: float | None = None) -> None:
        """Stops the producer thread; with ``timeout``, waits up to that long for it to exit."""
        self._done = True
        self._finalizer()
        if timeout is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


# ---------------------------------------------------------------------------------------------
# datasets


def _batch_leaves(leaves_per_element: Iterable[Sequence[Any]], treedef: optree.PyTreeSpec, where: str) -> Any:
    columns = list(zip(*leaves_per_element))
    out = []
    for c, column in enumerate(columns):
        first = np.shape(column[0])
        for i, leaf in enumerate(column[1:], 1):
            if np.shape(leaf) != first:
                raise InvalidArgumentError(  # a ValueError; TF's error for it at iteration
                    f"{where}: cannot batch elements with different shapes in component {c}: element 0 has "
                    f"shape {first} but element {i} has shape {tuple(np.shape(leaf))}"
                )
        xp = array_module(column[0])
        out.append(_readonly_new(xp.stack(column)))
    return optree.tree_unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------
# the vectorized batch path: elements that are rows of in-memory arrays
#
# A dataset built only from from_tensor_slices / from_tensors / range and shuffle / take / skip /
# shard / repeat carries a ``_Rows`` plan: its elements are row ``p`` of every source leaf, for the
# positions ``p`` its ``positions()`` streams. ``batch`` then gathers B rows at once (a slice --
# a view -- for consecutive rows, ``take`` otherwise) instead of stacking B elements one by one.
# The position streams reproduce the element-wise iterators exactly, including *when* they pull
# from upstream (so a shuffle's seed sequence is spawned at the same moments) and the random draws
# of shuffle; tests/test_data.py compares the two paths on random pipelines.

#: Tests set this to False to force the element-wise batch path (the reference for the fast one).
_VECTORIZE = True
# Positions a shuffle processes per vectorized step (bounds its temporary memory).
_SHUFFLE_CHUNK = 1 << 14
#: Dataset.shuffle's buffer_size for UNKNOWN_CARDINALITY: no bound (every element is buffered).
_UNBOUNDED_BUFFER = np.iinfo(np.int64).max
# A repeated static pass shorter than this many positions is tiled into runs of about this size.
_TILE = 1 << 12


_LEAF_TREEDEF = _flatten(0)[1]


class _RangeLeaf:
    """The virtual source of ``Dataset.range``: row ``p`` is ``start + step * p`` as ``dtype``."""

    __slots__ = ("start", "step", "dtype")

    def __init__(self, start: int, step: int, dtype: np.dtype[Any]) -> None:
        self.start, self.step, self.dtype = start, step, dtype


class _Rows:
    """Elements are ``treedef.unflatten([leaf[p] for leaf in leaves])`` for ``p`` in ``positions()``.

    ``positions()`` returns a fresh iterator of non-empty runs of row numbers, each a ``range``
    with a positive step or an int64 array (never written to: runs may be shared); iterating it
    has the same side effects, at the same points, as iterating the dataset element by element.
    ``static``: iterating has no side effects at all and always gives the same positions (there
    is no reshuffling shuffle upstream).
    """

    __slots__ = ("leaves", "treedef", "positions", "static")

    def __init__(
        self, leaves: list[Any], treedef: optree.PyTreeSpec, positions: _Positions, static: bool = True
    ) -> None:
        self.leaves, self.treedef, self.positions, self.static = leaves, treedef, positions, static

    def with_positions(self, positions: _Positions, static: bool = True) -> _Rows:
        return _Rows(self.leaves, self.treedef, positions, self.static and static)


def _row_source(leaf: object) -> bool:
    # Only plain numeric native-endian NumPy arrays: their rows stack to exactly a slice of them.
    # (Strings would stack to the widest element's width, objects re-infer a dtype, non-native
    # byte order becomes native in 0-d rows; CuPy arrays keep the element-wise path.)
    return type(leaf) is np.ndarray and leaf.dtype.kind in "biufc" and leaf.dtype.isnative


def _positions_array(piece: _Run) -> NDArray[np.int64]:
    if isinstance(piece, builtins.range):
        return np.arange(piece.start, piece.stop, piece.step, dtype=np.int64)
    return piece


def _gather(leaf: Any, piece: _Run) -> Any:
    """Rows ``piece`` (a range or an int64 array) of one source leaf, read-only and C-contiguous."""
    if isinstance(leaf, _RangeLeaf):
        out = (leaf.start + leaf.step * _positions_array(piece)).astype(leaf.dtype, copy=False)
    elif isinstance(piece, builtins.range):
        out = leaf[piece.start : piece.stop : piece.step]
        if out.flags.c_contiguous:
            return out  # a view of a read-only leaf: already read-only
        out = np.ascontiguousarray(out)
    else:
        out = leaf.take(piece, axis=0)
    out.flags.writeable = False
    return out


def _join(pieces: Sequence[_Run]) -> _Run:
    """One run holding the positions of ``pieces`` in order."""
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate([_positions_array(p) for p in pieces])


def _rows_batches(rows: _Rows, b: int, drop: bool) -> Iterator[Any]:
    """Batches of ``b`` consecutive elements of ``rows``, gathered leaf by leaf."""
    leaves, unflatten = rows.leaves, rows.treedef.unflatten
    # Consecutive rows of a C-contiguous (read-only) leaf are a C-contiguous read-only view.
    views = [isinstance(leaf, np.ndarray) and leaf.flags.c_contiguous for leaf in leaves]
    all_views = all(views)

    def make(piece: _Run) -> Any:
        if isinstance(piece, builtins.range) and piece.step == 1:
            lo, hi = piece.start, piece.stop
            if all_views:
                return unflatten([leaf[lo:hi] for leaf in leaves])
            return unflatten([leaf[lo:hi] if v else _gather(leaf, piece) for leaf, v in zip(leaves, views)])
        return unflatten([_gather(leaf, piece) for leaf in leaves])

    pending: list[_Run] = []
    count = 0
    for run in rows.positions():
        start, k = 0, len(run)
        if count:
            head = run[: b - count]
            pending.append(head)
            count += len(head)
            start = len(head)
            if count < b:
                continue
            yield make(_join(pending))
            pending, count = [], 0
        while k - start >= b:
            yield make(run[start : start + b])
            start += b
        if start < k:
            pending, count = [run[start:]], k - start
    if count and not drop:
        yield make(_join(pending))


def _no_positions() -> Iterator[_Run]:
    return iter(())


def _take_positions(upstream: _Positions, count: int) -> _Positions:
    def positions() -> Iterator[_Run]:
        left = count
        if left <= 0:
            return
        for run in upstream():
            if len(run) >= left:
                yield run[:left]
                return  # like islice: never pulls past the last element taken
            yield run
            left -= len(run)

    return positions


def _skip_positions(upstream: _Positions, count: int) -> _Positions:
    def positions() -> Iterator[_Run]:
        left = count
        for run in upstream():
            if left:
                if len(run) <= left:
                    left -= len(run)
                    continue
                run, left = run[left:], 0
            yield run

    return positions


def _shard_positions(upstream: _Positions, n: int, index: int) -> _Positions:
    def positions() -> Iterator[_Run]:
        offset = 0  # the stream position of the run's first element
        for run in upstream():
            picked = run[(index - offset) % n :: n]
            offset += len(run)
            if len(picked):
                yield picked

    return positions


def _repeat_positions(upstream: _Positions, count: int, static: bool) -> _Positions:
    def positions() -> Iterator[_Run]:
        k = 0
        if static and count != 0:
            # A short pass (from_tensors, a few rows) would make one run per pass and batches that
            # gather from many runs; a static pass can be computed once and tiled instead.
            runs: list[_Run] = []
            total = 0
            it = upstream()
            for run in it:
                runs.append(run)
                total += len(run)
                if total >= _TILE:
                    break
            else:
                if not runs:
                    return
                per = _TILE // total
                tiled = np.tile(_positions_array(_join(runs)), per)
                while count < 0 or k < count:
                    reps = per if count < 0 else min(per, count - k)
                    yield tiled if reps == per else tiled[: reps * total]
                    k += reps
                return
            yield from runs  # a long pass: streamed as usual
            yield from it
            k = 1
        while count < 0 or k < count:
            got_any = False
            for run in upstream():
                got_any = True
                yield run
            if not got_any:
                return
            k += 1

    return positions


def _shuffle_step(
    buf: NDArray[np.int64], incoming: NDArray[np.int64], slots: NDArray[np.int64]
) -> NDArray[np.int64]:
    """The buffer shuffle for a run of inputs at once: input t replaces (and emits) ``buf[slots[t]]``.

    Output t is what slot ``slots[t]`` holds at time t: the input last written there before t, or
    the buffer's content if none was. Updates ``buf`` to its state after the run.
    """
    k = len(slots)
    order = np.argsort(slots, kind="stable")  # by slot, then by time
    s_slots, s_in = slots[order], incoming[order]
    first = np.empty(k, bool)
    first[0] = True
    np.not_equal(s_slots[1:], s_slots[:-1], out=first[1:])
    vals = np.empty(k, np.int64)
    vals[first] = buf[s_slots[first]]
    later = ~first[1:]
    vals[1:][later] = s_in[:-1][later]
    out = np.empty(k, np.int64)
    out[order] = vals
    last = np.empty(k, bool)
    last[-1] = True
    last[:-1] = first[1:]
    buf[s_slots[last]] = s_in[last]
    return out


def _shuffle_positions(upstream: _Positions, size: int, make_rng: Callable[[], np.random.Generator]) -> _Positions:
    def positions() -> Iterator[_Run]:
        rng = make_rng()
        # The buffer grows as it fills: a buffer_size beyond the dataset allocates only what exists.
        buf = np.empty(min(size, _SHUFFLE_CHUNK), np.int64)
        filled = 0
        for run in upstream():
            if filled < size:
                head = _positions_array(run[: size - filled])
                if filled + len(head) > len(buf):
                    grown = np.empty(min(size, max(2 * len(buf), filled + len(head))), np.int64)
                    grown[:filled] = buf[:filled]
                    buf = grown
                buf[filled : filled + len(head)] = head
                filled += len(head)
                run = run[len(head) :]
            for s in builtins.range(0, len(run), _SHUFFLE_CHUNK):
                piece = _positions_array(run[s : s + _SHUFFLE_CHUNK])
                # One draw per input, as the element-wise loop's rng.integers(size) calls: NumPy
                # draws the same numbers one at a time or as an array.
                yield _shuffle_step(buf, piece, rng.integers(size, size=len(piece)))
        rest = buf[:filled]
        rng.shuffle(rest)  # the same permutation as rng.shuffle of the element-wise list
        if filled:
            yield rest

    return positions


class AutoShardPolicy(enum.IntEnum):
    """How a multi-worker strategy shards a dataset over workers (``tf.data.experimental.AutoShardPolicy``).

    AUTO: FILE if the dataset reads files, else DATA (cudist's datasets are in memory: DATA).
    FILE: shard the input files (cudist's datasets have none: an error, as TF's "unshardable source").
    DATA: every worker reads the whole dataset and keeps its share of each global batch.
    OFF: no sharding: every worker reads the whole dataset and its replicas take every global batch's
    pieces in turn (each element is seen once per worker).
    HINT: as DATA here (TF shards at its ``shard(SHARD_HINT)`` placeholders).
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class DistributeOptions:
    """``Options().experimental_distribute``: how a dataset is distributed (``tf.data.experimental.DistributeOptions``)."""

    def __init__(self) -> None:
        self._auto_shard_policy: AutoShardPolicy | None = None
        self.num_devices: int | None = None

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        """The :class:`AutoShardPolicy` (default AUTO)."""
        return AutoShardPolicy.AUTO if self._auto_shard_policy is None else self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, policy: AutoShardPolicy | int) -> None:
        try:
            self._auto_shard_policy = AutoShardPolicy(policy)
        except ValueError:
            raise ValueError(f"auto_shard_policy must be a cudist.data.AutoShardPolicy, got {policy!r}") from None

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy={self.auto_shard_policy.name})"


class Options:
    """Options of a dataset (``tf.data.Options``); set them with ``Dataset.with_options``.

    Only ``experimental_distribute.auto_shard_policy`` has an effect (multi-worker input);
    ``deterministic`` is accepted for TF compatibility (cudist's pipelines are deterministic).
    """

    def __init__(self) -> None:
        self.experimental_distribute = DistributeOptions()
        self.deterministic: bool | None = None

    def merge(self, options: Options | None) -> Options:
        """A new Options with ``options``' explicitly set values taken over this one's."""
        out = Options()
        for src in (self, options):
            if src is None:
                continue
            if src.experimental_distribute._auto_shard_policy is not None:
                out.experimental_distribute.auto_shard_policy = src.experimental_distribute.auto_shard_policy
            if src.experimental_distribute.num_devices is not None:
                out.experimental_distribute.num_devices = src.experimental_distribute.num_devices
            if src.deterministic is not None:
                out.deterministic = src.deterministic
        return out

    def __repr__(self) -> str:
        return f"Options(experimental_distribute={self.experimental_distribute!r})"


class experimental:  # noqa: N801 - TF's module name, a namespace here
    """``cudist.data.experimental``: ``AutoShardPolicy`` and ``DistributeOptions`` by TF's names."""

    AutoShardPolicy = AutoShardPolicy
    DistributeOptions = DistributeOptions


class _OneShot:
    """Makes a one-pass iterator peekable (for ``element_spec``) without losing the peeked element."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._it = iterator
        self._buffer: list[Any] = []
        self.exhausted = False  # a pass reached its end: later passes are empty

    def peek(self) -> Any:
        if not self._buffer:
            self._buffer.append(next(self._it))
        return self._buffer[0]

    def __iter__(self) -> Iterator[Any]:
        while self._buffer:
            yield self._buffer.pop(0)
        yield from self._it
        self.exhausted = True


class DatasetIterator:
    """An iterator over a :class:`Dataset` (``iter(dataset)``; TF's ``OwnedIterator``).

    It counts the elements it has handed out, so ``cudist.train.Checkpoint(it=iterator)`` saves its
    position and a restore moves it back there (by replaying the dataset from the start on a fresh
    iterator: exact for a deterministic pipeline; a shuffle needs a seed).

    Args:
        dataset: the dataset to iterate.
    """

    def __init__(self, dataset: Dataset) -> None:
        self._dataset = dataset
        self._it: Iterator[Any] = iter(dataset._iter_fn())
        self._consumed = 0

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        value = next(self._it)
        self._consumed += 1
        return value

    def get_next(self) -> Any:
        """The next element (TF's ``get_next``).

        Raises:
            cudist.errors.OutOfRangeError: the dataset is exhausted (also a StopIteration).
        """
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError("End of sequence") from None

    @property
    def element_spec(self) -> Any:
        """The dataset's ``element_spec``."""
        return self._dataset.element_spec

    def close(self) -> None:
        """Stops the underlying pipeline (its generators and prefetch threads)."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    # -- checkpoints: cudist.train.Checkpoint saves and restores the position through these
    def _checkpoint_state(self) -> dict[str, int]:
        """The iterator's position: how many elements it has handed out."""
        return {"position": self._consumed}

    def _prepare_restore(self, state: dict[str, Any]) -> Callable[[], None]:
        """Replays the dataset to ``state["position"]`` on a fresh iterator; returns the function that
        moves this iterator there (nothing changes before it is called).

        Raises:
            ValueError: the position is not an integer >= 0, or the dataset ends before it.
        """
        target = state["position"]
        if isinstance(target, bool) or not isinstance(target, int) or target < 0:
            raise ValueError(f"an iterator position must be an integer >= 0, got {target!r}")
        fresh = iter(self._dataset._iter_fn())
        for done in range(target):
            try:
                next(fresh)
            except StopIteration:
                raise ValueError(
                    f"cannot restore the iterator to element {target}: its dataset ends after {done} elements"
                ) from None

        def commit() -> None:
            self.close()
            self._it, self._consumed = fresh, target

        return commit


class Dataset:
    """A re-iterable sequence of elements (nested structures of NumPy arrays), like ``tf.data.Dataset``.

    Build one with :meth:`range`, :meth:`from_tensor_slices`, :meth:`from_tensors` or
    :meth:`from_generator` and transform it with the chainable methods; do not call the
    constructor directly.
    """

    def __init__(
        self,
        iter_fn: Callable[[], Iterable[Any]],
        spec_fn: Callable[[], Any],
        cardinality: int,
        rows: _Rows | None = None,
        cheap: bool = False,
    ) -> None:
        self._iter_fn = iter_fn
        self._spec_fn = spec_fn
        self._spec: Any = None
        self._card = int(cardinality)
        # A _Rows plan when the elements are rows of in-memory arrays (lets batch gather at once).
        self._rows = rows
        # Elements cost a few microseconds each (rows, vectorized batches and slicing/counting of
        # them): a prefetch thread could only add its hand-off cost, so prefetch skips it.
        self._cheap = bool(cheap) or rows is not None

    # ------------------------------------------------------------------ basics
    def __iter__(self) -> DatasetIterator:
        return DatasetIterator(self)

    def as_numpy_iterator(self) -> Iterator[Any]:
        """An iterator over the elements (they already are NumPy values)."""
        return iter(self)

    @property
    def element_spec(self) -> Any:
        """The structure of an element with a :class:`TensorSpec` per component.

        A dimension that can differ between elements (a batch that may be partial) is ``None``.
        For ``map`` and Python iterables it is found by computing the first element.
        """
        if self._spec is None:
            self._spec = self._spec_fn()
        return self._spec

    def cardinality(self) -> int:
        """The number of elements, or INFINITE_CARDINALITY (-1) or UNKNOWN_CARDINALITY (-2)."""
        return self._card

    def __len__(self) -> int:
        if self._card == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if self._card < 0:
            raise TypeError("The dataset length is unknown.")
        return self._card

    def __bool__(self) -> bool:
        return True  # a Dataset is truthy even when empty, like any object without __len__ use

    def __repr__(self) -> str:
        return f"<{type(self).__name__} element_spec={self.element_spec!r}>"

    def _derive(
        self,
        iter_fn: Callable[[], Iterable[Any]],
        spec_fn: Callable[[], Any],
        cardinality: int,
        rows: _Rows | None = None,
        cheap: bool = False,
    ) -> Dataset:
        out = Dataset(iter_fn, spec_fn, cardinality, rows, cheap)
        out._options = self._options  # options hold for the whole pipeline, as tf.data's
        out._static_batch = self._static_batch  # element-wise ops keep the batches (batch/unbatch reset it)
        return out

    _options: Options | None = None
    #: The batch size of the last ``batch`` this pipeline applied (None: none, or an ``unbatch`` after it).
    _static_batch: int | None = None

    def with_options(self, options: Options) -> Dataset:
        """This dataset with ``options`` set (merged over any set before), as ``tf.data.Dataset.with_options``."""
        if not isinstance(options, Options):
            raise TypeError(f"Dataset.with_options: options must be a cudist.data.Options, got {type(options).__name__}")
        src = self
        out = Dataset(lambda: iter(src), lambda: src.element_spec, self._card, self._rows, self._cheap)
        out._options = (self._options or Options()).merge(options)
        out._static_batch = self._static_batch
        return out

    def options(self) -> Options:
        """The dataset's options (defaults where none were set)."""
        return Options().merge(self._options)

    def _derive_rows(self, make_positions: Callable[[_Rows], _Positions], static: bool = True) -> _Rows | None:
        """The ``_Rows`` plan of a transformation of this dataset's positions (None without a plan)."""
        if self._rows is None:
            return None
        return self._rows.with_positions(make_positions(self._rows), static)

    # ------------------------------------------------------------------ sources
    @staticmethod
    def range(*args: _IntLike, output_type: DTypeLike = np.int64, name: str | None = None) -> Dataset:
        """Like Python's ``range``: ``range(stop)``, ``range(start, stop)``, ``range(start, stop, step)``.

        Elements are NumPy scalars of ``output_type`` (int64 by default, as in tf.data).
        """
        if not 1 <= len(args) <= 3:
            raise TypeError(f"Dataset.range takes 1 to 3 positional arguments, got {len(args)}")
        ints = [_check_int(a, n, "Dataset.range") for a, n in zip(args, ("start/stop", "stop", "step"))]
        if len(ints) == 3 and ints[2] == 0:
            raise InvalidArgumentError("Dataset.range: step must be a non-zero integer")  # as TF (a ValueError)
        r = builtins.range(*ints)
        dtype = np.dtype(output_type)
        scalar = dtype.type
        rows = None
        if dtype.kind in "iu" and len(r):
            lo, hi = min(r[0], r[-1]), max(r[0], r[-1])
            bounds = np.iinfo(dtype)
            fits = max(bounds.min, _INT64.min) <= lo and hi <= min(bounds.max, _INT64.max)
            if fits and abs(r.start) + abs(r.step) * (len(r) - 1) <= _INT64.max:  # start + step * p can't overflow
                leaf = _RangeLeaf(r.start, r.step, dtype)
                rows = _Rows([leaf], _LEAF_TREEDEF, lambda: iter((builtins.range(len(r)),)))
        return Dataset(lambda: map(scalar, r), lambda: TensorSpec((), dtype), len(r), rows)

    @staticmethod
    def from_tensor_slices(tensors: Any, name: str | None = None) -> Dataset:
        """A dataset of the slices of ``tensors`` along dimension 0 (every component must agree).

        ``tensors`` is an array, a Python list (one array) or a nested tuple/dict of them.

        Raises:
            ValueError: a component is a scalar, components disagree on dimension 0, or the
                structure has no components.
        """
        where = "Dataset.from_tensor_slices"
        leaves, treedef = _flatten(_normalize(tensors, where))
        if not leaves:
            raise ValueError(f"{where}: the structure has no components to slice")
        for i, leaf in enumerate(leaves):
            if np.ndim(leaf) == 0:
                raise ValueError(
                    f"{where}: component {i} is a scalar; slicing needs arrays of rank >= 1 "
                    "(use Dataset.from_tensors for a single element)"
                )
        n = int(leaves[0].shape[0])
        for i, leaf in enumerate(leaves[1:], 1):
            if leaf.shape[0] != n:
                raise ValueError(
                    f"{where}: component {i} has {leaf.shape[0]} rows but component 0 has {n}; "
                    "every component must have the same size in dimension 0"
                )
        leaves = [_readonly(leaf) for leaf in leaves]
        unflatten = treedef.unflatten

        def it() -> Iterator[Any]:
            for i in builtins.range(n):
                yield unflatten([leaf[i] for leaf in leaves])

        specs = [TensorSpec(tuple(leaf.shape[1:]), np.dtype(leaf.dtype)) for leaf in leaves]
        spec = optree.tree_unflatten(treedef, specs)
        rows = None
        if all(_row_source(leaf) for leaf in leaves):
            rows = _Rows(leaves, treedef, lambda: iter((builtins.range(n),) if n else ()))
        return Dataset(it, lambda: spec, n, rows)

    @staticmethod
    def from_tensors(tensors: Any, name: str | None = None) -> Dataset:
        """A dataset with ``tensors`` as its single element."""
        element = _map(_readonly, _normalize(tensors, "Dataset.from_tensors"))
        spec = _structure_spec(element)
        leaves, treedef = _flatten(element)
        rows = None
        if leaves and all(isinstance(leaf, np.generic) or _row_source(leaf) for leaf in leaves):
            sources = [_readonly(np.asarray(leaf)[None]) for leaf in leaves]
            if all(_row_source(src) for src in sources):
                rows = _Rows(sources, treedef, lambda: iter((builtins.range(1),)))
        return Dataset(lambda: iter((element,)), lambda: spec, 1, rows)

    @staticmethod
    def from_generator(
        generator: Callable[..., Iterable[Any]],
        output_types: Any = None,
        output_shapes: Any = None,
        args: Iterable[Any] | None = None,
        output_signature: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """A dataset of what ``generator(*args)`` yields; each iteration calls it again.

        As TF's: with ``output_types`` (a structure of dtypes, with ``output_shapes`` beside it) or
        ``output_signature`` (a structure of :class:`TensorSpec`), each element is converted to those
        dtypes (float64 yielded for float32 is cast, as TF does) and checked against those shapes
        (a dimension of None matches any size); ``output_signature`` also gives ``element_spec``
        without running the generator. Unlike TF, both may be left out: the dtypes and shapes are
        then what the generator yields (the first element is computed to find ``element_spec``).

        Raises:
            TypeError: ``generator`` is not callable; ``output_types`` or ``output_shapes`` given
                with ``output_signature``; ``output_shapes`` without ``output_types``.
            InvalidArgumentError: (at iteration) an element that does not fit the given structure,
                dtypes or shapes.
        """
        if not callable(generator):
            raise TypeError(f"Dataset.from_generator: generator must be callable, got {type(generator).__name__}")
        if output_signature is not None and (output_types is not None or output_shapes is not None):
            which = "output_types" if output_types is not None else "output_shapes"
            raise TypeError(f"The `{which}` argument can not be used together with the `output_signature` argument.")
        if output_shapes is not None and output_types is None:
            raise TypeError(
                "To specify the output signature you need to provide either the `output_signature` argument or the "
                "`output_types` argument."
            )
        call_args = tuple(args or ())
        # Per leaf: (dtype, shape to check or None).
        wanted: list[tuple[np.dtype[Any], tuple[int | None, ...] | None]] | None = None
        if output_signature is not None:
            sig, treedef = flatten_specs(output_signature)
            wanted = [(np.dtype(x.dtype), tuple(x.shape)) for x in sig]
        elif output_types is not None:
            types, treedef = optree.tree_flatten(output_types)
            shapes: list[Any] = [None] * len(types) if output_shapes is None else treedef.flatten_up_to(output_shapes)
            wanted = [(np.dtype(t), None if sh is None else tuple(sh)) for t, sh in zip(types, shapes)]

        def it() -> Iterator[Any]:
            for element in generator(*call_args):
                element = _normalize(element, "Dataset.from_generator")
                yield element if wanted is None else _conform(element, treedef, wanted)

        spec_fn: Callable[[], Any]
        if output_signature is not None:
            spec_fn = lambda: output_signature  # noqa: E731
        elif wanted is not None and all(shape is not None for _, shape in wanted):  # TF's: the declared ones
            declared = [TensorSpec(shape or (), dtype) for dtype, shape in wanted]
            spec_fn = lambda: optree.tree_unflatten(treedef, declared)  # noqa: E731
        else:
            spec_fn = lambda: _first_spec(it, "Dataset.from_generator")  # noqa: E731
        return Dataset(it, spec_fn, UNKNOWN_CARDINALITY)

    @staticmethod
    def zip(*datasets: Iterable[Any]) -> Dataset:
        """Elements are tuples of the zipped datasets' elements; ends with the shortest."""
        if len(datasets) == 1 and isinstance(datasets[0], (tuple, list)):
            datasets = tuple(datasets[0])
        if not datasets:
            raise ValueError("Dataset.zip needs at least one dataset")
        dss = [as_dataset(d, "Dataset.zip") for d in datasets]
        cards = [d.cardinality() for d in dss]
        known = [c for c in cards if c >= 0]
        if known:
            card = min(known)
        elif UNKNOWN_CARDINALITY in cards:
            card = UNKNOWN_CARDINALITY
        else:
            card = INFINITE_CARDINALITY
        return Dataset(lambda: zip(*dss), lambda: tuple(d.element_spec for d in dss), card)

    # ------------------------------------------------------------------ transformations
    def concatenate(self, dataset: Iterable[Any], name: str | None = None) -> Dataset:
        """This dataset's elements, then ``dataset``'s (``tf.data.Dataset.concatenate``).

        The element_spec is the most specific one both fit (a dimension that differs becomes None).

        Raises:
            TypeError: the datasets' elements differ in structure, dtype or rank (as TF).
        """
        other = as_dataset(dataset, "Dataset.concatenate")
        first = self

        def spec() -> Any:
            (a, ta), (b, tb) = flatten_specs(first.element_spec), flatten_specs(other.element_spec)
            if ta != tb or any(np.dtype(x.dtype) != np.dtype(y.dtype) or len(x.shape) != len(y.shape) for x, y in zip(a, b)):
                raise TypeError(
                    f"Dataset.concatenate: incompatible dataset elements: {first.element_spec} and {other.element_spec}"
                )
            specs = [TensorSpec(tuple(d if d == e else None for d, e in zip(x.shape, y.shape)), x.dtype, x.name) for x, y in zip(a, b)]
            return optree.tree_unflatten(ta, specs)

        c1, c2 = self._card, other.cardinality()
        if INFINITE_CARDINALITY in (c1, c2):
            card = INFINITE_CARDINALITY
        elif UNKNOWN_CARDINALITY in (c1, c2):
            card = UNKNOWN_CARDINALITY
        else:
            card = c1 + c2
        return self._derive(lambda: itertools.chain(first, other), spec, card)

    def batch(
        self,
        batch_size: _IntLike,
        drop_remainder: bool = False,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """Stacks ``batch_size`` consecutive elements into one (a new leading dimension).

        The last batch may be smaller unless ``drop_remainder``; ``element_spec`` shows the batch
        dimension as ``None`` unless ``drop_remainder``. Batches are read-only; over rows of
        in-memory arrays they are gathered at once (slices of the source where the rows are
        consecutive), otherwise stacked element by element.

        Raises:
            InvalidArgumentError: (a ValueError, as TF) ``batch_size`` <= 0.
            ValueError: at iteration, elements of different shapes.
        """
        where = "Dataset.batch"
        b = _check_int(batch_size, "batch_size", where)
        if b <= 0:
            raise InvalidArgumentError(f"{where}: batch_size must be greater than zero, got {b}")
        drop = bool(drop_remainder)
        src = self

        def it() -> Iterator[Any]:
            if _VECTORIZE and src._rows is not None:
                yield from _rows_batches(src._rows, b, drop)
                return
            buf: list[Any] = []
            for element in src:
                buf.append(element)
                if len(buf) == b:
                    yield _stack(buf, where)
                    buf = []
            if buf and not drop:
                yield _stack(buf, where)

        def spec() -> Any:
            lead = b if drop else None
            return map_specs(lambda s: TensorSpec((lead, *s.shape), s.dtype, s.name), src.element_spec)

        c = self._card
        card = c if c < 0 else (c // b if drop else -(-c // b))
        out = self._derive(it, spec, card, cheap=src._rows is not None)
        out._static_batch = b
        return out

    def unbatch(self, name: str | None = None) -> Dataset:
        """Splits each element along dimension 0 into its rows (the inverse of ``batch``)."""
        src = self

        def it() -> Iterator[Any]:
            for element in src:
                leaves, treedef = _flatten(element)
                if any(np.ndim(leaf) == 0 for leaf in leaves):
                    raise ValueError("Dataset.unbatch: every component needs rank >= 1")
                for i in builtins.range(int(leaves[0].shape[0]) if leaves else 0):
                    yield treedef.unflatten([leaf[i] for leaf in leaves])

        def spec() -> Any:
            return map_specs(lambda s: TensorSpec(tuple(s.shape[1:]), s.dtype, s.name), src.element_spec)

        card = INFINITE_CARDINALITY if self._card == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY
        out = self._derive(it, spec, card)
        out._static_batch = None
        return out

    def shard(self, num_shards: _IntLike, index: _IntLike, name: str | None = None) -> Dataset:
        """Keeps every ``num_shards``-th element starting at ``index``.

        Raises:
            InvalidArgumentError: (a ValueError, as TF) ``num_shards`` <= 0 or ``index`` outside
                [0, num_shards).
        """
        where = "Dataset.shard"
        n = _check_int(num_shards, "num_shards", where)
        i = _check_int(index, "index", where)
        if n <= 0:
            raise InvalidArgumentError(f"{where}: num_shards must be greater than zero (currently num_shards = {n})")
        if not 0 <= i < n:
            raise InvalidArgumentError(f"{where}: index must be between 0 and {n - 1} (currently index = {i})")
        src = self
        c = self._card
        card = c if c < 0 else c // n + (1 if i < c % n else 0)
        rows = self._derive_rows(lambda up: _shard_positions(up.positions, n, i))
        return self._derive(lambda: itertools.islice(src, i, None, n), lambda: src.element_spec, card, rows, self._cheap)

    def repeat(self, count: _IntLike | None = None, name: str | None = None) -> Dataset:
        """Repeats the dataset ``count`` times (forever for None or -1), starting over each time."""
        where = "Dataset.repeat"
        times = -1 if count is None else _check_int(count, "count", where)
        src = self

        def it() -> Iterator[Any]:
            k = 0
            while times < 0 or k < times:
                got_any = False
                for element in src:
                    got_any = True
                    yield element
                if not got_any:
                    return  # repeating an empty dataset forever would spin
                k += 1

        c = self._card
        if times == 0 or c == 0:
            card = 0
        elif times < 0:
            card = INFINITE_CARDINALITY if c != UNKNOWN_CARDINALITY else UNKNOWN_CARDINALITY
        else:
            card = c if c < 0 else c * times
        rows = self._derive_rows(lambda up: _repeat_positions(up.positions, times, up.static))
        return self._derive(it, lambda: src.element_spec, card, rows, self._cheap)

    def take(self, count: _IntLike, name: str | None = None) -> Dataset:
        """The first ``count`` elements (all of them for a negative count)."""
        n = _check_int(count, "count", "Dataset.take")
        src = self
        if n < 0:
            return self._derive(lambda: iter(src), lambda: src.element_spec, self._card, self._rows, self._cheap)
        c = self._card
        card = n if c == INFINITE_CARDINALITY else (c if c == UNKNOWN_CARDINALITY else min(c, n))
        rows = self._derive_rows(lambda up: _take_positions(up.positions, n))
        return self._derive(lambda: itertools.islice(src, n), lambda: src.element_spec, card, rows, self._cheap)

    def skip(self, count: _IntLike, name: str | None = None) -> Dataset:
        """All but the first ``count`` elements (none for a negative count)."""
        n = _check_int(count, "count", "Dataset.skip")
        src = self
        if n < 0:
            rows = self._derive_rows(lambda up: _no_positions)
            return self._derive(lambda: iter(()), lambda: src.element_spec, 0, rows, self._cheap)
        c = self._card
        card = c if c < 0 else max(0, c - n)
        rows = self._derive_rows(lambda up: _skip_positions(up.positions, n))
        return self._derive(lambda: itertools.islice(src, n, None), lambda: src.element_spec, card, rows, self._cheap)

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """Applies ``map_func`` to each element.

        A tuple element is passed as positional arguments (``map_func(*element)``), anything else
        (an array, a dict, a namedtuple) as one argument, as tf.data does. Results are converted
        like elements (lists and Python numbers become arrays).

        Raises:
            InvalidArgumentError: (a ValueError) at iteration, ``map_func`` returned None (TF
                raises it when ``map`` traces the function).
        """
        if not callable(map_func):
            raise TypeError(f"Dataset.map: map_func must be callable, got {type(map_func).__name__}")
        src = self

        def apply(element: Any) -> Any:
            out = map_func(*element) if type(element) is tuple else map_func(element)
            if out is None:
                raise InvalidArgumentError(
                    f"Dataset.map: map_func {getattr(map_func, '__qualname__', map_func)!r} returned None; "
                    "a dataset element must hold at least one value (did the function forget to return?)"
                )
            return _normalize(out, "Dataset.map")

        def spec() -> Any:
            out_spec = _first_spec(lambda: map(apply, src), "Dataset.map")
            # A batch dimension that varies in the input varies in the output too.
            in_specs = flatten_specs(src.element_spec)[0]
            if in_specs and all(s.shape and s.shape[0] is None for s in in_specs):
                out_spec = map_specs(lambda s: TensorSpec((None, *s.shape[1:]), s.dtype) if s.shape else s, out_spec)
            return out_spec

        return self._derive(lambda: map(apply, src), spec, self._card)

    def filter(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset:
        """Keeps the elements for which ``predicate`` (called like a ``map`` function) is true."""
        if not callable(predicate):
            raise TypeError(f"Dataset.filter: predicate must be callable, got {type(predicate).__name__}")
        src = self

        def keep(element: Any) -> bool:
            r = predicate(*element) if type(element) is tuple else predicate(element)
            if np.ndim(r) != 0:
                raise ValueError(f"Dataset.filter: predicate must return a scalar boolean, got shape {np.shape(r)}")
            if type(r) is not bool and getattr(r, "dtype", None) != np.bool_:
                # As TF (which says so when filter() traces the predicate): no truthiness of numbers.
                raise ValueError(
                    "Dataset.filter: predicate must return a boolean scalar, but it returned "
                    f"{getattr(r, 'dtype', type(r).__name__)} {r!r}; compare explicitly (e.g. x > 0)"
                )
            return bool(r)

        card = INFINITE_CARDINALITY if self._card == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY
        return self._derive(lambda: filter(keep, src), lambda: src.element_spec, card)

    def enumerate(self, start: _IntLike = 0, name: str | None = None) -> Dataset:
        """Elements become ``(index, element)`` with an int64 index counting from ``start``."""
        first = _check_int(start, "start", "Dataset.enumerate")
        src = self
        spec = lambda: (TensorSpec((), np.dtype(np.int64)), src.element_spec)  # noqa: E731
        return self._derive(
            lambda: ((np.int64(i), e) for i, e in zip(itertools.count(first), src)), spec, self._card
        )

    def shuffle(
        self,
        buffer_size: _IntLike,
        seed: int | None = None,
        reshuffle_each_iteration: bool = True,
        name: str | None = None,
    ) -> Dataset:
        """Shuffles with a buffer of ``buffer_size`` elements (tf.data's algorithm, not its numbers).

        With a ``seed`` and ``reshuffle_each_iteration=False`` every iteration has the same order.
        Only the elements that exist are buffered: ``buffer_size`` may exceed the dataset (as TF's
        documentation says, a buffer at least the dataset's size shuffles it completely), and
        ``UNKNOWN_CARDINALITY`` (-2), as in TF, buffers the whole dataset.

        Raises:
            InvalidArgumentError: (a ValueError, as TF) ``buffer_size`` is 0 or negative other than -2.
        """
        where = "Dataset.shuffle"
        size = _check_int(buffer_size, "buffer_size", where)
        if size == UNKNOWN_CARDINALITY:
            size = _UNBOUNDED_BUFFER
        if size <= 0:
            raise InvalidArgumentError(
                f"{where}: buffer_size must be greater than zero or UNKNOWN_CARDINALITY (-2), got {size}"
            )
        src = self
        seeds = np.random.SeedSequence(seed)

        def make_rng() -> np.random.Generator:
            return np.random.default_rng(seeds.spawn(1)[0] if reshuffle_each_iteration else seeds)

        def it() -> Iterator[Any]:
            rng = make_rng()
            buf: list[Any] = []
            for element in src:
                if len(buf) < size:
                    buf.append(element)
                    continue
                j = int(rng.integers(size))
                yield buf[j]
                buf[j] = element
            rng.shuffle(buf)
            yield from buf

        # Without reshuffling every pass draws the same numbers from the same seed: still static.
        rows = self._derive_rows(
            lambda up: _shuffle_positions(up.positions, size, make_rng), static=not reshuffle_each_iteration
        )
        return self._derive(it, lambda: src.element_spec, self._card, rows)

    def prefetch(self, buffer_size: _IntLike, name: str | None = None) -> Dataset:
        """Computes up to ``buffer_size`` elements ahead in a background thread.

        ``AUTOTUNE`` (-1) picks a small buffer; 0 turns prefetching off. The thread stops when the
        iteration ends or its iterator is dropped (an early ``break``): it never hangs or leaks.
        Over elements that take microseconds to make (rows of arrays, batches gathered from them)
        there is no thread: handing each element over would cost more than making it.

        Raises:
            ValueError: ``buffer_size`` < -1.
        """
        size = _check_int(buffer_size, "buffer_size", "Dataset.prefetch")
        if size < -1:
            raise InvalidArgumentError(  # as TF (a ValueError)
                f"Dataset.prefetch: buffer_size must be >= 0 or AUTOTUNE (-1) for auto-tuning, got {size}"
            )
        src = self
        if size == 0 or self._cheap:
            return self._derive(lambda: iter(src), lambda: src.element_spec, self._card, self._rows, self._cheap)
        size = _AUTOTUNE_BUFFER if size == AUTOTUNE else size
        return self._derive(lambda: PrefetchIterator(iter(src), size), lambda: src.element_spec, self._card)

    def cache(self, filename: str = "", name: str | None = None) -> Dataset:
        """Returns the dataset itself (elements are already in memory; nothing to cache)."""
        if filename:
            raise NotImplementedError("Dataset.cache: caching to a file is not supported")
        return self

    def reduce(self, initial_state: _T, reduce_func: Callable[[_T, Any], _T], name: str | None = None) -> _T:
        """Folds the elements: ``state = reduce_func(state, element)`` for each element in order."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state


def _stack(elements: Sequence[Any], where: str) -> Any:
    flat = [_flatten(e) for e in elements]
    treedef = flat[0][1]
    for i, (_, t) in enumerate(flat[1:], 1):
        if t != treedef:
            raise ValueError(f"{where}: element {i} has structure {t} but element 0 has {treedef}")
    return _batch_leaves([leaves for leaves, _ in flat], treedef, where)


def _conform(
    element: Any, treedef: optree.PyTreeSpec, wanted: Sequence[tuple[np.dtype[Any], tuple[int | None, ...] | None]]
) -> Any:
    """``element`` converted to the specs' dtypes and checked against their shapes (from_generator's
    ``output_types``/``output_shapes``/``output_signature``), with TF's InvalidArgumentError otherwise."""
    try:
        leaves = treedef.flatten_up_to(element)
    except (ValueError, TypeError):
        raise InvalidArgumentError(
            f"`generator` yielded an element that did not match the expected structure. The expected structure was "
            f"{optree.tree_unflatten(treedef, [d.name for d, _ in wanted])}, but the yielded element was {element!r}."
        ) from None
    out = []
    for leaf, (dtype, want) in zip(leaves, wanted):
        value: Any = leaf
        if not is_array(value) or getattr(value, "dtype", None) != dtype:
            try:
                value = value.astype(dtype) if is_device_array(value) else np.asarray(value).astype(dtype)
            except (ValueError, TypeError) as e:
                raise InvalidArgumentError(
                    f"`generator` yielded an element that could not be converted to the expected type {dtype.name}: {e}"
                ) from None
        shape = tuple(value.shape)
        if want is not None and (len(shape) != len(want) or any(w is not None and w != g for w, g in zip(want, shape))):
            raise InvalidArgumentError(
                f"`generator` yielded an element of shape {shape} where an element of shape {want} was expected."
            )
        out.append(value)
    return optree.tree_unflatten(treedef, out)


def _first_spec(iter_fn: Callable[[], Iterable[Any]], where: str) -> Any:
    it = iter(iter_fn())
    try:
        first = next(it)
    except StopIteration:
        raise ValueError(f"{where}: the element_spec of an empty dataset can't be found (it has no element)") from None
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return _structure_spec(first)


def _second_pass(where: str) -> Iterator[Any]:
    raise ValueError(
        f"{where}: this input is a one-pass Python iterator (a generator, iter(...)) that an earlier pass left "
        "unfinished: it cannot be iterated again from the start, nor replayed to restore a checkpointed iterator position; pass a re-iterable input (a list, a "
        "cudist.data.Dataset, Dataset.from_generator(fn)) instead"
    )
    yield  # a generator: raises at the first next(), as iteration would


def _iterable_dataset(obj: Iterable[Any], where: str) -> Dataset:
    """Wraps a Python iterable of elements (batches) as a Dataset (re-iterable if ``obj`` is)."""
    is_iterator = iter(obj) is obj
    if is_iterator:
        source = _OneShot(cast("Iterator[Any]", obj))
        passes = [0]

        def it() -> Iterator[Any]:
            # A second pass over a one-pass iterator is empty once the first reached the end; one that
            # starts where an unfinished first pass stopped would silently hand out the wrong elements
            # (a checkpoint restore replaying the input would land on them): an error.
            passes[0] += 1
            if passes[0] > 1 and not source.exhausted:
                return _second_pass(where)
            return (_normalize(e, where) for e in source)

        def spec() -> Any:
            try:
                return _structure_spec(_normalize(source.peek(), where))
            except StopIteration:
                raise ValueError(f"{where}: the element_spec of an empty iterator can't be found") from None

        return Dataset(it, spec, UNKNOWN_CARDINALITY)

    def it_all() -> Iterator[Any]:
        return (_normalize(e, where) for e in obj)

    try:
        card = len(cast("Sized", obj))
    except TypeError:
        card = UNKNOWN_CARDINALITY
    return Dataset(it_all, lambda: _first_spec(it_all, where), card)


def as_dataset(obj: Iterable[Any], where: str = "as_dataset") -> Dataset:
    """Returns ``obj`` if it is a Dataset, else wraps a Python iterable of elements as one.

    A list of arrays, a generator, or a DataLoader-like object each become a dataset whose elements
    are the items they yield. A generator (or other iterator) can be iterated only once.

    Raises:
        TypeError: ``obj`` is not iterable, or is an array, string or dict (which would be
            iterated row by row or key by key, almost certainly not what was meant).
    """
    if isinstance(obj, Dataset):
        return obj
    if isinstance(obj, (np.ndarray, str, bytes, dict)) or is_device_array(obj) or not hasattr(obj, "__iter__"):
        hint = ""
        if isinstance(obj, np.ndarray) or is_device_array(obj):
            hint = "; wrap arrays with cudist.data.Dataset.from_tensor_slices(x).batch(global_batch_size)"
        raise TypeError(
            f"{where}: expected a cudist.data.Dataset or an iterable of batches, got {type(obj).__name__}{hint}"
        )
    return _iterable_dataset(obj, where)


def static_batch_size(dataset: Any) -> int | None:
    """The batch size of the last ``batch`` of a :class:`Dataset` pipeline, as tf.data's
    ``compute_batch_size`` finds it through element-wise ops (None: no batch, an ``unbatch`` after
    it, or not a Dataset). A multi-worker strategy's AutoShardPolicy.OFF re-splits by it: a partial
    first batch does not change the sizes.
    """
    return dataset._static_batch if isinstance(dataset, Dataset) else None

