"""Surviving preemption (issue #29): PreemptionCheckpointHandler, ``launch --max-restarts``, asynchronous saves,
input positions.

The jobs run ``tests/preemption_job.py`` (40 SGD-momentum steps through ``PreemptionCheckpointHandler.run``,
saved every 5) under ``python -m cudist.launch`` with a timeout each; a job that is interrupted after step 17
(SIGTERM: the notice is agreed on during step 18, every worker saves at the call after it and exits 42;
SIGKILL: the job dies) and restarted once
must end with the same bits as the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import cudist
from cudist import data, train
from cudist.cluster_resolver import ClusterSpec, SimpleClusterResolver
from cudist.errors import InvalidArgumentError
from cudist.train import _format
from cudist.train.experimental import RESTART_EXIT_CODE, PreemptionCheckpointHandler, TerminationConfig

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "preemption_job.py")


def _mpi_missing():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install \".[mpi]\")"
    from cudist.launch import find_mpiexec

    if find_mpiexec() is None:
        return "no mpiexec (pip install mpich, or \".[mpi]\")"
    return None


from test_multi_worker import _shm, _shm_left  # the MPI segments check of the other job tests

MISSING = _mpi_missing()
needs_mpi = pytest.mark.skipif(MISSING is not None, reason=f"jobs need MPI: {MISSING}")


def _running(tag):
    """Processes (other than this one) whose command line names ``tag``: a job's workers, its launcher."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            pid = int(cmdline.parent.name)
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and any(tag.encode() in a for a in args):
            found.append((pid, b" ".join(args).decode(errors="replace")[:200]))
    return found


@pytest.fixture
def no_shm_left(tmp_path):
    """After the test: no MPI segment left in /dev/shm, and no process left that the test's job made
    (every job names the test's ``tmp_path`` on its command line)."""
    before = _shm()
    yield
    left = _shm_left(before)
    assert not left, f"MPI shared-memory segments left in /dev/shm: {sorted(left)}"
    deadline = time.monotonic() + 10  # a killed worker's parent may still be reaping it
    while (alive := _running(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"processes of the job left running: {alive}"


@pytest.fixture
def sigterm_restored():
    """The handler installs a SIGTERM handler in this process: put the previous one back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "CUDIST_CHECK_COLLECTIVES", "CUDIST_RESTART_COUNT")}
    return env


def _launch(n, *args, flags=("--max-restarts", "1"), timeout=150):
    cmd = [sys.executable, "-m", "cudist.launch", "-n", str(n), *flags, JOB, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=HERE)


def _results(proc, n):
    out = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"(?:\[\d+\] )?RESULT (\d+) (.*)$", line)
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(out) == list(range(n)), f"missing worker results:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


# ------------------------------------------------------------------------------------ the jobs
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted job's final weights (2 workers and 1 process must agree: same data, same order)."""
    if MISSING is not None:
        pytest.skip(MISSING)
    proc = _launch(2, "none", str(tmp_path_factory.mktemp("ref")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _results(proc, 2)
    assert res[0]["w"] == res[1]["w"] and res[0]["start"] == 0 and res[0]["restart"] == 0
    assert "restarting" not in proc.stderr
    return res[0]


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("n", [2, 1], ids=["2-workers", "1-process"])
@pytest.mark.parametrize("mode,start", [("sigterm", 18), ("sigkill", 15), ("async", None)])
def test_an_interrupted_job_restarts_and_ends_with_the_same_bits(n, mode, start, reference, tmp_path, no_shm_left):
    if n == 1 and mode == "async":
        pytest.skip("the 2-worker run covers asynchronous periodic saves")
    proc = _launch(n, mode, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _results(proc, n)
    for r in res.values():
        assert r["restart"] == 1 and r["runs"] == 40 and r["iterations"] == 40
        assert r["w"] == reference["w"], "the restarted job's weights differ from the uninterrupted job's"
        if start is not None:
            assert r["start"] == start
        else:  # killed while the asynchronous save of run 15 may still have been written: 15 or 10
            assert r["start"] in (10, 15)
    err = proc.stderr
    assert "cudist.launch: restarting the job (1 of 1 restarts)" in err
    if mode == "sigterm":  # every worker saved and exited with the restart code
        for rank in range(n):
            assert f"worker {rank} exited with code {RESTART_EXIT_CODE}" in err, err[-3000:]
    else:
        assert re.search(rf"worker {n - 1} \(pid \d+\) ended abnormally \((killed by SIGKILL|exit status unknown)\)", err), err[-3000:]


@needs_mpi
@pytest.mark.multi_worker
def test_sigterm_to_the_launcher_saves_the_job_and_a_new_launch_resumes_it(reference, tmp_path, no_shm_left):
    """A scheduler preempting the whole job signals the launcher: it passes SIGTERM to the workers,
    whose handler saves at the same step within the launcher's grace period; the launcher exits
    143 without restarting, and a new launch resumes from that save to the reference's bits."""
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", "--max-restarts", "2", JOB, "slow", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=HERE)
    try:
        deadline = time.monotonic() + 60
        while train.latest_checkpoint(str(tmp_path)) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the first periodic save (run 5): training is under way
        assert train.latest_checkpoint(str(tmp_path)) is not None
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "received SIGTERM" in err and "restarting" not in err
    assert f"worker 1 of 2 exited with code {RESTART_EXIT_CODE}" in err or f"worker 0 of 2 exited with code {RESTART_EXIT_CODE}" in err
    saved = int(_values(train.latest_checkpoint(str(tmp_path)))["checkpointed_runs"])
    assert 5 <= saved < 40
    again = _launch(2, "none", str(tmp_path), flags=())
    assert again.returncode == 0, again.stderr[-3000:]
    for r in _results(again, 2).values():
        assert r["start"] == saved and r["w"] == reference["w"]


@needs_mpi
@pytest.mark.multi_worker
def test_without_max_restarts_a_preempted_job_ends_with_the_restart_code(tmp_path, no_shm_left):
    proc = _launch(2, "sigterm", str(tmp_path), flags=())
    assert proc.returncode == RESTART_EXIT_CODE, proc.stderr[-3000:]
    assert "restarting" not in proc.stderr
    assert "RESULT" not in proc.stdout
    # The preemption checkpoint is there, with the run count: a later run resumes from it.
    latest = train.latest_checkpoint(str(tmp_path))
    assert latest is not None
    index = json.loads(Path(latest + _format.INDEX_SUFFIX).read_text())
    assert "checkpointed_runs" in index["objects"]


@needs_mpi
@pytest.mark.multi_worker
def test_restarts_are_bounded_and_each_failure_is_named(tmp_path, no_shm_left):
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        print("attempt", os.environ["CUDIST_RESTART_COUNT"], flush=True)
        sys.exit(3)
    """))
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", "--max-restarts", "2", "--no-prefix", "--log-dir", str(logs),
           str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 3
    assert sorted(set(re.findall(r"attempt (\d)", proc.stdout))) == ["0", "1", "2"]
    assert proc.stderr.count("cudist.launch: restarting the job") == 2
    assert "(2 of 2 restarts)" in proc.stderr
    assert proc.stderr.count("exited with code 3") >= 3  # each attempt's failure is named
    for rank in (0, 1):  # each worker's log keeps every attempt, in order
        text = (logs / f"worker-{rank}.log").read_text()
        assert re.findall(r"attempt (\d)", text) == ["0", "1", "2"], text
        assert text.count("--- cudist.launch: restart") == 2


@needs_mpi
@pytest.mark.multi_worker
def test_a_timed_out_job_is_not_restarted(tmp_path, no_shm_left):
    script = tmp_path / "hangs.py"
    script.write_text("import time\ntime.sleep(60)\n")
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "1", "--max-restarts", "3", "--timeout", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 124
    assert "restarting" not in proc.stderr


def test_max_restarts_must_not_be_negative(capsys):
    from cudist import launch

    with pytest.raises(SystemExit):
        launch.main(["-n", "1", "--max-restarts", "-1", "x.py"])
    assert "--max-restarts must be >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the handler, in-process
class _Exited(Exception):
    pass


def _model(strategy=None):
    ctx = strategy.scope() if strategy is not None else _null()
    with ctx:
        w = cudist.Variable(np.zeros(4, np.float32), name="w")
        opt = cudist.optimizers.SGD(0.1, momentum=0.9)
    return w, opt


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _exit_fn(log):
    def fn():
        log.append("exit")
        raise _Exited

    return fn


def test_a_checkpoint_needs_a_directory_and_other_objects_are_refused():
    w, _ = _model()
    # TF 2.21 means to raise InvalidArgumentError here but builds it with one argument of three, so a
    # TypeError comes out ("InvalidArgumentError.__init__() missing 2 required positional arguments").
    with pytest.raises(InvalidArgumentError, match="checkpoint_dir must be passed"):
        PreemptionCheckpointHandler(None, train.Checkpoint(w=w))
    with pytest.raises(TypeError, match="Checkpoint or CheckpointManager"):
        PreemptionCheckpointHandler(None, {"w": w}, checkpoint_dir="/tmp/x")


def test_outside_the_main_thread_a_watcher_is_required(tmp_path):
    w, _ = _model()
    errors = []

    def make():
        try:
            PreemptionCheckpointHandler(None, train.Checkpoint(w=w), checkpoint_dir=str(tmp_path))
        except ValueError as e:
            errors.append(str(e))

    t = threading.Thread(target=make)
    t.start()
    t.join(10)
    assert len(errors) == 1 and "main thread" in errors[0]


def test_a_parameter_server_cluster_is_refused(tmp_path):
    w, _ = _model()
    resolver = SimpleClusterResolver(ClusterSpec({"worker": ["a:1"], "ps": ["b:1"]}), task_type="worker", task_id=0)
    with pytest.raises(NotImplementedError, match="parameter-server"):
        PreemptionCheckpointHandler(resolver, train.Checkpoint(w=w), checkpoint_dir=str(tmp_path))


def test_sigterm_saves_at_the_next_run_and_exits_and_a_new_handler_resumes(tmp_path, sigterm_restored):
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    w, opt = _model(strategy)
    log = []
    handler = PreemptionCheckpointHandler(
        strategy.cluster_resolver if hasattr(strategy, "cluster_resolver") else None,
        train.Checkpoint(w=w, optimizer=opt),
        checkpoint_dir=str(tmp_path),
        termination_config=TerminationConfig(exit_fn=_exit_fn(log)),
    )
    assert handler.total_run_calls == 0
    assert train.latest_checkpoint(str(tmp_path)) is None  # nothing to restore, nothing saved yet

    def step(i):
        log.append(i)
        strategy.run(lambda: opt.apply_gradients([(np.full(4, 1.0, np.float32), w)]))
        return i * 10

    assert handler.run(step, 0) == 0  # the function's result
    assert handler.run(step, 1) == 10
    os.kill(os.getpid(), signal.SIGTERM)  # handled: only a flag
    time.sleep(0.05)
    assert handler.run(step, 2) == 20  # the notice is sent on at this call (as TF: saved one call later)
    with pytest.raises(_Exited):
        handler.run(step, 3)
    # TF 2.21, the same script (MirroredStrategy(["/cpu:0"]), exit_fn raising): log [0, 1, 2, 'exit'],
    # total_run_calls 3, and a new handler restores total_run_calls 3.
    assert log == [0, 1, 2, "exit"]  # the step of the call that saves does not run: saved, then exit_fn
    saved = w.numpy()
    path = train.latest_checkpoint(str(tmp_path))
    assert path is not None

    w2, opt2 = _model(strategy)
    handler2 = PreemptionCheckpointHandler(None, train.Checkpoint(w=w2, optimizer=opt2), checkpoint_dir=str(tmp_path),
                                           termination_config=TerminationConfig(exit_fn=_exit_fn(log)))
    assert handler2.total_run_calls == 3
    np.testing.assert_array_equal(w2.numpy(), saved)
    assert int(opt2.iterations.numpy()) == 3
    # Momentum continues: the next step from the restored state equals the next step of the original.
    strategy.run(lambda: opt.apply_gradients([(np.full(4, 1.0, np.float32), w)]))
    handler2.run(lambda: strategy.run(lambda: opt2.apply_gradients([(np.full(4, 1.0, np.float32), w2)])))
    np.testing.assert_array_equal(w2.numpy(), w.numpy())


def test_the_default_exit_is_the_restart_code(tmp_path, sigterm_restored):
    w, _ = _model()
    handler = PreemptionCheckpointHandler(None, train.Checkpoint(w=w), checkpoint_dir=str(tmp_path))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    handler.run(lambda: None)
    with pytest.raises(SystemExit) as e:
        handler.run(lambda: None)
    assert e.value.code == RESTART_EXIT_CODE == 42


def test_a_manager_is_used_as_given_and_periodic_saves_record_the_run_count(tmp_path, sigterm_restored):
    w, _ = _model()
    ckpt = train.Checkpoint(w=w)
    manager = train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)
    handler = PreemptionCheckpointHandler(None, manager)
    for _ in range(3):
        handler.run(lambda: w.assign_add(np.ones(4, np.float32)))
    manager.save()  # a periodic save, not a preemption: the run count goes with it (cudist keeps it current)
    fresh_w, _ = _model()
    fresh = PreemptionCheckpointHandler(None, train.CheckpointManager(train.Checkpoint(w=fresh_w), str(tmp_path)))
    assert fresh.total_run_calls == 3
    np.testing.assert_array_equal(fresh_w.numpy(), np.full(4, 3.0, np.float32))


def test_a_termination_watcher_replaces_the_signal(tmp_path, monkeypatch, sigterm_restored):
    from cudist.train import _preemption

    monkeypatch.setattr(_preemption, "_POLL_SECONDS", 0.01)
    before = signal.getsignal(signal.SIGTERM)
    notice = threading.Event()
    log = []
    w, _ = _model()
    handler = PreemptionCheckpointHandler(
        None, train.Checkpoint(w=w), checkpoint_dir=str(tmp_path),
        termination_config=TerminationConfig(termination_watcher_fn=notice.is_set, exit_fn=_exit_fn(log)),
    )
    assert signal.getsignal(signal.SIGTERM) is before  # no SIGTERM handler with a watcher
    handler.run(lambda: None)
    notice.set()
    deadline = time.monotonic() + 10
    with pytest.raises(_Exited):
        while time.monotonic() < deadline:
            handler.run(lambda: time.sleep(0.005))
    assert log == ["exit"]


def test_save_fn_and_save_checkpoint_if_preempted(tmp_path, sigterm_restored):
    w, _ = _model()
    calls, log = [], []
    handler = PreemptionCheckpointHandler(
        None, train.Checkpoint(w=w), checkpoint_dir=str(tmp_path),
        termination_config=TerminationConfig(save_fn=lambda *a, **k: calls.append((a, k)), exit_fn=_exit_fn(log)),
    )
    handler.save_checkpoint_if_preempted()
    assert handler.total_run_calls == 1 and calls == []
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    handler.save_checkpoint_if_preempted()
    assert handler.total_run_calls == 2 and calls == []
    with pytest.raises(_Exited):
        handler.save_checkpoint_if_preempted(7, check_interval=False)
    assert calls == [((7,), {"check_interval": False})]
    with handler.watch_preemption_scope():
        pass


def test_a_grace_period_saves_at_once_and_exits_when_it_is_nearly_over(tmp_path, sigterm_restored):
    w, _ = _model()
    saves, log = [], []
    handler = PreemptionCheckpointHandler(
        None, train.Checkpoint(w=w), checkpoint_dir=str(tmp_path),
        termination_config=TerminationConfig(grace_period=0.5, save_fn=lambda: saves.append(time.monotonic()),
                                             exit_fn=_exit_fn(log)),
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    begin = time.monotonic()
    ran = 0
    with pytest.raises(_Exited):
        while time.monotonic() - begin < 10:
            handler.run(lambda: time.sleep(0.01))
            ran += 1
    assert len(saves) == 2 and log == ["exit"]  # one save at the notice, the last one at the end
    assert ran >= 5  # training went on during the grace period
    assert saves[1] - saves[0] > 0.2


# ------------------------------------------------------------------------------------ asynchronous saves
ASYNC = train.CheckpointOptions(enable_async=True)


def _state(strategy):
    with strategy.scope():
        w = cudist.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="w")
        opt = cudist.optimizers.SGD(0.1, momentum=0.9)
        mean = cudist.metrics.Mean()
    strategy.run(lambda: opt.apply_gradients([(np.ones((3, 4), np.float32), w)]))
    strategy.run(lambda: mean.update_state(np.float32(2.0)))
    return w, opt, mean


def _values(ckpt_path):
    from safetensors.numpy import load_file

    index = json.loads(Path(ckpt_path + _format.INDEX_SUFFIX).read_text())
    return load_file(str(Path(ckpt_path).parent / index["tensors"]))


@pytest.mark.parametrize("where", ["one-device", "mirrored"])
def test_an_async_save_keeps_the_values_of_the_call_while_training_goes_on(tmp_path, where, monkeypatch):
    strategy = cudist.OneDeviceStrategy("/cpu:0") if where == "one-device" else cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    w, opt, mean = _state(strategy)
    ckpt = train.Checkpoint(w=w, optimizer=opt, mean=mean)
    want = {"w": w.numpy(), "mean": float(mean.result())}
    gate = threading.Event()
    monkeypatch.setattr(_format, "before_commit", lambda prefix: gate.wait(10))  # hold the write open
    path = ckpt.save(str(tmp_path / "c"), options=ASYNC)
    for _ in range(3):  # train while the write is pending: copy-on-write keeps the captured values
        strategy.run(lambda: opt.apply_gradients([(np.ones((3, 4), np.float32), w)]))
        strategy.run(lambda: mean.update_state(np.float32(9.0)))
    assert train.latest_checkpoint(str(tmp_path)) is None  # not committed yet, not recorded yet
    gate.set()
    ckpt.sync()
    assert train.latest_checkpoint(str(tmp_path)) == path
    fresh_w, fresh_opt, fresh_mean = _state(strategy)
    train.Checkpoint(w=fresh_w, optimizer=fresh_opt, mean=fresh_mean).restore(path).assert_consumed()
    np.testing.assert_array_equal(fresh_w.numpy(), want["w"])
    assert float(fresh_mean.result()) == want["mean"]
    assert int(fresh_opt.iterations.numpy()) == 1


def test_an_async_write_error_surfaces_at_sync_once_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    w = cudist.Variable(np.ones(4, np.float32))
    ckpt = train.Checkpoint(w=w)
    manager = train.CheckpointManager(ckpt, str(tmp_path))
    first = manager.save(options=ASYNC)
    manager.sync()

    def boom(prefix):
        raise OSError("disk full (planted)")

    monkeypatch.setattr(_format, "before_commit", boom)
    w.assign(np.full(4, 5.0, np.float32))
    manager.save(options=ASYNC)  # returns: the error comes later
    with pytest.raises(OSError, match="planted"):
        manager.sync()
    manager.sync()  # raised once
    assert manager.latest_checkpoint == first and train.latest_checkpoint(str(tmp_path)) == first
    # The next save raises a pending error too.
    manager.save(options=ASYNC)
    with pytest.raises(OSError, match="planted"):
        manager.save(options=ASYNC)
    monkeypatch.undo()
    fresh = cudist.Variable(np.zeros(4, np.float32))
    train.Checkpoint(w=fresh).restore(first)
    np.testing.assert_array_equal(fresh.numpy(), np.ones(4, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no debris


def test_a_second_save_waits_for_the_first(tmp_path, monkeypatch):
    w = cudist.Variable(np.ones(4, np.float32))
    ckpt = train.Checkpoint(w=w)
    gate = threading.Event()
    monkeypatch.setattr(_format, "before_commit", lambda prefix: gate.wait(10))
    ckpt.write(str(tmp_path / "a"), options=ASYNC)
    done = threading.Event()

    def second():
        ckpt.write(str(tmp_path / "b"), options=ASYNC)
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not done.wait(0.3)  # blocked behind the first write
    gate.set()
    t.join(10)
    assert done.is_set()
    ckpt.sync()
    assert _format.exists(str(tmp_path / "a")) and _format.exists(str(tmp_path / "b"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_async_saves_hold_the_bits_of_each_call_while_training_goes_on(tmp_path, monkeypatch, dtype):
    """Tensors above the multi-threaded copy's threshold (odd sizes, random values), two saves in a row
    (the second reuses the first's staging buffers): each checkpoint holds the variable and its
    momentum slot as they were at its save call, whatever the steps after it wrote meanwhile."""
    rng = np.random.default_rng(29)
    shapes = [(300_007,), (517, 1031)]
    ws = [cudist.Variable(rng.standard_normal(s).astype(dtype), name=f"w{i}") for i, s in enumerate(shapes)]
    grads = [rng.standard_normal(s).astype(dtype) for s in shapes]
    opt = cudist.optimizers.SGD(0.01, momentum=0.9)

    def step():
        opt.apply_gradients(zip(grads, ws))

    step()
    ckpt = train.Checkpoint(optimizer=opt, w0=ws[0], w1=ws[1])
    gate = threading.Event()
    monkeypatch.setattr(_format, "before_commit", lambda prefix: gate.wait(10))  # hold each write open
    saved = []
    for _ in range(2):
        step()
        want = {f"w{i}": (w.numpy().tobytes(), opt.get_slot(w, "momentum").numpy().tobytes())
                for i, w in enumerate(ws)}
        gate.clear()
        path = ckpt.save(str(tmp_path / "c"), options=ASYNC)
        for _ in range(3):  # every variable and slot is written while the write is pending
            step()
        gate.set()
        ckpt.sync()
        saved.append((path, want))
    for path, want in saved:
        values = _values(path)
        for key, (w_bytes, m_bytes) in want.items():
            assert values[key].tobytes() == w_bytes, f"{path}: {key} is not the value of the save call"
            assert values[f"{key}/.OPTIMIZER_SLOT/optimizer/momentum"].tobytes() == m_bytes
        fresh = [cudist.Variable(np.zeros(s, dtype)) for s in shapes]
        train.Checkpoint(w0=fresh[0], w1=fresh[1]).restore(path).expect_partial()
        for i, f in enumerate(fresh):
            assert f.numpy().tobytes() == want[f"w{i}"][0]
    assert saved[0][1] != saved[1][1]  # training moved the values between the saves


def _writer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("cudist-checkpoint-write") and t.is_alive()]


def test_no_writer_thread_outlives_its_write(tmp_path, monkeypatch):
    before = set(_writer_threads())
    gate = threading.Event()
    monkeypatch.setattr(_format, "before_commit", lambda prefix: gate.wait(10))
    ckpt = train.Checkpoint(w=cudist.Variable(np.ones(4, np.float32)))
    ckpt.write(str(tmp_path / "a"), options=ASYNC)
    mine = set(_writer_threads()) - before
    assert len(mine) == 1  # the pending write's
    gate.set()
    ckpt.sync()
    assert not any(t.is_alive() for t in mine), "the writer thread outlived its write"


_FORK_CHILD = """
import os, sys, threading
import numpy as np
import cudist
from cudist import train
from cudist.train import _format
gate = threading.Event()
_format.before_commit = lambda prefix: gate.wait(30)
ckpt = train.Checkpoint(w=cudist.Variable(np.ones(4, np.float32)))
ckpt.write(os.path.join(sys.argv[1], "a"), options=train.CheckpointOptions(enable_async=True))
pid = os.fork()
if pid == 0:  # the parent's write is not the child's to wait for
    ckpt.sync()
    os._exit(0)
_, status = os.waitpid(pid, 0)
gate.set()
ckpt.sync()
print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_wait_for_its_parents_pending_write(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _FORK_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "child 0" in proc.stdout
    assert _format.exists(str(tmp_path / "a"))


def test_async_manager_saves_keep_max_to_keep_and_the_state_file(tmp_path):
    w = cudist.Variable(np.zeros(2, np.float32))
    ckpt = train.Checkpoint(w=w)
    manager = train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    for i in range(4):
        w.assign(np.full(2, float(i), np.float32))
        manager.save(options=ASYNC)
    manager.sync()
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-3", "ckpt-4"]
    assert train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-4")
    assert sorted(p.name for p in tmp_path.glob("*.index.json")) == ["ckpt-3.index.json", "ckpt-4.index.json"]
    np.testing.assert_array_equal(_values(str(tmp_path / "ckpt-3"))["w"], [2.0, 2.0])


def test_checkpoint_options(tmp_path):
    w = cudist.Variable(np.zeros(2, np.float32))
    with cudist.OneDeviceStrategy("/cpu:0").scope():
        opt = cudist.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.ones(2, np.float32), w)])
    ckpt = train.Checkpoint(w=w, optimizer=opt)
    seen = []
    options = train.CheckpointOptions(experimental_write_callbacks=[seen.append, lambda: seen.append("no-arg")],
                                      experimental_skip_slot_variables=True)
    path = ckpt.save(str(tmp_path / "c"), options=options)
    assert seen == [path, "no-arg"]
    assert not any(".OPTIMIZER_SLOT" in k for k in _values(path))
    # TF 2.21: CheckpointOptions(experimental_enable_async_checkpoint=True).enable_async is True.
    assert train.CheckpointOptions(experimental_enable_async_checkpoint=True).enable_async
    with pytest.raises(TypeError, match="CheckpointOptions"):
        ckpt.save(str(tmp_path / "c"), options={"enable_async": True})
    with pytest.raises(ValueError, match="sharding"):
        train.CheckpointOptions(experimental_sharding_callback=object())


_CHILD = """
import os, signal, sys
import numpy as np
import cudist
from cudist import train
from cudist.train import _format
d, mode = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(3)
w = cudist.Variable(rng.standard_normal((512, 1024)).astype(np.float32))
opt = cudist.optimizers.SGD(0.1, momentum=0.9)
opt.apply_gradients([(np.ones((512, 1024), np.float32), w)])
ckpt = train.Checkpoint(w=w, optimizer=opt)
manager = train.CheckpointManager(ckpt, d)
manager.save()
np.save(os.path.join(d, "want.npy"), w.numpy())
opt.apply_gradients([(np.ones((512, 1024), np.float32), w)])
if mode == "kill":
    def kill(key):  # in the background writer, after its first tensor: mid-write
        os.kill(os.getpid(), signal.SIGKILL)
    _format.tensor_written = kill
    manager.save(options=train.CheckpointOptions(enable_async=True))
    import time
    time.sleep(30)  # killed before this ends
else:  # exit with the write pending: the interpreter finishes it
    np.save(os.path.join(d, "want2.npy"), w.numpy())
    manager.save(options=train.CheckpointOptions(enable_async=True))
"""


def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_bit_for_bit(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), "kill"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    latest = train.latest_checkpoint(str(tmp_path))
    assert latest == str(tmp_path / "ckpt-1")
    w = cudist.Variable(np.zeros((512, 1024), np.float32))
    train.Checkpoint(w=w).restore(latest).expect_partial()
    np.testing.assert_array_equal(w.numpy(), np.load(tmp_path / "want.npy"))
    assert w.numpy().tobytes() == np.load(tmp_path / "want.npy").tobytes()


def test_interpreter_exit_finishes_a_pending_write(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), "exit"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    latest = train.latest_checkpoint(str(tmp_path))
    assert latest == str(tmp_path / "ckpt-2")
    w = cudist.Variable(np.zeros((512, 1024), np.float32))
    train.Checkpoint(w=w).restore(latest).expect_partial()
    assert w.numpy().tobytes() == np.load(tmp_path / "want2.npy").tobytes()


# ------------------------------------------------------------------------------------ input positions
def _restores(make):
    it = make()
    next(it)
    ckpt = train.Checkpoint(it=it)
    return it, ckpt


@pytest.mark.parametrize("kind", ["dataset", "map", "distributed", "from_function", "list", "from_generator"])
def test_every_iterator_a_user_makes_checkpoints_its_position(tmp_path, kind):
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    ds = data.Dataset.range(24).batch(4)

    def gen():
        yield from (np.arange(4.0) + i for i in range(6))

    make = {
        "dataset": lambda: iter(ds),
        "map": lambda: iter(ds.map(lambda x: x * 2)),
        "distributed": lambda: iter(strategy.experimental_distribute_dataset(ds)),
        "from_function": lambda: iter(strategy.distribute_datasets_from_function(lambda ctx: data.Dataset.range(24).batch(2))),
        "list": lambda: iter(strategy.experimental_distribute_dataset([np.arange(4.0) + i for i in range(6)])),
        "from_generator": lambda: iter(strategy.experimental_distribute_dataset(
            data.Dataset.from_generator(gen, output_signature=data.TensorSpec((4,), np.float64)))),
    }[kind]

    def local(x):
        return [np.asarray(v).tolist() for v in x.values] if hasattr(x, "values") else np.asarray(x).tolist()

    it = make()
    next(it)
    ckpt = train.Checkpoint(it=it)
    path = ckpt.save(str(tmp_path / "c"))
    want = local(next(it))
    next(it)
    ckpt.restore(path).assert_consumed()
    assert local(next(it)) == want  # the same iterator, moved back
    other = make()
    train.Checkpoint(it=other).restore(path)
    assert local(next(other)) == want  # a new iterator over the same input, moved there


def test_an_iterator_over_a_one_pass_generator_cannot_be_replayed_silently(tmp_path):
    strategy = cudist.OneDeviceStrategy("/cpu:0")
    it = iter(strategy.experimental_distribute_dataset(np.arange(4.0) + i for i in range(6)))
    next(it)
    ckpt = train.Checkpoint(it=it)
    path = ckpt.save(str(tmp_path / "c"))
    after = np.asarray(next(it)).tolist()
    with pytest.raises(ValueError, match="one-pass Python iterator"):
        ckpt.restore(path)
    assert np.asarray(next(it)).tolist() == [v + 1 for v in after]  # nothing moved


@pytest.mark.parametrize("what", ["python", "tf1"])
def test_iterators_that_cannot_be_checkpointed_are_a_clear_error(what):
    import warnings

    strategy = cudist.OneDeviceStrategy("/cpu:0")
    if what == "python":
        it = iter([1, 2, 3])
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            it = strategy.make_dataset_iterator(data.Dataset.range(4).batch(2))
    # TF 2.21 raises the same for both: "`Checkpoint` was expecting it to be a trackable object".
    with pytest.raises(ValueError, match="`Checkpoint` was expecting it to be a trackable object"):
        train.Checkpoint(it=it)


@pytest.mark.gpu
def test_an_async_save_of_gpu_variables_keeps_the_values_of_the_call(tmp_path, monkeypatch):
    """On GPUs the capture is a device copy, moved to the host by the background thread."""
    from conftest import gpu0_split

    with gpu0_split(2, memory_limit=1024):
        strategy = cudist.MirroredStrategy(["/gpu:0", "/gpu:1"])
        with strategy.scope():
            w = cudist.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="w")
            opt = cudist.optimizers.SGD(0.1, momentum=0.9)

        def step():
            strategy.run(lambda: opt.apply_gradients([(np.ones((3, 4), np.float32), w)]))

        step()
        want = w.numpy()
        gate = threading.Event()
        monkeypatch.setattr(_format, "before_commit", lambda prefix: gate.wait(10))
        ckpt = train.Checkpoint(w=w, optimizer=opt)
        path = ckpt.save(str(tmp_path / "c"), options=ASYNC)
        step()
        step()
        gate.set()
        ckpt.sync()
        saved = _values(path)
        np.testing.assert_array_equal(saved["w"], want)
        assert not np.array_equal(w.numpy(), want)
