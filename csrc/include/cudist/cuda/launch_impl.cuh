/// @file cuda/launch_impl.cuh
/// @brief Definitions of the launchers declared in <cudist/cuda/launch.hpp> (nvcc only).
///
/// Include this instead of launch.hpp from a .cu file to instantiate the launchers yourself
/// (no need to link cudist::cuda). It must come before any include of launch.hpp in that file.
#pragma once

#ifndef CUDIST_CUDA_IMPLEMENTATION
#define CUDIST_CUDA_IMPLEMENTATION 1
#endif

#include <initializer_list>
#include <type_traits>

#include "../kernels/kernels.cuh"
#include "launch.hpp"

// Every launch goes through this macro so that a host emulation (tests/emu) can run the very same
// launchers without nvcc by defining it, before including this file, to a loop over the grid.
#ifndef CUDIST_LAUNCH_KERNEL
#define CUDIST_LAUNCH_KERNEL(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

namespace cudist {
namespace cuda {
namespace detail {

using kernels::kMaxReplicas;
using kernels::PtrPack;

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU (132 SMs x 8 resident blocks of 256 threads on an H100);
// the kernels are grid-stride loops, so bigger buffers just loop.
constexpr long long kMaxBlocks = 2048;

template <class T>
inline dim3 grid_for(long long count, unsigned y = 1) {
  const long long groups = (count + kernels::detail::vec_width<T>::value - 1) / kernels::detail::vec_width<T>::value;
  long long blocks = (groups + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return dim3((unsigned)blocks, y, 1);
}

template <class T>
inline PtrPack<T> pack(T* const* ptrs, int n) {
  PtrPack<T> p{};
  for (int i = 0; i < n && i < kMaxReplicas; ++i) p.p[i] = ptrs[i];
  return p;
}

inline bool bad_args(const void* ptrs, int n, long long count) { return ptrs == nullptr || n < 1 || count < 0; }

inline int divisor_for(reduce_op op, int n) { return op == reduce_op::mean ? n : 0; }

inline bool valid_op(reduce_op op) { return op == reduce_op::sum || op == reduce_op::mean; }

// Two-shot chunk length: ceil(count / n) rounded up to whole 16-byte vectors, so that no vector
// straddles two owners. Chunk r is owned by replica r (the last one also takes any remainder).
template <class T>
inline long long two_shot_chunk(long long count, int n) {
  constexpr int W = kernels::detail::vec_width<T>::value;
  const long long chunk = (count + n - 1) / n;
  return (chunk + W - 1) / W * W;
}

// Copies dsts[first..n) from src, kMaxReplicas destinations per launch.
template <class T>
cudaError_t broadcast_from(const T* src, T* const* dsts, int first, int n, long long count, cudaStream_t stream) {
  for (int g = first; g < n; g += kMaxReplicas) {
    const int m = n - g < kMaxReplicas ? n - g : kMaxReplicas;
    CUDIST_LAUNCH_KERNEL(kernels::broadcast_packed<T>, grid_for<T>(count), kThreads, stream, src, pack(dsts + g, m), m,
                         count);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// The 16-bit floats' sums accumulate in float32 and round once (the contract): a running sum kept
// in __half / __nv_bfloat16 between the passes of more than kMaxReplicas buffers would round at
// every pass.
template <class T>
constexpr bool rounds_between_passes() {
  return std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;
}

// Reduces bufs[0..n) into `out` (and, on the last pass, also into extra[0..n_extra), n_extra <
// kMaxReplicas). More than kMaxReplicas inputs: the running sum is kept in `out` between passes,
// which preserves the order ((b0 + b1) + ...) exactly since every partial sum of those types is
// rounded to T anyway; the 16-bit floats refuse them (cudaErrorNotSupported, see
// rounds_between_passes).
template <class T>
cudaError_t reduce_into(const T* const* bufs, int n, T* out, T* const* extra, int n_extra, long long count,
                        int divisor, cudaStream_t stream) {
  if (rounds_between_passes<T>() && n > kMaxReplicas) return cudaErrorNotSupported;
  int done = 0;
  while (done < n) {
    PtrPack<T> in{};
    int n_in = 0;
    if (done > 0) in.p[n_in++] = out;  // the running sum
    while (n_in < kMaxReplicas && done < n) in.p[n_in++] = const_cast<T*>(bufs[done++]);  // only read
    const bool last = done == n;
    PtrPack<T> outs{};
    int n_out = 0;
    outs.p[n_out++] = out;
    if (last)
      for (int i = 0; i < n_extra; ++i) outs.p[n_out++] = extra[i];
    CUDIST_LAUNCH_KERNEL(kernels::all_reduce_one_shot_packed<T>, grid_for<T>(count), kThreads, stream, in, n_in, outs,
                         n_out, count, last ? divisor : 0);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace detail

template <class T>
cudaError_t all_reduce(T* const* bufs, int n, long long count, reduce_op op, cudaStream_t stream) {
  if (detail::bad_args(bufs, n, count) || !detail::valid_op(op)) return cudaErrorInvalidValue;
  if (n == 1 || count == 0) return cudaSuccess;
  const int divisor = detail::divisor_for(op, n);
  if (n <= detail::kMaxReplicas) {
    CUDIST_LAUNCH_KERNEL(kernels::all_reduce_one_shot_packed<T>, detail::grid_for<T>(count), detail::kThreads, stream,
                         detail::pack(bufs, n), n, detail::pack(bufs, n), n, count, divisor);
    return cudaGetLastError();
  }
  // The running sum lives in bufs[0]: it is consumed by the first pass before being overwritten.
  const cudaError_t e =
      detail::reduce_into<T>(bufs, n, bufs[0], bufs + 1, detail::kMaxReplicas - 1, count, divisor, stream);
  if (e != cudaSuccess) return e;
  return detail::broadcast_from<T>(bufs[0], bufs, detail::kMaxReplicas, n, count, stream);
}

template <class T>
cudaError_t all_reduce(const T* const* in, T* const* out, int n, long long count, reduce_op op, cudaStream_t stream) {
  if (detail::bad_args(in, n, count) || out == nullptr || !detail::valid_op(op)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const int divisor = detail::divisor_for(op, n);
  if (n <= detail::kMaxReplicas) {
    detail::PtrPack<T> ins{};
    for (int i = 0; i < n; ++i) ins.p[i] = const_cast<T*>(in[i]);  // only read
    CUDIST_LAUNCH_KERNEL(kernels::all_reduce_one_shot_packed<T>, detail::grid_for<T>(count), detail::kThreads, stream,
                         ins, n, detail::pack(out, n), n, count, divisor);
    return cudaGetLastError();
  }
  // The running sum lives in out[0], which is no input of a later pass (outputs are their own
  // inputs at most, and in[0] is consumed by the first pass).
  const cudaError_t e = detail::reduce_into<T>(in, n, out[0], out + 1, detail::kMaxReplicas - 1, count, divisor, stream);
  if (e != cudaSuccess) return e;
  return detail::broadcast_from<T>(out[0], out, detail::kMaxReplicas, n, count, stream);
}

template <class T>
cudaError_t all_reduce_two_shot(T* const* bufs, int n, long long count, reduce_op op, cudaStream_t stream) {
  if (detail::bad_args(bufs, n, count) || !detail::valid_op(op)) return cudaErrorInvalidValue;
  if (n == 1 || count == 0) return cudaSuccess;
  if (n > detail::kMaxReplicas) return all_reduce(bufs, n, count, op, stream);
  const long long chunk = detail::two_shot_chunk<T>(count, n);
  const detail::PtrPack<T> p = detail::pack(bufs, n);
  const dim3 grid = detail::grid_for<T>(count);
  CUDIST_LAUNCH_KERNEL(kernels::reduce_scatter_packed<T>, grid, detail::kThreads, stream, p, n, chunk, 0, count,
                       detail::divisor_for(op, n));
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  CUDIST_LAUNCH_KERNEL(kernels::all_gather_chunks_packed<T>, grid, detail::kThreads, stream, p, n, chunk, 0, count);
  return cudaGetLastError();
}

template <class T>
cudaError_t reduce_to_one(T* const* bufs, int n, T* out, long long count, reduce_op op, cudaStream_t stream) {
  if (detail::bad_args(bufs, n, count) || out == nullptr || !detail::valid_op(op)) return cudaErrorInvalidValue;
  // With several passes `out` holds the running sum, so it must not be an input of a later pass.
  for (int i = detail::kMaxReplicas; i < n; ++i)
    if (bufs[i] == out) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  return detail::reduce_into<T>(bufs, n, out, bufs, 0, count, detail::divisor_for(op, n), stream);
}

template <class T>
cudaError_t broadcast(const T* src, T* const* dsts, int n, long long count, cudaStream_t stream) {
  if (detail::bad_args(dsts, n, count) || src == nullptr) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  return detail::broadcast_from(src, dsts, 0, n, count, stream);
}

template <class T>
cudaError_t scatter_batch(const T* src, T* const* dsts, int n, long long batch, long long row_elems,
                          cudaStream_t stream) {
  if (detail::bad_args(dsts, n, batch) || row_elems < 0 || (src == nullptr && batch * row_elems > 0))
    return cudaErrorInvalidValue;
  const long long total = batch * row_elems;
  if (total == 0) return cudaSuccess;
  const long long per = (batch + n - 1) / n * row_elems;
  for (int g = 0; g < n; g += detail::kMaxReplicas) {
    const int m = n - g < detail::kMaxReplicas ? n - g : detail::kMaxReplicas;
    const long long begin = (long long)g * per;
    if (begin >= total) break;  // the remaining replicas get empty pieces
    CUDIST_LAUNCH_KERNEL(kernels::scatter_batch_packed<T>, detail::grid_for<T>(per, (unsigned)m), detail::kThreads,
                         stream, src + begin, detail::pack(dsts + g, m), m, per, total - begin);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <class T>
cudaError_t assign_add(T* const* copies, int n, const T* value, long long count, bool negate, cudaStream_t stream) {
  if (detail::bad_args(copies, n, count) || value == nullptr) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const int m = n < detail::kMaxReplicas ? n : detail::kMaxReplicas;
  CUDIST_LAUNCH_KERNEL(kernels::mirrored_assign_add_packed<T>, detail::grid_for<T>(count), detail::kThreads, stream,
                       detail::pack(copies, m), m, value, count, negate ? 1 : 0);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return detail::broadcast_from<T>(copies[0], copies, m, n, count, stream);
}

namespace detail {

// The gradients of a fused update as at most kMaxReplicas pointers: more are first reduced (in
// replica order, so bit-identical) into a stream-ordered temporary `*tmp`, which the caller frees
// with cudaFreeAsync after its launch.
template <class T>
cudaError_t grads_pack(const T* const* grads, int m, long long count, cudaStream_t stream, PtrPack<T>& pack,
                       int& n_pack, T** tmp) {
  *tmp = nullptr;
  if (m <= kMaxReplicas) {
    for (int i = 0; i < m; ++i) pack.p[i] = const_cast<T*>(grads[i]);  // only read
    n_pack = m;
    return cudaSuccess;
  }
  if (rounds_between_passes<T>()) return cudaErrorNotSupported;  // the temporary would round the head's sum
  // Reduce all but the last kMaxReplicas - 1 into the temporary; the kernel adds those in order.
  const int head = m - (kMaxReplicas - 1);
  cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(tmp), static_cast<size_t>(count) * sizeof(T), stream);
  if (e != cudaSuccess) return e;
  e = reduce_into<T>(grads, head, *tmp, nullptr, 0, count, 0, stream);
  if (e != cudaSuccess) {
    cudaFreeAsync(*tmp, stream);
    *tmp = nullptr;
    return e;
  }
  pack.p[0] = *tmp;
  for (int i = 0; i < kMaxReplicas - 1; ++i) pack.p[1 + i] = const_cast<T*>(grads[head + i]);
  n_pack = kMaxReplicas;
  return cudaSuccess;
}

inline bool bad_grads(const void* grads, int m) { return grads == nullptr || m < 1; }

}  // namespace detail

namespace detail {
// The fused updates of the rules' table: the gradients packed (more than kMaxReplicas
// pre-reduced), `launch(k, grads, n_grads)` on copies [0, k) of every group, then copy 0 of each
// group broadcast to the other copies.
template <class T, class Launch>
cudaError_t run_fused(std::initializer_list<T* const*> groups, int n, const T* const* grads, int m, long long count,
                      cudaStream_t stream, Launch&& launch) {
  PtrPack<T> g{};
  int ng = 0;
  T* tmp = nullptr;
  cudaError_t e = grads_pack<T>(grads, m, count, stream, g, ng, &tmp);
  if (e != cudaSuccess) return e;
  const int k = n < kMaxReplicas ? n : kMaxReplicas;
  launch(k, g, ng);
  e = cudaGetLastError();
  if (tmp != nullptr) cudaFreeAsync(tmp, stream);
  if (e != cudaSuccess) return e;
  for (T* const* group : groups) {
    e = broadcast_from<T>(group[0], group, k, n, count, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
}  // namespace detail

template <class T>
cudaError_t reduce_unscale_finite(const T* const* grads, int m, T* out, long long count, double scale, int* flag,
                                  cudaStream_t stream) {
  using C = typename kernels::detail::compute<T>::type;
  if (detail::bad_grads(grads, m) || out == nullptr || flag == nullptr || count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  detail::PtrPack<T> g{};
  int ng = 0;
  T* tmp = nullptr;
  cudaError_t e = detail::grads_pack<T>(grads, m, count, stream, g, ng, &tmp);
  if (e != cudaSuccess) return e;
  CUDIST_LAUNCH_KERNEL(kernels::reduce_unscale_finite_packed<T>, detail::grid_for<T>(count), detail::kThreads, stream, g,
                       ng, out, count, static_cast<C>(scale), flag);
  e = cudaGetLastError();
  if (tmp != nullptr) cudaFreeAsync(tmp, stream);
  return e;
}

// The launchers of CUDIST_UPDATE_RULE_LIST's kernels (declared in <cudist/cuda/launch.hpp>): every
// slot must be given; the fused form runs the rule's kernel over the slots then the copies.
#define CUDIST_CUDA_RULE_NULL_(A, slot) || slot##s == nullptr
#define CUDIST_CUDA_RULE_PACK_(A, slot) detail::pack(slot##s, k),
#define CUDIST_CUDA_RULE_CAST_(A, h) static_cast<C>(h),
#define CUDIST_CUDA_RULE_DEFINE_(A, name, rule, slots, hyper)                                                        \
  template <class T>                                                                                               \
  cudaError_t all_reduce_##name(T* const* copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, T* const*, slots) int n,          \
                                const T* const* grads, int m, CUDIST_PP_MAP(CUDIST_PP_TRAIL, double, hyper)         \
                                double decay, long long count, cudaStream_t stream) {                              \
    using C = typename kernels::detail::compute<T>::type;                                                          \
    if (detail::bad_args(copies, n, count) CUDIST_PP_MAP(CUDIST_CUDA_RULE_NULL_, ~, slots) ||                      \
        detail::bad_grads(grads, m))                                                                               \
      return cudaErrorInvalidValue;                                                                                \
    if (count == 0) return cudaSuccess;                                                                            \
    return detail::run_fused<T>({CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, , slots) copies}, n, grads, m, count, stream,     \
                                [&](int k, const detail::PtrPack<T>& g, int ng) {                                  \
      CUDIST_LAUNCH_KERNEL(kernels::mirrored_all_reduce_##name##_packed<T>, detail::grid_for<T>(count),           \
                           detail::kThreads, stream, detail::pack(copies, k),                                       \
                           CUDIST_PP_MAP(CUDIST_CUDA_RULE_PACK_, ~, slots) k, g, ng,                                \
                           CUDIST_PP_MAP(CUDIST_CUDA_RULE_CAST_, ~, hyper) static_cast<C>(decay), count);            \
    });                                                                                                            \
  }                                                                                                                \
  template <class T>                                                                                               \
  cudaError_t name(T* const* copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, T* const*, slots) int n, const T* grad,       \
                   CUDIST_PP_MAP(CUDIST_PP_TRAIL, double, hyper) double decay, long long count,                    \
                   cudaStream_t stream) {                                                                          \
    if (grad == nullptr) return cudaErrorInvalidValue;                                                             \
    return all_reduce_##name<T>(copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, , slots) n, &grad, 1,                     \
                                CUDIST_PP_MAP(CUDIST_PP_TRAIL, , hyper) decay, count, stream);                     \
  }
CUDIST_UPDATE_RULE_LIST(CUDIST_CUDA_RULE_DEFINE_, ~)
#undef CUDIST_CUDA_RULE_DEFINE_
#undef CUDIST_CUDA_RULE_CAST_
#undef CUDIST_CUDA_RULE_PACK_
#undef CUDIST_CUDA_RULE_NULL_
}  // namespace cuda
}  // namespace cudist
