"""The documentation under docs/ cannot rot: its Python snippets run, and its environment-variable
table lists every ``CUDIST_*`` variable the code reads: ``cudist._settings`` reads them all (no other
module of ``src/`` does) and its ``TABLE`` is what the page's tables print.

Snippets: every fenced ```` ```python ```` block of ``docs/**/*.md`` runs, a page's blocks in order in
one fresh interpreter (later blocks may use names from earlier ones, as a reader would), from an empty
temporary directory. A block right after a line ``<!-- skip-test: reason -->`` is not run (it needs
MPI, a GPU, TensorFlow or another framework the test extra lacks); the reason is required.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ENV_PAGE = DOCS / "reference" / "environment.md"

_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!--\s*skip-test:\s*(\S[^>]*?)\s*-->\s*$")


def doc_snippets(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` for each ```python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        out.append((line, m.group(1), skip.group(1) if skip else None))
    return out


PAGES = sorted(p for p in DOCS.rglob("*.md") if any(s is None for _, _, s in doc_snippets(p)))


def test_there_are_snippets_to_run():
    assert len(PAGES) >= 4, PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_doc_snippets_run(page, tmp_path):
    parts = []
    for line, code, skip in doc_snippets(page):
        if skip is None:
            parts.append(f"print('--- snippet at {page.name}:{line}', flush=True)\n{code}")
    script = tmp_path / "snippets.py"
    script.write_text("\n".join(parts), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"a snippet of {page.relative_to(ROOT)} failed (the last '--- snippet' line says "
                                  f"which):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def test_skip_markers_give_a_reason():
    for page in DOCS.rglob("*.md"):
        for line in page.read_text(encoding="utf-8").splitlines():
            if "skip-test" in line:
                assert _SKIP.search(line), f"{page}: {line!r} (write <!-- skip-test: why -->)"


# ------------------------------------------------------------------------------------------ env vars
def documented_variables() -> set[str]:
    """The names in the first column of the tables of docs/reference/environment.md."""
    names = set()
    for line in ENV_PAGE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\|\s*`(CUDIST_[A-Z0-9_]+)`", line)
        if m:
            names.add(m.group(1))
    return names


def _is_environ(node: ast.AST) -> bool:
    return "environ" in ast.unparse(node) or "getenv" in ast.unparse(node)


def python_env_reads(path: Path) -> set[str]:
    """``CUDIST_*`` names read from the environment by one module: the argument of
    ``os.environ.get/pop/setdefault``, ``os.getenv``, ``os.environ[...]`` and ``... in os.environ``,
    given as a literal or as a module-level constant holding one. ``os.environ[...] = value`` sets a
    variable (for a child process) and is not a read."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    consts = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    consts[t.id] = node.value.value

    def value(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            return n.value
        if isinstance(n, ast.Name):
            return consts.get(n.id)
        return None

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)) or (
                    isinstance(f, (ast.Attribute, ast.Name)) and ast.unparse(f).endswith("getenv")):
                keys.append(value(node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            keys.append(value(node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
            if any(_is_environ(c) for c in node.comparators):
                keys.append(value(node.left))
    return {k for k in keys if k and k.startswith("CUDIST_")}


def cpp_env_reads(path: Path) -> set[str]:
    return set(re.findall(r"getenv\(\s*\"(CUDIST_[A-Z0-9_]+)\"", path.read_text(encoding="utf-8", errors="replace")))


def code_env_reads() -> dict[str, list[str]]:
    """Every ``CUDIST_*`` variable src/ and csrc/ read, with the files that read it."""
    from cudist import _settings

    found: dict[str, list[str]] = {}
    for p in sorted((ROOT / "src").rglob("*.py")):
        # _settings reads through helpers taking the variable as an argument; its TABLE lists what it
        # reads (tests/test_settings.py checks each accessor against the environment).
        names = {s.name for s in _settings.TABLE} if p.name == "_settings.py" else python_env_reads(p)
        for name in names:
            found.setdefault(name, []).append(str(p.relative_to(ROOT)))
    for p in sorted((ROOT / "csrc").rglob("*")):
        if p.suffix in (".hpp", ".cpp", ".cuh", ".cu", ".h"):
            for name in cpp_env_reads(p):
                found.setdefault(name, []).append(str(p.relative_to(ROOT)))
    return found


def test_env_scanner_finds_the_known_reads():
    """The scanner sees literal, constant and C++ reads (so the next test can fail)."""
    found = code_env_reads()
    for name in ("CUDIST_BACKEND", "CUDIST_CHECK_COLLECTIVES", "CUDIST_POOL_SPIN_US",
                 "CUDIST_REPLICA_EXECUTION", "CUDIST_CUDA_LAUNCHERS"):
        assert name in found, (name, sorted(found))
    assert "CUDIST_KERNELS" not in found  # a macro name in a regular expression, not an environment read


def test_env_scanner_on_planted_reads(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('import os\nX = "CUDIST_PLANTED_A"\nos.environ.get(X)\nos.getenv("CUDIST_PLANTED_B")\n'
                 'os.environ["CUDIST_PLANTED_C"]\n"CUDIST_PLANTED_D" in os.environ\nY = "CUDIST_NOT_READ"\n'
                 'os.environ["CUDIST_ONLY_SET"] = "1"\n')
    assert python_env_reads(p) == {"CUDIST_PLANTED_A", "CUDIST_PLANTED_B", "CUDIST_PLANTED_C", "CUDIST_PLANTED_D"}


def test_every_env_variable_the_code_reads_is_documented():
    missing = {k: v for k, v in code_env_reads().items() if k not in documented_variables()}
    assert not missing, f"add these to docs/reference/environment.md: {missing}"


def test_only_settings_reads_cudist_variables():
    """``cudist._settings`` is the one module of src/ that reads a ``CUDIST_*`` variable."""
    readers = {p for paths in code_env_reads().values() for p in paths if p.startswith("src/")}
    assert readers == {"src/cudist/_settings.py"}, sorted(readers)


def test_settings_table_covers_every_read():
    """Each variable src/ or csrc/ reads has a row in ``_settings.TABLE`` (the C++ pool's included)."""
    from cudist import _settings

    names = {s.name for s in _settings.TABLE}
    assert set(code_env_reads()) <= names, sorted(set(code_env_reads()) - names)


def test_env_page_tables_are_the_settings_table():
    """The page's Runtime, Set-by-cudist and Benchmarks tables are ``_settings.markdown_table``'s output."""
    from cudist import _settings

    text = ENV_PAGE.read_text(encoding="utf-8")
    for section, title in _settings.SECTIONS.items():
        part = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
        table = "\n".join(line for line in part.splitlines() if line.startswith("|"))
        assert table == _settings.markdown_table(section), (
            f"docs/reference/environment.md's {title!r} table differs from cudist._settings.TABLE; print it with "
            f"python -c \"from cudist import _settings; print(_settings.markdown_table({section!r}))\"")


def test_every_documented_variable_exists():
    """No stale rows: each name in the table occurs in the code, the build, the tests, bench/ or CI."""
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace")
                     for d in ("src", "csrc", "tests", "bench", ".ci")
                     for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".hpp", ".cpp", ".cuh", ".sh", "")
                     ) + (ROOT / "CMakeLists.txt").read_text()
    stale = sorted(n for n in documented_variables() if n not in text)
    assert not stale, stale


# ------------------------------------------------------------------------------------------ CLI page
def test_every_cudist_bench_option_is_on_the_cli_page():
    """docs/reference/cli.md names each subcommand and long option of cudist-bench's parsers."""
    import argparse

    from cudist.bench._cli import _common_parser, build_parser
    from cudist.bench._multi_worker import build_parser as workers_parser

    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    parsers = [build_parser(), workers_parser(_common_parser())]
    sub = next(a for a in parsers[0]._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"`{name}`" for name in sub.choices if f"`{name}`" not in page]
    parsers += list(sub.choices.values())
    for p in parsers:
        for action in p._actions:
            for opt in action.option_strings:
                if opt.startswith("--") and opt not in ("--help", "--version") and f"`{opt}" not in page:
                    missing.append(opt)
    assert not missing, f"add to docs/reference/cli.md: {sorted(set(missing))}"
