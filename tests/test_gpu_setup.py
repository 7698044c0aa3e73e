"""Install and driver problems on a first GPU run say what is wrong: CUDA's own error, the driver and
CuPy versions, and the pip extra or package that fixes it (no GPU needed: the fake CuPy plays the
machine, with CUDIST_EMU_DRIVER / CUDIST_EMU_RUNTIME setting the versions it reports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli, the same parser
    import tomli as tomllib

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "emu" / "fakecupy"


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join([str(FAKE), *filter(None, [os.environ.get("PYTHONPATH")])])
    full.pop("CUDIST_BACKEND", None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


_GPU0 = """
import cudist
try:
    cudist.OneDeviceStrategy("/gpu:0")
except ValueError as e:
    print(e)
else:
    print("no error")
"""


def test_an_old_driver_gives_cudas_error_and_the_fix():
    """CuPy for CUDA 13 on a CUDA 12.4 driver: every CUDA call fails with cudaErrorInsufficientDriver.
    The error names it, both versions, the R580 requirement and the cuda12 extra (it used to say only
    "0 logical GPUs ... is cudist[cuda] installed?")."""
    out = _run(_GPU0, CUDIST_EMU_DRIVER="12040", CUDIST_EMU_RUNTIME="13000")
    assert out.returncode == 0, out.stderr
    msg = out.stdout
    assert "cudaErrorInsufficientDriver" in msg, msg
    assert "CUDA 12.4" in msg and "CUDA 13.0" in msg, msg
    assert "R580" in msg and "cudist[cuda12]" in msg, msg


def test_no_device_says_so():
    out = _run(_GPU0, CUDIST_EMU_DEVICES="0")
    assert out.returncode == 0, out.stderr
    assert "CUDA reports no GPU" in out.stdout, out.stdout


def test_missing_cupy_names_the_extras(monkeypatch):
    from cudist import config

    monkeypatch.setattr(config, "_gpu_count_cache", [])
    monkeypatch.setattr(config, "_gpu_error", [])
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    reason = config.gpu_unavailable_reason()
    assert reason is not None and "cudist[cuda13]" in reason and "cudist[cuda12]" in reason, reason


@pytest.mark.parametrize(("runtime", "package"), [("12080", "nvidia-nccl-cu12"), ("13000", "nvidia-nccl-cu13")])
def test_nccl_hint_names_the_package_for_cupys_cuda(runtime, package):
    code = (
        "from cupy.cuda import nccl\n"
        "nccl.available = False\n"
        "from cudist._dataplane.transports import nccl as cn\n"
        "print(cn.load()[1])\n"
    )
    out = _run(code, CUDIST_EMU_RUNTIME=runtime, CUDIST_EMU_DRIVER="13000")
    assert out.returncode == 0, out.stderr
    assert f"pip install {package}" in out.stdout, out.stdout


def test_info_prints_versions_and_warns_about_an_old_driver():
    code = "import sys; from cudist.__main__ import main; sys.exit(main(['--info']))"
    out = _run(code, CUDIST_EMU_DRIVER="12040", CUDIST_EMU_RUNTIME="13000")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for key in ("cupy ", "cuda_runtime 13.0", "driver       12.4", "nccl "):
        assert key in text, text
    assert "WARNING" in text and "cudaErrorInsufficientDriver" in text and "cudist[cuda12]" in text, text
    ok = _run(code, CUDIST_EMU_DRIVER="13000", CUDIST_EMU_RUNTIME="13000")
    assert ok.returncode == 0 and "WARNING" not in ok.stdout, ok.stdout


def test_cuda_extras_match_cupy_nvrtc_headers_and_nccl():
    """cuda12 / cuda13 bring CuPy for that CUDA, NVRTC, the CUDA headers CuPy compiles the kernels
    with (cuda_fp16.h: without them CuPy refuses to compile any RawModule) and NCCL of the same
    major version; cuda is an alias of cuda13."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for major in ("12", "13"):
        deps = " ".join(extras[f"cuda{major}"])
        assert f"cupy-cuda{major}x" in deps
        suffix = "-cu12" if major == "12" else ""
        assert f"nvidia-cuda-nvrtc{suffix}=={major}.*" in deps, deps
        assert f"nvidia-cuda-runtime{suffix}=={major}.*" in deps, deps
        assert f"nvidia-nccl-cu{major}" in deps, deps
    assert extras["cuda"] == ["cudist[cuda13]"]
