// mha — a thin C++ layer over the C API: errors become exceptions, tensors are
// built from shapes, parameters are set by name.  Header-only; links libmha.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace mha {

class Error : public std::runtime_error {
 public:
  Error(mha_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  mha_status status() const noexcept { return status_; }

 private:
  mha_status status_;
};

inline void check(mha_status status) {
  if (status != MHA_OK) {
    throw Error(status, std::string(mha_status_name(status)) + ": " + mha_last_error());
  }
}

// A tensor view: C order unless strides are given (in elements).
class Tensor {
 public:
  Tensor(const float* data, std::initializer_list<int64_t> shape,
         std::initializer_list<int64_t> strides = {})
      : Tensor(const_cast<float*>(data), MHA_DTYPE_F32, shape, strides) {}
  Tensor(void* data, mha_dtype dtype, std::initializer_list<int64_t> shape,
         std::initializer_list<int64_t> strides = {}) {
    if (shape.size() == 0 || shape.size() > MHA_MAX_DIMS) {
      throw Error(MHA_ERR_INVALID_SIZE, "a tensor has 1 to 4 dimensions");
    }
    if (strides.size() != 0 && strides.size() != shape.size()) {
      throw Error(MHA_ERR_INVALID_STRIDES, "strides and shape differ in rank");
    }
    int64_t shape_array[MHA_MAX_DIMS] = {};
    int64_t stride_array[MHA_MAX_DIMS] = {};
    int i = 0;
    for (int64_t s : shape) shape_array[i++] = s;
    i = 0;
    for (int64_t s : strides) stride_array[i++] = s;
    check(mha_tensor_init(&desc_, data, dtype, static_cast<int32_t>(shape.size()), shape_array,
                          strides.size() != 0 ? stride_array : nullptr));
  }

  const mha_tensor* get() const noexcept { return &desc_; }
  mha_tensor* get() noexcept { return &desc_; }

 private:
  mha_tensor desc_{};
};

// Parameters of attention(); the referenced tensors must outlive the call.
class AttentionParams {
 public:
  AttentionParams() { mha_attention_params_init(&params_); }
  AttentionParams& scale(float s) {
    params_.has_scale = 1;
    params_.scale = s;
    return *this;
  }
  AttentionParams& causal(mha_causal mode) {
    params_.causal = mode;
    return *this;
  }
  AttentionParams& valid_lens(const Tensor& t) {
    params_.valid_lens = t.get();
    return *this;
  }
  AttentionParams& mask(const Tensor& t) {
    params_.mask = t.get();
    return *this;
  }
  AttentionParams& lse(Tensor& t) {
    params_.lse = t.get();
    return *this;
  }
  AttentionParams& dropout(float p, uint64_t seed) {
    params_.dropout_p = p;
    params_.dropout_seed = seed;
    return *this;
  }
  const mha_attention_params* get() const noexcept { return &params_; }

 private:
  mha_attention_params params_{};
};

// out = softmax(Q·Kᵀ·scale + mask)·V; throws mha::Error on bad input.
inline void attention(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                      const AttentionParams& params = AttentionParams()) {
  check(mha_attention(q.get(), k.get(), v.get(), out.get(), params.get()));
}

// ------------------------------------------------ the multi-head attention module

// The module's configuration (mha_module_config): embed_dim and num_heads are
// required; the input sizes default to embed_dim (0), biases are on as in
// PyTorch (d2l's default is off).
struct ModuleConfig {
  int64_t embed_dim = 0;
  int64_t num_heads = 0;
  int64_t query_dim = 0;  // 0: embed_dim
  int64_t key_dim = 0;    // 0: embed_dim
  int64_t value_dim = 0;  // 0: embed_dim
  bool bias = true;
  float dropout = 0.0f;  // on the attention weights in training mode, [0, 1)
};

// Parameters of Module::forward; the referenced tensors must outlive the call.
class ModuleForwardParams {
 public:
  ModuleForwardParams() { mha_module_forward_params_init(&params_); }
  ModuleForwardParams& valid_lens(const Tensor& t) {
    params_.valid_lens = t.get();
    return *this;
  }
  // PyTorch's convention: bool true = the key is ignored; or f32, added.
  ModuleForwardParams& key_padding_mask(const Tensor& t) {
    params_.key_padding_mask = t.get();
    return *this;
  }
  // PyTorch's convention: bool true = not allowed; or f32, added.
  ModuleForwardParams& attn_mask(const Tensor& t) {
    params_.attn_mask = t.get();
    return *this;
  }
  ModuleForwardParams& causal(mha_causal mode) {
    params_.causal = mode;
    return *this;
  }
  // [B, H, Lq, Lk], or [B, Lq, Lk] when averaged over the heads.
  ModuleForwardParams& attn_weights(Tensor& t, bool average = false) {
    params_.attn_weights = t.get();
    params_.average_attn_weights = average ? 1 : 0;
    return *this;
  }
  // Training mode: dropout as configured, decided by the seed.
  ModuleForwardParams& training(uint64_t dropout_seed) {
    params_.training = 1;
    params_.dropout_seed = dropout_seed;
    return *this;
  }
  const mha_module_forward_params* get() const noexcept { return &params_; }

 private:
  mha_module_forward_params params_{};
};

// An mha_module owned by this object: destroyed with it; movable, not copyable.
class Module {
 public:
  explicit Module(const ModuleConfig& config) {
    mha_module_config c;
    mha_module_config_init(&c);
    c.embed_dim = config.embed_dim;
    c.num_heads = config.num_heads;
    c.query_dim = config.query_dim;
    c.key_dim = config.key_dim;
    c.value_dim = config.value_dim;
    c.bias = config.bias ? 1 : 0;
    c.dropout = config.dropout;
    check(mha_module_create(&c, &module_));
  }
  Module(int64_t embed_dim, int64_t num_heads)
      : Module(ModuleConfig{embed_dim, num_heads, 0, 0, 0, true, 0.0f}) {}
  ~Module() { mha_module_destroy(module_); }
  Module(Module&& other) noexcept : module_(other.module_) { other.module_ = nullptr; }
  Module& operator=(Module&& other) noexcept {
    if (this != &other) {
      mha_module_destroy(module_);
      module_ = other.module_;
      other.module_ = nullptr;
    }
    return *this;
  }
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Copies a weight named as in PyTorch's state_dict ("in_proj_weight",
  // "out_proj.bias", ...) or d2l's ("W_q.weight", ...).
  void set_weight(const std::string& name, const Tensor& value) {
    check(mha_module_set_weight(module_, name.c_str(), value.get()));
  }

  // out [B, Lq, E] = module(query [B, Lq, Eq], key [B, Lk, Ek], value [B, Lk, Ev]).
  void forward(const Tensor& query, const Tensor& key, const Tensor& value, Tensor& out,
               const ModuleForwardParams& params = ModuleForwardParams()) const {
    check(
        mha_module_forward(module_, query.get(), key.get(), value.get(), out.get(), params.get()));
  }

  mha_module* get() const noexcept { return module_; }

 private:
  mha_module* module_ = nullptr;
};

// Adds the sinusoidal positional encoding to x [B, L, d] in place.
inline void positional_encoding_add(Tensor& x) {
  check(mha_positional_encoding_add(x.get()));
}

inline std::string selected_backend() {
  const char* name = mha_selected_backend();
  if (name == nullptr) throw Error(MHA_ERR_BACKEND_UNAVAILABLE, mha_last_error());
  return name;
}

inline void select_backend(const std::string& name) {
  check(mha_select_backend(name.c_str()));
}

inline void set_num_threads(int32_t n) {
  check(mha_set_num_threads(n));
}

}  // namespace mha
