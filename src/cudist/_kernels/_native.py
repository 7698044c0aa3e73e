"""The native backend: the C++ kernels of ``<cudist/cudist.hpp>`` through the extension ``cudist._core``.

Multi-threaded over a persistent pool (``cudist._core.set_num_threads``) whose workers spin briefly
between kernels (``CUDIST_POOL_SPIN_US``), GIL released for large buffers, inline on the caller for
small ones (and for mid-size ones while no worker spins). Bit-identical to the NumPy reference.
"""

from __future__ import annotations

import numpy as np

from cudist import _core, _settings
from cudist._kernels._base import (
    OPTIONAL_SLOTS,
    UPDATE_ENTRY_POINTS,
    UPDATE_KERNELS,
    update_variants,
    KernelBackend,
    TrustedKernels,
    variant_of,
)
from cudist._reduce_util import ReduceOp

__all__ = ["NativeBackend", "num_threads", "set_num_threads"]

_SUM, _MEAN = ReduceOp.SUM, ReduceOp.MEAN
_OP_CODES = {_SUM: _core.SUM, _MEAN: _core.MEAN}
# The extension takes the ReduceOp members themselves as ops (no mapping on the hot path).
_core.register_reduce_ops(_SUM, _MEAN)


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
        RuntimeError: the system refused to start a thread; the pool kept its previous size and
            none of the threads this call started is left running.
    """
    n = int(n)
    if n > MAX_THREADS:
        raise ValueError(f"set_num_threads: n must be <= {MAX_THREADS}, got {n}")
    before = _core.num_threads()
    try:
        _core.set_num_threads(n)
    except RuntimeError as e:  # std::system_error from std::thread: say what happened and what is left
        raise RuntimeError(
            f"set_num_threads({n}): the system refused to start a thread ({e}); the kernels keep "
            f"{_core.num_threads()} thread(s) (were {before})"
        ) from e


def _threads_from_settings() -> None:
    """Sizes the pool as ``CUDIST_NUM_THREADS`` asks (the launcher's share of the cores per worker)."""
    n = _settings.num_threads()
    if n is not None and n != _core.num_threads():
        set_num_threads(n)


_threads_from_settings()


class NativeBackend(KernelBackend):
    """C++ kernels: fused, multi-threaded, streaming stores for large buffers."""

    name = "native"
    bfloat16 = True
    mixed_gradients = True

    def all_reduce(self, bufs, op=ReduceOp.SUM, outputs=None):
        # Fast path for the hot call: the extension checks arrays, dtypes, sizes, contiguity,
        # writeability (and, out of place, overlaps) itself in well under a microsecond. Whatever it
        # rejects (or any op given as a string) goes through the base class, which raises the
        # contract's messages.
        if (op is _SUM or op is _MEAN) and type(bufs) in (tuple, list):
            shape = bufs[0].shape if bufs and type(bufs[0]) is np.ndarray else None
            if shape is not None and all(type(b) is np.ndarray and b.shape == shape for b in bufs):
                try:
                    if outputs is None:
                        _core.all_reduce(bufs, op)
                        return tuple(bufs)
                    if type(outputs) in (tuple, list) and all(
                        type(o) is np.ndarray and o.shape == shape for o in outputs
                    ):
                        _core.all_reduce_into(bufs, outputs, op, True)
                        return tuple(outputs)
                except (TypeError, ValueError):
                    pass
        return super().all_reduce(bufs, op, outputs)

    def _make_trusted(self):
        if type(self) is NativeBackend:
            return _NativeTrusted(self)
        return super()._make_trusted()  # a subclass may override hooks: go through them

    def _hook_all_reduce(self, inputs, outputs, op):
        if outputs is inputs:
            _core.all_reduce(inputs, op)
        else:
            _core.all_reduce_into(inputs, outputs, op)

    def _hook_batch_all_reduce(self, inputs, outputs, op):
        _core.batch_all_reduce(inputs, outputs, op)

    def _hook_batch_reduce_to_one(self, inputs, op, out):
        _core.batch_reduce_to_one(inputs, op, out)

    def _hook_reduce_to_one(self, bufs, op, out):
        _core.reduce_to_one(bufs, op, out)

    def _hook_broadcast(self, src, dsts):
        _core.broadcast(src, dsts)

    def _hook_all_gather(self, bufs, axis):
        return _core.all_gather(bufs, axis)

    def _hook_assign(self, copies, value):
        _core.assign(copies, value)

    def _hook_assign_add(self, copies, value, negate):
        _core.assign_add(copies, value, negate)

    def _hook_reduce_unscale_finite(self, grads, scale, out):
        return _core.reduce_unscale_finite(grads, scale, out)


def _core_variants(name, form):
    """The entry point ``form + name`` (``form``: "" or "all_reduce_") of a row with optional slots:
    the extension's function of the variant the given slots call for (one per combination)."""
    nslots = len(UPDATE_KERNELS[name][0])
    fns = {v: getattr(_core, form + v) for v, (row, _, _) in update_variants().items() if row == name}

    def entry(copies, *args):
        variant, slots = variant_of(name, args[:nslots])
        fns[variant](copies, *slots, *args[nslots:])

    entry.__name__ = entry.__qualname__ = form + name
    return entry


def _entry_point(name):
    """The extension's function serving the trusted entry point ``name`` (a form of a table row)."""
    row = name.removeprefix("all_reduce_")
    return _core_variants(row, name[: len(name) - len(row)]) if row in OPTIONAL_SLOTS else getattr(_core, name)


def _core_hook(name):
    fn = _entry_point(name)

    def hook(self, *args):
        fn(*args)

    hook.__name__ = hook.__qualname__ = f"_hook_{name}"
    return hook


# The optimizers' hooks beyond the ones above are the extension's functions of the same names.
for _name in UPDATE_ENTRY_POINTS:
    if f"_hook_{_name}" not in NativeBackend.__dict__:
        setattr(NativeBackend, f"_hook_{_name}", _core_hook(_name))
del _name


class _NativeTrusted(TrustedKernels):
    """The native backend's trusted kernels: the extension's functions themselves (they take the
    ReduceOp members as ops and run the same cheap checks that keep a bad call from crashing)."""

    __slots__ = ()

    def __init__(self, backend):
        super().__init__(backend)
        self.all_reduce = _core.all_reduce_into  # (inputs, outputs, op): in place when outputs is inputs
        self.batch_all_reduce = _core.batch_all_reduce
        self.batch_reduce_to_one = _core.batch_reduce_to_one
        self.reduce_to_one = _core.reduce_to_one
        self.reduce_to_one_shared = _core.reduce_to_one_shared
        self.batch_reduce_to_one_shared = _core.batch_reduce_to_one_shared
        self.settle_plain = _core.settle_plain
        self.broadcast = _core.broadcast
        self.assign = _core.assign
        self.assign_add = _core.assign_add
        self.reduce_unscale_finite = _core.reduce_unscale_finite
        for name in UPDATE_ENTRY_POINTS:
            setattr(self, name, _entry_point(name))
        # The entry points that take ``sources=``: a row with optional slots is served by its
        # variants' functions, picked per call (_core_variants), which do not pass it on.
        self.out_of_place = frozenset(
            n
            for n in _core.out_of_place_rules
            if n in UPDATE_ENTRY_POINTS and n.removeprefix("all_reduce_") not in OPTIONAL_SLOTS
        )
