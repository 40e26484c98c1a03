// IEEE binary16 (float16, NumPy's <f2) and bfloat16 from and to double, for
// the .npy code and mha-run's conversions on load.  From the formats'
// definitions, in plain C++ without the library: a double is rounded once,
// to nearest with ties to even (a float64 file is not rounded to float32
// first); NaN stays NaN (quiet, its sign kept), infinities stay, finite
// values beyond the largest half value round to infinity (a caller that must
// not lose a finite value checks the result).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mha_tools {

namespace half_detail {

// |x| (finite, not NaN) rounded to `digits` significant bits, an exponent
// range [emin, emax] and a bias: the magnitude bits of the format, or the
// infinity pattern when it rounds beyond emax.
inline uint16_t round_magnitude(double a, int digits, int emin, int emax, int bias,
                                uint16_t infinity) {
  if (a == 0) return 0;
  int e = 0;
  (void)std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): the exponent is e - 1
  if (e - 1 < emin) {       // subnormal: units of 2^(emin - digits + 1), exact scaling
    // 2^(digits - 1) units are the smallest normal: its bits are those units.
    return static_cast<uint16_t>(std::nearbyint(std::ldexp(a, digits - 1 - emin)));
  }
  double units = std::nearbyint(std::ldexp(a, digits - e));  // in [2^(digits-1), 2^digits]
  int exponent = e - 1;
  const double top = std::ldexp(1.0, digits);
  if (units == top) {
    units = top / 2;
    ++exponent;
  }
  if (exponent > emax) return infinity;
  const auto mantissa = static_cast<uint16_t>(units - top / 2);
  return static_cast<uint16_t>((static_cast<unsigned>(exponent + bias) << (digits - 1)) | mantissa);
}

}  // namespace half_detail

inline uint16_t f16_bits_from_double(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return static_cast<uint16_t>(sign | 0x7E00);
  if (std::isinf(x)) return static_cast<uint16_t>(sign | 0x7C00);
  return static_cast<uint16_t>(sign |
                               half_detail::round_magnitude(std::fabs(x), 11, -14, 15, 15, 0x7C00));
}

inline uint16_t bf16_bits_from_double(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return static_cast<uint16_t>(sign | 0x7FC0);
  if (std::isinf(x)) return static_cast<uint16_t>(sign | 0x7F80);
  return static_cast<uint16_t>(
      sign | half_detail::round_magnitude(std::fabs(x), 8, -126, 127, 127, 0x7F80));
}

inline double f16_bits_to_double(uint16_t bits) {
  const double sign = (bits & 0x8000u) != 0 ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent == 0x1F) return mantissa != 0 ? std::copysign(std::nan(""), sign) : sign * HUGE_VAL;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

inline double bf16_bits_to_double(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f = 0;
  std::memcpy(&f, &wide, sizeof f);
  return static_cast<double>(f);
}

// The largest finite values.
constexpr double kF16Max = 65504.0;
constexpr double kBf16Max = 3.3895313892515355e38;  // (2 - 2^-7) * 2^127

}  // namespace mha_tools
