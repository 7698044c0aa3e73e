"""cudist's version is written once, as the CUDIST_VERSION_* macros of version.hpp.

pyproject.toml reads them (scikit-build-core's regex provider), CMake reads them for
project(VERSION) (and hands them to the extension), ``cudist.__version__`` is the installed
distribution's version, and C++ users get ``cudist::version_string`` from the same header.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import cudist

ROOT = Path(__file__).resolve().parent.parent
SOURCE_HEADER = ROOT / "csrc" / "include" / "cudist" / "version.hpp"


def test_version_agrees_everywhere() -> None:
    v = cudist.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", v), v
    assert v == importlib.metadata.version("cudist")
    # The header installed next to the extension (or the source tree's, for an in-place build).
    assert v == cudist._header_version(Path(cudist.get_include()) / "cudist" / "version.hpp")


def test_extension_version_agrees() -> None:
    core = pytest.importorskip("cudist._core", reason="the C++ extension is not built")
    assert core.__version__ == cudist.__version__


def test_source_tree_header_is_the_installed_version() -> None:
    # Fails when version.hpp was bumped without reinstalling (pip install . / -e .).
    if not SOURCE_HEADER.is_file():
        pytest.skip("no source tree")
    assert cudist._header_version(SOURCE_HEADER) == cudist.__version__


def test_pyproject_reads_the_version_from_the_header() -> None:
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("needs the source tree")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli, the same parser
        import tomli as tomllib

    config = tomllib.loads(pyproject.read_text())
    assert "version" not in config["project"], "the version must not be written in pyproject.toml"
    assert "version" in config["project"]["dynamic"]
    provider = config["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["provider"] == "scikit_build_core.metadata.regex"
    assert (ROOT / provider["input"]).resolve() == SOURCE_HEADER.resolve()
    # What scikit-build-core computes: the regex over the file, formatted with `result`.
    m = re.search(provider["regex"], SOURCE_HEADER.read_text(), re.MULTILINE)
    assert m, provider["regex"]
    assert provider["result"].format(*m.groups(), **m.groupdict()) == cudist._header_version(SOURCE_HEADER)


def test_version_is_not_written_elsewhere() -> None:
    # The places that used to carry their own copy: none may come back.
    if not SOURCE_HEADER.is_file():
        pytest.skip("no source tree")
    v = cudist.__version__
    header = SOURCE_HEADER.read_text()
    assert f'"{v}"' not in header, "version_string must be built from the CUDIST_VERSION_* macros"
    init = (ROOT / "src" / "cudist" / "__init__.py").read_text()
    assert not re.search(r"^__version__\s*=", init, re.M)
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert v not in cmake
