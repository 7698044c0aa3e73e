"""The cost of the default cross-worker collective check on the MLP multi-worker step.

Run under the launcher (``python -m cudist.launch -n 2 bench/check_cost.py``). Every worker builds
``bench/step_compare.py``'s step (MLP 784-512-512-10, global batch 256, SGD with momentum, one CPU
replica per worker) twice, on two ``MultiWorkerMirroredStrategy`` objects in the same processes:
one with the default check (a hash of each collective riding with it), one created under
``CUDIST_CHECK_COLLECTIVES=0``. Rounds alternate the two (which goes first alternates too), each
``--steps`` timed steps after ``--warmup`` untimed ones; rank 0 prints each round's median step
time of both and the ratio checked / unchecked, then the median ratio over the rounds.

Usage::

    python -m cudist.launch -n 2 bench/check_cost.py [--rounds 30] [--steps 20] [--warmup 5] [--settle 100]
        [--what step|N]   (N: time an all_reduce of N float32 in strategy.run instead of the step)
        [--control]       (A/A: both checked; the ratio the set-up itself gives)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import step_compare  # noqa: E402 - the step under test is that benchmark's

import cudist  # noqa: E402


class _Step(step_compare.CudistWorker):
    """step_compare's cudist step over one strategy (this worker's shard of the global batch)."""

    def __init__(self, strategy, rank, world, batch):  # noqa: D107 - the parent reads a file; this builds in memory
        self.params, self.x, self.y = step_compare.make_problem(0, batch)
        part = step_compare.shards(world, self.x, self.y)[rank]
        self.step = self._build_step(strategy, lambda c: part)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--settle", type=int, default=100)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--what", default="step",
                   help="step (the MLP step), or N: an all_reduce of N float32 in strategy.run instead (the "
                        "step's gradients are 669706)")
    p.add_argument("--control", action="store_true",
                   help="A/A control: both strategies checked (what the two-strategy set-up itself measures)")
    a = p.parse_args()
    checked = cudist.MultiWorkerMirroredStrategy()
    if not a.control:
        os.environ["CUDIST_CHECK_COLLECTIVES"] = "0"
    unchecked = cudist.MultiWorkerMirroredStrategy()
    os.environ.pop("CUDIST_CHECK_COLLECTIVES", None)
    from mpi4py import MPI

    rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if a.what == "step":
        steps = {"checked": _Step(checked, rank, world, a.batch).step,
                 "unchecked": _Step(unchecked, rank, world, a.batch).step}
    else:
        import numpy as np

        grads = np.ones(int(a.what), np.float32)

        def all_reduce(strategy):
            return lambda want_loss: strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", grads))

        steps = {"checked": all_reduce(checked), "unchecked": all_reduce(unchecked)}
    for fn in steps.values():
        for _ in range(a.settle):
            fn(False)
    ratios, diffs = [], []
    if rank == 0:
        what = "MLP step of bench/step_compare.py" if a.what == "step" else f"all_reduce of {a.what} float32"
        print(f"# check_cost: {world} workers, {what}, {a.rounds} rounds of "
              f"{a.warmup} + {a.steps} steps each way; medians in ms", flush=True)
    for r in range(a.rounds):
        med = {}
        for name in (("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked")):
            fn = steps[name]
            for _ in range(a.warmup):
                fn(False)
            samples = []
            for _ in range(a.steps):
                t0 = time.perf_counter_ns()
                fn(False)
                samples.append(time.perf_counter_ns() - t0)
            med[name] = statistics.median(samples) / 1e6
        ratios.append(med["checked"] / med["unchecked"])
        diffs.append((med["checked"] - med["unchecked"]) * 1e3)
        if rank == 0:
            print(f"round {r:2d}: checked {med['checked']:.3f}  unchecked {med['unchecked']:.3f}  "
                  f"ratio {ratios[-1]:.4f}", flush=True)
    if rank == 0:
        q = statistics.quantiles(ratios, n=4)
        print(f"# checked / unchecked: median {statistics.median(ratios):.4f} (quartiles {q[0]:.4f}-{q[2]:.4f}, "
              f"{a.rounds} rounds); checked - unchecked: median {statistics.median(diffs):.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
