"""``cudist.losses``: Keras 3's common losses, with their gradients (cudist does no autodiff).

Each loss class computes what its Keras 3 namesake computes -- per-example values, weighted by
``sample_weight`` and reduced by ``reduction`` -- and also the gradient of that result with
respect to the predictions (or logits)::

    loss_fn = cudist.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    per_example_loss, dlogits = loss_fn.value_and_gradient(labels, logits)
    loss = cudist.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
    dlogits = dlogits / GLOBAL_BATCH_SIZE          # d(loss)/d(logits), to backpropagate

Reductions (Keras 3's): ``"sum_over_batch_size"`` (the default: the weighted sum divided by the
number of elements of the per-example values), ``"sum"``, ``"none"`` / None (the weighted
per-example values), ``"mean"`` (as ``"sum_over_batch_size"``) and ``"mean_with_sample_weight"``
(divided by the sum of the weights). As Keras 3 does under a TF strategy, ``sum_over_batch_size``,
``mean`` and ``mean_with_sample_weight`` are further divided by the current strategy's
``num_replicas_in_sync``, so that inside ``strategy.run`` each replica's loss is its share of the
global mean and the replicas' gradients add up to the gradient of the whole batch (when the
replicas' batches are equal; else use ``"none"`` and :func:`cudist.nn.compute_average_loss` with
``global_batch_size``).

The gradient is that of the reduced value, or for ``"none"`` that of the sum of the weighted
per-example values (row ``i`` of it is the gradient of example ``i``'s weighted loss), always with
the shape of ``y_pred``.

Where we differ from Keras on purpose: an empty batch (0 examples) reduces to a 0-d zero (Keras
returns the empty array itself for a rank-1 empty batch, which then cannot be reduced across
replicas); the computation keeps ``y_pred``'s floating dtype (float64 stays float64) unless
``dtype`` is given, where Keras uses its ``floatx`` (float32).

Values and gradients work on NumPy and CuPy arrays and on arrays with an Array API namespace
(``jax.numpy``), so the value can also be differentiated by JAX itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cudist._arrays import array_namespace
from cudist._distribute_lib import get_strategy
from cudist.errors import InvalidArgumentError

__all__ = [
    "Loss",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "CategoricalCrossentropy",
    "BinaryCrossentropy",
    "MeanSquaredError",
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
    "mean_squared_error",
]

#: Keras's ``backend.epsilon()``: probabilities are clipped to [EPSILON, 1 - EPSILON].
EPSILON = 1e-7

_REDUCTIONS = ("sum_over_batch_size", "sum", None, "none", "mean", "mean_with_sample_weight")


class Reduction:
    """The reduction names, as ``tf.keras.losses.Reduction`` spells them (plain strings)."""

    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"


# ---------------------------------------------------------------------------------------- helpers
def as_numeric(xp: Any, x: Any) -> Any:
    """``x`` as an array of ``xp``, refusing values that are not numbers (``None`` in a list, ...).

    NumPy would make an object array of them, which casts ``None`` to NaN: a loss or a metric fed
    one would turn NaN for good. Keras 3 refuses them (``ValueError: None is not a valid value``,
    on the JAX and TF backends alike); so does cudist.

    Raises:
        ValueError: ``x`` holds something other than numbers.
    """
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) or array_namespace(x) is not xp:
        x = xp.asarray(x)
    if x.dtype == object:
        text = repr(x.tolist())
        raise ValueError(f"expected numbers, got {text if len(text) <= 80 else text[:77] + '...'} (dtype object)")
    return x


def _floating(xp: Any, x: Any, dtype: Any = None) -> Any:
    """``x`` as an array of ``xp`` with a floating dtype: ``dtype`` if given, else its own, float32 for others."""
    x = as_numeric(xp, x)
    if dtype is None:
        if np.issubdtype(np.dtype(x.dtype), np.floating):
            return x
        dtype = np.float32
    return x if x.dtype == np.dtype(dtype) else x.astype(dtype)


def _like(xp: Any, x: Any, dtype: Any) -> Any:
    """``x`` as an array of ``xp`` cast to ``dtype``."""
    x = as_numeric(xp, x)
    return x if x.dtype == np.dtype(dtype) else x.astype(dtype)


def squeeze_or_expand_to_same_rank(x1: Any, x2: Any, expand_rank_1: bool = True) -> tuple[Any, Any]:
    """Keras's rule: when the ranks differ by one and the longer's last dimension is 1, squeeze it
    (or, when the other is rank 1, expand that one instead)."""
    r1, r2 = x1.ndim, x2.ndim
    if r1 == r2:
        return x1, x2
    if r1 == r2 + 1 and x1.shape[-1] == 1:
        if r2 == 1 and expand_rank_1:
            x2 = x2.reshape(tuple(x2.shape) + (1,))
        else:
            x1 = x1.reshape(tuple(x1.shape[:-1]))
    if r2 == r1 + 1 and x2.shape[-1] == 1:
        if r1 == 1 and expand_rank_1:
            x1 = x1.reshape(tuple(x1.shape) + (1,))
        else:
            x2 = x2.reshape(tuple(x2.shape[:-1]))
    return x1, x2


def _unbroadcast(xp: Any, g: Any, shape: tuple[int, ...]) -> Any:
    """Sums ``g`` down to ``shape`` (the reverse of NumPy broadcasting)."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, (a, b) in enumerate(zip(g.shape, shape)) if b == 1 and a != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _num_replicas() -> int:
    return int(get_strategy().num_replicas_in_sync)


def _check_axis(axis: int, ndim: int) -> None:
    if axis != -1 and axis != ndim - 1:
        raise ValueError(f"Only axis=-1 is currently supported. Received: axis={axis}")


def _softmax_parts(xp: Any, logits: Any) -> tuple[Any, Any]:
    """(log-softmax, softmax) of ``logits`` along the last axis, computed stably."""
    shifted = logits - xp.max(logits, axis=-1, keepdims=True) if logits.shape[-1] else logits
    exp = xp.exp(shifted)
    total = xp.sum(exp, axis=-1, keepdims=True)
    return shifted - xp.log(total), exp / total


def _clip_mask(xp: Any, p: Any) -> tuple[Any, Any]:
    """``p`` clipped to [EPSILON, 1 - EPSILON] in its dtype, and where the clip let it through
    (TF's clip gradient passes where lo <= p <= hi)."""
    t = np.dtype(p.dtype).type
    lo, hi = t(EPSILON), t(1.0 - EPSILON)
    return xp.clip(p, lo, hi), (p >= lo) & (p <= hi)


# ---------------------------------------------------------------------- per-example losses (+ grads)
def _sparse_cce(y_true: Any, y_pred: Any, from_logits: bool, axis: int, grad: bool, dtype: Any = None) -> tuple[Any, Any, Any]:
    xp = array_namespace(y_pred)
    y_pred = _floating(xp, y_pred, dtype)
    labels = y_true if array_namespace(y_true) is xp and hasattr(y_true, "ndim") else xp.asarray(y_true)
    if labels.ndim == y_pred.ndim and labels.shape[-1] == 1:
        labels = labels.reshape(tuple(labels.shape[:-1]))
    if y_pred.ndim < 1:
        raise ValueError(f"Argument `output` must be at least rank 1. Received: output.shape={tuple(y_pred.shape)}")
    _check_axis(axis, y_pred.ndim)
    if tuple(labels.shape) != tuple(y_pred.shape[:-1]):
        raise ValueError(
            "Arguments `target` and `output` must have the same shape up until the last dimension: "
            f"target.shape={tuple(labels.shape)}, output.shape={tuple(y_pred.shape)}"
        )
    if not np.issubdtype(np.dtype(labels.dtype), np.integer):
        labels = labels.astype(np.int32)  # float labels truncate, as TF's cast (int32: JAX's default integer)
    num_classes = y_pred.shape[-1]
    if xp is np and labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}) for {num_classes} classes; got {labels.min()}..{labels.max()}")
    one_hot = labels[..., None] == xp.arange(num_classes)
    if from_logits:
        log_p, softmax = _softmax_parts(xp, y_pred)
        values = -xp.sum(xp.where(one_hot, log_p, 0), axis=-1)
        if not grad:
            return values, None, None
        return values, softmax - one_hot.astype(y_pred.dtype), y_pred.shape
    # Keras: clip the probabilities, take their log, and apply softmax cross-entropy to that:
    # -log(p_label) + log(sum(p)) with p clipped (the second term is ~0 for normalized p).
    clipped, mask = _clip_mask(xp, y_pred)
    total = xp.sum(clipped, axis=-1, keepdims=True)
    values = -xp.sum(xp.where(one_hot, xp.log(clipped), 0), axis=-1) + xp.log(total[..., 0])
    if not grad:
        return values, None, None
    g = xp.where(one_hot, -1 / clipped, 0) + 1 / total
    return values, xp.where(mask, g, 0), y_pred.shape


def _cce(y_true: Any, y_pred: Any, from_logits: bool, label_smoothing: float, axis: int, grad: bool, dtype: Any = None) -> tuple[Any, Any, Any]:
    xp = array_namespace(y_pred)
    y_pred = _floating(xp, y_pred, dtype)
    target = _like(xp, y_true, y_pred.dtype)
    if target.ndim < 1:
        raise ValueError(f"Arguments `target` and `output` must be at least rank 1. Received: target.shape={tuple(target.shape)}")
    if tuple(target.shape) != tuple(y_pred.shape):
        raise ValueError(
            f"Arguments `target` and `output` must have the same shape. Received: target.shape={tuple(target.shape)}, "
            f"output.shape={tuple(y_pred.shape)}"
        )
    _check_axis(axis, y_pred.ndim)
    if label_smoothing:
        num_classes = y_pred.shape[-1]
        target = target * (1.0 - label_smoothing) + label_smoothing / num_classes
        target = target.astype(y_pred.dtype)
    if from_logits:
        log_p, softmax = _softmax_parts(xp, y_pred)
        values = -xp.sum(target * log_p, axis=-1)
        if not grad:
            return values, None, None
        return values, softmax * xp.sum(target, axis=-1, keepdims=True) - target, y_pred.shape
    # Keras: normalize the probabilities to sum to one, clip, cross-entropy.
    total = xp.sum(y_pred, axis=-1, keepdims=True)
    q = y_pred / total
    clipped, mask = _clip_mask(xp, q)
    values = -xp.sum(target * xp.log(clipped), axis=-1)
    if not grad:
        return values, None, None
    dq = xp.where(mask, -target / clipped, 0)  # d(values)/d(q)
    # q = p / S: d/dp_j = dq_j / S - sum_c dq_c p_c / S^2
    return values, dq / total - xp.sum(dq * y_pred, axis=-1, keepdims=True) / (total * total), y_pred.shape


def _bce(y_true: Any, y_pred: Any, from_logits: bool, label_smoothing: float, axis: int, grad: bool, dtype: Any = None) -> tuple[Any, Any, Any]:
    xp = array_namespace(y_pred)
    y_pred = _floating(xp, y_pred, dtype)
    target = _like(xp, y_true, y_pred.dtype)
    if target.ndim != y_pred.ndim or tuple(target.shape) != tuple(y_pred.shape):
        raise ValueError(
            f"Arguments `target` and `output` must have the same shape. Received: target.shape={tuple(target.shape)}, "
            f"output.shape={tuple(y_pred.shape)}"
        )
    if label_smoothing:
        target = (target * (1.0 - label_smoothing) + 0.5 * label_smoothing).astype(y_pred.dtype)
    if from_logits:
        z = y_pred
        # TF's sigmoid_cross_entropy_with_logits: max(z, 0) - z * t + log(1 + exp(-|z|))
        elem = xp.maximum(z, 0) - z * target + xp.log1p(xp.exp(-xp.abs(z)))
        d_elem = (1 / (1 + xp.exp(-z)) - target) if grad else None
    else:
        clipped, mask = _clip_mask(xp, y_pred)
        elem = -(target * xp.log(clipped) + (1 - target) * xp.log(1 - clipped))
        d_elem = xp.where(mask, -target / clipped + (1 - target) / (1 - clipped), 0) if grad else None
    if elem.ndim < 1:
        raise ValueError(f"binary_crossentropy: y_pred must be at least rank 1, got shape {tuple(y_pred.shape)}")
    _check_axis(axis, elem.ndim)
    values = xp.mean(elem, axis=-1)
    if not grad:
        return values, None, None
    return values, d_elem / np.dtype(y_pred.dtype).type(elem.shape[-1]), y_pred.shape


def _mse(y_true: Any, y_pred: Any, grad: bool, dtype: Any = None) -> tuple[Any, Any, Any]:
    xp = array_namespace(y_pred)
    y_pred = _floating(xp, y_pred, dtype)
    target = _like(xp, y_true, y_pred.dtype)
    target, pred = squeeze_or_expand_to_same_rank(target, y_pred)
    # As Keras, y_true and y_pred broadcast against each other; shapes that do not are TF's
    # InvalidArgumentError ("Incompatible shapes: [2,3] vs. [2,4]").
    try:
        shape = np.broadcast_shapes(tuple(target.shape), tuple(pred.shape))
    except ValueError:
        dims = [",".join(map(str, s)) for s in (target.shape, pred.shape)]
        raise InvalidArgumentError(
            f"mean_squared_error: Incompatible shapes: [{dims[0]}] vs. [{dims[1]}] (y_true, y_pred)"
        ) from None
    if grad and shape != tuple(pred.shape):
        raise InvalidArgumentError(
            f"mean_squared_error: the gradient needs y_pred of the broadcast shape {shape}, got y_pred of shape "
            f"{tuple(y_pred.shape)} against y_true of shape {tuple(target.shape)}"
        )
    if pred.ndim < 1:
        raise ValueError(f"mean_squared_error: y_pred must be at least rank 1, got shape {tuple(y_pred.shape)}")
    diff = pred - target
    values = xp.mean(xp.square(diff), axis=-1)
    if not grad:
        return values, None, None
    # pred may be y_pred with a trailing axis of 1 added (Keras's rank matching); the gradient is
    # reshaped back at the end.
    return values, diff * np.dtype(y_pred.dtype).type(2.0 / diff.shape[-1]), y_pred.shape


def sparse_categorical_crossentropy(y_true: Any, y_pred: Any, from_logits: bool = False, axis: int = -1) -> Any:
    """Per-example cross-entropy of integer labels (``keras.losses.sparse_categorical_crossentropy``).

    ``y_true`` has ``y_pred``'s shape without the class axis (or with a class axis of 1); without
    ``from_logits``, ``y_pred`` holds probabilities, clipped to [1e-7, 1 - 1e-7] as in Keras.
    """
    return _sparse_cce(y_true, y_pred, from_logits, axis, grad=False)[0]


def categorical_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, label_smoothing: float = 0.0, axis: int = -1
) -> Any:
    """Per-example cross-entropy of one-hot (or soft) targets (``keras.losses.categorical_crossentropy``)."""
    return _cce(y_true, y_pred, from_logits, label_smoothing, axis, grad=False)[0]


def binary_crossentropy(
    y_true: Any, y_pred: Any, from_logits: bool = False, label_smoothing: float = 0.0, axis: int = -1
) -> Any:
    """Per-example binary cross-entropy, averaged over the last axis (``keras.losses.binary_crossentropy``)."""
    return _bce(y_true, y_pred, from_logits, label_smoothing, axis, grad=False)[0]


def mean_squared_error(y_true: Any, y_pred: Any) -> Any:
    """Per-example mean of the squared errors over the last axis (``keras.losses.mean_squared_error``)."""
    return _mse(y_true, y_pred, grad=False)[0]


# ---------------------------------------------------------------------------------------- classes
class Loss:
    """Base class of the losses: per-example values (:meth:`call`), weighted and reduced (``__call__``),
    and the gradient of the result w.r.t. ``y_pred`` (:meth:`gradient`, :meth:`value_and_gradient`).

    Args:
        name: the loss's name.
        reduction: one of "sum_over_batch_size" (default), "sum", "none" (or None), "mean",
            "mean_with_sample_weight".
        dtype: the dtype to compute in; default: ``y_pred``'s floating dtype (float32 for others).

    Subclasses implement ``_values(y_true, y_pred, grad)`` returning the per-example values and,
    when ``grad``, the per-example derivatives (shape ``values.shape + (k,)``: each value depends
    on the ``k`` entries of its row of the prediction's last axis) and ``y_pred``'s shape.
    """

    def __init__(self, name: str | None = None, reduction: str | None = "sum_over_batch_size", dtype: Any = None):
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"Invalid value for argument `reduction`. Expected one of {set(_REDUCTIONS)}. Received: reduction={reduction}"
            )
        self.name = name if name is not None else _snake(type(self).__name__)
        self.reduction = reduction
        self.dtype = None if dtype is None else np.dtype(dtype)

    def _values(self, y_true: Any, y_pred: Any, grad: bool) -> tuple[Any, Any, Any]:
        raise NotImplementedError

    def call(self, y_true: Any, y_pred: Any) -> Any:
        """The per-example losses (unweighted, unreduced)."""
        return self._values(y_true, y_pred, False)[0]

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        """The loss: per-example values weighted by ``sample_weight`` and reduced by ``reduction``."""
        return self._reduce(y_true, y_pred, sample_weight, grad=False)[0]

    def gradient(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        """The gradient of ``self(y_true, y_pred, sample_weight)`` w.r.t. ``y_pred`` (summed over the
        examples' values for reduction "none"), with ``y_pred``'s shape."""
        return self._reduce(y_true, y_pred, sample_weight, grad=True)[1]

    def value_and_gradient(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> tuple[Any, Any]:
        """``(self(y_true, y_pred, sample_weight), self.gradient(...))`` computed together."""
        return self._reduce(y_true, y_pred, sample_weight, grad=True)

    def _reduce(self, y_true: Any, y_pred: Any, sample_weight: Any, grad: bool) -> tuple[Any, Any]:
        values, jacobian, pred_shape = self._values(y_true, y_pred, grad)
        xp = array_namespace(values)
        dtype = values.dtype
        weighted, w, v2 = values, None, values
        if sample_weight is not None:
            w = _like(xp, sample_weight, dtype)
            v2, w = squeeze_or_expand_to_same_rank(values, w)
            weighted = v2 * w
        reduction = self.reduction
        if reduction is None or reduction == "none":
            scale = None
            out = weighted
        else:
            t = np.dtype(dtype).type
            out = xp.sum(weighted)
            scale = t(1.0)
            if reduction != "sum":
                if reduction == "mean_with_sample_weight" and w is not None:
                    divisor = xp.sum(w).astype(dtype)
                else:
                    divisor = t(weighted.size)
                # As Keras: divide_no_nan(sum, divisor), then times 1/num_replicas under a strategy.
                out = _div_no_nan(xp, out, divisor)
                scale = _div_no_nan(xp, t(1.0), divisor)
                n = _num_replicas()
                if n > 1:
                    out = out * t(1.0 / n)
                    scale = scale * t(1.0 / n)
            out = out.astype(dtype)
        if not grad:
            return out, None
        # d(out)/d(weighted): `scale` everywhere (ones for "none"); back through the weighting to values.
        if w is None:
            dvalues = xp.ones(values.shape, dtype=dtype)
            if scale is not None:
                dvalues = dvalues * scale
        else:
            dweighted = xp.broadcast_to(w, weighted.shape)
            if scale is not None:
                dweighted = dweighted * scale
            dvalues = _unbroadcast(xp, dweighted, tuple(v2.shape)).reshape(values.shape).astype(dtype)
        return out, (dvalues[..., None] * jacobian).reshape(pred_shape)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "reduction": self.reduction}

    def __repr__(self) -> str:
        return f"<cudist.losses.{type(self).__name__} name={self.name!r} reduction={self.reduction!r}>"


def _div_no_nan(xp: Any, x: Any, y: Any) -> Any:
    if xp is np:
        return x / y if y != 0 else np.zeros((), dtype=np.result_type(x, y))[()]
    return xp.where(y == 0, 0, x / xp.where(y == 0, 1, y))


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy of integer labels (``keras.losses.SparseCategoricalCrossentropy``).

    Args:
        from_logits: ``y_pred`` holds logits (else probabilities, clipped to [1e-7, 1 - 1e-7]).
        reduction: see :class:`Loss`.
        name: default "sparse_categorical_crossentropy".
        dtype: see :class:`Loss`.
    """

    def __init__(self, from_logits: bool = False, reduction: str | None = "sum_over_batch_size",
                 name: str = "sparse_categorical_crossentropy", dtype: Any = None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.from_logits = bool(from_logits)

    def _values(self, y_true: Any, y_pred: Any, grad: bool) -> tuple[Any, Any, Any]:
        return _sparse_cce(y_true, y_pred, self.from_logits, -1, grad, self.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "from_logits": self.from_logits}


class CategoricalCrossentropy(Loss):
    """Cross-entropy of one-hot (or soft) targets (``keras.losses.CategoricalCrossentropy``).

    Args:
        from_logits: ``y_pred`` holds logits (else probabilities: normalized to sum to 1 along the
            class axis, then clipped, as in Keras).
        label_smoothing: in [0, 1]: targets become ``t * (1 - s) + s / num_classes``.
        reduction: see :class:`Loss`.
        name: see :class:`Loss`.
        dtype: see :class:`Loss`.
    """

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, reduction: str | None = "sum_over_batch_size",
                 name: str = "categorical_crossentropy", dtype: Any = None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.from_logits = bool(from_logits)
        self.label_smoothing = float(label_smoothing)

    def _values(self, y_true: Any, y_pred: Any, grad: bool) -> tuple[Any, Any, Any]:
        return _cce(y_true, y_pred, self.from_logits, self.label_smoothing, -1, grad, self.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "from_logits": self.from_logits, "label_smoothing": self.label_smoothing}


class BinaryCrossentropy(Loss):
    """Binary cross-entropy, averaged over the last axis (``keras.losses.BinaryCrossentropy``).

    Args:
        from_logits: ``y_pred`` holds logits (else probabilities, clipped to [1e-7, 1 - 1e-7]).
        label_smoothing: in [0, 1]: targets become ``t * (1 - s) + s / 2``.
        reduction: see :class:`Loss`.
        name: see :class:`Loss`.
        dtype: see :class:`Loss`.
    """

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, reduction: str | None = "sum_over_batch_size",
                 name: str = "binary_crossentropy", dtype: Any = None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.from_logits = bool(from_logits)
        self.label_smoothing = float(label_smoothing)

    def _values(self, y_true: Any, y_pred: Any, grad: bool) -> tuple[Any, Any, Any]:
        return _bce(y_true, y_pred, self.from_logits, self.label_smoothing, -1, grad, self.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "from_logits": self.from_logits, "label_smoothing": self.label_smoothing}


class MeanSquaredError(Loss):
    """Mean of the squared errors over the last axis (``keras.losses.MeanSquaredError``)."""

    def __init__(self, reduction: str | None = "sum_over_batch_size", name: str = "mean_squared_error", dtype: Any = None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def _values(self, y_true: Any, y_pred: Any, grad: bool) -> tuple[Any, Any, Any]:
        return _mse(y_true, y_pred, grad, self.dtype)
