"""The optimizers' fused update pass: planning, gradient settling, dispatch to the update kernels.

An optimizer (:mod:`cudist.optimizers`) keeps Keras's semantics -- hyperparameters, schedules,
clipping, gradient accumulation, EMA, ``iterations`` -- and hands each step's kernel work here as
one :class:`Rule` per variable: a row of the ONE table of update rules,
:data:`cudist._kernels.UPDATE_KERNELS` (name -> slot names, scalars), with the step's scalars.
This module then

* plans each variable's work once (:meth:`UpdatePass.plan`): per memory (the host, or one GPU each)
  the variable's copies and its slots' copies, validated through the backend's own checks and
  reused while the storage arrays stay the same;
* settles the host gradients before the first write (:func:`settle_inputs`: the ONE gradient
  settling path, so every update reads the gradients as they were before the step);
* calls the rule's kernel -- ``name`` from a final gradient, or ``all_reduce_<name>`` from the N
  per-replica gradients summed in the same pass (:meth:`UpdatePass.apply_fused`) -- after the
  decoupled weight-decay pass for rules whose kernel has no weight-decay factor (SGD's).

Adding an optimizer: a row in ``UPDATE_KERNELS`` (and the kernels it names), then its
:class:`~cudist.optimizers.Optimizer` subclass names its slots (``_slot_names``), its step scalars
(``_step_params``) and its rule (``_rule``); nothing here changes.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from cudist._arrays import device_context, gpu_of, like
from cudist._dataplane.storage import GroupStorage, Storage, kernel_backend
from cudist._kernels import UPDATE_KERNELS, bias_corrected_lr, is_bfloat16, momentum_schedule_step, numpy_backend

if TYPE_CHECKING:
    from cudist._kernels import KernelBackend, TrustedKernels

__all__ = [
    "is_bfloat16",
    "Plan",
    "Rule",
    "UpdatePass",
    "Updatable",
    "bias_corrected_lr",
    "device_groups",
    "momentum_schedule_step",
    "settle_inputs",
]

class Updatable(Protocol):
    """What the update pass needs of a variable (``cudist.Variable``: the data plane sits below it)."""

    @property
    def name(self) -> str: ...

    @property
    def storage(self) -> Storage | GroupStorage: ...


#: One memory's kernel work for a variable: (its copies there, per slot its copies, the backend).
Group: TypeAlias = "tuple[tuple[Any, ...], tuple[tuple[Any, ...], ...], KernelBackend]"
#: A variable's validated kernel work: (the storage arrays it was validated for, its groups).
Plan: TypeAlias = "tuple[tuple[Any, ...], tuple[Group, ...]]"

class Rule:
    """One step's kernel work for a variable: an ``UPDATE_KERNELS`` rule with its scalars.

    Args:
        name: the rule (a key of :data:`cudist._kernels.UPDATE_KERNELS`).
        scalars: the rule's scalars in the table's order, the weight decay excluded.
        decay: the decoupled weight decay ``w -= w * decay`` of this step (0: none).
        slots: per slot of the rule, the index of the optimizer's slot that fills it, or None for
            a slot the rule leaves out (one of its OPTIONAL_SLOTS); None: the optimizer's slots in order.

    Raises:
        ValueError: a rule the table does not have, or the wrong number of scalars.
    """

    __slots__ = ("kernel", "fused", "scalars", "decay", "slots", "decay_pass")

    def __init__(
        self, name: str, scalars: tuple[Any, ...], decay: float = 0.0, slots: tuple[int | None, ...] | None = None
    ) -> None:
        entry = UPDATE_KERNELS.get(name)
        if entry is None:
            raise ValueError(f"no update rule {name!r} (the rules: {', '.join(UPDATE_KERNELS)})")
        # A rule whose kernel takes the decoupled weight decay as its last scalar; the others (sgd,
        # momentum) get a pass of their own before the update (_decay_pass).
        in_kernel = entry[1][-1:] == ("decay",)
        expected = len(entry[1]) - in_kernel
        if len(scalars) != expected:
            raise ValueError(f"update rule {name!r} takes {expected} scalars ({entry[1]}), got {len(scalars)}")
        self.kernel = name
        self.fused = f"all_reduce_{name}"
        self.scalars = scalars + (decay,) if in_kernel else scalars
        self.decay = decay
        self.slots = slots
        #: Whether the weight decay is a pass of its own (a rule without a weight-decay factor).
        self.decay_pass = bool(decay) and not in_kernel

    def run(self, kernels: TrustedKernels, copies: tuple[Any, ...], slots: tuple[tuple[Any, ...], ...], grad: Any) -> None:
        """Updates ``copies`` and their ``slots`` from the final ``grad`` (``kernels``: a backend's ``trusted``)."""
        if self.decay_pass:
            _decay_pass(kernels, copies, self.decay)
        args = slots if self.slots is None else self._slot_args(slots)  # (optional slots left out)
        getattr(kernels, self.kernel)(copies, *args, grad, *self.scalars)

    def run_fused(
        self, kernels: TrustedKernels, copies: tuple[Any, ...], slots: tuple[tuple[Any, ...], ...], grads: list[Any]
    ) -> None:
        """As :meth:`run`, from per-replica ``grads`` summed in the same pass."""
        if self.decay_pass:
            _decay_pass(kernels, copies, self.decay)
        args = slots if self.slots is None else self._slot_args(slots)  # (optional slots left out)
        getattr(kernels, self.fused)(copies, *args, grads, *self.scalars)

    def _slot_args(self, slots: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...] | None, ...]:
        """The rule's slot arguments, in the table's order, from the optimizer's slots."""
        order = self.slots
        if order is None:
            return slots
        return tuple(None if i is None else slots[i] for i in order)


def _decay_pass(kernels: TrustedKernels, copies: tuple[Any, ...], decay: float) -> None:
    """The decoupled weight decay as its own pass, ``w -= w * decay`` (rules whose kernel has no
    weight-decay factor: SGD's)."""
    w = copies[0]
    kernels.assign_add(copies, w * w.dtype.type(decay), True)


# ------------------------------------------------------------------------------------- settling
def settle_inputs(
    passes: Sequence[tuple[Sequence[Any], tuple[Any, ...]]], *, aliasing: bool = True, kernels: TrustedKernels | None = None
) -> list[list[Any]]:
    """The host gradients each of a step's passes reads, settled before the first pass writes.

    Args:
        passes: per pass, (its gradient arrays, the arrays it writes).
        aliasing: whether a gradient may share memory with what the passes write (False: they are
            fresh results of a reduction, only made C-contiguous).
        kernels: trusted kernels whose ``settle_plain`` (the native backend's) takes the common case
            -- every gradient a contiguous array of its own, none written -- in one call.

    Returns:
        Per pass its gradients, C-contiguous, copied where they are or view memory that some pass of
        the step writes (identity, or a NumPy view's owning base; a gradient whose memory comes
        from elsewhere, DLPack, by byte range), so every update sees the gradients as they were
        before the step.
    """
    plain = kernels.settle_plain if kernels is not None else None
    if plain is not None:
        as_is: list[list[Any]] | None = plain(passes, aliasing)
        if as_is is not None:
            return as_is
    written_ids: set[int] = set()
    if aliasing:
        for _, written in passes:
            for w in written:
                written_ids.add(id(w))
                if w.base is not None:
                    written_ids.add(id(w.base))
    spans: _Spans | None = None  # of every written array, once a gradient of foreign memory needs it
    out: list[list[Any]] = []
    for grads, written in passes:
        ins: list[Any] = []
        for c in grads:
            if not c.flags.c_contiguous:
                c = np.ascontiguousarray(c)
            elif aliasing:
                base = c.base
                if id(c) in written_ids:
                    alias = True
                elif base is None:
                    alias = False
                elif type(base) is np.ndarray:  # a NumPy view: its base owns the memory
                    alias = id(base) in written_ids or any(np.may_share_memory(c, w) for w in written)
                else:  # memory from elsewhere (DLPack: a JAX or PyTorch gradient, a variable's export)
                    if spans is None:
                        spans = _Spans([w for _, ws in passes for w in ws])
                    alias = spans.overlaps(c)
                if alias:
                    c = c.copy()
            ins.append(c)
        out.append(ins)
    return out


class _Spans:
    """The byte ranges of C-contiguous host arrays, sorted for an O(log k) overlap test."""

    def __init__(self, arrays: Sequence[npt.NDArray[Any]]) -> None:
        spans = sorted({_span(a) for a in arrays if a.nbytes})
        self._starts = [s for s, _ in spans]
        self._ends = list(itertools.accumulate((e for _, e in spans), max))  # the furthest end so far

    def overlaps(self, a: npt.NDArray[Any]) -> bool:
        """Whether C-contiguous ``a`` shares a byte with any of the arrays."""
        if not a.nbytes:
            return False
        start, end = _span(a)
        i = bisect.bisect_left(self._starts, end) - 1  # the last range starting before ``a`` ends
        return i >= 0 and self._ends[i] > start


def _span(a: npt.NDArray[Any]) -> tuple[int, int]:
    start: int = a.__array_interface__["data"][0]
    return start, start + a.nbytes


# ------------------------------------------------------------------------------------- planning
def _same_arrays(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two tuples hold the very same arrays (identity, not values)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def device_groups(bufs: Sequence[Any]) -> list[tuple[int, ...]]:
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


class UpdatePass:
    """One optimizer's kernel side: its variables' validated plans and the update passes.

    Args:
        name: the optimizer's name, for error messages.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        #: Per variable its validated kernel work (see :meth:`plan`).
        self.plans: dict[Updatable, Plan] = {}

    def plan(self, var: Updatable, named_slots: Mapping[str, Updatable]) -> Plan:
        """The validated kernel work of ``var`` and its slots (by slot name): per memory, (copies,
        slot copies in ``named_slots``' order, backend).

        Validated once through the backends' own checks, then reused while the variable and its
        slots keep the same storage arrays (an assign of a new shape reallocates them), so each step
        calls the kernels' hooks directly instead of re-checking every buffer.
        """
        slots = named_slots.values()
        bufs = var.storage.buffers()
        plan = self.plans.get(var)
        if plan is not None:
            # The per-step case: the variable and its slots kept the storage the plan was made for.
            key = bufs
            for s in slots:
                key += s.storage.buffers()
            if _same_arrays(plan[0], key):
                return plan
        slot_bufs = tuple(s.storage.buffers() for s in slots)
        if any(len(sb) != len(bufs) for sb in slot_bufs):
            # Host copies share storage until one is written alone; once the variable's (or a
            # slot's) copies have gone their own ways, every one of them gets its own storage.
            for v in (var, *slots):
                v.storage.split()
            bufs = var.storage.buffers()
            slot_bufs = tuple(s.storage.buffers() for s in slots)
        key = bufs + sum(slot_bufs, ())
        plan = self.plans.get(var)
        if plan is not None and _same_arrays(plan[0], key):
            return plan
        where = f"{self.name} update of '{var.name}'"
        groups: list[Group] = []
        for idx in device_groups(bufs):
            copies = tuple(bufs[i] for i in idx)
            backend = var.storage.kernel() if len(idx) == len(bufs) else kernel_backend(copies[0])
            if backend is None:  # a dtype the fast CPU backend lacks: the NumPy reference has all
                backend = numpy_backend()
            copies = backend.check_bufs(where, copies, writable=True, what="copy")
            backend.check_float(where, copies[0])
            group_slots: list[tuple[Any, ...]] = []
            for name, sb in zip(named_slots, slot_bufs):
                sc = backend.check_bufs(where, tuple(sb[i] for i in idx), writable=True, what=f"{name} copy")
                backend.check_same_slots(where, copies, sc, name)
                group_slots.append(sc)
            groups.append((copies, tuple(group_slots), backend))
        plan = (key, tuple(groups))
        self.plans[var] = plan
        return plan

    def apply(self, plans: Sequence[Plan], grads: Sequence[Any], rules: Sequence[Rule], *, fresh: bool = False) -> None:
        """Updates every planned variable once from its final gradient.

        Args:
            plans: per variable its :meth:`plan`.
            grads: per variable its gradient (of its shape and dtype; host or device).
            rules: per variable the step's rule.
            fresh: the gradients are new buffers (results of the reduction) that alias nothing.
        """
        host: list[tuple[Any, tuple[Any, ...], tuple[tuple[Any, ...], ...], KernelBackend, Rule]] = []
        for grad, plan, rule in zip(grads, plans, rules):
            for copies, slots, backend in plan[1]:
                ref = copies[0]
                if type(ref) is np.ndarray:  # updated below, once every host gradient is settled
                    host.append((grad if type(grad) is np.ndarray else like(grad, ref), copies, slots, backend, rule))
                else:
                    with device_context(ref):
                        g = like(grad, ref)
                        if not g.flags.c_contiguous or any(g is c for c in copies):
                            g = g.copy(order="C")
                        rule.run(backend.trusted, copies, slots, g)
        ins = settle_inputs([([g], copies + sum(slots, ())) for g, copies, slots, _, _ in host], aliasing=not fresh)
        for (_, copies, slots, backend, rule), (g,) in zip(host, ins):
            rule.run(backend.trusted, copies, slots, g)

    def fusable(
        self, strategy: Any, per_var: Sequence[Sequence[Any]], plans: Sequence[Plan]
    ) -> KernelBackend | None:
        """The backend that can sum each variable's per-replica gradients inside its update, or None.

        ``strategy``: the ``cudist.distribute.Strategy`` whose ``merge_call`` runs the step.
        Possible when every gradient and every copy is in host memory, each variable has one group,
        and the strategy's cross-device ops reduce with the kernels' own replica-order sum (the
        default ops): then one pass reads the N gradients and copy 0 of the variable and slots and
        writes every copy -- bit-identical to reducing first, then updating.
        """
        if per_var and len(per_var[0]) != len(strategy.extended.worker_devices):
            return None
        # One check of every gradient: host arrays of kernel dtypes, and cross-device ops that sum as the kernels do.
        backend: KernelBackend | None = strategy.extended._fused_sum_backend(  # private-read: the strategy's fused-sum capability (the reduce entry of #27 makes it public)
            [c for comps in per_var for c in comps]
        )
        if backend is None:
            return None
        mixed = backend.mixed_gradients
        same = None  # the last dtype seen on both sides (dtype comparisons cost ~0.1 us each; 64 variables)
        for plan, comps in zip(plans, per_var):
            groups = plan[1]
            if len(groups) != 1:
                return None
            copies, _, var_backend = groups[0]
            if var_backend is not backend or type(copies[0]) is not np.ndarray:
                return None
            dt = comps[0].dtype
            if dt is same and copies[0].dtype is same:
                continue
            if dt != copies[0].dtype:
                # Narrow gradients (the optimizer left them uncast): one dtype over the replicas,
                # which the fused kernels widen themselves.
                if not mixed or any(c.dtype != dt for c in comps):
                    return None
            elif dt not in backend.dtypes:  # bfloat16 variables: their updates have no fused kernel
                return None
            else:
                same = dt
        return backend

    def apply_fused(
        self, backend: KernelBackend, per_var: Sequence[Sequence[Any]], plans: Sequence[Plan], rules: Sequence[Rule]
    ) -> None:
        """Sums each variable's per-replica gradients and updates it in ONE kernel pass (after :meth:`fusable`).

        Args:
            backend: what :meth:`fusable` returned.
            per_var: per variable, its gradient from each of this worker's replicas.
            plans: per variable its :meth:`plan` (one host group each).
            rules: per variable the step's rule.
        """
        trusted = backend.trusted
        work = [plan[1][0] for plan in plans]
        inputs = settle_inputs(
            [(comps, copies + sum(slots, ())) for comps, (copies, slots, _) in zip(per_var, work)], kernels=trusted
        )
        for (copies, slots, _), ins, rule in zip(work, inputs, rules):
            rule.run_fused(trusted, copies, slots, ins)
