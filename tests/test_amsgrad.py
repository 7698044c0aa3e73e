"""AMSGrad (``Adam(amsgrad=True)``, ``AdamW(amsgrad=True)``) against Keras 3 (issue 27).

The numbers below are Keras 3.15.1 on TensorFlow 2.21.0, observed once with
tests/data/record_keras_amsgrad.py (TF is never imported here): a 7-element float32 variable
updated for 5 steps under ``tf.distribute.MirroredStrategy`` on 4 logical CPUs, each replica
applying its own gradient (exact float32 values from ``grad`` below, shrinking over the steps so
that ``v`` falls below its running maximum and AMSGrad differs from Adam). cudist replays them under
``MirroredStrategy`` with 4 replicas on every CPU backend, through the fused all-reduce + update
kernel, and the backends must agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist import optimizers
from cudist._kernels import available_backends, cpu_backend

REPLICAS, SIZE = 4, 7
SCALES = (2.0, 1.0, 0.5, 0.25, 1.0)
INIT = (np.arange(SIZE, dtype=np.float32) - 3.0) * np.float32(0.5)
CPU_BACKENDS = [b for b in ("numpy", "numba", "native") if b in available_backends()]
TOL = dict(rtol=3e-5, atol=3e-6)  # Keras computes its step size in float32, cudist in float64

# Keras 3.15.1 / TF 2.21.0: the variable after each step, and velocity_hat after the last.
KERAS = {
    "adam": dict(
        kwargs={"learning_rate": 0.01, "amsgrad": True},
        trajectory=[
            [-1.4900001, -1.0099999, -0.49000013, -0.009999921, 0.5, 1.0099999, 1.4900001],
            [-1.4800003, -1.0183058, -0.4800922, -0.018556796, 0.5074412, 1.0134559, 1.4873368],
            [-1.4755147, -1.024723, -0.470158, -0.025469618, 0.5160258, 1.0155249, 1.4891884],
            [-1.4725676, -1.0296204, -0.46351695, -0.030990187, 0.52010626, 1.0172187, 1.4930131],
            [-1.470974, -1.0309638, -0.46060672, -0.033968426, 0.5187799, 1.0196208, 1.4905554],
        ],
        velocity_hat=[0.0024804743, 0.005248884, 0.0015120974, 0.007367848, 0.0011588098, 0.007534416, 0.0015492167],
    ),
    "adamw": dict(
        kwargs={"learning_rate": 0.01, "weight_decay": 0.1, "amsgrad": True},
        trajectory=[
            [-1.4885001, -1.009, -0.48950014, -0.009999921, 0.4995, 1.009, 1.4885001],
            [-1.4770118, -1.0162969, -0.4791027, -0.018546797, 0.5064418, 1.011447, 1.4843483],
            [-1.4710492, -1.0216979, -0.4686894, -0.025441073, 0.5145199, 1.0125045, 1.4847156],
            [-1.466631, -1.0255735, -0.46157965, -0.0309362, 0.51808584, 1.0131857, 1.4870555],
            [-1.4635708, -1.0258913, -0.45820785, -0.033883505, 0.5162414, 1.0145746, 1.4831108],
        ],
        velocity_hat=[0.0024804743, 0.005248884, 0.0015120974, 0.007367848, 0.0011588098, 0.007534416, 0.0015492167],
    ),
}
OPTIMIZER = {"adam": optimizers.Adam, "adamw": optimizers.AdamW}


def grad(step, replica):
    """Replica ``replica``'s gradient at ``step``, as the recording script gives it."""
    i = np.arange(SIZE)
    return ((((i * 7 + replica * 3 + step * 5) % 11) - 5) * 0.25 * SCALES[step]).astype(np.float32)


def replay(name, on_step=None):
    """Runs the recorded case ``name`` under MirroredStrategy (4 replicas); returns (w, optimizer)."""
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    with strategy.scope():
        w = cudist.Variable(INIT, name="w")
        opt = OPTIMIZER[name](**KERAS[name]["kwargs"])
    for step in range(len(SCALES)):

        def fn(step=step):
            r = cudist.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(grad(step, r), w)])

        strategy.run(fn)
        if on_step is not None:
            on_step(step, w, opt)
    return w, opt


@pytest.mark.parametrize("name", sorted(KERAS))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_amsgrad_follows_keras_step_by_step_on_4_replicas(select_cpu_backend, backend, name):
    select_cpu_backend(backend)
    want = KERAS[name]
    fused_calls = []
    trusted = cpu_backend().trusted
    real = trusted.all_reduce_amsgrad

    def counting(*args):
        fused_calls.append(len(args[4]))  # the per-replica gradients, summed inside the kernel
        real(*args)

    trusted.all_reduce_amsgrad = counting
    below_max = []

    def check(step, w, opt):
        v, v_hat = (opt.get_slot(w, s).numpy() for s in ("velocity", "velocity_hat"))
        assert (v_hat >= v).all()
        below_max.append(bool((v_hat > v).any()))
        got = w.numpy()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want["trajectory"][step], **TOL, err_msg=f"{name} {backend} step {step}")
        for comp in w.values[1:]:  # the mirrors stay bitwise equal
            assert comp.numpy().tobytes() == got.tobytes()

    try:
        w, opt = replay(name, check)
    finally:
        trusted.all_reduce_amsgrad = real
    assert fused_calls == [REPLICAS] * len(SCALES), "AMSGrad did not take the fused all-reduce + update kernel"
    v_hat = opt.get_slot(w, "velocity_hat").numpy()
    np.testing.assert_allclose(v_hat, want["velocity_hat"], **TOL)
    assert any(below_max), "the case must exercise the running maximum"


@pytest.mark.parametrize("name", sorted(KERAS))
def test_cpu_backends_agree_bit_for_bit(select_cpu_backend, name):
    results = {}
    for backend in CPU_BACKENDS:
        select_cpu_backend(backend)
        w, opt = replay(name)
        results[backend] = [w.numpy()] + [opt.get_slot(w, s).numpy() for s in ("momentum", "velocity", "velocity_hat")]
    ref = results.pop("numpy")
    for backend, got in results.items():
        for a, b in zip(got, ref):
            assert a.tobytes() == b.tobytes(), backend


def test_amsgrad_differs_from_adam_and_round_trips_its_config():
    w_ams, _ = replay("adam")
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    with strategy.scope():
        w = cudist.Variable(INIT, name="w")
        opt = optimizers.Adam(learning_rate=0.01)
    for step in range(len(SCALES)):
        strategy.run(lambda step=step: opt.apply_gradients(
            [(grad(step, cudist.get_replica_context().replica_id_in_sync_group), w)]))
    assert not np.array_equal(w.numpy(), w_ams.numpy())
    for cls in (optimizers.Adam, optimizers.AdamW):
        opt = cls(amsgrad=True)
        assert opt.amsgrad is True and opt.get_config()["amsgrad"] is True
        assert cls.from_config(opt.get_config()).amsgrad is True
        assert cls().get_config()["amsgrad"] is False


@pytest.mark.parametrize("kind", ["one_device", "mirrored2", "central2"])
@pytest.mark.parametrize("cls", [optimizers.Adam, optimizers.AdamW])
def test_checkpoint_saves_and_restores_velocity_hat(tmp_path, kind, cls):
    """cudist.train.Checkpoint saves the velocity_hat slot; a fresh optimizer restored from it
    continues bit for bit."""
    from conftest import make_strategy

    from cudist import train

    def model(strategy):
        with strategy.scope():
            w = cudist.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), name="w")
            opt = cls(learning_rate=0.01, amsgrad=True)
        return w, opt

    def steps(strategy, w, opt, seed, n, scale=1.0):
        rng = np.random.default_rng(seed)
        for _ in range(n):
            g = (rng.standard_normal((4, 3)) * scale).astype(np.float32)

            def fn(g=g):
                r = cudist.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(g * np.float32(r + 1), w)])

            strategy.run(fn)

    s1 = make_strategy(kind)
    w, opt = model(s1)
    steps(s1, w, opt, 1, 3, scale=4.0)  # large gradients first: v_hat then stays above v
    path = train.Checkpoint(w=w, optimizer=opt).save(str(tmp_path / "ckpt"))
    saved_v_hat = opt.get_slot(w, "velocity_hat").numpy()
    steps(s1, w, opt, 2, 3, scale=0.25)
    want = w.numpy()
    s2 = make_strategy(kind)
    w2, opt2 = model(s2)
    train.Checkpoint(w=w2, optimizer=opt2).restore(path).assert_consumed()
    assert opt2.get_slot(w2, "velocity_hat").numpy().tobytes() == saved_v_hat.tobytes()
    steps(s2, w2, opt2, 2, 3, scale=0.25)
    assert w2.numpy().tobytes() == want.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(KERAS))
def test_amsgrad_follows_keras_on_gpus(name):
    """The same replay on 4 logical GPUs (GPU 0 split): the cupy backend's mirrored_all_reduce_amsgrad
    kernel (under the CuPy emulation without a GPU)."""
    pytest.importorskip("cupy")
    from conftest import make_strategy, set_gpu0_split

    try:
        strategy = make_strategy("mirrored_gpu4")
        with strategy.scope():
            w = cudist.Variable(INIT, name="w")
            opt = OPTIMIZER[name](**KERAS[name]["kwargs"])
        for step in range(len(SCALES)):

            def fn(step=step):
                r = cudist.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(grad(step, r), w)])

            strategy.run(fn)
            got = np.asarray(w.numpy())
            np.testing.assert_allclose(got, KERAS[name]["trajectory"][step], **TOL, err_msg=f"{name} step {step}")
            for comp in w.values[1:]:
                value = comp.numpy()
                value = value.get() if hasattr(value, "get") else np.asarray(value)
                assert value.tobytes() == got.tobytes()
        v_hat = opt.get_slot(w, "velocity_hat").numpy()
        v_hat = v_hat.get() if hasattr(v_hat, "get") else np.asarray(v_hat)
        np.testing.assert_allclose(v_hat, KERAS[name]["velocity_hat"], **TOL)
    finally:
        set_gpu0_split(None)
