"""Learning-rate schedules: ``cudist.optimizers.schedules`` (Keras 3's ``keras.optimizers.schedules``).

A schedule is called with the optimizer's iteration count (0 on the first step) and returns the
learning rate of that step as a Python float. The formulas are Keras 3's, evaluated in float64
(Keras evaluates them in the dtype of ``initial_learning_rate``, float32 for a Python float, so
the two agree to float32 precision). ``get_config`` / ``from_config`` and :func:`serialize` /
:func:`deserialize` use Keras's layout (``{"module", "class_name", "config", "registered_name"}``),
so a config written by one reads in the other.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

__all__ = [
    "LearningRateSchedule",
    "ExponentialDecay",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "InverseTimeDecay",
    "CosineDecay",
    "CosineDecayRestarts",
    "serialize",
    "deserialize",
]

#: The module name Keras writes into a serialized schedule.
_KERAS_MODULE = "keras.optimizers.schedules"


def _step(step: Any) -> float:
    """The iteration count as a float (a Python int, a NumPy scalar or 0-d array, a cudist Variable)."""
    try:
        return float(step)
    except (TypeError, ValueError):
        raise TypeError(f"a learning-rate schedule is called with the iteration count (a number), got {step!r}") from None


def _positive_steps(name: str, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"Argument `{name}` must be > 0. Received: {name}={value}")


class LearningRateSchedule:
    """Base class of the schedules: subclasses implement ``__call__(step)`` and ``get_config()``.

    A user's subclass works wherever cudist's do (an optimizer calls it with its iteration count and
    uses the float it returns).
    """

    #: Registry of the schedule classes by name, for :func:`deserialize`.
    _registry: ClassVar[dict[str, type[LearningRateSchedule]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        LearningRateSchedule._registry.setdefault(cls.__name__, cls)

    def __call__(self, step: Any) -> float:
        raise NotImplementedError(f"Learning rate schedule '{type(self).__name__}' must override `__call__(self, step)`.")

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(
            f"Learning rate schedule '{type(self).__name__}' must override `get_config()` in order to be serializable."
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LearningRateSchedule:
        """The schedule of ``config`` (what :meth:`get_config` returned)."""
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (the exponent floored when
    ``staircase``)."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        decay_rate: float,
        staircase: bool = False,
        name: str = "ExponentialDecay",
    ) -> None:
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name
        _positive_steps("decay_steps", decay_steps)

    def __call__(self, step: Any) -> float:
        p = _step(step) / float(self.decay_steps)
        if self.staircase:
            p = math.floor(p)
        return float(self.initial_learning_rate) * float(float(self.decay_rate) ** p)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
            "name": self.name,
        }


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` while ``step <= boundaries[0]``, ``values[i]`` while
    ``boundaries[i-1] < step <= boundaries[i]``, ``values[-1]`` after the last boundary."""

    def __init__(self, boundaries: list[float], values: list[float], name: str = "PiecewiseConstant") -> None:
        if len(boundaries) != len(values) - 1:
            raise ValueError(
                "The length of boundaries should be 1 less than the length of values. Received: "
                f"boundaries={boundaries} of length {len(boundaries)}, and values={values} of length {len(values)}."
            )
        self.boundaries = boundaries
        self.values = values
        self.name = name

    def __call__(self, step: Any) -> float:
        s = _step(step)
        for b, v in zip(self.boundaries, self.values):
            if s <= b:
                return float(v)
        return float(self.values[-1])

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class PolynomialDecay(LearningRateSchedule):
    """``(initial - end) * (1 - step / decay_steps) ** power + end``, the step capped at
    ``decay_steps``; with ``cycle`` the horizon grows to the next multiple of ``decay_steps``."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        end_learning_rate: float = 0.0001,
        power: float = 1.0,
        cycle: bool = False,
        name: str = "PolynomialDecay",
    ) -> None:
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.cycle = cycle
        self.name = name
        _positive_steps("decay_steps", decay_steps)

    def __call__(self, step: Any) -> float:
        s = _step(step)
        decay_steps = float(self.decay_steps)
        if self.cycle:
            decay_steps *= 1.0 if s == 0 else math.ceil(s / float(self.decay_steps))
        else:
            s = min(s, decay_steps)
        p = s / decay_steps
        init, end = float(self.initial_learning_rate), float(self.end_learning_rate)
        return (init - end) * float((1.0 - p) ** float(self.power)) + end

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "cycle": self.cycle,
            "name": self.name,
        }


class InverseTimeDecay(LearningRateSchedule):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (the ratio floored when
    ``staircase``)."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        decay_rate: float,
        staircase: bool = False,
        name: str = "InverseTimeDecay",
    ) -> None:
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name
        _positive_steps("decay_steps", decay_steps)

    def __call__(self, step: Any) -> float:
        p = _step(step) / float(self.decay_steps)
        if self.staircase:
            p = math.floor(p)
        return float(self.initial_learning_rate) / (1.0 + float(self.decay_rate) * p)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
            "name": self.name,
        }


class CosineDecay(LearningRateSchedule):
    """Cosine decay from ``initial_learning_rate`` (or, after a linear warmup of ``warmup_steps``
    from it to ``warmup_target``, from ``warmup_target``) to ``alpha`` times it over
    ``decay_steps``: ``lr * ((1 - alpha) * 0.5 * (1 + cos(pi * step / decay_steps)) + alpha)``."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        alpha: float = 0.0,
        name: str = "CosineDecay",
        warmup_target: float | None = None,
        warmup_steps: float = 0,
    ) -> None:
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.alpha = alpha
        self.name = name
        self.warmup_steps = warmup_steps
        self.warmup_target = warmup_target
        _positive_steps("decay_steps", decay_steps)

    def _decay(self, step: float, decay_from: float) -> float:
        fraction = step / float(self.decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * fraction))
        alpha = float(self.alpha)
        return decay_from * ((1.0 - alpha) * cosine + alpha)

    def __call__(self, step: Any) -> float:
        s = _step(step)
        init = float(self.initial_learning_rate)
        if self.warmup_target is None:
            return self._decay(min(s, float(self.decay_steps)), init)
        warmup_steps, target = float(self.warmup_steps), float(self.warmup_target)
        s = min(s, float(self.decay_steps) + warmup_steps)
        if s < warmup_steps:
            return (target - init) * (s / warmup_steps) + init
        return self._decay(s - warmup_steps, target)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "name": self.name,
            "warmup_target": self.warmup_target,
            "warmup_steps": self.warmup_steps,
        }


class CosineDecayRestarts(LearningRateSchedule):
    """Cosine decay with warm restarts (SGDR): periods of ``first_decay_steps``, each ``t_mul``
    times longer than the last, restarting at ``m_mul`` times the previous peak."""

    def __init__(
        self,
        initial_learning_rate: float,
        first_decay_steps: float,
        t_mul: float = 2.0,
        m_mul: float = 1.0,
        alpha: float = 0.0,
        name: str = "SGDRDecay",
    ) -> None:
        self.initial_learning_rate = initial_learning_rate
        self.first_decay_steps = first_decay_steps
        self._t_mul = t_mul
        self._m_mul = m_mul
        self.alpha = alpha
        self.name = name
        _positive_steps("first_decay_steps", first_decay_steps)

    def __call__(self, step: Any) -> float:
        fraction = _step(step) / float(self.first_decay_steps)
        t_mul, m_mul, alpha = float(self._t_mul), float(self._m_mul), float(self.alpha)
        if t_mul == 1.0:
            i_restart = math.floor(fraction)
            fraction -= i_restart
        else:
            i_restart = math.floor(math.log(1.0 - fraction * (1.0 - t_mul)) / math.log(t_mul))
            sum_r = (1.0 - t_mul**i_restart) / (1.0 - t_mul)
            fraction = (fraction - sum_r) / t_mul**i_restart
        cosine = 0.5 * m_mul**i_restart * (1.0 + math.cos(math.pi * fraction))
        return float(self.initial_learning_rate) * ((1.0 - alpha) * cosine + alpha)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "first_decay_steps": self.first_decay_steps,
            "t_mul": self._t_mul,
            "m_mul": self._m_mul,
            "alpha": self.alpha,
            "name": self.name,
        }


def serialize(learning_rate_schedule: LearningRateSchedule) -> dict[str, Any]:
    """Keras's serialized form: ``{"module", "class_name", "config", "registered_name"}``."""
    if not isinstance(learning_rate_schedule, LearningRateSchedule):
        raise TypeError(f"serialize expects a LearningRateSchedule, got {type(learning_rate_schedule).__name__}")
    cls = type(learning_rate_schedule)
    builtin = cls in _BUILTINS
    return {
        "module": _KERAS_MODULE if builtin else cls.__module__,
        "class_name": cls.__name__,
        "config": learning_rate_schedule.get_config(),
        "registered_name": None if builtin else cls.__name__,
    }


def deserialize(config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> LearningRateSchedule:
    """The schedule a :func:`serialize` (or Keras's ``serialize``) dictionary describes.

    ``custom_objects`` maps class names to user-defined schedule classes.
    """
    if isinstance(config, LearningRateSchedule):
        return config
    if not isinstance(config, dict) or "class_name" not in config:
        raise ValueError(f"Could not interpret serialized learning-rate schedule: {config!r}")
    name = config["class_name"]
    cls = (custom_objects or {}).get(name) or LearningRateSchedule._registry.get(name)
    if cls is None:
        raise ValueError(f"Unknown decay: '{name}'. Please ensure you are using a LearningRateSchedule it knows.")
    return cls.from_config(dict(config.get("config") or {}))


_BUILTINS = (ExponentialDecay, PiecewiseConstantDecay, PolynomialDecay, InverseTimeDecay, CosineDecay, CosineDecayRestarts)
# Where users find them (the module is re-exported as cudist.optimizers.schedules).
for _cls in (LearningRateSchedule, *_BUILTINS):
    _cls.__module__ = "cudist.optimizers.schedules"
