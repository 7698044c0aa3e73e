"""``cudist.cluster_resolver``: who the workers of a multi-worker job are (``tf.distribute.cluster_resolver``).

A cluster resolver tells :class:`cudist.MultiWorkerMirroredStrategy` the cluster (a
:class:`ClusterSpec`: job name -> task addresses) and which task this process is:

* :class:`TFConfigClusterResolver` reads the ``TF_CONFIG`` environment variable, as TF's does
  (``{"cluster": {"chief": [...], "worker": [...]}, "task": {"type": "worker", "index": 0}}``);
* :class:`MPIClusterResolver` asks MPI (``mpiexec``'s rank and size); under ``mpiexec`` with a
  ``TF_CONFIG`` as well, the cluster is TF_CONFIG's and the task index maps to the rank;
* :class:`SimpleClusterResolver` holds what it is given.

The chief follows TF's ``multi_worker_util``: the ``chief`` task if the cluster has one, else
worker 0 (:func:`is_chief`). Worker ids count the chief first, then the workers (:func:`id_in_cluster`).

cudist does not talk gRPC: addresses are informational, the workers find each other through MPI
(``python -m cudist.launch -n N script.py``); ``rpc_layer`` is kept for TF compatibility.
"""

from __future__ import annotations

import abc
import json
import os
import socket

__all__ = [
    "ClusterSpec",
    "ClusterResolver",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "MPIClusterResolver",
]

_TF_CONFIG = "TF_CONFIG"
_WORKER_JOBS = ("chief", "worker")
_ALLOWED_JOBS = ("chief", "worker", "evaluator", "ps")


# ---------------------------------------------------------------------------------------------- ClusterSpec
class ClusterSpec:
    """A cluster as a map from job names to task addresses (``tf.train.ClusterSpec``).

    Jobs keep the order they are given in (``jobs``); a copy of another ClusterSpec has its jobs
    sorted by name (as TF's, which copies through a ``ClusterDef``).

    Args:
        cluster: a dict mapping each job name to a list of addresses (task i is the i-th) or to a
            dict ``{task index: address}`` (sparse; indices as ints or, as JSON gives them, strings
            of ints); or another ClusterSpec.

    Raises:
        TypeError: ``cluster`` is not a dict or ClusterSpec; a job name, a job's tasks or an
            address of the wrong type.
        ValueError: a sparse task index that is not an integer.
    """

    def __init__(self, cluster):
        if isinstance(cluster, ClusterSpec):
            self._cluster = {job: dict(cluster._cluster[job]) for job in sorted(cluster._cluster)}
            return
        if not isinstance(cluster, dict):
            raise TypeError(f"ClusterSpec: cluster must be a dict or a ClusterSpec, got {type(cluster).__name__}")
        self._cluster = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str):
                raise TypeError(f"ClusterSpec: job names must be strings, got {job!r}")
            if isinstance(tasks, dict):
                parsed = {}
                for i, addr in tasks.items():
                    try:  # TF's int(): JSON's "1" is task 1
                        index = int(i)
                    except (TypeError, ValueError):
                        raise ValueError(f"ClusterSpec: task index {i!r} of job {job!r} is not an integer") from None
                    parsed[index] = _address(job, addr)
            elif isinstance(tasks, (list, tuple)):
                parsed = {i: _address(job, addr) for i, addr in enumerate(tasks)}
            else:
                raise TypeError(f"ClusterSpec: the tasks of job {job!r} must be a list or a dict, got {tasks!r}")
            self._cluster[job] = parsed

    def __bool__(self) -> bool:
        return bool(self._cluster)

    def __eq__(self, other) -> bool:
        return isinstance(other, ClusterSpec) and self._cluster == other._cluster

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(json.dumps(self.as_dict(), sort_keys=True, default=str))

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    @property
    def jobs(self) -> list:
        """The job names, in the order the cluster gave them (as TF's)."""
        return list(self._cluster)

    def as_dict(self) -> dict:
        """Job name -> list of addresses (dict of index -> address for a sparse job), as TF's."""
        out = {}
        for job, tasks in self._cluster.items():
            idx = sorted(tasks)
            out[job] = [tasks[i] for i in idx] if idx == list(range(len(idx))) else {i: tasks[i] for i in idx}
        return out

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has.

        Raises:
            ValueError: no such job.
        """
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list:
        """The task indices of ``job_name``, sorted."""
        return sorted(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of ``job_name``.

        Raises:
            ValueError: no such job or task.
        """
        tasks = self._job(job_name)
        if task_index not in tasks:
            raise ValueError(f"No task with index {task_index!r} in job {job_name!r}")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list:
        """The addresses of ``job_name``'s tasks, by index (None where a sparse job has a gap)."""
        tasks = self._job(job_name)
        if not tasks:
            return []
        return [tasks.get(i) for i in range(max(tasks) + 1)]

    def _job(self, job_name):
        if job_name not in self._cluster:
            raise ValueError(f"No such job in cluster: {job_name!r}")
        return self._cluster[job_name]


def _address(job: str, addr) -> str:
    if isinstance(addr, bytes):
        return addr.decode()
    if not isinstance(addr, str):
        raise TypeError(f"ClusterSpec: task address {addr!r} of job {job!r} must be bytes or unicode")
    return addr


def normalize_cluster_spec(cluster_spec) -> ClusterSpec:
    """A ClusterSpec from a dict or ClusterSpec (TF's ``multi_worker_util.normalize_cluster_spec``)."""
    if isinstance(cluster_spec, ClusterSpec):
        return cluster_spec
    if isinstance(cluster_spec, dict):
        return ClusterSpec(cluster_spec)
    raise ValueError(f"`cluster_spec' should be dict or a `tf.train.ClusterSpec`, got {type(cluster_spec).__name__}")


# ---------------------------------------------------------------------------------------------- chief rules
def validate_cluster_spec(cluster_spec, task_type, task_id) -> None:
    """TF's checks: known job names, at most one chief, the task in the cluster."""
    spec = normalize_cluster_spec(cluster_spec).as_dict()
    if task_type not in _ALLOWED_JOBS:
        raise ValueError(f"Unrecognized task_type: {task_type!r}, valid task types are: {list(_ALLOWED_JOBS)}")
    for job in spec:
        if job not in _ALLOWED_JOBS:
            raise ValueError(f"Unrecognized job name in cluster: {job!r}, valid job names are: {list(_ALLOWED_JOBS)}")
    if len(spec.get("chief", [])) > 1:
        raise ValueError("There must be at most one 'chief' job.")
    if task_type not in spec and task_type != "evaluator":
        raise ValueError(f"`task_type` {task_type!r} not found in cluster_spec.")
    if task_type in spec:
        n = len(spec[task_type])
        if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 <= task_id < n:
            raise ValueError(f"The `task_id` {task_id!r} exceeds the maximum id of {task_type}.")


def is_chief(cluster_spec=None, task_type=None, task_id=None) -> bool:
    """Whether the task is the chief: the ``chief`` task (or an evaluator), else worker 0 when there is no chief."""
    if not cluster_spec:
        return True
    validate_cluster_spec(cluster_spec, task_type, task_id)
    spec = normalize_cluster_spec(cluster_spec).as_dict()
    if task_type in ("chief", "evaluator"):
        return True
    return "chief" not in spec and task_type == "worker" and task_id == 0


def worker_count(cluster_spec, task_type) -> int:
    """How many workers take part in collectives: chief + workers (the evaluators for an evaluator)."""
    validate_cluster_spec(cluster_spec, task_type, 0)
    spec = normalize_cluster_spec(cluster_spec).as_dict()
    if task_type not in ("chief", "worker", "evaluator"):
        raise ValueError(f"Unexpected `task_type` {task_type!r}")
    if task_type == "evaluator":
        return len(spec["evaluator"])
    return len(spec.get("chief", [])) + len(spec.get("worker", []))


def id_in_cluster(cluster_spec, task_type, task_id) -> int:
    """The task's id among the workers: the chief is 0, worker i is i (+1 with a chief)."""
    validate_cluster_spec(cluster_spec, task_type, task_id)
    spec = normalize_cluster_spec(cluster_spec).as_dict()
    if task_type == "chief":
        return 0
    if task_type == "worker":
        return task_id + len(spec.get("chief", []))
    if task_type == "evaluator":
        return task_id
    raise ValueError(f"There is no id for task_type {task_type!r}")


# ---------------------------------------------------------------------------------------------- resolvers
class ClusterResolver(abc.ABC):
    """The abstract cluster resolver (``tf.distribute.cluster_resolver.ClusterResolver``)."""

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster as a :class:`ClusterSpec`."""

    @abc.abstractmethod
    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """The address of a task (this one by default), prefixed with ``rpc_layer://`` if given."""

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        """Accelerators per type on this machine: ``{"GPU": n}`` (empty without GPUs).

        Raises:
            ValueError: the task is not in the cluster (TF asks the task's master for its devices).
        """
        del config_proto
        self.master(task_type, task_id)
        from cudist import config  # noqa: PLC0415 - only when asked

        n = len(config.list_physical_devices("GPU"))
        return {"GPU": n} if n else {}

    @property
    def environment(self) -> str | None:
        """The environment the job runs in ("" here, as TF's default)."""
        return ""

    @property
    def task_type(self):
        """This process's job name ("worker", "chief", ...) or None."""
        return getattr(self, "_task_type", None)

    @task_type.setter
    def task_type(self, task_type):
        self._task_type = task_type

    @property
    def task_id(self):
        """This process's task index within its job, or None."""
        return getattr(self, "_task_id", None)

    @task_id.setter
    def task_id(self, task_id):
        self._task_id = task_id

    @property
    def rpc_layer(self):
        """The RPC layer TF would use ("grpc"); informational here."""
        return getattr(self, "_rpc_layer", None)

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer):
        self._rpc_layer = rpc_layer

    def __repr__(self) -> str:
        return (
            f"<cudist.cluster_resolver.{type(self).__name__} task={self.task_type}:{self.task_id} "
            f"cluster={self.cluster_spec().as_dict()}>"
        )


def _format_master(address: str, rpc_layer) -> str:
    return f"{rpc_layer}://{address}" if rpc_layer else address


class SimpleClusterResolver(ClusterResolver):
    """A resolver holding what it is given (``tf.distribute.cluster_resolver.SimpleClusterResolver``)."""

    def __init__(self, cluster_spec, master="", task_type=None, task_id=None, environment="",
                 num_accelerators=None, rpc_layer=None):
        self._cluster_spec = normalize_cluster_spec(cluster_spec)
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        if task_type is not None and task_id is not None:
            return _format_master(self._cluster_spec.task_address(task_type, task_id), rpc_layer or self._rpc_layer)
        return _format_master(self._master, rpc_layer or self._rpc_layer) if self._master else ""

    @property
    def environment(self) -> str:
        return self._environment

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        if self._num_accelerators is not None:
            return dict(self._num_accelerators)
        return super().num_accelerators(task_type, task_id, config_proto)


def _load_tf_config() -> dict:
    raw = os.environ.get(_TF_CONFIG, "")
    if not raw.strip():
        return {}
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object, got {type(cfg).__name__}")
    return cfg


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this task from ``TF_CONFIG`` (``tf.distribute.cluster_resolver.TFConfigClusterResolver``).

    As TF 2.21's: ``task_type`` is a string and ``task_id`` an int whether they come from TF_CONFIG
    or the constructor; ``environment`` is only what the constructor was given (TF_CONFIG's
    ``environment`` is not read).

    Args:
        task_type: overrides TF_CONFIG's ``task`` type.
        task_id: overrides TF_CONFIG's ``task`` index.
        rpc_layer: override TF_CONFIG's ``rpc_layer``.
        environment: the environment the job runs in (None unless given).
    """

    def __init__(self, task_type=None, task_id=None, rpc_layer=None, environment=None):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def task_type(self):
        if self._task_type is not None:
            return str(self._task_type)
        t = _load_tf_config().get("task", {}).get("type")
        return str(t) if t is not None else None

    @task_type.setter
    def task_type(self, task_type):
        self._task_type = task_type

    @property
    def task_id(self):
        if self._task_id is not None:
            return int(self._task_id)
        i = _load_tf_config().get("task", {}).get("index")
        return int(i) if i is not None else None

    @task_id.setter
    def task_id(self, task_id):
        self._task_id = task_id

    @property
    def rpc_layer(self):
        if self._rpc_layer is not None:
            return self._rpc_layer
        return _load_tf_config().get("rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer):
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        return self._environment

    def cluster_spec(self) -> ClusterSpec:
        """TF_CONFIG's ``cluster`` (an empty ClusterSpec without TF_CONFIG)."""
        return ClusterSpec(_load_tf_config().get("cluster", {}))

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        """TF_CONFIG's ``session_master`` if set; "" for a cluster of at most one task; else the
        task's address (this task's by default), prefixed with ``rpc_layer://``.

        Raises:
            ValueError: the task (or, without one, this process's task) is not in the cluster.
        """
        session_master = _load_tf_config().get("session_master")
        if session_master is not None:
            return session_master
        spec = self.cluster_spec()
        jobs = spec.jobs
        if not jobs or (len(jobs) == 1 and len(spec.job_tasks(jobs[0])) == 1):
            return ""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        return _format_master(spec.task_address(task_type, task_id), rpc_layer or self.rpc_layer)


class MPIClusterResolver(ClusterResolver):
    """The cluster of an MPI job: one ``worker`` task per rank (cudist's; TF has none).

    Under ``mpiexec`` (or ``python -m cudist.launch``) the rank and size come from MPI; a plain
    ``python script.py`` is a one-worker cluster and loads no MPI. With a ``TF_CONFIG`` (one for all
    ranks, as a scheduler may set it), the cluster is TF_CONFIG's and task ``k`` in its worker order
    (the chief first, then the workers) is rank ``k``.

    Args:
        comm: the mpi4py communicator whose ranks are the workers (default: ``MPI.COMM_WORLD``).

    Raises:
        ValueError: a TF_CONFIG cluster whose worker count is not the number of ranks.
    """

    def __init__(self, comm=None):
        from cudist._dataplane.transports import mpi  # noqa: PLC0415

        if comm is None:
            comm = mpi.world()
        self._comm = comm
        if comm is None:
            rank, size = 0, 1
        else:
            rank, size = comm.Get_rank(), comm.Get_size()
        self._rank, self._size = rank, size
        cfg = _load_tf_config()
        cluster = cfg.get("cluster")
        if cluster:
            spec = ClusterSpec(cluster)
            tasks = [(job, i) for job in _WORKER_JOBS if job in spec.jobs for i in spec.task_indices(job)]
            if len(tasks) != size:
                raise ValueError(
                    f"MPIClusterResolver: TF_CONFIG's cluster has {len(tasks)} chief/worker task(s) but the MPI job "
                    f"has {size} rank(s); run as many ranks as tasks"
                )
            self._cluster_spec = spec
            self._task_type, self._task_id = tasks[rank]
        else:
            host = socket.gethostname()
            if comm is not None and size > 1:
                hosts = mpi.allgather_setup(comm, host, "host names")
            else:
                hosts = [host]
            self._cluster_spec = ClusterSpec({"worker": [f"{h}:{r}" for r, h in enumerate(hosts)]})
            self._task_type, self._task_id = "worker", rank
        self._rpc_layer = cfg.get("rpc_layer")
        self._environment = cfg.get("environment", "")

    @property
    def comm(self):
        """The mpi4py communicator (None in a one-worker job without MPI)."""
        return self._comm

    @property
    def environment(self) -> str:
        return self._environment

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    def master(self, task_type=None, task_id=None, rpc_layer=None) -> str:
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        return _format_master(self._cluster_spec.task_address(task_type, task_id), rpc_layer or self._rpc_layer)
