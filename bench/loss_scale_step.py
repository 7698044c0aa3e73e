"""LossScaleOptimizer step through ``strategy.run``: the fused finiteness check against the previous
per-replica sweep, A/B in one process (interleaved rounds).

B (this tree): one merge_call reduces each variable's per-replica gradients, unscales them and
reports finiteness in one kernel pass (``reduce_unscale_finite``), then the inner optimizer updates
from the sums. A (before): the previous ``LossScaleOptimizer.apply_gradients`` (its non-fused path, still there): each
replica checks its gradients (``np.isfinite`` over a float32 copy), the replicas all-reduce the
verdict, each divides its gradients by the scale (a float32 copy), and the inner optimizer's fused
all-reduce + update runs on those. Both are checked to give the same bits first.

Usage: ``python bench/loss_scale_step.py [--mib 16] [--replicas 4] [--vars 4] [--rounds 7]
[--calls 5] [--dtypes float32,bfloat16] [--backend native]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def before_apply_gradients(self, grads_and_vars):
    """LossScaleOptimizer.apply_gradients as it was before the fused check (commit b0f2386): its
    per-replica path, which the optimizer still takes where the check cannot be fused."""
    from cudist import get_replica_context

    return self._apply_checked(list(grads_and_vars), get_replica_context())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=16.0, help="float32 MiB per variable")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--vars", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--backend", default="native")
    a = p.parse_args()
    os.environ["CUDIST_BACKEND"] = a.backend

    import ml_dtypes
    import numpy as np

    import cudist
    from cudist import config, optimizers

    n = a.replicas
    count = int(a.mib * (1 << 20)) // 4
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * n)
    strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(count).astype(np.float32) for _ in range(a.vars)]
    g32 = [[(rng.standard_normal(count) * 1024).astype(np.float32) for _ in range(a.vars)] for _ in range(n)]
    after = optimizers.LossScaleOptimizer.apply_gradients
    print(f"# strategy.run + LossScaleOptimizer(SGD(momentum=0.9)).apply_gradients, {n} replicas, {a.vars} float32 "
          f"variables of {count} elements ({a.mib:g} MiB each), backend {a.backend}; A: the per-replica check "
          f"(before), B: fused into the reduce (this tree); {a.rounds} interleaved rounds x median of {a.calls} calls")
    print(f"# {'gradients':>9} {'A ms':>8} {'B ms':>8} {'A/B':>6}")
    for dt in a.dtypes.split(","):
        dtype = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)
        grads = [[g.astype(dtype) for g in row] for row in g32]

        def build():
            with strategy.scope():
                ws = [cudist.Variable(x, name=f"w{i}") for i, x in enumerate(init)]
                opt = optimizers.LossScaleOptimizer(optimizers.SGD(0.01, momentum=0.9))

            def step():
                r = cudist.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients(list(zip(grads[r], ws)))

            return ws, step

        runs = {}
        for name, impl in (("A", before_apply_gradients), ("B", after)):
            optimizers.LossScaleOptimizer.apply_gradients = impl
            ws, step = build()
            for _ in range(2):
                strategy.run(step)
            runs[name] = (ws, step)
        want = [np.asarray(w.read_value()).tobytes() for w in runs["A"][0]]
        assert [np.asarray(w.read_value()).tobytes() for w in runs["B"][0]] == want, "A and B differ"
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(a.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                optimizers.LossScaleOptimizer.apply_gradients = before_apply_gradients if name == "A" else after
                step = runs[name][1]
                strategy.run(step)  # warm-up
                s = []
                for _ in range(a.calls):
                    t0 = time.perf_counter()
                    strategy.run(step)
                    s.append(time.perf_counter() - t0)
                times[name].append(statistics.median(s) * 1e3)
        optimizers.LossScaleOptimizer.apply_gradients = after
        ta, tb = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"  {dt:>9} {ta:8.2f} {tb:8.2f} {ta / tb:5.2f}x")


if __name__ == "__main__":
    main()
