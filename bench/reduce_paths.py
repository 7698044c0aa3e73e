"""The three ways a host all-reduce can write its result, timed alone on the native kernels.

``cudist.bench``'s user-path rows compare ``strategy.run`` + ``all_reduce`` with the in-place kernel.
The user's path cannot run in place (the replicas' inputs must stay intact): this script shows what
each out-of-place choice costs next to the in-place kernel, without any dispatch around it:

* ``in place``: ``all_reduce(bufs, bufs)`` (N inputs read, N written back into lines just read);
* ``reduce-to-one``: ``reduce_to_one(ins, out)`` (N read, one result written: what ``run`` uses for
  leaves of 64 KiB and more, every replica getting a read-only view of the one result);
* ``out of place``: ``all_reduce(ins, outs)`` (N read, N results written);
* ``strategy.run``: the user's call, ``strategy.run`` of a function returning
  ``get_replica_context().all_reduce("sum", x)`` on the same inputs (a PerReplica), 4 logical CPUs.

The ratio columns divide by the in-place time: ``r2o/ip`` is the least a path that keeps its inputs
intact can reach with no dispatch at all, ``run/ip`` what the user's call reaches.

Usage: ``python bench/reduce_paths.py [--replicas 4] [--rounds 7] [--sizes 256K,4M,16M,64M]``.
Medians of interleaved rounds (each round times a block of calls of every variant in turn), float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cudist._kernels import cpu_backend
from cudist._reduce_util import ReduceOp


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", default="256K,4M,16M,64M", help="bytes per replica, comma list (K/M/G suffixes)")
    a = p.parse_args(argv)
    kernels = cpu_backend().trusted
    import cudist
    from cudist import config

    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * a.replicas)
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(a.replicas)])

    def replica_fn(x):
        return cudist.get_replica_context().all_reduce("sum", x)

    print(f"# reduce_paths: {a.replicas} replicas, float32, backend {cpu_backend().name}; medians of {a.rounds} "
          "interleaved rounds; us per call")
    print(f"# {'size':>6} {'in place':>10} {'reduce-to-one':>14} {'out of place':>13} {'strategy.run':>13} "
          f"{'r2o/ip':>7} {'run/ip':>7}  check")
    rng = np.random.default_rng(0)
    for size in (_bytes(t) for t in a.sizes.split(",")):
        n = size // 4
        ins = [rng.standard_normal(n).astype(np.float32) for _ in range(a.replicas)]
        outs = [np.empty(n, np.float32) for _ in range(a.replicas)]
        one = np.empty(n, np.float32)
        bufs = [x.copy() for x in ins]
        per_replica = strategy.experimental_distribute_values_from_function(lambda c: ins[c.replica_id_in_sync_group])
        got: list = []
        variants = {
            "in place": lambda: kernels.all_reduce(bufs, bufs, ReduceOp.SUM),
            "reduce-to-one": lambda: kernels.reduce_to_one(ins, ReduceOp.SUM, one),
            "out of place": lambda: kernels.all_reduce(ins, outs, ReduceOp.SUM),
            "strategy.run": lambda: got.append(strategy.run(replica_fn, args=(per_replica,))) or got.clear(),
        }
        calls = max(3, (1 << 27) // (size * a.replicas))
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / calls * 1e6)
        want = ins[0].copy()
        for x in ins[1:]:
            want += x
        result = strategy.experimental_local_results(strategy.run(replica_fn, args=(per_replica,)))
        ok = (np.array_equal(one, want) and all(np.array_equal(o, want) for o in outs)
              and all(np.array_equal(r, want) for r in result))
        med = [statistics.median(times[k]) for k in variants]
        label = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K"
        print(f"  {label:>6} {med[0]:>10.1f} {med[1]:>14.1f} {med[2]:>13.1f} {med[3]:>13.1f} "
              f"{med[1] / med[0]:>7.3f} {med[3] / med[0]:>7.3f}  {'ok' if ok else 'WRONG'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
