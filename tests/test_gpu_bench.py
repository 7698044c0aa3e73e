"""Smoke tests of the GPU benchmarks at tiny sizes (need a GPU with CuPy; skipped without one).

They make sure the benchmarks a GPU session will run (``bench/gpu_kernels.py``, ``cudist-bench
--backend cupy``) work end to end and that their correctness column reads 0, before device time is
spent on the real sizes. Timings at these sizes mean nothing and are not asserted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
TINY = ["-b", "4K", "-e", "64K", "-f", "4", "-n", "2", "-w", "1", "--no-progress", "--copy-size", "1M"]


def _rows(doc):
    return [r for t in doc["tables"] for r in t["rows"]]


@pytest.mark.parametrize(
    "cmd",
    [["all-reduce"], ["all-reduce", "-o", "mean", "-d", "float16,int64"], ["all-gather"], ["broadcast"],
     ["split", "-d", "int32"], ["update", "--optimizer", "sgd"], ["update", "--optimizer", "momentum"],
     ["update", "--optimizer", "adamw"]],
    ids=lambda c: "-".join(c),
)
def test_cudist_bench_cupy_rows_are_checked(tmp_path, capsys, cmd):
    from cudist.bench import main

    out = tmp_path / "bench.json"
    # 11 replicas: more than one kernel launch's worth of buffers (MAX_REPLICAS = 8).
    rc = main([*cmd, *TINY, "--replicas", "11", "--backend", "cupy", "--json", str(out)])
    assert rc == 0
    rows = _rows(json.loads(out.read_text()))
    dtypes = cmd[cmd.index("-d") + 1].split(",") if "-d" in cmd else ["float32"]
    assert len(rows) == 3 * len(dtypes)  # 4K, 16K, 64K per dtype
    for r in rows:
        assert r["backend"] == "cupy" and r["replicas"] == 11
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0
    text = capsys.readouterr().out
    assert "GPU copy ceiling" in text and "# Out of bounds values : 0 OK" in text
    from cudist._kernels import get_backend

    # The header says how the cupy backend launches (cudist._core's C++ launchers or NVRTC).
    assert f"# cupy launch path: {get_backend('cupy').launch_path}\n" in text


def test_gpu_kernels_script_reports_every_row():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_kernels.py"), "--mib", "1", "--repeats", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    for n in (2, 4, 8):
        assert re.search(rf"all_reduce sum N={n}\s+{n}\s+[\d.]+\s+[\d.]+\s+\d+%\s+0\n", out), out
    for n in (1, 2, 4):
        assert re.search(rf"adam N={n}\s+{n}\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+0\n", out), out
    assert "target >= 85%" in out and "wrong elements: 0" in out
    assert re.search(r"^launch path: (NVRTC|cudist\._core's CUDA launchers)", out, re.M), out
