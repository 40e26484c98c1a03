// The portable backend: tiled online-softmax attention in plain C++.
//
// For a block of query rows it walks the keys tile by tile, keeping each row's
// running maximum and sum, rescales the accumulator only when the maximum
// grows, and divides once at the end.  Memory does not grow with Lq·Lk, and
// keys past every row's causal / valid-length limit, or before every row's
// sliding-window start, are never visited.  It is
// the fallback on every CPU and the yardstick for the SIMD backends.
#include <mha/plugin_abi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "common/dropout.h"
#include "common/dtype.h"
#include "common/problem.h"
#include "common/softmax.h"
#include "scalar_backward.h"

// A test builds a copy that claims priority 1000 (the runtime must ignore it).
#ifndef MHA_SCALAR_PRIORITY
#define MHA_SCALAR_PRIORITY 0
#endif

namespace {

using mha_kernel::last_visible_key;

constexpr int64_t kRows = 16;  // query rows per block
constexpr int64_t kKeys = 64;  // keys per tile
constexpr float kNegInf = mha_softmax::kNegInf;

// The units of the scores.  Natural: Q is multiplied by the scale, a score is
// the logit.  A logit within the fp32 range can still make a row non-finite
// (a dot product of Q·scale that overflows on the way, a mask of -FLT_MAX
// on every key of a row), so a block whose output came out non-finite is
// computed again in raw units: Q times the scale's sign and min(|scale|, 1),
// a score is the logit divided by r = max(|scale|, 1), r is applied to its
// distance to the row maximum, and an additive mask, a softcap or an ALiBi
// slope joins divided by r (>= 1: it never overflows).  The same rule as the
// SIMD kernels' ScoreUnits (backends/simd/tile_tools.hpp).
struct Units {
  bool raw;
  float q_factor;
  float to_logit;  // raw units: a score times this is its logit
  float mask(float m) const { return raw ? m / to_logit : m; }
  float weight(float distance) const { return std::exp(raw ? distance * to_logit : distance); }
  float natural(float s) const { return raw ? s * to_logit : s; }
};

struct Workspace {
  float* q;                // [kRows][D], pre-scaled
  float* k_tile;           // [kKeys][D]: the key tile, widened to fp32 (int8: times its scales)
  float* v_tile;           // [kKeys][Dv]: the value tile, likewise
  float* scores;           // [kRows][kKeys]
  float* acc;              // [kRows][Dv]
  float* tile_acc;         // [Dv]: one row's sum over the current key tile
  mha_softmax::Row* rows;  // [kRows]: running maximum and sum
  int64_t* first;          // [kRows]: the row's first key (window, item)
  int64_t* last;           // [kRows]: its last key (causal, window, valid length, item)
  uint32_t* row_key;       // [kRows]: dropout hash of each row
};

Workspace carve(void* scratch, int64_t d, int64_t dv) {
  auto* f = static_cast<float*>(scratch);
  Workspace w{};
  w.q = f;
  w.k_tile = w.q + kRows * d;
  w.v_tile = w.k_tile + kKeys * d;
  w.scores = w.v_tile + kKeys * dv;
  w.acc = w.scores + kRows * kKeys;
  w.tile_acc = w.acc + kRows * dv;
  w.rows = reinterpret_cast<mha_softmax::Row*>(w.tile_acc + dv + (dv % 2));  // 8-byte aligned
  w.first = reinterpret_cast<int64_t*>(w.rows + kRows);
  w.last = w.first + kRows;
  w.row_key = reinterpret_cast<uint32_t*>(w.last + kRows);
  return w;
}

size_t scratch_bytes(const mha_kernel_problem* p, int64_t /*max_queries*/) {
  const int64_t floats = kRows * (p->d + kKeys + p->dv + 3) + kKeys * (p->d + p->dv) + p->dv + 1;
  return static_cast<size_t>(floats) * sizeof(float) + kRows * (2 * sizeof(int64_t) + 4) + 64;
}

// The key tile's K and V rows widened to fp32 (an int8 row times its scale):
// each is read once per block of query rows, whatever its dtype.
void load_tile(const mha_kernel_problem& p, const Workspace& w, int64_t b, int64_t kvh, int64_t j0,
               int64_t keys) {
  const bool int8 = p.kv_dtype == MHA_DTYPE_I8;
  for (int64_t jj = 0; jj < keys; ++jj) {
    const int64_t j = j0 + jj;
    const int64_t k_at = mha_kernel::kv_offset(p, p.k_strides, b, kvh, j);
    const int64_t v_at = mha_kernel::kv_offset(p, p.v_strides, b, kvh, j);
    mha_kernel::widen_row(p.k, p.kv_dtype, k_at, p.k_strides[3], p.d,
                          int8 ? *mha_kernel::k_scales(p, b, kvh, j) : 1.0f, w.k_tile + jj * p.d);
    mha_kernel::widen_row(p.v, p.kv_dtype, v_at, p.v_strides[3], p.dv,
                          int8 ? *mha_kernel::v_scales(p, b, kvh, j) : 1.0f, w.v_tile + jj * p.dv);
  }
}

// Scores of one key tile for one block of rows, with every mask applied.
void score_tile(const mha_kernel_problem& p, const Workspace& w, const Units& u, int64_t b,
                int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t keys) {
  const float cap = u.mask(p.softcap);
  const float slope = -u.mask(mha_kernel::alibi_slope(p, b, h));
  for (int64_t r = 0; r < rows; ++r) {
    float* s = w.scores + r * kKeys;
    const float* q = w.q + r * p.d;
    for (int64_t jj = 0; jj < keys; ++jj) {
      const int64_t j = j0 + jj;
      if (j > w.last[r] || j < w.first[r]) {
        s[jj] = kNegInf;
        continue;
      }
      const float* k = w.k_tile + jj * p.d;
      float dot = 0.0f;
      for (int64_t d = 0; d < p.d; ++d) dot += q[d] * k[d];
      // The score variants, before the mask: softcap, then ALiBi.
      if (p.softcap > 0.0f) dot = cap * std::tanh(dot / cap);
      if (p.alibi_slopes != nullptr) {
        dot += slope * static_cast<float>(mha_kernel::alibi_distance(p, i0 + r, j));
      }
      s[jj] = dot;
    }
    if (p.mask_kind == MHA_MASK_NONE) continue;
    const int64_t row = mha_kernel::mask_row_offset(p, b, h, i0 + r);
    for (int64_t jj = 0; jj < keys; ++jj) {
      // A key outside the causal, window or valid-length limits takes no
      // part, whatever the mask holds; for the others the additive mask is
      // added even to a score of -inf (-inf + NaN or +inf is NaN, as in the
      // reference).
      if (j0 + jj > w.last[r] || j0 + jj < w.first[r]) continue;
      const int64_t at = row + (j0 + jj) * p.mask_strides[3];
      if (p.mask_kind == MHA_MASK_BOOL) {
        if (static_cast<const uint8_t*>(p.mask)[at] == 0) s[jj] = kNegInf;
      } else {
        s[jj] += u.mask(mha_kernel::mask_value(p, at));
      }
    }
  }
}

// Online softmax (common/softmax.h): fold one tile of scores into each row's
// running maximum and sum, then add the tile's weighted values to the output.
// A tile's products are summed apart and then added to the row, so rounding
// grows with the tile width plus the number of tiles, not with the number of
// keys (which matters when many keys are alike).
void accumulate_tile(const mha_kernel_problem& p, const Workspace& w, const Units& u, int64_t rows,
                     int64_t j0, int64_t keys) {
  const bool dropout = p.dropout_p > 0.0f;
  const uint32_t drop_below = mha_dropout::threshold(p.dropout_p);
  const float keep_scale = 1.0f / (1.0f - p.dropout_p);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = w.scores + r * kKeys;
    const mha_softmax::Fold fold =
        mha_softmax::fold_tile(s, keys, w.rows[r], [&u](float d) { return u.weight(d); });
    if (!fold.any) continue;  // nothing of this tile takes part
    float* acc = w.acc + r * p.dv;
    if (fold.alpha != 1.0f) {
      for (int64_t d = 0; d < p.dv; ++d) acc[d] *= fold.alpha;
    }
    for (int64_t d = 0; d < p.dv; ++d) w.tile_acc[d] = 0.0f;
    for (int64_t jj = 0; jj < keys; ++jj) {
      if (s[jj] == kNegInf) continue;  // removed: its V row is never read
      float weight = s[jj];
      if (dropout) {
        if (!mha_dropout::keep(w.row_key[r], j0 + jj, drop_below)) continue;
        weight *= keep_scale;
      }
      const float* v = w.v_tile + jj * p.dv;
      for (int64_t d = 0; d < p.dv; ++d) w.tile_acc[d] += weight * v[d];
    }
    for (int64_t d = 0; d < p.dv; ++d) acc[d] += w.tile_acc[d];
  }
}

// One block of query rows over the item's keys, in the given units; returns
// false when a row needs raw units: its accumulator is not finite, or it has
// visible keys but no weight (logits that overflowed to -inf, or a mask that
// removed every key -- then raw units give the same zeros).
bool compute_block(const mha_kernel_problem& p, const mha_work_item& item, const Workspace& w,
                   const Units& u, int64_t h, int64_t i0, int64_t rows) {
  const int64_t b = item.b;
  const int64_t kvh = mha_kernel::kv_head_of(p, h);
  int64_t key_begin = item.k_end, key_end = item.k_begin;
  for (int64_t r = 0; r < rows; ++r) {
    w.first[r] = std::max(mha_kernel::first_visible_key(p, i0 + r), item.k_begin);
    w.last[r] = std::min(last_visible_key(p, b, i0 + r), item.k_end - 1);
    if (w.first[r] <= w.last[r]) {
      key_begin = std::min(key_begin, w.first[r]);
      key_end = std::max(key_end, w.last[r] + 1);
    }
    const int64_t q_at = b * p.q_strides[0] + h * p.q_strides[1] + (i0 + r) * p.q_strides[2];
    for (int64_t d = 0; d < p.d; ++d) {
      w.q[r * p.d + d] =
          mha_types::load_float(p.q, p.q_dtype, q_at + d * p.q_strides[3]) * u.q_factor;
    }
    w.rows[r] = mha_softmax::Row{};
    w.row_key[r] = mha_kernel::dropout_row_key(p, b, h, i0 + r);
    for (int64_t d = 0; d < p.dv; ++d) w.acc[r * p.dv + d] = 0.0f;
  }
  for (int64_t j0 = key_begin; j0 < key_end; j0 += kKeys) {
    const int64_t keys = std::min(kKeys, key_end - j0);
    load_tile(p, w, b, kvh, j0, keys);
    score_tile(p, w, u, b, h, i0, rows, j0, keys);
    accumulate_tile(p, w, u, rows, j0, keys);
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (w.rows[r].sum == 0.0f && w.last[r] >= w.first[r]) return false;  // no weight: overflow?
  }
  for (int64_t x = 0; x < rows * p.dv; ++x) {
    if (!std::isfinite(w.acc[x])) return false;
  }
  return true;
}

int attend(const mha_kernel_problem* problem, const mha_work_item* item, void* scratch) {
  const mha_kernel_problem& p = *problem;
  const Workspace w = carve(scratch, p.d, p.dv);
  const Units natural{false, p.scale, 1.0f};
  const float magnitude = std::fabs(p.scale);
  const Units raw{true, std::copysign(std::fmin(magnitude, 1.0f), p.scale),
                  std::fmax(magnitude, 1.0f)};
  for (int64_t h = item->h_begin; h < item->h_end; ++h) {
    for (int64_t i0 = item->q_begin; i0 < item->q_end; i0 += kRows) {
      const int64_t rows = std::min(kRows, item->q_end - i0);
      const bool finite = compute_block(p, *item, w, natural, h, i0, rows);
      if (!finite) compute_block(p, *item, w, raw, h, i0, rows);
      const Units& u = finite ? natural : raw;
      const float sink = mha_kernel::sink_logit(p, h);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row_h = h - item->h_begin, row_i = i0 + r - item->q_begin;
        const int64_t out_at = row_h * item->out_strides[0] + row_i * item->out_strides[1];
        // The head's sink joins the denominator without a value row (as a
        // logit: in raw units it could overflow).
        mha_softmax::Row row{u.natural(w.rows[r].max), w.rows[r].sum};
        const float acc_scale =
            mha_softmax::fold_sink(row, sink, [](float d) { return std::exp(d); });
        const float sum = row.sum;
        // No key took part.  (A row a sink outweighs has acc_scale 0: a NaN
        // among its values stays NaN.)
        const bool empty = sum == 0.0f;
        const float inv = empty ? 0.0f : acc_scale / sum;
        for (int64_t d = 0; d < p.dv; ++d) {
          mha_types::store_float(item->out, item->out_dtype, out_at + d * item->out_strides[2],
                                 empty ? 0.0f : w.acc[r * p.dv + d] * inv);
        }
        if (item->lse != nullptr) {
          item->lse[row_h * item->lse_strides[0] + row_i * item->lse_strides[1]] =
              sum == 0.0f ? kNegInf : row.max + std::log(sum);
        }
      }
    }
  }
  return 0;
}

// A test builds a copy that declines every call through supports(), to check
// the runtime reports it (MHA_ERR_UNSUPPORTED with the plugin's reason).
#ifdef MHA_SCALAR_DECLINES
int declines(const mha_kernel_problem* /*problem*/, char* reason, size_t reason_size) {
  std::snprintf(reason, reason_size, "%s", MHA_SCALAR_DECLINES);
  return 0;
}
#define MHA_SCALAR_SUPPORTS declines
#else
#define MHA_SCALAR_SUPPORTS nullptr
#endif

}  // namespace

extern "C" __attribute__((visibility("default"))) const mha_plugin* mha_plugin_entry(void) {
  static const mha_plugin table = {
      MHA_PLUGIN_ABI_VERSION,
      sizeof(mha_plugin),
      "scalar",
      "portable C++, no SIMD intrinsics",
      0,                    // runs on any CPU
      MHA_SCALAR_PRIORITY,  // the plugin's claim; the runtime ranks backends itself
      1,
      kRows,
      kKeys,
      nullptr,
      scratch_bytes,
      attend,
      MHA_SCALAR_SUPPORTS,  // every problem the runtime validates
      nullptr,              // path: the runtime's names (fp32, widened-to-fp32) are right
      mha_scalar::backward_scratch_bytes,
      mha_scalar::backward,
      nullptr,  // choose_tiles: loops over single keys, no tile to size
      nullptr,  // gemm_ukernel: BLIS's own kernels
      nullptr,  // bf16_gemm: none
      nullptr,  // narrow_floats: the runtime rounds
  };
  return &table;
}
