"""Options of cross-worker collectives (TF's ``collective_util``): ``cudist.experimental.CommunicationOptions``."""

from __future__ import annotations

import copy
import enum

__all__ = ["CommunicationImplementation", "CommunicationOptions"]


class CommunicationImplementation(enum.Enum):
    """How cross-worker collectives are carried out (``tf.distribute.experimental.CommunicationImplementation``).

    AUTO: MPI for host buffers; NCCL for GPU buffers when CuPy can load it, else MPI with the GPU
    buffers staged through the host. RING: MPI for everything (TF's gRPC ring becomes MPI's
    all-reduce; GPU buffers staged through the host). NCCL: NCCL for the all-reduce of GPU
    buffers; it needs GPUs and a loadable NCCL (an error says what to install otherwise). As in
    TF, all-gather and broadcast always use the ring (MPI). See the README's multi-worker section.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """Options for cross-worker collectives (``tf.distribute.experimental.CommunicationOptions``).

    Args:
        bytes_per_pack: the all-reduce of many values is packed into buffers of about this many
            bytes, one non-blocking MPI all-reduce each (0: one buffer per dtype).
        timeout_seconds: how long a collective waits for the other workers before it raises
            ``DeadlineExceededError`` (a ``TimeoutError``) naming the missing workers; None waits
            forever, as in TF (a warning names them after 60 s).
        implementation: a :class:`CommunicationImplementation` or its name.

    Raises:
        ValueError: a negative ``bytes_per_pack``, a non-positive ``timeout_seconds`` or an unknown
            implementation.
    """

    def __init__(self, bytes_per_pack=0, timeout_seconds=None, implementation=CommunicationImplementation.AUTO):
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
            raise ValueError(f"Argument `bytes_per_pack` must be >=0, Received {bytes_per_pack}.")
        if timeout_seconds is not None:
            if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or timeout_seconds <= 0:
                raise ValueError(f"Argument `timeout_seconds` must be None or > 0, Received {timeout_seconds!r}.")
        if isinstance(implementation, str):
            try:
                implementation = CommunicationImplementation(implementation.upper())
            except ValueError:
                implementation = None
        if not isinstance(implementation, CommunicationImplementation):
            raise ValueError(
                "Argument `implementation` must be instance of `cudist.experimental.CommunicationImplementation`."
            )
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    def merge(self, options):
        """A copy with the non-default fields of ``options`` (a CommunicationOptions or None) taken over."""
        merged = copy.deepcopy(self)
        if options is None:
            return merged
        if options.bytes_per_pack != 0:
            merged.bytes_per_pack = options.bytes_per_pack
        if options.timeout_seconds is not None:
            merged.timeout_seconds = options.timeout_seconds
        if options.implementation != CommunicationImplementation.AUTO:
            merged.implementation = options.implementation
        return merged

    def __eq__(self, other) -> bool:
        return isinstance(other, CommunicationOptions) and (
            self.bytes_per_pack, self.timeout_seconds, self.implementation
        ) == (other.bytes_per_pack, other.timeout_seconds, other.implementation)

    __hash__ = None  # mutable, as TF's

    def __repr__(self) -> str:
        return (
            f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, timeout_seconds={self.timeout_seconds}, "
            f"implementation={self.implementation})"
        )
