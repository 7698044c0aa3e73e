"""MPI for multi-worker strategies: the world, a communicator with deadline-polled collectives.

``mpi4py`` is imported only when a process was started by an MPI launcher (``mpiexec``, ``srun``,
``python -m cudist.launch``) or when something asks for MPI explicitly (:func:`load`); a plain
``python script.py`` is a one-worker job and never loads MPI. ``import cudist`` imports nothing here.

Every cross-worker collective of a :class:`Communicator` is non-blocking (``Iallreduce``,
``Iallgatherv``, ``Ibcast``) and polled until it completes, so that:

* ``timeout_seconds`` (TF's ``CommunicationOptions.timeout_seconds``; default None: wait forever,
  as TF) ends a wait with :class:`DeadlineExceededError` naming the workers that never arrived;
* after :data:`STALL_WARNING_SECONDS` a :class:`CollectiveStallWarning` names them too;
* every collective is checked: by default a 64-bit hash of its sequence number, kind, buffer
  sizes and dtypes rides along (one tiny ``Iallreduce`` MAX of ``[h, -h]``, started with the data
  and waited for first: equal maxima of ``h`` and ``-h`` mean every worker's hash is the same);
  with ``CUDIST_CHECK_COLLECTIVES=1`` each collective is preceded by an all-gather of its whole
  fingerprint (sequence number, kind, shapes, dtypes). Workers that disagree get a
  :class:`~cudist._replica_engine.ReplicaMismatchError` naming the difference (the default check
  gathers the descriptions once it has found one) instead of a hang or a garbled result.
  ``CUDIST_CHECK_COLLECTIVES=0`` turns the check off.

Collectives another library carries (NCCL for GPU buffers, see
:class:`cudist._dataplane.transports.nccl.WorkerCommunicator`) go through :meth:`Communicator.collective`,
which numbers, checks and waits for them the same way.

Who arrived is learnt from small notices: a worker that has waited a little while (a fraction of a
second) tells the others, on a separate communicator, the sequence number it is waiting in. A
worker stuck in its own code never sends one, which is how it gets named.

:func:`install_abort_hook` makes an uncaught exception in any worker end the whole job
(``MPI_Abort``), as ``python -m mpi4py`` does; without it the other workers would wait forever.
A worker that exits cleanly while another waits for it in a collective ends the job too
(:func:`await_peers_at_exit`, run at exit once the :func:`job` communicator exists).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType, TracebackType
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from cudist import _settings, errors
from cudist._replica_engine import ReplicaMismatchError

__all__ = [
    "ENV_CHECK",
    "STALL_WARNING_SECONDS",
    "Communicator",
    "CollectiveStallWarning",
    "DeadlineExceededError",
    "ReplicaMismatchError",
    "load",
    "world",
    "install_abort_hook",
    "abort",
    "job",
    "await_peers_at_exit",
    "exit_message",
    "check_mode",
    "allgather_setup",
    "shm_segments",
    "remove_shm_segments",
]

#: Unset: the default hash check of every cross-worker collective; 1: the whole fingerprint first
#: (debug mode, one more round trip per collective); 0: no check.
ENV_CHECK = "CUDIST_CHECK_COLLECTIVES"
#: The default check's hash, kept under 2**62 so that -h fits an int64 too.
_HASH_MASK = (1 << 62) - 1
_HASH_MUL = 0x100000001B3  # FNV-1's 64-bit prime
#: Seconds a worker waits in one collective before a CollectiveStallWarning names the missing workers
#: (env ``CUDIST_STALL_WARNING_SECONDS`` overrides it).
STALL_WARNING_SECONDS = 60.0
_FINGERPRINT_BYTES = 512
#: A wait polls MPI without pause this long, then every half millisecond.
_SPIN_SECONDS = 1.0
#: Spinning waits yield the CPU only when the job is oversubscribed (more workers than cores: the
#: launcher sets MPICH's MPIR_CVAR_ENABLE_HEAVY_YIELD=1 then); otherwise a yield per poll costs
#: 5-10% of a 1-4 MiB all-reduce (measured), like a blocking MPI wait, which spins too.
_YIELD = os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "0") == "1"
_NOTICE_TAG = 7
#: How long :func:`abort` lets mpiexec forward this process's last output before aborting.
_ABORT_FLUSH_SECONDS = 0.2
#: "This worker is exiting" (see :func:`await_peers_at_exit`), on the job communicator's side channel.
_EXIT_TAG = 8


# A cross-worker collective did not complete within ``CommunicationOptions.timeout_seconds``: TF's
# DeadlineExceededError (cudist.errors, also a TimeoutError), re-exported here under its old home.
DeadlineExceededError = errors.DeadlineExceededError


class CollectiveStallWarning(RuntimeWarning):
    """A worker has waited unusually long in a cross-worker collective."""


_MPI: ModuleType | None = None
_MPI_ERROR: str | None = None


def load() -> tuple[ModuleType | None, str | None]:
    """``(mpi4py.MPI, None)``, or ``(None, why)`` when mpi4py cannot be imported."""
    global _MPI, _MPI_ERROR
    if _MPI is None and _MPI_ERROR is None:
        try:
            from mpi4py import MPI  # type: ignore[import-not-found, unused-ignore]  # noqa: PLC0415 - multi-worker jobs only

            _MPI = MPI
        except ImportError as e:  # pragma: no cover - depends on the installation
            _MPI_ERROR = f"mpi4py is not installed ({e}); install cudist with `pip install \"cudist[mpi]\"`"
    return _MPI, _MPI_ERROR


def world() -> Any:
    """``MPI.COMM_WORLD`` when this process was started by an MPI launcher, else None (one worker).

    Returns:
        mpi4py's ``Intracomm`` (typed ``Any``: reached through the module :func:`load` returns), or
        None.

    Raises:
        RuntimeError: started by a launcher of several processes, but mpi4py is missing.
    """
    if not _settings.launched_by_mpi():
        return None
    MPI, why = load()
    if MPI is None:
        size = os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or "1"
        if size.isdigit() and int(size) > 1:
            raise RuntimeError(f"this process is one of {size} MPI workers, but {why}")
        return None
    if MPI.COMM_WORLD.Get_size() > 1:
        # From the first use of MPI on: an error anywhere after (a bad TF_CONFIG, a failed strategy
        # creation) must end the job, not leave the other workers waiting for this one.
        install_abort_hook()
    return MPI.COMM_WORLD


_JOB_LOCK = threading.Lock()
_JOB: Communicator | None = None
#: Every live Communicator of this process: at exit, their peers' notices say who waits for us.
_LIVE: weakref.WeakSet[Communicator] = weakref.WeakSet()
_EXITED = False


def job() -> Communicator | None:
    """The job's own communicator over every process of the MPI job (None in a one-process job).

    Created once (a collective: every worker creates it at the same point: the launcher's bootstrap
    at start, else the first strategy); it carries the set-up collectives of strategies and
    resolvers (polled, so they name absent workers like any other) and the exit rendezvous:
    creating it registers :func:`await_peers_at_exit` to run at interpreter exit, before MPI's own
    finalization, which would otherwise block forever in a worker whose peers wait in a collective.
    """
    global _JOB
    comm = world()
    if comm is None or comm.Get_size() == 1:
        return None
    with _JOB_LOCK:
        if _JOB is None:
            _JOB = Communicator(comm)
            atexit.register(_exit_rendezvous)
        return _JOB


def allgather_setup(comm: Any, value: int | str, kind: str) -> list[Any]:
    """Every rank's ``value`` (an int, or a string of up to 256 bytes), in rank order, over ``comm``.

    For the set-up collectives of resolvers and strategies. Over the world they go through the
    :func:`job` communicator, polled like any collective (so a worker exiting instead of joining
    is named, see :func:`await_peers_at_exit`); over another communicator, mpi4py's blocking
    ``allgather``.

    Args:
        comm: the mpi4py communicator.
        value: this rank's value.
        kind: names the collective in fingerprints and errors.
    """
    MPI, _ = load()
    job_comm = job() if MPI is not None and comm is MPI.COMM_WORLD else None
    if job_comm is None:
        return list(comm.allgather(value))
    if isinstance(value, str):
        row = np.zeros((1, 256), np.uint8)
        raw = value.encode()[:256]
        row[0, : len(raw)] = np.frombuffer(raw, np.uint8)
        return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in job_comm.allgather_rows(row, 0, kind)]
    return [int(x) for x in job_comm.allgather_rows(np.array([value], np.int64), 0, kind)]


def abort(code: int, message: str) -> NoReturn:
    """Prints ``message``, removes this process's MPICH shared-memory files and aborts the job (``MPI_Abort``).

    The one way cudist ends a job from inside a worker (an uncaught exception, a worker exiting
    while others wait for it, the launcher's bootstrap on an error exit).

    Args:
        code: the exit code of the job (mpiexec returns it).
        message: one line for stderr, naming this worker and why.
    """
    MPI, why = load()
    try:
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # mpiexec's proxy forwards output asynchronously and the abort ends it: without a moment
        # for it, this process's traceback and message were lost in ~1 of 8 plain-mpiexec runs.
        time.sleep(_ABORT_FLUSH_SECONDS)
    finally:
        remove_shm_segments(shm_segments())  # an aborted job would leave them in /dev/shm
        if MPI is not None:
            MPI.COMM_WORLD.Abort(code)
        # MPICH's MPI_Abort can return once it has told mpiexec (seen here): this process must not
        # go on to run more Python, nor block in MPI_Finalize. (os._exit is the standard library's
        # documented exit without cleanup, not another module's private attribute.)
        os._exit(code or 1)  # private-read: the standard library's exit without cleanup


def await_peers_at_exit(poll_seconds: float = 0.002) -> str | None:
    """At a worker's exit: waits for every other worker to exit too, unless one waits for this one.

    A worker that ends (its script returned, or called ``sys.exit``) while another still waits in
    a collective would leave that one waiting forever, and would itself block in ``MPI_Finalize``.
    So each exiting worker tells the others (a message on the job communicator's side channel) and
    waits for theirs; meanwhile it reads the arrival notices the others post after waiting a
    moment in a collective (every :class:`Communicator` of this process). A worker waiting in a
    collective numbered past the last one this worker made will never be joined: the description
    of that is returned, for the caller to abort the job with. Runs once per process.

    Args:
        poll_seconds: the pause between polls.

    Returns:
        None when every worker is exiting (MPI can finalize), else what this worker failed to join
        (``"worker(s) [0] wait in collective #7, which it never made (its last was #6)"``).
    """
    global _EXITED
    job_comm = _JOB
    if _EXITED or job_comm is None:
        return None
    _EXITED = True
    MPI = job_comm._MPI
    side = job_comm._side
    note = np.zeros(1, np.int64)
    sends = [side.Isend(note, dest=p, tag=_EXIT_TAG) for p in range(job_comm.size) if p != job_comm.rank]
    exiting = {job_comm.rank}
    status = MPI.Status()
    scratch = np.zeros(1, np.int64)
    while len(exiting) < job_comm.size:
        while side.Iprobe(source=MPI.ANY_SOURCE, tag=_EXIT_TAG, status=status):
            src = status.Get_source()
            side.Recv(scratch, source=src, tag=_EXIT_TAG)
            exiting.add(src)
        for c in list(_LIVE):
            if c._broken is not None:
                continue  # its collectives already failed, with an error of their own
            c._drain_notices()
            waiting = [w for w in range(c.size) if w != c.rank and c._arrived[w] > c.seq]
            if waiting:
                seq = max(c._arrived[w] for w in waiting)
                return f"worker(s) {waiting} wait in collective #{seq}, which it never made (its last was #{c.seq})"
        if len(exiting) < job_comm.size:
            time.sleep(poll_seconds)
    MPI.Request.Waitall(sends)  # every peer receives them: it waits for them as this worker did
    return None


def _exit_rendezvous() -> None:
    """atexit: :func:`await_peers_at_exit`, aborting the job if a peer waits for this worker."""
    problem = await_peers_at_exit()
    if problem is not None:
        abort(1, exit_message(problem))


def exit_message(problem: str) -> str:
    """What a worker that exits while ``problem`` (from :func:`await_peers_at_exit`) says as it aborts the job."""
    comm = _JOB.comm if _JOB is not None else None
    who = f"worker {comm.Get_rank()} of {comm.Get_size()}" if comm is not None else "a worker"
    return (
        f"cudist: {who} is ending (its script returned or called sys.exit) while {problem}; "
        "aborting every worker of the job (MPI_Abort)"
    )


def shm_segments(pid: int | str = "self") -> list[str]:
    """The MPICH shared-memory files (``/dev/shm/mpich_shm_*``) process ``pid`` has mapped and not yet removed.

    An aborted or killed MPICH job leaves them behind (a clean ``MPI_Finalize`` removes them).
    """
    found: list[str] = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/mpich_shm_") and not path.endswith("(deleted)") and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def remove_shm_segments(paths: Iterable[str]) -> None:
    """Unlinks MPICH shared-memory files (processes that mapped them keep their memory)."""
    for path in paths:
        if os.path.basename(path).startswith("mpich_shm_"):
            try:
                os.unlink(path)
            except OSError:
                pass


_HOOK_LOCK = threading.Lock()
_HOOK_INSTALLED = False


def install_abort_hook() -> bool:
    """Makes an uncaught exception print its traceback, then ``MPI_Abort`` the whole job.

    Installed (once) when cudist first uses MPI in a job of several workers (:func:`world`).
    Returns whether it was installed by this call.
    """
    global _HOOK_INSTALLED
    MPI, _ = load()
    if MPI is None:
        return False
    with _HOOK_LOCK:
        if _HOOK_INSTALLED:
            return False
        _HOOK_INSTALLED = True
        previous = sys.excepthook

        def abort_on_exception(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            comm = MPI.COMM_WORLD
            try:
                previous(exc_type, exc, tb)
            finally:
                # As ``python -m mpi4py``: KeyboardInterrupt exits 130 (128 + SIGINT), others 1.
                abort(
                    130 if issubclass(exc_type, KeyboardInterrupt) else 1,
                    f"cudist: worker {comm.Get_rank()} of {comm.Get_size()} raised {exc_type.__name__}; "
                    "aborting every worker of the job (MPI_Abort)",
                )

        sys.excepthook = abort_on_exception
        return True


def check_mode() -> str:
    """``"quick"`` (the default: a hash of each collective rides with it), ``"full"``
    (``CUDIST_CHECK_COLLECTIVES=1``: whole fingerprints gathered first) or ``"off"`` (``=0``)."""
    return _settings.check_collectives()


def _dtype_of_num(num: int) -> np.dtype[Any] | str:
    for code in np.typecodes["All"]:
        try:
            dt = np.dtype(code)
        except TypeError:
            continue
        if dt.num == num:
            return dt
    return f"<dtype #{num}>"


def describe(arrays: Iterable[Any]) -> str:
    """``float32(3, 4) int64()``: the shapes and dtypes of ``arrays``, for fingerprints and errors."""
    return " ".join(f"{a.dtype}{tuple(a.shape)}" for a in arrays)


class Communicator:
    """A strategy's cross-worker communicator (a duplicate of the given one: its own message space).

    Args:
        comm: an mpi4py intracommunicator whose ranks are the workers, in worker order.
        timeout_seconds: how long one collective may wait for the others (None: forever).
        check: gather each collective's whole fingerprint first (True), or hash-check it as it runs
            (False); default: :func:`check_mode` (``CUDIST_CHECK_COLLECTIVES``), which can also
            turn checks off.
        stall_warning_seconds: how long one collective waits before a :class:`CollectiveStallWarning`
            (default: ``CUDIST_STALL_WARNING_SECONDS``, else :data:`STALL_WARNING_SECONDS`).

    Raises:
        RuntimeError: mpi4py cannot be imported.
    """

    def __init__(
        self,
        comm: Any,
        *,
        timeout_seconds: float | None = None,
        check: bool | None = None,
        stall_warning_seconds: float | None = None,
    ) -> None:
        MPI, why = load()
        if MPI is None:
            raise RuntimeError(why)
        self._MPI = MPI
        self.comm = comm.Dup()
        self._side = comm.Dup()  # arrival notices, apart from the collectives
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout_seconds = None if timeout_seconds is None else float(timeout_seconds)
        mode = check_mode() if check is None else ("full" if check else "quick")
        self.check = mode == "full"
        self.quick = mode == "quick"  # the default hash check (see the module's docstring)
        self._hash_send = np.zeros(2, np.int64)
        self._hash_recv = np.zeros(2, np.int64)
        if stall_warning_seconds is None:
            stall_warning_seconds = _settings.stall_warning_seconds(STALL_WARNING_SECONDS)
        self.stall_warning_seconds = stall_warning_seconds
        self.seq = 0
        self._broken: str | None = None
        self._arrived = [0] * self.size  # latest sequence number each worker said it waits in
        self._notice_buf = np.zeros(1, np.int64)
        self._sends: list[Any] = []  # mpi4py Requests
        self._hash_req: Any = None  # the default check's request, between _begin and _finish_hash_check
        #: Whether waits yield the CPU at every poll (a pipelined reduction's communication thread sets
        #: it: its spin would take the core from the caller's thread, which works meanwhile).
        self.yielding = False
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"<cudist MPI communicator: worker {self.rank} of {self.size}, timeout {self.timeout_seconds}>"

    # ------------------------------------------------------------------ waiting
    def _begin(
        self, kind: str, detail: str | Callable[[], str], shape: Iterable[int] = (), hash_check: bool = True
    ) -> int:
        """Numbers a collective; with the default check, starts its hash check (before its data).

        Args:
            kind: the collective's name (the workers' must be the same).
            detail: its description for errors (a string, or a function giving one).
            shape: integers that must agree across workers (buffer sizes, dtype numbers, ...).
            hash_check: False: the caller compares :meth:`call_hash` across workers itself.
        """
        if self._broken is not None:
            raise RuntimeError(
                f"cudist: cross-worker collectives cannot continue after {self._broken}; restart the job"
            )
        self.seq += 1
        if self.size > 1:
            if self.quick:
                if hash_check:
                    self._start_hash_check(kind, shape)
            elif self.check:
                self._check_fingerprint(kind, detail() if callable(detail) else detail)
        return self.seq

    def call_hash(self, kind: str, shape: Iterable[int]) -> int:
        """The default check's hash of the current collective (its number, ``kind`` and ``shape``)."""
        h = (zlib.crc32(kind.encode()) ^ (self.seq << 32)) & _HASH_MASK
        for x in shape:
            h = (h * _HASH_MUL + x) & _HASH_MASK
        return h

    def mismatch_error(self, kind: str, detail: str | Callable[[], str], seq: int) -> ReplicaMismatchError:
        """The error for collective ``seq``, whose hashes differ across workers (every worker found it:
        each gathers the others' descriptions); the communicator refuses further collectives."""
        self._broken = f"mismatched collectives at #{seq}"
        return self._mismatch(self._gather_prints(self._side, kind, detail() if callable(detail) else detail, seq))

    def _start_hash_check(self, kind: str, shape: Iterable[int]) -> None:
        """Starts the default check: an ``Iallreduce`` MAX of ``[h, -h]``, h hashing the call."""
        h = self.call_hash(kind, shape)
        send = self._hash_send
        send[0] = h
        send[1] = -h
        self._hash_req = self.comm.Iallreduce(send, self._hash_recv, self._MPI.MAX)

    def _finish_hash_check(self, kind: str, detail: str | Callable[[], str], seq: int) -> None:
        """Waits for the hash check started by :meth:`_begin` (the data may still be in flight)
        and raises if the workers' hashes differ, naming every worker's call."""
        if not (self.quick and self.size > 1):
            return
        req, self._hash_req = self._hash_req, None
        self._wait([req], kind, seq)  # (a worker that never comes is missed here: name the collective itself)
        top, neg_bottom = self._hash_recv
        if top == -neg_bottom:
            return
        # Every worker sees the same maxima, so all are here: gather the descriptions (on the
        # side communicator: this one has mismatched collectives in flight).
        self._broken = f"mismatched collectives at #{seq}"
        prints = self._gather_prints(self._side, kind, detail() if callable(detail) else detail, seq)
        raise self._mismatch(prints)

    def _gather_prints(self, comm: Any, kind: str, detail: str, seq: int) -> list[str]:
        mine = f"{seq}|{kind}|{detail}".encode()[:_FINGERPRINT_BYTES]
        buf = np.zeros(_FINGERPRINT_BYTES, np.uint8)
        buf[: len(mine)] = np.frombuffer(mine, np.uint8)
        out = np.empty((self.size, _FINGERPRINT_BYTES), np.uint8)
        req = comm.Iallgather(buf, out)
        self._wait([req], f"the fingerprint check of collective #{seq} ({kind})", seq)
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in out]

    @staticmethod
    def _mismatch(prints: list[str]) -> ReplicaMismatchError:
        lines: list[str] = []
        for w, p in enumerate(prints):
            s, k, d = (p.split("|", 2) + ["", ""])[:3]
            lines.append(f"worker {w}: collective #{s} {k} {d}".rstrip())
        return ReplicaMismatchError(
            "cross-worker collectives differ across workers (every worker must make the same collective calls, "
            "in the same order, with the same shapes and dtypes):\n  " + "\n  ".join(lines)
        )

    def _check_fingerprint(self, kind: str, detail: str) -> None:
        prints = self._gather_prints(self.comm, kind, detail, self.seq)
        if any(p != prints[0] for p in prints):
            raise self._mismatch(prints)

    def _post_notice(self, seq: int) -> None:
        self._notice_buf[0] = seq
        for peer in range(self.size):
            if peer != self.rank:
                self._sends.append(self._side.Isend(self._notice_buf, dest=peer, tag=_NOTICE_TAG))

    def _drain_notices(self) -> None:
        MPI = self._MPI
        status = MPI.Status()
        buf = np.zeros(1, np.int64)
        while self._side.Iprobe(source=MPI.ANY_SOURCE, tag=_NOTICE_TAG, status=status):
            src = status.Get_source()
            self._side.Recv(buf, source=src, tag=_NOTICE_TAG)
            self._arrived[src] = max(self._arrived[src], int(buf[0]))
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]

    def missing_workers(self, seq: int) -> list[int]:
        """Workers not known to have reached collective ``seq`` (from their notices).

        Args:
            seq: the collective's sequence number.
        """
        self._drain_notices()
        return [w for w in range(self.size) if w != self.rank and self._arrived[w] < seq]

    def _wait(self, reqs: Sequence[Any], what: str, seq: int) -> None:
        testall = self._MPI.Request.Testall
        if testall(reqs):
            return
        self._poll(lambda: testall(reqs), what, seq)

    def _poll(self, done: Callable[[], bool], what: str, seq: int, on_timeout: Callable[[], None] | None = None) -> None:
        """Calls ``done()`` until it is true, with the deadline, stall warning and arrival notices."""
        start = time.monotonic()
        timeout = self.timeout_seconds
        deadline = None if timeout is None else start + timeout
        notice_at = start + (0.25 if timeout is None else min(0.25, timeout / 4))
        warn_at = start + self.stall_warning_seconds
        noticed = False
        monotonic = time.monotonic
        sleep = time.sleep
        sched_yield = os.sched_yield
        yielding = _YIELD or self.yielding
        while not done():
            now = monotonic()
            if now - start < _SPIN_SECONDS:
                if yielding:
                    sched_yield()  # spin, letting an oversubscribed core go: MPI progresses only inside Testall
                continue
            sleep(0.0005)  # a long wait (a slow or stuck worker): poll without burning a core
            if not noticed and now >= notice_at:
                self._post_notice(seq)
                noticed = True
            if now >= warn_at:
                warn_at = float("inf")
                missing = self.missing_workers(seq)
                warnings.warn(
                    f"cudist: worker {self.rank} has waited {now - start:.0f} s in {what}, collective #{seq}, for "
                    f"worker(s) {missing or 'unknown'}; a worker may be stuck or have diverged "
                    "(set CUDIST_CHECK_COLLECTIVES=1 to check that workers make the same collective calls)",
                    CollectiveStallWarning,
                    stacklevel=5,
                )
            if deadline is not None and now >= deadline:
                missing = self.missing_workers(seq)
                self._broken = f"a timeout in collective #{seq}"
                if on_timeout is not None:
                    on_timeout()
                raise DeadlineExceededError(
                    f"cudist: worker {self.rank} of {self.size} timed out after {timeout:g} s "
                    f"(CommunicationOptions.timeout_seconds) in {what}, collective #{seq}: "
                    f"worker(s) {missing if missing else '(unknown)'} did not join it"
                )

    # ------------------------------------------------------------------ collectives
    def allreduce(
        self,
        pairs: Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]],
        kind: str = "all_reduce",
        detail: str | Callable[[], str] | None = None,
    ) -> None:
        """SUM all-reduces each ``(send, recv)`` pair (contiguous host arrays; ``send is recv``: in place).

        One non-blocking ``Iallreduce`` per pair, all started before any is waited for. ``detail``
        (a string, or a function giving one) describes the call in fingerprints.

        Args:
            pairs: (send, recv) arrays, one pair per buffer.
            kind: names the collective in fingerprints and errors.
            detail: see above (default: the buffers' shapes and dtypes).

        Raises:
            DeadlineExceededError: a worker did not join within ``timeout_seconds``.
            ReplicaMismatchError: (fingerprint checks) the workers called different collectives.
        """
        MPI = self._MPI
        if detail is None:
            detail = lambda: describe([p[1] for p in pairs])  # noqa: E731
        shape = [x for _, recv in pairs for x in (recv.size, recv.dtype.num)] if self.quick else ()
        seq = self._begin(kind, detail, shape)
        reqs: list[Any] = []
        for send, recv in pairs:
            reqs.append(self.comm.Iallreduce(MPI.IN_PLACE if send is recv else send, recv, MPI.SUM))
        self._finish_hash_check(kind, detail, seq)
        self._wait(reqs, kind, seq)

    def allreduce_value(self, value: int, op: str = "max", kind: str = "input sync") -> int:
        """All-reduces one int64 (``op``: "max", "min" or "sum").

        Args:
            value: this worker's value.
            op: "max", "min" or "sum".
            kind: names the collective in fingerprints and errors.
        """
        MPI = self._MPI
        seq = self._begin(kind, op, (len(op),))
        send = np.array([value], np.int64)
        recv = np.empty(1, np.int64)
        req = self.comm.Iallreduce(send, recv, {"max": MPI.MAX, "min": MPI.MIN, "sum": MPI.SUM}[op])
        self._finish_hash_check(kind, op, seq)
        self._wait([req], kind, seq)
        return int(recv[0])

    def bcast(self, arr: npt.NDArray[Any], root: int = 0, kind: str = "broadcast") -> None:
        """Broadcasts the contiguous host array ``arr`` from worker ``root`` into everyone's ``arr``.

        Args:
            arr: the array (read on ``root``, written on the others).
            root: the worker whose array is broadcast.
            kind: names the collective in fingerprints and errors.
        """
        detail = describe([arr])
        seq = self._begin(kind, detail, (arr.size, arr.dtype.num, root))
        req = self.comm.Ibcast(arr, root=root)
        self._finish_hash_check(kind, detail, seq)
        self._wait([req], kind, seq)

    def allgather_rows(self, arr: npt.ArrayLike, axis: int, kind: str = "all_gather") -> npt.NDArray[Any]:
        """Concatenates every worker's host array along ``axis``, in worker order (sizes may differ there).

        Args:
            arr: this worker's array.
            axis: the axis to concatenate along.
            kind: names the collective in fingerprints and errors.

        Raises:
            ValueError: the workers' arrays differ in anything but the size along ``axis``.
        """
        arr = np.asarray(arr)
        detail = f"axis {axis} {arr.dtype} ndim {arr.ndim}"
        seq = self._begin(kind, detail, (axis, arr.dtype.num, arr.ndim))
        ndim = arr.ndim
        meta = np.zeros(ndim + 2, np.int64)
        meta[0] = ndim
        meta[1] = arr.dtype.num
        meta[2:] = arr.shape
        # The ranks could pass arrays of different ndim: gather a fixed-size header first.
        head = np.zeros(34, np.int64)
        head[: min(34, ndim + 2)] = meta[:34]
        heads = np.empty((self.size, 34), np.int64)
        req = self.comm.Iallgather(head, heads)
        self._finish_hash_check(kind, detail, seq)
        self._wait([req], f"{kind} (shapes)", seq)
        mine = heads[self.rank]
        for w in range(self.size):
            h = heads[w]
            same = h[0] == mine[0] and h[1] == mine[1]
            if same:
                dims = [d for i, d in enumerate(h[2 : 2 + ndim]) if i != axis]
                same = dims == [d for i, d in enumerate(mine[2 : 2 + ndim]) if i != axis]
            if not same:
                shape = tuple(int(x) for x in h[2 : 2 + int(h[0])])
                raise ValueError(
                    f"{kind}: workers disagree: worker {self.rank} has dtype {arr.dtype} shape {arr.shape}, "
                    f"worker {w} has dtype {_dtype_of_num(int(h[1]))} shape {shape}; "
                    f"only the size along axis {axis} may differ"
                )
        rows = [int(h[2 + axis]) for h in heads]
        moved = np.ascontiguousarray(np.moveaxis(arr, axis, 0)) if axis != 0 else np.ascontiguousarray(arr)
        rest = moved.shape[1:]
        per_row = int(np.prod(rest, dtype=np.int64)) if rest else 1
        counts = [r * per_row for r in rows]
        out = np.empty((sum(rows), *rest), arr.dtype)
        req = self.comm.Iallgatherv(moved.reshape(-1), [out.reshape(-1), counts])
        self._wait([req], kind, seq)
        return np.moveaxis(out, 0, axis) if axis != 0 else out

    def collective(
        self,
        kind: str,
        detail: str | Callable[[], str],
        start: Callable[[], Callable[[], bool]],
        on_timeout: Callable[[], None] | None = None,
        hash_check: bool = True,
    ) -> None:
        """A cross-worker collective carried by another library (NCCL), numbered, checked and waited
        for like this communicator's own.

        ``start()`` queues the collective and returns a poll function, true once it has completed
        (it may raise, e.g. on an asynchronous NCCL error). The poll is subject to the deadline
        (``timeout_seconds``), the stall warning and the arrival notices that name missing workers;
        on a timeout ``on_timeout()`` runs (NCCL: ``ncclCommAbort``, which ends a kernel waiting
        for a peer) before :class:`DeadlineExceededError` is raised. After any error the
        communicator refuses further collectives, as after a timeout.

        Args:
            kind: names the collective in fingerprints and errors.
            detail: describes the call in fingerprints (a string, or a function giving one).
            start: queues the collective; returns its poll function.
            on_timeout: called when the deadline passes, before the error is raised.
            hash_check: False: no MPI hash check; ``start`` compares :meth:`call_hash` across the
                workers itself (the shared-memory transport, in shared memory) when :attr:`quick`.

        Raises:
            DeadlineExceededError: a worker did not join within ``timeout_seconds``.
            ReplicaMismatchError: (fingerprint checks) the workers called different collectives.
        """
        seq = self._begin(kind, detail, (zlib.crc32((detail() if callable(detail) else detail).encode()),)
                          if self.quick and hash_check else (), hash_check)
        try:
            # Checked before NCCL is called: mismatched NCCL calls would spin on the GPU, not fail.
            if hash_check:
                self._finish_hash_check(kind, detail, seq)
            done = start()
            if not done():
                self._poll(done, kind, seq, on_timeout)
        except BaseException:
            if self._broken is None:
                self._broken = f"an error in collective #{seq} ({kind})"
            raise

    def barrier(self, kind: str = "barrier") -> None:
        """Waits until every worker has reached this barrier (``kind`` names it in errors)."""
        seq = self._begin(kind, "")
        req = self.comm.Ibarrier()
        self._finish_hash_check(kind, "", seq)
        self._wait([req], kind, seq)
