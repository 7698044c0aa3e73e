/// @file half.hpp
/// @brief An IEEE 754 binary16 storage type whose arithmetic matches NumPy's float16 bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace cudist {

namespace detail {

/// float32 -> binary16 bits, round to nearest even; overflow gives inf, NaN stays a (quiet) NaN.
inline std::uint16_t float_to_half_bits(float f) noexcept {
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t ax = x & 0x7fffffffu;
  std::uint16_t out;
  if (ax >= (127u + 16u) << 23) {  // |f| >= 65536 (rounds to inf) or inf / NaN
    out = ax > 0x7f800000u ? static_cast<std::uint16_t>(0x7e00u | ((ax >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (ax < 113u << 23) {  // result is subnormal or zero
    // Adding 0.5f puts the ulp at 2^-24, the binary16 subnormal step, so the FPU's own
    // round-to-nearest-even rounds exactly as the conversion must.
    float af;
    std::memcpy(&af, &ax, sizeof af);
    af += 0.5f;
    std::uint32_t r;
    std::memcpy(&r, &af, sizeof r);
    out = static_cast<std::uint16_t>(r - 0x3f000000u);
  } else {
    const std::uint32_t mant_odd = (ax >> 13) & 1u;
    ax += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;  // rebias + RNE bias
    out = static_cast<std::uint16_t>(ax >> 13);  // a carry into the exponent gives inf: correct
  }
  return static_cast<std::uint16_t>(out | sign);
}

/// binary16 bits -> float32 (exact).
inline float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    // Subnormal or zero: mant * 2^-24 is exact in float32.
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    std::memcpy(&bits, &v, sizeof bits);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace detail

/// IEEE 754 binary16, the layout of NumPy's ``float16``.
///
/// A storage type: arithmetic converts to float32, computes there and rounds the result back to
/// nearest even, which is exactly what NumPy does for every float16 operation, so a sequence of
/// operations on ``half`` gives the bits NumPy gives.
struct half {
  std::uint16_t bits;  ///< The raw binary16 bits.

  half() noexcept = default;
  /// Rounds a float32 to the nearest binary16 (ties to even).
  explicit half(float f) noexcept : bits(detail::float_to_half_bits(f)) {}
  /// Rounds a double via float32, as NumPy's ``np.float16(np.float32(x))``.
  explicit half(double d) noexcept : half(static_cast<float>(d)) {}
  /// Rounds an integer via float32.
  explicit half(int i) noexcept : half(static_cast<float>(i)) {}

  /// Builds a half from raw bits.
  static half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }
  /// The exact float32 value.
  explicit operator float() const noexcept { return detail::half_bits_to_float(bits); }
  /// The exact float64 value.
  explicit operator double() const noexcept { return static_cast<double>(static_cast<float>(*this)); }

  friend half operator+(half a, half b) noexcept { return half(float(a) + float(b)); }
  friend half operator-(half a, half b) noexcept { return half(float(a) - float(b)); }
  friend half operator*(half a, half b) noexcept { return half(float(a) * float(b)); }
  friend half operator/(half a, half b) noexcept { return half(float(a) / float(b)); }
  friend half operator-(half a) noexcept { return from_bits(static_cast<std::uint16_t>(a.bits ^ 0x8000u)); }
  half& operator+=(half o) noexcept { return *this = *this + o; }
  half& operator-=(half o) noexcept { return *this = *this - o; }
  half& operator*=(half o) noexcept { return *this = *this * o; }
  half& operator/=(half o) noexcept { return *this = *this / o; }
  /// IEEE comparison (NaN unequal to everything, +0 == -0).
  friend bool operator==(half a, half b) noexcept { return float(a) == float(b); }
  friend bool operator!=(half a, half b) noexcept { return !(a == b); }
  friend bool operator<(half a, half b) noexcept { return float(a) < float(b); }
};

static_assert(sizeof(half) == 2, "cudist::half must be 2 bytes, like numpy.float16");

/// Rounds a float32 to the nearest binary16 value and returns it as float32.
inline float round_to_half(float f) noexcept { return detail::half_bits_to_float(detail::float_to_half_bits(f)); }

}  // namespace cudist
