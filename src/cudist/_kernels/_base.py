"""The kernel contract: one interface, several implementations.

Every backend subclasses :class:`KernelBackend` and implements the ``_hook_*`` methods. The public
methods here validate arguments once, with errors that name the problem, then call the hooks, which
may assume:

* buffer lists are non-empty tuples of arrays of one shape and one supported dtype, C-contiguous;
  buffers that are written are writeable; inputs may be read-only;
* an output is either exactly its own input (in place) or shares no memory with any other buffer
  of the call (the public methods refuse other overlaps; the in-place ``all_reduce(bufs)`` and the
  mirrored updates keep coping with overlapping buffers as they always did);
* ``op`` is a :class:`~cudist._reduce_util.ReduceOp`.

Callers that validated once (with :meth:`KernelBackend.check_bufs` and friends) and call the same
kernels every step use :attr:`KernelBackend.trusted` (a :class:`TrustedKernels`), which goes straight
to the hooks (the native backend: straight to the C++ extension).

Semantics every backend must follow bit for bit on the CPU:

* SUM adds in replica order: ``((b0 + b1) + b2) + ...`` elementwise, in the buffers' dtype
  (integers wrap around), except the 16-bit floats (float16, bfloat16): they accumulate in float32
  and round to their dtype once, at the end.
* MEAN is that sum divided by N: true division for floats (not a multiplication by 1/N; the 16-bit
  floats divide the float32 sum by float32(N), then round), truncation toward zero for integers
  (C semantics).
* Mirrored updates read copy 0 (the copies are mirrors, so copy 0 stands for all of them) and write
  every copy. Arithmetic is in the variable dtype, except float16, which computes in float32 and
  rounds on store. Scalar hyper-parameters are converted to that compute type first.
* The fused all-reduce + update forms (``all_reduce_sgd`` ...) first sum their M gradients exactly
  as ``reduce_to_one(grads, SUM)`` does (rounded to the gradients' dtype), then apply the update: the result
  is bit-identical to ``g = reduce_to_one(grads, SUM); sgd(copies, g, ...)``, in one pass.

Hook names are ``_hook_<operation>``; callers that validated once use :attr:`KernelBackend.trusted`
and the public ``check_*`` methods.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Sequence

import numpy as np

from cudist._reduce_util import ReduceOp

__all__ = [
    "KernelBackend",
    "TrustedKernels",
    "UPDATE_ENTRY_POINTS",
    "SUPPORTED_DTYPES",
    "is_bfloat16",
    "FLOAT_DTYPES",
    "bias_corrected_lr",
    "momentum_schedule_step",
    "UPDATE_KERNELS",
    "OPTIONAL_SLOTS",
    "update_variants",
    "variant_of",
]

SUPPORTED_DTYPES = tuple(np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64"))
FLOAT_DTYPES = tuple(np.dtype(t) for t in ("float16", "float32", "float64"))
_DTYPE_NAMES = ", ".join(d.name for d in SUPPORTED_DTYPES)


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is ``ml_dtypes.bfloat16``, decided without importing ml_dtypes.

    bfloat16 is an optional dtype (the ``bf16`` extra installs ml_dtypes); NumPy files it under
    kind ``"V"``, so it is recognised by name. Only backends with ``bfloat16 = True`` compute it.
    """
    return getattr(dtype, "name", None) == "bfloat16"


def bias_corrected_lr(lr: float, beta_1: float, beta_2: float, step: int) -> float:
    """The bias-corrected step size ``lr * sqrt(1 - beta_2**step) / (1 - beta_1**step)`` for 1-based
    ``step`` (computed once, in float64).

    ``beta_2 = 0`` gives the first moment's correction alone, ``lr / (1 - beta_1**step)``, bit for
    bit (``sqrt(1.0)`` is exactly 1.0): the step size of the optimizers that correct only ``m``.
    """
    return lr * math.sqrt(1.0 - beta_2**step) / (1.0 - beta_1**step)


def momentum_schedule_step(beta_1: float, beta_2: float, step: int, u_product: float) -> tuple[float, float, float, float]:
    """Nadam's scalars for 1-based ``step`` (Keras 3's schedule of the momentum decay), in float64.

    ``u_product`` is the product ``u_1 * ... * u_(step-1)`` of the earlier steps (1.0 before the
    first), Keras's ``_u_product`` before this step. With ``u_t = beta_1 * (1 - 0.5 * 0.96**t)``:

    Returns:
        ``(u_product_t, c_m, c_g, c_v)``: the product through ``u_step`` (the state to keep),
        ``c_m = u_(t+1) / (1 - u_product_t * u_(t+1))``, ``c_g = (1 - u_t) / (1 - u_product_t)`` and
        ``c_v = 1 - beta_2**t``, the coefficients of ``m_hat = c_m * m + c_g * g`` and
        ``v_hat = v / c_v``.
    """
    u_t = beta_1 * (1.0 - 0.5 * 0.96**step)
    u_t1 = beta_1 * (1.0 - 0.5 * 0.96 ** (step + 1))
    u_product_t = u_product * u_t
    return u_product_t, u_t1 / (1.0 - u_product_t * u_t1), (1.0 - u_t) / (1.0 - u_product_t), 1.0 - beta_2**step


#: The optimizer update kernels of the contract: name -> (slot names, trusted hyper-parameters).
#: Each has a plain form ``name(copies, *slots, grad, *hyper)`` and a fused all-reduce form
#: ``all_reduce_<name>(copies, *slots, grads, *hyper)``; a slot given as None is absent (those of
#: OPTIONAL_SLOTS). Every row's last hyper-parameter is the decoupled weight decay ``decay``
#: (``w - w * decay`` before the rule, in the kernel; 0: none). The trusted entry points (:class:`TrustedKernels`),
#: the native backend's hooks and the fused forms' default hooks are generated from this table.
UPDATE_KERNELS = {
    "sgd": ((), ("lr", "decay")),
    "momentum": (("velocity",), ("lr", "momentum", "decay")),
    "nesterov": (("velocity",), ("lr", "momentum", "decay")),
    "adamw": (("m", "v"), ("lr_t", "beta_1", "beta_2", "epsilon", "decay")),
    "amsgrad": (("m", "v", "v_hat"), ("lr_t", "beta_1", "beta_2", "epsilon", "decay")),
    "rmsprop": (("velocity", "momentum", "average_gradient"), ("lr", "rho", "momentum", "epsilon", "decay")),
    "adagrad": (("accumulator",), ("lr", "epsilon", "decay")),
    "adamax": (("m", "u"), ("lr_t", "beta_1", "beta_2", "epsilon", "decay")),
    "nadam": (("m", "v"), ("lr", "beta_1", "beta_2", "epsilon", "c_m", "c_g", "c_v", "decay")),
    "lion": (("m",), ("lr", "beta_1", "beta_2", "decay")),
}

#: The slots of an UPDATE_KERNELS row that a call may give as None (absent). Each combination of
#: them is a variant of the rule with its slots fixed: a row of the C++ table of its own
#: (``CUDIST_UPDATE_RULE_LIST``), named ``<name>_<slot>...`` after the optional slots it has, in the
#: row's order, which the native and CUDA hooks pick per call (:func:`variant_of`).
OPTIONAL_SLOTS: dict[str, tuple[str, ...]] = {
    "rmsprop": ("momentum", "average_gradient"),
}


def update_variants() -> dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """Every kernel of the C++ rules' table: variant name -> (its UPDATE_KERNELS row, its slots, the
    row's hyper-parameters), in the rows' order; a row without optional slots is its one variant.
    Computed from the tables when called (a row added to them is in it)."""
    out = {}
    for name, (slots, hyper) in UPDATE_KERNELS.items():
        optional = OPTIONAL_SLOTS.get(name, ())
        for mask in range(1 << len(optional)):
            present = {s for i, s in enumerate(optional) if mask >> i & 1}
            kept = tuple(s for s in slots if s not in optional or s in present)
            out[name + "".join(f"_{s}" for s in slots if s in present)] = (name, kept, hyper)
    return out


def variant_of(name: str, slots: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
    """The variant of row ``name`` that the slot arguments ``slots`` (None: absent) call for, and
    the slots it takes (those given)."""
    optional = OPTIONAL_SLOTS.get(name)
    if not optional:
        return name, tuple(slots)
    suffix = "".join(f"_{s}" for s, a in zip(UPDATE_KERNELS[name][0], slots) if a is not None and s in optional)
    return name + suffix, tuple(a for a in slots if a is not None)


class KernelBackend:
    """Base class of the kernel backends; see the module docstring for the contract."""

    #: Backend name as accepted by ``CUDIST_BACKEND`` and :func:`cudist._kernels.get_backend`.
    name: str = "abstract"
    #: Dtypes this backend computes; a subset of SUPPORTED_DTYPES.
    dtypes: tuple = SUPPORTED_DTYPES
    #: Whether this backend also computes ``ml_dtypes.bfloat16`` (float32 accumulation, one rounding).
    bfloat16: bool = False
    #: Whether the optimizers' updates also take bfloat16 variables (float32 arithmetic, one rounding
    #: per stored value): the NumPy reference, to which every CPU backend hands them so they get one
    #: set of bits, and the GPU's kernels (their ``__nv_bfloat16`` forms, the same bits).
    bfloat16_updates: bool = False
    #: Whether the fused all-reduce + update kernels (``all_reduce_<rule>``) also take bfloat16 and
    #: float16 gradients for float32 variables, widened exactly inside the pass (mixed precision:
    #: no float32 copy of the gradients; the bits of casting them first).
    mixed_gradients: bool = False
    #: Array module of the buffers this backend takes (numpy, or cupy for the GPU backend).
    xp = np

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._dtype_set = frozenset(cls.dtypes)
        _default_update_hooks(cls)

    def __repr__(self) -> str:
        return f"<cudist kernel backend {self.name!r}>"

    def computes(self, dtype) -> bool:
        """Whether this backend's kernels take arrays of ``dtype`` (its ``dtypes``, plus bfloat16 where set)."""
        return dtype in self._dtype_set or (self.bfloat16 and is_bfloat16(dtype))

    def reaches(self, device: int, a) -> bool:
        """Whether kernels on GPU ``device`` may read array ``a`` in place (no staging copy): the
        GPU backends answer by peer access; the host backends' arrays are all in one memory."""
        del device, a
        return True

    def concurrently(self, devices) -> contextlib.AbstractContextManager[None]:
        """A block of launches on GPUs ``devices`` that may read each other's memory but write
        nothing another launch of the block reads (the fused update pass across GPUs): ordered
        against the work before and after the block, not against each other. The host backends
        have one memory and run their kernels in call order: nothing to do."""
        del devices
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ the trusted entry points
    @functools.cached_property
    def trusted(self) -> "TrustedKernels":
        """The prepared entry points for callers that validated their arguments once.

        See :class:`TrustedKernels` for the preconditions; nothing is checked on this path.
        """
        return self._make_trusted()

    def _make_trusted(self) -> "TrustedKernels":
        return TrustedKernels(self)

    # ------------------------------------------------------------------ validation
    def _check_array(self, where: str, what: str, a, *, writable: bool):
        if not isinstance(a, self.xp.ndarray):
            raise TypeError(f"{where}: {what} must be a {self.xp.__name__}.ndarray, got {type(a).__name__}")
        dt = a.dtype
        if not dt.isnative:  # ">f4" != "float32", so it would otherwise read as "unsupported dtype float32"
            raise TypeError(
                f"{where}: {what} has dtype {dt.str!r}, which is not in the machine's byte order; "
                f"convert it first with .astype({dt.newbyteorder('=').name!r})"
            )
        if is_bfloat16(dt):
            if not self.bfloat16:
                raise TypeError(
                    f"{where}: backend {self.name!r} does not support dtype bfloat16 "
                    f"(it supports: {', '.join(d.name for d in self.dtypes)}); the numpy backend computes it"
                )
        elif dt not in SUPPORTED_DTYPES:
            raise TypeError(f"{where}: unsupported dtype {dt.name} for {what} (supported: {_DTYPE_NAMES})")
        elif dt not in self.dtypes:
            raise TypeError(
                f"{where}: backend {self.name!r} does not support dtype {dt.name} "
                f"(it supports: {', '.join(d.name for d in self.dtypes)})"
            )
        if not a.flags.c_contiguous:
            raise ValueError(f"{where}: {what} is not C-contiguous")
        if writable and not getattr(a.flags, "writeable", True):  # CuPy arrays have no such flag
            raise ValueError(f"{where}: {what} is read-only but is written by this operation")
        return a

    def check_bufs(
        self, where: str, bufs: Any, *, writable: bool, what: str = "replica", same_shape: bool = True
    ) -> tuple[Any, ...]:
        """Validates a list of buffers once; returns them as a tuple.

        Checks: a non-empty list or tuple of this backend's arrays (``xp.ndarray``), of one supported
        dtype in native byte order, C-contiguous, of one shape (unless ``same_shape`` is False), and
        writeable when ``writable``. Errors name ``where`` and the offending ``what i``.

        Raises:
            TypeError: not arrays, unsupported or mismatched dtypes.
            ValueError: empty, mismatched shapes, not C-contiguous, read-only but written.
        """
        # Fast path: one loop of cheap checks for the common valid call (a few replicas of small
        # buffers must cost microseconds); any failure falls through to the detailed checks below,
        # which name the problem.
        if type(bufs) in (list, tuple) and bufs:
            nd = self.xp.ndarray
            first = bufs[0]
            if type(first) is nd and first.dtype in self._dtype_set:
                dt, shape = first.dtype, first.shape
                for b in bufs:
                    if type(b) is not nd or b.dtype != dt or (same_shape and b.shape != shape):
                        break
                    f = b.flags
                    if not f.c_contiguous or (writable and not getattr(f, "writeable", True)):
                        break
                else:
                    return tuple(bufs)
        if isinstance(bufs, self.xp.ndarray) or not isinstance(bufs, Sequence):
            raise TypeError(f"{where}: expected a list of {what} arrays, got {type(bufs).__name__}")
        bufs = tuple(bufs)
        if not bufs:
            raise ValueError(f"{where}: expected at least one {what} array, got an empty list")
        first = self._check_array(where, f"{what} 0", bufs[0], writable=writable)
        for i, b in enumerate(bufs[1:], 1):
            self._check_array(where, f"{what} {i}", b, writable=writable)
            if b.dtype != first.dtype:
                raise TypeError(f"{where}: {what} {i} has dtype {b.dtype.name} but {what} 0 has dtype {first.dtype.name}")
            if same_shape and b.shape != first.shape:
                raise ValueError(f"{where}: {what} {i} has shape {b.shape} but {what} 0 has shape {first.shape}")
        return bufs

    def check_like(self, where: str, what: str, a: Any, ref: Any, *, writable: bool) -> Any:
        """Validates one array ``a`` (named ``what``) against ``ref``: same dtype and shape. Returns ``a``."""
        self._check_array(where, what, a, writable=writable)
        if a.dtype != ref.dtype:
            raise TypeError(f"{where}: {what} has dtype {a.dtype.name} but the replicas have dtype {ref.dtype.name}")
        if a.shape != ref.shape:
            raise ValueError(f"{where}: {what} has shape {a.shape} but the replicas have shape {ref.shape}")
        return a

    def check_float(self, where: str, ref: Any) -> None:
        """Raises TypeError unless ``ref`` has a floating-point dtype (the optimizer updates)."""
        if ref.dtype not in FLOAT_DTYPES and not (self.bfloat16_updates and is_bfloat16(ref.dtype)):
            raise TypeError(f"{where}: needs a floating-point dtype, got {ref.dtype.name}")

    def check_same_slots(self, where: str, copies: Sequence[Any], slots: Sequence[Any], slot: str) -> None:
        """Raises ValueError unless the slot copies ``slots`` (named ``slot``) match ``copies``."""
        if len(slots) != len(copies):
            raise ValueError(f"{where}: got {len(copies)} variable copies but {len(slots)} {slot} copies")
        if slots[0].dtype != copies[0].dtype or slots[0].shape != copies[0].shape:
            raise ValueError(
                f"{where}: {slot} slots have shape {slots[0].shape} dtype {slots[0].dtype.name} but the variable "
                f"copies have shape {copies[0].shape} dtype {copies[0].dtype.name}"
            )

    def check_outputs(self, where: str, inputs, outputs):
        """Validates the outputs of an out-of-place all-reduce against its (checked) inputs.

        ``outputs``: as many arrays as ``inputs``, of their shape and dtype, C-contiguous and
        writeable; ``outputs[i]`` may be ``inputs[i]`` itself (in place), and no other output may
        share memory with an input or with another output. Returns the outputs as a tuple.
        """
        outputs = self.check_bufs(where, outputs, writable=True, what="output")
        if len(outputs) != len(inputs):
            raise ValueError(f"{where}: got {len(inputs)} inputs but {len(outputs)} outputs")
        ref = inputs[0]
        if outputs[0].dtype != ref.dtype:
            raise TypeError(f"{where}: the outputs have dtype {outputs[0].dtype.name} but the inputs have dtype {ref.dtype.name}")
        if outputs[0].shape != ref.shape:
            raise ValueError(f"{where}: the outputs have shape {outputs[0].shape} but the inputs have shape {ref.shape}")
        self._check_overlaps(
            where,
            [(a, ("input", i)) for i, a in enumerate(inputs)] + [(a, ("output", i)) for i, a in enumerate(outputs)],
            _in_place_pair,
            _IN_PLACE_HINT,
        )
        return outputs

    def _span(self, a):
        """The byte range [start, end) of a C-contiguous array."""
        start = a.__array_interface__["data"][0]
        return start, start + a.nbytes

    def _check_overlaps(self, where, items, allowed, hint=""):
        """Raises ValueError naming the first pair of ``items`` ((array, tag)) that shares memory,
        unless ``allowed(tag_a, tag_b, identical)`` says the pair may (``identical``: the very same
        byte range). Two inputs (tag ``("input", ...)``) always may. A sweep over the sorted byte
        ranges: O(k log k) for k arrays when nothing overlaps."""
        spans = []
        for a, tag in items:
            if a.nbytes:
                start, end = self._span(a)
                spans.append((start, end, tag))
        spans.sort(key=lambda t: t[0])
        active = []  # spans that may still overlap later ones
        for start, end, tag in spans:
            if active:
                active = [x for x in active if x[1] > start]
                for a_start, a_end, a_tag in active:
                    if a_tag[0] == "input" and tag[0] == "input":
                        continue
                    if not allowed(a_tag, tag, a_start == start and a_end == end):
                        first, second = sorted((a_tag, tag), key=_tag_order)
                        raise ValueError(f"{where}: {_tag_name(second)} overlaps {_tag_name(first)}{hint}")
            active.append((start, end, tag))

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, bufs: Any, op: ReduceOp | str = ReduceOp.SUM, outputs: Any = None) -> Any:
        """Reduces N replica buffers elementwise and writes the result into every output.

        One fused pass: every input element is read once and every output element written once.

        Args:
            bufs: N same-shape, same-dtype, C-contiguous arrays. Without ``outputs`` they are
                reduced in place (so must be writeable); with ``outputs`` they are only read (may be
                read-only).
            op: ReduceOp.SUM or ReduceOp.MEAN (or "sum" / "mean").
            outputs: None (in place), or N writeable, C-contiguous arrays of the inputs' shape and
                dtype. ``outputs[i]`` may be ``bufs[i]`` itself; any other overlap of an output with
                an input or another output is a ValueError.

        Returns:
            The outputs as a tuple (``bufs`` when reduced in place).
        """
        op = ReduceOp.parse(op, where="all_reduce")
        if outputs is None or outputs is bufs:
            bufs = self.check_bufs("all_reduce", bufs, writable=True)
            if len(bufs) > 1:  # one replica: the sum and the mean are the value itself
                self._hook_all_reduce(bufs, bufs, op)
            return bufs
        if type(outputs) in (list, tuple) and type(bufs) in (list, tuple) and len(outputs) == len(bufs) and all(
            o is b for o, b in zip(outputs, bufs)
        ):
            return self.all_reduce(outputs, op)  # every output is its input: in place
        bufs = self.check_bufs("all_reduce", bufs, writable=False, what="input")
        outputs = self.check_outputs("all_reduce", bufs, outputs)
        self._hook_all_reduce(bufs, outputs, op)
        return outputs

    def batch_all_reduce(self, inputs, outputs, op=ReduceOp.SUM):
        """All-reduces several leaves at once, out of place, without packing them first.

        Args:
            inputs: ``inputs[r][j]`` is leaf j of replica r (N replicas of M leaves). Every leaf has
                one dtype; leaf j has one shape across replicas (leaves may differ in shape).
            outputs: ``outputs[r][j]``, writeable, C-contiguous, the shape and dtype of
                ``inputs[r][j]``; it may be ``inputs[r][j]`` itself (in place) but no other output
                may share memory with an input or another output.
            op: ReduceOp.SUM or ReduceOp.MEAN (or "sum" / "mean").

        Returns:
            ``outputs`` as a tuple of tuples: ``outputs[r][j]`` holds the reduction of leaf j.
        """
        where = "batch_all_reduce"
        op = ReduceOp.parse(op, where=where)
        inputs, outputs = self._check_batch(where, inputs, outputs)
        if inputs[0]:
            self._hook_batch_all_reduce(inputs, outputs, op)
        return outputs

    def batch_reduce_to_one(self, inputs: Any, op: ReduceOp | str = ReduceOp.SUM, out: Any = None) -> Any:
        """Reduces several leaves at once into one packed buffer, without packing the inputs first.

        The reduced leaves land back to back in ``out``, in leaf order: leaf j occupies the
        ``inputs[0][j].size`` elements after those of leaves 0..j-1. One pass reads every input
        element once and writes every output element once.

        Args:
            inputs: ``inputs[r][j]`` is leaf j of replica r (N replicas of M >= 1 leaves). Every leaf
                has one dtype; leaf j has one shape across replicas (leaves may differ in shape).
            op: ReduceOp.SUM or ReduceOp.MEAN (or "sum" / "mean").
            out: None (a new 1-d array), or a writeable, C-contiguous 1-d array of the leaves' dtype
                with as many elements as one replica's leaves together; it may not share memory
                with an input.

        Returns:
            ``out``.
        """
        where = "batch_reduce_to_one"
        op = ReduceOp.parse(op, where=where)
        inputs, _ = self._check_batch(where, inputs, None)
        if not inputs[0]:
            raise ValueError(f"{where}: expected at least one leaf per replica, got none")
        dt = inputs[0][0].dtype
        total = sum(a.size for a in inputs[0])
        if out is None:
            out = self.xp.empty(total, dt)
        else:
            self._check_array(where, "out", out, writable=True)
            if out.ndim != 1 or out.dtype != dt or out.size != total:
                raise ValueError(
                    f"{where}: out must be a 1-d {dt.name} array of {total} elements (the leaves of one replica "
                    f"together), got {out.dtype.name} of shape {out.shape}"
                )
            self._check_overlaps(
                where,
                [(a, ("input", r, j)) for r, leaves in enumerate(inputs) for j, a in enumerate(leaves)] + [(out, ("output", "out"))],
                lambda a, b, identical: False,
            )
        self._hook_batch_reduce_to_one(inputs, op, out)
        return out

    def _check_batch(self, where, inputs, outputs):
        def replicas(x, what):
            if isinstance(x, self.xp.ndarray) or not isinstance(x, Sequence):
                raise TypeError(f"{where}: {what} must be a list with one list of leaves per replica, got {type(x).__name__}")
            x = tuple(x)
            for r, leaves in enumerate(x):
                if isinstance(leaves, self.xp.ndarray) or not isinstance(leaves, Sequence):
                    raise TypeError(f"{where}: {what}[{r}] must be a list of leaf arrays, got {type(leaves).__name__}")
            return tuple(tuple(leaves) for leaves in x)

        inputs = replicas(inputs, "inputs")
        checked = [("input", inputs, False)]
        if outputs is not None:  # None: batch_reduce_to_one's inputs, without outputs
            outputs = replicas(outputs, "outputs")
            checked.append(("output", outputs, True))
        n = len(inputs)
        if n == 0:
            raise ValueError(f"{where}: expected at least one replica, got an empty list")
        if outputs is not None and len(outputs) != n:
            raise ValueError(f"{where}: got {n} input replicas but {len(outputs)} output replicas")
        m = len(inputs[0])
        for what, x, _ in checked:
            for r, leaves in enumerate(x):
                if len(leaves) != m:
                    raise ValueError(f"{where}: {what} replica {r} has {len(leaves)} leaves but input replica 0 has {m}")
        if m == 0:
            return inputs, outputs
        dt = None
        for what, x, writable in checked:
            for r, leaves in enumerate(x):
                for j, a in enumerate(leaves):
                    self._check_array(where, f"{what} leaf {j} of replica {r}", a, writable=writable)
                    ref = inputs[0][j]
                    if dt is None:
                        dt = a.dtype
                    elif a.dtype != dt:
                        raise TypeError(
                            f"{where}: {what} leaf {j} of replica {r} has dtype {a.dtype.name} but input leaf 0 of "
                            f"replica 0 has dtype {dt.name} (every leaf of one batch must have one dtype)"
                        )
                    if a.shape != ref.shape:
                        raise ValueError(
                            f"{where}: {what} leaf {j} of replica {r} has shape {a.shape} but input leaf {j} of "
                            f"replica 0 has shape {ref.shape}"
                        )
        if outputs:
            self._check_overlaps(
                where,
                [(a, ("input", r, j)) for r, leaves in enumerate(inputs) for j, a in enumerate(leaves)]
                + [(a, ("output", r, j)) for r, leaves in enumerate(outputs) for j, a in enumerate(leaves)],
                _in_place_pair,
                _IN_PLACE_HINT,
            )
        return inputs, outputs

    def reduce_to_one(self, bufs: Any, op: ReduceOp | str = ReduceOp.SUM, out: Any = None) -> Any:
        """Reduces N replica buffers elementwise into ``out`` (a new array when None).

        ``out`` may be one of ``bufs``. Returns ``out``.
        """
        op = ReduceOp.parse(op, where="reduce_to_one")
        bufs = self.check_bufs("reduce_to_one", bufs, writable=False)
        if out is None:
            out = self.xp.empty_like(bufs[0])
        else:
            self.check_like("reduce_to_one", "out", out, bufs[0], writable=True)
        self._hook_reduce_to_one(bufs, op, out)
        return out

    def broadcast(self, src: Any, dsts: Any) -> tuple[Any, ...]:
        """Copies ``src`` into every array of ``dsts`` (same shape and dtype). Returns ``dsts``."""
        dsts = self.check_bufs("broadcast", dsts, writable=True, what="destination")
        self.check_like("broadcast", "src", src, dsts[0], writable=False)
        self._hook_broadcast(src, dsts)
        return dsts

    def all_gather(self, bufs: Any, axis: int = 0) -> Any:
        """Concatenates the replica buffers along ``axis`` in replica order into a new array.

        The buffers may differ in size along ``axis`` only (partial batches). Negative axes count
        from the end.
        """
        bufs = self.check_bufs("all_gather", bufs, writable=False, same_shape=False)
        ndim = bufs[0].ndim
        if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
            raise TypeError(f"all_gather: axis must be an int, got {type(axis).__name__}")
        if ndim == 0:
            raise ValueError("all_gather: cannot gather 0-d (scalar) arrays along an axis; give them a dimension first")
        if not -ndim <= axis < ndim:
            raise ValueError(f"all_gather: axis {axis} is out of range for arrays of rank {ndim}")
        axis = int(axis) % ndim
        ref = bufs[0].shape
        for i, b in enumerate(bufs[1:], 1):
            if b.ndim != ndim or any(b.shape[d] != ref[d] for d in range(ndim) if d != axis):
                raise ValueError(
                    f"all_gather: replica {i} has shape {b.shape}, which differs from replica 0's {ref} "
                    f"outside the gather axis {axis}"
                )
        return self._hook_all_gather(bufs, axis)

    def split(self, batch, n):
        """Splits a (nested) batch into ``n`` per-replica pieces along dimension 0, ceil rule.

        See :func:`cudist._kernels._split.split`. On the CPU the pieces are views.
        """
        from cudist._kernels._split import split

        return split(batch, n)

    # ------------------------------------------------------------------ mirrored updates
    def assign(self, copies: Any, value: Any) -> tuple[Any, ...]:
        """Writes ``value`` into every copy. Returns ``copies``."""
        copies = self.check_bufs("assign", copies, writable=True, what="copy")
        self.check_like("assign", "value", value, copies[0], writable=False)
        self._hook_assign(copies, value)
        return copies

    def assign_add(self, copies, value):
        """Every copy becomes ``copies[0] + value``. Returns ``copies``."""
        copies = self.check_bufs("assign_add", copies, writable=True, what="copy")
        self.check_like("assign_add", "value", value, copies[0], writable=False)
        self._hook_assign_add(copies, value, False)
        return copies

    def assign_sub(self, copies, value):
        """Every copy becomes ``copies[0] - value``. Returns ``copies``."""
        copies = self.check_bufs("assign_sub", copies, writable=True, what="copy")
        self.check_like("assign_sub", "value", value, copies[0], writable=False)
        self._hook_assign_add(copies, value, True)
        return copies

    def sgd(self, copies, grad, *, lr, weight_decay=0.0):
        """Plain gradient descent: every copy becomes ``copies[0] - lr * grad`` (after the
        decoupled weight decay, see below). Returns ``copies``."""
        return self._sgd("sgd", False, copies, grad, lr, weight_decay)

    def _sgd(self, where, fused, copies, g, lr, weight_decay):
        copies, _, g = self._check_opt(where, copies, (), **{"grads" if fused else "grad": g})
        hook = self._hook_all_reduce_sgd if fused else self._hook_sgd
        hook(copies, g, float(lr), float(weight_decay) * float(lr))
        return copies

    def momentum(self, copies, velocities, grad, *, lr, momentum, nesterov=False, weight_decay=0.0):
        """Gradient descent with momentum (Keras formulation), on N variable copies and N velocity copies.

        ``v = momentum * v - lr * g``; then ``w += momentum * v - lr * g`` (nesterov) or ``w += v``.
        The trusted forms are two rows of the table, ``momentum`` and ``nesterov`` (this picks one).
        Returns ``copies``.
        """
        return self._momentum("momentum", False, copies, velocities, grad, lr, momentum, nesterov, weight_decay)

    def nesterov(self, copies, velocities, grad, *, lr, momentum, weight_decay=0.0):
        """:meth:`momentum` with Nesterov's momentum (the table's ``nesterov`` row). Returns ``copies``."""
        return self._momentum("nesterov", False, copies, velocities, grad, lr, momentum, True, weight_decay)

    def _momentum(self, where, fused, copies, vels, g, lr, momentum, nesterov, weight_decay):
        copies, (vels,), g = self._check_opt(where, copies, (("velocity", vels),), **{"grads" if fused else "grad": g})
        row = "nesterov" if nesterov else "momentum"
        hook = getattr(self, f"_hook_all_reduce_{row}" if fused else f"_hook_{row}")
        hook(copies, vels, g, float(lr), float(momentum), float(weight_decay) * float(lr))
        return copies

    def adam(self, copies, ms, vs, grad, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step):
        """Adam (Keras formulation) on N copies of the variable and of its two slots.

        With ``lr_t = lr * sqrt(1 - beta_2**step) / (1 - beta_1**step)`` (``step`` is 1-based):
        ``m += (g - m) * (1 - beta_1)``; ``v += (g*g - v) * (1 - beta_2)``;
        ``w -= lr_t * m / (sqrt(v) + epsilon)``.
        """
        copies = self.check_bufs("adam", copies, writable=True, what="copy")
        self.check_float("adam", copies[0])
        ms = self.check_bufs("adam", ms, writable=True, what="m copy")
        vs = self.check_bufs("adam", vs, writable=True, what="v copy")
        self.check_same_slots("adam", copies, ms, "m")
        self.check_same_slots("adam", copies, vs, "v")
        self.check_like("adam", "grad", grad, copies[0], writable=False)
        lr_t = self._bias_corrected_lr("adam", lr, beta_1, beta_2, step)
        # Keras 3's Adam is AdamW's update without the weight decay: the adamw row, decay 0.
        self._hook_adamw(copies, ms, vs, grad, lr_t, float(beta_1), float(beta_2), float(epsilon), 0.0)
        return copies

    @staticmethod
    def _bias_corrected_lr(where, lr, beta_1, beta_2, step):
        if int(step) < 1:
            raise ValueError(f"{where}: step must be >= 1 (1-based), got {step}")
        return bias_corrected_lr(float(lr), float(beta_1), float(beta_2), int(step))

    # ------------------------------------------------------------------ more optimizer updates
    # Every one reads copy 0 of the variable and of its slots and writes all N copies in one pass;
    # ``weight_decay`` (Keras's decoupled weight decay) first makes the variable
    # ``w - w * (weight_decay * lr)`` in the compute type, within the same pass (skipped when 0).
    # Each has a fused all-reduce form (``all_reduce_<name>``, see :meth:`all_reduce_sgd`).
    def _check_opt(self, where, copies, slots, *, grad=None, grads=None):
        """Validates an update: the copies, each ``(name, slot copies or None)``, and either the
        final ``grad`` or the fused form's ``grads``. Returns (copies, slot groups, grad or grads)."""
        copies = self.check_bufs(where, copies, writable=True, what="copy")
        self.check_float(where, copies[0])
        groups = []
        for name, group in slots:
            if group is not None:
                group = self.check_bufs(where, group, writable=True, what=f"{name} copy")
                self.check_same_slots(where, copies, group, name)
            groups.append(group)
        if grads is None:
            return copies, groups, self.check_like(where, "grad", grad, copies[0], writable=False)
        named = [(name, group) for (name, _), group in zip(slots, groups) if group is not None]
        return copies, groups, self.check_grads(where, grads, copies, named)

    @staticmethod
    def _step(where, step):
        if int(step) < 1:
            raise ValueError(f"{where}: step must be >= 1 (1-based), got {step}")
        return int(step)

    def _adamw(self, where, fused, copies, ms, vs, g, lr, beta_1, beta_2, epsilon, step, weight_decay):
        copies, (ms, vs), g = self._check_opt(where, copies, (("m", ms), ("v", vs)), **{"grads" if fused else "grad": g})
        lr_t = self._bias_corrected_lr(where, lr, beta_1, beta_2, step)
        hook = self._hook_all_reduce_adamw if fused else self._hook_adamw
        hook(copies, ms, vs, g, lr_t, float(beta_1), float(beta_2), float(epsilon), float(weight_decay) * float(lr))
        return copies

    def adamw(self, copies, ms, vs, grad, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step, weight_decay=0.004):
        """AdamW (Keras): decoupled weight decay ``w -= w * (weight_decay * lr)``, then :meth:`adam`.

        The trusted form takes the bias-corrected ``lr_t`` (:func:`bias_corrected_lr`) and
        ``decay = weight_decay * lr``. Returns ``copies``.
        """
        return self._adamw("adamw", False, copies, ms, vs, grad, lr, beta_1, beta_2, epsilon, step, weight_decay)

    def _amsgrad(self, where, fused, copies, ms, vs, v_hats, g, lr, beta_1, beta_2, epsilon, step, weight_decay):
        copies, (ms, vs, v_hats), g = self._check_opt(
            where, copies, (("m", ms), ("v", vs), ("v_hat", v_hats)), **{"grads" if fused else "grad": g}
        )
        lr_t = self._bias_corrected_lr(where, lr, beta_1, beta_2, step)
        hook = self._hook_all_reduce_amsgrad if fused else self._hook_amsgrad
        hook(copies, ms, vs, v_hats, g, lr_t, float(beta_1), float(beta_2), float(epsilon),
             float(weight_decay) * float(lr))
        return copies

    def amsgrad(self, copies, ms, vs, v_hats, grad, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step,
                weight_decay=0.0):
        """AMSGrad (Keras 3's ``Adam(amsgrad=True)``): :meth:`adamw`'s moments, then
        ``v_hat = maximum(v_hat, v)`` (NumPy's) and ``w -= lr_t * m / (sqrt(v_hat) + epsilon)``.

        The trusted form takes the bias-corrected ``lr_t`` (:func:`bias_corrected_lr`) and
        ``decay = weight_decay * lr``. Returns ``copies``.
        """
        return self._amsgrad("amsgrad", False, copies, ms, vs, v_hats, grad, lr, beta_1, beta_2, epsilon, step,
                             weight_decay)

    def rmsprop(self, copies, velocities, momentums, average_grads, grad, *, lr, rho=0.9, momentum=0.0,
                epsilon=1e-7, weight_decay=0.0):
        """RMSprop (Keras formulation) on N copies and their slots.

        ``v = rho * v + (1 - rho) * g*g``; centered (``average_grads`` given):
        ``a = rho * a + (1 - rho) * g`` and ``d = v - a*a + epsilon``, else ``d = v + epsilon``;
        ``inc = lr * g / sqrt(d)``; with ``momentums`` given: ``mo = momentum * mo + inc`` and
        ``w -= mo``, else ``w -= inc``. ``momentums`` / ``average_grads``: N slot copies, or None
        when the optimizer has no such slot (momentum 0, not centered). Returns ``copies``.
        """
        return self._rmsprop("rmsprop", False, copies, velocities, momentums, average_grads, grad, lr, rho,
                             momentum, epsilon, weight_decay)

    def _rmsprop(self, where, fused, copies, vels, moms, avgs, g, lr, rho, momentum, epsilon, weight_decay):
        slots = (("velocity", vels), ("momentum", moms), ("average_gradient", avgs))
        copies, (vels, moms, avgs), g = self._check_opt(where, copies, slots, **{"grads" if fused else "grad": g})
        hook = self._hook_all_reduce_rmsprop if fused else self._hook_rmsprop
        hook(copies, vels, moms, avgs, g, float(lr), float(rho), float(momentum), float(epsilon),
             float(weight_decay) * float(lr))
        return copies

    def adagrad(self, copies, accumulators, grad, *, lr, epsilon=1e-7, weight_decay=0.0):
        """Adagrad (Keras): ``acc += g*g``; ``w -= lr * g / sqrt(acc + epsilon)``. Returns ``copies``."""
        return self._adagrad("adagrad", False, copies, accumulators, grad, lr, epsilon, weight_decay)

    def _adagrad(self, where, fused, copies, accs, g, lr, epsilon, weight_decay):
        copies, (accs,), g = self._check_opt(where, copies, (("accumulator", accs),), **{"grads" if fused else "grad": g})
        hook = self._hook_all_reduce_adagrad if fused else self._hook_adagrad
        hook(copies, accs, g, float(lr), float(epsilon), float(weight_decay) * float(lr))
        return copies

    def adamax(self, copies, ms, us, grad, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step, weight_decay=0.0):
        """Adamax (Keras): ``m += (g - m) * (1 - beta_1)``; ``u = maximum(beta_2 * u, |g|)``;
        ``w -= lr_t * m / (u + epsilon)`` with ``lr_t = lr / (1 - beta_1**step)`` (:func:`bias_corrected_lr` with
        ``beta_2 = 0``, what the trusted form takes). ``maximum`` is NumPy's (a NaN wins). Returns ``copies``."""
        return self._adamax("adamax", False, copies, ms, us, grad, lr, beta_1, beta_2, epsilon, step, weight_decay)

    def _adamax(self, where, fused, copies, ms, us, g, lr, beta_1, beta_2, epsilon, step, weight_decay):
        copies, (ms, us), g = self._check_opt(where, copies, (("m", ms), ("u", us)), **{"grads" if fused else "grad": g})
        lr_t = bias_corrected_lr(float(lr), float(beta_1), 0.0, self._step(where, step))
        hook = self._hook_all_reduce_adamax if fused else self._hook_adamax
        hook(copies, ms, us, g, lr_t, float(beta_1), float(beta_2), float(epsilon), float(weight_decay) * float(lr))
        return copies

    def nadam(self, copies, ms, vs, grad, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step, u_product,
              weight_decay=0.0):
        """Nadam (Keras 3 formulation).

        ``u_product``: Keras's ``_u_product`` before this step (1.0 before the first); the caller
        keeps the new one, the first value :func:`momentum_schedule_step` returns. With that function's
        ``c_m, c_g, c_v`` (what the trusted form takes): ``m += (g - m) * (1 - beta_1)``;
        ``v += (g*g - v) * (1 - beta_2)``; ``m_hat = c_m * m + c_g * g``; ``v_hat = v / c_v``;
        ``w -= m_hat * lr / (sqrt(v_hat) + epsilon)``. Returns ``copies``.
        """
        return self._nadam("nadam", False, copies, ms, vs, grad, lr, beta_1, beta_2, epsilon, step, u_product,
                           weight_decay)

    def _nadam(self, where, fused, copies, ms, vs, g, lr, beta_1, beta_2, epsilon, step, u_product, weight_decay):
        copies, (ms, vs), g = self._check_opt(where, copies, (("m", ms), ("v", vs)), **{"grads" if fused else "grad": g})
        _, c_m, c_g, c_v = momentum_schedule_step(float(beta_1), float(beta_2), self._step(where, step), float(u_product))
        hook = self._hook_all_reduce_nadam if fused else self._hook_nadam
        hook(copies, ms, vs, g, float(lr), float(beta_1), float(beta_2), float(epsilon), c_m, c_g, c_v,
             float(weight_decay) * float(lr))
        return copies

    def lion(self, copies, ms, grad, *, lr, beta_1=0.9, beta_2=0.99, weight_decay=0.0):
        """Lion (Keras): ``w -= lr * sign(m * beta_1 + g * (1 - beta_1))``;
        ``m = m * beta_2 + g * (1 - beta_2)``. ``sign`` is NumPy's (+0 for zeros, NaN stays NaN).
        Returns ``copies``."""
        return self._lion("lion", False, copies, ms, grad, lr, beta_1, beta_2, weight_decay)

    def _lion(self, where, fused, copies, ms, g, lr, beta_1, beta_2, weight_decay):
        copies, (ms,), g = self._check_opt(where, copies, (("m", ms),), **{"grads" if fused else "grad": g})
        hook = self._hook_all_reduce_lion if fused else self._hook_lion
        hook(copies, ms, g, float(lr), float(beta_1), float(beta_2), float(weight_decay) * float(lr))
        return copies

    # ------------------------------------------------------------------ fused all-reduce + update
    def check_grads(self, where, grads, copies, slots=()):
        """Validates the gradients of a fused all-reduce + update against its (checked) copies.

        ``grads``: one or more arrays of the copies' shape and dtype (C-contiguous; may be
        read-only), none sharing memory with a copy or with a slot copy in ``slots`` (a sequence of
        ``(name, slot copies)``). Returns the gradients as a tuple.
        """
        grads = self.check_bufs(where, grads, writable=False, what="gradient")
        ref = copies[0]
        if grads[0].dtype != ref.dtype:
            raise TypeError(f"{where}: the gradients have dtype {grads[0].dtype.name} but the copies have dtype {ref.dtype.name}")
        if grads[0].shape != ref.shape:
            raise ValueError(f"{where}: the gradients have shape {grads[0].shape} but the copies have shape {ref.shape}")
        items = [(g, ("input", "gradient", i)) for i, g in enumerate(grads)]
        items += [(c, ("output", "copy", i)) for i, c in enumerate(copies)]
        for name, group in slots:
            items += [(c, ("output", f"{name} copy", i)) for i, c in enumerate(group)]
        self._check_overlaps(
            where, items, _written_may_overlap, "; the gradients must not share memory with what the update writes"
        )
        return grads

    def _check_update(self, where, copies, slots):
        copies = self.check_bufs(where, copies, writable=True, what="copy")
        self.check_float(where, copies[0])
        out = []
        for name, group in slots:
            group = self.check_bufs(where, group, writable=True, what=f"{name} copy")
            self.check_same_slots(where, copies, group, name)
            out.append(group)
        return copies, out

    def all_reduce_sgd(self, copies, grads, *, lr, weight_decay=0.0):
        """Fused all-reduce + gradient descent: ``g = grads[0] + ... + grads[M-1]``, then every copy
        becomes ``copies[0] - lr * g``, in one pass (M gradients and copy 0 read, N copies written).

        Bit-identical to ``g = reduce_to_one(grads, SUM); sgd(copies, g, lr=lr)``. M need not be N
        (one central variable updated from N replica gradients has one copy). Returns ``copies``.
        """
        return self._sgd("all_reduce_sgd", True, copies, grads, lr, weight_decay)

    def all_reduce_momentum(self, copies, velocities, grads, *, lr, momentum, nesterov=False, weight_decay=0.0):
        """Fused all-reduce + :meth:`momentum`: the M gradients summed as in :meth:`all_reduce_sgd`,
        then the update of the N copies and N velocities, in one pass. Returns ``copies``."""
        return self._momentum("all_reduce_momentum", True, copies, velocities, grads, lr, momentum, nesterov,
                              weight_decay)

    def all_reduce_adam(self, copies, ms, vs, grads, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step):
        """Fused all-reduce + Adam: the M gradients summed as in :meth:`all_reduce_sgd`, then
        :meth:`adam` on the N copies of the variable and of its slots, in one pass. Returns ``copies``."""
        where = "all_reduce_adam"
        copies, (ms, vs) = self._check_update(where, copies, (("m", ms), ("v", vs)))
        grads = self.check_grads(where, grads, copies, (("m", ms), ("v", vs)))
        lr_t = self._bias_corrected_lr(where, lr, beta_1, beta_2, step)
        self._hook_all_reduce_adamw(copies, ms, vs, grads, lr_t, float(beta_1), float(beta_2), float(epsilon), 0.0)
        return copies

    def all_reduce_adamw(self, copies, ms, vs, grads, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step,
                         weight_decay=0.004):
        """Fused all-reduce + :meth:`adamw` (the M gradients summed as in :meth:`all_reduce_sgd`)."""
        return self._adamw("all_reduce_adamw", True, copies, ms, vs, grads, lr, beta_1, beta_2, epsilon, step,
                           weight_decay)

    def all_reduce_amsgrad(self, copies, ms, vs, v_hats, grads, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step,
                           weight_decay=0.0):
        """Fused all-reduce + :meth:`amsgrad`."""
        return self._amsgrad("all_reduce_amsgrad", True, copies, ms, vs, v_hats, grads, lr, beta_1, beta_2, epsilon,
                             step, weight_decay)

    def all_reduce_rmsprop(self, copies, velocities, momentums, average_grads, grads, *, lr, rho=0.9, momentum=0.0,
                           epsilon=1e-7, weight_decay=0.0):
        """Fused all-reduce + :meth:`rmsprop`."""
        return self._rmsprop("all_reduce_rmsprop", True, copies, velocities, momentums, average_grads, grads, lr,
                             rho, momentum, epsilon, weight_decay)

    def all_reduce_adagrad(self, copies, accumulators, grads, *, lr, epsilon=1e-7, weight_decay=0.0):
        """Fused all-reduce + :meth:`adagrad`."""
        return self._adagrad("all_reduce_adagrad", True, copies, accumulators, grads, lr, epsilon, weight_decay)

    def all_reduce_adamax(self, copies, ms, us, grads, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step,
                          weight_decay=0.0):
        """Fused all-reduce + :meth:`adamax`."""
        return self._adamax("all_reduce_adamax", True, copies, ms, us, grads, lr, beta_1, beta_2, epsilon, step,
                            weight_decay)

    def all_reduce_nadam(self, copies, ms, vs, grads, *, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step, u_product,
                         weight_decay=0.0):
        """Fused all-reduce + :meth:`nadam`."""
        return self._nadam("all_reduce_nadam", True, copies, ms, vs, grads, lr, beta_1, beta_2, epsilon, step,
                           u_product, weight_decay)

    def all_reduce_lion(self, copies, ms, grads, *, lr, beta_1=0.9, beta_2=0.99, weight_decay=0.0):
        """Fused all-reduce + :meth:`lion`."""
        return self._lion("all_reduce_lion", True, copies, ms, grads, lr, beta_1, beta_2, weight_decay)

    # ------------------------------------------------------------------ hooks
    def _hook_all_reduce(self, inputs, outputs, op):  # pragma: no cover - abstract
        """outputs[i] = reduce(inputs) for every i; ``outputs`` may be ``inputs`` (in place)."""
        raise NotImplementedError

    def _hook_batch_all_reduce(self, inputs, outputs, op):
        """Every leaf j: outputs[r][j] = reduce over r of inputs[r][j]. Default: one call per leaf."""
        n = len(inputs)
        for j in range(len(inputs[0])):
            self._hook_all_reduce(tuple(inputs[r][j] for r in range(n)), tuple(outputs[r][j] for r in range(n)), op)

    def _hook_batch_reduce_to_one(self, inputs, op, out):
        """``out`` = the reductions of every leaf j over r of ``inputs[r][j]``, back to back.
        Default: one reduce-to-one per leaf, into its slice of ``out``."""
        n, off = len(inputs), 0
        for j, ref in enumerate(inputs[0]):
            size = ref.size
            if size:
                self._hook_reduce_to_one(tuple(inputs[r][j] for r in range(n)), op, out[off : off + size].reshape(ref.shape))
            off += size

    def _hook_reduce_to_one(self, bufs, op, out):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_broadcast(self, src, dsts):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_all_gather(self, bufs, axis):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_assign(self, copies, value):
        self._hook_broadcast(value, copies)

    def _hook_assign_add(self, copies, value, negate):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_sgd(self, copies, grad, lr, decay):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_momentum(self, copies, velocities, grad, lr, momentum, decay):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_nesterov(self, copies, velocities, grad, lr, momentum, decay):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_adamw(self, copies, ms, vs, grad, lr_t, beta_1, beta_2, epsilon, decay):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_amsgrad(self, copies, ms, vs, v_hats, grad, lr_t, beta_1, beta_2, epsilon, decay):  # pragma: no cover
        raise NotImplementedError

    def _hook_rmsprop(self, copies, vels, moms, avgs, grad, lr, rho, momentum, epsilon, decay):  # pragma: no cover
        raise NotImplementedError

    def _hook_adagrad(self, copies, accs, grad, lr, epsilon, decay):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_adamax(self, copies, ms, us, grad, lr_t, beta_1, beta_2, epsilon, decay):  # pragma: no cover
        raise NotImplementedError

    def _hook_nadam(self, copies, ms, vs, grad, lr, beta_1, beta_2, epsilon, c_m, c_g, c_v, decay):  # pragma: no cover
        raise NotImplementedError

    def _hook_lion(self, copies, ms, grad, lr, beta_1, beta_2, decay):  # pragma: no cover - abstract
        raise NotImplementedError

    # The fused forms default to the definition: reduce_to_one into a temporary, then the update.
    def _sum_grads(self, grads, dtype):
        if grads[0].dtype != dtype:
            # Mixed precision (bfloat16 / float16 gradients of float32 copies, from a backend with
            # ``mixed_gradients`` falling back here): the definition casts each gradient first.
            grads = [g.astype(dtype) for g in grads]
        if len(grads) == 1:
            return grads[0]
        g = self.xp.empty_like(grads[0])
        self._hook_reduce_to_one(grads, ReduceOp.SUM, g)
        return g

    def _hook_reduce_unscale_finite(self, grads, scale, out):
        """The definition of LossScaleOptimizer's fused reduce: ``out`` = the gradients' sum (as the
        fused updates sum them, narrow gradients of a wider ``out`` cast first) divided by ``scale``
        in the compute type; returns whether every element of ``out`` is finite."""
        with np.errstate(all="ignore"):  # an inf or NaN is the answer here, not a warning
            s = self._sum_grads(grads, out.dtype)
            ct = np.dtype(np.float32) if out.dtype == np.float16 else out.dtype
            np.copyto(out, np.divide(s.astype(ct, copy=False), ct.type(scale)), casting="unsafe")
            return bool(np.isfinite(out).all())

    def _hook_reduce_unscale_flag(self, grads, scale, out, flag):
        """``reduce_unscale_finite`` with its verdict in ``flag`` (a one-element int32 array in
        ``out``'s memory) instead of returned: set to 1 when ``out`` has an inf or NaN, left as it
        was otherwise. The host backends answer at once; a GPU backend keeps the flag on its GPU
        so that a step's variables need one read-back in all."""
        if not self._hook_reduce_unscale_finite(grads, scale, out):
            flag[0] = 1



#: The trusted entry points of the update kernels: ``name`` and ``all_reduce_name`` per UPDATE_KERNELS entry.
UPDATE_ENTRY_POINTS = tuple(f"{form}{name}" for name in UPDATE_KERNELS for form in ("", "all_reduce_"))


class TrustedKernels:
    """A backend's kernels without argument checks, for callers that validated once.

    Get it as ``backend.trusted``. The methods return None and check nothing; each call must meet
    the preconditions a public method of :class:`KernelBackend` would have established:

    * every buffer list is a non-empty tuple (or list) of this backend's arrays (``backend.xp``),
      one supported dtype (one of ``backend.dtypes``), one shape, C-contiguous; buffers written are
      writeable; a list may not change while a call runs;
    * ``op`` is a :class:`~cudist._reduce_util.ReduceOp` member (not a string);
    * an output is exactly its own input (in place) or shares no memory with any other buffer of the
      call; gradients share no memory with the copies or slots an update writes;
    * the updates (every row of UPDATE_KERNELS and its fused form) get floating-point buffers; slot
      lists are as long as the copy list; hyper-parameters are Python floats (an ``lr_t`` is the
      bias-corrected step size of :func:`bias_corrected_lr`).

    Breaking them is undefined behaviour on the fast backends (a wrong result, not necessarily an
    error). Use :meth:`check_bufs` (and the backend's other ``check_*`` methods) once, then call these.

    Methods (all return None):

    * ``all_reduce(inputs, outputs, op)``: outputs[i] = reduce(inputs); ``outputs`` may be
      ``inputs`` (in place).
    * ``batch_all_reduce(inputs, outputs, op)``: ``inputs[r][j]`` leaf j of replica r (one dtype;
      leaf j of one shape across replicas; at least one leaf), ``outputs[r][j]`` likewise.
    * ``batch_reduce_to_one(inputs, op, out)``: ``inputs`` as for ``batch_all_reduce``, ``out`` one
      1-d array receiving the reduced leaves back to back (not sharing memory with an input).
    * ``reduce_to_one(bufs, op, out)``; ``broadcast(src, dsts)``; ``assign(copies, value)``;
      ``assign_add(copies, value, negate)``.
    * ``reduce_to_one_shared(bufs, op, out)`` (the native backend; None elsewhere): the one exception
      to "checks nothing": ``reduce_to_one`` into ``out`` (a buffer nobody else holds), made
      read-only, returning ``[out]`` + ``len(bufs) - 1`` read-only views of it; or None, doing
      nothing, unless ``bufs`` are at least 2 C-contiguous ``numpy.ndarray`` of one shape and kernel
      dtype (an integer MEAN excluded) and ``out`` fits them. ``batch_reduce_to_one_shared(inputs, op,
      out)`` likewise for ``batch_reduce_to_one``: per replica the list of its leaves' read-only
      results (views of ``out`` in the leaves' shapes), or None. ``settle_plain(passes, aliasing)``
      (native; None elsewhere): the optimizers' common case of settling a step's gradients in one
      call: per pass (gradients, written arrays) its gradients as a list when every gradient is a
      C-contiguous ndarray owning its memory and, with ``aliasing``, neither a written array nor the
      base of one; else None.
    * ``reduce_unscale_finite(grads, scale, out)`` -> bool: ``out`` (a fresh buffer of the variable's
      float dtype and the gradients' shape) becomes the sum of ``grads`` (one or more; of ``out``'s
      dtype, or bfloat16 / float16 for a float32 ``out`` where ``mixed_gradients``), summed as the
      fused updates sum them, divided by ``scale``; returns whether every element of ``out`` is finite.
      LossScaleOptimizer's step: the finiteness check is part of the reduction's pass.
    * ``reduce_unscale_flag(grads, scale, out, flag)``: the same, the verdict kept in ``flag`` (a
      one-element int32 array of ``out``'s backend, on ``out``'s device) -- set to 1 when ``out``
      has an inf or NaN, untouched otherwise --, so that one read of the flag serves every variable
      of a step (on a GPU: no host round trip per variable).
    * ``sgd(copies, grad, lr, decay)``; ``momentum(copies, velocities, grad, lr, momentum, decay)`` and
      ``nesterov(...)`` with the same arguments (Nesterov's momentum: a row of its own).
    * ``adamw(copies, ms, vs, grad, lr_t, beta_1, beta_2, epsilon, decay)`` (also the public
      :meth:`KernelBackend.adam`'s, decay 0);
      ``amsgrad(copies, ms, vs, v_hats, grad, lr_t, beta_1, beta_2, epsilon, decay)``;
      ``rmsprop(copies, velocities, momentums, average_grads, grad, lr, rho, momentum, epsilon, decay)``
      (``momentums`` / ``average_grads`` None when absent: OPTIONAL_SLOTS); ``adagrad(copies, accs, grad, lr, epsilon,
      decay)``; ``adamax(copies, ms, us, grad, lr_t, beta_1, beta_2, epsilon, decay)`` (``lr_t`` of
      :func:`bias_corrected_lr` with ``beta_2 = 0``); ``nadam(copies, ms, vs, grad, lr, beta_1, beta_2, epsilon, c_m, c_g, c_v,
      decay)`` (:func:`momentum_schedule_step`); ``lion(copies, ms, grad, lr, beta_1, beta_2, decay)``; each with
      an ``all_reduce_<name>`` form taking ``grads`` in place of ``grad``. ``decay`` is
      ``weight_decay * lr`` (0.0: none).
    * ``out_of_place``: the names of the update entry points above that also take ``sources=``, a
      tuple of arrays (the variable's, then each slot's in the entry point's order; read-only is
      fine; each the copies' dtype and size, sharing no memory with them unless it IS copy 0) holding
      the current values: the update reads them instead of copy 0 and writes every copy without
      reading it (out of place; the bits of the in-place update). Empty where no entry point does
      (the NumPy, Numba and CuPy backends): callers copy the values into copy 0 first.
    * ``check_bufs(where, bufs, *, writable, what="replica", same_shape=True)`` and the other
      validators (``check_like``, ``check_float``, ``check_same_slots``, ``check_outputs``,
      ``check_grads``): the backend's own, for validating once.
    """

    __slots__ = (
        "backend",
        "all_reduce",
        "batch_all_reduce",
        "batch_reduce_to_one",
        "reduce_to_one",
        "reduce_to_one_shared",
        "batch_reduce_to_one_shared",
        "settle_plain",
        "out_of_place",
        "broadcast",
        "assign",
        "assign_add",
        "reduce_unscale_finite",
        "reduce_unscale_flag",
        "__dict__",  # the update kernels' entry points, one pair per row of UPDATE_KERNELS
        "check_bufs",
        "check_like",
        "check_float",
        "check_same_slots",
        "check_outputs",
        "check_grads",
    )

    # The entry points callers outside the kernel layer use, typed for them (the update kernels'
    # are reached by name, getattr(trusted, rule), through the update pass).
    all_reduce: Callable[..., None]
    batch_all_reduce: Callable[..., None]
    batch_reduce_to_one: Callable[..., None]
    reduce_to_one: Callable[..., None]
    broadcast: Callable[..., None]
    assign: Callable[..., None]
    assign_add: Callable[..., None]
    reduce_unscale_finite: Callable[..., bool]
    reduce_unscale_flag: Callable[..., None]

    def __init__(self, backend: KernelBackend) -> None:
        self.backend = backend
        # Bound methods stored once: a call is one attribute load and the hook itself.
        self.all_reduce = backend._hook_all_reduce
        self.batch_all_reduce = backend._hook_batch_all_reduce
        self.batch_reduce_to_one = backend._hook_batch_reduce_to_one
        self.reduce_to_one = backend._hook_reduce_to_one
        #: Only where the backend has it in one native call (else None): see the class docstring.
        self.reduce_to_one_shared: Any = None
        self.batch_reduce_to_one_shared: Any = None
        self.settle_plain: Any = None
        #: The update entry points (rule names, plain and ``all_reduce_`` forms) that take
        #: ``sources=`` (the native backend's table rules; empty elsewhere): see the class docstring.
        self.out_of_place: frozenset[str] = frozenset()
        self.broadcast = backend._hook_broadcast
        self.assign = backend._hook_assign
        self.assign_add = backend._hook_assign_add
        self.reduce_unscale_finite = backend._hook_reduce_unscale_finite
        self.reduce_unscale_flag = backend._hook_reduce_unscale_flag
        for name in UPDATE_KERNELS:
            setattr(self, name, getattr(backend, f"_hook_{name}"))
            setattr(self, f"all_reduce_{name}", getattr(backend, f"_hook_all_reduce_{name}"))
        self.check_bufs = backend.check_bufs
        self.check_like = backend.check_like
        self.check_float = backend.check_float
        self.check_same_slots = backend.check_same_slots
        self.check_outputs = backend.check_outputs
        self.check_grads = backend.check_grads

    def __repr__(self) -> str:
        return f"<trusted kernels of {self.backend!r}>"


# ---------------------------------------------------------------------------- overlap rules
_IN_PLACE_HINT = " (an output may share memory only with its own input, and then be exactly that input)"

def _in_place_pair(a, b, identical):
    """all_reduce / batch_all_reduce: an output may be exactly its own input, nothing else."""
    if a[0] == b[0]:
        return False  # two outputs
    return identical and a[1:] == b[1:]


def _written_may_overlap(a, b, identical):
    """Fused updates: gradients must not touch what is written; copies and slots may overlap each
    other (the kernels cope, as the plain updates always did)."""
    return a[0] == b[0] == "output"


def _tag_order(tag):
    return (tag[0] != "input", tag[1:])


def _tag_name(tag):
    kind, *idx = tag
    if len(idx) == 2 and isinstance(idx[0], str):  # ("output", "velocity copy", 3)
        return f"{idx[0]} {idx[1]}"
    if len(idx) == 2:  # ("input", r, j)
        return f"{kind} leaf {idx[1]} of replica {idx[0]}"
    return f"{kind} {idx[0]}"


# ---------------------------------------------------------------------------- update hooks from the table
def _abstract_update_hook(name):
    def hook(self, *args):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} does not implement the update kernel {name!r}")

    hook.__name__ = f"_hook_{name}"
    return hook


def _fused_update_hook(name):
    nslots = len(UPDATE_KERNELS[name][0])

    def hook(self, copies, *args):
        # The definition of the fused form: reduce_to_one into a temporary, then the plain update.
        getattr(self, f"_hook_{name}")(copies, *args[:nslots], self._sum_grads(args[nslots], copies[0].dtype), *args[nslots + 1 :])

    hook.__name__ = f"_hook_all_reduce_{name}"
    return hook


def _default_update_hooks(cls):
    """Gives ``cls`` the hooks of the UPDATE_KERNELS rows it lacks: the plain one abstract, the fused
    one the plain one on the summed gradients. A backend writes only the hooks it computes itself."""
    for name in UPDATE_KERNELS:
        if not hasattr(cls, f"_hook_{name}"):
            setattr(cls, f"_hook_{name}", _abstract_update_hook(name))
        if not hasattr(cls, f"_hook_all_reduce_{name}"):
            setattr(cls, f"_hook_all_reduce_{name}", _fused_update_hook(name))


_default_update_hooks(KernelBackend)
