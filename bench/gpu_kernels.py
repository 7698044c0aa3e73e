"""GPU kernel benchmark: cudist's CUDA all-reduce and fused Adam against same-run baselines.

Run on a machine with an NVIDIA GPU and CuPy:

    python bench/gpu_kernels.py [--mib 256] [--repeats 20] [--device 0]

1. All-reduce over N = 2, 4, 8 logical replicas (N buffers on one GPU), one-shot kernel, counting
   2 * N * size bytes (each buffer read once and written once), against the device's copy bandwidth
   measured in the same run (a device-to-device copy of `size` bytes, counted as 2 * size: one read,
   one write). Target: all-reduce bandwidth >= 85% of the copy bandwidth.
2. Fused mirrored Adam on N copies against the same update written as a chain of CuPy elementwise
   operations (what one would write without cudist).

Times are medians over --repeats runs, taken with cupy.cuda.Event pairs after a warm-up. The
"wrong" column counts elements that differ from the NumPy reference (all-reduce, bit for bit) or from
the chained CuPy result (Adam, within 1e-6 relative: the chain may fuse differently), checked once on
fresh data outside the timed loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np


def _time(cp, fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs (after two warm-up calls)."""
    fn()
    fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def _wrong_all_reduce(cp, be, n: int, count: int) -> int:
    """Elements of a one-off all-reduce that differ from the NumPy reference (bit for bit)."""
    from cudist._kernels._numpy import reference_reduce

    bufs = [cp.random.standard_normal(count, dtype=cp.float32) for _ in range(n)]
    want = reference_reduce([cp.asnumpy(b) for b in bufs], "sum")
    be.all_reduce(bufs, "sum")
    return sum(int(np.count_nonzero(cp.asnumpy(b).view(np.uint32) != want.view(np.uint32))) for b in bufs)


def bench_all_reduce(cp, be, mib: int, repeats: int) -> list[tuple]:
    nbytes = mib << 20
    count = nbytes // 4
    src = cp.random.standard_normal(count, dtype=cp.float32)
    dst = cp.empty_like(src)
    # Copy ceiling: one read + one write of `nbytes`.
    t_copy = _time(cp, lambda: cp.copyto(dst, src), repeats)
    copy_bw = 2 * nbytes / t_copy
    rows = [("copy (ceiling)", 1, t_copy, copy_bw, 1.0, 0)]
    for n in (2, 4, 8):
        bufs = [cp.random.standard_normal(count, dtype=cp.float32) for _ in range(n)]
        t = _time(cp, lambda: be.all_reduce(bufs, "sum"), repeats)
        bw = 2 * n * nbytes / t
        del bufs
        rows.append((f"all_reduce sum N={n}", n, t, bw, bw / copy_bw, _wrong_all_reduce(cp, be, n, count)))
    return rows


def bench_adam(cp, be, mib: int, repeats: int) -> list[tuple]:
    count = (mib << 20) // 4
    rows = []
    lr, b1, b2, eps, step = 1e-3, 0.9, 0.999, 1e-7, 3
    for n in (1, 2, 4):
        ws = [cp.random.standard_normal(count, dtype=cp.float32) for _ in range(n)]
        ms = [cp.zeros(count, cp.float32) for _ in range(n)]
        vs = [cp.zeros(count, cp.float32) for _ in range(n)]
        g = cp.random.standard_normal(count, dtype=cp.float32)

        def fused():
            be.adam(ws, ms, vs, g, lr=lr, beta_1=b1, beta_2=b2, epsilon=eps, step=step)

        lr_t = np.float32(lr * np.sqrt(1 - b2**step) / (1 - b1**step))
        one = np.float32(1)
        fb1, fb2, feps = np.float32(b1), np.float32(b2), np.float32(eps)

        def chained():
            m = ms[0] + (g - ms[0]) * (one - fb1)
            v = vs[0] + (g * g - vs[0]) * (one - fb2)
            w = ws[0] - lr_t * m / (cp.sqrt(v) + feps)
            for k in range(n):
                cp.copyto(ms[k], m)
                cp.copyto(vs[k], v)
                cp.copyto(ws[k], w)

        t_fused = _time(cp, fused, repeats)
        t_chain = _time(cp, chained, repeats)
        # Bytes the fused kernel must move: read w, m, v, g once; write 3 * n arrays.
        moved = (4 + 3 * n) * count * 4
        # Correctness on fresh state: one fused step against one chained step from the same inputs.
        for a in ms + vs:
            a.fill(0)
        for w in ws[1:]:
            cp.copyto(w, ws[0])
        w0 = ws[0].copy()
        fused()
        got = [x.copy() for x in (*ws, *ms, *vs)]
        for k in range(n):
            cp.copyto(ws[k], w0)
            ms[k].fill(0)
            vs[k].fill(0)
        chained()
        want = (*ws, *ms, *vs)
        wrong = sum(
            int(cp.count_nonzero(cp.abs(a - b) > 1e-6 * cp.maximum(cp.abs(b), 1e-30))) for a, b in zip(got, want)
        )
        rows.append((f"adam N={n}", n, t_fused, moved / t_fused, t_chain / t_fused, wrong))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per replica buffer (default 256)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001 - any failure means: no usable GPU here
        print(f"gpu_kernels: needs CuPy and an NVIDIA GPU ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    from cudist._kernels import get_backend

    be = get_backend("cupy")
    with cp.cuda.Device(args.device):
        props = cp.cuda.runtime.getDeviceProperties(args.device)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        print(f"device {args.device}: {name}; {args.mib} MiB float32 per buffer; median of {args.repeats}")
        print(f"launch path: {be.launch_path}")
        print(f"{'all-reduce':<24}{'N':>3}{'time ms':>12}{'GB/s':>10}{'vs copy':>10}{'wrong':>8}")
        rows = bench_all_reduce(cp, be, args.mib, args.repeats)
        for label, n, t, bw, ratio, wrong in rows:
            print(f"{label:<24}{n:>3}{t * 1e3:>12.3f}{bw / 1e9:>10.1f}{ratio:>9.0%}{wrong:>8}")
        worst = min(r[4] for r in rows[1:])
        print(f"all-reduce worst ratio to copy bandwidth: {worst:.0%} (target >= 85%)")
        print()
        print(f"{'fused adam':<24}{'N':>3}{'time ms':>12}{'GB/s':>10}{'speedup':>10}{'wrong':>8}")
        adam_rows = bench_adam(cp, be, max(1, args.mib // 4), args.repeats)
        for label, n, t, bw, speedup, wrong in adam_rows:
            print(f"{label:<24}{n:>3}{t * 1e3:>12.3f}{bw / 1e9:>10.1f}{speedup:>9.1f}x{wrong:>8}")
        print("(speedup: time of the chain of CuPy elementwise ops / time of the fused kernel)")
    total_wrong = sum(r[-1] for r in rows) + sum(r[-1] for r in adam_rows)
    print(f"wrong elements: {total_wrong}")
    return 0 if total_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
