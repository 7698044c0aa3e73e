"""Variables: ``cudist.Variable`` and the distributed variables strategies create from it.

``cudist.Variable(...)`` checks its arguments and hands them to the current strategy's
``extended._create_variable(next_creator, **kwargs)`` (TF's variable creator pattern), so each
strategy's rules live in its own module; the builders they call are here:

* :func:`create_plain_variable` (the default strategy, OneDeviceStrategy): a plain :class:`Variable`;
* :func:`create_mirrored_variable` (MirroredStrategy): a :class:`MirroredVariable` with one component
  per device (names ``"v:0"``, ``"v/replica_1:0"``, ...), or a :class:`SyncOnReadVariable` for
  ``synchronization=ON_READ``;
* :func:`create_aggregating_variable` (CentralStorageStrategy): one :class:`AggregatingVariable` on
  the parameter device, whose updates in replica context are aggregated across replicas first.

Aggregation (replica-context updates, cross-replica reads of sync-on-read variables) goes through
``strategy.extended.reduce_to`` and so through the strategy's cross-device ops, as in TF.

All of them are instances of :class:`Variable`, as all of TF's are instances of ``tf.Variable``.
TensorFlow 2.21 is the reference for every rule here (what raises, with which message, what the
assign methods return).

Storage is one NumPy array per component on CPU devices and one CuPy array per component on GPU
devices; array work goes through :func:`cudist._arrays.array_module` so both work. Mirrored updates run through the kernel
layer's fused ``assign``/``assign_add``/``assign_sub`` (one pass writing all N copies).

Deliberate differences from TF: dtypes are NumPy dtypes; reads return NumPy (or CuPy) arrays rather
than tensors; a plain ``assign*`` returns the variable itself (TF returns an equivalent
``UnreadVariable`` view of it); variables hash by identity (TF raises and asks for ``ref()``).
"""

from __future__ import annotations

import enum
import functools
import inspect
import itertools
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, TypeVar, cast

import numpy as np
import numpy.typing as npt

from cudist._arrays import (
    array_module,
    contiguous,
    device_context,
    from_dlpack,
    is_array,
    is_foreign_array,
    like,
    may_share_memory,
    physical_gpu,
    place,
    python_dtype,
    snapshot,
    to_gpu,
    to_host,
)
from cudist._dataplane.storage import GroupStorage, Storage, kernel_backend
from cudist._devices import any_gpu, canonicalize, display_name, parse_device
from cudist._reduce_util import ReduceOp
from cudist._values import DistributedValues, Mirrored, PerReplica, select_replica
from cudist._kernels import is_bfloat16
from cudist.errors import InvalidArgumentError
from cudist.mixed_precision import global_policy, variable_dtype_for

if TYPE_CHECKING:
    from typing_extensions import Self

    from cudist._arrays import Array
    from cudist._devices import DeviceLike
    from cudist._distribute_lib import ReplicaContext, Strategy

_E = TypeVar("_E", bound=enum.Enum)
_V = TypeVar("_V", bound="Variable")

#: A variable's declared shape (``shape=`` at creation): None (unknown), or a tuple of ints and
#: None for unknown dimensions.
_ShapeSpec: TypeAlias = "tuple[int | None, ...] | None"

__all__ = [
    "Variable",
    "VariableSynchronization",
    "VariableAggregation",
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "AggregatingVariable",
]

#: What ``assign`` / ``assign_add`` / ``assign_sub`` return: the updated variable (a plain or
#: aggregating variable, or the component a replica updated), the updated value of a distributed
#: variable (a Mirrored in cross-replica context, this replica's array in replica context; the
#: aggregated array of a sync-on-read variable), or None with ``read_value=False``.
UpdateResult: TypeAlias = "Variable | Mirrored | Array | None"
#: What ``Variable.numpy()`` returns: a NumPy array, or a NumPy scalar for a 0-d variable.
HostValue: TypeAlias = "npt.NDArray[Any] | np.number[Any] | np.bool_"


class VariableSynchronization(enum.Enum):
    """When a distributed variable's components are kept in sync (``tf.VariableSynchronization``)."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How per-replica updates of a distributed variable are combined (``tf.VariableAggregation``)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


_AGGREGATION_ERROR = (
    "You must specify an aggregation method to update a {variable_type} in Replica Context. You can do so by "
    "passing an explicit value for argument `aggregation` to cudist.Variable(..), e.g. "
    "`cudist.Variable(..., aggregation=cudist.VariableAggregation.SUM)`. `cudist.VariableAggregation` lists the "
    "possible aggregation methods. This is required because {variable_type} should always be kept in sync. When "
    "updating them or assigning to them in a replica context, we automatically try to aggregate the values before "
    "updating the variable. For this aggregation, we need to know the aggregation method. Another alternative is "
    "to not try to update such {variable_type} in replica context, but in cross replica context."
)

_uid = itertools.count(1)
_uid_lock = threading.Lock()


def _next_uid() -> int:
    with _uid_lock:
        return next(_uid)


# ---------------------------------------------------------------------------- value conversion
def _unwrap(x: Any) -> Any:
    """Resolves variables (and objects convertible like them) to their current array value."""
    if isinstance(x, Variable):
        return x._read_live()
    if is_foreign_array(x):  # a JAX array, a PyTorch tensor: through DLPack, as collectives take them
        return from_dlpack(x)
    return x


def _infer_array(value: Any) -> Array:
    """Turns an initial value into an array, inferring the dtype as TF does for Python values.

    Python floats become float32 and Python ints int32 (int64 when they do not fit), as
    ``tf.convert_to_tensor`` does; NumPy and CuPy arrays keep their dtype.
    """
    if isinstance(value, Variable):
        return value._read_live().copy()
    if is_array(value):
        return value
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise TypeError(f"cannot convert {value!r} to an array: {e}") from None
    return python_dtype(a)


def _kind(dtype: np.dtype[Any]) -> str:
    """NumPy's dtype kind, with bfloat16 (kind "V" to NumPy) counted as the float it is."""
    return "f" if is_bfloat16(dtype) else dtype.kind


def _check_dtype_supported(dtype: np.dtype[Any], what: str) -> None:
    # bfloat16 (ml_dtypes) is kind "V" in NumPy; it is the one non-builtin numeric dtype allowed.
    if _kind(dtype) not in "biufc":
        raise TypeError(f"{what}: unsupported dtype {dtype.name}; cudist variables hold numeric or bool arrays")


def cast_value(value: Any, dtype: np.dtype[Any], what: str) -> Array:
    """Converts ``value`` to an array of ``dtype`` under TF's conversion rules.

    Python values (scalars, lists) convert only within their kind or upward (int -> float is fine,
    1.5 -> int32 is a TypeError, as in TF); NumPy/CuPy arrays of any numeric dtype cast (TF casts
    NumPy values too). Non-numeric values are a TypeError.

    Args:
        value: a variable, an array, or a Python value (scalar, nested list).
        dtype: the dtype to convert to.
        what: names the conversion in error messages.

    Returns:
        A NumPy or CuPy array of ``dtype`` (``value`` itself when it already is one).

    Raises:
        TypeError: a non-numeric value, or a Python value that does not convert within its kind.
        ValueError: a Python integer out of ``dtype``'s range.
    """
    value = _unwrap(value)
    if is_array(value):
        if _kind(value.dtype) not in "biufc":
            raise TypeError(f"{what}: cannot convert a value of dtype {value.dtype.name} to {dtype.name}")
        if value.dtype.kind == "c" and _kind(dtype) != "c":
            raise TypeError(f"{what}: cannot convert a complex value to {dtype.name}")
        return value.astype(dtype, copy=False) if value.dtype != dtype else value
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise TypeError(f"{what}: cannot convert {value!r} to {dtype.name}: {e}") from None
    # bfloat16 takes Python floats and ints like float16 does (NumPy has no casting rules for it).
    target = np.dtype(np.float16) if is_bfloat16(dtype) else dtype
    if a.dtype.kind not in "biufc" or not np.can_cast(a.dtype, target, "same_kind"):
        raise TypeError(
            f"{what}: cannot convert {value!r} to {dtype.name} (Python values convert only within their kind or "
            f"upward, as in TF; this one is {a.dtype.name})"
        )
    if a.dtype.kind in "iu" and dtype.kind in "iu" and a.size:
        info = np.iinfo(dtype)
        if a.min() < info.min or a.max() > info.max:
            raise ValueError(f"{what}: {value!r} is out of range for {dtype.name}")
    return a.astype(dtype, copy=False)


def _parse_enum(enum_cls: type[_E], value: object, kind: str, name: str | None) -> _E:
    if isinstance(value, enum_cls):
        return value
    raise ValueError(f"Invalid variable {kind} mode: {value} for variable: {name}")


def _shape_spec(shape: Any) -> _ShapeSpec:
    """Normalizes a ``shape`` argument: None (unknown), or a tuple of ints / None (unknown dims)."""
    if shape is None:
        return None
    dims = getattr(shape, "dims", shape)  # TensorShape-like objects
    if dims is None:
        return None
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    try:
        return tuple(None if d is None else int(d) for d in dims)
    except TypeError:
        raise TypeError(f"shape must be a tuple of ints (None for an unknown dimension), got {shape!r}") from None


def _compatible(spec: _ShapeSpec, shape: tuple[int, ...]) -> bool:
    if spec is None:
        return True
    return len(spec) == len(shape) and all(s is None or s == d for s, d in zip(spec, shape))


def _get_strategy() -> tuple[Strategy, bool]:
    from cudist import _distribute_lib

    return _distribute_lib.get_strategy(), _distribute_lib.has_strategy()


def _replica_context_of(strategy: Strategy | None, strict: bool = True) -> ReplicaContext | None:
    """The ReplicaContext when called inside ``strategy.run``; None in cross-replica context.

    Outside the variable's strategy (e.g. after its scope closed) updates are cross-replica, as TF
    enters the variable's strategy for them.

    Raises:
        RuntimeError: (``strict``) inside another strategy's scope or ``run``, as TF does for reads
            and updates of a distributed variable there; the other strategy's replicas would
            otherwise each apply the update to the shared variable.
    """
    from cudist import _distribute_lib

    if strict and _distribute_lib.has_strategy():
        current = _distribute_lib.get_strategy()
        if current is not strategy:
            raise RuntimeError(f"Mixing different cudist.Strategy objects: {current!r} is not {strategy!r}")
    if _distribute_lib.in_cross_replica_context():
        return None
    ctx = _distribute_lib.get_replica_context()
    if ctx is None or getattr(ctx, "strategy", None) is not strategy:
        return None
    return ctx


def _format_numpy(a: Any) -> str:
    a = to_host(a)
    if a.ndim == 0:
        return repr(a[()].item())  # as TF prints it: float32 0.1 shows as 0.10000000149011612
    text = repr(a)
    return "\n" + text if "\n" in text else text  # as TF's numpy_text: a new line only before several


# ---------------------------------------------------------------------------- Variable
class VariableRef:
    """What ``Variable.ref()`` returns: hashable, equal only to a reference to the same variable."""

    __slots__ = ("_wrapped",)

    def __init__(self, wrapped: Variable) -> None:
        self._wrapped = wrapped

    def deref(self) -> Variable:
        """The variable this reference wraps."""
        return self._wrapped

    def __hash__(self) -> int:
        return id(self._wrapped)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VariableRef) and other._wrapped is self._wrapped

    def __repr__(self) -> str:
        return f"<Reference wrapping {self._wrapped!r}>"


class _VariableMeta(type):
    """Routes ``Variable(...)`` to the factory, which asks the current strategy what to build."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable:
            return _create_variable(*args, **kwargs)
        raise TypeError(
            f"{cls.__name__} is not created directly: call cudist.Variable(...) inside the strategy's scope()"
        )


_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "truediv": np.true_divide,
    "floordiv": np.floor_divide,
    "mod": np.remainder,
    "pow": np.power,
    "matmul": np.matmul,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
}
_COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}


class Variable(metaclass=_VariableMeta):
    """A mutable array on a device (``tf.Variable``).

    ``cudist.Variable(initial_value, trainable=None, name=None, dtype=None,
    synchronization=VariableSynchronization.AUTO, aggregation=VariableAggregation.NONE, shape=None)``
    creates what the current strategy asks for: a plain Variable under the default strategy and
    OneDeviceStrategy, a :class:`MirroredVariable` / :class:`SyncOnReadVariable` under
    MirroredStrategy, an :class:`AggregatingVariable` under CentralStorageStrategy.

    Args:
        initial_value: an array, a Python number or nested list, or a callable returning one. Python
            floats become float32 and Python ints int32, as in TF.
        trainable: whether optimizers should train it; defaults to True, False for ON_READ.
        name: the variable's name (default "Variable"); ``.name`` is ``"<name>:0"``.
        dtype: the dtype (anything ``numpy.dtype`` takes); the initial value is cast to it.
        synchronization: a :class:`VariableSynchronization`; NONE is rejected by MirroredStrategy.
        aggregation: a :class:`VariableAggregation`: how replica-context updates are combined.
        shape: the variable's shape, if it should allow assigning other shapes (None dimensions).

    Raises:
        ValueError: no initial value; invalid synchronization/aggregation; a ``shape`` the initial
            value does not fit; the strategy's rules (see :class:`MirroredVariable`).
        TypeError: the initial value cannot be converted to ``dtype``.
    """

    #: ``cudist.Variable``'s parameters for ``inspect`` (set below the class: those of the factory).
    __signature__: ClassVar[inspect.Signature]
    #: Set on each component of a distributed variable: a weak reference to that variable.
    _distributed_container: weakref.ref[DistributedVariable]
    #: The variable's storage (internal to the package, stable for its modules): its arrays, the
    #: copy-on-write snapshots, the kernel backend; see :mod:`cudist._dataplane.storage`.
    storage: Storage

    if TYPE_CHECKING:
        # ``Variable(...)`` goes through _VariableMeta.__call__ to the factory; this is the
        # signature type checkers see for it (the factory's, :func:`_create_variable`).
        def __init__(
            self,
            initial_value: npt.ArrayLike | Callable[[], npt.ArrayLike],
            trainable: bool | None = None,
            name: str | None = None,
            dtype: npt.DTypeLike | None = None,
            synchronization: VariableSynchronization = VariableSynchronization.AUTO,
            aggregation: VariableAggregation = VariableAggregation.NONE,
            shape: int | Sequence[int | None] | None = None,
        ) -> None: ...

    # ---- construction (only through the factory)
    def _setup(
        self,
        array: Array,
        *,
        name: str,
        device: str,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        shape_spec: _ShapeSpec,
        strategy: Strategy | None,
    ) -> None:
        self.storage = Storage(array)
        self._base_name = name
        self._name = f"{name}:0"
        self._device = device
        self._trainable = trainable
        self._synchronization = synchronization
        self._aggregation = aggregation
        self._shape_spec = shape_spec
        self._distribute_strategy = strategy
        self._unique_id = f"{name.split('/')[0]}_{_next_uid()}"

    @classmethod
    def _build(cls, array: Array, **kwargs: Any) -> Self:
        obj = object.__new__(cls)
        obj._setup(array, **kwargs)
        return obj

    # ---- properties
    @property
    def name(self) -> str:
        """The name, "v:0" style."""
        return self._name

    @property
    def device(self) -> str:
        """The long device name, e.g. "/job:localhost/replica:0/task:0/device:CPU:0" (a worker's task in a cluster)."""
        return display_name(self._device)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The NumPy dtype."""
        return self.storage.array.dtype

    @property
    def shape(self) -> tuple[int | None, ...]:
        """The shape (a tuple; None entries for dimensions left unknown through ``shape=``)."""
        if self._shape_spec is not None:
            return self._shape_spec
        return self.storage.array.shape

    def get_shape(self) -> tuple[int | None, ...]:
        """Same as :attr:`shape`."""
        return self.shape

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return self.storage.array.ndim

    @property
    def trainable(self) -> bool:
        """Whether optimizers should train it."""
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        """When a distributed variable's components are synchronized."""
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        """How replica-context updates are combined."""
        return self._aggregation

    # ---- reads
    def _read_live(self) -> Array:
        """The live storage (no copy); callers must not keep or write it."""
        return self.storage.array

    def value(self) -> Array:
        """A snapshot of the current value (a NumPy or CuPy array).

        On the host the snapshot is a read-only NumPy array that shares the variable's memory until
        the variable is next written while the snapshot (or an array derived from it) is still
        referenced: that write first moves the variable to fresh memory (copy-on-write), so the
        snapshot keeps the value it had, as a TF tensor read from a variable does. A snapshot that
        is dropped before the next update costs no copy at all. Use :meth:`numpy` for a writable copy.
        """
        return self._read_snapshot()

    def read_value(self) -> Array:
        """A snapshot of the current value (a NumPy or CuPy array); see :meth:`value`."""
        return self._read_snapshot()

    def _read_snapshot(self) -> Array:
        """What value() and read_value() return (a distributed variable: of its local component)."""
        return self.storage.snapshot()

    def _read_host(self) -> npt.NDArray[Any]:
        """What host reads (numpy(), __array__, checkpoints) copy from: the live storage, or a host copy of it."""
        return to_host(self._read_live())

    def numpy(self) -> HostValue:
        """The value as a NumPy array (a NumPy scalar for 0-d variables), copied to the host."""
        a = self._read_host()
        return a[()] if a.ndim == 0 else a.copy()

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> npt.NDArray[Any]:
        a = self._read_host()
        if dtype is not None and a.dtype != np.dtype(dtype):
            return a.astype(dtype)
        return a.copy()  # the caller may write the result; it must not alias the variable

    def __dlpack__(self, **kwargs: Any) -> Any:
        """DLPack export of the value, so ``jax.numpy.from_dlpack(v)``, ``torch.from_dlpack(v)``,
        ``np.from_dlpack(v)`` or ``cupy.from_dlpack(v)`` take the variable without a copy.

        The result shares the variable's live storage (what :meth:`value` would snapshot: this
        replica's component inside ``run``, the aggregate of a sync-on-read variable outside it):
        later updates of the variable show through it, as long as no ``read_value()`` snapshot is
        still held when the update comes (copy-on-write then moves the variable to fresh memory and
        the export keeps the old one). Use ``read_value()`` for a snapshot.

        Returns:
            The storage array's DLPack capsule (``Any``: a ``PyCapsule``, which has no type before
            Python 3.13's ``types.CapsuleType``).
        """
        return self._read_live().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """The DLPack device of the storage :meth:`__dlpack__` exports: (1, 0) on the host, (2, gpu) on a GPU."""
        return self._read_live().__dlpack_device__()

    # ---- updates
    def _coerce(self, value: Any, method: str) -> Array:
        """``value`` as an array of this variable's dtype and shape on its device."""
        ref = self.storage.array
        if type(value) is np.ndarray and type(ref) is np.ndarray and value.dtype == ref.dtype and value.shape == ref.shape:
            return value  # the common case, kept cheap: per-step updates of host variables
        what = f"{method} to variable '{self.name}'"
        arr = like(cast_value(value, self.dtype, what), ref)
        if method == "assign":
            if not _compatible(self._shape_spec, arr.shape) or (self._shape_spec is None and arr.shape != ref.shape):
                raise ValueError(
                    f"Cannot assign value to variable '{self.name}': Shape mismatch. The variable shape "
                    f"{self.shape}, and the assigned value shape {arr.shape} are incompatible."
                )
        elif arr.shape != ref.shape:
            raise InvalidArgumentError(  # a ValueError too; TF's error for assign_add/assign_sub
                f"Cannot update variable '{self.name}' with shape {ref.shape} using a value with shape "
                f"{arr.shape} ({method}): shapes must be equal."
            )
        return arr

    def _write(self, method: str, arr: Array) -> None:
        """Applies an already-coerced update to this single storage array."""
        ref = self.storage.detach()
        xp = array_module(ref)
        if xp is not np:
            with device_context(ref):  # CuPy works on the current device: make it this component's
                self._write_arrays(xp, method, ref, arr)
            return
        self._write_arrays(xp, method, ref, arr)

    def _write_arrays(self, xp: ModuleType, method: str, ref: Array, arr: Array) -> None:
        if method == "assign":
            if arr.shape != ref.shape:  # allowed by a partially unknown `shape=`
                self.storage.replace(xp.array(arr, order="C", copy=True))
            else:
                xp.copyto(ref, arr)
        elif method == "assign_add":
            xp.add(ref, arr, out=ref, casting="unsafe")
        else:
            xp.subtract(ref, arr, out=ref, casting="unsafe")

    def _update(self, method: str, value: Any, read_value: bool) -> UpdateResult:
        self._write(method, self._coerce(value, method))
        return self if read_value else None

    def assign(
        self,
        value: npt.ArrayLike | DistributedValues,
        use_locking: bool = False,
        name: str | None = None,
        read_value: bool = True,
    ) -> UpdateResult:
        """Writes ``value`` (same shape; cast to the dtype) into the variable.

        Args:
            value: an array or Python value; a Mirrored in cross-replica context. Inside
                ``strategy.run`` each replica passes its own (combined by ``aggregation``).
            use_locking: accepted for TF compatibility; ignored.
            name: accepted for TF compatibility; ignored.
            read_value: return the result (True) or None.

        Returns:
            The variable (TF returns an equivalent view of it), or None when ``read_value=False``.
            A distributed variable returns its updated value instead: a Mirrored in cross-replica
            context, this replica's array inside ``run`` (see :data:`UpdateResult`).

        Raises:
            ValueError: the shapes differ.
            TypeError: the value cannot be converted to the variable's dtype.
        """
        return self._update("assign", value, read_value)

    def assign_add(
        self,
        delta: npt.ArrayLike | DistributedValues,
        use_locking: bool = False,
        name: str | None = None,
        read_value: bool = True,
    ) -> UpdateResult:
        """Adds ``delta`` (same shape) to the variable; returns it as :meth:`assign` does.

        Args:
            delta: an array or Python value, as :meth:`assign`'s ``value``.
            use_locking: accepted for TF compatibility; ignored.
            name: accepted for TF compatibility; ignored.
            read_value: return the result (True) or None.
        """
        return self._update("assign_add", delta, read_value)

    def assign_sub(
        self,
        delta: npt.ArrayLike | DistributedValues,
        use_locking: bool = False,
        name: str | None = None,
        read_value: bool = True,
    ) -> UpdateResult:
        """Subtracts ``delta`` (same shape) from the variable; returns it as :meth:`assign` does.

        Args:
            delta: an array or Python value, as :meth:`assign`'s ``value``.
            use_locking: accepted for TF compatibility; ignored.
            name: accepted for TF compatibility; ignored.
            read_value: return the result (True) or None.
        """
        return self._update("assign_sub", delta, read_value)

    # ---- Python protocol
    def __repr__(self) -> str:
        return f"<cudist.Variable '{self.name}' shape={self.shape} dtype={self.dtype.name}, numpy={_format_numpy(self._read_live())}>"

    def __str__(self) -> str:
        return repr(self)

    # By identity (``==`` is elementwise, as NumPy's); object's own, at C speed: optimizers and
    # checkpoints look variables up in dicts every step.
    __hash__ = object.__hash__

    def ref(self) -> VariableRef:
        """A hashable reference to this variable (TF's ``Variable.ref()``; ``.deref()`` gives it back).

        cudist variables are hashable themselves (TF's are not); ``ref()`` is there for ported code.
        """
        return VariableRef(self)

    def experimental_ref(self) -> VariableRef:
        """Deprecated TF name of :meth:`ref` (warns)."""
        import warnings

        warnings.warn("experimental_ref is deprecated; use ref() instead", DeprecationWarning, stacklevel=2)
        return VariableRef(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """An independent variable with a copy of the value: same name, device, settings and strategy."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        state = {k: v for k, v in vars(self).items() if k != "_distributed_container"}
        state["storage"] = self.storage.clone()
        state["_unique_id"] = f"{self._base_name.split('/')[0]}_{_next_uid()}"
        new.__dict__.update(state)
        return new

    def __reduce__(self) -> tuple[Callable[[], Variable], tuple[()]]:
        """Pickles a plain variable as its value and settings (unpickled outside any strategy, on its
        device); distributed variables refuse."""
        if type(self) is not Variable:
            raise TypeError(
                f"cannot pickle {type(self).__name__} '{self.name}': it belongs to its strategy's devices; save it "
                "with cudist.train.Checkpoint (or pickle its value, variable.numpy()); copy.deepcopy works in-process"
            )
        rebuild = functools.partial(
            create_plain_variable,
            None,
            initial_value=to_host(self.storage.array),
            trainable=self._trainable,
            name=self._base_name,
            dtype=self.storage.array.dtype,
            synchronization=self._synchronization,
            aggregation=self._aggregation,
            shape=self._shape_spec,
            device=self._device,
        )
        return (rebuild, ())

    def __bool__(self) -> bool:
        return bool(self._read_live())

    def __len__(self) -> int:
        shape: tuple[int, ...] = self._read_live().shape
        if not shape:
            raise TypeError("len() of a 0-d (scalar) variable")
        return shape[0]

    def __iter__(self) -> Iterator[Any]:
        a = self._read_live().copy()
        if a.ndim == 0:
            raise TypeError("iteration over a 0-d (scalar) variable")
        return iter(a)

    def __getitem__(self, index: Any) -> Any:
        out: Any = self._read_live()[_unwrap(index)]
        return out.copy() if hasattr(out, "copy") and getattr(out, "ndim", 0) else out  # type: ignore[arg-type]  # getattr overload

    def __format__(self, spec: str) -> str:
        return format(self.numpy(), spec)

    def __float__(self) -> float:
        return float(self._read_live())

    def __int__(self) -> int:
        return int(self._read_live())

    def __index__(self) -> int:
        return int(self._read_live().__index__())

    def __neg__(self) -> Array:
        return -self._read_live()

    def __pos__(self) -> Array:
        return +self._read_live()

    def __abs__(self) -> Array:
        return abs(self._read_live())

    def __invert__(self) -> Array:
        return ~self._read_live()

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(isinstance(o, Variable) for o in kwargs.get("out", ()) or ()):
            raise TypeError("a Variable cannot be a ufunc's `out`; update it with assign/assign_add/assign_sub")
        inputs = tuple(_unwrap(x) for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    if TYPE_CHECKING:
        # Arithmetic and comparisons, installed below the class (see _BINARY, _COMPARE): each reads
        # the value and applies the NumPy (CuPy) operator, giving an array.
        def __add__(self, other: Any) -> Array: ...
        def __radd__(self, other: Any) -> Array: ...
        def __sub__(self, other: Any) -> Array: ...
        def __rsub__(self, other: Any) -> Array: ...
        def __mul__(self, other: Any) -> Array: ...
        def __rmul__(self, other: Any) -> Array: ...
        def __truediv__(self, other: Any) -> Array: ...
        def __rtruediv__(self, other: Any) -> Array: ...
        def __floordiv__(self, other: Any) -> Array: ...
        def __rfloordiv__(self, other: Any) -> Array: ...
        def __mod__(self, other: Any) -> Array: ...
        def __rmod__(self, other: Any) -> Array: ...
        def __pow__(self, other: Any) -> Array: ...
        def __rpow__(self, other: Any) -> Array: ...
        def __matmul__(self, other: Any) -> Array: ...
        def __rmatmul__(self, other: Any) -> Array: ...
        def __and__(self, other: Any) -> Array: ...
        def __rand__(self, other: Any) -> Array: ...
        def __or__(self, other: Any) -> Array: ...
        def __ror__(self, other: Any) -> Array: ...
        def __xor__(self, other: Any) -> Array: ...
        def __rxor__(self, other: Any) -> Array: ...
        def __lt__(self, other: Any) -> Array: ...
        def __le__(self, other: Any) -> Array: ...
        def __gt__(self, other: Any) -> Array: ...
        def __ge__(self, other: Any) -> Array: ...
        def __eq__(self, other: object) -> Array: ...  # type: ignore[override]  # elementwise, as NumPy
        def __ne__(self, other: object) -> Array: ...  # type: ignore[override]  # elementwise, as NumPy


def _binary(fn: Callable[[Any, Any], Any], reflected: bool) -> Callable[[Variable, Any], Any]:
    def op(self: Variable, other: Any) -> Any:
        if reflected:
            return fn(_unwrap(other), self._read_live())
        return fn(self._read_live(), _unwrap(other))

    return op


for _name, _fn in _BINARY.items():
    setattr(Variable, f"__{_name}__", _binary(_fn, False))
    setattr(Variable, f"__r{_name}__", _binary(_fn, True))
for _name, _fn in _COMPARE.items():
    setattr(Variable, f"__{_name}__", _binary(_fn, False))
del _name, _fn


# ---------------------------------------------------------------------------- distributed
def _replica_zero_value(strategy: Strategy, value: Any) -> Any:
    """ONLY_FIRST_REPLICA's value: replica 0's of the whole job (the chief's first, on every worker)."""
    return strategy.extended._first_replica_value(value)  # private-read: the strategy's multi-worker hook (TF's *Extended pattern)


def _aggregate(strategy: Strategy, value: Any, aggregation: VariableAggregation, var: Variable) -> Any:
    """Combines a regrouped replica-context update value (inside merge_call) into one array.

    Mirrors TF's ``apply_aggregation``: ONLY_FIRST_REPLICA takes replica 0's value; SUM/MEAN reduce
    the per-replica values in replica order. A value that is the same object in every replica (a
    Python constant) cannot be summed: TF raises, as the sum would silently be N times it.
    """
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        return _replica_zero_value(strategy, value)
    op = ReduceOp.from_variable_aggregation(aggregation)
    n = strategy.num_replicas_in_sync
    # Multi-worker: a worker's plain value is its contribution.
    value = strategy.extended._local_value_of(value)  # private-read: the strategy's multi-worker hook (TF's *Extended pattern)
    if not isinstance(value, DistributedValues):
        if op is ReduceOp.SUM and n > 1:
            raise ValueError(f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op {op}.")
        return value
    n_local = len(strategy.extended.worker_devices)
    if len(value.values) != n_local:
        raise ValueError(
            f"update to variable '{var.name}' has {len(value.values)} per-replica values but the strategy has "
            f"{n_local} local replicas"
        )
    ref = var.storage.primary
    arrays: list[Array] = []
    for i, v in enumerate(value.values):
        if type(v) is np.ndarray and type(ref) is np.ndarray and v.dtype == ref.dtype and v.shape == ref.shape:
            arrays.append(contiguous(v))
            continue
        a = like(cast_value(v, ref.dtype, f"{aggregation.name} of replica {i}'s update to '{var.name}'"), ref)
        if a.shape != ref.shape:
            raise ValueError(
                f"replica {i}'s update to variable '{var.name}' has shape {a.shape} but the variable has shape {ref.shape}"
            )
        arrays.append(contiguous(a))
    return _reduce_components(strategy, arrays, op, var.device)


def _reduce_components(strategy: Strategy, arrays: Sequence[Any], op: ReduceOp, device: str) -> Array:
    """Reduces per-replica arrays of one dtype to ``device`` through ``strategy.extended.reduce_to``.

    So the strategy's cross-device ops (a user's ``NcclAllReduce``, say) do the reduction, as in TF.
    Integer MEAN keeps the dtype, truncating toward zero (the variable's dtype cannot change).
    """
    int_mean = op is ReduceOp.MEAN and arrays[0].dtype.kind in "iu"
    red = strategy.extended.reduce_to(ReduceOp.SUM if int_mean else op, PerReplica(arrays), device)
    if int_mean:
        xp = array_module(red)
        n = strategy.num_replicas_in_sync  # over every worker of a multi-worker job
        red = (xp.sign(red) * (xp.abs(red) // n)).astype(arrays[0].dtype, copy=False)
    return red


class DistributedVariable(DistributedValues, Variable):
    """Base of variables with one component (a plain :class:`Variable`) per replica device."""

    _keep_in_replica = True
    _values: tuple[Variable, ...]  # the components
    _distribute_strategy: Strategy  # always set for distributed variables
    #: The components' storages as one group (their arrays are the components' ``storage``).
    storage: GroupStorage  # type: ignore[assignment]  # a distributed variable's storage is its components' group

    def _setup_distributed(
        self,
        strategy: Strategy,
        components: Sequence[Variable],
        *,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
    ) -> None:
        DistributedValues.__init__(self, components)
        for c in components:  # lets extended.value_container(component) find this variable (weakly: no cycle)
            c._distributed_container = weakref.ref(self)
        self._distribute_strategy = strategy
        self._trainable = trainable
        self._synchronization = synchronization
        self._aggregation = aggregation
        self.storage = GroupStorage([c.storage for c in components], mirrored=isinstance(self, Mirrored))

    @classmethod
    def _build_distributed(cls, strategy: Strategy, components: Sequence[Variable], **kwargs: Any) -> Self:
        obj = object.__new__(cls)
        obj._setup_distributed(strategy, components, **kwargs)
        return obj

    def _replica_ctx(self) -> ReplicaContext | None:
        return _replica_context_of(self._distribute_strategy)

    @property
    def distribute_strategy(self) -> Strategy:
        """The strategy this variable was created in (TF's ``distribute_strategy``)."""
        return self._distribute_strategy

    def _local(self, ctx: ReplicaContext | None = None) -> Variable:
        """The component of the calling replica (the primary in cross-replica context)."""
        if ctx is None:
            ctx = self._replica_ctx()
        if ctx is None:
            return self._values[0]
        # This worker's replica index: the components are this worker's replicas, in order.
        return self._values[ctx.replica_id_in_sync_group % len(self._values)]

    # ---- properties resolve to the primary (or the local component where TF does)
    @property
    def name(self) -> str:
        """The primary component's name, "v:0" style."""
        return self._values[0].name

    @property
    def device(self) -> str:
        """The calling replica's component's device inside ``run``; else the primary's."""
        ctx = _replica_context_of(self._distribute_strategy, strict=False)
        return self._values[0 if ctx is None else ctx.replica_id_in_sync_group % len(self._values)].device

    @property
    def dtype(self) -> np.dtype[Any]:
        """The NumPy dtype (every component's)."""
        return self._values[0].dtype

    @property
    def shape(self) -> tuple[int | None, ...]:
        """The shape (every component's), as :attr:`Variable.shape`."""
        return self._values[0].shape

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return self._values[0].ndim

    @property
    def _unique_id(self) -> str:  # type: ignore[override]  # Variable's is set in _setup; a component's here
        return self._values[0]._unique_id

    def _read_snapshot(self) -> Array:
        return self._local()._read_snapshot()

    def _read_live(self) -> Array:
        return self._local().storage.array

    def __len__(self) -> int:
        return Variable.__len__(self)

    __hash__ = object.__hash__  # by identity, as Variable's

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """An independent distributed variable of the same strategy, each component copied."""
        components = tuple(memo.get(id(c)) or c.__deepcopy__(memo) for c in self._values)
        new = type(self)._build_distributed(
            self._distribute_strategy,
            components,
            trainable=self._trainable,
            synchronization=self._synchronization,
            aggregation=self._aggregation,
        )
        memo[id(self)] = new
        return new

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    __str__ = __repr__


class MirroredVariable(DistributedVariable, Mirrored):
    """A variable kept identical on every replica device (TF's ``MirroredVariable``).

    In replica context (inside ``strategy.run``) an update follows ``aggregation``: NONE writes the
    calling replica's component only; SUM/MEAN reduce the replicas' values (a Python constant cannot
    be summed over several replicas: ValueError) and write the result to every component;
    ONLY_FIRST_REPLICA writes replica 0's value to every component. In cross-replica context an
    update writes every component, in one fused kernel pass.
    """

    def _all_write(self, method: str, arr: Array) -> None:
        """Applies a coerced update to every component with one fused kernel pass."""
        storage = self.storage
        copies = storage.buffers()
        if storage.host() and type(arr) is np.ndarray and arr.shape == copies[0].shape:
            backend = storage.kernel()
            if backend is not None:
                if any(np.may_share_memory(arr, c) for c in copies):
                    arr = arr.copy()  # e.g. assigning one component to all: kernels may not allow aliasing
                getattr(backend, method)(copies, contiguous(arr))
                return
        if arr.shape != copies[0].shape:  # a shape change allowed by `shape=`: reallocate
            for c in self._values:
                c._write(method, like(arr, c.storage.array))
            return
        if any(may_share_memory(arr, c) for c in copies):
            arr = snapshot(arr)  # e.g. assigning one component to all: kernels may not allow aliasing
        backend = kernel_backend(copies[0]) if all(array_module(c) is array_module(copies[0]) for c in copies) else None
        # The CuPy backend updates copies on several GPUs in one pass too (over peer access, or
        # staged where there is none), so only a mix of host and device copies needs the loop below.
        if backend is not None:
            getattr(backend, method)(copies, contiguous(arr))
            return
        new = arr
        if method != "assign":
            new = copies[0] + arr if method == "assign_add" else copies[0] - arr
            new = new.astype(copies[0].dtype, copy=False)
        for c in self._values:
            c._write("assign", like(new, c.storage.array))

    def _update(self, method: str, value: Any, read_value: bool) -> UpdateResult:
        ctx = self._replica_ctx()
        if ctx is None:
            if isinstance(value, DistributedValues) and not isinstance(value, Mirrored):
                # As TF 2.21: each component gets its own replica's value (the copies may then differ).
                if len(value.values) != len(self._values):
                    raise ValueError(
                        f"{method} of variable '{self.name}' in cross-replica context got a {type(value).__name__} "
                        f"of {len(value.values)} components for its {len(self._values)} components"
                    )
                for c, v in zip(self._values, value.values):
                    c._write(method, c._coerce(v, method))
                return Mirrored(self.storage.snapshots()) if read_value else None
            if isinstance(value, DistributedValues):
                value = value.values[0]
            self._all_write(method, self._values[0]._coerce(value, method))
            if not read_value:
                return None
            return Mirrored(self.storage.snapshots())
        if self._aggregation is VariableAggregation.NONE:
            return self._local(ctx)._update(method, value, read_value)

        def merge_fn(strategy: Strategy, v: Any) -> None:
            self._all_write(method, self._values[0]._coerce(_aggregate(strategy, v, self._aggregation, self), method))

        ctx.merge_call(merge_fn, args=(value,))
        return self._local(ctx)._read_snapshot() if read_value else None


class SyncOnReadVariable(DistributedVariable):
    """A variable whose components are combined only when read (TF's ``SyncOnReadVariable``).

    In replica context reads and writes touch the calling replica's component only. In
    cross-replica context a read combines the components by ``aggregation`` (SUM, MEAN, or replica
    0's for ONLY_FIRST_REPLICA; NONE cannot be read there); ``assign`` writes every component
    (``value / N`` each for SUM, so the sum reads back as ``value``); ``assign_add``/``assign_sub``
    add to every component (not allowed for SUM). ``trainable`` defaults to False.
    """

    def _aggregated(self) -> Array:
        agg = self._aggregation
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:  # replica 0 of the job (of every worker)
            return _replica_zero_value(self._distribute_strategy, PerReplica(self._arrays()))
        op = ReduceOp.from_variable_aggregation(agg)  # NONE raises, as in TF
        return _reduce_components(self._distribute_strategy, self._arrays(), op, self._values[0].device)

    def _arrays(self) -> tuple[Array, ...]:
        """The components' storage, to read (writers use ``storage.buffers()``)."""
        return self.storage.arrays()

    def _read_live(self) -> Array:
        ctx = self._replica_ctx()
        if ctx is not None:
            return self._local(ctx).storage.array
        return self._aggregated()

    def _read_snapshot(self) -> Array:
        ctx = self._replica_ctx()
        if ctx is not None:
            return self._local(ctx)._read_snapshot()
        return snapshot(self._aggregated())

    def _update(self, method: str, value: Any, read_value: bool) -> UpdateResult:
        ctx = self._replica_ctx()
        if ctx is not None:
            return self._local(ctx)._update(method, value, read_value)
        agg = self._aggregation
        # Aggregation NONE: as TF 2.21, every component is written; only reading the result back
        # (read_value=True) raises TF's "Could not convert" ValueError, from _aggregated().
        if agg is VariableAggregation.SUM and method != "assign":
            raise ValueError(
                f"SyncOnReadVariable does not support `{method}` in cross-replica context when aggregation is set "
                "to `cudist.VariableAggregation.SUM`."
            )
        if isinstance(value, DistributedValues):
            value = value.values[0]
        arr = self._values[0]._coerce(value, method)
        if method == "assign":
            if agg is VariableAggregation.SUM:
                n = self._distribute_strategy.num_replicas_in_sync  # over every worker, as TF
                xp = array_module(arr)
                if arr.dtype.kind == "f" or arr.dtype.kind == "c":
                    arr = arr / arr.dtype.type(n)
                else:  # TF divides, then casts back (truncation toward zero)
                    arr = xp.trunc(arr / n).astype(arr.dtype)
            copies = self.storage.buffers()
            backend = kernel_backend(copies[0])
            if backend is not None and array_module(copies[0]) is np and arr.shape == copies[0].shape:
                backend.assign(copies, contiguous(arr))
            else:
                for c in self._values:
                    c._write("assign", like(arr, c.storage.array))
        else:
            for c in self._values:  # components differ: each gets the delta
                c._write(method, like(arr, c.storage.array))
        return self._aggregated().copy() if read_value else None


class AggregatingVariable(Variable):
    """CentralStorageStrategy's variable: one copy on the parameter device (TF's ``AggregatingVariable``).

    Its ``device`` is the parameter device. In replica context an update is first aggregated over
    the replicas (SUM, MEAN, ONLY_FIRST_REPLICA) and applied once; aggregation NONE is a ValueError
    there. In cross-replica context updates apply directly. Prints like a plain Variable, as in TF.

    Reads inside a replica that runs on a GPU other than the storage's (e.g. GPU replicas with
    the variable in host memory) give that replica a CuPy copy on its GPU, as TF copies the
    variable to the compute device: ``value()``, ``read_value()``, operators and ufuncs. Each such
    read copies (nothing is cached: optimizers write the storage in place). ``numpy()`` and
    ``__array__`` read the storage directly.
    """

    @property
    def distribute_strategy(self) -> Strategy:
        """The CentralStorageStrategy this variable was created in (TF's ``distribute_strategy``)."""
        return cast("Strategy", self._distribute_strategy)

    def _replica_gpu(self) -> int | None:
        """The physical GPU of the calling replica, when reads must be copied there; else None."""
        strategy = self._distribute_strategy
        if strategy is None:
            return None
        ctx = _replica_context_of(strategy, strict=False)
        if ctx is None:
            return None
        device = ctx.devices[0]
        if ":GPU:" not in device:
            return None  # CPU replicas share host memory with a host variable
        gpu = physical_gpu(parse_device(device))  # the GPU the replica runs on (made current while it runs)
        arr = self.storage.array
        if type(arr) is not np.ndarray and int(arr.device.id) == gpu:  # type: ignore[union-attr]  # CuPy's device
            return None
        return gpu

    def _read_live(self) -> Array:
        gpu = self._replica_gpu()
        if gpu is None:
            return self.storage.array
        return to_gpu(self.storage.array, gpu, copy=True)

    def value(self) -> Array:
        """A snapshot of the current value; a CuPy array on the replica's GPU inside a GPU replica."""
        gpu = self._replica_gpu()
        if gpu is None:
            return self._read_snapshot()
        return to_gpu(self.storage.array, gpu, copy=True)  # a fresh copy already

    read_value = value

    def _read_host(self) -> npt.NDArray[Any]:
        return to_host(self.storage.array)  # the storage itself, never a replica's GPU copy

    def _update(self, method: str, value: Any, read_value: bool) -> UpdateResult:
        ctx = _replica_context_of(self._distribute_strategy)
        if ctx is None:
            if isinstance(value, DistributedValues):
                value = value.values[0]
            return Variable._update(self, method, value, read_value)
        if self._aggregation is VariableAggregation.NONE:
            raise ValueError(_AGGREGATION_ERROR.format(variable_type="AggregatingVariable"))

        def merge_fn(strategy: Strategy, v: Any) -> None:
            Variable._update(self, method, _aggregate(strategy, v, self._aggregation, self), False)

        ctx.merge_call(merge_fn, args=(value,))
        return self if read_value else None



# ---------------------------------------------------------------------------- for the package
def strategy_of(var: Variable) -> Strategy | None:
    """The strategy ``var`` was created in (None: a plain variable made outside any strategy).

    For the package's modules (the optimizer's slots, checkpoints): a plain variable has no public
    ``distribute_strategy`` (TF's has none either), but its slots belong to the same strategy.
    """
    return var._distribute_strategy


def read_host(var: Variable) -> npt.NDArray[Any]:
    """What a host read of ``var`` copies from (no copy where it can be avoided; do not write it):
    the storage of a plain, mirrored (replica 0's or the calling replica's component) or aggregating
    variable, the aggregate of a sync-on-read variable in cross-replica context. Checkpoints save it.
    """
    return var._read_host()


# ---------------------------------------------------------------------------- the factory
def _create_variable(
    initial_value: Any = None,
    trainable: bool | None = None,
    name: str | None = None,
    dtype: npt.DTypeLike | None = None,
    synchronization: VariableSynchronization = VariableSynchronization.AUTO,
    aggregation: VariableAggregation = VariableAggregation.NONE,
    shape: object = None,
) -> Variable:
    """``cudist.Variable(...)``: checks the arguments, then lets the current strategy build the variable.

    As TF's variable creator stack: ``strategy.extended._create_variable(next_creator, **kwargs)``
    decides what to build (each strategy's rules live in its own module); ``next_creator`` builds a
    plain :class:`Variable`.
    """
    synchronization = _parse_enum(VariableSynchronization, synchronization, "synchronization", name)
    aggregation = _parse_enum(VariableAggregation, aggregation, "aggregation", name)
    if trainable is not None and not isinstance(trainable, (bool, np.bool_)):
        raise TypeError(f"trainable must be a bool or None, got {type(trainable).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    if initial_value is None:
        raise ValueError("The `initial_value` arg to `cudist.Variable` must be specified.")
    strategy, has_strategy = _get_strategy()
    return cast(Variable, strategy.extended._create_variable(
        functools.partial(create_plain_variable, strategy if has_strategy else None),
        initial_value=initial_value,
        trainable=trainable,
        name=name,
        dtype=dtype,
        synchronization=synchronization,
        aggregation=aggregation,
        shape=shape,
    ))


def initial_array(initial_value: Any, dtype: npt.DTypeLike | None, shape: object) -> tuple[Array, _ShapeSpec]:
    """The initial value as an array (calling it if callable, cast to ``dtype``) and the shape spec.

    Args:
        initial_value: an array, a Python value, a variable, or a callable returning one.
        dtype: the dtype to cast to, or None to infer it (TF's rules for Python values).
        shape: the ``shape=`` argument (see :class:`Variable`).

    Raises:
        TypeError: an unsupported dtype, or a value that does not convert to ``dtype``.
        ValueError: the value's shape does not fit ``shape``.
    """
    if callable(initial_value):
        initial_value = initial_value()
    if dtype is not None:
        dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
        _check_dtype_supported(dtype, "cudist.Variable")
        # Python values convert under TF's strict rules, arrays cast (see _cast).
        arr = cast_value(initial_value, dtype, "initial value of cudist.Variable")
        if isinstance(initial_value, Variable) or arr is initial_value:
            arr = arr.copy()
    else:
        arr = _infer_array(initial_value)
        policy_dtype = variable_dtype_for(arr.dtype)
        if policy_dtype is not None:
            arr = _cast_to_policy(arr, policy_dtype)
    _check_dtype_supported(arr.dtype, "cudist.Variable")
    spec = _shape_spec(shape)
    if not _compatible(spec, arr.shape):
        raise ValueError(
            f"In this `cudist.Variable` creation, the initial value's shape ({arr.shape}) is not compatible with "
            f"the explicitly supplied `shape` argument ({spec})."
        )
    return arr, spec


def _cast_to_policy(arr: Array, dtype_name: str) -> Array:
    """``arr`` cast to the global mixed-precision policy's variable dtype (a copy: a new variable)."""
    if dtype_name == "bfloat16":
        import ml_dtypes  # noqa: PLC0415 - optional, and only a bfloat16 policy needs it

        return arr.astype(ml_dtypes.bfloat16)
    return arr.astype(dtype_name)


def _default_trainable(trainable: bool | None, synchronization: VariableSynchronization) -> bool:
    if trainable is None:
        return synchronization is not VariableSynchronization.ON_READ
    return bool(trainable)


def create_plain_variable(
    strategy: Strategy | None,
    *,
    initial_value: Any,
    trainable: bool | None,
    name: str | None,
    dtype: npt.DTypeLike,
    synchronization: VariableSynchronization,
    aggregation: VariableAggregation,
    shape: object,
    device: DeviceLike,
) -> Variable:
    """Builds a plain :class:`Variable` on ``device`` (the end of every strategy's creator chain).

    ``strategy``: the strategy it belongs to (None under the default strategy).
    """
    return _build_on_device(
        Variable, strategy, device, initial_value, trainable, name, dtype, synchronization, aggregation, shape
    )


def _build_on_device(
    cls: type[_V],
    strategy: Strategy | None,
    device: DeviceLike,
    initial_value: Any,
    trainable: bool | None,
    name: str | None,
    dtype: npt.DTypeLike,
    synchronization: VariableSynchronization,
    aggregation: VariableAggregation,
    shape: object,
) -> _V:
    """One storage array of class ``cls`` (a plain or an aggregating variable) on ``device``."""
    arr, spec = initial_array(initial_value, dtype, shape)
    device = canonicalize(device)
    return cls._build(
        place(arr, device, copy=True),
        name=name if name is not None else "Variable",
        device=device,
        synchronization=synchronization,
        strategy=strategy,
        trainable=_default_trainable(trainable, synchronization),
        aggregation=aggregation,
        shape_spec=spec,
    )


def _deuniquified(name: Any) -> Any:
    """A variable name without the "_<digit>" suffixes of upstream uniquification, as TF compares
    the names replicas give one variable ("q" and "q_1" name the same variable; "v0" and "v1" do not)."""
    if not isinstance(name, str):
        return name
    return re.sub(r"_\d$", "", re.sub(r"_\d/", "/", name))


def create_in_replica_context(strategy: Strategy, kwargs: dict[str, Any]) -> Variable | None:
    """Inside ``strategy.run``: one variable for all replicas, created in a ``merge_call``; else None.

    As in TF, the variable is created once (from replica 0's initial value) and every replica gets
    that same variable. A callable initial value is called in each replica, where replica-local
    state is visible.
    """
    ctx = _replica_context_of(strategy)
    if ctx is None:
        return None
    initial_value = kwargs["initial_value"]
    if callable(initial_value):
        initial_value = initial_value()
    rest = {k: v for k, v in kwargs.items() if k != "initial_value"}

    def merge_fn(_: Strategy, init: Any, name: Any) -> Variable:
        if isinstance(name, DistributedValues):  # the replicas passed different name objects
            first = _deuniquified(name.values[0])
            for i, other in enumerate(name.values):
                if _deuniquified(other) != first:  # as TF 2.21 (shared_variable_creator)
                    raise RuntimeError(f"Tried to create variable {other} with mismatching name on device {i}")
        return _create_variable(select_replica(0, init), **rest)

    return cast(Variable, ctx.merge_call(merge_fn, args=(initial_value, kwargs.get("name"))))


def create_mirrored_variable(
    strategy: Strategy,
    devices: Iterable[DeviceLike],
    *,
    initial_value: Any,
    trainable: bool | None,
    name: str | None,
    dtype: npt.DTypeLike,
    synchronization: VariableSynchronization,
    aggregation: VariableAggregation,
    shape: object,
) -> DistributedVariable:
    """Builds a :class:`MirroredVariable` (or :class:`SyncOnReadVariable` for ON_READ) over ``devices``.

    Components are named ``"v:0"``, ``"v/replica_1:0"``, ... Raises TF's ValueErrors for
    synchronization NONE and for aggregation MEAN with a non-floating dtype.
    """
    if synchronization is VariableSynchronization.NONE:
        raise ValueError(
            "`NONE` variable synchronization mode is not supported with cudist strategies. Please change the "
            f"`synchronization` for variable: {name}"
        )
    devices = tuple(canonicalize(d) for d in devices)
    if not devices:
        raise ValueError(f"{type(strategy).__name__} reported no device to place variables on")
    arr, spec = initial_array(initial_value, dtype, shape)
    if aggregation is VariableAggregation.MEAN and arr.dtype.kind not in "fc":
        raise ValueError(
            "creating distributed cudist.Variable with aggregation=MEAN and a non-floating dtype is not supported, "
            "please use a different aggregation or dtype"
        )
    trainable = _default_trainable(trainable, synchronization)
    if synchronization is VariableSynchronization.AUTO:
        synchronization = VariableSynchronization.ON_WRITE
    base = name if name is not None else "Variable"
    cls = SyncOnReadVariable if synchronization is VariableSynchronization.ON_READ else MirroredVariable
    # Mirrored copies on CPU devices share one host array until one of them is written alone (see
    # GroupStorage.buffers); sync-on-read components differ by design, each has its own.
    shared = place(arr, devices[0], copy=True) if cls is MirroredVariable and not any_gpu(devices) else None
    components = tuple(
        Variable._build(
            shared if shared is not None else place(arr, dev, copy=True),
            name=base if i == 0 else f"{base}/replica_{i}",
            device=dev,
            synchronization=synchronization,
            strategy=strategy,
            trainable=trainable,
            aggregation=aggregation,
            shape_spec=spec,
        )
        for i, dev in enumerate(devices)
    )
    return cls._build_distributed(
        strategy, components, trainable=trainable, synchronization=synchronization, aggregation=aggregation
    )


def create_aggregating_variable(
    strategy: Strategy,
    device: DeviceLike,
    *,
    initial_value: Any,
    trainable: bool | None,
    name: str | None,
    dtype: npt.DTypeLike,
    synchronization: VariableSynchronization,
    aggregation: VariableAggregation,
    shape: object,
) -> AggregatingVariable:
    """Builds CentralStorageStrategy's :class:`AggregatingVariable` on the parameter ``device``."""
    return _build_on_device(
        AggregatingVariable, strategy, device, initial_value, trainable, name, dtype, synchronization, aggregation,
        shape,
    )


Variable.__signature__ = inspect.signature(_create_variable)
