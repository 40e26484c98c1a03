// 2^x for the softmax: scores minus a running maximum, x <= 64 (the fused
// path lets scores exceed a stale maximum by up to kMaxGrowth).
//
// x = n + f with n = round(x), f in [-1/2, 1/2]; 2^f by a degree-5 polynomial
// (minimax for relative error, fitted in float64 and checked in float32: at
// most 2.4e-7 relative, about 2 ulp); 2^n put into the exponent.  Inputs are
// clamped low enough that the result there is exactly 0 (a weight below
// 2^-127 of the row maximum's is below fp32 resolution anyway): masked scores
// (-inf) give 0, never NaN, and a NaN input stays NaN.
#pragma once

#include <xsimd/xsimd.hpp>

#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mha_simd {

template <class Arch>
inline xsimd::batch<float, Arch> fast_exp2(xsimd::batch<float, Arch> x) {
  using B = xsimd::batch<float, Arch>;
  // max(c, x) returns x when x is NaN (on x86 the second operand wins a NaN
  // comparison; Arm's FMAX returns the NaN): a NaN score poisons its row.
  constexpr bool kScalef = std::is_base_of<xsimd::avx512f, Arch>::value;
  // vscalefps rounds p * 2^-160 to 0; the exponent-bits path needs n >= -127,
  // where n = -127 builds the bit pattern of +0.
  x = xsimd::max(B(kScalef ? -160.0f : -127.0f), x);
  const B n = xsimd::nearbyint(x);
  const B f = x - n;
  B p = B(1.3276472e-03f);
  p = xsimd::fma(p, f, B(9.6755419e-03f));
  p = xsimd::fma(p, f, B(5.5507131e-02f));
  p = xsimd::fma(p, f, B(2.4022120e-01f));
  p = xsimd::fma(p, f, B(6.9314694e-01f));
  p = xsimd::fma(p, f, B(1.0000001e+00f));
#if defined(__AVX512F__)
  if constexpr (kScalef) return B(_mm512_scalef_ps(p, n));
#endif
  using I = xsimd::batch<int32_t, Arch>;
  const I bits = (xsimd::to_int(n) + I(127)) << 23;
  return p * xsimd::bitwise_cast<B>(bits);
}

}  // namespace mha_simd
