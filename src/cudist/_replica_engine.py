"""The replica engine: runs a function once per replica; replicas meet at collectives.

Why long-lived greenlets: ``strategy.run`` is called once per training step, so its fixed cost
matters. Measured on the project's machines, handing a no-op to 2 persistent worker *threads* and
back costs ~58 us, to 2 *fresh* greenlets ~21 us, and to 2 *long-lived* greenlets ~2.5 us. Threads
would let kernels of different replicas overlap, but every kernel is already multi-threaded on its
own, and a collective needs all replicas anyway. So each thread keeps a pool of N greenlets that
loop forever: the caller switches a task into each replica in turn; a replica runs until it returns
or reaches a collective (all_reduce, all_gather, merge_call), where it switches back to the caller
with what it wants. When every replica is waiting at the same collective, the caller performs it
once (one packed kernel call) and switches each replica its share of the result.

Errors never hang: if a replica raises, the others -- suspended at a collective or not yet started
-- are unwound by throwing :class:`_Abort` into them, and the original exception propagates from
``run``. A replica reaches a collective by switching ``(kind, payload)`` to its parent greenlet
(see ``ReplicaContext._collective``). Replicas that disagree (different collectives, a replica returning while others wait, or
different shapes at the same collective) get an error naming the replicas and what differed.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeAlias

import greenlet  # type: ignore[import-untyped]

from cudist._context import CTX as _CTX
from cudist._context import Frame

__all__ = ["run_replicas", "ReplicaMismatchError"]

_DONE, _ERROR, _ABORTED = "done", "error", "aborted"

#: What a replica greenlet is switched into: (frame, fn, args, kwargs).
_Task: TypeAlias = "tuple[Frame, Callable[..., Any], Sequence[Any], Mapping[str, Any]]"
#: What a replica switches back: (_DONE, result), (_ERROR, exception), (_ABORTED, None), or, at a
#: collective, (kind, payload).
_Event: TypeAlias = "tuple[str, Any]"
#: ``kind -> handler(payloads) -> per-replica results`` (see :func:`run_replicas`).
Handlers: TypeAlias = "Mapping[str, Callable[[list[Any]], Sequence[Any]]]"


class ReplicaMismatchError(RuntimeError):
    """Replicas of one ``run`` made different collective calls."""


class _Abort(BaseException):
    """Thrown into a suspended replica to unwind it (BaseException so ``except Exception`` lets it pass)."""


def _worker_main(task: _Task) -> NoReturn:
    """Body of a pooled replica greenlet: run tasks forever, reporting each outcome to the parent."""
    while True:
        frame, fn, args, kwargs = task
        token = _CTX.set(frame)
        try:
            out = (_DONE, fn(*args, **kwargs))
        except _Abort:
            out = (_ABORTED, None)
        except greenlet.GreenletExit:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
            out = (_ERROR, e)
        finally:
            _CTX.reset(token)
        del frame, fn, args, kwargs
        task = greenlet.getcurrent().parent.switch(out)


class _Pool:
    __slots__ = ("workers", "busy")

    def __init__(self, n: int) -> None:
        self.workers: list[Any] = [greenlet.greenlet(_worker_main) for _ in range(n)]  # greenlets
        self.busy = False


_local = threading.local()


def _get_pool(n: int) -> _Pool:
    pools: dict[int, _Pool] | None = getattr(_local, "pools", None)
    if pools is None:
        pools = _local.pools = {}
    pool = pools.get(n)
    if pool is None or pool.busy:
        # A busy pool means run() is being called again while one is in progress on this thread
        # (e.g. from a merge_call function); that call gets a pool of its own.
        pool = _Pool(n)
        if n not in pools:
            pools[n] = pool
    return pool


def _describe(ev: _Event) -> str:
    kind = ev[0]
    if kind == _DONE:
        return "returned"
    return f"called {kind}"


def _abort(workers: Sequence[Any], events: list[Any]) -> bool:
    """Unwinds every replica suspended at a collective. Returns False if one refused to unwind."""
    ok = True
    for i, g in enumerate(workers):
        if events[i] is None or events[i][0] in (_DONE, _ERROR, _ABORTED):
            continue
        for _ in range(3):  # a replica that catches the release and waits again gets it again
            ev = g.throw(_Abort())
            if ev[0] in (_DONE, _ERROR, _ABORTED):
                break
        else:
            ok = False
        events[i] = ev
    return ok


def run_replicas(
    n: int,
    frames: Sequence[Frame],
    fn: Callable[..., Any],
    args_list: Sequence[Sequence[Any]],
    kwargs_list: Sequence[Mapping[str, Any]],
    handlers: Handlers,
) -> list[Any]:
    """Runs ``fn`` once per replica in the current thread's greenlet pool.

    Args:
        n: number of replicas (>= 2).
        frames: per replica, the context frame the replica runs under.
        fn: the replica function.
        args_list, kwargs_list: per replica, its arguments.
        handlers: ``kind -> handler(payloads) -> per-replica results`` for each collective kind;
            a handler runs in the caller (cross-replica), once per step.

    Returns:
        The list of per-replica return values.
    """
    pool = _get_pool(n)
    workers = pool.workers
    me = greenlet.getcurrent()
    for g in workers:
        if g.parent is not me:
            g.parent = me
    pool.busy = True
    events: list[Any] = [None] * n  # per replica its last _Event (None: not started); checked by kind
    try:
        try:
            for i in range(n):
                events[i] = workers[i].switch((frames[i], fn, args_list[i], kwargs_list[i]))
                if events[i][0] == _ERROR:
                    break  # the replicas after it never start
            while True:
                kinds = [ev[0] if ev is not None else None for ev in events]
                first = kinds[0]
                if first == _DONE and kinds.count(_DONE) == n:
                    return [ev[1] for ev in events]
                if _ERROR in kinds:
                    err = kinds.index(_ERROR)
                    exc = events[err][1]
                    if not _abort(workers, events):
                        _discard(n, pool)
                    if n > 1 and sys.version_info >= (3, 11):
                        exc.add_note(f"(raised in replica {err} of {n})")
                    raise exc
                if any(k != first for k in kinds):
                    groups: dict[str, list[int]] = {}
                    for i, ev in enumerate(events):
                        groups.setdefault(_describe(ev), []).append(i)
                    desc = "; ".join(
                        f"replica{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))} {what}"
                        for what, ids in groups.items()
                    )
                    raise ReplicaMismatchError(
                        f"replicas disagree at the same step: {desc}; every replica must make the same "
                        "collective calls (all_reduce, all_gather, merge_call) in the same order"
                    )
                results = handlers[first]([ev[1] for ev in events])  # type: ignore[index]  # no None: all ran
                for i in range(n):
                    events[i] = workers[i].switch(results[i])
                    if events[i][0] == _ERROR:
                        # The replicas after it still wait at this collective, their results
                        # undelivered: unwind them now; the loop above then raises the error.
                        for k in range(i + 1, n):
                            events[k] = workers[k].throw(_Abort())
                        break
        except BaseException:
            if not _abort(workers, events):
                _discard(n, pool)
            raise
    finally:
        pool.busy = False


def _discard(n: int, pool: _Pool) -> None:
    pools: dict[int, _Pool] = getattr(_local, "pools", {})
    if pools.get(n) is pool:
        del pools[n]

