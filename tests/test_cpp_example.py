"""Builds and runs examples/cpp, a downstream CMake project, against the installed cudist package.

This checks the C++ embedding end to end: the installed headers, ``cudistConfig.cmake`` found
through ``cudist.get_cmake_dir()``, the ``cudist::cudist`` target, and the kernels' results.
Skipped only when there is no cmake executable or no C++ compiler.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cudist
from cudist import _core

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpp"


def _tool(name: str) -> str | None:
    # The `test` extra installs cmake and ninja next to the interpreter, which need not be on PATH.
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return shutil.which(cxx)
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def tools():
    cmake, cxx = _tool("cmake"), _compiler()
    if cmake is None:
        pytest.skip("no cmake executable (install cudist[test])")
    if cxx is None:
        pytest.skip("no C++ compiler")
    return cmake, cxx, _tool("ninja")


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_cmake_dir_is_installed():
    cmake_dir = Path(cudist.get_cmake_dir())
    for name in ("cudistConfig.cmake", "cudistConfigVersion.cmake", "cudistTargets.cmake"):
        assert (cmake_dir / name).is_file(), name
    include = Path(cudist.get_include())
    assert (include / "cudist" / "cudist.hpp").is_file()
    out = _run([sys.executable, "-m", "cudist", "--cmakedir"])
    assert Path(out.strip()) == cmake_dir


@pytest.mark.parametrize("how", ["cudist_DIR", "CMAKE_PREFIX_PATH"])
def test_downstream_project_builds_and_runs(tools, tmp_path, how):
    cmake, cxx, ninja = tools
    build = tmp_path / "build"
    cfg = [cmake, "-S", str(EXAMPLE), "-B", str(build), f"-DCMAKE_CXX_COMPILER={cxx}", "-DCMAKE_BUILD_TYPE=Release"]
    if ninja:
        cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    cfg.append(f"-D{how}={cudist.get_cmake_dir()}")
    _run(cfg)
    _run([cmake, "--build", str(build)])
    exe = build / ("cudist_example.exe" if os.name == "nt" else "cudist_example")
    out = _run([str(exe)])

    header = re.search(r"^cudist (\S+), (\d+) threads$", out, re.M)
    assert header, out
    assert header.group(1) == cudist.__version__
    assert int(header.group(2)) == _core.hardware_threads()

    def row(label):
        m = re.search(rf"^{re.escape(label)}:(.*)$", out, re.M)
        assert m, f"no {label!r} line in:\n{out}"
        return [float(v) for v in m.group(1).split()]

    # Replica r holds r + i/4 for i in 0..5 (see main.cpp).
    n, count = 4, 6
    sums = [sum(r + i / 4 for r in range(n)) for i in range(count)]
    for r in range(n):
        assert row(f"sum  replica {r}") == sums
    assert row("mean replica 0") == [s / n for s in sums]
    assert row("sgd  replica 3") == [s - 0.5 * 2.0 for s in sums]
