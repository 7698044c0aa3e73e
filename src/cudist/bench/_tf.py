"""Runs the TensorFlow side of ``--compare tf`` in a subprocess and reads back its JSON.

TensorFlow is never a dependency: the worker script (``_tf_worker.py``, standalone, needs only
NumPy and TensorFlow) runs under ``--tf-python`` / ``$CUDIST_BENCH_TF_PYTHON`` or, when TensorFlow is
importable here, under this interpreter. A subprocess also keeps TF's threads and logical-device
configuration out of the process being measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from cudist import _settings

__all__ = ["TFUnavailable", "find_tf_python", "run_worker", "compare", "modes", "WORKER"]

WORKER = Path(__file__).with_name("_tf_worker.py")


class TFUnavailable(RuntimeError):
    """No python with TensorFlow to compare against."""


def find_tf_python(python: str | None = None) -> str:
    """The interpreter to run TensorFlow with.

    Raises:
        TFUnavailable: none given, and TensorFlow is not importable in this interpreter.
    """
    python = python or _settings.bench_tf_python()
    if python:
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise TFUnavailable(f"--tf-python {python!r} is not an executable file")
        return python
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable
    raise TFUnavailable("TensorFlow is not importable here; pass --tf-python PATH or set CUDIST_BENCH_TF_PYTHON")


def run_worker(spec: dict, python: str | None = None, timeout: float = 1800) -> dict:
    """Runs the worker on ``spec`` and returns its result (``{"version", "python", "rows"}``).

    Raises:
        TFUnavailable: no TensorFlow python, or the worker failed (its stderr tail is in the message).
    """
    exe = find_tf_python(python)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run([exe, str(WORKER), json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TFUnavailable(f"the TensorFlow worker did not run: {e}") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise TFUnavailable(f"the TensorFlow worker failed (exit {proc.returncode}): {' | '.join(tail)}")
    return json.loads(lines[-1])


def compare(ctx, spec: dict):
    """The TensorFlow worker's result for ``spec``; None (said in the output) without TensorFlow."""
    try:
        res = run_worker(spec, python=ctx.args.tf_python)
    except TFUnavailable as e:
        ctx.print(f"# tf: skipped ({e})")
        return None
    ctx.header.setdefault("tensorflow", res.get("version"))
    return res


def modes(a) -> list:
    """TF execution modes asked for by ``--tf-mode``."""
    return ["function", "eager"] if a.tf_mode == "both" else [a.tf_mode]
