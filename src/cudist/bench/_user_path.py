"""The user's path next to the kernels: ``strategy.run`` + ``all_reduce`` and ``apply_gradients``.

For every size (bytes per replica) and group, the contestants run in interleaved rounds -- round k
times a block of calls of each in turn (A, B, C, A, B, C, ...) -- so that a slow drift of the shared
machine lands on all of them alike; every row is the median over all its calls, and every ratio
comes from the same rounds. Groups:

* ``all-reduce`` (SUM of N float32 arrays): the bare kernel in place (``backend.all_reduce(bufs,
  "sum")``); the user's path, ``strategy.run(fn, args=(x,))`` with ``fn`` doing
  ``cudist.get_replica_context().all_reduce("sum", x_r)`` on a PerReplica ``x``; the plain NumPy
  loop a user would write (``s = x0.copy(); s += x1; ...`` then a copy into each output); and
  TensorFlow's ``strategy.run`` + ``all_reduce`` inside ``tf.function`` with ``--compare tf``.
* ``nest`` (SUM of a list of :data:`NEST_LEAVES` float32 leaves per replica, S bytes in all, in
  weight / bias pairs: each pair's second leaf 1/64 of the pair, as a model's gradients): the
  batched kernel in place (``backend.batch_all_reduce(leaves, leaves, "sum")`` once, then timed
  through ``backend.trusted``: the public method's checks of 2*N*64 arrays cost more than the pass); the user's path,
  ``strategy.run(fn)`` with ``fn`` all-reducing its replica's list (a replica's gradients, computed
  inside it) and returning nothing (a step uses its reduced gradients inside the replica; returning
  the list from ``run`` adds regrouping it into per-leaf PerReplica values); the NumPy loop over
  the leaves. Not compared with TensorFlow.
* ``momentum`` / ``adam``: ``optimizer.apply_gradients([(g_r, var)])`` inside ``strategy.run``
  (``_strategy_bench.make_optimizer``: momentum 0.9 / Adam), each replica passing its own gradient; the
  kernels the same work takes today (in-place ``all_reduce`` of the N gradients, then the mirrored
  ``momentum`` / ``adam`` update: two passes); the NumPy loop; Keras's optimizer under TF's
  ``strategy.run`` in ``tf.function`` with ``--compare tf``.
* ``copy``: the ceiling ``%copy`` divides by: the copy method that won the header's measurement, on a
  ``--copy-size`` buffer, timed as the header does (median of back-to-back copies after an untimed
  one) right before and right after the point's rounds; the faster of the two counts (as in
  ``bench/targets.py``: the ceiling comes from the same minutes as the point).
* ``copy-same`` (``%same``): a copy whose two buffers together span the point's working set (what
  the user's path touches per call: all-reduce and nest (N+1)*S, momentum (N+2)*S, Adam (N+3)*S), by the
  fastest copy method at that size, timed in the rounds like every other row: the bandwidth the
  point's memory gets in the same cache state (the ``--copy-size`` copy is timed back to back, and
  a small one may run from cache while a large point cannot). Left out (said) above
  :data:`SAME_COPY_MAX_BYTES` per buffer.

Bytes moved (``%copy``, ``GB/s``): all-reduce and nest 2*N*S (N inputs read, N outputs written: what an
all-reduce into per-replica results moves; the user's path on CPU replicas reads the N inputs and
writes one shared result, (N+1)*S, so its %copy may pass 100%). The update counts what one fused
all-reduce + update pass must move when the N host copies of a variable share one storage (as
MirroredVariable's CPU copies do): momentum (N+4)*S (N gradients read; variable and velocity read
and written); Adam (N+6)*S (N gradients read; variable, m and v read and written). The kernel rows
write N copies and so move more than that.

``flt/call``: minor page faults per call (``/proc/self/stat`` field 10 read around each block), the
count of fresh large buffers a call touches. Only public API is used: ``cudist.MirroredStrategy``,
``strategy.run``, ``cudist.get_replica_context().all_reduce``, ``cudist.optimizers``,
``cudist.Variable``, and for the kernels ``get_backend(name).all_reduce / .batch_all_reduce /
.momentum / .adam``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np

from cudist.bench._sizes import format_size
from cudist.bench._timing import minor_faults

__all__ = ["run_user_path", "GROUPS", "DEFAULT_GROUPS", "SUITE_GROUPS", "moved_bytes", "working_set_bytes", "TFServer"]

GROUPS = ("all-reduce", "momentum", "adam", "nest")
#: ``cudist-bench user-path --groups``'s default, and the groups ``cudist-bench suite`` runs.
DEFAULT_GROUPS = ("all-reduce", "nest", "momentum", "adam")
SUITE_GROUPS = ("all-reduce", "momentum", "adam")
#: Leaves per replica of the ``nest`` group (fewer when S holds fewer float32 elements).
NEST_LEAVES = 64
LR, MOMENTUM, BETA_1, BETA_2, EPSILON = 0.01, 0.9, 0.9, 0.999, 1e-7

_COLS = ("size", "group", "path", "api", "backend", "calls", "time(us)", "min(us)", "GB/s", "%copy", "%same",
         "flt/call", "#wrong")
_FMT = "{:>7} {:>10} {:<39} {:>9} {:>8} {:>6} {:>11} {:>11} {:>7} {:>7} {:>6} {:>8} {:>6}"
#: The largest buffer (bytes) of a point's ``copy-same`` row; a point that needs more leaves the row out.
SAME_COPY_MAX_BYTES = 1 << 30


def moved_bytes(group: str, size: int, n: int) -> int:
    """Bytes one call must move at least (see the module docstring)."""
    if group in ("all-reduce", "nest"):
        return 2 * n * size
    if group == "momentum":
        return (n + 4) * size
    if group == "adam":
        return (n + 6) * size
    raise ValueError(group)


def working_set_bytes(group: str, size: int, n: int) -> int:
    """Bytes the user's path touches in one call: the N inputs and the one shared result (all-reduce);
    the N gradients, the variable and its slots (momentum: 1, Adam: 2)."""
    extra = {"all-reduce": 1, "nest": 1, "momentum": 2, "adam": 3}[group]
    return (n + extra) * size


_MOVED_TEXT = {"all-reduce": "2N*S", "nest": "2N*S", "momentum": "(N+4)*S", "adam": "(N+6)*S"}


def nest_sizes(count: int, leaves: int = NEST_LEAVES) -> list[int]:
    """The leaf sizes (float32 elements) of the ``nest`` group: ``count`` elements in weight / bias
    pairs, each pair's bias 1/64 of it (at least one element each), summing to ``count``."""
    pairs = max(1, min(leaves, count) // 2)
    sizes: list[int] = []
    for p in range(pairs):
        part = count * (p + 1) // pairs - count * p // pairs
        bias = max(1, part // 64) if part > 1 else 0
        sizes += [part - bias, bias] if bias else [part]
    return sizes


# ------------------------------------------------------------------------------------------ contestants
class Contestant:
    """One row: ``call()`` is the timed call; samples and page faults accumulate over the rounds."""

    def __init__(self, path, api, backend, call, *, wrong=None, remote=None):
        self.path, self.api, self.backend, self.call = path, api, backend, call
        self.wrong = wrong
        self.remote = remote  # (TFServer, mode) for rows timed in the TensorFlow process
        self.samples: list[int] = []
        self.round_medians: list[float] = []
        self.faults = 0
        self.fault_calls = 0
        self.faults_known = True
        self.block = 1
        self.moved = None  # bytes one call moves, where it differs from the point's (the copy-same row)
        self.error = None

    def run_block(self, calls: int, record: bool = True) -> list:
        if self.remote is not None:
            server, mode = self.remote
            res = server.time(mode, calls)
            samples, faults = res["samples"], res.get("minflt")
        else:
            samples = []
            clock = time.perf_counter_ns
            was = gc.isenabled()
            gc.disable()
            f0 = minor_faults()
            try:
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    for _ in range(calls):
                        t0 = clock()
                        self.call()
                        samples.append(clock() - t0)
            finally:
                f1 = minor_faults()
                if was:
                    gc.enable()
            faults = None if f0 is None or f1 is None else f1 - f0
        if record:
            self.samples += samples
            self.round_medians.append(statistics.median(samples))
            if faults is None:
                self.faults_known = False
            else:
                self.faults += faults
                self.fault_calls += len(samples)
        return samples


def _reference_sum(host):
    """The SUM in replica order, in the inputs' dtype (the kernels' and NumPy loop's order)."""
    ref = host[0].copy()
    for h in host[1:]:
        ref += h
    return ref


_CHUNK = 1 << 18  # elements per piece of the checks: small temporaries, no large first-touch allocations


def _wrong(got, ref, rtol=2e-6, atol=2e-6) -> int:
    """Elements of ``got`` not within ``atol + rtol * |ref|`` of ``ref`` (NaN is wrong), in pieces."""
    got = np.asarray(got)
    if got.shape != ref.shape:
        return int(max(got.size, ref.size))
    g, r = got.reshape(-1), ref.reshape(-1)
    ok = 0
    for i in range(0, g.size, _CHUNK):
        gi, ri = g[i : i + _CHUNK], r[i : i + _CHUNK]
        d = np.subtract(gi, ri, dtype=np.result_type(gi, ri))
        np.abs(d, out=d)
        tol = np.abs(ri)
        tol *= rtol
        tol += atol
        ok += int(np.count_nonzero(d <= tol))
    return int(g.size - ok)


def _checksum(a) -> int:
    """A cheap fingerprint of an array's bytes (to tell whether a call wrote into its inputs)."""
    return int(np.asarray(a).view(np.uint32).sum(dtype=np.uint64))


def _update_reference(group, w0, grad_steps):
    """The variable after ``apply_gradients`` of each step's per-replica gradients (float64, Keras rules)."""
    out = np.empty(w0.shape, np.float64)
    for i in range(0, w0.size, _CHUNK):
        sl = slice(i, i + _CHUNK)
        w = w0[sl].astype(np.float64)
        s1 = np.zeros_like(w)
        s2 = np.zeros_like(w)
        for t, grads in enumerate(grad_steps, start=1):
            g = grads[0][sl].astype(np.float64)
            for gr in grads[1:]:
                g += gr[sl]
            if group == "momentum":
                s1 = MOMENTUM * s1 - LR * g
                w = w + s1
            else:
                s1 += (g - s1) * (1 - BETA_1)
                s2 += (g * g - s2) * (1 - BETA_2)
                lr_t = LR * np.sqrt(1 - BETA_2**t) / (1 - BETA_1**t)
                w = w - lr_t * s1 / (np.sqrt(s2) + EPSILON)
        out[sl] = w
    return out


_UPDATE_RTOL, _UPDATE_ATOL = 1e-5, 1e-6


def _rand(rng, count):
    """Fresh float32 data in [-1, 1)."""
    a = rng.random(count, dtype=np.float32)
    a *= 2
    a -= 1
    return a


# ------------------------------------------------------------------------------------------ the groups
def _per_replica(strategy, host):
    return strategy.experimental_distribute_values_from_function(lambda c: host[c.replica_id_in_sync_group])


def _allreduce_contestants(strategy, be, n, count, rng, check, notes):
    """Rows of the all-reduce group. The check runs each on the same fresh data (one reference); the
    timed calls then go on with the checked buffers."""
    import cudist

    def fn(x):
        return cudist.get_replica_context().all_reduce("sum", x)

    host = [_rand(rng, count) for _ in range(n)]  # read-only inputs of the run and NumPy-loop rows
    x = _per_replica(strategy, host)
    bufs = [h.copy() for h in host]  # the kernel reduces these in place
    outs = [np.empty(count, np.float32) for _ in range(n)]

    def numpy_loop(xs=host, outs=outs):  # what a user would write: inputs read, N outputs written
        s_ = xs[0].copy()
        for v in xs[1:]:
            s_ += v
        for o in outs:
            np.copyto(o, s_)

    wrong = {}
    if check:
        ref = _reference_sum(host)
        sums = [_checksum(h) for h in host]
        got = strategy.experimental_local_results(strategy.run(fn, args=(x,)))
        wrong["user"] = sum(_wrong(g, ref) for g in got) + abs(len(got) - n) * count
        # the inputs are the user's arrays: the all-reduce must leave them unchanged
        wrong["user"] += sum(count for h, c in zip(host, sums) if _checksum(h) != c)
        be.all_reduce(bufs, "sum")
        wrong["kernel"] = sum(_wrong(b, ref) for b in bufs)
        numpy_loop()
        wrong["numpy"] = sum(_wrong(o, ref) for o in outs)
        # A second call on other data (the kernel's output, N * ref): do the first call's results survive
        # it? Said in a note, not counted wrong.
        first = [np.array(g, copy=True) for g in got]
        strategy.run(fn, args=(_per_replica(strategy, bufs),))
        changed = sum(int(np.count_nonzero(np.asarray(g) != f)) for g, f in zip(got, first))
        if changed:
            notes.append(f"strategy.run's all_reduce results of one call were changed by the next call "
                         f"({changed} of {n * count} elements): results alias reused buffers")
        del got, first, ref
    return [
        Contestant("kernel all_reduce (in place)", "kernel", be.name, lambda: be.all_reduce(bufs, "sum"),
                   wrong=wrong.get("kernel")),
        Contestant("strategy.run+all_reduce", "user", be.name, lambda: strategy.run(fn, args=(x,)),
                   wrong=wrong.get("user")),
        Contestant("numpy loop (copy, +=, copyto)", "numpy", "numpy", numpy_loop, wrong=wrong.get("numpy")),
    ]


def _nest_contestants(strategy, be, n, count, rng, check, notes):
    """Rows of the nest group (see the module docstring); checked like the all-reduce group."""
    import cudist

    sizes = nest_sizes(count)
    host = [[_rand(rng, k) for k in sizes] for _ in range(n)]  # each replica's gradients, only read

    def fn():
        ctx = cudist.get_replica_context()
        return ctx.all_reduce("sum", host[ctx.replica_id_in_sync_group])

    def step():  # what is timed: a step uses its reduced gradients inside the replica, returns none of them
        fn()

    bufs = [[h.copy() for h in leaves] for leaves in host]  # the kernel reduces these in place
    outs = [[np.empty(k, np.float32) for k in sizes] for _ in range(n)]

    def numpy_loop():
        for j in range(len(sizes)):
            s_ = host[0][j].copy()
            for leaves in host[1:]:
                s_ += leaves[j]
            for o in outs:
                np.copyto(o[j], s_)

    wrong = {}
    if check:
        refs = [_reference_sum([leaves[j] for leaves in host]) for j in range(len(sizes))]
        sums = [_checksum(h) for leaves in host for h in leaves]
        got = strategy.experimental_local_results(strategy.run(fn))
        wrong["user"] = sum(_wrong(g[j], ref) for g in got for j, ref in enumerate(refs)) + abs(len(got) - n) * count
        wrong["user"] += sum(k for h, c, k in zip([h for leaves in host for h in leaves], sums, sizes * n)
                             if _checksum(h) != c)
        be.batch_all_reduce(bufs, bufs, "sum")
        wrong["kernel"] = sum(_wrong(b[j], ref) for b in bufs for j, ref in enumerate(refs))
        numpy_loop()
        wrong["numpy"] = sum(_wrong(o[j], ref) for o in outs for j, ref in enumerate(refs))
        del got, refs
    else:
        be.batch_all_reduce(bufs, bufs, "sum")  # the public call validates the buffers once
    trusted, SUM = be.trusted, cudist.ReduceOp.SUM
    notes.append(f"{len(sizes)} leaves per replica, {min(sizes)} to {max(sizes)} float32 elements; the kernel row "
                 "calls backend.trusted (validated once)")
    return [
        # Validated once (the public call above), then timed through ``trusted`` as a caller that validated
        # once would: the public method's checks of 2 * N * 64 arrays cost ~1 ms, far more than the pass.
        Contestant("kernel batch_all_reduce (in place)", "kernel", be.name,
                   lambda: trusted.batch_all_reduce(bufs, bufs, SUM), wrong=wrong.get("kernel")),
        Contestant("strategy.run+all_reduce(list)", "user", be.name, lambda: strategy.run(step), wrong=wrong.get("user")),
        Contestant("numpy loop (per leaf)", "numpy", "numpy", numpy_loop, wrong=wrong.get("numpy")),
    ]


class _KernelUpdate:
    """The kernels the same update takes today: in-place all-reduce of the N gradients, then the
    mirrored update of N copies (two passes)."""

    def __init__(self, be, group, w0, n):
        self.be, self.group = be, group
        self.copies = [w0.copy() for _ in range(n)]
        self.slots = [[np.zeros_like(w0) for _ in range(n)] for _ in range(1 if group == "momentum" else 2)]
        self.t = 0

    def __call__(self, grads):
        self.be.all_reduce(grads, "sum")
        self.t += 1
        if self.group == "momentum":
            self.be.momentum(self.copies, self.slots[0], grads[0], lr=LR, momentum=MOMENTUM, nesterov=False)
        else:
            self.be.adam(self.copies, self.slots[0], self.slots[1], grads[0], lr=LR, beta_1=BETA_1, beta_2=BETA_2,
                         epsilon=EPSILON, step=self.t)


class _NumpyUpdate:
    """What a user would write in NumPy: sum the gradients, update copy 0 (with temporaries), copy it
    and its slots into the mirrors."""

    def __init__(self, group, w0, n):
        self.group = group
        self.copies = [w0.copy() for _ in range(n)]
        self.slots = [[np.zeros_like(w0) for _ in range(n)] for _ in range(1 if group == "momentum" else 2)]
        self.t = 0

    def __call__(self, grads):
        g = grads[0].copy()
        for x in grads[1:]:
            g += x
        self.t += 1
        w = self.copies[0]
        if self.group == "momentum":
            v = self.slots[0][0]
            v *= np.float32(MOMENTUM)
            v -= np.float32(LR) * g
            w += v
        else:
            m, v = self.slots[0][0], self.slots[1][0]
            m += (g - m) * np.float32(1 - BETA_1)
            v += (g * g - v) * np.float32(1 - BETA_2)
            lr_t = np.float32(LR * np.sqrt(1 - BETA_2**self.t) / (1 - BETA_1**self.t))
            w -= lr_t * m / (np.sqrt(v) + np.float32(EPSILON))
        for c in self.copies[1:]:
            np.copyto(c, w)
        for sl in self.slots:
            for c in sl[1:]:
                np.copyto(c, sl[0])


def _group_hyper(group):
    """The optimizer's hyper-parameters (Keras's keyword arguments, the learning rate aside) of an
    apply_gradients group: cudist's and Keras's optimizer get the same."""
    return dict(momentum=MOMENTUM) if group == "momentum" else dict(beta_1=BETA_1, beta_2=BETA_2, epsilon=EPSILON)


def keras_optimizer(group):
    """(Keras's class name, its constructor's keyword arguments) of an apply_gradients group's
    optimizer, for the TensorFlow worker: cudist's optimizers are named as Keras's, so the worker
    builds ``keras.optimizers.<name>(**kwargs)`` without a table of its own."""
    from cudist.bench._strategy_bench import make_optimizer

    hyper = _group_hyper(group)
    return type(make_optimizer(group, LR, **hyper)).__name__, dict(learning_rate=LR, **hyper)


def _update_contestants(group, strategy, be, n, count, rng, check, notes):
    """Rows of an apply_gradients group. The check applies two steps of the same fresh gradients to
    each, from the same initial variable, and compares every copy with one float64 reference; the timed
    calls then go on from the checked state with the last step's gradients."""
    import cudist
    from cudist.bench._strategy_bench import make_optimizer

    w0 = _rand(rng, count)
    steps = [[_rand(rng, count) for _ in range(n)] for _ in range(2 if check else 1)]
    with strategy.scope():
        var = cudist.Variable(w0.copy())
        opt = make_optimizer(group, LR, **_group_hyper(group))

    def replica_fn(g):
        opt.apply_gradients([(g, var)])

    kern = _KernelUpdate(be, group, w0, n)
    npu = _NumpyUpdate(group, w0, n)
    grads = steps[-1]  # read-only gradients of the run and NumPy-loop rows
    g_pr = _per_replica(strategy, grads)
    kgrads = [g.copy() for g in grads]  # the kernel row reduces these in place

    def bad(copies, ref):
        return sum(_wrong(np.asarray(c), ref, _UPDATE_RTOL, _UPDATE_ATOL) for c in copies) + abs(len(copies) - n) * count

    wrong = {}
    if check:
        ref = _update_reference(group, w0, steps)
        sums = [_checksum(g) for gs in steps for g in gs]
        for gs in steps:
            strategy.run(replica_fn, args=(_per_replica(strategy, gs),))
            kern([g.copy() for g in gs])
            npu(gs)
        wrong["user"] = bad(strategy.experimental_local_results(var), ref)
        # the gradients are the user's arrays: apply_gradients must leave them unchanged
        wrong["user"] += sum(count for g, c in zip([g for gs in steps for g in gs], sums) if _checksum(g) != c)
        wrong["kernel"] = bad(kern.copies, ref)
        wrong["numpy"] = bad(npu.copies, ref)
        del ref
    del steps
    return [
        Contestant(f"kernel all_reduce+{group} (2 pass)", "kernel", be.name, lambda: kern(kgrads),
                   wrong=wrong.get("kernel")),
        Contestant("strategy.run+apply_gradients", "user", be.name, lambda: strategy.run(replica_fn, args=(g_pr,)),
                   wrong=wrong.get("user")),
        Contestant("numpy loop (sum, update, copyto)", "numpy", "numpy", lambda: npu(grads), wrong=wrong.get("numpy")),
    ]


# ------------------------------------------------------------------------------------------ TensorFlow
class TFServer:
    """The TensorFlow worker (``_tf_worker.py --serve``) as a long-lived subprocess timed in rounds.

    It builds one case at a time (``setup``: the same group, size and replicas; checked on fresh data),
    then times blocks of calls on request (``time``), so its rows take turns with ours. The worker's
    stderr goes to a temporary file whose tail explains a failure.
    """

    def __init__(self, python, replicas, modes, seed=0, timeout=900):
        from cudist.bench import _tf

        exe = _tf.find_tf_python(python)
        self.timeout = timeout
        self._err = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen([exe, str(_tf.WORKER), "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, env=env, bufsize=1)
        hello = self._ask({"replicas": replicas, "modes": modes, "seed": seed})
        self.version, self.python = hello.get("version"), hello.get("python")

    def _ask(self, msg):
        from cudist.bench._tf import TFUnavailable

        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith("{"):
                    res = json.loads(line)
                    if res.get("error"):
                        raise TFUnavailable(f"the TensorFlow worker failed: {res['error']}")
                    return res
        except (BrokenPipeError, OSError, ValueError) as e:
            raise TFUnavailable(f"the TensorFlow worker failed: {e}: {self._tail()}") from None
        self.proc.wait(timeout=30)
        raise TFUnavailable(f"the TensorFlow worker exited ({self.proc.returncode}): {self._tail()}")

    def _tail(self):
        try:
            self._err.seek(0)
            return " | ".join(self._err.read().strip().splitlines()[-3:])
        except (OSError, ValueError):
            return ""

    def setup(self, group, size, check):
        msg = {"cmd": "setup", "group": group, "size": size, "check": check}
        if group not in ("all-reduce", "nest"):
            msg["keras"] = keras_optimizer(group)
        return self._ask(msg)

    def time(self, mode, calls):
        return self._ask({"cmd": "time", "mode": mode, "calls": calls})

    def close(self):
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            for f in (self.proc.stdin, self.proc.stdout, self._err):
                try:
                    f.close()
                except (OSError, ValueError):
                    pass


# ------------------------------------------------------------------------------------------ driver
def _copy_method(nbytes, name=None):
    """(name, callable, bytes read + written) of a way to copy an ``nbytes`` buffer: ``name`` (the
    header's winner; ``numpy.copyto`` where that method is not available), else the fastest by the
    median of 3 copies each (which method wins depends on the size: streaming stores pay off only
    out of cache)."""
    from cudist.bench import _sysinfo

    methods = _sysinfo.copy_methods(nbytes)
    if name is None:
        name = min(methods, key=lambda k: _sysinfo._time_copy(methods[k], 3))
    elif name not in methods:
        name = "numpy.copyto"
    return name, methods[name], 2 * max(8, nbytes - nbytes % 8)


def _line(size, group, c, moved, ceiling):
    t = statistics.median(c.samples) / 1e3 if c.samples else None
    gbps = moved / (t * 1e-6) / 1e9 if t else None
    pct = 100.0 * gbps / ceiling if (gbps and ceiling) else None
    flt = c.faults / c.fault_calls if (c.faults_known and c.fault_calls) else None
    row = {"op_name": f"user-path/{group}", "group": group, "size": size, "count": size // 4, "dtype": "float32",
           "path": c.path, "api": c.api, "backend": c.backend, "iters": len(c.samples), "time_us": t,
           "min_us": min(c.samples) / 1e3 if c.samples else None, "moved_bytes": moved, "GBps": gbps, "pct_copy": pct,
           "faults_per_call": flt, "wrong": c.wrong, "user_path": c.api in ("user", "tf-user")}
    if c.error:
        row["error"] = c.error
    return row


def _fmt_row(r) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    path = r["path"] + (" [user]" if r.get("user_path") else "")
    return " " + _FMT.format(
        format_size(r["size"]) if r["group"] != "copy" else "-", r["group"], path[:39], r["api"], r["backend"],
        r["iters"], f(r["time_us"], ".1f"), f(r["min_us"], ".1f"), f(r["GBps"], ".2f"), f(r["pct_copy"], ".1f"),
        f(r["pct_same"], ".1f"), f(r["faults_per_call"], ".1f"), "-" if r["wrong"] is None else r["wrong"],
    )[1:]


def _ratio_text(num, den):
    """median(num)/median(den) and the spread of the per-round ratios."""
    a, b = statistics.median(num.samples), statistics.median(den.samples)
    per = [x / y for x, y in zip(num.round_medians, den.round_medians) if y > 0]
    spread = f" [rounds {min(per):.2f}-{max(per):.2f}]" if len(per) > 1 else ""
    return a / b, f"{a / b:.2f}x{spread}", per


_BLOCK_CAP = 200
_COPY_ITERS = 10


def _block_size(c, target_ns, cap):
    """Calls per round so a block takes about ``target_ns`` (from the fastest call of the last warm-up block)."""
    est = min(c.samples_warm) if getattr(c, "samples_warm", None) else 0
    if est <= 0:
        return 1
    return max(1, min(cap, int(target_ns // est)))


def run_user_path(ctx, *, sizes=None, groups=None) -> list:
    """Times the user's path next to the kernels (see the module docstring); prints and returns rows."""
    from cudist._kernels import get_backend
    from cudist.bench._errors import BenchError
    from cudist.bench._progress import Progress
    from cudist.bench._sizes import size_sweep
    from cudist.bench._strategy_bench import _ensure_logical_cpus, use_backend

    a = ctx.args
    n = a.replicas
    if sizes is None:
        try:
            sizes = size_sweep(a.minbytes, a.maxbytes, a.stepfactor)
        except ValueError as e:
            raise BenchError(str(e)) from None
    groups = list(groups or a.groups)
    small = [s for s in sizes if s < 4]
    if small:
        raise BenchError(f"size {format_size(small[0])} is smaller than one float32 element (4 bytes)")
    ctx.print_header()
    ceiling0 = ctx.copy_bw.best if ctx.copy_bw else None
    rounds, warm = a.iters, a.warmup_iters
    target_ns = int(a.round_ms * 1e6)
    tf_server = None
    tf_modes = []
    if a.compare == "tf":
        from cudist.bench import _tf
        from cudist.bench._tf import TFUnavailable

        tf_modes = _tf.modes(a)
        try:
            tf_server = TFServer(a.tf_python, n, tf_modes, seed=a.seed)
            ctx.header.setdefault("tensorflow", tf_server.version)
        except TFUnavailable as e:
            ctx.print(f"# tf: skipped ({e})")
    rows = []
    with use_backend(None if a.backend == "all" else a.backend):
        be = get_backend()
        if be.xp is not np:
            raise BenchError(f"user-path runs on CPU backends; the default backend here is {be.name} "
                             "(pass --backend native, numba or numpy)")
        try:
            import cudist

            _ensure_logical_cpus(n)
            strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        except ImportError as e:
            ctx.print(f"# user-path skipped: the strategy API is not available here ({e})")
            ctx.add_table("user-path", rows, skipped=True)
            return rows
        ctx.print()
        ctx.print(f"# user-path: the user's path ([user] rows) next to the kernels; {n} replicas, float32, sizes in "
                  f"bytes per replica; backend {be.name}")
        ctx.print(f"# {rounds} interleaved rounds after {warm} warm-up rounds: each round times a block of calls of "
                  f"every row in turn (about {a.round_ms:g} ms each); time = median over all calls; check "
                  f"{'on (fresh random data vs the NumPy reference)' if a.check else 'off'}")
        ctx.print("# bytes moved (GB/s, %copy): all-reduce 2N*S; apply_gradients what one fused all-reduce + update "
                  "must move (host copies sharing one storage): momentum (N+4)*S, adam (N+6)*S; %copy divides by the point's copy row, "
                  "%same by its copy-same row (a copy spanning the point's working set, timed in the rounds); "
                  "flt/call = minor page faults per call (fresh large buffers touched)")
        copy_method = _copy_method(a.copy_size, ctx.copy_bw.best_method if ctx.copy_bw else "numpy.copyto")
        ctx.print(f"# copy row (the ceiling): {copy_method[0]} of a {format_size(copy_method[2] // 2)} buffer, the "
                  f"header's fastest method timed as there (median of {_COPY_ITERS} back-to-back copies) right before "
                  "and right after the point's rounds; the faster of the two counts")
        ctx.print("# ratio lines: a/b = median time of a over median time of b, [rounds] = the spread of the per-round "
                  "ratios; run/kernel > 1: the user's path is slower than the kernel; numpy-loop/run and tf-*/run > 1: "
                  "the user's path is faster")
        ctx.print("#" + _FMT.format(*_COLS)[1:])
        points = [(s, g) for s in sizes for g in groups]
        with Progress(len(points) * (rounds + warm), "user-path", enabled=ctx.progress_enabled()) as prog:
            ctx.progress = prog
            try:
                for size, group in points:
                    rows += _run_point(ctx, strategy, be, n, size, group, rounds, warm, target_ns, tf_server,
                                       tf_modes, prog, ceiling0, copy_method)
            finally:
                ctx.progress = None
                if tf_server is not None:
                    tf_server.close()
    ctx.add_table("user-path", rows, replicas=n, rounds=rounds, warmup_rounds=warm, backend=be.name,
                  tensorflow=getattr(tf_server, "version", None))
    return rows


def _run_point(ctx, strategy, be, n, size, group, rounds, warm, target_ns, tf_server, tf_modes, prog, ceiling0,
               copy_method):
    a = ctx.args
    count = size // 4
    size = count * 4
    rng = np.random.default_rng([a.seed, size, GROUPS.index(group)])
    notes: list = []
    if group == "all-reduce":
        cs = _allreduce_contestants(strategy, be, n, count, rng, a.check, notes)
    elif group == "nest":
        cs = _nest_contestants(strategy, be, n, count, rng, a.check, notes)
    else:
        cs = _update_contestants(group, strategy, be, n, count, rng, a.check, notes)
    for note in notes:
        ctx.print(f"# note: {format_size(size)} {group}: {note}")
    if tf_server is not None and group == "nest":
        ctx.print(f"# tf: {format_size(size)} nest: no TensorFlow row (the TF worker times the other groups)")
    elif tf_server is not None:
        from cudist.bench._tf import TFUnavailable

        try:
            res = tf_server.setup(group, size, a.check)
            for mode in tf_modes:
                label = "tf strategy.run+" + ("all_reduce" if group == "all-reduce" else "apply_gradients")
                wrong = res.get("wrong", {}).get(mode)
                cs.append(Contestant(label, "tf-user", "tf-" + ("fn" if mode == "function" else "eager"), None,
                                     wrong=wrong, remote=(tf_server, mode)))
        except TFUnavailable as e:
            ctx.print(f"# tf: {group} {format_size(size)} skipped ({e})")
    moved = moved_bytes(group, size, n)
    same = None  # the copy-same contestant: a copy whose buffers span the point's working set, in the rounds
    half = working_set_bytes(group, size, n) // 2
    if half <= SAME_COPY_MAX_BYTES:
        same_name, same_fn, same_bytes = _copy_method(half)
        same = Contestant(f"copy, same working set ({format_size(same_bytes // 2)})", "copy-same",
                          same_name.split(" ")[0].split(".")[0], same_fn)
        same.moved = same_bytes
        cs.append(same)
    else:
        ctx.print(f"# note: {format_size(size)} {group}: no copy-same row (it would copy "
                  f"{format_size(half)}, more than {format_size(SAME_COPY_MAX_BYTES)})")
    from cudist.bench._sysinfo import _time_copy

    _, copy_fn, copy_bytes = copy_method
    # The copy ceiling of this point: the header's method and way (median of back-to-back copies after
    # an untimed one), right before and right after the rounds; the faster of the two counts.
    before = _time_copy(copy_fn, _COPY_ITERS)
    # Warm-up rounds: two calls each in the first (the faster one estimates the block size; the first
    # call may pay for first touches), then full blocks.
    for c in cs:
        c.samples_warm = []
    def turn(c, k, record=True):
        """One block of ``c``; a TensorFlow worker that fails drops its rows (said), not the run."""
        if c.remote is None:
            return c.run_block(k, record)
        from cudist.bench._tf import TFUnavailable

        try:
            return c.run_block(k, record)
        except TFUnavailable as e:
            ctx.print(f"# tf: {group} {format_size(size)} dropped ({e})")
            cs.remove(c)
            return None

    for w in range(max(warm, 1)):
        for c in list(cs):
            k = 2 if w == 0 else c.block
            s = turn(c, k, record=False)
            if s is not None:
                c.samples_warm = s
                c.block = _block_size(c, target_ns, _BLOCK_CAP)
        if w < warm:
            prog.update(f"{group} {format_size(size)} warm-up")
    for r in range(rounds):
        order = list(cs) if r % 2 == 0 else cs[::-1]  # alternate the order so no row always follows the same one
        for c in order:
            turn(c, c.block)
        prog.update(f"{group} {format_size(size)} round {r + 1}")
    after = _time_copy(copy_fn, _COPY_ITERS)
    ceiling = copy_bytes / min(before, after) / 1e9
    rows = [_line(size, group, c, c.moved or moved, ceiling) for c in cs]
    same_gbps = rows[cs.index(same)]["GBps"] if same is not None else None
    for r in rows:
        r["pct_same"] = 100.0 * r["GBps"] / same_gbps if (r["GBps"] and same_gbps) else None
        ctx.print(_fmt_row(r))
    crow = {"op_name": "user-path/copy", "group": "copy", "size": size, "count": None, "dtype": None,
            "path": f"copy ceiling ({format_size(copy_bytes // 2)}, before|after)", "api": "copy", "backend": "-",
            "iters": 2 * _COPY_ITERS, "time_us": min(before, after) * 1e6, "min_us": None, "moved_bytes": copy_bytes,
            "GBps": ceiling, "pct_copy": 100.0, "pct_same": None, "faults_per_call": None, "wrong": None, "user_path": False,
            "copy_before_GBps": copy_bytes / before / 1e9, "copy_after_GBps": copy_bytes / after / 1e9,
            "header_ceiling_GBps": ceiling0}
    ctx.print(_fmt_row(crow))
    rows.append(crow)
    # ratios of the same rounds
    by_api = {c.api: c for c in cs}
    parts = []
    info = {}
    user, kern, nump = by_api.get("user"), by_api.get("kernel"), by_api.get("numpy")
    if user is not None and kern is not None:
        v, text, per = _ratio_text(user, kern)
        parts.append(f"run/kernel {text}")
        info["run_over_kernel"], info["run_over_kernel_rounds"] = v, per
    if user is not None and nump is not None:
        v, text, per = _ratio_text(nump, user)
        parts.append(f"numpy-loop/run {text}")
        info["numpy_loop_over_run"], info["numpy_loop_over_run_rounds"] = v, per
    for c in cs:
        if c.api == "tf-user" and user is not None and c.samples:
            v, text, per = _ratio_text(c, user)
            parts.append(f"{c.backend}/run {text}")
            info[f"{c.backend}_over_run"], info[f"{c.backend}_over_run_rounds"] = v, per
    if user is not None and same is not None and same.samples:
        v, text, per = _ratio_text(user, same)
        parts.append(f"run/copy-same {text}")
        info["run_over_copy_same"], info["run_over_copy_same_rounds"] = v, per
    for r in rows:
        if r["api"] == "user":
            r.update(info)
    if parts:
        ctx.print(f"#   {format_size(size)} {group}: " + ", ".join(parts))
    return rows
