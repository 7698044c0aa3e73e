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
        compression: cudist extension (Horovod's ``compression=Compression.fp16``, torch's
            ``bf16_compress_hook``): ``"bfloat16"`` (or ``"bf16"``) or ``"float16"`` (``"fp16"``)
            sends float32 values between workers in that 16-bit dtype, half the bytes; each worker
            still sums its local replicas exactly in float32, and the workers' rounded partial sums
            are added in float32 in worker order. Results are float32, within
            ``(u + W * 2**-24) * sum_w |s_w| + W * e`` of the exact ``sum_w s_w`` elementwise
            (``W`` workers, ``s_w`` worker w's float32 partial sum; ``u`` = 2**-8 and ``e`` = 2**-134
            for bfloat16, ``u`` = 2**-11 and ``e`` = 2**-25 for float16, ``e`` covering subnormals);
            the same on every worker. float16 turns partial sums beyond 65504 into inf.
            None (the default): no compression, exact float32. Host (MPI) values only; other
            dtypes are never compressed. bfloat16 needs ``ml_dtypes`` (``pip install "cudist[bf16]"``).

    Raises:
        ValueError: a negative ``bytes_per_pack``, a non-positive ``timeout_seconds``, an unknown
            implementation or compression.
    """

    def __init__(
        self, bytes_per_pack=0, timeout_seconds=None, implementation=CommunicationImplementation.AUTO, *, compression=None
    ):
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
        self.compression = _compression_name(compression)

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
        if options.compression is not None:
            merged.compression = options.compression
        return merged

    def __eq__(self, other) -> bool:
        return isinstance(other, CommunicationOptions) and (
            self.bytes_per_pack, self.timeout_seconds, self.implementation, self.compression
        ) == (other.bytes_per_pack, other.timeout_seconds, other.implementation, other.compression)

    __hash__ = None  # mutable, as TF's

    def __repr__(self) -> str:
        return (
            f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, timeout_seconds={self.timeout_seconds}, "
            f"implementation={self.implementation}"
            + ("" if self.compression is None else f", compression={self.compression!r}")
            + ")"
        )


_COMPRESSIONS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def _compression_name(compression):
    """``compression`` as a dtype name ("bfloat16", "float16") or None; ValueError for anything else."""
    if compression is None or (isinstance(compression, str) and compression.lower() == "none"):
        return None
    name = _COMPRESSIONS.get(compression.lower()) if isinstance(compression, str) else None
    if name is None:
        raise ValueError(
            f"Argument `compression` must be None, 'bfloat16' ('bf16') or 'float16' ('fp16'), Received {compression!r}."
        )
    return name
