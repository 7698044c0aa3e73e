"""The replica engine: runs a function once per replica; replicas meet at collectives.

Two ways to run the N replicas of a ``run``, one protocol:

* **greenlets** (the default for short steps): each thread keeps a pool of N long-lived greenlets
  that loop forever. The caller switches a task into each replica in turn; a replica runs until it
  returns or reaches a collective, where it switches back to the caller with what it wants. So
  replicas compute one after the other, and a no-op ``run`` on 2 replicas costs ~4 us (to 2
  *fresh* greenlets ~21 us; to 2 persistent threads and back 17-80 us, see below).
* **threads** (CPU replicas only, N >= 2): each thread keeps, per N, a pool of N persistent daemon
  replica threads. The caller hands every replica its task first and then waits for all their
  events, so the replicas' compute overlaps; at a collective each replica thread blocks until the
  caller has run the handler once and hands back its share.

In both modes, while a run of N >= 2 CPU replicas is in progress, the BLAS thread pools NumPy uses
are limited to ``max(1, threads // N)`` (:mod:`cudist._blas`): threads need it (else each replica's
BLAS oversubscribes the cores), and greenlets get the same count because BLAS rounding depends on
it -- so the same program gives the same bits in every mode, whatever ``auto`` picks.

The engine is Python only. A C copy of the greenlet loop (in ``cudist._core`` until issue #25)
saved ~1.4 us per ``run`` (under 0.1% of a training step) but crashed the interpreter on a
non-mapping ``kwargs`` and hit RecursionError with 512 replicas (its relay nested the replicas'
switches); one engine, with every argument checked in Python, was the simpler fix.

Either way, a replica reaches a collective (all_reduce, all_gather, merge_call) through
:func:`meet`, which hands ``(kind, payload)`` to the caller. When every replica is waiting at the
same collective, the caller performs it once (one packed kernel call, with every core: the
replicas are all blocked) and hands each replica its share of the result. Everything that decides
what happens -- the failed-step rule, mismatch errors, notes, aborting and unwinding -- is the one
loop of :func:`run_replicas`; the pools only move messages (:meth:`_Pool.exchange`).

Which mode: ``cudist.config.set_replica_execution("auto" | "greenlets" | "threads")`` (initially
``$CUDIST_REPLICA_EXECUTION``, else ``auto``). GPU replicas and one-replica strategies never use
threads. ``auto`` (:class:`AutoPolicy`) starts every (replica count, step function) on greenlets
and measures the replicas' work per run (the caller's wall time outside the collective handlers);
once that exceeds 1 ms it tries threads, keeps them only if they cut that time by at least 5%
(in either of two blocks of 8 runs), and otherwise goes back to greenlets for a while (longer after
each failed try); on threads it goes back when the work shrinks below half the threshold, gives
threads up once two blocks in a row are slower than greenlets were, and compares the two again
every 1000 runs. Without a BLAS whose threads can be limited (OpenBLAS or MKL), ``auto`` stays on
greenlets.

The decision, measured on the project's 2-core machines (``bench/step_compare.py``, the MLP step
784-512-512-10, global batch 256, momentum 0.9; medians of interleaved rounds, quiet machine):

* a no-op ``run`` on 2 replicas: greenlets ~4.4 us, ``auto`` ~4.7-5.0 us (3.9 us before threads
  existed: the mode lookup and the timing cost ~0.8 us), threads 17-80 us (each handoff wakes
  another CPU: ~40 us when the other vCPU is idle, less when it is busy). So short steps must stay
  on greenlets, and threads only pay for steps of hundreds of microseconds or more; 1 ms leaves
  margin, and the 5% gain check catches work that does not overlap (GIL-bound Python, a BLAS
  whose threads cannot be limited).
* the MLP step, 2 replicas: greenlets 4.8-5.2 ms, threads 4.4-4.9 ms, one device 3.8-4.2 ms
  (threads 1.11-1.16x one device, greenlets 1.22-1.27x). 4 replicas: greenlets 5.9-6.4 ms, threads
  5.8-6.0 ms: 4 replica threads on 2 cores, one BLAS thread each, gain little.
* threads lose when other processes hold cores: with one core busy, 7.2 ms against 5.1 ms on
  greenlets (a replica thread waits for a core at every handoff), and for ~0.1 s after any
  multi-threaded BLAS call (OpenBLAS's idle threads spin). Hence the trial and the rechecks
  rather than a fixed threshold, blocks judged by their low end, and runs not counted for 0.15 s
  after a switch.
* without sharing the BLAS out, threads oversubscribe: 2 replica threads each running a 2-thread
  OpenBLAS on 2 cores made the forward+backward 5.7 ms, against 4.0 ms one after the other and
  3.5 ms threaded with 1 BLAS thread each. And a replica thread's malloc arena must not be
  trimmed at every step (see :func:`_keep_thread_arenas`): 808 page faults per step, 5.3 ms.

Errors never hang: if a replica raises, the others -- waiting at a collective or not yet started
-- are unwound by an :class:`_Abort` raised inside them, and the original exception propagates
from ``run``. Replicas that disagree (different collectives, a replica returning while others
wait, or different shapes at the same collective) get an error naming the replicas and what
differed. An interrupt (KeyboardInterrupt) in the caller leaves the pool in an unknown state: it
is never reused. A greenlet pool is unwound at the next ``run``; a thread pool is told at once
(its threads end at their next collective, or when their function returns). Replica threads block
the asynchronous signals (SIGINT, SIGTERM, ...), so Ctrl-C reaches the waiting caller promptly.
"""

from __future__ import annotations

import _thread
import functools
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeAlias

import greenlet  # type: ignore[import-untyped]

from cudist import _blas, config
from cudist._context import CTX as _CTX
from cudist._context import Frame

__all__ = ["run_replicas", "meet", "ReplicaMismatchError", "AutoPolicy"]

_DONE, _ERROR, _ABORTED = "done", "error", "aborted"
#: What a replica reports when it leaves its task (any other event is a collective).
_OUTCOMES = frozenset((_DONE, _ERROR, _ABORTED))
#: What the caller sends a replica: a task to start, a collective's result, or "unwind".
_TASK, _RESULT, _ABORT = 0, 1, 2

#: A replica's task: (frame, fn, args, kwargs).
_Task: TypeAlias = "tuple[Frame, Callable[..., Any], Sequence[Any], Mapping[str, Any]]"
#: What a replica reports: (_DONE, result), (_ERROR, exception), (_ABORTED, None), or, at a
#: collective, (kind, payload).
_Event: TypeAlias = "tuple[str, Any]"
#: ``kind -> handler(payloads) -> per-replica results`` (see :func:`run_replicas`).
Handlers: TypeAlias = "Mapping[str, Callable[[list[Any]], Sequence[Any]]]"

_now = time.perf_counter
_getcurrent = greenlet.getcurrent


class ReplicaMismatchError(RuntimeError):
    """Replicas of one ``run`` made different collective calls."""


class _Abort(BaseException):
    """Raised inside a waiting replica to unwind it (BaseException so ``except Exception`` lets it pass)."""


# ---------------------------------------------------------------------------------------- greenlets
def _greenlet_main(box: list[Any]) -> NoReturn:
    """Body of a pooled replica greenlet: run tasks forever, reporting each outcome to the parent.

    Tasks and outcomes travel in one-element lists (boxes) that the receiver empties, so an idle
    replica holds no reference to the last step's arguments or results (on a GPU: device memory).
    A ``GreenletExit`` raised by the replica function is an error of that replica like any other;
    only one thrown at the idle switch (the pool being discarded) ends the greenlet.
    """
    while True:
        kind, result = _run_task(*box.pop())
        out = [result]
        del result
        box = _getcurrent().parent.switch((kind, out))
        del out


def _run_task(frame: Frame, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> _Event:
    """Runs one replica's task under its context frame (in its greenlet or thread), in both modes:
    ``(_DONE, result)``, ``(_ABORTED, None)`` when unwound, ``(_ERROR, exception)``."""
    token = _CTX.set(frame)
    try:
        return (_DONE, fn(*args, **kwargs) if kwargs else fn(*args))
    except _Abort:
        return (_ABORTED, None)
    except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
        return (_ERROR, e)
    finally:
        _CTX.reset(token)


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


class _Pool:
    """N replicas of one caller thread, and how messages reach them.

    ``clean`` is True only while every replica is known to sit idle, waiting for a task; a ``run``
    that ends any other way (an interrupt at an unlucky moment, a replica that would not unwind)
    leaves it False, and the next ``run`` throws the pool away instead of trusting it.
    """

    __slots__ = ("n", "busy", "clean")
    threaded = False

    def __init__(self, n: int) -> None:
        self.n = n
        self.busy = False
        self.clean = True

    def exchange(self, events: list[Any], op: int, values: Sequence[Any] | None, which: Iterable[int]) -> None:
        """Sends ``(op, values[i])`` to each replica ``i`` in ``which`` and stores its next event in ``events[i]``."""
        raise NotImplementedError

    def abandon(self) -> None:
        """Called at once when a run leaves the pool unclean; must not block."""

    def discard(self) -> None:
        """Ends the replicas of a pool that will never be used again."""


#: A replica greenlet that came back to the caller other than through meet() or by returning.
_SWITCHED_AWAY = (
    "strategy.run: a replica switched greenlets by itself (to its parent) instead of returning or calling a "
    "collective; the run is abandoned"
)


class _GreenletPool(_Pool):
    """N long-lived replica greenlets: an exchange runs each replica in turn until its next event."""

    __slots__ = ("workers",)

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.workers: list[Any] = [greenlet.greenlet(_greenlet_main) for _ in range(n)]

    def exchange(self, events: list[Any], op: int, values: Sequence[Any] | None, which: Iterable[int]) -> None:
        workers = self.workers
        try:
            if op == _RESULT:
                for i in which:
                    kind, out = workers[i].switch(values[i])  # type: ignore[index]  # values given with _RESULT
                    events[i] = (kind, out.pop())
            elif op == _TASK:
                me = _getcurrent()  # the caller: where the replicas switch back to (it may differ per run)
                for i in which:
                    g = workers[i]
                    if g.parent is not me:
                        g.parent = me
                    kind, out = g.switch([values[i]])  # type: ignore[index]  # values given with _TASK
                    events[i] = (kind, out.pop())
            else:
                for i in which:
                    kind, out = workers[i].throw(_Abort())
                    events[i] = (kind, out.pop())
        except (TypeError, ValueError, AttributeError):
            # Not an event (kind, [value]): the replica switched back by itself (the pool is then
            # left unclean and thrown away); what its function raised is never caught here.
            raise RuntimeError(_SWITCHED_AWAY) from None

    def discard(self) -> None:
        _kill(self.workers)


# ---------------------------------------------------------------------------------------- threads
#: Asynchronous signals a replica thread blocks, so the kernel delivers them to the caller.
_ASYNC_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGWINCH")
    if hasattr(signal, name)
)
class _ReplicaThread(threading.local):
    """Per thread: in a replica thread its :class:`_Slot` (how :func:`meet` tells the modes apart).

    The class attribute is the default everywhere else: reading it costs ~40 ns, where
    ``getattr(local, name, None)`` on a missing attribute costs ~300 ns (an AttributeError inside).
    """

    slot: _Slot | None = None


_replica_thread = _ReplicaThread()
#: Seconds between checks for a pending interrupt while the caller waits for replica threads.
_POLL = 0.05
#: Seconds between an idle replica thread's checks that its pool still exists.
_IDLE_CHECK = 1.0


def _park() -> NoReturn:
    """Blocks this (daemon) thread forever: a replica function that catches every unwind gets no more CPU."""
    lock = _thread.allocate_lock()
    lock.acquire()
    lock.acquire()
    raise AssertionError("unreachable")  # pragma: no cover


class _Slot:
    """The mailbox between the caller and one replica thread.

    ``go`` and ``done`` are plain locks used as binary semaphores (the cheapest handoff CPython
    has): the caller writes ``msg`` and releases ``go``; the replica writes ``event`` and releases
    ``done``. Each side empties what it reads, so an idle replica holds nothing of the last step.
    ``abandoned`` (set once, by :meth:`abandon`) makes the replica unwind at its next collective
    and end its thread instead of waiting for more work.
    """

    __slots__ = ("go", "done", "msg", "event", "abandoned", "refusals")

    def __init__(self) -> None:
        self.go = _thread.allocate_lock()
        self.go.acquire()
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.msg: tuple[int, Any] | None = None
        self.event: _Event | None = None
        self.abandoned = False
        self.refusals = 0

    def abandon(self) -> None:
        self.abandoned = True
        try:
            self.go.release()  # wakes the replica wherever it waits; it then sees ``abandoned``
        except RuntimeError:
            pass  # already released: the replica has a wake-up pending and will see ``abandoned``

    def _unwind(self) -> NoReturn:
        """Raises the unwind in an abandoned replica; one that keeps catching it is parked."""
        self.refusals += 1
        if self.refusals > 3:
            _park()
        raise _Abort()

    def meet(self, kind: str, payload: Any) -> Any:
        """In the replica thread: reports a collective and waits for this replica's share."""
        if self.abandoned:
            self._unwind()
        self.event = (kind, payload)
        del payload
        self.done.release()
        self.go.acquire()
        if self.abandoned:
            self._unwind()
        op, value = self.msg  # type: ignore[misc]  # the caller wrote it before releasing ``go``
        self.msg = None
        if op == _ABORT:
            raise _Abort()
        return value


def _thread_main(slot: _Slot, n: int, pool: weakref.ref[_ThreadPool]) -> None:
    """Body of a replica thread: run tasks until the pool is abandoned or gone, reporting each outcome."""
    owes = False  # a message was taken and its event not yet reported
    try:
        _replica_thread.slot = slot  # (asynchronous signals are blocked: the mask of the pool's creator)
        _blas.per_thread(n)
        go, done = slot.go, slot.done
        while True:
            # Idle: a pool nobody holds any more (its caller thread ended, or its construction was
            # interrupted) is noticed here, rather than by a finalizer in the caller: Python code
            # run from __del__ swallows a Ctrl-C that lands in it.
            while not go.acquire(True, _IDLE_CHECK):
                if pool() is None:
                    return
            if slot.abandoned:
                return
            owes = True
            op, task = slot.msg  # type: ignore[misc]  # the caller wrote it before releasing ``go``
            slot.msg = None
            if op != _TASK:  # an unwind for a replica that is not running: nothing to unwind
                slot.event = (_ABORTED, None)
            else:
                slot.event = _run_task(*task)
            del task
            owes = False
            done.release()
            if slot.abandoned:
                return
    except BaseException as e:  # noqa: BLE001 - the thread's own machinery failed: never leave the caller waiting
        if owes:
            slot.event = (_ERROR, RuntimeError(f"a cudist replica thread failed: {e!r}"))
            done.release()


_malloc_ready = False


def _keep_thread_arenas() -> None:
    """Once per process, before the first replica threads start: frees one 16 MiB malloc block.

    glibc's malloc gives each thread an arena of its own and hands the free top of a thread's
    arena back to the OS (``MADV_DONTNEED``) once it exceeds the trim threshold, twice the mmap
    threshold; both start at 128 KiB and rise (to at most 32 MiB) when the program frees a block
    that big. A replica thread frees all of its step's temporaries at the end of the step, so with
    the thresholds low its arena is trimmed every step and the next step faults every page in
    again: measured on the MLP benchmark's step (2 replicas, a fresh process), 808 minor faults and
    5.3 ms per step, against 0 faults and 4.3 ms once a large block had been freed (replicas on
    greenlets share the main arena and did not fault either way). Freeing a 16 MiB block is what
    any NumPy program that drops a 16 MiB array does; glibc then keeps up to 32 MiB of free memory
    per arena instead of returning it. Elsewhere than glibc (or with ``MALLOC_MMAP_THRESHOLD_`` set,
    which fixes the thresholds) this changes nothing.
    """
    global _malloc_ready
    if _malloc_ready:
        return
    _malloc_ready = True
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: others manage thread memory otherwise
        malloc, free = libc.malloc, libc.free
    except (OSError, AttributeError):
        return
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    block = malloc(16 << 20)
    if block:
        free(block)


class _ThreadPool(_Pool):
    """N persistent replica threads: an exchange hands every replica its message, then waits for all."""

    __slots__ = ("slots", "__weakref__")
    threaded = True

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.slots: list[_Slot] = []
        _keep_thread_arenas()
        # Threads inherit the signal mask: asynchronous signals are blocked while they start, so a
        # Ctrl-C never lands in a replica thread (it goes to the caller, waiting interruptibly).
        masked = hasattr(signal, "pthread_sigmask")
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS) if masked else None
        try:
            for _ in range(n):
                slot = _Slot()
                # Listed before its thread starts: whatever interrupts this loop, abandon() reaches
                # every thread started. _thread, not threading.Thread: start() waits on Python-level
                # locks that an interrupt can leave broken ("release unlocked lock").
                self.slots.append(slot)
                _thread.start_new_thread(_thread_main, (slot, n, weakref.ref(self)))
        except BaseException:
            self.abandon()
            raise
        finally:
            if masked:
                try:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)  # type: ignore[arg-type]  # set when masked
                except BaseException:  # a held-back interrupt, raised here: no one will use these threads
                    self.abandon()
                    raise

    def exchange(self, events: list[Any], op: int, values: Sequence[Any] | None, which: Iterable[int]) -> None:
        slots = self.slots
        which = list(which)
        for i in which:
            s = slots[i]
            s.msg = (op, None if values is None else values[i])
            s.go.release()
        for i in which:
            s = slots[i]
            # Interruptible: Ctrl-C raises here, and the run leaves the pool unclean. In steps
            # of _POLL, because a signal that lands after CPython released the GIL but before
            # it blocked in sem_wait is handled without waking the wait (seen 1 time in 8 in
            # tests); the timeout bounds that delay.
            while not s.done.acquire(True, _POLL):
                pass
            events[i] = s.event
            s.event = None

    def abandon(self) -> None:
        for s in getattr(self, "slots", ()):  # (none if the pool's construction was interrupted)
            if not s.abandoned:
                s.abandon()

    discard = abandon


def meet(kind: str, payload: Any) -> Any:
    """Called by a replica at a collective: hands ``payload`` to the caller of ``run``, which
    performs the collective once every replica is there; returns this replica's result."""
    slot = _replica_thread.slot
    if slot is not None:
        return slot.meet(kind, payload)
    return _getcurrent().parent.switch((kind, [payload]))


# ---------------------------------------------------------------------------------------- choosing
class AutoPolicy:
    """The ``auto`` choice for one (replica count, function), by measured replica work per run.

    ``observe(seconds)`` takes one clean run's replica work (the caller's wall time outside the
    collective handlers) and updates :attr:`threaded`, the mode of the next run. Runs are judged
    in blocks of :attr:`BLOCK`, by each block's second-smallest time: noise only ever adds time,
    and another process's burst (OpenBLAS threads of a neighbour spin for ~0.1 s after each call)
    spoils a mean or even a median of a block, rarely its low end.

    * On greenlets, once a block's estimate exceeds :attr:`UP` (and threads are possible), try
      threads for up to :attr:`TRIAL_BLOCKS` blocks, remembering the greenlet estimate.
    * Keep threads as soon as a trial block takes at most :attr:`GAIN` times the greenlet time; if
      none does, go back to greenlets for :attr:`PIN` runs, doubled after each failed try (up to
      :attr:`MAX_PIN`).
    * On threads, give up the same way once :attr:`STRIKES` blocks in a row take longer than
      greenlets did (the machine got busy: threads lose when other processes hold cores, see the
      module docstring); go back (not pinned) when the work, scaled to what it would be one replica
      after the other, falls below half of :attr:`UP`; and after :attr:`RECHECK` runs, measure
      greenlets and try threads again, since which is faster changes with the load.

    One block decided each of these before, and a single noisy block (the first steps after the
    process sat idle, a neighbour's burst) then cost hundreds of runs on the slower mode: in
    ``bench/step_compare.py`` (turns of a few dozen steps with 1 s pauses between them), ``auto``
    gave threads up in 2 of 3 runs, for a 2-replica MLP step of 4.75-4.99 ms against 4.26-4.49 ms
    with threads forced.

    The first run of a function and after each switch is not counted (first-call compiles, thread
    start); after a switch to threads, runs are not counted until :attr:`SETTLE` seconds of them
    have passed: the BLAS threads of the greenlet runs before spin for ~0.1 s after their last call
    and would make threads look slow (measured: a 4.4 ms threaded step took 6-7 ms for the first
    ~15 runs after greenlets).
    """

    #: Seconds of replica work per run (one replica after the other) above which threads are tried.
    UP = 1e-3
    #: Runs per judgement.
    BLOCK = 8
    #: Seconds of runs not counted after a switch to threads.
    SETTLE = 0.15
    #: Threads are kept when they take at most this fraction of the greenlet time. 0.9 lost the MLP
    #: step's threads (2 replicas: 4.27 ms on threads, 4.72 ms on greenlets) to noise now and then.
    GAIN = 0.95
    #: Runs on greenlets after a failed try of threads (doubled after each, up to MAX_PIN).
    PIN = 200
    MAX_PIN = 12_800
    #: Runs on threads between two comparisons with greenlets.
    RECHECK = 1000
    #: Blocks a trial of threads may take to show the gain.
    TRIAL_BLOCKS = 2
    #: Blocks in a row that kept threads must lose to greenlets' time before they are given up.
    STRIKES = 2

    __slots__ = (
        "threaded", "first", "settling", "seen", "low", "low2", "reference", "ratio", "pinned", "backoff", "can_thread",
        "trial_left", "strikes",
    )

    def __init__(self, can_thread: Callable[[], bool] = _blas.available) -> None:
        self.threaded = False
        self.first = True  # the next run is the first since the start or a switch: not counted
        self.settling = 0.0  # seconds of runs still to skip after a switch to threads
        self.seen = 0  # runs counted since the last switch
        self.low = self.low2 = float("inf")  # the block's two smallest times so far
        self.reference = 0.0  # greenlet estimate when threads were tried
        self.ratio = 0.0  # threads' estimate / greenlets' estimate, once threads are kept (0: on trial)
        self.pinned = 0
        self.backoff = self.PIN
        self.can_thread = can_thread
        self.trial_left = 0  # trial blocks still to judge (on trial)
        self.strikes = 0  # blocks in a row that kept threads lost

    def _switch(self, threaded: bool) -> None:
        self.threaded = threaded
        self.first = True
        self.settling = self.SETTLE if threaded else 0.0
        self.seen = 0
        self.low = self.low2 = float("inf")

    def _give_up(self) -> None:
        self.pinned, self.backoff = self.backoff, min(self.backoff * 2, self.MAX_PIN)
        self._switch(False)

    def observe(self, seconds: float) -> None:
        """Records one clean run's replica work and decides the next run's mode."""
        if self.pinned and not self.threaded:
            self.pinned -= 1
            return
        if self.first or self.settling > 0:
            self.first = False
            self.settling -= seconds
            return
        self.seen += 1
        if seconds < self.low:
            self.low, self.low2 = seconds, self.low
        elif seconds < self.low2:
            self.low2 = seconds
        if self.seen % self.BLOCK:
            return
        est = self.low2
        self.low = self.low2 = float("inf")
        if not self.threaded:
            if est > self.UP and self.can_thread():
                self.reference, self.ratio = est, 0.0
                self.trial_left = self.TRIAL_BLOCKS
                self._switch(True)
        elif not self.ratio:  # on trial
            if est <= self.GAIN * self.reference:
                self.ratio, self.backoff, self.strikes = est / self.reference, self.PIN, 0
            else:
                self.trial_left -= 1
                if self.trial_left <= 0:
                    self._give_up()
        elif est > self.reference:
            self.strikes += 1
            if self.strikes >= self.STRIKES:
                self._give_up()
        else:
            self.strikes = 0
            if est / self.ratio < self.UP / 2 or self.seen > self.RECHECK:
                self._switch(False)

    def refuse_threads(self) -> None:
        """Threads could not be started: greenlets from now on."""
        self.can_thread = lambda: False
        self._switch(False)


def _fn_key(fn: Callable[..., Any]) -> Any:
    """What identifies "the same step function" across runs: its code (a new lambda or partial each
    step is still the same step), else its type."""
    f: Any = fn
    while isinstance(f, functools.partial):
        f = f.func
    f = getattr(f, "__func__", f)
    return getattr(f, "__code__", None) or type(f)


class _Local(threading.local):
    """Per caller thread: its replica pools and the ``auto`` statistics."""

    def __init__(self) -> None:
        #: ``(n, threaded) -> pools`` (more than one only while runs nest, e.g. run inside merge_call).
        self.pools: dict[tuple[int, bool], list[_Pool]] = {}
        #: ``(n, code of the step function) -> its AutoPolicy``.
        self.stats: dict[tuple[int, Any], AutoPolicy] = {}


_local = _Local()


def _after_fork_in_child() -> None:
    """In a forked child only the forking thread exists: its replica threads stayed in the parent.

    Every pool is forgotten (greenlet pools too: the child rebuilds what it uses), so the child's
    first run starts threads of its own instead of waiting for ones that are not there.
    """
    global _local, _replica_thread
    _local = _Local()
    _replica_thread = _ReplicaThread()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _policy(n: int, fn: Callable[..., Any]) -> AutoPolicy:
    stats = _local.stats
    try:
        key = (n, fn.__code__)  # a plain function (the usual step)
    except AttributeError:
        key = (n, _fn_key(fn))
    p = stats.get(key)
    if p is None:
        if len(stats) >= 256:  # many distinct step functions: forget them all rather than grow
            stats.clear()
        p = stats[key] = AutoPolicy()
    return p


def _get_pool(n: int, threaded: bool) -> _Pool:
    """An idle, clean pool of this thread for ``n`` replicas of the given kind; a new one if none is.

    A busy pool means run() is being called again while one is in progress on this thread (e.g.
    from a merge_call function); that call gets (and keeps, for the next time) a pool of its own.
    """
    pools = _local.pools
    lst = pools.get((n, threaded))
    if lst is None:
        lst = pools[(n, threaded)] = []
    elif lst and lst[0].clean and not lst[0].busy:  # the usual case: one pool, idle
        return lst[0]
    for pool in lst:
        if pool.clean and not pool.busy:
            return pool
    for pool in [p for p in lst if not p.busy]:
        # Left in an unknown state by an interrupted run: never reused. Forgotten only once its
        # replicas are ended (an interrupt meanwhile leaves it listed, to be ended next time).
        pool.discard()
        lst.remove(pool)
    pool = _ThreadPool(n) if threaded else _GreenletPool(n)
    lst.append(pool)
    return pool


# ---------------------------------------------------------------------------------------- the protocol
def _describe(ev: _Event) -> str:
    kind = ev[0]
    if kind == _DONE:
        return "returned"
    return f"called {kind}"


def _abort(pool: _Pool, events: list[Any]) -> bool:
    """Unwinds every replica waiting at a collective. Returns False if one refused to unwind."""
    for _ in range(3):  # a replica that catches the release and waits again gets it again
        waiting = [i for i, ev in enumerate(events) if ev is not None and ev[0] not in (_DONE, _ERROR, _ABORTED)]
        if not waiting:
            return True
        pool.exchange(events, _ABORT, None, waiting)
    return all(ev is None or ev[0] in (_DONE, _ERROR, _ABORTED) for ev in events)


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
    *,
    cpu: bool = False,
) -> list[Any]:
    """Runs ``fn`` once per replica on the current thread's replica pool (greenlets or threads).

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
        cpu: every replica is a CPU device, so replica threads may be used (see the module
            docstring for how the mode is chosen).

    Returns:
        The list of per-replica return values.
    """
    policy = None
    threaded = False
    if cpu:
        mode = config.get_replica_execution()
        if mode == "auto":
            try:  # (_policy's lookup of a plain function inlined: it runs on every run)
                policy = _local.stats[(n, fn.__code__)]
            except (AttributeError, KeyError):
                policy = _policy(n, fn)
            threaded = policy.threaded
        else:
            threaded = mode == "threads"
        # The determinism contract: the replicas' BLAS thread count is max(1, threads // n) for the
        # whole run (collective handlers and merge_call functions included) in every mode, since
        # OpenBLAS's rounding depends on its thread count (see cudist._blas); so the mode, and auto's
        # choice by measured time, never change a program's bits.
        _blas.limit(n)
    # One function, not a wrapper around the pool loop: a Python call is ~2% of a no-op ``run``.
    try:
        try:
            pool = _get_pool(n, threaded)
        except RuntimeError:  # no thread could be started ("can't start new thread")
            if policy is None:
                raise
            policy.refuse_threads()
            pool = _get_pool(n, False)
        events: list[Any] = [None] * n  # per replica its last _Event (None: not started); checked by kind
        everyone = range(n)
        try:
            # Inside the try: an interrupt anywhere after it must not leave the pool marked busy for ever.
            pool.busy = True
            pool.clean = False  # until every replica is back, idle
            t0 = _now()
            pool.exchange(events, _TASK, [*zip(frames, [fn] * n, args_list, kwargs_list)], everyone)
            work = _now() - t0
            while True:
                kinds = [ev[0] for ev in events]
                first = kinds[0]
                same = kinds.count(first) == n
                if same and first not in _OUTCOMES:
                    # Every replica waits at the same collective (the common case): perform it once.
                    payloads = [ev[1] for ev in events]
                    events = [(first, None)] * n  # the payloads are the handler's now
                    try:
                        results = handlers[first](payloads)
                    except BaseException:
                        if _abort(pool, events):
                            pool.clean = True
                        raise
                    del payloads
                    # Every replica gets its result and runs on, even after another one raised (TF's rule).
                    t0 = _now()
                    pool.exchange(events, _RESULT, results, everyone)
                    work += _now() - t0
                    del results
                    continue
                if same and first == _DONE:
                    pool.clean = True
                    if policy is not None:
                        policy.observe(work)
                    return [ev[1] for ev in events]
                if _ERROR in kinds:
                    err = kinds.index(_ERROR)
                    exc = events[err][1]
                    events[err] = (_ERROR, None)
                    if _abort(pool, events):
                        pool.clean = True
                    _note(exc, f"(raised in replica {err} of {n})")
                    raise exc
                # Replicas that disagree: different collectives, or some returned while others wait.
                groups: dict[str, list[int]] = {}
                for i, ev in enumerate(events):
                    groups.setdefault(_describe(ev), []).append(i)
                desc = "; ".join(
                    f"replica{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))} {what}"
                    for what, ids in groups.items()
                )
                if _abort(pool, events):
                    pool.clean = True
                raise ReplicaMismatchError(
                    f"replicas disagree at the same step: {desc}; every replica must make the same "
                    "collective calls (all_reduce, all_gather, merge_call) in the same order"
                )
        finally:
            pool.busy = False
            if not pool.clean:
                pool.abandon()
    finally:
        if cpu:
            _blas.restore()
