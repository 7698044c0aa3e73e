/// @file bfloat16.hpp
/// @brief A bfloat16 storage type whose conversions match ``ml_dtypes.bfloat16`` bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace cudist {

namespace detail {

/// float32 -> bfloat16 bits, round to nearest even (subnormals included: bfloat16 has float32's
/// exponent range, so they round like any other value); overflow gives inf. A NaN becomes the
/// quiet NaN 0x7fc0 with the NaN's sign, as ml_dtypes does (its payload is dropped), so a rounding
/// carry can never turn a NaN into inf.
inline std::uint16_t float_to_bfloat16_bits(float f) noexcept {
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  // Branch-free (a select), so the reductions' loops vectorize.
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;  // RNE; a carry rounds up (to inf at the top)
  const std::uint32_t nan = ((x >> 16) & 0x8000u) | 0x7fc0u;
  return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/// bfloat16 bits -> float32 (exact: the upper half of a float32).
inline float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  const std::uint32_t x = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

}  // namespace detail

/// bfloat16 (1 sign, 8 exponent, 7 mantissa bits), the layout of ``ml_dtypes.bfloat16``.
///
/// A storage type like cudist::half: values convert exactly to float32, arithmetic happens there.
/// The reductions accumulate a whole chain in float32 and round once at the end (see
/// detail::arith<bfloat16>); the operators below round after each operation, as ml_dtypes' do.
struct bfloat16 {
  std::uint16_t bits;  ///< The raw bfloat16 bits.

  bfloat16() noexcept = default;
  /// Rounds a float32 to the nearest bfloat16 (ties to even).
  explicit bfloat16(float f) noexcept : bits(detail::float_to_bfloat16_bits(f)) {}
  /// Rounds a double via float32, as ``ml_dtypes.bfloat16(np.float32(x))``.
  explicit bfloat16(double d) noexcept : bfloat16(static_cast<float>(d)) {}
  /// Rounds an integer via float32.
  explicit bfloat16(int i) noexcept : bfloat16(static_cast<float>(i)) {}

  /// Builds a bfloat16 from raw bits.
  static bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  /// The exact float32 value.
  explicit operator float() const noexcept { return detail::bfloat16_bits_to_float(bits); }
  /// The exact float64 value.
  explicit operator double() const noexcept { return static_cast<double>(static_cast<float>(*this)); }

  friend bfloat16 operator+(bfloat16 a, bfloat16 b) noexcept { return bfloat16(float(a) + float(b)); }
  friend bfloat16 operator-(bfloat16 a, bfloat16 b) noexcept { return bfloat16(float(a) - float(b)); }
  friend bfloat16 operator*(bfloat16 a, bfloat16 b) noexcept { return bfloat16(float(a) * float(b)); }
  friend bfloat16 operator/(bfloat16 a, bfloat16 b) noexcept { return bfloat16(float(a) / float(b)); }
  friend bfloat16 operator-(bfloat16 a) noexcept { return from_bits(static_cast<std::uint16_t>(a.bits ^ 0x8000u)); }
  /// IEEE comparison (NaN unequal to everything, +0 == -0).
  friend bool operator==(bfloat16 a, bfloat16 b) noexcept { return float(a) == float(b); }
  friend bool operator!=(bfloat16 a, bfloat16 b) noexcept { return !(a == b); }
  friend bool operator<(bfloat16 a, bfloat16 b) noexcept { return float(a) < float(b); }
};

static_assert(sizeof(bfloat16) == 2, "cudist::bfloat16 must be 2 bytes, like ml_dtypes.bfloat16");

}  // namespace cudist
