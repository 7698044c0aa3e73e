"""TensorFlow side of ``cudist-bench --compare tf`` (standalone: needs only NumPy and TensorFlow).

Usage: ``python _tf_worker.py '<json spec>'``; prints one JSON line ``{"version", "python", "rows"}``.
Times the same work as the cudist benchmark with ``tf.distribute.MirroredStrategy`` on N logical CPUs,
inside ``tf.function`` (mode "function") and/or eagerly (mode "eager").
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def _timeit(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    s = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        s.append(time.perf_counter_ns() - t0)
    return statistics.median(s) / 1e3, min(s) / 1e3


def _rand(rng, count, dtype, nonneg=False):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        a = rng.random(count)
        a = a * 0.99 + 0.01 if nonneg else a * 2 - 1
        return a.astype(dtype)
    return rng.integers(0 if nonneg else -1000, 1000, count).astype(dtype)


def _wrong(got, ref):
    got = np.asarray(got)
    if got.shape != ref.shape:
        return int(max(got.size, ref.size))
    if ref.dtype.kind != "f":
        return int(np.count_nonzero(got != ref))
    rtol = {2: 1e-2, 4: 1e-5, 8: 1e-12}[ref.dtype.itemsize]
    return int(np.count_nonzero(~np.isclose(got, ref, rtol=rtol, atol=rtol)))


def _per_replica(strategy, arrays):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(arrays[ctx.replica_id_in_sync_group])
    )


def _wrap(fn, mode):
    return tf.function(fn) if mode == "function" else fn


def kernel_rows(strategy, spec):
    n = spec["replicas"]
    op = spec["op"]
    rng = np.random.default_rng(spec.get("seed", 0))
    red = tf.distribute.ReduceOp.SUM if spec.get("redop", "sum") == "sum" else tf.distribute.ReduceOp.MEAN
    rows = []
    for dt in spec["dtypes"]:
        for size in spec["sizes"]:
            count = size // np.dtype(dt).itemsize
            host = [_rand(rng, count, dt) for _ in range(n)]
            for mode in spec["modes"]:
                check = None
                if op == "all-reduce":
                    x = _per_replica(strategy, host)
                    call = _wrap(lambda x: strategy.run(
                        lambda t: tf.distribute.get_replica_context().all_reduce(red, t), args=(x,)), mode)
                    f = lambda: call(x)  # noqa: E731
                    ref = host[0].copy()
                    for h in host[1:]:
                        ref = ref + h
                    if red == tf.distribute.ReduceOp.MEAN:
                        ref = (ref / n).astype(ref.dtype) if ref.dtype.kind == "f" else np.trunc(ref / n).astype(ref.dtype)
                    check = lambda: sum(_wrong(v, ref) for v in strategy.experimental_local_results(f()))  # noqa: E731
                elif op == "all-gather":
                    x = _per_replica(strategy, host)
                    call = _wrap(lambda x: strategy.run(
                        lambda t: tf.distribute.get_replica_context().all_gather(t, axis=0), args=(x,)), mode)
                    f = lambda: call(x)  # noqa: E731
                    ref = np.concatenate(host)
                    check = lambda: _wrong(strategy.experimental_local_results(f())[0], ref)  # noqa: E731
                elif op == "broadcast":
                    # A mirrored variable's assign in cross-replica context writes every component: the
                    # strategy-level broadcast of one host value to N devices.
                    with strategy.scope():
                        v = tf.Variable(tf.zeros(count, dtype=dt))
                    src = tf.constant(host[0])
                    call = _wrap(lambda s: v.assign(s), mode)
                    f = lambda: call(src)  # noqa: E731
                    check = lambda: (f(), sum(_wrong(c, host[0]) for c in strategy.experimental_local_results(v)))[1]  # noqa: E731
                elif op.startswith("update/"):
                    f, check = _update(strategy, op.split("/", 1)[1], host, count, dt, mode, rng)
                else:
                    raise SystemExit(f"unsupported op {op}")
                wrong = check() if spec.get("check", 1) and check else None
                med, mn = _timeit(f, spec["iters"], spec["warmup"])
                rows.append({"size": count * np.dtype(dt).itemsize, "count": count, "dtype": dt, "mode": mode,
                             "time_us": med, "min_us": mn, "wrong": wrong})
    return rows


def _update(strategy, opt, host, count, dt, mode, rng):
    """A fused TF update kernel (ResourceApply*) applied to every component via extended.update."""
    w0, g = host[0], tf.constant(host[1])
    with strategy.scope():
        w = tf.Variable(w0)
        m = tf.Variable(_rand(rng, count, dt))
        v = tf.Variable(_rand(rng, count, dt, nonneg=True))
    lr = tf.constant(0.01, dtype=dt)
    one = tf.constant(1.0, dtype=dt)

    def apply(var, m_, v_, grad):
        if opt == "sgd":
            return tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=lr, delta=grad)
        if opt == "momentum":
            return tf.raw_ops.ResourceApplyKerasMomentum(var=var.handle, accum=m_.handle, lr=lr, grad=grad,
                                                         momentum=tf.constant(0.9, dtype=dt))
        return tf.raw_ops.ResourceApplyAdam(var=var.handle, m=m_.handle, v=v_.handle, beta1_power=tf.constant(0.9, dt),
                                            beta2_power=tf.constant(0.999, dt), lr=lr,
                                            beta1=tf.constant(0.9, dt), beta2=tf.constant(0.999, dt),
                                            epsilon=tf.constant(1e-7, dt), grad=grad)

    def step(grad):
        strategy.extended.update(w, apply, args=(m, v, grad), group=True)

    call = _wrap(step, mode)
    check = None
    if opt == "sgd":
        expect = (w0 - np.asarray(lr) * host[1]).astype(w0.dtype)

        def check():
            w.assign(w0)
            call(g)
            return sum(_wrong(c, expect) for c in strategy.experimental_local_results(w))

    return (lambda: call(g)), check


def overhead_rows(spec):
    n = spec["replicas"]
    rows = []
    strategies = [("MirroredStrategy", tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])),
                  ("OneDeviceStrategy", tf.distribute.OneDeviceStrategy("/cpu:0"))]
    for label, strategy in strategies:
        nrep = strategy.num_replicas_in_sync

        def noop():
            return tf.constant(0.0)

        def scalar_all_reduce():
            rc = tf.distribute.get_replica_context()
            return rc.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(rc.replica_id_in_sync_group + 1, tf.float32))

        for fname, fn in (("noop", noop), ("all_reduce(scalar)", scalar_all_reduce)):
            for mode in spec["modes"]:
                call = _wrap(lambda fn=fn: strategy.run(fn), mode)
                wrong = None
                if spec.get("check", 1) and fname != "noop":
                    got = [float(v) for v in strategy.experimental_local_results(call())]
                    wrong = sum(int(g != nrep * (nrep + 1) / 2) for g in got)
                med, mn = _timeit(call, spec["iters"], spec["warmup"])
                rows.append({"strategy": label, "replicas": nrep, "fn": fname, "mode": mode, "time_us": med,
                             "min_us": mn, "wrong": wrong})
    return rows


def main():
    spec = json.loads(sys.argv[1])
    n = spec["replicas"]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * max(n, 1))
    if spec["op"] == "run-overhead":
        rows = overhead_rows(spec)
    else:
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        rows = kernel_rows(strategy, spec)
    print(json.dumps({"version": tf.__version__, "python": sys.executable, "rows": rows}))


if __name__ == "__main__":
    main()
