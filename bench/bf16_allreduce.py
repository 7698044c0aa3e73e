"""bfloat16 vs float32 all-reduce through ``strategy.run`` (the user's path), same element count.

MirroredStrategy over ``--replicas`` logical CPUs; each replica's function all-reduces (SUM) one
array given as a PerReplica argument: ``cudist.get_replica_context().all_reduce("sum", x)``. float32
at ``--mib`` MiB per replica against bfloat16 with the same number of elements (half the bytes).
Rounds alternate the dtypes in one process (float32 then bfloat16, then the other way round), each
round the median of ``--calls`` timed calls; the table gives the median over rounds and the ratio.
Before timing, every backend's result is checked bit for bit against the NumPy reference (float32
accumulation in replica order, one rounding).

``--update``: instead, the fused all-reduce + SGD-momentum through ``optimizer.apply_gradients``
inside ``strategy.run``: a float32 variable of the same element count updated from float32
gradients against bfloat16 gradients (mixed precision; on backends with ``mixed_gradients`` the
fused pass widens them itself, no float32 copy). Checked first: both give the NumPy reference's
bits for the same gradient values.

Usage: ``python bench/bf16_allreduce.py [--mib 64] [--replicas 4] [--rounds 7] [--calls 5]
[--backends native,numba,numpy] [--update] [--simd-ab]``

``--simd-ab``: native only, float32 against bfloat16 with the SSE2 and with the AVX2 line kernel
(``cudist._core.bf16_simd``), the three rotated round by round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=64.0, help="float32 MiB per replica")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--backends", default="native,numba,numpy")
    p.add_argument("--update", action="store_true", help="the fused all-reduce + SGD-momentum instead")
    p.add_argument("--simd-ab", action="store_true",
                   help="native only: bfloat16 with the SSE2 and the AVX2 line kernel, each against float32")
    a = p.parse_args()
    if a.simd_ab:
        simd_ab(a)
        return
    (update_bench if a.update else all_reduce_bench)(a)


def _select(name: str) -> None:
    """Makes ``name`` the CPU kernel backend of what is created next."""
    from cudist._kernels import cpu_backend, reset_backend_cache

    os.environ["CUDIST_BACKEND"] = name
    reset_backend_cache()
    assert cpu_backend().name == name


def _logical_cpus(n: int) -> None:
    from cudist import config

    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * n)


def _interleaved(strategy, runs, rounds: int, calls: int, setup=None) -> dict[str, float]:
    """Median ms of ``strategy.run(fn, args=(x,))`` per key of ``runs = {key: (fn, x)}``: each round
    takes the keys in an order rotated by one (first key first, then the second, ...), each key a
    ``setup(key)`` call when given, a warm-up call, then the median of ``calls`` timed calls; the
    median over rounds per key."""
    keys = list(runs)
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            if setup is not None:
                setup(key)
            fn, x = runs[key]
            strategy.run(fn, args=(x,))  # warm-up
            s = []
            for _ in range(calls):
                t0 = time.perf_counter()
                strategy.run(fn, args=(x,))
                s.append(time.perf_counter() - t0)
            times[key].append(statistics.median(s) * 1e3)
    return {k: statistics.median(t) for k, t in times.items()}


def all_reduce_bench(a: argparse.Namespace) -> None:
    """``all_reduce("sum", x)`` inside ``strategy.run``: float32 vs bfloat16 of the same element count."""
    import ml_dtypes
    import numpy as np

    import cudist

    bf16 = np.dtype(ml_dtypes.bfloat16)
    count = int(a.mib * (1 << 20)) // 4
    n = a.replicas
    _logical_cpus(n)
    rng = np.random.default_rng(0)
    host32 = [(rng.random(count, dtype=np.float32) * 2 - 1) for _ in range(n)]
    host = {"float32": host32, "bfloat16": [h.astype(bf16) for h in host32]}

    def fn(x):
        return cudist.get_replica_context().all_reduce("sum", x)

    print(f"# strategy.run + all_reduce(SUM), {n} replicas, {count} elements per replica "
          f"(float32 {count * 4 / 2**20:.0f} MiB, bfloat16 {count * 2 / 2**20:.0f} MiB); "
          f"{a.rounds} interleaved rounds x median of {a.calls} calls")
    print(f"# {'backend':>8} {'float32 ms':>11} {'bfloat16 ms':>12} {'f32/bf16':>9}")
    for name in a.backends.split(","):
        _select(name)
        strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        runs = {}
        for dt, h in host.items():
            x = strategy.experimental_distribute_values_from_function(lambda c, h=h: h[c.replica_id_in_sync_group])
            got = strategy.experimental_local_results(strategy.run(fn, args=(x,)))
            want = h[0].astype(np.float32)
            for v in h[1:]:
                want = want + v.astype(np.float32)
            want = want.astype(h[0].dtype)
            for g in got:
                assert np.asarray(g).tobytes() == want.tobytes(), (name, dt)
            runs[dt] = (fn, x)
        t = _interleaved(strategy, runs, a.rounds, a.calls)
        f, b = t["float32"], t["bfloat16"]
        print(f"  {name:>8} {f:11.2f} {b:12.2f} {f / b:8.2f}x")
    os.environ.pop("CUDIST_BACKEND", None)


def simd_ab(a: argparse.Namespace) -> None:
    """Native bfloat16 all-reduce through strategy.run with each SIMD line kernel, and float32, interleaved."""
    import ml_dtypes
    import numpy as np

    import cudist
    from cudist import _core

    bf16 = np.dtype(ml_dtypes.bfloat16)
    count = int(a.mib * (1 << 20)) // 4
    n = a.replicas
    _logical_cpus(n)
    _select("native")
    rng = np.random.default_rng(0)
    host32 = [(rng.random(count, dtype=np.float32) * 2 - 1) for _ in range(n)]
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    xs = {dt: strategy.experimental_distribute_values_from_function(lambda c, h=h: h[c.replica_id_in_sync_group])
          for dt, h in (("float32", host32), ("bfloat16", [h.astype(bf16) for h in host32]))}

    def fn(x):
        return cudist.get_replica_context().all_reduce("sum", x)

    variants = [("float32", "auto"), ("bfloat16", "sse2"), ("bfloat16", "avx2")]
    got = {}
    for dt, simd in variants[1:]:
        assert _core.bf16_simd(simd) == simd
        got[simd] = np.asarray(strategy.experimental_local_results(strategy.run(fn, args=(xs[dt],)))[0]).tobytes()
    assert got["sse2"] == got["avx2"]
    print(f"# native strategy.run + all_reduce(SUM), {n} replicas, {count} elements per replica; bfloat16 with "
          f"each SIMD line kernel; {a.rounds} rounds (order rotated) x median of {a.calls} calls")
    runs = {f"{dt}-{simd}": (fn, xs[dt]) for dt, simd in variants}
    t = _interleaved(strategy, runs, a.rounds, a.calls, setup=lambda key: _core.bf16_simd(key.split("-")[1]))
    _core.bf16_simd("auto")
    f, b_sse, b_avx = t["float32-auto"], t["bfloat16-sse2"], t["bfloat16-avx2"]
    print(f"# float32 ms  bf16-sse2 ms  bf16-avx2 ms  f32/sse2  f32/avx2  sse2/avx2")
    print(f"  {f:10.2f} {b_sse:13.2f} {b_avx:13.2f} {f / b_sse:8.2f}x {f / b_avx:8.2f}x {b_sse / b_avx:9.2f}x")
    os.environ.pop("CUDIST_BACKEND", None)


def update_bench(a: argparse.Namespace) -> None:
    """Fused all-reduce + SGD-momentum via apply_gradients: float32 vs bfloat16 gradients, float32 variable."""
    import ml_dtypes
    import numpy as np

    import cudist

    bf16 = np.dtype(ml_dtypes.bfloat16)
    count = int(a.mib * (1 << 20)) // 4
    n = a.replicas
    _logical_cpus(n)
    rng = np.random.default_rng(0)
    g16 = [(rng.random(count, dtype=np.float32) * 2 - 1).astype(bf16) for _ in range(n)]
    grads = {"float32": [g.astype(np.float32) for g in g16], "bfloat16": g16}  # the same values
    init = rng.random(count, dtype=np.float32)

    def trained(strategy, dt, steps=1):
        with strategy.scope():
            w = cudist.Variable(init, name="w")
            opt = cudist.optimizers.SGD(0.01, momentum=0.9)
        x = strategy.experimental_distribute_values_from_function(lambda c: grads[dt][c.replica_id_in_sync_group])

        def step(g):
            opt.apply_gradients([(g, w)])

        for _ in range(steps):
            strategy.run(step, args=(x,))
        return w, x, step

    print(f"# strategy.run + SGD(momentum=0.9).apply_gradients (fused all-reduce + update), {n} replicas, "
          f"float32 variable of {count} elements; gradients float32 ({count * 4 / 2**20:.0f} MiB per replica) "
          f"vs bfloat16 ({count * 2 / 2**20:.0f} MiB); {a.rounds} interleaved rounds x median of {a.calls} calls")
    print(f"# {'backend':>8} {'f32 grads ms':>12} {'bf16 grads ms':>13} {'f32/bf16':>9}")
    _select("numpy")
    want = np.asarray(trained(cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)]), "float32", 2)[0].read_value())
    for name in a.backends.split(","):
        _select(name)
        strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        runs = {}
        for dt in grads:
            w, x, step = trained(strategy, dt, 2)
            assert np.asarray(w.read_value()).tobytes() == want.tobytes(), (name, dt)
            runs[dt] = (step, x)
        t = _interleaved(strategy, runs, a.rounds, a.calls)
        f, b = t["float32"], t["bfloat16"]
        print(f"  {name:>8} {f:12.2f} {b:13.2f} {f / b:8.2f}x")
    os.environ.pop("CUDIST_BACKEND", None)


if __name__ == "__main__":
    main()
