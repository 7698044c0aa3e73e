"""``cudist-bench --plot`` and ``--csv``: what they write, and the checks made before anything runs."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

from cudist.bench import main
from cudist.bench._plot import plot_series, write_plot

TINY = ["-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1", "--no-progress", "--copy-size", "1M",
        "--backend", "numpy"]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (the plot extra)")


def _png_size(path):
    with open(path, "rb") as f:
        data = f.read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_csv_has_a_row_per_point_with_the_json_values(tmp_path):
    out, js = tmp_path / "r.csv", tmp_path / "r.json"
    assert main(["all-reduce", *TINY, "--csv", str(out), "--json", str(js)]) == 0
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    import json

    doc = json.loads(js.read_text())
    want = [r for t in doc["tables"] for r in t["rows"]]
    assert len(rows) == len(want) == 2
    for got, r in zip(rows, want):
        assert got["table"] == "all-reduce" and got["backend"] == "numpy"
        assert int(got["size"]) == r["size"]
        assert float(got["time_us"]) == pytest.approx(r["time_us"])
        assert float(got["algbw"]) == pytest.approx(r["algbw"])


@needs_mpl
def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "ar.png"
    assert main(["all-reduce", *TINY, "--plot", str(out)]) == 0
    w, h = _png_size(out)
    assert w >= 600 and h >= 400


def _table(name, rows, replicas=4):
    return {"name": name, "rows": rows, "replicas": replicas}


def _row(backend, size, time_us, n=4):
    moved = 2 * n * size
    algbw = size / (time_us * 1e-6) / 1e9
    return {"size": size, "dtype": "float32", "backend": backend, "time_us": time_us, "algbw": algbw,
            "moved_bytes": moved, "pct_copy": 100.0 * moved / (time_us * 1e-6) / 1e9 / 40.0}


def test_plot_series_has_each_backend_tf_and_the_ceiling_in_algbw():
    """A 40 GB/s copy ceiling over an all-reduce moving 2*N*S bytes is 40/(2N) GB/s of algbw."""
    rows = [_row(b, s, t) for b, t in (("native", 10.0), ("tf-fn", 100.0)) for s in (4096, 65536)]
    ylabel, series, ceilings = plot_series(_table("all-reduce", rows))
    assert "algorithm" in ylabel
    assert set(series) == {"native", "tf-fn"}
    assert [s for s, _ in series["native"]] == [4096, 65536]
    assert series["tf-fn"][0][1] == pytest.approx(4096 / 100e-6 / 1e9)
    ((label, pts),) = ceilings
    assert "40.0 GB/s" in label
    assert all(v == pytest.approx(40.0 / 8) for _, v in pts)


def test_plot_series_of_user_path_uses_the_copy_rows():
    rows = [{"size": 4096, "group": "all-reduce", "path": "strategy.run", "user_path": True, "GBps": 3.0},
            {"size": 4096, "group": "all-reduce", "path": "copy, same working set (40K)", "api": "copy-same",
             "GBps": 20.0},
            {"size": 65536, "group": "all-reduce", "path": "copy, same working set (640K)", "api": "copy-same",
             "GBps": 25.0},
            {"size": 4096, "group": "copy", "path": "copy", "GBps": 30.0},
            {"size": 4096, "group": "copy", "path": "copy", "GBps": 31.0}]
    _, series, ceilings = plot_series(_table("user-path", rows))
    assert list(series) == ["all-reduce: strategy.run [user]", "all-reduce: copy, same working set"]
    assert series["all-reduce: copy, same working set"] == [(4096, 20.0), (65536, 25.0)]
    assert ceilings == [("copy ceiling (copy row)", [(4096, 31.0)])]  # the best copy row at each size


@needs_mpl
def test_write_plot_draws_tf_curves_too(tmp_path):
    rows = [_row(b, s, t * s / 4096) for b, t in (("native", 10.0), ("numpy", 30.0), ("tf-fn", 100.0),
                                                   ("tf-eager", 300.0)) for s in (4096, 65536, 1 << 20)]
    out = tmp_path / "tf.png"
    assert write_plot([_table("all-reduce", rows), _table("run-overhead", [{"time_us": 1.0}])], str(out)) == 1
    _png_size(out)


@pytest.mark.parametrize("flag", ["--plot", "--csv"])
def test_output_to_a_missing_directory_fails_before_running(tmp_path, flag, capsys):
    target = tmp_path / "no" / "such" / "out.png"
    with pytest.raises(SystemExit) as e:
        main(["all-reduce", *TINY, flag, str(target)])
    assert e.value.code == 2
    err = capsys.readouterr()
    assert "no directory" in err.err and flag in err.err
    assert "# all-reduce" not in err.out  # nothing was measured


def test_plot_to_a_directory_or_unknown_suffix_fails(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["all-reduce", *TINY, "--csv", str(tmp_path)])
    assert "is a directory; give a file name" in capsys.readouterr().err
    if HAVE_MPL:
        with pytest.raises(SystemExit):
            main(["all-reduce", *TINY, "--plot", str(tmp_path / "out.xyz")])
        assert "unknown image format" in capsys.readouterr().err


def test_plot_of_a_command_without_sizes_fails_up_front(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run-overhead", "-n", "2", "--plot", str(tmp_path / "x.png")])
    assert e.value.code == 2 and "no size axis" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    """With matplotlib hidden, --plot exits 2 at once with the extra to install, before any header."""
    code = ("import sys, importlib.util as u\n"
            "real = u.find_spec\n"
            "u.find_spec = lambda name, *a: None if name.split('.')[0] == 'matplotlib' else real(name, *a)\n"
            "from cudist.bench import main\n"
            f"sys.exit(main(['all-reduce', *{TINY!r}, '--plot', {str(tmp_path / 'x.png')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert 'pip install "cudist[plot]"' in proc.stderr
    assert "copy bandwidth" not in proc.stdout + proc.stderr
    assert not os.path.exists(tmp_path / "x.png")


def test_plot_and_csv_are_refused_with_workers(capsys):
    with pytest.raises(SystemExit) as e:
        main(["all-reduce", "--workers", "2", "--csv", "x.csv"])
    assert e.value.code == 2 and "--workers" in capsys.readouterr().err


def test_import_cudist_bench_does_not_import_matplotlib():
    code = "import cudist, cudist.bench, cudist.bench._cli, sys; print('matplotlib' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr
