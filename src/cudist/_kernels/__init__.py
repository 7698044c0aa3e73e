"""Kernel backends: one interface (:class:`KernelBackend`), several implementations.

``numpy`` is the reference, ``numba`` and ``native`` (the C++ extension ``cudist._core``) are the
fast CPU backends, ``cupy`` runs the shipped CUDA kernels on GPUs. Nothing here imports numba, the
extension or CuPy until a backend is first asked for.

Callers pick the backend for their buffers with :func:`backend_for` (host arrays: the CPU backend,
chosen once per process; GPU arrays: ``cupy``), validate once with the backend's ``check_*``
methods and then call its public methods or, on hot paths, ``backend.trusted``.

This package imports nothing of cudist above it: only numpy, :mod:`cudist._reduce_util`,
:mod:`cudist._devices`, :mod:`cudist._arrays` (lazily) and its own modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading

import numpy as np

from cudist import _settings
from cudist._kernels._base import (
    FLOAT_DTYPES,
    OPTIONAL_SLOTS,
    SUPPORTED_DTYPES,
    UPDATE_KERNELS,
    update_variants,
    KernelBackend,
    TrustedKernels,
    bias_corrected_lr,
    is_bfloat16,
    momentum_schedule_step,
    variant_of,
)
from cudist._kernels._cuda_launch import launch_policy as cuda_launch_policy
from cudist._kernels._split import split, split_sizes

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "KernelBackend",
    "TrustedKernels",
    "SUPPORTED_DTYPES",
    "FLOAT_DTYPES",
    "is_bfloat16",
    "available_backends",
    "get_backend",
    "default_cpu_backend",
    "backend_for",
    "cpu_backend",
    "numpy_backend",
    "reset_backend_cache",
    "bias_corrected_lr",
    "momentum_schedule_step",
    "UPDATE_KERNELS",
    "OPTIONAL_SLOTS",
    "update_variants",
    "variant_of",
    "split",
    "split_sizes",
    "reference_reduce",
    "cuda_launch_policy",
]

#: Every backend name, in order of preference for CPU buffers.
BACKENDS = ("native", "numba", "numpy", "cupy")
_CPU_PREFERENCE = ("native", "numba", "numpy")
_MODULES = {
    "numpy": ("cudist._kernels._numpy", "NumpyBackend"),
    "numba": ("cudist._kernels._numba", "NumbaBackend"),
    "native": ("cudist._kernels._native", "NativeBackend"),
    "cupy": ("cudist._kernels._cupy", "CupyBackend"),
}
# What must be importable for each backend; checked without importing it.
_REQUIRES = {"numpy": (), "numba": ("numba",), "native": ("cudist._core",), "cupy": ("cupy",)}

_lock = threading.Lock()
_instances: dict[str, KernelBackend] = {}


class BackendUnavailableError(RuntimeError):
    """A kernel backend was asked for by name but cannot be used on this machine."""


def _importable(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def available_backends() -> list[str]:
    """Names of the backends whose requirements are installed (not yet imported)."""
    return [name for name in BACKENDS if all(_importable(m) for m in _REQUIRES[name])]


def _load(name: str) -> KernelBackend:
    with _lock:
        inst = _instances.get(name)
        if inst is None:
            missing = [m for m in _REQUIRES[name] if not _importable(m)]
            if missing:
                raise BackendUnavailableError(
                    f"kernel backend {name!r} is not available: cannot import {', '.join(missing)}"
                    + (" (install cudist[cuda])" if name == "cupy" else "")
                )
            mod_name, cls_name = _MODULES[name]
            try:
                cls = getattr(importlib.import_module(mod_name), cls_name)
                inst = cls()
            except BackendUnavailableError:
                raise
            except Exception as e:  # a broken install must name the backend, not fail obscurely later
                raise BackendUnavailableError(f"kernel backend {name!r} failed to load: {type(e).__name__}: {e}") from e
            _instances[name] = inst
        return inst


def get_backend(name: str | None = None) -> KernelBackend:
    """Returns a kernel backend.

    Args:
        name: "numpy", "numba", "native" or "cupy". When None, ``CUDIST_BACKEND`` decides if set,
            else the first available of native, numba, numpy.

    Raises:
        ValueError: the name is not a backend.
        BackendUnavailableError: the backend is known but cannot be used here.
    """
    if name is None:
        name = _settings.backend()
    if name is None:
        return default_cpu_backend()
    key = str(name).strip().lower()
    if key not in _MODULES:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return _load(key)


def default_cpu_backend() -> KernelBackend:
    """The fastest CPU backend that loads (native, else numba, else numpy)."""
    for name in _CPU_PREFERENCE:
        try:
            return _load(name)
        except BackendUnavailableError:
            continue
    raise AssertionError("the numpy backend always loads")  # pragma: no cover


_chosen: dict[str, KernelBackend] = {}


def cpu_backend() -> KernelBackend:
    """The kernel backend for host buffers (``get_backend()``), chosen once per process.

    ``get_backend()`` reads ``CUDIST_BACKEND`` and re-probes unavailable backends on every call
    (microseconds); a collective runs at every training step, so the choice is made when the first
    one runs. :func:`reset_backend_cache` makes a later ``CUDIST_BACKEND`` take effect.
    """
    b = _chosen.get("cpu")
    if b is None:
        b = get_backend()
        if b.xp is not np:  # CUDIST_BACKEND=cupy must not break host values: they get the CPU default
            b = default_cpu_backend()
        _chosen["cpu"] = b
    return b


def reset_backend_cache() -> None:
    """Forgets the chosen CPU backend (tests changing ``CUDIST_BACKEND`` call this)."""
    _chosen.clear()


def numpy_backend() -> KernelBackend:
    """The NumPy reference backend (every dtype of the contract, any host buffer)."""
    return _instances.get("numpy") or _load("numpy")


def backend_for(a) -> KernelBackend:
    """The kernel backend for buffers like ``a``: :func:`cpu_backend` for host arrays, ``cupy`` for GPU arrays.

    The CuPy backend is loaded only when a GPU array shows up.
    """
    if type(a) is np.ndarray:
        return _chosen.get("cpu") or cpu_backend()
    from cudist._arrays import is_device_array  # noqa: PLC0415 - only for what is not a NumPy array

    if not is_device_array(a):
        return cpu_backend()
    return get_backend("cupy")


def reference_reduce(arrays, op):
    """The NumPy reference reduction (replica order) of same-shape host arrays into a new array."""
    from cudist._kernels._numpy import reference_reduce as ref  # noqa: PLC0415 - the reference loads on demand

    return ref(arrays, op)

