"""Builds and runs examples/cpp, a downstream CMake project, against the installed cudist package.

This checks the C++ embedding end to end: the installed headers, ``cudistConfig.cmake`` found
through ``cudist.get_cmake_dir()``, the ``cudist::cudist`` target, and the kernels' results, all
with strict warnings as errors; and that every kernel, for every type, compiles that way from the
installed headers alone, and that the thread pool hands exceptions back to the caller.
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
STRICT_FLAGS = "-Wall -Wextra -Werror -pedantic"


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
    # A downstream project may build with strict warnings; the installed headers must pass them.
    cfg.append(f"-DCMAKE_CXX_FLAGS={STRICT_FLAGS}")
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


_STRICT_TU = r"""
// Instantiates every kernel of <cudist/cudist.hpp> for every type, under the strictest warnings a
// downstream project is likely to use, and checks the thread pool's exception handling.
#include <cudist/cudist.hpp>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAIL %s\n", what);
    ++failures;
  }
}

template <class T>
void collectives() {
  const std::size_t n = 3, count = 100;
  std::vector<std::vector<T>> b(n, std::vector<T>(count, T(1)));
  std::vector<T*> p;
  for (auto& x : b) p.push_back(x.data());
  cudist::all_reduce(p.data(), n, count, cudist::reduce_op::sum);
  cudist::all_reduce(b, cudist::reduce_op::mean);
  std::vector<T> out(count);
  cudist::reduce_to_one(const_cast<const T* const*>(p.data()), n, count, cudist::reduce_op::sum, out.data());
  cudist::broadcast(out.data(), p.data(), n, count);
  const std::size_t extents[3] = {1, 2, 3};
  std::vector<T> gathered(10 * 6 * 3);
  cudist::all_gather(const_cast<const T* const*>(p.data()), n, extents, 10, 3, gathered.data());
  cudist::assign(p.data(), n, count, out.data());
  cudist::assign_add(p.data(), n, count, out.data());
  cudist::assign_sub(p.data(), n, count, out.data());
  check(static_cast<double>(b[2][99]) == 9.0, "collectives");
}

template <class T>
void updates() {
  collectives<T>();
  const std::size_t n = 2, count = 100;
  std::vector<std::vector<T>> b(3 * n, std::vector<T>(count, T(1)));
  std::vector<T*> p;
  for (auto& x : b) p.push_back(x.data());
  const std::vector<T> grad(count, T(2));
  cudist::sgd(p.data(), n, count, grad.data(), 0.25);
  check(static_cast<double>(b[1][0]) == 0.5, "sgd");
  cudist::momentum(p.data(), p.data() + n, n, count, grad.data(), 0.1, 0.9, true);
  cudist::adam(p.data(), p.data() + n, p.data() + 2 * n, n, count, grad.data(), cudist::adam_lr_t(0.1, 0.9, 0.999, 1),
               0.9, 0.999, 1e-7);
}

}  // namespace

int main() {
  updates<float>();
  updates<double>();
  updates<cudist::half>();
  collectives<std::int32_t>();
  collectives<std::int64_t>();

  // An exception thrown by a piece of a parallel loop reaches the caller, whichever thread ran it,
  // and the pool keeps working afterwards.
  cudist::thread_pool pool(3);
  for (int round = 0; round < 50; ++round) {
    bool caught = false;
    try {
      pool.parallel_for(1000, 16, 1, [](std::size_t b, std::size_t) {
        if (b >= 500) throw std::runtime_error("piece failed");
      });
    } catch (const std::runtime_error&) {
      caught = true;
    }
    check(caught, "exception from a piece reaches the caller");
  }
  std::vector<int> hits(1000, 0);
  pool.parallel_for(1000, 16, 1, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) ++hits[i];
  });
  bool all_once = true;
  for (int h : hits) all_once = all_once && h == 1;
  check(all_once, "the pool works after an exception");
  std::printf(failures ? "FAILED\n" : "OK\n");
  return failures ? 1 : 0;
}
"""


@pytest.mark.parametrize("std", ["c++17", "c++20"])
def test_installed_headers_compile_strictly_and_pool_rethrows(tools, tmp_path, std):
    # Every kernel for every type (the example instantiates only float), with the installed headers
    # and no CMake: the include path of `python -m cudist --includes`, C++17 or later, threads.
    _, cxx, _ = tools
    src = tmp_path / "strict.cpp"
    src.write_text(_STRICT_TU)
    exe = tmp_path / "strict"
    flags = [f"-std={std}", "-O1", *STRICT_FLAGS.split(), "-Wshadow", "-Wconversion", "-Wsign-conversion"]
    _run([cxx, *flags, f"-I{cudist.get_include()}", str(src), "-o", str(exe), "-pthread"])
    assert _run([str(exe)]).strip().endswith("OK")
