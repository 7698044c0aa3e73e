// Emulated CUDA entry points of the optimizer kernels of the rules' table (CUDIST_UPDATE_RULE_LIST in
// <cudist/detail/update_rules.hpp>), generated from its rows in the style of emu_kernels.cpp and
// emu_launchers.cpp, so that a new row needs no edit here:
//   void cudist_emu_mirrored_all_reduce_<name>_<dtype>(unsigned gx, unsigned gy, unsigned bx, <kernel params>)
// runs the real pointer-table kernel of <cudist/kernels/mirrored.cuh> over a (gx, gy) grid, and
//   int cudist_emu_launch_<name>_<dtype>(...) / cudist_emu_launch_all_reduce_<name>_<dtype>(...)
// the real C++ launchers of <cudist/cuda/launch_impl.cuh> (the stream as a void*, the result the
// cudaError_t). float16 kernels take their scalars as float, as on the GPU.
#include <cudist/cuda/launch_impl.cuh>

namespace {

namespace k = cudist::kernels;
namespace cc = cudist::cuda;

template <class... P, class... A>
void run(void (*kernel)(P...), unsigned gx, unsigned gy, unsigned bx, A... args) {
  cudist_emu::launch(kernel, dim3(gx, gy, 1), dim3(bx, 1, 1), nullptr, args...);
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

// X(A, name, rule, slots, hyper) with A = (T, G, C, DT): the fused kernel, gradients of type G (T's
// own, or a 16-bit float for float32 copies: DT float32_g<gradient dtype>).
#define CUDIST_EMU_RULE_KERNEL_(A, name, rule, slots, hyper) CUDIST_EMU_RULE_KERNEL2_(CUDIST_PP_REM A, name, slots, hyper)
#define CUDIST_EMU_RULE_KERNEL2_(...) CUDIST_EMU_RULE_KERNEL3_(__VA_ARGS__)
#define CUDIST_EMU_RULE_KERNEL3_(T, G, C, DT, name, slots, hyper)                                                \
  extern "C" void cudist_emu_mirrored_all_reduce_##name##_##DT(                                                 \
      unsigned gx, unsigned gy, unsigned bx, T* const* w CUDIST_PP_MAP(CUDIST_PP_LEAD_S, T* const*, slots), int n, \
      G* const* grads, int n_grads CUDIST_PP_MAP(CUDIST_PP_LEAD, C, hyper), C decay, long long count) {          \
    run(&k::mirrored_all_reduce_##name<T, G>, gx, gy, bx, w CUDIST_PP_MAP(CUDIST_PP_LEAD_S, , slots), n, grads,  \
        n_grads CUDIST_PP_MAP(CUDIST_PP_LEAD, , hyper), decay, count);                                           \
  }

// X(A, name, rule, slots, hyper) with A = (T, C, DT): the row's two C++ launchers.
#define CUDIST_EMU_RULE_(A, name, rule, slots, hyper) CUDIST_EMU_RULE2_(CUDIST_PP_REM A, name, slots, hyper)
#define CUDIST_EMU_RULE2_(...) CUDIST_EMU_RULE3_(__VA_ARGS__)
#define CUDIST_EMU_RULE3_(T, C, DT, name, slots, hyper)                                                          \
  extern "C" int cudist_emu_launch_##name##_##DT(T* const* w CUDIST_PP_MAP(CUDIST_PP_LEAD_S, T* const*, slots),    \
                                                 int n, const T* g CUDIST_PP_MAP(CUDIST_PP_LEAD, double, hyper), \
                                                 double decay, long long count, void* s) {                      \
    return cc::name<T>(w CUDIST_PP_MAP(CUDIST_PP_LEAD_S, , slots), n, g CUDIST_PP_MAP(CUDIST_PP_LEAD, , hyper),   \
                       decay, count, as_stream(s));                                                             \
  }                                                                                                             \
  extern "C" int cudist_emu_launch_all_reduce_##name##_##DT(                                                    \
      T* const* w CUDIST_PP_MAP(CUDIST_PP_LEAD_S, T* const*, slots), int n, const T* const* g, int m              \
          CUDIST_PP_MAP(CUDIST_PP_LEAD, double, hyper),                                                          \
      double decay, long long count, void* s) {                                                                  \
    return cc::all_reduce_##name<T>(w CUDIST_PP_MAP(CUDIST_PP_LEAD_S, , slots), n, g,                            \
                                    m CUDIST_PP_MAP(CUDIST_PP_LEAD, , hyper), decay, count, as_stream(s));       \
  }

CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_KERNEL_, (__half, __half, float, float16))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_KERNEL_, (float, float, float, float32))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_KERNEL_, (double, double, double, float64))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_KERNEL_, (__nv_bfloat16, __nv_bfloat16, float, bfloat16))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_KERNEL_, (float, __half, float, float32_gfloat16))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_KERNEL_, (float, __nv_bfloat16, float, float32_gbfloat16))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_, (__half, float, float16))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_, (float, float, float32))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_, (double, double, float64))
CUDIST_UPDATE_RULE_LIST(CUDIST_EMU_RULE_, (__nv_bfloat16, float, bfloat16))
