"""The native backend: the C++ kernels of ``<cudist/cudist.hpp>`` through the extension ``cudist._core``.

Multi-threaded over a persistent pool (``cudist._core.set_num_threads``), GIL released for large
buffers, inline on the caller for small ones. Bit-identical to the NumPy reference.
"""

from __future__ import annotations

import numpy as np

from cudist import _core
from cudist._kernels._base import KernelBackend
from cudist._reduce_util import ReduceOp

__all__ = ["NativeBackend", "num_threads", "set_num_threads"]

_SUM, _MEAN = ReduceOp.SUM, ReduceOp.MEAN
_OP_CODES = {_SUM: _core.SUM, _MEAN: _core.MEAN}


def num_threads() -> int:
    """Threads the native kernels use (the calling thread included)."""
    return _core.num_threads()


#: Upper bound on the pool size: more threads than this only thrash (and a huge count would fail
#: late, half-started, with an unclear "Resource temporarily unavailable").
MAX_THREADS = 1024


def set_num_threads(n: int) -> None:
    """Sets the native kernels' thread count (0: all hardware threads).

    Raises:
        ValueError: ``n`` is negative or above :data:`MAX_THREADS`.
    """
    n = int(n)
    if n > MAX_THREADS:
        raise ValueError(f"set_num_threads: n must be <= {MAX_THREADS}, got {n}")
    _core.set_num_threads(n)


class NativeBackend(KernelBackend):
    """C++ kernels: fused, multi-threaded, streaming stores for large buffers."""

    name = "native"

    def all_reduce(self, bufs, op=ReduceOp.SUM):
        # Fast path for the hot call: the extension checks arrays, dtypes, sizes, contiguity and
        # writeability itself in well under a microsecond. Whatever it rejects (or any op given
        # as a string) goes through the base class, which raises the contract's messages.
        if (op is _SUM or op is _MEAN) and type(bufs) in (tuple, list):
            shape = bufs[0].shape if bufs and type(bufs[0]) is np.ndarray else None
            if shape is not None and all(type(b) is np.ndarray and b.shape == shape for b in bufs):
                try:
                    _core.all_reduce(bufs, _OP_CODES[op])
                except (TypeError, ValueError):
                    pass
                else:
                    return tuple(bufs)
        return super().all_reduce(bufs, op)

    def _all_reduce(self, bufs, op):
        _core.all_reduce(bufs, _OP_CODES[op])

    def _reduce_to_one(self, bufs, op, out):
        _core.reduce_to_one(bufs, _OP_CODES[op], out)

    def _broadcast(self, src, dsts):
        _core.broadcast(src, dsts)

    def _all_gather(self, bufs, axis):
        return _core.all_gather(bufs, axis)

    def _assign_add(self, copies, value, negate):
        _core.assign_add(copies, value, negate)

    def _sgd(self, copies, grad, lr):
        _core.sgd(copies, grad, lr)

    def _momentum(self, copies, velocities, grad, lr, momentum, nesterov):
        _core.momentum(copies, velocities, grad, lr, momentum, nesterov)

    def _adam(self, copies, ms, vs, grad, lr_t, beta_1, beta_2, epsilon):
        _core.adam(copies, ms, vs, grad, lr_t, beta_1, beta_2, epsilon)
