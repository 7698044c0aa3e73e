"""Packing per-replica leaves for the reductions of :mod:`.reduce`, and the checks they share.

A batch of values is *packed*: all leaves of one dtype go to one kernel call per replica buffer, so
a hundred small gradients cost one fused call instead of a hundred. ``num_packs`` splits that into
several calls (TF's knob); 0 means one call per leaf. Host leaves and GPU leaves are handled
separately (a nest may hold a Python number next to CuPy arrays); each GPU replica's buffer is
allocated on that replica's GPU.

Here: the plan (:func:`pack_plan`, :func:`pack_groups`), the packed copies (:func:`packs`) and the
way back (:func:`unpack_all`), which backend reduces a dtype (:func:`kernel_backend`), and the
structure checks every reduction makes (:func:`check_same_leaves`, :func:`check_reducible`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeAlias

import numpy as np
import optree

from cudist._arrays import device_context, is_device_array, like
from cudist.errors import InvalidArgumentError
from cudist._kernels import KernelBackend, backend_for, is_bfloat16, numpy_backend
from cudist._reduce_util import ReduceOp

__all__ = [
    "LeafPaths",
    "Reducer",
    "check_reducible",
    "check_same_leaves",
    "dtype_of",
    "kernel_backend",
    "pack_groups",
    "pack_plan",
    "packs",
    "tree_leaves_with_paths",
    "unpack_all",
]

#: ``reducer(backend, bufs, op)``: all-reduces packed GPU buffers (one per replica) in place, in
#: place of ``backend``'s own kernel (NCCL plugs in here; see :func:`cudist._dataplane.reduce.all_reduce`).
Reducer: TypeAlias = "Callable[[KernelBackend, list[Any], ReduceOp], None]"


class LeafPaths(Protocol):
    """Names of the leaves of a nest, by leaf index (a list of str, or one computed on demand)."""

    def __getitem__(self, j: int, /) -> str: ...


def check_reducible(where: str, dtype: np.dtype[Any]) -> None:
    """Raises TypeError unless ``dtype`` can be summed (bfloat16, NumPy kind "V", can)."""
    if dtype.kind not in "iufc" and not is_bfloat16(dtype):
        raise TypeError(f"{where}: cannot reduce values of dtype {dtype} (only numeric dtypes can be summed)")


_shape_dtype = operator.attrgetter("shape", "dtype")
dtype_of = operator.attrgetter("dtype")


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


def kernel_backend(a: Any, dt: np.dtype[Any]) -> KernelBackend | None:
    """The backend that reduces buffers like ``a`` of dtype ``dt``; None for host dtypes outside the contract."""
    b = backend_for(a)
    if b.computes(dt):
        return b
    if b.xp is not np:
        raise TypeError(f"all_reduce: dtype {dt} is not supported by the GPU kernels")
    b = numpy_backend()  # the reference backend also computes bfloat16 (float32 accumulation)
    return b if b.computes(dt) else None


def pack_plan(
    op: ReduceOp, ref: Sequence[Any], num_packs: int, *, by_memory: bool
) -> Iterator[tuple[np.dtype[Any], list[int], int, ReduceOp, bool]]:
    """Yields (dtype, leaf ids, total elements, kernel op, int_mean) for each pack of ``ref``'s leaves.

    Leaves are grouped by dtype (and, ``by_memory``, host apart from GPU), then split into
    ``num_packs`` packs (:func:`pack_groups`). Integer MEAN packs are summed (then divided).
    """
    groups: dict[tuple[bool, np.dtype[Any]], list[int]] = {}
    dtypes = set(map(dtype_of, ref))
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


def packs(
    where: str, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], num_packs: int
) -> Iterator[tuple[list[int], list[Any], KernelBackend | None, ReduceOp, bool]]:
    """Yields (leaf ids, per-replica packed copies, backend or None, kernel op, int_mean) per pack.

    Each replica's pack is a fresh flat buffer on that replica's device holding its leaves ``ids``.
    """
    ref = per_replica_leaves[0]
    for dt, ids, total, kop, int_mean in pack_plan(op, ref, num_packs, by_memory=True):
        check_reducible(where, dt)
        b = kernel_backend(ref[ids[0]], dt)
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


def unpack_all(ref: Sequence[Any], ids: Sequence[int], results: Sequence[Any], outs: list[list[Any]]) -> None:
    off = 0
    for j in ids:
        shape, s = ref[j].shape, ref[j].size
        for r, res in enumerate(results):
            outs[r][j] = res[off : off + s].reshape(shape)
        off += s
