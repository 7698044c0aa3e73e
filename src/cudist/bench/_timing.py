"""Timing loops: warm up, then time each iteration separately and keep every sample."""

from __future__ import annotations

import gc
import statistics
import time

__all__ = ["time_calls", "median_us", "minor_faults", "parse_minor_faults"]


def time_calls(fn, iters: int, warmup: int, sync=None, budget_s: float | None = None, min_iters: int = 5) -> list[int]:
    """Calls ``fn`` ``warmup`` times, then ``iters`` times timing each call; returns nanoseconds.

    The garbage collector is paused while timing so a collection does not land inside a sample.
    ``sync`` (for GPU work) is called after each timed call, inside the timed region. With
    ``budget_s``, slow calls get fewer timed iterations (never fewer than ``min_iters``) so that one
    point takes about ``budget_s`` seconds; the estimate is the slowest warm-up call.
    """
    clock = time.perf_counter_ns
    slowest = 0
    for _ in range(warmup):
        t0 = clock()
        fn()
        if sync is not None:
            sync()
        slowest = max(slowest, clock() - t0)
    if sync is not None:
        sync()
    if budget_s is not None and slowest > 0:
        iters = max(min(iters, min_iters), min(iters, int(budget_s * 1e9 / slowest)))
    samples = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(iters):
            t0 = clock()
            fn()
            if sync is not None:
                sync()
            samples.append(clock() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return samples


def median_us(samples_ns) -> float:
    """Median of nanosecond samples, in microseconds."""
    return statistics.median(samples_ns) / 1e3


def minor_faults() -> int | None:
    """Minor page faults of this process so far (``/proc/self/stat`` field 10, all threads), or None.

    A minor fault is a first touch of a page that needs no disk read: allocating a large buffer
    afresh (NumPy's large arrays come from mmap, returned to the OS when freed) costs one fault per
    page on its first write, so faults per call count per-call allocations of big buffers. None where
    the file does not exist (not Linux).
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            return parse_minor_faults(f.read())
    except (OSError, ValueError):
        return None


def parse_minor_faults(stat: bytes) -> int:
    """Field 10 (minflt) of a ``/proc/<pid>/stat`` line.

    Field 2 (the command name) is in parentheses and may itself hold spaces and parentheses, so the
    fields are counted from the last ``)``: the one after it is field 3.

    Raises:
        ValueError: not a stat line.
    """
    try:
        return int(stat[stat.rindex(b")") + 2 :].split()[7])
    except IndexError:
        raise ValueError("not a /proc/<pid>/stat line") from None
