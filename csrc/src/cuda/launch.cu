// The cudist::cuda library: the launchers of <cudist/cuda/launch.hpp> and the multi-GPU
// <cudist/cuda/p2p.hpp> instantiated for every dtype cudist supports, so that C++ code compiled
// without nvcc can call them. One translation unit: p2p_all_reduce launches kernels that the
// launchers instantiate anyway, and nvcc compiles each of them once per file.
#include <cudist/cuda/launch_impl.cuh>
#include <cudist/cuda/p2p_impl.cuh>

namespace cudist {
namespace cuda {

#define CUDIST_CUDA_DEFINE_ALL(T)                                                                                \
  template cudaError_t all_reduce<T>(T* const*, int, long long, reduce_op, cudaStream_t);                        \
  template cudaError_t all_reduce<T>(const T* const*, T* const*, int, long long, reduce_op, cudaStream_t);       \
  template cudaError_t all_reduce_two_shot<T>(T* const*, int, long long, reduce_op, cudaStream_t);               \
  template cudaError_t reduce_to_one<T>(T* const*, int, T*, long long, reduce_op, cudaStream_t);                 \
  template cudaError_t broadcast<T>(const T*, T* const*, int, long long, cudaStream_t);                          \
  template cudaError_t scatter_batch<T>(const T*, T* const*, int, long long, long long, cudaStream_t);           \
  template cudaError_t assign_add<T>(T* const*, int, const T*, long long, bool, cudaStream_t);                   \
  template cudaError_t p2p_all_reduce<T>(T* const*, const int*, const cudaStream_t*, int, long long, reduce_op);
#define CUDIST_CUDA_DEFINE_FLOAT(T)                                                                              \
  template cudaError_t sgd<T>(T* const*, int, const T*, double, long long, cudaStream_t);                       \
  template cudaError_t momentum<T>(T* const*, T* const*, int, const T*, double, double, bool, long long,        \
                                   cudaStream_t);                                                               \
  template cudaError_t adam<T>(T* const*, T* const*, T* const*, int, const T*, double, double, double, double, \
                               long long, cudaStream_t);                                                        \
  template cudaError_t all_reduce_sgd<T>(T* const*, int, const T* const*, int, double, long long, cudaStream_t); \
  template cudaError_t all_reduce_momentum<T>(T* const*, T* const*, int, const T* const*, int, double, double,  \
                                              bool, long long, cudaStream_t);                                   \
  template cudaError_t all_reduce_adam<T>(T* const*, T* const*, T* const*, int, const T* const*, int, double,   \
                                          double, double, double, long long, cudaStream_t);

#define CUDIST_CUDA_DEFINE_MORE(T)                                                                              \
  template cudaError_t adamw<T>(T* const*, T* const*, T* const*, int, const T*, double, double, double, double,   \
                                double, long long, cudaStream_t);                                                \
  template cudaError_t all_reduce_adamw<T>(T* const*, T* const*, T* const*, int, const T* const*, int, double,    \
                                           double, double, double, double, long long, cudaStream_t);             \
  template cudaError_t rmsprop<T>(T* const*, T* const*, T* const*, T* const*, int, const T*, double, double,      \
                                  double, double, double, long long, cudaStream_t);                              \
  template cudaError_t all_reduce_rmsprop<T>(T* const*, T* const*, T* const*, T* const*, int, const T* const*,    \
                                             int, double, double, double, double, double, long long, cudaStream_t); \
  template cudaError_t adagrad<T>(T* const*, T* const*, int, const T*, double, double, double, long long,         \
                                  cudaStream_t);                                                                 \
  template cudaError_t all_reduce_adagrad<T>(T* const*, T* const*, int, const T* const*, int, double, double,     \
                                             double, long long, cudaStream_t);                                   \
  template cudaError_t adamax<T>(T* const*, T* const*, T* const*, int, const T*, double, double, double, double,  \
                                 double, long long, cudaStream_t);                                               \
  template cudaError_t all_reduce_adamax<T>(T* const*, T* const*, T* const*, int, const T* const*, int, double,   \
                                            double, double, double, double, long long, cudaStream_t);            \
  template cudaError_t nadam<T>(T* const*, T* const*, T* const*, int, const T*, double, double, double, double,   \
                                double, double, double, double, long long, cudaStream_t);                        \
  template cudaError_t all_reduce_nadam<T>(T* const*, T* const*, T* const*, int, const T* const*, int, double,    \
                                           double, double, double, double, double, double, double, long long,    \
                                           cudaStream_t);                                                        \
  template cudaError_t lion<T>(T* const*, T* const*, int, const T*, double, double, double, double, long long,    \
                               cudaStream_t);                                                                    \
  template cudaError_t all_reduce_lion<T>(T* const*, T* const*, int, const T* const*, int, double, double, double, \
                                          double, long long, cudaStream_t);

CUDIST_CUDA_DEFINE_ALL(float)
CUDIST_CUDA_DEFINE_ALL(double)
CUDIST_CUDA_DEFINE_ALL(__half)
CUDIST_CUDA_DEFINE_ALL(int)
CUDIST_CUDA_DEFINE_ALL(long long)
CUDIST_CUDA_DEFINE_FLOAT(float)
CUDIST_CUDA_DEFINE_FLOAT(double)
CUDIST_CUDA_DEFINE_FLOAT(__half)
CUDIST_CUDA_DEFINE_MORE(float)
CUDIST_CUDA_DEFINE_MORE(double)
CUDIST_CUDA_DEFINE_MORE(__half)

}  // namespace cuda
}  // namespace cudist
