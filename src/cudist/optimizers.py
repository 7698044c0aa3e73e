"""Optimizers over the fused mirrored-update kernels: ``cudist.optimizers.SGD`` and ``Adam``.

They follow Keras 3 (the optimizers TensorFlow 2.21 ships): ``apply_gradients(grads_and_vars)``
returns the ``iterations`` variable, slot variables are created on first use next to each variable,
and the update formulas are Keras's (see the kernel contract, :class:`cudist._kernels.KernelBackend`).

Distribution follows Keras's default (``experimental_aggregate_gradients=True``):

* called in replica context (inside ``strategy.run``), the gradients are per-replica: they are
  summed over the replicas in ONE ``merge_call``. With host arrays and the default cross-device
  ops, each variable's N gradients are summed inside its update kernel (one pass: the gradients
  and copy 0 read, every copy and slot written; bit-identical to reducing first); otherwise ONE
  batched reduction (``extended.batch_reduce_to``, so a user's cross-device ops) for all variables,
  then each variable is updated once;
* called in cross-replica context (inside ``scope()``, or with no strategy), the gradients are final.

Each variable is updated by one fused kernel call (``sgd`` / ``momentum`` / ``adam`` of the
variable's own kernel backend) that reads copy 0 and writes all N mirrored copies of the variable
and of its slots in one pass, so the copies stay bitwise equal. Under CentralStorageStrategy the
single copy on the parameter device is updated once.

Deliberate differences from Keras: the learning rate is a Python number (or a callable taking the
iteration count, like a Keras schedule), not a variable; gradients must have the variable's dtype
(Keras casts them); no weight decay, clipping, EMA or gradient accumulation.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex, TypeAlias

import numpy as np
import numpy.typing as npt

from cudist import _distribute_lib
from cudist._arrays import array_module, device_context, from_dlpack, gpu_of, is_array, is_foreign_array, like
from cudist._kernels import adam_lr_t, numpy_backend
from cudist._reduce_util import ReduceOp
from cudist._values import DistributedValues, Mirrored, PerReplica
from cudist._variables import (
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    cast_value,
    kernel_backend,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from cudist._arrays import Array
    from cudist._distribute_lib import Strategy
    # cudist._kernels is not annotated yet: calls into it carry `type: ignore[no-untyped-call]`.
    from cudist._kernels import KernelBackend, TrustedKernels

__all__ = ["Optimizer", "SGD", "Adam"]

#: A learning rate: a number, or a schedule called with the iteration count (0 on the first step).
LearningRate: TypeAlias = "float | Callable[[int], float]"
#: One memory's kernel work for a variable: (its copies there, per slot its copies, the backend).
_Group: TypeAlias = "tuple[tuple[Any, ...], tuple[tuple[Any, ...], ...], KernelBackend]"
#: A variable's validated kernel work: (the storage arrays it was validated for, its groups).
_Plan: TypeAlias = "tuple[tuple[Any, ...], tuple[_Group, ...]]"


def _check_real(
    name: str, value: object, *, low: float | None = None, high: float | None = None, high_open: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value}")
    if low is not None and value < low:
        raise ValueError(f"`{name}` must be >= {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"`{name}` must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def _base_name(var: Variable) -> str:
    return var.name.split(":")[0]


def _primary_device(var: Variable) -> str:
    return var.values[0].device if isinstance(var, DistributedValues) else var.device


def _same_arrays(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two tuples hold the very same arrays (identity, not values)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _device_groups(bufs: Sequence[Any]) -> list[tuple[int, ...]]:
    """Indices of ``bufs`` grouped by the memory they live in (host, or one GPU each).

    A fused kernel call writes copies in one memory; mirrored copies on several GPUs are updated
    per GPU, each group from its own copy (the copies are equal, so the results are too).
    """
    if all(type(b) is np.ndarray for b in bufs):
        return [tuple(range(len(bufs)))]
    groups: dict[int | None, list[int]] = {}
    for i, b in enumerate(bufs):
        groups.setdefault(gpu_of(b), []).append(i)  # None: host memory
    return [tuple(g) for g in groups.values()]


class Optimizer:
    """Base class of the cudist optimizers (Keras 3's ``keras.optimizers.Optimizer`` API subset).

    Subclasses name their slots in ``_slot_names`` and implement ``_kernel_update`` (and
    ``_step_params`` when a step needs more scalars than the learning rate).

    Args:
        learning_rate: a real number, or a callable taking the iteration count (an int, 0 on the
            first step) and returning one, like a Keras learning-rate schedule.
        name: the optimizer's name; its variables are named under it.
    """

    _slot_names: tuple[str, ...] = ()

    def __init__(self, learning_rate: LearningRate, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"`name` must be a non-empty string, got {name!r}")
        self.name = name
        self.learning_rate = learning_rate
        # Keras creates its iteration counter with ONLY_FIRST_REPLICA aggregation under the strategy
        # current at construction: a replica-context update must be applied once, not N times.
        self._iterations = Variable(
            0,
            dtype=np.int64,
            name=f"{name}/iteration",
            trainable=False,
            aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self._slots: dict[Variable, dict[str, Variable]] = {}  # {slot name: slot} per variable (by identity)
        self._plans: dict[Variable, _Plan] = {}  # variable -> validated kernel work, see _plan
        self._one = np.ones((), dtype=np.int64)
        self._variables = [self._iterations]

    # ------------------------------------------------------------------ properties
    @property
    def iterations(self) -> Variable:
        """The number of ``apply_gradients`` calls so far (an int64 variable, as in Keras)."""
        return self._iterations

    @property
    def learning_rate(self) -> LearningRate:
        """The learning rate: a float, or the callable given."""
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value: LearningRate) -> None:
        if not callable(value):
            value = _check_real("learning_rate", value)
        self._learning_rate = value

    def _current_learning_rate(self, iteration: int) -> float:
        lr = self._learning_rate
        if callable(lr):
            return _check_real(f"learning_rate({iteration})", lr(iteration))
        return lr

    @property
    def variables(self) -> list[Variable]:
        """The optimizer's variables: ``iterations``, then the slots in creation order."""
        return list(self._variables)

    def get_slot(self, var: Variable, slot_name: str) -> Variable:
        """The slot variable ``slot_name`` of ``var`` (created by :meth:`build` or a first update).

        Args:
            var: a variable the optimizer updates.
            slot_name: one of the optimizer's slots ("momentum", "velocity").

        Raises:
            KeyError: ``var`` has no slots yet, or no slot of that name.
        """
        slots = self._slots.get(var)
        if slots is None:
            raise KeyError(f"{self.name} has no slots for variable '{var.name}' (not built or updated yet)")
        if slot_name not in slots:
            raise KeyError(f"{self.name} has no slot {slot_name!r}; its slots are {list(slots)}")
        return slots[slot_name]

    # ------------------------------------------------------------------ slots
    def build(self, var_list: Iterable[Variable]) -> None:
        """Creates the slot variables of ``var_list`` now (otherwise done on the first update).

        Call it in cross-replica context (inside ``strategy.scope()`` or outside any scope).

        Args:
            var_list: the variables the optimizer will update.

        Raises:
            TypeError: a value that is not a floating-point cudist.Variable.
            ValueError: a SyncOnReadVariable.
        """
        for var in var_list:
            self._check_variable(var)
            self._ensure_slots(var)

    def _ensure_slots(self, var: Variable) -> dict[str, Variable]:
        slots = self._slots.get(var)
        if slots is not None:
            return slots
        # The slot lives where the variable lives: the variable's strategy and devices, so a
        # MirroredVariable gets mirrored slots and CentralStorage's variable a slot on the
        # parameter device.
        if not self._slot_names:  # nothing to create (plain SGD): no strategy to enter, as Keras
            slots = self._slots[var] = {}
            return slots
        strategy = var._distribute_strategy or _distribute_lib.get_strategy()
        slots = {}
        scope = contextlib.ExitStack()  # holds the strategy's scope until the slots are made
        try:
            scope.enter_context(strategy.scope())
        except RuntimeError as e:
            # E.g. apply_gradients outside any scope: it runs in the default strategy's merge_call,
            # where the variable's strategy cannot be entered (TF/Keras: 'Need to be inside "with
            # strategy.scope()"'). Say what to do.
            raise RuntimeError(
                f'Need to be inside "with strategy.scope()" for {strategy!r}: {self.name} creates the slot '
                f"variables of {var.name!r} on first use, in that variable's strategy, and it cannot be entered "
                f"here ({e}). Call apply_gradients inside `with strategy.scope():` or `strategy.run`, or create "
                "the slots first with optimizer.build(var_list) inside `with strategy.scope():`"
            ) from e
        with scope, strategy.extended.colocate_vars_with(var):
            for slot_name in self._slot_names:
                slots[slot_name] = Variable(
                    np.zeros(var._primary_array().shape, dtype=var.dtype),
                    name=f"{_base_name(var)}/{slot_name}",
                    trainable=False,
                    dtype=var.dtype,
                )
        self._slots[var] = slots
        self._variables.extend(slots.values())
        return slots

    # ------------------------------------------------------------------ checks
    def _check_variable(self, var: object) -> None:
        if not isinstance(var, Variable):
            raise TypeError(f"{self.name}: expected a cudist.Variable to update, got {type(var).__name__}")
        if isinstance(var, SyncOnReadVariable):
            raise ValueError(
                f"{self.name}: cannot apply gradients to variable '{var.name}': it is a SyncOnReadVariable "
                "(synchronization=ON_READ), whose components differ by design"
            )
        if var.dtype.kind != "f":
            raise TypeError(
                f"{self.name}: cannot update variable '{var.name}' of dtype {var.dtype.name}: the optimizer "
                "kernels need a floating-point dtype (float16, float32, float64)"
            )
        if var._kernel() is None and array_module(var._primary_array()) is not np:
            raise TypeError(f"{self.name}: no GPU kernel supports variable '{var.name}' of dtype {var.dtype.name}")

    def _check_grad(self, grad: Any, var: Variable, *, cross_replica: bool) -> Array:
        """``grad`` as an array of ``var``'s dtype and shape (not yet on its device)."""
        if isinstance(grad, DistributedValues):
            if not cross_replica:
                raise ValueError(
                    f"{self.name}: the gradient of variable '{var.name}' is a {type(grad).__name__}; inside "
                    "strategy.run pass this replica's gradient (an array)"
                )
            if not isinstance(grad, Mirrored):
                raise ValueError(
                    f"{self.name}: the gradient of variable '{var.name}' is a {type(grad).__name__} in "
                    "cross-replica context; reduce it first (strategy.reduce / extended.reduce_to) or call "
                    "apply_gradients inside strategy.run"
                )
            grad = grad.values[0]
        if isinstance(grad, Variable):
            grad = grad.read_value()
        elif is_foreign_array(grad):  # a JAX array, a PyTorch tensor: NumPy/CuPy through DLPack, no copy
            grad = from_dlpack(grad)
        if is_array(grad):
            if grad.dtype != var.dtype:
                raise TypeError(
                    f"{self.name}: the gradient of variable '{var.name}' has dtype {grad.dtype.name} but the "
                    f"variable has dtype {var.dtype.name}"
                )
        else:  # Python numbers and lists convert under TF's rules
            grad = cast_value(grad, var.dtype, f"{self.name}: gradient of variable '{var.name}'")
        shape = var._primary_array().shape  # var.shape may have None dimensions (``shape=`` at creation)
        if grad.shape != shape:
            raise ValueError(
                f"{self.name}: the gradient of variable '{var.name}' has shape {grad.shape} but the variable "
                f"has shape {shape}"
            )
        return grad

    # ------------------------------------------------------------------ applying
    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[npt.ArrayLike | DistributedValues | None, Variable]],
        *,
        experimental_aggregate_gradients: bool = True,
    ) -> Variable:
        """Applies gradients to variables, one fused kernel pass per variable.

        Args:
            grads_and_vars: (gradient, variable) pairs. A None gradient skips its variable (with a
                warning, as in Keras). In replica context each replica passes its own gradients.
            experimental_aggregate_gradients: in replica context, sum the per-replica gradients
                over the replicas first (True, Keras's behaviour); False means they are already
                all-reduced, and replica 0's are used.

        Returns:
            The ``iterations`` variable (Keras 3 returns it too), incremented by one.

        Raises:
            TypeError: a non-floating variable, or a gradient whose dtype is not the variable's.
            ValueError: a gradient whose shape is not the variable's; no gradient at all; a
                SyncOnReadVariable; a PerReplica gradient in cross-replica context.
        """
        pairs: list[tuple[Any, Variable]] = []
        missing: list[str] = []
        for item in grads_and_vars:
            try:
                grad, var = item
            except (TypeError, ValueError):
                raise TypeError(f"{self.name}.apply_gradients expects (gradient, variable) pairs, got {item!r}") from None
            self._check_variable(var)
            if grad is None:
                missing.append(var.name)
                continue
            pairs.append((grad, var))
        if not pairs:
            if missing:
                raise ValueError("No gradients provided for any variable.")
            return self._iterations
        if missing:
            warnings.warn(f"Gradients do not exist for variables {missing} when minimizing the loss.", UserWarning, stacklevel=2)

        ctx = _distribute_lib.get_replica_context()
        variables = [v for _, v in pairs]
        grads: Sequence[Array]
        if ctx is None:  # cross-replica: the gradients are final
            grads = [self._check_grad(g, v, cross_replica=True) for g, v in pairs]
            self._apply(grads, variables)
            return self._iterations
        grads = tuple(self._check_grad(g, v, cross_replica=False) for g, v in pairs)
        aggregate = bool(experimental_aggregate_gradients)

        def merge_fn(strategy: Strategy, per_replica_grads: Sequence[Any]) -> None:
            n = strategy.num_replicas_in_sync
            if n > 1 and aggregate and self._apply_fused(strategy, list(per_replica_grads), variables):
                return
            reduced = self._aggregate(strategy, list(per_replica_grads), variables, aggregate)
            self._apply(reduced, variables, fresh=n > 1 and aggregate)

        ctx.merge_call(merge_fn, args=(grads,))
        return self._iterations

    def _aggregate(
        self, strategy: Strategy, grads: list[Any], variables: Sequence[Variable], aggregate: bool
    ) -> Sequence[Any]:
        """Per-replica gradients (inside merge_call) -> one array per variable, summed in one batch."""
        if strategy.num_replicas_in_sync == 1:
            return grads
        if not aggregate:
            return [g.values[0] if isinstance(g, DistributedValues) else g for g in grads]
        # The same object from every replica is regrouped unwrapped; its all-reduce is still N times it.
        n = len(strategy.extended.worker_devices)  # this worker's replicas (the others' come through the reduction)
        values = [g if isinstance(g, DistributedValues) else PerReplica([g] * n) for g in grads]
        return strategy.extended.batch_reduce_to(
            ReduceOp.SUM, [(g, _primary_device(v)) for g, v in zip(values, variables)]
        )

    def _apply_fused(self, strategy: Strategy, grads: list[Any], variables: Sequence[Variable]) -> bool:
        """Sums each variable's per-replica gradients and updates it in ONE kernel pass, if it can.

        Possible when every gradient and every copy is in host memory and the strategy's
        cross-device ops reduce with the kernels' own replica-order sum (the default ops; see
        ``extended._fused_sum_backend``): then the pass reads the N gradients and copy 0 of the
        variable and slots and writes every copy -- bit-identical to reducing first, then
        updating. Returns False (nothing done) otherwise, for the general path.
        """
        n = len(strategy.extended.worker_devices)
        work: list[tuple[KernelBackend, tuple[Any, ...], tuple[tuple[Any, ...], ...], list[Any]]] = []
        for g, var in zip(grads, variables):
            comps = list(g.values) if isinstance(g, DistributedValues) else [g] * n
            if len(comps) != n:
                return False
            backend = strategy.extended._fused_sum_backend(comps)
            if backend is None:
                return False
            plan = self._plan(var)
            if len(plan[1]) != 1:
                return False
            copies, slots, var_backend = plan[1][0]
            if var_backend is not backend or type(copies[0]) is not np.ndarray:
                return False
            work.append((backend, copies, slots, comps))
        iteration = int(self._iterations)
        params = self._step_params(self._current_learning_rate(iteration), iteration + 1)
        for backend, copies, slots, comps in work:
            written = copies + sum(slots, ())
            ins: list[Any] = []
            for c in comps:
                if not c.flags.c_contiguous:
                    c = np.ascontiguousarray(c)
                elif any(c is w for w in written) or (
                    c.base is not None and any(np.may_share_memory(c, w) for w in written)
                ):
                    c = c.copy()  # a gradient overlapping what the pass writes
                ins.append(c)
            self._kernel_update_reduced(backend.trusted, copies, slots, ins, params)
        self._iterations.assign_add(self._one, read_value=False)
        return True

    def _apply(self, grads: Sequence[Any], variables: Sequence[Variable], fresh: bool = False) -> None:
        """Updates every variable once from its final gradient (cross-replica context).

        ``fresh``: the gradients are new buffers (results of the reduction) that alias nothing.
        """
        plans = [self._plan(v) for v in variables]  # slots are all created before any variable changes
        iteration = int(self._iterations)
        params = self._step_params(self._current_learning_rate(iteration), iteration + 1)
        for grad, plan in zip(grads, plans):
            for copies, slots, backend in plan[1]:
                ref = copies[0]
                if type(ref) is np.ndarray:
                    g = grad if type(grad) is np.ndarray else like(grad, ref)
                    if not g.flags.c_contiguous:
                        g = np.array(g, order="C")
                    elif not fresh and (g.base is not None or any(g is c for c in copies)):
                        # A view may overlap a copy the kernel writes while reading the gradient.
                        if any(np.may_share_memory(g, c) for c in copies):
                            g = g.copy()
                    self._kernel_update(backend.trusted, copies, slots, g, params)
                else:
                    with device_context(ref):
                        g = like(grad, ref)
                        if not g.flags.c_contiguous or any(g is c for c in copies):
                            g = g.copy(order="C")
                        self._kernel_update(backend.trusted, copies, slots, g, params)
        self._iterations.assign_add(self._one, read_value=False)

    def _plan(self, var: Variable) -> _Plan:
        """The validated kernel work of ``var``: per memory, (copies, slot copies, backend).

        Validated once through the backends' own checks, then reused while the variable and its
        slots keep the same storage arrays (an assign of a new shape reallocates them), so each step
        calls the kernels' hooks directly instead of re-checking every buffer.
        """
        slots = self._ensure_slots(var)
        bufs = var._buffers()
        slot_bufs = tuple(s._buffers() for s in slots.values())
        key = bufs + sum(slot_bufs, ())
        plan = self._plans.get(var)
        if plan is not None and _same_arrays(plan[0], key):
            return plan
        where = f"{self.name} update of '{var.name}'"
        groups: list[_Group] = []
        for idx in _device_groups(bufs):
            copies = tuple(bufs[i] for i in idx)
            backend = var._kernel() if len(idx) == len(bufs) else kernel_backend(copies[0])
            if backend is None:  # a dtype the fast CPU backend lacks: the NumPy reference has all
                backend = numpy_backend()
            copies = backend.check_bufs(where, copies, writable=True, what="copy")
            backend.check_float(where, copies[0])
            group_slots: list[tuple[Any, ...]] = []
            for name, sb in zip(slots, slot_bufs):
                sc = backend.check_bufs(where, tuple(sb[i] for i in idx), writable=True, what=f"{name} copy")
                backend.check_same_slots(where, copies, sc, name)  # type: ignore[no-untyped-call]
                group_slots.append(sc)
            groups.append((copies, tuple(group_slots), backend))
        plan = (key, tuple(groups))
        self._plans[var] = plan
        return plan

    def _step_params(self, lr: float, step: int) -> tuple[float, ...]:
        """The scalars of one step (``step`` is 1-based), computed once for all variables."""
        return (lr,)

    def _kernel_update(  # pragma: no cover - abstract
        self,
        kernels: TrustedKernels,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        grad: Any,
        params: tuple[float, ...],
    ) -> None:
        """Updates ``copies`` and their ``slots`` from the final ``grad`` (``kernels``: a backend's ``trusted``)."""
        raise NotImplementedError

    def _kernel_update_reduced(  # pragma: no cover - abstract
        self,
        kernels: TrustedKernels,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        grads: list[Any],
        params: tuple[float, ...],
    ) -> None:
        """As :meth:`_kernel_update`, from per-replica ``grads`` summed in the same pass."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints, copies
    def _checkpoint_state(self) -> dict[str, Any]:
        """What ``cudist.train.Checkpoint`` saves: ``{"hyperparameters": {...}, "iterations": variable,
        "slots": [(variable, slot name, slot variable), ...]}``.

        The hyperparameters are the public numeric/bool/str attributes and the learning rate (None
        when it is a callable).
        """
        lr = self._learning_rate
        hyper: dict[str, bool | int | float | str | None] = {"learning_rate": None if callable(lr) else lr}
        for k, v in vars(self).items():
            if not k.startswith("_") and isinstance(v, (bool, int, float, str)):
                hyper[k] = v
        slots = [(var, name, slot) for var, named in self._slots.items() for name, slot in named.items()]
        return {"hyperparameters": hyper, "iterations": self._iterations, "slots": slots}

    def _restore_state(self, hyperparameters: dict[str, Any], var_list: Iterable[Variable] = ()) -> None:
        """Creates the slots of ``var_list`` (the checkpoint then restores their values) and restores a
        numeric learning rate, as Keras 3 restores its learning-rate variable. Other hyperparameters
        are constructor arguments and stay as constructed."""
        self.build(var_list)
        lr = hyperparameters.get("learning_rate")
        if lr is not None and not callable(self._learning_rate):
            self.learning_rate = lr

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """An independent optimizer: same hyperparameters, copies of ``iterations`` and the slots.

        Its slots are keyed by deep copies of the variables they belong to (the same copies as the
        rest of one ``copy.deepcopy`` call makes: deep-copy a model and its optimizer together).
        """
        import copy  # noqa: PLC0415

        new = object.__new__(type(self))
        memo[id(self)] = new
        for k, v in vars(self).items():
            if k == "_plans":
                new._plans = {}  # kernel work validated for the original's buffers
            elif k == "_slots":
                new._slots = {copy.deepcopy(var, memo): copy.deepcopy(named, memo) for var, named in v.items()}
            else:
                new.__dict__[k] = copy.deepcopy(v, memo)
        return new

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(
            f"cannot pickle optimizer {self.name!r}: its slots are keyed by the variables it trains, which "
            "belong to their strategy's devices; save it with cudist.train.Checkpoint(optimizer=..., model=...) "
            "(copy.deepcopy works in-process)"
        )

    def __repr__(self) -> str:
        return f"<cudist.optimizers.{type(self).__name__} name={self.name!r} iterations={int(self._iterations)}>"


class SGD(Optimizer):
    """Gradient descent, with optional (Nesterov) momentum (``keras.optimizers.SGD``).

    Without momentum: ``w -= learning_rate * g``. With momentum, one slot ``"momentum"`` (the
    velocity) per variable: ``v = momentum * v - learning_rate * g``, then ``w += v`` or, with
    Nesterov, ``w += momentum * v - learning_rate * g``.

    Args:
        learning_rate: see :class:`Optimizer`.
        momentum: in [0, 1]; 0 means plain SGD (no slot).
        nesterov: use Nesterov momentum.
        name: the optimizer's name.
    """

    def __init__(
        self, learning_rate: LearningRate = 0.01, momentum: float = 0.0, nesterov: bool = False, name: str = "SGD"
    ) -> None:
        self.momentum = _check_real("momentum", momentum, low=0.0, high=1.0)
        self.nesterov = bool(nesterov)
        self._slot_names = ("momentum",) if self.momentum != 0 else ()
        super().__init__(learning_rate, name)

    def _kernel_update(
        self,
        kernels: TrustedKernels,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        grad: Any,
        params: tuple[float, ...],
    ) -> None:
        if slots:
            kernels.momentum(copies, slots[0], grad, params[0], self.momentum, self.nesterov)  # type: ignore[no-untyped-call]
        else:
            kernels.sgd(copies, grad, params[0])  # type: ignore[no-untyped-call]

    def _kernel_update_reduced(
        self,
        kernels: TrustedKernels,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        grads: list[Any],
        params: tuple[float, ...],
    ) -> None:
        if slots:
            kernels.all_reduce_momentum(copies, slots[0], grads, params[0], self.momentum, self.nesterov)  # type: ignore[no-untyped-call]
        else:
            kernels.all_reduce_sgd(copies, grads, params[0])  # type: ignore[no-untyped-call]


class Adam(Optimizer):
    """Adam (``keras.optimizers.Adam``), with slots ``"momentum"`` (m) and ``"velocity"`` (v).

    At step ``t`` (1-based): ``lr_t = learning_rate * sqrt(1 - beta_2**t) / (1 - beta_1**t)``;
    ``m += (g - m) * (1 - beta_1)``; ``v += (g*g - v) * (1 - beta_2)``;
    ``w -= lr_t * m / (sqrt(v) + epsilon)``.

    Args:
        learning_rate: see :class:`Optimizer`.
        beta_1, beta_2: decay rates of the moment estimates, in [0, 1).
        epsilon: the small constant added to ``sqrt(v)``, >= 0.
        name: the optimizer's name.
    """

    _slot_names = ("momentum", "velocity")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        name: str = "adam",
    ) -> None:
        self.beta_1 = _check_real("beta_1", beta_1, low=0.0, high=1.0, high_open=True)
        self.beta_2 = _check_real("beta_2", beta_2, low=0.0, high=1.0, high_open=True)
        self.epsilon = _check_real("epsilon", epsilon, low=0.0)
        super().__init__(learning_rate, name)

    def _step_params(self, lr: float, step: int) -> tuple[float, ...]:
        return (adam_lr_t(lr, self.beta_1, self.beta_2, step),)

    def _kernel_update(
        self,
        kernels: TrustedKernels,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        grad: Any,
        params: tuple[float, ...],
    ) -> None:
        kernels.adam(copies, slots[0], slots[1], grad, params[0], self.beta_1, self.beta_2, self.epsilon)  # type: ignore[no-untyped-call]

    def _kernel_update_reduced(
        self,
        kernels: TrustedKernels,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        grads: list[Any],
        params: tuple[float, ...],
    ) -> None:
        kernels.all_reduce_adam(  # type: ignore[no-untyped-call]
            copies, slots[0], slots[1], grads, params[0], self.beta_1, self.beta_2, self.epsilon
        )
