"""The intra-node transport of multi-worker jobs: an all-reduce over MPI-3 shared memory.

The workers of one node (``MPI.Comm.Split_type(COMM_TYPE_SHARED)``, or consecutive groups of
``CUDIST_NODE_SIZE`` workers) share one window (``MPI.Win.Allocate_shared``): a slot per worker, a
result area and a control area of flags. One all-reduce of host buffers is

1. each worker copies its buffers into its slot and raises its "arrived" flag;
2. once every flag is up, each worker sums its slice of every buffer over all slots, in worker
   order, with the CPU backend's ``reduce_to_one`` (a reduce-scatter over shared memory; the sum
   of ``w0, w1, ..., wN`` in that order is what MirroredStrategy computes over the same replicas,
   so the result is bit for bit the same), into the result area, and raises its "reduced" flag;
3. once every "reduced" flag is up, each worker copies the whole result out (the all-gather by
   reading).

A job spanning nodes is hierarchical: after step 2 the node leaders (node rank 0) all-reduce their
node's result over MPI (``Iallreduce`` among the leaders) and raise a "final" flag the others wait
for, then every worker copies the result out. Across nodes the sum is MPI's order, not worker
order (float tolerance).

The engine is still MPI: the window comes from MPI, and every collective is numbered, hash-checked
and waited for by the strategy's :class:`~cudist._dataplane.transports.mpi.Communicator`
(:meth:`~cudist._dataplane.transports.mpi.Communicator.collective`): the same deadline
(``timeout_seconds``), stall warning, arrival notices naming missing workers and exit rendezvous as
every MPI collective. The hash check (an ``Iallreduce`` of 16 bytes, waited for before the data
moves) doubles as proof that every worker arrived with the same buffers, so resizing the window
(a blocking collective) only happens among workers known to be present. MPICH unlinks the window's
file as soon as every worker has mapped it, so nothing stays in ``/dev/shm`` whatever happens to
the job.

Below ``CUDIST_SHM_MIN_BYTES`` (and for dtypes the CPU kernels lack) an all-reduce goes through
MPI's own ``Iallreduce``, whose latency for small messages is lower than two rounds of flags.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from cudist import _settings
from cudist._dataplane.transports import mpi
from cudist._kernels import KernelBackend, cpu_backend, numpy_backend
from cudist._reduce_util import ReduceOp

__all__ = ["SharedMemoryAllReduce", "connect", "DEFAULT_MIN_BYTES"]

#: All-reduces of fewer bytes (all buffers of one call together) go through MPI's own Iallreduce
#: (``CUDIST_SHM_MIN_BYTES`` overrides it). Measured with ``cudist-bench all-reduce --workers 2``
#: (bench/PERFORMANCE.md): the crossover on a 2-core VM lies between 16 and 64 KiB.
DEFAULT_MIN_BYTES = 32 << 10
#: Every buffer starts on its own cache line in a slot; each worker's slice is a multiple of this.
_ALIGN = 64
#: The control area: one cache line per flag (no false sharing between writers), one row per kind.
_LINE = _ALIGN // 8  # int64 entries per line
_ARRIVED, _REDUCED, _FINAL, _HELD = range(4)
_FLAGS = 4
#: Result banks: a result is a read-only view of one, and a bank is reused once no worker holds a
#: view of it (reference counts, published with the arrival). Past that, a scratch bank, copied out.
_BANKS = 3


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class SharedMemoryAllReduce:
    """SUM all-reduces of host buffers over the shared memory of each node (see the module's docstring).

    Created collectively by every worker of ``communicator`` (use :func:`connect`).

    Args:
        communicator: the strategy's MPI communicator; its collectives carry this one's checks and
            deadlines.
        node_size: workers per node, consecutive in worker order (a simulated split for tests);
            None: the nodes MPI reports (``COMM_TYPE_SHARED``).
        min_bytes: all-reduces of fewer bytes go through MPI.
    """

    def __init__(self, communicator: mpi.Communicator, *, node_size: int | None = None, min_bytes: int = 0) -> None:
        MPI, why = mpi.load()
        if MPI is None:  # pragma: no cover - a Communicator exists only with mpi4py
            raise RuntimeError(why)
        self._MPI = MPI
        self.communicator = communicator
        self.min_bytes = int(min_bytes)
        comm = communicator.comm
        rank = comm.Get_rank()
        if node_size is None:
            self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        else:
            self.node = comm.Split(rank // node_size, rank)
        self.node_rank = self.node.Get_rank()
        self.node_size = self.node.Get_size()
        leaders = comm.Split(0 if self.node_rank == 0 else MPI.UNDEFINED, rank)
        self.leaders: Any = None if leaders == MPI.COMM_NULL else leaders
        self.num_nodes = int(self.node.bcast(self.leaders.Get_size() if self.leaders is not None else 0, root=0))
        #: Whether any node has several workers (else shared memory saves nothing: every call is MPI's).
        self.useful = bool(comm.allreduce(self.node_size, op=MPI.MAX) > 1)
        self._kernels: Any = cpu_backend()
        self._win: Any = None
        self._capacity = 0  # bytes per slot
        self._slots: list[npt.NDArray[np.uint8]] = []
        self._banks: list[npt.NDArray[np.uint8]] = []
        self._free_refs = 0
        self._retired: list[Any] = []  # smaller windows, kept mapped (results may be views of them)
        self._ctrl: npt.NDArray[np.int64] = np.empty(0, np.int64)
        self._count = 0  # shared-memory all-reduces so far (the flags' values)
        #: Bytes this worker copied into and out of shared memory, and summed, over its all-reduces.
        self.stats = {"calls": 0, "mpi_calls": 0, "bytes": 0}

    def __repr__(self) -> str:
        return (
            f"<cudist shared-memory all-reduce: node rank {self.node_rank} of {self.node_size}, "
            f"{self.num_nodes} node(s), MPI below {self.min_bytes} B>"
        )

    @property
    def name(self) -> str:
        """What carries host all-reduces, for logs and benchmarks."""
        level = "shared memory" if self.num_nodes == 1 else f"shared memory + MPI across {self.num_nodes} nodes"
        return f"{level} (MPI below {self.min_bytes} B)"

    # ------------------------------------------------------------------ the window
    def _ensure(self, nbytes: int) -> None:
        """A window whose slots hold ``nbytes`` (collective over the node; all workers ask the same size).

        A smaller window is retired, not freed: results handed out are views of its banks, and
        freeing it (unmapping them) under a user's array would crash the process. Capacities
        double, so the retired windows cost at most as much as the current one.
        """
        if nbytes <= self._capacity:
            return
        MPI = self._MPI
        if self._win is not None:
            self._retired.append(self._win)
        cap = max(1 << 16, 1 << (nbytes - 1).bit_length())
        n = self.node_size
        ctrl_bytes = _round_up(_FLAGS * n * _ALIGN, 4096)
        total = ctrl_bytes + (n + _BANKS + 1) * cap
        # Node rank 0 holds the whole window (one contiguous mapping on every worker).
        win = MPI.Win.Allocate_shared(total if self.node_rank == 0 else 0, 1, comm=self.node)
        buf, _ = win.Shared_query(0)
        raw = memoryview(buf)
        ctrl = np.frombuffer(raw[:ctrl_bytes], np.int64)
        if self.node_rank == 0:
            ctrl[:] = 0
        win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for Win.Sync, the memory barrier of the flags

        def area(i: int) -> npt.NDArray[np.uint8]:
            # Each area its own base object (a memoryview, not an array): views of a result keep
            # exactly their bank referenced, which is how a bank is known to be held.
            lo = ctrl_bytes + i * cap
            return np.frombuffer(raw[lo : lo + cap], np.uint8)

        self._win = win
        self._ctrl = ctrl
        self._slots = [area(w) for w in range(n)]
        self._banks = [area(n + k) for k in range(_BANKS + 1)]  # the last: the scratch bank, copied out
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
        self._ctrl[self._flag(kind, self.node_rank)] = self._count

    def _all_up(self, kind: int) -> bool:
        lo = self._flag(kind, 0)
        if (self._ctrl[lo : lo + self.node_size * _LINE : _LINE] >= self._count).all():
            self._win.Sync()  # the others' data is read after their flags
            return True
        return False

    def _held(self) -> int:
        """The banks this worker still holds results in (a bit each), by their reference counts."""
        getrefcount = sys.getrefcount
        banks = self._banks
        free = self._free_refs  # measured the same way: the list's reference and the argument
        return sum(1 << k for k in range(_BANKS) if getrefcount(banks[k]) > free)

    def _pick_bank(self) -> int:
        """The first bank no worker of the node holds (every worker computes the same from the masks)."""
        lo = self._flag(_HELD, 0)
        held = 0
        for m in self._ctrl[lo : lo + self.node_size * _LINE : _LINE]:
            held |= int(m)
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

    def serves(self, pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]]) -> bool:
        """Whether :meth:`allreduce` carries ``pairs`` through shared memory (else through MPI).

        Buffers of a kernel dtype of ``min_bytes`` or more in all; and, on one node, buffers of a
        dtype only the kernels sum (bfloat16: MPI has no such type) whatever their size.
        """
        if not self.useful:
            return False
        total = 0
        mpi_lacks = False
        for send, recv in pairs:
            dt = recv.dtype
            if send.dtype != dt or not send.flags.c_contiguous or self._kernels_for(dt) is None:
                return False
            mpi_lacks = mpi_lacks or dt.kind == "V"
            total += recv.nbytes
        if mpi_lacks:
            return self.num_nodes == 1 and total > 0
        return total >= self.min_bytes and total > 0

    def allreduce(
        self,
        pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
        kind: str = "all_reduce",
        detail: str | Callable[[], str] | None = None,
    ) -> list[npt.NDArray[Any]]:
        """SUM all-reduces each ``(send, recv)`` pair: the results, one per pair.

        A result is a read-only view of the node's shared memory, valid as long as it is held (its
        bank is reused once no worker of the node holds it), or ``recv`` filled with the sum (MPI's
        path for small or non-kernel buffers, and when every bank is held).

        Args:
            pairs: (send, recv) host arrays, one pair per buffer (``send is recv``: in place);
                ``send`` C-contiguous, ``recv`` of its shape and dtype.
            kind: names the collective in fingerprints and errors.
            detail: describes the call in fingerprints (default: the buffers' shapes and dtypes).

        Raises:
            DeadlineExceededError: a worker did not join within ``timeout_seconds``.
            ReplicaMismatchError: the workers called different collectives.
        """
        if not self.serves(pairs):
            self.stats["mpi_calls"] += 1
            self.communicator.allreduce(pairs, kind, detail)
            return [recv for _, recv in pairs]
        if detail is None:
            detail = mpi.describe([p[1] for p in pairs])
        results: list[npt.NDArray[Any]] = []
        self.communicator.collective(kind, detail, lambda: self._start(pairs, results))
        return results

    def _start(
        self, pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]], results: list[npt.NDArray[Any]]
    ) -> Callable[[], bool]:
        """Every worker has arrived with the same buffers (the hash check): copy in, then the flags' rounds.

        Each worker copies into its slot only the slices the others sum (its own it sums from
        ``send`` directly), and writes its slice of the sum once, into a bank every worker reads.
        """
        offsets = []
        off = 0
        for _, recv in pairs:
            offsets.append(off)
            off = _round_up(off + recv.nbytes, _ALIGN)
        self._ensure(off)
        self._count += 1
        self.stats["calls"] += 1
        self._ctrl[self._flag(_HELD, self.node_rank)] = self._held()
        me = self.node_rank
        mine = self._slots[me]
        slices = []
        for (send, recv), o in zip(pairs, offsets):
            flat = send.reshape(-1)
            lo, hi = self._slice(recv.size, me)
            slot = mine[o : o + recv.nbytes].view(recv.dtype)
            if lo > 0:
                np.copyto(slot[:lo], flat[:lo], casting="no")
            if hi < recv.size:
                np.copyto(slot[hi:], flat[hi:], casting="no")
            slices.append((flat, recv, o, lo, hi))
        self._raise(_ARRIVED)
        phase = 0
        bank: npt.NDArray[np.uint8] = self._banks[0]
        reqs: list[Any] = []

        def done() -> bool:
            nonlocal phase, bank, reqs
            if phase == 0:  # every slot written: sum this worker's slices
                if not self._all_up(_ARRIVED):
                    return False
                bank = self._banks[self._pick_bank()]
                for flat, recv, o, lo, hi in slices:
                    if lo < hi:
                        reduce_to_one = self._kernels_for(recv.dtype).trusted.reduce_to_one
                        nb = recv.nbytes
                        ins = [flat[lo:hi] if w == me else s[o : o + nb].view(recv.dtype)[lo:hi]
                               for w, s in enumerate(self._slots)]
                        reduce_to_one(ins, ReduceOp.SUM, bank[o : o + nb].view(recv.dtype)[lo:hi])
                self._raise(_REDUCED)
                phase = 1
            if phase == 1:  # every slice summed
                if not self._all_up(_REDUCED):
                    return False
                phase = 2
                if self.num_nodes > 1 and self.leaders is not None:
                    MPI = self._MPI
                    reqs = [self.leaders.Iallreduce(MPI.IN_PLACE, bank[o : o + recv.nbytes].view(recv.dtype), MPI.SUM)
                            for _, recv, o, _, _ in slices]
            if phase == 2 and self.num_nodes > 1:  # across nodes: the leaders' MPI all-reduce
                if self.leaders is not None:
                    if not self._MPI.Request.Testall(reqs):
                        return False
                    self._raise(_FINAL)
                elif not self._leader_done():
                    return False
            scratch = bank is self._banks[_BANKS]
            for _, recv, o, _, _ in slices:
                view = bank[o : o + recv.nbytes].view(recv.dtype).reshape(recv.shape)
                if scratch:
                    np.copyto(recv, view, casting="no")
                    results.append(recv)
                else:
                    view.flags.writeable = False  # the other workers read it too
                    results.append(view)
            self.stats["bytes"] += sum(r.nbytes for _, r, _, _, _ in slices)
            return True

        return done

    def _slice(self, size: int, w: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of a buffer of ``size`` that worker ``w`` sums (on cache lines)."""
        step = _round_up(-(-size // self.node_size), _ALIGN)
        return min(size, w * step), min(size, (w + 1) * step)

    def _leader_done(self) -> bool:
        if self._ctrl[self._flag(_FINAL, 0)] >= self._count:
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
