"""Context functions: default / cross-replica / replica contexts, scopes, set_strategy, threads, greenlets."""

from __future__ import annotations

import threading

import greenlet
import pytest

import cudist
from cudist._distribute_lib import _default_strategy


def test_outside_any_scope_is_the_default_context():
    s = cudist.get_strategy()
    assert s is _default_strategy()
    assert not cudist.has_strategy()
    ctx = cudist.get_replica_context()
    assert ctx is not None
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    assert ctx.strategy is s
    assert not cudist.in_cross_replica_context()
    assert cudist.get_cross_replica_context() is None


def test_inside_scope_is_cross_replica(strategy):
    with strategy.scope() as s:
        assert s is strategy
        assert cudist.get_strategy() is strategy
        assert cudist.has_strategy()
        assert cudist.get_replica_context() is None
        assert cudist.in_cross_replica_context()
        assert cudist.get_cross_replica_context() is strategy
    assert cudist.get_strategy() is _default_strategy()
    assert not cudist.has_strategy()


def test_inside_run_is_replica_context(strategy):
    def fn():
        ctx = cudist.get_replica_context()
        return (
            ctx.replica_id_in_sync_group,
            ctx.num_replicas_in_sync,
            ctx.strategy is strategy,
            cudist.get_strategy() is strategy,
            cudist.in_cross_replica_context(),
            cudist.get_cross_replica_context(),
            cudist.has_strategy(),
        )

    out = strategy.experimental_local_results(strategy.run(fn))
    n = strategy.num_replicas_in_sync
    assert len(out) == n
    for i, o in enumerate(out):
        assert o == (i, n, True, True, False, None, True)
    # run leaves the caller's context unchanged
    assert cudist.get_strategy() is _default_strategy()


def test_run_inside_scope_returns_to_cross_replica(strategy):
    with strategy.scope():
        strategy.run(lambda: None)
        assert cudist.get_replica_context() is None
        assert cudist.get_cross_replica_context() is strategy


def test_same_scope_nests():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        with s.scope():
            assert cudist.get_strategy() is s
        assert cudist.get_strategy() is s
    assert not cudist.has_strategy()


def test_mixing_scopes_raises_naming_both():
    a = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    b = cudist.OneDeviceStrategy("/cpu:0")
    with a.scope():
        with pytest.raises(RuntimeError, match="Mixing different") as ei:
            with b.scope():
                pass
        assert repr(a) in str(ei.value) and repr(b) in str(ei.value)
        # still in a's scope after the failed attempt
        assert cudist.get_strategy() is a
    assert not cudist.has_strategy()


def test_default_scope_inside_another_raises():
    a = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with a.scope():
        with pytest.raises(RuntimeError, match="Must not nest"):
            with _default_strategy().scope():
                pass


def test_scope_exits_on_exception():
    s = cudist.OneDeviceStrategy("/cpu:0")
    with pytest.raises(KeyError):
        with s.scope():
            raise KeyError("x")
    assert not cudist.has_strategy()
    assert cudist.get_replica_context() is not None


def test_run_of_other_strategy_inside_scope_raises():
    a = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    b = cudist.MirroredStrategy(["/cpu:2", "/cpu:3"])
    with a.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            b.run(lambda: None)


def test_experimental_set_strategy():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    other = cudist.OneDeviceStrategy("/cpu:0")
    try:
        cudist.experimental_set_strategy(s)
        assert cudist.get_strategy() is s
        assert cudist.has_strategy()
        assert cudist.in_cross_replica_context()
        with s.scope():
            assert cudist.get_strategy() is s
        with pytest.raises(RuntimeError, match="Mixing different"):
            with other.scope():
                pass
        cudist.experimental_set_strategy(other)  # replacing a set strategy is allowed
        assert cudist.get_strategy() is other
    finally:
        cudist.experimental_set_strategy(None)
    assert cudist.get_strategy() is _default_strategy()
    with s.scope():
        with pytest.raises(RuntimeError, match="Must not be called inside"):
            cudist.experimental_set_strategy(other)
    with pytest.raises(TypeError):
        cudist.experimental_set_strategy("mirrored")


def test_threads_start_outside_any_scope():
    s = cudist.OneDeviceStrategy("/cpu:0")
    seen = {}

    def worker():
        seen["strategy"] = cudist.get_strategy()
        seen["ctx"] = cudist.get_replica_context()

    with s.scope():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["strategy"] is _default_strategy()
    assert seen["ctx"] is not None and seen["ctx"].num_replicas_in_sync == 1


def test_greenlets_have_their_own_context():
    s = cudist.OneDeviceStrategy("/cpu:0")
    seen = []

    def other():
        seen.append(cudist.get_strategy())
        with s.scope():
            main.switch()
            seen.append(cudist.get_strategy())

    main = greenlet.getcurrent()
    g = greenlet.greenlet(other)
    g.switch()  # other is now suspended inside s.scope()
    assert cudist.get_strategy() is _default_strategy()
    g.switch()
    assert seen == [_default_strategy(), s]
    assert cudist.get_strategy() is _default_strategy()


def test_default_replica_context_collectives():
    ctx = cudist.get_replica_context()
    assert float(ctx.all_reduce("sum", 3.0)) == 3.0
    seen = []

    def merge_fn(strategy, x):
        seen.append((strategy, cudist.in_cross_replica_context()))
        return x + 1

    assert ctx.merge_call(merge_fn, args=(1,)) == 2
    assert seen == [(_default_strategy(), True)]
    assert not cudist.in_cross_replica_context()


def test_default_strategy_run_and_reduce():
    s = cudist.get_strategy()
    assert s.run(lambda x: x * 2, args=(21,)) == 42
    assert s.num_replicas_in_sync == 1
    assert float(s.reduce("SUM", 3.0, axis=None)) == 3.0
    assert s.experimental_local_results(5) == (5,)
    with pytest.raises(ValueError, match="list or tuple"):
        s.run(lambda x: x, args=5)
