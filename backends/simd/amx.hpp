// The bf16 path's two products on AMX tiles (tdpbf16ps), where the runtime
// asks for them (mha_simd_tiles::bf16_dot 2: CPU, OS and the process's
// permission checked by runtime/cpu_features.cpp).  Everything around the
// products -- Q packed as pairs along the head dimension, V as pairs of
// keys, the softmax in fp32 with the query tile's lanes along the queries,
// P rounded to bf16 once -- is the bf16 dot-product path's (bf16_dot.hpp).
//
// A tile is 16 rows of 64 bytes; tdpbf16ps C += A · B takes A as 16 rows of
// 16 bf16 pairs and B as 16 rows of pairs (row i: pair i of each of 16
// columns), exact products summed in fp32.  Both products are laid so that
// the operands the prefill layout already has are B, and C lands where the
// layout wants it:
//   scores, transposed: S[key][query] = K[key][·] · Qᵀ -- A is 16 bf16 K rows
//     (in place for whole 32-key blocks when D is a multiple of 32, the rest
//     copied per key tile, zero-padded to whole tiles), B is 16 pairs of Q
//     (qp, as packed for the dot products), C is 16 keys x 16 query lanes,
//     stored as the layout's score rows;
//   P·V: O[query][·] = P[query][keys] · V -- A is 16 query rows of pairs of
//     probabilities (the probability pairs, transposed 16 x 16 per step), B
//     is V as pairs of keys, C is 16 accumulator rows x 16 columns, loaded
//     from and stored to the accumulators (after their rescale).
// That is the keys' orientation, which every tile may take.  A fused tile
// (maskless, no dropout, no score variant: most of a prefill) takes the
// rows instead, where the item caches V's pairs: S[query][key] with Q's
// rows as A and K's pairs transposed once per item as B, so that the
// epilogue rounds each query's probabilities to bf16 in key order -- P·V's
// A operand as it is (see "rows" below).
// Every tile is a square of 16 x 16; the kernels work in 2 x 2 blocks of
// them (four C, two A, two B: the eight tiles).  Operands are padded with
// zeros to whole tiles, never read past their buffers: a product's padding
// must be finite (0 · NaN would be NaN), so the last partial step's V rows
// are staged with zeros.
//
// Tile numbers are immediates of the instructions (GCC's intrinsics are
// macros that paste them into assembly), so each kernel names its tiles.
#pragma once

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd/bf16_dot.hpp"
#include "simd/exp2.hpp"
#include "simd/transpose.hpp"

#if defined(__AVX512BF16__) && defined(__x86_64__)
#include <immintrin.h>
#define MHA_HAVE_AMX_TILES 1
#define MHA_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#endif

namespace mha_simd {

template <class Arch>
struct AmxTiles;

#if defined(MHA_HAVE_AMX_TILES)

template <class Arch>
struct AmxTiles {
  using B = xsimd::batch<float, Arch>;
  using Dot = Bf16Dot<Arch>;
  static constexpr int W = 16;         // lanes of a vector; rows and pair columns of a tile
  static constexpr int kStep = 2 * W;  // bf16 values (keys, head indices) a product step takes
  static constexpr int64_t kRowBytes = 64;

  // The head dimension as the score tiles take it: whole steps of 32.
  static int64_t padded_d(int64_t d) { return (d + kStep - 1) / kStep * kStep; }
  // Keys of a key tile as the tiles take them: whole pairs of 16-key blocks.
  static int padded_keys(int keys) { return (keys + kStep - 1) / kStep * kStep; }

  // Every tile 16 rows of 64 bytes (palette 1).  Each thread configures its
  // own tiles before its first tile instruction.
  MHA_AMX_TARGET static void configure() {
    struct alignas(64) Config {
      uint8_t palette;
      uint8_t start_row;
      uint8_t reserved[14];
      uint16_t columns[16];  // bytes per row
      uint8_t rows[16];
      uint8_t unused[16];
    } config{};
    config.palette = 1;
    for (int i = 0; i < 8; ++i) {
      config.columns[i] = kRowBytes;
      config.rows[i] = W;
    }
    // The whole configuration as the operand: GCC's _tile_loadconfig names
    // only its first 8 bytes, so the stores of the rest could be dropped.
    __asm__ volatile("ldtilecfg %0" ::"m"(config));
  }

  // Gives the tiles back (their state then costs no context switch).
  MHA_AMX_TARGET static void release() { _tile_release(); }

  // The tile loads read memory the compiler does not see them read (GCC's
  // tileloadd is an asm without a memory operand): stores before them must
  // not be moved past.
  static void memory_barrier() { __asm__ volatile("" ::: "memory"); }

  // ------------------------------------------------------------ packing

  // Where the score tiles read the keys' bf16 rows (k: row j at k + j ·
  // k_stride, d values): in place when whole steps of the head dimension
  // cover them (d a multiple of 32), for every whole block pair of 32 keys;
  // the rest (all of it otherwise) packed into `out` as rows of padded_d(d)
  // values, zeros around them, up to padded_keys(keys) rows.
  struct KeyRows {
    const uint16_t* in_place;  // rows 0 .. in_place_keys, `stride` apart
    int64_t stride;
    int in_place_keys;       // a multiple of 32
    const uint16_t* packed;  // the rows from in_place_keys on, padded_d(d) apart
  };
  static KeyRows key_rows(const uint16_t* k, int64_t k_stride, int keys, int64_t d, uint16_t* out) {
    const int64_t dp = padded_d(d);
    const int in_place = d == dp ? keys / kStep * kStep : 0;
    const int rows = padded_keys(keys) - in_place;
    const uint16_t* from = k + in_place * k_stride;
    const int left = keys - in_place;
    for (int j = 0; j < left; ++j) {
      for (int64_t x = 0; x < dp; x += kStep) {
        _mm512_storeu_si512(out + j * dp + x, step_of_row(from + j * k_stride, 1, x, d));
      }
    }
    for (int j = left; j < rows; ++j) {
      for (int64_t x = 0; x < dp; x += kStep) {
        _mm512_storeu_si512(out + j * dp + x, _mm512_setzero_si512());
      }
    }
    return {k, k_stride, in_place, out};
  }

  // Pairs of Q (as Dot::pack_queries left them: d2 rows of kStride lanes)
  // padded with zero rows to whole steps.
  template <int kStride>
  static void pad_query_pairs(uint32_t* qp, int64_t d) {
    const int64_t d2 = (d + 1) / 2, rows = padded_d(d) / 2;
    for (int64_t x2 = d2; x2 < rows; ++x2) std::memset(qp + x2 * kStride, 0, kStride * 4);
  }

  // ------------------------------------------------------------ scores

  // scores[n][lane] = Σ_x K[n][x] · Q[lane][x] (unscaled) for the keys of
  // k (key_rows: padded_keys(keys) rows of padded_d(d) values) and
  // the query vectors 0 .. nqv rounded up to an even count (pairs of Q:
  // qp rows kStride pairs apart, padded by pad_query_pairs; the lanes of a
  // vector past nqv come out as whatever their pairs hold, and are not read).
  template <int kStride>
  MHA_AMX_TARGET static void scores(const KeyRows& k, int keys, int64_t d, const uint32_t* qp,
                                    int nqv, float* scores) {
    memory_barrier();
    const int64_t dp = padded_d(d), q_bytes = kStride * 4;
    const int rows = padded_keys(keys);
    for (int n0 = 0; n0 < rows; n0 += kStep) {
      const bool in_place = n0 < k.in_place_keys;
      const int64_t k_stride = in_place ? k.stride : dp, k_bytes = k_stride * 2;
      const uint16_t* k0 =
          in_place ? k.in_place + n0 * k.stride : k.packed + (n0 - k.in_place_keys) * dp;
      const uint16_t* k1 = k0 + W * k_stride;
      for (int v = 0; v < nqv; v += 2) {
        block_2x2(k0, k1, k_bytes, qp + v * W, W * kStride, q_bytes, dp / kStep,
                  scores + int64_t{n0} * kStride + v * W, kStride);
      }
    }
  }

  // What Dot::score_block does after its products, on the tile's unscaled
  // scores in memory (rows kStride floats apart, nqv vectors, `keys` rows):
  // kFused: p = 2^(c · score - row_max), added to tile_sum and stored as
  // bf16 pairs of keys in `pairs` (an odd last key paired with 0); kSetMax
  // takes row_max as each lane's maximum over the first 32 keys first.
  // Otherwise the scores times c, in place.
  template <int kStride, bool kFused, bool kSetMax>
  static void score_epilogue(float* scores, int nqv, int keys, float c, uint32_t* pairs,
                             float* row_max, float* tile_sum) {
    const B factor(c);
    for (int v = 0; v < nqv; ++v) {
      float* s = scores + v * W;
      if constexpr (!kFused) {
        for (int n = 0; n < keys; ++n)
          (B::load_aligned(s + n * kStride) * factor).store_aligned(s + n * kStride);
        continue;
      }
      B shift(0.0f);
      if constexpr (kSetMax) {
        // The first step's 32 keys set the reference, as the fp32 path's
        // first key group does (the caller's check on the sums catches
        // keys far above it); a pass over the whole tile cost S1:bf16 a
        // third of the epilogue of every other tile.
        shift = B::load_aligned(s) * factor;
        for (int n = 1; n < std::min(keys, kStep); ++n) {
          shift = xsimd::max(shift, B::load_aligned(s + n * kStride) * factor);
        }
        shift.store_aligned(row_max + v * W);
      } else {
        shift = B::load_aligned(row_max + v * W);
      }
      B sum = B::load_aligned(tile_sum + v * W);
      for (int n = 0; n < keys; n += 2) {
        const B d0 = xsimd::fms(B::load_aligned(s + n * kStride), factor, shift);
        const B d1 = n + 1 < keys
                         ? xsimd::fms(B::load_aligned(s + (n + 1) * kStride), factor, shift)
                         : B(0.0f);
        Dot::store_exp_pair(d0, n + 1 < keys ? &d1 : nullptr, sum,
                            pairs + (n / 2) * kStride + v * W);
      }
      sum.store_aligned(tile_sum + v * W);
    }
  }

  // ------------------------------------------------------------ rows

  // The fused tiles' orientation (rows): the scores come out as the
  // queries' rows, S[query][key] = Q[query][·] · Kᵀ -- A is 16 bf16 Q rows
  // (q_rows), B is 16 pairs of the head dimension for 16 keys (K's pairs
  // transposed once per item: key_pairs_t), C is 16 queries x 16 keys.  The
  // epilogue then rounds each row's probabilities to bf16 in key order,
  // which is P·V's A operand as it is: no pairs interleaved, no P
  // transposed, no Q packed as pairs.

  // Q rows q .. q + nq (q_stride values apart, d values col_stride apart)
  // as A operands: rows of padded_d(d) values, zeros after d and from row nq
  // to `rows`.
  static void q_rows(const uint16_t* q, int64_t q_stride, int64_t col_stride, int64_t nq,
                     int64_t rows, int64_t d, uint16_t* out) {
    const int64_t dp = padded_d(d);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t x = 0; x < dp; x += kStep) {
        _mm512_storeu_si512(out + r * dp + x, r < nq
                                                  ? step_of_row(q + r * q_stride, col_stride, x, d)
                                                  : _mm512_setzero_si512());
      }
    }
  }

  // Values x .. x + 32 of a row of d bf16 values col_stride apart, zeros
  // from d on.
  __attribute__((always_inline)) static __m512i step_of_row(const uint16_t* row, int64_t col_stride,
                                                            int64_t x, int64_t d) {
    const int64_t n = std::clamp<int64_t>(d - x, 0, kStep);
    if (col_stride == 1) {
      const __mmask32 valid = n == kStep ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
      return _mm512_maskz_loadu_epi16(valid, row + x);
    }
    alignas(64) uint16_t values[kStep] = {};
    for (int64_t i = 0; i < n; ++i) values[i] = row[(x + i) * col_stride];
    return _mm512_load_si512(values);
  }

  // kt[x2 · kt_stride + j] = the pair (K[j][2 x2], K[j][2 x2 + 1]) for the
  // keys j of whole groups of 16 from `from` (a multiple of 16) to `to`,
  // and every pair x2 < padded_d(d) / 2: zeros after d, and for keys from
  // `rows` on (key j's row at k_row(j), d values col_stride apart).
  template <class KeyRow>
  static void key_pairs_t(const KeyRow& k_row, int64_t col_stride, int64_t d, int64_t from,
                          int64_t to, int64_t rows, uint32_t* kt, int64_t kt_stride) {
    const int64_t dp = padded_d(d);
    for (int64_t j0 = from; j0 < to; j0 += W) {
      const uint16_t* row[W];
      for (int i = 0; i < W; ++i) row[i] = j0 + i < rows ? k_row(j0 + i) : nullptr;
      for (int64_t x = 0; x < dp; x += kStep) {
        B block[W];
        for (int i = 0; i < W; ++i) {
          block[i] = B(_mm512_castsi512_ps(row[i] != nullptr ? step_of_row(row[i], col_stride, x, d)
                                                             : _mm512_setzero_si512()));
        }
        transpose_square<Arch>(block);
        for (int i = 0; i < W; ++i) {
          _mm512_storeu_ps(kt + (x / 2 + i) * kt_stride + j0, block[i]);
        }
      }
    }
  }

  // s[r][n] = Σ_x Q[r][x] · K[n][x] (unscaled) for the rows 0 .. rows (a
  // multiple of 32; q as q_rows left them) and the keys 0 .. padded_keys(keys)
  // (kt from key_pairs_t, kt_stride pairs a row); s rows s_stride floats
  // apart.  Columns past `keys` hold whatever kt holds there.
  MHA_AMX_TARGET static void scores_rows(const uint16_t* q, int64_t rows, int64_t d,
                                         const uint32_t* kt, int64_t kt_stride, int keys, float* s,
                                         int64_t s_stride) {
    memory_barrier();
    const int64_t dp = padded_d(d), q_bytes = dp * 2, k_bytes = kt_stride * 4;
    const int n_end = padded_keys(keys);
    for (int64_t r0 = 0; r0 < rows; r0 += kStep) {
      const uint16_t* q0 = q + r0 * dp;
      const uint16_t* q1 = q0 + W * dp;
      for (int n0 = 0; n0 < n_end; n0 += kStep) {
        block_2x2(q0, q1, q_bytes, kt + n0, W * kt_stride, k_bytes, dp / kStep,
                  s + r0 * s_stride + n0, s_stride);
      }
    }
  }

  // The fused epilogue on scores_rows' rows 0 .. rows (a multiple of 16):
  // p = 2^(c · score - row_max[r]) for the keys 0 .. keys, 0 after them up to
  // padded_keys(keys), stored as bf16 in key order at p_rows + r ·
  // p_stride (pairs); tile_sum[r] = the row's sum in fp32.  kSetMax sets
  // row_max[r] to the row's maximum over its first 32 keys first (the
  // caller's check on the sums catches keys far above it).  each_row() is
  // called before each row (the caller's prefetches: vector work for them
  // to overlap).
  template <bool kSetMax, class EachRow>
  static void row_epilogue(const float* s, int64_t s_stride, int64_t rows, int keys, float c,
                           uint32_t* p_rows, int64_t p_stride, float* row_max, float* tile_sum,
                           const EachRow& each_row) {
    const B factor(c), minus_inf(-std::numeric_limits<float>::infinity());
    const int n_end = padded_keys(keys);
    // Lanes of the vector starting at key n that hold keys of the tile.
    const auto valid = [keys](int n) {
      const int m = std::clamp(keys - n, 0, W);
      return static_cast<__mmask16>((1u << m) - 1u);
    };
    for (int64_t g = 0; g < rows; g += W) {
      B lanes[W];
      if constexpr (kSetMax) {
        for (int i = 0; i < W; ++i) {
          const float* row = s + (g + i) * s_stride;
          B m = B(_mm512_mask_mov_ps(minus_inf, valid(0), B::load_aligned(row) * factor));
          m = xsimd::max(
              m, B(_mm512_mask_mov_ps(minus_inf, valid(W), B::load_aligned(row + W) * factor)));
          lanes[i] = m;
        }
        transpose_square<Arch>(lanes);
        B m = lanes[0];
        for (int i = 1; i < W; ++i) m = xsimd::max(m, lanes[i]);
        m.store_aligned(row_max + g);
      }
      for (int i = 0; i < W; ++i) {
        each_row();
        const float* row = s + (g + i) * s_stride;
        uint32_t* out = p_rows + (g + i) * p_stride;
        const B shift(row_max[g + i]);
        B sum(0.0f);
        // Whole steps, then the last one with the keys past the tile at -inf.
        const auto step = [&](int n, __mmask16 m0, __mmask16 m1) {
          const B d0(_mm512_mask_mov_ps(minus_inf, m0,
                                        xsimd::fms(B::load_aligned(row + n), factor, shift)));
          const B d1(_mm512_mask_mov_ps(minus_inf, m1,
                                        xsimd::fms(B::load_aligned(row + n + W), factor, shift)));
          const B e0 = fast_exp2<Arch>(d0), e1 = fast_exp2<Arch>(d1);
          sum += e0 + e1;
          _mm512_store_si512(out + n / 2, Dot::as_bits(_mm512_cvtne2ps_pbh(e1, e0)));
        };
        const int whole = keys / kStep * kStep;
        for (int n = 0; n < whole; n += kStep) step(n, 0xFFFF, 0xFFFF);
        if (whole < n_end) step(whole, valid(whole), valid(whole + W));
        lanes[i] = sum;
      }
      transpose_square<Arch>(lanes);
      B total = lanes[0];
      for (int i = 1; i < W; ++i) total += lanes[i];
      total.store_aligned(tile_sum + g);
    }
  }

  // ------------------------------------------------------------ P·V

  // The A operand of P·V for rows r0 .. r0 + 32: p_rows[r · p_stride + j2]
  // = pairs[j2 · kStride + r0 + r] for j2 < n_pairs, 0 up to row_pairs (the
  // whole steps: padded_keys / 2).
  template <int kStride>
  static void transpose_pairs(const uint32_t* pairs, int64_t r0, int n_pairs, int row_pairs,
                              uint32_t* p_rows, int64_t p_stride) {
    for (int half = 0; half < 2; ++half) {
      for (int j0 = 0; j0 < row_pairs; j0 += W) {
        B rows[W];
        for (int i = 0; i < W; ++i) {
          rows[i] = j0 + i < n_pairs ? B::load_aligned(reinterpret_cast<const float*>(pairs) +
                                                       (j0 + i) * kStride + r0 + half * W)
                                     : B(0.0f);
        }
        transpose_square<Arch>(rows);
        for (int i = 0; i < W; ++i) {
          rows[i].store_aligned(reinterpret_cast<float*>(p_rows) + (half * W + i) * p_stride + j0);
        }
      }
    }
  }

  // acc[r][c] += Σ_j P[r][j] · V[j][c] for the 32 rows of p_rows (two blocks
  // of 16, row_pairs pairs apart) and the dvp columns of acc (rows dvp
  // floats apart), over n_pairs pairs of keys of V (pairs of keys, rows
  // v_stride pairs apart).  A last partial step's V rows are staged first,
  // with zeros after them, in `stage` (16 x v_stride pairs): once for every
  // block of columns.
  MHA_AMX_TARGET static void pv(const uint32_t* p_rows, int row_pairs, const uint32_t* v,
                                int64_t v_stride, int n_pairs, float* acc, int64_t dvp,
                                uint32_t* stage) {
    const int whole = n_pairs / W * W;
    if (whole < n_pairs) {
      const int valid = n_pairs - whole;
      std::memcpy(stage, v + whole * v_stride, static_cast<size_t>(valid * v_stride) * 4);
      std::memset(stage + valid * v_stride, 0, static_cast<size_t>((W - valid) * v_stride) * 4);
    }
    const Pv run{p_rows, row_pairs, v, v_stride, n_pairs, stage, acc, dvp};
    int64_t c = 0;
    for (; c + 2 * W <= dvp; c += 2 * W) pv_columns<true>(run, c);
    if (c < dvp) pv_columns<false>(run, c);  // a last block of 16 columns
  }

  // A 2 x 2 block of tiles: c[i][j] = c0[i][j] + Σ over `steps` steps of
  // A_i · B_j, stored at c (the four 16 x 16 blocks, rows c_stride floats
  // apart).  A_0 and A_1 are 16 rows of bf16 from a0 and a1 (a_bytes apart),
  // 32 values further each step; B_0 and B_1 are 16 rows of pairs from b and
  // b + 16 (b_bytes apart), b_step pairs further each step.  c0: 0 (nullptr),
  // or 32 x 32 floats, rows c0_stride apart (the matrix products' biases).
  // kPlanes > 1: A is the sum of that many planes of bf16, `plane` values
  // apart (an fp32 A split into bf16 parts), each step's B products taken
  // with each.  kAheadA > 0: A's rows of the step that many steps on are
  // requested into the L1 (A from the L2, as in the matrix products).
  template <int kPlanes = 1, int kAheadA = 0>
  MHA_AMX_TARGET static void block_2x2(const uint16_t* a0, const uint16_t* a1, int64_t a_bytes,
                                       const uint32_t* b, int64_t b_step, int64_t b_bytes,
                                       int64_t steps, float* c, int64_t c_stride,
                                       const float* c0 = nullptr, int64_t c0_stride = 0,
                                       int64_t plane = 0, int64_t a_step = kStep) {
    if (c0 == nullptr) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      const int64_t c0_bytes = c0_stride * 4;
      _tile_loadd(0, c0, c0_bytes);
      _tile_loadd(1, c0 + W, c0_bytes);
      _tile_loadd(2, c0 + W * c0_stride, c0_bytes);
      _tile_loadd(3, c0 + W * c0_stride + W, c0_bytes);
    }
    for (int64_t x = 0; x < steps; ++x) {
      if constexpr (kAheadA > 0) {
        if (x + kAheadA < steps) {
          for (int part = 0; part < kPlanes; ++part) {
            const auto* r0 =
                reinterpret_cast<const char*>(a0 + part * plane + (x + kAheadA) * a_step);
            const auto* r1 =
                reinterpret_cast<const char*>(a1 + part * plane + (x + kAheadA) * a_step);
            for (int r = 0; r < W; ++r) {
              __builtin_prefetch(r0 + r * a_bytes, 0, 3);
              __builtin_prefetch(r1 + r * a_bytes, 0, 3);
            }
          }
        }
      }
      if constexpr (kPlanes == 1) {
        _tile_loadd(4, a0 + x * a_step, a_bytes);
        _tile_loadd(5, a1 + x * a_step, a_bytes);
        _tile_loadd(6, b + x * b_step, b_bytes);
        _tile_loadd(7, b + x * b_step + W, b_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_loadd(6, b + x * b_step, b_bytes);
        _tile_loadd(7, b + x * b_step + W, b_bytes);
        // The smallest parts first.
        for (int part = kPlanes - 1; part >= 0; --part) {
          const int64_t at = part * plane + x * a_step;
          _tile_loadd(4, a0 + at, a_bytes);
          _tile_loadd(5, a1 + at, a_bytes);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
    const int64_t c_bytes = c_stride * 4;
    _tile_stored(0, c, c_bytes);
    _tile_stored(1, c + W, c_bytes);
    _tile_stored(2, c + W * c_stride, c_bytes);
    _tile_stored(3, c + W * c_stride + W, c_bytes);
  }

 private:
  struct Pv {
    const uint32_t* p_rows;
    int row_pairs;
    const uint32_t* v;
    int64_t v_stride;
    int n_pairs;
    const uint32_t* stage;  // the last partial step's rows
    float* acc;
    int64_t dvp;
  };

  // pv's columns c .. c + 32 (kPair) or c .. c + 16: accumulator tiles 0 and
  // 1 for rows 0-15, 2 and 3 for rows 16-31 (1 and 3 only with kPair).
  template <bool kPair>
  MHA_AMX_TARGET static void pv_columns(const Pv& r, int64_t c) {
    const int64_t p_bytes = r.row_pairs * 4, v_bytes = r.v_stride * 4, a_bytes = r.dvp * 4;
    const uint32_t* p1 = r.p_rows + W * r.row_pairs;
    float* acc0 = r.acc + c;
    float* acc1 = r.acc + W * r.dvp + c;
    memory_barrier();
    _tile_loadd(0, acc0, a_bytes);
    _tile_loadd(2, acc1, a_bytes);
    if constexpr (kPair) {
      _tile_loadd(1, acc0 + W, a_bytes);
      _tile_loadd(3, acc1 + W, a_bytes);
    }
    for (int j2 = 0; j2 < r.n_pairs; j2 += W) {
      const uint32_t* vr = (j2 + W <= r.n_pairs ? r.v + j2 * r.v_stride : r.stage) + c;
      _tile_loadd(4, r.p_rows + j2, p_bytes);
      _tile_loadd(5, p1 + j2, p_bytes);
      _tile_loadd(6, vr, v_bytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kPair) {
        _tile_loadd(7, vr + W, v_bytes);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, acc0, a_bytes);
    _tile_stored(2, acc1, a_bytes);
    if constexpr (kPair) {
      _tile_stored(1, acc0 + W, a_bytes);
      _tile_stored(3, acc1 + W, a_bytes);
    }
  }
};

#endif  // MHA_HAVE_AMX_TILES

}  // namespace mha_simd
