"""Single-thread time of the native update kernels, A/B between source trees (issue #27).

Times ``cudist._core``'s fused all-reduce + update entry points themselves (no strategy, no Python
optimizer): 4 copies, 4 gradients of ``--sizes`` float32 elements, one thread
(``_core.set_num_threads(1)``), CPU time of the calling thread per call, the minimum of 7 batches.
Each round runs every tree once, in a fresh process (the trees alternate, so load drifts touch
both); the ratios are of the medians of the rounds' results, each later tree over the first (give a
copy of the first tree last to see the run's noise floor: its ratio would be 1 on a quiet machine).

    python bench/kernel_ab.py --trees /tmp/main_site,/tmp/branch_src --rounds 5

A tree is a directory holding the ``cudist`` package with its built ``_core`` (a ``pip install
--target`` of a tree, or a copy of ``src`` with the build's ``_core*.so`` put beside it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

#: name -> (entry point of cudist._core, slot count, arguments after the gradients): the rows of the
#: rules' table (every one takes the weight decay last, 0 here).
CASES = {
    "momentum": ("all_reduce_momentum", 1, (0.01, 0.9, 0.0)),
    "nesterov": ("all_reduce_nesterov", 1, (0.01, 0.9, 0.0)),
    "sgd": ("all_reduce_sgd", 0, (0.01, 0.0)),
    "adam": ("all_reduce_adamw", 2, (0.001, 0.9, 0.999, 1e-7, 0.0)),
}
#: The same work in a tree from before gradient descent and momentum were rows of the table
#: (hand-written entry points: no weight decay, Nesterov a flag), to A/B against one.
LEGACY_CASES = {
    "momentum": ("all_reduce_momentum", 1, (0.01, 0.9, False)),
    "nesterov": ("all_reduce_momentum", 1, (0.01, 0.9, True)),
    "sgd": ("all_reduce_sgd", 0, (0.01,)),
}


def _child(tree: str, cases: list[str], sizes: list[int]) -> None:
    # The tree's package, not the editable install of the running environment.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path.insert(0, tree)
    import numpy as np

    from cudist import _core

    assert _core.__file__.startswith(tree), _core.__file__
    table = hasattr(_core, "all_reduce_nesterov")
    _core.set_num_threads(1)
    rng = np.random.default_rng(0)
    out = {}
    for size in sizes:
        for case in cases:
            entry, nslots, args = CASES[case] if table else LEGACY_CASES.get(case, CASES[case])
            fn = getattr(_core, entry, None)
            if fn is None:
                continue
            copies = [rng.standard_normal(size).astype(np.float32) for _ in range(4)]
            slots = [[np.abs(rng.standard_normal(size)).astype(np.float32) for _ in range(4)] for _ in range(nslots)]
            grads = [rng.standard_normal(size).astype(np.float32) * 1e-3 for _ in range(4)]
            calls = max(20, 8_000_000 // (size * 8))
            best = float("inf")
            for _ in range(7):
                t = time.thread_time()
                for _ in range(calls):
                    fn(copies, *slots, grads, *args)
                best = min(best, (time.thread_time() - t) / calls * 1e6)
            out[f"{case}-{size}"] = best
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", required=True, help="comma-separated trees (first: the reference)")
    ap.add_argument("--cases", default="momentum,nesterov,sgd,adam", help=f"of {sorted(CASES)}")
    ap.add_argument("--sizes", default="4096,65536", help="elements per buffer, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cases, sizes = a.cases.split(","), [int(s) for s in a.sizes.split(",")]
    if a.child:
        _child(a.child, cases, sizes)
        return
    trees = a.trees.split(",")
    res: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(a.rounds):
        for t in trees:
            cmd = [sys.executable, __file__, "--trees", a.trees, "--cases", a.cases, "--sizes", a.sizes, "--child", t]
            res[t].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    print(f"# us per call (thread CPU time, min of 7 batches), {a.rounds} rounds; trees: {', '.join(trees)}")
    for key in res[trees[0]][0]:
        cols = [[r[key] for r in res[t] if key in r] for t in trees]
        if any(not c for c in cols):
            continue
        meds = [statistics.median(c) for c in cols]
        rows = "   ".join(" / ".join(f"{x:.2f}" for x in c) for c in cols)
        # Every later tree's ratio to the first: with a copy of the first tree last (A/B/A'), the
        # last ratio is the noise floor of the run.
        print(f"  {key:16s} {rows}   ratio {' '.join(f'{m / meds[0]:.3f}' for m in meds[1:])}")


if __name__ == "__main__":
    main()
