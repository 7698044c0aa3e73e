"""``CollectiveAllReduce``: the cross-device ops of MultiWorkerMirroredStrategy (TF's ``CollectiveAllReduce``).

A hierarchical all-reduce over the workers of an MPI job:

1. the worker's local replicas are summed by the kernels (one fused pass per leaf, straight into a
   packed host buffer; a single local replica's leaves are sent as they are, without a copy: one
   leaf to MPI, every leaf of a pack to the node's shared memory, which packs them in its slots);
2. one non-blocking MPI ``Iallreduce`` (SUM) per packed buffer of about ``bytes_per_pack`` bytes
   (0: one buffer per dtype), all started before any is waited for, polled with the
   communicator's deadline (see :mod:`cudist._dataplane.transports.mpi`); when several workers
   share a node, host buffers go through the node's shared memory instead
   (:mod:`cudist._dataplane.transports.shm`: summed in worker order by the kernels, node
   leaders over MPI across nodes), under the same deadlines and checks;
3. MEAN divides the global sum by the GLOBAL replica count (integers: a true division, float64 or float32 as
   TF; variables keep their dtype, see ``cudist._variables``), then each local replica gets its
   own copy of the result on its own device (the local broadcast).

GPU replicas, with NCCL (``CommunicationImplementation.NCCL``, or AUTO when CuPy can load NCCL):
step 1 sums the local replicas with the kernels into packed buffers on the worker's first GPU
(``bytes_per_pack`` as for MPI), step 2 is one grouped NCCL all-reduce of those buffers across the
workers (:class:`cudist._dataplane.transports.nccl.WorkerCommunicator`: one rank per worker, queued on the
GPU's current stream, waited for with the same deadline, stall warning and fingerprint checks as
MPI), then MEAN's division and the local broadcast happen on the GPUs. Without NCCL (RING, or
AUTO without a loadable NCCL), and for dtypes NCCL lacks, GPU replicas are summed on their GPUs
and the sum is staged through the host for MPI.

Summation order: the local replicas in replica order, then MPI's (or NCCL's) order across
workers, which for more than two workers is not replica order (MPI: pairwise ((w0 + w1) + (w2 +
w3)); NCCL: its ring's chunked order). With one replica per worker and two workers the result is
a single addition, bit-identical to a MirroredStrategy over two replicas; otherwise it can
differ from it in the last bits (float tolerance). The 16-bit floats are the exception: MPI has no
bfloat16 and would round float16 sums per addition, so the replicas' bfloat16 / float16 values are
all-gathered and every worker sums all of them in float32 in global replica order, rounding once:
bit-identical to a MirroredStrategy over every replica in worker order (float16 GPU values that
NCCL carries keep NCCL's float16 all-reduce).
"""

from __future__ import annotations

import numpy as np

from cudist._arrays import array_module, contiguous, device_context, gpu_of, is_device_array, like, to_host
from cudist._dataplane import packing, pool
from cudist._dataplane import reduce as reductions
from cudist._dataplane.transports.mpi import describe
from cudist._dataplane.placement import on_destinations, resolve_destinations
from cudist import _cross_device_ops as cross_device_ops_lib
from cudist._cross_device_ops import CrossDeviceOps
from cudist._kernels import backend_for, cpu_backend, is_bfloat16
from cudist._reduce_util import ReduceOp, int_mean_dtype
from cudist._values import DistributedValues

__all__ = ["CollectiveAllReduce"]

_KINDS = {op: f"all_reduce {op.name}" for op in ReduceOp}
# For the per-step path (in :meth:`CollectiveAllReduce._all_reduce_arrays`): an Enum's hash and class
# attributes are Python-level lookups, a few hundred ns each.
_SUM, _MEAN = ReduceOp.SUM, ReduceOp.MEAN
_SUM_KIND, _MEAN_KIND = _KINDS[_SUM], _KINDS[_MEAN]
#: The dtypes of that path (the 16-bit floats take their own route),
#: the canonical objects, compared by identity (a dtype's hash is computed afresh at every lookup).
_SMALL_DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))


class CollectiveAllReduce(CrossDeviceOps):
    """All-reduce across the workers of a multi-worker job, hierarchically (``tf.distribute`` internal).

    Args:
        communicator: the workers' :class:`cudist._dataplane.transports.mpi.Communicator` (None: one worker).
        local_ops: the cross-device ops of the worker's local replicas (what MirroredStrategy picks).
        bytes_per_pack: the size of the packed buffers each MPI (or NCCL) all-reduce carries (0: one per dtype).
        nccl: the cross-worker NCCL communicator for GPU values
            (:class:`cudist._dataplane.transports.nccl.WorkerCommunicator`); None: GPU values go through MPI.
        host_transport: what all-reduces host buffers across workers
            (:class:`cudist._dataplane.transports.shm.SharedMemoryAllReduce`); None: ``communicator`` (MPI).
        compression: None, or "bfloat16" / "float16": float32 host values cross the workers in that
            dtype (``CommunicationOptions.compression``; see :meth:`_compressed_sums`).
    """

    def __init__(self, communicator, local_ops, bytes_per_pack=0, nccl=None, host_transport=None, compression=None):
        self._comm = communicator
        self._shm = host_transport if communicator is not None else None
        self.compression = compression
        # The 16-bit dtype float32 host values cross the workers in (CommunicationOptions.compression).
        self._wire = None if compression is None else _wire_dtype(compression)
        self._local = local_ops
        self.bytes_per_pack = int(bytes_per_pack)
        self.num_packs = local_ops.num_packs
        self._workers = 1 if communicator is None else communicator.size
        self._nccl = nccl if self._workers > 1 else None

    def __repr__(self) -> str:
        return (
            f"<cudist.CollectiveAllReduce workers={self._workers} bytes_per_pack={self.bytes_per_pack} "
            f"gpu_values={self.gpu_implementation} local={self._local!r}>"
        )

    @property
    def num_workers(self) -> int:
        return self._workers

    @property
    def gpu_implementation(self) -> str:
        """How GPU values cross workers: "NCCL", or "MPI" (staged through the host)."""
        return "NCCL" if self._nccl is not None else "MPI"

    @property
    def host_implementation(self) -> str:
        """How host values cross workers: "MPI", or the shared-memory transport's description."""
        return "MPI" if self._shm is None else self._shm.name

    def _host_allreduce(self, pairs, kind, detail):
        """SUM all-reduces host ``(send, recv)`` pairs: the results, ``recv`` or (shared memory) read-only views."""
        if self._shm is not None:
            return self._shm.allreduce(pairs, kind, detail)
        self._comm.allreduce(pairs, kind, detail)
        return [recv for _, recv in pairs]

    def _check_devices(self, devices):
        self._local._check_devices(devices)

    def _bind(self, devices, physical):
        self._local._bind(devices, physical)

    def _fused_sum_backend(self, arrays):
        # A fused local sum + update would skip the other workers: optimizers reduce through
        # batch_reduce_to (and so through MPI) instead. One worker: exactly the local ops.
        if self._workers > 1:
            return None
        return cross_device_ops_lib.fused_sum_backend(self._local, arrays)

    # ------------------------------------------------------------------ the global sum
    def _compressible(self, per_replica_leaves):
        """The ids of the leaves that cross the workers compressed: float32 host arrays in every replica."""
        if self._wire is None:
            return []
        return [j for j, a in enumerate(per_replica_leaves[0])
                if a.dtype == np.float32 and all(type(leaves[j]) is np.ndarray for leaves in per_replica_leaves)]

    def _compressed_sums(self, where, kind, per_replica_leaves, ids, sums):
        """Sets ``sums[j]`` (``j`` in ``ids``) to the global float32 SUM of leaf ``j``, compressed on the wire.

        The local replicas are summed exactly (float32, replica order); that partial sum is rounded
        once to the 16-bit wire dtype; the workers' rounded sums are all-gathered (MPI has no
        bfloat16, and a reduction op would add in 16 bits) and added in float32 in worker order,
        the same on every worker. Error: see ``CommunicationOptions.compression``.
        """
        n = len(per_replica_leaves)
        sizes = [per_replica_leaves[0][j].size for j in ids]
        packed = np.empty((1, sum(sizes)), self._wire)
        off = 0
        for j, s in zip(ids, sizes):
            arrs = [leaves[j] for leaves in per_replica_leaves]
            local = reductions.reduce_arrays(where, arrs, ReduceOp.SUM) if n > 1 else arrs[0]
            packed[0, off : off + s] = local.reshape(-1)  # the one rounding to the wire dtype
            off += s
        rows = self._comm.allgather_rows(packed.view(np.uint16), 0, kind).view(self._wire)
        total = rows[0].astype(np.float32)
        for w in range(1, len(rows)):
            total += rows[w].astype(np.float32)
        off = 0
        for j, s in zip(ids, sizes):
            sums[j] = total[off : off + s].reshape(per_replica_leaves[0][j].shape)
            off += s

    def _global_sums(self, where, kind, per_replica_leaves):
        """The global SUM of leaf ``j`` over every replica of every worker: ``sums[j]``, fresh host arrays."""
        n = len(per_replica_leaves)
        ref = per_replica_leaves[0]
        sums = [None] * len(ref)
        squeezed = self._compressible(per_replica_leaves)
        if squeezed:
            self._compressed_sums(where, kind, per_replica_leaves, squeezed, sums)
            if len(squeezed) == len(ref):
                return sums
        gpu = self._nccl_leaves(where, per_replica_leaves)
        if gpu:
            self._nccl_sums(kind, per_replica_leaves, gpu, sums)
            if len(gpu) + len(squeezed) == len(ref):
                return sums
        host = {}  # per leaf (not all-reduced by NCCL): the arrays to sum locally, all on the host
        for j, a in enumerate(ref):
            if sums[j] is not None:
                continue
            arrs = [per_replica_leaves[r][j] for r in range(n)]
            packing.check_reducible(where, a.dtype)
            if any(is_device_array(x) for x in arrs):
                # GPU leaves: summed on the GPUs first, then one copy to the host for MPI.
                local = reductions.reduce_arrays(where, arrs, ReduceOp.SUM) if n > 1 else arrs[0]
                arrs = [to_host(local)]
            host[j] = arrs
        by_dtype: dict = {}
        for j, arrs in host.items():
            by_dtype.setdefault(arrs[0].dtype, []).append(j)
        groups = [[leaf_ids[i] for i in ids] for dt, leaf_ids in by_dtype.items()
                  for ids in _byte_packs([host[j][0].size * dt.itemsize for j in leaf_ids], self.bytes_per_pack)]
        results = None
        if self._shm is not None and all(len(arrs) == 1 for arrs in host.values()):
            # One local replica: its gradients go into the node's shared memory where they are, no pack
            # built (None: these sizes take another path, which the packs below serve).
            results = self._shm.allreduce_packs(
                [[contiguous(host[j][0]).reshape(-1) for j in ids] for ids in groups], kind,
                lambda: describe(arrs[0] for arrs in host.values()),
            )
        if results is None:
            results = self._packed_allreduce(host, groups, kind)
        for ids, recv in zip(groups, results):
            off = 0
            for j in ids:
                shape = host[j][0].shape
                s = host[j][0].size
                sums[j] = recv[off : off + s].reshape(shape)
                off += s
        return sums

    def _packed_allreduce(self, host, groups, kind):
        """The global SUM of each group of leaves (``host[j]``: leaf ``j``'s local arrays), packed: per
        group a flat host array, the local replicas summed into it by the kernels."""
        backend = cpu_backend()
        trusted = backend.trusted
        pairs = []
        for ids in groups:
            dt = host[ids[0]][0].dtype
            total = sum(host[j][0].size for j in ids)
            if len(ids) == 1 and len(host[ids[0]]) == 1:
                # One leaf of one local replica: sent as it is, received into a pooled buffer.
                send = contiguous(host[ids[0]][0]).reshape(-1)
                recv = pool.take((total,), dt)
            else:
                send = recv = pool.take((total,), dt)
                off = 0
                for j in ids:
                    arrs = host[j]
                    s = arrs[0].size
                    view = send[off : off + s]
                    if len(arrs) == 1:
                        np.copyto(view, arrs[0].reshape(-1))
                    elif dt in backend.dtypes:
                        trusted.reduce_to_one([contiguous(x).reshape(-1) for x in arrs], ReduceOp.SUM, view)
                    else:
                        np.copyto(view, arrs[0].reshape(-1))
                        for x in arrs[1:]:
                            np.add(view, x.reshape(-1), out=view)
                    off += s
            pairs.append((send, recv))
        return self._host_allreduce(pairs, kind, lambda: describe(arrs[0] for arrs in host.values()))

    def _nccl_leaves(self, where, per_replica_leaves):
        """The ids of the leaves NCCL all-reduces: on a GPU in every local replica, of a dtype NCCL has."""
        nc = self._nccl
        if nc is None:
            return []
        dtypes = nc.dtypes
        ids = []
        for j, a in enumerate(per_replica_leaves[0]):
            if a.dtype in dtypes and all(is_device_array(leaves[j]) for leaves in per_replica_leaves):
                if a.dtype in backend_for(a).dtypes:  # the local sum is a kernel call
                    ids.append(j)
        return ids

    def _nccl_sums(self, kind, per_replica_leaves, ids, sums):
        """Sets ``sums[j]`` (``j`` in ``ids``) to the global SUM of GPU leaf ``j``, on this worker's NCCL GPU.

        The local replicas are summed by the kernels straight into packed buffers (one per dtype
        and ``bytes_per_pack``) on the NCCL GPU, which one grouped NCCL call then all-reduces across
        the workers; ``sums[j]`` are views of those buffers.
        """
        nc = self._nccl
        n = len(per_replica_leaves)
        ref = per_replica_leaves[0]
        if nc.device is None:
            nc.bind(gpu_of(ref[ids[0]]))  # the first local replica's GPU, for the job's lifetime
        xp = array_module(ref[ids[0]])
        by_dtype: dict = {}
        for j in ids:
            by_dtype.setdefault(ref[j].dtype, []).append(j)
        bufs, unpack = [], []
        for dt, leaf_ids in by_dtype.items():
            for group in _byte_packs([ref[j].size * dt.itemsize for j in leaf_ids], self.bytes_per_pack):
                jj = [leaf_ids[i] for i in group]
                with xp.cuda.Device(nc.device):
                    buf = xp.empty(sum(ref[j].size for j in jj), dt)
                backend = backend_for(buf)
                off = 0
                for j in jj:
                    s = ref[j].size
                    if s:
                        # One kernel pass: the local replicas (on any GPU: read over peer access or
                        # staged, ordered by events) summed in replica order into the pack.
                        backend.reduce_to_one(
                            [contiguous(per_replica_leaves[r][j]).reshape(-1) for r in range(n)], ReduceOp.SUM,
                            buf[off : off + s],
                        )
                    off += s
                bufs.append(buf)
                unpack.append((jj, buf))
        nc.all_reduce(bufs, kind, lambda: describe(ref[j] for j in ids))
        for jj, buf in unpack:
            off = 0
            for j in jj:
                s = ref[j].size
                sums[j] = buf[off : off + s].reshape(ref[j].shape)
                off += s

    def _one_sum(self, kind, a):
        """The global SUM of one host array of the only local replica: sent as it is, into a pooled buffer."""
        if a.dtype.kind not in "iufc":
            packing.check_reducible(kind, a.dtype)
        send = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        recv = pool.take(a.shape, a.dtype)
        return self._host_allreduce(((send, recv),), kind, lambda: describe((a,)))[0]

    def _half_results(self, where, kind, op, per_replica_leaves, ids):
        """The global reduction of the 16-bit float leaves ``ids`` (all bfloat16, or all float16: one
        call per dtype), bit-identical to a MirroredStrategy over every replica of every worker in
        worker order.

        MPI has no bfloat16 and its sums would round after every addition (or per worker), so the
        replicas' own 16-bit values travel (one ``Iallgatherv`` of all of them, as 16-bit words: half the
        bytes of float32) and every worker sums all of them in float32 in global replica order and
        rounds once, as the local kernels do. The bytes each worker receives grow with the number of
        replicas (an all-gather), which for two workers is half a float32 all-reduce's.
        """
        n = len(per_replica_leaves)
        ref = [per_replica_leaves[0][j] for j in ids]
        dt = ref[0].dtype
        sizes = [a.size for a in ref]
        packed = np.empty((n, sum(sizes)), dt)
        for r, leaves in enumerate(per_replica_leaves):
            off = 0
            for j, s in zip(ids, sizes):
                np.copyto(packed[r, off : off + s], to_host(leaves[j]).reshape(-1))
                off += s
        rows = self._comm.allgather_rows(packed.view(np.uint16), 0, kind).view(dt)  # (global replicas, elements)
        out, off = [], 0
        for a, s in zip(ref, sizes):
            parts = [rows[g, off : off + s] for g in range(len(rows))]
            out.append(reductions.reduce_arrays(where, parts, op).reshape(a.shape))
            off += s
        return out

    def _global_results(self, where, kind, op, per_replica_leaves):
        """The global reduction of each leaf (SUM, or MEAN over the global replica count), host arrays."""
        nccl = set(self._nccl_leaves(where, per_replica_leaves)) if self._nccl is not None else set()
        # float16 GPU values keep NCCL's native float16 all-reduce (its order, as for float32).
        half = [j for j, a in enumerate(per_replica_leaves[0])
                if is_bfloat16(a.dtype) or (a.dtype == np.float16 and j not in nccl)]
        if half:
            results = [None] * len(per_replica_leaves[0])
            for dt in dict.fromkeys(per_replica_leaves[0][j].dtype for j in half):
                ids = [j for j in half if per_replica_leaves[0][j].dtype == dt]
                for j, res in zip(ids, self._half_results(where, kind, op, per_replica_leaves, ids)):
                    results[j] = res
            rest = [j for j in range(len(results)) if results[j] is None]
            if rest:
                sub = [[leaves[j] for j in rest] for leaves in per_replica_leaves]
                for j, res in zip(rest, self._global_results(where, kind, op, sub)):
                    results[j] = res
            return results
        if (len(per_replica_leaves) == 1 and len(per_replica_leaves[0]) == 1 and type(per_replica_leaves[0][0]) is np.ndarray
                and self._wire is None):
            sums = [self._one_sum(kind, per_replica_leaves[0][0])]  # the per-step common case, kept short
        else:
            sums = self._global_sums(where, kind, per_replica_leaves)
        if op is ReduceOp.MEAN:
            total = len(per_replica_leaves) * self._workers
            for j, s in enumerate(sums):
                xp = array_module(s)  # NCCL's sums stay on their GPU
                with device_context(s):
                    if s.dtype.kind in "iu":
                        sums[j] = xp.true_divide(s, total, dtype=int_mean_dtype(s.dtype))
                    elif type(s) is np.ndarray and not s.flags.writeable:  # a view of the node's shared sum: divided into a copy
                        sums[j] = xp.true_divide(s, s.dtype.type(total), out=pool.take(s.shape, s.dtype))
                    else:
                        xp.true_divide(s, s.dtype.type(total), out=s)
        return sums

    # ------------------------------------------------------------------ CrossDeviceOps
    def _all_reduce_leaves(self, op, per_replica_leaves, paths=None):
        if self._workers == 1:
            return cross_device_ops_lib.all_reduce(self._local, op, per_replica_leaves, paths)
        if len(per_replica_leaves) > 1:
            packing.check_same_leaves("all_reduce", per_replica_leaves, paths)
        results = self._global_results("all_reduce", _KINDS[op], op, per_replica_leaves)
        outs = []
        for r, leaves in enumerate(per_replica_leaves):
            mine = []
            for res, leaf in zip(results, leaves):
                if is_device_array(leaf):
                    # NCCL's result already on this replica's GPU is the first replica's own (a
                    # fresh buffer); every other replica gets a copy, ordered after the NCCL call.
                    mine.append(res if r == 0 and gpu_of(res) == gpu_of(leaf) else like(res, leaf, copy=True))
                else:
                    mine.append(res if r == 0 else res.copy())
            outs.append(mine)
        return outs

    def _all_reduce_arrays(self, op, arrays):
        if self._workers == 1:
            return cross_device_ops_lib.all_reduce_arrays(self._local, op, arrays)
        if len(arrays) == 1 and self._shm is not None and self._wire is None:
            # The per-step common case, one host array of the only replica, on the one-round path
            # (what _global_results computes, without its walk).
            a = arrays[0]
            dt = a.dtype
            if type(a) is np.ndarray and (dt is _SMALL_DTYPES[0] or dt is _SMALL_DTYPES[1] or dt is _SMALL_DTYPES[2]
                                          or dt is _SMALL_DTYPES[3]):
                mean = op is _MEAN
                if not mean or dt.kind == "f":  # (an integer MEAN gives floats: the general path)
                    res = self._shm.allreduce_one(a, _MEAN_KIND if mean else _SUM_KIND, lambda: describe((a,)))
                    if res is not None:
                        if mean:
                            np.true_divide(res, dt.type(self._workers), out=res)
                        return [res]
        return [o[0] for o in self._all_reduce_leaves(op, [[a] for a in arrays])]

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        if self._workers == 1:
            return self._local.reduce(reduce_op, per_replica_value, destinations, options)
        op = ReduceOp.parse(reduce_op, where="CrossDeviceOps.reduce")
        devices = resolve_destinations(destinations, "CrossDeviceOps.reduce")
        self._check_devices(devices)
        comps = self._values_of("reduce", per_replica_value)
        packing.check_same_leaves("reduce", [[c] for c in comps])
        res = self._global_results("reduce", f"reduce {op.name}", op, [[c] for c in comps])[0]
        return on_destinations(res, devices)

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        if self._workers == 1:
            return self._local.batch_reduce(reduce_op, value_destination_pairs, options)
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
        packing.check_same_leaves("batch_reduce", per_replica)
        res = self._global_results("batch_reduce", f"batch_reduce {op.name}", op, per_replica)
        return [on_destinations(o, d) for o, d in zip(res, devs)]

    def _values_of(self, where, value):
        if isinstance(value, DistributedValues):
            return [np.asarray(v) if not is_device_array(v) else v for v in value.values]
        return [np.asarray(value) if not is_device_array(value) else value]


def _wire_dtype(compression):
    """The NumPy dtype of a ``CommunicationOptions.compression`` name."""
    if compression == "float16":
        return np.dtype(np.float16)
    try:
        import ml_dtypes  # noqa: PLC0415 - optional: only for bfloat16
    except ImportError:
        raise ImportError(
            "CommunicationOptions(compression='bfloat16') needs the ml_dtypes package: pip install \"cudist[bf16]\""
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def _byte_packs(nbytes, bytes_per_pack):
    """Leaf indices (in order) in groups of about ``bytes_per_pack`` bytes (0: one group)."""
    if bytes_per_pack <= 0 or len(nbytes) <= 1:
        return [list(range(len(nbytes)))]
    groups, cur, acc = [], [], 0
    for i, b in enumerate(nbytes):
        if cur and acc + b > bytes_per_pack:
            groups.append(cur)
            cur, acc = [], 0
        cur.append(i)
        acc += b
    if cur:
        groups.append(cur)
    return groups
