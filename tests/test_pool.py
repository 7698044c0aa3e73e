"""The result-buffer pool of the user's all-reduce path: reuse without ever overwriting a held result."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cudist
from cudist import PerReplica
from cudist._dataplane import pool

BIG = (1 << 16,)  # 256 KiB of float32: pooled


def _ptr(a) -> int:
    return a.__array_interface__["data"][0]


def test_a_dropped_buffer_is_reused_and_a_held_one_is_not():
    pool.clear()
    a = pool.take(BIG, np.float32)
    pa = _ptr(a)
    b = pool.take(BIG, np.float32)
    assert _ptr(b) != pa  # `a` is held: a second buffer
    view = a[10:20]  # a view keeps the buffer alive on its own
    del a
    c = pool.take(BIG, np.float32)
    assert _ptr(c) != pa
    del view, c
    gc.collect()
    d = pool.take(BIG, np.float32)
    assert _ptr(d) == pa  # free again: the first free buffer is handed out
    assert pool.stats()[BIG[0] * 4][0] <= pool.PER_SIZE


def test_reuse_across_dtypes_and_shapes_of_one_byte_size():
    pool.clear()
    a = pool.take((256, 256), np.float32)
    pa = _ptr(a)
    del a
    b = pool.take((1 << 15,), np.float64)  # same bytes, another dtype and shape
    assert _ptr(b) == pa and b.dtype == np.float64 and b.shape == (1 << 15,) and b.flags.c_contiguous


def test_small_requests_and_a_full_size_are_fresh():
    pool.clear()
    small = pool.take((4,), np.float32)
    assert pool.stats() == {}
    held = [pool.take(BIG, np.float32) for _ in range(pool.PER_SIZE + 2)]
    assert len({_ptr(h) for h in held}) == len(held)  # beyond PER_SIZE: fresh arrays, never shared
    assert pool.stats()[BIG[0] * 4] == (pool.PER_SIZE, pool.PER_SIZE)
    del small, held


@pytest.mark.parametrize("n", [2, 4])
def test_results_the_user_keeps_are_never_overwritten(n):
    """A training loop that keeps every step's all-reduce result sees each one unchanged."""
    s = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    rng = np.random.default_rng(n)
    kept, expected = [], []
    for _ in range(pool.PER_SIZE + 3):
        parts = [rng.standard_normal(BIG).astype(np.float32) for _ in range(n)]
        out = s.run(lambda x: cudist.get_replica_context().all_reduce("sum", x), args=(PerReplica(parts),))
        kept.append(out)
        ref = parts[0].copy()
        for p in parts[1:]:
            ref += p
        expected.append(ref)
    for out, ref in zip(kept, expected):
        for v in s.experimental_local_results(out):
            np.testing.assert_array_equal(v, ref)


def _minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minflt


def test_a_steady_training_loop_stops_faulting_in_result_pages():
    """Dropped results are recycled: after warm-up, steps of 4 MiB all-reduces fault in (almost) no new pages."""
    n = 2
    s = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    parts = PerReplica([np.full(1 << 20, i + 1, np.float32) for i in range(n)])
    step = lambda x: cudist.get_replica_context().all_reduce("sum", x)  # noqa: E731
    for _ in range(3):
        out = s.run(step, args=(parts,))
    del out
    before = _minor_faults()
    for _ in range(20):
        out = s.run(step, args=(parts,))
        assert float(s.experimental_local_results(out)[1][7]) == 3.0
        del out
    per_step = (_minor_faults() - before) / 20
    # Fresh 4 MiB results would fault ~1000 pages per step per replica; recycled ones none.
    assert per_step < 50, f"{per_step} minor page faults per step"
