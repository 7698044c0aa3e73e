"""Fake ``cupy.cuda.nccl``: single-process communicators over the emulated GPUs.

As with real NCCL driven from one thread, collectives of several ranks must sit between
``groupStart()`` and ``groupEnd()`` (one rank's call alone would block forever: the fake raises).
At ``groupEnd`` every clique's calls are matched (count, dtype and op must agree) and reduced in
rank order. Buffers must be device memory of the communicator's GPU (or pinned host memory), and
the stream must belong to that GPU. As on GPUs, a collective is queued on every rank's stream: it
runs (for all ranks at once) when any rank's stream reaches it, after the work queued before it
on every rank's stream.
"""

from __future__ import annotations

import itertools

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
    return tuple(range(128))


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
    """Validates the calls now and queues each clique's collective on its ranks' streams."""
    by_clique: dict[int, list] = {}
    for c in calls:
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


def _reduce(cs):
    _, _, _, count, dtype, op, _ = cs[0]
    dt = np.dtype(_DTYPES[dtype])
    ins = [_emu.host_array(c[1], (count,), dt, pooled=True).copy() for c in cs]
    if op == NCCL_AVG:
        acc = ins[0].copy()
        for x in ins[1:]:
            acc = np.add(acc, x, dtype=dt)
        res = (acc / len(ins)).astype(dt)
    else:
        acc = ins[0].copy()
        for x in ins[1:]:
            acc = _OPS[op](acc, x).astype(dt)
        res = acc
    for c in cs:
        _emu.host_array(c[2], (count,), dt, pooled=True)[...] = res


class NcclCommunicator:
    def __init__(self, ndev: int, commId, rank: int):
        raise NotImplementedError("emulator: only NcclCommunicator.initAll is supported")

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
        q = _emu.queue(self._device, int(stream))
        call = (self, int(sendbuf), int(recvbuf), int(count), int(datatype), int(op), q)
        if _group_depth == 0:
            if self._size == 1:
                _launch([call])
                return
            raise NcclError(5, "NCCL_ERROR_INVALID_USAGE (emulator): allReduce of one rank outside groupStart/groupEnd "
                               "would block forever in a single-threaded multi-GPU program")
        _pending.append(call)
