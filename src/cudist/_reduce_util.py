"""Reduction operations shared by the kernel layer and the Strategy API."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = ["ReduceOp", "int_mean_dtype"]


def int_mean_dtype(dtype: np.dtype[Any] | type) -> np.dtype[Any]:
    """The dtype of an integer MEAN (a sum divided by a count), as TF's true division gives it.

    float32 for 8- and 16-bit integers, float64 for 32- and 64-bit ones (TF 2.21: a MEAN of uint8
    or int16 values is float32, of int32 or uint64 values float64).
    """
    return np.dtype(np.float32) if np.dtype(dtype).itemsize <= 2 else np.dtype(np.float64)


class ReduceOp(enum.Enum):
    """How values from different replicas are combined (``tf.distribute.ReduceOp``).

    ``SUM`` adds the values; ``MEAN`` adds them and divides by how many there were.
    Wherever an op is accepted, a case-insensitive string ("sum", "MEAN") works too.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation: object) -> ReduceOp:
        """Maps a ``VariableAggregation`` (SUM / MEAN) to the matching op.

        Raises:
            ValueError: for aggregations that are not reductions (NONE, ONLY_FIRST_REPLICA).
        """
        name = getattr(aggregation, "name", str(aggregation)).upper()
        if name in ("SUM", "MEAN"):
            return ReduceOp[name]
        raise ValueError(f"Could not convert from `tf.VariableAggregation` {aggregation} to `tf.distribute.ReduceOp` type")

    @classmethod
    def parse(cls, op: ReduceOp | str, *, where: str = "reduce") -> ReduceOp:
        """Returns the ReduceOp named by ``op`` (a ReduceOp or a case-insensitive string).

        Raises:
            ValueError: if ``op`` names neither SUM nor MEAN.
        """
        if isinstance(op, cls):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise ValueError(f"{where}: unknown reduce op {op!r}; expected ReduceOp.SUM or ReduceOp.MEAN (or 'sum' / 'mean')")
