"""Records Keras 3 / TF 2.21 ``LossScaleOptimizer`` step by step on injected inf/NaN gradients, for
tests/test_loss_scale.py (issue 28): the scale, the inner optimizer's iterations and the variable
after every ``apply_gradients``.

Run it once with a Python that has TensorFlow 2.21 and Keras 3 (cudist's tests never import either)::

    /work/tfvenv/bin/python tests/data/record_keras_loss_scale.py

The gradients passed in are scaled ones (what the gradient of ``scale_loss(loss)`` gives); they are
exact float32 values, with an inf at step 2 and a NaN at step 5.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import keras  # noqa: E402

SIZE = 3
INIT = np.array([1.0, -2.0, 0.5], np.float32)
GRADS = [
    [8.0, 16.0, -4.0],
    [4.0, -8.0, 2.0],
    [float("inf"), 1.0, 1.0],
    [2.0, 2.0, -2.0],
    [1.0, 3.0, 5.0],
    [float("nan"), 0.0, 0.0],
    [6.0, -6.0, 12.0],
    [0.5, 0.25, 1.0],
]


def main():
    w = keras.Variable(INIT, name="w")
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.5, momentum=0.5), initial_scale=4.0, dynamic_growth_steps=2
    )
    rows = []
    for g in GRADS:
        opt.apply_gradients([(np.array(g, np.float32), w)])
        rows.append({
            "scale": float(np.asarray(opt.dynamic_scale)),
            "iterations": int(np.asarray(opt.iterations)),
            "inner_iterations": int(np.asarray(opt.inner_optimizer.iterations)),
            "w": np.asarray(w).tolist(),
        })
    print(json.dumps({"init": INIT.tolist(), "grads": [[repr(x) for x in g] for g in GRADS], "steps": rows}))


if __name__ == "__main__":
    main()
