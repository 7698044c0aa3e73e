"""The user's-path instruments: ``cudist-bench user-path``, the page-fault reader, the suite's and
``step``'s user-path rows, and ``bench/step_compare.py``. Speed is never asserted."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudist.bench import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ["-b", "4K", "-e", "8K", "-f", "2", "-n", "2", "-w", "1", "--no-progress", "--copy-size", "1M",
        "--round-ms", "1"]


def _run(tmp_path, *argv):
    out = tmp_path / "bench.json"
    rc = main([*argv, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _rows(doc):
    return [r for t in doc["tables"] for r in t["rows"]]


# ------------------------------------------------------------------------------------------ user-path
@pytest.mark.parametrize("backend", ["numpy", "all"])
def test_user_path_tiny(tmp_path, capsys, backend):
    rc, doc = _run(tmp_path, "user-path", *TINY, "--replicas", "2", "--backend", backend)
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = _rows(doc)
    assert doc["summary"]["ok"] and doc["summary"]["out_of_bounds"] == 0
    assert "# Out of bounds values : 0 OK" in text
    for size in (4 << 10, 8 << 10):
        for group in ("all-reduce", "nest", "momentum", "adam"):
            got = {r["api"]: r for r in rows if r["size"] == size and r["group"] == group}
            assert set(got) == {"kernel", "user", "numpy", "copy-same"}, (size, group, got.keys())
            for r in got.values():
                assert r["time_us"] > 0 and r["iters"] >= 2
                assert r["moved_bytes"] > 0 and r["pct_copy"] > 0 and r["pct_same"] > 0
                assert r["wrong"] == (None if r["api"] == "copy-same" else 0)
            assert got["copy-same"]["pct_same"] == pytest.approx(100.0)
            user = got["user"]
            assert user["run_over_copy_same"] > 0 and len(user["run_over_copy_same_rounds"]) == 2
            assert user["user_path"] and "[user]" in text
            assert user["faults_per_call"] is not None and user["faults_per_call"] >= 0
            assert user["run_over_kernel"] > 0 and user["numpy_loop_over_run"] > 0
            assert len(user["run_over_kernel_rounds"]) == 2
        copy = [r for r in rows if r["size"] == size and r["group"] == "copy"]
        assert len(copy) == 4 and all(r["GBps"] > 0 for r in copy)  # one bracketed ceiling per point
    assert "run/kernel" in text and "numpy-loop/run" in text


def test_user_path_bytes_moved(tmp_path):
    rc, doc = _run(tmp_path, "user-path", *TINY, "-e", "4K", "--replicas", "3", "--backend", "numpy")
    assert rc == 0
    n, s = 3, 4 << 10
    moved = {r["group"]: r["moved_bytes"] for r in _rows(doc) if r["api"] == "user"}
    assert moved == {"all-reduce": 2 * n * s, "nest": 2 * n * s, "momentum": (n + 4) * s, "adam": (n + 6) * s}
    for r in _rows(doc):
        if r["api"] != "copy":
            ceiling = next(c["GBps"] for c in _rows(doc) if c["api"] == "copy" and c["size"] == r["size"]
                           and _rows(doc).index(c) > _rows(doc).index(r))
            assert r["pct_copy"] == pytest.approx(100 * r["moved_bytes"] / (r["time_us"] * 1e-6) / 1e9 / ceiling)
    # The copy-same row's two buffers span the point's working set, and %same divides by its GB/s.
    ws = {"all-reduce": (n + 1) * s, "nest": (n + 1) * s, "momentum": (n + 2) * s, "adam": (n + 3) * s}
    for group, want in ws.items():
        rows = [r for r in _rows(doc) if r["group"] == group]
        same = next(r for r in rows if r["api"] == "copy-same")
        assert same["moved_bytes"] == want
        for r in rows:
            assert r["pct_same"] == pytest.approx(100 * r["GBps"] / same["GBps"])


def test_user_path_leaves_out_a_copy_same_row_too_large(tmp_path, monkeypatch, capsys):
    from cudist.bench import _user_path

    # 2 replicas x 4K: all-reduce spans 3 x 4K (6K per buffer), Adam 5 x 4K (10K per buffer)
    monkeypatch.setattr(_user_path, "SAME_COPY_MAX_BYTES", 8 << 10)
    rc, doc = _run(tmp_path, "user-path", *TINY, "-e", "4K", "--replicas", "2", "--backend", "numpy",
                   "--groups", "all-reduce,adam")
    assert rc == 0
    apis = {r["group"]: {x["api"] for x in _rows(doc) if x["group"] == r["group"]} for r in _rows(doc)}
    assert "copy-same" in apis["all-reduce"] and "copy-same" not in apis["adam"]
    assert "4K adam: no copy-same row" in capsys.readouterr().out
    assert all(r["pct_same"] is None for r in _rows(doc) if r["group"] == "adam")


def test_user_path_groups_option(tmp_path):
    rc, doc = _run(tmp_path, "user-path", *TINY, "-e", "4K", "--replicas", "2", "--backend", "numpy",
                   "--groups", "momentum")
    assert rc == 0
    assert {r["group"] for r in _rows(doc)} == {"momentum", "copy"}


@pytest.mark.parametrize("group", ["all-reduce", "nest"])
def test_user_path_check_is_live(tmp_path, monkeypatch, capsys, group):
    """A wrong reference makes every checked row wrong (a check that cannot fail proves nothing)."""
    from cudist.bench import _user_path

    real = _user_path._reference_sum
    monkeypatch.setattr(_user_path, "_reference_sum", lambda host: real(host) + 1)
    rc, doc = _run(tmp_path, "user-path", *TINY, "-e", "4K", "--replicas", "2", "--backend", "numpy",
                   "--groups", group)
    assert rc == 1
    rows = [r for r in _rows(doc) if r["api"] in ("kernel", "user", "numpy")]
    assert rows and all(r["wrong"] == 2 * 1024 for r in rows)
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("count", [1, 2, 3, 64, 100, 1 << 20, (1 << 20) + 7])
def test_nest_sizes_pair_weights_and_biases(count):
    from cudist.bench._user_path import NEST_LEAVES, nest_sizes

    sizes = nest_sizes(count)
    assert sum(sizes) == count and all(k >= 1 for k in sizes)
    assert len(sizes) <= NEST_LEAVES and (len(sizes) == NEST_LEAVES or count < NEST_LEAVES * 64)
    if count >= 128:  # weight / bias pairs, each bias 1/64 of its pair
        assert all(w > b for w, b in zip(sizes[0::2], sizes[1::2]))


def test_wrong_counts_nan_and_far_values():
    import numpy as np

    from cudist.bench._user_path import _CHUNK, _wrong

    ref = np.ones(_CHUNK + 10, np.float32)
    got = ref.copy()
    assert _wrong(got, ref) == 0
    got[3] = np.nan
    got[-1] = 1.001
    got[-2] = np.nextafter(np.float32(1), np.float32(2))  # one ulp: within tolerance
    assert _wrong(got, ref) == 2
    assert _wrong(got[:5], ref) == ref.size


@pytest.mark.parametrize("argv,message", [
    (["user-path", "--groups", "rmsprop"], "unknown group"),
    (["user-path", "-b", "2", "-e", "2"], "smaller than one float32"),
    (["user-path", "-d", "float64"], "unrecognized arguments"),
])
def test_user_path_bad_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--backend", "numpy", "--no-progress"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _tf_python():
    for p in (os.environ.get("CUDIST_BENCH_TF_PYTHON"), "/work/peers/tf/bin/python", "/tmp/tfvenv/bin/python"):
        if p and os.path.isfile(p):
            return p
    return None


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.skipif(_tf_python() is None, reason="no python with TensorFlow (set CUDIST_BENCH_TF_PYTHON)")
def test_user_path_compare_tf(tmp_path):
    rc, doc = _run(tmp_path, "user-path", *TINY, "-e", "4K", "--replicas", "2", "--backend", "numpy",
                   "--compare", "tf", "--tf-python", _tf_python())
    assert rc == 0
    tf = [r for r in _rows(doc) if r["api"] == "tf-user"]
    assert {r["group"] for r in tf} == {"all-reduce", "momentum", "adam"}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 and r["backend"] == "tf-fn" for r in tf)
    assert all(r["tf-fn_over_run"] > 0 for r in _rows(doc) if r["api"] == "user" and r["group"] != "nest")
    assert not [r for r in _rows(doc) if r["group"] == "nest" and r["api"] == "tf-user"]


def test_user_path_without_tensorflow_is_skipped(tmp_path, capsys):
    rc, doc = _run(tmp_path, "user-path", *TINY, "-e", "4K", "--replicas", "2", "--backend", "numpy",
                   "--groups", "all-reduce", "--compare", "tf", "--tf-python", str(tmp_path / "no-python"))
    assert rc == 0
    assert "# tf: skipped" in capsys.readouterr().out
    assert not [r for r in _rows(doc) if r["api"] == "tf-user"]


# ------------------------------------------------------------------------------------------ page faults
def test_minor_faults_reader():
    from cudist.bench._timing import minor_faults, parse_minor_faults

    before = minor_faults()
    if before is None:
        pytest.skip("no /proc/self/stat here")
    m = mmap.mmap(-1, 4 << 20)  # fresh anonymous pages: each first write is a minor fault
    try:
        for off in range(0, len(m), mmap.PAGESIZE):
            m[off] = 1
        after = minor_faults()
    finally:
        m.close()
    assert after > before
    # the command name may hold spaces and parentheses: fields count from the last ')'
    line = b"4242 (a b) c)) S 1 4242 4242 0 -1 4194560 12345 0 7 0 9 3 0 0 20 0 1 0 100 1000 10"
    assert parse_minor_faults(line) == 12345
    with pytest.raises(ValueError):
        parse_minor_faults(b"garbage")


# ------------------------------------------------------------------------------------------ suite / step
def test_suite_runs_user_path_rows(monkeypatch):
    from cudist.bench import _cli, _strategy_bench, _user_path

    calls = []
    monkeypatch.setattr(_cli, "run_kernel_op", lambda ctx, op, **kw: calls.append(op))
    monkeypatch.setattr(_strategy_bench, "run_overhead", lambda ctx: calls.append("run-overhead"))
    monkeypatch.setattr(_strategy_bench, "run_step", lambda ctx: calls.append("step"))
    monkeypatch.setattr(_user_path, "run_user_path",
                        lambda ctx, sizes=None, groups=None: calls.append(("user-path", tuple(sizes), tuple(ctx.args.groups))))
    assert main(["suite", "--no-progress"]) == 0
    assert ("user-path", (256 << 10, 4 << 20), ("all-reduce", "momentum", "adam")) in calls
    assert calls.index("step") > calls.index("run-overhead")


def test_options_without_subcommand_go_to_the_suite(monkeypatch):
    from cudist.bench import _cli

    seen = []
    monkeypatch.setattr(_cli, "run_suite", lambda ctx: seen.append((ctx.args.command, ctx.args.iters)))
    assert main(["-n", "3", "--no-progress"]) == 0
    assert seen == [("suite", 3)]


def test_step_names_the_users_path(tmp_path, capsys):
    rc, doc = _run(tmp_path, "step", "-n", "2", "-w", "1", "--replicas", "2", "--batch", "16", "--features", "8",
                   "--hidden", "16", "--classes", "3", "--backend", "numpy", "--no-progress", "--copy-size", "1M")
    assert rc == 0
    text = capsys.readouterr().out
    assert "# the user's path: api=strategy rows" in text
    if any(r["api"] == "strategy" and r.get("time_us") for r in _rows(doc)):
        assert "# user's path / kernel step time" in text


# ------------------------------------------------------------------------------------------ step_compare
def test_step_compare_model_gradients():
    """The script's hand-written backward pass is the gradient of its loss (finite differences)."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import step_compare
    finally:
        sys.path.pop(0)
    rng = np.random.default_rng(3)
    params = [rng.standard_normal(s) * 0.3 for s in ((5, 4), (4,), (4, 4), (4,), (4, 3), (3,))]
    x, y = rng.standard_normal((6, 5)), rng.integers(0, 3, 6)
    grads, _ = step_compare.mlp_grads(params, x, y, 1 / 6)
    eps = 1e-6
    for p, g in zip(params, grads):
        idx = tuple(rng.integers(0, s) for s in p.shape)
        old = p[idx]
        p[idx] = old + eps
        up = step_compare.mlp_grads(params, x, y, 1 / 6)[1]
        p[idx] = old - eps
        down = step_compare.mlp_grads(params, x, y, 1 / 6)[1]
        p[idx] = old
        assert g[idx] == pytest.approx((up - down) / (2 * eps), rel=1e-4, abs=1e-8)


@pytest.mark.heavy
def test_step_compare_runs(tmp_path):
    out = tmp_path / "sc.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_compare.py"), "--rounds", "1", "--steps", "2", "--warmup", "1",
         "--settle", "3", "--replicas", "2", "--no-peers", "--gap-ms", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = doc["groups"][0]["rows"]
    assert [r["key"] for r in rows] == ["cudist", "cudist-1dev"]
    assert all(r["wrong"] == 0 and r["steps"] == 2 and r["median_ms"] > 0 for r in rows)
    assert rows[1]["ratio_vs_cudist"] > 0
    assert "skipped (--no-peers)" in proc.stdout
    assert "3 untimed steps per contestant first" in proc.stdout  # the settle steps: run, not recorded


@pytest.mark.heavy
def test_step_compare_runs_multi_worker(tmp_path):
    """--workers: 2 MPI processes of MultiWorkerMirroredStrategy take their turns; the losses check
    against the float64 reference (the same trajectory as MirroredStrategy's)."""
    pytest.importorskip("mpi4py")
    out = tmp_path / "sc.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_compare.py"), "--rounds", "1", "--steps", "2", "--warmup", "1",
         "--settle", "0", "--replicas", "2", "--no-peers", "--workers", "--gap-ms", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["groups"][0]["rows"]
    assert [r["key"] for r in rows] == ["cudist", "cudist-mw", "cudist-1dev"]
    assert all(r["wrong"] == 0 and r["steps"] == 2 and r["median_ms"] > 0 for r in rows)


@pytest.mark.heavy
def test_step_compare_reports_a_missing_peer(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_compare.py"), "--rounds", "1", "--steps", "1", "--warmup", "0",
         "--settle", "0", "--replicas", "1", "--gap-ms", "0", "--tf-python", str(tmp_path / "nope"), "--torch-python", sys.executable],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "# tf: skipped" in proc.stdout
    if "# torch: skipped" not in proc.stdout:  # this python has torch after all
        assert "torch" in proc.stdout


def test_reduce_paths_script_checks_its_results():
    """bench/reduce_paths.py (the in-place / reduce-to-one / out-of-place / strategy.run table of
    PERFORMANCE.md) runs, every variant's result equals the sum it must be, and the ratio columns
    are the times' ratios."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reduce_paths.py"), "--rounds", "1", "--replicas", "3", "--sizes", "4K,68K"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [ln.split() for ln in proc.stdout.splitlines() if not ln.startswith("#")]
    assert [r[0] for r in rows] == ["4K", "68K"] and all(r[-1] == "ok" for r in rows), proc.stdout
    for r in rows:
        in_place, r2o, run, r2o_ip, run_ip = float(r[1]), float(r[2]), float(r[4]), float(r[5]), float(r[6])
        for t, ratio in ((r2o, r2o_ip), (run, run_ip)):  # the times are printed to 0.1 us
            assert (t - 0.05) / (in_place + 0.05) - 1e-3 <= ratio <= (t + 0.05) / max(in_place - 0.05, 1e-3) + 1e-3, r


def test_copy_sizes_script_prints_a_rate_per_size_and_method():
    """bench/copy_sizes.py (PERFORMANCE.md's copy bandwidth by buffer size) runs and reports a
    positive rate for every size and method."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "copy_sizes.py"), "--sizes", "64K,1M", "--iters", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [ln.split() for ln in proc.stdout.splitlines() if not ln.startswith("#")]
    assert [r[0] for r in rows] == ["64K", "1M"], proc.stdout
    assert all(len(r) >= 2 and all(float(x) > 0 for x in r[1:]) for r in rows), proc.stdout


def test_read_bound_script_prints_each_kernels_read_rate():
    """bench/read_bound.py (PERFORMANCE.md's read rates of the fused updates) runs; each row's bytes
    moved and read are the kernel's, its rates are positive, and the read-bound column is the best read
    rate of the table over the row's read share, relative to the copy."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "read_bound.py"), "--size", "256K", "--replicas", "3", "--rounds", "2", "--iters", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [ln.rsplit(None, 7) for ln in proc.stdout.splitlines() if not ln.startswith("#")]
    names = [r[0].strip() for r in rows]
    assert names == ["copy (native broadcast)", "reduce_to_one 2 -> 1", "reduce_to_one 3 -> 1", "all_reduce_sgd (3 grads)",
                     "all_reduce_momentum (3 grads)", "all_reduce_adam (3 grads)"], proc.stdout
    assert [(r[1], r[2]) for r in rows] == [("2*S", "1*S"), ("3*S", "2*S"), ("4*S", "3*S"), ("5*S", "4*S"), ("7*S", "5*S"),
                                          ("9*S", "6*S")], proc.stdout
    nums = [[float(x) for x in r[3:]] for r in rows]
    assert all(x > 0 for row in nums for x in row), proc.stdout
    best_read = max(row[2] for row in nums)
    copy_rate = nums[0][1]
    for r, row in zip(rows, nums):
        moved, read = int(r[1][:-2]), int(r[2][:-2])
        assert row[4] == pytest.approx(100 * best_read * moved / read / copy_rate, rel=0.02, abs=0.2), r


def test_path_ab_script_times_each_case_per_tree():
    """bench/path_ab.py (PERFORMANCE.md's sixth-section A/B) runs each case in a child process per tree
    and round and prints their medians, and the last/first ratio for two trees."""
    src = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "path_ab.py"), "--trees", f"installed,{src}", "--cases",
         "one-256K,vars64-momentum", "--rounds", "2", "--scale", "0.02"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [ln.split() for ln in proc.stdout.splitlines() if not ln.startswith("#")]
    assert [r[0] for r in rows] == ["one-256K", "vars64-momentum"], proc.stdout
    for r in rows:  # case, a / b (tree 1), c / d (tree 2), ratio
        times = [float(x) for x in r[1:-1] if x != "/"]
        assert len(times) == 4 and all(t > 0 for t in times), proc.stdout
        assert float(r[-1]) == pytest.approx(((times[2] + times[3]) / 2) / ((times[0] + times[1]) / 2), rel=1e-2)
