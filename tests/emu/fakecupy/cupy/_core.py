"""The fake ``cupy.ndarray``: a NumPy array in emulated device memory, tagged with its device.

It follows CuPy 13's rules where cudist can observe them:

* Arrays are created on the *current* device (``empty_like``/``copy``/``asarray`` included).
* Views (basic indexing, reshape, ravel, ``.T``) share memory and stay on their array's device.
* An operation is a kernel on the current device: every array it reads or writes must be on that
  device, or on one the current device can access as a peer (CuPy then enables peer access and
  warns ``PerformanceWarning``); otherwise ``ValueError``. Plain copies (``copy``, ``get``,
  ``set``, ``asarray`` of another device's array, ``copyto`` between devices) work across devices.
* NumPy arrays do not mix: implicit conversion (``__array__``) and NumPy operands raise
  ``TypeError``; Python and NumPy scalars are fine.
* Work is asynchronous (see :mod:`cupy._emu`): an operation allocates its result at once and
  queues the computation on the current stream of the current device; shapes and errors come
  from a dry run on the operands' present contents. Host reads (``get``, ``item``, ``float``,
  ``bool``, ``repr``...) synchronize the stream CuPy's ``get()`` uses, as CuPy does; operations
  whose result shape depends on the data (``nonzero``, boolean masks, ``unique``...) synchronize
  the current stream first, as CuPy does.
"""

from __future__ import annotations

import numbers
import warnings

import numpy as np

from cupy import _emu
from cupy.cuda import memory as _memory
from cupy.cuda import runtime as _runtime


class PerformanceWarning(RuntimeWarning):
    """As ``cupy._util.PerformanceWarning``."""


_SCALARS = (numbers.Number, np.generic, bool)
_peer_warned: set = set()


def _cur() -> int:
    return _emu.THREAD.device


def _check_peer(dev: int, cur: int) -> None:
    """CuPy's _check_peer_access for an operand on ``dev`` of a kernel on ``cur``."""
    if dev == cur:
        return
    msg = f"The device where the array resides ({dev}) is different from the current device ({cur})."
    if not _emu.can_access_peer(cur, dev):
        raise ValueError(f"{msg} Peer access is unavailable between these devices.")
    _emu.PEER_ENABLED.add((cur, dev))
    warnings.warn(f"{msg} Peer access has been activated automatically.", PerformanceWarning, stacklevel=3)


def _stream_ptr(dev: int) -> int:
    s = _emu.THREAD.streams.get(dev)
    return 0 if s is None else s.ptr


def _alloc(shape, dtype, order="C", device=None):
    """An uninitialized block as a NumPy array on ``device`` (default: current), and its owner token."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (numbers.Integral, np.integer)) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    dev = _cur() if device is None else device
    block, _, owner = _emu.allocate(nbytes, dev, _stream_ptr(dev))
    if nbytes == 0:
        return np.empty(shape, dtype, order="F" if order == "F" else "C"), None
    return np.ndarray(shape, dtype, buffer=block, order="F" if order == "F" else "C"), owner


def _empty(shape, dtype, device=None, order="C") -> ndarray:
    a, owner = _alloc(shape, dtype, order, device)
    return ndarray._wrap(a, _cur() if device is None else device, owner)


def _quiet(fn):
    """``fn`` as queued device work: a GPU kernel never warns about inf/nan, so NumPy must not either."""

    def run():
        with np.errstate(all="ignore"):
            fn()

    return run


def _submit(fn, what: str, device: int | None = None) -> int:
    """Queues ``fn`` on the current stream of ``device`` (default: the current device)."""
    return _emu.enqueue(_emu.current_queue(device), _quiet(fn), what)


def _queue_of(stream, dev: int):
    """The queue of a ``cupy.cuda.Stream`` argument (None: the current stream) for work on ``dev``."""
    if stream is None:
        return _emu.current_queue(dev)
    ptr = int(getattr(stream, "ptr", 0) or 0)
    if ptr in (0, 1):  # the legacy null stream (1: cudaStreamLegacy) of the device the copy runs on
        return _emu.queue(dev, 0)
    return _emu.queue(stream.device_id if stream.device_id >= 0 else dev, ptr, getattr(stream, "non_blocking", False))


def _pinned_view(host: np.ndarray):
    """A view of ``host``'s memory that does not own it, if it is pinned (None for pageable memory).

    Queued copies read pinned memory when they run, like DMA does, and do not keep it allocated:
    freeing it early and reusing it is the user's race, as with CuPy's pinned pool.
    """
    if host.size == 0 or not (host.flags.c_contiguous or host.flags.f_contiguous):
        return None
    a = _emu.find(host.ctypes.data)
    if a is None or not a.pinned:
        return None
    return _emu.host_array(host.ctypes.data, host.shape, host.dtype, host.strides, pooled=True)


def _to_device(host, device=None, order="C") -> ndarray:
    """A new array on ``device`` (default: current) that gets a copy of NumPy array ``host``.

    A host-to-device copy on the current stream: pageable memory is read now (the driver stages
    it), pinned memory when the copy runs.
    """
    host = np.asarray(host)
    if order in ("K", "A", None):
        order = "F" if host.flags.f_contiguous and not host.flags.c_contiguous else "C"
    dev = _cur() if device is None else device
    out = _empty(host.shape, host.dtype, dev, order)
    if out.size:
        src = _pinned_view(host)
        if src is None:
            src = np.array(host, copy=True)
        dst = out._a
        _submit(lambda: np.copyto(dst, src), "host-to-device copy", dev)
    return out


def _unwrap(x, cur: int, *, allow_numpy: bool = False):
    """The NumPy view behind an operand of a kernel on ``cur`` (nested lists/tuples too)."""
    if isinstance(x, ndarray):
        _check_peer(x._dev, cur)
        return x._a
    if isinstance(x, np.ndarray):
        if allow_numpy:
            return np.array(x, copy=True)  # CuPy copies it to the device now
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, cur, allow_numpy=allow_numpy) for v in x)
    if hasattr(x, "__cuda_array_interface__"):
        return _unwrap(_from_cai(x), cur)
    return x


def _shares(res: np.ndarray, src: np.ndarray) -> bool:
    return res.size > 0 and src.size > 0 and np.may_share_memory(res, src)


def _views(res, views_of):
    """The operand ``res`` is a view of (None when it is new data)."""
    for v in views_of:
        if isinstance(v, ndarray) and _shares(res, v._a):
            return v
    return None


def _lazy(compute, cur: int, views_of=(), *, eager: bool = False):
    """Runs ``compute`` (NumPy over operand views, no side effects) as a kernel on ``cur``.

    The result arrays are allocated now, from a dry run on the operands' present contents, and
    filled when the current stream's queue runs (``compute`` is evaluated again then). Results
    that are views of an operand stay views. ``eager``: the result shape depends on the data, so
    the current stream is synchronized first and the result computed now (CuPy syncs there too).
    """
    with _emu.LOCK:
        if eager:
            _emu.synchronize_queue(_emu.current_queue(cur))
        try:
            with np.errstate(all="ignore"):
                res = compute()
        except Exception:
            if eager:
                raise
            # Maybe the stale contents only (an index array not yet written): retry on final data.
            _emu.synchronize_all()
            return _lazy(compute, cur, views_of, eager=True)
        if not eager and not _all_arrays(res):
            return _lazy(compute, cur, views_of, eager=True)  # a host value (bool...): needs the data
        targets = []
        wrapped = _wrap_tree(res, cur, views_of, targets, ())
        if targets:
            if eager:
                snap = [(dst, np.array(_pick(res, path), copy=True)) for path, dst in targets]
                _submit(lambda: [np.copyto(d, r, casting="unsafe") for d, r in snap], "kernel", cur)
            else:

                def run():
                    r = compute()
                    for path, dst in targets:
                        np.copyto(dst, _pick(r, path), casting="unsafe")

                _submit(run, getattr(compute, "__qualname__", "kernel"), cur)
        return wrapped


def _all_arrays(res) -> bool:
    if isinstance(res, (tuple, list)):
        return all(_all_arrays(r) for r in res)
    return isinstance(res, (np.ndarray, np.generic))


def _pick(res, path):
    for i in path:
        res = res[i]
    return res


def _wrap_tree(res, cur, views_of, targets, path):
    if isinstance(res, tuple):
        return tuple(_wrap_tree(r, cur, views_of, targets, path + (i,)) for i, r in enumerate(res))
    if isinstance(res, list):
        return [_wrap_tree(r, cur, views_of, targets, path + (i,)) for i, r in enumerate(res)]
    if isinstance(res, np.generic):
        res = np.asarray(res)
    if isinstance(res, np.ndarray):
        v = _views(res, views_of)
        if v is not None:
            return ndarray._wrap(res, v._dev, v._mem)
        order = "F" if res.flags.f_contiguous and not res.flags.c_contiguous else "C"
        out = _empty(res.shape, res.dtype, cur, order)
        if out.size:
            targets.append((path, out._a))
        return out
    return res


def _wrap_result(res, cur: int, views_of=()):
    """Wraps a NumPy result computed now from final data: views stay views, new data is copied to ``cur``."""
    return _lazy(lambda: res, cur, views_of)


def _from_cai(obj) -> ndarray:
    """A view of a foreign ``__cuda_array_interface__`` object (its memory must be registered)."""
    cai = obj.__cuda_array_interface__
    ptr = int(cai["data"][0])
    a = _emu.find(ptr)
    dev = a.device if a is not None and a.device is not None else _cur()
    host = _emu.host_array(ptr, cai["shape"], np.dtype(cai["typestr"]), cai.get("strides"))
    return ndarray._wrap(host, dev, obj)  # the foreign object owns the memory


def _is_basic_key(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return all(
        k is None or k is Ellipsis or isinstance(k, (slice, numbers.Integral, np.integer)) and not isinstance(k, bool)
        for k in keys
    )


class _Flags:
    def __init__(self, a: np.ndarray):
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = False

    def __getitem__(self, name):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous, "OWNDATA": self.owndata}[name]

    def __repr__(self):
        return f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}\n  OWNDATA : {self.owndata}"


class ndarray:  # noqa: N801 - CuPy's name
    """Fake ``cupy.ndarray`` (see the module docstring)."""

    __slots__ = ("_a", "_dev", "_mem", "__weakref__")
    __hash__ = None  # type: ignore[assignment]
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is None:
            self._a, self._mem = _alloc(shape, dtype, order)
            self._dev = _cur()
        else:
            shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
            self._a = _emu.host_array(memptr.ptr, shape, dtype, strides)
            self._dev = memptr.device_id
            self._mem = memptr  # keeps the memory it points into allocated

    @classmethod
    def _wrap(cls, a: np.ndarray, dev: int, mem) -> ndarray:
        """An array over ``a`` (a view of emulated memory) on ``dev``; ``mem`` owns that memory."""
        self = cls.__new__(cls)
        self._a = a
        self._dev = int(dev)
        self._mem = mem
        return self

    # ------------------------------------------------------------------ attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    @property
    def flags(self):
        return _Flags(self._a)

    @property
    def T(self):  # noqa: N802
        return ndarray._wrap(self._a.T, self._dev, self._mem)

    @property
    def device(self):
        from cupy.cuda import Device

        return Device(self._dev)

    @property
    def _ptr(self) -> int:
        return 0 if self._a.size == 0 else self._a.__array_interface__["data"][0]

    @property
    def data(self) -> _memory.MemoryPointer:
        alloc = _emu.find(self._ptr) if self._ptr else None
        kind = _memory.MemoryAsync if alloc is not None and alloc.async_pool else _memory.UnownedMemory
        mem = kind(self._ptr, self.nbytes, self, device_id=self._dev)
        return _memory.MemoryPointer(mem, 0)

    @property
    def base(self):
        return None

    @property
    def __cuda_array_interface__(self):
        from cupy.cuda import get_current_stream

        s = get_current_stream().ptr
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "data": (self._ptr, False),
            "version": 3,
            "strides": None if self._a.flags.c_contiguous else self.strides,
            "stream": s if s else 1,
        }

    # ------------------------------------------------------------------ host interop
    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array explicitly."
        )

    def get(self, stream=None, order="C", out=None, blocking=True):
        """As CuPy 13: a device-to-host copy on ``stream`` (default: the current stream of the current
        device; a null stream means the array's device's), then ``stream.synchronize()`` when
        ``blocking``. Into pageable memory the copy is synchronous anyway (as CUDA does it)."""
        with _emu.LOCK:
            if stream is None:
                stream = _emu.THREAD.streams.get(_cur())
            q = _queue_of(stream, self._dev) if stream is not None else _emu.queue(self._dev, 0)
            if out is not None:
                if not isinstance(out, np.ndarray):
                    raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
                if out.shape != self.shape or out.dtype != self.dtype:
                    raise ValueError(f"Shape/dtype mismatch: out {out.shape} {out.dtype}, array {self.shape} {self.dtype}")
                target = out
            else:
                if order == "A":
                    order = "F" if self._a.flags.f_contiguous and not self._a.flags.c_contiguous else "C"
                target = np.empty(self.shape, self.dtype, order=order)
            if self.size == 0:
                return target
            dst = _pinned_view(target)
            pinned = dst is not None
            if dst is None:
                dst = target
            src = self._a
            seq = _emu.enqueue(q, _quiet(lambda: np.copyto(dst, src)), "device-to-host copy")
            if blocking or not pinned:
                _emu.run_until(q, seq)
            return target

    def set(self, arr, stream=None):
        """As CuPy 13: a host-to-device copy on ``stream`` (default: the current stream); from
        pinned memory it reads the host buffer when it runs, from pageable memory now."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        if not self.size:
            return
        with _emu.LOCK:
            src = _pinned_view(arr)
            if src is None:
                src = np.array(arr, copy=True)
            dst = self._a
            _emu.enqueue(_queue_of(stream, self._dev), _quiet(lambda: np.copyto(dst, src)), "host-to-device copy")

    def item(self, *args):
        return self.get().item(*args)

    def tolist(self):
        return self.get().tolist()

    def __float__(self):
        return float(self._scalar_value())

    def __int__(self):
        return int(self._scalar_value())

    def __complex__(self):
        return complex(self._scalar_value())

    def __bool__(self):
        if self.size != 1:
            raise ValueError(
                "The truth value of an array with more than one element is ambiguous. Use a.any() or a.all()"
            )
        return bool(self.get().reshape(()).item())

    def _scalar_value(self):
        if self.size != 1:
            raise TypeError("only length-1 arrays can be converted to Python scalars")
        return self.get().reshape(()).item()

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self):
        return repr(self.get())

    def __str__(self):
        return str(self.get())

    def __format__(self, spec):
        h = self.get()
        return format(h.reshape(()).item() if self.ndim == 0 else h, spec)

    def __reduce__(self):
        return (_to_device, (self.get(),))

    # ------------------------------------------------------------------ copies and views
    def copy(self, order="C"):
        """A copy on the *current* device (a plain memcpy: works from any device)."""
        cur = _cur()
        if self._dev != cur and self.size:
            _memory._set_peer_access(self._dev, cur)
        if order in ("K", "A"):
            order = "F" if self._a.flags.f_contiguous and not self._a.flags.c_contiguous else "C"
        out = _empty(self.shape, self.dtype, cur, order)
        if out.size:
            src, dst = self._a, out._a
            _submit(lambda: np.copyto(dst, src), "copy", cur)
        return out

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        dtype = np.dtype(dtype)
        if not copy and dtype == self.dtype:
            return self
        cur = _cur()
        if self.size:
            _check_peer(self._dev, cur)
        kw = {} if casting is None else {"casting": casting}
        src = self._a
        return _lazy(lambda: src.astype(dtype, order=order, **kw), cur)

    def view(self, dtype=None, type=None):
        return ndarray._wrap(self._a.view() if dtype is None else self._a.view(dtype), self._dev, self._mem)

    def _viewish(self, compute):
        res = compute()
        cur = _cur()
        if isinstance(res, np.ndarray) and (_shares(res, self._a) or res.size == 0 and self.size == 0):
            return ndarray._wrap(res, self._dev, self._mem)
        if self.size:
            _check_peer(self._dev, cur)
        return _lazy(compute, cur)

    def reshape(self, *shape, order="C", copy=None):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        src = self._a
        return self._viewish(lambda: src.reshape(shape, order=order))

    def ravel(self, order="C"):
        src = self._a
        return self._viewish(lambda: src.ravel(order=order))

    def flatten(self, order="C"):
        return self.copy().ravel()

    def squeeze(self, axis=None):
        return ndarray._wrap(self._a.squeeze(axis), self._dev, self._mem)

    def transpose(self, *axes):
        return ndarray._wrap(self._a.transpose(*axes), self._dev, self._mem)

    def swapaxes(self, a1, a2):
        return ndarray._wrap(self._a.swapaxes(a1, a2), self._dev, self._mem)

    def fill(self, value):
        if self.size:
            _check_peer(self._dev, _cur())
            if isinstance(value, ndarray):
                value = value.item()
            dst = self._a
            np.empty(0, dst.dtype).fill(value)  # a bad value raises now
            _submit(lambda: dst.fill(value), "fill")

    def __getitem__(self, key):
        if _is_basic_key(key):
            keys = key if isinstance(key, tuple) else (key,)
            if Ellipsis not in keys:
                keys = keys + (Ellipsis,)
            return ndarray._wrap(self._a[keys], self._dev, self._mem)
        cur = _cur()
        _check_peer(self._dev, cur)
        k = _unwrap(key, cur, allow_numpy=True)
        src = self._a
        return _lazy(lambda: src[k], cur, eager=_is_mask(k))

    def __setitem__(self, key, value):
        cur = _cur()
        if self.size:
            _check_peer(self._dev, cur)
        if isinstance(value, ndarray):
            _check_peer(value._dev, cur)
            value = value._a
        elif isinstance(value, np.ndarray):
            value = np.array(value, copy=True)  # CuPy copies it to the device now
        k = _unwrap(key, cur, allow_numpy=True)
        dst = self._a
        with _emu.LOCK:
            if not (_is_basic_key(k) and isinstance(value, _SCALARS)):
                # Shape and index errors are raised now, as CuPy does, from a dry run on a copy.
                with np.errstate(all="ignore"):
                    try:
                        dst.copy()[k] = value
                    except IndexError:
                        pass  # maybe stale index contents; the real run decides
            _submit(lambda: dst.__setitem__(k, value), "setitem", cur)

    # ------------------------------------------------------------------ arithmetic
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # As CuPy: operands that are neither arrays, scalars nor CUDA-array-interface objects are
        # declined, so NumPy's dispatch (NEP 13) tries their own __array_ufunc__ next.
        for x in inputs + tuple(kwargs.get("out", ()) or ()):
            if not isinstance(x, (ndarray, np.ndarray, *_SCALARS)) and not hasattr(x, "__cuda_array_interface__"):
                return NotImplemented
        return _apply_numpy(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        import cupy

        impl = getattr(cupy, func.__name__, None)
        if impl is None or not callable(impl):
            return NotImplemented
        return impl(*args, **kwargs)

    def _binop(self, ufunc, other, reflected=False):
        args = (other, self) if reflected else (self, other)
        if other is None or isinstance(other, (ndarray, *_SCALARS, np.ndarray)):
            if other is None:
                return NotImplemented
            return _apply_numpy(ufunc, args, {})
        # CuPy's _should_use_rop: defer to an operand that opts out of ufuncs (or, without
        # __array_ufunc__, has a higher __array_priority__); otherwise call the NumPy ufunc, whose
        # dispatch offers the operation to every operand's __array_ufunc__ (see above).
        try:
            other_ufunc = other.__array_ufunc__
        except AttributeError:
            if getattr(other, "__array_priority__", 0) > self.__array_priority__:
                return NotImplemented
        else:
            if other_ufunc is None:
                return NotImplemented
        return ufunc(*args)

    def _inplace(self, ufunc, other):
        _apply_numpy(ufunc, (self, other), {"out": (self,), "casting": "same_kind"})
        return self

    def __neg__(self):
        return _apply_numpy(np.negative, (self,), {})

    def __pos__(self):
        return _apply_numpy(np.positive, (self,), {})

    def __abs__(self):
        return _apply_numpy(np.absolute, (self,), {})

    def __invert__(self):
        return _apply_numpy(np.invert, (self,), {})

    # ------------------------------------------------------------------ reductions and friends
    def _method(self, name, *args, **kwargs):
        cur = _cur()
        args = _unwrap(args, cur)
        out = kwargs.get("out")
        _check_peer(self._dev, cur)
        src = self._a
        if isinstance(out, ndarray):
            kw = dict(kwargs, out=_unwrap(out, cur))
            dry = {k: v for k, v in kwargs.items() if k != "out"}
            with _emu.LOCK, np.errstate(all="ignore"):
                getattr(src, name)(*args, **dry)  # argument errors are raised now
                _submit(lambda: getattr(src, name)(*args, **kw), name, cur)
            return out
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        return _lazy(lambda: getattr(src, name)(*args, **kwargs), cur, eager=name == "nonzero")

    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._method("sum", axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._method("mean", axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def prod(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._method("prod", axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def max(self, axis=None, out=None, keepdims=False):
        return self._method("max", axis=axis, out=out, keepdims=keepdims)

    def min(self, axis=None, out=None, keepdims=False):
        return self._method("min", axis=axis, out=out, keepdims=keepdims)

    def all(self, axis=None, out=None, keepdims=False):
        return self._method("all", axis=axis, out=out, keepdims=keepdims)

    def any(self, axis=None, out=None, keepdims=False):
        return self._method("any", axis=axis, out=out, keepdims=keepdims)

    def std(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
        return self._method("std", axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)

    def var(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
        return self._method("var", axis=axis, dtype=dtype, out=out, ddof=ddof, keepdims=keepdims)

    def argmax(self, axis=None, out=None, keepdims=False):
        return self._method("argmax", axis=axis, out=out, keepdims=keepdims)

    def argmin(self, axis=None, out=None, keepdims=False):
        return self._method("argmin", axis=axis, out=out, keepdims=keepdims)

    def cumsum(self, axis=None, dtype=None, out=None):
        return self._method("cumsum", axis=axis, dtype=dtype, out=out)

    def clip(self, min=None, max=None, out=None):  # noqa: A002
        return self._method("clip", min, max, out=out)

    def round(self, decimals=0, out=None):
        return self._method("round", decimals=decimals, out=out)

    def dot(self, b, out=None):
        return self._method("dot", b, out=out)

    def nonzero(self):
        return self._method("nonzero")

    def sort(self, axis=-1):
        _check_peer(self._dev, _cur())
        dst = self._a
        _submit(lambda: dst.sort(axis=axis), "sort")

    def argsort(self, axis=-1):
        return self._method("argsort", axis=axis)


_DATA_DEPENDENT = {"nonzero", "unique", "bincount", "argwhere", "flatnonzero", "compress", "extract"}


def _is_mask(k) -> bool:
    keys = k if isinstance(k, tuple) else (k,)
    return any(isinstance(x, np.ndarray) and x.dtype == np.bool_ for x in keys)


def _apply_numpy(fn, args, kwargs):
    """Runs NumPy function ``fn`` as a kernel on the current device (see the module docstring)."""
    cur = _cur()
    out = kwargs.get("out")
    if out is not None:
        outs = out if isinstance(out, tuple) else (out,)
        for o in outs:
            if not isinstance(o, ndarray):
                raise TypeError(f"Output arguments must be cupy.ndarray, got {type(o)}")
        kwargs = dict(kwargs, out=tuple(_unwrap(o, cur) for o in outs) if isinstance(out, tuple) else _unwrap(out, cur))
    args = _unwrap(tuple(args), cur)
    kwargs = {k: (_unwrap(v, cur) if k not in ("out",) else v) for k, v in kwargs.items()}
    name = getattr(fn, "__name__", "")
    if out is not None:
        o = kwargs["out"]
        dry = dict(kwargs, out=tuple(np.empty_like(x) for x in o) if isinstance(o, tuple) else np.empty_like(o))
        with _emu.LOCK:
            with np.errstate(all="ignore"):
                fn(*args, **dry)  # argument, shape and casting errors are raised now
            _submit(lambda: fn(*args, **kwargs), name, cur)
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out
    eager = name in _DATA_DEPENDENT or (name == "where" and len(args) == 1)
    return _lazy(lambda: fn(*args, **kwargs), cur, eager=eager)


def _inplace_numpy(fn, args, kwargs, what: str):
    """Queues NumPy function ``fn`` that writes its first operand (``np.copyto``) on the current device."""
    cur = _cur()
    args = _unwrap(tuple(args), cur)
    kwargs = {k: _unwrap(v, cur) for k, v in kwargs.items()}
    with _emu.LOCK:
        with np.errstate(all="ignore"):
            fn(args[0].copy(), *args[1:], **kwargs)  # errors are raised now
        _submit(lambda: fn(*args, **kwargs), what, cur)


_BINOPS = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "truediv": np.true_divide,
    "floordiv": np.floor_divide,
    "mod": np.remainder,
    "pow": np.power,
    "matmul": np.matmul,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "lshift": np.left_shift,
    "rshift": np.right_shift,
}


def _install_ops():
    for name, uf in _BINOPS.items():
        setattr(ndarray, f"__{name}__", lambda self, o, _u=uf: self._binop(_u, o))
        setattr(ndarray, f"__r{name}__", lambda self, o, _u=uf: self._binop(_u, o, reflected=True))
        setattr(ndarray, f"__i{name}__", lambda self, o, _u=uf: self._inplace(_u, o))
    for name, uf in {
        "eq": np.equal,
        "ne": np.not_equal,
        "lt": np.less,
        "le": np.less_equal,
        "gt": np.greater,
        "ge": np.greater_equal,
    }.items():
        setattr(ndarray, f"__{name}__", lambda self, o, _u=uf: self._binop(_u, o))


_install_ops()
ndarray.__module__ = "cupy"  # as CuPy: <class 'cupy.ndarray'>
_ = _runtime  # the runtime module must be importable before arrays are used
