"""Builds the host emulation of cudist's CUDA code (tests/emu/*.cpp) into one shared library.

The library holds the real kernels (<cudist/kernels/*.cuh>) and launchers
(<cudist/cuda/launch_impl.cuh>) compiled by the system C++ compiler against the fake CUDA headers
in tests/emu/include (which come first on the include path), with extern "C" entry points for
ctypes. It is cached under ``tempfile.gettempdir()/cudist-emu-<hash>/``, the hash covering every
source involved, the compiler and its flags, so an edit of any header rebuilds it and concurrent
processes share one build (each writes a private file, then renames it into place atomically).

Usage::

    from tests.emu import build
    lib = build.load()  # ctypes.CDLL, built on first use
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["compiler", "library_path", "load", "sources"]

EMU_DIR = Path(__file__).resolve().parent
ROOT = EMU_DIR.parents[1]
CSRC_INCLUDE = ROOT / "csrc" / "include"
EMU_INCLUDE = EMU_DIR / "include"
LIBRARY_NAME = "libcudist_emu.so"
# -ffp-contract=off: no FMA fusion, so every float operation rounds once, as the kernels' __f*_rn
# intrinsics do on the GPU. -fno-strict-aliasing: the kernels read buffers through vector structs.
FLAGS = (
    "-std=c++17",
    "-O1",
    "-shared",
    "-fPIC",
    "-pthread",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wno-unknown-pragmas",
)
_COMPILE_TIMEOUT_S = 600

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else ``c++``, else ``g++`` (None when there is none)."""
    for cand in (os.environ.get("CXX"), "c++", "g++"):
        if cand:
            found = shutil.which(cand)
            if found:
                return found
    return None


def sources() -> list[Path]:
    """The translation units: every tests/emu/*.cpp (whoever added it)."""
    return sorted(EMU_DIR.glob("*.cpp"))


def _digest(cxx: str) -> str:
    h = hashlib.sha256()
    h.update(cxx.encode())
    h.update("\0".join(FLAGS).encode())
    h.update(Path(__file__).read_bytes())
    groups = [(EMU_DIR, sources())]
    groups += [(tree, sorted(p for p in tree.rglob("*") if p.is_file())) for tree in (EMU_INCLUDE, CSRC_INCLUDE)]
    for tree, files in groups:
        h.update(str(tree).encode())
        for path in files:
            h.update(str(path.relative_to(tree)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:20]


def library_path() -> Path:
    """The path of the emulation library, compiled first if this version of the sources is not built.

    Raises:
        RuntimeError: no C++ compiler is found, there is no source, or the compilation fails (the
            message holds the command and the compiler's output).
    """
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("cannot build the CUDA emulation: no C++ compiler found ($CXX, c++ or g++)")
    srcs = sources()
    if not srcs:
        raise RuntimeError(f"cannot build the CUDA emulation: no *.cpp under {EMU_DIR}")
    out_dir = Path(tempfile.gettempdir()) / f"cudist-emu-{_digest(cxx)}"
    lib = out_dir / LIBRARY_NAME
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = [cxx, *FLAGS, f"-I{EMU_INCLUDE}", f"-I{CSRC_INCLUDE}", *map(str, srcs), "-o", str(tmp)]
    try:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"building the CUDA emulation timed out after {e.timeout} s: {' '.join(cmd)}") from e
        if res.returncode != 0:
            raise RuntimeError(
                f"building the CUDA emulation failed (exit {res.returncode}):\n"
                f"{' '.join(cmd)}\n{res.stdout}{res.stderr}"
            )
        os.replace(tmp, lib)
    finally:
        if tmp.exists():
            tmp.unlink()
        if not lib.exists():
            try:
                out_dir.rmdir()  # a failed build leaves nothing behind (unless another process built it)
            except OSError:
                pass
    return lib


def load() -> ctypes.CDLL:
    """The emulation library, loaded once per process (built if needed; see :func:`library_path`)."""
    global _loaded
    with _lock:
        if _loaded is None:
            lib = ctypes.CDLL(str(library_path()))
            lib.cudist_emu_get_last_error.restype = ctypes.c_int
            lib.cudist_emu_reset.restype = None
            _loaded = lib
        return _loaded
