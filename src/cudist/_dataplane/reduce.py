"""The reductions of the data plane: one entry per verb, each trying the fast host path first.

* :func:`all_reduce` -- the one all-reduce (``out[r][j]``: every replica its own result). In this one
  place, in order: the native host call that checks and reduces in one pass; the structure checks;
  host leaves of kernel dtypes reduced once into pooled buffers (each replica a view); then the
  general path, packed per replica on its own device, GPU packs all-reduced by a ``reducer`` (NCCL
  plugs in there) or the backend's fused kernel. :func:`all_reduce_arrays` is the same entry for
  one leaf per replica (the per-step common case, kept short).
* :func:`all_reduce_via_one` -- the same result as reduce-to-one-device then broadcast
  (``ReductionToOneDevice``);
* :func:`batch_reduce` -- one result per leaf (``out[j]``), for ``reduce_to`` / ``batch_reduce_to``;
  :func:`reduce_arrays` -- one leaf's reduce-to-one;
* :func:`gather_arrays` -- the all-gather's concatenation.

Integer MEAN is a true division, as TF's ``x / n`` on integer tensors: float32 for 8- and 16-bit
integers, float64 for wider ones (:func:`cudist._reduce_util.int_mean_dtype`). The cross-device ops
(:mod:`cudist._cross_device_ops`) choose which of these their algorithm is; the packing is
:mod:`.packing`'s, the result buffers :mod:`.pool`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from cudist._arrays import Array, contiguous, device_context, is_device_array, like, to_host
from cudist._dataplane import packing, pool
from cudist._dataplane.packing import LeafPaths, Reducer
from cudist._kernels import KernelBackend, backend_for, cpu_backend, numpy_backend
from cudist._reduce_util import ReduceOp, int_mean_dtype
from cudist.errors import InvalidArgumentError

__all__ = [
    "ReducerFor",
    "all_reduce",
    "all_reduce_arrays",
    "all_reduce_via_one",
    "batch_reduce",
    "reduce_arrays",
    "gather_arrays",
]

#: ``reducer_for(per_replica_leaves)``: the :data:`~.packing.Reducer` for GPU packs of these leaves
#: (None: the backend's kernel). Asked only when the general path runs: host leaves never load NCCL.
ReducerFor = Callable[[Sequence[Sequence[Any]]], "Reducer | None"]


def all_reduce(
    op: ReduceOp,
    per_replica_leaves: Sequence[Sequence[Any]],
    *,
    num_packs: int = 1,
    reducer_for: ReducerFor | None = None,
    paths: LeafPaths | None = None,
) -> list[list[Array]]:
    """The all-reduce: ``out[r][j]`` is leaf ``j`` reduced over the replicas, replica ``r``'s own result.

    Args:
        op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``.
        per_replica_leaves: ``per_replica_leaves[r][j]`` is leaf ``j`` (an array) of replica ``r``.
        num_packs: how many kernel calls per dtype (0: one per leaf).
        reducer_for: the GPU packs' reducer (see :data:`ReducerFor`); None: the backend's kernel.
        paths: the leaves' names, for errors.

    Returns:
        New arrays; host results are read-only views of one pooled result (TF's results are
        immutable), GPU results one buffer per replica on its own device.

    Raises:
        InvalidArgumentError: the replicas' shapes or dtypes differ (the message names the leaf).
        TypeError: a dtype that cannot be summed.
    """
    n = len(per_replica_leaves)
    if n > 1 and num_packs == 1:
        shared = cpu_backend().trusted.batch_reduce_to_one_shared
        if shared is not None:
            # The native call checks the leaves (host arrays of one kernel dtype, one shape per leaf,
            # C-contiguous, not an integer MEAN), then takes its output from the pool; None: not for it.
            checked: list[list[Array]] | None = shared(per_replica_leaves, op, pool.take)
            if checked is not None:
                return checked
    packing.check_same_leaves("all_reduce", per_replica_leaves, paths)
    if n > 1:
        host = _host_all_reduce(op, per_replica_leaves, num_packs)
        if host is not None:
            return host
    reducer = None if reducer_for is None else reducer_for(per_replica_leaves)
    return _packed_all_reduce("all_reduce", op, per_replica_leaves, num_packs, reducer)


def all_reduce_arrays(
    op: ReduceOp, arrays: Sequence[Any], *, num_packs: int = 1, reducer_for: ReducerFor | None = None
) -> list[Array]:
    """:func:`all_reduce` of one array per replica: ``out[r]`` (same results, same errors).

    Host arrays of one kernel dtype and shape take a short path (one reduce-to-one pass into a pooled
    result, each replica a view; the native backend checks them in the same call); anything else,
    and any mismatch (which it reports), goes through :func:`all_reduce`.
    """
    a0 = arrays[0]
    if type(a0) is np.ndarray and len(arrays) > 1:
        b = cpu_backend()
        shared = b.trusted.reduce_to_one_shared
        if shared is not None:  # the native backend checks, takes its output from the pool, reduces, makes the views
            out: list[Array] | None = shared(arrays, op, pool.take)
            if out is not None:
                return out
        shape, dtype = a0.shape, a0.dtype
        if dtype in b.dtypes and all(type(a) is np.ndarray and a.shape == shape and a.dtype == dtype for a in arrays):
            return _reduce_one_leaf(b.trusted, op, arrays)
    return [o[0] for o in all_reduce(op, [[a] for a in arrays], num_packs=num_packs, reducer_for=reducer_for)]


def all_reduce_via_one(
    where: str, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], *, num_packs: int = 1
) -> list[list[Array]]:
    """The all-reduce as reduce-to-one-device (the first replica's) then broadcast."""
    n = len(per_replica_leaves)
    ref = per_replica_leaves[0]
    outs: list[list[Any]] = [[None] * len(ref) for _ in range(n)]
    for ids, bufs, b, kop, int_mean in packing.packs(where, op, per_replica_leaves, num_packs):
        xp = backend_for(bufs[0]).xp
        if n > 1:
            with device_context(bufs[0]):  # the reduction happens on the first replica's device
                red = b.reduce_to_one(bufs, kop) if b is not None else reduce_arrays(where, bufs, kop)
                if int_mean:
                    red = _int_mean(xp, red, n)
            if int_mean:
                bufs = [red] + [like(red, buf, copy=True) for buf in bufs[1:]]
            elif b is not None:
                b.broadcast(red, bufs)
            else:
                for buf in bufs:
                    xp.copyto(buf, red)
        elif int_mean:
            bufs = _divide(xp, bufs, n)
        packing.unpack_all(ref, ids, bufs, outs)
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
    for ids, bufs, b, kop, int_mean in packing.packs(where, op, per_replica_leaves, num_packs):
        if b is None or n == 1:
            red = reduce_arrays(where, bufs, op)
        else:
            with device_context(bufs[0]):
                red = b.reduce_to_one(bufs, kop)
                if int_mean:
                    red = _int_mean(b.xp, red, n)
        off = 0
        for j in ids:
            outs[j] = red[off : off + ref[j].size].reshape(ref[j].shape)
            off += ref[j].size
    return outs


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
    packing.check_reducible(where, dt)
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
                packing.kernel_backend(arrs[0], dt)  # raises, naming the dtype, if the GPU kernels lack it
                out = b.reduce_to_one([contiguous(a) for a in arrs], kop)
            if int_mean:
                out = _int_mean(xp, out, len(arrs))
        return out
    if len(arrs) == 1:
        out = np.array(arrs[0], copy=True)
    else:
        b = packing.kernel_backend(arrs[0], dt)
        if b is not None:
            out = b.reduce_to_one([contiguous(a) for a in arrs], kop)
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


def _replica_views(v: Any, n: int) -> list[Any]:
    """One read-only result per replica, distinct objects (as TF's tensors are) sharing ``v``'s memory;
    a NumPy scalar (a 0-d integer MEAN) is copied instead, immutable anyway."""
    if type(v) is not np.ndarray:
        return [v.copy() for _ in range(n)]
    return [v] + [v.view() for _ in range(n - 1)]


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
    if set(map(type, ref)) != {np.ndarray} or not set(map(packing.dtype_of, ref)) <= set(b.dtypes):
        return None
    trusted = b.trusted
    if len(ref) == 1:  # the common case, kept short: one array per replica
        return [[v] for v in _reduce_one_leaf(trusted, op, [p[0] for p in per_replica_leaves])]
    row0: list[Any] = [None] * len(ref)  # replica 0's results; the others get views of them
    scalars = False
    for dt, ids, total, kop, int_mean in packing.pack_plan(op, ref, num_packs, by_memory=False):
        pack_ins = [[a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in (leaves[j] for j in ids)]
                    for leaves in per_replica_leaves]
        buf = pool.take((total,), dt)
        trusted.batch_reduce_to_one(pack_ins, kop, buf)
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


def _packed_all_reduce(
    where: str, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], num_packs: int, reducer: Reducer | None
) -> list[list[Array]]:
    """:func:`all_reduce`'s general path (leaves checked): each replica's leaves packed on its own
    device, each pack all-reduced in place by ``reducer(backend, bufs, op)`` (GPU packs; SUM or float
    MEAN) or the backend's fused kernel, then unpacked."""
    n = len(per_replica_leaves)
    ref = per_replica_leaves[0]
    outs: list[list[Any]] = [[None] * len(ref) for _ in range(n)]
    for ids, bufs, b, kop, int_mean in packing.packs(where, op, per_replica_leaves, num_packs):
        xp = backend_for(bufs[0]).xp
        if n > 1:
            if b is None:  # a host dtype outside the kernel contract
                red = reduce_arrays(where, bufs, kop)
                for buf in bufs:
                    np.copyto(buf, red)
            elif reducer is not None and b.xp is not np:
                reducer(b, bufs, kop)
            else:
                b.all_reduce(bufs, kop)
        if int_mean:
            bufs = _divide(xp, bufs, n)
        packing.unpack_all(ref, ids, bufs, outs)
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
                return b.all_gather(arrs, axis)
            # Validated like a kernel call (shapes, axis), then concatenated by CuPy.
            numpy_backend().all_gather([np.zeros(a.shape, np.float32) for a in arrs], axis)
            return xp.concatenate([like(a, arrs[0]) for a in arrs], axis=axis)  # cross-GPU copies ordered
    arrs = [contiguous(to_host(a)) for a in arrs]
    b = cpu_backend()
    if arrs[0].dtype not in b.dtypes:
        b = numpy_backend()
    if arrs[0].dtype in b.dtypes:
        return b.all_gather(arrs, axis)
    numpy_backend().all_gather([np.zeros(a.shape, np.float32) for a in arrs], axis)
    return np.concatenate(arrs, axis=axis)
