"""Fake ``cupyx``: pinned host arrays (NumPy arrays in page-locked memory every device can reach)."""

from __future__ import annotations

import numpy as _np



def empty_pinned(shape, dtype=float, order="C"):
    """A NumPy array in pinned memory from the pinned pool; the array owns it (as in CuPy)."""
    from cupy.cuda import alloc_pinned_memory

    dtype = _np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, _np.integer)) else tuple(int(s) for s in shape)
    nbytes = int(_np.prod(shape, dtype=_np.int64)) * dtype.itemsize
    if nbytes == 0:
        return _np.empty(shape, dtype, order=order)
    mem = alloc_pinned_memory(nbytes)
    return _np.ndarray(shape, dtype, buffer=mem, order=order)


def zeros_pinned(shape, dtype=float, order="C"):
    a = empty_pinned(shape, dtype, order)
    a[...] = 0
    return a


def empty_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return empty_pinned(a.shape if shape is None else shape, a.dtype if dtype is None else dtype,
                        "C" if order in ("K", "A") else order)


def zeros_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    out = empty_like_pinned(a, dtype, order, subok, shape)
    out[...] = 0
    return out
