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

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from cudist import _settings
from cudist._dataplane.transports import mpi
from cudist._kernels import cpu_backend
from cudist._reduce_util import ReduceOp

__all__ = ["SharedMemoryAllReduce", "connect", "DEFAULT_MIN_BYTES"]

#: All-reduces of fewer bytes (all buffers of one call together) go through MPI's own Iallreduce
#: (``CUDIST_SHM_MIN_BYTES`` overrides it). Measured with ``cudist-bench all-reduce --workers 2``
#: (bench/PERFORMANCE.md): the crossover on a 2-core VM lies between 16 and 64 KiB.
DEFAULT_MIN_BYTES = 32 << 10
#: Every buffer starts on its own cache line in a slot; each worker's slice is a multiple of this.
_ALIGN = 64
#: The control area: one cache line per flag (no false sharing between writers).
_LINE = _ALIGN // 8  # int64 entries per line


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
        self._kernels = cpu_backend()
        self._win: Any = None
        self._capacity = 0  # bytes per slot
        self._slots: list[npt.NDArray[np.uint8]] = []
        self._result: npt.NDArray[np.uint8] = np.empty(0, np.uint8)
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
        """A window whose slots hold ``nbytes`` (collective over the node; all workers ask the same size)."""
        if nbytes <= self._capacity:
            return
        MPI = self._MPI
        self.close()
        cap = max(1 << 16, 1 << (nbytes - 1).bit_length())
        n = self.node_size
        ctrl_bytes = _round_up(3 * n * _ALIGN, 4096)
        total = ctrl_bytes + (n + 1) * cap
        # Node rank 0 holds the whole window (contiguous, its NUMA node: first touch below).
        win = MPI.Win.Allocate_shared(total if self.node_rank == 0 else 0, 1, comm=self.node)
        buf, _ = win.Shared_query(0)
        mem = np.frombuffer(buf, np.uint8, total)
        ctrl = mem[:ctrl_bytes].view(np.int64)
        if self.node_rank == 0:
            ctrl[:] = 0
        win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for Win.Sync, the memory barrier of the flags
        self._win = win
        self._ctrl = ctrl
        self._slots = [mem[ctrl_bytes + w * cap : ctrl_bytes + (w + 1) * cap] for w in range(n)]
        self._result = mem[ctrl_bytes + n * cap : ctrl_bytes + (n + 1) * cap]
        self._capacity = cap
        self._count = 0
        win.Sync()
        self.node.Barrier()  # the zeroed flags are seen by all before any is raised

    def close(self) -> None:
        """Frees the window (collective over the node); the next all-reduce allocates a new one."""
        win, self._win = self._win, None
        if win is None:
            return
        self._slots, self._result = [], np.empty(0, np.uint8)
        self._ctrl = np.empty(0, np.int64)
        self._capacity = 0
        win.Unlock_all()
        win.Free()

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

    # ------------------------------------------------------------------ the all-reduce
    def serves(self, pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]]) -> bool:
        """Whether :meth:`allreduce` carries ``pairs`` through shared memory (else through MPI)."""
        if not self.useful:
            return False
        total = 0
        for send, recv in pairs:
            if not self._kernels.computes(recv.dtype) or send.dtype != recv.dtype or not recv.flags.c_contiguous:
                return False
            total += recv.nbytes
        return total >= self.min_bytes and total > 0

    def allreduce(
        self,
        pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
        kind: str = "all_reduce",
        detail: str | Callable[[], str] | None = None,
    ) -> None:
        """SUM all-reduces each ``(send, recv)`` pair, as :meth:`mpi.Communicator.allreduce` does.

        Args:
            pairs: (send, recv) contiguous host arrays, one pair per buffer (``send is recv``: in place).
            kind: names the collective in fingerprints and errors.
            detail: describes the call in fingerprints (default: the buffers' shapes and dtypes).

        Raises:
            DeadlineExceededError: a worker did not join within ``timeout_seconds``.
            ReplicaMismatchError: the workers called different collectives.
        """
        if not self.serves(pairs):
            self.stats["mpi_calls"] += 1
            self.communicator.allreduce(pairs, kind, detail)
            return
        if detail is None:
            detail = mpi.describe([p[1] for p in pairs])
        self.communicator.collective(kind, detail, lambda: self._start(pairs))

    def _start(self, pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]]) -> Callable[[], bool]:
        """Every worker has arrived with the same buffers (the hash check): copy in, then the flags' rounds."""
        offsets = []
        off = 0
        for _, recv in pairs:
            offsets.append(off)
            off = _round_up(off + recv.nbytes, _ALIGN)
        self._ensure(off)
        self._count += 1
        self.stats["calls"] += 1
        mine = self._slots[self.node_rank]
        for (send, recv), o in zip(pairs, offsets):
            np.copyto(mine[o : o + recv.nbytes].view(recv.dtype), send.reshape(-1), casting="no")
        self._raise(0)
        views = [(recv, o) for (_, recv), o in zip(pairs, offsets)]
        phase = 0
        reqs: list[Any] = []

        def done() -> bool:
            nonlocal phase, reqs
            if phase == 0:  # wait for every slot, then sum this worker's slices
                if not self._all_up(0):
                    return False
                self._reduce_my_slices(views)
                self._raise(1)
                phase = 1
            if phase == 1:  # wait for every slice
                if not self._all_up(1):
                    return False
                phase = 2
                if self.num_nodes > 1 and self.leaders is not None:
                    MPI = self._MPI
                    reqs = [self.leaders.Iallreduce(MPI.IN_PLACE, self._result_view(r, o), MPI.SUM) for r, o in views]
            if phase == 2 and self.num_nodes > 1:  # across nodes: the leaders' MPI all-reduce
                if self.leaders is not None:
                    if not self._MPI.Request.Testall(reqs):
                        return False
                    self._raise(2)
                elif not self._leader_done():
                    return False
            for recv, o in views:
                np.copyto(recv.reshape(-1), self._result_view(recv, o), casting="no")
            self.stats["bytes"] += sum(r.nbytes for r, _ in views)
            return True

        return done

    def _leader_done(self) -> bool:
        if self._ctrl[self._flag(2, 0)] >= self._count:
            self._win.Sync()
            return True
        return False

    def _result_view(self, recv: npt.NDArray[Any], offset: int) -> npt.NDArray[Any]:
        return self._result[offset : offset + recv.nbytes].view(recv.dtype)

    def _reduce_my_slices(self, views: Sequence[tuple[npt.NDArray[Any], int]]) -> None:
        """This worker's slice of every buffer, summed over the slots in worker order into the result."""
        n = self.node_size
        w = self.node_rank
        reduce_to_one = self._kernels.trusted.reduce_to_one
        for recv, o in views:
            size = recv.size
            step = _round_up(-(-size // n), _ALIGN)  # elements: slices on cache lines whatever the dtype
            lo, hi = w * step, min(size, (w + 1) * step)
            if lo >= hi:
                continue
            nb = recv.nbytes
            ins = [s[o : o + nb].view(recv.dtype)[lo:hi] for s in self._slots]
            reduce_to_one(ins, ReduceOp.SUM, self._result_view(recv, o)[lo:hi])


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
