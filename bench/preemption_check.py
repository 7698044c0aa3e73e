"""The cost of ``PreemptionCheckpointHandler.run`` over calling the step directly: its per-call agreement.

``python -m cudist.launch -n 2 bench/preemption_check.py [calls] [rounds] [floats]`` (or ``python
bench/preemption_check.py`` for one process): times ``handler.run(step)`` against ``step()`` in
alternating rounds, and prints the medians (us per call) on worker 0, for two steps: a no-op (the
worst case: nothing moves the previous call's non-blocking all-reduce along, so the next call
waits for all of it) and ``strategy.run`` of an all-reduce of ``floats`` float32 (default 65536),
during which MPI progresses the handler's request. The difference is the agreement (the all-reduce
of one int64 that lets every worker see a preemption notice at the same call) and the run-count
variable's update.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import numpy as np

import cudist
from cudist import train
from cudist.train.experimental import PreemptionCheckpointHandler


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    floats = int(sys.argv[3]) if len(sys.argv) > 3 else 65536
    strategy = cudist.MultiWorkerMirroredStrategy()
    with strategy.scope():
        w = cudist.Variable(np.zeros(4, np.float32))
    directory = tempfile.mkdtemp() if strategy.extended.should_checkpoint else tempfile.mkdtemp()
    handler = PreemptionCheckpointHandler(strategy.cluster_resolver, train.Checkpoint(w=w), checkpoint_dir=directory)

    x = np.ones(floats, np.float32)

    def noop() -> None:
        pass

    def all_reduce() -> None:
        strategy.run(lambda: cudist.get_replica_context().all_reduce("sum", x))

    workers = strategy.num_replicas_in_sync // max(1, len(strategy.extended.worker_devices))
    for name, step, n in (("no-op", noop, calls), (f"all-reduce of {floats} float32", all_reduce, max(1, calls // 4))):
        direct, wrapped = [], []
        for _ in range(rounds):
            a = time.perf_counter()
            for _ in range(n):
                step()
            direct.append((time.perf_counter() - a) / n * 1e6)
            a = time.perf_counter()
            for _ in range(n):
                handler.run(step)
            wrapped.append((time.perf_counter() - a) / n * 1e6)
        if strategy.extended.should_checkpoint:
            d, w_ = statistics.median(direct), statistics.median(wrapped)
            print(f"{workers} worker(s), {name} step, {rounds} rounds of {n} calls: step() {d:.1f} us, "
                  f"handler.run(step) {w_:.1f} us: +{w_ - d:.1f} us a call (medians)")


if __name__ == "__main__":
    main()
