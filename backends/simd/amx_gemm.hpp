// The module's matrix products on AMX tiles (mha_bf16_gemm, plugin ABI 19):
// C = A · Wᵀ + bias with W a Linear layer's weight [n][k] holding bf16
// values, the products exact and summed in fp32 (tdpbf16ps; subnormal inputs
// count as 0) -- the products BLIS computes on the same values, in another
// order (runtime/module/bf16_products.cpp decides where they apply).  A is
// either
//   bf16 rows (run): the tiles' operand as it is; or
//   fp32 rows (run_split): each value split into three bf16 parts whose sum
//     is the value exactly (split_rows), each part's products taken: three
//     times the tile work, no rounding of A.
//
// W is packed once (pack): B's pairs along k, in panels of 32 columns --
// panel p, pair row i: the 32 pairs (W[n][2i], W[n][2i + 1]) of columns n =
// 32p .. 32p + 31, zeros past n and k -- so that a panel is the B operand of
// a 2 x 2 block of tiles, its rows 128 bytes apart, and contiguous.
//
// The rows go by groups that fit in half of the L2 (A read from memory once
// a group), each group over every panel (a panel read once per group), each
// panel over the group's blocks of 32 rows: a block's accumulators start from
// the biases and are stored straight into C when whole, else through a
// staging tile.  A group's rows are first put in the tiles' order (tile_row:
// each step of a block of 32 rows 2 KiB in one run), with zeros to whole
// blocks and steps: bf16 rows copied (pack_rows), fp32 rows split into three
// such planes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd/amx.hpp"
#include "simd/convert.hpp"

namespace mha_simd {

#if defined(MHA_HAVE_AMX_TILES)

template <class Arch>
struct AmxGemm {
  using Tiles = AmxTiles<Arch>;
  static constexpr int W = Tiles::W;          // 16
  static constexpr int kBlock = 2 * W;        // rows and columns of a 2 x 2 block of tiles
  static constexpr int kStep = Tiles::kStep;  // k values a product step takes (32)
  static constexpr int kParts = 3;            // bf16 parts of an fp32 value (run_split)
  // A's rows requested into the L1 this many steps ahead: they come from
  // the L2, 16 lines a tile, faster than the L1's own prefetchers bring them
  // (Intel family 6 model 167, one core, builds alternating in one process,
  // 9 rounds: 4096 x 2304 x 768 0.80 of the time with 2 steps ahead, split
  // 0.85; 1 step against 2: 0.97 and 0.95; 4 against 2: 1.01 and 0.98).
  static constexpr int kAheadA = 1;

  static int64_t padded_k(int64_t k) { return (k + kStep - 1) / kStep * kStep; }
  static int64_t panels(int64_t n) { return (n + kBlock - 1) / kBlock; }
  // Pairs of one panel: padded_k / 2 rows of 32.
  static int64_t panel_pairs(int64_t k) { return padded_k(k) / 2 * kBlock; }

  static size_t packed_bytes(int64_t n, int64_t k) {
    return static_cast<size_t>(panels(n) * panel_pairs(k)) * 4;
  }

  // Packs B = Wᵀ from the fp32 values wt[p · ld + j] = W[j][p] (the module's
  // transposed weights), rounded to bf16 (exact for values that are bf16).
  static void pack(int64_t n, int64_t k, const float* wt, int64_t ld, void* packed) {
    auto* out = static_cast<uint32_t*>(packed);
    const int64_t pairs = padded_k(k) / 2;
    for (int64_t p = 0; p < panels(n); ++p) {
      for (int64_t i = 0; i < pairs; ++i) {
        uint32_t* row = out + (p * pairs + i) * kBlock;
        for (int c = 0; c < kBlock; ++c) {
          const int64_t j = p * kBlock + c;
          const uint32_t lo = j < n && 2 * i < k ? to_bf16(wt[2 * i * ld + j]) : 0;
          const uint32_t hi = j < n && 2 * i + 1 < k ? to_bf16(wt[(2 * i + 1) * ld + j]) : 0;
          row[c] = lo | hi << 16;
        }
      }
    }
  }

  // Rows of a group (l2_bytes: the L2, 0 when unknown: 1 MiB assumed), each
  // `planes` rows of padded_k bf16 values.
  static int64_t group_rows(int64_t k, int planes, int64_t l2_bytes) {
    const int64_t half_l2 = (l2_bytes > 0 ? l2_bytes : int64_t{1} << 20) / 2;
    return std::max<int64_t>(kBlock, half_l2 / (padded_k(k) * 2 * planes) / kBlock * kBlock);
  }

  // Scratch of run (bf16 rows): a group's rows packed (pack_rows); of
  // run_split (fp32 rows): a group's three planes.  Both: a staging tile (32
  // x 32 floats) and the biases of a panel (32 floats).
  static size_t scratch_bytes(int64_t k, int64_t l2_bytes) {
    return static_cast<size_t>(group_rows(k, 1, l2_bytes) * padded_k(k)) * 2 + kBlock * kBlock * 4 +
           kBlock * 4;
  }
  static size_t split_scratch_bytes(int64_t k, int64_t l2_bytes) {
    return static_cast<size_t>(kParts * group_rows(k, kParts, l2_bytes) * padded_k(k)) * 2 +
           kBlock * kBlock * 4 + kBlock * 4;
  }

  // Rows [0, m) of C (rows ldc floats apart) = A (bf16, rows lda values
  // apart) · B + bias (nullptr: none).
  MHA_AMX_TARGET static void run(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                                 const void* packed, const float* bias, float* c, int64_t ldc,
                                 void* scratch, int64_t l2_bytes) {
    run_into(m, n, k, a, lda, packed, bias, c, nullptr, ldc, scratch, l2_bytes);
  }
  // The same with C in bf16: each sum rounded once, to nearest even (the
  // module's activations in bf16).  C's columns lie in slabs of c_slab
  // (rows ldc values apart within one), slab_stride values apart: the
  // module's projections written head-major, [heads][rows][D].
  MHA_AMX_TARGET static void run_to_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a,
                                         int64_t lda, const void* packed, const float* bias,
                                         uint16_t* c, int64_t ldc, int64_t c_slab,
                                         int64_t slab_stride, void* scratch, int64_t l2_bytes) {
    run_into(m, n, k, a, lda, packed, bias, nullptr, c, ldc, scratch, l2_bytes,
             Slabs{c_slab, slab_stride});
  }

 private:
  // C's columns in slabs (run_to_bf16); one slab by default.
  struct Slabs {
    int64_t cols = std::numeric_limits<int64_t>::max();
    int64_t stride = 0;
  };

  // run and run_to_bf16: C is c (fp32) or c16 (bf16, in slabs).
  MHA_AMX_TARGET static void run_into(int64_t m, int64_t n, int64_t k, const uint16_t* a,
                                      int64_t lda, const void* packed, const float* bias, float* c,
                                      uint16_t* c16, int64_t ldc, void* scratch, int64_t l2_bytes,
                                      Slabs slabs = {}) {
    const int64_t kp = padded_k(k);
    const int64_t group = group_rows(k, 1, l2_bytes);
    auto* a_pack = static_cast<uint16_t*>(scratch);
    Out out{n,    k,   static_cast<const uint32_t*>(packed),          bias,
            c,    ldc, reinterpret_cast<float*>(a_pack + group * kp), c16,
            slabs};
    Tiles::configure();
    const int64_t steps = kp / kStep;
    for (int64_t g0 = 0; g0 < m; g0 += group) {
      const int64_t g1 = std::min(m, g0 + group);
      pack_rows(a + g0 * lda, lda, g1 - g0, k, kp, a_pack);
      Tiles::memory_barrier();  // the packed rows, before the tile loads
      for_each_block(out, g0, g1,
                     [&](int64_t r0, int /*rows*/, const uint32_t* panel, float* to,
                         int64_t to_stride, const float* biases) {
                       const uint16_t* a0 = a_pack + (r0 - g0) * kp;
                       Tiles::memory_barrier();  // the biases, before the tile loads
                       Tiles::template block_2x2<1, kAheadA>(a0, a0 + W * kStep, kStep * 2, panel,
                                                             W * kBlock, kBlock * 4, steps, to,
                                                             to_stride, biases, 0, 0, kTileStep);
                     });
    }
    Tiles::release();
  }

 public:
  // The same with A as fp32 rows (lda floats apart), split into three bf16
  // parts (split_rows) a group at a time.
  MHA_AMX_TARGET static void run_split(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                                       const void* packed, const float* bias, float* c, int64_t ldc,
                                       void* scratch, int64_t l2_bytes) {
    const int64_t kp = padded_k(k);
    const int64_t group = group_rows(k, kParts, l2_bytes);
    const int64_t plane = group * kp;  // values between the parts of a row
    auto* planes = static_cast<uint16_t*>(scratch);
    Out out{n,
            k,
            static_cast<const uint32_t*>(packed),
            bias,
            c,
            ldc,
            reinterpret_cast<float*>(planes + kParts * plane)};
    Tiles::configure();
    for (int64_t g0 = 0; g0 < m; g0 += group) {
      const int64_t g1 = std::min(m, g0 + group);
      const int64_t rows = (g1 - g0 + kBlock - 1) / kBlock * kBlock;
      for (int64_t r = 0; r < rows; ++r) {
        split_row(g0 + r < g1 ? a + (g0 + r) * lda : nullptr, k, kp, planes + tile_row(r, kp),
                  plane);
      }
      Tiles::memory_barrier();  // the planes, before the tile loads
      for_each_block(out, g0, g1,
                     [&](int64_t r0, int /*rows*/, const uint32_t* panel, float* to,
                         int64_t to_stride, const float* biases) {
                       const uint16_t* a0 = planes + (r0 - g0) * kp;
                       Tiles::memory_barrier();  // the biases, before the tile loads
                       Tiles::template block_2x2<kParts, kAheadA>(
                           a0, a0 + W * kStep, kStep * 2, panel, W * kBlock, kBlock * 4, kp / kStep,
                           to, to_stride, biases, 0, plane, kTileStep);
                     });
    }
    Tiles::release();
  }

 private:
  // Where a product's blocks go: C, its biases, a staging tile and the
  // panel's biases (32 floats after it).
  struct Out {
    int64_t n, k;
    const uint32_t* panels;
    const float* bias;
    float* c;
    int64_t ldc;
    float* stage;             // 32 x 32 floats, then 32 biases
    uint16_t* c16 = nullptr;  // C in bf16 instead (run_to_bf16), in slabs
    Slabs slabs{};
  };

  // For each panel, each block of 32 rows from g0 (before g1): block(r0,
  // rows, panel, to, to_stride, biases) computes it into `to` -- C itself
  // when whole, else the staging tile, copied into C after (a bf16 C:
  // always staged, each value rounded as it is copied).
  template <class Block>
  static void for_each_block(const Out& out, int64_t g0, int64_t g1, Block&& block) {
    const int64_t pairs = padded_k(out.k) / 2;
    float* biases = out.stage + kBlock * kBlock;
    for (int64_t p = 0; p < panels(out.n); ++p) {
      const int64_t n0 = p * kBlock;
      const int cols = static_cast<int>(std::min<int64_t>(kBlock, out.n - n0));
      for (int x = 0; x < kBlock; ++x) {
        biases[x] = out.bias != nullptr && x < cols ? out.bias[n0 + x] : 0.0f;
      }
      const uint32_t* panel = out.panels + p * pairs * kBlock;
      for (int64_t r0 = g0; r0 < g1; r0 += kBlock) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlock, g1 - r0));
        const bool whole = rows == kBlock && cols == kBlock && out.c16 == nullptr;
        float* to = whole ? out.c + r0 * out.ldc + n0 : out.stage;
        block(r0, rows, panel, to, whole ? out.ldc : int64_t{kBlock}, biases);
        if (out.c16 != nullptr) {
          Tiles::memory_barrier();  // the tile stores, before the rounding reads them
          write_rounded(out.stage, kBlock, rows, cols, r0, n0, out.c16, out.ldc, out.slabs.cols,
                        out.slabs.stride);
        } else if (!whole) {
          Tiles::memory_barrier();  // the tile stores, before the copy reads them
          for (int r = 0; r < rows; ++r) {
            std::memcpy(out.c + (r0 + r) * out.ldc + n0, out.stage + r * kBlock,
                        static_cast<size_t>(cols) * 4);
          }
        }
      }
    }
  }

  // x (k floats; nullptr: a row of zeros) as three rows of bf16 parts,
  // `plane` values apart, padded with zeros to kp: hi + lo + lo2 = x
  // exactly.  Each part is its remainder truncated to bf16's 8 significant
  // bits (so never rounded past the largest float), and the remainders'
  // subtractions are exact: x's 24 bits are 8 + 8 + 8.  A non-finite x is
  // its own hi (a NaN kept a NaN), its other parts 0.
  static void split_row(const float* x, int64_t k, int64_t kp, uint16_t* out, int64_t plane) {
    // Value i of the row at tile_value(i) (16 values never straddle a step).
    int64_t i = 0;
    if (x != nullptr) {
      for (; i + W <= k; i += W) split_vector(_mm512_loadu_ps(x + i), out + tile_value(i), plane);
      if (i < k) {
        const __mmask16 valid = static_cast<__mmask16>((1u << (k - i)) - 1u);
        split_vector(_mm512_maskz_loadu_ps(valid, x + i), out + tile_value(i), plane);
        i += W;
      }
    }
    for (; i < kp; i += W) {
      for (int part = 0; part < kParts; ++part) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + part * plane + tile_value(i)),
                            _mm256_setzero_si256());
      }
    }
  }
  static void split_vector(__m512 x, uint16_t* out, int64_t plane) {
    const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __mmask16 finite =
        _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(3.4028235e38f), _CMP_LE_OQ);
    const __m512 hi = _mm512_mask_mov_ps(
        x, finite, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), top)));
    const __m512 r1 = _mm512_maskz_sub_ps(finite, x, hi);
    const __m512 lo = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), top));
    const __m512 lo2 = _mm512_sub_ps(r1, lo);  // 8 bits at most: exact in bf16
    store_top_halves(hi, out);
    store_top_halves(lo, out + plane);
    store_top_halves(lo2, out + 2 * plane);
  }
  // The upper 16 bits of each float (its bf16 truncation; a NaN's payload may
  // lie in the lower ones, so a NaN is made the quiet NaN first).
  static void store_top_halves(__m512 v, uint16_t* out) {
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i bits =
        _mm512_mask_mov_epi32(_mm512_castps_si512(v), nan, _mm512_set1_epi32(0x7FC00000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }

  // The tiles' order of a group's rows (packed A, split planes): block b of
  // 32 rows, step x at (b · steps + x) · kTileStep values -- the step's 32
  // rows of 32 values back to back (tile 0's 16 rows, then tile 1's), so a
  // block streams from the L2 as one run instead of 32 rows lda apart
  // (4096 x 2304 x 768: 0.91 of the time, 4096 x 768 x 768 0.93, the
  // packing included; Intel family 6 model 167, docs/kernel-design.md).
  static constexpr int64_t kTileStep = kBlock * kStep;
  // Where row r of the group starts, and where value i of a row lies from it.
  static int64_t tile_row(int64_t r, int64_t kp) {
    return r / kBlock * kBlock * kp + r % kBlock * kStep;
  }
  static int64_t tile_value(int64_t i) { return i / kStep * kTileStep + i % kStep; }

  // `rows` rows of A (lda apart, k values) in the tiles' order, zeros past
  // the rows (to a whole block) and past k.
  static void pack_rows(const uint16_t* a, int64_t lda, int64_t rows, int64_t k, int64_t kp,
                        uint16_t* out) {
    const int64_t padded_rows = (rows + kBlock - 1) / kBlock * kBlock;
    for (int64_t r = 0; r < padded_rows; ++r) {
      uint16_t* to = out + tile_row(r, kp);
      const uint16_t* row = a + r * lda;
      for (int64_t x = 0; x < kp / kStep; ++x) {
        const int64_t have = r < rows ? std::min<int64_t>(kStep, k - x * kStep) : 0;
        const auto valid = static_cast<__mmask32>(have >= kStep ? ~0u : (1u << have) - 1u);
        _mm512_storeu_si512(to + x * kTileStep, _mm512_maskz_loadu_epi16(valid, row + x * kStep));
      }
    }
  }

 public:
  // A staged block (rows stage_stride floats apart) into a bf16 C, each value
  // rounded once, C's columns in slabs of slab_cols, slab_stride apart
  // (run_to_bf16's layout): slab by slab, a block may straddle two.
  static void write_rounded(const float* stage, int64_t stage_stride, int rows, int cols,
                            int64_t r0, int64_t n0, uint16_t* c16, int64_t ldc, int64_t slab_cols,
                            int64_t slab_stride) {
    for (int x0 = 0; x0 < cols;) {
      const int64_t slab = (n0 + x0) / slab_cols, at = (n0 + x0) % slab_cols;
      const int run = static_cast<int>(std::min<int64_t>(cols - x0, slab_cols - at));
      uint16_t* slab_at = c16 + slab * slab_stride + at;
      for (int r = 0; r < rows; ++r) {
        narrow_row(stage + r * stage_stride + x0, run, slab_at + (r0 + r) * ldc);
      }
      x0 += run;
    }
  }

 private:
  // cols fp32 values rounded once to bf16 (convert.hpp's rule).
  static void narrow_row(const float* x, int cols, uint16_t* to) {
    int c = 0;
    for (; c + W <= cols; c += W) {
      store_narrow<Arch, MHA_DTYPE_BF16>(to + c, xsimd::batch<float, Arch>::load_unaligned(x + c));
    }
    for (; c < cols; ++c) to[c] = mha_types::f32_to_bf16(x[c]);
  }

  // Round to nearest, ties to even (the values the module keeps are finite).
  static uint32_t to_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  }
};

#endif  // MHA_HAVE_AMX_TILES

}  // namespace mha_simd
