"""Fake ``cupy.RawModule`` / ``RawKernel``: cudist's real kernels, compiled for the host, run through ctypes.

A RawModule must be cudist's kernel source (``#include <cudist/kernels/kernels.cuh>`` with ``-I``
the shipped headers); ``get_function`` accepts only the name expressions the module was built
with, as NVRTC does. A launch checks what a GPU would punish or what would silently corrupt:

* each argument has exactly the C type of the kernel parameter (parsed from the .cuh signature):
  a NumPy scalar of the right width, an array of the right dtype for ``T*``, a uint64 array of
  pointers for ``T* const*``, a one-element NumPy array of PtrPack's size for ``PtrPack<T>`` (what
  CuPy passes by value; a Python ``int`` would be passed by CuPy as a 64-bit value: refused);
* every pointer, and every pointer inside a pointer table, lies with the extent the kernel touches
  in one live allocation that the *current* device may access (its own memory, a peer's whose
  access was enabled, or pinned host memory), aligned to the element size; else the launch raises
  like cudaErrorIllegalAddress;
* replica counts are within 1..kMaxReplicas, the block fits, the grid is 2-D at most;
* afterwards no allocation the kernel could reach has its guard bytes overwritten.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import re
import threading
from pathlib import Path

import numpy as np

from cupy import _emu
from cupy._core import _queue_of, ndarray
from cupy.cuda.driver import CUDA_ERROR_NOT_FOUND, CUDADriverError

_BUILD_PY = Path(__file__).resolve().parents[2] / "build.py"
_lock = threading.Lock()
_lib = None
_build = None

_CTYPE_TO_DTYPE = {"__half": "float16", "float": "float32", "double": "float64", "int": "int32", "long long": "int64"}
_SCALAR_TYPES = {"int": np.int32, "long long": np.int64, "float": np.float32, "double": np.float64}
_CTYPES = {np.int32: ctypes.c_int, np.int64: ctypes.c_longlong, np.float32: ctypes.c_float, np.float64: ctypes.c_double}
_TABLE_COUNT = {"in": "n_in", "out": "n_out", "dst": "n_dst", "grads": "n_grads"}


def _build_module():
    global _build
    if _build is None:
        spec = importlib.util.spec_from_file_location("_cudist_emu_build", _BUILD_PY)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _build = mod
    return _build


def _library():
    global _lib
    with _lock:
        if _lib is None:
            _lib = _build_module().load()
        return _lib


def _kernel_digest(inc: Path) -> str:
    h = hashlib.sha256()
    for p in sorted((inc / "cudist" / "kernels").glob("*.cuh")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


_SIG = re.compile(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)")


def _parse_signatures(inc: Path) -> tuple[dict[str, list[tuple[str, str]]], int]:
    """{kernel: [(kind, name)]} from the headers' ``__global__`` templates, and kMaxReplicas.

    kind: "table" (T* const*), "ptr" (T* / const T*), "compute" (compute<T>::type), or a scalar C type.
    """
    sigs: dict[str, list[tuple[str, str]]] = {}
    text = "\n".join(p.read_text() for p in sorted((inc / "cudist" / "kernels").glob("*.cuh")))
    for m in _SIG.finditer(text):
        params = []
        for raw in m.group(2).split(","):
            raw = " ".join(raw.split())
            typ, name = raw.rsplit(" ", 1)
            if "* const*" in raw:
                kind = "table"
            elif typ.startswith("PtrPack<"):
                kind = "pack"
            elif "*" in typ:
                kind = "ptr"
            elif "compute<T>::type" in typ:
                kind = "compute"
            elif typ in _SCALAR_TYPES:
                kind = typ
            else:
                kind = "unknown:" + typ
            params.append((kind, name))
        sigs[m.group(1)] = params
    mx = re.search(r"kMaxReplicas\s*=\s*(\d+)", text)
    return sigs, int(mx.group(1)) if mx else 8


class RawModule:
    """Fake ``cupy.RawModule`` for cudist's kernel source only (see the module docstring)."""

    def __init__(self, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False, *,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if not isinstance(options, tuple):
            # Cython-typed in CuPy (``tuple options=()``).
            raise TypeError(f"Argument 'options' has incorrect type (expected tuple, got {type(options).__name__})")
        if code is None:
            raise NotImplementedError("emulator: RawModule(path=...) is not supported; pass code=")
        if "#include <cudist/kernels/kernels.cuh>" not in code:
            raise NotImplementedError("emulator: RawModule only runs cudist's kernels (#include <cudist/kernels/kernels.cuh>)")
        incs = [Path(o[2:]) for o in options if isinstance(o, str) and o.startswith("-I")]
        inc = next((i for i in incs if (i / "cudist" / "kernels" / "kernels.cuh").is_file()), None)
        if inc is None:
            # NVRTC would fail to find the header.
            raise RuntimeError(f"NVRTC_ERROR_COMPILATION: cannot open source file \"cudist/kernels/kernels.cuh\" (options {options!r})")
        emu_inc = _build_module().CSRC_INCLUDE
        if _kernel_digest(inc) != _kernel_digest(emu_inc):
            raise RuntimeError(
                f"emulator: the kernels under {inc} differ from {emu_inc}, which the emulation library is built "
                "from (a stale installed copy? reinstall cudist)"
            )
        self.code, self.options = code, tuple(options)
        self.name_expressions = tuple(name_expressions or ())
        self._sigs, self._max_replicas = _parse_signatures(inc)

    def get_function(self, name: str) -> RawKernel:
        if self.name_expressions and name not in self.name_expressions:
            raise CUDADriverError(CUDA_ERROR_NOT_FOUND, f"CUDA_ERROR_NOT_FOUND: named symbol not found ({name!r} is not among name_expressions)")
        m = re.fullmatch(r"cudist::kernels::(\w+)<(.+)>", name)
        if m is None or m.group(2) not in _CTYPE_TO_DTYPE or m.group(1) not in self._sigs:
            raise CUDADriverError(CUDA_ERROR_NOT_FOUND, f"CUDA_ERROR_NOT_FOUND: named symbol not found ({name!r})")
        kernel, dtype = m.group(1), _CTYPE_TO_DTYPE[m.group(2)]
        # A `_packed` kernel runs through the emulated pointer-table form of the same kernel (same
        # parameters in the same order, one body): its PtrPack arguments become host tables. The
        # packed bodies themselves run in tests/test_cuda_emulated.py through the C++ launchers.
        entry = kernel[: -len("_packed")] if kernel.endswith("_packed") else kernel
        fn = getattr(_library(), f"cudist_emu_{entry}_{dtype}", None)
        if fn is None:
            raise CUDADriverError(CUDA_ERROR_NOT_FOUND, f"CUDA_ERROR_NOT_FOUND: no emulated entry point for {name!r}")
        return RawKernel._make(name, entry, np.dtype(dtype), self._sigs[kernel], fn, self._max_replicas)


def _dim3(v, what):
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(t) <= 3 or any(not isinstance(x, (int, np.integer)) or x < 1 for x in t):
        raise ValueError(f"{what} must be 1 to 3 positive ints, got {v!r}")
    return tuple(int(x) for x in t) + (1,) * (3 - len(t))


class RawKernel:
    """A kernel of a fake RawModule; ``kernel(grid, block, args)`` runs it on the current device."""

    @classmethod
    def _make(cls, name, kernel, dtype, params, fn, max_replicas):
        self = cls.__new__(cls)
        self.name, self._entry, self.dtype, self.params, self._fn, self._max = name, kernel, dtype, params, fn, max_replicas
        self.launches = 0
        return self

    class _Function:
        """``RawKernel.kernel``: the compiled function (``ptr`` is its CUfunction handle)."""

        def __init__(self, ptr):
            self.ptr = ptr

    @property
    def kernel(self):
        return RawKernel._Function(id(self) or 1)

    def __call__(self, grid, block, args, shared_mem=0, stream=None, enable_cooperative_groups=False):
        for what, v in (("grid", grid), ("block", block)):
            if not isinstance(v, tuple):  # cupy.cuda.function.Function.__call__(tuple grid, tuple block, ...)
                raise TypeError(f"Argument '{what}' has incorrect type (expected tuple, got {type(v).__name__})")
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        if gz != 1 or by != 1 or bz != 1:
            raise NotImplementedError(f"emulator: {self.name} launched with grid {grid} block {block}; only (x, y) grids of x blocks")
        if bx > 1024:
            raise RuntimeError(f"cudaErrorInvalidConfiguration: block of {bx} threads (max 1024) for {self.name}")
        if not isinstance(args, tuple):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments ({', '.join(n for _, n in self.params)}), got {len(args)}")
        dev = _emu.THREAD.device
        cdefs, cvals, scalars, pointers, tables = [], [], {}, {}, {}
        item = self.dtype.itemsize
        packs = {}
        for (kind, pname), a in zip(self.params, args):
            where = f"{self.name} argument {pname!r}"
            if kind == "pack":
                # As CuPy's function.pyx: a numpy.ndarray of size one is passed by value (its bytes);
                # any other size is refused; a cupy.ndarray would pass a device pointer instead.
                if not isinstance(a, np.ndarray):
                    raise TypeError(f"{where}: a PtrPack<T> is passed by value as a one-element NumPy array, "
                                    f"got {type(a).__name__}")
                if a.size != 1:
                    raise TypeError(f"You are trying to pass a numpy.ndarray of shape {a.shape} as a kernel parameter. "
                                    "Only numpy.ndarrays of size one can be passed by value.")
                if a.dtype.itemsize != 8 * self._max:
                    raise TypeError(f"{where}: PtrPack<T> is {8 * self._max} bytes, the array element is {a.dtype.itemsize}")
                ptrs = np.frombuffer(a.tobytes(), np.uint64).copy()  # the value, captured at launch
                cdefs.append(ctypes.c_void_p)
                cvals.append(ptrs.ctypes.data)
                packs[pname] = ptrs
                continue
            if kind in ("ptr", "table"):
                if not isinstance(a, ndarray):
                    raise TypeError(f"{where}: expected a cupy.ndarray for a pointer parameter, got {type(a).__name__}")
                if kind == "ptr" and a.dtype != self.dtype:
                    raise TypeError(f"{where}: array of {a.dtype} passed for a {self.dtype} pointer")
                if kind == "table" and (a.dtype not in (np.uint64, np.int64) or not a._a.flags.c_contiguous):
                    raise TypeError(f"{where}: pointer table must be a contiguous uint64 array, got {a.dtype}")
                cdefs.append(ctypes.c_void_p)
                cvals.append(a._ptr or None)
                (pointers if kind == "ptr" else tables)[pname] = a
                continue
            want = {"compute": np.float64 if self.dtype == np.float64 else np.float32}.get(kind) or _SCALAR_TYPES.get(kind)
            if want is None:
                raise TypeError(f"{where}: emulator cannot pass a parameter of kind {kind}")
            if type(a) is not want:
                raise TypeError(
                    f"{where}: the kernel parameter is {np.dtype(want).name} but got {type(a).__name__} "
                    "(CuPy passes a Python int as int64 and a Python float as float64)"
                )
            cdefs.append(_CTYPES[want])
            cvals.append(a)
            scalars[pname] = a.item()
        # Every pointer the kernel will dereference, with the elements it may touch. Direct
        # pointers must be live now; pointer-table entries are read when the kernel runs (the
        # table upload may still be queued), and then may point into blocks already freed back
        # to the pool (legal: their users' work is stream-ordered before any reuse).
        direct = []
        for pname, a in pointers.items():
            direct.append((f"{pname}", a._ptr, self._extent(pname, None, scalars)))
        table_reads = []
        for pname, ptrs in packs.items():
            nname = _TABLE_COUNT.get(pname, "n")
            n = scalars.get(nname)
            if n is None or not 1 <= n <= self._max:
                raise ValueError(f"{self.name}: {nname}={n} must be within 1..{self._max} (kMaxReplicas)")
            table_reads.append((pname, ptrs[:n], n))
        for pname, t in tables.items():
            nname = _TABLE_COUNT.get(pname, "n")
            n = scalars.get(nname)
            if n is None or not 1 <= n <= self._max:
                raise ValueError(f"{self.name}: {nname}={n} must be within 1..{self._max} (kMaxReplicas)")
            if t.size < n:
                raise ValueError(f"{self.name}: pointer table {pname!r} has {t.size} entries for {nname}={n}")
            _emu.check_range(t._ptr, n * 8, f"{self.name} pointer table {pname!r}", device=dev)
            table_reads.append((pname, t._a[:n], n))
        self._check_pointers(direct, dev, pooled=False)
        if self._entry == "scatter_batch" and gy < scalars["n_dst"]:
            raise ValueError(f"{self.name}: grid y {gy} < n_dst {scalars['n_dst']}: replicas past the grid get nothing")
        keep = [a for a in args if isinstance(a, ndarray)]  # their memory, not its ownership
        keep_packs = list(packs.values())  # the host tables the emulated kernel reads
        launched = _emu.HANDOUTS

        def run():
            touched = list(direct)
            for pname, entries, _ in table_reads:
                for r, p in enumerate(entries.tolist()):
                    touched.append((f"{pname}[{r}]", int(p), self._extent(pname, r, scalars)))
            allocs = self._check_pointers(touched, dev, pooled=True, since=launched)
            # A block reused since the launch has its new owner's guard inside the old extent.
            allocs = [a for a in allocs if a is not None and a.live and a.stamp <= launched]
            fn = self._fn
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, *cdefs]
            fn.restype = None
            fn(gx, gy, bx, *cvals)
            for a in allocs:
                if not a.guard_intact():
                    raise _emu.IllegalAddress(f"{self.name} wrote past the end of a {a.size}-byte allocation on {a.where()}")

        raws = [a._a for a in keep] + keep_packs  # noqa: F841 - keeps the bytes mapped while queued
        q = _emu.current_queue(dev) if stream is None else _queue_of(stream, dev)
        if stream is not None and stream.ptr and getattr(stream, "device_id", dev) not in (dev, -1):
            # cudaLaunchKernel on a stream of another device.
            raise RuntimeError(f"cudaErrorInvalidResourceHandle: {self.name} launched on device {dev} into a stream of device {stream.device_id}")
        _emu.enqueue(q, lambda: (raws, run()), f"kernel {self.name}")
        self.launches += 1

    def _check_pointers(self, touched, dev, *, pooled, since=None):
        item = self.dtype.itemsize
        allocs = []
        for what, p, count in touched:
            if count <= 0:
                continue
            if p % item:
                raise RuntimeError(f"cudaErrorMisalignedAddress: {self.name} {what} = {p:#x} is not {item}-byte aligned")
            allocs.append(_emu.check_range(p, count * item, f"{self.name} {what}", device=dev, pooled=pooled, since=since))
        return allocs

    def _extent(self, pname: str, r: int | None, s: dict) -> int:
        """How many elements from the pointer ``pname`` (entry ``r`` of a table) the kernel touches."""
        k = self._entry
        if k in ("reduce_scatter", "all_gather_chunks"):
            return int(s["end"])
        if k == "scatter_batch":
            if pname == "src":
                return int(s["total"])
            per, total = int(s["per"]), int(s["total"])
            return max(0, min(per, total - r * per))
        return int(s["count"])
