"""``import cudist`` stays light: no numba, no CuPy, no native extension, nothing compiled."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("numba", "llvmlite", "cupy", "cudist._core", "cudist._kernels._numba", "cudist._kernels._native",
         "cudist._kernels._cupy", "tensorflow")


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, timeout=120, check=True)


def test_import_cudist_imports_nothing_heavy():
    out = _run("import sys, json, cudist; print(json.dumps(sorted(sys.modules)))").stdout
    mods = set(json.loads(out.strip().splitlines()[-1]))
    assert "cudist" in mods
    loaded = sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert loaded == [], f"import cudist loaded {loaded}"


def test_kernels_package_and_reference_backend_stay_light():
    # Picking the numpy backend (and reading the registry) must not load the others either.
    code = (
        "import sys, json\n"
        "from cudist._kernels import get_backend, available_backends\n"
        "available_backends(); get_backend('numpy')\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    mods = set(json.loads(_run(code).stdout.strip().splitlines()[-1]))
    loaded = sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert loaded == [], f"the numpy backend loaded {loaded}"


def test_import_cudist_is_quick():
    # -X importtime reports each module's cumulative import time in microseconds; a loose bound
    # (numba alone costs ~0.3 s) that a busy CI machine still meets.
    err = _run("import cudist", "-X", "importtime").stderr
    rows = [line.split("|") for line in err.splitlines() if line.startswith("import time:") and "|" in line]
    cum = {r[2].strip(): int(r[1]) for r in rows if r[1].strip().isdigit()}
    assert "cudist" in cum, err[-2000:]
    assert cum["cudist"] < 1_500_000, f"import cudist took {cum['cudist'] / 1e6:.2f} s"
