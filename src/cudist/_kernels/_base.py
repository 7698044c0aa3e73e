"""The kernel contract: one interface, several implementations.

Every backend subclasses :class:`KernelBackend` and implements the ``_``-prefixed hooks. The public
methods here validate arguments once, with errors that name the problem, so the hooks can assume:

* ``bufs`` is a non-empty tuple of arrays of one shape and one supported dtype, C-contiguous;
  buffers that are written are writeable;
* ``op`` is a :class:`~cudist._reduce_util.ReduceOp`.

Semantics every backend must follow bit for bit on the CPU:

* SUM adds in replica order: ``((b0 + b1) + b2) + ...`` elementwise, in the buffers' dtype
  (float16 rounds to float16 after every addition; integers wrap around).
* MEAN is that sum divided by N: true division for floats (not a multiplication by 1/N), truncation
  toward zero for integers (C semantics).
* Mirrored updates read copy 0 (the copies are mirrors, so copy 0 stands for all of them) and write
  every copy. Arithmetic is in the variable dtype, except float16, which computes in float32 and
  rounds on store. Scalar hyper-parameters are converted to that compute type first.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from cudist._reduce_util import ReduceOp

__all__ = ["KernelBackend", "SUPPORTED_DTYPES", "FLOAT_DTYPES", "adam_lr_t"]

SUPPORTED_DTYPES = tuple(np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64"))
FLOAT_DTYPES = tuple(np.dtype(t) for t in ("float16", "float32", "float64"))
_DTYPE_NAMES = ", ".join(d.name for d in SUPPORTED_DTYPES)


def adam_lr_t(lr: float, beta_1: float, beta_2: float, step: int) -> float:
    """Adam's bias-corrected step size for 1-based ``step`` (computed once, in float64)."""
    return lr * math.sqrt(1.0 - beta_2**step) / (1.0 - beta_1**step)


class KernelBackend:
    """Base class of the kernel backends; see the module docstring for the contract."""

    #: Backend name as accepted by ``CUDIST_BACKEND`` and :func:`cudist._kernels.get_backend`.
    name: str = "abstract"
    #: Dtypes this backend computes; a subset of SUPPORTED_DTYPES.
    dtypes: tuple = SUPPORTED_DTYPES
    #: Array module of the buffers this backend takes (numpy, or cupy for the GPU backend).
    xp = np

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._dtype_set = frozenset(cls.dtypes)

    def __repr__(self) -> str:
        return f"<cudist kernel backend {self.name!r}>"

    # ------------------------------------------------------------------ validation
    def _check_array(self, where: str, what: str, a, *, writable: bool):
        if not isinstance(a, self.xp.ndarray):
            raise TypeError(f"{where}: {what} must be a {self.xp.__name__}.ndarray, got {type(a).__name__}")
        dt = a.dtype
        if not dt.isnative:  # ">f4" != "float32", so it would otherwise read as "unsupported dtype float32"
            raise TypeError(
                f"{where}: {what} has dtype {dt.str!r}, which is not in the machine's byte order; "
                f"convert it first with .astype({dt.newbyteorder('=').name!r})"
            )
        if dt not in SUPPORTED_DTYPES:
            raise TypeError(f"{where}: unsupported dtype {dt.name} for {what} (supported: {_DTYPE_NAMES})")
        if dt not in self.dtypes:
            raise TypeError(
                f"{where}: backend {self.name!r} does not support dtype {dt.name} "
                f"(it supports: {', '.join(d.name for d in self.dtypes)})"
            )
        if not a.flags.c_contiguous:
            raise ValueError(f"{where}: {what} is not C-contiguous")
        if writable and not getattr(a.flags, "writeable", True):  # CuPy arrays have no such flag
            raise ValueError(f"{where}: {what} is read-only but is written by this operation")
        return a

    def _check_bufs(self, where: str, bufs, *, writable: bool, what: str = "replica", same_shape: bool = True):
        # Fast path: one loop of cheap checks for the common valid call (a few replicas of small
        # buffers must cost microseconds); any failure falls through to the detailed checks below,
        # which name the problem.
        if type(bufs) in (list, tuple) and bufs:
            nd = self.xp.ndarray
            first = bufs[0]
            if type(first) is nd and first.dtype in self._dtype_set:
                dt, shape = first.dtype, first.shape
                for b in bufs:
                    if type(b) is not nd or b.dtype != dt or (same_shape and b.shape != shape):
                        break
                    f = b.flags
                    if not f.c_contiguous or (writable and not getattr(f, "writeable", True)):
                        break
                else:
                    return tuple(bufs)
        if isinstance(bufs, self.xp.ndarray) or not isinstance(bufs, Sequence):
            raise TypeError(f"{where}: expected a list of {what} arrays, got {type(bufs).__name__}")
        bufs = tuple(bufs)
        if not bufs:
            raise ValueError(f"{where}: expected at least one {what} array, got an empty list")
        first = self._check_array(where, f"{what} 0", bufs[0], writable=writable)
        for i, b in enumerate(bufs[1:], 1):
            self._check_array(where, f"{what} {i}", b, writable=writable)
            if b.dtype != first.dtype:
                raise TypeError(f"{where}: {what} {i} has dtype {b.dtype.name} but {what} 0 has dtype {first.dtype.name}")
            if same_shape and b.shape != first.shape:
                raise ValueError(f"{where}: {what} {i} has shape {b.shape} but {what} 0 has shape {first.shape}")
        return bufs

    def _check_like(self, where: str, what: str, a, ref, *, writable: bool):
        self._check_array(where, what, a, writable=writable)
        if a.dtype != ref.dtype:
            raise TypeError(f"{where}: {what} has dtype {a.dtype.name} but the replicas have dtype {ref.dtype.name}")
        if a.shape != ref.shape:
            raise ValueError(f"{where}: {what} has shape {a.shape} but the replicas have shape {ref.shape}")
        return a

    def _check_float(self, where: str, ref):
        if ref.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{where}: needs a floating-point dtype, got {ref.dtype.name}")

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, bufs, op=ReduceOp.SUM):
        """Reduces N replica buffers elementwise and writes the result into every one of them.

        One fused pass: every input element is read once and every output element written once.

        Args:
            bufs: N same-shape, same-dtype, C-contiguous, writeable arrays.
            op: ReduceOp.SUM or ReduceOp.MEAN (or "sum" / "mean").

        Returns:
            ``bufs`` as a tuple (reduced in place).
        """
        op = ReduceOp.parse(op, where="all_reduce")
        bufs = self._check_bufs("all_reduce", bufs, writable=True)
        if len(bufs) > 1:  # one replica: the sum and the mean are the value itself
            self._all_reduce(bufs, op)
        return bufs

    def reduce_to_one(self, bufs, op=ReduceOp.SUM, out=None):
        """Reduces N replica buffers elementwise into ``out`` (a new array when None).

        ``out`` may be one of ``bufs``. Returns ``out``.
        """
        op = ReduceOp.parse(op, where="reduce_to_one")
        bufs = self._check_bufs("reduce_to_one", bufs, writable=False)
        if out is None:
            out = self.xp.empty_like(bufs[0])
        else:
            self._check_like("reduce_to_one", "out", out, bufs[0], writable=True)
        self._reduce_to_one(bufs, op, out)
        return out

    def broadcast(self, src, dsts):
        """Copies ``src`` into every array of ``dsts`` (same shape and dtype). Returns ``dsts``."""
        dsts = self._check_bufs("broadcast", dsts, writable=True, what="destination")
        self._check_like("broadcast", "src", src, dsts[0], writable=False)
        self._broadcast(src, dsts)
        return dsts

    def all_gather(self, bufs, axis=0):
        """Concatenates the replica buffers along ``axis`` in replica order into a new array.

        The buffers may differ in size along ``axis`` only (partial batches). Negative axes count
        from the end.
        """
        bufs = self._check_bufs("all_gather", bufs, writable=False, same_shape=False)
        ndim = bufs[0].ndim
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
            raise TypeError(f"all_gather: axis must be an int, got {type(axis).__name__}")
        if ndim == 0:
            raise ValueError("all_gather: cannot gather 0-d (scalar) arrays along an axis; give them a dimension first")
        if not -ndim <= axis < ndim:
            raise ValueError(f"all_gather: axis {axis} is out of range for arrays of rank {ndim}")
        axis = int(axis) % ndim
        ref = bufs[0].shape
        for i, b in enumerate(bufs[1:], 1):
            if b.ndim != ndim or any(b.shape[d] != ref[d] for d in range(ndim) if d != axis):
                raise ValueError(
                    f"all_gather: replica {i} has shape {b.shape}, which differs from replica 0's {ref} "
                    f"outside the gather axis {axis}"
                )
        return self._all_gather(bufs, axis)

    def split(self, batch, n):
        """Splits a (nested) batch into ``n`` per-replica pieces along dimension 0, ceil rule.

        See :func:`cudist._kernels._split.split`. On the CPU the pieces are views.
        """
        from cudist._kernels._split import split

        return split(batch, n)

    # ------------------------------------------------------------------ mirrored updates
    def assign(self, copies, value):
        """Writes ``value`` into every copy. Returns ``copies``."""
        copies = self._check_bufs("assign", copies, writable=True, what="copy")
        self._check_like("assign", "value", value, copies[0], writable=False)
        self._broadcast(value, copies)
        return copies

    def assign_add(self, copies, value):
        """Every copy becomes ``copies[0] + value``. Returns ``copies``."""
        copies = self._check_bufs("assign_add", copies, writable=True, what="copy")
        self._check_like("assign_add", "value", value, copies[0], writable=False)
        self._assign_add(copies, value, False)
        return copies

    def assign_sub(self, copies, value):
        """Every copy becomes ``copies[0] - value``. Returns ``copies``."""
        copies = self._check_bufs("assign_sub", copies, writable=True, what="copy")
        self._check_like("assign_sub", "value", value, copies[0], writable=False)
        self._assign_add(copies, value, True)
        return copies

    def sgd(self, copies, grad, *, lr):
        """Plain gradient descent: every copy becomes ``copies[0] - lr * grad``."""
        copies = self._check_bufs("sgd", copies, writable=True, what="copy")
        self._check_float("sgd", copies[0])
        self._check_like("sgd", "grad", grad, copies[0], writable=False)
        self._sgd(copies, grad, float(lr))
        return copies

    def momentum(self, copies, velocities, grad, *, lr, momentum, nesterov=False):
        """SGD with momentum (Keras formulation), on N variable copies and N velocity copies.

        ``v = momentum * v - lr * g``; then ``w += momentum * v - lr * g`` (nesterov) or ``w += v``.
        """
        copies = self._check_bufs("momentum", copies, writable=True, what="copy")
        self._check_float("momentum", copies[0])
        velocities = self._check_bufs("momentum", velocities, writable=True, what="velocity copy")
        self._check_same_slots("momentum", copies, velocities, "velocity")
        self._check_like("momentum", "grad", grad, copies[0], writable=False)
        self._momentum(copies, velocities, grad, float(lr), float(momentum), bool(nesterov))
        return copies

    def adam(self, copies, ms, vs, grad, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step):
        """Adam (Keras formulation) on N copies of the variable and of its two slots.

        With ``lr_t = lr * sqrt(1 - beta_2**step) / (1 - beta_1**step)`` (``step`` is 1-based):
        ``m += (g - m) * (1 - beta_1)``; ``v += (g*g - v) * (1 - beta_2)``;
        ``w -= lr_t * m / (sqrt(v) + epsilon)``.
        """
        copies = self._check_bufs("adam", copies, writable=True, what="copy")
        self._check_float("adam", copies[0])
        ms = self._check_bufs("adam", ms, writable=True, what="m copy")
        vs = self._check_bufs("adam", vs, writable=True, what="v copy")
        self._check_same_slots("adam", copies, ms, "m")
        self._check_same_slots("adam", copies, vs, "v")
        self._check_like("adam", "grad", grad, copies[0], writable=False)
        if int(step) < 1:
            raise ValueError(f"adam: step must be >= 1 (1-based), got {step}")
        lr_t = adam_lr_t(float(lr), float(beta_1), float(beta_2), int(step))
        self._adam(copies, ms, vs, grad, lr_t, float(beta_1), float(beta_2), float(epsilon))
        return copies

    def _check_same_slots(self, where, copies, slots, slot):
        if len(slots) != len(copies):
            raise ValueError(f"{where}: got {len(copies)} variable copies but {len(slots)} {slot} copies")
        if slots[0].dtype != copies[0].dtype or slots[0].shape != copies[0].shape:
            raise ValueError(
                f"{where}: {slot} slots have shape {slots[0].shape} dtype {slots[0].dtype.name} but the variable "
                f"copies have shape {copies[0].shape} dtype {copies[0].dtype.name}"
            )

    # ------------------------------------------------------------------ hooks
    def _all_reduce(self, bufs, op):  # pragma: no cover - abstract
        raise NotImplementedError

    def _reduce_to_one(self, bufs, op, out):  # pragma: no cover - abstract
        raise NotImplementedError

    def _broadcast(self, src, dsts):  # pragma: no cover - abstract
        raise NotImplementedError

    def _all_gather(self, bufs, axis):  # pragma: no cover - abstract
        raise NotImplementedError

    def _assign_add(self, copies, value, negate):  # pragma: no cover - abstract
        raise NotImplementedError

    def _sgd(self, copies, grad, lr):  # pragma: no cover - abstract
        raise NotImplementedError

    def _momentum(self, copies, velocities, grad, lr, momentum, nesterov):  # pragma: no cover - abstract
        raise NotImplementedError

    def _adam(self, copies, ms, vs, grad, lr_t, beta_1, beta_2, epsilon):  # pragma: no cover - abstract
        raise NotImplementedError
