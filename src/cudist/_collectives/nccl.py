"""NCCL through CuPy (``cupy.cuda.nccl``): loading, one communicator per GPU set, the grouped all-reduce.

Imported only when NCCL is about to be used: ``import cudist`` never loads CuPy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from cudist import config
from cudist._reduce_util import ReduceOp

__all__ = ["load", "dtype_codes", "communicators_for", "all_reduce"]


def load() -> tuple[ModuleType, None] | tuple[None, str]:
    """(``cupy.cuda.nccl``, None) when NCCL can be used, else (None, why not)."""
    try:
        from cupy.cuda import nccl  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - only when NCCL is about to be used
    except Exception as e:  # noqa: BLE001 - no CuPy, or a broken one: say why
        return None, f"cannot import cupy.cuda.nccl ({type(e).__name__}: {e}); install cudist[cuda13] or cudist[cuda12]"
    if not getattr(nccl, "available", False):
        return None, (
            "CuPy cannot load the NCCL library (cupy.cuda.nccl.available is False); install NCCL for "
            f"CuPy's CUDA: pip install {config.nccl_package()}"
        )
    return nccl, None


def dtype_codes(nccl: ModuleType) -> dict[np.dtype[Any], int]:
    """NumPy dtype -> NCCL data type code, for the dtypes the kernels support.

    Args:
        nccl: the ``cupy.cuda.nccl`` module (see :func:`load`).
    """
    return {
        np.dtype(np.float16): nccl.NCCL_FLOAT16,
        np.dtype(np.float32): nccl.NCCL_FLOAT32,
        np.dtype(np.float64): nccl.NCCL_FLOAT64,
        np.dtype(np.int32): nccl.NCCL_INT32,
        np.dtype(np.int64): nccl.NCCL_INT64,
    }


_comm_lock = threading.Lock()
_communicators: dict[tuple[int, ...], list[Any]] = {}  # tuple of CUDA device ids -> list of NcclCommunicator, one rank per GPU


def communicators_for(nccl: ModuleType, physical: Iterable[int]) -> list[Any]:
    """NCCL communicators over ``physical`` GPUs (distinct), created once per GPU tuple and kept.

    Args:
        nccl: the ``cupy.cuda.nccl`` module (see :func:`load`).
        physical: CUDA device ids, one rank each.

    Returns:
        CuPy's ``NcclCommunicator`` objects, one per GPU in ``physical``'s order (``Any`` to type
        checkers: CuPy ships no type information).
    """
    key = tuple(physical)
    comms = _communicators.get(key)
    if comms is None:
        with _comm_lock:
            comms = _communicators.get(key)
            if comms is None:
                comms = _communicators[key] = nccl.NcclCommunicator.initAll(list(key))
    return comms


def all_reduce(nccl: ModuleType, bufs: Sequence[Any], op: ReduceOp) -> None:
    """All-reduces GPU buffers (one per distinct GPU) in place with NCCL, SUM or MEAN.

    Each rank's call goes on its GPU's current stream, so it is ordered after the copies that
    filled the buffer and before whatever reads it next, like any CuPy operation. MEAN is the NCCL
    sum divided by N on each GPU (the kernels' definition; NCCL's own average needs NCCL 2.10).

    Args:
        nccl: the ``cupy.cuda.nccl`` module (see :func:`load`).
        bufs: same-shape, same-dtype CuPy arrays, one per distinct GPU.
        op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``.
    """
    import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - only reached with GPU arrays

    physical = [b.device.id for b in bufs]
    comms = communicators_for(nccl, physical)
    code = dtype_codes(nccl)[bufs[0].dtype]
    count = bufs[0].size
    nccl.groupStart()
    try:
        for comm, buf in zip(comms, bufs):
            with buf.device:
                stream = cupy.cuda.get_current_stream()
                comm.allReduce(buf.data.ptr, buf.data.ptr, count, code, nccl.NCCL_SUM, stream.ptr)
    finally:
        nccl.groupEnd()
    if op is ReduceOp.MEAN:
        n = len(bufs)
        for buf in bufs:
            with buf.device:
                cupy.true_divide(buf, buf.dtype.type(n), out=buf)
