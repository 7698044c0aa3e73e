"""The shipped CUDA kernels compile: with nvcc for sm_80 and sm_90, and with NVRTC as CuPy sees them.

No GPU needed. The kernel list comes from <cudist/kernels/kernel_list.cuh> (as the cupy backend's
``KERNELS`` does, parsed by :mod:`cudist._kernels._cuda_launch` without importing CuPy), so what is
compiled here is exactly what the cupy backend asks for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cudist
from cudist._kernels._cuda_headers import cuda_include_dirs
from cudist._kernels._cuda_launch import (
    UPDATE_RULES,
    dtype_ctypes,
    kernel_list,
    mixed_gradients,
    parse_update_rules,
    takes_mixed_gradients,
)

ROOT = Path(__file__).resolve().parents[1]
KERNELS: dict[str, tuple[str, ...]] = kernel_list(cudist.get_include())
CTYPES: dict[str, str] = dtype_ctypes(cudist.get_include())
MIXED: dict[str, tuple[str, ...]] = mixed_gradients(cudist.get_include())
INCLUDE = Path(cudist.get_include())


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def _cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h / cuda_runtime_api.h: the ones nvcc itself uses."""
    dirs = []
    nvcc = _nvcc()
    if nvcc:
        # nvcc may be a wrapper script; its dry run names the real include directories.
        res = subprocess.run([nvcc, "--dryrun", "-c", "x.cu"], capture_output=True, text=True, timeout=60)
        for line in (res.stdout + res.stderr).splitlines():
            if "INCLUDES=" in line:
                dirs += re.findall(r'-I"?([^" ]+)', line)
    dirs = [d for d in dict.fromkeys(dirs) if (Path(d) / "cuda_fp16.h").is_file()]
    # ... and wherever the cupy backend looks (the CuPy-free part of its search).
    return dirs + [d for d in cuda_include_dirs() if d not in dirs]


def _instantiations(packed: bool) -> list[str]:
    out = []
    for kernel, dtypes in KERNELS.items():
        for dt in dtypes:
            # The mixed-precision forms <T, G> too (CUDIST_MIXED_GRADIENTS).
            args = [CTYPES[dt]] + ([f"{CTYPES[dt]}, {CTYPES[g]}" for g in MIXED.get(dt, ())]
                                   if takes_mixed_gradients(kernel) else [])
            for a in args:
                for suffix in ("", "_packed") if packed else ("",):
                    out.append(f"cudist::kernels::{kernel}{suffix}<{a}>")
    return out


def test_kernel_list_covers_the_headers():
    """Every __global__ template in the headers is in KERNELS (a new kernel cannot go untested)."""
    text = "\n".join(p.read_text() for p in sorted((INCLUDE / "cudist" / "kernels").glob("*.cuh")))
    declared = set(re.findall(r"__global__\s+void\s+(\w+)\s*\(", text))
    assert declared, "no kernels found in the headers"
    # The update rules' kernels: one generator (both forms) expanded over the rules' table.
    assert re.search(r"__global__\s+void\s+mirrored_all_reduce_##name##suffix\(", text)
    assert "CUDIST_UPDATE_RULE_LIST(CUDIST_RULE_KERNELS_, ~)" in text
    rules = parse_update_rules((INCLUDE / UPDATE_RULES).read_text())
    declared |= {f"mirrored_all_reduce_{name}{form}" for name in rules for form in ("", "_packed")}
    expected = set(KERNELS) | {k + "_packed" for k in KERNELS}
    assert declared == expected
    assert set(CTYPES) == {"float16", "float32", "float64", "int32", "int64", "bfloat16"}
    assert CTYPES["bfloat16"] == "__nv_bfloat16"
    for kernel, dtypes in KERNELS.items():
        assert set(dtypes) <= set(CTYPES), kernel


nvcc_required = pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (the CUDA toolkit)")


@nvcc_required
@pytest.mark.heavy
def test_nvcc_compiles_every_kernel_and_launcher_for_sm80_and_sm90(tmp_path):
    """Every kernel x dtype, both entry-point forms, plus the C++ launcher library, in one nvcc run."""
    src = tmp_path / "cudist_all.cu"
    lines = [
        f'#include "{ROOT / "csrc" / "src" / "cuda" / "launch.cu"}"',
        "// Taking the address instantiates each kernel template.",
        "void* cudist_every_kernel[] = {",
    ]
    lines += [f"    (void*)&{name}," for name in _instantiations(packed=True)]
    lines.append("};")
    src.write_text("\n".join(lines) + "\n")
    obj = tmp_path / "cudist_all.o"
    cmd = [
        _nvcc(), "-std=c++17", f"-I{INCLUDE}",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
        "-Werror", "all-warnings",
        "-c", str(src), "-o", str(obj),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"nvcc failed:\n{res.stdout}\n{res.stderr}"
    assert obj.stat().st_size > 0
    # The multi-GPU launcher is in the library too, for every dtype.
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, timeout=60).stdout
        for t in ("float", "double", "__half", "int", "long long"):
            assert f"cudist::cuda::p2p_all_reduce<{t}>(" in symbols, t
    # Both architectures made it into the fat binary.
    cuobjdump = Path(_nvcc()).with_name("cuobjdump")
    if cuobjdump.is_file():
        listing = subprocess.run([str(cuobjdump), "--list-elf", str(obj)], capture_output=True, text=True).stdout
        assert "sm_80" in listing and "sm_90" in listing, listing


@nvcc_required
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_launch_header_is_plain_cpp(tmp_path):
    """<cudist/cuda/launch.hpp> compiles with a host compiler (no CUDA syntax in it)."""
    inc = _cuda_include_dirs()
    if not inc:
        pytest.skip("CUDA headers not found next to nvcc")
    src = tmp_path / "host.cpp"
    src.write_text(
        "#include <cudist/cuda/launch.hpp>\n"
        "#include <cudist/cuda/p2p.hpp>\n"
        "cudaError_t f(float** b, __half** h) {\n"
        "  cudaError_t e = cudist::cuda::all_reduce<float>(b, 2, 10, cudist::reduce_op::mean);\n"
        "  if (e != cudaSuccess) return e;\n"
        "  const int devices[2] = {0, 1};\n"
        "  e = cudist::cuda::p2p_all_reduce<__half>(h, devices, nullptr, 2, 10, cudist::reduce_op::sum);\n"
        "  return e != cudaSuccess ? e : cudist::cuda::sgd<__half>(h, 2, h[0], 0.1, 0.0, 10);\n"
        "}\n"
    )
    cmd = ["g++", "-std=c++17", "-Wall", "-Werror", f"-I{INCLUDE}", *(f"-I{d}" for d in inc), "-c", str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------------------------------- NVRTC
def _find_nvrtc() -> str | None:
    """libnvrtc: $CUDIST_NVRTC_LIBRARY, the nvidia-cuda-nvrtc wheel, the toolkit, or the loader path."""
    cands = [os.environ.get("CUDIST_NVRTC_LIBRARY", "")]
    for entry in sys.path:
        cands += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnvrtc.so*")))
    nvcc = _nvcc()
    if nvcc:
        root = Path(os.path.realpath(nvcc)).parent.parent
        cands += sorted(glob.glob(str(root / "lib64" / "libnvrtc.so*")))
        cands += sorted(glob.glob(str(root / "targets" / "*" / "lib" / "libnvrtc.so*")))
    cands.append(ctypes.util.find_library("nvrtc") or "")
    for c in cands:
        if c and "builtins" not in c and "alt" not in Path(c).name and (os.path.isfile(c) or "/" not in c):
            return c
    return None


def _load_nvrtc(path: str):
    # libnvrtc dlopens its builtins library by name; preload the one next to it.
    for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
        if ".alt." not in b:
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


@pytest.mark.skipif(_find_nvrtc() is None, reason="needs libnvrtc (pip install nvidia-cuda-nvrtc, or the CUDA toolkit)")
@pytest.mark.heavy
def test_nvrtc_compiles_every_name_expression():
    """The source the cupy backend hands to RawModule compiles under NVRTC (__CUDACC_RTC__, no host
    headers) with CuPy's forced -ftz=true, and every name expression resolves to a kernel."""
    inc = _cuda_include_dirs()
    if not inc:
        pytest.skip("CUDA headers (cuda_fp16.h) not found; CuPy supplies them at run time")
    lib = _load_nvrtc(_find_nvrtc())
    prog = ctypes.c_void_p()
    source = b"#include <cudist/kernels/kernels.cuh>\n"
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"cudist.cu", 0, None, None) == 0
    try:
        names = [n.encode() for n in _instantiations(packed=False)]
        for n in names:
            assert lib.nvrtcAddNameExpression(prog, n) == 0
        opts = [b"-std=c++17", f"-I{INCLUDE}".encode(), *(f"-I{d}".encode() for d in inc)]
        opts += [b"-arch=compute_80", b"-ftz=true"]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, f"NVRTC failed ({lib.nvrtcGetErrorString(rc).decode()}):\n{log.value.decode()}"
        lowered = {}
        for n in names:
            out = ctypes.c_char_p()
            assert lib.nvrtcGetLoweredName(prog, n, ctypes.byref(out)) == 0, n
            lowered[n] = out.value
        assert all(v and v.startswith(b"_Z") for v in lowered.values()), lowered
        assert len(set(lowered.values())) == len(names)  # one distinct kernel per (name, dtype)
        ptx_size = ctypes.c_size_t()
        assert lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)) == 0
        ptx = ctypes.create_string_buffer(ptx_size.value)
        assert lib.nvrtcGetPTX(prog, ptx) == 0
        text = ptx.value.decode()
        for v in lowered.values():
            assert f".entry {v.decode()}(" in text
        # The kernels move 16-byte vectors, and never contract multiply-adds (NumPy does not).
        assert "ld.v4" in text or "ld.global.v4" in text
        assert "fma.rn.f32" not in text and "fma.rn.f64" not in text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_cuda_include_dirs_search_order(tmp_path, monkeypatch):
    """The cupy backend's header search: explicit roots first, then $CUDA_PATH/$CUDA_HOME; only
    directories that hold cuda_fp16.h, each once."""
    roots = {}
    for name in ("explicit", "env", "empty"):
        (tmp_path / name / "include").mkdir(parents=True)
        roots[name] = tmp_path / name
    for name in ("explicit", "env"):
        (roots[name] / "include" / "cuda_fp16.h").write_text("// stand-in\n")
    monkeypatch.setenv("CUDA_PATH", str(roots["env"]))
    monkeypatch.setenv("CUDA_HOME", str(roots["env"]))
    got = cuda_include_dirs([roots["explicit"], roots["empty"], tmp_path / "missing"])
    assert got[:2] == [str(roots["explicit"] / "include"), str(roots["env"] / "include")]
    assert str(roots["empty"] / "include") not in got
    assert len(got) == len(set(got))
    assert all((Path(d) / "cuda_fp16.h").is_file() for d in got)
