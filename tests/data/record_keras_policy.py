"""Records Keras 3's mixed-precision policies (``keras.mixed_precision``) for
tests/test_mixed_precision.py (issue 28): each policy's name, compute and variable dtypes and repr,
and the errors of bad names and bad ``set_global_policy`` arguments.

Run it once with a Python that has Keras 3 (cudist's tests never import it)::

    /work/tfvenv/bin/python tests/data/record_keras_policy.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
from keras import mixed_precision as mp  # noqa: E402

NAMES = ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "float16", "float64", "int32", "uint8", "bool"]
BAD_NAMES = ["mixed_float32", "mixed_float64", "foo", "", "Float32", "half", "double", "float", 3, 1.5]
BAD_SET = [None, 3, "foo"]


def error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recording whatever Keras raises
        return [type(e).__name__, str(e)]
    return None


def main() -> None:
    out = {"keras_version": keras.__version__, "default": mp.global_policy().name, "policies": {}, "bad_names": [],
           "bad_set_global_policy": []}
    for n in NAMES:
        p = mp.Policy(n)
        out["policies"][n] = {"name": p.name, "compute_dtype": p.compute_dtype, "variable_dtype": p.variable_dtype,
                              "repr": repr(p), "config": p.get_config()}
    for n in BAD_NAMES:
        out["bad_names"].append([n, error(lambda n=n: mp.Policy(n))])
    for n in BAD_SET:
        out["bad_set_global_policy"].append([n, error(lambda n=n: mp.set_global_policy(n))])
    mp.set_global_policy("mixed_bfloat16")
    out["none_under_mixed_bfloat16"] = mp.Policy(None).name
    out["equal_same_name"] = mp.Policy("mixed_float16") == mp.Policy("mixed_float16")
    out["equal_other_name"] = mp.Policy("mixed_float16") == mp.Policy("float32")
    out["equal_string"] = mp.Policy("mixed_float16") == "mixed_float16"
    path = Path(__file__).with_name("keras_policy.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
