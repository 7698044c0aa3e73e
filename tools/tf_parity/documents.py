"""TensorFlow's documents' loops, ported to cudist as the porting guide says, on either library (issue #31).

``--backend tf`` runs the originals on TensorFlow 2.21 (two logical CPUs) and ``record.py --documents``
stores their outputs in ``tests/data/tf_documents.json``; ``--backend cudist`` runs the ports, which
``tests/test_tf_documents.py`` compares with the recording (TensorFlow is never imported there).

Each function is one document's snippet or loop, as the document writes it, with the renames of
``docs/guides/porting.md`` (``tf.distribute.X`` -> ``cudist.X``, ``tf.data`` -> ``cudist.data``,
``@tf.function`` -> ``@cudist.function``) and two changes a port needs: weights start from fixed values
(the documents draw them at random) and, on cudist, gradients are written out (no ``GradientTape``).

* The Distributed input tutorial (tensorflow.org/tutorials/distribute/input): iterating a distributed
  dataset in a loop, with ``iter``/``next``, inside a function; the batch splits of its prose
  (``range(6).batch(4)`` and ``range(4).batch(4)`` over replicas); ``distribute_datasets_from_function``;
  ``get_next_as_optional`` over ``range(9).batch(2)`` with its partial last step; ``element_spec``;
  ``experimental_distribute_values_from_function``; a generator dataset.
* The Distributed training guide's custom loop (tensorflow.org/guide/distributed_training, "Use
  tf.distribute.Strategy with custom training loops"): a one-unit dense layer with an L2 regularizer,
  SGD, ``from_tensors(([1.], [1.])).repeat(1000).batch(global_batch_size)``, the mean loss of each step.
* The ``tf.distribute.Strategy`` API page (tensorflow.org/api_docs/python/tf/distribute/Strategy): the
  examples of ``scope``, ``experimental_distribute_dataset``, ``run``, ``reduce``,
  ``experimental_distribute_values_from_function``, ``gather`` and the class's custom training loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

BACKEND = None
tf = cd = None
REPLICAS = 2


def _setup(backend):
    global BACKEND, tf, cd  # noqa: PLW0603 - the backend's modules, imported once by name
    BACKEND = backend
    if backend == "tf":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf_

        tf = tf_
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    else:
        import cudist as cd_
        import cudist.nn  # noqa: F401

        cd = cd_
        if len(cd.config.list_logical_devices("CPU")) < REPLICAS:  # (a test process may have made them)
            cpu = cd.config.list_physical_devices("CPU")[0]
            cd.config.set_logical_device_configuration(cpu, [cd.config.LogicalDeviceConfiguration()] * REPLICAS)


def lib():
    """``tf`` or ``cudist``: the ported code calls the same names on either."""
    return tf if BACKEND == "tf" else cd


def _np(x):
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def _strategy():
    return lib().distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)]) if BACKEND == "tf" else \
        cd.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])


def _local(strategy, value):
    return [_np(v).tolist() for v in strategy.experimental_local_results(value)]


def _function(f):
    return tf.function(f) if BACKEND == "tf" else cd.function(f)


def _constant(x):
    return tf.constant(x) if BACKEND == "tf" else np.asarray(x, dtype=np.float32)


def _reduce_op(name):
    return getattr(tf.distribute.ReduceOp if BACKEND == "tf" else cd.ReduceOp, name)


# -------------------------------------------------------------------------------- the input tutorial
def input_tutorial():
    out = {}
    global_batch_size = 16
    mirrored_strategy = _strategy()
    Dataset = lib().data.Dataset
    dataset = Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(global_batch_size)

    @_function
    def train_step(inputs):
        features, labels = inputs
        return labels - 0.3 * features

    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    out["loop"] = [_local(mirrored_strategy, mirrored_strategy.run(train_step, args=(d,))) for d in dist_dataset]

    # "Batching": the examples of the tutorial's prose, over 2 replicas (and 3 for range(4).batch(4) there).
    def splits(ds):
        return [_local(mirrored_strategy, x) for x in mirrored_strategy.experimental_distribute_dataset(ds)]

    out["range(6).batch(4)"] = splits(Dataset.range(6).batch(4))
    out["range(4).batch(4)"] = splits(Dataset.range(4).batch(4))
    out["range(9).batch(4, drop_remainder=True)"] = splits(Dataset.range(9).batch(4, drop_remainder=True))

    # iter / next
    dist_iterator = iter(dist_dataset)
    out["next"] = [_local(mirrored_strategy, mirrored_strategy.run(train_step, args=(next(dist_iterator),)))
                   for _ in range(3)]

    # Iterating inside a function (the tutorial's train_dist_dataset, a sum of reduced losses)
    @_function
    def train_dist_dataset(dist_dataset):
        total_loss = _constant([0.0])
        for x in dist_dataset:
            per_replica = mirrored_strategy.run(lambda inputs: inputs[0] * 2.0, args=(x,))
            total_loss += mirrored_strategy.reduce(_reduce_op("SUM"), per_replica, axis=0)
        return total_loss

    out["train_dist_dataset"] = _np(train_dist_dataset(dist_dataset)).tolist()

    # distribute_datasets_from_function
    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        d = Dataset.from_tensors(([1.0], [1.0])).repeat(64).batch(16)
        d = d.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        d = d.unbatch().batch(batch_size)
        return d.prefetch(2)

    from_fn = mirrored_strategy.distribute_datasets_from_function(dataset_fn)
    out["from_function"] = [[[list(np.shape(v)) for v in _local_raw(mirrored_strategy, part)] for part in x] for x in from_fn]

    # get_next_as_optional with a partial last step
    strategy = mirrored_strategy
    dataset = Dataset.range(9).batch(2)
    dist_dataset2 = strategy.experimental_distribute_dataset(dataset)
    out["element_spec"] = _spec(dist_dataset2.element_spec)

    def step_fn(x):
        return x

    dist_dataset_iterator = iter(dist_dataset2)
    steps = []
    while True:
        optional_data = dist_dataset_iterator.get_next_as_optional()
        if not _np(optional_data.has_value()):
            break
        per_replica_results = strategy.run(step_fn, args=(optional_data.get_value(),))
        steps.append(_local(strategy, per_replica_results))
    out["get_next_as_optional"] = steps

    # Tensor inputs: experimental_distribute_values_from_function
    def value_fn(ctx):
        return _constant(1.0) + ctx.replica_id_in_sync_group

    distributed_values = mirrored_strategy.experimental_distribute_values_from_function(value_fn)
    out["values_from_function"] = [_local(mirrored_strategy, mirrored_strategy.run(lambda v: v * 2.0, args=(distributed_values,)))
                                   for _ in range(2)]

    # A generator dataset (the tutorial's draws np.random.rand(4); here a fixed sequence)
    def input_gen():
        for i in range(6):
            yield np.arange(4) / 10 + i

    float32 = tf.float32 if BACKEND == "tf" else np.float32
    shape = tf.TensorShape([4]) if BACKEND == "tf" else (4,)
    gen_ds = Dataset.from_generator(input_gen, output_types=(float32), output_shapes=shape).batch(4)
    iterator = iter(mirrored_strategy.experimental_distribute_dataset(gen_ds))
    out["generator"] = [_local(mirrored_strategy, next(iterator)) for _ in range(2)]
    return out


def _local_raw(strategy, value):
    return [_np(v) for v in strategy.experimental_local_results(value)]


def _spec(spec):
    kind = type(spec).__name__
    if isinstance(spec, (tuple, list)) and kind != "TensorSpec":
        return ["tuple", [_spec(s) for s in spec]]
    if "PerReplica" in kind:
        return ["PerReplica", [_spec(s) for s in spec._component_specs]]
    shape = spec.shape.as_list() if BACKEND == "tf" else [None if d is None else int(d) for d in spec.shape]
    return ["TensorSpec", shape, spec.dtype.name if BACKEND == "tf" else np.dtype(spec.dtype).name]


# -------------------------------------------------------------------------- the guide's custom loop
def guide_custom_loop():
    mirrored_strategy = _strategy()
    batch_size_per_replica = 5
    global_batch_size = batch_size_per_replica * mirrored_strategy.num_replicas_in_sync
    kernel0 = np.array([[0.5]], np.float32)  # the guide's Dense(1) draws it (glorot): fixed for the comparison
    if BACKEND == "tf":
        with mirrored_strategy.scope():
            model = tf.keras.Sequential([tf.keras.layers.Dense(
                1, input_shape=(1,), kernel_regularizer=tf.keras.regularizers.L2(1e-4))])
            model.layers[0].kernel.assign(kernel0)
            optimizer = tf.keras.optimizers.SGD()
        trainable = model.trainable_variables
    else:
        with mirrored_strategy.scope():
            kernel = cd.Variable(kernel0, name="dense/kernel")
            bias = cd.Variable(np.zeros(1, np.float32), name="dense/bias")
            optimizer = cd.optimizers.SGD()
        trainable = [kernel, bias]

    dataset = lib().data.Dataset.from_tensors(([1.0], [1.0])).repeat(1000).batch(global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

    @_function
    def train_step(dist_inputs):
        def step_fn(inputs):
            features, labels = inputs
            if BACKEND == "tf":
                with tf.GradientTape() as tape:
                    logits = model(features, training=True)
                    import keras  # noqa: PLC0415 - tf.keras.losses (Keras 3) lacks the function the guide calls

                    per_example_loss = keras.losses.mean_squared_error(labels, logits)
                    loss = tf.nn.compute_average_loss(per_example_loss)
                    model_losses = model.losses
                    if model_losses:
                        loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
                gradients = tape.gradient(loss, model.trainable_variables)
            else:
                x, y = np.asarray(features), np.asarray(labels)
                k, b = np.asarray(kernel), np.asarray(bias)
                logits = x @ k + b
                per_example_loss = cd.losses.mean_squared_error(y, logits)
                loss = cd.nn.compute_average_loss(per_example_loss)
                loss += cd.nn.scale_regularization_loss(np.float32(1e-4) * np.sum(np.square(k)))
                # the gradients of that loss, by hand: d/dlogits of the averaged MSE, plus the L2 term's
                dlogits = np.float32(-2.0) * (y - logits) / np.float32(global_batch_size)
                n = mirrored_strategy.num_replicas_in_sync
                gradients = [x.T @ dlogits + np.float32(2e-4) * k / np.float32(n), dlogits.sum(axis=0)]
            optimizer.apply_gradients(zip(gradients, trainable))
            return loss

        per_example_losses = mirrored_strategy.run(step_fn, args=(dist_inputs,))
        mean_loss = mirrored_strategy.reduce(_reduce_op("MEAN"), per_example_losses, axis=None)
        return mean_loss

    losses = []
    with mirrored_strategy.scope():
        for inputs in dist_dataset:
            losses.append(float(_np(train_step(inputs))))
    return {"losses": losses, "kernel": _np(trainable[0]).tolist(), "bias": _np(trainable[1]).tolist()}


# ------------------------------------------------------------------- the Strategy API page's examples
def _identity(x):
    return tf.identity(x) if BACKEND == "tf" else np.array(x, copy=True)


def strategy_api():
    """The examples of the ``tf.distribute.Strategy`` API page (the class's and its methods' docstrings),
    on two logical CPUs where the page says ``["GPU:0", "GPU:1"]`` (and ``"GPU:0"``-``"GPU:3"`` for
    ``gather``'s second example), with the porting guide's renames (``tf.identity(x)`` -> ``np.array(x, copy=True)``,
    ``tf.constant`` -> a NumPy array, ``tf.reshape(tf.range(6), ...)`` -> ``np.arange(6).reshape``)."""
    out = {}
    dist = lib().distribute if BACKEND == "tf" else cd
    ctx_of = dist.get_replica_context

    # Strategy.scope: a variable created inside the scope is mirrored, outside it is a plain variable.
    strategy = _strategy()
    with strategy.scope():
        mirrored_variable = lib().Variable(1.0)
    regular_variable = lib().Variable(1.0)
    out["scope"] = {"inside": _local(strategy, mirrored_variable),
                    "outside": _local(strategy, regular_variable),
                    "inside_is_distributed": type(mirrored_variable).__name__ == "MirroredVariable",
                    "outside_is_distributed": type(regular_variable).__name__ == "MirroredVariable"}

    # Strategy.experimental_distribute_dataset
    global_batch_size = 2
    dataset = lib().data.Dataset.range(4).batch(global_batch_size)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    @_function
    def replica_fn(input):  # noqa: A002 - the page's name
        return input * 2

    result = []
    for x in dist_dataset:
        result.append(strategy.run(replica_fn, args=(x,)))
    out["experimental_distribute_dataset"] = [_local(strategy, r) for r in result]

    strategy = _strategy()  # each example makes its own, as the page does
    # Strategy.run: a tensor input, the same on every replica
    tensor_input = _constant(3.0)

    @_function
    def replica_fn_2(input):  # noqa: A002
        return input * 2.0

    out["run_tensor_input"] = _local(strategy, strategy.run(replica_fn_2, args=(tensor_input,)))

    strategy = _strategy()  # each example makes its own, as the page does
    # Strategy.run: values from a function, then a replica-context all_reduce
    @_function
    def run_values():
        def value_fn(value_context):
            return value_context.num_replicas_in_sync

        distributed_values = strategy.experimental_distribute_values_from_function(value_fn)

        def replica_fn2(input):  # noqa: A002
            return input * 2

        return strategy.run(replica_fn2, args=(distributed_values,))

    out["run_values_from_function"] = _local(strategy, run_values())

    @_function
    def run_all_reduce():
        def value_fn(value_context):
            return _constant_int(value_context.replica_id_in_sync_group)

        distributed_values = strategy.experimental_distribute_values_from_function(value_fn)

        def replica_fn(input):  # noqa: A002
            return ctx_of().all_reduce("sum", input)

        return strategy.run(replica_fn, args=(distributed_values,))

    out["run_all_reduce"] = _local(strategy, run_all_reduce())

    strategy = _strategy()  # each example makes its own, as the page does
    # Strategy.reduce: the replica ids, summed
    def step_fn():
        i = ctx_of().replica_id_in_sync_group
        return _identity(i)

    per_replica_result = strategy.run(step_fn)
    total = strategy.reduce("SUM", per_replica_result, axis=None)
    out["reduce"] = _np(total).tolist()

    strategy = _strategy()  # each example makes its own, as the page does
    # Strategy.experimental_distribute_values_from_function / experimental_local_results
    out["values_from_function"] = {
        "constant": _local(strategy, strategy.experimental_distribute_values_from_function(lambda ctx: _constant(1.0))),
        "array_value": _local(strategy, strategy.experimental_distribute_values_from_function(
            lambda ctx: np.array([3.0, 2.0, 1.0])[ctx.replica_id_in_sync_group])),
        "num_replicas_in_sync": _local(strategy, strategy.experimental_distribute_values_from_function(
            lambda ctx: ctx.num_replicas_in_sync)),
    }

    strategy = _strategy()  # each example makes its own, as the page does
    # Strategy.gather
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: _identity(_constant_int([[1], [2]])))

    @_function
    def run_gather():
        return strategy.gather(distributed_values, axis=0)

    out["gather"] = _np(run_gather()).tolist()
    strategy = _strategy()  # each example makes its own, as the page does
    single_tensor = _constant_int(np.arange(6).reshape(1, 2, 3))
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: _identity(single_tensor))

    @_function
    def run_gather_axis(axis):
        return strategy.gather(distributed_values, axis=axis)

    out["gather_axes"] = [_np(run_gather_axis(axis)).tolist() for axis in (0, 1, 2)]

    strategy = _strategy()  # each example makes its own, as the page does
    # The class's custom training loop ("can be as simple as"), an epoch's reduced sum over two epochs
    with strategy.scope():
        @_function
        def distribute_train_epoch(dataset):
            def replica_fn(input):  # noqa: A002
                return input * 3
            # The page starts from ``0`` and reduces with ``axis=None``: for batches of float32 that fails
            # in TF's loop (an int32 then a [2]-shaped loop variable); a float and ``axis=0`` run on both.
            total_result = 0.0
            for x in dataset:
                per_replica_result = strategy.run(replica_fn, args=(x,))
                total_result += strategy.reduce(_reduce_op("SUM"), per_replica_result, axis=0)
            return total_result

        dataset = lib().data.Dataset.from_tensor_slices(np.arange(8, dtype=np.float32)).batch(4)
        dist_dataset = strategy.experimental_distribute_dataset(dataset)
        out["custom_loop_epochs"] = [_np(distribute_train_epoch(dist_dataset)).tolist() for _ in range(2)]
    return out


def _constant_int(x):
    return tf.constant(x) if BACKEND == "tf" else np.asarray(x, dtype=np.int32)


DOCUMENTS = {"input_tutorial": input_tutorial, "guide_custom_loop": guide_custom_loop, "strategy_api": strategy_api}


def run(backend, only=None):
    if backend == "tf" and only is None:
        # One process per document: TF 2.21's collective instance keys start over with each strategy,
        # and a gather after another document's all-reduces on the same devices is aborted
        # ("Collective instance 100 expected type 0 ... but got type 2").
        import subprocess  # noqa: PLC0415
        import tempfile  # noqa: PLC0415

        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in DOCUMENTS:
                path = os.path.join(tmp, name + ".json")
                subprocess.run([sys.executable, __file__, "--backend", "tf", "--only", name, "--out", path], check=True)
                with open(path) as f:
                    out.update(json.load(f))
        return out
    _setup(backend)
    return {name: fn() for name, fn in DOCUMENTS.items() if only is None or name == only}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["tf", "cudist"], required=True)
    p.add_argument("--only", choices=sorted(DOCUMENTS), help="run one document (each in its own process on TF)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = run(args.backend, args.only)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
