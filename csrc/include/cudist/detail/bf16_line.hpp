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

#include <atomic>
#include <cstddef>
#include <cstdint>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define CUDIST_BF16_SSE2 1
#endif

// AVX2 built beside the SSE2 baseline and picked at run time (GCC/Clang on x86-64): the package is
// built for plain x86-64, and the kernel is compute-bound at bfloat16's half bytes on busy cores.
#if defined(CUDIST_BF16_SSE2) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && \
    !defined(__CUDACC__) && !defined(__NVCC__)
#include <immintrin.h>
#define CUDIST_BF16_AVX2 1
#endif

#include "../bfloat16.hpp"

namespace cudist {
namespace detail {

#ifdef CUDIST_BF16_SSE2
/// ``a + b`` with ``a`` the instruction's first operand, whose NaN x86 returns when both are NaN
/// (NumPy's sum keeps the first NaN's sign). Compilers treat the intrinsic's addition as commutative
/// and may swap its operands (seen: GCC -O3 on a standalone build gave the second NaN's sign).
inline __m128 add_keep_first_nan(__m128 a, __m128 b) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  asm("addps %1, %0" : "+x"(a) : "x"(b));
  return a;
#else
  return _mm_add_ps(a, b);
#endif
}

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
      acc[2 * v] = add_keep_first_nan(acc[2 * v], _mm_castsi128_ps(_mm_unpacklo_epi16(zero, x)));
      acc[2 * v + 1] = add_keep_first_nan(acc[2 * v + 1], _mm_castsi128_ps(_mm_unpackhi_epi16(zero, x)));
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

#ifdef CUDIST_BF16_AVX2
/// Whether the CPU runs AVX2 (asked once).
inline bool cpu_has_avx2() noexcept {
  static const bool has = __builtin_cpu_supports("avx2") != 0;
  return has;
}

/// -1: pick by the CPU; 0: the SSE2 kernel; 1: AVX2 where the CPU has it. Set by tests and A/B
/// benchmarks (``cudist._core.bf16_simd``) to run both kernels on the same data in one process.
inline std::atomic<int>& bf16_simd_choice() noexcept {
  static std::atomic<int> choice{-1};
  return choice;
}

/// Whether the bfloat16 reduction uses the AVX2 line kernel.
inline bool bf16_use_avx2() noexcept {
  return bf16_simd_choice().load(std::memory_order_relaxed) != 0 && cpu_has_avx2();
}

/// add_keep_first_nan() of 8 floats.
__attribute__((target("avx2"))) inline __m256 add_keep_first_nan(__m256 a, __m256 b) noexcept {
  __m256 r;
  asm("vaddps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
  return r;
}

/// reduce_line_bf16() in AVX2: 16 elements a vector, the same operations in the same order on each
/// element (unpack to float32, float32 adds in replica order, the division of a mean, the rounding),
/// so the bits are the SSE2 kernel's. The unpacks and ``packs_epi32`` work within 128-bit lanes, so
/// unpacking low/high halves and packing them back restores the element order.
template <std::size_t K>
__attribute__((target("avx2"))) void reduce_line_bf16_avx2(const bfloat16* const* in, std::size_t n_in,
                                                           std::size_t i, bool mean, float cnt,
                                                           bfloat16* res) noexcept {
  static_assert(K % 16 == 0, "a line holds whole vectors of 16 bfloat16");
  constexpr std::size_t X = K / 16;  // 256-bit loads of 16 bfloat16 per line
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[2 * X];
  {
    const auto* p = reinterpret_cast<const __m256i*>(in[0] + i);
    for (std::size_t v = 0; v < X; ++v) {
      const __m256i x = _mm256_loadu_si256(p + v);
      acc[2 * v] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
      acc[2 * v + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
    }
  }
  for (std::size_t r = 1; r < n_in; ++r) {
    const auto* p = reinterpret_cast<const __m256i*>(in[r] + i);
    for (std::size_t v = 0; v < X; ++v) {
      const __m256i x = _mm256_loadu_si256(p + v);
      acc[2 * v] = add_keep_first_nan(acc[2 * v], _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)));
      acc[2 * v + 1] = add_keep_first_nan(acc[2 * v + 1], _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)));
    }
  }
  if (mean) {
    const __m256 n = _mm256_set1_ps(cnt);
    for (std::size_t v = 0; v < 2 * X; ++v) acc[v] = _mm256_div_ps(acc[v], n);
  }
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i sign = _mm256_set1_epi32(INT32_MIN), qnan = _mm256_set1_epi32(0x7fc00000);
  auto* out = reinterpret_cast<__m256i*>(res);
  for (std::size_t v = 0; v < X; ++v) {
    __m256i h[2];
    for (std::size_t j = 0; j < 2; ++j) {
      const __m256 a = acc[2 * v + j];
      const __m256i x = _mm256_castps_si256(a);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
      const __m256i rounded = _mm256_add_epi32(x, _mm256_add_epi32(bias, lsb));
      const __m256i nan = _mm256_or_si256(_mm256_and_si256(x, sign), qnan);
      const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      h[j] = _mm256_srai_epi32(_mm256_blendv_epi8(rounded, nan, is_nan), 16);
    }
    _mm256_storeu_si256(out + v, _mm256_packs_epi32(h[0], h[1]));
  }
}
#endif

}  // namespace detail
}  // namespace cudist
