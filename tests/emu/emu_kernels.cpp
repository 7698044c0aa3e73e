// Emulated CUDA kernels: every (kernel, dtype) of KERNELS in src/cudist/_kernels/_cupy.py, in the
// pointer-table form CuPy launches, as an extern "C" host function
//   void cudist_emu_<kernel>_<dtype>(unsigned gx, unsigned gy, unsigned bx, <kernel parameters>)
// that runs the real kernel from <cudist/kernels/kernels.cuh> over a (gx, gy) grid of bx-thread
// blocks (see include/cuda_emu.hpp). float16 buffers are 2-byte __half, bfloat16 ones
// __nv_bfloat16; float16 kernels take their
// scalars as float, as on the GPU. Plus a few entry points into the emulated runtime. The update
// kernels of the rules' table have theirs generated in emu_optimizers.cpp.
#include <cudist/kernels/kernels.cuh>

namespace {

namespace k = cudist::kernels;

template <class... P, class... A>
void run(void (*kernel)(P...), unsigned gx, unsigned gy, unsigned bx, A... args) {
  cudist_emu::launch(kernel, dim3(gx, gy, 1), dim3(bx, 1, 1), nullptr, args...);
}

}  // namespace

#define CUDIST_EMU_ALL_DTYPES(T, DT)                                                                              \
  extern "C" void cudist_emu_all_reduce_one_shot_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* in,        \
                                                       int n_in, T* const* out, int n_out, long long count,        \
                                                       int divisor) {                                              \
    run(&k::all_reduce_one_shot<T>, gx, gy, bx, in, n_in, out, n_out, count, divisor);                             \
  }                                                                                                                \
  extern "C" void cudist_emu_reduce_scatter_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* bufs, int n,     \
                                                  long long chunk, long long begin, long long end, int divisor) {  \
    run(&k::reduce_scatter<T>, gx, gy, bx, bufs, n, chunk, begin, end, divisor);                                   \
  }                                                                                                                \
  extern "C" void cudist_emu_all_gather_chunks_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* bufs, int n,  \
                                                     long long chunk, long long begin, long long end) {            \
    run(&k::all_gather_chunks<T>, gx, gy, bx, bufs, n, chunk, begin, end);                                         \
  }                                                                                                                \
  extern "C" void cudist_emu_broadcast_##DT(unsigned gx, unsigned gy, unsigned bx, const T* src, T* const* dst,    \
                                             int n_dst, long long count) {                                         \
    run(&k::broadcast<T>, gx, gy, bx, src, dst, n_dst, count);                                                     \
  }                                                                                                                \
  extern "C" void cudist_emu_scatter_batch_##DT(unsigned gx, unsigned gy, unsigned bx, const T* src, T* const* dst, \
                                                 int n_dst, long long per, long long total) {                      \
    run(&k::scatter_batch<T>, gx, gy, bx, src, dst, n_dst, per, total);                                            \
  }                                                                                                                \
  extern "C" void cudist_emu_mirrored_assign_add_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* copies,     \
                                                       int n, const T* value, long long count, int negate) {       \
    run(&k::mirrored_assign_add<T>, gx, gy, bx, copies, n, value, count, negate);                                  \
  }

CUDIST_EMU_ALL_DTYPES(__half, float16)
CUDIST_EMU_ALL_DTYPES(float, float32)
CUDIST_EMU_ALL_DTYPES(double, float64)
CUDIST_EMU_ALL_DTYPES(int, int32)
CUDIST_EMU_ALL_DTYPES(long long, int64)
CUDIST_EMU_ALL_DTYPES(__nv_bfloat16, bfloat16)

// LossScaleOptimizer's reduce_unscale_finite<T, G>: the update dtypes (G = T), and the
// mixed-precision pairs of the kernel list (DT float32_g<gradient dtype>).
#define CUDIST_EMU_UNSCALE(T, G, C, DT)                                                                           \
  extern "C" void cudist_emu_reduce_unscale_finite_##DT(unsigned gx, unsigned gy, unsigned bx, G* const* grads,    \
                                                         int n_grads, T* out, long long count, C scale, int* flag) { \
    run(&k::reduce_unscale_finite<T, G>, gx, gy, bx, grads, n_grads, out, count, scale, flag);                     \
  }
CUDIST_EMU_UNSCALE(__half, __half, float, float16)
CUDIST_EMU_UNSCALE(float, float, float, float32)
CUDIST_EMU_UNSCALE(double, double, double, float64)
CUDIST_EMU_UNSCALE(__nv_bfloat16, __nv_bfloat16, float, bfloat16)
CUDIST_EMU_UNSCALE(float, __half, float, float32_gfloat16)
CUDIST_EMU_UNSCALE(float, __nv_bfloat16, float, float32_gbfloat16)

// ------------------------------------------------------------------------------------- runtime
/// The calling thread's last error (an emulated cudaError_t), cleared: cudaGetLastError.
extern "C" int cudist_emu_get_last_error() { return cudaGetLastError(); }
/// Number of emulated devices (CUDIST_EMU_DEVICES, default 4).
extern "C" int cudist_emu_device_count() { return cudist_emu::device_count(); }
/// The calling thread's current device, and setting it (returns the cudaError_t).
extern "C" int cudist_emu_get_device() { return cudist_emu::current_device; }
extern "C" int cudist_emu_set_device(int device) { return cudaSetDevice(device); }
/// Whether peer access from `device` to `peer` has been enabled (1) or not (0).
extern "C" int cudist_emu_peer_enabled(int device, int peer) { return cudist_emu::peer_enabled(device, peer) ? 1 : 0; }
/// cudaDeviceCanAccessPeer / cudaDeviceEnablePeerAccess (from the calling thread's current device) /
/// cudaDeviceDisablePeerAccess, returning the cudaError_t: for a fake CuPy runtime sharing this state.
extern "C" int cudist_emu_device_can_access_peer(int* can, int device, int peer) {
  return cudaDeviceCanAccessPeer(can, device, peer);
}
extern "C" int cudist_emu_device_enable_peer_access(int peer, unsigned flags) {
  return cudaDeviceEnablePeerAccess(peer, flags);
}
extern "C" int cudist_emu_device_disable_peer_access(int peer) { return cudaDeviceDisablePeerAccess(peer); }
/// Stream-ordered allocations (cudaMallocAsync) not yet freed (cudaFreeAsync).
extern "C" long long cudist_emu_async_allocations() { return cudist_emu::async_allocations.load(); }
/// Forgets the enabled peer pairs and the calling thread's current device and last error.
extern "C" void cudist_emu_reset() { cudist_emu::reset(); }
/// Sets the harder modes of cuda_emu.hpp for this process (tests; normally CUDIST_EMU_MODE sets them).
extern "C" void cudist_emu_set_modes(int shuffle, int ftz, unsigned long long seed) {
  cudist_emu::modes().shuffle = shuffle != 0;
  cudist_emu::modes().ftz = ftz != 0;
  cudist_emu::modes().seed = seed;
}
