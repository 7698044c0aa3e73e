"""The cupy backend's CUDA kernels against the NumPy reference (needs a GPU; skipped without one).

Logical replicas on one GPU are N buffers on device 0; the multi_gpu tests spread them over GPUs.
Results must equal the reference bit for bit (float32 subnormals aside: CuPy compiles with -ftz,
and random normal data never produces them).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from cudist._kernels._numpy import NumpyBackend

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
FLOATS = ["float16", "float32", "float64"]
NS = [1, 2, 3, 5, 8, 11]  # 11: more than one launch's worth of replicas
SHAPES = [(), (1,), (7,), (33, 5), (1031,)]  # odd sizes: scalar tails after the 16-byte vectors

REF = NumpyBackend()


def _rand(rng, shape, dtype, scale=4.0):
    dt = np.dtype(dtype)
    if dt.kind == "i":
        info = np.iinfo(dt)
        # Large magnitudes so that SUM wraps around, as the contract says it must.
        # np.asarray: with shape () NumPy returns a scalar, not the 0-d array the kernels take.
        return np.asarray(rng.integers(info.min // 2, info.max // 2, size=shape, dtype=dt))
    x = rng.standard_normal(shape) * scale
    return np.asarray(x.astype(dt))


def _host(cp, arrs):
    return [cp.asnumpy(a) for a in arrs]


def _assert_same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    # Bitwise (NaN-free data): compare the raw bytes.
    assert got.tobytes() == want.tobytes(), f"max abs diff {np.max(np.abs(got.astype(float) - want.astype(float)))}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce(cp, be, dtype, n, op):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}/{n}/{op}".encode()))
    for shape in SHAPES:
        host = [_rand(rng, shape, dtype) for _ in range(n)]
        want = [h.copy() for h in host]
        REF.all_reduce(want, op)
        dev = [cp.asarray(h) for h in host]
        be.all_reduce(dev, op)
        for g, w in zip(_host(cp, dev), want):
            _assert_same(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 8, 11])
def test_reduce_to_one_new_and_aliased_out(cp, be, dtype, n):
    rng = np.random.default_rng(n)
    host = [_rand(rng, (257,), dtype) for _ in range(n)]
    for op in ("sum", "mean"):
        want = REF.reduce_to_one([h.copy() for h in host], op)
        dev = [cp.asarray(h) for h in host]
        _assert_same(cp.asnumpy(be.reduce_to_one(dev, op)), want)
        # `out` may be one of the inputs, including one read in a later pass (n > 8).
        for k in {0, n - 1}:
            dev = [cp.asarray(h) for h in host]
            out = be.reduce_to_one(dev, op, out=dev[k])
            assert out is dev[k]
            _assert_same(cp.asnumpy(dev[k]), want)


def test_unaligned_views_take_the_scalar_path(cp, be):
    """Buffers offset by one element (not 16-byte aligned) must still reduce right."""
    rng = np.random.default_rng(7)
    host = [_rand(rng, (1001,), "float32") for _ in range(3)]
    want = [h[1:].copy() for h in host]
    REF.all_reduce(want, "sum")
    bases = [cp.asarray(h) for h in host]
    views = [b[1:] for b in bases]
    be.all_reduce(views, "sum")
    for v, w in zip(views, want):
        _assert_same(cp.asnumpy(v), w)
    # The element before each view is untouched.
    for b, h in zip(bases, host):
        assert cp.asnumpy(b)[0] == h[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_and_assign(cp, be, dtype):
    rng = np.random.default_rng(3)
    for n in (1, 4, 11):
        src = _rand(rng, (33, 5), dtype)
        dsts = [cp.asarray(_rand(rng, (33, 5), dtype)) for _ in range(n)]
        be.broadcast(cp.asarray(src), dsts)
        for d in dsts:
            _assert_same(cp.asnumpy(d), src)
        dsts = [cp.asarray(_rand(rng, (33, 5), dtype)) for _ in range(n)]
        be.assign(dsts, cp.asarray(src))
        for d in dsts:
            _assert_same(cp.asnumpy(d), src)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather(cp, be, dtype):
    rng = np.random.default_rng(4)
    host = [_rand(rng, (s, 3), dtype) for s in (3, 3, 1, 0)]
    for axis in (0, -2):
        got = be.all_gather([cp.asarray(h) for h in host], axis=axis)
        _assert_same(cp.asnumpy(got), np.concatenate(host, axis=axis))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 8, 11])
def test_assign_add_and_sub(cp, be, dtype, n):
    rng = np.random.default_rng(n + 100)
    for shape in SHAPES:
        w0 = _rand(rng, shape, dtype)
        val = _rand(rng, shape, dtype)
        for method in ("assign_add", "assign_sub"):
            want = getattr(REF, method)([w0.copy() for _ in range(n)], val)
            dev = [cp.asarray(w0) for _ in range(n)]
            getattr(be, method)(dev, cp.asarray(val))
            for g, w in zip(_host(cp, dev), want):
                _assert_same(g, w)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 2, 5, 8, 11])
def test_sgd(cp, be, dtype, n):
    rng = np.random.default_rng(n + 200)
    for shape in SHAPES:
        w0, g = _rand(rng, shape, dtype), _rand(rng, shape, dtype)
        want = REF.sgd([w0.copy() for _ in range(n)], g, lr=0.037)
        dev = [cp.asarray(w0) for _ in range(n)]
        be.sgd(dev, cp.asarray(g), lr=0.037)
        for a, b in zip(_host(cp, dev), want):
            _assert_same(a, b)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 3, 8, 11])
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum(cp, be, dtype, n, nesterov):
    rng = np.random.default_rng(n + 300)
    for shape in SHAPES:
        w0, v0, g = (_rand(rng, shape, dtype) for _ in range(3))
        ws, vs = [w0.copy() for _ in range(n)], [v0.copy() for _ in range(n)]
        REF.momentum(ws, vs, g, lr=0.05, momentum=0.9, nesterov=nesterov)
        dw, dv = [cp.asarray(w0) for _ in range(n)], [cp.asarray(v0) for _ in range(n)]
        be.momentum(dw, dv, cp.asarray(g), lr=0.05, momentum=0.9, nesterov=nesterov)
        for a, b in zip(_host(cp, dw) + _host(cp, dv), ws + vs):
            _assert_same(a, b)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 2, 7, 8, 11])
def test_adam(cp, be, dtype, n):
    rng = np.random.default_rng(n + 400)
    for shape in SHAPES:
        w0, g = _rand(rng, shape, dtype), _rand(rng, shape, dtype)
        m0 = _rand(rng, shape, dtype, scale=0.1)
        v0 = np.asarray(np.abs(_rand(rng, shape, dtype, scale=0.1)))  # a 0-d abs() is a scalar
        for step in (1, 5):
            ws, ms, vs = ([a.copy() for _ in range(n)] for a in (w0, m0, v0))
            REF.adam(ws, ms, vs, g, lr=0.001, step=step)
            dw, dm, dv = ([cp.asarray(a) for _ in range(n)] for a in (w0, m0, v0))
            be.adam(dw, dm, dv, cp.asarray(g), lr=0.001, step=step)
            for a, b in zip(_host(cp, dw) + _host(cp, dm) + _host(cp, dv), ws + ms + vs):
                _assert_same(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 11])
def test_scatter_follows_the_ceil_rule(cp, be, dtype, n):
    from cudist._kernels._split import split

    rng = np.random.default_rng(n + 500)
    for bsz in (0, 1, 3, 5, 8, 17):
        host = {"x": _rand(rng, (bsz, 3), dtype), "y": _rand(rng, (bsz,), dtype)}
        want = split(host, n)
        for batch in (host, {k: cp.asarray(v) for k, v in host.items()}):  # from host and from device
            got = be.scatter(batch, [0] * n)
            assert len(got) == n
            for g, w in zip(got, want):
                for key in ("x", "y"):
                    assert isinstance(g[key], cp.ndarray)
                    _assert_same(cp.asnumpy(g[key]), w[key])


def test_replica_pointers_travel_by_value(cp, be):
    """The backend launches the ``*_packed`` kernels, whose replica pointers are a kernel parameter
    (a one-element structured NumPy array that CuPy passes by value): nothing is uploaded or cached
    on the device per call, so no table can be recycled under a kernel still queued on another
    stream (what the pointer-table cache had to guard against)."""
    from cudist._kernels import _cupy

    p = _cupy._pack([cp.zeros(4, cp.float32)] * 3)
    assert isinstance(p, np.ndarray) and p.shape == (1,) and p.dtype.itemsize == 8 * _cupy.MAX_REPLICAS
    assert not hasattr(be, "_tables")
    rng = np.random.default_rng(11)
    sets = [[_rand(rng, (1031,), "float32") for _ in range(3)] for _ in range(3)]
    a, b, c = ([cp.asarray(h) for h in hs] for hs in sets)
    want = [[x.copy() for x in hs] for hs in sets]
    be.all_reduce(a, "sum")
    REF.all_reduce(want[0], "sum")
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    used = pool.used_bytes()
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        be.all_reduce(a, "sum")  # queued on `side`, which nothing synchronizes yet
    REF.all_reduce(want[0], "sum")
    be.all_reduce(b, "sum")
    be.all_reduce(c, "sum")
    REF.all_reduce(want[1], "sum")
    REF.all_reduce(want[2], "sum")
    assert pool.used_bytes() == used  # in-place all-reduces allocate no device memory
    side.synchronize()
    cp.cuda.Device().synchronize()
    for got, exp in zip((a, b, c), want):
        for g, w in zip(got, exp):
            _assert_same(cp.asnumpy(g), w)
    assert all(k[2] in _cupy.KERNELS for k in be._functions)
    assert all("_packed" in fn.name for fn in be._functions.values())  # (mangled on a GPU)


def test_bad_input_is_rejected(cp, be):
    a = cp.zeros(4, dtype=cp.float32)
    with pytest.raises(TypeError, match="cupy.ndarray"):
        be.all_reduce([a, np.zeros(4, np.float32)])
    with pytest.raises(ValueError, match="shape"):
        be.all_reduce([a, cp.zeros(5, dtype=cp.float32)])
    with pytest.raises(TypeError, match="dtype"):
        be.all_reduce([a, cp.zeros(4, dtype=cp.float64)])
    with pytest.raises(TypeError, match="unsupported dtype"):
        be.all_reduce([cp.zeros(4, dtype=cp.uint8)] * 2)
    with pytest.raises(ValueError, match="contiguous"):
        be.all_reduce([cp.zeros((4, 4), dtype=cp.float32).T] * 2)
    with pytest.raises(TypeError, match="floating-point"):
        be.sgd([cp.zeros(4, dtype=cp.int32)], cp.zeros(4, dtype=cp.int32), lr=0.1)
    with pytest.raises(ValueError, match="step"):
        be.adam([a], [a.copy()], [a.copy()], a, lr=0.1, step=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_out_of_place(cp, be, dtype, n, op):
    """N inputs -> N separate outputs (inputs untouched); with every other output its own input."""
    rng = np.random.default_rng(zlib.crc32(f"oop/{dtype}/{n}/{op}".encode()))
    for shape in SHAPES:
        host = [_rand(rng, shape, dtype) for _ in range(n)]
        want = REF.reduce_to_one([h.copy() for h in host], op)
        ins = [cp.asarray(h) for h in host]
        outs = [cp.asarray(_rand(rng, shape, dtype)) for _ in range(n)]
        got = be.all_reduce(ins, op, outputs=outs)
        assert all(g is o for g, o in zip(got, outs))
        for o in outs:
            _assert_same(cp.asnumpy(o), want)
        for i, h in zip(ins, host):
            _assert_same(cp.asnumpy(i), h)
        mixed = [ins[r] if r % 2 else cp.empty_like(ins[r]) for r in range(n)]
        be.all_reduce(ins, op, outputs=mixed)
        for o in mixed:
            _assert_same(cp.asnumpy(o), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 11])
def test_batch_all_reduce(cp, be, dtype, n):
    rng = np.random.default_rng(n + 600)
    shapes = [(7,), (), (33, 5), (0,), (1031,)]
    host = [[_rand(rng, s, dtype) for s in shapes] for _ in range(n)]
    ins = [[cp.asarray(h) for h in hs] for hs in host]
    outs = [[cp.empty(s, dtype) for s in shapes] for _ in range(n)]
    be.batch_all_reduce(ins, outs, "mean")
    for j in range(len(shapes)):
        want = REF.reduce_to_one([host[r][j] for r in range(n)], "mean")
        for r in range(n):
            _assert_same(cp.asnumpy(outs[r][j]), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 11])
def test_batch_reduce_to_one(cp, be, dtype, n):
    """The leaves reduced back to back into one 1-d device array (the default hook: one
    reduce_to_one per leaf into its slice), as the host backends do."""
    rng = np.random.default_rng(n + 700)
    shapes = [(7,), (), (33, 5), (0,), (1031,)]
    host = [[_rand(rng, s, dtype) for s in shapes] for _ in range(n)]
    ins = [[cp.asarray(h) for h in hs] for hs in host]
    out = be.batch_reduce_to_one(ins, "mean")
    assert out.shape == (sum(int(np.prod(s)) for s in shapes),)
    got, off = cp.asnumpy(out), 0
    for j, shape in enumerate(shapes):
        size = int(np.prod(shape))
        _assert_same(got[off : off + size].reshape(shape), REF.reduce_to_one([host[r][j] for r in range(n)], "mean"))
        off += size


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n, m", [(1, 1), (1, 4), (3, 3), (8, 8), (2, 11), (11, 2)])
def test_fused_all_reduce_updates(cp, be, dtype, n, m):
    """all_reduce_sgd / _momentum / _adam: bit for bit reduce_to_one(grads, SUM) then the update
    (m > 8 gradients: a temporary holds the first sums)."""
    rng = np.random.default_rng(n * 100 + m)
    for shape in SHAPES:
        grads = [_rand(rng, shape, dtype) for _ in range(m)]
        g = REF.reduce_to_one([x.copy() for x in grads], "sum")
        dgrads = [cp.asarray(x) for x in grads]
        w0, m0 = _rand(rng, shape, dtype), _rand(rng, shape, dtype, scale=0.1)
        v0 = np.asarray(np.abs(_rand(rng, shape, dtype, scale=0.1)))
        ws, ms, vs = ([a.copy() for _ in range(n)] for a in (w0, m0, v0))
        REF.adam(ws, ms, vs, g, lr=0.001, step=3)
        dw, dm, dv = ([cp.asarray(a) for _ in range(n)] for a in (w0, m0, v0))
        be.all_reduce_adam(dw, dm, dv, dgrads, lr=0.001, step=3)
        for a, b in zip(_host(cp, dw) + _host(cp, dm) + _host(cp, dv), ws + ms + vs):
            _assert_same(a, b)
        REF.momentum(ws, ms, g, lr=0.05, momentum=0.9, nesterov=True)
        be.all_reduce_momentum(dw, dm, dgrads, lr=0.05, momentum=0.9, nesterov=True)
        for a, b in zip(_host(cp, dw) + _host(cp, dm), ws + ms):
            _assert_same(a, b)
        REF.sgd(ws, g, lr=0.25)
        be.all_reduce_sgd(dw, dgrads, lr=0.25)
        for a, b in zip(_host(cp, dw), ws):
            _assert_same(a, b)
        for x, h in zip(dgrads, grads):
            _assert_same(cp.asnumpy(x), h)


def test_trusted_kernels_on_gpu(cp, be):
    from cudist._reduce_util import ReduceOp

    t = be.trusted
    rng = np.random.default_rng(12)
    host = [_rand(rng, (257,), "float32") for _ in range(3)]
    ins = tuple(cp.asarray(h) for h in host)
    outs = tuple(cp.empty(257, cp.float32) for _ in range(3))
    t.all_reduce(ins, outs, ReduceOp.SUM)
    want = REF.reduce_to_one(host, "sum")
    for o in outs:
        _assert_same(cp.asnumpy(o), want)
    w = tuple(cp.asarray(host[0]) for _ in range(2))
    t.all_reduce_sgd(w, ins, 0.5, 0.0)
    exp = [host[0].copy() for _ in range(2)]
    REF.sgd(exp, want, lr=0.5)
    for a, b in zip(_host(cp, w), exp):
        _assert_same(a, b)
    with pytest.raises(ValueError, match="output 1 overlaps input 0"):
        be.all_reduce(list(ins[:2]), "sum", outputs=[outs[0], ins[0]])
    with pytest.raises(ValueError, match="copy 0 overlaps gradient 0"):
        be.all_reduce_sgd([ins[0]], [ins[0]], lr=0.1)


@pytest.mark.multi_gpu
def test_out_of_place_and_fused_across_gpus(cp, be):
    ndev = cp.cuda.runtime.getDeviceCount()
    rng = np.random.default_rng(13)
    host = [_rand(rng, (1031,), "float32") for _ in range(ndev)]
    want = REF.reduce_to_one(host, "mean")
    ins, outs = [], []
    for d, h in enumerate(host):
        with cp.cuda.Device(d):
            ins.append(cp.asarray(h))
            outs.append(cp.empty(1031, cp.float32))
    be.all_reduce(ins, "mean", outputs=outs)
    for d, o in enumerate(outs):
        assert o.device.id == d
        _assert_same(cp.asnumpy(o), want)
    w0 = _rand(rng, (1031,), "float32")
    ws = []
    for d in range(ndev):
        with cp.cuda.Device(d):
            ws.append(cp.asarray(w0))
    be.all_reduce_sgd(ws, ins, lr=0.125)  # gradients on every GPU, copies on every GPU
    exp = [w0.copy() for _ in range(ndev)]
    REF.sgd(exp, REF.reduce_to_one(host, "sum"), lr=0.125)
    for d, (a, b) in enumerate(zip(ws, exp)):
        assert a.device.id == d
        _assert_same(cp.asnumpy(a), b)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("size", [1031, 1 << 20])  # small: one-shot over peers; large: two-shot
def test_all_reduce_across_gpus(cp, be, size):
    ndev = cp.cuda.runtime.getDeviceCount()
    rng = np.random.default_rng(size)
    host = [_rand(rng, (size,), "float32") for _ in range(ndev)]
    want = [h.copy() for h in host]
    REF.all_reduce(want, "mean")
    dev = []
    for d, h in enumerate(host):
        with cp.cuda.Device(d):
            dev.append(cp.asarray(h))
    be.all_reduce(dev, "mean")
    for d, (a, w) in enumerate(zip(dev, want)):
        assert a.device.id == d
        _assert_same(cp.asnumpy(a), w)


@pytest.mark.multi_gpu
def test_adam_and_scatter_across_gpus(cp, be):
    ndev = cp.cuda.runtime.getDeviceCount()
    rng = np.random.default_rng(11)
    w0, g, m0 = (_rand(rng, (777,), "float32") for _ in range(3))
    v0 = np.abs(m0)
    ws, ms, vs = ([a.copy() for _ in range(ndev)] for a in (w0, m0, v0))
    REF.adam(ws, ms, vs, g, lr=0.01, step=3)
    on = []
    for arr in (w0, m0, v0):
        copies = []
        for d in range(ndev):
            with cp.cuda.Device(d):
                copies.append(cp.asarray(arr))
        on.append(copies)
    be.adam(*on, cp.asarray(g), lr=0.01, step=3)
    for got, want in zip(on, (ws, ms, vs)):
        for a, b in zip(got, want):
            _assert_same(cp.asnumpy(a), b)
    batch = _rand(rng, (9, 2), "float32")
    pieces = be.scatter(cp.asarray(batch), list(range(ndev)))
    from cudist._kernels._split import split

    for d, (p, w) in enumerate(zip(pieces, split(batch, ndev))):
        assert p.device.id == d
        _assert_same(cp.asnumpy(p), w)
