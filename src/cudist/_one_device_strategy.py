"""``OneDeviceStrategy``: everything on one device, through the Strategy API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cudist import _devices
from cudist._distribute_lib import Strategy, StrategyExtended
from cudist._input_lib import ValueContext, distribute_values_from_function

__all__ = ["OneDeviceStrategy"]


class OneDeviceExtended(StrategyExtended):
    """Extended API of :class:`OneDeviceStrategy`: one replica; variables are plain, on the device.

    Variable creation is the base class's (a plain variable on the device).
    """

    def _distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """As TF's OneDeviceStrategy: the value function's plain result, not a PerReplica."""
        return distribute_values_from_function(value_fn, self._container_strategy(), wrap_single=False)


class OneDeviceStrategy(Strategy):
    """Runs on a single device (``tf.distribute.OneDeviceStrategy``).

    Variables created in its scope are plain variables on ``device``; ``run`` calls the function once,
    in a replica context of one replica.

    Args:
        device: the device, e.g. "/cpu:0" or "/gpu:0".

    Raises:
        ValueError: ``device`` is not a local CPU/GPU device string.
    """

    def __init__(self, device: _devices.DeviceLike) -> None:
        super().__init__(OneDeviceExtended(self, (_devices.canonicalize(device),)))

    def __repr__(self) -> str:
        return f"<cudist.OneDeviceStrategy device={self._extended.worker_devices[0]!r}>"
