#include "validate.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "common/dtype.h"
#include "common/visibility.h"
#include "error.h"
#include "versioned.h"

namespace mha::rt {
namespace {

// [first byte, one past the last byte] of the elements a descriptor can reach.
struct ByteRange {
  uintptr_t begin, end;
};

ByteRange byte_range(const mha_tensor& t) {
  int64_t last = 0;
  for (int32_t d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.strides[d];
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  return {begin, begin + static_cast<uintptr_t>((last + 1) * dtype_size(t.dtype))};
}

bool ranges_overlap(const mha_tensor& a, const mha_tensor& b) {
  const ByteRange ra = byte_range(a), rb = byte_range(b);
  return ra.begin < rb.end && rb.begin < ra.end;
}

}  // namespace

// True when no two index tuples address the same element: with the dimensions
// sorted by stride, each stride must step over everything the smaller ones span.
bool elements_distinct(const mha_tensor& t) {
  std::pair<int64_t, int64_t> dims[MHA_MAX_DIMS];  // (stride, size)
  int n = 0;
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (t.shape[d] > 1) dims[n++] = {t.strides[d], t.shape[d]};
  }
  for (int i = 1; i < n; ++i) {  // insertion sort: at most four entries
    for (int j = i; j > 0 && dims[j] < dims[j - 1]; --j) std::swap(dims[j], dims[j - 1]);
  }
  int64_t span = 1;  // elements covered by the dimensions so far
  for (int i = 0; i < n; ++i) {
    if (dims[i].first < span) return false;
    span = dims[i].first * dims[i].second;
  }
  return true;
}

mha_status check_shape_equal(const char* what, const char* a, int64_t va, const char* b,
                             int64_t vb) {
  if (va == vb) return MHA_OK;
  return fail(MHA_ERR_SHAPE_MISMATCH, "%s: %s has %lld but %s has %lld", what, a,
              static_cast<long long>(va), b, static_cast<long long>(vb));
}

mha_status check_agreements(std::initializer_list<SizeAgreement> agreements) {
  for (const SizeAgreement& a : agreements) {
    if (mha_status s = check_shape_equal(a.what, a.a, a.va, a.b, a.vb); s != MHA_OK) return s;
  }
  return MHA_OK;
}

mha_status check_head_sizes(std::initializer_list<NamedSize> sizes) {
  for (const NamedSize& h : sizes) {
    if (h.value > MHA_MAX_HEAD_DIM) {
      return fail(MHA_ERR_INVALID_SIZE, "%s = %lld exceeds MHA_MAX_HEAD_DIM = %d", h.what,
                  static_cast<long long>(h.value), MHA_MAX_HEAD_DIM);
    }
  }
  return MHA_OK;
}

namespace {

// The strides of a mask broadcast (NumPy's rule, aligned right) to
// [B, H, Lq, Lk]: 0 along every axis it does not span.
void broadcast_mask_strides(const mha_tensor& mask, int64_t strides[4]) {
  const int32_t offset = 4 - mask.ndim;
  for (int32_t axis = 0; axis < 4; ++axis) {
    strides[axis] =
        axis < offset || mask.shape[axis - offset] == 1 ? 0 : mask.strides[axis - offset];
  }
}

mha_status check_mask(const mha_tensor* mask, const int64_t full[4]) {
  if (mha_status s = check_tensor(mask, "mask", 2, 4); s != MHA_OK) return s;
  if (mask->dtype != MHA_DTYPE_BOOL && mha_types::float_bytes(mask->dtype) == 0) {
    return fail(MHA_ERR_INVALID_DTYPE, "mask has dtype %s; it must be bool, f32, bf16 or f16",
                dtype_name(mask->dtype));
  }
  static const char* const kAxis[4] = {"batch", "heads", "Lq", "Lk"};
  const int32_t offset = 4 - mask->ndim;  // right-aligned, as NumPy broadcasts
  for (int32_t axis = offset; axis < 4; ++axis) {
    const int64_t size = mask->shape[axis - offset];
    if (size != 1 && size != full[axis]) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "mask dimension %d (%s) is %lld; it must be 1 or %lld to broadcast to "
                  "[B, H, Lq, Lk] = [%lld, %lld, %lld, %lld]",
                  axis - offset, kAxis[axis], static_cast<long long>(size),
                  static_cast<long long>(full[axis]), static_cast<long long>(full[0]),
                  static_cast<long long>(full[1]), static_cast<long long>(full[2]),
                  static_cast<long long>(full[3]));
    }
  }
  return MHA_OK;
}

}  // namespace

int64_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case MHA_DTYPE_F32:
      return 4;
    case MHA_DTYPE_F16:
    case MHA_DTYPE_BF16:
      return 2;
    case MHA_DTYPE_BOOL:
    case MHA_DTYPE_I8:
      return 1;
    case MHA_DTYPE_I32:
      return 4;
    case MHA_DTYPE_I64:
      return 8;
    default:
      return 0;
  }
}

std::string shape_text(const mha_tensor& t) {
  std::string s = "[";
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (d != 0) s += ", ";
    s += std::to_string(t.shape[d]);
  }
  return s + "]";
}

mha_status check_f32(const mha_tensor* t, const char* name) {
  if (t->dtype == MHA_DTYPE_F32) return MHA_OK;
  return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be f32", name, dtype_name(t->dtype));
}

mha_status check_valid_lens(const mha_tensor* vl, const char* name, int64_t batch, int64_t lq,
                            int64_t lk) {
  if (mha_status s = check_tensor(vl, name, 1, 2); s != MHA_OK) return s;
  if (vl->dtype != MHA_DTYPE_I32 && vl->dtype != MHA_DTYPE_I64) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be i32 or i64", name,
                dtype_name(vl->dtype));
  }
  if (vl->shape[0] != batch || (vl->ndim == 2 && vl->shape[1] != lq)) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "%s has shape %s; it must be [B] = [%lld] or [B, Lq] = [%lld, %lld]", name,
                shape_text(*vl).c_str(), static_cast<long long>(batch),
                static_cast<long long>(batch), static_cast<long long>(lq));
  }
  const int64_t rows = vl->ndim == 2 ? lq : 1;
  const int64_t s1 = vl->ndim == 2 ? vl->strides[1] : 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t len = mha_rules::valid_length_at(vl->data, vl->dtype == MHA_DTYPE_I64,
                                                     b * vl->strides[0] + i * s1);
      if (len < 0 || len > lk) {
        char index[64];
        if (vl->ndim == 2) {
          std::snprintf(index, sizeof index, "[%lld][%lld]", static_cast<long long>(b),
                        static_cast<long long>(i));
        } else {
          std::snprintf(index, sizeof index, "[%lld]", static_cast<long long>(b));
        }
        return fail(MHA_ERR_INVALID_VALUE, "%s%s = %lld is outside [0, Lk = %lld]", name, index,
                    static_cast<long long>(len), static_cast<long long>(lk));
      }
    }
  }
  return MHA_OK;
}

mha_status check_tensor(const mha_tensor* t, const char* name, int32_t min_ndim, int32_t max_ndim) {
  if (t == nullptr) return fail(MHA_ERR_NULL_POINTER, "%s is NULL", name);
  if (t->data == nullptr) {
    // An empty array's data may well be NULL (PyTorch's, NumPy's): its size is what to name.
    for (int32_t d = 0; d < std::min<int32_t>(t->ndim, MHA_MAX_DIMS); ++d) {
      if (t->shape[d] <= 0) {
        return fail(MHA_ERR_INVALID_SIZE, "%s->shape[%d] = %lld; sizes must be positive", name, d,
                    static_cast<long long>(t->shape[d]));
      }
    }
    return fail(MHA_ERR_NULL_POINTER, "%s->data is NULL", name);
  }
  if (dtype_size(t->dtype) == 0) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has unknown dtype %d", name, t->dtype);
  }
  if (t->ndim < min_ndim || t->ndim > max_ndim) {
    if (min_ndim == max_ndim) {
      return fail(MHA_ERR_INVALID_SIZE, "%s must have %d dimensions, has %d", name, min_ndim,
                  t->ndim);
    }
    return fail(MHA_ERR_INVALID_SIZE, "%s must have %d to %d dimensions, has %d", name, min_ndim,
                max_ndim, t->ndim);
  }
  // The furthest element must be addressable: sum((size - 1) * stride) * itemsize
  // and every product on the way must fit in int64.
  int64_t last = 0;
  for (int32_t d = 0; d < t->ndim; ++d) {
    if (t->shape[d] <= 0) {
      return fail(MHA_ERR_INVALID_SIZE, "%s->shape[%d] = %lld; sizes must be positive", name, d,
                  static_cast<long long>(t->shape[d]));
    }
    if (t->strides[d] < 0) {
      return fail(MHA_ERR_INVALID_STRIDES, "%s->strides[%d] = %lld; strides must be >= 0", name, d,
                  static_cast<long long>(t->strides[d]));
    }
    int64_t reach = 0;
    if (__builtin_mul_overflow(t->shape[d] - 1, t->strides[d], &reach) ||
        __builtin_add_overflow(last, reach, &last)) {
      return fail(MHA_ERR_SIZE_OVERFLOW, "%s: shape times strides overflows 64 bits", name);
    }
  }
  int64_t elements = 1, bytes = 0;
  for (int32_t d = 0; d < t->ndim; ++d) {
    if (__builtin_mul_overflow(elements, t->shape[d], &elements)) {
      return fail(MHA_ERR_SIZE_OVERFLOW, "%s: the element count overflows 64 bits", name);
    }
  }
  if (__builtin_add_overflow(last, int64_t{1}, &last) ||
      __builtin_mul_overflow(last, dtype_size(t->dtype), &bytes) ||
      bytes > INT64_MAX - static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->data) >> 1)) {
    return fail(MHA_ERR_SIZE_OVERFLOW, "%s: its byte extent overflows 64 bits", name);
  }
  // Checked after the overflows, so that an extent that cannot even be
  // represented is reported as such.
  for (int32_t d = 0; d < t->ndim; ++d) {
    if (t->shape[d] > MHA_MAX_EXTENT) {
      return fail(MHA_ERR_INVALID_SIZE, "%s->shape[%d] = %lld exceeds MHA_MAX_EXTENT = 2^40", name,
                  d, static_cast<long long>(t->shape[d]));
    }
  }
  return MHA_OK;
}

mha_status check_no_overlap(const mha_tensor& output, const char* output_name,
                            const mha_tensor* const* others, const char* const* other_names,
                            int count) {
  if (!elements_distinct(output)) {
    return fail(MHA_ERR_OVERLAP, "%s overlaps itself: its strides map two elements to one address",
                output_name);
  }
  for (int i = 0; i < count; ++i) {
    if (others[i] != nullptr && ranges_overlap(output, *others[i])) {
      return fail(MHA_ERR_OVERLAP, "%s overlaps %s in memory", output_name, other_names[i]);
    }
  }
  return MHA_OK;
}

// The dtypes mha_attention takes: q F32/BF16/F16; k and v one of those or I8
// (an int8 cache), both the same; out F32 or q's dtype.
mha_status check_dtypes(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                        const mha_tensor& out) {
  if (mha_types::float_bytes(q.dtype) == 0) {
    return fail(MHA_ERR_INVALID_DTYPE, "q has dtype %s; it must be f32, bf16 or f16",
                dtype_name(q.dtype));
  }
  if (mha_types::float_bytes(k.dtype) == 0 && k.dtype != MHA_DTYPE_I8) {
    return fail(MHA_ERR_INVALID_DTYPE, "k has dtype %s; it must be f32, bf16, f16 or i8",
                dtype_name(k.dtype));
  }
  if (v.dtype != k.dtype) {
    return fail(MHA_ERR_INVALID_DTYPE, "v has dtype %s but k has %s; k and v share one dtype",
                dtype_name(v.dtype), dtype_name(k.dtype));
  }
  if (out.dtype != MHA_DTYPE_F32 && out.dtype != q.dtype) {
    return fail(MHA_ERR_INVALID_DTYPE, "out has dtype %s; it must be f32 or q's dtype (%s)",
                dtype_name(out.dtype), dtype_name(q.dtype));
  }
  return MHA_OK;
}

namespace {}  // namespace

mha_status check_kv_scales(const mha_attention_params& params, bool int8_kv, const int64_t* shape,
                           int32_t ndim, const char* layout) {
  const mha_tensor* scales[2] = {params.k_scale, params.v_scale};
  const char* names[2] = {"k_scale", "v_scale"};
  for (int i = 0; i < 2; ++i) {
    const mha_tensor* t = scales[i];
    if (!int8_kv) {
      if (t != nullptr) {
        return fail(MHA_ERR_INVALID_VALUE,
                    "params->%s is given but k and v are not i8 (scales belong to an int8 KV "
                    "cache)",
                    names[i]);
      }
      continue;
    }
    if (t == nullptr) {
      return fail(MHA_ERR_NULL_POINTER,
                  "params->%s is NULL; k and v are i8 and need their row scales, F32 %s", names[i],
                  layout);
    }
    if (mha_status s = check_tensor(t, names[i], ndim, ndim); s != MHA_OK) return s;
    if (mha_status s = check_f32(t, names[i]); s != MHA_OK) return s;
    if (!std::equal(shape, shape + ndim, t->shape)) {
      std::string want = "[";
      for (int32_t d = 0; d < ndim; ++d) want += (d != 0 ? ", " : "") + std::to_string(shape[d]);
      return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must be %s = %s]", names[i],
                  shape_text(*t).c_str(), layout, want.c_str());
    }
  }
  return MHA_OK;
}

mha_status check_window(int64_t window_left, int64_t window_right) {
  if (window_left >= -1 && window_right >= -1) return MHA_OK;
  const bool left = window_left < -1;
  return fail(MHA_ERR_INVALID_VALUE,
              "params->window_%s = %lld; it must be -1 (unbounded) or a key count >= 0",
              left ? "left" : "right", static_cast<long long>(left ? window_left : window_right));
}

mha_status check_variants(const mha_tensor* sinks, float softcap, const mha_tensor* alibi_slopes,
                          int64_t batch, int64_t heads, const char* prefix) {
  if (!(softcap >= 0.0f && softcap <= FLT_MAX)) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->softcap = %g; it must be 0 (off) or a finite value > 0",
                static_cast<double>(softcap));
  }
  if (const mha_tensor* t = sinks; t != nullptr) {
    const std::string name = std::string(prefix) + "sinks";
    if (mha_status s = check_tensor(t, name.c_str(), 1, 1); s != MHA_OK) return s;
    if (mha_status s = check_f32(t, name.c_str()); s != MHA_OK) return s;
    if (t->shape[0] != heads) {
      return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must be [H] = [%lld]", name.c_str(),
                  shape_text(*t).c_str(), static_cast<long long>(heads));
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float x = static_cast<const float*>(t->data)[h * t->strides[0]];
      if (std::isnan(x) || x == HUGE_VALF) {
        return fail(MHA_ERR_INVALID_VALUE, "%s[%lld] = %g; a sink must be finite or -inf (no sink)",
                    name.c_str(), static_cast<long long>(h), static_cast<double>(x));
      }
    }
  }
  if (const mha_tensor* t = alibi_slopes; t != nullptr) {
    const std::string name = std::string(prefix) + "alibi_slopes";
    if (mha_status s = check_tensor(t, name.c_str(), 1, 2); s != MHA_OK) return s;
    if (mha_status s = check_f32(t, name.c_str()); s != MHA_OK) return s;
    const bool per_batch = t->ndim == 2;
    if (t->shape[t->ndim - 1] != heads || (per_batch && t->shape[0] != batch)) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "%s has shape %s; it must be [H] = [%lld] or [B, H] = [%lld, %lld]", name.c_str(),
                  shape_text(*t).c_str(), static_cast<long long>(heads),
                  static_cast<long long>(batch), static_cast<long long>(heads));
    }
    for (int64_t b = 0; b < (per_batch ? batch : 1); ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        const float x = static_cast<const float*>(
            t->data)[(per_batch ? b * t->strides[0] : 0) + h * t->strides[t->ndim - 1]];
        if (!std::isfinite(x)) {
          return fail(MHA_ERR_INVALID_VALUE, "%s holds %g; slopes must be finite", name.c_str(),
                      static_cast<double>(x));
        }
      }
    }
  }
  return MHA_OK;
}

mha_status check_call_values(const mha_attention_params& params) {
  if (params.has_scale && (!std::isfinite(params.scale) || params.scale == 0.0f)) {
    return fail(MHA_ERR_INVALID_VALUE, "params->scale = %g; it must be finite and non-zero",
                static_cast<double>(params.scale));
  }
  if (params.causal != MHA_CAUSAL_NONE && params.causal != MHA_CAUSAL_TOP_LEFT &&
      params.causal != MHA_CAUSAL_BOTTOM_RIGHT) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->causal = %d; it must be MHA_CAUSAL_NONE, _TOP_LEFT or _BOTTOM_RIGHT",
                params.causal);
  }
  if (mha_status s = check_window(params.window_left, params.window_right); s != MHA_OK) return s;
  if (!(params.dropout_p >= 0.0f && params.dropout_p < 1.0f)) {
    return fail(MHA_ERR_INVALID_VALUE, "params->dropout_p = %g; it must be in [0, 1)",
                static_cast<double>(params.dropout_p));
  }
  return MHA_OK;
}

bool is_block(const mha_attention_params& params) {
  return params.query_offset != 0 || params.key_offset != 0 || params.full_lq != 0 ||
         params.full_lk != 0;
}

Block block_of(const mha_attention_params& params, int64_t lq, int64_t lk) {
  return Block{params.query_offset, params.key_offset,
               params.full_lq != 0 ? params.full_lq : params.query_offset + lq,
               params.full_lk != 0 ? params.full_lk : params.key_offset + lk};
}

mha_status check_block(const mha_attention_params& params, int64_t lq, int64_t lk) {
  const struct {
    const char* offset_name;
    int64_t offset;
    const char* full_name;
    int64_t full, length;
    const char* length_name;
  } sides[] = {{"query_offset", params.query_offset, "full_lq", params.full_lq, lq, "Lq"},
               {"key_offset", params.key_offset, "full_lk", params.full_lk, lk, "Lk"}};
  for (const auto& s : sides) {
    if (s.offset < 0 || s.offset > MHA_MAX_EXTENT) {
      return fail(MHA_ERR_INVALID_VALUE, "params->%s = %lld; it must be in [0, %lld]",
                  s.offset_name, static_cast<long long>(s.offset),
                  static_cast<long long>(MHA_MAX_EXTENT));
    }
    if (s.full < 0 || s.full > MHA_MAX_EXTENT) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "params->%s = %lld; it must be 0 (this call's own) or "
                  "a length up to %lld",
                  s.full_name, static_cast<long long>(s.full),
                  static_cast<long long>(MHA_MAX_EXTENT));
    }
    if (s.full != 0 && s.offset + s.length > s.full) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "params->%s + %s = %lld + %lld exceeds params->%s = %lld: the block must lie "
                  "inside the full problem",
                  s.offset_name, s.length_name, static_cast<long long>(s.offset),
                  static_cast<long long>(s.length), s.full_name, static_cast<long long>(s.full));
    }
  }
  return MHA_OK;
}

namespace {

// Every check of mha_attention's arguments (params already completed to this
// version's struct); nothing is written.
mha_status check_attention(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                           const mha_tensor* out, const mha_attention_params& params) {
  const mha_tensor* tensors[4] = {q, k, v, out};
  const char* names[4] = {"q", "k", "v", "out"};
  for (int i = 0; i < 4; ++i) {
    if (mha_status s = check_tensor(tensors[i], names[i], 4, 4); s != MHA_OK) return s;
  }
  if (mha_status s = check_dtypes(*q, *k, *v, *out); s != MHA_OK) return s;

  const int64_t batch = q->shape[0], heads = q->shape[1], lq = q->shape[2], d = q->shape[3];
  const int64_t kv_heads = k->shape[1], lk = k->shape[2], dv = v->shape[3];
  if (mha_status s = check_agreements({
          {"batch", "q", batch, "k", k->shape[0]},
          {"batch", "q", batch, "v", v->shape[0]},
          {"batch", "q", batch, "out", out->shape[0]},
          {"KV heads", "k", kv_heads, "v", v->shape[1]},
          {"heads", "q", heads, "out", out->shape[1]},
          {"key length", "k", lk, "v", v->shape[2]},
          {"query length", "q", lq, "out", out->shape[2]},
          {"head size", "q", d, "k", k->shape[3]},
          {"value head size", "v", dv, "out", out->shape[3]},
      });
      s != MHA_OK) {
    return s;
  }
  if (mha_status s = check_head_sizes(
          {{"q->shape[3] (the head size D)", d}, {"v->shape[3] (the head size Dv)", dv}});
      s != MHA_OK) {
    return s;
  }
  if (heads % kv_heads != 0) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "q has %lld heads, not a multiple of the %lld KV heads of k and v",
                static_cast<long long>(heads), static_cast<long long>(kv_heads));
  }

  if (mha_status s = check_call_values(params); s != MHA_OK) return s;
  if (mha_status s = check_block(params, lq, lk); s != MHA_OK) return s;
  const int64_t scale_shape[3] = {batch, kv_heads, lk};
  if (mha_status s =
          check_kv_scales(params, k->dtype == MHA_DTYPE_I8, scale_shape, 3, "[B, Hkv, Lk]");
      s != MHA_OK) {
    return s;
  }
  if (mha_status s =
          check_variants(params.sinks, params.softcap, params.alibi_slopes, batch, heads, "");
      s != MHA_OK) {
    return s;
  }
  if (params.valid_lens != nullptr) {
    if (mha_status s = check_valid_lens(params.valid_lens, "valid_lens", batch, lq, lk);
        s != MHA_OK) {
      return s;
    }
  }
  if (params.mask != nullptr) {
    const int64_t full[4] = {batch, heads, lq, lk};
    if (mha_status s = check_mask(params.mask, full); s != MHA_OK) return s;
  }
  const mha_tensor* lse = params.lse;
  if (lse != nullptr) {
    if (mha_status s = check_tensor(lse, "lse", 3, 3); s != MHA_OK) return s;
    if (mha_status s = check_f32(lse, "lse"); s != MHA_OK) return s;
    if (lse->shape[0] != batch || lse->shape[1] != heads || lse->shape[2] != lq) {
      return fail(MHA_ERR_SHAPE_MISMATCH, "lse must have shape [B=%lld, H=%lld, Lq=%lld]",
                  static_cast<long long>(batch), static_cast<long long>(heads),
                  static_cast<long long>(lq));
    }
  }

  // (lse last: it is checked against the others, not itself.)
  const mha_tensor* inputs[] = {q,
                                k,
                                v,
                                params.mask,
                                params.valid_lens,
                                params.k_scale,
                                params.v_scale,
                                params.sinks,
                                params.alibi_slopes,
                                lse};
  const char* input_names[] = {"q",       "k",       "v",     "mask",         "valid_lens",
                               "k_scale", "v_scale", "sinks", "alibi_slopes", "lse"};
  if (mha_status s = check_no_overlap(*out, "out", inputs, input_names, 10); s != MHA_OK) return s;
  if (lse != nullptr) {
    if (mha_status s = check_no_overlap(*lse, "lse", inputs, input_names, 9); s != MHA_OK) {
      return s;
    }
  }
  return MHA_OK;
}

}  // namespace

void describe_attention(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                        const mha_tensor& out, const mha_attention_params& params,
                        KernelCall* call) {
  mha_kernel_problem& p = call->problem;
  std::memset(&p, 0, sizeof p);
  p.struct_size = static_cast<uint32_t>(sizeof p);
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  std::memcpy(p.q_strides, q.strides, sizeof p.q_strides);
  std::memcpy(p.k_strides, k.strides, sizeof p.k_strides);
  std::memcpy(p.v_strides, v.strides, sizeof p.v_strides);
  p.batch = q.shape[0];
  p.heads = q.shape[1];
  p.kv_heads = k.shape[1];
  p.lq = q.shape[2];
  p.lk = k.shape[2];
  p.d = q.shape[3];
  p.dv = v.shape[3];
  p.scale = params.has_scale ? params.scale
                             : static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.d)));
  // The rules of positions on the full problem, moved into this block's
  // indices: query i is full row query_offset + i, key j full key
  // key_offset + j.
  const Block block = block_of(params, p.lq, p.lk);
  const int64_t shift = block.query_offset - block.key_offset;
  const int64_t upper =
      mha_rules::upper_diagonal(params.causal, params.window_right, block.full_lq, block.full_lk);
  const int64_t lower =
      mha_rules::window_lower_diagonal(params.window_left, block.full_lq, block.full_lk);
  p.causal_diag = upper == mha_rules::kNoCausalLimit ? upper : upper + shift;
  p.lower_diag = lower == -mha_rules::kNoCausalLimit ? lower : lower + shift;
  p.query_offset = block.query_offset;
  p.key_offset = block.key_offset;
  p.full_lq = block.full_lq;
  p.alibi_diag = block.full_lk - block.full_lq + shift;
  p.dropout_p = params.dropout_p;
  p.dropout_seed = params.dropout_seed;
  p.q_dtype = q.dtype;
  p.kv_dtype = k.dtype;
  if (params.k_scale != nullptr && params.v_scale != nullptr) {
    p.k_scale = static_cast<const float*>(params.k_scale->data);
    p.v_scale = static_cast<const float*>(params.v_scale->data);
    std::memcpy(p.k_scale_strides, params.k_scale->strides, sizeof p.k_scale_strides);
    std::memcpy(p.v_scale_strides, params.v_scale->strides, sizeof p.v_scale_strides);
  }
  if (const mha_tensor* vl = params.valid_lens; vl != nullptr) {
    p.valid_lens = vl->data;
    p.valid_lens_is_i64 = vl->dtype == MHA_DTYPE_I64 ? 1 : 0;
    p.valid_lens_strides[0] = vl->strides[0];
    p.valid_lens_strides[1] = vl->ndim == 2 ? vl->strides[1] : 0;
  }
  if (const mha_tensor* mask = params.mask; mask != nullptr) {
    p.mask = mask->data;
    p.mask_kind = mask->dtype == MHA_DTYPE_BOOL ? MHA_MASK_BOOL : MHA_MASK_ADDITIVE;
    p.mask_dtype = mask->dtype;
    broadcast_mask_strides(*mask, p.mask_strides);
  }
  p.softcap = params.softcap;
  if (const mha_tensor* slopes = params.alibi_slopes; slopes != nullptr) {
    p.alibi_slopes = static_cast<const float*>(slopes->data);
    p.alibi_strides[0] = slopes->ndim == 2 ? slopes->strides[0] : 0;
    p.alibi_strides[1] = slopes->strides[slopes->ndim - 1];
  }
  if (const mha_tensor* sinks = params.sinks; sinks != nullptr) {
    p.sinks = static_cast<const float*>(sinks->data);
    p.sinks_stride = sinks->strides[0];
  }
  call->window_left = params.window_left;
  call->window_right = params.window_right;
  call->out = out.data;
  call->out_dtype = out.dtype;
  std::memcpy(call->out_strides, out.strides, sizeof call->out_strides);
  call->lse = nullptr;
  if (const mha_tensor* lse = params.lse; lse != nullptr) {
    call->lse = static_cast<float*>(lse->data);
    std::memcpy(call->lse_strides, lse->strides, sizeof call->lse_strides);
  }
}

mha_status read_attention_params(const mha_attention_params* params, mha_attention_params* given) {
  mha_attention_params_init(given);
  if (params == nullptr) return MHA_OK;
  const mha_attention_params defaults = *given;
  return read_versioned(params, defaults, kAttentionParamsSizes, "params",
                        "mha_attention_params_init", given);
}

mha_status validate_attention(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                              const mha_tensor* out, const mha_attention_params* params,
                              KernelCall* call) {
  mha_attention_params given;
  if (mha_status s = read_attention_params(params, &given); s != MHA_OK) return s;
  if (mha_status s = check_attention(q, k, v, out, given); s != MHA_OK) return s;
  describe_attention(*q, *k, *v, *out, given, call);
  return MHA_OK;
}

}  // namespace mha::rt
