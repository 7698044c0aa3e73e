"""Device names: parsing the spellings tf.distribute accepts, and the canonical long form.

"/cpu:0", "CPU:0", "cpu", "/device:GPU:1", "/gpu:1" and
"/job:localhost/replica:0/task:0/device:GPU:0" all parse; :func:`canonicalize` returns
"/job:localhost/replica:0/task:0/device:CPU:0" style names, the names cudist works with internally.

In a multi-worker job TF names a worker's devices by its task ("/job:worker/replica:0/task:1/device:CPU:0")
in ``worker_devices``, ``parameter_devices`` and ``variable.device``. The multi-worker strategy tells
this module the process's task (:func:`set_local_task`); :func:`display_name` then shows a canonical
name under it, and the parser accepts that spelling too, so a name read back from ``.device`` (or
written by a user in either form) parses to the same device. Internally everything stays localhost.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import NamedTuple, Protocol, TypeAlias

__all__ = [
    "DeviceSpec",
    "DeviceLike",
    "parse_device",
    "canonicalize",
    "display_name",
    "set_local_task",
    "local_task",
    "any_gpu",
    "CPU",
    "GPU",
]

CPU = "CPU"
GPU = "GPU"
_PREFIX = "/job:localhost/replica:0/task:0"
_JOB = re.compile(r"^(?:/?job:([A-Za-z_][\w-]*))?(?:/replica:(\d+))?(?:/task:(\d+))?(?=/|$)", re.IGNORECASE)
#: (job, task) of this process in a multi-worker cluster, set by the multi-worker strategy; None otherwise.
_local_task: tuple[str, int] | None = None
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


def set_local_task(job: str | None, task: int = 0) -> None:
    """Names this process's devices by its cluster task (``job=None``: by localhost again).

    Args:
        job: the task's type ("worker", "chief"), or None for a process outside a multi-worker cluster.
        task: the task's index.
    """
    global _local_task  # noqa: PLW0603 - the process's place in its cluster, as TF's context holds it
    _local_task = None if job is None else (str(job), int(task))
    _parse.cache_clear()


def local_task() -> tuple[str, int] | None:
    """The (job, task) set by :func:`set_local_task`, or None."""
    return _local_task


def _is_local(job: str | None, replica: str | None, task: str | None) -> bool:
    """Whether a name's job/replica/task prefix (parts None where absent) names this process."""
    if replica is not None and int(replica) != 0:
        return False
    if job is None or job.lower() == "localhost":
        return task is None or int(task) == 0 or (job is None and _local_task is not None and int(task) == _local_task[1])
    return _local_task is not None and job == _local_task[0] and (task is None or int(task) == _local_task[1])


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> DeviceSpec:
    text = text.strip()
    prefix = _JOB.match(text)
    rest = text[prefix.end():] if prefix and _is_local(*prefix.groups()) else text
    m = _DEV.match(rest)
    if not m:
        here = "" if _local_task is None else f" (this process is /job:{_local_task[0]}/replica:0/task:{_local_task[1]})"
        remote = " names another task's device" if prefix and prefix.group(0) and rest is text else ""
        raise ValueError(
            f"invalid device {text!r}{remote}{here}: expected a local CPU or GPU device such as '/cpu:0', 'GPU:1', "
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


def display_name(canonical: str) -> str:
    """The name users see for a canonical device name: under this process's task when one is set.

    Args:
        canonical: a name as :func:`canonicalize` returns it.

    Returns:
        ``canonical`` itself outside a multi-worker cluster, else e.g.
        "/job:worker/replica:0/task:1/device:CPU:0".
    """
    if _local_task is None or not canonical.startswith(_PREFIX):
        return canonical
    job, task = _local_task
    return f"/job:{job}/replica:0/task:{task}{canonical[len(_PREFIX):]}"


def any_gpu(devices: Iterable[DeviceLike]) -> bool:
    """Whether any of ``devices`` (in any spelling :func:`parse_device` accepts) is a GPU."""
    return any(parse_device(d).is_gpu for d in devices)
