"""Argument parsing, the sweep driver, the header / table / summary output and ``--json``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator

from cudist import _settings
from cudist.bench import _tf
from cudist.bench._errors import BenchError
from cudist.bench._sizes import check_fits_in_memory, format_size, parse_size, size_sweep

class _Names:
    """A tuple of workload names another bench module registers (``module.attr``), read on first use,
    so that building the parser imports no NumPy: the registries name the workloads, not this file."""

    def __init__(self, module: str, attr: str) -> None:
        self._where = (module, attr)

    def _names(self) -> tuple[str, ...]:
        module, attr = self._where
        return tuple(getattr(importlib.import_module(module), attr))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return repr(self._names())

    def __str__(self) -> str:
        return ",".join(self._names())


#: ``update --optimizer`` choices: derived from the kernels' table.
UPDATE_OPTIMIZERS = _Names("cudist.bench._ops", "UPDATE_OPTIMIZERS")
#: ``user-path --groups``: every group, and the default list.
_USER_PATH_GROUPS = _Names("cudist.bench._user_path", "GROUPS")
_USER_PATH_DEFAULT = _Names("cudist.bench._user_path", "DEFAULT_GROUPS")
#: ``step --optimizer`` choices.
_STEP_OPTIMIZERS = _Names("cudist.bench._strategy_bench", "STEP_OPTIMIZERS")

__all__ = ["main", "build_parser"]

KERNEL_OPS = ("all-reduce", "all-gather", "broadcast", "split", "update")
SUBCOMMANDS = KERNEL_OPS + ("run-overhead", "step", "user-path", "suite")
_DTYPE_ALIASES = {
    "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "double": "float64",
    "fp64": "float64", "int": "int32", "int32": "int32", "int64": "int64", "long": "int64",
    "bf16": "bfloat16",
}
_BACKEND_CHOICES = ("numpy", "numba", "native", "cupy", "all")


# ---------------------------------------------------------------------------------------- parsing
def _size_arg(text):
    try:
        size = parse_size(text)
        check_fits_in_memory(size, 1, f"size {text}")  # e.g. -b 1T: not even one buffer fits
        return size
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(name, minimum=1):
    def conv(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {v}")
        return v

    return conv


def _positive_seconds(name):
    def conv(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, got {text!r}") from None
        if not v > 0 or v == float("inf"):  # (NaN too)
            raise argparse.ArgumentTypeError(f"{name} must be a positive number of seconds, got {text}")
        return v

    return conv


def json_destination(text):
    """``--json FILE``: checked before the run (a run of minutes must not end in a traceback).

    ``-`` is stdout; otherwise FILE's directory must exist and be writable, and FILE must not be a
    directory.
    """
    if text == "-":
        return text
    directory = os.path.dirname(text) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"cannot write {text}: no directory {directory}")
    if not os.access(directory, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def file_destination(text):
    """``--csv FILE`` and ``--plot FILE``: checked before the run, as :func:`json_destination` checks
    ``--json`` (FILE's directory exists and is writable, FILE is not a directory); ``-`` is refused."""
    if text == "-":
        raise argparse.ArgumentTypeError("give a file name ('-' is stdout only for --json)")
    return json_destination(text)


def _dtype_list(text):
    import numpy as np

    from cudist._kernels import SUPPORTED_DTYPES

    out = []
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if names == ["all"]:
        return [d.name for d in SUPPORTED_DTYPES]
    for t in names:
        name = _DTYPE_ALIASES.get(t.lower(), t.lower())
        if name == "bfloat16":  # ml_dtypes' (the bf16 extra); importing it registers the name with NumPy
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                raise argparse.ArgumentTypeError(
                    "dtype bfloat16 needs the ml_dtypes package (pip install 'cudist[bf16]')"
                ) from None
            out.append(name)
            continue
        try:
            dt = np.dtype(name)
        except TypeError:
            dt = None
        if dt is None or dt not in SUPPORTED_DTYPES:
            raise argparse.ArgumentTypeError(
                f"unsupported dtype {t!r}; expected one of {', '.join(d.name for d in SUPPORTED_DTYPES)} "
                "(or bfloat16/bf16 with ml_dtypes, float/double/half/int/long, a comma-separated list, or 'all')"
            )
        out.append(dt.name)
    if not out:
        raise argparse.ArgumentTypeError("empty dtype list")
    return out


def _groups_arg(text):
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    allowed = tuple(_USER_PATH_GROUPS)
    bad = [t for t in names if t not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown group(s) {', '.join(bad) or '(none)'}; expected a comma list of "
                                         + ", ".join(allowed))
    return names


def _common_parser(*, sizes=True, defaults=None, dtype_op=True):
    d = {"b": "4K", "e": "64M", "f": 4, "n": 20, "w": 5, "replicas": 4, **(defaults or {})}
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common options")
    if sizes:
        g.add_argument("-b", "--minbytes", type=_size_arg, default=parse_size(d["b"]),
                       help=f"smallest size in bytes per replica; K/M/G suffixes (default {d['b']})")
        g.add_argument("-e", "--maxbytes", type=_size_arg, default=parse_size(d["e"]),
                       help=f"largest size in bytes per replica (default {d['e']})")
        g.add_argument("-f", "--stepfactor", type=_positive_int("-f"), default=d["f"],
                       help=f"multiplication factor between sizes (default {d['f']})")
    if sizes and dtype_op:
        g.add_argument("-d", "--datatype", type=_dtype_list, default=["float32"],
                       help="dtype(s): float16, float32, float64, int32, int64, bfloat16 (needs ml_dtypes), a comma list, "
                            "or 'all' (default float32)")
        g.add_argument("-o", "--op", type=str.lower, choices=("sum", "mean"), default="sum",
                       help="reduction op for all-reduce (default sum)")
    g.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="1: check every size against the NumPy reference and count wrong elements (default 1)")
    g.add_argument("-n", "--iters", type=_positive_int("-n"), default=d["n"],
                   help=f"timed iterations per point; the median is reported (default {d['n']})")
    g.add_argument("-w", "--warmup_iters", type=_positive_int("-w", 0), default=d["w"],
                   help=f"untimed warm-up iterations (default {d['w']})")
    g.add_argument("--replicas", type=_positive_int("--replicas"), default=d["replicas"],
                   help=f"number of replicas / mirrored copies (default {d['replicas']})")
    g.add_argument("--backend", type=str.lower, choices=_BACKEND_CHOICES, default="all",
                   help="kernel backend, or 'all' available ones (default all)")
    g.add_argument("--json", metavar="FILE", type=json_destination,
                   help="also write every result as JSON to FILE ('-' for stdout)")
    g.add_argument("--csv", metavar="FILE", type=file_destination,
                   help="also write every measured point as a CSV row to FILE")
    g.add_argument("--plot", metavar="FILE", type=file_destination,
                   help="also draw bandwidth against size (one panel per table, the copy ceiling dotted) to FILE "
                   "(.png, .svg, .pdf, ...); needs matplotlib: pip install \"cudist[plot]\"")
    g.add_argument("--compare", choices=("tf",), help="also time TensorFlow's MirroredStrategy for the same work")
    g.add_argument("--tf-python", metavar="PATH",
                   help="python with TensorFlow for --compare tf (default: $CUDIST_BENCH_TF_PYTHON, else this python)")
    g.add_argument("--tf-mode", choices=("function", "eager", "both"), default="function",
                   help="run TF's strategy.run inside tf.function (default), eagerly, or both")
    g.add_argument("--copy-size", type=_size_arg, default=parse_size("64M"),
                   help="buffer size of the copy-bandwidth measurement in the header (default 64M)")
    g.add_argument("--budget", type=_positive_seconds("--budget"), default=d.get("budget"), metavar="SECONDS",
                   help="cap the time of one point: slow points get fewer timed iterations (at least 5)"
                   + (f" (default {d['budget']})" if d.get("budget") else " (default: no cap)"))
    g.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    g.add_argument("--seed", type=int, default=0, help="seed of the random data (default 0)")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The full ``cudist-bench`` parser (subcommands with their flags)."""
    import cudist

    parser = argparse.ArgumentParser(
        prog="cudist-bench",
        description="nccl-tests-style microbenchmarks of cudist's kernels (all-reduce, all-gather, broadcast, "
        "split, mirrored updates) and strategies (run overhead, a data-parallel training step, the user's path: "
        "strategy.run + all_reduce and apply_gradients next to the kernels). "
        "Without a subcommand: the default suite (about a minute on 2 cores).",
    )
    parser.add_argument("-V", "--version", action="version", version=f"cudist-bench {cudist.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    helps = {
        "all-reduce": "fused all-reduce of N replica buffers (SUM/MEAN)",
        "all-gather": "concatenate N replica buffers",
        "broadcast": "copy one buffer into N replica buffers",
        "split": "split a batch into N per-replica pieces (ceil rule)",
        "update": "fused mirrored optimizer update of N copies (--optimizer)",
    }
    for name in KERNEL_OPS:
        sp = sub.add_parser(name, parents=[_common_parser()], help=helps[name], description=helps[name])
        if name == "update":
            sp.add_argument("--optimizer", type=str.lower, choices=UPDATE_OPTIMIZERS, default=None,
                            help="update rule: a kernel variant of the rules' table (default: the suite's "
                            "first, plain gradient descent)")
    sp = sub.add_parser(
        "run-overhead",
        parents=[_common_parser(sizes=False, defaults={"n": 200, "w": 20})],
        help="cost of strategy.run: a no-op and one scalar all_reduce",
        description="Times MirroredStrategy.run on --replicas logical CPUs with a no-op function and with "
        "one scalar ReplicaContext.all_reduce (and OneDeviceStrategy.run for scale).",
    )
    sp = sub.add_parser(
        "step",
        parents=[_common_parser(sizes=False, defaults={"n": 20, "w": 3})],
        help="a synthetic data-parallel training step of a small MLP",
        description="Per-replica forward/backward of a 2-layer MLP in NumPy, a MEAN all-reduce of the "
        "gradients and a mirrored update (--optimizer), via the kernel layer and via MirroredStrategy.run + "
        "cudist.optimizers.",
    )
    sp.add_argument("--batch", type=_positive_int("--batch"), default=256, help="global batch size (default 256)")
    sp.add_argument("--features", type=_positive_int("--features"), default=256, help="input features (default 256)")
    sp.add_argument("--hidden", type=_positive_int("--hidden"), default=1024, help="hidden units (default 1024)")
    sp.add_argument("--classes", type=_positive_int("--classes"), default=16, help="outputs (default 16)")
    sp.add_argument("--optimizer", type=str.lower, choices=_STEP_OPTIMIZERS, default=None,
                    help="(default: the first, plain gradient descent)")
    sp.add_argument("--api", choices=("kernel", "strategy", "both"), default="both",
                    help="drive the step through the kernel layer, the strategy API, or both (default both)")
    sp = sub.add_parser(
        "user-path",
        parents=[_common_parser(defaults={"b": "256K", "e": "64M", "f": 16, "n": 10, "w": 2}, dtype_op=False)],
        help="the user's path (strategy.run + all_reduce, apply_gradients) next to the kernels",
        description="Per size (float32 bytes per replica): the bare in-place all-reduce kernel, strategy.run with "
        "ReplicaContext.all_reduce('sum') on a PerReplica array, the plain NumPy loop and, with --compare tf, "
        "TensorFlow's strategy.run + all_reduce in tf.function; then optimizer.apply_gradients inside "
        "strategy.run (the optimizer groups) next to the kernels and a NumPy loop doing the same update. "
        "Rows take turns in interleaved rounds (-n rounds after -w warm-up rounds); %%copy divides by a copy of "
        "--copy-size bytes timed before and after them, %%same by a copy spanning the point's working set timed "
        "in the rounds (the bandwidth of memory in the same cache state). --backend picks the kernels of both the "
        "kernel rows and the strategy (all: the default backend).",
    )
    sp.add_argument("--groups", type=_groups_arg, default=_USER_PATH_DEFAULT,
                    help="comma list of groups (default %(default)s)")
    sp.add_argument("--round-ms", type=float, default=20.0, metavar="MS",
                    help="time of one row's block of calls in a round; fast calls repeat to fill it (default 20)")
    sub.add_parser(
        "suite",
        parents=[_common_parser(sizes=False, defaults={"n": 20, "w": 3, "budget": 0.5})],
        help="the default suite (what plain `cudist-bench` runs)",
    )
    return parser


# ---------------------------------------------------------------------------------------- context
class Context:
    """State shared by the parts of one invocation: header facts, results, output."""

    def __init__(self, args, out=None):
        self.args = args
        self.out = out or sys.stdout
        self.tables: list[dict] = []
        self.header: dict = {}
        self.copy_bw = None
        self.gpu_copy_bw = None
        self._header_done = False
        self.progress = None
        self.notes: list[str] = []

    def print(self, line: str = "") -> None:
        if self.progress is not None:
            self.progress.clear()
        print(line, file=self.out, flush=True)

    def progress_enabled(self):
        return False if getattr(self.args, "no_progress", False) else None

    # --------------------------------------------------------------- header
    def backends(self) -> list:
        """The backends to run, loaded; unavailable ones named in --backend are an error."""
        if getattr(self, "_backends", None) is not None:
            return self._backends
        self._backends = self._load_backends()
        return self._backends

    def _load_backends(self) -> list:
        from cudist._kernels import BackendUnavailableError, available_backends, get_backend

        want = self.args.backend
        if want != "all":
            try:
                return [get_backend(want)]
            except BackendUnavailableError as e:
                raise BenchError(str(e)) from None
        out = []
        for name in ("numpy", "numba", "native", "cupy"):
            if name not in available_backends():
                continue
            try:
                out.append(get_backend(name))
            except BackendUnavailableError as e:
                self.notes.append(f"skipped backend {name}: {e}")
        return out

    def print_header(self, *, copy_bw: bool = True) -> None:
        if self._header_done:
            return
        self._header_done = True
        import platform

        import cudist
        from cudist.bench import _sysinfo

        a = self.args
        h = self.header
        h["cudist"] = cudist.__version__
        h["python"] = platform.python_version()
        h["cpu"] = _sysinfo.cpu_model()
        h["cores"] = _sysinfo.core_count()
        h["backends"] = _sysinfo.backend_versions()
        self.print(f"# cudist-bench {cudist.__version__}: {' '.join(a._argv) or '(default suite)'}")
        h["last_level_cache"] = _sysinfo.last_level_cache()
        llc = f", {h['last_level_cache']} last-level cache" if h["last_level_cache"] else ""
        self.print(f"# CPU: {h['cpu']}, {h['cores']} cores{llc}; Python {h['python']}")
        self.print("# backends: " + ", ".join(f"{k} ({v})" for k, v in h["backends"].items()))
        for be in getattr(self, "_backends", None) or ():
            if be.name == "cupy":  # the loaded GPU backend: C++ launchers or NVRTC (CUDIST_CUDA_LAUNCHERS)
                h["cupy_launch_path"] = be.launch_path
                self.print(f"# cupy launch path: {be.launch_path}")
        for n in self.notes:
            self.print(f"# note: {n}")
        if copy_bw:
            bw = _sysinfo.measure_copy_bandwidth(a.copy_size)
            self.copy_bw = bw
            h["copy_bandwidth"] = {"bytes": bw.nbytes, "GBps": bw.results, "ceiling": bw.best, "method": bw.best_method}
            parts = "; ".join(f"{k} {v:.1f}" for k, v in bw.results.items())
            self.print(f"# copy bandwidth ({format_size(bw.nbytes)} buffer, bytes read + written per second, GB/s): {parts}")
            self.print(f"# copy ceiling: {bw.best:.1f} GB/s ({bw.best_method}); %copy = bytes moved / time / ceiling "
                       "(points whose buffers fit in cache can exceed 100%)")
            if any(b.name == "cupy" for b in self.backends()):
                from cudist.bench._sysinfo import measure_gpu_copy_bandwidth

                self.gpu_copy_bw = measure_gpu_copy_bandwidth()
                if self.gpu_copy_bw:
                    h["gpu_copy_bandwidth"] = self.gpu_copy_bw
                    self.print(f"# GPU copy ceiling (cupy rows): {self.gpu_copy_bw:.1f} GB/s (cupy.copyto, device to device)")

    def add_table(self, name: str, rows: list, **meta) -> None:
        self.tables.append({"name": name, "rows": rows, **meta})


# ---------------------------------------------------------------------------------------- kernel sweeps
_COLS = ("size", "count", "type", "op", "backend", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "%copy", "#wrong")
_ROW_FMT = "{:>10} {:>11} {:>8} {:>9} {:>8} {:>10} {:>12} {:>12} {:>7} {:>7}"


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _row_line(r) -> str:
    return " " + _ROW_FMT.format(
        format_size(r["size"]), r["count"], r["dtype"], r["op"], r["backend"], _fmt(r["time_us"], ".2f"),
        _fmt(r["algbw"], ".2f"), _fmt(r["busbw"], ".2f"), _fmt(r["pct_copy"], ".1f"),
        "-" if r["wrong"] is None else r["wrong"],
    )


def _finish_row(row, spec, n, ceiling):
    t = row["time_us"] * 1e-6
    size = row["size"]
    row["algbw"] = spec.algbw_bytes(size, n) / t / 1e9 if t > 0 else None
    moved = spec.moved_bytes(size, n)
    row["moved_bytes"] = moved
    if spec.busbw_factor is None:
        row["busbw"] = moved / t / 1e9 if t > 0 else None
    else:
        row["busbw"] = row["algbw"] * spec.busbw_factor(n) if row["algbw"] is not None else None
    row["pct_copy"] = 100.0 * moved / t / 1e9 / ceiling if (moved and ceiling and t > 0) else None
    return row


def run_kernel_op(ctx: Context, op: str, *, sizes=None, dtypes=None, title=None) -> list:
    """Sweeps one kernel operation over sizes x dtypes x backends; prints and returns the rows."""
    import numpy as np

    from cudist.bench._ops import OPS, make_case
    from cudist.bench._progress import Progress
    from cudist.bench._timing import median_us, time_calls

    a = ctx.args
    opname = f"update/{a.optimizer}" if op == "update" else op
    spec = OPS[opname]
    n = a.replicas
    if sizes is None:
        try:
            sizes = size_sweep(a.minbytes, a.maxbytes, a.stepfactor)
        except ValueError as e:
            raise BenchError(str(e)) from None
    dtypes = dtypes or a.datatype
    if spec.floats_only:
        bad = [d for d in dtypes if np.dtype(d).kind != "f"]
        if bad:
            raise BenchError(f"{opname} needs floating-point dtypes; got {', '.join(bad)}")
    for d in dtypes:
        small = [s for s in sizes if s < np.dtype(d).itemsize]
        if small:
            raise BenchError(f"size {format_size(small[0])} is smaller than one {d} element ({np.dtype(d).itemsize} bytes)")
    try:  # every replica holds at least one buffer of the size
        check_fits_in_memory(max(sizes), n, f"{opname} of {format_size(max(sizes))} on {n} replicas")
    except ValueError as e:
        raise BenchError(str(e)) from None
    backends = ctx.backends()
    ctx.print_header()
    oplabel = a.optimizer if op == "update" else (a.op if op == "all-reduce" else "-")
    ctx.print()
    ctx.print(f"# {title or opname}: {n} replicas, sizes in bytes per replica, median of {a.iters} iterations "
              f"after {a.warmup_iters} warm-up, check {'on' if a.check else 'off'}")
    ctx.print(f"# bytes moved for %copy: {spec.moved_formula}" + ("; busbw = bytes moved / time" if spec.busbw_factor is None else ""))
    ctx.print("#" + _ROW_FMT.format(*_COLS)[1:])
    rows = []
    points = [(s, d, be) for d in dtypes for s in sizes for be in backends]
    with Progress(len(points), opname, enabled=ctx.progress_enabled()) as prog:
        ctx.progress = prog
        try:
            for size, dt, be in points:
                itemsize = np.dtype(dt).itemsize
                count = size // itemsize
                if not be.computes(np.dtype(dt)):
                    ctx.print(f"# {be.name} does not support {dt}; skipped")
                    prog.update()
                    continue
                case = make_case(opname, be, count, dt, n, redop=a.op, seed=a.seed)
                wrong = case.check() if a.check else None
                sync = _sync_for(be)
                # Repeated in-place SUMs grow geometrically and reach inf after a few dozen iterations
                # (float16: ~8). IEEE inf arithmetic runs at full speed, and the check above ran on
                # fresh data, so only NumPy's overflow warning needs silencing here.
                with np.errstate(over="ignore", invalid="ignore"):
                    samples = time_calls(case.run, a.iters, a.warmup_iters, sync, budget_s=a.budget)
                del case
                ceiling = ctx.gpu_copy_bw if be.name == "cupy" else (ctx.copy_bw.best if ctx.copy_bw else None)
                row = _finish_row(
                    {"op_name": opname, "size": count * itemsize, "count": count, "dtype": dt, "op": oplabel,
                     "backend": be.name, "replicas": n, "time_us": median_us(samples),
                     "min_us": min(samples) / 1e3, "iters": len(samples), "wrong": wrong, "api": "kernel"},
                    spec, n, ceiling,
                )
                rows.append(row)
                ctx.print(_row_line(row))
                prog.update(f"{be.name} {format_size(size)} {dt}")
        finally:
            ctx.progress = None
    if a.compare == "tf":
        rows += _compare_tf_kernel(ctx, opname, sizes, dtypes, n, spec, oplabel)
    _print_ratios(ctx, rows)
    ctx.add_table(opname, rows, replicas=n, iters=a.iters, warmup=a.warmup_iters)
    return rows


def _sync_for(be):
    if be.name != "cupy":
        return None
    import cupy

    return cupy.cuda.Device().synchronize


def _compare_tf_kernel(ctx, opname, sizes, dtypes, n, spec, oplabel) -> list:
    a = ctx.args
    if opname == "split":
        ctx.print("# tf: no TensorFlow counterpart timed for split (its input pipeline is not a kernel)")
        return []
    spec_tf = {"op": opname, "sizes": sizes, "dtypes": dtypes, "replicas": n, "redop": a.op, "iters": a.iters,
               "warmup": a.warmup_iters, "modes": _tf.modes(a), "check": a.check, "seed": a.seed}
    if opname.startswith("update/"):
        from cudist.bench._ops import tf_update

        spec_tf["tf_update"] = tf_update(opname)
    res = _tf.compare(ctx, spec_tf)
    if res is None:
        return []
    ctx.print(f"# tf: TensorFlow {res.get('version')} MirroredStrategy on {n} logical CPUs ({res.get('python')})")
    rows = []
    for r in res["rows"]:
        row = _finish_row(
            {"op_name": opname, "size": r["size"], "count": r["count"], "dtype": r["dtype"], "op": oplabel,
             "backend": "tf-" + ("fn" if r["mode"] == "function" else "eager"), "replicas": n,
             "time_us": r["time_us"], "min_us": r["min_us"], "wrong": r.get("wrong"), "api": "tf", "mode": r["mode"]},
            spec, n, ctx.copy_bw.best if ctx.copy_bw else None,
        )
        rows.append(row)
        ctx.print(_row_line(row))
    return rows


def _print_ratios(ctx, rows) -> None:
    """One line per (size, dtype): how many times faster each backend is than numpy and than TF."""
    by_point: dict = {}
    for r in rows:
        by_point.setdefault((r["size"], r["dtype"]), {})[r["backend"]] = r["time_us"]
    lines = []
    for (size, dt), times in by_point.items():
        refs = [k for k in ("numpy", "tf-fn", "tf-eager") if k in times]
        mine = [k for k in times if not k.startswith("tf-")]
        parts = []
        for ref in refs:
            for k in mine:
                if k != ref and times[k] and times[k] > 0:
                    parts.append(f"{k} {times[ref] / times[k]:.1f}x vs {ref}")
        if parts:
            lines.append(f"#   {format_size(size):>6} {dt}: " + ", ".join(parts))
    if lines:
        ctx.print("# speedup (median time ratio):")
        for ln in lines:
            ctx.print(ln)


# ---------------------------------------------------------------------------------------- summary / json
def _summary(ctx) -> dict:
    rows = [r for t in ctx.tables for r in t["rows"]]
    wrong = sum(r.get("wrong") or 0 for r in rows)
    checked = [r for r in rows if r.get("wrong") is not None]
    bus = [r["busbw"] for r in rows if r.get("api") == "kernel" and r.get("busbw") is not None]
    by_be: dict = {}
    for r in rows:
        if r.get("api") == "kernel" and r.get("busbw") is not None and "busbw" in r:
            by_be.setdefault(r["backend"], []).append(r["busbw"])
    errors = [r["error"] for r in rows if r.get("error")]
    return {
        "errors": errors,
        "out_of_bounds": wrong,
        "checked_points": len(checked),
        "ok": wrong == 0 and not errors,
        "avg_busbw": sum(bus) / len(bus) if bus else None,
        "avg_busbw_by_backend": {k: sum(v) / len(v) for k, v in by_be.items()},
    }


def _print_summary(ctx, s) -> None:
    ctx.print()
    for e in s["errors"]:
        ctx.print(f"# Error                : {e}")
    ctx.print(f"# Out of bounds values : {s['out_of_bounds']} {'OK' if s['out_of_bounds'] == 0 else 'FAILED'}"
              f" ({s['checked_points']} points checked)")
    if s["avg_busbw"] is not None:
        per = ", ".join(f"{k} {v:.2f}" for k, v in s["avg_busbw_by_backend"].items())
        ctx.print(f"# Avg bus bandwidth    : {s['avg_busbw']:.3f} GB/s (kernel rows; by backend: {per})")
    if s.get("elapsed_s") is not None:
        ctx.print(f"# Elapsed              : {s['elapsed_s']:.1f} s")
    ctx.print()


def _write_json(ctx, s, path) -> None:
    doc = {"cudist_bench": ctx.header.get("cudist"), "command": ctx.args.command or "suite",
           "argv": ctx.args._argv, "header": ctx.header, "tables": ctx.tables, "summary": s}
    text = json.dumps(doc, indent=1, default=float)
    if path == "-":
        print(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


# ---------------------------------------------------------------------------------------- suite
def run_suite(ctx) -> None:
    """The default suite: the headline kernel tables, the user's path next to the kernels, then the
    strategy-level ones (run overhead, a training step)."""
    a = ctx.args
    sizes_big = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
    sizes_mid = size_sweep(4 << 10, 16 << 20, 64)
    a.op = "sum"
    run_kernel_op(ctx, "all-reduce", sizes=sizes_big, dtypes=["float32"])
    if importlib.util.find_spec("ml_dtypes") is not None:
        # One bfloat16 row next to float32's: the 64M row's element count in half the bytes.
        import ml_dtypes  # noqa: F401  (registers the name "bfloat16" with NumPy)

        run_kernel_op(ctx, "all-reduce", sizes=[32 << 20], dtypes=["bfloat16"],
                      title="all-reduce bfloat16 (32M: as many elements as the float32 64M row)")
    run_kernel_op(ctx, "broadcast", sizes=sizes_mid, dtypes=["float32"])
    run_kernel_op(ctx, "all-gather", sizes=sizes_mid, dtypes=["float32"])
    from cudist.bench._ops import SUITE_UPDATES

    for opt in SUITE_UPDATES:
        a.optimizer = opt
        run_kernel_op(ctx, "update", sizes=[4 << 10, 1 << 20, 64 << 20], dtypes=["float32"])
    from cudist.bench import _strategy_bench, _user_path

    # The user's path next to the kernels (strategy.run + all_reduce, apply_gradients): small sizes and
    # few rounds, so the suite stays about a minute; `cudist-bench user-path` runs the full sweep.
    iters, warmup = a.iters, a.warmup_iters
    a.iters, a.warmup_iters, a.groups, a.round_ms = 5, 1, list(_user_path.SUITE_GROUPS), 10.0
    _user_path.run_user_path(ctx, sizes=[256 << 10, 4 << 20])
    a.iters, a.warmup_iters = iters, warmup
    a.iters, a.warmup_iters = max(a.iters, 100), max(a.warmup_iters, 10)
    _strategy_bench.run_overhead(ctx)
    a.iters, a.warmup_iters = 5, 1
    a.batch, a.features, a.hidden, a.classes, a.api = 256, 256, 512, 16, "both"
    a.optimizer = _strategy_bench.STEP_OPTIMIZERS[-1]  # the one with slots
    _strategy_bench.run_step(ctx)


# ---------------------------------------------------------------------------------------- main
def _default_optimizer(args: argparse.Namespace) -> None:
    """Fills ``--optimizer`` left out from the registries (a string default would name a rule here,
    and building the parser must not import them)."""
    if getattr(args, "optimizer", "") is not None:
        return
    if args.command == "update":
        from cudist.bench._ops import SUITE_UPDATES

        args.optimizer = SUITE_UPDATES[0]
    else:
        from cudist.bench._strategy_bench import STEP_OPTIMIZERS

        args.optimizer = STEP_OPTIMIZERS[0]


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--workers" or a.startswith("--workers=") for a in argv):
        # Across worker processes (MultiWorkerMirroredStrategy against raw mpi4py, under mpiexec).
        from cudist.bench import _multi_worker

        if any(a.split("=", 1)[0] in ("--plot", "--csv") for a in argv):
            parser.exit(2, "cudist-bench: error: --plot and --csv are not available with --workers (use --json)\n")
        return _multi_worker.main(argv, _common_parser(defaults=_multi_worker.COMMON_DEFAULTS))
    # Options without a subcommand (`cudist-bench -n 5 --no-progress`) are the default suite's.
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-V", "--version"):
        args = parser.parse_args(["suite"] + argv)
    else:
        args = parser.parse_args(argv)
    args._argv = argv
    if args.command is None:
        args = parser.parse_args(["suite"] + argv)
        args._argv = argv
    if args.tf_python is None:
        args.tf_python = _settings.bench_tf_python()
    _default_optimizer(args)
    # Output files are checked before anything runs: a missing matplotlib or directory fails now, not
    # after minutes of measurement.
    try:
        _check_outputs(args)
    except BenchError as e:
        parser.exit(2, f"cudist-bench: error: {e}\n")
    # With --json -, stdout carries only the JSON document; the human-readable table goes to stderr.
    ctx = Context(args, out=sys.stderr if args.json == "-" else None)
    t0 = time.monotonic()
    try:
        if args.command in KERNEL_OPS:
            run_kernel_op(ctx, args.command)
        elif args.command == "run-overhead":
            from cudist.bench import _strategy_bench

            _strategy_bench.run_overhead(ctx)
        elif args.command == "step":
            from cudist.bench import _strategy_bench

            _strategy_bench.run_step(ctx)
        elif args.command == "user-path":
            from cudist.bench import _user_path

            _user_path.run_user_path(ctx)
        else:
            run_suite(ctx)
    except BenchError as e:
        parser.exit(2, f"cudist-bench: error: {e}\n")
    except MemoryError as e:  # a point that fits the machine but not what is free now
        parser.exit(2, f"cudist-bench: error: out of memory ({e}); use smaller sizes (-b/--minbytes, -e/--maxbytes)\n")
    except KeyboardInterrupt:
        print("cudist-bench: interrupted", file=sys.stderr)
        return 130
    s = _summary(ctx)
    s["elapsed_s"] = time.monotonic() - t0
    _print_summary(ctx, s)
    if args.json:
        _write_json(ctx, s, args.json)
    try:
        _write_outputs(ctx)
    except BenchError as e:
        parser.exit(2, f"cudist-bench: error: {e}\n")
    return 0 if s["ok"] else 1


def _check_outputs(args) -> None:
    """What ``--plot`` needs beyond a writable path (the parser checked that), before anything runs."""
    from cudist.bench import _plot

    if args.plot:
        _plot.check_plot_request(args.plot, args.command or "suite")


def _write_outputs(ctx) -> None:
    """Writes ``--csv`` and ``--plot`` from the run's tables and says where."""
    from cudist.bench import _plot

    a = ctx.args
    if a.csv:
        n = _plot.write_csv(ctx.tables, a.csv)
        print(f"# csv: {n} rows written to {a.csv}", file=sys.stderr)
    if a.plot:
        h = ctx.header
        machine = f"{h.get('cpu', '?')}, {h.get('cores', '?')} cores; cudist {h.get('cudist', '?')}"
        title = f"cudist-bench {' '.join(a._argv) or '(default suite)'}\n{machine}"
        n = _plot.write_plot(ctx.tables, a.plot, title=title)
        print(f"# plot: {n} panel(s) written to {a.plot}", file=sys.stderr)
