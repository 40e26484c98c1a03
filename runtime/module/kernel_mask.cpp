// PyTorch's module masks (key_padding_mask, attn_mask; bool true = NOT
// allowed) as mha_attention's one mask (bool true = take part, or additive:
// an f32 mask read in place, a half-precision one widened into scratch).
#include "kernel_mask.h"

#include <cstdint>
#include <cstring>
#include <limits>

#include "common/dtype.h"
#include "projections.h"

namespace mha::rt {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

bool build_kernel_mask(const ModuleCall& call, int64_t heads, AlignedBuffer& scratch,
                       mha_tensor* mask) {
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
    if (kpm->dtype != MHA_DTYPE_BOOL) {  // bf16 or f16 (the query's): widened
      auto* additive = static_cast<float*>(take(scratch, float_bytes(batch * lk)));
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t j = 0; j < lk; ++j) {
          additive[b * lk + j] = mha_types::load_float(kpm->data, kpm->dtype,
                                                       b * kpm->strides[0] + j * kpm->strides[1]);
        }
      }
      mask->data = additive;
      mask->dtype = MHA_DTYPE_F32;
      const int64_t strides[4] = {lk, 0, 0, 1};
      std::memcpy(mask->strides, strides, sizeof strides);
      return true;
    }
    auto* allowed = static_cast<uint8_t*>(take(scratch, static_cast<size_t>(batch * lk)));
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
    auto* allowed = static_cast<uint8_t*>(take(scratch, static_cast<size_t>(count)));
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
  auto* additive = static_cast<float*>(take(scratch, float_bytes(count)));
  const auto term = [](const mha_tensor* t, int64_t offset) -> float {
    if (t->dtype == MHA_DTYPE_BOOL)
      return static_cast<const uint8_t*>(t->data)[offset] != 0 ? -kInf : 0.0f;
    return mha_types::load_float(t->data, t->dtype, offset);  // f32, or the query's half dtype
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

}  // namespace mha::rt
