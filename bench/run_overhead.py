"""Fixed cost of ``strategy.run``: cudist vs TensorFlow eager, on 2 logical CPUs.

Measures the median time of (a) a no-op ``run`` on 2 replicas and (b) a ``run`` whose function does
one scalar ``all_reduce``; OneDeviceStrategy no-op for reference. The TensorFlow part runs in a
subprocess with the interpreter of ``--tf-python`` (default ``/tmp/tfvenv/bin/python``) if it exists;
TensorFlow is never imported into cudist's own process.

Usage: python bench/run_overhead.py [--repeat 2000] [--tf-python PATH] [--no-tf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_TF_SNIPPET = r"""
import json, os, statistics, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
repeat = int(sys.argv[1])
ms = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
od = tf.distribute.OneDeviceStrategy("/cpu:0")
def noop():
    return None
def one_all_reduce():
    return tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))
def med(f, n):
    for _ in range(min(50, n)):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6
print(json.dumps({
    "mirrored2_noop_us": med(lambda: ms.run(noop), repeat),
    "mirrored2_all_reduce_us": med(lambda: ms.run(one_all_reduce), max(repeat // 4, 20)),
    "one_device_noop_us": med(lambda: od.run(noop), repeat),
}))
"""


def _median_us(f, n):
    for _ in range(min(200, n)):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def bench_cudist(repeat):
    import cudist
    from cudist import config

    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 2)
    ms = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
    od = cudist.OneDeviceStrategy("/cpu:0")

    def noop():
        return None

    def one_all_reduce():
        return cudist.get_replica_context().all_reduce("sum", 1.0)

    return {
        "mirrored2_noop_us": _median_us(lambda: ms.run(noop), repeat),
        "mirrored2_all_reduce_us": _median_us(lambda: ms.run(one_all_reduce), repeat),
        "one_device_noop_us": _median_us(lambda: od.run(noop), repeat),
    }


def bench_tf(python, repeat):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([python, "-c", _TF_SNIPPET, str(repeat)], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"TensorFlow benchmark failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--tf-python", default="/tmp/tfvenv/bin/python")
    p.add_argument("--no-tf", action="store_true")
    a = p.parse_args(argv)
    rows = {"cudist": bench_cudist(a.repeat)}
    if not a.no_tf and os.path.exists(a.tf_python):
        rows["tensorflow"] = bench_tf(a.tf_python, min(a.repeat, 500))
    keys = ["mirrored2_noop_us", "mirrored2_all_reduce_us", "one_device_noop_us"]
    print(f"{'median us per run':<26}" + "".join(f"{k:>14}" for k in rows))
    for k in keys:
        line = f"{k:<26}" + "".join(f"{rows[r][k]:>14.1f}" for r in rows)
        if "tensorflow" in rows:
            line += f"   ({rows['tensorflow'][k] / rows['cudist'][k]:.0f}x faster)"
        print(line)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
