"""The replica engine: errors propagate and release the other replicas; disagreements are named."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import cudist
from cudist._replica_engine import ReplicaMismatchError

#: Every test twice: replicas on greenlets, then on replica threads.
pytestmark = pytest.mark.usefixtures("replica_execution")


class Boom(Exception):
    pass


def rid():
    return cudist.get_replica_context().replica_id_in_sync_group


def ctx():
    return cudist.get_replica_context()


@pytest.fixture(params=[2, 4])
def ms(request):
    return cudist.MirroredStrategy([f"/cpu:{i}" for i in range(request.param)])


def test_exception_while_others_wait_in_all_reduce(ms):
    unwound = []

    def fn():
        i = rid()
        try:
            if i == 1:
                raise Boom("replica one failed")
            return ctx().all_reduce("sum", 1.0)
        finally:
            unwound.append(i)

    with pytest.raises(Boom, match="replica one failed") as ei:
        ms.run(fn)
    if sys.version_info >= (3, 11):  # exception notes (add_note) are Python 3.11+
        assert "(raised in replica 1 of" in "".join(getattr(ei.value, "__notes__", []))
    # replica 0 waited in all_reduce and was unwound (its finally ran); later replicas never hang
    assert 0 in unwound and 1 in unwound
    # the strategy works afterwards
    out = ms.run(lambda: ctx().all_reduce("sum", 1.0))
    assert [float(x) for x in ms.experimental_local_results(out)] == [ms.num_replicas_in_sync] * ms.num_replicas_in_sync


def test_exception_after_a_collective(ms):
    n = ms.num_replicas_in_sync

    def fn():
        a = ctx().all_reduce("sum", 1.0)
        if rid() == n - 1:
            raise KeyError("late")
        return ctx().all_reduce("sum", a)

    with pytest.raises(KeyError, match="late"):
        ms.run(fn)
    assert ms.run(lambda: 2) == 2


def test_exception_in_replica_zero_before_any_collective(ms):
    started = []

    def fn():
        started.append(rid())
        if rid() == 0:
            raise ZeroDivisionError("first")
        return ctx().all_reduce("sum", 1.0)

    with pytest.raises(ZeroDivisionError):
        ms.run(fn)
    assert sorted(started) == list(range(ms.num_replicas_in_sync))  # every replica ran (TF's rule)


def test_broad_except_in_a_replica_does_not_swallow_the_release():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        if rid() == 1:
            raise Boom("one")
        try:
            return ctx().all_reduce("sum", 1.0)
        except Exception:  # the release is not an Exception, so it passes through
            return "swallowed"

    with pytest.raises(Boom):
        s.run(fn)
    assert s.run(lambda: 5) == 5


def test_exception_in_merge_fn_releases_replicas(ms):
    def merge_fn(strategy, v):
        raise ValueError("merge failed")

    with pytest.raises(ValueError, match="merge failed"):
        ms.run(lambda: ctx().merge_call(merge_fn, args=(rid(),)))
    assert ms.run(lambda: 1) == 1


def test_mismatched_collectives_are_named():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        if rid() == 0:
            return ctx().all_reduce("sum", 1.0)
        return ctx().merge_call(lambda st: None)

    with pytest.raises(ReplicaMismatchError, match="replica 0 called all_reduce; replica 1 called merge_call"):
        s.run(fn)
    assert issubclass(ReplicaMismatchError, RuntimeError)
    assert s.run(lambda: 1) == 1


def test_replica_returning_while_others_wait():
    s = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(4)])

    def fn():
        if rid() == 3:
            return ctx().all_reduce("sum", 1.0)
        return None

    with pytest.raises(ReplicaMismatchError, match="replicas 0, 1, 2 returned; replica 3 called all_reduce"):
        s.run(fn)


def test_different_shapes_at_the_same_step():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(ValueError, match=r"replica 0 has shape \(2,\) dtype float64, replica 1 has shape \(3,\)"):
        s.run(lambda: ctx().all_reduce("sum", np.ones(2 + rid())))
    with pytest.raises(ValueError, match="replica 1 has shape \\(2,\\) dtype float32"):
        s.run(lambda: ctx().all_reduce("sum", np.ones(2, [np.float64, np.float32][rid()])))
    with pytest.raises(ValueError, match="at .*'w'"):
        s.run(lambda: ctx().all_reduce("sum", {"v": np.ones(2), "w": np.ones(1 + rid())}))
    with pytest.raises(ValueError, match="replica 1 passed a structure"):
        s.run(lambda: ctx().all_reduce("sum", [1.0] * (1 + rid())))
    with pytest.raises(ValueError, match="replica 0 reduces with SUM but replica 1 with MEAN"):
        s.run(lambda: ctx().all_reduce(["sum", "mean"][rid()], 1.0))


def test_many_steps_in_a_loop(ms):
    n = ms.num_replicas_in_sync

    def fn(x):
        total = x
        for _ in range(5):
            total = ctx().all_reduce("mean", total) + 1.0
        return total

    x = cudist.PerReplica([np.float64(i) for i in range(n)])
    want = (n - 1) / 2 + 5.0
    for _ in range(3):
        assert [float(v) for v in ms.experimental_local_results(ms.run(fn, args=(x,)))] == [want] * n


def test_run_inside_merge_fn():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def merge_fn(strategy, v):
        inner = strategy.run(lambda: ctx().all_reduce("sum", 10.0))
        return float(strategy.experimental_local_results(inner)[0])

    out = s.run(lambda: ctx().merge_call(merge_fn, args=(rid(),)) + ctx().all_reduce("sum", 1.0))
    assert [float(v) for v in s.experimental_local_results(out)] == [22.0, 22.0]


def test_runs_from_several_threads():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    errors, results = [], []

    def worker(k):
        try:
            for _ in range(50):
                out = s.run(lambda: ctx().all_reduce("sum", np.float64(k + rid())))
                results.append((k, tuple(float(v) for v in s.experimental_local_results(out))))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert len(results) == 150
    for k, vals in results:
        assert vals == (3.0 * k + 3.0,) * 3


def test_replica_that_refuses_to_unwind_is_dropped():
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        if rid() == 1:
            raise Boom("one")
        while True:  # swallows every release: the engine gives up on this greenlet, never hangs
            try:
                return ctx().all_reduce("sum", 1.0)
            except BaseException:
                continue

    with pytest.raises(Boom):
        s.run(fn)
    out = s.run(lambda: ctx().all_reduce("sum", 2.0))
    assert [float(v) for v in s.experimental_local_results(out)] == [4.0, 4.0]


def test_a_replica_that_switches_away_on_its_own_fails_the_run_not_the_next(ms):
    """A replica function that switches to its greenlet's parent itself (bypassing the collectives)
    breaks the run it is in -- an error, not a hang or a crash -- and the next run works."""
    import greenlet

    def fn():
        if rid() == 1:
            parent = greenlet.getcurrent().parent
            if parent is not None:
                parent.switch()
            raise Boom("no parent to switch to")  # a replica thread's main greenlet has none
        return ctx().all_reduce("sum", 1.0)

    with pytest.raises(Exception) as ei:
        ms.run(fn)
    if type(ei.value) is RuntimeError:  # the greenlet engines say what happened (replica threads: Boom)
        assert "switched greenlets by itself" in str(ei.value)
    else:
        assert type(ei.value) is Boom
    n = ms.num_replicas_in_sync
    out = ms.run(lambda: ctx().all_reduce("sum", np.float64(rid())))
    assert [float(x) for x in ms.experimental_local_results(out)] == [float(sum(range(n)))] * n
