"""examples/train_mlp.py on logical GPUs follows the CPU trajectory (needs a GPU with CuPy).

The same model code runs on CuPy arrays with ``--device gpu``; cudist's kernels sum in the same
order on both, so only the matrix products (cuBLAS against the host BLAS) may round differently.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TRAIN_MLP_SMALL as SMALL

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _restore_logical_devices():
    """The example splits GPU 0 (and may add logical CPUs): process-wide settings, put them back."""
    from cudist import config

    saved = {kind: (d := config.list_physical_devices(kind)[0], config.get_logical_device_configuration(d))
             for kind in ("CPU", "GPU")}
    yield
    for dev, conf in saved.values():
        config.set_logical_device_configuration(dev, conf)


@pytest.mark.parametrize(
    "strategy, replicas, optimizer",
    [("one_device", 1, "momentum"), ("mirrored", 3, "momentum"), ("mirrored", 2, "adam"), ("central", 2, "adam")],
)
def test_gpu_training_follows_the_cpu_trajectory(train_mlp, strategy, replicas, optimizer):
    flags = [*SMALL, "--strategy", strategy, "--replicas", str(replicas), "--optimizer", optimizer]
    cpu = train_mlp.main(flags)
    gpu = train_mlp.main([*flags, "--device", "gpu"])
    steps = np.array(gpu["step_losses"])
    assert len(steps) == 2 * (512 // 64) and np.all(np.isfinite(steps))
    np.testing.assert_allclose(steps, cpu["step_losses"], rtol=1e-4)
    np.testing.assert_allclose(gpu["test_loss"], cpu["test_loss"], rtol=1e-4)
    assert steps[-4:].mean() < steps[:4].mean()  # it trains


def test_gpu_variables_live_on_the_replica_gpus(train_mlp):
    import cupy

    args = train_mlp.parse_args([*SMALL, "--epochs", "1", "--strategy", "mirrored", "--replicas", "3", "--device", "gpu"])
    _, strategy, model, _ = train_mlp.train(args)
    for var in model.trainable_variables:
        copies = strategy.experimental_local_results(var)
        assert len(copies) == 3
        for i, c in enumerate(copies):
            assert isinstance(c.storage.array, cupy.ndarray)
            assert c.device.endswith(f"device:GPU:{i}")
            np.testing.assert_array_equal(cupy.asnumpy(c.storage.array), cupy.asnumpy(copies[0].storage.array))
