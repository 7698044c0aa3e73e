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

__all__ = ["run_replicas", "meet", "ReplicaMismatchError"]

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


def _worker_main(box: list[Any]) -> NoReturn:
    """Body of a pooled replica greenlet: run tasks forever, reporting each outcome to the parent.

    Tasks and outcomes travel in one-element lists (boxes) that the receiver empties, so an idle
    replica holds no reference to the last step's arguments or results (on a GPU: device memory).
    A ``GreenletExit`` raised by the replica function is an error of that replica like any other;
    only one thrown at the idle switch (the pool being discarded) ends the greenlet.
    """
    while True:
        frame, fn, args, kwargs = box.pop()
        token = _CTX.set(frame)
        try:
            out = [fn(*args, **kwargs)]
            kind = _DONE
        except _Abort:
            out, kind = [None], _ABORTED
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
            out, kind = [e], _ERROR
        finally:
            _CTX.reset(token)
        del frame, fn, args, kwargs
        box = greenlet.getcurrent().parent.switch((kind, out))
        del out


class _Pool:
    """N long-lived replica greenlets of one thread.

    ``clean`` is True only while every worker is known to sit idle at its task switch; a ``run``
    that ends any other way (an interrupt at an unlucky moment, a replica that would not unwind)
    leaves it False, and the next ``run`` throws the pool away instead of trusting it.
    """

    __slots__ = ("workers", "busy", "clean")

    def __init__(self, n: int) -> None:
        self.workers: list[Any] = [greenlet.greenlet(_worker_main) for _ in range(n)]  # greenlets
        self.busy = False
        self.clean = True


_local = threading.local()


def _get_pool(n: int) -> _Pool:
    pools: dict[int, _Pool] | None = getattr(_local, "pools", None)
    if pools is None:
        pools = _local.pools = {}
    pool = pools.get(n)
    if pool is not None and not pool.busy and not pool.clean:
        _kill(pool.workers)  # left in an unknown state by an interrupted run: never reused
        del pools[n]
        pool = None
    if pool is None or pool.busy:
        # A busy pool means run() is being called again while one is in progress on this thread
        # (e.g. from a merge_call function); that call gets a pool of its own.
        pool = _Pool(n)
        if n not in pools:
            pools[n] = pool
    return pool


def _kill(workers: Sequence[Any]) -> None:
    """Ends greenlets of a discarded pool, unwinding any replica function still suspended in them."""
    for g in workers:
        for _ in range(4):
            if g.dead:
                break
            try:
                g.throw(_Abort())  # inside fn: unwinds it (-> _ABORTED); at the idle switch: ends it
            except _Abort:
                pass
            except BaseException:  # noqa: BLE001 - a replica that raised while unwinding: it is dead now
                pass


def meet(kind: str, payload: Any) -> Any:
    """Called by a replica (in its greenlet) at a collective: hands ``payload`` to the caller of
    ``run``, which performs the collective once every replica is there; returns this replica's result."""
    return greenlet.getcurrent().parent.switch((kind, [payload]))


def _throw_abort(g: Any) -> _Event:
    kind, out = g.throw(_Abort())
    return (kind, out.pop())


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
            ev = _throw_abort(g)
            if ev[0] in (_DONE, _ERROR, _ABORTED):
                break
        else:
            ok = False
        events[i] = ev
    return ok


def _note(exc: BaseException, text: str) -> None:
    """Adds ``text`` to the exception's notes once (a re-raised exception object must not pile them up)."""
    if sys.version_info >= (3, 11) and text not in getattr(exc, "__notes__", ()):
        exc.add_note(text)


def run_replicas(
    n: int,
    frames: Sequence[Frame],
    fn: Callable[..., Any],
    args_list: Sequence[Sequence[Any]],
    kwargs_list: Sequence[Mapping[str, Any]],
    handlers: Handlers,
) -> list[Any]:
    """Runs ``fn`` once per replica in the current thread's greenlet pool.

    A failed step follows TF's rule: every replica runs (as TF's replica threads do) until it
    returns, raises, or reaches a collective that can no longer complete; those are then unwound,
    and the error of the lowest-numbered failing replica propagates. So each replica's local work
    up to that point (e.g. writes to its own component of a variable with aggregation NONE) is
    done, on every replica alike.

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
    pool.clean = False  # until every worker is back at its idle switch
    events: list[Any] = [None] * n  # per replica its last _Event (None: not started); checked by kind
    try:
        for i, g in enumerate(workers):
            kind, out = g.switch([(frames[i], fn, args_list[i], kwargs_list[i])])
            events[i] = (kind, out.pop())
        while True:
            kinds = [ev[0] for ev in events]
            first = kinds[0]
            same = kinds.count(first) == n
            if same and first == _DONE:
                pool.clean = True
                return [ev[1] for ev in events]
            if _ERROR in kinds:
                err = kinds.index(_ERROR)
                exc = events[err][1]
                events[err] = (_ERROR, None)
                if _abort(workers, events):
                    pool.clean = True
                _note(exc, f"(raised in replica {err} of {n})")
                raise exc
            if not same:
                groups: dict[str, list[int]] = {}
                for i, ev in enumerate(events):
                    groups.setdefault(_describe(ev), []).append(i)
                desc = "; ".join(
                    f"replica{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))} {what}"
                    for what, ids in groups.items()
                )
                if _abort(workers, events):
                    pool.clean = True
                raise ReplicaMismatchError(
                    f"replicas disagree at the same step: {desc}; every replica must make the same "
                    "collective calls (all_reduce, all_gather, merge_call) in the same order"
                )
            payloads = [ev[1] for ev in events]
            events = [(first, None)] * n  # the payloads are the handler's now
            try:
                results = handlers[first](payloads)
            except BaseException:
                events = [(first, None)] * n
                if _abort(workers, events):
                    pool.clean = True
                raise
            del payloads
            # Every replica gets its result and runs on, even after another one raised (TF's rule).
            for i, g in enumerate(workers):
                kind, out = g.switch(results[i])
                events[i] = (kind, out.pop())
            del results
    finally:
        pool.busy = False
