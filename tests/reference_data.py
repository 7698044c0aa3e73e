"""Keras 3 / TF 2.21 reference results recorded by tests/data/record_keras_reference.py (no TF here)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

PATH = Path(__file__).resolve().parent / "data" / "keras_reference.json"


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """The recorded cases (see the recording script's docstring for the layout)."""
    return json.loads(PATH.read_text())


def dec(d: dict) -> np.ndarray:
    """An array recorded by the script's ``enc``."""
    return np.asarray(d["data"], dtype=d["dtype"]).reshape(d["shape"])
