/// @file detail/store.hpp
/// @brief Block copies with optional non-temporal (streaming) stores (private).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define CUDIST_HAVE_SSE2 1
#endif

namespace cudist {
namespace detail {

/// Copies ``bytes`` from ``src`` to ``dst`` (no overlap). With ``stream``, the bulk goes through
/// non-temporal stores, which write whole lines to memory without reading them first and without
/// evicting the working set; the unaligned head and the tail use ordinary stores.
///
/// After streaming stores a thread must call store_fence() before others may read the data.
inline void copy_block(void* dst, const void* src, std::size_t bytes, bool stream) noexcept {
#ifdef CUDIST_HAVE_SSE2
  if (stream && bytes >= 64) {
    auto* d = static_cast<unsigned char*>(dst);
    auto* s = static_cast<const unsigned char*>(src);
    const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    const std::size_t vecs = bytes / 16;
    for (std::size_t i = 0; i < vecs; ++i) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(d) + i, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s) + i));
    }
    std::memcpy(d + vecs * 16, s + vecs * 16, bytes - vecs * 16);
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

/// Size of a cache line, the unit of the fused loops.
constexpr std::size_t kLineBytes = 64;

/// Writes the K values of one cache line's worth, ``src`` to ``dst``; streaming when asked and
/// ``dst`` is 16-byte aligned.
template <class T, std::size_t K>
inline void store_line(T* dst, const T* src, bool stream) noexcept {
#ifdef CUDIST_HAVE_SSE2
  static_assert(K * sizeof(T) % 16 == 0, "a line is whole 16-byte vectors");
  if (stream && (reinterpret_cast<std::uintptr_t>(dst) & 15) == 0) {
    for (std::size_t v = 0; v < K * sizeof(T) / 16; ++v)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst) + v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src) + v));
    return;
  }
#endif
  (void)stream;
  for (std::size_t k = 0; k < K; ++k) dst[k] = src[k];
}

/// Orders this thread's streaming stores before its later stores (a no-op without SSE2).
inline void store_fence() noexcept {
#ifdef CUDIST_HAVE_SSE2
  _mm_sfence();
#endif
}

}  // namespace detail
}  // namespace cudist
