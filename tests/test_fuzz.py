"""The public API under hypothesis-generated arguments, in a subprocess: an interpreter crash (the
C replica engine once segfaulted on ``kwargs=[1]``) is a failed test here, not a lost suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("fuzz_public_api.py")


def test_fuzzed_public_calls_never_crash_and_raise_tf_types():
    r = subprocess.run([sys.executable, str(SCRIPT), "250"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    assert r.returncode == 0, f"exit {r.returncode} (negative: killed by that signal)\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert r.stdout.split()[-2:] == ["ok", "250"], r.stdout
