"""Input on GPU replicas: pinned staging ring, copy streams and events, scatter of device batches.

Every step is checked against the NumPy split (the ceil rule) of the same batch; steps are kept
and re-checked at the end, so a staging buffer or device array reused too early shows up as wrong
contents. Needs CuPy and a GPU (marker ``gpu``), or the fake CuPy of tests/emu.
"""

from __future__ import annotations


import numpy as np
import pytest
from conftest import gpu0_split

import cudist
from cudist import _gpu_feeder, _input_lib
from cudist._kernels._split import split_sizes
from cudist.data import Dataset

pytestmark = pytest.mark.gpu


def _split_np(a, n):
    out, start = [], 0
    for s in split_sizes(a.shape[0], n):
        out.append(a[start : start + s])
        start += s
    return out


@pytest.fixture(params=[1, 2, 3], ids=["1logical", "2logical", "3logical"])
def strategy(request):
    """MirroredStrategy over ``n`` logical GPUs of physical GPU 0."""
    n = request.param
    with gpu0_split(n):
        yield cudist.MirroredStrategy([f"/gpu:{i}" for i in range(n)])


@pytest.fixture(autouse=True)
def _no_leaked_threads(no_leaked_threads):
    yield


def _local(strategy, value):
    return list(strategy.experimental_local_results(value))


def _batches(seed, count, sizes=(7, 8, 5)):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        b = sizes[i % len(sizes)]
        out.append(
            {
                "x": (rng.standard_normal((b, 3)) * 10).astype(np.float32),
                "y": rng.integers(-(10**6), 10**6, size=(b,)).astype(np.int64),
                "w": rng.standard_normal((b, 2, 2)).astype(np.float16),
            }
        )
    return out


def _check_step(strategy, step, batch, gpus):
    import cupy

    n = strategy.num_replicas_in_sync
    for key, leaf in batch.items():
        parts = _local(strategy, step[key])
        want = _split_np(leaf, n)
        assert len(parts) == n
        for r, (p, w) in enumerate(zip(parts, want)):
            assert isinstance(p, cupy.ndarray), (key, r, type(p))
            assert p.device.id == gpus[r] and p.dtype == w.dtype and p.shape == w.shape
            np.testing.assert_array_equal(cupy.asnumpy(p), w)


@pytest.mark.parametrize("buffer_size", [0, 1, 3])
def test_split_steps_on_devices_match_numpy_and_stay_intact(strategy, buffer_size):
    n = strategy.num_replicas_in_sync
    batches = _batches(1, 25)
    opts = cudist.InputOptions(experimental_per_replica_buffer_size=buffer_size)
    it = iter(strategy.experimental_distribute_dataset(batches, opts))
    steps = list(it)
    assert len(steps) == len(batches)
    for step, batch in zip(steps, batches):  # every step kept: none overwritten by later ones
        _check_step(strategy, step, batch, [0] * n)
    feeder = it._steps._feeder
    # The staging ring is reused: bounded by the prefetch depth, not by the 25 steps.
    assert 1 <= len(feeder.slots) <= buffer_size + 2
    assert feeder.pinned_allocations <= len(feeder.slots) * 2


@pytest.mark.parametrize("buffer_size", [0, 2])
def test_steps_dropped_after_queued_compute_do_not_corrupt_it(strategy, buffer_size):
    """The training pattern: each step's arrays feed work queued on the consumer's stream and are
    dropped at once, so the pool hands their memory to the steps copied next. Those copies run on
    the copy stream, which must wait for the consumer's queued work before overwriting it."""
    import cupy

    n = strategy.num_replicas_in_sync
    batches = _batches(2, 12, sizes=(8,))
    opts = cudist.InputOptions(experimental_per_replica_buffer_size=buffer_size)
    results = []
    for step in strategy.experimental_distribute_dataset(batches, opts):
        results.append([p * 2 for p in _local(strategy, step["x"])])  # queued, reads the step's memory
        del step
    for got, batch in zip(results, batches):
        for g, w in zip(got, _split_np(batch["x"], n)):
            np.testing.assert_array_equal(cupy.asnumpy(g), w * 2)


def test_host_arrays_when_not_fetching_to_device(strategy):
    batches = _batches(2, 3)
    opts = cudist.InputOptions(experimental_fetch_to_device=False)
    for step, batch in zip(strategy.experimental_distribute_dataset(batches, opts), batches):
        for key, leaf in batch.items():
            parts = _local(strategy, step[key])
            assert all(type(p) is np.ndarray for p in parts)
            for p, w in zip(parts, _split_np(leaf, strategy.num_replicas_in_sync)):
                np.testing.assert_array_equal(p, w)


def test_dataset_pipeline(strategy):
    import cupy

    x = np.arange(40, dtype=np.float32).reshape(20, 2) * 1.5 - 7
    ds = Dataset.from_tensor_slices(x).batch(6).map(lambda b: (b, b[:, :1].astype(np.int32)))
    got = []
    for xs, ks in strategy.experimental_distribute_dataset(ds):
        parts, kparts = _local(strategy, xs), _local(strategy, ks)
        assert all(isinstance(p, cupy.ndarray) for p in parts + kparts)
        for p, k in zip(parts, kparts):
            np.testing.assert_array_equal(cupy.asnumpy(k), cupy.asnumpy(p)[:, :1].astype(np.int32))
        got.append(np.concatenate([cupy.asnumpy(p) for p in parts]))
    np.testing.assert_array_equal(np.concatenate(got), x)
    assert len(got) == 4


def test_scalar_leaves_become_0d_device_arrays(strategy):
    import cupy

    n = strategy.num_replicas_in_sync
    data = [{"x": np.full((2,), i, np.float64), "k": 3, "s": np.float32(0.5)} for i in range(n)]
    (step,) = list(strategy.distribute_datasets_from_function(lambda ctx: data))
    # The dataset makes the Python 3 an int32 scalar (as TF does); array scalars go to the device.
    ks = _local(strategy, step["k"])
    assert all(isinstance(k, cupy.ndarray) and k.dtype == np.int32 and int(k) == 3 for k in ks)
    xs, ss = _local(strategy, step["x"]), _local(strategy, step["s"])
    assert len(xs) == len(ss) == n
    for r, (x, s) in enumerate(zip(xs, ss)):
        # A NumPy scalar is an array leaf: a 0-d CuPy array on the device.
        assert isinstance(x, cupy.ndarray) and isinstance(s, cupy.ndarray) and s.shape == () and s.dtype == np.float32
        np.testing.assert_array_equal(cupy.asnumpy(x), np.full((2,), r, np.float64))
        assert float(s) == 0.5


def test_device_resident_batches_are_split_by_scatter(strategy, monkeypatch):
    import cupy

    from cudist._kernels._cupy import CupyBackend

    calls = []
    real = CupyBackend.scatter

    def scatter(self, batch, devices):
        calls.append(list(devices))
        return real(self, batch, devices)

    monkeypatch.setattr(CupyBackend, "scatter", scatter)
    n = strategy.num_replicas_in_sync
    host = _batches(3, 6)
    dev = [{k: cupy.asarray(v) for k, v in b.items()} for b in host]
    steps = list(strategy.experimental_distribute_dataset(dev))
    for step, batch in zip(steps, host):
        _check_step(strategy, step, batch, [0] * n)
    if n == 1:
        assert calls == []  # nothing to split: the batch is already on the replica's GPU
        return
    assert calls == [[0] * n] * len(host)
    # The scatter outputs are new arrays: changing the source batch leaves the steps intact.
    for b in dev:
        for v in b.values():
            v.fill(0)
    for step, batch in zip(steps, host):
        _check_step(strategy, step, batch, [0] * n)


def test_datasets_from_function_per_replica_batches(strategy):
    import cupy

    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(5)
    data = [rng.standard_normal((3, 2)).astype(np.float32) for _ in range(2 * n + 1)]
    steps = list(strategy.distribute_datasets_from_function(lambda ctx: data))
    assert len(steps) == 3
    flat = [p for s in steps for p in _local(strategy, s)]
    for i, p in enumerate(flat):
        assert isinstance(p, cupy.ndarray) and p.device.id == 0
        if i < len(data):
            np.testing.assert_array_equal(cupy.asnumpy(p), data[i])
        else:  # the data ran out in the middle of the last step: empty batches
            assert p.shape == (0, 2) and p.dtype == np.float32


def test_early_break_and_close_stop_the_pipeline(strategy):
    ds = Dataset.range(10**9).batch(4)
    it = iter(strategy.experimental_distribute_dataset(ds, cudist.InputOptions(experimental_per_replica_buffer_size=2)))
    first = next(it)
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(p.get()) for p in _local(strategy, first)]), np.arange(4)
    )
    for i, _ in enumerate(strategy.experimental_distribute_dataset(ds)):
        if i == 3:
            break  # the autouse fixture checks the prefetch thread is gone


def test_errors_arrive_after_the_steps_before_them(strategy):
    def gen():
        yield np.arange(6.0)
        yield np.arange(6.0) + 1
        raise ValueError("bad input file")

    it = iter(strategy.experimental_distribute_dataset(gen(), cudist.InputOptions(experimental_per_replica_buffer_size=2)))
    assert float(sum(p.sum() for p in _local(strategy, next(it)))) == 15.0
    assert float(sum(p.sum() for p in _local(strategy, next(it)))) == 21.0
    with pytest.raises(ValueError, match="bad input file"):
        next(it)


def test_non_numeric_input_names_the_option(strategy):
    with pytest.raises(TypeError, match="experimental_fetch_to_device=False"):
        next(iter(strategy.experimental_distribute_dataset([np.array(["a", "b", "c", "d"])])))


def test_copies_run_on_a_non_default_stream_and_consumer_waits(strategy, monkeypatch):
    import cupy

    waits = []
    real_hand_out = _gpu_feeder.GpuFeeder.hand_out

    def hand_out(flight):
        waits.append([(g, ev) for g, ev in flight.events])
        return real_hand_out(flight)

    monkeypatch.setattr(_gpu_feeder.GpuFeeder, "hand_out", staticmethod(hand_out))
    batches = _batches(6, 4)
    for step, batch in zip(strategy.experimental_distribute_dataset(batches), batches):
        _check_step(strategy, step, batch, [0] * strategy.num_replicas_in_sync)
    stream = _gpu_feeder._copy_stream(0)
    assert stream is _gpu_feeder._copy_stream(0)
    assert stream.ptr != cupy.cuda.Stream.null.ptr
    # One copy event per step (all replicas are on GPU 0), each already reached after the hand-out.
    assert [len(w) for w in waits] == [1] * 4
    for w in waits:
        w[0][1].synchronize()
        assert w[0][1].done


def test_v1_iterator_on_gpus(strategy):
    import warnings

    batches = _batches(7, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        it = strategy.make_dataset_iterator(batches)
    for batch in batches:
        _check_step(strategy, it.get_next(), batch, [0] * strategy.num_replicas_in_sync)
    with pytest.raises(_input_lib.OutOfRangeError):
        it.get_next()


@pytest.mark.multi_gpu
@pytest.mark.parametrize("buffer_size", [0, 2])
def test_physical_gpus_get_their_pieces(buffer_size):
    import cupy

    count = min(cupy.cuda.runtime.getDeviceCount(), 4)
    strategy = cudist.MirroredStrategy([f"/gpu:{i}" for i in range(count)])
    batches = _batches(8, 12, sizes=(9, 2, 13))
    opts = cudist.InputOptions(experimental_per_replica_buffer_size=buffer_size)
    steps = list(strategy.experimental_distribute_dataset(batches, opts))
    for step, batch in zip(steps, batches):
        _check_step(strategy, step, batch, list(range(count)))
    dev = [{k: cupy.asarray(v) for k, v in b.items()} for b in batches[:3]]
    for step, batch in zip(strategy.experimental_distribute_dataset(dev), batches[:3]):
        _check_step(strategy, step, batch, list(range(count)))
