"""MultiWorkerMirroredStrategy: real 2-worker MPI jobs (``mpiexec -n 2``), and the pieces that need no MPI.

The jobs run ``tests/multi_worker_job.py``; each worker prints ``RESULT <rank> <json>`` and the tests
compare. Each job runs under a timeout; together they take a few seconds on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cudist
from cudist.cluster_resolver import (
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    id_in_cluster,
    is_chief,
    worker_count,
)

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "multi_worker_job.py")


def _mpi_missing():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install \".[mpi]\")"
    from cudist.launch import find_mpiexec

    if find_mpiexec() is None:
        return "no mpiexec (pip install mpich, or \".[mpi]\")"
    return None


MISSING = _mpi_missing()
needs_mpi = pytest.mark.skipif(MISSING is not None, reason=f"multi-worker jobs need MPI: {MISSING}")


def _shm():
    return {p.name for p in Path("/dev/shm").glob("mpich_shm_*")} if Path("/dev/shm").is_dir() else set()


#: What the launcher says of worker 1 killed on purpose: named (by the order the processes ended, not
#: only by mpiexec's report, which under load may name a worker it killed after), with how it ended
#: (unknown when mpiexec named another and the ended process was reaped before /proc was read).
_KILLED_WORKER_1 = r"worker 1 \(pid \d+\) ended abnormally \((killed by SIGKILL|exit status unknown)\)"


def _mapped_shm():
    """The MPICH segments some live process maps (those of jobs still running, here or beside us)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        mapped.update(m.rsplit("/", 1)[1] for m in re.findall(r"/dev/shm/mpich_shm_\S+", text))
    return mapped


def _shm_left(before):
    """Segments new since ``before`` and mapped by no live process, looked at until they persist for 2 s.

    A job running beside us (another test run on this machine) has its segments in /dev/shm for a
    moment before it maps them, and after it unmapped them before it removes them: such a segment
    vanishes or becomes mapped within that time; a leaked one stays.
    """
    deadline = time.monotonic() + 2
    while True:
        left = _shm() - before - _mapped_shm()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture
def no_shm_left():
    before = _shm()
    yield
    # Left = new and mapped by no live process: a job started meanwhile by another test run on this
    # machine holds its segments mapped, and removes them itself.
    left = _shm_left(before)
    assert not left, f"MPI shared-memory segments left in /dev/shm: {sorted(left)}"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "CUDIST_CHECK_COLLECTIVES")}
    env.update(extra)
    return env


def _mpiexec(*args, timeout=90):
    from cudist.launch import find_mpiexec

    cmd = [find_mpiexec(), "-n", "2", sys.executable, JOB, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=HERE)


def _launch(*args, timeout=60, flags=(), env=None):
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", *flags, JOB, *args]
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(**(env or {})), cwd=HERE)
    return p, time.monotonic() - start


def _results(proc, n=2):
    """``{rank: result}`` from the job's ``RESULT <rank> <json>`` lines, one for each of the ``n`` workers."""
    out = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"(?:\[\d+\] )?RESULT (\d+) (.*)$", line)  # the launcher's "[rank] " in front, or not
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(out) == list(range(n)), f"missing worker results:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


# ---------------------------------------------------------------------------------------------- jobs
@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("local_replicas", [1, 2], ids=["2x1-bit-exact", "2x2-tolerance"])
def test_parity_with_mirrored_strategy(local_replicas, no_shm_left):
    """run+all_reduce, reduce, gather, variables, optimizers, datasets (each policy), from_function, debug mode."""
    proc = _mpiexec("parity", str(local_replicas))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = _results(proc)
    failed = {f"worker {r}: {name}": detail for r, res in results.items() for name, (ok, detail) in res.items() if not ok}
    assert not failed, failed
    assert len(results[0]) >= 45  # every check ran



@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("local_replicas", [1, 2], ids=["2x1", "2x2"])
def test_bfloat16_and_loss_scaling_across_workers(local_replicas, no_shm_left):
    """bfloat16 all-reduce / reduce bit for bit as a MirroredStrategy over every replica in worker order
    (also 2x2, where summing per worker first would differ); bf16 gradients into float32 variables;
    LossScaleOptimizer with an inf/NaN on one worker only: every worker skips the same steps;
    CommunicationOptions(compression=bfloat16 / float16) within its documented error bound."""
    pytest.importorskip("ml_dtypes")
    proc = _mpiexec("mixed", str(local_replicas))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = _results(proc)
    failed = {f"worker {r}: {name}": detail for r, res in results.items()
              for name, (ok, detail) in res["results"].items() if not ok}
    assert not failed, failed
    assert len(results[0]["results"]) == 21  # every check ran
    assert results[0]["trace"] == results[1]["trace"]  # same scale and inner iterations on both workers
    assert results[0]["squeezed"] == results[1]["squeezed"]  # compressed sums: the same bits on both workers

def _ready_time(proc, started):
    """When the first worker had its strategy (the output of a worker that was killed may be lost)."""
    times = [float(t) for t in re.findall(r"READY \d ([0-9.]+)", proc.stdout)]
    return min(times) if times else started


@needs_mpi
@pytest.mark.multi_worker
def test_a_worker_that_raises_ends_the_job(no_shm_left):
    started = time.time()
    proc, _ = _launch("raise")
    end = time.time()
    assert proc.returncode != 0
    assert "UNREACHABLE" not in proc.stdout
    assert end - _ready_time(proc, started) < 5
    assert "worker 1 raised ZeroDivisionError: worker 1 fails on purpose" in proc.stderr, proc.stderr[-2000:]


@needs_mpi
@pytest.mark.multi_worker
def test_a_killed_worker_ends_the_job(no_shm_left):
    started = time.time()
    proc, _ = _launch("kill")
    end = time.time()
    assert proc.returncode != 0
    assert end - _ready_time(proc, started) < 5
    assert re.search(_KILLED_WORKER_1, proc.stderr), proc.stderr[-2000:]


@needs_mpi
@pytest.mark.multi_worker
def test_a_hung_worker_times_out(no_shm_left):
    """timeout_seconds=2: worker 0 raises DeadlineExceededError naming worker 1; the job ends by timeout + 5 s.

    The stall warning (after 60 s by default; 1 s here) names the missing worker first.
    """
    started = time.time()
    proc, _ = _launch("hang", env={"CUDIST_STALL_WARNING_SECONDS": "1"})
    end = time.time()
    assert proc.returncode != 0
    assert end - _ready_time(proc, started) < 2 + 5
    assert "DeadlineExceededError" in proc.stderr
    assert "worker(s) [1] did not join it" in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"CollectiveStallWarning: cudist: worker 0 has waited 1 s in all_reduce SUM, collective #\d+, "
                     r"for worker\(s\) \[1\]", proc.stderr), proc.stderr[-2000:]


#: How each way for worker 1 to end is named (by the launcher's summary, or by the worker itself).
_EXITS = {
    "early": "worker 1 raised ZeroDivisionError: worker 1 fails before its strategy",
    "alone": "worker 1 raised ValueError: this process is one of the 2 processes of an MPI job, but its cluster",
    "exit3": "worker 1 exited with code 3",
    "exit0": "worker 1 ended while worker(s) [0] wait in collective #",
    "return": "worker 1 ended while worker(s) [0] wait in collective #",
    "term": "worker 1 (pid ",
    "os_exit0": "worker 1 (pid ",
}


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("mode", sorted(_EXITS))
def test_a_worker_ending_any_way_ends_the_job_naming_it(mode, no_shm_left):
    """A worker that ends without the strategy's exception hook seeing it (before the strategy, a
    one-worker TF_CONFIG, sys.exit(n), the end of its script, a signal), while worker 0 waits for
    it in a collective, ends the job within seconds (it used to hang forever), named."""
    started = time.time()
    proc, took = _launch(f"exit:{mode}", timeout=60)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert took < 15
    assert "UNREACHABLE" not in proc.stdout
    assert _EXITS[mode] in proc.stderr, proc.stderr[-2000:]
    if mode == "exit3":
        assert proc.returncode == 3
    if mode == "term":
        assert re.search(r"worker 1 \(pid \d+\) ended abnormally \((killed by SIGTERM|exit status unknown|exit code 15)\)",
                         proc.stderr), proc.stderr[-2000:]
    assert time.time() - _ready_time(proc, started) < 10


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("mode", ["early", "return", "exit3"])
def test_a_worker_ending_under_plain_mpiexec_ends_the_job(mode, no_shm_left):
    """The same without the launcher (mpiexec -n 2 python script.py): the worker says why."""
    proc = _mpiexec(f"exit:{mode}", timeout=60)
    assert proc.returncode != 0
    assert "UNREACHABLE" not in proc.stdout
    said = {
        "early": "cudist: worker 1 of 2 raised ZeroDivisionError; aborting every worker of the job",
        "return": "cudist: worker 1 of 2 is ending (its script returned or called sys.exit) while worker(s) [0] "
                  "wait in collective #",
        "exit3": "cudist: worker 1 of 2 is ending (its script returned or called sys.exit) while worker(s) [0] "
                 "wait in collective #",
    }[mode]
    assert said in proc.stderr, proc.stderr[-2000:]


@needs_mpi
@pytest.mark.multi_worker
def test_a_worker_ending_first_with_nothing_owed_is_fine(no_shm_left):
    """Worker 1 ends while worker 0 still works (no collective): the job succeeds, both finish."""
    proc, _ = _launch("exit:finish", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FINISHED 0" in proc.stdout
    proc = _mpiexec("exit:finish", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FINISHED 0" in proc.stdout


def test_the_early_hook_knows_the_launchers_variables(monkeypatch):
    """``import cudist``'s early abort hook and the strategy share one test of "started by mpiexec"."""
    from cudist import _settings

    for k in _settings.MPI_LAUNCHER_ENV:
        monkeypatch.delenv(k, raising=False)
    assert not _settings.launched_by_mpi()
    for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.setenv(k, "1")
        assert _settings.launched_by_mpi(), k
        monkeypatch.delenv(k)


@needs_mpi
@pytest.mark.multi_worker
def test_checkpoints_with_a_metric_are_right_when_every_worker_saves(tmp_path, no_shm_left):
    """As the README (and TF) say: every worker calls save; the chief alone writes."""
    proc, _ = _launch("checkpoint", "all", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = _results(proc)
    for r in (0, 1):
        assert res[r]["steps"] == [2.0, 2.0]
        assert res[r]["after_two"] == 1.5  # (1 + 2 + 1 + 2) / 4 over the job
        assert res[r]["restored"] == 1.5  # the job's metric at the save, on every worker
    assert res[0]["files"] == res[1]["files"] and "checkpoint" in res[0]["files"]


@needs_mpi
@pytest.mark.multi_worker
def test_checkpoints_as_tf_multi_worker_tutorial(tmp_path, no_shm_left):
    """TF 2.21's tutorial: every worker saves through a CheckpointManager, a non-chief into
    workertemp_<id>/ckpt, which it then removes (shutil.rmtree: the directory must exist)."""
    proc, _ = _launch("checkpoint", "tutorial", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = _results(proc)
    for r in (0, 1):
        assert res[r]["steps"] == [2.0, 2.0] and res[r]["restored"] == 1.5
    assert "workertemp_1" in res[0]["files"] and "checkpoint" in res[0]["files"]
    assert os.listdir(tmp_path / "workertemp_1") == []  # removed by worker 1, nothing else left


@needs_mpi
@pytest.mark.multi_worker
def test_a_checkpoint_saved_by_the_chief_alone_is_an_error_not_a_wrong_value(tmp_path, no_shm_left):
    """The chief's metric read used to pair with worker 1's next all-reduce: worker 1 got 3.0, not
    2.0, and the saved metric was wrong. Now the default collective check refuses it on both."""
    proc, took = _launch("checkpoint", "chief", str(tmp_path))
    assert proc.returncode != 0
    assert took < 20
    errors = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("error-*.json"))]
    assert errors and all(e["error"] == "ReplicaMismatchError" for e in errors), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "reduce SUM" in errors[0]["message"] and "all_reduce SUM" in errors[0]["message"]
    assert "steps" not in proc.stdout


def _processes_marked(mark):
    """Pids of the live processes whose environment holds ``CUDIST_TEST_MARK=<mark>`` (the launcher,
    mpiexec, its proxy and the workers of one test's job)."""
    found = []
    needle = f"CUDIST_TEST_MARK={mark}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") and (d / "stat").read_text().split(") ")[1][0] != "Z":
                found.append(int(d.name))
        except (OSError, IndexError):
            pass
    return found


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("target", ["launcher", "group"])
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signalled_launcher_ends_the_job_and_cleans_up(signame, target, no_shm_left):
    """SIGTERM/SIGINT to the launcher alone, or to its process group (as `timeout` and a terminal's
    Ctrl-C send them), ends mpiexec, its proxy and the workers, leaves nothing in /dev/shm, and the
    launcher exits 128 + the signal's number."""
    import signal

    sig = getattr(signal, signame)
    mark = f"{os.getpid()}-{signame}-{target}"
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", JOB, "steps"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
                         env=_env(CUDIST_TEST_MARK=mark), start_new_session=True)
    try:
        assert "READY" in p.stdout.readline()
        assert len(_processes_marked(mark)) >= 4  # the launcher, mpiexec, the proxy, two workers
        time.sleep(0.3)
        started = time.monotonic()
        if target == "launcher":
            os.kill(p.pid, sig)
        else:
            os.killpg(p.pid, sig)
        code = p.wait(timeout=20)
        took = time.monotonic() - started
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        p.stdout.close()
        p.stderr.close()
    assert code == 128 + sig, err[-2000:]
    assert took < 10
    assert f"cudist.launch: received {signame}; the job of 2 worker(s) was ended" in err
    deadline = time.monotonic() + 5
    while _processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_marked(mark), "processes of the job outlived the launcher"


def test_launcher_refuses_a_missing_mpiexec_in_one_line(tmp_path):
    for bad in ("/nonexistent/mpiexec", str(tmp_path)):
        p = subprocess.run([sys.executable, "-m", "cudist.launch", "-n", "2", "--mpiexec", bad, JOB, "steps"],
                           capture_output=True, text=True, timeout=60, env=_env())
        assert p.returncode == 127
        assert p.stderr == f"cudist.launch: --mpiexec {bad}: not an executable file\n"


@needs_mpi
@pytest.mark.multi_worker
def test_launcher_writes_tf_config(no_shm_left):
    proc, _ = _launch("tfconfig", flags=("--tf-config",))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = _results(proc)
    for rank in (0, 1):
        assert res[rank] == {
            "rank": rank, "resolver": "TFConfigClusterResolver", "task": ["worker", rank], "workers": 2,
            "chief": rank == 0, "sum": 3.0,
        }


@needs_mpi
@pytest.mark.multi_worker
def test_one_tf_config_for_all_ranks_maps_tasks_to_ranks(no_shm_left):
    """A TF_CONFIG with a cluster but no task (as a scheduler may set one for all): task k is rank k."""
    cluster = {"chief": ["host0:2222"], "worker": ["host1:2222"]}
    from cudist.launch import find_mpiexec

    cmd = [find_mpiexec(), "-n", "2", sys.executable, JOB, "tfconfig"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=HERE,
                       env=_env(TF_CONFIG=json.dumps({"cluster": cluster})))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = _results(p)
    assert res[0]["resolver"] == res[1]["resolver"] == "MPIClusterResolver"
    assert [res[0]["task"], res[1]["task"]] == [["chief", 0], ["worker", 0]]
    assert [res[0]["chief"], res[1]["chief"]] == [True, False] and res[0]["sum"] == 3.0


@needs_mpi
@pytest.mark.multi_worker
def test_two_processes_claiming_one_task_are_refused(no_shm_left):
    tf_config = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}
    from cudist.launch import find_mpiexec

    cmd = [find_mpiexec(), "-n", "2", sys.executable, JOB, "tfconfig"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=HERE,
                       env=_env(TF_CONFIG=json.dumps(tf_config)))
    assert p.returncode != 0
    assert "claim worker ids [0, 0]" in p.stderr, p.stderr[-2000:]


@needs_mpi
@pytest.mark.multi_worker
def test_example_trains_multi_worker(no_shm_left):
    """examples/train_mlp.py --strategy multi_worker under the launcher: both workers end with the same loss."""
    example = HERE.parent / "examples" / "train_mlp.py"
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", str(example), "--strategy", "multi_worker",
           "--epochs", "2", "--train-examples", "512", "--test-examples", "128", "--batch-size", "64"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=HERE.parent)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = re.findall(r"worker (\d) of 2 final loss ([0-9.]+)", p.stdout)
    assert sorted(w for w, _ in losses) == ["0", "1"], p.stdout[-2000:]
    assert losses[0][1] == losses[1][1]


def _emulated_gpus_env(devices, **extra):
    """The environment of a job on the CuPy emulation (tests/emu/fakecupy) with ``devices`` GPUs per
    worker (mpiexec hands it to every worker); skips without a C++ compiler to build the emulation."""
    sys.path.insert(0, str(HERE / "emu"))
    try:
        import build  # noqa: PLC0415 - tests/emu/build.py
    finally:
        sys.path.pop(0)
    if build.compiler() is None:
        pytest.skip("no C++ compiler: the CUDA emulation cannot be built")
    env = _env()
    for k in ("CUDIST_BACKEND", "CUDIST_EMU_MODE", "CUDIST_EMU_NCCL", "CUDIST_EMU_NCCL_FAIL"):
        env.pop(k, None)
    env.update(CUDIST_EMU_DEVICES=str(devices), CUDIST_EMU_PEER="all", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "emu" / "fakecupy"), *filter(None, [env.get("PYTHONPATH")])])
    return env


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("gpus_per_worker", [1, 2], ids=["2x1-bit-exact", "2x2-tolerance"])
def test_nccl_across_workers_under_the_cupy_emulation(gpus_per_worker, no_shm_left):
    """CommunicationImplementation.NCCL: 2 workers x R emulated GPUs against a MirroredStrategy over 2R GPUs.

    all_reduce SUM/MEAN of every NCCL dtype (bit-exact for 2x1: a copy, then NCCL's one addition,
    as MirroredStrategy's; within float tolerance for 2x2: (g0 + g1) + (g2 + g3) against
    ((g0 + g1) + g2) + g3), nests mixing host values (over MPI) and GPU values, bytes_per_pack,
    reduce, SGD-momentum and Adam steps; the fake NCCL counts one cross-process call per packed
    buffer; RING does not use NCCL; mismatched calls are a ReplicaMismatchError (debug mode) or an
    InternalError naming the worker (the fake NCCL refuses mismatched counts where a GPU would hang).
    """
    env = _emulated_gpus_env(2 * gpus_per_worker)
    from cudist.launch import find_mpiexec

    cmd = [find_mpiexec(), "-n", "2", sys.executable, JOB, "nccl", str(gpus_per_worker)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = _results(p)
    failed = {f"worker {r}: {k}": d for r, rr in res.items() for k, (ok, d) in rr.items() if not ok}
    assert not failed, failed
    assert len(res[0]) == 44  # every check ran


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("mode", ["nccl_raise", "nccl_kill", "nccl_fail", "nccl_hang"])
def test_nccl_failures_end_the_job(mode, no_shm_left):
    """No hang inside NCCL: worker 1 raising while worker 0 waits in an NCCL all-reduce ends the job
    (abort hook), so does worker 1 being killed then (the launcher); an NCCL error in worker 1 (asynchronous, the fake's CUDIST_EMU_NCCL_FAIL) is an
    InternalError naming it; worker 1 hanging makes worker 0's NCCL wait time out (timeout_seconds=2)
    naming worker 1, after the stall warning (1 s here). Each ends within timeout + 5 s."""
    env = _emulated_gpus_env(1, CUDIST_STALL_WARNING_SECONDS="1")
    if mode == "nccl_fail":
        env["CUDIST_EMU_NCCL_FAIL"] = "1"
    started = time.time()
    p = subprocess.run([sys.executable, "-m", "cudist.launch", "-n", "2", JOB, mode], capture_output=True, text=True,
                       timeout=120, env=env, cwd=HERE)
    end = time.time()
    assert p.returncode != 0
    assert "UNREACHABLE" not in p.stdout
    assert end - _ready_time(p, started) < (2 if mode == "nccl_hang" else 0) + 5
    if mode == "nccl_raise":
        assert "worker 1 raised ZeroDivisionError: worker 1 fails on purpose" in p.stderr, p.stderr[-2000:]
    elif mode == "nccl_kill":
        assert re.search(_KILLED_WORKER_1, p.stderr), p.stderr[-2000:]
    elif mode == "nccl_fail":
        assert ("InternalError: cudist: worker 1 of 2 (GPU 0): NCCL all_reduce SUM failed: NcclError: "
                "NCCL_ERROR_SYSTEM_ERROR") in p.stderr, p.stderr[-2000:]
        assert "worker 1 raised InternalError" in p.stderr
    else:
        assert ("DeadlineExceededError: cudist: worker 0 of 2 timed out after 2 s (CommunicationOptions.timeout_seconds) "
                "in all_reduce SUM (NCCL)") in p.stderr, p.stderr[-2000:]
        assert "worker(s) [1] did not join it" in p.stderr
        assert re.search(r"CollectiveStallWarning: cudist: worker 0 has waited 1 s in all_reduce SUM \(NCCL\), "
                         r"collective #\d+, for worker\(s\) \[1\]", p.stderr), p.stderr[-2000:]


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("nccl_loads", [True, False], ids=["nccl", "no-nccl"])
def test_auto_picks_nccl_for_gpus_when_it_loads(nccl_loads, no_shm_left):
    """AUTO (the default) on GPU workers: NCCL when CuPy loads it (as TF picks NCCL for GPU
    all-reduces), else MPI with the GPU values staged through the host; the same result either way."""
    env = _emulated_gpus_env(1)
    if not nccl_loads:
        env["CUDIST_EMU_NCCL"] = "0"
    from cudist.launch import find_mpiexec

    p = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, JOB, "nccl_auto"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=HERE)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = _results(p)
    for r in (0, 1):
        assert res[r] == {"implementation": "NCCL" if nccl_loads else "MPI", "sum": [3.0, 3.0, 3.0], "on_gpu": True}


def test_nccl_requested_but_not_loadable_names_the_package():
    """CommunicationImplementation.NCCL with GPUs whose CuPy cannot load NCCL: an error saying what to install."""
    env = _emulated_gpus_env(1, CUDIST_EMU_NCCL="0")
    env = {k: v for k, v in env.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_"))}
    code = (
        "import cudist\n"
        "CO, CI = cudist.experimental.CommunicationOptions, cudist.experimental.CommunicationImplementation\n"
        "try:\n"
        "    cudist.MultiWorkerMirroredStrategy(communication_options=CO(implementation=CI.NCCL), devices=['/gpu:0'])\n"
        "except RuntimeError as e:\n"
        "    print(f'{type(e).__name__}: {e}')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=HERE)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("BackendUnavailableError: MultiWorkerMirroredStrategy: CommunicationImplementation.NCCL"), p.stdout
    assert "pip install nvidia-nccl-cu" in p.stdout and "CommunicationImplementation.RING" in p.stdout, p.stdout


@needs_mpi
@pytest.mark.multi_worker
def test_fake_nccl_refuses_ranks_with_different_unique_ids(no_shm_left):
    """The fake's get_unique_id() is random per call: a job that forgets to broadcast it fails at
    init (real NCCL would hang), so the strategy's broadcast over MPI is really tested."""
    env = _emulated_gpus_env(1)
    code = (
        "from mpi4py import MPI\n"
        "from cupy.cuda import nccl\n"
        "rank, said = MPI.COMM_WORLD.Get_rank(), 'accepted'\n"
        "try:\n"
        "    nccl.NcclCommunicator(2, nccl.get_unique_id(), rank)\n"
        "except nccl.NcclError as e:\n"
        "    said = f'REFUSED {rank} {e}'\n"
        "said = MPI.COMM_WORLD.gather(said, root=0)\n"  # one process prints: no interleaved lines
        "print('\\n'.join(said) if rank == 0 else '', flush=True)\n"
    )
    from cudist.launch import find_mpiexec

    p = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=env, cwd=HERE)
    assert p.returncode == 0, p.stderr[-2000:]
    refused = re.findall(r"^REFUSED (\d) (.*)$", p.stdout, re.M)
    assert sorted(r for r, _ in refused) == ["0", "1"], p.stdout[-2000:]
    assert all("joined with another unique id" in msg for _, msg in refused), refused


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.heavy
def test_gpu_workers_under_the_cupy_emulation(no_shm_left):
    """2 workers x 2 emulated GPUs (tests/emu/fakecupy) against a MirroredStrategy over 4 GPUs (AUTO: NCCL)."""
    env = _emulated_gpus_env(4)
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", JOB, "gpu"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = _results(p)
    failed = {f"worker {r}: {k}": d for r, rr in res.items() for k, (ok, d) in rr.items() if not ok}
    assert not failed, failed
    assert len(res[0]) == 6


# ---------------------------------------------------------------------------------------------- one process
def test_plain_python_is_one_worker_without_mpi():
    code = (
        "import sys, numpy as np, cudist\n"
        "s = cudist.MultiWorkerMirroredStrategy()\n"
        "out = s.run(lambda: cudist.get_replica_context().all_reduce('sum', np.ones(3, np.float32)))\n"
        "assert s.num_replicas_in_sync == 1 and s.extended.should_checkpoint and out.tolist() == [1, 1, 1]\n"
        "assert 'mpi4py' not in sys.modules, 'a one-worker job must not load MPI'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in _env().items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_"))}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_import_does_not_load_mpi():
    code = "import sys, cudist, cudist.experimental, cudist.cluster_resolver; print('mpi4py' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert p.stdout.strip() == "False", p.stderr


def test_one_worker_matches_mirrored_strategy():
    s = cudist.MultiWorkerMirroredStrategy()
    assert s.extended._num_workers == 1 and s.extended.experimental_should_init
    with s.scope():
        v = cudist.Variable(np.arange(3, dtype=np.float32))
    opt = cudist.optimizers.SGD(0.5)
    s.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), v)]))
    np.testing.assert_array_equal(v.numpy(), np.arange(3, dtype=np.float32) - 0.5)
    assert cudist.experimental.MultiWorkerMirroredStrategy is cudist.MultiWorkerMirroredStrategy


def test_tf_config_cluster_without_launcher_is_refused(monkeypatch):
    for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}
    ))
    with pytest.raises(RuntimeError, match="cudist.launch -n 2"):
        cudist.MultiWorkerMirroredStrategy()


def test_communication_options():
    CO, CI = cudist.experimental.CommunicationOptions, cudist.experimental.CommunicationImplementation
    o = CO(bytes_per_pack=1 << 20, timeout_seconds=5, implementation="ring")
    assert (o.bytes_per_pack, o.timeout_seconds, o.implementation) == (1 << 20, 5, CI.RING)
    with pytest.raises(ValueError, match="bytes_per_pack"):
        CO(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="implementation"):
        CO(implementation="gloo")
    with pytest.raises(ValueError, match="NCCL"):
        cudist.MultiWorkerMirroredStrategy(communication_options=CO(implementation=CI.NCCL))
    with pytest.raises(ValueError, match="communication_options"):
        cudist.MultiWorkerMirroredStrategy(communication_options={"bytes_per_pack": 1})


def test_communication_options_compression():
    """cudist's ``compression`` field: off by default, Horovod's / torch's spellings, merged like the others."""
    CO = cudist.experimental.CommunicationOptions
    assert CO().compression is None and CO(compression="none").compression is None
    assert "compression" not in repr(CO())  # TF's repr while it is off
    for spelling, name in (("bfloat16", "bfloat16"), ("BF16", "bfloat16"), ("float16", "float16"), ("fp16", "float16")):
        assert CO(compression=spelling).compression == name
    assert repr(CO(compression="bf16")).endswith("compression='bfloat16')")
    assert CO(compression="fp16") == CO(compression="float16") != CO()
    assert CO(bytes_per_pack=64).merge(CO(compression="bf16")).compression == "bfloat16"
    assert CO(compression="fp16").merge(CO(bytes_per_pack=8)).compression == "float16"
    for bad in ("float32", "int8", 16, True):
        with pytest.raises(ValueError, match="compression.*'bfloat16'"):
            CO(compression=bad)
    # One worker: no wire, so nothing is compressed (the local sum is exact float32).
    s = cudist.MultiWorkerMirroredStrategy(communication_options=CO(compression="bf16"), devices=["/cpu:0", "/cpu:1"])
    vals = [np.float32(1) + np.float32(2.0**-20), np.float32(3)]
    out = s.run(lambda: cudist.get_replica_context().all_reduce("sum", vals[cudist.get_replica_context().replica_id_in_sync_group]))
    assert [float(x) for x in s.experimental_local_results(out)] == [float(vals[0] + vals[1])] * 2


def test_cluster_spec_and_chief_rules():
    spec = ClusterSpec({"chief": ["h0:1"], "worker": ["h1:1", "h2:1"], "ps": {3: "p:1"}})
    assert spec.jobs == ["chief", "worker", "ps"] and spec.num_tasks("worker") == 2
    assert spec.task_address("worker", 1) == "h2:1" and spec.task_indices("ps") == [3]
    assert spec.as_dict()["ps"] == {3: "p:1"} and ClusterSpec(spec) == spec
    assert is_chief(spec, "chief", 0) and not is_chief(spec, "worker", 0)
    assert worker_count(spec, "worker") == 3
    assert [id_in_cluster(spec, "chief", 0), id_in_cluster(spec, "worker", 0), id_in_cluster(spec, "worker", 1)] == [0, 1, 2]
    no_chief = {"worker": ["a:1", "b:1"]}
    assert is_chief(no_chief, "worker", 0) and not is_chief(no_chief, "worker", 1)
    with pytest.raises(ValueError, match="task_id"):
        is_chief(no_chief, "worker", 2)
    with pytest.raises(ValueError, match="at most one 'chief'"):
        is_chief({"chief": ["a", "b"]}, "chief", 0)


def test_tf_config_resolver(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]},
        "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc",
    }))
    r = TFConfigClusterResolver()
    assert (r.task_type, r.task_id, r.rpc_layer) == ("worker", 1, "grpc")
    assert r.cluster_spec().as_dict() == {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]}
    assert r.master() == "grpc://w1:2222" and r.master("chief", 0, rpc_layer="") == "grpc://c:2222"
    r.task_type, r.task_id = "chief", 0
    assert r.master() == "grpc://c:2222"
    s = SimpleClusterResolver(ClusterSpec({"worker": ["a:1"]}), master="a:1", task_type="worker", task_id=0,
                              num_accelerators={"GPU": 2})
    assert s.num_accelerators() == {"GPU": 2} and s.master() == "a:1" and s.environment == ""


@pytest.mark.parametrize("value,mode", [(None, "quick"), ("", "quick"), ("1", "full"), ("yes", "full"),
                                        ("0", "off"), ("off", "off"), ("False", "off")])
def test_collective_checks_are_on_by_default(monkeypatch, value, mode):
    from cudist._dataplane.transports import mpi

    if value is None:
        monkeypatch.delenv("CUDIST_CHECK_COLLECTIVES", raising=False)
    else:
        monkeypatch.setenv("CUDIST_CHECK_COLLECTIVES", value)
    assert mpi.check_mode() == mode


@needs_mpi
@pytest.mark.multi_worker
def test_launcher_prefixes_worker_lines_and_writes_one_log_per_worker(tmp_path, no_shm_left):
    """torchrun's --log-dir: each worker's output in DIR/worker-<rank>.log (untagged); on the console
    each worker's lines carry its rank ("[1] "), stdout and stderr, unless --no-prefix."""
    logs = tmp_path / "logs"
    proc, _ = _launch("tfconfig", flags=("--log-dir", str(logs)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in logs.iterdir()) == ["worker-0.log", "worker-1.log"]
    # The job's rank 0 prints every worker's RESULT line (tests/multi_worker_job.py's report).
    lines = (logs / "worker-0.log").read_text().splitlines()
    assert [ln.split(" ", 2)[:2] for ln in lines if ln.startswith("RESULT")] == [["RESULT", "0"], ["RESULT", "1"]]
    assert "RESULT" not in (logs / "worker-1.log").read_text()
    assert "[0] RESULT 0 " in proc.stdout and "[0] RESULT 1 " in proc.stdout
    assert _results(proc)[1]["rank"] == 1
    plain, _ = _launch("tfconfig", flags=("--no-prefix",))
    assert plain.returncode == 0 and not re.search(r"^\[\d\] ", plain.stdout, re.M), plain.stdout[-1000:]
    bad = tmp_path / "file"
    bad.write_text("x")
    refused, _ = _launch("tfconfig", flags=("--log-dir", str(bad / "sub")))
    assert refused.returncode == 2 and "--log-dir" in refused.stderr and "RESULT" not in refused.stdout
