"""cudist.mixed_precision (issue 28): Keras 3's policies, checked against a recording of Keras
(tests/data/record_keras_policy.py), and what a policy does in a library without layers: variables
created without a dtype take its variable dtype."""

from __future__ import annotations

import builtins
import json
import re
from pathlib import Path

import numpy as np
import pytest

import cudist
from cudist import mixed_precision as mp

KERAS = json.loads((Path(__file__).parent / "data" / "keras_policy.json").read_text())


@pytest.fixture(autouse=True)
def _default_policy():
    """Every test starts and ends under the default policy (the policy is process-wide)."""
    mp.set_global_policy("float32")
    yield
    mp.set_global_policy("float32")


@pytest.mark.parametrize("name", sorted(KERAS["policies"]))
def test_policy_attributes_match_keras(name):
    want = KERAS["policies"][name]
    p = mp.Policy(name)
    assert (p.name, p.compute_dtype, p.variable_dtype, repr(p)) == (
        want["name"], want["compute_dtype"], want["variable_dtype"], want["repr"])
    assert p.get_config() == want["config"]
    assert mp.Policy.from_config(p.get_config()) == p


@pytest.mark.parametrize("index", range(len(KERAS["bad_names"])))
def test_bad_names_raise_keras_errors(index):
    name, (kind, message) = KERAS["bad_names"][index]
    with pytest.raises(getattr(builtins, kind), match=re.escape(message)):
        mp.Policy(name)


@pytest.mark.parametrize("index", range(len(KERAS["bad_set_global_policy"])))
def test_bad_set_global_policy_raises_keras_errors(index):
    value, (kind, message) = KERAS["bad_set_global_policy"][index]
    with pytest.raises(ValueError, match=re.escape(message)):
        mp.set_global_policy(value)
    assert kind == "ValueError"
    assert mp.global_policy().name == "float32"  # a refused policy leaves the old one set


def test_global_policy_and_equality_match_keras():
    assert mp.global_policy().name == KERAS["default"]
    mp.set_global_policy("mixed_bfloat16")
    assert mp.global_policy() == mp.Policy("mixed_bfloat16")
    assert mp.Policy(None).name == KERAS["none_under_mixed_bfloat16"]
    mp.set_global_policy(mp.Policy("mixed_float16"))
    assert mp.global_policy().compute_dtype == "float16"
    assert (mp.Policy("mixed_float16") == mp.Policy("mixed_float16")) is KERAS["equal_same_name"]
    assert (mp.Policy("mixed_float16") == mp.Policy("float32")) is KERAS["equal_other_name"]
    assert (mp.Policy("mixed_float16") == "mixed_float16") is KERAS["equal_string"]
    assert mp.DTypePolicy is mp.Policy
    assert cudist.mixed_precision is mp


def test_policy_is_process_wide():
    """Replicas on threads see the policy the program set (Keras keeps its own per thread)."""
    import threading

    mp.set_global_policy("mixed_float16")
    seen = []
    t = threading.Thread(target=lambda: seen.append(mp.global_policy().name))
    t.start()
    t.join()
    assert seen == ["mixed_float16"]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_policy_makes_float_variables_float32(policy):
    mp.set_global_policy(policy)
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    half = np.array([1.5, -2.25, 3.0], np.float16)
    with strategy.scope():
        from_half = cudist.Variable(half)
        from_f64 = cudist.Variable(np.array([0.1, 0.2]))
        from_python = cudist.Variable(0.5)
        explicit = cudist.Variable(half, dtype=np.float16)  # an explicit dtype wins
        ints = cudist.Variable(np.arange(3))  # integers are left alone
    assert from_half.dtype == np.float32 and isinstance(from_half, cudist.MirroredVariable)
    np.testing.assert_array_equal(from_half.numpy(), half.astype(np.float32))
    for component in from_half.values:
        assert component.dtype == np.float32
    assert from_f64.dtype == np.float32 and from_python.dtype == np.float32
    assert explicit.dtype == np.float16
    assert ints.dtype == np.arange(3).dtype


def test_bfloat16_values_become_float32_master_weights():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    mp.set_global_policy("mixed_bfloat16")
    w = np.array([0.5, -1.25, 3.0], ml_dtypes.bfloat16)
    v = cudist.Variable(w)
    assert v.dtype == np.float32
    np.testing.assert_array_equal(v.numpy(), w.astype(np.float32))
    # The variable is a copy: writing it leaves the user's array alone.
    v.assign_add(np.ones(3, np.float32))
    np.testing.assert_array_equal(w.astype(np.float32), [0.5, -1.25, 3.0])


def test_default_policy_keeps_tf_dtypes():
    """Under the default policy (set or not) TF's rules hold: a float64 array stays float64."""
    for name in (None, "float32"):
        if name:
            mp.set_global_policy(name)
        assert cudist.Variable(np.array([0.1])).dtype == np.float64
        assert cudist.Variable(np.array([1.0], np.float16)).dtype == np.float16


def test_float16_and_float64_policies():
    mp.set_global_policy("float16")
    assert cudist.Variable(np.array([0.1, 0.2])).dtype == np.float16
    assert cudist.Variable(1.0).dtype == np.float16
    mp.set_global_policy("float64")
    assert cudist.Variable(np.float32(1.5)).dtype == np.float64
    mp.set_global_policy("int32")  # not a float policy: float values keep their dtype
    assert cudist.Variable(1.5).dtype == np.float32


def test_bfloat16_policy_makes_bfloat16_variables():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    mp.set_global_policy("bfloat16")
    v = cudist.Variable(np.array([1.0, 1.00390625, 3.3], np.float32))
    assert v.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(v.numpy(), np.array([1.0, 1.00390625, 3.3], np.float32).astype(ml_dtypes.bfloat16))
    assert cudist.Variable(1.5).dtype == ml_dtypes.bfloat16
    assert cudist.Variable(np.arange(3)).dtype == np.int64  # integers keep their dtype
    assert cudist.Variable(np.ones(2, np.float32), dtype=np.float32).dtype == np.float32


def test_compute_dtype_casts_gradients_for_float32_variables():
    """The policy's compute dtype is what a step casts its gradients to; float32 variables take
    them, summed over the replicas in float32."""
    mp.set_global_policy("mixed_float16")
    policy = mp.global_policy()
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with strategy.scope():
        v = cudist.Variable(np.ones(5))
        opt = cudist.optimizers.SGD(0.5)
    assert v.dtype == np.float32
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(5).astype(policy.compute_dtype) for _ in range(3)]

    def step():
        opt.apply_gradients([(grads[cudist.get_replica_context().replica_id_in_sync_group], v)])

    strategy.run(step)
    total = grads[0].astype(np.float32) + grads[1].astype(np.float32) + grads[2].astype(np.float32)
    np.testing.assert_array_equal(v.numpy(), np.float32(1) - np.float32(0.5) * total)


# ------------------------------------------------------------------------------- float16 sums
@pytest.mark.parametrize("size", [1, 7, 1000, 4099])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_float16_all_reduce_accumulates_in_float32(each_cpu_backend, size, op):
    """float16 has bfloat16's contract: float32 accumulation in replica order, one rounding (the mean
    divides the float32 sum), bit for bit on every CPU backend, through strategy.run with 4 replicas."""
    rng = np.random.default_rng(size)
    values = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3, size)).astype(np.float16) for _ in range(4)]
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(4)])

    def step():
        ctx = cudist.get_replica_context()
        return ctx.all_reduce(op, values[ctx.replica_id_in_sync_group])

    acc = values[0].astype(np.float32)
    for v in values[1:]:
        acc = acc + v.astype(np.float32)
    want = (acc / np.float32(4) if op == "mean" else acc).astype(np.float16)
    for local in strategy.experimental_local_results(strategy.run(step)):
        got = np.asarray(local)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    naive = values[0]
    for v in values[1:]:
        naive = naive + v  # NumPy's float16 addition rounds every time
    if op == "sum" and size >= 1000:
        assert not np.array_equal(naive.view(np.uint16), want.view(np.uint16))  # the test can fail


def test_float16_fused_update_rounds_the_gradient_sum_once(each_cpu_backend):
    """float16 variables, float16 gradients from 4 replicas: the fused all-reduce + momentum equals the
    reference's reduce_to_one (float32 accumulation, one rounding) then momentum, bit for bit."""
    from cudist._kernels import get_backend

    rng = np.random.default_rng(5)
    init = rng.standard_normal(1001).astype(np.float16)
    grads = [(rng.standard_normal(1001) * 10.0 ** rng.integers(-2, 2, 1001)).astype(np.float16) for _ in range(4)]
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    with strategy.scope():
        v = cudist.Variable(init, name="w")
        opt = cudist.optimizers.SGD(0.1, momentum=0.9)

    def step():
        opt.apply_gradients([(grads[cudist.get_replica_context().replica_id_in_sync_group], v)])

    strategy.run(step)
    ref = get_backend("numpy")
    g = ref.reduce_to_one(grads, "sum")
    w, vel = [init.copy()], [np.zeros_like(init)]
    ref.momentum(w, vel, g, lr=0.1, momentum=0.9)
    np.testing.assert_array_equal(v.numpy().view(np.uint16), w[0].view(np.uint16))
