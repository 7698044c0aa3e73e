"""One orchestrator (issue 15): the CuPy backend's two launch paths and the kernel list they share.

* The kernel list is declared once, in <cudist/kernels/kernel_list.cuh>: the CuPy backend's
  ``KERNELS`` (its NVRTC name expressions) is parsed from it, the C++ launchers of launch.hpp /
  p2p.hpp are listed under its kernels and instantiated for their dtypes. Checked against the
  headers' ``__global__`` templates, the emulation library's entry points, the declarations
  launch.hpp expands to, and (CUDA builds) the symbols of the compiled ``cudist::cuda`` library.
* The dispatch: under the fake CuPy (tests/emu/fakecupy, imported in isolation, 4 GPUs, peer access
  within {0, 1} and {2, 3}, other streams' queued work run first), the backend with
  ``CUDIST_CUDA_LAUNCHERS=core`` runs its collectives through ``_core``-style launchers -- the real
  C++ launchers compiled for the host (``cupy._launchers.EmulatedLaunchers``) -- on CuPy's current
  stream of each device, with results bit for bit those of the NumPy reference and of the NVRTC
  path; with the real extension, which sees no GPU here, ``auto`` falls back to NVRTC and ``core``
  is an error.
"""

from __future__ import annotations

import ast
import collections
import inspect
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import ml_dtypes  # noqa: F401 - a test dependency: np.dtype("bfloat16") is then the kernels' bfloat16
import numpy as np
import pytest

import cudist
from cudist import _core
from cudist._kernels._cuda_launch import (
    KERNEL_LIST,
    LAUNCHERS_ENV,
    UPDATE_RULES,
    kernel_list,
    launch_mode,
    launch_policy,
    parse_update_rules,
    runs_on,
)
from cudist._kernels._numpy import NumpyBackend

ROOT = Path(__file__).resolve().parents[1]
SOURCE_INCLUDE = ROOT / "csrc" / "include"
INCLUDE = Path(cudist.get_include())
FAKE = str(ROOT / "tests" / "emu" / "fakecupy")
DTYPES = ("float16", "float32", "float64", "int32", "int64", "bfloat16")
CTYPES = {"float16": "__half", "float32": "float", "float64": "double", "int32": "int", "int64": "long long",
          "bfloat16": "__nv_bfloat16"}
#: The 16-bit floats: summed in float32 and rounded once, so more than 8 buffers are summed on the host.
HALVES = ("float16", "bfloat16")
KERNELS = kernel_list(SOURCE_INCLUDE)
REF = NumpyBackend()

sys.path.insert(0, str(ROOT / "tests" / "emu"))
try:
    import build as emu_build  # tests/emu/build.py
finally:
    sys.path.pop(0)


# ------------------------------------------------------------------------------- the kernel list
_LAUNCHERS_MACRO = re.compile(r"#define\s+CUDIST_CUDA_LAUNCHERS_(\w+)\(L, T, name\)((?:[^\n]*\\\n)*[^\n]*)")
_LAUNCHER = re.compile(r"\bL\((launch|p2p),\s*(\w+),\s*T,\s*\(([^()]*)\)\)")


RULES = parse_update_rules((SOURCE_INCLUDE / UPDATE_RULES).read_text())


def _rule_launchers(name: str, slots: tuple[str, ...], hyper: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """The two launchers launch.hpp generates for a row of the rules' table (as _launchers lists them)."""
    ptrs = ", ".join(["T* const*"] * (1 + len(slots)))
    doubles = ", ".join(["double"] * (len(hyper) + 1))  # the hyper-parameters, then decay
    return [("launch", name, f"{ptrs}, int, const T*, {doubles}, long long, cudaStream_t"),
            ("launch", f"all_reduce_{name}", f"{ptrs}, int, const T* const*, int, {doubles}, long long, cudaStream_t")]


def _launchers() -> dict[str, list[tuple[str, str, str]]]:
    """launch.hpp's list: kernel -> [(header, launcher, parameters)], the rules' kernels' generated."""
    text = (SOURCE_INCLUDE / "cudist" / "cuda" / "launch.hpp").read_text()
    out = {}
    for m in _LAUNCHERS_MACRO.finditer(text):
        body = re.sub(r"\\\n", " ", m.group(2))
        out[m.group(1)] = [(h, name, " ".join(p.split())) for h, name, p in _LAUNCHER.findall(body)]
    assert "CUDIST_UPDATE_RULE_LIST(CUDIST_CUDA_RULE_LAUNCHERS_, L)" in text
    for name, (_, slots, hyper) in RULES.items():
        assert f"mirrored_all_reduce_{name}" not in out, f"{name}'s launchers are generated from the table"
        out[f"mirrored_all_reduce_{name}"] = _rule_launchers(name, slots, hyper)
    return out


def _preprocessed(tmp_path: Path, *headers: str) -> str:
    """The headers as the C++ preprocessor expands them (the emulation's CUDA headers standing in)."""
    cxx = emu_build.compiler()
    if cxx is None:
        pytest.skip("needs a C++ compiler (c++ or g++)")
    src = tmp_path / "pp.cpp"
    src.write_text("".join(f"#include <{h}>\n" for h in headers))
    out = subprocess.run([cxx, "-std=c++17", "-E", "-P", f"-I{emu_build.EMU_INCLUDE}", f"-I{SOURCE_INCLUDE}", str(src)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _expected_launchers() -> collections.Counter:
    """(launcher, C++ type) -> overloads, for every launcher and every dtype of its kernel."""
    want = collections.Counter()
    for kernel, entries in _launchers().items():
        for _, name, _ in entries:
            for dt in KERNELS[kernel]:
                want[name, CTYPES[dt]] += 1
    return want


def _emu_name(launcher: str, params: str) -> str:
    """The emulation library's name of a launcher overload (the out-of-place all_reduce is ``all_reduce_into``)."""
    return "all_reduce_into" if launcher == "all_reduce" and params.startswith("const T* const*") else launcher


def test_kernel_list_is_what_the_backend_and_the_installed_headers_use():
    assert KERNEL_LIST == "cudist/kernels/kernel_list.cuh"
    assert kernel_list(INCLUDE) == KERNELS, "the installed headers (cudist.get_include()) are stale: reinstall cudist"
    assert "all_reduce_one_shot" in KERNELS and KERNELS["mirrored_all_reduce_sgd"] == ("float16", "float32", "float64", "bfloat16")
    # _cupy.py keeps no list of its own: KERNELS and CTYPES come from the header.
    tree = ast.parse((ROOT / "src" / "cudist" / "_kernels" / "_cupy.py").read_text())
    literals = [t.id for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
                for t in n.targets if isinstance(t, ast.Name)]
    assert "KERNELS" not in literals and "CTYPES" not in literals


def test_kernel_list_is_every_global_template_of_the_headers():
    text = "\n".join(p.read_text() for p in sorted((SOURCE_INCLUDE / "cudist" / "kernels").glob("*.cuh")))
    declared = set(re.findall(r"__global__\s+void\s+(\w+)\s*\(", text))
    # The rules' kernels: one generator (both forms) expanded over the table (the emulation and
    # NVRTC tests compile and run every name of KERNELS, so a missing expansion fails there too).
    assert re.search(r"__global__\s+void\s+mirrored_all_reduce_##name##suffix\(", text)
    assert "CUDIST_UPDATE_RULE_LIST(CUDIST_RULE_KERNELS_, ~)" in text
    declared |= {f"mirrored_all_reduce_{name}{form}" for name in RULES for form in ("", "_packed")}
    assert declared == set(KERNELS) | {k + "_packed" for k in KERNELS}
    assert {f"mirrored_all_reduce_{name}" for name in RULES} <= set(KERNELS)


def test_every_kernel_has_its_launchers_listed_once(tmp_path):
    launchers = _launchers()
    assert set(launchers) == set(KERNELS), "CUDIST_CUDA_LAUNCHERS_<kernel> macros differ from the kernel list"
    listed = [(name, params) for entries in launchers.values() for _, name, params in entries]
    assert len(listed) == len(set(listed)), "a launcher overload is listed under two kernels"
    names = {name for name, _ in listed}
    # Every launcher template that launch.hpp / p2p.hpp declare is listed (so it gets instantiated).
    decl = re.compile(r"template <class T>\s*cudaError_t\s+(\w+)\(")
    declared = set(decl.findall(_preprocessed(tmp_path, "cudist/cuda/launch.hpp", "cudist/cuda/p2p.hpp")))
    assert names == declared
    assert ("p2p", "p2p_all_reduce") in {(h, n) for e in launchers.values() for h, n, _ in e}


def test_emulation_library_matches_the_kernel_list():
    """Its kernel entry points are exactly KERNELS x dtypes; its launcher entry points exactly the
    launch.hpp list x the dtypes of each launcher's kernel."""
    if emu_build.compiler() is None:
        pytest.skip("needs a C++ compiler (c++ or g++)")
    lib = emu_build.load()
    for kernel, dtypes in KERNELS.items():
        for dt in DTYPES:
            assert hasattr(lib, f"cudist_emu_{kernel}_{dt}") == (dt in dtypes), (kernel, dt)
    for kernel, entries in _launchers().items():
        for _, name, params in entries:
            for dt in DTYPES:
                assert hasattr(lib, f"cudist_emu_launch_{_emu_name(name, params)}_{dt}") == (dt in KERNELS[kernel]), (
                    name, dt)


def test_launch_headers_declare_exactly_the_listed_instantiations(tmp_path):
    """What launch.hpp and p2p.hpp expand to (the extern templates C++ users compile against), with
    the parameters listed (those of the rules' launchers derived from the table)."""
    text = _preprocessed(tmp_path, "cudist/cuda/launch.hpp", "cudist/cuda/p2p.hpp")
    got = collections.Counter(re.findall(r"extern template cudaError_t (\w+)<([\w ]+)>", text))
    assert got == _expected_launchers()
    expanded = {(name, t, re.sub(r"\s+", "", params))
                for name, t, params in re.findall(r"extern template cudaError_t (\w+)<([\w ]+)>\s*\(([^;]*)\);", text)}
    for kernel, entries in _launchers().items():
        for header, name, params in entries:
            if header != "launch":
                continue
            for dt in KERNELS[kernel]:
                t = CTYPES[dt]
                want = re.sub(r"\s+", "", re.sub(r"\bT\b", t, params))
                assert (name, t, want) in expanded, (name, t, want)


_STUB = re.compile(r"__device_stub__ZN6cudist7kernels(\d+)(\w+)")
_MANGLED = {"f": "float32", "d": "float64", "i": "int32", "x": "int64", "6__half": "float16",
            "13__nv_bfloat16": "bfloat16"}


def _stub_kernel(length: str, rest: str) -> tuple[str, str]:
    name, rest = rest[: int(length)], rest[int(length):]
    # kernel<T>, or a fused kernel<T, G> (G defaulted to T: the launchers instantiate no mixed form).
    # (A repeated class type is mangled as a substitution, S<n>_.)
    m = re.match(r"I(6__half|13__nv_bfloat16|[fdix])(6__half|13__nv_bfloat16|[fdix]|S\d*_)?E", rest)
    assert m, rest
    same = m.group(2) is None or m.group(2) == m.group(1) or m.group(2).startswith("S")
    assert same, f"{name}: a mixed-precision instantiation in the C++ launchers: {rest}"
    return name, _MANGLED[m.group(1)]


@pytest.mark.skipif(not _core.cuda_built, reason="cudist._core was built without CUDA (no cudist::cuda library)")
def test_compiled_library_instantiates_exactly_the_kernel_list():
    lib = INCLUDE.parent / "lib" / "libcudist_cuda.a"
    if not lib.is_file():
        pytest.skip(f"no installed cudist::cuda library at {lib} (an in-place build)")
    if shutil.which("nm") is None:
        pytest.skip("needs nm (binutils)")
    text = subprocess.run(["nm", "-C", str(lib)], capture_output=True, text=True, timeout=120, check=True).stdout
    got = collections.Counter(re.findall(r" [TW] cudaError cudist::cuda::(\w+)<([\w ]+)>\(", text))
    assert got == _expected_launchers()
    raw = subprocess.run(["nm", str(lib)], capture_output=True, text=True, timeout=120, check=True).stdout
    stubs = {_stub_kernel(*m) for m in _STUB.findall(raw)}
    assert stubs, "no kernel stubs (__device_stub__...) found: has nvcc changed its naming?"
    assert stubs == {(k + "_packed", dt) for k, dts in KERNELS.items() for dt in dts}


# ------------------------------------------------------------------------------- the switch
def test_launch_mode_is_validated(monkeypatch):
    for raw, want in (("", "auto"), ("auto", "auto"), (" Core ", "core"), ("NVRTC", "nvrtc")):
        monkeypatch.setenv(LAUNCHERS_ENV, raw)
        assert launch_mode() == want
    monkeypatch.delenv(LAUNCHERS_ENV)
    assert launch_mode() == "auto"
    monkeypatch.setenv(LAUNCHERS_ENV, "cuda")
    with pytest.raises(ValueError, match=r"CUDIST_CUDA_LAUNCHERS='cuda' is not one of auto, core, nvrtc"):
        launch_mode()
    assert launch_policy().startswith("unusable: CUDIST_CUDA_LAUNCHERS='cuda'")


@pytest.mark.parametrize("mode", ["auto", "core", "nvrtc"])
def test_info_says_which_launch_path(mode):
    env = dict(os.environ, **{LAUNCHERS_ENV: mode})
    out = subprocess.run([sys.executable, "-m", "cudist", "--info"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("cupy launch path:"))
    if mode == "nvrtc":
        assert "NVRTC for every kernel (CUDIST_CUDA_LAUNCHERS=nvrtc)" in line
    elif not _core.cuda_built:
        assert ("unusable" if mode == "core" else "NVRTC for every kernel") in line
        assert "built without CUDA" in line
    else:
        assert "cudist._core's CUDA launchers for the collectives" in line and f"={mode})" in line


# ------------------------------------------------------------------------------- under the fake CuPy
_ENV = {"CUDIST_EMU_DEVICES": "4", "CUDIST_EMU_PEER": "0,1;2,3", "CUDIST_EMU_MODE": "streams", "CUDIST_EMU_SEED": "15"}


def _fake_modules():
    return [k for k in sys.modules if k in ("cupy", "cupyx") or k.startswith(("cupy.", "cupyx."))]


@pytest.fixture(scope="module")
def fake():
    """(the fake cupy, cudist._kernels._cupy imported over it), removed again afterwards."""
    if emu_build.compiler() is None:
        pytest.skip("needs a C++ compiler (c++ or g++) for the CUDA emulation")
    saved = {k: sys.modules.pop(k) for k in _fake_modules() + ["cudist._kernels._cupy"] if k in sys.modules}
    env = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    sys.path.insert(0, FAKE)
    try:
        import cupy

        assert cupy.__fake__
        from cudist._kernels import _cupy

        yield cupy, _cupy
    finally:
        sys.path.remove(FAKE)
        for k in _fake_modules() + ["cudist._kernels._cupy"]:
            sys.modules.pop(k, None)
        sys.modules.update(saved)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def make(fake, monkeypatch):
    """make(mode, core) -> a new CupyBackend with CUDIST_CUDA_LAUNCHERS=mode and ``core`` as its
    extension (default: the emulated launchers)."""
    cp, mod = fake
    from cupy._launchers import EmulatedLaunchers

    def _make(mode="core", core=None):
        monkeypatch.setenv(LAUNCHERS_ENV, mode)
        monkeypatch.setattr(mod, "_core", EmulatedLaunchers() if core is None else core)
        return mod.CupyBackend()

    yield _make
    cp.cuda.runtime.deviceSynchronize()
    for d in range(4):
        with cp.cuda.Device(d):
            cp.cuda.Stream.null.use()


def _rand(rng, count, dtype):
    dt = np.dtype(dtype)
    if dt.kind == "i":
        info = np.iinfo(dt)
        return rng.integers(info.min // 2, info.max // 2, size=count, dtype=dt)
    return (rng.standard_normal(count) * 4.0).astype(dt)


def _same(got, want, what=""):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert got.tobytes() == want.tobytes(), what


def _on(cp, hosts, devices):
    out = []
    for h, d in zip(hosts, devices):
        with cp.cuda.Device(d):
            out.append(cp.asarray(h))
    return out


def _use_side_streams(cp, devices):
    """A fresh non-blocking current stream on each device; returns {device: its handle}."""
    handles = {}
    for d in sorted(set(devices)):
        with cp.cuda.Device(d):
            handles[d] = cp.cuda.Stream(non_blocking=True).use().ptr
    return handles


def _run_all(cp, be, dtype, n, count, op, devices, seed):
    """Every covered collective on fresh random data; returns the host results in a fixed order."""
    rng = np.random.default_rng(seed)
    host = [_rand(rng, count, dtype) for _ in range(n)]
    results = []
    bufs = _on(cp, host, devices)
    be.all_reduce(bufs, op)
    results += [cp.asnumpy(b) for b in bufs]
    ins = _on(cp, host, devices)
    outs = _on(cp, [np.zeros(count, dtype)] * n, devices)
    be.all_reduce(ins, op, outputs=outs)
    results += [cp.asnumpy(o) for o in outs] + [cp.asnumpy(i) for i in ins]
    ins = _on(cp, host, devices)
    results.append(cp.asnumpy(be.reduce_to_one(ins, op)))
    k = n - 1  # `out` aliasing the last input (read in a later pass when n > 8)
    be.reduce_to_one(ins, op, out=ins[k])
    results.append(cp.asnumpy(ins[k]))
    dsts = _on(cp, [np.zeros(count, dtype)] * n, devices)
    be.broadcast(ins[0], dsts)
    results += [cp.asnumpy(d) for d in dsts]
    # The NumPy reference, in the same order.
    want_all = REF.reduce_to_one([h.copy() for h in host], op)
    want = [want_all] * n + [want_all] * n + list(host) + [want_all, want_all] + [host[0]] * n
    return results, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 11])
def test_core_path_equals_numpy_and_nvrtc_on_one_gpu(fake, make, dtype, n):
    cp, _ = fake
    core_be, nvrtc_be = make("core"), make("nvrtc")
    launchers = core_be._launchers.core
    for count in (1, 7, 1031):
        for op in ("sum", "mean"):
            seed = zlib.crc32(f"{dtype}/{n}/{count}/{op}".encode())
            handles = _use_side_streams(cp, [0])
            calls = len(launchers.calls)
            got, want = _run_all(cp, core_be, dtype, n, count, op, [0] * n, seed)
            new = launchers.calls[calls:]
            # In place (nothing to do for one replica), out of place, reduce_to_one twice (into a
            # temporary then a copy when `out` is an input of a later pass), broadcast.
            expected = ["cuda_all_reduce"] * (n > 1) + [
                "cuda_all_reduce_into", "cuda_reduce_to_one", "cuda_reduce_to_one"] + ["cuda_broadcast"] * (n > 8) + [
                "cuda_broadcast"]
            if dtype in HALVES and n > 8:
                # float16 / bfloat16 sums over more than 8 buffers are done on the host (one
                # rounding; the launchers would round between their passes and refuse them).
                expected = ["cuda_broadcast"]
            assert [c.name for c in new] == expected
            assert all(c.device == 0 and c.streams == (handles[0],) and c.dtype == dtype for c in new)
            assert not core_be._functions, "the core path compiled NVRTC kernels for the collectives"
            ref, _ = _run_all(cp, nvrtc_be, dtype, n, count, op, [0] * n, seed)
            assert nvrtc_be._functions and nvrtc_be._launchers is None
            for i, (g, r, w) in enumerate(zip(got, ref, want)):
                _same(g, w, f"result {i} vs NumPy ({dtype}, n={n}, count={count}, {op})")
                _same(g, r, f"result {i} vs NVRTC ({dtype}, n={n}, count={count}, {op})")


@pytest.mark.parametrize("dtype", ["float16", "float32", "int64", "bfloat16"])
@pytest.mark.parametrize(
    "devices",
    [
        [0, 1],  # peers: one-shot over peer access (small) or two-shot P2P (large)
        [0, 1, 0, 1, 1],  # repeated devices: one-shot
        [2, 3, 0, 1],  # 0/1 and 2/3 cannot peer: the far buffers are staged, then one launch
        [1, 0, 3, 2, 0, 1, 2, 3, 1, 0, 3],  # 11 replicas on 4 GPUs: several passes, staging
    ],
)
def test_core_path_across_gpus_uses_each_devices_current_stream(fake, make, dtype, devices):
    cp, _ = fake
    core_be, nvrtc_be = make("core"), make("nvrtc")
    launchers = core_be._launchers.core
    n = len(devices)
    for count in (1031, (1 << 20) // np.dtype(dtype).itemsize + 3):  # the second is two-shot sized
        seed = zlib.crc32(f"{dtype}/{devices}/{count}".encode())
        handles = _use_side_streams(cp, devices)
        calls = len(launchers.calls)
        got, want = _run_all(cp, core_be, dtype, n, count, "mean", devices, seed)
        new = launchers.calls[calls:]
        if dtype in HALVES and n > 8:
            # float16 / bfloat16 sums over more than 8 buffers are done on the host (one rounding): only the
            # broadcast launches; the results must still be the reference's.
            assert [c.name for c in new] == ["cuda_broadcast"]
            for i, (g, w) in enumerate(zip(got, want)):
                _same(g, w, f"result {i} vs NumPy ({dtype}, devices={devices}, count={count})")
            continue
        two_shot = count > 1031 and devices == [0, 1]  # distinct GPUs, all peers, >= 1 MiB
        assert new[0].name == ("cuda_p2p_all_reduce" if two_shot else "cuda_all_reduce")
        for c in new:
            if c.name == "cuda_p2p_all_reduce":
                assert c.streams == tuple(handles[d] for d in devices)  # each buffer's GPU: its current stream
            else:
                assert c.streams == (handles[c.device],)
        # Out of place and broadcast run on the first output's / the source's GPU, reduce_to_one on
        # `out`'s (a new one is on the current device, 0, as CuPy's empty_like puts it).
        assert [c.device for c in new[1:]] == [devices[0], 0, devices[-1]] + [devices[-1]] * (n > 8) + [devices[0]]
        ref, _ = _run_all(cp, nvrtc_be, dtype, n, count, "mean", devices, seed)
        for i, (g, r, w) in enumerate(zip(got, ref, want)):
            _same(g, w, f"result {i} vs NumPy ({dtype}, devices={devices}, count={count})")
            _same(g, r, f"result {i} vs NVRTC ({dtype}, devices={devices}, count={count})")


def test_only_the_collectives_take_the_core_path(fake, make):
    cp, _ = fake
    be = make("core")
    launchers = be._launchers.core
    ws = [cp.ones(33, cp.float32) for _ in range(3)]
    be.sgd(ws, cp.ones(33, cp.float32), lr=0.5)
    be.all_gather([cp.ones(4, cp.float32)] * 2, axis=0)
    assert launchers.calls == []
    assert {k[2] for k in be._functions} == {"mirrored_all_reduce_sgd"}
    np.testing.assert_array_equal(cp.asnumpy(ws[2]), np.full(33, 0.5, np.float32))


def test_auto_takes_the_core_path_where_the_extension_sees_the_gpus(fake, make):
    cp, _ = fake
    from cupy._launchers import EmulatedLaunchers

    class TwoGpus(EmulatedLaunchers):
        def cuda_device_count(self):
            return 2  # the extension's runtime sees GPUs 0 and 1 only

    core = TwoGpus()
    be = make("auto", core)
    assert be._launchers is not None and "2 GPU(s) seen" in be.launch_path and "=auto" in be.launch_path
    near = _on(cp, [np.arange(8, dtype=np.float32)] * 2, [0, 1])
    be.all_reduce(near, "sum")
    far = _on(cp, [np.arange(8, dtype=np.float32)] * 2, [2, 3])
    be.all_reduce(far, "sum")  # GPUs the extension does not see: NVRTC
    assert [c.name for c in core.calls] == ["cuda_all_reduce"] and core.calls[0].device == 0
    assert {k[2] for k in be._functions} == {"all_reduce_one_shot"}
    for a in near + far:
        np.testing.assert_array_equal(cp.asnumpy(a), 2 * np.arange(8, dtype=np.float32))
    forced = make("core", TwoGpus())
    with pytest.raises(RuntimeError, match=r"CUDIST_CUDA_LAUNCHERS=core, but cudist._core's CUDA launchers cannot "
                                           r"serve GPUs \[2, 3\]: its CUDA runtime sees 2 GPU\(s\)"):
        forced.all_reduce(_on(cp, [np.ones(4, np.float32)] * 2, [2, 3]), "sum")


def test_auto_takes_nvrtc_for_gpus_the_extension_was_not_built_for(fake, make):
    """The emulated GPUs are compute capability 9.0: an extension built for sm_100 only cannot run
    its kernels there (no kernel image), NVRTC compiles for them."""
    cp, _ = fake
    from cupy._launchers import EmulatedLaunchers

    core = EmulatedLaunchers()
    core.cuda_architectures = "100"
    be = make("auto", core)
    bufs = _on(cp, [np.full(8, 2, np.int64)] * 3, [0, 0, 0])
    be.all_reduce(bufs, "sum")
    assert core.calls == [] and {k[2] for k in be._functions} == {"all_reduce_one_shot"}
    np.testing.assert_array_equal(cp.asnumpy(bufs[2]), np.full(8, 6, np.int64))
    core.cuda_architectures = "80-real,90-virtual"  # PTX for 9.0: runs
    assert make("auto", core)._launchers.serve(bufs)


@pytest.mark.parametrize(
    ("archs", "cc", "ok"),
    [("80,90", 80, True), ("80,90", 86, True), ("80,90", 89, True), ("80,90", 90, True), ("80,90", 120, True),
     ("80,90", 75, False), ("80-real,90-real", 100, False), ("80-real", 86, True), ("80-real", 90, False),
     ("80-virtual", 90, True), ("90a", 90, True), ("90a", 100, False), ("", 90, False), ("native", 90, True), ("all-major", 75, True),
     ("bogus", 90, False)],
)
def test_runs_on(archs, cc, ok):
    assert runs_on(archs, cc) is ok


def test_nvrtc_is_forced_by_the_switch(fake, make):
    cp, _ = fake
    from cupy._launchers import EmulatedLaunchers

    core = EmulatedLaunchers()
    be = make("nvrtc", core)
    assert be._launchers is None and be.launch_path == "NVRTC for every kernel (CUDIST_CUDA_LAUNCHERS=nvrtc)"
    be.all_reduce([cp.ones(5, cp.int32), cp.ones(5, cp.int32)], "sum")
    assert core.calls == [] and be._functions


def test_real_extension_without_a_gpu_falls_back_to_nvrtc(fake, make, monkeypatch):
    """The extension here is the real one: built with CUDA (or not) and seeing no GPU, so ``auto``
    launches through NVRTC, and ``core`` is a clear error, at load time."""
    cp, mod = fake
    assert _core.cuda_device_count() == 0
    be = make("auto", _core)
    assert be._launchers is None
    if _core.cuda_built:
        assert re.fullmatch(r"NVRTC for every kernel \(the CUDA runtime \d+\.\d+ of cudist\._core sees no GPU\)",
                            be.launch_path), be.launch_path
    else:
        assert be.launch_path == "NVRTC for every kernel (cudist._core was built without CUDA)"
    rng = np.random.default_rng(5)
    host = [_rand(rng, 1031, "float32") for _ in range(3)]
    bufs = _on(cp, host, [0, 0, 0])
    be.all_reduce(bufs, "mean")
    assert {k[2] for k in be._functions} == {"all_reduce_one_shot"}
    for b in bufs:
        _same(cp.asnumpy(b), REF.reduce_to_one([h.copy() for h in host], "mean"))
    with pytest.raises(RuntimeError, match=r"CUDIST_CUDA_LAUNCHERS=core, but .*(sees no GPU|built without CUDA); unset it"):
        make("core", _core)
    with pytest.raises(ValueError, match="CUDIST_CUDA_LAUNCHERS='sometimes' is not one of"):
        make("sometimes", _core)
    # Through the registry the same error names the backend.
    from cudist._kernels import BackendUnavailableError, _instances, _load

    assert "cupy" not in _instances
    monkeypatch.setenv(LAUNCHERS_ENV, "core")
    monkeypatch.setattr(mod, "_core", _core)
    with pytest.raises(BackendUnavailableError, match=r"kernel backend 'cupy' failed to load: RuntimeError: "
                                                      r"CUDIST_CUDA_LAUNCHERS=core, but"):
        _load("cupy")
    assert "cupy" not in _instances


def test_emulated_launchers_refuse_what_a_gpu_or_the_bindings_refuse(fake):
    cp, _ = fake
    from cupy._launchers import EmulatedLaunchers

    em = EmulatedLaunchers()
    with cp.cuda.Device(2):
        a = cp.ones(8, cp.float32)
        s2 = cp.cuda.Stream(non_blocking=True)
    b = cp.ones(8, cp.float32)  # device 0, which cannot reach device 2
    with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress.*device 0 touched memory of device 2"):
        em.cuda_all_reduce([b.data.ptr, a.data.ptr], 8, "float32", 0, device=0)
    with pytest.raises(RuntimeError, match="cudaErrorInvalidResourceHandle.*belongs to device 2"):
        em.cuda_all_reduce([b.data.ptr], 8, "float32", 0, stream=s2.ptr, device=0)
    with pytest.raises(RuntimeError, match="cudaErrorInvalidDevice"):
        em.cuda_p2p_all_reduce([(b.data.ptr, 0), (a.data.ptr, 2)], 8, "float32", 0)
    with pytest.raises(ValueError, match="pointer 1 is null"):
        em.cuda_all_reduce([b.data.ptr, 0], 8, "float32", 0)
    with pytest.raises(ValueError, match="unsupported dtype 'uint8'"):
        em.cuda_broadcast(b.data.ptr, [b.data.ptr], 8, "uint8")
    with pytest.raises(ValueError, match="got 1 inputs but 2 outputs"):
        em.cuda_all_reduce_into([b.data.ptr], [b.data.ptr, b.data.ptr], 8, "float32", 1)
    with pytest.raises(RuntimeError, match="cudaErrorIllegalAddress.*past the end"):
        em.cuda_broadcast(b.data.ptr, [b.data.ptr], 9, np.float32)
    assert em.calls == []
    cp.cuda.runtime.deviceSynchronize()


@pytest.mark.skipif(not _core.cuda_built, reason="cudist._core was built without CUDA")
def test_emulated_launchers_have_the_bindings_signatures(fake):
    from cupy._launchers import EmulatedLaunchers

    names = [n for n in dir(_core) if n.startswith("cuda_") and callable(getattr(_core, n))]
    assert set(names) == {n for n in dir(EmulatedLaunchers) if n.startswith("cuda_") and callable(getattr(EmulatedLaunchers, n))}
    assert {n for n in dir(_core) if n.startswith("cuda_") and n not in names} == {
        "cuda_built", "cuda_architectures", "cuda_runtime_version"}
    em = EmulatedLaunchers()
    assert em.cuda_built is True and isinstance(em.cuda_runtime_version, int) and isinstance(em.cuda_architectures, str)
    for name in names:
        first = getattr(_core, name).__doc__.splitlines()[0]
        params = re.findall(r"(\w+): [^,=]+?(?: = ([^,]+))?(?:, |\) ->)", first[len(name) + 1:])
        emu = list(inspect.signature(getattr(EmulatedLaunchers, name)).parameters.values())[1:]
        assert [p.name for p in emu] == [p for p, _ in params], name
        for p, (_, default) in zip(emu, params):
            want = inspect.Parameter.empty if not default else ast.literal_eval(default)
            assert p.default == want, (name, p.name)


# ------------------------------------------------------------------------------- on a GPU (or the fake)
@pytest.mark.gpu
def test_the_loaded_backend_launches_the_collectives_where_it_says():
    """On a GPU with a CUDA build of the extension (and under the fake CuPy's ``core`` mode, see
    tests/test_gpu_emulated.py) the collectives go through the C++ launchers; else through NVRTC."""
    cupy = pytest.importorskip("cupy")
    from cudist._kernels import get_backend

    be = get_backend("cupy")
    if getattr(cupy, "__fake__", False):
        emulated = "core" in {m.strip() for m in os.environ.get("CUDIST_EMU_MODE", "").split(",")}
        assert (be._launchers is not None) == emulated, be.launch_path
    else:
        usable = _core.cuda_built and _core.cuda_device_count() > 0 and launch_mode() != "nvrtc"
        assert (be._launchers is not None) == usable, be.launch_path
    fresh = type(be)()
    bufs = [cupy.full(1000, i + 1, cupy.float32) for i in range(3)]
    fresh.all_reduce(bufs, "sum")
    assert ("all_reduce_one_shot" in {k[2] for k in fresh._functions}) == (fresh._launchers is None)
    for b in bufs:
        np.testing.assert_array_equal(cupy.asnumpy(b), np.full(1000, 6, np.float32))
