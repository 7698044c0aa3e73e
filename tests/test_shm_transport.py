"""The shared-memory transport of multi-worker jobs (``cudist._dataplane.transports.shm``).

Real MPI jobs on this machine (``python -m cudist.launch -n N``), each under a timeout:

* 2 and 4 workers on one node equal a MirroredStrategy over the same replicas bit for bit (every
  kernel dtype and bfloat16, odd sizes, SUM and MEAN, nests, packs, held results, an optimizer), and
  so does the whole parity job of ``test_multi_worker`` over shared memory;
* ``CUDIST_NODE_SIZE=2`` with 4 workers simulates 2 hosts x 2 workers (the node leaders' MPI
  level): equal within float32 tolerance;
* the fault tests of ``test_multi_worker`` (raise, kill, hang, a worker ending any way) pass with
  every all-reduce over shared memory, and a worker that hangs, raises or is killed *inside* the
  protocol ends the job within the same deadlines, named; nothing is left in ``/dev/shm``.

The one-round path's single call of the extension (``_core.shm_all_reduce``) is also driven in one
process, every worker of a node simulated on one window: worker-order sums bit for bit, the posted
hash, mismatches, the bounded wait and bad arguments; and in real jobs around its size threshold, and
with a worker killed or interrupted while it waits inside it.

``CUDIST_SHM_MIN_BYTES=0`` puts every host all-reduce through shared memory (the tests' buffers are
small; by default those go through MPI).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

import test_multi_worker as tmw
from cudist import _core, _settings
from cudist._kernels import numpy_backend
from cudist._reduce_util import ReduceOp

JOB = tmw.JOB
needs_mpi = tmw.needs_mpi
no_shm_left = tmw.no_shm_left
EVERY_SIZE = {"CUDIST_SHM_MIN_BYTES": "0"}
# A worker that raises or is killed inside the shared-memory protocol, and how the job names it.
PROTOCOL_FAILURES = [
    ("shm_raise", "worker 1 raised ZeroDivisionError: worker 1 fails on purpose inside the shared-memory protocol"),
    ("shm_kill", tmw._KILLED_WORKER_1),
]


def _launch(n, *args, env=None, timeout=120):
    cmd = [sys.executable, "-m", "cudist.launch", "-n", str(n), JOB, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=tmw._env(**(env or {})),
                          cwd=tmw.HERE)
    return proc, time.monotonic() - start


def _results(proc, n):
    out = tmw._results(proc, n)
    failed = {f"worker {r}: {name}": detail for r, res in out.items() for name, (ok, detail) in res.items() if not ok}
    assert not failed, failed
    return out


# ---------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("CUDIST_SHM_TRANSPORT", "fast", "is not one of auto, off"),
        ("CUDIST_SHM_MIN_BYTES", "-1", "is not a non-negative integer"),
        ("CUDIST_SHM_MIN_BYTES", "4k", "is not a non-negative integer"),
        ("CUDIST_NODE_SIZE", "0", "is not a positive integer"),
        ("CUDIST_NODE_SIZE", "two", "is not a positive integer"),
    ],
)
def test_bad_settings_are_errors_naming_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    read = {"CUDIST_SHM_TRANSPORT": _settings.shm_transport, "CUDIST_NODE_SIZE": _settings.node_size,
            "CUDIST_SHM_MIN_BYTES": lambda: _settings.shm_min_bytes(7)}[name]
    with pytest.raises(ValueError, match=rf"\${name}={value!r} {message}"):
        read()


def test_settings_defaults_and_values(monkeypatch):
    for name in ("CUDIST_SHM_TRANSPORT", "CUDIST_SHM_MIN_BYTES", "CUDIST_NODE_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert _settings.shm_transport() is True
    assert _settings.shm_min_bytes(123) == 123
    assert _settings.node_size() is None
    monkeypatch.setenv("CUDIST_SHM_TRANSPORT", "OFF")
    monkeypatch.setenv("CUDIST_SHM_MIN_BYTES", "0")
    monkeypatch.setenv("CUDIST_NODE_SIZE", "3")
    assert _settings.shm_transport() is False
    assert _settings.shm_min_bytes(123) == 0
    assert _settings.node_size() == 3


# ---------------------------------------------------------------------------------------------- results
@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("workers", [2, 4])
def test_one_node_equals_mirrored_strategy_bit_for_bit(workers, no_shm_left):
    proc, _ = _launch(workers, "shm", "exact", env=EVERY_SIZE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = _results(proc, workers)
    assert len(results[0]) >= 75  # every check ran (bfloat16 included)


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("workers", [2, 4])
def test_training_over_read_only_shared_results_equals_mirrored_strategy(workers, no_shm_left):
    """Tensors large enough for the reduce-scatter (results are read-only views of shared memory): SGD,
    momentum, Adam, RMSprop, ON_WRITE SUM/MEAN variables, MEAN all-reduce, reduce; bit for bit."""
    proc, _ = _launch(workers, "shm_train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(_results(proc, workers)[0]) == 21


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("workers", [2, 4])
def test_a_model_trains_from_unpacked_gradients_bit_for_bit(workers, no_shm_left):
    """Several variables of odd sizes (a worker's slice of a pack cuts through them), one pack or several: the
    gradients cross the workers from where they are (no pack built), and training equals MirroredStrategy's."""
    proc, _ = _launch(workers, "shm_model")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(_results(proc, workers)[0]) == 2 * (2 * 6 + 6 + 1)


@needs_mpi
@pytest.mark.multi_worker
def test_two_simulated_hosts_of_two_workers_within_tolerance(no_shm_left):
    proc, _ = _launch(4, "shm", "tolerance", env={**EVERY_SIZE, "CUDIST_NODE_SIZE": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _results(proc, 4)


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize(
    ("workers", "flags", "env"),
    [(2, [], {}), (4, ["exact"], {}), (4, [], {"CUDIST_NODE_SIZE": "2"})],
    ids=["2-workers", "4-workers-bit-exact", "2x2-hosts"],
)
def test_the_parity_job_over_shared_memory(workers, flags, env, no_shm_left):
    """Every check of test_multi_worker's parity job (run, reduce, gather, variables, optimizers, datasets,
    mismatch errors) with every host all-reduce over shared memory."""
    proc, _ = _launch(workers, "parity", "1", *flags, env={**EVERY_SIZE, **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(_results(proc, workers)[0]) >= 45


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("how", ["setting", "ring"])
def test_the_opt_outs_give_mpi(how, no_shm_left):
    """CUDIST_SHM_TRANSPORT=off, or CommunicationImplementation.RING: host values go through MPI."""
    code = (
        "import cudist\n"
        "opts = cudist.experimental.CommunicationOptions(implementation={impl!r})\n"
        "s = cudist.MultiWorkerMirroredStrategy(communication_options=opts)\n"
        "print('IMPL', s.extended._cross_device_ops.host_implementation, flush=True)\n"
    ).format(impl="RING" if how == "ring" else "AUTO")
    env = {"CUDIST_SHM_TRANSPORT": "off"} if how == "setting" else {}
    script = tmw.HERE / f".shm_opt_out_{how}.py"
    script.write_text(code)
    try:
        cmd = [sys.executable, "-m", "cudist.launch", "-n", "2", str(script)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=tmw._env(**env), cwd=tmw.HERE)
    finally:
        script.unlink()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("IMPL MPI") == 2, proc.stdout


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("case", ["dtype", "size"])
def test_workers_on_different_paths_get_a_mismatch_error(case, no_shm_left):
    proc, took = _launch(2, "shm_mismatch", case, env={"CUDIST_STALL_WARNING_SECONDS": "5"}, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert took < 20
    for rank in (0, 1):
        assert f"RAISED {rank} ReplicaMismatchError: cross-worker collectives differ" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------- failures
@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize(
    "test",
    [
        tmw.test_a_worker_that_raises_ends_the_job,
        tmw.test_a_killed_worker_ends_the_job,
        tmw.test_a_hung_worker_times_out,
        tmw.test_a_worker_ending_first_with_nothing_owed_is_fine,
    ],
    ids=lambda t: t.__name__[5:],
)
def test_the_fault_tests_pass_over_shared_memory(test, monkeypatch, no_shm_left):
    monkeypatch.setenv("CUDIST_SHM_MIN_BYTES", "0")
    test(None)


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("mode", ["exit0", "return", "term"])
def test_a_worker_ending_while_another_waits_in_shared_memory(mode, monkeypatch, no_shm_left):
    monkeypatch.setenv("CUDIST_SHM_MIN_BYTES", "0")
    tmw.test_a_worker_ending_any_way_ends_the_job_naming_it(mode, None)


#: float32 counts of the one-round path (4 KiB) and of the reduce-scatter (400 KB).
SIZES = pytest.mark.parametrize("n", ["1000", "100000"], ids=["one-round", "reduce-scatter"])


@needs_mpi
@pytest.mark.multi_worker
@SIZES
def test_a_worker_hanging_inside_the_protocol_times_out_named(n, no_shm_left):
    """Worker 1 copies its data in, then never sums: worker 0 raises DeadlineExceededError naming it."""
    proc, took = _launch(2, "shm_hang", n, env={**EVERY_SIZE, "CUDIST_STALL_WARNING_SECONDS": "1"}, timeout=60)
    assert proc.returncode != 0
    assert "UNREACHABLE" not in proc.stdout
    assert took < 2 + 10
    assert "DeadlineExceededError" in proc.stderr
    assert "worker(s) [1] did not join it" in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"CollectiveStallWarning: cudist: worker 0 has waited 1 s in all_reduce SUM, collective #\d+, "
                     r"for worker\(s\) \[1\]", proc.stderr), proc.stderr[-2000:]


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize(("mode", "named"), PROTOCOL_FAILURES)
@SIZES
def test_a_worker_failing_inside_the_protocol_ends_the_job_named(mode, named, n, no_shm_left):
    proc, took = _launch(2, mode, n, env=EVERY_SIZE, timeout=60)
    assert proc.returncode != 0
    assert "UNREACHABLE" not in proc.stdout
    assert took < 15
    assert re.search(named, proc.stderr), proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- the one-round call
# The extension's side of the one-round path (``_core.shm_all_reduce``, ``shm_wait``, ``shm_sum``), driven in
# one process: the node's workers are simulated by calling it once per worker rank on one window (a control
# area of int64 flags and two sets of slots), as shm.py lays them out.
_LINE = 8  # int64 per cache line


def _aligned(count, dtype):
    dt = np.dtype(dtype)
    raw = np.zeros(count * dt.itemsize + 64, np.uint8)
    off = -raw.ctypes.data % 64
    return raw[off : off + count * dt.itemsize].view(dt)


def _window(n, cap=1 << 16):
    return _aligned(6 * n * _LINE, np.int64), _aligned(2 * n * cap, np.uint8)


def _dtypes():
    out = [np.float16, np.float32, np.float64, np.int32, np.int64]
    try:
        import ml_dtypes

        out.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    return [np.dtype(d) for d in out]


def _values(rng, dt, size):
    if dt.kind in "iu":
        return rng.integers(-1000, 1000, size).astype(dt)
    return (rng.standard_normal(size) * 10).astype(dt)


def _one_round(ctrl, slots, n, count, sends, crcs=None):
    """Call ``count`` of every worker (worker ``w`` all-reduces ``sends[w]``, a list of arrays): the
    statuses each got, and each worker's results."""
    recvs = [[np.empty_like(x) for x in xs] for xs in sends]
    statuses = []
    for w in range(n):  # workers arriving one after the other: only the last finds every flag up at once
        pairs = list(zip(sends[w], recvs[w]))
        crc = crcs[w] if crcs else 1234
        statuses.append(_core.shm_all_reduce(ctrl, slots, n, w, count, pairs, crc, 17, 0, True))
    for w in range(n - 1):
        if statuses[w] == 1:
            statuses[w] = _core.shm_wait(ctrl, slots, n, w, count, 0)
            if statuses[w] == 0:
                _core.shm_sum(ctrl, slots, n, w, count, list(zip(sends[w], recvs[w])))
    return statuses, recvs


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dt", _dtypes(), ids=str)
def test_the_one_round_call_sums_in_worker_order_bit_for_bit(n, dt):
    rng = np.random.default_rng(n * 100 + dt.num)
    ctrl, slots = _window(n)
    ref = numpy_backend().trusted
    for count, size in enumerate((1, 7, 1000, 4099, 16 * 1024 // dt.itemsize - 3), start=1):
        sends = [[_values(rng, dt, size), _values(rng, dt, 5)] for _ in range(n)]  # two buffers: offsets on lines
        statuses, recvs = _one_round(ctrl, slots, n, count, sends)
        assert statuses == [0] * n
        for j in range(2):
            want = np.empty_like(sends[0][j])
            ref.reduce_to_one([s[j] for s in sends], ReduceOp.SUM, want)
            for w in range(n):
                assert np.array_equal(recvs[w][j].view(np.uint8), want.view(np.uint8)), (count, w, j)


@pytest.mark.parametrize("n", [2, 4])
def test_the_one_array_call_makes_its_result_and_sums_in_worker_order(n):
    """``shm_one_caller``'s call (the per-step one): the result is a new array of the input's shape and
    dtype, whatever the input's layout (a strided send is summed as its C-order copy); the caller counts."""
    rng = np.random.default_rng(n)
    ctrl, slots = _window(n)
    ref = numpy_backend().trusted
    ones = [_core.shm_one_caller(ctrl, slots, n, w, 0) for w in range(n)]
    layouts = [lambda a: a, lambda a: np.asfortranarray(a), lambda a: np.repeat(a, 2, axis=1)[:, ::2]]
    count = 0
    for dt in (np.float32, np.float64, np.int32, np.int64, np.float16):
        for layout in layouts:
            count += 1
            sends = [layout(_values(rng, np.dtype(dt), 3 * 333).reshape(3, 333)) for _ in range(n)]
            got = [ones[w](count, sends[w], "all_reduce SUM", 5) for w in range(n)]
            assert [g[0] for g in got[:-1]] == [1] * (n - 1) and isinstance(got[-1], np.ndarray)
            for w in range(n - 1):
                assert _core.shm_wait(ctrl, slots, n, w, count, 0) == 0
                _core.shm_sum(ctrl, slots, n, w, count, [(got[w][1], got[w][1])])
            recvs = [g[1] for g in got[:-1]] + [got[-1]]
            want = np.empty(sends[0].shape, sends[0].dtype)
            ref.reduce_to_one([np.ascontiguousarray(s).reshape(-1) for s in sends], ReduceOp.SUM, want.reshape(-1))
            for w, recv in enumerate(recvs):
                assert recv.shape == (3, 333) and recv.dtype == dt and recv.flags.c_contiguous and recv.flags.writeable
                assert recv is not sends[w] and np.array_equal(recv.view(np.uint8), want.view(np.uint8)), (count, w)
    assert [_core.shm_one_counts(o) for o in ones] == [(count, sum(
        3 * 333 * np.dtype(d).itemsize * len(layouts) for d in (np.float32, np.float64, np.int32, np.int64, np.float16)))] * n


def test_the_one_array_call_posts_the_same_hash_as_the_general_call():
    """The caller hashes ``kind`` itself (its CRC-32): the hash it posts is the general call's, so workers on
    the two paths of one collective meet and agree, and one whose ``kind`` differs gets status 2."""
    n, seq = 2, 9
    ctrl, slots = _window(n)
    x = np.arange(12, dtype=np.float32)
    one = _core.shm_one_caller(ctrl, slots, n, 1, 0)
    status, _ = one(1, x, "all_reduce SUM", seq)
    assert status == 1
    assert _core.shm_all_reduce(ctrl, slots, n, 0, 1, [(x, np.empty_like(x))], zlib.crc32(b"all_reduce SUM"), seq,
                                0, True) == 0
    row = 4 + 1
    assert ctrl[(row * n + 0) * _LINE] == ctrl[(row * n + 1) * _LINE]
    status, _ = one(2, x, "all_reduce MEAN", seq)
    assert status == 1
    assert _core.shm_all_reduce(ctrl, slots, n, 0, 2, [(x, np.empty_like(x))], zlib.crc32(b"all_reduce SUM"), seq,
                                0, True) == 2


def test_the_one_round_call_posts_the_mpi_checks_hash_and_its_flags():
    """The hash posted is the MPI check's (Communicator.call_hash), in the row of the call's parity; the
    arrival flag holds the call's number; every slot set alternates by parity."""
    from types import SimpleNamespace

    from cudist._dataplane.transports import mpi

    n, seq, kind = 2, 41, "all_reduce SUM"
    ctrl, slots = _window(n)
    x = np.arange(10, dtype=np.float32)
    for count in (1, 2):
        status = _core.shm_all_reduce(ctrl, slots, n, 1, count, [(x, np.empty_like(x))], zlib.crc32(kind.encode()),
                                      seq, 0, True)
        assert status == 1  # worker 0 has not arrived
        row = 4 + (count & 1)
        want = mpi.Communicator.call_hash(SimpleNamespace(seq=seq), kind, [x.size, x.dtype.num])
        assert ctrl[(row * n + 1) * _LINE] == want
        assert ctrl[(0 * n + 1) * _LINE] == count
        cap = slots.size // (2 * n)
        start = ((count & 1) * n + 1) * cap
        assert np.array_equal(slots[start : start + x.nbytes].view(np.float32), x)


def test_workers_making_different_calls_all_get_status_2():
    n = 3
    ctrl, slots = _window(n)
    sends = [[np.ones(8, np.float32)] for _ in range(n)]
    statuses, _ = _one_round(ctrl, slots, n, 1, sends, crcs=[1, 1, 2])
    assert statuses == [2, 2, 2]


def test_the_wait_is_bounded_and_returns_to_the_caller():
    """A worker that never comes: each call spins about ``spin_ns`` and returns 1 (the caller's poll applies
    the deadline), rather than spinning in the extension for ever."""
    n = 2
    ctrl, slots = _window(n)
    x = np.ones(100, np.float32)
    start = time.monotonic()
    assert _core.shm_all_reduce(ctrl, slots, n, 0, 1, [(x, np.empty_like(x))], 1, 1, 20_000_000, True) == 1
    assert _core.shm_wait(ctrl, slots, n, 0, 1, 20_000_000) == 1
    took = time.monotonic() - start
    assert 0.03 < took < 2


def test_bad_arguments_are_errors_not_crashes():
    n = 2
    ctrl, slots = _window(n, cap=4096)
    x = np.ones(8, np.float32)
    ok = [(x, np.empty_like(x))]
    with pytest.raises(ValueError, match="node_rank 2 is not in"):
        _core.shm_all_reduce(ctrl, slots, n, 2, 1, ok, 1, 1, 0, True)
    with pytest.raises(ValueError, match="cache-line aligned int64"):
        _core.shm_all_reduce(_aligned(6 * n * _LINE + 1, np.int64)[1:], slots, n, 0, 1, ok, 1, 1, 0, True)
    with pytest.raises(ValueError, match="writable C-contiguous array of 8-byte items"):
        _core.shm_all_reduce(ctrl.view(np.float32), slots, n, 0, 1, ok, 1, 1, 0, True)
    with pytest.raises(ValueError, match="do not fit a slot of 4096"):
        big = np.ones(1025, np.float32)
        _core.shm_all_reduce(ctrl, slots, n, 0, 1, [(big, np.empty_like(big))], 1, 1, 0, True)
    with pytest.raises(TypeError, match="differ in dtype"):
        _core.shm_all_reduce(ctrl, slots, n, 0, 1, [(x, np.empty(8, np.float64))], 1, 1, 0, True)
    with pytest.raises(ValueError, match="differ in size"):
        _core.shm_all_reduce(ctrl, slots, n, 0, 1, [(x, np.empty(9, np.float32))], 1, 1, 0, True)
    with pytest.raises(ValueError, match="recv writable"):
        ro = np.empty_like(x)
        ro.flags.writeable = False
        _core.shm_all_reduce(ctrl, slots, n, 0, 1, [(x, ro)], 1, 1, 0, True)
    u = np.ones(8, np.uint8)
    with pytest.raises(TypeError, match="not a kernel dtype"):
        _core.shm_sum(ctrl, slots, n, 0, 1, [(u, np.empty_like(u))])
    with pytest.raises(TypeError, match="not a kernel dtype"):  # refused before arriving, when asked to sum
        _core.shm_all_reduce(ctrl, slots, n, 0, 1, [(u, np.empty_like(u))], 1, 1, 0, True)
    with pytest.raises(ValueError, match="node_rank 2 is not in"):
        _core.shm_one_caller(ctrl, slots, n, 2, 0)
    with pytest.raises(ValueError, match="cache-line aligned int64"):
        _core.shm_one_caller(_aligned(6 * n * _LINE + 1, np.int64)[1:], slots, n, 0, 0)
    one = _core.shm_one_caller(ctrl, slots, n, 0, 0)
    with pytest.raises(TypeError, match="not a kernel dtype"):
        one(1, x.astype(">f4"), "k", 1)
    with pytest.raises(TypeError, match="not a kernel dtype"):
        one(1, np.ones(8, np.uint8), "k", 1)
    with pytest.raises(TypeError, match="not a numpy.ndarray"):
        one(1, [1.0, 2.0], "k", 1)
    with pytest.raises(ValueError, match="do not fit a slot of 4096"):
        one(1, np.ones(1025, np.float32), "k", 1)
    with pytest.raises(TypeError, match="takes 4 positional arguments"):
        one(1, x, "k")
    with pytest.raises(TypeError):
        one(1, x, b"k", 1)  # kind is a str
    with pytest.raises(TypeError, match="not a caller"):
        _core.shm_one_counts(len)
    assert _core.shm_one_counts(one) == (0, 0)
    assert not ctrl.any()  # nothing was posted by a refused call


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize("workers", [2, 4])
def test_the_one_round_call_equals_mirrored_strategy_around_its_threshold(workers, no_shm_left):
    proc, _ = _launch(workers, "shm_small", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(_results(proc, workers)[0]) >= 150


@needs_mpi
@pytest.mark.multi_worker
@pytest.mark.parametrize(
    ("mode", "named"),
    [("kill", tmw._KILLED_WORKER_1), ("sigint", r"worker 1 of 2 raised KeyboardInterrupt")],
)
def test_a_worker_killed_or_interrupted_inside_the_one_round_call_ends_the_job_named(mode, named, no_shm_left):
    """Worker 1 is waiting inside the extension's spin (worker 0 comes 3 s late) when it is killed, or gets
    SIGINT (which only Python can act on: the spin returns to the poll every ~100 us)."""
    proc, took = _launch(2, f"shm_small_{mode}", timeout=60)
    assert proc.returncode != 0
    assert "UNREACHABLE" not in proc.stdout
    assert "READY 1" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert took < 15
    assert re.search(named, proc.stderr), proc.stderr[-2000:]
