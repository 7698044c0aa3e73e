"""Tests specific to the native backend (the C++ extension ``cudist._core``).

The property tests every backend shares live in test_kernels.py; here: bit-identity with the NumPy
reference on the parallel and streaming paths, thread counts, the released GIL, concurrent callers,
overlapping buffers, float16 rounding, the extension's own argument checks, fork safety, resizing
the pool while kernels run, and arrays kept alive while a kernel runs without the GIL.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import cudist
from cudist import _core
from cudist._kernels import get_backend
from cudist._kernels._native import NativeBackend, num_threads, set_num_threads
from cudist._reduce_util import ReduceOp

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
FLOATS = ["float16", "float32", "float64"]
# 2 x 300_001 float32 is ~2.4 MB of traffic: above the inline threshold (1 MiB), so the work is
# split over several chunks and threads; 300_001 is odd, so the last chunk has a scalar tail.
BIG = 300_001


@pytest.fixture
def native():
    return get_backend("native")


@pytest.fixture
def ref():
    return get_backend("numpy")


@pytest.fixture
def threads():
    """Restores the thread count after a test changes it."""
    before = num_threads()
    yield
    set_num_threads(before)


@pytest.fixture(params=["default", "always"])
def streaming(request):
    """Runs a test with the default streaming-store threshold and with streaming forced on."""
    old = _core.set_streaming_threshold(0) if request.param == "always" else None
    yield request.param
    if old is not None:
        _core.set_streaming_threshold(old)


def rand(rng, dtype, shape):
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        info = np.iinfo(dtype)  # the full range, so sums wrap around
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    scale = 100.0 if dtype != np.float16 else 20.0
    return (rng.standard_normal(shape) * scale).astype(dtype)


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"max abs diff {np.max(np.abs(a.astype(float) - b))}"


def test_extension_metadata():
    assert _core.__version__ == cudist.__version__
    assert isinstance(get_backend("native"), NativeBackend)
    assert get_backend("native").name == "native"
    assert _core.hardware_threads() >= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_all_reduce_large_matches_reference(native, ref, streaming, dtype, n, op):
    rng = np.random.default_rng(hash((dtype, n, op.name)) % 2**32)
    bufs = [rand(rng, dtype, (BIG,)) for _ in range(n)]
    want = [b.copy() for b in bufs]
    ref.all_reduce(want, op)
    got = [b.copy() for b in bufs]
    native.all_reduce(got, op)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    out = np.empty_like(bufs[0])
    native.reduce_to_one(bufs, op, out=out)
    assert_bits_equal(out, want[0])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_updates_large_match_reference(native, ref, streaming, dtype, n):
    rng = np.random.default_rng(n)
    w, g = rand(rng, dtype, (BIG,)), rand(rng, dtype, (BIG,))
    m, v = rand(rng, dtype, (BIG,)), np.abs(rand(rng, dtype, (BIG,)))
    cases = [
        ("sgd", 0, dict(lr=0.01)),
        ("momentum", 1, dict(lr=0.01, momentum=0.9, nesterov=False)),
        ("momentum", 1, dict(lr=0.01, momentum=0.9, nesterov=True)),
        ("adam", 2, dict(lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step=5)),
    ]
    for method, nslots, kw in cases:
        results = []
        for backend in (ref, native):
            copies = [w.copy() for _ in range(n)]
            slots = [[s.copy() for _ in range(n)] for s in (m, v)[:nslots]]
            getattr(backend, method)(copies, *slots, g, **kw)
            results.append([copies, *slots])
        for want, got in zip(*results):
            for a, b in zip(want, got):
                assert_bits_equal(b, a)
    for method in ("assign_add", "assign_sub", "assign"):
        want = getattr(ref, method)([w.copy() for _ in range(n)], g)
        got = getattr(native, method)([w.copy() for _ in range(n)], g)
        for a, b in zip(want, got):
            assert_bits_equal(b, a)


@pytest.mark.parametrize("dtype", FLOATS)
def test_updates_with_copies_passed_more_than_once(native, ref, streaming, dtype):
    # The same buffer as several mirrors (the kernel writes it once): results must equal those of
    # distinct mirrors, on the parallel and the streaming paths, the repeats at any position.
    rng = np.random.default_rng(7)
    w, g = rand(rng, dtype, (BIG,)), rand(rng, dtype, (BIG,))
    m, v = rand(rng, dtype, (BIG,)), np.abs(rand(rng, dtype, (BIG,)))
    layout = [0, 1, 0, 2, 1]  # mirror i is buffer layout[i]
    cases = [
        ("sgd", 0, dict(lr=0.01)),
        ("momentum", 1, dict(lr=0.01, momentum=0.9, nesterov=True)),
        ("adam", 2, dict(lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step=3)),
        ("assign_add", 0, {}),
        ("assign_sub", 0, {}),
    ]
    for method, nslots, kw in cases:
        want_copies = [w.copy() for _ in layout]
        want_slots = [[s.copy() for _ in layout] for s in (m, v)[:nslots]]
        getattr(ref, method)(want_copies, *want_slots, g, **kw)
        bufs = [[x.copy() for _ in range(3)] for x in (w, m, v)[: nslots + 1]]
        # Each slot aliased differently, so a slot's repeats never line up with another's.
        mirrors = [[b[(j + k) % 3] for j in layout] for k, b in enumerate(bufs)]
        getattr(native, method)(mirrors[0], *mirrors[1:], g, **kw)
        for want, got in zip([want_copies, *want_slots], mirrors):
            for a, b in zip(want, got):
                assert_bits_equal(b, a)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_large_and_empty_pieces(native, axis):
    rng = np.random.default_rng(3)
    shapes = {0: [(700, 3, 129), (0, 3, 129), (555, 3, 129)],
              1: [(40, 7, 1001), (40, 0, 1001), (40, 5, 1001)],
              -1: [(3, 5, 20_001), (3, 5, 0), (3, 5, 7)]}[axis]
    bufs = [rand(rng, "float64", s) for s in shapes]
    assert_bits_equal(native.all_gather(bufs, axis), np.concatenate(bufs, axis=axis))


def test_num_threads(threads):
    set_num_threads(1)
    assert num_threads() == _core.num_threads() == 1
    set_num_threads(3)
    assert num_threads() == 3
    set_num_threads(0)
    assert num_threads() == _core.hardware_threads()
    with pytest.raises(ValueError, match="set_num_threads"):
        set_num_threads(-1)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int64"])
def test_results_identical_across_thread_counts(native, threads, dtype):
    rng = np.random.default_rng(11)
    bufs = [rand(rng, dtype, (BIG,)) for _ in range(4)]
    grad = rand(rng, dtype, (BIG,))
    results = []
    for t in (1, 2, 3, 0):
        set_num_threads(t)
        got = [b.copy() for b in bufs]
        native.all_reduce(got, "mean")
        if dtype != "int64":
            native.sgd(got, grad, lr=0.125)
        results.append(got[3])
    for r in results[1:]:
        assert_bits_equal(r, results[0])


def test_gil_is_released_during_a_large_kernel():
    # With a huge switch interval, a thread that holds the GIL keeps it until it blocks, so the
    # main thread can only run Python while the kernel runs if the kernel released the GIL.
    dst = np.zeros(1 << 20, np.float32)
    src = np.ones_like(dst)
    dsts = (dst,) * 100
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        overlapped = False
        for _ in range(5):
            state = {"started": False, "done": False}

            def work():
                state["started"] = True
                _core.broadcast(src, dsts)
                state["done"] = True

            t = threading.Thread(target=work)
            t.start()
            while not state["started"]:
                time.sleep(0.0005)
            seen_running = not state["done"]
            t.join()
            if seen_running:
                overlapped = True
                break
    finally:
        sys.setswitchinterval(old)
    assert overlapped, "the main thread never ran while the kernel did: the GIL was not released"
    assert np.all(dst == 1)


def test_concurrent_callers_get_correct_results(native, ref):
    # Two Python threads call large kernels at once: one gets the pool, the other runs inline.
    rng = np.random.default_rng(5)
    inputs = [[rand(rng, "float32", (BIG,)) for _ in range(4)] for _ in range(2)]
    want = []
    for bufs in inputs:
        w = [b.copy() for b in bufs]
        ref.all_reduce(w, "sum")
        want.append(w[0])
    errors = []

    def worker(k):
        try:
            for _ in range(10):
                got = [b.copy() for b in inputs[k]]
                native.all_reduce(got, "sum")
                for g in got:
                    assert_bits_equal(g, want[k])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("shift", [1, 1000])
def test_partially_overlapping_buffers(native, ref, shift):
    rng = np.random.default_rng(shift)
    n = 4000
    for backend_out in ("all_reduce", "broadcast", "sgd"):
        base = rand(rng, "float32", (n + shift,))
        results = []
        for backend in (ref, native):
            x = base.copy()
            a, b = x[:n], x[shift:]
            if backend_out == "all_reduce":
                backend.all_reduce([a, b], "sum")
            elif backend_out == "broadcast":
                backend.broadcast(a, [b])
            else:
                backend.sgd([b], a, lr=0.5)  # grad overlaps the copy it updates
            results.append(x)
        assert_bits_equal(results[1], results[0])


def test_same_buffer_twice(native):
    a = np.arange(10, dtype=np.int32)
    native.all_reduce([a, a, a], "sum")
    np.testing.assert_array_equal(a, 3 * np.arange(10))
    x, y = np.arange(5.0), np.ones(5)
    out = native.reduce_to_one([x, y], "sum", out=x)
    assert out is x
    np.testing.assert_array_equal(x, np.arange(5.0) + 1)
    w = np.arange(6, dtype=np.float32)
    native.sgd([w], w, lr=0.5)  # grad is the variable itself
    np.testing.assert_array_equal(w, np.arange(6, dtype=np.float32) * np.float32(0.5))


def test_float16_rounding_and_special_values(native, ref):
    rng = np.random.default_rng(16)
    # Every finite float16, as gradients scaled by several magnitudes: the float32 results cover
    # overflow to inf, subnormals, exact ties and underflow to zero.
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    g = bits.view(np.float16)
    g = g[np.isfinite(g)].copy()
    for lr in (1.0, -0.37, 3.1, 1000.0, 1e-3, 2.0**-20):
        w = rand(rng, "float16", g.shape)
        with np.errstate(over="ignore"):  # overflowing to inf is part of what is checked
            want = ref.sgd([w.copy(), w.copy()], g, lr=lr)
        got = native.sgd([w.copy(), w.copy()], g, lr=lr)
        assert_bits_equal(got[1], want[1])
        assert_bits_equal(got[0], want[0])
    big = np.full(8, 65504, np.float16)
    tiny = np.full(8, 2.0**-24, np.float16)
    for bufs in ([big, big], [tiny, tiny, tiny], [big, -big], [tiny, big]):
        for op in ("sum", "mean"):
            with np.errstate(over="ignore"):
                want = ref.reduce_to_one(bufs, op)
            got = native.reduce_to_one(bufs, op)
            assert_bits_equal(got, want)
    nan = native.reduce_to_one([np.full(3, np.nan, np.float16), np.ones(3, np.float16)], "sum")
    assert np.isnan(nan).all()


def test_extension_checks_its_arguments():
    a = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="tuple or list"):
        _core.all_reduce(a, 0)
    with pytest.raises(ValueError, match="at least one"):
        _core.all_reduce([], 0)
    with pytest.raises(TypeError, match="not a numpy.ndarray"):
        _core.all_reduce([a, [1.0, 2.0]], 0)
    with pytest.raises(TypeError, match="unsupported dtype"):
        _core.all_reduce([np.ones(4, np.uint8)], 0)
    with pytest.raises(TypeError, match="byte order"):
        _core.all_reduce([np.ones(4, ">f4")], 0)
    with pytest.raises(TypeError, match="dtype float64"):
        _core.all_reduce([a, np.ones(4)], 0)
    with pytest.raises(ValueError, match="elements"):
        _core.all_reduce([a, np.ones(5, np.float32)], 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.all_reduce([a, np.ones(8, np.float32)[::2]], 0)
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _core.all_reduce([a, ro], 0)
    _core.reduce_to_one([a, ro], 0, np.empty(4, np.float32))  # inputs may be read-only
    with pytest.raises(ValueError, match="op must be"):
        _core.all_reduce([a], 2)
    with pytest.raises(TypeError, match="floating-point"):
        _core.sgd([np.ones(4, np.int32)], np.ones(4, np.int32), 0.1, 0.0)
    with pytest.raises(ValueError, match="velocity slot copies must match"):
        _core.momentum([a], [a, a], a, 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match="out of range"):
        _core.all_gather([a], 1)


def test_fast_path_falls_back_to_the_contract_messages(native):
    a = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="replica 1 has dtype float64"):
        native.all_reduce([a, np.ones((2, 3))])
    with pytest.raises(ValueError, match=r"replica 1 has shape \(3, 2\)"):
        native.all_reduce([a, np.ones((3, 2), np.float32)])
    ro = np.ones((2, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="replica 1 is read-only"):
        native.all_reduce([a, ro], ReduceOp.MEAN)
    with pytest.raises(ValueError, match="empty"):
        native.all_reduce([])
    b = np.full((2, 3), 3, np.float32)
    assert native.all_reduce((a, b), "MEAN") == (a, b)
    np.testing.assert_array_equal(a, 2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # 3.12+ warns on forking with threads
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")  # JAX warns at every fork once imported
def test_kernels_work_in_a_forked_child(native, threads):
    set_num_threads(2)
    bufs = [np.full(1 << 20, 1.5, np.float32) for _ in range(3)]
    native.all_reduce(bufs, "sum")  # the pool's workers now exist in the parent
    pid = os.fork()
    if pid == 0:  # child: its pool has no workers; the kernels must run, not wait for them
        ok = False
        try:
            native.all_reduce(bufs, "sum")
            ok = bool(np.all(bufs[0] == 13.5))
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in a native kernel")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


_RESIZE_RACE = """
import sys, threading, time
import numpy as np
from cudist import _core
bufs = [np.ones(1 << 19, np.float32) for _ in range(2)]  # 8 MiB moved: a parallel loop
stop = threading.Event()
def resizer():
    while not stop.is_set():
        _core.set_num_threads(1)
        _core.set_num_threads(2)
t = threading.Thread(target=resizer)
t.start()
deadline = time.monotonic() + float(sys.argv[1])
try:
    while time.monotonic() < deadline:
        for b in bufs:
            b.fill(1.5)
        _core.all_reduce(bufs, _core.SUM)
        assert np.all(bufs[1] == 3.0)
finally:
    stop.set()
    t.join()
print("done")
"""


def test_resizing_the_pool_while_kernels_run_does_not_hang():
    # A loop that counted the pool's threads before a concurrent set_num_threads() shrank it used
    # to wait forever for workers that no longer existed. Run in a child so a hang fails the test.
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _RESIZE_RACE, "4"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr



_LIST_CLEARED = """
import sys, threading, time, weakref
import numpy as np
from cudist import _core
src = np.ones(1 << 20, np.float32)
sys.setswitchinterval(30.0)  # the kernel's thread keeps the GIL until the kernel releases it
for _ in range(5):
    dsts = [np.zeros(1 << 20, np.float32) for _ in range(2)] * 50
    alive = [weakref.ref(d) for d in dsts[:2]]
    state = {"started": False, "done": False}

    def work(dsts=dsts):
        state["started"] = True
        _core.broadcast(src, dsts)
        state["done"] = True

    t = threading.Thread(target=work)
    t.start()
    while not state["started"]:
        time.sleep(0.0005)
    dsts.clear()
    del dsts
    freed_while_running = not state["done"] and any(r() is None for r in alive)
    t.join()
    assert not freed_while_running, "an array was freed while the kernel was writing it"
    assert all(r() is None for r in alive), "the kernel leaked a reference"
print("done")
"""


def test_arrays_of_a_list_stay_alive_while_the_kernel_runs_without_the_gil():
    # The kernel runs without the GIL, so another thread may empty the list it was given; the
    # arrays must live until the kernel is done (this used to write into freed memory: SIGSEGV).
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _LIST_CLEARED], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "done" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_set_num_threads_rejects_absurd_counts_before_starting_threads():
    from cudist._kernels import _native

    before = _native.num_threads()
    with pytest.raises(ValueError, match="<= 1024"):
        _native.set_num_threads(10**6)
    with pytest.raises(ValueError, match=">= 0"):
        _native.set_num_threads(-1)
    assert _native.num_threads() == before


# ---------------------------------------------------------------------------- out of place, batched, fused
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_out_of_place_and_batched_all_reduce_large(native, ref, streaming, dtype, n, op):
    # The parallel and the streaming paths (the outputs are not inputs, so they stream).
    rng = np.random.default_rng(hash((dtype, n, op.name, 2)) % 2**32)
    bufs = [rand(rng, dtype, (BIG,)) for _ in range(n)]
    want = ref.reduce_to_one(bufs, op)
    outs = [np.empty_like(b) for b in bufs]
    native.all_reduce(bufs, op, outputs=outs)
    for o in outs:
        assert_bits_equal(o, want)
    # Mixed: some outputs are their inputs.
    mixed = [b.copy() if i % 2 else np.empty_like(b) for i, b in enumerate(bufs)]
    ins = [m if i % 2 else b for i, (b, m) in enumerate(zip(bufs, mixed))]
    native.all_reduce(ins, op, outputs=mixed)
    for o in mixed:
        assert_bits_equal(o, want)
    leaves = [[b, b[: BIG // 3].copy(), b[:5].copy()] for b in bufs]
    louts = [[np.empty_like(x) for x in lv] for lv in leaves]
    native.batch_all_reduce(leaves, louts, op)
    for j in range(3):
        w = ref.reduce_to_one([lv[j] for lv in leaves], op)
        for lo in louts:
            assert_bits_equal(lo[j], w)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n, m", [(1, 4), (4, 4), (3, 1), (2, 20)])  # 20 gradients: past the inline list
def test_fused_updates_large_match_reference(native, ref, streaming, dtype, n, m):
    rng = np.random.default_rng(n * 100 + m)
    w = rand(rng, dtype, (BIG,))
    s1, s2 = rand(rng, dtype, (BIG,)), np.abs(rand(rng, dtype, (BIG,)))
    grads = [rand(rng, dtype, (BIG,)) for _ in range(m)]
    cases = [
        ("sgd", 0, dict(lr=0.01)),
        ("momentum", 1, dict(lr=0.01, momentum=0.9, nesterov=True)),
        ("adam", 2, dict(lr=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, step=5)),
    ]
    g = ref.reduce_to_one(grads, "sum")
    for method, nslots, kw in cases:
        want = [[x.copy() for _ in range(n)] for x in (w, s1, s2)[: nslots + 1]]
        getattr(ref, method)(*want, g, **kw)
        got = [[x.copy() for _ in range(n)] for x in (w, s1, s2)[: nslots + 1]]
        getattr(native, "all_reduce_" + method)(*got, grads, **kw)
        for wl, gl in zip(want, got):
            for a, b in zip(wl, gl):
                assert_bits_equal(b, a)


def test_fused_updates_with_copies_passed_more_than_once(native, ref, streaming):
    rng = np.random.default_rng(9)
    w, v, g1, g2 = (rand(rng, "float32", (BIG,)) for _ in range(4))
    want_w, want_v = [w.copy() for _ in range(4)], [v.copy() for _ in range(4)]
    ref.momentum(want_w, want_v, ref.reduce_to_one([g1, g2], "sum"), lr=0.1, momentum=0.9)
    bw, bv = [w.copy(), w.copy()], [v.copy(), v.copy()]
    copies, vels = [bw[0], bw[1], bw[0], bw[1]], [bv[1], bv[1], bv[0], bv[0]]
    native.all_reduce_momentum(copies, vels, [g1, g2], lr=0.1, momentum=0.9)
    for a, b in zip(want_w + want_v, copies + vels):
        assert_bits_equal(b, a)


def test_core_takes_reduce_op_members_and_ints():
    a, b = np.ones(4, np.float32), np.full(4, 3.0, np.float32)
    out = np.empty(4, np.float32)
    _core.reduce_to_one([a, b], ReduceOp.MEAN, out)
    assert out.tolist() == [2.0] * 4
    _core.reduce_to_one([a, b], 0, out)
    assert out.tolist() == [4.0] * 4
    for bad in ("sum", 2, True, None, 1.0):
        with pytest.raises(ValueError, match="op must be ReduceOp.SUM or ReduceOp.MEAN"):
            _core.reduce_to_one([a, b], bad, out)


def test_core_out_of_place_and_batch_check_their_arguments():
    a, b = np.ones(4, np.float32), np.ones(4, np.float32)
    o1, o2 = np.empty(4, np.float32), np.empty(4, np.float32)
    with pytest.raises(ValueError, match="got 2 inputs but 1 outputs"):
        _core.all_reduce_into([a, b], [o1], 0)
    with pytest.raises(TypeError, match="outputs have dtype float64"):
        _core.all_reduce_into([a, b], [np.empty(4), np.empty(4)], 0)
    with pytest.raises(ValueError, match="outputs have 5 elements"):
        _core.all_reduce_into([a, b], [np.empty(5, np.float32)] * 2, 0)
    ro = np.empty(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="output 1 is read-only"):
        _core.all_reduce_into([a, b], [o1, ro], 0)
    _core.all_reduce_into([ro, ro], [o1, o2], 0)  # inputs may be read-only
    with pytest.raises(ValueError, match="output 1 overlaps input 0"):
        _core.all_reduce_into([a, b], [o1, a], 0, True)
    with pytest.raises(ValueError, match="output 1 overlaps output 0"):
        _core.all_reduce_into([a, b], [o1, o1], 0, True)
    _core.all_reduce_into([a, b], [a, o2], 0, True)  # exactly its own input: fine
    with pytest.raises(ValueError, match="got 2 input replicas but 1 output replicas"):
        _core.batch_all_reduce([[a], [b]], [[o1]], 0)
    with pytest.raises(ValueError, match="input replica 1 has 2 leaves but input replica 0 has 1"):
        _core.batch_all_reduce([[a], [b, b]], [[o1], [o2]], 0)
    with pytest.raises(ValueError, match="input leaf 0 of replica 1 has 3 elements"):
        _core.batch_all_reduce([[a], [b[:3]]], [[o1], [o2]], 0)
    with pytest.raises(TypeError, match="leaf 0 of replica 1 has dtype float64"):
        _core.batch_all_reduce([[a], [np.ones(4)]], [[o1], [o2]], 0)
    with pytest.raises(ValueError, match="output leaf 0 1 is read-only|output leaf 0 is read-only"):
        _core.batch_all_reduce([[a], [b]], [[ro], [o2]], 0)
    with pytest.raises(TypeError, match=r"inputs\[r\] must be a tuple or list"):
        _core.batch_all_reduce([a, b], [[o1], [o2]], 0)
    with pytest.raises(ValueError, match="gradients have 5 elements"):
        _core.all_reduce_sgd([o1], [np.ones(5, np.float32)], 0.1, 0.0)
    with pytest.raises(TypeError, match="gradients have dtype float64"):
        _core.all_reduce_sgd([o1], [np.ones(4)], 0.1, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        _core.all_reduce_adamw([o1], [o2], [o2], [], 0.1, 0.9, 0.999, 1e-7, 0.0)


def test_core_overlapping_buffers_go_through_a_temporary(ref):
    # Without the strict check (the trusted path), partially overlapping outputs and batch segments
    # still give NumPy's answer: everything reduced first, then the outputs written in order.
    rng = np.random.default_rng(21)
    for size in (7, BIG):
        base = rand(rng, "float64", (size + 3,))
        x = base.copy()
        ins = [x[:size], rand(rng, "float64", (size,))]
        outs = [x[3:], np.empty(size)]
        want_x = x.copy()
        ref.trusted.all_reduce([want_x[:size], ins[1]], [want_x[3:], np.empty(size)], ReduceOp.SUM)
        _core.all_reduce_into(ins, outs, ReduceOp.SUM)
        assert_bits_equal(x, want_x)
        y = base.copy()
        want_y = y.copy()
        other = rand(rng, "float64", (size,))
        ref.trusted.batch_all_reduce([[want_y[:size]], [other]], [[want_y[3:]], [np.empty(size)]], ReduceOp.SUM)
        _core.batch_all_reduce([[y[:size]], [other]], [[y[3:]], [np.empty(size)]], ReduceOp.SUM)
        assert_bits_equal(y, want_y)


def test_results_of_new_kernels_identical_across_thread_counts(native, threads):
    rng = np.random.default_rng(33)
    ins = [rand(rng, "float32", (BIG,)) for _ in range(3)]
    grads = [rand(rng, "float32", (BIG,)) for _ in range(3)]
    results = []
    for t in (1, 2, 3, 8):
        set_num_threads(t)
        outs = [np.empty(BIG, np.float32) for _ in range(3)]
        native.all_reduce(ins, "mean", outputs=outs)
        louts = [[np.empty(BIG, np.float32), np.empty(7, np.float32)] for _ in range(3)]
        native.batch_all_reduce([[a, a[:7].copy()] for a in ins], louts, "sum")
        w = [ins[0].copy() for _ in range(2)]
        native.all_reduce_sgd(w, grads, lr=0.25)
        results.append([outs[2], louts[1][0], louts[2][1], w[1]])
    for r in results[1:]:
        for a, b in zip(r, results[0]):
            assert_bits_equal(a, b)


def test_gil_is_released_during_a_large_batch():
    dst = np.zeros(1 << 20, np.float32)
    src = np.ones_like(dst)
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        overlapped = False
        for _ in range(5):
            state = {"started": False, "done": False}

            def work():
                state["started"] = True
                for _ in range(20):
                    _core.batch_all_reduce([[src] * 8] * 4, [[dst] * 8] * 4, 0)
                state["done"] = True

            t = threading.Thread(target=work)
            t.start()
            while not state["started"]:
                time.sleep(0.0005)
            seen_running = not state["done"]
            t.join()
            if seen_running:
                overlapped = True
                break
    finally:
        sys.setswitchinterval(old)
    assert overlapped, "the main thread never ran while the batch kernel did: the GIL was not released"
    assert np.all(dst == 4)


def test_trusted_calls_the_extension_directly(native):
    t = native.trusted
    assert t.all_reduce is _core.all_reduce_into and t.all_reduce_adamw is _core.all_reduce_adamw
    assert t.batch_all_reduce is _core.batch_all_reduce and t.sgd is _core.sgd

    class Sub(NativeBackend):
        def _hook_sgd(self, copies, grad, lr, decay):  # a subclass's hooks are honoured
            raise RuntimeError("sub")

    with pytest.raises(RuntimeError, match="sub"):
        Sub().trusted.sgd((np.ones(2, np.float32),), np.ones(2, np.float32), 0.1, 0.0)


def _at(a, byte_offset):
    """A copy of ``a`` starting ``byte_offset`` bytes past a 64-byte boundary."""
    raw = np.empty(a.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + byte_offset
    out = np.ndarray(a.shape, a.dtype, raw.data, start)
    out[...] = a
    return out


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_streaming_stores_with_outputs_at_every_alignment(native, ref, streaming, dtype):
    # Streamed outputs are lined up with the first one: outputs at other offsets within a cache
    # line, or not even element-aligned, take the ordinary stores; results never change.
    rng = np.random.default_rng(41)
    size = BIG + 13
    isz = np.dtype(dtype).itemsize
    offsets = [0, isz, 16, 48, 1]
    ins = [_at(rand(rng, dtype, (size,)), o) for o in (16, 0, 3, 16)]
    want = ref.reduce_to_one(ins, "mean")
    for first in offsets:
        outs = [_at(np.zeros(size, dtype), o) for o in [first] + [o for o in offsets if o != first][:3]]
        native.all_reduce(ins, "mean", outputs=outs)
        for o in outs:
            assert_bits_equal(o, want)
        out = _at(np.zeros(size, dtype), first)
        native.reduce_to_one(ins, "mean", out=out)
        assert_bits_equal(out, want)
        w0, v0 = rand(rng, dtype, (size,)), rand(rng, dtype, (size,))
        want_w, want_v = [w0.copy() for _ in range(4)], [v0.copy() for _ in range(4)]
        ref.momentum(want_w, want_v, ref.reduce_to_one(ins, "sum"), lr=0.1, momentum=0.9)
        w = [_at(w0, o) for o in [16] + [first] * 2 + [4]]
        v = [_at(v0, o) for o in [first, 0, 48, 1]]
        native.all_reduce_momentum(w, v, ins, lr=0.1, momentum=0.9)
        for a, b in zip(want_w + want_v, w + v):
            assert_bits_equal(b, a)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_broadcast_with_destinations_at_every_alignment(native, streaming, dtype):
    # Streamed blocks line up with the first destination that is not the source (NumPy's large
    # arrays sit 16 bytes past a line); destinations elsewhere in a line, not element-aligned, or the
    # source itself still get every element, and nothing outside them is written.
    rng = np.random.default_rng(43)
    size = BIG + 13
    isz = np.dtype(dtype).itemsize
    src0 = rand(rng, dtype, (size,))
    for first in [16, 0, isz, 48, 1]:
        raws, dsts = [], []
        for o in [first, 0, 16, 3]:
            raw = np.full(size * isz + 192, 0xA5, np.uint8)
            start = (-raw.ctypes.data) % 64 + 64 + o
            raws.append((raw, start))
            dsts.append(np.ndarray((size,), dtype, raw.data, start))
        src = _at(src0, 16)
        native.broadcast(src, dsts)
        for (raw, start), d in zip(raws, dsts):
            assert_bits_equal(d, src0)
            end = start + size * isz
            assert (raw[:start] == 0xA5).all() and (raw[end:] == 0xA5).all()
        # the source among the destinations: left as it is, the others written
        others = [_at(np.zeros(size, dtype), first), _at(np.zeros(size, dtype), 32)]
        native.broadcast(src, [others[0], src, others[1]])
        for d in [*others, src]:
            assert_bits_equal(d, src0)


@pytest.fixture
def pool_defaults():
    """The pool's default thresholds (conftest lowers the cold one) and a restored spin time."""
    thresholds = _core.set_parallel_thresholds(1 << 20, 8 << 20)
    spin = _core.pool_spin_time()
    yield
    _core.set_parallel_thresholds(*thresholds)
    _core.set_pool_spin_time(spin)


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_mid_size_kernels_stay_on_the_caller_unless_a_worker_spins(threads, pool_defaults, ref):
    # 3 x 256 Ki float32 all-reduced in place moves 6 MiB: above the warm threshold (1 MiB), below
    # the cold one (8 MiB). A blocked worker is not woken for it; a spinning one takes part.
    set_num_threads(2)
    rng = np.random.default_rng(7)
    srcs = [rng.standard_normal(1 << 18).astype(np.float32) for _ in range(3)]
    want = ref.reduce_to_one([s.copy() for s in srcs], "sum")
    big = [np.ones(1 << 21, np.float32) for _ in range(2)]  # 32 MiB moved: parallel, cold or not

    _core.set_pool_spin_time(0)
    _core.all_reduce(big, _core.SUM)  # the worker runs a share, then blocks at once
    assert _wait_for(lambda: not _core.pool_warm())
    loops = _core.pool_parallel_loops()
    bufs = [s.copy() for s in srcs]
    _core.all_reduce(bufs, _core.SUM)
    assert _core.pool_parallel_loops() == loops, "a blocked worker was woken for a mid-size kernel"
    assert all(np.array_equal(b, want) for b in bufs)
    assert not _core.pool_warm(), "with a spin time of 0, nothing spins"

    _core.set_pool_spin_time(10**9)  # 1 s: the worker is still spinning when the next kernel starts
    _core.all_reduce(big, _core.SUM)
    assert _wait_for(_core.pool_warm), "the worker does not spin after a loop"
    loops = _core.pool_parallel_loops()
    bufs = [s.copy() for s in srcs]
    _core.all_reduce(bufs, _core.SUM)
    assert _core.pool_parallel_loops() == loops + 1, "a spinning worker was not used"
    assert all(np.array_equal(b, want) for b in bufs)


def test_a_mid_size_kernel_on_a_cold_pool_wakes_the_workers_for_the_next(threads, pool_defaults):
    set_num_threads(2)
    _core.set_pool_spin_time(0)
    _core.all_reduce([np.ones(1 << 21, np.float32) for _ in range(2)], _core.SUM)
    assert _wait_for(lambda: not _core.pool_warm())
    _core.set_pool_spin_time(10**9)
    loops = _core.pool_parallel_loops()
    bufs = [np.full(1 << 18, 1.5, np.float32) for _ in range(3)]
    _core.all_reduce(bufs, _core.SUM)  # inline (cold), and the worker is told to start spinning
    assert _core.pool_parallel_loops() == loops
    assert np.all(bufs[2] == 4.5)
    assert _wait_for(_core.pool_warm), "the cold mid-size kernel did not wake the workers"
    small = [np.ones(1 << 10, np.float32) for _ in range(3)]  # 24 KiB moved: never worth a worker
    _core.all_reduce(small, _core.SUM)
    assert _core.pool_parallel_loops() == loops


def test_pool_spin_time_setting_and_environment():
    assert _core.set_pool_spin_time(-5) >= 0
    try:
        assert _core.pool_spin_time() == 0  # negative counts as 0
    finally:
        _core.set_pool_spin_time(200_000)
    import subprocess

    code = "from cudist import _core; print(_core.pool_spin_time())"
    for value, want in (("0", 0), ("50", 50_000), ("abc", 200_000), ("-3", 200_000)):
        env = dict(os.environ, CUDIST_POOL_SPIN_US=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert int(out.stdout) == want, (value, out.stdout)


@pytest.mark.parametrize("spin", [0, 200_000])
def test_pool_loops_of_every_thread_count_cover_each_element_once(threads, pool_defaults, ref, spin):
    # Each thread starts on its own share and then takes from the others': whatever the pool size,
    # spin time, chunk count or tail, every element is reduced exactly once, in the fixed order.
    _core.set_pool_spin_time(spin)
    rng = np.random.default_rng(spin)
    for t in (2, 3, 5):
        set_num_threads(t)
        for count in (1 << 20, (1 << 20) + 17):
            srcs = [rng.standard_normal(count).astype(np.float32) for _ in range(3)]
            want = ref.reduce_to_one([s.copy() for s in srcs], "sum")
            for _ in range(3):
                bufs = [s.copy() for s in srcs]
                _core.all_reduce(bufs, _core.SUM)
                assert all(np.array_equal(b, want) for b in bufs), (t, count)


def test_workers_spin_only_while_calls_come_close_together(threads, pool_defaults):
    # A kernel that ends a burst (one all-reduce per training step) must not leave a worker taking a
    # core from the step's compute: workers spin only when the last gap between calls was short.
    set_num_threads(2)
    big = [np.ones(1 << 21, np.float32) for _ in range(2)]  # 32 MiB moved: parallel, cold or not
    _core.set_pool_spin_time(200_000_000)  # 200 ms
    _core.all_reduce(big, _core.SUM)
    time.sleep(0.5)  # longer than the spin time: the next call ends a long gap
    assert _wait_for(lambda: not _core.pool_warm())
    _core.all_reduce(big, _core.SUM)
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:
        assert not _core.pool_warm(), "a worker spins after a call that followed a long gap"
    _core.all_reduce(big, _core.SUM)  # 50 ms after the last one: calls are close now
    assert _wait_for(_core.pool_warm, 1.0), "a worker does not spin while calls come close together"


# ---------------------------------------------------------------------------------------- reduce_to_one_shared
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (BIG,), ()])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_reduce_to_one_shared_matches_reference(ref, dtype, n, shape, op):
    if op is ReduceOp.MEAN and np.dtype(dtype).kind == "i":
        pytest.skip("integer MEAN is refused (test below)")
    rng = np.random.default_rng(hash((dtype, n, shape, op.value)) % 2**32)
    bufs = [np.array(rand(rng, dtype, shape)) for _ in range(n)]
    before = [b.copy() for b in bufs]
    out = np.empty(shape, dtype)
    res = _core.reduce_to_one_shared(bufs, op, out)
    assert isinstance(res, list) and len(res) == n
    assert res[0] is out and len({id(r) for r in res}) == n
    for r in res:
        assert not r.flags.writeable and r.shape == shape and np.shares_memory(r, out)
    one = np.atleast_1d  # assert_bits_equal views bytes, which a 0-d array cannot
    assert_bits_equal(one(out), one(ref.reduce_to_one([b.copy() for b in before], op)))
    for b, b0 in zip(bufs, before):
        assert_bits_equal(one(b), one(b0))  # inputs untouched


def test_reduce_to_one_shared_declines_what_it_does_not_check_for_the_caller():
    rng = np.random.default_rng(1)
    a = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]
    out = np.empty(64, np.float32)

    def declined(bufs, op=ReduceOp.SUM, o=None):
        o = out if o is None else o
        return _core.reduce_to_one_shared(bufs, op, o) is None and o.flags.writeable

    assert declined(a[:1])  # one replica
    assert declined([a[0], a[1][:32], a[2]])  # another size
    assert declined([a[0].reshape(8, 8), a[1], a[2]])  # another shape, same size
    assert declined([a[0], a[1].astype(np.float64), a[2]])  # another dtype
    assert declined([a[0], np.arange(128, dtype=np.float32)[::2], a[2]])  # not C-contiguous
    assert declined([a[0], a[1].view(np.matrix), a[2]])  # a subclass
    assert declined([a[0], list(a[1]), a[2]])  # not an array
    assert declined([x.astype(np.complex64) for x in a])  # not a kernel dtype
    assert declined([x.astype(">f4") for x in a])  # swapped byte order
    assert declined([x.astype(np.int32) for x in a], ReduceOp.MEAN, np.empty(64, np.int32))  # integer MEAN
    assert declined(a, ReduceOp.SUM, np.empty(32, np.float32))  # out of another size
    assert declined(a, ReduceOp.SUM, np.empty(64, np.float64))  # out of another dtype
    ro = np.empty(64, np.float32)
    ro.flags.writeable = False
    assert _core.reduce_to_one_shared(a, ReduceOp.SUM, ro) is None
    assert _core.reduce_to_one_shared(tuple(a), ReduceOp.SUM, out) is not None  # tuples too
    assert _core.reduce_to_one_shared(iter(a), ReduceOp.SUM, np.empty(64, np.float32)) is None
    with pytest.raises(ValueError, match="op"):
        _core.reduce_to_one_shared(a, 7, np.empty(64, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_batch_reduce_to_one_shared_matches_reference(ref, dtype, n, op):
    if op is ReduceOp.MEAN and np.dtype(dtype).kind == "i":
        pytest.skip("integer MEAN is refused (test below)")
    rng = np.random.default_rng(hash((dtype, n, op.value)) % 2**32)
    shapes = [(7, 13), (1,), (), (BIG,), (3, 1, 2)]
    leaves = [[np.array(rand(rng, dtype, s)) for s in shapes] for _ in range(n)]
    before = [[a.copy() for a in row] for row in leaves]
    total = sum(int(np.prod(s)) for s in shapes)
    out = np.empty(total, dtype)
    res = _core.batch_reduce_to_one_shared(leaves, op, out)
    assert isinstance(res, list) and len(res) == n and all(len(row) == len(shapes) for row in res)
    one = np.atleast_1d
    for j, s in enumerate(shapes):
        want = ref.reduce_to_one([before[r][j].copy() for r in range(n)], op)
        objs = [res[r][j] for r in range(n)]
        assert len({id(o) for o in objs}) == n
        for o in objs:
            assert o.shape == s and not o.flags.writeable and np.shares_memory(o, out)
            assert_bits_equal(one(o), one(np.asarray(want)))
    for row, row0 in zip(leaves, before):
        for a, a0 in zip(row, row0):
            assert_bits_equal(one(a), one(a0))  # inputs untouched


def test_batch_reduce_to_one_shared_declines_what_it_does_not_check_for_the_caller():
    rng = np.random.default_rng(2)
    rows = [[rng.standard_normal(s).astype(np.float32) for s in ((4, 4), (3,))] for _ in range(3)]

    def declined(inputs, op=ReduceOp.SUM, out=None):
        out = np.empty(19, np.float32) if out is None else out
        return _core.batch_reduce_to_one_shared(inputs, op, out) is None and out.flags.writeable

    assert declined(rows[:1])  # one replica
    assert declined([[], [], []])  # no leaves
    assert declined([rows[0], rows[1][:1], rows[2]])  # another leaf count
    assert declined([rows[0], [rows[1][0].reshape(2, 8), rows[1][1]], rows[2]])  # another shape
    assert declined([rows[0], [rows[1][0], rows[1][1].astype(np.float64)], rows[2]])  # another dtype
    assert declined([rows[0], [rows[1][0].T, rows[1][1]], rows[2]])  # not C-contiguous
    assert declined([rows[0], [rows[1][0], list(rows[1][1])], rows[2]])  # not an array
    assert declined([rows[0], (x for x in rows[1]), rows[2]])  # not a list or tuple
    assert declined([[x.astype(np.int64) for x in r] for r in rows], ReduceOp.MEAN, np.empty(19, np.int64))
    assert declined(rows, ReduceOp.SUM, np.empty(18, np.float32))  # out of another size
    assert declined(rows, ReduceOp.SUM, np.empty(19, np.float64))  # out of another dtype
    assert _core.batch_reduce_to_one_shared(tuple(tuple(r) for r in rows), ReduceOp.SUM, np.empty(19, np.float32))


def test_shared_reductions_take_their_output_from_a_callable_only_for_good_inputs():
    """``out`` may be the pool's take(shape, dtype): called once, with the leaves' total size (the
    array's shape) and dtype, and only when the inputs pass (a declined call takes no buffer); what
    it returns must fit too."""
    rng = np.random.default_rng(4)
    rows = [[rng.standard_normal(s).astype(np.float32) for s in ((4, 4), (3,))] for _ in range(3)]
    calls = []

    def take(shape, dtype):
        calls.append((shape, dtype))
        return np.empty(shape, dtype)

    res = _core.batch_reduce_to_one_shared(rows, ReduceOp.SUM, take)
    assert calls == [((19,), np.dtype(np.float32))]
    base = res[0][0].base
    assert all(o.base is base and not o.flags.writeable for row in res for o in row)
    assert_bits_equal(res[2][1], rows[0][1] + rows[1][1] + rows[2][1])
    calls.clear()
    assert _core.batch_reduce_to_one_shared([rows[0], rows[1][:1], rows[2]], ReduceOp.SUM, take) is None
    assert calls == []  # declined before taking a buffer
    assert _core.batch_reduce_to_one_shared(rows, ReduceOp.SUM, lambda shape, dtype: np.empty(5, dtype)) is None
    with pytest.raises(RuntimeError, match="no buffer"):
        _core.batch_reduce_to_one_shared(rows, ReduceOp.SUM, lambda shape, dtype: (_ for _ in ()).throw(RuntimeError("no buffer")))
    # reduce_to_one_shared the same way, with the arrays' own shape
    a = [rng.standard_normal((3, 5)).astype(np.float64) for _ in range(4)]
    calls.clear()
    res = _core.reduce_to_one_shared(a, ReduceOp.SUM, take)
    assert calls == [((3, 5), np.dtype(np.float64))]
    assert len(res) == 4 and all(not r.flags.writeable and np.shares_memory(r, res[0]) for r in res)
    assert_bits_equal(res[3], ((a[0] + a[1]) + a[2]) + a[3])
    calls.clear()
    assert _core.reduce_to_one_shared([a[0], a[1].astype(np.float32)], ReduceOp.SUM, take) is None
    assert calls == []


def test_settle_plain_takes_only_gradients_that_cannot_alias_what_the_step_writes():
    rng = np.random.default_rng(3)
    w1, w2 = np.ones(8, np.float32), np.zeros((2, 4), np.float32)
    wv = np.ones(16, np.float32)[:8]  # a written view: its base counts as written too
    g = [rng.standard_normal(8).astype(np.float32) for _ in range(4)]
    passes = [(g[:2], (w1, wv)), ([g[2], g[3]], (w2,))]
    out = _core.settle_plain(passes, True)
    assert [len(r) for r in out] == [2, 2] and all(a is b for a, b in zip(out[0] + out[1], g))
    declined = [
        [([g[0], w1], (w1,))],  # the gradient is a written array
        [([g[0], wv.base], (wv,))],  # the gradient owns a written view's memory
        [([g[0], g[1][::2]], (w1,))],  # not C-contiguous
        [([g[0], g[1][:4]], (w1,))],  # a view (it has a base)
        [([g[0], np.frombuffer(g[1].tobytes(), np.float32)], (w1,))],  # memory it does not own
        [([g[0], g[1].view(np.matrix)], (w1,))],  # a subclass
        [([g[0], list(g[1])], (w1,))],  # not an array
    ]
    for p in declined:
        assert _core.settle_plain(p, True) is None, p
    # Without aliasing only the gradients themselves are looked at.
    row = _core.settle_plain([([g[0], w1], (w1,))], False)[0]
    assert len(row) == 2 and row[0] is g[0] and row[1] is w1
    assert _core.settle_plain([([g[0], g[1][:4]], ())], False) is None
    assert _core.settle_plain([], True) == []


@pytest.mark.parametrize(("value", "want"), [("1", "1"), ("3", "3"), ("0", "ValueError: $CUDIST_NUM_THREADS='0' is not a positive integer")])
def test_the_pool_size_comes_from_cudist_num_threads(value, want):
    """CUDIST_NUM_THREADS sizes the native pool when the backend loads (the launcher's share of the cores)."""
    import subprocess
    import sys

    code = ("try:\n from cudist._kernels import _native\n print(_native.num_threads())\n"
            "except ValueError as e:\n print('ValueError:', e)\n")
    env = dict(os.environ, CUDIST_NUM_THREADS=value)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == want, out.stderr[-2000:]


def test_the_launcher_gives_each_worker_its_share_of_the_kernel_threads():
    from cudist import launch

    cores = os.cpu_count() or 1
    assert launch.worker_env(2, {})["CUDIST_NUM_THREADS"] == str(max(1, cores // 2))
    assert launch.worker_env(2, {"CUDIST_NUM_THREADS": "7"})["CUDIST_NUM_THREADS"] == "7"  # a user's choice stays
