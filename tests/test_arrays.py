"""cudist._arrays: the shared array/device helpers, on host arrays and on a stand-in for CuPy.

The stand-in (a tiny NumPy-backed ``cupy`` module with devices) checks the GPU branches' control
flow on machines without a GPU: which device an array lands on, when a copy is made, and that
CuPy's ``__cuda_array_interface__`` is never built just to recognise a CuPy array.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from cudist import _arrays as A


# ---------------------------------------------------------------------------------------------- host
def test_host_arrays_and_values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    assert not A.is_device_array(x) and not A.is_device_array(1.5) and A.is_array(x) and A.is_array(np.float32(1))
    assert not A.is_array(1.5) and not A.is_array([1.0])
    assert A.array_module(x) is np and A.array_module(2) is np
    assert A.as_array(x) is A.to_host(x) is x
    s = A.as_array(2.5)
    assert isinstance(s, np.ndarray) and s.shape == () and s == 2.5
    assert A.gpu_of(x) is None
    with A.device_context(x):
        pass


def test_contiguous_copies_only_when_needed_and_keeps_0d():
    x = np.random.default_rng(1).standard_normal((4, 6))
    assert A.contiguous(x) is x
    t = x[:, ::2]
    c = A.contiguous(t)
    assert c.flags.c_contiguous and np.array_equal(c, t) and not np.shares_memory(c, x)
    z = A.contiguous(np.float64(3.0))
    assert isinstance(z, np.ndarray) and z.shape == ()
    assert A.contiguous(np.asarray(7.0)).shape == ()


def test_snapshot_like_place_copy_semantics():
    x = np.random.default_rng(2).standard_normal(5)
    snap = A.snapshot(x)
    assert snap is not x and np.array_equal(snap, x)
    assert A.like(x, x) is x
    c = A.like(x, x, copy=True)
    assert c is not x and np.array_equal(c, x)
    assert A.place(x, "/cpu:1") is x
    p = A.place(x, "CPU:0", copy=True)
    assert p is not x and p.flags.c_contiguous and p.flags.writeable and np.array_equal(p, x)
    q = A.place([1.0, 2.0], "/cpu:0", copy=True)
    assert isinstance(q, np.ndarray) and q.tolist() == [1.0, 2.0]


def test_may_share_memory_on_host():
    x = np.arange(10.0)
    assert A.may_share_memory(x, x[2:5]) and not A.may_share_memory(x, x.copy())


@pytest.mark.parametrize(
    ("value", "dtype"),
    [([1.5, 2.0], np.float32), ([1, 2], np.int32), ([1, 2**40], np.int64), ([], np.float32), ([True], np.bool_)],
)
def test_python_dtype_follows_tf(value, dtype):
    assert A.python_dtype(np.asarray(value)).dtype == dtype


def test_missing_gpu_is_named(monkeypatch):
    from cudist import _devices, config

    monkeypatch.setattr(config, "_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match=r"device:GPU:0 does not exist: 0 logical GPU\(s\).*no GPU is visible"):
        A.physical_gpu(_devices.parse_device("/gpu:0"))
    with pytest.raises(ValueError, match="GPU:1 does not exist"):
        A.place(np.zeros(2), "/gpu:1")


# ---------------------------------------------------------------------------------------------- stand-in GPU
def _fake_cupy():
    current = [0]

    class Device:
        def __init__(self, i=None):
            self.id = current[0] if i is None else i

        def __enter__(self):
            self._prev = current[0]
            current[0] = self.id
            return self

        def __exit__(self, *exc):
            current[0] = self._prev

    class ndarray:  # noqa: N801 - named like CuPy's
        def __init__(self, a, device):
            self._a, self.device = a, Device(device)

        @property
        def __cuda_array_interface__(self):
            raise AssertionError("CuPy's interface dict was built just to recognise a CuPy array")

        flags = property(lambda self: self._a.flags)
        dtype = property(lambda self: self._a.dtype)
        nbytes = property(lambda self: self._a.nbytes)
        data = property(lambda self: types.SimpleNamespace(ptr=self._a.__array_interface__["data"][0]))

        def copy(self, order="C"):
            return ndarray(self._a.copy(order=order), current[0])  # on the *current* device, like CuPy

        def __getitem__(self, index):
            return ndarray(self._a[index], self.device.id)

    ndarray.__module__ = "cupy"

    def raw(a):
        return a._a if isinstance(a, ndarray) else a

    def asarray(a):
        if isinstance(a, ndarray) and a.device.id == current[0]:
            return a
        return ndarray(np.array(raw(a)), current[0])

    def array(a, order="K", copy=True):
        return ndarray(np.array(raw(a), order=order, copy=True), current[0])

    runtime = types.SimpleNamespace(getDevice=lambda: current[0], setDevice=lambda d: current.__setitem__(0, d))

    class _Event:  # this stand-in runs everything at once: ordering between devices is a no-op
        def record(self, stream=None):
            pass

    class _Stream:
        def wait_event(self, ev):
            pass

    return types.SimpleNamespace(
        ndarray=ndarray,
        asarray=asarray,
        array=array,
        asnumpy=lambda a: raw(a).copy(),
        cuda=types.SimpleNamespace(Device=Device, runtime=runtime, Event=lambda **kw: _Event(),
                                   get_current_stream=lambda device_id=None: _Stream()),
    )


@pytest.fixture
def cupy(monkeypatch):
    from cudist import config

    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(config, "_gpu_count", lambda: 2)
    return fake


def test_gpu_placement_and_copies(cupy):
    x = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)
    g = A.to_gpu(x, 1)
    assert isinstance(g, cupy.ndarray) and A.gpu_of(g) == 1 and A.is_device_array(g) and A.is_array(g)
    assert A.array_module(g) is cupy and A.as_array(g) is g
    assert A.to_gpu(g, 1) is g and A.gpu_of(A.to_gpu(g, 0)) == 0 and A.to_gpu(g, 1, copy=True) is not g
    assert A.place(g, "/gpu:1") is g and A.gpu_of(A.place(g, "/device:GPU:0")) == 0
    host = A.place(g, "/cpu:0")
    assert type(host) is np.ndarray and np.array_equal(host, x) and np.array_equal(A.to_host(g), x)
    assert A.gpu_of(A.snapshot(g)) == 1 and A.snapshot(g) is not g
    assert A.gpu_of(A.like(x, g)) == 1 and A.like(g, g) is g and A.like(g, g, copy=True) is not g
    assert np.array_equal(A.like(g, x), x)
    c = A.contiguous(g[:, ::2])
    assert c.flags.c_contiguous and A.gpu_of(c) == 1
    assert A.may_share_memory(g, g) and not A.may_share_memory(g, A.snapshot(g)) and not A.may_share_memory(g, x)
    assert cupy.cuda.runtime.getDevice() == 0  # every helper restored the current device
    with A.device_context(g):
        assert A.current_gpu() == 1
    A.set_current_gpu(1)
    assert A.current_gpu() == 1


def test_gpu_device_putter_and_optimizer_groups(cupy):
    from cudist import _input_lib
    from cudist._dataplane.update import device_groups

    x = np.arange(6.0).reshape(3, 2)
    y = _input_lib.device_putter("/gpu:1")({"x": x, "k": 3, "s": np.float32(2.0)})
    assert y["k"] == 3 and A.gpu_of(y["x"]) == 1 and A.gpu_of(y["s"]) == 1
    np.testing.assert_array_equal(A.to_host(y["x"]), x)
    bufs = [A.to_gpu(x, 0), A.to_gpu(x, 1), A.to_gpu(x, 0)]
    assert device_groups(bufs) == [(0, 2), (1,)]
