"""One worker of the 2-process multi-worker parity scenarios, on TensorFlow or on cudist (issue #31).

The same scenarios run on both: ``--backend tf`` under TensorFlow 2.21's ``MultiWorkerMirroredStrategy``
(two processes on loopback with ``TF_CONFIG``, started by ``record.py``), ``--backend cudist`` under
``python -m cudist.launch -n 2 --tf-config`` (``tests/test_tf_multi_worker.py``). Each worker writes its
answers as one JSON object to ``--out``; ``record.py`` stores TF's in ``tests/data/tf_multi_worker.json``
and the test compares cudist's to them. The cudist side never imports TensorFlow.

What each scenario records is written to be comparable across the two, not to mirror either's types:
devices as strings, specs as (kind, shape, dtype), values as lists.

Scenarios:

* ``devices``: ``worker_devices``, ``parameter_devices``, a variable's ``device`` and its components'.
* ``shard``: each auto-shard policy (FILE, DATA, OFF, AUTO) on ``range`` datasets (partial batches,
  odd batches, ``drop_remainder``): each worker's local batches per step, or the error TF raises.
* ``element_spec``: a distributed dataset's ``element_spec`` (batched, ``drop_remainder``, a tuple).
* ``reduce``: ``all_reduce`` in ``run``, ``reduce`` SUM/MEAN with and without an axis, ``gather``.
* ``inputs``: ``distribute_datasets_from_function`` (InputContext, batches per worker),
  ``experimental_distribute_values_from_function``, a reduce of replica ids (its dtype).
* ``ctl``: the multi-worker custom-training-loop tutorial's loop (``distribute_datasets_from_function``
  with the per-replica batch and ``shard`` by input pipeline, a model and RMSprop made in
  ``scope()``, per-example loss averaged by ``compute_average_loss``, the step's loss reduced with
  SUM, an accuracy metric, a new iterator each epoch, the epoch counters and the model in a
  checkpoint saved each epoch, the chief's into the checkpoint directory and the others' into a
  temporary one they remove): the loss of every step, the accuracy of every epoch, the latest
  checkpoint's name, and what a restart restores. The model is a
  dense softmax layer over synthetic data (the tutorial's CNN on MNIST needs Keras layers and the
  download); its gradient is written out by hand on the cudist side (cudist does no autodiff) and
  comes from ``tf.GradientTape`` on TF's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import numpy as np

BACKEND = None
#: Where the ``ctl`` scenario's checkpoints go (shared by the workers): --out's directory.
CHECKPOINT_ROOT = "."


def _setup(backend):
    global BACKEND, tf, cd  # noqa: PLW0603 - the backend's modules, imported once by name
    BACKEND = backend
    if backend == "tf":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf  # noqa: F401
    else:
        import cudist as cd  # noqa: F401
        import cudist.losses  # noqa: F401
        import cudist.metrics  # noqa: F401
        import cudist.nn  # noqa: F401
        import cudist.optimizers  # noqa: F401
        import cudist.train  # noqa: F401


tf = cd = None


def lib():
    """``tf`` or ``cudist``: what the ported code calls the same names on."""
    return tf if BACKEND == "tf" else cd


def _np(x):
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def _strategy():
    if BACKEND == "tf":
        return tf.distribute.MultiWorkerMirroredStrategy()
    return cd.MultiWorkerMirroredStrategy()


def _range_ds(n):
    return (tf.data.Dataset if BACKEND == "tf" else cd.data.Dataset).range(n)


def _with_policy(ds, policy):
    if BACKEND == "tf":
        opts = tf.data.Options()
        opts.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy, policy)
    else:
        opts = cd.data.Options()
        opts.experimental_distribute.auto_shard_policy = getattr(cd.data.experimental.AutoShardPolicy, policy)
    return ds.with_options(opts)


def _local(strategy, value):
    return [_np(v).tolist() for v in strategy.experimental_local_results(value)]


def _spec(spec):
    """A spec as [kind, shape, dtype]; a per-replica spec as ["PerReplica", [each replica's]]."""
    kind = type(spec).__name__
    if isinstance(spec, (tuple, list)) and kind not in ("TensorSpec",):  # cudist's TensorSpec is a NamedTuple
        return ["tuple", [_spec(s) for s in spec]]
    if "PerReplica" in kind:
        comps = spec._component_specs  # both name it so (TF has no public accessor)
        return ["PerReplica", [_spec(s) for s in comps]]
    dtype = spec.dtype.name if BACKEND == "tf" else np.dtype(spec.dtype).name
    shape = list(spec.shape.as_list()) if BACKEND == "tf" else [None if d is None else int(d) for d in spec.shape]
    return ["TensorSpec", shape, dtype]


def _error(e):
    return {"error": type(e).__name__}


# ------------------------------------------------------------------------------------------ scenarios
def devices(strategy):
    ext = strategy.extended
    with strategy.scope():
        v = (tf.Variable if BACKEND == "tf" else cd.Variable)(1.0, name="v")
    return {
        "num_replicas_in_sync": int(strategy.num_replicas_in_sync),
        "worker_devices": list(ext.worker_devices),
        "parameter_devices": list(ext.parameter_devices),
        "variable_device": v.device,
        "component_devices": [c.device for c in v.values],
        "should_checkpoint": bool(ext.should_checkpoint),
        "logical_devices": [d.name for d in lib().config.list_logical_devices("CPU")],
    }


#: (n, batch, drop_remainder) of the ``shard`` scenario's datasets: ``range(n).batch(batch, drop)``.
SHARD_CASES = [(10, 4, False), (5, 4, False), (6, 3, False), (8, 4, True), (7, 2, False), (12, 4, False), (3, 4, False)]
POLICIES = ["OFF", "DATA", "FILE", "AUTO"]


#: Pipelines around ``batch`` (element-wise ops after it, a second batch, a tuple), by name.
PIPELINES = {
    "range(3).batch(4).repeat(2)": lambda: _range_ds(3).batch(4).repeat(2),
    "range(7).batch(4).map(x + 1)": lambda: _range_ds(7).batch(4).map(lambda x: x + 1),
    "range(10).batch(4).unbatch().batch(3)": lambda: _range_ds(10).batch(4).unbatch().batch(3),
    "range(9).batch(3).take(2)": lambda: _range_ds(9).batch(3).take(2),
    "zip(range(5), range(5)).batch(4)": lambda: _dataset_cls().zip((_range_ds(5), _range_ds(5))).batch(4),
}


def _dataset_cls():
    return tf.data.Dataset if BACKEND == "tf" else cd.data.Dataset


def shard(strategy):
    out = {}
    cases = {f"range({n}).batch({b}{', drop_remainder=True' if drop else ''})":
             (lambda n=n, b=b, drop=drop: _range_ds(n).batch(b, drop_remainder=drop)) for n, b, drop in SHARD_CASES}
    cases.update(PIPELINES)
    for policy in POLICIES:
        for name, make in cases.items():
            key = f"{policy} {name}"
            ds = _with_policy(make(), policy)
            try:
                out[key] = [_local(strategy, x) for x in strategy.experimental_distribute_dataset(ds)]
            except Exception as e:  # noqa: BLE001 - the error class is the answer
                out[key] = _error(e)
    return out


def element_spec(strategy):
    out = {}
    cases = {
        "batch(4)": lambda: _range_ds(8).batch(4),
        "batch(4, drop_remainder=True)": lambda: _range_ds(8).batch(4, drop_remainder=True),
        "zip batch(2)": lambda: (tf.data.Dataset if BACKEND == "tf" else cd.data.Dataset).zip(
            (_range_ds(6), _range_ds(6))).batch(2),
    }
    for name, make in cases.items():
        dist = strategy.experimental_distribute_dataset(make())
        out[name] = {"dataset": _spec(dist.element_spec), "iterator": _spec(iter(dist).element_spec)}
    for name, drop in (("from_function batch(2)", False), ("from_function batch(2, drop_remainder=True)", True)):
        dist = strategy.distribute_datasets_from_function(lambda ctx, drop=drop: _range_ds(8).batch(2, drop_remainder=drop))
        out[name] = {"dataset": _spec(dist.element_spec), "iterator": _spec(iter(dist).element_spec)}
    return out


def reduce(strategy):
    out = {}
    if BACKEND == "tf":
        ctx_fn, sum_, mean_ = tf.distribute.get_replica_context, tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
    else:
        ctx_fn, sum_, mean_ = cd.get_replica_context, cd.ReduceOp.SUM, cd.ReduceOp.MEAN

    def rid():
        return ctx_fn().replica_id_in_sync_group

    def value():  # replica g's value: g + 1 in a (g+1, 2) array of float32
        g = int(_np(rid()))
        x = np.arange(2 * (g + 1), dtype=np.float32).reshape(g + 1, 2) + 10 * g
        return tf.constant(x) if BACKEND == "tf" else x

    out["replica_ids"] = _local(strategy, strategy.run(lambda: rid()))
    out["all_reduce_sum"] = _local(strategy, strategy.run(lambda: ctx_fn().all_reduce(sum_, value()[:1])))
    out["all_reduce_mean"] = _local(strategy, strategy.run(lambda: ctx_fn().all_reduce(mean_, value()[:1])))
    out["all_gather"] = _local(strategy, strategy.run(lambda: ctx_fn().all_gather(value(), axis=0)))
    per = strategy.run(value)
    out["reduce_sum_axis0"] = _np(strategy.reduce(sum_, per, axis=0)).tolist()
    out["reduce_mean_axis0"] = _np(strategy.reduce(mean_, per, axis=0)).tolist()
    first = strategy.run(lambda: value()[:1])
    out["reduce_sum_none"] = _np(strategy.reduce(sum_, first, axis=None)).tolist()
    out["reduce_mean_none"] = _np(strategy.reduce(mean_, first, axis=None)).tolist()
    out["gather_axis0"] = _np(strategy.gather(per, axis=0)).tolist()
    return out


def inputs(strategy):
    """``distribute_datasets_from_function`` (each worker's InputContext and batches),
    ``experimental_distribute_values_from_function`` (its ValueContext), the dtypes of replica ids
    and of their reductions."""
    out = {}
    contexts = []

    def dataset_fn(ctx):
        contexts.append([ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync])
        d = _range_ds(10).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return d.batch(ctx.get_per_replica_batch_size(4))

    out["from_function"] = [_local(strategy, x) for x in strategy.distribute_datasets_from_function(dataset_fn)]
    out["input_contexts"] = contexts

    def value_fn(ctx):
        return np.array([ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync], np.int64)

    out["values_from_function"] = _local(strategy, strategy.experimental_distribute_values_from_function(value_fn))
    get_ctx = tf.distribute.get_replica_context if BACKEND == "tf" else cd.get_replica_context
    ids = strategy.run(lambda: get_ctx().replica_id_in_sync_group)
    sum_op = tf.distribute.ReduceOp.SUM if BACKEND == "tf" else cd.ReduceOp.SUM
    total = strategy.reduce(sum_op, ids, axis=None)
    out["reduce_of_replica_ids"] = [_np(total).tolist(), _np(total).dtype.name]
    return out


# ---------------------------------------------------------------------------------------------- ctl
CTL = {"examples": 96, "features": 6, "classes": 3, "global_batch": 16, "epochs": 2, "steps_per_epoch": 4, "lr": 0.01}


def _ctl_data():
    rng = np.random.default_rng(31)
    x = rng.standard_normal((CTL["examples"], CTL["features"])).astype(np.float32)
    w = rng.standard_normal((CTL["features"], CTL["classes"])).astype(np.float32)
    y = np.argmax(x @ w + 0.5 * rng.standard_normal((CTL["examples"], CTL["classes"])), axis=1).astype(np.int64)
    k0 = (rng.standard_normal((CTL["features"], CTL["classes"])) * 0.1).astype(np.float32)
    return x, y, k0


def ctl(strategy):
    """The tutorial's loop, as it is written there (names kept), on a dense softmax model."""
    x, y, k0 = _ctl_data()
    global_batch_size = CTL["global_batch"]
    lib = tf if BACKEND == "tf" else cd

    def dataset_fn(global_batch_size, input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        dataset = lib.data.Dataset.from_tensor_slices((x, y))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.repeat().batch(batch_size)  # the tutorial shuffles first: its RNG is TF's own
        return dataset

    per_worker_dataset_fn = lambda input_context: dataset_fn(global_batch_size, input_context)  # noqa: E731
    with strategy.scope():
        kernel = lib.Variable(k0, name="kernel")
        bias = lib.Variable(np.zeros(CTL["classes"], np.float32), name="bias")
        if BACKEND == "tf":
            optimizer = tf.keras.optimizers.RMSprop(learning_rate=CTL["lr"])
            train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        else:
            optimizer = cd.optimizers.RMSprop(learning_rate=CTL["lr"])
            train_accuracy = cd.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    per_worker_dataset = strategy.distribute_datasets_from_function(per_worker_dataset_fn)

    def step_fn(inputs):
        xb, yb = inputs
        if BACKEND == "tf":
            with tf.GradientTape() as tape:
                predictions = tf.matmul(xb, kernel) + bias
                per_example_loss = tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction="none")(yb, predictions)
                loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
            grads = tape.gradient(loss, [kernel, bias])
        else:
            xb, yb = np.asarray(xb), np.asarray(yb)
            predictions = xb @ np.asarray(kernel) + np.asarray(bias)
            per_example_loss = cd.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="none")(yb, predictions)
            loss = cd.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
            # d loss / d logits of the mean softmax cross-entropy over the global batch, by hand
            p = np.exp(predictions - predictions.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(yb)), yb] -= 1
            dlogits = (p / global_batch_size).astype(np.float32)
            grads = [xb.T @ dlogits, dlogits.sum(axis=0)]
        optimizer.apply_gradients(zip(grads, [kernel, bias]))
        train_accuracy.update_state(yb, predictions)
        return loss

    def train_step(iterator):
        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(sum_op, per_replica_losses, axis=None)

    sum_op = (tf.distribute.ReduceOp.SUM if BACKEND == "tf" else cd.ReduceOp.SUM)
    # The tutorial's fault-tolerance part: epoch counters and the model in a checkpoint; the chief
    # writes into checkpoint_dir, the others into a temporary directory they remove after saving.
    task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
    cluster_spec = strategy.cluster_resolver.cluster_spec()
    checkpoint_dir = os.path.join(CHECKPOINT_ROOT, "ckpt")

    def _is_chief(task_type, task_id, cluster_spec):
        return (task_type is None or task_type == "chief"
                or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict()))

    def _get_temp_dir(dirpath, task_id):
        temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
        os.makedirs(temp_dir, exist_ok=True)  # tf.io.gfile.makedirs
        return temp_dir

    def write_filepath(filepath, task_type, task_id, cluster_spec):
        dirpath = os.path.dirname(filepath)
        base = os.path.basename(filepath)
        if not _is_chief(task_type, task_id, cluster_spec):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    def make_checkpoint(kernel, bias):
        epoch = lib.Variable(np.int64(0), name="epoch")
        step_in_epoch = lib.Variable(np.int64(0), name="step_in_epoch")
        checkpoint = lib.train.Checkpoint(kernel=kernel, bias=bias, epoch=epoch, step_in_epoch=step_in_epoch)
        return checkpoint, epoch, step_in_epoch

    def barrier():
        strategy.reduce(sum_op, strategy.run(lambda: _np(1.0).astype(np.float32)), axis=None)

    checkpoint, epoch, step_in_epoch = make_checkpoint(kernel, bias)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id, cluster_spec)
    checkpoint_manager = lib.train.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    latest_checkpoint = lib.train.latest_checkpoint(checkpoint_dir)
    if latest_checkpoint:
        checkpoint.restore(latest_checkpoint)

    step_losses, epochs, latest = [], [], []
    while int(_np(epoch)) < CTL["epochs"]:
        iterator = iter(per_worker_dataset)
        total_loss = 0.0
        num_batches = 0
        while int(_np(step_in_epoch)) < CTL["steps_per_epoch"]:
            step_loss = train_step(iterator)
            step_losses.append(float(_np(step_loss)))
            total_loss += step_loss
            num_batches += 1
            step_in_epoch.assign_add(1)
        train_loss = total_loss / num_batches
        epochs.append({"train_loss": float(_np(train_loss)), "train_accuracy": float(_np(train_accuracy.result()))})
        train_accuracy.reset_state()
        checkpoint_manager.save()
        if not _is_chief(task_type, task_id, cluster_spec):
            shutil.rmtree(write_checkpoint_dir)  # tf.io.gfile.rmtree
        epoch.assign_add(1)
        step_in_epoch.assign(0)
        barrier()  # (not the tutorial's: the chief's files exist before the others look)
        latest.append(os.path.basename(lib.train.latest_checkpoint(checkpoint_dir)))

    # A restart, as the tutorial's fault tolerance has it: new variables, restored from the chief's checkpoint.
    with strategy.scope():
        kernel2 = lib.Variable(np.zeros_like(k0), name="kernel")
        bias2 = lib.Variable(np.ones(CTL["classes"], np.float32), name="bias")
    checkpoint2, epoch2, step2 = make_checkpoint(kernel2, bias2)
    checkpoint2.restore(lib.train.latest_checkpoint(checkpoint_dir))
    return {
        "step_losses": step_losses, "epochs": epochs, "kernel": _np(kernel).tolist(), "bias": _np(bias).tolist(),
        "latest_checkpoints": latest,
        "temp_dir_left": os.path.isdir(os.path.join(CHECKPOINT_ROOT, f"workertemp_{task_id}")),
        "restored": {"epoch": int(_np(epoch2)), "step_in_epoch": int(_np(step2)),
                     "kernel_equal": bool(np.array_equal(_np(kernel2), _np(kernel))),
                     "bias_equal": bool(np.array_equal(_np(bias2), _np(bias)))},
    }


SCENARIOS = {"devices": devices, "shard": shard, "element_spec": element_spec, "reduce": reduce, "inputs": inputs,
             "ctl": ctl}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["tf", "cudist"], required=True)
    p.add_argument("--out", required=True, help="where this worker writes its JSON (a {rank} in it is replaced)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args(argv)
    global CHECKPOINT_ROOT  # noqa: PLW0603
    CHECKPOINT_ROOT = os.path.abspath(os.path.dirname(args.out) or ".")
    _setup(args.backend)
    strategy = _strategy()
    resolver = strategy.cluster_resolver
    task_type, task_id = resolver.task_type, int(resolver.task_id)
    result = {"task": [task_type, task_id]}
    for name in args.scenarios.split(","):
        result[name] = SCENARIOS[name](strategy)
    # The file of worker k of the cluster, the chief first (TF's worker order).
    rank = task_id + (len(resolver.cluster_spec().as_dict().get("chief", ())) if task_type == "worker" else 0)
    with open(args.out.format(rank=rank), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
