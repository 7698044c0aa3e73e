"""A data-parallel training step, cudist against its peers, each in its own interpreter.

The step: an MLP 784-512-512-10 (ReLU), softmax cross-entropy on integer labels, global batch 256
split evenly over the replicas, SGD with momentum 0.9 and learning rate 0.01 (Keras's formulation,
the same trajectory as torch's). Every contestant starts from the same weights and data (written by
the driver to one ``.npz``) and times whole steps: forward, backward, the gradient all-reduce and
the update.

Contestants (each a subprocess that stays up and takes its turn in every round):

* ``cudist MirroredStrategy`` (N replicas): a custom loop, ``strategy.run(step)`` where each replica
  computes its gradients with NumPy and calls ``cudist.optimizers.SGD.apply_gradients`` (the
  optimizer sums the replicas' gradients, each scaled by 1/global batch);
* ``cudist OneDeviceStrategy``: the same step on the whole batch, one replica;
* ``tf MirroredStrategy`` (N logical CPUs): a custom loop with ``tf.GradientTape`` inside
  ``strategy.run`` inside ``tf.function``, ``tf.nn.compute_average_loss`` and Keras's SGD
  (``--tf-python``, default ``$CUDIST_BENCH_TF_PYTHON``);
* ``torch DDP`` (N processes, gloo on 127.0.0.1) and plain single-process ``torch``
  (``--torch-python``, default ``$CUDIST_BENCH_TORCH_PYTHON``). DDP ranks use cores/N threads each
  (``--torch-threads`` to override), the single process all cores;
* ``cudist MultiWorker`` (``--workers``; N processes of ``cudist.MultiWorkerMirroredStrategy``
  started by ``python -m cudist.launch -n N``, one CPU replica and cores/N threads each, the
  gradients summed over MPI): the same step as torch DDP's process layout.

First every contestant runs ``--settle`` untimed steps (default 300: a training loop's steady state,
after first-call compiles and after cudist's ``auto`` replica mode has measured greenlets against
threads, which takes it ~50 steps). Round k: every contestant in turn, after a ``--gap-ms`` pause,
runs ``--warmup`` untimed steps (default 20: steps run slow for ~10 steps after the pause) then
``--steps`` timed ones (default 20; alternating the order from round to round). Reported: the
median step time of each contestant over all its timed steps, and per round the ratio of each
peer's median to cudist MirroredStrategy's (median and spread over the rounds). Correctness: before the rounds, each
contestant's first three steps report their global loss, compared with a float64 NumPy reference
(``#wrong`` = steps off by more than 1e-4 relative).

Usage (our venv's python)::

    python bench/step_compare.py [--replicas 1,2,4] [--rounds 5] [--steps 20] [--warmup 20] [--settle 300]
        [--tf-python PATH] [--torch-python PATH] [--no-peers] [--workers] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

LAYERS = (784, 512, 512, 10)
LR, MOMENTUM = 0.01, 0.9
CHECK_STEPS = 3
LOSS_RTOL = 1e-4


# ------------------------------------------------------------------------------------------ the model
def make_problem(seed: int, batch: int):
    """Initial weights (Glorot uniform, zero biases) and one batch of data, float32."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(LAYERS[:-1], LAYERS[1:]):
        lim = np.sqrt(6.0 / (fan_in + fan_out))
        params += [rng.uniform(-lim, lim, (fan_in, fan_out)).astype(np.float32), np.zeros(fan_out, np.float32)]
    x = rng.standard_normal((batch, LAYERS[0])).astype(np.float32)
    y = rng.integers(0, LAYERS[-1], batch).astype(np.int64)
    return params, x, y


def mlp_grads(params, x, y, scale):
    """Forward and backward in NumPy; loss = scale * sum of the examples' cross-entropies.

    Returns (gradients, loss) with gradients in the params' dtype (new arrays).
    """
    w1, b1, w2, b2, w3, b3 = params
    z1 = x @ w1
    z1 += b1
    h1 = np.maximum(z1, 0)
    z2 = h1 @ w2
    z2 += b2
    h2 = np.maximum(z2, 0)
    logits = h2 @ w3
    logits += b3
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    se = e.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(scale * np.sum(np.log(se[:, 0]) + m[:, 0] - logits[rows, y]))
    d = e / se
    d[rows, y] -= 1
    d *= d.dtype.type(scale)
    gw3 = h2.T @ d
    gb3 = d.sum(axis=0)
    dh = d @ w3.T
    dh *= z2 > 0
    gw2 = h1.T @ dh
    gb2 = dh.sum(axis=0)
    dh = dh @ w2.T
    dh *= z1 > 0
    gw1 = x.T @ dh
    gb1 = dh.sum(axis=0)
    return [gw1, gb1, gw2, gb2, gw3, gb3], loss


def reference_losses(params, x, y, steps=CHECK_STEPS):
    """Global losses of the first ``steps`` steps, full batch, float64 (the check's reference)."""
    p = [a.astype(np.float64) for a in params]
    v = [np.zeros_like(a) for a in p]
    x = x.astype(np.float64)
    out = []
    for _ in range(steps):
        gs, loss = mlp_grads(p, x, y, 1.0 / len(y))
        out.append(loss)
        for a, vel, g in zip(p, v, gs):
            vel *= MOMENTUM
            vel -= LR * g
            a += vel
    return out


def shards(n, x, y):
    """The ceil rule of cudist / tf.distribute: replica i gets rows [i*per, (i+1)*per)."""
    per = -(-len(x) // n)
    return [(x[i * per : (i + 1) * per], y[i * per : (i + 1) * per]) for i in range(n)]


# ------------------------------------------------------------------------------------------ workers
class _Worker:
    """Subclasses build a step (``self.step()`` returns the step's global loss when ``want_loss``)."""

    framework = version = ""

    def __init__(self, args):
        d = np.load(args.data)
        self.params = [d[f"p{i}"] for i in range(2 * (len(LAYERS) - 1))]
        self.x, self.y = d["x"], d["y"]
        self.n = args.replicas
        self.args = args

    def serve(self, read, write):
        losses = [self.step(True) for _ in range(CHECK_STEPS)]
        write({"version": self.version, "framework": self.framework, "python": sys.executable,
               "threads": self.threads(), "check_losses": losses})
        while True:
            cmd = read()
            if cmd is None or cmd.get("cmd") == "quit":
                return
            if cmd.get("cmd") == "digest":
                write({"digest": self.digest()})
                continue
            for _ in range(cmd["warmup"]):
                self.step(False)
            samples = []
            for _ in range(cmd["steps"]):
                t0 = time.perf_counter_ns()
                self.step(False)
                samples.append(time.perf_counter_ns() - t0)
            write({"samples": samples})

    def threads(self):
        return None

    def digest(self):
        """A hash of the weights' bits now (None: not reported by this contestant)."""
        return None


class CudistWorker(_Worker):
    framework = "cudist"

    def __init__(self, args, one_device=False):
        super().__init__(args)
        import cudist
        from cudist import config

        self.version = cudist.__version__
        if one_device:
            strategy = cudist.OneDeviceStrategy("/cpu:0")
            n = 1
        else:
            n = self.n
            if len(config.list_logical_devices("CPU")) < n:
                cpu = config.list_physical_devices("CPU")[0]
                config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * n)
            strategy = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        parts = shards(n, self.x, self.y)
        self.step = self._build_step(strategy, lambda c: parts[c.replica_id_in_sync_group])

    def _build_step(self, strategy, part_fn):
        """The custom loop: each replica reads the variables (zero-copy snapshots), computes its
        gradients with NumPy and applies them; the step's loss is summed over every replica."""
        import cudist
        import cudist.optimizers as optimizers

        with strategy.scope():
            vs = [cudist.Variable(p.copy()) for p in self.params]
            opt = optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
        self._vars = (strategy, vs)
        data = strategy.experimental_distribute_values_from_function(part_fn)
        scale = 1.0 / len(self.x)

        def replica_step(xy):
            x, y = xy
            grads, loss = mlp_grads([v.read_value() for v in vs], x, y, scale)
            opt.apply_gradients(zip(grads, vs))
            return loss

        def step(want_loss):
            out = strategy.run(replica_step, args=(data,))
            if want_loss:
                return float(strategy.reduce("sum", out, axis=None))
            return None

        return step

    def digest(self):
        # Every replica's copy: the determinism contract says the bits do not depend on the replica
        # execution mode (greenlets, threads, auto) or the load; runs compare these.
        import hashlib

        strategy, vs = self._vars
        h = hashlib.sha256()
        for v in vs:
            for c in strategy.experimental_local_results(v):
                h.update(np.ascontiguousarray(np.asarray(c)).tobytes())
        return h.hexdigest()[:16]


class CudistMultiWorker(CudistWorker):
    """One worker of ``cudist.MultiWorkerMirroredStrategy`` over MPI (N processes started by
    ``python -m cudist.launch -n N``, one CPU replica each; rank 0 talks to the driver)."""

    def __init__(self, args):
        _Worker.__init__(self, args)
        import cudist
        from mpi4py import MPI

        self.version = cudist.__version__
        self.comm = MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        part = shards(self.world, self.x, self.y)[self.rank]
        self.step = self._build_step(cudist.MultiWorkerMirroredStrategy(), lambda c: part)

    def threads(self):
        return {"ranks": self.world, "intra": os.environ.get("OPENBLAS_NUM_THREADS", "?")}

    def serve(self, read, write):
        comm = self.comm

        def shared_read():
            # A blocking MPI_Bcast busy-polls: the ranks waiting for rank 0's next command would
            # spin on the cores the other contestants are timed on. Poll with sleeps instead, long
            # ones: every wake-up preempts a contestant's thread (the turns start 1 s apart anyway).
            head = np.zeros(1, np.int64)
            if self.rank == 0:
                body = np.frombuffer(json.dumps(read()).encode(), np.uint8)
                head[0] = body.size
            req = comm.Ibcast(head, root=0)
            while not req.Test():
                time.sleep(0.02)
            if self.rank != 0:
                body = np.empty(int(head[0]), np.uint8)
            comm.Bcast(body, root=0)  # the command itself: rank 0 has sent it already
            return json.loads(body.tobytes())

        return super().serve(shared_read, write if self.rank == 0 else (lambda msg: None))


class TFWorker(_Worker):
    framework = "tensorflow"

    def __init__(self, args):
        super().__init__(args)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import keras
        import tensorflow as tf

        self.version = tf.__version__
        self.tf = tf
        n = self.n
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with strategy.scope():
            vs = [tf.Variable(p) for p in self.params]
            opt = keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
            opt.build(vs)
        parts = shards(n, self.x, self.y)
        data = strategy.experimental_distribute_values_from_function(
            lambda ctx: (tf.constant(parts[ctx.replica_id_in_sync_group][0]),
                         tf.constant(parts[ctx.replica_id_in_sync_group][1]))
        )
        global_batch = len(self.x)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.matmul(x, vs[0]) + vs[1])
                h = tf.nn.relu(tf.matmul(h, vs[2]) + vs[3])
                logits = tf.matmul(h, vs[4]) + vs[5]
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, vs)
            opt.apply_gradients(zip(grads, vs))
            return loss

        @tf.function
        def train_step(batch):
            return strategy.run(replica_step, args=batch)

        def step(want_loss):
            out = train_step(data)
            if want_loss:
                return float(sum(float(v) for v in strategy.experimental_local_results(out)))
            return None

        self.step = step

    def threads(self):
        return {"intra": self.tf.config.threading.get_intra_op_parallelism_threads() or "auto",
                "inter": self.tf.config.threading.get_inter_op_parallelism_threads() or "auto"}


class TorchWorker(_Worker):
    """Plain torch (kind "torch": one process, no process group) or one rank of DDP over gloo on 127.0.0.1
    (kind "torch-ddp", N processes; rank 0 talks to the driver)."""

    framework = "torch"

    def __init__(self, args):
        super().__init__(args)
        import torch
        import torch.nn.functional as F

        self.torch = torch
        self.version = torch.__version__
        self.rank, self.world = args.rank, args.world
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        layers = []
        for i, (fi, fo) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
            lin = torch.nn.Linear(fi, fo)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(self.params[2 * i].T.copy()))
                lin.bias.copy_(torch.from_numpy(self.params[2 * i + 1]))
            layers += [lin, torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers[:-1])
        self.dist = None
        if args.worker == "torch-ddp":  # DDP even on one rank: the same code path as the user's N-rank run
            import datetime

            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=self.rank,
                                    world_size=self.world, timeout=datetime.timedelta(hours=3))
            model = torch.nn.parallel.DistributedDataParallel(model)
            self.dist = dist
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        x, y = shards(self.world, self.x, self.y)[self.rank]
        x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
        # DDP averages the ranks' gradients: scaling the local sum by world/global makes that average
        # the gradient of the global mean loss, for any split.
        scale = self.world / len(self.x)

        def step(want_loss):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y, reduction="sum") * scale
            loss.backward()
            opt.step()
            if want_loss:
                t = loss.detach() / self.world
                if self.dist is not None:
                    self.dist.all_reduce(t)
                return float(t)
            return None

        self.step = step

    def threads(self):
        return {"intra": self.torch.get_num_threads(), "ranks": self.world}

    def serve(self, read, write):
        if self.dist is None or self.world == 1:
            try:
                return super().serve(read, write)
            finally:
                if self.dist is not None:
                    self.dist.destroy_process_group()
        # Rank 0 talks to the driver and hands each command to the other ranks.
        dist = self.dist

        def shared_read():
            box = [read() if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        try:
            return super().serve(shared_read, write if self.rank == 0 else (lambda msg: None))
        finally:
            dist.destroy_process_group()


def worker_main(args):
    # Answers go to the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def read():
        line = sys.stdin.readline()
        return json.loads(line) if line.strip() else None

    def write(msg):
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        kind = args.worker
        if kind == "cudist-mirrored":
            w = CudistWorker(args)
        elif kind == "cudist-one-device":
            w = CudistWorker(args, one_device=True)
        elif kind == "cudist-multi-worker":
            w = CudistMultiWorker(args)
        elif kind == "tf-mirrored":
            w = TFWorker(args)
        elif kind in ("torch-ddp", "torch"):
            w = TorchWorker(args)
        else:
            raise SystemExit(f"unknown worker {kind}")
        w.serve(read, write)
    except Exception as e:  # noqa: BLE001 - the driver prints it and skips the contestant
        write({"error": f"{type(e).__name__}: {e}"})
        raise


# ------------------------------------------------------------------------------------------ driver
class Contestant:
    """A worker subprocess (or, for DDP, N of them: rank 0 answers) taking turns in the rounds."""

    def __init__(self, label, key, python, kind, args, replicas, *, world=1, env=None):
        self.label, self.key, self.kind = label, key, kind
        self.samples: list[int] = []
        self.round_medians: list[float] = []
        self.procs = []
        self.errs = []
        self.hello = None
        here = os.path.abspath(__file__)
        port = _free_port() if kind == "torch-ddp" else 0
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore", GLOO_SOCKET_IFNAME="lo",
                   MASTER_ADDR="127.0.0.1", **(env or {}))
        threads = args.torch_threads if args.torch_threads else (
            max(1, (os.cpu_count() or 1) // world) if kind == "torch-ddp" else 0)
        for rank in range(1 if kind == "cudist-multi-worker" else world):
            err = tempfile.TemporaryFile(mode="w+")
            cmd = [python, here, "--worker", kind, "--replicas", str(replicas), "--data", args.data_file,
                   "--rank", str(rank), "--world", str(world), "--port", str(port), "--torch-threads", str(threads)]
            if kind == "cudist-multi-worker":  # mpiexec passes stdin to rank 0; cores / N threads each
                cmd = [python, "-m", "cudist.launch", "-n", str(world), "--no-prefix", *cmd[1:]]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=err, text=True,
                                 env=env, bufsize=1)
            self.procs.append(p)
            self.errs.append(err)

    def _read(self):
        p = self.procs[0]
        while True:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"exited ({p.wait()}): {self.tail()}")
            if line.startswith("{"):
                msg = json.loads(line)
                if "error" in msg:
                    raise RuntimeError(f"{msg['error']} | {self.tail()}")
                return msg

    def tail(self):
        out = []
        for e in self.errs:
            try:
                e.seek(0)
                out += [ln for ln in e.read().strip().splitlines() if ln.strip()][-2:]
            except (OSError, ValueError):
                pass
        return " | ".join(out[-3:])

    def start(self):
        self.hello = self._read()
        return self.hello

    def round(self, warmup, steps, record=True):
        p = self.procs[0]
        p.stdin.write(json.dumps({"cmd": "round", "warmup": warmup, "steps": steps}) + "\n")
        p.stdin.flush()
        s = self._read()["samples"]
        if record:
            self.samples += s
            self.round_medians.append(statistics.median(s))

    def digest(self):
        """The contestant's weights hash now (None if it reports none)."""
        p = self.procs[0]
        p.stdin.write(json.dumps({"cmd": "digest"}) + "\n")
        p.stdin.flush()
        return self._read().get("digest")

    def close(self):
        try:
            if self.procs and self.procs[0].poll() is None:
                self.procs[0].stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.procs[0].stdin.flush()
        except (OSError, ValueError):
            pass
        for i, p in enumerate(self.procs):
            # Rank 0 gets a minute to finish; the other ranks follow it within seconds, unless it
            # failed (then they would wait in the process group for hours).
            failed = self.procs[0].poll() not in (None, 0)
            try:
                p.wait(timeout=60 if i == 0 else (1 if failed else 20))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    try:
                        f.close()
                    except (OSError, ValueError):
                        pass
        for e in self.errs:
            e.close()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python_has(python, module):
    if not python:
        return False, "not given"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return False, f"{python} is not an executable file"
    try:
        r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"`import {module}` failed under {python}: {tail}"
    return True, ""


def _fmt_ms(ns):
    return f"{ns / 1e6:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="1,2,4", help="comma list of replica counts (default 1,2,4)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contestant per round (default 20)")
    # After the pause between turns a step runs slow for a while (the 2-replica MLP step on threads:
    # 7-10 ms for the first one and some 7 ms ones among the next ~10, against 4.2 ms steady), so a
    # turn warms up longer than that before it is timed: what a training loop's steps see.
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed steps per contestant per round, after the pause before its turn (default 20)")
    p.add_argument("--settle", type=int, default=300,
                   help="untimed steps each contestant runs once before the first round: the steady state of a "
                        "training loop (default 300)")
    p.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--seed", type=int, default=0)
    from cudist import _settings  # every CUDIST_* variable is read there

    p.add_argument("--tf-python", default=_settings.bench_tf_python(),
                   help="python with TensorFlow (default $CUDIST_BENCH_TF_PYTHON)")
    p.add_argument("--torch-python", default=_settings.bench_torch_python(),
                   help="python with torch (default $CUDIST_BENCH_TORCH_PYTHON)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch threads per DDP rank (default cores / ranks; the single process keeps all cores)")
    p.add_argument("--gap-ms", type=float, default=1000.0,
                   help="pause before each contestant's turn, so the threads of the one before stop spinning "
                        "(default 1000)")
    p.add_argument("--no-peers", action="store_true", help="cudist only (MirroredStrategy and OneDeviceStrategy)")
    p.add_argument("--workers", action="store_true",
                   help="also cudist.MultiWorkerMirroredStrategy with N processes of one CPU replica each "
                        "(python -m cudist.launch; needs cudist[mpi]), next to torch DDP's N processes")
    p.add_argument("--workers-check-off", action="store_true",
                   help="with --workers: also the multi-worker step with its default collective check off "
                        "(CUDIST_CHECK_COLLECTIVES=0), and the per-round ratio of the two (the check's cost)")
    p.add_argument("--json", default=None, help="write every result as JSON to this file")
    # worker mode (internal)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        a.replicas = int(a.replicas)
        worker_main(a)
        return 0
    try:
        reps = [int(t) for t in a.replicas.split(",") if t.strip()]
    except ValueError:
        p.error(f"--replicas: expected a comma list of integers, got {a.replicas!r}")
    if not reps or min(reps) < 1 or max(reps) > a.batch:
        p.error("--replicas: counts must be between 1 and --batch")
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0 or a.settle < 0:
        p.error("--rounds and --steps must be >= 1, --warmup and --settle >= 0")

    params, x, y = make_problem(a.seed, a.batch)
    tmp = tempfile.TemporaryDirectory(prefix="step_compare_")
    a.data_file = os.path.join(tmp.name, "problem.npz")
    np.savez(a.data_file, x=x, y=y, **{f"p{i}": q for i, q in enumerate(params)})
    ref = reference_losses(params, x, y)

    have_tf, why_tf = (False, "--no-peers") if a.no_peers else _python_has(a.tf_python, "tensorflow")
    have_torch, why_torch = (False, "--no-peers") if a.no_peers else _python_has(a.torch_python, "torch")
    nparams = sum(q.size for q in params)
    print(f"# step_compare: MLP {'-'.join(map(str, LAYERS))} ({nparams} float32 params), ReLU, softmax cross-entropy, "
          f"global batch {a.batch}, SGD momentum {MOMENTUM} lr {LR}; cores {os.cpu_count()}")
    print(f"# {a.settle} untimed steps per contestant first, then {a.rounds} interleaved rounds; in each, every "
          f"contestant runs {a.warmup} warm-up + {a.steps} timed steps; "
          "step = median over all timed steps; ratio = peer / cudist MirroredStrategy, per round (median [spread])")
    print(f"# check: global loss of the first {CHECK_STEPS} steps vs a float64 NumPy reference "
          f"({', '.join(f'{v:.6f}' for v in ref)}); #wrong = steps off by > {LOSS_RTOL:g} relative")
    if not have_tf:
        print(f"# tf: skipped ({why_tf})")
    if not have_torch:
        print(f"# torch: skipped ({why_torch})")
    results = {"argv": sys.argv[1:] if argv is None else argv, "reference_losses": ref, "groups": []}
    singles = {}  # single-device contestants, started once, in every group's rounds
    ok = True
    try:
        for n in reps:
            group = [Contestant(f"cudist MirroredStrategy ({n})", "cudist", sys.executable, "cudist-mirrored", a, n)]
            if "one-device" not in singles:
                singles["one-device"] = Contestant("cudist OneDeviceStrategy", "cudist-1dev", sys.executable,
                                                   "cudist-one-device", a, 1)
            if have_tf:
                group.append(Contestant(f"tf MirroredStrategy ({n})", "tf", a.tf_python, "tf-mirrored", a, n))
            if a.workers and n > 1:
                group.append(Contestant(f"cudist MultiWorker ({n} proc)", "cudist-mw", sys.executable,
                                        "cudist-multi-worker", a, 1, world=n))
                if a.workers_check_off:
                    group.append(Contestant("cudist MultiWorker, no check", "cudist-mw-nocheck", sys.executable,
                                            "cudist-multi-worker", a, 1, world=n,
                                            env={"CUDIST_CHECK_COLLECTIVES": "0"}))
            if have_torch:
                group.append(Contestant(f"torch DDP gloo ({n} proc)", "torch-ddp", a.torch_python, "torch-ddp", a, n,
                                        world=n))
                if "torch" not in singles:
                    singles["torch"] = Contestant("torch (1 process)", "torch", a.torch_python, "torch", a, 1)
            cs = group + list(singles.values())
            live = []
            for c in cs:
                try:
                    if c.hello is None:
                        c.start()
                    live.append(c)
                except RuntimeError as e:
                    print(f"# {c.label}: skipped ({e})")
                    c.close()
                    for k, v in list(singles.items()):
                        if v is c:
                            del singles[k]
            for c in live:
                c.samples, c.round_medians = [], []
                if not getattr(c, "settled", False) and a.settle:
                    # A training loop's steady state: warm-up effects (first-call compiles, caches,
                    # cudist's `auto` replica mode measuring greenlets against threads) are over.
                    time.sleep(a.gap_ms / 1e3)
                    c.round(a.settle, 1, record=False)
                    c.settled = True
            for r in range(a.rounds):
                for c in live if r % 2 == 0 else live[::-1]:
                    # Threads of the contestant before (OpenBLAS, Eigen, OpenMP) spin a while after their
                    # work; a pause lets them sleep so they do not take cores from this one.
                    time.sleep(a.gap_ms / 1e3)
                    c.round(a.warmup, a.steps)
            ok &= _report(n, live, ref, a, results)
            for c in group:
                c.close()
    finally:
        for c in singles.values():
            c.close()
        tmp.cleanup()
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


def _report(n, cs, ref, a, results) -> bool:
    base = cs[0] if cs and cs[0].key == "cudist" else None
    print()
    print(f"# {n} replica(s)")
    print(f"# {'contestant':<28} {'version':>10} {'threads':>16} {'step(ms)':>9} {'min(ms)':>8} {'samples/s':>10} "
          f"{'#wrong':>6}  ratio vs cudist MirroredStrategy (peer/cudist; >1: cudist faster)")
    rows = []
    ok = True
    for c in cs:
        med = statistics.median(c.samples)
        losses = c.hello.get("check_losses", [])
        wrong = sum(1 for got, want in zip(losses, ref) if not abs(got - want) <= LOSS_RTOL * abs(want))
        wrong += abs(len(losses) - len(ref))
        ok &= wrong == 0
        digest = c.digest() if c.key.startswith("cudist") else None
        ratio, text = None, "-"
        if base is not None and c is not base:
            per = [x / y for x, y in zip(c.round_medians, base.round_medians)]
            ratio = statistics.median(per)
            text = f"{ratio:.2f}x [{min(per):.2f}-{max(per):.2f}]"
        th = c.hello.get("threads")
        th = ",".join(f"{k}={v}" for k, v in th.items()) if isinstance(th, dict) else "-"
        print(f"  {c.label:<28} {str(c.hello.get('version'))[:10]:>10} {th[:16]:>16} {_fmt_ms(med):>9} "
              f"{_fmt_ms(min(c.samples)):>8} {a.batch / (med * 1e-9):>10.0f} {wrong:>6}  {text}")
        if digest is not None:
            print(f"  {'':<28} final weights sha256 {digest} (after the same steps in every run: compare runs)")
        rows.append({"contestant": c.label, "key": c.key, "replicas": n, "framework": c.hello.get("framework"),
                     "version": c.hello.get("version"), "python": c.hello.get("python"), "threads": c.hello.get("threads"),
                     "median_ms": med / 1e6, "min_ms": min(c.samples) / 1e6, "steps": len(c.samples),
                     "round_medians_ms": [v / 1e6 for v in c.round_medians], "check_losses": losses, "wrong": wrong,
                     "ratio_vs_cudist": ratio, "weights_sha256": digest})
    results["groups"].append({"replicas": n, "rows": rows})
    on = next((c for c in cs if c.key == "cudist-mw"), None)
    off = next((c for c in cs if c.key == "cudist-mw-nocheck"), None)
    if on is not None and off is not None:
        per = [x / y for x, y in zip(on.round_medians, off.round_medians)]
        print(f"# the default collective check: MultiWorker checked / unchecked, per round: {statistics.median(per):.3f}x "
              f"[{min(per):.3f}-{max(per):.3f}] ({' '.join(f'{x:.3f}' for x in per)})")
        results["groups"][-1]["check_cost_ratio"] = {"median": statistics.median(per), "rounds": per}
    return ok


if __name__ == "__main__":
    sys.exit(main())
