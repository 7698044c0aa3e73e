"""``OneDeviceStrategy``: everything on one device, through the Strategy API."""

from __future__ import annotations

from cudist import _devices
from cudist._distribute_lib import Strategy, StrategyExtended

__all__ = ["OneDeviceStrategy"]


class OneDeviceExtended(StrategyExtended):
    """Extended API of :class:`OneDeviceStrategy`: one replica; variables are plain, on the device."""

    _variable_policy = "plain"


class OneDeviceStrategy(Strategy):
    """Runs on a single device (``tf.distribute.OneDeviceStrategy``).

    Variables created in its scope are plain variables on ``device``; ``run`` calls the function once,
    in a replica context of one replica.

    Args:
        device: the device, e.g. "/cpu:0" or "/gpu:0".

    Raises:
        ValueError: ``device`` is not a local CPU/GPU device string.
    """

    def __init__(self, device):
        super().__init__(OneDeviceExtended(self, (_devices.canonicalize(device),)))

    def __repr__(self) -> str:
        return f"<cudist.OneDeviceStrategy device={self._extended.worker_devices[0]!r}>"
