// The micro-kernel of the module's matrix products (mha_gemm_ukernel, plugin
// ABI 14).  The runtime runs those products in BLIS's framework -- its
// blocking, its packing, its threads -- and calls this kernel on BLIS's packed
// panels in place of BLIS's own, when the BLIS kernel set in use packs them
// for the same C tile (`PackedGemmTile`).
//
// Why: on Zen 5 (AMD family 26 model 2) BLIS 0.9's "skx" kernels ran the
// module's products at 79-81 % of the FMA peak (4096 x 2304 x 769, one
// thread), although a micro-kernel of the same tile runs at the peak on
// panels in the L2.  What the framework loses is the next B panel: it comes
// from the L3 when the micro-kernel's column of calls moves on.  This kernel
// requests it during the calls before (BLIS hands it `next_b`), and the C
// tile at its start: 86-88 % in the same runs (docs/kernel-design.md).
//
// One template for both orientations: the kernel broadcasts one packed
// panel (R values a step) and loads the other as NV vectors a step, into R x
// NV accumulators; `row_major` says which of A and B is broadcast.  The sum
// over k runs in order p = 0, 1, ..., one FMA a term, as BLIS's kernels do.
#pragma once

#include <xsimd/xsimd.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mha_simd {

// x·y + z rounded once.  xsimd 8.1's fma for AVX-512 is its generic x * y + z,
// which GCC fuses only when it contracts (at -O2 and above): the ASan build
// (-O1) gave other bits.  The products' bits should not depend on that.
template <class Arch>
inline xsimd::batch<float, Arch> fused_fma(xsimd::batch<float, Arch> x, xsimd::batch<float, Arch> y,
                                           xsimd::batch<float, Arch> z) {
#if defined(__AVX512F__)
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) {
    return xsimd::batch<float, Arch>(_mm512_fmadd_ps(x, y, z));
  }
#endif
  return xsimd::fma(x, y, z);
}

// The C tile and orientation of the BLIS kernel set this ISA meets, or none
// (kOffered false: the runtime keeps BLIS's own kernels).
template <class Arch, class Enable = void>
struct PackedGemmTile {
  static constexpr bool kOffered = false;
  static constexpr int kMr = 1, kNr = 1;
  static constexpr bool kRowMajor = true;
};

// AVX-512: BLIS's "skx" set (which the runtime gives BLIS on every AVX-512
// CPU): 32 x 12, vectors along C's columns (two vectors of A, twelve
// broadcasts of B: 24 accumulators).  AVX2 offers none: BLIS's "haswell" and
// "zen" kernels (6 x 16 by rows) ran at 92-95 % of the avx2 peak on Zen 5,
// this template with their tile 5 % slower.
template <class Arch>
struct PackedGemmTile<Arch, std::enable_if_t<std::is_base_of<xsimd::avx512f, Arch>::value>> {
  static constexpr bool kOffered = true;
  static constexpr int kMr = 32, kNr = 12;
  static constexpr bool kRowMajor = false;
};

// C = beta·C + alpha·A·B on an m x n corner of the tile; see mha_gemm_ukernel
// in plugin_abi.h for the layouts.
template <class Arch>
void packed_gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b,
                 float beta, float* c, int64_t rs_c, int64_t cs_c, const float* /*next_a*/,
                 const float* next_b) {
  using T = PackedGemmTile<Arch>;
  using V = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(V::size);
  // Broadcast panel x (R values a step), vector panel y (NV vectors a step).
  constexpr int R = T::kRowMajor ? T::kMr : T::kNr;
  constexpr int Y = T::kRowMajor ? T::kNr : T::kMr;
  constexpr int NV = Y / W;
  static_assert(Y % W == 0, "the vector side of the tile is whole vectors");
  const float* x = T::kRowMajor ? a : b;
  const float* y = T::kRowMajor ? b : a;
  // C's lines (one per broadcast value) and the elements along each.
  const int64_t lines = T::kRowMajor ? m : n, elements = T::kRowMajor ? n : m;
  const int64_t line_stride = T::kRowMajor ? rs_c : cs_c;
  const int64_t element_stride = T::kRowMajor ? cs_c : rs_c;
  const bool whole = lines == R && elements == Y && element_stride == 1;

  // The C tile now, so that its update at the end does not wait on memory.
  if (whole) {
    for (int r = 0; r < R; ++r) {
      for (int e = 0; e < Y; e += 16) __builtin_prefetch(c + r * line_stride + e, 0, 3);
    }
  }
  // The next B panel, a few lines every 4 steps over the whole loop: BLIS
  // moves to it after a column of calls, from the L3.  (Requesting it into the
  // L2 instead, or a line every step, measured alike or slower.)
  const char* next = reinterpret_cast<const char*>(next_b);
  constexpr int kNextLines = (T::kNr * 4 * 4 + 63) / 64;  // 4 steps of the B panel
  // The vector panel kAhead steps on: it streams from the L2 (BLIS keeps its
  // A block there), two lines a step on AVX-512, faster than the L1's own
  // prefetchers bring it in (Intel family 6 model 167, in-process A/B, 7
  // rounds: module S1 0.972 of the time with 8 steps, 0.983 with 16).
  constexpr int64_t kAhead = 8;

  V acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = V(0.0f);
  }
  for (int64_t p = 0; p < k; ++p) {
    V yv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) yv[v] = V::load_unaligned(y + p * Y + v * W);
    if (p + kAhead < k) {
      const char* ahead = reinterpret_cast<const char*>(y + (p + kAhead) * Y);
#pragma GCC unroll 4
      for (int l = 0; l < Y * 4; l += 64) __builtin_prefetch(ahead + l, 0, 3);
    }
    if (next != nullptr && (p & 3) == 0) {
      for (int l = 0; l < kNextLines; ++l) __builtin_prefetch(next + p * T::kNr * 4 + l * 64, 0, 3);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V xr(x[p * R + r]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = fused_fma(xr, yv[v], acc[r][v]);
    }
  }

  const V va(alpha), vb(beta);
  if (whole) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        float* out = c + r * line_stride + v * W;
        const V sum = alpha == 1.0f ? acc[r][v] : acc[r][v] * va;
        (beta == 0.0f ? sum : fused_fma(vb, V::load_unaligned(out), sum)).store_unaligned(out);
      }
    }
    return;
  }
  // A corner, or C with other strides: through a tile in memory.
  alignas(64) float tile[R][Y];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v].store_aligned(&tile[r][v * W]);
  }
  for (int64_t r = 0; r < lines; ++r) {
    for (int64_t e = 0; e < elements; ++e) {
      float* out = c + r * line_stride + e * element_stride;
      const float sum = alpha * tile[r][e];
      *out = beta == 0.0f ? sum : std::fma(beta, *out, sum);
    }
  }
}

}  // namespace mha_simd
