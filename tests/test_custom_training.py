"""examples/custom_training.py: TF's "Custom training with tf.distribute.Strategy" tutorial on cudist.

With the same global batch (and batches that split evenly), one device, N mirrored replicas and
central storage follow the same trajectory up to float summation order; so do the gradient
backends (JAX, autograd, NumPy) among themselves.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import EXAMPLES, load_example

# 480 training examples in global batches of 48 (every replica count here divides 48): 10 steps
# an epoch; 97 test examples leave a last test batch of 1, so most replicas get an empty batch.
SMALL = ["--train-examples", "480", "--test-examples", "97", "--epochs", "2", "--global-batch-size", "48",
         "--alternate-steps", "3", "--quiet"]
STRATEGIES = [("one_device", 1), ("mirrored", 2), ("mirrored", 3), ("central", 2)]


@pytest.fixture(scope="module")
def tutorial():
    return load_example("custom_training")


@pytest.fixture(autouse=True)
def _restore_logical_cpus():
    """The example may add logical CPUs (a process-wide setting); put the session's back."""
    from cudist import config

    cpu = config.list_physical_devices("CPU")[0]
    saved = config.get_logical_device_configuration(cpu)
    yield
    config.set_logical_device_configuration(cpu, saved)


def _run(tutorial, strategy, replicas, grad, *extra):
    return tutorial.main([*SMALL, "--strategy", strategy, "--replicas", str(replicas), "--grad", grad, *extra])


def _assert_same_trajectory(h, ref, where, rtol=2e-5):
    for key in ("step_losses", "iterator_losses", "function_losses", "loss", "test_loss"):
        np.testing.assert_allclose(h[key], ref[key], rtol=rtol, atol=0, err_msg=f"{where}: {key}")
    # Accuracies count examples; a float-level difference could flip a borderline one.
    np.testing.assert_allclose(h["train_accuracy"], ref["train_accuracy"], atol=2 / 480, err_msg=where)
    np.testing.assert_allclose(h["test_accuracy"], ref["test_accuracy"], atol=2 / 97, err_msg=where)


@pytest.mark.parametrize("grad", ["numpy", "jax"])
def test_same_trajectory_on_every_strategy(tutorial, grad):
    if grad != "numpy":
        pytest.importorskip(grad, reason=f"{grad} is in the test extra; not installed here")
    ref = _run(tutorial, "one_device", 1, grad)
    assert ref["grad"] == grad
    assert len(ref["step_losses"]) == 2 * 10 and len(ref["iterator_losses"]) == 3 and len(ref["function_losses"]) == 10
    assert all(np.isfinite(ref["step_losses"]))
    for strategy, replicas in STRATEGIES[1:]:
        h = _run(tutorial, strategy, replicas, grad)
        _assert_same_trajectory(h, ref, f"{strategy} x{replicas} vs one_device ({grad})")
        assert h["eval_accuracy"] == pytest.approx(ref["eval_accuracy"], abs=2 / 97)


def test_gradient_backends_agree(tutorial):
    ref = _run(tutorial, "mirrored", 2, "numpy")
    for grad in ("jax", "autograd", "torch"):
        if importlib.util.find_spec(grad) is None:
            continue  # jax and autograd are in the test extra; torch is not
        _assert_same_trajectory(_run(tutorial, "mirrored", 2, grad), ref, f"{grad} vs numpy", rtol=1e-4)


def test_trains_well_above_chance_and_restores_the_checkpoint(tutorial, tmp_path):
    h = tutorial.main(["--quiet", "--epochs", "3", "--checkpoint-dir", str(tmp_path)])  # 2 replicas, best backend
    assert h["train_seconds"] > 0  # how long is measured, not asserted: about 5 s here (README)
    assert h["loss"][-1] < 0.5 * h["loss"][0]
    assert h["test_accuracy"][-1] > 0.8  # 10 classes: chance is 0.1
    # Saved after epochs 1 and 3 (epoch % 2 == 0); the restored model, evaluated without a
    # strategy, scores what the trained one scored on the same test set after epoch 3.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".index.json")) == [
        "ckpt-1.index.json", "ckpt-2.index.json"]
    index = json.loads((tmp_path / "ckpt-2.index.json").read_text())
    assert {"model/kernel1", "optimizer/iterations"} <= set(index["objects"])
    assert h["eval_accuracy"] == pytest.approx(h["test_accuracy"][2], abs=1e-6)


def test_trajectory_depends_on_the_seed(tutorial):
    # Guards the agreement tests against comparing something that does not depend on training.
    a = _run(tutorial, "mirrored", 2, "numpy", "--seed", "1")
    b = _run(tutorial, "mirrored", 2, "numpy", "--seed", "2")
    assert not np.allclose(a["step_losses"], b["step_losses"], rtol=1e-3)


def test_bad_flags_exit_with_usage_error(tutorial, capsys):
    with pytest.raises(SystemExit) as e:
        tutorial.main(["--strategy", "one_device", "--replicas", "2"])
    assert e.value.code == 2 and "one_device" in capsys.readouterr().err


def test_script_runs_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "custom_training.py"), "--strategy", "central", "--grad", "numpy",
         "--epochs", "1", "--train-examples", "960", "--test-examples", "200", "--alternate-steps", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Number of devices: 2 (CentralStorageStrategy; gradients: numpy)" in proc.stdout
    assert sum(line.startswith("Epoch ") for line in proc.stdout.splitlines()) == 3  # the three loop styles
    assert "Accuracy after restoring the saved model without strategy" in proc.stdout


def _histories(stdout):
    """Every JSON history the workers printed (their lines may interleave: decode object by object)."""
    decoder, out, i = json.JSONDecoder(), [], stdout.find("{")
    while i != -1:
        obj, end = decoder.raw_decode(stdout, i)
        out.append(obj)
        i = stdout.find("{", end)
    return out


@pytest.mark.multi_worker
def test_multi_worker_follows_the_mirrored_trajectory(tutorial, tmp_path):
    """Under the launcher, 2 workers x 1 replica follow MirroredStrategy(2)'s trajectory; the chief
    writes the checkpoint and every worker restores it."""
    pytest.importorskip("mpi4py", reason="multi-worker jobs need MPI (pip install \".[mpi]\")")
    from cudist.launch import find_mpiexec

    if find_mpiexec() is None:
        pytest.skip("no mpiexec (pip install \".[mpi]\")")
    ref = _run(tutorial, "mirrored", 2, "numpy")
    cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", "--no-prefix", str(EXAMPLES / "custom_training.py"), *SMALL,
           "--strategy", "multi_worker", "--grad", "numpy", "--checkpoint-dir", str(tmp_path), "--history-json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    histories = _histories(p.stdout)
    assert len(histories) == 2, p.stdout[-2000:]
    for h in histories:
        _assert_same_trajectory(h, ref, "multi_worker 2x1 vs mirrored x2")
        assert h["eval_accuracy"] == pytest.approx(ref["eval_accuracy"], abs=2 / 97)
