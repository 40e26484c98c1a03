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
