"""The examples run and train for real: examples/train_mlp.py.

Data parallelism with a loss scaled by the global batch size is exact up to summation order, so
one device, N mirrored replicas and central storage must follow the same loss trajectory.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import EXAMPLES, TRAIN_MLP_SMALL as SMALL


@pytest.fixture(autouse=True)
def _restore_logical_cpus():
    """The example may add logical CPUs (a process-wide setting); put the session's back."""
    from cudist import config

    cpu = config.list_physical_devices("CPU")[0]
    saved = config.get_logical_device_configuration(cpu)
    yield
    config.set_logical_device_configuration(cpu, saved)


def _run(train_mlp, *argv):
    return train_mlp.main([*SMALL, *argv])


def test_training_reduces_loss_and_reaches_high_accuracy(train_mlp):
    h = train_mlp.main(["--strategy", "mirrored", "--replicas", "2", "--epochs", "3", "--quiet"])
    steps = np.array(h["step_losses"])
    assert len(h["loss"]) == len(h["accuracy"]) == len(h["test_accuracy"]) == 3
    assert len(steps) == 3 * (2048 // 64)
    # Untrained, the 4-class cross-entropy is at least about ln 4 = 1.39; trained, far below.
    assert steps[0] > 1.0
    assert steps[-8:].mean() < 0.25 * steps[:8].mean()
    assert h["loss"][-1] < h["loss"][0]
    assert h["accuracy"][-1] > 0.9 and h["test_accuracy"][-1] > 0.9
    assert h["test_loss"][-1] < 0.3
    assert all(np.isfinite(steps))
    assert len(h["step_seconds"]) == len(steps) and all(t > 0 for t in h["step_seconds"])


@pytest.mark.parametrize(
    "dtype, optimizer, rtol",
    [("float32", "momentum", 2e-5), ("float32", "adam", 2e-5), ("float64", "momentum", 1e-12)],
)
def test_trajectories_agree_across_strategies(train_mlp, dtype, optimizer, rtol):
    ref = _run(train_mlp, "--strategy", "one_device", "--dtype", dtype, "--optimizer", optimizer)
    ref_steps = np.array(ref["step_losses"])
    assert len(ref_steps) == 2 * (512 // 64)
    for strategy, replicas in [("mirrored", 2), ("mirrored", 3), ("mirrored", 4), ("central", 2)]:
        flags = ["--strategy", strategy, "--replicas", str(replicas), "--dtype", dtype, "--optimizer", optimizer]
        h = _run(train_mlp, *flags)
        where = f"{strategy} x{replicas} vs one_device ({dtype}, {optimizer})"
        np.testing.assert_allclose(h["step_losses"], ref_steps, rtol=rtol, atol=0, err_msg=where)
        np.testing.assert_allclose(h["loss"], ref["loss"], rtol=rtol, atol=0, err_msg=where)
        np.testing.assert_allclose(h["test_loss"], ref["test_loss"], rtol=rtol, atol=0, err_msg=where)
        # Accuracies are counts; a float-level difference could flip one borderline example.
        np.testing.assert_allclose(h["accuracy"], ref["accuracy"], atol=2 / 512, err_msg=where)
        np.testing.assert_allclose(h["test_accuracy"], ref["test_accuracy"], atol=2 / 515, err_msg=where)


def test_one_replica_mirrored_is_bitwise_one_device(train_mlp):
    ref = _run(train_mlp, "--strategy", "one_device")
    h = _run(train_mlp, "--strategy", "mirrored", "--replicas", "1")
    assert h["step_losses"] == ref["step_losses"]


def test_trajectory_depends_on_the_seed(train_mlp):
    # Guards the agreement test against comparing something that does not depend on the training.
    a = _run(train_mlp, "--strategy", "mirrored", "--seed", "1")
    b = _run(train_mlp, "--strategy", "mirrored", "--seed", "2")
    assert not np.allclose(a["step_losses"], b["step_losses"], rtol=1e-3)


@pytest.mark.parametrize("kind", ["mirrored", "central"])
def test_variables_stay_in_sync(train_mlp, kind):
    import cudist

    args = train_mlp.parse_args([*SMALL, "--strategy", kind, "--replicas", "3", "--epochs", "1", "--optimizer", "adam"])
    history, strategy, model, optimizer = train_mlp.train(args)
    assert int(optimizer.iterations) == len(history["step_losses"]) == 512 // 64
    slots = [optimizer.get_slot(v, name) for v in model.trainable_variables for name in ("momentum", "velocity")]
    assert len(optimizer.variables) == 2 + len(slots)  # iteration, learning_rate, the slots
    for var in model.trainable_variables + slots:
        copies = strategy.experimental_local_results(var)
        if kind == "mirrored":
            assert isinstance(var, cudist.MirroredVariable)
            assert len(copies) == 3
            for c in copies[1:]:
                np.testing.assert_array_equal(np.asarray(c), np.asarray(copies[0]), err_msg=var.name)
        else:
            assert len(copies) == 1
            assert var.device.endswith("device:CPU:0")
        assert np.all(np.isfinite(var.numpy()))
        assert np.any(var.numpy() != 0), var.name  # trained (slots start at zero, biases too)


def test_bad_flags_exit_with_usage_error(train_mlp, capsys):
    with pytest.raises(SystemExit) as e:
        train_mlp.main(["--strategy", "one_device", "--replicas", "2"])
    assert e.value.code == 2
    assert "one_device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_mlp.main(["--batch-size", "4096"])


def test_script_runs_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_mlp.py"), "--strategy", "central", "--replicas", "2", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("Epoch ")]
    assert len(lines) == 2
    assert "CentralStorageStrategy, 2 replica(s)" in proc.stdout
    final_acc = float(lines[-1].split("Test Accuracy: ")[1].split("%")[0])
    assert final_acc > 90.0


def test_mixed_precision_example_reaches_float32_accuracy():
    """examples/train_mlp_mixed_precision.py: bfloat16 (and float16 + loss scaling) gradients from JAX
    into float32 variables train the MLP to the float32 run's accuracy."""
    pytest.importorskip("jax")
    pytest.importorskip("ml_dtypes")
    from conftest import load_example

    from cudist import mixed_precision

    example = load_example("train_mlp_mixed_precision")
    runs = {p: example.main(["--policy", p, "--quiet"]) for p in ("float32", "mixed_bfloat16", "mixed_float16")}
    assert mixed_precision.global_policy().name == "float32"  # the example restores the default
    base = runs["float32"]
    assert base["grad_dtypes"] == ["float32"] and base["test_accuracy"][-1] > 0.9
    for policy, grads in (("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")):
        h = runs[policy]
        assert h["grad_dtypes"] == [grads], policy  # the replicas really passed 16-bit gradients
        assert h["variable_dtypes"] == ["float32"], policy
        assert h["step_losses"][0] > 1.0 and h["loss"][-1] < 0.25 * h["step_losses"][0], policy
        assert abs(h["test_accuracy"][-1] - base["test_accuracy"][-1]) <= 0.02, (policy, h["test_accuracy"])
        assert abs(h["accuracy"][-1] - base["accuracy"][-1]) <= 0.02, (policy, h["accuracy"])
        # Not the float32 run in disguise: 16-bit compute changes the losses.
        assert h["step_losses"] != base["step_losses"], policy
