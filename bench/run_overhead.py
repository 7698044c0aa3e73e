"""Fixed cost of ``strategy.run`` on 2 replicas, cudist vs TensorFlow (the Strategy API issue's benchmark).

A thin front-end to ``cudist-bench run-overhead`` (the one implementation): a no-op ``run`` and a
``run`` doing one scalar ``all_reduce``, MirroredStrategy on 2 logical CPUs and OneDeviceStrategy,
with TensorFlow's eager and ``tf.function`` timings from the same run when a TensorFlow interpreter is
given (``--tf-python``, or ``CUDIST_BENCH_TF_PYTHON``, default ``/tmp/tfvenv/bin/python`` if present).

Usage: python bench/run_overhead.py [--replicas 2] [-n 2000] [--tf-python PATH] [--no-tf]
"""

from __future__ import annotations

import argparse
import os
import sys

from cudist import _settings
from cudist.bench import main as bench_main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=2000)
    p.add_argument("--tf-python", default=_settings.bench_tf_python() or "/tmp/tfvenv/bin/python")
    p.add_argument("--no-tf", action="store_true", help="skip the TensorFlow comparison")
    a = p.parse_args(argv)
    args = ["run-overhead", "--replicas", str(a.replicas), "-n", str(a.iters), "-w", str(max(1, a.iters // 10))]
    if not a.no_tf and os.path.exists(a.tf_python):
        args += ["--compare", "tf", "--tf-mode", "both", "--tf-python", a.tf_python]
    return bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
