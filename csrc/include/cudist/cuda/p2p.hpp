/// @file cuda/p2p.hpp
/// @brief Multi-GPU all-reduce over peer-to-peer memory access, launched from one host call.
///
/// Plain C++ (no CUDA syntax), like <cudist/cuda/launch.hpp>: link `cudist::cuda` for T = float,
/// double, __half, int, long long and __nv_bfloat16, or include <cudist/cuda/p2p_impl.cuh> from a
/// .cu file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "../reduce_op.hpp"
#include "launch.hpp"  // CUDIST_CUDA_FOR_EACH_LAUNCHER

namespace cudist {
namespace cuda {

/// All-reduces n buffers of `count` elements, buffer r living on GPU devices[r], in place: every
/// buffer ends up holding the replica-order reduction (SUM or MEAN) of all of them, bit for bit the
/// result of all_reduce() and of cudist's NumPy reference.
///
/// Two-shot, one launch per buffer and phase: the elements are cut into n chunks of whole 16-byte
/// vectors; buffer r's GPU reduces chunk r of every buffer into buffer r (reduce-scatter), then
/// copies it into the other buffers (all-gather). Each GPU reads and writes the others' memory
/// directly, so the traffic spreads over all the links instead of funnelling through one GPU.
///
///  * streams: streams[r] is a stream of devices[r] (nullptr: that device's legacy default stream);
///    `streams` itself may be nullptr (every device's default stream). The work starts after what is
///    already enqueued on all of the streams and, when the call returns, every stream's later work
///    sees the result (events make the streams wait for each other). The host does not wait.
///  * devices may repeat (several replicas on one GPU). Peer access is enabled between every pair of
///    distinct devices, in both directions (already-enabled pairs are fine); it stays enabled.
///  * when every buffer is on the same GPU, or n exceeds the 8 pointers a kernel takes, the same
///    result comes from the one-shot all_reduce() on devices[0] and streams[0] (buffers on other
///    GPUs are then read over peer access as well).
///  * the caller's current device is restored before returning, whatever happened.
///
/// Returns cudaSuccess; cudaErrorInvalidValue for bad arguments (null pointers, n < 1, count < 0,
/// an op other than sum/mean); cudaErrorInvalidDevice for a device index out of range, or when two
/// of the GPUs cannot reach each other's memory (cudaDeviceCanAccessPeer says no; the error that
/// cudaDeviceEnablePeerAccess gives then; nothing is enqueued, since no kernel could read the other
/// buffers: copy them to one GPU and use all_reduce() there); or the first CUDA error met (e.g.
/// cudaErrorNoDevice or cudaErrorInsufficientDriver without a GPU). The
/// cudaErrorPeerAccessAlreadyEnabled of pairs enabled before is not an error and is cleared from
/// cudaGetLastError().
template <class T>
cudaError_t p2p_all_reduce(T* const* bufs, const int* devices, const cudaStream_t* streams, int n, long long count,
                           reduce_op op);

// The definitions live in the cudist::cuda library (csrc/src/cuda/launch.cu), for the dtypes
// p2p_all_reduce is listed with in <cudist/cuda/launch.hpp> (CUDIST_CUDA_FOR_EACH_LAUNCHER).
#ifndef CUDIST_CUDA_IMPLEMENTATION
#define CUDIST_CUDA_DECLARE_P2P_(header, launcher, T, params) CUDIST_CUDA_DECLARE_P2P_##header(launcher, T, params)
#define CUDIST_CUDA_DECLARE_P2P_launch(launcher, T, params)  // declared by <cudist/cuda/launch.hpp>
#define CUDIST_CUDA_DECLARE_P2P_p2p(launcher, T, params) extern template cudaError_t launcher<T> params;
CUDIST_CUDA_FOR_EACH_LAUNCHER(CUDIST_CUDA_DECLARE_P2P_)
#undef CUDIST_CUDA_DECLARE_P2P_
#undef CUDIST_CUDA_DECLARE_P2P_launch
#undef CUDIST_CUDA_DECLARE_P2P_p2p
#endif

}  // namespace cuda
}  // namespace cudist
