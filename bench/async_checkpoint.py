"""How long a checkpoint save blocks the training loop: synchronous against ``CheckpointOptions(enable_async=True)``.

``python bench/async_checkpoint.py [MiB] [rounds] [steps]``: a model of ``MiB``/2 MiB of float32
variables (8 of them) trained by SGD with momentum (as many MiB of slots: ``MiB`` in all, 256 by
default), saved by a ``CheckpointManager`` (fsync included) in rounds that alternate:

* sync: ``manager.save()``; the time the call takes is the time the loop is blocked;
* async: ``manager.save(options=CheckpointOptions(enable_async=True))``, then ``steps`` training
  steps while the background thread writes, then ``manager.sync()``. Blocked: the call, plus what
  the steps after it cost beyond the same steps without a save (the copy-on-write: each variable
  and slot written while its snapshot is held moves to fresh memory once), plus any wait left at
  ``sync()`` (none when the steps outlast the write).

Prints the medians over the rounds (ms) and the ratios to the synchronous save. The steps' own
time is measured in the same run, as is a plain copy of the same bytes (the copy-on-write's floor).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import numpy as np

import cudist
from cudist import train


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    nvars = 8
    n = ((mib // 2) << 18) // nvars  # float32 elements per variable: half the bytes are variables, half slots
    rng = np.random.default_rng(0)
    variables = [cudist.Variable(rng.standard_normal(n, dtype=np.float32), name=f"v{i}") for i in range(nvars)]
    grads = [np.full(n, 1e-3, np.float32) for _ in range(nvars)]
    opt = cudist.optimizers.SGD(0.01, momentum=0.9)

    def step() -> None:
        opt.apply_gradients(zip(grads, variables))

    step()  # creates the slots
    ckpt = train.Checkpoint(optimizer=opt, variables=variables)
    asynchronous = train.CheckpointOptions(enable_async=True)
    t: dict[str, list[float]] = {k: [] for k in ("sync save", "async call", "steps after", "sync wait", "steps plain", "copy")}
    with tempfile.TemporaryDirectory() as d:
        manager = train.CheckpointManager(ckpt, d, max_to_keep=2)
        manager.save()  # warm: the files exist, the page cache is in its steady state
        for _ in range(rounds):
            a = time.perf_counter()
            for _ in range(steps):
                step()
            t["steps plain"].append(time.perf_counter() - a)

            a = time.perf_counter()
            manager.save()
            t["sync save"].append(time.perf_counter() - a)

            a = time.perf_counter()
            manager.save(options=asynchronous)
            b = time.perf_counter()
            for _ in range(steps):
                step()
            c = time.perf_counter()
            manager.sync()
            e = time.perf_counter()
            t["async call"].append(b - a)
            t["steps after"].append(c - b)
            t["sync wait"].append(e - c)

            src = [v.numpy() for v in variables]
            a = time.perf_counter()
            for s in src:
                s.copy()
                s.copy()  # the variable and its slot
            t["copy"].append(time.perf_counter() - a)
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    extra = max(0.0, med["steps after"] - med["steps plain"])
    blocked = med["async call"] + extra + med["sync wait"]
    print(f"{mib} MiB of variables + momentum slots ({nvars} variables), {rounds} rounds, {steps} steps after each "
          "async save; medians in ms")
    print("| sync save | async save call | steps after it, beyond plain | wait at sync() | blocked in all | "
          f"{steps} plain steps | copy of the bytes |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {med['sync save']:.1f} | {med['async call']:.2f} ({100 * med['async call'] / med['sync save']:.1f}%) | "
          f"{extra:.1f} | {med['sync wait']:.1f} | {blocked:.1f} ({100 * blocked / med['sync save']:.1f}%) | "
          f"{med['steps plain']:.1f} | {med['copy']:.1f} |")


if __name__ == "__main__":
    main()
