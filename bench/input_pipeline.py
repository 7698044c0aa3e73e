"""Input-pipeline cost per batch: the working tree against a git revision, in one process.

Times a full pass over ``Dataset.from_tensor_slices((x, y)).batch(B)`` (x: (n, 2) float32, y: (n,)
int32) -- plain, shuffled, through ``repeat().take()`` -- and the same pipeline through
``MirroredStrategy`` (2 logical CPUs) ``experimental_distribute_dataset``. "before" is
``src/cudist/data.py`` and ``src/cudist/_input_lib.py`` as of ``--ref`` (default HEAD, read with
``git show`` into a temporary directory and imported as separate modules); "after" is the working
tree. The default ref, 469c5d5, is the input pipeline before the vectorized batch path. For the
distributed rows, "old split" is the old ``_input_lib`` over the new ``data`` (the per-step cost of
splitting and building PerReplica alone). Each case runs ``--repeat`` passes; the median per-batch
time is reported.

Usage: python bench/input_pipeline.py [--n 10000] [--batch 64] [--repeat 15] [--ref 469c5d5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git_source(ref: str, name: str) -> str:
    return subprocess.run(
        ["git", "show", f"{ref}:src/cudist/{name}.py"], cwd=_ROOT, check=True, capture_output=True, text=True
    ).stdout


def _import_source(name: str, source: str, tmp: str):
    path = os.path.join(tmp, name + ".py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _load_revision(ref: str, tmp: str):
    """``data`` and ``_input_lib`` of git revision ``ref`` bound to each other, and that
    ``_input_lib`` bound to the working tree's ``cudist.data``."""
    old_data = _import_source("_before_data", _git_source(ref, "data"), tmp)
    input_src = _git_source(ref, "_input_lib")
    old_input = _import_source(
        "_before_input_lib", input_src.replace("from cudist import data as _data", "import _before_data as _data"), tmp
    )
    old_split = _import_source("_before_split_input_lib", input_src, tmp)
    return old_data, old_input, old_split


def _per_batch_us(make_iterable, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        k = 0
        for _ in make_iterable():
            k += 1
        times.append((time.perf_counter() - t0) / max(k, 1))
    return statistics.median(times[1:]) * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--ref", default="469c5d5")
    args = p.parse_args(argv)

    import cudist
    from cudist import _input_lib, data

    cpu = cudist.config.list_physical_devices("CPU")[0]
    cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * 2)
    strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.n, 2)).astype(np.float32)
    y = rng.integers(0, 10, args.n).astype(np.int32)
    b = args.batch

    pipelines = {
        "batch": lambda D: D.from_tensor_slices((x, y)).batch(b),
        "shuffle(n).batch": lambda D: D.from_tensor_slices((x, y)).shuffle(args.n, seed=1).batch(b),
        "batch.prefetch(AUTOTUNE)": lambda D: D.from_tensor_slices((x, y)).batch(b).prefetch(-1),
        "shuffle(1000).batch(drop)": lambda D: D.from_tensor_slices((x, y)).shuffle(1000, seed=1).batch(b, True),
        "repeat().batch.take": lambda D: D.from_tensor_slices((x, y)).repeat().batch(b).take(-(-args.n // b)),
        "from_tensors.repeat().batch.take": lambda D: D.from_tensors((x[0], y[0])).repeat().batch(b).take(
            -(-args.n // b)
        ),
        "range.shard(2,1).batch": lambda D: D.range(args.n).shard(2, 1).batch(b),
    }

    with tempfile.TemporaryDirectory() as tmp:
        before_data, before_input, before_split = _load_revision(args.ref, tmp)
        rows = []
        for name, make in pipelines.items():
            old = _per_batch_us(lambda: make(before_data.Dataset), args.repeat)
            new = _per_batch_us(lambda: make(data.Dataset), args.repeat)
            rows.append((name, old, new))
        for name in ("batch", "shuffle(n).batch"):
            make = pipelines[name]
            old = _per_batch_us(
                lambda: before_input.DistributedDataset(make(before_data.Dataset), strategy), args.repeat
            )
            new = _per_batch_us(lambda: strategy.experimental_distribute_dataset(make(data.Dataset)), args.repeat)
            rows.append((f"distribute({name}) 2 CPUs", old, new))
            old = _per_batch_us(lambda: before_split.DistributedDataset(make(data.Dataset), strategy), args.repeat)
            rows.append(("  same, old split (new data)", old, new))
        assert _input_lib is not before_input

    print(f"n={args.n} batch={args.batch} x:(n,2) float32, y:(n,) int32; median of {args.repeat} passes; "
          f"before = {args.ref}, after = working tree")
    print(f"{'pipeline':<36}{'before us/batch':>16}{'after us/batch':>16}{'speedup':>9}")
    for name, old, new in rows:
        print(f"{name:<36}{old:>16.1f}{new:>16.1f}{old / new:>8.1f}x")


if __name__ == "__main__":
    main()
