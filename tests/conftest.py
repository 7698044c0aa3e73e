"""Shared fixtures: hardware markers, the default deselection of `heavy` tests, and the ``strategy`` fixture."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """GPUs usable through CuPy (0 without CuPy, a driver or a device)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


#: How many ``heavy`` tests the run deselected (reported at the end).
_HEAVY_DESELECTED = pytest.StashKey[int]()


def _files_named_on_the_command_line(config) -> set[Path]:
    """Test files given as arguments (``tests/test_x.py`` or ``tests/test_x.py::test_y``), not directories."""
    named = set()
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::", 1)[0])
        if path.is_file():
            named.add(path.resolve())
    return named


def _deselect_heavy(config, items):
    """Without ``-m``, tests marked ``heavy`` (compilers, subprocess suites) are deselected, except in
    test files named on the command line; any ``-m`` expression decides for itself (``-m heavy``)."""
    if config.option.markexpr:
        return
    named = _files_named_on_the_command_line(config)
    keep, heavy = [], []
    for item in items:
        is_heavy = item.get_closest_marker("heavy") is not None and Path(item.path).resolve() not in named
        (heavy if is_heavy else keep).append(item)
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        items[:] = keep
        config.stash[_HEAVY_DESELECTED] = len(heavy)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = config.stash.get(_HEAVY_DESELECTED, 0)
    if n:
        terminalreporter.write_line(f"{n} heavy tests deselected; `python -m pytest -m heavy` runs them")


def pytest_configure(config):
    _install_emulated_launchers()


def _install_emulated_launchers():
    """``CUDIST_EMU_MODE=core`` (tests/test_gpu_emulated.py's mode matrix): under the fake CuPy, the
    cupy backend launches its collectives through cudist._core's C++ launchers, emulated by
    ``cupy._launchers`` (the real launch_impl.cuh/p2p_impl.cuh compiled for the host), which see
    every emulated GPU, so ``CUDIST_CUDA_LAUNCHERS=auto`` takes them (the real extension sees no GPU
    here; subprocesses of the tests get it, and NVRTC)."""
    if "core" not in {m.strip() for m in os.environ.get("CUDIST_EMU_MODE", "").split(",")}:
        return
    import cupy

    if not getattr(cupy, "__fake__", False):
        raise pytest.UsageError("CUDIST_EMU_MODE=core needs the fake CuPy (PYTHONPATH=tests/emu/fakecupy)")
    from cupy._launchers import EmulatedLaunchers

    from cudist._kernels import _cupy

    if os.environ.get("CUDIST_CUDA_LAUNCHERS", "auto").strip().lower() not in ("", "auto", "core"):
        raise pytest.UsageError("CUDIST_EMU_MODE=core runs the C++ launchers: unset CUDIST_CUDA_LAUNCHERS")
    _cupy._core = EmulatedLaunchers()


def pytest_collection_modifyitems(config, items):
    _deselect_heavy(config, items)
    n = None
    for item in items:
        # Markers, not keywords: a parameter id containing "gpu" must not make a CPU test skip.
        need = 2 if item.get_closest_marker("multi_gpu") else 1 if item.get_closest_marker("gpu") else 0
        if not need:
            continue
        if n is None:
            n = gpu_count()
        if n < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s) with CuPy; found {n}"))


@pytest.fixture(scope="session", autouse=True)
def _four_logical_cpus():
    """Four logical CPUs, as TF tests get with set_logical_device_configuration."""
    from cudist import config

    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 4)
    yield


@pytest.fixture(scope="session", autouse=True)
def _kernels_split_from_one_mib():
    """The native kernels split their work over their pool from 1 MiB moved whether or not a worker
    is spinning (by default 8 MiB when none is), so that the sizes the tests pick for the parallel
    paths take them every time; test_native.py tests the cold threshold itself."""
    from cudist import _core

    warm, cold = _core.set_parallel_thresholds(1 << 20, 1 << 20)
    yield
    _core.set_parallel_thresholds(warm, cold)


@pytest.fixture(scope="module")
def cp():
    """The ``cupy`` module (the GPU kernel tests' arrays), or skip."""
    return pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def be():
    """The CuPy kernel backend."""
    from cudist._kernels import get_backend

    return get_backend("cupy")


#: The strategy kinds the common tests run over: on logical CPUs, and (marker ``gpu``) on logical
#: GPUs split from physical GPU 0, where variables and values are CuPy arrays.
STRATEGY_PARAMS = [
    "one_device", "mirrored1", "mirrored2", "mirrored3", "mirrored4", "central2",
    pytest.param("one_device_gpu", marks=pytest.mark.gpu),
    pytest.param("mirrored_gpu3", marks=pytest.mark.gpu),
    pytest.param("central_gpu2", marks=pytest.mark.gpu),  # GPU replicas, variables in host memory
]


def set_gpu0_split(n, memory_limit=None):
    """Splits physical GPU 0 into ``n`` logical GPUs (None: back to one)."""
    from cudist import config

    gpu0 = config.list_physical_devices("GPU")[0]
    logical = None if n is None else [config.LogicalDeviceConfiguration(memory_limit=memory_limit)] * n
    config.set_logical_device_configuration(gpu0, logical)


@contextlib.contextmanager
def gpu0_split(n, memory_limit=None):
    """Physical GPU 0 split into ``n`` logical GPUs for the ``with`` block, one again after it."""
    set_gpu0_split(n, memory_limit)
    try:
        yield
    finally:
        set_gpu0_split(None)


def make_strategy(kind: str):
    """Builds the strategy named by a STRATEGY_PARAMS entry (``*_gpu<n>`` kinds split GPU 0 first)."""
    import cudist

    if "_gpu" in kind:
        n = int(kind[-1]) if kind[-1].isdigit() else 1
        set_gpu0_split(n)
        gpus = [f"/gpu:{i}" for i in range(n)]
        if kind.startswith("one_device"):
            return cudist.OneDeviceStrategy(gpus[0])
        if kind.startswith("mirrored"):
            return cudist.MirroredStrategy(gpus)
        return cudist.CentralStorageStrategy(compute_devices=gpus, parameter_device="/cpu:0")
    if kind == "one_device":
        return cudist.OneDeviceStrategy("/cpu:0")
    if kind.startswith("mirrored"):
        n = int(kind[len("mirrored"):])
        return cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    if kind == "central2":
        return cudist.CentralStorageStrategy(compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:0")
    raise ValueError(kind)


@pytest.fixture(params=STRATEGY_PARAMS)
def strategy(request):
    """Each strategy kind the common tests run over."""
    s = make_strategy(request.param)
    yield s
    if "_gpu" in request.param:
        set_gpu0_split(None)


def _cudist_threads():
    return [t for t in threading.enumerate() if t.name.startswith("cudist-") and t.is_alive()]


@pytest.fixture
def no_leaked_threads():
    """Fails the test if a ``cudist-*`` thread (input prefetch, copy feeder) outlives it."""
    yield
    deadline = time.monotonic() + 5
    while _cudist_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert _cudist_threads() == []


# Small sizes keep examples/train_mlp.py fast in tests; 515 test examples make the last test batch 3
# examples, which four replicas split [1, 1, 1, 0] (an empty replica batch).
TRAIN_MLP_SMALL = ["--epochs", "2", "--train-examples", "512", "--test-examples", "515", "--quiet"]


@pytest.fixture(scope="module")
def train_mlp():
    """examples/train_mlp.py as a module."""
    return load_example("train_mlp")


def load_example(name: str):
    """Imports ``examples/<name>.py`` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"cudist_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def select_cpu_backend(monkeypatch):
    """``select_cpu_backend(name)`` makes ``name`` the CPU kernel backend (``CUDIST_BACKEND`` and
    an emptied backend cache) for what the test creates afterwards; the process's own choice is
    back after the test."""
    from cudist._kernels import cpu_backend, reset_backend_cache

    def select(name: str) -> None:
        monkeypatch.setenv("CUDIST_BACKEND", name)
        reset_backend_cache()
        assert cpu_backend().name == name

    yield select
    monkeypatch.delenv("CUDIST_BACKEND", raising=False)
    reset_backend_cache()


@pytest.fixture(params=["numpy", "native", "numba"])
def each_cpu_backend(request, select_cpu_backend):
    """The test runs once per CPU kernel backend, selected (:func:`select_cpu_backend`) before it starts."""
    select_cpu_backend(request.param)
    return request.param


@pytest.fixture(params=["greenlets", "threads"])
def replica_execution(request):
    """The test runs twice: ``strategy.run``'s CPU replicas on greenlets, then on replica threads.

    Modules that exercise the engine use it for every test with
    ``pytestmark = pytest.mark.usefixtures("replica_execution")``.
    """
    from cudist import config

    mode = request.param
    before = config.get_replica_execution()
    config.set_replica_execution(mode)
    try:
        yield mode
    finally:
        config.set_replica_execution(before)
