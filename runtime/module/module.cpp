// The multi-head attention module's C entry points: configuration, weights,
// and the checks of a forward call.  The computation is in module_forward.cpp.
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <new>
#include <string>

#include "bf16_products.h"
#include "blis.h"
#include "common/dtype.h"
#include "error.h"
#include "f32_standins.h"
#include "module.h"
#include "projections.h"
#include "registry.h"
#include "validate.h"
#include "versioned.h"

using namespace mha::rt;

void mha_module::sync_bias_rows() {
  if (!bias) return;
  const auto e = static_cast<std::ptrdiff_t>(embed_dim);
  std::copy(b_in.begin(), b_in.begin() + e, bias_row_q());
  std::copy(b_in.begin() + e, b_in.begin() + 2 * e, bias_row_k());
  std::copy(b_in.begin() + 2 * e, b_in.end(), bias_row_v());
  std::copy(b_out.begin(), b_out.end(), bias_row_out());
}

namespace {

long long ll(int64_t x) {
  return static_cast<long long>(x);
}

// ---------------------------------------------------------------- configuration

mha_status check_config(const mha_module_config* c) {
  if (c->embed_dim <= 0) {
    return fail(MHA_ERR_INVALID_SIZE, "config->embed_dim = %lld; it must be positive",
                ll(c->embed_dim));
  }
  if (c->num_heads <= 0) {
    return fail(MHA_ERR_INVALID_SIZE, "config->num_heads = %lld; it must be positive",
                ll(c->num_heads));
  }
  if (c->embed_dim % c->num_heads != 0) {
    return fail(MHA_ERR_INVALID_SIZE,
                "config->embed_dim = %lld is not a multiple of config->num_heads = %lld",
                ll(c->embed_dim), ll(c->num_heads));
  }
  const struct {
    const char* name;
    int64_t value;
  } dims[] = {{"query_dim", c->query_dim}, {"key_dim", c->key_dim}, {"value_dim", c->value_dim}};
  for (const auto& d : dims) {
    if (d.value < 0) {
      return fail(MHA_ERR_INVALID_SIZE,
                  "config->%s = %lld; it must be positive, or 0 for embed_dim", d.name,
                  ll(d.value));
    }
  }
  if (c->activations != MHA_ACTIVATIONS_F32 && c->activations != MHA_ACTIVATIONS_INPUT) {
    return fail(MHA_ERR_INVALID_VALUE,
                "config->activations = %d; it must be MHA_ACTIVATIONS_F32 (0) or "
                "MHA_ACTIVATIONS_INPUT (1)",
                static_cast<int>(c->activations));
  }
  if (!(c->dropout >= 0.0f && c->dropout < 1.0f)) {
    return fail(MHA_ERR_INVALID_VALUE, "config->dropout = %g; it must be in [0, 1)",
                static_cast<double>(c->dropout));
  }
  // Every weight's element count (and 3E x max(dim) for the stacked input
  // weights) must fit, with room to spare for the byte count.
  const int64_t e = c->embed_dim;
  const int64_t resolved[3] = {c->query_dim != 0 ? c->query_dim : e,
                               c->key_dim != 0 ? c->key_dim : e,
                               c->value_dim != 0 ? c->value_dim : e};
  int64_t total = 0, product = 0;
  if (__builtin_mul_overflow(e, e, &product) || __builtin_add_overflow(total, product, &total)) {
    return fail(MHA_ERR_SIZE_OVERFLOW, "config->embed_dim = %lld: the weights overflow 64 bits",
                ll(e));
  }
  for (int64_t dim : resolved) {
    if (__builtin_mul_overflow(e, dim, &product) ||
        __builtin_add_overflow(total, product, &total)) {
      return fail(MHA_ERR_SIZE_OVERFLOW, "the weights' sizes overflow 64 bits");
    }
  }
  if (total > INT64_MAX / 16) return fail(MHA_ERR_SIZE_OVERFLOW, "the weights are too large");
  if (c->embed_dim > MHA_MAX_EXTENT || c->num_heads > MHA_MAX_EXTENT) {
    return fail(MHA_ERR_INVALID_SIZE, "config->%s = %lld exceeds MHA_MAX_EXTENT = 2^40",
                c->embed_dim > MHA_MAX_EXTENT ? "embed_dim" : "num_heads",
                ll(std::max(c->embed_dim, c->num_heads)));
  }
  if (c->embed_dim / c->num_heads > MHA_MAX_HEAD_DIM) {
    return fail(MHA_ERR_INVALID_SIZE,
                "config->embed_dim / config->num_heads = %lld (the head size) exceeds "
                "MHA_MAX_HEAD_DIM = %d",
                ll(c->embed_dim / c->num_heads), MHA_MAX_HEAD_DIM);
  }
  for (const auto& d : dims) {
    if (d.value > MHA_MAX_EXTENT) {
      return fail(MHA_ERR_INVALID_SIZE, "config->%s = %lld exceeds MHA_MAX_EXTENT = 2^40", d.name,
                  ll(d.value));
    }
  }
  return MHA_OK;
}

// ---------------------------------------------------------------- weights

// Where one named weight goes: `rows` x `cols`, element (r, c) to
// dst[c * ld + r] (stored transposed); cols = 0: a vector of `rows`, to dst[r].
struct WeightSlot {
  float* dst = nullptr;
  int64_t ld = 0;
  int64_t rows = 0, cols = 0;
  const char* expected = "";  // "[3E, E]"
};

const char kKnownNames[] =
    "in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight, in_proj_bias, "
    "out_proj.weight, out_proj.bias (PyTorch), W_q.weight, W_k.weight, W_v.weight, W_o.weight "
    "and their .bias (d2l)";

bool is_one_of(const char* name, const char* a, const char* b = nullptr) {
  return std::strcmp(name, a) == 0 || (b != nullptr && std::strcmp(name, b) == 0);
}

mha_status find_slot(mha_module* m, const char* name, WeightSlot* slot) {
  const int64_t e = m->embed_dim;
  bool is_bias = false;
  if (is_one_of(name, "in_proj_weight")) {
    if (m->query_dim != e || m->key_dim != e || m->value_dim != e) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "'in_proj_weight' needs query_dim = key_dim = value_dim = embed_dim, but they "
                  "are %lld, %lld, %lld and %lld: set q_proj_weight, k_proj_weight and "
                  "v_proj_weight instead",
                  ll(m->query_dim), ll(m->key_dim), ll(m->value_dim), ll(e));
    }
    *slot = {m->w_in.data() + m->wq_t.offset, m->wq_t.ld, 3 * e, e, "[3E, E]"};
  } else if (is_one_of(name, "q_proj_weight", "W_q.weight")) {
    *slot = {m->w_in.data() + m->wq_t.offset, m->wq_t.ld, e, m->query_dim, "[E, query_dim]"};
  } else if (is_one_of(name, "k_proj_weight", "W_k.weight")) {
    *slot = {m->w_in.data() + m->wk_t.offset, m->wk_t.ld, e, m->key_dim, "[E, key_dim]"};
  } else if (is_one_of(name, "v_proj_weight", "W_v.weight")) {
    *slot = {m->w_in.data() + m->wv_t.offset, m->wv_t.ld, e, m->value_dim, "[E, value_dim]"};
  } else if (is_one_of(name, "out_proj.weight", "W_o.weight")) {
    *slot = {m->w_out.data(), e, e, e, "[E, E]"};
  } else if (is_one_of(name, "in_proj_bias")) {
    is_bias = true;
    *slot = {m->b_in.data(), 0, 3 * e, 0, "[3E]"};
  } else if (is_one_of(name, "W_q.bias") || is_one_of(name, "W_k.bias") ||
             is_one_of(name, "W_v.bias")) {
    is_bias = true;
    const int64_t which = name[2] == 'q' ? 0 : (name[2] == 'k' ? 1 : 2);
    *slot = {m->b_in.data() + which * e, 0, e, 0, "[E]"};
  } else if (is_one_of(name, "out_proj.bias", "W_o.bias")) {
    is_bias = true;
    *slot = {m->b_out.data(), 0, e, 0, "[E]"};
  } else {
    return fail(MHA_ERR_INVALID_VALUE, "unknown weight name '%s'; the module has %s", name,
                kKnownNames);
  }
  if (is_bias && !m->bias) {
    return fail(MHA_ERR_INVALID_VALUE,
                "'%s': this module has no biases (it was created with config.bias = 0)", name);
  }
  return MHA_OK;
}

// ---------------------------------------------------------------- forward checks

// A mask: bool, or additive in f32 or the query's dtype (PyTorch's rule for
// a float mask: the query's dtype).
mha_status check_mask_dtype(const mha_tensor* t, const char* name, int32_t query_dtype) {
  if (t->dtype == MHA_DTYPE_BOOL || t->dtype == MHA_DTYPE_F32 || t->dtype == query_dtype) {
    return MHA_OK;
  }
  if (query_dtype == MHA_DTYPE_F32) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be bool or f32", name,
                dtype_name(t->dtype));
  }
  return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be bool, f32 or the query's (%s)",
              name, dtype_name(t->dtype), dtype_name(query_dtype));
}

// An input (widened to fp32 as it is read) or a gradient of the backward
// (rounded once from fp32): f32, bf16 or f16.
mha_status check_f32_or_half(const mha_tensor* t, const char* name) {
  if (t->dtype == MHA_DTYPE_F32 || t->dtype == MHA_DTYPE_BF16 || t->dtype == MHA_DTYPE_F16) {
    return MHA_OK;
  }
  return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be f32, bf16 or f16", name,
              dtype_name(t->dtype));
}

// An output of the forward pass: f32 or the query's dtype (rounded once).
mha_status check_output_dtype(const mha_tensor* t, const char* name, int32_t query_dtype) {
  if (t->dtype == MHA_DTYPE_F32 || t->dtype == query_dtype) return MHA_OK;
  return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be f32 or the query's dtype (%s)",
              name, dtype_name(t->dtype), dtype_name(query_dtype));
}

// The checks of a forward call, and of the backward's, which takes the same
// arguments with dout ([B, Lq, E], read) in out's place.
enum class OutRole { kWritten, kRead };

mha_status check_forward(mha_module* module, const mha_tensor* query, const mha_tensor* key,
                         const mha_tensor* value, const mha_tensor* out, const char* out_name,
                         OutRole out_role, const mha_module_forward_params* params,
                         ModuleCall* call) {
  if (module == nullptr) return fail(MHA_ERR_NULL_POINTER, "module is NULL");
  mha_module_forward_params defaults;
  mha_module_forward_params_init(&defaults);
  mha_module_forward_params given = defaults;
  if (params == nullptr) {
    params = &defaults;
  } else {
    if (mha_status s = read_versioned(params, defaults, kModuleForwardParamsSizes, "params",
                                      "mha_module_forward_params_init", &given);
        s != MHA_OK) {
      return s;
    }
    params = &given;
  }
  const mha_tensor* tensors[4] = {query, key, value, out};
  const char* names[4] = {"query", "key", "value", out_name};
  for (int i = 0; i < 4; ++i) {
    if (mha_status s = check_tensor(tensors[i], names[i], 3, 3); s != MHA_OK) return s;
  }
  // The inputs, f32 or half; out (or the backward's dout, which has out's
  // dtype) f32 or the query's dtype.
  for (int i = 0; i < 3; ++i) {
    if (mha_status s = check_f32_or_half(tensors[i], names[i]); s != MHA_OK) return s;
  }
  if (mha_status s = check_output_dtype(out, out_name, query->dtype); s != MHA_OK) return s;

  const mha_module& m = *module;
  const int64_t batch = query->shape[0], lq = query->shape[1], lk = key->shape[1];
  const int64_t e = m.embed_dim, h = m.num_heads;
  const struct {
    const mha_tensor* t;
    const char* name;
    int64_t dim;
    const char* config_name;
  } features[] = {{query, "query", m.query_dim, "query_dim"},
                  {key, "key", m.key_dim, "key_dim"},
                  {value, "value", m.value_dim, "value_dim"}};
  for (const auto& f : features) {
    if (f.t->shape[2] != f.dim) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "%s has %lld features (shape %s) but the module's %s is %lld", f.name,
                  ll(f.t->shape[2]), shape_text(*f.t).c_str(), f.config_name, ll(f.dim));
    }
  }
  if (key->shape[0] != batch || value->shape[0] != batch) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "batch: query has %lld but key has %lld and value %lld (shapes are [B, L, E])",
                ll(batch), ll(key->shape[0]), ll(value->shape[0]));
  }
  if (value->shape[1] != lk) {
    return fail(MHA_ERR_SHAPE_MISMATCH, "key length: key has %lld but value has %lld", ll(lk),
                ll(value->shape[1]));
  }
  if (out->shape[0] != batch || out->shape[1] != lq || out->shape[2] != e) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "%s has shape %s; it must be [B, Lq, E] = [%lld, %lld, %lld]", out_name,
                shape_text(*out).c_str(), ll(batch), ll(lq), ll(e));
  }

  if (params->causal != MHA_CAUSAL_NONE && params->causal != MHA_CAUSAL_TOP_LEFT &&
      params->causal != MHA_CAUSAL_BOTTOM_RIGHT) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->causal = %d; it must be MHA_CAUSAL_NONE, _TOP_LEFT or _BOTTOM_RIGHT",
                params->causal);
  }
  if (mha_status s = check_window(params->window_left, params->window_right); s != MHA_OK) {
    return s;
  }
  if (mha_status s = check_variants(params->sinks, params->softcap, params->alibi_slopes, batch, h,
                                    "params->");
      s != MHA_OK) {
    return s;
  }
  if (params->valid_lens != nullptr) {
    if (mha_status s = check_valid_lens(params->valid_lens, "params->valid_lens", batch, lq, lk);
        s != MHA_OK)
      return s;
  }
  if (const mha_tensor* kpm = params->key_padding_mask; kpm != nullptr) {
    if (mha_status s = check_tensor(kpm, "params->key_padding_mask", 2, 2); s != MHA_OK) return s;
    if (mha_status s = check_mask_dtype(kpm, "params->key_padding_mask", query->dtype);
        s != MHA_OK) {
      return s;
    }
    if (kpm->shape[0] != batch || kpm->shape[1] != lk) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "params->key_padding_mask has shape %s; it must be [B, Lk] = [%lld, %lld]",
                  shape_text(*kpm).c_str(), ll(batch), ll(lk));
    }
  }
  if (const mha_tensor* am = params->attn_mask; am != nullptr) {
    if (mha_status s = check_tensor(am, "params->attn_mask", 2, 3); s != MHA_OK) return s;
    if (mha_status s = check_mask_dtype(am, "params->attn_mask", query->dtype); s != MHA_OK) {
      return s;
    }
    const bool two_d = am->ndim == 2 && am->shape[0] == lq && am->shape[1] == lk;
    const bool three_d =
        am->ndim == 3 && am->shape[0] == batch * h && am->shape[1] == lq && am->shape[2] == lk;
    if (!two_d && !three_d) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "params->attn_mask has shape %s; it must be [Lq, Lk] = [%lld, %lld] or "
                  "[B*H, Lq, Lk] = [%lld, %lld, %lld]",
                  shape_text(*am).c_str(), ll(lq), ll(lk), ll(batch * h), ll(lq), ll(lk));
    }
  }
  const mha_tensor* weights = params->attn_weights;
  const bool average = params->average_attn_weights != 0;
  if (weights != nullptr) {
    const int32_t rank = average ? 3 : 4;
    if (mha_status s = check_tensor(weights, "params->attn_weights", rank, rank); s != MHA_OK) {
      return s;
    }
    if (mha_status s = check_output_dtype(weights, "params->attn_weights", query->dtype);
        s != MHA_OK) {
      return s;
    }
    const bool ok =
        average ? weights->shape[0] == batch && weights->shape[1] == lq && weights->shape[2] == lk
                : weights->shape[0] == batch && weights->shape[1] == h && weights->shape[2] == lq &&
                      weights->shape[3] == lk;
    if (!ok) {
      if (average) {
        return fail(MHA_ERR_SHAPE_MISMATCH,
                    "params->attn_weights has shape %s; averaged over heads it must be "
                    "[B, Lq, Lk] = [%lld, %lld, %lld]",
                    shape_text(*weights).c_str(), ll(batch), ll(lq), ll(lk));
      }
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "params->attn_weights has shape %s; it must be [B, H, Lq, Lk] = [%lld, %lld, "
                  "%lld, %lld]",
                  shape_text(*weights).c_str(), ll(batch), ll(h), ll(lq), ll(lk));
    }
  }

  // (attn_weights last: it is checked against the others, not itself.)
  const mha_tensor* inputs[] = {query,
                                key,
                                value,
                                params->valid_lens,
                                params->key_padding_mask,
                                params->attn_mask,
                                params->sinks,
                                params->alibi_slopes,
                                weights};
  const char* input_names[] = {"query",
                               "key",
                               "value",
                               "params->valid_lens",
                               "params->key_padding_mask",
                               "params->attn_mask",
                               "params->sinks",
                               "params->alibi_slopes",
                               "params->attn_weights"};
  constexpr int kInputs = static_cast<int>(std::size(inputs));
  if (out_role == OutRole::kWritten) {
    if (mha_status s = check_no_overlap(*out, out_name, inputs, input_names, kInputs);
        s != MHA_OK) {
      return s;
    }
  }
  if (weights != nullptr) {
    if (mha_status s =
            check_no_overlap(*weights, "params->attn_weights", inputs, input_names, kInputs - 1);
        s != MHA_OK) {
      return s;
    }
  }

  call->module = module;
  call->query = query;
  call->key = key;
  call->value = value;
  call->out = out;
  call->batch = batch;
  call->lq = lq;
  call->lk = lk;
  call->valid_lens = params->valid_lens;
  call->key_padding_mask = params->key_padding_mask;
  call->attn_mask = params->attn_mask;
  call->causal = params->causal;
  call->attn_weights = weights;
  call->average_weights = average;
  call->dropout_p = params->training != 0 ? m.dropout : 0.0f;
  call->dropout_seed = params->dropout_seed;
  call->window_left = params->window_left;
  call->window_right = params->window_right;
  call->sinks = params->sinks;
  call->softcap = params->softcap;
  call->alibi_slopes = params->alibi_slopes;
  return MHA_OK;
}

// ---------------------------------------------------------------- backward checks

// The gradients of a backward call: each shaped like what it differentiates,
// F32, BF16 or F16 (rounded once from fp32), and written only where no input or other gradient is
// -- except that identical query, key and value gradients (self-attention) receive a sum.
mha_status check_gradients(const mha_module& m, const ModuleCall& call, const mha_tensor* dout,
                           const mha_module_gradients& g) {
  const int64_t e = m.embed_dim;
  const struct {
    mha_tensor* t;
    const char* name;
    int64_t rows, cols;  // cols = 0: a vector; rows = -1: like the input
    const mha_tensor* like;
    bool bias;
  } grads[] = {
      {g.query, "grads->query", -1, 0, call.query, false},
      {g.key, "grads->key", -1, 0, call.key, false},
      {g.value, "grads->value", -1, 0, call.value, false},
      {g.q_proj_weight, "grads->q_proj_weight", e, m.query_dim, nullptr, false},
      {g.k_proj_weight, "grads->k_proj_weight", e, m.key_dim, nullptr, false},
      {g.v_proj_weight, "grads->v_proj_weight", e, m.value_dim, nullptr, false},
      {g.q_proj_bias, "grads->q_proj_bias", e, 0, nullptr, true},
      {g.k_proj_bias, "grads->k_proj_bias", e, 0, nullptr, true},
      {g.v_proj_bias, "grads->v_proj_bias", e, 0, nullptr, true},
      {g.out_proj_weight, "grads->out_proj_weight", e, e, nullptr, false},
      {g.out_proj_bias, "grads->out_proj_bias", e, 0, nullptr, true},
      {g.sinks, "grads->sinks", m.num_heads, 0, nullptr, false},
  };
  constexpr int kGrads = static_cast<int>(std::size(grads));
  for (const auto& grad : grads) {
    if (grad.t == nullptr) continue;
    const int32_t rank = grad.like != nullptr ? 3 : (grad.cols == 0 ? 1 : 2);
    if (mha_status s = check_tensor(grad.t, grad.name, rank, rank); s != MHA_OK) return s;
    if (mha_status s = check_f32_or_half(grad.t, grad.name); s != MHA_OK) return s;
    if (grad.bias && !m.bias) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "%s is given but this module has no biases (config.bias = 0)", grad.name);
    }
    if (grad.t == g.sinks && call.sinks == nullptr) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "grads->sinks is given but params->sinks is NULL: there is no sink to "
                  "differentiate");
    }
    bool ok = true;
    if (grad.like != nullptr) {
      for (int32_t axis = 0; axis < 3; ++axis)
        ok = ok && grad.t->shape[axis] == grad.like->shape[axis];
      if (!ok) {
        return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must have the input's shape %s",
                    grad.name, shape_text(*grad.t).c_str(), shape_text(*grad.like).c_str());
      }
      continue;
    }
    ok = grad.t->shape[0] == grad.rows && (rank == 1 || grad.t->shape[1] == grad.cols);
    if (!ok) {
      if (rank == 1) {
        return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must be [%lld]", grad.name,
                    shape_text(*grad.t).c_str(), ll(grad.rows));
      }
      return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must be [%lld, %lld]", grad.name,
                  shape_text(*grad.t).c_str(), ll(grad.rows), ll(grad.cols));
    }
  }
  const mha_tensor* inputs[] = {call.query,     call.key,        call.value,
                                dout,           call.valid_lens, call.key_padding_mask,
                                call.attn_mask, call.sinks,      call.alibi_slopes};
  const char* input_names[] = {"query",
                               "key",
                               "value",
                               "dout",
                               "params->valid_lens",
                               "params->key_padding_mask",
                               "params->attn_mask",
                               "params->sinks",
                               "params->alibi_slopes"};
  constexpr int kInputs = static_cast<int>(std::size(inputs));
  for (int a = 0; a < kGrads; ++a) {
    if (grads[a].t == nullptr) continue;
    if (mha_status s = check_no_overlap(*grads[a].t, grads[a].name, inputs, input_names, kInputs);
        s != MHA_OK) {
      return s;
    }
    for (int b = a + 1; b < kGrads; ++b) {
      if (grads[b].t == nullptr) continue;
      const bool summed = a < 3 && b < 3 && same_tensor(*grads[a].t, *grads[b].t);
      if (summed) continue;
      const mha_tensor* other[] = {grads[b].t};
      const char* other_name[] = {grads[b].name};
      if (mha_status s = check_no_overlap(*grads[a].t, grads[a].name, other, other_name, 1);
          s != MHA_OK) {
        return s;
      }
    }
  }
  return MHA_OK;
}

}  // namespace

extern "C" {

void mha_module_config_init(mha_module_config* config) {
  if (config == nullptr) return;
  std::memset(config, 0, sizeof *config);
  config->struct_size = sizeof *config;
  config->bias = 1;
}

mha_status mha_module_create(const mha_module_config* config, mha_module** module) {
  clear_error();
  return guarded([&] {
    if (module == nullptr) return fail(MHA_ERR_NULL_POINTER, "module is NULL");
    if (config == nullptr) return fail(MHA_ERR_NULL_POINTER, "config is NULL");
    mha_module_config defaults;
    mha_module_config_init(&defaults);
    mha_module_config given = defaults;
    if (mha_status s = read_versioned(config, defaults, kModuleConfigSizes, "config",
                                      "mha_module_config_init", &given);
        s != MHA_OK) {
      return s;
    }
    if (mha_status s = check_config(&given); s != MHA_OK) return s;
    auto* m = new mha_module;
    m->bf16_cache = std::make_shared<Bf16WeightCache>();
    const int64_t e = given.embed_dim;
    m->embed_dim = e;
    m->num_heads = given.num_heads;
    m->head_dim = e / given.num_heads;  // NOLINT(clang-analyzer-core.DivideZero): checked above
    m->query_dim = given.query_dim != 0 ? given.query_dim : e;
    m->key_dim = given.key_dim != 0 ? given.key_dim : e;
    m->value_dim = given.value_dim != 0 ? given.value_dim : e;
    m->bias = given.bias != 0;
    m->dropout = given.dropout;
    m->half_activations = given.activations == MHA_ACTIVATIONS_INPUT;
    try {
      // Each matrix has one row more, for its biases (module.h).
      const int64_t eq = m->query_dim + 1, ek = m->key_dim + 1, ev = m->value_dim + 1;
      m->w_in.assign(static_cast<size_t>(e * (eq + ek + ev)), 0.0f);
      const auto at = [e](int64_t row) { return static_cast<size_t>(row * e); };
      if (m->query_dim == m->key_dim && m->key_dim == m->value_dim) {
        m->wq_t = {0, 3 * e};
        m->wk_t = {static_cast<size_t>(e), 3 * e};
        m->wv_t = {static_cast<size_t>(2 * e), 3 * e};
      } else if (m->key_dim == m->value_dim) {
        m->wq_t = {0, e};
        m->wk_t = {at(eq), 2 * e};
        m->wv_t = {at(eq) + static_cast<size_t>(e), 2 * e};
      } else {
        m->wq_t = {0, e};
        m->wk_t = {at(eq), e};
        m->wv_t = {at(eq + ek), e};
      }
      m->w_out.assign(static_cast<size_t>(e * (e + 1)), 0.0f);
      if (m->bias) {
        m->b_in.assign(static_cast<size_t>(3 * e), 0.0f);
        m->b_out.assign(static_cast<size_t>(e), 0.0f);
      }
    } catch (...) {
      delete m;
      throw;
    }
    *module = m;
    return MHA_OK;
  });
}

void mha_module_destroy(mha_module* module) {
  delete module;
}

mha_status mha_module_set_weight(mha_module* module, const char* name, const mha_tensor* value) {
  clear_error();
  return guarded([&] {
    if (module == nullptr) return fail(MHA_ERR_NULL_POINTER, "module is NULL");
    if (name == nullptr) return fail(MHA_ERR_NULL_POINTER, "name is NULL");
    WeightSlot slot;
    if (mha_status s = find_slot(module, name, &slot); s != MHA_OK) return s;
    const int32_t rank = slot.cols == 0 ? 1 : 2;
    if (value == nullptr) return fail(MHA_ERR_NULL_POINTER, "value (for '%s') is NULL", name);
    if (mha_status s = check_tensor(value, name, rank, rank); s != MHA_OK) return s;
    if (value->dtype != MHA_DTYPE_F32 && value->dtype != MHA_DTYPE_BF16 &&
        value->dtype != MHA_DTYPE_F16) {
      return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be f32, bf16 or f16", name,
                  dtype_name(value->dtype));
    }
    const bool shape_ok =
        value->shape[0] == slot.rows && (rank == 1 || value->shape[1] == slot.cols);
    if (!shape_ok) {
      if (rank == 1) {
        return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must be %s = [%lld]", name,
                    shape_text(*value).c_str(), slot.expected, ll(slot.rows));
      }
      return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must be %s = [%lld, %lld]", name,
                  shape_text(*value).c_str(), slot.expected, ll(slot.rows), ll(slot.cols));
    }
    // The module keeps fp32 weights: a bf16 or f16 checkpoint's values are
    // widened (exactly) as they are copied.
    const auto at = [value](int64_t offset) {
      return mha_types::load_float(value->data, value->dtype, offset);
    };
    if (rank == 1) {
      for (int64_t r = 0; r < slot.rows; ++r) slot.dst[r] = at(r * value->strides[0]);
    } else {
      // Transposed in blocks of 32 x 32: column by column over a row-major matrix read
      // every element a line apart, and mha.torch.MultiheadAttention's copy of
      // in_proj_weight (E 1024) took 27 ms.
      constexpr int64_t kBlock = 32;
      for (int64_t c0 = 0; c0 < slot.cols; c0 += kBlock) {
        const int64_t c1 = std::min(slot.cols, c0 + kBlock);
        for (int64_t r0 = 0; r0 < slot.rows; r0 += kBlock) {
          const int64_t r1 = std::min(slot.rows, r0 + kBlock);
          for (int64_t c = c0; c < c1; ++c) {
            for (int64_t r = r0; r < r1; ++r) {
              slot.dst[c * slot.ld + r] = at(r * value->strides[0] + c * value->strides[1]);
            }
          }
        }
      }
    }
    module->sync_bias_rows();
    module->bf16_cache->clear();  // packed from the old values
    return MHA_OK;
  });
}

void mha_module_forward_params_init(mha_module_forward_params* params) {
  if (params != nullptr) init_attention_defaults(params);
}

mha_status mha_module_forward(mha_module* module, const mha_tensor* query, const mha_tensor* key,
                              const mha_tensor* value, mha_tensor* out,
                              const mha_module_forward_params* params) {
  clear_error();
  return guarded([&] {
    ModuleCall call;
    if (mha_status s =
            check_forward(module, query, key, value, out, "out", OutRole::kWritten, params, &call);
        s != MHA_OK) {
      return s;
    }
    const char* why = nullptr;
    if (Registry::instance().selected(&why) == nullptr) {
      return fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", why);
    }
    if (mha_status s = check_blis_kernel_set(); s != MHA_OK) return s;
    return run_module_forward(call);
  });
}

void mha_module_gradients_init(mha_module_gradients* grads) {
  if (grads == nullptr) return;
  std::memset(grads, 0, sizeof *grads);
  grads->struct_size = sizeof *grads;
}

mha_status mha_module_backward(mha_module* module, const mha_tensor* query, const mha_tensor* key,
                               const mha_tensor* value, const mha_tensor* dout,
                               const mha_module_forward_params* params,
                               const mha_module_gradients* grads) {
  clear_error();
  return guarded([&] {
    ModuleCall call;
    if (mha_status s =
            check_forward(module, query, key, value, dout, "dout", OutRole::kRead, params, &call);
        s != MHA_OK) {
      return s;
    }
    if (call.attn_weights != nullptr) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "params->attn_weights is given: the backward pass returns no attention weights "
                  "(pass NULL)");
    }
    if (grads == nullptr) return fail(MHA_ERR_NULL_POINTER, "grads is NULL");
    mha_module_gradients given;
    mha_module_gradients_init(&given);
    const mha_module_gradients defaults = given;
    if (mha_status s = read_versioned(grads, defaults, kModuleGradientsSizes, "grads",
                                      "mha_module_gradients_init", &given);
        s != MHA_OK) {
      return s;
    }
    if (mha_status s = check_gradients(*module, call, dout, given); s != MHA_OK) return s;
    const char* why = nullptr;
    if (Registry::instance().selected(&why) == nullptr) {
      return fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", why);
    }
    if (mha_status s = check_blis_kernel_set(); s != MHA_OK) return s;
    // A half-precision input or gradient takes an fp32 stand-in; the
    // gradients are rounded into the caller's tensors only when the whole
    // backward has succeeded.
    F32Standins standins;
    ModuleCall f32_call = call;
    f32_call.query = standins.input(call.query);
    f32_call.key = standins.input(call.key);
    f32_call.value = standins.input(call.value);
    const mha_tensor* f32_dout = standins.input(dout);
    f32_call.out = f32_dout;
    mha_module_gradients f32_grads = given;
    for (mha_tensor** g :
         {&f32_grads.query, &f32_grads.key, &f32_grads.value, &f32_grads.q_proj_weight,
          &f32_grads.k_proj_weight, &f32_grads.v_proj_weight, &f32_grads.q_proj_bias,
          &f32_grads.k_proj_bias, &f32_grads.v_proj_bias, &f32_grads.out_proj_weight,
          &f32_grads.out_proj_bias, &f32_grads.sinks}) {
      *g = standins.gradient(*g);
    }
    if (mha_status s = run_module_backward(f32_call, f32_dout, f32_grads); s != MHA_OK) return s;
    standins.round_gradients();
    return MHA_OK;
  });
}

}  // extern "C"
