"""cudist._settings: each accessor's parsing and its errors (the docs side is in tests/test_docs.py)."""

from __future__ import annotations

import os

import pytest

from cudist import _settings


def test_unset_and_blank_take_the_default(monkeypatch):
    for name in (s.name for s in _settings.TABLE):
        monkeypatch.delenv(name, raising=False)
    assert _settings.backend() is None
    assert _settings.replica_execution() is None
    assert _settings.cuda_launchers() == "auto"
    assert _settings.check_collectives() == "quick"
    assert _settings.stall_warning_seconds(60.0) == 60.0
    assert _settings.launch_status_dir() is None
    assert _settings.bench_tf_python() is None
    assert _settings.bench_torch_python() is None
    monkeypatch.setenv(_settings.BACKEND, "  ")
    monkeypatch.setenv(_settings.STALL_WARNING_SECONDS, "")
    assert _settings.backend() is None
    assert _settings.stall_warning_seconds(7) == 7.0


def test_values_are_parsed(monkeypatch):
    monkeypatch.setenv(_settings.BACKEND, " Numba ")
    monkeypatch.setenv(_settings.REPLICA_EXECUTION, "Threads")
    monkeypatch.setenv(_settings.CUDA_LAUNCHERS, " NVRTC")
    monkeypatch.setenv(_settings.STALL_WARNING_SECONDS, "2.5")
    monkeypatch.setenv(_settings.LAUNCH_STATUS_DIR, "/tmp/x")
    assert _settings.backend() == "Numba"  # validated by the backend registry, which names the choices
    assert _settings.replica_execution() == "threads"
    assert _settings.cuda_launchers() == "nvrtc"
    assert _settings.stall_warning_seconds(60) == 2.5
    assert _settings.launch_status_dir() == "/tmp/x"
    for raw, mode in (("0", "off"), ("off", "off"), ("No", "off"), ("1", "full"), ("yes", "full")):
        monkeypatch.setenv(_settings.CHECK_COLLECTIVES, raw)
        assert _settings.check_collectives() == mode


@pytest.mark.parametrize("name, raw, call, message", [
    (_settings.REPLICA_EXECUTION, "fibers", _settings.replica_execution,
     r"\$CUDIST_REPLICA_EXECUTION='fibers' is not one of auto, greenlets, threads"),
    (_settings.CUDA_LAUNCHERS, "cuda", _settings.cuda_launchers, r"CUDIST_CUDA_LAUNCHERS='cuda' is not one of"),
    (_settings.STALL_WARNING_SECONDS, "soon", lambda: _settings.stall_warning_seconds(60),
     r"\$CUDIST_STALL_WARNING_SECONDS='soon' is not a positive number"),
    (_settings.STALL_WARNING_SECONDS, "-1", lambda: _settings.stall_warning_seconds(60),
     r"\$CUDIST_STALL_WARNING_SECONDS='-1' is not a positive number"),
    (_settings.STALL_WARNING_SECONDS, "nan", lambda: _settings.stall_warning_seconds(60),
     r"\$CUDIST_STALL_WARNING_SECONDS='nan' is not a positive number"),
])
def test_bad_values_name_the_variable(monkeypatch, name, raw, call, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=message):
        call()


def test_overridden_sets_and_restores(monkeypatch):
    monkeypatch.setenv(_settings.BACKEND, "numpy")
    with _settings.overridden(_settings.BACKEND, "numba"):
        assert _settings.backend() == "numba"
        with _settings.overridden(_settings.BACKEND, None):
            assert _settings.backend() is None
        assert _settings.backend() == "numba"
    assert os.environ[_settings.BACKEND] == "numpy"
    monkeypatch.delenv(_settings.BACKEND)
    with pytest.raises(RuntimeError), _settings.overridden(_settings.BACKEND, "numba"):
        raise RuntimeError("restored even so")
    assert _settings.BACKEND not in os.environ
    with pytest.raises(KeyError, match="CUDIST_NOPE"), _settings.overridden("CUDIST_NOPE", "1"):
        pass


def test_markdown_table_rows():
    table = _settings.markdown_table("internal").splitlines()
    assert table[0] == "| Variable | Default | What it does | Read when |"
    assert [r.split("|")[1].strip() for r in table[2:]] == ["`CUDIST_RESTART_COUNT`", "`CUDIST_LAUNCH_STATUS_DIR`"]
    assert sum(len(_settings.markdown_table(k).splitlines()) - 2 for k in _settings.SECTIONS) == len(_settings.TABLE)
    with pytest.raises(KeyError):
        _settings.markdown_table("nope")


def test_restart_count(monkeypatch):
    monkeypatch.delenv(_settings.RESTART_COUNT, raising=False)
    assert _settings.restart_count() == 0
    monkeypatch.setenv(_settings.RESTART_COUNT, "3")
    assert _settings.restart_count() == 3
    for bad in ("-1", "two"):
        monkeypatch.setenv(_settings.RESTART_COUNT, bad)
        with pytest.raises(ValueError, match="CUDIST_RESTART_COUNT"):
            _settings.restart_count()


def test_checkpoint_writer_nice(monkeypatch):
    monkeypatch.delenv(_settings.CHECKPOINT_WRITER_NICE, raising=False)
    assert _settings.checkpoint_writer_nice() == _settings.CHECKPOINT_WRITER_NICE_DEFAULT == 0
    for raw, nice in ((" 0 ", 0), ("19", 19), ("5", 5), ("", 0)):
        monkeypatch.setenv(_settings.CHECKPOINT_WRITER_NICE, raw)
        assert _settings.checkpoint_writer_nice() == nice
    for raw in ("-1", "20", "low", "2.5"):
        monkeypatch.setenv(_settings.CHECKPOINT_WRITER_NICE, raw)
        with pytest.raises(ValueError, match=f"CUDIST_CHECKPOINT_WRITER_NICE={raw!r} is not an integer from 0 to 19"):
            _settings.checkpoint_writer_nice()
