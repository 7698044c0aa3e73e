"""Gradient descent and momentum take the decoupled weight decay inside their pass (issue #27).

Their rows of the rules' table (``sgd``, ``momentum``, ``nesterov``) apply ``w - w * decay`` in the
compute type before the update, as every other row does; they used to run it as a pass of its own
(``assign_add(copies, w * decay, negate=True)``) before a kernel without one. For float32 and
float64 the compute type is the variable's, so the two forms round the same two operations and
give the same bits: checked here on every CPU backend against the old two-pass form, fused and
plain, on random data of odd sizes over several replica counts. The 16-bit floats compute in
float32 and now round once (the other rows' arithmetic), checked against the NumPy reference by the
backends' cross-checks (tests/test_kernels.py, tests/test_mixed_fused_update.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from cudist._kernels import get_backend

BACKENDS = ("numpy", "numba", "native")
ROWS = {"sgd": (0.05,), "momentum": (0.05, 0.9), "nesterov": (0.05, 0.9)}


def _backend(name):
    try:
        return get_backend(name)
    except (ImportError, RuntimeError) as e:  # numba or the extension missing from this install
        pytest.skip(f"{name}: {e}")


@pytest.mark.parametrize("fused", (False, True))
@pytest.mark.parametrize("row", sorted(ROWS))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_decay_in_the_pass_is_the_old_decay_pass(backend, dtype, row, fused):
    trusted = _backend(backend).trusted
    rng = np.random.default_rng(hash((backend, dtype, row, fused)) % 2**32)
    entry = getattr(trusted, f"all_reduce_{row}" if fused else row)
    for n, size in ((1, 1), (3, 1001), (4, 4099)):
        decay = float(rng.uniform(1e-4, 0.05))
        w0 = (rng.standard_normal(size) * 10.0 ** rng.integers(-2, 3, size)).astype(dtype)
        v0 = rng.standard_normal(size).astype(dtype)
        grads = [rng.standard_normal(size).astype(dtype) for _ in range(3 if fused else 1)]
        g = grads if fused else grads[0]
        slots = () if row == "sgd" else (v0,)
        got = [w0.copy() for _ in range(n)]
        got_s = [[s.copy() for _ in range(n)] for s in slots]
        entry(got, *got_s, g, *ROWS[row], decay)
        # The old form: the decay as a pass of its own, in the variable's dtype, then no decay.
        want = [w0.copy() for _ in range(n)]
        want_s = [[s.copy() for _ in range(n)] for s in slots]
        trusted.assign_add(want, want[0] * want[0].dtype.type(decay), True)
        entry(want, *want_s, g, *ROWS[row], 0.0)
        for r in range(n):
            assert got[r].tobytes() == want[r].tobytes(), (n, size, r)
            for gs, ws in zip(got_s, want_s):
                assert gs[r].tobytes() == ws[r].tobytes(), (n, size, r)
        assert not np.array_equal(got[0], w0)  # the update ran


@pytest.mark.parametrize("row", sorted(ROWS))
def test_the_decay_is_applied(row):
    """A non-zero decay changes the result (the in-kernel factor is not ignored) on every backend alike."""
    rng = np.random.default_rng(4)
    w0, v0, g = (rng.standard_normal(257).astype(np.float32) for _ in range(3))
    out = {}
    for backend in BACKENDS:
        trusted = _backend(backend).trusted
        for decay in (0.0, 0.01):
            w, v = [w0.copy(), w0.copy()], [v0.copy(), v0.copy()]
            getattr(trusted, row)(w, *(() if row == "sgd" else (v,)), g, *ROWS[row], decay)
            out[backend, decay] = w[1].tobytes()
    for backend in BACKENDS:
        assert out[backend, 0.01] != out[backend, 0.0]
        assert out[backend, 0.01] == out["numpy", 0.01] and out[backend, 0.0] == out["numpy", 0.0]
