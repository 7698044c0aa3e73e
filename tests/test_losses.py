"""cudist.losses and cudist.nn against Keras 3 / TF 2.21 (values recorded in tests/data), and their
gradients against TF's autodiff (recorded) and finite differences.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_data import dec, reference

import cudist
import cudist.losses
import cudist.nn

LOSS_CASES = reference()["losses"]


def _case_id(c):
    extra = ",".join(f"{k}={v}" for k, v in c["kwargs"].items())
    return f"{c['class']}({extra}){'-weighted' if 'sample_weight' in c else ''}"


def _make(case):
    return getattr(cudist.losses, case["class"])(**case["kwargs"])


@pytest.mark.parametrize("case", LOSS_CASES, ids=[_case_id(c) for c in LOSS_CASES])
def test_value_and_gradient_match_keras(case):
    loss = _make(case)
    y_true, y_pred = dec(case["y_true"]), dec(case["y_pred"])
    sw = dec(case["sample_weight"]) if "sample_weight" in case else None
    want, want_grad = dec(case["value"]), dec(case["gradient"])
    value = loss(y_true, y_pred, sample_weight=sw)
    assert np.shape(value) == want.shape
    assert np.asarray(value).dtype == np.float32
    np.testing.assert_allclose(value, want, rtol=2e-6, atol=1e-6)
    v2, grad = loss.value_and_gradient(y_true, y_pred, sample_weight=sw)
    np.testing.assert_array_equal(v2, value)
    assert grad.shape == y_pred.shape and grad.dtype == np.float32
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(loss.gradient(y_true, y_pred, sample_weight=sw), grad)


def test_the_recorded_cases_cover_every_loss_and_reduction():
    seen = {(c["class"], c["kwargs"].get("reduction", "sum_over_batch_size"), "sample_weight" in c) for c in LOSS_CASES}
    for cls in ("SparseCategoricalCrossentropy", "CategoricalCrossentropy", "MeanSquaredError", "BinaryCrossentropy"):
        for red in ("sum_over_batch_size", "sum", "none", "mean_with_sample_weight"):
            assert (cls, red, True) in seen and (cls, red, False) in seen


LOSSES = [
    ("SparseCategoricalCrossentropy", {"from_logits": True}, "sparse"),
    ("SparseCategoricalCrossentropy", {}, "sparse_prob"),
    ("CategoricalCrossentropy", {"from_logits": True, "label_smoothing": 0.1}, "onehot"),
    ("CategoricalCrossentropy", {}, "onehot_prob"),
    ("BinaryCrossentropy", {"from_logits": True}, "binary"),
    ("BinaryCrossentropy", {"label_smoothing": 0.2}, "binary_prob"),
    ("MeanSquaredError", {}, "regression"),
]


def _inputs(kind, rng, n=5, c=4):
    logits = rng.standard_normal((n, c))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return {
        "sparse": (rng.integers(0, c, n), logits),
        "sparse_prob": (rng.integers(0, c, n), probs),
        "onehot": (np.eye(c)[rng.integers(0, c, n)], logits),
        "onehot_prob": (np.eye(c)[rng.integers(0, c, n)], rng.uniform(0.1, 1.0, (n, c))),
        "binary": (rng.integers(0, 2, (n, c)).astype(float), logits),
        "binary_prob": (rng.integers(0, 2, (n, c)).astype(float), rng.uniform(0.05, 0.95, (n, c))),
        "regression": (rng.standard_normal((n, c)), logits),
    }[kind]


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "none", "mean_with_sample_weight"])
@pytest.mark.parametrize("cls, kwargs, kind", LOSSES, ids=[f"{c}-{k}" for c, _, k in LOSSES])
def test_gradient_matches_finite_differences_in_float64(cls, kwargs, kind, reduction):
    rng = np.random.default_rng(7)
    y_true, y_pred = _inputs(kind, rng)
    sw = rng.uniform(0.5, 2.0, len(y_pred))
    loss = getattr(cudist.losses, cls)(reduction=reduction, **kwargs)
    value, grad = loss.value_and_gradient(y_true, y_pred, sample_weight=sw)
    assert np.asarray(value).dtype == np.float64 and grad.dtype == np.float64  # float64 stays float64
    eps = 1e-6
    numeric = np.zeros_like(y_pred)
    for idx in np.ndindex(y_pred.shape):
        up, down = y_pred.copy(), y_pred.copy()
        up[idx] += eps
        down[idx] -= eps
        numeric[idx] = (np.sum(loss(y_true, up, sample_weight=sw)) - np.sum(loss(y_true, down, sample_weight=sw))) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def test_empty_batch_reduces_to_zero():
    # Keras returns the empty per-example array itself for a rank-1 empty batch; we give a 0-d
    # zero (and an empty gradient), which reduces across replicas.
    loss = cudist.losses.SparseCategoricalCrossentropy(from_logits=True)
    value, grad = loss.value_and_gradient(np.zeros(0, np.int64), np.zeros((0, 10), np.float32))
    assert np.shape(value) == () and value == 0 and value.dtype == np.float32
    assert grad.shape == (0, 10)
    none = cudist.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    assert none(np.zeros(0, np.int64), np.zeros((0, 10), np.float32)).shape == (0,)
    assert cudist.losses.MeanSquaredError(reduction="sum")(np.zeros((0, 3)), np.zeros((0, 3))) == 0


def test_sum_over_batch_size_is_scaled_by_the_replicas_inside_run():
    # Keras 3 (TF backend) divides "sum_over_batch_size" by num_replicas_in_sync under a strategy;
    # recorded: 4 replicas, 6 examples split [2, 2, 2, 0].
    ref = reference()["distributed_losses"]
    y, logits = dec(ref["y"]), dec(ref["logits"])
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    for case in ref["cases"]:
        loss = cudist.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=case["reduction"])
        dataset = cudist.data.Dataset.from_tensor_slices((y, logits)).batch(6)
        for batch in strategy.experimental_distribute_dataset(dataset):
            out = strategy.run(lambda b: loss.value_and_gradient(b[0], b[1]), args=(batch,))
            values = strategy.experimental_local_results(out[0])
            grads = strategy.experimental_local_results(out[1])
        for r, want in enumerate(case["per_replica"]):
            want = dec(want)
            if want.shape == (0,):  # Keras's empty-batch result; ours is 0
                assert values[r] == 0 and grads[r].shape == (0, 10)
            else:
                np.testing.assert_allclose(values[r], want.reshape(()), rtol=2e-6)
        # Each replica's gradient is that of its value: "sum" adds up to the whole batch's; the
        # mean divides by 2 rows x 4 replicas = 8 per replica where the whole batch has 6.
        whole = cudist.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=case["reduction"]).gradient(y, logits)
        factor = 1.0 if case["reduction"] == "sum" else 6 / 8
        np.testing.assert_allclose(np.concatenate(grads), factor * whole, rtol=1e-5, atol=1e-7)


def test_call_gives_per_example_values_and_functions_match_the_classes():
    rng = np.random.default_rng(1)
    y, logits = rng.integers(0, 3, 4), rng.standard_normal((4, 3)).astype(np.float32)
    loss = cudist.losses.SparseCategoricalCrossentropy(from_logits=True)
    per_example = loss.call(y, logits)
    assert per_example.shape == (4,)
    np.testing.assert_allclose(cudist.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), per_example)
    np.testing.assert_allclose(loss(y, logits), per_example.mean(), rtol=1e-6)
    np.testing.assert_allclose(cudist.losses.categorical_crossentropy(np.eye(3)[y], logits, from_logits=True),
                               per_example, rtol=1e-6)
    assert loss.name == "sparse_categorical_crossentropy" and loss.reduction == "sum_over_batch_size"
    assert cudist.losses.Reduction.NONE == "none"
    assert cudist.losses.MeanSquaredError().get_config() == {"name": "mean_squared_error", "reduction": "sum_over_batch_size"}


def test_argument_errors():
    with pytest.raises(ValueError, match="reduction"):
        cudist.losses.MeanSquaredError(reduction="auto")
    loss = cudist.losses.SparseCategoricalCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match="same shape up until the last dimension"):
        loss(np.zeros(3, np.int64), np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 5\)"):
        loss(np.array([0, 5]), np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="must have the same shape"):
        cudist.losses.CategoricalCrossentropy()(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="axis=-1"):
        cudist.losses.sparse_categorical_crossentropy(np.zeros(2), np.zeros((2, 3)), axis=0)


def test_losses_work_in_jax_and_jax_differentiates_them_to_the_same_gradient():
    jax = pytest.importorskip("jax", reason="JAX is in the test extra (jax[cpu]); without it this check is skipped")
    jnp = jax.numpy
    rng = np.random.default_rng(3)
    y, logits = rng.integers(0, 5, 6), rng.standard_normal((6, 5)).astype(np.float32)
    w = rng.uniform(0, 1, 6).astype(np.float32)
    for loss in (cudist.losses.SparseCategoricalCrossentropy(from_logits=True),
                 cudist.losses.CategoricalCrossentropy(label_smoothing=0.1),
                 cudist.losses.MeanSquaredError(reduction="sum")):
        target = y if isinstance(loss, cudist.losses.SparseCategoricalCrossentropy) else np.eye(5, dtype=np.float32)[y]
        pred = logits if loss.name != "categorical_crossentropy" else np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        value, grad = jax.value_and_grad(lambda p: loss(target, p, sample_weight=w))(jnp.asarray(pred))
        ours_value, ours_grad = loss.value_and_gradient(target, pred, sample_weight=w)
        np.testing.assert_allclose(value, ours_value, rtol=1e-6)
        np.testing.assert_allclose(grad, ours_grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------- cudist.nn
CAL = reference()["compute_average_loss"]


@pytest.mark.parametrize("case", CAL["plain"], ids=range(len(CAL["plain"])))
def test_compute_average_loss_matches_tf(case):
    kwargs = {}
    if "sample_weight" in case:
        kwargs["sample_weight"] = dec(case["sample_weight"])
    if "global_batch_size" in case:
        kwargs["global_batch_size"] = case["global_batch_size"]
    per_example = dec(case["per_example_loss"])
    out = cudist.nn.compute_average_loss(per_example, **kwargs)
    want = dec(case["value"])
    assert np.asarray(out).dtype == want.dtype and np.shape(out) == ()
    # TF weights float64 losses in float32 (its scale_losses_by_sample_weight): so do we.
    np.testing.assert_allclose(out, want, rtol=1e-6 if want.dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("case", CAL["replicas"], ids=[str(c["splits"]) for c in CAL["replicas"]])
def test_compute_average_loss_in_replica_context_matches_tf(case):
    # Without global_batch_size each replica divides by ITS batch x num_replicas (TF's rule): an
    # uneven split ([2, 2, 1, 0]) does not give the global mean, an empty replica gives 0.
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    pe, sw, gbs = dec(case["per_example_loss"]), dec(case["sample_weight"]), case["global_batch_size"]
    dataset = cudist.data.Dataset.from_tensor_slices((pe, sw)).batch(gbs)

    def fn(inputs):
        x, w = inputs
        return (
            cudist.nn.compute_average_loss(x),
            cudist.nn.compute_average_loss(x, sample_weight=w),
            cudist.nn.compute_average_loss(x, global_batch_size=gbs),
            cudist.nn.scale_regularization_loss(x.sum()),
        )

    (batch,) = list(strategy.experimental_distribute_dataset(dataset))
    assert [len(b) for b in strategy.experimental_local_results(batch[0])] == case["splits"]
    out = strategy.run(fn, args=(batch,))
    for got, key in zip(out, ("default", "weighted", "given", "scale_regularization_loss")):
        np.testing.assert_allclose(strategy.experimental_local_results(got), case[key], rtol=1e-6, atol=1e-7, err_msg=key)


def test_scale_regularization_loss_matches_tf_and_divides_by_the_replicas():
    assert cudist.nn.scale_regularization_loss(np.float32(3.0)) == CAL["scale_regularization_loss"]["plain"]
    assert cudist.nn.scale_regularization_loss([np.float32(1.0), np.float32(2.5)]) == CAL["scale_regularization_loss"]["list"]
    assert cudist.nn.scale_regularization_loss(3.0).dtype == np.float32  # Python floats: float32, as TF
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = strategy.run(lambda: cudist.nn.scale_regularization_loss(np.float32(3.0)))
    assert strategy.experimental_local_results(out) == (1.5, 1.5)


def test_compute_average_loss_errors_as_tf():
    with pytest.raises(ValueError, match="at least rank 1"):
        cudist.nn.compute_average_loss(np.float32(1.0))
    with pytest.raises(TypeError, match="must be an integer"):
        cudist.nn.compute_average_loss(np.ones(2), global_batch_size=2.0)
    with pytest.raises(ValueError, match="non-negative"):
        cudist.nn.compute_average_loss(np.ones(2), global_batch_size=-1)
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        with pytest.raises(RuntimeError, match="cross replica context"):
            cudist.nn.compute_average_loss(np.ones(2))
        assert cudist.nn.compute_average_loss(np.ones(2, np.float32), global_batch_size=4) == 0.5
        with pytest.raises(RuntimeError, match="cross replica context"):
            cudist.nn.scale_regularization_loss(1.0)
    assert cudist.nn.compute_average_loss([1.0, 2.0]).dtype == np.float32  # Python lists as TF converts them
    assert cudist.nn.compute_average_loss(np.array([1, 2, 3], np.int32)) == 2.0  # integers: float64
    assert cudist.nn.compute_average_loss(np.array([1, 2, 3], np.int32)).dtype == np.float64


def test_compute_average_loss_under_jax_grad():
    jax = pytest.importorskip("jax", reason="JAX is in the test extra (jax[cpu]); without it this check is skipped")
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        x = jax.numpy.arange(3.0)
        return jax.grad(lambda v: cudist.nn.compute_average_loss(v * v))(x)

    out = strategy.run(fn)  # the global batch is 3 x 2 replicas
    for g in strategy.experimental_local_results(out):
        np.testing.assert_allclose(g, 2 * np.arange(3.0) / 6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "none"])
def test_losses_and_helpers_on_cupy_arrays_match_numpy(reduction):
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(11)
    w = rng.uniform(0.5, 2.0, 5).astype(np.float32)
    for cls, kwargs, kind in LOSSES:
        y_true, y_pred = (a.astype(np.float32) if a.dtype == np.float64 else a for a in _inputs(kind, rng))
        loss = getattr(cudist.losses, cls)(reduction=reduction, **kwargs)
        want_value, want_grad = loss.value_and_gradient(y_true, y_pred, sample_weight=w)
        value, grad = loss.value_and_gradient(cupy.asarray(y_true), cupy.asarray(y_pred), sample_weight=cupy.asarray(w))
        assert isinstance(grad, cupy.ndarray) and grad.dtype == np.float32
        np.testing.assert_allclose(cupy.asnumpy(value), want_value, rtol=1e-5, atol=1e-7, err_msg=cls)
        np.testing.assert_allclose(cupy.asnumpy(grad), want_grad, rtol=1e-5, atol=1e-7, err_msg=cls)
    per_example = rng.standard_normal(6).astype(np.float32)
    got = cudist.nn.compute_average_loss(cupy.asarray(per_example), sample_weight=cupy.asarray(w[:1]), global_batch_size=8)
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(got), cudist.nn.compute_average_loss(per_example, sample_weight=w[:1], global_batch_size=8), rtol=1e-6)


def test_values_that_are_not_numbers_are_refused():
    """[1.0, None] would be NaN to NumPy and the loss NaN; refused, as Keras 3 refuses it."""
    import cudist.losses

    with pytest.raises(ValueError, match=r"expected numbers, got \[1\.0, None\]"):
        cudist.losses.MeanSquaredError()([1.0, None], np.ones(2, np.float32))
    with pytest.raises(ValueError, match="expected numbers"):
        cudist.losses.BinaryCrossentropy()(np.ones(2, np.float32), [0.5, None])
