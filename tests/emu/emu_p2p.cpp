// Emulated multi-GPU P2P all-reduce: the real <cudist/cuda/p2p_impl.cuh> over the emulated runtime
// (include/cuda_runtime_api.h), its launches running on the host, exposed for every dtype as
//   int cudist_emu_launch_p2p_all_reduce_<dtype>(T* const* bufs, const int* devices,
//                                               void* const* streams, int n, long long count, int op)
// (streams may be null; op 0 sum, 1 mean; returns the cudaError_t), plus emulated stream handles
// so that tests can pass streams of given devices.
#include <cudist/cuda/p2p_impl.cuh>

namespace {
inline const cudaStream_t* as_streams(void* const* s) { return reinterpret_cast<const cudaStream_t*>(s); }
}  // namespace

#define CUDIST_EMU_P2P(T, DT)                                                                                   \
  extern "C" int cudist_emu_launch_p2p_all_reduce_##DT(T* const* bufs, const int* devices, void* const* streams, \
                                                       int n, long long count, int op) {                         \
    return cudist::cuda::p2p_all_reduce<T>(bufs, devices, as_streams(streams), n, count,                       \
                                           static_cast<cudist::reduce_op>(op));                                  \
  }

CUDIST_EMU_P2P(__half, float16)
CUDIST_EMU_P2P(float, float32)
CUDIST_EMU_P2P(double, float64)
CUDIST_EMU_P2P(int, int32)
CUDIST_EMU_P2P(long long, int64)
CUDIST_EMU_P2P(__nv_bfloat16, bfloat16)

/// A new stream of `device` (the calling thread's current device is left as it was), or null when
/// the device is invalid.
extern "C" void* cudist_emu_stream_create(int device) {
  int saved = 0;
  if (cudaGetDevice(&saved) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  cudaStream_t s = nullptr;
  const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaSetDevice(saved);
  return e == cudaSuccess ? s : nullptr;
}

extern "C" int cudist_emu_stream_destroy(void* stream) { return cudaStreamDestroy(static_cast<cudaStream_t>(stream)); }

/// Cross-device cudaStreamWaitEvent calls so far (the joins between GPUs' streams).
extern "C" long long cudist_emu_cross_device_waits() { return cudist_emu::cross_device_waits.load(); }
