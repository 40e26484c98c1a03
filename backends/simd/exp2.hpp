// 2^x for the softmax: scores minus a running maximum (the fused path lets
// scores exceed a stale maximum; beyond 2^64 the result is capped -- such a
// tile is computed again anyway).
//
// AVX-512: f = x - floor(x) in [0, 1) by vreduceps, 2^f by a degree-5
// polynomial (minimax for relative error on [0, 1], fitted in float64 and
// checked in float32: 1.6e-7), and vscalefps multiplies by 2^floor(x).
// vreduceps turns ±inf into 0, so NaN stays NaN: 9 operations, one fewer
// than rounding and subtracting (and the clamp) -- on CPUs whose 512-bit
// operations share two ports with the FMAs (Intel), the softmax's exps
// compete with the products for them.  Below -126 the result is 0 (zero
// masking; -inf, a masked score, included), never a subnormal: weights under
// 2^-126 of the row maximum's are below fp32 resolution, and a subnormal
// probability costs a microcode assist in every FMA of P·V it enters (Intel,
// family 6 model 207: S2 with ALiBi, whose distant keys land there, ran 2.7x
// slower than with them flushed).
//
// Elsewhere (AVX2, NEON): x = n + f with n = round(x), f in [-1/2, 1/2];
// 2^f by a degree-5 polynomial (at most 2.4e-7 relative, about 2 ulp), 2^n
// put into the exponent bits.  Inputs are clamped low enough that the
// result there is exactly 0 (a weight below 2^-127 of the row maximum's is
// below fp32 resolution anyway), and high to 64: masked scores (-inf) give
// 0, never NaN, and a NaN input stays NaN.
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
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    const B f = B(_mm512_reduce_ps(x, 0x09));  // x - floor(x); 0x08: no precision exception
    B p = B(1.87736936e-03f);
    p = xsimd::fma(p, f, B(8.98915436e-03f));
    p = xsimd::fma(p, f, B(5.58272116e-02f));
    p = xsimd::fma(p, f, B(2.40152955e-01f));
    p = xsimd::fma(p, f, B(6.93153203e-01f));
    p = xsimd::fma(p, f, B(9.99999940e-01f));
    // Not less than -126, or unordered (NaN passes through).
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    return B(_mm512_maskz_scalef_ps(normal, p, x));
  }
#endif
  // max(c, x) and min(c, x) return x when x is NaN (on x86 the second
  // operand wins a NaN comparison; Arm's FMAX and FMIN return the NaN): a
  // NaN score poisons its row.  The exponent-bits path needs -127 <= n <=
  // 127: n = -127 builds the bit pattern of +0, and 2^64 (a score 64 above
  // a stale maximum) is already far beyond what the fused path keeps.
  x = xsimd::max(B(-127.0f), xsimd::min(B(64.0f), x));
  const B n = xsimd::nearbyint(x);
  const B f = x - n;
  B p = B(1.3276472e-03f);
  p = xsimd::fma(p, f, B(9.6755419e-03f));
  p = xsimd::fma(p, f, B(5.5507131e-02f));
  p = xsimd::fma(p, f, B(2.4022120e-01f));
  p = xsimd::fma(p, f, B(6.9314694e-01f));
  p = xsimd::fma(p, f, B(1.0000001e+00f));
  using I = xsimd::batch<int32_t, Arch>;
  const I bits = (xsimd::to_int(n) + I(127)) << 23;
  return p * xsimd::bitwise_cast<B>(bits);
}

}  // namespace mha_simd
