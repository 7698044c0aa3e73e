"""Cross-device ops: results against NumPy, packing (kernel call counts), GPU-only ops on CPUs."""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist import Mirrored, PerReplica
from cudist._cross_device_ops import KernelAllReduce, _cpu_backend, _pack_groups

CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"
CPU_OPS = [
    lambda: KernelAllReduce(),
    lambda: cudist.ReductionToOneDevice(),
    lambda: cudist.HierarchicalCopyAllReduce(num_packs=2),
    lambda: KernelAllReduce(num_packs=0),
]


class CallCounter:
    """Wraps one method of the memoized kernel backend and counts its calls."""

    def __init__(self, monkeypatch, method):
        self.calls = []
        backend = _cpu_backend()
        real = getattr(backend, method)

        def spy(bufs, *a, **k):  # the public method or the hook the strategies call
            self.calls.append(tuple(b.size for b in bufs))
            return real(bufs, *a, **k)

        monkeypatch.setattr(backend, method, spy)


def ref_sum(parts):
    s = parts[0].copy()
    for p in parts[1:]:
        s = (s + p).astype(parts[0].dtype)
    return s


@pytest.mark.parametrize("make", CPU_OPS, ids=["kernel", "to_one", "hier2", "nopack"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_reduce_and_batch_reduce_match_numpy(make, n):
    ops = make()
    rng = np.random.default_rng(n)
    for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64):
        parts = [(rng.standard_normal((4, 7)) * 50).astype(dtype) for _ in range(n)]
        before = [p.copy() for p in parts]
        out = ops.reduce("sum", PerReplica(parts), "/cpu:0")
        np.testing.assert_array_equal(out, ref_sum(parts))
        assert out.dtype == dtype
        mirrored = ops.reduce("mean", PerReplica(parts), ["/cpu:0", "/cpu:1"])
        assert isinstance(mirrored, Mirrored) and len(mirrored.values) == 2
        want = ref_sum(parts) / n if np.dtype(dtype).kind == "i" else (ref_sum(parts) / dtype(n)).astype(dtype)
        for v in mirrored.values:
            np.testing.assert_allclose(v, want, rtol=1e-3 if dtype == np.float16 else 1e-7)
        for p, b in zip(parts, before):
            np.testing.assert_array_equal(p, b)
        odd = [[(rng.standard_normal(k) * 9).astype(dtype) for _ in range(n)] for k in (1, 13, 0, 5)]
        outs = ops.batch_reduce("sum", [(PerReplica(v), "/cpu:0") for v in odd])
        for o, v in zip(outs, odd):
            np.testing.assert_array_equal(o, ref_sum(v))


@pytest.mark.parametrize("make", CPU_OPS, ids=["kernel", "to_one", "hier2", "nopack"])
def test_strategy_all_reduce_with_each_cpu_ops(make):
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"], cross_device_ops=make())
    rng = np.random.default_rng(0)
    leaves = [[rng.standard_normal(k).astype(np.float32) for k in (3, 1, 8)] for _ in range(3)]
    x = PerReplica([tuple(v) for v in leaves])
    out = s.run(lambda v: cudist.get_replica_context().all_reduce("sum", v), args=(x,))
    for r in s.experimental_local_results(out):
        for j in range(3):
            np.testing.assert_array_equal(r[j], ref_sum([leaves[i][j] for i in range(3)]))


def test_broadcast():
    ops = KernelAllReduce()
    src = np.arange(4.0)
    out = ops.broadcast(src, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert isinstance(out, Mirrored)
    for v in out.values:
        np.testing.assert_array_equal(v, src)
        assert v is not src
    one = ops.broadcast(src, "/cpu:1")
    np.testing.assert_array_equal(one, src)
    assert one is not src


def test_destinations_from_distributed_values():
    class Comp:
        def __init__(self, device):
            self.device = device

    ops = KernelAllReduce()
    out = ops.reduce("sum", PerReplica([1.0, 2.0]), Mirrored([Comp("/cpu:2"), Comp("/cpu:3")]))
    assert isinstance(out, Mirrored) and [float(v) for v in out.values] == [3.0, 3.0]
    with pytest.raises(ValueError, match="destinations must not be None"):
        ops.reduce("sum", PerReplica([1.0, 2.0]), None)
    with pytest.raises(ValueError, match="invalid device"):
        ops.reduce("sum", PerReplica([1.0, 2.0]), "/xpu:0")


def test_hundred_small_gradients_cost_one_reduce_call(monkeypatch):
    spy = CallCounter(monkeypatch, "reduce_to_one")
    rng = np.random.default_rng(1)
    grads = [PerReplica([rng.standard_normal((3, 2)).astype(np.float32) for _ in range(2)]) for _ in range(100)]
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    outs = s.extended.batch_reduce_to("sum", [(g, "/cpu:0") for g in grads])
    assert len(spy.calls) == 1 and spy.calls[0] == (600, 600)
    for o, g in zip(outs, grads):
        np.testing.assert_array_equal(o, g.values[0] + g.values[1])


def test_hundred_leaves_in_all_reduce_cost_one_kernel_call(monkeypatch):
    spy = CallCounter(monkeypatch, "_all_reduce")
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(2)
    grads = [[rng.standard_normal(5).astype(np.float32) for _ in range(100)] for _ in range(2)]
    out = s.run(lambda g: cudist.get_replica_context().all_reduce("sum", g), args=(PerReplica(grads),))
    assert len(spy.calls) == 1 and spy.calls[0] == (500, 500)
    for r in s.experimental_local_results(out):
        for j in range(100):
            np.testing.assert_array_equal(r[j], grads[0][j] + grads[1][j])


def test_one_kernel_call_per_dtype_and_pack(monkeypatch):
    spy = CallCounter(monkeypatch, "_all_reduce")
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    mixed = [np.ones(4, np.float32), np.ones(2, np.int64), np.ones(3, np.float32), np.ones(1, np.int64)]
    s.run(lambda: cudist.get_replica_context().all_reduce("sum", mixed))
    assert sorted(spy.calls) == [(3, 3), (7, 7)]
    spy.calls.clear()
    s2 = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=cudist.HierarchicalCopyAllReduce(num_packs=2))
    s2.run(lambda: cudist.get_replica_context().all_reduce("sum", [np.ones(4, np.float32)] * 10))
    assert len(spy.calls) == 2 and sum(c[0] for c in spy.calls) == 40
    spy.calls.clear()
    s3 = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=KernelAllReduce(num_packs=0))
    s3.run(lambda: cudist.get_replica_context().all_reduce("sum", [np.ones(4, np.float32)] * 10))
    assert len(spy.calls) == 10


def test_pack_groups_balance():
    assert _pack_groups([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert _pack_groups([5], 3) == [[0]]
    assert _pack_groups([1, 1, 1], 0) == [[0], [1], [2]]
    groups = _pack_groups([10, 1, 1, 1, 1, 1], 3)
    assert len(groups) == 3 and sum(groups, []) == list(range(6))


@pytest.mark.parametrize("cls", [cudist.NcclAllReduce, cudist.HierarchicalCopyAllReduce, cudist.P2PAllReduce])
def test_num_packs_validation(cls):
    with pytest.raises(ValueError, match="num_packs >= 0"):
        cls(num_packs=-1)
    assert cls(num_packs=3).num_packs == 3


@pytest.mark.parametrize("cls", [cudist.NcclAllReduce, cudist.P2PAllReduce])
def test_gpu_only_ops_reject_cpu_devices(cls):
    ops = cls()  # constructing needs no GPU (and imports no CuPy)
    with pytest.raises(ValueError, match=f"{cls.__name__} needs GPU devices, but got '{CPU.format(0)}'"):
        ops.reduce("sum", PerReplica([1.0, 2.0]), "/cpu:0")
    with pytest.raises(ValueError, match="needs GPU devices"):
        cudist.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)


def test_reduction_to_one_device_arguments():
    r = cudist.ReductionToOneDevice(reduce_to_device="/cpu:1")
    assert r.reduce_to_device == CPU.format(1)
    with pytest.raises(TypeError, match="accumulation_fn must be callable"):
        cudist.ReductionToOneDevice(accumulation_fn=3)
    assert "ReductionToOneDevice" in repr(r)


def test_backends_agree_bitwise_through_the_strategy(monkeypatch):
    from cudist._cross_device_ops import _reset_backend_cache
    from cudist._kernels import available_backends

    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    rng = np.random.default_rng(9)
    x = PerReplica([(rng.standard_normal(37) * 3).astype(np.float32) for _ in range(3)])

    def step(v):
        return cudist.get_replica_context().all_reduce("mean", [v, v * 2])

    results = {}
    try:
        for name in [b for b in available_backends() if b != "cupy"]:
            monkeypatch.setenv("CUDIST_BACKEND", name)
            _reset_backend_cache()
            assert _cpu_backend().name == name
            results[name] = s.experimental_local_results(s.run(step, args=(x,)))
    finally:
        monkeypatch.delenv("CUDIST_BACKEND", raising=False)
        _reset_backend_cache()
    ref = results.pop("numpy")
    for name, res in results.items():
        for r, rr in zip(res, ref):
            for a, b in zip(r, rr):
                assert a.tobytes() == b.tobytes(), name
