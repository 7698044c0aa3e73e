"""A/B of the learning-rate variable's read per step (issue #31), interleaved rounds in one process.

A: the rate taken from the float kept on the optimizer (the behaviour before the learning rate was
read from its variable), patched in; B: this tree, where each ``apply_gradients`` reads the float32
``learning_rate`` variable once. Adam on one 256-element float32 variable under a 2-CPU
MirroredStrategy (a small update, where a per-step cost shows most). Prints the B/A time ratio.

    .venv/bin/python bench/lr_variable_ab.py [--rounds 15] [--steps 300]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cudist
from cudist import optimizers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    cpu = cudist.config.list_physical_devices("CPU")[0]
    cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * 2)
    s = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        w = cudist.Variable(np.ones(256, np.float32))
        opt = optimizers.Adam(0.01)
    g = np.full(256, 0.5, np.float32)

    def step() -> None:
        s.run(lambda: opt.apply_gradients([(g, w)]))

    variants = {"A": lambda self: self._learning_rate, "B": optimizers.Optimizer._variable_learning_rate}
    for _ in range(200):
        step()
    ratios = []
    for r in range(args.rounds):
        t = {}
        for name in ("A", "B") if r % 2 else ("B", "A"):
            optimizers.Optimizer._variable_learning_rate = variants[name]  # type: ignore[method-assign]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            t[name] = time.perf_counter() - t0
        ratios.append(t["B"] / t["A"])
    print(f"B/A time ratio over {args.rounds} rounds of {args.steps} steps: median {np.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
