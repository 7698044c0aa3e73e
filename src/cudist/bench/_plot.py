"""``--plot FILE`` and ``--csv FILE``: bandwidth-against-size pictures and flat tables of the results.

matplotlib is optional (``pip install "cudist[plot]"``) and imported only when a plot is drawn;
:func:`check_plot_request` runs before any measurement (the parser has checked the output paths),
so a missing matplotlib fails at once rather than after minutes of benchmarking.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re

from cudist.bench._errors import BenchError
from cudist.bench._sizes import format_size

__all__ = ["PLOT_COMMANDS", "check_plot_request", "write_csv", "write_plot", "plot_series"]

#: Subcommands whose tables have a size axis (what ``--plot`` draws); the suite draws those it runs.
PLOT_COMMANDS = ("all-reduce", "all-gather", "broadcast", "split", "update", "user-path", "suite")


def check_plot_request(path: str, command: str) -> None:
    """Everything ``--plot`` needs, checked before anything runs.

    Args:
        path: the image file to write; its suffix picks the format (``.png``, ``.svg``, ``.pdf``, ...).
        command: the subcommand (``suite`` for the default suite).

    The path itself was checked by the parser (``cudist.bench._cli.file_destination``).

    Raises:
        BenchError: the command has no size axis to plot, matplotlib is not installed, or the
            suffix is not an image format matplotlib writes.
    """
    if command not in PLOT_COMMANDS:
        raise BenchError(f"--plot draws bandwidth against size; {command} has no size axis "
                         f"(use it with {', '.join(PLOT_COMMANDS[:-1])} or the default suite)")
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError('--plot needs matplotlib, which is not installed: pip install "cudist[plot]" '
                         "(or pip install matplotlib)")
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in kinds:
        raise BenchError(f"--plot {path}: unknown image format {suffix or '(no suffix)'!r}; "
                         f"use one of {', '.join('.' + k for k in sorted(kinds))}")


# ------------------------------------------------------------------------------------------ csv
def write_csv(tables: list, path: str) -> int:
    """Writes one CSV row per measured point of every table; returns the number of rows.

    The first column is the table's name (``all-reduce``, ``update/<rule>``, ``user-path``, ...), then
    every field any row has, in the order first seen (sizes in bytes, times in microseconds,
    bandwidths in GB/s); a field a row lacks is empty.

    Args:
        tables: the run's tables (``{"name": ..., "rows": [...]}``).
        path: the file to write.
    """
    fields: dict = {"table": None}
    for t in tables:
        for r in t["rows"]:
            fields.update(dict.fromkeys(r))
    n = 0
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        for t in tables:
            for r in t["rows"]:
                w.writerow({"table": t["name"], **{k: ("" if v is None else v) for k, v in r.items()}})
                n += 1
    return n


# ------------------------------------------------------------------------------------------ plot
def _is_tf(label: str) -> bool:
    return label.startswith("tf")


def plot_series(table: dict) -> tuple[str, dict, list]:
    """What one table's panel shows: ``(y axis label, {series label: [(size, GB/s), ...]}, ceilings)``.

    Kernel tables plot the algorithm bandwidth (nccl-tests' algbw: the size the operation is defined
    over, divided by its time) of each backend and, with ``--compare tf``, TensorFlow's rows
    (``tf-fn``, ``tf-eager``). The copy ceiling is drawn in the same unit: the algbw an operation
    would reach if it moved its bytes at the copy bandwidth of the run's header. ``user-path``
    tables plot bytes moved per second of each path against their copy row. ``ceilings`` is a list
    of ``(label, [(size, GB/s), ...])``; an empty dict means nothing in the table can be drawn.
    """
    rows = [r for r in table.get("rows", ()) if r.get("size")]
    series: dict = {}
    ceilings: dict = {}
    if table["name"].startswith("user-path"):
        for r in rows:
            if r.get("GBps") is None:
                continue
            if r.get("group") == "copy":  # the point's copy ceiling; one per group at each size: the best
                pts = ceilings.setdefault("copy ceiling (copy row)", {})
                pts[r["size"]] = max(pts.get(r["size"], 0.0), r["GBps"])
                continue
            # "copy, same working set (640K)": one curve per group, not one point per working-set size
            path = re.sub(r"\s*\([^)]*\)$", "", r["path"]) if r.get("api") == "copy-same" else r["path"]
            label = f"{r['group']}: {path}" + (" [user]" if r.get("user_path") else "")
            series.setdefault(label, []).append((r["size"], r["GBps"]))
        return "bytes moved per second (GB/s)", series, [(k, sorted(v.items())) for k, v in ceilings.items()]
    dtypes = {r.get("dtype") for r in rows}
    for r in rows:
        if r.get("algbw") is None:
            continue
        label = r["backend"] + (f" {r['dtype']}" if len(dtypes) > 1 else "")
        series.setdefault(label, []).append((r["size"], r["algbw"]))
        t, moved, pct = r.get("time_us"), r.get("moved_bytes"), r.get("pct_copy")
        if t and moved and pct:  # ceiling (bytes moved per second) expressed as algbw
            moved_gbps = moved / (t * 1e-6) / 1e9
            ceiling = moved_gbps / (pct / 100.0)
            which = "GPU copy ceiling" if r["backend"] == "cupy" else "copy ceiling"
            pts = ceilings.setdefault(f"{which} ({ceiling:.1f} GB/s moved)", {})
            pts[r["size"]] = r["algbw"] / moved_gbps * ceiling
    return "algorithm bandwidth (GB/s)", series, [(k, sorted(v.items())) for k, v in ceilings.items()]


def write_plot(tables: list, path: str, *, title: str = "") -> int:
    """Draws one panel per table that has a size axis and writes the figure to ``path``.

    Args:
        tables: the run's tables.
        path: the image file (its suffix picks the format).
        title: the figure's title (the command line and the machine).

    Returns:
        The number of panels drawn.

    Raises:
        BenchError: no table of the run has anything to plot.
    """
    panels = []
    for t in tables:
        ylabel, series, ceilings = plot_series(t)
        if series:
            panels.append((t, ylabel, series, ceilings))
    if not panels:
        raise BenchError(f"--plot {path}: no table of this run has a bandwidth to plot against size")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    cols = 1 if len(panels) == 1 else 2
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(7.5 * cols, 4.8 * rows_n), squeeze=False)
    for ax, (t, ylabel, series, ceilings) in zip(axes.flat, panels):
        sizes = sorted({s for pts in series.values() for s, _ in pts})
        for label, pts in series.items():
            pts.sort()
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            style = "--" if _is_tf(label) else ("-." if "copy, same working set" in label else "-")
            ax.plot(xs, ys, style, marker="s" if _is_tf(label) else "o", markersize=4, label=label)
        for label, pts in ceilings:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            if len(xs) == 1:
                xs, ys = [sizes[0], sizes[-1]], ys * 2
            ax.plot(xs, ys, color="0.3", linestyle=":", linewidth=2, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45 if len(sizes) > 6 else 0)
        meta = f", {t['replicas']} replicas" if t.get("replicas") else ""
        ax.set_title(f"{t['name']}{meta}")
        ax.set_xlabel("size per replica (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        import textwrap

        width = 90 * cols
        fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.splitlines()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(panels)
