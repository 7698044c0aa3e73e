"""The Numba CPU backend: fused, multi-threaded kernels compiled on first use and cached on disk.

Design notes (why it looks the way it does):

* Compile cost is kept to one specialisation per dtype and kind of operation, never one per
  number of replicas or per shape: the buffers reach the kernels as addresses in an ``int64``
  argument block, and :func:`_view` turns an address back into an array inside the kernel.
  The per-dtype work functions (``_reduce_*`` for the 5 dtypes, ``_update_*`` for the 3 float
  dtypes) are compiled as C callbacks (``cfunc``) on first use; the single multi-threaded driver
  :func:`_k_par` calls them through a function pointer, so the expensive ``parallel=True``
  compilation happens once, not once per dtype. Everything is cached on disk (``cache=True``).
* One worker kind (reduce) does all_reduce, reduce_to_one, broadcast, assign, assign_add and
  assign_sub: each is "combine the inputs elementwise in order, write the result to M outputs".
  Work is done in blocks of ``_CHUNK`` elements: a block of the combination is built in a small
  cache-resident scratch array from every input, then written to every output, so main memory
  sees each input read once and each output written once, and an output that *is* an input
  (all_reduce in place) is safe.
* float16 has no Numba arithmetic, so it travels as ``uint16`` bits and is converted in the
  kernel with NumPy's round-to-nearest-even rule (``npy_floatbits_to_halfbits``); sums accumulate
  in float32 and round once (the contract), updates compute in float32 and round on store, so
  results are bit-identical to the reference.
* Buffers that partially overlap, or are misaligned, would break the blockwise multi-threaded
  scheme; the driver detects them and the NumPy reference does those (rare) calls instead.
* Calls moving fewer than ``_PARALLEL_MIN_BYTES`` run the worker on the calling thread (the same
  driver, which skips its ``prange`` then; results are bitwise the same either way). Waking the
  pool costs tens of microseconds, and on a busy machine a parallel region waits for every thread
  of the team, so one descheduled worker stalls a call for a whole scheduler slice.
* Numba picks the ``omp`` threading layer when TBB is absent, and GNU OpenMP's idle workers spin
  for ~300000 iterations (2-3 ms of a core) after every parallel region unless told otherwise.
  That spinning took a core from the caller's next NumPy call and, on a loaded machine, made every
  parallel kernel take one scheduler slice (8 ms). So when this module loads, and only if nobody
  chose yet (no ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` set, threading layer not started,
  libgomp not loaded), the layer is started with ``OMP_WAIT_POLICY=PASSIVE`` in the environment,
  which is restored once libgomp has read it. See :func:`_start_threads_passive`.
"""

from __future__ import annotations

import os
import sys
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, prange, types
from numba.extending import intrinsic, overload

from cudist._kernels._base import FLOAT_DTYPES, SUPPORTED_DTYPES, KernelBackend, is_bfloat16
from cudist._kernels._numpy import NumpyBackend
from cudist._reduce_util import ReduceOp

__all__ = ["NumbaBackend"]

#: Elements per block; the scratch block of the widest dtype (64 KiB) stays in L2.
_CHUNK = 8192
#: Below this many bytes moved (read + written), a call runs on the calling thread. Measured on
#: 2 shared cores, float32 all-reduce of 4 buffers, 1 vs 2 threads: at best (minimum times) 2
#: threads win from 0.5 MiB moved and by 1.6x at 4 MiB (119 vs 191 us); with the machine busy
#: (passive waits, medians) 1 thread still wins at 4 MiB (211 vs 367 us), it is a wash at 8 MiB and
#: 2 threads win by 1.4x at 32 MiB. Below 4 MiB a call takes ~200 us at most, so serial costs little.
_PARALLEL_MIN_BYTES = 4 << 20

# Modes of _k_reduce.
_SUM, _MEAN, _SUB = 0, 1, 2
# Modes of _k_update.
_SGD, _MOMENTUM, _NESTEROV = 0, 1, 2
# The optimizers with up to three slots (3 is free); every mode takes the decoupled weight decay (_DECAY).
_ADAMW, _RMSPROP, _ADAGRAD, _ADAMAX, _NADAM, _LION, _AMSGRAD = 4, 5, 6, 7, 8, 9, 10
#: Hyper-parameters per update call (float64 in, rounded to the compute type in the kernel);
#: the last one is the weight-decay factor (every mode).
_NHP = 12
_DECAY = _NHP - 1


# ---------------------------------------------------------------------------- compiling and forking
def _cached(decorator, *args, **kwargs):
    """``decorator(*args, cache=True, **kwargs)``, or without the on-disk cache where there is none.

    Numba refuses to cache ("cannot cache function ...: no locator available") when neither the
    package directory nor a user cache directory (``NUMBA_CACHE_DIR``, ``~/.cache``) is writable,
    e.g. a read-only install under a read-only HOME. Compiling on every start beats failing.
    """

    def wrap(fn):
        try:
            return decorator(*args, cache=True, **kwargs)(fn)
        except RuntimeError as e:
            if "cannot cache" not in str(e):
                raise
            return decorator(*args, cache=False, **kwargs)(fn)

    return wrap


_IN_FORK_CHILD = False


def _after_fork_in_child() -> None:
    # GNU OpenMP cannot be used again in a child forked from a process that used it (Numba's
    # OpenMP layer terminates the child on its next parallel region). The kernels' serial path
    # computes the same bits (the work split never changes a result), so the child uses it.
    global _IN_FORK_CHILD
    _IN_FORK_CHILD = True


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------- low-level helpers
@intrinsic
def _ptr_like(typingctx, addr, dtype):
    """A pointer to ``dtype`` elements (a NumPy scalar class) from the integer address ``addr``."""
    if not isinstance(addr, types.Integer) or not isinstance(dtype, types.NumberClass):
        return None
    rtype = types.CPointer(dtype.instance_type)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(rtype))

    return rtype(addr, dtype), codegen


@intrinsic
def _call_worker(typingctx, fn, args, lo, hi):
    """Calls the C function at address ``fn`` as ``void fn(int64 args, int64 lo, int64 hi)``."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, llargs):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64, i64, i64])
        builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), llargs[1:])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bits of a float32, zero-extended to int64."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(x), codegen


@intrinsic
def _bits_f32(typingctx, x):
    """The float32 whose IEEE bits are the low 32 bits of int64 ``x``."""
    if x != types.int64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def _sdiv(typingctx, a, b):
    """C integer division (truncates toward zero) of ``a`` by ``b``, in ``a``'s type."""
    if not isinstance(a, types.Integer) or not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.sdiv(args[0], context.cast(builder, args[1], sig.args[1], a))

    return a(a, b), codegen


@_cached(njit)
def _view(addr, size, dtype):
    return numba.carray(_ptr_like(addr, dtype), (size,))


@_cached(njit)
def _h2f(h):
    """float16 bits (uint16) -> float32; exact."""
    h = np.int64(h)
    e = h & 0x7C00
    if e == 0:  # zero or subnormal: an integer times 2**-24, exact in float32
        r = np.float32(h & 0x3FF) * np.float32(5.9604644775390625e-08)
        return -r if h & 0x8000 else r
    if e == 0x7C00:  # inf / nan
        return _bits_f32(((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13))
    return _bits_f32(((h & 0x8000) << 16) | (((h & 0x7FFF) + 0x1C000) << 13))


@_cached(njit)
def _f2h(f):
    """float32 -> float16 bits (uint16), round to nearest even; NumPy's npy_floatbits_to_halfbits."""
    x = _f32_bits(f)
    sgn = (x & 0x80000000) >> 16
    fe = x & 0x7F800000
    if fe >= 0x47800000:  # overflow, inf, nan
        fs = x & 0x007FFFFF
        if fe == 0x7F800000 and fs != 0:
            r = 0x7C00 + (fs >> 13)
            if r == 0x7C00:  # keep it a nan
                r += 1
            return np.uint16(sgn + r)
        return np.uint16(sgn + 0x7C00)
    if fe <= 0x38000000:  # underflow: subnormal half or signed zero
        if fe < 0x33000000:
            return np.uint16(sgn)
        fs = (0x00800000 + (x & 0x007FFFFF)) >> (113 - (fe >> 23))
        if (fs & 0x3FFF) != 0x1000 or (x & 0x7FF) != 0:
            fs += 0x1000
        return np.uint16(sgn + (fs >> 13))
    fs = x & 0x007FFFFF
    if (fs & 0x3FFF) != 0x1000:
        fs += 0x1000
    # A carry out of the significand bumps the exponent, which is the right result (up to inf).
    return np.uint16(sgn + ((fe - 0x38000000) >> 13) + (fs >> 13))


@_cached(njit)
def _bf2f(b):
    """bfloat16 bits (uint16) -> float32; exact (the upper half of a float32)."""
    return _bits_f32(np.int64(b) << 16)


@_cached(njit)
def _f2bf(f):
    """float32 -> bfloat16 bits (uint16), round to nearest even, as ml_dtypes does: a NaN becomes the
    quiet NaN 0x7fc0 with its sign (so no rounding carry can make it inf)."""
    x = _f32_bits(f)
    if (x & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(((x >> 16) & 0x8000) | 0x7FC0)
    return np.uint16((x + 0x7FFF + ((x >> 16) & 1)) >> 16)


# Element operations, chosen at compile time by the storage type (uint16 stands for float16).
def _div(s, n):  # pragma: no cover - typing stubs, implemented by the overloads below
    raise NotImplementedError


def _ld(x):  # pragma: no cover
    raise NotImplementedError


def _st(v, proto):  # pragma: no cover
    raise NotImplementedError


@overload(_div)
def _ol_div(s, n):
    if isinstance(s, types.Float):
        cast = np.float32 if s.bitwidth == 32 else np.float64
        return lambda s, n: s / cast(n)  # true division, not a multiplication by 1/n
    if isinstance(s, types.Integer):
        return lambda s, n: _sdiv(s, n)
    return None


def _sum_grads(a, g0, ng, off, m, g, tg, ta, dtype):  # pragma: no cover
    raise NotImplementedError


@overload(_sum_grads)
def _ol_sum_grads(a, g0, ng, off, m, g, tg, ta, dtype):
    """The ``ng`` gradients of a block summed into ``tg`` in replica order: float16 (uint16) in the
    float32 scratch ``ta``, rounded once; the other dtypes straight in ``tg`` (no extra pass)."""
    if dtype.instance_type == types.uint16:

        def impl(a, g0, ng, off, m, g, tg, ta, dtype):
            for j in range(m):
                ta[j] = _h2f(g[j])
            for i in range(1, ng):
                x = _view(a[g0 + i] + off, m, dtype)
                for j in range(m):
                    ta[j] = ta[j] + _h2f(x[j])
            for j in range(m):
                tg[j] = _f2h(ta[j])

        return impl

    def plain(a, g0, ng, off, m, g, tg, ta, dtype):
        for j in range(m):
            tg[j] = g[j]
        for i in range(1, ng):
            x = _view(a[g0 + i] + off, m, dtype)
            for j in range(m):
                tg[j] = tg[j] + x[j]

    return plain


@overload(_ld)
def _ol_ld(x):
    if x == types.uint16:
        return lambda x: _h2f(x)
    return lambda x: x


@overload(_st)
def _ol_st(v, proto):
    if proto.instance_type == types.uint16:
        return lambda v, proto: _f2h(v)
    return lambda v, proto: v


# ---------------------------------------------------------------------------- kernels
# A worker is a C function ``void(int64 args, int64 lo, int64 hi)`` (a numba cfunc, one per dtype)
# that processes elements [lo, hi) of the operation described by the int64 block at ``args``.
# The one parallel driver, _k_par, is compiled once for all of them.

# The argument block: a header of _HDR int64 slots, then buffer addresses.
# Header: mode, size (elements), then for reduce: n_in, n_out; for update: n (copies), n_slot1,
# n_slot2, n_grad (gradients summed first; 0 means 1), address of the float64[_NHP]
# hyper-parameters; slot 7 is the itemsize; slot 8 n_slot3 (update).
# Addresses: reduce: inputs then outputs; update: copies, first, second, third slots, gradients.
_HDR = 9


@_cached(njit)
def _reduce_range(argp, lo, hi, dtype, ctype):
    a = numba.carray(_ptr_like(argp, np.int64), (_HDR,))
    mode, nin, nout = a[0], a[2], a[3]
    a = numba.carray(_ptr_like(argp, np.int64), (_HDR + nin + nout,))
    # The running sum in the compute type: float16 accumulates in float32 and rounds once, on store.
    tmp = np.empty(_CHUNK, ctype)
    isz = np.empty(1, dtype).itemsize
    for start in range(lo, hi, _CHUNK):
        # Views of this block indexed by an unsigned j: no negative-index wraparound, so the
        # loops vectorize into plain SIMD loads and stores.
        m = np.uint64(min(_CHUNK, hi - start))
        off = start * isz
        x = _view(a[_HDR] + off, m, dtype)
        for j in range(m):
            tmp[j] = _ld(x[j])
        for i in range(1, nin):
            x = _view(a[_HDR + i] + off, m, dtype)
            if mode == _SUB:
                for j in range(m):
                    tmp[j] = tmp[j] - _ld(x[j])
            else:
                for j in range(m):
                    tmp[j] = tmp[j] + _ld(x[j])
        if mode == _MEAN:
            for j in range(m):
                tmp[j] = _div(tmp[j], nin)
        for i in range(nout):
            y = _view(a[_HDR + nin + i] + off, m, dtype)
            for j in range(m):
                y[j] = _st(tmp[j], dtype)


def _widen_sum(a, first, n, off, m, acc, gtype, sub):  # pragma: no cover - typing stub, see the overload
    raise NotImplementedError


@overload(_widen_sum)
def _ol_widen_sum(a, first, n, off, m, acc, gtype, sub):
    """``acc[:m]`` = the 16-bit buffers at addresses ``a[first : first + n]`` (``off`` bytes in, ``m``
    elements) widened exactly to float32 and added (``sub``: subtracted from the first) in replica
    order in float32, never rounded to 16 bits: the bfloat16 collectives' accumulation and the
    mixed-precision gradients' sum, one loop for both. ``gtype``: int16 marks bfloat16 bits, uint16
    float16 bits (a compile-time choice)."""
    widen = _bf2f if gtype.instance_type == types.int16 else _h2f

    def impl(a, first, n, off, m, acc, gtype, sub):
        x = _view(a[first] + off, m, np.uint16)
        for j in range(m):
            acc[j] = widen(x[j])
        for i in range(1, n):
            x = _view(a[first + i] + off, m, np.uint16)
            # A NaN sum keeps its first NaN (NumPy's sign): x86 returns the first NaN operand, but
            # LLVM may swap an addition's operands, which would pick the other NaN's sign.
            if sub:
                for j in range(m):
                    t = acc[j]
                    d = t - widen(x[j])
                    acc[j] = t if t != t else d
            else:
                for j in range(m):
                    t = acc[j]
                    s = t + widen(x[j])
                    acc[j] = t if t != t else s

    return impl


@_cached(njit)
def _reduce_range_bf16(argp, lo, hi):
    """_reduce_range for bfloat16 (uint16 bits): the block accumulates in float32 in replica order
    and is rounded once when written, the reference's rule (float16 rounds after every addition)."""
    a = numba.carray(_ptr_like(argp, np.int64), (_HDR,))
    mode, nin, nout = a[0], a[2], a[3]
    a = numba.carray(_ptr_like(argp, np.int64), (_HDR + nin + nout,))
    tmp = np.empty(_CHUNK, np.float32)
    for start in range(lo, hi, _CHUNK):
        m = np.uint64(min(_CHUNK, hi - start))
        off = start * 2
        _widen_sum(a, _HDR, nin, off, m, tmp, np.int16, mode == _SUB)
        if mode == _MEAN:
            n = np.float32(nin)
            for j in range(m):
                tmp[j] /= n
        for i in range(nout):
            y = _view(a[_HDR + nin + i] + off, m, np.uint16)
            for j in range(m):
                y[j] = _f2bf(tmp[j])


@_cached(njit)
def _update_more(a, mode, n, n1, n2, n3, off, m, w, g, hp, has_decay, zero, one, tc, t1, t2, t3, tw, dtype):
    """One block of the optimizers with weight decay (modes from _ADAMW): the new slot values into
    t1..t3 and the variable's into tw (storage type), as NumPy's reference computes them.
    ``has_decay``: the float64 weight-decay factor is not 0 (the reference's test)."""
    dec = hp[_DECAY]
    if has_decay:
        for j in range(m):
            x = _ld(w[j])
            tc[j] = x - x * dec
    else:
        for j in range(m):
            tc[j] = _ld(w[j])
    s1 = _view(a[_HDR + n] + off, m, dtype)
    if mode == _ADAMW or mode == _NADAM:
        b1, b2, eps = hp[1], hp[2], hp[3]
        c1 = one - b1
        c2 = one - b2
        s2 = _view(a[_HDR + n + n1] + off, m, dtype)
        if mode == _ADAMW:
            lr_t = hp[0]
            for j in range(m):
                gg = _ld(g[j])
                mm = _ld(s1[j])
                vv = _ld(s2[j])
                mm = mm + (gg - mm) * c1
                vv = vv + (gg * gg - vv) * c2
                t1[j] = _st(mm, dtype)
                t2[j] = _st(vv, dtype)
                tw[j] = _st(tc[j] - lr_t * mm / (np.sqrt(vv) + eps), dtype)
        else:
            lr, c_m, c_g, c_v = hp[0], hp[4], hp[5], hp[6]
            for j in range(m):
                gg = _ld(g[j])
                mm = _ld(s1[j])
                vv = _ld(s2[j])
                mm = mm + (gg - mm) * c1
                vv = vv + (gg * gg - vv) * c2
                mh = c_m * mm + c_g * gg
                vh = vv / c_v
                t1[j] = _st(mm, dtype)
                t2[j] = _st(vv, dtype)
                tw[j] = _st(tc[j] - mh * lr / (np.sqrt(vh) + eps), dtype)
    elif mode == _AMSGRAD:
        lr_t, b1, b2, eps = hp[0], hp[1], hp[2], hp[3]
        c1 = one - b1
        c2 = one - b2
        s2 = _view(a[_HDR + n + n1] + off, m, dtype)
        s3 = _view(a[_HDR + n + n1 + n2] + off, m, dtype)
        for j in range(m):
            gg = _ld(g[j])
            mm = _ld(s1[j])
            vv = _ld(s2[j])
            mm = mm + (gg - mm) * c1
            vv = vv + (gg * gg - vv) * c2
            x = _ld(s3[j])
            vh = x if (x > vv or x != x) else vv  # np.maximum(v_hat, v): a NaN wins, equal values give v
            t1[j] = _st(mm, dtype)
            t2[j] = _st(vv, dtype)
            t3[j] = _st(vh, dtype)
            tw[j] = _st(tc[j] - lr_t * mm / (np.sqrt(vh) + eps), dtype)
    elif mode == _RMSPROP:
        lr, rho, mom, eps = hp[0], hp[1], hp[2], hp[3]
        omr = one - rho
        smo = s1
        sa = s1
        if n2 > 0:
            smo = _view(a[_HDR + n + n1] + off, m, dtype)
        if n3 > 0:
            sa = _view(a[_HDR + n + n1 + n2] + off, m, dtype)
        for j in range(m):
            gg = _ld(g[j])
            vv = rho * _ld(s1[j]) + omr * (gg * gg)
            if n3 > 0:
                aa = rho * _ld(sa[j]) + omr * gg
                d = vv - aa * aa + eps
                t3[j] = _st(aa, dtype)
            else:
                d = vv + eps
            inc = lr * gg / np.sqrt(d)
            if n2 > 0:
                mo = mom * _ld(smo[j]) + inc
                t2[j] = _st(mo, dtype)
                ww = tc[j] - mo
            else:
                ww = tc[j] - inc
            t1[j] = _st(vv, dtype)
            tw[j] = _st(ww, dtype)
    elif mode == _ADAGRAD:
        lr, eps = hp[0], hp[1]
        for j in range(m):
            gg = _ld(g[j])
            acc = _ld(s1[j]) + gg * gg
            t1[j] = _st(acc, dtype)
            tw[j] = _st(tc[j] - lr * gg / np.sqrt(acc + eps), dtype)
    elif mode == _ADAMAX:
        lr_t, b1, b2, eps = hp[0], hp[1], hp[2], hp[3]
        c1 = one - b1
        s2 = _view(a[_HDR + n + n1] + off, m, dtype)
        for j in range(m):
            gg = _ld(g[j])
            mm = _ld(s1[j])
            mm = mm + (gg - mm) * c1
            x = b2 * _ld(s2[j])
            y = abs(gg)
            uu = x if (x > y or x != x) else y  # np.maximum: a NaN wins, equal values give y
            t1[j] = _st(mm, dtype)
            t2[j] = _st(uu, dtype)
            tw[j] = _st(tc[j] - lr_t * mm / (uu + eps), dtype)
    else:  # _LION
        lr, b1, b2 = hp[0], hp[1], hp[2]
        c1 = one - b1
        c2 = one - b2
        for j in range(m):
            gg = _ld(g[j])
            mm = _ld(s1[j])
            u = mm * b1 + gg * c1
            if u > zero:
                sg = one
            elif u < zero:
                sg = -one
            elif u == zero:
                sg = zero
            else:
                sg = u  # np.sign keeps a NaN
            t1[j] = _st(mm * b2 + gg * c2, dtype)
            tw[j] = _st(tc[j] - lr * sg, dtype)


def _is_mixed(dtype, gtype):  # pragma: no cover
    raise NotImplementedError


@overload(_is_mixed)
def _ol_is_mixed(dtype, gtype):
    """Whether the gradients' storage type is not the copies' (a compile-time constant)."""
    mixed = dtype.instance_type != gtype.instance_type
    return lambda dtype, gtype: mixed


def _block_grads(a, g0, ng, start, m, tg, ta, dtype, gtype):  # pragma: no cover
    raise NotImplementedError


@overload(_block_grads)
def _ol_block_grads(a, g0, ng, start, m, tg, ta, dtype, gtype):
    """One block's gradient for the update, in the copies' storage type: gradient 0 itself, or the
    ``ng`` gradients summed in replica order (:func:`_sum_grads`). Mixed precision (``gtype`` is not
    ``dtype``: float32 copies, float16 gradients as ``uint16`` or bfloat16 ones marked ``int16``):
    every gradient widened exactly to float32 and summed in float32 into ``ta`` (no rounding to the
    narrow type), the bits of casting each gradient to float32 first, as the native pass does."""
    g_t = gtype.instance_type
    if g_t == dtype.instance_type:

        def same(a, g0, ng, start, m, tg, ta, dtype, gtype):
            off = start * tg.itemsize
            g = _view(a[g0] + off, m, dtype)
            if ng > 1:
                # The fused all-reduce: the gradients summed in replica order in the compute type and
                # rounded once to their dtype (float16), exactly what reduce_to_one would store.
                _sum_grads(a, g0, ng, off, m, g, tg, ta, dtype)
                g = _view(tg.ctypes.data, m, dtype)
            return g

        return same
    def mixed(a, g0, ng, start, m, tg, ta, dtype, gtype):
        _widen_sum(a, g0, ng, start * 2, m, ta, gtype, False)
        return _view(ta.ctypes.data, m, dtype)

    return mixed


@_cached(njit)
def _update_range(argp, lo, hi, dtype, ctype, gtype):
    a = numba.carray(_ptr_like(argp, np.int64), (_HDR,))
    mode, n, n1, n2, ng, hpp, n3 = a[0], a[2], a[3], a[4], a[5], a[6], a[8]
    if ng < 1:
        ng = 1
    a = numba.carray(_ptr_like(argp, np.int64), (_HDR + n + n1 + n2 + n3 + ng,))
    g0 = _HDR + n + n1 + n2 + n3
    # Hyper-parameters are rounded to the compute type first, as NumPy's ct.type(x) does.
    hp64 = numba.carray(_ptr_like(hpp, np.float64), (_NHP,))
    hp = np.empty(_NHP, ctype)
    for i in range(_NHP):
        hp[i] = hp64[i]
    cst = np.empty(2, ctype)  # 0 and 1 in the compute type (a Python literal would widen float32)
    cst[0] = 0
    cst[1] = 1
    zero, one = cst[0], cst[1]
    has_decay = hp64[_DECAY] != 0.0
    tw = np.empty(_CHUNK, dtype)
    t1 = np.empty(_CHUNK, dtype)
    t2 = np.empty(_CHUNK, dtype)
    t3 = np.empty(_CHUNK if n3 > 0 else 1, dtype)
    tc = np.empty(_CHUNK if mode >= _ADAMW else 1, ctype)  # copy 0 after the weight decay
    tg = np.empty(_CHUNK if ng > 1 else 1, dtype)
    # float16's float32 running sum (see _sum_grads), or the widened sum of mixed-precision gradients.
    ta = np.empty(_CHUNK if ng > 1 or _is_mixed(dtype, gtype) else 1, ctype)
    isz = tw.itemsize
    for start in range(lo, hi, _CHUNK):
        m = np.uint64(min(_CHUNK, hi - start))
        off = start * isz
        w = _view(a[_HDR] + off, m, dtype)
        g = _block_grads(a, g0, ng, start, m, tg, ta, dtype, gtype)
        if mode == _SGD:
            lr = hp[0]
            if has_decay:
                dec = hp[_DECAY]
                for j in range(m):
                    x = _ld(w[j])
                    tw[j] = _st((x - x * dec) - lr * _ld(g[j]), dtype)
            else:
                for j in range(m):
                    tw[j] = _st(_ld(w[j]) - lr * _ld(g[j]), dtype)
        elif mode == _MOMENTUM or mode == _NESTEROV:
            lr = hp[0]
            mom = hp[1]
            dec = hp[_DECAY]
            v = _view(a[_HDR + n] + off, m, dtype)
            for j in range(m):
                gg = _ld(g[j])
                vv = mom * _ld(v[j]) - lr * gg
                ww = _ld(w[j])
                if has_decay:
                    ww = ww - ww * dec
                if mode == _NESTEROV:
                    ww = ww + (mom * vv - lr * gg)
                else:
                    ww = ww + vv
                t1[j] = _st(vv, dtype)
                tw[j] = _st(ww, dtype)
        else:
            _update_more(a, mode, n, n1, n2, n3, off, m, w, g, hp, has_decay, zero, one, tc, t1, t2, t3, tw, dtype)
        for i in range(n1):
            y = _view(a[_HDR + n + i] + off, m, dtype)
            for j in range(m):
                y[j] = t1[j]
        for i in range(n2):
            y = _view(a[_HDR + n + n1 + i] + off, m, dtype)
            for j in range(m):
                y[j] = t2[j]
        for i in range(n3):
            y = _view(a[_HDR + n + n1 + n2 + i] + off, m, dtype)
            for j in range(m):
                y[j] = t3[j]
        for i in range(n):
            y = _view(a[_HDR + i] + off, m, dtype)
            for j in range(m):
                y[j] = tw[j]


# The per-dtype workers (compiled as cfuncs on first use; uint16 carries float16 bits).
def _reduce_f16(argp, lo, hi):
    _reduce_range(argp, lo, hi, np.uint16, np.float32)


def _reduce_bf16(argp, lo, hi):
    _reduce_range_bf16(argp, lo, hi)


def _reduce_f32(argp, lo, hi):
    _reduce_range(argp, lo, hi, np.float32, np.float32)


def _reduce_f64(argp, lo, hi):
    _reduce_range(argp, lo, hi, np.float64, np.float64)


def _reduce_i32(argp, lo, hi):
    _reduce_range(argp, lo, hi, np.int32, np.int32)


def _reduce_i64(argp, lo, hi):
    _reduce_range(argp, lo, hi, np.int64, np.int64)


def _update_f16(argp, lo, hi):
    _update_range(argp, lo, hi, np.uint16, np.float32, np.uint16)


def _update_f32(argp, lo, hi):
    _update_range(argp, lo, hi, np.float32, np.float32, np.float32)


def _update_f64(argp, lo, hi):
    _update_range(argp, lo, hi, np.float64, np.float64, np.float64)


# Mixed precision: float32 copies from float16 (uint16 bits) or bfloat16 (marked int16) gradients.
def _update_f32_gf16(argp, lo, hi):
    _update_range(argp, lo, hi, np.float32, np.float32, np.uint16)


def _update_f32_gbf16(argp, lo, hi):
    _update_range(argp, lo, hi, np.float32, np.float32, np.int16)


@_cached(njit, parallel=True)
def _k_par(fn, args, hp, nthreads, itemsize, mode, size, h2, h3, h4, narrow):
    """Runs worker ``fn`` on the operation ``args`` describes, over contiguous block-aligned ranges.

    ``narrow``: how many of the last addresses are 2-byte gradients of a mixed-precision update
    (0: every buffer has ``itemsize``).

    Returns False, doing nothing, when buffers partially overlap or are misaligned (the caller
    then falls back to NumPy): blocks would read data another block or thread already wrote.
    """
    args[0] = mode
    args[1] = size
    args[2] = h2
    args[3] = h3
    args[4] = h4
    args[7] = isz = itemsize
    k = args.size
    first_narrow = k - narrow
    for i in range(_HDR, k):
        isz_i = 2 if i >= first_narrow else isz
        if args[i] % isz_i != 0:
            return False
        for j in range(i + 1, k):
            # [a_i, a_i + len_i) and [a_j, a_j + len_j) share a byte but are not the same buffer.
            len_i = size * isz_i
            len_j = size * (2 if j >= first_narrow else isz)
            if args[i] != args[j] and args[i] < args[j] + len_j and args[j] < args[i] + len_i:
                return False
    args[6] = hp.ctypes.data
    argp = args.ctypes.data
    nchunks = (size + _CHUNK - 1) // _CHUNK
    nt = min(nthreads, nchunks)
    if nt <= 1:
        _call_worker(fn, argp, 0, size)
    else:
        for t in prange(nt):
            lo = (t * nchunks // nt) * _CHUNK
            hi = min(((t + 1) * nchunks // nt) * _CHUNK, size)
            _call_worker(fn, argp, lo, hi)
    return True


@_cached(njit, parallel=True)
def _k_batch(fn, blocks, sizes, ok, nthreads, itemsize):
    """Runs worker ``fn`` over several operations at once (a batched all-reduce): row ``s`` of
    ``blocks`` is the argument block of operation ``s`` (``sizes[s]`` elements). The blocks of all
    operations are dealt out to the threads as one list, so many small leaves cost one parallel
    region. A row whose buffers partially overlap or are misaligned is skipped with ``ok[s] = 0``
    (the caller does it through NumPy); returns how many were skipped.
    """
    nseg = blocks.shape[0]
    width = blocks.shape[1]
    skipped = 0
    starts = np.zeros(nseg + 1, np.int64)
    for s in range(nseg):
        size = sizes[s]
        good = size > 0
        nbytes = size * itemsize
        for i in range(_HDR, width):
            if not good:
                break
            if blocks[s, i] % itemsize != 0:
                good = False
            for j in range(i + 1, width):
                d = blocks[s, i] - blocks[s, j]
                if d != 0 and -nbytes < d < nbytes:
                    good = False
        if size > 0 and not good:
            skipped += 1
        ok[s] = 1 if good else 0
        starts[s + 1] = starts[s] + ((size + _CHUNK - 1) // _CHUNK if good else 0)
    nchunks = starts[nseg]
    base = blocks.ctypes.data
    row = width * 8
    nt = min(nthreads, nchunks)
    if nt <= 1:
        for s in range(nseg):
            if ok[s]:
                _call_worker(fn, base + s * row, 0, sizes[s])
    else:
        for t in prange(nt):
            c = t * nchunks // nt
            c1 = (t + 1) * nchunks // nt
            s = 0
            while c < c1:
                while starts[s + 1] <= c:
                    s += 1
                cend = min(c1, starts[s + 1])
                lo = (c - starts[s]) * _CHUNK
                hi = min((cend - starts[s]) * _CHUNK, sizes[s])
                _call_worker(fn, base + s * row, lo, hi)
                c = cend
    return skipped


@_cached(njit)
def _pack8(args, off, a0, a1, a2, a3, a4, a5, a6, a7):
    # Reading addresses in compiled code costs ~0.1 us an array against ~1 us for .ctypes.data.
    args[off] = a0.ctypes.data
    args[off + 1] = a1.ctypes.data
    args[off + 2] = a2.ctypes.data
    args[off + 3] = a3.ctypes.data
    args[off + 4] = a4.ctypes.data
    args[off + 5] = a5.ctypes.data
    args[off + 6] = a6.ctypes.data
    args[off + 7] = a7.ctypes.data


# ---------------------------------------------------------------------------- the backend
_WORKER_SIG = types.void(types.int64, types.int64, types.int64)
_REDUCE_PY = dict(zip(SUPPORTED_DTYPES, (_reduce_f16, _reduce_f32, _reduce_f64, _reduce_i32, _reduce_i64)))
_UPDATE_PY = dict(zip(FLOAT_DTYPES, (_update_f16, _update_f32, _update_f64)))
#: The bfloat16 worker, keyed by the dtype's name (ml_dtypes is not imported here); broadcast copies
#: bfloat16 bits with the float16 worker (one input, SUM: a plain copy of uint16 bits, NaN payloads kept).
_REDUCE_BF16 = {"bfloat16": _reduce_bf16}
#: The mixed-precision update workers (float32 copies), keyed by the gradients' dtype name.
_UPDATE_MIXED = {"bfloat16": _update_f32_gbf16, "float16": _update_f32_gf16}
_workers: dict = {}
_workers_lock = threading.Lock()
_NO_HP = np.zeros(_NHP, np.float64)
_NP = NumpyBackend()


def _worker(table, dtype) -> int:
    """Address of the worker cfunc for ``dtype`` from ``table``, compiling (or loading) it once."""
    fn = table[dtype]
    addr = _workers.get(fn)
    if addr is None:
        with _workers_lock:
            addr = _workers.get(fn)
            if addr is None:
                compiled = _cached(cfunc, _WORKER_SIG)(fn)
                _workers[(fn, "cfunc")] = compiled  # keeps the machine code alive
                addr = _workers[fn] = compiled.address
    return addr


def _reduce_worker(dtype, copy: bool = False) -> int:
    """Address of the reduce worker for ``dtype``; ``copy``: the call only copies (one input, SUM)."""
    if is_bfloat16(dtype):
        return _worker(_REDUCE_PY, np.dtype(np.float16)) if copy else _worker(_REDUCE_BF16, "bfloat16")
    return _worker(_REDUCE_PY, dtype)


def _args(arrays, writable: bool):
    """The int64 argument block with the addresses of ``arrays`` (one dtype and shape) filled in.

    The header slots are left for :func:`_k_par` to fill. ``writable``: the caller knows every
    array is writeable (read-only arrays are another Numba type, so they are packed in Python
    rather than given a specialisation per pattern).
    """
    k = len(arrays)
    if arrays[0].dtype == np.float16 or is_bfloat16(arrays[0].dtype):
        # Numba has no float16 or bfloat16 arrays; the addresses are the same
        arrays = tuple(a.view(np.uint16) for a in arrays)
    # 1-D views, so that one specialisation of _pack8 serves leaves of every rank.
    arrays = tuple(a if a.ndim == 1 else a.ravel() for a in arrays)
    # Room for whole groups of 8; the padding repeats an address, which the overlap check allows.
    args = np.empty(_HDR + (k + 7) // 8 * 8, np.int64)
    for i in range(0, k, 8):
        grp = arrays[i : i + 8]
        if writable or all(a.flags.writeable for a in grp):
            if len(grp) < 8:  # pad with a repeat so one specialisation serves every count
                grp = grp + (grp[0],) * (8 - len(grp))
            _pack8(args, _HDR + i, *grp)
        else:
            for j in range(8):
                args[_HDR + i + j] = grp[min(j, len(grp) - 1)].ctypes.data
    return args


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return True  # unknown: assume another library already started OpenMP


def _start_threads_passive() -> str:
    """Starts Numba's threading layer with passive OpenMP waits, unless someone already chose.

    GNU OpenMP reads ``OMP_WAIT_POLICY`` once, when it is loaded, which for Numba is when its
    threading layer starts; so the variable is set only around that start and restored right after
    (child processes and OpenMP runtimes loaded later do not see it). Nothing is changed when the
    user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (their choice stands; ``active`` restores
    the spinning), chose a layer other than OpenMP, or when the layer or libgomp is already
    running (too late to matter). Linux only: other OpenMP runtimes read the environment lazily.

    Returns:
        What was done, for tests and diagnostics: "passive", or why not.
    """
    from numba.np.ufunc import parallel as _par

    if not sys.platform.startswith("linux"):
        return "skipped: not linux"
    # Empty counts as unset, as libgomp reads it (``OMP_WAIT_POLICY= python ...``).
    if os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT"):
        return "skipped: user set OMP_WAIT_POLICY/GOMP_SPINCOUNT"
    if getattr(_par, "_is_initialized", True):
        return "skipped: threading layer already started"
    if str(numba.config.THREADING_LAYER).lower() in ("tbb", "workqueue"):
        return "skipped: threading layer is not omp"
    if _libgomp_loaded():
        return "skipped: libgomp already loaded"
    saved = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        numba.get_num_threads()  # loads the layer (and libgomp, which reads the variable now)
    finally:
        if saved is None:
            del os.environ["OMP_WAIT_POLICY"]
        else:
            os.environ["OMP_WAIT_POLICY"] = saved
    return "passive"


_THREADS_SETUP = _start_threads_passive()


def _nthreads(nbytes: int) -> int:
    # Asked per call: numba.set_num_threads may change it (the kernel itself must not ask, as the
    # threading layer's function pointer would make it uncacheable).
    if _IN_FORK_CHILD:
        return 1
    return numba.get_num_threads() if nbytes >= _PARALLEL_MIN_BYTES else 1


class NumbaBackend(KernelBackend):
    """Fused multi-threaded CPU kernels compiled by Numba on first use (cached on disk)."""

    name = "numba"
    dtypes = SUPPORTED_DTYPES
    bfloat16 = True
    mixed_gradients = True

    def _combine(self, ins, outs, mode, fallback, copy=False):
        ref = outs[0]
        size = ref.size
        if size == 0:
            return
        args = _args(tuple(ins) + tuple(outs), ins is outs)
        moved = ref.nbytes * (len(ins) + len(outs))
        fn = _reduce_worker(ref.dtype, copy)
        if not _k_par(fn, args, _NO_HP, _nthreads(moved), ref.itemsize, mode, size, len(ins), len(outs), 0, 0):
            fallback()

    def _hook_all_reduce(self, inputs, outputs, op):
        mode = _MEAN if op is ReduceOp.MEAN else _SUM
        self._combine(inputs, outputs, mode, lambda: _NP._hook_all_reduce(inputs, outputs, op))

    def _hook_batch_all_reduce(self, inputs, outputs, op):
        n, m = len(inputs), len(inputs[0])
        if m == 0:
            return
        flat = []
        for j in range(m):
            flat += [inputs[r][j] for r in range(n)]
            flat += [outputs[r][j] for r in range(n)]
        ref = inputs[0][0]
        addrs = _args(tuple(flat), False)
        width = _HDR + 2 * n
        blocks = np.empty((m, width), np.int64)
        blocks[:, _HDR:] = addrs[_HDR : _HDR + len(flat)].reshape(m, 2 * n)
        blocks[:, 0] = _MEAN if op is ReduceOp.MEAN else _SUM
        sizes = np.fromiter((inputs[0][j].size for j in range(m)), np.int64, m)
        blocks[:, 1] = sizes
        blocks[:, 2] = n
        blocks[:, 3] = n
        blocks[:, 4:7] = 0
        blocks[:, 7] = ref.itemsize
        blocks[:, 8:_HDR] = 0
        ok = np.empty(m, np.int8)
        moved = int(sizes.sum()) * ref.itemsize * 2 * n
        fn = _reduce_worker(ref.dtype)
        if _k_batch(fn, blocks, sizes, ok, _nthreads(moved), ref.itemsize):
            for j in np.flatnonzero(ok == 0).tolist():
                if sizes[j]:
                    _NP._hook_all_reduce(
                        tuple(inputs[r][j] for r in range(n)), tuple(outputs[r][j] for r in range(n)), op
                    )

    def _hook_reduce_to_one(self, bufs, op, out):
        mode = _MEAN if op is ReduceOp.MEAN else _SUM
        self._combine(bufs, (out,), mode, lambda: _NP._hook_reduce_to_one(bufs, op, out))

    def _hook_broadcast(self, src, dsts):
        self._combine((src,), dsts, _SUM, lambda: _NP._hook_broadcast(src, dsts), copy=True)

    def _hook_all_gather(self, bufs, axis):
        return np.concatenate(bufs, axis=axis)

    def _hook_assign_add(self, copies, value, negate):
        self._combine(
            (copies[0], value), copies, _SUB if negate else _SUM, lambda: _NP._hook_assign_add(copies, value, negate)
        )

    def _update(self, mode, copies, s1, s2, grads, hp, fallback, s3=(), decay=0.0):
        ref = copies[0]
        size = ref.size
        if size == 0:
            return
        # Copies and slots were checked writeable; only the gradients may be read-only.
        writable = all(g.flags.writeable for g in grads)
        gdt = grads[0].dtype
        narrow = 0
        if gdt == ref.dtype:
            args = _args(tuple(copies) + tuple(s1) + tuple(s2) + tuple(s3) + tuple(grads), writable)
            fn = _worker(_UPDATE_PY, ref.dtype)
        else:
            # Mixed precision (float32 copies, bfloat16 / float16 gradients): the gradients' addresses
            # packed apart (another storage type), after the copies' and slots'.
            bufs = tuple(copies) + tuple(s1) + tuple(s2) + tuple(s3)
            head = _args(bufs, True)[: _HDR + len(bufs)]
            narrow = len(grads)
            args = np.concatenate((head, _args(tuple(grads), writable)[_HDR : _HDR + narrow]))
            fn = _worker(_UPDATE_MIXED, "bfloat16" if is_bfloat16(gdt) else "float16")
        args[5] = len(grads)
        args[8] = len(s3)
        hp = np.array(hp + (0.0,) * (_NHP - 1 - len(hp)) + (decay,), np.float64)
        moved = ref.nbytes * (1 + len(copies) + 2 * len(s1) + 2 * len(s2) + 2 * len(s3)) + grads[0].nbytes * len(grads)
        if not _k_par(fn, args, hp, _nthreads(moved), ref.itemsize, mode, size, len(copies), len(s1), len(s2), narrow):
            fallback()

    def _hook_sgd(self, copies, grad, lr, decay):
        self._hook_all_reduce_sgd(copies, (grad,), lr, decay)

    def _hook_all_reduce_sgd(self, copies, grads, lr, decay):
        self._update(_SGD, copies, (), (), grads, (lr,), lambda: _NP._hook_all_reduce_sgd(copies, grads, lr, decay),
                     decay=decay)

    def _hook_momentum(self, copies, velocities, grad, lr, momentum, decay):
        self._hook_all_reduce_momentum(copies, velocities, (grad,), lr, momentum, decay)

    def _hook_all_reduce_momentum(self, copies, velocities, grads, lr, momentum, decay):
        self._update(_MOMENTUM, copies, velocities, (), grads, (lr, momentum),
                     lambda: _NP._hook_all_reduce_momentum(copies, velocities, grads, lr, momentum, decay), decay=decay)

    def _hook_nesterov(self, copies, velocities, grad, lr, momentum, decay):
        self._hook_all_reduce_nesterov(copies, velocities, (grad,), lr, momentum, decay)

    def _hook_all_reduce_nesterov(self, copies, velocities, grads, lr, momentum, decay):
        self._update(_NESTEROV, copies, velocities, (), grads, (lr, momentum),
                     lambda: _NP._hook_all_reduce_nesterov(copies, velocities, grads, lr, momentum, decay), decay=decay)

    # ------------------------------------------------------------------ the optimizers with weight decay
    def _opt(self, mode, copies, slots, grads, hp, decay, fallback):
        s1, s2, s3 = (tuple(x) if x is not None else () for x in slots + (None,) * (3 - len(slots)))
        self._update(mode, copies, s1, s2, grads, hp, fallback, s3, decay)

    def _hook_adamw(self, copies, ms, vs, grad, lr_t, beta_1, beta_2, epsilon, decay):
        self._hook_all_reduce_adamw(copies, ms, vs, (grad,), lr_t, beta_1, beta_2, epsilon, decay)

    def _hook_all_reduce_adamw(self, copies, ms, vs, grads, lr_t, beta_1, beta_2, epsilon, decay):
        self._opt(_ADAMW, copies, (ms, vs), grads, (lr_t, beta_1, beta_2, epsilon), decay,
                  lambda: _NP._hook_all_reduce_adamw(copies, ms, vs, grads, lr_t, beta_1, beta_2, epsilon, decay))

    def _hook_amsgrad(self, copies, ms, vs, v_hats, grad, lr_t, beta_1, beta_2, epsilon, decay):
        self._hook_all_reduce_amsgrad(copies, ms, vs, v_hats, (grad,), lr_t, beta_1, beta_2, epsilon, decay)

    def _hook_all_reduce_amsgrad(self, copies, ms, vs, v_hats, grads, lr_t, beta_1, beta_2, epsilon, decay):
        self._opt(_AMSGRAD, copies, (ms, vs, v_hats), grads, (lr_t, beta_1, beta_2, epsilon), decay,
                  lambda: _NP._hook_all_reduce_amsgrad(copies, ms, vs, v_hats, grads, lr_t, beta_1, beta_2, epsilon,
                                                       decay))

    def _hook_rmsprop(self, copies, vels, moms, avgs, grad, lr, rho, momentum, epsilon, decay):
        self._hook_all_reduce_rmsprop(copies, vels, moms, avgs, (grad,), lr, rho, momentum, epsilon, decay)

    def _hook_all_reduce_rmsprop(self, copies, vels, moms, avgs, grads, lr, rho, momentum, epsilon, decay):
        self._opt(_RMSPROP, copies, (vels, moms, avgs), grads, (lr, rho, momentum, epsilon), decay,
                  lambda: _NP._hook_all_reduce_rmsprop(copies, vels, moms, avgs, grads, lr, rho, momentum, epsilon, decay))

    def _hook_adagrad(self, copies, accs, grad, lr, epsilon, decay):
        self._hook_all_reduce_adagrad(copies, accs, (grad,), lr, epsilon, decay)

    def _hook_all_reduce_adagrad(self, copies, accs, grads, lr, epsilon, decay):
        self._opt(_ADAGRAD, copies, (accs,), grads, (lr, epsilon), decay,
                  lambda: _NP._hook_all_reduce_adagrad(copies, accs, grads, lr, epsilon, decay))

    def _hook_adamax(self, copies, ms, us, grad, lr_t, beta_1, beta_2, epsilon, decay):
        self._hook_all_reduce_adamax(copies, ms, us, (grad,), lr_t, beta_1, beta_2, epsilon, decay)

    def _hook_all_reduce_adamax(self, copies, ms, us, grads, lr_t, beta_1, beta_2, epsilon, decay):
        self._opt(_ADAMAX, copies, (ms, us), grads, (lr_t, beta_1, beta_2, epsilon), decay,
                  lambda: _NP._hook_all_reduce_adamax(copies, ms, us, grads, lr_t, beta_1, beta_2, epsilon, decay))

    def _hook_nadam(self, copies, ms, vs, grad, lr, beta_1, beta_2, epsilon, c_m, c_g, c_v, decay):
        self._hook_all_reduce_nadam(copies, ms, vs, (grad,), lr, beta_1, beta_2, epsilon, c_m, c_g, c_v, decay)

    def _hook_all_reduce_nadam(self, copies, ms, vs, grads, lr, beta_1, beta_2, epsilon, c_m, c_g, c_v, decay):
        self._opt(_NADAM, copies, (ms, vs), grads, (lr, beta_1, beta_2, epsilon, c_m, c_g, c_v), decay,
                  lambda: _NP._hook_all_reduce_nadam(copies, ms, vs, grads, lr, beta_1, beta_2, epsilon, c_m, c_g, c_v, decay))

    def _hook_lion(self, copies, ms, grad, lr, beta_1, beta_2, decay):
        self._hook_all_reduce_lion(copies, ms, (grad,), lr, beta_1, beta_2, decay)

    def _hook_all_reduce_lion(self, copies, ms, grads, lr, beta_1, beta_2, decay):
        self._opt(_LION, copies, (ms,), grads, (lr, beta_1, beta_2), decay,
                  lambda: _NP._hook_all_reduce_lion(copies, ms, grads, lr, beta_1, beta_2, decay))
