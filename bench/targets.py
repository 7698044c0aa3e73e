"""Measures cudist's CPU performance targets in one process and prints a met/missed table.

Targets (4 replicas, float32):

* all-reduce SUM of 4 x 64 MiB: >= 80% of the copy ceiling counting 2*N*size bytes; >= 5x the plain
  NumPy loop (the ``numpy`` backend: ``s = b0.copy(); s += b1 ...; copyto`` each); >= 10x TF's
  ``all_reduce`` inside ``MirroredStrategy.run`` (tf.function) on 4 logical CPUs, when a TensorFlow
  python is given;
* all-reduce of 4 x 4 KiB: median <= 10 us;
* SGD and Adam updates of 4 mirrored copies of 64 MiB: >= 80% of the copy ceiling counting the bytes
  each must move (SGD (2+N)*size: var and grad read, N copies written; Adam (4+3N)*size).

The machine these run on is shared and noisy, so each large point is bracketed by two copy
measurements (the fastest copy method found at start, median of 10, right before and right after
the point), and its %copy divides by the higher of the two: the ceiling comes from the same
seconds of machine time as the point. Small (4 KiB) points are timed back to back. Each result is
first checked against the NumPy reference (#wrong).

Usage::

    python bench/targets.py [--tf-python /tmp/tfvenv/bin/python] [--size 64M] [-n 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from cudist.bench import _sysinfo
from cudist.bench._ops import OPS, make_case
from cudist.bench._sizes import format_size, parse_size


def _bracketed(run, copy, iters, warmup, copy_iters=10):
    """Median ns of ``run`` (``iters`` calls) and the higher of two copy medians taken right before
    and right after it (``copy_iters`` calls each).

    Not call-by-call alternation: a copy timed right after a large operation pays for writing back
    the operation's dirty cache lines, which would understate the ceiling.
    """
    before = _back_to_back(copy, copy_iters, 1)
    t_run = _back_to_back(run, iters, warmup)
    after = _back_to_back(copy, copy_iters, 1)
    return t_run, (min(before[0], after[0]), min(before[1], after[1]))


def _back_to_back(run, iters, warmup):
    """(median ns, fastest ns) of ``iters`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    clock = time.perf_counter_ns
    out = []
    for _ in range(iters):
        t0 = clock()
        run()
        out.append(clock() - t0)
    return statistics.median(out), min(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="large size per replica (default 64M)")
    p.add_argument("--small", type=parse_size, default=parse_size("4K"), help="small size per replica (default 4K)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=3)
    p.add_argument("--small-iters", type=int, default=5000)
    p.add_argument("--backends", default="numpy,numba,native", help="comma-separated CPU backends")
    p.add_argument("--copy-size", type=parse_size, default=parse_size("64M"))
    p.add_argument("--tf-python", default=None, help="python with TensorFlow for the TF ratio")
    p.add_argument("--tf-iters", type=int, default=10)
    p.add_argument("--json", default=None)
    t = p.parse_args(argv)

    from cudist._kernels import BackendUnavailableError, get_backend

    n, size = t.replicas, t.size
    backends = []
    for name in t.backends.split(","):
        try:
            backends.append(get_backend(name.strip()))
        except BackendUnavailableError as e:
            print(f"# skipped backend {name}: {e}")

    print(f"# bench/targets.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"# CPU: {_sysinfo.cpu_model()}, {_sysinfo.core_count()} cores; "
          + ", ".join(f"{k} ({v})" for k, v in _sysinfo.backend_versions().items()))
    start = _sysinfo.measure_copy_bandwidth(t.copy_size, iters=20)
    print(f"# copy bandwidth at start ({format_size(start.nbytes)}, read + write bytes / s, median of 20): "
          + "; ".join(f"{k} {v:.1f} GB/s" for k, v in start.results.items()))
    method = start.best_method
    copy = _sysinfo.copy_methods(t.copy_size)[method]
    copy_bytes = start.nbytes
    print(f"# ceiling method (timed right before and after every large point; the faster of the two is the "
          f"row's ceiling): {method}")

    cases = [("all-reduce", size), ("all-reduce", t.small), ("update/sgd", size), ("update/adamw", size)]
    rows = []
    print()
    print(f"# {'case':<22} {'backend':>7} {'median(us)':>12} {'best(us)':>10} {'copy(GB/s)':>10} {'moved(GB/s)':>11} "
          f"{'%copy':>6} {'%copy best':>10} {'#wrong':>6}")
    print("#   %copy: median bytes moved per second / median copy bandwidth; '%copy best': fastest call / fastest copy")
    for op, sz in cases:
        spec = OPS[op]
        for be in backends:
            count = sz // 4
            case = make_case(op, be, count, "float32", n, redop="sum")
            wrong = case.check()
            with np.errstate(over="ignore", invalid="ignore"):
                if sz >= (1 << 20):
                    (t_run, t_best), (t_copy, t_copy_best) = _bracketed(case.run, copy, t.iters, t.warmup)
                    copy_bw, copy_best = 2 * copy_bytes / t_copy, 2 * copy_bytes / t_copy_best
                else:
                    (t_run, t_best), copy_bw, copy_best = _back_to_back(case.run, t.small_iters, 200), None, None
            del case
            moved = spec.moved_bytes(sz, n)
            moved_bw = moved / t_run
            pct = 100 * moved_bw / copy_bw if copy_bw else None
            pct_best = 100 * (moved / t_best) / copy_best if copy_best else None
            row = {"op": op, "size": sz, "backend": be.name, "time_us": t_run / 1e3, "best_us": t_best / 1e3,
                   "copy_GBps": copy_bw, "moved_GBps": moved_bw, "pct_copy": pct, "pct_copy_best": pct_best,
                   "wrong": wrong}
            rows.append(row)
            label = f"{op} {n}x{format_size(sz)}"
            print(f"  {label:<22} {be.name:>7} {row['time_us']:>12.2f} {row['best_us']:>10.2f} "
                  f"{'-' if copy_bw is None else format(copy_bw, '.1f'):>10} {moved_bw:>11.2f} "
                  f"{'-' if pct is None else format(pct, '.1f'):>6} {'-' if pct_best is None else format(pct_best, '.1f'):>10} "
                  f"{wrong:>6}", flush=True)

    tf_t = None
    if t.tf_python:
        from cudist.bench import _tf

        try:
            res = _tf.run_worker({"op": "all-reduce", "sizes": [size], "dtypes": ["float32"], "replicas": n,
                                  "redop": "sum", "iters": t.tf_iters, "warmup": 2, "modes": ["function"],
                                  "check": 1}, python=t.tf_python)
            r = res["rows"][0]
            tf_t = r["time_us"]
            print(f"  {'TF all-reduce ' + f'{n}x{format_size(size)}':<22} {'tf-fn':>7} {tf_t:>12.2f} "
                  f"{r['min_us']:>10.2f} {'-':>10} {2 * n * size / (tf_t * 1e3):>11.2f} {'-':>6} {'-':>10} {r['wrong']:>6}   "
                  f"(TensorFlow {res['version']}, MirroredStrategy.run + all_reduce in tf.function, {n} logical CPUs)")
            rows.append({"op": "all-reduce", "size": size, "backend": "tf-fn", "time_us": tf_t, "wrong": r["wrong"]})
        except _tf.TFUnavailable as e:
            print(f"# tf: skipped ({e})")
    end = _sysinfo.measure_copy_bandwidth(t.copy_size, iters=20)
    print(f"# copy bandwidth at end: " + "; ".join(f"{k} {v:.1f} GB/s" for k, v in end.results.items()))

    def get(op, sz, be):
        return next((r for r in rows if r["op"] == op and r["size"] == sz and r["backend"] == be), None)

    verdicts = []

    def target(name, be, value, goal, higher=True, unit=""):
        if value is None:
            verdicts.append((name, be, "n/a", goal, "not measured"))
            return
        ok = value >= goal if higher else value <= goal
        how = "met" if ok else (f"missed ({value / goal * 100:.0f}% of target)" if higher
                                else f"missed ({value / goal:.1f}x the limit)")
        verdicts.append((name, be, f"{value:.1f}{unit}", f"{'>=' if higher else '<='} {goal}{unit}", how))

    np_big = get("all-reduce", size, "numpy")
    for be in [b.name for b in backends]:
        big = get("all-reduce", size, be)
        target(f"all-reduce {n}x{format_size(size)} %copy", be, big["pct_copy"], 80, unit="%")
        if be != "numpy" and np_big:
            target(f"all-reduce {n}x{format_size(size)} vs numpy loop", be, np_big["time_us"] / big["time_us"], 5, unit="x")
        if tf_t:
            target(f"all-reduce {n}x{format_size(size)} vs TF", be, tf_t / big["time_us"], 10, unit="x")
        target(f"all-reduce {n}x{format_size(t.small)} median", be, get("all-reduce", t.small, be)["time_us"], 10,
               higher=False, unit=" us")
        target(f"SGD {n}x{format_size(size)} %copy", be, get("update/sgd", size, be)["pct_copy"], 80, unit="%")
        target(f"Adam {n}x{format_size(size)} %copy", be, get("update/adamw", size, be)["pct_copy"], 80, unit="%")
    print()
    print(f"# {'target':<30} {'backend':>7} {'measured':>10} {'goal':>9}  verdict")
    for name, be, val, goal, how in verdicts:
        print(f"  {name:<30} {be:>7} {val:>10} {goal:>9}  {how}")
    wrong = sum(r["wrong"] or 0 for r in rows)
    print(f"\n# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if t.json:
        with open(t.json, "w", encoding="utf-8") as f:
            json.dump({"copy_start": start.results, "copy_end": end.results, "ceiling_method": method, "rows": rows,
                       "verdicts": verdicts}, f, indent=1)
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
