# Optional CUDA part of the cudist build: the `cudist::cuda` static library holding the host-side
# launchers of <cudist/cuda/launch.hpp> (csrc/src/cuda/launch.cu), instantiated for float, double,
# __half, int and long long.
#
# Off by default so that CPU-only builds, CI and wheels never spend minutes in nvcc. Python does not
# need it: the cupy backend compiles the same kernels (csrc/include/cudist/kernels/*.cuh) at run time
# with NVRTC. Turn it on to build the library for C++ users:
#
#   cmake -S . -B build -DCUDIST_WITH_CUDA=ON [-DCUDIST_CUDA_ARCHITECTURES="80;90"]
#
# Included by the top-level CMakeLists.txt with include(cmake/cudist_cuda.cmake OPTIONAL); sets
# CUDIST_HAVE_CUDA to ON when the library target exists.

option(CUDIST_WITH_CUDA "Build the cudist::cuda library of CUDA kernel launchers (needs nvcc)" OFF)
set(CUDIST_CUDA_ARCHITECTURES "80;90" CACHE STRING "GPU architectures of cudist::cuda (CMAKE_CUDA_ARCHITECTURES syntax)")
set(CUDIST_HAVE_CUDA OFF)

if(CUDIST_WITH_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(WARNING "CUDIST_WITH_CUDA=ON but no CUDA compiler was found (set CUDACXX or CMAKE_CUDA_COMPILER); "
                    "building without cudist::cuda")
  else()
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "${CUDIST_CUDA_ARCHITECTURES}")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)

    get_filename_component(_cudist_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
    add_library(cudist_cuda STATIC "${_cudist_root}/csrc/src/cuda/launch.cu")
    add_library(cudist::cuda ALIAS cudist_cuda)
    target_include_directories(cudist_cuda PUBLIC $<BUILD_INTERFACE:${_cudist_root}/csrc/include>
                                                  $<INSTALL_INTERFACE:include>)
    target_compile_features(cudist_cuda PUBLIC cxx_std_17)
    set_target_properties(cudist_cuda PROPERTIES
      CUDA_STANDARD 17
      CUDA_STANDARD_REQUIRED ON
      CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
      POSITION_INDEPENDENT_CODE ON
      EXPORT_NAME cuda)
    # The kernels' numerics do not depend on these flags (they use explicitly rounded intrinsics),
    # but keep nvcc from contracting anything else either.
    target_compile_options(cudist_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false>)
    target_link_libraries(cudist_cuda PUBLIC CUDA::cudart)
    set(CUDIST_HAVE_CUDA ON)
    message(STATUS "cudist: building cudist::cuda for CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")
  endif()
endif()
