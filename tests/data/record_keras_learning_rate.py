"""Records Keras 3's learning-rate variable (issue #31): what ``optimizer.learning_rate`` is, what
assigning it does to the next step, schedules' read-only values, the errors, and a checkpoint.

Run it with a Python that has TensorFlow 2.21 and Keras 3 (cudist's tests never import either)::

    /path/to/tf-venv/bin/python tests/data/record_keras_learning_rate.py

It writes ``tests/data/keras_learning_rate.json``; ``tests/test_tf_parity.py`` replays each case on
cudist. Each optimizer trains a float32 variable ``w`` (5,) for three steps of recorded gradients:
the first at the constructor's rate 0.1, then after ``optimizer.learning_rate.assign(0.01)``, then
after ``optimizer.learning_rate = 0.001``; ``w`` is recorded after each step.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

OUT = Path(__file__).with_name("keras_learning_rate.json")
CLASSES = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "Nadam", "Lion"]


def outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is what is recorded
        return type(e).__name__
    return "ok"


def trajectory(cls):
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(5).astype(np.float32)
    grads = [rng.standard_normal(5).astype(np.float32) for _ in range(3)]
    w = keras.Variable(w0, name="w")
    opt = getattr(keras.optimizers, cls)(learning_rate=0.1)
    out = {"optimizer": cls, "w0": w0.tolist(), "grads": [g.tolist() for g in grads], "w": [], "lr": []}
    out["is_variable"] = isinstance(opt.learning_rate, keras.Variable)
    out["is_listed_second"] = opt.learning_rate is opt.variables[1]
    out["path"] = opt.learning_rate.path
    for i, g in enumerate(grads):
        if i == 1:
            opt.learning_rate.assign(0.01)
        elif i == 2:
            opt.learning_rate = 0.001
        out["lr"].append(float(opt.learning_rate.numpy()))
        opt.apply_gradients([(tf.constant(g), w)])
        out["w"].append(w.numpy().tolist())
    out["config_learning_rate"] = opt.get_config()["learning_rate"]
    return out


def main():
    cases = [trajectory(cls) for cls in CLASSES]
    sched = keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.5))
    w = keras.Variable(np.ones(2, np.float32))
    sched_values = []
    for _ in range(3):
        lr = sched.learning_rate
        sched_values.append({"type": type(lr).__name__, "dtype": str(lr.dtype), "value": float(lr.numpy())})
        sched.apply_gradients([(tf.ones(2), w)])
    schedule = {
        "values": sched_values,
        "set_float": outcome(lambda: setattr(sched, "learning_rate", 0.1)),
        "assign": outcome(lambda: sched.learning_rate.assign(0.1)),
        "variables": [v.path.split("/", 1)[1] for v in sched.variables],
    }
    callable_opt = keras.optimizers.SGD(lambda: 0.3)
    plain = keras.optimizers.Adam(0.01)
    errors = {
        "constructor_str": outcome(lambda: keras.optimizers.Adam("fast")),
        "constructor_int": outcome(lambda: keras.optimizers.Adam(1)),
        "setter_str": outcome(lambda: setattr(plain, "learning_rate", "fast")),
        "setter_int": outcome(lambda: setattr(plain, "learning_rate", 1)),
        "setter_int_value": float(plain.learning_rate.numpy()),
    }
    later = keras.optimizers.SGD(0.1)
    later.learning_rate = keras.optimizers.schedules.ExponentialDecay(0.2, 3, 0.5)
    dropped = {"variables": [v.path.split("/", 1)[1] for v in later.variables], "value": float(later.learning_rate.numpy())}
    # A checkpoint saves the variable: restored into an optimizer made with another rate.
    with tempfile.TemporaryDirectory() as d:
        saved = keras.optimizers.Adam(0.01)
        saved.learning_rate.assign(0.25)
        path = tf.train.Checkpoint(optimizer=saved).save(os.path.join(d, "ckpt"))
        restored = keras.optimizers.Adam(0.5)
        tf.train.Checkpoint(optimizer=restored).restore(path).assert_existing_objects_matched()
        checkpoint = {"restored": float(restored.learning_rate.numpy())}
    inner = keras.optimizers.SGD(0.1)
    lso = keras.optimizers.LossScaleOptimizer(inner)
    loss_scale = {"same_variable": lso.learning_rate is inner.learning_rate}
    lso.learning_rate = 0.05
    loss_scale["inner_after_set"] = float(inner.learning_rate.numpy())
    record = {
        "tensorflow": tf.__version__, "keras": keras.__version__, "trajectories": cases, "schedule": schedule,
        "callable_value": callable_opt.learning_rate, "callable_variables": [v.path.split("/", 1)[1] for v in callable_opt.variables],
        "errors": errors, "schedule_set_later": dropped, "checkpoint": checkpoint, "loss_scale": loss_scale,
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "trajectories"}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
