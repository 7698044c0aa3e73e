"""Strategy-level benchmarks: ``strategy.run`` overhead and a synthetic data-parallel training step."""

from __future__ import annotations

import contextlib

import numpy as np

__all__ = ["run_overhead", "run_step", "mlp_grads", "STEP_OPTIMIZERS", "make_optimizer"]

_OVH_COLS = ("strategy", "replicas", "fn", "backend", "time(us)", "min(us)", "#wrong")
_OVH_FMT = "{:>21} {:>8} {:>18} {:>9} {:>10} {:>10} {:>7}"


def _ensure_logical_cpus(n: int) -> None:
    """Makes sure at least ``n`` logical CPUs exist (as TF's set_logical_device_configuration)."""
    from cudist import config

    if len(config.list_logical_devices("CPU")) < n:
        cpu = config.list_physical_devices("CPU")[0]
        config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * n)


@contextlib.contextmanager
def use_backend(name):
    """Makes the strategies' collectives use kernel backend ``name`` (None: leave the default)."""
    if name is None:
        yield
        return
    from cudist import _settings
    from cudist._kernels import reset_backend_cache as reset

    try:
        with _settings.overridden(_settings.BACKEND, name):
            reset()
            yield
    finally:
        reset()  # after the variable is restored: the next collective re-reads it


def _strategies(ctx, n):
    """(label, strategy) pairs to time, or None with a printed reason when the API is missing."""
    try:
        import cudist

        _ensure_logical_cpus(n)
        out = [(f"MirroredStrategy", cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)]))]
        try:
            out.append(("OneDeviceStrategy", cudist.OneDeviceStrategy("/cpu:0")))
        except ImportError:
            pass
        return out
    except ImportError as e:
        ctx.print(f"# strategy benchmarks skipped: the strategy API is not available here ({e})")
        return None


def run_overhead(ctx) -> list:
    """Times ``strategy.run`` with a no-op and with one scalar ``all_reduce``; prints and returns rows."""
    from cudist._kernels import get_backend

    a = ctx.args
    n = a.replicas
    ctx.print_header(copy_bw=False)
    ctx.print()
    ctx.print(f"# run-overhead: strategy.run per call, median of {a.iters} after {a.warmup_iters} warm-up")
    ctx.print("#" + _OVH_FMT.format(*_OVH_COLS)[1:])
    rows = []
    with use_backend(None if a.backend == "all" else a.backend):
        strategies = _strategies(ctx, n)
        if strategies is None:
            ctx.add_table("run-overhead", rows, skipped=True)
            return rows
        backend = get_backend().name
        _time_overhead(ctx, strategies, backend, rows)
    if a.compare == "tf":
        rows += _tf_overhead(ctx, n)
        _overhead_ratios(ctx, rows)
    ctx.add_table("run-overhead", rows, replicas=n, iters=a.iters, warmup=a.warmup_iters)
    return rows


def _time_overhead(ctx, strategies, backend, rows):
    import cudist
    from cudist.bench._timing import median_us, time_calls

    a = ctx.args

    def noop():
        return None

    def scalar_all_reduce():
        rc = cudist.get_replica_context()
        return rc.all_reduce("sum", np.float32(rc.replica_id_in_sync_group + 1))

    for label, strategy in strategies:
        nrep = strategy.num_replicas_in_sync
        for fname, fn in (("noop", noop), ("all_reduce(scalar)", scalar_all_reduce)):
            wrong = None
            if a.check and fname != "noop":
                expect = nrep * (nrep + 1) / 2
                got = [np.asarray(v) for v in strategy.experimental_local_results(strategy.run(fn))]
                wrong = sum(int(g != expect) for g in got) + abs(len(got) - nrep)
            samples = time_calls(lambda: strategy.run(fn), a.iters, a.warmup_iters)
            row = {"strategy": label, "replicas": nrep, "fn": fname, "backend": backend, "api": "cudist",
                   "time_us": median_us(samples), "min_us": min(samples) / 1e3, "wrong": wrong}
            rows.append(row)
            ctx.print(_ovh_line(row))


def _ovh_line(r) -> str:
    return " " + _OVH_FMT.format(r["strategy"], r["replicas"], r["fn"], r["backend"], f"{r['time_us']:.2f}",
                                 f"{r['min_us']:.2f}", "-" if r["wrong"] is None else r["wrong"])[1:]


def _tf_overhead(ctx, n) -> list:
    from cudist.bench import _tf

    a = ctx.args
    spec = {"op": "run-overhead", "replicas": n, "iters": a.iters, "warmup": a.warmup_iters,
            "modes": _tf.modes(a), "check": a.check}
    res = _tf.compare(ctx, spec)
    if res is None:
        return []
    rows = []
    for r in res["rows"]:
        row = {"strategy": "tf." + r["strategy"], "replicas": r["replicas"], "fn": r["fn"],
               "backend": "tf-" + ("fn" if r["mode"] == "function" else "eager"), "api": "tf", "mode": r["mode"],
               "time_us": r["time_us"], "min_us": r["min_us"], "wrong": r.get("wrong")}
        rows.append(row)
        ctx.print(_ovh_line(row))
    return rows


def _overhead_ratios(ctx, rows) -> None:
    mine = {(r["strategy"], r["fn"]): r["time_us"] for r in rows if r["api"] == "cudist"}
    parts = []
    for r in rows:
        if r["api"] != "tf":
            continue
        t = mine.get((r["strategy"][3:], r["fn"]))
        if t:
            parts.append(f"{r['strategy'][3:]} {r['fn']}: {r['time_us'] / t:.1f}x faster than {r['backend']}")
    if parts:
        ctx.print("# speedup (median time ratio):")
        for p in parts:
            ctx.print("#   " + p)


# ------------------------------------------------------------------------------------------- step
_STEP_COLS = ("api", "replicas", "batch", "params", "opt", "backend", "step(us)", "fwd+bwd(us)", "allreduce(us)",
              "update(us)", "samples/s", "#wrong")
_STEP_FMT = "{:>9} {:>8} {:>6} {:>9} {:>5} {:>8} {:>10} {:>12} {:>13} {:>11} {:>10} {:>7}"


def mlp_grads(params, x, y):
    """Forward and backward of ``relu(x @ W1 + b1) @ W2 + b2`` under a mean squared error.

    Returns the gradients (new C-contiguous arrays, the params' dtype) and the loss.
    """
    w1, b1, w2, b2 = params
    pre = x @ w1 + b1
    h = np.maximum(pre, 0)
    out = h @ w2 + b2
    diff = out - y
    loss = float(np.mean(diff * diff))
    d = diff * out.dtype.type(2.0 / max(out.size, 1))
    gw2 = h.T @ d
    gb2 = d.sum(axis=0)
    dh = d @ w2.T
    dh *= pre > 0
    gw1 = x.T @ dh
    gb1 = dh.sum(axis=0)
    return [np.ascontiguousarray(g) for g in (gw1, gb1, gw2, gb2)], loss


def _init(a, rng):
    f, hdim, c, b = a.features, a.hidden, a.classes, a.batch
    params = [
        (rng.standard_normal((f, hdim)) / np.sqrt(f)).astype(np.float32),
        (rng.standard_normal(hdim) * 0.01).astype(np.float32),
        (rng.standard_normal((hdim, c)) / np.sqrt(hdim)).astype(np.float32),
        (rng.standard_normal(c) * 0.01).astype(np.float32),
    ]
    x = rng.standard_normal((b, f)).astype(np.float32)
    y = rng.standard_normal((b, c)).astype(np.float32)
    return params, x, y


#: ``cudist-bench step --optimizer``: plain SGD, and Adam (two slots per parameter).
STEP_OPTIMIZERS = ("sgd", "adam")


def make_optimizer(kind: str, learning_rate: float = 0.01, **hyper: float) -> object:
    """The benches' cudist optimizer for ``kind``, built in one place so that the benches (and the
    optimizer names in src/, tests/test_structure.py) do not each spell the classes.

    Args:
        kind: ``"sgd"`` (plain gradient descent), ``"momentum"`` (the same class with ``momentum``,
            0.9 unless given) or ``"adam"``.
        learning_rate: the learning rate.
        **hyper: further keyword arguments of the optimizer's constructor (Keras's names).

    Returns:
        A new ``cudist.optimizers`` optimizer.

    Raises:
        ValueError: ``kind`` is none of the three.
    """
    from cudist import optimizers

    if kind == "momentum":
        hyper.setdefault("momentum", 0.9)
        kind = "sgd"
    classes = {"sgd": optimizers.SGD, "adam": optimizers.Adam}
    if kind not in classes:
        raise ValueError(f"no bench optimizer {kind!r} (the kinds: sgd, momentum, adam)")
    return classes[kind](learning_rate=learning_rate, **hyper)


class _KernelStep:
    """The data-parallel step written against the kernel layer: N mirrored copies of every parameter."""

    def __init__(self, backend, params, shards, optimizer, lr=0.01):
        self.be, self.shards, self.opt, self.lr = backend, shards, optimizer, lr
        n = len(shards)
        self.copies = [[p.copy() for _ in range(n)] for p in params]
        self.slots = [[[np.zeros_like(p) for _ in range(n)] for p in params] for _ in range(2 if optimizer == "adam" else 0)]
        self.t = 0
        self.phase = [0, 0, 0]

    def __call__(self):
        import time

        clock = time.perf_counter_ns
        t0 = clock()
        grads = [mlp_grads([c[r] for c in self.copies], x, y)[0] for r, (x, y) in enumerate(self.shards)]
        t1 = clock()
        per_param = [[g[p] for g in grads] for p in range(len(self.copies))]
        for gs in per_param:
            self.be.all_reduce(gs, "mean")
        t2 = clock()
        self.t += 1
        for p, cps in enumerate(self.copies):
            g = per_param[p][0]
            if self.opt == "sgd":
                self.be.sgd(cps, g, lr=self.lr)
            else:
                self.be.adam(cps, self.slots[0][p], self.slots[1][p], g, lr=self.lr, step=self.t)
        t3 = clock()
        self.phase = [t1 - t0, t2 - t1, t3 - t2]


def _shards(x, y, n):
    from cudist._kernels import split

    return list(zip(split(x, n), split(y, n)))


def _step_line(r) -> str:
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return " " + _STEP_FMT.format(
        r["api"], r["replicas"], r["batch"], r["params"], r["optimizer"], r["backend"], f(r["time_us"]),
        f(r.get("fwd_bwd_us")), f(r.get("all_reduce_us")), f(r.get("update_us")), f"{r['samples_per_s']:.0f}",
        "-" if r["wrong"] is None else r["wrong"],
    )[1:]


def _time_phases(step, iters, warmup):
    import statistics

    from cudist.bench._timing import time_calls

    phases = []

    def call():
        step()
        phases.append(list(step.phase))

    samples = time_calls(call, iters, warmup)
    phases = phases[warmup:]
    med = [statistics.median(p[i] for p in phases) / 1e3 for i in range(3)]
    return samples, med


def _max_wrong(copies_list, ref_params) -> int:
    """Elements of any copy further than float32 rounding noise from the reference parameters."""
    wrong = 0
    for copies, ref in zip(copies_list, ref_params):
        for c in copies:
            wrong += int(np.count_nonzero(~np.isclose(np.asarray(c), ref, rtol=1e-5, atol=1e-6)))
    return wrong


def run_step(ctx) -> list:
    """Times the synthetic training step per backend (kernel API) and through MirroredStrategy."""
    from cudist._kernels import numpy_backend
    from cudist.bench._timing import median_us

    a = ctx.args
    n = a.replicas
    if a.batch < n:
        from cudist.bench._errors import BenchError

        raise BenchError(f"--batch {a.batch} is smaller than --replicas {n}: some replicas would get no data")
    backends = [b for b in ctx.backends() if b.xp is np]
    ctx.print_header()
    rng = np.random.default_rng(a.seed)
    params, x, y = _init(a, rng)
    nparams = sum(p.size for p in params)
    shards = _shards(x, y, n)
    ctx.print()
    ctx.print(f"# step: MLP {a.features}-{a.hidden}-{a.classes} ({nparams} float32 params), global batch {a.batch} "
              f"over {n} replicas, {a.optimizer}; median of {a.iters} after {a.warmup_iters} warm-up")
    ctx.print("# per step: forward/backward per replica (NumPy), MEAN all-reduce of the gradients, mirrored update;"
              " #wrong = parameters off the NumPy-backend reference after one step (rtol 1e-5; strategy rows: the same"
              " strategy step on the NumPy backend)")
    ctx.print("# the user's path: api=strategy rows (MirroredStrategy.run + cudist.optimizers apply_gradients, what a "
              "training loop calls); api=kernel rows call the kernels directly (the floor the user's path can reach)")
    ctx.print("#" + _STEP_FMT.format(*_STEP_COLS)[1:])
    ref = None
    if a.check:
        r = _KernelStep(numpy_backend(), params, shards, a.optimizer)
        r()
        ref = [c[0] for c in r.copies]
    rows = []
    if a.api in ("kernel", "both"):
        for be in backends:
            wrong = None
            if a.check:
                chk = _KernelStep(be, params, shards, a.optimizer)
                chk()
                wrong = _max_wrong(chk.copies, ref)
            step = _KernelStep(be, params, shards, a.optimizer)
            samples, med = _time_phases(step, a.iters, a.warmup_iters)
            t = median_us(samples)
            row = {"api": "kernel", "replicas": n, "batch": a.batch, "params": nparams, "optimizer": a.optimizer,
                   "backend": be.name, "time_us": t, "min_us": min(samples) / 1e3, "fwd_bwd_us": med[0],
                   "all_reduce_us": med[1], "update_us": med[2], "samples_per_s": a.batch / (t * 1e-6), "wrong": wrong}
            rows.append(row)
            ctx.print(_step_line(row))
    if a.api in ("strategy", "both"):
        sref = None
        if a.check:
            # Like with like: the strategy rows against the same step through the same strategy on
            # the NumPy backend. (Against the kernel rows' reference they would differ in the last
            # bits whenever BLAS rounds differently inside a run -- it gets max(1, threads // N)
            # threads there, see cudist._blas -- and an adaptive optimizer magnifies such bits.)
            with use_backend("numpy"):
                sref = _strategy_reference(ctx, params, shards)
        for be in backends:
            with use_backend(be.name):
                rows += _strategy_step(ctx, params, shards, sref, nparams)
    _user_vs_kernel(ctx, rows)
    if a.compare == "tf":
        ctx.print("# tf: no TensorFlow counterpart for step (it would time Keras, not the strategy); use run-overhead "
                  "and the kernel subcommands with --compare tf")
    ctx.add_table("step", rows, replicas=n, iters=a.iters, warmup=a.warmup_iters)
    return rows


def _user_vs_kernel(ctx, rows) -> None:
    """One line: the user's path (api=strategy) step time over the kernel step time, per backend."""
    kern = {r["backend"]: r["time_us"] for r in rows if r["api"] == "kernel" and r.get("time_us")}
    parts = [f"{r['backend']} {r['time_us'] / kern[r['backend']]:.2f}x" for r in rows
             if r["api"] == "strategy" and r.get("time_us") and r["backend"] in kern]
    if parts:
        ctx.print("# user's path / kernel step time (median; 1.00x = the strategy API costs nothing): " + ", ".join(parts))


def _strategy_builder(ctx, params, shards):
    """``(strategy, build)``: ``build()`` makes fresh variables and optimizer and returns ``(vs, step)``.

    Raises:
        ImportError: MirroredStrategy or cudist.optimizers is not available.
    """
    import cudist
    import cudist.optimizers  # noqa: F401 -- the ImportError documented above, before any work

    a = ctx.args
    n = a.replicas
    _ensure_logical_cpus(n)
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    scale = np.float32(1.0 / n)

    def build():
        with strategy.scope():
            vs = [cudist.Variable(p.copy()) for p in params]
            opt = make_optimizer(a.optimizer)
        data = strategy.experimental_distribute_values_from_function(lambda c: shards[c.replica_id_in_sync_group])

        def replica_fn(xy):
            x, y = xy
            gs, loss = mlp_grads([v.read_value() for v in vs], x, y)
            opt.apply_gradients(zip([g * scale for g in gs], vs))
            return loss

        return vs, lambda: strategy.run(replica_fn, args=(data,))

    return strategy, build


def _one_strategy_step(strategy, build):
    """Every replica's copy of every parameter after one step from the initial ones."""
    vs, step = build()
    step()
    return [[np.asarray(c) for c in strategy.experimental_local_results(v)] for v in vs]


def _strategy_reference(ctx, params, shards):
    """Replica 0's parameters after one strategy step on the current (NumPy) backend; None if unavailable."""
    try:
        strategy, build = _strategy_builder(ctx, params, shards)
        return [c[0] for c in _one_strategy_step(strategy, build)]
    except Exception:  # noqa: BLE001 - reported by _strategy_step's own try, per backend
        return None


def _strategy_step(ctx, params, shards, ref, nparams) -> list:
    """The same step through the public API: MirroredStrategy.run + cudist.optimizers.apply_gradients.

    Each replica scales its local mean gradient by 1/N, so the optimizer's SUM over replicas (Keras's
    default aggregation) is the mean gradient of the kernel path; the result is compared with ``ref``,
    the same strategy step on the NumPy backend (:func:`_strategy_reference`), within float32 rounding
    (rtol 1e-5): backends agree bit for bit, so any difference is a real one.
    """
    from cudist._kernels import get_backend
    from cudist.bench._timing import median_us, time_calls

    a = ctx.args
    n = a.replicas
    try:
        strategy, build = _strategy_builder(ctx, params, shards)
    except ImportError as e:
        ctx.print(f"# strategy API step skipped: MirroredStrategy / cudist.optimizers not available here ({e})")
        return []

    wrong = None
    try:
        if a.check:
            if ref is None:
                raise RuntimeError("the NumPy-backend reference step failed")
            wrong = _max_wrong(_one_strategy_step(strategy, build), ref)
        vs, step = build()
        samples = time_calls(step, a.iters, a.warmup_iters)
    except Exception as e:  # an incomplete strategy API must not hide the kernel-level table
        ctx.print(f"# strategy API step failed: {type(e).__name__}: {e}")
        ctx.notes.append(f"strategy step failed: {type(e).__name__}: {e}")
        return [{"api": "strategy", "replicas": n, "batch": a.batch, "params": nparams, "optimizer": a.optimizer,
                 "backend": get_backend().name, "time_us": None, "samples_per_s": None, "wrong": None,
                 "error": f"{type(e).__name__}: {e}"}]
    t = median_us(samples)
    row = {"api": "strategy", "replicas": n, "batch": a.batch, "params": nparams, "optimizer": a.optimizer,
           "backend": get_backend().name, "time_us": t, "min_us": min(samples) / 1e3, "fwd_bwd_us": None,
           "all_reduce_us": None, "update_us": None, "samples_per_s": a.batch / (t * 1e-6), "wrong": wrong}
    ctx.print(_step_line(row))
    return [row]
