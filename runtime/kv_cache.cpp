// mha_kv_cache_write: a step's new K and V rows into their slots of a paged
// cache (vLLM's reshape_and_cache), converted to the cache's dtype -- int8
// rows quantised with their scales as mha_quantize_kv does.  Every check runs
// before the first write.
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "error.h"
#include "quantize.h"
#include "validate.h"

using namespace mha::rt;

namespace {

using ll = long long;

int64_t slot_at(const mha_tensor& slots, int64_t t) {
  const int64_t at = t * slots.strides[0];
  return slots.dtype == MHA_DTYPE_I64 ? static_cast<const int64_t*>(slots.data)[at]
                                      : static_cast<const int32_t*>(slots.data)[at];
}

// Element [t, h, 0] of a [T, Hkv, D] tensor.
int64_t token_row(const mha_tensor& t, int64_t token, int64_t h) {
  return token * t.strides[0] + h * t.strides[1];
}

// Element [block, row, h, 0] of a [num_blocks, block_size, Hkv, D] cache.
int64_t cache_row(const mha_tensor& c, int64_t block, int64_t row, int64_t h) {
  return block * c.strides[0] + row * c.strides[1] + h * c.strides[2];
}

mha_status check_scale_cache(const mha_tensor* scales, const char* name, bool int8,
                             const mha_tensor& cache) {
  if (!int8) {
    if (scales == nullptr) return MHA_OK;
    return fail(MHA_ERR_INVALID_VALUE,
                "%s is given but the caches are %s (scales belong to an i8 cache)", name,
                dtype_name(cache.dtype));
  }
  if (scales == nullptr) {
    return fail(MHA_ERR_NULL_POINTER,
                "%s is NULL; an i8 cache needs its row scales, F32 [num_blocks, block_size, Hkv]",
                name);
  }
  if (mha_status s = check_tensor(scales, name, 3, 3); s != MHA_OK) return s;
  if (mha_status s = check_f32(scales, name); s != MHA_OK) return s;
  for (int d = 0; d < 3; ++d) {
    if (scales->shape[d] != cache.shape[d]) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "%s has shape %s; it must be [num_blocks, block_size, Hkv], the cache's %s", name,
                  shape_text(*scales).c_str(), shape_text(cache).c_str());
    }
  }
  return MHA_OK;
}

// Slots below num_blocks · block_size, none twice (negative: skipped).
mha_status check_slots(const mha_tensor& slots, int64_t capacity) {
  std::vector<std::pair<int64_t, int64_t>> taken;  // (slot, token)
  for (int64_t t = 0; t < slots.shape[0]; ++t) {
    const int64_t slot = slot_at(slots, t);
    if (slot < 0) continue;
    if (slot >= capacity) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "slot_mapping[%lld] = %lld; slots must be below num_blocks · block_size = %lld",
                  static_cast<ll>(t), static_cast<ll>(slot), static_cast<ll>(capacity));
    }
    taken.emplace_back(slot, t);
  }
  std::sort(taken.begin(), taken.end());
  for (size_t i = 1; i < taken.size(); ++i) {
    if (taken[i].first == taken[i - 1].first) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "slot_mapping[%lld] and slot_mapping[%lld] are both %lld; a slot takes one "
                  "token",
                  static_cast<ll>(taken[i - 1].second), static_cast<ll>(taken[i].second),
                  static_cast<ll>(taken[i].first));
    }
  }
  return MHA_OK;
}

// An int8 cache quantises the rows it takes: they must be finite.
mha_status check_finite_rows(const mha_tensor& x, const char* name, const mha_tensor& slots) {
  for (int64_t t = 0; t < x.shape[0]; ++t) {
    if (slot_at(slots, t) < 0) continue;
    for (int64_t h = 0; h < x.shape[1]; ++h) {
      for (int64_t e = 0; e < x.shape[2]; ++e) {
        const float value =
            mha_types::load_float(x.data, x.dtype, token_row(x, t, h) + e * x.strides[2]);
        if (!std::isfinite(value)) {
          return fail(MHA_ERR_INVALID_VALUE,
                      "%s[%lld][%lld][%lld] = %g; an i8 cache needs finite values", name,
                      static_cast<ll>(t), static_cast<ll>(h), static_cast<ll>(e),
                      static_cast<double>(value));
        }
      }
    }
  }
  return MHA_OK;
}

mha_status check_cache_write(const mha_tensor* key, const mha_tensor* value,
                             const mha_tensor* key_cache, const mha_tensor* value_cache,
                             const mha_tensor* slots, const mha_tensor* key_scales,
                             const mha_tensor* value_scales) {
  if (mha_status s = check_tensor(key, "key", 3, 3); s != MHA_OK) return s;
  if (mha_status s = check_tensor(value, "value", 3, 3); s != MHA_OK) return s;
  if (mha_status s = check_tensor(key_cache, "key_cache", 4, 4); s != MHA_OK) return s;
  if (mha_status s = check_tensor(value_cache, "value_cache", 4, 4); s != MHA_OK) return s;
  if (mha_status s = check_tensor(slots, "slot_mapping", 1, 1); s != MHA_OK) return s;
  if (mha_types::float_bytes(key->dtype) == 0) {
    return fail(MHA_ERR_INVALID_DTYPE, "key has dtype %s; it must be f32, bf16 or f16",
                dtype_name(key->dtype));
  }
  if (value->dtype != key->dtype) {
    return fail(MHA_ERR_INVALID_DTYPE, "value has dtype %s; it must be key's, %s",
                dtype_name(value->dtype), dtype_name(key->dtype));
  }
  const int32_t cache_dtype = key_cache->dtype;
  if (mha_types::float_bytes(cache_dtype) == 0 && cache_dtype != MHA_DTYPE_I8) {
    return fail(MHA_ERR_INVALID_DTYPE, "key_cache has dtype %s; it must be f32, bf16, f16 or i8",
                dtype_name(cache_dtype));
  }
  if (value_cache->dtype != cache_dtype) {
    return fail(MHA_ERR_INVALID_DTYPE, "value_cache has dtype %s; it must be key_cache's, %s",
                dtype_name(value_cache->dtype), dtype_name(cache_dtype));
  }
  if (slots->dtype != MHA_DTYPE_I32 && slots->dtype != MHA_DTYPE_I64) {
    return fail(MHA_ERR_INVALID_DTYPE, "slot_mapping has dtype %s; it must be i32 or i64",
                dtype_name(slots->dtype));
  }
  if (mha_status s = check_agreements({
          {"tokens T", "key", key->shape[0], "value", value->shape[0]},
          {"tokens T", "key", key->shape[0], "slot_mapping", slots->shape[0]},
          {"KV heads", "key", key->shape[1], "value", value->shape[1]},
          {"num_blocks", "key_cache", key_cache->shape[0], "value_cache", value_cache->shape[0]},
          {"block_size", "key_cache", key_cache->shape[1], "value_cache", value_cache->shape[1]},
          {"KV heads", "key", key->shape[1], "key_cache", key_cache->shape[2]},
          {"KV heads", "value", value->shape[1], "value_cache", value_cache->shape[2]},
          {"head size", "key", key->shape[2], "key_cache", key_cache->shape[3]},
          {"value head size", "value", value->shape[2], "value_cache", value_cache->shape[3]},
      });
      s != MHA_OK) {
    return s;
  }
  const int64_t block_size = key_cache->shape[1];
  if (block_size % 8 != 0) {
    return fail(MHA_ERR_INVALID_SIZE,
                "key_cache has block_size %lld (its shape[1]); it must be a positive multiple "
                "of 8",
                static_cast<ll>(block_size));
  }
  const bool int8 = cache_dtype == MHA_DTYPE_I8;
  if (mha_status s = check_scale_cache(key_scales, "key_scale_cache", int8, *key_cache);
      s != MHA_OK) {
    return s;
  }
  if (mha_status s = check_scale_cache(value_scales, "value_scale_cache", int8, *value_cache);
      s != MHA_OK) {
    return s;
  }
  if (mha_status s = check_slots(*slots, key_cache->shape[0] * block_size); s != MHA_OK) return s;
  if (int8) {
    if (mha_status s = check_finite_rows(*key, "key", *slots); s != MHA_OK) return s;
    if (mha_status s = check_finite_rows(*value, "value", *slots); s != MHA_OK) return s;
  }
  // Each output against the inputs and the outputs before it.
  const mha_tensor* all[] = {key, value, slots, key_cache, value_cache, key_scales};
  const char* names[] = {"key",       "value",       "slot_mapping",
                         "key_cache", "value_cache", "key_scale_cache"};
  const struct {
    const mha_tensor* t;
    const char* name;
    int others;
  } outputs[] = {{key_cache, "key_cache", 3},
                 {value_cache, "value_cache", 4},
                 {key_scales, "key_scale_cache", 5},
                 {value_scales, "value_scale_cache", 6}};
  for (const auto& o : outputs) {
    if (o.t == nullptr) continue;
    if (mha_status s = check_no_overlap(*o.t, o.name, all, names, o.others); s != MHA_OK) return s;
  }
  return MHA_OK;
}

// Token t's rows of x ([T, Hkv, D]) into row `row` of block `block` of the
// cache, converted (int8: quantised, with their scales).
void write_rows(const mha_tensor& x, int64_t t, mha_tensor& cache, mha_tensor* scales,
                int64_t block, int64_t row) {
  const int64_t d = x.shape[2];
  for (int64_t h = 0; h < x.shape[1]; ++h) {
    const int64_t from = token_row(x, t, h), to = cache_row(cache, block, row, h);
    if (cache.dtype == MHA_DTYPE_I8) {
      static_cast<float*>(scales->data)[block * scales->strides[0] + row * scales->strides[1] +
                                        h * scales->strides[2]] =
          quantize_row(x.data, x.dtype, from, x.strides[2], d, static_cast<int8_t*>(cache.data), to,
                       cache.strides[3]);
      continue;
    }
    for (int64_t e = 0; e < d; ++e) {
      mha_types::store_float(cache.data, cache.dtype, to + e * cache.strides[3],
                             mha_types::load_float(x.data, x.dtype, from + e * x.strides[2]));
    }
  }
}

}  // namespace

extern "C" mha_status mha_kv_cache_write(const mha_tensor* key, const mha_tensor* value,
                                         mha_tensor* key_cache, mha_tensor* value_cache,
                                         const mha_tensor* slot_mapping,
                                         mha_tensor* key_scale_cache,
                                         mha_tensor* value_scale_cache) {
  clear_error();
  return guarded([&] {
    if (mha_status s = check_cache_write(key, value, key_cache, value_cache, slot_mapping,
                                         key_scale_cache, value_scale_cache);
        s != MHA_OK) {
      return s;
    }
    const int64_t block_size = key_cache->shape[1];
    for (int64_t t = 0; t < key->shape[0]; ++t) {
      const int64_t slot = slot_at(*slot_mapping, t);
      if (slot < 0) continue;
      write_rows(*key, t, *key_cache, key_scale_cache, slot / block_size, slot % block_size);
      write_rows(*value, t, *value_cache, value_scale_cache, slot / block_size, slot % block_size);
    }
    return MHA_OK;
  });
}
