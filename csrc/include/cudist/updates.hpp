/// @file updates.hpp
/// @brief Fused updates of N mirrored copies of a variable: assign, assign_add/sub and the optimizers
/// of CUDIST_UPDATE_RULE_LIST
/// (<cudist/detail/update_rules.hpp>), and the fused all-reduce + update forms (all_reduce_<rule>)
/// that sum M gradients in the same pass.
///
/// Every update reads copy 0 (and slot copy 0), computes the new values once and writes all N
/// copies in the same pass. The arithmetic follows cudist's NumPy reference operation by
/// operation: in the variable's type, except float16 (cudist::half), which computes in float32 and
/// rounds when stored; scalar hyper-parameters are converted to that compute type first. Built
/// without floating-point contraction (-ffp-contract=off), the results equal NumPy's bit for bit.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "all_reduce.hpp"
#include "detail/arith.hpp"
#include "detail/parallel.hpp"
#include "detail/store.hpp"
#include "detail/update_rules.hpp"
#include "half.hpp"
#include "thread_pool.hpp"

namespace cudist {


namespace detail {

template <class T>
constexpr bool is_update_float = std::is_floating_point<T>::value || std::is_same<T, half>::value;

/// Shared driver of the updates. ``compute(i, len, out, at)`` fills ``out[s][at + k]`` (storage
/// type) for ``k < len`` and each slot ``s`` with the new values of elements [i, i+len);
/// row ``s`` is then written to the copies of slot ``s``. ``len`` is a compile-time constant
/// (one cache line) except at the tail, so the arithmetic vectorises.
///
/// In cache, work goes block by block: a block of every slot is computed into L1, then written to
/// copy 0 with ordinary stores (copy 0 was just read, so its lines are in cache) and to the other
/// copies. Keeping the arithmetic and the stores in separate tight loops is faster than
/// interleaving them per cache line (measured: ~1.6x on plain gradient descent and a two-slot rule, 4 x 64 KiB in cache, one
/// thread). When the update is large, the other copies are written with streaming stores (they
/// are write-only: streaming saves reading them first), two whole cache lines at a time right
/// after they are computed, which in memory beats the block scheme.
///
/// A buffer passed more than once in a slot is written once: every copy gets the same values, so
/// the result is the same for less traffic. It matters most with streaming stores, which would
/// otherwise evict the lines just written to that buffer and write them again (measured: 4 copies
/// that are one 64 MiB buffer, plain gradient descent 2.4x and a two-slot rule 3.5x faster).
///
/// ``unread0``: bit ``s`` set when copy 0 of slot ``s`` is not what ``compute`` reads (an
/// out-of-place update): it is then written like the other copies, streamed when large (its lines
/// are not in cache, and reading them for ownership would add a third to the update's traffic).
template <class T, std::size_t NSlots, class Compute>
void run_update(T* const* const (&slots)[NSlots], std::size_t n, std::size_t count, std::size_t n_inputs,
                thread_pool* pool, Compute&& compute, unsigned unread0 = 0) {
  constexpr std::size_t K = kLineBytes / sizeof(T);
  constexpr std::size_t B = kBlockBytes / sizeof(T);
  constexpr std::size_t kInline = 32;
  T* inline_dst[kInline];
  std::vector<T*> heap_dst;
  T** dst_ptrs = inline_dst;  // no allocation in the common case: a 4 KiB update takes ~0.5 us
  if (NSlots * n > kInline) {
    heap_dst.resize(NSlots * n);
    dst_ptrs = heap_dst.data();
  }
  T** dst[NSlots];
  std::size_t m[NSlots];
  std::size_t first[NSlots];  // per slot, the first copy written like the others (0: copy 0 is not read)
  std::size_t read_copies = 0;
  std::size_t distinct = 0;
  for (std::size_t s = 0; s < NSlots; ++s) {
    dst[s] = dst_ptrs + s * n;
    std::size_t k = 0;
    for (std::size_t c = 0; c < n; ++c) {
      T* p = slots[s][c];
      if (std::find(dst[s], dst[s] + k, p) == dst[s] + k) dst[s][k++] = p;
    }
    m[s] = k;
    distinct += k;
    first[s] = (unread0 >> s) & 1u ? 0 : 1;
    read_copies += first[s];
  }
  // The first buffer written with streaming stores (a copy other than copy 0), whose cache lines
  // the streaming loop lines up with.
  T* stream_ref = nullptr;
  for (std::size_t s = 0; s < NSlots && stream_ref == nullptr; ++s)
    if (m[s] > first[s]) stream_ref = dst[s][first[s]];
  const std::size_t bytes = count * sizeof(T);
  run_blocks(pool, count, B, bytes * (n_inputs + distinct), bytes * (distinct - read_copies),
             [&](std::size_t b, std::size_t e, bool stream) {
               const auto mis = reinterpret_cast<std::uintptr_t>(stream_ref + b) & (kLineBytes - 1);
               if (stream && stream_ref != nullptr && mis % sizeof(T) == 0) {
                 // In memory: two lines of every slot at a time, written at once to every copy (copy 0
                 // with ordinary stores, the others streamed as whole lines where they line up with
                 // stream_ref): measured ~1.3x faster than a block computed first, then streamed.
                 alignas(64) T out2[NSlots][2 * K];
                 auto piece = [&](std::size_t i, std::size_t len) {  // ordinary stores, any length <= 2K
                   for (std::size_t j = 0; j < len; j += K) compute(i + j, std::min(K, len - j), out2, j);
                   for (std::size_t s = 0; s < NSlots; ++s)
                     for (std::size_t c = 0; c < m[s]; ++c) std::memcpy(dst[s][c] + i, out2[s], len * sizeof(T));
                 };
                 std::size_t i = b;
                 if (mis) {
                   const std::size_t head = std::min<std::size_t>((kLineBytes - mis) / sizeof(T), e - i);
                   piece(i, head);
                   i += head;
                 }
                 for (; i + 2 * K <= e; i += 2 * K) {
                   compute(i, std::integral_constant<std::size_t, K>{}, out2, 0);
                   compute(i + K, std::integral_constant<std::size_t, K>{}, out2, K);
                   for (std::size_t s = 0; s < NSlots; ++s) {
                     if (first[s]) std::memcpy(dst[s][0] + i, out2[s], sizeof out2[s]);
                     for (std::size_t c = first[s]; c < m[s]; ++c) {
                       T* d = dst[s][c] + i;
                       if (line_aligned(d)) {
                         stream_lines<2>(d, out2[s]);
                       } else {
                         std::memcpy(d, out2[s], sizeof out2[s]);
                       }
                     }
                   }
                 }
                 if (i < e) piece(i, e - i);
                 return;
               }
               alignas(64) T out[NSlots][B];
               for (std::size_t i = b; i < e; i += B) {
                 const std::size_t len = std::min(B, e - i);
                 if (len == B) {
                   for (std::size_t j = 0; j < B; j += K) compute(i + j, std::integral_constant<std::size_t, K>{}, out, j);
                 } else {
                   for (std::size_t j = 0; j < len; j += K) compute(i + j, std::min(K, len - j), out, j);
                 }
                 for (std::size_t s = 0; s < NSlots; ++s) {
                   if (first[s]) std::memcpy(dst[s][0] + i, out[s], len * sizeof(T));
                   for (std::size_t c = first[s]; c < m[s]; ++c) copy_block(dst[s][c] + i, out[s], len * sizeof(T), stream);
                 }
               }
             });
}

/// Returns ``p`` or, when it partially overlaps one of the ``n`` buffers of any slot, a pointer to
/// a copy kept in ``keep``.
template <class T>
const T* snapshot_if_overlapping(const T* p, std::initializer_list<T* const*> slots, std::size_t n,
                                 std::size_t count, std::vector<std::vector<T>>& keep) {
  for (T* const* slot : slots)
    for (std::size_t c = 0; c < n; ++c)
      if (partial_overlap(p, slot[c], count * sizeof(T))) {
        keep.emplace_back(p, p + count);
        return keep.back().data();
      }
  return p;
}

}  // namespace detail

/// Writes ``value`` into each of the ``n`` copies.
template <class T>
void assign(T* const* copies, std::size_t n, std::size_t count, const T* value,
            thread_pool* pool = &thread_pool::global()) {
  broadcast(value, copies, n, count, pool);
}

/// Every copy becomes ``copies[0] + value`` (``copies[0] - value`` when ``negate``).
///
/// Integers wrap around; float16 rounds the sum, as NumPy does.
template <class T>
void assign_add(T* const* copies, std::size_t n, std::size_t count, const T* value, bool negate = false,
                thread_pool* pool = &thread_pool::global()) {
  if (n == 0 || count == 0) return;
  using A = detail::arith<T>;
  std::vector<std::vector<T>> keep;
  const T* w0 = detail::snapshot_if_overlapping<T>(copies[0], {copies}, n, count, keep);
  value = detail::snapshot_if_overlapping<T>(value, {copies}, n, count, keep);
  T* const* const slots[1] = {copies};
  detail::run_update<T, 1>(slots, n, count, 2, pool, [&](std::size_t b, auto len, auto out, std::size_t at) {
    const T* w = w0 + b;
    const T* x = value + b;
    detail::prefetch(w);
    detail::prefetch(x);
    if (negate) {
      for (std::size_t k = 0; k < len; ++k) out[0][at + k] = A::store(A::sub(A::load(w[k]), A::load(x[k])));
    } else {
      for (std::size_t k = 0; k < len; ++k) out[0][at + k] = A::store(A::add(A::load(w[k]), A::load(x[k])));
    }
  });
}

/// Every copy becomes ``copies[0] - value``.
template <class T>
void assign_sub(T* const* copies, std::size_t n, std::size_t count, const T* value,
                thread_pool* pool = &thread_pool::global()) {
  assign_add(copies, n, count, value, true, pool);
}

namespace detail {

/// Elements [b, b+len) of the sum of the ``m`` gradients, in replica order and with the
/// reduction's arithmetic (float16: in float32, rounded once), so they are exactly what
/// reduce_to_one(grads, sum) would store. Summed into ``acc``; a single gradient that needs no
/// conversion is returned in place.
///
/// ``G``, the gradients' type, may be narrower than T (bfloat16 or float16 gradients of a float32
/// variable, mixed precision): each is widened exactly while loaded, so the sum is the one of the
/// gradients cast to T first -- without a copy of them in T.
template <class T, class G = T, class Len>
inline const typename arith<T>::acc_t* sum_grads_line(const G* const* g, std::size_t m, std::size_t b, Len len,
                                                      typename arith<T>::acc_t* acc) noexcept {
  using A = arith<T>;
  using AG = arith<G>;
  using acc_t = typename A::acc_t;
  static_assert(std::is_same<G, T>::value || sizeof(G) < sizeof(T), "gradients may only be narrower than the variable");
  const G* p = g[0] + b;
  prefetch(p);
  if constexpr (std::is_same<acc_t, T>::value && std::is_same<G, T>::value) {
    if (m == 1) return p;
  }
  for (std::size_t k = 0; k < len; ++k) acc[k] = static_cast<acc_t>(AG::load(p[k]));
  for (std::size_t r = 1; r < m; ++r) {
    p = g[r] + b;
    prefetch(p);
    for (std::size_t k = 0; k < len; ++k) acc[k] = A::add(acc[k], static_cast<acc_t>(AG::load(p[k])));
  }
  if constexpr (!std::is_same<acc_t, T>::value) {
    // float16: the float32 sum rounded once, as reduce_to_one stores it.
    if (m > 1)
      for (std::size_t k = 0; k < len; ++k) acc[k] = A::load(A::store(acc[k]));
  }
  return acc;
}

/// The gradient pointers of a fused update, each replaced by a private copy when it partially
/// overlaps a buffer the update writes (no allocation for up to kInline gradients). Gradients of
/// another type than the buffers (``G`` narrower than T) are copied when they share any byte with one.
template <class T, class G = T>
class grad_list {
 public:
  grad_list(const G* const* grads, std::size_t m, std::initializer_list<T* const*> slots, std::size_t n,
            std::size_t count, std::vector<std::vector<G>>& keep) {
    ptrs_ = inline_;
    if (m > kInline) {
      heap_.resize(m);
      ptrs_ = heap_.data();
    }
    for (std::size_t r = 0; r < m; ++r) ptrs_[r] = snapshot(grads[r], slots, n, count, keep);
  }
  grad_list(const grad_list&) = delete;
  grad_list& operator=(const grad_list&) = delete;
  const G* const* data() const noexcept { return ptrs_; }

 private:
  static const G* snapshot(const G* p, std::initializer_list<T* const*> slots, std::size_t n, std::size_t count,
                           std::vector<std::vector<G>>& keep) {
    if constexpr (std::is_same<G, T>::value) {
      return snapshot_if_overlapping<T>(p, slots, n, count, keep);
    } else {
      const auto x = reinterpret_cast<std::uintptr_t>(p);
      for (T* const* slot : slots)
        for (std::size_t c = 0; c < n; ++c) {
          const auto y = reinterpret_cast<std::uintptr_t>(slot[c]);
          if (x < y + count * sizeof(T) && y < x + count * sizeof(G)) {
            keep.emplace_back(p, p + count);
            return keep.back().data();
          }
        }
      return p;
    }
  }
  static constexpr std::size_t kInline = 16;
  const G* inline_[kInline];
  std::vector<const G*> heap_;
  const G** ptrs_;
};

}  // namespace detail

namespace detail {

/// Calls ``f(dec)`` with ``dec(w)`` the decoupled weight decay ``w - w * decay`` in C, or the
/// identity when ``decay`` is 0 (two instantiations, so the common case carries no branch).
template <class C, class F>
void with_decay(double decay, F&& f) {
  if (decay != 0.0) {
    const C d = static_cast<C>(decay);
    f([d](C w) { return w - w * d; });
  } else {
    f([](C w) { return w; });
  }
}

/// NumPy's maximum: a NaN in either operand wins; of two equal values the second.
template <class C>
inline C np_maximum(C a, C b) noexcept {
  return (a > b || a != a) ? a : b;
}

/// NumPy's sign: +1, -1, +0 for either zero, a NaN unchanged. Written as copysign and two selects,
/// which GCC vectorizes (nested conditionals, or selects of constants, it left scalar).
template <class C>
inline C np_sign(C x) noexcept {
  C s = std::copysign(C(1), x);
  s = x == C(0) ? C(0) : s;
  return x != x ? x : s;
}

template <class T, class G, std::size_t NS, class Rule, std::size_t... I>
void fused_rule_update(T* const* const (&state)[NS], const T* const* sources, std::size_t n, std::size_t count,
                       const G* const* grads, std::size_t m, thread_pool* pool, Rule& rule, std::index_sequence<I...>) {
  using C = compute_t<T>;
  using A = arith<T>;
  constexpr std::size_t K = kLineBytes / sizeof(T);
  std::vector<std::vector<T>> keep;
  std::vector<std::vector<G>> keep_g;
  // What the rule reads: copy 0 (in place) or the separate source (out of place: the written copies
  // are other memory, so a reader of the source still sees the old values).
  const T* const s0[NS] = {
      snapshot_if_overlapping<T>(sources != nullptr ? sources[I] : state[I][0], {state[I]...}, n, count, keep)...};
  unsigned unread0 = 0;  // the slots whose copy 0 is written, not read (see run_update)
  ((unread0 |= s0[I] != state[I][0] ? 1u << I : 0u), ...);
  const grad_list<T, G> gl(grads, m, {state[I]...}, n, count, keep_g);
  const G* const* gp = gl.data();
  run_update<T, NS>(state, n, count, m + NS, pool, [&](std::size_t b, auto len, auto out, std::size_t at) {
    // Local copies of the rule (its constants) and of the read pointers: a store to ``out`` may
    // alias any float reached through a reference, so without them the constants are reloaded
    // every element (measured: a two-slot rule, 64 x 4 KiB updates, ~25% slower).
    const Rule r = rule;
    const T* const p[NS] = {(s0[I] + b)...};
    typename A::acc_t acc[K];
    const auto* g = sum_grads_line<T, G>(gp, m, b, len, acc);
    for (std::size_t s = 0; s < NS; ++s) prefetch(p[s]);
    auto element = [&](std::size_t k) {
      C x[NS] = {static_cast<C>(A::load(p[I][k]))...};
      r(static_cast<C>(g[k]), x);
      ((out[I][at + k] = static_cast<T>(x[I])), ...);
    };
    if constexpr (NS > 1) {
      // Kept a loop until the vectorizer has seen it. With a constant trip count of 16 (one line
      // of float32), GCC's early complete unrolling (cunrolli, before the vectorizer) peels the
      // loop whenever the rule's body is small enough (16 copies under
      // max-completely-peeled-insns); the peeled copies are left to the SLP vectorizer, which does
      // not reorder the loads of element k+1 above the stores of element k to ``out`` (they may
      // alias), so they stay mostly scalar: momentum ~1.4x the time of the vectorized loop. Whether
      // a body crossed the threshold depended on inlining and constant propagation, so on unrelated
      // code under LTO (the hand-written momentum loop this driver replaces ran 1.6x slower in one
      // build, as fast again in the next). ``unroll 4``, below the trip count, forbids the
      // complete peeling: the loop is vectorized (with a run-time alias check) in every build.
      // Not for a rule without slots (plain gradient descent): its peeled body is vectorized whole, and the kept loop
      // made GCC hold the gradient sum in scalar registers instead (1.7x). See bench/PERFORMANCE.md.
      const std::size_t L = len;  // (``k < len`` on an integral_constant made GCC drop the pragma)
#pragma GCC unroll 4
      for (std::size_t k = 0; k < L; ++k) element(k);
    } else {
      for (std::size_t k = 0; k < len; ++k) element(k);
    }
  }, unread0);
}

/// The shared driver of these optimizers: ``state`` lists the slot groups then the variable's
/// copies (last); ``rule(g, x)`` turns x (the current values of each, in the compute type) into the
/// new values, written to every copy. ``sources`` (one per entry of ``state``, or nullptr) are the
/// arrays the current values are read from; nullptr reads copy 0 (in place). Out of place, a source
/// may be any memory holding the current values (a snapshot kept by a reader): the same arithmetic,
/// so the same bits.
template <class T, std::size_t NS, class Rule, class G>
void fused_rule_update(T* const* const (&state)[NS], const T* const* sources, std::size_t n, std::size_t count,
                       const G* const* grads, std::size_t m, thread_pool* pool, Rule&& rule) {
  fused_rule_update<T, G, NS>(state, sources, n, count, grads, m, pool, rule, std::make_index_sequence<NS>{});
}

/// The host arithmetic of the rules of <cudist/detail/update_rules.hpp>: IEEE operators (the
/// build disables contraction, so they round as NumPy's do).
struct host_math {
  template <class C>
  static C add(C a, C b) noexcept { return a + b; }
  template <class C>
  static C sub(C a, C b) noexcept { return a - b; }
  template <class C>
  static C mul(C a, C b) noexcept { return a * b; }
  template <class C>
  static C div(C a, C b) noexcept { return a / b; }
  template <class C>
  static C sqrt(C a) noexcept { return std::sqrt(a); }
  template <class C>
  static C maximum(C a, C b) noexcept { return np_maximum(a, b); }
  template <class C>
  static C abs(C a) noexcept { return std::abs(a); }
  template <class C>
  static C sign(C a) noexcept { return np_sign(a); }
};

/// The fused update of ``Rule`` (a rule of <cudist/detail/update_rules.hpp>) reading the current
/// values from ``sources`` (per entry of ``state``; nullptr: copy 0, in place) and writing every copy
/// of ``state`` (the slot groups then the variable's copies); ``hyper`` are the rule's
/// hyper-parameters (converted to the compute type first, as the reference does) and ``decay`` the
/// decoupled weight decay (0: none).
template <template <class, class> class Rule, class T, std::size_t NS, class G, class... H>
void run_rule_reading(T* const* const (&state)[NS], const T* const* sources, std::size_t n, std::size_t count,
                   const G* const* grads, std::size_t m, double decay, thread_pool* pool, H... hyper) {
  if (n == 0 || m == 0 || count == 0) return;
  using C = compute_t<T>;
  using R = Rule<C, host_math>;
  static_assert(R::kSlots + 1 == NS && R::kHyper == sizeof...(H), "a rule's slots or hyper-parameters mismatch");
  const R rule(static_cast<C>(hyper)...);
  with_decay<C>(decay, [&](auto dec) {  // captured by value: fused_rule_update copies it into registers
    fused_rule_update<T>(state, sources, n, count, grads, m, pool,
                         [rule, dec](C g, C(&x)[NS]) { rule(g, x, dec); });
  });
}

/// run_rule_reading() in place (copy 0 of each entry of ``state`` read).
template <template <class, class> class Rule, class T, std::size_t NS, class G, class... H>
void run_rule(T* const* const (&state)[NS], std::size_t n, std::size_t count, const G* const* grads, std::size_t m,
              double decay, thread_pool* pool, H... hyper) {
  run_rule_reading<Rule>(state, static_cast<const T* const*>(nullptr), n, count, grads, m, decay, pool, hyper...);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// The optimizers of CUDIST_UPDATE_RULE_LIST.
//
// Each follows cudist's NumPy reference (src/cudist/_kernels/_numpy.py) operation by operation, in
// the compute type (float32 for half): copy 0 of the variable and of every slot is read, the
// decoupled weight decay ``w - w * decay`` is applied first when ``decay`` (= weight_decay * lr)
// is not 0, then the update; every slot and the variable are written to all n copies in one pass.
// The ``all_reduce_*`` forms first sum their m gradients (sum_grads_line).


/// For each row X(A, name, rule, (slots), (hyper)) of CUDIST_UPDATE_RULE_LIST
/// (<cudist/detail/update_rules.hpp>, where each rule's formula is documented), generated:
///   all_reduce_name(copies, <slot>s..., n, count, grads, m, hyper..., decay, pool): the m
///     gradients summed in replica order (sum_grads_line), then ``w -= w * decay`` (when ``decay`` is not 0)
///     and the rule on the n copies of the variable and of its slots;
///   name(copies, <slot>s..., n, count, grad, hyper..., decay, pool): the same from one gradient.
/// Both take a last, optional ``sources``: the arrays holding the current values, one per slot then
/// the variable (a reader's snapshot); the copies are then written without being read (out of
/// place, same bits). nullptr (the default): copy 0 of each is read, in place.
#define CUDIST_HOST_RULE_(A, name, rule, slots, hyper)                                                              \
  template <class T>                                                                                              \
  void all_reduce_##name(T* const* copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, T* const*, slots) std::size_t n,       \
                         std::size_t count, const T* const* grads, std::size_t m,                                 \
                         CUDIST_PP_MAP(CUDIST_PP_TRAIL, double, hyper) double decay,                              \
                         thread_pool* pool = &thread_pool::global(), const T* const* sources = nullptr) {         \
    static_assert(detail::is_update_float<T>, "cudist::all_reduce_" #name " needs a floating-point type");        \
    T* const* const state[] = {CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, , slots) copies};                                 \
    detail::run_rule_reading<rules::rule>(state, sources, n, count, grads, m, decay,                                 \
                                       pool CUDIST_PP_MAP(CUDIST_PP_LEAD, , hyper));                              \
  }                                                                                                               \
  template <class T>                                                                                              \
  void name(T* const* copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, T* const*, slots) std::size_t n, std::size_t count, \
            const T* grad, CUDIST_PP_MAP(CUDIST_PP_TRAIL, double, hyper) double decay,                            \
            thread_pool* pool = &thread_pool::global(), const T* const* sources = nullptr) {                      \
    all_reduce_##name<T>(copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, , slots) n, count, &grad, 1,                    \
                         CUDIST_PP_MAP(CUDIST_PP_TRAIL, , hyper) decay, pool, sources);                           \
  }
CUDIST_UPDATE_RULE_LIST(CUDIST_HOST_RULE_, ~)
#undef CUDIST_HOST_RULE_

/// The gradient all-reduce of a loss-scaled step (LossScaleOptimizer), its finiteness check fused
/// into the same pass: ``out`` becomes the sum of the ``m`` gradients -- in replica order, with the
/// fused updates' arithmetic (sum_grads_line: float16 rounded once; bfloat16 or float16 gradients
/// of a float32 ``out`` widened exactly) -- divided by ``scale`` in T's compute type, and the call
/// returns whether every stored element of ``out`` is finite (an inf or NaN gradient, or a sum that
/// overflows, makes it false). One read of each gradient and one write of ``out``: the check costs
/// no pass of its own, and the optimizer then updates from ``out`` or skips the step.
///
/// @param grads  the m gradients, ``count`` elements each (type G: T, or narrower for float32 T).
/// @param m      number of gradients (at least 1).
/// @param count  elements per gradient.
/// @param scale  the loss scale the sum is divided by.
/// @param out    ``count`` elements; must not overlap a gradient.
/// @param pool   pool to parallelise over, or nullptr to run on the caller.
template <class T, class G = T>
bool reduce_unscale_finite(const G* const* grads, std::size_t m, std::size_t count, double scale, T* out,
                           thread_pool* pool = &thread_pool::global()) {
  static_assert(detail::is_update_float<T>, "cudist::reduce_unscale_finite needs a floating-point type");
  using A = detail::arith<T>;
  using acc_t = typename A::acc_t;
  if (count == 0 || m == 0) return true;
  const acc_t s = static_cast<acc_t>(scale);
  std::atomic<bool> bad{false};
  constexpr std::size_t B = detail::kBlockBytes / sizeof(T);
  const std::size_t bytes = count * (m * sizeof(G) + sizeof(T));
  detail::run_blocks(pool, count, B, bytes, 0, [&](std::size_t b, std::size_t e, bool) {
    constexpr std::size_t L = 256;
    acc_t acc[L];
    bool ok = true;
    for (std::size_t i = b; i < e; i += L) {
      const std::size_t len = std::min(L, e - i);
      const auto* g = detail::sum_grads_line<T, G>(grads, m, i, len, acc);
      T* o = out + i;
      for (std::size_t k = 0; k < len; ++k) {
        const T v = A::store(static_cast<acc_t>(g[k]) / s);
        o[k] = v;
        const acc_t y = A::load(v);
        ok &= (y - y) == acc_t(0);  // false for inf and NaN only; vectorizes, unlike std::isfinite
      }
    }
    if (!ok) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load(std::memory_order_relaxed);
}

}  // namespace cudist
