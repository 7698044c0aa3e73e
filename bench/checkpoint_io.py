"""Times a checkpoint save and restore of one large float32 variable (the checksum's cost).

``python bench/checkpoint_io.py [MiB] [repeats]``: saves ``Checkpoint(v=Variable(MiB of float32))``
with ``write`` (fsync included) and restores it ``repeats`` times, printing the median of each
(the files stay in the page cache, so the restore is the CPU-bound case, where a checksum shows most),
wall-clock and CPU time (the process's, less sensitive to other load on a shared machine).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import numpy as np

import cudist


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    v = cudist.Variable(np.random.default_rng(0).standard_normal(mib << 18, dtype=np.float32))
    ckpt = cudist.train.Checkpoint(v=v)
    times: dict[str, list[float]] = {"save": [], "restore": [], "save cpu": [], "restore cpu": []}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(repeats):
            for what, call in (("save", ckpt.write), ("restore", ckpt.read)):
                t, c = time.perf_counter(), time.process_time()
                call(f"{d}/ckpt")
                times[what].append(time.perf_counter() - t)
                times[what + " cpu"].append(time.process_time() - c)
    print(f"{mib} MiB float32, {repeats} runs (ms, min / median): " + ", ".join(
        f"{k} {min(v) * 1e3:.1f} / {statistics.median(v) * 1e3:.1f}" for k, v in times.items()))


if __name__ == "__main__":
    main()
