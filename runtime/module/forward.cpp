// The module's forward pass:
//
//   1. projections, one BLIS sgemm over all B·L rows of an input (the same
//      tensor passed as query, key and value -- self-attention -- is projected
//      once against the stacked weights W_qkvᵀ [E, 3E]; key = value against W_kvᵀ [Ek, 2E]);
//   2. attention per head on strided views of the projections: the projected
//      Q [B, Lq, E] is the [B, H, Lq, D] tensor with strides {Lq·E, D, E, 1},
//      and the heads' outputs land in the same way in one [B, Lq, E] buffer,
//      which is their concatenation;
//   3. out = concat · W_oᵀ + b_o, one sgemm written into the caller's out.
//
// Step 2 is mha_attention (fused, nothing of size Lq x Lk), except when the
// attention weights are wanted: then S = scale·Q·Kᵀ is computed by BLIS per
// block of queries, capped, biased (ALiBi), masked, soft-maxed (with the
// sinks) and dropped out here, written to the caller, and multiplied by V.
// Both read one description of the call (the kernels' mha_kernel_problem).
//
// The row order of the scratch buffers follows the caller's tensors, so that
// every product is one sgemm with one row stride: a sequence-first input
// ([L, B, E] memory, strides {E, B·E, 1}) gives projections in [L, B, ·] order;
// inputs whose rows cannot be walked with one stride take one sgemm per batch.
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
#include "blis.h"
#include "common/dropout.h"
#include "common/problem.h"
#include "common/softmax.h"
#include "env.h"
#include "module.h"
#include "scratch.h"
#include "threads.h"
#include "validate.h"

namespace mha::rt {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------- scratch

// The forward pass's per-thread buffers; taking memory that cannot be had
// throws std::bad_alloc, which the entry point turns into a status before any
// output is written.
thread_local AlignedBuffer t_projections, t_concat, t_mask, t_rows;

void* take(AlignedBuffer& buffer, size_t bytes) {
  void* memory = buffer.get(bytes);
  if (memory == nullptr) throw std::bad_alloc();
  return memory;
}

size_t float_bytes(int64_t count) {
  return static_cast<size_t>(count) * sizeof(float);
}

// ---------------------------------------------------------------- row orders

// How the B x L rows of a [B, L, F] tensor are walked by sgemm calls.
struct RowOrder {
  bool seq_major = false;   // rows in (position, batch) order: a sequence-first tensor
  int64_t gemms = 1;        // 1, or B (one product per batch)
  int64_t rows = 0;         // rows per product
  int64_t row_stride = 0;   // elements between consecutive rows of one product
  int64_t gemm_stride = 0;  // elements between the products' first rows (batch stride)
};

RowOrder row_order(const mha_tensor& t) {
  const int64_t batch = t.shape[0], len = t.shape[1], s0 = t.strides[0], s1 = t.strides[1];
  if (batch == 1) return {false, 1, len, s1, 0};
  if (len == 1) return {false, 1, batch, s0, 0};  // one row per batch: either order
  if (s0 == len * s1) return {false, 1, batch * len, s1, 0};
  if (s1 == batch * s0) return {true, 1, batch * len, s0, 0};
  return {false, batch, len, s1, s0};
}

// Strides of the [B, H, L, D] view of head columns `offset` + h·D of a buffer
// of rows `width` wide in the given order.
void head_view(float* base, int64_t batch, int64_t heads, int64_t len, int64_t d, int64_t width,
               bool seq_major, int64_t offset, mha_tensor* view) {
  std::memset(view, 0, sizeof *view);
  view->data = base + offset;
  view->dtype = MHA_DTYPE_F32;
  view->ndim = 4;
  view->shape[0] = batch;
  view->shape[1] = heads;
  view->shape[2] = len;
  view->shape[3] = d;
  view->strides[0] = seq_major ? width : len * width;
  view->strides[1] = d;
  view->strides[2] = seq_major ? batch * width : width;
  view->strides[3] = 1;
}

// dst rows (in `order`, `width` wide, columns [0, n)) = x · wt + bias, with wt
// the transposed weights [K, n] (row stride ld) and x [B, L, K].
void project(const mha_tensor& x, const RowOrder& order, const float* wt, int64_t ld, int64_t n,
             const float* bias, float* dst, int64_t width, int32_t threads) {
  const int64_t k = x.shape[2];
  const int64_t total_rows = x.shape[0] * x.shape[1];
  if (bias != nullptr) {
    for (int64_t r = 0; r < total_rows; ++r) std::memcpy(dst + r * width, bias, float_bytes(n));
  }
  const auto* src = static_cast<const float*>(x.data);
  const int32_t t = sgemm_threads(order.rows, n, k, threads);
  for (int64_t g = 0; g < order.gemms; ++g) {
    sgemm(order.rows, n, k, 1.0f, src + g * order.gemm_stride, order.row_stride, x.strides[2], wt,
          ld, 1, bias != nullptr ? 1.0f : 0.0f, dst + g * order.rows * width, width, 1, t);
  }
}

bool same_tensor(const mha_tensor& a, const mha_tensor& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int32_t d = 0; d < a.ndim; ++d) {
    if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

// ---------------------------------------------------------------- masks

// The masks in mha_attention's form: one mask, bool true = take part or f32
// added to the scores, as a [B or 1, H or 1, Lq or 1, Lk] descriptor.
//   key_padding_mask alone: f32 is used in place ([B, 1, 1, Lk] view); bool is
//     inverted into B·Lk bytes of scratch.
//   attn_mask alone: f32 is used in place ([Lq, Lk], or the [B*H, Lq, Lk] one
//     viewed as [B, H, Lq, Lk]); bool is inverted into scratch of its own size.
//   both: combined into scratch of [B, 1 or H, Lq, Lk] elements -- bool
//     (allowed = neither masks the key) when both are bool, otherwise f32 (the
//     sum of the two, a true bool entry counting as -inf), so O(B·Lq·Lk), or
//     O(B·H·Lq·Lk) when attn_mask already has that size.
bool build_kernel_mask(const ModuleCall& call, int64_t heads, mha_tensor* mask) {
  const mha_tensor* kpm = call.key_padding_mask;
  const mha_tensor* am = call.attn_mask;
  if (kpm == nullptr && am == nullptr) return false;
  const int64_t batch = call.batch, lq = call.lq, lk = call.lk;
  std::memset(mask, 0, sizeof *mask);
  mask->ndim = 4;

  // attn_mask as [1 or B, 1 or H, Lq, Lk] strides.
  int64_t am_shape[4] = {1, 1, lq, lk}, am_strides[4] = {0, 0, 0, 0};
  if (am != nullptr) {
    if (am->ndim == 2) {
      am_strides[2] = am->strides[0];
      am_strides[3] = am->strides[1];
    } else {
      am_shape[0] = batch;
      am_shape[1] = heads;
      am_strides[0] = heads * am->strides[0];
      am_strides[1] = am->strides[0];
      am_strides[2] = am->strides[1];
      am_strides[3] = am->strides[2];
    }
  }

  if (am == nullptr) {  // key_padding_mask only
    const int64_t shape[4] = {batch, 1, 1, lk};
    std::memcpy(mask->shape, shape, sizeof shape);
    if (kpm->dtype == MHA_DTYPE_F32) {
      mask->data = kpm->data;
      mask->dtype = MHA_DTYPE_F32;
      const int64_t strides[4] = {kpm->strides[0], 0, 0, kpm->strides[1]};
      std::memcpy(mask->strides, strides, sizeof strides);
      return true;
    }
    auto* allowed = static_cast<uint8_t*>(take(t_mask, static_cast<size_t>(batch * lk)));
    const auto* src = static_cast<const uint8_t*>(kpm->data);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t j = 0; j < lk; ++j) {
        allowed[b * lk + j] =
            static_cast<uint8_t>(src[b * kpm->strides[0] + j * kpm->strides[1]] != 0 ? 0 : 1);
      }
    }
    mask->data = allowed;
    mask->dtype = MHA_DTYPE_BOOL;
    const int64_t strides[4] = {lk, 0, 0, 1};
    std::memcpy(mask->strides, strides, sizeof strides);
    return true;
  }

  if (kpm == nullptr && am->dtype == MHA_DTYPE_F32) {  // attn_mask only, in place
    mask->data = am->data;
    mask->dtype = MHA_DTYPE_F32;
    std::memcpy(mask->shape, am_shape, sizeof am_shape);
    std::memcpy(mask->strides, am_strides, sizeof am_strides);
    return true;
  }

  // Scratch of [B or 1, 1 or H, Lq, Lk], C order.
  const int64_t out_batch = kpm != nullptr ? batch : am_shape[0];
  const int64_t out_heads = am_shape[1];
  const int64_t shape[4] = {out_batch, out_heads, lq, lk};
  const int64_t strides[4] = {out_heads * lq * lk, lq * lk, lk, 1};
  std::memcpy(mask->shape, shape, sizeof shape);
  std::memcpy(mask->strides, strides, sizeof strides);
  const int64_t count = out_batch * out_heads * lq * lk;
  const bool all_bool =
      am->dtype == MHA_DTYPE_BOOL && (kpm == nullptr || kpm->dtype == MHA_DTYPE_BOOL);
  if (all_bool) {
    auto* allowed = static_cast<uint8_t*>(take(t_mask, static_cast<size_t>(count)));
    const auto* am_data = static_cast<const uint8_t*>(am->data);
    const auto* kpm_data = kpm != nullptr ? static_cast<const uint8_t*>(kpm->data) : nullptr;
    int64_t n = 0;
    for (int64_t b = 0; b < out_batch; ++b)
      for (int64_t h = 0; h < out_heads; ++h)
        for (int64_t i = 0; i < lq; ++i)
          for (int64_t j = 0; j < lk; ++j) {
            const int64_t ab = am_shape[0] == 1 ? 0 : b;
            bool masked = am_data[ab * am_strides[0] + h * am_strides[1] + i * am_strides[2] +
                                  j * am_strides[3]] != 0;
            if (kpm_data != nullptr)
              masked = masked || kpm_data[b * kpm->strides[0] + j * kpm->strides[1]] != 0;
            allowed[n++] = static_cast<uint8_t>(masked ? 0 : 1);
          }
    mask->data = allowed;
    mask->dtype = MHA_DTYPE_BOOL;
    return true;
  }
  auto* additive = static_cast<float*>(take(t_mask, float_bytes(count)));
  const auto term = [](const mha_tensor* t, int64_t offset) -> float {
    if (t->dtype == MHA_DTYPE_BOOL)
      return static_cast<const uint8_t*>(t->data)[offset] != 0 ? -kInf : 0.0f;
    return static_cast<const float*>(t->data)[offset];
  };
  int64_t n = 0;
  for (int64_t b = 0; b < out_batch; ++b)
    for (int64_t h = 0; h < out_heads; ++h)
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) {
          const int64_t ab = am_shape[0] == 1 ? 0 : b;
          float value = term(
              am, ab * am_strides[0] + h * am_strides[1] + i * am_strides[2] + j * am_strides[3]);
          if (kpm != nullptr) value += term(kpm, b * kpm->strides[0] + j * kpm->strides[1]);
          additive[n++] = value;
        }
  mask->data = additive;
  mask->dtype = MHA_DTYPE_F32;
  return true;
}

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
    const uint32_t key = mha_dropout::row_key(p.dropout_seed, b, h, i, p.heads, p.lq);
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
  const mha_tensor& aw = *c.attn_weights;
  auto* weights_out = static_cast<float*>(aw.data);
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
          float* dst =
              weights_out + b * aw.strides[0] + h * aw.strides[1] + (i0 + r) * aw.strides[2];
          for (int64_t j = 0; j < lk; ++j) dst[j * aw.strides[3]] = s[r * lk + j];
        }
      }
      // O = P V
      sgemm(rows, d, lk, 1.0f, s, lk, 1, v, w.v.strides[2], 1, 0.0f, o, w.concat.strides[2], 1, 1);
    }
    if (c.average_weights) {
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = weights_out + b * aw.strides[0] + (i0 + r) * aw.strides[1];
        for (int64_t j = 0; j < lk; ++j) dst[j * aw.strides[2]] = acc[r * lk + j] * inv_heads;
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
  const int32_t threads = num_threads();
  const bool verbose = verbose_level() >= 2;
  const auto t0 = std::chrono::steady_clock::now();

  // ---- 1. projections
  const mha_tensor& query = *call.query;
  const mha_tensor& key = *call.key;
  const mha_tensor& value = *call.value;
  const RowOrder q_order = row_order(query), k_order = row_order(key), v_order = row_order(value);
  const bool qkv_packed = same_tensor(query, key) && same_tensor(key, value);
  const bool kv_packed = !qkv_packed && same_tensor(key, value);
  const int64_t q_width = qkv_packed ? 3 * e : e;
  const int64_t kv_width = kv_packed ? 2 * e : e;
  const int64_t q_rows = batch * lq, kv_rows = batch * lk;
  int64_t floats = q_rows * q_width;
  if (!qkv_packed) floats += kv_packed ? kv_rows * kv_width : 2 * kv_rows * e;
  float* proj = static_cast<float*>(take(t_projections, float_bytes(floats)));
  float* q_buf = proj;
  float* k_buf = qkv_packed ? proj : q_buf + q_rows * q_width;
  float* v_buf = qkv_packed || kv_packed ? k_buf : k_buf + kv_rows * e;
  const int64_t k_width = qkv_packed ? q_width : kv_width;
  const int64_t k_offset = qkv_packed ? e : 0;
  const int64_t v_offset = qkv_packed ? 2 * e : (kv_packed ? e : 0);

  if (qkv_packed) {
    project(query, q_order, m.w_q(), m.wq_t.ld, 3 * e, m.b_q(), q_buf, q_width, threads);
  } else {
    project(query, q_order, m.w_q(), m.wq_t.ld, e, m.b_q(), q_buf, q_width, threads);
    if (kv_packed) {
      project(key, k_order, m.w_k(), m.wk_t.ld, 2 * e, m.b_k(), k_buf, kv_width, threads);
    } else {
      project(key, k_order, m.w_k(), m.wk_t.ld, e, m.b_k(), k_buf, e, threads);
      project(value, v_order, m.w_v(), m.wv_t.ld, e, m.b_v(), v_buf, e, threads);
    }
  }
  mha_tensor qv, kv, vv;
  head_view(q_buf, batch, heads, lq, d, q_width, q_order.seq_major, 0, &qv);
  head_view(k_buf, batch, heads, lk, d, k_width, k_order.seq_major, k_offset, &kv);
  head_view(v_buf, batch, heads, lk, d, qkv_packed || kv_packed ? k_width : e, v_order.seq_major,
            v_offset, &vv);
  const double proj_ms = verbose ? ms_since(t0) : 0.0;

  // ---- 2. attention, into the concatenation of the heads, in out's row order
  const mha_tensor& out = *call.out;
  const RowOrder out_order = row_order(out);
  float* concat = static_cast<float*>(take(t_concat, float_bytes(q_rows * e)));
  mha_tensor cv;
  head_view(concat, batch, heads, lq, d, e, out_order.seq_major, 0, &cv);
  mha_tensor kernel_mask;
  const bool has_mask = build_kernel_mask(call, heads, &kernel_mask);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  // The core's attention on the module's own views, which are valid by
  // construction: the arguments were checked once, by mha_module_forward.
  // The weights path reads the same description of the call.
  mha_attention_params ap;
  mha_attention_params_init(&ap);
  ap.has_scale = 1;
  ap.scale = scale;
  ap.causal = call.causal;
  ap.valid_lens = call.valid_lens;
  ap.mask = has_mask ? &kernel_mask : nullptr;
  ap.dropout_p = call.dropout_p;
  ap.dropout_seed = call.dropout_seed;
  ap.window_left = call.window_left;
  ap.window_right = call.window_right;
  ap.sinks = call.sinks;
  ap.softcap = call.softcap;
  ap.alibi_slopes = call.alibi_slopes;
  KernelCall kernel_call;
  describe_attention(qv, kv, vv, cv, ap, &kernel_call);
  const auto t1 = std::chrono::steady_clock::now();
  if (call.attn_weights != nullptr) {
    const WeightsPath path{&call, &kernel_call.problem, qv, kv, vv, cv};
    run_weights_path(path, threads);
  } else {
    if (mha_status s = attend(kernel_call); s != MHA_OK) return s;
  }
  const double attn_ms = verbose ? ms_since(t1) : 0.0;

  // ---- 3. out = concat · W_oᵀ + b_o
  const auto t2 = std::chrono::steady_clock::now();
  auto* out_data = static_cast<float*>(out.data);
  const bool bias = !m.b_out.empty();
  if (bias) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < lq; ++i) {
        float* row = out_data + b * out.strides[0] + i * out.strides[1];
        for (int64_t n = 0; n < e; ++n) row[n * out.strides[2]] = m.b_out[static_cast<size_t>(n)];
      }
  }
  const int32_t t = sgemm_threads(out_order.rows, e, e, threads);
  for (int64_t g = 0; g < out_order.gemms; ++g) {
    sgemm(out_order.rows, e, e, 1.0f, concat + g * out_order.rows * e, e, 1, m.w_out.data(), e, 1,
          bias ? 1.0f : 0.0f, out_data + g * out_order.gemm_stride, out_order.row_stride,
          out.strides[2], t);
  }
  if (verbose) {
    std::fprintf(stderr,
                 "mha_verbose,exec,module,B=%lld,Lq=%lld,Lk=%lld,E=%lld,H=%lld,Eq=%lld,Ek=%lld,"
                 "Ev=%lld,bias=%d,packed=%s,path=%s,dropout=%g,variants=%s,blis=%s,threads=%d,"
                 "proj_ms=%.4f,attention_ms=%.4f,out_proj_ms=%.4f\n",
                 static_cast<long long>(batch), static_cast<long long>(lq),
                 static_cast<long long>(lk), static_cast<long long>(e),
                 static_cast<long long>(heads), static_cast<long long>(m.query_dim),
                 static_cast<long long>(m.key_dim), static_cast<long long>(m.value_dim),
                 m.bias ? 1 : 0, qkv_packed ? "qkv" : (kv_packed ? "kv" : "no"),
                 call.attn_weights != nullptr ? "weights" : "fused",
                 static_cast<double>(call.dropout_p), variants_of(kernel_call).c_str(),
                 blis_kernel_set(), threads, proj_ms, attn_ms, ms_since(t2));
  }
  return MHA_OK;
}

}  // namespace mha::rt
