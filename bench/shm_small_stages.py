"""The 4 KiB all-reduce of ``MultiWorkerMirroredStrategy`` over shared memory, stage by stage (issue #30).

Run under the launcher with one worker per process, e.g.::

    python -m cudist.launch -n 2 bench/shm_small_stages.py --bytes 4096 --rounds 10 --calls 100

Each stage is timed from its own entry point, so each row includes the rows below it: raw mpi4py
``Allreduce`` (the yardstick), the extension's per-step one-round call alone on the transport's window
(copy in, hash, flags, wait, worker-order sum), the transport's ``allreduce_one`` (+ the
communicator's numbering and deadline frame, the result's allocation), its general ``allreduce``
(+ the path walk over pairs), the cross-device ops (+ op and dtype dispatch), ``strategy.run`` of a
function that all-reduces (+ run and the replica context), and ``strategy.run`` of a function that
does nothing (run alone). Rounds interleave the stages; each call starts after a barrier; the
figure is the median over calls of the slowest worker's time. Uses private attributes: a bench, not
an example.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import cudist
from cudist import _core
from cudist._reduce_util import ReduceOp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=100, help="calls per stage and round")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    strategy = cudist.MultiWorkerMirroredStrategy()
    tr = strategy.extended.host_transport
    cdo = strategy.extended._cross_device_ops
    x = np.full(args.bytes // 4, rank + 1, np.float32)
    recv = np.empty_like(x)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: x)

    def step(v):
        return cudist.get_replica_context().all_reduce("sum", v)

    def one_round():  # the extension's per-step call alone, numbered as the transport numbers its calls
        tr._count += 1
        out = tr._one(tr._count, x, "all_reduce SUM", 1)
        if out.__class__ is tuple:  # a wait past the call's spin (a loaded machine): finished here
            while _core.shm_wait(*tr._window, tr._count, 10**9) == 1:
                pass
            _core.shm_sum(*tr._window, tr._count, ((out[1], out[1]),))

    stages = {
        "raw mpi4py Allreduce": lambda: comm.Allreduce(x, recv, MPI.SUM),
        "C++ one round alone": one_round,
        "transport.allreduce_one": lambda: tr.allreduce_one(x, "all_reduce SUM", "d"),
        "transport.allreduce": lambda: tr.allreduce(((x, recv),), "all_reduce SUM", "d"),
        "cross-device ops": lambda: cdo._all_reduce_arrays(ReduceOp.SUM, [x]),
        "strategy.run(all_reduce)": lambda: strategy.run(step, args=(values,)),
        "strategy.run(identity)": lambda: strategy.run(lambda v: v, args=(values,)),
    }
    for f in stages.values():
        for _ in range(args.calls):
            f()
    times = {k: [] for k in stages}
    pc = time.perf_counter
    for _ in range(args.rounds):
        for k, f in stages.items():
            for _ in range(args.calls):
                comm.Barrier()
                t = pc()
                f()
                times[k].append(pc() - t)
    if rank == 0:
        print(f"# {comm.Get_size()} workers, {args.bytes} B float32 SUM, {tr!r}; {args.rounds} interleaved rounds x "
              f"{args.calls} calls; median of the slowest worker per call", flush=True)
    for k, v in times.items():
        a = np.array(v)
        slowest = np.empty_like(a)
        comm.Allreduce(a, slowest, MPI.MAX)
        if rank == 0:
            print(f"  {k:28s} {np.median(slowest) * 1e6:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
