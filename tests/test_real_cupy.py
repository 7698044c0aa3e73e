"""Checks against the real CuPy package, without a GPU (importing CuPy and compiling need none).

* compile: the cupy backend's exact NVRTC program (``nvrtc_program`` + ``compiled_names``) through
  CuPy's own option assembly and its forced ``-ftz=true``, for sm_80 and sm_90, every kernel and dtype;
* SASS gate (cuobjdump from the ``nvidia-cuda-cuobjdump`` wheel): no spills (no stack or local
  memory), a register budget, 128-bit global loads and stores in every kernel;
* signature diff: every CuPy API cudist uses, as the fake CuPy (tests/emu/fakecupy) and the real
  one declare it (``inspect.signature``, else the signature line Cython puts in docstrings).

Real CuPy comes from the directory named by ``CUDIST_REAL_CUPY`` (``pip install --target DIR
cupy-cuda13x cuda-pathfinder nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm``: .ci/run does this) or from
the environment when ``import cupy`` gives a real one; otherwise these tests skip, saying so.
The checks run in subprocesses, so this process never imports CuPy.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudist._kernels._cuda_launch import takes_mixed_gradients

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "real_cupy_probe.py"
FAKE = ROOT / "tests" / "emu" / "fakecupy"

pytestmark = pytest.mark.heavy

#: The hot kernels move data in 16-byte vectors; each must load (LDG) and store 128 bits at a time.
#: reduce_scatter stores only the owner's chunk (1/n of what it reads) and nvcc splits that store
#: into four 32-bit STG (seen with NVRTC 13.5 on sm_80/sm_90): allowed, recorded here.
STORE_128_EXEMPT = {"reduce_scatter_packed"}
#: A mixed-precision instantiation (<float, __half / __nv_bfloat16>) of a kernel that reads only the
#: 16-bit gradients (LossScaleOptimizer's reduce_unscale_finite) loads each vector of four of them
#: in one 64-bit LDG, half the 128-bit float32 vector they widen into and store as.
LOAD_128_EXEMPT_MIXED = {"reduce_unscale_finite_packed"}
#: Registers per thread: 256-thread blocks keep >= 2 resident blocks per SM below 128. Without
#: __launch_bounds__ the collectives take 32-56 registers (5+ blocks per SM) and Adam/RMSprop up to
#: 121, none spilling (NVRTC 13.5, sm_80/sm_90). __launch_bounds__ was tried and left off: (256)
#: made ptxas spill (Lion, float16, sm_80); (256, 4) on the collectives spilled 8-16 bytes;
#: (256, 2) spilled nothing but raised most kernels' registers by 10-110% (one-shot float32 48 -> 84),
#: fewer resident blocks for no measured gain.
REGISTER_BUDGET = 128
#: Kernels over the budget, each with its own ceiling (no spills still). The fused
#: all-reduce + AMSGrad update took 134-143 registers until the kernels told NVVM their pointers
#: address global memory (kernels/common.cuh, assume_global); 100-122 since (NVRTC 13, 2026-11-28).
#: RMSprop's fused kernel on bfloat16 variables (each stored value rounded to bfloat16 on its bits,
#: ml_dtypes' NaN) took 130 on sm_90 (NVRTC 13.5, 2026-11-28), no spills: one resident 256-thread
#: block per SM instead of two; its other dtypes stay under the budget.
REGISTER_EXEMPT: dict[str, int] = {"mirrored_all_reduce_rmsprop_packed": 136}


def _real_env() -> dict[str, str] | None:
    """The environment of a subprocess that imports the real CuPy, or None when there is none."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDIST_EMU_MODE",)}
    extra = os.environ.get("CUDIST_REAL_CUPY")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != FAKE.resolve()]
    env["PYTHONPATH"] = os.pathsep.join(([extra] if extra else []) + paths)
    check = "import cupy, sys; sys.exit(1 if hasattr(cupy, '_emu') else 0)"
    ok = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, timeout=120, cwd=ROOT)
    return env if ok.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def _env_or_reason() -> tuple[dict[str, str] | None, str]:
    env = _real_env()
    if env is None:
        return None, ("real CuPy is not importable: pip install --target DIR cupy-cuda13x cuda-pathfinder "
                      "nvidia-cuda-nvrtc nvidia-cuda-cuobjdump, then CUDIST_REAL_CUPY=DIR (.ci/run does this)")
    return env, ""


def _env() -> dict[str, str]:
    env, why = _env_or_reason()
    if env is None:
        pytest.skip(why)
    return env


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = _env()
    out = tmp_path_factory.mktemp("real-cupy")
    proc = subprocess.run([sys.executable, str(PROBE), "compile", str(out)], env=env, capture_output=True,
                          text=True, timeout=900, cwd=ROOT)  # fmt: skip
    if proc.returncode != 0 and "CUDA headers" in proc.stderr + proc.stdout:
        pytest.skip("CuPy finds no CUDA headers (cuda_fp16.h): pip install nvidia-cuda-runtime, or set CUDA_PATH")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _kernel_name(entry: dict, mangled: str) -> str:
    for expr, m in entry["mapping"].items():
        if m == mangled:
            return expr.split("::")[-1].split("<")[0]
    return mangled


def _is_mixed(entry: dict, mangled: str) -> bool:
    """Whether the instantiation is a mixed-precision one, ``<T, G>`` with 16-bit G."""
    return any(m == mangled and (", __half>" in e or ", __nv_bfloat16>" in e) for e, m in entry["mapping"].items())


def test_cupy_compiles_every_kernel_and_dtype_for_sm80_and_sm90(compiled):
    KERNELS = compiled["kernels"]  # noqa: N806 - cudist._kernels._cupy.KERNELS (this process has no CuPy)
    assert "-ftz=true" in compiled["options"] and any(o.startswith("--std=") or o.startswith("-std=")
                                                      for o in compiled["options"])  # fmt: skip
    seen = {(b["arch"], b["dtype"]) for b in compiled["builds"]}
    dtypes = ("float16", "float32", "float64", "int32", "int64", "bfloat16")
    assert seen == {(a, d) for a in ("80", "90") for d in dtypes}
    for b in compiled["builds"]:
        want = {k + "_packed" for k, dts in KERNELS.items() if b["dtype"] in dts}
        got = {expr.split("::")[-1].split("<")[0] for expr in b["mapping"]}
        assert got == want, (b["arch"], b["dtype"])
        assert all(m.startswith("_Z") for m in b["mapping"].values())
        # The mixed-precision <T, G> instantiations compile into T's module too.
        takes_mixed = [k for k in want if takes_mixed_gradients(k.removesuffix("_packed"))]
        mixed = {f"{k}<{g}>" for k in takes_mixed for g in compiled["mixed"].get(b["dtype"], ())}
        assert len(set(b["mapping"].values())) == len(want) + len(mixed)
        if b["dtype"] == "float32":
            assert "reduce_unscale_finite_packed" in takes_mixed
            assert len(mixed) == 2 * len(takes_mixed) > 0
            assert sum(", __nv_bfloat16>" in e or ", __half>" in e for e in b["mapping"]) == len(mixed)


def test_no_flush_to_zero_arithmetic_under_cupys_ftz_flag(compiled):
    """CuPy compiles with -ftz=true; the kernels' float32 arithmetic must not flush subnormals
    (NumPy keeps them), and nothing is contracted into an FMA."""
    for b in compiled["builds"]:
        arith = [op for op in b["ptx_ftz_ops"] if op.split(".")[0] in ("add", "sub", "mul", "div", "sqrt", "rcp", "fma")]
        assert arith == [], (b["arch"], b["dtype"], arith)
        assert b["ptx_fma"] == 0, (b["arch"], b["dtype"])


def _sass(compiled):
    if not compiled["cuobjdump"]:
        why = compiled.get("sass_error") or "no cuobjdump"
        pytest.skip(f"{why} (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): the SASS gate cannot run")
    for b in compiled["builds"]:
        for mangled, facts in b["sass"].items():
            yield b, _kernel_name(b, mangled), facts, _is_mixed(b, mangled)


def test_sass_no_spills_and_registers_within_budget(compiled):
    over = []
    for b, name, f, _ in _sass(compiled):
        assert f["stack"] == 0 and f["local"] == 0, f"sm_{b['arch']} {b['dtype']} {name} spills: {f}"
        if f["reg"] > REGISTER_EXEMPT.get(name, REGISTER_BUDGET):
            over.append(f"sm_{b['arch']} {b['dtype']} {name}: {f['reg']} registers")
    assert not over, over


def test_sass_hot_kernels_move_128_bit_vectors(compiled):
    missing = []
    for b, name, f, mixed in _sass(compiled):
        ops = set(f["ops"])
        if mixed and name in LOAD_128_EXEMPT_MIXED:
            if "LDG.E.64" not in ops:
                missing.append(f"sm_{b['arch']} {b['dtype']} mixed {name}: no 64-bit load of 16-bit gradients ({sorted(ops)})")
        elif "LDG.E.128" not in ops:
            missing.append(f"sm_{b['arch']} {b['dtype']} {name}: no LDG.E.128 ({sorted(ops)})")
        if name not in STORE_128_EXEMPT and not ops & {"STG.E.128", "ST.E.128"}:
            missing.append(f"sm_{b['arch']} {b['dtype']} {name}: no 128-bit store ({sorted(ops)})")
    assert not missing, "\n".join(missing)


# --------------------------------------------------------------------------------- signature diff
def _cupy_chains() -> set[str]:
    """Every ``cupy.a.b...`` attribute chain in src/cudist (the CuPy APIs named in the source)."""
    chains = set()
    for path in (ROOT / "src" / "cudist").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "_parent", None), ast.Attribute):
                parts = []
                cur = node
                while isinstance(cur, ast.Attribute):
                    parts.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id == "cupy":
                    chains.add(".".join(["cupy", *reversed(parts)]))
    # Keep the longest chains only where a prefix is a module/class on the way (cupy.cuda, ...).
    return {c for c in chains if c.count(".") >= 1 and not c.endswith(("float32", "float16", "float64"))}


def _probe_signatures(env: dict[str, str], names: list[str], real: bool) -> dict:
    env = dict(env, CUDIST_PROBE_REAL="1" if real else "0")
    proc = subprocess.run([sys.executable, str(PROBE), "signatures"], input=json.dumps(names), env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _fake_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.fixture(scope="module")
def signature_pairs():
    sys.path.insert(0, str(PROBE.parent))
    try:
        import real_cupy_probe  # noqa: PLC0415 - tests/real_cupy_probe.py
    finally:
        sys.path.pop(0)
    names = sorted(_cupy_chains() | set(real_cupy_probe.METHODS))
    real = _probe_signatures(_env(), names, real=True)
    fake = _probe_signatures(_fake_env(), names, real=False)
    if not real.pop("__nccl_available__"):
        # Without libnccl (nvidia-nccl-cu13, 300 MB) CuPy's NCCL module has no bindings to compare.
        names = [n for n in names if not n.startswith("cupy.cuda.nccl.") or n == "cupy.cuda.nccl.available"]
    fake.pop("__nccl_available__", None)
    return names, real, fake


def _positional(desc):
    return [p["name"] for p in desc["params"] if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]


def test_fake_cupy_has_every_api_cudist_uses(signature_pairs):
    names, real, fake = signature_pairs
    missing_real = [n for n in names if "missing" in real[n]]
    assert not missing_real, f"cudist uses CuPy APIs that real CuPy lacks: {missing_real}"
    missing_fake = [n for n in names if "missing" in fake[n]]
    assert not missing_fake, f"the fake CuPy lacks APIs cudist uses: {missing_fake}"


def test_fake_cupy_signatures_match_real_cupy(signature_pairs):
    """Positional parameters agree in name and order (as far as the real one declares them), and
    every keyword the real API takes that the fake lacks is listed (the fake may take more)."""
    names, real, fake = signature_pairs
    diffs = []
    for n in names:
        r, f = real.get(n) or {}, fake.get(n) or {}
        if not r.get("params") or not f.get("params") or "missing" in r or "missing" in f:
            continue
        r = dict(r, params=[p for p in r["params"] if not p["name"].startswith("_")])  # CuPy-internal
        fake_names = {p["name"] for p in f["params"]}
        fake_var_kw = any(p["kind"] == "VAR_KEYWORD" for p in f["params"])
        fake_var_pos = any(p["kind"] == "VAR_POSITIONAL" for p in f["params"])
        rp, fp = _positional(r), _positional(f)
        if not fake_var_pos and fp[: len(rp)] != rp:
            diffs.append(f"{n}: positional {fp} (fake) vs {rp} (real)")
        required_fake = [p["name"] for p in f["params"] if not p["default"] and p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]
        extra_required = [x for x in required_fake if x not in {p["name"] for p in r["params"]}]
        if extra_required and not any(p["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD") for p in r["params"]):
            diffs.append(f"{n}: the fake requires {extra_required}, which real CuPy does not take")
        lacking = [p["name"] for p in r["params"] if p["kind"] in ("KEYWORD_ONLY", "POSITIONAL_OR_KEYWORD")
                   and p["name"] not in fake_names and not fake_var_kw]  # fmt: skip
        if lacking:
            diffs.append(f"{n}: the fake lacks keyword(s) {lacking}")
    assert not diffs, "\n".join(diffs)


def test_fake_requires_tuples_where_real_cupy_does():
    """Real CuPy's RawModule takes ``options`` as a tuple and RawKernel launches take tuple grid and
    block (Cython-typed: a list or an int is a TypeError); the fake refuses the same."""
    code = """
import numpy as np, cupy
from cudist._kernels import _cupy as C
src, opts = C.nvrtc_program()
names = C.compiled_names("float32")
for bad in (list(opts),):
    try:
        cupy.RawModule(code=src, options=bad, name_expressions=names)
    except TypeError:
        pass
    else:
        raise SystemExit("RawModule accepted options as a list")
mod = cupy.RawModule(code=src, options=opts, name_expressions=names)
k = mod.get_function(names[3])  # broadcast_packed<float>
a = cupy.zeros(8, np.float32)
args = (a, C._pack([a]), np.int32(1), np.int64(8))
for grid, block in ((1, (256,)), ((1,), 256), ([1], (256,)), ((1,), [256])):
    try:
        k(grid, block, args)
    except TypeError:
        continue
    raise SystemExit(f"launch accepted grid={grid!r} block={block!r}")
k((1,), (256,), args)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], env=_fake_env(), capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
