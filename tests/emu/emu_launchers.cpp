// Emulated C++ launchers: the real <cudist/cuda/launch_impl.cuh>, its kernel launches run on the host
// through CUDIST_LAUNCH_KERNEL (include/cuda_runtime_api.h), exposed for every dtype as
//   int cudist_emu_launch_<launcher>_<dtype>(<the launcher's parameters>)
// with reduce_op as an int (0 sum, 1 mean), bools as ints and the stream as a void*; the return
// value is the launcher's cudaError_t. The fake CuPy's stand-in for cudist._core's CUDA bindings
// (fakecupy/cupy/_launchers.py) runs the cupy backend's collectives through these; every launcher
// of <cudist/cuda/launch.hpp>'s list has one per dtype of its kernel (tests/test_cuda_launch_paths.py).
#include <cudist/cuda/launch_impl.cuh>

namespace {
namespace cc = cudist::cuda;
inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
inline cudist::reduce_op as_op(int op) { return static_cast<cudist::reduce_op>(op); }
}  // namespace

#define CUDIST_EMU_LAUNCH_ALL(T, DT)                                                                              \
  extern "C" int cudist_emu_launch_all_reduce_##DT(T* const* bufs, int n, long long count, int op, void* stream) { \
    return cc::all_reduce<T>(bufs, n, count, as_op(op), as_stream(stream));                                        \
  }                                                                                                                \
  extern "C" int cudist_emu_launch_all_reduce_into_##DT(const T* const* in, T* const* out, int n, long long count,  \
                                                        int op, void* stream) {                                    \
    return cc::all_reduce<T>(in, out, n, count, as_op(op), as_stream(stream));                                     \
  }                                                                                                                \
  extern "C" int cudist_emu_launch_all_reduce_two_shot_##DT(T* const* bufs, int n, long long count, int op,        \
                                                            void* stream) {                                        \
    return cc::all_reduce_two_shot<T>(bufs, n, count, as_op(op), as_stream(stream));                               \
  }                                                                                                                \
  extern "C" int cudist_emu_launch_reduce_to_one_##DT(T* const* bufs, int n, T* out, long long count, int op,      \
                                                      void* stream) {                                              \
    return cc::reduce_to_one<T>(bufs, n, out, count, as_op(op), as_stream(stream));                                \
  }                                                                                                                \
  extern "C" int cudist_emu_launch_broadcast_##DT(const T* src, T* const* dsts, int n, long long count,            \
                                                  void* stream) {                                                  \
    return cc::broadcast<T>(src, dsts, n, count, as_stream(stream));                                               \
  }                                                                                                                \
  extern "C" int cudist_emu_launch_scatter_batch_##DT(const T* src, T* const* dsts, int n, long long batch,        \
                                                      long long row_elems, void* stream) {                         \
    return cc::scatter_batch<T>(src, dsts, n, batch, row_elems, as_stream(stream));                                \
  }                                                                                                                \
  extern "C" int cudist_emu_launch_assign_add_##DT(T* const* copies, int n, const T* value, long long count,       \
                                                   int negate, void* stream) {                                     \
    return cc::assign_add<T>(copies, n, value, count, negate != 0, as_stream(stream));                             \
  }

CUDIST_EMU_LAUNCH_ALL(__half, float16)
CUDIST_EMU_LAUNCH_ALL(float, float32)
CUDIST_EMU_LAUNCH_ALL(double, float64)
CUDIST_EMU_LAUNCH_ALL(int, int32)
CUDIST_EMU_LAUNCH_ALL(long long, int64)
CUDIST_EMU_LAUNCH_ALL(__nv_bfloat16, bfloat16)

// The launcher of LossScaleOptimizer's reduce_unscale_finite (the update dtypes).
#define CUDIST_EMU_LAUNCH_UNSCALE(T, DT)                                                                          \
  extern "C" int cudist_emu_launch_reduce_unscale_finite_##DT(const T* const* grads, int m, T* out, long long count, \
                                                              double scale, int* flag, void* stream) {             \
    return cc::reduce_unscale_finite<T>(grads, m, out, count, scale, flag, as_stream(stream));                      \
  }
CUDIST_EMU_LAUNCH_UNSCALE(__half, float16)
CUDIST_EMU_LAUNCH_UNSCALE(float, float32)
CUDIST_EMU_LAUNCH_UNSCALE(double, float64)
CUDIST_EMU_LAUNCH_UNSCALE(__nv_bfloat16, bfloat16)
