// Emulated CUDA entry points of the optimizer kernels beyond SGD / momentum / Adam (AdamW, AMSGrad, RMSprop,
// Adagrad, Adamax, Nadam, Lion), in the style of emu_kernels.cpp and emu_launchers.cpp:
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

#define CUDIST_EMU_RULE_KERNELS(T, G, C, DT)                                                                          \
  extern "C" void cudist_emu_mirrored_all_reduce_adamw_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* w,   \
                                                             T* const* ms, T* const* vs, int n, G* const* grads,  \
                                                             int n_grads, C lr_t, C b1, C b2, C eps, C decay,     \
                                                             long long count) {                                   \
    run(&k::mirrored_all_reduce_adamw<T, G>, gx, gy, bx, w, ms, vs, n, grads, n_grads, lr_t, b1, b2, eps, decay,      \
        count);                                                                                                   \
  }                                                                                                               \
  extern "C" void cudist_emu_mirrored_all_reduce_amsgrad_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* w, \
                                                               T* const* ms, T* const* vs, T* const* vh, int n,    \
                                                               G* const* grads, int n_grads, C lr_t, C b1, C b2,   \
                                                               C eps, C decay, long long count) {                  \
    run(&k::mirrored_all_reduce_amsgrad<T, G>, gx, gy, bx, w, ms, vs, vh, n, grads, n_grads, lr_t, b1, b2, eps, decay, \
        count);                                                                                                   \
  }                                                                                                               \
  extern "C" void cudist_emu_mirrored_all_reduce_rmsprop_##DT(                                                    \
      unsigned gx, unsigned gy, unsigned bx, T* const* w, T* const* vels, T* const* moms, T* const* avgs, int n,  \
      G* const* grads, int n_grads, C lr, C rho, C momentum, C eps, C decay, int has_momentum, int centered,      \
      long long count) {                                                                                          \
    run(&k::mirrored_all_reduce_rmsprop<T, G>, gx, gy, bx, w, vels, moms, avgs, n, grads, n_grads, lr, rho, momentum, \
        eps, decay, has_momentum, centered, count);                                                               \
  }                                                                                                               \
  extern "C" void cudist_emu_mirrored_all_reduce_adagrad_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* w, \
                                                               T* const* accs, int n, G* const* grads, int n_grads, \
                                                               C lr, C eps, C decay, long long count) {           \
    run(&k::mirrored_all_reduce_adagrad<T, G>, gx, gy, bx, w, accs, n, grads, n_grads, lr, eps, decay, count);       \
  }                                                                                                               \
  extern "C" void cudist_emu_mirrored_all_reduce_adamax_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* w,  \
                                                              T* const* ms, T* const* us, int n, G* const* grads, \
                                                              int n_grads, C lr_t, C b1, C b2, C eps, C decay,    \
                                                              long long count) {                                  \
    run(&k::mirrored_all_reduce_adamax<T, G>, gx, gy, bx, w, ms, us, n, grads, n_grads, lr_t, b1, b2, eps, decay,     \
        count);                                                                                                   \
  }                                                                                                               \
  extern "C" void cudist_emu_mirrored_all_reduce_nadam_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* w,   \
                                                             T* const* ms, T* const* vs, int n, G* const* grads,  \
                                                             int n_grads, C lr, C b1, C b2, C eps, C c_m, C c_g,  \
                                                             C c_v, C decay, long long count) {                   \
    run(&k::mirrored_all_reduce_nadam<T, G>, gx, gy, bx, w, ms, vs, n, grads, n_grads, lr, b1, b2, eps, c_m, c_g,     \
        c_v, decay, count);                                                                                       \
  }                                                                                                               \
  extern "C" void cudist_emu_mirrored_all_reduce_lion_##DT(unsigned gx, unsigned gy, unsigned bx, T* const* w,    \
                                                            T* const* ms, int n, G* const* grads, int n_grads,    \
                                                            C lr, C b1, C b2, C decay, long long count) {         \
    run(&k::mirrored_all_reduce_lion<T, G>, gx, gy, bx, w, ms, n, grads, n_grads, lr, b1, b2, decay, count);         \
  }

#define CUDIST_EMU_RULE_LAUNCHERS(T, C, DT)                                                                       \
  extern "C" int cudist_emu_launch_adamw_##DT(T* const* w, T* const* ms, T* const* vs, int n, const T* g,          \
                                              double lr_t, double b1, double b2, double eps, double decay,        \
                                              long long count, void* s) {                                         \
    return cc::adamw<T>(w, ms, vs, n, g, lr_t, b1, b2, eps, decay, count, as_stream(s));                          \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_all_reduce_adamw_##DT(T* const* w, T* const* ms, T* const* vs, int n,          \
                                                         const T* const* g, int m, double lr_t, double b1,         \
                                                         double b2, double eps, double decay, long long count,     \
                                                         void* s) {                                                \
    return cc::all_reduce_adamw<T>(w, ms, vs, n, g, m, lr_t, b1, b2, eps, decay, count, as_stream(s));            \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_amsgrad_##DT(T* const* w, T* const* ms, T* const* vs, T* const* vh, int n,     \
                                                const T* g, double lr_t, double b1, double b2, double eps,        \
                                                double decay, long long count, void* s) {                         \
    return cc::amsgrad<T>(w, ms, vs, vh, n, g, lr_t, b1, b2, eps, decay, count, as_stream(s));                    \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_all_reduce_amsgrad_##DT(T* const* w, T* const* ms, T* const* vs, T* const* vh, \
                                                           int n, const T* const* g, int m, double lr_t,           \
                                                           double b1, double b2, double eps, double decay,         \
                                                           long long count, void* s) {                             \
    return cc::all_reduce_amsgrad<T>(w, ms, vs, vh, n, g, m, lr_t, b1, b2, eps, decay, count, as_stream(s));      \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_rmsprop_##DT(T* const* w, T* const* v, T* const* mo, T* const* a, int n,       \
                                                const T* g, double lr, double rho, double mom, double eps,        \
                                                double decay, long long count, void* s) {                         \
    return cc::rmsprop<T>(w, v, mo, a, n, g, lr, rho, mom, eps, decay, count, as_stream(s));                      \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_all_reduce_rmsprop_##DT(T* const* w, T* const* v, T* const* mo, T* const* a,   \
                                                           int n, const T* const* g, int m, double lr, double rho, \
                                                           double mom, double eps, double decay, long long count,  \
                                                           void* s) {                                              \
    return cc::all_reduce_rmsprop<T>(w, v, mo, a, n, g, m, lr, rho, mom, eps, decay, count, as_stream(s));        \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_adagrad_##DT(T* const* w, T* const* acc, int n, const T* g, double lr,         \
                                                double eps, double decay, long long count, void* s) {             \
    return cc::adagrad<T>(w, acc, n, g, lr, eps, decay, count, as_stream(s));                                     \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_all_reduce_adagrad_##DT(T* const* w, T* const* acc, int n, const T* const* g,  \
                                                           int m, double lr, double eps, double decay,             \
                                                           long long count, void* s) {                             \
    return cc::all_reduce_adagrad<T>(w, acc, n, g, m, lr, eps, decay, count, as_stream(s));                       \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_adamax_##DT(T* const* w, T* const* ms, T* const* us, int n, const T* g,         \
                                               double lr_t, double b1, double b2, double eps, double decay,        \
                                               long long count, void* s) {                                        \
    return cc::adamax<T>(w, ms, us, n, g, lr_t, b1, b2, eps, decay, count, as_stream(s));                         \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_all_reduce_adamax_##DT(T* const* w, T* const* ms, T* const* us, int n,         \
                                                          const T* const* g, int m, double lr_t, double b1,        \
                                                          double b2, double eps, double decay, long long count,    \
                                                          void* s) {                                               \
    return cc::all_reduce_adamax<T>(w, ms, us, n, g, m, lr_t, b1, b2, eps, decay, count, as_stream(s));           \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_nadam_##DT(T* const* w, T* const* ms, T* const* vs, int n, const T* g,          \
                                              double lr, double b1, double b2, double eps, double c_m, double c_g, \
                                              double c_v, double decay, long long count, void* s) {               \
    return cc::nadam<T>(w, ms, vs, n, g, lr, b1, b2, eps, c_m, c_g, c_v, decay, count, as_stream(s));             \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_all_reduce_nadam_##DT(T* const* w, T* const* ms, T* const* vs, int n,          \
                                                         const T* const* g, int m, double lr, double b1, double b2, \
                                                         double eps, double c_m, double c_g, double c_v,           \
                                                         double decay, long long count, void* s) {                 \
    return cc::all_reduce_nadam<T>(w, ms, vs, n, g, m, lr, b1, b2, eps, c_m, c_g, c_v, decay, count,              \
                                   as_stream(s));                                                                  \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_lion_##DT(T* const* w, T* const* ms, int n, const T* g, double lr, double b1,   \
                                             double b2, double decay, long long count, void* s) {                 \
    return cc::lion<T>(w, ms, n, g, lr, b1, b2, decay, count, as_stream(s));                                      \
  }                                                                                                               \
  extern "C" int cudist_emu_launch_all_reduce_lion_##DT(T* const* w, T* const* ms, int n, const T* const* g,      \
                                                        int m, double lr, double b1, double b2, double decay,     \
                                                        long long count, void* s) {                               \
    return cc::all_reduce_lion<T>(w, ms, n, g, m, lr, b1, b2, decay, count, as_stream(s));                        \
  }

// The kernels with gradients of the copies' dtype and their launchers, per dtype; the mixed-precision
// kernels (float32 copies, 16-bit gradients) as cudist_emu_<kernel>_float32_g<gradient dtype>.
#define CUDIST_EMU_OPTIMIZERS(T, C, DT) \
  CUDIST_EMU_RULE_KERNELS(T, T, C, DT)  \
  CUDIST_EMU_RULE_LAUNCHERS(T, C, DT)

CUDIST_EMU_OPTIMIZERS(__half, float, float16)
CUDIST_EMU_OPTIMIZERS(float, float, float32)
CUDIST_EMU_OPTIMIZERS(double, double, float64)
CUDIST_EMU_OPTIMIZERS(__nv_bfloat16, float, bfloat16)
CUDIST_EMU_RULE_KERNELS(float, __half, float, float32_gfloat16)
CUDIST_EMU_RULE_KERNELS(float, __nv_bfloat16, float, float32_gbfloat16)
