// cudist CUDA kernels: the kernel list, declared once.
//
// Every kernel template of <cudist/kernels/kernels.cuh> that cudist launches, with the dtypes it is
// instantiated for. Both launch paths take it from here:
//  * the C++ launchers (<cudist/cuda/launch.hpp>, <cudist/cuda/p2p.hpp>): each launcher is listed
//    under the kernel it is built on and instantiated for exactly that kernel's dtypes
//    (CUDIST_CUDA_FOR_EACH_LAUNCHER in launch.hpp expands both lists);
//  * the CuPy backend (src/cudist/_kernels/_cuda_launch.py parses this file): its NVRTC name
//    expressions are `cudist::kernels::<kernel>_packed<T>` for every entry below.
// Plain preprocessor text (no CUDA, no includes), kept in the simple form Python parses: one
// `X(A, <kernel>, <dtype set>)` per line and one `D(A, <C++ type>, <NumPy name>)` per dtype.
#pragma once

/// D(A, T, name) for every dtype of a set: A passed through, T the C++ element type, name NumPy's.
/// ALL is every dtype cudist's kernels support: the collectives, the batch scatter and assign_add
/// take them all, bfloat16 (``ml_dtypes.bfloat16``; CUDA's __nv_bfloat16, summed in float32 and
/// rounded once, see common.cuh) included. FLOAT is the floating-point ones the updates take: the
/// 16-bit floats compute in float32 and round once per stored value (bfloat16 as float16).
#define CUDIST_DTYPES_ALL(D, A) \
  D(A, __half, float16)         \
  D(A, float, float32)          \
  D(A, double, float64)         \
  D(A, int, int32)              \
  D(A, long long, int64)        \
  D(A, __nv_bfloat16, bfloat16)
#define CUDIST_DTYPES_FLOAT(D, A) \
  D(A, __half, float16)           \
  D(A, float, float32)            \
  D(A, double, float64)           \
  D(A, __nv_bfloat16, bfloat16)

/// Mixed precision: M(A, variable dtype, gradient dtype) for every pair whose fused all-reduce +
/// update kernels (every `mirrored_all_reduce_*` of the rules' table) and LossScaleOptimizer's
/// `reduce_unscale_finite` are also instantiated `kernel<T, G>` (T the variables', G the
/// gradients' C++ type; NumPy names here): the gradients widened exactly while summed in float32.
/// The CuPy backend compiles their `_packed` forms through NVRTC; the C++ launchers take
/// gradients of the variables' dtype.
#define CUDIST_MIXED_GRADIENTS(M, A) \
  M(A, float32, float16)             \
  M(A, float32, bfloat16)

/// X(A, kernel, SET) for every kernel (each has a pointer-table form `kernel<T>` and the by-value
/// form `kernel_packed<T>` that the launchers and the CuPy backend launch), SET naming the
/// CUDIST_DTYPES_<SET> it is instantiated for. Besides these, each row `name` of
/// CUDIST_UPDATE_RULE_LIST (<cudist/detail/update_rules.hpp>) has the kernel
/// `mirrored_all_reduce_<name>`, FLOAT (generated in <cudist/kernels/mirrored.cuh>, so that a rule
/// is named once).
#define CUDIST_KERNELS(X, A)                  \
  X(A, all_reduce_one_shot, ALL)              \
  X(A, reduce_scatter, ALL)                   \
  X(A, all_gather_chunks, ALL)                \
  X(A, broadcast, ALL)                        \
  X(A, scatter_batch, ALL)                    \
  X(A, mirrored_assign_add, ALL)              \
  X(A, reduce_unscale_finite, FLOAT)
