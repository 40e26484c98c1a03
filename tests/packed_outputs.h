// The outputs of a packed variable-length call (mha_attention_varlen): out
// F32 [total_q, H, Dv] and lse F32 [H, total_q], filled with a sentinel so a
// refused call can be seen to have written nothing.  Shared by the packed
// and the paged tests.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "test_util.h"

namespace mha_test {

// The bits of a float: results are compared bit for bit (NaN and -0 included).
inline uint32_t float_bits(float x) {
  uint32_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

class PackedOutputs {
 public:
  static constexpr float kSentinel = -7.0f;

  PackedOutputs(int64_t total_q, int64_t heads, int64_t dv)
      : total_q_(total_q),
        heads_(heads),
        dv_(dv),
        out_(static_cast<size_t>(total_q * heads * dv), kSentinel),
        lse_(static_cast<size_t>(heads * total_q), kSentinel) {
    out = describe(out_.data(), MHA_DTYPE_F32, {total_q, heads, dv});
    lse = describe(lse_.data(), MHA_DTYPE_F32, {heads, total_q});
  }
  PackedOutputs(const PackedOutputs&) = delete;  // the descriptors point into it
  PackedOutputs& operator=(const PackedOutputs&) = delete;

  float out_at(int64_t row, int64_t h, int64_t x) const {
    return out_[static_cast<size_t>((row * heads_ + h) * dv_ + x)];
  }
  float lse_at(int64_t h, int64_t row) const {
    return lse_[static_cast<size_t>(h * total_q_ + row)];
  }
  bool untouched() const {
    for (const std::vector<float>* v : {&out_, &lse_}) {
      for (float x : *v) {
        if (float_bits(x) != float_bits(kSentinel)) return false;
      }
    }
    return true;
  }
  // out, then lse.
  std::vector<float> results() const {
    std::vector<float> all = out_;
    all.insert(all.end(), lse_.begin(), lse_.end());
    return all;
  }

  mha_tensor out{}, lse{};

 private:
  int64_t total_q_, heads_, dv_;
  std::vector<float> out_, lse_;
};

}  // namespace mha_test
