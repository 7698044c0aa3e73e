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
  per-replica gradients summed in the same pass (:meth:`UpdatePass.apply_fused`); every rule's
  kernel applies the decoupled weight decay itself (its last scalar, ``decay``).

Adding an optimizer: a row in ``UPDATE_KERNELS`` (and the kernels it names), then its
:class:`~cudist.optimizers.Optimizer` subclass names its slots (``_slot_names``), its step scalars
(``_step_params``) and its rule (``_rule``); nothing here changes.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from cudist._arrays import array_module, contiguous, device_context, gpu_of, like, to_host
from cudist._dataplane import pool
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


#: One memory's kernel work for a variable: (its copies there, per slot its copies, the backend,
#: the sources: None (in place) or the arrays holding the current values, the variable's then each
#: slot's, when the copies are written out of place).
Group: TypeAlias = "tuple[tuple[Any, ...], tuple[tuple[Any, ...], ...], KernelBackend, tuple[Any, ...] | None]"
#: What a fused all-reduce + update of a variable needs, settled at plan time: (the backend of its
#: groups -- the host's one group, or the CuPy backend for copies on one GPU or one group per GPU
#: --, the variable's dtype, every array the update writes: copies, then slot copies, group by
#: group); None when its update cannot be fused (copies in the host's memory and a GPU's, a dtype
#: without fused kernels).
Fused: TypeAlias = "tuple[KernelBackend, Any, tuple[Any, ...]] | None"
#: A variable's validated kernel work: (the storage arrays it was validated for, its groups, its
#: Fused, the out-of-place writes to commit once it ran: (storage, the array written) each).
Plan: TypeAlias = "tuple[tuple[Any, ...], tuple[Group, ...], Fused, tuple[tuple[Storage | GroupStorage, Any], ...]]"

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

    __slots__ = ("kernel", "fused", "scalars", "decay", "slots")

    def __init__(
        self, name: str, scalars: tuple[Any, ...], decay: float = 0.0, slots: tuple[int | None, ...] | None = None
    ) -> None:
        entry = UPDATE_KERNELS.get(name)
        if entry is None:
            raise ValueError(f"no update rule {name!r} (the rules: {', '.join(UPDATE_KERNELS)})")
        # Every row's kernel takes the decoupled weight decay as its last scalar (UPDATE_KERNELS).
        expected = len(entry[1]) - 1
        if len(scalars) != expected:
            raise ValueError(f"update rule {name!r} takes {expected} scalars ({entry[1]}), got {len(scalars)}")
        self.kernel = name
        self.fused = f"all_reduce_{name}"
        self.scalars = scalars + (decay,)
        self.decay = decay
        self.slots = slots

    def run(
        self,
        kernels: TrustedKernels,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        grad: Any,
        sources: tuple[Any, ...] | None = None,
    ) -> None:
        """Updates ``copies`` and their ``slots`` from the final ``grad`` (``kernels``: a backend's ``trusted``).

        ``sources``: None (in place), or the arrays holding the current values (the variable's,
        then each slot's) when the copies are to be written without being read (see :class:`Group`).
        """
        kernel = getattr(kernels, self.kernel)
        if sources is not None and self._reads_sources(kernels, self.kernel, copies, slots, sources):
            kernel(copies, *slots, grad, *self.scalars, sources=sources)
            return
        args = slots if self.slots is None else self._slot_args(slots)  # (optional slots left out)
        kernel(copies, *args, grad, *self.scalars)

    def run_fused(
        self,
        kernels: TrustedKernels,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        grads: list[Any],
        sources: tuple[Any, ...] | None = None,
    ) -> None:
        """As :meth:`run`, from per-replica ``grads`` summed in the same pass."""
        kernel = getattr(kernels, self.fused)
        if sources is not None and self._reads_sources(kernels, self.fused, copies, slots, sources):
            kernel(copies, *slots, grads, *self.scalars, sources=sources)
            return
        args = slots if self.slots is None else self._slot_args(slots)  # (optional slots left out)
        kernel(copies, *args, grads, *self.scalars)

    def _reads_sources(
        self,
        kernels: TrustedKernels,
        entry: str,
        copies: tuple[Any, ...],
        slots: tuple[tuple[Any, ...], ...],
        sources: tuple[Any, ...],
    ) -> bool:
        """Whether ``entry`` reads ``sources`` itself; if not, copies them into copy 0 of the variable
        and of each slot first (the same bits: the in-place update then reads what the sources hold)."""
        if entry in kernels.out_of_place and self.slots is None:
            return True
        for dst, src in zip((copies, *slots), sources):
            if src is not dst[0]:
                kernels.broadcast(src, (dst[0],))
        return False

    def _slot_args(self, slots: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...] | None, ...]:
        """The rule's slot arguments, in the table's order, from the optimizer's slots."""
        order = self.slots
        if order is None:
            return slots
        return tuple(None if i is None else slots[i] for i in order)


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
    """The byte ranges of arrays, sorted for an O(log k) overlap test.

    ``span``: an array's (start, end) addresses: :func:`_span` for C-contiguous host arrays (the
    default), :func:`_device_span` for GPU arrays of any layout (unified addressing: one address
    space over every GPU).
    """

    def __init__(self, arrays: Sequence[Any], span: Callable[[Any], tuple[int, int]] | None = None) -> None:
        self._span = _span if span is None else span
        spans = sorted({self._span(a) for a in arrays if a.nbytes})
        self._starts = [s for s, _ in spans]
        self._ends = list(itertools.accumulate((e for _, e in spans), max))  # the furthest end so far

    def overlaps(self, a: Any) -> bool:
        """Whether ``a`` shares a byte with any of the arrays."""
        if not a.nbytes:
            return False
        start, end = self._span(a)
        i = bisect.bisect_left(self._starts, end) - 1  # the last range starting before ``a`` ends
        return i >= 0 and self._ends[i] > start


def _span(a: npt.NDArray[Any]) -> tuple[int, int]:
    start: int = a.__array_interface__["data"][0]
    return start, start + a.nbytes


def _device_span(a: Any) -> tuple[int, int]:
    """A GPU array's extent, any layout: from its lowest element's first byte to its highest's last."""
    start = int(a.data.ptr)
    lo = start + sum(min(0, (n - 1) * st) for n, st in zip(a.shape, a.strides))
    hi = start + sum(max(0, (n - 1) * st) for n, st in zip(a.shape, a.strides)) + a.itemsize
    return lo, hi


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
        # What each storage's update writes and reads (the same array unless it goes out of place:
        # a snapshot held, e.g. by an asynchronous checkpoint write; see Storage.targets).
        bufs, src = var.storage.targets()
        plan = self.plans.get(var)
        if plan is not None:
            # The per-step case: the variable and its slots kept the storage the plan was made for
            # (_same_arrays inlined: this runs for every variable of every step).
            key = bufs + (src,)
            for s in slots:
                sb, ss = s.storage.targets()
                key += sb + (ss,)
            made = plan[0]
            if len(made) == len(key) and all(map(operator.is_, made, key)):
                return plan
        slot_targets = [s.storage.targets() for s in slots]
        if any(len(sb) != len(bufs) for sb, _ in slot_targets):
            # Host copies share storage until one is written alone; once the variable's (or a
            # slot's) copies have gone their own ways, every one of them gets its own storage.
            for v in (var, *slots):
                v.storage.split()
            bufs, src = var.storage.targets()
            slot_targets = [s.storage.targets() for s in slots]
        slot_bufs = tuple(sb for sb, _ in slot_targets)
        key = bufs + (src,) + sum((sb + (ss,) for sb, ss in slot_targets), ())
        plan = self.plans.get(var)
        if plan is not None and _same_arrays(plan[0], key):
            return plan
        sources: tuple[Any, ...] | None = (src, *(ss for _, ss in slot_targets))
        moves = tuple(
            (v.storage, b[0])
            for v, (b, ss) in zip((var, *slots), [(bufs, src), *slot_targets])
            if b[0] is not ss
        )
        if not moves:
            sources = None
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
            if sources is not None:  # out of place: one host group (Storage.targets), read from the sources
                for s in sources:
                    backend.check_like(where, "source", s, copies[0], writable=False)
            groups.append((copies, tuple(group_slots), backend, sources))
        fused: Fused = None
        backend = groups[0][2]
        ref = groups[0][0][0]
        # One group (the host's, or one GPU's), or one per GPU with one backend (each GPU's launch
        # of the pass updates its own group). bfloat16 variables (not in the backend's dtypes)
        # have no fused kernel on the CPU; on a GPU they are not fused either, so both give the
        # bits of reducing first.
        if ref.dtype in backend.dtypes and (
            len(groups) == 1 or all(type(g[0][0]) is not np.ndarray and g[2] is backend for g in groups)
        ):
            fused = (backend, ref.dtype, sum((g[0] + sum(g[1], ()) for g in groups), ()))
        plan = (key, tuple(groups), fused, moves)
        if moves:
            # Not kept: a plan holds its arrays, and the ones written out of place move away from
            # go back to their storage's pool only once nothing else holds them (Storage.targets).
            # The next step plans for the new arrays.
            self.plans.pop(var, None)
        else:
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
        host: list[tuple[Any, tuple[Any, ...], tuple[tuple[Any, ...], ...], KernelBackend, Rule, Any]] = []
        for grad, plan, rule in zip(grads, plans, rules):
            for copies, slots, backend, sources in plan[1]:
                ref = copies[0]
                if type(ref) is np.ndarray:  # updated below, once every host gradient is settled
                    g = grad if type(grad) is np.ndarray else like(grad, ref)
                    host.append((g, copies, slots, backend, rule, sources))
                else:
                    with device_context(ref):
                        g = like(grad, ref)
                        if not g.flags.c_contiguous or any(g is c for c in copies):
                            g = g.copy(order="C")
                        rule.run(backend.trusted, copies, slots, g)
        ins = settle_inputs([([g], copies + sum(slots, ())) for g, copies, slots, *_ in host], aliasing=not fresh)
        for (_, copies, slots, backend, rule, sources), (g,) in zip(host, ins):
            rule.run(backend.trusted, copies, slots, g, sources)
        _commit(plans)

    def fusable(
        self, strategy: Any, per_var: Sequence[Sequence[Any]], plans: Sequence[Plan]
    ) -> KernelBackend | None:
        """The backend that can sum each variable's per-replica gradients inside its update, or None.

        ``strategy``: the ``cudist.distribute.Strategy`` whose ``merge_call`` runs the step.
        Possible when every gradient and every copy is in the host's memory (one group per
        variable), or all are GPU arrays -- on one GPU (logical GPUs split from one physical GPU
        included) or on several, where each GPU holding copies can read every replica's gradient
        in place (peer access: the backend's ``reaches``, the P2P collectives' own test) --, and
        the strategy's cross-device ops reduce with the kernels' own replica-order sum (the
        default ops): then one pass per memory reads the N gradients and copy 0 of the variable
        and slots there and writes every copy there -- bit-identical to reducing first, then
        updating. Where some GPU cannot read some gradient, None: the general path (reduce
        first; the same bits). Narrow (bfloat16 / float16) gradients of float32 variables are
        widened inside that pass where the backend's fused kernels do it (``mixed_gradients``:
        every backend, the CuPy one included).
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
        on_gpu = type(per_var[0][0]) is not np.ndarray
        # What depends on the variable alone (its groups of this backend, a dtype with fused
        # kernels) was settled at plan time: per variable one identity test, and one of its dtype.
        for plan, comps in zip(plans, per_var):
            fused = plan[2]
            if fused is None or fused[0] is not backend:
                return None
            if on_gpu:
                # Each GPU's launch reads every replica's gradient where it is: a pair without
                # peer access (or a gradient in a stream-ordered pool) keeps the general path.
                for group in plan[1]:
                    d: int = group[0][0].device.id
                    if not all(backend.reaches(d, c) for c in comps):
                        return None
            dt = comps[0].dtype
            if dt is not fused[1] and dt != fused[1]:
                # Narrow gradients (the optimizer left them uncast): one dtype over the replicas,
                # which the fused kernels widen themselves.
                if not mixed or any(c.dtype != dt for c in comps):
                    return None
        return backend

    def reduce_unscaled(
        self, backend: KernelBackend, per_var: Sequence[Sequence[Any]], plans: Sequence[Plan], scale: float
    ) -> list[Any] | None:
        """LossScaleOptimizer's reduction (after :meth:`fusable`): per variable its per-replica
        gradients summed and divided by ``scale`` into a new buffer of the variable's dtype where
        its copy 0 lives, the finiteness check in the same kernel pass: on the host (pooled
        buffers) ``reduce_unscale_finite``, whose verdict comes with the call; on GPUs
        ``reduce_unscale_flag``, reading every replica's gradient over peer access and leaving
        the verdict in a flag on the GPU, the flags read back once after every variable's launch
        (one host round trip per step, not one per variable or replica).

        Returns:
            The unscaled sums, or None when one is not finite (the step is skipped; on the host
            the remaining variables are not reduced: each verdict comes at once).
        """
        trusted = backend.trusted
        out: list[Any] = []
        if type(per_var[0][0]) is np.ndarray:  # host arrays: each verdict at once
            reduce_finite = trusted.reduce_unscale_finite
            for comps, plan in zip(per_var, plans):
                ref = plan[1][0][0][0]  # copy 0 of the variable: its shape and dtype
                buf = pool.take(ref.shape, ref.dtype)
                if not reduce_finite([c if c.flags.c_contiguous else np.ascontiguousarray(c) for c in comps], scale, buf):
                    return None
                out.append(buf)
            return out
        reduce = trusted.reduce_unscale_flag
        flags: dict[int, Any] = {}  # per GPU holding a first copy, its flag
        for comps, plan in zip(per_var, plans):
            ref = plan[1][0][0][0]
            with device_context(ref):
                buf = array_module(ref).empty(ref.shape, ref.dtype)
                flag = flags.get(ref.device.id)
                if flag is None:
                    flag = flags[ref.device.id] = array_module(ref).zeros(1, np.int32)
            reduce([contiguous(c) for c in comps], scale, buf, flag)
            out.append(buf)
        if any(to_host(f)[0] for f in flags.values()):
            return None
        return out

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
        if per_var and type(per_var[0][0]) is not np.ndarray:
            _apply_fused_on_gpu(trusted, per_var, plans, rules)
            return
        inputs = settle_inputs([(comps, plan[2][2]) for comps, plan in zip(per_var, plans)], kernels=trusted)  # type: ignore[index]  # fusable: every plan has its Fused
        last: Rule | None = None
        kernel: Any = None
        scalars: tuple[Any, ...] = ()
        for plan, ins, rule in zip(plans, inputs, rules):
            copies, slots, _, sources = plan[1][0]
            if rule is not last:  # (one rule for every variable, unless weight decays differ)
                last, scalars = rule, rule.scalars
                # The rule's kernel called here directly when it needs no slot reordering: one
                # Python call per variable, where rule.run_fused would be two.
                kernel = None if rule.slots is not None else getattr(trusted, rule.fused)
            if kernel is None or sources is not None:
                rule.run_fused(trusted, copies, slots, ins, sources)
            else:
                kernel(copies, *slots, ins, *scalars)
        _commit(plans)


def _apply_fused_on_gpu(
    trusted: TrustedKernels, per_var: Sequence[Sequence[Any]], plans: Sequence[Plan], rules: Sequence[Rule]
) -> None:
    """:meth:`UpdatePass.apply_fused` for copies and gradients on GPUs: the CuPy backend's fused
    kernels, one launch per variable and GPU holding copies (narrow gradients read as they are: no
    float32 copy). Across GPUs, GPU k's launch reads the N replicas' gradients in replica order
    over peer access (:meth:`UpdatePass.fusable` checked it), so every GPU computes the same sum,
    and copy 0 of its own variable and slots (the copies are mirrored: equal), and writes only its
    own copies and slots.

    The gradients are settled as the host's are (:func:`settle_inputs`): made C-contiguous, and
    copied (on their own GPU) where they share memory with anything the pass writes on any GPU (a
    kernel reading a gradient that an earlier launch of the pass wrote, or that its own threads
    write, would read updated values).

    Why this is race-free across GPUs: no launch writes anything another launch reads -- each
    writes only its own GPU's copies and slots, reads of copies stay on that GPU, and no gradient
    shares a byte with any written array (settled above) --, so the launches may run in any order
    or at once -- and do (the backend's ``concurrently``): before the first launch every GPU's
    stream waits once for the work queued so far on every GPU of the pass (the gradients and their
    settling copies are ready), the launches then wait for nothing of each other's, and after the
    last every GPU's stream waits for all of them (their later work may overwrite or free a
    gradient a launch read).
    """
    written = _Spans([a for plan in plans for a in plan[2][2]], _device_span)  # type: ignore[index]  # fusable: every plan has its Fused
    # Every gradient settled before the first launch writes anything.
    inputs = []
    for comps in per_var:
        ins = []
        for g in comps:
            if not g.flags.c_contiguous or written.overlaps(g):
                with device_context(g):  # (a copy lands on the current GPU: g's own)
                    g = g.copy(order="C")
            ins.append(g)
        inputs.append(ins)
    devices = {copies[0].device.id for plan in plans for copies, *_ in plan[1]}
    devices.update(g.device.id for ins in inputs for g in ins)
    with trusted.backend.concurrently(devices):  # (no launch waits for another: see above)
        for ins, plan, rule in zip(inputs, plans, rules):
            for copies, slots, _, sources in plan[1]:
                with device_context(copies[0]):
                    rule.run_fused(trusted, copies, slots, ins, sources)



def _commit(plans: Sequence[Plan]) -> None:
    """Makes the arrays written out of place the storages (after every update of the pass ran)."""
    for plan in plans:
        for storage, written in plan[3]:
            storage.commit(written)
