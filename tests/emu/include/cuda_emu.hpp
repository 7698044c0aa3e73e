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
#include <cstdlib>
#include <cstring>

namespace cudist_emu {

/// The harder emulation modes of CUDIST_EMU_MODE (comma-separated, read at the first launch; the
/// fake CuPy reads the same variable): `shuffle` runs each launch's (block, thread) pairs in a
/// random order (CUDIST_EMU_SEED seeds it), `ftz` makes the float32 __f*_rn intrinsics flush
/// subnormal inputs and results to zero as CuPy's forced -ftz=true does on a GPU.
struct Modes {
  bool shuffle = false;
  bool ftz = false;
  unsigned long long seed = 0;
};

inline bool mode_listed(const char* list, const char* name) {
  const std::size_t n = std::strlen(name);
  for (const char* p = list; p != nullptr && *p != '\0';) {
    while (*p == ',' || *p == ' ') ++p;
    const char* end = p;
    while (*end != '\0' && *end != ',' && *end != ' ') ++end;
    if (static_cast<std::size_t>(end - p) == n && std::strncmp(p, name, n) == 0) return true;
    p = end;
  }
  return false;
}

inline Modes& modes() {
  static Modes m = [] {
    Modes r;
    const char* list = std::getenv("CUDIST_EMU_MODE");
    r.shuffle = mode_listed(list, "shuffle");
    r.ftz = mode_listed(list, "ftz");
    const char* seed = std::getenv("CUDIST_EMU_SEED");
    r.seed = seed != nullptr ? std::strtoull(seed, nullptr, 10) : 0;
    return r;
  }();
  return m;
}

/// A float32 operand or result as a GPU in flush-to-zero mode sees it.
inline float ftz(float x) { return modes().ftz && std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }

}  // namespace cudist_emu

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
// The float32 ones flush subnormals in the `ftz` mode, as they do on a GPU under -ftz=true (which
// CuPy always passes to NVRTC); the double ones never flush.
inline float __fadd_rn(float a, float b) { using cudist_emu::ftz; return ftz(ftz(a) + ftz(b)); }
inline float __fsub_rn(float a, float b) { using cudist_emu::ftz; return ftz(ftz(a) - ftz(b)); }
inline float __fmul_rn(float a, float b) { using cudist_emu::ftz; return ftz(ftz(a) * ftz(b)); }
inline float __fdiv_rn(float a, float b) { using cudist_emu::ftz; return ftz(ftz(a) / ftz(b)); }
inline float __fsqrt_rn(float a) { using cudist_emu::ftz; return ftz(std::sqrt(ftz(a))); }
inline float __frcp_rn(float a) { using cudist_emu::ftz; return ftz(1.0f / ftz(a)); }
inline float __fmaf_rn(float a, float b, float c) { using cudist_emu::ftz; return ftz(std::fma(ftz(a), ftz(b), ftz(c))); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline double __drcp_rn(double a) { return 1.0 / a; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

// The runtime, the launch and CUDIST_LAUNCH_KERNEL (the runtime needs the definitions above).
#include <cuda_runtime_api.h>
