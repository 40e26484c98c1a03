// The C entry points: each validates, then hands over to the registry and the
// scheduler.  No entry point lets an exception escape.
#include <mha/mha.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "attention.h"
#include "backward.h"
#include "cpu_caches.h"
#include "cpu_features.h"
#include "env.h"
#include "error.h"
#include "registry.h"
#include "scheduler.h"
#include "threads.h"
#include "validate.h"
#include "varlen.h"
#include "varlen_backward.h"
#include "versioned.h"

using namespace mha::rt;

namespace {

// One backend's snapshot for the mha_backend_get_* calls; an index out of
// range fails with the error set.
mha_status backend_at(int32_t index, BackendInfo* info) {
  const Registry& registry = Registry::instance();
  if (index < 0 || index >= registry.count()) {
    return fail(MHA_ERR_INVALID_VALUE, "backend index %d is outside [0, %d)", index,
                registry.count());
  }
  *info = registry.info(index);
  return MHA_OK;
}

}  // namespace

extern "C" {

const char* mha_status_name(mha_status status) {
  return status_name(status);
}

const char* mha_last_error(void) {
  return last_error();
}

const char* mha_version(void) {
#define MHA_STR2(x) #x
#define MHA_STR(x) MHA_STR2(x)
  return MHA_STR(MHA_VERSION_MAJOR) "." MHA_STR(MHA_VERSION_MINOR) "." MHA_STR(MHA_VERSION_PATCH);
#undef MHA_STR
#undef MHA_STR2
}

mha_status mha_tensor_init(mha_tensor* tensor, void* data, mha_dtype dtype, int32_t ndim,
                           const int64_t* shape, const int64_t* strides) {
  clear_error();
  if (tensor == nullptr) return fail(MHA_ERR_NULL_POINTER, "tensor is NULL");
  if (shape == nullptr) return fail(MHA_ERR_NULL_POINTER, "shape is NULL");
  if (ndim < 1 || ndim > MHA_MAX_DIMS) {
    return fail(MHA_ERR_INVALID_SIZE, "ndim = %d; it must be 1 to %d", ndim, MHA_MAX_DIMS);
  }
  if (dtype_size(dtype) == 0) return fail(MHA_ERR_INVALID_DTYPE, "unknown dtype %d", dtype);
  for (int32_t d = 0; d < ndim; ++d) {
    if (shape[d] <= 0) {
      return fail(MHA_ERR_INVALID_SIZE, "shape[%d] = %lld; sizes must be positive", d,
                  static_cast<long long>(shape[d]));
    }
  }
  mha_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim;
  int64_t running = 1;
  for (int32_t d = ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    if (strides != nullptr) {
      if (strides[d] < 0) {
        return fail(MHA_ERR_INVALID_STRIDES, "strides[%d] = %lld; strides must be >= 0", d,
                    static_cast<long long>(strides[d]));
      }
      t.strides[d] = strides[d];
    } else {
      t.strides[d] = running;
      if (__builtin_mul_overflow(running, shape[d], &running)) {
        return fail(MHA_ERR_SIZE_OVERFLOW, "shape: the element count overflows 64 bits");
      }
    }
  }
  for (int32_t d = 0; d < ndim; ++d) {
    if (shape[d] > MHA_MAX_EXTENT) {
      return fail(MHA_ERR_INVALID_SIZE, "shape[%d] = %lld exceeds MHA_MAX_EXTENT = 2^40", d,
                  static_cast<long long>(shape[d]));
    }
  }
  *tensor = t;
  return MHA_OK;
}

void mha_attention_params_init(mha_attention_params* params) {
  if (params != nullptr) init_attention_defaults(params);
}

mha_status mha_attention(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                         mha_tensor* out, const mha_attention_params* params) {
  clear_error();
  return guarded([&] {
    KernelCall call;
    if (mha_status s = validate_attention(q, k, v, out, params, &call); s != MHA_OK) return s;
    return attend(call);
  });
}

void mha_backward_params_init(mha_backward_params* backward) {
  if (backward == nullptr) return;
  std::memset(backward, 0, sizeof *backward);
  backward->struct_size = sizeof *backward;
}

mha_status mha_attention_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                                  const mha_tensor* out, const mha_tensor* lse,
                                  const mha_tensor* dout, mha_tensor* dq, mha_tensor* dk,
                                  mha_tensor* dv, const mha_attention_params* params,
                                  const mha_backward_params* backward) {
  clear_error();
  return guarded(
      [&] { return attention_backward(q, k, v, out, lse, dout, dq, dk, dv, params, backward); });
}

void mha_varlen_params_init(mha_varlen_params* varlen) {
  if (varlen == nullptr) return;
  std::memset(varlen, 0, sizeof *varlen);
  varlen->struct_size = sizeof *varlen;
}

mha_status mha_attention_varlen(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                                mha_tensor* out, const mha_varlen_params* varlen,
                                const mha_attention_params* params) {
  clear_error();
  return guarded([&] { return attention_varlen(q, k, v, out, varlen, params); });
}

mha_status mha_attention_varlen_backward(const mha_tensor* q, const mha_tensor* k,
                                         const mha_tensor* v, const mha_tensor* out,
                                         const mha_tensor* lse, const mha_tensor* dout,
                                         mha_tensor* dq, mha_tensor* dk, mha_tensor* dv,
                                         const mha_varlen_params* varlen,
                                         const mha_attention_params* params,
                                         const mha_backward_params* backward) {
  clear_error();
  return guarded([&] {
    return attention_varlen_backward(q, k, v, out, lse, dout, dq, dk, dv, varlen, params, backward);
  });
}

int32_t mha_backend_count(void) {
  clear_error();
  return Registry::instance().count();
}

mha_status mha_backend_get_info(int32_t index, mha_backend_info* info) {
  clear_error();
  if (info == nullptr) return fail(MHA_ERR_NULL_POINTER, "info is NULL");
  BackendInfo b{};
  if (const mha_status status = backend_at(index, &b); status != MHA_OK) return status;
  info->name = b.name;
  info->usable = b.usable ? 1 : 0;
  info->priority = b.priority;
  info->reason = b.reason;
  return MHA_OK;
}

mha_status mha_backend_get_tiles(int32_t index, mha_backend_tiles* tiles) {
  clear_error();
  if (tiles == nullptr) return fail(MHA_ERR_NULL_POINTER, "tiles is NULL");
  BackendInfo b{};
  if (const mha_status status = backend_at(index, &b); status != MHA_OK) return status;
  const mha_tile_sizes t = b.tiles;
  *tiles = mha_backend_tiles{t.query_tile, t.key_tile, t.decode_key_tile};
  return MHA_OK;
}

mha_status mha_backend_get_decode_streams(int32_t index, int32_t* streams) {
  clear_error();
  if (streams == nullptr) return fail(MHA_ERR_NULL_POINTER, "streams is NULL");
  BackendInfo b{};
  if (const mha_status status = backend_at(index, &b); status != MHA_OK) return status;
  *streams = b.tiles.decode_key_streams;
  return MHA_OK;
}

mha_status mha_backend_get_bf16_dot(int32_t index, int32_t* bf16_dot) {
  clear_error();
  if (bf16_dot == nullptr) return fail(MHA_ERR_NULL_POINTER, "bf16_dot is NULL");
  BackendInfo b{};
  if (const mha_status status = backend_at(index, &b); status != MHA_OK) return status;
  *bf16_dot = b.tiles.bf16_dot;
  return MHA_OK;
}

mha_status mha_cpu_caches(mha_cache_info* caches) {
  clear_error();
  if (caches == nullptr) return fail(MHA_ERR_NULL_POINTER, "caches is NULL");
  const mha_cache_sizes& c = cpu_caches();
  *caches = mha_cache_info{c.l1d, c.l2, c.l3};
  return MHA_OK;
}

const char* mha_selected_backend(void) {
  clear_error();
  const char* why = nullptr;
  const Backend* backend = Registry::instance().selected(&why);
  if (backend == nullptr) {
    fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", why);
    return nullptr;
  }
  return backend->name.c_str();
}

mha_status mha_select_backend(const char* name) {
  clear_error();
  if (name == nullptr) return fail(MHA_ERR_NULL_POINTER, "name is NULL");
  return guarded([&] { return Registry::instance().select(name); });
}

const char* mha_cpu_features(void) {
  static const std::string names = feature_names(cpu_features());
  return names.c_str();
}

mha_status mha_set_num_threads(int32_t n) {
  clear_error();
  if (n < 0 || n > 4096) {
    return fail(MHA_ERR_INVALID_VALUE, "n = %d; it must be 0 (use the environment) to 4096", n);
  }
  set_num_threads(n);
  return MHA_OK;
}

int32_t mha_get_num_threads(void) {
  return num_threads();
}

}  // extern "C"
