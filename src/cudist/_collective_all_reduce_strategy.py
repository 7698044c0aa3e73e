"""``MultiWorkerMirroredStrategy``: synchronous replicas over the workers of an MPI job (TF's module name).

Each worker (one process, started by ``python -m cudist.launch -n N script.py`` or ``mpiexec``)
runs the same program on its local replicas -- one per local device, as MirroredStrategy picks
them (every GPU, else the CPU) -- and the replicas of all workers stay in sync: all-reduces are
hierarchical (:class:`cudist._collective_ops.CollectiveAllReduce`: local kernels, then MPI),
variables start from the chief's initial values (broadcast at creation), ``reduce``/``gather`` in
cross-replica context are global, and input is split over workers, then local replicas.

A plain ``python script.py`` is a one-worker job: no MPI is loaded and the strategy behaves as
a MirroredStrategy over the local devices.
"""

from __future__ import annotations

import logging

import numpy as np

from cudist import _devices, _settings
from cudist._arrays import like, to_host
from cudist._collective_ops import CollectiveAllReduce
from cudist._collective_util import CommunicationImplementation, CommunicationOptions
from cudist._dataplane.transports import mpi
from cudist._dataplane.transports import nccl as nccl_lib
from cudist._dataplane.transports import shm
from cudist._cross_device_ops import select_cross_device_ops
from cudist._distribute_lib import Strategy, default_devices, parse_devices
from cudist._kernels import BackendUnavailableError
from cudist._mirrored_strategy import MirroredExtended
from cudist._values import DistributedValues, PerReplica
from cudist._variables import MirroredVariable
from cudist.cluster_resolver import (
    ClusterResolver,
    MPIClusterResolver,
    TFConfigClusterResolver,
    id_in_cluster,
    is_chief,
    worker_count,
)

__all__ = ["MultiWorkerMirroredStrategy", "CollectiveAllReduceExtended"]

_log = logging.getLogger("cudist")


def _default_resolver():
    """TF_CONFIG's task if it names one; else MPI's ranks under an MPI launcher; else a one-worker TF_CONFIG resolver."""
    tf_config = TFConfigClusterResolver()
    if tf_config.task_type is not None and tf_config.cluster_spec():
        return tf_config
    if _settings.launched_by_mpi():
        return MPIClusterResolver()
    return tf_config


class CollectiveAllReduceExtended(MirroredExtended):
    """Extended API of :class:`MultiWorkerMirroredStrategy` (TF's ``CollectiveAllReduceExtended``)."""

    _per_replica_input_supported = False  # TF 2.21: PER_REPLICA input is MirroredStrategy's only

    def __init__(self, container_strategy, cluster_resolver, communication_options, devices):
        if cluster_resolver is None:
            cluster_resolver = _default_resolver()
        if not isinstance(cluster_resolver, ClusterResolver):
            raise ValueError(
                "cluster_resolver must be a cudist.cluster_resolver.ClusterResolver, got "
                f"{type(cluster_resolver).__name__}"
            )
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise ValueError(
                "communication_options must be a cudist.experimental.CommunicationOptions, got "
                f"{type(communication_options).__name__}"
            )
        self._cluster_resolver = cluster_resolver
        self._communication_options = communication_options
        spec = cluster_resolver.cluster_spec()
        task_type, task_id = cluster_resolver.task_type, cluster_resolver.task_id
        if spec and task_type is not None and task_type != "evaluator":
            task_id = 0 if task_id is None else int(task_id)
            self._num_workers = worker_count(spec, task_type)
            self._worker_index = id_in_cluster(spec, task_type, task_id)
            self._is_chief = is_chief(spec, task_type, task_id)
        else:  # a local job (or an evaluator, which runs alone)
            self._num_workers, self._worker_index, self._is_chief = 1, 0, True
        self._task_type, self._task_id = task_type, task_id
        self._id_in_cluster = self._worker_index
        devs = default_devices() if devices is None else parse_devices(devices, "MultiWorkerMirroredStrategy")
        if communication_options.implementation is CommunicationImplementation.NCCL and not _devices.any_gpu(devs):
            raise ValueError("NCCL is requested but no GPU is available (the local devices are CPUs).")
        nccl = self._load_nccl(devs)
        self._communicator = self._connect()
        worker_nccl = None
        if nccl is not None and self._communicator is not None:
            worker_nccl = nccl_lib.WorkerCommunicator(nccl, self._communicator)
        # RING asks for MPI's own all-reduce for every byte (as it stages GPU values through MPI).
        host_transport = shm.connect(
            self._communicator, communication_options.implementation is not CommunicationImplementation.RING
        )
        ops = CollectiveAllReduce(
            self._communicator, select_cross_device_ops(devs), communication_options.bytes_per_pack, nccl=worker_nccl,
            host_transport=host_transport, compression=communication_options.compression,
        )
        self._host_transport = host_transport
        if host_transport is not None:
            _log.info("MultiWorkerMirroredStrategy: host values cross workers through %s", host_transport.name)
        if self._communicator is not None and _devices.any_gpu(devs):
            _log.info("MultiWorkerMirroredStrategy: GPU values cross workers through %s", ops.gpu_implementation)
        super().__init__(container_strategy, devs, ops)
        if self._communicator is not None:  # connected to the other workers: from here on, TF names devices by task
            _devices.set_local_task(task_type, task_id)

    def _load_nccl(self, devs):
        """``cupy.cuda.nccl`` when GPU values should cross workers through NCCL, else None.

        NCCL: GPU devices (checked before) and a loadable NCCL, else an error naming what to
        install. AUTO: NCCL when the devices are GPUs and NCCL loads (as TF picks NCCL for GPU
        all-reduces), else MPI. RING: MPI (staged through the host).
        """
        impl = self._communication_options.implementation
        if impl is CommunicationImplementation.RING or not _devices.any_gpu(devs):
            return None
        if impl is CommunicationImplementation.AUTO and self._num_workers == 1:
            return None  # nothing crosses workers: do not load NCCL for nothing
        nccl, why = nccl_lib.load()
        if nccl is None and impl is CommunicationImplementation.NCCL:
            raise BackendUnavailableError(
                f"MultiWorkerMirroredStrategy: CommunicationImplementation.NCCL is requested, but {why} "
                "(or use CommunicationImplementation.RING: GPU values staged through the host over MPI)"
            )
        return nccl

    def _connect(self):
        """The workers' communicator, ranks in worker order (chief first); None for one worker."""
        if self._num_workers == 1:
            world = mpi.world()
            if world is not None and world.Get_size() > 1 and self._task_type != "evaluator":
                # Training alone inside a job of several would diverge silently (and leave the
                # others waiting for this worker in their first collective).
                raise ValueError(
                    f"this process is one of the {world.Get_size()} processes of an MPI job, but its cluster "
                    f"({type(self._cluster_resolver).__name__}: {self._cluster_resolver.cluster_spec().as_dict()}) "
                    "has one worker; give every process the same cluster (or no TF_CONFIG: one worker per rank)"
                )
            return None
        comm = getattr(self._cluster_resolver, "comm", None) or mpi.world()
        if comm is None:
            raise RuntimeError(
                f"the cluster has {self._num_workers} workers, but this process was not started by an MPI launcher: "
                f"cudist's workers talk MPI, not gRPC; start them with `python -m cudist.launch -n {self._num_workers} "
                "script.py` (or mpiexec)"
            )
        size = comm.Get_size()
        if size != self._num_workers:
            raise ValueError(
                f"the cluster has {self._num_workers} workers but the MPI job has {size} processes; "
                "start one process per chief/worker task"
            )
        # Ranks ordered as the workers (TF_CONFIG's task index maps to the rank order).
        claimed = mpi.allgather_setup(comm, self._worker_index, "worker ids")
        if sorted(claimed) != list(range(size)):
            dup = sorted({w for w in claimed if claimed.count(w) > 1})
            raise ValueError(
                f"the MPI job's processes claim worker ids {claimed} (from their tasks {self._task_type}:{self._task_id}"
                f" here); every chief/worker task must be claimed once{f', {dup} more than once' if dup else ''}: "
                "give each process its own TF_CONFIG task (python -m cudist.launch --tf-config does), or none"
            )
        ordered = comm.Split(0, self._worker_index)
        communicator = mpi.Communicator(ordered, timeout_seconds=self._communication_options.timeout_seconds)
        ordered.Free()
        return communicator

    # -------------------------------------------------------------- TF's properties
    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def experimental_should_init(self) -> bool:
        return True

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints (the chief)."""
        return self._is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (the chief)."""
        return self._is_chief

    @property
    def host_communication(self) -> str:
        """cudist extension: how host values cross workers ("MPI", or the shared-memory transport's
        description: ``"shared memory (one round below 131072 B)"``; "none" for one worker)."""
        if self._communicator is None:
            return "none"
        return self._cross_device_ops.host_implementation

    @property
    def host_transport(self):
        """cudist extension: the shared-memory transport (``cudist._dataplane.transports.shm``), or None (MPI)."""
        return self._host_transport

    @property
    def _communication(self):
        return self._communication_options.implementation

    # -------------------------------------------------------------- hooks
    def _create_variable(self, next_creator, **kwargs):
        """A mirrored variable whose initial value is the chief's (broadcast at creation)."""
        var = super()._create_variable(next_creator, **kwargs)
        comm = self._communicator
        if comm is None or not isinstance(var, DistributedValues) or getattr(var, "_cudist_broadcast", False):
            return var
        comps = var.values
        first = comps[0].storage.array
        host = np.array(to_host(first), copy=True, order="C")
        # MPI has no bfloat16 (ml_dtypes' kind "V"): such values travel as their bytes.
        comm.bcast(host if host.dtype.kind in "biufc" else host.reshape(-1).view(np.uint8), root=0,
                   kind=f"initial value of {var.name}")
        # Creation runs in cross-replica context (a replica's creation goes through merge_call), where
        # a mirrored variable's assign writes every copy in one pass (host copies sharing one storage: once).
        if isinstance(var, MirroredVariable):
            var.assign(host, read_value=False)
        else:
            for c in comps:
                c.assign(host, read_value=False)
        var._cudist_broadcast = True
        return var

    def _first_replica_value(self, value):
        """ONLY_FIRST_REPLICA: replica 0 of the whole job (the chief's first replica), on every worker."""
        local = super()._first_replica_value(value)
        if self._communicator is None:
            return local
        host = np.array(to_host(local), copy=True, order="C")
        self._communicator.bcast(host, root=0, kind="ONLY_FIRST_REPLICA value")
        return like(host, local) if not isinstance(local, np.ndarray) else host

    def _gather_across_workers(self, array, axis):
        if self._communicator is None:
            return array
        out = self._communicator.allgather_rows(to_host(array), axis)
        return out if isinstance(array, np.ndarray) else like(out, array)

    def _global_count(self, count):
        if self._communicator is None:
            return count
        return self._communicator.allreduce_value(int(count), "sum", kind="reduce count")

    def _any_worker(self, has_value: bool) -> bool:
        if self._communicator is None:
            return has_value
        return bool(self._communicator.allreduce_value(int(bool(has_value)), "max", kind="input sync"))

    def _local_value_of(self, value):
        """A non-distributed value in a multi-worker job is this worker's contribution, one per local replica."""
        if self._num_workers > 1 and not isinstance(value, DistributedValues):
            return PerReplica([value] * self._num)
        return value

    # -------------------------------------------------------------- the strategy's own checks
    def _check_replica_counts(self):
        """Raises ValueError unless every worker has as many local replicas as this one."""
        if self._num_workers > 1:
            counts = self._global_count(self._num)
            if counts != self._num * self._num_workers:
                raise ValueError(
                    f"MultiWorkerMirroredStrategy: workers have different numbers of local replicas "
                    f"(this worker {self._num}, {counts} in all over {self._num_workers} workers); give every worker as many"
                )

    def _describe(self):
        """``worker I of W (chief), N local replica(s)``: for the log line and ``repr``."""
        role = "chief" if self._is_chief else "not chief"
        return f"worker {self._worker_index} of {self._num_workers} ({role}), {self._num} local replica(s)"


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training on the workers of an MPI job (``tf.distribute.MultiWorkerMirroredStrategy``).

    Start the workers with ``python -m cudist.launch -n N script.py`` (or ``mpiexec -n N python
    script.py``); a plain ``python script.py`` is a one-worker job.

    Args:
        cluster_resolver: a :class:`cudist.cluster_resolver.ClusterResolver` (default: TF_CONFIG if
            it names this task, else the MPI job's ranks, else one local worker).
        communication_options: a :class:`cudist.experimental.CommunicationOptions`
            (``bytes_per_pack``, ``timeout_seconds``, ``implementation``; cudist's ``compression``).
        devices: cudist extension: this worker's local devices, one replica each (default: as
            MirroredStrategy, every logical GPU else "/cpu:0"); every worker must have as many.

    Raises:
        ValueError: a cluster whose size is not the MPI job's, bad options, NCCL without GPUs.
        RuntimeError: a cluster of several workers in a process not started by an MPI launcher.
    """

    def __init__(self, cluster_resolver=None, communication_options=None, *, devices=None):
        super().__init__(CollectiveAllReduceExtended(self, cluster_resolver, communication_options, devices))
        ext = self._extended
        ext._check_replica_counts()
        _log.info("MultiWorkerMirroredStrategy: %s, %d in sync", ext._describe(), self.num_replicas_in_sync)

    def __repr__(self) -> str:
        ext = self._extended
        return (
            f"<cudist.MultiWorkerMirroredStrategy worker {ext._worker_index} of {ext._num_workers}, "
            f"devices={ext.worker_devices}>"
        )

    @property
    def cluster_resolver(self):
        """The cluster resolver the strategy was built with (or the default one)."""
        return self._extended._cluster_resolver
