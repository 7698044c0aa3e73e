// cudist CUDA kernels: fused updates of N mirrored copies of a variable (and of its optimizer slots).
//
// Each kernel reads copy 0 (the copies are mirrors, so copy 0 stands for all of them), computes the
// update once and writes it into all n copies in the same pass. The arithmetic is exactly that of
// cudist's NumPy reference (src/cudist/_kernels/_numpy.py): compute type = the dtype, except float16
// which computes in float32 and rounds to nearest even on store; hyper-parameters arrive already
// converted to the compute type; no FMA contraction.
//
// The fused all-reduce + update kernels (mirrored_all_reduce_sgd / _momentum / _adam) first sum
// their n_grads gradients in replica order in T (float16 rounds after every addition), exactly as
// all_reduce_one_shot / reduce_to_one would store the sum, then apply the same update: one pass
// reads the gradients, copy 0 and slot copy 0 and writes every copy.
//
// Like all_reduce.cuh, every kernel has a pointer-table form (CuPy) and a `_packed` by-value form
// (C++ launchers); at most kMaxReplicas copies and kMaxReplicas gradients per launch (the
// launchers broadcast copy 0 to the rest when there are more copies, and pre-reduce the gradients
// when there are more gradients).
//
// T: assign_add: float, double, __half, int, long long; the updates: float, double, __half.
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

// Where an update's gradient comes from: one buffer ...
template <class T>
struct OneGrad {
  const T* p;

  template <int W>
  __device__ __forceinline__ Pack<T, W> get(long long i) const {
    return load<W>(p + i);
  }
  __device__ __forceinline__ bool aligned() const { return aligned16(p); }
};

// ... or the sum of n of them, in replica order in T (the fused all-reduce).
template <class T>
struct SumGrads {
  Ptrs<T> p;
  int n;

  template <int W>
  __device__ __forceinline__ Pack<T, W> get(long long i) const {
    return reduce_packs<T, W>(p, n, 0, i);
  }
  __device__ __forceinline__ bool aligned() const { return all_aligned16(p, n, 0); }
};

// w = w - lr * g
template <class T, class G = OneGrad<T>>
struct Sgd {
  using C = typename compute<T>::type;
  Ptrs<T> copies;
  G grad;
  int n;
  C lr;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> w = load<W>(copies.p[0] + i);
    const Pack<T, W> g = grad.template get<W>(i);
#pragma unroll
    for (int k = 0; k < W; ++k) w.v[k] = from_compute<T>(sub(to_compute(w.v[k]), mul(lr, to_compute(g.v[k]))));
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r)
      if (r < n) store<W>(copies.p[r] + i, w);
  }
};

// v = momentum * v - lr * g;  w = w + (momentum * v - lr * g) (nesterov) or w + v
template <class T, class G = OneGrad<T>>
struct Momentum {
  using C = typename compute<T>::type;
  Ptrs<T> copies, vels;
  G grad;
  int n, nesterov;
  C lr, momentum;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> w = load<W>(copies.p[0] + i);
    Pack<T, W> v = load<W>(vels.p[0] + i);
    const Pack<T, W> g = grad.template get<W>(i);
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
template <class T, class G = OneGrad<T>>
struct Adam {
  using C = typename compute<T>::type;
  Ptrs<T> copies, ms, vs;
  G grad;
  int n;
  C lr_t, beta_1, beta_2, epsilon;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> w = load<W>(copies.p[0] + i);
    Pack<T, W> m = load<W>(ms.p[0] + i);
    Pack<T, W> v = load<W>(vs.p[0] + i);
    const Pack<T, W> g = grad.template get<W>(i);
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
  detail::Sgd<T> f{c, {grad}, n, lr};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::aligned16(grad), f);
}
template <class T>
__global__ void mirrored_sgd_packed(PtrPack<T> copies, int n, const T* grad, typename detail::compute<T>::type lr,
                                    long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n);
  detail::Sgd<T> f{c, {grad}, n, lr};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::aligned16(grad), f);
}

/// SGD with momentum (Keras formulation) on n variable copies and n velocity copies.
template <class T>
__global__ void mirrored_momentum(T* const* copies, T* const* vels, int n, const T* grad,
                                  typename detail::compute<T>::type lr, typename detail::compute<T>::type momentum,
                                  int nesterov, long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n), v = detail::load_ptrs(vels, n);
  detail::Momentum<T> f{c, v, {grad}, n, nesterov, lr, momentum};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::all_aligned16(v, n, 0) &&
                                    detail::aligned16(grad), f);
}
template <class T>
__global__ void mirrored_momentum_packed(PtrPack<T> copies, PtrPack<T> vels, int n, const T* grad,
                                         typename detail::compute<T>::type lr,
                                         typename detail::compute<T>::type momentum, int nesterov, long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n), v = detail::load_ptrs(vels, n);
  detail::Momentum<T> f{c, v, {grad}, n, nesterov, lr, momentum};
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
  detail::Adam<T> f{c, m, v, {grad}, n, lr_t, beta_1, beta_2, epsilon};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::all_aligned16(m, n, 0) &&
                                    detail::all_aligned16(v, n, 0) && detail::aligned16(grad), f);
}
template <class T>
__global__ void mirrored_adam_packed(PtrPack<T> copies, PtrPack<T> ms, PtrPack<T> vs, int n, const T* grad,
                                     typename detail::compute<T>::type lr_t, typename detail::compute<T>::type beta_1,
                                     typename detail::compute<T>::type beta_2,
                                     typename detail::compute<T>::type epsilon, long long count) {
  const detail::Ptrs<T> c = detail::load_ptrs(copies, n), m = detail::load_ptrs(ms, n), v = detail::load_ptrs(vs, n);
  detail::Adam<T> f{c, m, v, {grad}, n, lr_t, beta_1, beta_2, epsilon};
  detail::for_each<T>(0, count, detail::all_aligned16(c, n, 0) && detail::all_aligned16(m, n, 0) &&
                                    detail::all_aligned16(v, n, 0) && detail::aligned16(grad), f);
}

namespace detail {

template <class T>
__device__ __forceinline__ void all_reduce_sgd_body(const Ptrs<T>& c, int n, const Ptrs<T>& g, int n_grads,
                                                    typename compute<T>::type lr, long long count) {
  Sgd<T, SumGrads<T>> f{c, {g, n_grads}, n, lr};
  for_each<T>(0, count, all_aligned16(c, n, 0) && f.grad.aligned(), f);
}

template <class T>
__device__ __forceinline__ void all_reduce_momentum_body(const Ptrs<T>& c, const Ptrs<T>& v, int n, const Ptrs<T>& g,
                                                         int n_grads, typename compute<T>::type lr,
                                                         typename compute<T>::type momentum, int nesterov,
                                                         long long count) {
  Momentum<T, SumGrads<T>> f{c, v, {g, n_grads}, n, nesterov, lr, momentum};
  for_each<T>(0, count, all_aligned16(c, n, 0) && all_aligned16(v, n, 0) && f.grad.aligned(), f);
}

template <class T>
__device__ __forceinline__ void all_reduce_adam_body(const Ptrs<T>& c, const Ptrs<T>& m, const Ptrs<T>& v, int n,
                                                     const Ptrs<T>& g, int n_grads, typename compute<T>::type lr_t,
                                                     typename compute<T>::type beta_1,
                                                     typename compute<T>::type beta_2,
                                                     typename compute<T>::type epsilon, long long count) {
  Adam<T, SumGrads<T>> f{c, m, v, {g, n_grads}, n, lr_t, beta_1, beta_2, epsilon};
  for_each<T>(0, count,
              all_aligned16(c, n, 0) && all_aligned16(m, n, 0) && all_aligned16(v, n, 0) && f.grad.aligned(), f);
}

}  // namespace detail

/// Fused all-reduce + SGD: g = grads[0] + ... + grads[n_grads-1] (replica order, in T), then every
/// one of the n copies becomes copies[0] - lr * g. 1 <= n, n_grads <= kMaxReplicas.
template <class T>
__global__ void mirrored_all_reduce_sgd(T* const* copies, int n, T* const* grads, int n_grads,
                                        typename detail::compute<T>::type lr, long long count) {
  detail::all_reduce_sgd_body<T>(detail::load_ptrs(copies, n), n, detail::load_ptrs(grads, n_grads), n_grads, lr,
                                 count);
}
template <class T>
__global__ void mirrored_all_reduce_sgd_packed(PtrPack<T> copies, int n, PtrPack<T> grads, int n_grads,
                                               typename detail::compute<T>::type lr, long long count) {
  detail::all_reduce_sgd_body<T>(detail::load_ptrs(copies, n), n, detail::load_ptrs(grads, n_grads), n_grads, lr,
                                 count);
}

/// Fused all-reduce + momentum SGD (the gradients summed as in mirrored_all_reduce_sgd).
template <class T>
__global__ void mirrored_all_reduce_momentum(T* const* copies, T* const* vels, int n, T* const* grads, int n_grads,
                                             typename detail::compute<T>::type lr,
                                             typename detail::compute<T>::type momentum, int nesterov,
                                             long long count) {
  detail::all_reduce_momentum_body<T>(detail::load_ptrs(copies, n), detail::load_ptrs(vels, n), n,
                                      detail::load_ptrs(grads, n_grads), n_grads, lr, momentum, nesterov, count);
}
template <class T>
__global__ void mirrored_all_reduce_momentum_packed(PtrPack<T> copies, PtrPack<T> vels, int n, PtrPack<T> grads,
                                                    int n_grads, typename detail::compute<T>::type lr,
                                                    typename detail::compute<T>::type momentum, int nesterov,
                                                    long long count) {
  detail::all_reduce_momentum_body<T>(detail::load_ptrs(copies, n), detail::load_ptrs(vels, n), n,
                                      detail::load_ptrs(grads, n_grads), n_grads, lr, momentum, nesterov, count);
}

/// Fused all-reduce + Adam (the gradients summed as in mirrored_all_reduce_sgd; lr_t bias-corrected).
template <class T>
__global__ void mirrored_all_reduce_adam(T* const* copies, T* const* ms, T* const* vs, int n, T* const* grads,
                                         int n_grads, typename detail::compute<T>::type lr_t,
                                         typename detail::compute<T>::type beta_1,
                                         typename detail::compute<T>::type beta_2,
                                         typename detail::compute<T>::type epsilon, long long count) {
  detail::all_reduce_adam_body<T>(detail::load_ptrs(copies, n), detail::load_ptrs(ms, n), detail::load_ptrs(vs, n), n,
                                  detail::load_ptrs(grads, n_grads), n_grads, lr_t, beta_1, beta_2, epsilon, count);
}
template <class T>
__global__ void mirrored_all_reduce_adam_packed(PtrPack<T> copies, PtrPack<T> ms, PtrPack<T> vs, int n,
                                                PtrPack<T> grads, int n_grads, typename detail::compute<T>::type lr_t,
                                                typename detail::compute<T>::type beta_1,
                                                typename detail::compute<T>::type beta_2,
                                                typename detail::compute<T>::type epsilon, long long count) {
  detail::all_reduce_adam_body<T>(detail::load_ptrs(copies, n), detail::load_ptrs(ms, n), detail::load_ptrs(vs, n), n,
                                  detail::load_ptrs(grads, n_grads), n_grads, lr_t, beta_1, beta_2, epsilon, count);
}

}  // namespace kernels
}  // namespace cudist
