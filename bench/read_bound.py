"""How fast each native kernel reads memory: the fused updates against the reductions and a copy.

``cudist-bench user-path`` rates a fused all-reduce + update by the bytes it must move, against a
copy (``%copy``). A copy reads half of what it moves; the fused momentum pass reads 6 of every 8
bytes it moves on 4 replicas (4 gradients, the variable and its velocity; it writes the variable
and the velocity back), Adam 7 of 10. Where a core can only have so many reads in flight, every
kernel tops out at about the same *read* rate, and a pass that is mostly reads moves fewer bytes per
second than a copy however it is written. This script times the native kernels on buffers of
``--size`` bytes in interleaved rounds and prints, for each, the bytes it moves and reads (in units
of the buffer size S), its rate in both, and its moved rate as a percentage of the copy's
(``%copy``). The last column, ``read-bound %copy``, is what the pass would reach at the best read rate
any kernel of the table showed: the most a pass of that read share can get on this machine.

Usage: ``python bench/read_bound.py [--size 64M] [--replicas 4] [--rounds 7] [--iters 5]``.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from cudist._kernels import get_backend
from cudist.bench._sizes import format_size, parse_size
from cudist.bench._timing import time_calls

LR, MOMENTUM = 0.01, 0.9


def kernels(be, size: int, n: int) -> list[tuple[str, int, int, object]]:
    """(name, bytes moved / S, bytes read / S, call) of each timed kernel, on fresh random buffers."""
    count = size // 4
    rng = np.random.default_rng(0)

    def rand():
        return rng.standard_normal(count, dtype=np.float32)

    # Every kernel its own buffers: one that reuses the previous kernel's inputs would find part of
    # them still in cache (this machine reports a 480 MiB L3), and so would read faster than memory.
    two = [rand() for _ in range(2)]
    g_rto, g_sgd, g_mom, g_adam = ([rand() for _ in range(n)] for _ in range(4))
    src, dst = rand(), np.empty(count, np.float32)
    out2, out_n = np.empty(count, np.float32), np.empty(count, np.float32)
    w, wm, vel = rand(), rand(), np.zeros(count, np.float32)
    wa, m, v = rand(), np.zeros(count, np.float32), np.zeros(count, np.float32)
    step = [0]

    def adam():
        step[0] += 1
        be.all_reduce_adam([wa], [m], [v], g_adam, lr=1e-3, step=step[0])

    # Outputs of 16 MiB and more are written with streaming stores (no read for ownership), so the
    # reductions read only their inputs; the updates write back lines they have just read.
    return [
        ("copy (native broadcast)", 2, 1, lambda: be.broadcast(src, [dst])),
        ("reduce_to_one 2 -> 1", 3, 2, lambda: be.reduce_to_one(two, out=out2)),
        (f"reduce_to_one {n} -> 1", n + 1, n, lambda: be.reduce_to_one(g_rto, out=out_n)),
        (f"all_reduce_sgd ({n} grads)", n + 2, n + 1, lambda: be.all_reduce_sgd([w], g_sgd, lr=LR)),
        (f"all_reduce_momentum ({n} grads)", n + 4, n + 2,
         lambda: be.all_reduce_momentum([wm], [vel], g_mom, lr=LR, momentum=MOMENTUM)),
        (f"all_reduce_adam ({n} grads)", n + 6, n + 3, adam),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="64M", help="bytes per buffer (default 64M)")
    p.add_argument("--replicas", type=int, default=4, help="gradients per fused pass (default 4)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per kernel and round (default 5)")
    p.add_argument("--backend", default="native", help="kernel backend (default native)")
    a = p.parse_args(argv)
    size = parse_size(a.size)
    if size < 4 or a.replicas < 2 or a.rounds < 1 or a.iters < 1:
        p.error("--size must hold one float32, --replicas >= 2, --rounds and --iters >= 1")
    be = get_backend(a.backend)
    table = kernels(be, size, a.replicas)
    times: dict[str, list[float]] = {name: [] for name, *_ in table}
    for _ in range(a.rounds):
        for name, _, _, call in table:
            # One untimed call first: the previous kernel's buffers were the ones in cache.
            times[name].append(statistics.fmean(time_calls(call, a.iters, warmup=1)) / 1e9)
    rows = []
    for name, moved, read, _ in table:
        t = statistics.median(times[name])
        rows.append((name, moved, read, t, moved * size / t / 1e9, read * size / t / 1e9))
    copy_rate = rows[0][4]
    best_read = max(r[5] for r in rows)
    print(f"# {be.name} kernels, S = {format_size(size)} (float32) per buffer, {a.replicas} gradients per fused pass; "
          f"median of {a.rounds} interleaved rounds x {a.iters} calls")
    print(f"# read-bound %copy = best read rate of the table ({best_read:.1f} GB/s) / (read / moved) / copy rate")
    print(f"#{'kernel':>33} {'moved':>6} {'read':>5} {'time(ms)':>9} {'GB/s':>7} {'read GB/s':>10} {'%copy':>6} "
          f"{'read-bound %copy':>17}")
    for name, moved, read, t, gbps, rgbps in rows:
        bound = 100 * best_read * moved / read / copy_rate
        print(f"{name:>34} {moved:>4}*S {read:>3}*S {t * 1e3:>9.2f} {gbps:>7.1f} {rgbps:>10.1f} "
              f"{100 * gbps / copy_rate:>6.1f} {bound:>17.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
