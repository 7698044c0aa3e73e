// Host emulation of the CUDA runtime API subset cudist's C++ code uses (tests only).
//
// A machine of CUDIST_EMU_DEVICES devices (default 4; 0 is allowed: cudaGetDeviceCount then
// fails with cudaErrorNoDevice) whose memory is host memory, so every "device" pointer is a host
// pointer and every device can read every other device's buffers. The semantics follow the real
// runtime where cudist's code depends on them:
//  * the current device is per host thread (default 0); invalid ids give cudaErrorInvalidDevice;
//  * peer access is a per-(device, peer) table: cudaDeviceCanAccessPeer says 1 for two different
//    devices (0 for a device and itself, or for every pair when CUDIST_EMU_PEER=0), enabling it
//    twice gives cudaErrorPeerAccessAlreadyEnabled, disabling what is not enabled
//    cudaErrorPeerAccessNotEnabled;
//  * the last error is per host thread: cudaGetLastError returns and clears it,
//    cudaPeekAtLastError only returns it;
//  * streams and events are opaque handles remembering their device; the null stream (and
//    cudaStreamLegacy / cudaStreamPerThread) is valid and means the current device's default stream;
//  * everything is synchronous: a launch or copy has finished when the call returns, so
//    synchronizations and waits only validate their arguments.
// Everything is inline (C++17 inline variables hold the state), so any number of translation units
// of the emulation library share one runtime.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_emu.hpp"

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorPeerAccessNotEnabled = 705,
  cudaErrorNotSupported = 801,
};
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

#define cudaEventDefault 0x00u
#define cudaEventBlockingSync 0x01u
#define cudaEventDisableTiming 0x02u
#define cudaEventInterprocess 0x04u
#define cudaStreamDefault 0x00u
#define cudaStreamNonBlocking 0x01u

struct CUstream_st {
  int device;
};
struct CUevent_st {
  int device;
  unsigned int flags;
  bool recorded;
};
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
// As in CUDA: handles naming the current device's legacy and per-thread default streams.
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

namespace cudist_emu {

inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (end != nullptr && *end == '\0' && x >= 0 && x <= 1024) ? static_cast<int>(x) : fallback;
}

inline int device_count() { return env_int("CUDIST_EMU_DEVICES", 4); }
inline bool peer_capable() { return env_int("CUDIST_EMU_PEER", 1) != 0; }
inline bool valid_device(int d) { return d >= 0 && d < device_count(); }

inline thread_local int current_device = 0;
inline thread_local cudaError_t last_error = cudaSuccess;

/// Whether a stream handle means "this device's default stream" (null, legacy, per-thread):
/// the same handle on two devices is two streams.
inline bool device_relative(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}
/// The device a stream belongs to (a default-stream handle: the current device).
inline int stream_device(cudaStream_t s) { return device_relative(s) ? current_device : s->device; }

/// cudaStreamWaitEvent calls whose stream and event are on different devices (the cross-GPU
/// joins), so that tests can check that orchestration code makes them.
inline std::atomic<long long> cross_device_waits{0};

struct PeerTable {
  std::mutex mu;
  std::set<std::pair<int, int>> enabled;  // (device, peer): kernels on device may access peer
};
inline PeerTable peer_table;

/// Records `e` as the calling thread's last error (unless it is cudaSuccess) and returns it, as
/// every runtime call does.
inline cudaError_t fail(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

/// Forgets the enabled peer pairs and the calling thread's current device and error (test isolation).
inline void reset() {
  std::lock_guard<std::mutex> lock(peer_table.mu);
  peer_table.enabled.clear();
  current_device = 0;
  last_error = cudaSuccess;
}

}  // namespace cudist_emu

// ------------------------------------------------------------------------------------- errors
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = cudist_emu::last_error;
  cudist_emu::last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return cudist_emu::last_error; }

inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorPeerAccessNotEnabled: return "cudaErrorPeerAccessNotEnabled";
  }
  return "cudaErrorUnknown";
}

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorPeerAccessNotEnabled: return "peer access has not been enabled";
  }
  return "unknown error";
}

// ------------------------------------------------------------------------------------- devices
inline cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return cudist_emu::fail(cudaErrorInvalidValue);
  *count = cudist_emu::device_count();
  return *count > 0 ? cudaSuccess : cudist_emu::fail(cudaErrorNoDevice);
}

inline cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cudist_emu::fail(cudaErrorInvalidValue);
  if (cudist_emu::device_count() == 0) return cudist_emu::fail(cudaErrorNoDevice);
  *device = cudist_emu::current_device;
  return cudaSuccess;
}

inline cudaError_t cudaSetDevice(int device) {
  if (cudist_emu::device_count() == 0) return cudist_emu::fail(cudaErrorNoDevice);
  if (!cudist_emu::valid_device(device)) return cudist_emu::fail(cudaErrorInvalidDevice);
  cudist_emu::current_device = device;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceSynchronize() {
  return cudist_emu::device_count() > 0 ? cudaSuccess : cudist_emu::fail(cudaErrorNoDevice);
}

inline cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (can == nullptr) return cudist_emu::fail(cudaErrorInvalidValue);
  if (!cudist_emu::valid_device(device) || !cudist_emu::valid_device(peer))
    return cudist_emu::fail(cudaErrorInvalidDevice);
  *can = device != peer && cudist_emu::peer_capable() ? 1 : 0;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  const int device = cudist_emu::current_device;
  if (flags != 0) return cudist_emu::fail(cudaErrorInvalidValue);
  if (!cudist_emu::valid_device(device) || !cudist_emu::valid_device(peer) || peer == device)
    return cudist_emu::fail(cudaErrorInvalidDevice);
  if (!cudist_emu::peer_capable()) return cudist_emu::fail(cudaErrorInvalidDevice);
  std::lock_guard<std::mutex> lock(cudist_emu::peer_table.mu);
  if (!cudist_emu::peer_table.enabled.insert({device, peer}).second)
    return cudist_emu::fail(cudaErrorPeerAccessAlreadyEnabled);
  return cudaSuccess;
}

inline cudaError_t cudaDeviceDisablePeerAccess(int peer) {
  const int device = cudist_emu::current_device;
  if (!cudist_emu::valid_device(peer) || peer == device) return cudist_emu::fail(cudaErrorInvalidDevice);
  std::lock_guard<std::mutex> lock(cudist_emu::peer_table.mu);
  if (cudist_emu::peer_table.enabled.erase({device, peer}) == 0)
    return cudist_emu::fail(cudaErrorPeerAccessNotEnabled);
  return cudaSuccess;
}

namespace cudist_emu {
/// Whether peer access from `device` to `peer` is enabled (a device always reaches itself).
inline bool peer_enabled(int device, int peer) {
  if (device == peer) return true;
  std::lock_guard<std::mutex> lock(peer_table.mu);
  return peer_table.enabled.count({device, peer}) != 0;
}
}  // namespace cudist_emu

// ------------------------------------------------------------------------------------- streams
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr || (flags & ~cudaStreamNonBlocking) != 0) return cudist_emu::fail(cudaErrorInvalidValue);
  *stream = new CUstream_st{cudist_emu::current_device};
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }
inline cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (cudist_emu::device_relative(stream)) return cudist_emu::fail(cudaErrorInvalidResourceHandle);
  delete stream;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }

// ------------------------------------------------------------------------------------- events
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr ||
      (flags & ~(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess)) != 0)
    return cudist_emu::fail(cudaErrorInvalidValue);
  *event = new CUevent_st{cudist_emu::current_device, flags, false};
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }
inline cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return cudist_emu::fail(cudaErrorInvalidResourceHandle);
  delete event;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr) {
  if (event == nullptr) return cudist_emu::fail(cudaErrorInvalidResourceHandle);
  // As on a GPU, an event and the stream it is recorded on must belong to the same device.
  if (cudist_emu::stream_device(stream) != event->device) return cudist_emu::fail(cudaErrorInvalidResourceHandle);
  event->recorded = true;
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event == nullptr ? cudist_emu::fail(cudaErrorInvalidResourceHandle) : cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t event) {
  return event == nullptr ? cudist_emu::fail(cudaErrorInvalidResourceHandle) : cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags = 0) {
  if (event == nullptr) return cudist_emu::fail(cudaErrorInvalidResourceHandle);
  if (flags != 0) return cudist_emu::fail(cudaErrorInvalidValue);
  if (cudist_emu::stream_device(stream) != event->device) ++cudist_emu::cross_device_waits;
  return cudaSuccess;
}

// ------------------------------------------------------------------------------------- memory
// Device memory is host memory, 256-byte aligned like cudaMalloc's.
inline cudaError_t cudaMalloc(void** ptr, std::size_t size) {
  if (ptr == nullptr) return cudist_emu::fail(cudaErrorInvalidValue);
  *ptr = std::aligned_alloc(256, (size + 255) / 256 * 256 + 256);
  return *ptr != nullptr ? cudaSuccess : cudist_emu::fail(cudaErrorMemoryAllocation);
}
template <class T>
inline cudaError_t cudaMalloc(T** ptr, std::size_t size) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), size);
}
inline cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}
// Stream-ordered allocation: emulated launches run at once, so memory freed "after the stream's
// work so far" is free now. The live count lets tests check that the launchers free what they take.
namespace cudist_emu {
inline std::atomic<long long> async_allocations{0};
}  // namespace cudist_emu
inline cudaError_t cudaMallocAsync(void** ptr, std::size_t size, cudaStream_t) {
  const cudaError_t e = cudaMalloc(ptr, size);
  if (e == cudaSuccess) ++cudist_emu::async_allocations;
  return e;
}
template <class T>
inline cudaError_t cudaMallocAsync(T** ptr, std::size_t size, cudaStream_t stream) {
  return cudaMallocAsync(reinterpret_cast<void**>(ptr), size, stream);
}
inline cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) {
  if (ptr != nullptr) --cudist_emu::async_allocations;
  std::free(ptr);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind,
                                   cudaStream_t = nullptr) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return cudist_emu::fail(cudaErrorInvalidMemcpyDirection);
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudist_emu::fail(cudaErrorInvalidValue);
  std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, n, kind);
}
inline cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device, std::size_t n,
                                       cudaStream_t = nullptr) {
  if (!cudist_emu::valid_device(dst_device) || !cudist_emu::valid_device(src_device))
    return cudist_emu::fail(cudaErrorInvalidDevice);
  return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice);
}
inline cudaError_t cudaMemcpyPeer(void* dst, int dst_device, const void* src, int src_device, std::size_t n) {
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, n);
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t n, cudaStream_t = nullptr) {
  if (n == 0) return cudaSuccess;
  if (dst == nullptr) return cudist_emu::fail(cudaErrorInvalidValue);
  std::memset(dst, value, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* dst, int value, std::size_t n) { return cudaMemsetAsync(dst, value, n); }

// ------------------------------------------------------------------------------------- launches
namespace cudist_emu {

/// Runs `kernel<<<grid, block, 0, stream>>>(args...)` on the calling host thread: every thread of
/// every block in turn (blocks in z, y, x order, threads likewise; in a random order of (block,
/// thread) pairs in the `shuffle` mode, see cuda_emu.hpp), with the built-in variables set
/// for each. Returns once the kernel has finished, like everything here. Bad configurations and a
/// stream of another device than the current one set the last error and run nothing, as on a GPU.
template <class... P, class... A>
inline void launch(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "wrong number of kernel arguments");
  const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535u || grid.z > 65535u || threads == 0 ||
      threads > 1024u || block.z > 64u) {
    fail(cudaErrorInvalidConfiguration);
    return;
  }
  if (!device_relative(stream) && stream->device != current_device) {
    fail(cudaErrorInvalidResourceHandle);
    return;
  }
  // The parameters as the kernel receives them: converted once, at launch, like CUDA does.
  const std::tuple<P...> params(std::forward<A>(args)...);
  const uint3 saved_thread = threadIdx, saved_block = blockIdx;
  const dim3 saved_grid = gridDim, saved_dim = blockDim;
  gridDim = grid;
  blockDim = block;
  if (modes().shuffle) {
    // Every (block, thread) pair once, in a random order (the seed and a launch counter pick it).
    static std::atomic<unsigned long long> launches{0};
    const unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
    std::vector<unsigned long long> order(blocks * threads);
    for (unsigned long long i = 0; i < order.size(); ++i) order[i] = i;
    std::mt19937_64 rng(modes().seed * 0x9E3779B97F4A7C15ull + launches++);
    std::shuffle(order.begin(), order.end(), rng);
    for (const unsigned long long i : order) {
      const unsigned long long b = i / threads, t = i % threads;
      blockIdx = uint3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y), (unsigned)(b / grid.x / grid.y)};
      threadIdx = uint3{(unsigned)(t % block.x), (unsigned)(t / block.x % block.y), (unsigned)(t / block.x / block.y)};
      std::apply(kernel, params);
    }
  } else {
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = uint3{bx, by, bz};
        for (unsigned tz = 0; tz < block.z; ++tz)
          for (unsigned ty = 0; ty < block.y; ++ty)
            for (unsigned tx = 0; tx < block.x; ++tx) {
              threadIdx = uint3{tx, ty, tz};
              std::apply(kernel, params);
            }
      }
  }
  threadIdx = saved_thread;
  blockIdx = saved_block;
  gridDim = saved_grid;
  blockDim = saved_dim;
}

}  // namespace cudist_emu

// The launchers of <cudist/cuda/launch_impl.cuh> (and any code written against that macro) launch
// through the emulation.
#ifndef CUDIST_LAUNCH_KERNEL
#define CUDIST_LAUNCH_KERNEL(kernel, grid, block, stream, ...) \
  ::cudist_emu::launch(kernel, (grid), (block), (stream), __VA_ARGS__)
#endif
