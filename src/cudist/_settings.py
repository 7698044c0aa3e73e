"""Every ``CUDIST_*`` environment variable cudist reads, in one table, with one typed accessor each.

This is the only module of ``src/cudist`` that reads a ``CUDIST_*`` variable (``tests/test_docs.py``
enforces it); other modules may *set* variables for child processes (the launcher, the benchmarks).
Each accessor reads the environment when called, so a test or a benchmark that changes a variable sees
the change at the next read; callers cache where the table's "read when" says so. A value that cannot
be used is a ``ValueError`` naming the variable and what it accepts.

:data:`TABLE` is the source of truth of ``docs/reference/environment.md``: ``tests/test_docs.py``
checks that the page's tables are :func:`markdown_table`'s rendering of it (regenerate a section
with ``python -c "from cudist import _settings; print(_settings.markdown_table('runtime'))"``).

Layer 0: imports nothing from cudist.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "Setting",
    "TABLE",
    "SECTIONS",
    "markdown_table",
    "overridden",
    "backend",
    "replica_execution",
    "cuda_launchers",
    "check_collectives",
    "stall_warning_seconds",
    "shm_transport",
    "shm_min_bytes",
    "node_size",
    "pipeline_update",
    "checkpoint_writer_nice",
    "num_threads",
    "launch_status_dir",
    "bench_tf_python",
    "bench_torch_python",
    "BACKEND",
    "REPLICA_EXECUTION",
    "CUDA_LAUNCHERS",
    "CHECK_COLLECTIVES",
    "STALL_WARNING_SECONDS",
    "SHM_TRANSPORT",
    "SHM_MIN_BYTES",
    "NODE_SIZE",
    "PIPELINE_UPDATE",
    "CHECKPOINT_WRITER_NICE",
    "CHECKPOINT_DIRECT_IO",
    "POOL_SPIN_US",
    "NUM_THREADS",
    "LAUNCH_STATUS_DIR",
    "BENCH_TF_PYTHON",
    "BENCH_TORCH_PYTHON",
    "MPI_LAUNCHER_ENV",
    "launched_by_mpi",
]


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default, what it does and when it is read.

    Attributes:
        name: the variable, ``CUDIST_...``.
        section: the docs table it belongs to: ``runtime``, ``internal`` (set by cudist itself) or
            ``bench``.
        default: the default, as the docs print it.
        meaning: what it does and the values it accepts.
        read_when: when cudist reads it.
    """

    name: str
    section: str
    default: str
    meaning: str
    read_when: str


BACKEND = "CUDIST_BACKEND"
REPLICA_EXECUTION = "CUDIST_REPLICA_EXECUTION"
POOL_SPIN_US = "CUDIST_POOL_SPIN_US"
NUM_THREADS = "CUDIST_NUM_THREADS"
CUDA_LAUNCHERS = "CUDIST_CUDA_LAUNCHERS"
CHECK_COLLECTIVES = "CUDIST_CHECK_COLLECTIVES"
STALL_WARNING_SECONDS = "CUDIST_STALL_WARNING_SECONDS"
SHM_TRANSPORT = "CUDIST_SHM_TRANSPORT"
SHM_MIN_BYTES = "CUDIST_SHM_MIN_BYTES"
NODE_SIZE = "CUDIST_NODE_SIZE"
PIPELINE_UPDATE = "CUDIST_PIPELINE_UPDATE"
CHECKPOINT_WRITER_NICE = "CUDIST_CHECKPOINT_WRITER_NICE"
CHECKPOINT_DIRECT_IO = "CUDIST_CHECKPOINT_DIRECT_IO"
LAUNCH_STATUS_DIR = "CUDIST_LAUNCH_STATUS_DIR"
RESTART_COUNT = "CUDIST_RESTART_COUNT"
BENCH_TF_PYTHON = "CUDIST_BENCH_TF_PYTHON"
BENCH_TORCH_PYTHON = "CUDIST_BENCH_TORCH_PYTHON"

#: The docs' section titles, in page order.
SECTIONS = {"runtime": "Runtime", "internal": "Set by cudist itself", "bench": "Benchmarks"}

#: Every variable, in the docs' order.
TABLE: tuple[Setting, ...] = (
    Setting(
        BACKEND, "runtime", "unset: `native`, else `numba`, else `numpy` on the CPU; `cupy` for CuPy arrays",
        "Forces a kernel backend: `numpy`, `numba`, `native` or `cupy`. A backend that is not installed is an error "
        "that says so. `python -m cudist --info` shows the choice.",
        "When the first kernel runs (the CPU choice is then cached; `cudist._kernels.reset_backend_cache()` "
        "forgets it)",
    ),
    Setting(
        REPLICA_EXECUTION, "runtime", "`auto`",
        "How CPU replicas run: `auto`, `greenlets` or `threads` (see "
        "[Getting started](../getting-started.md#how-replicas-run)). Any other value is a `ValueError`. "
        "`cudist.config.set_replica_execution` overrides it.",
        "At each `run` while no mode was set with `set_replica_execution`",
    ),
    Setting(
        POOL_SPIN_US, "runtime", "`200`",
        "How long (microseconds) the native kernels' pool workers spin waiting for the next kernel before "
        "blocking; `0` never spins. Read by the C++ thread pool (`thread_pool.hpp`).",
        "At the first native kernel (process-wide)",
    ),
    Setting(
        NUM_THREADS, "runtime", "unset: every hardware thread (`python -m cudist.launch` sets cores / N for its N workers)",
        "Threads of the native kernels' pool per process (the caller included), as `OMP_NUM_THREADS` is for "
        "BLAS: the workers of one machine share its cores instead of each starting one thread per core. A value "
        "that is not a positive integer is a `ValueError`. `cudist._kernels._native.set_num_threads` changes it "
        "later.",
        "When the native backend loads (the first native kernel)",
    ),
    Setting(
        CUDA_LAUNCHERS, "runtime", "`auto`",
        "How the `cupy` backend launches its collectives: `auto` (the C++ launchers of `cudist._core` where they "
        "can serve, else NVRTC), `core` (insist on the launchers; an error if they cannot serve), `nvrtc` (never "
        "use them). Any other value is an error naming the choices.",
        "When the `cupy` backend loads",
    ),
    Setting(
        CHECK_COLLECTIVES, "runtime", "unset: the quick check",
        "How a multi-worker job checks that its workers make the same collective calls. Unset: a 64-bit hash of "
        "each collective (sequence number, kind, buffer sizes, dtypes) rides with it (about 10 us a collective); "
        "workers that disagree get a `ReplicaMismatchError` naming the difference instead of a hang. `1` (any "
        "other value): the full check, each collective's whole fingerprint (shapes, dtypes) gathered first. `0` "
        "(or `false`, `no`, `off`): no check.",
        "When the strategy's MPI communicator is created",
    ),
    Setting(
        STALL_WARNING_SECONDS, "runtime", "`60`",
        "Seconds a multi-worker collective waits before a `CollectiveStallWarning` names the workers that have "
        "not arrived. A value that is not a positive number is a `ValueError` naming the variable.",
        "When the strategy's MPI communicator is created",
    ),
    Setting(
        SHM_TRANSPORT, "runtime", "`auto`",
        "How the workers of one node all-reduce host values in a multi-worker job: `auto` (MPI-3 shared memory "
        "when a node has several workers, MPI across nodes) or `off` (MPI for every byte, as "
        "`CommunicationOptions(implementation=\"RING\")`). Any other value is a `ValueError`.",
        "When a MultiWorkerMirroredStrategy is created",
    ),
    Setting(
        SHM_MIN_BYTES, "runtime", "`0`",
        "All-reduces of fewer bytes (all buffers of one call together) go through MPI's own all-reduce rather "
        "than shared memory; `0` (the default: shared memory measured faster at every size): none. A value that "
        "is not a non-negative integer is a `ValueError`.",
        "When a MultiWorkerMirroredStrategy is created",
    ),
    Setting(
        NODE_SIZE, "runtime", "unset: the nodes MPI reports",
        "Workers per node for the shared-memory transport, consecutive in worker order: `2` in a 4-worker job on "
        "one machine simulates 2 hosts x 2 workers (node leaders all-reduce over MPI). A value that is not a "
        "positive integer is a `ValueError`.",
        "When a MultiWorkerMirroredStrategy is created",
    ),
    Setting(
        PIPELINE_UPDATE, "runtime", "`off`",
        "`on`: in a multi-worker job, an optimizer's `apply_gradients` whose gradients form several packs "
        "(`CommunicationOptions(bytes_per_pack=...)`) runs the cross-worker all-reduce of pack k on a "
        "communication thread while the caller sums pack k+1 over its local replicas and applies pack k-1's "
        "update (the same bits as `off`). Off by default: on a machine with no spare core it measured slower "
        "(see the multi-worker guide). Every worker must set the same value. Any other value is a `ValueError`.",
        "When a MultiWorkerMirroredStrategy is created",
    ),
    Setting(
        CHECKPOINT_WRITER_NICE, "runtime", "`0`",
        "How much lower than the training loop's priority an asynchronous checkpoint write runs (Linux: added to "
        "the niceness of its background thread only, from 0 to 19; the loop's threads keep theirs). A higher "
        "value lets the loop's steps have the cores first and makes the write take longer (about 3x at `10` on "
        "the busy 2-core build machine, where the steps did not measurably gain: `bench/PERFORMANCE.md`); "
        "worth trying where a loop saturates dedicated cores and saves far apart. A value that is not an "
        "integer from 0 to 19 is a `ValueError`.",
        "When each asynchronous write starts",
    ),
    Setting(
        CHECKPOINT_DIRECT_IO, "runtime", "`off`",
        "`on`: checkpoint tensors files of 8 MiB or more are written with `O_DIRECT` (Linux, where the file "
        "system allows it; elsewhere as `off`) through a 1 MiB bounce buffer: no copy into the page cache, about "
        "half the write's CPU time, the header padded with spaces so that the data starts at 4096 bytes (every "
        "safetensors reader skips them). `off`: through the page cache. Off by default: on the 2-core build "
        "machine it shortened the loop's cost of an asynchronous save only when other processes kept both cores "
        "busy, and lengthened it on a quiet one (`bench/PERFORMANCE.md`). Any other value is a `ValueError`.",
        "When each checkpoint is written",
    ),
    Setting(
        RESTART_COUNT, "internal", "unset",
        "Set by `python -m cudist.launch` for its workers: how many times the job has been restarted "
        "(`--max-restarts`), `0` in the first attempt. For scripts that want to know; a worker's bootstrap reads "
        "it to append to its `--log-dir` log after the first attempt.",
        "When the launcher starts each attempt",
    ),
    Setting(
        LAUNCH_STATUS_DIR, "internal", "unset",
        "Set by `python -m cudist.launch` for its workers: the directory where each worker records its pid and "
        "outcome, so the launcher can name the worker that failed. Do not set it yourself.",
        "When a worker started by the launcher boots",
    ),
    Setting(
        BENCH_TF_PYTHON, "bench", "this Python",
        "The Python interpreter with TensorFlow that `cudist-bench --compare tf` (and `bench/step_compare.py`) "
        "runs TensorFlow's side in. Same as `--tf-python`.",
        "When `cudist-bench` starts",
    ),
    Setting(
        BENCH_TORCH_PYTHON, "bench", "this Python",
        "The Python interpreter with PyTorch for the torch DDP rows of `bench/step_compare.py` and "
        "`bench/user_path.sh`.",
        "When those scripts start",
    ),
)


def markdown_table(section: str) -> str:
    """The docs' table of one section of :data:`TABLE` (Markdown, without a trailing newline).

    Args:
        section: a key of :data:`SECTIONS`.

    Returns:
        The table: a header row, a rule, then one row per variable.

    Raises:
        KeyError: not a section.
    """
    SECTIONS[section]  # noqa: B018 - a KeyError names a wrong section
    rows = ["| Variable | Default | What it does | Read when |", "| --- | --- | --- | --- |"]
    rows += [f"| `{s.name}` | {s.default} | {s.meaning} | {s.read_when} |" for s in TABLE if s.section == section]
    return "\n".join(rows)


def _raw(name: str) -> str | None:
    """The variable's value stripped, or None when unset or blank (the table's "unset or empty")."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _choice(name: str, choices: tuple[str, ...], default: str | None) -> str | None:
    raw = os.environ.get(name)
    value = _raw(name)
    if value is None:
        return default
    key = value.lower()
    if key not in choices:
        raise ValueError(f"${name}={raw!r} is not one of {', '.join(choices)}")
    return key


#: Environment variables MPI launchers set in the processes they start (MPICH/Hydra, PMIx, Open MPI, Slurm).
#: Not cudist's variables, so not in :data:`TABLE`; read here so that ``import cudist``'s early abort
#: hook and the strategy decide "started by an MPI launcher" the same way, without importing MPI.
MPI_LAUNCHER_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def launched_by_mpi() -> bool:
    """Whether this process was started by an MPI launcher (one of :data:`MPI_LAUNCHER_ENV` is set)."""
    return any(k in os.environ for k in MPI_LAUNCHER_ENV)


def backend() -> str | None:
    """``CUDIST_BACKEND`` as written (stripped), or None when unset or empty.

    The name is validated by the backend registry (``cudist._kernels.get_backend``), which knows the
    backends and says which are installed.
    """
    return _raw(BACKEND)


def replica_execution() -> str | None:
    """``CUDIST_REPLICA_EXECUTION`` lower-cased, or None when unset or empty.

    Raises:
        ValueError: not one of ``auto``, ``greenlets``, ``threads`` (the message names the variable).
    """
    return _choice(REPLICA_EXECUTION, ("auto", "greenlets", "threads"), None)


def cuda_launchers() -> str:
    """``CUDIST_CUDA_LAUNCHERS``: ``auto`` (also when unset), ``core`` or ``nvrtc``.

    Raises:
        ValueError: any other value (the message names the variable and the choices).
    """
    raw = os.environ.get(CUDA_LAUNCHERS, "")
    mode = raw.strip().lower() or "auto"
    if mode not in ("auto", "core", "nvrtc"):
        raise ValueError(
            f"{CUDA_LAUNCHERS}={raw!r} is not one of auto, core, nvrtc (auto: cudist._core's CUDA launchers for "
            "the collectives where they can run, else NVRTC; core: always the launchers; nvrtc: never)"
        )
    return mode


def check_collectives() -> str:
    """``CUDIST_CHECK_COLLECTIVES`` as a mode: ``"quick"`` (unset), ``"off"`` (``0``, ``false``, ``no``,
    ``off``) or ``"full"`` (any other value)."""
    value = (_raw(CHECK_COLLECTIVES) or "").lower()
    if value == "":
        return "quick"
    return "off" if value in ("0", "false", "no", "off") else "full"


def stall_warning_seconds(default: float) -> float:
    """``CUDIST_STALL_WARNING_SECONDS`` as a float, else ``default``.

    Args:
        default: the value when unset or empty.

    Raises:
        ValueError: not a positive number (the message names the variable).
    """
    value = _raw(STALL_WARNING_SECONDS)
    if value is None:
        return float(default)
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:  # nan too
        raise ValueError(f"${STALL_WARNING_SECONDS}={value!r} is not a positive number of seconds")
    return seconds


def shm_transport() -> bool:
    """``CUDIST_SHM_TRANSPORT``: True for ``auto`` (also when unset), False for ``off``.

    Raises:
        ValueError: any other value (the message names the variable and the choices).
    """
    return _choice(SHM_TRANSPORT, ("auto", "off"), "auto") == "auto"


def pipeline_update() -> bool:
    """``CUDIST_PIPELINE_UPDATE``: True for ``on``, False for ``off`` (also when unset).

    Raises:
        ValueError: any other value (the message names the variable and the choices).
    """
    return _choice(PIPELINE_UPDATE, ("off", "on"), "off") == "on"


def _count(name: str, minimum: int) -> int | None:
    value = _raw(name)
    if value is None:
        return None
    try:
        count = int(value)
    except ValueError:
        count = minimum - 1
    if count < minimum:
        what = "a positive integer" if minimum > 0 else "a non-negative integer"
        raise ValueError(f"${name}={value!r} is not {what}")
    return count


def shm_min_bytes(default: int) -> int:
    """``CUDIST_SHM_MIN_BYTES`` as an int, else ``default``.

    Args:
        default: the value when unset or empty.

    Raises:
        ValueError: not a non-negative integer (the message names the variable).
    """
    count = _count(SHM_MIN_BYTES, 0)
    return default if count is None else count


#: The niceness an asynchronous checkpoint write adds to its thread when the variable is unset.
CHECKPOINT_WRITER_NICE_DEFAULT = 0


def checkpoint_writer_nice() -> int:
    """``CUDIST_CHECKPOINT_WRITER_NICE``: the niceness an asynchronous checkpoint write's thread adds to its own.

    Returns:
        0 to 19; :data:`CHECKPOINT_WRITER_NICE_DEFAULT` when unset or empty.

    Raises:
        ValueError: not an integer from 0 to 19 (the message names the variable).
    """
    value = _raw(CHECKPOINT_WRITER_NICE)
    if value is None:
        return CHECKPOINT_WRITER_NICE_DEFAULT
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"${CHECKPOINT_WRITER_NICE}={value!r} is not an integer from 0 to 19")
    return nice


def checkpoint_direct_io() -> bool:
    """``CUDIST_CHECKPOINT_DIRECT_IO``: True for ``on``, False for ``off`` (also when unset).

    Raises:
        ValueError: any other value (the message names the variable and the choices).
    """
    return _choice(CHECKPOINT_DIRECT_IO, ("off", "on"), "off") == "on"


def node_size() -> int | None:
    """``CUDIST_NODE_SIZE`` as an int, or None when unset or empty (the nodes MPI reports).

    Raises:
        ValueError: not a positive integer (the message names the variable).
    """
    return _count(NODE_SIZE, 1)


def num_threads() -> int | None:
    """``CUDIST_NUM_THREADS`` as an int, or None when unset or empty (every hardware thread).

    Raises:
        ValueError: not a positive integer (the message names the variable).
    """
    return _count(NUM_THREADS, 1)


def launch_status_dir() -> str | None:
    """``CUDIST_LAUNCH_STATUS_DIR`` (set by ``python -m cudist.launch`` for its workers), or None."""
    return _raw(LAUNCH_STATUS_DIR)


def restart_count() -> int:
    """``CUDIST_RESTART_COUNT`` (set by ``python -m cudist.launch --max-restarts``): the attempt, 0 when unset.

    Raises:
        ValueError: the variable is set to something that is not a non-negative integer.
    """
    value = _raw(RESTART_COUNT)
    if value in (None, ""):
        return 0
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"${RESTART_COUNT}={value!r} is not a non-negative integer")
    return count


def bench_tf_python() -> str | None:
    """``CUDIST_BENCH_TF_PYTHON``: the interpreter with TensorFlow for the benchmarks, or None."""
    return _raw(BENCH_TF_PYTHON)


def bench_torch_python() -> str | None:
    """``CUDIST_BENCH_TORCH_PYTHON``: the interpreter with PyTorch for the benchmarks, or None."""
    return _raw(BENCH_TORCH_PYTHON)


@contextlib.contextmanager
def overridden(name: str, value: str | None) -> Iterator[None]:
    """Sets (``value``) or unsets (None) a variable of :data:`TABLE` for a block, then restores it.

    For the benchmarks, which run the same code under several settings in one process.

    Args:
        name: a variable of :data:`TABLE`.
        value: its value inside the block, or None to unset it there.

    Raises:
        KeyError: ``name`` is not in :data:`TABLE`.
    """
    if not any(s.name == name for s in TABLE):
        raise KeyError(f"{name} is not a cudist setting")
    old = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
