"""Cross-device reductions: how per-replica values are combined (``tf.distribute.CrossDeviceOps``).

Every implementation here funnels into the kernel layer (:mod:`cudist._kernels`): a batch of values is
first *packed* -- all leaves of one dtype concatenated into one flat buffer per replica -- so that a
hundred small gradients cost one fused kernel call instead of a hundred. ``num_packs`` splits that
buffer into several calls (TF's knob for overlapping communication with computation); 0 disables
packing (one call per value).

On the CPU every replica's memory is host memory, so the "devices" only decide how many copies a
result gets. GPU devices will route the same packed buffers to the CuPy backend; NCCL and P2P need GPUs
and say so clearly when given CPU devices.
"""

from __future__ import annotations

import contextlib

import numpy as np
import optree

from cudist import _devices
from cudist._reduce_util import ReduceOp
from cudist._values import DistributedValues, Mirrored

__all__ = [
    "CrossDeviceOps",
    "ReductionToOneDevice",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "P2PAllReduce",
    "KernelAllReduce",
    "select_cross_device_ops",
]

_backend_cache: dict = {}


def _cpu_backend():
    """The kernel backend for host buffers (``get_backend()``), chosen once per process.

    ``get_backend()`` reads ``CUDIST_BACKEND`` and re-probes unavailable backends on every call
    (microseconds); a collective runs at every training step, so the choice is made when the first
    collective runs. :func:`_reset_backend_cache` makes a later ``CUDIST_BACKEND`` take effect.
    """
    b = _backend_cache.get("cpu")
    if b is None:
        from cudist._kernels import get_backend

        b = _backend_cache["cpu"] = get_backend()
    return b


def _reset_backend_cache():
    """Forgets the chosen CPU backend (tests changing ``CUDIST_BACKEND`` call this)."""
    _backend_cache.clear()


def _array_module(a):
    """(array module, kernel backend) for a collective over arrays like ``a``.

    Host arrays use the CPU backend; CUDA arrays (CuPy) the ``cupy`` backend, loaded only then.
    """
    if type(a) is np.ndarray:
        return np, _cpu_backend()
    if hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray):
        from cudist._kernels import get_backend

        b = get_backend("cupy")
        return b.xp, b
    return np, _cpu_backend()


def _device_of(a):
    """A context manager making ``a``'s GPU current (CuPy allocates there); a no-op for host arrays."""
    dev = getattr(a, "device", None)
    return dev if hasattr(dev, "__enter__") else contextlib.nullcontext()


def _fallback_backend(xp, dt):
    """The backend for a dtype the preferred one lacks: the NumPy reference on the host; none on GPUs."""
    if xp is not np:
        raise TypeError(f"all_reduce: dtype {dt} is not supported by the GPU kernels")
    return _numpy_backend()


def _numpy_backend():
    from cudist._kernels import get_backend

    return get_backend("numpy")


def to_array(x):
    """``x`` as an array the kernels accept (numpy on the host; device arrays are kept)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return x
    return np.asarray(x)


def _contig(a):
    """``a`` as a C-contiguous array, keeping 0-d arrays 0-d (``np.ascontiguousarray`` makes them 1-d)."""
    return a if a.flags.c_contiguous else np.array(a, order="C")


def _check_reducible(where, dtype):
    if dtype.kind not in "iufc":
        raise TypeError(f"{where}: cannot reduce values of dtype {dtype} (only numeric dtypes can be summed)")


def _reduce_arrays(where, arrs, op):
    """Reduces same-shape arrays in replica order into a new array (SUM, or MEAN as TF computes it).

    Integer MEAN is a true division giving float64, as TF's ``x / n`` on integer tensors does.
    """
    dt = arrs[0].dtype
    _check_reducible(where, dt)
    int_mean = op is ReduceOp.MEAN and dt.kind in "iu"
    kop = ReduceOp.SUM if int_mean else op
    if len(arrs) == 1:
        out = np.array(arrs[0], copy=True)
    else:
        b = _cpu_backend()
        if dt not in b.dtypes:
            b = _numpy_backend()
        if dt in b.dtypes:
            out = b.reduce_to_one([_contig(a) for a in arrs], kop)
        else:  # numeric dtypes outside the kernel contract (int8, uint*, complex): plain numpy
            out = np.array(arrs[0], copy=True)
            for a in arrs[1:]:
                np.add(out, a, out=out)
            if kop is ReduceOp.MEAN:
                out = out / out.dtype.type(len(arrs))
    if int_mean:
        out = np.true_divide(out, len(arrs))
    return out


def check_same_leaves(where, per_replica_leaves, paths=None):
    """Raises a ValueError naming the replicas and leaf whose shapes or dtypes differ from replica 0's."""
    ref = per_replica_leaves[0]
    for r, leaves in enumerate(per_replica_leaves[1:], 1):
        if len(leaves) != len(ref):
            raise ValueError(f"{where}: replica {r} passed {len(leaves)} values but replica 0 passed {len(ref)}")
        for j, (a, b) in enumerate(zip(ref, leaves)):
            if a.shape != b.shape or a.dtype != b.dtype:
                name = f" at {paths[j]!r}" if paths and paths[j] else (f" (value {j})" if len(ref) > 1 else "")
                raise ValueError(
                    f"{where}: replicas disagree{name}: replica 0 has shape {a.shape} dtype {a.dtype}, "
                    f"replica {r} has shape {b.shape} dtype {b.dtype}; every replica must pass the same shapes and dtypes"
                )


def _pack_groups(sizes, num_packs):
    """Splits leaf indices (in order) into ``num_packs`` contiguous groups of about equal total size."""
    idx = list(range(len(sizes)))
    if num_packs <= 0 or len(idx) <= 1:
        return [[i] for i in idx] if num_packs <= 0 else [idx]
    k = min(num_packs, len(idx))
    total = sum(sizes) or 1
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


def packed_reduce(where, op, per_replica_leaves, *, num_packs=1, all_reduce=True, via_one=False):
    """Reduces lists of per-replica arrays, packing leaves of one dtype into one buffer per replica.

    Args:
        where: name used in error messages.
        op: a ReduceOp.
        per_replica_leaves: ``per_replica_leaves[r][j]`` is leaf ``j`` of replica ``r`` (arrays).
        num_packs: buffers per dtype (1: everything of a dtype in one kernel call; 0: no packing).
        all_reduce: True gives every replica its own result (``out[r][j]``); False gives one result
            per leaf (``out[j]``).
        via_one: do an all-reduce as reduce-to-one-device then broadcast (ReductionToOneDevice).

    Returns:
        ``out[r][j]`` (all_reduce) or ``out[j]`` -- views into fresh buffers, never the inputs.
    """
    n = len(per_replica_leaves)
    ref = per_replica_leaves[0]
    m = len(ref)
    if m == 1 and all_reduce and not via_one:
        return _single_all_reduce(where, op, per_replica_leaves)
    outs = [[None] * m for _ in range(n)] if all_reduce else [None] * m
    by_dtype: dict = {}
    for j, a in enumerate(ref):
        by_dtype.setdefault(a.dtype, []).append(j)
    xp, backend = _array_module(ref[0])
    for dt, leaf_ids in by_dtype.items():
        _check_reducible(where, dt)
        int_mean = op is ReduceOp.MEAN and dt.kind in "iu"
        kop = ReduceOp.SUM if int_mean else op
        b = backend if dt in backend.dtypes else _fallback_backend(xp, dt)
        use_kernel = dt in b.dtypes
        sizes = [ref[j].size for j in leaf_ids]
        for group in _pack_groups(sizes, num_packs):
            ids = [leaf_ids[g] for g in group]
            total = sum(ref[j].size for j in ids)
            bufs = []
            for r in range(n):
                leaves = per_replica_leaves[r]
                with _device_of(leaves[ids[0]]):  # each replica's buffer on its own device
                    if len(ids) == 1:
                        buf = xp.array(leaves[ids[0]], dtype=dt, copy=True, order="C").reshape(-1)
                    else:
                        buf = xp.empty(total, dtype=dt)
                        off = 0
                        for j in ids:
                            s = leaves[j].size
                            buf[off : off + s] = leaves[j].reshape(-1)
                            off += s
                bufs.append(buf)
            if not all_reduce:
                red = _reduce_arrays(where, bufs, op) if not use_kernel or n == 1 else b.reduce_to_one(bufs, kop)
                if int_mean and use_kernel and n > 1:
                    red = xp.true_divide(red, n)
                results = [red]
            elif via_one and n > 1:
                red = b.reduce_to_one(bufs, kop) if use_kernel else _reduce_arrays(where, bufs, kop)
                if int_mean:
                    red = xp.true_divide(red, n)
                    results = [red] + [red.copy() for _ in range(n - 1)]
                else:
                    if use_kernel:
                        b.broadcast(red, bufs)
                    else:
                        for buf in bufs:
                            xp.copyto(buf, red)
                    results = bufs
            else:
                if n > 1:
                    if use_kernel:
                        b._all_reduce(bufs, kop)  # fresh valid buffers: the hook, as above
                    else:
                        red = _reduce_arrays(where, bufs, kop)
                        for buf in bufs:
                            xp.copyto(buf, red)
                if int_mean:
                    bufs = [xp.true_divide(buf, n) for buf in bufs]
                results = bufs
            off = 0
            for j in ids:
                shape, s = ref[j].shape, ref[j].size
                if all_reduce:
                    for r in range(n):
                        outs[r][j] = results[r][off : off + s].reshape(shape)
                else:
                    outs[j] = results[0][off : off + s].reshape(shape)
                off += s
    return outs


def _single_all_reduce(where, op, per_replica_leaves):
    """``packed_reduce`` for one leaf per replica: the per-step common case, kept lean."""
    n = len(per_replica_leaves)
    a0 = per_replica_leaves[0][0]
    dt = a0.dtype
    shape = a0.shape
    for r in range(1, n):
        a = per_replica_leaves[r][0]
        if a.shape != shape or a.dtype != dt:
            check_same_leaves(where, per_replica_leaves)  # raises, naming the replicas
    if dt.kind not in "iufc":
        _check_reducible(where, dt)
    xp, b = _array_module(a0)
    if xp is np:
        bufs = [np.array(p[0], dtype=dt, copy=True, order="C").reshape(-1) for p in per_replica_leaves]
    else:
        bufs = []
        for p in per_replica_leaves:
            with _device_of(p[0]):
                bufs.append(xp.array(p[0], dtype=dt, copy=True, order="C").reshape(-1))
    int_mean = op is ReduceOp.MEAN and dt.kind in "iu"
    kop = ReduceOp.SUM if int_mean else op
    if n > 1:
        if dt not in b.dtypes:
            b = _fallback_backend(xp, dt)
        if dt in b.dtypes:
            # Straight to the backend's hook: these are fresh, valid buffers of one shape and dtype,
            # so the public method's checks (a few microseconds per step) are skipped.
            b._all_reduce(bufs, kop)
        else:
            red = _reduce_arrays(where, bufs, kop)
            for buf in bufs:
                np.copyto(buf, red)
    if int_mean:
        bufs = [xp.true_divide(buf, n) for buf in bufs]
    return [[buf.reshape(shape)] for buf in bufs]


def resolve_destinations(destinations, where="reduce"):
    """Canonical device names of ``destinations``: a device string, a list of them, a DistributedValues
    or variable (the devices of its components), or anything with a ``device``."""
    if destinations is None:
        raise ValueError(f"{where}: destinations must not be None")
    if isinstance(destinations, str):
        return (_devices.canonicalize(destinations),)
    if isinstance(destinations, DistributedValues):
        devs = []
        for v in destinations.values:
            d = getattr(v, "device", None)
            if isinstance(d, str) and d:
                devs.append(_devices.canonicalize(d))
        if devs:
            return tuple(devs)
        raise ValueError(f"{where}: cannot tell the devices of destinations {destinations!r}")
    if isinstance(destinations, (list, tuple)):
        if not destinations:
            raise ValueError(f"{where}: destinations must not be empty")
        return tuple(_devices.canonicalize(d) for d in destinations)
    d = getattr(destinations, "device", None)
    if isinstance(d, str) and d:
        return (_devices.canonicalize(d),)
    raise ValueError(f"{where}: invalid destinations {destinations!r}; expected a device string, a list of them, "
                     "or a distributed value or variable")


def _to_host(x):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        import cupy  # noqa: PLC0415 - only reached with GPU arrays

        return cupy.asnumpy(x)
    return np.asarray(x)


def _on_destinations(result, devices):
    """One result per destination device: the array itself for one, a Mirrored of copies for many."""
    if len(devices) == 1:
        return result
    return Mirrored([result] + [result.copy() for _ in devices[1:]])


class CrossDeviceOps:
    """Base class of cross-device reduction and broadcast algorithms.

    Subclasses choose how an all-reduce is carried out; the public methods are the same as TF's.
    """

    #: How many buffers per dtype a batch is packed into (0: no packing).
    num_packs = 1
    _via_one = False
    _needs_gpu = False

    def __repr__(self) -> str:
        return f"<cudist.{type(self).__name__} num_packs={self.num_packs}>"

    def _check_devices(self, devices):
        """Raises ValueError if this algorithm cannot run on ``devices`` (canonical names)."""
        if self._needs_gpu:
            bad = [d for d in devices if not _devices.parse_device(d).is_gpu]
            if bad:
                raise ValueError(
                    f"{type(self).__name__} needs GPU devices, but got {bad[0]!r}; use "
                    "cudist.ReductionToOneDevice() or the default cross_device_ops on CPUs"
                )

    def _values_of(self, where, value):
        if isinstance(value, DistributedValues):
            return [_to_host(to_array(v)) for v in value.values]
        return [_to_host(to_array(value))]

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        """Reduces ``per_replica_value`` to ``destinations``.

        Returns:
            An array when there is one destination device, else a Mirrored with a copy per device.
        """
        del options
        op = ReduceOp.parse(reduce_op, where="CrossDeviceOps.reduce")
        devices = resolve_destinations(destinations, "CrossDeviceOps.reduce")
        self._check_devices(devices)
        comps = self._values_of("reduce", per_replica_value)
        check_same_leaves("reduce", [[c] for c in comps])
        return _on_destinations(_reduce_arrays("reduce", comps, op), devices)

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        """Reduces many (value, destinations) pairs, packed into one kernel call per dtype and pack."""
        del options
        op = ReduceOp.parse(reduce_op, where="CrossDeviceOps.batch_reduce")
        pairs = list(value_destination_pairs)
        if not pairs:
            return []
        for p in pairs:
            if not (isinstance(p, (tuple, list)) and len(p) == 2):
                raise ValueError(f"batch_reduce: expected (value, destinations) pairs, got {p!r}")
        devs = [resolve_destinations(d, "CrossDeviceOps.batch_reduce") for _, d in pairs]
        for d in devs:
            self._check_devices(d)
        comps = [self._values_of("batch_reduce", v) for v, _ in pairs]
        n = len(comps[0])
        for j, c in enumerate(comps):
            if len(c) != n:
                raise ValueError(f"batch_reduce: value {j} has {len(c)} components but value 0 has {n}")
        per_replica = [[c[r] for c in comps] for r in range(n)]
        check_same_leaves("batch_reduce", per_replica)
        outs = packed_reduce("batch_reduce", op, per_replica, num_packs=self.num_packs, all_reduce=False)
        return [_on_destinations(o, d) for o, d in zip(outs, devs)]

    def broadcast(self, tensor, destinations):
        """Copies ``tensor`` to every destination device."""
        devices = resolve_destinations(destinations, "CrossDeviceOps.broadcast")
        self._check_devices(devices)
        arr = np.array(_to_host(to_array(tensor)), copy=True)
        return _on_destinations(arr, devices)

    def _all_reduce(self, op, per_replica_leaves, paths=None):
        """The replica-context all-reduce: ``out[r][j]``, one packed kernel call per dtype and pack."""
        if len(per_replica_leaves[0]) == 1 and not self._via_one:
            return _single_all_reduce("all_reduce", op, per_replica_leaves)
        check_same_leaves("all_reduce", per_replica_leaves, paths)
        return packed_reduce(
            "all_reduce", op, per_replica_leaves, num_packs=self.num_packs, all_reduce=True, via_one=self._via_one
        )


class KernelAllReduce(CrossDeviceOps):
    """The default: one fused all-reduce kernel call per dtype (all of a step's values packed)."""

    def __init__(self, num_packs=1):
        self.num_packs = _check_num_packs(type(self).__name__, num_packs)


def _check_num_packs(name, num_packs):
    if isinstance(num_packs, bool) or not isinstance(num_packs, (int, np.integer)) or num_packs < 0:
        raise ValueError(f"{name} requires num_packs >= 0, but {num_packs!r} is specified")
    return int(num_packs)


class ReductionToOneDevice(CrossDeviceOps):
    """Reduces to one device, then broadcasts the result back (``tf.distribute.ReductionToOneDevice``).

    Args:
        reduce_to_device: the device the reduction happens on (default: the first destination).
        accumulation_fn: accepted for TF compatibility; the kernels' fixed-order sum is always used.
    """

    _via_one = True

    def __init__(self, reduce_to_device=None, accumulation_fn=None):
        self.reduce_to_device = None if reduce_to_device is None else _devices.canonicalize(reduce_to_device)
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(f"accumulation_fn must be callable, got {type(accumulation_fn).__name__}")
        self.accumulation_fn = accumulation_fn
        self.num_packs = 1


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """All-reduce by hierarchical copies (``tf.distribute.HierarchicalCopyAllReduce``).

    On host memory this is the fused all-reduce kernel over packed buffers; GPU devices use the
    CUDA kernels.
    """

    def __init__(self, num_packs=1):
        self.num_packs = _check_num_packs("HierarchicalCopy", num_packs)


class NcclAllReduce(CrossDeviceOps):
    """NCCL all-reduce (``tf.distribute.NcclAllReduce``); GPU devices only.

    CuPy's NCCL bindings are imported when the first reduction runs, not here.
    """

    _needs_gpu = True

    def __init__(self, num_packs=1):
        self.num_packs = _check_num_packs("NCCL all-reduce", num_packs)

    def _all_reduce(self, op, per_replica_leaves, paths=None):
        raise ValueError("NcclAllReduce needs GPU devices; the replicas hold host (numpy) arrays")


class P2PAllReduce(CrossDeviceOps):
    """Peer-to-peer all-reduce over GPU memory (cudist extension); GPU devices only."""

    _needs_gpu = True

    def __init__(self, num_packs=1):
        self.num_packs = _check_num_packs("P2PAllReduce", num_packs)

    def _all_reduce(self, op, per_replica_leaves, paths=None):
        raise ValueError("P2PAllReduce needs GPU devices; the replicas hold host (numpy) arrays")


def select_cross_device_ops(devices, cross_device_ops=None):
    """The cross-device ops a strategy over ``devices`` uses (the given one, checked, or the default)."""
    if cross_device_ops is None:
        return KernelAllReduce()
    if not isinstance(cross_device_ops, CrossDeviceOps):
        raise TypeError(
            f"cross_device_ops must be a cudist.CrossDeviceOps instance, got {type(cross_device_ops).__name__}"
        )
    cross_device_ops._check_devices(devices)
    return cross_device_ops


def tree_leaves_with_paths(tree):
    """(leaves, treespec, paths) of a nest (None is an empty node, as in optree.tree_flatten)."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    return leaves, spec, ["/".join(str(p) for p in path) for path in paths]
