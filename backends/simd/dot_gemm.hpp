// The module's bf16 matrix products with AVX512_BF16 dot products
// (mha_bf16_gemm's run and run_to_bf16 where the runtime chose the bf16
// dot-product path, bf16_dot 1: Zen 4 runs vdpbf16ps at twice its FMA rate,
// where BLIS would take the same products in fp32; on Intel, which runs it
// at half the rate, the runtime chooses the AMX tiles or widening).
//
// C = A · Wᵀ + bias on AmxGemm's packed weights (pairs along k, 32 columns a
// panel): each vdpbf16ps lane multiplies a pair of A's row by its column's
// pair and adds both products to its fp32 accumulator, as tdpbf16ps does
// (the products exact, subnormal inputs counted as 0) -- the products BLIS
// takes on the same values, summed in another order.  A's pairs are read in
// place and broadcast (an odd k's last value paired with 0: nothing past a
// row is read).
//
// Blocking, from the caches: rows in AmxGemm's groups (half of the L2); for
// each two panels (64 columns), k in blocks whose two panel slices take half
// of the L1d; every block of 6 rows of the group over that slice: 6 x 4
// vectors of accumulators, 4 vector loads and 6 broadcasts a pair of k (the
// prefill's 4 x 6 score block, turned).  Between k blocks the accumulators
// wait in the scratch (the group's rows x 64 floats); the last k block
// writes C through a staging block (fp32, or each sum rounded once to bf16,
// C's columns in slabs as run_to_bf16 takes them).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "simd/amx_gemm.hpp"
#include "simd/bf16_dot.hpp"
#include "simd/convert.hpp"

namespace mha_simd {

#if defined(MHA_HAVE_AMX_TILES)

template <class Arch>
struct DotGemm {
  using Packing = AmxGemm<Arch>;  // the packed weights and the row groups
  using Dot = Bf16Dot<Arch>;
  static constexpr int W = 16;
  static constexpr int kPanel = 32;            // columns of a packed panel
  static constexpr int kCols = 2 * kPanel;     // columns of a block: two panels
  static constexpr int kRows = 6;              // rows of a block
  static constexpr int64_t kPairRow = kPanel;  // uint32 pairs between a panel's pair rows

  // Pairs of k in a block whose two panel slices (256 bytes a pair) take
  // half of the L1d (64 with the L1d unknown).
  static int64_t k_block_pairs(int64_t l1d_bytes) {
    return l1d_bytes > 0 ? std::max<int64_t>(16, l1d_bytes / 2 / (2 * kPanel * 4)) : 64;
  }

  // The accumulators of a group's rows between k blocks, a staging block
  // and the biases of a block.
  static size_t scratch_bytes(int64_t k, int64_t l2_bytes) {
    return static_cast<size_t>(Packing::group_rows(k, 1, l2_bytes) + kRows + 1) * kCols * 4;
  }

  // Rows [0, m) of C = A (bf16 rows, lda apart) · W + bias (nullptr: none):
  // fp32 C (c, rows ldc apart), or bf16 (c16: each sum rounded once, its
  // columns in slabs of slab_cols, slab_stride apart).
  static void run(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                  const void* packed, const float* bias, float* c, uint16_t* c16, int64_t ldc,
                  int64_t slab_cols, int64_t slab_stride, void* scratch, int64_t l1d_bytes,
                  int64_t l2_bytes) {
    const int64_t group = Packing::group_rows(k, 1, l2_bytes);
    const int64_t pairs = (k + 1) / 2, row_pairs = Packing::padded_k(k) / 2;
    const int64_t k_block = k_block_pairs(l1d_bytes);
    auto* waiting = static_cast<float*>(scratch);  // group x kCols
    float* stage = waiting + group * kCols;        // kRows x kCols
    float* biases = stage + kRows * kCols;         // kCols
    const auto* panels = static_cast<const uint32_t*>(packed);
    const int64_t panel_count = Packing::panels(n);
    for (int64_t g0 = 0; g0 < m; g0 += group) {
      const int64_t g1 = std::min(m, g0 + group);
      for (int64_t p = 0; p < panel_count; p += 2) {
        const int64_t n0 = p * kPanel;
        const int cols = static_cast<int>(std::min<int64_t>(kCols, n - n0));
        const bool two = p + 1 < panel_count;
        for (int x = 0; x < kCols; ++x) {
          biases[x] = bias != nullptr && x < cols ? bias[n0 + x] : 0.0f;
        }
        const uint32_t* w0 = panels + p * row_pairs * kPairRow;
        const uint32_t* w1 = two ? w0 + row_pairs * kPairRow : w0;
        for (int64_t i0 = 0; i0 < pairs; i0 += k_block) {
          const int64_t i1 = std::min(pairs, i0 + k_block);
          const bool last = i1 == pairs;
          for (int64_t r0 = g0; r0 < g1; r0 += kRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kRows, g1 - r0));
            float* held = waiting + (r0 - g0) * kCols;
            const Block b{a + r0 * lda,
                          lda,
                          k,
                          i0,
                          i1,
                          w0 + i0 * kPairRow,
                          w1 + i0 * kPairRow,
                          i0 == 0 ? biases : held,
                          i0 == 0 ? 0 : kCols,
                          last ? stage : held};
            run_block(b, rows, two);
            if (last) write(stage, rows, cols, r0, n0, c, c16, ldc, slab_cols, slab_stride);
          }
        }
      }
    }
  }

 private:
  struct Block {
    const uint16_t* a;  // the block's first row
    int64_t lda, k, i0, i1;
    const uint32_t *w0, *w1;  // the two panels' pair rows from i0
    const float* init;        // the accumulators' start, rows init_stride apart
    int64_t init_stride;
    float* out;  // kRows x kCols
  };

  static void run_block(const Block& b, int rows, bool two) {
    switch (rows) {
      case 1:
        return two ? block<1, 4>(b) : block<1, 2>(b);
      case 2:
        return two ? block<2, 4>(b) : block<2, 2>(b);
      case 3:
        return two ? block<3, 4>(b) : block<3, 2>(b);
      case 4:
        return two ? block<4, 4>(b) : block<4, 2>(b);
      case 5:
        return two ? block<5, 4>(b) : block<5, 2>(b);
      default:
        return two ? block<6, 4>(b) : block<6, 2>(b);
    }
  }

  // MR rows x NV vectors of C over pairs [i0, i1) of k.
  template <int MR, int NV>
  static void block(const Block& b) {
    __m512 acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(b.init + r * b.init_stride + v * W);
    }
    // Whole pairs; an odd k's last value alone (paired with 0).
    const int64_t whole_end = std::min(b.i1, b.k / 2);
    const uint32_t* w0 = b.w0;
    const uint32_t* w1 = b.w1;
    const auto step = [&](const auto& pair_of_row) {
      __m512bh w[NV];
      w[0] = Dot::load_pairs(w0);
      w[1] = Dot::load_pairs(w0 + W);
      if constexpr (NV == 4) {
        w[2] = Dot::load_pairs(w1);
        w[3] = Dot::load_pairs(w1 + W);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512bh x = pair_of_row(r);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, w[v]);
      }
      w0 += kPairRow;
      w1 += kPairRow;
    };
    for (int64_t i = b.i0; i < whole_end; ++i) {
      step([&](int r) { return Dot::broadcast_pair(b.a + r * b.lda + 2 * i); });
    }
    if (whole_end < b.i1) {  // the odd k's last value
      step([&](int r) { return Dot::as_bf16(_mm512_set1_epi32(b.a[r * b.lda + b.k - 1])); });
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(b.out + r * kCols + v * W, acc[r][v]);
    }
  }

  // The staged block's rows into C: fp32, or rounded once to bf16.
  static void write(const float* stage, int rows, int cols, int64_t r0, int64_t n0, float* c,
                    uint16_t* c16, int64_t ldc, int64_t slab_cols, int64_t slab_stride) {
    if (c16 != nullptr) {
      Packing::write_rounded(stage, kCols, rows, cols, r0, n0, c16, ldc, slab_cols, slab_stride);
      return;
    }
    for (int r = 0; r < rows; ++r) {
      std::memcpy(c + (r0 + r) * ldc + n0, stage + r * kCols, static_cast<size_t>(cols) * 4);
    }
  }
};

#endif  // MHA_HAVE_AMX_TILES

}  // namespace mha_simd
