"""cudist: tf.distribute's Strategy API over NumPy (CPU) and CuPy (GPU) arrays.

The public names are re-exported lazily from private modules so that ``import cudist`` stays fast:
nothing here imports numba, CuPy or the native extension, and nothing is compiled. Type checkers
and IDEs see the same names as real imports (the ``TYPE_CHECKING`` block below), so
``cudist.MirroredStrategy`` is the class itself to them, not ``Any``.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # What the lazy ``__getattr__`` below returns, for type checkers only; keep in step with
    # _EXPORTS and _SUBMODULES (tests/test_typing.py checks that they agree).
    from cudist import (
        cluster_resolver,
        config,
        data,
        errors,
        experimental,
        launch,
        losses,
        metrics,
        mixed_precision,
        nn,
        optimizers,
        train,
    )
    from cudist._central_storage_strategy import CentralStorageStrategy
    from cudist._collective_all_reduce_strategy import MultiWorkerMirroredStrategy
    from cudist._cross_device_ops import (
        CrossDeviceOps,
        HierarchicalCopyAllReduce,
        NcclAllReduce,
        P2PAllReduce,
        ReductionToOneDevice,
    )
    from cudist._distribute_lib import (
        ReplicaContext,
        RunOptions,
        Strategy,
        StrategyExtended,
        experimental_set_strategy,
        get_cross_replica_context,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from cudist._input_lib import (
        DistributedDataset,
        DistributedDatasetsFromFunction,
        DistributedIterator,
        InputContext,
        InputOptions,
        InputReplicationMode,
        ValueContext,
    )
    from cudist._def_function import function
    from cudist._mirrored_strategy import MirroredStrategy
    from cudist._one_device_strategy import OneDeviceStrategy
    from cudist._reduce_util import ReduceOp
    from cudist._values import DistributedValues, Mirrored, PerReplica
    from cudist._variables import (
        MirroredVariable,
        SyncOnReadVariable,
        Variable,
        VariableAggregation,
        VariableSynchronization,
    )

    #: The installed distribution's version (read lazily; see ``_read_version``).
    __version__: str

# public name -> private module that defines it
_EXPORTS = {
    "Strategy": "_distribute_lib",
    "StrategyExtended": "_distribute_lib",
    "ReplicaContext": "_distribute_lib",
    "RunOptions": "_distribute_lib",
    "get_strategy": "_distribute_lib",
    "has_strategy": "_distribute_lib",
    "get_replica_context": "_distribute_lib",
    "in_cross_replica_context": "_distribute_lib",
    "get_cross_replica_context": "_distribute_lib",
    "experimental_set_strategy": "_distribute_lib",
    "OneDeviceStrategy": "_one_device_strategy",
    "MirroredStrategy": "_mirrored_strategy",
    "CentralStorageStrategy": "_central_storage_strategy",
    "MultiWorkerMirroredStrategy": "_collective_all_reduce_strategy",
    "ReduceOp": "_reduce_util",
    "DistributedValues": "_values",
    "PerReplica": "_values",
    "Mirrored": "_values",
    "Variable": "_variables",
    "VariableSynchronization": "_variables",
    "VariableAggregation": "_variables",
    "MirroredVariable": "_variables",
    "SyncOnReadVariable": "_variables",
    "InputContext": "_input_lib",
    "InputOptions": "_input_lib",
    "InputReplicationMode": "_input_lib",
    "ValueContext": "_input_lib",
    "DistributedDataset": "_input_lib",
    "DistributedIterator": "_input_lib",
    "DistributedDatasetsFromFunction": "_input_lib",
    "CrossDeviceOps": "_cross_device_ops",
    "ReductionToOneDevice": "_cross_device_ops",
    "HierarchicalCopyAllReduce": "_cross_device_ops",
    "NcclAllReduce": "_cross_device_ops",
    "P2PAllReduce": "_cross_device_ops",
    "function": "_def_function",
}
_SUBMODULES = ("data", "config", "experimental", "errors", "optimizers", "cluster_resolver", "launch", "losses", "metrics", "mixed_precision", "nn", "train")

# Written out (not computed from _EXPORTS) so that type checkers read it; tests/test_typing.py
# checks that it holds exactly _EXPORTS, _SUBMODULES, get_include, get_cmake_dir and __version__.
__all__ = [
    "CentralStorageStrategy",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "P2PAllReduce",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "experimental_set_strategy",
    "function",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "data",
    "config",
    "experimental",
    "errors",
    "optimizers",
    "cluster_resolver",
    "launch",
    "losses",
    "metrics",
    "mixed_precision",
    "nn",
    "train",
    "get_include",
    "get_cmake_dir",
    "__version__",
]


def _abort_job_on_early_errors() -> None:
    """In a process started by an MPI launcher: an uncaught exception ends the whole job.

    The strategy makes an exception abort the job (``MPI_Abort``) from the moment cudist first
    uses MPI; an exception raised earlier (before the strategy is created) would end this process
    alone while the others wait for it in ``MPI_Init`` or a collective, forever. So a first hook
    is installed here, at no cost: it loads MPI only if an exception reaches it, and then hands
    over to the strategy's hook (which prints the traceback and aborts the job).
    """
    import sys  # noqa: PLC0415

    from cudist import _settings  # noqa: PLC0415 - cheap: the environment only, no MPI

    if not _settings.launched_by_mpi():
        return
    previous = sys.excepthook

    def on_exception(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        if sys.excepthook is not on_exception:  # a later hook (the strategy's) wraps this one: just print
            previous(exc_type, exc, tb)
            return
        sys.excepthook = previous
        try:
            from cudist._dataplane.transports import mpi  # noqa: PLC0415

            mpi.world()  # loads MPI; in a job of several processes, installs the aborting hook
        except BaseException:  # noqa: BLE001 - whatever fails here, the traceback must still be printed
            pass
        sys.excepthook(exc_type, exc, tb)

    sys.excepthook = on_exception


_abort_job_on_early_errors()
if not TYPE_CHECKING:  # hidden from type checkers: a misspelt name must be an error to them

    def __getattr__(name: str) -> object:
        mod = _EXPORTS.get(name)
        if mod is not None:
            value = getattr(importlib.import_module(f"cudist.{mod}"), name)
        elif name in _SUBMODULES:
            value = importlib.import_module(f"cudist.{name}")
        elif name == "__version__":
            value = _read_version()
        else:
            raise AttributeError(f"module 'cudist' has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _read_version() -> str:
    """The installed distribution's version (``cudist.__version__``, read on first use).

    scikit-build-core took it at build time from the CUDIST_VERSION_* macros of
    ``csrc/include/cudist/version.hpp``, the one place it is written. A source tree used without
    installing it has no distribution metadata; the version then comes from that header itself.
    """
    import importlib.metadata  # noqa: PLC0415 - only when the version is asked for

    try:
        return importlib.metadata.version("cudist")
    except importlib.metadata.PackageNotFoundError:
        return _header_version(Path(get_include()) / "cudist" / "version.hpp")


def _header_version(path: Path) -> str:
    """``MAJOR.MINOR.PATCH`` from the ``CUDIST_VERSION_*`` macros of a ``version.hpp``."""
    import re  # noqa: PLC0415

    text = path.read_text(encoding="utf-8")
    parts = [re.search(rf"^#define CUDIST_VERSION_{p} (\d+)$", text, re.M) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise RuntimeError(f"no CUDIST_VERSION_MAJOR/MINOR/PATCH macros in {path}")
    return ".".join(m.group(1) for m in parts if m)


def _install_dir() -> Path:
    # The extension sits next to the installed headers and CMake files; in an editable install
    # the Python sources live elsewhere, so locate the extension rather than this file.
    spec = importlib.util.find_spec("cudist._core")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    return Path(__file__).parent


def get_include() -> str:
    """The directory holding cudist's public C++ headers (``#include <cudist/cudist.hpp>``)."""
    installed = _install_dir() / "include"
    if (installed / "cudist").is_dir():
        return str(installed)
    source = Path(__file__).resolve().parents[2] / "csrc" / "include"
    if (source / "cudist").is_dir():
        return str(source)
    raise FileNotFoundError("cudist's C++ headers are not installed; reinstall cudist with pip")


def get_cmake_dir() -> str:
    """The directory holding ``cudistConfig.cmake`` (pass it as ``-Dcudist_DIR=...``)."""
    path = _install_dir() / "share" / "cmake" / "cudist"
    if not (path / "cudistConfig.cmake").is_file():
        raise FileNotFoundError(
            "cudist's CMake package files are not installed (an in-place editable build has none); "
            "install cudist with `pip install .`"
        )
    return str(path)
