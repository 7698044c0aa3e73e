"""``cudist.nn``: TF's loss-scaling helpers for custom training loops (``tf.nn.compute_average_loss``,
``tf.nn.scale_regularization_loss``), replica-context aware.

Inside ``strategy.run`` each replica sees its share of the global batch. Dividing each replica's
summed loss by the *global* batch size makes the replicas' gradients add up (``apply_gradients``
sums them) to the gradient of the mean over the whole batch, whatever the number of replicas.

Both work on NumPy and CuPy arrays, and on any array whose type names its namespace through
``__array_namespace__`` (JAX arrays and JAX tracers included, so they can sit inside a function
that ``jax.value_and_grad`` differentiates); the result is an array of the input's kind.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from cudist._arrays import array_namespace, python_dtype
from cudist._distribute_lib import get_strategy, has_strategy, in_cross_replica_context
from cudist.errors import InvalidArgumentError

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def _as_array(x: Any) -> Any:
    """``x`` itself when it is an array of some namespace; Python values as NumPy arrays with TF's dtypes."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic):
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    return python_dtype(np.asarray(x))


def _num_replicas(what: str) -> int:
    """The number of replicas in sync, after TF's check that we are not in cross-replica context."""
    if has_strategy() and in_cross_replica_context():
        raise RuntimeError(
            f"You are calling `{what}` in cross replica context, while it was expected to be called in replica context."
        )
    return int(get_strategy().num_replicas_in_sync)


def _scale_by_sample_weight(losses: Any, sample_weight: Any) -> Any:
    """TF's ``scale_losses_by_sample_weight``: both cast to float32, weights squeezed or expanded
    by one trailing dimension to the losses' rank, multiplied (broadcasting)."""
    xp = array_namespace(losses)
    w = sample_weight
    if not (hasattr(w, "shape") and hasattr(w, "dtype")) or array_namespace(w) is not xp:
        w = xp.asarray(np.asarray(w) if array_namespace(w) is np else w)
    losses32 = losses.astype(np.float32)
    w32 = w.astype(np.float32)
    if w32.ndim != 0:
        if w32.ndim - losses32.ndim == 1:
            if w32.shape[-1] != 1:
                raise InvalidArgumentError(  # TF's error (a ValueError too)
                    f"sample_weight of shape {tuple(w32.shape)} does not fit per-example losses of shape "
                    f"{tuple(losses32.shape)}: its extra last dimension must be 1"
                )
            w32 = w32.reshape(w32.shape[:-1])
        elif losses32.ndim - w32.ndim == 1:
            w32 = w32.reshape(tuple(w32.shape) + (1,))
    try:
        np.broadcast_shapes(tuple(losses32.shape), tuple(w32.shape))
    except ValueError:
        raise InvalidArgumentError(  # TF's "Incompatible shapes: [4] vs. [3]"
            f"sample_weight of shape {tuple(w.shape)} does not broadcast against per-example losses of shape "
            f"{tuple(losses.shape)}"
        ) from None
    return losses32 * w32


def _check_global_batch_size(global_batch_size: Any) -> int:
    """TF's checks: a scalar, an integer, not negative."""
    value = global_batch_size
    if hasattr(value, "shape") and not isinstance(value, np.generic):
        if tuple(value.shape) != ():
            raise ValueError(f"global_batch_size must be scalar, got shape {tuple(value.shape)}")
        if not np.issubdtype(np.dtype(str(value.dtype)), np.integer):
            raise TypeError(f"global_batch_size must be an integer, got dtype {value.dtype}")
        value = int(value)
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"global_batch_size must be an integer, got {global_batch_size!r}")
    value = int(value)
    if value < 0:
        raise InvalidArgumentError(f"global_batch_size must be non-negative, got {value}")  # TF's (a ValueError)
    return value


def compute_average_loss(per_example_loss: Any, sample_weight: Any = None, global_batch_size: Any = None) -> Any:
    """Scales per-example losses by sample weights and averages them over the global batch
    (``tf.nn.compute_average_loss``).

    ``sum(per_example_loss * sample_weight) / global_batch_size``, in the loss's dtype. Called
    inside ``strategy.run``, each replica divides its own sum by the global batch, so the
    replicas' losses (and gradients) add up to the mean over the whole batch.

    As TF:

    * without ``global_batch_size``, the global batch is this replica's batch (the first dimension
      of ``per_example_loss``) times ``num_replicas_in_sync`` -- which is only the true global batch
      when the replicas' batches are equal; with a batch that does not split evenly (the last one
      of a dataset, say) pass ``global_batch_size`` explicitly;
    * a global batch of 0 (e.g. a replica that got an empty batch) gives 0, not NaN;
    * ``sample_weight`` (a scalar, or per-example weights, with at most one extra or one missing
      trailing dimension) is applied in float32 and the product cast back to the loss's dtype
      (TF's ``scale_losses_by_sample_weight``; float64 losses lose precision there, as in TF);
    * integer losses give a float64 result.

    Args:
        per_example_loss: the per-example losses, at least rank 1 (a NumPy, CuPy or JAX array, or a
            nested Python list).
        sample_weight: optional weights, broadcast against the losses.
        global_batch_size: optional global batch size, a non-negative integer.

    Returns:
        A scalar: a NumPy scalar for NumPy input, a 0-d array for CuPy or JAX input.

    Raises:
        ValueError: ``per_example_loss`` is a scalar (rank 0); a negative or non-scalar
            ``global_batch_size``.
        TypeError: a ``global_batch_size`` that is not an integer.
        RuntimeError: no ``global_batch_size`` given, in cross-replica context (inside
            ``strategy.scope()`` but outside ``run``).
    """
    losses = _as_array(per_example_loss)
    if losses.ndim == 0:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1. Received "
            f"per_example_loss={per_example_loss} with rank 0"
        )
    input_dtype = losses.dtype
    if sample_weight is not None:
        losses = _scale_by_sample_weight(losses, sample_weight).astype(input_dtype)
    if global_batch_size is None:
        global_batch_size = int(losses.shape[0]) * _num_replicas("compute_average_loss")
    else:
        global_batch_size = _check_global_batch_size(global_batch_size)
    out_dtype = input_dtype if np.issubdtype(np.dtype(str(input_dtype)), np.inexact) else np.float64
    total = losses.sum().astype(out_dtype)
    if global_batch_size == 0:
        return total * 0  # div_no_nan
    return total / np.dtype(out_dtype).type(global_batch_size)


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divides the sum of the regularization losses by the number of replicas
    (``tf.nn.scale_regularization_loss``).

    Each replica adds the full regularization loss of the (shared) weights to its loss; dividing by
    ``num_replicas_in_sync`` makes the sum over the replicas count it once.

    Args:
        regularization_loss: a scalar, an array (summed), or a list of scalars (summed, as TF's
            ``reduce_sum`` of the list).

    Returns:
        A scalar of the loss's dtype (float64 for integer losses).

    Raises:
        RuntimeError: called in cross-replica context (inside ``strategy.scope()``, outside ``run``).
    """
    n = _num_replicas("scale_regularization_loss")
    if isinstance(regularization_loss, (list, tuple)):
        parts = [_as_array(r) for r in regularization_loss]
        if not parts:
            return np.float32(0.0)
        total = parts[0].sum()
        for p in parts[1:]:
            total = total + p.sum()
    else:
        total = _as_array(regularization_loss).sum()
    if not np.issubdtype(np.dtype(str(total.dtype)), np.inexact):
        total = total.astype(np.float64)
    return total / np.dtype(str(total.dtype)).type(n)
