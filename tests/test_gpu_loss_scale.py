"""LossScaleOptimizer's reduction on GPUs (issue #28, item 3): the CuPy backend's
``reduce_unscale_finite`` kernel sums the per-replica gradients in replica order (bfloat16 /
float16 gradients of a float32 ``out`` widened inside the kernel), divides the sum by the loss scale
and sets a device flag where a stored value is inf or NaN -- the finiteness check in the pass that
reads the gradients, the flag left on the GPU so that one read serves a whole step.

Checked against the NumPy reference (the definition the CPU backends equal bit for bit) on random
data of mixed magnitudes: odd sizes, 1 to 11 gradients (more than one launch's worth), an inf, a
NaN, a sum that overflows, float32 subnormal results; gradients on other GPUs (peer access, or
staged copies without it). Marker ``gpu``: on a GPU, and on the CPU under the fake CuPy
(tests/test_gpu_emulated.py) in every emulation mode.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from cudist._kernels import get_backend

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs the optional ml_dtypes package")

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
#: (out dtype, gradient dtype): same-dtype reductions and the mixed-precision ones.
PAIRS = [
    (np.dtype(np.float32), np.dtype(np.float32)),
    (np.dtype(np.float64), np.dtype(np.float64)),
    (np.dtype(np.float16), np.dtype(np.float16)),
    (BF16, BF16),
    (np.dtype(np.float32), BF16),
    (np.dtype(np.float32), np.dtype(np.float16)),
]
IDS = ["f32", "f64", "f16", "bf16", "bf16->f32", "f16->f32"]
NS = [1, 2, 3, 8, 11]  # 11: the head pre-summed before the launch
SIZES = [1, 37, 1031, 4099]  # odd: scalar tails after the 16-byte vectors
SCALE = 2.0**10
REF = get_backend("numpy").trusted


def _grads(gdt, m, size, key):
    rng = np.random.default_rng(zlib.crc32(f"{gdt}/{m}/{size}/{key}".encode()))
    # Mixed magnitudes: a sum rounded between replicas, or in the narrow type, gives other bits.
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-2, 3, size)).astype(gdt) for _ in range(m)]


def _want(grads, scale, odt):
    out = np.full(grads[0].shape, 7, odt)
    finite = REF.reduce_unscale_finite(grads, scale, out)
    return out, finite


def _run(cp, be, grads, scale, odt, device=0, flag=None):
    """The kernel on GPU ``device``: (out on the host, the flag's value)."""
    with cp.cuda.Device(device):
        out = cp.full(grads[0].shape, 7, odt)  # not zeros: every element must be written
        flag = cp.zeros(1, np.int32) if flag is None else flag
    be.trusted.reduce_unscale_flag(grads, scale, out, flag)
    return cp.asnumpy(out), int(cp.asnumpy(flag)[0])


def _bits(a):
    return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("odt,gdt", PAIRS, ids=IDS)
@pytest.mark.parametrize("m", NS)
@pytest.mark.parametrize("size", SIZES)
def test_finite_gradients_give_the_references_bits_and_no_flag(cp, be, odt, gdt, m, size):
    grads = _grads(gdt, m, size, "finite")
    want, finite = _want(grads, SCALE, odt)
    assert finite
    got, flag = _run(cp, be, [cp.asarray(g) for g in grads], SCALE, odt)
    assert flag == 0
    assert got.dtype == odt and got.tobytes() == want.tobytes()
    # The test can fail: summing in the narrow type (or rounding between replicas) differs.
    if m > 1 and gdt != odt:
        narrow = grads[0]
        for g in grads[1:]:
            narrow = (narrow + g).astype(gdt)
        assert (narrow.astype(np.float32) / np.float32(SCALE)).astype(odt).tobytes() != want.tobytes()


@pytest.mark.parametrize("odt,gdt", PAIRS, ids=IDS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 18, 1030])
@pytest.mark.parametrize("m", [1, 3, 11])
def test_one_non_finite_element_sets_the_flag(cp, be, odt, gdt, bad, where, m):
    """One inf, -inf or NaN in the last replica's gradient, at the first, a middle or the last
    element (a vector's lane or the scalar tail): the flag is set; every other element is the
    reference's."""
    grads = _grads(gdt, m, 1031, "bad")
    grads[-1][where] = bad
    want, finite = _want(grads, SCALE, odt)
    assert not finite
    got, flag = _run(cp, be, [cp.asarray(g) for g in grads], SCALE, odt)
    assert flag == 1
    keep = np.arange(1031) != where
    assert got[keep].tobytes() == want[keep].tobytes()
    assert not np.isfinite(got[where].astype(np.float64))


@pytest.mark.parametrize(
    "odt,gdt,big",
    [(PAIRS[0][0], PAIRS[0][1], 3.0e38), (PAIRS[2][0], PAIRS[2][1], 6.0e4), (BF16, BF16, 3.0e38),
     (PAIRS[4][0], PAIRS[4][1], 3.0e38)],
    ids=["f32", "f16", "bf16", "bf16->f32"],  # (float16 gradients cannot overflow a float32 sum)
)
def test_a_sum_that_overflows_sets_the_flag(cp, be, odt, gdt, big):
    """Finite gradients whose sum is past the out dtype's range: flagged, as by the reference."""
    grads = _grads(gdt, 2, 37, "overflow")
    for g in grads:
        g[5] = np.asarray(big, np.float32).astype(gdt)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads)
    _, finite = _want(grads, 1.0, odt)
    assert not finite
    _, flag = _run(cp, be, [cp.asarray(g) for g in grads], 1.0, odt)
    assert flag == 1


@pytest.mark.parametrize("gdt", [np.dtype(np.float32), BF16], ids=["f32", "bf16->f32"])
def test_subnormal_results_are_kept(cp, be, gdt):
    """Unscaled values below float32's smallest normal: the reference's subnormals (the kernels'
    float32 arithmetic does not flush, whatever -ftz CuPy compiles with), and no flag."""
    grads = [np.full(37, 1.5e-35, np.float32).astype(gdt), np.full(37, 2.5e-35, np.float32).astype(gdt)]
    want, finite = _want(grads, 2.0**20, np.dtype(np.float32))
    assert finite and 0 < abs(float(want[0])) < np.finfo(np.float32).tiny
    got, flag = _run(cp, be, [cp.asarray(g) for g in grads], 2.0**20, np.dtype(np.float32))
    assert flag == 0 and got.tobytes() == want.tobytes()


def test_one_flag_serves_many_variables_and_is_never_cleared(cp, be):
    """The flag is set by the launch that sees a non-finite value and kept by the finite ones
    after it: a step's variables share one flag, read once."""
    flag = cp.zeros(1, np.int32)
    bad = _grads(np.float32, 2, 37, "first")
    bad[0][3] = np.nan
    assert _run(cp, be, [cp.asarray(g) for g in bad], SCALE, np.dtype(np.float32), flag=flag)[1] == 1
    good = _grads(np.float32, 2, 1031, "second")
    got, value = _run(cp, be, [cp.asarray(g) for g in good], SCALE, np.dtype(np.float32), flag=flag)
    assert value == 1
    assert got.tobytes() == _want(good, SCALE, np.dtype(np.float32))[0].tobytes()


def test_the_returning_form_reads_its_own_flag(cp, be):
    """``reduce_unscale_finite`` (the trusted form that returns the verdict) on the GPU: True for
    finite sums, False otherwise, the reference's bits."""
    odt = np.dtype(np.float32)
    for bad in (False, True):
        grads = _grads(BF16, 3, 1031, f"returning{bad}")
        if bad:
            grads[1][7] = np.inf
        want, finite = _want(grads, SCALE, odt)
        out = cp.full(1031, 7, odt)
        assert be.trusted.reduce_unscale_finite([cp.asarray(g) for g in grads], SCALE, out) is (not bad) is finite
        keep = np.arange(1031) != 7
        assert cp.asnumpy(out)[keep].tobytes() == want[keep].tobytes()


def test_other_dtypes_are_refused_with_both_named(cp, be):
    out = cp.zeros(37, np.float32)
    with pytest.raises(TypeError, match="float64.*float32"):
        be.trusted.reduce_unscale_flag([cp.ones(37, np.float64)], SCALE, out, cp.zeros(1, np.int32))
    with pytest.raises(TypeError, match="bfloat16.*float16"):
        be.trusted.reduce_unscale_flag([cp.ones(37, BF16)], SCALE, cp.zeros(37, np.float16), cp.zeros(1, np.int32))


@pytest.mark.multi_gpu
@pytest.mark.parametrize("odt,gdt", [PAIRS[0], PAIRS[2], PAIRS[4]], ids=["f32", "f16", "bf16->f32"])
@pytest.mark.parametrize("m", [4, 11])
def test_gradients_on_other_gpus(cp, be, odt, gdt, m):
    """Gradient r on GPU r % 4, the sum on GPU 1: read over peer access where the GPUs have it,
    through staged copies where they do not (CUDIST_EMU_PEER=none under the fake): the same bits."""
    if cp.cuda.runtime.getDeviceCount() < 4:
        pytest.skip("needs 4 GPUs")  # (never under the fake: it emulates 4)
    grads = _grads(gdt, m, 1031, "peers")
    grads[m - 1][100] = np.nan
    on = []
    for r, g in enumerate(grads):
        with cp.cuda.Device(r % 4):
            on.append(cp.asarray(g))
    want, _ = _want(grads, SCALE, odt)
    got, flag = _run(cp, be, on, SCALE, odt, device=1)
    assert flag == 1
    keep = np.arange(1031) != 100
    assert got[keep].tobytes() == want[keep].tobytes()
