"""The NumPy reference backend: the plain definition every other backend is tested against."""

from __future__ import annotations

import numpy as np

from cudist._kernels._base import KernelBackend, is_bfloat16
from cudist._reduce_util import ReduceOp


def reference_reduce(bufs, op):
    """Returns the reduction of ``bufs`` as a new array, in the contract's fixed order.

    The 16-bit floats (float16, bfloat16) accumulate in float32 in replica order (the mean divides
    the float32 sum by float32(N)) and round once at the end: rounded after every addition, their
    11- and 8-bit significands would lose the low bits of later replicas.
    """
    if bufs[0].dtype == np.float16 or is_bfloat16(bufs[0].dtype):
        return reference_reduce([b.astype(np.float32) for b in bufs], op).astype(bufs[0].dtype)
    s = bufs[0].copy()
    for b in bufs[1:]:
        np.add(s, b, out=s)
    if op is ReduceOp.MEAN:
        n = len(bufs)
        if s.dtype.kind == "f":
            np.divide(s, s.dtype.type(n), out=s)
        else:
            # Truncation toward zero, as C's integer division does.
            q = np.floor_divide(s, n)
            q += ((s - q * n) != 0) & (s < 0)
            s = q
    return s


def _copy_to_all(src, dsts):
    src = src.copy() if any(np.shares_memory(src, d) for d in dsts) else src
    for d in dsts:
        np.copyto(d, src)


def _compute_dtype(dtype):
    # The 16-bit floats compute in float32 and round once per stored value (Keras does the same).
    return np.dtype(np.float32) if dtype == np.float16 or is_bfloat16(dtype) else dtype


class NumpyBackend(KernelBackend):
    """Reference implementation in plain NumPy (not fused; clarity over speed)."""

    name = "numpy"
    bfloat16 = True
    bfloat16_updates = True
    # Its fused forms are the definition, which casts narrow gradients first (_sum_grads): the fast
    # backends' mixed-precision passes and LossScaleOptimizer's fused step are checked against it.
    mixed_gradients = True

    def _hook_all_reduce(self, inputs, outputs, op):
        # Everything is reduced before anything is written: outputs may be (or overlap) inputs.
        s = reference_reduce(inputs, op)
        for b in outputs:
            np.copyto(b, s)

    def _hook_reduce_to_one(self, bufs, op, out):
        np.copyto(out, reference_reduce(bufs, op))

    def _hook_broadcast(self, src, dsts):
        _copy_to_all(src, dsts)

    def _hook_all_gather(self, bufs, axis):
        return np.concatenate(bufs, axis=axis)

    def _hook_assign_add(self, copies, value, negate):
        new = np.subtract(copies[0], value) if negate else np.add(copies[0], value)
        _copy_to_all(new, copies)

    def _hook_sgd(self, copies, grad, lr, decay):
        ct, _, w, g, (lr,) = self._start(copies, grad, decay, lr)
        self._finish(copies, (w - lr * g, copies))

    def _hook_momentum(self, copies, velocities, grad, lr, momentum, decay):
        self._momentum_rule(copies, velocities, grad, lr, momentum, decay, False)

    def _hook_nesterov(self, copies, velocities, grad, lr, momentum, decay):
        self._momentum_rule(copies, velocities, grad, lr, momentum, decay, True)

    def _momentum_rule(self, copies, velocities, grad, lr, momentum, decay, nesterov):
        # ``v`` unrounded within the step (float16: rounded when stored), as Keras computes it.
        ct, _, w, g, (lr, mom) = self._start(copies, grad, decay, lr, momentum)
        v = mom * velocities[0].astype(ct) - lr * g
        w = w + (mom * v - lr * g) if nesterov else w + v
        self._finish(copies, (v, velocities), (w, copies))

    # The optimizers below share one shape: copy 0 of the variable and of each slot read in the
    # compute type, the decoupled weight decay first (``w - w * decay``, skipped when decay is 0),
    # the update, then every slot and the variable written to all their copies.
    @staticmethod
    def _start(copies, grad, decay, *hyper):
        ct = _compute_dtype(copies[0].dtype)
        w = copies[0].astype(ct)
        if decay != 0.0:
            w = w - w * ct.type(decay)
        return ct, ct.type(1), w, grad.astype(ct), tuple(ct.type(h) for h in hyper)

    @staticmethod
    def _finish(copies, *pairs):
        dt = copies[0].dtype
        for new, group in pairs:
            _copy_to_all(new.astype(dt), group)

    def _hook_adamw(self, copies, ms, vs, grad, lr_t, beta_1, beta_2, epsilon, decay):
        ct, one, w, g, (lr_t, b1, b2, eps) = self._start(copies, grad, decay, lr_t, beta_1, beta_2, epsilon)
        m = ms[0].astype(ct)
        v = vs[0].astype(ct)
        m = m + (g - m) * (one - b1)
        v = v + (g * g - v) * (one - b2)
        w = w - lr_t * m / (np.sqrt(v) + eps)
        self._finish(copies, (m, ms), (v, vs), (w, copies))

    def _hook_amsgrad(self, copies, ms, vs, v_hats, grad, lr_t, beta_1, beta_2, epsilon, decay):
        ct, one, w, g, (lr_t, b1, b2, eps) = self._start(copies, grad, decay, lr_t, beta_1, beta_2, epsilon)
        m = ms[0].astype(ct)
        v = vs[0].astype(ct)
        m = m + (g - m) * (one - b1)
        v = v + (g * g - v) * (one - b2)
        v_hat = np.maximum(v_hats[0].astype(ct), v)
        w = w - lr_t * m / (np.sqrt(v_hat) + eps)
        self._finish(copies, (m, ms), (v, vs), (v_hat, v_hats), (w, copies))

    def _hook_rmsprop(self, copies, vels, moms, avgs, grad, lr, rho, momentum, epsilon, decay):
        ct, one, w, g, (lr, rho, mom, eps) = self._start(copies, grad, decay, lr, rho, momentum, epsilon)
        v = rho * vels[0].astype(ct) + (one - rho) * (g * g)
        out = [(v, vels)]
        if avgs is not None:
            a = rho * avgs[0].astype(ct) + (one - rho) * g
            d = v - a * a + eps
            out.append((a, avgs))
        else:
            d = v + eps
        inc = lr * g / np.sqrt(d)
        if moms is not None:
            mo = mom * moms[0].astype(ct) + inc
            w = w - mo
            out.append((mo, moms))
        else:
            w = w - inc
        self._finish(copies, *out, (w, copies))

    def _hook_adagrad(self, copies, accs, grad, lr, epsilon, decay):
        ct, one, w, g, (lr, eps) = self._start(copies, grad, decay, lr, epsilon)
        acc = accs[0].astype(ct) + g * g
        w = w - lr * g / np.sqrt(acc + eps)
        self._finish(copies, (acc, accs), (w, copies))

    def _hook_adamax(self, copies, ms, us, grad, lr_t, beta_1, beta_2, epsilon, decay):
        ct, one, w, g, (lr_t, b1, b2, eps) = self._start(copies, grad, decay, lr_t, beta_1, beta_2, epsilon)
        m = ms[0].astype(ct)
        m = m + (g - m) * (one - b1)
        u = np.maximum(b2 * us[0].astype(ct), np.abs(g))
        w = w - lr_t * m / (u + eps)
        self._finish(copies, (m, ms), (u, us), (w, copies))

    def _hook_nadam(self, copies, ms, vs, grad, lr, beta_1, beta_2, epsilon, c_m, c_g, c_v, decay):
        ct, one, w, g, (lr, b1, b2, eps, c_m, c_g, c_v) = self._start(
            copies, grad, decay, lr, beta_1, beta_2, epsilon, c_m, c_g, c_v
        )
        m = ms[0].astype(ct)
        v = vs[0].astype(ct)
        m = m + (g - m) * (one - b1)
        v = v + (g * g - v) * (one - b2)
        m_hat = c_m * m + c_g * g
        v_hat = v / c_v
        w = w - m_hat * lr / (np.sqrt(v_hat) + eps)
        self._finish(copies, (m, ms), (v, vs), (w, copies))

    def _hook_lion(self, copies, ms, grad, lr, beta_1, beta_2, decay):
        ct, one, w, g, (lr, b1, b2) = self._start(copies, grad, decay, lr, beta_1, beta_2)
        m = ms[0].astype(ct)
        w = w - lr * np.sign(m * b1 + g * (one - b1))
        m = m * b2 + g * (one - b2)
        self._finish(copies, (m, ms), (w, copies))

    # The fused all-reduce + update hooks are the base class's definition: reduce_to_one into a
    # temporary (the plain sum above), then the update.
