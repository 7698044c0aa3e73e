"""Batch splitting across replicas (the ceil rule of tf.distribute's input pipeline)."""

from __future__ import annotations

import numpy as np
import optree


def split_sizes(batch_size: int, n: int) -> list[int]:
    """Per-replica sizes: ceil(B/N) each in order, the last ones fewer or none.

    >>> split_sizes(8, 3), split_sizes(4, 3), split_sizes(5, 4)
    ([3, 3, 2], [2, 2, 0], [2, 2, 1, 0])
    """
    if n < 1:
        raise ValueError(f"split: the number of replicas must be >= 1, got {n}")
    per = -(-batch_size // n) if batch_size else 0
    return [max(0, min(per, batch_size - i * per)) for i in range(n)]


def split(batch, n: int) -> list:
    """Splits a nested batch into ``n`` pieces along dimension 0 (views for NumPy leaves).

    Every leaf must have the same leading (batch) dimension. Returns a list of ``n`` structures
    shaped like ``batch``.

    Raises:
        ValueError: a leaf is a scalar (no batch dimension), or leaves disagree on the batch size.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"split: n must be an int, got {type(n).__name__}")
    leaves, treedef = optree.tree_flatten(batch)
    arrays = []
    for i, leaf in enumerate(leaves):
        a = leaf if hasattr(leaf, "shape") and hasattr(leaf, "__getitem__") else np.asarray(leaf)
        if len(a.shape) == 0:
            raise ValueError(f"split: leaf {i} is a scalar and has no batch dimension to split")
        arrays.append(a)
    if not arrays:
        raise ValueError("split: the batch has no array leaves to split")
    bsz = arrays[0].shape[0]
    for i, a in enumerate(arrays[1:], 1):
        if a.shape[0] != bsz:
            raise ValueError(f"split: leaf {i} has batch size {a.shape[0]} but leaf 0 has batch size {bsz}")
    out, start = [], 0
    for size in split_sizes(bsz, int(n)):
        out.append(optree.tree_unflatten(treedef, [a[start : start + size] for a in arrays]))
        start += size
    return out
