"""Fake ``cupy.cuda.nccl``: communicators over the emulated GPUs, in one process or across the
processes of an MPI job.

In one process (``NcclCommunicator.initAll``), as with real NCCL driven from one thread,
collectives of several ranks must sit between ``groupStart()`` and ``groupEnd()`` (one rank's call
alone would block forever: the fake raises). At ``groupEnd`` every clique's calls are matched
(count, dtype and op must agree) and reduced in rank order. Buffers must be device memory of the
communicator's GPU (or pinned host memory), and the stream must belong to that GPU. As on GPUs, a
collective is queued on every rank's stream: it runs (for all ranks at once) when any rank's
stream reaches it, after the work queued before it on every rank's stream.

Across processes (``NcclCommunicator(nranks, uid, rank)`` in each process of an ``mpiexec`` job,
one rank per process, the communicator on the current device), the data travels over MPI
(mpi4py's ``COMM_WORLD``, point to point, tags of its own). ``get_unique_id()`` is random per
call, so ranks given ids from different calls (a forgotten broadcast) fail at init, where real
NCCL would hang. Each collective is queued on its stream and runs when the stream reaches it and
every peer process has sent its part (until then the stream's queries say "not done" and its
synchronizes wait: see ``cupy._emu.NotReady``); the ranks' count, dtype and op must agree (a
mismatch raises NcclError where a GPU would hang or garble), and the reduction is in rank order.
``NcclCommunicator.abort()`` (ncclCommAbort) completes a waiting collective without touching its
buffers. ``EMU_CALLS`` counts cross-process inits and collectives (tests assert NCCL was used);
``CUDIST_EMU_NCCL_FAIL=<MPI rank>`` makes that process's cross-process collectives fail with an
asynchronous NCCL error (``check_async_error``), as a broken network would.
"""

from __future__ import annotations

import collections
import itertools
import os
import time

import numpy as np

from cupy import _emu
from cupy.cuda import runtime

available = _emu.NCCL_AVAILABLE

NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16, 7: np.float32, 8: np.float64}
try:  # ncclBfloat16 (NCCL >= 2.10) needs NumPy to know bfloat16
    import ml_dtypes as _ml_dtypes

    _DTYPES[NCCL_BFLOAT16] = _ml_dtypes.bfloat16
except ImportError:
    _ml_dtypes = None
_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}


class NcclError(RuntimeError):
    def __init__(self, status: int, msg: str = ""):
        self.status = status
        super().__init__(msg or f"NCCL error {status}")


def get_version() -> int:
    return 22105


def get_build_version() -> int:
    return 22105


def get_unique_id():
    # ncclUniqueId's 128 bytes as CuPy returns them (C chars, signed); random, as a real id differs
    # per call, so that ranks given different ids (a forgotten broadcast) are caught at init.
    return tuple(b - 256 if b > 127 else b for b in os.urandom(128))


#: Cross-process communicator inits and collectives of this process (tests check NCCL was used).
EMU_CALLS: collections.Counter = collections.Counter()


_clique_ids = itertools.count()
_group_depth = 0
_pending: list[tuple] = []


def groupStart() -> None:  # noqa: N802
    global _group_depth
    _group_depth += 1


def groupEnd() -> None:  # noqa: N802
    global _group_depth
    if _group_depth == 0:
        raise NcclError(5, "NCCL_ERROR_INVALID_USAGE: groupEnd without groupStart")
    _group_depth -= 1
    if _group_depth == 0:
        calls, _pending[:] = list(_pending), []
        _launch(calls)


def _launch(calls):
    """Validates the calls now and queues each clique's collective on its ranks' streams (each
    cross-process call on its own rank's stream)."""
    by_clique: dict[int, list] = {}
    for c in calls:
        if c[0]._remote:
            _launch_remote(c)
            continue
        by_clique.setdefault(c[0]._clique, []).append(c)
    for clique, cs in by_clique.items():
        size = cs[0][0]._size
        ranks = sorted(c[0]._rank for c in cs)
        if ranks != list(range(size)):
            raise NcclError(5, f"NCCL_ERROR_INVALID_USAGE (emulator): allReduce called by ranks {ranks} of {size}: "
                               "the missing ranks would hang the collective")
        cs.sort(key=lambda c: c[0]._rank)
        for c in cs:
            if (c[3], c[4], c[5]) != cs[0][3:6]:
                raise NcclError(5, f"NCCL_ERROR_INVALID_USAGE (emulator): mismatched allReduce calls {cs[0][3:6]} vs {c[3:6]}")
        with _emu.LOCK:
            queues = [c[6] for c in cs]
            before = [(q, q.enqueued) for q in queues]  # each rank's work queued before the collective
            state = {"ran": False}

            def run(cs=cs, state=state):
                if not state["ran"]:
                    state["ran"] = True
                    _reduce(cs)

            for q in queues:
                _emu.enqueue(q, run, "ncclAllReduce", deps=before)


def _cuda_nan(acc, dt):
    """A bfloat16 NaN as CUDA's arithmetic writes it (0x7fff, whatever its operands' signs and
    payloads: ``__hadd`` / ``__floats2bfloat162_rn``), where ml_dtypes' rounding gives 0x7fc0."""
    if _ml_dtypes is not None and dt == np.dtype(_ml_dtypes.bfloat16):
        u = acc.view(np.uint16)
        u[(u & 0x7FFF) > 0x7F80] = 0x7FFF
    return acc


def _combine(ins, op, dt):
    """The reduction of ``ins`` (rank order) as NCCL's ``op`` gives it in dtype ``dt``: rounded to
    ``dt`` after every operation (NCCL's FuncSum of two 16-bit floats returns a 16-bit float)."""
    acc = ins[0].copy()
    if op == NCCL_AVG:
        for x in ins[1:]:
            acc = _cuda_nan(np.add(acc, x, dtype=dt), dt)
        return _cuda_nan((acc / len(ins)).astype(dt), dt)
    for x in ins[1:]:
        acc = _cuda_nan(_OPS[op](acc, x).astype(dt), dt)
    return acc


def _reduce(cs):
    _, _, _, count, dtype, op, _ = cs[0]
    dt = np.dtype(_DTYPES[dtype])
    res = _combine([_emu.host_array(c[1], (count,), dt, pooled=True).copy() for c in cs], op, dt)
    for c in cs:
        _emu.host_array(c[2], (count,), dt, pooled=True)[...] = res


_HELLO_TAG, _DATA_TAG = 0x6E01, 0x6E02  # MPI tags of the fake's messages on COMM_WORLD


class _Wire:
    """The fake's MPI transport: mailboxes of the messages received so far, the sends in flight."""

    def __init__(self):
        from mpi4py import MPI  # the fake's cross-process NCCL runs in MPI jobs only

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.me = self.world.Get_rank()
        self.nproc = self.world.Get_size()
        self.hellos: list[tuple] = []  # (source process, uid, rank, nranks)
        self.data: dict[tuple, tuple] = {}  # (uid, seq, rank) -> (count, dtype, op, array)
        self.sends: list = []

    def send(self, obj, dest: int, tag: int) -> list:
        req = self.world.isend(obj, dest=dest, tag=tag)
        self.sends.append(req)
        return [req]

    def drain(self) -> None:
        status = self.MPI.Status()
        for tag in (_HELLO_TAG, _DATA_TAG):
            while True:
                msg = self.world.improbe(source=self.MPI.ANY_SOURCE, tag=tag, status=status)
                if msg is None:
                    break
                src = status.Get_source()
                obj = msg.recv()
                if tag == _HELLO_TAG:
                    self.hellos.append((src, *obj))
                else:
                    uid, seq, rank, count, dtype, op, arr = obj
                    self.data[(uid, seq, rank)] = (count, dtype, op, arr)
        self.sends = [r for r in self.sends if not r.Test()]


_WIRE: _Wire | None = None


def _wire() -> _Wire:
    global _WIRE
    if _WIRE is None:
        _WIRE = _Wire()
    return _WIRE


def _fails_here() -> bool:
    want = os.environ.get("CUDIST_EMU_NCCL_FAIL", "").strip()
    return bool(want) and _WIRE is not None and want == str(_WIRE.me)


class _RemoteCall:
    """One cross-process collective of one rank: posted when its stream reaches it, run when every
    peer's part has arrived (and this rank's sends are through)."""

    def __init__(self, comm, seq, sendbuf, recvbuf, count, datatype, op):
        self.comm, self.seq = comm, seq
        self.sendbuf, self.recvbuf, self.count, self.datatype, self.op = sendbuf, recvbuf, count, datatype, op
        self.reqs = None
        self.parts = None

    def _key(self, rank):
        return (self.comm._uid, self.seq, rank)

    def ready(self) -> bool:
        c = self.comm
        if c._aborted:
            return True
        if c._async_error is not None:
            return False
        w = _wire()
        if self.reqs is None:
            if _fails_here():
                c._async_error = NcclError(2, "NCCL_ERROR_SYSTEM_ERROR: unhandled system error (emulator: "
                                              f"CUDIST_EMU_NCCL_FAIL={w.me}, a broken connection to the peers)")
                return False
            dt = np.dtype(_DTYPES[self.datatype])
            mine = _emu.host_array(self.sendbuf, (self.count,), dt, pooled=True).copy()
            self.parts = {c._rank: (self.count, self.datatype, self.op, mine)}
            self.reqs = []
            msg = (c._uid, self.seq, c._rank, self.count, self.datatype, self.op, mine)
            for r, proc in enumerate(c._procs):
                if r != c._rank:
                    self.reqs += w.send(msg, proc, _DATA_TAG)
        w.drain()
        for r in range(c._size):
            if r not in self.parts and self._key(r) in w.data:
                self.parts[r] = w.data.pop(self._key(r))
        if len(self.parts) < c._size:
            return False
        mine = self.parts[c._rank][:3]
        for r in range(c._size):
            if self.parts[r][:3] != mine:
                c._async_error = NcclError(
                    5, f"NCCL_ERROR_INVALID_USAGE (emulator): collective #{self.seq}: rank {c._rank} called "
                       f"allReduce(count, datatype, op)={mine}, rank {r} {self.parts[r][:3]}: on GPUs the "
                       "ranks would hang or garble",
                )
                raise c._async_error
        return all(req.Test() for req in self.reqs)

    def run(self) -> None:
        if self.comm._aborted:
            return  # ncclCommAbort: the collective ends, its buffers are left as they are
        dt = np.dtype(_DTYPES[self.datatype])
        res = _combine([self.parts[r][3] for r in range(self.comm._size)], self.op, dt)
        _emu.host_array(self.recvbuf, (self.count,), dt, pooled=True)[...] = res
        self.parts = None


def _launch_remote(call) -> None:
    comm, sendbuf, recvbuf, count, datatype, op, q = call
    comm._seq += 1
    rc = _RemoteCall(comm, comm._seq, sendbuf, recvbuf, count, datatype, op)
    EMU_CALLS["allReduce"] += 1
    _emu.enqueue(q, rc.run, f"ncclAllReduce #{comm._seq} of rank {comm._rank} (waiting for its peer processes)",
                 ready=rc.ready)


class NcclCommunicator:
    def __init__(self, ndev: int, commId: tuple, rank: int):
        if not isinstance(ndev, int) or not isinstance(rank, int):
            raise TypeError("an integer is required")
        if not isinstance(commId, tuple):  # Cython-typed in CuPy
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(commId).__name__})")
        if len(commId) != 128:
            raise AssertionError("len(commId) == NCCL_UNIQUE_ID_BYTES")
        if not 0 <= rank < ndev:
            raise NcclError(4, f"NCCL_ERROR_INVALID_ARGUMENT: rank {rank} of {ndev}")
        self._device = runtime.getDevice()
        _emu.check_device_id(self._device)
        self._rank, self._size = rank, ndev
        self._aborted = False
        self._async_error = None
        self._seq = 0
        if ndev == 1:
            self._clique, self._remote = next(_clique_ids), False
            return
        self._clique, self._remote = None, True
        self._uid = bytes((x + 256) % 256 for x in commId)
        self._procs = self._rendezvous(ndev, rank)
        EMU_CALLS["NcclCommunicator"] += 1

    def _rendezvous(self, ndev, rank):
        """ncclCommInitRank: every rank tells every process (uid, rank, nranks) and waits for its peers.

        Returns the MPI process of each rank. Raises NcclError where real NCCL would hang: a process
        that joined with another id, a rank claimed twice, nranks that differ, no peers in time.
        """
        w = _wire()
        hello = (self._uid, rank, ndev)
        for p in range(w.nproc):
            if p != w.me:
                w.send(hello, p, _HELLO_TAG)
        start = time.monotonic()
        while True:
            w.drain()
            mine = [h for h in w.hellos if h[1] == self._uid]
            others = {h[0] for h in w.hellos}
            if len(mine) >= ndev - 1:
                break
            if len(others) >= w.nproc - 1:
                strangers = [h for h in w.hellos if h[1] != self._uid]
                raise NcclError(5, (
                    f"NCCL_ERROR_INVALID_USAGE (emulator): ncclCommInitRank(nranks={ndev}, rank={rank}) in MPI "
                    f"process {w.me}: process(es) {sorted({h[0] for h in strangers})} joined with another unique id; "
                    "every rank must get the id of one get_unique_id() call (broadcast it); on GPUs the init would hang"
                ))
            if time.monotonic() - start > _emu.WAIT_SECONDS:
                raise NcclError(5, (
                    f"NCCL_ERROR_INVALID_USAGE (emulator): ncclCommInitRank(nranks={ndev}, rank={rank}) in MPI "
                    f"process {w.me}: only {len(mine) + 1} rank(s) joined in {_emu.WAIT_SECONDS:g} s; on GPUs it would hang"
                ))
            time.sleep(0.0005)
        peers = mine[: ndev - 1]
        for h in peers:
            w.hellos.remove(h)
        procs = {rank: w.me}
        for src, _, r, n in peers:
            if n != ndev:
                raise NcclError(5, f"NCCL_ERROR_INVALID_USAGE (emulator): process {src} initialised rank {r} of {n} "
                                   f"ranks, this one rank {rank} of {ndev}")
            if r in procs:
                raise NcclError(5, f"NCCL_ERROR_INVALID_USAGE (emulator): rank {r} claimed by processes {procs[r]} and {src}")
            procs[r] = src
        return [procs[r] for r in range(ndev)]

    @classmethod
    def initAll(cls, devices):  # noqa: N802
        if isinstance(devices, int):
            devices = list(range(devices))
        devices = [int(d) for d in devices]
        if len(set(devices)) != len(devices):
            raise NcclError(5, f"NCCL_ERROR_INVALID_USAGE: duplicate GPU in {devices} (ncclCommInitAll needs distinct devices)")
        for d in devices:
            _emu.check_device_id(d)
        clique = next(_clique_ids)
        comms = []
        for r, d in enumerate(devices):
            c = cls.__new__(cls)
            c._clique, c._rank, c._size, c._device = clique, r, len(devices), d
            c._remote, c._aborted, c._async_error, c._seq = False, False, None, 0
            comms.append(c)
        return comms

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def device_id(self) -> int:
        return self._device

    def destroy(self) -> None:
        pass

    def abort(self) -> None:
        """ncclCommAbort: a collective still waiting for its peers completes, its buffers untouched."""
        self._aborted = True

    def check_async_error(self) -> None:
        if self._async_error is not None:
            raise self._async_error

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        if datatype not in _DTYPES:
            raise NcclError(4, f"NCCL_ERROR_INVALID_ARGUMENT: datatype {datatype}")
        if op not in (*_OPS, NCCL_AVG):
            raise NcclError(4, f"NCCL_ERROR_INVALID_ARGUMENT: op {op}")
        from cupy.cuda import stream_device

        sdev = stream_device(int(stream))
        if sdev != self._device:
            raise NcclError(4, f"NCCL_ERROR_INVALID_ARGUMENT (emulator): stream of device {sdev} for the rank on device {self._device}")
        nbytes = int(count) * np.dtype(_DTYPES[datatype]).itemsize
        for p, what in ((sendbuf, "sendbuf"), (recvbuf, "recvbuf")):
            _emu.check_range(int(p), nbytes, f"ncclAllReduce {what} of rank {self._rank}", device=self._device)
        if self._aborted:
            raise NcclError(5, "NCCL_ERROR_INVALID_USAGE (emulator): allReduce on an aborted communicator")
        q = _emu.queue(self._device, int(stream))
        call = (self, int(sendbuf), int(recvbuf), int(count), int(datatype), int(op), q)
        if self._remote:
            if _group_depth == 0:
                _launch_remote(call)
            else:
                _pending.append(call)
            return
        if _group_depth == 0:
            if self._size == 1:
                _launch([call])
                return
            raise NcclError(5, "NCCL_ERROR_INVALID_USAGE (emulator): allReduce of one rank outside groupStart/groupEnd "
                               "would block forever in a single-threaded multi-GPU program")
        _pending.append(call)
