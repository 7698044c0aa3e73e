"""Records Keras 3 / TF 2.21 optimizer trajectories for cudist.optimizers (issue 13).

Run it with a Python that has TensorFlow 2.21 and Keras 3 (cudist's tests never import either)::

    /path/to/tf-venv/bin/python tests/data/record_keras_optimizers.py

It writes ``tests/data/keras_optimizers.json`` next to itself; ``tests/test_optimizers_keras.py``
replays every case with cudist and compares.

* ``schedules``: each learning-rate schedule (class, config) and its value at steps 0..N.
* ``cases``: an optimizer (Keras class name, constructor kwargs; a schedule as
  ``{"schedule": class name, "config": {...}}``; ``exclude_from_weight_decay`` var_names), two
  variables ``kernel`` (4x3) and ``bias`` (3,) of one dtype with fixed random initial values, and
  a few steps of random gradients. Each case runs

  - ``one``: outside any strategy, ``apply_gradients`` on the whole gradient;
  - ``mirrored2`` / ``mirrored3``: inside ``tf.distribute.MirroredStrategy.run`` on 2 / 3 logical
    CPUs, each replica applying its own gradient (random positive shares of the whole gradient, so
    they sum to it up to rounding); Keras 3 under a strategy clips each replica's gradient before
    the all-reduce, so the clipping cases differ between the three.

  After every step: the variables and ``iterations``; at the end (``use_ema``) the variables after
  ``finalize_variable_values``. The gradients are stored as given to each replica, so the replay
  depends on nothing but this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

OUT = Path(__file__).with_name("keras_optimizers.json")
rng = np.random.default_rng(20261125)
STEPS = 6
SHAPES = {"kernel": (4, 3), "bias": (3,)}

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
#: Replicas of each run. TF 2.21 cannot run two MirroredStrategy of different sizes in one process
#: (their collectives share a group key: "joining a group with size2, but that group has size 3"),
#: so each strategy's runs happen in a child process of their own.
KINDS = {"one": 1, "mirrored2": 2, "mirrored3": 3}


def enc(a):
    """An array as JSON: dtype, shape and the values (float32 values are exact as doubles)."""
    a = np.asarray(a)
    flat = a.reshape(-1)
    if a.dtype == np.float32:  # the shortest decimal that reads back as the same float32
        data = [float(np.format_float_positional(x, unique=True, trim="-")) for x in flat]
    else:
        data = flat.tolist()
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": data}


def keras_kwargs(kwargs):
    out = dict(kwargs)
    lr = out.get("learning_rate")
    if isinstance(lr, dict):
        out["learning_rate"] = getattr(keras.optimizers.schedules, lr["schedule"])(**lr["config"])
    return out


# ------------------------------------------------------------------------------- schedules
SCHEDULES = [
    ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.5}),
    ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.5, "staircase": True}),
    ("PiecewiseConstantDecay", {"boundaries": [2, 5], "values": [0.1, 0.05, 0.01]}),
    ("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 5, "end_learning_rate": 0.01, "power": 2.0}),
    ("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 4, "power": 0.5, "cycle": True}),
    ("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 2, "decay_rate": 0.7}),
    ("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 2, "decay_rate": 0.7, "staircase": True}),
    ("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 6, "alpha": 0.1}),
    ("CosineDecay", {"initial_learning_rate": 0.0, "decay_steps": 6, "warmup_target": 0.1, "warmup_steps": 3}),
    ("CosineDecayRestarts", {"initial_learning_rate": 0.1, "first_decay_steps": 3}),
    ("CosineDecayRestarts", {"initial_learning_rate": 0.1, "first_decay_steps": 2, "t_mul": 1.0, "m_mul": 0.5, "alpha": 0.1}),
]


def record_schedules():
    out = []
    for name, config in SCHEDULES:
        sched = getattr(keras.optimizers.schedules, name)(**config)
        out.append({
            "class_name": name,
            "config": config,
            "serialized": keras.optimizers.schedules.serialize(sched),
            "values": [float(sched(step)) for step in range(0, 25)],
        })
    return out


# ------------------------------------------------------------------------------- optimizers
def S(name, **config):
    return {"schedule": name, "config": config}


CASES = [
    # (case name, optimizer, kwargs, dtype, exclude_from_weight_decay var_names)
    ("sgd", "SGD", {"learning_rate": 0.1}, "float32", None),
    ("sgd_nesterov_clipnorm", "SGD", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True, "clipnorm": 0.5}, "float32", None),
    ("sgd_momentum_wd_exclude", "SGD", {"learning_rate": 0.05, "momentum": 0.8, "weight_decay": 0.5}, "float32", ["bias"]),
    ("sgd_clipvalue_loss_scale", "SGD", {"learning_rate": 0.1, "clipvalue": 0.3, "loss_scale_factor": 4.0}, "float32", None),
    ("sgd_ema", "SGD", {"learning_rate": 0.1, "momentum": 0.5, "use_ema": True, "ema_momentum": 0.7,
                        "ema_overwrite_frequency": 4}, "float32", None),
    ("sgd_accumulation", "SGD", {"learning_rate": 0.1, "momentum": 0.9, "gradient_accumulation_steps": 2}, "float32", None),
    ("adam", "Adam", {"learning_rate": 0.01}, "float32", None),
    ("adam_float64", "Adam", {"learning_rate": 0.01, "beta_1": 0.8, "epsilon": 1e-6}, "float64", None),
    ("adam_global_clipnorm_cosine_warmup", "Adam",
     {"learning_rate": S("CosineDecay", initial_learning_rate=0.0, decay_steps=4, warmup_target=0.02, warmup_steps=2),
      "global_clipnorm": 1.0}, "float32", None),
    ("adam_wd", "Adam", {"learning_rate": 0.01, "weight_decay": 0.2}, "float32", None),
    ("adamw", "AdamW", {"learning_rate": 0.01}, "float32", None),
    ("adamw_wd_exclude_exponential", "AdamW",
     {"learning_rate": S("ExponentialDecay", initial_learning_rate=0.02, decay_steps=2, decay_rate=0.6),
      "weight_decay": 0.3, "beta_2": 0.99}, "float32", ["bias"]),
    ("adamw_clipnorm_float64", "AdamW", {"learning_rate": 0.01, "weight_decay": 0.1, "clipnorm": 0.8}, "float64", None),
    ("rmsprop", "RMSprop", {"learning_rate": 0.01}, "float32", None),
    ("rmsprop_momentum", "RMSprop", {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.9}, "float32", None),
    ("rmsprop_centered_momentum_wd", "RMSprop",
     {"learning_rate": 0.005, "momentum": 0.5, "centered": True, "weight_decay": 0.1, "epsilon": 1e-3}, "float32", None),
    ("rmsprop_centered_piecewise_clipnorm", "RMSprop",
     {"learning_rate": S("PiecewiseConstantDecay", boundaries=[1, 3], values=[0.01, 0.005, 0.002]),
      "centered": True, "clipnorm": 0.5}, "float64", None),
    ("adagrad", "Adagrad", {"learning_rate": 0.1}, "float32", None),
    ("adagrad_inverse_time_wd", "Adagrad",
     {"learning_rate": S("InverseTimeDecay", initial_learning_rate=0.1, decay_steps=1, decay_rate=0.5),
      "initial_accumulator_value": 0.5, "epsilon": 1e-5, "weight_decay": 0.05}, "float32", None),
    ("adagrad_global_clipnorm", "Adagrad", {"learning_rate": 0.1, "global_clipnorm": 0.7}, "float64", None),
    ("adamax", "Adamax", {"learning_rate": 0.02}, "float32", None),
    ("adamax_polynomial_clipvalue", "Adamax",
     {"learning_rate": S("PolynomialDecay", initial_learning_rate=0.02, decay_steps=4, end_learning_rate=0.001, power=2.0),
      "clipvalue": 0.5, "beta_2": 0.9}, "float32", None),
    ("adamax_wd", "Adamax", {"learning_rate": 0.02, "weight_decay": 0.2}, "float64", None),
    ("nadam", "Nadam", {"learning_rate": 0.01}, "float32", None),
    ("nadam_restarts_clipnorm", "Nadam",
     {"learning_rate": S("CosineDecayRestarts", initial_learning_rate=0.01, first_decay_steps=2),
      "clipnorm": 0.6, "beta_1": 0.85}, "float32", None),
    ("nadam_wd_float64", "Nadam", {"learning_rate": 0.01, "weight_decay": 0.1}, "float64", None),
    ("lion", "Lion", {"learning_rate": 0.01}, "float32", None),
    ("lion_wd_cosine", "Lion",
     {"learning_rate": S("CosineDecay", initial_learning_rate=0.01, decay_steps=5, alpha=0.2), "weight_decay": 0.5,
      "beta_1": 0.8, "beta_2": 0.95}, "float32", None),
    ("lion_global_clipnorm_ema", "Lion", {"learning_rate": 0.01, "global_clipnorm": 0.5, "use_ema": True}, "float64", None),
]


def run_case(opt_name, kwargs, dtype, exclude, init, grads, strategy):
    """Keras's trajectory: the variables (and iterations) after each step; ``grads[step][r]`` is
    replica r's {name: gradient}."""
    cls = getattr(keras.optimizers, opt_name)
    scope = strategy.scope() if strategy is not None else _nullcontext()
    with scope:
        variables = {k: keras.Variable(v, name=k, dtype=dtype) for k, v in init.items()}
        opt = cls(**keras_kwargs(kwargs))
        if exclude:
            opt.exclude_from_weight_decay(var_names=exclude)
        opt.build(list(variables.values()))
    names = list(SHAPES)
    trajectory = []
    for step_grads in grads:
        if strategy is None:
            (g,) = step_grads
            opt.apply_gradients([(tf.constant(g[k]), variables[k]) for k in names])
        else:
            values = strategy.experimental_distribute_values_from_function(
                lambda ctx, sg=step_grads: tuple(tf.constant(sg[ctx.replica_id_in_sync_group][k]) for k in names)
            )

            def step(gs):  # eager, as a user's loop without tf.function
                opt.apply_gradients(list(zip(gs, [variables[k] for k in names])))

            strategy.run(step, args=(values,))
        trajectory.append({
            "variables": {k: enc(variables[k].numpy()) for k in names},
            "iterations": int(opt.iterations.numpy()),
        })
    out = {"trajectory": trajectory}
    if kwargs.get("use_ema"):
        opt.finalize_variable_values([variables[k] for k in names])
        out["finalized"] = {k: enc(variables[k].numpy()) for k in names}
    return out


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def shares(g, n):
    """n random positive shares of g (summing to it up to rounding), in g's dtype."""
    w = rng.uniform(0.5, 1.5, size=n)
    w /= w.sum()
    return [(g.astype(np.float64) * wi).astype(g.dtype) for wi in w]


_STRATEGIES = {}


def _strategy(n):
    """One MirroredStrategy per process and size (a new one per case breaks TF's collectives:
    "Collective instance 100 expected type 0 and data_type ...")."""
    if n not in _STRATEGIES:
        _STRATEGIES[n] = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    return _STRATEGIES[n]


def record_cases(kinds):
    """Every case's runs of the strategies ``kinds``; the data (drawn from the seeded generator in
    one fixed order) is the same whatever ``kinds`` is."""
    out = []
    for name, opt_name, kwargs, dtype, exclude in CASES:
        init = {k: (rng.standard_normal(s) * 0.5).astype(dtype) for k, s in SHAPES.items()}
        whole = [{k: (rng.standard_normal(s)).astype(dtype) for k, s in SHAPES.items()} for _ in range(STEPS)]
        case = {"name": name, "optimizer": opt_name, "kwargs": kwargs, "dtype": dtype, "exclude": exclude,
                "init": {k: enc(v) for k, v in init.items()}, "runs": {}}
        for kind, n in KINDS.items():
            grads = [[dict(g)] if n == 1 else [dict(zip(g, parts)) for parts in zip(*(shares(g[k], n) for k in g))]
                     for g in whole]
            if kind not in kinds:
                continue
            strategy = None if n == 1 else _strategy(n)
            try:
                result = run_case(opt_name, kwargs, dtype, exclude, init, grads, strategy)
            except Exception as e:  # a combination Keras cannot run under a strategy: recorded as such
                result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            result["grads"] = [[{k: enc(v) for k, v in r.items()} for r in step] for step in grads]
            case["runs"][kind] = result
            print(name, kind, "error" in result and result["error"] or "ok", flush=True)
        out.append(case)
    return out


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":  # one strategy's runs, into a file
        kind, path = sys.argv[2].split("=", 1)
        Path(path).write_text(json.dumps(record_cases({kind})))
        return
    cases = record_cases({"one"})
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            if kind == "one":
                continue
            path = os.path.join(tmp, kind + ".json")
            subprocess.run([sys.executable, __file__, "--child", f"{kind}={path}"], check=True)
            for case, other in zip(cases, json.loads(Path(path).read_text())):
                assert case["name"] == other["name"] and case["init"] == other["init"]
                case["runs"][kind] = other["runs"][kind]
    data = {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "steps": STEPS,
        "schedules": record_schedules(),
        "cases": cases,
    }
    OUT.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
