/// @file cuda/launch.hpp
/// @brief Host-side launchers of cudist's CUDA kernels (<cudist/kernels/*.cuh>) on a CUDA stream.
///
/// Plain C++ (no CUDA syntax): include it from any compiler that sees the CUDA headers and link the
/// `cudist::cuda` library (built when cudist is configured with -DCUDIST_WITH_CUDA=ON), which holds
/// the definitions for T = float, double, __half, int and long long (the updates) and
/// __nv_bfloat16 (the collectives, the batch scatter and assign_add). Code compiled by nvcc may
/// instead include <cudist/cuda/launch_impl.cuh> and get the templates themselves.
///
/// Conventions shared by every launcher:
///  * replica buffers are given as a host array of `n` device pointers (n >= 1; any n: more than
///    cudist::kernels::kMaxReplicas are handled in several launches, summation order unchanged;
///    except float16 and bfloat16 sums, which accumulate in float32 and round once: more than
///    kMaxReplicas such buffers to sum in one call return cudaErrorNotSupported (cudist's CuPy
///    backend sums those on the host));
///  * `count` is the number of elements of each buffer;
///  * the work is enqueued on `stream` and the call returns without synchronizing; buffers on other
///    GPUs must be reachable from the current device (peer access enabled, or pinned host memory);
///  * the return value is the launch status (cudaSuccess, cudaErrorInvalidValue for bad arguments,
///    or the error of the failed launch).
/// The numerics are those of cudist's kernel contract: replica-order sums in the buffer type (float16
/// and bfloat16 in float32, rounded once to nearest even; a bfloat16 NaN comes out as
/// ml_dtypes' 0x7fc0 with its sign), MEAN
/// as a true division (floats) or truncation toward zero (integers), float16 updates computed in
/// float32; results equal cudist's NumPy reference bit for bit (up to float32 subnormals when the
/// kernels are built with flush-to-zero).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "../detail/update_rules.hpp"
#include "../kernels/kernel_list.cuh"
#include "../reduce_op.hpp"

namespace cudist {
namespace cuda {

/// Reduces the n buffers elementwise (SUM or MEAN) and writes the result into every one of them,
/// in one fused pass (each element read n times and written n times).
template <class T>
cudaError_t all_reduce(T* const* bufs, int n, long long count, reduce_op op, cudaStream_t stream = nullptr);

/// Out of place: reduces the n buffers `in` elementwise and writes the result into the n buffers
/// `out`, in one fused pass (each input read once, each output written once). `out[i]` may be
/// `in[i]` itself; outputs must not otherwise overlap inputs or each other.
template <class T>
cudaError_t all_reduce(const T* const* in, T* const* out, int n, long long count, reduce_op op,
                       cudaStream_t stream = nullptr);

/// The same result as all_reduce, as a reduce-scatter followed by an all-gather (two launches).
/// Moves the same bytes on one GPU; across GPUs it spreads the traffic over the links.
template <class T>
cudaError_t all_reduce_two_shot(T* const* bufs, int n, long long count, reduce_op op, cudaStream_t stream = nullptr);

/// Reduces the n buffers into `out`, which may be one of bufs[0..7] (or any bufs[i] when n <= 8).
template <class T>
cudaError_t reduce_to_one(T* const* bufs, int n, T* out, long long count, reduce_op op,
                          cudaStream_t stream = nullptr);

/// Copies `src` into the n buffers `dsts`.
template <class T>
cudaError_t broadcast(const T* src, T* const* dsts, int n, long long count, cudaStream_t stream = nullptr);

/// Splits a batch of `batch` rows of `row_elems` elements into n per-replica buffers by the ceil
/// rule (ceil(batch/n) rows each, the last ones fewer or none). `src` may be pinned host memory.
template <class T>
cudaError_t scatter_batch(const T* src, T* const* dsts, int n, long long batch, long long row_elems,
                          cudaStream_t stream = nullptr);

/// Every copy becomes copies[0] + value (or copies[0] - value when `negate`).
template <class T>
cudaError_t assign_add(T* const* copies, int n, const T* value, long long count, bool negate,
                       cudaStream_t stream = nullptr);

/// LossScaleOptimizer's reduction with its finiteness check in the same pass: `out` becomes the sum
/// of the m gradients (replica order, as the fused updates sum them) divided by `scale` (in the
/// compute type, rounded once), and `*flag` (a device int) becomes 1 when some element of `out`
/// is inf or NaN -- it is left as it was otherwise, so zero it once, launch for every variable,
/// and read it once. `out` must not overlap a gradient.
template <class T>
cudaError_t reduce_unscale_finite(const T* const* grads, int m, T* out, long long count, double scale, int* flag,
                                  cudaStream_t stream = nullptr);

/// For each row X(A, name, rule, (slots), (hyper)) of CUDIST_UPDATE_RULE_LIST (<cudist/detail/update_rules.hpp>;
/// cudist's kernel contract, Keras 3 formulas), generated (the rule's hyper-parameters as the table
/// names them): the plain update on the n copies from `grad`, and the fused all-reduce form from the
/// m gradients `grads` (summed in replica order in T; more than kMaxReplicas
/// are first reduced into a stream-ordered temporary); `decay` is the decoupled weight decay
/// (weight_decay * lr: w -= w * decay first; 0: none); gradients must not overlap what is written:
///   name(copies, <slot>s..., n, grad, hyper..., decay, count, stream)
///   all_reduce_name(copies, <slot>s..., n, grads, m, hyper..., decay, count, stream)
/// with every `<slot>s` a host array of the n device pointers of that slot's copies.
#define CUDIST_CUDA_RULE_DECLARE_(A, name, rule, slots, hyper)                                                      \
  template <class T>                                                                                              \
  cudaError_t name(T* const* copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, T* const*, slots) int n, const T* grad,      \
                   CUDIST_PP_MAP(CUDIST_PP_TRAIL, double, hyper) double decay, long long count,                   \
                   cudaStream_t stream = nullptr);                                                                \
  template <class T>                                                                                              \
  cudaError_t all_reduce_##name(T* const* copies, CUDIST_PP_MAP(CUDIST_PP_TRAIL_S, T* const*, slots) int n,         \
                                const T* const* grads, int m, CUDIST_PP_MAP(CUDIST_PP_TRAIL, double, hyper)        \
                                double decay, long long count, cudaStream_t stream = nullptr);
CUDIST_UPDATE_RULE_LIST(CUDIST_CUDA_RULE_DECLARE_, ~)
#undef CUDIST_CUDA_RULE_DECLARE_

/// The launchers, declared once: CUDIST_CUDA_LAUNCHERS_<kernel>(L, T, name) lists, for each kernel
/// of CUDIST_KERNELS (<cudist/kernels/kernel_list.cuh>), the launchers built on it as
/// L(header, launcher, T, (parameters)), `header` being `launch` (this file) or `p2p`
/// (<cudist/cuda/p2p.hpp>). A launcher is instantiated for the dtypes of the kernel it is listed
/// under, so the launchers and the CuPy backend's NVRTC name expressions come from one list; the
/// kernels a launcher launches besides (broadcast, for the copies past kMaxReplicas) support every
/// dtype.
#define CUDIST_CUDA_LAUNCHERS_all_reduce_one_shot(L, T, name)                                                   \
  L(launch, all_reduce, T, (T* const*, int, long long, reduce_op, cudaStream_t))                                \
  L(launch, all_reduce, T, (const T* const*, T* const*, int, long long, reduce_op, cudaStream_t))               \
  L(launch, reduce_to_one, T, (T* const*, int, T*, long long, reduce_op, cudaStream_t))
#define CUDIST_CUDA_LAUNCHERS_reduce_scatter(L, T, name)                                                        \
  L(launch, all_reduce_two_shot, T, (T* const*, int, long long, reduce_op, cudaStream_t))                       \
  L(p2p, p2p_all_reduce, T, (T* const*, const int*, const cudaStream_t*, int, long long, reduce_op))
#define CUDIST_CUDA_LAUNCHERS_all_gather_chunks(L, T, name)  // the second phase of the two above
#define CUDIST_CUDA_LAUNCHERS_broadcast(L, T, name)                                                             \
  L(launch, broadcast, T, (const T*, T* const*, int, long long, cudaStream_t))
#define CUDIST_CUDA_LAUNCHERS_scatter_batch(L, T, name)                                                         \
  L(launch, scatter_batch, T, (const T*, T* const*, int, long long, long long, cudaStream_t))
#define CUDIST_CUDA_LAUNCHERS_mirrored_assign_add(L, T, name)                                                   \
  L(launch, assign_add, T, (T* const*, int, const T*, long long, bool, cudaStream_t))
#define CUDIST_CUDA_LAUNCHERS_reduce_unscale_finite(L, T, name)                                                 \
  L(launch, reduce_unscale_finite, T, (const T* const*, int, T*, long long, double, int*, cudaStream_t))
/// L(header, launcher, T, (parameters)) for every launcher and every dtype of the kernel it is
/// listed under (a kernel of CUDIST_KERNELS without a CUDIST_CUDA_LAUNCHERS_<kernel> is an error).
/// The launchers of the rules' kernels are generated from CUDIST_UPDATE_RULE_LIST (float dtypes).
#define CUDIST_CUDA_FOR_EACH_LAUNCHER(L)                    \
  CUDIST_KERNELS(CUDIST_CUDA_KERNEL_LAUNCHERS_, L)          \
  CUDIST_UPDATE_RULE_LIST(CUDIST_CUDA_RULE_LAUNCHERS_, L)
#define CUDIST_CUDA_KERNEL_LAUNCHERS_(L, kernel, SET) CUDIST_DTYPES_##SET(CUDIST_CUDA_LAUNCHERS_##kernel, L)
#define CUDIST_CUDA_RULE_LAUNCHERS_(L, name, rule, slots, hyper) \
  CUDIST_DTYPES_FLOAT(CUDIST_CUDA_RULE_LAUNCHERS_T_, (L, name, slots, hyper))
#define CUDIST_CUDA_RULE_LAUNCHERS_T_(A, T, dtype) CUDIST_CUDA_RULE_LAUNCHERS_T2_(CUDIST_PP_REM A, T)
#define CUDIST_CUDA_RULE_LAUNCHERS_T2_(...) CUDIST_CUDA_RULE_LAUNCHERS_T3_(__VA_ARGS__)
#define CUDIST_CUDA_RULE_LAUNCHERS_T3_(L, name, slots, hyper, T)                                                   \
  L(launch, name, T,                                                                                            \
    (T* const*, CUDIST_PP_MAP(CUDIST_PP_TYPE, T* const*, slots) int, const T*,                                  \
     CUDIST_PP_MAP(CUDIST_PP_TYPE, double, hyper) double, long long, cudaStream_t))                             \
  L(launch, all_reduce_##name, T,                                                                               \
    (T* const*, CUDIST_PP_MAP(CUDIST_PP_TYPE, T* const*, slots) int, const T* const*, int,                       \
     CUDIST_PP_MAP(CUDIST_PP_TYPE, double, hyper) double, long long, cudaStream_t))

// The definitions live in the cudist::cuda library (csrc/src/cuda/launch.cu).
#ifndef CUDIST_CUDA_IMPLEMENTATION
#define CUDIST_CUDA_DECLARE_(header, launcher, T, params) CUDIST_CUDA_DECLARE_##header(launcher, T, params)
#define CUDIST_CUDA_DECLARE_launch(launcher, T, params) extern template cudaError_t launcher<T> params;
#define CUDIST_CUDA_DECLARE_p2p(launcher, T, params)  // declared by <cudist/cuda/p2p.hpp>
CUDIST_CUDA_FOR_EACH_LAUNCHER(CUDIST_CUDA_DECLARE_)
#undef CUDIST_CUDA_DECLARE_
#undef CUDIST_CUDA_DECLARE_launch
#undef CUDIST_CUDA_DECLARE_p2p
#endif

}  // namespace cuda
}  // namespace cudist
