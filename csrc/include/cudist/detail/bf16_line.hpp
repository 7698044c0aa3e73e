/// @file detail/bf16_line.hpp
/// @brief The bfloat16 reduction of one cache line of every replica, in SSE2 (private).
///
/// Compilers leave the float32 -> bfloat16 rounding of the generic loop half-vectorized on plain
/// x86-64 (no SSE4.1 ``packusdw``: the 32 -> 16-bit narrowing became scalar shuffles), which made a
/// bfloat16 all-reduce as slow as float32's at twice the bytes. Here the narrowing is an arithmetic
/// shift by 16 (the bfloat16 bits as a signed 16-bit value) and ``packs_epi32``, whose saturation
/// then never applies. Same arithmetic as arith<bfloat16>: float32 sums in replica order (the
/// accumulator the first operand, so a NaN + NaN keeps the first NaN as NumPy's loop), one rounding
/// to nearest even, a NaN stored as the quiet NaN with its sign.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define CUDIST_BF16_SSE2 1
#endif

#include "../bfloat16.hpp"

namespace cudist {
namespace detail {

#ifdef CUDIST_BF16_SSE2
/// Reduces the K (a multiple of 8) bfloat16 elements at ``i`` of the ``n_in`` inputs into ``res``.
template <std::size_t K>
inline void reduce_line_bf16(const bfloat16* const* in, std::size_t n_in, std::size_t i, bool mean, float cnt,
                             bfloat16* res) noexcept {
  static_assert(K % 8 == 0, "a line holds whole vectors of 8 bfloat16");
  constexpr std::size_t V = K / 4;  // float32 vectors of 4
  const __m128i zero = _mm_setzero_si128();
  __m128 acc[V];
  {
    const auto* p = reinterpret_cast<const __m128i*>(in[0] + i);
    for (std::size_t v = 0; v < K / 8; ++v) {
      const __m128i x = _mm_loadu_si128(p + v);
      acc[2 * v] = _mm_castsi128_ps(_mm_unpacklo_epi16(zero, x));  // bits << 16: the exact float32
      acc[2 * v + 1] = _mm_castsi128_ps(_mm_unpackhi_epi16(zero, x));
    }
  }
  for (std::size_t r = 1; r < n_in; ++r) {
    const auto* p = reinterpret_cast<const __m128i*>(in[r] + i);
    for (std::size_t v = 0; v < K / 8; ++v) {
      const __m128i x = _mm_loadu_si128(p + v);
      acc[2 * v] = _mm_add_ps(acc[2 * v], _mm_castsi128_ps(_mm_unpacklo_epi16(zero, x)));
      acc[2 * v + 1] = _mm_add_ps(acc[2 * v + 1], _mm_castsi128_ps(_mm_unpackhi_epi16(zero, x)));
    }
  }
  if (mean) {
    const __m128 n = _mm_set1_ps(cnt);
    for (std::size_t v = 0; v < V; ++v) acc[v] = _mm_div_ps(acc[v], n);
  }
  const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7fff);
  const __m128i sign = _mm_set1_epi32(INT32_MIN), qnan = _mm_set1_epi32(0x7fc00000);
  auto* out = reinterpret_cast<__m128i*>(res);
  for (std::size_t v = 0; v < K / 8; ++v) {
    __m128i h[2];
    for (std::size_t j = 0; j < 2; ++j) {
      const __m128 a = acc[2 * v + j];
      const __m128i x = _mm_castps_si128(a);
      const __m128i lsb = _mm_and_si128(_mm_srli_epi32(x, 16), one);
      const __m128i rounded = _mm_add_epi32(x, _mm_add_epi32(bias, lsb));
      const __m128i nan = _mm_or_si128(_mm_and_si128(x, sign), qnan);
      const __m128i is_nan = _mm_castps_si128(_mm_cmpunord_ps(a, a));
      const __m128i pick = _mm_or_si128(_mm_and_si128(is_nan, nan), _mm_andnot_si128(is_nan, rounded));
      h[j] = _mm_srai_epi32(pick, 16);  // in [-32768, 32767]: packs_epi32 keeps the low 16 bits
    }
    _mm_storeu_si128(out + v, _mm_packs_epi32(h[0], h[1]));
  }
}
#endif

}  // namespace detail
}  // namespace cudist
