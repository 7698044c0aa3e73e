"""Cross-device reductions: how per-replica values are combined (``tf.distribute.CrossDeviceOps``).

Every implementation here funnels into the kernel layer (:mod:`cudist._kernels`): a batch of values is
first *packed* -- all leaves of one dtype concatenated into one flat buffer per replica -- so that a
hundred small gradients cost one fused kernel call instead of a hundred. ``num_packs`` splits that
buffer into several calls (TF's knob for overlapping communication with computation); 0 disables
packing (one call per value).

On the CPU every replica's memory is host memory, so the "devices" only decide how many copies a
result gets. On GPUs the same packed buffers go to the CuPy backend's kernels (``P2PAllReduce``: one
kernel reading the replicas' buffers over peer access) or to NCCL (``NcclAllReduce``: one
communicator rank per physical GPU, ``cupy.cuda.nccl``). Logical GPUs carved out of one physical GPU
cannot be separate ranks of one NCCL communicator, so NCCL falls back to P2P there (its ``repr`` says
so). The default on GPUs (:class:`AutoGpuAllReduce`) takes P2P for small buffers or a single physical
GPU and NCCL for large buffers over several. Strategies mixing CPU and GPU devices are refused: their
replicas would hold arrays of two array modules that no kernel reduces together.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import optree

from cudist import _devices
from cudist._arrays import (
    as_array,
    contiguous,
    device_context,
    gpu_of,
    is_device_array,
    like,
    physical_gpu,
    place,
    snapshot,
    to_host,
)
from cudist._reduce_util import ReduceOp
from cudist._values import DistributedValues, Mirrored

__all__ = [
    "CrossDeviceOps",
    "ReductionToOneDevice",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "P2PAllReduce",
    "KernelAllReduce",
    "AutoGpuAllReduce",
    "default_gpu_ops",
    "select_cross_device_ops",
    "gpu_layout",
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
        from cudist._kernels import default_cpu_backend, get_backend

        b = get_backend()
        if b.xp is not np:  # CUDIST_BACKEND=cupy must not break host values: they get the CPU default
            b = default_cpu_backend()
        _backend_cache["cpu"] = b
    return b


def _reset_backend_cache():
    """Forgets the chosen CPU backend (tests changing ``CUDIST_BACKEND`` call this)."""
    _backend_cache.clear()


def backend_for(a):
    """The kernel backend for buffers like ``a`` (its ``xp`` is their array module).

    Host arrays get the CPU backend (:func:`_cpu_backend`); GPU arrays the ``cupy`` backend, loaded
    only then.
    """
    if type(a) is np.ndarray or not is_device_array(a):
        return _cpu_backend()
    from cudist._kernels import get_backend

    return get_backend("cupy")


def _fallback_backend(xp, dt):
    """The backend for a dtype the preferred one lacks: the NumPy reference on the host; none on GPUs."""
    if xp is not np:
        raise TypeError(f"all_reduce: dtype {dt} is not supported by the GPU kernels")
    return _numpy_backend()


def _numpy_backend():
    from cudist._kernels import get_backend

    return get_backend("numpy")


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
    if is_device_array(arrs[0]):
        # GPU arrays: reduced by the CUDA kernels on the first array's GPU (the others are read over
        # peer access or staged there by the backend).
        b = backend_for(arrs[0])
        xp = b.xp
        with device_context(arrs[0]):
            if len(arrs) == 1:
                out = arrs[0].copy()
            else:
                if dt not in b.dtypes:
                    _fallback_backend(xp, dt)  # raises, naming the dtype
                out = b.reduce_to_one([contiguous(a) for a in arrs], kop)
            if int_mean:
                out = xp.true_divide(out, len(arrs))
        return out
    if len(arrs) == 1:
        out = np.array(arrs[0], copy=True)
    else:
        b = _cpu_backend()
        if dt not in b.dtypes:
            b = _numpy_backend()
        if dt in b.dtypes:
            out = b.reduce_to_one([contiguous(a) for a in arrs], kop)
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


def _divide(xp, bufs, n):
    """Integer MEAN: each replica's sum / n as float64 (TF's ``x / n``), computed on its own device."""
    if xp is np:
        return [np.true_divide(buf, n) for buf in bufs]
    out = []
    for buf in bufs:
        with device_context(buf):
            out.append(xp.true_divide(buf, n))
    return out


def _all_reduce_in_place(where, backend, bufs, op, reducer):
    """All-reduces fresh buffers (one per replica, at least two) in place: SUM or float MEAN.

    ``backend`` is the one for their dtype (the NumPy reference for host dtypes the fast backends
    lack); a dtype outside the kernel contract is added up by NumPy. ``reducer`` (None: the
    backend's kernel) all-reduces GPU buffers.
    """
    if bufs[0].dtype in backend.dtypes:
        if reducer is None or backend.xp is np:
            # Straight to the backend's hook: these are fresh, valid buffers of one shape and dtype,
            # so the public method's checks (a few microseconds per step) are skipped.
            backend._all_reduce(bufs, op)
        else:
            reducer(backend, bufs, op)
    else:
        red = _reduce_arrays(where, bufs, op)
        for buf in bufs:
            backend.xp.copyto(buf, red)


def packed_reduce(where, op, per_replica_leaves, *, num_packs=1, all_reduce=True, via_one=False, reducer=None):
    """Reduces lists of per-replica arrays, packing leaves of one dtype into one buffer per replica.

    Args:
        where: name used in error messages.
        op: a ReduceOp.
        per_replica_leaves: ``per_replica_leaves[r][j]`` is leaf ``j`` of replica ``r`` (arrays).
        num_packs: buffers per dtype (1: everything of a dtype in one kernel call; 0: no packing).
        all_reduce: True gives every replica its own result (``out[r][j]``); False gives one result
            per leaf (``out[j]``).
        via_one: do an all-reduce as reduce-to-one-device then broadcast (ReductionToOneDevice).
        reducer: ``reducer(backend, bufs, op)`` all-reduces fresh packed buffers in place (SUM or
            float MEAN); default: the backend's fused all-reduce kernel. NCCL plugs in here.

    Returns:
        ``out[r][j]`` (all_reduce) or ``out[j]`` -- views into fresh buffers, never the inputs.

    Host leaves and GPU leaves are packed separately (a nest may hold a Python number next to CuPy
    arrays); each GPU replica's buffer is allocated on that replica's GPU.
    """
    n = len(per_replica_leaves)
    ref = per_replica_leaves[0]
    m = len(ref)
    if m == 1 and all_reduce and not via_one:
        return _single_all_reduce(where, op, per_replica_leaves, reducer=reducer)
    outs = [[None] * m for _ in range(n)] if all_reduce else [None] * m
    groups_by_key: dict = {}
    for j, a in enumerate(ref):
        groups_by_key.setdefault((is_device_array(a), a.dtype), []).append(j)
    for (_, dt), leaf_ids in groups_by_key.items():
        _check_reducible(where, dt)
        backend = backend_for(ref[leaf_ids[0]])
        xp = backend.xp
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
                with device_context(leaves[ids[0]]):  # each replica's buffer on its own device
                    if len(ids) == 1:
                        buf = xp.array(leaves[ids[0]], dtype=dt, copy=True, order="C").reshape(-1)
                    else:
                        buf = xp.empty(total, dtype=dt)
                        off = 0
                        for j in ids:
                            s = leaves[j].size
                            # asarray: a replica's leaf on another GPU (or the host) is moved here first
                            buf[off : off + s] = (leaves[j] if xp is np else xp.asarray(leaves[j])).reshape(-1)
                            off += s
                bufs.append(buf)
            if not all_reduce:
                if not use_kernel or n == 1:
                    red = _reduce_arrays(where, bufs, op)
                else:
                    with device_context(bufs[0]):
                        red = b.reduce_to_one(bufs, kop)
                        if int_mean:
                            red = xp.true_divide(red, n)
                results = [red]
            elif via_one and n > 1:
                with device_context(bufs[0]):  # the reduction happens on the first replica's device
                    red = b.reduce_to_one(bufs, kop) if use_kernel else _reduce_arrays(where, bufs, kop)
                    if int_mean:
                        red = xp.true_divide(red, n)
                if int_mean:
                    results = [red] + [like(red, buf, copy=True) for buf in bufs[1:]]
                else:
                    if use_kernel:
                        b.broadcast(red, bufs)
                    else:
                        for buf in bufs:
                            xp.copyto(buf, red)
                    results = bufs
            else:
                if n > 1:
                    _all_reduce_in_place(where, b, bufs, kop, reducer)
                if int_mean:
                    bufs = _divide(xp, bufs, n)
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


def _single_all_reduce(where, op, per_replica_leaves, reducer=None):
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
    b = backend_for(a0)
    xp = b.xp
    if xp is np:
        bufs = [np.array(p[0], dtype=dt, copy=True, order="C").reshape(-1) for p in per_replica_leaves]
    else:
        bufs = []
        for p in per_replica_leaves:
            with device_context(p[0]):
                bufs.append(xp.array(p[0], dtype=dt, copy=True, order="C").reshape(-1))
    int_mean = op is ReduceOp.MEAN and dt.kind in "iu"
    kop = ReduceOp.SUM if int_mean else op
    if n > 1:
        if dt not in b.dtypes:
            b = _fallback_backend(xp, dt)
        _all_reduce_in_place(where, b, bufs, kop, reducer)
    if int_mean:
        bufs = _divide(xp, bufs, n)
    return [[buf.reshape(shape)] for buf in bufs]


def gather_arrays(arrs, axis):
    """Concatenates per-replica arrays (same dtype) along ``axis`` in replica order into a new array.

    Host arrays go through the CPU backend (the NumPy reference for dtypes outside the kernel
    contract); GPU arrays through the CuPy backend, the result on the first array's GPU.
    """
    if is_device_array(arrs[0]) and all(is_device_array(a) for a in arrs):
        b = backend_for(arrs[0])
        xp = b.xp
        with device_context(arrs[0]):
            if arrs[0].dtype in b.dtypes:
                return b.all_gather(arrs, axis)
            # Validated like a kernel call (shapes, axis), then concatenated by CuPy.
            _numpy_backend().all_gather([np.zeros(a.shape, np.float32) for a in arrs], axis)
            return xp.concatenate([xp.asarray(a) for a in arrs], axis=axis)
    arrs = [contiguous(to_host(a)) for a in arrs]
    b = _cpu_backend()
    if arrs[0].dtype not in b.dtypes:
        b = _numpy_backend()
    if arrs[0].dtype in b.dtypes:
        return b.all_gather(arrs, axis)
    _numpy_backend().all_gather([np.zeros(a.shape, np.float32) for a in arrs], axis)
    return np.concatenate(arrs, axis=axis)


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


def _on_destinations(result, devices):
    """One result per destination device: the array itself for one, a Mirrored of copies for many.

    Host results for CPU destinations stay host arrays (the first is ``result`` itself); GPU
    destinations get a CuPy array on their physical GPU (``result`` itself where it already is).
    """
    if not _devices.any_gpu(devices):
        if len(devices) == 1:
            return to_host(result)
        result = to_host(result)
        return Mirrored([result] + [result.copy() for _ in devices[1:]])
    placed, seen = [], set()
    for d in devices:
        p = place(result, d)
        if id(p) in seen:  # two logical devices on one physical GPU: each gets its own copy
            p = snapshot(p)
        seen.add(id(p))
        placed.append(p)
    return placed[0] if len(placed) == 1 else Mirrored(placed)


# ---------------------------------------------------------------------------------------------- devices
def gpu_layout(devices):
    """The physical GPU of each device, or None when every device is a CPU.

    Args:
        devices: device names (any spelling :func:`cudist._devices.parse_device` accepts).

    Returns:
        None for CPU devices; for GPU devices a tuple with the CUDA device id of each (logical GPUs
        split from one physical GPU share its id).

    Raises:
        ValueError: CPU and GPU devices are mixed, or a GPU does not exist.
    """
    specs = [_devices.parse_device(d) for d in devices]
    gpus = [s for s in specs if s.is_gpu]
    if not gpus:
        return None
    if len(gpus) != len(specs):
        cpu = next(s for s in specs if not s.is_gpu)
        raise ValueError(
            f"cannot mix CPU and GPU devices in one strategy: got {cpu.name!r} and {gpus[0].name!r}; "
            "replicas on CPUs hold NumPy arrays and replicas on GPUs CuPy arrays, which are not reduced together. "
            "Use only GPU devices or only CPU devices"
        )
    return tuple(physical_gpu(s) for s in specs)


def _describe_layout(physical) -> str:
    n, p = len(physical), len(set(physical))
    if n == p:
        return f"{n} GPU{'s' if n != 1 else ''}"
    return f"{n} logical GPUs on {p} physical GPU{'s' if p != 1 else ''}"


def _nccl_module():
    """(``cupy.cuda.nccl``, None) when NCCL can be used, else (None, why not)."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415 - only when NCCL is about to be used
    except Exception as e:  # noqa: BLE001 - no CuPy, or a broken one: say why
        return None, f"cannot import cupy.cuda.nccl ({type(e).__name__}: {e}); install cudist[cuda]"
    if not getattr(nccl, "available", False):
        return None, (
            "CuPy cannot load the NCCL library (cupy.cuda.nccl.available is False); install NCCL "
            "(e.g. pip install nvidia-nccl-cu12)"
        )
    return nccl, None


def _nccl_dtypes(nccl):
    return {
        np.dtype(np.float16): nccl.NCCL_FLOAT16,
        np.dtype(np.float32): nccl.NCCL_FLOAT32,
        np.dtype(np.float64): nccl.NCCL_FLOAT64,
        np.dtype(np.int32): nccl.NCCL_INT32,
        np.dtype(np.int64): nccl.NCCL_INT64,
    }


_comm_lock = threading.Lock()
_communicators: dict = {}  # tuple of CUDA device ids -> list of NcclCommunicator, one rank per GPU


def _communicators_for(nccl, physical):
    """NCCL communicators over ``physical`` GPUs (distinct), created once per GPU tuple and kept."""
    key = tuple(physical)
    comms = _communicators.get(key)
    if comms is None:
        with _comm_lock:
            comms = _communicators.get(key)
            if comms is None:
                comms = _communicators[key] = nccl.NcclCommunicator.initAll(list(key))
    return comms


def _nccl_all_reduce(nccl, bufs, op):
    """All-reduces GPU buffers (one per distinct GPU) in place with NCCL, SUM or MEAN.

    Each rank's call goes on its GPU's current stream, so it is ordered after the copies that
    filled the buffer and before whatever reads it next, like any CuPy operation. MEAN is the NCCL
    sum divided by N on each GPU (the kernels' definition; NCCL's own average needs NCCL 2.10).
    """
    import cupy  # noqa: PLC0415 - only reached with GPU arrays

    physical = [b.device.id for b in bufs]
    comms = _communicators_for(nccl, physical)
    code = _nccl_dtypes(nccl)[bufs[0].dtype]
    count = bufs[0].size
    nccl.groupStart()
    try:
        for comm, buf in zip(comms, bufs):
            with buf.device:
                stream = cupy.cuda.get_current_stream()
                comm.allReduce(buf.data.ptr, buf.data.ptr, count, code, nccl.NCCL_SUM, stream.ptr)
    finally:
        nccl.groupEnd()
    if op is ReduceOp.MEAN:
        n = len(bufs)
        for buf in bufs:
            with buf.device:
                cupy.true_divide(buf, buf.dtype.type(n), out=buf)


# ---------------------------------------------------------------------------------------------- classes
class CrossDeviceOps:
    """Base class of cross-device reduction and broadcast algorithms.

    Subclasses choose how an all-reduce is carried out; the public methods are the same as TF's.
    On GPU devices, reductions run on the GPUs and results are CuPy arrays on the destination
    devices (host arrays for CPU destinations).
    """

    #: How many buffers per dtype a batch is packed into (0: no packing).
    num_packs = 1
    _via_one = False
    _needs_gpu = False
    #: Set by :meth:`_bind` when a strategy chose this op by default: why, for ``repr``.
    _default_note = None

    def __repr__(self) -> str:
        extra = f" ({self._default_note})" if self._default_note else ""
        return f"<cudist.{type(self).__name__} num_packs={self.num_packs}{extra}>"

    def _check_devices(self, devices):
        """Raises ValueError if this algorithm cannot run on ``devices`` (canonical names)."""
        if self._needs_gpu:
            bad = [d for d in devices if not _devices.parse_device(d).is_gpu]
            if bad:
                raise ValueError(
                    f"{type(self).__name__} needs GPU devices, but got {bad[0]!r}; use "
                    "cudist.ReductionToOneDevice() or the default cross_device_ops on CPUs"
                )

    def _bind(self, devices, physical):
        """Called when a strategy over ``devices`` (physical GPU ids ``physical``, None on CPUs) adopts this op."""
        del devices, physical

    def _reducer(self, per_replica_leaves):
        """The all-reduce of packed buffers (see ``packed_reduce``); None: the backend's kernel."""
        del per_replica_leaves
        return None

    def _values_of(self, where, value):
        if isinstance(value, DistributedValues):
            return [as_array(v) for v in value.values]
        return [as_array(value)]

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        """Reduces ``per_replica_value`` to ``destinations``.

        Returns:
            An array when there is one destination device, else a Mirrored with a copy per device.
        """
        del options
        op = ReduceOp.parse(reduce_op, where="CrossDeviceOps.reduce")
        devices = resolve_destinations(destinations, "CrossDeviceOps.reduce")
        self._check_devices(devices)
        comps = self._uniform("reduce", self._values_of("reduce", per_replica_value))
        check_same_leaves("reduce", [[c] for c in comps])
        return _on_destinations(_reduce_arrays("reduce", comps, op), devices)

    @staticmethod
    def _uniform(where, comps):
        """The components all on GPUs or all on the host: a mix is moved to the host."""
        dev = [is_device_array(c) for c in comps]
        if any(dev) and not all(dev):
            return [to_host(c) for c in comps]
        return comps

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
        comps = [self._uniform("batch_reduce", self._values_of("batch_reduce", v)) for v, _ in pairs]
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
        arr = as_array(tensor)
        if not _devices.any_gpu(devices):
            return _on_destinations(np.array(to_host(arr), copy=True), devices)
        return _on_destinations(snapshot(arr) if is_device_array(arr) else arr, devices)

    def _all_reduce(self, op, per_replica_leaves, paths=None):
        """The replica-context all-reduce: ``out[r][j]``, one packed kernel call per dtype and pack."""
        if len(per_replica_leaves[0]) == 1 and not self._via_one:
            return _single_all_reduce("all_reduce", op, per_replica_leaves, reducer=self._reducer(per_replica_leaves))
        check_same_leaves("all_reduce", per_replica_leaves, paths)
        return packed_reduce(
            "all_reduce",
            op,
            per_replica_leaves,
            num_packs=self.num_packs,
            all_reduce=True,
            via_one=self._via_one,
            reducer=self._reducer(per_replica_leaves),
        )


class KernelAllReduce(CrossDeviceOps):
    """The default on CPUs: one fused all-reduce kernel call per dtype (all of a step's values packed)."""

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


def _replica_gpus_of(per_replica_leaves):
    """The GPU of each replica's first GPU leaf, or None when every leaf is a host value.

    Host leaves (Python numbers, NumPy arrays) next to GPU arrays are reduced on the host, as
    TF reduces CPU tensors under GPU cross-device ops.
    """
    for j, a in enumerate(per_replica_leaves[0]):
        if is_device_array(a):
            return [gpu_of(leaves[j]) for leaves in per_replica_leaves]
    return None


class P2PAllReduce(CrossDeviceOps):
    """Peer-to-peer all-reduce over GPU memory (cudist extension); GPU devices only.

    The CUDA kernels of the CuPy backend read every replica's buffer over peer access (one-shot), or,
    for large buffers with one replica per GPU, each GPU reduces a chunk and pushes it to the others
    (two-shot). Works for logical GPUs sharing a physical GPU, where it is a single local kernel.
    """

    _needs_gpu = True

    def __init__(self, num_packs=1):
        self.num_packs = _check_num_packs("P2PAllReduce", num_packs)


class NcclAllReduce(CrossDeviceOps):
    """NCCL all-reduce (``tf.distribute.NcclAllReduce``); GPU devices only.

    One process drives every GPU: a communicator per set of physical GPUs
    (``cupy.cuda.nccl.NcclCommunicator.initAll``), one grouped ``allReduce`` per packed buffer.
    Logical GPUs split from one physical GPU cannot be separate ranks of one communicator, so there
    the P2P kernels are used instead (``repr`` says so, and binding it to such a strategy warns).
    CuPy's NCCL bindings are imported when the op is bound to GPU devices or first runs, not here.
    """

    _needs_gpu = True
    _fallback = None  # why P2P is used instead of NCCL (None: NCCL is used)

    def __init__(self, num_packs=1):
        self.num_packs = _check_num_packs("NCCL all-reduce", num_packs)

    def __repr__(self) -> str:
        extra = f" (falls back to P2P: {self._fallback})" if self._fallback else ""
        return f"<cudist.NcclAllReduce num_packs={self.num_packs}{extra}>"

    def _bind(self, devices, physical):
        if physical is None:
            return
        if len(set(physical)) != len(physical):
            self._fallback = (
                f"{_describe_layout(physical)}; logical GPUs on one physical GPU cannot share an NCCL communicator"
            )
            warnings.warn(
                f"NcclAllReduce: {self._fallback}, so the P2P kernels (cudist.P2PAllReduce) do the all-reduce",
                UserWarning,
                stacklevel=4,
            )
            return
        self._fallback = None
        if len(physical) > 1:
            nccl, why = _nccl_module()
            if nccl is None:
                from cudist._kernels import BackendUnavailableError

                raise BackendUnavailableError(f"NcclAllReduce cannot run: {why}; or use cudist.P2PAllReduce()")
            self._nccl = nccl

    def _reducer(self, per_replica_leaves):
        if len(per_replica_leaves) < 2:
            return None  # nothing to reduce
        physical = _replica_gpus_of(per_replica_leaves)
        if physical is None or len(set(physical)) != len(physical):
            return None  # logical GPUs sharing a GPU: the P2P kernels
        nccl = self.__dict__.get("_nccl")
        if nccl is None:
            nccl, why = _nccl_module()
            if nccl is None:
                from cudist._kernels import BackendUnavailableError

                raise BackendUnavailableError(f"NcclAllReduce cannot run: {why}; or use cudist.P2PAllReduce()")
            self._nccl = nccl
        dtypes = _nccl_dtypes(nccl)

        def reduce(backend, bufs, op):
            if bufs[0].dtype in dtypes and len({b.device.id for b in bufs}) == len(bufs):
                _nccl_all_reduce(nccl, bufs, op)
            else:
                backend._all_reduce(bufs, op)

        return reduce


class AutoGpuAllReduce(CrossDeviceOps):
    """The default over several physical GPUs: P2P kernels for small buffers, NCCL for large ones.

    A packed buffer of at least :attr:`NCCL_MIN_BYTES` goes through NCCL, a smaller one through the
    P2P kernels (lower latency: one launch, no NCCL protocol). Strategies on a single physical GPU
    (logical GPUs included), with several logical GPUs per physical GPU, or without NCCL get a plain
    :class:`P2PAllReduce` by default instead (see :func:`select_cross_device_ops`).
    """

    _needs_gpu = True
    #: Packed buffers of at least this many bytes use NCCL (the replicas being on distinct GPUs).
    NCCL_MIN_BYTES = 8 << 20

    def __init__(self, physical, nccl, num_packs=1):
        self.num_packs = _check_num_packs("AutoGpuAllReduce", num_packs)
        self._physical = tuple(physical)
        self._nccl = nccl
        self._default_note = f"default for {_describe_layout(self._physical)}"

    def __repr__(self) -> str:
        return (
            f"<cudist.AutoGpuAllReduce num_packs={self.num_packs}: P2PAllReduce below "
            f"{_format_bytes(self.NCCL_MIN_BYTES)} per buffer, NcclAllReduce from there ({self._default_note})>"
        )

    def _reducer(self, per_replica_leaves):
        del per_replica_leaves
        nccl = self._nccl
        dtypes = _nccl_dtypes(nccl)
        threshold = self.NCCL_MIN_BYTES

        def reduce(backend, bufs, op):
            if (
                bufs[0].nbytes >= threshold
                and bufs[0].dtype in dtypes
                and len({b.device.id for b in bufs}) == len(bufs)
            ):
                _nccl_all_reduce(nccl, bufs, op)
            else:
                backend._all_reduce(bufs, op)

        return reduce


def default_gpu_ops(physical):
    """The default cross-device ops for replicas on the physical GPUs ``physical`` (one id per replica).

    NCCL needs one replica per physical GPU and at least two of them; otherwise, or when NCCL cannot
    be loaded, the P2P kernels do everything.
    """
    layout = _describe_layout(physical)
    if len(physical) > 1 and len(set(physical)) == len(physical):
        nccl, why = _nccl_module()
        if nccl is not None:
            return AutoGpuAllReduce(physical, nccl)
        note = f"default for {layout}; NCCL unavailable: {why}"
    else:
        note = f"default for {layout}"
    ops = P2PAllReduce()
    ops._default_note = note
    return ops


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def select_cross_device_ops(devices, cross_device_ops=None):
    """The cross-device ops a strategy over ``devices`` uses (the given one, checked, or the default).

    The default is :class:`KernelAllReduce` on CPUs; on GPUs :class:`AutoGpuAllReduce` over several
    physical GPUs with NCCL available, else :class:`P2PAllReduce` (see :func:`default_gpu_ops`).

    Raises:
        ValueError: CPU and GPU devices mixed, a GPU that does not exist, or an op that cannot run
            on these devices (NcclAllReduce on CPUs).
        TypeError: ``cross_device_ops`` is not a CrossDeviceOps.
    """
    if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
        raise TypeError(
            f"cross_device_ops must be a cudist.CrossDeviceOps instance, got {type(cross_device_ops).__name__}"
        )
    if cross_device_ops is not None:
        cross_device_ops._check_devices(devices)
    physical = gpu_layout(devices)
    if cross_device_ops is None:
        return KernelAllReduce() if physical is None else default_gpu_ops(physical)
    cross_device_ops._bind(devices, physical)
    return cross_device_ops


def tree_leaves_with_paths(tree):
    """(leaves, treespec, paths) of a nest (None is an empty node, as in optree.tree_flatten)."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    return leaves, spec, ["/".join(str(p) for p in path) for path in paths]
