"""The BLAS thread pools loaded in this process, and how many threads they may use.

When the replicas of a ``run`` compute on threads of their own (see :mod:`cudist._replica_engine`),
a multi-threaded BLAS in every replica oversubscribes the cores: measured on 2 cores, two replica
threads doing the MLP benchmark's matmuls took 5.7 ms with OpenBLAS's 2 threads each, against
3.5 ms with 1 thread each and 4.0 ms one replica after the other. So while the N replicas of a CPU
``run`` compute, the BLAS gets ``max(1, its threads // N)`` threads per replica.

That count is the same in every replica execution mode (greenlets too), because OpenBLAS's results
depend on its thread count: a float32 ``(128, 784) @ (784, 512)`` differs in its last bits between
1 and 2 threads (OpenBLAS 0.3.31 of NumPy 2.4.6), and an adaptive optimizer turns such bits into visible differences.
One count for all modes keeps a program's bits independent of the mode and of ``auto``'s choice.

Found by looking at the shared libraries the process has mapped (``/proc/self/maps``, Linux) and
asking ctypes for their thread-control symbols, once, on first use:

* OpenBLAS (NumPy's and SciPy's wheels bundle it, with symbols renamed, e.g.
  ``scipy_openblas_set_num_threads64_``): its thread count is process-wide, so :func:`limit` sets it
  while replicas compute and :func:`restore` puts it back: a get and, when the share differs from
  the count, two sets per ``run``. The count is read at every run, never cached, so a program that
  changes it between runs is honoured; the pool is never left limited between runs, where the
  program's own BLAS calls (an evaluation in cross-replica context) would get the share.
  Measured in a no-op-sized ``run`` (256 KiB all-reduce, 4 replicas, loaded 2-core machine):
  ~2 us a run with CDLL calls, declared argument types and a general loop; the single-OpenBLAS
  path with GIL-keeping PyDLL calls takes most of that back (bench/PERFORMANCE.md, issue #27).
  ``openblas_set_num_threads_local`` is no help: in pthreads builds it changes the global count too.
* MKL (conda's NumPy): ``mkl_set_num_threads_local`` is per thread, so each replica thread sets
  its own count once (:func:`per_thread`), and :func:`limit` / :func:`restore` set and reset the
  calling thread's (greenlet replicas compute on it); nothing global changes.

With neither (Apple's Accelerate, BLIS, a platform without ``/proc``), :func:`available` is False:
the engine's ``auto`` mode then keeps the replicas on greenlets (one after the other, each BLAS call
with every core), and the explicit ``threads`` mode runs without limiting anything.

Nothing here is imported or looked up at ``import cudist``; the engine asks on its first threaded run.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["available", "describe", "limit", "restore", "per_thread"]

#: Name variants of OpenBLAS's entry points: plain, and the renamed ones of the scipy-openblas
#: wheels NumPy and SciPy bundle (a prefix, and a suffix for the 64-bit-integer build).
_OPENBLAS_PREFIXES = ("", "scipy_")
_OPENBLAS_SUFFIXES = ("", "64_", "_64")


class _Found:
    """What :func:`_lookup` found: per OpenBLAS library its (set, get) functions; MKL's per-thread setter."""

    def __init__(self) -> None:
        self.openblas: list[tuple[str, Any, Any]] = []  # (path, set_num_threads, get_num_threads)
        self.mkl: tuple[str, Any, Any] | None = None  # (path, set_num_threads_local, get_max_threads)
        #: (set, get) of the only BLAS when it is one OpenBLAS (NumPy's wheel): :func:`limit` and
        #: :func:`restore` run on every ``run``, and their general loops cost ~2 us a pair more.
        self.one: tuple[Any, Any] | None = None


_found: _Found | None = None
_lookup_lock = threading.Lock()
#: Guards the process-wide OpenBLAS count: ``_users`` threaded phases are computing now (possibly of
#: runs on several caller threads); the count is limited while there is one and ``_saved`` holds the
#: counts to restore.
_count_lock = threading.Lock()
_users = 0
_saved: list[int] = []
#: The one OpenBLAS's count to put back when the last user restores (0: :func:`limit` left it as it was).
_restore_one = 0


class _MklLocal(threading.local):
    """Per thread: MKL's local thread counts :func:`limit` replaced (a stack: runs nest)."""

    def __init__(self) -> None:
        self.saved: list[int] = []


_mkl_local = _MklLocal()


def _loaded_libraries() -> list[str]:
    """Paths of the shared libraries mapped into this process (Linux; elsewhere none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return []
    paths: dict[str, None] = {}
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and ".so" in parts[5]:
            paths[parts[5].strip()] = None
    return list(paths)


def _after_fork_in_child() -> None:
    # A lock another thread held at fork() would never be released in the child.
    global _count_lock, _users
    _count_lock = threading.Lock()
    _users = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _symbol(lib: Any, names: list[str], argtypes: list[Any] | None, restype: Any) -> Any:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = restype
            return fn
    return None


def _lookup() -> _Found:
    global _found
    if _found is not None:
        return _found
    with _lookup_lock:
        if _found is not None:
            return _found
        import ctypes  # here, not at import: nothing of this runs unless replicas use threads

        found = _Found()
        for path in _loaded_libraries():
            base = path.rsplit("/", 1)[-1].lower()
            if "openblas" in base:
                try:
                    # PyDLL: its calls keep the GIL, where CDLL's release and retake it around each
                    # call; OpenBLAS's get and set only read or write its count (set starts threads
                    # when it grows past the pool), and they run twice on every ``run``.
                    lib: ctypes.CDLL = ctypes.PyDLL(path)
                except OSError:
                    continue
                names = [f"{p}openblas_{{}}{s}" for p in _OPENBLAS_PREFIXES for s in _OPENBLAS_SUFFIXES]
                # No argtypes: ctypes then passes the Python int as a C int itself, where a declared
                # c_int argument costs ~0.4 us a call in its conversion (two calls on every run).
                set_fn = _symbol(lib, [n.format("set_num_threads") for n in names], None, None)
                get_fn = _symbol(lib, [n.format("get_num_threads") for n in names], [], ctypes.c_int)
                if set_fn is not None and get_fn is not None:
                    found.openblas.append((path, set_fn, get_fn))
            elif base.startswith("libmkl_rt") and found.mkl is None:
                try:
                    lib = ctypes.CDLL(path)
                except OSError:
                    continue
                set_fn = _symbol(lib, ["mkl_set_num_threads_local", "MKL_Set_Num_Threads_Local"], [ctypes.c_int], ctypes.c_int)
                get_fn = _symbol(lib, ["mkl_get_max_threads", "MKL_Get_Max_Threads"], [], ctypes.c_int)
                if set_fn is not None and get_fn is not None:
                    found.mkl = (path, set_fn, get_fn)
        if len(found.openblas) == 1 and found.mkl is None:
            found.one = found.openblas[0][1:]
        _found = found
        return found


def available() -> bool:
    """Whether a BLAS whose threads can be limited is loaded (OpenBLAS or MKL)."""
    f = _lookup()
    return bool(f.openblas) or f.mkl is not None


def describe() -> str:
    """The BLAS libraries found and how they are controlled, for messages and benchmarks."""
    f = _lookup()
    parts = [f"OpenBLAS {p.rsplit('/', 1)[-1]} ({g()} threads, process-wide)" for p, _, g in f.openblas]
    if f.mkl is not None:
        parts.append(f"MKL {f.mkl[0].rsplit('/', 1)[-1]} ({f.mkl[2]()} threads, per thread)")
    return "; ".join(parts) if parts else "no controllable BLAS found (OpenBLAS or MKL)"


def limit(n: int) -> None:
    """Limits every process-wide BLAS pool to ``max(1, threads // n)`` threads (n replicas compute).

    Calls nest and may come from several threads: the first one limits, the matching last
    :func:`restore` puts the counts back. The count to limit is read from the BLAS at every first
    call, never cached: a program that sets the count itself between runs (``threadpoolctl``,
    ``openblas_set_num_threads``) gets its count shared out and back.
    """
    global _users, _restore_one
    f = _found if _found is not None else _lookup()
    one = f.one
    if one is not None:  # the usual case, on every run: one OpenBLAS, nothing else
        with _count_lock:
            _users += 1
            if _users == 1:
                was = one[1]()
                want = was // n or 1
                if want != was:
                    one[0](want)
                    _restore_one = was
                else:
                    _restore_one = 0
        return
    if f.mkl is not None:
        _, set_local, get_max = f.mkl
        _mkl_local.saved.append(int(set_local(max(1, int(get_max()) // n))))
    if not f.openblas:
        return
    with _count_lock:
        _users += 1
        if _users == 1:
            _saved[:] = [get() for _, _, get in f.openblas]
            for (_, set_fn, _), was in zip(f.openblas, _saved):
                want = max(1, was // n)
                if want != was:
                    set_fn(want)


def restore() -> None:
    """Undoes one :func:`limit`; the last one puts the saved thread counts back."""
    global _users
    f = _found if _found is not None else _lookup()
    one = f.one
    if one is not None:
        with _count_lock:
            if _users == 0:
                return
            _users -= 1
            if _users == 0 and _restore_one:
                one[0](_restore_one)
        return
    if f.mkl is not None and _mkl_local.saved:
        f.mkl[1](_mkl_local.saved.pop())  # the previous local count (0: MKL's global one)
    if not f.openblas:
        return
    with _count_lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            for (_, set_fn, get), was in zip(f.openblas, _saved):
                if get() != was:
                    set_fn(was)


def per_thread(n: int) -> None:
    """In a replica thread: limits per-thread BLAS pools (MKL) to ``max(1, threads // n)`` for this thread."""
    f = _lookup()
    if f.mkl is not None:
        _, set_local, get_max = f.mkl
        set_local(max(1, int(get_max()) // n))
