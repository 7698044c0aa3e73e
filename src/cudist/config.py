"""Device configuration (``tf.config``'s device functions, for the devices cudist knows).

CPU replicas are logical devices over host memory: ``set_logical_device_configuration`` on the
physical CPU decides how many "/cpu:N" devices :func:`list_logical_devices` reports (one by default,
as in TensorFlow). On a GPU it splits one physical GPU into several logical ones. GPUs are counted
through CuPy only when GPUs are asked about, never at ``import cudist``.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable
from typing import NamedTuple

from cudist._devices import CPU, GPU

__all__ = [
    "PhysicalDevice",
    "LogicalDevice",
    "LogicalDeviceConfiguration",
    "list_physical_devices",
    "list_logical_devices",
    "set_logical_device_configuration",
    "get_logical_device_configuration",
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


def _gpu_count() -> int:
    """How many physical GPUs CuPy sees (0 without CuPy, a driver or a device); counted once.

    Input pipelines map logical to physical GPUs for every batch, so the count (an import attempt
    and a driver call) is not repeated; tests fake other machines by replacing this function.
    """
    if _gpu_count_cache:
        return _gpu_count_cache[0]
    try:
        # Only when GPUs are asked about; by name, so type checkers need no CuPy stubs.
        cupy = importlib.import_module("cupy")
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device: no GPUs
        n = 0
    _gpu_count_cache.append(n)
    return n


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
    """The logical devices, named "/device:CPU:N" and "/device:GPU:N"."""
    t = _check_type(device_type)
    out: list[LogicalDevice] = []
    if t in (None, CPU):
        n = len(_logical.get("/physical_device:CPU:0") or [None])
        out.extend(LogicalDevice(f"/device:CPU:{i}", CPU) for i in range(n))
    if t in (None, GPU):
        out.extend(LogicalDevice(f"/device:GPU:{i}", GPU) for i in range(len(logical_to_physical_gpu())))
    return out
