"""The Strategy API core: strategies, their ``extended`` part, replica contexts and the context stack.

Contexts follow ``tf.distribute``:

* outside any scope, :func:`get_strategy` is the default strategy and :func:`get_replica_context`
  a default :class:`ReplicaContext` (one replica);
* inside ``strategy.scope()`` we are in the *cross-replica* context: :func:`get_replica_context` is
  None and :func:`get_cross_replica_context` is the strategy;
* inside ``strategy.run(fn)`` each replica sees its own :class:`ReplicaContext`.

The state lives in a :class:`contextvars.ContextVar`, so it is per thread (a new thread starts outside
any scope) and per greenlet (greenlet >= 1 gives every greenlet its own context), which is what lets
the replica greenlets of :mod:`cudist._replica_engine` each see their own replica context.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar

import numpy as np
import numpy.typing as npt
import optree

from cudist import _cross_device_ops as cross_device_ops_lib
from cudist import _devices, _replica_engine
from cudist._context import COLOCATE as _COLOCATE
from cudist._context import CTX as _CTX
from cudist._context import Frame as _Frame
from cudist._arrays import (
    as_array,
    contiguous,
    current_gpu,
    is_device_array,
    like,
    physical_gpu,
    set_current_gpu,
    snapshot,
    to_host,
)
from cudist._reduce_util import ReduceOp, int_mean_dtype
from cudist._values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    regroup,
    select_replica,
    select_replicas,
    select_replicas_exact,
    stays_in_replica,
)

if TYPE_CHECKING:
    from cudist._arrays import Array
    from cudist._dataplane.placement import Destinations
    from cudist._cross_device_ops import CrossDeviceOps
    from cudist._input_lib import (
        DistributedDataset,
        DistributedDatasetsFromFunction,
        DistributedIterator,
        InputContext,
        InputOptions,
        InputReplicationMode,
        ValueContext,
    )
    from cudist._kernels import KernelBackend
    from cudist._tf1_iterators import DatasetIterator, InputFunctionIterator
    from cudist.data import Dataset

_T = TypeVar("_T")

__all__ = [
    "Strategy",
    "StrategyExtended",
    "ReplicaContext",
    "RunOptions",
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "in_cross_replica_context",
    "get_cross_replica_context",
    "experimental_set_strategy",
]


# ---------------------------------------------------------------------------------------------- contexts
def get_strategy() -> "Strategy":
    """The current strategy: the one whose scope we are in, else the default strategy."""
    f = _CTX.get()
    return f.strategy if f is not None else _default_strategy()


def has_strategy() -> bool:
    """Whether we are inside a (non-default) strategy's scope or ``run``."""
    f = _CTX.get()
    return f is not None and not isinstance(f.strategy, _DefaultDistributionStrategy)


def get_replica_context() -> ReplicaContext | None:
    """The current ReplicaContext: the default one outside any scope, None in cross-replica context
    (inside ``scope()``), the replica's own inside ``run``.

    Returns:
        A :class:`ReplicaContext`, or None in cross-replica context (check for it before calling
        collectives: inside ``strategy.run`` it is never None).
    """
    f = _CTX.get()
    if f is None:
        return _default_replica_context()
    return f.replica_ctx  # type: ignore[no-any-return]  # Frame.replica_ctx: Any


def in_cross_replica_context() -> bool:
    """True inside a strategy's ``scope()`` but not inside ``run`` (TF's cross-replica context)."""
    f = _CTX.get()
    return f is not None and f.replica_ctx is None


def get_cross_replica_context() -> Strategy | None:
    """The strategy in cross-replica context, else None (in replica context or outside any scope)."""
    f = _CTX.get()
    if f is None or f.replica_ctx is not None:
        return None
    return f.strategy  # type: ignore[no-any-return]  # Frame.strategy: Any


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Makes ``strategy`` current for this thread outside any ``with scope()`` (None resets it).

    Args:
        strategy: the strategy, or None for the default strategy.

    Raises:
        RuntimeError: called inside a strategy's scope.
        TypeError: ``strategy`` is neither a :class:`Strategy` nor None.
    """
    f = _CTX.get()
    if f is not None and not f.is_set:
        raise RuntimeError("Must not be called inside a `cudist.Strategy` scope.")
    if strategy is None:
        _CTX.set(None)
        return
    if not isinstance(strategy, Strategy):
        raise TypeError(f"experimental_set_strategy expects a cudist.Strategy or None, got {type(strategy).__name__}")
    _CTX.set(None if isinstance(strategy, _DefaultDistributionStrategy) else _Frame(strategy, None, is_set=True))


def _require_cross_replica(strategy: Strategy, what: str) -> None:
    """Raises RuntimeError unless in ``strategy``'s cross-replica context or outside any scope."""
    f = _CTX.get()
    if f is None:
        return
    if f.replica_ctx is not None:
        raise RuntimeError(
            f"{what}: method requires being in cross-replica context, use get_replica_context().merge_call()"
        )
    if f.strategy is not strategy and not isinstance(f.strategy, _DefaultDistributionStrategy):
        raise RuntimeError(f"{what}: mixing different cudist.Strategy objects: {strategy!r} is not {f.strategy!r}")


class _Scope:
    """``strategy.scope()``: enters the strategy's cross-replica context (re-entrant for the same strategy)."""

    __slots__ = ("_strategy", "_token")

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._token: contextvars.Token[_Frame | None] | None = None

    def __enter__(self) -> Strategy:
        s = self._strategy
        f = _CTX.get()
        if f is not None and f.strategy is s and f.replica_ctx is not None:
            # As TF: a strategy's scope is its cross-replica context, which replicas reach by merge_call.
            raise RuntimeError(
                f"{s!r}.scope() entered inside its own strategy.run (in replica context): method requires "
                "being in cross-replica context, use get_replica_context().merge_call()"
            )
        if f is not None and f.strategy is not s:
            if isinstance(s, _DefaultDistributionStrategy):
                raise RuntimeError(f"Must not nest cudist.Strategy scopes: the default strategy inside {f.strategy!r}")
            raise RuntimeError(f"Mixing different cudist.Strategy objects: {f.strategy!r} is not {s!r}")
        if f is None and not isinstance(s, _DefaultDistributionStrategy):
            self._token = _CTX.set(s._extended._cross_frame)
        return s

    def __exit__(self, *exc: object) -> Literal[False]:
        if self._token is not None:
            _CTX.reset(self._token)
            self._token = None
        return False


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for ``Strategy.run`` (accepted for TF compatibility; they change nothing on CPUs/GPUs here)."""

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: object = None


# ---------------------------------------------------------------------------------------------- helpers
_OPS = {k: v for name, v in ReduceOp.__members__.items() for k in (name, name.lower(), name.capitalize())}


def _is_dv(x: object) -> TypeGuard[DistributedValues]:
    return isinstance(x, DistributedValues)


def _contains_dv(tree: Any) -> bool:
    if isinstance(tree, DistributedValues):
        return True
    return any(isinstance(x, DistributedValues) for x in optree.tree_leaves(tree, is_leaf=_is_dv))


def _is_nest_of_dv(value: object) -> bool:
    """Whether ``value`` is a (tuple/list/dict) nest holding DistributedValues, not one itself."""
    return isinstance(value, (tuple, list, dict)) and not isinstance(value, DistributedValues) and _contains_dv(value)


def _select_all(i: int, tree: Any) -> Any:
    """Component ``i`` of every DistributedValues in ``tree`` -- variables included (cross-replica split)."""
    if isinstance(tree, DistributedValues):
        return tree.values[i]
    return optree.tree_map(lambda x: x.values[i] if isinstance(x, DistributedValues) else x, tree, is_leaf=_is_dv)


def _check_component_counts(where: str, tree: Any, n: int) -> None:
    """Raises ValueError if a DistributedValues in ``tree`` (variables aside) has other than ``n`` components.

    TF 2.21 silently uses the first ``n`` components of a longer PerReplica in ``run`` and sums all
    of them in ``reduce``; we refuse, as a value for replicas that do not exist is a mistake.
    """
    if type(tree) is tuple and _counts_match(tree, n):
        return  # run()'s common args: arrays, per-replica values, lists and tuples of them
    leaves = (tree,) if isinstance(tree, DistributedValues) else optree.tree_leaves(tree, is_leaf=_is_dv)
    for x in leaves:
        if isinstance(x, DistributedValues) and len(x.values) != n and not stays_in_replica(x):
            raise ValueError(
                f"{where} got a {type(x).__name__} with {len(x.values)} component(s), but the strategy has {n} "
                f"replicas (on this worker); build per-replica values with "
                "strategy.experimental_distribute_values_from_function or take them from strategy.run"
            )


def _only_replica_args(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``run``'s positional ``args`` for the only local replica, checked and selected in one pass:
    arrays as they are, DistributedValues of one component by that component; None when anything
    else is in them (the general path checks and selects those)."""
    if len(args) == 1:  # (the usual step: one argument, checked without building a list)
        x = args[0]
        if type(x) is np.ndarray:
            return args
        if type(x) is PerReplica:
            values = x.values
            return (values[0],) if len(values) == 1 else None
    out = []
    for x in args:
        if type(x) is np.ndarray:
            out.append(x)
        elif type(x) is PerReplica or (isinstance(x, DistributedValues) and not stays_in_replica(x)):
            values = x.values
            if len(values) != 1:
                return None
            out.append(values[0])
        else:
            return None
    return tuple(out)


def _counts_match(items: list[Any] | tuple[Any, ...], n: int) -> bool:
    """True when ``items`` holds only arrays, DistributedValues of ``n`` components (or variables),
    and lists and tuples of them; False when anything else is in it (then the caller looks closer)."""
    for x in items:
        t = type(x)
        if t is np.ndarray:
            continue
        if isinstance(x, DistributedValues):
            if len(x.values) != n and not stays_in_replica(x):
                return False
        elif t is list or t is tuple:
            if not _counts_match(x, n):
                return False
        else:
            return False
    return True


def _scalarize(a: Any) -> Any:
    return a[()] if isinstance(a, np.ndarray) and a.ndim == 0 else a


def _regroup_results(results: Sequence[Any]) -> Any:
    first = results[0]
    for r in results:
        if r is not first:
            break
    else:
        return first
    if type(first) is np.ndarray:  # the usual result: one array per replica
        return PerReplica(results)
    if isinstance(first, (tuple, list, dict)) or first is None or isinstance(first, DistributedValues):
        return regroup(results, PerReplica)
    return PerReplica(results)




def _warn_deprecated(name: str, instead: str) -> None:
    warnings.warn(f"{name} is deprecated (a TF1-era method); use {instead} instead", DeprecationWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------- collectives
_SIMPLE_LEAVES = (np.ndarray, np.generic, float, int, complex)
_NDARRAY_ONLY = {np.ndarray}


class _LazyPaths:
    """Leaf paths of a nest, computed only when an error message needs them."""

    def __init__(self, tree: Any) -> None:
        self._tree = tree
        self._paths: list[str] | None = None

    def __getitem__(self, j: int) -> str:
        if self._paths is None:
            from cudist._dataplane.packing import tree_leaves_with_paths

            self._paths = tree_leaves_with_paths(self._tree)[2]
        return self._paths[j]

    def __bool__(self) -> bool:
        return True


def _h_all_reduce(strategy: Strategy, payloads: Sequence[tuple[ReduceOp, Any]]) -> list[Any]:
    """``ReplicaContext.all_reduce`` of every replica at once: flattens each replica's nest, checks
    that the replicas agree, calls the strategy's cross-device ops once, unflattens the results."""
    op, v0 = payloads[0]
    ops = strategy._extended._cross_device_ops
    if type(v0) is np.ndarray:
        # One NumPy array per replica, every replica with the same op: the per-step common case.
        host = []
        for o, v in payloads:
            if o is not op or type(v) is not np.ndarray:
                break
            host.append(v)
        else:
            return cross_device_ops_lib.all_reduce_arrays(ops, op, host)
    for r, (o, _) in enumerate(payloads[1:], 1):
        if o is not op:
            raise ValueError(f"all_reduce: replica 0 reduces with {op.name} but replica {r} with {o.name}")
    if isinstance(v0, _SIMPLE_LEAVES) and all(isinstance(p[1], _SIMPLE_LEAVES) for p in payloads):
        # One array or scalar per replica: the per-step common case, without tree flattening.
        res = cross_device_ops_lib.all_reduce_arrays(ops, op, [as_array(p[1]) for p in payloads])
        if isinstance(v0, np.ndarray):
            return res
        return [_scalarize(o) for o in res]
    t0 = type(v0)
    if (
        (t0 is list or t0 is tuple)
        and all(type(p[1]) is t0 and len(p[1]) == len(v0) for p in payloads)
        and all(set(map(type, p[1])) == _NDARRAY_ONLY for p in payloads)
    ):
        # A flat list or tuple of host arrays (a step's gradients): no tree walk, and no scalars. (Lists
        # of the user's lists' items, not those lists: a cross-device ops subclass may change them.)
        out = cross_device_ops_lib.all_reduce(ops, op, [list(p[1]) for p in payloads], _LazyPaths(v0))
        return [t0(o) for o in out]
    flat = [optree.tree_flatten(v) for _, v in payloads]
    leaves0, spec0 = flat[0]
    for r, (_, spec) in enumerate(flat[1:], 1):
        if spec != spec0:
            raise ValueError(f"all_reduce: replica {r} passed a structure {spec} but replica 0 passed {spec0}")
    arrays = [[x if type(x) is np.ndarray else as_array(x) for x in leaves] for leaves, _ in flat]
    out = cross_device_ops_lib.all_reduce(ops, op, arrays, _LazyPaths(v0))
    scalar = [type(x) is not np.ndarray and not is_device_array(x) for x in leaves0]
    results: list[Any] = []
    for r in range(len(payloads)):
        leaves = [_scalarize(a) if s else a for a, s in zip(out[r], scalar)]
        results.append(optree.tree_unflatten(spec0, leaves))
    return results


def _h_all_gather(strategy: Strategy, payloads: Sequence[tuple[Any, int]]) -> list[Any]:
    from cudist._dataplane.packing import tree_leaves_with_paths
    from cudist._dataplane.reduce import gather_arrays

    a: Any  # a replica's axis, then a replica's array
    axis = payloads[0][1]
    for r, (_, a) in enumerate(payloads[1:], 1):
        if a != axis:
            raise ValueError(f"all_gather: replica 0 gathers along axis {axis} but replica {r} along axis {a}")
    flat = [tree_leaves_with_paths(v) for v, _ in payloads]
    leaves0, spec0, paths = flat[0]
    for r, (_, spec, _) in enumerate(flat[1:], 1):
        if spec != spec0:
            raise ValueError(f"all_gather: replica {r} passed a structure {spec} but replica 0 passed {spec0}")
    n = len(payloads)
    gathered: list[tuple[Array, list[Array]]] = []
    for j in range(len(leaves0)):
        arrs = [contiguous(flat[r][0][j]) for r in range(n)]
        for r, a in enumerate(arrs[1:], 1):
            if a.dtype != arrs[0].dtype:
                where = f" at {paths[j]!r}" if paths[j] else ""
                raise ValueError(
                    f"all_gather: replicas disagree{where}: replica 0 has dtype {arrs[0].dtype}, replica {r} has dtype {a.dtype}"
                )
        gathered.append((strategy._extended._gather_across_workers(gather_arrays(arrs, axis), axis), arrs))
    # Each replica owns its result, on its own device, as in TF (and so ``run`` returns a
    # PerReplica, not one shared object). A host result (replicas passing host values) stays on the host.
    def own_copy(g: Any, ref: Any) -> Array:
        return like(g, ref, copy=True) if is_device_array(g) else snapshot(g)

    return [
        optree.tree_unflatten(spec0, [g if r == 0 else own_copy(g, arrs[r]) for g, arrs in gathered]) for r in range(n)
    ]


def _h_merge_call(
    strategy: Strategy, payloads: Sequence[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]
) -> list[Any]:
    fn = payloads[0][0]
    n = len(payloads)
    if n == 1:
        margs, mkwargs = payloads[0][1], payloads[0][2]
    else:
        margs = regroup([p[1] for p in payloads], PerReplica)
        mkwargs = regroup([p[2] for p in payloads], PerReplica)
    # In a copy of the caller's context: the cross-replica frame can never outlive the call, even
    # when an interrupt lands between setting and resetting it (the copy is simply dropped).
    result = contextvars.copy_context().run(_call_in_frame, strategy._extended._cross_frame, fn, (strategy, *margs), mkwargs)
    return select_replicas(n, result)


#: The keyword arguments of a call without any (shared: ``fn(**kwargs)`` gives fn a copy).
_NO_KWARGS: dict[str, Any] = {}


def _call_in_frame(frame: _Frame, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` with ``frame`` current: run inside a copied context, so it never leaks."""
    _CTX.set(frame)
    return fn(*args, **kwargs)


_HANDLERS: dict[str, Callable[[Strategy, Any], list[Any]]] = {
    "all_reduce": _h_all_reduce,
    "all_gather": _h_all_gather,
    "merge_call": _h_merge_call,
}


# ---------------------------------------------------------------------------------------------- ReplicaContext
class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (``tf.distribute.ReplicaContext``).

    Collectives (``all_reduce``, ``all_gather``, ``merge_call``) must be called by every replica, in
    the same order, with matching shapes; they return this replica's share of the result.
    """

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int) -> None:
        self._strategy = strategy
        self._replica_id = int(replica_id_in_sync_group)  # local: this worker's replica index
        self._num = len(strategy.extended._devices)  # local replicas (the engine's count)
        # The cross-device ops' one-array all-reduce (all_reduce's per-step path), bound on first use.
        self._reduce_arrays: Callable[[ReduceOp, list[Any]], list[Any]] | None = None

    def __repr__(self) -> str:
        return (
            f"<cudist.ReplicaContext replica {self.replica_id_in_sync_group} of {self.num_replicas_in_sync} "
            f"of {self._strategy!r}>"
        )

    @property
    def strategy(self) -> Strategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index, 0 .. num_replicas_in_sync - 1 (over every worker of a multi-worker job)."""
        ext = self._strategy.extended
        return ext._worker_index * self._num + self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run in sync (over every worker of a multi-worker job)."""
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        """The device of this replica (a 1-tuple of its canonical name)."""
        return (self._strategy._extended._devices[self._replica_id],)

    def _collective(self, kind: str, payload: Any) -> Any:
        f = _CTX.get()
        if f is None or f.replica_ctx is not self:
            raise RuntimeError(
                f"ReplicaContext.{kind} must be called inside strategy.run, by the replica it belongs to "
                f"(replica {self._replica_id}); use strategy.reduce or extended.reduce_to in cross-replica context"
            )
        if self._num == 1:
            return _HANDLERS[kind](self._strategy, [payload])[0]
        return _replica_engine.meet(kind, payload)  # the caller of run() performs it once all are there

    def all_reduce(self, reduce_op: ReduceOp | str, value: _T, options: object = None) -> _T:
        """All-reduces ``value`` (a nested structure of arrays or scalars) across replicas.

        All leaves of one dtype are reduced in one kernel call, straight from the replicas' arrays
        (no staging copy); on CPU replicas the results of all of them land in one shared buffer, of
        which each replica gets read-only views. Integer MEAN gives float64, as in TF.

        Args:
            reduce_op: ``ReduceOp.SUM`` / ``MEAN`` or "sum" / "mean".
            value: this replica's value: an array, a scalar, or a nest (tuple, list, dict) of them;
                every replica passes the same structure, shapes and dtypes.
            options: accepted for TF compatibility (``CommunicationOptions``); ignored.

        Returns:
            This replica's copy of the result, in ``value``'s structure (typed as ``value``'s type:
            arrays stay arrays of their kind, Python scalars come back as NumPy scalars, and an
            integer MEAN has dtype float64).

        Raises:
            RuntimeError: called outside ``strategy.run``, or by another replica's context.
            ValueError: an unknown op, or replicas passing different structures, shapes or dtypes.
        """
        del options
        op = _OPS.get(reduce_op) if isinstance(reduce_op, str) else reduce_op
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(reduce_op, where="ReplicaContext.all_reduce")
        if self._num == 1 and type(value) is np.ndarray:
            # The per-step common case (what _h_all_reduce does with one array), a few calls shorter.
            f = _CTX.get()
            if f is not None and f.replica_ctx is self:
                reduce_arrays = self._reduce_arrays
                if reduce_arrays is None:
                    ops = self._strategy._extended._cross_device_ops
                    reduce_arrays = self._reduce_arrays = cross_device_ops_lib.arrays_reducer(ops)
                return reduce_arrays(op, [value])[0]  # type: ignore[no-any-return]  # an array, as value
        return self._collective("all_reduce", (op, value))  # type: ignore[no-any-return]  # value's structure

    def all_gather(self, value: _T, axis: int, options: object = None) -> _T:
        """Concatenates ``value`` (nested ok) from every replica along ``axis``, in replica order.

        Replicas may differ in size along ``axis`` (partial batches) but nowhere else.

        Args:
            value: this replica's array, or a nest (tuple, list, dict) of arrays.
            axis: the axis to concatenate along.
            options: accepted for TF compatibility (``CommunicationOptions``); ignored.

        Returns:
            This replica's copy of the gathered arrays, in ``value``'s structure.

        Raises:
            TypeError: ``axis`` is not an int.
            ValueError: replicas passing different structures or dtypes.
        """
        del options
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"all_gather: axis must be an int, got {type(axis).__name__}")
        return self._collective("all_gather", (value, int(axis)))  # type: ignore[no-any-return]  # value's structure

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        The arguments of all replicas are merged (PerReplica where they differ); every replica gets
        the result, with PerReplica results resolved to its own component.

        Args:
            merge_fn: called as ``merge_fn(strategy, *args, **kwargs)``.
            args: this replica's positional arguments.
            kwargs: this replica's keyword arguments.

        Returns:
            ``merge_fn``'s result (whatever it returns: typed ``Any``), this replica's component
            where it is a PerReplica.

        Raises:
            TypeError: ``merge_fn`` is not callable.
            ValueError: ``args`` is not a list or tuple.
        """
        if not callable(merge_fn):
            raise TypeError(f"merge_call: merge_fn must be callable, got {type(merge_fn).__name__}")
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"merge_call: args must be a list or tuple, got {type(args)}")
        return self._collective("merge_call", (merge_fn, tuple(args), dict(kwargs or {})))


class _GpuReplicaContext(ReplicaContext):
    """The context of a replica on a GPU: that GPU is CUDA's current device while the replica runs.

    CuPy allocates on, and launches on, the current device, and refuses (or warns about) arrays of
    another one; so, as TF places a replica's ops on its device, the replica's physical GPU is made
    current when it starts and again whenever it resumes after a collective (the collectives run in
    the caller, which may leave another GPU current).
    """

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int, gpu: int) -> None:
        super().__init__(strategy, replica_id_in_sync_group)
        self._gpu = int(gpu)

    def _collective(self, kind: str, payload: Any) -> Any:
        out = super()._collective(kind, payload)
        set_current_gpu(self._gpu)
        return out


def _on_replica_gpu(fn: Callable[..., _T]) -> Callable[..., _T]:
    """``fn`` wrapped to make the running replica's GPU current first (see _GpuReplicaContext)."""

    def run_on_gpu(*args: Any, **kwargs: Any) -> _T:
        set_current_gpu(_CTX.get().replica_ctx._gpu)  # type: ignore[union-attr]  # a replica's frame is set
        return fn(*args, **kwargs)

    return run_on_gpu


class _DefaultReplicaContext(ReplicaContext):
    """The replica context outside any scope: one replica of the default strategy."""

    def __repr__(self) -> str:
        return "<cudist default ReplicaContext>"

    def _collective(self, kind: str, payload: Any) -> Any:
        return _HANDLERS[kind](self._strategy, [payload])[0]


# ---------------------------------------------------------------------------------------------- extended
class StrategyExtended:
    """The strategy's additional API for library writers (``tf.distribute.StrategyExtended``).

    Attributes:
        _per_replica_input_supported: whether ``distribute_datasets_from_function`` takes
            ``InputReplicationMode.PER_REPLICA`` (not over several workers, as TF 2.21).

    Args:
        container_strategy: the :class:`Strategy` this belongs to.
        devices: canonical names of the replicas' devices, one per replica.
        cross_device_ops: the :class:`cudist.CrossDeviceOps` to reduce with (default: chosen for
            ``devices``, see :func:`cudist._cross_device_ops.select_cross_device_ops`).
        parameter_devices: canonical names of the devices variables are placed on (default:
            ``devices``).
    """

    _per_replica_input_supported = True

    def __init__(
        self,
        container_strategy: Strategy,
        devices: Iterable[str],
        cross_device_ops: CrossDeviceOps | None = None,
        parameter_devices: Iterable[str] | None = None,
    ) -> None:
        from cudist._cross_device_ops import select_cross_device_ops

        self._container_strategy_ref = container_strategy
        self._devices = tuple(devices)
        self._num = len(self._devices)
        self._parameter_devices = tuple(parameter_devices) if parameter_devices else self._devices
        self._cross_device_ops = select_cross_device_ops(self._devices, cross_device_ops)
        self._cross_frame = _Frame(container_strategy, None)
        self._replica_frames: list[_Frame] | None = None
        # The frame of the only replica of a one-CPU-replica strategy, once made (run's shortest path).
        self._only_cpu_frame: _Frame | None = None
        # The physical GPU of each replica (None on CPUs): made current while the replica runs.
        self._replica_gpus: tuple[int, ...] | None = None
        if _devices.any_gpu(self._devices):
            from cudist._dataplane.placement import gpu_layout

            self._replica_gpus = gpu_layout(self._devices)
        self._check_devices_exist()

    def __repr__(self) -> str:
        return f"<cudist.{type(self).__name__} of {self._container_strategy_ref!r}>"

    def _check_devices_exist(self) -> None:
        """Raises ValueError naming a worker or parameter device that is not configured.

        TF 2.21 accepts such devices (``MirroredStrategy(["/cpu:0", "/cpu:99"])``, a
        ``parameter_device="/gpu:3"`` without GPUs) and soft placement quietly runs their work on
        CPU:0; here a replica device is where the replica's values live, so we refuse at construction.
        """
        from cudist import config

        where = type(self._container_strategy_ref).__name__
        cpus: int | None = None
        for name in dict.fromkeys(self._devices + self._parameter_devices):
            spec = _devices.parse_device(name)
            if spec.is_gpu:
                try:
                    physical_gpu(spec)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                continue
            if cpus is None:
                cpus = len(config.list_logical_devices("CPU"))
            if spec.device_index >= cpus:
                raise ValueError(
                    f"{where}: device {name!r} does not exist: {cpus} logical CPU(s) are configured "
                    "(cudist.config.set_logical_device_configuration on the physical CPU makes more)"
                )

    def _container_strategy(self) -> Strategy:
        return self._container_strategy_ref

    def _frames(self) -> list[_Frame]:
        frames = self._replica_frames
        if frames is None:
            s = self._container_strategy_ref
            gpus = self._replica_gpus
            if gpus is None:
                frames = [_Frame(s, ReplicaContext(s, i)) for i in range(self._num)]
            else:
                frames = [_Frame(s, _GpuReplicaContext(s, i, gpus[i])) for i in range(self._num)]
            self._replica_frames = frames
            if self._num == 1 and gpus is None:
                self._only_cpu_frame = frames[0]
        return frames

    # -------------------------------------------------------------- hooks each strategy overrides
    def _create_variable(self, next_creator: Callable[..., object], **kwargs: Any) -> object:
        """Creates the variable ``cudist.Variable(**kwargs)`` asks for in this strategy's scope.

        ``next_creator(device=..., **kwargs)`` builds a plain variable; this default (the default
        strategy, OneDeviceStrategy) places it on the first variable device. Strategies with
        distributed variables override this, as TF's ``*Extended`` classes do.

        Returns:
            A :class:`cudist.Variable` (typed ``object`` here: the variables sit a layer above
            this module; ``cudist.Variable(...)`` gives it its type).
        """
        return next_creator(device=self._variable_devices()[0], **kwargs)

    def _gpu_of_replica(self, replica_id: int) -> int | None:
        """The physical GPU replica ``replica_id`` runs on (made current while it runs); None on CPUs."""
        gpus = self._replica_gpus
        return None if gpus is None else gpus[replica_id]

    def _fused_sum_backend(self, arrays: Sequence[Any]) -> KernelBackend | None:
        """The kernel backend that may sum per-replica ``arrays`` inside a fused optimizer update.

        None unless this strategy's cross-device ops reduce with exactly that kernel sum (see
        ``CrossDeviceOps._fused_sum_backend``); optimizers then use ``batch_reduce_to``.
        """
        return cross_device_ops_lib.fused_sum_backend(self._cross_device_ops, arrays)

    def _pipelined_sums(
        self,
        per_replica_leaves: Sequence[Sequence[Any]],
        consume: Callable[[list[int], list[Any]], None],
        settle: Callable[[], Sequence[Sequence[Any]]] | None = None,
    ) -> bool:
        """The SUM of each leaf over every replica, handed pack by pack to ``consume(leaf ids, sums)``
        while the next packs cross the workers; False, nothing done, unless this strategy's
        cross-device ops pipeline it (``MultiWorkerMirroredStrategy`` with ``CUDIST_PIPELINE_UPDATE=on``).
        ``settle()``: called once the pipeline is decided, before any work: the leaves to read instead."""
        return cross_device_ops_lib.pipelined_sums(self._cross_device_ops, per_replica_leaves, consume, settle)

    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``experimental_distribute_values_from_function``: a PerReplica at each leaf, even for one replica."""
        from cudist import _input_lib

        return _input_lib.distribute_values_from_function(value_fn, self._container_strategy_ref)

    # -------------------------------------------------------------- multi-worker hooks (one worker here)
    #: Workers of the job and this one's index (MultiWorkerMirroredStrategy sets them).
    _num_workers = 1
    _worker_index = 0

    @property
    def _num_replicas_in_sync(self) -> int:
        """Replicas over every worker: local replicas x workers."""
        return self._num * self._num_workers

    def _first_replica_value(self, value: Any) -> Any:
        """ONLY_FIRST_REPLICA aggregation's value: replica 0's component."""
        return value.values[0] if isinstance(value, DistributedValues) else value

    def _gather_across_workers(self, array: Array, axis: int) -> Array:
        """This worker's gathered ``array`` concatenated with the other workers' along ``axis``."""
        del axis
        return array

    def _global_count(self, count: int) -> int:
        """``count`` summed over the workers."""
        return count

    def _any_worker(self, has_value: bool) -> bool:
        """Whether any worker has a value (input steps end together on every worker)."""
        return has_value

    def _local_value_of(self, value: Any) -> Any:
        """How a replica-context value that is not distributed counts in a reduction (as it is here)."""
        return value

    # -------------------------------------------------------------- devices
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Names of the devices the replicas run on, one per replica (under the worker's task in a cluster)."""
        return tuple(map(_devices.display_name, self._devices))

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Names of the devices variables are placed on (under the worker's task in a cluster)."""
        return tuple(map(_devices.display_name, self._parameter_devices))

    def _variable_devices(self) -> tuple[str, ...]:
        """Devices of a variable created now: the colocated variable's, else the policy's."""
        c = _COLOCATE.get()
        if c is not None and c[0] is self:
            return c[1]
        return self._parameter_devices

    def non_slot_devices(self, var_list: object) -> tuple[str, ...]:
        """Devices for non-slot variables (the parameter devices).

        Args:
            var_list: the variables (unused: every non-slot variable goes to the parameter devices).
        """
        del var_list
        return self._parameter_devices

    experimental_require_static_shapes = False
    experimental_between_graph = False
    experimental_should_init = True
    should_checkpoint = True
    should_save_summary = True

    # -------------------------------------------------------------- variables
    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: object) -> Iterator[None]:
        """Variables created inside are placed on the devices of ``colocate_with_variable``.

        Args:
            colocate_with_variable: a variable or distributed value whose components have devices.

        Returns:
            A context manager (this is a ``contextlib.contextmanager``).

        Raises:
            ValueError: ``colocate_with_variable`` (or a component of it) has no device.
        """
        v = colocate_with_variable
        comps = v.values if isinstance(v, DistributedValues) else (v,)
        devices: list[str] = []
        for c in comps:
            d = getattr(c, "device", None)
            if not isinstance(d, str) or not d:
                raise ValueError(f"colocate_vars_with: {v!r} has no device to colocate with")
            devices.append(_devices.canonicalize(d))
        token = _COLOCATE.set((self, tuple(devices)))
        try:
            yield
        finally:
            _COLOCATE.reset(token)

    def variable_created_in_scope(self, v: object) -> bool:
        """Whether ``v`` was created inside this strategy's scope."""
        return getattr(v, "_distribute_strategy", None) is self._container_strategy_ref

    def value_container(self, value: Any) -> Any:
        """The distributed variable a component belongs to, else ``value`` itself.

        Args:
            value: any value; a component of a distributed variable resolves to that variable.
        """
        c = getattr(value, "_distributed_container", None)
        if callable(c):
            c = c()
        return c if c is not None else value

    def read_var(self, v: Any) -> Any:
        """Reads a variable in cross-replica context (aggregating sync-on-read variables).

        Args:
            v: a variable (other values: a DistributedValues gives its first component, anything
                else itself).

        Returns:
            The variable's value, an array (typed ``Any``, as what other values give is).

        Raises:
            RuntimeError: called in replica context.
        """
        _require_cross_replica(self._container_strategy_ref, "read_var")
        getter = getattr(v, "_get_cross_replica", None)
        if getter is not None:
            return getter()
        rv = getattr(v, "read_value", None)  # distributed variables aggregate in cross-replica reads
        if rv is not None:
            return rv()
        return v.values[0] if isinstance(v, DistributedValues) else v

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(component, *args, **kwargs)`` on each component of ``var``.

        DistributedValues in ``args``/``kwargs`` are split per component. Returns the results merged
        (a Mirrored where they differ) when ``group``, else a tuple of them. Called inside
        ``run`` (this strategy's replica context) it does the same through ``merge_call``, as TF
        does: the replicas' ``args`` become PerReplica values, one per component.

        Args:
            var: a variable (distributed or not) or another value with components.
            fn: called as ``fn(component, *args, **kwargs)``.
            args: positional arguments (a list or tuple).
            kwargs: keyword arguments.
            group: merge the results (True) or return a tuple of them.

        Returns:
            ``fn``'s results (whatever it returns: typed ``Any``), merged or as a tuple.

        Raises:
            ValueError: ``args`` is not a list or tuple.
            RuntimeError: inside another strategy's scope or ``run``.
        """
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"update: args must be a list or tuple, got {type(args)}")
        kwargs = kwargs or {}
        f = _CTX.get()
        if f is not None and f.replica_ctx is not None and f.strategy is self._container_strategy_ref:

            def merge_fn(strategy: Strategy, *margs: Any, **mkwargs: Any) -> Any:
                return strategy.extended.update(var, fn, margs, mkwargs, group)

            return f.replica_ctx.merge_call(merge_fn, args=tuple(args), kwargs=kwargs)
        _require_cross_replica(self._container_strategy_ref, "update")
        if isinstance(var, DistributedValues):
            comps = var.values
            results = [fn(c, *_select_all(i, tuple(args)), **_select_all(i, kwargs)) for i, c in enumerate(comps)]
        else:
            results = [fn(var, *self._single_values(args), **self._single_values(kwargs))]
        return self._group_results(results, group)

    def update_non_slot(
        self,
        colocate_with: str | Sequence[str],
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per device of ``colocate_with`` (cross-replica only).

        ``colocate_with`` is what :meth:`non_slot_devices` returned (one device or a sequence of
        them). DistributedValues in ``args``/``kwargs`` are split per device, as TF does. Returns the
        results merged (a Mirrored where they differ) when ``group``, else a tuple of them.

        Args:
            colocate_with: a device name or a sequence of them (what :meth:`non_slot_devices` gave).
            fn: called as ``fn(*args, **kwargs)`` once per device.
            args: positional arguments (a list or tuple).
            kwargs: keyword arguments.
            group: merge the results (True) or return a tuple of them.

        Returns:
            ``fn``'s results (whatever it returns: typed ``Any``), merged or as a tuple.

        Raises:
            RuntimeError: called in replica context.
            ValueError: ``args`` is not a list or tuple, or ``colocate_with`` names no device.
        """
        _require_cross_replica(self._container_strategy_ref, "update_non_slot")
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"update_non_slot: args must be a list or tuple, got {type(args)}")
        kwargs = kwargs or {}
        devices = (colocate_with,) if isinstance(colocate_with, str) else tuple(colocate_with)
        if not devices:
            raise ValueError("update_non_slot: colocate_with names no device")
        results = [fn(*_select_all(i, tuple(args)), **_select_all(i, kwargs)) for i in range(len(devices))]
        return self._group_results(results, group)

    @staticmethod
    def _group_results(results: list[Any], group: bool) -> Any:
        """Per-component results as ``update`` returns them: a tuple, one value, or a Mirrored."""
        if not group:
            return tuple(results)
        if len(results) == 1:
            return results[0]
        return regroup(results, Mirrored)

    @staticmethod
    def _single_values(tree: Any) -> Any:
        def one(x: Any) -> Any:
            if not isinstance(x, DistributedValues):
                return x
            vals = x.values
            if isinstance(x, Mirrored) or all(v is vals[0] for v in vals):
                return vals[0]
            raise ValueError(
                f"cannot update a single variable with {type(x).__name__} {x!r} of {len(vals)} different components; "
                "reduce it first (extended.reduce_to) or pass a single value"
            )

        return optree.tree_map(one, tree, is_leaf=_is_dv)

    # -------------------------------------------------------------- reductions
    def broadcast_to(self, tensor: Any, destinations: Destinations) -> Array | Mirrored:
        """Copies ``tensor`` to ``destinations`` (TF1-era ``StrategyExtended.broadcast_to``).

        Args:
            tensor: the value to copy.
            destinations: a device string or a (distributed) variable, as for :meth:`reduce_to`.

        Returns:
            The value on the one destination device, or a Mirrored over several (TF 2.21: a
            MirroredVariable destination gives a Mirrored, "/cpu:1" a plain value).

        Raises:
            RuntimeError: called in replica context.
            ValueError: ``destinations`` is a list or tuple (TF asserts it is not).
        """
        _require_cross_replica(self._container_strategy_ref, "broadcast_to")
        if destinations is None or isinstance(destinations, (list, tuple)):
            raise ValueError(
                f"broadcast_to: destinations must be a device string or a variable, got {type(destinations).__name__}"
            )
        return self._cross_device_ops.broadcast(tensor, destinations)

    def reduce_to(
        self, reduce_op: ReduceOp | str, value: Any, destinations: Destinations, options: object = None
    ) -> Array | Mirrored:
        """Reduces ``value`` across replicas to ``destinations`` (array for one device, else Mirrored).

        Args:
            reduce_op: ``ReduceOp.SUM`` / ``MEAN`` or "sum" / "mean".
            value: a DistributedValues (e.g. from ``run``), or a plain value (which SUM cannot
                reduce over several replicas).
            destinations: a device string, a list of them, or a distributed value or variable.
            options: accepted for TF compatibility (``CommunicationOptions``); ignored.

        Returns:
            An array (NumPy, or CuPy on a GPU) for one destination device, else a Mirrored.

        Raises:
            RuntimeError: called in replica context.
            ValueError: an unknown op, or SUM of a plain value over several replicas.
        """
        del options
        _require_cross_replica(self._container_strategy_ref, "reduce_to")
        op = ReduceOp.parse(reduce_op, where="reduce_to")
        value = self._local_value_of(value)
        if isinstance(value, DistributedValues):
            return self._cross_device_ops.reduce(op, value, destinations)
        return self._reduce_non_distributed(op, value, destinations)

    def _reduce_non_distributed(self, op: ReduceOp, value: Any, destinations: Destinations) -> Array | Mirrored:
        if op is ReduceOp.MEAN:
            return value  # as TF: the one value is the mean, whatever the destinations
        if self._num_replicas_in_sync != 1:
            raise ValueError(f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op {op}.")
        return self._cross_device_ops.broadcast(value, destinations)

    def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Iterable[tuple[Any, Destinations]],
        options: object = None,
    ) -> list[Array | Mirrored]:
        """Reduces many (value, destinations) pairs, packing them into about one kernel call per dtype.

        Args:
            reduce_op: ``ReduceOp.SUM`` / ``MEAN`` or "sum" / "mean".
            value_destination_pairs: (value, destinations) pairs, each as :meth:`reduce_to` takes them.
            options: accepted for TF compatibility (``CommunicationOptions``); ignored.

        Returns:
            One result per pair, in order, as :meth:`reduce_to` returns it.
        """
        del options
        _require_cross_replica(self._container_strategy_ref, "batch_reduce_to")
        op = ReduceOp.parse(reduce_op, where="batch_reduce_to")
        pairs = list(value_destination_pairs)
        if all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], DistributedValues) for p in pairs):
            return self._cross_device_ops.batch_reduce(op, pairs)
        return [self.reduce_to(op, v, d) for v, d in pairs]

    def _reduce(self, op: ReduceOp, value: Any) -> npt.NDArray[Any]:
        """Reduces to the host, returning one host array (Strategy.reduce with axis=None)."""
        value = self._local_value_of(value)
        if not isinstance(value, DistributedValues):
            if op is ReduceOp.SUM and self._num_replicas_in_sync != 1:
                raise ValueError(
                    f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op {op}."
                )
            return np.array(to_host(value), copy=True)
        return to_host(self._cross_device_ops.reduce(op, value, self._devices[0]))

    # -------------------------------------------------------------- running
    def call_for_each_replica(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs ``fn`` once per replica (what ``Strategy.run`` does), returning the merged results.

        Returns:
            As :meth:`Strategy.run`: ``fn``'s result structure (typed ``Any``), with a PerReplica
            at each leaf where the replicas returned different values.
        """
        only = self._only_cpu_frame
        if only is not None and kwargs is None and type(args) is tuple:
            # The per-step common case: the only (CPU) replica, positional arrays or one-component
            # values, called outside any scope or in this strategy's (nothing else to check).
            f = _CTX.get()
            if f is None or (f.replica_ctx is None and f.strategy is self._container_strategy_ref):
                picked = _only_replica_args(args)
                if picked is not None:
                    return contextvars.copy_context().run(_call_in_frame, only, fn, picked, _NO_KWARGS)
        if kwargs is not None or type(args) is not tuple:  # (a tuple and no kwargs: nothing to check)
            kwargs = _check_run_arguments(args, kwargs)
        f = _CTX.get()
        if f is not None:
            if f.replica_ctx is not None:
                raise RuntimeError(
                    "strategy.run cannot be called inside strategy.run (in replica context); "
                    "method requires being in cross-replica context, use get_replica_context().merge_call()"
                )
            if f.strategy is not self._container_strategy_ref and not isinstance(f.strategy, _DefaultDistributionStrategy):
                raise RuntimeError(
                    f"Mixing different cudist.Strategy objects: {f.strategy!r} is not {self._container_strategy_ref!r}"
                )
        kwargs = kwargs or {}
        n = self._num
        if n == 1 and not kwargs and type(args) is tuple and self._replica_gpus is None:
            picked = _only_replica_args(args)
            if picked is not None:  # the per-step common case: arrays and one-component values
                return contextvars.copy_context().run(_call_in_frame, self._frames()[0], fn, picked, kwargs)
        # The usual arguments are checked and selected in one pass; anything else the general way.
        args_list = select_replicas_exact(n, tuple(args)) if args and n > 1 else None
        if args and args_list is None:
            _check_component_counts("strategy.run", args, n)
        if kwargs:
            _check_component_counts("strategy.run", kwargs, n)
        frames = self._replica_frames or self._frames()  # (made once; the call only the first time)
        gpus = self._replica_gpus
        if gpus is not None:
            prev = current_gpu()
        if n == 1:
            if args:
                args = select_replica(0, tuple(args))
            if kwargs:
                kwargs = select_replica(0, kwargs)
            try:
                if gpus is not None:
                    set_current_gpu(gpus[0])
                # In a copy of the context: the replica frame cannot leak, whatever interrupts the call.
                return contextvars.copy_context().run(_call_in_frame, frames[0], fn, args, kwargs)
            finally:
                if gpus is not None:
                    set_current_gpu(prev)
        try:
            if args_list is None:
                args_list = select_replicas(n, tuple(args)) if args else [()] * n
            kwargs_list = select_replicas(n, kwargs) if kwargs else [kwargs] * n
        except IndexError:
            sizes = sorted({len(x.values) for x in optree.tree_leaves((args, kwargs), is_leaf=_is_dv) if _is_dv(x)})  # type: ignore[arg-type]  # PyTree
            raise ValueError(
                f"strategy.run got a DistributedValues argument with {sizes[0]} component(s), "
                f"but the strategy has {n} replicas"
            ) from None
        if gpus is None:
            handlers = self.__dict__.get("_handlers_cache") or self._handlers()
            results = _replica_engine.run_replicas(n, frames, fn, args_list, kwargs_list, handlers, cpu=True)
        else:
            try:
                results = _replica_engine.run_replicas(
                    n, frames, _on_replica_gpu(fn), args_list, kwargs_list, self._handlers()
                )
            finally:
                set_current_gpu(prev)  # the caller's current GPU, whatever the replicas left current
        return _regroup_results(results)

    def _handlers(self) -> dict[str, Callable[[list[Any]], list[Any]]]:
        h: dict[str, Callable[[list[Any]], list[Any]]] | None = self.__dict__.get("_handlers_cache")
        if h is None:
            s = self._container_strategy_ref
            h = self.__dict__["_handlers_cache"] = {k: functools.partial(v, s) for k, v in _HANDLERS.items()}
        return h

    def _local_results(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, DistributedValues):
            return tuple(value.values)
        if self._num > 1 and (isinstance(value, (tuple, list, dict)) or _contains_dv(value)):
            # As TF: a nest gives one result per replica, even with no DistributedValues inside.
            return tuple(_select_all(i, value) for i in range(self._num))
        return (value,)


# ---------------------------------------------------------------------------------------------- Strategy
class Strategy:
    """A way to distribute computation over devices (``tf.distribute.Strategy``).

    Args:
        extended: the strategy's :class:`StrategyExtended` (each strategy builds its own).
    """

    def __init__(self, extended: StrategyExtended) -> None:
        self._extended = extended

    def __repr__(self) -> str:
        return f"<cudist.{type(self).__name__} devices={self._extended.worker_devices}>"

    @property
    def extended(self) -> StrategyExtended:
        """The :class:`StrategyExtended` with the library-writer API."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas a ``run`` call runs in sync (over every worker of a multi-worker job)."""
        return self._extended._num_replicas_in_sync

    @property
    def cluster_resolver(self) -> None:
        """None: cudist strategies are single-worker."""
        return None

    def scope(self) -> contextlib.AbstractContextManager[Strategy, Literal[False]]:
        """A context manager entering this strategy's cross-replica context.

        Variables created inside are distributed by this strategy. Entering another strategy's scope
        inside it raises RuntimeError.

        Returns:
            The context manager; ``with strategy.scope() as s`` binds ``s`` to the strategy.
        """
        return _Scope(self)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per replica and merges the results.

        DistributedValues in ``args``/``kwargs`` are replaced by each replica's component. The result
        keeps ``fn``'s structure; at each leaf the same object from every replica stays as is,
        different values become a PerReplica.

        Args:
            fn: the replica function.
            args: positional arguments (a list or tuple), DistributedValues split per replica.
            kwargs: keyword arguments, likewise.
            options: a :class:`RunOptions` (accepted for TF compatibility; changes nothing).

        Returns:
            ``fn``'s result structure with a PerReplica at each leaf where the replicas returned
            different values (the plain value with one replica). Typed ``Any``: it is whatever
            nest ``fn`` returns, with leaves replaced.

        Raises:
            ValueError: ``args`` is not a list or tuple.
            RuntimeError: called inside ``run`` (in replica context) or another strategy's scope.
        """
        del options
        return self._extended.call_for_each_replica(fn, args, kwargs)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> npt.NDArray[Any] | Any:
        """Reduces ``value`` across replicas to one host (numpy) array.

        Args:
            reduce_op: ReduceOp.SUM / MEAN or "sum" / "mean" (any case).
            value: a DistributedValues (e.g. from ``run``), or a plain value.
            axis: None to reduce across replicas only; an int to first reduce within each replica
                along that axis. MEAN then divides by the total number of elements along it over all
                replicas, so partial (even empty) batches are weighted right.

        Returns:
            A NumPy array (a NumPy scalar for a 0-d result); for a nest of DistributedValues, the
            same nest of them (hence the ``Any`` in the type).

        Raises:
            ValueError: unknown op, out-of-range axis, or replicas with different shapes.
            RuntimeError: called in replica context.
        """
        _require_cross_replica(self, "Strategy.reduce")
        op = ReduceOp.parse(reduce_op, where="Strategy.reduce")
        if _is_nest_of_dv(value):
            # As TF: a nest of DistributedValues (e.g. what ``run`` returned) reduces leaf by leaf.
            return optree.tree_map(lambda v: self.reduce(op, v, axis), value, is_leaf=_is_dv)
        _check_component_counts("Strategy.reduce", value, self._extended._num)
        if axis is None:
            return _scalarize(self._extended._reduce(op, value))
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"Strategy.reduce: axis must be an int or None, got {type(axis).__name__}")
        comps = list(value.values) if isinstance(value, DistributedValues) else [value] * self._extended._num
        sums: list[Any]
        sums, counts = [], 0
        for r, c in enumerate(comps):
            a = to_host(c)
            if not -a.ndim <= axis < a.ndim:
                raise ValueError(
                    f"Strategy.reduce: invalid reduction axis {axis} for the value of replica {r}, "
                    f"which has {a.ndim} dimensions (shape {a.shape})"
                )
            if a.dtype.kind not in "iufc":  # TF: bool (and strings) cannot be summed
                raise TypeError(f"Strategy.reduce: cannot reduce values of dtype {a.dtype}")
            sums.append(np.sum(a, axis=axis, dtype=a.dtype))  # as TF: an int32 sum stays int32
            counts += a.shape[axis]
        multi_worker = self._extended._num_workers > 1
        total = self._extended._reduce(ReduceOp.SUM, PerReplica(sums)) if len(sums) > 1 or multi_worker else sums[0]
        counts = self._extended._global_count(counts)
        if op is ReduceOp.MEAN:
            total = np.asarray(total)
            if total.dtype.kind in "iu":  # TF's true division: float32 for 8/16-bit ints, else float64
                total = np.true_divide(total, counts, dtype=int_mean_dtype(total.dtype))
            else:
                total = total / total.dtype.type(counts)
        return _scalarize(np.asarray(total))

    def gather(self, value: Any, axis: int) -> npt.NDArray[Any] | Any:
        """Concatenates the replicas' components of ``value`` along ``axis`` into one host array.

        Args:
            value: a DistributedValues (e.g. from ``run``), a nest of them, or a plain array.
            axis: the axis to concatenate along.

        Returns:
            A NumPy array; for a nest of DistributedValues, the same nest of them (hence the
            ``Any`` in the type).

        Raises:
            TypeError: ``axis`` is not an int.
            RuntimeError: called in replica context.
        """
        _require_cross_replica(self, "Strategy.gather")
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"Strategy.gather: axis must be an int, got {type(axis).__name__}")
        if _is_nest_of_dv(value):
            return optree.tree_map(lambda v: self.gather(v, axis), value, is_leaf=_is_dv)
        from cudist._dataplane.reduce import gather_arrays

        comps = value.values if isinstance(value, DistributedValues) else (value,)
        return self._extended._gather_across_workers(gather_arrays([to_host(c) for c in comps], int(axis)), int(axis))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this worker's replicas, as a tuple (``(value,)`` if plain).

        Args:
            value: a DistributedValues, a nest holding some, or a plain value.
        """
        return self._extended._local_results(value)

    # -------------------------------------------------------------- input
    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Splits each batch of ``dataset`` over the replicas (see :class:`cudist.DistributedDataset`).

        Args:
            dataset: a :class:`cudist.data.Dataset` of global batches, or any iterable of them.
            options: a :class:`cudist.InputOptions`.

        Returns:
            The distributed dataset; ``iter()`` of it gives a :class:`cudist.DistributedIterator`.
        """
        from cudist import _input_lib

        return _input_lib.DistributedDataset(dataset, self, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> DistributedDatasetsFromFunction:
        """Calls ``dataset_fn(InputContext)`` per input pipeline; its batches are per-replica already.

        Args:
            dataset_fn: returns a :class:`cudist.data.Dataset` (or an iterable) of per-replica
                batches for the :class:`cudist.InputContext` it gets.
            options: a :class:`cudist.InputOptions`.
        """
        from cudist import _input_lib

        return _input_lib.DistributedDatasetsFromFunction(dataset_fn, self, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """A PerReplica of ``value_fn(ValueContext)`` for each replica.

        Args:
            value_fn: called once per replica with its :class:`cudist.ValueContext`.

        Returns:
            A PerReplica at each leaf of the results (whatever ``value_fn`` returns: typed ``Any``).
        """
        return self._extended._distribute_values_from_function(value_fn)

    def experimental_run_v2(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """TF 1.15's name of :meth:`run` (deprecated: warns, then runs ``fn`` as ``run`` does)."""
        _warn_deprecated("experimental_run_v2", "Strategy.run")
        return self.run(fn, args, kwargs, options)

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None
    ) -> DistributedDatasetsFromFunction:
        """TF 1.15/2.x's old name of :meth:`distribute_datasets_from_function` (deprecated: warns)."""
        _warn_deprecated("experimental_distribute_datasets_from_function", "Strategy.distribute_datasets_from_function")
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> Dataset:
        """A dataset of the slices of ``numpy_input`` (TF1-era)."""
        _warn_deprecated("experimental_make_numpy_dataset", "cudist.data.Dataset.from_tensor_slices")
        from cudist import data

        return data.Dataset.from_tensor_slices(numpy_input)

    # -------------------------------------------------------------- TF1-era
    def experimental_run(
        self,
        fn: Callable[..., Any],
        input_iterator: DistributedIterator | DatasetIterator | InputFunctionIterator | None = None,
    ) -> Any:
        """Runs ``fn(inputs)`` on each replica with the next element of ``input_iterator`` (TF1-era)."""
        _warn_deprecated("experimental_run", "Strategy.run")
        if input_iterator is None:
            return self.run(fn)
        return self.run(fn, args=(input_iterator.get_next(),))

    def make_dataset_iterator(self, dataset: Iterable[Any]) -> DatasetIterator:
        """An initializable iterator over ``dataset`` split across replicas (TF1-era)."""
        _warn_deprecated("make_dataset_iterator", "experimental_distribute_dataset")
        from cudist import _tf1_iterators

        return _tf1_iterators.DatasetIterator(dataset, self)

    def make_input_fn_iterator(
        self,
        input_fn: Callable[[InputContext], Iterable[Any]],
        replication_mode: InputReplicationMode | None = None,
    ) -> InputFunctionIterator:
        """An iterator over the datasets ``input_fn(InputContext)`` returns (TF1-era)."""
        _warn_deprecated("make_input_fn_iterator", "distribute_datasets_from_function")
        from cudist import _input_lib, _tf1_iterators

        if replication_mode is None:
            replication_mode = _input_lib.InputReplicationMode.PER_WORKER
        return _tf1_iterators.InputFunctionIterator(input_fn, self, replication_mode)

    def update_config_proto(self, config_proto: _T) -> _T:
        """Returns a copy of ``config_proto`` (nothing to configure here; TF1-era)."""
        _warn_deprecated("update_config_proto", "nothing (there is no session config)")
        import copy

        return copy.deepcopy(config_proto)


# ---------------------------------------------------------------------------------------------- default
class _DefaultDistributionExtended(StrategyExtended):
    """The default strategy's extended: one replica, no distribution."""

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Unsupported, as in TF (the default strategy places nothing)."""
        raise RuntimeError("worker_devices() method unsupported by default cudist.Strategy.")

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Unsupported, as in TF (the default strategy places nothing)."""
        raise RuntimeError("parameter_devices() method unsupported by default cudist.Strategy.")

    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """As TF's default strategy (and OneDeviceStrategy): the value function's plain result."""
        from cudist import _input_lib

        return _input_lib.distribute_values_from_function(value_fn, self._container_strategy_ref, wrap_single=False)

    def call_for_each_replica(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = _check_run_arguments(args, kwargs)
        f = _CTX.get()
        if f is not None and f.replica_ctx is not None:
            raise RuntimeError("strategy.run cannot be called inside strategy.run (in replica context)")
        return fn(*args, **(kwargs or {}))


class _DefaultDistributionStrategy(Strategy):
    """The strategy in effect outside any scope: runs everything on one device, unchanged."""

    def __init__(self) -> None:
        super().__init__(_DefaultDistributionExtended(self, (_devices.canonicalize("/cpu:0"),)))

    def __repr__(self) -> str:
        return "<cudist default Strategy>"


@functools.lru_cache(maxsize=None)
def _default_strategy() -> _DefaultDistributionStrategy:
    return _DefaultDistributionStrategy()


@functools.lru_cache(maxsize=None)
def _default_replica_context() -> _DefaultReplicaContext:
    return _DefaultReplicaContext(_default_strategy(), 0)


def _check_run_arguments(args: Any, kwargs: Any) -> Any:
    """``run``'s checks of ``args`` and ``kwargs`` (before any replica starts); a copy of ``kwargs``.

    Raises:
        ValueError: ``args`` is not a list or tuple (TF's error).
        TypeError: ``kwargs`` is not a mapping, or has a key that is not a string.
    """
    if not isinstance(args, (list, tuple)):
        raise ValueError(f"positional args must be a list or tuple, got {type(args)}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        # (fn(**kwargs) would say "argument after ** must be a mapping"; said here, before any replica starts.)
        raise TypeError(f"strategy.run: kwargs must be a mapping (a dict) or None, got {type(kwargs).__name__}")
    if kwargs:
        kwargs = dict(kwargs)
        bad = [k for k in kwargs if not isinstance(k, str)]
        if bad:
            raise TypeError(f"strategy.run: kwargs keys must be strings (keyword names), got {bad[0]!r}")
    return kwargs


def parse_devices(devices: Sequence[_devices.DeviceLike], where: str) -> tuple[str, ...]:
    """Canonical device names from a list of device specs, rejecting empty lists and duplicates.

    Args:
        devices: a list or tuple of device names (any spelling ``canonicalize`` accepts).
        where: the caller's name, for error messages.

    Raises:
        TypeError: ``devices`` is not a list or tuple.
        ValueError: a single device string (TF 2.21 raises ValueError too), no devices, a duplicate,
            or an invalid device name.
    """
    if isinstance(devices, str):
        raise ValueError(f"{where}: devices must be a list or tuple of device strings, got the string {devices!r}; "
                         f"pass [{devices!r}]")
    if not isinstance(devices, (list, tuple)):
        raise TypeError(f"{where}: devices must be a list or tuple of device strings, got {type(devices).__name__}")
    if not devices:
        raise ValueError(f"{where}: devices must not be empty")
    names = tuple(_devices.canonicalize(d) for d in devices)
    seen: set[str] = set()
    for d, name in zip(devices, names):
        if name in seen:
            raise ValueError(f"{where}: no duplicates allowed in `devices` argument: {d!r} appears more than once")
        seen.add(name)
    return names


def default_devices() -> tuple[str, ...]:
    """All logical GPUs, else the CPU (only called when a strategy is built without devices)."""
    from cudist import config

    gpus = config.list_logical_devices("GPU")
    return tuple(_devices.canonicalize(d.name) for d in gpus) or (_devices.canonicalize("/cpu:0"),)
