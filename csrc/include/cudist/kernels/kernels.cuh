// cudist CUDA kernels, all of them. `#include <cudist/kernels/kernels.cuh>` from a .cu file compiled
// by nvcc (C++17), or hand this header to NVRTC (CuPy's RawModule does) with `-I<cudist include dir>`
// and name expressions such as "cudist::kernels::all_reduce_one_shot<float>".
#pragma once

#include "common.cuh"
#include "all_reduce.cuh"
#include "mirrored.cuh"
#include "scatter.cuh"
