"""TensorFlow side of ``cudist-bench --compare tf`` (standalone: needs only NumPy and TensorFlow).

Usage: ``python _tf_worker.py '<json spec>'``; prints one JSON line ``{"version", "python", "rows"}``.
Times the same work as the cudist benchmark with ``tf.distribute.MirroredStrategy`` on N logical CPUs,
inside ``tf.function`` (mode "function") and/or eagerly (mode "eager").

``python _tf_worker.py --serve`` (``cudist-bench user-path --compare tf``) stays up and answers one
JSON line per JSON line read from stdin, so its rows take turns with cudist's in interleaved rounds:
first ``{"replicas", "modes", "seed"}`` (answer ``{"version", "python"}``), then ``{"cmd": "setup",
"group", "size", "check", "keras"}`` builds one case (all-reduce: ``strategy.run`` + ``all_reduce``; momentum /
adam: the Keras optimizer ``keras`` names -- [class name, keyword arguments], sent by the parent --
``apply_gradients`` inside ``strategy.run``), checked on fresh data (answer
``{"wrong": {mode: n}}``), ``{"cmd": "time", "mode", "calls"}`` times that many calls (answer
``{"samples": [ns...], "minflt": page faults}``), ``{"cmd": "quit"}`` ends it. A failure is answered
``{"error": "..."}``.
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
                    f, check = _update(strategy, spec.get("tf_update") or _DEFAULT_UPDATE, host, count, dt, mode, rng)
                else:
                    raise SystemExit(f"unsupported op {op}")
                wrong = check() if spec.get("check", 1) and check else None
                med, mn = _timeit(f, spec["iters"], spec["warmup"])
                rows.append({"size": count * np.dtype(dt).itemsize, "count": count, "dtype": dt, "mode": mode,
                             "time_us": med, "min_us": mn, "wrong": wrong})
    return rows


#: The raw op an update row is timed against when the parent names none.
_DEFAULT_UPDATE = ["ResourceApplyAdam", {}]


def _update(strategy, tf_update, host, count, dt, mode, rng):
    """A fused TF update kernel (ResourceApply*) applied to every component via extended.update.

    ``tf_update``: [raw op name, its extra attributes], from the parent (cudist.bench._ops.tf_update)."""
    raw, attrs = tf_update
    w0, g = host[0], tf.constant(host[1])
    with strategy.scope():
        w = tf.Variable(w0)
        m = tf.Variable(_rand(rng, count, dt))
        v = tf.Variable(_rand(rng, count, dt, nonneg=True))
    lr = tf.constant(0.01, dtype=dt)
    one = tf.constant(1.0, dtype=dt)

    def apply(var, m_, v_, grad):
        if raw == "ResourceApplyGradientDescent":
            return tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=lr, delta=grad)
        if raw == "ResourceApplyKerasMomentum":
            return tf.raw_ops.ResourceApplyKerasMomentum(var=var.handle, accum=m_.handle, lr=lr, grad=grad,
                                                         momentum=tf.constant(0.9, dtype=dt), **attrs)
        return tf.raw_ops.ResourceApplyAdam(var=var.handle, m=m_.handle, v=v_.handle, beta1_power=tf.constant(0.9, dt),
                                            beta2_power=tf.constant(0.999, dt), lr=lr,
                                            beta1=tf.constant(0.9, dt), beta2=tf.constant(0.999, dt),
                                            epsilon=tf.constant(1e-7, dt), grad=grad)

    def step(grad):
        strategy.extended.update(w, apply, args=(m, v, grad), group=True)

    call = _wrap(step, mode)
    check = None
    if raw == "ResourceApplyGradientDescent":
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


def _minflt():
    try:
        with open("/proc/self/stat", "rb") as f:
            text = f.read()
        return int(text[text.rindex(b")") + 2 :].split()[7])
    except (OSError, ValueError, IndexError):
        return None


_LR, _MOMENTUM, _B1, _B2, _EPS = 0.01, 0.9, 0.9, 0.999, 1e-7


def _update_ref(group, w0, grad_steps):
    w = w0.astype(np.float64)
    s1, s2 = np.zeros_like(w), np.zeros_like(w)
    for t, grads in enumerate(grad_steps, start=1):
        g = np.sum([x.astype(np.float64) for x in grads], axis=0)
        if group == "momentum":
            s1 = _MOMENTUM * s1 - _LR * g
            w = w + s1
        else:
            s1 += (g - s1) * (1 - _B1)
            s2 += (g * g - s2) * (1 - _B2)
            w = w - _LR * np.sqrt(1 - _B2**t) / (1 - _B1**t) * s1 / (np.sqrt(s2) + _EPS)
    return w


class _Serve:
    """One case at a time of ``cudist-bench user-path``: the user's path through TF's MirroredStrategy."""

    def __init__(self, hello):
        self.n = hello["replicas"]
        self.modes = hello["modes"]
        self.rng = np.random.default_rng(hello.get("seed", 0))
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * max(self.n, 1))
        self.strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(self.n)])
        self.calls = {}

    def _rand(self, count):
        return (self.rng.random(count, dtype=np.float32) * 2 - 1).astype(np.float32)

    def _pr(self, host):
        return _per_replica(self.strategy, host)

    def setup(self, group, size, check, keras_opt=None):
        """``keras_opt``: (Keras's optimizer class name, its keyword arguments) of an update group."""
        self.calls = {}
        count = size // 4
        s = self.strategy
        wrong = {}
        for mode in self.modes:
            if group == "all-reduce":
                call = _wrap(lambda x: s.run(
                    lambda t: tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, t),
                    args=(x,)), mode)
                if check:
                    host = [self._rand(count) for _ in range(self.n)]
                    ref = host[0].copy()
                    for h in host[1:]:
                        ref += h
                    got = s.experimental_local_results(call(self._pr(host)))
                    wrong[mode] = sum(_wrong(g, ref) for g in got) + abs(len(got) - self.n) * count
                x = self._pr([self._rand(count) for _ in range(self.n)])
                self.calls[mode] = (lambda call=call, x=x: call(x))
            else:
                import keras

                if not keras_opt:
                    raise ValueError(f"setup: the group {group!r} needs the Keras optimizer (class name, arguments)")
                cls_name, kwargs = keras_opt

                def build(w0):
                    with s.scope():
                        var = tf.Variable(w0)
                        opt = getattr(keras.optimizers, cls_name)(**kwargs)
                        opt.build([var])
                    step = _wrap(lambda g: s.run(lambda gr: opt.apply_gradients([(gr, var)]), args=(g,)), mode)
                    return var, step

                if check:
                    w0 = self._rand(count)
                    steps = [[self._rand(count) for _ in range(self.n)] for _ in range(2)]
                    var, step = build(w0)
                    for gs in steps:
                        step(self._pr(gs))
                    ref = _update_ref(group, w0, steps)
                    comps = s.experimental_local_results(var)
                    wrong[mode] = sum(int(np.count_nonzero(~np.isclose(np.asarray(c), ref, rtol=1e-5, atol=1e-6)))
                                      for c in comps) + abs(len(comps) - self.n) * count
                var, step = build(self._rand(count))
                g = self._pr([self._rand(count) for _ in range(self.n)])
                self.calls[mode] = (lambda step=step, g=g: step(g))
        for fn in self.calls.values():
            fn()  # traces the tf.function: the first timed block must not pay for it
        return {"wrong": wrong}

    def time(self, mode, calls):
        fn = self.calls[mode]
        out = []
        f0 = _minflt()
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t0)
        f1 = _minflt()
        return {"samples": out, "minflt": None if f0 is None or f1 is None else f1 - f0}


def serve():
    # Answers go to the real stdout; anything else printed (TF's C++ side included) goes to stderr.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    server = None
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        msg = json.loads(line)
        try:
            if server is None:
                server = _Serve(msg)
                res = {"version": tf.__version__, "python": sys.executable}
            elif msg.get("cmd") == "setup":
                res = server.setup(msg["group"], msg["size"], msg.get("check", 1), msg.get("keras"))
            elif msg.get("cmd") == "time":
                res = server.time(msg["mode"], msg["calls"])
            elif msg.get("cmd") == "quit":
                break
            else:
                res = {"error": f"unknown command {msg!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which says the row was skipped
            res = {"error": f"{type(e).__name__}: {e}"}
        reply.write(json.dumps(res) + "\n")
        reply.flush()


def main():
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
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
