"""Distributed values: one value per replica (``PerReplica``) or one mirrored value (``Mirrored``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeGuard

import numpy as np
import optree

__all__ = [
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "regroup",
    "select_replica",
    "select_replicas",
    "select_replicas_exact",
    "is_distributed",
    "stays_in_replica",
]


class DistributedValues:
    """Base class of values that have one component per replica.

    Use ``strategy.experimental_local_results(v)`` to get the components; ``.values`` holds them too.
    """

    #: Distributed variables resolve themselves to the local component inside ``run``;
    #: ``select_replica`` leaves objects with this flag set untouched.
    _keep_in_replica = False

    def __init__(self, values: Iterable[Any]) -> None:
        self._values: tuple[Any, ...] = tuple(values)
        if not self._values:
            raise ValueError(f"{type(self).__name__} needs at least one component")

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-replica components, in replica order."""
        return self._values

    def _get_replica(self, replica_id: int) -> Any:
        return self._values[replica_id]

    @property
    def _primary(self) -> Any:
        return self._values[0]

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    __str__ = __repr__


class PerReplica(DistributedValues):
    """Holds a (possibly different) value for each replica."""


class Mirrored(DistributedValues):
    """Holds the same value on every replica; the components are copies, one per device."""


def is_distributed(x: object) -> TypeGuard[DistributedValues]:
    """Whether ``x`` is a :class:`DistributedValues` (a per-replica value, a mirrored value or variable)."""
    return isinstance(x, DistributedValues)


def _is_leaf_dv(x: object) -> bool:
    return isinstance(x, DistributedValues)


def select_replicas(n: int, structured: Any) -> list[Any]:
    """``[select_replica(i, structured) for i in range(n)]``, in one pass over the structure.

    Raises:
        IndexError: a DistributedValues leaf has fewer than ``n`` components.
    """
    if type(structured) is tuple:
        per_replica = _select_sequence(n, structured)
        if per_replica is not None:
            return per_replica
    elif structured is None or type(structured) is np.ndarray:
        return [structured] * n  # e.g. what a merge_call function returns: nothing, or one array
    return [select_replica(i, structured) for i in range(n)]


def select_replicas_exact(n: int, args: tuple[Any, ...]) -> list[Any] | None:
    """``select_replicas(n, args)`` of ``strategy.run``'s usual arguments -- arrays, DistributedValues
    of exactly ``n`` components (or kept whole, as variables are) and lists and tuples of them --
    in one pass; None, selecting nothing, for anything else or another component count (the caller
    then checks the counts and selects the general way)."""
    return _select_sequence(n, args, exact=True)


def _select_sequence(n: int, x: list[Any] | tuple[Any, ...], exact: bool = False) -> list[Any] | None:
    """``select_replicas`` of a list or tuple of arrays, DistributedValues, and lists and tuples of
    them (nested): run()'s common arguments (a step's inputs, a list of per-replica gradients),
    without the tree walk. Every replica gets containers of its own. None when anything else is
    in them (with ``exact``, also a DistributedValues of other than ``n`` components)."""
    cols: list[Sequence[Any]] = []
    for item in x:
        t = type(item)
        if t is np.ndarray:
            cols.append((item,) * n)
        elif t is PerReplica and len(item._values) == n:
            cols.append(item._values)
        elif isinstance(item, DistributedValues):
            if item._keep_in_replica:
                cols.append((item,) * n)
            elif exact and len(item.values) != n:
                return None
            else:
                cols.append([item._get_replica(i) for i in range(n)])
        elif t is list or t is tuple:
            col = _select_sequence(n, item, exact)
            if col is None:
                return None
            cols.append(col)
        else:
            return None
    tx = type(x)
    if not cols:
        return [tx() for _ in range(n)]
    return [tx(row) for row in zip(*cols)]


def stays_in_replica(value: DistributedValues) -> bool:
    """Whether ``value`` goes whole into each replica of ``run`` (a distributed variable, which picks
    its local component itself) rather than being split into its components."""
    return value._keep_in_replica


def select_replica(replica_id: int, structured: Any) -> Any:
    """Replaces each DistributedValues leaf of ``structured`` by its ``replica_id`` component.

    Distributed variables are kept whole: they pick their local component themselves.
    """

    def pick(x: Any) -> Any:
        if isinstance(x, DistributedValues) and not x._keep_in_replica:
            return x._get_replica(replica_id)
        return x

    if isinstance(structured, DistributedValues):
        return pick(structured)
    if type(structured) is tuple and all(type(x) is np.ndarray or isinstance(x, DistributedValues) for x in structured):
        return tuple(map(pick, structured))  # run()'s common args: arrays and per-replica values, no nesting
    return optree.tree_map(pick, structured, is_leaf=_is_leaf_dv, none_is_leaf=True)


_NOT_SEQUENCES = object()


def _regroup_sequences(replicas: list[Any], wrap_class: type[DistributedValues], always_wrap: bool) -> Any:
    """:func:`regroup` of lists and tuples (nested) of arrays, without the tree walk: a step's
    outputs, merge_call's arguments ``(grads,)``. ``_NOT_SEQUENCES`` when anything else is in them
    (or the replicas' structures differ: the general path then says how)."""
    first = replicas[0]
    t0 = type(first)
    if (t0 is not list and t0 is not tuple) or not all(type(v) is t0 and len(v) == len(first) for v in replicas):
        return _NOT_SEQUENCES
    out = []
    for column in zip(*replicas):
        x = column[0]
        tx = type(x)
        if tx is np.ndarray:
            same = not always_wrap
            for y in column:
                if y is not x:
                    if type(y) is not np.ndarray:
                        return _NOT_SEQUENCES
                    same = False
            out.append(x if same else wrap_class(column))
        elif tx is list or tx is tuple:
            sub = _regroup_sequences(list(column), wrap_class, always_wrap)
            if sub is _NOT_SEQUENCES:
                return _NOT_SEQUENCES
            out.append(sub)
        else:
            return _NOT_SEQUENCES
    return t0(out)


def regroup(
    per_replica_values: Iterable[Any], wrap_class: type[DistributedValues] = PerReplica, always_wrap: bool = False
) -> Any:
    """Merges N per-replica structures into one structure of DistributedValues.

    The structures must match. At each leaf, the same object from every replica stays unwrapped
    (unless ``always_wrap``); otherwise the N leaves become one ``wrap_class``.

    Raises:
        ValueError: the replicas returned structures of different shapes.
    """
    replicas = list(per_replica_values)
    if len(replicas) == 1 and not always_wrap:
        return replicas[0]
    if all(type(v) is dict and not v for v in replicas):
        return {}  # e.g. merge_call's keyword arguments: none from any replica
    seq = _regroup_sequences(replicas, wrap_class, always_wrap)
    if seq is not _NOT_SEQUENCES:
        return seq
    flat: list[list[Any]] = []
    specs: list[optree.PyTreeSpec] = []
    for i, v in enumerate(replicas):
        leaves, spec = optree.tree_flatten(v, is_leaf=_is_leaf_dv, none_is_leaf=True)
        if specs and spec != specs[0]:
            raise ValueError(
                f"replica {i} returned a structure {spec} that differs from replica 0's {specs[0]}; "
                "every replica must return the same nested structure"
            )
        flat.append(leaves)
        specs.append(spec)
    out: list[Any] = []
    for column in zip(*flat):
        first = column[0]
        if not always_wrap and all(x is first for x in column):
            out.append(first)
        else:
            out.append(wrap_class(column))
    return optree.tree_unflatten(specs[0], out)
