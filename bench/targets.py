"""Measures cudist's performance targets in one process and prints a pass/miss table.

Every number of the verdict table comes from this one run (one copy-bandwidth measurement, the same
buffers sizes for every backend), so the ratios compare like with like:

* all-reduce SUM float32, 4 replicas x 64 MiB: >= 80% of the copy ceiling counting 2*N*size bytes,
  >= 5x the plain NumPy loop (the ``numpy`` backend), >= 10x TF's ``all_reduce`` inside
  ``MirroredStrategy.run`` on 4 logical CPUs (tf.function) when a TensorFlow python is given;
* all-reduce of 4 x 4 KiB: <= 10 us (median);
* SGD and Adam updates of 4 mirrored copies of 64 MiB: >= 80% of the copy ceiling counting the bytes
  each must move (SGD (2+N)*size, Adam (4+3N)*size).

Usage::

    python bench/targets.py [--tf-python /tmp/tfvenv/bin/python] [--size 64M] [-n 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

from cudist.bench import _cli
from cudist.bench._sizes import format_size, parse_size


def _rows(rows, backend):
    return [r for r in rows if r["backend"] == backend]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="large size per replica (default 64M)")
    p.add_argument("--small", type=parse_size, default=parse_size("4K"), help="small size per replica (default 4K)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--small-iters", type=int, default=2000)
    p.add_argument("--backend", default="all")
    p.add_argument("--tf-python", default=None)
    p.add_argument("--json", default=None)
    t = p.parse_args(argv)

    size, n = t.size, t.replicas
    cli = _cli.build_parser()
    base = ["all-reduce", "-n", str(t.iters), "-w", str(t.warmup), "--replicas", str(n), "--backend", t.backend,
            "--copy-size", format_size(max(size, 64 << 20)), "--no-progress"]
    if t.tf_python:
        base += ["--compare", "tf", "--tf-python", t.tf_python]
    args = cli.parse_args(base)
    args._argv = sys.argv[1:] if argv is None else list(argv)
    ctx = _cli.Context(args)

    big = _cli.run_kernel_op(ctx, "all-reduce", sizes=[size], dtypes=["float32"])
    args.compare = None
    args.iters, args.warmup_iters = t.small_iters, max(t.warmup, 100)
    small = _cli.run_kernel_op(ctx, "all-reduce", sizes=[t.small], dtypes=["float32"])
    args.iters, args.warmup_iters = t.iters, t.warmup
    upd = {}
    for opt in ("sgd", "adam"):
        args.optimizer = opt
        upd[opt] = _cli.run_kernel_op(ctx, "update", sizes=[size], dtypes=["float32"])

    ceiling = ctx.copy_bw.best
    numpy_t = next((r["time_us"] for r in big if r["backend"] == "numpy"), None)
    tf_t = next((r["time_us"] for r in big if r["backend"] == "tf-fn"), None)
    verdicts = []

    def target(name, backend, value, goal, higher=True, unit=""):
        if value is None:
            verdicts.append((name, backend, "not measured", f"{goal}{unit}", "-"))
            return
        ok = value >= goal if higher else value <= goal
        if ok:
            how = "met"
        elif higher:
            how = f"missed: {value / goal * 100:.0f}% of target"
        else:
            how = f"missed: {value / goal:.1f}x the limit"
        verdicts.append((name, backend, f"{value:.1f}{unit}", f"{'>=' if higher else '<='} {goal}{unit}", how))

    fast = [b for b in dict.fromkeys(r["backend"] for r in big) if not b.startswith("tf-")]
    for be in fast:
        r = _rows(big, be)[0]
        target(f"all-reduce {n}x{format_size(size)} %copy (2*N*size)", be, r["pct_copy"], 80, unit="%")
        if be != "numpy":
            target(f"all-reduce {n}x{format_size(size)} vs numpy loop", be,
                   numpy_t / r["time_us"] if numpy_t else None, 5, unit="x")
        target(f"all-reduce {n}x{format_size(size)} vs TF MirroredStrategy.run (tf.function)", be,
               tf_t / r["time_us"] if tf_t else None, 10, unit="x")
        rs = _rows(small, be)
        target(f"all-reduce {n}x{format_size(t.small)} median", be, rs[0]["time_us"] if rs else None, 10, higher=False,
               unit=" us")
        for opt, goal_bytes in (("sgd", "(2+N)*size"), ("adam", "(4+3N)*size")):
            ru = _rows(upd[opt], be)
            target(f"{opt} update {n}x{format_size(size)} %copy ({goal_bytes})", be, ru[0]["pct_copy"] if ru else None,
                   80, unit="%")

    ctx.print()
    ctx.print(f"# targets (copy ceiling {ceiling:.1f} GB/s, {ctx.copy_bw.best_method}; same run)")
    w = max(len(v[0]) for v in verdicts)
    ctx.print(f"# {'target':<{w}}  {'backend':>7}  {'measured':>10}  {'goal':>9}  verdict")
    for name, be, val, goal, how in verdicts:
        ctx.print(f"  {name:<{w}}  {be:>7}  {val:>10}  {goal:>9}  {how}")
    summary = _cli._summary(ctx)
    _cli._print_summary(ctx, summary)
    if t.json:
        doc = {"header": ctx.header, "tables": ctx.tables, "verdicts": verdicts, "summary": summary}
        with open(t.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, default=float)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
