"""Optimizers over the fused mirrored-update kernels: ``cudist.optimizers.SGD``, ``Adam``, ``AdamW``,
``RMSprop``, ``Adagrad``, ``Adamax``, ``Nadam``, ``Lion``, and ``cudist.optimizers.schedules``.

They follow Keras 3 (the optimizers TensorFlow 2.21 ships): ``apply_gradients(grads_and_vars)``
returns the ``iterations`` variable, slot variables are created on first use next to each variable,
and the update formulas are Keras's (see the kernel contract, :class:`cudist._kernels.KernelBackend`).

Distribution follows Keras's default (``experimental_aggregate_gradients=True``):

* called in replica context (inside ``strategy.run``), the gradients are per-replica: they are
  summed over the replicas in ONE ``merge_call``. With host arrays and the default cross-device
  ops, each variable's N gradients are summed inside its update kernel (one pass: the gradients
  and copy 0 read, every copy and slot written; bit-identical to reducing first); otherwise ONE
  batched reduction (``extended.batch_reduce_to``, so a user's cross-device ops) for all variables,
  then each variable is updated once (in a multi-worker job with ``CUDIST_PIPELINE_UPDATE=on`` and
  several packs, pack by pack: each pack's variables updated while the next packs cross the
  workers, the same bits);
* called in cross-replica context (inside ``scope()``, or with no strategy), the gradients are final.

Each variable is updated by one fused kernel call (``sgd`` / ``momentum`` / ``nesterov`` / ``adamw`` /
``amsgrad`` / ``rmsprop`` / ``adagrad`` / ``adamax`` / ``nadam`` / ``lion`` of the variable's own kernel backend) that reads copy 0 and writes all N mirrored copies of the variable
and of its slots in one pass, so the copies stay bitwise equal. Under CentralStorageStrategy the
single copy on the parameter device is updated once. Each optimizer here names its step's rule (a
row of the kernels' table ``UPDATE_KERNELS``) and scalars; :mod:`cudist._dataplane.update` plans,
settles the gradients and calls the kernels.

Keras 3's base arguments work on every optimizer: ``weight_decay`` (decoupled, inside the update
pass; ``exclude_from_weight_decay``), ``clipnorm`` / ``clipvalue`` /
``global_clipnorm``, ``use_ema`` / ``ema_momentum`` / ``ema_overwrite_frequency``
(``finalize_variable_values``), ``loss_scale_factor`` (``scale_loss``) and
``gradient_accumulation_steps``. As in Keras 3 under a tf.distribute strategy (observed with TF
2.21), the loss scale, the accumulation and the clipping apply to each replica's own gradients
before they are summed (so ``clipnorm`` bounds each replica's contribution, not the sum); the
weight decay and the update then apply once to the variable. ``learning_rate`` is a number, a
:class:`~cudist.optimizers.schedules.LearningRateSchedule` (called with the iteration count) or a
callable of no arguments, as in Keras. Gradients of another dtype are cast to the variable's.

As in Keras 3, a numeric learning rate is a float32 variable (``optimizer.learning_rate``, listed
second in ``variables``) that each step reads once. Deliberate differences from Keras: Nadam's
running momentum product is computed from ``iterations`` rather than kept in a variable; the gradient accumulators of ``gradient_accumulation_steps`` are host-side
per-replica buffers, not variables (a checkpoint does not save a half-accumulated step).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex, TypeAlias

import numpy as np
import numpy.typing as npt

from cudist import _distribute_lib
from cudist import _schedules as schedules
from cudist._arrays import array_module, device_context, from_dlpack, is_array, is_device_array, is_foreign_array, to_host
from cudist._dataplane.update import Plan, Rule, UpdatePass, bias_corrected_lr, is_bfloat16, momentum_schedule_step, settle_inputs
from cudist._reduce_util import ReduceOp
from cudist._schedules import LearningRateSchedule
from cudist._values import DistributedValues, Mirrored, PerReplica
from cudist.errors import InvalidArgumentError
from cudist._variables import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    cast_value,
    strategy_of,
)

if TYPE_CHECKING:
    from typing_extensions import Self

    from cudist._arrays import Array
    from cudist._distribute_lib import Strategy

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "Nadam", "Lion", "LossScaleOptimizer", "schedules"]

# ``import cudist.optimizers.schedules`` / ``from cudist.optimizers.schedules import CosineDecay``
# find the schedules module under its public name (this module is not a package).
sys.modules.setdefault(__name__ + ".schedules", schedules)

#: A learning rate (Keras 3): a number, a schedule called with the iteration count (0 on the first
#: step), or a callable of no arguments.
LearningRate: TypeAlias = "float | LearningRateSchedule | Callable[[], float]"


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


def _optional_real(name: str, value: object, *, low: float | None = None) -> float | None:
    return None if value is None else _check_real(name, value, low=low)


def _is_schedule(lr: object) -> bool:
    """A learning-rate schedule (called with the iteration count): cudist's, or Keras's by class name."""
    return isinstance(lr, LearningRateSchedule) or any(
        c.__name__ == "LearningRateSchedule" for c in type(lr).__mro__[1:]
    )


def _narrow_ok(grad: Any, var: Variable) -> bool:
    """Whether ``grad`` may reach the fused all-reduce + update of ``var`` uncast: a bfloat16 or
    float16 gradient (host or GPU array) of a float32 variable whose backend's fused kernels widen
    it in the pass (exactly: the bits of casting it first, without the float32 copy)."""
    if var.dtype != np.float32 or (type(grad) is not np.ndarray and not is_device_array(grad)):
        return False
    if grad.dtype != np.float16 and not is_bfloat16(grad.dtype):
        return False
    backend = var.storage.kernel()
    return backend is not None and backend.mixed_gradients


def _cast(grad: Any, dtype: Any) -> Any:
    """``grad.astype(dtype)`` where ``grad`` lives: a replica's GPU gradient is cast on its own GPU
    (the merge_call runs with another replica's device current)."""
    if type(grad) is np.ndarray:
        return grad.astype(dtype)
    with device_context(grad):
        return grad.astype(dtype)


def _clip_by_norm(g: Any, clipnorm: float) -> Any:
    """``tf.clip_by_norm`` (Keras 3's TF backend): ``g * clipnorm / max(norm, clipnorm)`` in g's dtype."""
    xp = array_module(g)
    dt = g.dtype.type
    l2sum = xp.sum(g * g)
    norm = xp.sqrt(l2sum) if l2sum > 0 else l2sum
    return g * dt(clipnorm) / xp.maximum(norm, dt(clipnorm))


def _clip_by_global_norm(grads: list[Any], clipnorm: float) -> list[Any]:
    """Keras 3's ``clip_by_global_norm``: every gradient times
    ``clipnorm * min(1 / norm, 1 / clipnorm)`` (NaN when the global norm is not finite)."""
    norm = math.sqrt(sum(float(array_module(g).sum(g * g)) for g in grads))
    inverse = 1.0 / norm if norm else math.inf
    scale = clipnorm * min(inverse, 1.0 / clipnorm) + (norm - norm)
    return [g * g.dtype.type(scale) for g in grads]


def _base_name(var: Variable) -> str:
    return var.name.split(":")[0]


def _primary_device(var: Variable) -> str:
    return var.values[0].device if isinstance(var, DistributedValues) else var.device


class _ReplicaGrads:
    """One replica's gradients on their way through ``merge_call``: one object, so that merge_call
    regroups the replicas' lists as one PerReplica instead of one per variable (which the fused
    update would unwrap again)."""

    __slots__ = ("grads", "narrow")

    def __init__(self, grads: list[Any], narrow: bool = False) -> None:
        self.grads = grads
        self.narrow = narrow  # some gradient was left narrow for the fused pass to widen (_narrow_ok)


#: How many optimizers took each default name so far (Keras 3's ``uniquify``, per process).
_NAME_UIDS: dict[str, int] = {}
_NAME_LOCK = threading.Lock()


def _auto_name(class_name: str) -> str:
    """Keras 3's default optimizer name: the class name in snake case ("RMSprop" -> "rm_sprop"),
    then "_1", "_2", ... for the later ones in the process."""
    snake = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", re.sub(r"\W+", "", class_name))
    snake = re.sub(r"([a-z])([A-Z])", r"\1_\2", snake).lower()
    # Inside ``strategy.run`` every replica makes its own optimizer and its variables are created once,
    # under one name: the replicas take the next number without using it up (TF hides Keras's
    # different numbers per replica by stripping "_<digit>" suffixes, for the first ten only).
    in_replicas = _distribute_lib.has_strategy() and _distribute_lib.get_replica_context() is not None
    with _NAME_LOCK:
        count = _NAME_UIDS.get(snake, 0)
        if not in_replicas:
            _NAME_UIDS[snake] = count + 1
    return snake if count == 0 else f"{snake}_{count}"


class Optimizer:
    """Base class of the cudist optimizers (Keras 3's ``keras.optimizers.Optimizer`` API subset).

    Subclasses name their slots in ``_slot_names`` and their update rule in ``_rule`` (a row of
    the kernels' table of update rules, run by :mod:`cudist._dataplane.update`), and implement
    ``_step_params`` when a step needs more scalars than the learning rate.

    Args:
        learning_rate: a real number; a :class:`~cudist.optimizers.schedules.LearningRateSchedule`
            (called with the iteration count, 0 on the first step); or a callable of no arguments
            (Keras 3).
        name: the optimizer's name; its variables are named under it (None: Keras 3's default, the
            class's name in snake case made unique in the process: "rm_sprop", "rm_sprop_1", ...).
        weight_decay: decoupled weight decay: ``w -= w * weight_decay * learning_rate`` before
            each update (variables named in :meth:`exclude_from_weight_decay` are exempt).
        clipnorm: clip each gradient to this L2 norm (``tf.clip_by_norm``).
        clipvalue: clip each gradient element to ``[-clipvalue, clipvalue]``.
        global_clipnorm: scale the gradients of one ``apply_gradients`` so that their global
            norm is at most this. At most one of the three clippings. Under a strategy they apply
            to each replica's gradients before the sum, as Keras 3 does.
        use_ema: keep an exponential moving average of every variable (``ema_momentum``; the
            first step copies the variable); every ``ema_overwrite_frequency`` steps, and in
            :meth:`finalize_variable_values`, the variables take their averages.
        loss_scale_factor: gradients are divided by it first; :meth:`scale_loss` multiplies.
        gradient_accumulation_steps: an integer >= 2: the variables change every this many
            steps, from the mean of the gradients since the last change (each replica
            accumulates its own, as Keras 3 does under a strategy).
    """

    _slot_names: tuple[str, ...] = ()
    #: Slots Keras 3 lists by kind (all variables' first kind, then the next) after the per-variable
    #: ones, in ``optimizer.variables``: RMSprop's every slot, Adam's ``velocity_hat``.
    _grouped_slot_names: tuple[str, ...] = ()

    def __init__(
        self,
        learning_rate: LearningRate,
        name: str | None,
        *,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:  # Keras 3's error for a misspelt or unknown argument
            raise ValueError(f"Argument(s) not recognized: {kwargs}")
        if name is None:
            name = _auto_name(type(self).__name__)
        if not isinstance(name, str) or not name:
            raise TypeError(f"`name` must be a non-empty string, got {name!r}")
        self.name = name
        # Keras 3's base arguments. Private attributes behind properties: the checkpoint's record of
        # hyperparameters (_checkpoint_state) lists the public ones, i.e. each optimizer's own.
        self._weight_decay = _optional_real("weight_decay", weight_decay, low=0.0)
        self._clipnorm = _optional_real("clipnorm", clipnorm, low=0.0)
        self._clipvalue = _optional_real("clipvalue", clipvalue, low=0.0)
        self._global_clipnorm = _optional_real("global_clipnorm", global_clipnorm, low=0.0)
        if sum(a is not None for a in (clipnorm, clipvalue, global_clipnorm)) > 1:
            raise ValueError(
                "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
                f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
            )
        self._use_ema = bool(use_ema)
        self._ema_momentum = _check_real("ema_momentum", ema_momentum)
        if use_ema and not 0.0 <= self._ema_momentum <= 1.0:
            raise ValueError(f"`ema_momentum` must be in the range [0, 1]. Received: ema_momentum={ema_momentum}")
        if ema_overwrite_frequency is not None and (
            isinstance(ema_overwrite_frequency, bool)
            or not isinstance(ema_overwrite_frequency, numbers.Integral)
            or ema_overwrite_frequency < 1
        ):
            raise ValueError(
                "`ema_overwrite_frequency` must be an integer >= 1 or None. Received: "
                f"ema_overwrite_frequency={ema_overwrite_frequency}"
            )
        self._ema_overwrite_frequency = None if ema_overwrite_frequency is None else int(ema_overwrite_frequency)
        self._loss_scale_factor = _optional_real("loss_scale_factor", loss_scale_factor)
        if self._loss_scale_factor == 0.0:
            raise ValueError("`loss_scale_factor` must not be 0")
        if gradient_accumulation_steps is not None and (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, numbers.Integral)
            or gradient_accumulation_steps < 2
        ):
            raise ValueError(
                "`gradient_accumulation_steps` must be an integer >= 2. Received: "
                f"gradient_accumulation_steps={gradient_accumulation_steps}"
            )
        self._gradient_accumulation_steps = None if gradient_accumulation_steps is None else int(gradient_accumulation_steps)
        self._learning_rate: float | LearningRateSchedule | Callable[[], Any] = 0.0
        self._learning_rate_rounded = math.nan  # float32 rounding of a numeric _learning_rate (nan: none)
        self._set_learning_rate(learning_rate, constructing=True)
        # Keras creates its iteration counter with ONLY_FIRST_REPLICA aggregation under the strategy
        # current at construction: a replica-context update must be applied once, not N times.
        self._iterations = Variable(
            0,
            dtype=np.int64,
            name=f"{name}/iteration",
            trainable=False,
            aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
        )
        # With gradient accumulation, Keras's ``iterations`` counts the updates (steps // N): kept
        # in step with ``_iterations`` (what a checkpoint saves) by _after_update / _restore_state.
        self._updates: Variable | None = None
        if self._gradient_accumulation_steps:
            self._updates = Variable(
                0,
                dtype=np.int64,
                name=f"{name}/updates",
                trainable=False,
                aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
            )
        # Keras 3's learning-rate variable (float32, absent for a schedule or a callable): what
        # ``optimizer.learning_rate`` returns and ``optimizer.variables`` lists second. The updates read
        # it (once per step, as they read ``iterations``), so assigning it changes the next step's rate.
        self._learning_rate_variable: Variable | None = None
        if not callable(self._learning_rate):
            self._learning_rate_variable = Variable(
                np.float32(self._learning_rate),
                dtype=np.float32,
                name=f"{name}/learning_rate",
                trainable=False,
                aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
            )
        self._slots: dict[Variable, dict[str, Variable]] = {}  # {slot name: slot} per variable (by identity)
        self._update = UpdatePass(name)  # the kernel side: each variable's validated work, the passes
        self._one = np.ones((), dtype=np.int64)
        self._built = False
        self._ema: dict[Variable, Variable] = {}  # use_ema: the moving average of each variable
        # gradient_accumulation_steps: per variable, each replica's running sum of its gradients.
        self._accumulators: dict[Variable, dict[int, Any]] = {}
        self._wd_exclude: tuple[Variable, ...] = ()
        self._wd_pattern: re.Pattern[str] | None = None
        self._wd_use: dict[Variable, bool] = {}  # exclude_from_weight_decay's answer per variable

    # ------------------------------------------------------------------ properties
    @property
    def iterations(self) -> Variable:
        """The number of ``apply_gradients`` calls so far (an int64 variable, as in Keras); with
        ``gradient_accumulation_steps`` N, the number of updates (calls // N), as Keras 3."""
        return self._iterations if self._updates is None else self._updates

    def _update_step(self, iteration: int) -> int:
        """The 1-based step of the update at call ``iteration`` (bias corrections, Nadam's schedule):
        Keras's ``iterations + 1``, which counts updates under gradient accumulation."""
        steps = self._gradient_accumulation_steps
        return iteration // steps + 1 if steps else iteration + 1

    @property
    def learning_rate(self) -> Variable | float | np.float32:
        """The learning rate (Keras 3): for a number, the optimizer's float32 ``learning_rate``
        variable itself (``opt.learning_rate.assign(0.01)`` changes the rate of the next step); for a
        :class:`~cudist.optimizers.schedules.LearningRateSchedule`, its float32 value at
        ``iterations`` (a read-only ``numpy.float32``); for a callable, its value.

        Setting a number assigns the variable (checked as ``assign`` checks: TypeError for a value
        that is not a real number, as Keras); setting a schedule or a callable replaces the rate and
        drops the variable from :attr:`variables`, as Keras 3 untracks it. An optimizer made with a
        schedule refuses a number (TypeError, as Keras).
        """
        if self._learning_rate_variable is not None:
            return self._learning_rate_variable
        value = self._current_learning_rate(int(self._iterations))
        return np.float32(value) if _is_schedule(self._learning_rate) else value

    @learning_rate.setter
    def learning_rate(self, value: LearningRate) -> None:
        self._set_learning_rate(value, constructing=False)

    def _set_learning_rate(self, value: LearningRate, *, constructing: bool) -> None:
        if _is_schedule(value) or callable(value):
            self._learning_rate = value
            self._learning_rate_variable = None  # as Keras 3, which untracks it
            return
        if _is_schedule(self._learning_rate):
            raise TypeError(
                "This optimizer was created with a `LearningRateSchedule` object as its `learning_rate` "
                "constructor argument, hence its learning rate is not settable. If you need the learning rate "
                "to be settable, you should instantiate the optimizer with a float `learning_rate` argument."
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            # Keras 3: the constructor's check is a ValueError; a later set is the variable's assign,
            # whose conversion fails with a TypeError.
            cls = ValueError if constructing else TypeError
            raise cls(
                "Argument `learning_rate` should be float, or an instance of LearningRateSchedule, or a callable "
                "(that takes in the current iteration value and returns the corresponding learning rate value). "
                f"Received instead: learning_rate={value!r}"
            )
        self._learning_rate = _check_real("learning_rate", value)
        # What the variable holds after this set (compared with it each step: no conversion there).
        self._learning_rate_rounded = float(np.float32(self._learning_rate))
        lr_variable = None if constructing else self._learning_rate_variable
        if lr_variable is not None:
            lr_variable.assign(np.float32(self._learning_rate), read_value=False)

    def _current_learning_rate(self, iteration: int) -> float:
        if self._learning_rate_variable is not None:
            return self._variable_learning_rate()
        lr: Any = self._learning_rate
        if type(lr) is float:
            return lr
        if _is_schedule(lr):
            value = lr(iteration)
        else:
            try:
                value = lr()
            except TypeError as e:
                raise TypeError(
                    f"{self.name}: calling the learning rate {lr!r} with no arguments failed ({e}). As in Keras 3, a "
                    "callable learning rate takes no arguments; a schedule of the iteration count is a "
                    "cudist.optimizers.schedules.LearningRateSchedule (subclass it and define __call__(self, step))"
                ) from e
        if not isinstance(value, numbers.Real):
            try:
                value = float(value)  # a 0-d array, a tensor
            except (TypeError, ValueError):
                pass
        return _check_real(f"learning_rate at iteration {iteration}", value)

    def _variable_learning_rate(self) -> float:
        """The rate the learning-rate variable holds, read once a step from its primary copy (every
        copy holds the same rate: ONLY_FIRST_REPLICA, as :meth:`_iteration` reads). While it holds
        the float32 rounding of the number last set, that number itself: float64 variables keep
        their float64 rate (see the porting guide); after an ``assign`` of the variable, its value."""
        lr_variable = self._learning_rate_variable
        if lr_variable is None:  # (callers check; a schedule or a callable has no variable)
            return self._current_learning_rate(self._iteration())
        held = float(lr_variable.storage.primary)
        lr = self._learning_rate
        return lr if held == self._learning_rate_rounded and type(lr) is float else held

    # Keras 3's base arguments, as given to the constructor (read-only).
    @property
    def weight_decay(self) -> float | None:
        """Decoupled weight decay: ``w -= w * weight_decay * learning_rate`` before each update."""
        return self._weight_decay

    @property
    def clipnorm(self) -> float | None:
        """Each gradient is clipped to this L2 norm (per replica, before the sum, as Keras)."""
        return self._clipnorm

    @property
    def clipvalue(self) -> float | None:
        """Each gradient element is clipped to [-clipvalue, clipvalue] (per replica)."""
        return self._clipvalue

    @property
    def global_clipnorm(self) -> float | None:
        """The gradients of one apply_gradients are scaled to at most this global norm (per replica)."""
        return self._global_clipnorm

    @property
    def use_ema(self) -> bool:
        """Whether an exponential moving average of each variable is kept (see finalize_variable_values)."""
        return self._use_ema

    @property
    def ema_momentum(self) -> float:
        return self._ema_momentum

    @property
    def ema_overwrite_frequency(self) -> int | None:
        return self._ema_overwrite_frequency

    @property
    def loss_scale_factor(self) -> float | None:
        """Gradients are divided by it first (see scale_loss)."""
        return self._loss_scale_factor

    @property
    def gradient_accumulation_steps(self) -> int | None:
        """Variables are updated every this many steps, from the mean of the accumulated gradients."""
        return self._gradient_accumulation_steps

    @property
    def built(self) -> bool:
        """Whether :meth:`build` or a first update created the optimizer's variables."""
        return self._built

    @property
    def variables(self) -> list[Variable]:
        """The optimizer's variables in Keras 3's order: ``iteration``, ``learning_rate`` (absent
        for a schedule or a callable), the moving averages (``use_ema``), then the slots: per
        variable (Adam's momentum and velocity of each), except the kinds Keras lists by kind
        (RMSprop's slots, Adam's ``velocity_hat``), then Nadam's ``u_product``.

        The variables appear in the order their slots were made (:meth:`build`'s list, or the
        first update's). cudist keeps the gradient accumulators of ``gradient_accumulation_steps``
        per replica, outside this list (see the porting guide).
        """
        owners = list(self._slots)
        out = [self._iterations]
        if self._learning_rate_variable is not None:
            out.append(self._learning_rate_variable)
        out += [self._ema[v] for v in owners if v in self._ema]
        grouped = self._grouped_slot_names
        out += [slot for v in owners for name, slot in self._slots[v].items() if name not in grouped]
        out += [self._slots[v][name] for name in grouped for v in owners if name in self._slots[v]]
        return out + self._extra_variables()

    def _extra_variables(self) -> list[Variable]:
        """Variables Keras lists after the slots (Nadam's ``u_product``)."""
        return []

    def _build_extra(self, var: Variable) -> None:
        """Creates an optimizer's variables other than slots, in ``var``'s strategy and place (at the first build)."""

    # ------------------------------------------------------------------ Keras 3's configuration
    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as Keras 3 lists them (a schedule serialized as Keras does;
        a plain callable learning rate is put in as is). ``from_config(get_config())`` rebuilds the
        optimizer without its state."""
        lr: Any = self._learning_rate
        if isinstance(lr, LearningRateSchedule):
            lr = schedules.serialize(lr)
        elif self._learning_rate_variable is not None:
            lr = self._variable_learning_rate()  # an assign of the variable included, as Keras 3
        return {
            "name": self.name,
            "learning_rate": lr,
            "weight_decay": self._weight_decay,
            "clipnorm": self._clipnorm,
            "global_clipnorm": self._global_clipnorm,
            "clipvalue": self._clipvalue,
            "use_ema": self._use_ema,
            "ema_momentum": self._ema_momentum,
            "ema_overwrite_frequency": self._ema_overwrite_frequency,
            "loss_scale_factor": self._loss_scale_factor,
            "gradient_accumulation_steps": self._gradient_accumulation_steps,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> Self:
        """The optimizer ``config`` describes (what :meth:`get_config` returned, or Keras's)."""
        config = dict(config)
        lr = config.get("learning_rate")
        if isinstance(lr, dict):
            config["learning_rate"] = schedules.deserialize(lr, custom_objects=custom_objects)
        return cls(**config)

    def exclude_from_weight_decay(
        self, var_list: Iterable[Variable] | None = None, var_names: Iterable[str] | None = None
    ) -> None:
        """Exempts variables from the weight decay (Keras 3): those of ``var_list``, and those whose
        name contains (``re.search``) one of ``var_names``, e.g. ``var_names=["bias"]``."""
        self._wd_exclude = tuple(var_list) if var_list else ()
        names = sorted(set(var_names)) if var_names else []
        self._wd_pattern = re.compile("|".join(names)) if names else None
        self._wd_use.clear()

    def _use_weight_decay(self, var: Variable) -> bool:
        use = self._wd_use.get(var)
        if use is None:
            use = not any(var is v for v in self._wd_exclude) and (
                self._wd_pattern is None or self._wd_pattern.search(var.name) is None
            )
            self._wd_use[var] = use
        return use

    def _decay(self, var: Variable, lr: float) -> float:
        """The weight-decay factor of ``var`` at learning rate ``lr`` (0.0: none)."""
        wd = self._weight_decay
        if not wd or not self._use_weight_decay(var):
            return 0.0
        return wd * lr

    def scale_loss(self, loss: Any) -> Any:
        """``loss * loss_scale_factor`` (the loss as is without one), as Keras 3."""
        return loss if self._loss_scale_factor is None else loss * self._loss_scale_factor

    def finalize_variable_values(self, var_list: Iterable[Variable]) -> None:
        """With ``use_ema``, sets each variable of ``var_list`` to its moving average (Keras 3)."""
        if not self._use_ema:
            return
        for var in var_list:
            average = self._ema.get(var)
            if average is not None:
                var.assign(average.read_value(), read_value=False)

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
        self._built = True

    def _slot_initial_value(self, slot_name: str) -> float:
        """The value slot ``slot_name`` starts at (Adagrad's accumulator: initial_accumulator_value)."""
        return 0.0

    def _ensure_slots(self, var: Variable) -> dict[str, Variable]:
        slots = self._slots.get(var)
        if slots is not None:
            return slots
        # The slot lives where the variable lives: the variable's strategy and devices, so a
        # MirroredVariable gets mirrored slots and CentralStorage's variable a slot on the
        # parameter device.
        if not self._slot_names and not self._use_ema:  # nothing to create (plain SGD): no strategy to enter, as Keras
            slots = self._slots[var] = {}
            return slots
        strategy = strategy_of(var) or _distribute_lib.get_strategy()
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
            shape = var.storage.primary.shape
            prefix = f"{self.name}/{_base_name(var).replace('/', '_')}_"  # Keras 3's path: "adam/dense_kernel_momentum"
            for slot_name in self._slot_names:
                slots[slot_name] = Variable(
                    np.full(shape, self._slot_initial_value(slot_name), dtype=var.dtype),
                    name=prefix + slot_name,
                    trainable=False,
                    dtype=var.dtype,
                )
            if self._use_ema:  # Keras's "average" of the variable, zeros until the first step
                self._ema[var] = Variable(np.zeros(shape, dtype=var.dtype), name=prefix + "average", trainable=False, dtype=var.dtype)
            self._build_extra(var)
        self._slots[var] = slots
        return slots

    # ------------------------------------------------------------------ checks
    def _check_variable(self, var: object) -> None:
        if isinstance(var, Variable) and var in self._update.plans:
            return  # checked before its kernel work was planned; type, dtype and device never change
        if not isinstance(var, Variable):
            raise TypeError(f"{self.name}: expected a cudist.Variable to update, got {type(var).__name__}")
        if isinstance(var, SyncOnReadVariable):
            raise ValueError(
                f"{self.name}: cannot apply gradients to variable '{var.name}': it is a SyncOnReadVariable "
                "(synchronization=ON_READ), whose components differ by design"
            )
        if var.dtype.kind != "f" and not is_bfloat16(var.dtype):
            raise TypeError(
                f"{self.name}: cannot update variable '{var.name}' of dtype {var.dtype.name}: the optimizer "
                "kernels need a floating-point dtype (float16, bfloat16, float32, float64)"
            )
        if var.storage.kernel() is None and array_module(var.storage.primary) is not np:
            raise TypeError(f"{self.name}: no GPU kernel supports variable '{var.name}' of dtype {var.dtype.name}")

    def _check_grad(self, grad: Any, var: Variable, *, cross_replica: bool) -> Array:
        """``grad`` as an array of ``var``'s shape (not yet on its device); a float or integer dtype
        other than the variable's is cast by :meth:`_local_grads`, after the clipping (Keras)."""
        if type(grad) is np.ndarray:  # the per-step common case, as the general checks below accept it
            ref = var.storage.primary
            if grad.dtype == ref.dtype and grad.shape == ref.shape:
                return grad
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
            # bfloat16 (NumPy kind "V") is a float: mixed precision casts it exactly to the variable's
            # float32 before the float32 sum over replicas (or the fused pass widens it: _narrow_ok).
            if grad.dtype != var.dtype and grad.dtype.kind not in "fiu" and not is_bfloat16(grad.dtype):
                raise TypeError(
                    f"{self.name}: the gradient of variable '{var.name}' has dtype {grad.dtype.name}, which cannot "
                    f"be cast to the variable's {var.dtype.name}"
                )
        else:  # Python numbers and lists convert under TF's rules
            grad = cast_value(grad, var.dtype, f"{self.name}: gradient of variable '{var.name}'")
        shape = var.storage.primary.shape  # var.shape may have None dimensions (``shape=`` at creation)
        if grad.shape != shape:
            raise InvalidArgumentError(  # TF's error (a ValueError too)
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

        Every variable's update reads the gradients as they were before the step: a gradient that
        shares memory with a variable or slot the step writes (a view of one, or its DLPack export,
        ``np.from_dlpack(variable)``) is copied before the first update.

        Args:
            grads_and_vars: (gradient, variable) pairs. A None gradient skips its variable (with a
                warning, as in Keras). In replica context each replica passes its own gradients.
            experimental_aggregate_gradients: in replica context, sum the per-replica gradients
                over the replicas first (True, Keras's behaviour); False means they are already
                all-reduced, and replica 0's are used.

        Returns:
            The ``iterations`` variable (Keras 3 returns it too), incremented by one.

        Raises:
            TypeError: a non-floating variable, or a gradient that is not a number array.
            ValueError: a gradient whose shape is not the variable's; no gradient at all; a
                SyncOnReadVariable; a PerReplica gradient in cross-replica context.
        """
        ctx = _distribute_lib.get_replica_context()
        grads: list[Any] = []
        variables: list[Variable] = []
        missing: list[str] = []
        plans = self._update.plans
        cast = False  # whether some gradient may need a cast to its variable's dtype
        for item in grads_and_vars:
            try:
                grad, var = item
            except (TypeError, ValueError):
                raise TypeError(f"{self.name}.apply_gradients expects (gradient, variable) pairs, got {item!r}") from None
            if not (isinstance(var, Variable) and var in plans):  # (a planned variable was checked then)
                self._check_variable(var)
            if grad is None:
                missing.append(var.name)
                continue
            variables.append(var)
            if ctx is not None:  # a replica's gradient (cross-replica ones are checked below)
                if type(grad) is np.ndarray:  # the per-step common case (_check_grad's own first test, inlined)
                    ref = var.storage.primary
                    if grad.dtype == ref.dtype and grad.shape == ref.shape:
                        grads.append(grad)
                        continue
                grad = self._check_grad(grad, var, cross_replica=False)
                cast = True
            grads.append(grad)
        if not variables:
            if missing:
                raise ValueError("No gradients provided for any variable.")
            return self._iterations
        if missing:
            warnings.warn(f"Gradients do not exist for variables {missing} when minimizing the loss.", UserWarning, stacklevel=2)

        self._built = True
        if ctx is None:  # cross-replica: the gradients are final
            checked = [self._check_grad(g, v, cross_replica=True) for g, v in zip(grads, variables)]
            final, update, _ = self._local_grads(checked, variables, 0)
            if update:
                self._apply(final, variables)
            else:
                self._after_update()
            return self._iterations
        aggregate = bool(experimental_aggregate_gradients)
        # A fused all-reduce + update may widen bf16/float16 gradients itself (see _narrow_ok).
        narrow = cast and aggregate and ctx.num_replicas_in_sync > 1
        local, update, left_narrow = self._local_grads(
            grads, variables, ctx.replica_id_in_sync_group, cast=cast, narrow=narrow
        )

        def merge_fn(strategy: Strategy, held: _ReplicaGrads | PerReplica) -> None:
            if not update:  # gradient accumulation: this step only accumulated
                self._after_update()
                return
            each = held.values if isinstance(held, PerReplica) else (held,)
            rows = [h.grads for h in each]
            for r, row in enumerate(rows[1:], 1):
                if len(row) != len(rows[0]):
                    raise ValueError(
                        f"{self.name}.apply_gradients: replica {r} passed {len(row)} gradients but replica 0 passed "
                        f"{len(rows[0])}; every replica must pass a gradient for each of the same variables"
                    )
            per_var = list(zip(*rows))  # per variable, its gradient from each of this worker's replicas
            if any(h.narrow for h in each):
                # The fused kernels take one gradient dtype per variable: where the replicas' dtypes
                # differ (one left bf16, another float32), cast that variable's gradients as Keras does.
                per_var = [
                    comps if all(c.dtype == comps[0].dtype for c in comps) else tuple(_cast(c, v.dtype) for c in comps)
                    for comps, v in zip(per_var, variables)
                ]
            n = strategy.num_replicas_in_sync
            if n > 1 and aggregate and self._apply_fused(strategy, per_var, variables):
                return
            if narrow:  # gradients left narrow for a fused pass that did not happen: cast them now
                per_var = [
                    tuple(c if c.dtype == v.dtype else _cast(c, v.dtype) for c in comps)
                    for comps, v in zip(per_var, variables)
                ]
            if n > 1 and aggregate and self._apply_pipelined(strategy, per_var, variables):
                return
            reduced = self._aggregate(strategy, per_var, variables, aggregate)
            self._apply(reduced, variables, fresh=n > 1 and aggregate)

        ctx.merge_call(merge_fn, args=(_ReplicaGrads(local, left_narrow),))
        return self._iterations

    def _local_grads(
        self, grads: Sequence[Any], variables: Sequence[Variable], replica: int, *, cast: bool = True, narrow: bool = False
    ) -> tuple[list[Any], bool, bool]:
        """One replica's gradients made ready for the sum, as Keras 3 does before its all-reduce:
        divided by ``loss_scale_factor``, accumulated (``gradient_accumulation_steps``), clipped
        (``clipnorm`` / ``global_clipnorm`` / ``clipvalue``), cast to each variable's dtype.

        ``cast=False``: the caller knows every gradient has its variable's dtype already.
        ``narrow=True``: a host bfloat16 or float16 gradient of a float32 variable whose backend's
        fused kernels widen it themselves (``KernelBackend.mixed_gradients``) stays uncast; the
        caller casts it if the fused pass does not happen.

        Returns the gradients, whether this step updates the variables (False: an
        accumulation-only step) and whether a gradient was left narrow.
        """
        out = list(grads)
        scale = self._loss_scale_factor
        if not cast and scale is None and not self._gradient_accumulation_steps and not (
            self._clipnorm or self._global_clipnorm or self._clipvalue
        ):
            return out, True, False  # nothing to do (the per-step common case)
        if scale is not None:
            out = [g / g.dtype.type(scale) for g in out]
        update = True
        steps = self._gradient_accumulation_steps
        if steps:
            update = (self._iteration() + 1) % steps == 0
            for i, (g, var) in enumerate(zip(out, variables)):
                per_replica = self._accumulators.setdefault(var, {})
                acc = per_replica.get(replica)
                if update:
                    out[i] = (g if acc is None else g + acc) / steps
                    per_replica.pop(replica, None)
                else:
                    per_replica[replica] = (g if acc is None else g + acc).astype(var.dtype)
            if not update:
                return out, False, False
        if self._clipnorm:
            out = [_clip_by_norm(g, self._clipnorm) for g in out]
        elif self._global_clipnorm:
            out = _clip_by_global_norm(out, self._global_clipnorm)
        elif self._clipvalue:
            v = self._clipvalue
            out = [array_module(g).clip(g, -v, v) for g in out]
        left = False
        for i, (g, var) in enumerate(zip(out, variables)):
            if g.dtype != var.dtype:
                if narrow and _narrow_ok(g, var):
                    left = True
                else:
                    out[i] = g.astype(var.dtype)
        return out, update, left

    def _after_update(self) -> None:
        """The end of every step (cross-replica context): the moving averages, then ``iterations += 1``."""
        if self._use_ema and self._ema:
            iteration = self._update_step(self._iteration()) - 1  # Keras's (accumulated) iterations
            momentum = self._ema_momentum if iteration != 0 else 0.0
            for var, average in self._ema.items():
                value = var.storage.primary
                dt = value.dtype.type
                new = dt(momentum) * average.storage.primary + dt(1.0 - momentum) * value
                average.assign(new, read_value=False)
            freq = self._ema_overwrite_frequency
            if freq and (iteration + 1) % freq == 0:
                self.finalize_variable_values(list(self._ema))
        self._count_step()
        self._sync_updates()

    def _iteration(self) -> int:
        """``int(self._iterations)``, read from its primary copy: every copy of the counter holds the
        same count (ONLY_FIRST_REPLICA), and this skips the replica-context lookup of a read."""
        return int(self._iterations.storage.primary)

    def _count_step(self) -> None:
        """``iterations += 1``. The counter's host copies are incremented in place: a 0-d int64 add,
        where ``assign_add`` goes through the update checks and a kernel call (~8 us a step, most of
        a small update's cost). The copies come from ``storage.buffers()``, which moves a storage whose
        snapshot someone holds (``iterations.read_value()``) to fresh memory first, as every write does."""
        it = self._iterations
        if type(it) is MirroredVariable or type(it) is Variable:
            bufs = it.storage.buffers()
            if all(type(b) is np.ndarray for b in bufs):
                for b in bufs:
                    b += 1
                return
        it.assign_add(self._one, read_value=False)

    def _sync_updates(self) -> None:
        if self._updates is not None and self._gradient_accumulation_steps:
            self._updates.assign(self._iteration() // self._gradient_accumulation_steps, read_value=False)

    def _aggregate(
        self, strategy: Strategy, per_var: Sequence[Sequence[Any]], variables: Sequence[Variable], aggregate: bool
    ) -> Sequence[Any]:
        """Per variable its gradient from each of this worker's replicas (inside merge_call) -> one
        array per variable, summed over every replica in one batch."""
        if strategy.num_replicas_in_sync == 1 or not aggregate:
            return [comps[0] for comps in per_var]
        return strategy.extended.batch_reduce_to(
            ReduceOp.SUM, [(PerReplica(comps), _primary_device(v)) for comps, v in zip(per_var, variables)]
        )

    def _step(self) -> tuple[float, tuple[float, ...]]:
        """This step's learning rate and scalars (:meth:`_step_params`), computed once for all variables."""
        iteration = self._iteration()
        lr = self._current_learning_rate(iteration)
        return lr, self._step_params(lr, self._update_step(iteration))

    def _rules(self, variables: Sequence[Variable], lr: float, params: tuple[float, ...]) -> Sequence[Rule]:
        """Per variable this step's update rule (one per distinct weight decay)."""
        if not self._weight_decay:  # the common case: one rule for every variable
            return [self._rule(params, 0.0)] * len(variables)
        made: dict[float, Rule] = {}
        out: list[Rule] = []
        for var in variables:
            decay = self._decay(var, lr)
            rule = made.get(decay)
            if rule is None:
                rule = made[decay] = self._rule(params, decay)
            out.append(rule)
        return out

    def _apply_fused(self, strategy: Strategy, per_var: Sequence[Sequence[Any]], variables: Sequence[Variable]) -> bool:
        """Sums each variable's per-replica gradients and updates it in ONE kernel pass, if it can.

        ``per_var``: per variable, its gradient from each of this worker's replicas. Possible when
        every gradient and every copy is in one memory (the host's, or one GPU's) and the strategy's
        cross-device ops reduce with the kernels' own replica-order sum (see
        :meth:`UpdatePass.fusable`). Returns False (nothing done) otherwise, for the general path.
        """
        update, ensure_slots = self._update, self._ensure_slots
        plans = [update.plan(v, ensure_slots(v)) for v in variables]  # (the general path reuses them)
        backend = update.fusable(strategy, per_var, plans)
        if backend is None:
            return False
        lr, params = self._step()
        update.apply_fused(backend, per_var, plans, self._rules(variables, lr, params))
        self._after_update()
        return True

    def _apply_unscaled_fused(
        self, strategy: Strategy, per_var: Sequence[Sequence[Any]], variables: Sequence[Variable], scale: float
    ) -> bool | None:
        """LossScaleOptimizer's step with the finiteness check fused into the all-reduce: each
        variable's per-replica gradients summed and divided by ``scale`` in one kernel pass that
        also reports whether the result is finite; then the update from those sums, or nothing.

        Possible where :meth:`_apply_fused` is (host arrays, or GPU arrays each GPU holding copies
        can read; the kernels' replica-order sum) and this optimizer changes no per-replica
        gradient before the sum (no ``loss_scale_factor``, accumulation or clipping, which Keras
        applies per replica). On GPUs the flags stay on the GPUs until every variable's sum is
        launched: one read-back per step. Returns None (nothing done)
        otherwise, True when the variables were updated, False when a sum was not finite (the
        step is skipped: no variable, slot or ``iterations`` changes).
        """
        if self._loss_scale_factor is not None or self._gradient_accumulation_steps or (
            self._clipnorm or self._global_clipnorm or self._clipvalue
        ):
            return None
        for comps, var in zip(per_var, variables):
            shape = var.shape
            for c in comps:
                if (type(c) is not np.ndarray and not is_device_array(c)) or c.shape != shape:
                    return None
        update, ensure_slots = self._update, self._ensure_slots
        plans = [update.plan(v, ensure_slots(v)) for v in variables]
        backend = update.fusable(strategy, per_var, plans)
        if backend is None:
            return None
        sums = update.reduce_unscaled(backend, per_var, plans, scale)
        if sums is None:
            return False
        self._apply(sums, variables, fresh=True)
        return True

    def _apply_pipelined(
        self, strategy: Strategy, per_var: Sequence[Sequence[Any]], variables: Sequence[Variable]
    ) -> bool:
        """The reduction and update of :meth:`_apply`, pipelined pack by pack where the strategy does it
        (``MultiWorkerMirroredStrategy`` with ``CUDIST_PIPELINE_UPDATE=on`` and several packs): each
        pack's variables are updated as soon as their sums arrive, while the next packs cross the
        workers. Every variable's update is the one :meth:`_apply` makes (same sums, same rule, same
        kernel), and reads the gradients as they were before the step (a gradient that shares memory
        with a variable or slot is copied first). Returns False, nothing done, where the strategy
        does not pipeline.
        """
        update, ensure_slots = self._update, self._ensure_slots
        made: list[tuple[list[Plan], Sequence[Rule]]] = []

        def settle() -> list[list[Any]]:
            # Once the pipeline is decided, before any sum or update: every plan (and slot), the
            # step's rules, and the gradients settled against everything the step writes.
            plans = [update.plan(v, ensure_slots(v)) for v in variables]
            lr, params = self._step()
            made.append((plans, self._rules(variables, lr, params)))
            written = tuple(a for plan in plans for copies, slots, _, _ in plan[1] for a in copies + sum(slots, ()))
            settled = settle_inputs([(comps, written) for comps in per_var])
            return [list(row) for row in zip(*settled)]  # per replica, its gradient of each variable

        def consume(ids: list[int], sums: list[Any]) -> None:
            plans, rules = made[0]
            update.apply([plans[i] for i in ids], sums, [rules[i] for i in ids], fresh=True)

        rows = [list(row) for row in zip(*per_var)]
        if not strategy.extended._pipelined_sums(rows, consume, settle):  # private-read: the strategy's pipelined-reduction hook (TF's *Extended pattern)
            return False
        self._after_update()
        return True

    def _apply(self, grads: Sequence[Any], variables: Sequence[Variable], fresh: bool = False) -> None:
        """Updates every variable once from its final gradient (cross-replica context).

        ``fresh``: the gradients are new buffers (results of the reduction) that alias nothing.
        """
        update, ensure_slots = self._update, self._ensure_slots
        plans = [update.plan(v, ensure_slots(v)) for v in variables]  # slots are all created before any variable changes
        lr, params = self._step()
        update.apply(plans, grads, self._rules(variables, lr, params), fresh=fresh)
        self._after_update()

    def _step_params(self, lr: float, step: int) -> tuple[float, ...]:
        """The scalars of one step (``step`` is 1-based), computed once for all variables."""
        return (lr,)

    def _rule(self, params: tuple[float, ...], decay: float) -> Rule:  # pragma: no cover - abstract
        """This step's update rule: a row of the kernels' table of update rules with its scalars
        (the weight decay ``w -= w * decay`` applies first when ``decay`` is not 0)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints, copies
    def _checkpoint_state(self) -> dict[str, Any]:
        """What ``cudist.train.Checkpoint`` saves: ``{"hyperparameters": {...}, "iterations": variable,
        "slots": [(variable, slot name, slot variable), ...]}``.

        The hyperparameters are the public numeric/bool/str attributes and the learning rate (None
        when it is a callable).
        """
        lr = self._learning_rate
        if self._learning_rate_variable is not None:
            lr = self._variable_learning_rate()  # what the next step uses (the variable may have been assigned)
        hyper: dict[str, bool | int | float | str | None] = {"learning_rate": None if callable(lr) else lr}
        for k, v in vars(self).items():
            if not k.startswith("_") and isinstance(v, (bool, int, float, str)):
                hyper[k] = v
        slots = [(var, name, slot) for var, named in self._slots.items() for name, slot in named.items()]
        slots += [(var, "average", average) for var, average in self._ema.items()]
        return {"hyperparameters": hyper, "iterations": self._iterations, "slots": slots}

    def _restore_state(self, hyperparameters: dict[str, Any], var_list: Iterable[Variable] = ()) -> None:
        """Creates the slots of ``var_list`` (the checkpoint then restores their values) and restores a
        numeric learning rate, as Keras 3 restores its learning-rate variable. Other hyperparameters
        are constructor arguments and stay as constructed."""
        self.build(var_list)
        self._sync_updates()  # iterations was restored
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
            if k == "_update":
                new._update = UpdatePass(v.name)  # kernel work validated for the original's buffers
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
    Nesterov, ``w += momentum * v - learning_rate * g``. A weight decay ``w -= w * weight_decay *
    learning_rate`` comes first, in the same pass (in the compute type, as every optimizer's).

    Args:
        learning_rate: see :class:`Optimizer`.
        momentum: in [0, 1]; 0 means plain SGD (no slot).
        nesterov: use Nesterov momentum.
        weight_decay: see :class:`Optimizer`.
        clipnorm: see :class:`Optimizer`.
        clipvalue: see :class:`Optimizer`.
        global_clipnorm: see :class:`Optimizer`.
        use_ema: see :class:`Optimizer`.
        ema_momentum: see :class:`Optimizer`.
        ema_overwrite_frequency: see :class:`Optimizer`.
        loss_scale_factor: see :class:`Optimizer`.
        gradient_accumulation_steps: see :class:`Optimizer`.
        name: the optimizer's name (default: Keras 3's, the class's name in snake case made unique
            in the process: "adam", "adam_1", ...).
    """

    def __init__(
        self,
        learning_rate: LearningRate = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.momentum = _check_real("momentum", momentum, low=0.0, high=1.0)
        self.nesterov = bool(nesterov)
        self._slot_names = ("momentum",) if self.momentum != 0 else ()
        super().__init__(
            learning_rate,
            name,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            }
        )
        return config

    def _rule(self, params: tuple[float, ...], decay: float) -> Rule:
        if self._slot_names:
            # Nesterov's momentum is a row of the rules' table of its own (the same slot and scalars).
            return Rule("nesterov" if self.nesterov else "momentum", (params[0], self.momentum), decay)
        return Rule("sgd", (params[0],), decay)


class Adam(Optimizer):
    """Adam (``keras.optimizers.Adam``), with slots ``"momentum"`` (m) and ``"velocity"`` (v).

    At step ``t`` (1-based): ``lr_t = learning_rate * sqrt(1 - beta_2**t) / (1 - beta_1**t)``;
    ``m += (g - m) * (1 - beta_1)``; ``v += (g*g - v) * (1 - beta_2)``;
    ``w -= lr_t * m / (sqrt(v) + epsilon)``. With a weight decay, the AdamW kernel (the decay in
    the same pass). With ``amsgrad``, a third slot ``"velocity_hat"`` keeps the running maximum of
    ``v`` (``v_hat = maximum(v_hat, v)``), which replaces ``v`` in the denominator (Keras 3).

    Args:
        learning_rate: see :class:`Optimizer`.
        beta_1: decay rates of the moment estimates, in [0, 1).
        beta_2: decay rates of the moment estimates, in [0, 1).
        epsilon: the small constant added to ``sqrt(v)``, >= 0.
        amsgrad: Keras's AMSGrad variant (the slot ``"velocity_hat"``).
        weight_decay: see :class:`Optimizer`.
        clipnorm: see :class:`Optimizer`.
        clipvalue: see :class:`Optimizer`.
        global_clipnorm: see :class:`Optimizer`.
        use_ema: see :class:`Optimizer`.
        ema_momentum: see :class:`Optimizer`.
        ema_overwrite_frequency: see :class:`Optimizer`.
        loss_scale_factor: see :class:`Optimizer`.
        gradient_accumulation_steps: see :class:`Optimizer`.
        name: the optimizer's name (default: Keras 3's, the class's name in snake case made unique
            in the process: "adam", "adam_1", ...).
    """

    _slot_names: tuple[str, ...] = ("momentum", "velocity")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.beta_1 = _check_real("beta_1", beta_1, low=0.0, high=1.0, high_open=True)
        self.beta_2 = _check_real("beta_2", beta_2, low=0.0, high=1.0, high_open=True)
        self.epsilon = _check_real("epsilon", epsilon, low=0.0)
        # Kept private (read through the property) so that checkpoints record the same
        # hyperparameters as before AMSGrad existed; the slot "velocity_hat" records it.
        self._amsgrad = bool(amsgrad)
        if self._amsgrad:
            self._slot_names = ("momentum", "velocity", "velocity_hat")
            self._grouped_slot_names = ("velocity_hat",)  # Keras 3 makes them after every variable's m and v
        super().__init__(
            learning_rate,
            name,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )

    @property
    def amsgrad(self) -> bool:
        """Whether this is Keras's AMSGrad variant (the slot ``"velocity_hat"``)."""
        return self._amsgrad

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
            "amsgrad": self._amsgrad,
            }
        )
        return config

    def _step_params(self, lr: float, step: int) -> tuple[float, ...]:
        return (bias_corrected_lr(lr, self.beta_1, self.beta_2, step),)

    def _rule(self, params: tuple[float, ...], decay: float) -> Rule:
        scalars = (params[0], self.beta_1, self.beta_2, self.epsilon)
        if self._amsgrad:
            return Rule("amsgrad", scalars, decay)
        return Rule("adamw", scalars, decay)  # one rule: the weight decay 0, or not


class AdamW(Adam):
    """AdamW (``keras.optimizers.AdamW``): Adam with decoupled weight decay, in one fused pass:
    ``w -= w * weight_decay * learning_rate``, then the Adam update (see :class:`Adam`).

    Args:
        learning_rate: see :class:`Optimizer`.
        weight_decay: the decay rate (Keras's default 0.004); None is refused, as Keras.
        beta_1: see :class:`Adam`.
        beta_2: see :class:`Adam`.
        epsilon: see :class:`Adam`.
        amsgrad: see :class:`Adam`.
        clipnorm: see :class:`Optimizer`.
        clipvalue: see :class:`Optimizer`.
        global_clipnorm: see :class:`Optimizer`.
        use_ema: see :class:`Optimizer`.
        ema_momentum: see :class:`Optimizer`.
        ema_overwrite_frequency: see :class:`Optimizer`.
        loss_scale_factor: see :class:`Optimizer`.
        gradient_accumulation_steps: see :class:`Optimizer`.
        name: the optimizer's name (default: Keras 3's, the class's name in snake case made unique
            in the process: "adam", "adam_1", ...).
    """

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        weight_decay: float | None = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if weight_decay is None:
            raise ValueError("Argument `weight_decay` must be a float. Received: weight_decay=None")
        super().__init__(
            learning_rate,
            beta_1,
            beta_2,
            epsilon,
            amsgrad,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            **kwargs,
        )


class RMSprop(Optimizer):
    """RMSprop (``keras.optimizers.RMSprop``), plain, with momentum, centered, one fused kernel pass.

    Slots ``"velocity"`` (v), ``"momentum"`` (when momentum > 0), ``"average_gradient"`` (centered):
    ``v = rho * v + (1 - rho) * g*g``; centered: ``a = rho * a + (1 - rho) * g`` and
    ``d = v - a*a + epsilon``, else ``d = v + epsilon``; ``inc = learning_rate * g / sqrt(d)``;
    with momentum ``mo = momentum * mo + inc; w -= mo``, else ``w -= inc``.

    Args:
        learning_rate: see :class:`Optimizer`.
        rho: the discounting factor of the squared gradients.
        momentum: >= 0; 0 means no momentum slot.
        epsilon: added to the denominator before the square root, >= 0.
        centered: normalize by the variance estimate ``v - a*a`` (an extra slot).
        weight_decay: see :class:`Optimizer`.
        clipnorm: see :class:`Optimizer`.
        clipvalue: see :class:`Optimizer`.
        global_clipnorm: see :class:`Optimizer`.
        use_ema: see :class:`Optimizer`.
        ema_momentum: see :class:`Optimizer`.
        ema_overwrite_frequency: see :class:`Optimizer`.
        loss_scale_factor: see :class:`Optimizer`.
        gradient_accumulation_steps: see :class:`Optimizer`.
        name: the optimizer's name (default: Keras 3's, the class's name in snake case made unique
            in the process: "adam", "adam_1", ...).
    """

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.rho = _check_real("rho", rho, low=0.0, high=1.0)
        self.momentum = _check_real("momentum", momentum, low=0.0)
        self.epsilon = _check_real("epsilon", epsilon, low=0.0)
        self.centered = bool(centered)
        self._slot_names = (
            ("velocity",) + (("momentum",) if self.momentum > 0 else ()) + (("average_gradient",) if self.centered else ())
        )
        self._grouped_slot_names = self._slot_names  # Keras 3 lists RMSprop's slots by kind
        # The rule's slots (velocity, momentum, average_gradient) by index into _slot_names; None: absent.
        self._rule_slots = (0, 1 if self.momentum > 0 else None, len(self._slot_names) - 1 if self.centered else None)
        super().__init__(
            learning_rate,
            name,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
            "rho": self.rho,
            "momentum": self.momentum,
            "epsilon": self.epsilon,
            "centered": self.centered,
            }
        )
        return config

    def _rule(self, params: tuple[float, ...], decay: float) -> Rule:
        return Rule("rmsprop", (params[0], self.rho, self.momentum, self.epsilon), decay, self._rule_slots)


class Adagrad(Optimizer):
    """Adagrad (``keras.optimizers.Adagrad``), one slot ``"accumulator"`` starting at
    ``initial_accumulator_value``: ``acc += g*g``; ``w -= learning_rate * g / sqrt(acc + epsilon)``.

    Args:
        learning_rate: see :class:`Optimizer`.
        initial_accumulator_value: the accumulators' starting value, >= 0.
        epsilon: added to the accumulator before the square root, >= 0.
        weight_decay: see :class:`Optimizer`.
        clipnorm: see :class:`Optimizer`.
        clipvalue: see :class:`Optimizer`.
        global_clipnorm: see :class:`Optimizer`.
        use_ema: see :class:`Optimizer`.
        ema_momentum: see :class:`Optimizer`.
        ema_overwrite_frequency: see :class:`Optimizer`.
        loss_scale_factor: see :class:`Optimizer`.
        gradient_accumulation_steps: see :class:`Optimizer`.
        name: the optimizer's name (default: Keras 3's, the class's name in snake case made unique
            in the process: "adam", "adam_1", ...).
    """

    _slot_names = ("accumulator",)

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.initial_accumulator_value = _check_real("initial_accumulator_value", initial_accumulator_value, low=0.0)
        self.epsilon = _check_real("epsilon", epsilon, low=0.0)
        super().__init__(
            learning_rate,
            name,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
            "initial_accumulator_value": self.initial_accumulator_value,
            "epsilon": self.epsilon,
            }
        )
        return config

    def _slot_initial_value(self, slot_name: str) -> float:
        return self.initial_accumulator_value

    def _rule(self, params: tuple[float, ...], decay: float) -> Rule:
        return Rule("adagrad", (params[0], self.epsilon), decay)


class Adamax(Optimizer):
    """Adamax (``keras.optimizers.Adamax``), slots ``"momentum"`` (m) and ``"norm"`` (u):
    ``m += (g - m) * (1 - beta_1)``; ``u = maximum(beta_2 * u, |g|)``;
    ``w -= learning_rate * m / ((1 - beta_1**t) * (u + epsilon))`` at step t (1-based).

    Args:
        learning_rate: see :class:`Optimizer`.
        beta_1: decay rates of the first moment and of the infinity norm, in [0, 1).
        beta_2: decay rates of the first moment and of the infinity norm, in [0, 1).
        epsilon: added to the norm, >= 0.
        weight_decay: see :class:`Optimizer`.
        clipnorm: see :class:`Optimizer`.
        clipvalue: see :class:`Optimizer`.
        global_clipnorm: see :class:`Optimizer`.
        use_ema: see :class:`Optimizer`.
        ema_momentum: see :class:`Optimizer`.
        ema_overwrite_frequency: see :class:`Optimizer`.
        loss_scale_factor: see :class:`Optimizer`.
        gradient_accumulation_steps: see :class:`Optimizer`.
        name: the optimizer's name (default: Keras 3's, the class's name in snake case made unique
            in the process: "adam", "adam_1", ...).
    """

    _slot_names = ("momentum", "norm")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.beta_1 = _check_real("beta_1", beta_1, low=0.0, high=1.0, high_open=True)
        self.beta_2 = _check_real("beta_2", beta_2, low=0.0, high=1.0)
        self.epsilon = _check_real("epsilon", epsilon, low=0.0)
        super().__init__(
            learning_rate,
            name,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
            }
        )
        return config

    def _step_params(self, lr: float, step: int) -> tuple[float, ...]:
        # beta_2 = 0: only m is bias-corrected, lr / (1 - beta_1**step) exactly.
        return (bias_corrected_lr(lr, self.beta_1, 0.0, step),)

    def _rule(self, params: tuple[float, ...], decay: float) -> Rule:
        return Rule("adamax", (params[0], self.beta_1, self.beta_2, self.epsilon), decay)


class Nadam(Optimizer):
    """Nadam (``keras.optimizers.Nadam``, Keras 3's momentum schedule), slots ``"momentum"`` (m) and
    ``"velocity"`` (v). At step t: ``u_t = beta_1 * (1 - 0.5 * 0.96**t)``, their running product
    ``u_prod``; ``m += (g - m) * (1 - beta_1)``; ``v += (g*g - v) * (1 - beta_2)``;
    ``m_hat = u_(t+1) * m / (1 - u_prod * u_(t+1)) + (1 - u_t) * g / (1 - u_prod)``;
    ``w -= m_hat * learning_rate / (sqrt(v / (1 - beta_2**t)) + epsilon)``.

    Keras keeps ``u_prod`` in a variable; it is a function of the iteration count, so cudist
    computes it from ``iterations`` (exactly as after a checkpoint restore) and has no such variable.

    Args:
        learning_rate: see :class:`Optimizer`.
        beta_1: decay rates of the moment estimates, in [0, 1).
        beta_2: decay rates of the moment estimates, in [0, 1).
        epsilon: added to ``sqrt(v_hat)``, >= 0.
        weight_decay: see :class:`Optimizer`.
        clipnorm: see :class:`Optimizer`.
        clipvalue: see :class:`Optimizer`.
        global_clipnorm: see :class:`Optimizer`.
        use_ema: see :class:`Optimizer`.
        ema_momentum: see :class:`Optimizer`.
        ema_overwrite_frequency: see :class:`Optimizer`.
        loss_scale_factor: see :class:`Optimizer`.
        gradient_accumulation_steps: see :class:`Optimizer`.
        name: the optimizer's name (default: Keras 3's, the class's name in snake case made unique
            in the process: "adam", "adam_1", ...).
    """

    _slot_names = ("momentum", "velocity")

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.beta_1 = _check_real("beta_1", beta_1, low=0.0, high=1.0, high_open=True)
        self.beta_2 = _check_real("beta_2", beta_2, low=0.0, high=1.0, high_open=True)
        self.epsilon = _check_real("epsilon", epsilon, low=0.0)
        self._u_cache = (0, 1.0)  # (steps taken, the product of their u_t)
        self._u_product_variable: Variable | None = None
        super().__init__(
            learning_rate,
            name,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
            }
        )
        return config

    def _build_extra(self, var: Variable) -> None:
        """Keras 3's ``u_product`` variable, in the first variable's dtype (made with the first slots)."""
        if self._u_product_variable is None:
            self._u_product_variable = Variable(
                var.dtype.type(1.0),
                dtype=var.dtype,
                name=f"{self.name}/u_product",
                trainable=False,
                aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
            )

    def _extra_variables(self) -> list[Variable]:
        """``u_product`` after the slots, as Keras 3; its value is set from ``iterations`` here (the
        updates compute the product from the step count and never read it)."""
        u = self._u_product_variable
        if u is None:
            return []
        done = self._update_step(int(self._iterations)) - 1
        value = u.dtype.type(self._u_product(done))
        if u.numpy() != value:
            u.assign(value)
        return [u]

    def _u_product(self, steps: int) -> float:
        """``u_1 * ... * u_steps`` (1.0 for none), advanced from the last one asked for."""
        done, u = self._u_cache
        if steps < done:
            done, u = 0, 1.0
        while done < steps:
            done += 1
            u = momentum_schedule_step(self.beta_1, self.beta_2, done, u)[0]
        self._u_cache = (done, u)
        return u

    def _step_params(self, lr: float, step: int) -> tuple[float, ...]:
        _, c_m, c_g, c_v = momentum_schedule_step(self.beta_1, self.beta_2, step, self._u_product(step - 1))
        return (lr, c_m, c_g, c_v)

    def _rule(self, params: tuple[float, ...], decay: float) -> Rule:
        return Rule("nadam", (params[0], self.beta_1, self.beta_2, self.epsilon, *params[1:]), decay)


class Lion(Optimizer):
    """Lion (``keras.optimizers.Lion``), one slot ``"momentum"`` (m):
    ``w -= learning_rate * sign(m * beta_1 + g * (1 - beta_1))``; ``m = m * beta_2 + g * (1 - beta_2)``.

    Args:
        learning_rate: see :class:`Optimizer`.
        beta_1: the interpolation factor of the update direction, in (0, 1].
        beta_2: the decay rate of the momentum, in [0, 1].
        weight_decay: see :class:`Optimizer`.
        clipnorm: see :class:`Optimizer`.
        clipvalue: see :class:`Optimizer`.
        global_clipnorm: see :class:`Optimizer`.
        use_ema: see :class:`Optimizer`.
        ema_momentum: see :class:`Optimizer`.
        ema_overwrite_frequency: see :class:`Optimizer`.
        loss_scale_factor: see :class:`Optimizer`.
        gradient_accumulation_steps: see :class:`Optimizer`.
        name: the optimizer's name (default: Keras 3's, the class's name in snake case made unique
            in the process: "adam", "adam_1", ...).
    """

    _slot_names = ("momentum",)

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.beta_1 = _check_real("beta_1", beta_1, high=1.0)
        if self.beta_1 <= 0:
            raise ValueError(f"Argument for `beta_1` must be in range (0, 1]. Received: beta_1={beta_1}.")
        self.beta_2 = _check_real("beta_2", beta_2, low=0.0, high=1.0)
        super().__init__(
            learning_rate,
            name,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            {
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            }
        )
        return config

    def _rule(self, params: tuple[float, ...], decay: float) -> Rule:
        return Rule("lion", (params[0], self.beta_1, self.beta_2), decay)


def _as_float32(g: Any) -> Any:
    """A gradient as float32 where it lives (a GPU gradient on its GPU; anything else on the host)."""
    if is_device_array(g):
        return _cast(g, np.float32)
    return np.asarray(g, dtype=np.float32)


def _all_finite(g: Any) -> bool:
    """Whether every element of gradient ``g`` is finite (checked in float32, on its GPU for a GPU array)."""
    if is_device_array(g):
        with device_context(g):
            return bool(to_host(array_module(g).isfinite(_as_float32(g)).all()))
    return bool(np.isfinite(np.asarray(g, dtype=np.float32)).all())


class LossScaleOptimizer:
    """Keras 3's dynamic loss scaling around an optimizer (``keras.optimizers.LossScaleOptimizer``).

    Multiply the loss by :meth:`scale_loss` before differentiating, and pass the resulting (scaled)
    gradients to :meth:`apply_gradients`: when every gradient is finite they are divided by the
    scale and applied by ``inner_optimizer``, and after ``dynamic_growth_steps`` such steps in a row
    the scale doubles; a step with an inf or NaN gradient is skipped (the inner optimizer's
    ``iterations`` does not move) and halves the scale. Under a strategy every replica decides on
    the all-reduced finiteness, so all replicas skip the same steps.

    Under a MirroredStrategy (host gradients on the CPU backends, or GPU gradients that every GPU
    holding copies of the variable reads in place: peer access; the default cross-device ops) the
    check is fused into the all-reduce: one kernel pass sums each variable's per-replica gradients,
    divides the sum by the scale and flags a non-finite result, and the inner optimizer then
    updates from those sums or the step is skipped -- no pass over the gradients of its own (on
    GPUs the flag stays on the GPU: one read-back per step, whatever the number of variables). The
    decision is then taken on the reduced gradients, so a step whose finite gradients overflow to
    inf in the sum is skipped too (Keras, which checks each replica's gradients, would apply the
    inf). The sum is divided once instead of each replica's gradient (Keras): the same bits for a
    power-of-two scale (the only scales the fused step takes; others take the per-replica path)
    unless an unscaled value is a float32 subnormal. Elsewhere (one replica, multi-worker, GPUs
    without peer access, an inner optimizer that clips, accumulates or has ``loss_scale_factor``), each replica checks
    its gradients and the replicas (and workers) agree through an all-reduce of the verdict.

    Args:
        inner_optimizer: the optimizer that applies the unscaled gradients.
        initial_scale: the first loss scale (Keras: ``2**15``).
        dynamic_growth_steps: finite steps in a row after which the scale doubles.
        name: the optimizer's name.
    """

    def __init__(
        self,
        inner_optimizer: Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        name: str = "loss_scale_optimizer",
    ) -> None:
        if not isinstance(inner_optimizer, Optimizer):
            raise TypeError(f"LossScaleOptimizer: inner_optimizer must be a cudist optimizer, got {type(inner_optimizer).__name__}")
        scale = _check_real("initial_scale", initial_scale)
        if scale <= 0:
            raise ValueError(f"`initial_scale` must be > 0, got {scale}")
        if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, numbers.Integral) or dynamic_growth_steps < 1:
            raise ValueError(f"`dynamic_growth_steps` must be a positive integer, got {dynamic_growth_steps!r}")
        self.name: str = name
        self.inner_optimizer: Optimizer = inner_optimizer
        self.dynamic_growth_steps: int = int(dynamic_growth_steps)
        # ONLY_FIRST_REPLICA, as the iteration counter: every replica computes the same new value.
        self.dynamic_scale: Variable = Variable(
            np.float32(scale), name=f"{name}/dynamic_scale", trainable=False,
            aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self.step_counter: Variable = Variable(
            0, dtype=np.int64, name=f"{name}/step_counter", trainable=False,
            aggregation=VariableAggregation.ONLY_FIRST_REPLICA,
        )

    @property
    def iterations(self) -> Variable:
        """The inner optimizer's iteration count (skipped steps do not count)."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> Variable | float | np.float32:
        """The inner optimizer's learning rate (its variable for a number), as Keras 3; setting it sets the inner one's."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: LearningRate) -> None:
        self.inner_optimizer.learning_rate = value

    @property
    def variables(self) -> list[Variable]:
        """The inner optimizer's variables, then the scale and the step counter."""
        return [*self.inner_optimizer.variables, self.dynamic_scale, self.step_counter]

    def scale_loss(self, loss: Any) -> Any:
        """``loss`` multiplied by the current scale (Keras's ``scale_loss``)."""
        scale = to_host(self.dynamic_scale.read_value())
        if is_device_array(loss):  # a GPU loss stays on its GPU, in its dtype
            with device_context(loss):
                return loss * array_module(loss).asarray(scale, dtype=loss.dtype)
        return np.multiply(loss, scale.astype(np.asarray(loss).dtype))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Variable]]) -> Variable:
        """Applies the unscaled gradients when all are finite (on every replica), else skips the step.

        Returns:
            The inner optimizer's ``iterations`` variable.
        """
        pairs = list(grads_and_vars)
        ctx = _distribute_lib.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            if pairs and math.frexp(float(to_host(self.dynamic_scale.read_value())))[0] == 0.5 and all(
                g is not None for g, _ in pairs  # (frexp's mantissa 0.5: a power of two)
            ):
                # One merge_call decides for every replica (each gets its result): fused, or None.
                done = ctx.merge_call(self._fused_step, args=(_ReplicaGrads([g for g, _ in pairs]),),
                                      kwargs={"variables": [v for _, v in pairs]})
                if done is not None:
                    return self.inner_optimizer.iterations
        return self._apply_checked(pairs, ctx)

    def _apply_checked(self, pairs: list[tuple[Any, Variable]], ctx: Any) -> Variable:
        """apply_gradients where the check is not fused: each replica checks its own gradients, the
        replicas all-reduce the verdict, each unscales its gradients for the inner optimizer."""
        finite = all(g is None or _all_finite(g) for g, _ in pairs)
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            bad = ctx.all_reduce(ReduceOp.SUM, np.float32(0.0 if finite else 1.0))
            finite = float(to_host(bad)) == 0.0
        scale = np.float32(to_host(self.dynamic_scale.read_value()))
        if not finite:
            self.dynamic_scale.assign(scale / np.float32(2.0))
            self.step_counter.assign(0)
            return self.inner_optimizer.iterations
        unscaled = [(None if g is None else _as_float32(g) / scale, v) for g, v in pairs]
        self.inner_optimizer.apply_gradients(unscaled)
        self._grow(scale)
        return self.inner_optimizer.iterations

    def _grow(self, scale: np.floating[Any]) -> None:
        """After a finite step: one more in a row, the scale doubled every ``dynamic_growth_steps``."""
        count = int(to_host(self.step_counter.read_value())) + 1
        if count >= self.dynamic_growth_steps:
            self.dynamic_scale.assign(scale * np.float32(2.0))
            count = 0
        self.step_counter.assign(count)

    def _fused_step(
        self, strategy: Strategy, held: _ReplicaGrads | PerReplica, *, variables: list[Variable]
    ) -> bool | None:
        """The merge_call of a fused step (cross-replica context): the inner optimizer's
        reduce-with-finiteness, then update or skip (and the scale's bookkeeping). None: not fusable
        here, nothing done; every replica then takes the per-replica path."""
        each = held.values if isinstance(held, PerReplica) else (held,)
        if any(len(h.grads) != len(variables) for h in each):
            return None  # (the per-replica path raises the error about it)
        per_var = list(zip(*(h.grads for h in each)))
        scale = float(to_host(self.dynamic_scale.read_value()))
        done = self.inner_optimizer._apply_unscaled_fused(strategy, per_var, variables, scale)
        if done is None:
            return None
        if done:
            self._grow(np.float32(scale))
        else:
            self.dynamic_scale.assign(np.float32(scale) / np.float32(2.0))
            self.step_counter.assign(0)
        return done
