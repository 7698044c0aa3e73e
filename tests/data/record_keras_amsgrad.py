"""Records Keras 3 / TF 2.21 AMSGrad trajectories (``Adam(amsgrad=True)``, ``AdamW(amsgrad=True)``)
under ``tf.distribute.MirroredStrategy`` on 4 logical CPUs, for tests/test_amsgrad.py (issue 27).

Run it once with a Python that has TensorFlow 2.21 and Keras 3 (cudist's tests never import either)::

    /work/tfvenv/bin/python tests/data/record_keras_amsgrad.py

It prints the numbers that tests/test_amsgrad.py holds inline. The gradients are exact float32
values from a formula (no random generator), shrinking over the steps so that ``v`` falls below
its running maximum ``velocity_hat`` and AMSGrad's denominator differs from Adam's.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

REPLICAS, SIZE = 4, 7
SCALES = (2.0, 1.0, 0.5, 0.25, 1.0)
INIT = (np.arange(SIZE, dtype=np.float32) - 3.0) * np.float32(0.5)


def grad(step, replica):
    """Replica ``replica``'s gradient at ``step``: exact in float32."""
    i = np.arange(SIZE)
    return ((((i * 7 + replica * 3 + step * 5) % 11) - 5) * 0.25 * SCALES[step]).astype(np.float32)


CASES = {
    "adam_amsgrad": ("Adam", {"learning_rate": 0.01, "amsgrad": True}),
    "adamw_amsgrad": ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1, "amsgrad": True}),
}

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
out = {"tensorflow": tf.__version__, "keras": keras.__version__}
for name, (cls, kwargs) in CASES.items():
    with strategy.scope():
        w = tf.Variable(INIT, name="w")
        opt = getattr(keras.optimizers, cls)(**kwargs)
        opt.build([w])
    traj = []
    for step in range(len(SCALES)):
        strategy.run(
            lambda s=step: opt.apply_gradients(
                [(tf.constant(grad(s, int(tf.distribute.get_replica_context().replica_id_in_sync_group))), w)]
            )
        )
        traj.append([float(x) for x in w.numpy()])
    v_hat = [v for v in opt.variables if "velocity_hat" in v.path]
    out[name] = {"trajectory": traj, "velocity_hat": [float(x) for x in v_hat[0].numpy()]}
print(json.dumps(out))
