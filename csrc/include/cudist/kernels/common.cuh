// cudist CUDA kernels: shared device helpers.
//
// Every kernel header in this directory compiles both with nvcc (C++17) and with NVRTC (CuPy's
// RawModule): nothing here includes a host-only header, and sizes and indices are `long long` so
// that no <cstdint>/<cstddef> is needed under NVRTC.
//
// Numerics follow the kernel contract of cudist (src/cudist/_kernels/_base.py) bit for bit:
//  * sums add in replica order 0, 1, ..., N-1 in the buffer dtype (integers wrap around), except
//    the 16-bit floats (float16, bfloat16), which accumulate in float32 and round once, on store;
//  * MEAN divides that sum by N: IEEE division for floats (the 16-bit floats: the float32 sum by
//    float32(N)), truncation toward zero for integers;
//  * updates of float16 variables compute in float32 and round to nearest even on store.
// Floating-point arithmetic goes through the `__d*_rn` intrinsics and, for float32, `.rn` PTX
// without `.ftz`: never contracted into FMAs, always rounded to nearest, subnormals kept, whatever
// -fmad / -prec-div / -ftz / -use_fast_math the including translation unit (or CuPy, which forces
// -ftz=true) compiles with, so the GPU matches NumPy exactly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cudist {
namespace kernels {

/// Most replica buffers one kernel launch reads or writes. More replicas are handled by the
/// launchers in several passes (the summation order stays 0, 1, ..., N-1).
constexpr int kMaxReplicas = 8;

/// Up to kMaxReplicas device pointers, passed to the `*_packed` kernels by value.
template <class T>
struct PtrPack {
  T* p[kMaxReplicas];
};

namespace detail {

// ----------------------------------------------------------------------------- arithmetic
// Compute type: the 16-bit floats compute in float32, everything else in itself.
template <class T> struct compute { using type = T; };
template <> struct compute<__half> { using type = float; };
template <> struct compute<__nv_bfloat16> { using type = float; };

// bfloat16 <-> float32 written out on the bits rather than CUDA's __bfloat162float /
// __float2bfloat16_rn: the rounding must give ml_dtypes' bits, and CUDA's turns every NaN into
// 0x7fff where ml_dtypes (and cudist's CPU kernels, <cudist/bfloat16.hpp>, which NVRTC cannot
// include: <cstring>) give the quiet NaN 0x7fc0 with the NaN's sign. Integer operations only, so
// -ftz (CuPy's) cannot flush a subnormal on the way.
__device__ __forceinline__ unsigned int float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  unsigned int u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}
__device__ __forceinline__ float bits_float(unsigned int u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}
// Exact: a bfloat16 is the upper half of a float32.
__device__ __forceinline__ float bf16_to_float(__nv_bfloat16 x) {
  return bits_float((unsigned int)__bfloat16_as_ushort(x) << 16);
}
// Round to nearest even (a carry out of the mantissa rounds up, to inf past the largest finite);
// a NaN becomes 0x7fc0 | sign, so no rounding carry can turn it into inf.
__device__ __forceinline__ __nv_bfloat16 float_to_bf16(float f) {
  const unsigned int x = float_bits(f);
  const unsigned int rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const unsigned int nan = ((x >> 16) & 0x8000u) | 0x7fc0u;
  return __ushort_as_bfloat16((unsigned short)((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded));
}

__device__ __forceinline__ float to_compute(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_compute(__nv_bfloat16 x) { return bf16_to_float(x); }
__device__ __forceinline__ float to_compute(float x) { return x; }
__device__ __forceinline__ double to_compute(double x) { return x; }
__device__ __forceinline__ int to_compute(int x) { return x; }
__device__ __forceinline__ long long to_compute(long long x) { return x; }

template <class T> __device__ __forceinline__ T from_compute(typename compute<T>::type x) { return x; }
template <> __device__ __forceinline__ __half from_compute<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_compute<__nv_bfloat16>(float x) { return float_to_bf16(x); }

// float32 goes through PTX without `.ftz`: CuPy compiles every RawModule with -ftz=true, under
// which the __f*_rn intrinsics flush subnormal operands and results to zero (NumPy keeps them).
// The host branch (the CPU emulation in tests/emu) is plain IEEE arithmetic.
#if defined(__CUDA_ARCH__)
#define CUDIST_F32_BINARY(name, op)                                                   \
  __device__ __forceinline__ float name(float a, float b) {                           \
    float r;                                                                          \
    asm(op ".rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                         \
    return r;                                                                         \
  }
CUDIST_F32_BINARY(add, "add")
CUDIST_F32_BINARY(sub, "sub")
CUDIST_F32_BINARY(mul, "mul")
CUDIST_F32_BINARY(div, "div")
#undef CUDIST_F32_BINARY
__device__ __forceinline__ float sqrt_rn(float a) {
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
#else
__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ float sub(float a, float b) { return a - b; }
__device__ __forceinline__ float mul(float a, float b) { return a * b; }
__device__ __forceinline__ float div(float a, float b) { return a / b; }
__device__ __forceinline__ float sqrt_rn(float a) { return sqrtf(a); }
#endif
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }

// Elementwise add/subtract in the buffer dtype, as NumPy does it.
// float16: the float32 sum of two halves rounded once to half equals the correctly rounded half
// sum (float32 has >= 2*11+2 significand bits, so the double rounding is innocuous).
__device__ __forceinline__ __half add(__half a, __half b) {
  return __float2half_rn(add(__half2float(a), __half2float(b)));
}
__device__ __forceinline__ __half sub(__half a, __half b) {
  return __float2half_rn(sub(__half2float(a), __half2float(b)));
}
// bfloat16 (assign_add): likewise, as ml_dtypes adds (float32 has >= 2*8+2 significand bits).
__device__ __forceinline__ __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) {
  return float_to_bf16(add(bf16_to_float(a), bf16_to_float(b)));
}
__device__ __forceinline__ __nv_bfloat16 sub(__nv_bfloat16 a, __nv_bfloat16 b) {
  return float_to_bf16(sub(bf16_to_float(a), bf16_to_float(b)));
}
// Integers wrap around: add in the unsigned type (signed overflow would be undefined behaviour).
__device__ __forceinline__ int add(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int sub(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
__device__ __forceinline__ long long add(long long a, long long b) {
  return (long long)((unsigned long long)a + (unsigned long long)b);
}
__device__ __forceinline__ long long sub(long long a, long long b) {
  return (long long)((unsigned long long)a - (unsigned long long)b);
}

// MEAN: the (already reduced) sum divided by the replica count n >= 1.
__device__ __forceinline__ float divide_by(float s, int n) { return div(s, (float)n); }
__device__ __forceinline__ double divide_by(double s, int n) { return __ddiv_rn(s, (double)n); }
// C division truncates toward zero, which is the contract; n >= 1 so INT_MIN / n is defined.
__device__ __forceinline__ int divide_by(int s, int n) { return s / n; }
__device__ __forceinline__ long long divide_by(long long s, int n) { return s / (long long)n; }

// ----------------------------------------------------------------------------- vector access
// Elements per 16-byte vector; the kernels move whole vectors when every pointer they touch is
// 16-byte aligned and fall back to scalars for the tail (or for unaligned views).
template <class T> struct vec_width { static constexpr int value = 16 / (int)sizeof(T); };

template <class T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

template <int W, class T>
__device__ __forceinline__ Pack<T, W> load(const T* p) {
  return *reinterpret_cast<const Pack<T, W>*>(p);
}
template <int W, class T>
__device__ __forceinline__ void store(T* p, const Pack<T, W>& x) {
  *reinterpret_cast<Pack<T, W>*>(p) = x;
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

/// Replica pointers held in registers: the launchers pass at most kMaxReplicas, every loop over
/// them is unrolled to kMaxReplicas with an `r < n` guard, so indices are compile-time constants.
template <class T>
struct Ptrs {
  T* p[kMaxReplicas];
};

// Tells the compiler that the first n pointers address global memory (device buffers, or pinned
// host memory mapped into the global space), so it emits LDG/STG rather than generic loads and
// stores: left to itself, NVVM infers the space for some kernels' pointers and not others, by
// how their code happens to be shaped.
template <class T>
__device__ __forceinline__ void assume_global(const Ptrs<T>& r, int n) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#pragma unroll
  for (int i = 0; i < kMaxReplicas; ++i)
    if (i < n) __builtin_assume(__isGlobal(r.p[i]));
#else
  (void)r;
  (void)n;
#endif
}

// From a device-side table of pointers (CuPy entry points) ...
template <class T>
__device__ __forceinline__ Ptrs<T> load_ptrs(T* const* table, int n) {
  Ptrs<T> r;
#pragma unroll
  for (int i = 0; i < kMaxReplicas; ++i) r.p[i] = i < n ? table[i] : nullptr;
  assume_global(r, n);
  return r;
}
// ... or from a by-value pack (C++ launchers).
template <class T>
__device__ __forceinline__ Ptrs<T> load_ptrs(const PtrPack<T>& pack, int n) {
  Ptrs<T> r;
#pragma unroll
  for (int i = 0; i < kMaxReplicas; ++i) r.p[i] = i < n ? pack.p[i] : nullptr;
  assume_global(r, n);
  return r;
}

template <class T>
__device__ __forceinline__ bool all_aligned16(const Ptrs<T>& ptrs, int n, long long offset) {
  bool ok = true;
#pragma unroll
  for (int r = 0; r < kMaxReplicas; ++r)
    if (r < n) ok = ok && aligned16(ptrs.p[r] + offset);
  return ok;
}

/// Runs `f.template apply<W>(i)` over [begin, end): whole 16-byte vectors (W = vec_width) while
/// `vectorize` holds, then the scalar tail (W = 1); a grid-stride loop over blockIdx.x. The vector
/// groups start at `begin`, so the caller checks alignment at `begin`.
template <class T, class F>
__device__ __forceinline__ void for_each(long long begin, long long end, bool vectorize, F& f) {
  constexpr int W = vec_width<T>::value;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long count = end > begin ? end - begin : 0;
  const long long groups = vectorize ? count / W : 0;
  for (long long g = tid; g < groups; g += stride) f.template apply<W>(begin + g * W);
  for (long long i = begin + groups * W + tid; i < end; i += stride) f.template apply<1>(i);
}

// (p[0][i..i+W) + p[1][i..] + ... + p[n-1][i..]) (/ divisor), summed in replica order. The loop
// runs to kMaxReplicas with constant indices (unrolled) so that the pointers stay in registers.
template <class T, int W>
__device__ __forceinline__ Pack<T, W> reduce_packs(const Ptrs<T>& p, int n, int divisor, long long i) {
  // The running sum in the compute type: the 16-bit floats accumulate in float32 and round once,
  // on store.
  using C = typename compute<T>::type;
  const Pack<T, W> x0 = load<W>(p.p[0] + i);
  C acc[W];
#pragma unroll
  for (int k = 0; k < W; ++k) acc[k] = to_compute(x0.v[k]);
#pragma unroll
  for (int r = 1; r < kMaxReplicas; ++r) {
    if (r < n) {
      const Pack<T, W> x = load<W>(p.p[r] + i);
#pragma unroll
      for (int k = 0; k < W; ++k) acc[k] = add(acc[k], to_compute(x.v[k]));
    }
  }
  if (divisor > 0) {
#pragma unroll
    for (int k = 0; k < W; ++k) acc[k] = divide_by(acc[k], divisor);
  }
  Pack<T, W> s;
#pragma unroll
  for (int k = 0; k < W; ++k) s.v[k] = from_compute<T>(acc[k]);
  return s;
}

}  // namespace detail
}  // namespace kernels
}  // namespace cudist
