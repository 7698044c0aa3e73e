"""Records Keras 3 / TF 2.21 reference results for cudist.metrics, cudist.losses and cudist.nn.

Run it with a Python that has TensorFlow 2.21 and Keras 3 (cudist's tests never import either)::

    /path/to/tf-venv/bin/python tests/data/record_keras_reference.py

It writes ``tests/data/keras_reference.json`` next to itself: every input (random data from a
seeded generator, stored as given, so the tests do not depend on the generator's stream) and what
Keras / TF computed from it. ``tests/test_metrics.py`` and ``tests/test_losses.py`` replay the
cases with cudist and compare.

* ``metrics``: a metric (class name and constructor kwargs) and a sequence of steps (``update``
  with ``y_true``/``y_pred``/``values`` and maybe ``sample_weight``, or ``reset``), with
  ``result()`` after every step. Empty batches (0 rows) are among the updates.
* ``distributed_metrics``: metrics updated inside ``MirroredStrategy.run`` on 4 logical CPUs over
  a dataset whose batches split unevenly (one replica gets 0 rows), read outside.
* ``losses``: a loss (class name, kwargs, reduction), inputs, the value and the gradient of the
  value's sum w.r.t. ``y_pred`` (``tf.GradientTape``; for reduction "none" the gradient of the
  sum of the per-example losses).
* ``distributed_losses``: a Keras loss called inside ``MirroredStrategy.run`` (Keras scales
  "sum_over_batch_size" by 1 / num_replicas there).
* ``compute_average_loss`` / ``scale_regularization_loss``: ``tf.nn``'s helpers, outside any
  strategy and inside ``MirroredStrategy.run`` with uneven and empty per-replica batches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

OUT = Path(__file__).with_name("keras_reference.json")
rng = np.random.default_rng(20261124)


def enc(a):
    """An array as JSON: dtype, shape and the values (float32 values are exact as doubles)."""
    a = np.asarray(a)
    flat = a.reshape(-1)
    if a.dtype == np.float32:  # the shortest decimal that reads back as the same float32
        data = [float(np.format_float_positional(x, unique=True, trim="-")) for x in flat]
    else:
        data = flat.tolist()
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": data}


def f32(*shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def labels(n, c=10, shape=None):
    return rng.integers(0, c, size=(n,) if shape is None else shape).astype(np.int64)


def one_hot(y, c=10):
    return np.eye(c, dtype=np.float32)[y]


def weights(*shape):
    return rng.uniform(0.0, 2.0, size=shape).astype(np.float32)


# ----------------------------------------------------------------------------------- metrics
def metric_case(cls, kwargs, steps):
    m = getattr(keras.metrics, cls)(**kwargs)
    recorded = []
    for step in steps:
        if step == "reset":
            m.reset_state()
            recorded.append({"op": "reset", "result": float(m.result())})
            continue
        args = {k: v for k, v in step.items()}
        if cls in ("Mean", "Sum"):
            m.update_state(args["values"], sample_weight=args.get("sample_weight"))
        else:
            m.update_state(args["y_true"], args["y_pred"], sample_weight=args.get("sample_weight"))
        recorded.append({"op": "update", "args": {k: enc(v) for k, v in args.items()}, "result": float(m.result())})
    return {"class": cls, "kwargs": kwargs, "name": m.name, "dtype": str(m.dtype), "steps": recorded}


def reduction_steps():
    return [
        {"values": f32(8)},
        {"values": f32(6, 3), "sample_weight": weights(6)},
        {"values": f32(5), "sample_weight": weights(5, 1)},
        {"values": np.float32(2.5)},
        {"values": np.zeros((0,), np.float32)},
        {"values": np.zeros((0,), np.float32), "sample_weight": np.zeros((0,), np.float32)},
        {"values": f32(4, 3), "sample_weight": weights(4, 3)},
        {"values": f32(3, 2, 2), "sample_weight": weights(3)},
        {"values": f32(7), "sample_weight": np.float32(0.5)},
        "reset",
        {"values": f32(3)},
    ]


def sparse_steps(logits=True):
    def pred(n):
        x = f32(n, 10, scale=2.0)
        return x if logits else softmax(x)

    return [
        {"y_true": labels(16), "y_pred": pred(16)},
        {"y_true": labels(12, shape=(12, 1)), "y_pred": pred(12), "sample_weight": weights(12)},
        {"y_true": labels(0), "y_pred": pred(0)},
        {"y_true": labels(9).astype(np.float32), "y_pred": pred(9), "sample_weight": weights(9, 1)},
        {"y_true": labels(0), "y_pred": pred(0), "sample_weight": np.zeros((0,), np.float32)},
        "reset",
        {"y_true": labels(5).astype(np.int32), "y_pred": pred(5)},
    ]


def categorical_steps():
    return [
        {"y_true": one_hot(labels(16)), "y_pred": f32(16, 10)},
        {"y_true": one_hot(labels(12)), "y_pred": softmax(f32(12, 10)), "sample_weight": weights(12)},
        {"y_true": np.zeros((0, 10), np.float32), "y_pred": f32(0, 10)},
        "reset",
        {"y_true": one_hot(labels(6)), "y_pred": f32(6, 10)},
    ]


def accuracy_steps():
    return [
        {"y_true": labels(16, 3), "y_pred": labels(16, 3)},
        {"y_true": labels(10, 2).astype(np.float32), "y_pred": labels(10, 2).astype(np.float32),
         "sample_weight": weights(10)},
        {"y_true": labels(0, 3), "y_pred": labels(0, 3)},
        {"y_true": labels(4, 3, shape=(4, 5)), "y_pred": labels(4, 3, shape=(4, 5)), "sample_weight": weights(4)},
        "reset",
        {"y_true": labels(6, 2), "y_pred": labels(6, 2)},
    ]


def mse_steps():
    return [
        {"y_true": f32(16, 4), "y_pred": f32(16, 4)},
        {"y_true": f32(10, 4), "y_pred": f32(10, 4), "sample_weight": weights(10)},
        {"y_true": f32(0, 4), "y_pred": f32(0, 4)},
        {"y_true": f32(5, 2, 3), "y_pred": f32(5, 2, 3)},
        {"y_true": f32(6, 3), "y_pred": f32(6, 3), "sample_weight": weights(6, 1)},
        "reset",
        {"y_true": f32(3, 4), "y_pred": f32(3, 4)},
    ]


def record_metrics():
    return [
        metric_case("Mean", {}, reduction_steps()),
        metric_case("Mean", {"name": "test_loss"}, reduction_steps()),
        metric_case("Sum", {}, reduction_steps()),
        metric_case("SparseCategoricalAccuracy", {}, sparse_steps()),
        metric_case("CategoricalAccuracy", {}, categorical_steps()),
        metric_case("Accuracy", {}, accuracy_steps()),
        metric_case("SparseCategoricalCrossentropy", {"from_logits": True}, sparse_steps(logits=True)),
        metric_case("SparseCategoricalCrossentropy", {}, sparse_steps(logits=False)),
        metric_case("MeanSquaredError", {}, mse_steps()),
    ]


def mirrored4():
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])


def record_distributed_metrics():
    """Metrics updated inside run: 13 examples in batches of 5 -> replica splits [2,2,1,0] x2, [1,1,1,0]."""
    strategy = mirrored4()
    x, y = f32(13, 10, scale=2.0), labels(13)
    w = weights(13)
    with strategy.scope():
        acc = keras.metrics.SparseCategoricalAccuracy()
        wacc = keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")
        mean = keras.metrics.Mean()
        sce = keras.metrics.SparseCategoricalCrossentropy(from_logits=True)
        total = keras.metrics.Sum()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    ds = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(5)

    def step(inputs):
        xb, yb, wb = inputs
        acc.update_state(yb, xb)
        wacc.update_state(yb, xb, sample_weight=wb)
        per_example = loss(yb, xb)
        mean.update_state(per_example)
        sce.update_state(yb, xb)
        total.update_state(per_example, sample_weight=wb)

    splits = []
    for batch in strategy.experimental_distribute_dataset(ds):
        splits.append([int(t.shape[0]) for t in strategy.experimental_local_results(batch[1])])
        strategy.run(step, args=(batch,))
    return {
        "x": enc(x), "y": enc(y), "sample_weight": enc(w), "batch": 5, "replicas": 4, "splits": splits,
        "results": {m.name: float(m.result()) for m in (acc, wacc, mean, sce, total)},
    }


# ----------------------------------------------------------------------------------- losses
def loss_case(cls, kwargs, y_true, y_pred, sample_weight=None):
    out = {"class": cls, "kwargs": kwargs, "y_true": enc(y_true), "y_pred": enc(y_pred)}
    if sample_weight is not None:
        out["sample_weight"] = enc(sample_weight)
    loss = getattr(keras.losses, cls)(**kwargs)
    pred = tf.Variable(y_pred)
    with tf.GradientTape() as tape:
        value = loss(y_true, pred, sample_weight=sample_weight)
        total = tf.reduce_sum(value)
    out["value"] = enc(value.numpy())
    out["gradient"] = enc(tape.gradient(total, pred).numpy())
    return out


def record_losses():
    cases = []
    reductions = ["sum_over_batch_size", "sum", "none", "mean_with_sample_weight"]
    for reduction in reductions:
        for sw in (None, "w"):
            n = 12
            y = labels(n)
            logits = f32(n, 10, scale=2.0)
            w = weights(n) if sw else None
            cases.append(loss_case("SparseCategoricalCrossentropy", {"from_logits": True, "reduction": reduction}, y, logits, w))
            cases.append(loss_case("SparseCategoricalCrossentropy", {"reduction": reduction}, labels(n, shape=(n, 1)), softmax(f32(n, 10)), w))
            cases.append(loss_case("CategoricalCrossentropy", {"from_logits": True, "reduction": reduction}, one_hot(y), logits, w))
            # Unnormalized "probabilities": Keras divides by their sum first.
            cases.append(loss_case("CategoricalCrossentropy", {"reduction": reduction}, one_hot(labels(n)),
                                   rng.uniform(0.05, 1.0, (n, 10)).astype(np.float32), w))
            cases.append(loss_case("MeanSquaredError", {"reduction": reduction}, f32(n, 4), f32(n, 4), w))
            cases.append(loss_case("BinaryCrossentropy", {"from_logits": True, "reduction": reduction},
                                   labels(n, 2, shape=(n, 3)).astype(np.float32), f32(n, 3, scale=2.0), w))
            cases.append(loss_case("BinaryCrossentropy", {"reduction": reduction},
                                   labels(n, 2, shape=(n, 1)).astype(np.float32),
                                   rng.uniform(0.02, 0.98, (n, 1)).astype(np.float32), w))
    # Options, shapes and edge cases under the default reduction.
    y = labels(8)
    cases.append(loss_case("CategoricalCrossentropy", {"from_logits": True, "label_smoothing": 0.1}, one_hot(y), f32(8, 10)))
    cases.append(loss_case("CategoricalCrossentropy", {"label_smoothing": 0.2}, one_hot(y), softmax(f32(8, 10))))
    cases.append(loss_case("BinaryCrossentropy", {"from_logits": True, "label_smoothing": 0.1},
                           labels(8, 2, shape=(8, 2)).astype(np.float32), f32(8, 2)))
    cases.append(loss_case("BinaryCrossentropy", {}, labels(8, 2, shape=(8, 2)).astype(np.float32),
                           rng.uniform(0.0, 1.0, (8, 2)).astype(np.float32)))
    cases.append(loss_case("MeanSquaredError", {}, f32(5, 2, 3), f32(5, 2, 3)))
    cases.append(loss_case("MeanSquaredError", {}, f32(6, 3), f32(6, 3), weights(6, 1)))
    cases.append(loss_case("MeanSquaredError", {"reduction": "none"}, f32(5, 2, 3), f32(5, 2, 3), weights(5, 2)))
    cases.append(loss_case("SparseCategoricalCrossentropy", {"from_logits": True}, labels(6, shape=(3, 2)), f32(3, 2, 10)))
    # Saturated probabilities: Keras clips them to [1e-7, 1 - 1e-7].
    p = softmax(f32(6, 10, scale=2.0))
    p[0] = 0.0
    p[0, 3] = 1.0
    cases.append(loss_case("SparseCategoricalCrossentropy", {}, np.array([3, 1, 2, 0, 5, 9]), p))
    return cases


def record_distributed_losses():
    """Keras losses inside run (4 replicas, 6 rows split [2,2,2,0]): sum_over_batch_size is scaled by 1/4."""
    strategy = mirrored4()
    y, logits = labels(6), f32(6, 10)
    out = []
    for reduction in ("sum_over_batch_size", "sum"):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        ds = tf.data.Dataset.from_tensor_slices((y, logits)).batch(6)
        for batch in strategy.experimental_distribute_dataset(ds):
            res = strategy.run(lambda b: loss(b[0], b[1]), args=(batch,))
            out.append({"reduction": reduction, "per_replica": [enc(r.numpy()) for r in strategy.experimental_local_results(res)]})
    return {"y": enc(y), "logits": enc(logits), "replicas": 4, "cases": out}


def record_compute_average_loss():
    out = {"plain": [], "replicas": []}

    def plain(per_example, **kw):
        res = tf.nn.compute_average_loss(per_example, **kw)
        case = {"per_example_loss": enc(per_example), "value": enc(res.numpy())}
        for k, v in kw.items():
            case[k] = enc(v) if isinstance(v, (np.ndarray, np.generic)) else v
        out["plain"].append(case)

    plain(f32(6))
    plain(f32(6), global_batch_size=16)
    plain(f32(6), sample_weight=weights(6))
    plain(f32(6), sample_weight=weights(6, 1), global_batch_size=10)
    plain(f32(4, 3), sample_weight=weights(4))
    plain(f32(4, 3))
    plain(f32(5), sample_weight=np.float32(0.25))
    plain(np.zeros((0,), np.float32))
    plain(f32(3), global_batch_size=0)
    plain(rng.standard_normal(5), sample_weight=rng.uniform(0, 1, 5))  # float64: TF weights in float32
    plain(rng.standard_normal(5))

    strategy = mirrored4()
    for batch in (5, 3, 8):
        per_example = f32(batch)
        w = weights(batch)
        ds = tf.data.Dataset.from_tensor_slices((per_example, w)).batch(batch)
        for b in strategy.experimental_distribute_dataset(ds):
            def fn(inp):
                pe, sw = inp
                return (
                    tf.nn.compute_average_loss(pe),
                    tf.nn.compute_average_loss(pe, sample_weight=sw),
                    tf.nn.compute_average_loss(pe, global_batch_size=batch),
                    tf.nn.scale_regularization_loss(tf.reduce_sum(pe)),
                )
            res = strategy.run(fn, args=(b,))
            out["replicas"].append({
                "per_example_loss": enc(per_example), "sample_weight": enc(w), "global_batch_size": batch,
                "splits": [int(t.shape[0]) for t in strategy.experimental_local_results(b[0])],
                "default": [float(v) for v in strategy.experimental_local_results(res[0])],
                "weighted": [float(v) for v in strategy.experimental_local_results(res[1])],
                "given": [float(v) for v in strategy.experimental_local_results(res[2])],
                "scale_regularization_loss": [float(v) for v in strategy.experimental_local_results(res[3])],
            })
    out["scale_regularization_loss"] = {
        "plain": float(tf.nn.scale_regularization_loss(np.float32(3.0))),
        "list": float(tf.nn.scale_regularization_loss([np.float32(1.0), np.float32(2.5)])),
    }
    return out


def main():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    data = {
        "recorded_with": {"tensorflow": tf.__version__, "keras": keras.__version__, "numpy": np.__version__,
                          "python": sys.version.split()[0]},
        "metrics": record_metrics(),
        "distributed_metrics": record_distributed_metrics(),
        "losses": record_losses(),
        "distributed_losses": record_distributed_losses(),
        "compute_average_loss": record_compute_average_loss(),
    }
    OUT.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
