"""``CentralStorageStrategy``: replicated computation, variables stored once on a parameter device.

With GPU compute devices and a CPU parameter device (TF's default with several GPUs) the variables
are NumPy arrays in host memory; a replica reading one gets a CuPy copy on its own GPU (TF copies
the variable to the compute device), and the replicas' updates are reduced and land on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cudist import _devices
from cudist._distribute_lib import Strategy, StrategyExtended, default_devices, parse_devices
from cudist._variables import Variable, create_aggregating_variable, create_in_replica_context

if TYPE_CHECKING:
    from cudist._cross_device_ops import CrossDeviceOps

__all__ = ["CentralStorageStrategy"]


class CentralStorageExtended(StrategyExtended):
    """Extended API of :class:`CentralStorageStrategy`: one copy of each variable, on the parameter device."""

    def _create_variable(self, next_creator: Callable[..., object], **kwargs: Any) -> Variable:
        """An AggregatingVariable on the parameter device (one for all replicas, even inside ``run``).

        With one compute device TF 2.21 makes a plain variable on the parameter device (there is
        nothing to aggregate), and so do we -- unless the replica is a GPU and the variable is kept
        elsewhere, where the AggregatingVariable's copy to the replica's GPU is still needed.
        """
        if self._num == 1 and (not self._replica_gpus or self._variable_devices()[0] == self._devices[0]):
            return next_creator(device=self._variable_devices()[0], **kwargs)  # type: ignore[return-value]
        del next_creator
        strategy = self._container_strategy()
        var: Variable | None = create_in_replica_context(strategy, kwargs)
        if var is None:
            var = create_aggregating_variable(strategy, self._variable_devices()[0], **kwargs)
        return var


class CentralStorageStrategy(Strategy):
    """Variables on one device, computation replicated (``tf.distribute.experimental.CentralStorageStrategy``).

    Args:
        compute_devices: devices the replicas run on; default: every logical GPU, else "/cpu:0".
        parameter_device: where variables live; default: the compute device if there is exactly
            one, else "/cpu:0". With one compute device variables are plain (as TF).

    Raises:
        ValueError: empty or duplicate compute devices, an invalid device string, or a device
            that is not configured (``parameter_device="/gpu:3"`` without that GPU, say).
    """

    def __init__(
        self,
        compute_devices: Sequence[_devices.DeviceLike] | None = None,
        parameter_device: _devices.DeviceLike | None = None,
    ) -> None:
        if compute_devices is None:
            devs = default_devices()
        else:
            devs = parse_devices(compute_devices, "CentralStorageStrategy")
        if parameter_device is None:
            param = devs[0] if len(devs) == 1 else _devices.canonicalize("/cpu:0")
        else:
            param = _devices.canonicalize(parameter_device)
        ops: CrossDeviceOps | None = None
        if _devices.any_gpu(devs) and not _devices.parse_device(param).is_gpu:
            # As TF (ReductionToOneDevice): the GPU-only P2P/NCCL ops cannot deliver a reduction to
            # a variable in host memory. TF reduces on the CPU; we reduce on the first GPU with the
            # CUDA kernels and copy only the result to the host.
            from cudist._cross_device_ops import ReductionToOneDevice

            ops = ReductionToOneDevice()
        super().__init__(CentralStorageExtended(self, devs, cross_device_ops=ops, parameter_devices=(param,)))

    def __repr__(self) -> str:
        return (
            f"<cudist.CentralStorageStrategy compute_devices={self._extended.worker_devices} "
            f"parameter_device={self._extended.parameter_devices[0]!r}>"
        )
