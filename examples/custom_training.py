"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", whole, on cudist.

Section by section as the tutorial: the strategy, the datasets (``shuffle``, ``batch`` by the
global batch, ``experimental_distribute_dataset``), the model and the optimizer created in
``strategy.scope()``, the loss (per-example, reduction "none", averaged over the global batch by
``cudist.nn.compute_average_loss``, plus the regularization loss scaled by
``cudist.nn.scale_regularization_loss``), the metrics (``test_loss``, ``train_accuracy``,
``test_accuracy``), the train and test steps run by ``strategy.run``, checkpoints saved every second
epoch and restored into a new model outside the strategy, and the tutorial's two other ways to
loop: an iterator with ``next``, and iterating inside a function.

What differs, and why: there is no ``tf.GradientTape`` (cudist does no autodiff). The gradients
come from JAX when it is installed (``jax.value_and_grad`` differentiates the same loss code:
cudist's losses and ``compute_average_loss`` run on JAX arrays), else from PyTorch or autograd
(the framework differentiates the model; the loss's gradient w.r.t. the logits comes from
``cudist.losses``), else from a NumPy backward pass; ``--grad`` picks one. Whatever the framework
returns goes to ``optimizer.apply_gradients`` as it is (through DLPack, no copy). The data is
synthetic and shaped like Fashion-MNIST (28x28 grayscale images, 10 classes, uint8 pixels
scaled to [0, 1]): each class is a pattern of blobs, shifted, dimmed and noised per image. The
model is a small MLP (the tutorial's convolutions replaced by one dense layer, its L2
regularization kept); ``tf.function`` has no counterpart (the steps are plain Python). The
PyTorch path runs where torch is installed (checked by hand with torch 2.14.1 on CPU; torch is not
in the test extra, its wheels are gigabytes); JAX, autograd and NumPy are tested in every run.

Run::

    python examples/custom_training.py                          # MirroredStrategy, 2 CPU replicas
    python examples/custom_training.py --strategy one_device
    python examples/custom_training.py --strategy central --replicas 3 --grad numpy
    python -m cudist.launch -n 2 examples/custom_training.py --strategy multi_worker   # 2 worker processes (MPI)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

import cudist
import cudist.losses
import cudist.metrics
import cudist.nn
import cudist.optimizers
import cudist.train

NUM_CLASSES = 10
IMAGE_SHAPE = (28, 28, 1)
HIDDEN_UNITS = 128
L2 = 1e-5  # the tutorial's tf.keras.regularizers.L2(1e-5) on every kernel
GRAD_BACKENDS = ("jax", "torch", "autograd", "numpy")


# ------------------------------------------------------------------------------------------- data
def fashion_mnist_like(num_examples: int, seed: int):
    """Synthetic images shaped like Fashion-MNIST's: ``(uint8 images (n, 28, 28), int labels (n,))``.

    Class ``c`` is a fixed pattern of four Gaussian blobs (the same for every seed); each image is
    its class's pattern shifted by up to 3 pixels, dimmed or brightened, with pixel noise.
    """
    yy, xx = np.mgrid[0:28, 0:28]
    patterns = np.zeros((NUM_CLASSES, 28, 28))
    proto_rng = np.random.default_rng(1234)
    for c in range(NUM_CLASSES):
        for _ in range(4):
            cy, cx = proto_rng.uniform(6, 22, 2)
            s = proto_rng.uniform(2.0, 4.5)
            patterns[c] += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * s * s))
        patterns[c] /= patterns[c].max()
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, num_examples)
    shifts = rng.integers(-3, 4, (num_examples, 2))
    images = np.empty((num_examples, 28, 28))
    for i, (c, (dy, dx)) in enumerate(zip(labels, shifts)):
        images[i] = np.roll(patterns[c], (dy, dx), axis=(0, 1))
    images *= rng.uniform(0.6, 1.2, (num_examples, 1, 1))
    images += rng.normal(0.0, 0.35, images.shape)
    return (np.clip(images, 0, 1) * 255).astype(np.uint8), labels.astype(np.int64)


# ------------------------------------------------------------------------------------------- model
class Model:
    """Flatten -> Dense(128, relu) -> Dense(10) (logits), kernels L2-regularized.

    The variables are created where the model is built: in ``strategy.scope()`` mirrored (or
    central) variables, outside any scope plain ones.
    """

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)

        def glorot_uniform(fan_in, fan_out):  # Keras's default kernel initializer
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)

        n_in = int(np.prod(IMAGE_SHAPE))
        self.kernel1 = cudist.Variable(glorot_uniform(n_in, HIDDEN_UNITS), name="dense/kernel")
        self.bias1 = cudist.Variable(np.zeros(HIDDEN_UNITS, np.float32), name="dense/bias")
        self.kernel2 = cudist.Variable(glorot_uniform(HIDDEN_UNITS, NUM_CLASSES), name="dense_1/kernel")
        self.bias2 = cudist.Variable(np.zeros(NUM_CLASSES, np.float32), name="dense_1/bias")

    @property
    def trainable_variables(self) -> list:
        return [self.kernel1, self.bias1, self.kernel2, self.bias2]

    def __call__(self, images, training=False):
        """Logits (NumPy), reading the variables (inside ``run``: this replica's copies)."""
        return forward(np, [v.read_value() for v in self.trainable_variables], images)[0]


def forward(xp, params, images):
    """The model as a function of its parameters, in any array module: (logits, activations)."""
    kernel1, bias1, kernel2, bias2 = params
    x = images.reshape(images.shape[0], int(np.prod(images.shape[1:])))  # not -1: a batch may be empty
    z1 = x @ kernel1 + bias1
    h = z1 * (z1 > 0)  # ReLU, written so that NumPy, JAX, PyTorch and autograd arrays all take it
    return h @ kernel2 + bias2, (x, z1, h)


def regularization_losses(params) -> list:
    """The model's ``losses`` (Keras's ``model.losses``): L2 of each kernel."""
    return [L2 * (params[0] ** 2).sum(), L2 * (params[2] ** 2).sum()]


# ------------------------------------------------------------------------------------------- gradients
def pick_backend(name: str) -> str:
    """``name``, or for "auto" the first installed of JAX, PyTorch, autograd; else NumPy."""
    if name != "auto":
        if name != "numpy" and importlib.util.find_spec(name) is None:
            raise SystemExit(f"--grad {name}: {name} is not installed")
        return name
    for candidate in GRAD_BACKENDS[:-1]:
        if importlib.util.find_spec(candidate) is not None:
            return candidate
    return "numpy"


def make_gradient_fn(backend: str, model: Model, compute_loss, loss_object):
    """``fn(images, labels) -> (loss, predictions, gradients)`` for one replica's batch: what
    ``tf.GradientTape`` gives the tutorial's ``train_step``."""
    variables = model.trainable_variables

    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def loss_fn(params, images, labels):
            predictions, _ = forward(jnp, params, images)
            # cudist's loss and compute_average_loss run on JAX arrays: JAX differentiates them.
            return compute_loss(labels, predictions, regularization_losses(params)), predictions

        value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

        def fn(images, labels):
            # jnp.asarray(v) takes a Variable (this replica's copy); a copy, as JAX computes
            # asynchronously and apply_gradients then writes the variables in place.
            (loss, predictions), grads = value_and_grad([jnp.asarray(v) for v in variables], images, labels)
            return loss, predictions, grads  # JAX arrays: apply_gradients takes them through DLPack

        return fn

    def loss_and_dlogits(labels, logits):
        # The loss as the tutorial computes it, and its gradient w.r.t. the logits: the loss
        # object's per-example gradients, scaled as compute_average_loss scales the losses (by
        # 1 / (this replica's batch x replicas), its rule without global_batch_size).
        per_example_loss, dlogits = loss_object.value_and_gradient(labels, logits)
        loss = compute_loss(labels, logits, None, per_example_loss=per_example_loss)
        global_batch = len(labels) * cudist.get_replica_context().num_replicas_in_sync
        return loss, dlogits / np.float32(max(global_batch, 1))

    n_replicas = lambda: cudist.get_replica_context().num_replicas_in_sync  # noqa: E731

    if backend == "torch":
        import torch

        def fn(images, labels):
            params = [torch.tensor(np.asarray(v), requires_grad=True) for v in variables]
            logits, _ = forward(torch, params, torch.from_numpy(np.array(images)))
            loss, dlogits = loss_and_dlogits(labels, logits.detach().numpy())
            reg = sum(regularization_losses(params)) / n_replicas()  # scale_regularization_loss
            # A surrogate whose gradient is the loss's: logits . dlogits + the regularization.
            surrogate = (logits * torch.from_numpy(dlogits)).sum() + reg
            surrogate.backward()
            loss = loss + float(reg.detach())
            return loss, logits.detach().numpy(), [p.grad for p in params]  # torch tensors, via DLPack

        return fn

    if backend == "autograd":
        import autograd
        import autograd.numpy as anp

        def fn(images, labels):
            params = [v.read_value() for v in variables]  # zero-copy snapshots (copy-on-write)
            logits = forward(np, params, images)[0]
            loss, dlogits = loss_and_dlogits(labels, logits)

            def surrogate(p):
                reg = regularization_losses(p)
                return anp.sum(forward(anp, p, images)[0] * dlogits) + (reg[0] + reg[1]) / n_replicas()

            grads = autograd.grad(surrogate)(params)
            return loss + cudist.nn.scale_regularization_loss(regularization_losses(params)), logits, grads

        return fn

    def fn(images, labels):  # NumPy: the backward pass written out
        params = [v.read_value() for v in variables]  # zero-copy snapshots (copy-on-write)
        logits, (x, z1, h) = forward(np, params, images)
        loss, dlogits = loss_and_dlogits(labels, logits)
        loss = loss + cudist.nn.scale_regularization_loss(regularization_losses(params))
        reg_scale = np.float32(2 * L2 / n_replicas())
        dkernel2 = h.T @ dlogits + reg_scale * params[2]
        dbias2 = dlogits.sum(axis=0)
        dz1 = (dlogits @ params[2].T) * (z1 > 0)
        dkernel1 = x.T @ dz1 + reg_scale * params[0]
        dbias1 = dz1.sum(axis=0)
        return loss, logits, [dkernel1, dbias1, dkernel2, dbias2]

    return fn


# ------------------------------------------------------------------------------------------- strategy
def make_strategy(kind: str, replicas: int):
    """The strategy named on the command line, over ``replicas`` logical CPUs."""
    from cudist import config

    if len(config.list_logical_devices("CPU")) < replicas:  # only ever add logical devices
        cpu = config.list_physical_devices("CPU")[0]
        config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * replicas)
    devices = [f"/cpu:{i}" for i in range(replicas)]
    if kind == "one_device":
        return cudist.OneDeviceStrategy(devices[0])
    if kind == "mirrored":
        return cudist.MirroredStrategy(devices)
    if kind == "multi_worker":
        # One process per worker (python -m cudist.launch -n N ...), `replicas` local replicas each.
        return cudist.MultiWorkerMirroredStrategy(devices=devices)
    return cudist.CentralStorageStrategy(compute_devices=devices, parameter_device="/cpu:0")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=["one_device", "mirrored", "central", "multi_worker"], default="mirrored")
    p.add_argument("--replicas", type=int, default=None,
                   help="logical CPUs (per worker for multi_worker); default 1 for one_device and multi_worker, else 2")
    p.add_argument("--grad", choices=["auto", *GRAD_BACKENDS], default="auto",
                   help="where gradients come from (auto: JAX, else PyTorch, else autograd, else NumPy)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size-per-replica", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="fixes the global batch (default: per-replica batch x replicas, as the tutorial)")
    p.add_argument("--learning-rate", type=float, default=0.001)
    p.add_argument("--train-examples", type=int, default=6000)
    p.add_argument("--test-examples", type=int, default=1000)
    p.add_argument("--alternate-steps", type=int, default=10, help="steps per epoch of the iterator loop")
    p.add_argument("--alternate-epochs", type=int, default=1, help="epochs of each alternate loop style")
    p.add_argument("--checkpoint-dir", default=None,
                   help="default: a temporary directory (multi_worker: ./training_checkpoints, as the tutorial, "
                        "since every worker must read what the chief writes)")
    p.add_argument("--history-json", action="store_true", help="print the history as one JSON line at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.replicas is None:
        args.replicas = 1 if args.strategy in ("one_device", "multi_worker") else 2
    if args.strategy == "multi_worker" and args.checkpoint_dir is None:
        args.checkpoint_dir = "./training_checkpoints"
    if args.strategy == "one_device" and args.replicas != 1:
        p.error("--strategy one_device runs one replica; drop --replicas")
    if args.replicas < 1 or args.epochs < 0 or args.batch_size_per_replica < 1:
        p.error("--replicas and --batch-size-per-replica must be >= 1, --epochs >= 0")
    return args


# ------------------------------------------------------------------------------------------- the tutorial
def main(argv=None) -> dict:
    """Runs the tutorial; returns its history (losses, accuracies, per step and per epoch)."""
    args = parse_args(argv)
    log = (lambda *a: None) if args.quiet else print
    backend = pick_backend(args.grad)
    history = {"grad": backend, "step_losses": [], "loss": [], "train_accuracy": [], "test_loss": [],
               "test_accuracy": [], "iterator_losses": [], "function_losses": [], "eval_accuracy": None}

    # Distribution strategy
    strategy = make_strategy(args.strategy, args.replicas)
    log(f"Number of devices: {strategy.num_replicas_in_sync} ({type(strategy).__name__}; gradients: {backend})")

    # Setup input pipeline
    train_images, train_labels = fashion_mnist_like(args.train_examples, args.seed)
    test_images, test_labels = fashion_mnist_like(args.test_examples, args.seed + 1)
    # Add a dimension to the array -> new shape == (28, 28, 1); scale to [0, 1]
    train_images = train_images[..., None] / np.float32(255)
    test_images = test_images[..., None] / np.float32(255)

    BUFFER_SIZE = len(train_images)
    BATCH_SIZE_PER_REPLICA = args.batch_size_per_replica
    GLOBAL_BATCH_SIZE = args.global_batch_size or BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = args.epochs

    train_dataset = (cudist.data.Dataset.from_tensor_slices((train_images, train_labels))
                     .shuffle(BUFFER_SIZE, seed=args.seed).batch(GLOBAL_BATCH_SIZE))
    test_dataset = cudist.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    # The tutorial writes ./training_checkpoints; by default we use a directory removed at the end.
    scratch = None if args.checkpoint_dir else tempfile.TemporaryDirectory(prefix="cudist_custom_training_")
    checkpoint_dir = args.checkpoint_dir or scratch.name
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

    # Define the loss function
    with strategy.scope():
        # reduction "none": the per-example losses, averaged over the GLOBAL batch below.
        loss_object = cudist.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def compute_loss(labels, predictions, model_losses, per_example_loss=None):
            if per_example_loss is None:
                per_example_loss = loss_object(labels, predictions)
            loss = cudist.nn.compute_average_loss(per_example_loss)
            if model_losses:
                loss += cudist.nn.scale_regularization_loss(sum(model_losses))
            return loss

    # Define the metrics to track loss and accuracy
    with strategy.scope():
        test_loss = cudist.metrics.Mean(name="test_loss")
        train_accuracy = cudist.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = cudist.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    # A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
    with strategy.scope():
        model = Model(args.seed)
        optimizer = cudist.optimizers.Adam(learning_rate=args.learning_rate)
        checkpoint = cudist.train.Checkpoint(optimizer=optimizer, model=model)
    compute_gradients = make_gradient_fn(backend, model, compute_loss, loss_object)

    def train_step(inputs):
        images, labels = inputs
        loss, predictions, gradients = compute_gradients(images, labels)  # the tutorial's GradientTape
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    # `run` replicates the provided computation and runs it with the distributed input.
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(cudist.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    start = time.perf_counter()
    for epoch in range(EPOCHS):
        # TRAIN LOOP
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            step_loss = float(distributed_train_step(x))
            history["step_losses"].append(step_loss)
            total_loss += step_loss
            num_batches += 1
        train_loss = total_loss / num_batches

        # TEST LOOP
        for x in test_dist_dataset:
            distributed_test_step(x)

        if epoch % 2 == 0:
            checkpoint.save(checkpoint_prefix)

        history["loss"].append(train_loss)
        history["train_accuracy"].append(float(train_accuracy.result()))
        history["test_loss"].append(float(test_loss.result()))
        history["test_accuracy"].append(float(test_accuracy.result()))
        log(f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, Accuracy: {train_accuracy.result() * 100:.2f}, "
            f"Test Loss: {test_loss.result():.4f}, Test Accuracy: {test_accuracy.result() * 100:.2f}")

        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()
    history["train_seconds"] = time.perf_counter() - start

    # Restore the latest checkpoint and test: a new model, outside the strategy.
    if EPOCHS > 0:
        eval_accuracy = cudist.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
        new_model = Model(args.seed + 1)
        new_optimizer = cudist.optimizers.Adam()
        test_dataset = cudist.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

        def eval_step(images, labels):
            predictions = new_model(images, training=False)
            eval_accuracy(labels, predictions)

        checkpoint = cudist.train.Checkpoint(optimizer=new_optimizer, model=new_model)
        checkpoint.restore(cudist.train.latest_checkpoint(checkpoint_dir))
        for images, labels in test_dataset:
            eval_step(images, labels)
        history["eval_accuracy"] = float(eval_accuracy.result())
        log(f"Accuracy after restoring the saved model without strategy: {eval_accuracy.result() * 100:.2f}")

    # Alternate ways of iterating over a dataset: using iterators
    for epoch in range(args.alternate_epochs):
        total_loss = 0.0
        num_batches = 0
        train_iter = iter(train_dist_dataset)
        for _ in range(args.alternate_steps):
            step_loss = float(distributed_train_step(next(train_iter)))
            history["iterator_losses"].append(step_loss)
            total_loss += step_loss
            num_batches += 1
        average_train_loss = total_loss / num_batches
        log(f"Epoch {epoch + 1}, Loss: {average_train_loss:.4f}, Accuracy: {train_accuracy.result() * 100:.2f}")
        train_accuracy.reset_state()

    # Iterating inside a function (a tf.function in the tutorial)
    def distributed_train_epoch(dataset):
        total_loss = 0.0
        num_batches = 0
        for x in dataset:
            per_replica_losses = strategy.run(train_step, args=(x,))
            step_loss = strategy.reduce(cudist.ReduceOp.SUM, per_replica_losses, axis=None)
            history["function_losses"].append(float(step_loss))
            total_loss += step_loss
            num_batches += 1
        return total_loss / np.float32(num_batches)

    for epoch in range(args.alternate_epochs):
        train_loss = distributed_train_epoch(train_dist_dataset)
        log(f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, Accuracy: {train_accuracy.result() * 100:.2f}")
        train_accuracy.reset_state()
    if scratch is not None:
        scratch.cleanup()
    if args.history_json:
        print(json.dumps({k: v for k, v in history.items() if k != "train_seconds"}))
    return history


if __name__ == "__main__":
    main(sys.argv[1:])
