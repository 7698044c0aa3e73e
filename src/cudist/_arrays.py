"""Array and device helpers: the one implementation of each, shared by every module.

Host values are NumPy arrays; device values are GPU arrays, i.e. CuPy arrays or anything else
exporting the CUDA array interface. Nothing here imports CuPy until a device array (or a GPU
device) actually shows up, so ``import cudist`` stays free of CUDA.

Each helper takes the cheapest route for plain ``np.ndarray`` first: several sit on the per-step
paths of ``strategy.run``, collectives and variable updates.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, TypeAlias, cast

import numpy as np
import numpy.typing as npt

from cudist import _devices

__all__ = [
    "is_device_array",
    "is_array",
    "array_module",
    "as_array",
    "to_host",
    "device_context",
    "gpu_of",
    "physical_gpu",
    "current_gpu",
    "set_current_gpu",
    "to_gpu",
    "place",
    "like",
    "snapshot",
    "contiguous",
    "may_share_memory",
    "python_dtype",
    "is_foreign_array",
    "from_dlpack",
    "array_namespace",
    "order_streams",
    "join_streams",
]

#: What the helpers below return for an array that may be on the host or on a GPU: a NumPy array,
#: or a GPU array (a CuPy array, or any object exporting ``__cuda_array_interface__``). CuPy ships
#: no type information, so to a type checker a GPU array is ``Any``: the alias reads
#: ``NDArray[Any] | Any``. Parameters taking any array (or any value) are typed ``Any``.
Array: TypeAlias = "npt.NDArray[Any] | Any"

_NULL_CONTEXT = contextlib.nullcontext()
_INT32 = np.iinfo(np.int32)


def is_device_array(a: object) -> bool:
    """Whether ``a`` is a GPU array.

    Args:
        a: any object.

    Returns:
        True for CuPy arrays and any other object exporting ``__cuda_array_interface__``; False
        for NumPy arrays and scalars, Python numbers and everything else.
    """
    t = type(a)
    if t is np.ndarray:
        return False
    if t.__name__ == "ndarray" and t.__module__ == "cupy":
        return True  # without building CuPy's interface dict, as hasattr() below would
    return hasattr(a, "__cuda_array_interface__")


def is_array(x: object) -> bool:
    """Whether ``x`` is an array or array scalar: a NumPy array, a NumPy scalar or a GPU array."""
    return isinstance(x, (np.ndarray, np.generic)) or is_device_array(x)


def array_module(a: object) -> ModuleType:
    """The array module that works on ``a``: ``cupy`` for GPU arrays, ``numpy`` for everything else.

    Args:
        a: an array (or any value; non-GPU values get ``numpy``).

    Returns:
        The ``numpy`` or ``cupy`` module.
    """
    if type(a) is np.ndarray or not is_device_array(a):
        return np
    import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - only reached with GPU arrays

    return cast(ModuleType, cupy)


def as_array(x: object) -> Array:
    """``x`` as an array the kernels accept: NumPy and GPU arrays as they are, else ``np.asarray(x)``.

    Python and NumPy scalars become 0-d NumPy arrays; nothing is copied that need not be. Other
    frameworks' arrays (JAX, PyTorch: see :func:`is_foreign_array`) come in through DLPack,
    zero-copy: NumPy arrays for host memory, CuPy arrays for CUDA memory (:func:`from_dlpack`).

    Args:
        x: an array, a scalar, or anything ``np.asarray`` accepts.

    Returns:
        ``x`` itself for NumPy and GPU arrays, a NumPy or CuPy array sharing a framework array's
        memory, else a NumPy array.
    """
    if isinstance(x, np.ndarray):
        return x
    if is_foreign_array(x):  # JAX, PyTorch, ...: the one place their arrays come in (DLPack, zero-copy)
        return from_dlpack(x)
    if is_device_array(x):
        return x
    return np.asarray(x)


def to_host(a: object) -> npt.NDArray[Any]:
    """``a`` as a NumPy array: NumPy arrays as they are, GPU arrays copied to the host.

    Args:
        a: a NumPy or GPU array, or anything ``np.asarray`` accepts (scalars, lists).

    Returns:
        ``a`` itself for NumPy arrays (subclasses included); a new host array for GPU arrays; else
        ``np.asarray(a)`` (which may share memory with ``a``).
    """
    if isinstance(a, np.ndarray):
        return a
    if is_foreign_array(a):
        a = from_dlpack(a)
        if isinstance(a, np.ndarray):
            return a
    if is_device_array(a):
        import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - only reached with GPU arrays

        return cast("npt.NDArray[Any]", cupy.asnumpy(a))  # unlike ndarray.get(), also takes non-CuPy CUDA arrays
    return np.asarray(a)


def device_context(a: object) -> contextlib.AbstractContextManager[object]:
    """A context manager making ``a``'s GPU the current CUDA device; a no-op for host values.

    CuPy allocates and launches on the current device, so anything created from a GPU array
    (a copy, a reduction result) is made inside this context to land on that array's GPU.

    Args:
        a: any value; only GPU arrays (whose ``device`` is a context manager) have an effect.

    Returns:
        ``a.device`` for CuPy arrays, else a null context.
    """
    dev: Any = getattr(a, "device", None)  # NumPy 2 arrays have device == "cpu": no context manager
    return dev if hasattr(dev, "__enter__") else _NULL_CONTEXT


def gpu_of(a: Any) -> int | None:
    """The CUDA device id of the GPU holding ``a``, or None for host values.

    Args:
        a: any value (an array, typically).
    """
    if type(a) is np.ndarray or not is_device_array(a):
        return None
    return int(a.device.id)


def physical_gpu(spec: _devices.DeviceSpec) -> int:
    """The physical GPU (CUDA device id) a logical ``/gpu:N`` device lives on.

    Args:
        spec: a GPU :class:`cudist._devices.DeviceSpec`.

    Raises:
        ValueError: there is no such logical GPU (none at all when CuPy sees no GPU).
    """
    from cudist import config

    mapping = config.logical_to_physical_gpu()
    if spec.device_index >= len(mapping):
        hint = f" ({config.gpu_unavailable_reason()})" if not mapping else ""
        raise ValueError(f"device {spec.name} does not exist: {len(mapping)} logical GPU(s) are configured{hint}")
    return mapping[spec.device_index]


def current_gpu() -> int:
    """The current CUDA device id (the calling thread's)."""
    import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - GPU strategies only

    return cast(int, cupy.cuda.runtime.getDevice())


def set_current_gpu(gpu: int) -> None:
    """Makes physical GPU ``gpu`` the current CUDA device of the calling thread."""
    import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - GPU strategies only

    cupy.cuda.runtime.setDevice(gpu)


def to_gpu(a: Any, gpu: int, *, copy: bool = False) -> Any:
    """``a`` as a CuPy array on physical GPU ``gpu``.

    Args:
        a: a NumPy or GPU array, a NumPy scalar, or anything ``cupy.asarray`` accepts.
        gpu: the CUDA device id.
        copy: always make a new C-contiguous array (else ``a`` itself when it already is a CuPy
            array on ``gpu``; host values and arrays of other GPUs are copied onto it).

    Returns:
        A CuPy array (``Any`` to type checkers: CuPy ships no type information).
    """
    import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - only reached with GPU devices

    if isinstance(a, cupy.ndarray) and a.device.id != gpu:
        return _copy_across(cupy, a, gpu, copy)
    if not copy and isinstance(a, cupy.ndarray):
        return a
    with cupy.cuda.Device(gpu):
        return cupy.array(a, order="C", copy=True) if copy else cupy.asarray(a)


#: (CuPy module, device, stream pointer) -> an event reused for every join recorded on that stream.
#: Recording it again is safe: a wait enqueued earlier captured the record it saw, and a later
#: record on the same stream only covers more work.
_EVENTS: dict[tuple[int, int, int], tuple[Any, Any]] = {}


def _event_after(cupy: ModuleType, device: int) -> Any:
    """An event recorded now on GPU ``device``'s current stream (the cached one of that stream)."""
    with cupy.cuda.Device(device):
        stream = cupy.cuda.get_current_stream()
        key = (id(cupy), device, int(getattr(stream, "ptr", 0)))
        entry = _EVENTS.get(key)
        if entry is None or entry[0] is not cupy:  # (another module object reusing a dead one's id)
            entry = _EVENTS[key] = (cupy, cupy.cuda.Event(disable_timing=True))
        ev = entry[1]
        ev.record(stream)
    return ev


def join_streams(cupy: ModuleType, waiters: Any, sources: Any) -> None:
    """Makes each GPU of ``waiters`` wait (its current stream) for the work queued so far on the
    current stream of each GPU of ``sources`` (itself excepted).

    CUDA orders nothing across devices by itself: a copy or kernel on one GPU that reads memory
    another GPU's stream still writes reads stale data, and one GPU's later writes (or the pool
    reusing freed memory) can overtake another GPU's queued read of it. One event is recorded per
    source GPU and join (not one per waiter and source), from a per-stream cache: joining 8 GPUs
    records 8 events instead of creating 56.

    Args:
        cupy: the ``cupy`` module.
        waiters: CUDA device ids whose current streams wait.
        sources: CUDA device ids whose queued work is waited for.
    """
    waiters = list(dict.fromkeys(int(w) for w in waiters))
    sources = [s for s in dict.fromkeys(int(s) for s in sources) if any(w != s for w in waiters)]
    if not sources:
        return
    events = {s: _event_after(cupy, s) for s in sources}
    for w in waiters:
        with cupy.cuda.Device(w):
            stream = cupy.cuda.get_current_stream()
            for s, ev in events.items():
                if s != w:
                    stream.wait_event(ev)


def order_streams(cupy: ModuleType, waiter: int, source: int) -> None:
    """Makes GPU ``waiter``'s current stream wait for the work queued so far on ``source``'s
    (:func:`join_streams` for one pair).

    Args:
        cupy: the ``cupy`` module.
        waiter: the CUDA device id whose current stream waits.
        source: the CUDA device id whose queued work is waited for.
    """
    if waiter != source:
        join_streams(cupy, (waiter,), (source,))


def _copy_across(cupy: ModuleType, a: Any, gpu: int, copy: bool) -> Any:
    """A copy of CuPy array ``a`` onto another GPU, ordered both ways against both GPUs' streams."""
    src = a.device.id
    order_streams(cupy, gpu, src)  # the copy reads what a's GPU wrote
    with cupy.cuda.Device(gpu):
        out = cupy.array(a, order="C", copy=True) if copy else cupy.asarray(a)
    order_streams(cupy, src, gpu)  # a's GPU may overwrite or free a only after the copy read it
    return out


def place(a: Any, device: _devices.DeviceLike, *, copy: bool = False) -> Array:
    """``a`` as an array on ``device``: host memory for CPUs, the memory of its physical GPU for GPUs.

    Args:
        a: a NumPy or GPU array (or anything ``np.asarray`` accepts).
        device: a device name in any spelling :func:`cudist._devices.parse_device` accepts.
        copy: always return a new, C-contiguous, writeable array; else ``a`` itself when it
            already lives on ``device`` (and a host or GPU copy otherwise).

    Returns:
        A NumPy array for CPU devices, a CuPy array for GPU devices.

    Raises:
        ValueError: ``device`` is a GPU that does not exist.
    """
    spec = _devices.parse_device(device)
    if spec.is_gpu:
        return to_gpu(a, physical_gpu(spec), copy=copy)
    host = to_host(a)
    if copy and (host is a or not is_device_array(a)):  # a GPU array's host copy is new already
        return np.array(host, order="C", copy=True)
    return host


def like(a: Any, ref: Any, *, copy: bool = False) -> Array:
    """``a`` as an array of ``ref``'s module on ``ref``'s device.

    Args:
        a: an array (or value) to convert.
        ref: a NumPy or GPU array.
        copy: always return a new array; else ``a`` itself when it already is one of ``ref``'s
            module on ``ref``'s device.

    Returns:
        A NumPy array when ``ref`` is one (or any host value), else a CuPy array on ``ref``'s GPU.
    """
    if type(ref) is np.ndarray or not is_device_array(ref):
        host = to_host(a)
        return host.copy() if copy and (host is a or not is_device_array(a)) else host
    xp = array_module(ref)
    if xp is not np and isinstance(a, xp.ndarray) and a.device.id != ref.device.id:
        return _copy_across(xp, a, ref.device.id, copy)
    with device_context(ref):
        return xp.array(a, copy=True) if copy else xp.asarray(a)


def snapshot(a: Any) -> Array:
    """A copy of array ``a`` on its own device.

    CuPy's ``ndarray.copy`` allocates on the *current* device, so a GPU array is copied with its
    own GPU made current.

    Args:
        a: a NumPy or GPU array.

    Returns:
        A new array of ``a``'s module on ``a``'s device.
    """
    if type(a) is np.ndarray:
        return a.copy()
    with device_context(a):
        return a.copy()


def contiguous(a: Any) -> Array:
    """``a`` as a C-contiguous array, copied only if it is not; 0-d arrays stay 0-d.

    (``np.ascontiguousarray`` makes 0-d arrays 1-d.) Values that are not arrays are converted by
    ``np.asarray`` first; a GPU array is copied on its own GPU.

    Args:
        a: a NumPy or GPU array, or anything ``np.asarray`` accepts.

    Returns:
        ``a`` itself when it already is a C-contiguous array, else a C-contiguous copy.
    """
    if not isinstance(a, np.ndarray):
        a = as_array(a)
    if a.flags.c_contiguous:
        return a
    if isinstance(a, np.ndarray):
        return a.copy(order="C")
    with device_context(a):
        return a.copy(order="C")


def python_dtype(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``arr``, converted from Python numbers, with the dtype TF gives Python values.

    ``tf.convert_to_tensor`` makes Python floats float32 and Python ints int32 (int64 when one does
    not fit), where NumPy picks float64 and int64.

    Args:
        arr: a NumPy array made by ``np.asarray`` from Python numbers (or nested lists of them).

    Returns:
        ``arr`` cast to float32 / int32 accordingly, else ``arr`` itself.
    """
    if arr.dtype == np.float64:
        return arr.astype(np.float32)
    if arr.dtype == np.int64 and (arr.size == 0 or (arr.min() >= _INT32.min and arr.max() <= _INT32.max)):
        return arr.astype(np.int32)
    return arr


def may_share_memory(a: Any, b: Any) -> bool:
    """Whether arrays ``a`` and ``b`` may overlap in memory (host with host, or GPU with GPU).

    Host arrays are compared by ``np.may_share_memory``; CuPy arrays by their address ranges (GPU
    addresses are unified, so arrays of different GPUs never overlap); a host and a GPU array never
    overlap.

    Args:
        a: a NumPy or GPU array.
        b: a NumPy or GPU array.
    """
    a_dev, b_dev = is_device_array(a), is_device_array(b)
    if not a_dev and not b_dev:
        return bool(np.may_share_memory(a, b))
    if a_dev != b_dev or a.nbytes == 0 or b.nbytes == 0:
        return False
    pa, pb = a.data.ptr, b.data.ptr
    return cast(bool, pa < pb + b.nbytes and pb < pa + a.nbytes)


# ---------------------------------------------------------------------------- other frameworks' arrays
#: DLPack device types (``__dlpack_device__()[0]``) whose memory CuPy imports.
_DLPACK_GPU = (2, 13)  # kDLCUDA, kDLCUDAManaged


def is_foreign_array(x: object) -> bool:
    """Whether ``x`` is another framework's array (a JAX array, a PyTorch tensor, ...).

    That is: its type exports DLPack (``__dlpack__`` and ``__dlpack_device__``) and it is neither a
    NumPy nor a CuPy array nor a cudist object (cudist Variables export DLPack too, but convert
    through ``__array__``, a copy, as they always did).
    """
    if isinstance(x, (np.ndarray, np.generic)):
        return False
    t = type(x)
    if not (hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__")):
        return False
    top = (t.__module__ or "").partition(".")[0]
    return top not in ("cupy", "cudist")


def from_dlpack(x: Any) -> Array:
    """Another framework's array as a NumPy (host) or CuPy (GPU) array sharing its memory.

    The exchange goes through DLPack (``numpy.from_dlpack`` / ``cupy.from_dlpack``): nothing is
    copied, and the result may be read-only (JAX arrays are immutable). Host memory gives NumPy
    arrays, CUDA memory CuPy arrays.

    NumPy imports no bfloat16 through DLPack; where the framework's own NumPy conversion can hold it
    (JAX gives an ``ml_dtypes.bfloat16`` array) that conversion is used instead.

    Raises:
        TypeError: the array cannot be held by NumPy (a PyTorch bfloat16 tensor, a tensor that
            requires grad, ...); the message names its type and dtype.
        ImportError: a CUDA array without CuPy; the message names the device and how to install it.
    """
    device_type, device_id = (int(v) for v in x.__dlpack_device__())
    if device_type in _DLPACK_GPU:
        try:
            import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - GPU arrays only
        except ImportError as e:
            from cudist.config import CUPY_INSTALL  # noqa: PLC0415 - only for this error

            name = f"{type(x).__module__}.{type(x).__qualname__}"
            raise ImportError(
                f"a {name} on CUDA device {device_id} (DLPack device type {device_type}) needs CuPy, which cudist "
                f"takes GPU arrays through, but CuPy cannot be imported ({e}); {CUPY_INSTALL}, or move the "
                "array to the host first"
            ) from e
        return cupy.from_dlpack(x)
    try:
        return np.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError) as e:
        error = e
    a: npt.NDArray[Any] | None
    try:
        a = np.asarray(x)
    except Exception:  # noqa: BLE001 - the DLPack error below says more
        a = None
    if a is not None and a.dtype != object:
        return a
    name = f"{type(x).__module__}.{type(x).__qualname__}"
    raise TypeError(
        f"cannot convert a {name} of dtype {getattr(x, 'dtype', '?')} to a NumPy array: {error}. cudist takes "
        "other frameworks' arrays through DLPack; NumPy holds no PyTorch bfloat16 (cast it, e.g. tensor.float()), "
        "and a PyTorch tensor that requires grad needs .detach() first"
    ) from None


def array_namespace(x: object) -> ModuleType:
    """The array module whose functions work on ``x``.

    ``numpy`` for NumPy arrays and scalars, ``cupy`` for CuPy arrays, the array's own Array API
    namespace where it has one (``jax.numpy`` for JAX arrays and tracers), else ``numpy``.
    """
    if isinstance(x, (np.ndarray, np.generic)):
        return np
    t = type(x)
    if t.__name__ == "ndarray" and t.__module__ == "cupy":
        return array_module(x)
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is not None:
        return cast(ModuleType, namespace())
    return array_module(x)
