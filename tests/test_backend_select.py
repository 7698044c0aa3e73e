"""Choosing a kernel backend: CUDIST_BACKEND, names, availability, default order, ``--info``."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cudist._kernels as K
from cudist._kernels import BackendUnavailableError, KernelBackend, available_backends, get_backend


@pytest.fixture
def fresh(monkeypatch):
    """An empty backend cache and no CUDIST_BACKEND, restored afterwards."""
    monkeypatch.delenv("CUDIST_BACKEND", raising=False)
    monkeypatch.setattr(K, "_instances", {})
    return monkeypatch


def _hide(monkeypatch, *missing):
    real = K._importable
    monkeypatch.setattr(K, "_importable", lambda mod: mod not in missing and real(mod))


@pytest.mark.parametrize("name", ["numpy", "numba", "native"])
def test_env_override_selects_backend(fresh, name):
    fresh.setenv("CUDIST_BACKEND", name)
    b = get_backend()
    assert isinstance(b, KernelBackend) and b.name == name


def test_env_override_is_case_insensitive(fresh):
    fresh.setenv("CUDIST_BACKEND", " NumPy ")
    assert get_backend().name == "numpy"


def test_empty_env_means_default(fresh):
    fresh.setenv("CUDIST_BACKEND", "")
    assert get_backend().name == get_backend(None).name == K.default_cpu_backend().name


def test_explicit_name_beats_env(fresh):
    fresh.setenv("CUDIST_BACKEND", "numba")
    assert get_backend("numpy").name == "numpy"


def test_instances_are_cached(fresh):
    assert get_backend("numpy") is get_backend("numpy")


@pytest.mark.parametrize("bad", ["tensorflow", "cuda", "nump"])
def test_unknown_backend_name(fresh, bad):
    with pytest.raises(ValueError, match=f"unknown kernel backend '{bad}'.*native, numba, numpy, cupy"):
        get_backend(bad)
    fresh.setenv("CUDIST_BACKEND", bad)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_backend()


def test_unavailable_backend_raises(fresh):
    _hide(fresh, "cupy")
    with pytest.raises(BackendUnavailableError, match=r"'cupy' is not available: cannot import cupy.*cudist\[cuda\]"):
        get_backend("cupy")
    _hide(fresh, "numba")
    with pytest.raises(BackendUnavailableError, match="'numba' is not available: cannot import numba"):
        get_backend("numba")
    assert issubclass(BackendUnavailableError, RuntimeError)


def test_cupy_missing_here_is_unavailable(fresh):
    if K._importable("cupy"):
        pytest.skip("CuPy is installed here")
    assert "cupy" not in available_backends()
    with pytest.raises(BackendUnavailableError, match="cupy"):
        get_backend("cupy")


def test_broken_backend_names_itself(fresh):
    fresh.setitem(K._MODULES, "numba", ("cudist._kernels._no_such_module", "X"))
    with pytest.raises(BackendUnavailableError, match="'numba' failed to load: ModuleNotFoundError"):
        get_backend("numba")


def test_default_order_native_numba_numpy(fresh):
    expected = next(n for n in ("native", "numba", "numpy") if n in available_backends())
    assert get_backend().name == expected
    fresh.setattr(K, "_instances", {})
    _hide(fresh, "cudist._core")
    assert get_backend().name == "numba"
    fresh.setattr(K, "_instances", {})
    _hide(fresh, "cudist._core", "numba")
    assert get_backend().name == "numpy"
    assert available_backends() == ["numpy"]


def test_default_skips_a_backend_that_fails_to_load(fresh):
    fresh.setitem(K._MODULES, "native", ("cudist._kernels._no_such_module", "X"))
    assert get_backend().name == "numba"


def test_available_backends_lists_known_names():
    avail = available_backends()
    assert "numpy" in avail and set(avail) <= set(K.BACKENDS)
    assert list(avail) == [n for n in K.BACKENDS if n in avail]  # preference order


def test_info_lists_backends():
    env = {k: v for k, v in __import__("os").environ.items() if k != "CUDIST_BACKEND"}
    out = subprocess.run([sys.executable, "-m", "cudist", "--info"], capture_output=True, text=True, timeout=300,
                         check=True, env=env).stdout
    assert "kernel backends:" in out
    for name in K.BACKENDS:
        assert any(line.split()[:1] == [name] for line in out.splitlines()), f"{name} missing from:\n{out}"
    for name in ("numpy", "numba"):
        assert any(line.split()[:2] == [name, "available"] for line in out.splitlines()), out
    if not K._importable("cupy"):
        assert any(line.split() == ["cupy", "not", "available"] for line in out.splitlines()), out
    default = next(n for n in ("native", "numba", "numpy") if n in available_backends())
    assert f"default CPU backend: {default}" in out


def test_info_reports_env_override():
    env = dict(__import__("os").environ, CUDIST_BACKEND="numpy")
    out = subprocess.run([sys.executable, "-m", "cudist", "--info"], capture_output=True, text=True, timeout=300,
                         check=True, env=env).stdout
    assert "default CPU backend: numpy (CUDIST_BACKEND=numpy)" in out


def test_info_reports_the_kernel_pool():
    env = dict(__import__("os").environ, CUDIST_POOL_SPIN_US="0")
    out = subprocess.run([sys.executable, "-m", "cudist", "--info"], capture_output=True, text=True, timeout=300,
                         check=True, env=env).stdout
    assert "native kernel threads: " in out and "workers never spin" in out, out
    env["CUDIST_POOL_SPIN_US"] = "50"
    out = subprocess.run([sys.executable, "-m", "cudist", "--info"], capture_output=True, text=True, timeout=300,
                         check=True, env=env).stdout
    assert "workers spin up to 50 us" in out, out


@pytest.mark.parametrize("value", ["bogus", "cupy"])
def test_info_reports_an_unusable_env_override_instead_of_failing(value):
    env = dict(__import__("os").environ, CUDIST_BACKEND=value)
    proc = subprocess.run([sys.executable, "-m", "cudist", "--info"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "kernel backends:" in proc.stdout
    if value == "bogus":
        assert "CUDIST_BACKEND=bogus is unusable: unknown kernel backend 'bogus'" in proc.stdout
    else:  # named without loading it: --info must not initialise CUDA (or fail without CuPy)
        assert "default backend: cupy (CUDIST_BACKEND=cupy; loads on first use)" in proc.stdout
