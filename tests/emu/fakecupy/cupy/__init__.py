"""A fake ``cupy`` for running cudist's GPU code on a CPU-only machine.

Arrays are NumPy arrays in emulated device memory (:mod:`cupy._core`); ``RawModule`` runs cudist's
real CUDA kernels compiled for the host (tests/emu/build.py) after checking every pointer they get
(:mod:`cupy._raw`); ``cupy.cuda`` has devices, peer access, streams, events and NCCL. Work is
asynchronous as on a GPU: queued per stream and run when something waits for it (:mod:`cupy._emu`;
``CUDIST_EMU_SYNC=1`` runs it at once, for debugging). It is put on ``sys.path`` only by tests/test_gpu_emulated.py (and by hand:
``PYTHONPATH=tests/emu/fakecupy``), never installed.
"""

from __future__ import annotations

import builtins as _builtins
import functools as _functools

import numpy as _np

from cupy import _emu  # noqa: F401
from cupy import cuda  # noqa: F401
from cupy._core import PerformanceWarning, _apply_numpy, _cur, _from_cai, _inplace_numpy, _lazy, _submit, _to_device, _unwrap, ndarray
from cupy._raw import RawKernel, RawModule  # noqa: F401

__version__ = "13.6.0"
__fake__ = True  # lets a test assert it runs under the emulator

# dtypes and constants, as CuPy re-exports them from NumPy
from numpy import (  # noqa: E402, F401
    bool_,
    complex64,
    complex128,
    dtype,
    e,
    finfo,
    float16,
    float32,
    float64,
    floating,
    generic,
    iinfo,
    inexact,
    inf,
    int8,
    int16,
    int32,
    int64,
    integer,
    intp,
    nan,
    newaxis,
    number,
    pi,
    signedinteger,
    uint8,
    uint16,
    uint32,
    uint64,
    uintp,
    unsignedinteger,
)
from numpy import can_cast, issubdtype, promote_types, result_type  # noqa: E402, F401

bool = _builtins.bool  # noqa: A001 - cupy.bool is Python's bool as in NumPy 2 (np.bool is np.bool_)


class _util:  # noqa: N801 - stands in for the cupy._util module
    PerformanceWarning = PerformanceWarning


# ----------------------------------------------------------------------------------- creation
def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    """As ``cupy.array``: another device's array is copied onto the current device."""
    if isinstance(obj, ndarray):
        dt = obj.dtype if dtype is None else _np.dtype(dtype)
        if obj._dev == _cur():
            a = obj.astype(dt, order=order, copy=bool(copy))
        else:
            a = obj.copy(order="C" if order in ("K", "A", None) else order).astype(dt, copy=False)
    elif hasattr(obj, "__cuda_array_interface__"):
        return array(_from_cai(obj), dtype, copy, order, subok, ndmin)
    elif isinstance(obj, (list, tuple)) and _contains_device_array(obj):
        a = stack([array(o, dtype) for o in obj])
        if dtype is not None:
            a = a.astype(dtype, copy=False)
    else:
        host = _np.array(obj, dtype=dtype, copy=True, order=order if order in ("C", "F", "K", "A") else "K")
        a = _to_device(host, order=order)
    if ndmin > a.ndim:
        a = a.reshape((1,) * (ndmin - a.ndim) + a.shape)
    return a


def _contains_device_array(seq) -> _builtins.bool:
    return any(isinstance(x, ndarray) or isinstance(x, (list, tuple)) and _contains_device_array(x) for x in seq)


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    return array(a, dtype=dtype, copy=_builtins.bool(copy), order=order)


def asanyarray(a, dtype=None, order=None):
    return asarray(a, dtype, order)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        return array(a, dtype=dtype, order="C", ndmin=1)
    dt = a.dtype if dtype is None else _np.dtype(dtype)
    if a._a.flags.c_contiguous and dt == a.dtype:
        return a
    return _apply_numpy(lambda x: _np.ascontiguousarray(x, dtype=dt), (a,), {})


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if hasattr(a, "__cuda_array_interface__"):
        return _from_cai(a).get(order=order, out=out)
    res = _np.asarray(a, order=order)
    if out is not None:
        out[...] = res
        return out
    return res


def get_array_module(*args):
    return __import__("cupy") if any(isinstance(a, ndarray) for a in args) else _np


def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype, order=order)


def _fill(shape, dtype, order, value):
    a = empty(shape, dtype, order)
    if a.size:
        dst = a._a
        if isinstance(value, _np.ndarray):
            value = value.copy()
        _submit(lambda: dst.__setitem__(Ellipsis, value), "fill")
    return a


def zeros(shape, dtype=float, order="C"):
    return _fill(shape, dtype, order, 0)


def ones(shape, dtype=float, order="C"):
    return _fill(shape, dtype, order, 1)


def full(shape, fill_value, dtype=None):
    if dtype is None:
        dtype = fill_value.dtype if isinstance(fill_value, ndarray) else _np.array(fill_value).dtype
    if isinstance(fill_value, ndarray):
        fill_value = fill_value.item()
    return _fill(shape, dtype, "C", fill_value)


def _like(a, dtype, order, shape):
    """Shape/dtype of ``a``; the new array goes to the *current* device, as in CuPy."""
    return (a.shape if shape is None else shape), (a.dtype if dtype is None else dtype), ("C" if order in ("K", "A") else order)


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    s, d, o = _like(prototype, dtype, order, shape)
    return empty(s, d, o)


def zeros_like(prototype, dtype=None, order="K", subok=None, shape=None):
    s, d, o = _like(prototype, dtype, order, shape)
    return zeros(s, d, o)


def ones_like(prototype, dtype=None, order="K", subok=None, shape=None):
    s, d, o = _like(prototype, dtype, order, shape)
    return ones(s, d, o)


def full_like(prototype, fill_value, dtype=None, order="K", subok=None, shape=None):
    s, d, o = _like(prototype, dtype, order, shape)
    return _fill(s, d, o, fill_value)


def arange(start, stop=None, step=None, dtype=None):
    return _to_device(_np.arange(start, stop, step, dtype=dtype) if stop is not None else _np.arange(start, dtype=dtype) if step is None else _np.arange(0, start, step, dtype=dtype))


def linspace(start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0):
    return _to_device(_np.linspace(start, stop, num, endpoint=endpoint, dtype=dtype, axis=axis))


def copyto(dst, src, casting="same_kind", where=None):
    """As ``cupy.copyto`` (CuPy 13): between devices a plain copy, else a kernel on the current device."""
    if not isinstance(dst, ndarray):
        raise TypeError(f"Argument 'dst' has incorrect type (expected cupy.ndarray, got {type(dst).__name__})")
    scalar = type(src) in (int, float, complex, _builtins.bool)
    if scalar:
        ok = _np.can_cast(_np.min_scalar_type(src), dst.dtype, casting) if casting != "unsafe" else True
        src_dtype = _np.dtype(type(src))
    elif isinstance(src, (_np.ndarray, _np.generic)):
        if src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        src_dtype = src.dtype
        ok = _np.can_cast(src.dtype, dst.dtype, casting)
        src, scalar = src.item(), True
    else:
        src_dtype = src.dtype
        ok = _np.can_cast(src_dtype, dst.dtype, casting)
    if not ok:
        raise TypeError(f"Cannot cast {src_dtype} to {dst.dtype} in {casting} casting mode")
    if where is not None:
        _inplace_numpy(_np.copyto, (dst, src), {"where": where, "casting": "unsafe"}, "copyto")
        return
    if dst.size == 0:
        return
    if scalar:
        _inplace_numpy(_np.copyto, (dst, src), {"casting": "unsafe"}, "copyto")
        return
    for s, d in zip(reversed(src.shape), reversed(dst.shape)):
        if s not in (d, 1):
            raise ValueError(f"could not broadcast input array from shape {src.shape} into shape {dst.shape}")
    c = dst._a.flags.c_contiguous and src._a.flags.c_contiguous
    f = dst._a.flags.f_contiguous and src._a.flags.f_contiguous
    if (c or f) and dst.dtype == src.dtype and dst.size == src.size:
        dst.data.copy_from_device_async(src.data, src.nbytes)
        return
    with cuda.Device(dst._dev):
        if src._dev != dst._dev:
            src = src.copy()
        _inplace_numpy(_np.copyto, (dst, src), {"casting": "unsafe"}, "copyto")


def concatenate(tup, axis=0, out=None, dtype=None, casting="same_kind"):
    kw = {"axis": axis, "casting": casting}
    if dtype is not None:
        kw["dtype"] = dtype
    if out is not None:
        kw["out"] = out
    return _apply_numpy(_np.concatenate, (list(tup),), kw)


def stack(tup, axis=0, out=None, dtype=None, casting="same_kind"):
    kw = {"axis": axis, "casting": casting}
    if dtype is not None:
        kw["dtype"] = dtype
    if out is not None:
        kw["out"] = out
    return _apply_numpy(_np.stack, (list(tup),), kw)


def _numpy_function(name):
    fn = getattr(_np, name)

    @_functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for a in args:
            if isinstance(a, (_np.ndarray)):
                raise TypeError(f"Unsupported type {type(a)}")
        res = _apply_numpy(fn, args, kwargs)
        return res

    wrapper.__module__ = "cupy"
    return wrapper


def _view_function(name):
    """Functions returning views of their argument (which stay on its device)."""
    fn = getattr(_np, name)

    @_functools.wraps(fn)
    def wrapper(a, *args, **kwargs):
        if not isinstance(a, ndarray):
            raise TypeError(f"Unsupported type {type(a)}")
        src = a._a
        return _lazy(lambda: fn(src, *args, **kwargs), _cur(), views_of=(a,))

    wrapper.__module__ = "cupy"
    return wrapper


for _name in (
    "add subtract multiply divide true_divide floor_divide negative positive power remainder mod fmod absolute abs "
    "sqrt square exp log log2 log10 log1p expm1 sin cos tanh sign maximum minimum fmax fmin trunc floor ceil rint "
    "around round clip equal not_equal less less_equal greater greater_equal logical_and logical_or logical_not "
    "logical_xor isnan isinf isfinite where sum mean prod amax amin max min any all std var argmax argmin cumsum "
    "dot matmul outer tensordot einsum allclose isclose array_equal nonzero count_nonzero sort argsort unique tile "
    "repeat flip vstack hstack dstack column_stack split array_split bitwise_and bitwise_or bitwise_xor invert "
    "left_shift right_shift nan_to_num diff searchsorted bincount take"
).split():
    globals()[_name] = _numpy_function(_name)

for _name in "reshape ravel transpose squeeze expand_dims broadcast_to moveaxis swapaxes atleast_1d atleast_2d".split():
    globals()[_name] = _view_function(_name)


def may_share_memory(a, b, max_work=None):
    if not isinstance(a, ndarray) or not isinstance(b, ndarray):
        return False
    return _builtins.bool(_np.may_share_memory(a._a, b._a))


shares_memory = may_share_memory


def get_default_memory_pool():
    return cuda.MemoryPool()


def get_default_pinned_memory_pool():
    return cuda.PinnedMemoryPool()


def is_available() -> _builtins.bool:
    return cuda.is_available()


from cupy import random  # noqa: E402, F401 - after the creation functions it uses


def from_dlpack(array, *, device=None, copy=None):
    """As ``cupy.from_dlpack`` for what the emulator can hold: an object whose DLPack device is CUDA
    (2) or CUDA managed (13) and that also exports ``__cuda_array_interface__`` over emulated memory
    (a view, like CuPy's zero-copy import). Anything else is refused as CuPy refuses host tensors."""
    dev = array.__dlpack_device__() if hasattr(array, "__dlpack_device__") else None
    if dev is None or int(dev[0]) not in (2, 13):
        raise RuntimeError(f"Unsupported device in DLTensor: {dev!r} (the emulator imports CUDA memory only)")
    if not hasattr(array, "__cuda_array_interface__"):
        raise NotImplementedError("emulator: from_dlpack needs __cuda_array_interface__ as well")
    out = _from_cai(array)
    return out.copy() if copy else out
