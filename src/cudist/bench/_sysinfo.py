"""What the header says about the machine: CPU, cores, backends, and the measured copy bandwidth."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

__all__ = [
    "cpu_model", "core_count", "backend_versions", "CopyBandwidth", "copy_methods", "measure_copy_bandwidth",
    "measure_gpu_copy_bandwidth",
]


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def last_level_cache() -> str | None:
    """Size of the largest CPU cache, as /sys reports it ("48M"), or None where unknown."""
    import glob

    best = None
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            n = int(text[:-1]) * units[text[-1].upper()] if text[-1].isalpha() else int(text)
        except (ValueError, KeyError, IndexError):
            continue
        if best is None or n > best:
            best = n
    if best is None:
        return None
    from cudist.bench._sizes import format_size

    return format_size(best)


def core_count() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def backend_versions() -> dict[str, str]:
    """Each known kernel backend -> a version string, or why it is unavailable (nothing imported)."""
    from cudist._kernels import BACKENDS, available_backends

    import cudist

    avail = set(available_backends())
    out = {}
    for name in BACKENDS:
        if name not in avail:
            out[name] = "unavailable"
        elif name == "numpy":
            out[name] = f"numpy {_dist_version('numpy')}"
        elif name == "numba":
            out[name] = f"numba {_dist_version('numba')}"
        elif name == "native":
            out[name] = f"cudist._core {cudist.__version__}"
        elif name == "cupy":
            v = _dist_version("cupy", "cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x")
            out[name] = f"cupy {v}" if v else "cupy"
    return out


@dataclass
class CopyBandwidth:
    """Copy bandwidths measured at start; ``best`` is the ceiling the % column divides by.

    Bandwidths count bytes read plus bytes written (2 x buffer size) per second, in GB/s (1e9).
    """

    nbytes: int
    results: dict = field(default_factory=dict)  # method -> GB/s

    @property
    def best_method(self) -> str | None:
        return max(self.results, key=self.results.get) if self.results else None

    @property
    def best(self) -> float | None:
        return self.results[self.best_method] if self.results else None


def _time_copy(fn, iters: int) -> float:
    fn()  # first touch / compile
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@functools.lru_cache(maxsize=1)
def _numba_prange_copy():
    """The numba copy, compiled once per process (copy_methods is called once per benchmark point)."""
    import numba

    @numba.njit(parallel=True, nogil=True, cache=False)
    def copy(dst, src):  # pragma: no cover - compiled
        for i in numba.prange(src.size):
            dst[i] = src[i]

    return copy


def copy_methods(nbytes: int = 64 << 20, backends=("native", "numba")) -> dict:
    """Ways to copy one ``nbytes`` host buffer into another: method name -> zero-argument callable.

    Methods: a numba ``prange`` copy over uint64 words (all cores), the broadcast kernel of each fast
    CPU backend to one destination, and ``numpy.copyto`` (one core, memcpy). Each callable copies the
    same pair of buffers; ``nbytes`` is rounded down to a multiple of 8.
    """
    import numpy as np

    from cudist._kernels import BackendUnavailableError, available_backends, get_backend

    nbytes = max(8, nbytes - nbytes % 8)
    src = np.random.default_rng(0).integers(0, 1 << 62, nbytes // 8, dtype=np.uint64)
    dst = np.empty_like(src)
    out = {}
    avail = available_backends()
    if "numba" in avail:
        try:
            copy = _numba_prange_copy()
            out["numba prange copy"] = lambda: copy(dst, src)
        except Exception:  # a broken numba must not stop the benchmark; the other methods remain
            pass
    src32, dst32 = src.view(np.float32), dst.view(np.float32)
    for name in backends:
        if name not in avail:
            continue
        try:
            be = get_backend(name)
        except BackendUnavailableError:
            continue
        if np.dtype(np.float32) in be.dtypes:
            out[f"{name} broadcast (1 destination)"] = lambda be=be: be.broadcast(src32, [dst32])
    out["numpy.copyto"] = lambda: np.copyto(dst, src)
    return out


def measure_copy_bandwidth(nbytes: int = 64 << 20, iters: int = 10, backends=("native", "numba")) -> CopyBandwidth:
    """Measures every :func:`copy_methods` way of copying an ``nbytes`` buffer; keeps every result.

    Each is the median of ``iters`` copies after one untimed call (which also compiles numba).
    """
    nbytes = max(8, nbytes - nbytes % 8)
    bw = CopyBandwidth(nbytes)
    for name, fn in copy_methods(nbytes, backends).items():
        bw.results[name] = 2 * nbytes / _time_copy(fn, iters) / 1e9
    return bw


def measure_gpu_copy_bandwidth(nbytes: int = 256 << 20, iters: int = 10) -> float | None:
    """Device-to-device copy bandwidth of the current CuPy GPU (read + write bytes, GB/s), or None."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        src = cupy.ones(nbytes // 4, dtype=cupy.float32)
        dst = cupy.empty_like(src)
        sync = cupy.cuda.Device().synchronize

        def run():
            cupy.copyto(dst, src)
            sync()

        return 2 * src.nbytes / _time_copy(run, iters) / 1e9
    except Exception:
        return None
