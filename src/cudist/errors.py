"""``cudist.errors``: the exception types ported tf.distribute code catches."""

from cudist._input_lib import OutOfRangeError

__all__ = ["OutOfRangeError"]
