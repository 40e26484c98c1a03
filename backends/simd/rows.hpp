// The rows layout: tiny problems, one query row at a time, vector lanes along
// the keys.
//
// With at most mha_kernel::kRowsMaxKeys keys (and a few queries) -- the d2l.ai
// example, S5 -- the arithmetic is a few hundred FMAs a head and what a call
// costs is the per-row and per-tile state of the other layouts.  Here an item
// holds several heads of one batch; each query's limits are worked out once
// for all of them; each KV head's K is transposed (one register of keys per
// head-dimension index) and its V rows copied, zero-padded, once for all its
// query rows.  A row is then D broadcast FMAs (on AVX2, for half a vector
// of keys or fewer, a dot product with each key's row instead, K left as it
// is), one vector softmax with no running state (all keys fit one tile), and
// P·V over the keys it sees.
//
// The careful cases -- a row whose result came out non-finite, or that has
// keys but no weight (logits that overflowed, a mask of -inf on every key,
// NaN or infinities in a removed key's V row) -- send the whole head through
// the prefill kernel, which handles them (raw units, guarded P·V).
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "common/dtype.h"
#include "common/problem.h"
#include "simd/convert.hpp"
#include "simd/epilogue.hpp"
#include "simd/masking.hpp"
#include "simd/prefill.hpp"
#include "simd/row_kernels.hpp"
#include "simd/score_variants.hpp"
#include "simd/softmax.hpp"
#include "simd/tile_tools.hpp"
#include "simd/transpose.hpp"

namespace mha_simd {

// An ISA's half-width vectors, where it has them (AVX-512: AVX2's 8 lanes;
// void elsewhere).
template <class Arch, class = void>
struct HalfWidth {
  using type = void;
};
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
template <class Arch>
struct HalfWidth<Arch, std::enable_if_t<std::is_base_of<xsimd::avx512f, Arch>::value>> {
  using type = xsimd::fma3<xsimd::avx2>;
};
#endif

template <class Arch, bool kBf16Dot = false>
class RowsKernel {
  using B = xsimd::batch<float, Arch>;
  static constexpr int W = static_cast<int>(B::size);
  static constexpr int kKeys = static_cast<int>(mha_kernel::kRowsMaxKeys);
  static constexpr int KV = kKeys / W;  // vectors of keys: 1 (AVX-512), 2 (AVX2), 4 (NEON)
  using Half = typename HalfWidth<Arch>::type;
  static_assert(kKeys % W == 0, "the key tile is whole vectors");
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // Rows whose scores are computed together (each K vector loaded once for
  // them, independent FMA chains).
  static constexpr int kRowBlock = 4;
  // Whether the scores take dot products along the head dimension
  // (score_rows_dot, no transposition of K): where the ISA says so, for at
  // most half a vector of keys, which a transposed K would carry in lanes
  // mostly idle.  AVX2 (Zen 3, family 25 model 1), in-process A/B against
  // the transposed K (`mha_ab_builds`, 11-15 rounds, both orders): S5 (three
  // keys, D 20) 0.86-0.95 and 1/1.07-1/1.09 of the time, callgrind 18.6 k
  // instructions a call against 21.5 k; four queries of four keys at D 64
  // 0.87 and 1/1.15; three keys at D 128 0.67 and 1/1.53; four keys of a KV
  // head shared by eight query heads at D 128 0.81 and 1/1.22.  Not past
  // half a vector: eight such keys took 1.14 and 1/0.88 (eight query heads
  // share one transposition), eight keys at D 64 without groups 1.00.
  static bool dot_scores(int keys) { return Blocking<Arch>::kRowsDotScores && keys <= W / 2; }
  // A plain row (fp32 output with unit stride, no LSE, no sink) of at most
  // this many vectors of Dv goes from its P·V sums in registers straight to
  // the output (values_out).
  static constexpr int kPlainVectors = 4;
  // Lane l's key index, as a float (the limits are compared in floats).
  alignas(64) static constexpr float kLaneIndex[16] = {0, 1, 2,  3,  4,  5,  6,  7,
                                                       8, 9, 10, 11, 12, 13, 14, 15};
  static_assert(kKeys == 16, "kLaneIndex holds one index per key of the tile");

  struct Scratch {
    float* kt;       // [Dp][kKeys]: K transposed, lane l = key kb + l (zero past the keys)
    float* v;        // [kKeys][Dvp]: V rows, zero-padded
    float* q;        // [kRowBlock][D]: query rows widened (not fp32 with unit stride)
    float* stage;    // [kKeys][Dp]: K rows widened (not fp32 in place), zero-padded
    float* s;        // [kRowBlock][kKeys]: rows' scores, then their probabilities
    float* acc;      // [Dvp]: a row's unnormalised output
    int64_t* first;  // [Lq]: each query's first visible key
    int64_t* last;   // [Lq]: its last
    void* prefill;   // the careful path's scratch
  };

  // K's rows for score_rows_dot: in place, or widened into Scratch::stage.
  struct KeyRows {
    const float* first;
    int64_t stride;
  };

  static int64_t dvp_of(const mha_kernel_problem& p) { return round_up(p.dv, W); }

 public:
  static size_t scratch_bytes(const mha_kernel_problem& p) {
    const int64_t dvp = dvp_of(p);
    const int64_t dp = round_up(p.d, W);
    return ScratchCarver::bytes({dp * kKeys, kKeys * dvp, kRowBlock * p.d, kKeys * dp,
                                 kRowBlock * kKeys, dvp, 2 * p.lq, 2 * p.lq}) +
           PrefillKernel<Arch, kBf16Dot>::scratch_bytes(p);
  }

  static void run(const mha_kernel_problem& p, const mha_work_item& item, void* scratch) {
    const int64_t dvp = dvp_of(p);
    ScratchCarver carve(scratch);
    Scratch t{};
    const int64_t dp = round_up(p.d, W);
    t.kt = carve.floats(dp * kKeys);
    t.v = carve.floats(kKeys * dvp);
    t.q = carve.floats(kRowBlock * p.d);
    t.stage = carve.floats(kKeys * dp);
    t.s = carve.floats(kRowBlock * kKeys);
    t.acc = carve.floats(dvp);
    t.first = reinterpret_cast<int64_t*>(carve.floats(2 * p.lq));
    t.last = reinterpret_cast<int64_t*>(carve.floats(2 * p.lq));
    t.prefill = carve.floats(0);

    // Each query's limits (causal, window, valid length) do not depend on
    // the head: once per item.  [kb, ke) are the keys some query sees.
    const int64_t nq = item.q_end - item.q_begin;
    int64_t kb = item.k_end, ke = item.k_begin;
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t i = item.q_begin + r;
      t.first[r] = std::max(mha_kernel::first_visible_key(p, i), item.k_begin);
      t.last[r] = std::min(mha_kernel::last_visible_key(p, item.b, i), item.k_end - 1);
      if (t.first[r] <= t.last[r]) {
        kb = std::min(kb, t.first[r]);
        ke = std::max(ke, t.last[r] + 1);
      }
    }
    const int keys = static_cast<int>(std::max<int64_t>(0, ke - kb));

    if constexpr (!std::is_void<Half>::value) {
      if (keys <= W / 2) {  // transpose_keys fills only the first half of each kt row
        for (int64_t x = 0; x < dp; ++x) B(0.0f).store_aligned(t.kt + x * kKeys);
      }
    }
    // Each query head's KV head counted along, not divided out per head (two
    // 64-bit divisions a head were about 1 % of S5).
    const int64_t group = p.heads / p.kv_heads;
    with_key_vectors(keys, [&](auto vectors) {
      constexpr int NKV = decltype(vectors)::value;
      int64_t kvh = item.h_begin / group, next_kvh_at = item.h_begin;
      KeyRows k_rows{t.stage, dp};
      for (int64_t h = item.h_begin; h < item.h_end; ++h) {
        if (h == next_kvh_at) {  // a KV head's first query head in the item
          if (h != item.h_begin) ++kvh;
          next_kvh_at = (kvh + 1) * group;
          if (keys > 0) k_rows = load_kv<NKV>(p, t, item.b, kvh, kb, keys, dvp);
        }
        if (!head_rows<NKV>(p, item, t, k_rows, h, kb, keys, dvp)) careful_head(p, item, t, h);
      }
    });
  }

 private:
  // Calls f(std::integral_constant<int, n>{}) with the fewest vectors n (1,
  // 2 or 4, at most KV) that hold `keys` lanes: the rows compute only those.
  template <class F>
  static void with_key_vectors(int keys, F&& f) {
    if constexpr (KV >= 4) {
      if (keys > 2 * W) return f(std::integral_constant<int, 4>{});
    }
    if constexpr (KV >= 2) {
      if (keys > W) return f(std::integral_constant<int, 2>{});
    }
    f(std::integral_constant<int, 1>{});
  }

  // K of keys kb .. kb + keys transposed into t.kt (or, for dot products,
  // dot_scores, left as rows: where they are returned), V copied into t.v,
  // both fp32 whatever their dtype (an int8 row times its scale).  fp32 rows
  // with unit column stride outside a paged cache are read in place; the
  // others are widened first (K into t.stage).
  template <int NKV>
  static KeyRows load_kv(const mha_kernel_problem& p, const Scratch& t, int64_t b, int64_t kvh,
                         int64_t kb, int keys, int64_t dvp) {
    const bool transpose = NKV > 1 || !dot_scores(keys);
    const int64_t dp = round_up(p.d, W);
    const bool in_place = p.kv_dtype == MHA_DTYPE_F32 && p.block_table == nullptr;
    KeyRows k_rows{t.stage, dp};
    if (in_place && p.k_strides[3] == 1) {
      k_rows = {mha_kernel::k_row(p, b, kvh, kb), p.k_strides[2]};
      if (transpose) transpose_keys<NKV>(k_rows.first, k_rows.stride, keys, p.d, t.kt);
    } else {
      for (int jj = 0; jj < keys; ++jj) {
        widen_kv_row(p, p.k, p.k_strides, p.k_scale, p.k_scale_strides, p.d, b, kvh, kb + jj,
                     t.stage + jj * dp);
      }
      if (transpose) transpose_keys<NKV>(t.stage, dp, keys, p.d, t.kt);
    }
    if (in_place && p.v_strides[3] == 1) {
      const float* v = mha_kernel::v_row(p, b, kvh, kb);
      for (int jj = 0; jj < keys; ++jj) copy_row(v + jj * p.v_strides[2], p.dv, t.v + jj * dvp);
    } else {
      for (int jj = 0; jj < keys; ++jj) {
        float* v = t.v + jj * dvp;
        B(0.0f).store_aligned(v + dvp - W);  // the padding
        widen_kv_row(p, p.v, p.v_strides, p.v_scale, p.v_scale_strides, p.dv, b, kvh, kb + jj, v);
      }
    }
    return k_rows;
  }

  // Row j of (b, kvh) of K or V (n values) widened to fp32 at dst.
  static void widen_kv_row(const mha_kernel_problem& p, const void* data, const int64_t* strides,
                           const float* scales, const int64_t* scale_strides, int64_t n, int64_t b,
                           int64_t kvh, int64_t j, float* dst) {
    const float scale =
        scales == nullptr ? 1.0f : scales[mha_kernel::kv_offset(p, scale_strides, b, kvh, j)];
    mha_kernel::widen_row(data, p.kv_dtype, mha_kernel::kv_offset(p, strides, b, kvh, j),
                          strides[3], n, scale, dst);
  }

  // n floats from src to dst, zero-padded to whole vectors: tile_tools.hpp's
  // pack_rows in vectors, the tail by a masked load (pack_rows' scalar loops
  // cost S5 5 % more instructions).
  static void copy_row(const float* src, int64_t n, float* dst) {
    int64_t x = 0;
    for (; x + W <= n; x += W) B::load_unaligned(src + x).store_aligned(dst + x);
    if (x < n) load_partial<Arch>(src + x, static_cast<int>(n - x)).store_aligned(dst + x);
  }

  // kt[x][l] = row l's element x (rows `stride` floats apart, `keys` of
  // them, d elements each) for NKV vectors of lanes; lanes past `keys` get 0.
  // At most half a vector of keys on an ISA with half-width vectors
  // (AVX-512: S5's 6 keys) is transposed in those, into the first half of
  // each kt row: half the shuffles (run() zeroes the other half).
  template <int NKV>
  static void transpose_keys(const float* rows, int64_t stride, int keys, int64_t d, float* kt) {
    if constexpr (NKV == 1 && !std::is_void<Half>::value) {
      if (keys <= W / 2) return transpose_lanes<Half, 1>(rows, stride, keys, d, kt);
    }
    transpose_lanes<Arch, NKV>(rows, stride, keys, d, kt);
  }

  // transpose_keys in vectors of TArch, TW x TW blocks at a time through the
  // register transpose.
  template <class TArch, int NV>
  static void transpose_lanes(const float* rows, int64_t stride, int keys, int64_t d, float* kt) {
    using TB = xsimd::batch<float, TArch>;
    constexpr int TW = static_cast<int>(TB::size);
    for (int v = 0; v < NV; ++v) {
      for (int64_t x0 = 0; x0 < d; x0 += TW) {
        const int n = static_cast<int>(std::min<int64_t>(TW, d - x0));
        TB block[TW];
        for (int l = 0; l < TW; ++l) {
          const int jj = v * TW + l;
          const float* row = rows + jj * stride + x0;
          block[l] = jj >= keys ? TB(0.0f)
                                : (n == TW ? TB::load_unaligned(row) : load_partial<TArch>(row, n));
        }
        transpose_square<TArch>(block);
        for (int l = 0; l < TW; ++l) block[l].store_unaligned(kt + (x0 + l) * kKeys + v * TW);
      }
    }
  }

  // What every row of a head shares.
  struct HeadRows {
    int64_t h, row_h;
    int64_t kb;
    int keys;
    int64_t dvp;
    ScoreUnits units;
    float sink;
    bool plain;  // fp32 output with unit stride, no LSE, no sink: straight to write_row
    bool variants, dropout;
  };

  // The rows of head h, in blocks of up to kRowBlock whose scores are
  // computed together; false (the head's rows left to the careful path) as
  // soon as one of them needs it.
  template <int NKV>
  static bool head_rows(const mha_kernel_problem& p, const mha_work_item& item, const Scratch& t,
                        const KeyRows& k_rows, int64_t h, int64_t kb, int keys, int64_t dvp) {
    HeadRows head{};
    head.h = h;
    head.row_h = h - item.h_begin;
    head.kb = kb;
    head.keys = keys;
    head.dvp = dvp;
    head.units = ScoreUnits::base2(p.scale);
    head.sink = mha_kernel::sink_logit(p, h);
    head.plain = plain_output_rows(item, head.sink);
    head.variants = mha_kernel::has_score_variants(p);
    head.dropout = p.dropout_p > 0.0f;
    const bool q_in_place = p.q_dtype == MHA_DTYPE_F32 && p.q_strides[3] == 1;
    const int64_t nq = item.q_end - item.q_begin;
    for (int64_t r0 = 0; r0 < nq;) {
      bool ok = true;
      const int n = with_block_of<kRowBlock>(
          static_cast<int>(std::min<int64_t>(kRowBlock, nq - r0)), [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            const float* q[R];
            for (int r = 0; r < R; ++r) {
              const int64_t q_at = item.b * p.q_strides[0] + h * p.q_strides[1] +
                                   (item.q_begin + r0 + r) * p.q_strides[2];
              q[r] = static_cast<const float*>(p.q) + q_at;
              if (!q_in_place) {
                mha_kernel::widen_row(p.q, p.q_dtype, q_at, p.q_strides[3], p.d, 1.0f,
                                      t.q + r * p.d);
                q[r] = t.q + r * p.d;
              }
            }
            scores_of<NKV, R>(q, t, k_rows, keys, p.d, head.units.q_factor);
            ok = finish_rows<NKV, R>(p, item, t, head, r0);
          });
      if (!ok) return false;
      r0 += n;
    }
    return true;
  }

  // Rows r0 .. r0 + R of the item (their scores at t.s, times
  // scale·log2(e)): the variants, the mask, the limits, the softmax, P·V and
  // the output.  The rows' softmaxes are interleaved, so that their chains of
  // dependent operations (maximum, exp, sum) overlap: one row alone is bound
  // by their latency.  False when a row needs the careful path: keys but no
  // weight, or a result that is not finite.
  template <int NKV, int R>
  __attribute__((always_inline)) static bool finish_rows(const mha_kernel_problem& p,
                                                         const mha_work_item& item,
                                                         const Scratch& t, const HeadRows& head,
                                                         int64_t r0) {
    int64_t lo[R], hi[R];  // each row's keys [lo, hi] of the tile (none: lo > hi)
    for (int r = 0; r < R; ++r) {
      lo[r] = t.first[r0 + r] - head.kb;
      hi[r] = t.last[r0 + r] - head.kb;
      float* s = t.s + r * kKeys;
      const int64_t i = item.q_begin + r0 + r;
      if (lo[r] <= hi[r] && head.variants) {
        apply_score_variants_row<Arch>(p, s, item.b, head.h, i, head.kb, head.keys, head.units);
      }
      if (lo[r] <= hi[r] && p.mask_kind != MHA_MASK_NONE) {
        apply_mask_row(p, item.b, head.h, i, head.kb, head.keys, s, head.units);
      }
    }
    // The limits last: a key outside them takes no part whatever the mask or
    // the variants gave it.  (A row without keys is all -inf here; its
    // results are not used.)
    float max[R], sum[R];
    for (int r = 0; r < R; ++r) {
      float* s = t.s + r * kKeys;
      const B first(static_cast<float>(lo[r])), last(static_cast<float>(hi[r]));
      B tile_max(kNegInf);
      for (int v = 0; v < NKV; ++v) {
        const B lane = B::load_aligned(kLaneIndex + v * W);
        const B sv =
            xsimd::select(lane < first || lane > last, B(kNegInf), B::load_aligned(s + v * W));
        sv.store_aligned(s + v * W);
        tile_max = xsimd::max(tile_max, sv);
      }
      max[r] = horizontal_max<Arch>(tile_max);
    }
    for (int r = 0; r < R; ++r) {
      float* s = t.s + r * kKeys;
      B row_sum(0.0f);
      for (int v = 0; v < NKV; ++v) {
        const B e = fast_exp2<Arch>(B::load_aligned(s + v * W) - B(max[r]));
        e.store_aligned(s + v * W);
        row_sum += e;
      }
      sum[r] = xsimd::hadd(row_sum);
    }
    for (int r = 0; r < R; ++r) {
      float* s = t.s + r * kKeys;
      const int64_t row_i = r0 + r;
      if (lo[r] > hi[r]) {  // no key: zeros (and the sink's LSE, if any)
        for (int64_t x = 0; x < head.dvp; x += W) B(0.0f).store_aligned(t.acc + x);
        write_item_row<Arch>(item, head.row_h, row_i, t.acc, p.dv, kNegInf, 0.0f, head.sink,
                             head.units);
        continue;
      }
      if (head.dropout) {
        apply_dropout_row<Arch>(
            p.dropout_p, mha_kernel::dropout_row_key(p, item.b, head.h, item.q_begin + row_i),
            head.kb, NKV * W, s);
      }
      if (head.plain && head.dvp <= kPlainVectors * W) {
        float* out = static_cast<float*>(item.out) + head.row_h * item.out_strides[0] +
                     row_i * item.out_strides[1];
        bool written = false;
        with_count<kPlainVectors>(static_cast<int>(head.dvp / W), [&](auto width) {
          written = values_out<decltype(width)::value>(s, static_cast<int>(lo[r]),
                                                       static_cast<int>(hi[r]), t.v, head.dvp,
                                                       sum[r], p.dv, out);
        });
        if (!written) return false;
        continue;
      }
      const bool finite =
          values(s, static_cast<int>(lo[r]), static_cast<int>(hi[r]), t.v, head.dvp, t.acc);
      if (!finite || !(sum[r] > 0.0f) || !std::isfinite(sum[r])) return false;
      if (head.plain) {
        write_row<Arch>(t.acc, p.dv, 0.0f, sum[r], 1.0f,
                        static_cast<float*>(item.out) + head.row_h * item.out_strides[0] +
                            row_i * item.out_strides[1],
                        MHA_DTYPE_F32, 1, nullptr);
      } else {
        write_item_row<Arch>(item, head.row_h, row_i, t.acc, p.dv, max[r], sum[r], head.sink,
                             head.units);
      }
    }
    return true;
  }

  // s[r][l] = q_r · K[kb + l] · factor for R rows (s rows kKeys floats apart)
  // and NKV vectors of keys: D broadcasts of each q_r against the transposed
  // keys, each K vector loaded once for the R rows.  The head dimension is
  // split over two chains of FMAs where registers allow: one chain of D
  // dependent FMAs is the longest latency of a head at S5's D = 20 (S5 on
  // AVX2, in-process A/B: 0.97 of the time; AVX-512 unchanged, and four
  // chains made it 3 % slower there).
  template <int NKV, int R>
  static void score_rows(const float* const* q, const float* kt, int64_t d, float factor,
                         float* s) {
    constexpr int C = Blocking<Arch>::kDecodeAccumulators >= 2 * R * NKV ? 2 : 1;
    B acc[C][R][NKV];  // C x R x NKV independent chains (as many registers: AVX2 has 16)
    for (int c = 0; c < C; ++c) {
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < NKV; ++v) acc[c][r][v] = B(0.0f);
      }
    }
    const auto step = [&](int c, int64_t x) {
      B k[NKV];
      for (int v = 0; v < NKV; ++v) k[v] = B::load_aligned(kt + x * kKeys + v * W);
      for (int r = 0; r < R; ++r) {
        const B qr(q[r][x]);
        for (int v = 0; v < NKV; ++v) acc[c][r][v] = xsimd::fma(qr, k[v], acc[c][r][v]);
      }
    };
    int64_t x = 0;
    for (; x + C <= d; x += C) {
      for (int c = 0; c < C; ++c) step(c, x + c);
    }
    for (; x < d; ++x) step(0, x);
    for (int c = 1; c < C; ++c) {
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < NKV; ++v) acc[0][r][v] += acc[c][r][v];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < NKV; ++v) {
        (acc[0][r][v] * B(factor)).store_aligned(s + r * kKeys + v * W);
      }
    }
  }

  // The scores of R rows into t.s: dot products along the head dimension
  // (dot_scores) or against the transposed K.
  template <int NKV, int R>
  static void scores_of(const float* const* q, const Scratch& t, const KeyRows& k_rows, int keys,
                        int64_t d, float factor) {
    if constexpr (NKV == 1 && Blocking<Arch>::kRowsDotScores) {
      if (dot_scores(keys)) return score_rows_dot<R>(q, k_rows, keys, d, factor, t.s);
    }
    score_rows<NKV, R>(q, t.kt, d, factor, t.s);
  }

  // score_rows for keys that fit one vector, along the head dimension
  // instead (AVX2, Blocking::kRowsDotScores): s[r][l] = (q_r · K[l]) ·
  // factor, K's row l at k.first + l · k.stride.  Rows of d floats, each
  // one's last partial vector read masked (a row that ends at the end of the
  // caller's buffer is never read past).  Each K vector is loaded once for
  // the R rows; a key's R sums share one horizontal reduction, and the
  // lanes past the keys are 0.
  template <int R>
  static void score_rows_dot(const float* const* q, const KeyRows& k, int keys, int64_t d,
                             float factor, float* s) {
#if defined(__AVX2__)
    static_assert(W == 8 && R <= 4, "AVX2's 8 lanes, at most four rows");
    for (int r = 0; r < R; ++r) B(0.0f).store_aligned(s + r * kKeys);
    const int64_t whole = d / W * W;
    const int tail = static_cast<int>(d - whole);
    const __m128 scale = _mm_set1_ps(factor);
    for (int j = 0; j < keys; ++j) {
      const float* row = k.first + j * k.stride;
      B acc[4] = {B(0.0f), B(0.0f), B(0.0f), B(0.0f)};
      for (int64_t x = 0; x < whole; x += W) {
        const B kv = B::load_unaligned(row + x);
        for (int r = 0; r < R; ++r) acc[r] = xsimd::fma(B::load_unaligned(q[r] + x), kv, acc[r]);
      }
      if (tail > 0) {
        const B kv = load_partial<Arch>(row + whole, tail);
        for (int r = 0; r < R; ++r) {
          acc[r] = xsimd::fma(load_partial<Arch>(q[r] + whole, tail), kv, acc[r]);
        }
      }
      // Lane r of `sums`: row r's score (lanes 0+1, 2+3, their sum, then the
      // two halves).
      const __m256 pairs =
          _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m128 sums = _mm_mul_ps(
          _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)), scale);
      alignas(16) float lanes[4];
      _mm_store_ps(lanes, sums);
      for (int r = 0; r < R; ++r) s[r * kKeys + j] = lanes[r];
    }
#else
    static_cast<void>(q), static_cast<void>(k), static_cast<void>(keys), static_cast<void>(d),
        static_cast<void>(factor), static_cast<void>(s);
#endif
  }

  // acc = Σ_{j = lo..hi} p[j] · V[j]: Dv in blocks of up to 4 vectors held in
  // registers, the last block exactly as wide as what is left (one pass over
  // the keys per block).  Returns whether every value is finite (checked on
  // the registers).  Inlined into the row's epilogue (finish_rows), as that
  // is into the head's loop: S5 (40 rows a call) took 4.9 % fewer
  // instructions and 0.96-0.98 of the time (Zen 3, AVX2, in-process A/B).
  __attribute__((always_inline)) static bool values(const float* p, int lo, int hi, const float* v,
                                                    int64_t dvp, float* acc) {
    int64_t c0 = 0;
    bool finite = true;
    for (; dvp - c0 > 4 * W; c0 += 4 * W) finite &= values_block<4>(p, lo, hi, v, dvp, c0, acc);
    with_count<4>(static_cast<int>((dvp - c0) / W), [&](auto width) {
      finite &= values_block<decltype(width)::value>(p, lo, hi, v, dvp, c0, acc);
    });
    return finite;
  }

  // values() and write_row's plain case in one, for Dv of at most
  // kPlainVectors vectors: the row's sums stay in registers, multiplied by
  // 1 / sum on their way to out (fp32, unit stride) -- the same operations
  // as values() then write_row, so the same bits.  S5 (Dv 20) on AVX2,
  // callgrind: the rows 12.3 k instructions a call against 13.7 k.
  // Nothing is written, and false returned, when a sum is not finite or the
  // row has no weight (the careful path's cases).
  template <int N>
  __attribute__((always_inline)) static bool values_out(const float* p, int lo, int hi,
                                                        const float* v, int64_t dvp, float sum,
                                                        int64_t dv, float* out) {
    B a[N];
    const bool finite = sum_values<N>(p, lo, hi, v, dvp, 0, a);
    if (!finite || !(sum > 0.0f) || !std::isfinite(sum)) return false;
    const B inv(1.0f / sum);
    for (int c = 0; c < N; ++c) {
      if ((c + 1) * W <= dv) {
        (a[c] * inv).store_unaligned(out + c * W);
      } else {
        store_partial<Arch>(out + c * W, a[c] * inv, static_cast<int>(dv - c * W));
      }
    }
    return true;
  }

  template <int N>
  static bool values_block(const float* p, int lo, int hi, const float* v, int64_t dvp, int64_t c0,
                           float* acc) {
    B a[N];
    const bool finite = sum_values<N>(p, lo, hi, v, dvp, c0, a);
    for (int c = 0; c < N; ++c) a[c].store_aligned(acc + c0 + c * W);
    return finite;
  }

  // a[c] = Σ_{j = lo..hi} p[j] · V[j][c0 + c·W ...] for N vectors, in
  // registers; returns whether every value is finite.
  template <int N>
  __attribute__((always_inline)) static bool sum_values(const float* p, int lo, int hi,
                                                        const float* v, int64_t dvp, int64_t c0,
                                                        B* a) {
    for (int c = 0; c < N; ++c) a[c] = B(0.0f);
    for (int j = lo; j <= hi; ++j) {
      const B pj(p[j]);
      const float* row = v + j * dvp + c0;
      for (int c = 0; c < N; ++c) a[c] = xsimd::fma(pj, B::load_aligned(row + c * W), a[c]);
    }
    B poison(0.0f);  // a - a is 0 for finite a, NaN for NaN and infinities
    for (int c = 0; c < N; ++c) poison += a[c] - a[c];
    return xsimd::all(poison == poison);
  }

  // Head h through the prefill kernel, whose careful path handles what the
  // rows cannot.
  static void careful_head(const mha_kernel_problem& p, const mha_work_item& item, const Scratch& t,
                           int64_t h) {
    mha_work_item one = item;
    const int64_t row_h = h - item.h_begin;
    one.h_begin = h;
    one.h_end = h + 1;
    one.out = mha_types::element_at(item.out, item.out_dtype, row_h * item.out_strides[0]);
    if (item.lse != nullptr) one.lse = item.lse + row_h * item.lse_strides[0];
    PrefillKernel<Arch, kBf16Dot>::run(p, one, t.prefill);
  }
};

}  // namespace mha_simd
