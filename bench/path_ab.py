"""A/B of the user's Python paths between two source trees: the same calls, alternated processes.

The cases (4 replicas on logical CPUs, float32):

* ``one-256K`` / ``one-4M``: ``strategy.run`` of a function that all-reduces one array per replica
  (``cudist.get_replica_context().all_reduce("sum", x)``), the array a PerReplica argument;
* ``nest-256K``: ``strategy.run`` of a function that all-reduces its replica's list of 64 leaves
  (``cudist-bench user-path``'s nest sizes, 256 KiB in all);
* ``vars64-momentum`` / ``vars64-adam``: ``strategy.run`` of ``optimizer.apply_gradients`` over 64
  variables (32 of 64x64 and 32 of 64), the gradients a list of PerReplica arguments;
  ``vars64-lso``: the same through ``LossScaleOptimizer(SGD(momentum=0.9))`` (its reduction with the
  finiteness check, then the update);
* ``mlp-step``: ``bench/step_compare.py``'s MLP training step (784-512-512-10, batch 256 split over
  the replicas, NumPy forward and backward, SGD with momentum through ``apply_gradients``).

Each (tree, case) runs in a process of its own, ``--rounds`` times, the trees alternating; each
process prints the median time of its calls (microseconds; ``cudist.bench._timing.time_calls``,
the garbage collector paused). A tree is a directory
holding an importable ``cudist`` package (a checkout's ``src``, with its built ``_core`` extension
copied in when the C++ is the same), or ``installed`` for the cudist this interpreter has.

Usage: ``python bench/path_ab.py --trees OLD_SRC,NEW_SRC [--cases one-256K,vars64-momentum]
[--rounds 3]``
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CASES = ("one-256K", "one-4M", "nest-256K", "vars64-momentum", "vars64-adam", "vars64-lso", "mlp-step")
REPLICAS = 4


def child(tree: str, case: str, scale: float) -> float:
    """Times ``case`` with the cudist of ``tree``; returns microseconds per call."""
    if tree != "installed":
        # An editable install's import hook would take `import cudist` to its own checkout.
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
        sys.path.insert(0, tree)
    import numpy as np

    import cudist
    from cudist import config
    from cudist.bench._timing import median_us, time_calls

    def median_of(fn, calls: int) -> float:
        return median_us(time_calls(fn, 7 * calls, max(3, calls // 10)))

    n = REPLICAS
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * n)
    s = cudist.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    rng = np.random.default_rng(0)
    if case.startswith("one-"):
        size = {"one-256K": 256 << 10, "one-4M": 4 << 20}[case]
        host = [rng.standard_normal(size // 4).astype(np.float32) for _ in range(n)]
        x = s.experimental_distribute_values_from_function(lambda c: host[c.replica_id_in_sync_group])

        def fn(x):
            return cudist.get_replica_context().all_reduce("sum", x)

        return median_of(lambda: s.run(fn, args=(x,)), max(5, int((2000 if size < 1 << 20 else 200) * scale)))
    if case == "nest-256K":
        from cudist.bench._user_path import nest_sizes

        leaves = [[rng.standard_normal(c).astype(np.float32) for c in nest_sizes((256 << 10) // 4)] for _ in range(n)]

        def step():
            ctx = cudist.get_replica_context()
            ctx.all_reduce("sum", leaves[ctx.replica_id_in_sync_group])

        return median_of(lambda: s.run(step), max(5, int(1000 * scale)))
    if case in ("vars64-momentum", "vars64-adam", "vars64-lso"):
        with s.scope():
            vs = []
            for _ in range(32):
                vs.append(cudist.Variable(rng.standard_normal((64, 64)).astype(np.float32)))
                vs.append(cudist.Variable(rng.standard_normal(64).astype(np.float32)))
            if case.endswith("momentum"):
                opt = cudist.optimizers.SGD(0.01, momentum=0.9)
            elif case.endswith("lso"):
                # (dynamic_growth_steps past the run: the scale stays a power of two, every step applies)
                opt = cudist.optimizers.LossScaleOptimizer(cudist.optimizers.SGD(0.01, momentum=0.9),
                                                           dynamic_growth_steps=10**9)
            else:
                opt = cudist.optimizers.Adam(1e-3)
        grads = [[rng.standard_normal(v.shape).astype(np.float32) for v in vs] for _ in range(n)]
        g = s.experimental_distribute_values_from_function(lambda c: grads[c.replica_id_in_sync_group])

        def apply(gs):
            opt.apply_gradients(zip(gs, vs))

        return median_of(lambda: s.run(apply, args=(g,)), max(5, int(300 * scale)))
    if case == "mlp-step":
        import importlib.util
        import os

        spec = importlib.util.spec_from_file_location("step_compare", os.path.join(os.path.dirname(__file__), "step_compare.py"))
        assert spec is not None and spec.loader is not None
        sc = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sc)
        params, xs, ys = sc.make_problem(0, 256)
        parts = sc.shards(n, xs, ys)
        with s.scope():
            vs = [cudist.Variable(p.copy()) for p in params]
            opt = cudist.optimizers.SGD(learning_rate=sc.LR, momentum=sc.MOMENTUM)
        data = s.experimental_distribute_values_from_function(lambda c: parts[c.replica_id_in_sync_group])

        def replica_step(xy):
            grads, _ = sc.mlp_grads([v.read_value() for v in vs], xy[0], xy[1], 1.0 / len(xs))
            opt.apply_gradients(zip(grads, vs))

        return median_of(lambda: s.run(replica_step, args=(data,)), max(5, int(60 * scale)))
    raise SystemExit(f"unknown case {case!r}; the cases: {', '.join(CASES)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", default="installed", help="comma-separated: source directories, or 'installed'")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the calls per block (tests: small)")
    p.add_argument("--child", nargs=2, metavar=("TREE", "CASE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(f"{child(a.child[0], a.child[1], a.scale):.3f}")
        return 0
    trees = a.trees.split(",")
    print(f"# path_ab: {REPLICAS} replicas, float32; us per call, median of each process's calls; {a.rounds} rounds, trees alternating")
    print(f"# {'case':<16}" + "".join(f"  {t[-28:]:>28}" for t in trees) + ("   ratio (last/first)" if len(trees) > 1 else ""))
    for case in a.cases.split(","):
        got: dict[str, list[float]] = {t: [] for t in trees}
        for _ in range(a.rounds):
            for t in trees:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", t, case, "--scale", str(a.scale)],
                    capture_output=True, text=True, check=True,
                )
                got[t].append(float(out.stdout.strip().splitlines()[-1]))
        cells = "".join(f"  {' / '.join(f'{v:.1f}' for v in got[t]):>28}" for t in trees)
        ratio = ""
        if len(trees) > 1:
            ratio = f"   {statistics.median(got[trees[-1]]) / statistics.median(got[trees[0]]):.3f}"
        print(f"  {case:<16}{cells}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
