// The cudist::cuda library: the launchers of <cudist/cuda/launch.hpp> and the multi-GPU
// <cudist/cuda/p2p.hpp> instantiated for the dtypes of the kernel list, so that C++ code compiled
// without nvcc can call them. One translation unit: p2p_all_reduce launches kernels that the
// launchers instantiate anyway, and nvcc compiles each of them once per file.
#include <cudist/cuda/launch_impl.cuh>
#include <cudist/cuda/p2p_impl.cuh>

namespace cudist {
namespace cuda {

// Every launcher for every dtype of the kernel it is listed under (<cudist/cuda/launch.hpp>,
// from the kernel list of <cudist/kernels/kernel_list.cuh>).
#define CUDIST_CUDA_DEFINE_(header, launcher, T, params) template cudaError_t launcher<T> params;
CUDIST_CUDA_FOR_EACH_LAUNCHER(CUDIST_CUDA_DEFINE_)
#undef CUDIST_CUDA_DEFINE_

}  // namespace cuda
}  // namespace cudist
