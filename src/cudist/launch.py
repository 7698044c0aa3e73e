"""``python -m cudist.launch -n N script.py args...``: runs a multi-worker job (thin over ``mpiexec``).

Starts N workers of ``script.py`` with the ``mpiexec`` of the ``mpich`` wheel (``pip install
"cudist[mpi]"``), each a process whose :class:`cudist.MultiWorkerMirroredStrategy` finds the others
through MPI. Options:

* ``--tf-config``: give each worker a ``TF_CONFIG`` naming the cluster (``worker`` tasks
  ``localhost:<port>``) and its own task index (= its MPI rank), for scripts that read TF_CONFIG
  (``TFConfigClusterResolver``);
* ``--mpiexec PATH``: the launcher to use (default: the one next to this Python, else on PATH);
* ``--timeout S``: end the job after S seconds (exit code 124; with restarts, each attempt gets S seconds);
* ``--max-restarts N`` (torchrun's name): when the job fails (a worker killed by a signal, exiting
  with a nonzero code, a preemption's exit code 42 included), say which worker failed and how, end
  and clean up the job (``/dev/shm`` included), and start it again, up to N times. The workers of
  restart K see ``CUDIST_RESTART_COUNT=K`` (0 the first time); a job that resumes from its latest
  checkpoint (:class:`cudist.train.experimental.PreemptionCheckpointHandler`,
  ``CheckpointManager.restore_or_initialize``) continues where it stopped. ``--timeout`` and a
  signal to the launcher end the job without a restart; the exit code is the last attempt's.

Each worker's BLAS/OpenMP/Numba/native-kernel thread count is set to cores / N (``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ``NUMBA_NUM_THREADS``, ``CUDIST_NUM_THREADS``, unless
already set, as ``torchrun`` does): N workers each running a matmul over every core would slow each other down
several times over. When there are more workers than CPU cores, ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``
is set so that waiting workers yield the CPU instead of spinning. The exit code is the job's; when it fails, the
launcher says which worker failed and how (raised an exception, exited with a code, was killed). A
worker that ends without finishing its script (``os._exit``, a kill) fails the job even where
mpiexec reports success.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from cudist import _settings

__all__ = ["main", "find_mpiexec", "build_command", "worker_env"]

_STATUS_DIR = "CUDIST_LAUNCH_STATUS_DIR"
#: Set in each worker's environment: how many times the launcher has restarted the job (read by user scripts).
_RESTART_COUNT = _settings.RESTART_COUNT
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
                _settings.NUM_THREADS)
_BASE_PORT = 23456


def find_mpiexec(explicit: str | None = None) -> str | None:
    """The ``mpiexec`` to use: ``explicit``, else the one next to this Python (a venv's), else PATH's."""
    if explicit:
        return explicit if os.sep in explicit else (shutil.which(explicit) or explicit)
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


def worker_env(n: int, env=None) -> dict:
    """The environment for ``n`` workers on this machine: thread counts of cores / n, heavy yield if oversubscribed."""
    env = dict(os.environ if env is None else env)
    cores = os.cpu_count() or 1
    for var in _THREAD_VARS:  # the workers share the cores (as torchrun does)
        env.setdefault(var, str(max(1, cores // n)))
    if n > cores:
        env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")  # oversubscribed: waiting ranks yield the CPU
    return env


def _rank() -> int:
    for k in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        v = os.environ.get(k)
        if v is not None and v.isdigit():
            return int(v)
    return 0


def _size() -> int:
    for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        v = os.environ.get(k)
        if v is not None and v.isdigit():
            return int(v)
    return 1


def tf_config(num_workers: int, index: int, base_port: int = _BASE_PORT) -> str:
    """The TF_CONFIG of worker ``index`` of a ``num_workers`` cluster on this machine."""
    cluster = {"worker": [f"localhost:{base_port + i}" for i in range(num_workers)]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def _write_status(directory: str | None, rank: int, text: str) -> None:
    if not directory:
        return
    try:
        Path(directory, f"{rank}.status").write_text(text)
    except OSError:
        pass


def _read_status(directory: str, rank: int) -> str | None:
    """What worker ``rank`` wrote in its status file (None if nothing)."""
    try:
        return Path(directory, f"{rank}.status").read_text()
    except OSError:
        return None


def _worker(args) -> int:
    """One worker's bootstrap (inside mpiexec): records its pid and outcome, then runs the script.

    An error exit (an exception, ``sys.exit`` with a nonzero code, Ctrl-C) aborts the whole job at
    once, as ``python -m mpi4py`` does; a clean one waits for the other workers to exit too, and
    aborts the job if one of them waits in a collective this worker never made
    (:func:`cudist._dataplane.transports.mpi.await_peers_at_exit`). Either way no worker is left waiting for
    this one, nor this one blocked in ``MPI_Finalize``.
    """
    rank = _rank()
    directory = _settings.launch_status_dir()
    if directory:
        Path(directory, f"{rank}.pid").write_text(str(os.getpid()))
        _connect_watch(directory, rank)
    _tag_output(rank, not args.no_prefix, args.log_dir)
    mpi = _start_mpi(directory, rank)
    if args.tf_config:
        os.environ["TF_CONFIG"] = tf_config(_size(), rank)
    sys.argv = [args.script, *args.args]
    script_dir = str(Path(args.script).resolve().parent)
    if sys.path[0] != script_dir:
        sys.path.insert(0, script_dir)
    try:
        if args.module:
            runpy.run_module(args.script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            _write_status(directory, rank, f"exited with code {code}")
            if mpi is not None:
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)  # what Python prints for sys.exit("message")
                mpi.abort(code, f"cudist: worker {rank} of {_size()} exited with code {code}; "
                                "aborting every worker of the job (MPI_Abort)")
            raise
    except BaseException as e:
        _write_status(directory, rank, f"raised {type(e).__name__}: {e}".splitlines()[0][:500])
        if mpi is not None:
            import traceback  # noqa: PLC0415

            traceback.print_exc()
            mpi.abort(130 if isinstance(e, KeyboardInterrupt) else 1,
                      f"cudist: worker {rank} of {_size()} raised {type(e).__name__}; "
                      "aborting every worker of the job (MPI_Abort)")
        raise
    if mpi is not None:
        problem = mpi.await_peers_at_exit()
        if problem is not None:
            _write_status(directory, rank, f"ended while {problem}")
            mpi.abort(1, mpi.exit_message(problem))
    _write_status(directory, rank, "ok")
    return 0


def _start_mpi(directory: str | None, rank: int):
    """Starts MPI in a worker: notes its shared-memory files (for the launcher to remove if the job
    dies) and creates the job communicator (set-up collectives, the exit rendezvous). Returns
    ``cudist._dataplane.transports.mpi``, or None without mpi4py (the script will say so if it needs MPI)."""
    try:
        from mpi4py import MPI  # noqa: F401, PLC0415 - initializes MPI (the script would anyway)

        from cudist._dataplane.transports import mpi  # noqa: PLC0415
    except ImportError:
        return None
    if directory:
        segments = mpi.shm_segments()
        if segments:
            Path(directory, f"{rank}.shm").write_text("\n".join(segments))
    mpi.job()
    return mpi


def _remove_recorded_shm(directory: str) -> None:
    """Removes the MPICH shared-memory files the workers noted (a killed or aborted job leaves them)."""
    paths = []
    for p in Path(directory).glob("*.shm"):
        paths += [x for x in p.read_text().splitlines() if x.startswith("/dev/shm/mpich_shm_")]
    for path in set(paths):
        try:
            os.unlink(path)
        except OSError:
            pass


def build_command(mpiexec: str, n: int, script: str, script_args, *, tf_config_flag=False, module=False,
                  prefix=True, log_dir=None) -> list:
    """The mpiexec command line that starts ``n`` workers of ``script``."""
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "cudist.launch", "--worker"]
    if tf_config_flag:
        cmd.append("--tf-config")
    if module:
        cmd.append("-m")
    if not prefix:
        cmd.append("--no-prefix")
    if log_dir is not None:
        cmd += ["--log-dir", os.path.abspath(log_dir)]
    return [*cmd, "--", script, *script_args]


class _RankLines:
    """A worker's ``sys.stdout`` / ``sys.stderr``: each line goes to the console with ``tag`` in front
    (``"[1] "``; nothing with ``--no-prefix``) and, untagged, to the worker's log file (``--log-dir``).

    Python-level writes only (print, logging, tracebacks); what C code writes to the file
    descriptors directly goes to the console untagged. A tagged line is written whole, in one write
    (so the workers' lines do not interleave mid-line); a partial line waits for its end or a flush.
    """

    def __init__(self, stream: Any, tag: str, log: Any) -> None:
        self._stream, self._tag, self._log = stream, tag, log
        self._pending = ""
        self._line_start = True

    def write(self, text: str) -> int:
        if self._log is not None:
            self._log.write(text)
        if not self._tag:
            self._stream.write(text)
            return len(text)
        self._pending += text
        if "\n" in self._pending:
            head, _, self._pending = self._pending.rpartition("\n")
            lines = head.split("\n")
            first = self._tag if self._line_start else ""
            self._stream.write(first + lines[0] + "\n" + "".join(f"{self._tag}{line}\n" for line in lines[1:]))
            self._line_start = True
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write((self._tag if self._line_start else "") + self._pending)
            self._pending, self._line_start = "", False
        self._stream.flush()
        if self._log is not None:
            self._log.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, errors, buffer, ...
        return getattr(self._stream, name)


def _tag_output(rank: int, prefix: bool, log_dir: str | None) -> None:
    """Routes this worker's Python output through :class:`_RankLines` (the launcher's default)."""
    log = None
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        # A restarted job (--max-restarts) appends, so the log keeps the failed attempts' output too.
        restart = _settings.restart_count()
        mode = "w" if restart == 0 else "a"
        log = open(os.path.join(log_dir, f"worker-{rank}.log"), mode, buffering=1, encoding="utf-8")  # noqa: SIM115
        if mode == "a":
            log.write(f"--- cudist.launch: restart {restart} ---\n")
    tag = f"[{rank}] " if prefix else ""
    if tag or log is not None:
        sys.stdout = _RankLines(sys.stdout, tag, log)
        sys.stderr = _RankLines(sys.stderr, tag, log)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In mpiexec's process: SIGTERM it if the launcher dies (even by SIGKILL), so that its workers
    do not outlive the launcher (mpiexec ends them when it is terminated)."""
    import ctypes  # noqa: PLC0415 - Linux only, in the forked child

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Job:
    """Waits for mpiexec, ending it on ``--timeout`` or when the launcher is signalled.

    SIGTERM, SIGINT and SIGHUP sent to the launcher (alone, or to its whole process group) are
    passed to mpiexec, which ends the workers; after :data:`GRACE` seconds mpiexec is killed (its
    proxies then kill the workers). Either way the launcher lives on to remove the shared-memory
    files of the ended workers, which a launcher killed by the signal would leave in ``/dev/shm``.
    """

    GRACE = 5.0
    SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")

    def __init__(self, timeout: float | None) -> None:
        self.proc: subprocess.Popen | None = None
        self.timeout = timeout
        self.signal: int | None = None
        self.timed_out = False
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signal is None:
            self.signal = signum
        if self.proc is not None:
            try:
                self.proc.send_signal(signum)
            except OSError:
                pass

    def __enter__(self) -> _Job:
        """From here on, the launcher's signals are the job's (noted before mpiexec starts, passed after)."""
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def started(self, proc: subprocess.Popen) -> None:
        """mpiexec is running: a signal that came while it started is passed to it now."""
        self.proc = proc
        if self.signal is not None:
            self._on_signal(self.signal, None)

    def wait(self) -> int:
        """mpiexec's exit code (after ending it, if the job timed out or the launcher was signalled)."""
        assert self.proc is not None
        start = time.monotonic()
        end_by: float | None = None
        while True:
            try:
                return self.proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.signal is not None or self.timed_out:
                if end_by is None:
                    end_by = now + self.GRACE
                elif now >= end_by:
                    self.proc.kill()
                    return self.proc.wait()
            elif self.timeout is not None and now - start >= self.timeout:
                self.timed_out = True
                self.proc.terminate()


class _ExitWatch:
    """Notes the order in which the workers' processes end, and how when it still can.

    mpiexec names one failed process, but under load not always the first: once a worker dies it
    kills the others, and it may then report one of those (seen in ~1 of 40 runs: worker 1 killed
    on purpose, "worker 0 ended abnormally (killed by SIGKILL)"). So each worker connects to a Unix
    socket the launcher listens on (``watch.sock`` in the status directory) and keeps the connection
    for its life (:func:`_connect_watch`). The kernel closes it as the process ends, when it closes
    the worker's other sockets, which is how mpiexec learns of the death: so a worker's connection
    ends before mpiexec can kill anyone because of it, and the order of the ends is the order of the
    deaths. (A process's pidfd says so later: after all its threads are gone, which under load came
    after mpiexec had already killed the others.) How an ended worker ended is read from
    ``/proc/<pid>/stat`` while it is a zombie, until mpiexec's proxy reaps it.

    ``order`` is complete only when every worker's connection was seen to end; otherwise (a worker
    that died before connecting would be missing from it) it is emptied at :meth:`stop`, and
    mpiexec's report stands.
    """

    NAME = "watch.sock"

    def __init__(self, directory: str, n: int) -> None:
        self.n = n
        #: (rank, wait status or None, batch), in the order the connections ended: ends seen in one
        #: poll share a batch number and have no known order among themselves.
        self.order: list[tuple[int, int | None, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: socket.socket | None = None
        if not hasattr(socket, "AF_UNIX") or not hasattr(select, "poll"):
            return  # (not on Windows): mpiexec's report stands
        try:
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(os.path.join(directory, self.NAME))  # fails for a path past the ~108-byte limit
            server.listen(max(n, 1))
            server.setblocking(False)
        except OSError:
            return
        self._server = server
        self._thread = threading.Thread(target=self._run, name="cudist-launch-exit-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the watch (once mpiexec has returned: every worker has ended, and is noted, by then)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
        if len({r for r, _, _ in self.order}) < self.n:
            self.order = []

    def _run(self) -> None:
        assert self._server is not None
        server = self._server
        poller = select.poll()
        poller.register(server, select.POLLIN)
        conns: dict[int, tuple[socket.socket, bytearray]] = {}  # fd -> (connection, what it sent)
        batch = 0
        try:
            while True:
                events = poller.poll(100)
                ended: list[tuple[int, int]] = []  # (rank, pid) of connections ended in this poll
                for fd, _ in events:
                    if fd == server.fileno():
                        while True:
                            try:
                                conn, _addr = server.accept()
                            except (BlockingIOError, InterruptedError):
                                break
                            conn.setblocking(False)
                            conns[conn.fileno()] = (conn, bytearray())
                            poller.register(conn, select.POLLIN)
                        continue
                    conn, sent = conns[fd]
                    while True:
                        try:
                            data = conn.recv(256)
                        except (BlockingIOError, InterruptedError):
                            break
                        except OSError:
                            data = b""
                        if data:
                            sent += data
                            continue
                        # The connection ended: the worker's process has.
                        poller.unregister(fd)
                        conn.close()
                        del conns[fd]
                        fields = bytes(sent).split()
                        if len(fields) == 2 and all(f.isdigit() for f in fields):
                            ended.append((int(fields[0]), int(fields[1])))
                        break
                if ended:
                    batch += 1
                    for rank, pid in ended:
                        self.order.append((rank, _exit_status(pid), batch))
                if self._stop.is_set() and not poller.poll(0):
                    return  # (mpiexec has returned: every worker's end is pending by now)
        finally:
            for conn, _ in conns.values():
                conn.close()


_watch_socket: socket.socket | None = None


def _connect_watch(directory: str, rank: int) -> None:
    """In a worker: connects to the launcher's :class:`_ExitWatch` and keeps the connection open
    for the life of the process (closed in forked children, so that it ends with this process)."""
    global _watch_socket
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5.0)  # a launcher that does not accept must not hold the worker up
        s.connect(os.path.join(directory, _ExitWatch.NAME))
        s.sendall(f"{rank} {os.getpid()}\n".encode())
    except (OSError, AttributeError):
        return
    _watch_socket = s
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_watch_in_child)


def _close_watch_in_child() -> None:
    global _watch_socket
    if _watch_socket is not None:
        _watch_socket.close()
        _watch_socket = None


def _exit_status(pid: int, wait: float = 0.05) -> int | None:
    """The wait status of ending process ``pid``: its connection has just closed, so it becomes a
    zombie within moments; read while it is one (None if it was reaped first, or no pidfds)."""
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(wait * 1000)
        finally:
            os.close(fd)
    return _zombie_status(pid)


def _zombie_status(pid: int) -> int | None:
    """The wait status of ended process ``pid`` while it is still a zombie (field 52 of /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 50 or fields[0] != "Z":
        return None
    return int(fields[49])


def _how(code: int | None, wait_status: int | None) -> str:
    """How a process ended: from its wait status when known, else from mpiexec's exit code for it."""
    if wait_status is not None:
        if wait_status & 0x7F:
            try:
                return f"killed by {signal.Signals(wait_status & 0x7F).name}"
            except ValueError:
                return f"killed by signal {wait_status & 0x7F}"
        return f"exit code {wait_status >> 8}"
    if code is None:
        return "exit status unknown"
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    elif code == 9:
        return "killed by SIGKILL"
    return f"exit code {code}"


def _describe_failure(directory: str, n: int, pids: dict, bad_pid, bad_code, order=()) -> list:
    """What the launcher says about a failed job.

    Args:
        directory: the status directory (``<rank>.status`` files the workers wrote).
        n: the number of workers.
        pids: rank -> pid.
        bad_pid, bad_code: the process mpiexec reported, and its exit code (None if none).
        order: (rank, wait status or None, batch) as :class:`_ExitWatch` saw the workers'
            processes end: the culprit is one of the earliest batch holding a worker that did not
            end well; mpiexec's pick when it is among them (their order is not known), else the
            first listed.
    """
    lines = []
    statuses = {}
    for r in range(n):
        statuses[r] = _read_status(directory, r)
    culprit = None
    if bad_pid is not None:
        for r, pid in pids.items():
            if pid == bad_pid:
                culprit = r
    first = None
    bad_batch = min((b for r, _, b in order if statuses[r] != "ok"), default=None)
    if bad_batch is not None:
        earliest = [(r, st) for r, st, b in order if b == bad_batch and statuses[r] != "ok"]
        first = next((x for x in earliest if x[0] == culprit), earliest[0])
    failed = [r for r, s in statuses.items() if s is not None and s != "ok"]
    if failed:
        for r in failed:
            lines.append(f"worker {r} {statuses[r]}")
    elif first is not None:
        r, wait_status = first
        code = bad_code if r == culprit else None  # mpiexec's code is for the process it named
        pid = f" (pid {pids[r]})" if r in pids else ""
        lines.append(f"worker {r}{pid} ended abnormally ({_how(code, wait_status)})")
        culprit = r
    elif culprit is not None:
        lines.append(f"worker {culprit} (pid {bad_pid}) ended abnormally ({_how(bad_code, None)})")
    silent = [r for r, s in statuses.items() if s is None and r != culprit]
    if silent and (failed or culprit is not None):
        lines.append(f"worker(s) {silent} were ended by the launcher")
    elif silent:
        lines.append(f"worker(s) {silent} ended without reporting (killed, or ended by the launcher)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cudist.launch",
        description="Run a cudist multi-worker job: N worker processes of a script, over MPI (mpiexec).",
    )
    parser.add_argument("-n", "--num-workers", type=int, default=None, help="number of workers (processes)")
    parser.add_argument("--tf-config", action="store_true", help="give each worker a TF_CONFIG (task index = rank)")
    parser.add_argument("--mpiexec", default=None, help="the mpiexec to use (default: next to python, else PATH)")
    parser.add_argument("--timeout", type=float, default=None, help="end the job after this many seconds (exit 124)")
    parser.add_argument("-m", dest="module", action="store_true", help="run a module (as python -m) instead of a script")
    parser.add_argument("--no-prefix", action="store_true",
                        help="do not put each worker's rank ('[0] ') in front of its output lines")
    parser.add_argument("--log-dir", default=None,
                        help="also write each worker's output to DIR/worker-<rank>.log (created if missing)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart a failed job up to this many times (default 0)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("script", help="the script (or module with -m) every worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if args.args and args.args[0] == "--":
        args.args = args.args[1:]
    if args.worker:
        return _worker(args)
    n = args.num_workers
    if n is None or n < 1:
        parser.error("-n N (N >= 1 workers) is required")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    mpiexec = find_mpiexec(args.mpiexec)
    if mpiexec is None:
        sys.stderr.write(
            "cudist.launch: no mpiexec found; install the MPI extra: pip install \"cudist[mpi]\" "
            "(mpi4py and the mpich wheel)\n"
        )
        return 127
    if not (os.path.isfile(mpiexec) and os.access(mpiexec, os.X_OK)):
        # Checked here so that a typo gets one line, not Popen's traceback.
        sys.stderr.write(f"cudist.launch: --mpiexec {args.mpiexec}: not an executable file\n")
        return 127
    if args.log_dir is not None:
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as e:
            sys.stderr.write(f"cudist.launch: --log-dir {args.log_dir}: {e.strerror or e}\n")
            return 2
    env = worker_env(n)
    restart = 0
    while True:
        env[_RESTART_COUNT] = str(restart)
        code, restartable = _run_job(args, mpiexec, n, env)
        if code == 0 or not restartable or restart >= args.max_restarts:
            return code
        restart += 1
        sys.stderr.write(f"cudist.launch: restarting the job ({restart} of {args.max_restarts} restarts)\n")
        sys.stderr.flush()


def _run_job(args: argparse.Namespace, mpiexec: str, n: int, env: dict) -> tuple[int, bool]:
    """Runs the job once: (its exit code, whether a failure may be restarted: not when mpiexec
    could not start, the job ran past --timeout or the launcher was signalled)."""
    with tempfile.TemporaryDirectory(prefix="cudist-launch-") as directory:
        env[_STATUS_DIR] = directory
        cmd = build_command(mpiexec, n, args.script, args.args, tf_config_flag=args.tf_config, module=args.module,
                            prefix=not args.no_prefix, log_dir=args.log_dir)
        start = time.monotonic()
        with _Job(args.timeout) as job:
            try:
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, errors="replace", bufsize=1,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            except OSError as e:
                sys.stderr.write(f"cudist.launch: cannot start {mpiexec}: {e.strerror or e}\n")
                return 127, False
            job.started(proc)
            bad = {"pid": None, "code": None}

            def pump():
                assert proc.stdout is not None
                for line in proc.stdout:
                    m = re.search(r"PID (\d+) RUNNING AT", line)
                    if m and bad["pid"] is None:
                        bad["pid"] = int(m.group(1))
                    m = re.search(r"EXIT CODE: (\d+)", line)
                    if m and bad["code"] is None:
                        bad["code"] = int(m.group(1))
                    sys.stdout.write(line)
                    sys.stdout.flush()

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            watch = _ExitWatch(directory, n)
            code = job.wait()
            if job.timed_out or job.signal is not None:
                reader.join(timeout=2)
                watch.stop()
                _remove_recorded_shm(directory)
                if job.timed_out:
                    sys.stderr.write(f"cudist.launch: the job ran past --timeout {args.timeout:g} s and was ended\n")
                    return 124, False
                signum = job.signal
                assert signum is not None
                sys.stderr.write(
                    f"cudist.launch: received {signal.Signals(signum).name}; the job of {n} worker(s) was ended\n"
                )
                return 128 + signum, False
        reader.join(timeout=5)
        watch.stop()
        _remove_recorded_shm(directory)
        if code == 0 and not all(_read_status(directory, r) == "ok" for r in range(n)):
            # mpiexec returns 0 when a worker ends with os._exit(0) mid-job, after killing the
            # others (seen with MPICH 5's): a job whose workers did not all finish their script
            # (each says "ok" as it does) did not succeed.
            code = 1
        if code != 0:
            pids = {}
            for r in range(n):
                p = Path(directory, f"{r}.pid")
                if p.is_file():
                    try:
                        pids[r] = int(p.read_text())
                    except ValueError:
                        pass
            lines = _describe_failure(directory, n, pids, bad["pid"], bad["code"], watch.order)
            sys.stderr.write(
                f"cudist.launch: the job of {n} worker(s) failed after {time.monotonic() - start:.1f} s "
                f"(exit code {code}):\n" + "".join(f"  {line}\n" for line in lines)
            )
        return code, True


if __name__ == "__main__":
    sys.exit(main())
