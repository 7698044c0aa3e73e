"""The launcher names the worker that failed first: its exit watch and its failure description.

mpiexec reports one failed process, and under load it may name a worker it killed itself after
the real culprit died (seen once in ~40 runs of the kill tests). The launcher also watches the
order in which the workers' processes end (each keeps a connection to it open for its life) and
reads how each ended while it is a zombie. These tests drive both with stand-in workers (no MPI).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cudist import launch

def _worker(directory, rank, fork=False) -> subprocess.Popen:
    """A stand-in worker: connects to the launcher's watch as a real one does, then sleeps (after
    forking a child that outlives it, with ``fork``)."""
    code = (
        "import os, sys, time; from cudist import launch; "
        f"launch._connect_watch({str(directory)!r}, {rank}); "
        + ("os.fork() or time.sleep(30); " if fork else "")
        + "print('ready', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _end(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()
    p.stdout.close()


def _wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_exit_watch_notes_the_order_and_how_each_worker_ended(tmp_path):
    watch = launch._ExitWatch(str(tmp_path), 3)
    procs = [_worker(tmp_path, r) for r in range(3)]
    try:
        procs[2].kill()  # these are our children: zombies until waited for, so their status is readable
        _wait_for(lambda: len(watch.order) == 1)
        procs[1].send_signal(signal.SIGTERM)
        _wait_for(lambda: len(watch.order) == 2)
        procs[0].kill()
        _wait_for(lambda: len(watch.order) == 3)
        watch.stop()
        assert [r for r, _, _ in watch.order] == [2, 1, 0]
        assert len({b for _, _, b in watch.order}) == 3  # seen one at a time: a known order
        assert [launch._how(None, st) for _, st, _ in watch.order] == ["killed by SIGKILL", "killed by SIGTERM", "killed by SIGKILL"]
    finally:
        for p in procs:
            _end(p)


def test_a_workers_end_is_seen_even_when_a_forked_child_outlives_it(tmp_path):
    watch = launch._ExitWatch(str(tmp_path), 2)
    procs = [_worker(tmp_path, 0), _worker(tmp_path, 1, fork=True)]
    try:
        procs[1].kill()  # its forked child sleeps on, without the watch connection
        _wait_for(lambda: len(watch.order) == 1)
        procs[0].kill()
        _wait_for(lambda: len(watch.order) == 2)
        watch.stop()
        assert [r for r, _, _ in watch.order] == [1, 0]
    finally:
        for p in procs:
            _end(p)


def test_exit_watch_is_dropped_when_a_worker_never_connected(tmp_path):
    """A worker that died before connecting is missing from the order: mpiexec's report stands."""
    watch = launch._ExitWatch(str(tmp_path), 2)
    p = _worker(tmp_path, 0)
    _end(p)
    _wait_for(lambda: len(watch.order) == 1)
    watch.stop()
    assert watch.order == []


def test_exit_watch_stops_while_workers_never_started(tmp_path):
    watch = launch._ExitWatch(str(tmp_path), 2)
    started = time.monotonic()
    watch.stop()
    assert time.monotonic() - started < 1.5 and watch.order == []


def _status(tmp_path, statuses):
    for r, text in statuses.items():
        Path(tmp_path, f"{r}.status").write_text(text)


def test_describe_failure_names_the_first_worker_to_end_not_the_one_mpiexec_named(tmp_path):
    pids = {0: 100, 1: 101}
    # mpiexec named worker 0 (which it killed itself), but worker 1 ended first: worker 1 is the culprit
    lines = launch._describe_failure(str(tmp_path), 2, pids, 100, 9, [(1, None, 1), (0, 9, 2)])
    assert lines == ["worker 1 (pid 101) ended abnormally (exit status unknown)", "worker(s) [0] were ended by the launcher"]
    # with its zombie status read
    lines = launch._describe_failure(str(tmp_path), 2, pids, 100, 9, [(1, signal.SIGSEGV, 1), (0, 9, 2)])
    assert lines[0] == "worker 1 (pid 101) ended abnormally (killed by SIGSEGV)"
    # mpiexec named the right one: its exit code is used when the zombie was not read
    lines = launch._describe_failure(str(tmp_path), 2, pids, 101, 137, [(1, None, 1), (0, None, 2)])
    assert lines[0] == "worker 1 (pid 101) ended abnormally (killed by SIGKILL)"
    # seen to end together: no known order between them, so mpiexec's pick stands
    lines = launch._describe_failure(str(tmp_path), 2, pids, 101, 9, [(0, None, 1), (1, None, 1)])
    assert lines[0] == "worker 1 (pid 101) ended abnormally (killed by SIGKILL)"


def test_describe_failure_skips_workers_that_ended_well_and_prefers_reported_failures(tmp_path):
    pids = {0: 100, 1: 101, 2: 102}
    _status(tmp_path, {0: "ok"})
    lines = launch._describe_failure(str(tmp_path), 3, pids, None, None, [(0, 0, 1), (2, 3 << 8, 2), (1, 9, 3)])
    assert lines == ["worker 2 (pid 102) ended abnormally (exit code 3)", "worker(s) [1] were ended by the launcher"]
    _status(tmp_path, {1: "raised ValueError: bad"})
    lines = launch._describe_failure(str(tmp_path), 3, pids, None, None, [(0, 0, 1), (2, 9, 2), (1, 1 << 8, 3)])
    assert lines == ["worker 1 raised ValueError: bad", "worker(s) [2] were ended by the launcher"]


def test_describe_failure_without_a_watch_keeps_mpiexecs_report(tmp_path):
    lines = launch._describe_failure(str(tmp_path), 2, {0: 100, 1: 101}, 101, 9)
    assert lines == ["worker 1 (pid 101) ended abnormally (killed by SIGKILL)", "worker(s) [0] were ended by the launcher"]
