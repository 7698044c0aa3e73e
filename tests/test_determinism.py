"""The determinism contract: the same program on the same inputs gives the same bits in every
replica execution mode (greenlets, threads, auto -- including auto switching mid-training).

OpenBLAS rounds a float32 ``(128, 784) @ (784, 512)`` differently with 1 and 2 threads; before the
replicas' BLAS count was made the same in every mode, threads and greenlets ended an Adam run on
different weights (``bench/step_compare.py``, ``cudist-bench step``).
"""

from __future__ import annotations

import numpy as np
import pytest

import cudist
import cudist.optimizers as optimizers
from cudist import config
from cudist._replica_engine import AutoPolicy

LAYERS = (784, 64, 10)
BATCH = 256  # 128 rows per replica: a shape whose OpenBLAS rounding depends on the thread count


def _problem():
    rng = np.random.default_rng(7)
    params = []
    for fan_in, fan_out in zip(LAYERS[:-1], LAYERS[1:]):
        params += [(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32), np.zeros(fan_out, np.float32)]
    x = rng.standard_normal((BATCH, LAYERS[0])).astype(np.float32)
    y = rng.standard_normal((BATCH, LAYERS[-1])).astype(np.float32)
    return params, x, y


def _grads(params, x, y):
    """A 2-layer MLP's squared-error gradients in NumPy (the matmuls whose rounding is at stake)."""
    w1, b1, w2, b2 = params
    pre = x @ w1 + b1
    h = np.maximum(pre, 0)
    d = (h @ w2 + b2 - y) * np.float32(2.0 / y.size)
    dh = (d @ w2.T) * (pre > 0)
    return [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def _train(mode: str, steps: int) -> list[np.ndarray]:
    config.set_replica_execution(mode)
    params, x, y = _problem()
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        vs = [cudist.Variable(p) for p in params]
        opt = optimizers.Adam(learning_rate=0.01)
    data = s.experimental_distribute_dataset(cudist.data.Dataset.from_tensors((x, y)).repeat(steps))

    def step(xy):
        gs = _grads([v.read_value() for v in vs], *xy)
        opt.apply_gradients(zip(gs, vs))

    for xy in data:
        s.run(step, args=(xy,))
    return [np.concatenate([np.ravel(c) for c in s.experimental_local_results(v)]) for v in vs]


@pytest.fixture
def restore_mode():
    before = config.get_replica_execution()
    yield
    config.set_replica_execution(before)


def test_every_replica_execution_mode_gives_the_same_bits(restore_mode, monkeypatch):
    ref = _train("greenlets", 12)
    # auto, made to try threads at once and keep them: it switches mid-training (greenlets, then threads).
    monkeypatch.setattr(AutoPolicy, "UP", 0.0)
    monkeypatch.setattr(AutoPolicy, "GAIN", 1e9)
    monkeypatch.setattr(AutoPolicy, "BLOCK", 2)
    monkeypatch.setattr(AutoPolicy, "SETTLE", 0.0)
    for mode in ("threads", "auto"):
        got = _train(mode, 12)
        for a, b in zip(ref, got):
            np.testing.assert_array_equal(a, b, err_msg=mode)
