// The module's backward pass.  With X the inputs, P = X·Wᵀ + b the
// projections (per head: Q, K, V), C the concatenated heads' attention and
// out = C·W_oᵀ + b_o:
//
//   0. recompute P and C with the attention's LSE (nothing is kept from the
//      forward call: activation checkpointing);
//   1. dC = dout·W_o, one sgemm;
//   2. dQ, dK, dV from mha_attention_backward on the heads' views of P, C and
//      dC (the fused FlashAttention-2 backward: nothing of size Lq x Lk);
//   3. the gradients, all written after every computation that could fail:
//        dW_o = doutᵀ·C,  db_o = Σ_rows dout,
//        dW_x = dP_xᵀ·X_x, db_x = Σ_rows dP_x, dX_x = dP_x·W_x  (x = q, k, v),
//      each product one sgemm (BLIS never splits the summed dimension, so
//      the bits do not depend on the thread count), the bias sums in double
//      in row order.
//
// Every scratch buffer (P, C, dC, dP, the LSE) is O((Lq + Lk)·E) and per
// calling thread; it grows to the largest call.
#include <mha/mha.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "attention.h"
#include "backward.h"
#include "blis.h"
#include "env.h"
#include "kernel_mask.h"
#include "module.h"
#include "projections.h"
#include "threads.h"

namespace mha::rt {
namespace {

thread_local AlignedBuffer t_projections, t_mask, t_heads, t_grad_projections, t_lse;

// The rows of a [B, L, F] tensor as sgemm operands, batch by batch when
// `per_batch`, else all B·L rows at once in `order`.
struct Rows {
  const float* data;
  int64_t row_stride, col_stride;
};

// The [rows, width] scratch buffer `base` in the row order of an input: row
// (b, l) of batch b's group when walked per batch.
Rows scratch_rows(const float* base, const RowOrder& order, int64_t width, int64_t group) {
  return {base + group * order.rows * width, width, 1};
}

Rows tensor_rows(const mha_tensor& t, const RowOrder& order, int64_t group) {
  return {static_cast<const float*>(t.data) + group * order.gemm_stride, order.row_stride,
          t.strides[2]};
}

// dst[n] = Σ_rows src[row, n] over a [rows, n] scratch buffer, in double and
// in row order.
void column_sums(const float* src, int64_t rows, int64_t n, mha_tensor* dst) {
  std::vector<double> sums(static_cast<size_t>(n), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < n; ++c)
      sums[static_cast<size_t>(c)] += static_cast<double>(src[r * n + c]);
  }
  auto* out = static_cast<float*>(dst->data);
  for (int64_t c = 0; c < n; ++c) {
    out[c * dst->strides[0]] = static_cast<float>(sums[static_cast<size_t>(c)]);
  }
}

// dX = dP · W into the caller's gradient of an input, whose rows may be in
// another order than dP's (dP follows the input's own order): one sgemm
// when both orders agree, else one per batch.  beta = 1 adds (self-attention's
// gradients summed into one tensor).
void input_gradient(const float* dp, const RowOrder& dp_order, int64_t e, const float* wt,
                    int64_t ld, float beta, mha_tensor* dx, int32_t threads) {
  const int64_t batch = dx->shape[0], len = dx->shape[1], in = dx->shape[2];
  const RowOrder dx_order = row_order(*dx);
  auto* out = static_cast<float*>(dx->data);
  // W (n, c) is Wᵀ's element (c, n): wt[c·ld + n].
  if (dx_order.gemms == 1 && dp_order.gemms == 1 && dx_order.seq_major == dp_order.seq_major) {
    sgemm(dx_order.rows, in, e, 1.0f, dp, e, 1, wt, 1, ld, beta, out, dx_order.row_stride,
          dx->strides[2], sgemm_threads(dx_order.rows, in, e, threads));
    return;
  }
  const int32_t t = sgemm_threads(len, in, e, threads);
  for (int64_t b = 0; b < batch; ++b) {
    // Batch b's rows of dP: every B-th row from row b when sequence-major.
    const float* a = dp_order.seq_major ? dp + b * e : dp + b * len * e;
    const int64_t rsa = dp_order.seq_major ? batch * e : e;
    sgemm(len, in, e, 1.0f, a, rsa, 1, wt, 1, ld, beta, out + b * dx->strides[0], dx->strides[1],
          dx->strides[2], t);
  }
}

// One input projection's gradients: dW = dPᵀ·X and db = Σ dP (its weight and
// bias), dX = dP·W (the input's, accumulated when `accumulate`).
struct InputSide {
  const mha_tensor* x;
  RowOrder order;
  const float* dp;  // [B·L, E] in x's row order
  const float* wt;  // Wᵀ [in, E], row stride ld
  int64_t ld;
  mha_tensor* dw;
  mha_tensor* db;
  mha_tensor* dx;
  bool accumulate;
};

void input_side_gradients(const InputSide& s, int64_t e, int32_t threads) {
  const int64_t rows = s.x->shape[0] * s.x->shape[1];
  const int64_t in = s.x->shape[2];
  if (s.dw != nullptr) {
    auto* dw = static_cast<float*>(s.dw->data);
    const int32_t t = sgemm_threads(e, in, s.order.rows, threads);
    for (int64_t g = 0; g < s.order.gemms; ++g) {
      const Rows a = scratch_rows(s.dp, s.order, e, g);
      const Rows b = tensor_rows(*s.x, s.order, g);
      // dW (n, c) = Σ_r dP (r, n) · X (r, c): A = dPᵀ.
      sgemm(e, in, s.order.rows, 1.0f, a.data, a.col_stride, a.row_stride, b.data, b.row_stride,
            b.col_stride, g > 0 ? 1.0f : 0.0f, dw, s.dw->strides[0], s.dw->strides[1], t);
    }
  }
  if (s.db != nullptr) column_sums(s.dp, rows, e, s.db);
  if (s.dx != nullptr) {
    input_gradient(s.dp, s.order, e, s.wt, s.ld, s.accumulate ? 1.0f : 0.0f, s.dx, threads);
  }
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

mha_status run_module_backward(const ModuleCall& call, const mha_tensor* dout_tensor,
                               const mha_module_gradients& grads) {
  const mha_module& m = *call.module;
  const int64_t batch = call.batch, lq = call.lq, lk = call.lk;
  const int64_t e = m.embed_dim, heads = m.num_heads, d = m.head_dim;
  const int64_t q_rows = batch * lq, kv_rows = batch * lk;
  const int32_t threads = num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  const mha_tensor& dout = *dout_tensor;

  // ---- 0. the forward again: P, then C (in dout's row order) with the LSE
  const Projections proj = project_inputs(call, t_projections, threads);
  const RowOrder out_order = row_order(dout);
  auto* heads_buf = static_cast<float*>(take(t_heads, float_bytes(2 * q_rows * e)));
  float* concat = heads_buf;
  float* dconcat = heads_buf + q_rows * e;
  mha_tensor cv, dcv;
  head_view(concat, batch, heads, lq, d, e, out_order.seq_major, 0, &cv);
  head_view(dconcat, batch, heads, lq, d, e, out_order.seq_major, 0, &dcv);
  mha_tensor kernel_mask;
  const bool has_mask = build_kernel_mask(call, heads, t_mask, &kernel_mask);
  mha_attention_params ap = module_attention_params(call, has_mask ? &kernel_mask : nullptr);
  mha_tensor lse{};
  lse.data = take(t_lse, float_bytes(batch * heads * lq));
  lse.dtype = MHA_DTYPE_F32;
  lse.ndim = 3;
  lse.shape[0] = batch;
  lse.shape[1] = heads;
  lse.shape[2] = lq;
  lse.strides[0] = heads * lq;
  lse.strides[1] = lq;
  lse.strides[2] = 1;
  ap.lse = &lse;
  KernelCall kernel_call;
  describe_attention(proj.q, proj.k, proj.v, cv, ap, &kernel_call);
  if (mha_status s = attend(kernel_call); s != MHA_OK) return s;

  // ---- 1. dC = dout · W_o (W_o (n, m) is W_oᵀ's element (m, n))
  const auto* dout_data = static_cast<const float*>(dout.data);
  {
    const int32_t t = sgemm_threads(out_order.rows, e, e, threads);
    for (int64_t g = 0; g < out_order.gemms; ++g) {
      const Rows a = tensor_rows(dout, out_order, g);
      sgemm(out_order.rows, e, e, 1.0f, a.data, a.row_stride, a.col_stride, m.w_out.data(), 1, e,
            0.0f, dconcat + g * out_order.rows * e, e, 1, t);
    }
  }

  // ---- 2. the attention's backward, into dP (each in its input's row order)
  auto* dp = static_cast<float*>(take(t_grad_projections, float_bytes((q_rows + 2 * kv_rows) * e)));
  float* dp_q = dp;
  float* dp_k = dp_q + q_rows * e;
  float* dp_v = dp_k + kv_rows * e;
  mha_tensor dqv, dkv, dvv;
  head_view(dp_q, batch, heads, lq, d, e, proj.q_order.seq_major, 0, &dqv);
  head_view(dp_k, batch, heads, lk, d, e, proj.k_order.seq_major, 0, &dkv);
  head_view(dp_v, batch, heads, lk, d, e, proj.v_order.seq_major, 0, &dvv);
  mha_backward_params bp;
  mha_backward_params_init(&bp);
  bp.dsinks = grads.sinks;
  ap.lse = nullptr;
  if (mha_status s = attention_backward(&proj.q, &proj.k, &proj.v, &cv, &lse, &dcv, &dqv, &dkv,
                                        &dvv, &ap, &bp);
      s != MHA_OK) {
    return s;
  }
  const double attention_ms = ms_since(t0);

  // ---- 3. the gradients of the weights, the biases and the inputs
  const auto t3 = std::chrono::steady_clock::now();
  if (grads.out_proj_weight != nullptr) {
    mha_tensor& dw = *grads.out_proj_weight;
    const int32_t t = sgemm_threads(e, e, out_order.rows, threads);
    for (int64_t g = 0; g < out_order.gemms; ++g) {
      const Rows a = tensor_rows(dout, out_order, g);
      const Rows c = scratch_rows(concat, out_order, e, g);
      // dW_o (n, m) = Σ_r dout (r, n) · C (r, m): A = doutᵀ.
      sgemm(e, e, out_order.rows, 1.0f, a.data, a.col_stride, a.row_stride, c.data, c.row_stride,
            c.col_stride, g > 0 ? 1.0f : 0.0f, static_cast<float*>(dw.data), dw.strides[0],
            dw.strides[1], t);
    }
  }
  if (grads.out_proj_bias != nullptr) {
    std::vector<double> sums(static_cast<size_t>(e), 0.0);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < lq; ++i) {
        const float* row = dout_data + b * dout.strides[0] + i * dout.strides[1];
        for (int64_t n = 0; n < e; ++n)
          sums[static_cast<size_t>(n)] += static_cast<double>(row[n * dout.strides[2]]);
      }
    }
    mha_tensor& db = *grads.out_proj_bias;
    for (int64_t n = 0; n < e; ++n) {
      static_cast<float*>(db.data)[n * db.strides[0]] =
          static_cast<float>(sums[static_cast<size_t>(n)]);
    }
  }
  const bool key_adds =
      grads.key != nullptr && grads.query != nullptr && same_tensor(*grads.key, *grads.query);
  const bool value_adds = grads.value != nullptr &&
                          ((grads.query != nullptr && same_tensor(*grads.value, *grads.query)) ||
                           (grads.key != nullptr && same_tensor(*grads.value, *grads.key)));
  const InputSide sides[3] = {
      {call.query, proj.q_order, dp_q, m.w_q(), m.wq_t.ld, grads.q_proj_weight, grads.q_proj_bias,
       grads.query, false},
      {call.key, proj.k_order, dp_k, m.w_k(), m.wk_t.ld, grads.k_proj_weight, grads.k_proj_bias,
       grads.key, key_adds},
      {call.value, proj.v_order, dp_v, m.w_v(), m.wv_t.ld, grads.v_proj_weight, grads.v_proj_bias,
       grads.value, value_adds},
  };
  for (const InputSide& side : sides) input_side_gradients(side, e, threads);

  if (verbose_level() >= 2) {
    std::fprintf(stderr,
                 "mha_verbose,exec,module_backward,B=%lld,Lq=%lld,Lk=%lld,E=%lld,H=%lld,Eq=%lld,"
                 "Ek=%lld,Ev=%lld,bias=%d,packed=%s,dropout=%g,variants=%s,blis=%s,gemm_ukernel=%s,"
                 "threads=%d,"
                 "forward_and_attention_ms=%.4f,projections_ms=%.4f\n",
                 static_cast<long long>(batch), static_cast<long long>(lq),
                 static_cast<long long>(lk), static_cast<long long>(e),
                 static_cast<long long>(heads), static_cast<long long>(m.query_dim),
                 static_cast<long long>(m.key_dim), static_cast<long long>(m.value_dim),
                 m.bias ? 1 : 0, proj.qkv_packed ? "qkv" : (proj.kv_packed ? "kv" : "no"),
                 static_cast<double>(call.dropout_p), variants_of(kernel_call).c_str(),
                 blis_kernel_set(), gemm_ukernel_in_use(), threads, attention_ms, ms_since(t3));
  }
  return MHA_OK;
}

}  // namespace mha::rt
