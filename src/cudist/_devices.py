"""Device names: parsing the spellings tf.distribute accepts, and the canonical long form.

"/cpu:0", "CPU:0", "cpu", "/device:GPU:1", "/gpu:1" and
"/job:localhost/replica:0/task:0/device:GPU:0" all parse; :func:`canonicalize` returns
"/job:localhost/replica:0/task:0/device:CPU:0" style names, which is what ``.device`` attributes show.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import NamedTuple, Protocol, TypeAlias

__all__ = ["DeviceSpec", "DeviceLike", "parse_device", "canonicalize", "any_gpu", "CPU", "GPU"]

CPU = "CPU"
GPU = "GPU"
_PREFIX = "/job:localhost/replica:0/task:0"
_JOB = re.compile(r"^(?:/?job:localhost)?(?:/replica:0)?(?:/task:0)?(?=/|$)", re.IGNORECASE)
_DEV = re.compile(r"^/?(?:device:)?(cpu|gpu)(?::(\d+))?$", re.IGNORECASE)


class DeviceSpec(NamedTuple):
    """A parsed local device: its type ("CPU" or "GPU") and index."""

    device_type: str
    device_index: int

    @property
    def name(self) -> str:
        """The canonical long name, e.g. "/job:localhost/replica:0/task:0/device:GPU:1"."""
        return f"{_PREFIX}/device:{self.device_type}:{self.device_index}"

    @property
    def short_name(self) -> str:
        """The short name, e.g. "/device:GPU:1"."""
        return f"/device:{self.device_type}:{self.device_index}"

    @property
    def is_gpu(self) -> bool:
        """Whether this is a GPU."""
        return self.device_type == GPU


class _Named(Protocol):
    """An object naming a device by its ``name`` (a DeviceSpec, a LogicalDevice)."""

    @property
    def name(self) -> str: ...


#: What names a device: a string in any spelling above, a DeviceSpec, or an object with a ``name``.
DeviceLike: TypeAlias = "str | _Named"


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> DeviceSpec:
    rest = _JOB.sub("", text.strip())
    m = _DEV.match(rest)
    if not m:
        raise ValueError(
            f"invalid device {text!r}: expected a local CPU or GPU device such as '/cpu:0', 'GPU:1', "
            f"'/device:GPU:0' or '/job:localhost/replica:0/task:0/device:CPU:0'"
        )
    return DeviceSpec(m.group(1).upper(), int(m.group(2) or 0))


def parse_device(device: DeviceLike) -> DeviceSpec:
    """Parses a device string (or DeviceSpec, or an object with a ``name``, such as LogicalDevice).

    Raises:
        ValueError: the string names no local CPU/GPU device (another job or task, another type).
        TypeError: ``device`` is not a string.
    """
    if isinstance(device, DeviceSpec):
        return device
    name = getattr(device, "name", device)
    if not isinstance(name, str):
        raise TypeError(f"a device must be a string such as '/cpu:0' or '/gpu:0', got {type(device).__name__}")
    return _parse(name)


def canonicalize(device: DeviceLike) -> str:
    """Returns the canonical long name of ``device``."""
    return parse_device(device).name


def any_gpu(devices: Iterable[DeviceLike]) -> bool:
    """Whether any of ``devices`` (in any spelling :func:`parse_device` accepts) is a GPU."""
    return any(parse_device(d).is_gpu for d in devices)
