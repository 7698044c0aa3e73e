/// @file reduce_op.hpp
/// @brief The cross-replica reduction operations (tf.distribute.ReduceOp).
#pragma once

namespace cudist {

/// How N replica buffers are combined elementwise.
///
/// Both ops add in replica order, ((b0 + b1) + b2) + ..., in the buffers' type: float16 rounds after
/// every addition and integers wrap around. MEAN then divides by N: true division for floating
/// point (not a multiplication by 1/N), truncation toward zero for integers.
enum class reduce_op : int {
  sum = 0,   ///< Elementwise sum.
  mean = 1,  ///< Elementwise sum divided by the number of replicas.
};

}  // namespace cudist
