// Widening the element types of mha's tensors to fp32 vectors as they are
// loaded (bf16 by a 16-bit shift, f16 by vcvtph2ps / fcvtl, int8 by sign
// extension and conversion), and narrowing results back.  The dtype is a
// template parameter, so the loops around a load are compiled once per type.
#pragma once

#include <mha/mha.h>
#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <type_traits>

#include "common/dtype.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace mha_simd {

// The C++ element type of a dtype.
template <int32_t kDtype>
using element_t = std::conditional_t<kDtype == MHA_DTYPE_F32, float,
                                     std::conditional_t<kDtype == MHA_DTYPE_I8, int8_t, uint16_t>>;

// Element x of a row, as fp32 (the scalar edges of the vector loops).
template <int32_t kDtype>
inline float load_one(const element_t<kDtype>* p, int64_t x) {
  if constexpr (kDtype == MHA_DTYPE_I8) {
    return static_cast<float>(p[x]);
  } else {
    return mha_types::load_float(p, kDtype, x);
  }
}

// W elements at p (exactly W: never more bytes than they take), as fp32.
template <class Arch, int32_t kDtype>
inline xsimd::batch<float, Arch> load_widen(const element_t<kDtype>* p) {
  using B = xsimd::batch<float, Arch>;
  if constexpr (kDtype == MHA_DTYPE_F32) {
    return B::load_unaligned(p);
  }
#if defined(__AVX512F__)
  else if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    if constexpr (kDtype == MHA_DTYPE_BF16) {
      const __m512i wide =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return B(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    } else if constexpr (kDtype == MHA_DTYPE_F16) {
      return B(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
    } else {
      return B(_mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
    }
  }
#endif
#if defined(__AVX2__)
  else if constexpr (std::is_base_of<xsimd::avx2, Arch>::value) {
    if constexpr (kDtype == MHA_DTYPE_BF16) {
      const __m256i wide =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return B(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    } else if constexpr (kDtype == MHA_DTYPE_F16) {
      return B(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    } else {
      return B(_mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
    }
  }
#endif
#if defined(__aarch64__)
  else if constexpr (std::is_base_of<xsimd::neon64, Arch>::value) {
    if constexpr (kDtype == MHA_DTYPE_BF16) {
      return B(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)));
    } else if constexpr (kDtype == MHA_DTYPE_F16) {
      return B(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))));
    } else {
      // Exactly four bytes: one 32-bit lane, then sign extension.
      int32_t word;
      __builtin_memcpy(&word, p, sizeof word);
      const int8x8_t bytes = vreinterpret_s8_s32(vdup_n_s32(word));
      return B(vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(bytes)))));
    }
  }
#endif
  else {
    alignas(64) float lanes[B::size];
    for (std::size_t i = 0; i < B::size; ++i)
      lanes[i] = load_one<kDtype>(p, static_cast<int64_t>(i));
    return B::load_aligned(lanes);
  }
}

// n floats (0 < n <= W) loaded from p into the first lanes, the others 0,
// the memory after p + n not read (a row's last partial vector: the row may
// end at the end of the caller's buffer).  Masked loads where the ISA has
// them (their masked lanes never fault).
template <class Arch>
inline xsimd::batch<float, Arch> load_partial(const float* p, int n) {
  using B = xsimd::batch<float, Arch>;
#if defined(__AVX512F__)
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    return B(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p));
  }
#endif
#if defined(__AVX2__)
  if constexpr (std::is_base_of<xsimd::avx2, Arch>::value) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return B(_mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes)));
  }
#endif
  alignas(64) float lanes[B::size] = {};
  for (int i = 0; i < n; ++i) lanes[i] = p[i];
  return B::load_aligned(lanes);
}

// The first n lanes of x (0 < n < W) stored at p, the memory after them left
// untouched: a row's last partial vector in one masked store on AVX-512
// (xsimd 8.1 has none), in halves on AVX2.  AVX2's masked store
// (`vmaskmovps`) is microcoded on AMD's Zen 1-3: S5's 40 rows spent 7 % of
// their samples on it (Zen 3); four, two and one lanes at a time cost a few
// predictable branches instead.
template <class Arch>
inline void store_partial(float* p, xsimd::batch<float, Arch> x, int n) {
#if defined(__AVX512F__)
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), x);
    return;
  }
#endif
#if defined(__AVX2__)
  if constexpr (std::is_base_of<xsimd::avx2, Arch>::value) {
    __m128 part = _mm256_castps256_ps128(x);
    if (n >= 4) {
      _mm_storeu_ps(p, part);
      part = _mm256_extractf128_ps(x, 1);
      p += 4;
      n -= 4;
    }
    if (n >= 2) {
      _mm_storel_pi(reinterpret_cast<__m64*>(p), part);
      part = _mm_movehl_ps(part, part);
      p += 2;
      n -= 2;
    }
    if (n >= 1) _mm_store_ss(p, part);
    return;
  }
#endif
  alignas(64) float lanes[xsimd::batch<float, Arch>::size];
  x.store_aligned(lanes);
  for (int i = 0; i < n; ++i) p[i] = lanes[i];
}

// W fp32 values rounded once to a floating dtype and stored at p (exactly W
// elements): to nearest even, a NaN stays NaN, as mha_types::f32_to_bf16 and
// f32_to_f16 do one value at a time.
template <class Arch, int32_t kDtype>
inline void store_narrow(element_t<kDtype>* p, xsimd::batch<float, Arch> x) {
  using B = xsimd::batch<float, Arch>;
  static_assert(kDtype != MHA_DTYPE_I8, "outputs are floating");
  if constexpr (kDtype == MHA_DTYPE_F32) {
    x.store_unaligned(p);
    return;
  }
#if defined(__AVX512F__)
  if constexpr (kDtype == MHA_DTYPE_F16 && std::is_base_of<xsimd::avx512f, Arch>::value) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return;
  }
#endif
#if defined(__AVX2__)
  if constexpr (kDtype == MHA_DTYPE_F16 && std::is_base_of<xsimd::avx2, Arch>::value) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return;
  }
#endif
#if defined(__aarch64__)
  if constexpr (kDtype == MHA_DTYPE_F16 && std::is_base_of<xsimd::neon64, Arch>::value) {
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x)));  // FPCR's default: to nearest even
    return;
  }
#endif
  if constexpr (kDtype == MHA_DTYPE_BF16) {
    // The upper half of each word, rounded to nearest even on the lower half.
    using U = xsimd::batch<uint32_t, Arch>;
    const U bits = xsimd::bitwise_cast<U>(x);
    const U rounded = (bits + U(0x7FFFu) + ((bits >> 16) & U(1u))) >> 16;
    const U word =
        xsimd::select((bits & U(0x7FFFFFFFu)) > U(0x7F800000u), (bits >> 16) | U(0x40u), rounded);
#if defined(__AVX512F__)
    if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(word));
      return;
    }
#endif
#if defined(__AVX2__)
    if constexpr (std::is_base_of<xsimd::avx2, Arch>::value) {
      // packus interleaves the 128-bit halves: words 0-3 and 4-7 of each, in order.
      const __m256i packed = _mm256_packus_epi32(word, word);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                       _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
      return;
    }
#endif
#if defined(__aarch64__)
    if constexpr (std::is_base_of<xsimd::neon64, Arch>::value) {
      vst1_u16(p, vmovn_u32(word));
      return;
    }
#endif
    alignas(64) uint32_t lanes[B::size];
    word.store_aligned(lanes);
    for (std::size_t i = 0; i < B::size; ++i) p[i] = static_cast<uint16_t>(lanes[i]);
  } else {
    alignas(64) float lanes[B::size];
    x.store_aligned(lanes);
    for (std::size_t i = 0; i < B::size; ++i) p[i] = mha_types::f32_to_f16(lanes[i]);
  }
}

// Calls f(std::integral_constant<int32_t, dtype>{}) for a floating or int8 dtype.
template <class F>
inline void with_dtype(int32_t dtype, F&& f) {
  switch (dtype) {
    case MHA_DTYPE_BF16:
      f(std::integral_constant<int32_t, MHA_DTYPE_BF16>{});
      break;
    case MHA_DTYPE_F16:
      f(std::integral_constant<int32_t, MHA_DTYPE_F16>{});
      break;
    case MHA_DTYPE_I8:
      f(std::integral_constant<int32_t, MHA_DTYPE_I8>{});
      break;
    default:
      f(std::integral_constant<int32_t, MHA_DTYPE_F32>{});
  }
}

// Rows of `cols` elements of a dtype (element stride col_stride, row stride
// row_stride, both in elements) widened into dense fp32 rows of padded_cols,
// each times its scale (int8: scales[r · scale_stride]; others: 1), the
// padding zero-filled.
template <class Arch, int32_t kDtype>
inline void widen_rows(const void* src, int64_t row_stride, int64_t col_stride, int64_t rows,
                       int64_t cols, const float* scales, int64_t scale_stride, float* dst,
                       int64_t padded_cols) {
  using B = xsimd::batch<float, Arch>;
  constexpr int64_t W = static_cast<int64_t>(B::size);
  using T = element_t<kDtype>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = static_cast<const T*>(src) + r * row_stride;
    float* out = dst + r * padded_cols;
    const float scale = scales != nullptr ? scales[r * scale_stride] : 1.0f;
    int64_t c = 0;
    if (col_stride == 1) {
      for (; c + W <= cols; c += W)
        (load_widen<Arch, kDtype>(in + c) * B(scale)).store_unaligned(out + c);
    }
    for (; c < cols; ++c) out[c] = load_one<kDtype>(in, c * col_stride) * scale;
    for (c = cols; c < padded_cols; ++c) out[c] = 0.0f;
  }
}

}  // namespace mha_simd
