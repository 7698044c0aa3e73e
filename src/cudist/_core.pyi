"""Type stub of ``cudist._core``, the pybind11 extension built from ``csrc/bindings/core.cpp``.

Keep it in step with the bindings: tests/test_typing.py compares its names with the module's and
with the ``m.def``/``m.attr`` calls of core.cpp, and its parameter names with their signature lines.

Arrays are NumPy arrays of float16, float32, float64, int32 or int64, C-contiguous and in native
byte order; the ones written to must be writeable. Sequences of arrays must be tuples or lists.
"""

from collections.abc import Callable, Sequence
from typing import Any, Final, SupportsFloat, SupportsIndex, SupportsInt, TypeAlias

import numpy as np
from numpy.typing import DTypeLike, NDArray

from cudist._reduce_util import ReduceOp

_Array: TypeAlias = NDArray[Any]
_Arrays: TypeAlias = tuple[_Array, ...] | list[_Array]
_Int: TypeAlias = SupportsInt | SupportsIndex
#: shm_one_caller's caller: one(count, send, kind, seq) -> the sum, or (status, recv).
_ShmOne: TypeAlias = Callable[[int, _Array, str, int], _Array | tuple[int, _Array]]
_Float: TypeAlias = SupportsFloat | SupportsIndex
#: A reduction: SUM (0) or MEAN (1), or the ReduceOp members given to register_reduce_ops.
_Op: TypeAlias = int | ReduceOp

__version__: Final[str]
#: ``op`` codes of the reductions.
SUM: Final[int]
MEAN: Final[int]

#: Whether the extension was built with the CUDA launchers (``cuda_all_reduce``,
#: ``cuda_all_reduce_into``, ``cuda_reduce_to_one``, ``cuda_broadcast``, ``cuda_p2p_all_reduce``);
#: without them those functions do not exist.
cuda_built: Final[bool]
#: The CUDA architectures compiled for, e.g. "80,90" ("" without CUDA).
cuda_architectures: Final[str]
#: CUDART_VERSION of the (static) CUDA runtime, e.g. 13000 (0 without CUDA).
cuda_runtime_version: Final[int]
#: Whether :func:`crc32` folds with PCLMULQDQ on this CPU (else it is a table loop, slower than zlib's).
crc32_accelerated: Final[bool]

def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """``zlib.crc32(data, value)`` of a C-contiguous buffer (PCLMULQDQ where ``crc32_accelerated``; no GIL)."""

def write_crc32(fd: int, data: bytes | bytearray | memoryview, chunk: int = 1 << 20, value: int = 0) -> int:
    """Writes ``data`` (C-contiguous) to ``fd`` in ``chunk``-byte writes, every byte, and returns
    ``zlib.crc32(data, value)``, each chunk summed right after its write; no GIL (except to run signal
    handlers when a signal interrupts a write: one that raises ends it). OSError when a write fails."""

def direct_append_crc32(
    fd: int, data: bytes | bytearray | memoryview, bounce: _Array, fill: int, offset: int, value: int = 0
) -> tuple[int, int, int]:
    """Appends ``data`` to a file opened with O_DIRECT through ``bounce`` (4096-aligned, a multiple of
    4096 bytes; bounce[0:fill] still to be written at the aligned file ``offset``): each piece copied
    in and summed there, a full buffer written with pwrite(2). Returns (zlib.crc32(data, value), fill,
    offset) for the next call; no GIL. ValueError for a misaligned buffer or offset, OSError when a write fails."""

def direct_finish(fd: int, bounce: _Array, fill: int, offset: int) -> None:
    """Writes bounce[0:fill] at ``offset`` (zero-padded to 4096 bytes) and truncates the file to
    ``offset + fill`` bytes. OSError when either fails."""

def all_reduce(bufs: _Arrays, op: _Op) -> None:
    """In place: every array of ``bufs`` becomes their elementwise reduction; op 0=SUM, 1=MEAN."""

def all_reduce_into(inputs: _Arrays, outputs: _Arrays, op: _Op, strict: bool = False) -> None:
    """Out of place: every array of ``outputs`` becomes the elementwise reduction of ``inputs``.

    One pass; outputs[i] may be inputs[i]. ``strict``: refuse any other overlap (ValueError).
    """

def batch_all_reduce(inputs: Sequence[_Arrays], outputs: Sequence[_Arrays], op: _Op) -> None:
    """outputs[r][j] = reduction over r of inputs[r][j], for every leaf j, in one dispatch.

    ``inputs`` and ``outputs`` are tuples or lists (one per replica) of tuples or lists of arrays
    (the leaves, all of one dtype).
    """

def batch_reduce_to_one(inputs: Sequence[_Arrays], op: _Op, out: _Array) -> None:
    """The reduction over r of ``inputs[r][j]`` for every leaf j, back to back into the 1-d ``out``;
    one dispatch (leaves of one dtype)."""

def register_reduce_ops(sum: object, mean: object) -> None:
    """Registers the objects (cudist.ReduceOp.SUM, .MEAN) accepted as ``op`` besides 0 and 1."""

def reduce_to_one(bufs: _Arrays, op: _Op, out: _Array) -> None:
    """Reduces ``bufs`` elementwise into ``out`` (which may be one of them)."""

def broadcast(src: _Array, dsts: _Arrays) -> None:
    """Copies ``src`` into every array of ``dsts``."""

def all_gather(bufs: _Arrays, axis: _Int) -> _Array:
    """Concatenates ``bufs`` along non-negative ``axis`` into a new array."""

def assign_add(copies: _Arrays, value: _Array, negate: bool) -> None:
    """Every copy becomes copies[0] + value (or - value when ``negate``)."""

def assign(copies: _Arrays, value: _Array) -> None:
    """Writes ``value`` into every copy."""

def bf16_simd(choice: str | None = None) -> str:
    """The bfloat16 reduction's SIMD kernel: set 'auto' / 'sse2' / 'avx2' (None: only ask); returns the one in use."""

def reduce_unscale_finite(grads: _Arrays, scale: _Float, out: _Array) -> bool:
    """out = (sum of ``grads`` in replica order) / scale in one pass; returns whether every element of out is finite."""

# The optimizers of the rules' table: ``decay`` is weight_decay * lr (0: none).

def __getattr__(name: str) -> Callable[..., None]:
    """The optimizers of the rules' table (CUDIST_UPDATE_RULES in csrc/include/cudist/detail/update_rules.hpp),
    bound from that table as ``<name>(copies, *slots, grad, *hyper, decay)`` and
    ``all_reduce_<name>(copies, *slots, grads, *hyper, decay)``: each slot the list of its copies, named
    ``<slot>s``; the hyper-parameters those of ``cudist._kernels.UPDATE_KERNELS``. Declared here once, so
    that adding a row to the table needs no stub edit (tests/test_typing.py checks the bound signatures
    against the table). Each also takes ``sources=``: the arrays holding the current values (the
    variable's, then each slot's), read instead of copy 0 while every copy is written (out of place)."""

#: The names of the entry points bound from the rules' table (plain and ``all_reduce_``): those
#: taking ``sources=``.
out_of_place_rules: list[str]


def reduce_to_one_shared(
    bufs: _Arrays, op: _Op, out: _Array | Callable[[tuple[int, ...], np.dtype[Any]], _Array]
) -> list[_Array] | None:
    """reduce_to_one into ``out``, made read-only; [out] + len(bufs)-1 read-only views of it, or None
    (doing nothing) unless bufs are >= 2 C-contiguous numpy.ndarray of one shape and kernel dtype
    (not an integer MEAN) and out a writable C-contiguous array of that dtype and size (or a
    callable ``out(shape, dtype)`` returning one, called only once the inputs pass)."""

def batch_reduce_to_one_shared(
    inputs: Sequence[_Arrays], op: _Op, out: _Array | Callable[[tuple[int], np.dtype[Any]], _Array]
) -> list[list[_Array]] | None:
    """batch_reduce_to_one into ``out``, made read-only; per replica its leaves' read-only results
    (views of out in the leaves' shapes), or None (doing nothing) unless inputs are >= 2 replicas of
    the same >= 1 C-contiguous numpy.ndarray leaves of one kernel dtype (not an integer MEAN; leaf j
    of one shape) and out a writable C-contiguous array of that dtype and their total size (or a
    callable ``out(shape, dtype)`` returning one, called only once the inputs pass)."""

def shm_all_reduce(
    ctrl: _Array,
    slots: _Array,
    node_size: _Int,
    node_rank: _Int,
    count: _Int,
    pairs: Sequence[tuple[_Array, _Array]],
    kind_crc: _Int,
    seq: _Int,
    spin_ns: _Int,
    sum: bool,
) -> int:
    """The shared-memory transport's one-round all-reduce (call ``count`` of the window's control
    area ``ctrl``, int64, and eager ``slots``, bytes): copies each send of ``pairs`` into this
    worker's slot, posts the call's hash, raises its arrival flag and spins up to ``spin_ns`` for the
    other workers. 0: all arrived with the same hash (and, with ``sum``, each recv holds the sum of
    the slots in worker order); 1: not yet (poll :func:`shm_wait`); 2: the hashes differ."""

def shm_one_caller(ctrl: _Array, slots: _Array, node_size: _Int, node_rank: _Int, spin_ns: _Int) -> _ShmOne:
    """The window's per-step caller (its areas checked once): ``one(count, send, kind, seq)`` is
    :func:`shm_all_reduce` of one array (any layout; ``kind``'s CRC-32 taken here), summed into a new
    array of its shape and dtype: that array, or ``(status, recv)`` when the workers were not all there
    within ``spin_ns`` (1: poll :func:`shm_wait`, then :func:`shm_sum`) or their hashes differ (2)."""

def shm_one_counts(one: _ShmOne) -> tuple[int, int]:
    """The calls and bytes a caller of :func:`shm_one_caller` has all-reduced."""

def shm_wait(ctrl: _Array, slots: _Array, node_size: _Int, node_rank: _Int, count: _Int, spin_ns: _Int) -> int:
    """Spins up to ``spin_ns`` for every worker's arrival in call ``count``: :func:`shm_all_reduce`'s 0, 1 or 2."""

def shm_sum(
    ctrl: _Array, slots: _Array, node_size: _Int, node_rank: _Int, count: _Int, pairs: Sequence[tuple[_Array, _Array]]
) -> None:
    """Each recv of ``pairs`` becomes the sum of the node's slots of call ``count``, in worker order."""

def settle_plain(passes: Sequence[tuple[Sequence[_Array], Sequence[Any]]], aliasing: bool) -> list[list[_Array]] | None:
    """Per pass (gradients, written arrays) its gradients as a list when every gradient is a
    C-contiguous numpy.ndarray owning its memory and (aliasing) neither a written array nor a
    written array's base; else None."""

def num_threads() -> int:
    """Threads the kernels use (the calling thread included)."""

def set_num_threads(n: _Int) -> None:
    """Sets the number of threads (0 = all hardware threads)."""

def set_streaming_threshold(nbytes: _Int) -> int:
    """Bytes written from which kernels use streaming stores (returns the previous value)."""

def hardware_threads() -> int:
    """Hardware threads of this machine."""

def set_parallel_thresholds(warm_bytes: _Int, cold_bytes: _Int) -> tuple[int, int]:
    """Bytes moved from which kernels use their pool, with a worker spinning and without (returns
    the previous pair)."""

def pool_spin_time() -> int:
    """Nanoseconds the kernels' pool workers spin for the next loop before blocking."""

def set_pool_spin_time(ns: _Int) -> int:
    """Sets pool_spin_time() (negative: 0); returns the previous value."""

def pool_warm() -> bool:
    """Whether a worker of the kernels' pool is spinning now."""

def pool_parallel_loops() -> int:
    """Loops the kernels' pool has run on more than one thread."""

def cuda_device_count() -> int:
    """CUDA devices visible to the extension's CUDA runtime; 0 without a driver, device or CUDA build."""

# CUDA builds only (``cuda_built``): the launchers over raw device pointers (Python ints).

def cuda_all_reduce(
    ptrs: Sequence[int],
    count: _Int,
    dtype: DTypeLike,
    op: _Int,
    stream: _Int = 0,
    device: _Int = -1,
    two_shot: bool = False,
) -> None:
    """Enqueues cudist::cuda::all_reduce (or all_reduce_two_shot) on ``stream`` of ``device``.

    ``device`` -1 is the current one; ``ptrs`` are the device buffers' addresses, ``count``
    elements of ``dtype`` each; op 0=SUM, 1=MEAN. Raises RuntimeError naming the CUDA error.
    """

def cuda_all_reduce_into(
    inputs: Sequence[int],
    outputs: Sequence[int],
    count: _Int,
    dtype: DTypeLike,
    op: _Int,
    stream: _Int = 0,
    device: _Int = -1,
) -> None:
    """Enqueues the out-of-place cudist::cuda::all_reduce on ``stream`` of ``device``.

    Every buffer of ``outputs`` gets the reduction of the buffers ``inputs`` (as many; outputs[i]
    may be inputs[i], no other overlap). Raises RuntimeError naming the CUDA error.
    """

def cuda_reduce_to_one(
    ptrs: Sequence[int],
    out: _Int,
    count: _Int,
    dtype: DTypeLike,
    op: _Int,
    stream: _Int = 0,
    device: _Int = -1,
) -> None:
    """Enqueues cudist::cuda::reduce_to_one: the reduction of ``ptrs`` into ``out``.

    ``out`` may be one of ptrs[0..7] (any of them when there are at most 8). Raises RuntimeError
    naming the CUDA error.
    """

def cuda_broadcast(
    src: _Int,
    dsts: Sequence[int],
    count: _Int,
    dtype: DTypeLike,
    stream: _Int = 0,
    device: _Int = -1,
) -> None:
    """Enqueues cudist::cuda::broadcast: copies ``src`` into every buffer of ``dsts``.

    Raises RuntimeError naming the CUDA error.
    """

def cuda_p2p_all_reduce(
    bufs: Sequence[tuple[int, int]],
    count: _Int,
    dtype: DTypeLike,
    op: _Int,
    streams: Sequence[int] | None = None,
) -> None:
    """Enqueues cudist::cuda::p2p_all_reduce over ``bufs``, (pointer, device) pairs.

    One stream per buffer (None: the devices' default streams). Raises RuntimeError naming the
    CUDA error.
    """
