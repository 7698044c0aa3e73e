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


@pytest.mark.heavy
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

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
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
  // Two leaves per replica (100 and 7 elements), reduced back to back into one packed output: the
  // same values as reduce_to_one of each leaf.
  std::vector<T> small(n * 7, T(2)), packed(count + 7);
  std::vector<const T*> leaves;
  for (std::size_t r = 0; r < n; ++r) leaves.push_back(p[r]);
  for (std::size_t r = 0; r < n; ++r) leaves.push_back(small.data() + 7 * r);
  const std::size_t counts[2] = {count, 7};
  cudist::batch_reduce_to_one(leaves.data(), n, counts, 2, cudist::reduce_op::sum, packed.data());
  check(std::memcmp(packed.data(), out.data(), count * sizeof(T)) == 0 && static_cast<double>(packed[count + 6]) == 6.0,
        "batch_reduce_to_one");
  cudist::broadcast(out.data(), p.data(), n, count);
  const std::size_t extents[3] = {1, 2, 3};
  std::vector<T> gathered(10 * 6 * 3);
  cudist::all_gather(const_cast<const T* const*>(p.data()), n, extents, 10, 3, gathered.data());
  std::vector<T> fresh(gathered.size());  // a just-allocated output: ordinary stores, same result
  cudist::all_gather(const_cast<const T* const*>(p.data()), n, extents, 10, 3, fresh.data(),
                     &cudist::thread_pool::global(), true);
  check(std::memcmp(fresh.data(), gathered.data(), fresh.size() * sizeof(T)) == 0, "all_gather fresh_output");
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
  cudist::sgd(p.data(), n, count, grad.data(), 0.25, 0.0);
  check(static_cast<double>(b[1][0]) == 0.5, "sgd");
  cudist::nesterov(p.data(), p.data() + n, n, count, grad.data(), 0.1, 0.9, 0.0);
  // Adam: the adamw row without weight decay.
  cudist::adamw(p.data(), p.data() + n, p.data() + 2 * n, n, count, grad.data(), cudist::adam_lr_t(0.1, 0.9, 0.999, 1),
                0.9, 0.999, 1e-7, 0.0);
  // AdamW ... Lion, plain and fused (two gradients), RMSprop's variants with and without its optional slots.
  T* const* c = p.data();
  T* const* s1 = p.data() + n;
  T* const* s2 = p.data() + 2 * n;
  const T* grads[2] = {grad.data(), grad.data()};
  cudist::adamw(c, s1, s2, n, count, grad.data(), 0.01, 0.9, 0.999, 1e-7, 0.001);
  cudist::all_reduce_adamw(c, s1, s2, n, count, grads, 2, 0.01, 0.9, 0.999, 1e-7, 0.0);
  cudist::rmsprop_momentum<T>(c, s1, s2, n, count, grad.data(), 0.01, 0.9, 0.9, 1e-7, 0.001);
  cudist::all_reduce_rmsprop<T>(c, s1, n, count, grads, 2, 0.01, 0.9, 0.0, 1e-7, 0.0);
  cudist::adagrad(c, s1, n, count, grad.data(), 0.01, 1e-7, 0.0);
  cudist::all_reduce_adagrad(c, s1, n, count, grads, 2, 0.01, 1e-7, 0.001);
  cudist::adamax(c, s1, s2, n, count, grad.data(), cudist::adamax_lr_t(0.01, 0.9, 1), 0.9, 0.999, 1e-7, 0.0);
  cudist::all_reduce_adamax(c, s1, s2, n, count, grads, 2, 0.01, 0.9, 0.999, 1e-7, 0.001);
  cudist::nadam(c, s1, s2, n, count, grad.data(), 0.01, 0.9, 0.999, 1e-7, 0.5, 0.1, 0.01, 0.0);
  cudist::all_reduce_nadam(c, s1, s2, n, count, grads, 2, 0.01, 0.9, 0.999, 1e-7, 0.5, 0.1, 0.01, 0.001);
  cudist::lion(c, s1, n, count, grad.data(), 0.01, 0.9, 0.99, 0.0);
  cudist::all_reduce_lion(c, s1, n, count, grads, 2, 0.01, 0.9, 0.99, 0.001);
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

  // Loops of fewer threads than the pool (a worker sitting one out), with the workers spinning
  // between loops and with them blocking at once, and after wake(): every index exactly once.
  for (long long spin : {0LL, 1000000LL}) {
    pool.set_spin_time(spin);
    check(pool.spin_time() == spin, "set_spin_time");
    for (unsigned max_threads : {0u, 1u, 2u, 3u}) {
      for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{4099}}) {
        std::vector<std::atomic<int>> seen(n);
        pool.parallel_for(n, 5, 3, [&](std::size_t b, std::size_t e) {
          for (std::size_t i = b; i < e; ++i) seen[i].fetch_add(1);
        }, max_threads);
        bool once = true;
        for (auto& h : seen) once = once && h.load() == 1;
        check(once, "every index once, whatever the thread count");
      }
    }
    pool.wake();
  }
  check(pool.parallel_loops() > 0, "parallel_loops counts the loops run on workers");
  pool.resize(2);  // stops workers that may be spinning
  check(pool.size() == 2, "resize while workers spin");
  std::printf(failures ? "FAILED\n" : "OK\n");
  return failures ? 1 : 0;
}
"""


@pytest.mark.heavy
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


# ------------------------------------------------------------------------------------------ CUDA
CUDA_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpp_cuda"
EXIT_NO_GPU = 77  # what examples/cpp_cuda returns when no GPU is usable


def test_cuda_component_is_installed_exactly_when_built():
    cmake_dir = Path(cudist.get_cmake_dir())
    lib = cmake_dir.parents[2] / "lib" / "libcudist_cuda.a"
    assert (cmake_dir / "cudistCudaTargets.cmake").is_file() == _core.cuda_built
    if _core.cuda_built:
        assert lib.is_file()
        for header in ("launch.hpp", "p2p.hpp", "launch_impl.cuh", "p2p_impl.cuh"):
            assert (Path(cudist.get_include()) / "cudist" / "cuda" / header).is_file(), header


_FIND_CUDA_COMPONENT = """
cmake_minimum_required(VERSION 3.18)
project(find_cudist_cuda LANGUAGES CXX)
find_package(cudist CONFIG REQUIRED OPTIONAL_COMPONENTS cuda)
message(STATUS "cudist_cuda_FOUND=${cudist_cuda_FOUND}")
if(TARGET cudist::cuda)
  message(STATUS "has cudist::cuda")
endif()
find_package(cudist CONFIG COMPONENTS cuda QUIET)
message(STATUS "required component: cudist_FOUND=${cudist_FOUND}")
"""


def test_find_package_cuda_component(tools, tmp_path):
    # OPTIONAL_COMPONENTS cuda: found exactly when the package was built with CUDA (and the CUDA
    # toolkit is here, which it is wherever nvcc built it); a required `cuda` component of a
    # CPU-only package makes find_package fail, not the configure.
    cmake, cxx, _ = tools
    (tmp_path / "CMakeLists.txt").write_text(_FIND_CUDA_COMPONENT)
    out = _run([cmake, "-S", str(tmp_path), "-B", str(tmp_path / "build"), f"-DCMAKE_CXX_COMPILER={cxx}",
                f"-Dcudist_DIR={cudist.get_cmake_dir()}"])  # fmt: skip
    found = "TRUE" if _core.cuda_built else "FALSE"
    assert f"cudist_cuda_FOUND={found}" in out
    assert ("has cudist::cuda" in out) == _core.cuda_built
    assert f"required component: cudist_FOUND={'1' if _core.cuda_built else '0'}" in out


@pytest.fixture(scope="module")
def cuda_example(tools, tmp_path_factory):
    """examples/cpp_cuda configured and built against the installed package (plain C++, strict warnings)."""
    if not _core.cuda_built:
        pytest.skip("this cudist was built without CUDA (no cudist::cuda to link)")
    cmake, cxx, ninja = tools
    build = tmp_path_factory.mktemp("cuda_example")
    cfg = [cmake, "-S", str(CUDA_EXAMPLE), "-B", str(build), f"-DCMAKE_CXX_COMPILER={cxx}",
           "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_CXX_FLAGS={STRICT_FLAGS}", f"-Dcudist_DIR={cudist.get_cmake_dir()}"]  # fmt: skip
    if ninja:
        cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    _run(cfg)
    _run([cmake, "--build", str(build)])
    exe = build / ("cudist_cuda_example.exe" if os.name == "nt" else "cudist_cuda_example")
    assert exe.is_file()
    return exe


@pytest.mark.heavy
def test_cuda_example_builds_and_fails_cleanly_without_a_gpu(cuda_example):
    # CUDA_VISIBLE_DEVICES="" hides every GPU: the example must say so and exit 77, not crash.
    proc = subprocess.run([str(cuda_example)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # fmt: skip
    assert proc.returncode == EXIT_NO_GPU, proc.stdout + proc.stderr
    assert proc.stdout.startswith("no usable CUDA device")


@pytest.mark.gpu
@pytest.mark.heavy
def test_cuda_example_runs_on_gpus(cuda_example):
    proc = subprocess.run([str(cuda_example)], capture_output=True, text=True, timeout=300)
    if proc.returncode == EXIT_NO_GPU:
        pytest.skip(f"the example's CUDA runtime sees no GPU: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all_reduce sum: 4 replicas, element 5 = 11, ok" in proc.stdout  # (0+1+2+3) + 4 * 5/4
    assert re.search(r"^p2p_all_reduce mean: \d+ replicas, element 5 = .*ok$|skipped", proc.stdout, re.M), proc.stdout
    assert proc.stdout.strip().endswith("OK")


# ------------------------------------------------------------------- configuring cudist with CUDA
ROOT = Path(__file__).resolve().parents[1]


def _env_without_nvcc() -> dict[str, str]:
    """The environment minus every way CMake could find nvcc (CPU-only CI machines look like this)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_PATH", "CUDA_HOME", "CUDAToolkit_ROOT")}
    dirs = [d for d in env.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvcc").exists()]
    env["PATH"] = os.pathsep.join(dirs)
    return env


def _configure_cudist(tools, build: Path, *defs: str, env=None):
    cmake, cxx, ninja = tools
    cmd = [cmake, "-S", str(ROOT), "-B", str(build), f"-DCMAKE_CXX_COMPILER={cxx}", "-DCUDIST_BUILD_PYTHON=OFF", *defs]
    if ninja:
        cmd += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    ("mode", "nvcc", "ok", "says"),
    [
        ("OFF", True, True, "cudist: building without CUDA (CUDIST_WITH_CUDA=OFF)"),
        ("AUTO", False, True, "cudist: building without CUDA: no CUDA compiler was found"),
        ("ON", False, False, "CUDIST_WITH_CUDA=ON but no CUDA compiler was found"),
        ("maybe", True, False, "CUDIST_WITH_CUDA must be AUTO, ON or OFF, got 'maybe'"),
        # CMake's CUDA compiler checks compile with nvcc: seconds.
        pytest.param("AUTO", True, True, "cudist: building cudist::cuda with CUDA", marks=pytest.mark.heavy),
    ],
)
def test_configure_cuda_modes(tools, tmp_path, mode, nvcc, ok, says):
    if nvcc and mode == "AUTO" and shutil.which("nvcc") is None:
        pytest.skip("needs nvcc on PATH")
    proc = _configure_cudist(tools, tmp_path / "b", f"-DCUDIST_WITH_CUDA={mode}",
                             env=None if nvcc else _env_without_nvcc())  # fmt: skip
    out = " ".join((proc.stdout + proc.stderr).split())  # CMake wraps long messages
    assert (proc.returncode == 0) == ok, out
    assert says in out
    if ok:
        # The library target exists exactly when the configure says it builds it.
        build_files = "".join(p.read_text() for p in (tmp_path / "b").glob("*") if p.name in ("build.ninja", "Makefile"))
        assert ("cudist_cuda.dir" in build_files) == says.startswith("cudist: building cudist::cuda")


@pytest.mark.heavy
def test_cpu_only_package_has_no_cuda_component(tools, tmp_path):
    # A package built without CUDA: cudist::cudist works, `cuda` is reported missing, and the
    # version file stays architecture-independent (header-only).
    proc = _configure_cudist(tools, tmp_path / "b", "-DCUDIST_WITH_CUDA=OFF", f"-DCMAKE_INSTALL_PREFIX={tmp_path / 'p'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cmake, cxx, _ = tools
    _run([cmake, "--build", str(tmp_path / "b")])
    _run([cmake, "--install", str(tmp_path / "b")])
    cmake_dir = tmp_path / "p" / "cudist" / "share" / "cmake" / "cudist"
    assert (cmake_dir / "cudistConfig.cmake").is_file()
    assert not (cmake_dir / "cudistCudaTargets.cmake").exists()
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "CMakeLists.txt").write_text(_FIND_CUDA_COMPONENT)
    out = _run([cmake, "-S", str(proj), "-B", str(proj / "build"), f"-DCMAKE_CXX_COMPILER={cxx}", f"-Dcudist_DIR={cmake_dir}"])
    assert "cudist_cuda_FOUND=FALSE" in out and "has cudist::cuda" not in out
    assert "required component: cudist_FOUND=0" in out
