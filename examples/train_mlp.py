"""Data-parallel training of a small MLP with a custom training loop, the tf.distribute way.

This is TensorFlow's "Custom training with tf.distribute.Strategy" tutorial written for cudist:
the dataset is built with ``cudist.data.Dataset``, distributed with
``strategy.experimental_distribute_dataset``, the model's variables are created in
``strategy.scope()``, each replica computes the loss of its share of the global batch (scaled by
the *global* batch size) and its gradients, and ``optimizer.apply_gradients`` (a
``cudist.optimizers`` optimizer, Keras-like) sums the gradients over the replicas in one batched
reduction and updates every variable once, with one fused kernel pass over all its mirrored copies
and its slots.

The model (forward and backward pass) is plain NumPy, or CuPy with ``--device gpu`` (the same code:
it asks the arrays for their module): cudist does the distribution, not autodiff.

Because the loss of each replica is scaled by the global batch size, the summed gradients equal
the gradients of the whole batch: one device and N replicas follow the same trajectory up to
floating-point summation order. ``tests/test_examples.py`` checks that.

Run::

    python examples/train_mlp.py                                   # MirroredStrategy, 2 CPU replicas
    python examples/train_mlp.py --strategy one_device
    python examples/train_mlp.py --strategy mirrored --replicas 4
    python examples/train_mlp.py --strategy central --replicas 2 --optimizer adam
    python examples/train_mlp.py --device gpu --replicas 4    # needs CuPy; logical GPUs if too few
    python -m cudist.launch -n 2 examples/train_mlp.py --strategy multi_worker   # 2 worker processes (MPI)

With ``--strategy multi_worker`` each worker process runs the same loop under
``MultiWorkerMirroredStrategy`` (``--replicas`` local replicas each, default 1); the global batch is
split over the workers, then their replicas; only the chief prints the epochs.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import cudist
import cudist.optimizers

NUM_CLASSES = 4
NUM_FEATURES = 2
HIDDEN_UNITS = 32

# ------------------------------------------------------------------------------------------- data
def make_blobs(num_examples: int, seed: int, dtype=np.float32):
    """A learnable but not linearly separable classification problem (fixed by ``seed``).

    Eight Gaussian blobs sit evenly on a circle; blob ``k`` belongs to class ``k % 4``, so every
    class is two blobs on opposite sides of the circle and a linear model cannot separate them.

    Returns:
        ``(features, labels)``: a ``(num_examples, 2)`` array of ``dtype`` and an int32 array.
    """
    rng = np.random.default_rng(seed)
    blob = rng.integers(0, 2 * NUM_CLASSES, size=num_examples)
    angle = blob * (2 * np.pi / (2 * NUM_CLASSES))
    centers = 4.0 * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    features = centers + 0.7 * rng.standard_normal((num_examples, NUM_FEATURES))
    return features.astype(dtype), (blob % NUM_CLASSES).astype(np.int32)


# ------------------------------------------------------------------------------------------- model
def array_module(x):
    """``numpy`` for host arrays, ``cupy`` for GPU arrays (``cupy.get_array_module`` without CuPy)."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


class MLP:
    """``logits = relu(x @ w1 + b1) @ w2 + b2``, its variables created in the current strategy scope."""

    def __init__(self, seed: int, dtype):
        rng = np.random.default_rng(seed + 1)
        # He initialization for the ReLU layer, Glorot for the output layer.
        w1 = rng.standard_normal((NUM_FEATURES, HIDDEN_UNITS)) * math.sqrt(2.0 / NUM_FEATURES)
        w2 = rng.standard_normal((HIDDEN_UNITS, NUM_CLASSES)) * math.sqrt(2.0 / (HIDDEN_UNITS + NUM_CLASSES))
        self.w1 = cudist.Variable(w1, dtype=dtype, name="dense/kernel")
        self.b1 = cudist.Variable(np.zeros(HIDDEN_UNITS), dtype=dtype, name="dense/bias")
        self.w2 = cudist.Variable(w2, dtype=dtype, name="dense_1/kernel")
        self.b2 = cudist.Variable(np.zeros(NUM_CLASSES), dtype=dtype, name="dense_1/bias")

    @property
    def trainable_variables(self) -> list:
        return [self.w1, self.b1, self.w2, self.b2]

    def forward(self, x):
        """Logits and the activations the backward pass needs."""
        xp = array_module(x)
        z1 = x @ self.w1 + self.b1  # variables take part in arithmetic like arrays (TF's read)
        h = xp.maximum(z1, 0)
        return h @ self.w2 + self.b2, (x, z1, h)

    def backward(self, dlogits, cache) -> list:
        """Gradients of the loss w.r.t. the trainable variables, given d(loss)/d(logits)."""
        x, z1, h = cache
        dw2 = h.T @ dlogits
        db2 = dlogits.sum(axis=0)
        dz1 = (dlogits @ self.w2.read_value().T) * (z1 > 0)
        dw1 = x.T @ dz1
        db1 = dz1.sum(axis=0)
        return [dw1, db1, dw2, db2]


def softmax_cross_entropy(logits, labels):
    """Per-example cross-entropy and its gradient w.r.t. the logits (per example, unscaled)."""
    xp = array_module(logits)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(len(labels))
    per_example_loss = xp.log(total[:, 0]) - shifted[rows, labels]
    dlogits = exp / total
    dlogits[rows, labels] -= 1
    return per_example_loss, dlogits


# ------------------------------------------------------------------------------------------- strategy
def make_strategy(kind: str, replicas: int, device: str = "cpu"):
    """The strategy named on the command line, over ``replicas`` logical CPUs or GPUs.

    With ``device="gpu"`` and fewer GPUs than replicas, GPU 0 is split into ``replicas`` logical
    GPUs (what ``tf.config.set_logical_device_configuration`` does in TF's tutorials).
    """
    from cudist import config

    kind_name = device.upper()
    # Logical devices are only ever added: the configuration is process-wide (as in TF), and a
    # caller (a test, a notebook) may already have configured more.
    if len(config.list_logical_devices(kind_name)) < replicas:
        physical = config.list_physical_devices(kind_name)
        if not physical:
            raise RuntimeError(f"--device {device}: no {kind_name} found (GPUs need CuPy and a CUDA driver)")
        config.set_logical_device_configuration(physical[0], [config.LogicalDeviceConfiguration()] * replicas)
    devices = [f"/{device}:{i}" for i in range(replicas)]
    if kind == "one_device":
        return cudist.OneDeviceStrategy(devices[0])
    if kind == "mirrored":
        return cudist.MirroredStrategy(devices)
    if kind == "multi_worker":
        # One process per worker (python -m cudist.launch -n N ...), `replicas` local replicas each.
        return cudist.MultiWorkerMirroredStrategy(devices=devices)
    if kind == "central":
        # Variables in host memory, as TF's default with several GPUs.
        return cudist.CentralStorageStrategy(compute_devices=devices, parameter_device="/cpu:0")
    raise ValueError(f"unknown strategy {kind!r}; expected one_device, mirrored, central or multi_worker")


# ------------------------------------------------------------------------------------------- training
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=["one_device", "mirrored", "central", "multi_worker"], default="mirrored")
    p.add_argument("--replicas", type=int, default=None,
                   help="number of replicas (logical devices; per worker for multi_worker); "
                        "default 1 for one_device and multi_worker, else 2")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="where the replicas run")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch size, split over the replicas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=["momentum", "adam"], default="momentum")
    p.add_argument("--learning-rate", type=float, default=None, help="default 0.05 (momentum) or 0.01 (adam)")
    p.add_argument("--train-examples", type=int, default=2048)
    p.add_argument("--test-examples", type=int, default=512)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    args = p.parse_args(argv)
    if args.replicas is None:
        args.replicas = 1 if args.strategy in ("one_device", "multi_worker") else 2
    if args.replicas < 1:
        p.error(f"--replicas must be at least 1, got {args.replicas}")
    if args.strategy == "one_device" and args.replicas != 1:
        p.error("--strategy one_device runs one replica; drop --replicas")
    if args.batch_size < 1 or args.epochs < 0:
        p.error("--batch-size must be >= 1 and --epochs >= 0")
    if args.batch_size > args.train_examples:
        p.error(f"--batch-size {args.batch_size} is larger than --train-examples {args.train_examples}")
    if args.learning_rate is None:
        args.learning_rate = 0.05 if args.optimizer == "momentum" else 0.01
    return args


def train(args):
    """Trains the model as ``args`` (from :func:`parse_args`) say.

    Returns:
        ``(history, strategy, model, optimizer)``. ``history`` is a dict of lists with one entry per epoch:
        ``loss`` (mean training loss over the epoch's steps), ``accuracy`` (training accuracy over
        the epoch), ``test_loss``, ``test_accuracy``; ``step_losses`` (every step's loss, in order) and
        ``step_seconds`` (every training step's wall time).
    """
    log = (lambda *a: None) if args.quiet else print
    dtype = np.dtype(args.dtype)
    GLOBAL_BATCH_SIZE = args.batch_size

    strategy = make_strategy(args.strategy, args.replicas, args.device)
    if not strategy.extended.should_save_summary:  # multi-worker: only the chief reports
        log = lambda *a: None  # noqa: E731
    log(f"strategy: {type(strategy).__name__}, {strategy.num_replicas_in_sync} replica(s); "
        f"global batch {GLOBAL_BATCH_SIZE}; optimizer {args.optimizer}; dtype {dtype.name}")

    x_train, y_train = make_blobs(args.train_examples, args.seed, dtype)
    x_test, y_test = make_blobs(args.test_examples, args.seed + 1000, dtype)
    # drop_remainder: every step sees a full global batch, so scaling by GLOBAL_BATCH_SIZE is exact.
    train_dataset = (
        cudist.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=args.seed)
        .batch(GLOBAL_BATCH_SIZE, drop_remainder=True)
    )
    test_dataset = cudist.data.Dataset.from_tensor_slices((x_test, y_test)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    with strategy.scope():
        model = MLP(args.seed, dtype)
        variables = model.trainable_variables
        if args.optimizer == "momentum":
            optimizer = cudist.optimizers.SGD(args.learning_rate, momentum=0.9)
        else:
            optimizer = cudist.optimizers.Adam(args.learning_rate)
        optimizer.build(variables)  # slots now, in the scope, rather than on the first step

    def compute_loss_and_grads(x, y):
        logits, cache = model.forward(x)
        per_example_loss, dlogits = softmax_cross_entropy(logits, y)
        # tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE):
        # each replica's loss is its share of the global mean, so the replicas' gradients add up
        # to the gradient of the whole batch.
        loss = per_example_loss.sum() / GLOBAL_BATCH_SIZE
        grads = model.backward(dlogits / GLOBAL_BATCH_SIZE, cache)
        correct = (logits.argmax(axis=1) == y).sum()
        return loss, grads, correct

    def train_step(inputs):
        x, y = inputs
        loss, grads, correct = compute_loss_and_grads(x, y)
        # Per-replica gradients: apply_gradients sums them over the replicas (Keras's default).
        optimizer.apply_gradients(zip(grads, variables))
        return loss, correct

    def test_step(inputs):
        x, y = inputs
        logits, _ = model.forward(x)
        per_example_loss, _ = softmax_cross_entropy(logits, y)
        return per_example_loss.sum(), (logits.argmax(axis=1) == y).sum()

    def distributed_train_step(inputs):
        per_replica_loss, per_replica_correct = strategy.run(train_step, args=(inputs,))
        return (
            strategy.reduce(cudist.ReduceOp.SUM, per_replica_loss, axis=None),
            strategy.reduce(cudist.ReduceOp.SUM, per_replica_correct, axis=None),
        )

    def distributed_test_step(inputs):
        per_replica_loss, per_replica_correct = strategy.run(test_step, args=(inputs,))
        return (
            strategy.reduce(cudist.ReduceOp.SUM, per_replica_loss, axis=None),
            strategy.reduce(cudist.ReduceOp.SUM, per_replica_correct, axis=None),
        )

    history = {"loss": [], "accuracy": [], "test_loss": [], "test_accuracy": [], "step_losses": [], "step_seconds": []}
    start = time.perf_counter()
    for epoch in range(args.epochs):
        epoch_start = time.perf_counter()
        total_loss, num_batches, correct, seen = 0.0, 0, 0, 0
        for inputs in train_dist_dataset:
            step_start = time.perf_counter()
            loss, batch_correct = distributed_train_step(inputs)
            history["step_seconds"].append(time.perf_counter() - step_start)
            history["step_losses"].append(float(loss))
            total_loss += float(loss)
            num_batches += 1
            correct += int(batch_correct)
            seen += GLOBAL_BATCH_SIZE

        test_loss, test_correct = 0.0, 0
        for inputs in test_dist_dataset:
            batch_loss, batch_correct = distributed_test_step(inputs)
            test_loss += float(batch_loss)
            test_correct += int(batch_correct)

        history["loss"].append(total_loss / num_batches)
        history["accuracy"].append(correct / seen)
        history["test_loss"].append(test_loss / len(x_test))
        history["test_accuracy"].append(test_correct / len(x_test))
        log(
            f"Epoch {epoch + 1}, Loss: {history['loss'][-1]:.6f}, Accuracy: {100 * history['accuracy'][-1]:.2f}%, "
            f"Test Loss: {history['test_loss'][-1]:.6f}, Test Accuracy: {100 * history['test_accuracy'][-1]:.2f}% "
            f"({time.perf_counter() - epoch_start:.2f} s)"
        )
    step_ms = 1e3 * float(np.median(history["step_seconds"])) if history["step_seconds"] else float("nan")
    log(f"trained {args.epochs} epoch(s) in {time.perf_counter() - start:.2f} s; median train step {step_ms:.3f} ms")
    if args.strategy == "multi_worker" and not args.quiet and history["loss"]:
        ext = strategy.extended
        print(f"worker {ext._worker_index} of {ext._num_workers} final loss {history['loss'][-1]:.6f}", flush=True)
    return history, strategy, model, optimizer


def main(argv=None) -> dict:
    """Command-line entry point: trains, prints per-epoch results, returns the history (see :func:`train`)."""
    history, _, _, _ = train(parse_args(argv))
    return history


if __name__ == "__main__":
    main(sys.argv[1:])
