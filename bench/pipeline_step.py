"""A/B: the multi-worker optimizer step pipelined (``CUDIST_PIPELINE_UPDATE=on``) against unpipelined.

Run under the launcher: ``python -m cudist.launch -n 2 bench/pipeline_step.py [--mib 32] [--packs 8]``.
Each worker builds two ``MultiWorkerMirroredStrategy`` (pipeline on / off, the same
``bytes_per_pack``) and the same model (``--vars`` float32 variables, ``--mib`` MiB in all) with the
same optimizer, then times ``strategy.run(step)`` where the step is ``apply_gradients`` of fixed
per-replica gradients (the all-reduce and the update: what the pipeline changes), in interleaved
rounds (A then B, B then A, ...; the workers start each side together after a barrier). Rank 0
prints the median step time of each side and their ratio, per optimizer and replica count: ratios
from one run, not absolute claims. A third side, "user-reduced", is TF's
``experimental_aggregate_gradients=False`` pattern on the unpipelined strategy: the user's own
``all_reduce`` of the gradients, then an update-only ``apply_gradients`` (timed on its own too: the
part of the step a user's work placed between the two does not wait on).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import cudist
from cudist import _settings, optimizers


def main() -> None:
    from mpi4py import MPI

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=32.0, help="gradient MiB per replica (float32)")
    p.add_argument("--vars", type=int, default=16, help="variables")
    p.add_argument("--packs", type=int, default=8, help="packs (bytes_per_pack = total / packs)")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="local replicas per worker")
    p.add_argument("--optimizers", nargs="+", default=["sgd", "adam"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="steps per side per round")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    rank, W = world.Get_rank(), world.Get_size()
    n = int(args.mib * (1 << 20) / 4 / args.vars)
    per_pack = n * 4 * args.vars // args.packs
    cpu = cudist.config.list_physical_devices("CPU")[0]
    cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * max(args.replicas))
    makers = {"sgd": lambda: optimizers.SGD(0.01, momentum=0.9), "adam": lambda: optimizers.Adam(0.001)}
    rows = []
    for R in args.replicas:
        devices = [f"/cpu:{i}" for i in range(R)]
        opts = cudist.experimental.CommunicationOptions(bytes_per_pack=per_pack)
        with _settings.overridden(_settings.PIPELINE_UPDATE, "on"):
            on = cudist.MultiWorkerMirroredStrategy(communication_options=opts, devices=devices)
        off = cudist.MultiWorkerMirroredStrategy(communication_options=opts, devices=devices)
        rng = np.random.default_rng(rank)
        grads = [[(rng.standard_normal(n) * 1e-3).astype(np.float32) for _ in range(args.vars)] for _ in range(R)]
        for name in args.optimizers:
            sides = {}
            for label, s in (("pipelined", on), ("unpipelined", off)):
                with s.scope():
                    vs = [cudist.Variable(np.zeros(n, np.float32)) for _ in range(args.vars)]
                    opt = makers[name]()

                def step(vs=vs, opt=opt):
                    r = cudist.get_replica_context().replica_id_in_sync_group % R
                    opt.apply_gradients(zip(grads[r], vs))

                sides[label] = (s, step)
            with off.scope():
                vs_u = [cudist.Variable(np.zeros(n, np.float32)) for _ in range(args.vars)]
                opt_u = makers[name]()
            in_apply: list[float] = []

            def user_step(vs=vs_u, opt=opt_u):
                # experimental_aggregate_gradients=False: the user's own all-reduce, then an update-only apply
                ctx = cudist.get_replica_context()
                summed = ctx.all_reduce("sum", grads[ctx.replica_id_in_sync_group % R])
                t = time.perf_counter()
                opt.apply_gradients(zip(summed, vs), experimental_aggregate_gradients=False)
                in_apply.append(time.perf_counter() - t)

            sides["user-reduced"] = (off, user_step)
            times: dict[str, list[float]] = {k: [] for k in sides}
            for k in sides:  # warm-up: plans, slots, pools, the shared window
                for _ in range(2):
                    sides[k][0].run(sides[k][1])
            for rnd in range(args.rounds):
                order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
                for k in order:
                    s, step = sides[k]
                    world.Barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        s.run(step)
                    times[k].append((time.perf_counter() - t0) / args.steps)
            assert on.extended._cross_device_ops.pipelined_calls > 0  # private-read: the A side really pipelined
            mine = {k: statistics.median(v) for k, v in times.items()}
            mine["apply"] = statistics.median(in_apply) * R  # the R replicas' update-only calls, per step
            worst = world.allreduce(mine, op=_max_dict)
            rows.append((R, name, worst))
    if rank == 0:
        total = n * 4 * args.vars
        print(f"{W} workers, {args.vars} float32 variables, {total / (1 << 20):.1f} MiB per replica, "
              f"bytes_per_pack {per_pack} ({args.packs} packs), {args.rounds} interleaved rounds x {args.steps} steps; "
              "median step, slowest worker")
        print("| replicas/worker | optimizer | pipelined ms | unpipelined ms | pipelined / unpipelined "
              "| user-reduced ms (aggregate=False) | of which update-only apply ms |")
        print("|---|---|---|---|---|---|---|")
        for R, name, t in rows:
            a, b = t["pipelined"], t["unpipelined"]
            print(f"| {R} | {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.3f} | {t['user-reduced'] * 1e3:.2f} "
                  f"| {t['apply'] * 1e3:.2f} |")


def _max_dict(a, b, datatype=None):  # an MPI reduction op over {side: seconds} dicts (mpi4py's pickled op)
    return {k: max(a[k], b[k]) for k in a}


if __name__ == "__main__":
    main()
