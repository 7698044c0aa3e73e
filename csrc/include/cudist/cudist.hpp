/// @file cudist.hpp
/// @brief Umbrella header of cudist's C++ API: include this one.
///
/// Header-only; needs C++17 and threads (link ``cudist::cudist`` from CMake, which brings both).
/// Compile without -ffast-math (and ideally with -ffp-contract=off, which the CMake target adds)
/// so results stay bit-identical to NumPy.
#pragma once

#include "all_reduce.hpp"
#include "bfloat16.hpp"
#include "half.hpp"
#include "reduce_op.hpp"
#include "thread_pool.hpp"
#include "updates.hpp"
#include "version.hpp"
