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
// AdamW, RMSprop, Adagrad, Adamax, Nadam and Lion have the fused form only (mirrored_all_reduce_*);
// their plain update is that kernel with one gradient.
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

// ---------------------------------------------------------------------------------------------
// AdamW, RMSprop, Adagrad, Adamax, Nadam, Lion: one kernel each (pointer-table and `_packed`
// forms), the fused all-reduce form; the plain update is the same kernel with one gradient. The
// arithmetic is that of the NumPy reference (`_hook_adamw` ... in _numpy.py): the decoupled weight
// decay w - w * decay first (skipped when decay is 0), then the update, in the compute type.

namespace detail {

template <class C>
__device__ __forceinline__ C decayed(C w, C decay) {
  return decay != C(0) ? sub(w, mul(w, decay)) : w;
}
__device__ __forceinline__ float abs_c(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_c(double x) { return fabs(x); }
// NumPy's maximum (a NaN wins; of equal values the second) and sign (+0 for zeros, NaN kept).
template <class C>
__device__ __forceinline__ C np_maximum(C a, C b) {
  return (a > b || a != a) ? a : b;
}
template <class C>
__device__ __forceinline__ C np_sign(C x) {
  return x > C(0) ? C(1) : (x < C(0) ? C(-1) : (x == C(0) ? C(0) : x));
}

// A fused update of NS buffer groups (the slots, then the variable's copies last): copy 0 of each
// read, `rule(g, x)` turns the compute-type values into the new ones, every copy written.
template <class T, int NS, class Rule, class G>
struct RuleUpdate {
  using C = typename compute<T>::type;
  Ptrs<T> s[NS];
  G grad;
  int n;
  Rule rule;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> x[NS];
#pragma unroll
    for (int j = 0; j < NS; ++j) x[j] = load<W>(s[j].p[0] + i);
    const Pack<T, W> g = grad.template get<W>(i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      C c[NS];
#pragma unroll
      for (int j = 0; j < NS; ++j) c[j] = to_compute(x[j].v[k]);
      rule(to_compute(g.v[k]), c);
#pragma unroll
      for (int j = 0; j < NS; ++j) x[j].v[k] = from_compute<T>(c[j]);
    }
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r) {
      if (r < n) {
#pragma unroll
        for (int j = 0; j < NS; ++j) store<W>(s[j].p[r] + i, x[j]);
      }
    }
  }

  __device__ __forceinline__ bool aligned() const {
    bool ok = grad.aligned();
#pragma unroll
    for (int j = 0; j < NS; ++j) ok = ok && all_aligned16(s[j], n, 0);
    return ok;
  }
};

template <class T, int NS, class Rule>
__device__ __forceinline__ void run_rule(const Ptrs<T> (&s)[NS], int n, const Ptrs<T>& g, int n_grads, const Rule& rule,
                                         long long count) {
  RuleUpdate<T, NS, Rule, SumGrads<T>> f{{}, {g, n_grads}, n, rule};
#pragma unroll
  for (int j = 0; j < NS; ++j) f.s[j] = s[j];
  for_each<T>(0, count, f.aligned(), f);
}

// m += (g - m) * c1;  v += (g*g - v) * c2;  w = decayed(w) - lr_t * m / (sqrt(v) + epsilon)
template <class C>
struct AdamWRule {
  C lr_t, c1, c2, epsilon, decay;
  __device__ __forceinline__ void operator()(C g, C (&x)[3]) const {
    const C m = add(x[0], mul(sub(g, x[0]), c1));
    const C v = add(x[1], mul(sub(mul(g, g), x[1]), c2));
    x[2] = sub(decayed(x[2], decay), div(mul(lr_t, m), add(sqrt_rn(v), epsilon)));
    x[0] = m;
    x[1] = v;
  }
};

// acc += g*g;  w = decayed(w) - lr * g / sqrt(acc + epsilon)
template <class C>
struct AdagradRule {
  C lr, epsilon, decay;
  __device__ __forceinline__ void operator()(C g, C (&x)[2]) const {
    x[0] = add(x[0], mul(g, g));
    x[1] = sub(decayed(x[1], decay), div(mul(lr, g), sqrt_rn(add(x[0], epsilon))));
  }
};

// m += (g - m) * c1;  u = maximum(beta_2 * u, |g|);  w = decayed(w) - lr_t * m / (u + epsilon)
template <class C>
struct AdamaxRule {
  C lr_t, c1, beta_2, epsilon, decay;
  __device__ __forceinline__ void operator()(C g, C (&x)[3]) const {
    x[0] = add(x[0], mul(sub(g, x[0]), c1));
    x[1] = np_maximum(mul(beta_2, x[1]), abs_c(g));
    x[2] = sub(decayed(x[2], decay), div(mul(lr_t, x[0]), add(x[1], epsilon)));
  }
};

// m, v as Adam; m_hat = c_m * m + c_g * g;  v_hat = v / c_v;  w = decayed(w) - m_hat * lr / (sqrt(v_hat) + epsilon)
template <class C>
struct NadamRule {
  C lr, c1, c2, epsilon, c_m, c_g, c_v, decay;
  __device__ __forceinline__ void operator()(C g, C (&x)[3]) const {
    x[0] = add(x[0], mul(sub(g, x[0]), c1));
    x[1] = add(x[1], mul(sub(mul(g, g), x[1]), c2));
    const C m_hat = add(mul(c_m, x[0]), mul(c_g, g));
    const C v_hat = div(x[1], c_v);
    x[2] = sub(decayed(x[2], decay), div(mul(m_hat, lr), add(sqrt_rn(v_hat), epsilon)));
  }
};

// w = decayed(w) - lr * sign(m * beta_1 + g * c1);  m = m * beta_2 + g * c2
template <class C>
struct LionRule {
  C lr, beta_1, beta_2, c1, c2, decay;
  __device__ __forceinline__ void operator()(C g, C (&x)[2]) const {
    x[1] = sub(decayed(x[1], decay), mul(lr, np_sign(add(mul(x[0], beta_1), mul(g, c1)))));
    x[0] = add(mul(x[0], beta_2), mul(g, c2));
  }
};

// RMSprop: the momentum and average-gradient slots are optional (runtime flags), so not a RuleUpdate.
template <class T, class G>
struct Rmsprop {
  using C = typename compute<T>::type;
  Ptrs<T> copies, vels, moms, avgs;
  G grad;
  int n, has_momentum, centered;
  C lr, rho, omr, momentum, epsilon, decay;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    Pack<T, W> w = load<W>(copies.p[0] + i);
    Pack<T, W> v = load<W>(vels.p[0] + i);
    Pack<T, W> mo{}, a{};
    if (has_momentum) mo = load<W>(moms.p[0] + i);
    if (centered) a = load<W>(avgs.p[0] + i);
    const Pack<T, W> g = grad.template get<W>(i);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const C gk = to_compute(g.v[k]);
      const C vk = add(mul(rho, to_compute(v.v[k])), mul(omr, mul(gk, gk)));
      C d;
      if (centered) {
        const C ak = add(mul(rho, to_compute(a.v[k])), mul(omr, gk));
        d = add(sub(vk, mul(ak, ak)), epsilon);
        a.v[k] = from_compute<T>(ak);
      } else {
        d = add(vk, epsilon);
      }
      const C inc = div(mul(lr, gk), sqrt_rn(d));
      C wk = decayed(to_compute(w.v[k]), decay);
      if (has_momentum) {
        const C mk = add(mul(momentum, to_compute(mo.v[k])), inc);
        wk = sub(wk, mk);
        mo.v[k] = from_compute<T>(mk);
      } else {
        wk = sub(wk, inc);
      }
      v.v[k] = from_compute<T>(vk);
      w.v[k] = from_compute<T>(wk);
    }
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r) {
      if (r < n) {
        store<W>(vels.p[r] + i, v);
        if (has_momentum) store<W>(moms.p[r] + i, mo);
        if (centered) store<W>(avgs.p[r] + i, a);
        store<W>(copies.p[r] + i, w);
      }
    }
  }
};

template <class T>
__device__ __forceinline__ void rmsprop_body(const Ptrs<T>& c, const Ptrs<T>& v, const Ptrs<T>& mo, const Ptrs<T>& a,
                                             int n, const Ptrs<T>& g, int n_grads, typename compute<T>::type lr,
                                             typename compute<T>::type rho, typename compute<T>::type momentum,
                                             typename compute<T>::type epsilon, typename compute<T>::type decay,
                                             int has_momentum, int centered, long long count) {
  using C = typename compute<T>::type;
  Rmsprop<T, SumGrads<T>> f{c, v, mo, a, {g, n_grads}, n, has_momentum, centered,
                            lr, rho, sub(C(1), rho), momentum, epsilon, decay};
  const bool ok = all_aligned16(c, n, 0) && all_aligned16(v, n, 0) && (!has_momentum || all_aligned16(mo, n, 0)) &&
                  (!centered || all_aligned16(a, n, 0)) && f.grad.aligned();
  for_each<T>(0, count, ok, f);
}

}  // namespace detail

// The table form takes device arrays of pointers (CuPy), the `_packed` form PtrPacks by value (the
// C++ launchers); 1 <= n, n_grads <= kMaxReplicas. Hyper-parameters in the compute type.

/// Fused all-reduce + AdamW: g = the sum of the n_grads gradients (replica order, in T), then
/// w -= w * decay and Adam with the bias-corrected lr_t on the n copies and the m and v slots.
template <class T>
__global__ void mirrored_all_reduce_adamw(T* const* copies, T* const* ms, T* const* vs, int n, T* const* grads,
                                          int n_grads, typename detail::compute<T>::type lr_t,
                                          typename detail::compute<T>::type beta_1,
                                          typename detail::compute<T>::type beta_2,
                                          typename detail::compute<T>::type epsilon,
                                          typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[3] = {detail::load_ptrs(ms, n), detail::load_ptrs(vs, n), detail::load_ptrs(copies, n)};
  const detail::AdamWRule<C> rule{lr_t, detail::sub(C(1), beta_1), detail::sub(C(1), beta_2), epsilon, decay};
  detail::run_rule<T, 3>(s, n, detail::load_ptrs(grads, n_grads), n_grads, rule, count);
}
template <class T>
__global__ void mirrored_all_reduce_adamw_packed(PtrPack<T> copies, PtrPack<T> ms, PtrPack<T> vs, int n,
                                                 PtrPack<T> grads, int n_grads, typename detail::compute<T>::type lr_t,
                                                 typename detail::compute<T>::type beta_1,
                                                 typename detail::compute<T>::type beta_2,
                                                 typename detail::compute<T>::type epsilon,
                                                 typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[3] = {detail::load_ptrs(ms, n), detail::load_ptrs(vs, n), detail::load_ptrs(copies, n)};
  const detail::AdamWRule<C> rule{lr_t, detail::sub(C(1), beta_1), detail::sub(C(1), beta_2), epsilon, decay};
  detail::run_rule<T, 3>(s, n, detail::load_ptrs(grads, n_grads), n_grads, rule, count);
}

/// Fused all-reduce + RMSprop (Keras formulation); the momentum slot is used when has_momentum,
/// the average-gradient slot when centered (otherwise their pointers are not read).
template <class T>
__global__ void mirrored_all_reduce_rmsprop(T* const* copies, T* const* vels, T* const* moms, T* const* avgs, int n,
                                            T* const* grads, int n_grads, typename detail::compute<T>::type lr,
                                            typename detail::compute<T>::type rho,
                                            typename detail::compute<T>::type momentum,
                                            typename detail::compute<T>::type epsilon,
                                            typename detail::compute<T>::type decay, int has_momentum, int centered,
                                            long long count) {
  const detail::Ptrs<T> none{};
  detail::rmsprop_body<T>(detail::load_ptrs(copies, n), detail::load_ptrs(vels, n),
                          has_momentum ? detail::load_ptrs(moms, n) : none, centered ? detail::load_ptrs(avgs, n) : none,
                          n, detail::load_ptrs(grads, n_grads), n_grads, lr, rho, momentum, epsilon, decay,
                          has_momentum, centered, count);
}
template <class T>
__global__ void mirrored_all_reduce_rmsprop_packed(PtrPack<T> copies, PtrPack<T> vels, PtrPack<T> moms,
                                                   PtrPack<T> avgs, int n, PtrPack<T> grads, int n_grads,
                                                   typename detail::compute<T>::type lr,
                                                   typename detail::compute<T>::type rho,
                                                   typename detail::compute<T>::type momentum,
                                                   typename detail::compute<T>::type epsilon,
                                                   typename detail::compute<T>::type decay, int has_momentum,
                                                   int centered, long long count) {
  detail::rmsprop_body<T>(detail::load_ptrs(copies, n), detail::load_ptrs(vels, n), detail::load_ptrs(moms, n),
                          detail::load_ptrs(avgs, n), n, detail::load_ptrs(grads, n_grads), n_grads, lr, rho, momentum,
                          epsilon, decay, has_momentum, centered, count);
}

/// Fused all-reduce + Adagrad: acc += g*g; w = w - w * decay - lr * g / sqrt(acc + epsilon).
template <class T>
__global__ void mirrored_all_reduce_adagrad(T* const* copies, T* const* accs, int n, T* const* grads, int n_grads,
                                            typename detail::compute<T>::type lr,
                                            typename detail::compute<T>::type epsilon,
                                            typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[2] = {detail::load_ptrs(accs, n), detail::load_ptrs(copies, n)};
  detail::run_rule<T, 2>(s, n, detail::load_ptrs(grads, n_grads), n_grads, detail::AdagradRule<C>{lr, epsilon, decay},
                         count);
}
template <class T>
__global__ void mirrored_all_reduce_adagrad_packed(PtrPack<T> copies, PtrPack<T> accs, int n, PtrPack<T> grads,
                                                   int n_grads, typename detail::compute<T>::type lr,
                                                   typename detail::compute<T>::type epsilon,
                                                   typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[2] = {detail::load_ptrs(accs, n), detail::load_ptrs(copies, n)};
  detail::run_rule<T, 2>(s, n, detail::load_ptrs(grads, n_grads), n_grads, detail::AdagradRule<C>{lr, epsilon, decay},
                         count);
}

/// Fused all-reduce + Adamax with lr_t = lr / (1 - beta_1^step).
template <class T>
__global__ void mirrored_all_reduce_adamax(T* const* copies, T* const* ms, T* const* us, int n, T* const* grads,
                                           int n_grads, typename detail::compute<T>::type lr_t,
                                           typename detail::compute<T>::type beta_1,
                                           typename detail::compute<T>::type beta_2,
                                           typename detail::compute<T>::type epsilon,
                                           typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[3] = {detail::load_ptrs(ms, n), detail::load_ptrs(us, n), detail::load_ptrs(copies, n)};
  const detail::AdamaxRule<C> rule{lr_t, detail::sub(C(1), beta_1), beta_2, epsilon, decay};
  detail::run_rule<T, 3>(s, n, detail::load_ptrs(grads, n_grads), n_grads, rule, count);
}
template <class T>
__global__ void mirrored_all_reduce_adamax_packed(PtrPack<T> copies, PtrPack<T> ms, PtrPack<T> us, int n,
                                                  PtrPack<T> grads, int n_grads,
                                                  typename detail::compute<T>::type lr_t,
                                                  typename detail::compute<T>::type beta_1,
                                                  typename detail::compute<T>::type beta_2,
                                                  typename detail::compute<T>::type epsilon,
                                                  typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[3] = {detail::load_ptrs(ms, n), detail::load_ptrs(us, n), detail::load_ptrs(copies, n)};
  const detail::AdamaxRule<C> rule{lr_t, detail::sub(C(1), beta_1), beta_2, epsilon, decay};
  detail::run_rule<T, 3>(s, n, detail::load_ptrs(grads, n_grads), n_grads, rule, count);
}

/// Fused all-reduce + Nadam (Keras 3) with the step's coefficients c_m, c_g, c_v (cudist's nadam_step).
template <class T>
__global__ void mirrored_all_reduce_nadam(T* const* copies, T* const* ms, T* const* vs, int n, T* const* grads,
                                          int n_grads, typename detail::compute<T>::type lr,
                                          typename detail::compute<T>::type beta_1,
                                          typename detail::compute<T>::type beta_2,
                                          typename detail::compute<T>::type epsilon,
                                          typename detail::compute<T>::type c_m, typename detail::compute<T>::type c_g,
                                          typename detail::compute<T>::type c_v,
                                          typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[3] = {detail::load_ptrs(ms, n), detail::load_ptrs(vs, n), detail::load_ptrs(copies, n)};
  const detail::NadamRule<C> rule{lr, detail::sub(C(1), beta_1), detail::sub(C(1), beta_2), epsilon, c_m, c_g, c_v,
                                  decay};
  detail::run_rule<T, 3>(s, n, detail::load_ptrs(grads, n_grads), n_grads, rule, count);
}
template <class T>
__global__ void mirrored_all_reduce_nadam_packed(PtrPack<T> copies, PtrPack<T> ms, PtrPack<T> vs, int n,
                                                 PtrPack<T> grads, int n_grads, typename detail::compute<T>::type lr,
                                                 typename detail::compute<T>::type beta_1,
                                                 typename detail::compute<T>::type beta_2,
                                                 typename detail::compute<T>::type epsilon,
                                                 typename detail::compute<T>::type c_m,
                                                 typename detail::compute<T>::type c_g,
                                                 typename detail::compute<T>::type c_v,
                                                 typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[3] = {detail::load_ptrs(ms, n), detail::load_ptrs(vs, n), detail::load_ptrs(copies, n)};
  const detail::NadamRule<C> rule{lr, detail::sub(C(1), beta_1), detail::sub(C(1), beta_2), epsilon, c_m, c_g, c_v,
                                  decay};
  detail::run_rule<T, 3>(s, n, detail::load_ptrs(grads, n_grads), n_grads, rule, count);
}

/// Fused all-reduce + Lion: w = w - w * decay - lr * sign(m * beta_1 + g * (1 - beta_1));
/// m = m * beta_2 + g * (1 - beta_2).
template <class T>
__global__ void mirrored_all_reduce_lion(T* const* copies, T* const* ms, int n, T* const* grads, int n_grads,
                                         typename detail::compute<T>::type lr, typename detail::compute<T>::type beta_1,
                                         typename detail::compute<T>::type beta_2,
                                         typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[2] = {detail::load_ptrs(ms, n), detail::load_ptrs(copies, n)};
  const detail::LionRule<C> rule{lr, beta_1, beta_2, detail::sub(C(1), beta_1), detail::sub(C(1), beta_2), decay};
  detail::run_rule<T, 2>(s, n, detail::load_ptrs(grads, n_grads), n_grads, rule, count);
}
template <class T>
__global__ void mirrored_all_reduce_lion_packed(PtrPack<T> copies, PtrPack<T> ms, int n, PtrPack<T> grads,
                                                int n_grads, typename detail::compute<T>::type lr,
                                                typename detail::compute<T>::type beta_1,
                                                typename detail::compute<T>::type beta_2,
                                                typename detail::compute<T>::type decay, long long count) {
  using C = typename detail::compute<T>::type;
  const detail::Ptrs<T> s[2] = {detail::load_ptrs(ms, n), detail::load_ptrs(copies, n)};
  const detail::LionRule<C> rule{lr, beta_1, beta_2, detail::sub(C(1), beta_1), detail::sub(C(1), beta_2), decay};
  detail::run_rule<T, 2>(s, n, detail::load_ptrs(grads, n_grads), n_grads, rule, count);
}

}  // namespace kernels
}  // namespace cudist
