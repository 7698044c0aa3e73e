"""The launcher names the worker that failed first: its exit watch and its failure description.

mpiexec reports one failed process, and under load it may name a worker it killed itself after
the real culprit died (seen once in ~40 runs of the kill tests). The launcher also watches the
order in which the workers' processes end (Linux pidfds) and reads how each ended while it is a
zombie. These tests drive both with plain child processes (no MPI needed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cudist import launch

needs_pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux-only")


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.01)


@needs_pidfd
def test_exit_watch_notes_the_order_and_how_each_process_ended(tmp_path):
    procs = [_sleeper(), _sleeper(), _sleeper()]
    try:
        watch = launch._ExitWatch(str(tmp_path), 3)
        for r in (2, 0):  # pid files appear as workers start, in any order
            Path(tmp_path, f"{r}.pid").write_text(str(procs[r].pid))
        time.sleep(0.1)  # the watch has opened their pidfds
        procs[2].kill()  # rank 2 first; these are our children, so they stay zombies until waited for
        _wait_for(lambda: len(watch.order) == 1)
        Path(tmp_path, "1.pid").write_text(str(procs[1].pid))
        time.sleep(0.1)
        procs[1].send_signal(signal.SIGTERM)
        _wait_for(lambda: len(watch.order) == 2)
        procs[0].kill()
        _wait_for(lambda: len(watch.order) == 3)
        watch.stop()
        assert [r for r, _ in watch.order] == [2, 1, 0]
        assert [launch._how(None, st) for _, st in watch.order] == ["killed by SIGKILL", "killed by SIGTERM", "killed by SIGKILL"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@needs_pidfd
def test_exit_watch_counts_a_process_gone_before_it_was_watched_as_ended(tmp_path):
    p = _sleeper()
    p.kill()
    p.wait()  # reaped: no zombie left to read
    Path(tmp_path, "0.pid").write_text(str(p.pid))
    watch = launch._ExitWatch(str(tmp_path), 1)
    _wait_for(lambda: len(watch.order) == 1)
    watch.stop()
    assert watch.order == [(0, None)]


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
    lines = launch._describe_failure(str(tmp_path), 2, pids, 100, 9, [(1, None), (0, 9)])
    assert lines == ["worker 1 (pid 101) ended abnormally (exit status unknown)", "worker(s) [0] were ended by the launcher"]
    # with its zombie status read
    lines = launch._describe_failure(str(tmp_path), 2, pids, 100, 9, [(1, signal.SIGSEGV), (0, 9)])
    assert lines[0] == "worker 1 (pid 101) ended abnormally (killed by SIGSEGV)"
    # mpiexec named the right one: its exit code is used when the zombie was not read
    lines = launch._describe_failure(str(tmp_path), 2, pids, 101, 137, [(1, None), (0, None)])
    assert lines[0] == "worker 1 (pid 101) ended abnormally (killed by SIGKILL)"


def test_describe_failure_skips_workers_that_ended_well_and_prefers_reported_failures(tmp_path):
    pids = {0: 100, 1: 101, 2: 102}
    _status(tmp_path, {0: "ok"})
    lines = launch._describe_failure(str(tmp_path), 3, pids, None, None, [(0, 0), (2, 3 << 8), (1, 9)])
    assert lines == ["worker 2 (pid 102) ended abnormally (exit code 3)", "worker(s) [1] were ended by the launcher"]
    _status(tmp_path, {1: "raised ValueError: bad"})
    lines = launch._describe_failure(str(tmp_path), 3, pids, None, None, [(0, 0), (2, 9), (1, 1 << 8)])
    assert lines == ["worker 1 raised ValueError: bad", "worker(s) [2] were ended by the launcher"]


def test_describe_failure_without_a_watch_keeps_mpiexecs_report(tmp_path):
    lines = launch._describe_failure(str(tmp_path), 2, {0: 100, 1: 101}, 101, 9)
    assert lines == ["worker 1 (pid 101) ended abnormally (killed by SIGKILL)", "worker(s) [0] were ended by the launcher"]
