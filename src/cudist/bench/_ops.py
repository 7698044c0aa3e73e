"""Kernel-level benchmark cases: buffers, the timed call, the check against the NumPy reference,
and the byte counts behind algbw / busbw / %copy.

Sizes are bytes per replica (per mirrored copy for updates). Bandwidth formulas follow nccl-tests:

* all-reduce: algbw = size / t, busbw = algbw * 2(n-1)/n; bytes moved = 2*n*size (n read, n written).
* all-gather: algbw = n*size / t (the gathered output), busbw = algbw * (n-1)/n; moved = 2*n*size.
* broadcast: algbw = busbw = size / t; moved = (n+1)*size (source read once, n destinations written).
* split: algbw = busbw = n*size / t (the batch); the pieces are views, so no bytes move (%copy n/a).
* update: algbw = size / t; busbw = bytes moved / t, moved = (r + w*n)*size with r buffers read (the
  variable's copy 0, each slot's copy 0, the gradient) and w per copy written (the variable and each
  slot): with k slots, (2+k) + (1+k)*n, one case per kernel variant of
  cudist._kernels.update_variants() (a rule with optional slots has one per combination of them):
  no slot 2+n, one 3+2n, two 4+3n (var, two slots and grad read; 3n copies written), three 5+4n.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cudist._kernels import UPDATE_KERNELS, update_variants

__all__ = [
    "OPS", "OpSpec", "Case", "UPDATE_OPTIMIZERS", "SUITE_UPDATES", "make_case", "random_array", "count_wrong", "tf_update"
]


@dataclass(frozen=True)
class OpSpec:
    name: str
    algbw_bytes: Callable[[int, int], int]
    busbw_factor: Callable[[int], float]
    moved_bytes: Callable[[int, int], int | None]
    moved_formula: str
    floats_only: bool = False


@dataclass
class Case:
    """One benchmark point: ``run()`` is the timed call, ``check()`` returns #wrong elements."""

    run: Callable[[], object]
    check: Callable[[], int]


#: Update rule -> (buffers read, buffers written per mirrored copy): see the module docstring. One
#: per kernel variant of cudist._kernels.update_variants() (its slots read and written besides the
#: variable and the gradient).
_UPDATE_MOVED = {name: (2 + len(slots), 1 + len(slots)) for name, (_, slots, _) in update_variants().items()}
#: Slots that hold positive values (the others are signed).
_POSITIVE_SLOTS = frozenset({"velocity", "v", "v_hat", "u", "accumulator"})
#: Keyword arguments of an update beyond the learning rate (and the step, where it takes one).
_UPDATE_ARGS = {
    "momentum": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9),
    "adamw": dict(weight_decay=0.004),
    "amsgrad": dict(weight_decay=0.004),
    "nadam": dict(u_product=0.5),
}
#: TensorFlow's fused kernel that ``--compare tf`` times an update row against: (raw op, its extra
#: attributes); the rows not listed are timed against ResourceApplyAdam (the TF worker names no
#: optimizer).
_TF_UPDATES = {
    "sgd": ("ResourceApplyGradientDescent", {}),
    "momentum": ("ResourceApplyKerasMomentum", {}),
    "nesterov": ("ResourceApplyKerasMomentum", {"use_nesterov": True}),
}


def tf_update(op: str) -> tuple[str, dict[str, bool]]:
    """TensorFlow's raw op (and its attributes) for the benchmark operation ``update/<row>``."""
    return _TF_UPDATES.get(op.split("/", 1)[-1], ("ResourceApplyAdam", {}))


#: The update rules ``cudist-bench update --optimizer`` takes.
UPDATE_OPTIMIZERS = tuple(_UPDATE_MOVED)
#: Those ``cudist-bench suite`` times: no slot, and two (with the weight decay).
SUITE_UPDATES = ("sgd", "adamw")

OPS = {
    "all-reduce": OpSpec(
        "all-reduce", lambda s, n: s, lambda n: 2 * (n - 1) / n, lambda s, n: 2 * n * s, "2*n*size"
    ),
    "all-gather": OpSpec(
        "all-gather", lambda s, n: n * s, lambda n: (n - 1) / n, lambda s, n: 2 * n * s, "2*n*size"
    ),
    "broadcast": OpSpec("broadcast", lambda s, n: s, lambda n: 1.0, lambda s, n: (n + 1) * s, "(n+1)*size"),
    "split": OpSpec("split", lambda s, n: n * s, lambda n: 1.0, lambda s, n: None, "none (views)"),
}
for _opt, (_r, _w) in _UPDATE_MOVED.items():
    OPS[f"update/{_opt}"] = OpSpec(
        f"update/{_opt}",
        lambda s, n: s,
        None,  # busbw is bytes moved / t for updates
        lambda s, n, r=_r, w=_w: (r + w * n) * s,
        f"({_r}+{_w}n)*size" if _w > 1 else f"({_r}+n)*size",
        floats_only=True,
    )


def random_array(rng, count: int, dtype, *, nonneg: bool = False) -> np.ndarray:
    """Random host data of ``dtype`` (never zeros): floats in [-1, 1) (or [0.01, 1)), ints in [-1000, 1000)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        a = rng.random(count, dtype=dtype if dtype in (np.float32, np.float64) else np.float64)
        a = a * 0.99 + 0.01 if nonneg else a * 2 - 1
        return a.astype(dtype, copy=False)
    return rng.integers(0 if nonneg else -1000, 1000, count, dtype=dtype)


def _to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def count_wrong(got, ref, *, exact: bool) -> int:
    """Elements of ``got`` differing from ``ref``: exactly (NaN equals NaN), or beyond a dtype tolerance."""
    got = _to_host(got)
    if got.shape != ref.shape:
        return int(max(ref.size, got.size))
    itemsize = ref.dtype.itemsize
    if ref.dtype.name == "bfloat16":  # ml_dtypes': compared as float32, exactly or within bfloat16's ulps
        got, ref = got.astype(np.float32), ref.astype(np.float32)
    if ref.dtype.kind != "f":
        return int(np.count_nonzero(got != ref))
    if exact:
        return int(np.count_nonzero(~((got == ref) | (np.isnan(got) & np.isnan(ref)))))
    rtol = 2e-2 if itemsize == 2 and ref.dtype == np.float32 else {2: 2e-3, 4: 2e-6, 8: 1e-12}[itemsize]
    return int(np.count_nonzero(~np.isclose(got, ref, rtol=rtol, atol=rtol, equal_nan=True)))


def make_case(op: str, backend, count: int, dtype, n: int, *, redop="sum", seed: int = 0) -> Case:
    """Allocates the buffers of one benchmark point and returns its timed call and check.

    The check refills the buffers with fresh random data, runs the operation once and compares every
    output element with the NumPy reference (:func:`cudist._kernels.reference_reduce`); timing then reuses the buffers.
    Comparisons are exact on CPU backends (the kernel contract is bitwise) and within a few ulps on
    the GPU.
    """
    from cudist._kernels import numpy_backend, reference_reduce
    from cudist._reduce_util import ReduceOp

    xp = backend.xp
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    exact = xp is np

    def dev(a):
        return a if xp is np else xp.asarray(a)

    def fresh(a):
        """A new buffer holding ``a``: mirrors must be distinct memory, or the bench measures cache hits."""
        return a.copy() if xp is np else xp.asarray(a)

    if op == "all-reduce":
        rop = ReduceOp.parse(redop, where="all-reduce")
        bufs = [xp.empty(count, dtype=dtype) for _ in range(n)]

        def check():
            host = [random_array(rng, count, dtype) for _ in range(n)]
            for b, h in zip(bufs, host):
                b[...] = dev(h)
            ref = reference_reduce(host, rop)
            backend.all_reduce(bufs, rop)
            return sum(count_wrong(b, ref, exact=exact) for b in bufs)

        for b in bufs:
            b[...] = dev(random_array(rng, count, dtype))
        return Case(lambda: backend.all_reduce(bufs, rop), check)

    if op == "all-gather":
        host = [random_array(rng, count, dtype) for _ in range(n)]
        bufs = [dev(h) for h in host]

        def check():
            return count_wrong(backend.all_gather(bufs, 0), np.concatenate(host), exact=exact)

        return Case(lambda: backend.all_gather(bufs, 0), check)

    if op == "broadcast":
        hsrc = random_array(rng, count, dtype)
        src = dev(hsrc)
        dsts = [xp.zeros(count, dtype=dtype) for _ in range(n)]

        def check():
            for d in dsts:
                d[...] = 0
            backend.broadcast(src, dsts)
            return sum(count_wrong(d, hsrc, exact=exact) for d in dsts)

        return Case(lambda: backend.broadcast(src, dsts), check)

    if op == "split":
        from cudist._kernels import split_sizes

        total = n * count - (1 if count > 1 and n > 1 else 0)  # uneven on purpose: the ceil rule's last piece
        hbatch = random_array(rng, total, dtype)
        batch = dev(hbatch)

        def check():
            pieces = backend.split(batch, n)
            if len(pieces) != n:
                return total
            per = -(-total // n)
            wrong = 0
            for i, p in enumerate(pieces):
                ref = hbatch[min(i * per, total) : min((i + 1) * per, total)]
                wrong += count_wrong(p, ref, exact=True)
            assert [int(p.shape[0]) for p in pieces] == split_sizes(total, n)
            return wrong

        return Case(lambda: backend.split(batch, n), check)

    if op.startswith("update/"):
        opt = op.split("/", 1)[1]
        if dtype.kind != "f":
            raise ValueError(f"update/{opt}: needs a floating-point dtype, got {dtype.name}")
        ref_be = numpy_backend()
        w0 = random_array(rng, count, dtype)
        g_h = random_array(rng, count, dtype)
        copies = [fresh(w0) for _ in range(n)]
        grad = dev(g_h)
        hp = dict(lr=0.01)
        signed = lambda: random_array(rng, count, dtype)  # noqa: E731
        positive = lambda: random_array(rng, count, dtype, nonneg=True)  # noqa: E731
        kernel, kept, _ = update_variants()[opt]
        values = []
        for s in kept:  # second moments, norms and accumulators are positive, first moments signed
            if s == "average_gradient":  # small against sqrt(velocity), so v - a*a stays positive
                v = values[0].astype(np.float64)
                values.append((signed().astype(np.float64) * 0.1 * np.sqrt(v)).astype(dtype))
            else:
                values.append(positive() if s in _POSITIVE_SLOTS else signed())
        slots_h = values
        hp.update(_UPDATE_ARGS.get(opt, {}))
        slots = [[fresh(s) for _ in range(n)] for s in slots_h]
        step = [0]
        takes_step = "step" in inspect.signature(getattr(ref_be, kernel)).parameters

        def call(be, cps, sl, g):
            given = iter(sl)  # the variant's slots; the row's others absent (None)
            args = [next(given) if s in kept else None for s in UPDATE_KERNELS[kernel][0]]
            if not takes_step:
                return getattr(be, kernel)(cps, *args, g, **hp)
            step[0] += 1
            return getattr(be, kernel)(cps, *args, g, step=step[0], **hp)

        def check():
            # Restore the mirrors to known values, then one update on both backends from the same state.
            for c in copies:
                c[...] = dev(w0)
            for s_dev, s_h in zip(slots, slots_h):
                for s in s_dev:
                    s[...] = dev(s_h)
            saved = step[0]
            ref_w, ref_slots = [w0.copy()], [[s.copy()] for s in slots_h]
            call(ref_be, ref_w, ref_slots, g_h)
            step[0] = saved
            call(backend, copies, slots, grad)
            wrong = sum(count_wrong(c, ref_w[0], exact=exact) for c in copies)
            for s_dev, s_ref in zip(slots, ref_slots):
                wrong += sum(count_wrong(s, s_ref[0], exact=exact) for s in s_dev)
            return wrong

        return Case(lambda: call(backend, copies, slots, grad), check)

    raise ValueError(f"unknown operation {op!r}; expected one of {', '.join(OPS)}")
