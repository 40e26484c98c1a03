// W vectors in, one vector out: lane k holds the sum of vector k's lanes.
//
// xsimd 8.1's haddp does this, but its avx512f version returns lanes 2-3 and
// 4-5 (and 10-11 and 12-13) swapped: AVX-512 folds each zmm to a ymm and
// uses the (correct) AVX version instead.
#pragma once

#include <xsimd/xsimd.hpp>

#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mha_simd {

template <class Arch>
inline xsimd::batch<float, Arch> sums_of(const xsimd::batch<float, Arch>* rows) {
#if defined(__AVX512F__)
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    using Half = xsimd::batch<float, xsimd::fma3<xsimd::avx2>>;
    Half low[8], high[8];
    for (int i = 0; i < 8; ++i) {
      const __m512 a = rows[i], b = rows[i + 8];
      low[i] = Half(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
      high[i] = Half(_mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1)));
    }
    const __m256 sums_low = xsimd::haddp(low), sums_high = xsimd::haddp(high);
    return xsimd::batch<float, Arch>(
        _mm512_insertf32x8(_mm512_castps256_ps512(sums_low), sums_high, 1));
  }
#endif
  return xsimd::haddp(rows);
}

}  // namespace mha_simd
