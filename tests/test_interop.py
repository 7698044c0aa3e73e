"""Gradients from other frameworks: their arrays go into collectives and ``apply_gradients`` through
DLPack (zero-copy), results come back as NumPy (CuPy on GPUs), and Variables export DLPack.

JAX and autograd are in the test extra (CPU builds, small); PyTorch is not (its wheels pull in
gigabytes of CUDA libraries), so its tests skip unless it is installed. A stand-in DLPack exporter
covers the conversion paths (and the errors) without any framework.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import cudist
import cudist.optimizers
from cudist._arrays import as_array, from_dlpack, is_foreign_array


def _mirrored(n=2):
    return cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


class Exporter:
    """Another framework's host array, as far as cudist can tell: DLPack only (no ``__array__``)."""

    def __init__(self, array, fail=None, dtype=None):
        self._array = array
        self._fail = fail
        self.dtype = dtype if dtype is not None else array.dtype

    def __dlpack__(self, **kwargs):
        if self._fail is not None:
            raise self._fail
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


# ------------------------------------------------------------------------------ the conversion point
def test_foreign_arrays_convert_zero_copy_to_numpy():
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = Exporter(base)
    assert is_foreign_array(x)
    assert not is_foreign_array(base) and not is_foreign_array(np.float32(1)) and not is_foreign_array([1.0])
    a = as_array(x)
    assert type(a) is np.ndarray and np.shares_memory(a, base)
    with cudist.MirroredStrategy(["/cpu:0"]).scope():
        v = cudist.Variable(np.zeros(3, np.float32))
    assert not is_foreign_array(v)  # cudist's own objects keep converting through __array__ (a copy)


def test_unconvertible_foreign_array_is_a_type_error_naming_the_dtype():
    x = Exporter(np.zeros(3, np.float32), fail=BufferError("unsupported dtype bfloat16"), dtype="torch.bfloat16")
    with pytest.raises(TypeError, match=r"Exporter of dtype torch\.bfloat16.*unsupported dtype bfloat16"):
        from_dlpack(x)
    s = _mirrored()
    with pytest.raises(TypeError, match="torch.bfloat16"):
        s.run(lambda: cudist.get_replica_context().all_reduce("sum", x))


def test_a_cuda_array_without_cupy_says_which_device_and_how_to_install_it(monkeypatch):
    class OnGpu(Exporter):
        def __dlpack_device__(self):
            return (2, 1)  # kDLCUDA, device 1

    monkeypatch.setitem(sys.modules, "cupy", None)  # what `import cupy` does where CuPy is not installed
    x = OnGpu(np.zeros(3, np.float32))
    with pytest.raises(ImportError, match=r"OnGpu on CUDA device 1 \(DLPack device type 2\) needs CuPy.*"
                                          r"pip install 'cudist\[cuda13\]'") as info:
        from_dlpack(x)
    assert type(info.value) is ImportError  # not the bare ModuleNotFoundError of `import cupy`
    s = _mirrored()
    with pytest.raises(ImportError, match="CUDA device 1"):
        s.run(lambda: cudist.get_replica_context().all_reduce("sum", x))


def test_collectives_and_apply_gradients_take_foreign_arrays_and_return_numpy():
    s = _mirrored(2)
    with s.scope():
        v = cudist.Variable(np.ones(3, np.float32), name="v")
        opt = cudist.optimizers.SGD(0.5)

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        g = Exporter(np.full(3, r + 1.0, np.float32))
        ctx = cudist.get_replica_context()
        out = ctx.all_reduce("sum", g), ctx.all_reduce("mean", {"g": g}), ctx.all_gather(g, axis=0)
        opt.apply_gradients([(g, v)])
        return out

    total, nested, gathered = s.run(step)
    for a in s.experimental_local_results(total):
        assert type(a) is np.ndarray and a.tolist() == [3.0, 3.0, 3.0]
    assert [a.tolist() for a in s.experimental_local_results(nested["g"])] == [[1.5] * 3] * 2
    assert s.experimental_local_results(gathered)[0].tolist() == [1.0] * 3 + [2.0] * 3
    np.testing.assert_array_equal(v.numpy(), 1 - 0.5 * 3)
    per_replica = s.experimental_distribute_values_from_function(lambda c: Exporter(np.full(2, c.replica_id_in_sync_group, np.float32)))
    assert s.reduce("sum", per_replica, axis=None).tolist() == [1.0, 1.0]
    assert s.reduce("mean", per_replica, axis=0) == 0.5


def test_variables_export_dlpack_without_copying():
    s = _mirrored(2)
    with s.scope():
        v = cudist.Variable(np.arange(3, dtype=np.float32), name="v")
    assert v.__dlpack_device__() == (1, 0)
    view = np.from_dlpack(v)  # the live storage of replica 0's copy
    v.assign_add(np.ones(3, np.float32))
    assert view.tolist() == [1.0, 2.0, 3.0]
    copy = np.asarray(v)  # __array__ still copies
    v.assign_add(np.ones(3, np.float32))
    assert copy.tolist() == [1.0, 2.0, 3.0]
    inside = s.run(lambda: np.from_dlpack(v).tolist())  # inside run: the replica's own component
    assert s.experimental_local_results(inside) == ([2.0, 3.0, 4.0], [2.0, 3.0, 4.0])


# ------------------------------------------------------------------------------ JAX
def _jax():
    return pytest.importorskip("jax", reason="JAX is in the test extra (pip install 'jax[cpu]'); not installed here")


def test_jax_gradients_through_apply_gradients_and_all_reduce():
    jax = _jax()
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    s = _mirrored(2)
    with s.scope():
        w = cudist.Variable(np.zeros(3, np.float32), name="w")
        opt = cudist.optimizers.SGD(0.1)

    def loss_fn(weights, xb, yb):
        return jnp.sum((xb @ weights - yb) ** 2) / 8  # scaled by the global batch

    def step(inputs):
        xb, yb = inputs
        loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(w), xb, yb)  # a Variable is a JAX input
        opt.apply_gradients([(grad, w)])
        return cudist.get_replica_context().all_reduce("sum", loss)

    dataset = cudist.data.Dataset.from_tensor_slices((x, y)).batch(8)
    for batch in s.experimental_distribute_dataset(dataset):
        out = s.run(step, args=(batch,))
    loss = s.experimental_local_results(out)[0]
    assert isinstance(loss, (np.ndarray, np.generic))  # collectives give NumPy, not JAX arrays
    np.testing.assert_allclose(loss, np.sum(y**2) / 8, rtol=1e-6)
    want = -0.1 * (2 / 8) * (x.T @ (-y))
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-5)


def test_jax_arrays_are_taken_without_a_copy_and_variables_feed_jax():
    jax = _jax()
    jnp = jax.numpy
    x = jnp.arange(4.0, dtype=jnp.float32)
    a = as_array(x)
    assert type(a) is np.ndarray and a.__array_interface__["data"][0] == x.unsafe_buffer_pointer()
    assert not a.flags.writeable  # JAX arrays are immutable; the kernels only read them
    with _mirrored(2).scope():
        v = cudist.Variable(np.arange(3, dtype=np.float32), name="v")
    np.testing.assert_array_equal(jnp.from_dlpack(v), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(jax.grad(lambda p: jnp.sum(p * p))(jnp.asarray(v)), [0.0, 2.0, 4.0])
    v.assign(jnp.ones(3, jnp.float32))
    assert v.numpy().tolist() == [1.0, 1.0, 1.0]


def test_bfloat16_is_held_as_ml_dtypes_and_reduced():
    jax = _jax()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = jax.numpy.ones(3, jax.numpy.bfloat16)
    a = as_array(x)  # NumPy cannot import bfloat16 through DLPack; JAX's own conversion holds it
    assert a.dtype == ml_dtypes.bfloat16 and a.tolist() == [1.0, 1.0, 1.0]
    s = _mirrored(2)
    # Issue #28: JAX's bfloat16 is all-reduced (float32 accumulation) and updates float32 variables.
    out = s.run(lambda: cudist.get_replica_context().all_reduce("sum", x))
    for r in s.experimental_local_results(out):
        assert np.asarray(r).dtype == ml_dtypes.bfloat16 and np.asarray(r).tolist() == [2.0, 2.0, 2.0]
    with s.scope():
        v = cudist.Variable(np.zeros(3, np.float32))
        opt = cudist.optimizers.SGD(0.1)
    s.run(lambda: opt.apply_gradients([(x, v)]))
    np.testing.assert_array_equal(np.asarray(v.read_value()), np.full(3, np.float32(0.0) - np.float32(0.1) * np.float32(2.0)))


# ------------------------------------------------------------------------------ autograd, PyTorch
def test_autograd_gradients_apply():
    autograd = pytest.importorskip("autograd", reason="autograd is in the test extra; not installed here")
    anp = autograd.numpy
    s = _mirrored(2)
    with s.scope():
        w = cudist.Variable(np.ones(2, np.float32), name="w")
        opt = cudist.optimizers.SGD(1.0)

    def step():
        grad = autograd.grad(lambda p: anp.sum(p * p) / 2)(w.numpy())  # 1/2 of |w|^2 on each replica
        opt.apply_gradients([(grad.astype(np.float32), w)])

    s.run(step)
    np.testing.assert_array_equal(w.numpy(), [-1.0, -1.0])  # w - (w/2 + w/2)


def test_torch_tensors_in_collectives_and_apply_gradients():
    torch = pytest.importorskip("torch", reason="PyTorch is not in the test extra (multi-GB wheels); not installed here")
    s = _mirrored(2)
    with s.scope():
        w = cudist.Variable(np.zeros(3, np.float32), name="w")
        opt = cudist.optimizers.SGD(1.0)

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        p = torch.from_dlpack(w).clone().requires_grad_(True)  # a Variable as a torch input
        loss = ((p - (r + 1)) ** 2).sum() / 2
        loss.backward()
        opt.apply_gradients([(p.grad, w)])
        return cudist.get_replica_context().all_reduce("sum", loss.detach())

    out = s.run(step)
    assert isinstance(s.experimental_local_results(out)[0], (np.ndarray, np.generic))
    np.testing.assert_array_equal(w.numpy(), [3.0, 3.0, 3.0])  # -((0-1) + (0-2))
    with pytest.raises(TypeError, match="bfloat16"):
        s.run(lambda: cudist.get_replica_context().all_reduce("sum", torch.ones(2, dtype=torch.bfloat16)))
