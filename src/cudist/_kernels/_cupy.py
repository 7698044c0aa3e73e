"""The GPU kernel backend: cudist's CUDA kernels (``cudist/kernels/*.cuh``) run through CuPy.

The kernels ship as headers with the package (:func:`cudist.get_include`); they are compiled by
NVRTC through :class:`cupy.RawModule` the first time a dtype is used on a device (CuPy caches the
binaries on disk, keyed by the source, which names a digest of the headers). One launch handles up
to ``MAX_REPLICAS`` buffers; more are handled in several passes without changing the summation
order. The replica pointers reach the kernels by value (the ``*_packed`` kernels take a
``PtrPack<T>`` of up to 8 pointers, which CuPy passes from a one-element structured NumPy array):
nothing is uploaded per call, and the pointers sit in registers rather than being loaded from a
device table (all_reduce_one_shot<float> for sm_90 with NVRTC 13.5: 48 registers and global
LDG.E.128 loads by value, 72 registers and generic LD.E.128 loads from a table; see
tests/test_real_cupy.py).

Buffers may sit on different GPUs. Kernels then run on the first buffer's device, reading and
writing the others over peer access, which is enabled on first use; where peer access is
impossible the foreign buffers are staged through copies on that device. Work is ordered with
events against every involved device's current stream, so the calls are asynchronous like any
CuPy operation. When every replica sits on its own GPU and the buffers are large, all-reduce runs
two-shot (each GPU reduces one chunk then pushes it to the others), which spreads the traffic over
the links.

Two launch paths, one set of kernels. Where ``cudist._core`` was built with CUDA, its CUDA runtime
(static, inside the extension) sees the GPUs involved and its kernels were built for them
(``_core.cuda_architectures``), the collectives -- all-reduce in place and out of place,
reduce-to-one, broadcast and the two-shot all-reduce across GPUs -- are launched by the C++
launchers of ``cudist::cuda`` (<cudist/cuda/launch.hpp>, <cudist/cuda/p2p.hpp>;
``_core.cuda_all_reduce`` and its siblings), given CuPy's current stream of the launching GPU (of
every GPU for the two-shot one): one host-side orchestration serves C++ users and this backend,
as in flashinfer. Both runtimes work in each device's primary context, so CuPy's pointers and
streams are valid there. Everything else (the mirrored updates, the batch scatter), and every
collective where the launchers cannot serve, goes through NVRTC: the same ``.cuh`` kernels, the
same ``*_packed`` entry points with the same parameters. The staging, the event joins between
GPUs and the choice of two-shot are the same on both paths; only the launch differs, and the
results are identical bit for bit. ``CUDIST_CUDA_LAUNCHERS=auto|core|nvrtc`` chooses (see
:mod:`cudist._kernels._cuda_launch`, which also parses the kernel list both paths are built from,
<cudist/kernels/kernel_list.cuh>); :attr:`CupyBackend.launch_path` says which path is in use.

bfloat16: CuPy arrays of dtype ``ml_dtypes.bfloat16`` -- the dtype NumPy users have, which CuPy
(14 and later, with ``ml_dtypes`` installed) holds on the GPU -- go through the kernels' ``__nv_bfloat16``
forms: all-reduce, reduce-to-one, broadcast, the two-shot phases, the batch scatter and assign_add,
summed in float32 in replica order and rounded once, bit for bit the NumPy reference (ml_dtypes'
rounding and NaN, 0x7fc0). A ``uint16`` array is not taken for bfloat16 (it is an integer dtype
cudist does not sum): ``a.view(ml_dtypes.bfloat16)`` says what its bits are. bfloat16 variables
are updated by the kernels' ``__nv_bfloat16`` forms (float32 arithmetic, rounded once per stored
value: the NumPy reference's bits, ``bfloat16_updates``). The fused all-reduce + update kernels
also take bfloat16 / float16 gradients for float32 variables (``mixed_gradients``): their
``<float, G>`` instantiations (``CUDIST_MIXED_GRADIENTS`` in the kernel list) widen each gradient
exactly while summing in float32 in replica order, the bits of casting first, without the float32
copy.

Importing this module imports CuPy: :func:`cudist._kernels.get_backend` does so only when the
``cupy`` backend is asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from pathlib import Path

import cupy
import numpy as np
import optree

from cudist._arrays import join_streams
from cudist._kernels._base import SUPPORTED_DTYPES, UPDATE_KERNELS, KernelBackend, is_bfloat16, variant_of
from cudist._kernels._cuda_headers import cuda_include_dirs
from cudist._kernels._numpy import reference_reduce
from cudist._kernels._cuda_launch import (
    LAUNCHERS_ENV,
    dtype_ctypes,
    kernel_list,
    launch_mode,
    mixed_gradients,
    runs_on,
    takes_mixed_gradients,
)
from cudist._kernels._split import split_sizes
from cudist._reduce_util import ReduceOp

__all__ = [
    "CupyBackend",
    "CTYPES",
    "KERNELS",
    "MAX_REPLICAS",
    "kernel_source",
    "name_expression",
    "nvrtc_program",
    "compiled_names",
]

try:
    from cudist import _core  # the CUDA launchers, when the extension was built with CUDA
except ImportError:  # an install without the extension: NVRTC only
    _core = None


def _include_dir() -> Path:
    import cudist

    return Path(cudist.get_include())


#: C++ spelling of each supported dtype in the kernel templates (from the kernel list's dtype sets).
CTYPES = dtype_ctypes(_include_dir())
#: Kernel templates in namespace ``cudist::kernels`` and the dtypes each is instantiated for: the
#: kernel list of <cudist/kernels/kernel_list.cuh>, which the C++ launchers are instantiated from too.
KERNELS = kernel_list(_include_dir())
#: Variable dtype -> the gradient dtypes its fused kernels also take (CUDIST_MIXED_GRADIENTS).
MIXED = mixed_gradients(_include_dir())
#: Most replica buffers one launch touches (cudist::kernels::kMaxReplicas).
MAX_REPLICAS = 8
_THREADS = 256
_BLOCKS_PER_SM = 8
# Below this many bytes per buffer, the one-shot kernel on one device beats two-shot's 2N launches.
_TWO_SHOT_MIN_BYTES = 1 << 20
_VEC_BYTES = 16
#: ``cudist::kernels::PtrPack<T>``: MAX_REPLICAS device pointers, passed to the ``*_packed`` kernels by
#: value. CuPy passes a one-element NumPy array by value (its bytes become the kernel parameter).
_PACK = np.dtype([("p", np.uint64, (MAX_REPLICAS,))])


def _blocks_per_sm(fn) -> int:
    """How many blocks of _THREADS threads of RawKernel ``fn`` fit on one SM of the current device
    (the driver's occupancy calculator: registers, shared memory); _BLOCKS_PER_SM if it cannot say."""
    try:
        occ = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, _THREADS, 0))
    except Exception:  # noqa: BLE001 - an old CuPy, a driver without the call: the fixed guess
        return _BLOCKS_PER_SM
    return occ if occ > 0 else _BLOCKS_PER_SM


def _pack(arrays) -> np.ndarray:
    """The arrays' data pointers as a ``PtrPack<T>`` kernel argument (at most MAX_REPLICAS)."""
    p = np.zeros(1, _PACK)
    p["p"][0, : len(arrays)] = [a.data.ptr for a in arrays]
    return p


def _dtype_name(dtype) -> str:
    # "bfloat16" is a NumPy dtype only once ml_dtypes is imported: names pass as they are.
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def name_expression(kernel: str, dtype, grad_dtype=None) -> str:
    """The NVRTC name expression of a kernel instantiation, e.g. ``cudist::kernels::broadcast<float>``;
    with ``grad_dtype`` a fused kernel's mixed-precision one, ``...<float, __nv_bfloat16>``."""
    name = _dtype_name(dtype)
    args = CTYPES[name]
    if grad_dtype is not None and _dtype_name(grad_dtype) != name:
        args += f", {CTYPES[_dtype_name(grad_dtype)]}"
    return f"cudist::kernels::{kernel}<{args}>"


def _cuda_include_dirs() -> list[str]:
    """The CUDA headers' directories (<cuda_fp16.h>), CuPy's own CUDA first."""
    get_cuda_path = getattr(cupy.cuda, "get_cuda_path", None)
    root = get_cuda_path() if get_cuda_path is not None else None
    return cuda_include_dirs([root] if root else [])


def kernel_source(include_dir: Path | None = None) -> str:
    """The NVRTC source: an include of the shipped headers, stamped with their digest.

    CuPy keys its on-disk binary cache on the source text, not on included files; the digest makes a
    changed header recompile.
    """
    inc = include_dir or _include_dir()
    digest = hashlib.sha256()
    for path in sorted((inc / "cudist" / "kernels").glob("*.cuh")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return f"// cudist kernels {digest.hexdigest()}\n#include <cudist/kernels/kernels.cuh>\n"


def nvrtc_program(include_dir: Path | None = None) -> tuple[str, tuple[str, ...]]:
    """The (source, options) the backend hands to ``cupy.RawModule`` (CuPy then adds its own:
    ``--std``, its headers, ``-arch`` and ``-ftz=true``); tests compile exactly this."""
    inc = include_dir or _include_dir()
    return kernel_source(inc), ("-std=c++17", f"-I{inc}", *(f"-I{d}" for d in _cuda_include_dirs()))


def compiled_names(dtype) -> list[str]:
    """The name expressions compiled for ``dtype``: the by-value ``*_packed`` forms only (their
    pointers travel in the kernel parameters, where the table forms load them from device memory)."""
    dt = np.dtype(dtype).name
    names = [name_expression(k + "_packed", dt) for k, dts in KERNELS.items() if dt in dts]
    # The mixed-precision instantiations go into the variables' dtype's module.
    names += [name_expression(k + "_packed", dt, g) for k, dts in KERNELS.items()
              if takes_mixed_gradients(k) and dt in dts for g in MIXED.get(dt, ())]
    return names


def _ranges_overlap(a, b) -> bool:
    pa, pb = a.data.ptr, b.data.ptr
    return a.nbytes > 0 and b.nbytes > 0 and pa < pb + b.nbytes and pb < pa + a.nbytes


def _partial_overlap(a, b) -> bool:
    """Whether ``a`` and ``b`` overlap other than by being exactly the same elements."""
    return _ranges_overlap(a, b) and not (a.data.ptr == b.data.ptr and a.nbytes == b.nbytes)


_MEMORY_ASYNC = getattr(getattr(cupy.cuda, "memory", None), "MemoryAsync", None)


def _from_async_pool(a) -> bool:
    """Whether ``a`` lives in a stream-ordered pool (cudaMallocAsync: CuPy's MemoryAsyncPool).

    cudaDeviceEnablePeerAccess does not map such memory for other GPUs (that takes
    cudaMemPoolSetAccess on the pool, which CuPy does not expose), so kernels on another GPU must
    not touch it: it is staged through copies like memory of a GPU without peer access.
    """
    return _MEMORY_ASYNC is not None and isinstance(getattr(a.data, "mem", None), _MEMORY_ASYNC)


def _host_reduce(bufs, op):
    """The reference's reduction of device buffers, on the host (the 16-bit floats past
    MAX_REPLICAS buffers: see CupyBackend._half_on_host). Quiet about inf and NaN, as the kernels are."""
    with np.errstate(over="ignore", invalid="ignore"):
        return reference_reduce([cupy.asnumpy(x) for x in bufs], op)


def _op_code(op) -> int:
    """The launchers' cudist::reduce_op code (1: MEAN, 0: SUM), decided as the NVRTC path decides its divisor."""
    return 1 if op is ReduceOp.MEAN else 0


def _current_stream(device: int) -> int:
    """The handle of CuPy's current stream on ``device``: where the NVRTC path would launch."""
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr


class _CoreLaunchers:
    """The C++ launchers of ``cudist::cuda`` through ``core`` (``cudist._core``, or a stand-in with
    the same ``cuda_*`` functions), each enqueued on CuPy's current stream of the launching GPU.

    The arrays must be usable from that GPU (its own, or peers' with peer access enabled): the
    backend stages the others first, exactly as for an NVRTC launch.
    """

    def __init__(self, core, devices: int):
        self.core, self.devices = core, devices
        self._runs: dict[int, bool] = {}  # device -> whether the extension's kernels run on it

    def serve(self, arrays) -> bool:
        """Whether the extension's CUDA runtime sees every GPU the arrays live on and its kernels
        were built for them (``_core.cuda_architectures``; NVRTC compiles for any GPU)."""
        return all(self._serves(d) for d in {a.device.id for a in arrays})

    def _serves(self, device: int) -> bool:
        ok = self._runs.get(device)
        if ok is None:
            ok = device < self.devices
            if ok:
                props = cupy.cuda.runtime.getDeviceProperties(device)
                ok = runs_on(self.core.cuda_architectures, int(props["major"]) * 10 + int(props["minor"]))
            self._runs[device] = ok
        return ok

    def all_reduce(self, device, bufs, op):
        b = bufs[0]
        self.core.cuda_all_reduce([x.data.ptr for x in bufs], b.size, b.dtype.name, _op_code(op),
                                  stream=_current_stream(device), device=device)

    def all_reduce_into(self, device, inputs, outputs, op):
        b = inputs[0]
        self.core.cuda_all_reduce_into([x.data.ptr for x in inputs], [x.data.ptr for x in outputs], b.size,
                                       b.dtype.name, _op_code(op), stream=_current_stream(device), device=device)

    def reduce_to_one(self, device, bufs, out, op):
        self.core.cuda_reduce_to_one([x.data.ptr for x in bufs], out.data.ptr, out.size, out.dtype.name,
                                     _op_code(op), stream=_current_stream(device), device=device)

    def broadcast(self, device, src, dsts):
        self.core.cuda_broadcast(src.data.ptr, [x.data.ptr for x in dsts], src.size, src.dtype.name,
                                 stream=_current_stream(device), device=device)

    def p2p_all_reduce(self, bufs, op):
        """Two-shot across GPUs, each buffer's GPU on its current stream; the launcher joins the
        streams before and after (what the NVRTC path's join_streams calls do)."""
        b = bufs[0]
        devices = [x.device.id for x in bufs]
        self.core.cuda_p2p_all_reduce([(x.data.ptr, d) for x, d in zip(bufs, devices)], b.size, b.dtype.name,
                                      _op_code(op), streams=[_current_stream(d) for d in devices])


def _select_launchers():
    """``(launchers or None, forced, description)`` by ``CUDIST_CUDA_LAUNCHERS`` and what the
    extension offers.

    Raises:
        ValueError: CUDIST_CUDA_LAUNCHERS has a value other than auto, core or nvrtc.
        RuntimeError: it says ``core`` but the extension has no CUDA launchers or sees no GPU.
    """
    mode = launch_mode()
    if mode == "nvrtc":
        return None, False, f"NVRTC for every kernel ({LAUNCHERS_ENV}=nvrtc)"
    core, n, why = _core, 0, None
    if core is None:
        why = "cudist._core is not importable"
    elif not getattr(core, "cuda_built", False):
        why = "cudist._core was built without CUDA"
    else:
        n = int(core.cuda_device_count())
        if n < 1:
            v = int(core.cuda_runtime_version)
            why = f"the CUDA runtime {v // 1000}.{v % 1000 // 10} of cudist._core sees no GPU"
    if why is not None:
        if mode == "core":
            raise RuntimeError(f"{LAUNCHERS_ENV}=core, but {why}; unset it (or set {LAUNCHERS_ENV}=nvrtc) to "
                               "launch every kernel through NVRTC")
        return None, False, f"NVRTC for every kernel ({why})"
    return _CoreLaunchers(core, n), mode == "core", (
        f"cudist._core's CUDA launchers for the collectives ({n} GPU(s) seen), NVRTC for the rest "
        f"({LAUNCHERS_ENV}={mode})"
    )


class CupyBackend(KernelBackend):
    """Kernel backend over CuPy arrays on NVIDIA GPUs (see the module docstring).

    ``launch_path`` says how it launches: through cudist._core's CUDA launchers for the
    collectives (NVRTC for the rest), or through NVRTC for everything, and why.
    """

    name = "cupy"
    dtypes = SUPPORTED_DTYPES
    # CuPy arrays of dtype ml_dtypes.bfloat16 (CuPy >= 14 holds them when ml_dtypes is installed):
    # the collectives, the batch scatter and assign_add run the kernels' __nv_bfloat16 forms.
    bfloat16 = True
    # bfloat16 variables: the update kernels' __nv_bfloat16 forms (float32 math, one rounding per store).
    bfloat16_updates = True
    # bfloat16 / float16 gradients of float32 variables: the fused kernels' <float, G> forms.
    mixed_gradients = True
    xp = cupy

    def __init__(self):
        self._lock = threading.Lock()
        self._local = threading.local()  # .concurrent: the GPUs of this thread's concurrently() block
        self._modules: dict[str, cupy.RawModule] = {}  # per dtype; CuPy compiles per device
        self._functions: dict[tuple, object] = {}  # (device, dtype, kernel) -> RawKernel
        self._peer: dict[tuple[int, int], bool] = {}  # (device, peer) -> peer access enabled
        self._sms: dict[int, int] = {}
        self._occupancy: dict[tuple, int] = {}  # (device, dtype, kernel) -> resident blocks per SM
        self._program: tuple | None = None  # (NVRTC source, options): the same for every dtype
        self._launchers, self._launchers_forced, self.launch_path = _select_launchers()

    def _core_for(self, arrays):
        """The C++ launchers when they can serve these arrays, else None (the NVRTC path)."""
        launchers = self._launchers
        if launchers is None or launchers.serve(arrays):
            return launchers
        if self._launchers_forced:
            raise RuntimeError(
                f"{LAUNCHERS_ENV}=core, but cudist._core's CUDA launchers cannot serve GPUs "
                f"{sorted({a.device.id for a in arrays})}: its CUDA runtime sees {launchers.devices} GPU(s) and its "
                f"kernels are built for {launchers.core.cuda_architectures or 'no architecture'}"
            )
        return None

    def _span(self, a):
        start = int(a.data.ptr)
        return start, start + a.nbytes

    # ------------------------------------------------------------------ compilation and launch
    @staticmethod
    def _key(device: int, dtype, kernel: str, grad_dtype=None) -> tuple:
        """A compiled kernel's key: (device, dtype, kernel), and the gradients' dtype where mixed."""
        key = (device, np.dtype(dtype).name, kernel)
        return key if grad_dtype is None else (*key, np.dtype(grad_dtype).name)

    def _function(self, device: int, dtype, kernel: str, grad_dtype=None):
        dtype = np.dtype(dtype)
        key = self._key(device, dtype, kernel, grad_dtype)
        fn = self._functions.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._functions.get(key)
            if fn is None:
                mod = self._modules.get(dtype.name)
                if mod is None:
                    if self._program is None:
                        self._program = nvrtc_program()
                    source, options = self._program
                    mod = cupy.RawModule(code=source, options=options, name_expressions=compiled_names(dtype))
                    self._modules[dtype.name] = mod
                with cupy.cuda.Device(device):
                    fn = mod.get_function(name_expression(kernel + "_packed", dtype, grad_dtype))  # compiles for this device
                    self._occupancy[key] = _blocks_per_sm(fn)
                self._functions[key] = fn
        return fn

    def _grid(self, device: int, count: int, itemsize: int, kernel: str | None = None, dtype=None,
              grad_dtype=None) -> int:
        """Blocks for ``count`` elements: one 16-byte vector per thread, at most one full wave (SMs x
        the kernel's resident blocks per SM, queried once per device and kernel); the kernels'
        grid-stride loops cover the rest."""
        sms = self._sms.get(device)
        if sms is None:
            sms = self._sms[device] = int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])
        per_sm = self._occupancy.get(self._key(device, dtype, kernel, grad_dtype), _BLOCKS_PER_SM) if kernel else _BLOCKS_PER_SM
        groups = -(-count * itemsize // _VEC_BYTES)
        return max(1, min(-(-groups // _THREADS), sms * per_sm))

    def _launch(self, device, kernel, dtype, count, args, *, grid_y=1, grad_dtype=None):
        fn = self._function(device, dtype, kernel, grad_dtype)
        blocks = self._grid(device, count, np.dtype(dtype).itemsize, kernel, dtype, grad_dtype)
        with cupy.cuda.Device(device):
            fn((blocks, grid_y), (_THREADS,), args)

    # ------------------------------------------------------------------ devices
    def _peer_ok(self, device: int, peer: int) -> bool:
        """Whether kernels on ``device`` may touch memory of ``peer`` (enabling access on first use)."""
        if device == peer:
            return True
        key = (device, peer)
        ok = self._peer.get(key)
        if ok is None:
            rt = cupy.cuda.runtime
            ok = bool(rt.deviceCanAccessPeer(device, peer))
            if ok:
                with cupy.cuda.Device(device):
                    try:
                        rt.deviceEnablePeerAccess(peer)
                    except rt.CUDARuntimeError as e:
                        # 704: cudaErrorPeerAccessAlreadyEnabled (someone else enabled it: fine).
                        if getattr(e, "status", None) != 704:
                            ok = False
            self._peer[key] = ok
        return ok

    def _reachable(self, device: int, a) -> bool:
        """Whether kernels on ``device`` may touch array ``a`` (its own, or a peer's outside async pools)."""
        d = a.device.id
        return d == device or (self._peer_ok(device, d) and not _from_async_pool(a))

    def reaches(self, device: int, a) -> bool:
        """Whether kernels on ``device`` may read ``a`` in place: the collectives' own test (what
        fails it, another GPU without peer access or a stream-ordered pool, they stage through copies)."""
        return self._reachable(device, a)

    def _wait_for(self, waiter: int, devices) -> None:
        """Makes ``waiter``'s current stream wait for the work queued so far on ``devices``."""
        join_streams(cupy, (waiter,), devices)

    @contextlib.contextmanager
    def concurrently(self, devices):
        """Launches on GPUs ``devices`` that read each other's memory (gradients over peer access)
        but write nothing another launch of the block reads: on entry every one of ``devices``
        waits once for the work queued so far on all of them; inside, the launches skip their own
        cross-GPU waits (the staging's: before each launch its GPU waits for the other GPUs it
        reads, after it those GPUs wait for it -- which would order the block's launches one after
        another); on exit every one of ``devices`` waits for all of them (their later work may
        overwrite or free what a launch read). A launch touching a GPU outside ``devices`` keeps
        its own waits. Per thread; blocks do not nest."""
        devs = frozenset(int(d) for d in devices)
        join_streams(cupy, devs, devs)
        self._local.concurrent = devs
        try:
            yield
        finally:
            self._local.concurrent = None
            join_streams(cupy, devs, devs)

    class _Staging:
        """Makes every array usable by kernels on ``device``: peer-accessible ones as they are,
        the others as copies on ``device`` (copied back on ``finish`` when written)."""

        def __init__(self, backend, device, arrays, written):
            self.backend, self.device = backend, device
            self.others = sorted({a.device.id for a in arrays} - {device})
            block = getattr(backend._local, "concurrent", None)
            if block is not None and device in block and block.issuperset(self.others):
                self.others = []  # ordered by the concurrently() block instead
            backend._wait_for(device, self.others)
            self.arrays = []
            staged = {}  # id(original) -> copy on `device`
            back = {}  # id(original) -> (original, copy) for the ones the kernels write
            for a, w in zip(arrays, written):
                if backend._reachable(device, a):
                    self.arrays.append(a)
                    continue
                s = staged.get(id(a))
                if s is None:
                    with cupy.cuda.Device(device):
                        s = staged[id(a)] = a.copy()  # ndarray.copy() copies into the current device
                if w:
                    back[id(a)] = (a, s)
                self.arrays.append(s)
            self.back = list(back.values())

        def finish(self):
            for orig, s in self.back:
                with cupy.cuda.Device(self.device):
                    orig.data.copy_from_device_async(s.data, s.nbytes)
            # Later work on the other devices must see what the kernels wrote there.
            join_streams(cupy, self.others, (self.device,))

    # ------------------------------------------------------------------ building blocks
    def _reduce_into(self, device, bufs, out, extra, divisor):
        """Reduces ``bufs`` into ``out`` (and ``extra`` on the last pass), MAX_REPLICAS per pass.

        All arrays must be usable from ``device``. Between passes the running sum is kept in ``out``,
        which preserves the order ((b0 + b1) + ...) exactly since every partial sum is rounded to
        the dtype anyway.
        """
        n, count, dtype = len(bufs), out.size, out.dtype
        done = 0
        while done < n:
            ins = [out] if done else []
            take = MAX_REPLICAS - len(ins)
            ins += list(bufs[done : done + take])
            done += take
            last = done >= n
            outs = [out] + (list(extra) if last else [])
            self._launch(
                device,
                "all_reduce_one_shot",
                dtype,
                count,
                (
                    _pack(ins),
                    np.int32(len(ins)),
                    _pack(outs),
                    np.int32(len(outs)),
                    np.int64(count),
                    np.int32(divisor if last else 0),
                ),
            )

    def _broadcast_from(self, device, src, dsts):
        count = src.size
        for g in range(0, len(dsts), MAX_REPLICAS):
            group = dsts[g : g + MAX_REPLICAS]
            self._launch(
                device,
                "broadcast",
                src.dtype,
                count,
                (src, _pack(group), np.int32(len(group)), np.int64(count)),
            )

    def _all_reduce_two_shot(self, bufs, divisor):
        """Each GPU d reduces chunk d of every buffer into its own, then pushes it to the others.

        Phase 2 on GPU d touches only chunk d, which no other GPU reads or writes, so each GPU
        needs only its own stream order between the phases.
        """
        n, count, dtype = len(bufs), bufs[0].size, bufs[0].dtype
        devices = [b.device.id for b in bufs]
        width = _VEC_BYTES // dtype.itemsize
        chunk = -(-count // n)
        chunk = -(-chunk // width) * width
        join_streams(cupy, devices, devices)
        for r, d in enumerate(devices):
            begin, end = min(r * chunk, count), (count if r == n - 1 else min((r + 1) * chunk, count))
            if begin >= end:
                continue
            ptrs = _pack(bufs)
            span = end - begin
            self._launch(
                d,
                "reduce_scatter",
                dtype,
                span,
                (ptrs, np.int32(n), np.int64(chunk), np.int64(begin), np.int64(end), np.int32(divisor)),
            )
            self._launch(
                d,
                "all_gather_chunks",
                dtype,
                span,
                (ptrs, np.int32(n), np.int64(chunk), np.int64(begin), np.int64(end)),
            )
        join_streams(cupy, devices, devices)

    def _use_two_shot(self, bufs) -> bool:
        devices = [b.device.id for b in bufs]
        if len(set(devices)) != len(devices) or len(bufs) > MAX_REPLICAS:
            return False
        if bufs[0].nbytes < _TWO_SHOT_MIN_BYTES:
            return False
        return all(self._reachable(d, b) for d in devices for b in bufs)

    # ------------------------------------------------------------------ hooks
    @staticmethod
    def _half_on_host(bufs) -> bool:
        """float16 or bfloat16 over more than MAX_REPLICAS buffers: summed on the host by the reference.

        The 16-bit floats accumulate in float32 and round once (the contract); the kernels keep the
        running sum between their passes of MAX_REPLICAS buffers in the 16-bit dtype, which would
        round at every pass (the C++ launchers refuse them: cudaErrorNotSupported). Only logical
        GPUs give more.
        """
        return len(bufs) > MAX_REPLICAS and (bufs[0].dtype == np.float16 or is_bfloat16(bufs[0].dtype))

    def _hook_all_reduce(self, inputs, outputs, op):
        n, count = len(inputs), inputs[0].size
        if count == 0:
            return
        if self._half_on_host(inputs):
            s = _host_reduce(inputs, op)
            for o in outputs:
                o.set(s)
            return
        divisor = n if op is ReduceOp.MEAN else 0
        if outputs is inputs or all(o is i for o, i in zip(outputs, inputs)):
            self._all_reduce_in_place(outputs, op)
            return
        # Out of place: one-shot on the first output's GPU (the others over peer access, or
        # staged), reading each input once and writing each output once.
        device = outputs[0].device.id
        core = self._core_for(list(inputs) + list(outputs))
        st = self._Staging(self, device, list(inputs) + list(outputs), [False] * n + [True] * n)
        ins, outs = st.arrays[:n], st.arrays[n:]
        if core is not None:
            core.all_reduce_into(device, ins, outs, op)
        elif n <= MAX_REPLICAS:
            self._launch(
                device,
                "all_reduce_one_shot",
                outs[0].dtype,
                count,
                (
                    _pack(ins),
                    np.int32(n),
                    _pack(outs),
                    np.int32(n),
                    np.int64(count),
                    np.int32(divisor),
                ),
            )
        else:
            # The running sum lives in outs[0], which is no later input (it is at most ins[0],
            # which the first pass consumes).
            self._reduce_into(device, ins, outs[0], outs[1:MAX_REPLICAS], divisor)
            self._broadcast_from(device, outs[0], outs[MAX_REPLICAS:])
        st.finish()

    def _all_reduce_in_place(self, bufs, op):
        n = len(bufs)
        divisor = n if op is ReduceOp.MEAN else 0
        core = self._core_for(bufs)
        if self._use_two_shot(bufs):
            if core is not None:
                core.p2p_all_reduce(bufs, op)
            else:
                self._all_reduce_two_shot(bufs, divisor)
            return
        device = bufs[0].device.id
        st = self._Staging(self, device, bufs, [True] * n)
        b = st.arrays
        if core is not None:
            core.all_reduce(device, b, op)
        elif n <= MAX_REPLICAS:
            self._reduce_into(device, b, b[0], b[1:], divisor)
        else:
            # The running sum lives in b[0], which the first pass consumes before overwriting it.
            self._reduce_into(device, b, b[0], b[1:MAX_REPLICAS], divisor)
            self._broadcast_from(device, b[0], b[MAX_REPLICAS:])
        st.finish()

    def _hook_reduce_to_one(self, bufs, op, out):
        if out.size == 0:
            return
        if self._half_on_host(bufs):
            out.set(_host_reduce(bufs, op))
            return
        n = len(bufs)
        divisor = n if op is ReduceOp.MEAN else 0
        device = out.device.id
        core = self._core_for(list(bufs) + [out])
        st = self._Staging(self, device, list(bufs) + [out], [False] * n + [True])
        b, o = st.arrays[:n], st.arrays[n]
        # An output exactly equal to an input is fine (each element is read, then written, by one
        # thread); partially overlapping one, threads would overwrite elements others still read.
        # With several passes `o` also holds the running sum, so it must not overlap a later input.
        if any(_partial_overlap(o, x) for x in b) or (
            n > MAX_REPLICAS and any(_ranges_overlap(o, x) for x in b[MAX_REPLICAS:])
        ):
            with cupy.cuda.Device(device):
                tmp = cupy.empty_like(o)
            if core is not None:
                core.reduce_to_one(device, b, tmp, op)
                core.broadcast(device, tmp, [o])
            else:
                self._reduce_into(device, b, tmp, [], divisor)
                self._broadcast_from(device, tmp, [o])
        elif core is not None:
            core.reduce_to_one(device, b, o, op)
        else:
            self._reduce_into(device, b, o, [], divisor)
        st.finish()

    def _hook_broadcast(self, src, dsts):
        if src.size == 0:
            return
        device = src.device.id
        core = self._core_for([src] + list(dsts))
        st = self._Staging(self, device, [src] + list(dsts), [False] + [True] * len(dsts))
        s, ds = st.arrays[0], st.arrays[1:]
        # Exact aliasing is harmless (each element is read before it is written, by one thread);
        # a partially overlapping destination would clobber source elements still to be read.
        if any(_ranges_overlap(s, d) and d.data.ptr != s.data.ptr for d in ds):
            with cupy.cuda.Device(device):
                s = s.copy()
        if core is not None:
            core.broadcast(device, s, ds)
        else:
            self._broadcast_from(device, s, ds)
        st.finish()

    def _hook_all_gather(self, bufs, axis):
        device = bufs[0].device.id
        others = sorted({b.device.id for b in bufs} - {device})
        with cupy.cuda.Device(device):
            self._wait_for(device, others)  # the copies read what the sources' GPUs wrote
            local = [b if b.device.id == device else b.copy() for b in bufs]
            out = cupy.concatenate(local, axis=axis)
        # ... and the sources' GPUs may overwrite (or free) their buffers only after the copies.
        join_streams(cupy, others, (device,))
        return out

    def _mirrored(self, kernel, copies, slots, grad, scalars, grads=None):
        """Runs a mirrored-update kernel on copies[:MAX_REPLICAS] (and the slots), then broadcasts
        copy 0 of each to the rest. With ``grads`` (a list), the fused all-reduce form: the kernel
        sums up to MAX_REPLICAS gradients itself; more are first reduced into a temporary."""
        n, count, dtype = len(copies), copies[0].size, copies[0].dtype
        # (mirrored_assign_add's value has no mixed form)
        inputs, grad_dtype = self._gradient_inputs(kernel, dtype, [grad] if grads is None else grads, mixed=grads is not None)
        if count == 0:
            return
        device = copies[0].device.id
        groups = [list(copies)] + [list(s) for s in slots]
        flat = [a for g in groups for a in g] + inputs
        k = len(inputs)
        st = self._Staging(self, device, flat, [True] * (len(flat) - k) + [False] * k)
        staged = st.arrays
        g_arrs = staged[len(flat) - k :]
        staged_groups = [staged[i * n : (i + 1) * n] for i in range(len(groups))]
        m = min(n, MAX_REPLICAS)
        tables = [_pack(g[:m]) for g in staged_groups]
        if kernel == "mirrored_assign_add":
            args = (tables[0], np.int32(m), g_arrs[0], np.int64(count), *scalars)
        elif grads is None:
            args = (*tables, np.int32(m), g_arrs[0], *scalars, np.int64(count))
        else:
            g_arrs = self._fit_gradients(device, g_arrs)
            gt = _pack(g_arrs)
            args = (*tables, np.int32(m), gt, np.int32(len(g_arrs)), *scalars, np.int64(count))
        self._launch(device, kernel, dtype, count, args, grad_dtype=grad_dtype)
        if n > m:
            for group in staged_groups:
                self._broadcast_from(device, group[0], group[m:])
        st.finish()

    @staticmethod
    def _gradient_inputs(kernel, dtype, grads, mixed=True):
        """The gradients a kernel summing them for copies of ``dtype`` reads, and the gradients'
        dtype of its mixed-precision launch (None: the copies' own).

        Raises:
            TypeError: gradients of another dtype than the copies', other than the kernel list's
                mixed pairs (bfloat16 / float16 for float32 copies) where ``mixed``.
        """
        inputs = list(grads)
        if inputs[0].dtype == dtype:
            return inputs, None
        if not mixed or inputs[0].dtype.name not in MIXED.get(dtype.name, ()):
            # Only the kernels summing gradients have mixed instantiations, and only for the pairs
            # of the kernel list: anything else would be misread by the kernel, never silently.
            raise TypeError(
                f"{kernel}: the gradients have dtype {inputs[0].dtype.name} but the copies have dtype "
                f"{dtype.name}; the cupy backend's kernels take gradients of the copies' dtype, or bfloat16 / "
                f"float16 ones for float32 copies in the fused all-reduce forms (cast them first, e.g. "
                f"g.astype({dtype.name!r}): exact for bfloat16/float16 -> float32)"
            )
        if len(inputs) > MAX_REPLICAS:
            # Past one launch's gradients the head is pre-summed into a temporary of the copies'
            # dtype: widened first (exact), so that sum is float32 too, not a 16-bit rounding.
            # Each on its own GPU (astype works on the current one).
            wide = []
            for g in inputs:
                with cupy.cuda.Device(g.device.id):
                    wide.append(g.astype(dtype))
            return wide, None
        return inputs, inputs[0].dtype

    def _fit_gradients(self, device, g_arrs):
        """At most MAX_REPLICAS gradients (usable on ``device``) for one launch, replica order kept:
        more are pre-summed -- float16 / bfloat16 on the host by the reference (their float32
        accumulation would round between passes), the others' head into a temporary the kernel
        adds the rest to."""
        k = len(g_arrs)
        if k <= MAX_REPLICAS:
            return g_arrs
        with cupy.cuda.Device(device):
            tmp = cupy.empty_like(g_arrs[0])
        if self._half_on_host(g_arrs):
            tmp.set(_host_reduce(g_arrs, ReduceOp.SUM))
            return [tmp]
        head = k - (MAX_REPLICAS - 1)
        self._reduce_into(device, g_arrs[:head], tmp, [], 0)
        return [tmp, *g_arrs[head:]]

    def _hook_reduce_unscale_flag(self, grads, scale, out, flag):
        """LossScaleOptimizer's reduction on ``out``'s GPU: one ``reduce_unscale_finite`` launch
        reading every gradient where it is (peer access, or staged copies) and setting ``flag`` (a
        one-element int32 array on that GPU) to 1 where ``out`` gets an inf or NaN; nothing is
        read back (the caller reads its flags once per step)."""
        dtype, count = out.dtype, out.size
        inputs, grad_dtype = self._gradient_inputs("reduce_unscale_finite", dtype, grads)
        if count == 0:
            return
        device = out.device.id
        st = self._Staging(self, device, [out, flag, *inputs], [True, True] + [False] * len(inputs))
        o, f, *g_arrs = st.arrays
        g_arrs = self._fit_gradients(device, g_arrs)
        args = (_pack(g_arrs), np.int32(len(g_arrs)), o, np.int64(count), self._ct(dtype)(scale), f)
        self._launch(device, "reduce_unscale_finite", dtype, count, args, grad_dtype=grad_dtype)
        st.finish()

    def _hook_reduce_unscale_finite(self, grads, scale, out):
        with cupy.cuda.Device(out.device.id):
            flag = cupy.zeros(1, np.int32)
            self._hook_reduce_unscale_flag(grads, scale, out, flag)
            return not bool(flag.get()[0])

    @staticmethod
    def _ct(dtype):
        # The 16-bit floats' kernels take their hyper-parameters in float32, their compute type.
        return np.float32 if dtype == np.float16 or is_bfloat16(dtype) else np.dtype(dtype).type

    def _hook_assign_add(self, copies, value, negate):
        self._mirrored("mirrored_assign_add", copies, [], value, (np.int32(1 if negate else 0),))

    # The optimizers of UPDATE_KERNELS: one fused kernel per variant (``mirrored_all_reduce_<name>``,
    # their hooks generated from the table below the class); the plain update is that kernel with
    # one gradient.
    def _opt(self, name, copies, slots, grads, hyper):
        ct = self._ct(copies[0].dtype)
        scalars = tuple(ct(h) for h in hyper)
        self._mirrored(f"mirrored_all_reduce_{name}", copies, list(slots), None, scalars, grads=list(grads))

    # ------------------------------------------------------------------ batch scatter
    def scatter(self, batch, devices):
        """Splits a (nested) batch by the ceil rule into one new CuPy array per replica device.

        Args:
            batch: NumPy or CuPy arrays (a nest of them) with the batch dimension first.
            devices: one CUDA device id per replica (repeats allowed: logical replicas).

        Returns:
            A list with one structure like ``batch`` per replica, its leaves on that replica's device.

        A host batch is copied piece by piece (from pinned memory these copies run at full PCIe
        speed). A device batch is split by one kernel launch per group of replicas, writing straight
        into the replicas' memory over peer access where the devices differ.
        """
        devices = [int(d) for d in devices]
        if not devices:
            raise ValueError("scatter: expected at least one replica device, got none")
        leaves, treedef = optree.tree_flatten(batch)
        if not leaves:
            raise ValueError("scatter: the batch has no array leaves to split")
        per_leaf = []
        bsz = None
        for i, leaf in enumerate(leaves):
            a = leaf if isinstance(leaf, (np.ndarray, cupy.ndarray)) else np.asarray(leaf)
            if a.ndim == 0:
                raise ValueError(f"scatter: leaf {i} is a scalar and has no batch dimension to split")
            if bsz is None:
                bsz = a.shape[0]
            elif a.shape[0] != bsz:
                raise ValueError(f"scatter: leaf {i} has batch size {a.shape[0]} but leaf 0 has batch size {bsz}")
            per_leaf.append(self._scatter_leaf(a, devices))
        return [optree.tree_unflatten(treedef, [p[r] for p in per_leaf]) for r in range(len(devices))]

    def _scatter_leaf(self, a, devices):
        n = len(devices)
        sizes = split_sizes(a.shape[0], n)
        outs = []
        for d, size in zip(devices, sizes):
            with cupy.cuda.Device(d):
                outs.append(cupy.empty((size,) + a.shape[1:], dtype=a.dtype))
        row = int(np.prod(a.shape[1:], dtype=np.int64))
        total = a.shape[0] * row
        if total == 0:
            return outs
        if isinstance(a, np.ndarray):
            start = 0
            for out, size in zip(outs, sizes):
                if size:
                    with out.device:
                        out.set(np.ascontiguousarray(a[start : start + size]))
                start += size
            return outs
        src = a if a.flags.c_contiguous else cupy.ascontiguousarray(a)
        device = src.device.id
        if not self.computes(src.dtype) or any(not self._reachable(device, o) for o in outs):
            # No kernel for this dtype, or no peer access: plain copies (the driver stages them).
            self._wait_for(device, set(devices))
            with cupy.cuda.Device(device):
                start = 0
                for out, size in zip(outs, sizes):
                    if size:
                        out.data.copy_from_device_async(src[start : start + size].data, out.nbytes)
                    start += size
            join_streams(cupy, set(devices), (device,))
            return outs
        self._wait_for(device, set(devices))
        per = sizes[0] * row
        for g in range(0, n, MAX_REPLICAS):
            group = outs[g : g + MAX_REPLICAS]
            begin = g * per
            if begin >= total:
                break  # the remaining replicas get empty pieces
            self._launch(
                device,
                "scatter_batch",
                src.dtype,
                per,
                (src.ravel()[begin:], _pack(group), np.int32(len(group)), np.int64(per),
                 np.int64(total - begin)),
                grid_y=len(group),
            )
        join_streams(cupy, set(devices), (device,))
        return outs


def _rule_hooks(name):
    """The plain and fused hooks of ``name``: the ``mirrored_all_reduce_<variant>`` kernel of the
    variant its slots call for (:func:`variant_of`: ``name`` itself without optional slots)."""
    nslots = len(UPDATE_KERNELS[name][0])

    def plain(self, copies, *args):
        variant, slots = variant_of(name, args[:nslots])
        self._opt(variant, copies, slots, (args[nslots],), args[nslots + 1 :])

    def fused(self, copies, *args):
        variant, slots = variant_of(name, args[:nslots])
        self._opt(variant, copies, slots, args[nslots], args[nslots + 1 :])

    return plain, fused


for _name in UPDATE_KERNELS:
    if f"_hook_{_name}" not in CupyBackend.__dict__:
        _plain, _fused = _rule_hooks(_name)
        setattr(CupyBackend, f"_hook_{_name}", _plain)
        setattr(CupyBackend, f"_hook_all_reduce_{_name}", _fused)
del _name, _plain, _fused
