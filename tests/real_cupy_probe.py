"""Checks against the real CuPy package, run by tests/test_real_cupy.py in a subprocess whose
``sys.path`` starts with a real CuPy (no GPU needed: importing CuPy and compiling with NVRTC need
none). Prints one JSON document.

    python tests/real_cupy_probe.py compile OUT_DIR   # every kernel x dtype for sm_80 and sm_90,
                                                      # CuPy's option assembly; cubins + SASS facts
    python tests/real_cupy_probe.py signatures        # the CuPy APIs cudist uses, as real CuPy has them
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ARCHS = ("80", "90")
DTYPES = ("float16", "float32", "float64", "int32", "int64", "bfloat16")


def _cupy():
    import cupy

    if hasattr(cupy, "_emu"):
        raise SystemExit("real_cupy_probe: imported the fake CuPy (tests/emu/fakecupy), not the real one")
    return cupy


def cuobjdump() -> str | None:
    """cuobjdump from the nvidia-cuda-cuobjdump wheel (next to CuPy), the toolkit, or PATH."""
    for entry in sys.path:
        for cand in sorted(Path(entry or ".").glob("nvidia/*/bin/cuobjdump")):
            return str(cand)
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root and (Path(root) / "bin" / "cuobjdump").is_file():
            return str(Path(root) / "bin" / "cuobjdump")
    return shutil.which("cuobjdump")


def _sass_facts(tool: str, path: Path) -> dict[str, dict]:
    """Per mangled kernel name: registers, stack and local bytes, and the memory instructions used."""
    # cuobjdump -sass runs nvdisasm (the nvidia-cuda-nvdisasm wheel puts it next to cuobjdump).
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")]))
    res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, timeout=300, env=env).stdout
    proc = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, timeout=300, env=env)
    if "nvdisasm" in proc.stderr:
        raise RuntimeError(f"cuobjdump -sass cannot run nvdisasm: {proc.stderr.strip()}")
    sass = proc.stdout
    ops: dict[str, set[str]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            ops[cur] = set()
        elif cur:
            ops[cur].update(re.findall(r"\b((?:LDG|STG|LD|ST)(?:\.[A-Z0-9]+)*)\b", line))
    out = {}
    for m in re.finditer(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res):
        out[m.group(1)] = {
            "reg": int(m.group(2)), "stack": int(m.group(3)), "shared": int(m.group(4)),
            "local": int(m.group(5)), "ops": sorted(ops.get(m.group(1), ())),
        }  # fmt: skip
    return out


def compile_all(out_dir: Path) -> dict:
    cupy = _cupy()
    from cupy._core import core
    from cupy.cuda import compiler

    import ml_dtypes  # noqa: F401 - np.dtype("bfloat16") is then the kernels' bfloat16

    from cudist._kernels import _cupy as backend

    # No GPU: the architecture CuPy would ask the device for is given instead.
    compiler._get_arch = lambda: ARCHS[-1]
    source, options = backend.nvrtc_program()
    # What cupy.RawModule(code=source, options=options) compiles with: CuPy's own assembly
    # (cupy._core.core.compile_with_cache), then -ftz=true (compiler._compile_with_cache_cuda).
    full = core.assemble_cupy_compiler_options(tuple(options)) + ("-ftz=true",)
    tool = cuobjdump()
    report: dict = {"kernels": {k: list(v) for k, v in backend.KERNELS.items()}, "cupy": cupy.__version__, "nvrtc": list(compiler._get_nvrtc_version()), "options": list(full),
                    "cuobjdump": tool, "builds": []}  # fmt: skip
    for arch in ARCHS:
        for dt in DTYPES:
            names = backend.compiled_names(dt)
            entry: dict = {"arch": arch, "dtype": dt, "names": names}
            compiler._get_arch_for_options_for_nvrtc = lambda a=None, arch=arch: (f"-arch=compute_{arch}", "ptx")
            ptx, _ = compiler.compile_using_nvrtc(source, full, arch=arch, name_expressions=names)
            ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
            entry["ptx_ftz_ops"] = sorted(set(re.findall(r"\b\w+\.\w*\.?ftz\.f32\b", ptx)))
            entry["ptx_fma"] = len(re.findall(r"\bfma\.rn\.f(?:32|64)\b", ptx))
            compiler._get_arch_for_options_for_nvrtc = lambda a=None, arch=arch: (f"-arch=sm_{arch}", "cubin")
            cubin, mapping = compiler.compile_using_nvrtc(source, full, arch=arch, name_expressions=names)
            entry["mapping"] = dict(mapping)
            path = out_dir / f"cudist_sm{arch}_{dt}.cubin"
            # CuPy hands the cubin over without its last byte (it strips a C string's NUL); the
            # driver loads it all the same, cuobjdump wants the file whole.
            path.write_bytes(cubin + b"\0")
            entry["cubin"] = str(path)
            try:
                entry["sass"] = _sass_facts(tool, path) if tool else None
            except RuntimeError as e:
                report["cuobjdump"], entry["sass"] = None, None
                report["sass_error"] = str(e)
            report["builds"].append(entry)
    return report


#: CuPy APIs cudist calls that are not a plain ``cupy.x.y`` chain in its source (methods of objects
#: it gets from CuPy); the chains themselves are found by tests/test_real_cupy.py in src/cudist.
METHODS = [
    "cupy.ndarray.copy", "cupy.ndarray.get", "cupy.ndarray.set", "cupy.ndarray.astype", "cupy.ndarray.fill",
    "cupy.ndarray.ravel", "cupy.ndarray.reshape", "cupy.ndarray.view",
    "cupy.cuda.MemoryPointer.copy_from_device_async", "cupy.cuda.MemoryPointer.copy_from_host_async",
    "cupy.cuda.MemoryPointer.copy_to_host_async",
    "cupy.cuda.Stream.wait_event", "cupy.cuda.Stream.synchronize", "cupy.cuda.Stream.use",
    "cupy.cuda.Stream.launch_host_func", "cupy.cuda.Event.record", "cupy.cuda.Event.synchronize",
    "cupy.cuda.Device.synchronize", "cupy.cuda.Device.use",
    "cupy.cuda.ExternalStream", "cupy.cuda.get_elapsed_time", "cupy.cuda.set_allocator",
    "cupy.cuda.MemoryAsyncPool", "cupy.cuda.MemoryPool.used_bytes", "cupy.cuda.alloc_pinned_memory",
    "cupy.RawKernel.__call__", "cupy.RawModule.get_function",
    "cupy.cuda.runtime.deviceCanAccessPeer", "cupy.cuda.runtime.deviceEnablePeerAccess",
    "cupy.cuda.runtime.getDeviceProperties", "cupy.cuda.runtime.getDeviceCount", "cupy.cuda.runtime.getDevice",
    "cupy.cuda.runtime.setDevice", "cupy.cuda.runtime.driverGetVersion", "cupy.cuda.runtime.runtimeGetVersion",
    "cupy.cuda.runtime.memGetInfo", "cupy.cuda.runtime.deviceSynchronize",
    "cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor",
    "cupy.cuda.nccl.NcclCommunicator", "cupy.cuda.nccl.NcclCommunicator.allReduce",
    "cupy.cuda.nccl.NcclCommunicator.initAll", "cupy.cuda.nccl.groupStart", "cupy.cuda.nccl.groupEnd",
    "cupy.cuda.nccl.get_unique_id", "cupy.cuda.nccl.get_version",
    "cupy.cuda.nccl.NcclCommunicator.abort", "cupy.cuda.nccl.NcclCommunicator.check_async_error",
    "cupy.cuda.nccl.NcclError", "cupy.cuda.Event",
]  # fmt: skip

_PARAM = re.compile(r"^\s*(?:(?P<type>[\w.\[\]]+(?:\s*\*)?)\s+)?(?P<stars>\*{0,2})(?P<name>\w+)\s*(?P<default>=.*)?$")


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


def describe(obj) -> dict | None:
    """The parameters of a callable: (name, kind, has default, declared type) each, from
    ``inspect.signature`` or, for Cython builtins, the signature line their docstring starts with."""
    target = obj.__init__ if inspect.isclass(obj) and not hasattr(obj, "__text_signature__") else obj
    try:
        sig = inspect.signature(obj)
        params = [
            {"name": p.name, "kind": p.kind.name, "default": p.default is not p.empty, "type": None}
            for p in sig.parameters.values() if p.name != "self"
        ]  # fmt: skip
        return {"how": "signature", "params": params}
    except (TypeError, ValueError):
        pass
    for doc in (getattr(obj, "__doc__", None), getattr(target, "__doc__", None)):
        m = re.match(r"\s*[\w.]+\((.*?)\)\s*(?:->.*)?$", (doc or "").split("\n", 1)[0])
        if not m:
            continue
        params, kind = [], "POSITIONAL_OR_KEYWORD"
        for raw in _split_params(m.group(1)):
            raw = raw.strip().replace("\\*", "*")
            if raw == "*":
                kind = "KEYWORD_ONLY"
                continue
            if raw == "/":
                for p in params:
                    p["kind"] = "POSITIONAL_ONLY"
                continue
            pm = _PARAM.match(raw)
            if not pm or pm.group("name") == "self":
                continue
            k = {"*": "VAR_POSITIONAL", "**": "VAR_KEYWORD"}.get(pm.group("stars"), kind)
            if k == "VAR_POSITIONAL":
                kind = "KEYWORD_ONLY"
            params.append({"name": pm.group("name"), "kind": k, "default": bool(pm.group("default")),
                           "type": pm.group("type")})  # fmt: skip
        return {"how": "docstring", "params": params}
    return None


def resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def signatures(names: list[str]) -> dict:
    import warnings

    out = {}
    try:
        import cupy.cuda.nccl as nccl

        out["__nccl_available__"] = bool(nccl.available)
    except Exception:  # noqa: BLE001
        out["__nccl_available__"] = False
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = resolve(name)
        except Exception as e:  # noqa: BLE001 - reported, the test decides
            out[name] = {"missing": f"{type(e).__name__}: {e}"}
            continue
        out[name] = describe(obj) if callable(obj) else {"how": "value", "params": None}
    return out


def main() -> None:
    what = sys.argv[1]
    if what == "compile":
        report = compile_all(Path(sys.argv[2]))
    elif what == "signatures":
        _cupy() if os.environ.get("CUDIST_PROBE_REAL", "1") == "1" else None
        report = signatures(json.loads(sys.stdin.read()))
    else:
        raise SystemExit(f"unknown command {what!r}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
