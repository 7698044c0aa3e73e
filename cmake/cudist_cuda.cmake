# CUDA part of the cudist build: the `cudist_cuda` static library (exported as cudist::cuda) holding
# the host-side launchers of <cudist/cuda/launch.hpp> and the multi-GPU <cudist/cuda/p2p.hpp>
# (csrc/src/cuda/launch.cu), instantiated for float, double, __half, int and long long.
#
#   CUDIST_WITH_CUDA=AUTO (default)  build it when CMake finds a CUDA compiler and toolkit
#   CUDIST_WITH_CUDA=ON              build it; a configure error without a CUDA compiler
#   CUDIST_WITH_CUDA=OFF             never (CPU-only build; nvcc is not even looked for)
#   CUDIST_CUDA_ARCHITECTURES        GPU architectures, "80;90" by default (each one adds ~6 s of nvcc)
#
# The library links the static CUDA runtime (CUDA::cudart_static), so anything linking it (the
# Python extension included) loads on machines without a GPU or driver; CUDA calls then fail with
# an error code instead. Python does not need this library for the GPU path: the cupy backend
# compiles the same kernels (csrc/include/cudist/kernels/*.cuh) at run time with NVRTC.
#
# Included by the top-level CMakeLists.txt; sets CUDIST_HAVE_CUDA to ON when the target exists.

set(CUDIST_WITH_CUDA AUTO CACHE STRING "Build the cudist::cuda library of CUDA launchers: AUTO (when nvcc is found), ON or OFF")
set_property(CACHE CUDIST_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(CUDIST_CUDA_ARCHITECTURES "80;90" CACHE STRING "GPU architectures of cudist::cuda (CMAKE_CUDA_ARCHITECTURES syntax)")
set(CUDIST_HAVE_CUDA OFF)

string(TOUPPER "${CUDIST_WITH_CUDA}" _cudist_with_cuda)
if(NOT _cudist_with_cuda MATCHES "^(AUTO|ON|OFF|TRUE|FALSE|YES|NO|Y|N|1|0)$")
  message(FATAL_ERROR "cudist: CUDIST_WITH_CUDA must be AUTO, ON or OFF, got '${CUDIST_WITH_CUDA}'")
endif()
if(_cudist_with_cuda STREQUAL "AUTO")
  set(_cudist_cuda_required OFF)
  set(_cudist_cuda_wanted ON)
elseif(CUDIST_WITH_CUDA)
  set(_cudist_cuda_required ON)
  set(_cudist_cuda_wanted ON)
else()
  set(_cudist_cuda_required OFF)
  set(_cudist_cuda_wanted OFF)
endif()

if(_cudist_cuda_wanted)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # CMAKE_CUDA_ARCHITECTURES set by the user wins; otherwise ours, before enable_language picks
    # the compiler's default.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "${CUDIST_CUDA_ARCHITECTURES}")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit)
  endif()
  # 11.8 is the first CUDA that compiles for sm_90; an older nvcc would fail the whole build.
  set(_cudist_min_cuda 11.8)
  if(NOT CMAKE_CUDA_COMPILER OR NOT CUDAToolkit_FOUND
     OR CMAKE_CUDA_COMPILER_VERSION VERSION_LESS _cudist_min_cuda)
    set(_cudist_why "no CUDA compiler was found (put nvcc on PATH, or set CUDACXX or CMAKE_CUDA_COMPILER)")
    if(CMAKE_CUDA_COMPILER AND CMAKE_CUDA_COMPILER_VERSION VERSION_LESS _cudist_min_cuda)
      set(_cudist_why "${CMAKE_CUDA_COMPILER} is CUDA ${CMAKE_CUDA_COMPILER_VERSION}, older than the "
                      "${_cudist_min_cuda} needed for ${CMAKE_CUDA_ARCHITECTURES}")
    elseif(CMAKE_CUDA_COMPILER)
      set(_cudist_why "the CUDA toolkit of ${CMAKE_CUDA_COMPILER} was not found (set CUDAToolkit_ROOT)")
    endif()
    if(_cudist_cuda_required)
      message(FATAL_ERROR "cudist: CUDIST_WITH_CUDA=${CUDIST_WITH_CUDA} but ${_cudist_why}. "
                          "Configure with -DCUDIST_WITH_CUDA=OFF (or AUTO) for a CPU-only build.")
    endif()
    message(STATUS "cudist: building without CUDA: ${_cudist_why}")
  else()
    get_filename_component(_cudist_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
    add_library(cudist_cuda STATIC "${_cudist_root}/csrc/src/cuda/launch.cu")
    add_library(cudist::cuda ALIAS cudist_cuda)
    target_include_directories(cudist_cuda PUBLIC $<BUILD_INTERFACE:${_cudist_root}/csrc/include>
                                                  $<INSTALL_INTERFACE:${CUDIST_INSTALL_PREFIX}/include>)
    target_compile_features(cudist_cuda PUBLIC cxx_std_17)
    set_target_properties(cudist_cuda PROPERTIES
      CUDA_STANDARD 17
      CUDA_STANDARD_REQUIRED ON
      CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
      POSITION_INDEPENDENT_CODE ON
      EXPORT_NAME cuda
      OUTPUT_NAME cudist_cuda)
    # The kernels' numerics do not depend on these flags (they use explicitly rounded intrinsics),
    # but keep nvcc from contracting anything else either.
    target_compile_options(cudist_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--fmad=false>)
    target_link_libraries(cudist_cuda PUBLIC CUDA::cudart_static)
    set(CUDIST_HAVE_CUDA ON)
    message(STATUS "cudist: building cudist::cuda with CUDA ${CMAKE_CUDA_COMPILER_VERSION} "
                   "for architectures ${CMAKE_CUDA_ARCHITECTURES}")
  endif()
else()
  message(STATUS "cudist: building without CUDA (CUDIST_WITH_CUDA=${CUDIST_WITH_CUDA})")
endif()
