"""Mixed precision through the GPU optimizer path (issue #28, item 2): ``Optimizer.apply_gradients``
under a MirroredStrategy over logical GPUs takes bfloat16 / float16 gradients of float32 variables
straight into the fused all-reduce + update (the CuPy backend's ``<float, G>`` kernels widen them
while they sum in replica order: no float32 copy of the gradients, no reduction first).

The contract: step by step the bits of the CPU backends' mixed path (their fused pass widens the
gradients too), weights and every slot, for SGD, SGD with momentum, Adam, RMSprop (and its
centered + momentum variant: the optional slots' row) and decoupled weight decay; 2 and 4 replicas,
odd sizes. Across physical GPUs (2 and 4) the pass is one launch per variable and GPU, each GPU
reading every replica's gradient over peer access (narrow and float32 gradients): the same bits.
What cannot fuse (a pair of GPUs without peer access, cross-device ops that reduce their own way)
takes the general path with the same bits. Marker ``gpu``: on a GPU, and on the CPU under the
fake CuPy (tests/test_gpu_emulated.py) in every emulation mode.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from conftest import gpu0_split

import cudist

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs the optional ml_dtypes package")

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
NARROW = [BF16, np.dtype(np.float16)]
SIZES = (1031, (7, 3))  # odd sizes: a partial vector at the end, a 2-d variable
STEPS = 3

OPTIMIZERS = {
    "sgd": lambda: cudist.optimizers.SGD(0.01),
    "sgd_momentum": lambda: cudist.optimizers.SGD(0.01, momentum=0.9, nesterov=True),
    "adam": lambda: cudist.optimizers.Adam(0.003),
    "rmsprop": lambda: cudist.optimizers.RMSprop(0.003),
    # The optional slots' row: momentum and the average gradient (rmsprop_momentum_average_gradient).
    "rmsprop_centered_momentum": lambda: cudist.optimizers.RMSprop(0.003, momentum=0.5, centered=True),
    # Decoupled weight decay: in the kernel (AdamW) and as a pass of its own (SGD's plain rule).
    "adamw": lambda: cudist.optimizers.AdamW(0.003, weight_decay=0.04),
    "sgd_weight_decay": lambda: cudist.optimizers.SGD(0.01, momentum=0.9, weight_decay=0.04),
}


def _rng(*key):
    return np.random.default_rng(zlib.crc32("/".join(map(str, key)).encode()))


def _grads(gdtype, n, key):
    """Per step, per replica, per variable: mixed magnitudes (a sum rounded to the narrow type, or
    added in it, would give other bits), never zeros."""
    rng = _rng("grads", gdtype, n, key)
    return [
        [[(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3, s)).astype(gdtype) for s in SIZES] for _ in range(n)]
        for _ in range(STEPS)
    ]


def _train(devices, to_device, make, steps, *, cross_device_ops=None, wrap=None, vdtype=np.float32):
    """Trains two variables (of ``vdtype``) from ``steps``; returns per step (weights of every
    replica, every slot variable's value)."""
    strategy = cudist.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    rng = _rng("init")
    init = [rng.standard_normal(s).astype(vdtype) for s in SIZES]
    with strategy.scope():
        ws = [cudist.Variable(x, name=f"w{i}") for i, x in enumerate(init)]
        opt = make()
        if wrap is not None:
            opt = wrap(opt)
    history = []
    for grads in steps:
        def step(grads=grads):
            g = grads[cudist.get_replica_context().replica_id_in_sync_group]
            opt.apply_gradients([(to_device(x), w) for x, w in zip(g, ws)])

        strategy.run(step)
        weights = [[np.asarray(_host(c)) for c in strategy.experimental_local_results(w)] for w in ws]
        history.append((weights, [np.asarray(_host(v.numpy())) for v in opt.variables]))
    return history


def _host(a):
    import cupy

    return cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a


def _assert_same(got, want, vdtype=np.float32):
    assert len(got) == len(want)
    for s, ((gw, gs), (ww, ws)) in enumerate(zip(got, want)):
        for v, (copies, ref) in enumerate(zip(gw, ww)):
            for r, c in enumerate(copies):
                assert c.dtype == vdtype, (s, v, r)
                assert c.tobytes() == ref[0].tobytes(), f"step {s}: variable {v}, replica {r} differs from the CPU path"
        assert len(gs) == len(ws)
        for j, (a, b) in enumerate(zip(gs, ws)):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"step {s}: optimizer variable {j} differs"


@pytest.fixture
def launches(monkeypatch):
    """Records every NVRTC-path launch of the CuPy backend: (kernel, dtype, the gradients' dtype
    of a mixed launch or None), and the fused update passes run on GPU arrays."""
    import cudist._kernels._cupy as cupy_mod
    from cudist._dataplane import update

    out = {"kernels": [], "devices": [], "fused": 0}
    real = cupy_mod.CupyBackend._launch

    def spy(self, device, kernel, dtype, count, args, **kw):
        out["kernels"].append((kernel, np.dtype(dtype), kw.get("grad_dtype")))
        out["devices"].append(device)
        return real(self, device, kernel, dtype, count, args, **kw)

    real_gpu = update._apply_fused_on_gpu

    def spy_gpu(*args, **kw):
        out["fused"] += 1
        return real_gpu(*args, **kw)

    monkeypatch.setattr(cupy_mod.CupyBackend, "_launch", spy)
    monkeypatch.setattr(update, "_apply_fused_on_gpu", spy_gpu)
    return out


@pytest.mark.parametrize("gdtype", NARROW, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("n", [2, 4])
def test_narrow_gradients_fuse_on_logical_gpus_as_on_the_cpu(n, opt_name, gdtype, launches):
    """n logical GPUs on GPU 0: each step is one fused launch per variable reading the 16-bit
    gradients (the kernel's mixed instantiation; nothing reduced first, no float32 copy), and gives
    the CPU mixed path's bits step by step."""
    import cupy

    steps = _grads(gdtype, n, opt_name)
    make = OPTIMIZERS[opt_name]
    with gpu0_split(n, memory_limit=1024):
        got = _train([f"/gpu:{i}" for i in range(n)], cupy.asarray, make, steps)
    want = _train([f"/cpu:{i}" for i in range(n)], lambda g: g, make, steps)
    _assert_same(got, want)
    assert launches["fused"] == STEPS  # every step through the fused pass on the GPU
    fused = [(k, dt, g) for k, dt, g in launches["kernels"] if k.startswith("mirrored_all_reduce_")]
    # One launch per variable and step, each reading the narrow gradients as they are.
    assert len(fused) == STEPS * len(SIZES), launches["kernels"]
    assert all(dt == np.float32 and g == gdtype for _, dt, g in fused), fused
    # No reduction before the update (the general path's reduce_to_one / all-reduce kernels).
    assert not [k for k, _, _ in launches["kernels"] if "reduce" in k and not k.startswith("mirrored_all_reduce_")]
    # The test can fail: the float32 weights keep more than the narrow type holds.
    w = got[-1][0][0][0]
    assert not np.array_equal(w, w.astype(gdtype).astype(np.float32))


def test_no_float32_copy_of_the_gradients(launches, monkeypatch):
    """The narrow gradients reach the kernel uncast: no astype of a GPU array to float32 during
    apply_gradients (the general path casts every replica's gradient first)."""
    import cupy

    n = 2
    casts = []
    real = cupy.ndarray.astype

    def astype(self, dtype, *args, **kw):
        if np.dtype(dtype) == np.float32 and self.dtype == BF16:
            casts.append(self.shape)
        return real(self, dtype, *args, **kw)

    steps = _grads(BF16, n, "no_copy")
    with gpu0_split(n, memory_limit=1024):
        monkeypatch.setattr(cupy.ndarray, "astype", astype)
        _train([f"/gpu:{i}" for i in range(n)], cupy.asarray, OPTIMIZERS["adam"], steps)
    assert launches["fused"] == STEPS
    assert casts == []


def test_the_general_path_casts_where_the_pass_cannot_fuse(launches):
    """Cross-device ops that reduce their own way (a subclass with its own batch_reduce) keep the
    general path: the gradients cast to float32, reduced, then updated -- the same bits."""
    import cupy

    class OwnReduce(cudist.P2PAllReduce):
        def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
            return super().batch_reduce(reduce_op, value_destination_pairs, options)

    n = 2
    steps = _grads(BF16, n, "general")
    make = OPTIMIZERS["sgd_momentum"]
    with gpu0_split(n, memory_limit=1024):
        got = _train([f"/gpu:{i}" for i in range(n)], cupy.asarray, make, steps, cross_device_ops=OwnReduce())
    want = _train([f"/cpu:{i}" for i in range(n)], lambda g: g, make, steps)
    _assert_same(got, want)
    assert launches["fused"] == 0
    assert not [g for _, _, g in launches["kernels"] if g is not None]  # no mixed launch: cast first


def _physical_gpus_or_skip(k):
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < k:
        pytest.skip(f"needs {k} GPUs")  # (never under the fake: it emulates 4)


def _all_peers(k):
    """Whether every pair of GPUs 0..k-1 has peer access (the fake's CUDIST_EMU_PEER decides)."""
    import cupy

    rt = cupy.cuda.runtime
    return all(rt.deviceCanAccessPeer(i, j) for i in range(k) for j in range(k) if i != j)


def _check_fused_per_gpu(launches, k, gdtype, steps):
    """One fused launch per (variable, GPU) each step, on that GPU, reading gradients of gdtype as
    they are; nothing reduced first."""
    fused = [(kern, dt, g, d) for (kern, dt, g), d in zip(launches["kernels"], launches["devices"])
             if kern.startswith("mirrored_all_reduce_")]  # fmt: skip
    assert len(fused) == steps * len(SIZES) * k, launches["kernels"]
    assert sorted(d for *_, d in fused) == sorted(list(range(k)) * steps * len(SIZES))
    want_g = None if gdtype == np.float32 else gdtype
    assert all(dt == np.float32 and g == want_g for _, dt, g, _ in fused), fused
    assert not [kern for kern, _, _ in launches["kernels"] if "reduce" in kern and not kern.startswith("mirrored_all_reduce_")]


GDTYPES = [*NARROW, np.dtype(np.float32)]


@pytest.mark.multi_gpu
@pytest.mark.parametrize("gdtype", GDTYPES, ids=["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("k", [2, 4])
def test_copies_on_several_physical_gpus_fuse_per_gpu_as_on_the_cpu(k, opt_name, gdtype, launches):
    """One replica per physical GPU: with peer access between every pair, each step is one fused
    launch per variable on each GPU (its kernel sums every replica's gradient in replica order over
    peer access and updates that GPU's copies), and gives the CPU mixed path's bits step by step.
    Without peer access (CUDIST_EMU_PEER=none under the fake) the general path runs instead (cast,
    reduce first, then update per GPU): the same bits."""
    import cupy

    _physical_gpus_or_skip(k)
    steps = _grads(gdtype, k, opt_name)
    make = OPTIMIZERS[opt_name]
    got = _train([f"/gpu:{i}" for i in range(k)], cupy.asarray, make, steps)
    want = _train([f"/cpu:{i}" for i in range(k)], lambda g: g, make, steps)
    _assert_same(got, want)
    if _all_peers(k):
        assert launches["fused"] == STEPS
        _check_fused_per_gpu(launches, k, gdtype, STEPS)
    else:
        assert launches["fused"] == 0
        assert not [g for _, _, g in launches["kernels"] if g is not None]  # no mixed launch: cast first
    if gdtype != np.float32:  # the test can fail: the weights keep more than the narrow type holds
        w = got[-1][0][0][0]
        assert not np.array_equal(w, w.astype(gdtype).astype(np.float32))


@pytest.mark.multi_gpu
@pytest.mark.parametrize("k", [2, 4])
def test_across_physical_gpus_no_float32_copy_of_the_gradients(k, launches, monkeypatch):
    """Across GPUs with peer access the narrow gradients reach every GPU's kernel uncast; without
    it, the general path casts each replica's gradient (on its own GPU)."""
    import cupy

    _physical_gpus_or_skip(k)
    casts = []
    real = cupy.ndarray.astype

    def astype(self, dtype, *args, **kw):
        if np.dtype(dtype) == np.float32 and self.dtype == BF16:
            casts.append(self.device.id)
        return real(self, dtype, *args, **kw)

    steps = _grads(BF16, k, "no_copy_physical")
    monkeypatch.setattr(cupy.ndarray, "astype", astype)
    _train([f"/gpu:{i}" for i in range(k)], cupy.asarray, OPTIMIZERS["adam"], steps)
    if _all_peers(k):
        assert launches["fused"] == STEPS
        assert casts == []
    else:
        assert launches["fused"] == 0
        assert sorted(casts) == sorted(list(range(k)) * STEPS * len(SIZES))


@pytest.mark.multi_gpu
def test_a_pair_without_peer_access_keeps_the_general_path(launches, monkeypatch):
    """Peer access between GPUs 0 and 1 only (2 and 3 cannot reach them): 4 replicas take the
    general path, 2 replicas on GPUs 0 and 1 fuse (when the fake or the machine gives that pair
    peer access): the same bits either way."""
    import cupy

    import cudist._kernels._cupy as cupy_mod

    _physical_gpus_or_skip(4)
    real = cupy_mod.CupyBackend._peer_ok

    def peer_ok(self, device, peer):
        if {device, peer} & {2, 3} and device != peer:
            return False
        return real(self, device, peer)

    monkeypatch.setattr(cupy_mod.CupyBackend, "_peer_ok", peer_ok)
    make = OPTIMIZERS["rmsprop_centered_momentum"]
    for k in (4, 2):
        launches["fused"] = 0
        steps = _grads(np.float16, k, "pair")
        got = _train([f"/gpu:{i}" for i in range(k)], cupy.asarray, make, steps)
        want = _train([f"/cpu:{i}" for i in range(k)], lambda g: g, make, steps)
        _assert_same(got, want)
        if k == 4:
            assert launches["fused"] == 0
        else:
            assert launches["fused"] == (STEPS if _all_peers(2) else 0)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("k", [2, 4])
def test_loss_scale_optimizer_on_physical_gpus(k, launches):
    """LossScaleOptimizer over bfloat16 gradients, one replica per physical GPU, an inf at step 1:
    the CPU's skips, scales and bits; the finite steps' unscaled float32 gradients take the fused
    pass across the GPUs where every pair has peer access."""
    import cupy

    _physical_gpus_or_skip(k)
    steps = _grads(BF16, k, "lso_physical")
    steps[1][k - 1][1][0, 2] = np.inf

    def wrap(opt):
        return cudist.optimizers.LossScaleOptimizer(opt, initial_scale=2.0**4, dynamic_growth_steps=1)

    make = OPTIMIZERS["adam"]
    got = _train([f"/gpu:{i}" for i in range(k)], cupy.asarray, make, steps, wrap=wrap)
    want = _train([f"/cpu:{i}" for i in range(k)], lambda g: g, make, steps, wrap=wrap)
    _assert_same(got, want)
    assert np.array_equal(got[1][0][0][0], got[0][0][0][0]) and not np.array_equal(got[2][0][0][0], got[1][0][0][0])
    _check_loss_scale_launches(launches, len(steps), BF16, fused=_all_peers(k))


@pytest.mark.parametrize("n", [2, 4])
def test_loss_scale_optimizer_on_logical_gpus(n, launches):
    """LossScaleOptimizer over bfloat16 gradients on logical GPUs, an inf in one replica's gradient
    at step 1 and a NaN at step 3: the same skips, scales and bits as on the CPU (where the
    finiteness check is fused into the all-reduce); on the GPU the check runs per replica, and the
    finite steps' float32 (unscaled) gradients go through the fused pass."""
    import cupy

    steps = _grads(BF16, n, "lso") + _grads(BF16, n, "lso2")
    steps[1][n - 1][0][5] = np.inf
    steps[3][0][1][2, 1] = np.nan

    def wrap(opt):
        return cudist.optimizers.LossScaleOptimizer(opt, initial_scale=2.0**4, dynamic_growth_steps=2)

    make = OPTIMIZERS["sgd_momentum"]
    with gpu0_split(n, memory_limit=1024):
        got = _train([f"/gpu:{i}" for i in range(n)], cupy.asarray, make, steps, wrap=wrap)
        # scale_loss of a GPU loss: on its GPU, in its dtype (a new wrapper: the scale is 2**4).
        strategy = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
        with strategy.scope():
            lso = wrap(make())
        for dt in (np.float32, BF16):
            scaled = lso.scale_loss(cupy.asarray(np.array(2.5, dt)))
            assert isinstance(scaled, cupy.ndarray) and scaled.dtype == dt
            assert float(cupy.asnumpy(scaled).astype(np.float32)) == 40.0
    want = _train([f"/cpu:{i}" for i in range(n)], lambda g: g, make, steps, wrap=wrap)
    _assert_same(got, want)
    # The test can fail: steps 1 and 3 were skipped (the weights did not move), the others were not.
    moved = [not np.array_equal(got[s][0][0][0], got[s - 1][0][0][0]) for s in range(1, len(steps))]
    assert moved == [False, True, False, True, True]
    _check_loss_scale_launches(launches, len(steps), BF16, fused=True)


def _check_loss_scale_launches(launches, steps, gdtype, *, fused):
    """LossScaleOptimizer's steps on GPUs: with ``fused``, every step (skipped ones too: the flag is
    read after every variable's launch) one ``reduce_unscale_finite`` launch per variable on GPU 0
    (the first copy's), reading the gradients as they are (``gdtype``: the mixed launch's gradient
    dtype, None for the variables' own); the updates then take the plain path (one gradient: the
    unscaled sum). Without ``fused``, none (the per-replica check)."""
    unscale = [(g, d) for (kern, _, g), d in zip(launches["kernels"], launches["devices"])
               if kern == "reduce_unscale_finite"]  # fmt: skip
    if fused:
        assert len(unscale) == steps * len(SIZES), launches["kernels"]
        assert all(g == gdtype and d == 0 for g, d in unscale), unscale
        assert launches["fused"] == 0  # (the fused update pass is the non-scaled optimizers')
    else:
        assert unscale == []


@pytest.mark.parametrize("physical", [False, pytest.param(True, marks=pytest.mark.multi_gpu)], ids=["logical", "physical"])
def test_gradients_sharing_memory_with_what_the_pass_writes_are_read_as_before_the_step(physical, launches):
    """A replica's gradient that is another variable's copy (the pass writes it before the kernel of
    the second variable reads it) or its own variable's copy, or a non-contiguous view: the update
    reads the values from before the step, as from fresh copies of the gradients. On two physical
    GPUs a GPU's launch reads the other GPU's copies too (they are every replica's gradients)."""
    import contextlib

    import cupy

    n = 2
    if physical:
        _physical_gpus_or_skip(n)
    rng = _rng("alias")
    init = [rng.standard_normal(37).astype(np.float32) for _ in range(3)]
    wide = rng.standard_normal(74).astype(np.float32)

    def train(fresh):
        with contextlib.nullcontext() if physical else gpu0_split(n, memory_limit=1024):
            strategy = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(n)])
            with strategy.scope():
                ws = [cudist.Variable(x, name=f"w{i}") for i, x in enumerate(init)]
                opt = cudist.optimizers.SGD(0.25, momentum=0.5)
            for _ in range(2):
                def step():
                    r = cudist.get_replica_context().replica_id_in_sync_group
                    grads = [
                        cupy.asarray(wide[r:][:37]) * 0.5,
                        ws[0].storage.buffers()[r],  # written by the first variable's launch
                        ws[2].storage.buffers()[r][::-1],  # its own copy, reversed: a view
                    ]
                    if fresh:
                        grads = [cupy.ascontiguousarray(g).copy() for g in grads]
                    opt.apply_gradients(list(zip(grads, ws)))

                strategy.run(step)
            return [[cupy.asnumpy(b) for b in w.storage.buffers()] for w in ws]

    got = train(fresh=False)
    assert launches["fused"] == (2 if not physical or _all_peers(n) else 0)
    want = train(fresh=True)
    for v, (g, w) in enumerate(zip(got, want)):
        for r in range(n):
            assert g[r].tobytes() == w[r].tobytes(), f"variable {v}, replica {r}"


LSO_OPTIMIZERS = ["sgd_momentum", "adam", "rmsprop_centered_momentum", "adamw"]


@pytest.mark.parametrize(
    "vdtype,gdtype",
    [(np.float32, BF16), (np.float32, np.float16), (np.float32, np.float32), (np.float16, np.float16), (BF16, BF16)],
    ids=["bf16->f32", "f16->f32", "f32", "f16", "bf16"],
)
@pytest.mark.parametrize("opt_name", LSO_OPTIMIZERS)
@pytest.mark.parametrize("n", [2, 4, 10])  # 10: more gradients than one launch reads
def test_loss_scale_optimizer_check_is_fused_into_the_gpu_reduction(n, opt_name, vdtype, gdtype, launches, monkeypatch):
    """LossScaleOptimizer on logical GPUs: an inf at step 1, a NaN at step 3, finite steps between
    and after (the scale grows after 2): step by step the CPU fused path's bits (weights, slots,
    scale, counters). Each step is one reduce_unscale_finite launch per variable (the finiteness
    check in the reduction's pass), no per-replica isfinite sweep, and ONE device-to-host read of
    the flags per step, whatever the number of variables and replicas. (bfloat16 variables have no
    fused kernels: the per-replica check, the same bits.)"""
    import cupy

    from cudist import optimizers
    from cudist._dataplane import update

    vdtype, gdtype = np.dtype(vdtype), np.dtype(gdtype)
    steps = _grads(gdtype, n, f"lso_fused/{opt_name}") + _grads(gdtype, n, f"lso_fused2/{opt_name}")
    steps[1][n - 1][0][5] = np.inf
    steps[3][0][1][2, 1] = np.nan

    def wrap(opt):
        return cudist.optimizers.LossScaleOptimizer(opt, initial_scale=2.0**4, dynamic_growth_steps=2)

    sweeps, reads = [], []
    real_finite, real_to_host = optimizers._all_finite, update.to_host
    monkeypatch.setattr(optimizers, "_all_finite", lambda g: (sweeps.append(1), real_finite(g))[1])
    monkeypatch.setattr(update, "to_host", lambda a: (reads.append(type(a)), real_to_host(a))[1])
    make = OPTIMIZERS[opt_name]
    with gpu0_split(n, memory_limit=512):
        got = _train([f"/gpu:{i}" for i in range(n)], cupy.asarray, make, steps, wrap=wrap, vdtype=vdtype)
    gpu_reads, gpu_sweeps = list(reads), list(sweeps)
    cpu = cudist.config.list_physical_devices("CPU")[0]
    cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * max(n, 4))
    try:
        want = _train([f"/cpu:{i}" for i in range(n)], lambda g: g, make, steps, wrap=wrap, vdtype=vdtype)
    finally:  # (conftest's four)
        cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * 4)
    _assert_same(got, want, vdtype)
    moved = [not np.array_equal(got[s][0][0][0], got[s - 1][0][0][0]) for s in range(1, len(steps))]
    assert moved == [False, True, False, True, True]
    if vdtype == BF16:  # bfloat16 variables have no fused kernels (nor on the CPU): per replica
        assert gpu_sweeps and gpu_reads == []
        _check_loss_scale_launches(launches, len(steps), None, fused=False)
        return
    assert gpu_sweeps == []
    assert gpu_reads == [cupy.ndarray] * len(steps)  # one flag, read once per step
    # A mixed launch reads the 16-bit gradients; past one launch's gradients (8) they are widened
    # first (exact) and read as the variables' dtype.
    mixed = gdtype != vdtype and n <= 8
    _check_loss_scale_launches(launches, len(steps), gdtype if mixed else None, fused=True)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("k", [2, 4])
def test_gpus_launch_together_and_later_work_waits_for_the_pass(k, launches, monkeypatch):
    """Across physical GPUs the pass's launches are ordered against the work before and after it,
    not against each other: two cross-GPU joins per pass (every GPU with every GPU, on entry and
    on exit), whatever the number of variables -- the backend's staging would join twice per
    launch, chaining GPU k's launch after GPU k-1's. The exit join is what keeps the next step's
    work on a gradient's GPU (here every replica overwrites its gradient buffer in place) from
    overtaking another GPU's launch still reading it; the bits are the CPU's in every mode (the
    entry join's removal fails the fake's shuffle mode on bits, the exit join's this count). Without
    peer access (CUDIST_EMU_PEER=none under the fake) the general path runs: the same bits."""
    import cupy

    import cudist._kernels._cupy as cupy_mod

    _physical_gpus_or_skip(k)
    from cudist._dataplane import update

    joins, inside = [], []
    real = cupy_mod.join_streams
    monkeypatch.setattr(cupy_mod, "join_streams", lambda *a: (inside and joins.append(a), real(*a))[1])
    real_pass = update._apply_fused_on_gpu

    def fused_pass(*args, **kw):
        inside.append(1)
        try:
            return real_pass(*args, **kw)
        finally:
            inside.pop()

    monkeypatch.setattr(update, "_apply_fused_on_gpu", fused_pass)
    steps = _grads(np.float16, k, "together")
    buffers = {}

    def reused(g):
        """The replica's persistent buffer for this shape on the current GPU, overwritten in place."""
        dev = cupy.cuda.Device().id
        buf = buffers.get((dev, g.shape))
        if buf is None:
            buf = buffers[(dev, g.shape)] = cupy.empty(g.shape, g.dtype)
        buf[...] = cupy.asarray(g)
        return buf

    make = OPTIMIZERS["adam"]
    got = _train([f"/gpu:{i}" for i in range(k)], reused, make, steps)
    want = _train([f"/cpu:{i}" for i in range(k)], lambda g: g, make, steps)
    _assert_same(got, want)
    if not _all_peers(k):  # the general path (reduce first): no fused pass to join around
        assert launches["fused"] == 0 and joins == []
        return
    assert launches["fused"] == STEPS
    _check_fused_per_gpu(launches, k, np.dtype(np.float16), STEPS)
    # In each pass two joins of every GPU with every GPU, none per launch (2 variables x k GPUs).
    joins = [(w, s) for _, w, s in joins if any(int(a) != int(b) for a in w for b in s)]
    assert len(joins) == 2 * STEPS, [tuple(map(sorted, j)) for j in joins]
    assert all(sorted(w) == sorted(s) == list(range(k)) for w, s in joins)
