"""Reductions of per-replica leaves through the kernel contract, packing leaves of one dtype together.

A batch of values is *packed*: all leaves of one dtype go to one kernel call per replica buffer, so
a hundred small gradients cost one fused call instead of a hundred. ``num_packs`` splits that into
several calls (TF's knob); 0 means one call per leaf. Host leaves and GPU leaves are handled
separately (a nest may hold a Python number next to CuPy arrays); each GPU replica's buffer is
allocated on that replica's GPU.

Three forms, one per cross-device algorithm:

* :func:`all_reduce` -- every replica gets its own result (``out[r][j]``); GPU buffers may be
  all-reduced by a ``reducer`` (NCCL plugs in there);
* :func:`all_reduce_via_one` -- the same, as reduce-to-one-device then broadcast
  (``ReductionToOneDevice``);
* :func:`batch_reduce` -- one result per leaf (``out[j]``), for ``reduce_to`` / ``batch_reduce_to``.

Integer MEAN is a true division, as TF's ``x / n`` on integer tensors: float32 for 8- and 16-bit
integers, float64 for wider ones (:func:`cudist._reduce_util.int_mean_dtype`).
"""

from __future__ import annotations

import operator

from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, Protocol, TypeAlias

import numpy as np
import optree

from cudist._arrays import Array, contiguous, device_context, is_device_array, like, to_host
from cudist.errors import InvalidArgumentError
from cudist._dataplane import pool
# cudist._kernels is not annotated yet: calls into it carry `type: ignore[no-untyped-call]`.
from cudist._kernels import KernelBackend, backend_for, cpu_backend, numpy_backend
from cudist._reduce_util import ReduceOp, int_mean_dtype

__all__ = [
    "all_reduce_arrays",
    "all_reduce",
    "all_reduce_via_one",
    "batch_reduce",
    "reduce_arrays",
    "gather_arrays",
    "check_same_leaves",
    "host_all_reduce_checked",
    "pack_groups",
    "tree_leaves_with_paths",
]

#: ``reducer(backend, bufs, op)``: all-reduces packed GPU buffers (one per replica) in place, in
#: place of ``backend``'s own kernel (NCCL plugs in here; see :func:`all_reduce`).
Reducer: TypeAlias = "Callable[[KernelBackend, list[Any], ReduceOp], None]"


class LeafPaths(Protocol):
    """Names of the leaves of a nest, by leaf index (a list of str, or one computed on demand)."""

    def __getitem__(self, j: int, /) -> str: ...


def check_reducible(where: str, dtype: np.dtype[Any]) -> None:
    """Raises TypeError unless ``dtype`` can be summed."""
    if dtype.kind not in "iufc":
        raise TypeError(f"{where}: cannot reduce values of dtype {dtype} (only numeric dtypes can be summed)")


_shape_dtype = operator.attrgetter("shape", "dtype")
_dtype_of = operator.attrgetter("dtype")


def check_same_leaves(
    where: str, per_replica_leaves: Sequence[Sequence[Any]], paths: LeafPaths | None = None
) -> None:
    """Raises InvalidArgumentError (a ValueError; TF's error for a collective's shape mismatch) naming
    the replicas and leaf whose shapes or dtypes differ from replica 0's.

    Args:
        where: the caller's name, for the message.
        per_replica_leaves: ``per_replica_leaves[r][j]`` is leaf ``j`` (an array) of replica ``r``.
        paths: the leaves' names, for the message (else they are numbered).
    """
    ref = per_replica_leaves[0]
    sig0 = list(map(_shape_dtype, ref))
    for r, leaves in enumerate(per_replica_leaves[1:], 1):
        if len(leaves) != len(ref):
            raise InvalidArgumentError(f"{where}: replica {r} passed {len(leaves)} values but replica 0 passed {len(ref)}")
        if list(map(_shape_dtype, leaves)) == sig0:
            continue  # the common case: one list comparison
        for j, (a, b) in enumerate(zip(ref, leaves)):
            if a.shape != b.shape or a.dtype != b.dtype:
                name = f" at {paths[j]!r}" if paths and paths[j] else (f" (value {j})" if len(ref) > 1 else "")
                raise InvalidArgumentError(
                    f"{where}: replicas disagree{name}: replica 0 has shape {a.shape} dtype {a.dtype}, "
                    f"replica {r} has shape {b.shape} dtype {b.dtype}; every replica must pass the same shapes and dtypes"
                )


def tree_leaves_with_paths(tree: Any) -> tuple[list[Any], optree.PyTreeSpec, list[str]]:
    """(leaves, treespec, paths) of a nest (None is an empty node, as in optree.tree_flatten)."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    return leaves, spec, ["/".join(str(p) for p in path) for path in paths]


def pack_groups(sizes: Sequence[int], num_packs: int) -> list[list[int]]:
    """Splits leaf indices (in order) into ``num_packs`` contiguous groups of about equal total size.

    Args:
        sizes: each leaf's size (elements).
        num_packs: how many groups; 0 or less: one group per leaf.
    """
    idx = list(range(len(sizes)))
    if num_packs <= 0:
        return [[i] for i in idx]
    if num_packs == 1 or len(idx) <= 1:
        return [idx]
    k = min(num_packs, len(idx))
    total = sum(sizes) or 1
    groups: list[list[int]]
    cur: list[int]
    groups, cur, acc = [], [], 0
    for i in idx:
        cur.append(i)
        acc += sizes[i]
        remaining_groups = k - len(groups) - 1
        if remaining_groups > 0 and (acc >= total * (len(groups) + 1) / k or len(idx) - i - 1 == remaining_groups):
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    return groups


def _kernel_backend(a: Any, dt: np.dtype[Any]) -> KernelBackend | None:
    """The backend that reduces buffers like ``a`` of dtype ``dt``; None for host dtypes outside the contract."""
    b = backend_for(a)
    if dt in b.dtypes:
        return b
    if b.xp is not np:
        raise TypeError(f"all_reduce: dtype {dt} is not supported by the GPU kernels")
    b = numpy_backend()
    return b if dt in b.dtypes else None


def reduce_arrays(where: str, arrs: Sequence[Any], op: ReduceOp) -> Array:
    """Reduces same-shape arrays in replica order into a new array (SUM, or MEAN as TF computes it).

    Args:
        where: the caller's name, for error messages.
        arrs: one array per replica (all NumPy, or all GPU arrays), one shape and dtype.
        op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``.

    Returns:
        A new array on the first array's device.
    """
    b: KernelBackend | None
    dt = arrs[0].dtype
    check_reducible(where, dt)
    int_mean = op is ReduceOp.MEAN and dt.kind in "iu"
    kop = ReduceOp.SUM if int_mean else op
    if is_device_array(arrs[0]):
        # GPU arrays: reduced by the CUDA kernels on the first array's GPU (the others are read over
        # peer access or staged there by the backend).
        b = backend_for(arrs[0])
        xp = b.xp
        with device_context(arrs[0]):
            if len(arrs) == 1:
                out = arrs[0].copy()
            else:
                _kernel_backend(arrs[0], dt)  # raises, naming the dtype, if the GPU kernels lack it
                out = b.reduce_to_one([contiguous(a) for a in arrs], kop)  # type: ignore[no-untyped-call]
            if int_mean:
                out = _int_mean(xp, out, len(arrs))
        return out
    if len(arrs) == 1:
        out = np.array(arrs[0], copy=True)
    else:
        b = _kernel_backend(arrs[0], dt)
        if b is not None:
            out = b.reduce_to_one([contiguous(a) for a in arrs], kop)  # type: ignore[no-untyped-call]
        else:  # numeric dtypes outside the kernel contract (int8, uint*, complex): plain numpy
            out = np.array(arrs[0], copy=True)
            for a in arrs[1:]:
                np.add(out, a, out=out)
            if kop is ReduceOp.MEAN:
                out = out / out.dtype.type(len(arrs))
    if int_mean:
        out = _int_mean(np, out, len(arrs))
    return out


def _int_mean(xp: ModuleType, total: Any, n: int) -> Array:
    """An integer sum divided by ``n`` in TF's true-division dtype (float32 for 8/16-bit integers)."""
    return xp.true_divide(total, n, dtype=int_mean_dtype(total.dtype))


def _divide(xp: ModuleType, bufs: Sequence[Any], n: int) -> list[Array]:
    """Integer MEAN: each replica's sum / n as TF's ``x / n`` gives it, computed on its own device."""
    if xp is np:
        return [_int_mean(np, buf, n) for buf in bufs]
    out: list[Array] = []
    for buf in bufs:
        with device_context(buf):
            out.append(_int_mean(xp, buf, n))
    return out


def _pack_plan(
    op: ReduceOp, ref: Sequence[Any], num_packs: int, *, by_memory: bool
) -> Iterator[tuple[np.dtype[Any], list[int], int, ReduceOp, bool]]:
    """Yields (dtype, leaf ids, total elements, kernel op, int_mean) for each pack of ``ref``'s leaves.

    Leaves are grouped by dtype (and, ``by_memory``, host apart from GPU), then split into
    ``num_packs`` packs (:func:`pack_groups`). Integer MEAN packs are summed (then divided).
    """
    groups: dict[tuple[bool, np.dtype[Any]], list[int]] = {}
    dtypes = set(map(_dtype_of, ref))
    if len(dtypes) == 1 and not (by_memory and any(map(is_device_array, ref))):
        groups[(False, dtypes.pop())] = list(range(len(ref)))  # the common case: one host dtype
    else:
        for j, a in enumerate(ref):
            groups.setdefault((by_memory and is_device_array(a), a.dtype), []).append(j)
    for (_, dt), leaf_ids in groups.items():
        int_mean = op is ReduceOp.MEAN and dt.kind in "iu"
        kop = ReduceOp.SUM if int_mean else op
        sizes = [ref[j].size for j in leaf_ids]
        for group in pack_groups(sizes, num_packs):
            yield dt, [leaf_ids[g] for g in group], sum(sizes[g] for g in group), kop, int_mean


def _packs(
    where: str, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], num_packs: int
) -> Iterator[tuple[list[int], list[Any], KernelBackend | None, ReduceOp, bool]]:
    """Yields (leaf ids, per-replica packed copies, backend or None, kernel op, int_mean) per pack.

    Each replica's pack is a fresh flat buffer on that replica's device holding its leaves ``ids``.
    """
    ref = per_replica_leaves[0]
    for dt, ids, total, kop, int_mean in _pack_plan(op, ref, num_packs, by_memory=True):
        check_reducible(where, dt)
        b = _kernel_backend(ref[ids[0]], dt)
        xp = backend_for(ref[ids[0]]).xp
        bufs: list[Any] = []
        for leaves in per_replica_leaves:
            with device_context(leaves[ids[0]]):  # each replica's buffer on its own device
                if len(ids) == 1:
                    buf = xp.array(leaves[ids[0]], dtype=dt, copy=True, order="C").reshape(-1)
                else:
                    buf = xp.empty(total, dtype=dt)
                    off = 0
                    for j in ids:
                        s = leaves[j].size
                        # like(): a replica's leaf on another GPU is copied here first, that copy
                        # ordered after the leaf's GPU's writes and before its later ones (a bare
                        # asarray() would be an unordered cross-device copy); host leaves uploaded
                        buf[off : off + s] = (leaves[j] if xp is np else like(leaves[j], buf)).reshape(-1)
                        off += s
            bufs.append(buf)
        yield ids, bufs, b, kop, int_mean


def _unpack_all(ref: Sequence[Any], ids: Sequence[int], results: Sequence[Any], outs: list[list[Any]]) -> None:
    off = 0
    for j in ids:
        shape, s = ref[j].shape, ref[j].size
        for r, res in enumerate(results):
            outs[r][j] = res[off : off + s].reshape(shape)
        off += s


def all_reduce(
    where: str,
    op: ReduceOp,
    per_replica_leaves: Sequence[Sequence[Any]],
    *,
    num_packs: int = 1,
    reducer: Reducer | None = None,
) -> list[list[Array]]:
    """All-reduces ``per_replica_leaves[r][j]`` (leaf j of replica r): ``out[r][j]``, new arrays.

    The shapes and dtypes must agree across replicas (:func:`check_same_leaves`). Host leaves of a
    kernel dtype are reduced out of place in one pass, straight from the inputs into pooled result
    buffers (:mod:`.pool`): no staging copy, no fresh pages per step. ``reducer(backend, bufs, op)``
    all-reduces packed GPU buffers in place (SUM or float MEAN); None: the backend's fused kernel.
    """
    n = len(per_replica_leaves)
    ref = per_replica_leaves[0]
    if n > 1:
        host = _host_all_reduce(op, per_replica_leaves, num_packs)
        if host is not None:
            return host
    outs: list[list[Any]] = [[None] * len(ref) for _ in range(n)]
    for ids, bufs, b, kop, int_mean in _packs(where, op, per_replica_leaves, num_packs):
        xp = backend_for(bufs[0]).xp
        if n > 1:
            if b is None:  # a host dtype outside the kernel contract
                red = reduce_arrays(where, bufs, kop)
                for buf in bufs:
                    np.copyto(buf, red)
            elif reducer is not None and b.xp is not np:
                reducer(b, bufs, kop)
            else:
                b.all_reduce(bufs, kop)  # type: ignore[no-untyped-call]
        if int_mean:
            bufs = _divide(xp, bufs, n)
        _unpack_all(ref, ids, bufs, outs)
    return outs


def _replica_views(v: Any, n: int) -> list[Any]:
    """One read-only result per replica, distinct objects (as TF's tensors are) sharing ``v``'s memory;
    a NumPy scalar (a 0-d integer MEAN) is copied instead, immutable anyway."""
    if type(v) is not np.ndarray:
        return [v.copy() for _ in range(n)]
    return [v] + [v.view() for _ in range(n - 1)]


def all_reduce_arrays(op: ReduceOp, arrays: Sequence[Any]) -> list[Array] | None:
    """:func:`all_reduce` of one host array per replica (the per-step common case), kept short.

    Returns:
        ``out[r]``, read-only results as :func:`all_reduce` makes them; None when the general path
        must take the call (fewer than 2 replicas, a non-host array, a dtype outside the kernels,
        or shapes or dtypes that differ, which the general path reports).
    """
    a0 = arrays[0]
    if type(a0) is not np.ndarray or len(arrays) < 2:
        return None
    b = cpu_backend()
    shared = b.trusted.reduce_to_one_shared
    if shared is not None:  # the native backend checks, takes its output from the pool, reduces, makes the views
        out = shared(arrays, op, pool.take)
        if out is not None:
            return out  # type: ignore[no-any-return]
    shape, dtype = a0.shape, a0.dtype
    for a in arrays:
        if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
            return None
    if dtype not in b.dtypes:
        return None
    return _reduce_one_leaf(b.trusted, op, arrays)


def _reduce_one_leaf(trusted: Any, op: ReduceOp, arrays: Sequence[Any]) -> list[Any]:
    """One host leaf per replica (same shape, kernel dtype), all-reduced once into a shared pooled
    result: read-only, one view per replica (distinct objects, as TF's tensors are)."""
    a0 = arrays[0]
    n = len(arrays)
    ins = list(arrays)
    for i, a in enumerate(ins):
        if not a.flags.c_contiguous:
            ins[i] = np.ascontiguousarray(a)
    out = pool.take(a0.shape, a0.dtype)
    if op is ReduceOp.MEAN and a0.dtype.kind in "iu":
        trusted.reduce_to_one(ins, ReduceOp.SUM, out)
        out = _int_mean(np, out, n)  # a fresh float array (a NumPy scalar for 0-d)
        if type(out) is not np.ndarray:
            return _replica_views(out, n)
    else:
        trusted.reduce_to_one(ins, op, out)
    out.flags.writeable = False
    return [out] + [out.view() for _ in range(n - 1)]


def host_all_reduce_checked(
    op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], num_packs: int
) -> list[list[Array]] | None:
    """:func:`all_reduce` of host leaves in one native call that also checks them (the native
    backend's ``batch_reduce_to_one_shared``): results as :func:`_host_all_reduce` makes them.

    None, doing nothing, unless there are at least 2 replicas of host arrays of one kernel dtype,
    leaf ``j`` of one shape and that dtype in every replica, all C-contiguous, one pack, not an
    integer MEAN, and the backend has the call; the caller then checks the leaves
    (:func:`check_same_leaves`) and reduces them the general way.
    """
    if len(per_replica_leaves) < 2 or num_packs != 1:
        return None
    shared = cpu_backend().trusted.batch_reduce_to_one_shared
    if shared is None:
        return None
    # The native call checks the leaves, then takes its output from the pool (pool.take(shape, dtype)).
    out: list[list[Array]] | None = shared(per_replica_leaves, op, pool.take)
    return out


def _host_all_reduce(
    op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], num_packs: int
) -> list[list[Array]] | None:
    """The user's hot path: host leaves of kernel dtypes, reduced out of place into pooled buffers.

    Every replica's result of a host all-reduce is the same value in the same (host) memory, so it
    is computed once: one batched reduce-to-one pass per dtype (and pack) reads the N inputs of
    every leaf and writes the results back to back into one pooled buffer, (N+1)·S bytes (an
    all-reduce into N outputs moves 2·N·S), and each replica gets views of it. The results are
    read-only, as TF's results are immutable tensors (``np.array(result)`` gives a writable copy).
    None when some leaf is not a host array of a kernel dtype (the general path then takes them all).
    """
    b = cpu_backend()
    ref = per_replica_leaves[0]
    n = len(per_replica_leaves)
    if set(map(type, ref)) != {np.ndarray} or not set(map(_dtype_of, ref)) <= set(b.dtypes):
        return None
    trusted = b.trusted
    if len(ref) == 1:  # the common case, kept short: one array per replica
        return [[v] for v in _reduce_one_leaf(trusted, op, [p[0] for p in per_replica_leaves])]
    row0: list[Any] = [None] * len(ref)  # replica 0's results; the others get views of them
    scalars = False
    for dt, ids, total, kop, int_mean in _pack_plan(op, ref, num_packs, by_memory=False):
        pack_ins = [[a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in (leaves[j] for j in ids)]
                    for leaves in per_replica_leaves]
        buf = pool.take((total,), dt)
        trusted.batch_reduce_to_one(pack_ins, kop, buf)  # type: ignore[no-untyped-call]
        del pack_ins
        if int_mean:
            buf = _int_mean(np, buf, n)
        # Read-only before the views are taken: every view of it is then read-only too.
        buf.flags.writeable = False
        off = 0
        for j in ids:
            a = ref[j]
            shape, size = a.shape, a.size
            if int_mean and not shape:
                row0[j] = buf[off]  # a 0-d integer MEAN is a NumPy scalar, as the one-leaf path gives it
                scalars = True
            elif len(shape) == 1:
                row0[j] = buf[off : off + size]
            else:
                row0[j] = buf[off : off + size].reshape(shape)
            off += size
    if scalars:
        return [row0] + [[v.view() if type(v) is np.ndarray else v.copy() for v in row0] for _ in range(n - 1)]
    return [row0] + [[v.view() for v in row0] for _ in range(n - 1)]


def all_reduce_via_one(
    where: str, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], *, num_packs: int = 1
) -> list[list[Array]]:
    """:func:`all_reduce` as reduce-to-one-device (the first replica's) then broadcast."""
    n = len(per_replica_leaves)
    ref = per_replica_leaves[0]
    outs: list[list[Any]] = [[None] * len(ref) for _ in range(n)]
    for ids, bufs, b, kop, int_mean in _packs(where, op, per_replica_leaves, num_packs):
        xp = backend_for(bufs[0]).xp
        if n > 1:
            with device_context(bufs[0]):  # the reduction happens on the first replica's device
                red = b.reduce_to_one(bufs, kop) if b is not None else reduce_arrays(where, bufs, kop)  # type: ignore[no-untyped-call]
                if int_mean:
                    red = _int_mean(xp, red, n)
            if int_mean:
                bufs = [red] + [like(red, buf, copy=True) for buf in bufs[1:]]
            elif b is not None:
                b.broadcast(red, bufs)  # type: ignore[no-untyped-call]
            else:
                for buf in bufs:
                    xp.copyto(buf, red)
        elif int_mean:
            bufs = _divide(xp, bufs, n)
        _unpack_all(ref, ids, bufs, outs)
    return outs


def batch_reduce(
    where: str, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], *, num_packs: int = 1
) -> list[Array]:
    """Reduces ``per_replica_leaves[r][j]`` over replicas: ``out[j]``, one fresh array per leaf.

    Args:
        where: the caller's name, for error messages.
        op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``.
        per_replica_leaves: ``per_replica_leaves[r][j]`` is leaf ``j`` of replica ``r``.
        num_packs: how many kernel calls per dtype (0: one per leaf).
    """
    n = len(per_replica_leaves)
    ref = per_replica_leaves[0]
    outs: list[Any] = [None] * len(ref)
    for ids, bufs, b, kop, int_mean in _packs(where, op, per_replica_leaves, num_packs):
        if b is None or n == 1:
            red = reduce_arrays(where, bufs, op)
        else:
            with device_context(bufs[0]):
                red = b.reduce_to_one(bufs, kop)  # type: ignore[no-untyped-call]
                if int_mean:
                    red = _int_mean(b.xp, red, n)
        off = 0
        for j in ids:
            outs[j] = red[off : off + ref[j].size].reshape(ref[j].shape)
            off += ref[j].size
    return outs


def _check_gather_shapes(arrs: Sequence[Any], axis: int) -> None:
    ndim = arrs[0].ndim
    if not ndim or not -ndim <= axis < ndim:
        return  # the kernel contract's own checks name these
    axis = int(axis) % ndim
    ref = arrs[0].shape
    for i, a in enumerate(arrs[1:], 1):
        if a.ndim != ndim or any(a.shape[d] != ref[d] for d in range(ndim) if d != axis):
            raise InvalidArgumentError(
                f"all_gather: replica {i} has shape {a.shape}, which differs from replica 0's {ref} "
                f"outside the gather axis {axis}"
            )


def gather_arrays(arrs: Sequence[Any], axis: int) -> Array:
    """Concatenates per-replica arrays (same dtype) along ``axis`` in replica order into a new array.

    Host arrays go through the CPU backend (the NumPy reference for dtypes outside the kernel
    contract); GPU arrays through the CuPy backend, the result on the first array's GPU.

    Raises:
        InvalidArgumentError: (a ValueError, as TF) the arrays differ in rank, or in shape outside ``axis``.
        ValueError: ``axis`` is out of range, or the arrays are 0-d.
    """
    _check_gather_shapes(arrs, axis)
    if is_device_array(arrs[0]) and all(is_device_array(a) for a in arrs):
        b = backend_for(arrs[0])
        xp = b.xp
        with device_context(arrs[0]):
            if arrs[0].dtype in b.dtypes:
                return b.all_gather(arrs, axis)  # type: ignore[no-untyped-call]
            # Validated like a kernel call (shapes, axis), then concatenated by CuPy.
            numpy_backend().all_gather([np.zeros(a.shape, np.float32) for a in arrs], axis)  # type: ignore[no-untyped-call]
            return xp.concatenate([like(a, arrs[0]) for a in arrs], axis=axis)  # cross-GPU copies ordered
    arrs = [contiguous(to_host(a)) for a in arrs]
    b = cpu_backend()
    if arrs[0].dtype not in b.dtypes:
        b = numpy_backend()
    if arrs[0].dtype in b.dtypes:
        return b.all_gather(arrs, axis)  # type: ignore[no-untyped-call]
    numpy_backend().all_gather([np.zeros(a.shape, np.float32) for a in arrs], axis)  # type: ignore[no-untyped-call]
    return np.concatenate(arrs, axis=axis)
