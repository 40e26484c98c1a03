// The backward pass (plugin_abi.h, ABI 8): FlashAttention-2's algorithm.
//
// An item is one KV head's group of query heads over a range of keys.  For
// each block of BK keys (K, Kᵀ and Vᵀ packed once), every query tile of the
// group's heads that sees one of them runs the five products of the
// backward, each a call of the one register-blocked micro-kernel
// (gemm_tile.hpp) on tiles in scratch:
//   S  = Q·Kᵀ            (recomputed; P = e^(logit(S) - LSE), no reduction)
//   dP = dO·Vᵀ
//   dS = P ∘ (dP ∘ Z - delta) · d(logit)/dS     (the epilogue, one row at a time;
//                                                Z the dropout factors)
//   dV += (P ∘ Z)ᵀ·dO,   dK += dSᵀ·Q     (the block's, in scratch over the item)
//   dQ += dS·K           (added to the item's dq rows)
// Scores have the keys along the vector lanes: a row's LSE and delta are
// scalars, so the epilogue needs no horizontal operation.  BF16 and F16 Q,
// K, V and dO are widened to fp32 as they are packed (convert.hpp, the dtype
// a template parameter of the load); the products, the epilogue and every
// output are fp32 (the runtime rounds half-precision gradients).  Every sum has a
// fixed order (key blocks, heads, query tiles as listed): the same bits on
// any number of threads.
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/backward_rules.h"
#include "common/dropout.h"
#include "common/problem.h"
#include "simd/blocking.hpp"
#include "simd/convert.hpp"
#include "simd/dropout_simd.hpp"
#include "simd/exp2.hpp"
#include "simd/gemm_tile.hpp"
#include "simd/score_variants.hpp"

namespace mha_simd {

template <class Arch>
class BackwardKernel {
  using V = xsimd::batch<float, Arch>;
  using U = xsimd::batch<uint32_t, Arch>;
  static constexpr int W = static_cast<int>(V::size);
  using Blk = Blocking<Arch>;
  static constexpr int64_t BQ = Blk::kBackwardQueryTile;
  static constexpr int64_t BK = Blk::kBackwardKeyBlock;
  static_assert(BK % W == 0 && BK % 16 == 0, "a key block is whole vectors");
  template <bool kAccumulate>
  using Product = Gemm<Arch, Blk::kGemmRows, Blk::kGemmVectors, kAccumulate>;
  static constexpr float kLog2e = 1.4426950408889634f;
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  static int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

  // Scratch, in floats (every region a multiple of 16: 64-byte aligned).
  struct Tiles {
    int64_t dp_, dvp;  // D and Dv rounded up to 16
    float* k;          // [BK][dp_]   the key block's rows
    float* kt;         // [dp_][BK]   its transpose
    float* vt;         // [dvp][BK]   V's transpose
    float* q;          // [BQ][dp_]   the query tile's rows
    float* dout;       // [BQ][dvp]   and its dO rows
    float* s;          // [BQ][BK]    scores, then P ∘ Z
    float* ds;         // [BQ][BK]    dP, then dS (times d logit / d score)
    float* dk;         // [BK][dp_]   the block's dK over the item
    float* dv;         // [BK][dvp]   and dV
    float* dq;         // [BQ][dp_]   the tile's dQ share of the block
    float* row;        // [BK]        a row's mask additions
  };

  static Tiles carve(const mha_kernel_problem& p, void* scratch) {
    Tiles t{};
    t.dp_ = padded(p.d);
    t.dvp = padded(p.dv);
    float* f = static_cast<float*>(scratch);
    auto take = [&f](int64_t n) {
      float* at = f;
      f += n;
      return at;
    };
    t.k = take(BK * t.dp_);
    t.kt = take(t.dp_ * BK);
    t.vt = take(t.dvp * BK);
    t.q = take(BQ * t.dp_);
    t.dout = take(BQ * t.dvp);
    t.s = take(BQ * BK);
    t.ds = take(BQ * BK);
    t.dk = take(BK * t.dp_);
    t.dv = take(BK * t.dvp);
    t.dq = take(BQ * t.dp_);
    t.row = take(BK);
    return t;
  }

 public:
  static size_t scratch_bytes(const mha_backward_problem& bp) {
    const mha_kernel_problem& p = *bp.forward;
    const int64_t dp_ = padded(p.d), dvp = padded(p.dv);
    const int64_t floats = BK * dp_ * 3 + dvp * BK * 2 + BQ * (2 * dp_ + dvp) + 2 * BQ * BK + BK;
    return static_cast<size_t>(floats) * sizeof(float);
  }

  static void run(const mha_backward_problem& bp, const mha_backward_item& item, void* scratch) {
    const mha_kernel_problem& p = *bp.forward;
    const Tiles t = carve(p, scratch);
    const int64_t group = p.heads / p.kv_heads;
    const int64_t h0 = item.kv_head * group;
    for (int64_t j0 = item.k_begin; j0 < item.k_end; j0 += BK) {
      const int64_t n = std::min(item.k_end - j0, BK);
      pack_keys(p, item, j0, n, t);
      std::fill_n(t.dk, BK * t.dp_, 0.0f);
      std::fill_n(t.dv, BK * t.dvp, 0.0f);
      const mha_backward::QueryRange queries = mha_backward::queries_seeing(p, j0, j0 + n);
      for (int64_t h = h0; h < h0 + group; ++h) {
        if (item.dmask != nullptr) clear_dmask(p, item, h - h0, j0, n, queries);
        for (int64_t q0 = queries.first / BQ * BQ; q0 <= queries.last; q0 += BQ) {
          const int64_t first = std::max(q0, queries.first);
          const int64_t nq = std::min(queries.last + 1, q0 + BQ) - first;
          tile(bp, item, h, h - h0, first, nq, j0, n, t);
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        float* dk = item.dk + (j0 - item.k_begin + r) * item.dk_strides[0];
        float* dv = item.dv + (j0 - item.k_begin + r) * item.dv_strides[0];
        for (int64_t x = 0; x < p.d; ++x) dk[x * item.dk_strides[1]] = t.dk[r * t.dp_ + x];
        for (int64_t x = 0; x < p.dv; ++x) dv[x * item.dv_strides[1]] = t.dv[r * t.dvp + x];
      }
    }
  }

 private:
  // K's rows, Kᵀ and Vᵀ of keys [j0, j0 + n); key columns past n are zeros.
  // V's rows are widened into the block's dV tile first (zeroed after this,
  // before the products): it holds exactly [BK][dvp].
  static void pack_keys(const mha_kernel_problem& p, const mha_backward_item& item, int64_t j0,
                        int64_t n, const Tiles& t) {
    std::fill_n(t.kt, t.dp_ * BK, 0.0f);
    std::fill_n(t.vt, t.dvp * BK, 0.0f);
    widen_key_rows(p, p.k, p.k_strides, item, j0, n, p.d, t.k, t.dp_);
    widen_key_rows(p, p.v, p.v_strides, item, j0, n, p.dv, t.dv, t.dvp);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t x = 0; x < p.d; ++x) t.kt[x * BK + r] = t.k[r * t.dp_ + x];
      for (int64_t x = 0; x < p.dv; ++x) t.vt[x * BK + r] = t.dv[r * t.dvp + x];
    }
  }

  // Rows of keys [j0, j0 + n) of K or V (data, strides), `cols` elements
  // each, widened to fp32 rows of `padded` floats (the padding zeroed).
  static void widen_key_rows(const mha_kernel_problem& p, const void* data, const int64_t* strides,
                             const mha_backward_item& item, int64_t j0, int64_t n, int64_t cols,
                             float* dst, int64_t padded) {
    mha_kernel::for_each_kv_run(p, j0, n, [&](int64_t t0, int64_t m) {
      const int64_t first = mha_kernel::kv_offset(p, strides, item.b, item.kv_head, j0 + t0);
      with_dtype(p.kv_dtype, [&](auto kv) {
        constexpr int32_t kKv = decltype(kv)::value;
        widen_rows<Arch, kKv>(static_cast<const element_t<kKv>*>(data) + first, strides[2],
                              strides[3], m, cols, nullptr, 0, dst + t0 * padded, padded);
      });
    });
  }

  // Rows [i0, i0 + n) of head h of Q or dO (data of `dtype`, strides),
  // widened likewise.
  static void widen_query_rows(const void* data, int32_t dtype, const int64_t* strides, int64_t b,
                               int64_t h, int64_t i0, int64_t n, int64_t cols, float* dst,
                               int64_t padded) {
    const int64_t first = b * strides[0] + h * strides[1] + i0 * strides[2];
    with_dtype(dtype, [&](auto dt) {
      constexpr int32_t kDt = decltype(dt)::value;
      widen_rows<Arch, kDt>(static_cast<const element_t<kDt>*>(data) + first, strides[2],
                            strides[3], n, cols, nullptr, 0, dst, padded);
    });
  }

  // dmask of every query of head (h0 + hl) and keys [j0, j0 + n) that the
  // tiles below do not write: zeros outside the causal / window range.
  static void clear_dmask(const mha_kernel_problem& p, const mha_backward_item& item, int64_t hl,
                          int64_t j0, int64_t n, const mha_backward::QueryRange& queries) {
    for (int64_t i = 0; i < p.lq; ++i) {
      if (i >= queries.first && i <= queries.last) continue;
      float* row = item.dmask + hl * item.dmask_strides[0] + i * item.dmask_strides[1] +
                   (j0 - item.k_begin) * item.dmask_strides[2];
      for (int64_t r = 0; r < n; ++r) row[r * item.dmask_strides[2]] = 0.0f;
    }
  }

  // One query tile [q0, q0 + nq) of head h against the key block.
  static void tile(const mha_backward_problem& bp, const mha_backward_item& item, int64_t h,
                   int64_t hl, int64_t q0, int64_t nq, int64_t j0, int64_t n, const Tiles& t) {
    const mha_kernel_problem& p = *bp.forward;
    const int64_t b = item.b;
    widen_query_rows(p.q, p.q_dtype, p.q_strides, b, h, q0, nq, p.d, t.q, t.dp_);
    widen_query_rows(bp.dout, bp.dout_dtype, bp.dout_strides, b, h, q0, nq, p.dv, t.dout, t.dvp);
    // S = Q·Kᵀ and dP = dO·Vᵀ, whole key blocks (columns past n are 0).
    Product<false>::run(nq, BK, p.d, t.q, t.dp_, 1, t.kt, BK, t.s, BK);
    Product<false>::run(nq, BK, p.dv, t.dout, t.dvp, 1, t.vt, BK, t.ds, BK);
    bool any = false;
    for (int64_t r = 0; r < nq; ++r) any = epilogue(bp, item, h, hl, q0 + r, j0, n, t, r) || any;
    if (!any) return;
    // dV += (P ∘ Z)ᵀ·dO and dK += dSᵀ·Q over the tile's queries; dQ = dS·K.
    Product<true>::run(n, t.dvp, nq, t.s, 1, BK, t.dout, t.dvp, t.dv, t.dvp);
    Product<true>::run(n, t.dp_, nq, t.ds, 1, BK, t.q, t.dp_, t.dk, t.dp_);
    Product<false>::run(nq, t.dp_, n, t.ds, BK, 1, t.k, t.dp_, t.dq, t.dp_);
    for (int64_t r = 0; r < nq; ++r) {
      float* dq = item.dq + hl * item.dq_strides[0] + (q0 + r) * item.dq_strides[1];
      const float* share = t.dq + r * t.dp_;
      for (int64_t x = 0; x < p.d; ++x) dq[x * item.dq_strides[2]] += share[x];
    }
  }

  // 1 - tanh²(y), tanh(y) = th: directly where th is far from ±1, else as
  // 4e / (1 + e)² with e = e^(-2|y|), which keeps its relative accuracy where
  // 1 - th² would cancel to fp32's resolution (a saturated softcap's
  // gradient is then tiny, not 2^-23).
  static V sech2(V y, V th) {
    const V e = fast_exp2<Arch>(xsimd::abs(y) * V(-2.0f * kLog2e));
    const V one_plus = V(1.0f) + e;
    return xsimd::select(xsimd::abs(y) < V(0.625f), V(1.0f) - th * th,
                         V(4.0f) * e / (one_plus * one_plus));
  }

  // Row r (query i) of the tile: s <- P ∘ Z, ds <- dS · d(logit)/d(score),
  // both 0 where the key does not take part.  Returns whether any key did.
  static bool epilogue(const mha_backward_problem& bp, const mha_backward_item& item, int64_t h,
                       int64_t hl, int64_t i, int64_t j0, int64_t n, const Tiles& t, int64_t r) {
    const mha_kernel_problem& p = *bp.forward;
    const int64_t b = item.b;
    float* s = t.s + r * BK;
    float* ds = t.ds + r * BK;
    float* dmask = item.dmask == nullptr
                       ? nullptr
                       : item.dmask + hl * item.dmask_strides[0] + i * item.dmask_strides[1] +
                             (j0 - item.k_begin) * item.dmask_strides[2];
    const mha_backward::KeyRange keys = mha_backward::visible_in_block(p, b, i, j0, j0 + n);
    const float lse = bp.lse[b * bp.lse_strides[0] + h * bp.lse_strides[1] + i * bp.lse_strides[2]];
    if (keys.empty() || lse == kNegInf) {
      std::fill_n(s, BK, 0.0f);
      std::fill_n(ds, BK, 0.0f);
      if (dmask != nullptr) {
        for (int64_t c = 0; c < n; ++c) dmask[c * item.dmask_strides[2]] = 0.0f;
      }
      return false;
    }
    const float delta =
        bp.delta[b * bp.delta_strides[0] + h * bp.delta_strides[1] + i * bp.delta_strides[2]];
    // The mask's additions (-inf: the key does not take part), as a row.
    const bool masked = p.mask != nullptr;
    if (masked) {
      const int64_t at = mha_kernel::mask_row_offset(p, b, h, i);
      for (int64_t c = 0; c < n; ++c) {
        const int64_t e = at + (j0 + c) * p.mask_strides[3];
        t.row[c] = p.mask_kind == MHA_MASK_BOOL
                       ? (static_cast<const uint8_t*>(p.mask)[e] != 0 ? 0.0f : kNegInf)
                       : mha_kernel::mask_value(p, e);
      }
      std::fill(t.row + n, t.row + BK, 0.0f);
    }
    const bool capped = p.softcap > 0.0f;
    const V cap(p.softcap), inv_cap(capped ? 1.0f / p.softcap : 0.0f), scale(p.scale);
    const float slope = mha_kernel::alibi_slope(p, b, h);
    const bool alibi = p.alibi_slopes != nullptr;
    // ALiBi's distance |i + Lk - Lq - j| as (i + Lk - Lq - j0) - lane.
    const float alibi_base = static_cast<float>(i + p.alibi_diag - j0);
    const bool dropout = p.dropout_p > 0.0f;
    const DropoutFactor<Arch> factor(dropout ? p.dropout_p : 0.0f);
    const uint32_t row_key = dropout ? mha_kernel::dropout_row_key(p, b, h, i) : 0;
    alignas(64) float lane_index[W];
    alignas(64) uint32_t lane_steps[W];
    for (int l = 0; l < W; ++l) {
      lane_index[l] = static_cast<float>(l);
      lane_steps[l] = static_cast<uint32_t>(l) * mha_dropout::kKeyStep;
    }
    const V lanes = V::load_aligned(lane_index);
    const U key_steps = U::load_aligned(lane_steps);
    // Keys [lo, hi] of the block take part, as offsets from j0.
    const V lo(static_cast<float>(keys.lo - j0)), hi(static_cast<float>(keys.hi - j0));
    const V lse_v(lse), delta_v(delta);
    for (int64_t c = 0; c < BK; c += W) {
      const V col = lanes + V(static_cast<float>(c));
      V x = V::load_aligned(s + c) * scale;
      V dslope = scale;
      if (capped) {
        const V y = x * inv_cap;
        const V th = fast_tanh<Arch>(y);
        x = cap * th;
        dslope = scale * sech2(y, th);
      }
      if (alibi) x -= V(slope) * xsimd::abs(V(alibi_base) - col);
      if (masked) x += V::load_aligned(t.row + c);
      x = xsimd::select((col < lo) || (col > hi), V(kNegInf), x);
      const V prob = fast_exp2<Arch>((x - lse_v) * V(kLog2e));
      V z(1.0f);
      if (dropout) {
        z = factor(U(row_key + static_cast<uint32_t>(j0 + c) * mha_dropout::kKeyStep) + key_steps);
      }
      // A key whose weight is 0 (masked) takes no part: NaN in its V row
      // must not leak in through 0 · NaN.
      const V grad =
          xsimd::select(prob != V(0.0f), prob * (V::load_aligned(ds + c) * z - delta_v), V(0.0f));
      if (dmask != nullptr) {
        alignas(64) float lanes_out[W];
        grad.store_aligned(lanes_out);
        for (int l = 0; l < W && c + l < n; ++l)
          dmask[(c + l) * item.dmask_strides[2]] = lanes_out[l];
      }
      (prob * z).store_aligned(s + c);
      (grad * dslope).store_aligned(ds + c);
    }
    return true;
  }
};

}  // namespace mha_simd
