// The module's input projections: one BLIS sgemm over all B·L rows of an
// input, in the input's own row order, the biases a row of the product.
#include "projections.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>

#include "bf16_products.h"
#include "blis.h"
#include "common/dtype.h"
#include "registry.h"
#include "threads.h"

namespace mha::rt {
namespace {

// fp32 projections before their rounding (project_inputs into a half dtype
// where the tiles do not write it), per calling thread.
thread_local AlignedBuffer t_unrounded;

// dst rows (in `order`, `width` wide, columns [0, n)) = x · wt (+ the biases),
// with wt the transposed weights [K, n] (row stride ld) and x [B, L, K].
// With biases (in the row below wt: module.h), x's rows are copied beside a
// column of ones into `staging` first, and one product over K + 1 adds them.
// Presetting dst with the biases instead made the product read every output
// row once more: module S1's fused QKV product (4096 x 2304 x 768) on Zen 5
// took 74.1-79.3 ms that way, 72.4-73.7 ms this way (the copy 0.8 ms of it).
// A bf16 or f16 x is widened to fp32 by the same copy (with or without
// biases): BLIS's products are fp32.
// Returns whether the product ran as bf16 products on AMX tiles
// (bf16_products.h).
bool project(const mha_module& m, const mha_tensor& x, const RowOrder& order, const float* wt,
             int64_t ld, int64_t n, bool bias, float* staging, float* dst, int64_t width,
             int32_t threads) {
  if (project_bf16(m, x, order, wt, ld, n, bias, dst, width, threads)) return true;
  const int64_t k = x.shape[2];
  const bool widen = x.dtype != MHA_DTYPE_F32;
  if (!bias && !widen) {
    const auto* src = static_cast<const float*>(x.data);
    const int32_t t = sgemm_threads(order.rows, n, k, threads);
    for (int64_t g = 0; g < order.gemms; ++g) {
      sgemm(order.rows, n, k, 1.0f, src + g * order.gemm_stride, order.row_stride, x.strides[2], wt,
            ld, 1, 0.0f, dst + g * order.rows * width, width, 1, t);
    }
    return false;
  }
  const int64_t lda = ones_row_width(k), rows = order.gemms * order.rows;
  const int64_t depth = bias ? k + 1 : k;
  // In blocks of rows over the threads the product will use.
  constexpr int64_t kBlockRows = 256;
  const int32_t team = sgemm_threads(rows, n, depth, threads);
  auto no_preparation = [](int32_t /*thread*/) { return true; };
  run_team((rows + kBlockRows - 1) / kBlockRows, team, no_preparation,
           [&](int64_t block, int32_t /*thread*/) {
             const int64_t end = std::min(rows, (block + 1) * kBlockRows);
             for (int64_t r = block * kBlockRows; r < end; ++r) {
               const int64_t g = r / order.rows, i = r % order.rows;
               const int64_t from = g * order.gemm_stride + i * order.row_stride;
               float* row = staging + r * lda;
               if (widen) {
                 mha_types::widen_row(x.data, x.dtype, from, x.strides[2], k, row);
               } else if (x.strides[2] == 1) {
                 std::memcpy(row, static_cast<const float*>(x.data) + from, float_bytes(k));
               } else {
                 const auto* src = static_cast<const float*>(x.data) + from;
                 for (int64_t c = 0; c < k; ++c) row[c] = src[c * x.strides[2]];
               }
               if (bias) row[k] = 1.0f;
             }
           });
  sgemm(rows, n, depth, 1.0f, staging, lda, 1, wt, ld, 1, 0.0f, dst, width, 1, team);
  return false;
}

}  // namespace

int64_t ones_row_width(int64_t k) {
  return (k + 1 + 15) / 16 * 16;
}

void* take(AlignedBuffer& buffer, size_t bytes) {
  void* memory = buffer.get(bytes);
  if (memory == nullptr) throw std::bad_alloc();
  return memory;
}

RowOrder row_order(const mha_tensor& t) {
  const int64_t batch = t.shape[0], len = t.shape[1], s0 = t.strides[0], s1 = t.strides[1];
  if (batch == 1) return {false, 1, len, s1, 0};
  if (len == 1) return {false, 1, batch, s0, 0};  // one row per batch: either order
  if (s0 == len * s1) return {false, 1, batch * len, s1, 0};
  if (s1 == batch * s0) return {true, 1, batch * len, s0, 0};
  return {false, batch, len, s1, s0};
}

void head_view(void* base, int64_t batch, int64_t heads, int64_t len, int64_t d, int64_t width,
               bool seq_major, int64_t offset, mha_tensor* view, int32_t dtype) {
  std::memset(view, 0, sizeof *view);
  const int64_t bytes = dtype == MHA_DTYPE_F32 ? 4 : 2;
  view->data = static_cast<char*>(base) + offset * bytes;
  view->dtype = dtype;
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

void head_major_view(void* base, int64_t batch, int64_t heads, int64_t len, int64_t d,
                     bool seq_major, int64_t offset, mha_tensor* view, int32_t dtype) {
  head_view(base, batch, heads, len, d, d, seq_major, offset, view, dtype);
  view->strides[1] = batch * len * d;
}

bool same_tensor(const mha_tensor& a, const mha_tensor& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int32_t d = 0; d < a.ndim; ++d) {
    if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

Projections project_inputs(const ModuleCall& call, AlignedBuffer& scratch, int32_t threads,
                           int32_t dtype) {
  const mha_module& m = *call.module;
  const int64_t batch = call.batch, lq = call.lq, lk = call.lk;
  const int64_t e = m.embed_dim, heads = m.num_heads, d = m.head_dim;
  const mha_tensor& query = *call.query;
  const mha_tensor& key = *call.key;
  const mha_tensor& value = *call.value;
  Projections p;
  p.q_order = row_order(query);
  p.k_order = row_order(key);
  p.v_order = row_order(value);
  p.qkv_packed = same_tensor(query, key) && same_tensor(key, value);
  p.kv_packed = !p.qkv_packed && same_tensor(key, value);
  const int64_t q_width = p.qkv_packed ? 3 * e : e;
  const int64_t kv_width = p.kv_packed ? 2 * e : e;
  const int64_t q_rows = batch * lq, kv_rows = batch * lk;
  int64_t floats = q_rows * q_width;
  if (!p.qkv_packed) floats += p.kv_packed ? kv_rows * kv_width : 2 * kv_rows * e;
  floats = (floats + 15) / 16 * 16;
  // The inputs' rows beside a column of ones (or widened from bf16 / f16),
  // one input at a time (project).
  int64_t staging_floats = 0;
  const bool widen =
      query.dtype != MHA_DTYPE_F32 || key.dtype != MHA_DTYPE_F32 || value.dtype != MHA_DTYPE_F32;
  if (m.bias || widen) {
    staging_floats = q_rows * ones_row_width(m.query_dim);
    if (!p.qkv_packed) {
      staging_floats = std::max(staging_floats, kv_rows * ones_row_width(m.key_dim));
      staging_floats = std::max(staging_floats, kv_rows * ones_row_width(m.value_dim));
    }
  }
  // The projections (fp32, or `dtype`'s 2-byte values), then the staging rows.
  const size_t bytes = static_cast<size_t>(floats) * (dtype == MHA_DTYPE_F32 ? 4 : 2);
  char* base = static_cast<char*>(take(scratch, bytes + float_bytes(staging_floats)));
  float* staging = reinterpret_cast<float*>(base + bytes);
  const int64_t k_start = p.qkv_packed ? 0 : q_rows * q_width;
  const int64_t v_start = p.qkv_packed || p.kv_packed ? k_start : k_start + kv_rows * e;
  const int64_t k_width = p.qkv_packed ? q_width : kv_width;
  const int64_t k_offset = p.qkv_packed ? e : 0;
  const int64_t v_offset = p.qkv_packed ? 2 * e : (p.kv_packed ? e : 0);

  const bool bias = m.bias;
  // x · wt into the buffer's rows from element `start` (their width is n).
  const auto product = [&](const mha_tensor& x, const RowOrder& order, const float* wt, int64_t ld,
                           int64_t n, int64_t start) {
    if (dtype == MHA_DTYPE_F32) {
      p.bf16_products += project(m, x, order, wt, ld, n, bias, staging,
                                 reinterpret_cast<float*>(base) + start, n, threads);
      return;
    }
    auto* dst = reinterpret_cast<uint16_t*>(base) + start;
    if (dtype == MHA_DTYPE_BF16 &&
        project_bf16_rounded(m, x, order, wt, ld, n, bias, dst, d, threads)) {
      ++p.bf16_products;
      return;
    }
    // fp32 rows first, then each value rounded once into its head's slab.
    const int64_t rows = order.gemms * order.rows;
    auto* fp32 = static_cast<float*>(take(t_unrounded, float_bytes(rows * n)));
    p.bf16_products += project(m, x, order, wt, ld, n, bias, staging, fp32, n, threads);
    round_into_heads(fp32, rows, n, d, dtype, dst, threads);
  };
  if (p.qkv_packed) {
    product(query, p.q_order, m.w_q(), m.wq_t.ld, 3 * e, 0);
  } else {
    product(query, p.q_order, m.w_q(), m.wq_t.ld, e, 0);
    if (p.kv_packed) {
      product(key, p.k_order, m.w_k(), m.wk_t.ld, 2 * e, k_start);
    } else {
      product(key, p.k_order, m.w_k(), m.wk_t.ld, e, k_start);
      product(value, p.v_order, m.w_v(), m.wv_t.ld, e, v_start);
    }
  }
  p.data = dtype == MHA_DTYPE_F32 ? reinterpret_cast<float*>(base) : nullptr;
  p.floats = q_rows * q_width;
  if (!p.qkv_packed) p.floats += p.kv_packed ? kv_rows * kv_width : 2 * kv_rows * e;
  if (dtype != MHA_DTYPE_F32) {  // heads apart: a product's n columns are n / d slabs
    head_major_view(base, batch, heads, lq, d, p.q_order.seq_major, 0, &p.q, dtype);
    const int64_t k_at = p.qkv_packed ? q_rows * e : k_start;
    head_major_view(base, batch, heads, lk, d, p.k_order.seq_major, k_at, &p.k, dtype);
    head_major_view(base, batch, heads, lk, d, p.v_order.seq_major,
                    p.qkv_packed || p.kv_packed ? k_at + kv_rows * e : v_start, &p.v, dtype);
    return p;
  }
  head_view(base, batch, heads, lq, d, q_width, p.q_order.seq_major, 0, &p.q, dtype);
  head_view(base, batch, heads, lk, d, k_width, p.k_order.seq_major, k_start + k_offset, &p.k,
            dtype);
  head_view(base, batch, heads, lk, d, p.qkv_packed || p.kv_packed ? k_width : e,
            p.v_order.seq_major, v_start + v_offset, &p.v, dtype);
  return p;
}

Narrower::Narrower() {
  // In the selected plugin's vectors where it offers them: one value at a
  // time, the rounding of module S1's projections (9.4 M values) took 13.7
  // ms on one core (Intel family 6 model 167), in AVX-512 vectors about 1.
  const char* why = nullptr;
  const Backend* backend = Registry::instance().selected(&why);
  if (backend != nullptr && backend->plugin != nullptr) narrow_ = backend->plugin->narrow_floats;
}

void Narrower::row(const float* src, int64_t n, void* data, int32_t dtype, int64_t at,
                   int64_t stride) const {
  if (narrow_ != nullptr && stride == 1 && dtype != MHA_DTYPE_F32) {
    narrow_(src, n, static_cast<char*>(data) + at * 2, dtype);
  } else {
    mha_types::narrow_row(src, n, data, dtype, at, stride);
  }
}

void Narrower::in_place(float* x, int64_t n, int32_t dtype) const {
  constexpr int64_t kChunk = 256;  // values rounded through the stack at a time
  uint16_t halves[kChunk];
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t count = std::min(kChunk, n - at);
    row(x + at, count, halves, dtype, 0, 1);
    mha_types::widen_row(halves, dtype, 0, 1, count, x + at);
  }
}

void round_into_heads(const float* src, int64_t rows, int64_t n, int64_t d, int32_t dtype,
                      uint16_t* dst, int32_t threads) {
  const Narrower narrower;
  for_each_row(rows, threads, [&](int64_t r) {
    for (int64_t head = 0; head < n / d; ++head) {
      narrower.row(src + r * n + head * d, d, dst, dtype, head * rows * d + r * d, 1);
    }
  });
}

void round_values(float* src, int64_t n, int32_t dtype, void* dst, int32_t threads) {
  constexpr int64_t kBlock = 16384;  // values a work item: 64 KiB read
  const Narrower narrower;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const auto team = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(threads, blocks)));
  auto no_preparation = [](int32_t /*thread*/) { return true; };
  run_team(blocks, team, no_preparation, [&](int64_t block, int32_t /*thread*/) {
    const int64_t at = block * kBlock, count = std::min(n, at + kBlock) - at;
    if (dst != nullptr) {
      narrower.row(src + at, count, dst, dtype, at, 1);
    } else {
      narrower.in_place(src + at, count, dtype);
    }
  });
}

mha_attention_params module_attention_params(const ModuleCall& call, const mha_tensor* mask) {
  const int64_t d = call.module->head_dim;
  mha_attention_params ap;
  mha_attention_params_init(&ap);
  ap.has_scale = 1;
  ap.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  ap.causal = call.causal;
  ap.valid_lens = call.valid_lens;
  ap.mask = mask;
  ap.dropout_p = call.dropout_p;
  ap.dropout_seed = call.dropout_seed;
  ap.window_left = call.window_left;
  ap.window_right = call.window_right;
  ap.sinks = call.sinks;
  ap.softcap = call.softcap;
  ap.alibi_slopes = call.alibi_slopes;
  return ap;
}

}  // namespace mha::rt
