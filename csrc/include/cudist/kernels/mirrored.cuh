// cudist CUDA kernels: fused updates of N mirrored copies of a variable (and of its optimizer slots).
//
// Each kernel reads copy 0 (the copies are mirrors, so copy 0 stands for all of them), computes the
// update once and writes it into all n copies in the same pass. The arithmetic is exactly that of
// cudist's NumPy reference (src/cudist/_kernels/_numpy.py): compute type = the dtype, except float16
// which computes in float32 and rounds to nearest even on store; hyper-parameters arrive already
// converted to the compute type; no FMA contraction.
//
// Like all_reduce.cuh, every kernel has a pointer-table form (CuPy) and a `_packed` by-value form
// (C++ launchers); at most kMaxReplicas copies per launch (the launchers broadcast copy 0 to the
// rest when there are more).
//
// T: assign_add: float, double, __half, int, long long; sgd / momentum / adam: float, double, __half.
#pragma once

#include "common.cuh"

namespace cudist {
namespace kernels {
namespace detail {

// copies[r] = copies[0] +/- value, in the dtype (integers wrap).
template <class T>
struct AssignAdd {
  Ptrs<T> copies;
  const T* value;
  int n, negate;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> w = load<W>(copies.p[0] + i);
    const Pack<T, W> x = load<W>(value + i);
    if (negate) {
#pragma unroll
      for (int k = 0; k < W; ++k) w.v[k] = sub(w.v[k], x.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) w.v[k] = add(w.v[k], x.v[k]);
    }
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r)
      if (r < n) store<W>(copies.p[r] + i, w);
  }
};

// w = w - lr * g
template <class T>
struct Sgd {
  using C = typename compute<T>::type;
  Ptrs<T> copies;
  const T* grad;
  int n;
  C lr;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> w = load<W>(copies.p[0] + i);
    const Pack<T, W> g = load<W>(grad + i);
#pragma unroll
    for (int k = 0; k < W; ++k) w.v[k] = from_compute<T>(sub(to_compute(w.v[k]), mul(lr, to_compute(g.v[k]))));
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r)
      if (r < n) store<W>(copies.p[r] + i, w);
  }
};

// v = momentum * v - lr * g;  w = w + (momentum * v - lr * g) (nesterov) or w + v
template <class T>
struct Momentum {
  using C = typename compute<T>::type;
  Ptrs<T> copies, vels;
  const T* grad;
  int n, nesterov;
  C lr, momentum;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> w = load<W>(copies.p[0] + i);
    Pack<T, W> v = load<W>(vels.p[0] + i);
    const Pack<T, W> g = load<W>(grad + i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const C gk = to_compute(g.v[k]);
      const C lr_g = mul(lr, gk);
      const C vk = sub(mul(momentum, to_compute(v.v[k])), lr_g);
      const C wk = to_compute(w.v[k]);
      // The velocity used for the weight is the unrounded compute-type one, as in the reference.
      const C wn = nesterov ? add(wk, sub(mul(momentum, vk), lr_g)) : add(wk, vk);
      v.v[k] = from_compute<T>(vk);
      w.v[k] = from_compute<T>(wn);
    }
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r) {
      if (r < n) {
        store<W>(vels.p[r] + i, v);
        store<W>(copies.p[r] + i, w);
      }
    }
  }
};

// m += (g - m) * (1 - beta_1);  v += (g*g - v) * (1 - beta_2);  w -= lr_t * m / (sqrt(v) + epsilon)
template <class T>
struct Adam {
  using C = typename compute<T>::type;
  Ptrs<T> copies, ms, vs;
  const T* grad;
  int n;
  C lr_t, beta_1, beta_2, epsilon;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> w = load<W>(copies.p[0] + i);
    Pack<T, W> m = load<W>(ms.p[0] + i);
    Pack<T, W> v = load<W>(vs.p[0] + i);
    const Pack<T, W> g = load<W>(grad + i);
    // (1 - beta) in the compute type, as the reference computes it (not folded on the host).
    const C one = C(1);
    const C omb1 = sub(one, beta_1);
    const C omb2 = sub(one, beta_2);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const C gk = to_compute(g.v[k]);
      C mk = to_compute(m.v[k]);
      C vk = to_compute(v.v[k]);
      mk = add(mk, mul(sub(gk, mk), omb1));
      vk = add(vk, mul(sub(mul(gk, gk), vk), omb2));
      const C wk = sub(to_compute(w.v[k]), div(mul(lr_t, mk), add(sqrt_rn(vk), epsilon)));
      m.v[k] = from_compute<T>(mk);
      v.v[k] = from_compute<T>(vk);
      w.v[k] = from_compute<T>(wk);
    }
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r) {
      if (r < n) {
        store<W>(ms.p[r] + i, m);
        store<W>(vs.p[r] + i, v);
        store<W>(copies.p[r] + i, w);
      }
    }
  }
};

}  // namespace detail

/// Every copy becomes copies[0] + value (negate = 0) or copies[0] - value (negate != 0).
template <class T>
__global__ void mirrored_assign_add(T* const* copies, int n, const T* value, long long count, int negate) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n);
  detail::AssignAdd<T> f{c, value, n, negate};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::aligned16(value), f);
}
template <class T>
__global__ void mirrored_assign_add_packed(PtrPack<T> copies, int n, const T* value, long long count, int negate) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n);
  detail::AssignAdd<T> f{c, value, n, negate};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::aligned16(value), f);
}

/// Plain SGD on n copies.
template <class T>
__global__ void mirrored_sgd(T* const* copies, int n, const T* grad, typename detail::compute<T>::type lr,
                             long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n);
  detail::Sgd<T> f{c, grad, n, lr};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::aligned16(grad), f);
}
template <class T>
__global__ void mirrored_sgd_packed(PtrPack<T> copies, int n, const T* grad, typename detail::compute<T>::type lr,
                                    long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n);
  detail::Sgd<T> f{c, grad, n, lr};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::aligned16(grad), f);
}

/// SGD with momentum (Keras formulation) on n variable copies and n velocity copies.
template <class T>
__global__ void mirrored_momentum(T* const* copies, T* const* vels, int n, const T* grad,
                                  typename detail::compute<T>::type lr, typename detail::compute<T>::type momentum,
                                  int nesterov, long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n), v = detail::load_ptrs(vels, n);
  detail::Momentum<T> f{c, v, grad, n, nesterov, lr, momentum};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::all_aligned16(v, n, 0) &&
                                    detail::aligned16(grad), f);
}
template <class T>
__global__ void mirrored_momentum_packed(PtrPack<T> copies, PtrPack<T> vels, int n, const T* grad,
                                         typename detail::compute<T>::type lr,
                                         typename detail::compute<T>::type momentum, int nesterov, long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n), v = detail::load_ptrs(vels, n);
  detail::Momentum<T> f{c, v, grad, n, nesterov, lr, momentum};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::all_aligned16(v, n, 0) &&
                                    detail::aligned16(grad), f);
}

/// Adam (Keras formulation) on n copies of the variable and of its m and v slots; lr_t is the
/// bias-corrected step size lr * sqrt(1 - beta_2^t) / (1 - beta_1^t), computed by the caller.
template <class T>
__global__ void mirrored_adam(T* const* copies, T* const* ms, T* const* vs, int n, const T* grad,
                              typename detail::compute<T>::type lr_t, typename detail::compute<T>::type beta_1,
                              typename detail::compute<T>::type beta_2, typename detail::compute<T>::type epsilon,
                              long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n), m = detail::load_ptrs(ms, n), v = detail::load_ptrs(vs, n);
  detail::Adam<T> f{c, m, v, grad, n, lr_t, beta_1, beta_2, epsilon};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::all_aligned16(m, n, 0) &&
                                    detail::all_aligned16(v, n, 0) && detail::aligned16(grad), f);
}
template <class T>
__global__ void mirrored_adam_packed(PtrPack<T> copies, PtrPack<T> ms, PtrPack<T> vs, int n, const T* grad,
                                     typename detail::compute<T>::type lr_t, typename detail::compute<T>::type beta_1,
                                     typename detail::compute<T>::type beta_2,
                                     typename detail::compute<T>::type epsilon, long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n), m = detail::load_ptrs(ms, n), v = detail::load_ptrs(vs, n);
  detail::Adam<T> f{c, m, v, grad, n, lr_t, beta_1, beta_2, epsilon};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::all_aligned16(m, n, 0) &&
                                    detail::all_aligned16(v, n, 0) && detail::aligned16(grad), f);
}

}  // namespace kernels
}  // namespace cudist
