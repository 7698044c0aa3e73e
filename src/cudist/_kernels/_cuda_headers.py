"""Where the CUDA toolkit's headers are, for compiling cudist's kernels with NVRTC.

The kernels include ``<cuda_fp16.h>``, which NVRTC does not provide by itself (checked with NVRTC
13.0). CuPy adds the include directory of the CUDA it found; this module finds the usual places
too, so that the cupy backend does not depend on how CuPy was installed: ``$CUDA_PATH``,
``$CUDA_HOME``, CuPy's own CUDA path, the ``nvidia-*`` wheels' include directories, the toolkit
next to ``nvcc`` and ``/usr/local/cuda``. Importing it imports nothing heavy (no CuPy).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
from pathlib import Path

__all__ = ["cuda_include_dirs"]

_MARKER = "cuda_fp16.h"


def _candidates(extra_roots) -> list[Path]:
    roots = [Path(r) for r in extra_roots if r]
    roots += [Path(os.environ[e]) for e in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(e)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(Path(os.path.realpath(nvcc)).parent.parent)
    roots.append(Path("/usr/local/cuda"))
    dirs = []
    for root in roots:
        dirs.append(root / "include")
        dirs += [Path(p) for p in glob.glob(str(root / "targets" / "*" / "include"))]
    # pip's CUDA wheels: site-packages/nvidia/<component or cuXY>/include
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        dirs += [Path(p) for p in sorted(glob.glob(os.path.join(base, "*", "include")))]
    return dirs


def cuda_include_dirs(extra_roots=()) -> list[str]:
    """Include directories that hold the CUDA headers the kernels need, best first, no duplicates.

    Args:
        extra_roots: CUDA installation roots to look in first (e.g. ``cupy.cuda.get_cuda_path()``).

    Returns:
        Absolute paths of directories containing ``cuda_fp16.h`` (empty when none is found: then
        the compiler's own search path has to have it).
    """
    found = []
    for d in _candidates(extra_roots):
        if (d / _MARKER).is_file():
            path = str(d.resolve())
            if path not in found:
                found.append(path)
    return found
