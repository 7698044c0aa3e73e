"""The intra-node transport of multi-worker jobs: host all-reduces over MPI-3 shared memory.

The workers of one node (``MPI.Comm.Split_type(COMM_TYPE_SHARED)``, or consecutive groups of
``CUDIST_NODE_SIZE`` workers) share one window (``MPI.Win.Allocate_shared``): per worker a slot
(and two small ones), result banks and a control area of flags, one cache line each. Two paths:

* the reduce-scatter (from :data:`EAGER_BYTES`): each worker copies into its slot only the slices
  the others sum and raises its "arrived" flag; once every flag is up, each worker sums its slice
  over all workers, in worker order, with the CPU backend's ``reduce_to_one`` (its own slice read
  straight from its buffer) into a result bank, and raises "reduced"; once all are up, every worker
  takes the whole sum as a read-only view of the bank (the all-gather by reading: no copy out). A
  bank is reused once no worker of the node holds a view of it (reference counts, published with
  the arrival); with every bank held, a scratch bank is copied out. Bytes moved per worker for S
  bytes and N workers: S(N-1)/N copied in (read + write), S read and S/N written by the sum.
  :meth:`~SharedMemoryAllReduce.allreduce_packs` takes a pack's buffers where they are (a worker's
  gradients): the parts the others sum go straight into the slot, this worker's slice is summed
  from the buffers themselves, and no pack is built (a copy of every byte less).
* the one-round path (below :data:`EAGER_BYTES`): each worker copies its buffers into its small
  slot (two sets, used by turns), raises "arrived", and sums every slot itself into its own
  result: one synchronization instead of two, for messages where latency dominates. All of it is
  one call of the extension (``_core.shm_all_reduce``; for the per-step single array,
  :meth:`SharedMemoryAllReduce.allreduce_one`, a builtin bound to the window by
  ``_core.shm_one_caller``: the window checked once, the kind hashed, the result made and the call
  counted in C++), with C++ acquire/release atomics on the flags; a wait longer than ``_SPIN_NS``
  (spinning, yielding the CPU every few checks) returns to the communicator's poll
  (``_core.shm_wait``), so deadlines, stall warnings, notices and signals work as for every collective.

The sum of ``w0, w1, ..., wN`` in that order is what MirroredStrategy computes over the same
replicas, so one node's results are MirroredStrategy's bit for bit (float32, float64, float16,
integers; bfloat16, which MPI cannot carry, through NumPy's kernels as MirroredStrategy sums it).

A job spanning nodes is hierarchical: after the reduce-scatter the node leaders (node rank 0)
all-reduce their node's sum over MPI (``Iallreduce`` among the leaders) and raise a "final" flag
the others wait for; below :data:`EAGER_BYTES` the call is one MPI all-reduce over every worker.
Across nodes the sum is MPI's order, not worker order (float tolerance).

The engine is still MPI: the window comes from MPI, and every collective is numbered and waited
for by the strategy's :class:`~cudist._dataplane.transports.mpi.Communicator`
(:meth:`~cudist._dataplane.transports.mpi.Communicator.collective`): the same deadline
(``timeout_seconds``), stall warning, arrival notices naming missing workers and exit rendezvous as
every MPI collective. On one node the default check's hash of each call is compared in shared
memory (posted with the arrival, in two rows by turns) instead of by an MPI ``Iallreduce``, on
every path (MPI's included, so workers that disagree on the path meet there too): workers that
disagree get the same :class:`~cudist._replica_engine.ReplicaMismatchError` before any data is
read, and a window too small for a call grows only after every worker has arrived with the same
sizes. (The comparison costs nothing, so it is made with ``CUDIST_CHECK_COLLECTIVES=0`` too.) A
job of several nodes keeps MPI's hash check, which covers every worker of every node. MPICH unlinks the
window's file as soon as every worker has mapped it, so nothing stays in ``/dev/shm`` whatever
happens to the job.

``CUDIST_SHM_MIN_BYTES`` sends smaller all-reduces through MPI instead (default 0: none, the
one-round path measured faster than MPI at every size).
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from cudist import _core, _settings
from cudist._dataplane.transports import mpi
from cudist._kernels import KernelBackend, cpu_backend, is_bfloat16, numpy_backend
from cudist._reduce_util import ReduceOp

__all__ = ["SharedMemoryAllReduce", "connect", "DEFAULT_MIN_BYTES", "EAGER_BYTES"]

#: All-reduces of fewer bytes (all buffers of one call together) go through MPI's own Iallreduce
#: (``CUDIST_SHM_MIN_BYTES`` overrides it): 0, shared memory measured faster at every size.
DEFAULT_MIN_BYTES = 0
#: Below this many bytes, one round (every worker sums every slot: N times the arithmetic, one
#: synchronization); from it on, the reduce-scatter (each worker a slice, two rounds). Measured with
#: 2 workers (issue #30): at 64 KiB one round took 42 us against the reduce-scatter's 54 us (raw
#: MPI 54 us), at 128 KiB they tie, at 256 KiB the reduce-scatter wins (109 against 136 us).
EAGER_BYTES = 128 << 10
#: Every buffer starts on its own cache line in a slot; each worker's slice is a multiple of this.
_ALIGN = 64
#: The control area: one cache line per flag (no false sharing between writers), one row per kind.
_LINE = _ALIGN // 8  # int64 entries per line
#: The hashes alternate between two rows by the call's parity: a worker posts the next call's hash
#: while a slower one may still compare this call's.
_ARRIVED, _REDUCED, _FINAL, _HELD, _HASH = range(5)
_FLAGS = 6
#: Result banks: a result is a read-only view of one, and a bank is reused once no worker holds a
#: view of it (reference counts, published with the arrival). Past that, a scratch bank, copied out.
_BANKS = 3
#: How long one call of the extension spins for the other workers before returning to be polled
#: under the communicator's deadline (it yields the CPU every few checks meanwhile).
_SPIN_NS = 100_000
#: The dtypes the extension sums (its kernel dtypes, bfloat16 by name: ml_dtypes is not imported).
_NATIVE_DTYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64"))
#: Their canonical objects' ids (a dtype's hash is computed afresh at every lookup; these objects live
#: as long as NumPy): the per-step check, before the general one.
_NATIVE_IDS = frozenset(id(d) for d in _NATIVE_DTYPES)


def _native_sum(dtype: np.dtype[Any]) -> bool:
    """Whether the extension's one-round all-reduce sums ``dtype`` (a kernel dtype)."""
    return dtype in _NATIVE_DTYPES or is_bfloat16(dtype)


def _finished() -> bool:
    return True


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Pack:
    """Buffers of one dtype all-reduced as their concatenation (:meth:`SharedMemoryAllReduce.allreduce_packs`)."""

    __slots__ = ("buffers", "dtype", "size")

    def __init__(self, buffers: list[npt.NDArray[Any]], dtype: np.dtype[Any], size: int) -> None:
        self.buffers = buffers
        self.dtype = dtype
        self.size = size


class SharedMemoryAllReduce:
    """SUM all-reduces of host buffers over the shared memory of each node (see the module's docstring).

    Created collectively by every worker of ``communicator`` (use :func:`connect`).

    Args:
        communicator: the strategy's MPI communicator; its collectives carry this one's numbers,
            deadlines and notices.
        node_size: workers per node, consecutive in worker order (a simulated split for tests);
            None: the nodes MPI reports (``COMM_TYPE_SHARED``).
        min_bytes: all-reduces of fewer bytes go through MPI.
        eager_bytes: all-reduces of fewer bytes take the one-round path.
    """

    def __init__(
        self,
        communicator: mpi.Communicator,
        *,
        node_size: int | None = None,
        min_bytes: int = 0,
        eager_bytes: int = EAGER_BYTES,
    ) -> None:
        MPI, why = mpi.load()
        if MPI is None:  # pragma: no cover - a Communicator exists only with mpi4py
            raise RuntimeError(why)
        self._MPI = MPI
        self.communicator = communicator
        self.min_bytes = int(min_bytes)
        self.eager_bytes = int(eager_bytes)
        comm = communicator.comm
        rank = comm.Get_rank()
        if node_size is None:
            self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        else:
            self.node = comm.Split(rank // node_size, rank)
        self.node_rank = int(self.node.Get_rank())
        self.node_size = int(self.node.Get_size())
        leaders = comm.Split(0 if self.node_rank == 0 else MPI.UNDEFINED, rank)
        self.leaders: Any = None if leaders == MPI.COMM_NULL else leaders
        self.num_nodes = int(self.node.bcast(self.leaders.Get_size() if self.leaders is not None else 0, root=0))
        #: Whether any node has several workers (else shared memory saves nothing: every call is MPI's).
        self.useful = bool(comm.allreduce(self.node_size, op=MPI.MAX) > 1)
        #: The byte sizes :meth:`allreduce_one` takes (the one-round path's, from ``min_bytes``; none
        #: across nodes, where small messages are MPI's), as bounds on ``nbytes`` itself (see _kernels).
        self._small_lo = max(1, self.min_bytes)
        self._small_hi = self.eager_bytes if self.num_nodes == 1 and self.useful else 0
        self._one_lo, self._one_hi = 1, -1
        self._kernels = cpu_backend()
        self._win: Any = None
        self._capacity = 0  # bytes per slot
        self._eager_cap = _round_up(max(self.eager_bytes, _ALIGN), 4096) if self.num_nodes == 1 else 0
        self._eager: list[list[npt.NDArray[np.uint8]]] = [[], []]  # [parity][worker]
        self._eager_area: npt.NDArray[np.uint8] = np.empty(0, np.uint8)  # both sets, for the extension
        self._kind_crcs: dict[str, int] = {}
        # allreduce_one's call and its result, handed to and from _start_one around the communicator
        self._pending: tuple[npt.NDArray[Any], str, str | Callable[[], str]] = (np.empty(0), "", "")
        self._result: npt.NDArray[Any] = np.empty(0)
        #: The extension's per-step call on the current window (``_core.shm_one_caller``), and the
        #: calls and bytes of the callers of retired windows.
        self._one: Any = None
        self._one_counts = (0, 0)
        self._slots: list[npt.NDArray[np.uint8]] = []
        self._banks: list[npt.NDArray[np.uint8]] = []
        self._free_refs = 0
        self._retired: list[Any] = []  # smaller windows, kept mapped (results may be views of them)
        self._ctrl: npt.NDArray[np.int64] = np.empty(0, np.int64)
        #: The extension's first arguments: the control area, the one-round slots, node size and rank.
        self._window: tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8], int, int] = (
            self._ctrl, self._eager_area, self.node_size, self.node_rank)
        self._flags: Any = memoryview(b"")  # the control area as int64 items: a flag read is ~40 ns, not numpy's ~1 us
        self._rows: list[range] = []  # per kind, the flag indices of the node's workers
        self._count = 0  # shared-memory all-reduces since the window was made (the flags' values)
        # This worker's all-reduces by path but allreduce_one's (counted by the extension): see stats.
        self._stats = {"calls": 0, "eager_calls": 0, "mpi_calls": 0, "bytes": 0, "unpacked_calls": 0}
        if self.useful:
            self._ensure(1 << 16)  # the eager path's buffers exist from the start (it has no resize step)

    @property
    def _kernels(self) -> Any:
        """The CPU backend that sums (a test swaps in faulty kernels, which only the general path calls)."""
        return self._kernels_now

    @_kernels.setter
    def _kernels(self, kernels: Any) -> None:
        self._kernels_now = kernels
        # allreduce_one's size test, on nbytes without rounding: lo <= roundup(nbytes, _ALIGN) < hi.
        # Other kernels than a backend's (a test's faulty ones) are called from Python: no sizes then.
        lo, hi = self._small_lo, self._small_hi if isinstance(kernels, KernelBackend) else 0
        self._one_lo = (lo - 1) // _ALIGN * _ALIGN + 1
        self._one_hi = (hi - 1) // _ALIGN * _ALIGN if hi > 0 else -1

    @property
    def stats(self) -> dict[str, int]:
        """This worker's all-reduces by path (``unpacked_calls``: those of :meth:`allreduce_packs`, among
        ``calls``), and the bytes the shared-memory ones all-reduced (a new dict at each read)."""
        calls, nbytes = self._one_counts
        if self._one is not None:
            c, b = _core.shm_one_counts(self._one)
            calls, nbytes = calls + c, nbytes + b
        out = dict(self._stats)
        out["eager_calls"] += calls
        out["bytes"] += nbytes
        return out

    def __repr__(self) -> str:
        return f"<cudist shared-memory all-reduce: node rank {self.node_rank} of {self.node_size}, {self.name}>"

    @property
    def name(self) -> str:
        """What carries host all-reduces, for logs and benchmarks."""
        level = "shared memory" if self.num_nodes == 1 else f"shared memory + MPI across {self.num_nodes} nodes"
        small = (f"one round below {self.eager_bytes} B" if self.num_nodes == 1 else
                 f"MPI below {max(self.eager_bytes, self.min_bytes)} B")
        mpi_note = f", MPI below {self.min_bytes} B" if self.min_bytes and self.num_nodes == 1 else ""
        return f"{level} ({small}{mpi_note})"

    # ------------------------------------------------------------------ the window
    def _ensure(self, nbytes: int) -> None:
        """A window whose slots hold ``nbytes`` (collective over the node; all workers ask the same size).

        Called once every worker of the node is known to be here (at creation, or after the
        arrival flags of a collective). A smaller window is retired, not freed: results handed out
        are views of its banks, and freeing it (unmapping them) under a user's array would crash
        the process. Capacities double, so the retired windows cost at most the current one.
        """
        if nbytes <= self._capacity:
            return
        MPI = self._MPI
        if self._win is not None:
            self._retired.append(self._win)
        cap = max(1 << 16, 1 << (nbytes - 1).bit_length())
        n = self.node_size
        ctrl_bytes = _round_up(_FLAGS * n * _ALIGN, 4096)
        eager = 2 * n * self._eager_cap
        total = ctrl_bytes + eager + (n + _BANKS + 1) * cap
        # Node rank 0 holds the whole window (one contiguous mapping on every worker).
        win = MPI.Win.Allocate_shared(total + _ALIGN if self.node_rank == 0 else 0, 1, comm=self.node)
        buf, _ = win.Shared_query(0)
        raw = memoryview(buf)
        # The layout starts on a cache line (the extension's atomics and slots need it; a shared
        # mapping is page-aligned, so every worker skips the same bytes).
        raw = raw[-np.frombuffer(raw, np.uint8, 1).ctypes.data % _ALIGN :]
        ctrl = np.frombuffer(raw[:ctrl_bytes], np.int64)
        if self.node_rank == 0:
            ctrl[:] = 0
        win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for Win.Sync, the memory barrier of the flags

        def area(lo: int, size: int) -> npt.NDArray[np.uint8]:
            # Each area its own base object (a memoryview, not an array): views of a result keep
            # exactly their bank referenced, which is how a bank is known to be held.
            return np.frombuffer(raw[lo : lo + size], np.uint8)

        e = self._eager_cap
        self._eager = [[area(ctrl_bytes + (p * n + w) * e, e) for w in range(n)] for p in range(2)]
        self._eager_area = area(ctrl_bytes, eager)
        self._window = (ctrl, self._eager_area, n, self.node_rank)  # the extension's first arguments
        if self._one is not None:  # the retired window's caller: its counts are kept
            c, b = _core.shm_one_counts(self._one)
            self._one_counts = (self._one_counts[0] + c, self._one_counts[1] + b)
        self._one = _core.shm_one_caller(ctrl, self._eager_area, n, self.node_rank, _SPIN_NS)
        base = ctrl_bytes + eager
        self._win = win
        self._ctrl = ctrl
        self._flags = raw[:ctrl_bytes].cast("q")
        self._rows = [range(self._flag(k, 0), self._flag(k, n), _LINE) for k in range(_FLAGS)]
        self._slots = [area(base + w * cap, cap) for w in range(n)]
        self._banks = [area(base + (n + k) * cap, cap) for k in range(_BANKS + 1)]  # the last: scratch, copied out
        self._free_refs = sys.getrefcount(self._banks[0])
        self._capacity = cap
        self._count = 0
        win.Sync()
        self.node.Barrier()  # the zeroed flags are seen by all before any is raised

    # ------------------------------------------------------------------ flags
    def _flag(self, kind: int, w: int) -> int:
        return (kind * self.node_size + w) * _LINE

    def _raise(self, kind: int) -> None:
        self._win.Sync()  # the data written before is visible before the flag
        self._flags[self._flag(kind, self.node_rank)] = self._count

    def _all_up(self, kind: int) -> bool:
        flags = self._flags
        count = self._count
        for i in self._rows[kind]:
            if flags[i] < count:
                return False
        self._win.Sync()  # the others' data is read after their flags
        return True

    def _post_hash(self, kind: str, pairs: Sequence[tuple[Any, npt.NDArray[Any] | _Pack]]) -> None:
        """This call's hash (the MPI check's, of the sizes and dtypes), for the others to compare."""
        shape = [x for _, recv in pairs for x in (recv.size, recv.dtype.num)]
        self._flags[self._flag(_HASH + (self._count & 1), self.node_rank)] = self.communicator.call_hash(kind, shape)

    def _check_hashes(self, kind: str, detail: str | Callable[[], str]) -> None:
        """Raises the communicator's mismatch error unless every worker of the node posted this worker's hash."""
        flags = self._flags
        row = _HASH + (self._count & 1)
        mine = flags[self._flag(row, self.node_rank)]
        if any(flags[i] != mine for i in self._rows[row]):
            raise self.communicator.mismatch_error(kind, detail, self.communicator.seq)

    def _held(self) -> int:
        """The banks this worker still holds results in (a bit each), by their reference counts."""
        getrefcount = sys.getrefcount
        banks = self._banks
        free = self._free_refs  # measured the same way: the list's reference and the argument
        return sum(1 << k for k in range(_BANKS) if getrefcount(banks[k]) > free)

    def _pick_bank(self) -> int:
        """The first bank no worker of the node holds (every worker computes the same from the masks)."""
        held = 0
        for i in self._rows[_HELD]:
            held |= self._flags[i]
        for k in range(_BANKS):
            if not held >> k & 1:
                return k
        return _BANKS  # every bank held somewhere: the scratch bank, copied out before the next call

    # ------------------------------------------------------------------ the all-reduce
    def _kernels_for(self, dtype: np.dtype[Any]) -> Any:
        """The kernels that sum ``dtype`` as MirroredStrategy does: the CPU backend's, else NumPy's
        (bfloat16: float32 accumulation, one rounding), else None."""
        if self._kernels.computes(dtype):
            return self._kernels
        fallback: KernelBackend = numpy_backend()
        return fallback if fallback.computes(dtype) else None

    def path(self, pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]]) -> str:
        """How :meth:`allreduce` carries ``pairs``: ``"eager"`` (one round: every worker sums every
        slot), ``"scatter"`` (each worker sums a slice, results in shared banks) or ``"mpi"``.

        Buffers of a kernel dtype take shared memory from ``min_bytes`` in all; on one node, buffers
        of a dtype only the kernels sum (bfloat16: MPI has no such type) whatever their size.
        """
        if not self.useful:
            return "mpi"
        return self._path(
            (recv.dtype, recv.nbytes, send.dtype == recv.dtype and send.flags.c_contiguous) for send, recv in pairs
        )

    def _path(self, buffers: Iterable[tuple[np.dtype[Any], int, bool]]) -> str:
        """:meth:`path` of buffers given as (dtype, bytes, whether the kernels can read the send side)."""
        total = 0
        mpi_lacks = False
        for dt, nbytes, readable in buffers:
            if not readable or self._kernels_for(dt) is None:
                return "mpi"
            mpi_lacks = mpi_lacks or dt.kind == "V"
            total = _round_up(total + nbytes, _ALIGN)
        if total == 0 or (mpi_lacks and self.num_nodes > 1):
            return "mpi"
        if total < self.min_bytes and not mpi_lacks:
            return "mpi"
        if total <= self._eager_cap and (total < self.eager_bytes or mpi_lacks):
            return "eager"
        if total < self.eager_bytes and not mpi_lacks:
            return "mpi"  # several nodes: small messages cross them in one MPI all-reduce
        return "scatter"

    def traffic(self, nbytes: int) -> tuple[str, int]:
        """The path of a one-buffer float32 all-reduce of ``nbytes`` and the bytes each worker moves through
        memory for it (reads + writes: copies in, the sum's reads and writes, copies out), for benchmarks."""
        path = self.path([(np.empty(0, np.float32), np.empty(0, np.float32))] if nbytes == 0 else
                         [(np.empty(nbytes // 4, np.float32),) * 2])
        n = self.node_size
        if path == "eager":  # copy in (read + write), sum every slot (n reads, one write)
            return path, (3 + n) * nbytes
        if path == "scatter":  # the others' slices copied in, one slice summed from every worker, no copy out
            return path, (2 * (n - 1) * nbytes + n * nbytes + nbytes) // n
        return path, 0

    def allreduce(
        self,
        pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
        kind: str = "all_reduce",
        detail: str | Callable[[], str] | None = None,
    ) -> list[npt.NDArray[Any]]:
        """SUM all-reduces each ``(send, recv)`` pair: the results, one per pair.

        A result is ``recv`` filled with the sum (the eager and MPI paths, and the scatter path when
        every bank is held), or a read-only view of the node's shared memory, valid as long as it is
        held (its bank is reused once no worker of the node holds it).

        Args:
            pairs: (send, recv) host arrays, one pair per buffer (``send is recv``: in place);
                ``send`` C-contiguous, ``recv`` C-contiguous of its shape and dtype.
            kind: names the collective in fingerprints and errors.
            detail: describes the call in fingerprints (default: the buffers' shapes and dtypes).

        Raises:
            DeadlineExceededError: a worker did not join within ``timeout_seconds``.
            ReplicaMismatchError: the workers called different collectives.
        """
        path = self.path(pairs)
        several_nodes = self.num_nodes > 1
        if path == "mpi":
            self._stats["mpi_calls"] += 1
            if several_nodes:  # MPI's own hash check covers every worker of every node
                self.communicator.allreduce(pairs, kind, detail)
                return [recv for _, recv in pairs]
        if detail is None:
            detail = lambda: mpi.describe([p[1] for p in pairs])  # noqa: E731 - described only for an error
        results: list[npt.NDArray[Any]] = []
        if path == "eager":
            start: Callable[[], Callable[[], bool]] = partial(self._start_eager, pairs, kind, detail)
            results = [recv for _, recv in pairs]
            self._stats["bytes"] += sum(recv.nbytes for recv in results)
        else:
            start = partial(self._start_scatter if path == "scatter" else self._start_mpi, pairs, results, kind, detail)
        # One node: no MPI hash check; every path (MPI's too, so that workers that disagree on the
        # path meet at the first flag rather than in different protocols) compares the call's hash
        # in shared memory. Several nodes: MPI's check, across them, before anything else.
        self.communicator.collective(kind, detail, start, hash_check=several_nodes)
        return results

    def allreduce_packs(
        self,
        packs: Sequence[Sequence[npt.NDArray[Any]]],
        kind: str = "all_reduce",
        detail: str | Callable[[], str] | None = None,
    ) -> list[npt.NDArray[Any]] | None:
        """SUM all-reduces packs of buffers without packing them: per pack, the sum of the
        concatenation of its buffers (flat), or None when the call would not take the reduce-scatter.

        Each worker copies the parts of its buffers that the others sum straight into its slot, and
        sums its own slice reading its buffers where they are: the pack a caller would build (one
        copy of every byte) is never made. The sums are those of :meth:`allreduce` over the packed
        buffers, bit for bit (each element is the same sum, in worker order). Collective: every
        worker calls it with the same sizes and dtypes.

        Args:
            packs: per pack, flat C-contiguous host arrays of one dtype.
            kind: names the collective in fingerprints and errors.
            detail: describes the call in fingerprints (default: the packs' sizes and dtypes).

        Returns:
            Per pack a flat array: a read-only view of the node's shared memory (see
            :meth:`allreduce`), or a fresh array when every bank is held; None (nothing done, no
            collective made) when these packs take another path than the reduce-scatter: then pack
            them and call :meth:`allreduce`.

        Raises:
            DeadlineExceededError: a worker did not join within ``timeout_seconds``.
            ReplicaMismatchError: the workers called different collectives.
        """
        if not self.useful:
            return None
        items = []
        for bufs in packs:
            dt = bufs[0].dtype
            size = sum(b.size for b in bufs)
            ok = all(b.dtype == dt and b.ndim == 1 and b.flags.c_contiguous for b in bufs)
            items.append((dt, size * dt.itemsize, ok))
        if self._path(items) != "scatter":
            return None
        work = [(None, _Pack(list(bufs), dt, nbytes // dt.itemsize)) for bufs, (dt, nbytes, _) in zip(packs, items)]
        if detail is None:
            detail = lambda: ", ".join(f"{p.dtype.name}[{p.size}]" for _, p in work)  # noqa: E731
        results: list[npt.NDArray[Any]] = []
        several_nodes = self.num_nodes > 1
        self._stats["unpacked_calls"] += 1
        self.communicator.collective(kind, detail, lambda: self._start_scatter(work, results, kind, detail),
                                     hash_check=several_nodes)
        return results

    def allreduce_one(
        self, send: npt.NDArray[Any], kind: str, detail: str | Callable[[], str]
    ) -> npt.NDArray[Any] | None:
        """:meth:`allreduce` of one host array when it takes the one-round path: its sum, a new array;
        None, having done nothing, when it would take another path (call :meth:`allreduce`).

        The per-step common case (one array of one replica per worker), decided without
        :meth:`path`'s walk: one call of the extension copies in (any layout: a send that is not
        C-contiguous goes through a C-order copy, so every worker takes this path whatever its
        array's strides), waits, sums, makes the result and counts the call in :attr:`stats`.
        """
        nbytes = send.nbytes
        if not (self._one_lo <= nbytes <= self._one_hi and (id(send.dtype) in _NATIVE_IDS or _native_sum(send.dtype))):
            return None
        self._pending = (send, kind, detail)
        self.communicator.collective(kind, detail, self._start_one, hash_check=False)
        return self._result

    def _start_one(self) -> Callable[[], bool]:
        """:meth:`_start_eager` of :meth:`allreduce_one`'s array, the result made by the extension."""
        send, kind, detail = self._pending
        self._count += 1
        out = self._one(self._count, send, kind, self.communicator.seq)
        if out.__class__ is not tuple:  # the usual end: every worker was there within the spin
            self._result = out
            return _finished
        status, recv = out
        self._result = recv
        # The sum reads only the slots (send is in them already): recv stands for both sides.
        return self._eager_poll(status, self._count, ((recv, recv),), kind, detail, True)

    def _start_mpi(
        self,
        pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
        results: list[npt.NDArray[Any]],
        kind: str,
        detail: str | Callable[[], str],
    ) -> Callable[[], bool]:
        """MPI's all-reduce (dtypes the kernels lack, or below ``min_bytes``), after the hashes' round."""
        self._count += 1
        self._post_hash(kind, pairs)
        self._raise(_ARRIVED)
        reqs: list[Any] = []

        def done() -> bool:
            nonlocal reqs
            if not reqs:
                if not self._all_up(_ARRIVED):
                    return False
                self._check_hashes(kind, detail)
                MPI = self._MPI
                comm = self.communicator.comm
                reqs = [comm.Iallreduce(MPI.IN_PLACE if send is recv else send, recv, MPI.SUM) for send, recv in pairs]
            if not self._MPI.Request.Testall(reqs):
                return False
            results.extend(recv for _, recv in pairs)
            return True

        return done

    def _start_eager(
        self,
        pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
        kind: str,
        detail: str | Callable[[], str],
        native: bool | None = None,
    ) -> Callable[[], bool]:
        """One round, in one call of the extension (``_core.shm_all_reduce``): every worker copies
        its buffers in, posts the call's hash, raises "arrived", spins briefly for the others and
        sums every slot itself into ``recv``, in worker order.

        A wait longer than the spin returns here, to be polled (``_core.shm_wait``) under the
        communicator's deadline, stall warning and notices. Two sets of slots, used by turns: a
        worker reuses a set only after every worker has arrived in the next collective, so after
        every worker has finished reading that set. ``native``: whether the extension sums (None:
        decided here). The results are the ``recv`` arrays, filled once the poll function is true.
        """
        self._count += 1
        count = self._count
        self._stats["eager_calls"] += 1
        if native is None:
            # The CPU backends sum bit for bit alike, so the extension sums the kernel dtypes whatever
            # backend was chosen; anything else (other dtypes, a test's faulty kernels) is summed here.
            native = isinstance(self._kernels, KernelBackend) and all(_native_sum(p[1].dtype) for p in pairs)
        status = _core.shm_all_reduce(*self._window, count, pairs, self._kind_crc(kind), self.communicator.seq,
                                      _SPIN_NS, native)
        if status == 0 and native:  # the usual end: every worker was there within the spin
            return _finished
        return self._eager_poll(status, count, pairs, kind, detail, native)

    def _kind_crc(self, kind: str) -> int:
        crc = self._kind_crcs.get(kind)
        if crc is None:
            crc = self._kind_crcs[kind] = zlib.crc32(kind.encode())
        return crc

    def _eager_poll(
        self,
        status: int,
        count: int,
        pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
        kind: str,
        detail: str | Callable[[], str],
        native: bool,
    ) -> Callable[[], bool]:
        """The poll function of one-round call ``count`` after its first call of the extension (``status``):
        waits for the others (under the communicator's deadline), then sums (the extension, or the
        CPU backend from here when not ``native``)."""
        window = self._window

        def done() -> bool:
            nonlocal status
            if status == 1:
                status = _core.shm_wait(*window, count, _SPIN_NS)
                if status == 1:
                    return False
            if status == 2:
                raise self.communicator.mismatch_error(kind, detail, self.communicator.seq)
            if native:
                _core.shm_sum(*window, count, pairs)
            else:
                slots = self._eager[count & 1]
                off = 0
                for _, recv in pairs:
                    nb = recv.nbytes
                    ins = [s[off : off + nb].view(recv.dtype) for s in slots]
                    self._kernels_for(recv.dtype).trusted.reduce_to_one(ins, ReduceOp.SUM, recv.reshape(-1))
                    off = _round_up(off + nb, _ALIGN)
            status = 0
            return True

        return done

    def _start_scatter(
        self,
        pairs: Sequence[tuple[npt.NDArray[Any] | None, npt.NDArray[Any] | _Pack]],
        results: list[npt.NDArray[Any]],
        kind: str,
        detail: str | Callable[[], str],
    ) -> Callable[[], bool]:
        """A reduce-scatter then an all-gather by reading, in rounds of flags.

        Each worker copies into its slot only the slices the others sum (its own it sums from
        ``send`` directly), and writes its slice of the sum once, into a bank every worker reads.
        A window too small for the call grows first, once every worker has arrived (it announces
        its call without data, then copies it in once the new window exists). ``pairs`` are
        ``(send, recv)`` arrays, or ``(None, pack)`` (:meth:`allreduce_packs`: the send side is the
        pack's buffers, end to end; the results are flat).
        """
        offsets = []
        off = 0
        for _, recv in pairs:
            offsets.append(off)
            off = _round_up(off + recv.size * recv.dtype.itemsize, _ALIGN)
        nbytes = off
        self._count += 1
        self._stats["calls"] += 1
        me = self.node_rank
        # Per buffer: its send side as (start element, flat array) segments, recv (None: a pack's flat
        # result), its pack offset, dtype, size, and this worker's slice [lo, hi).
        slices = []
        for (send, recv), o in zip(pairs, offsets):
            if isinstance(recv, _Pack):
                segs, start = [], 0
                for b in recv.buffers:
                    segs.append((start, b))
                    start += b.size
                out = None
            else:
                assert send is not None  # (send, recv) arrays
                segs, out = [(0, send.reshape(-1))], recv
            lo, hi = self._slice(recv.size, me)
            slices.append((segs, out, o, recv.dtype, recv.size, lo, hi))

        def copy_in() -> None:
            self._flags[self._flag(_HELD, me)] = self._held()
            mine = self._slots[me]
            for segs, _, o, dt, size, lo, hi in slices:
                slot = mine[o : o + size * dt.itemsize].view(dt)
                for a, flat in segs:
                    b = a + flat.size
                    if a < lo:  # the part before this worker's slice
                        e = min(b, lo)
                        np.copyto(slot[a:e], flat[: e - a], casting="no")
                    if b > hi:  # the part after it
                        x = max(a, hi)
                        np.copyto(slot[x:b], flat[x - a :], casting="no")

        grow = nbytes > self._capacity
        if not grow:
            copy_in()
        self._post_hash(kind, pairs)
        self._raise(_ARRIVED)
        phase = 0
        bank: npt.NDArray[np.uint8] = self._banks[0]
        reqs: list[Any] = []

        def done() -> bool:
            nonlocal phase, bank, reqs
            if phase == 0:  # every worker here with the same call
                if not self._all_up(_ARRIVED):
                    return False
                self._check_hashes(kind, detail)
                if grow:  # every worker grows it (same sizes): a blocking collective among present workers
                    self._ensure(nbytes)
                    self._count = 1
                    copy_in()
                    self._raise(_ARRIVED)
                phase = 1
            if phase == 1:  # every slot written: sum this worker's slices
                if grow and not self._all_up(_ARRIVED):
                    return False
                bank = self._banks[self._pick_bank()]
                for segs, _, o, dt, size, lo, hi in slices:
                    nb = size * dt.itemsize
                    others = [s[o : o + nb].view(dt) for s in self._slots]
                    total = bank[o : o + nb].view(dt)
                    reduce_to_one = self._kernels_for(dt).trusted.reduce_to_one
                    for a, flat in segs:  # this worker's own part read where it is, segment by segment
                        x, y = max(a, lo), min(a + flat.size, hi)
                        if x < y:
                            ins = [flat[x - a : y - a] if w == me else others[w][x:y] for w in range(len(others))]
                            reduce_to_one(ins, ReduceOp.SUM, total[x:y])
                self._raise(_REDUCED)
                phase = 2
            if phase == 2:  # every slice summed
                if not self._all_up(_REDUCED):
                    return False
                phase = 3
                if self.num_nodes > 1 and self.leaders is not None:
                    MPI = self._MPI
                    reqs = [self.leaders.Iallreduce(MPI.IN_PLACE, bank[o : o + size * dt.itemsize].view(dt), MPI.SUM)
                            for _, _, o, dt, size, _, _ in slices]
            if phase == 3 and self.num_nodes > 1:  # across nodes: the leaders' MPI all-reduce
                if self.leaders is not None:
                    if not self._MPI.Request.Testall(reqs):
                        return False
                    self._raise(_FINAL)
                elif not self._leader_done():
                    return False
            scratch = bank is self._banks[_BANKS]
            for _, out, o, dt, size, _, _ in slices:
                view = bank[o : o + size * dt.itemsize].view(dt)
                if out is not None:
                    view = view.reshape(out.shape)
                if scratch:  # the bank is reused by the next call: copied out
                    if out is None:
                        out = np.empty(size, dt)
                    np.copyto(out, view, casting="no")
                    results.append(out)
                else:
                    view.flags.writeable = False  # the other workers read it too
                    results.append(view)
            self._stats["bytes"] += sum(size * dt.itemsize for _, _, _, dt, size, _, _ in slices)
            return True

        return done

    def _slice(self, size: int, w: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of a buffer of ``size`` that worker ``w`` sums (on cache lines)."""
        step = _round_up(-(-size // self.node_size), _ALIGN)
        return min(size, w * step), min(size, (w + 1) * step)

    def _leader_done(self) -> bool:
        if self._flags[self._flag(_FINAL, 0)] >= self._count:
            self._win.Sync()
            return True
        return False


def connect(communicator: mpi.Communicator | None, enabled: bool = True) -> SharedMemoryAllReduce | None:
    """The shared-memory transport for ``communicator``'s workers, or None where it would not serve.

    Collective over the communicator's workers (every worker calls it, with the same ``enabled``).
    None for a one-worker job, when ``enabled`` is false or ``CUDIST_SHM_TRANSPORT`` is ``off``,
    and when no node has several workers (every all-reduce is MPI's then).

    Args:
        communicator: the strategy's communicator (None: one worker).
        enabled: False: plain MPI (``CommunicationImplementation.RING`` asks for it).

    Raises:
        ValueError: a ``CUDIST_SHM_*`` or ``CUDIST_NODE_SIZE`` value that cannot be used.
    """
    if communicator is None or not enabled or not _settings.shm_transport():
        return None
    transport = SharedMemoryAllReduce(
        communicator, node_size=_settings.node_size(), min_bytes=_settings.shm_min_bytes(DEFAULT_MIN_BYTES)
    )
    if not transport.useful:
        return None
    return transport
