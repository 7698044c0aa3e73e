// cudist CUDA kernels: fused updates of N mirrored copies of a variable (and of its optimizer slots).
//
// Each kernel reads copy 0 (the copies are mirrors, so copy 0 stands for all of them), computes the
// update once and writes it into all n copies in the same pass. The arithmetic is exactly that of
// cudist's NumPy reference (src/cudist/_kernels/_numpy.py): compute type = the dtype, except float16
// which computes in float32 and rounds to nearest even on store; hyper-parameters arrive already
// converted to the compute type; no FMA contraction.
//
// The fused all-reduce + update kernels (mirrored_all_reduce_<rule>) first sum
// their n_grads gradients in replica order in T (float16: in float32, rounded once), exactly as
// all_reduce_one_shot / reduce_to_one would store the sum, then apply the same update: one pass
// reads the gradients, copy 0 and slot copy 0 and writes every copy.
//
// Like all_reduce.cuh, every kernel has a pointer-table form (CuPy) and a `_packed` by-value form
// (C++ launchers); at most kMaxReplicas copies and kMaxReplicas gradients per launch (the
// launchers broadcast copy 0 to the rest when there are more copies, and pre-reduce the gradients
// when there are more gradients).
//
// The optimizers of CUDIST_UPDATE_RULE_LIST (<cudist/detail/update_rules.hpp>) have the fused form
// only (mirrored_all_reduce_*); their plain update is that kernel with one gradient.
//
// Every update's per-element arithmetic is its rule in <cudist/detail/update_rules.hpp>, shared with
// the host kernels (<cudist/updates.hpp>); the kernels here only load, call the rule and store
// (RuleUpdate); a rule's variants are rows of the table of their own (picked by the caller).
//
// T: assign_add: float, double, __half, int, long long, __nv_bfloat16; the updates: float, double,
// __half, __nv_bfloat16 (computed in float32 and rounded once per stored value, as float16 is).
// G (the fused all-reduce kernels' gradients): T, or __half / __nv_bfloat16 for float copies.
#pragma once

#include "common.cuh"
#include "../detail/update_rules.hpp"

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

// ... or the sum of n of them, in replica order (float16 in float32, rounded once; the fused all-reduce).
// G: the gradients' type, T's, or a 16-bit float for float32 copies (mixed precision): widened
// exactly while summed in float32, the bits of casting each gradient to float32 first.
template <class T, class G = T>
struct SumGrads {
  Ptrs<G> p;
  int n;

  template <int W>
  __device__ __forceinline__ Pack<T, W> get(long long i) const {
    return reduce_packs<T, W>(p, n, 0, i);
  }
  __device__ __forceinline__ bool aligned() const { return all_aligned16(p, n, 0); }
};

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
    bool ok = true;
#pragma unroll
    for (int j = 0; j < NS; ++j) ok = ok && all_aligned16(s[j], n, 0);
    return ok && grad.aligned();
  }
};

// The device arithmetic of the shared rules (<cudist/detail/update_rules.hpp>): the helpers above,
// which round like NumPy whatever flags the kernels are compiled with.
struct device_math {
  template <class C>
  static __device__ __forceinline__ C add(C a, C b) { return detail::add(a, b); }
  template <class C>
  static __device__ __forceinline__ C sub(C a, C b) { return detail::sub(a, b); }
  template <class C>
  static __device__ __forceinline__ C mul(C a, C b) { return detail::mul(a, b); }
  template <class C>
  static __device__ __forceinline__ C div(C a, C b) { return detail::div(a, b); }
  template <class C>
  static __device__ __forceinline__ C sqrt(C a) { return sqrt_rn(a); }
  template <class C>
  static __device__ __forceinline__ C maximum(C a, C b) { return np_maximum(a, b); }
  template <class C>
  static __device__ __forceinline__ C abs(C a) { return abs_c(a); }
  template <class C>
  static __device__ __forceinline__ C sign(C a) { return np_sign(a); }
};

// The weight decay of the rules: w - w * decay, skipped when decay is 0 (as the reference does).
template <class C>
struct Decayed {
  C decay;
  __device__ __forceinline__ C operator()(C w) const { return decayed(w, decay); }
};

// A shared rule bound to its weight decay, called as RuleUpdate calls a rule.
template <class R, class Dec>
struct Bound {
  R rule;
  Dec dec;
  template <class C, int N>
  __device__ __forceinline__ void operator()(C g, C (&x)[N]) const {
    rule(g, x, dec);
  }
};

// Runs rule Rule (of update_rules.hpp) over the slot groups then the copies `s`, the gradient from
// `grad` (OneGrad or SumGrads), `dec` the weight decay (Decayed, or rules::no_decay for the
// optimizers without one); `hyper` in the compute type.
template <template <class, class> class Rule, class T, int NS, class G, class Dec, class... H>
__device__ __forceinline__ void run_rule_from(const Ptrs<T> (&s)[NS], int n, const G& grad, const Dec& dec,
                                              long long count, H... hyper) {
  using C = typename compute<T>::type;
  using R = Rule<C, device_math>;
  static_assert(R::kSlots + 1 == NS && R::kHyper == sizeof...(H), "a rule's slots or hyper-parameters mismatch");
  RuleUpdate<T, NS, Bound<R, Dec>, G> f{{}, grad, n, {R(hyper...), dec}};
#pragma unroll
  for (int j = 0; j < NS; ++j) f.s[j] = s[j];
  for_each<T>(0, count, f.aligned(), f);
}

// Runs rule Rule over `s` from the sum of the n_grads gradients, `decay` the weight decay (0: none).
template <template <class, class> class Rule, class T, int NS, class G, class... H>
__device__ __forceinline__ void run_shared_rule(const Ptrs<T> (&s)[NS], int n, const Ptrs<G>& g, int n_grads,
                                                typename compute<T>::type decay, long long count, H... hyper) {
  using C = typename compute<T>::type;
  run_rule_from<Rule, T, NS>(s, n, SumGrads<T, G>{g, n_grads}, Decayed<C>{decay}, count, hyper...);
}

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

namespace detail {

// LossScaleOptimizer's reduction: out = the sum of the gradients (SumGrads: as the fused updates
// sum them) divided by `scale` in the compute type, rounded once; *flag = 1 where a stored value is
// inf or NaN (every thread that sees one stores the same 1: no atomics; never cleared here).
template <class T, class G>
struct UnscaleFinite {
  using C = typename compute<T>::type;
  SumGrads<T, G> grads;
  T* out;
  C scale;
  int* flag;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    const Pack<T, W> g = grads.template get<W>(i);
    Pack<T, W> o;
    bool ok = true;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      o.v[k] = from_compute<T>(div(to_compute(g.v[k]), scale));
      const C y = to_compute(o.v[k]);
      ok = ok && sub(y, y) == C(0);  // false for inf and NaN only (as the host kernel tests it)
    }
    store<W>(out + i, o);
    if (!ok) *flag = 1;
  }
  __device__ __forceinline__ bool aligned() const { return grads.aligned() && aligned16(out); }
};

}  // namespace detail

/// LossScaleOptimizer's step: ``out`` = (the sum of the n_grads gradients, in replica order as the
/// fused updates sum them: float16 in float32 rounded once, bfloat16 / float16 gradients of float32
/// copies widened exactly) / ``scale`` in the compute type, and ``*flag`` = 1 when some stored
/// element is inf or NaN (left as it was otherwise): the finiteness check in the pass that reads
/// the gradients, the bits of the host ``cudist::reduce_unscale_finite``. 1 <= n_grads <=
/// kMaxReplicas; ``out`` overlaps no gradient; one flag may serve many launches (read it once).
template <class T, class G = T>
__global__ void reduce_unscale_finite(G* const* grads, int n_grads, T* out, long long count,
                                      typename detail::compute<T>::type scale, int* flag) {
  detail::UnscaleFinite<T, G> f{{detail::load_ptrs(grads, n_grads), n_grads}, out, scale, flag};
  detail::for_each<T>(0, count, f.aligned(), f);
}
template <class T, class G = T>
__global__ void reduce_unscale_finite_packed(PtrPack<G> grads, int n_grads, T* out, long long count,
                                             typename detail::compute<T>::type scale, int* flag) {
  detail::UnscaleFinite<T, G> f{{detail::load_ptrs(grads, n_grads), n_grads}, out, scale, flag};
  detail::for_each<T>(0, count, f.aligned(), f);
}

// ---------------------------------------------------------------------------------------------
// The rules' table: one kernel each (pointer-table and `_packed` forms, 1 <= n, n_grads <=
// kMaxReplicas), the fused all-reduce form; the plain update is the same kernel with one gradient.
// The arithmetic is that of the NumPy reference (its `_hook_<name>` in _numpy.py): the decoupled
// weight decay w - w * decay first (skipped when decay is 0), then the update, in the compute type.

/// Fused all-reduce + the rule of each row of CUDIST_UPDATE_RULE_LIST (<cudist/detail/update_rules.hpp>):
/// ``mirrored_all_reduce_<name>(copies, <slot>s..., n, grads, n_grads, hyper..., decay, count)``:
/// g = the sum of the n_grads gradients (replica order, in T), then w -= w * decay (skipped when
/// decay is 0) and the rule on the n copies of the variable and of its slots; hyper-parameters in
/// the compute type. Generated so that a rule is named once in C++: each pair is the same code a
/// hand-written kernel would be (the slots then the copies). A rule with optional slots has a
/// row, so a kernel, per combination of them (each with its slots fixed, so that its values stay in
/// registers: one kernel that took them all and branched on flags kept every group's pointers live).
#define CUDIST_RULE_KERNEL_HYPER_(A, h) typename detail::compute<T>::type h,
#define CUDIST_RULE_KERNEL_LOAD_(A, slot) detail::load_ptrs(slot##s, n),
#define CUDIST_RULE_KERNEL_(P, GP, suffix, name, rule, slots, hyper)                                               \
  template <class T, class G = T>                                                                                \
  __global__ void mirrored_all_reduce_##name##suffix(                                                            \
      P copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, P, slots) int n, GP grads, int n_grads,                         \
      CUDIST_PP_MAP(CUDIST_RULE_KERNEL_HYPER_, ~, hyper) typename detail::compute<T>::type decay, long long count) { \
    const detail::Ptrs<T> s[] = {CUDIST_PP_MAP(CUDIST_RULE_KERNEL_LOAD_, ~, slots) detail::load_ptrs(copies, n)};  \
    detail::run_shared_rule<rules::rule>(s, n, detail::load_ptrs(grads, n_grads), n_grads, decay,                  \
                                         count CUDIST_PP_MAP(CUDIST_PP_LEAD, , hyper));                          \
  }
#define CUDIST_RULE_KERNELS_(A, name, rule, slots, hyper)             \
  CUDIST_RULE_KERNEL_(T* const*, G* const*, , name, rule, slots, hyper)          \
  CUDIST_RULE_KERNEL_(PtrPack<T>, PtrPack<G>, _packed, name, rule, slots, hyper)
CUDIST_UPDATE_RULE_LIST(CUDIST_RULE_KERNELS_, ~)
#undef CUDIST_RULE_KERNELS_
#undef CUDIST_RULE_KERNEL_
#undef CUDIST_RULE_KERNEL_LOAD_
#undef CUDIST_RULE_KERNEL_HYPER_

}  // namespace kernels
}  // namespace cudist
