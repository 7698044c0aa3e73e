// cudist CUDA kernels: scatter one batch into N per-replica buffers (the ceil split rule).
//
// The batch is `total` elements, row-major with the batch dimension first; replica r receives the
// flat elements [r * per, min((r + 1) * per, total)) where per = ceil(B / N) * (elements per row), so
// the first replicas get ceil(B/N) rows and the last ones fewer or none, as tf.distribute splits
// batches. `src` may be device memory or pinned host memory (read over PCIe through unified
// addressing); `dst[r]` may be on any GPU reachable from the launching one.
//
// Launch with grid (x, n_dst): blockIdx.y picks the replica, x is a grid-stride loop over its piece.
#pragma once

#include "common.cuh"

namespace cudist {
namespace kernels {
namespace detail {

template <class T>
struct CopyRange {
  const T* src;
  T* dst;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    store<W>(dst + i, load<W>(src + i));
  }
};

template <class T>
__device__ __forceinline__ void scatter_batch_body(const T* src, const Ptrs<T>& dst, int n_dst, long long per,
                                                   long long total) {
  const int r = (int)blockIdx.y;
  if (r >= n_dst) return;
  T* d = dst.p[0];
#pragma unroll
  for (int k = 1; k < kMaxReplicas; ++k)
    if (k == r) d = dst.p[k];
  const long long begin = (long long)r * per;
  long long end = begin + per;
  if (end > total) end = total;
  if (begin >= end) return;
  CopyRange<T> f{src + begin, d};
  for_each<T>(0, end - begin, aligned16(src + begin) && aligned16(d), f);
}

}  // namespace detail

/// Copies piece r of `src` into dst[r] for r < n_dst (n_dst <= kMaxReplicas; see the file comment).
template <class T>
__global__ void scatter_batch(const T* src, T* const* dst, int n_dst, long long per, long long total) {
  detail::scatter_batch_body<T>(src, detail::load_ptrs(dst, n_dst), n_dst, per, total);
}
template <class T>
__global__ void scatter_batch_packed(const T* src, PtrPack<T> dst, int n_dst, long long per, long long total) {
  detail::scatter_batch_body<T>(src, detail::load_ptrs(dst, n_dst), n_dst, per, total);
}

}  // namespace kernels
}  // namespace cudist
