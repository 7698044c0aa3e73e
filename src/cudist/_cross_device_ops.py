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

import warnings
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from cudist import _devices
from cudist._arrays import Array, as_array, gpu_of, is_device_array, like, place, snapshot, to_host
from cudist._dataplane.transports import nccl as _nccl
from cudist._dataplane import packing
from cudist._dataplane import reduce as reductions
from cudist._dataplane.packing import LeafPaths, Reducer
from cudist._dataplane.placement import (
    Destinations,
    describe_layout,
    gpu_layout,
    on_destinations,
    resolve_destinations,
)
from cudist._kernels import BackendUnavailableError, KernelBackend, backend_for, cpu_backend
from cudist._reduce_util import ReduceOp
from cudist._values import DistributedValues, Mirrored
from cudist.errors import InvalidArgumentError

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
    "all_reduce",
    "all_reduce_arrays",
    "arrays_reducer",
    "fused_sum_backend",
]


# ---------------------------------------------------------------------------------------------- classes
class CrossDeviceOps:
    """Base class of cross-device reduction and broadcast algorithms.

    Subclasses choose how an all-reduce is carried out; the public methods are the same as TF's.
    On GPU devices, reductions run on the GPUs and results are CuPy arrays on the destination
    devices (host arrays for CPU destinations).
    """

    #: How many buffers per dtype a batch is packed into (0: no packing).
    num_packs = 1
    _needs_gpu = False
    #: Set by :meth:`_bind` when a strategy chose this op by default: why, for ``repr``.
    _default_note: str | None = None

    def __repr__(self) -> str:
        extra = f" ({self._default_note})" if self._default_note else ""
        return f"<cudist.{type(self).__name__} num_packs={self.num_packs}{extra}>"

    def _check_devices(self, devices: Sequence[str]) -> None:
        """Raises InvalidArgumentError if this algorithm cannot run on ``devices`` (canonical names).

        A GPU-only algorithm is refused on two or more CPU devices, when the strategy is made (TF
        2.21 raises the same error type at the first all-reduce); on one device there is nothing to
        reduce across, and TF and cudist both run.
        """
        if self._needs_gpu and len(devices) > 1:
            bad = [d for d in devices if not _devices.parse_device(d).is_gpu]
            if bad:
                raise InvalidArgumentError(
                    f"{type(self).__name__} needs GPU devices, but got {bad[0]!r}; use "
                    "cudist.ReductionToOneDevice() or the default cross_device_ops on CPUs"
                )

    def _bind(self, devices: Sequence[str], physical: Sequence[int] | None) -> None:
        """Called when a strategy over ``devices`` (physical GPU ids ``physical``, None on CPUs) adopts this op."""
        del devices, physical

    def _reducer(self, per_replica_leaves: Sequence[Sequence[Any]]) -> Reducer | None:
        """``reducer(backend, bufs, op)``: all-reduces packed GPU buffers in place; None: the backend's kernel."""
        del per_replica_leaves
        return None

    def _pipelined_sums(
        self,
        per_replica_leaves: Sequence[Sequence[Any]],
        consume: Callable[[list[int], list[Any]], None],
        settle: Callable[[], Sequence[Sequence[Any]]] | None = None,
    ) -> bool:
        """Sums the leaves pack by pack, overlapping each pack's cross-worker all-reduce with the local
        work on the packs around it, handing each pack's sums to ``consume(leaf ids, sums)``
        (``settle()``, once decided: the leaves to read instead); False (nothing done) where no
        pipeline applies: every op but the multi-worker one."""
        del per_replica_leaves, consume, settle
        return False

    #: Whether optimizers may fuse this algorithm's sum into their update (its ``batch_reduce`` is
    #: the kernels' replica-order sum): set by the algorithms whose reduction that is, and False for
    #: any subclass that defines its own ``reduce`` or ``batch_reduce`` (:meth:`__init_subclass__`).
    _fuses_sum = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A user's reduce or batch_reduce is always the one that reduces: decided once, when the
        # class is made, not at each step.
        if "reduce" in cls.__dict__ or "batch_reduce" in cls.__dict__:
            cls._fuses_sum = False

    def _fused_sum_backend(self, arrays: Sequence[Any]) -> KernelBackend | None:
        """The kernel backend that may sum these per-replica arrays fused into an optimizer update.

        A fused all-reduce + update (one pass: N gradients in, every copy and slot out) is exactly
        this algorithm's reduction only for the algorithms whose ``batch_reduce`` is the kernels'
        replica-order sum (``_fuses_sum``): host arrays of dtypes the CPU backend computes, or GPU
        arrays (the CuPy backend's fused kernels, on one GPU or several: whether each GPU's kernel
        can read every gradient over peer access is the update pass's test, see
        ``UpdatePass.fusable``; NCCL never serves ``batch_reduce``, so the GPU algorithms qualify
        too). For the others (and for any subclass that overrides the reductions) None, and
        optimizers reduce through ``extended.batch_reduce_to`` first.
        """
        if not self._fuses_sum or not arrays:
            return None
        first = arrays[0]
        if type(first) is np.ndarray:
            b = cpu_backend()
            kind: Any = np.ndarray
        elif is_device_array(first):
            # GPU arrays, on one GPU or several: each GPU's fused kernel reads every replica's
            # gradient (peer access; UpdatePass.fusable checks it) and writes its own copies.
            b = backend_for(first)
            kind = type(first)
        else:
            return None
        seen = None  # a step's gradients share one dtype object or a few: each is checked once
        for a in arrays:
            if type(a) is not kind:
                return None
            dt = a.dtype
            if dt is not seen:
                if not b.computes(dt):  # (bfloat16: the gradients of a mixed-precision fused update)
                    return None
                seen = dt
        return b

    def _values_of(self, where: str, value: Any) -> list[Array]:
        if isinstance(value, DistributedValues):
            return [as_array(v) for v in value.values]
        return [as_array(value)]

    def reduce(
        self,
        reduce_op: ReduceOp,
        per_replica_value: Any,
        destinations: Destinations,
        options: object = None,
    ) -> Array | Mirrored:
        """Reduces ``per_replica_value`` to ``destinations``.

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN`` (a string is a ValueError, as in TF 2.21,
                whose cross-device ops take no strings; ``Strategy.reduce`` and
                ``StrategyExtended.reduce_to`` do).
            per_replica_value: a DistributedValues of arrays (or scalars), or a plain array, which
                is one replica's value.
            destinations: a device string, a list of them, or a distributed value or variable
                (the devices of its components).
            options: accepted for TF compatibility (``CommunicationOptions``); ignored.

        Returns:
            An array when there is one destination device, else a Mirrored with a copy per device.

        Raises:
            ValueError: invalid destinations, replicas with different shapes or dtypes, or
                devices this algorithm cannot run on.
            TypeError: a dtype that cannot be summed.
        """
        del options
        op = _reduce_op(reduce_op)
        devices = resolve_destinations(destinations, "CrossDeviceOps.reduce")
        self._check_devices(devices)
        comps = self._uniform("reduce", self._values_of("reduce", per_replica_value))
        packing.check_same_leaves("reduce", [[c] for c in comps])
        return on_destinations(reductions.reduce_arrays("reduce", self._to_reduce_device(comps), op), devices)

    def _to_reduce_device(self, comps: Sequence[Any]) -> Sequence[Any]:
        """The components where the reduction happens (as they are; ReductionToOneDevice moves them)."""
        return comps

    @staticmethod
    def _uniform(where: str, comps: list[Any]) -> list[Any]:
        """The components all on GPUs or all on the host: a mix is moved to the host."""
        dev = [is_device_array(c) for c in comps]
        if any(dev) and not all(dev):
            return [to_host(c) for c in comps]
        return comps

    def batch_reduce(
        self,
        reduce_op: ReduceOp,
        value_destination_pairs: Iterable[tuple[Any, Destinations]],
        options: object = None,
    ) -> list[Array | Mirrored]:
        """Reduces many (value, destinations) pairs, packed into one kernel call per dtype and pack.

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN`` (a string is a ValueError, as in TF 2.21,
                whose cross-device ops take no strings; ``Strategy.reduce`` and
                ``StrategyExtended.reduce_to`` do).
            value_destination_pairs: (value, destinations) pairs, each as :meth:`reduce` takes them.
            options: accepted for TF compatibility (``CommunicationOptions``); ignored.

        Returns:
            One result per pair, in order, as :meth:`reduce` returns it.

        Raises:
            ValueError: a malformed pair, or the errors of :meth:`reduce`.
        """
        del options
        op = _reduce_op(reduce_op)
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
        per_replica: list[Sequence[Any]] = [[c[r] for c in comps] for r in range(n)]
        packing.check_same_leaves("batch_reduce", per_replica)
        per_replica = [self._to_reduce_device(leaves) for leaves in per_replica]
        outs = reductions.batch_reduce("batch_reduce", op, per_replica, num_packs=self.num_packs)
        return [on_destinations(o, d) for o, d in zip(outs, devs)]

    def broadcast(self, tensor: Any, destinations: Destinations) -> Array | Mirrored:
        """Copies ``tensor`` to every destination device.

        Args:
            tensor: an array or scalar.
            destinations: as :meth:`reduce` takes them.

        Returns:
            A new array for one destination device, else a Mirrored with a copy per device.
        """
        devices = resolve_destinations(destinations, "CrossDeviceOps.broadcast")
        self._check_devices(devices)
        arr = as_array(tensor)
        if not _devices.any_gpu(devices):
            return on_destinations(np.array(to_host(arr), copy=True), devices)
        return on_destinations(snapshot(arr) if is_device_array(arr) else arr, devices)

    def _all_reduce_leaves(
        self, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], paths: LeafPaths | None = None
    ) -> list[list[Array]]:
        """The replica-context all-reduce (``ReplicaContext.all_reduce``): ``out[r][j]``, fresh arrays.

        ``per_replica_leaves[r][j]`` is leaf ``j`` of replica ``r``; ``paths`` names the leaves in
        errors. This algorithm's: the data plane's all-reduce (host fast path, then one packed
        kernel call per dtype and pack, GPU packs through :meth:`_reducer`). A class whose
        algorithm differs overrides this and :meth:`_all_reduce_arrays` both.
        """
        return reductions.all_reduce(
            op, per_replica_leaves, num_packs=self.num_packs, reducer_for=self._reducer, paths=paths
        )

    def _all_reduce_arrays(self, op: ReduceOp, arrays: Sequence[Any]) -> list[Array]:
        """:meth:`_all_reduce_leaves` of one array (or scalar) per replica: ``out[r]``.

        The per-step common case: host arrays skip the nest handling (same results, same errors).
        """
        return reductions.all_reduce_arrays(op, arrays, num_packs=self.num_packs, reducer_for=self._reducer)


class KernelAllReduce(CrossDeviceOps):
    """The default on CPUs: one fused all-reduce kernel call per dtype (all of a step's values packed).

    Args:
        num_packs: how many kernel calls per dtype a batch is split into (0: one per value).

    Raises:
        ValueError: ``num_packs`` is negative or not an int.
    """

    _fuses_sum = True  # (see CrossDeviceOps._fuses_sum)

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _check_num_packs(type(self).__name__, num_packs)


def _check_num_packs(name: str, num_packs: int | np.integer[Any]) -> int:
    if isinstance(num_packs, bool) or not isinstance(num_packs, (int, np.integer)) or num_packs < 0:
        raise ValueError(f"{name} requires num_packs >= 0, but {num_packs!r} is specified")
    return int(num_packs)


class ReductionToOneDevice(CrossDeviceOps):
    """Reduces to one device, then broadcasts the result back (``tf.distribute.ReductionToOneDevice``).

    Args:
        reduce_to_device: the device the reduction happens on: the values are copied there first
            (default: where the first value is).
        accumulation_fn: accepted for TF compatibility; the kernels' fixed-order sum is always used.

    Raises:
        ValueError: ``reduce_to_device`` is not a valid device string.
        TypeError: ``accumulation_fn`` is not callable.
    """

    def __init__(
        self, reduce_to_device: _devices.DeviceLike | None = None, accumulation_fn: Callable[..., Any] | None = None
    ) -> None:
        self.reduce_to_device = None if reduce_to_device is None else _devices.canonicalize(reduce_to_device)
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(f"accumulation_fn must be callable, got {type(accumulation_fn).__name__}")
        self.accumulation_fn = accumulation_fn
        self.num_packs = 1

    def _to_reduce_device(self, comps: Sequence[Any]) -> Sequence[Any]:
        if self.reduce_to_device is None:
            return comps
        return [place(c, self.reduce_to_device) for c in comps]

    def _all_reduce_leaves(
        self, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], paths: LeafPaths | None = None
    ) -> list[list[Array]]:
        """Reduce to one device (``reduce_to_device``, else the first replica's), then broadcast."""
        packing.check_same_leaves("all_reduce", per_replica_leaves, paths)
        outs = reductions.all_reduce_via_one(
            "all_reduce", op, [self._to_reduce_device(leaves) for leaves in per_replica_leaves]
        )
        if self.reduce_to_device is not None:  # each replica's result back on its own device
            outs = [[like(o, a) for o, a in zip(out, leaves)] for out, leaves in zip(outs, per_replica_leaves)]
        return outs

    def _all_reduce_arrays(self, op: ReduceOp, arrays: Sequence[Any]) -> list[Array]:
        return [o[0] for o in self._all_reduce_leaves(op, [[a] for a in arrays])]


class HierarchicalCopyAllReduce(KernelAllReduce):
    """``tf.distribute.HierarchicalCopyAllReduce``, accepted for TF compatibility: the fused all-reduce.

    TF's algorithm reduces within groups of GPUs, then across groups, to follow a DGX-1's links.
    Our fused kernel reads every replica's buffer in one pass (host memory, or peer access on
    GPUs), which leaves no hierarchy to exploit, so this is :class:`KernelAllReduce` by TF's name.

    Args:
        num_packs: as :class:`KernelAllReduce`'s.
    """

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _check_num_packs("HierarchicalCopy", num_packs)


def _replica_gpus_of(per_replica_leaves: Sequence[Sequence[Any]]) -> list[int | None] | None:
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

    Args:
        num_packs: how many kernel calls per dtype a batch is split into (0: one per value).
    """

    _needs_gpu = True
    _fuses_sum = True  # (see CrossDeviceOps._fuses_sum)

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _check_num_packs("P2PAllReduce", num_packs)


class NcclAllReduce(CrossDeviceOps):
    """NCCL all-reduce (``tf.distribute.NcclAllReduce``); GPU devices only.

    One process drives every GPU: a communicator per set of physical GPUs
    (``cupy.cuda.nccl.NcclCommunicator.initAll``), one grouped ``allReduce`` per packed buffer.
    Logical GPUs split from one physical GPU cannot be separate ranks of one communicator, so there
    the P2P kernels are used instead (``repr`` says so, and binding it to such a strategy warns).
    CuPy's NCCL bindings are imported when the op is bound to GPU devices or first runs, not here.

    Args:
        num_packs: how many NCCL calls per dtype a batch is split into (0: one per value).
    """

    _needs_gpu = True
    # batch_reduce (the optimizers' reduction) is the P2P kernels' sum: NCCL serves the replica
    # context's all_reduce only (_reducer).
    _fuses_sum = True
    _fallback: str | None = None  # why P2P is used instead of NCCL (None: NCCL is used)
    _nccl: ModuleType  # cupy.cuda.nccl, once loaded

    def __init__(self, num_packs: int = 1) -> None:
        self.num_packs = _check_num_packs("NCCL all-reduce", num_packs)

    def __repr__(self) -> str:
        extra = f" (falls back to P2P: {self._fallback})" if self._fallback else ""
        return f"<cudist.NcclAllReduce num_packs={self.num_packs}{extra}>"

    def _bind(self, devices: Sequence[str], physical: Sequence[int] | None) -> None:
        if physical is None:
            return
        if len(set(physical)) != len(physical):
            self._fallback = (
                f"{describe_layout(physical)}; logical GPUs on one physical GPU cannot share an NCCL communicator"
            )
            warnings.warn(
                f"NcclAllReduce: {self._fallback}, so the P2P kernels (cudist.P2PAllReduce) do the all-reduce",
                UserWarning,
                stacklevel=4,
            )
            return
        self._fallback = None
        if len(physical) > 1:
            nccl, why = _nccl.load()
            if nccl is None:
                raise BackendUnavailableError(f"NcclAllReduce cannot run: {why}; or use cudist.P2PAllReduce()")
            self._nccl = nccl

    def _reducer(self, per_replica_leaves: Sequence[Sequence[Any]]) -> Reducer | None:
        if len(per_replica_leaves) < 2:
            return None  # nothing to reduce
        physical = _replica_gpus_of(per_replica_leaves)
        if physical is None or len(set(physical)) != len(physical):
            return None  # logical GPUs sharing a GPU: the P2P kernels
        nccl = self.__dict__.get("_nccl")
        if nccl is None:
            nccl, why = _nccl.load()
            if nccl is None:
                raise BackendUnavailableError(f"NcclAllReduce cannot run: {why}; or use cudist.P2PAllReduce()")
            self._nccl = nccl
        dtypes = _nccl.dtype_codes(nccl)

        def reduce(backend: KernelBackend, bufs: list[Any], op: ReduceOp) -> None:
            if bufs[0].dtype in dtypes and len({b.device.id for b in bufs}) == len(bufs):
                _nccl.all_reduce(nccl, bufs, op)
            else:
                backend.all_reduce(bufs, op)

        return reduce


class AutoGpuAllReduce(CrossDeviceOps):
    """The default over several physical GPUs: P2P kernels for small buffers, NCCL for large ones.

    A packed buffer of at least :attr:`NCCL_MIN_BYTES` goes through NCCL, a smaller one through the
    P2P kernels (lower latency: one launch, no NCCL protocol). Strategies on a single physical GPU
    (logical GPUs included), with several logical GPUs per physical GPU, or without NCCL get a plain
    :class:`P2PAllReduce` by default instead (see :func:`select_cross_device_ops`).

    Args:
        physical: the CUDA device id of each replica (distinct).
        nccl: the ``cupy.cuda.nccl`` module (see :func:`cudist._dataplane.transports.nccl.load`).
        num_packs: how many buffers per dtype a batch is split into (0: one per value).
    """

    _needs_gpu = True
    _fuses_sum = True  # (as NcclAllReduce's: NCCL serves the replica context's all_reduce only)
    #: Packed buffers of at least this many bytes use NCCL (the replicas being on distinct GPUs).
    NCCL_MIN_BYTES = 8 << 20

    def __init__(self, physical: Sequence[int], nccl: ModuleType, num_packs: int = 1) -> None:
        self.num_packs = _check_num_packs("AutoGpuAllReduce", num_packs)
        self._physical = tuple(physical)
        self._nccl = nccl
        self._default_note = f"default for {describe_layout(self._physical)}"

    def __repr__(self) -> str:
        return (
            f"<cudist.AutoGpuAllReduce num_packs={self.num_packs}: P2PAllReduce below "
            f"{_format_bytes(self.NCCL_MIN_BYTES)} per buffer, NcclAllReduce from there ({self._default_note})>"
        )

    def _reducer(self, per_replica_leaves: Sequence[Sequence[Any]]) -> Reducer | None:
        del per_replica_leaves
        nccl = self._nccl
        dtypes = _nccl.dtype_codes(nccl)
        threshold = self.NCCL_MIN_BYTES

        def reduce(backend: KernelBackend, bufs: list[Any], op: ReduceOp) -> None:
            if (
                bufs[0].nbytes >= threshold
                and bufs[0].dtype in dtypes
                and len({b.device.id for b in bufs}) == len(bufs)
            ):
                _nccl.all_reduce(nccl, bufs, op)
            else:
                backend.all_reduce(bufs, op)

        return reduce


def default_gpu_ops(physical: Sequence[int]) -> CrossDeviceOps:
    """The default cross-device ops for replicas on the physical GPUs ``physical`` (one id per replica).

    NCCL needs one replica per physical GPU and at least two of them; otherwise, or when NCCL cannot
    be loaded, the P2P kernels do everything.
    """
    layout = describe_layout(physical)
    if len(physical) > 1 and len(set(physical)) == len(physical):
        nccl, why = _nccl.load()
        if nccl is not None:
            return AutoGpuAllReduce(physical, nccl)
        note = f"default for {layout}; NCCL unavailable: {why}"
    else:
        note = f"default for {layout}"
    ops = P2PAllReduce()
    ops._default_note = note
    return ops


# ------------------------------------------------------------------- what the orchestration calls
def all_reduce(
    ops: CrossDeviceOps, op: ReduceOp, per_replica_leaves: Sequence[Sequence[Any]], paths: LeafPaths | None = None
) -> list[list[Array]]:
    """The replica-context all-reduce (``ReplicaContext.all_reduce``) of ``ops``'s algorithm.

    Args:
        ops: the strategy's cross-device ops.
        op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``.
        per_replica_leaves: ``per_replica_leaves[r][j]`` is leaf ``j`` (an array) of replica ``r``.
        paths: the leaves' names, for errors.

    Returns:
        ``out[r][j]``, fresh arrays.
    """
    return ops._all_reduce_leaves(op, per_replica_leaves, paths)


def all_reduce_arrays(ops: CrossDeviceOps, op: ReduceOp, arrays: Sequence[Any]) -> list[Array]:
    """:func:`all_reduce` of one array per replica (the per-step common case): ``out[r]``."""
    return ops._all_reduce_arrays(op, arrays)


def arrays_reducer(ops: CrossDeviceOps) -> Callable[[ReduceOp, Sequence[Any]], list[Array]]:
    """:func:`all_reduce_arrays` bound to ``ops`` (a caller that keeps it saves a call per all-reduce)."""
    return ops._all_reduce_arrays


def fused_sum_backend(ops: CrossDeviceOps, arrays: Sequence[Any]) -> KernelBackend | None:
    """The kernel backend that may sum these per-replica arrays fused into an optimizer update
    under ``ops`` (None: optimizers reduce through ``extended.batch_reduce_to`` first)."""
    return ops._fused_sum_backend(arrays)


def pipelined_sums(
    ops: CrossDeviceOps,
    per_replica_leaves: Sequence[Sequence[Any]],
    consume: Callable[[list[int], list[Any]], None],
    settle: Callable[[], Sequence[Sequence[Any]]] | None = None,
) -> bool:
    """The SUM of each leaf over every replica, pack by pack into ``consume``, pipelined; False: not
    done (optimizers reduce through ``extended.batch_reduce_to``)."""
    return ops._pipelined_sums(per_replica_leaves, consume, settle)


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def _reduce_op(reduce_op: object) -> ReduceOp:
    if not isinstance(reduce_op, ReduceOp):
        raise ValueError(f"`reduce_op` must be Reduce.SUM or Reduce.MEAN, got {reduce_op!r}")
    return reduce_op


def select_cross_device_ops(devices: Sequence[str], cross_device_ops: CrossDeviceOps | None = None) -> CrossDeviceOps:
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

