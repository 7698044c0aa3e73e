/// @file reduce_op.hpp
/// @brief The cross-replica reduction operations (tf.distribute.ReduceOp).
#pragma once

namespace cudist {

/// How N replica buffers are combined elementwise.
///
/// Both ops add in replica order, ((b0 + b1) + b2) + ..., in the buffers' type, except float16,
/// which accumulates in float32 and rounds once at the end; integers wrap around. MEAN then divides
/// by N: true division for floating point (not a multiplication by 1/N; float16 divides the float32
/// sum, then rounds), truncation toward zero for integers.
enum class reduce_op : int {
  sum = 0,   ///< Elementwise sum.
  mean = 1,  ///< Elementwise sum divided by the number of replicas.
};

}  // namespace cudist
