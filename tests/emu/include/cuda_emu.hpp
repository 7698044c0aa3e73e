// Host emulation of the CUDA language subset cudist's kernels use (tests only).
//
// cudist's kernels (<cudist/kernels/*.cuh>) are race-free grid-stride loops without shared memory,
// __syncthreads or atomics, so running every thread of a launch one after the other on the host
// computes exactly what the GPU computes. This header gives them what nvcc would: the execution
// space qualifiers, dim3/uint3, the per-thread built-in variables (thread_local, so that host
// threads may launch concurrently), the correctly rounded __f*_rn/__d*_rn intrinsics (plain IEEE
// operations; build with -ffp-contract=off so the compiler fuses nothing) and a launch that loops
// over the grid (cudist_emu::launch, with the runtime in <cuda_runtime_api.h>, which this header
// includes), and CUDIST_LAUNCH_KERNEL, through which cudist's C++ launchers launch, defined to it.
#pragma once

#include <cmath>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// The built-in variables of the thread being run (one emulated GPU thread per host thread at a time).
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};

// Correctly rounded intrinsics: on the host every IEEE operation already rounds to nearest even.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline double __drcp_rn(double a) { return 1.0 / a; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

// The runtime, the launch and CUDIST_LAUNCH_KERNEL (the runtime needs the definitions above).
#include <cuda_runtime_api.h>
