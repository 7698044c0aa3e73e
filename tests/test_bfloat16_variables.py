"""bfloat16 variables: creation, updates, mirrored copies; every optimizer computes in float32 and
rounds once per stored value, with the same bits on every CPU backend (the NumPy reference kernels
update them), and Keras 3's slot dtypes (recorded by tests/data/record_bf16_variables.py)."""

import json
import pathlib

import numpy as np
import pytest

import cudist

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
DATA = json.loads((pathlib.Path(__file__).parent / "data" / "bf16_variable_steps.json").read_text())
W0 = np.array(DATA["w0"], np.uint16).view(BF16)
G = np.array(DATA["g"], np.uint16).view(BF16)
MAKERS = {
    "SGD": lambda: cudist.optimizers.SGD(0.1),
    "SGD_momentum": lambda: cudist.optimizers.SGD(0.1, momentum=0.9),
    "Adam": lambda: cudist.optimizers.Adam(0.01),
}


def test_create_assign_read():
    v = cudist.Variable(np.array([1.5, 2.25, 3.0], np.float32), dtype=BF16)
    assert v.dtype == BF16
    v.assign_add(np.array([0.1, 0.1, 0.1], BF16))
    expect = (np.array([1.5, 2.25, 3.0], np.float32) + np.float32(BF16.type(0.1))).astype(BF16)
    np.testing.assert_array_equal(v.numpy().view(np.uint16), expect.view(np.uint16))
    v.assign_sub([1.0, 1.0, 1.0])
    np.testing.assert_array_equal(v.numpy().astype(np.float32), expect.astype(np.float32) - 1)
    v.assign(np.ones(3, np.float32))
    assert v.numpy().dtype == BF16 and (v.numpy().astype(np.float32) == 1).all()
    with pytest.raises(TypeError, match="unsupported dtype"):
        cudist.Variable(np.zeros(2, "V2"))


def _two_steps(name: str, strategy) -> tuple[np.ndarray, set[str]]:
    with strategy.scope():
        v = cudist.Variable(W0)
        opt = MAKERS[name]()
        opt.build([v])
        opt.apply_gradients([(G, v)])
        opt.apply_gradients([(G, v)])
    slots = {s.dtype.name for s in opt.variables if s is not opt.iterations and "learning_rate" not in s.name}
    copies = [np.asarray(c) for c in getattr(v, "values", (v,))]
    for c in copies[1:]:
        np.testing.assert_array_equal(c.view(np.uint16), copies[0].view(np.uint16))
    return copies[0], slots


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_optimizer_steps_same_bits_on_every_backend_and_near_keras(name, select_cpu_backend):
    results = {}
    for backend in ("numpy", "native", "numba"):
        select_cpu_backend(backend)
        w, slots = _two_steps(name, cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"]))
        assert w.dtype == BF16
        assert slots == set(DATA["steps"][name]["slot_dtypes"])
        results[backend] = w.view(np.uint16)
    np.testing.assert_array_equal(results["native"], results["numpy"])
    np.testing.assert_array_equal(results["numba"], results["numpy"])
    keras = np.array(DATA["steps"][name]["w2"], np.uint16).view(BF16).astype(np.float32)
    if name == "Adam":
        # Keras computes Adam's hyperparameters in bfloat16 too: 0.999 rounds to 1, so 1 - beta_2**t is
        # 0 and its step leaves the weights where they were. cudist computes in float32 (they move).
        np.testing.assert_array_equal(keras, W0.astype(np.float32))
        assert (results["numpy"] != W0.view(np.uint16)).any()
        return
    # Keras (TF backend) rounds to bfloat16 after every op; cudist once per stored value.
    np.testing.assert_allclose(results["numpy"].view(BF16).astype(np.float32), keras, rtol=2**-7, atol=2**-9)


def test_sgd_is_float32_arithmetic_rounded_once(select_cpu_backend):
    for backend in ("numpy", "native", "numba"):
        select_cpu_backend(backend)
        v = cudist.Variable(W0)
        cudist.optimizers.SGD(0.1).apply_gradients([(G, v)])
        expect = (W0.astype(np.float32) - np.float32(0.1) * G.astype(np.float32)).astype(BF16)
        np.testing.assert_array_equal(v.numpy().view(np.uint16), expect.view(np.uint16))


def test_checkpoint_round_trip_bit_for_bit(tmp_path):
    rng = np.random.default_rng(3)
    v = cudist.Variable(rng.standard_normal(11).astype(BF16))
    opt = cudist.optimizers.Adam(0.01)
    opt.apply_gradients([(rng.standard_normal(11).astype(BF16), v)])
    path = cudist.train.Checkpoint(v=v, opt=opt).save(str(tmp_path / "c"))
    v2 = cudist.Variable(np.zeros(11, BF16))
    opt2 = cudist.optimizers.Adam(0.01)
    opt2.build([v2])
    cudist.train.Checkpoint(v=v2, opt=opt2).restore(path)
    np.testing.assert_array_equal(v2.numpy().view(np.uint16), v.numpy().view(np.uint16))
    for a, b in zip(opt.variables, opt2.variables):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.atleast_1d(b.numpy()).view(np.uint8), np.atleast_1d(a.numpy()).view(np.uint8))
    assert any(s.dtype == BF16 for s in opt2.variables)
