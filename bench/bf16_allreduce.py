"""bfloat16 vs float32 all-reduce through ``strategy.run`` (the user's path), same element count.

MirroredStrategy over ``--replicas`` logical CPUs; each replica's function all-reduces (SUM) one
array given as a PerReplica argument: ``cudist.get_replica_context().all_reduce("sum", x)``. float32
at ``--mib`` MiB per replica against bfloat16 with the same number of elements (half the bytes).
Rounds alternate the dtypes in one process (float32 then bfloat16, then the other way round), each
round the median of ``--calls`` timed calls; the table gives the median over rounds and the ratio.
Before timing, every backend's result is checked bit for bit against the NumPy reference (float32
accumulation in replica order, one rounding).

Usage: ``python bench/bf16_allreduce.py [--mib 64] [--replicas 4] [--rounds 7] [--calls 5]
[--backends native,numba,numpy]``
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
    a = p.parse_args()

    import ml_dtypes
    import numpy as np

    import cudist
    from cudist import config
    from cudist._kernels import cpu_backend, reset_backend_cache

    bf16 = np.dtype(ml_dtypes.bfloat16)
    count = int(a.mib * (1 << 20)) // 4
    n = a.replicas
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * n)
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
        os.environ["CUDIST_BACKEND"] = name
        reset_backend_cache()
        assert cpu_backend().name == name
        strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        xs = {}
        for dt, h in host.items():
            xs[dt] = strategy.experimental_distribute_values_from_function(
                lambda c, h=h: h[c.replica_id_in_sync_group])
            got = strategy.experimental_local_results(strategy.run(fn, args=(xs[dt],)))
            want = h[0].astype(np.float32)
            for v in h[1:]:
                want = want + v.astype(np.float32)
            want = want.astype(h[0].dtype)
            for g in got:
                assert np.asarray(g).tobytes() == want.tobytes(), (name, dt)
        times = {"float32": [], "bfloat16": []}
        for r in range(a.rounds):
            order = ("float32", "bfloat16") if r % 2 == 0 else ("bfloat16", "float32")
            for dt in order:
                strategy.run(fn, args=(xs[dt],))  # warm-up
                s = []
                for _ in range(a.calls):
                    t0 = time.perf_counter()
                    strategy.run(fn, args=(xs[dt],))
                    s.append(time.perf_counter() - t0)
                times[dt].append(statistics.median(s) * 1e3)
        f, b = statistics.median(times["float32"]), statistics.median(times["bfloat16"])
        print(f"  {name:>8} {f:11.2f} {b:12.2f} {f / b:8.2f}x")
    os.environ.pop("CUDIST_BACKEND", None)


if __name__ == "__main__":
    main()
