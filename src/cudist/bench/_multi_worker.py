"""``cudist-bench all-reduce --workers N``: the cross-worker all-reduce against raw mpi4py, same run.

Started as a plain process, it re-runs itself under ``mpiexec -n N`` (the mpich wheel's); each
worker then times, size by size and interleaved (A, B, A, B, ...), the same SUM all-reduce of a
float32 buffer of S bytes:

* ``mpi4py``: ``comm.Allreduce(send, recv, MPI.SUM)`` (blocking; the floor cudist builds on);
* ``cudist``: ``strategy.run`` + ``ReplicaContext.all_reduce`` under MultiWorkerMirroredStrategy
  (``--replicas`` local replicas per worker: the local kernel sum, the non-blocking MPI
  all-reduce polled with a deadline, each replica's result).

A sample is the slowest worker's time for one call, each call started after a barrier; the table
shows medians, the algorithm bandwidth S/t and cudist's speed as a percentage of mpi4py's.

The common options of ``cudist-bench`` that make sense across workers work here too: sizes
(``-b/-e/-f``), ``-d/--datatype`` (the dtypes MPI has: float32, float64, int32, int64), ``-o/--op``
(MEAN: mpi4py's sum divided by the worker count), ``-c``, ``-n``, ``-w``, ``--replicas``,
``--backend`` (the kernels of the local sum, through ``CUDIST_BACKEND``), ``--json`` (``-`` for
stdout), and ``--no-progress`` and ``--seed``, accepted for a common command line (this benchmark
draws no progress bar and fills its buffers with exact constants, so that the check is exact).
The others (``--compare``, ``--tf-python``, ``--tf-mode``, ``--copy-size``, ``--budget``) are
refused with a message saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

__all__ = ["main"]


def _fmt_size(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


#: Common options with no meaning across workers, and why.
_REFUSED = {
    "compare": "--compare: TensorFlow is compared in one process only (cudist-bench all-reduce --compare tf)",
    "tf_python": "--tf-python: TensorFlow is compared in one process only",
    "tf_mode": "--tf-mode: TensorFlow is compared in one process only",
    "copy_size": "--copy-size: the copy-bandwidth header is single-process",
    "budget": "--budget: every size runs -n timed calls on every worker (use -n)",
}
#: The dtypes both MPI and the kernels reduce (MPI has no float16).
_DTYPES = ("float32", "float64", "int32", "int64")


#: The defaults of the common options here (cudist-bench's own defaults are for one process).
COMMON_DEFAULTS = {"b": "4K", "e": "64M", "f": 4, "n": 20, "w": 3, "replicas": 1}


def build_parser(common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser of ``--workers`` runs: ``common`` (cudist-bench's common options, built with
    :data:`COMMON_DEFAULTS` by the caller, which owns them) plus the cross-worker ones."""
    p = argparse.ArgumentParser(
        prog="cudist-bench all-reduce --workers N",
        description="Cross-worker all-reduce: MultiWorkerMirroredStrategy against raw mpi4py Allreduce, same run.",
        parents=[common],
    )
    p.add_argument("command", choices=["all-reduce", "step"])
    p.add_argument("--workers", type=int, required=True, help="number of worker processes (mpiexec -n)")
    p.add_argument("--mpiexec", default=None, help="the mpiexec to use (default: next to python, else PATH)")
    p.add_argument("--rounds", type=int, default=4,
                   help="all-reduce: interleaved rounds the -n calls of each size are split into (default 4); "
                        "the JSON rows give each round's cudist/mpi4py ratio")
    p.add_argument("--steps", type=int, default=50, help="step: timed steps (default 50)")
    p.add_argument("--batch", type=int, default=256, help="step: global batch (default 256)")
    return p


def _relaunch(args, argv) -> int:
    from cudist.launch import find_mpiexec

    mpiexec = find_mpiexec(args.mpiexec)
    if mpiexec is None:
        sys.stderr.write("cudist-bench: --workers needs mpiexec: pip install \"cudist[mpi]\"\n")
        return 2
    from cudist.launch import worker_env

    env = worker_env(args.workers)
    if args.backend != "all":
        env["CUDIST_BACKEND"] = args.backend  # the kernels of every worker's local sum
    cmd = [mpiexec, "-n", str(args.workers), sys.executable, "-m", "cudist.bench", *argv]
    return subprocess.call(cmd, env=env)


def _run(args) -> int:
    from mpi4py import MPI

    import cudist

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    R = args.replicas
    if R > 1:
        cpu = cudist.config.list_physical_devices("CPU")[0]
        cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * R)
    strategy = cudist.MultiWorkerMirroredStrategy(devices=[f"/cpu:{i}" for i in range(R)])
    G = strategy.num_replicas_in_sync
    transport = strategy.extended.host_transport
    sizes = []
    s = args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        s *= max(2, args.stepfactor)

    def timed(fn, iters):
        out = np.empty(iters)
        for i in range(iters):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            out[i] = time.perf_counter() - t
        slowest = np.empty_like(out)
        comm.Allreduce(out, slowest, MPI.MAX)
        return slowest

    rows = []
    ok_all = True
    out = sys.stderr if args.json == "-" else sys.stdout  # with --json -, stdout carries only the JSON
    mean = args.op == "mean"
    if rank == 0:
        print(f"# cudist-bench all-reduce --workers {size}: {R} local replica(s) per worker, {G} in sync; "
              f"{', '.join(args.datatype)} {args.op.upper()}; {args.iters} calls per size and variant, interleaved; "
              "times are medians of the slowest worker per call", file=out, flush=True)
        print(f"# host values cross workers through: {strategy.extended.host_communication}", file=out, flush=True)
        print("# path: shared memory's (eager: one round; scatter: reduce-scatter) or mpi; moved: bytes each worker "
              "reads + writes per call, in multiples of the size; %copy: that traffic at this machine's memcpy speed "
              "(np.copyto on every worker at once, timed in the same rounds) as a share of cudist's time", file=out,
              flush=True)
        print(f"# {'size':>8} {'dtype':>8} {'mpi4py us':>11} {'cudist us':>11} {'mpi4py GB/s':>12} {'cudist GB/s':>12} "
              f"{'cudist/mpi4py':>14} {'path':>8} {'moved':>6} {'%copy':>6} {'check':>6}", file=out, flush=True)
    for dtype, nbytes in [(d, n) for d in args.datatype for n in sizes]:
        dt = np.dtype(dtype)
        count = max(1, nbytes // dt.itemsize)
        send = np.full(count, rank + 1, dt)
        recv = np.empty_like(send)
        locals_ = [np.full(count, rank * R + r + 1, dt) for r in range(R)]
        values = strategy.experimental_distribute_values_from_function(lambda vc: locals_[vc.replica_id_in_sync_group - rank * R])

        def raw():
            comm.Allreduce(send, recv, MPI.SUM)
            if mean:  # what a MEAN costs on top of MPI's sum
                return recv / size
            return recv

        def step(x):
            return cudist.get_replica_context().all_reduce(args.op, x)

        def ours():
            return strategy.run(step, args=(values,))

        copy_dst = np.empty_like(send)

        def copy():  # the memory-speed yardstick: one memcpy of the size, every worker at once
            np.copyto(copy_dst, send)

        for _ in range(args.warmup_iters):
            raw()
            ours()
            copy()
        raw_t, ours_t, copy_t = [], [], []
        per_round = max(1, args.iters // args.rounds)
        done = 0
        while done < args.iters:
            k = min(per_round, args.iters - done)
            raw_t.append(timed(raw, k))
            ours_t.append(timed(ours, k))
            copy_t.append(timed(copy, k))
            done += k
        round_ratios = [float(np.median(r) / np.median(o)) for r, o in zip(raw_t, ours_t)]
        raw_us = float(np.median(np.concatenate(raw_t))) * 1e6
        ours_us = float(np.median(np.concatenate(ours_t))) * 1e6
        copy_us = float(np.median(np.concatenate(copy_t))) * 1e6
        path, moved = transport.traffic(count * dt.itemsize) if transport is not None else ("mpi", 0)
        if R > 1:
            moved = 0  # the local sum's pack comes first: not this formula's
        # a memcpy of S bytes moves 2S (read + write): the traffic's time at that speed, against ours
        pct_copy = 100 * moved / (2 * count * dt.itemsize) * copy_us / ours_us if moved else float("nan")
        ok = True
        if args.check:
            res = strategy.experimental_local_results(ours())
            want = G * (G + 1) / 2 / (G if mean else 1)
            ok = all(float(r[0]) == want and float(r[-1]) == want for r in res)
            ok = bool(comm.allreduce(int(ok), MPI.MIN))
            got = raw()
            ok = ok and float(got[0]) == size * (size + 1) / 2 / (size if mean else 1)
        ok_all = ok_all and ok
        row = {
            "bytes": nbytes, "dtype": dtype, "op": args.op, "mpi4py_us": raw_us, "cudist_us": ours_us,
            "mpi4py_GBps": nbytes / raw_us / 1e3, "cudist_GBps": nbytes / ours_us / 1e3,
            "ratio": raw_us / ours_us, "check": ok, "path": path, "moved_bytes": moved, "memcpy_us": copy_us,
            "pct_copy": pct_copy, "round_ratios": round_ratios,
        }
        rows.append(row)
        if rank == 0:
            print(f"  {_fmt_size(nbytes):>8} {dtype:>8} {raw_us:11.1f} {ours_us:11.1f} {row['mpi4py_GBps']:12.2f} "
                  f"{row['cudist_GBps']:12.2f} {100 * row['ratio']:13.1f}% {path:>8} "
                  f"{moved / (count * dt.itemsize):5.2f}x {pct_copy:5.1f}% {'ok' if ok else 'FAIL':>6}",
                  file=out, flush=True)
    if rank == 0 and args.json:
        doc = {"workers": size, "replicas_per_worker": R, "op": args.op, "rows": rows, "ok": ok_all,
               "host_communication": strategy.extended.host_communication}
        if args.json == "-":
            print(json.dumps(doc, indent=1), flush=True)
        else:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    return 0 if ok_all else 1


# The training step of bench/step_compare.py (its torch DDP gloo contestant is the comparison):
# MLP 784-512-512-10, ReLU, softmax cross-entropy, the user-path bench's momentum optimizer
# (cudist.bench._strategy_bench.make_optimizer: momentum 0.9, lr 0.01), float32.
_LAYERS = (784, 512, 512, 10)


def _problem(batch):
    rng = np.random.default_rng(0)
    params = []
    for fan_in, fan_out in zip(_LAYERS[:-1], _LAYERS[1:]):
        lim = np.sqrt(6.0 / (fan_in + fan_out))
        params += [rng.uniform(-lim, lim, (fan_in, fan_out)).astype(np.float32), np.zeros(fan_out, np.float32)]
    x = rng.standard_normal((batch, _LAYERS[0])).astype(np.float32)
    y = rng.integers(0, _LAYERS[-1], batch).astype(np.int64)
    return params, x, y


def _grads(params, x, y, scale):
    w1, b1, w2, b2, w3, b3 = params
    z1 = x @ w1 + b1
    h1 = np.maximum(z1, 0)
    z2 = h1 @ w2 + b2
    h2 = np.maximum(z2, 0)
    logits = h2 @ w3 + b3
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    se = e.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(scale * np.sum(np.log(se[:, 0]) + m[:, 0] - logits[rows, y]))
    d = e / se
    d[rows, y] -= 1
    d *= d.dtype.type(scale)
    dh2 = (d @ w3.T) * (z2 > 0)
    dh1 = (dh2 @ w2.T) * (z1 > 0)
    return [x.T @ dh1, dh1.sum(axis=0), h1.T @ dh2, dh2.sum(axis=0), h2.T @ d, d.sum(axis=0)], loss


def _run_step(args) -> int:
    from mpi4py import MPI

    import cudist
    from cudist.bench._strategy_bench import make_optimizer

    comm = MPI.COMM_WORLD
    strategy = cudist.MultiWorkerMirroredStrategy()
    rank, W = comm.Get_rank(), comm.Get_size()  # started by mpiexec without TF_CONFIG: worker i is rank i
    params, x, y = _problem(args.batch)
    with strategy.scope():
        variables = [cudist.Variable(p) for p in params]
        opt = make_optimizer("momentum")
    per = -(-len(x) // W)
    mine = (x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
    scale = 1.0 / len(x)

    def replica_step(xy):
        grads, loss = _grads([v.read_value() for v in variables], xy[0], xy[1], scale)
        opt.apply_gradients(zip(grads, variables))
        return loss

    losses = [comm.allreduce(strategy.run(replica_step, args=(mine,))) for _ in range(3)]
    samples = np.empty(args.steps)
    for i in range(args.steps):
        t = time.perf_counter()
        strategy.run(replica_step, args=(mine,))
        samples[i] = time.perf_counter() - t
    slowest = np.empty_like(samples)
    comm.Allreduce(samples, slowest, MPI.MAX)
    if rank == 0:
        ms = float(np.median(slowest)) * 1e3
        out = sys.stderr if args.json == "-" else sys.stdout  # with --json -, stdout carries only the JSON
        print(f"# cudist-bench step --workers {W}: MLP 784-512-512-10, global batch {args.batch}, momentum 0.9; "
              f"threads per worker {os.environ.get('OMP_NUM_THREADS', '?')}", file=out, flush=True)
        print(f"  MultiWorkerMirroredStrategy ({W} workers): median step {ms:.2f} ms (slowest worker per step), "
              f"min {float(slowest.min()) * 1e3:.2f} ms, {args.batch / ms * 1e3:.0f} samples/s; "
              f"first losses {', '.join(f'{v:.6f}' for v in losses)}", file=out, flush=True)
        doc = {"workers": W, "median_ms": ms, "losses": losses}
        if args.json == "-":
            print(json.dumps(doc), flush=True)
        elif args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f)
    return 0


def main(argv, common: argparse.ArgumentParser) -> int:
    """Runs (or, outside an MPI job, launches under mpiexec) the cross-worker benchmark.

    Args:
        argv: the command line (with ``--workers N``).
        common: cudist-bench's common options (see :func:`build_parser`).
    """
    parser = build_parser(common)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    defaults = parser.parse_args(["all-reduce", "--workers", "1"])
    for name, why in _REFUSED.items():
        if getattr(args, name) != getattr(defaults, name):
            parser.error(f"{why}; not available with --workers")
    bad = [d for d in args.datatype if d not in _DTYPES]
    if bad:
        parser.error(f"-d/--datatype {','.join(bad)}: not available with --workers (MPI reduces {', '.join(_DTYPES)})")
    if args.backend != "all":
        os.environ["CUDIST_BACKEND"] = args.backend  # also when started by mpiexec directly
    from cudist._settings import launched_by_mpi

    if not launched_by_mpi():
        return _relaunch(args, argv)
    return _run_step(args) if args.command == "step" else _run(args)
