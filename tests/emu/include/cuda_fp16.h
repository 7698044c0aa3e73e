// Host emulation of CUDA's <cuda_fp16.h> for cudist's kernels (tests only): a 2-byte IEEE binary16
// `__half` converted with cudist's own routines (<cudist/half.hpp>: round to nearest even, the
// conversions NumPy makes), so emulated float16 kernels give NumPy's bits.
#pragma once

#include <cudist/half.hpp>

#include "cuda_emu.hpp"

struct __half {
  unsigned short __x;  // the raw binary16 bits (the name CUDA's own __half uses)
};
static_assert(sizeof(__half) == 2, "__half must be 2 bytes, like numpy.float16");

struct __half2 {
  __half x, y;
};

inline float __half2float(__half h) { return cudist::detail::half_bits_to_float(h.__x); }
inline __half __float2half_rn(float f) { return __half{cudist::detail::float_to_half_bits(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
