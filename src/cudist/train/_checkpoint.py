"""``cudist.train.Checkpoint``: saves and restores training state (``tf.train.Checkpoint``).

What is tracked (the object graph). ``Checkpoint(**objects)`` names its children; from them the
graph is walked breadth-first, the first path found to an object naming it (as TF):

* a cudist ``Variable`` of any kind is a leaf with one tensor: a plain variable its value; a
  ``MirroredVariable`` ONE value (component 0; the components are equal); an
  ``AggregatingVariable`` (CentralStorageStrategy) its storage; a ``SyncOnReadVariable`` its
  aggregate (the cross-replica read: SUM, MEAN or replica 0's value), plus its per-replica
  components, so that a restore onto the same number of replicas continues bit for bit (aggregation
  NONE has no aggregate and cannot be saved, as in TF);
* a cudist optimizer (any of ``cudist.optimizers``): its ``iterations`` variable (at
  ``<optimizer>/iterations``), its hyperparameters (in the index), and one slot variable per
  (tracked variable, slot name) at ``<variable>/.OPTIMIZER_SLOT/<optimizer>/<slot>``, linked to the
  variable's path. As in TF, slots of variables that are not themselves in the checkpoint are not
  saved. Restoring into an optimizer that has no slots yet creates them;
* a distributed iterator (``iter(strategy.experimental_distribute_dataset(ds))``): its position,
  the number of steps it has handed out. Restoring re-creates it over the same input and replays
  that many steps (read and dropped): exact for a deterministic pipeline, and it costs reading them;
* containers: a list or tuple names its items ``0``, ``1``, ...; a dict its (string) keys;
* any other object with attributes (a model class, a metric): its instance attributes, by name
  (TF's AutoTrackable). Plain Python values and arrays are not tracked (as in TF), nor cudist's
  internal objects (strategies, datasets).

Names are escaped as TF escapes them ("." -> "..", "/" -> "./"), so a path like
``model/dense/kernel`` is unambiguous.

Restore works under another strategy or replica count than the save: a saved value is assigned to
every component; a SyncOnRead SUM variable's components get ``value / N`` each (TF's rule; for
integer dtypes the remainder goes to the first components, so the sum reads back exactly, where TF
truncates), MEAN / ONLY_FIRST_REPLICA ones the value each; with as many replicas as at the save,
its saved components are restored as they were.

The status a restore returns follows TF 2.21 (observed there): ``assert_consumed()`` raises
AssertionError if a checkpointed object was not matched by the Python program or a Python object
got no value; ``assert_existing_objects_matched()`` only for the second; ``expect_partial()``
returns the status. ``restore()`` creates ``save_counter`` first (so a checkpoint written without
one leaves it unbound); ``read()`` does not (so a checkpoint's ``save_counter`` stays unresolved,
and is applied if ``save_counter`` is created later). Values are assigned when ``restore``
returns: there is no deferred restoration of objects created afterwards, except ``save_counter``.

In a multi-worker job every worker calls ``save`` (a sync-on-read variable's aggregate is a
collective) but only the chief writes (``strategy.extended.should_checkpoint``). A sync-on-read
variable's per-replica components are saved only when this process holds every replica; a worker
of several restores its share of the job-wide split (its global replica ids).
"""

from __future__ import annotations

import collections
import enum
import functools
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, Protocol, cast

import numpy as np
import numpy.typing as npt

from cudist import _distribute_lib
from cudist._input_lib import DistributedIterator
from cudist._values import DistributedValues
from cudist._variables import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
    create_plain_variable,
    read_host,
    strategy_of,
)
from cudist.data import Dataset, DatasetIterator
from cudist.errors import InvalidArgumentError, NotFoundError
from cudist.optimizers import Optimizer
from cudist.train import _async, _format
from cudist.train._async import CheckpointOptions

__all__ = ["Checkpoint", "CheckpointLoadStatus", "InitializationOnlyStatus"]

class _Saveable(Protocol):
    """The checkpoint protocol of the non-variable state a checkpoint tracks (optimizers, iterators):
    owned by this module, implemented by ``cudist.optimizers.Optimizer`` and the dataset iterators
    (TF's ``Trackable`` plays this part; its methods are underscored there too, kept off the objects'
    public API)."""

    def _checkpoint_state(self) -> dict[str, Any]:
        """What the checkpoint records (an optimizer: hyperparameters, iterations, slots; an
        iterator: its position)."""

    def _restore_state(self, state: dict[str, Any], var_list: Any = ()) -> None:
        """Restores an optimizer's state (creating the slots of ``var_list``)."""

    def _prepare_restore(self, state: dict[str, Any]) -> Callable[[], None]:
        """Checks an iterator's saved position; the returned function commits it."""


def _saveable(obj: object) -> _Saveable:
    """``obj`` (an optimizer or an iterator the graph walk found) as the protocol's implementer."""
    return cast(_Saveable, obj)


def write_checkpoint(
    checkpoint: Checkpoint,
    prefix: str,
    options: CheckpointOptions | None = None,
    committed: Callable[[], None] | None = None,
) -> bool:
    """Writes ``checkpoint`` at ``prefix`` atomically (``CheckpointManager.save``), then calls
    ``committed``; False when this worker must not write (see ``Checkpoint._write``)."""
    return checkpoint._write(prefix, options, committed)


_SLOT = ".OPTIMIZER_SLOT"
#: A restore checks every tensor it reads before it assigns any; up to this many bytes of them are
#: held from the check to the assignment (read once), the rest read a second time to be assigned.
RESTORE_HOLD_BYTES = 256 << 20
_PER_REPLICA = ".PER_REPLICA"


def _escape(name: str) -> str:
    """TF's escaping of a local name in a checkpoint key."""
    return name.replace(".", "..").replace("/", "./")


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


_ATOMS = (
    type(None), bool, int, float, complex, str, bytes, bytearray, np.ndarray, np.generic, enum.Enum, type,
    types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial,
    set, frozenset, Dataset, DistributedValues,
)


def _walkable(obj: object) -> bool:
    """Whether an object's instance attributes are walked (TF's AutoTrackable)."""
    if isinstance(obj, _ATOMS) or not hasattr(obj, "__dict__"):
        return False
    parts = (type(obj).__module__ or "").split(".")
    # cudist's internal objects (strategies, contexts, datasets, cross-device ops) hold no state to save.
    return not (parts[0] == "cudist" and (len(parts) == 1 or parts[1].startswith("_")))


def _kind(obj: object) -> str | None:
    if isinstance(obj, Variable):
        return "variable"
    if isinstance(obj, Optimizer):
        return "optimizer"
    if isinstance(obj, (DistributedIterator, DatasetIterator)):
        return "iterator"
    if isinstance(obj, Checkpoint):
        return "checkpoint"
    if isinstance(obj, (list, tuple)):
        return "list"
    if isinstance(obj, Mapping):
        return "dict"
    if _walkable(obj):
        return "object"
    return None


class _Graph:
    """The tracked objects reachable from a checkpoint, by path.

    ``leaves``: path -> (kind, object) with kind "variable", "slot", "optimizer" or "iterator";
    ``slots``: slot path -> (optimizer path, variable path, slot name).
    """

    def __init__(self, root: Checkpoint):
        self.leaves: dict[str, tuple[str, Any]] = {}
        self.slots: dict[str, tuple[str, str, str]] = {}
        self.path_of: dict[int, str] = {}
        self._alive: list[object] = []  # keeps every visited object alive, so ids stay unique
        seen: set[int] = set()
        optimizers: list[tuple[str, dict[str, Any]]] = []
        queue = collections.deque(("", child, name) for name, child in root._graph_children())
        while queue:
            parent, obj, name = queue.popleft()
            kind = _kind(obj)
            if kind is None or id(obj) in seen:
                continue
            path = _join(parent, _escape(name))
            seen.add(id(obj))
            self._alive.append(obj)
            if kind in ("variable", "optimizer", "iterator"):
                self.leaves[path] = (kind, obj)
                self.path_of[id(obj)] = path
                if kind == "optimizer":
                    state = _saveable(obj)._checkpoint_state()
                    optimizers.append((path, state))
                    queue.append((path, state["iterations"], "iterations"))
                continue
            children: list[tuple[str, Any]]
            if kind == "checkpoint":
                children = obj._graph_children()
            elif kind == "list":
                children = [(str(i), v) for i, v in enumerate(obj)]
            elif kind == "dict":
                children = []
                for k, v in obj.items():
                    if not isinstance(k, str):
                        if _kind(v) is not None:
                            raise ValueError(
                                f"cannot checkpoint the dict at {path!r}: its key {k!r} is not a string (a key "
                                "names the value in the checkpoint)"
                            )
                        continue
                    children.append((k, v))
            else:
                try:
                    children = list(vars(obj).items())
                except TypeError:  # an object whose __dict__ is not a plain instance dict
                    continue
            queue.extend((path, child, child_name) for child_name, child in children)
        for opt_path, state in optimizers:  # slots of the tracked variables, linked to their paths
            for var, slot_name, slot in state["slots"]:
                var_path = self.path_of.get(id(var))
                if var_path is None:
                    continue
                key = f"{var_path}/{_SLOT}/{opt_path}/{_escape(slot_name)}"
                self.leaves[key] = ("slot", slot)
                self.slots[key] = (opt_path, var_path, slot_name)
        self.optimizers = {path: state for path, state in optimizers}

    def strategies(self) -> list[Any]:
        out: list[Any] = []
        for kind, obj in self.leaves.values():
            if kind in ("variable", "slot"):
                s = strategy_of(obj)
                if s is not None and all(s is not o for o in out):
                    out.append(s)
        return out


# ------------------------------------------------------------------------------------- variables
def _shape_dtype(var: Variable) -> tuple[tuple[int, ...], np.dtype[Any]]:
    arr = var.storage.primary
    return tuple(int(d) for d in arr.shape), np.dtype(arr.dtype)


def _reader(key: str, var: Variable, writer: _async.AsyncWriter | None) -> Callable[[], Any]:
    """What a spec's ``get`` is: the variable's host read, or (``writer``, for an asynchronous save)
    its value captured now (:meth:`cudist.train._async.AsyncWriter.stage_variable`)."""
    if writer is None:
        return functools.partial(read_host, var)
    return writer.stage_variable(key, var)


def _save_entries(
    path: str, var: Variable, record: dict[str, Any], writer: _async.AsyncWriter | None = None
) -> list[_format.TensorSpec]:
    """The tensor specs (key, dtype, shape, get) of a variable, filling its index ``record``.

    With ``writer`` the values are captured now, for a write in another thread."""
    shape, dtype = _shape_dtype(var)
    record.update(
        tensor=path,
        dtype=dtype.name,
        shape=list(shape),
        variable_class=type(var).__name__,
        name=var.name,
        trainable=bool(var.trainable),
        synchronization=var.synchronization.name,
        aggregation=var.aggregation.name,
        replicas=_replica_counts(var)[0],
    )
    if isinstance(var, SyncOnReadVariable):
        if var.aggregation is VariableAggregation.NONE:
            raise ValueError(
                f"cannot checkpoint SyncOnReadVariable '{var.name}' (at {path!r}): with aggregation NONE it has no "
                "cross-replica value to save (TF raises too); give it aggregation SUM, MEAN or ONLY_FIRST_REPLICA"
            )
        aggregate: Callable[[], Any] = functools.partial(read_host, var)  # the aggregate: a cross-replica read (a collective)
        if writer is not None:  # taken now (it may be a component's storage: ONLY_FIRST_REPLICA)
            aggregate = writer.stage(path, aggregate())
        specs = [(path, dtype, shape, aggregate)]
        total, local = _replica_counts(var)
        if local == total:  # every replica's component is here (not so for one worker of several)
            keys = []
            for i, c in enumerate(var.values):
                key = f"{path}/{_PER_REPLICA}/{i}"
                keys.append(key)
                specs.append((key, dtype, shape, _reader(key, c, writer)))
            record["per_replica"] = keys
        return specs
    if isinstance(var, DistributedValues):  # MirroredVariable: one value, component 0's
        return [(path, dtype, shape, _reader(path, var.values[0], writer))]
    return [(path, dtype, shape, _reader(path, var, writer))]  # plain, AggregatingVariable: the storage


def _replica_counts(var: Variable) -> tuple[int, int]:
    """(replicas in sync over the whole job, components held here) of a variable."""
    if not isinstance(var, DistributedValues):
        return 1, 1
    local = len(var.values)
    strategy = strategy_of(var)
    return (local if strategy is None else int(strategy.num_replicas_in_sync)), local


def _tensor_keys(record: dict[str, Any]) -> list[str]:
    """The tensors a variable or slot record names (none for other records)."""
    if "tensor" not in record:
        return []
    return [record["tensor"], *(record.get("per_replica") or ())]


def _check_all_compatible(matched: Sequence[tuple[str, str, Any, dict[str, Any]]]) -> None:
    for path, kind, obj, record in matched:
        if kind in ("variable", "slot"):
            _check_compatible(path, obj, record)


def _check_compatible(path: str, var: Variable, record: dict[str, Any]) -> None:
    dtype = np.dtype(record["dtype"])
    shape = tuple(record["shape"])
    if dtype != var.dtype:
        raise InvalidArgumentError(
            f"Received incompatible tensor with dtype {dtype.name} when attempting to restore variable '{var.name}' "
            f"of dtype {var.dtype.name} (checkpoint key {path!r})"
        )
    spec = var.shape  # may hold None dimensions (a variable created with shape=)
    if len(spec) != len(shape) or any(s is not None and s != d for s, d in zip(spec, shape)):
        raise ValueError(
            f"Received incompatible tensor with shape {shape} when attempting to restore variable with shape "
            f"{tuple(spec)} and name {var.name} (checkpoint key {path!r})"
        )


def _split_sum(value: npt.NDArray[Any], n: int) -> list[Any]:
    """Components whose sum is ``value``: value / n each (TF); integers exactly (remainder first)."""
    if value.dtype.kind in "iub":
        if value.dtype.kind == "b":
            return [value] + [np.zeros_like(value)] * (n - 1)
        q, r = np.divmod(value, n)
        return [(q + (i < r)).astype(value.dtype) for i in range(n)]
    return [value / value.dtype.type(n)] * n


def _assign_components(var: DistributedValues, arrays: Sequence[Any]) -> None:
    for c, a in zip(var.values, arrays):
        c.assign(a, read_value=False)


def _restore_variable(var: Variable, record: dict[str, Any], read: Callable[[str], npt.NDArray[Any]]) -> None:
    """Assigns the saved value (``read(key)`` gives a tensor) to every component of ``var``."""
    value = read(record["tensor"])
    if isinstance(var, SyncOnReadVariable):
        total, local = _replica_counts(var)
        keys = record.get("per_replica") or []
        if len(keys) == total == local:  # as many replicas as at the save: the components as they were
            del value
            for c, key in zip(var.values, keys):
                c.assign(read(key), read_value=False)
            return
        if var.aggregation is VariableAggregation.SUM:
            # This worker's share of the split over every replica of the job (its global replica ids).
            first = 0 if total == local else getattr(strategy_of(var).extended, "_worker_index", 0) * local
            _assign_components(var, _split_sum(value, total)[first : first + local])
        else:  # MEAN, ONLY_FIRST_REPLICA, NONE: every component the value (as TF)
            _assign_components(var, [value] * local)
        return
    if isinstance(var, DistributedValues) and not isinstance(var, MirroredVariable):
        _assign_components(var, [value] * len(var.values))
        return
    # A mirrored variable's cross-replica assign writes every copy (host copies share one storage:
    # written once, no copy per component).
    var.assign(value, read_value=False)


# ------------------------------------------------------------------------------------- status
def _describe(objs: list[object]) -> str:
    shown = objs[:10]
    return f"Showing {len(shown)} of {len(objs)} unmatched objects: {shown!r}"


class _Restoration:
    """A restore's lasting record: the checkpoint's objects and which of them got their values.

    Kept by the :class:`Checkpoint` so that objects attached after the restore still get their saved
    values (TF's deferred restoration), and by the :class:`CheckpointLoadStatus`, which reads it
    when asked (a status is live, as TF's: ``save_counter`` created after ``read``, a variable
    attached after ``restore``, count as matched once they have their values).
    """

    def __init__(self, prefix: str, saved: dict[str, Any]) -> None:
        self.prefix = prefix
        self.saved = saved
        self.restored: set[str] = set()  # paths of checkpointed objects whose values were applied

    def pending(self) -> set[str]:
        return set(self.saved) - self.restored


class CheckpointLoadStatus:
    """What a :meth:`Checkpoint.restore` / :meth:`Checkpoint.read` matched (TF's ``CheckpointLoadStatus``).

    Live, as TF's: it reflects objects restored after the call too (a variable attached to the
    checkpoint later gets its saved value then; see :meth:`Checkpoint.restore`).
    """

    def __init__(self, checkpoint: Checkpoint, restoration: _Restoration) -> None:
        self._checkpoint = checkpoint
        self._restoration = restoration
        self._save_path = restoration.prefix
        self._partial = False

    @property
    def _unresolved(self) -> list[tuple[str, Any]]:
        """(path, kind) of checkpointed objects no value went to."""
        r = self._restoration
        return [(p, r.saved[p]["kind"]) for p in r.saved if p not in r.restored]

    @property
    def _unbound(self) -> list[tuple[str, object]]:
        """(path, object) of the program's tracked objects that got no value from the checkpoint."""
        restored = self._restoration.restored
        return [(p, obj) for p, (_, obj) in _Graph(self._checkpoint).leaves.items() if p not in restored]

    @property
    def _matched(self) -> int:
        return len(self._restoration.restored)

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every object in the checkpoint was matched, and every tracked Python object got a value.

        Raises:
            AssertionError: otherwise (naming the first unresolved checkpoint object, or the unbound
                Python objects).
        """
        if self._unresolved:
            path, kind = self._unresolved[0]
            others = f" (and {len(self._unresolved) - 1} more)" if len(self._unresolved) > 1 else ""
            raise AssertionError(f"Unresolved object in checkpoint {self._save_path}: {kind} {path!r}{others}")
        return self.assert_existing_objects_matched()

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every tracked Python object got a value from the checkpoint (extra checkpointed objects are fine).

        Raises:
            AssertionError: some tracked Python object has no value in the checkpoint.
        """
        if self._unbound:
            objs = [obj for _, obj in self._unbound]
            raise AssertionError(
                f"Found {len(objs)} Python objects that were not bound to checkpointed values, likely due to "
                f"changes in the Python program. {_describe(objs)} (paths: {[p for p, _ in self._unbound][:10]})"
            )
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """At least one object was matched.

        Raises:
            AssertionError: nothing in the checkpoint matched the program.
        """
        if not self._matched:
            raise AssertionError(f"Nothing except the root object matched a checkpointed value in {self._save_path}.")
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Marks the restore as intentionally partial; returns the status."""
        self._partial = True
        return self

    def run_restore_ops(self, session: object = None) -> None:
        """Nothing to run: values were assigned when restore returned (TF1 graph-mode API)."""

    def initialize_or_restore(self, session: object = None) -> None:
        """Nothing to run: values were assigned when restore returned (TF1 graph-mode API)."""

    def __repr__(self) -> str:
        return (
            f"<CheckpointLoadStatus {self._save_path!r} matched={self._matched} "
            f"unresolved={len(self._unresolved)} unbound={len(self._unbound)}>"
        )


class InitializationOnlyStatus:
    """The status of ``restore(None)``: nothing restored (TF's ``InitializationOnlyStatus``)."""

    _MESSAGE = "No checkpoint specified (save_path=None); nothing is being restored."

    def assert_consumed(self) -> NoReturn:
        raise AssertionError(self._MESSAGE)

    def assert_existing_objects_matched(self) -> NoReturn:
        raise AssertionError(self._MESSAGE)

    def assert_nontrivial_match(self) -> NoReturn:
        raise AssertionError(self._MESSAGE)

    def expect_partial(self) -> InitializationOnlyStatus:
        return self

    def run_restore_ops(self, session: object = None) -> None:
        """Nothing to run."""

    def initialize_or_restore(self, session: object = None) -> None:
        """Nothing to run."""


# ------------------------------------------------------------------------------------- Checkpoint
def require_cross_replica(what: str) -> None:
    if _distribute_lib.has_strategy() and not _distribute_lib.in_cross_replica_context():
        raise RuntimeError(f"{what} must be called in cross-replica context, not inside strategy.run")


class CheckpointNotFoundError(NotFoundError, FileNotFoundError):
    """No checkpoint at the path given: TF's ``NotFoundError``, and the FileNotFoundError cudist raised before."""


def _prefix_of(save_path: str | os.PathLike[str]) -> str:
    path = os.fspath(save_path)
    if path.endswith(_format.INDEX_SUFFIX):
        path = path[: -len(_format.INDEX_SUFFIX)]
    return path


class Checkpoint:
    """Groups trackable objects and saves / restores them (``tf.train.Checkpoint``).

    ``Checkpoint(model=model, optimizer=opt, iterator=it, ...)``: each keyword names an object in
    the checkpoint (a variable, an optimizer, a distributed iterator, a container of them or any
    object whose attributes hold them; see the module docstring). They are also attributes
    (``ckpt.model``); assigning a new attribute adds a dependency, as in TF.

    On disk a checkpoint is ``<prefix>.index.json`` (the object graph) and
    ``<prefix>.data-<hex>.safetensors`` (the tensors); see :mod:`cudist.train` for the format.

    Raises:
        ValueError: a value that cannot be tracked (a number, a string, an array).
    """

    _children: dict[str, Any]
    _save_counter: Variable | None
    _pending_save_counter: Any
    _restoration: _Restoration | None
    _writer: _async.AsyncWriter

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__["_children"] = {}
        self.__dict__["_save_counter"] = None
        self.__dict__["_pending_save_counter"] = None
        self.__dict__["_restoration"] = None
        self.__dict__["_writer"] = _async.AsyncWriter()  # background writes (CheckpointOptions(enable_async=True))
        for name, value in kwargs.items():
            setattr(self, name, value)

    # -- dependencies
    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name == "save_counter":
            raise AttributeError("save_counter is created and managed by the Checkpoint")
        if _kind(value) is None:
            raise ValueError(
                f"`Checkpoint` was expecting {name} to be a trackable object (a cudist Variable, an optimizer, a "
                f"distributed iterator, a Checkpoint, or a container or object holding them), got {value!r}."
            )
        self._children[name] = value
        restoration = self._restoration
        if restoration is not None and any(p == name or p.startswith(name + "/") for p in restoration.pending()):
            # TF's deferred restoration: an object attached after restore() gets its saved value now.
            self._read(restoration.prefix, restoration)

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__.get("_children", {})
        if name in children:
            return children[name]
        raise AttributeError(f"'Checkpoint' object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if name in self._children:
            del self._children[name]
        else:
            object.__delattr__(self, name)

    def _graph_children(self) -> list[tuple[str, Any]]:
        children = list(self._children.items())
        if self._save_counter is not None:
            children.append(("save_counter", self._save_counter))
        return children

    @property
    def save_counter(self) -> Variable:
        """An int64 variable counting :meth:`save` calls (numbers the checkpoints); created on first use."""
        if self._save_counter is None:
            counter = create_plain_variable(
                None,
                initial_value=0,
                trainable=False,
                name="save_counter",
                dtype=np.int64,
                synchronization=VariableSynchronization.AUTO,
                aggregation=VariableAggregation.NONE,
                shape=None,
                device="/cpu:0",
            )
            if self._pending_save_counter is not None:  # a read() before the counter existed
                counter.assign(self._pending_save_counter, read_value=False)
                self._pending_save_counter = None
                if self._restoration is not None:
                    self._restoration.restored.add("save_counter")
            self._save_counter = counter
        return self._save_counter

    # -- saving
    def save(self, file_prefix: str | os.PathLike[str], options: CheckpointOptions | None = None) -> str:
        """Saves a numbered checkpoint ``<file_prefix>-<save_counter>`` and makes it the latest one.

        Increments ``save_counter`` (saved with it), writes the checkpoint atomically, then records
        it in the directory's ``checkpoint`` state file (see :func:`cudist.train.latest_checkpoint`).

        Args:
            file_prefix: the path prefix; ``-<save_counter>`` is appended.
            options: a :class:`cudist.train.CheckpointOptions`; with ``enable_async=True`` the call
                returns once the state is captured and the checkpoint is written (and recorded as
                the latest) in the background (see :meth:`sync`).

        Returns:
            The checkpoint's path prefix, e.g. ``"/tmp/ckpt-3"`` (pass it to :meth:`restore`).

        Raises:
            Exception: the error of the previous asynchronous write, if it failed.
        """
        require_cross_replica("Checkpoint.save")
        options = _async.check_options(options)
        self._writer.sync()  # one write at a time; a failed earlier one raises here
        counter = self.save_counter
        counter.assign_add(1, read_value=False)
        path = f"{os.fspath(file_prefix)}-{int(counter)}"
        directory, name = os.path.dirname(path) or ".", os.path.basename(os.fspath(file_prefix))

        def committed() -> None:
            # TF lists only this save; the state file's checkpoints of other names (a manager's) stay listed.
            _format.write_state(directory, path, name, [(path, None)])
            _format.remove_orphans(directory, name)

        self._write(path, options, committed)
        return path

    def write(self, file_prefix: str | os.PathLike[str], options: CheckpointOptions | None = None) -> str:
        """Writes a checkpoint at exactly ``file_prefix`` (no numbering, no state file; ``save_counter``
        is saved if it exists but not incremented).

        Args:
            file_prefix: the checkpoint's path prefix.
            options: a :class:`cudist.train.CheckpointOptions` (``enable_async``: see :meth:`save`).

        Returns:
            ``file_prefix``.
        """
        require_cross_replica("Checkpoint.write")
        options = _async.check_options(options)
        self._writer.sync()
        path = os.fspath(file_prefix)
        self._write(path, options)
        return path

    def _should_write(self, graph: _Graph) -> bool:
        """Only the chief writes in a multi-worker job (every strategy involved must agree)."""
        strategies = graph.strategies()
        if _distribute_lib.has_strategy():
            strategies.append(_distribute_lib.get_strategy())
        return all(getattr(s.extended, "should_checkpoint", True) for s in strategies)

    def _write(
        self, prefix: str, options: CheckpointOptions | None = None, committed: Callable[[], None] | None = None
    ) -> bool:
        """Writes the checkpoint at ``prefix`` atomically, then calls ``committed`` (the caller's
        bookkeeping) and the options' write callbacks; False when this worker must not write.

        With ``options.enable_async`` the state is captured now and the rest runs in the background
        (:mod:`cudist.train._async`); the caller must have waited for the previous write."""
        skip_slots = options is not None and options.experimental_skip_slot_variables
        graph = _Graph(self)
        if skip_slots:
            graph.leaves = {p: leaf for p, leaf in graph.leaves.items() if leaf[0] != "slot"}
            graph.slots = {}
        writes = self._should_write(graph)
        # A worker that writes nothing reads in the foreground (its collectives) and stages nothing.
        capture = writes and options is not None and options.enable_async
        writer = self._writer if capture else None
        objects: dict[str, dict[str, Any]] = {}
        specs: list[_format.TensorSpec] = []
        for path, (kind, obj) in graph.leaves.items():
            record: dict[str, Any]
            if kind == "variable":
                record = {"kind": "variable"}
                specs += _save_entries(path, obj, record, writer)
            elif kind == "slot":
                opt_path, var_path, slot_name = graph.slots[path]
                record = {"kind": "slot", "optimizer": opt_path, "variable": var_path, "slot": slot_name}
                specs += _save_entries(path, obj, record, writer)
            elif kind == "optimizer":
                state = graph.optimizers[path]
                slots: dict[str, dict[str, str]] = {}
                for key, (opt_path, var_path, slot_name) in graph.slots.items():
                    if opt_path == path:
                        slots.setdefault(var_path, {})[slot_name] = key
                record = {
                    "kind": "optimizer",
                    "optimizer_class": type(obj).__name__,
                    "hyperparameters": state["hyperparameters"],
                    "iterations": _join(path, "iterations"),
                    "slots": slots,
                }
            else:  # iterator
                record = {"kind": "iterator", **_saveable(obj)._checkpoint_state()}
            objects[path] = record
        directory = os.path.dirname(prefix) or "."
        if not os.path.basename(prefix):
            raise ValueError(f"a checkpoint prefix must name a file, got {prefix!r}")
        # A non-chief worker too: TF's multi-worker tutorial saves there and then removes the directory.
        os.makedirs(directory, exist_ok=True)
        if not writes:
            for *_, get in specs:  # still take part in the collectives a read may be (sync-on-read aggregates)
                get()
            return False
        save_counter = None if self._save_counter is None else int(self._save_counter)

        def write() -> None:
            _format.write_checkpoint(
                prefix, specs, lambda tensors: {"tensors": tensors, "save_counter": save_counter, "objects": objects}
            )
            if committed is not None:
                committed()
            _async.run_write_callbacks(options, prefix)

        if capture:
            self._writer.release_unstaged()
            self._writer.submit(write, os.path.basename(prefix))
        else:
            write()
        return True

    # -- restoring
    def restore(
        self, save_path: str | os.PathLike[str] | None, options: object = None
    ) -> CheckpointLoadStatus | InitializationOnlyStatus:
        """Restores a checkpoint written by :meth:`save` or :meth:`write` (``save_counter`` included).

        Args:
            save_path: a checkpoint prefix (as :meth:`save` and :func:`cudist.train.latest_checkpoint`
                return), or None to restore nothing.

        Returns:
            A :class:`CheckpointLoadStatus` (``assert_consumed()``, ``assert_existing_objects_matched()``,
            ``expect_partial()``); for None an :class:`InitializationOnlyStatus`.

        Objects the checkpoint has values for that are attached to this Checkpoint afterwards
        (``ckpt.v = Variable(...)`` after ``restore``) get their saved values when attached, as in
        TF; the returned status then counts them.

        Raises:
            cudist.errors.NotFoundError: no checkpoint at ``save_path`` (TF's error; also a
                FileNotFoundError).
            cudist.errors.DataLossError: a damaged checkpoint (a checksum mismatch, a malformed,
                truncated or missing file, a path outside its directory); also a ValueError.
            ValueError: a saved value's dtype (:class:`~cudist.errors.InvalidArgumentError`) or
                shape does not fit its variable, or an iterator's input is shorter than the saved
                position.

        Nothing is assigned when it raises: every check (the files, their checksums, the fit of each
        value, an iterator's replay on a fresh copy) comes before the first assignment.
        """
        if save_path is None:
            return InitializationOnlyStatus()
        require_cross_replica("Checkpoint.restore")
        self._writer.sync()  # a pending asynchronous write may be the checkpoint asked for
        self.save_counter  # noqa: B018 - TF creates the counter before restoring, so it is matched
        return self._read(save_path)

    def read(
        self, save_path: str | os.PathLike[str] | None, options: object = None
    ) -> CheckpointLoadStatus | InitializationOnlyStatus:
        """Restores a checkpoint like :meth:`restore`, without creating ``save_counter`` first (the
        counterpart of :meth:`write`; a saved counter is applied if the counter is created later)."""
        if save_path is None:
            return InitializationOnlyStatus()
        require_cross_replica("Checkpoint.read")
        self._writer.sync()
        return self._read(save_path)

    def _read(self, save_path: str | os.PathLike[str], deferred: _Restoration | None = None) -> CheckpointLoadStatus:
        """Restores ``save_path``; with ``deferred`` (an earlier restore's record), only the objects
        that restore has not given values to yet."""
        prefix = _prefix_of(save_path)
        index_path = prefix + _format.INDEX_SUFFIX
        try:
            index = _format.read_index(prefix)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                None,
                None,
                f"Failed to find any matching files for {prefix}: no {os.path.basename(index_path)} there. A checkpoint "
                "prefix is what save()/write() return, e.g. 'path/to/ckpt-1'.",
            ) from None
        saved = all_saved = index["objects"]
        restoration = _Restoration(prefix, saved) if deferred is None else deferred
        if deferred is not None:  # only what the earlier restore left; the rest keeps its values
            saved = {p: r for p, r in saved.items() if p not in deferred.restored}
        shapes = _format.tensor_shapes(index)
        tensors_path = os.path.join(os.path.dirname(prefix) or ".", index["tensors"])
        with _format.TensorReader(tensors_path, shapes, os.path.basename(index_path), index["version"]) as reader:
            # All or nothing: the index, the header and the checksums of every tensor this restore reads
            # are checked, and the values' fit to their variables, before anything changes. Checked
            # tensors are held for the assignment up to RESTORE_HOLD_BYTES; beyond, they are read
            # again then (one tensor in memory at a time).
            held: dict[str, npt.NDArray[Any]] = {}
            room = [RESTORE_HOLD_BYTES]
            verified: set[str] = set()

            def verify(records: list[dict[str, Any]]) -> None:
                for record in records:
                    for key in _tensor_keys(record):
                        if key not in verified:
                            value = reader.read(key, *shapes[key])
                            verified.add(key)
                            if value.nbytes <= room[0]:
                                held[key] = value
                                room[0] -= value.nbytes

            graph = _Graph(self)
            matched, _, _ = self._match(graph, saved)
            _check_all_compatible(matched)
            leaves = graph.leaves
            verify([r for *_, r in matched] + [  # and the slots the optimizers are about to create
                r for r in saved.values()  # (the optimizer itself may have been restored before: all_saved)
                if r["kind"] == "slot" and leaves.get(r["optimizer"], ("",))[0] == "optimizer"
                and leaves.get(r["variable"], ("",))[0] == "variable"
            ])
            counter_record = saved.get("save_counter") if self._save_counter is None and deferred is None else None
            if counter_record is not None:
                verify([counter_record])
            if self._build_slots(graph, all_saved):
                graph = _Graph(self)
                matched, _, _ = self._match(graph, saved)
                _check_all_compatible(matched)
                verify([r for *_, r in matched])
            matched, _, _ = self._match(graph, saved)
            # An iterator replays its input on a fresh copy: a position past its end raises here.
            commits = [_saveable(obj)._prepare_restore(record) for _, kind, obj, record in matched if kind == "iterator"]

            # Nothing can fail from here on: assign.
            def read(key: str) -> npt.NDArray[Any]:
                value = held.pop(key, None)
                return reader.read(key, *shapes[key], verify=False) if value is None else value

            for _, kind, obj, record in matched:
                if kind in ("variable", "slot"):
                    _restore_variable(obj, record, read)
            if counter_record is not None:
                self._pending_save_counter = read(counter_record["tensor"])
        for _, kind, obj, record in matched:
            if kind == "optimizer":
                _saveable(obj)._restore_state(record["hyperparameters"])
        for commit in commits:
            commit()
        restoration.restored.update(path for path, *_ in matched)
        self._restoration = restoration
        return CheckpointLoadStatus(self, restoration)

    def _match(
        self, graph: _Graph, saved: dict[str, Any]
    ) -> tuple[list[tuple[str, str, Any, dict[str, Any]]], list[tuple[str, object]], list[tuple[str, Any]]]:
        """(matched (path, kind, object, record), unbound (path, object), unresolved (path, kind))."""
        matched, unbound = [], []
        for path, (kind, obj) in graph.leaves.items():
            record = saved.get(path)
            if record is not None and record["kind"] == kind:
                matched.append((path, kind, obj, record))
            else:
                unbound.append((path, obj))
        matched_paths = {m[0] for m in matched}
        unresolved = [(p, r["kind"]) for p, r in saved.items() if p not in matched_paths]
        if self._save_counter is None and "save_counter" in saved:
            unresolved = [u for u in unresolved if u[0] != "save_counter"] + [("save_counter", "variable")]
        return matched, unbound, unresolved

    @staticmethod
    def _build_slots(graph: _Graph, saved: dict[str, Any]) -> bool:
        """Creates the slots the checkpoint has for variables the program tracks; whether any optimizer built."""
        built = False
        for path, (kind, opt) in graph.leaves.items():
            record = saved.get(path)
            if kind != "optimizer" or record is None or record["kind"] != "optimizer":
                continue
            var_list = []
            for var_path in record.get("slots", {}):
                leaf = graph.leaves.get(var_path)
                if leaf is not None and leaf[0] == "variable":
                    var_list.append(leaf[1])
            for var in var_list:
                try:
                    _saveable(opt)._restore_state({}, [var])
                    built = True
                except (TypeError, ValueError):
                    pass  # a variable the optimizer cannot train now: its slots stay unmatched
        return built

    def sync(self) -> None:
        """Waits for the pending asynchronous write (``CheckpointOptions(enable_async=True)``), if any.

        Raises:
            Exception: the error that write failed with (raised once).
        """
        self._writer.sync()

    def __repr__(self) -> str:
        return f"<cudist.train.Checkpoint {list(self._children)}>"
