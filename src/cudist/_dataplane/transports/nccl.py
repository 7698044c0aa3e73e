"""NCCL through CuPy (``cupy.cuda.nccl``): loading, one communicator per GPU set, the grouped all-reduce,
and the cross-worker communicator of MultiWorkerMirroredStrategy (:class:`WorkerCommunicator`).

Imported only when NCCL is about to be used: ``import cudist`` never loads CuPy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from cudist import config, errors
from cudist._reduce_util import ReduceOp

if TYPE_CHECKING:
    from cudist._dataplane.transports.mpi import Communicator

__all__ = ["load", "dtype_codes", "bfloat16_code", "BFLOAT16_MIN_VERSION", "communicators_for", "all_reduce", "WorkerCommunicator", "UNIQUE_ID_BYTES"]

#: ``NCCL_UNIQUE_ID_BYTES``: the length of the tuple ``get_unique_id()`` returns.
UNIQUE_ID_BYTES = 128


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


#: ``ncclGetVersion()`` of the first NCCL with ``ncclBfloat16`` (2.10.0: ``major * 10000 + minor * 100``).
BFLOAT16_MIN_VERSION = 21000


def bfloat16_code(nccl: ModuleType) -> int | None:
    """NCCL's ``ncclBfloat16`` code (9), or None where NCCL or CuPy lack it (NCCL before 2.10, a CuPy
    without the constant, no ``ml_dtypes``: then bfloat16 stays on the staged path).

    NCCL's bfloat16 SUM adds two bfloat16 values and rounds the sum to bfloat16 at every step of its
    ring or tree (``FuncSum<__nv_bfloat16>``: ``__hadd`` from sm_80, float32 addition rounded with
    ``__floats2bfloat162_rn`` before), in its own order, and a NaN comes out as CUDA's 0x7fff.

    Args:
        nccl: the ``cupy.cuda.nccl`` module (see :func:`load`).
    """
    code = getattr(nccl, "NCCL_BFLOAT16", None)
    if code is None:
        return None
    try:
        version = int(nccl.get_version())
    except Exception:  # noqa: BLE001 - a CuPy that cannot say: the staged path, which every version has
        return None
    if version < BFLOAT16_MIN_VERSION:
        return None
    try:
        import ml_dtypes  # noqa: F401, PLC0415 - optional: NumPy knows no bfloat16 without it
    except ImportError:
        return None
    return int(code)


def dtype_codes(nccl: ModuleType, *, bfloat16: bool = False) -> dict[np.dtype[Any], int]:
    """NumPy dtype -> NCCL data type code, for the dtypes the kernels support.

    Args:
        nccl: the ``cupy.cuda.nccl`` module (see :func:`load`).
        bfloat16: also ``ml_dtypes.bfloat16`` where NCCL has it (:func:`bfloat16_code`). Only the
            cross-worker communicator asks: within a process the kernels sum bfloat16 in float32
            and round once, which NCCL's per-step bfloat16 rounding would not match.
    """
    codes: dict[np.dtype[Any], int] = {
        np.dtype(np.float16): nccl.NCCL_FLOAT16,
        np.dtype(np.float32): nccl.NCCL_FLOAT32,
        np.dtype(np.float64): nccl.NCCL_FLOAT64,
        np.dtype(np.int32): nccl.NCCL_INT32,
        np.dtype(np.int64): nccl.NCCL_INT64,
    }
    code = bfloat16_code(nccl) if bfloat16 else None
    if code is not None:
        import ml_dtypes  # noqa: PLC0415 - present: bfloat16_code checked

        codes[np.dtype(ml_dtypes.bfloat16)] = code
    return codes


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


class WorkerCommunicator:
    """NCCL across the workers of a multi-worker job: one rank per worker, on its first local GPU.

    The cross-worker step of :class:`cudist._collective_ops.CollectiveAllReduce` for GPU values:
    each worker first sums its local replicas with the kernels into packed buffers on one GPU
    (this communicator's), then this all-reduces those buffers across the workers with NCCL.
    One rank per worker (not one per GPU, as TF's CollectiveAllReduce makes them) keeps the
    hierarchy, the summation order and the packing of the MPI path, needs one communicator per
    job, and never mixes a worker's local reduction into NCCL's ring; its cost is that one GPU
    (and its network interface) per worker carries the cross-worker traffic.

    The NCCL communicator is created on first use: the chief's ``get_unique_id()`` is broadcast
    over the MPI control plane (``comm``), then every worker calls ``NcclCommunicator(workers,
    uid, worker)`` on its GPU (in a helper thread, so that the init, which blocks until every rank
    has joined, is waited for with the deadline). Every NCCL collective is numbered, checked
    (``CUDIST_CHECK_COLLECTIVES``) and waited for by ``comm`` like its MPI collectives
    (:meth:`cudist._dataplane.transports.mpi.Communicator.collective`): queued on the GPU's current CuPy
    stream, then an event recorded behind it is polled with ``timeout_seconds``, the stall
    warning, and ``ncclCommGetAsyncError`` (so an all-reduce returns once NCCL has finished, as
    the MPI path does: the price of a deadline is no overlap of later host work with the transfer); a timeout aborts the communicator
    (``ncclCommAbort``, which ends a kernel still waiting for a peer) and raises
    ``DeadlineExceededError`` naming the missing workers. What NCCL itself cannot promise: a
    collective whose peer died or never comes spins on the GPU until aborted (NCCL reports a dead
    peer as an asynchronous error only over network transports, not over shared memory or
    NVLink), and an init whose peers never come blocks its thread; the deadline, the abort hook
    (an exception in any worker ends the job) and the launcher (a killed worker ends the job) are
    what end those.

    Args:
        nccl: the ``cupy.cuda.nccl`` module (see :func:`load`).
        comm: the workers' MPI communicator (:class:`cudist._dataplane.transports.mpi.Communicator`).
    """

    def __init__(self, nccl: ModuleType, comm: Communicator) -> None:
        self._nccl = nccl
        self._comm = comm
        self._codes = dtype_codes(nccl, bfloat16=True)
        self._nc: Any = None  # the NcclCommunicator, once created
        self._broken: str | None = None
        self.device: int | None = None
        #: NCCL collectives run so far (each may carry several packed buffers).
        self.collectives = 0

    def __repr__(self) -> str:
        state = "not created yet" if self._nc is None else f"on GPU {self.device}"
        return f"<cudist NCCL worker communicator: worker {self._comm.rank} of {self._comm.size}, {state}>"

    @property
    def dtypes(self) -> frozenset[np.dtype[Any]]:
        """The dtypes NCCL all-reduces here (the others are staged through MPI): bfloat16 too from
        NCCL 2.10 (:func:`bfloat16_code`)."""
        return frozenset(self._codes)

    def _where(self) -> str:
        gpu = "" if self.device is None else f" (GPU {self.device})"
        return f"worker {self._comm.rank} of {self._comm.size}{gpu}"

    def _error(self, what: str, e: BaseException) -> errors.InternalError:
        err: errors.InternalError = errors.InternalError(f"cudist: {self._where()}: NCCL {what} failed: {type(e).__name__}: {e}")
        return err

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, with an NCCL error raised as an InternalError naming this worker (and the
        communicator refused afterwards: NCCL leaves it unusable)."""
        try:
            return fn()
        except self._nccl.NcclError as e:
            self._broken = f"NCCL {what} failed"
            raise self._error(what, e) from e

    def bind(self, device: int) -> None:
        """Makes CUDA device ``device`` this worker's NCCL GPU (before first use; later calls must agree).

        Raises:
            ValueError: the communicator already lives on another GPU.
        """
        if self.device is None:
            self.device = int(device)
        elif self.device != int(device):
            raise ValueError(f"cudist: {self._where()}: the NCCL communicator lives on GPU {self.device}, not {device}")

    def _communicator(self) -> Any:
        if self._broken is not None:
            raise RuntimeError(f"cudist: {self._where()}: cross-worker NCCL cannot continue after {self._broken}; restart the job")
        if self._nc is not None:
            return self._nc
        if self.device is None:
            raise RuntimeError("WorkerCommunicator: bind() a GPU before the first collective")
        import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - GPU workers only

        comm, nccl = self._comm, self._nccl
        uid = np.zeros(UNIQUE_ID_BYTES, np.int8)
        if comm.rank == 0:
            uid[:] = self._guard("get_unique_id", nccl.get_unique_id)
        comm.bcast(uid, root=0, kind="NCCL unique id")
        uid_t = tuple(int(x) for x in uid)
        made: dict[str, Any] = {}

        def init() -> None:
            try:
                with cupy.cuda.Device(self.device):
                    made["comm"] = nccl.NcclCommunicator(comm.size, uid_t, comm.rank)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                made["error"] = e

        def start() -> Callable[[], bool]:
            thread = threading.Thread(target=init, name="cudist-nccl-init", daemon=True)
            thread.start()
            return lambda: not thread.is_alive()

        comm.collective("NCCL communicator init", f"{comm.size} ranks", start)
        if "error" in made:
            e = made["error"]
            if isinstance(e, nccl.NcclError):
                self._broken = "a failed NCCL init"
                raise self._error("init (ncclCommInitRank)", e) from e
            raise e
        self._nc = made["comm"]
        return self._nc

    def _abort(self) -> None:
        nc, self._nc = self._nc, None
        self._broken = "an aborted NCCL collective (timeout)"
        if nc is not None:
            try:
                nc.abort()
            except Exception:  # noqa: BLE001 - aborting after a timeout: the timeout is the error to report
                pass

    def all_reduce(self, bufs: Sequence[Any], kind: str, detail: str | Callable[[], str]) -> None:
        """SUM all-reduces contiguous CuPy buffers on this worker's NCCL GPU in place, across the workers.

        One grouped NCCL call per buffer on the GPU's current stream, waited for as described above.

        Args:
            bufs: contiguous CuPy arrays on :attr:`device`, dtypes in :attr:`dtypes`.
            kind: names the collective in fingerprints and errors.
            detail: describes the call in fingerprints.

        Raises:
            DeadlineExceededError: a worker did not join within ``timeout_seconds``.
            InternalError: NCCL failed (the message names this worker).
        """
        import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: PLC0415 - GPU workers only

        nc = self._communicator()
        nccl = self._nccl

        def start() -> Callable[[], bool]:
            with cupy.cuda.Device(self.device):
                stream = cupy.cuda.get_current_stream()

                def queue() -> None:
                    nccl.groupStart()
                    try:
                        for b in bufs:
                            nc.allReduce(b.data.ptr, b.data.ptr, b.size, self._codes[b.dtype], nccl.NCCL_SUM, stream.ptr)
                    finally:
                        nccl.groupEnd()

                self._guard(f"{kind} (ncclAllReduce)", queue)
                event = cupy.cuda.Event(disable_timing=True)
                event.record(stream)

            def done() -> bool:
                return bool(self._guard(kind, lambda: event.done or nc.check_async_error()))

            return done

        self._comm.collective(f"{kind} (NCCL)", detail, start, on_timeout=self._abort)
        self.collectives += 1
