"""Records Keras 3's optimizer step on a bfloat16 variable (slot dtypes and the new values) into
bf16_variable_steps.json. Run with the TF venv: /work/tfvenv/bin/python tests/data/record_bf16_variables.py
(tests never import Keras; they read the JSON)."""

import json
import pathlib

import keras
import ml_dtypes
import numpy as np

W0 = np.linspace(-1.0, 1.0, 7).astype(np.float32)
G = np.linspace(0.3, -0.7, 7).astype(np.float32)
out = {"w0": W0.astype(ml_dtypes.bfloat16).view(np.uint16).tolist(),
       "g": G.astype(ml_dtypes.bfloat16).view(np.uint16).tolist(), "steps": {}}
for name, make in [("SGD", lambda: keras.optimizers.SGD(0.1)),
                   ("SGD_momentum", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
                   ("Adam", lambda: keras.optimizers.Adam(0.01))]:
    v = keras.Variable(W0.astype(ml_dtypes.bfloat16), dtype="bfloat16")
    opt = make()
    opt.build([v])
    g = keras.ops.convert_to_tensor(G.astype(ml_dtypes.bfloat16), dtype="bfloat16")
    opt.apply_gradients([(g, v)])
    opt.apply_gradients([(g, v)])
    slots = [s for s in opt.variables if s is not opt.iterations and "learning_rate" not in s.path]
    out["steps"][name] = {"slot_dtypes": sorted({str(s.dtype) for s in slots}),
                          "w2": np.asarray(v.numpy()).view(np.uint16).tolist()}
pathlib.Path(__file__).with_name("bf16_variable_steps.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out["steps"]))
