"""Keras 3's mixed-precision policies (``keras.mixed_precision``) for a library without layers.

A policy names two dtypes: ``compute_dtype``, the dtype a user casts activations and gradients to
(bfloat16 or float16 under the mixed policies), and ``variable_dtype``, the dtype variables keep
(float32 under the mixed policies, so updates from 16-bit gradients do not lose their low bits).
Keras's layers apply both themselves; cudist has no layers, so a policy does two things here:

* a :class:`~cudist.Variable` created *without* an explicit ``dtype`` from a floating-point initial
  value, while a policy other than the default ``"float32"`` is set, gets the policy's
  ``variable_dtype`` (a bfloat16 array becomes float32 master weights under ``"mixed_bfloat16"``).
  An explicit ``dtype=`` always wins, integer and bool values are left alone, and under the default
  policy nothing changes (TF's rules: a float64 NumPy array stays float64);
* ``global_policy().compute_dtype`` is what a training step casts its compute to; the optimizers
  take gradients of that dtype for float32 variables (cast exactly, summed in float32).

The policy is process-wide (not per thread): replicas that run on threads see the one the program
set.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["DTypePolicy", "Policy", "global_policy", "set_global_policy"]

#: The names Keras 3's ``standardize_dtype`` accepts (keras.src.backend.common.dtypes.ALLOWED_DTYPES),
#: except "string", which no NumPy array holds.
_DTYPE_NAMES = (
    "float16", "float32", "float64", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "bfloat16", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
)
_MIXED = {"mixed_float16": ("float16", "float32"), "mixed_bfloat16": ("bfloat16", "float32")}
_FLOATS = frozenset(("float16", "bfloat16", "float32", "float64"))


class Policy:
    """A dtype policy: the compute dtype and the variable dtype (``keras.mixed_precision.Policy``).

    Args:
        name: ``"mixed_bfloat16"`` (bfloat16 compute, float32 variables), ``"mixed_float16"``
            (float16 compute, float32 variables), or a dtype name such as ``"float32"``,
            ``"bfloat16"``, ``"float16"`` (both dtypes that one). None means the global policy's name.

    Raises:
        TypeError: ``name`` is not a string (Keras's message).
        ValueError: ``name`` is neither a mixed policy nor a dtype name (Keras's message).

    Example:
        >>> p = Policy("mixed_bfloat16")
        >>> p.compute_dtype, p.variable_dtype
        ('bfloat16', 'float32')
    """

    __slots__ = ("_name", "_compute_dtype", "_variable_dtype")

    def __init__(self, name: str | None = None) -> None:
        if name is None:
            name = global_policy().name
        if not isinstance(name, str):
            raise TypeError(f"'name' must be a string, such as 'mixed_float16'. Received: name={name} (of type {type(name)})")
        if name in _MIXED:
            compute, variable = _MIXED[name]
        elif name in _DTYPE_NAMES:
            compute = variable = name
        else:
            raise ValueError(
                f"Cannot convert '{name}' to a mixed precision DTypePolicy. Valid policies include 'mixed_float16', "
                "'mixed_bfloat16', and the name of any float dtype such as 'float32'."
            )
        self._name = name
        self._compute_dtype = compute
        self._variable_dtype = variable

    @property
    def name(self) -> str:
        """The policy's name, e.g. ``"mixed_bfloat16"``."""
        return self._name

    @property
    def compute_dtype(self) -> str:
        """The dtype to compute in (cast activations and gradients to it), as a string."""
        return self._compute_dtype

    @property
    def variable_dtype(self) -> str:
        """The dtype variables are created in when no ``dtype`` is given, as a string."""
        return self._variable_dtype

    def get_config(self) -> dict[str, Any]:
        """The policy as a dict: ``{"name": name}`` (Keras's config)."""
        return {"name": self._name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Policy:
        """The policy ``get_config`` described.

        Args:
            config: a dict from :meth:`get_config`.

        Returns:
            A new policy of that name.
        """
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.name == self._name  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((Policy, self._name))

    def __repr__(self) -> str:
        return f'<DTypePolicy "{self._name}">'


#: Keras 3's name for the class (``keras.mixed_precision.DTypePolicy``).
DTypePolicy = Policy

_lock = threading.Lock()
_global: Policy | None = None


def global_policy() -> Policy:
    """The policy set by :func:`set_global_policy`; ``Policy("float32")`` until one is set.

    Returns:
        The process-wide policy.
    """
    with _lock:
        global _global
        if _global is None:
            _global = Policy("float32")
        return _global


def set_global_policy(policy: Policy | str) -> None:
    """Sets the process-wide policy (``keras.mixed_precision.set_global_policy``).

    Args:
        policy: a :class:`Policy` or a policy name (``"mixed_bfloat16"``, ``"float32"``, ...).

    Raises:
        ValueError: ``policy`` is neither a Policy nor a string, or names no policy (Keras's messages).
    """
    if isinstance(policy, str):
        policy = Policy(policy)
    elif not isinstance(policy, Policy):
        raise ValueError(
            "Invalid `policy` argument. Expected the string name of a policy (such as 'mixed_float16') or a "
            f"`DTypePolicy` instance. Received: policy={policy} (of type {type(policy)})"
        )
    with _lock:
        global _global
        _global = policy


def variable_dtype_for(inferred: np.dtype[Any]) -> str | None:
    """The dtype a variable created without ``dtype=`` from a value of dtype ``inferred`` gets.

    Returns None when the value keeps its own dtype: under the default policy, for non-float
    values, or when the policy's variable dtype is not a float.
    """
    policy = global_policy()
    if policy.name == "float32" or policy.variable_dtype not in _FLOATS:
        return None
    is_float = inferred.kind == "f" or getattr(inferred, "name", None) == "bfloat16"
    if not is_float or inferred.name == policy.variable_dtype:
        return None
    return policy.variable_dtype
