// The prefill layout: vector lanes along the queries.
//
// A tile of queries is packed once, transposed and pre-multiplied by
// scale·log2(e), so one register holds one head-dimension index of W queries.
// The score micro-kernel then broadcasts K elements straight from K's rows and
// the P·V micro-kernel loads V rows as vectors: K and V are used in place (a
// tile is packed only when its rows are strided or Dv is not a multiple of W).
// All softmax state — running max, running sum, rescale factor — is vertical
// (one lane per query), so there are no horizontal reductions; exp is base 2.
// (flash-kernel-on-zen4.md measured this layout 5-22 % ahead of packing Kᵀ.)
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/attention_rules.h"
#include "common/dropout.h"
#include "simd/blocking.hpp"
#include "simd/dropout_simd.hpp"
#include "simd/exp2.hpp"
#include "simd/tile_tools.hpp"
#include "simd/transpose.hpp"

namespace mha_simd {

template <class Arch>
class QueryLaneKernel {
  using B = xsimd::batch<float, Arch>;
  static constexpr int W = static_cast<int>(B::size);
  using Blk = Blocking<Arch>;
  static constexpr int QT = Blk::kQueryTile;
  static constexpr int KT = Blk::kKeyTile;
  static constexpr int kWarmUpKeys = 4 * Blk::kScoreKeys;
  static_assert(QT % (W * Blk::kScoreQueryVectors) == 0, "query tile must hold whole blocks");
  static_assert(KT % Blk::kScoreKeys == 0, "key tile must hold whole key groups");

  struct Tile {
    float* qt;          // [D][QT]: Q transposed, times scale·log2(e)
    float* scores;      // [KT][QT]: scores, then probabilities, of one key tile
    float* acc;         // [QT][Dvp]: the unnormalised output
    float* row_max;     // [QT], base-2 units
    float* row_sum;     // [QT]
    float* alpha;       // [QT]: rescale factor of the current key tile
    uint8_t* removed;   // [KT][QT]: keys a mask removed, when V holds non-finite values
    float* tile_sum;    // [QT]: sums of a fused tile until it is known to be valid
    int64_t* last_key;  // [QT]: last visible key, relative to the item's first key
    float* tile_last;   // [QT]: the same relative to the current tile, within [-1, KT]
    uint32_t* row_key;  // [QT]: dropout hash of each query's row
    float* k_pack;      // [KT][D] when K rows are strided
    float* v_pack;      // [KT][Dvp] when V rows are strided or Dv % W != 0
  };

 public:
  static size_t scratch_bytes(const mha_kernel_problem& p) {
    const int64_t dvp = round_up(p.dv, W);
    return ScratchCarver::bytes({p.d * QT, int64_t{KT} * QT, QT * dvp, QT, QT, QT, QT, 2 * QT, QT,
                                 QT, KT * p.d, KT * dvp, int64_t{KT} * QT / 4});
  }

  static void run(const mha_kernel_problem& p, const mha_work_item& item, void* scratch) {
    ScratchCarver carve(scratch);
    const int64_t dvp = round_up(p.dv, W);
    Tile t{};
    t.qt = carve.floats(p.d * QT);
    t.scores = carve.floats(int64_t{KT} * QT);
    t.acc = carve.floats(QT * dvp);
    t.row_max = carve.floats(QT);
    t.row_sum = carve.floats(QT);
    t.alpha = carve.floats(QT);
    t.tile_sum = carve.floats(QT);
    t.last_key = reinterpret_cast<int64_t*>(carve.floats(2 * QT));
    t.tile_last = carve.floats(QT);
    t.row_key = reinterpret_cast<uint32_t*>(carve.floats(QT));
    t.k_pack = carve.floats(KT * p.d);
    t.v_pack = carve.floats(KT * dvp);
    t.removed = reinterpret_cast<uint8_t*>(carve.floats(int64_t{KT} * QT / 4));
    for (int64_t h = item.h_begin; h < item.h_end; ++h) {
      for (int64_t q0 = item.q_begin; q0 < item.q_end; q0 += QT) {
        query_tile(p, item, t, h, q0, std::min<int64_t>(QT, item.q_end - q0));
      }
    }
  }

 private:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // A logit of -inf (from the data, not a mask) is a key that takes no part,
  // so its V row must not reach the output either; the fast path cannot tell
  // such a weight from an underflowed one.  And a logit near FLT_MAX overflows
  // in the fast path's base-2 units.  A tile whose output came out non-finite
  // is therefore computed again, carefully: raw units (ScoreUnits), two-pass
  // softmax and P·V skipping every -inf logit.  Finite data never pays for it.
  static void query_tile(const mha_kernel_problem& p, const mha_work_item& item, const Tile& t,
                         int64_t h, int64_t q0, int64_t nq) {
    ScoreUnits units = ScoreUnits::base2(p.scale);
    accumulate_tile(p, item, t, h, q0, nq, units, /*careful=*/false);
    if (!acc_finite(t, nq, round_up(p.dv, W)) || has_lost_row(t, nq)) {
      units = ScoreUnits::raw_units(p.scale);
      accumulate_tile(p, item, t, h, q0, nq, units, /*careful=*/true);
    }
    write_rows(p, item, t, h, q0, nq, units);
  }

  // A row with visible keys but no weight: either a mask removed every key
  // (rare, and the careful pass gives the same zeros) or its logits are so
  // negative that base-2 units overflowed them to -inf (then the careful
  // pass, in raw units, finds the row).
  static bool has_lost_row(const Tile& t, int64_t nq) {
    for (int64_t r = 0; r < nq; ++r) {
      if (t.row_sum[r] == 0.0f && t.last_key[r] >= 0) return true;
    }
    return false;
  }

  static bool acc_finite(const Tile& t, int64_t nq, int64_t dvp) {
    B poison(0.0f);  // a - a is 0 for finite a, NaN for NaN and infinities
    for (int64_t x = 0; x < nq * dvp; x += W) {
      const B a = B::load_aligned(t.acc + x);
      poison += a - a;
    }
    return xsimd::all(poison == poison);
  }

  static void accumulate_tile(const mha_kernel_problem& p, const mha_work_item& item, const Tile& t,
                              int64_t h, int64_t q0, int64_t nq, const ScoreUnits& units,
                              bool careful) {
    const int64_t b = item.b;
    const int64_t kvh = mha_kernel::kv_head_of(p, h);
    const int64_t dvp = round_up(p.dv, W);
    const int nqv = static_cast<int>((nq + W - 1) / W);

    // Which keys each query sees; the tile stops at the furthest one.
    int64_t min_last = item.k_end - 1, max_last = item.k_begin - 1;
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t last = std::min(mha_kernel::last_visible_key(p, b, q0 + r), item.k_end - 1);
      min_last = std::min(min_last, last);
      max_last = std::max(max_last, last);
      t.last_key[r] = last - item.k_begin;
    }
    for (int64_t r = nq; r < int64_t{nqv} * W; ++r) {
      t.last_key[r] = max_last - item.k_begin;  // padding lanes
    }

    pack_queries(p, t, b, h, q0, nq, units.q_factor);
    if (p.dropout_p > 0.0f) {
      for (int64_t r = 0; r < int64_t{nqv} * W; ++r) {
        t.row_key[r] = mha_dropout::row_key(p.dropout_seed, b, h, q0 + r, p.heads, p.lq);
      }
    }
    for (int64_t r = 0; r < int64_t{nqv} * W; ++r) {
      t.row_max[r] = kNegInf;
      t.row_sum[r] = 0.0f;
    }
    for (int64_t x = 0; x < nq * dvp; x += W) B(0.0f).store_aligned(t.acc + x);

    PrefetchQueue prefetch;
    queue_next_rows(p, item, h, q0, nq, prefetch);
    const int64_t key_tiles = (max_last + 1 - item.k_begin + KT - 1) / KT;
    {
      constexpr int QV = Blk::kScoreQueryVectors, NK = Blk::kScoreKeys;
      constexpr int R = Blk::kPvRows, C = Blk::kPvVectors;
      const int64_t blocks_per_key_tile =
          (nqv + QV - 1) / QV * ((KT + NK - 1) / NK) + (nq + R - 1) / R * ((dvp / W + C - 1) / C);
      prefetch.pace(key_tiles * blocks_per_key_tile);
    }

    const bool k_direct = p.k_strides[3] == 1;
    const bool v_direct = p.v_strides[3] == 1 && p.dv % W == 0;
    bool lanes_have_maximum = false;
    int keys = 0;
    for (int64_t j0 = item.k_begin; j0 <= max_last; j0 += keys) {
      // Without a mask the first tile is short: it sets the running maximum
      // with the two-pass path, and the fused path takes over from the next
      // key on instead of from the next full tile.
      const int span = j0 == item.k_begin && p.mask_kind == MHA_MASK_NONE ? kWarmUpKeys : KT;
      keys = static_cast<int>(std::min<int64_t>(span, max_last + 1 - j0));
      const float* k_rows = mha_kernel::k_row(p, b, kvh, j0);
      int64_t k_stride = p.k_strides[2];
      if (!k_direct) {
        pack_rows(k_rows, p.k_strides[2], p.k_strides[3], keys, p.d, t.k_pack, p.d);
        k_rows = t.k_pack;
        k_stride = p.d;
      }
      // Fused path: once every lane has a finite running maximum, a tile with
      // no mask to apply computes its probabilities straight from the score
      // registers against that (stale) maximum; it is exact as long as no
      // score exceeds the maximum by more than kMaxGrowth (2^16 cannot
      // overflow), which the epilogue checks.  Otherwise, and on the first
      // tile, the two-pass path: scores, masks, new maximum, rescale.
      const float* v_rows = mha_kernel::v_row(p, b, kvh, j0);
      int64_t v_stride = p.v_strides[2];
      if (!v_direct) {
        pack_rows(v_rows, p.v_strides[2], p.v_strides[3], keys, p.dv, t.v_pack, dvp);
        v_rows = t.v_pack;
        v_stride = dvp;
      }
      const bool maskless = p.mask_kind == MHA_MASK_NONE && j0 + keys - 1 <= min_last;
      const bool fused = maskless && !careful && lanes_have_maximum &&
                         compute_scores<true>(t, k_rows, k_stride, p.d, nqv, keys, prefetch);
      // A key a mask or a -inf logit removed must not pass on a NaN or
      // infinity of its V row through 0 · V; such tiles (rare) take the
      // guarded P·V.
      bool guarded = false;
      if (!fused) {
        compute_scores<false>(t, k_rows, k_stride, p.d, nqv, keys, prefetch);
        if (p.mask_kind != MHA_MASK_NONE) apply_mask(p, t, b, h, q0, nq, nqv, j0, keys, units);
        if (j0 + keys - 1 > min_last) apply_visibility(t, nqv, j0 - item.k_begin, keys);
        guarded = (careful || !maskless) && !rows_finite(v_rows, v_stride, keys, dvp);
        if (guarded) {
          for (int64_t x = 0; x < int64_t{keys} * QT; ++x) t.removed[x] = t.scores[x] == kNegInf;
        }
        lanes_have_maximum = units.raw ? update_softmax<true>(t, nqv, keys, units)
                                       : update_softmax<false>(t, nqv, keys, units);
      }
      if (p.dropout_p > 0.0f) apply_dropout(p, t, nqv, j0, keys);
      if (guarded) {
        accumulate_pv_guarded(t, v_rows, v_stride, dvp, nq, keys);
      } else {
        accumulate_pv(t, v_rows, v_stride, dvp, nq, keys, prefetch);
      }
    }
  }

  // What comes next, to fetch while this tile computes: this tile's output
  // rows; then, after the last tile of a head in an item of several heads
  // (short sequences), the next head's Q, K and V; otherwise the Q rows just
  // before this tile, which the runtime's order (descending query tiles of
  // one head) most likely hands this thread next.
  static void queue_next_rows(const mha_kernel_problem& p, const mha_work_item& item, int64_t h,
                              int64_t q0, int64_t nq, PrefetchQueue& prefetch) {
    const int64_t b = item.b;
    if (item.out_strides[2] == 1) {
      prefetch.add(item.out + (h - item.h_begin) * item.out_strides[0] +
                       (q0 - item.q_begin) * item.out_strides[1],
                   item.out_strides[1], nq, p.dv, true);
    }
    if (q0 + nq >= item.q_end && h + 1 < item.h_end) {
      if (p.q_strides[3] == 1) {
        prefetch.add(mha_kernel::q_row(p, b, h + 1, item.q_begin), p.q_strides[2],
                     std::min<int64_t>(QT, item.q_end - item.q_begin), p.d, false);
      }
      const int64_t kvh = mha_kernel::kv_head_of(p, h + 1);
      if (kvh != mha_kernel::kv_head_of(p, h)) {
        const int64_t keys = std::min<int64_t>(KT, item.k_end - item.k_begin);
        if (p.k_strides[3] == 1) {
          prefetch.add(mha_kernel::k_row(p, b, kvh, item.k_begin), p.k_strides[2], keys, p.d,
                       false);
        }
        if (p.v_strides[3] == 1) {
          prefetch.add(mha_kernel::v_row(p, b, kvh, item.k_begin), p.v_strides[2], keys, p.dv,
                       false);
        }
      }
    } else if (q0 >= QT && p.q_strides[3] == 1) {
      prefetch.add(mha_kernel::q_row(p, b, h, q0 - QT), p.q_strides[2], QT, p.d, false);
    }
  }

  // qt[x][r] = Q[q0 + r][x] · c (scale · log2(e) in base-2 units); whole
  // W x W blocks go through a register transpose, the edges element by
  // element; padding lanes are 0.
  static void pack_queries(const mha_kernel_problem& p, const Tile& t, int64_t b, int64_t h,
                           int64_t q0, int64_t nq, float c) {
    // The partial last vector is zeroed first, so its padding lanes are 0.
    const int64_t whole = nq / W * W;
    if (whole < nq) {
      for (int64_t x = 0; x < p.d; ++x) B(0.0f).store_aligned(t.qt + x * QT + whole);
    }
    int64_t r0 = 0;
    if (p.q_strides[3] == 1) {
      for (; r0 < whole; r0 += W) {
        const float* q = mha_kernel::q_row(p, b, h, q0 + r0);
        int64_t x0 = 0;
        for (; x0 + W <= p.d; x0 += W) {
          B rows[W];
          for (int i = 0; i < W; ++i) rows[i] = B::load_unaligned(q + i * p.q_strides[2] + x0) * c;
          transpose_square<Arch>(rows);
          for (int j = 0; j < W; ++j) rows[j].store_aligned(t.qt + (x0 + j) * QT + r0);
        }
        for (int i = 0; i < W; ++i) {
          for (int64_t x = x0; x < p.d; ++x) t.qt[x * QT + r0 + i] = q[i * p.q_strides[2] + x] * c;
        }
      }
    }
    for (int64_t r = r0; r < nq; ++r) {
      const float* q = mha_kernel::q_row(p, b, h, q0 + r);
      for (int64_t x = 0; x < p.d; ++x) t.qt[x * QT + r] = q[x * p.q_strides[3]] * c;
    }
  }

  // scores[j][q] = Σ_x qt[x][q] · K[j][x] for NV query vectors and NK keys.
  // How far (in base-2 units) a score may exceed the stale maximum on the fused
  // path: probabilities up to 2^16, sums far from overflow.
  static constexpr float kMaxGrowth = 16.0f;

  // scores[j][q] = Σ_x qt[x][q] · K[j][x] for NV query vectors and NK keys.
  // kFused: store 2^(score - row_max) instead, add them to tile_sum, and return
  // false if a score exceeds row_max by more than kMaxGrowth.
  template <int NV, int NK, bool kFused>
  static bool score_block(const float* qt, const float* k_rows, int64_t k_stride, int64_t d,
                          float* scores, const float* row_max, float* tile_sum) {
    const float* k[NK];
    for (int n = 0; n < NK; ++n) k[n] = k_rows + n * k_stride;
    // The first index initialises the accumulators (d >= 1): no zeroing, and no
    // path on which they live in memory.
    B acc[NV][NK];
    {
      B q[NV];
      for (int v = 0; v < NV; ++v) q[v] = B::load_aligned(qt + v * W);
      for (int n = 0; n < NK; ++n) {
        const B kb(k[n][0]);
        for (int v = 0; v < NV; ++v) acc[v][n] = q[v] * kb;
      }
    }
    // The next key group's rows come from L2 while this one computes (measured:
    // the score phase about 5 % faster against the unchanged P·V phase).
    for (int n = 0; n < NK; ++n) {
      const char* next = reinterpret_cast<const char*>(k[n] + NK * k_stride);
      for (int64_t byte = 0; byte < d * 4; byte += 64) __builtin_prefetch(next + byte, 0, 3);
    }
    for (int64_t x = 1; x < d; ++x) {
      B q[NV];
      for (int v = 0; v < NV; ++v) q[v] = B::load_aligned(qt + x * QT + v * W);
      for (int n = 0; n < NK; ++n) {
        const B kb(k[n][x]);
        for (int v = 0; v < NV; ++v) acc[v][n] = xsimd::fma(q[v], kb, acc[v][n]);
      }
    }
    if constexpr (!kFused) {
      for (int n = 0; n < NK; ++n) {
        for (int v = 0; v < NV; ++v) acc[v][n].store_aligned(scores + n * QT + v * W);
      }
      return true;
    } else {
      bool within = true;
      for (int v = 0; v < NV; ++v) {
        const B shift = B::load_aligned(row_max + v * W);
        B highest = acc[v][0];
        for (int n = 1; n < NK; ++n) highest = xsimd::max(highest, acc[v][n]);
        within = within && !xsimd::any(highest > shift + B(kMaxGrowth));
        B sum = B::load_aligned(tile_sum + v * W);
        for (int n = 0; n < NK; ++n) {
          const B e = fast_exp2<Arch>(acc[v][n] - shift);
          e.store_aligned(scores + n * QT + v * W);
          sum += e;
        }
        sum.store_aligned(tile_sum + v * W);
      }
      return within;
    }
  }

  // Returns false when the fused path's stale maximum was exceeded; then
  // nothing of the tile is kept (row_sum is untouched, alpha is 1 otherwise).
  template <bool kFused>
  static bool compute_scores(const Tile& t, const float* k_rows, int64_t k_stride, int64_t d,
                             int nqv, int keys, PrefetchQueue& prefetch) {
    constexpr int QV = Blk::kScoreQueryVectors, NK = Blk::kScoreKeys;
    if constexpr (kFused) {
      for (int v = 0; v < nqv; ++v) B(0.0f).store_aligned(t.tile_sum + v * W);
    }
    bool within = true;
    for (int v0 = 0; v0 < nqv; v0 += QV) {
      const int nv = std::min(QV, nqv - v0);
      for (int j = 0; j < keys; j += NK) {
        prefetch.step();
        const int nk = std::min(NK, keys - j);
        with_count<QV>(nv, [&](auto NV) {
          with_count<NK>(nk, [&](auto NKc) {
            within &= score_block<decltype(NV)::value, decltype(NKc)::value, kFused>(
                t.qt + v0 * W, k_rows + j * k_stride, k_stride, d, t.scores + j * QT + v0 * W,
                t.row_max + v0 * W, t.tile_sum + v0 * W);
          });
        });
      }
    }
    if constexpr (kFused) {
      if (!within) return false;
      for (int v = 0; v < nqv; ++v) {
        (B::load_aligned(t.row_sum + v * W) + B::load_aligned(t.tile_sum + v * W))
            .store_aligned(t.row_sum + v * W);
        B(1.0f).store_aligned(t.alpha + v * W);
      }
    }
    return within;
  }

  // The explicit mask, in the units of the scores.
  static void apply_mask(const mha_kernel_problem& p, const Tile& t, int64_t b, int64_t h,
                         int64_t q0, int64_t nq, int nqv, int64_t j0, int keys,
                         const ScoreUnits& units) {
    const int64_t ms = p.mask_strides[3];
    const bool is_bool = p.mask_kind == MHA_MASK_BOOL;
    if (p.mask_strides[2] == 0) {
      // The same mask row for every query of the tile (key padding): one
      // broadcast per key.
      const int64_t row = mha_kernel::mask_row_offset(p, b, h, q0) + j0 * ms;
      for (int j = 0; j < keys; ++j) {
        float* s = t.scores + j * QT;
        if (is_bool) {
          if (static_cast<const uint8_t*>(p.mask)[row + j * ms] != 0) continue;
          for (int v = 0; v < nqv; ++v) B(kNegInf).store_aligned(s + v * W);
        } else {
          const B add(units.mask(static_cast<const float*>(p.mask)[row + j * ms]));
          for (int v = 0; v < nqv; ++v) (B::load_aligned(s + v * W) + add).store_aligned(s + v * W);
        }
      }
      return;
    }
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t row = mha_kernel::mask_row_offset(p, b, h, q0 + r) + j0 * ms;
      if (is_bool) {
        const auto* m = static_cast<const uint8_t*>(p.mask) + row;
        for (int j = 0; j < keys; ++j) {
          if (m[j * ms] == 0) t.scores[j * QT + r] = kNegInf;
        }
      } else {
        const auto* m = static_cast<const float*>(p.mask) + row;
        for (int j = 0; j < keys; ++j) t.scores[j * QT + r] += units.mask(m[j * ms]);
      }
    }
  }

  // Causal and valid-length limits: key j (relative) is hidden from query q
  // when j > last_key[q].  Only tiles that cross some query's limit get here.
  // The comparison runs in floats relative to the tile, where every value is a
  // small integer (exact for any sequence length).
  static void apply_visibility(const Tile& t, int nqv, int64_t j_rel0, int keys) {
    for (int64_t r = 0; r < int64_t{nqv} * W; ++r) {
      const int64_t last = std::min<int64_t>(std::max<int64_t>(t.last_key[r] - j_rel0, -1), keys);
      t.tile_last[r] = static_cast<float>(last);
    }
    for (int v = 0; v < nqv; ++v) {
      const B last = B::load_aligned(t.tile_last + v * W);
      for (int j = 0; j < keys; ++j) {
        float* s = t.scores + j * QT + v * W;
        const B hidden_from = B(static_cast<float>(j));
        xsimd::select(hidden_from > last, B(kNegInf), B::load_aligned(s)).store_aligned(s);
      }
    }
  }

  // 2^exponent of a score's distance d to the row maximum (ScoreUnits).
  template <bool kRaw>
  static B exp_of_distance(B d, const ScoreUnits& units) {
    if constexpr (kRaw) return fast_exp2<Arch>((d * B(units.abs_scale)) * B(kLog2e));
    return fast_exp2<Arch>(d);
  }

  // Online softmax over one key tile, all vertical: new running max, the
  // factor that rescales what was accumulated, probabilities in place of the
  // scores, running sum.
  // Returns true when every lane now has a finite running maximum (what the
  // fused path needs).
  template <bool kRaw>
  static bool update_softmax(const Tile& t, int nqv, int keys, const ScoreUnits& units) {
    bool all_finite = true;
    for (int v = 0; v < nqv; ++v) {
      float* s = t.scores + v * W;
      B m0 = B::load_aligned(s), m1 = m0;
      int j = 1;
      for (; j + 1 < keys; j += 2) {
        m0 = xsimd::max(m0, B::load_aligned(s + j * QT));
        m1 = xsimd::max(m1, B::load_aligned(s + (j + 1) * QT));
      }
      if (j < keys) m0 = xsimd::max(m0, B::load_aligned(s + j * QT));
      const B old_max = B::load_aligned(t.row_max + v * W);
      const B new_max = xsimd::max(old_max, xsimd::max(m0, m1));
      // A row that has seen no visible key yet keeps -inf; subtract 0 instead so
      // that -inf - -inf never happens (exp2 of -inf is 0).
      const B shift = xsimd::select(new_max == B(kNegInf), B(0.0f), new_max);
      const B alpha = exp_of_distance<kRaw>(old_max - shift, units);
      B sum0 = B::load_aligned(t.row_sum + v * W) * alpha, sum1 = B(0.0f);
      j = 0;
      for (; j + 1 < keys; j += 2) {
        const B e0 = exp_of_distance<kRaw>(B::load_aligned(s + j * QT) - shift, units);
        const B e1 = exp_of_distance<kRaw>(B::load_aligned(s + (j + 1) * QT) - shift, units);
        e0.store_aligned(s + j * QT);
        e1.store_aligned(s + (j + 1) * QT);
        sum0 += e0;
        sum1 += e1;
      }
      if (j < keys) {
        const B e0 = exp_of_distance<kRaw>(B::load_aligned(s + j * QT) - shift, units);
        e0.store_aligned(s + j * QT);
        sum0 += e0;
      }
      new_max.store_aligned(t.row_max + v * W);
      (sum0 + sum1).store_aligned(t.row_sum + v * W);
      alpha.store_aligned(t.alpha + v * W);
      all_finite = all_finite && xsimd::all(xsimd::abs(new_max) < B(1e30f));
    }
    return all_finite;
  }

  // Dropout after the running sum took the weights: the sum (and the LSE) are
  // those of the weights before dropout, as the softmax is.
  static void apply_dropout(const mha_kernel_problem& p, const Tile& t, int nqv, int64_t j0,
                            int keys) {
    using U = xsimd::batch<uint32_t, Arch>;
    const DropoutFactor<Arch> factor(p.dropout_p);
    for (int v = 0; v < nqv; ++v) {
      const U rows = U::load_aligned(t.row_key + v * W);
      for (int j = 0; j < keys; ++j) {
        float* s = t.scores + j * QT + v * W;
        const uint32_t step = static_cast<uint32_t>(j0 + j) * mha_dropout::kKeyStep;
        (B::load_aligned(s) * factor(rows + U(step))).store_aligned(s);
      }
    }
  }

  // acc[r][c] = acc[r][c] · alpha[r] + Σ_j P[j][r] · V[j][c] for NR rows and
  // NC vectors of Dv.  The tile's sum starts from its first product and the
  // old accumulator joins at the end (one FMA, the rescale riding on it): the
  // rounding of a row grows with the tile width plus the number of tiles, not
  // with the number of keys.
  template <int NR, int NC>
  static void pv_block(const float* probs, const float* alpha, const float* v_rows,
                       int64_t v_stride, int keys, float* acc, int64_t acc_stride) {
    B o[NR][NC];
    {
      B vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = B::load_unaligned(v_rows + c * W);
      for (int r = 0; r < NR; ++r) {
        const B pr(probs[r]);
        for (int c = 0; c < NC; ++c) o[r][c] = pr * vv[c];
      }
    }
    for (int j = 1; j < keys; ++j) {
      B vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = B::load_unaligned(v_rows + j * v_stride + c * W);
      for (int r = 0; r < NR; ++r) {
        const B pr(probs[j * QT + r]);
        for (int c = 0; c < NC; ++c) o[r][c] = xsimd::fma(pr, vv[c], o[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const B a(alpha[r]);
      for (int c = 0; c < NC; ++c) {
        float* out = acc + r * acc_stride + c * W;
        xsimd::fma(B::load_aligned(out), a, o[r][c]).store_aligned(out);
      }
    }
  }

  static void accumulate_pv(const Tile& t, const float* v_rows, int64_t v_stride, int64_t dvp,
                            int64_t nq, int keys, PrefetchQueue& prefetch) {
    constexpr int R = Blk::kPvRows, C = Blk::kPvVectors;
    const int vectors = static_cast<int>(dvp / W);
    for (int64_t r0 = 0; r0 < nq; r0 += R) {
      const int nr = static_cast<int>(std::min<int64_t>(R, nq - r0));
      for (int c0 = 0; c0 < vectors; c0 += C) {
        prefetch.step();
        const int nc = std::min(C, vectors - c0);
        with_count<R>(nr, [&](auto NR) {
          with_count<C>(nc, [&](auto NC) {
            pv_block<decltype(NR)::value, decltype(NC)::value>(t.scores + r0, t.alpha + r0,
                                                               v_rows + c0 * W, v_stride, keys,
                                                               t.acc + r0 * dvp + c0 * W, dvp);
          });
        });
      }
    }
  }

  // True when every value of the tile's V rows is finite.
  static bool rows_finite(const float* v_rows, int64_t v_stride, int keys, int64_t dvp) {
    B poison(0.0f);  // v - v is 0 for finite v, NaN for NaN and infinities
    for (int j = 0; j < keys; ++j) {
      for (int64_t x = 0; x < dvp; x += W) {
        const B v = B::load_unaligned(v_rows + j * v_stride + x);
        poison += v - v;
      }
    }
    return xsimd::all(poison == poison);
  }

  // P·V skipping the keys the masks removed (t.removed), for tiles whose V
  // holds NaN or infinities.  Plain loops: this is the rare path.
  static void accumulate_pv_guarded(const Tile& t, const float* v_rows, int64_t v_stride,
                                    int64_t dvp, int64_t nq, int keys) {
    for (int64_t r = 0; r < nq; ++r) {
      float* o = t.acc + r * dvp;
      const float a = t.alpha[r];
      for (int64_t x = 0; x < dvp; ++x) o[x] *= a;
      for (int j = 0; j < keys; ++j) {
        if (t.removed[j * QT + r]) continue;
        const float pj = t.scores[j * QT + r];
        const float* v = v_rows + j * v_stride;
        for (int64_t x = 0; x < dvp; ++x) o[x] += pj * v[x];
      }
    }
  }

  // One division per row; a row with no visible key is zeros with LSE -inf.
  static void write_rows(const mha_kernel_problem& p, const mha_work_item& item, const Tile& t,
                         int64_t h, int64_t q0, int64_t nq, const ScoreUnits& units) {
    const int64_t dvp = round_up(p.dv, W);
    for (int64_t r = 0; r < nq; ++r) {
      const float sum = t.row_sum[r];
      const bool empty = sum == 0.0f;
      const float inv = empty ? 0.0f : 1.0f / sum;
      const int64_t row_h = h - item.h_begin, row_i = q0 + r - item.q_begin;
      float* out = item.out + row_h * item.out_strides[0] + row_i * item.out_strides[1];
      const float* acc = t.acc + r * dvp;
      if (empty) {
        for (int64_t x = 0; x < p.dv; ++x) out[x * item.out_strides[2]] = 0.0f;
      } else if (item.out_strides[2] == 1) {
        int64_t x = 0;
        for (; x + W <= p.dv; x += W) (B::load_aligned(acc + x) * B(inv)).store_unaligned(out + x);
        for (; x < p.dv; ++x) out[x] = acc[x] * inv;
      } else {
        for (int64_t x = 0; x < p.dv; ++x) out[x * item.out_strides[2]] = acc[x] * inv;
      }
      if (item.lse != nullptr) {
        item.lse[row_h * item.lse_strides[0] + row_i * item.lse_strides[1]] =
            empty ? kNegInf : units.lse(t.row_max[r], sum);
      }
    }
  }
};

}  // namespace mha_simd
