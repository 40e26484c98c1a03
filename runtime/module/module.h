// The multi-head attention module inside the runtime: its weights and a
// validated forward call.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace mha::rt {
struct Bf16WeightCache;
}  // namespace mha::rt

// The opaque handle of the C API.  Forward calls only read it, so several
// threads may run forward on one module at once; set_weight must not run
// concurrently with anything else on the same module.
struct mha_module {
  int64_t embed_dim = 0;                              // E
  int64_t num_heads = 0;                              // H
  int64_t head_dim = 0;                               // D = E / H
  int64_t query_dim = 0, key_dim = 0, value_dim = 0;  // Eq, Ek, Ev (resolved: never 0)
  bool bias = false;
  float dropout = 0.0f;
  bool half_activations = false;  // config.activations == MHA_ACTIVATIONS_INPUT

  // The weights are kept transposed, Wᵀ [in, E] row-major, because BLIS packs
  // a row-major B operand of x·Wᵀ faster (measured: 8 instead of 12 µs for
  // the d2l example's 8 x 100 x 100 products with the skx kernels; a few
  // percent on large ones).  W_qᵀ, W_kᵀ and W_vᵀ sit side by side where
  // their input sizes agree, so that stacked projections are one product:
  //   Eq = Ek = Ev = K: one [K, 3E] matrix, columns q | k | v (row stride 3E);
  //   else Ek = Ev:     W_qᵀ [Eq, E], then one [Ek, 2E] matrix, columns k | v;
  //   else:             three matrices [Eq, E], [Ek, E], [Ev, E].
  // Each matrix [in, ·] is followed by one more row, its biases (b_q | b_k |
  // b_v side by side where the matrices are; zeros without biases): against
  // an input with a column of ones beside its `in` columns, one product adds
  // them (projections.cpp).  Products onto rows preset with the biases read
  // every output row once more: module S1 took 1.04 times as long that way
  // (Zen 5).  w_out likewise holds b_o in its row E.
  struct Transposed {
    size_t offset = 0;  // into w_in
    int64_t ld = 0;     // row stride
  };
  std::vector<float> w_in;
  Transposed wq_t, wk_t, wv_t;
  std::vector<float> b_in;   // b_q, b_k, b_v [3E] as set; empty without biases
  std::vector<float> w_out;  // W_oᵀ [E, E], then the bias row
  std::vector<float> b_out;  // b_o [E] as set; empty without biases

  const float* w_q() const { return w_in.data() + wq_t.offset; }
  const float* w_k() const { return w_in.data() + wk_t.offset; }
  const float* w_v() const { return w_in.data() + wv_t.offset; }
  // The bias rows of the products (see Transposed).
  float* bias_row_q() { return w_in.data() + wq_t.offset + query_dim * wq_t.ld; }
  float* bias_row_k() { return w_in.data() + wk_t.offset + key_dim * wk_t.ld; }
  float* bias_row_v() { return w_in.data() + wv_t.offset + value_dim * wv_t.ld; }
  float* bias_row_out() { return w_out.data() + embed_dim * embed_dim; }
  // Copies b_in and b_out into the bias rows (after set_weight).
  void sync_bias_rows();
  // The weights packed for a plugin's bf16 products (bf16_products.h), built
  // on first use, dropped by set_weight.
  std::shared_ptr<mha::rt::Bf16WeightCache> bf16_cache;
};

namespace mha::rt {

// A forward call whose arguments have all been checked.
struct ModuleCall {
  const mha_module* module = nullptr;
  const mha_tensor* query = nullptr;  // [B, Lq, Eq]
  const mha_tensor* key = nullptr;    // [B, Lk, Ek]
  const mha_tensor* value = nullptr;  // [B, Lk, Ev]
  const mha_tensor* out = nullptr;    // [B, Lq, E]
  int64_t batch = 0, lq = 0, lk = 0;

  const mha_tensor* valid_lens = nullptr;        // [B] or [B, Lq], values in [0, Lk]
  const mha_tensor* key_padding_mask = nullptr;  // [B, Lk], bool (true = ignore) or f32
  const mha_tensor* attn_mask =
      nullptr;  // [Lq, Lk] or [B*H, Lq, Lk], bool (true = not allowed) or f32
  int32_t causal = MHA_CAUSAL_NONE;
  const mha_tensor* attn_weights = nullptr;  // [B, H, Lq, Lk], or [B, Lq, Lk] when averaged
  bool average_weights = false;
  float dropout_p = 0.0f;  // resolved: 0 in inference mode
  uint64_t dropout_seed = 0;

  // The attention variants (mha_attention_params' semantics).
  int64_t window_left = -1, window_right = -1;  // -1: that side unbounded
  const mha_tensor* sinks = nullptr;            // F32 [H], or nullptr
  float softcap = 0.0f;                         // 0: off
  const mha_tensor* alibi_slopes = nullptr;     // F32 [H] or [B, H], or nullptr
};

// Runs a validated call.  Returns mha_attention's status if that fails (the
// message is its own); nothing has then been written to the outputs.
mha_status run_module_forward(const ModuleCall& call);

// Runs a validated backward call (call.out unused; dout [B, Lq, E] read).
// Returns mha_attention_backward's status if that fails; nothing has then been
// written to the gradients.
mha_status run_module_backward(const ModuleCall& call, const mha_tensor* dout,
                               const mha_module_gradients& grads);

}  // namespace mha::rt
