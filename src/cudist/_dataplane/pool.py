"""Reusable host buffers for collective results, recycled once the user has dropped them.

A training step all-reduces the same shapes every step. Allocating fresh result arrays each time
costs more than the reduction for large buffers: every new page is faulted in and zero-filled by
the kernel (about 500 minor faults per call at 4 MiB, measured). The pool hands out NumPy arrays
that are views of buffers it owns; a buffer is free again when nothing but the pool refers to it,
which CPython's reference count says exactly (a view, a slice of it or anything built on it keeps
the buffer alive, so a result the user still holds is never overwritten).

One pool per thread (the replicas of a ``run`` share their caller's thread), a few buffers per
byte size; past that, results are allocated fresh, so holding on to many results only costs what it
costs without a pool.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["take", "clear", "stats"]

#: Buffers kept per byte size; results held beyond this many are allocated fresh.
PER_SIZE = 8
#: Buffers smaller than this are allocated fresh: NumPy's small-block cache already reuses them.
MIN_BYTES = 1 << 14

class _Local(threading.local):
    """Per thread: its buffers by byte size (made on the thread's first use, no lookup function)."""

    def __init__(self) -> None:
        self.buffers: dict[int, list[npt.NDArray[np.uint8]]] = {}


_local = _Local()
_getrefcount = sys.getrefcount
_empty = np.empty
_u8 = np.uint8


def _buffers() -> dict[int, list[npt.NDArray[np.uint8]]]:
    return _local.buffers


def take(shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
    """An uninitialized C-contiguous array of ``shape`` and ``dtype``, from the pool when large enough.

    Args:
        shape: the array's shape.
        dtype: its dtype (anything ``np.dtype`` accepts).

    Returns:
        A view of a pooled buffer nobody else holds, or a fresh array (small sizes, or the size's
        buffers all in use).
    """
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    if nbytes < MIN_BYTES:
        return _empty(shape, dtype)
    buffers = _local.buffers
    lst = buffers.get(nbytes)
    if lst is None:
        lst = buffers[nbytes] = []
    for buf in lst:
        if _getrefcount(buf) == 3:  # the list, ``buf`` and getrefcount's argument: nobody else
            v = buf.view(dtype)  # (_typed inlined: every pooled all-reduce result comes through here)
            return v if len(shape) == 1 else v.reshape(shape)
    if len(lst) < PER_SIZE:
        buf = _empty(nbytes, _u8)
        lst.append(buf)
        return _typed(buf, dtype, shape)
    return _empty(shape, dtype)


def _typed(buf: npt.NDArray[np.uint8], dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
    v = buf.view(dtype)
    return v if len(shape) == 1 else v.reshape(shape)  # a 1-d view has the shape already


def clear() -> None:
    """Drops this thread's pooled buffers (results still held by users stay valid)."""
    _buffers().clear()


def stats() -> dict[int, tuple[int, int]]:
    """{byte size: (buffers, buffers in use)} for this thread, for tests and benchmarks."""
    out: dict[int, tuple[int, int]] = {}
    for nbytes, lst in _buffers().items():
        out[nbytes] = (len(lst), sum(1 for b in lst if _getrefcount(b) > 3))
    return out
