// The module's forward pass:
//
//   1. projections, one BLIS sgemm over all B·L rows of an input (the same
//      tensor passed as query, key and value -- self-attention -- is projected
//      once against the stacked weights W_qkvᵀ [E, 3E]; key = value against W_kvᵀ [Ek, 2E]);
//   2. attention per head on strided views of the projections: the projected
//      Q [B, Lq, E] is the [B, H, Lq, D] tensor with strides {Lq·E, D, E, 1}
//      (half-precision activations: each head's rows a block of their own,
//      strides {Lq·D, B·Lq·D, D, 1}), and the heads' outputs land in one
//      [B, Lq, E] buffer, which is their concatenation;
//   3. out = concat · W_oᵀ + b_o, one sgemm written into the caller's out
//      (a bf16 or f16 out: into fp32 rows, then rounded once).
//
// Half precision: bf16 and f16 inputs are widened as the projections copy
// their rows (projections.cpp); everything after is fp32, as PyTorch's CPU
// module computes its bf16 products with fp32 accumulation -- unless the
// module keeps its activations in the input's dtype (MHA_ACTIVATIONS_INPUT):
// then the projections are rounded to it (by the AMX tiles as they store
// them, where they run the product), the attention runs on half-precision
// Q, K, V and writes half-precision heads, which the output product reads
// (bf16: on the tiles as they are).
//
// Step 2 is mha_attention (fused, nothing of size Lq x Lk), except when the
// attention weights are wanted: then S = scale·Q·Kᵀ is computed by BLIS per
// block of queries, capped, biased (ALiBi), masked, soft-maxed (with the
// sinks) and dropped out here, written to the caller, and multiplied by V.
// Both read one description of the call (the kernels' mha_kernel_problem).
//
// Scratch is per calling thread and reused: it grows to the largest call.
#include <mha/mha.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "attention.h"
#include "bf16_products.h"
#include "blis.h"
#include "common/dropout.h"
#include "common/dtype.h"
#include "common/problem.h"
#include "common/softmax.h"
#include "env.h"
#include "kernel_mask.h"
#include "module.h"
#include "projections.h"
#include "scratch.h"
#include "threads.h"
#include "validate.h"

namespace mha::rt {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The forward pass's per-thread buffers, reused: they grow to the largest
// call.
thread_local AlignedBuffer t_projections, t_concat, t_mask, t_rows, t_out, t_half_concat;

// ---------------------------------------------------------------- the weights path

struct WeightsPath {
  const ModuleCall* call;
  // The call as the kernels see it (describe_attention over the views below):
  // which keys a row sees, the mask in its kernel form, the variants.  Read
  // with common/problem.h's helpers, as the scalar kernel reads it.
  const mha_kernel_problem* problem;
  mha_tensor q, k, v, concat;  // the [B, H, L, D] views
};

// Turns row (b, h, i) of scale·Q·Kᵀ into attention weights, in place, in the
// kernels' order: softcap, ALiBi, the window, causal and valid-length limits,
// the mask; then the softmax with the head's sink in its denominator (the
// weights are the true probabilities: they sum to 1 minus the sink's share; a
// row in which no key takes part is all zeros, sink or not); dropout.
void weights_row(const WeightsPath& w, int64_t b, int64_t h, int64_t i, float* row) {
  const mha_kernel_problem& p = *w.problem;
  const int64_t lk = p.lk;
  const int64_t first = mha_kernel::first_visible_key(p, i);
  const int64_t end = mha_kernel::last_visible_key(p, b, i) + 1;
  const int64_t mask_row =
      p.mask_kind == MHA_MASK_NONE ? 0 : mha_kernel::mask_row_offset(p, b, h, i);
  const float cap = p.softcap;
  const float slope = -mha_kernel::alibi_slope(p, b, h);
  for (int64_t j = 0; j < lk; ++j) {
    if (j < first || j >= end) {
      row[j] = -kInf;
      continue;
    }
    float logit = row[j];
    if (cap > 0.0f) logit = cap * std::tanh(logit / cap);
    if (p.alibi_slopes != nullptr) {
      logit += slope * static_cast<float>(mha_kernel::alibi_distance(p, i, j));
    }
    const int64_t at = mask_row + j * p.mask_strides[3];
    if (p.mask_kind == MHA_MASK_BOOL) {
      if (static_cast<const uint8_t*>(p.mask)[at] == 0) logit = -kInf;
    } else if (p.mask_kind == MHA_MASK_ADDITIVE) {
      logit += mha_kernel::mask_value(p, at);
    }
    row[j] = logit;
  }
  // The sink first (a row of weight 1 at the sink's logit; nothing without
  // one), then the whole row as one tile of the online softmax: each weight
  // is then e^(s_j - max) over a sum that holds the sink's e^(sink - max).
  // NaN poisons the row.
  const auto exp = [](float d) { return std::exp(d); };
  mha_softmax::Row state;
  mha_softmax::fold_sink(state, mha_kernel::sink_logit(p, h), exp);
  if (!mha_softmax::fold_tile(row, lk, state, exp).any) {
    std::fill(row, row + lk, 0.0f);  // no key takes part
    return;
  }
  const float inv = 1.0f / state.sum;
  for (int64_t j = 0; j < lk; ++j) row[j] = row[j] == -kInf ? 0.0f : row[j] * inv;
  if (p.dropout_p > 0.0f) {
    const uint32_t key = mha_kernel::dropout_row_key(p, b, h, i);
    const uint32_t below = mha_dropout::threshold(p.dropout_p);
    const float keep_scale = 1.0f / (1.0f - p.dropout_p);
    for (int64_t j = 0; j < lk; ++j) {
      row[j] = mha_dropout::keep(key, j, below) ? row[j] * keep_scale : 0.0f;
    }
  }
}

constexpr int64_t kWeightsBlock = 32;  // queries per work item of the weights path

void run_weights_path(const WeightsPath& w, int32_t threads) {
  const ModuleCall& c = *w.call;
  const mha_kernel_problem& p = *w.problem;
  const int64_t lq = p.lq, lk = p.lk, heads = p.heads, d = p.d;
  const int64_t blocks = (lq + kWeightsBlock - 1) / kWeightsBlock;
  const int64_t items = c.batch * blocks;
  const int32_t team =
      static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
  const int64_t per_thread = kWeightsBlock * lk * (c.average_weights ? 2 : 1);
  float* rows_scratch = static_cast<float*>(take(t_rows, float_bytes(per_thread * team)));
  const mha_tensor& aw = *c.attn_weights;  // f32, or the query's half dtype (rounded once)
  const float inv_heads = 1.0f / static_cast<float>(heads);

  auto no_preparation = [](int32_t /*thread*/) { return true; };
  run_team(items, team, no_preparation, [&](int64_t item, int32_t thread) {
    const int64_t b = item / blocks;
    const int64_t i0 = (item % blocks) * kWeightsBlock;
    const int64_t rows = std::min(kWeightsBlock, lq - i0);
    float* s = rows_scratch + per_thread * thread;
    float* acc = s + kWeightsBlock * lk;
    if (c.average_weights) std::fill(acc, acc + rows * lk, 0.0f);
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = static_cast<const float*>(w.q.data) + b * w.q.strides[0] +
                       h * w.q.strides[1] + i0 * w.q.strides[2];
      const float* k =
          static_cast<const float*>(w.k.data) + b * w.k.strides[0] + h * w.k.strides[1];
      const float* v =
          static_cast<const float*>(w.v.data) + b * w.v.strides[0] + h * w.v.strides[1];
      float* o = static_cast<float*>(w.concat.data) + b * w.concat.strides[0] +
                 h * w.concat.strides[1] + i0 * w.concat.strides[2];
      // S = scale · Q Kᵀ
      sgemm(rows, lk, d, p.scale, q, w.q.strides[2], 1, k, 1, w.k.strides[2], 0.0f, s, lk, 1, 1);
      for (int64_t r = 0; r < rows; ++r) weights_row(w, b, h, i0 + r, s + r * lk);
      if (c.average_weights) {
        for (int64_t n = 0; n < rows * lk; ++n) acc[n] += s[n];
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = b * aw.strides[0] + h * aw.strides[1] + (i0 + r) * aw.strides[2];
          for (int64_t j = 0; j < lk; ++j) {
            mha_types::store_float(aw.data, aw.dtype, at + j * aw.strides[3], s[r * lk + j]);
          }
        }
      }
      // O = P V
      sgemm(rows, d, lk, 1.0f, s, lk, 1, v, w.v.strides[2], 1, 0.0f, o, w.concat.strides[2], 1, 1);
    }
    if (c.average_weights) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = b * aw.strides[0] + (i0 + r) * aw.strides[1];
        for (int64_t j = 0; j < lk; ++j) {
          mha_types::store_float(aw.data, aw.dtype, at + j * aw.strides[2],
                                 acc[r * lk + j] * inv_heads);
        }
      }
    }
  });
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

mha_status run_module_forward(const ModuleCall& call) {
  const mha_module& m = *call.module;
  const int64_t batch = call.batch, lq = call.lq, lk = call.lk;
  const int64_t e = m.embed_dim, heads = m.num_heads, d = m.head_dim;
  const int64_t q_rows = batch * lq;
  const int32_t threads = num_threads();
  const bool verbose = verbose_level() >= 2;
  const auto t0 = std::chrono::steady_clock::now();

  // MHA_ACTIVATIONS_INPUT on a half-precision query: the projections and the
  // heads' outputs rounded to its dtype (mha.h).  The fused path keeps them
  // in that dtype (the attention's half-precision kernels, the output
  // product's bf16 rows on the tiles); the weights path rounds them in place.
  const int32_t half = m.half_activations && call.query->dtype != MHA_DTYPE_F32
                           ? call.query->dtype
                           : static_cast<int32_t>(MHA_DTYPE_F32);
  const bool weights_path = call.attn_weights != nullptr;
  const bool half_fused = half != MHA_DTYPE_F32 && !weights_path;

  // ---- 1. projections
  const Projections proj =
      project_inputs(call, t_projections, threads, half_fused ? half : MHA_DTYPE_F32);
  if (half != MHA_DTYPE_F32 && !half_fused) {
    round_values(proj.data, proj.floats, half, nullptr, threads);  // kept as fp32 values
  }
  const mha_tensor &qv = proj.q, &kv = proj.k, &vv = proj.v;
  const double proj_ms = verbose ? ms_since(t0) : 0.0;

  // ---- 2. attention, into the concatenation of the heads, in out's row order
  const mha_tensor& out = *call.out;
  const RowOrder out_order = row_order(out);
  // With biases, the concatenation's rows have a column of ones beside them
  // (ones_row_width), and the output product adds b_o's row of w_out.
  const bool bias = m.bias;
  const int64_t concat_width = bias ? ones_row_width(e) : e;
  float* concat = static_cast<float*>(take(t_concat, float_bytes(q_rows * concat_width)));
  if (bias) {
    for (int64_t r = 0; r < q_rows; ++r) concat[r * concat_width + e] = 1.0f;
  }
  // The heads' outputs: into the fp32 concatenation, or (half_fused) into
  // rows of the half dtype, E wide.
  uint16_t* half_concat =
      half_fused ? static_cast<uint16_t*>(take(t_half_concat, static_cast<size_t>(q_rows * e) * 2))
                 : nullptr;
  mha_tensor cv;
  if (half_fused) {
    head_view(half_concat, batch, heads, lq, d, e, out_order.seq_major, 0, &cv, half);
  } else {
    head_view(concat, batch, heads, lq, d, concat_width, out_order.seq_major, 0, &cv);
  }
  mha_tensor kernel_mask;
  const bool has_mask = build_kernel_mask(call, heads, t_mask, &kernel_mask);
  // The core's attention on the module's own views, which are valid by
  // construction: the arguments were checked once, by mha_module_forward.
  // The weights path reads the same description of the call.
  const mha_attention_params ap = module_attention_params(call, has_mask ? &kernel_mask : nullptr);
  KernelCall kernel_call;
  describe_attention(qv, kv, vv, cv, ap, &kernel_call);
  const auto t1 = std::chrono::steady_clock::now();
  if (weights_path) {
    const WeightsPath path{&call, &kernel_call.problem, qv, kv, vv, cv};
    run_weights_path(path, threads);
    // The heads' outputs rounded (only their E columns: the rest is the
    // column of ones and padding never written).
    if (half != MHA_DTYPE_F32) {
      const Narrower narrower;
      for_each_row(q_rows, threads,
                   [&](int64_t r) { narrower.in_place(concat + r * concat_width, e, half); });
    }
  } else {
    if (mha_status s = attend(kernel_call); s != MHA_OK) return s;
  }
  const double attn_ms = verbose ? ms_since(t1) : 0.0;

  // ---- 3. out = concat · W_oᵀ + b_o (the bias a row of the product)
  const auto t2 = std::chrono::steady_clock::now();
  const int64_t k = bias ? e + 1 : e;
  const int32_t t = sgemm_threads(out_order.rows, e, k, threads);
  int bf16_products = proj.bf16_products;
  // On the tiles: the bf16 heads' outputs as they are, or the fp32 ones split.
  const bool bf16_rows = half_fused && half == MHA_DTYPE_BF16;
  const auto on_tiles = [&](int64_t gemms, int64_t rows, float* c, int64_t ldc,
                            int64_t c_gemm_stride, uint16_t* c16 = nullptr) {
    TileProduct product =
        bf16_rows
            ? TileProduct{half_concat, true, gemms, rows, e, rows * e, c, ldc, c_gemm_stride}
            : TileProduct{concat, false, gemms,        rows, concat_width, rows * concat_width,
                          c,      ldc,   c_gemm_stride};
    product.c16 = c16;
    return run_on_tiles(m, product, m.w_out.data(), e, e, e, bias, threads);
  };
  // The half-precision heads' outputs widened beside their column of ones:
  // for the tiles' split or BLIS at once, for BLIS where the tiles refused
  // bf16 rows (widened()).
  const auto widen_concat = [&] {
    for_each_row(q_rows, t, [&](int64_t r) {
      mha_types::widen_row(half_concat, half, r * e, 1, e, concat + r * concat_width);
    });
  };
  if (half_fused && !bf16_rows) widen_concat();
  const auto widened = [&] {
    if (bf16_rows) widen_concat();
  };
  // Straight into out on the tiles: fp32, or bf16 from bf16 rows (each sum
  // rounded once as the tiles store it).
  const bool into_out = out.strides[2] == 1 &&
                        ((out.dtype == MHA_DTYPE_F32 &&
                          on_tiles(out_order.gemms, out_order.rows, static_cast<float*>(out.data),
                                   out_order.row_stride, out_order.gemm_stride)) ||
                         (out.dtype == MHA_DTYPE_BF16 && bf16_rows &&
                          on_tiles(out_order.gemms, out_order.rows, nullptr, out_order.row_stride,
                                   out_order.gemm_stride, static_cast<uint16_t*>(out.data))));
  if (into_out) {
    ++bf16_products;
  } else if (out.dtype == MHA_DTYPE_F32) {
    widened();
    auto* out_data = static_cast<float*>(out.data);
    for (int64_t g = 0; g < out_order.gemms; ++g) {
      sgemm(out_order.rows, e, k, 1.0f, concat + g * out_order.rows * concat_width, concat_width, 1,
            m.w_out.data(), e, 1, 0.0f, out_data + g * out_order.gemm_stride, out_order.row_stride,
            out.strides[2], t);
    }
  } else {
    // A bf16 or f16 out: the product in fp32 rows (the concatenation's
    // order), each value rounded once into out.
    float* rows = static_cast<float*>(take(t_out, float_bytes(q_rows * e)));
    if (on_tiles(1, q_rows, rows, e, 0)) {
      ++bf16_products;
    } else {
      widened();
      sgemm(q_rows, e, k, 1.0f, concat, concat_width, 1, m.w_out.data(), e, 1, 0.0f, rows, e, 1, t);
    }
    const Narrower narrower;
    for_each_row(q_rows, t, [&](int64_t r) {
      const int64_t g = r / out_order.rows, i = r % out_order.rows;
      narrower.row(rows + r * e, e, out.data, out.dtype,
                   g * out_order.gemm_stride + i * out_order.row_stride, out.strides[2]);
    });
  }
  if (verbose) {
    std::fprintf(stderr,
                 "mha_verbose,exec,module,B=%lld,Lq=%lld,Lk=%lld,E=%lld,H=%lld,Eq=%lld,Ek=%lld,"
                 "Ev=%lld,bias=%d,packed=%s,path=%s,dropout=%g,variants=%s,blis=%s,gemm_ukernel=%s,"
                 "bf16_products=%d,bf16_gemm=%s,activations=%s,threads=%d,"
                 "proj_ms=%.4f,attention_ms=%.4f,out_proj_ms=%.4f\n",
                 static_cast<long long>(batch), static_cast<long long>(lq),
                 static_cast<long long>(lk), static_cast<long long>(e),
                 static_cast<long long>(heads), static_cast<long long>(m.query_dim),
                 static_cast<long long>(m.key_dim), static_cast<long long>(m.value_dim),
                 m.bias ? 1 : 0, proj.qkv_packed ? "qkv" : (proj.kv_packed ? "kv" : "no"),
                 call.attn_weights != nullptr ? "weights" : "fused",
                 static_cast<double>(call.dropout_p), variants_of(kernel_call).c_str(),
                 blis_kernel_set(), gemm_ukernel_in_use(), bf16_products, bf16_products_kind(),
                 mha_types::dtype_name(half), threads, proj_ms, attn_ms, ms_since(t2));
  }
  return MHA_OK;
}

}  // namespace mha::rt
