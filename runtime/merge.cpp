// mha_merge_partials: the public face of the split-KV merge.
#include <mha/mha.h>

#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "error.h"
#include "scheduler.h"
#include "validate.h"

using namespace mha::rt;

namespace {

mha_status check_part(const mha_tensor* t, const char* what, int32_t c, int32_t ndim,
                      const int64_t* shape) {
  char name[48];
  std::snprintf(name, sizeof name, "%s[%d]", what, c);
  if (mha_status s = check_tensor(t, name, ndim, ndim); s != MHA_OK) return s;
  if (t->dtype != MHA_DTYPE_F32) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be f32", name,
                dtype_name(t->dtype));
  }
  for (int32_t d = 0; d < ndim; ++d) {
    if (t->shape[d] != shape[d]) {
      return fail(MHA_ERR_SHAPE_MISMATCH, "%s->shape[%d] = %lld but %s has %lld", name, d,
                  static_cast<long long>(t->shape[d]), "out", static_cast<long long>(shape[d]));
    }
  }
  return MHA_OK;
}

}  // namespace

extern "C" mha_status mha_merge_partials(int32_t n, const mha_tensor* outs, const mha_tensor* lses,
                                         mha_tensor* out, mha_tensor* lse) {
  clear_error();
  if (n < 1) return fail(MHA_ERR_INVALID_SIZE, "n = %d; at least one part is needed", n);
  if (outs == nullptr) return fail(MHA_ERR_NULL_POINTER, "outs is NULL");
  if (lses == nullptr) return fail(MHA_ERR_NULL_POINTER, "lses is NULL");
  if (mha_status s = check_tensor(out, "out", 4, 4); s != MHA_OK) return s;
  if (out->dtype != MHA_DTYPE_F32) {
    return fail(MHA_ERR_INVALID_DTYPE, "out has dtype %s; it must be f32", dtype_name(out->dtype));
  }
  const int64_t* shape = out->shape;
  for (int32_t c = 0; c < n; ++c) {
    if (mha_status s = check_part(&outs[c], "outs", c, 4, shape); s != MHA_OK) return s;
    if (mha_status s = check_part(&lses[c], "lses", c, 3, shape); s != MHA_OK) return s;
  }
  if (lse != nullptr) {
    if (mha_status s = check_part(lse, "lse", 0, 3, shape); s != MHA_OK) return s;
  }
  {
    std::vector<const mha_tensor*> inputs;
    std::vector<std::string> labels;
    for (int32_t c = 0; c < n; ++c) {
      inputs.push_back(&outs[c]);
      labels.push_back("outs[" + std::to_string(c) + "]");
      inputs.push_back(&lses[c]);
      labels.push_back("lses[" + std::to_string(c) + "]");
    }
    inputs.push_back(lse);
    labels.emplace_back("lse");
    std::vector<const char*> names;
    names.reserve(labels.size());
    for (const auto& label : labels) names.push_back(label.c_str());
    const int count = static_cast<int>(inputs.size());
    if (mha_status s = check_no_overlap(*out, "out", inputs.data(), names.data(), count);
        s != MHA_OK) {
      return s;
    }
    if (lse != nullptr) {
      if (mha_status s = check_no_overlap(*lse, "lse", inputs.data(), names.data(), count - 1);
          s != MHA_OK) {
        return s;
      }
    }
  }

  const int64_t batch = shape[0], heads = shape[1], lq = shape[2], dv = shape[3];
  std::vector<const float*> part_rows(static_cast<size_t>(n));
  std::vector<float> part_lses(static_cast<size_t>(n));
  std::vector<int64_t> part_strides(static_cast<size_t>(n));
  std::vector<float> part_weights(static_cast<size_t>(n));
  for (int32_t c = 0; c < n; ++c) part_strides[c] = outs[c].strides[3];
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        for (int32_t c = 0; c < n; ++c) {
          const mha_tensor& o = outs[c];
          const mha_tensor& l = lses[c];
          part_rows[c] = static_cast<const float*>(o.data) + b * o.strides[0] + h * o.strides[1] +
                         i * o.strides[2];
          part_lses[c] = static_cast<const float*>(
              l.data)[b * l.strides[0] + h * l.strides[1] + i * l.strides[2]];
        }
        float* dst = static_cast<float*>(out->data) + b * out->strides[0] + h * out->strides[1] +
                     i * out->strides[2];
        float* dst_lse = lse == nullptr ? nullptr
                                        : static_cast<float*>(lse->data) + b * lse->strides[0] +
                                              h * lse->strides[1] + i * lse->strides[2];
        merge_row(n, part_rows.data(), part_strides.data(), part_lses.data(),
                  -std::numeric_limits<float>::infinity(), part_weights.data(), dv, dst,
                  MHA_DTYPE_F32, out->strides[3], dst_lse);
      }
    }
  }
  return MHA_OK;
}
