// The portable backend's backward pass: FlashAttention-2's algorithm in plain
// loops.  For each block of the item's keys (rows of K and V widened once),
// every query row of the group's heads that sees one of them recomputes its
// weights from the LSE, adds its share to the block's dK and dV (held in
// scratch, written once) and its dQ share to its dq row.  Each sum runs in a
// fixed order: keys, then rows, as listed -- never dependent on threads.
#include "scalar_backward.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/backward_rules.h"
#include "common/dropout.h"
#include "common/dtype.h"
#include "common/problem.h"

namespace mha_scalar {
namespace {

constexpr int64_t kBlockKeys = 64;

struct Workspace {
  float* k;     // [kBlockKeys][D]
  float* v;     // [kBlockKeys][Dv]
  float* dk;    // [kBlockKeys][D]
  float* dv;    // [kBlockKeys][Dv]
  float* q;     // [D]
  float* dout;  // [Dv]
  float* dq;    // [D]
};

Workspace carve(void* scratch, int64_t d, int64_t dv) {
  auto* f = static_cast<float*>(scratch);
  Workspace w{};
  w.k = f;
  w.v = w.k + kBlockKeys * d;
  w.dk = w.v + kBlockKeys * dv;
  w.dv = w.dk + kBlockKeys * d;
  w.q = w.dv + kBlockKeys * dv;
  w.dout = w.q + d;
  w.dq = w.dout + dv;
  return w;
}

}  // namespace

size_t backward_scratch_bytes(const mha_backward_problem* problem) {
  const mha_kernel_problem& p = *problem->forward;
  return static_cast<size_t>(2 * kBlockKeys * (p.d + p.dv) + 2 * p.d + p.dv) * sizeof(float);
}

int backward(const mha_backward_problem* problem, const mha_backward_item* item, void* scratch) {
  const mha_backward_problem& bp = *problem;
  const mha_kernel_problem& p = *bp.forward;
  const Workspace w = carve(scratch, p.d, p.dv);
  const int64_t b = item->b, kvh = item->kv_head;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t h0 = kvh * group;
  const bool dropout = p.dropout_p > 0.0f;
  const uint32_t drop_below = dropout ? mha_dropout::threshold(p.dropout_p) : 0;
  const float keep_scale = dropout ? 1.0f / (1.0f - p.dropout_p) : 1.0f;

  for (int64_t j0 = item->k_begin; j0 < item->k_end; j0 += kBlockKeys) {
    const int64_t j1 = std::min(item->k_end, j0 + kBlockKeys);
    const int64_t n = j1 - j0;
    for (int64_t t = 0; t < n; ++t) {
      mha_kernel::widen_row(p.k, p.kv_dtype, mha_kernel::kv_offset(p, p.k_strides, b, kvh, j0 + t),
                            p.k_strides[3], p.d, 1.0f, w.k + t * p.d);
      mha_kernel::widen_row(p.v, p.kv_dtype, mha_kernel::kv_offset(p, p.v_strides, b, kvh, j0 + t),
                            p.v_strides[3], p.dv, 1.0f, w.v + t * p.dv);
    }
    std::fill_n(w.dk, n * p.d, 0.0f);
    std::fill_n(w.dv, n * p.dv, 0.0f);
    const mha_backward::QueryRange queries = mha_backward::queries_seeing(p, j0, j1);

    for (int64_t h = h0; h < h0 + group; ++h) {
      const float slope = mha_kernel::alibi_slope(p, b, h);
      for (int64_t i = 0; i < p.lq; ++i) {
        float* dmask_row = item->dmask == nullptr
                               ? nullptr
                               : item->dmask + (h - h0) * item->dmask_strides[0] +
                                     i * item->dmask_strides[1] +
                                     (j0 - item->k_begin) * item->dmask_strides[2];
        if (dmask_row != nullptr) {
          for (int64_t t = 0; t < n; ++t) dmask_row[t * item->dmask_strides[2]] = 0.0f;
        }
        if (i < queries.first || i > queries.last) continue;
        const mha_backward::KeyRange keys = mha_backward::visible_in_block(p, b, i, j0, j1);
        const float lse =
            bp.lse[b * bp.lse_strides[0] + h * bp.lse_strides[1] + i * bp.lse_strides[2]];
        if (keys.empty() || lse == -std::numeric_limits<float>::infinity()) continue;
        const float delta =
            bp.delta[b * bp.delta_strides[0] + h * bp.delta_strides[1] + i * bp.delta_strides[2]];
        mha_kernel::widen_row(p.q, p.q_dtype,
                              b * p.q_strides[0] + h * p.q_strides[1] + i * p.q_strides[2],
                              p.q_strides[3], p.d, 1.0f, w.q);
        mha_kernel::widen_row(
            bp.dout, bp.dout_dtype,
            b * bp.dout_strides[0] + h * bp.dout_strides[1] + i * bp.dout_strides[2],
            bp.dout_strides[3], p.dv, 1.0f, w.dout);
        std::fill_n(w.dq, p.d, 0.0f);
        const uint32_t row_key = dropout ? mha_kernel::dropout_row_key(p, b, h, i) : 0;
        const int64_t mask_row = p.mask == nullptr ? 0 : mha_kernel::mask_row_offset(p, b, h, i);
        for (int64_t j = keys.lo; j <= keys.hi; ++j) {
          float mask_add = 0.0f;
          if (p.mask_kind == MHA_MASK_BOOL) {
            if (static_cast<const uint8_t*>(p.mask)[mask_row + j * p.mask_strides[3]] == 0)
              continue;
          } else if (p.mask_kind == MHA_MASK_ADDITIVE) {
            mask_add = mha_kernel::mask_value(p, mask_row + j * p.mask_strides[3]);
          }
          const int64_t t = j - j0;
          const float* k = w.k + t * p.d;
          const float* v = w.v + t * p.dv;
          float dot = 0.0f, dp = 0.0f;
          for (int64_t x = 0; x < p.d; ++x) dot += w.q[x] * k[x];
          for (int64_t x = 0; x < p.dv; ++x) dp += w.dout[x] * v[x];
          const float alibi = -slope * static_cast<float>(mha_kernel::alibi_distance(p, i, j));
          const mha_backward::Logit logit =
              mha_backward::logit_of(dot, p.scale, p.softcap, alibi, mask_add);
          const float prob = std::exp(logit.value - lse);
          const float keep =
              dropout ? (mha_dropout::keep(row_key, j, drop_below) ? keep_scale : 0.0f) : 1.0f;
          const float ds = prob * (dp * keep - delta);  // dL/dlogit
          if (dmask_row != nullptr) dmask_row[t * item->dmask_strides[2]] = ds;
          const float kept = prob * keep;
          const float dx = ds * logit.slope;  // dL/d(q·k)
          float* dv = w.dv + t * p.dv;
          float* dk = w.dk + t * p.d;
          for (int64_t x = 0; x < p.dv; ++x) dv[x] += kept * w.dout[x];
          for (int64_t x = 0; x < p.d; ++x) {
            dk[x] += dx * w.q[x];
            w.dq[x] += dx * k[x];
          }
        }
        float* dq = item->dq + (h - h0) * item->dq_strides[0] + i * item->dq_strides[1];
        for (int64_t x = 0; x < p.d; ++x) dq[x * item->dq_strides[2]] += w.dq[x];
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      float* dk = item->dk + (j0 - item->k_begin + t) * item->dk_strides[0];
      float* dv = item->dv + (j0 - item->k_begin + t) * item->dv_strides[0];
      for (int64_t x = 0; x < p.d; ++x) dk[x * item->dk_strides[1]] = w.dk[t * p.d + x];
      for (int64_t x = 0; x < p.dv; ++x) dv[x * item->dv_strides[1]] = w.dv[t * p.dv + x];
    }
  }
  return 0;
}

}  // namespace mha_scalar
