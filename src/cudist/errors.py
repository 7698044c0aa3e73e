"""``cudist.errors``: the exception types ported tf.distribute code catches."""

from __future__ import annotations

__all__ = ["OutOfRangeError"]


class OutOfRangeError(StopIteration):
    """``get_next()`` was called on an exhausted iterator (TF's ``tf.errors.OutOfRangeError``).

    It is a ``StopIteration``, so code that catches either works.
    """
