"""Records Keras 3's ``optimizer.variables`` for every optimizer cudist has (issue #31).

Run it with a Python that has TensorFlow 2.21 and Keras 3 (cudist's tests never import either)::

    /path/to/tf-venv/bin/python tests/data/record_keras_variables.py

It writes ``tests/data/keras_optimizer_variables.json``: for each case (a Keras optimizer class, its
constructor kwargs, a schedule as ``{"schedule": class name, "config": {...}}``), the optimizer
built on two variables ``kernel`` (4x3) and ``bias`` (3,) of one dtype, then the list
``optimizer.variables`` as ``[name, path, shape, dtype]`` (after one ``apply_gradients``, whose
values are recorded too: ``iteration`` and ``learning_rate`` move with it); and ``default_names``:
each class's default name, for a first and a second instance in a fresh process.
``tests/test_optimizers_keras.py`` compares cudist's list entry by entry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

OUT = Path(__file__).with_name("keras_optimizer_variables.json")


def S(name, **config):
    return {"schedule": name, "config": config}


CASES = [
    ("SGD", {"learning_rate": 0.1}, "float32"),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9}, "float32"),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "use_ema": True}, "float32"),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "gradient_accumulation_steps": 2}, "float32"),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9, "use_ema": True, "gradient_accumulation_steps": 2}, "float32"),
    ("SGD", {"learning_rate": S("ExponentialDecay", initial_learning_rate=0.1, decay_steps=3, decay_rate=0.5)}, "float32"),
    ("Adam", {"learning_rate": 0.01}, "float32"),
    ("Adam", {"learning_rate": 0.01}, "float64"),
    ("Adam", {"learning_rate": 0.01, "amsgrad": True}, "float32"),
    ("Adam", {"learning_rate": S("CosineDecay", initial_learning_rate=0.01, decay_steps=4)}, "float32"),
    ("Adam", {"learning_rate": 0.01, "use_ema": True}, "float32"),
    ("AdamW", {"learning_rate": 0.01}, "float32"),
    ("AdamW", {"learning_rate": 0.01, "amsgrad": True}, "float32"),
    ("RMSprop", {"learning_rate": 0.01}, "float32"),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.9}, "float32"),
    ("RMSprop", {"learning_rate": 0.01, "centered": True}, "float32"),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.9, "centered": True}, "float32"),
    ("RMSprop", {"learning_rate": 0.01, "momentum": 0.9, "centered": True, "use_ema": True}, "float32"),
    ("Adagrad", {"learning_rate": 0.1}, "float32"),
    ("Adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.5}, "float64"),
    ("Adamax", {"learning_rate": 0.02}, "float32"),
    ("Nadam", {"learning_rate": 0.01}, "float32"),
    ("Nadam", {"learning_rate": 0.01}, "float64"),
    ("Nadam", {"learning_rate": 0.01, "use_ema": True, "gradient_accumulation_steps": 2}, "float32"),
    ("Lion", {"learning_rate": 0.01}, "float32"),
    ("Lion", {"learning_rate": S("PiecewiseConstantDecay", boundaries=[1], values=[0.01, 0.005]), "use_ema": True},
     "float64"),
]


def keras_kwargs(kwargs):
    out = dict(kwargs)
    lr = out.get("learning_rate")
    if isinstance(lr, dict):
        out["learning_rate"] = getattr(keras.optimizers.schedules, lr["schedule"])(**lr["config"])
    return out


def describe(v):
    value = np.asarray(v.numpy())
    return {"name": v.name, "path": v.path, "shape": list(v.shape), "dtype": str(v.dtype),
            "value": value.tolist() if value.size <= 1 else None}


def main():
    # Default names first, in a process that has made no optimizer yet: Keras 3 numbers the later ones.
    names = {cls: [getattr(keras.optimizers, cls)().name for _ in range(2)] for cls in dict.fromkeys(c[0] for c in CASES)}
    rng = np.random.default_rng(31)
    cases = []
    for cls, kwargs, dtype in CASES:
        kernel = keras.Variable(rng.standard_normal((4, 3)).astype(dtype), name="kernel", dtype=dtype)
        bias = keras.Variable(rng.standard_normal(3).astype(dtype), name="bias", dtype=dtype)
        opt = getattr(keras.optimizers, cls)(**keras_kwargs(kwargs))
        opt.build([kernel, bias])
        built = [describe(v) for v in opt.variables]
        grads = [tf.constant(rng.standard_normal(v.shape).astype(dtype)) for v in (kernel, bias)]
        opt.apply_gradients(zip(grads, [kernel, bias]))
        stepped = [describe(v) for v in opt.variables]
        cases.append({"optimizer": cls, "kwargs": kwargs, "dtype": dtype, "built": built, "after_step": stepped})
        print(cls, kwargs, [d["path"] for d in built])
    OUT.write_text(json.dumps({"tensorflow": tf.__version__, "keras": keras.__version__, "default_names": names, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
