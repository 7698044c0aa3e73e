"""Mixed-precision data-parallel training of the MLP of ``train_mlp.py``: bfloat16 (or float16)
compute and gradients from JAX, float32 variables, ``cudist`` doing the distribution.

Keras's recipe without Keras's layers:

* ``cudist.mixed_precision.set_global_policy("mixed_bfloat16")``: the variables (created in
  ``strategy.scope()`` without a dtype) are float32 master weights, and the policy's
  ``compute_dtype`` is what each step casts the weights and inputs to;
* each replica differentiates its share of the loss with ``jax.grad`` in that dtype, so its
  gradients are bfloat16 JAX arrays, handed straight to ``optimizer.apply_gradients``: cudist casts
  them exactly to float32, sums them over the replicas in float32 and updates the float32
  variables and slots;
* with ``--policy mixed_float16`` the loss is scaled (``cudist.optimizers.LossScaleOptimizer``,
  Keras 3's dynamic loss scaling), since float16 gradients underflow: every replica skips a step
  whose gradients overflowed, and the scale adapts.

The data, the model and the loss are those of ``train_mlp.py`` (eight Gaussian blobs, 4 classes,
2 -> 32 ReLU -> 4). ``tests/test_examples.py`` checks that both mixed policies reach the float32
accuracy.

Run::

    python examples/train_mlp_mixed_precision.py                          # mixed_bfloat16, 2 replicas
    python examples/train_mlp_mixed_precision.py --policy mixed_float16   # float16 + loss scaling
    python examples/train_mlp_mixed_precision.py --policy float32         # the float32 baseline

Needs JAX (``pip install jax``, in cudist's test extra) and ml_dtypes.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

import numpy as np

import cudist
import cudist.optimizers
from cudist import mixed_precision


def _train_mlp():
    """``train_mlp.py`` next to this file (its data, model initialisation and strategy set-up)."""
    spec = importlib.util.spec_from_file_location("cudist_example_train_mlp", Path(__file__).with_name("train_mlp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=["mixed_bfloat16", "mixed_float16", "float32"], default="mixed_bfloat16")
    p.add_argument("--replicas", type=int, default=2, help="MirroredStrategy replicas (logical CPUs)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch size, split over the replicas")
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-examples", type=int, default=2048)
    p.add_argument("--test-examples", type=int, default=512)
    p.add_argument("--quiet", action="store_true", help="print nothing")
    args = p.parse_args(argv)
    if args.replicas < 1 or args.batch_size < 1 or args.epochs < 0:
        p.error("--replicas and --batch-size must be >= 1, --epochs >= 0")
    return args


def train(args):
    """Trains as ``args`` say; returns a dict of per-epoch lists (``loss``, ``accuracy``,
    ``test_accuracy``), ``step_losses``, ``grad_dtypes`` (the dtypes of the gradients the replicas
    passed to the optimizer), ``skipped_steps`` (loss scaling) and ``variable_dtypes``."""
    import jax
    import jax.numpy as jnp

    log = (lambda *a: None) if args.quiet else print
    mlp = _train_mlp()
    mixed_precision.set_global_policy(args.policy)
    try:
        policy = mixed_precision.global_policy()
        compute = jnp.dtype(policy.compute_dtype)
        strategy = mlp.make_strategy("mirrored", args.replicas)
        B = args.batch_size
        x_train, y_train = mlp.make_blobs(args.train_examples, args.seed)
        x_test, y_test = mlp.make_blobs(args.test_examples, args.seed + 1000)
        train_ds = strategy.experimental_distribute_dataset(
            cudist.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=args.seed)
            .batch(B, drop_remainder=True))

        rng = np.random.default_rng(args.seed + 1)
        # Initial weights in the compute dtype, as a bfloat16 / float16 checkpoint would give them.
        init = [
            rng.standard_normal((mlp.NUM_FEATURES, mlp.HIDDEN_UNITS)) * math.sqrt(2.0 / mlp.NUM_FEATURES),
            np.zeros(mlp.HIDDEN_UNITS),
            rng.standard_normal((mlp.HIDDEN_UNITS, mlp.NUM_CLASSES))
            * math.sqrt(2.0 / (mlp.HIDDEN_UNITS + mlp.NUM_CLASSES)),
            np.zeros(mlp.NUM_CLASSES),
        ]
        init = [np.asarray(jnp.asarray(v, compute)) for v in init]
        with strategy.scope():
            # No dtype: the policy's variable dtype, float32 master weights under the mixed policies.
            variables = [cudist.Variable(v, name=n) for v, n in zip(init, ["w1", "b1", "w2", "b2"])]
            sgd = cudist.optimizers.SGD(args.learning_rate, momentum=0.9)
            sgd.build(variables)  # slots now, in the scope, rather than on the first step
            optimizer = cudist.optimizers.LossScaleOptimizer(sgd) if args.policy == "mixed_float16" else sgd

        def loss_fn(params, x, y, scale):
            w1, b1, w2, b2 = params
            logits = jnp.maximum(x @ w1 + b1, 0) @ w2 + b2
            # The softmax in float32 (as Keras's mixed-precision layers keep their outputs' softmax).
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            loss = -jnp.take_along_axis(logp, y[:, None], axis=1).sum() / B
            return loss * scale, (loss, (logits.argmax(axis=1) == y).sum())

        grad_fn = jax.jit(jax.grad(loss_fn, has_aux=True))
        grad_dtypes = set()

        def train_step(inputs):
            x, y = inputs
            params = [jnp.asarray(np.asarray(v.read_value())).astype(compute) for v in variables]
            scale = (jnp.asarray(np.asarray(optimizer.dynamic_scale.read_value()), compute)
                     if args.policy == "mixed_float16" else jnp.asarray(1, compute))
            grads, (loss, correct) = grad_fn(params, jnp.asarray(x).astype(compute), jnp.asarray(y), scale)
            grad_dtypes.update(str(g.dtype) for g in grads)
            optimizer.apply_gradients(zip(grads, variables))  # JAX arrays: bfloat16 gradients, float32 variables
            return np.float32(loss), np.int32(correct)

        def accuracy(x, y):
            w1, b1, w2, b2 = [np.asarray(v.numpy()) for v in variables]
            logits = np.maximum(x @ w1 + b1, 0) @ w2 + b2
            return float((logits.argmax(axis=1) == y).mean())

        history = {"loss": [], "accuracy": [], "test_accuracy": [], "step_losses": [], "skipped_steps": 0}
        log(f"policy {policy.name}: compute {policy.compute_dtype}, variables {policy.variable_dtype}; "
            f"{strategy.num_replicas_in_sync} replica(s)")
        start = time.perf_counter()
        steps = 0
        for epoch in range(args.epochs):
            total, correct, n = 0.0, 0, 0
            for inputs in train_ds:
                per_loss, per_correct = strategy.run(train_step, args=(inputs,))
                loss = float(strategy.reduce("sum", per_loss, axis=None))
                history["step_losses"].append(loss)
                total += loss
                correct += int(strategy.reduce("sum", per_correct, axis=None))
                n += 1
                steps += 1
            history["loss"].append(total / max(n, 1))
            history["accuracy"].append(correct / max(n * B, 1))
            history["test_accuracy"].append(accuracy(x_test, y_test))
            log(f"Epoch {epoch + 1}, Loss: {history['loss'][-1]:.6f}, Accuracy: {100 * history['accuracy'][-1]:.2f}%, "
                f"Test Accuracy: {100 * history['test_accuracy'][-1]:.2f}%")
        history["skipped_steps"] = steps - int(np.asarray(optimizer.iterations.numpy()))
        history["grad_dtypes"] = sorted(grad_dtypes)
        history["variable_dtypes"] = sorted({v.dtype.name for v in variables})
        log(f"trained in {time.perf_counter() - start:.2f} s; gradients {history['grad_dtypes']}, "
            f"variables {history['variable_dtypes']}, skipped steps {history['skipped_steps']}")
        return history
    finally:
        mixed_precision.set_global_policy("float32")


def main(argv=None) -> dict:
    """Command-line entry point: trains, prints per-epoch results, returns the history (see :func:`train`)."""
    return train(parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
