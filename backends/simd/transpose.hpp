// In-register transpose of a W x W block (W = floats per vector): rows[i]
// lane j becomes rows[j] lane i.  Shuffles only — the Q packing with gathers
// or scalar scatters costs several percent of a prefill (docs/kernel-design.md).
// xsimd 8.1 has no transpose, so each ISA gets its native sequence.
#pragma once

#include <xsimd/xsimd.hpp>

#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace mha_simd {

template <class Arch>
inline void transpose_square(xsimd::batch<float, Arch>* rows) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
#if defined(__AVX512F__)
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = rows[i];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
      r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 4; ++j) {
        t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
        t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
      }
    }
    for (int j = 0; j < 8; ++j) {
      rows[j] = B(_mm512_shuffle_f32x4(t[j], t[j + 8], 0x88));
      rows[j + 8] = B(_mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd));
    }
    return;
  }
#endif
#if defined(__AVX2__)
  if constexpr (W == 8) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
      s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int j = 0; j < 4; ++j) {
      rows[j] = B(_mm256_permute2f128_ps(s[j], s[j + 4], 0x20));
      rows[j + 4] = B(_mm256_permute2f128_ps(s[j], s[j + 4], 0x31));
    }
    return;
  }
#endif
#if defined(__aarch64__)
  if constexpr (W == 4) {
    const float32x4x2_t t01 = vtrnq_f32(rows[0], rows[1]);
    const float32x4x2_t t23 = vtrnq_f32(rows[2], rows[3]);
    rows[0] = B(vcombine_f32(vget_low_f32(t01.val[0]), vget_low_f32(t23.val[0])));
    rows[1] = B(vcombine_f32(vget_low_f32(t01.val[1]), vget_low_f32(t23.val[1])));
    rows[2] = B(vcombine_f32(vget_high_f32(t01.val[0]), vget_high_f32(t23.val[0])));
    rows[3] = B(vcombine_f32(vget_high_f32(t01.val[1]), vget_high_f32(t23.val[1])));
    return;
  }
#endif
  // Any other ISA: through memory.
  alignas(64) float block[W * W];
  for (int i = 0; i < W; ++i) rows[i].store_aligned(block + i * W);
  for (int j = 0; j < W; ++j) {
    alignas(64) float column[W];
    for (int i = 0; i < W; ++i) column[i] = block[i * W + j];
    rows[j] = B::load_aligned(column);
  }
}

}  // namespace mha_simd
