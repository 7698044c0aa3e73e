"""LossScaleOptimizer against Keras 3's recorded behaviour (tests/data/record_keras_loss_scale.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import cudist
from cudist import optimizers

KERAS = json.loads((Path(__file__).parent / "data" / "keras_loss_scale.json").read_text())
GRADS = [np.array([float(x) for x in g], np.float32) for g in KERAS["grads"]]


def _make():
    w = cudist.Variable(np.array(KERAS["init"], np.float32), name="w")
    opt = optimizers.LossScaleOptimizer(optimizers.SGD(0.5, momentum=0.5), initial_scale=4.0, dynamic_growth_steps=2)
    return w, opt


def _check(step, w, opt):
    want = KERAS["steps"][step]
    assert float(np.asarray(opt.dynamic_scale.read_value())) == want["scale"], step
    assert int(np.asarray(opt.iterations.read_value())) == want["iterations"], step
    np.testing.assert_array_equal(np.asarray(w.read_value()), np.array(want["w"], np.float32), err_msg=str(step))


def test_matches_keras_step_by_step():
    w, opt = _make()
    for step, g in enumerate(GRADS):
        opt.apply_gradients([(g, w)])
        _check(step, w, opt)


def test_replicas_agree_on_skips():
    """4 replicas; only replica 2 sees the inf/NaN: every replica skips (the sum of the others'
    gradients is 4x replica 0's, so the trajectory is Keras's with grads/4 on each replica)."""
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    with strategy.scope():
        w, opt = _make()
    for step, g in enumerate(GRADS):
        clean = np.where(np.isfinite(g), g, 0).astype(np.float32) / np.float32(4)

        def fn(g=g, clean=clean):
            r = cudist.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([((g / np.float32(4)) if r == 2 else clean, w)])

        strategy.run(fn)
        _check(step, w, opt)


def test_scale_loss_and_bad_arguments():
    _, opt = _make()
    assert float(opt.scale_loss(np.float32(1.5))) == 6.0
    with pytest.raises(TypeError):
        optimizers.LossScaleOptimizer(object())
    with pytest.raises(ValueError):
        optimizers.LossScaleOptimizer(optimizers.SGD(0.1), initial_scale=0.0)
    with pytest.raises(ValueError):
        optimizers.LossScaleOptimizer(optimizers.SGD(0.1), dynamic_growth_steps=0)
