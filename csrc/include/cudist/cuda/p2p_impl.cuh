/// @file cuda/p2p_impl.cuh
/// @brief Definition of cudist::cuda::p2p_all_reduce (<cudist/cuda/p2p.hpp>; nvcc only).
///
/// Include this instead of p2p.hpp from a .cu file to instantiate it yourself (no need to link
/// cudist::cuda). Uses only the CUDA runtime calls of the launchers plus device selection, peer
/// access and events, and launches through CUDIST_LAUNCH_KERNEL, so a host emulation of the runtime
/// (tests/emu) runs this very code.
#pragma once

#include <vector>

#include "launch_impl.cuh"
#include "p2p.hpp"

namespace cudist {
namespace cuda {
namespace detail {

// Puts the caller's current device back on every way out.
class device_guard {
 public:
  device_guard() : status_(cudaGetDevice(&saved_)) {}
  ~device_guard() {
    if (status_ == cudaSuccess) cudaSetDevice(saved_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int saved_ = 0;
  cudaError_t status_;
};

// The null, cudaStreamLegacy and cudaStreamPerThread handles name the current device's default
// stream: the same handle on two devices is two streams.
inline bool device_relative(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}
inline bool same_stream(const int* devices, const cudaStream_t* streams, int a, int b) {
  return streams[a] == streams[b] && (!device_relative(streams[a]) || devices[a] == devices[b]);
}

// Makes each of the distinct streams wait for the work enqueued so far on all the others.
inline cudaError_t join_streams(const int* devices, const cudaStream_t* streams, int n) {
  std::vector<int> distinct;
  for (int r = 0; r < n; ++r) {
    bool seen = false;
    for (int q : distinct) seen = seen || same_stream(devices, streams, q, r);
    if (!seen) distinct.push_back(r);
  }
  if (distinct.size() < 2) return cudaSuccess;
  std::vector<cudaEvent_t> events;
  events.reserve(distinct.size());
  cudaError_t e = cudaSuccess;
  // Events and legacy default streams belong to the current device, hence the cudaSetDevice calls.
  for (int r : distinct) {
    cudaEvent_t ev = nullptr;
    e = cudaSetDevice(devices[r]);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess) break;
    events.push_back(ev);
    e = cudaEventRecord(ev, streams[r]);
    if (e != cudaSuccess) break;
  }
  for (std::size_t i = 0; i < distinct.size() && e == cudaSuccess; ++i) {
    const int r = distinct[i];
    e = cudaSetDevice(devices[r]);
    for (std::size_t j = 0; j < events.size() && e == cudaSuccess; ++j)
      if (j != i) e = cudaStreamWaitEvent(streams[r], events[j], 0);
  }
  // Destroying an event that is still pending is fine: its resources go when it completes.
  for (cudaEvent_t ev : events) cudaEventDestroy(ev);
  return e;
}

// Checks every pair of distinct devices first, so that nothing changes when one pair cannot peer;
// that is cudaErrorInvalidDevice, the error cudaDeviceEnablePeerAccess documents for such a pair.
inline cudaError_t enable_peer_access(const std::vector<int>& devs) {
  for (int a : devs)
    for (int b : devs) {
      if (a == b) continue;
      int can = 0;
      const cudaError_t e = cudaDeviceCanAccessPeer(&can, a, b);
      if (e != cudaSuccess) return e;
      if (!can) return cudaErrorInvalidDevice;
    }
  for (int a : devs) {
    cudaError_t e = cudaSetDevice(a);
    if (e != cudaSuccess) return e;
    for (int b : devs) {
      if (a == b) continue;
      e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // also recorded as the thread's last error: not ours to report later
        continue;
      }
      if (e != cudaSuccess) return e;
    }
  }
  return cudaSuccess;
}

}  // namespace detail

template <class T>
cudaError_t p2p_all_reduce(T* const* bufs, const int* devices, const cudaStream_t* streams, int n, long long count,
                           reduce_op op) {
  if (bufs == nullptr || devices == nullptr || n < 1 || count < 0 || !detail::valid_op(op))
    return cudaErrorInvalidValue;
  for (int r = 0; r < n; ++r)
    if (bufs[r] == nullptr) return cudaErrorInvalidValue;
  int device_count = 0;
  cudaError_t e = cudaGetDeviceCount(&device_count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return e;
  }
  std::vector<int> distinct;
  for (int r = 0; r < n; ++r) {
    if (devices[r] < 0 || devices[r] >= device_count) return cudaErrorInvalidDevice;
    bool seen = false;
    for (int d : distinct) seen = seen || d == devices[r];
    if (!seen) distinct.push_back(devices[r]);
  }
  std::vector<cudaStream_t> default_streams;
  if (streams == nullptr) {
    default_streams.assign(static_cast<std::size_t>(n), nullptr);
    streams = default_streams.data();
  }
  const detail::device_guard guard;
  if (guard.status() != cudaSuccess) return guard.status();
  if (n == 1 || count == 0) return cudaSuccess;

  if (distinct.size() > 1) {
    e = detail::enable_peer_access(distinct);
    if (e != cudaSuccess) return e;
  }
  e = detail::join_streams(devices, streams, n);
  if (e != cudaSuccess) return e;

  if (distinct.size() == 1 || n > detail::kMaxReplicas) {
    e = cudaSetDevice(devices[0]);
    if (e == cudaSuccess) e = all_reduce<T>(bufs, n, count, op, streams[0]);
  } else {
    const long long chunk = detail::two_shot_chunk<T>(count, n);
    const detail::PtrPack<T> p = detail::pack(bufs, n);
    const int divisor = detail::divisor_for(op, n);
    // Chunk r is read and written only by stream r in both phases, so each stream needs no more
    // than its own order between them.
    for (int r = 0; r < n && e == cudaSuccess; ++r) {
      const long long begin = (long long)r * chunk < count ? (long long)r * chunk : count;
      const long long end = r == n - 1 ? count : ((long long)(r + 1) * chunk < count ? (long long)(r + 1) * chunk : count);
      if (begin >= end) continue;
      e = cudaSetDevice(devices[r]);
      if (e != cudaSuccess) break;
      const dim3 grid = detail::grid_for<T>(end - begin);
      CUDIST_LAUNCH_KERNEL(kernels::reduce_scatter_packed<T>, grid, detail::kThreads, streams[r], p, n, chunk, begin,
                           end, divisor);
      e = cudaGetLastError();
      if (e != cudaSuccess) break;
      CUDIST_LAUNCH_KERNEL(kernels::all_gather_chunks_packed<T>, grid, detail::kThreads, streams[r], p, n, chunk, begin,
                           end);
      e = cudaGetLastError();
    }
  }
  if (e != cudaSuccess) return e;
  return detail::join_streams(devices, streams, n);
}

}  // namespace cuda
}  // namespace cudist
