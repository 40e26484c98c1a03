// The module's bf16 matrix products on AMX tiles (mha_bf16_gemm, plugin ABI
// 19): C = A · Wᵀ + bias, A bf16 rows [m][k], W a Linear layer's bf16 weight
// [n][k], exact products summed in fp32 (tdpbf16ps; subnormal inputs count
// as 0).  The runtime calls it where the inputs are bf16 and the weights
// hold bf16 values (runtime/module/projections.cpp), so that the products
// are the ones BLIS computes on the same values widened to fp32.
//
// W is packed once (pack): B's pairs along k, in panels of 32 columns --
// panel p, pair row i: the 32 pairs (W[n][2i], W[n][2i + 1]) of columns n =
// 32p .. 32p + 31, zeros past n and k -- so that a panel is the B operand of
// a 2 x 2 block of tiles, its rows 128 bytes apart, and contiguous.
//
// A's rows are read in place (whole blocks of 32 rows when k is a multiple
// of 32), else staged with zeros to whole steps.  The blocks go by groups of
// rows that fit in half of the L2 (A read from memory once a group), each
// group over every panel (a panel read once per group), each panel over the
// group's blocks of 32 rows: a block's accumulators start from the biases
// and are stored straight into C when whole, else through a staging tile.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "simd/amx.hpp"

namespace mha_simd {

#if defined(MHA_HAVE_AMX_TILES)

template <class Arch>
struct AmxGemm {
  using Tiles = AmxTiles<Arch>;
  static constexpr int W = Tiles::W;          // 16
  static constexpr int kBlock = 2 * W;        // rows and columns of a 2 x 2 block of tiles
  static constexpr int kStep = Tiles::kStep;  // k values a product step takes (32)

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

  // Scratch: a block of A's rows staged (32 x padded_k bf16), a staging
  // tile (32 x 32 floats) and the biases of a panel (32 floats).
  static size_t scratch_bytes(int64_t k) {
    return static_cast<size_t>(kBlock * padded_k(k)) * 2 + kBlock * kBlock * 4 + kBlock * 4;
  }

  // Rows [0, m) of C (rows ldc floats apart) = A (rows lda values apart) ·
  // B + bias (nullptr: none).  l2_bytes sizes the groups of rows (0:
  // unknown, 1 MiB assumed).
  MHA_AMX_TARGET static void run(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                                 const void* packed, const float* bias, float* c, int64_t ldc,
                                 void* scratch, int64_t l2_bytes) {
    const int64_t kp = padded_k(k), pairs = kp / 2;
    auto* a_stage = static_cast<uint16_t*>(scratch);
    float* c_stage = reinterpret_cast<float*>(a_stage + kBlock * kp);
    float* bias_stage = c_stage + kBlock * kBlock;
    const auto* b = static_cast<const uint32_t*>(packed);
    const int64_t half_l2 = (l2_bytes > 0 ? l2_bytes : int64_t{1} << 20) / 2;
    const int64_t group = std::max<int64_t>(kBlock, half_l2 / (kp * 2) / kBlock * kBlock);
    Tiles::configure();
    for (int64_t g0 = 0; g0 < m; g0 += group) {
      const int64_t g1 = std::min(m, g0 + group);
      for (int64_t p = 0; p < panels(n); ++p) {
        const int64_t n0 = p * kBlock;
        const int cols = static_cast<int>(std::min<int64_t>(kBlock, n - n0));
        for (int x = 0; x < kBlock; ++x)
          bias_stage[x] = bias != nullptr && x < cols ? bias[n0 + x] : 0.0f;
        const uint32_t* panel = b + p * pairs * kBlock;
        for (int64_t r0 = g0; r0 < g1; r0 += kBlock) {
          const int rows = static_cast<int>(std::min<int64_t>(kBlock, g1 - r0));
          const uint16_t* a0 = a + r0 * lda;
          int64_t a_stride = lda;
          if (rows < kBlock || kp != k) {  // staged: zeros past the rows and k
            for (int r = 0; r < kBlock; ++r) {
              uint16_t* to = a_stage + r * kp;
              const int64_t have = r < rows ? k : 0;
              if (have > 0) std::memcpy(to, a0 + r * lda, static_cast<size_t>(have) * 2);
              std::memset(to + have, 0, static_cast<size_t>(kp - have) * 2);
            }
            a0 = a_stage;
            a_stride = kp;
          }
          const bool whole = rows == kBlock && cols == kBlock;
          float* to = whole ? c + r0 * ldc + n0 : c_stage;
          const int64_t to_stride = whole ? ldc : kBlock;
          Tiles::memory_barrier();  // the staged rows and biases, before the tile loads
          Tiles::block_2x2(a0, a0 + W * a_stride, a_stride * 2, panel, W * kBlock, kBlock * 4,
                           kp / kStep, to, to_stride, bias_stage, 0);
          if (!whole) {
            Tiles::memory_barrier();  // the tile stores, before the copy reads them
            for (int r = 0; r < rows; ++r) {
              std::memcpy(c + (r0 + r) * ldc + n0, c_stage + r * kBlock,
                          static_cast<size_t>(cols) * 4);
            }
          }
        }
      }
    }
    Tiles::release();
  }

 private:
  // Round to nearest, ties to even (the values the module keeps are finite).
  static uint32_t to_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  }
};

#endif  // MHA_HAVE_AMX_TILES

}  // namespace mha_simd
