"""Fuzzes the public entry points with arbitrary arguments (run by tests/test_fuzz.py in a subprocess).

A crash of the interpreter (SIGSEGV, abort) fails the test; every call must return or raise an
exception of the kinds TF raises for bad arguments (TypeError, ValueError, and cudist.errors'
classes, which derive from TF's Python bases), or RuntimeError where TF raises it (replica
mismatches, contexts). Prints "ok <examples>" when done.
"""

from __future__ import annotations

import sys

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudist
import cudist.optimizers as optimizers
from cudist import config

#: What a bad argument may raise (TF's types; RuntimeError for TF's replica-context/mismatch rules).
ALLOWED = (TypeError, ValueError, RuntimeError, NotImplementedError, cudist.errors.OpError)

cpu = config.list_physical_devices("CPU")[0]
config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 3)
STRATEGIES = [cudist.MirroredStrategy(["/cpu:0", "/cpu:1"]), cudist.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"]),
              cudist.OneDeviceStrategy("/cpu:0")]

arrays = st.sampled_from([np.float32, np.float64, np.float16, np.int32, np.int64, np.bool_, np.complex64,
                          np.uint8, object]).flatmap(
    lambda dt: st.lists(st.integers(0, 3), max_size=3).map(
        lambda shape: np.ones(shape, dtype=dt) if dt is not object else np.empty(shape, dtype=object)))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=4),
                    st.binary(max_size=4), st.just(object()), st.just(len), st.just(Ellipsis), st.just(...),
                    st.complex_numbers())
per_replica = st.lists(st.one_of(arrays, scalars), min_size=0, max_size=4).map(lambda v: cudist.PerReplica(v) if v else v)
leaves = st.one_of(scalars, arrays, per_replica)
values = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.tuples(kids, kids), st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), kids, max_size=3)),
    max_leaves=6)
_VALID_OPS = ["sum", "mean", "SUM", "Mean", cudist.ReduceOp.SUM, cudist.ReduceOp.MEAN]
# Mostly valid ops (two of three branches), so the values themselves get through to the collectives.
ops = st.one_of(st.sampled_from(_VALID_OPS), st.sampled_from(_VALID_OPS), st.sampled_from(["max", "", None, 3]), scalars)
axes = st.one_of(st.none(), st.none(), st.integers(-5, 5), st.integers(-2**70, 2**70), scalars)
strategy_index = st.integers(0, len(STRATEGIES) - 1)
modes = st.sampled_from(["greenlets", "threads", "auto"])


def _call(f, *a, **k):
    try:
        return f(*a, **k)
    except ALLOWED:
        return None
    except Exception as e:  # noqa: BLE001 - any other type is a finding: name the call and the type
        raise AssertionError(f"{getattr(f, '__qualname__', f)} raised {type(e).__name__}: {e}") from e


def _consume(out):
    # Results must be usable: unpack local results (as a user would).
    for s in STRATEGIES:
        _call(s.experimental_local_results, out)


@settings(max_examples=int(sys.argv[1]), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(i=strategy_index, mode=modes, args=st.one_of(st.lists(values, max_size=3), st.tuples(values), values),
       kwargs=st.one_of(st.none(), st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), values, max_size=2), values),
       op=ops, v=values, axis=axes, which=st.integers(0, 4))
def fuzz(i, mode, args, kwargs, op, v, axis, which):
    s = STRATEGIES[i]
    config.set_replica_execution(mode)
    if which == 0:  # run with arbitrary args/kwargs
        _consume(_call(s.run, lambda *a, **k: (a, k), args=args, kwargs=kwargs))
        _call(s.run, v, args=args)  # an arbitrary "function"
    elif which == 1:  # all_reduce / all_gather inside run
        def fn():
            ctx = cudist.get_replica_context()
            _call(ctx.all_reduce, op, v)
            _call(ctx.all_gather, v, axis)
        _call(s.run, fn)
    elif which == 2:  # reduce in cross-replica context
        _call(s.reduce, op, v, axis=axis)
        _call(s.reduce, op, v, axis)
    elif which == 3:  # apply_gradients with arbitrary gradients
        with s.scope():
            var = cudist.Variable(np.zeros(3, np.float32))
            opt = optimizers.SGD(0.1) if axis is None else optimizers.Adam(0.01)
        _call(opt.apply_gradients, [(v, var)])
        _call(opt.apply_gradients, v)
        _call(s.run, lambda: _call(opt.apply_gradients, [(v, var)]))
    else:  # experimental_distribute_dataset over an arbitrary "dataset"
        ds = _call(s.experimental_distribute_dataset, v)
        if ds is not None:
            it = _call(iter, ds)
            if it is not None:
                _call(next, it)


if __name__ == "__main__":
    fuzz()
    print("ok", sys.argv[1])
