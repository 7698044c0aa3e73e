// Host emulation of CUDA's <cuda_bf16.h> for cudist's kernels (tests only): a 2-byte `__nv_bfloat16`
// with the bit casts the kernels use. The kernels round float32 -> bfloat16 themselves
// (<cudist/kernels/common.cuh>), so no conversion is emulated here: the emulation runs their code.
#pragma once

#include "cuda_emu.hpp"

struct __nv_bfloat16 {
  unsigned short __x;  // the raw bfloat16 bits (the name CUDA's own __nv_bfloat16 uses)
};
static_assert(sizeof(__nv_bfloat16) == 2, "__nv_bfloat16 must be 2 bytes, like ml_dtypes.bfloat16");

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return __nv_bfloat16{b}; }
