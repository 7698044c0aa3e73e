/// @file detail/arith.hpp
/// @brief Per-type arithmetic that reproduces NumPy's results bit for bit (private).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../bfloat16.hpp"
#include "../half.hpp"

namespace cudist {
namespace detail {

/// Arithmetic of the reductions and updates for storage type T.
///
/// ``acc_t`` is the type values are computed in (float32 for half); ``add`` is the reduction's
/// addition in that type, and ``store`` rounds to T (once, at the end of a sum).
template <class T, class Enable = void>
struct arith;

template <class T>
struct arith<T, std::enable_if_t<std::is_floating_point<T>::value>> {
  using acc_t = T;
  using compute_t = T;
  static constexpr bool is_float = true;
  static acc_t load(T x) noexcept { return x; }
  static T store(acc_t a) noexcept { return a; }
  static acc_t add(acc_t a, acc_t b) noexcept { return a + b; }
  static acc_t sub(acc_t a, acc_t b) noexcept { return a - b; }
  // NumPy divides by ``dtype.type(n)``: true division, not a multiplication by 1/n.
  static acc_t div_n(acc_t a, acc_t n) noexcept { return a / n; }
  static acc_t count(std::size_t n) noexcept { return static_cast<T>(n); }
};

template <class T>
struct arith<T, std::enable_if_t<std::is_integral<T>::value>> {
  using acc_t = T;
  using compute_t = T;
  using u_t = std::make_unsigned_t<T>;
  static constexpr bool is_float = false;
  static acc_t load(T x) noexcept { return x; }
  static T store(acc_t a) noexcept { return a; }
  // Wrap-around as NumPy's integers do, computed unsigned because signed overflow is UB in C++.
  static acc_t add(acc_t a, acc_t b) noexcept { return static_cast<T>(static_cast<u_t>(a) + static_cast<u_t>(b)); }
  static acc_t sub(acc_t a, acc_t b) noexcept { return static_cast<T>(static_cast<u_t>(a) - static_cast<u_t>(b)); }
  // C++ integer division truncates toward zero; n >= 1 so it cannot overflow.
  static acc_t div_n(acc_t a, acc_t n) noexcept { return a / n; }
  static acc_t count(std::size_t n) noexcept { return static_cast<T>(n); }
};

// float16 accumulates in float32 and rounds once, on store: a sum over replicas rounded after every
// addition would lose the low bits of later replicas (the contract, cudist/_kernels/_base.py).
// assign_add / assign_sub are one addition, so rounding on store is NumPy's float16 result.
template <>
struct arith<half, void> {
  using acc_t = float;
  using compute_t = float;
  static constexpr bool is_float = true;
  static acc_t load(half x) noexcept { return static_cast<float>(x); }
  static half store(acc_t a) noexcept { return half(a); }
  static acc_t add(acc_t a, acc_t b) noexcept { return a + b; }
  static acc_t sub(acc_t a, acc_t b) noexcept { return a - b; }
  // The float32 sum divided by float32(n) (true division), rounded by store().
  static acc_t div_n(acc_t a, acc_t n) noexcept { return a / n; }
  static acc_t count(std::size_t n) noexcept { return static_cast<float>(n); }
};

// bfloat16 reductions accumulate in float32 and round once, in store(): an 8-bit mantissa rounded
// after every addition would drop the low replicas' bits (the NumPy reference's definition, and
// what NCCL and DeepSpeed do). The mean divides the float32 sum by float32(n).
template <>
struct arith<bfloat16, void> {
  using acc_t = float;
  using compute_t = float;
  static constexpr bool is_float = true;
  static acc_t load(bfloat16 x) noexcept { return static_cast<float>(x); }
  static bfloat16 store(acc_t a) noexcept { return bfloat16(a); }
  // Plain float32 additions, like the float32 kernels': the accumulator stays the first operand of
  // the vector add, so a NaN + NaN sum keeps the first NaN's sign as NumPy's loop does (checked by
  // tests/test_bfloat16_kernels.py). A select guarding it stops vectorization (5x slower, -ftrapping-math).
  static acc_t add(acc_t a, acc_t b) noexcept { return a + b; }
  static acc_t sub(acc_t a, acc_t b) noexcept { return a - b; }
  static acc_t div_n(acc_t a, acc_t n) noexcept { return a / n; }
  static acc_t count(std::size_t n) noexcept { return static_cast<float>(n); }
};

/// Type of the mirrored-update arithmetic: the variable type, float32 for half.
template <class T>
using compute_t = typename arith<T>::compute_t;

}  // namespace detail
}  // namespace cudist
