"""Where the 2-worker MLP step of ``bench/step_compare.py --workers`` spends its time, per worker.

Runs the same step (the same model, data split and optimizer) as step_compare's ``cudist
MultiWorker`` and ``torch DDP gloo`` contestants, N processes each, and times its phases with
wall-clock and thread CPU time (``time.thread_time_ns``: the work a phase did, whatever else the
machine runs; with one BLAS thread per worker, the main thread does all of the worker's compute;
a wait's CPU time is its spinning, to subtract from the phases that contain it):

cudist: ``read`` (the variables' snapshots), ``fwd+bwd`` (NumPy), ``apply_gradients`` and inside it
``pack`` (the gradients into the pack), ``transport`` (the shared-memory all-reduce: ``copy in``,
``sum``, ``wait`` for the other workers, the rest being Python), ``update`` (the fused momentum
update); torch: ``fwd``, ``bwd`` (which includes DDP's gloo all-reduce, run by its reducer from
the autograd hooks: ``allreduce`` is timed around ``dist.all_reduce`` of the same bytes after the
rounds, as gloo does it) and ``step`` (the optimizer).

Usage::

    python bench/step_profile.py [--workers 2] [--steps 300] [--torch-python PATH]

Prints, per contestant, a table of per-step medians (us) for rank 0 and rank 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_compare as sc  # noqa: E402 - the bench directory's sibling

_now = time.perf_counter_ns
_cpu = time.thread_time_ns


class Phases:
    """Per phase, the wall and CPU nanoseconds of each step (accumulated within the step)."""

    def __init__(self):
        self.cur = defaultdict(lambda: [0, 0])
        self.steps = []

    def add(self, name, wall, cpu):
        c = self.cur[name]
        c[0] += wall
        c[1] += cpu

    def wrap(self, name, fn):
        def timed(*a, **k):
            t0, c0 = _now(), _cpu()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, _now() - t0, _cpu() - c0)

        return timed

    def end_step(self):
        self.steps.append({k: tuple(v) for k, v in self.cur.items()})
        self.cur.clear()

    def medians(self):
        names = list(dict.fromkeys(k for s in self.steps for k in s))
        return {n: (statistics.median(s.get(n, (0, 0))[0] for s in self.steps) / 1e3,
                    statistics.median(s.get(n, (0, 0))[1] for s in self.steps) / 1e3) for n in names}


def cudist_worker(args):
    if args.src:  # another source tree (its built _core inside): ahead of this venv's editable install
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
        sys.path.insert(0, args.src)
    import cudist
    import cudist.optimizers as optimizers
    from cudist._collective_ops import CollectiveAllReduce
    from cudist._dataplane import update as update_mod
    from cudist._dataplane.transports import shm
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    d = np.load(args.data)
    params = [d[f"p{i}"] for i in range(2 * (len(sc.LAYERS) - 1))]
    x, y = sc.shards(world, d["x"], d["y"])[rank]
    strategy = cudist.MultiWorkerMirroredStrategy(
        communication_options=cudist.experimental.CommunicationOptions(bytes_per_pack=args.bytes_per_pack))
    with strategy.scope():
        vs = [cudist.Variable(p.copy()) for p in params]
        opt = optimizers.SGD(learning_rate=sc.LR, momentum=sc.MOMENTUM)
    data = strategy.experimental_distribute_values_from_function(lambda c: (x, y))
    scale = 1.0 / len(d["x"])
    if args.native_threads:
        from cudist._kernels import _native

        _native.set_num_threads(args.native_threads)
    ph = Phases()
    # The phases, wrapped where they are (the class attributes: every instance's calls).
    CollectiveAllReduce._host_allreduce = ph.wrap("transport", CollectiveAllReduce._host_allreduce)
    CollectiveAllReduce._global_sums = ph.wrap("reduce (pack+transport)", CollectiveAllReduce._global_sums)
    update_mod.UpdatePass.apply = ph.wrap("update", update_mod.UpdatePass.apply)
    t = strategy.extended.host_transport
    if t is not None:
        # A wait: from the first poll that finds a flag down to the poll that finds them all up
        # (perf_counter only: the polls are too many for a CPU-time syscall each).
        def waited(fn):
            since = [0, 0]

            def poll(*a):
                up = fn(*a)
                if not up and not since[0]:
                    since[:] = _now(), _cpu()
                elif up and since[0]:
                    ph.add("  wait (others)", _now() - since[0], _cpu() - since[1])
                    since[0] = 0
                return up

            return poll

        t._all_up = waited(t._all_up)
        t._leader_done = waited(t._leader_done)
        real = t._kernels_for

        class Timed:
            def __init__(self, k):
                self.k = k
                self.trusted = self

            def reduce_to_one(self, *a, **kw):
                return ph.wrap("  sum", self.k.trusted.reduce_to_one)(*a, **kw)

        t._kernels_for = lambda dt: Timed(real(dt))
        real_copyto = np.copyto
        proxy = types.ModuleType("numpy")
        proxy.__dict__.update(np.__dict__)
        proxy.copyto = ph.wrap("  copy in", real_copyto)
        shm.np = proxy
    grads_fn = ph.wrap("fwd+bwd", sc.mlp_grads)
    apply = ph.wrap("apply_gradients", opt.apply_gradients)
    read = ph.wrap("read", lambda: [v.read_value() for v in vs])

    fixed = sc.mlp_grads(params, x, y, scale) if args.no_compute else None

    def replica_step(xy):
        xx, yy = xy
        grads, loss = fixed if fixed is not None else grads_fn(read(), xx, yy, scale)
        apply(zip(grads, vs))
        return loss

    run = ph.wrap("step", strategy.run)
    for i in range(args.steps + args.warmup):
        run(replica_step, args=(data,))
        if i < args.warmup:
            ph.cur.clear()
        else:
            ph.end_step()
    rows = comm.gather(ph.medians(), root=0)
    info = {"cudist": os.path.dirname(cudist.__file__), "transport": strategy.extended.host_communication,
            "threads": os.environ.get("OPENBLAS_NUM_THREADS"), "native_threads": _native_threads()}
    if rank == 0:
        print(json.dumps({"cudist": rows, "info": info}), flush=True)


def _native_threads():
    try:
        from cudist._kernels import _native

        return _native.num_threads()
    except Exception:  # noqa: BLE001
        return None


def torch_worker(args):
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world = args.rank, args.world
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    d = np.load(args.data)
    params = [d[f"p{i}"] for i in range(2 * (len(sc.LAYERS) - 1))]
    layers = []
    for i, (fi, fo) in enumerate(zip(sc.LAYERS[:-1], sc.LAYERS[1:])):
        lin = torch.nn.Linear(fi, fo)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(params[2 * i].T.copy()))
            lin.bias.copy_(torch.from_numpy(params[2 * i + 1]))
        layers += [lin, torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=sc.LR, momentum=sc.MOMENTUM)
    x, y = sc.shards(world, d["x"], d["y"])[rank]
    x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
    scale = world / len(d["x"])
    ph = Phases()
    for i in range(args.steps + args.warmup):
        t0, c0 = _now(), _cpu()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y, reduction="sum") * scale
        t1, c1 = _now(), _cpu()
        loss.backward()
        t2, c2 = _now(), _cpu()
        opt.step()
        t3, c3 = _now(), _cpu()
        ph.add("fwd", t1 - t0, c1 - c0)
        ph.add("bwd (+ DDP all-reduce)", t2 - t1, c2 - c1)
        ph.add("step (update)", t3 - t2, c3 - c2)
        ph.add("step", t3 - t0, c3 - c0)
        if i < args.warmup:
            ph.cur.clear()
        else:
            ph.end_step()
    # gloo's all-reduce of the gradients' bytes alone, and the compute alone (no DDP hooks)
    alone = Phases()
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    plain = model.module
    for i in range(args.steps // 2 + args.warmup):
        dist.barrier()
        t0, c0 = _now(), _cpu()
        dist.all_reduce(flat)
        t1, c1 = _now(), _cpu()
        loss = F.cross_entropy(plain(x), y, reduction="sum") * scale
        loss.backward()
        alone.add("gloo all_reduce (alone)", t1 - t0, c1 - c0)
        alone.add("fwd+bwd (no DDP)", _now() - t1, _cpu() - c1)
        for p in plain.parameters():
            p.grad = None
        if i < args.warmup:
            alone.cur.clear()
        else:
            alone.end_step()
    out = [None] * world
    dist.all_gather_object(out, {**ph.medians(), **alone.medians()})
    if rank == 0:
        print(json.dumps({"torch": out, "info": {"threads": torch.get_num_threads(), "version": torch.__version__}}),
              flush=True)
    dist.destroy_process_group()


def _table(title, rows, info):
    print(f"\n## {title}  {info}")
    names = list(dict.fromkeys(k for r in rows for k in r))
    print(f"{'phase':<28}" + "".join(f"{f'rank{r} wall':>12}{f'rank{r} cpu':>12}" for r in range(len(rows))))
    for n in names:
        print(f"{n:<28}" + "".join(f"{r.get(n, (0, 0))[0]:>12.0f}{r.get(n, (0, 0))[1]:>12.0f}" for r in rows))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--bytes-per-pack", type=int, default=0)
    p.add_argument("--torch-python", default=None)
    p.add_argument("--native-threads", type=int, default=0, help="cudist's kernel pool threads per worker (0: default)")
    p.add_argument("--no-compute", action="store_true",
                   help="cudist: the same gradients every step (no forward/backward): the step's own overhead")
    p.add_argument("--src", default="", help="cudist: import cudist from this source tree (A/B of two trees)")
    p.add_argument("--only", choices=("cudist", "torch"), default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker == "cudist":
        return cudist_worker(a)
    if a.worker == "torch":
        return torch_worker(a)
    params, x, y = sc.make_problem(0, 256)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "problem.npz")
        np.savez(data, x=x, y=y, **{f"p{i}": q for i, q in enumerate(params)})
        common = ["--data", data, "--steps", str(a.steps), "--warmup", str(a.warmup), "--world", str(a.workers),
                  "--bytes-per-pack", str(a.bytes_per_pack),
                  "--native-threads", str(a.native_threads),
                  *(["--no-compute"] if a.no_compute else []), "--src", a.src]
        here = os.path.abspath(__file__)
        if a.only in (None, "cudist"):
            # mpiexec itself, with the launcher's environment (cores / N threads each): the launcher's
            # bootstrap would import this venv's cudist before --src could pick another tree.
            from cudist import launch

            out = subprocess.run([launch.find_mpiexec(), "-n", str(a.workers), sys.executable, here,
                                  "--worker", "cudist", *common], capture_output=True, text=True, check=False,
                                 env=launch.worker_env(a.workers))
            msg = next((json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")), None)
            if msg is None:
                print(out.stdout[-2000:], out.stderr[-3000:])
            else:
                _table("cudist MultiWorkerMirroredStrategy", msg["cudist"], msg["info"])
        if a.torch_python and a.only in (None, "torch"):
            port = sc._free_port()
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(here), "..", "src")]),
                       GLOO_SOCKET_IFNAME="lo")
            procs = [subprocess.Popen([a.torch_python, here, "--worker", "torch", "--rank", str(r), "--port", str(port),
                                       *common], stdout=subprocess.PIPE, text=True, env=env)
                     for r in range(a.workers)]
            outs = [pr.communicate()[0] for pr in procs]
            msg = next((json.loads(ln) for ln in outs[0].splitlines() if ln.startswith("{")), None)
            if msg is not None:
                _table("torch DDP gloo", msg["torch"], msg["info"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
