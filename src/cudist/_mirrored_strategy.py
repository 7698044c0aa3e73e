"""``MirroredStrategy``: synchronous replicas, one per device, with mirrored variables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cudist._devices import canonicalize
from cudist._distribute_lib import Strategy, StrategyExtended, parse_devices
from cudist._variables import Variable, create_in_replica_context, create_mirrored_variable

if TYPE_CHECKING:
    from cudist._cross_device_ops import CrossDeviceOps
    from cudist._devices import DeviceLike

__all__ = ["MirroredStrategy"]


class MirroredExtended(StrategyExtended):
    """Extended API of :class:`MirroredStrategy`: variables get one component per replica device."""

    def _create_variable(self, next_creator: Callable[..., object], **kwargs: Any) -> Variable:
        """A MirroredVariable (SyncOnReadVariable for ON_READ) with one component per variable device.

        Created inside ``run``, one variable is made in a ``merge_call`` and shared by every replica.
        """
        del next_creator  # every component is built here, one per device
        strategy = self._container_strategy()
        var: Variable | None = create_in_replica_context(strategy, kwargs)
        if var is None:
            var = create_mirrored_variable(strategy, self._variable_devices(), **kwargs)
        return var


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one machine (``tf.distribute.MirroredStrategy``).

    Each replica runs the step function on its own device; variables are mirrored (one copy per
    device) and kept in sync by all-reduce.

    Args:
        devices: device strings, one replica each; None or an empty list (as TF 2.21): every
            logical GPU, else every logical CPU.
        cross_device_ops: a :class:`cudist.CrossDeviceOps` (default: the fused all-reduce kernels).

    Raises:
        ValueError: duplicate devices, a device that is not configured (see
            ``cudist.config.set_logical_device_configuration``), or cross-device ops that cannot
            run on them (NcclAllReduce on CPUs).
    """

    def __init__(
        self, devices: Sequence[DeviceLike] | None = None, cross_device_ops: CrossDeviceOps | None = None
    ) -> None:
        if devices is None or (isinstance(devices, (list, tuple)) and not devices):
            devs = _all_local_devices()
        else:
            devs = parse_devices(devices, "MirroredStrategy")
        super().__init__(MirroredExtended(self, devs, cross_device_ops))


def _all_local_devices() -> tuple[str, ...]:
    """TF's default for MirroredStrategy: every logical GPU, else every logical CPU."""
    from cudist import config

    return tuple(canonicalize(d.name) for d in config.list_logical_devices("GPU") or config.list_logical_devices("CPU"))
