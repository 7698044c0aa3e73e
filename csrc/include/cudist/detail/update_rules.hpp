/// @file detail/update_rules.hpp
/// @brief The per-element rule of each optimizer, written once for the host kernels
/// (<cudist/updates.hpp>) and the CUDA kernels (<cudist/kernels/mirrored.cuh>) (private).
///
/// A rule is a struct templated on the compute type ``C`` and on the arithmetic ``M``, a class of
/// static function templates ``add``, ``sub``, ``mul``, ``div``, ``sqrt``, ``maximum`` (NumPy's: a
/// NaN wins, of equal values the second), ``abs`` and ``sign`` (NumPy's: +0 for either zero, a NaN
/// kept). The host passes plain IEEE operators (built with -ffp-contract=off); the CUDA kernels pass
/// the round-to-nearest intrinsics of <cudist/kernels/common.cuh> that never contract into FMAs
/// nor flush subnormals. Both then compute exactly what the NumPy reference
/// (src/cudist/_kernels/_numpy.py) computes, operation by operation.
///
/// Each rule has:
///  * ``kSlots``: its slot count; ``x`` holds copy 0 of each slot (in the compute type), then the
///    variable's, and the rule overwrites them with the new values;
///  * ``kHyper``: the count of its hyper-parameters and a constructor from them in the compute type
///    (in the order of cudist._kernels.UPDATE_KERNELS, weight decay excluded): derived constants
///    such as ``1 - beta_1`` are computed there, in the compute type, as the reference does;
///  * ``operator()(g, x, dec)``: one element; ``dec(w)`` is the decoupled weight decay
///    ``w - w * decay``, or the identity (the caller picks, so the common case carries no branch).
///
/// The rules' names and slots are tabled in CUDIST_UPDATE_RULE_LIST below. No includes: NVRTC compiles
/// this header as it is (the one host-only helper aside).
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cmath>  // adam_lr_t, adamax_lr_t; NVRTC sees no include
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define CUDIST_HD __host__ __device__ __forceinline__
#else
/// ``__host__ __device__`` under nvcc and NVRTC; empty (inline) for the host compiler.
#define CUDIST_HD inline
#endif

/// The optimizers whose update is a rule of this header: X(A, name, rule, (slots), (hyper)), ``A``
/// passed through, ``name`` the optimizer's (that of cudist._kernels.UPDATE_KERNELS), ``rule`` its
/// struct below, then its slots and its hyper-parameters (followed by the weight decay ``decay``,
/// ``weight_decay * lr``, 0: none) as identifiers. This is the one place a rule is named in C++:
/// the CUDA kernels (<cudist/kernels/mirrored.cuh>), their entry in the kernel list (read by
/// src/cudist/_kernels/_cuda_launch.py too), the CUDA launchers (<cudist/cuda/launch.hpp>), the host
/// entry points (<cudist/updates.hpp>) and the Python bindings (csrc/bindings/core.cpp) are all
/// generated from it; a slot ``s`` is passed as the list of its copies named ``<s>s``.
///
/// A rule with optional slots (cudist._kernels.OPTIONAL_SLOTS: RMSprop's momentum and average
/// gradient) has one row per combination of them, named after the row and the slots it has
/// (``<name>_<slot>...``, in the slots' order), each with its slots fixed: its values stay in
/// registers, and the callers (the Python hooks) pick the row once per call.
#define CUDIST_UPDATE_RULE_LIST(X, A)                                                \
  X(A, sgd, sgd, (), (lr))                                                           \
  X(A, momentum, momentum, (velocity), (lr, momentum))                               \
  X(A, nesterov, nesterov, (velocity), (lr, momentum))                               \
  X(A, adamw, adam, (m, v), (lr_t, beta_1, beta_2, epsilon))                         \
  X(A, amsgrad, amsgrad, (m, v, v_hat), (lr_t, beta_1, beta_2, epsilon))             \
  X(A, adagrad, adagrad, (accumulator), (lr, epsilon))                               \
  X(A, adamax, adamax, (m, u), (lr_t, beta_1, beta_2, epsilon))                      \
  X(A, nadam, nadam, (m, v), (lr, beta_1, beta_2, epsilon, c_m, c_g, c_v))           \
  X(A, lion, lion, (m), (lr, beta_1, beta_2))                                       \
  X(A, rmsprop, rmsprop, (velocity), (lr, rho, momentum, epsilon))                   \
  X(A, rmsprop_momentum, rmsprop_momentum, (velocity, momentum), (lr, rho, momentum, epsilon)) \
  X(A, rmsprop_average_gradient, rmsprop_centered, (velocity, average_gradient), (lr, rho, momentum, epsilon)) \
  X(A, rmsprop_momentum_average_gradient, rmsprop_centered_momentum, (velocity, momentum, average_gradient), \
    (lr, rho, momentum, epsilon))

// The preprocessor helpers the generated code is written with (lists of at most 8 items, or none).
#define CUDIST_PP_REM(...) __VA_ARGS__
#define CUDIST_PP_CAT(a, b) CUDIST_PP_CAT_(a, b)
#define CUDIST_PP_CAT_(a, b) a##b
#define CUDIST_PP_NARG(...) CUDIST_PP_NARG_(__VA_ARGS__, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define CUDIST_PP_NARG_(_1, _2, _3, _4, _5, _6, _7, _8, N, ...) N
/// 1 when the arguments hold a comma (2 to 8 of them), else 0.
#define CUDIST_PP_HAS_COMMA(...) CUDIST_PP_NARG_(__VA_ARGS__, 1, 1, 1, 1, 1, 1, 1, 0, ~)
/// 1 for an empty list of identifiers, else 0. CUDIST_PP_NARG counts an empty list as one item, and
/// __VA_OPT__ is C++20 (NVRTC compiles C++17): ``CUDIST_PP_EMPTY_PROBE_ x ()`` becomes a comma only
/// when ``x`` is empty, so (probe has a comma, list has a comma) is (1, 0) exactly for the empty
/// list -- (0, 0) for one identifier, (1, 1) for several (the items are never function-like macros).
#define CUDIST_PP_IS_EMPTY(...) \
  CUDIST_PP_IS_EMPTY_(CUDIST_PP_HAS_COMMA(CUDIST_PP_EMPTY_PROBE_ __VA_ARGS__ ()), CUDIST_PP_HAS_COMMA(__VA_ARGS__))
#define CUDIST_PP_EMPTY_PROBE_(...) ,
#define CUDIST_PP_IS_EMPTY_(probe, comma) CUDIST_PP_CAT(CUDIST_PP_IS_EMPTY_, CUDIST_PP_CAT(probe, comma))
#define CUDIST_PP_IS_EMPTY_00 0
#define CUDIST_PP_IS_EMPTY_10 1
#define CUDIST_PP_IS_EMPTY_11 0
/// The number of items of a list of identifiers, 0 for an empty one.
#define CUDIST_PP_COUNT(...) CUDIST_PP_CAT(CUDIST_PP_COUNT_, CUDIST_PP_IS_EMPTY(__VA_ARGS__))(__VA_ARGS__)
#define CUDIST_PP_COUNT_0(...) CUDIST_PP_NARG(__VA_ARGS__)
#define CUDIST_PP_COUNT_1(...) 0
/// F(A, x) for every x of the parenthesized list ``list``, juxtaposed (F supplies any commas).
#define CUDIST_PP_MAP(F, A, list) CUDIST_PP_MAP_(F, A, CUDIST_PP_REM list)
#define CUDIST_PP_MAP_(F, A, ...) CUDIST_PP_CAT(CUDIST_PP_MAP_N, CUDIST_PP_COUNT(__VA_ARGS__))(F, A, __VA_ARGS__)
#define CUDIST_PP_MAP_N0(F, A, ...)
#define CUDIST_PP_MAP_N1(F, A, x) F(A, x)
#define CUDIST_PP_MAP_N2(F, A, x, ...) F(A, x) CUDIST_PP_MAP_N1(F, A, __VA_ARGS__)
#define CUDIST_PP_MAP_N3(F, A, x, ...) F(A, x) CUDIST_PP_MAP_N2(F, A, __VA_ARGS__)
#define CUDIST_PP_MAP_N4(F, A, x, ...) F(A, x) CUDIST_PP_MAP_N3(F, A, __VA_ARGS__)
#define CUDIST_PP_MAP_N5(F, A, x, ...) F(A, x) CUDIST_PP_MAP_N4(F, A, __VA_ARGS__)
#define CUDIST_PP_MAP_N6(F, A, x, ...) F(A, x) CUDIST_PP_MAP_N5(F, A, __VA_ARGS__)
#define CUDIST_PP_MAP_N7(F, A, x, ...) F(A, x) CUDIST_PP_MAP_N6(F, A, __VA_ARGS__)
#define CUDIST_PP_MAP_N8(F, A, x, ...) F(A, x) CUDIST_PP_MAP_N7(F, A, __VA_ARGS__)
/// The common items: ``P x,`` / ``, P x`` (P a type, or empty), the same with a slot's copies
/// (``P xs,``, ``, P xs``), and ``P,`` (a parameter's type alone).
#define CUDIST_PP_TYPE(P, x) P,
#define CUDIST_PP_TRAIL(P, x) P x,
#define CUDIST_PP_LEAD(P, x) , P x
#define CUDIST_PP_TRAIL_S(P, x) P x##s,
#define CUDIST_PP_LEAD_S(P, x) , P x##s
/// The items of ``list`` as string literals, comma-separated (nothing for an empty list).
#define CUDIST_PP_STRINGS(list) CUDIST_PP_CAT(CUDIST_PP_STRINGS_, CUDIST_PP_IS_EMPTY(CUDIST_PP_REM list))(list)
#define CUDIST_PP_STRINGS_1(list)
#define CUDIST_PP_STRINGS_0(list) CUDIST_PP_DROP1_(CUDIST_PP_MAP(CUDIST_PP_STRING_, ~, list))
#define CUDIST_PP_STRING_(A, x) , #x
#define CUDIST_PP_DROP1_(...) CUDIST_PP_DROP1__(__VA_ARGS__)
#define CUDIST_PP_DROP1__(first, ...) __VA_ARGS__

/// X(name, rule, (slot names), (hyper-parameter names)): CUDIST_UPDATE_RULE_LIST with the names as
/// string literals (the Python bindings' argument names).
#define CUDIST_UPDATE_RULES(X) CUDIST_UPDATE_RULE_LIST(CUDIST_UPDATE_RULE_STRINGS_, X)
#define CUDIST_UPDATE_RULE_STRINGS_(X, name, rule, slots, hyper) \
  X(name, rule, (CUDIST_PP_STRINGS(slots)), (CUDIST_PP_STRINGS(hyper)))

namespace cudist {
namespace rules {

/// Gradient descent, no slot: ``w = w - lr * g``.
template <class C, class M>
struct sgd {
  static constexpr int kSlots = 0;
  static constexpr int kHyper = 1;
  C lr;
  CUDIST_HD explicit sgd(C lr_) : lr(lr_) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[kSlots + 1], const Dec& dec) const {
    x[0] = M::sub(dec(x[0]), M::mul(lr, g));
  }
};

/// SGD with momentum (Keras), slot velocity: ``v = momentum * v - lr * g``; then
/// ``w = w + (momentum * v - lr * g)`` with Nesterov, else ``w = w + v`` (``v`` unrounded within
/// the step, as the reference computes it). Nesterov is a template parameter, so each form is
/// straight-line code (the callers pick the instantiation once per call).
template <class C, class M, bool kNesterov>
struct momentum_rule {
  static constexpr int kSlots = 1;
  static constexpr int kHyper = 2;
  C lr, momentum;
  CUDIST_HD momentum_rule(C lr_, C momentum_) : lr(lr_), momentum(momentum_) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[kSlots + 1], const Dec& dec) const {
    const C lr_g = M::mul(lr, g);
    const C v = M::sub(M::mul(momentum, x[0]), lr_g);
    const C w = dec(x[1]);
    x[0] = v;
    if constexpr (kNesterov) {
      x[1] = M::add(w, M::sub(M::mul(momentum, v), lr_g));
    } else {
      x[1] = M::add(w, v);
    }
  }
};
template <class C, class M>
using momentum = momentum_rule<C, M, false>;
template <class C, class M>
using nesterov = momentum_rule<C, M, true>;

/// RMSprop (Keras), slots velocity, then momentum (when ``kMomentum``), then average gradient
/// (when ``kCentered``): ``v = rho * v + (1 - rho) * g*g``; centered: ``a = rho * a + (1 - rho) * g``,
/// ``d = v - a*a + epsilon``, else ``d = v + epsilon``; ``inc = lr * g / sqrt(d)``; with momentum
/// ``mo = momentum * mo + inc; w = dec(w) - mo``, else ``w = dec(w) - inc``.
///
/// The optional slots are template parameters, not null pointers or flags: every instantiation
/// indexes ``x`` with constants only, so its values stay in registers (a form that took the
/// optional slots' addresses gave the CUDA kernel a stack frame).
template <class C, class M, bool kMomentum, bool kCentered>
struct rmsprop_rule {
  static constexpr int kSlots = 1 + (kMomentum ? 1 : 0) + (kCentered ? 1 : 0);
  static constexpr int kHyper = 4;
  static constexpr int kMo = 1;                      // the momentum slot, when kMomentum
  static constexpr int kAvg = kMomentum ? 2 : 1;     // the average-gradient slot, when kCentered
  C lr, rho, omr, momentum, epsilon;
  CUDIST_HD rmsprop_rule(C lr_, C rho_, C momentum_, C epsilon_)
      : lr(lr_), rho(rho_), omr(M::sub(C(1), rho_)), momentum(momentum_), epsilon(epsilon_) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[static_cast<unsigned>(kSlots) + 1u], const Dec& dec) const {
    x[0] = M::add(M::mul(rho, x[0]), M::mul(omr, M::mul(g, g)));
    C d = M::add(x[0], epsilon);
    if constexpr (kCentered) {
      x[kAvg] = M::add(M::mul(rho, x[kAvg]), M::mul(omr, g));
      d = M::add(M::sub(x[0], M::mul(x[kAvg], x[kAvg])), epsilon);
    }
    const C inc = M::div(M::mul(lr, g), M::sqrt(d));
    if constexpr (kMomentum) {
      x[kMo] = M::add(M::mul(momentum, x[kMo]), inc);
      x[kSlots] = M::sub(dec(x[kSlots]), x[kMo]);
    } else {
      x[kSlots] = M::sub(dec(x[kSlots]), inc);
    }
  }
};
template <class C, class M>
using rmsprop = rmsprop_rule<C, M, false, false>;
template <class C, class M>
using rmsprop_momentum = rmsprop_rule<C, M, true, false>;
template <class C, class M>
using rmsprop_centered = rmsprop_rule<C, M, false, true>;
template <class C, class M>
using rmsprop_centered_momentum = rmsprop_rule<C, M, true, true>;

/// Adam's moments, shared by Adam(W) and AMSGrad:
/// ``m += (g - m) * c1``; ``v += (g*g - v) * c2`` (c1 = 1 - beta_1, c2 = 1 - beta_2).
template <class C, class M>
CUDIST_HD void adam_moments(C g, C c1, C c2, C& m, C& v) {
  m = M::add(m, M::mul(M::sub(g, m), c1));
  v = M::add(v, M::mul(M::sub(M::mul(g, g), v), c2));
}

/// Adam / AdamW (Keras), slots m, v, with the bias-corrected ``lr_t``:
/// ``w = dec(w) - lr_t * m / (sqrt(v) + epsilon)`` after adam_moments().
template <class C, class M>
struct adam {
  static constexpr int kSlots = 2;
  static constexpr int kHyper = 4;
  C lr_t, c1, c2, epsilon;
  CUDIST_HD adam(C lr_t_, C beta_1, C beta_2, C epsilon_)
      : lr_t(lr_t_), c1(M::sub(C(1), beta_1)), c2(M::sub(C(1), beta_2)), epsilon(epsilon_) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[kSlots + 1], const Dec& dec) const {
    adam_moments<C, M>(g, c1, c2, x[0], x[1]);
    x[2] = M::sub(dec(x[2]), M::div(M::mul(lr_t, x[0]), M::add(M::sqrt(x[1]), epsilon)));
  }
};

/// AMSGrad (Keras 3's ``Adam(amsgrad=True)``), slots m, v, v_hat: adam_moments(), then
/// ``v_hat = maximum(v_hat, v)``; ``w = dec(w) - lr_t * m / (sqrt(v_hat) + epsilon)``.
template <class C, class M>
struct amsgrad {
  static constexpr int kSlots = 3;
  static constexpr int kHyper = 4;
  C lr_t, c1, c2, epsilon;
  CUDIST_HD amsgrad(C lr_t_, C beta_1, C beta_2, C epsilon_)
      : lr_t(lr_t_), c1(M::sub(C(1), beta_1)), c2(M::sub(C(1), beta_2)), epsilon(epsilon_) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[kSlots + 1], const Dec& dec) const {
    adam_moments<C, M>(g, c1, c2, x[0], x[1]);
    x[2] = M::maximum(x[2], x[1]);
    x[3] = M::sub(dec(x[3]), M::div(M::mul(lr_t, x[0]), M::add(M::sqrt(x[2]), epsilon)));
  }
};

/// Adagrad, slot acc: ``acc += g*g``; ``w = dec(w) - lr * g / sqrt(acc + epsilon)``.
template <class C, class M>
struct adagrad {
  static constexpr int kSlots = 1;
  static constexpr int kHyper = 2;
  C lr, epsilon;
  CUDIST_HD adagrad(C lr_, C epsilon_) : lr(lr_), epsilon(epsilon_) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[kSlots + 1], const Dec& dec) const {
    x[0] = M::add(x[0], M::mul(g, g));
    x[1] = M::sub(dec(x[1]), M::div(M::mul(lr, g), M::sqrt(M::add(x[0], epsilon))));
  }
};

/// Adamax, slots m, u, with ``lr_t = lr / (1 - beta_1^step)``: ``m += (g - m) * (1 - beta_1)``;
/// ``u = maximum(beta_2 * u, |g|)``; ``w = dec(w) - lr_t * m / (u + epsilon)``.
template <class C, class M>
struct adamax {
  static constexpr int kSlots = 2;
  static constexpr int kHyper = 4;
  C lr_t, c1, beta_2, epsilon;
  CUDIST_HD adamax(C lr_t_, C beta_1, C beta_2_, C epsilon_)
      : lr_t(lr_t_), c1(M::sub(C(1), beta_1)), beta_2(beta_2_), epsilon(epsilon_) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[kSlots + 1], const Dec& dec) const {
    x[0] = M::add(x[0], M::mul(M::sub(g, x[0]), c1));
    x[1] = M::maximum(M::mul(beta_2, x[1]), M::abs(g));
    x[2] = M::sub(dec(x[2]), M::div(M::mul(lr_t, x[0]), M::add(x[1], epsilon)));
  }
};

/// Nadam (Keras 3), slots m, v, with the step's c_m, c_g, c_v (cudist._kernels.nadam_step):
/// adam_moments(); ``m_hat = c_m * m + c_g * g``; ``v_hat = v / c_v``;
/// ``w = dec(w) - m_hat * lr / (sqrt(v_hat) + epsilon)``.
template <class C, class M>
struct nadam {
  static constexpr int kSlots = 2;
  static constexpr int kHyper = 7;
  C lr, c1, c2, epsilon, c_m, c_g, c_v;
  CUDIST_HD nadam(C lr_, C beta_1, C beta_2, C epsilon_, C c_m_, C c_g_, C c_v_)
      : lr(lr_), c1(M::sub(C(1), beta_1)), c2(M::sub(C(1), beta_2)), epsilon(epsilon_), c_m(c_m_), c_g(c_g_),
        c_v(c_v_) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[kSlots + 1], const Dec& dec) const {
    adam_moments<C, M>(g, c1, c2, x[0], x[1]);
    const C m_hat = M::add(M::mul(c_m, x[0]), M::mul(c_g, g));
    const C v_hat = M::div(x[1], c_v);
    x[2] = M::sub(dec(x[2]), M::div(M::mul(m_hat, lr), M::add(M::sqrt(v_hat), epsilon)));
  }
};

/// Lion, slot m: ``w = dec(w) - lr * sign(m * beta_1 + g * (1 - beta_1))``;
/// ``m = m * beta_2 + g * (1 - beta_2)``.
template <class C, class M>
struct lion {
  static constexpr int kSlots = 1;
  static constexpr int kHyper = 3;
  C lr, beta_1, beta_2, c1, c2;
  CUDIST_HD lion(C lr_, C beta_1_, C beta_2_)
      : lr(lr_), beta_1(beta_1_), beta_2(beta_2_), c1(M::sub(C(1), beta_1_)), c2(M::sub(C(1), beta_2_)) {}
  template <class Dec>
  CUDIST_HD void operator()(C g, C (&x)[kSlots + 1], const Dec& dec) const {
    x[1] = M::sub(dec(x[1]), M::mul(lr, M::sign(M::add(M::mul(x[0], beta_1), M::mul(g, c1)))));
    x[0] = M::add(M::mul(x[0], beta_2), M::mul(g, c2));
  }
};

/// The weight decay of a rule: ``w - w * decay`` ...
template <class C, class M>
struct decay_by {
  C decay;
  CUDIST_HD C operator()(C w) const { return M::sub(w, M::mul(w, decay)); }
};

/// ... or none.
struct no_decay {
  template <class C>
  CUDIST_HD C operator()(C w) const {
    return w;
  }
};

}  // namespace rules

#if !defined(__CUDACC_RTC__)
/// Adam's bias-corrected step size for the 1-based ``step``, computed in double (host code; the
/// ``lr_t`` of the rules adam and amsgrad): ``lr * sqrt(1 - beta_2^step) / (1 - beta_1^step)``.
inline double adam_lr_t(double lr, double beta_1, double beta_2, long long step) {
  return lr * std::sqrt(1.0 - std::pow(beta_2, static_cast<double>(step))) /
         (1.0 - std::pow(beta_1, static_cast<double>(step)));
}

/// Adamax's bias-corrected step size ``lr / (1 - beta_1^step)`` for the 1-based ``step``, in double
/// (host code; the rule's ``lr_t``).
inline double adamax_lr_t(double lr, double beta_1, long long step) {
  return lr / (1.0 - std::pow(beta_1, static_cast<double>(step)));
}
#endif

}  // namespace cudist
