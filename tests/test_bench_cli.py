"""Smoke tests of the ``cudist-bench`` CLI: every subcommand at tiny sizes, JSON output, flag errors."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudist.bench import main
from cudist.bench._ops import count_wrong, make_case
from cudist.bench._sizes import format_size, parse_size, size_sweep

TINY = ["-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1", "--no-progress", "--copy-size", "1M"]
HAVE_STRATEGY = importlib.util.find_spec("cudist._mirrored_strategy") is not None


def _run(tmp_path, *argv):
    out = tmp_path / "bench.json"
    rc = main([*argv, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _rows(doc):
    return [r for t in doc["tables"] for r in t["rows"]]


# ------------------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize(
    "text,expected",
    [("4096", 4096), ("4K", 4096), ("4k", 4096), ("4KiB", 4096), ("4KB", 4096), ("64M", 64 << 20),
     ("1G", 1 << 30), ("1.5K", 1536), ("0", 0), (" 8M ", 8 << 20)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-4K", "4X", "1.3", "K", "4 K B x"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_format_size_round_trips():
    for n in (1, 1000, 4096, 3 << 20, 1 << 30, 4097):
        assert parse_size(format_size(n)) == n


def test_size_sweep():
    assert size_sweep(4 << 10, 64 << 10, 4) == [4 << 10, 16 << 10, 64 << 10]
    assert size_sweep(4 << 10, 100 << 10, 4) == [4 << 10, 16 << 10, 64 << 10]
    assert size_sweep(8, 8, 1) == [8]
    with pytest.raises(ValueError, match="larger than"):
        size_sweep(64, 4, 2)
    with pytest.raises(ValueError, match="factor"):
        size_sweep(4, 64, 1)


# ------------------------------------------------------------------------------------------ kernel ops
@pytest.mark.parametrize(
    "cmd",
    [["all-reduce"], ["all-reduce", "-o", "mean", "-d", "int32,float16"], ["all-gather"], ["broadcast"],
     ["split", "-d", "int64"], ["update", "--optimizer", "sgd"], ["update", "--optimizer", "momentum"],
     ["update", "--optimizer", "adamw", "-d", "float64"]],
    ids=lambda c: "-".join(c),
)
def test_kernel_subcommands(tmp_path, capsys, cmd):
    rc, doc = _run(tmp_path, *cmd, *TINY, "--replicas", "3", "--backend", "numpy")
    assert rc == 0
    rows = _rows(doc)
    dtypes = {"-d": cmd[cmd.index("-d") + 1].split(",")} if "-d" in cmd else {"-d": ["float32"]}
    # 2 sizes x every dtype, each checked (0 wrong) and timed.
    assert len(rows) == 2 * len(dtypes["-d"])
    assert {r["size"] for r in rows} == {4 << 10, 16 << 10}
    assert {r["dtype"] for r in rows} == set(dtypes["-d"])
    for r in rows:
        assert r["wrong"] == 0 and r["backend"] == "numpy" and r["replicas"] == 3
        assert r["time_us"] > 0 and r["algbw"] > 0
    assert doc["summary"]["ok"] and doc["summary"]["out_of_bounds"] == 0
    text = capsys.readouterr().out
    assert "# Out of bounds values : 0 OK" in text and "# Avg bus bandwidth" in text
    assert "# CPU:" in text and "copy ceiling" in text


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_bfloat16_rows_on_every_cpu_backend(tmp_path, op):
    pytest.importorskip("ml_dtypes")
    rc, doc = _run(tmp_path, "all-reduce", *TINY, "-o", op, "-d", "bf16,float32", "--replicas", "3",
                   "--backend", "all")
    assert rc == 0
    rows = _rows(doc)
    assert {(r["dtype"], r["backend"]) for r in rows} >= {
        (d, b) for d in ("bfloat16", "float32") for b in ("numpy", "numba", "native")
    }
    for r in rows:  # each row checked bit for bit against the reference on random data
        assert r["wrong"] == 0 and r["time_us"] > 0
    assert {r["count"] for r in rows if r["dtype"] == "bfloat16"} == {2 << 10, 8 << 10}


def test_bfloat16_option_without_ml_dtypes_says_what_to_install(monkeypatch):
    import builtins

    from cudist.bench._cli import _dtype_list

    real = builtins.__import__

    def no_ml_dtypes(name, *args, **kwargs):
        if name == "ml_dtypes":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ml_dtypes)
    with pytest.raises(argparse.ArgumentTypeError, match="ml_dtypes"):
        _dtype_list("bfloat16")


def test_long_sum_loops_overflow_quietly(tmp_path):
    """Repeated in-place float16 SUMs reach inf within the timed loop; that must not warn or fail."""
    rc, doc = _run(tmp_path, "all-reduce", *TINY, "-n", "30", "-d", "float16", "--backend", "numpy")
    assert rc == 0 and all(r["wrong"] == 0 for r in _rows(doc))


def test_busbw_formulas(tmp_path):
    _, doc = _run(tmp_path, "all-reduce", *TINY, "--replicas", "4", "--backend", "numpy")
    for r in _rows(doc):
        algbw = r["size"] / (r["time_us"] * 1e-6) / 1e9
        assert r["algbw"] == pytest.approx(algbw)
        assert r["busbw"] == pytest.approx(algbw * 2 * 3 / 4)
        ceiling = doc["header"]["copy_bandwidth"]["ceiling"]
        assert r["pct_copy"] == pytest.approx(100 * 2 * 4 * r["size"] / (r["time_us"] * 1e-6) / 1e9 / ceiling)
    _, doc = _run(tmp_path, "update", "--optimizer", "adamw", *TINY, "--replicas", "4", "--backend", "numpy")
    for r in _rows(doc):
        assert r["moved_bytes"] == (4 + 3 * 4) * r["size"]


def test_check_detects_a_wrong_kernel():
    """The check is live: a backend that drops the last replica is counted wrong."""
    from cudist._kernels._numpy import NumpyBackend

    class Broken(NumpyBackend):
        def _hook_all_reduce(self, inputs, outputs, op):
            super()._hook_all_reduce(inputs[:-1], outputs[:-1], op)

    case = make_case("all-reduce", Broken(), 1000, "float32", 3)
    assert case.check() == 3 * 1000
    case = make_case("all-reduce", NumpyBackend(), 1000, "float32", 3)
    assert case.check() == 0


def test_count_wrong():
    import numpy as np

    a = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    assert count_wrong(a, a.copy(), exact=True) == 0
    b = a.copy()
    b[2] = np.nextafter(np.float32(3), np.float32(4))
    assert count_wrong(b, a, exact=True) == 1
    assert count_wrong(b, a, exact=False) == 0
    assert count_wrong(np.arange(3), np.arange(3) + 1, exact=False) == 3


# ------------------------------------------------------------------------------------------ strategy level
def test_run_overhead(tmp_path, capsys):
    rc, doc = _run(tmp_path, "run-overhead", "-n", "3", "-w", "1", "--replicas", "2", "--no-progress")
    assert rc == 0
    rows = _rows(doc)
    if not HAVE_STRATEGY:
        assert rows == [] and "skipped" in capsys.readouterr().out
        return
    assert {r["backend"] for r in rows} == {os.environ.get("CUDIST_BACKEND") or _default_backend()}
    fns = {(r["strategy"], r["fn"]) for r in rows}
    assert ("MirroredStrategy", "noop") in fns and ("MirroredStrategy", "all_reduce(scalar)") in fns
    assert all(r["time_us"] > 0 for r in rows)
    assert all(r["wrong"] == 0 for r in rows if r["fn"] != "noop")


def _default_backend():
    from cudist._kernels import default_cpu_backend

    return default_cpu_backend().name


def test_run_overhead_honours_backend(tmp_path):
    if not HAVE_STRATEGY:
        pytest.skip("no MirroredStrategy yet")
    before = os.environ.get("CUDIST_BACKEND")
    rc, doc = _run(tmp_path, "run-overhead", "-n", "2", "-w", "1", "--replicas", "2", "--backend", "numpy")
    assert rc == 0 and {r["backend"] for r in _rows(doc)} == {"numpy"}
    assert all(r["wrong"] == 0 for r in _rows(doc) if r["fn"] != "noop")
    assert os.environ.get("CUDIST_BACKEND") == before  # restored


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_step(tmp_path, capsys, opt):
    rc, doc = _run(tmp_path, "step", "--optimizer", opt, "-n", "2", "-w", "1", "--replicas", "2", "--batch", "16",
                   "--features", "8", "--hidden", "16", "--classes", "3", "--backend", "numpy", "--no-progress",
                   "--copy-size", "1M")
    assert rc == 0
    rows = _rows(doc)
    kernel = [r for r in rows if r["api"] == "kernel"]
    assert len(kernel) == 1 and kernel[0]["wrong"] == 0 and kernel[0]["params"] == 8 * 16 + 16 + 16 * 3 + 3
    assert kernel[0]["time_us"] > 0 and kernel[0]["all_reduce_us"] >= 0
    if HAVE_STRATEGY:
        strat = [r for r in rows if r["api"] == "strategy"]
        assert [r["backend"] for r in strat] == ["numpy"], capsys.readouterr().out
        assert strat[0]["wrong"] == 0


_STEP_ARGS = ("step", "--optimizer", "adam", "-n", "2", "-w", "1", "--replicas", "2", "--batch", "256",
              "--features", "784", "--hidden", "64", "--classes", "10", "--no-progress", "--copy-size", "1M")


@pytest.mark.parametrize("mode", ["greenlets", "threads", "auto"])
def test_step_is_right_in_every_replica_execution_mode(tmp_path, mode):
    """Adam after one step on 128-row shards (whose matmul OpenBLAS rounds differently with 1 and 2
    threads): 0 wrong in every mode, on every backend -- the strategy rows used to count 8 on threads."""
    from cudist import config

    before = config.get_replica_execution()
    config.set_replica_execution(mode)
    try:
        rc, doc = _run(tmp_path, *_STEP_ARGS)
    finally:
        config.set_replica_execution(before)
    rows = _rows(doc)
    assert rc == 0 and rows and all(r["wrong"] == 0 for r in rows), rows
    assert {r["api"] for r in rows} == {"kernel", "strategy"}


def test_step_fails_on_a_real_mismatch_of_the_strategy_path(tmp_path, monkeypatch):
    """The strategy rows' check is live: a reference off by 0.1% in one parameter makes the bench fail."""
    from cudist.bench import _strategy_bench

    real = _strategy_bench._strategy_reference

    def off(*args):
        ref = real(*args)
        ref[0] = ref[0].copy()
        ref[0].flat[0] += abs(ref[0].flat[0]) * 1e-3 + 1e-3
        return ref

    monkeypatch.setattr(_strategy_bench, "_strategy_reference", off)
    rc, doc = _run(tmp_path, *_STEP_ARGS, "--backend", "numpy")
    strat = [r for r in _rows(doc) if r["api"] == "strategy"]
    assert rc == 1 and [r["wrong"] for r in strat] == [2]  # that element, in both replicas' copies


def test_mlp_grads_match_finite_differences():
    """The step's hand-written backward pass is the gradient of its loss."""
    import numpy as np

    from cudist.bench._strategy_bench import mlp_grads

    rng = np.random.default_rng(1)
    params = [rng.standard_normal(s) for s in ((4, 5), (5,), (5, 2), (2,))]
    x, y = rng.standard_normal((6, 4)), rng.standard_normal((6, 2))
    grads, loss = mlp_grads(params, x, y)
    eps = 1e-6
    for p, g in zip(params, grads):
        idx = tuple(rng.integers(0, s) for s in p.shape)
        old = p[idx]
        p[idx] = old + eps
        up = mlp_grads(params, x, y)[1]
        p[idx] = old - eps
        down = mlp_grads(params, x, y)[1]
        p[idx] = old
        assert g[idx] == pytest.approx((up - down) / (2 * eps), rel=1e-4, abs=1e-8)


def test_no_arguments_runs_the_suite(monkeypatch):
    from cudist.bench import _cli

    called = []
    monkeypatch.setattr(_cli, "run_suite", lambda ctx: called.append(ctx.args.command))
    assert main([]) == 0
    assert called == ["suite"]


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "argv,message",
    [
        (["all-reduce", "-b", "4Q"], "invalid size"),
        (["all-reduce", "-b", "64M", "-e", "4K"], "larger than"),
        (["all-reduce", "-b", "4K", "-e", "64K", "-f", "1"], "factor"),
        (["all-reduce", "-d", "complex64"], "unsupported dtype"),
        (["all-reduce", "--backend", "tpu"], "invalid choice"),
        (["all-reduce", "-o", "max"], "invalid choice"),
        (["all-reduce", "-n", "0"], "-n must be >= 1"),
        (["all-reduce", "-c", "2"], "invalid choice"),
        (["all-reduce", "-b", "2", "-e", "2"], "smaller than one float32 element"),
        (["update", "-d", "int32", "-b", "4K", "-e", "4K"], "floating-point"),
        (["update", "--optimizer", "adadelta"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
        (["step", "--batch", "2", "--replicas", "4"], "smaller than --replicas"),
        (["all-reduce", "--budget", "-1"], "--budget must be a positive number of seconds, got -1"),
        (["all-reduce", "--budget", "0"], "--budget must be a positive number of seconds"),
        (["all-reduce", "--budget", "nan"], "--budget must be a positive number of seconds"),
        (["all-reduce", "--json", "/nonexistent-dir/out.json"], "cannot write /nonexistent-dir/out.json: no directory"),
        (["all-reduce", "--json", "/"], "/ is a directory"),
        (["all-reduce", "--workers", "2", "--json", "/nonexistent-dir/x.json"], "no directory /nonexistent-dir"),
        (["all-reduce", "--workers", "2", "--budget", "-1"], "--budget must be a positive number"),
    ],
)
def test_bad_flags_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--backend", "numpy"] if "--backend" not in argv and argv[0] != "frobnicate" else argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["all-reduce", "split", "update", "user-path"])
def test_sizes_beyond_the_machine_are_a_clear_error(capsys, cmd):
    # `-b 1T` used to end in a traceback (numpy's "Unable to allocate 1.00 TiB").
    with pytest.raises(SystemExit) as e:
        main([cmd, "-b", "1T", "-e", "1T", "--backend", "numpy"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "size 1T needs at least 1T of memory, more than this machine's" in err and "Traceback" not in err


def test_replicas_times_size_beyond_the_machine_and_out_of_memory_exit_2(capsys, monkeypatch):
    from cudist.bench import _ops, _sizes

    monkeypatch.setattr(_sizes, "physical_memory", lambda: 1 << 20)
    with pytest.raises(SystemExit) as e:
        main(["all-reduce", "-b", "512K", "-e", "512K", "--replicas", "4", "--backend", "numpy", "--no-progress"])
    assert e.value.code == 2
    assert "all-reduce of 512K on 4 replicas needs at least 4 x 512K of memory, more than this machine's 1M" in capsys.readouterr().err
    monkeypatch.undo()

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 16.0 GiB")

    monkeypatch.setattr(_ops, "make_case", no_memory)
    with pytest.raises(SystemExit) as e:
        main(["all-reduce", *TINY, "--backend", "numpy"])
    assert e.value.code == 2
    assert "out of memory (Unable to allocate 16.0 GiB); use smaller sizes" in capsys.readouterr().err


def test_unavailable_backend_is_a_clear_error(capsys, monkeypatch):
    from cudist import _kernels

    monkeypatch.setattr(_kernels, "_importable", lambda mod: mod != "cupy")
    with pytest.raises(SystemExit) as e:
        main(["broadcast", "--backend", "cupy", "-b", "4K", "-e", "4K"])
    assert e.value.code == 2
    assert "'cupy' is not available" in capsys.readouterr().err


def test_compare_tf_without_tensorflow_is_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CUDIST_BENCH_TF_PYTHON", raising=False)
    rc, doc = _run(tmp_path, "broadcast", *TINY, "--backend", "numpy", "--compare", "tf",
                   "--tf-python", str(tmp_path / "no-such-python"))
    assert rc == 0
    assert "# tf: skipped" in capsys.readouterr().out
    assert all(r["api"] == "kernel" for r in _rows(doc))


def test_json_to_stdout_keeps_stdout_pure(capsys):
    assert main(["broadcast", *TINY, "--backend", "numpy", "--json", "-"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [r["size"] for r in _rows(doc)] == [4 << 10, 16 << 10]
    assert "# Out of bounds values : 0 OK" in captured.err


def test_time_calls_budget_limits_slow_points():
    import time

    from cudist.bench._timing import time_calls

    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.01)

    samples = time_calls(slow, 100, 1, budget_s=0.02)
    assert len(samples) == 5 and len(calls) == 6  # the floor of 5 timed iterations, plus the warm-up
    assert all(s >= 0.01e9 for s in samples)
    assert len(time_calls(lambda: None, 50, 2, budget_s=1.0)) == 50


def test_progress_line_fallback(capsys):
    from cudist.bench._progress import Progress

    with Progress(2, "sweep", enabled=True, delay=0) as p:
        p._kind = "line"  # the fallback even where tqdm is installed
        p.update("a")
        p.update("b")
    err = capsys.readouterr().err
    assert "sweep" in err and "2/2" in err


# ------------------------------------------------------------------------------------------ subprocess
def test_python_m_and_all_backends(tmp_path):
    """``python -m cudist.bench`` end to end, every available CPU backend checked bit for bit."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cudist.bench", "all-reduce", *TINY, "--backend", "all", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    from cudist._kernels import available_backends

    cpu = [b for b in available_backends() if b != "cupy"]
    rows = _rows(doc)
    assert {r["backend"] for r in rows} == set(cpu)
    assert all(r["wrong"] == 0 for r in rows)
    assert "# Out of bounds values : 0 OK" in proc.stdout


def test_console_script_version():
    exe = shutil.which("cudist-bench", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the cudist-bench console script is not installed next to this python")
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("cudist-bench ")


def _tf_python():
    p = os.environ.get("CUDIST_BENCH_TF_PYTHON") or "/tmp/tfvenv/bin/python"
    return p if os.path.isfile(p) else None


@pytest.mark.slow
@pytest.mark.skipif(_tf_python() is None, reason="no python with TensorFlow (set CUDIST_BENCH_TF_PYTHON)")
def test_compare_tf(tmp_path):
    rc, doc = _run(tmp_path, "all-reduce", "-b", "4K", "-e", "4K", "-n", "2", "-w", "1", "--replicas", "2",
                   "--backend", "numpy", "--no-progress", "--copy-size", "1M", "--compare", "tf",
                   "--tf-python", _tf_python())
    assert rc == 0
    tf_rows = [r for r in _rows(doc) if r["api"] == "tf"]
    assert len(tf_rows) == 1 and tf_rows[0]["wrong"] == 0 and tf_rows[0]["time_us"] > 0


def test_update_covers_every_optimizer(tmp_path):
    """cudist-bench update runs every optimizer's fused kernel, checked against the reference."""
    from cudist.bench import _cli
    from cudist.bench._ops import UPDATE_OPTIMIZERS

    assert tuple(_cli.UPDATE_OPTIMIZERS) == UPDATE_OPTIMIZERS
    assert set(UPDATE_OPTIMIZERS) >= {"sgd", "momentum", "adamw", "rmsprop", "rmsprop_momentum_average_gradient",
                                      "adagrad", "adamax", "nadam", "lion"}
    moved = {"rmsprop": (3, 2), "rmsprop_momentum_average_gradient": (5, 4), "rmsprop_momentum": (4, 3),
             "adagrad": (3, 2), "lion": (3, 2), "adamw": (4, 3), "adamax": (4, 3), "nadam": (4, 3)}
    for opt, (r, w) in moved.items():
        rc, doc = _run(tmp_path, "update", "--optimizer", opt, *TINY, "--replicas", "3", "-d", "float32,float16")
        assert rc == 0
        for row in _rows(doc):
            assert row["wrong"] == 0, (opt, row)
            assert row["moved_bytes"] == (r + w * 3) * row["size"]


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adamw"])
def test_update_case_mirrors_are_distinct_buffers(opt):
    # Aliased mirrors would let every copy's write hit the same cached lines and overstate bandwidth.
    from cudist._kernels._numpy import NumpyBackend
    from cudist.bench._ops import make_case

    seen = []

    class Spy(NumpyBackend):
        def _hook_sgd(self, copies, grad, lr, decay):
            seen.append([copies])
            return super()._hook_sgd(copies, grad, lr, decay)

        def _hook_momentum(self, copies, vels, grad, lr, momentum, decay):
            seen.append([copies, vels])
            return super()._hook_momentum(copies, vels, grad, lr, momentum, decay)

        def _hook_nesterov(self, copies, vels, grad, lr, momentum, decay):
            seen.append([copies, vels])
            return super()._hook_nesterov(copies, vels, grad, lr, momentum, decay)

        def _hook_adamw(self, copies, ms, vs, grad, lr_t, b1, b2, eps, decay):
            seen.append([copies, ms, vs])
            return super()._hook_adamw(copies, ms, vs, grad, lr_t, b1, b2, eps, decay)

    case = make_case(f"update/{opt}", Spy(), 64, "float32", 4)
    assert case.check() == 0
    case.run()
    for groups in seen:
        bufs = [b for g in groups for b in g]
        assert len({b.ctypes.data for b in bufs}) == len(bufs)


def _mpi_job_missing():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    from cudist.launch import find_mpiexec

    return None if find_mpiexec() else "no mpiexec"


@pytest.mark.multi_worker
@pytest.mark.skipif(_mpi_job_missing() is not None, reason=f"needs MPI: {_mpi_job_missing()}")
def test_workers_take_the_common_flags(tmp_path):
    """`all-reduce --workers 2` with the common flags that make sense there (--no-progress and --seed
    included): dtypes, MEAN, replicas, backend, JSON; every row checked against the exact result."""
    out = tmp_path / "mw.json"
    cmd = [sys.executable, "-m", "cudist.bench", "all-reduce", "--workers", "2", "-b", "4K", "-e", "16K", "-f", "4",
           "-n", "2", "-w", "1", "--no-progress", "--seed", "3", "-d", "float64,int32", "-o", "mean",
           "--replicas", "2", "--backend", "numpy", "-c", "1", "--rounds", "2", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["workers"] == 2 and doc["replicas_per_worker"] == 2 and doc["op"] == "mean" and doc["ok"]
    assert [(r["dtype"], r["bytes"]) for r in doc["rows"]] == [
        ("float64", 4096), ("float64", 16384), ("int32", 4096), ("int32", 16384)]
    assert all(r["check"] for r in doc["rows"])
    assert all(len(r["round_ratios"]) == 2 and min(r["round_ratios"]) > 0 for r in doc["rows"])  # one per round
    assert "float64, int32 MEAN" in p.stdout


@pytest.mark.parametrize("argv, message", [
    (["--compare", "tf"], "--compare: TensorFlow is compared in one process only"),
    (["--budget", "1"], "--budget"),
    (["--copy-size", "1M"], "--copy-size"),
    (["-d", "float16"], "-d/--datatype float16: not available with --workers"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_workers_refuse_flags_without_meaning_there(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["all-reduce", *(["--workers", "2"] if "--workers" not in argv else []), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_optimizer_defaults_come_from_the_registries():
    """``--optimizer`` left out is filled from the registries (the parser itself names no rule)."""
    from cudist.bench._cli import _default_optimizer, build_parser
    from cudist.bench._ops import SUITE_UPDATES
    from cudist.bench._strategy_bench import STEP_OPTIMIZERS

    parser = build_parser()
    for argv, expected in ((["update"], SUITE_UPDATES[0]), (["step"], STEP_OPTIMIZERS[0]),
                           (["update", "--optimizer", "adamw"], "adamw"), (["step", "--optimizer", "adam"], "adam")):
        args = parser.parse_args(argv)
        _default_optimizer(args)
        assert args.optimizer == expected, argv


def test_bench_make_optimizer():
    """One factory builds the benches' optimizers; an unknown kind is a ValueError naming the kinds."""
    from cudist.bench._strategy_bench import STEP_OPTIMIZERS, make_optimizer

    momentum = make_optimizer("momentum", 0.05)
    assert momentum.get_config()["momentum"] == pytest.approx(0.9)
    assert momentum.get_config()["learning_rate"] == pytest.approx(0.05)
    assert make_optimizer(STEP_OPTIMIZERS[0]).get_config()["momentum"] == 0.0
    adam = make_optimizer("adam", beta_2=0.99)
    assert type(adam) is not type(momentum) and adam.get_config()["beta_2"] == pytest.approx(0.99)
    with pytest.raises(ValueError, match="sgd, momentum, adam"):
        make_optimizer("lamb")
