"""``python -m cudist``: paths for C++ users and a summary of this installation."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence


def _info() -> str:
    import numpy as np

    import cudist
    from cudist import _settings
    from cudist._kernels import BACKENDS, BackendUnavailableError, available_backends, cuda_launch_policy, get_backend

    lines = [
        f"cudist {cudist.__version__}",
        f"python {platform.python_version()} ({sys.executable})",
        f"numpy {np.__version__}",
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "kernel backends:",
    ]
    installed = set(available_backends())
    for name in BACKENDS:
        if name not in installed:
            lines.append(f"  {name:7s} not available")
            continue
        if name == "cupy":  # loading it would initialise CUDA; report without doing so
            lines.append(f"  {name:7s} installed (GPU backend; loads on first GPU use)")
            continue
        try:
            get_backend(name)
            lines.append(f"  {name:7s} available")
        except BackendUnavailableError as e:
            lines.append(f"  {name:7s} broken: {e}")
    lines.append(_extension_info())
    pool = _pool_info()
    if pool:
        lines.append(pool)
    # How the cupy backend will launch (decided without initialising CUDA; CUDIST_CUDA_LAUNCHERS).
    lines.append(f"cupy launch path: {cuda_launch_policy()}" + ("" if "cupy" in installed else " (once CuPy is installed)"))
    if "cupy" in installed:
        lines.append(_cuda_info())
    env = _settings.backend()
    if not env:
        lines.append(f"default CPU backend: {get_backend().name}")
    elif env.strip().lower() == "cupy":  # as above: name it without initialising CUDA
        lines.append(f"default backend: cupy (CUDIST_BACKEND={env}; loads on first use)")
    else:
        # A diagnostic must report a bad setting, not die on it as every kernel call would.
        try:
            lines.append(f"default CPU backend: {get_backend(env).name} (CUDIST_BACKEND={env})")
        except (ValueError, BackendUnavailableError) as e:
            lines.append(f"CUDIST_BACKEND={env} is unusable: {e}")
    return "\n".join(lines)


def _cuda_info() -> str:
    """CuPy, CUDA runtime, driver, NVRTC and NCCL versions; a warning when the driver is too old."""
    from cudist import config

    v = config.cuda_versions()
    lines = ["CUDA (through CuPy; no device is initialised here):"]
    lines += [f"  {k:12s} {v[k]}" for k in ("cupy", "cuda_runtime", "driver", "nvrtc", "nccl") if k in v]
    try:
        drv, rt = (int(v[k].split(".")[0]) for k in ("driver", "cuda_runtime"))
    except (KeyError, ValueError):
        return "\n".join(lines)
    if drv < rt:
        other = config.CUDA_EXTRAS.get(drv)
        fix = f" or install {other}" if other else ""
        lines.append(f"  WARNING: the driver supports CUDA {v['driver']} < CuPy's CUDA {v['cuda_runtime']}: every CUDA "
                     f"call will fail (cudaErrorInsufficientDriver); update the driver{fix}")
    return "\n".join(lines)


def _pool_info() -> str:
    """The native kernels' thread pool: its size and how long its workers spin between kernels."""
    try:
        from cudist import _core
    except ImportError:
        return ""
    spin = _core.pool_spin_time() // 1000
    how = f"workers spin up to {spin} us between kernels that come that close" if spin else "workers never spin"
    return f"native kernel threads: {_core.num_threads()} ({how}; CUDIST_POOL_SPIN_US)"


def _extension_info() -> str:
    """How the C++ extension was built: with the CUDA launchers or CPU only."""
    try:
        from cudist import _core
    except ImportError as e:
        return f"C++ extension: not importable ({e})"
    if not getattr(_core, "cuda_built", False):
        return "C++ extension: CPU only (built without a CUDA compiler)"
    v = _core.cuda_runtime_version
    archs = ", ".join(f"sm_{a}" for a in str(_core.cuda_architectures).split(",") if a)
    # Counting devices would initialise CUDA, which a summary should not do (as for cupy above).
    return f"C++ extension: with CUDA launchers (CUDA runtime {v // 1000}.{v % 1000 // 10}, static; {archs})"


def main(argv: Sequence[str] | None = None) -> int:
    import cudist

    p = argparse.ArgumentParser(prog="python -m cudist", description=__doc__)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--includes", action="store_true", help="print -I flags for the C++ headers")
    g.add_argument("--include-dir", action="store_true", help="print the header directory")
    g.add_argument("--cmakedir", action="store_true", help="print the directory of cudistConfig.cmake")
    g.add_argument("--info", action="store_true", help="version, kernel backends, CPU count")
    args = p.parse_args(argv)
    if args.includes:
        print(f"-I{cudist.get_include()}")
    elif args.include_dir:
        print(cudist.get_include())
    elif args.cmakedir:
        print(cudist.get_cmake_dir())
    else:
        print(_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
