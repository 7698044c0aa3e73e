"""cudist.optimizers (SGD, Adam) against a NumPy reference of the Keras formulas.

The reference below is written from the kernel contract (``cudist._kernels._base``), independently
of the kernels: per-replica gradients are summed in replica order in their dtype, then each step
updates the variable (float16 computed in float32, rounded on store).
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import pytest

import cudist
from cudist import optimizers
from cudist._variables import AggregatingVariable

from conftest import make_strategy

#: Every test twice: replicas on greenlets, then on replica threads.
pytestmark = pytest.mark.usefixtures("replica_execution")

SHAPES = [(3, 7), (5,), ()]  # odd sizes and a 0-d variable, reduced together in one batch
STEPS = 3
SEED = int(os.environ.get("CUDIST_TEST_SEED", "0"))  # vary to stress the tolerances
KINDS = ["sgd", "momentum", "nesterov", "adam"]
LR = {"sgd": 0.05, "momentum": 0.05, "nesterov": 0.03, "adam": 0.01}
TOL = {"float16": dict(rtol=2e-3, atol=2e-3), "float32": dict(rtol=2e-6, atol=2e-6), "float64": dict(rtol=1e-13, atol=1e-13)}


# ---------------------------------------------------------------------------- reference
def _compute_dtype(dtype):
    return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def reference_step(kind, w, slots, g, lr, step, momentum=0.9, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """One Keras-formula update in NumPy; returns (new w, new slots)."""
    dt = w.dtype
    ct = _compute_dtype(dt)
    c = ct.type
    w, g = w.astype(ct), g.astype(ct)
    slots = [s.astype(ct) for s in slots]
    if kind == "sgd":
        w = w - c(lr) * g
    elif kind in ("momentum", "nesterov"):
        v = c(momentum) * slots[0] - c(lr) * g
        w = w + (c(momentum) * v - c(lr) * g) if kind == "nesterov" else w + v
        slots = [v]
    else:
        lr_t = lr * math.sqrt(1 - beta_2**step) / (1 - beta_1**step)
        m, v = slots
        m = m + (g - m) * (c(1) - c(beta_1))
        v = v + (g * g - v) * (c(1) - c(beta_2))
        w = w - c(lr_t) * m / (np.sqrt(v) + c(epsilon))
        slots = [m, v]
    return w.astype(dt), [s.astype(dt) for s in slots]


def reference_sum(per_replica):
    s = per_replica[0].copy()
    for x in per_replica[1:]:
        np.add(s, x, out=s)
    return s


def make_optimizer(kind, lr=None):
    lr = LR[kind] if lr is None else lr
    if kind == "sgd":
        return optimizers.SGD(lr)
    if kind == "momentum":
        return optimizers.SGD(lr, momentum=0.9)
    if kind == "nesterov":
        return optimizers.SGD(lr, momentum=0.9, nesterov=True)
    return optimizers.Adam(lr)


SLOTS = {"sgd": [], "momentum": ["momentum"], "nesterov": ["momentum"], "adam": ["momentum", "velocity"]}


def _random(shape, dtype, rng):
    return rng.standard_normal(shape).astype(dtype)


def _local(strategy, v):
    return [np.asarray(x) for x in strategy.experimental_local_results(v)]


def _rid():
    return cudist.get_replica_context().replica_id_in_sync_group


def _skip_unsupported(var):
    if var.dtype not in var.storage.kernel().dtypes:
        pytest.skip(f"backend {var.storage.kernel().name} lacks {var.dtype.name}")


# ---------------------------------------------------------------------------- numerics over strategies
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference_over_strategies(strategy, kind, dtype):
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng([KINDS.index(kind), np.dtype(dtype).itemsize, n, SEED])
    inits = [_random(s, dtype, rng) for s in SHAPES]
    # grads[step][replica][var], different on every replica and every step
    grads = [[[_random(s, dtype, rng) for s in SHAPES] for _ in range(n)] for _ in range(STEPS)]
    with strategy.scope():
        variables = [cudist.Variable(x, name=f"v{i}") for i, x in enumerate(inits)]
        opt = make_optimizer(kind)
    _skip_unsupported(variables[0])

    def step_fn(t):
        mine = grads[t][_rid()]
        return opt.apply_gradients(zip(mine, variables))

    ref_w = [x.copy() for x in inits]
    ref_slots = [[np.zeros(s, dtype) for _ in SLOTS[kind]] for s in SHAPES]
    for t in range(STEPS):
        result = strategy.run(step_fn, args=(t,))
        assert result is opt.iterations
        for j in range(len(SHAPES)):
            g = reference_sum([grads[t][r][j] for r in range(n)])
            ref_w[j], ref_slots[j] = reference_step(kind, ref_w[j], ref_slots[j], g, LR[kind], t + 1)
    assert int(opt.iterations) == STEPS

    for j, var in enumerate(variables):
        copies = _local(strategy, var)
        where = f"{kind} {dtype} {type(strategy).__name__} x{n} var {j}"
        np.testing.assert_allclose(copies[0].astype(np.float64), ref_w[j].astype(np.float64), err_msg=where, **TOL[dtype])
        for c in copies[1:]:  # mirrors stay bitwise equal
            np.testing.assert_array_equal(c, copies[0], err_msg=where)
        for name, ref in zip(SLOTS[kind], ref_slots[j]):
            slot = opt.get_slot(var, name)
            assert type(slot) is type(var)
            slot_copies = _local(strategy, slot)
            assert len(slot_copies) == len(copies)
            np.testing.assert_allclose(
                slot_copies[0].astype(np.float64), ref.astype(np.float64), err_msg=f"{where} slot {name}", **TOL[dtype]
            )
            for c in slot_copies[1:]:
                np.testing.assert_array_equal(c, slot_copies[0], err_msg=f"{where} slot {name}")
        assert var.numpy().dtype == np.dtype(dtype)
        # the update really moved the variable (guards against comparing untouched values); a
        # float16 scalar may round back to where it started after steps of opposite signs
        assert np.array_equal(copies[0], inits[j]) == np.array_equal(ref_w[j], inits[j])
        assert var.shape == () or not np.array_equal(copies[0], inits[j])


@pytest.mark.parametrize("kind", KINDS)
def test_no_strategy_matches_reference(kind):
    rng = np.random.default_rng(7)
    w0 = _random((4, 3), np.float32, rng)
    var = cudist.Variable(w0)
    opt = make_optimizer(kind)
    ref_w, ref_slots = w0.copy(), [np.zeros_like(w0) for _ in SLOTS[kind]]
    for t in range(STEPS):
        g = _random((4, 3), np.float32, rng)
        assert opt.apply_gradients([(g, var)]) is opt.iterations
        ref_w, ref_slots = reference_step(kind, ref_w, ref_slots, g, LR[kind], t + 1)
    np.testing.assert_allclose(var.numpy(), ref_w, **TOL["float32"])
    assert int(opt.iterations) == STEPS
    assert type(var) is type(cudist.Variable(1.0))


def test_adam_bias_correction_uses_the_step_count():
    # Same gradient twice: a step-independent (uncorrected) Adam would make the second update
    # differ from what the reference predicts for step 2.
    var = cudist.Variable(np.ones(6, np.float64))
    opt = optimizers.Adam(0.1)
    g = np.linspace(-1, 1, 6)
    ref_w, ref_slots = np.ones(6), [np.zeros(6), np.zeros(6)]
    deltas = []
    for t in range(1, 4):
        before = var.numpy()
        opt.apply_gradients([(g, var)])
        deltas.append(var.numpy() - before)
        ref_w, ref_slots = reference_step("adam", ref_w, ref_slots, g, 0.1, t)
        np.testing.assert_allclose(var.numpy(), ref_w, rtol=1e-14)
    # With bias correction the first step moves by about lr * sign(g) (|g| > 0).
    np.testing.assert_allclose(np.abs(deltas[0][g != 0]), 0.1, rtol=1e-4)
    assert not np.allclose(deltas[0], deltas[1], rtol=1e-9)


# ---------------------------------------------------------------------------- distribution semantics
def test_cross_replica_gradients_are_final(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        var = cudist.Variable(np.zeros(4, np.float32))
        opt = optimizers.SGD(0.5)
        g = np.array([1.0, -2.0, 3.0, 0.25], np.float32)
        opt.apply_gradients([(g, var)])  # in cross-replica context: not summed over replicas
        for c in _local(strategy, var):
            np.testing.assert_array_equal(c, -0.5 * g)
        opt.apply_gradients([(cudist.Mirrored([g] * max(n, 1)), var)])  # a Mirrored gradient is one value
        for c in _local(strategy, var):
            np.testing.assert_array_equal(c, -1.0 * g)
        if n > 1:
            with pytest.raises(ValueError, match="PerReplica.*cross-replica"):
                opt.apply_gradients([(cudist.PerReplica([g * (i + 1) for i in range(n)]), var)])
    assert int(opt.iterations) == 2


def test_same_gradient_object_on_every_replica_is_summed(strategy):
    n = strategy.num_replicas_in_sync
    g = np.array([1.0, 2.0, -4.0], np.float64)
    with strategy.scope():
        var = cudist.Variable(np.zeros(3))
        opt = optimizers.SGD(0.25)
    strategy.run(lambda: opt.apply_gradients([(g, var)]))
    for c in _local(strategy, var):
        np.testing.assert_array_equal(c, -0.25 * n * g)


@pytest.mark.parametrize("how", ["fewer", "none_on_one"])
def test_replicas_passing_different_gradient_counts_are_refused(how):
    """Every replica must pass a gradient for the same variables: a replica with fewer pairs (or a
    None gradient where the others have one) gets a ValueError naming it, and nothing is updated."""
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(3)])
    with strategy.scope():
        a = cudist.Variable(np.ones(4, np.float32))
        b = cudist.Variable(np.ones(2, np.float32))
        opt = optimizers.SGD(0.5, momentum=0.9)

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        ga, gb = np.full(4, 1.0, np.float32), np.full(2, 1.0, np.float32)
        if r == 2:
            pairs = [(ga, a)] if how == "fewer" else [(ga, a), (None, b)]
        else:
            pairs = [(ga, a), (gb, b)]
        opt.apply_gradients(pairs)

    with pytest.warns(UserWarning) if how == "none_on_one" else contextlib.nullcontext():
        with pytest.raises(ValueError, match="replica 2 passed 1 gradients but replica 0 passed 2"):
            strategy.run(step)
    for v in (a, b):
        for c in _local(strategy, v):
            np.testing.assert_array_equal(c, 1.0)
    assert int(opt.iterations) == 0


@pytest.mark.parametrize("ops", [None, "to_one"])
def test_one_merge_call_one_kernel_pass_per_variable(monkeypatch, ops):
    """Default ops: each variable's N gradients are summed inside its fused Adam pass (no separate
    reduction). A user's cross-device ops: ONE batched reduction through them, then one fused pass."""
    n = 3
    cross = cudist.ReductionToOneDevice() if ops else None
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=cross)
    rng = np.random.default_rng(3)
    with strategy.scope():
        variables = [cudist.Variable(_random(s, np.float32, rng)) for s in [(8,), (2, 3), (5, 1)]]
        opt = optimizers.Adam(0.01)
    kernels = variables[0].storage.kernel().trusted
    calls = {"merge": 0, "batch_reduce": 0, "adam": [], "fused": []}

    real_merge = cudist.ReplicaContext.merge_call

    def merge_call(self, fn, args=(), kwargs=None):
        calls["merge"] += 1
        return real_merge(self, fn, args, kwargs)

    real_batch = strategy.extended.batch_reduce_to

    def batch_reduce_to(op, pairs, options=None):
        pairs = list(pairs)
        calls["batch_reduce"] += 1
        assert op is cudist.ReduceOp.SUM and len(pairs) == len(variables)
        return real_batch(op, pairs, options)

    real_adam, real_fused = kernels.adamw, kernels.all_reduce_adamw  # Adam: the adamw row

    def adam(copies, ms, vs, grad, *hyper):
        calls["adam"].append((len(copies), len(ms), len(vs)))
        return real_adam(copies, ms, vs, grad, *hyper)

    def fused(copies, ms, vs, grads, *hyper):
        calls["fused"].append((len(copies), len(ms), len(vs), len(grads)))
        return real_fused(copies, ms, vs, grads, *hyper)

    monkeypatch.setattr(cudist.ReplicaContext, "merge_call", merge_call)
    monkeypatch.setattr(strategy.extended, "batch_reduce_to", batch_reduce_to)
    monkeypatch.setattr(kernels, "adamw", adam)
    monkeypatch.setattr(kernels, "all_reduce_adamw", fused)
    grads = [[_random(v.shape, np.float32, rng) for v in variables] for _ in range(n)]
    strategy.run(lambda: opt.apply_gradients(zip(grads[_rid()], variables)))
    assert calls["merge"] == n  # one merge_call per replica: merge_fn runs once
    if ops is None:
        assert calls["batch_reduce"] == 0 and calls["adam"] == []
        # one pass per variable: the N gradients summed into the one host storage its CPU copies
        # share (and its two slots')
        assert calls["fused"] == [(1, 1, 1, n)] * len(variables)
    else:
        assert calls["batch_reduce"] == 1 and calls["fused"] == []
        assert calls["adam"] == [(1, 1, 1)] * len(variables)


@pytest.mark.parametrize("make", ["mirrored2", "mirrored3", "central2"])
@pytest.mark.parametrize("opt_name", ["sgd", "momentum", "nesterov", "adam"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_fused_reduce_update_is_bit_identical_to_reduce_then_update(make, opt_name, dtype):
    """The one-pass path (default ops) and the reduce-first path (a user's ops) agree bit for bit."""
    results = []
    for ops in (None, cudist.ReductionToOneDevice()):
        strategy = make_strategy(make)
        if ops is not None:
            strategy.extended._cross_device_ops = ops
        rng = np.random.default_rng(7)
        n = strategy.num_replicas_in_sync
        with strategy.scope():
            var = cudist.Variable(_random((37, 5), dtype, rng))
            opt = {
                "sgd": lambda: optimizers.SGD(0.1),
                "momentum": lambda: optimizers.SGD(0.1, momentum=0.9),
                "nesterov": lambda: optimizers.SGD(0.1, momentum=0.9, nesterov=True),
                "adam": lambda: optimizers.Adam(0.01),
            }[opt_name]()
        steps = [[_random((37, 5), dtype, rng) for _ in range(n)] for _ in range(3)]
        for g in steps:
            strategy.run(lambda: opt.apply_gradients([(g[_rid()], var)]))
        results.append([np.array(c) for c in _local(strategy, var)])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_already_aggregated_gradients(strategy):
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(11)
    per_replica = [_random((6,), np.float32, rng) for _ in range(n)]
    with strategy.scope():
        a = cudist.Variable(np.ones(6, np.float32))
        b = cudist.Variable(np.ones(6, np.float32))
        opt_a, opt_b = optimizers.SGD(0.1, momentum=0.5), optimizers.SGD(0.1, momentum=0.5)

    def step():
        g = per_replica[_rid()]
        opt_a.apply_gradients([(g, a)])
        summed = cudist.get_replica_context().all_reduce(cudist.ReduceOp.SUM, g)
        opt_b.apply_gradients([(summed, b)], experimental_aggregate_gradients=False)

    strategy.run(step)
    strategy.run(step)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert not np.array_equal(a.numpy(), np.ones(6, np.float32))


def test_slots_live_with_their_variable():
    cpu = "/job:localhost/replica:0/task:0/device:CPU:{}"
    mirrored = make_strategy("mirrored3")
    with mirrored.scope():
        var = cudist.Variable(np.zeros((2, 2), np.float32), name="dense/kernel")
        opt = optimizers.Adam(name="adam")  # (the default name is numbered per process, as Keras's)
        opt.build([var])  # slots can be made ahead of the first step
    m = opt.get_slot(var, "momentum")
    assert isinstance(m, cudist.MirroredVariable)
    assert [c.device for c in m.values] == [c.device for c in var.values] == [cpu.format(i) for i in range(3)]
    assert m.name == "adam/dense_kernel_momentum:0" and not m.trainable  # Keras 3's path, as the TF variable's name
    assert [v.name for v in opt.variables] == [
        "adam/iteration:0", "adam/learning_rate:0", "adam/dense_kernel_momentum:0", "adam/dense_kernel_velocity:0"
    ]
    assert isinstance(opt.iterations, cudist.MirroredVariable)

    central = cudist.CentralStorageStrategy(compute_devices=["/cpu:1", "/cpu:2"], parameter_device="/cpu:3")
    with central.scope():
        var = cudist.Variable(np.zeros(3, np.float64))
        opt = optimizers.SGD(momentum=0.9)
    central.run(lambda: opt.apply_gradients([(np.ones(3), var)]))
    vel = opt.get_slot(var, "momentum")
    assert isinstance(vel, AggregatingVariable) and vel.device == var.device == cpu.format(3)
    np.testing.assert_allclose(vel.numpy(), -0.01 * 2 * np.ones(3))  # lr 0.01, gradients of 2 replicas summed

    one = cudist.OneDeviceStrategy("/cpu:2")
    with one.scope():
        var = cudist.Variable(np.zeros(3, np.float32))
    opt = optimizers.SGD(momentum=0.5)  # made outside the scope: slots still follow the variable
    one.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), var)]))
    assert opt.get_slot(var, "momentum").device == cpu.format(2)
    with pytest.raises(KeyError, match="no slots for variable 'Variable:0'"):
        optimizers.SGD().get_slot(var, "momentum")
    with pytest.raises(KeyError, match="slots are"):
        opt.get_slot(var, "velocity")


def test_plain_sgd_has_no_slots_and_iterations_count(strategy):
    with strategy.scope():
        var = cudist.Variable(np.zeros(2, np.float32))
        opt = optimizers.SGD(0.1, name="SGD")
    for _ in range(4):
        strategy.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), var)]))
    assert [v.name for v in opt.variables] == ["SGD/iteration:0", "SGD/learning_rate:0"]
    assert int(opt.iterations) == 4
    assert opt.iterations.numpy().dtype == np.int64


def test_iterations_count_keeps_snapshots_and_every_copy_in_step(strategy):
    """The counter is incremented in place on its host copies: a snapshot read before a step keeps its
    value (copy-on-write, as every variable write), and every replica's copy reads the new count."""
    with strategy.scope():
        var = cudist.Variable(np.zeros(2, np.float32))
        opt = optimizers.SGD(0.1, momentum=0.9)
    strategy.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), var)]))
    before = opt.iterations.read_value()
    strategy.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), var)]))
    opt.apply_gradients([(np.ones(2, np.float32), var)])  # cross-replica context
    assert int(before) == 1
    assert int(opt.iterations) == 3
    counts = strategy.experimental_local_results(strategy.run(lambda: opt.iterations.read_value()))
    assert len(counts) == strategy.num_replicas_in_sync and [int(c) for c in counts] == [3] * len(counts)
    copies = strategy.experimental_local_results(opt.iterations)  # one per replica; CentralStorage: one
    assert copies and [int(c) for c in copies] == [3] * len(copies)


def test_learning_rate_schedule_and_setter():
    """Keras 3: a LearningRateSchedule is called with the iteration count, a plain callable with no
    arguments; a number replaces a callable, not a schedule."""
    seen = []

    class Schedule(optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            seen.append(step)
            return 0.5 / (step + 1)

    var = cudist.Variable(np.zeros(2))
    opt = optimizers.SGD(Schedule())
    for _ in range(3):
        opt.apply_gradients([(np.ones(2), var)])
    assert seen == [0, 1, 2]
    np.testing.assert_allclose(var.numpy(), -(0.5 + 0.25 + 0.5 / 3) * np.ones(2), rtol=1e-15)
    assert opt.learning_rate == 0.5 / 4  # the next step's
    with pytest.raises(TypeError, match="not settable"):
        opt.learning_rate = 2.0
    opt = optimizers.SGD(lambda: 2.0)
    opt.apply_gradients([(np.ones(2), var)])
    np.testing.assert_allclose(var.numpy(), -(2.0 + 0.5 + 0.25 + 0.5 / 3) * np.ones(2), rtol=1e-15)
    opt.learning_rate = 1.0
    opt.apply_gradients([(np.ones(2), var)])
    np.testing.assert_allclose(var.numpy(), -(3.0 + 0.5 + 0.25 + 0.5 / 3) * np.ones(2), rtol=1e-15)
    with pytest.raises(TypeError, match="takes no arguments"):
        optimizers.SGD(lambda iteration: 0.1).apply_gradients([(np.ones(2), var)])


def test_none_gradients_are_skipped_with_a_warning(strategy):
    with strategy.scope():
        a = cudist.Variable(np.zeros(2, np.float32), name="a")
        b = cudist.Variable(np.zeros(2, np.float32), name="b")
        opt = optimizers.SGD(1.0)
    with pytest.warns(UserWarning, match="Gradients do not exist for variables \\['b:0'\\]"):
        strategy.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), a), (None, b)]))
    n = strategy.num_replicas_in_sync
    np.testing.assert_array_equal(a.numpy(), -n * np.ones(2))
    np.testing.assert_array_equal(b.numpy(), np.zeros(2))
    with pytest.raises(ValueError, match="No gradients provided for any variable"):
        opt.apply_gradients([(None, a)])
    assert opt.apply_gradients([]) is opt.iterations  # nothing to do
    assert int(opt.iterations) == 1


# ---------------------------------------------------------------------------- errors
def test_integer_variable_is_a_type_error(strategy):
    with strategy.scope():
        var = cudist.Variable(np.zeros(3, np.int32), name="counts")
        opt = optimizers.Adam()
        with pytest.raises(TypeError, match="'counts:0'.*int32.*floating-point"):
            opt.apply_gradients([(np.zeros(3, np.int32), var)])


def test_gradient_mismatch_names_the_variable(strategy):
    with strategy.scope():
        var = cudist.Variable(np.zeros((2, 3), np.float32), name="dense/kernel")
        opt = optimizers.SGD(momentum=0.9)
    with pytest.raises(TypeError, match="'dense/kernel:0' has dtype complex128, which cannot be cast"):
        strategy.run(lambda: opt.apply_gradients([(np.zeros((2, 3), np.complex128), var)]))
    with pytest.raises(ValueError, match=r"'dense/kernel:0' has shape \(3, 2\) but the variable has shape \(2, 3\)"):
        strategy.run(lambda: opt.apply_gradients([(np.zeros((3, 2), np.float32), var)]))
    with strategy.scope():
        with pytest.raises(ValueError, match=r"shape \(3,\)"):
            opt.apply_gradients([([1.0, 2.0, 3.0], var)])
    # nothing was updated or counted by the failed calls
    np.testing.assert_array_equal(var.numpy(), np.zeros((2, 3)))
    assert int(opt.iterations) == 0


def test_gradients_of_another_dtype_are_cast_as_keras_does(strategy):
    """Keras casts the gradient to the variable's dtype (after clipping): a float64 gradient for a
    float32 variable is no error."""
    with strategy.scope():
        var = cudist.Variable(np.zeros(3, np.float32))
        opt = optimizers.SGD(0.5)
    strategy.run(lambda: opt.apply_gradients([(np.full(3, 1.0 / 3.0), var)]))
    n = strategy.num_replicas_in_sync
    np.testing.assert_allclose(var.numpy(), np.full(3, -0.5 * n * np.float32(1.0 / 3.0), np.float32), rtol=1e-6)
    assert var.numpy().dtype == np.float32


def test_python_gradients_convert():
    var = cudist.Variable(np.zeros(2, np.float32))
    opt = optimizers.SGD(0.5)
    opt.apply_gradients([([1, 2], var)])
    np.testing.assert_array_equal(var.numpy(), np.array([-0.5, -1.0], np.float32))


def test_bad_arguments():
    with pytest.raises(ValueError, match="momentum"):
        optimizers.SGD(momentum=1.5)
    with pytest.raises(ValueError, match="beta_1"):
        optimizers.Adam(beta_1=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        optimizers.Adam(epsilon=-1e-7)
    with pytest.raises(ValueError, match="learning_rate"):
        optimizers.SGD("fast")
    with pytest.raises(ValueError, match="learning_rate"):
        optimizers.SGD(float("nan"))
    var = cudist.Variable(np.zeros(2, np.float32))
    opt = optimizers.SGD()
    with pytest.raises(TypeError, match="pairs"):
        opt.apply_gradients([np.zeros(3, np.float32)])
    with pytest.raises(TypeError, match="cudist.Variable"):
        opt.apply_gradients([(np.zeros(2, np.float32), np.zeros(2, np.float32))])
    mirrored = make_strategy("mirrored2")
    with mirrored.scope():
        on_read = cudist.Variable(
            np.zeros(2, np.float32),
            synchronization=cudist.VariableSynchronization.ON_READ,
            aggregation=cudist.VariableAggregation.SUM,
            name="stat",
        )
        with pytest.raises(ValueError, match="'stat:0'.*SyncOnReadVariable"):
            opt.apply_gradients([(np.zeros(2, np.float32), on_read)])


def test_exported_names():
    assert optimizers.__all__ == [
        "Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "Nadam", "Lion", "LossScaleOptimizer", "schedules"
    ]  # fmt: skip
    assert "learning_rate" in repr(optimizers.SGD.__init__.__code__.co_varnames)
    assert repr(optimizers.SGD(name="SGD")).startswith("<cudist.optimizers.SGD name='SGD' iterations=0")


def test_gradient_aliasing_the_variable():
    strategy = make_strategy("mirrored3")
    w0 = np.arange(1.0, 7.0, dtype=np.float32)
    with strategy.scope():
        var = cudist.Variable(w0)
        opt = optimizers.SGD(0.5)
        # a view of copy 1 (which the kernel writes) as the gradient: must read the old values
        opt.apply_gradients([(var.values[1].storage.array[:], var)])
    for c in _local(strategy, var):
        np.testing.assert_array_equal(c, w0 - np.float32(0.5) * w0)


@pytest.mark.parametrize("where", ["run", "cross-replica", "one-device"])
@pytest.mark.parametrize("how", ["storage", "view", "dlpack"])
def test_a_step_reads_gradients_that_alias_another_variable_before_any_update(how, where):
    """The gradient of b is a's storage (a view of it, or its DLPack export, the public way to it);
    a is updated first in the same step, and b must still see a's value from before the step. Inside
    run this is the fused all-reduce + update; in cross-replica context, the plain update."""
    strategy = make_strategy("mirrored3" if where != "one-device" else "one_device")
    n = 3 if where == "run" else 1
    rng = np.random.default_rng(3)
    a0, b0 = _random((6,), np.float32, rng), _random((6,), np.float32, rng)
    with strategy.scope():
        a, b = cudist.Variable(a0), cudist.Variable(b0)
        opt = optimizers.SGD(0.5)
    store = (a.values[0] if where != "one-device" else a).storage.array  # what the update of a writes (host copies share it)

    def step():
        g = {"storage": store, "view": store[:], "dlpack": np.from_dlpack(a)}[how]
        assert np.shares_memory(g, store)
        opt.apply_gradients([(np.ones(6, np.float32), a), (g, b)])

    if where == "run":
        strategy.run(step)
    else:
        with strategy.scope():
            step()
    for c in _local(strategy, b):
        np.testing.assert_array_equal(c, b0 - np.float32(0.5) * reference_sum([a0] * n))
    for c in _local(strategy, a):
        np.testing.assert_array_equal(c, a0 - np.float32(0.5) * np.float32(n))


def test_reassigned_variable_keeps_training_and_a_new_shape_is_reported():
    var = cudist.Variable(np.zeros(3, np.float32), shape=(None,), name="grow")
    opt = optimizers.SGD(1.0, momentum=0.5)
    opt.apply_gradients([(np.ones(3, np.float32), var)])
    var.assign(np.full(3, 10.0, np.float32))  # same shape: written in place
    opt.apply_gradients([(np.ones(3, np.float32), var)])
    np.testing.assert_array_equal(var.numpy(), np.full(3, 10.0 - 1.5, np.float32))  # v = 0.5 * -1 - 1
    var.assign(np.zeros(5, np.float32))  # a new shape: the slot no longer fits
    with pytest.raises(ValueError, match="'grow:0'.*momentum slots have shape \\(3,\\).*shape \\(5,\\)"):
        opt.apply_gradients([(np.ones(5, np.float32), var)])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_mirrored_on_logical_gpus(kind):
    """Two logical GPUs on physical GPU 0: CuPy gradients, CuPy slots, the GPU kernels."""
    import cupy

    from cudist import config

    gpu0 = config.list_physical_devices("GPU")[0]
    config.set_logical_device_configuration(gpu0, [config.LogicalDeviceConfiguration(memory_limit=1024)] * 2)
    try:
        strategy = cudist.MirroredStrategy(["/gpu:0", "/gpu:1"])
        rng = np.random.default_rng(5)
        w0 = _random((33,), np.float32, rng)
        grads = [[_random((33,), np.float32, rng) for _ in range(2)] for _ in range(STEPS)]
        with strategy.scope():
            var = cudist.Variable(w0)
            opt = make_optimizer(kind)
        for t in range(STEPS):
            strategy.run(lambda: opt.apply_gradients([(cupy.asarray(grads[t][_rid()]), var)]))
        ref_w, ref_slots = w0.copy(), [np.zeros(33, np.float32) for _ in SLOTS[kind]]
        for t in range(STEPS):
            ref_w, ref_slots = reference_step(kind, ref_w, ref_slots, reference_sum(grads[t]), LR[kind], t + 1)
        copies = [cupy.asnumpy(c.storage.array) for c in var.values]
        np.testing.assert_allclose(copies[0], ref_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(copies[1], copies[0])
        slot = opt.get_slot(var, SLOTS[kind][0])
        assert all(type(c.storage.array) is cupy.ndarray for c in slot.values)
        np.testing.assert_allclose(cupy.asnumpy(slot.values[1].storage.array), ref_slots[0], rtol=1e-5, atol=1e-6)
    finally:
        config.set_logical_device_configuration(gpu0, None)
