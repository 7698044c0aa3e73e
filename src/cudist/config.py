"""Device configuration (``tf.config``'s device functions, for the devices cudist knows).

CPU replicas are logical devices over host memory: ``set_logical_device_configuration`` on the
physical CPU decides how many "/cpu:N" devices :func:`list_logical_devices` reports (one by default,
as in TensorFlow). On a GPU it splits one physical GPU into several logical ones. GPUs are counted
through CuPy only when GPUs are asked about, never at ``import cudist``. :func:`set_replica_execution`
chooses how CPU replicas execute (greenlets or threads; see :mod:`cudist._replica_engine`).
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

from cudist import _settings
from cudist._devices import CPU, GPU, local_task

__all__ = [
    "PhysicalDevice",
    "LogicalDevice",
    "LogicalDeviceConfiguration",
    "list_physical_devices",
    "list_logical_devices",
    "set_logical_device_configuration",
    "get_logical_device_configuration",
    "gpu_unavailable_reason",
    "cuda_versions",
    "nccl_package",
    "REPLICA_EXECUTION_MODES",
    "set_replica_execution",
    "get_replica_execution",
]


class PhysicalDevice(NamedTuple):
    """A physical device (``tf.config.PhysicalDevice``), e.g. "/physical_device:GPU:0"."""

    name: str
    device_type: str


class LogicalDevice(NamedTuple):
    """A logical device (``tf.config.LogicalDevice``), e.g. "/device:CPU:1"; what replicas run on."""

    name: str
    device_type: str


class LogicalDeviceConfiguration(NamedTuple):
    """One logical device to carve out of a physical one (``tf.config.LogicalDeviceConfiguration``).

    Attributes:
        memory_limit: MiB of GPU memory for the logical device (None: no limit). Checked (a
            positive int or None) but **not enforced** -- a deliberate difference from TF, which gives
            each logical GPU its own allocator capped at this size so one replica running out of
            memory raises ResourceExhaustedError while the others are unaffected. Here every logical
            GPU of a physical GPU allocates from CuPy's memory pool of that GPU: the replicas run as
            greenlets on one thread and CuPy chooses its allocator per thread, so there is no point
            where a per-replica cap could be applied robustly (arrays also outlive the replica step
            that made them: input, variables, collective results). To cap the total, use CuPy's own
            ``cupy.get_default_memory_pool().set_limit(size=...)`` on that GPU.
        experimental_priority: accepted for TF compatibility; unused.
        experimental_device_ordinal: accepted for TF compatibility; unused.
    """

    memory_limit: int | None = None
    experimental_priority: int | None = None
    experimental_device_ordinal: int | None = None


_lock = threading.Lock()
_logical: dict[str, list[LogicalDeviceConfiguration]] = {}


_gpu_count_cache: list[int] = []
_gpu_error: list[str] = []  # why _gpu_count() found no GPU (set with the count)

#: The pip extra matching each CUDA major version of CuPy (see the README's GPUs section).
CUDA_EXTRAS = {12: "cudist[cuda12]", 13: "cudist[cuda13]"}
#: How to install CuPy, for errors that need it.
CUPY_INSTALL = "pip install 'cudist[cuda13]' (or 'cudist[cuda12]' for a CUDA 12 driver)"


def _version(v: int) -> str:
    """A CUDA version number (``13020``) as CUDA prints it (``13.2``)."""
    return f"{v // 1000}.{v % 1000 // 10}"


def cuda_versions() -> dict[str, str]:
    """CuPy's and the CUDA driver's versions, without initialising CUDA (no context, no device count).

    Returns:
        Keys ``cupy``, ``cuda_runtime`` (the CUDA runtime CuPy was built with), ``driver`` (the
        newest CUDA the installed driver supports, or "none found"), ``nvrtc`` and ``nccl`` where
        they can be read; ``cupy`` says why when CuPy cannot be imported. Empty values are left out.
    """
    out: dict[str, str] = {}
    try:
        cupy = importlib.import_module("cupy")
    except Exception as e:  # noqa: BLE001 - a diagnostic reports any failure
        out["cupy"] = f"not importable ({type(e).__name__}: {e})"
        return out
    out["cupy"] = str(getattr(cupy, "__version__", "?"))
    rt = getattr(getattr(cupy, "cuda", None), "runtime", None)
    for key, fn in (("cuda_runtime", "runtimeGetVersion"), ("driver", "driverGetVersion")):
        try:
            v = int(getattr(rt, fn)())
        except Exception as e:  # noqa: BLE001
            out[key] = f"unknown ({type(e).__name__}: {e})"
            continue
        out[key] = _version(v) if v else "none found (no libcuda.so.1: is the NVIDIA driver installed?)"
    try:
        nvrtc = getattr(cupy.cuda, "nvrtc", None) or importlib.import_module("cupy_backends.cuda.libs.nvrtc")
        out["nvrtc"] = ".".join(str(x) for x in nvrtc.getVersion())
    except Exception as e:  # noqa: BLE001
        out["nvrtc"] = f"not loadable ({type(e).__name__}: {e})"
    try:
        with warnings.catch_warnings():  # CuPy warns when libnccl is missing; the line below says so
            warnings.simplefilter("ignore")
            nccl = importlib.import_module("cupy.cuda.nccl")
        if getattr(nccl, "available", False):
            v = int(nccl.get_version())
            out["nccl"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else str(v)
        else:
            out["nccl"] = f"not loadable ({nccl_package()} installs it)"
    except Exception as e:  # noqa: BLE001
        out["nccl"] = f"not importable ({type(e).__name__}: {e})"
    return out


def cuda_major() -> int | None:
    """The CUDA major version CuPy was built for (12, 13), or None without a working CuPy."""
    try:
        cupy = importlib.import_module("cupy")
        return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001
        return None


def nccl_package() -> str:
    """The pip package with the NCCL that this CuPy loads (``nvidia-nccl-cu13`` for CUDA 13)."""
    major = cuda_major()
    return f"nvidia-nccl-cu{major}" if major else "nvidia-nccl-cu13 (CUDA 13) or nvidia-nccl-cu12 (CUDA 12)"


def _driver_hint(cupy: Any) -> str:
    """What the driver and CuPy versions say about a failed CUDA call ("" when nothing)."""
    try:
        rt = cupy.cuda.runtime
        drv, built = int(rt.driverGetVersion()), int(rt.runtimeGetVersion())
    except Exception:  # noqa: BLE001
        return ""
    if drv == 0:
        return "; no NVIDIA driver was found (libcuda.so.1 is not loadable)"
    if drv // 1000 < built // 1000:
        need = " (CUDA 13 needs driver R580 or newer)" if built // 1000 == 13 else ""
        other = CUDA_EXTRAS.get(drv // 1000)
        fix = f", or install the CuPy for CUDA {drv // 1000}: pip install '{other}'" if other else ""
        return (
            f"; the driver supports CUDA {_version(drv)} but CuPy {getattr(cupy, '__version__', '?')} is built for "
            f"CUDA {_version(built)}: update the driver{need}{fix}"
        )
    return f"; driver CUDA {_version(drv)}, CuPy built for CUDA {_version(built)}"


def _gpu_count() -> int:
    """How many physical GPUs CuPy sees (0 without CuPy, a driver or a device); counted once.

    Input pipelines map logical to physical GPUs for every batch, so the count (an import attempt
    and a driver call) is not repeated; tests fake other machines by replacing this function. Why
    the count is 0 is kept for :func:`gpu_unavailable_reason`.
    """
    if _gpu_count_cache:
        return _gpu_count_cache[0]
    why = ""
    try:
        # Only when GPUs are asked about; by name, so type checkers need no CuPy stubs.
        cupy = importlib.import_module("cupy")
    except ImportError as e:
        n, why = 0, f"CuPy is not installed ({e}): {CUPY_INSTALL}"
    except Exception as e:  # noqa: BLE001 - a broken CuPy install: say how it broke
        n, why = 0, f"importing CuPy failed ({type(e).__name__}: {e})"
    else:
        try:
            n = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as e:  # noqa: BLE001 - no driver, an old driver, no device: keep CUDA's own words
            n, why = 0, f"CUDA failed to count the GPUs ({e}){_driver_hint(cupy)}"
        else:
            if n == 0:
                why = "CUDA reports no GPU"
    _gpu_count_cache.append(n)
    if why:
        _gpu_error.append(why)
    return n


def gpu_unavailable_reason() -> str | None:
    """Why no GPU is visible through CuPy (CUDA's own error and what to do), or None when one is."""
    if _gpu_count():
        return None
    return _gpu_error[0] if _gpu_error else "no GPU is visible through CuPy"


def _check_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    t = str(device_type).upper()
    if t not in (CPU, GPU):
        raise ValueError(f"unknown device type {device_type!r}; expected 'CPU' or 'GPU'")
    return t


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The physical devices: one CPU, and each GPU CuPy sees."""
    t = _check_type(device_type)
    out: list[PhysicalDevice] = []
    if t in (None, CPU):
        out.append(PhysicalDevice("/physical_device:CPU:0", CPU))
    if t in (None, GPU):
        out.extend(PhysicalDevice(f"/physical_device:GPU:{i}", GPU) for i in range(_gpu_count()))
    return out


def _physical(device: PhysicalDevice | str) -> PhysicalDevice:
    if isinstance(device, PhysicalDevice):
        return device
    if isinstance(device, str):
        for d in list_physical_devices():
            if d.name.lower() == device.lower():
                return d
    raise ValueError(f"unknown physical device {device!r}; list them with cudist.config.list_physical_devices()")


def set_logical_device_configuration(
    device: PhysicalDevice | str, logical_devices: Iterable[LogicalDeviceConfiguration] | None
) -> None:
    """Splits a physical device into logical ones (None restores one logical device per physical).

    Unlike TF, this may be called at any time (there is no runtime to initialize first), and GPU
    ``memory_limit`` values are validated but not enforced (see :class:`LogicalDeviceConfiguration`).

    Raises:
        ValueError: the device is unknown, or the list is empty.
    """
    dev = _physical(device)
    with _lock:
        if logical_devices is None:
            _logical.pop(dev.name, None)
            return
        confs = list(logical_devices)
        if not confs:
            raise ValueError(f"set_logical_device_configuration: {dev.name} needs at least one logical device")
        for c in confs:
            if not isinstance(c, LogicalDeviceConfiguration):
                raise TypeError(f"expected LogicalDeviceConfiguration entries, got {type(c).__name__}")
            m = c.memory_limit
            if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m <= 0):
                raise ValueError(
                    f"set_logical_device_configuration: memory_limit must be a positive number of MiB or None, got {m!r}"
                )
        _logical[dev.name] = confs


def get_logical_device_configuration(device: PhysicalDevice | str) -> list[LogicalDeviceConfiguration] | None:
    """The logical configuration set for a physical device, or None."""
    dev = _physical(device)
    with _lock:
        confs = _logical.get(dev.name)
        return list(confs) if confs is not None else None


def logical_to_physical_gpu() -> list[int]:
    """For each logical GPU index, the physical GPU (CUDA device id) it lives on.

    Logical GPUs are numbered physical GPU by physical GPU: splitting GPU 0 into 4 gives
    "/gpu:0".."/gpu:3" on GPU 0, and GPU 1 (unsplit) becomes "/gpu:4".
    """
    out: list[int] = []
    for i in range(_gpu_count()):
        confs = _logical.get(f"/physical_device:GPU:{i}")
        out.extend([i] * (len(confs) if confs else 1))
    return out


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    """The logical devices, named "/device:CPU:N" and "/device:GPU:N".

    In a multi-worker job (once its strategy exists) they are named by the worker's task, as TF
    names them: "/job:worker/replica:0/task:1/device:CPU:0". TF lists the other tasks' devices after
    the local ones; cudist lists the local ones only (a worker places values on its own devices).
    """
    t = _check_type(device_type)
    out: list[LogicalDevice] = []
    task = local_task()
    prefix = "" if task is None else f"/job:{task[0]}/replica:0/task:{task[1]}"
    if t in (None, CPU):
        n = len(_logical.get("/physical_device:CPU:0") or [None])
        out.extend(LogicalDevice(f"{prefix}/device:CPU:{i}", CPU) for i in range(n))
    if t in (None, GPU):
        out.extend(LogicalDevice(f"{prefix}/device:GPU:{i}", GPU) for i in range(len(logical_to_physical_gpu())))
    return out


# ---------------------------------------------------------------------------------------- replica execution
#: How the replicas of ``strategy.run`` may execute (see :func:`set_replica_execution`).
REPLICA_EXECUTION_MODES = ("auto", "greenlets", "threads")
#: The environment variable that gives the initial mode (read on first use).
REPLICA_EXECUTION_ENV = "CUDIST_REPLICA_EXECUTION"
_replica_execution: list[str] = []  # the mode once read or set (a list: set from any thread, no global)


def _check_mode(mode: object, where: str) -> str:
    if not isinstance(mode, str) or mode.strip().lower() not in REPLICA_EXECUTION_MODES:
        raise ValueError(
            f"{where}: replica execution must be one of {', '.join(map(repr, REPLICA_EXECUTION_MODES))}, got {mode!r}"
        )
    return mode.strip().lower()


def set_replica_execution(mode: str) -> None:
    """Chooses how the replicas of ``strategy.run`` execute on CPU devices (a cudist extension).

    * ``"auto"`` (the default): replicas run one after the other on greenlets of the calling thread
      (a no-op ``run`` costs microseconds) until the measured replica work of a step function
      averages over ~1 ms per run; then threads are tried and kept if they are at least 5% faster
      (needs a BLAS whose thread count cudist can limit: OpenBLAS, as NumPy's wheels bundle, or MKL).
    * ``"greenlets"``: always one after the other.
    * ``"threads"``: each replica on a persistent thread of its own, so replicas' NumPy work
      overlaps; while they compute, the BLAS gets ``max(1, its threads // N)`` threads each.

    GPU replicas and one-replica strategies never use threads. The initial mode comes from the
    ``CUDIST_REPLICA_EXECUTION`` environment variable when set. Takes effect at the next ``run``.

    Args:
        mode: "auto", "greenlets" or "threads" (any case).

    Raises:
        ValueError: any other value.
    """
    m = _check_mode(mode, "set_replica_execution")
    with _lock:
        _replica_execution[:] = [m]


def get_replica_execution() -> str:
    """The replica execution mode: "auto", "greenlets" or "threads" (see :func:`set_replica_execution`).

    Raises:
        ValueError: ``$CUDIST_REPLICA_EXECUTION`` holds another value (and no mode was set).
    """
    if _replica_execution:
        return _replica_execution[0]
    m = _settings.replica_execution() or "auto"
    with _lock:
        if not _replica_execution:
            _replica_execution.append(m)
        return _replica_execution[0]
