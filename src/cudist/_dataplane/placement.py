"""Where reductions go: destinations, results placed on them, and the GPU layout of a device list."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeAlias

from cudist import _devices
from cudist._arrays import Array, physical_gpu, place, snapshot, to_host
from cudist._values import DistributedValues, Mirrored

__all__ = ["resolve_destinations", "on_destinations", "gpu_layout", "describe_layout"]


class _OnDevice(Protocol):
    """Anything with a ``device`` name (a variable, a component of a distributed value)."""

    @property
    def device(self) -> str: ...


#: Where a reduction goes (TF's ``destinations``): a device string, a list of them, a
#: DistributedValues or variable (the devices of its components), or anything with a ``device``.
Destinations: TypeAlias = "str | Sequence[_devices.DeviceLike] | DistributedValues | _OnDevice"


def resolve_destinations(destinations: Destinations | None, where: str = "reduce") -> tuple[str, ...]:
    """Canonical device names of ``destinations``: a device string, a list of them, a DistributedValues
    or variable (the devices of its components), or anything with a ``device``.

    Args:
        destinations: see :data:`Destinations`.
        where: the caller's name, for error messages.

    Raises:
        ValueError: None, an empty list, or destinations naming no device.
    """
    if destinations is None:
        raise ValueError(f"{where}: destinations must not be None")
    if isinstance(destinations, str):
        return (_devices.canonicalize(destinations),)
    if isinstance(destinations, DistributedValues):
        devs = []
        for v in destinations.values:
            d = getattr(v, "device", None)
            if isinstance(d, str) and d:
                devs.append(_devices.canonicalize(d))
        if devs:
            return tuple(devs)
        raise ValueError(f"{where}: cannot tell the devices of destinations {destinations!r}")
    if isinstance(destinations, (list, tuple)):
        if not destinations:
            raise ValueError(f"{where}: destinations must not be empty")
        return tuple(_devices.canonicalize(d) for d in destinations)
    d = getattr(destinations, "device", None)
    if isinstance(d, str) and d:
        return (_devices.canonicalize(d),)
    raise ValueError(f"{where}: invalid destinations {destinations!r}; expected a device string, a list of them, "
                     "or a distributed value or variable")


def on_destinations(result: Any, devices: Sequence[str]) -> Array | Mirrored:
    """One result per destination device: the array itself for one, a Mirrored of copies for many.

    Host results for CPU destinations stay host arrays (the first is ``result`` itself); GPU
    destinations get a CuPy array on their physical GPU (``result`` itself where it already is).
    """
    if not _devices.any_gpu(devices):
        if len(devices) == 1:
            return to_host(result)
        result = to_host(result)
        return Mirrored([result] + [result.copy() for _ in devices[1:]])
    placed: list[Array]
    seen: set[int]
    placed, seen = [], set()
    for d in devices:
        p = place(result, d)
        if id(p) in seen:  # two logical devices on one physical GPU: each gets its own copy
            p = snapshot(p)
        seen.add(id(p))
        placed.append(p)
    return placed[0] if len(placed) == 1 else Mirrored(placed)


def gpu_layout(devices: Iterable[_devices.DeviceLike]) -> tuple[int, ...] | None:
    """The physical GPU of each device, or None when every device is a CPU.

    Args:
        devices: device names (any spelling :func:`cudist._devices.parse_device` accepts).

    Returns:
        None for CPU devices; for GPU devices a tuple with the CUDA device id of each (logical GPUs
        split from one physical GPU share its id).

    Raises:
        ValueError: CPU and GPU devices are mixed, or a GPU does not exist.
    """
    specs = [_devices.parse_device(d) for d in devices]
    gpus = [s for s in specs if s.is_gpu]
    if not gpus:
        return None
    if len(gpus) != len(specs):
        cpu = next(s for s in specs if not s.is_gpu)
        raise ValueError(
            f"cannot mix CPU and GPU devices in one strategy: got {cpu.name!r} and {gpus[0].name!r}; "
            "replicas on CPUs hold NumPy arrays and replicas on GPUs CuPy arrays, which are not reduced together. "
            "Use only GPU devices or only CPU devices"
        )
    return tuple(physical_gpu(s) for s in specs)


def describe_layout(physical: Sequence[int]) -> str:
    """"4 GPUs" or "4 logical GPUs on 2 physical GPUs"."""
    n, p = len(physical), len(set(physical))
    if n == p:
        return f"{n} GPU{'s' if n != 1 else ''}"
    return f"{n} logical GPUs on {p} physical GPU{'s' if p != 1 else ''}"
