"""Reduction operations shared by the kernel layer and the Strategy API."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp"]


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
