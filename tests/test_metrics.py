"""cudist.metrics against Keras 3 (results recorded in tests/data by record_keras_reference.py), and
their distributed behaviour: state in sync-on-read variables, updated inside ``strategy.run`` (empty
replica batches included) and read outside.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_data import dec, reference

import cudist
import cudist.metrics
from cudist import VariableAggregation, VariableSynchronization

METRIC_CASES = reference()["metrics"]


def _make(case):
    return getattr(cudist.metrics, case["class"])(**case["kwargs"])


def _update(metric, cls, args):
    if cls in ("Mean", "Sum"):
        metric.update_state(args["values"], sample_weight=args.get("sample_weight"))
    else:
        metric.update_state(args["y_true"], args["y_pred"], sample_weight=args.get("sample_weight"))


@pytest.mark.parametrize("case", METRIC_CASES, ids=[f"{c['class']}-{c['name']}" for c in METRIC_CASES])
def test_results_match_keras_step_by_step(case):
    metric = _make(case)
    assert metric.name == case["name"] and metric.dtype == np.dtype(case["dtype"])
    for i, step in enumerate(case["steps"]):
        if step["op"] == "reset":
            metric.reset_state()
        else:
            _update(metric, case["class"], {k: dec(v) for k, v in step["args"].items()})
        result = metric.result()
        assert isinstance(result, np.float32), type(result)
        np.testing.assert_allclose(result, step["result"], rtol=2e-6, atol=1e-7, err_msg=f"step {i}: {step['op']}")


def test_recorded_steps_include_empty_batches_and_weights():
    for case in METRIC_CASES:
        shapes = [next(iter(s["args"].values()))["shape"] for s in case["steps"] if s["op"] == "update"]
        assert any(shape and shape[0] == 0 for shape in shapes), case["class"]
        assert any("sample_weight" in s.get("args", {}) for s in case["steps"]), case["class"]


DIST = reference()["distributed_metrics"]


def _distributed_metrics():
    return {
        "sparse_categorical_accuracy": cudist.metrics.SparseCategoricalAccuracy(),
        "weighted_accuracy": cudist.metrics.SparseCategoricalAccuracy(name="weighted_accuracy"),
        "mean": cudist.metrics.Mean(),
        "sparse_categorical_crossentropy": cudist.metrics.SparseCategoricalCrossentropy(from_logits=True),
        "sum": cudist.metrics.Sum(),
    }


def test_metrics_update_inside_run_and_read_the_global_value_outside(strategy):
    # Keras/TF recorded this with 4 replicas: 13 examples in batches of 5 split [2,2,1,0] twice,
    # then [1,1,1,0]; every strategy must give the same (whole-dataset) results.
    import cudist.losses

    x, y, w = dec(DIST["x"]), dec(DIST["y"]), dec(DIST["sample_weight"])
    with strategy.scope():
        metrics = _distributed_metrics()
    loss = cudist.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    dataset = cudist.data.Dataset.from_tensor_slices((x, y, w)).batch(DIST["batch"])

    def step(inputs):
        xb, yb, wb = inputs
        metrics["sparse_categorical_accuracy"].update_state(yb, xb)
        metrics["weighted_accuracy"].update_state(yb, xb, sample_weight=wb)
        per_example = loss(yb, xb)
        metrics["mean"].update_state(per_example)
        metrics["sparse_categorical_crossentropy"].update_state(yb, xb)
        metrics["sum"].update_state(per_example, sample_weight=wb)

    for batch in strategy.experimental_distribute_dataset(dataset):
        strategy.run(step, args=(batch,))
    for name, metric in metrics.items():
        result = metric.result()
        assert float(result) == pytest.approx(DIST["results"][name], rel=2e-6), name
    assert DIST["splits"] == [[2, 2, 1, 0], [2, 2, 1, 0], [1, 1, 1, 0]]

    # Kept per replica (sync-on-read) where the strategy mirrors; read the same from anywhere.
    n = strategy.num_replicas_in_sync
    for metric in metrics.values():
        for v in metric.variables:
            assert v.synchronization is VariableSynchronization.ON_READ
            assert v.aggregation is VariableAggregation.SUM
            assert not v.trainable
            if isinstance(strategy, cudist.MirroredStrategy):
                assert isinstance(v, cudist.SyncOnReadVariable) and len(strategy.experimental_local_results(v)) == n

    # reset_state (cross-replica) zeroes every replica's share.
    for metric in metrics.values():
        metric.reset_state()
        assert float(metric.result()) == 0.0
        for v in metric.variables:
            for c in strategy.experimental_local_results(v):
                assert float(np.asarray(c)) == 0.0


def test_result_inside_run_is_the_replicas_own_share():
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        total = cudist.metrics.Sum()

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        total.update_state(np.array([1.0, 2.0], np.float32) * (r + 1))
        return total.result()

    out = strategy.run(step)
    assert [float(v) for v in strategy.experimental_local_results(out)] == [3.0, 6.0]
    assert total.result() == 9.0


def test_update_outside_run_adds_once():
    # TF refuses assign_add on a SUM sync-on-read variable in cross-replica context; a metric
    # updated there adds to the first replica's share, so the total reads right.
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with strategy.scope():
        mean = cudist.metrics.Mean()
        mean.update_state([1.0, 2.0, 3.0])
    mean.update_state(np.float32(6.0))  # outside the scope too
    assert mean.result() == 3.0
    strategy.run(lambda: mean.update_state(np.zeros(0, np.float32)))
    assert mean.result() == 3.0 and float(mean.count.value()) == 4.0


def test_metric_interface():
    m = cudist.metrics.Mean(name="loss", dtype="float64")
    assert m.name == "loss" and m.dtype == np.float64
    assert [v.name for v in m.variables] == ["loss/total:0", "loss/count:0"]
    assert m([1.0, 3.0]) == 2.0  # __call__: update, then result
    assert isinstance(m.result(), np.float64)
    assert m.get_config() == {"name": "loss", "dtype": "float64"}
    assert "Mean" in repr(m)
    assert cudist.metrics.Mean().result() == 0.0  # nothing seen: 0, not NaN (divide_no_nan)
    acc = cudist.metrics.SparseCategoricalAccuracy()
    assert acc.name == "sparse_categorical_accuracy" and acc.dtype == np.float32
    assert acc([1, 2], [[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]]) == 0.5
    for cls, name in [(cudist.metrics.CategoricalAccuracy, "categorical_accuracy"), (cudist.metrics.Accuracy, "accuracy"),
                      (cudist.metrics.MeanSquaredError, "mean_squared_error"), (cudist.metrics.Sum, "sum"),
                      (cudist.metrics.SparseCategoricalCrossentropy, "sparse_categorical_crossentropy")]:
        assert cls().name == name


def test_metric_state_is_plain_under_one_device_and_single_copy_under_central_storage():
    one = cudist.OneDeviceStrategy("/cpu:0")
    with one.scope():
        m = cudist.metrics.Mean()
    assert type(m.total) is cudist.Variable
    central = cudist.CentralStorageStrategy(["/cpu:0", "/cpu:1"], parameter_device="/cpu:0")
    with central.scope():
        m = cudist.metrics.Mean()
    assert len(central.experimental_local_results(m.total)) == 1
    central.run(lambda: m.update_state(np.ones(2, np.float32)))
    assert m.result() == 1.0 and float(m.count.value()) == 4.0


def test_metrics_take_jax_arrays():
    jnp = pytest.importorskip("jax.numpy", reason="JAX is in the test extra (jax[cpu]); without it this check is skipped")
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        acc = cudist.metrics.SparseCategoricalAccuracy()
        mean = cudist.metrics.Mean()

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        logits = jnp.eye(3, dtype=jnp.float32)
        acc.update_state(jnp.array([0, 1, r + 1]), logits)
        mean.update_state(jnp.arange(3.0) + r)

    strategy.run(step)
    assert acc.result() == pytest.approx(5 / 6) and isinstance(acc.result(), np.float32)
    assert mean.result() == pytest.approx(1.5)


def test_metrics_are_checkpointable_across_replica_counts(tmp_path):
    import cudist.train

    two = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with two.scope():
        acc = cudist.metrics.SparseCategoricalAccuracy()
        loss = cudist.metrics.Mean(name="loss")
    logits = np.eye(4, dtype=np.float32)

    def step(labels):
        acc.update_state(labels, logits[: len(labels)])
        loss.update_state(np.asarray(labels, np.float32))

    per_replica = two.experimental_distribute_values_from_function(lambda c: [np.array([0, 1, 3]), np.array([2, 2])][c.replica_id_in_sync_group])
    two.run(step, args=(per_replica,))
    want = (acc.result(), loss.result())
    path = cudist.train.Checkpoint(acc=acc, loss=loss).save(str(tmp_path / "ckpt"))

    three = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with three.scope():
        acc2 = cudist.metrics.SparseCategoricalAccuracy()
        loss2 = cudist.metrics.Mean(name="loss")
    cudist.train.Checkpoint(acc=acc2, loss=loss2).restore(path).assert_consumed()
    assert (acc2.result(), loss2.result()) == want == (np.float32(2 / 5), np.float32(8 / 5))
    three.run(lambda: acc2.update_state(np.array([0]), logits[:1]))  # 3 more hits, 3 more examples
    assert acc2.result() == pytest.approx(5 / 8, rel=1e-6)  # restored as value / 3 per replica: float rounding


@pytest.mark.parametrize("bad", [None, [1.0, None], np.array([2.0, None], dtype=object)], ids=["None", "list", "object"])
def test_values_that_are_not_numbers_are_refused_and_leave_the_state_alone(bad):
    """NumPy casts None to NaN, which would poison the total for good; Keras 3 raises ValueError
    ("None is not a valid value for jnp.array", observed with Keras 3.15.1 on JAX), and so does cudist."""
    m = cudist.metrics.Mean()
    m.update_state([1.0, 3.0])
    with pytest.raises(ValueError, match=r"expected numbers, got .*None.* \(dtype object\)"):
        m.update_state(bad)
    if bad is not None:  # (sample_weight=None is no weighting)
        with pytest.raises(ValueError, match="expected numbers"):
            m.update_state([1.0, 2.0], sample_weight=bad)
    m.update_state(5.0)
    assert m.result() == 3.0
    s = cudist.metrics.Sum()
    with pytest.raises(ValueError, match="expected numbers"):
        s.update_state(bad)
    assert s.result() == 0.0
    acc = cudist.metrics.CategoricalAccuracy()
    with pytest.raises(ValueError, match="expected numbers"):
        acc.update_state([[0.0, 1.0]], [[0.2, None]])
    assert acc.result() == 0.0
