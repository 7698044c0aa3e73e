"""The distribution context stack: which strategy is current, and in which context.

A :class:`Frame` is one entry: the current strategy and, in replica context, the replica's
:class:`~cudist.ReplicaContext`. ``CTX`` holds the current frame in a :class:`contextvars.ContextVar`,
so the state is per thread (a new thread starts outside any scope) and per greenlet (greenlet >= 1
gives every greenlet its own context), which is what lets the replica greenlets of
:mod:`cudist._replica_engine` each see their own replica context.

This module sits at the bottom of the strategy layer and imports nothing from cudist: the engine,
the strategies and the variables all read the stack through it, and nothing imports back.
"""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["Frame", "CTX", "COLOCATE", "current_frame"]


class Frame:
    """One entry of the context state: the current strategy and, in replica context, the replica's context.

    Args:
        strategy: the current :class:`cudist.Strategy`.
        replica_ctx: the replica's :class:`cudist.ReplicaContext` inside ``run``; None in
            cross-replica context.
        is_set: whether the frame comes from ``experimental_set_strategy`` (not a ``scope()``).

    ``strategy`` and ``replica_ctx`` are typed ``Any``: this module sits below the strategy layer
    and cannot name its classes (the readers in :mod:`cudist._distribute_lib` give them their types).
    """

    __slots__ = ("strategy", "replica_ctx", "is_set")

    def __init__(self, strategy: Any, replica_ctx: Any = None, is_set: bool = False) -> None:
        self.strategy = strategy
        self.replica_ctx = replica_ctx
        self.is_set = is_set


#: The current :class:`Frame`; None means "outside any scope": the default strategy, in its
#: default replica context.
CTX: contextvars.ContextVar[Frame | None] = contextvars.ContextVar("cudist_distribution_context", default=None)
#: ``(extended, devices)`` while inside ``extended.colocate_vars_with(v)``.
COLOCATE: contextvars.ContextVar[tuple[Any, tuple[str, ...]] | None] = contextvars.ContextVar(
    "cudist_colocate_vars_with", default=None
)

current_frame = CTX.get
