"""cudist: tf.distribute's Strategy API over NumPy (CPU) and CuPy (GPU) arrays.

The public names are re-exported lazily from private modules so that ``import cudist`` stays fast:
nothing here imports numba, CuPy or the native extension, and nothing is compiled.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

__version__ = "0.1.0"

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
}
_SUBMODULES = ("data", "config", "experimental", "errors", "optimizers")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["get_include", "get_cmake_dir", "__version__"]


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is not None:
        value = getattr(importlib.import_module(f"cudist.{mod}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"cudist.{name}")
    else:
        raise AttributeError(f"module 'cudist' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


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
