"""The CUDA launchers of the extension ``cudist._core`` (built when CMake finds nvcc).

Without a GPU (or driver) this checks what must hold everywhere: the build metadata, that the
extension imports and counts no device, that launches raise a RuntimeError naming the CUDA error,
and the argument checks (ValueError before any CUDA call). The tests marked ``gpu``/``multi_gpu``
run the launchers on real devices over CuPy arrays (``data.ptr``) against the NumPy reference, bit
for bit; they also need the extension's own CUDA runtime to see the devices, so they skip under a
CuPy emulation.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cudist import _core
from cudist._kernels._numpy import reference_reduce
from cudist._reduce_util import ReduceOp

DTYPES = ("float16", "float32", "float64", "int32", "int64")
OPS = {ReduceOp.SUM: _core.SUM, ReduceOp.MEAN: _core.MEAN}

cuda_built = pytest.mark.skipif(not _core.cuda_built, reason="cudist._core was built without CUDA")
#: The launcher bindings of a CUDA build (the cupy backend's collectives go through them).
LAUNCHERS = ("cuda_all_reduce", "cuda_all_reduce_into", "cuda_reduce_to_one", "cuda_broadcast", "cuda_p2p_all_reduce")


def test_build_metadata():
    assert isinstance(_core.cuda_built, bool)
    if _core.cuda_built:
        assert re.fullmatch(r"\d+[a-z]?(,\d+[a-z]?)*", _core.cuda_architectures), _core.cuda_architectures
        assert _core.cuda_runtime_version >= 11000
        for name in LAUNCHERS:
            assert callable(getattr(_core, name)), name
    else:
        assert _core.cuda_architectures == "" and _core.cuda_runtime_version == 0
        assert _core.cuda_device_count() == 0
        for name in LAUNCHERS:
            assert not hasattr(_core, name), name


def test_info_names_the_cuda_build():
    out = subprocess.run([sys.executable, "-m", "cudist", "--info"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("C++ extension:"))
    if _core.cuda_built:
        assert "with CUDA" in line
        for arch in _core.cuda_architectures.split(","):
            assert f"sm_{arch}" in line
    else:
        assert "CPU only" in line


_NO_DEVICE_SCRIPT = textwrap.dedent(
    """
    from cudist import _core
    assert _core.cuda_device_count() == 0
    for call in (lambda: _core.cuda_all_reduce([4096, 8192], 10, "float32", _core.SUM),
                 lambda: _core.cuda_all_reduce([4096], 10, "float32", _core.SUM),
                 lambda: _core.cuda_p2p_all_reduce([(4096, 0), (8192, 1)], 10, "int64", _core.MEAN),
                 lambda: _core.cuda_all_reduce_into([4096], [8192], 10, "float16", _core.SUM),
                 lambda: _core.cuda_reduce_to_one([4096, 8192], 8192, 10, "int32", _core.MEAN, device=0),
                 lambda: _core.cuda_broadcast(4096, [8192], 0, "float64")):
        try:
            call()
        except RuntimeError as e:
            print("RuntimeError:", e)
        else:
            raise SystemExit("no error without a device")
    assert _core.cuda_device_count() == 0
    """
)


@cuda_built
def test_without_a_device_imports_and_launches_raise():
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on GPU machines too; on machines
    # without a driver the static runtime still loads (the extension imports) and says so.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", _NO_DEVICE_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    errors = out.stdout.strip().splitlines()
    wheres = ["cuda_all_reduce", "cuda_all_reduce", "cuda_p2p_all_reduce", "cuda_all_reduce_into", "cuda_reduce_to_one",
              "cuda_broadcast"]
    assert len(errors) == len(wheres)
    for line, where in zip(errors, wheres):
        # e.g. "cuda_all_reduce: CUDA error cudaErrorNoDevice (no CUDA-capable device is detected)"
        assert re.match(rf"RuntimeError: {where}: CUDA error cudaError\w+ \(.+\)$", line), line
        assert "cudaErrorNoDevice" in line or "cudaErrorInsufficientDriver" in line, line


@cuda_built
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([], 4, "float32", 0), {}, "at least one device pointer"),
        (((4096,), 4, "complex64", 0), {}, "unsupported dtype 'complex64'"),
        (((4096,), 4, "bogus", 0), {}, "unsupported dtype 'bogus'"),
        (((4096,), 4, object(), 0), {}, "is not a dtype"),
        (((4096,), -1, "float32", 0), {}, "count must be >= 0"),
        (((4096,), 4, "float32", 2), {}, "op must be 0"),
        (((4096, 0), 4, "float32", 0), {}, "pointer 1 is null"),
        (((4096, -8), 4, "float32", 0), {}, "pointer 1 is negative"),
        (((4096, 1.5), 4, "float32", 0), {}, "pointer 1 is not an integer"),
        ((4096, 4, "float32", 0), {}, "must be a sequence"),
        (((4096,), 4, "float32", 0), {"device": -2}, "device must be >= 0"),
    ],
)
def test_all_reduce_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _core.cuda_all_reduce(*args, **kwargs)


@cuda_built
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([], 4, "float32", 0), {}, "at least one (pointer, device) pair"),
        (([(4096, 0), 4096], 4, "float32", 0), {}, "bufs 1 must be a (pointer, device) pair"),
        (([(4096, 0, 1)], 4, "float32", 0), {}, "bufs 0 must be a (pointer, device) pair"),
        (([(0, 0)], 4, "float32", 0), {}, "pointer 0 is null"),
        (([(4096, -1)], 4, "float32", 0), {}, "device of buffer 0 is negative"),
        (([(4096, 0)], 4, np.complex128, 0), {}, "unsupported dtype 'complex128'"),
        (([(4096, 0)], -3, "int32", 0), {}, "count must be >= 0"),
        (([(4096, 0)], 4, "int32", -1), {}, "op must be 0"),
        (([(4096, 0), (8192, 1)], 4, "float32", 0), {"streams": [0]}, "got 1 streams for 2 buffers"),
        (([(4096, 0)], 4, "float32", 0), {"streams": [None]}, "stream 0 is not an integer"),
    ],
)
def test_p2p_all_reduce_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _core.cuda_p2p_all_reduce(*args, **kwargs)


@cuda_built
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: _core.cuda_all_reduce_into([4096], [], 4, "float32", 0), "expected at least one device output"),
        (lambda: _core.cuda_all_reduce_into([4096], [8192, 12288], 4, "float32", 0), "got 1 inputs but 2 outputs"),
        (lambda: _core.cuda_all_reduce_into([4096, 0], [8192, 1], 4, "float32", 0), "input 1 is null"),
        (lambda: _core.cuda_all_reduce_into(4096, [8192], 4, "float32", 0), "inputs must be a sequence"),
        (lambda: _core.cuda_all_reduce_into([4096], [8192], 4, "uint8", 0), "unsupported dtype 'uint8'"),
        (lambda: _core.cuda_all_reduce_into([4096], [8192], 4, "float32", 0, device=-3), "device must be >= 0"),
        (lambda: _core.cuda_reduce_to_one([4096], 0, 4, "float32", 0), "out is null"),
        (lambda: _core.cuda_reduce_to_one([4096], -4, 4, "float32", 0), "out is negative"),
        (lambda: _core.cuda_reduce_to_one([], 4096, 4, "float32", 1), "expected at least one device pointer"),
        (lambda: _core.cuda_reduce_to_one([4096], 8192, -1, "float32", 1), "count must be >= 0"),
        (lambda: _core.cuda_reduce_to_one([4096], 8192, 4, "float32", 3), "op must be 0"),
        (lambda: _core.cuda_broadcast(0, [8192], 4, "int32"), "src is null"),
        (lambda: _core.cuda_broadcast(4096, [8192, 0], 4, "int32"), "destination 1 is null"),
        (lambda: _core.cuda_broadcast(4096, [], 4, "int32"), "expected at least one device destination"),
        (lambda: _core.cuda_broadcast(4096, [8192], 4, "complex64"), "unsupported dtype 'complex64'"),
    ],
)
def test_the_other_launchers_reject_bad_arguments(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@cuda_built
def test_numpy_dtypes_are_accepted():
    # A dtype object names the type as well as its name does: the error is then the CUDA one
    # (no device here) or, on a GPU, an invalid-pointer fault we do not provoke: use count 0.
    for dt in (np.float16, np.dtype("int64"), "f4"):
        try:
            _core.cuda_all_reduce([4096], 0, dt, 0)
        except RuntimeError as e:
            assert "CUDA error" in str(e)


_BF16_BY_NAME = """
import sys
from cudist import _core
assert "ml_dtypes" not in sys.modules  # NumPy does not know the name "bfloat16" without it
try:
    _core.cuda_all_reduce([4096], 0, "bfloat16", 0)
except RuntimeError as e:  # no device here: the CUDA error, after the dtype was understood
    assert "CUDA error" in str(e), e
print("ok")
"""


@cuda_built
def test_bfloat16_is_accepted_by_name_and_as_ml_dtypes_dtype():
    """The cupy backend passes ``dtype.name``: "bfloat16" must mean __nv_bfloat16 whether or not
    ml_dtypes is imported (the dispatch once fell through to int64 for it); an unknown name is still
    refused, naming the supported ones."""
    out = subprocess.run([sys.executable, "-c", _BF16_BY_NAME], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (np.dtype(ml_dtypes.bfloat16), ml_dtypes.bfloat16):
        try:
            _core.cuda_all_reduce([4096], 0, dt, 0)
        except RuntimeError as e:
            assert "CUDA error" in str(e)
    with pytest.raises(ValueError, match=r"unsupported dtype 'bfloat17' \(supported: .*bfloat16\)"):
        _core.cuda_all_reduce([4096], 0, "bfloat17", 0)


# ------------------------------------------------------------------------------------- on GPUs
def _random(rng, dtype, count):
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
    return (rng.standard_normal(count) * (20.0 if dtype == np.float16 else 100.0)).astype(dtype)


@pytest.fixture
def cupy_devices():
    """CuPy and the number of GPUs the extension's own CUDA runtime sees (skips without a real one)."""
    if not _core.cuda_built:
        pytest.skip("cudist._core was built without CUDA")
    cupy = pytest.importorskip("cupy")
    n = _core.cuda_device_count()
    if n < 1:
        if getattr(cupy, "__fake__", False):
            pytest.skip("CuPy is the CPU emulation (tests/emu/fakecupy): the extension has no GPU to run on")
        # CuPy sees a GPU that our static CUDA runtime does not (e.g. a driver older than the
        # runtime): a real problem, not a reason to skip.
        pytest.fail(f"CuPy sees {cupy.cuda.runtime.getDeviceCount()} GPU(s) but cudist._core's CUDA runtime "
                    f"{_core.cuda_runtime_version} sees none")
    return cupy, n


def _on_devices(cupy, host, devices):
    arrays = []
    for h, d in zip(host, devices):
        with cupy.cuda.Device(d):
            arrays.append(cupy.asarray(h))
    return arrays


def _assert_all_equal(cupy, arrays, expected):
    for r, a in enumerate(arrays):
        got = cupy.asnumpy(a)
        assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), f"replica {r} differs from NumPy"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("count", [1, 1031, 65537])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
@pytest.mark.parametrize("two_shot", [False, True])
def test_cuda_all_reduce_on_one_gpu(cupy_devices, dtype, n, count, op, two_shot):
    cupy, _ = cupy_devices
    rng = np.random.default_rng([n, count, DTYPES.index(dtype)])
    host = [_random(rng, dtype, count) for _ in range(n)]
    arrays = _on_devices(cupy, host, [0] * n)
    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        _core.cuda_all_reduce([a.data.ptr for a in arrays], count, dtype, OPS[op], stream=stream.ptr, device=0,
                              two_shot=two_shot)  # fmt: skip
        stream.synchronize()
    _assert_all_equal(cupy, arrays, reference_reduce(host, op))


@pytest.mark.gpu
def test_cuda_all_reduce_current_device_and_default_stream(cupy_devices):
    cupy, _ = cupy_devices
    host = [_random(np.random.default_rng(r), "float32", 4099) for r in range(3)]
    arrays = _on_devices(cupy, host, [0] * 3)
    with cupy.cuda.Device(0):
        _core.cuda_all_reduce([a.data.ptr for a in arrays], 4099, np.float32, _core.MEAN)
        cupy.cuda.Device(0).synchronize()
    _assert_all_equal(cupy, arrays, reference_reduce(host, ReduceOp.MEAN))


@pytest.mark.gpu
def test_cuda_errors_name_the_cuda_error(cupy_devices):
    _, n = cupy_devices
    with pytest.raises(RuntimeError, match=r"cuda_all_reduce: CUDA error cudaErrorInvalidDevice"):
        _core.cuda_all_reduce([4096, 8192], 16, "float32", 0, device=n)
    with pytest.raises(RuntimeError, match=r"cuda_p2p_all_reduce: CUDA error cudaErrorInvalidDevice"):
        _core.cuda_p2p_all_reduce([(4096, 0), (8192, n)], 16, "float32", 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_p2p_all_reduce_replicas_sharing_one_gpu(cupy_devices, dtype, op):
    cupy, _ = cupy_devices
    count = 100003
    host = [_random(np.random.default_rng(r), dtype, count) for r in range(4)]
    arrays = _on_devices(cupy, host, [0] * 4)
    _core.cuda_p2p_all_reduce([(a.data.ptr, 0) for a in arrays], count, dtype, OPS[op])
    cupy.cuda.Device(0).synchronize()
    _assert_all_equal(cupy, arrays, reference_reduce(host, op))


@pytest.mark.multi_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [3, 1031, 1 << 20])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_p2p_all_reduce_across_gpus(cupy_devices, dtype, count, op):
    cupy, n_gpus = cupy_devices
    if n_gpus < 2:
        pytest.skip("the extension's CUDA runtime sees fewer than 2 GPUs")
    devices = [d for d in range(n_gpus) for _ in range(2)][: min(2 * n_gpus, 8)]  # two replicas per GPU
    if not all(cupy.cuda.runtime.deviceCanAccessPeer(a, b) for a in set(devices) for b in set(devices) if a != b):
        pytest.skip("these GPUs cannot access each other's memory")
    host = [_random(np.random.default_rng([r, count]), dtype, count) for r in range(len(devices))]
    arrays = _on_devices(cupy, host, devices)
    streams = []
    for d in devices:
        with cupy.cuda.Device(d):
            streams.append(cupy.cuda.Stream(non_blocking=True))
    with cupy.cuda.Device(devices[-1]):
        _core.cuda_p2p_all_reduce([(a.data.ptr, d) for a, d in zip(arrays, devices)], count, dtype, OPS[op],
                                  streams=[s.ptr for s in streams])  # fmt: skip
        assert cupy.cuda.runtime.getDevice() == devices[-1]
    for s in streams:
        s.synchronize()
    _assert_all_equal(cupy, arrays, reference_reduce(host, op))
