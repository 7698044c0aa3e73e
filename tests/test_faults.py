"""Fault safety of the replica engine: interrupts, replicas that raise, what a failed step leaves.

The rule for a failed step (TF's, whose replicas are threads): every replica runs until it returns,
raises, or reaches a collective that can no longer complete; those are unwound and the error of the
lowest-numbered failing replica propagates from ``run``. The engine is never left broken: the next
``run`` behaves normally, whatever the interrupt hit.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
import time
import weakref

import greenlet
import numpy as np
import pytest

import cudist
from cudist import PerReplica

VA = cudist.VariableAggregation


def _rid():
    return cudist.get_replica_context().replica_id_in_sync_group


def _strategy(n):
    return cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


def _check_healthy(s):
    """A normal step after a fault: correct, per-replica results of the right function."""
    n = s.num_replicas_in_sync
    out = s.run(lambda: ("ok", cudist.get_replica_context().all_reduce("sum", np.float32(_rid() + 1))))
    tags, values = zip(*s.experimental_local_results(out)) if n > 1 else ([out[0]], [out[1]])
    assert set(tags) == {"ok"}
    assert [float(v) for v in values] == [n * (n + 1) / 2] * n


@pytest.mark.usefixtures("replica_execution")
@pytest.mark.parametrize("n", [2, 3])
def test_a_replica_raising_greenlet_exit_is_an_error_and_the_pool_survives(n):
    s = _strategy(n)

    def step():
        if _rid() == 1:
            raise greenlet.GreenletExit("replica 1 gives up")
        return cudist.get_replica_context().all_reduce("sum", 1.0)

    with pytest.raises(greenlet.GreenletExit, match="replica 1 gives up"):
        s.run(step)
    assert s.run(lambda: 1) == 1
    _check_healthy(s)
    _check_healthy(_strategy(n))  # a new strategy with the same replica count shares the pool


@pytest.mark.usefixtures("replica_execution")
@pytest.mark.parametrize("where", ["before", "in_merge", "after_all_reduce"])
def test_keyboard_interrupt_inside_a_replica_propagates_and_the_next_run_is_normal(where):
    s = _strategy(3)

    def step():
        ctx = cudist.get_replica_context()
        if where == "before" and _rid() == 2:
            raise KeyboardInterrupt
        if where == "in_merge":
            def merge(_):
                raise KeyboardInterrupt

            ctx.merge_call(merge)
        ctx.all_reduce("sum", 1.0)
        if where == "after_all_reduce" and _rid() == 0:
            raise KeyboardInterrupt
        return ctx.all_reduce("sum", 2.0)

    with pytest.raises(KeyboardInterrupt):
        s.run(step)
    _check_healthy(s)


@pytest.mark.usefixtures("replica_execution")
def test_a_failed_step_runs_every_replica_s_local_work():
    """Replica 1 fails after its local write: the others (before and after it) still did theirs."""
    s = _strategy(4)
    with s.scope():
        local = cudist.Variable(np.zeros(2, np.float32))  # aggregation NONE: per-replica writes

    def step():
        local.assign_add(np.full(2, _rid() + 1, np.float32))
        if _rid() == 1:
            raise ValueError("bad batch")
        cudist.get_replica_context().all_reduce("sum", 1.0)  # can no longer complete: unwound

    with pytest.raises(ValueError, match="bad batch") as info:
        s.run(step)
    if sys.version_info >= (3, 11):  # exception notes (add_note) are Python 3.11+
        assert "(raised in replica 1 of 4)" in info.value.__notes__
    comps = [c.numpy() for c in local.values]
    assert [float(c[0]) for c in comps] == [1.0, 2.0, 3.0, 4.0]
    _check_healthy(s)


@pytest.mark.usefixtures("replica_execution")
def test_the_lowest_failing_replica_s_error_propagates():
    s = _strategy(3)

    def step():
        raise RuntimeError(f"replica {_rid()}")

    with pytest.raises(RuntimeError, match="replica 0"):
        s.run(step)


@pytest.mark.usefixtures("replica_execution")
def test_a_replica_failing_after_a_collective_lets_the_others_finish_theirs():
    s = _strategy(3)
    seen = []

    def step():
        total = cudist.get_replica_context().all_reduce("sum", 1.0)
        seen.append((_rid(), float(total)))
        if _rid() == 0:
            raise ValueError("after the collective")
        return total

    with pytest.raises(ValueError, match="after the collective"):
        s.run(step)
    assert sorted(seen) == [(0, 3.0), (1, 3.0), (2, 3.0)]
    _check_healthy(s)


@pytest.mark.usefixtures("replica_execution")
def test_idle_replicas_hold_no_reference_to_the_last_step():
    s = _strategy(2)
    arrays = [np.ones(1000, np.float32), np.ones(1000, np.float32)]
    refs = [weakref.ref(a) for a in arrays]
    out = s.run(lambda x: x * 2, args=(PerReplica(arrays),))
    result_refs = [weakref.ref(v) for v in s.experimental_local_results(out)]
    del arrays, out
    gc.collect()
    assert all(r() is None for r in refs), "the step's arguments are still referenced"
    assert all(r() is None for r in result_refs), "the step's results are still referenced"


@pytest.mark.usefixtures("replica_execution")
@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11+")
def test_a_re_raised_exception_object_does_not_pile_up_notes():
    s = _strategy(2)
    err = ValueError("the same object every step")

    def step():
        if _rid() == 1:
            raise err

    for _ in range(50):
        with pytest.raises(ValueError):
            s.run(step)
    assert err.__notes__ == ["(raised in replica 1 of 2)"]


def test_an_iterator_interrupted_in_next_says_so_instead_of_ending():
    s = _strategy(2)
    calls = {"n": 0}

    def slow(x):
        calls["n"] += 1
        if calls["n"] == 7:  # the input reads a step ahead: this is the third step's read
            raise KeyboardInterrupt  # Ctrl-C while the input pipeline computes a batch
        return x

    ds = cudist.data.Dataset.range(40).map(slow).batch(2)
    it = iter(s.experimental_distribute_dataset(ds))
    next(it)
    next(it)
    with pytest.raises(KeyboardInterrupt):
        next(it)
    with pytest.raises(RuntimeError, match="interrupted"):
        next(it)  # not a silent StopIteration that would end the training loop early


# ----------------------------------------------------------------------------- the SIGINT fuzz
class _Interrupter:
    """Sends a real SIGINT to this process at a random moment after each ``arm()``.

    A one-shot interval timer (SIGALRM, whose handler sends SIGINT) rather than a thread: the
    timer fires whatever the main thread is doing, without waiting for the GIL to be handed over.
    """

    def __init__(self, seed):
        self._rng = random.Random(seed)
        self._old = signal.signal(signal.SIGALRM, self._fire)
        self.sent = 0

    def _fire(self, signum, frame):
        self.sent += 1
        # To this (the main) thread itself, so the SIGINT is delivered before pthread_kill returns;
        # os.kill lets the kernel pick any thread, and on a loaded machine that thread may run the
        # C handler only after disarm() has stopped waiting, i.e. during the checks.
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    def arm(self):
        signal.setitimer(signal.ITIMER_REAL, self._rng.uniform(1e-6, 400e-6))

    def disarm(self):
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for _ in range(20):  # a SIGINT already sent lands here, not in the checks
                time.sleep(0)
        except KeyboardInterrupt:
            pass

    def close(self):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._old)


def test_thousands_of_real_sigints_never_break_run_or_variables(replica_execution):
    """SIGINT at random points of a training loop (run, collectives, merge_call, fused updates):
    after each, the next run is normal and mirrored copies are never torn apart; on replica
    threads, every abandoned pool's threads end (none accumulate).

    In a fresh interpreter: libraries imported by other tests (JAX's GC callbacks) would swallow
    interrupts that land in them, which is theirs to answer for, not the engine's.
    """
    import subprocess
    import sys

    env = dict(os.environ, CUDIST_REPLICA_EXECUTION=replica_execution)
    proc = subprocess.run(
        [sys.executable, __file__, "sigint-fuzz"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    interrupts, steps = map(int, proc.stdout.split()[-2:])
    assert interrupts >= 1000, f"only {interrupts} interrupts landed in {steps} steps"


def _sigint_fuzz():
    from cudist import config

    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 4)
    # Python's own handler, even where this process inherited SIGINT ignored (a shell's background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    n = 3
    s = _strategy(n)
    with s.scope():
        w = cudist.Variable(np.zeros(64, np.float32), aggregation=VA.SUM)
        opt = cudist.optimizers.SGD(0.01, momentum=0.9)
    grads = [np.full(64, r + 1, np.float32) for r in range(n)]

    def step(tag):
        ctx = cudist.get_replica_context()
        total = ctx.all_reduce("sum", np.float32(_rid() + 1))
        w.assign_add(np.ones(64, np.float32))
        opt.apply_gradients([(grads[_rid()], w)])
        return tag, float(total)

    interrupter = _Interrupter(seed=1234)
    interrupts = steps = 0
    deadline = time.monotonic() + 20
    try:
        while interrupts < 2000 and time.monotonic() < deadline:
            try:
                interrupter.arm()
                for k in range(4):
                    s.run(step, args=(f"step{k}",))
                    steps += 1
                interrupter.disarm()
            except KeyboardInterrupt:
                interrupts += 1
            interrupter.disarm()  # from here on no signal is pending: the checks run undisturbed
            if interrupts % 50 == 0 or steps % 97 == 0:
                out = s.run(step, args=("check",))
                assert [r for r in s.experimental_local_results(out)] == [("check", n * (n + 1) / 2)] * n
                comps = [c.numpy() for c in w.values]
                for c in comps[1:]:
                    np.testing.assert_array_equal(c, comps[0])  # mirrored copies stay identical
    finally:
        interrupter.close()
    _check_healthy(s)
    slots = opt.get_slot(w, "momentum")
    vals = [c.numpy() for c in slots.values]
    for v in vals[1:]:
        np.testing.assert_array_equal(v, vals[0])
    # Replica threads of the pools the interrupts abandoned end: what is left is the live pool's n.
    import _thread

    deadline = time.monotonic() + 30
    while _thread._count() > n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _thread._count() <= n, f"{_thread._count()} replica threads alive after {interrupts} interrupts"
    print(interrupts, steps)


# ----------------------------------------------------------------------------- processes and installs
def _child_all_reduce(q):
    from cudist._kernels import get_backend

    bufs = [np.full(1 << 20, r + 1, np.float32) for r in range(3)]  # large: the parallel path in the parent
    get_backend("numba").all_reduce(bufs)
    q.put([float(b[12345]) for b in bufs])


@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")  # JAX warns at every fork once imported
def test_numba_kernels_work_in_a_forked_child():
    """After the parent ran parallel Numba kernels (GNU OpenMP), a fork child still computes (serially)."""
    import multiprocessing as mp

    from cudist._kernels import get_backend

    parent = [np.full(1 << 20, r + 1, np.float32) for r in range(3)]
    get_backend("numba").all_reduce(parent)  # OpenMP threads started here
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_all_reduce, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0, f"the forked child died (exit code {p.exitcode})"
    assert q.get(timeout=5) == [6.0, 6.0, 6.0]


def test_numba_compiles_without_a_cache_where_none_can_be_written():
    """A read-only install under a read-only HOME: Numba's 'cannot cache' becomes an uncached compile."""
    from cudist._kernels import _numba

    calls = []

    def fake_decorator(*args, cache, **kwargs):
        calls.append(cache)
        if cache:
            raise RuntimeError("cannot cache function 'f': no locator available for file '/ro/f.py'")
        return lambda fn: fn

    def f():
        return 42

    assert _numba._cached(fake_decorator)(f)() == 42
    assert calls == [True, False]

    def other_error(*args, cache, **kwargs):
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        _numba._cached(other_error)(f)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["sigint-fuzz"]:
        _sigint_fuzz()
