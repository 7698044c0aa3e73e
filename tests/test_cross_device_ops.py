"""Cross-device ops: results against NumPy, packing (kernel call counts), GPU-only ops on CPUs."""

from __future__ import annotations

import numpy as np
import pytest

import cudist
from cudist import Mirrored, PerReplica
from cudist._dataplane.packing import pack_groups as _pack_groups
from cudist._cross_device_ops import KernelAllReduce
from cudist._reduce_util import ReduceOp
from cudist._kernels import cpu_backend as _cpu_backend
from cudist._kernels._numpy import reference_reduce

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


class KernelPassCounter:
    """Counts the kernel passes of the user's all-reduce path (``backend.trusted``: one call each).

    ``calls``: the all-reduce passes into per-replica outputs (none on the host path any more);
    ``batches``: the batched reduce-to-one passes, each as the element count per replica it reduces
    (all leaves of the call); ``to_one``: the one-leaf reduce-to-one passes, as the sizes per replica.
    """

    def __init__(self, monkeypatch):
        self.calls = []
        self.batches = []
        self.to_one = []
        trusted = _cpu_backend().trusted
        one, batch, batch_to_one, to_one = (
            trusted.all_reduce, trusted.batch_all_reduce, trusted.batch_reduce_to_one, trusted.reduce_to_one
        )

        def spy_one(inputs, outputs, op):
            self.calls.append(tuple(b.size for b in inputs))
            return one(inputs, outputs, op)

        def spy_batch(inputs, outputs, op):
            self.calls.append(tuple(sum(a.size for a in leaves) for leaves in inputs))
            return batch(inputs, outputs, op)

        def spy_batch_to_one(inputs, op, out):
            self.batches.append(tuple(sum(a.size for a in leaves) for leaves in inputs))
            return batch_to_one(inputs, op, out)

        def spy_to_one(bufs, op, out):
            self.to_one.append(tuple(b.size for b in bufs))
            return to_one(bufs, op, out)

        # The native backend's checked forms: a pass when they take the call (None: declined).
        shared, batch_shared = trusted.reduce_to_one_shared, trusted.batch_reduce_to_one_shared

        def spy_shared(bufs, op, out):
            res = shared(bufs, op, out)
            if res is not None:
                self.to_one.append(tuple(b.size for b in bufs))
            return res

        def spy_batch_shared(inputs, op, out):
            res = batch_shared(inputs, op, out)
            if res is not None:
                self.batches.append(tuple(sum(a.size for a in leaves) for leaves in inputs))
            return res

        if shared is not None:
            monkeypatch.setattr(trusted, "reduce_to_one_shared", spy_shared)
        if batch_shared is not None:
            monkeypatch.setattr(trusted, "batch_reduce_to_one_shared", spy_batch_shared)
        monkeypatch.setattr(trusted, "all_reduce", spy_one)
        monkeypatch.setattr(trusted, "batch_all_reduce", spy_batch)
        monkeypatch.setattr(trusted, "batch_reduce_to_one", spy_batch_to_one)
        monkeypatch.setattr(trusted, "reduce_to_one", spy_to_one)


def ref_sum(parts):
    """The contract's SUM in replica order (float16 accumulated in float32, rounded once)."""
    return reference_reduce([np.asarray(p) for p in parts], ReduceOp.SUM)


@pytest.mark.parametrize("make", CPU_OPS, ids=["kernel", "to_one", "hier2", "nopack"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_reduce_and_batch_reduce_match_numpy(make, n):
    ops = make()
    rng = np.random.default_rng(n)
    for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64):
        parts = [(rng.standard_normal((4, 7)) * 50).astype(dtype) for _ in range(n)]
        before = [p.copy() for p in parts]
        out = ops.reduce(ReduceOp.SUM, PerReplica(parts), "/cpu:0")
        np.testing.assert_array_equal(out, ref_sum(parts))
        assert out.dtype == dtype
        mirrored = ops.reduce(ReduceOp.MEAN, PerReplica(parts), ["/cpu:0", "/cpu:1"])
        assert isinstance(mirrored, Mirrored) and len(mirrored.values) == 2
        want = ref_sum(parts) / n if np.dtype(dtype).kind == "i" else (ref_sum(parts) / dtype(n)).astype(dtype)
        for v in mirrored.values:
            np.testing.assert_allclose(v, want, rtol=1e-3 if dtype == np.float16 else 1e-7)
        for p, b in zip(parts, before):
            np.testing.assert_array_equal(p, b)
        odd = [[(rng.standard_normal(k) * 9).astype(dtype) for _ in range(n)] for k in (1, 13, 0, 5)]
        outs = ops.batch_reduce(ReduceOp.SUM, [(PerReplica(v), "/cpu:0") for v in odd])
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


@pytest.mark.parametrize("make", CPU_OPS, ids=["kernel", "to_one", "hier2", "nopack"])
def test_one_array_per_replica_matches_the_nest_path(make):
    """Each ops' one-array all-reduce (its own _all_reduce_arrays) gives the nest path's bits."""
    from cudist import _cross_device_ops as lib

    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(37).astype(np.float32) for _ in range(3)]
    for op in (ReduceOp.SUM, ReduceOp.MEAN):
        one = lib.all_reduce_arrays(make(), op, arrays)
        nest = lib.all_reduce(make(), op, [[a] for a in arrays])
        assert len(one) == 3
        for a, b in zip(one, nest):
            np.testing.assert_array_equal(a, b[0])


def test_a_subclass_with_its_own_reduction_is_not_fused_into_updates():
    """A KernelAllReduce subclass defining batch_reduce (or reduce) reduces through it: optimizers get
    no fused-sum backend, decided when the class is made; the stock classes keep theirs."""
    from cudist import _cross_device_ops as lib

    calls = []

    class Counting(KernelAllReduce):
        def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
            pairs = list(value_destination_pairs)
            calls.append(len(pairs))
            return super().batch_reduce(reduce_op, pairs, options)

    class Child(Counting):
        pass

    grads = [np.ones(4, np.float32), np.ones(4, np.float32)]
    assert lib.fused_sum_backend(KernelAllReduce(), grads) is not None
    assert lib.fused_sum_backend(cudist.HierarchicalCopyAllReduce(), grads) is not None
    assert lib.fused_sum_backend(Counting(), grads) is None
    assert lib.fused_sum_backend(Child(), grads) is None
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=Counting())
    with s.scope():
        v = cudist.Variable(np.zeros(4, np.float32))
        opt = cudist.optimizers.SGD(0.5)
    s.run(lambda: opt.apply_gradients([(np.ones(4, np.float32), v)]))
    assert calls, "the subclass's batch_reduce was not called"
    np.testing.assert_array_equal(v.numpy(), np.full(4, -1.0, np.float32))


def test_which_algorithms_fuse_the_optimizers_sum():
    """The algorithms whose batch_reduce is the kernels' replica-order sum (the CPU kernel ops and
    the GPU ones, whose batch_reduce never goes through NCCL) offer a fused-sum backend; the others,
    and any subclass with its own reduce, do not; nor do non-arrays or an empty step."""
    from cudist import _cross_device_ops as lib
    from cudist._kernels import cpu_backend

    class OwnReduce(cudist.P2PAllReduce):
        def reduce(self, reduce_op, per_replica_value, destinations, options=None):
            return super().reduce(reduce_op, per_replica_value, destinations, options)

    grads = [np.ones(4, np.float32), np.ones(4, np.float32)]
    for ops in (KernelAllReduce(), cudist.P2PAllReduce(), cudist.NcclAllReduce()):
        assert lib.fused_sum_backend(ops, grads) is cpu_backend(), ops
    for ops in (cudist.ReductionToOneDevice(), OwnReduce()):
        assert lib.fused_sum_backend(ops, grads) is None, ops
    assert lib.fused_sum_backend(KernelAllReduce(), []) is None
    assert lib.fused_sum_backend(KernelAllReduce(), [[1.0], [2.0]]) is None
    assert lib.fused_sum_backend(KernelAllReduce(), [grads[0], np.ones(4, np.complex64)]) is None


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
    out = ops.reduce(ReduceOp.SUM, PerReplica([1.0, 2.0]), Mirrored([Comp("/cpu:2"), Comp("/cpu:3")]))
    assert isinstance(out, Mirrored) and [float(v) for v in out.values] == [3.0, 3.0]
    with pytest.raises(ValueError, match="destinations must not be None"):
        ops.reduce(ReduceOp.SUM, PerReplica([1.0, 2.0]), None)
    with pytest.raises(ValueError, match="invalid device"):
        ops.reduce(ReduceOp.SUM, PerReplica([1.0, 2.0]), "/xpu:0")


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
    spy = KernelPassCounter(monkeypatch)
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(2)
    grads = [[rng.standard_normal(5).astype(np.float32) for _ in range(100)] for _ in range(2)]
    out = s.run(lambda g: cudist.get_replica_context().all_reduce("sum", g), args=(PerReplica(grads),))
    assert spy.batches == [(500, 500)] and spy.calls == [] and spy.to_one == []
    for r in s.experimental_local_results(out):
        for j in range(100):
            np.testing.assert_array_equal(r[j], grads[0][j] + grads[1][j])


LARGE = 1 << 14  # float32 elements of a leaf the pool keeps buffers for (64 KiB)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("large", [5, 1 << 16], ids=["small", "large"])
def test_host_leaves_are_reduced_once_into_a_shared_read_only_result(monkeypatch, n, dtype, op, large):
    spy = KernelPassCounter(monkeypatch)
    s = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    rng = np.random.default_rng(n)
    shapes = [(large + 3,), (97, (large // 97) + 1)]  # odd sizes, two leaves of one dtype

    def rand(shape):
        if np.dtype(dtype).kind == "f":
            return (rng.standard_normal(shape) * 3).astype(dtype)
        return rng.integers(-1000, 1000, shape).astype(dtype)

    grads = [[rand(sh) for sh in shapes] for _ in range(n)]
    out = s.run(lambda g: cudist.get_replica_context().all_reduce(op, g), args=(PerReplica(grads),))
    assert spy.calls == [] and spy.to_one == [] and spy.batches == [tuple(g[0].size + g[1].size for g in grads)]
    results = s.experimental_local_results(out)
    assert len({id(r[0]) for r in results}) == n  # one object per replica, as TF's tensors
    for j in range(2):
        want = ref_sum([g[j] for g in grads])
        if op == "mean":  # TF: a float mean in the dtype (the contract's); an integer sum true-divided in float64
            parts = [g[j] for g in grads]
            want = reference_reduce(parts, ReduceOp.MEAN) if want.dtype.kind == "f" else np.true_divide(want, n)
        for r in results:
            assert not r[j].flags.writeable and np.shares_memory(r[j], results[0][j])
            np.testing.assert_array_equal(r[j], want)
            assert r[j].dtype == want.dtype
            with pytest.raises(ValueError, match="read-only"):
                r[j][0] = 0
    writable = np.array(results[0][0])  # a writable copy
    writable[0] = 0


def test_shared_results_of_held_steps_are_never_overwritten():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(5)
    held = []
    for step in range(12):  # more steps than the pool keeps buffers per size
        grads = [rng.standard_normal(LARGE).astype(np.float32) for _ in range(2)]
        out = s.run(lambda g: cudist.get_replica_context().all_reduce("sum", g), args=(PerReplica(grads),))
        held.append((s.experimental_local_results(out), grads[0] + grads[1]))
    for results, want in held:
        for r in results:
            np.testing.assert_array_equal(r, want)


def test_one_kernel_call_per_dtype_and_pack(monkeypatch):
    spy = KernelPassCounter(monkeypatch)
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    mixed = [np.ones(4, np.float32), np.ones(2, np.int64), np.ones(3, np.float32), np.ones(1, np.int64)]
    s.run(lambda: cudist.get_replica_context().all_reduce("sum", mixed))
    assert sorted(spy.batches) == [(3, 3), (7, 7)]
    spy.batches.clear()
    s2 = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=cudist.HierarchicalCopyAllReduce(num_packs=2))
    s2.run(lambda: cudist.get_replica_context().all_reduce("sum", [np.ones(4, np.float32)] * 10))
    assert len(spy.batches) == 2 and sum(c[0] for c in spy.batches) == 40
    spy.batches.clear()
    s3 = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=KernelAllReduce(num_packs=0))
    s3.run(lambda: cudist.get_replica_context().all_reduce("sum", [np.ones(4, np.float32)] * 10))
    assert len(spy.batches) == 10 and spy.calls == []


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
    # TF 2.21: NcclAllReduce() constructs on a CPU-only machine, reduces to one CPU destination
    # (ReductionToOneDevice's way) and runs a one-device strategy; over two CPU devices its
    # all-reduce raises InvalidArgumentError (cudist: when the strategy is made).
    ops = cls()  # constructing needs no GPU (and imports no CuPy)
    assert float(ops.reduce(ReduceOp.SUM, PerReplica([1.0, 2.0]), "/cpu:0")) == 3.0
    one = cudist.MirroredStrategy(["/cpu:0"], cross_device_ops=ops)
    assert float(one.run(lambda: cudist.get_replica_context().all_reduce("sum", np.float32(2.0)))) == 2.0
    with pytest.raises(cudist.errors.InvalidArgumentError, match=f"{cls.__name__} needs GPU devices, but got '{CPU.format(0)}'"):
        cudist.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)


def test_reduction_to_one_device_arguments():
    r = cudist.ReductionToOneDevice(reduce_to_device="/cpu:1")
    assert r.reduce_to_device == CPU.format(1)
    with pytest.raises(TypeError, match="accumulation_fn must be callable"):
        cudist.ReductionToOneDevice(accumulation_fn=3)
    assert "ReductionToOneDevice" in repr(r)


def test_backends_agree_bitwise_through_the_strategy(select_cpu_backend):
    from cudist._kernels import available_backends

    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    rng = np.random.default_rng(9)
    x = PerReplica([(rng.standard_normal(37) * 3).astype(np.float32) for _ in range(3)])

    def step(v):
        return cudist.get_replica_context().all_reduce("mean", [v, v * 2])

    results = {}
    for name in [b for b in available_backends() if b != "cupy"]:
        select_cpu_backend(name)
        results[name] = s.experimental_local_results(s.run(step, args=(x,)))
    ref = results.pop("numpy")
    for name, res in results.items():
        for r, rr in zip(res, ref):
            for a, b in zip(r, rr):
                assert a.tobytes() == b.tobytes(), name


# ---------------------------------------------------------------------------------------------- GPU device logic
# Everything below runs without a GPU: the GPU count is faked, so the device parsing, the logical ->
# physical mapping, the default op's choice and the error messages are checked on any machine.
GPU = "/job:localhost/replica:0/task:0/device:GPU:{}"


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(k, split={physical: n})``: pretend CuPy sees ``k`` GPUs, some split into logical ones."""
    from cudist import config

    def make(k, split=None):
        monkeypatch.setattr(config, "_gpu_count", lambda: k)
        for p, n in (split or {}).items():
            gpu = config.list_physical_devices("GPU")[p]
            config.set_logical_device_configuration(gpu, [config.LogicalDeviceConfiguration(memory_limit=1024)] * n)

    yield make
    for name in [n for n in config._logical if "GPU" in n]:
        config._logical.pop(name)


@pytest.fixture
def fake_nccl(monkeypatch):
    """``fake_nccl(available)``: what the NCCL probe reports (a stand-in module, or why it is missing)."""
    import types

    from cudist import _cross_device_ops as cdo
    from cudist._dataplane.transports import nccl as nccl_mod

    module = types.SimpleNamespace(
        NCCL_SUM=0, NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8, NCCL_INT32=2, NCCL_INT64=4, available=True
    )

    def make(available=True):
        result = (module, None) if available else (None, "CuPy cannot load the NCCL library (test)")
        monkeypatch.setattr(nccl_mod, "load", lambda: result)
        return module

    return make


@pytest.mark.parametrize("spelling", ["/gpu:1", "GPU:1", "gpu:1", "/device:GPU:1", GPU.format(1)])
def test_gpu_device_spellings_parse(spelling):
    from cudist._devices import canonicalize, parse_device

    assert canonicalize(spelling) == GPU.format(1)
    assert parse_device(spelling).is_gpu and parse_device(spelling).device_index == 1


def test_logical_gpus_map_to_physical(fake_gpus):
    from cudist import config
    from cudist._dataplane.placement import gpu_layout

    fake_gpus(2, split={0: 3})
    assert config.logical_to_physical_gpu() == [0, 0, 0, 1]
    assert [d.name for d in config.list_logical_devices("GPU")] == [f"/device:GPU:{i}" for i in range(4)]
    assert gpu_layout(["/gpu:0", "/gpu:2", "/gpu:3"]) == (0, 0, 1)
    assert gpu_layout(["/cpu:0", "/cpu:1"]) is None
    with pytest.raises(ValueError, match=r"device:GPU:4 does not exist: 4 logical GPU\(s\) are configured"):
        gpu_layout(["/gpu:4"])


def test_memory_limit_is_validated(fake_gpus):
    from cudist import config

    fake_gpus(1)
    gpu = config.list_physical_devices("GPU")[0]
    with pytest.raises(ValueError, match="memory_limit must be a positive number of MiB"):
        config.set_logical_device_configuration(gpu, [config.LogicalDeviceConfiguration(memory_limit=-5)])
    assert config.get_logical_device_configuration(gpu) is None


def test_mirrored_defaults_to_every_logical_gpu(fake_gpus):
    fake_gpus(1, split={0: 4})
    s = cudist.MirroredStrategy()
    assert s.extended.worker_devices == tuple(GPU.format(i) for i in range(4))
    assert s.extended._replica_gpus == (0, 0, 0, 0)
    ops = s.extended._cross_device_ops
    assert type(ops) is cudist.P2PAllReduce
    assert repr(ops) == "<cudist.P2PAllReduce num_packs=1 (default for 4 logical GPUs on 1 physical GPU)>"


def test_default_gpu_ops_choice(fake_gpus, fake_nccl):
    from cudist._cross_device_ops import AutoGpuAllReduce

    fake_gpus(4)
    fake_nccl(available=True)
    ops = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(4)]).extended._cross_device_ops
    assert type(ops) is AutoGpuAllReduce
    assert repr(ops) == (
        "<cudist.AutoGpuAllReduce num_packs=1: P2PAllReduce below 8 MiB per buffer, "
        "NcclAllReduce from there (default for 4 GPUs)>"
    )
    one = cudist.MirroredStrategy(["/gpu:2"]).extended._cross_device_ops
    assert repr(one) == "<cudist.P2PAllReduce num_packs=1 (default for 1 GPU)>"
    fake_nccl(available=False)
    ops = cudist.MirroredStrategy(["/gpu:0", "/gpu:1"]).extended._cross_device_ops
    assert type(ops) is cudist.P2PAllReduce
    assert "default for 2 GPUs; NCCL unavailable: CuPy cannot load the NCCL library" in repr(ops)


def test_default_gpu_ops_with_split_and_whole_gpus(fake_gpus, fake_nccl):
    fake_gpus(2, split={0: 2, 1: 2})
    fake_nccl(available=True)
    ops = cudist.MirroredStrategy().extended._cross_device_ops
    assert repr(ops) == "<cudist.P2PAllReduce num_packs=1 (default for 4 logical GPUs on 2 physical GPUs)>"


def test_mixed_cpu_and_gpu_devices_are_refused(fake_gpus):
    fake_gpus(1)
    with pytest.raises(ValueError, match=r"cannot mix CPU and GPU devices in one strategy: got '.*CPU:0' and '.*GPU:0'"):
        cudist.MirroredStrategy(["/cpu:0", "/gpu:0"])
    with pytest.raises(ValueError, match="NcclAllReduce needs GPU devices, but got '.*CPU:0'"):
        cudist.MirroredStrategy(["/gpu:0", "/cpu:0"], cross_device_ops=cudist.NcclAllReduce())


def test_missing_gpu_is_a_clear_error(fake_gpus):
    fake_gpus(0)
    # The reason is the probe's own (here: no GPU, or CuPy not installed), with what to do.
    with pytest.raises(ValueError, match=r"GPU:0 does not exist: 0 logical GPU\(s\) are configured \((no GPU is visible through CuPy|CuPy is not installed .*pip install)"):
        cudist.MirroredStrategy(["/gpu:0", "/gpu:1"])
    with pytest.raises(ValueError, match="does not exist"):
        cudist.OneDeviceStrategy("/gpu:0")


def test_nccl_on_logical_gpus_falls_back_to_p2p_and_says_so(fake_gpus, fake_nccl):
    fake_gpus(1, split={0: 2})
    fake_nccl(available=True)
    ops = cudist.NcclAllReduce()
    with pytest.warns(UserWarning, match="logical GPUs on one physical GPU cannot share an NCCL communicator"):
        s = cudist.MirroredStrategy(["/gpu:0", "/gpu:1"], cross_device_ops=ops)
    assert s.extended._cross_device_ops is ops
    assert repr(ops) == (
        "<cudist.NcclAllReduce num_packs=1 (falls back to P2P: 2 logical GPUs on 1 physical GPU; "
        "logical GPUs on one physical GPU cannot share an NCCL communicator)>"
    )


def test_nccl_unavailable_is_a_clear_error(fake_gpus, fake_nccl):
    from cudist._kernels import BackendUnavailableError

    fake_gpus(2)
    fake_nccl(available=False)
    with pytest.raises(BackendUnavailableError, match="NcclAllReduce cannot run: CuPy cannot load the NCCL library.*P2PAllReduce"):
        cudist.MirroredStrategy(["/gpu:0", "/gpu:1"], cross_device_ops=cudist.NcclAllReduce())
    fake_nccl(available=True)
    ops = cudist.NcclAllReduce(num_packs=2)
    cudist.MirroredStrategy(["/gpu:0", "/gpu:1"], cross_device_ops=ops)
    assert repr(ops) == "<cudist.NcclAllReduce num_packs=2>"


class _FakeDev:
    def __init__(self, i):
        self.id = i


class _FakeBuf:
    """Just enough of a CuPy array for the NCCL-or-P2P decision (which never touches the data)."""

    __cuda_array_interface__ = {}

    def __init__(self, nbytes, device, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.nbytes = nbytes
        self.size = nbytes // self.dtype.itemsize
        self.device = _FakeDev(device)


def test_auto_op_picks_nccl_by_size_and_layout(monkeypatch, fake_nccl):
    from cudist import _cross_device_ops as cdo
    from cudist._dataplane.transports import nccl as nccl_mod

    nccl = fake_nccl(available=True)
    calls = []
    monkeypatch.setattr(nccl_mod, "all_reduce", lambda mod, bufs, op: calls.append(("nccl", mod, bufs[0].nbytes)))

    class Backend:
        def all_reduce(self, bufs, op):
            calls.append(("p2p", None, bufs[0].nbytes))

    ops = cdo.AutoGpuAllReduce((0, 1), nccl)
    big, small = ops.NCCL_MIN_BYTES, ops.NCCL_MIN_BYTES - 4
    reduce = ops._reducer([[_FakeBuf(small, 0)], [_FakeBuf(small, 1)]])
    reduce(Backend(), [_FakeBuf(small, 0), _FakeBuf(small, 1)], cudist.ReduceOp.SUM)
    reduce(Backend(), [_FakeBuf(big, 0), _FakeBuf(big, 1)], cudist.ReduceOp.SUM)
    reduce(Backend(), [_FakeBuf(big, 0), _FakeBuf(big, 0)], cudist.ReduceOp.SUM)  # one GPU: no NCCL ranks
    reduce(Backend(), [_FakeBuf(big, 0, np.int8), _FakeBuf(big, 1, np.int8)], cudist.ReduceOp.SUM)
    assert calls == [("p2p", None, small), ("nccl", nccl, big), ("p2p", None, big), ("p2p", None, big)]


def test_nccl_op_uses_nccl_only_for_distinct_gpus(monkeypatch, fake_nccl):
    from cudist import _cross_device_ops as cdo
    from cudist._dataplane.transports import nccl as nccl_mod

    fake_nccl(available=True)
    ops = cudist.NcclAllReduce()
    assert ops._reducer([[_FakeBuf(8, 0)], [_FakeBuf(8, 0)]]) is None  # logical GPUs: the P2P kernels
    calls = []
    monkeypatch.setattr(nccl_mod, "all_reduce", lambda mod, bufs, op: calls.append(op))
    ops._reducer([[_FakeBuf(8, 0)], [_FakeBuf(8, 1)]])(None, [_FakeBuf(8, 0), _FakeBuf(8, 1)], cudist.ReduceOp.MEAN)
    assert calls == [cudist.ReduceOp.MEAN]
    # Host values under a GPU op (a Python loss next to GPU gradients) are reduced on the host.
    assert ops._reducer([[1.0], [2.0]]) is None
    out = ops._all_reduce_leaves(cudist.ReduceOp.SUM, [[np.float32(1.5), np.arange(3.0)], [np.float32(2.0), np.ones(3)]])
    assert calls == [cudist.ReduceOp.MEAN]
    for r in range(2):
        assert out[r][0] == np.float32(3.5) and out[r][0].dtype == np.float32
        np.testing.assert_array_equal(out[r][1], [1.0, 2.0, 3.0])


def test_gpu_replicas_run_with_their_gpu_current(monkeypatch, fake_gpus):
    """Each replica starts, and resumes after every collective, with its physical GPU current; the
    caller's current GPU is restored. CuPy's runtime is replaced by a recorder (no GPU needed)."""
    import sys
    import types

    fake_gpus(2, split={0: 2})
    current = [1]
    runtime = types.SimpleNamespace(getDevice=lambda: current[0], setDevice=lambda d: current.__setitem__(0, d))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    s = cudist.MirroredStrategy(["/gpu:0", "/gpu:1", "/gpu:2"])  # physical GPUs 0, 0, 1
    seen = []

    def step():
        ctx = cudist.get_replica_context()
        seen.append((ctx.replica_id_in_sync_group, "start", current[0]))
        total = ctx.all_reduce("sum", 1.0)  # host values: reduced on the host, no CuPy needed
        seen.append((ctx.replica_id_in_sync_group, "after", current[0]))
        ctx.merge_call(lambda strategy: None)
        seen.append((ctx.replica_id_in_sync_group, "merged", current[0]))
        return total

    out = s.run(step)
    assert s.experimental_local_results(out) == (3.0, 3.0, 3.0)
    want = {0: 0, 1: 0, 2: 1}
    assert len(seen) == 9 and all(dev == want[r] for r, _, dev in seen)
    assert current[0] == 1
    one = cudist.OneDeviceStrategy("/gpu:2")
    assert one.run(lambda: current[0]) == 1 and current[0] == 1
    current[0] = 0
    assert one.run(lambda: current[0]) == 1 and current[0] == 0


# ----------------------------------------------------------------------------- one reduction path
class SpyOps(KernelAllReduce):
    """A user's cross-device ops that records every reduction it is asked for."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        self.calls.append(("reduce", ReduceOp.parse(reduce_op)))
        return super().reduce(reduce_op, per_replica_value, destinations, options)

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        pairs = list(value_destination_pairs)
        self.calls.append(("batch_reduce", ReduceOp.parse(reduce_op), len(pairs)))
        return super().batch_reduce(reduce_op, pairs, options)


def _aggregating_updates(s):
    """Replica-context updates that must aggregate (SUM, MEAN) and a sync-on-read read; returns the values."""
    VA, VS = cudist.VariableAggregation, cudist.VariableSynchronization
    with s.scope():
        total = cudist.Variable(np.zeros(3, np.float32), aggregation=VA.SUM)
        mean = cudist.Variable(np.zeros(3, np.float32), aggregation=VA.MEAN)

    def step():
        r = cudist.get_replica_context().replica_id_in_sync_group
        total.assign_add(np.full(3, r + 1, np.float32))
        mean.assign(np.full(3, 2.0 * (r + 1), np.float32))

    s.run(step)
    return total, mean


def test_user_cross_device_ops_do_variable_aggregation():
    """MirroredStrategy(cross_device_ops=...): variables aggregate through the user's ops (as in TF)."""
    ops = SpyOps()
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"], cross_device_ops=ops)
    total, mean = _aggregating_updates(s)
    assert ("reduce", ReduceOp.SUM) in ops.calls and ("reduce", ReduceOp.MEAN) in ops.calls
    np.testing.assert_array_equal(total.numpy(), np.full(3, 6, np.float32))
    np.testing.assert_array_equal(mean.numpy(), np.full(3, 4, np.float32))
    with s.scope():
        counter = cudist.Variable(
            np.zeros(2, np.float32), synchronization=cudist.VariableSynchronization.ON_READ,
            aggregation=cudist.VariableAggregation.SUM,
        )
    s.run(lambda: counter.assign_add(np.ones(2, np.float32)))
    ops.calls.clear()
    np.testing.assert_array_equal(counter.read_value(), [3.0, 3.0])  # a cross-replica read aggregates
    assert ops.calls == [("reduce", ReduceOp.SUM)]


@pytest.mark.parametrize("make", [
    lambda: cudist.MirroredStrategy(["/cpu:0", "/cpu:1"]),
    lambda: cudist.CentralStorageStrategy(["/cpu:0", "/cpu:1"]),
    lambda: cudist.OneDeviceStrategy("/cpu:0"),
], ids=["mirrored", "central", "one_device"])
def test_every_strategy_aggregates_variables_through_reduce_to(monkeypatch, make):
    s = make()
    spy = SpyOps()
    monkeypatch.setattr(s.extended, "_cross_device_ops", spy)
    seen = []
    real = type(s.extended).reduce_to

    def reduce_to(self, op, value, destinations, options=None):
        seen.append(ReduceOp.parse(op))
        return real(self, op, value, destinations, options)

    monkeypatch.setattr(type(s.extended), "reduce_to", reduce_to)
    total, mean = _aggregating_updates(s)
    n = s.num_replicas_in_sync
    np.testing.assert_array_equal(total.numpy(), np.full(3, n * (n + 1) / 2, np.float32))
    np.testing.assert_array_equal(mean.numpy(), np.full(3, n + 1, np.float32))
    if n > 1:
        assert ReduceOp.SUM in seen and ReduceOp.MEAN in seen
        assert [c[:2] for c in spy.calls] == [("reduce", op) for op in seen]


@pytest.mark.parametrize("leaves", [1, 7])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_native_checked_calls_and_the_python_path_give_the_same_results(monkeypatch, leaves, dtype, op):
    """The native backend's reduce_to_one_shared / batch_reduce_to_one_shared (one call that checks,
    reduces and makes the views) against the Python path they shortcut (the other backends'): same
    values bit for bit, same shapes and dtypes, read-only, one object per replica."""
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    rng = np.random.default_rng(leaves)
    shapes = [(LARGE + 3,), (5, 7), (), (1,), (3, 4, 2), (LARGE // 2,), (9,)][:leaves]

    def rand(shape):
        if np.dtype(dtype).kind == "f":
            return np.asarray(rng.standard_normal(shape) * 3).astype(dtype)
        return np.asarray(rng.integers(-1000, 1000, shape)).astype(dtype)

    grads = [[rand(sh) for sh in shapes] for _ in range(3)]
    arg = PerReplica([g[0] for g in grads]) if leaves == 1 else PerReplica(grads)

    def run():
        out = s.run(lambda g: cudist.get_replica_context().all_reduce(op, g), args=(arg,))
        res = s.experimental_local_results(out)
        return [[r] for r in res] if leaves == 1 else [list(r) for r in res]

    native = run()
    trusted = _cpu_backend().trusted
    monkeypatch.setattr(trusted, "reduce_to_one_shared", None)
    monkeypatch.setattr(trusted, "batch_reduce_to_one_shared", None)
    python = run()
    for rn, rp in zip(native, python):
        for a, b in zip(rn, rp):
            assert type(a) is type(b) and np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            if isinstance(a, np.ndarray):
                assert not a.flags.writeable
    for j in range(leaves):
        objs = [row[j] for row in native]
        assert len({id(o) for o in objs}) == 3


@pytest.mark.parametrize(
    "version, has_constant, want",
    [(21000, True, True), (22105, True, True), (20912, True, False), (22105, False, False)],
    ids=["2.10.0", "2.21.5", "2.9.12", "no-constant"],
)
def test_nccl_carries_bfloat16_across_workers_only_where_nccl_has_it(version, has_constant, want):
    """ncclBfloat16 (9) is used from NCCL 2.10 and only by the cross-worker communicator; the
    in-process ops (NcclAllReduce, AutoGpuAllReduce) keep bfloat16 on the kernels, which sum in
    float32 and round once where NCCL would round after every addition."""
    import types

    ml_dtypes = pytest.importorskip("ml_dtypes")
    from cudist._dataplane.transports import nccl as nccl_mod

    module = types.SimpleNamespace(
        NCCL_SUM=0, NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8, NCCL_INT32=2, NCCL_INT64=4, available=True,
        get_version=lambda: version,
    )
    if has_constant:
        module.NCCL_BFLOAT16 = 9
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert bf16 not in nccl_mod.dtype_codes(module)  # in-process: never
    codes = nccl_mod.dtype_codes(module, bfloat16=True)
    assert (codes.get(bf16) == 9) is want
    assert nccl_mod.bfloat16_code(module) == (9 if want else None)
    assert (bf16 in nccl_mod.WorkerCommunicator(module, None).dtypes) is want
    assert codes[np.dtype(np.float32)] == 7  # the others unchanged
