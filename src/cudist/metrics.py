"""``cudist.metrics``: Keras 3's streaming metrics, with their state in sync-on-read variables.

As Keras does, a metric creates its state variables when it is constructed, in the current
strategy's scope, with ``synchronization=ON_READ`` and ``aggregation=SUM``: under
``MirroredStrategy`` each replica accumulates into its own component inside ``strategy.run``
(including a replica that got an empty batch), and a read outside ``run`` (``result()``) sums the
components -- the metric over the whole global batch. Under ``CentralStorageStrategy`` the
replicas' updates are summed into the one copy; under ``OneDeviceStrategy`` and the default
strategy the variables are plain. Construct metrics inside ``strategy.scope()``, as Keras needs.

Every metric has Keras's interface: ``update_state(...)``, ``result()``, ``reset_state()``,
``__call__`` (update, then result), ``name``, ``dtype`` (a NumPy dtype; float32 by default) and
``variables`` (the cudist Variables holding the state, which is what a checkpoint saves).

Updating a sync-on-read metric outside ``run`` (in cross-replica context), which TF refuses for
SUM-aggregated variables, adds the update to the first replica's component, so the sum reads right.

``result()`` outside ``run`` is a NumPy scalar (a 0-d CuPy array when the state is on a GPU);
inside ``run`` it is the replica's own partial result, as in TF.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cudist import losses as _losses_module
from cudist._arrays import array_namespace
from cudist._distribute_lib import get_replica_context, get_strategy
from cudist._variables import SyncOnReadVariable, Variable, VariableAggregation, VariableSynchronization

__all__ = [
    "Metric",
    "Mean",
    "Sum",
    "MeanMetricWrapper",
    "Accuracy",
    "SparseCategoricalAccuracy",
    "CategoricalAccuracy",
    "SparseCategoricalCrossentropy",
    "MeanSquaredError",
    "accuracy",
    "sparse_categorical_accuracy",
    "categorical_accuracy",
]

squeeze_or_expand_to_same_rank = _losses_module.squeeze_or_expand_to_same_rank


def _asarray(xp: Any, x: Any, dtype: Any = None) -> Any:
    # Not numbers (None: NaN for good in a metric's total) are refused, as Keras refuses them.
    x = _losses_module.as_numeric(xp, x)
    if dtype is not None and x.dtype != np.dtype(dtype):
        x = x.astype(dtype)
    return x


def _namespace(*values: Any) -> Any:
    """The namespace of the first array among ``values`` (NumPy for Python values)."""
    for v in values:
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            return array_namespace(v)
    return np


class Metric:
    """Base class of the metrics (``keras.metrics.Metric``).

    Subclasses create their state with :meth:`add_variable` in ``__init__`` and implement
    :meth:`update_state` and :meth:`result`.

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (default float32).
    """

    def __init__(self, name: str | None = None, dtype: Any = None):
        self._name = name if name is not None else _snake(type(self).__name__)
        self._dtype = np.dtype("float32" if dtype is None else dtype)
        self._strategy = get_strategy()
        self._variables: list[Variable] = []

    # ---- properties
    @property
    def name(self) -> str:
        return self._name

    @property
    def dtype(self) -> np.dtype[Any]:
        """The dtype of the state and the result (a NumPy dtype; Keras gives its name)."""
        return self._dtype

    @property
    def variables(self) -> list[Variable]:
        """The state variables, in creation order (what a checkpoint saves and restores)."""
        return list(self._variables)

    # ---- state
    def add_variable(self, shape: tuple[int, ...] = (), dtype: Any = None, aggregation: str = "sum", name: str | None = None) -> Variable:
        """Creates a zero-initialized state variable as Keras does: in the current strategy's scope,
        not trainable, ``synchronization=ON_READ`` with ``aggregation`` (default SUM)."""
        dtype = self._dtype if dtype is None else np.dtype(dtype)
        agg = VariableAggregation[aggregation.upper()] if isinstance(aggregation, str) else aggregation
        var = Variable(
            np.zeros(shape, dtype=dtype),
            trainable=False,
            name=f"{self._name}/{name or 'variable'}",
            dtype=dtype,
            synchronization=VariableSynchronization.ON_READ,
            aggregation=agg,
        )
        self._variables.append(var)
        return var

    def _in_own_replica_context(self) -> bool:
        ctx = get_replica_context()
        return ctx is not None and ctx.strategy is self._strategy

    def _assign_add(self, var: Variable, delta: Any) -> None:
        """Adds ``delta`` (a 0-d array of the variable's dtype) to ``var``.

        Each call passes a new array: replicas of CentralStorageStrategy sum their updates in a
        merge_call, which refuses one object shared by every replica.
        """
        xp = array_namespace(delta)
        delta = xp.array(delta, dtype=var.dtype, copy=True) if xp is not np else np.array(delta, dtype=var.dtype)
        if isinstance(var, SyncOnReadVariable) and not self._in_own_replica_context():
            # Cross-replica: TF refuses assign_add on a SUM sync-on-read variable; adding to the
            # first component keeps the sum (what a read returns) right.
            var.values[0].assign_add(delta, read_value=False)
            return
        var.assign_add(delta, read_value=False)

    @staticmethod
    def _read(var: Variable) -> Any:
        """The variable's value: the aggregate outside ``run``, the replica's component inside."""
        return var.value()

    def reset_state(self) -> None:
        """Sets every state variable to zero (call it outside ``run``)."""
        for v in self._variables:
            v.assign(np.zeros(v.shape, dtype=v.dtype), read_value=False)

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``update_state(*args, **kwargs)``, then ``result()``."""
        self.update_state(*args, **kwargs)
        return self.result()

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype.name}

    def __repr__(self) -> str:
        return f"<cudist.metrics.{type(self).__name__} name={self.name!r}>"


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


def _scalar(a: Any) -> Any:
    """A host 0-d array as a NumPy scalar; device arrays as they are."""
    if isinstance(a, np.ndarray) and a.ndim == 0:
        return a[()]
    return a


def _samplewise(xp: Any, values: Any, sample_weight: Any, reduce_fn: str, dtype: np.dtype[Any]) -> tuple[Any, Any]:
    """Keras's ``reduce_to_samplewise_values``: values cast to ``dtype``; with weights, both brought
    to the same rank, values reduced to the weights' rank, weighted; then reduced to rank 1."""
    values = _asarray(xp, values, dtype)
    fn = getattr(xp, reduce_fn)
    if sample_weight is not None:
        sample_weight = _asarray(xp, sample_weight, dtype)
        values, sample_weight = squeeze_or_expand_to_same_rank(values, sample_weight)
        weight_ndim, values_ndim = sample_weight.ndim, values.ndim
        if values_ndim > weight_ndim:
            values = fn(values, axis=tuple(range(weight_ndim, values_ndim)))
        sample_weight = xp.broadcast_to(sample_weight, values.shape)
        values = values * sample_weight
        if weight_ndim > 1:
            sample_weight = fn(sample_weight, axis=tuple(range(1, weight_ndim)))
    if values.ndim > 1:
        values = fn(values, axis=tuple(range(1, values.ndim)))
    return values, sample_weight


class Sum(Metric):
    """The (weighted) sum of the values (``keras.metrics.Sum``). State: ``total``."""

    def __init__(self, name: str = "sum", dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_variable(name="total")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        xp = _namespace(values, sample_weight)
        values, _ = _samplewise(xp, values, sample_weight, "sum", self.dtype)
        self._assign_add(self.total, xp.sum(values))

    def result(self) -> Any:
        return _scalar(self._read(self.total))


class Mean(Metric):
    """The (weighted) mean of the values (``keras.metrics.Mean``). State: ``total``, ``count``."""

    def __init__(self, name: str = "mean", dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_variable(name="total")
        self.count = self.add_variable(name="count")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        xp = _namespace(values, sample_weight)
        values, sample_weight = _samplewise(xp, values, sample_weight, "mean", self.dtype)
        if sample_weight is not None:
            num_samples = xp.sum(sample_weight)
        elif values.ndim >= 1:
            num_samples = values.shape[0]
        else:
            num_samples = 1
        self._assign_add(self.total, xp.sum(values))
        self._assign_add(self.count, xp.asarray(num_samples, dtype=self.dtype))

    def result(self) -> Any:
        total, count = self._read(self.total), self._read(self.count)
        xp = array_namespace(total)
        if xp is np:
            return _scalar(total / count if count != 0 else np.zeros((), total.dtype))
        return xp.where(count == 0, 0, total / xp.where(count == 0, 1, count)).astype(total.dtype)


class MeanMetricWrapper(Mean):
    """The mean of ``fn(y_true, y_pred, **kwargs)`` over the examples (``keras.metrics.MeanMetricWrapper``)."""

    def __init__(self, fn: Any, name: str | None = None, dtype: Any = None, **kwargs: Any):
        super().__init__(name=name if name is not None else getattr(fn, "__name__", "mean_metric_wrapper"), dtype=dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        values = self._fn(y_true, y_pred, **self._fn_kwargs)
        super().update_state(values, sample_weight=sample_weight)


# ------------------------------------------------------------------------------ metric functions
def accuracy(y_true: Any, y_pred: Any) -> Any:
    """1.0 where ``y_true == y_pred`` (elementwise, after Keras's rank matching), else 0.0."""
    xp = _namespace(y_pred, y_true)
    y_pred = _asarray(xp, y_pred)
    y_true = _asarray(xp, y_true, y_pred.dtype)
    y_true, y_pred = squeeze_or_expand_to_same_rank(y_true, y_pred)
    return (y_true == y_pred).astype(np.float32)


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> Any:
    """1.0 where the integer label equals ``argmax(y_pred, axis=-1)``, else 0.0 (Keras's rules for
    labels of shape ``(n, 1)`` included)."""
    xp = _namespace(y_pred, y_true)
    y_pred = _asarray(xp, y_pred)
    y_true = _asarray(xp, y_true, y_pred.dtype)
    y_true_shape = tuple(y_true.shape)
    reshape = False
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = y_true.reshape(y_true_shape[:-1])
        reshape = True
    predicted = xp.argmax(y_pred, axis=-1).astype(y_true.dtype)
    matches = (y_true == predicted).astype(np.float32)
    if reshape:
        matches = matches.reshape(y_true_shape)
    if matches.ndim > 1 and matches.shape[-1] == 1:
        matches = matches.reshape(tuple(matches.shape[:-1]))
    return matches


def categorical_accuracy(y_true: Any, y_pred: Any) -> Any:
    """1.0 where ``argmax(y_true) == argmax(y_pred)`` along the last axis, else 0.0."""
    xp = _namespace(y_pred, y_true)
    y_pred = _asarray(xp, y_pred)
    labels = xp.argmax(_asarray(xp, y_true), axis=-1).astype(y_pred.dtype)
    labels_shape = tuple(labels.shape)
    reshape = False
    if labels.ndim == y_pred.ndim:
        labels = labels.reshape(labels_shape[:-1])
        reshape = True
    predicted = xp.argmax(y_pred, axis=-1).astype(labels.dtype)
    matches = (labels == predicted).astype(np.float32)
    if reshape:
        matches = matches.reshape(labels_shape)
    return matches


# ------------------------------------------------------------------------------ metric classes
class Accuracy(MeanMetricWrapper):
    """How often ``y_pred`` equals ``y_true`` (``keras.metrics.Accuracy``)."""

    def __init__(self, name: str = "accuracy", dtype: Any = None):
        super().__init__(accuracy, name=name, dtype=dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label is the argmax of the predictions (``keras.metrics.SparseCategoricalAccuracy``).

    Logits work as well as probabilities.
    """

    def __init__(self, name: str = "sparse_categorical_accuracy", dtype: Any = None):
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax of one-hot labels is that of the predictions (``keras.metrics.CategoricalAccuracy``)."""

    def __init__(self, name: str = "categorical_accuracy", dtype: Any = None):
        super().__init__(categorical_accuracy, name=name, dtype=dtype)


class SparseCategoricalCrossentropy(MeanMetricWrapper):
    """The mean cross-entropy of integer labels (``keras.metrics.SparseCategoricalCrossentropy``).

    Args:
        name: default "sparse_categorical_crossentropy".
        dtype: the state's dtype.
        from_logits: ``y_pred`` holds logits (else probabilities, clipped as in Keras).
        axis: the class axis; only -1.
    """

    def __init__(self, name: str = "sparse_categorical_crossentropy", dtype: Any = None, from_logits: bool = False,
                 axis: int = -1):
        super().__init__(_losses_module.sparse_categorical_crossentropy, name=name, dtype=dtype,
                         from_logits=from_logits, axis=axis)
        self.from_logits = from_logits
        self.axis = axis


class MeanSquaredError(MeanMetricWrapper):
    """The mean of the per-example mean squared errors (``keras.metrics.MeanSquaredError``)."""

    def __init__(self, name: str = "mean_squared_error", dtype: Any = None):
        super().__init__(_losses_module.mean_squared_error, name=name, dtype=dtype)

