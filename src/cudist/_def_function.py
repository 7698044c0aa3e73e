"""``cudist.function``: ``tf.function`` for ported code, which runs eagerly here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

_F = TypeVar("_F", bound=Callable[..., Any])


@overload
def function(func: _F, **options: Any) -> _F: ...
@overload
def function(func: None = None, **options: Any) -> Callable[[_F], _F]: ...


def function(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Returns ``func`` itself: cudist has no graphs to trace, so ``@tf.function`` ports by renaming.

    ``tf.function``'s own speed-up (tracing Python into a graph) has no counterpart over NumPy
    arrays; the step runs as the Python it is, and cudist's kernels do the data movement. Usable
    bare (``@cudist.function``) or with TF's arguments (``@cudist.function(jit_compile=True)``,
    ``input_signature=...``, ``reduce_retracing=...``), which are accepted and ignored.

    Args:
        func: the function to decorate; None to return a decorator.
        **options: ``tf.function``'s keyword arguments (ignored).

    Returns:
        ``func``, or a decorator that returns its argument unchanged.

    Raises:
        TypeError: ``func`` is neither callable nor None.
    """
    del options
    if func is None:
        return function
    if not callable(func):
        raise TypeError(f"cudist.function: expected a callable to decorate, got {type(func).__name__}")
    return func
