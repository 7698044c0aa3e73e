// cudist CUDA kernels: all-reduce, reduce-to-one, broadcast, and the two phases of a two-shot
// all-reduce over N replica buffers.
//
// Every kernel comes in two forms with the same body:
//  * `name<T>(T* const* table, ...)`: the replica pointers are read from a small device array of
//    pointers (this is what CuPy's RawModule launches);
//  * `name_packed<T>(PtrPack<T> pack, ...)`: the pointers travel by value in the kernel parameters
//    (this is what the C++ launchers in <cudist/cuda/launch.hpp> use).
// At most kMaxReplicas pointers per launch; the launchers chain launches for more.
// Buffers may live on other GPUs when peer access is enabled (loads and stores go over NVLink /
// PCIe then); pinned host memory works too (unified addressing).
//
// Template arguments T: float, double, __half, int, long long, __nv_bfloat16.
// `divisor`: 0 for SUM; n >= 1 for MEAN over n replicas (the sum is divided by n before it is
// stored). Launch with a 1-D grid of any size: every kernel is a grid-stride loop.
#pragma once

#include "common.cuh"

namespace cudist {
namespace kernels {
namespace detail {

// out[o][i] = (in[0][i] + in[1][i] + ... + in[n_in-1][i]) (/ divisor) for o < n_out.
// In place (out == in) is fine, and so is out of place (out[i] separate buffers, or some of them
// the inputs themselves): each element is read and written by the same thread, reads first.
template <class T>
struct AllReduceOneShot {
  Ptrs<T> in, out;
  int n_in, n_out, divisor;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    const Pack<T, W> s = reduce_packs<T, W>(in, n_in, divisor, i);
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r)
      if (r < n_out) store<W>(out.p[r] + i, s);
  }
};

template <class T>
__device__ __forceinline__ void all_reduce_one_shot_body(const Ptrs<T>& in, int n_in, const Ptrs<T>& out, int n_out,
                                                         long long count, int divisor) {
  AllReduceOneShot<T> f{in, out, n_in, n_out, divisor};
  const bool vec = all_aligned16(in, n_in, 0) && all_aligned16(out, n_out, 0);
  for_each<T>(0, count, vec, f);
}

__device__ __forceinline__ int owner_of(int n, long long chunk, long long i) {
  const long long c = i / chunk;
  return c < n - 1 ? (int)c : n - 1;
}

// Selected with constant indices (unrolled) so that the pointers stay in registers.
template <class T>
__device__ __forceinline__ T* owner_ptr(const Ptrs<T>& bufs, int n, long long chunk, long long i) {
  const int owner = owner_of(n, chunk, i);
  T* p = bufs.p[0];
#pragma unroll
  for (int r = 1; r < kMaxReplicas; ++r)
    if (r == owner) p = bufs.p[r];
  return p;
}

// Two-shot, phase 1 (reduce-scatter): the elements are cut into chunks of `chunk` elements, chunk c
// owned by replica min(c, n-1); each element of [begin, end) is reduced over the n replicas and
// stored into its owner's buffer only.
template <class T>
struct ReduceScatter {
  Ptrs<T> bufs;
  int n, divisor;
  long long chunk;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    const Pack<T, W> s = reduce_packs<T, W>(bufs, n, divisor, i);
    store<W>(owner_ptr(bufs, n, chunk, i) + i, s);
  }
};

// Two-shot, phase 2 (all-gather): each element of [begin, end) is copied from its owner's buffer to
// every other replica.
template <class T>
struct AllGatherChunks {
  Ptrs<T> bufs;
  int n;
  long long chunk;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    const int owner = owner_of(n, chunk, i);
    const Pack<T, W> s = load<W>(owner_ptr(bufs, n, chunk, i) + i);
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r)
      if (r < n && r != owner) store<W>(bufs.p[r] + i, s);
  }
};

// A vector group never straddles two chunks when the chunk length and `begin` are whole vectors.
template <class T>
__device__ __forceinline__ bool chunked_vec_ok(const Ptrs<T>& bufs, int n, long long chunk, long long begin) {
  constexpr int W = vec_width<T>::value;
  return chunk % W == 0 && begin % W == 0 && all_aligned16(bufs, n, begin);
}

template <class T>
__device__ __forceinline__ void reduce_scatter_body(const Ptrs<T>& bufs, int n, long long chunk, long long begin,
                                                    long long end, int divisor) {
  ReduceScatter<T> f{bufs, n, divisor, chunk > 0 ? chunk : 1};
  for_each<T>(begin, end, chunked_vec_ok(bufs, n, f.chunk, begin), f);
}

template <class T>
__device__ __forceinline__ void all_gather_chunks_body(const Ptrs<T>& bufs, int n, long long chunk, long long begin,
                                                       long long end) {
  AllGatherChunks<T> f{bufs, n, chunk > 0 ? chunk : 1};
  for_each<T>(begin, end, chunked_vec_ok(bufs, n, f.chunk, begin), f);
}

// dst[d][i] = src[i] for d < n_dst.
template <class T>
struct Broadcast {
  const T* src;
  Ptrs<T> dst;
  int n_dst;

  template <int W>
  __device__ __forceinline__ void apply(long long i) const {
    const Pack<T, W> s = load<W>(src + i);
#pragma unroll
    for (int r = 0; r < kMaxReplicas; ++r)
      if (r < n_dst) store<W>(dst.p[r] + i, s);
  }
};

template <class T>
__device__ __forceinline__ void broadcast_body(const T* src, const Ptrs<T>& dst, int n_dst, long long count) {
  Broadcast<T> f{src, dst, n_dst};
  for_each<T>(0, count, aligned16(src) && all_aligned16(dst, n_dst, 0), f);
}

}  // namespace detail

/// One-shot all-reduce / reduce-to-one: reads n_in inputs, writes the (divided) sum to n_out outputs.
/// In place (`out` the same table as `in`), out of place (n_out separate outputs, any of them
/// possibly its own input), or reduce-to-one (n_out = 1).
template <class T>
__global__ void all_reduce_one_shot(T* const* in, int n_in, T* const* out, int n_out, long long count, int divisor) {
  detail::all_reduce_one_shot_body<T>(detail::load_ptrs(in, n_in), n_in, detail::load_ptrs(out, n_out), n_out, count,
                                      divisor);
}
template <class T>
__global__ void all_reduce_one_shot_packed(PtrPack<T> in, int n_in, PtrPack<T> out, int n_out, long long count,
                                           int divisor) {
  detail::all_reduce_one_shot_body<T>(detail::load_ptrs(in, n_in), n_in, detail::load_ptrs(out, n_out), n_out, count,
                                      divisor);
}

/// Two-shot phase 1 over elements [begin, end) (see detail::ReduceScatter).
template <class T>
__global__ void reduce_scatter(T* const* bufs, int n, long long chunk, long long begin, long long end, int divisor) {
  detail::reduce_scatter_body<T>(detail::load_ptrs(bufs, n), n, chunk, begin, end, divisor);
}
template <class T>
__global__ void reduce_scatter_packed(PtrPack<T> bufs, int n, long long chunk, long long begin, long long end,
                                      int divisor) {
  detail::reduce_scatter_body<T>(detail::load_ptrs(bufs, n), n, chunk, begin, end, divisor);
}

/// Two-shot phase 2 over elements [begin, end) (see detail::AllGatherChunks).
template <class T>
__global__ void all_gather_chunks(T* const* bufs, int n, long long chunk, long long begin, long long end) {
  detail::all_gather_chunks_body<T>(detail::load_ptrs(bufs, n), n, chunk, begin, end);
}
template <class T>
__global__ void all_gather_chunks_packed(PtrPack<T> bufs, int n, long long chunk, long long begin, long long end) {
  detail::all_gather_chunks_body<T>(detail::load_ptrs(bufs, n), n, chunk, begin, end);
}

/// Copies `src` into n_dst buffers.
template <class T>
__global__ void broadcast(const T* src, T* const* dst, int n_dst, long long count) {
  detail::broadcast_body<T>(src, detail::load_ptrs(dst, n_dst), n_dst, count);
}
template <class T>
__global__ void broadcast_packed(const T* src, PtrPack<T> dst, int n_dst, long long count) {
  detail::broadcast_body<T>(src, detail::load_ptrs(dst, n_dst), n_dst, count);
}

}  // namespace kernels
}  // namespace cudist
