"""cudist's whole GPU test suite on the CPU: every gpu-marked test under the fake CuPy.

The fake (tests/emu/fakecupy) backs CuPy arrays with host memory tagged by device, runs cudist's
real CUDA kernels compiled for the host (tests/emu/build.py), and refuses what a GPU would refuse
(touching another GPU's memory without enabled peer access, out-of-bounds pointers, wrongly typed
kernel arguments). Work is asynchronous as on a GPU (queued per stream, run when waited for), so a
missing stream/event wait or a staging buffer reused too early gives wrong data, every time. The
gpu-marked tests run in a subprocess with 4 emulated GPUs: once with peer
access between all of them, once with none (so cross-GPU work must be staged through copies).
No gpu test may skip itself under the fake: the passed count must cover every collected test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "emu" / "fakecupy"
# Every test file with gpu/multi_gpu tests (the test_gpu_* files, and the common strategy, variable,
# input and optimizer tests over their GPU strategy kinds), except those that need a real CUDA
# runtime of their own: cudist._core's CUDA launchers and the compiled C++ CUDA example.
_REAL_GPU_ONLY = {"test_native_cuda.py", "test_cpp_example.py", Path(__file__).name}
GPU_FILES = sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if p.name not in _REAL_GPU_ONLY
)


def _compiler_or_skip():
    sys.path.insert(0, str(ROOT / "tests" / "emu"))
    try:
        import build  # noqa: PLC0415 - tests/emu/build.py
    finally:
        sys.path.pop(0)
    if build.compiler() is None:
        pytest.skip("no C++ compiler: the CUDA emulation cannot be built")


# The inner run's short summary (-rfEsx): "FAILED <nodeid> - <message>", "ERROR <nodeid> ...",
# "XFAIL <nodeid> ...", "SKIPPED [n] <file>:<line>: <reason>".
_SUMMARY_LINE = re.compile(r"^(?:FAILED|ERROR|XFAIL|XPASS|SKIPPED) .*$", re.M)
# The node id of a FAILED/ERROR line: a path and names without spaces, then maybe a parameter id in
# brackets (which may hold spaces, even " - ") up to the "]" that ends it before " - " or the line's end.
_FAILING = re.compile(r"^(?:FAILED|ERROR) ([^\s\[]+(?:\[.*?\])?(?= - |$)|\S+)", re.M)


def _report(peer: str, why: str, out: str, mode: str = "") -> str:
    """A failure message naming every test that failed, erred or skipped in the inner run."""
    failing = _FAILING.findall(out)
    head = f"gpu suite under the fake CuPy (peer={peer}{', mode=' + mode if mode else ''}) {why}"
    if failing:
        shown = ", ".join(failing[:5]) + (f", ... ({len(failing)} in all)" if len(failing) > 5 else "")
        head += f": {shown}"
    summary = "\n".join(_SUMMARY_LINE.findall(out)) or "(no short test summary: see the output)"
    return f"{head}\n{summary}\n--- the last 6000 characters of its output ---\n{out[-6000:]}"


def _run_gpu_suite(files, peer: str, **extra_env):
    env = dict(os.environ, **extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE), *filter(None, [env.get("PYTHONPATH")])])
    env["CUDIST_EMU_DEVICES"] = "4"
    env["CUDIST_EMU_PEER"] = peer
    env["COLUMNS"] = "160"  # the short summary keeps more of each failure's message
    env.pop("CUDIST_BACKEND", None)
    env.setdefault("CUDIST_EMU_MODE", "")  # only the tests that ask for a harder mode get one
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEsx", "--tb=short",
           "-m", "gpu or multi_gpu", *files]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(_report(peer, f"failed (exit {proc.returncode})", out, env.get("CUDIST_EMU_MODE", "")), pytrace=False)
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", out)) else 0
    for word in ("skipped", "deselected", "xfailed", "failed", "error"):
        if re.search(rf"\d+ {word}", out) and word != "deselected":
            why = f"reports {word} tests: none may skip or fail under the fake"
            pytest.fail(_report(peer, why, out, env.get("CUDIST_EMU_MODE", "")), pytrace=False)
    return passed, out


@pytest.fixture(scope="module")
def collected():
    """How many gpu/multi_gpu tests the GPU files hold (collection needs no GPU)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu or multi_gpu", *GPU_FILES]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
    assert m, proc.stdout[-2000:]
    return int(m.group(1))


def test_gpu_files_exist():
    assert "tests/test_gpu_kernels.py" in GPU_FILES and "tests/test_gpu_strategy.py" in GPU_FILES


@pytest.mark.heavy
def test_whole_gpu_suite_passes_under_the_fake(collected):
    _compiler_or_skip()
    passed, out = _run_gpu_suite(GPU_FILES, "all")
    assert collected > 0
    assert passed >= collected, f"only {passed} of {collected} gpu tests passed:\n{out[-3000:]}"


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["", "core"])
def test_kernel_and_strategy_suites_pass_without_peer_access(mode):
    """Without peer access every cross-GPU kernel operand must be staged: the multi_gpu tests check
    it, on the NVRTC path and on the C++ launchers' (``core``); the optimizers' fused pass across
    GPUs falls back to reducing first there, with the same bits."""
    _compiler_or_skip()
    files = ["tests/test_gpu_kernels.py", "tests/test_gpu_strategy.py", "tests/test_gpu_mixed_fused.py"]
    passed, _ = _run_gpu_suite(files, "none", CUDIST_EMU_MODE=mode)
    assert passed > 100


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["streams", "shuffle", "ftz", "core", "core,streams"])
def test_whole_gpu_suite_passes_in_the_harder_modes(collected, mode):
    """CUDIST_EMU_MODE (see tests/emu/fakecupy/cupy/_emu.py): other streams' queued work runs first
    whenever work must run (a GPU reusing a buffer a peer still reads is caught); each kernel
    launch runs its threads in a random order (aliasing races); float32 intrinsics flush
    subnormals as CuPy's -ftz=true makes them do; the collectives go through cudist._core's C++
    launchers (emulated, tests/emu/fakecupy/cupy/_launchers.py) instead of NVRTC, alone and with
    streams out of order. Each mode runs the whole suite, seeded."""
    _compiler_or_skip()
    passed, out = _run_gpu_suite(GPU_FILES, "all", CUDIST_EMU_MODE=mode, CUDIST_EMU_SEED="15")
    assert passed >= collected, f"only {passed} of {collected} gpu tests passed in mode {mode}:\n{out[-3000:]}"


@pytest.mark.heavy
def test_input_and_strategy_suites_pass_in_the_fakes_synchronous_mode():
    """CUDIST_EMU_SYNC=1 runs every operation at once (the debugging switch): nothing may depend on
    the queues (e.g. a test that only passes because some work never ran)."""
    _compiler_or_skip()
    files = ["tests/test_gpu_input.py", "tests/test_gpu_strategy.py"]
    passed, _ = _run_gpu_suite(files, "0,1;2,3", CUDIST_EMU_SYNC="1")
    assert passed > 50
