"""Every operation of every CPU kernel backend against the NumPy reference, bit for bit.

The contract (``cudist/_kernels/_base.py``) fixes the summation order and the compute types, so the
CPU backends must agree with NumPy exactly: results are compared as raw bytes, not with a tolerance.
Data are random (never zeros), over every supported dtype, 1 to 8 replicas, sizes 0, 1, primes
and sizes larger than one thread's block, 1-D and multi-dimensional.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudist._kernels import SUPPORTED_DTYPES, bias_corrected_lr, get_backend
from cudist._kernels._numpy import NumpyBackend, reference_reduce
from cudist._reduce_util import ReduceOp

CPU_BACKENDS = ["numpy", "numba", "native"]
DTYPES = [d.name for d in SUPPORTED_DTYPES]
FLOATS = ["float16", "float32", "float64"]
# 0, 1, small primes, primes around the 8192-element block of the numba backend, and one size
# larger than a thread's share so the multi-threaded path runs.
SIZES = [0, 1, 2, 3, 5, 7, 13, 31, 127, 1021, 8191, 8209, 65537, 300007]
REF = NumpyBackend()

# Few examples each: every example of a new dtype can cost a compile in a fresh cache.
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(params=CPU_BACKENDS, scope="module")
def backend(request):
    # Not skipped when missing: every CPU backend is part of the package and must load.
    return get_backend(request.param)


def random_array(rng, shape, dtype, *, scale=None):
    """Random values of ``dtype`` with no zeros; integers span the whole range (sums wrap)."""
    dt = np.dtype(dtype)
    if dt.kind == "i":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
        a[a == 0] = 1
        return a
    scale = {2: 8.0, 4: 1e3, 8: 1e6}[dt.itemsize] if scale is None else scale
    a = rng.uniform(0.5, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    a *= scale ** rng.uniform(-1.0, 1.0, size=shape)  # several binades, so rounding matters
    return a.astype(dt)


def assert_bitwise(actual, expected, what=""):
    assert isinstance(actual, np.ndarray), f"{what}: got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.tobytes() != expected.tobytes():
        bad = np.flatnonzero(actual.reshape(-1).view(f"u{actual.itemsize}") != expected.reshape(-1).view(f"u{actual.itemsize}"))
        i = bad[0]
        raise AssertionError(
            f"{what}: {bad.size} of {actual.size} elements differ bitwise; first at flat index {i}: "
            f"{actual.reshape(-1)[i]!r} != {expected.reshape(-1)[i]!r}"
        )


@st.composite
def shapes(draw):
    size = draw(st.sampled_from(SIZES))
    if size > 1 and draw(st.booleans()):
        # A multi-dimensional shape of the same size: size x 1 or a split of a composite.
        return draw(st.sampled_from([(size, 1), (1, size), (1, size, 1)]))
    if draw(st.booleans()):
        return draw(st.sampled_from([(3, 4), (2, 3, 5), (6, 7, 11), (16, 1024, 3)]))
    return (size,)


case = dict(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 8),
    shape=shapes(),
    seed=st.integers(0, 2**32 - 1),
)


# ---------------------------------------------------------------------------- collectives
@FAST
@given(op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN, "sum", "Mean"]), **case)
def test_all_reduce_matches_reference(backend, op, dtype, n, shape, seed):
    rng = np.random.default_rng(seed)
    bufs = [random_array(rng, shape, dtype) for _ in range(n)]
    expected = reference_reduce([b.copy() for b in bufs], ReduceOp.parse(op))
    out = backend.all_reduce(bufs, op)
    assert isinstance(out, tuple) and len(out) == n
    for i, (o, b) in enumerate(zip(out, bufs)):
        assert o is b, "all_reduce reduces in place and returns the same buffers"
        assert_bitwise(b, expected, f"{backend.name} all_reduce {op} replica {i}")


@FAST
@given(op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN]), out_kind=st.sampled_from(["new", "given", "replica"]), **case)
def test_reduce_to_one_matches_reference(backend, op, out_kind, dtype, n, shape, seed):
    rng = np.random.default_rng(seed)
    bufs = [random_array(rng, shape, dtype) for _ in range(n)]
    before = [b.copy() for b in bufs]
    expected = reference_reduce(before, op)
    if out_kind == "new":
        out = backend.reduce_to_one(bufs, op)
    elif out_kind == "given":
        given_out = random_array(rng, shape, dtype)
        out = backend.reduce_to_one(bufs, op, out=given_out)
        assert out is given_out
    else:
        out = backend.reduce_to_one(bufs, op, out=bufs[-1])
        assert out is bufs[-1]
    assert_bitwise(out, expected, f"{backend.name} reduce_to_one {op}")
    untouched = bufs[:-1] if out_kind == "replica" else bufs
    for i, (b, b0) in enumerate(zip(untouched, before)):
        assert_bitwise(b, b0, f"input {i} must not change")


@FAST
@given(src_kind=st.sampled_from(["separate", "first_dst", "read_only"]), **case)
def test_broadcast_copies_into_every_destination(backend, src_kind, dtype, n, shape, seed):
    rng = np.random.default_rng(seed)
    dsts = [random_array(rng, shape, dtype) for _ in range(n)]
    src = random_array(rng, shape, dtype)
    if src_kind == "first_dst":
        src = dsts[0]
    elif src_kind == "read_only":
        src.flags.writeable = False
    expected = src.copy()
    out = backend.broadcast(src, dsts)
    assert isinstance(out, tuple) and all(o is d for o, d in zip(out, dsts))
    for i, d in enumerate(dsts):
        assert_bitwise(d, expected, f"{backend.name} broadcast dst {i}")
    assert_bitwise(src, expected, "src must not change")


@FAST
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 8),
    rank=st.integers(1, 3),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_all_gather_concatenates_in_replica_order(backend, dtype, n, rank, data, seed):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-rank, rank - 1), label="axis")
    base = data.draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank), label="base shape")
    sizes = data.draw(st.lists(st.integers(0, 7), min_size=n, max_size=n), label="sizes along axis")
    bufs = []
    for s in sizes:
        shape = list(base)
        shape[axis] = s  # partial batches: sizes differ along the gather axis only
        bufs.append(random_array(rng, tuple(shape), dtype))
    before = [b.copy() for b in bufs]
    got = backend.all_gather(bufs, axis=axis)
    assert_bitwise(got, np.concatenate(before, axis=axis), f"{backend.name} all_gather axis={axis}")
    for b, b0 in zip(bufs, before):
        assert_bitwise(b, b0, "inputs must not change")


def test_all_gather_default_axis_is_zero(backend):
    rng = np.random.default_rng(7)
    bufs = [random_array(rng, (k, 3), "float32") for k in (2, 0, 3)]
    assert_bitwise(backend.all_gather(bufs), np.concatenate(bufs, axis=0), "all_gather")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_all_reduce_large_multithreaded(backend, dtype, op):
    # Big enough (>= 4 MiB moved) for the parallel paths, with a ragged last block.
    rng = np.random.default_rng(11)
    bufs = [random_array(rng, (300007,), dtype) for _ in range(4)]
    expected = reference_reduce([b.copy() for b in bufs], op)
    backend.all_reduce(bufs, op)
    for i, b in enumerate(bufs):
        assert_bitwise(b, expected, f"{backend.name} large all_reduce replica {i}")


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_sum_wraps_and_mean_truncates_toward_zero(backend, dtype):
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, -7, 7, -9, 5], dtype)
    b = np.array([1, -1, -2, 2, 1, -14], dtype)
    s = [a.copy(), b.copy()]
    backend.all_reduce(s, "sum")
    assert s[0].tolist() == [info.min, info.max, -9, 9, -8, -9]  # overflow wraps around
    m = [a.copy(), b.copy()]
    backend.all_reduce(m, "mean")
    # the wrapped sums, halved toward zero (C semantics), not floored
    assert m[0].tolist() == [info.min // 2, info.max // 2, -4, 4, -4, -4]
    assert m[1].tolist() == m[0].tolist()
    three = [np.array([-7, 8, -1], dtype), np.array([-1, 1, -1], dtype), np.array([-3, 1, -1], dtype)]
    backend.all_reduce(three, "mean")
    assert three[2].tolist() == [-3, 3, -1]


def test_float16_accumulates_in_float32_and_rounds_once(backend):
    # 2048 + 1 is not representable in float16 (ties to even 2048): rounded after every addition,
    # three ones would give 2048 again; the contract accumulates in float32: 2051 -> 2052 once.
    bufs = [np.array([2048.0, 1.0], np.float16)] + [np.array([1.0, 2048.0], np.float16) for _ in range(3)]
    backend.all_reduce(bufs, "sum")
    assert bufs[0].tolist() == [2052.0, 6144.0]
    assert_bitwise(bufs[3], bufs[0], "float16 replicas")
    # MEAN divides the float32 sum: 2051 / 4 = 512.75 -> 513 (rounding every addition: 2048 / 4 = 512).
    bufs = [np.array([2048.0], np.float16)] + [np.array([1.0], np.float16) for _ in range(3)]
    backend.all_reduce(bufs, "mean")
    assert bufs[0].tolist() == [513.0]


def test_all_reduce_with_the_same_buffer_twice(backend):
    rng = np.random.default_rng(3)
    a = random_array(rng, (1000,), "float32")
    expected = a + a
    backend.all_reduce([a, a], "sum")
    assert_bitwise(a, expected, "all_reduce([a, a])")


@pytest.mark.parametrize("size", [5, 20000])
def test_partially_overlapping_buffers_match_reference(backend, size):
    rng = np.random.default_rng(5)
    base = random_array(rng, (size + 3,), "float64")
    ref = base.copy()
    REF.all_reduce([ref[:size], ref[3:]], "sum")
    backend.all_reduce([base[:size], base[3:]], "sum")
    assert_bitwise(base, ref, f"{backend.name} all_reduce of overlapping views")
    base = random_array(rng, (size + 1,), "float32")
    ref = base.copy()
    REF.broadcast(ref[1:], [ref[:size]])
    backend.broadcast(base[1:], [base[:size]])
    assert_bitwise(base, ref, f"{backend.name} broadcast between overlapping views")


# ---------------------------------------------------------------------------- mirrored updates
def mirrors(rng, shape, dtype, n, *, positive=False):
    v = random_array(rng, shape, dtype)
    if positive:
        v = np.abs(v)
    return [v.copy() for _ in range(n)]


def check_updates(backend, what, got_lists, exp_lists):
    for name, got, exp in zip(what, got_lists, exp_lists):
        for i, (g, e) in enumerate(zip(got, exp)):
            assert_bitwise(g, e, f"{backend.name} {name} copy {i}")


@FAST
@given(kind=st.sampled_from(["assign", "assign_add", "assign_sub"]), **case)
def test_assign_family_matches_reference(backend, kind, dtype, n, shape, seed):
    rng = np.random.default_rng(seed)
    copies = mirrors(rng, shape, dtype, n)
    value = random_array(rng, shape, dtype)
    expected = [c.copy() for c in copies]
    getattr(REF, kind)(expected, value.copy())
    out = getattr(backend, kind)(copies, value)
    assert isinstance(out, tuple) and all(o is c for o, c in zip(out, copies))
    check_updates(backend, [kind], [copies], [expected])


@pytest.mark.parametrize("kind", ["assign_add", "assign_sub"])
def test_assign_add_reads_copy_zero(backend, kind):
    # The copies are mirrors, so copy 0 stands for all of them: stale copies are overwritten.
    rng = np.random.default_rng(2)
    copies = [random_array(rng, (37,), "float64") for _ in range(3)]
    value = random_array(rng, (37,), "float64")
    expected = copies[0] + value if kind == "assign_add" else copies[0] - value
    getattr(backend, kind)(copies, value)
    for c in copies:
        assert_bitwise(c, expected, kind)


def test_assign_add_integers_wrap(backend):
    copies = [np.array([np.iinfo(np.int32).max, 5], np.int32) for _ in range(2)]
    backend.assign_add(copies, np.array([1, -6], np.int32))
    assert copies[1].tolist() == [np.iinfo(np.int32).min, -1]


float_case = dict(case, dtype=st.sampled_from(FLOATS))


@FAST
@given(lr=st.floats(1e-4, 1.0), **float_case)
def test_sgd_matches_reference(backend, lr, dtype, n, shape, seed):
    rng = np.random.default_rng(seed)
    copies = mirrors(rng, shape, dtype, n)
    grad = random_array(rng, shape, dtype)
    expected = [c.copy() for c in copies]
    REF.sgd(expected, grad, lr=lr)
    assert backend.sgd(copies, grad, lr=lr) is not None
    check_updates(backend, ["sgd"], [copies], [expected])


@FAST
@given(lr=st.floats(1e-4, 1.0), momentum=st.floats(0.0, 0.99), nesterov=st.booleans(), **float_case)
def test_momentum_matches_reference(backend, lr, momentum, nesterov, dtype, n, shape, seed):
    rng = np.random.default_rng(seed)
    copies = mirrors(rng, shape, dtype, n)
    vels = mirrors(rng, shape, dtype, n)
    grad = random_array(rng, shape, dtype)
    exp_w, exp_v = [c.copy() for c in copies], [v.copy() for v in vels]
    REF.momentum(exp_w, exp_v, grad, lr=lr, momentum=momentum, nesterov=nesterov)
    backend.momentum(copies, vels, grad, lr=lr, momentum=momentum, nesterov=nesterov)
    check_updates(backend, ["momentum w", "momentum v"], [copies, vels], [exp_w, exp_v])


@FAST
@given(
    lr=st.floats(1e-4, 0.1),
    beta_1=st.floats(0.5, 0.99),
    beta_2=st.floats(0.9, 0.9999),
    epsilon=st.sampled_from([1e-7, 1e-3]),
    step=st.integers(1, 10_000),
    **float_case,
)
def test_adam_matches_reference(backend, lr, beta_1, beta_2, epsilon, step, dtype, n, shape, seed):
    rng = np.random.default_rng(seed)
    copies = mirrors(rng, shape, dtype, n)
    ms = mirrors(rng, shape, dtype, n)
    vs = mirrors(rng, shape, dtype, n, positive=True)  # second moments are never negative
    grad = random_array(rng, shape, dtype)
    exp = [[a.copy() for a in x] for x in (copies, ms, vs)]
    kw = dict(lr=lr, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, step=step)
    REF.adam(*exp, grad, **kw)
    backend.adam(copies, ms, vs, grad, **kw)
    check_updates(backend, ["adam w", "adam m", "adam v"], [copies, ms, vs], exp)


@pytest.mark.parametrize("dtype", FLOATS)
def test_updates_large_multithreaded(backend, dtype):
    rng = np.random.default_rng(13)
    shape = (300007,)
    w, m, v = mirrors(rng, shape, dtype, 3), mirrors(rng, shape, dtype, 3), mirrors(rng, shape, dtype, 3, positive=True)
    g = random_array(rng, shape, dtype)
    exp = [[a.copy() for a in x] for x in (w, m, v)]
    REF.adam(*exp, g, lr=1e-3, step=7)
    backend.adam(w, m, v, g, lr=1e-3, step=7)
    check_updates(backend, ["adam w", "adam m", "adam v"], [w, m, v], exp)
    ew, ev = [a.copy() for a in w], [a.copy() for a in m]
    REF.momentum(ew, ev, g, lr=0.05, momentum=0.9, nesterov=True)
    backend.momentum(w, m, g, lr=0.05, momentum=0.9, nesterov=True)
    check_updates(backend, ["nesterov w", "nesterov v"], [w, m], [ew, ev])


# ---------------------------------------------------------------------------- errors
def _f32(*shape, seed=0):
    return random_array(np.random.default_rng(seed), shape, "float32")


def test_error_mismatched_shapes(backend):
    with pytest.raises(ValueError, match=r"replica 1 has shape \(5,\) but replica 0 has shape \(4,\)"):
        backend.all_reduce([_f32(4), _f32(5)])
    with pytest.raises(ValueError, match="shape"):
        backend.reduce_to_one([_f32(4), _f32(4)], out=_f32(3))
    with pytest.raises(ValueError, match="shape"):
        backend.broadcast(_f32(3), [_f32(4)])
    with pytest.raises(ValueError, match="outside the gather axis"):
        backend.all_gather([_f32(2, 3), _f32(2, 4)], axis=0)
    with pytest.raises(ValueError, match="grad has shape"):
        backend.sgd([_f32(4)], _f32(5), lr=0.1)


def test_error_mismatched_dtypes(backend):
    with pytest.raises(TypeError, match="replica 1 has dtype float64 but replica 0 has dtype float32"):
        backend.all_reduce([_f32(4), _f32(4).astype(np.float64)])
    with pytest.raises(TypeError, match="dtype"):
        backend.assign_add([_f32(4)], np.ones(4, np.int32))


@pytest.mark.parametrize("dtype", ["complex64", "bool", "uint8", "int16"])
def test_error_unsupported_dtype(backend, dtype):
    bufs = [np.ones(4, dtype), np.ones(4, dtype)]
    with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
        backend.all_reduce(bufs)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_error_non_native_byte_order_names_the_problem(backend, dtype):
    swapped = np.dtype(dtype).newbyteorder("S")
    bad = np.ones(4, swapped)
    msg = rf"replica 1 has dtype '{re.escape(swapped.str)}', which is not in the machine's byte order.*astype\('{dtype}'\)"
    with pytest.raises(TypeError, match=msg):
        backend.all_reduce([np.ones(4, dtype), bad])
    with pytest.raises(TypeError, match="grad has dtype .* byte order"):
        backend.sgd([np.ones(4, "float32")], np.ones(4, ">f4" if np.little_endian else "<f4"), lr=0.1)


def test_error_non_contiguous(backend):
    a = _f32(8)
    with pytest.raises(ValueError, match="replica 1 is not C-contiguous"):
        backend.all_reduce([_f32(4), a[::2]])
    with pytest.raises(ValueError, match="not C-contiguous"):
        backend.all_reduce([_f32(3, 4).T.copy().T, _f32(3, 4)])


def test_error_read_only_output(backend):
    a = _f32(4)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="replica 0 is read-only"):
        backend.all_reduce([a, _f32(4)])
    with pytest.raises(ValueError, match="out is read-only"):
        backend.reduce_to_one([_f32(4)], out=a)
    with pytest.raises(ValueError, match="read-only"):
        backend.sgd([_f32(4), a], _f32(4), lr=0.1)
    assert a.tolist() == _f32(4).tolist(), "a rejected call must not write"


def test_error_empty_replica_list(backend):
    with pytest.raises(ValueError, match="empty list"):
        backend.all_reduce([])
    with pytest.raises(ValueError, match="empty list"):
        backend.all_gather([])
    with pytest.raises(ValueError, match="empty list"):
        backend.broadcast(_f32(3), [])


@pytest.mark.parametrize("op", ["max", "prod", None, 3])
def test_error_unknown_op(backend, op):
    with pytest.raises(ValueError, match="unknown reduce op"):
        backend.all_reduce([_f32(4), _f32(4)], op)
    with pytest.raises(ValueError, match="unknown reduce op"):
        backend.reduce_to_one([_f32(4)], op)


def test_error_bad_axis(backend):
    with pytest.raises(ValueError, match="axis 2 is out of range for arrays of rank 2"):
        backend.all_gather([_f32(2, 3), _f32(2, 3)], axis=2)
    with pytest.raises(ValueError, match="axis -3 is out of range"):
        backend.all_gather([_f32(2, 3)], axis=-3)
    with pytest.raises(TypeError, match="axis must be an int"):
        backend.all_gather([_f32(2, 3)], axis=0.5)
    with pytest.raises(ValueError, match="0-d"):
        backend.all_gather([np.ones((), np.float32)], axis=0)


def test_error_non_array_input(backend):
    with pytest.raises(TypeError, match="replica 1 must be a numpy.ndarray, got list"):
        backend.all_reduce([_f32(3), [1.0, 2.0, 3.0]])
    with pytest.raises(TypeError, match="expected a list of replica arrays, got ndarray"):
        backend.all_reduce(_f32(3))
    with pytest.raises(TypeError, match="grad must be a numpy.ndarray"):
        backend.sgd([_f32(3)], 0.5, lr=0.1)


@pytest.mark.parametrize("step", [0, -1])
def test_error_adam_step_below_one(backend, step):
    w = [_f32(4)]
    before = w[0].copy()
    with pytest.raises(ValueError, match=f"step must be >= 1.*got {step}"):
        backend.adam(w, [_f32(4)], [np.abs(_f32(4))], _f32(4), lr=0.1, step=step)
    assert_bitwise(w[0], before, "rejected adam must not write")


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_error_integer_dtype_for_optimizers(backend, dtype):
    c = [np.ones(4, dtype)]
    with pytest.raises(TypeError, match=f"floating-point dtype, got {dtype}"):
        backend.sgd(c, np.ones(4, dtype), lr=0.1)
    with pytest.raises(TypeError, match="floating-point"):
        backend.momentum(c, [np.ones(4, dtype)], np.ones(4, dtype), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="floating-point"):
        backend.adam(c, [np.ones(4, dtype)], [np.ones(4, dtype)], np.ones(4, dtype), lr=0.1, step=1)


def test_error_slot_count_mismatch(backend):
    with pytest.raises(ValueError, match="2 variable copies but 1 velocity copies"):
        backend.momentum([_f32(4), _f32(4)], [_f32(4)], _f32(4), lr=0.1, momentum=0.9)


def test_backend_metadata(backend):
    assert backend.name in CPU_BACKENDS
    assert backend.xp is np
    assert set(backend.dtypes) <= set(SUPPORTED_DTYPES)
    assert {np.dtype("float32"), np.dtype("float64"), np.dtype("int32"), np.dtype("int64")} <= set(backend.dtypes)


# ---------------------------------------------------------------------------- numba specifics
def test_numba_supports_every_dtype():
    assert set(get_backend("numba").dtypes) == set(SUPPORTED_DTYPES)


def test_numba_float16_conversions_match_numpy():
    from cudist._kernels import _numba

    halves = np.arange(1 << 16, dtype=np.uint16)
    as_f32 = halves.view(np.float16).astype(np.float32)
    got = np.array([_numba._h2f(h) for h in halves.tolist()], np.float32)
    finite = ~np.isnan(as_f32)
    assert_bitwise(got[finite], as_f32[finite], "half -> float")
    assert np.isnan(got[~finite]).all()

    rng = np.random.default_rng(17)
    bits = rng.integers(0, 1 << 32, size=20000, dtype=np.uint64).astype(np.uint32)
    # Also every float16 value and the midpoints between neighbours (the ties), both signs.
    f = as_f32[finite]
    mids = ((f[:-1].astype(np.float64) + f[1:]) / 2).astype(np.float32)
    floats = np.concatenate([bits.view(np.float32), f, mids, np.float32([65520.0, 65519.996, 1e-8, 2.9802322e-08])])
    floats = floats[~np.isnan(floats)]
    got = np.array([_numba._f2h(np.float32(x)) for x in floats.tolist()], np.uint16)
    with np.errstate(over="ignore"):  # large floats become inf, as they should
        expected = floats.astype(np.float16).view(np.uint16)
    assert_bitwise(got, expected, "float -> half")


def _every_numba_op(backend, rng, dtype, size, n=3):
    """Runs every operation of ``backend`` once on random data; returns (name, got, expected) triples."""
    out = []
    for op in (ReduceOp.SUM, ReduceOp.MEAN):
        bufs = [random_array(rng, (size,), dtype) for _ in range(n)]
        exp = reference_reduce([b.copy() for b in bufs], op)
        backend.all_reduce(bufs, op)
        out += [(f"all_reduce {op.name} {i}", b, exp) for i, b in enumerate(bufs)]
        bufs = [random_array(rng, (size,), dtype) for _ in range(n)]
        out.append((f"reduce_to_one {op.name}", backend.reduce_to_one(bufs, op), reference_reduce(bufs, op)))
        ins = [random_array(rng, (size,), dtype) for _ in range(n)]
        for a in ins:
            a.flags.writeable = False
        outs = [random_array(rng, (size,), dtype) for _ in range(n)]
        backend.all_reduce(ins, op, outputs=outs)
        exp = reference_reduce(ins, op)
        out += [(f"all_reduce out of place {op.name} {i}", o, exp) for i, o in enumerate(outs)]
        leaves = [[random_array(rng, (size,), dtype), random_array(rng, (size // 3, 3), dtype)] for _ in range(n)]
        louts = [[np.empty_like(x) for x in lv] for lv in leaves]
        backend.batch_all_reduce(leaves, louts, op)
        for j in range(2):
            exp = reference_reduce([lv[j] for lv in leaves], op)
            out += [(f"batch_all_reduce {op.name} leaf {j} replica {r}", lo[j], exp) for r, lo in enumerate(louts)]
    src = random_array(rng, (size,), dtype)
    dsts = [random_array(rng, (size,), dtype) for _ in range(n)]
    backend.broadcast(src, dsts)
    out += [(f"broadcast {i}", d, src) for i, d in enumerate(dsts)]
    for kind in ("assign", "assign_add", "assign_sub"):
        copies, value = mirrors(rng, (size,), dtype, n), random_array(rng, (size,), dtype)
        exp = [c.copy() for c in copies]
        getattr(REF, kind)(exp, value)
        getattr(backend, kind)(copies, value)
        out += [(f"{kind} {i}", c, e) for i, (c, e) in enumerate(zip(copies, exp))]
    if np.dtype(dtype).kind != "f":
        return out
    g = random_array(rng, (size,), dtype)
    w = mirrors(rng, (size,), dtype, n)
    ew = [a.copy() for a in w]
    REF.sgd(ew, g, lr=0.1)
    backend.sgd(w, g, lr=0.1)
    out += [(f"sgd {i}", a, e) for i, (a, e) in enumerate(zip(w, ew))]
    for nesterov in (False, True):
        w, v = mirrors(rng, (size,), dtype, n), mirrors(rng, (size,), dtype, n)
        ew, ev = [a.copy() for a in w], [a.copy() for a in v]
        REF.momentum(ew, ev, g, lr=0.1, momentum=0.9, nesterov=nesterov)
        backend.momentum(w, v, g, lr=0.1, momentum=0.9, nesterov=nesterov)
        out += [(f"momentum nesterov={nesterov} {i}", a, e) for i, (a, e) in enumerate(zip(w + v, ew + ev))]
    w, m, v = mirrors(rng, (size,), dtype, n), mirrors(rng, (size,), dtype, n), mirrors(rng, (size,), dtype, n, positive=True)
    exp = [[a.copy() for a in x] for x in (w, m, v)]
    REF.adam(*exp, g, lr=1e-3, step=3)
    backend.adam(w, m, v, g, lr=1e-3, step=3)
    out += [(f"adam {i}", a, e) for i, (a, e) in enumerate(zip(w + m + v, sum(exp, [])))]
    grads = [random_array(rng, (size,), dtype) for _ in range(n + 1)]
    gs = reference_reduce(grads, ReduceOp.SUM)
    w, m, v = mirrors(rng, (size,), dtype, n), mirrors(rng, (size,), dtype, n), mirrors(rng, (size,), dtype, n, positive=True)
    exp = [[a.copy() for a in x] for x in (w, m, v)]
    REF.adam(*exp, gs, lr=1e-3, step=4)
    backend.all_reduce_adam(w, m, v, grads, lr=1e-3, step=4)
    out += [(f"all_reduce_adam {i}", a, e) for i, (a, e) in enumerate(zip(w + m + v, sum(exp, [])))]
    w, m = mirrors(rng, (size,), dtype, n), mirrors(rng, (size,), dtype, n)
    exp = [[a.copy() for a in x] for x in (w, m)]
    REF.momentum(*exp, gs, lr=0.1, momentum=0.9)
    backend.all_reduce_momentum(w, m, grads, lr=0.1, momentum=0.9)
    out += [(f"all_reduce_momentum {i}", a, e) for i, (a, e) in enumerate(zip(w + m, sum(exp, [])))]
    w = mirrors(rng, (size,), dtype, n)
    ew = [a.copy() for a in w]
    REF.sgd(ew, gs, lr=0.1)
    backend.all_reduce_sgd(w, grads, lr=0.1)
    out += [(f"all_reduce_sgd {i}", a, e) for i, (a, e) in enumerate(zip(w, ew))]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_serial_and_parallel_paths_agree_bitwise(monkeypatch, dtype):
    # Small calls run on the calling thread, large ones on the pool; the size threshold must not
    # change a single bit. Forcing each path on the same odd size (4 blocks, ragged) checks both.
    from cudist._kernels import _numba

    backend = get_backend("numba")
    size = 3 * _numba._CHUNK + 4099
    results = {}
    for path, threshold in (("serial", 1 << 62), ("parallel", 0)):
        monkeypatch.setattr(_numba, "_PARALLEL_MIN_BYTES", threshold)
        results[path] = _every_numba_op(backend, np.random.default_rng(23), dtype, size)
    for (name, got_s, exp), (_, got_p, _) in zip(results["serial"], results["parallel"]):
        assert_bitwise(got_s, exp, f"serial {name}")
        assert_bitwise(got_p, exp, f"parallel {name}")


def test_numba_small_calls_stay_on_the_calling_thread():
    import numba

    from cudist._kernels import _numba

    assert _numba._nthreads(_numba._PARALLEL_MIN_BYTES - 1) == 1
    assert _numba._nthreads(_numba._PARALLEL_MIN_BYTES) == numba.get_num_threads()
    # A 4-replica all-reduce of 64 KiB buffers (512 KiB moved) is latency-bound: no thread pool.
    assert _numba._nthreads(64 * 1024 * 8) == 1


_OMP_PROBE = """
import ctypes, json, os, sys
from cudist._kernels import _numba
import numba
numba.get_num_threads()  # starts the layer where the module left it alone
layer = numba.threading_layer()
if layer == "omp":
    ctypes.CDLL("libgomp.so.1").omp_display_env(1)  # the ICVs, on stderr
print(json.dumps({"setup": _numba._THREADS_SETUP, "layer": layer, "env": os.environ.get("OMP_WAIT_POLICY")}))
"""


def _run_probe(code, env_changes, *args):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER")}
    env.update(env_changes)
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"probe failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="passive waits are set on Linux only")
def test_numba_starts_openmp_with_passive_waits_unless_the_user_chose():
    got, err = _run_probe(_OMP_PROBE, {})
    if got["layer"] != "omp":
        assert got["setup"] != "passive"
        pytest.skip(f"numba uses the {got['layer']} threading layer, not OpenMP")
    assert got["setup"] == "passive"
    assert "GOMP_SPINCOUNT = '0'" in err, err  # passive: idle workers sleep at once
    assert got["env"] is None, "OMP_WAIT_POLICY must not stay in the environment (children would inherit it)"

    got, err = _run_probe(_OMP_PROBE, {"OMP_WAIT_POLICY": "active"})
    assert got["setup"].startswith("skipped: user set")
    assert got["env"] == "active"
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in err, err

    got, _ = _run_probe(_OMP_PROBE, {"NUMBA_THREADING_LAYER": "workqueue"})
    assert (got["setup"], got["layer"]) == ("skipped: threading layer is not omp", "workqueue")


_CACHE_PROBE = """
import json, sys, warnings
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_kernels import _every_numba_op, assert_bitwise
from cudist._kernels import get_backend, _numba
backend = get_backend("numba")
rng = np.random.default_rng(5)
for dtype in ("float16", "float32", "float64", "int32", "int64"):
    for size in (37, 300007):  # the serial and the parallel path of the driver
        for name, got, exp in _every_numba_op(backend, rng, dtype, size):
            assert_bitwise(got, exp, name)
stats = {}
for name in ("_k_par", "_k_batch", "_pack8"):
    d = getattr(_numba, name)
    stats[name] = {"hits": sum(d.stats.cache_hits.values()), "misses": sum(d.stats.cache_misses.values())}
for key, compiled in _numba._workers.items():
    if isinstance(key, tuple):
        stats[key[0].__name__] = {"hits": compiled.cache_hits}
print(json.dumps(stats))
"""


@pytest.mark.slow
@pytest.mark.heavy  # two cold Numba processes compiling every kernel
def test_numba_kernels_cache_without_warnings_and_load_from_the_cache(tmp_path):
    # A fresh cache dir: every kernel compiles (under -W error, so a NumbaWarning such as "cannot
    # cache ... dynamic globals" fails the run), then a second process must load all of them.
    import os
    import re

    here = os.path.dirname(os.path.abspath(__file__))
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    workers = [f"_reduce_{s}" for s in ("f16", "f32", "f64", "i32", "i64")] + [f"_update_{s}" for s in ("f16", "f32", "f64")]

    def listing():
        return {p.relative_to(tmp_path).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()}

    cold, _ = _run_probe(_CACHE_PROBE, env, here)
    assert set(workers) <= set(cold), cold
    assert cold["_k_par"]["misses"] == 1 and cold["_k_batch"]["misses"] == 1, cold
    assert cold["_pack8"]["misses"] == 5, cold  # one per dtype
    files = listing()
    for fn in ["_k_par", "_k_batch", "_pack8", *workers]:
        assert any(re.search(rf"\.{fn}-\d+\..*\.nbi$", f) for f in files), f"no cache index for {fn}: {sorted(files)}"

    warm, _ = _run_probe(_CACHE_PROBE, env, here)
    assert warm["_k_par"] == {"hits": 1, "misses": 0}, warm
    assert warm["_k_batch"] == {"hits": 1, "misses": 0}, warm
    assert warm["_pack8"] == {"hits": 5, "misses": 0}, warm
    for fn in workers:
        assert warm[fn]["hits"] == 1, (fn, warm)
    assert listing() == files, "the warm run wrote to the cache"


# ---------------------------------------------------------------------------- out of place, batched, fused
# Where a buffer lives: a fresh array, one element past a 64-byte boundary (an offset view into a
# larger array), or one byte past it (not even aligned to the element size).
LAYOUTS = ["fresh", "offset", "unaligned"]


def placed(a, layout):
    """A copy of ``a`` (same shape and dtype, C-contiguous) laid out as ``layout`` says."""
    a = np.asarray(a)  # random_array gives a NumPy scalar for shape ()
    if layout == "fresh":
        return a.copy()
    skip_bytes = a.itemsize if layout == "offset" else 1
    raw = np.empty(a.nbytes + 64 + skip_bytes, np.uint8)
    start = (-raw.ctypes.data) % 64 + skip_bytes
    out = np.ndarray(a.shape, a.dtype, raw.data, start)
    out[...] = a
    assert out.flags.c_contiguous and out.flags.writeable
    return out


def read_only(a):
    a.flags.writeable = False
    return a


def bits(a):
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


out_case = dict(
    case,
    op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN, "sum", "mean"]),
    layout=st.sampled_from(LAYOUTS),
    ro=st.booleans(),
    in_place=st.sampled_from(["none", "some", "all"]),
)


@FAST
@given(**out_case)
def test_all_reduce_out_of_place_matches_reference(backend, op, dtype, n, shape, seed, layout, ro, in_place):
    rng = np.random.default_rng(seed)
    bufs = [placed(random_array(rng, shape, dtype), layout) for _ in range(n)]
    before = [b.copy() for b in bufs]
    expected = reference_reduce(before, ReduceOp.parse(op))
    outs = [placed(random_array(rng, shape, dtype), layout) for _ in range(n)]
    aliased = {"none": set(), "some": set(range(0, n, 2)), "all": set(range(n))}[in_place]
    for i in aliased:
        outs[i] = bufs[i]
    if ro and in_place == "none":
        bufs = [read_only(b) for b in bufs]  # out of place, inputs are only read
    got = backend.all_reduce(bufs, op, outputs=outs)
    assert isinstance(got, tuple) and len(got) == n and all(g is o for g, o in zip(got, outs))
    for i, o in enumerate(outs):
        assert_bitwise(o, expected, f"{backend.name} all_reduce out of place {op} output {i}")
    for i, (b, b0) in enumerate(zip(bufs, before)):
        if i not in aliased:
            assert_bitwise(b, b0, f"input {i} must not change")


#: The leaves of one replica for the batched kernels: scalars, empty, odd and multi-dimensional.
LEAF_SHAPES = st.lists(st.sampled_from([(), (0,), (1,), (7,), (3, 5), (1023,), (4097,), (2, 3, 7)]), min_size=1, max_size=6)


@FAST
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 8),
    leaf_shapes=LEAF_SHAPES,
    op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN]),
    layout=st.sampled_from(LAYOUTS),
    ro=st.booleans(),
    in_place=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_batch_all_reduce_matches_reference(backend, dtype, n, leaf_shapes, op, layout, ro, in_place, seed):
    rng = np.random.default_rng(seed)
    inputs = [[placed(random_array(rng, s, dtype), layout) for s in leaf_shapes] for _ in range(n)]
    before = [[a.copy() for a in leaves] for leaves in inputs]
    expected = [reference_reduce([before[r][j] for r in range(n)], op) for j in range(len(leaf_shapes))]
    if in_place:
        outputs = [list(leaves) for leaves in inputs]
    else:
        outputs = [[placed(random_array(rng, s, dtype), layout) for s in leaf_shapes] for _ in range(n)]
        if ro:
            inputs = [[read_only(a) for a in leaves] for leaves in inputs]
    got = backend.batch_all_reduce(inputs, outputs, op)
    assert isinstance(got, tuple) and len(got) == n
    for r in range(n):
        assert all(g is o for g, o in zip(got[r], outputs[r]))
        for j, exp in enumerate(expected):
            assert_bitwise(outputs[r][j], exp, f"{backend.name} batch_all_reduce {op} replica {r} leaf {j}")
            if not in_place:
                assert_bitwise(inputs[r][j], before[r][j], f"input leaf {j} of replica {r} must not change")


@FAST
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 8),
    leaf_shapes=LEAF_SHAPES,
    op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN]),
    layout=st.sampled_from(LAYOUTS),
    ro=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_batch_reduce_to_one_matches_reference(backend, dtype, n, leaf_shapes, op, layout, ro, seed):
    """Every leaf reduced as reduce_to_one reduces it, the results back to back in one 1-d output."""
    rng = np.random.default_rng(seed)
    inputs = [[placed(random_array(rng, s, dtype), layout) for s in leaf_shapes] for _ in range(n)]
    if ro:
        inputs = [[read_only(a) for a in leaves] for leaves in inputs]
    before = [[a.copy() for a in leaves] for leaves in inputs]
    total = sum(int(np.prod(s)) for s in leaf_shapes)
    out = random_array(rng, (total,), dtype)  # garbage to overwrite
    assert backend.batch_reduce_to_one(inputs, op, out=out) is out
    fresh = backend.batch_reduce_to_one(inputs, op)
    off = 0
    for j, shape in enumerate(leaf_shapes):
        size = int(np.prod(shape))
        exp = reference_reduce([before[r][j] for r in range(n)], op)
        assert_bitwise(out[off : off + size].reshape(shape), exp, f"{backend.name} batch_reduce_to_one {op} leaf {j}")
        assert_bitwise(fresh[off : off + size].reshape(shape), exp, f"{backend.name} batch_reduce_to_one {op} leaf {j} (new out)")
        off += size
    for r in range(n):
        for j in range(len(leaf_shapes)):
            assert_bitwise(inputs[r][j], before[r][j], f"input leaf {j} of replica {r} must not change")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_batch_reduce_to_one_many_leaves_one_call(backend, dtype, op):
    # Many small leaves and a few large ones (more than 16 MiB written: the streaming, parallel path), ragged.
    rng = np.random.default_rng(32)
    shapes = [(k % 13,) for k in range(60)] + [(2_100_007,), (5, 8209), (1_000_003,)]
    n = 3
    inputs = [[random_array(rng, s, dtype) for s in shapes] for _ in range(n)]
    out = backend.batch_reduce_to_one(inputs, op)
    off = 0
    for j, shape in enumerate(shapes):
        size = int(np.prod(shape))
        assert_bitwise(out[off : off + size].reshape(shape), reference_reduce([inputs[r][j] for r in range(n)], op), f"leaf {j}")
        off += size


def test_batch_reduce_to_one_agrees_bit_for_bit_across_cpu_backends():
    rng = np.random.default_rng(33)
    for dtype in DTYPES:
        inputs = [[np.asarray(random_array(rng, s, dtype)) for s in [(17,), (3, 1001), (), (64,)]] for _ in range(5)]
        outs = [get_backend(name).batch_reduce_to_one(inputs, "mean") for name in ("numpy", "numba", "native")]
        for o in outs[1:]:
            assert_bitwise(o, outs[0], f"{dtype} batch_reduce_to_one across backends")


def test_error_batch_reduce_to_one_names_the_problem(backend):
    a, b = _f32(4), _f32(3)
    with pytest.raises(ValueError, match="input replica 1 has 1 leaves but input replica 0 has 2"):
        backend.batch_reduce_to_one([[a, b], [a]])
    with pytest.raises(ValueError, match=r"input leaf 1 of replica 1 has shape \(4,\) but input leaf 1 of replica 0 has shape \(3,\)"):
        backend.batch_reduce_to_one([[a, b], [a, _f32(4)]])
    with pytest.raises(TypeError, match="input leaf 1 of replica 0 has dtype float64 .* one dtype"):
        backend.batch_reduce_to_one([[a, np.ones(3)], [a, np.ones(3)]])
    with pytest.raises(ValueError, match="out must be a 1-d float32 array of 7 elements .* got float32 of shape \\(6,\\)"):
        backend.batch_reduce_to_one([[a, b], [a, b]], out=_f32(6))
    with pytest.raises(ValueError, match=r"out must be a 1-d float32 array of 7 elements .* got float64"):
        backend.batch_reduce_to_one([[a, b], [a, b]], out=np.zeros(7))
    with pytest.raises(ValueError, match=r"got float32 of shape \(7, 1\)"):
        backend.batch_reduce_to_one([[a, b], [a, b]], out=_f32(7, 1))
    with pytest.raises(ValueError, match="out is read-only"):
        backend.batch_reduce_to_one([[a, b], [a, b]], out=read_only(_f32(7)))
    big = _f32(7)
    with pytest.raises(ValueError, match="out overlaps input leaf 0 of replica 1"):
        backend.batch_reduce_to_one([[a, b], [big[:4], b]], out=big)
    with pytest.raises(ValueError, match="expected at least one leaf per replica"):
        backend.batch_reduce_to_one([[], []])
    with pytest.raises(ValueError, match="expected at least one replica"):
        backend.batch_reduce_to_one([])
    with pytest.raises(ValueError, match="unknown reduce op"):
        backend.batch_reduce_to_one([[a]], "max")


def test_native_batch_reduce_to_one_binding_checks_its_arguments():
    """The trusted entry point (the extension function) still refuses what would crash or write out of bounds."""
    from cudist import _core

    a, b = _f32(4), _f32(3)
    with pytest.raises(ValueError, match="out has 6 elements but the 2 leaves of a replica have 7"):
        _core.batch_reduce_to_one([[a, b], [a, b]], ReduceOp.SUM, _f32(6))
    with pytest.raises(TypeError, match="out has dtype float64 but the leaves have dtype float32"):
        _core.batch_reduce_to_one([[a, b], [a, b]], ReduceOp.SUM, np.zeros(7))
    with pytest.raises(ValueError, match="input leaf 1 of replica 1 has 4 elements but input leaf 1 of replica 0 has 3"):
        _core.batch_reduce_to_one([[a, b], [a, a]], ReduceOp.SUM, _f32(7))
    with pytest.raises(ValueError, match="out 0 is read-only"):
        _core.batch_reduce_to_one([[a, b], [a, b]], ReduceOp.SUM, read_only(_f32(7)))
    with pytest.raises(ValueError, match="expected at least one leaf per replica"):
        _core.batch_reduce_to_one([[], []], ReduceOp.SUM, _f32(0))
    with pytest.raises(TypeError, match="inputs must be a tuple or list"):
        _core.batch_reduce_to_one(a, ReduceOp.SUM, _f32(4))
    # an input inside the output region goes through a temporary: the result is still exact
    big = random_array(np.random.default_rng(3), (7,), np.float32)
    want = [reference_reduce([big[:4].copy(), a], ReduceOp.SUM), reference_reduce([big[4:].copy(), b], ReduceOp.SUM)]
    _core.batch_reduce_to_one([[big[:4], big[4:]], [a, b]], ReduceOp.SUM, big)
    assert_bitwise(big[:4], want[0], "input overlapping out, leaf 0")
    assert_bitwise(big[4:], want[1], "input overlapping out, leaf 1")


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_all_reduce_many_leaves_one_call(backend, dtype):
    # Many small leaves and a few large ones (more than 4 MiB moved: the parallel paths), ragged.
    rng = np.random.default_rng(31)
    shapes = [(k % 13,) for k in range(60)] + [(300007,), (5, 8209)]
    n = 3
    inputs = [[random_array(rng, s, dtype) for s in shapes] for _ in range(n)]
    outputs = [[np.empty(s, dtype) for s in shapes] for _ in range(n)]
    backend.batch_all_reduce(inputs, outputs, "sum")
    for j in range(len(shapes)):
        exp = reference_reduce([inputs[r][j] for r in range(n)], ReduceOp.SUM)
        for r in range(n):
            assert_bitwise(outputs[r][j], exp, f"leaf {j} replica {r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_all_reduce_out_of_place_large_multithreaded(backend, dtype, op):
    rng = np.random.default_rng(12)
    bufs = [read_only(random_array(rng, (300007,), dtype)) for _ in range(4)]
    outs = [np.empty(300007, dtype) for _ in range(4)]
    expected = reference_reduce(bufs, op)
    backend.all_reduce(bufs, op, outputs=outs)
    for i, o in enumerate(outs):
        assert_bitwise(o, expected, f"{backend.name} large out-of-place all_reduce output {i}")


def _grads_case(rng, shape, dtype, m, layout, ro):
    grads = [placed(random_array(rng, shape, dtype), layout) for _ in range(m)]
    return [read_only(g) for g in grads] if ro else grads


fused_case = dict(
    dtype=st.sampled_from(FLOATS),
    n=st.integers(1, 8),
    m=st.integers(1, 8),
    shape=shapes(),
    seed=st.integers(0, 2**32 - 1),
    layout=st.sampled_from(LAYOUTS),
    ro=st.booleans(),
)


def _check_fused(backend, what, got, expected):
    for name, g_list, e_list in zip(what, got, expected):
        for i, (g, e) in enumerate(zip(g_list, e_list)):
            assert_bitwise(g, e, f"{backend.name} {name} copy {i}")


@FAST
@given(lr=st.floats(1e-4, 1.0), **fused_case)
def test_all_reduce_sgd_matches_reduce_then_sgd(backend, lr, dtype, n, m, shape, seed, layout, ro):
    rng = np.random.default_rng(seed)
    copies = [placed(c, layout) for c in mirrors(rng, shape, dtype, n)]
    grads = _grads_case(rng, shape, dtype, m, layout, ro)
    exp = [c.copy() for c in copies]
    REF.sgd(exp, REF.reduce_to_one(grads, "sum"), lr=lr)
    # The same backend's two-step form must agree too (it is the definition).
    two = [c.copy() for c in copies]
    backend.sgd(two, backend.reduce_to_one(grads, "sum"), lr=lr)
    out = backend.all_reduce_sgd(copies, grads, lr=lr)
    assert isinstance(out, tuple) and all(o is c for o, c in zip(out, copies))
    _check_fused(backend, ["all_reduce_sgd", "two-step sgd"], [copies, two], [exp, exp])


@FAST
@given(lr=st.floats(1e-4, 1.0), momentum=st.floats(0.0, 0.99), nesterov=st.booleans(), **fused_case)
def test_all_reduce_momentum_matches_reduce_then_momentum(backend, lr, momentum, nesterov, dtype, n, m, shape, seed, layout, ro):
    rng = np.random.default_rng(seed)
    copies = [placed(c, layout) for c in mirrors(rng, shape, dtype, n)]
    vels = [placed(v, layout) for v in mirrors(rng, shape, dtype, n)]
    grads = _grads_case(rng, shape, dtype, m, layout, ro)
    exp_w, exp_v = [c.copy() for c in copies], [v.copy() for v in vels]
    REF.momentum(exp_w, exp_v, REF.reduce_to_one(grads, "sum"), lr=lr, momentum=momentum, nesterov=nesterov)
    backend.all_reduce_momentum(copies, vels, grads, lr=lr, momentum=momentum, nesterov=nesterov)
    _check_fused(backend, ["all_reduce_momentum w", "all_reduce_momentum v"], [copies, vels], [exp_w, exp_v])


@FAST
@given(
    lr=st.floats(1e-4, 0.1),
    beta_1=st.floats(0.5, 0.99),
    beta_2=st.floats(0.9, 0.9999),
    epsilon=st.sampled_from([1e-7, 1e-3]),
    step=st.integers(1, 10_000),
    **fused_case,
)
def test_all_reduce_adam_matches_reduce_then_adam(backend, lr, beta_1, beta_2, epsilon, step, dtype, n, m, shape, seed, layout, ro):
    rng = np.random.default_rng(seed)
    copies = [placed(c, layout) for c in mirrors(rng, shape, dtype, n)]
    ms = [placed(c, layout) for c in mirrors(rng, shape, dtype, n)]
    vs = [placed(c, layout) for c in mirrors(rng, shape, dtype, n, positive=True)]
    grads = _grads_case(rng, shape, dtype, m, layout, ro)
    exp = [[a.copy() for a in x] for x in (copies, ms, vs)]
    kw = dict(lr=lr, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, step=step)
    REF.adam(*exp, REF.reduce_to_one(grads, "sum"), **kw)
    backend.all_reduce_adam(copies, ms, vs, grads, **kw)
    _check_fused(backend, ["all_reduce_adam w", "all_reduce_adam m", "all_reduce_adam v"], [copies, ms, vs], exp)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n, m", [(4, 4), (1, 4), (4, 1), (3, 7)])
def test_fused_updates_large_multithreaded(backend, dtype, n, m):
    rng = np.random.default_rng(17)
    shape = (300007,)
    grads = [random_array(rng, shape, dtype) for _ in range(m)]
    g = REF.reduce_to_one(grads, "sum")
    w, v, s = mirrors(rng, shape, dtype, n), mirrors(rng, shape, dtype, n), mirrors(rng, shape, dtype, n, positive=True)
    exp = [[a.copy() for a in x] for x in (w, v, s)]
    REF.adam(*exp, g, lr=1e-3, step=9)
    backend.all_reduce_adam(w, v, s, grads, lr=1e-3, step=9)
    _check_fused(backend, ["adam w", "adam m", "adam v"], [w, v, s], exp)
    ew, ev = [a.copy() for a in w], [a.copy() for a in v]
    REF.momentum(ew, ev, g, lr=0.05, momentum=0.9)
    backend.all_reduce_momentum(w, v, grads, lr=0.05, momentum=0.9)
    _check_fused(backend, ["momentum w", "momentum v"], [w, v], [ew, ev])
    ew = [a.copy() for a in w]
    REF.sgd(ew, g, lr=0.3)
    backend.all_reduce_sgd(w, grads, lr=0.3)
    _check_fused(backend, ["sgd w"], [w], [ew])


def test_fused_float16_gradient_sum_rounds_once(backend):
    # The gradient sum is taken as reduce_to_one takes it: in float32, rounded once to float16
    # (2048 + 1 + 1 + 1 = 2051 -> 2052), then applied.
    grads = [np.array([2048.0], np.float16)] + [np.array([1.0], np.float16)] * 3
    w = [np.array([0.0], np.float16) for _ in range(2)]
    backend.all_reduce_sgd(w, grads, lr=1.0)
    assert w[0].tolist() == [-2052.0] and w[1].tolist() == [-2052.0]
    # Rounded before the update, not applied unrounded: 0.1 * 2051 and 0.1 * 2052 differ in float16.
    w = [np.array([0.0], np.float16) for _ in range(2)]
    backend.all_reduce_sgd(w, grads, lr=0.1)
    assert w[0].tolist() == [float(np.float16(-np.float32(0.1) * np.float32(2052)))]


def test_fused_update_with_the_same_gradient_object_from_every_replica(backend):
    rng = np.random.default_rng(4)
    g = random_array(rng, (1000,), "float32")
    w = mirrors(rng, (1000,), "float32", 2)
    exp = [c.copy() for c in w]
    REF.sgd(exp, REF.reduce_to_one([g, g, g], "sum"), lr=0.1)
    backend.all_reduce_sgd(w, [g, g, g], lr=0.1)
    _check_fused(backend, ["sgd"], [w], [exp])


# ---------------------------------------------------------------------------- the trusted entry points
def test_trusted_kernels_match_the_public_methods(backend):
    t = backend.trusted
    assert t is backend.trusted, "one TrustedKernels per backend"
    rng = np.random.default_rng(8)
    shape, n, S = (3, 37), 3, ReduceOp.SUM
    for dtype in DTYPES:
        ins = tuple(random_array(rng, shape, dtype) for _ in range(n))
        exp = reference_reduce(ins, ReduceOp.MEAN)
        outs = tuple(np.empty(shape, dtype) for _ in range(n))
        assert t.all_reduce(ins, outs, ReduceOp.MEAN) is None
        for o in outs:
            assert_bitwise(o, exp, f"{backend.name} trusted all_reduce")
        inplace = tuple(a.copy() for a in ins)
        t.all_reduce(inplace, inplace, ReduceOp.MEAN)
        for o in inplace:
            assert_bitwise(o, exp, f"{backend.name} trusted all_reduce in place")
        leaves = [(a, a[1:].copy()) for a in ins]
        louts = [tuple(np.empty_like(x) for x in lv) for lv in leaves]
        t.batch_all_reduce(leaves, louts, S)
        for lo in louts:
            assert_bitwise(lo[0], reference_reduce(ins, S), "trusted batch leaf 0")
            assert_bitwise(lo[1], reference_reduce([lv[1] for lv in leaves], S), "trusted batch leaf 1")
        out = np.empty(shape, dtype)
        t.reduce_to_one(ins, S, out)
        assert_bitwise(out, reference_reduce(ins, S), "trusted reduce_to_one")
        dsts = tuple(np.empty(shape, dtype) for _ in range(n))
        t.broadcast(ins[0], dsts)
        t.assign(dsts, ins[1])
        for d in dsts:
            assert_bitwise(d, ins[1], "trusted assign")
        t.assign_add(dsts, ins[2], True)
        for d in dsts:
            assert_bitwise(d, ins[1] - ins[2], "trusted assign_add(negate)")
        if dtype not in FLOATS:
            continue
        grads = tuple(random_array(rng, shape, dtype) for _ in range(2))
        g = reference_reduce(grads, S)
        for fused in (False, True):
            w, v, s = (tuple(mirrors(rng, shape, dtype, n, positive=k == 2)) for k in range(3))
            ew, ev, es = ([a.copy() for a in x] for x in (w, v, s))
            REF.adam(ew, ev, es, g, lr=0.01, step=4)
            lr_t = bias_corrected_lr(0.01, 0.9, 0.999, 4)
            if fused:  # Adam: the adamw row with the weight decay 0
                t.all_reduce_adamw(w, v, s, grads, lr_t, 0.9, 0.999, 1e-7, 0.0)
            else:
                t.adamw(w, v, s, g, lr_t, 0.9, 0.999, 1e-7, 0.0)
            _check_fused(backend, ["trusted adam w", "m", "v"], [w, v, s], [ew, ev, es])
            REF.momentum(ew, ev, g, lr=0.1, momentum=0.9, nesterov=True)
            if fused:
                t.all_reduce_nesterov(w, v, grads, 0.1, 0.9, 0.0)
            else:
                t.nesterov(w, v, g, 0.1, 0.9, 0.0)
            _check_fused(backend, ["trusted momentum w", "v"], [w, v], [ew, ev])
            REF.sgd(ew, g, lr=0.2)
            if fused:
                t.all_reduce_sgd(w, grads, 0.2, 0.0)
            else:
                t.sgd(w, g, 0.2, 0.0)
            _check_fused(backend, ["trusted sgd w"], [w], [ew])


def test_trusted_check_bufs_is_the_public_validation(backend):
    t = backend.trusted
    a, b = _f32(4), _f32(4)
    assert t.check_bufs("x", [a, b], writable=True) == (a, b)
    assert backend.check_bufs("x", (a,), writable=False) == (a,)
    with pytest.raises(ValueError, match=r"step: velocity 1 has shape \(5,\) but velocity 0 has shape \(4,\)"):
        t.check_bufs("step", [a, _f32(5)], writable=True, what="velocity")
    assert t.check_bufs("x", [a, _f32(5)], writable=False, same_shape=False)[1].shape == (5,)
    ro = read_only(_f32(4))
    with pytest.raises(ValueError, match="replica 1 is read-only"):
        t.check_bufs("x", [a, ro], writable=True)


def test_trusted_call_is_cheap(backend):
    # The point of the trusted path: no per-call validation. Generous bound (shared, loaded CI cores).
    import time

    t = backend.trusted
    ins = tuple(np.ones(1024, np.float32) for _ in range(4))
    outs = tuple(np.empty(1024, np.float32) for _ in range(4))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            t.all_reduce(ins, outs, ReduceOp.SUM)
        best = min(best, (time.perf_counter() - t0) / 200)
    limit = {"native": 20e-6, "numba": 100e-6, "numpy": 200e-6}[backend.name]
    assert best < limit, f"{backend.name}: trusted 4 x 4 KiB all_reduce took {best * 1e6:.1f} us"


# ---------------------------------------------------------------------------- errors of the new forms
def test_error_out_of_place_overlaps_are_named(backend):
    a, b, c = _f32(8, seed=1), _f32(8, seed=2), _f32(8, seed=3)
    with pytest.raises(ValueError, match=r"all_reduce: output 1 overlaps input 0 \(an output may share memory only"):
        backend.all_reduce([a, b], outputs=[c, a])
    with pytest.raises(ValueError, match="output 1 overlaps output 0"):
        backend.all_reduce([a, b], outputs=[c, c])
    base = _f32(9)
    with pytest.raises(ValueError, match="output 0 overlaps input 0"):  # its own input, but shifted
        backend.all_reduce([base[:8], b], outputs=[base[1:], c])
    with pytest.raises(ValueError, match="output 1 overlaps output 0"):
        backend.all_reduce([a, b], outputs=[base[:8], base[1:]])
    assert backend.all_reduce([a, a], outputs=[b, c]) == (b, c)  # inputs may overlap each other
    assert_bitwise(b, a + a, "the same input twice")


def test_error_out_of_place_shape_dtype_count(backend):
    a, b = _f32(4), _f32(4)
    with pytest.raises(ValueError, match="got 2 inputs but 1 outputs"):
        backend.all_reduce([a, b], outputs=[_f32(4)])
    with pytest.raises(ValueError, match=r"the outputs have shape \(5,\) but the inputs have shape \(4,\)"):
        backend.all_reduce([a, b], outputs=[_f32(5), _f32(5)])
    with pytest.raises(TypeError, match="the outputs have dtype float64 but the inputs have dtype float32"):
        backend.all_reduce([a, b], outputs=[np.ones(4), np.ones(4)])
    with pytest.raises(ValueError, match=r"output 1 has shape \(5,\) but output 0 has shape \(4,\)"):
        backend.all_reduce([a, b], outputs=[_f32(4), _f32(5)])
    with pytest.raises(ValueError, match="output 0 is read-only"):
        backend.all_reduce([a, b], outputs=[read_only(_f32(4)), _f32(4)])
    with pytest.raises(ValueError, match="output 1 is not C-contiguous"):
        backend.all_reduce([a, b], outputs=[_f32(4), _f32(8)[::2]])
    with pytest.raises(TypeError, match="expected a list of output arrays"):
        backend.all_reduce([a, b], outputs=_f32(4))
    ro = read_only(_f32(4))
    with pytest.raises(ValueError, match="replica 0 is read-only"):  # in place needs writeable buffers
        backend.all_reduce([ro, b], outputs=[ro, b])


def test_error_batch_all_reduce_names_the_leaf(backend):
    a, b = _f32(4), _f32(3)
    ok_out = [[_f32(4), _f32(3)], [_f32(4), _f32(3)]]
    with pytest.raises(ValueError, match="got 2 input replicas but 1 output replicas"):
        backend.batch_all_reduce([[a, b], [a, b]], [[_f32(4), _f32(3)]])
    with pytest.raises(ValueError, match="input replica 1 has 1 leaves but input replica 0 has 2"):
        backend.batch_all_reduce([[a, b], [a]], ok_out)
    with pytest.raises(ValueError, match="output replica 0 has 1 leaves"):
        backend.batch_all_reduce([[a, b], [a, b]], [[_f32(4)], [_f32(4), _f32(3)]])
    with pytest.raises(ValueError, match=r"input leaf 1 of replica 1 has shape \(4,\) but input leaf 1 of replica 0 has shape \(3,\)"):
        backend.batch_all_reduce([[a, b], [a, _f32(4)]], ok_out)
    with pytest.raises(ValueError, match=r"output leaf 0 of replica 1 has shape \(3,\)"):
        backend.batch_all_reduce([[a, b], [a, b]], [[_f32(4), _f32(3)], [_f32(3), _f32(3)]])
    with pytest.raises(TypeError, match="input leaf 1 of replica 0 has dtype float64 .* one dtype"):
        backend.batch_all_reduce([[a, np.ones(3)], [a, np.ones(3)]], ok_out)
    with pytest.raises(ValueError, match="output leaf 1 of replica 0 is read-only"):
        backend.batch_all_reduce([[a, b], [a, b]], [[_f32(4), read_only(_f32(3))], [_f32(4), _f32(3)]])
    with pytest.raises(ValueError, match="output leaf 0 of replica 1 overlaps input leaf 0 of replica 0"):
        backend.batch_all_reduce([[a, b], [_f32(4), b]], [[_f32(4), _f32(3)], [a, _f32(3)]])
    with pytest.raises(ValueError, match="expected at least one replica"):
        backend.batch_all_reduce([], [])
    with pytest.raises(TypeError, match=r"inputs\[1\] must be a list of leaf arrays"):
        backend.batch_all_reduce([[a], a], ok_out)
    with pytest.raises(ValueError, match="unknown reduce op"):
        backend.batch_all_reduce([[a]], [[_f32(4)]], "max")
    assert backend.batch_all_reduce([[], []], [[], []]) == ((), ())  # no leaves: nothing to do


def test_error_fused_updates_name_the_problem(backend):
    w = [_f32(4), _f32(4)]
    v = [_f32(4), _f32(4)]
    with pytest.raises(ValueError, match=r"all_reduce_sgd: the gradients have shape \(5,\) but the copies have shape \(4,\)"):
        backend.all_reduce_sgd(w, [_f32(5)], lr=0.1)
    with pytest.raises(TypeError, match="all_reduce_sgd: the gradients have dtype float64 but the copies have dtype float32"):
        backend.all_reduce_sgd(w, [np.ones(4)], lr=0.1)
    with pytest.raises(ValueError, match=r"gradient 1 has shape \(5,\) but gradient 0 has shape \(4,\)"):
        backend.all_reduce_sgd(w, [_f32(4), _f32(5)], lr=0.1)
    with pytest.raises(ValueError, match="expected at least one gradient array"):
        backend.all_reduce_sgd(w, [], lr=0.1)
    with pytest.raises(ValueError, match="all_reduce_momentum: velocity copy 1 overlaps gradient 0; the gradients must not"):
        backend.all_reduce_momentum(w, v, [v[1]], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="copy 0 overlaps gradient 1"):
        backend.all_reduce_sgd(w, [_f32(4), w[0]], lr=0.1)
    with pytest.raises(ValueError, match="got 2 variable copies but 1 velocity copies"):
        backend.all_reduce_momentum(w, [_f32(4)], [_f32(4)], lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="needs a floating-point dtype, got int32"):
        backend.all_reduce_sgd([np.ones(4, np.int32)], [np.ones(4, np.int32)], lr=0.1)
    with pytest.raises(ValueError, match="all_reduce_adam: step must be >= 1"):
        backend.all_reduce_adam(w, [_f32(4)] * 2, [_f32(4)] * 2, [_f32(4)], lr=0.1, step=0)
    with pytest.raises(ValueError, match="copy 1 is read-only"):
        backend.all_reduce_sgd([_f32(4), read_only(_f32(4))], [_f32(4)], lr=0.1)
    before = [c.copy() for c in w]
    with pytest.raises(ValueError):
        backend.all_reduce_sgd(w, [_f32(4), w[1]], lr=0.1)
    for c, c0 in zip(w, before):
        assert_bitwise(c, c0, "a rejected call must not write")


# ---------------------------------------------------------------------------- backend_for
def test_backend_for_picks_the_cpu_backend_once(monkeypatch):
    import cudist._kernels as K

    K.reset_backend_cache()
    try:
        monkeypatch.setenv("CUDIST_BACKEND", "numpy")
        assert K.backend_for(np.ones(2)).name == "numpy"
        monkeypatch.setenv("CUDIST_BACKEND", "numba")
        assert K.backend_for(np.ones(2)).name == "numpy", "chosen once per process"
        assert K.cpu_backend() is K.backend_for(1.5)  # not a GPU array: the CPU backend
        K.reset_backend_cache()
        assert K.backend_for(np.ones(2)).name == "numba"
        K.reset_backend_cache()
        monkeypatch.setenv("CUDIST_BACKEND", "cupy")  # a GPU choice does not apply to host buffers
        if "cupy" not in K.available_backends():
            with pytest.raises(K.BackendUnavailableError):
                K.cpu_backend()
        else:
            assert K.cpu_backend() is K.default_cpu_backend()
        assert K.numpy_backend().name == "numpy"
    finally:
        K.reset_backend_cache()
