"""``cudist.errors``: TensorFlow's error types (``tf.errors``), for ported code that catches them.

As in TF 2.21 every class derives from :class:`OpError` (which carries ``message``, ``op``,
``node_def``, ``error_code`` and ``experimental_payloads``) and has TF's constructor
``(node_def, op, message, *args)``; here ``op`` and ``node_def`` are None (there are no graph ops),
and ``SomeError("text")`` is accepted as a shorthand for ``SomeError(None, None, "text")``.

Where cudist raised a built-in exception before these classes existed, the class is also a subclass
of that built-in type, so existing ``except`` clauses keep working: :class:`InvalidArgumentError` is
a ``ValueError``, :class:`OutOfRangeError` a ``StopIteration``, :class:`DeadlineExceededError` a
``TimeoutError``, :class:`UnimplementedError` a ``NotImplementedError``,
:class:`ResourceExhaustedError` a ``MemoryError``, :class:`DataLossError` a ``ValueError`` (a damaged
checkpoint was one), :class:`PermissionDeniedError` a
``PermissionError``, :class:`NotFoundError` a ``LookupError``, :class:`AlreadyExistsError`,
:class:`FailedPreconditionError`, :class:`AbortedError`, :class:`InternalError` and
:class:`UnavailableError` ``RuntimeError``\\ s. The error codes are TF's (``tf.errors.INVALID_ARGUMENT``
is 3, ...).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
    "OpError",
    "CancelledError",
    "UnknownError",
    "InvalidArgumentError",
    "DeadlineExceededError",
    "NotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "FailedPreconditionError",
    "AbortedError",
    "OutOfRangeError",
    "UnimplementedError",
    "InternalError",
    "UnavailableError",
    "DataLossError",
    "UnauthenticatedError",
]

# TF's error codes (tensorflow/core/protobuf/error_codes.proto), as ``tf.errors`` exports them.
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16


class OpError(Exception):
    """The base of TF's runtime errors (``tf.errors.OpError``).

    Args:
        node_def: TF's NodeDef of the failing op; None here (kept for TF's signature).
        op: the failing op; None here.
        message: the error message (``str(error)`` is this message).
        error_code: one of the codes above (subclasses pass their own).
    """

    _code = UNKNOWN

    def __init__(self, node_def: Any = None, op: Any = None, message: str | None = None, error_code: int | None = None, *args: Any) -> None:
        if message is None and op is None and isinstance(node_def, str):
            node_def, message = None, node_def  # the shorthand SomeError("text")
        super().__init__(message, *args)
        self._node_def = node_def
        self._op = op
        self._message = "" if message is None else str(message)
        self._error_code = self._code if error_code is None else int(error_code)
        self._experimental_payloads: dict[str, Any] = {}

    def __str__(self) -> str:
        return self._message

    def __reduce__(self) -> Any:
        # Picklable with its attributes (TF's OpError pickles its message too).
        return (_rebuild, (type(self), self._node_def, self._op, self._message, self._error_code))

    @property
    def message(self) -> str:
        """The error message."""
        return self._message

    @property
    def op(self) -> Any:
        """The op that failed: always None in cudist (TF gives None in eager mode too)."""
        return self._op

    @property
    def node_def(self) -> Any:
        """The NodeDef of the failed op: always None in cudist."""
        return self._node_def

    @property
    def error_code(self) -> int:
        """The integer error code (``cudist.errors.INVALID_ARGUMENT`` and so on)."""
        return self._error_code

    @property
    def experimental_payloads(self) -> dict[str, Any]:
        """Extra information TF attaches to an error (always empty here)."""
        return self._experimental_payloads


def _rebuild(cls: type[OpError], node_def: Any, op: Any, message: str, error_code: int) -> OpError:
    err = cls(node_def, op, message)
    err._error_code = error_code
    return err


def _subclass_init(self: OpError, node_def: Any = None, op: Any = None, message: str | None = None, *args: Any) -> None:
    OpError.__init__(self, node_def, op, message, None, *args)


class CancelledError(OpError):
    """An operation was cancelled (``tf.errors.CancelledError``)."""

    _code = CANCELLED
    __init__ = _subclass_init


class UnknownError(OpError):
    """An error of unknown kind (``tf.errors.UnknownError``)."""

    _code = UNKNOWN
    __init__ = _subclass_init


class InvalidArgumentError(OpError, ValueError):
    """An argument was invalid (``tf.errors.InvalidArgumentError``); also a ``ValueError``.

    Raised where TF raises it at run time: shapes that differ between replicas in a collective or
    a reduction, ``assign_add``/``assign_sub`` of another shape, ``Dataset.batch(0)``, bad
    ``shard``/``shuffle`` arguments, ``get_value()`` of an empty optional.
    """

    _code = INVALID_ARGUMENT
    __init__ = _subclass_init


class DeadlineExceededError(OpError, TimeoutError):
    """A deadline expired, e.g. a cross-worker collective's ``timeout_seconds``; also a ``TimeoutError``."""

    _code = DEADLINE_EXCEEDED
    __init__ = _subclass_init


class NotFoundError(OpError, LookupError):
    """Something requested (a file, a device) was not found (``tf.errors.NotFoundError``); also a ``LookupError``."""

    _code = NOT_FOUND
    __init__ = _subclass_init


class AlreadyExistsError(OpError, RuntimeError):
    """What should be created already exists (``tf.errors.AlreadyExistsError``); also a ``RuntimeError``."""

    _code = ALREADY_EXISTS
    __init__ = _subclass_init


class PermissionDeniedError(OpError, PermissionError):
    """No permission for the operation (``tf.errors.PermissionDeniedError``); also a ``PermissionError``."""

    _code = PERMISSION_DENIED
    __init__ = _subclass_init


class ResourceExhaustedError(OpError, MemoryError):
    """A resource (usually memory) ran out (``tf.errors.ResourceExhaustedError``); also a ``MemoryError``."""

    _code = RESOURCE_EXHAUSTED
    __init__ = _subclass_init


class FailedPreconditionError(OpError, RuntimeError):
    """The system is not in a state the operation needs (``tf.errors.FailedPreconditionError``); also a ``RuntimeError``."""

    _code = FAILED_PRECONDITION
    __init__ = _subclass_init


class AbortedError(OpError, RuntimeError):
    """An operation was aborted, e.g. a collective after another one failed (``tf.errors.AbortedError``)."""

    _code = ABORTED
    __init__ = _subclass_init


class OutOfRangeError(OpError, StopIteration):
    """``get_next()`` was called on an exhausted iterator (TF's ``tf.errors.OutOfRangeError``).

    It is a ``StopIteration`` too, so code that catches either works.
    """

    _code = OUT_OF_RANGE
    __init__ = _subclass_init


class UnimplementedError(OpError, NotImplementedError):
    """The operation is not implemented or supported (``tf.errors.UnimplementedError``); also a ``NotImplementedError``."""

    _code = UNIMPLEMENTED
    __init__ = _subclass_init


class InternalError(OpError, RuntimeError):
    """An internal invariant broke (``tf.errors.InternalError``); also a ``RuntimeError``."""

    _code = INTERNAL
    __init__ = _subclass_init


class UnavailableError(OpError, RuntimeError):
    """A service (e.g. a peer worker) is unavailable (``tf.errors.UnavailableError``); also a ``RuntimeError``."""

    _code = UNAVAILABLE
    __init__ = _subclass_init


class DataLossError(OpError, ValueError):
    """Unrecoverable data loss or corruption (``tf.errors.DataLossError``); also a ``ValueError``.

    Raised for a damaged checkpoint (``cudist.train``): a checksum mismatch, a malformed or
    truncated index or tensors file, a path outside the checkpoint's directory.
    """

    _code = DATA_LOSS
    __init__ = _subclass_init


class UnauthenticatedError(OpError):
    """The request lacks valid authentication (``tf.errors.UnauthenticatedError``)."""

    _code = UNAUTHENTICATED
    __init__ = _subclass_init
