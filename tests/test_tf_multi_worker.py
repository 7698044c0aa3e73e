"""Multi-worker parity with TensorFlow 2.21, against its recorded answers (issue #31).

``tools/tf_parity/multi_worker.py`` holds the scenarios (device names by task, each auto-shard policy on
``range`` datasets with partial batches, ``element_spec``, all-reduce/reduce/gather, the multi-worker
custom-training-loop tutorial's loop); ``tools/tf_parity/record.py`` ran them on TF 2.21 as two processes
on loopback with TF_CONFIG and wrote ``tests/data/tf_multi_worker.json``. Here the same script runs on
cudist under ``python -m cudist.launch -n 2 --tf-config`` and every answer must equal TF's: exactly,
except the training loop's floats (TF's oneDNN matmuls sum in another order: float32 rounding).
TensorFlow is never imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cudist import _devices

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "tf_parity" / "multi_worker.py"
RECORDED = json.loads((ROOT / "tests" / "data" / "tf_multi_worker.json").read_text())


def _mpi_missing():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install \".[mpi]\")"
    from cudist.launch import find_mpiexec

    return None if find_mpiexec() is not None else "no mpiexec (pip install mpich, or \".[mpi]\")"


MISSING = _mpi_missing()


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "CUDIST_CHECK_COLLECTIVES")}
    env.update(extra)
    return env


def _job(cmd, out, env):
    from test_multi_worker import _shm, _shm_left  # the MPI segments check of the other job tests

    before = _shm()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    left = _shm_left(before)
    assert not left, f"MPI shared-memory segments left in /dev/shm: {sorted(left)}"
    return [json.loads((out / f"w{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def cudist_answers(tmp_path_factory):
    """Both workers' answers from one 2-worker job of every scenario (a few seconds)."""
    if MISSING:
        pytest.skip(f"multi-worker jobs need MPI: {MISSING}")
    out = tmp_path_factory.mktemp("tf_mw")
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", "--tf-config", str(SCRIPT), "--backend", "cudist",
           "--out", str(out / "w{rank}.json")]
    return _job(cmd, out, _env())


def _local_devices_of(answer):
    """TF lists every task's devices after MultiWorkerMirroredStrategy starts; cudist this task's (porting guide)."""
    job, task = answer["task"]
    devices = dict(answer["devices"])
    devices["logical_devices"] = [d for d in devices["logical_devices"] if d.startswith(f"/job:{job}/replica:0/task:{task}/")]
    return devices


def test_the_recording_is_tf_2_21_with_devices_named_by_task():
    assert RECORDED["tensorflow"] == "2.21.0"
    for k, w in enumerate(RECORDED["workers"]):
        name = f"/job:worker/replica:0/task:{k}/device:CPU:0"
        assert w["task"] == ["worker", k]
        assert w["devices"]["worker_devices"] == w["devices"]["parameter_devices"] == [name]
        assert w["devices"]["variable_device"] == name
        assert len(w["devices"]["logical_devices"]) == 2 and _local_devices_of(w)["logical_devices"] == [name]
    assert [w["task"] for w in RECORDED["chief"]] == [["chief", 0], ["worker", 0]]
    assert RECORDED["chief"][0]["devices"]["variable_device"] == "/job:chief/replica:0/task:0/device:CPU:0"


SCENARIOS = ["devices", "shard", "element_spec", "reduce", "inputs"]

#: Answers where cudist deliberately differs (docs/guides/porting.md), with cudist's answer: pinned, so
#: that a change either way is seen. replica_id_in_sync_group is a Python int, and NumPy reduces
#: Python ints to int64 (TF's replica id is an int32 tensor).
KNOWN_DIFFERENCES = {("inputs", "reduce_of_replica_ids"): [1, "int64"]}


@pytest.mark.multi_worker
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("rank", [0, 1])
def test_multi_worker_answers_equal_tf(cudist_answers, scenario, rank):
    want, got = RECORDED["workers"][rank][scenario], cudist_answers[rank][scenario]
    if scenario == "devices":
        want = _local_devices_of(RECORDED["workers"][rank])
    assert sorted(got) == sorted(want)
    for (where, key), value in KNOWN_DIFFERENCES.items():
        if where == scenario:
            assert got[key] == value and want[key] != value, key
            want = dict(want, **{key: value})
    wrong = {k: {"tf": want[k], "cudist": got[k]} for k in want if got[k] != want[k]}
    assert not wrong, json.dumps(wrong, indent=1)[:4000]


@pytest.mark.multi_worker
@pytest.mark.parametrize("rank", [0, 1])
def test_multi_worker_ctl_tutorial_loop_equals_tf(cudist_answers, rank):
    """The tutorial's loop: every step's loss, each epoch's loss and accuracy, the trained weights, its checkpoints."""
    want, got = RECORDED["workers"][rank]["ctl"], cudist_answers[rank]["ctl"]
    np.testing.assert_allclose(got["step_losses"], want["step_losses"], rtol=2e-6)
    assert [e["train_accuracy"] for e in got["epochs"]] == [e["train_accuracy"] for e in want["epochs"]]
    np.testing.assert_allclose([e["train_loss"] for e in got["epochs"]], [e["train_loss"] for e in want["epochs"]], rtol=2e-6)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)
    # The tutorial's checkpoints: the names, the non-chief's temporary directory, what a restart restores.
    for key in ("latest_checkpoints", "temp_dir_left", "restored"):
        assert got[key] == want[key], key
    assert want["latest_checkpoints"] == ["ckpt-1", "ckpt-2"] and want["restored"]["kernel_equal"]
    c0, c1 = (dict(cudist_answers[r]["ctl"]) for r in (0, 1))
    assert c0.pop("temp_dir_left") is False and c1.pop("temp_dir_left") is True
    assert c0 == c1  # the workers agree bit for bit


@pytest.mark.multi_worker
def test_a_chief_and_a_worker_name_their_devices_by_job(tmp_path):
    """One TF_CONFIG cluster for both ranks (chief, worker): rank 0 is the chief, its devices /job:chief/..."""
    if MISSING:
        pytest.skip(f"multi-worker jobs need MPI: {MISSING}")
    from cudist.launch import find_mpiexec

    cluster = json.dumps({"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"]}})
    cmd = [find_mpiexec(), "-n", "2", sys.executable, str(SCRIPT), "--backend", "cudist", "--scenarios", "devices",
           "--out", str(tmp_path / "w{rank}.json")]
    got = _job(cmd, tmp_path, _env(TF_CONFIG=cluster))
    for rank in (0, 1):
        assert got[rank]["task"] == RECORDED["chief"][rank]["task"]
        assert got[rank]["devices"] == _local_devices_of(RECORDED["chief"][rank])


# ------------------------------------------------------------------ device names by task, in one process
@pytest.fixture
def worker_1():
    _devices.set_local_task("worker", 1)
    yield
    _devices.set_local_task(None)


def test_device_names_by_task_parse_and_compare_equal(worker_1):
    long = "/job:worker/replica:0/task:1/device:CPU:0"
    assert _devices.display_name("/job:localhost/replica:0/task:0/device:CPU:0") == long
    for spelling in (long, "/job:worker/task:1/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0",
                     "/cpu:0", "CPU:0", "/task:1/device:CPU:0"):
        assert _devices.canonicalize(spelling) == "/job:localhost/replica:0/task:0/device:CPU:0", spelling
    assert _devices.canonicalize("/job:worker/replica:0/task:1/device:GPU:1") == "/job:localhost/replica:0/task:0/device:GPU:1"
    for remote in ("/job:worker/replica:0/task:0/device:CPU:0", "/job:chief/replica:0/task:1/device:CPU:0",
                   "/job:worker/replica:1/task:1/device:CPU:0"):
        with pytest.raises(ValueError, match=r"names another task's device \(this process is /job:worker/replica:0/task:1\)"):
            _devices.canonicalize(remote)


def test_a_strategy_and_its_variables_show_the_task(worker_1):
    import cudist

    s = cudist.MirroredStrategy(["/cpu:0"])
    with s.scope():
        v = cudist.Variable(1.0)
    name = "/job:worker/replica:0/task:1/device:CPU:0"
    assert s.extended.worker_devices == s.extended.parameter_devices == (name,)
    assert v.device == name
    with s.scope(), s.extended.colocate_vars_with(v):  # a display name read back places as the canonical one
        w = cudist.Variable(2.0)
    assert w.device == name
    opt = cudist.optimizers.SGD(0.1, momentum=0.9)
    with s.scope():
        opt.build([v])
    assert {x.device for x in opt.variables} == {name}
    logical = cudist.config.list_logical_devices("CPU")
    assert logical[0].name == name and logical[-1].name.startswith("/job:worker/replica:0/task:1/device:CPU:")
    assert cudist.MirroredStrategy().extended.worker_devices == tuple(d.name for d in logical)  # its names parse


def test_outside_a_cluster_names_stay_localhost(monkeypatch):
    import cudist

    for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}}))
    with pytest.raises(RuntimeError, match="cudist.launch -n 2"):  # a cluster it could not join names nothing
        cudist.MultiWorkerMirroredStrategy()
    assert _devices.local_task() is None
    assert _devices.display_name("/job:localhost/replica:0/task:0/device:CPU:0") == "/job:localhost/replica:0/task:0/device:CPU:0"
    with pytest.raises(ValueError, match="invalid device"):
        _devices.canonicalize("/job:worker/replica:0/task:1/device:CPU:0")
