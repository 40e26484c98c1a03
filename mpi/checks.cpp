#include "checks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "blocks.h"
#include "common/dtype.h"
#include "error.h"

namespace mha::mpi {
namespace {

constexpr uint32_t kOldestParamsSize = 56;  // mha 0.1's mha_attention_params

const char* dtype_text(int32_t dtype) {
  switch (dtype) {
    case MHA_DTYPE_F32:
      return "f32";
    case MHA_DTYPE_BF16:
      return "bf16";
    case MHA_DTYPE_F16:
      return "f16";
    case MHA_DTYPE_I8:
      return "i8";
    case MHA_DTYPE_I32:
      return "i32";
    case MHA_DTYPE_I64:
      return "i64";
    case MHA_DTYPE_BOOL:
      return "bool";
    default:
      return "invalid";
  }
}

bool is_float(int32_t dtype) {
  return dtype == MHA_DTYPE_F32 || dtype == MHA_DTYPE_BF16 || dtype == MHA_DTYPE_F16;
}

bool is_empty(const mha_tensor& t) {
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return true;
  }
  return false;
}

mha_status check_tensor(const mha_tensor* t, const char* name, int32_t ndim) {
  if (t == nullptr) return fail(MHA_ERR_NULL_POINTER, "%s is NULL", name);
  if (t->ndim != ndim) {
    return fail(MHA_ERR_INVALID_SIZE, "%s has %d dimensions; it must have %d", name, t->ndim, ndim);
  }
  for (int32_t d = 0; d < ndim; ++d) {
    if (t->shape[d] < 0 || t->shape[d] > MHA_MAX_EXTENT) {
      return fail(MHA_ERR_INVALID_SIZE, "%s->shape[%d] = %lld is out of range", name, d,
                  static_cast<long long>(t->shape[d]));
    }
    if (t->strides[d] < 0) {
      return fail(MHA_ERR_INVALID_STRIDES, "%s->strides[%d] = %lld is negative", name, d,
                  static_cast<long long>(t->strides[d]));
    }
  }
  // A rank's shard may be empty (0 rows), and then its data NULL.
  if (t->data == nullptr && !is_empty(*t)) {
    return fail(MHA_ERR_NULL_POINTER, "%s->data is NULL", name);
  }
  return MHA_OK;
}

mha_status same_extent(const mha_tensor& a, int32_t da, const char* name_a, const mha_tensor& b,
                       int32_t db, const char* name_b) {
  if (a.shape[da] == b.shape[db]) return MHA_OK;
  return fail(MHA_ERR_SHAPE_MISMATCH, "%s->shape[%d] = %lld but %s->shape[%d] = %lld", name_a, da,
              static_cast<long long>(a.shape[da]), name_b, db, static_cast<long long>(b.shape[db]));
}

mha_status check_valid_lens(const mha_tensor* vl, int64_t batch, int64_t lq) {
  if (vl->ndim != 1 && vl->ndim != 2) {
    return fail(MHA_ERR_INVALID_SIZE,
                "params->valid_lens has %d dimensions; it must be [B] or [B, Lq]", vl->ndim);
  }
  if (vl->dtype != MHA_DTYPE_I32 && vl->dtype != MHA_DTYPE_I64) {
    return fail(MHA_ERR_INVALID_DTYPE, "params->valid_lens has dtype %s; it must be i32 or i64",
                dtype_text(vl->dtype));
  }
  if (vl->data == nullptr && !is_empty(*vl)) {
    return fail(MHA_ERR_NULL_POINTER, "params->valid_lens->data is NULL");
  }
  if (vl->shape[0] != batch || (vl->ndim == 2 && vl->shape[1] != lq)) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "params->valid_lens must be [%lld] or [%lld, %lld] (this rank's queries)",
                static_cast<long long>(batch), static_cast<long long>(batch),
                static_cast<long long>(lq));
  }
  for (int32_t d = 0; d < vl->ndim; ++d) {
    if (vl->strides[d] < 0) {
      return fail(MHA_ERR_INVALID_STRIDES, "params->valid_lens->strides[%d] is negative", d);
    }
  }
  return MHA_OK;
}

// The bytes a tensor reaches, [first, last] (empty tensors: none).
struct Extent {
  const char* first;
  const char* last;
  bool empty;
};
Extent extent_of(const mha_tensor& t) {
  const int64_t bytes = t.dtype == MHA_DTYPE_I8 ? 1 : mha_types::float_bytes(t.dtype);
  int64_t span = 0;
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return Extent{nullptr, nullptr, true};
    span += (t.shape[d] - 1) * t.strides[d];
  }
  const char* first = static_cast<const char*>(t.data);
  return Extent{first, first + span * bytes + bytes - 1, false};
}
bool overlap(const mha_tensor& a, const mha_tensor& b) {
  const Extent x = extent_of(a), y = extent_of(b);
  return !x.empty && !y.empty && x.first <= y.last && y.first <= x.last;
}

int64_t valid_len_at(const mha_tensor& t, int64_t b, int64_t i) {
  const int64_t at = b * t.strides[0] + (t.ndim == 2 ? i * t.strides[1] : 0);
  return t.dtype == MHA_DTYPE_I64 ? static_cast<const int64_t*>(t.data)[at]
                                  : static_cast<const int32_t*>(t.data)[at];
}

// Everything else mha_attention checks -- the scale, the causal mode, the
// window, dropout, the softcap, ALiBi's slopes, the sinks -- checked by
// mha_attention itself, on a stand-in problem of one query and one key of
// this rank's sizes and dtypes (zeros; a shard may have no rows, and the
// caller's outputs must not be written): the same messages as a direct
// call, and no second copy of those rules here.  Valid lengths count the
// full problem's keys and are checked across ranks instead; shapes, dtypes
// and overlaps were checked above.
mha_status check_with_libmha(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                             const mha_tensor& out, const mha_attention_params& params) {
  const int64_t batch = q.shape[0], heads = q.shape[1], kv_heads = k.shape[1];
  const int64_t d = q.shape[3], dv = v.shape[3];
  int64_t elements = 0;
  if (!product(batch, heads, std::max(d, dv), 1, &elements) || elements > (int64_t{1} << 28)) {
    return fail(MHA_ERR_SIZE_OVERFLOW, "q [%lld, %lld, .., %lld] is too large",
                static_cast<long long>(batch), static_cast<long long>(heads),
                static_cast<long long>(d));
  }
  // Zeros of any dtype (4 bytes per element covers every one).
  std::vector<float> qz(static_cast<size_t>(batch * heads * d)),
      kz(static_cast<size_t>(batch * kv_heads * d));
  std::vector<float> vz(static_cast<size_t>(batch * kv_heads * dv));
  std::vector<float> oz(static_cast<size_t>(batch * heads * dv)),
      lz(static_cast<size_t>(batch * heads));
  std::vector<float> scales(static_cast<size_t>(batch * kv_heads), 1.0f);
  const mha_tensor q1 = dense(qz.data(), q.dtype, batch, heads, 1, d);
  const mha_tensor k1 = dense(kz.data(), k.dtype, batch, kv_heads, 1, d);
  const mha_tensor v1 = dense(vz.data(), v.dtype, batch, kv_heads, 1, dv);
  mha_tensor o1 = dense(oz.data(), out.dtype, batch, heads, 1, dv);
  mha_tensor l1 = dense3(lz.data(), batch, heads, 1);
  mha_tensor s1 = dense3(scales.data(), batch, kv_heads, 1);
  mha_attention_params dry = params;
  dry.valid_lens = nullptr;
  dry.lse = params.lse != nullptr ? &l1 : nullptr;
  if (params.k_scale != nullptr) dry.k_scale = &s1;
  if (params.v_scale != nullptr) dry.v_scale = &s1;
  const mha_status status = mha_attention(&q1, &k1, &v1, &o1, &dry);
  if (status != MHA_OK) return fail(status, "%s", mha_last_error());
  return MHA_OK;
}

}  // namespace

bool product(int64_t a, int64_t b, int64_t c, int64_t d, int64_t* count) {
  int64_t ab = 0, abc = 0;
  return !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, &abc) &&
         !__builtin_mul_overflow(abc, d, count);
}

mha_status read_params(const mha_attention_params* given, mha_attention_params* params) {
  mha_attention_params_init(params);
  if (given == nullptr) return MHA_OK;
  if (given->struct_size < kOldestParamsSize || given->struct_size > sizeof(*params)) {
    return fail(MHA_ERR_INVALID_PARAMS,
                "params->struct_size = %u is not a size mha_attention_params has had "
                "(initialise it with mha_attention_params_init)",
                given->struct_size);
  }
  std::memcpy(params, given, given->struct_size);
  params->struct_size = sizeof(*params);
  return MHA_OK;
}

mha_status read_mpi_params(const mha_mpi_params* given, mha_mpi_params* mpi) {
  mha_mpi_params_init(mpi);
  if (given == nullptr) return MHA_OK;
  if (given->struct_size != sizeof(*mpi)) {
    return fail(MHA_ERR_INVALID_PARAMS,
                "mpi->struct_size = %u is not a size mha_mpi_params has had "
                "(initialise it with mha_mpi_params_init)",
                given->struct_size);
  }
  *mpi = *given;
  if (mpi->layout != MHA_MPI_CONTIGUOUS && mpi->layout != MHA_MPI_ZIGZAG) {
    return fail(MHA_ERR_INVALID_VALUE,
                "mpi->layout = %d; it must be MHA_MPI_CONTIGUOUS (0) or MHA_MPI_ZIGZAG (1)",
                mpi->layout);
  }
  return MHA_OK;
}

mha_status check_local(Call call, const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                       const mha_tensor* out, const mha_attention_params& params, Shard* shard) {
  const bool ring = call == Call::kRing;
  const char* kname = ring ? "k" : "k_shard";
  const char* vname = ring ? "v" : "v_shard";
  if (mha_status s = check_tensor(q, "q", 4); s != MHA_OK) return s;
  if (mha_status s = check_tensor(k, kname, 4); s != MHA_OK) return s;
  if (mha_status s = check_tensor(v, vname, 4); s != MHA_OK) return s;
  if (mha_status s = check_tensor(out, "out", 4); s != MHA_OK) return s;
  if (!is_float(q->dtype)) {
    return fail(MHA_ERR_INVALID_DTYPE, "q has dtype %s; it must be f32, bf16 or f16",
                dtype_text(q->dtype));
  }
  const bool int8 = k->dtype == MHA_DTYPE_I8;
  if (!is_float(k->dtype) && !(int8 && !ring)) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be f32, bf16 or f16%s", kname,
                dtype_text(k->dtype), ring ? " (int8 caches: mha_attention_mpi_decode)" : " or i8");
  }
  if (v->dtype != k->dtype) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s but %s has %s; they must agree", vname,
                dtype_text(v->dtype), kname, dtype_text(k->dtype));
  }
  if (out->dtype != MHA_DTYPE_F32 && out->dtype != q->dtype) {
    return fail(MHA_ERR_INVALID_DTYPE, "out has dtype %s; it must be f32 or q's dtype (%s)",
                dtype_text(out->dtype), dtype_text(q->dtype));
  }
  const struct {
    const mha_tensor* a;
    int32_t da;
    const char* na;
    const mha_tensor* b;
    int32_t db;
    const char* nb;
  } agree_on[] = {
      {k, 0, kname, q, 0, "q"},   {v, 0, vname, q, 0, "q"},   {out, 0, "out", q, 0, "q"},
      {out, 1, "out", q, 1, "q"}, {v, 1, vname, k, 1, kname}, {k, 3, kname, q, 3, "q"},
      {v, 2, vname, k, 2, kname}, {out, 2, "out", q, 2, "q"}, {out, 3, "out", v, 3, vname}};
  for (const auto& e : agree_on) {
    if (mha_status s = same_extent(*e.a, e.da, e.na, *e.b, e.db, e.nb); s != MHA_OK) return s;
  }
  if (k->shape[1] == 0 || q->shape[1] % k->shape[1] != 0) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "q has %lld heads, not a multiple of %s's %lld (grouped-query attention)",
                static_cast<long long>(q->shape[1]), kname, static_cast<long long>(k->shape[1]));
  }
  if (params.mask != nullptr) {
    return fail(MHA_ERR_UNSUPPORTED,
                "params->mask: explicit masks are not supported across ranks (use causal, "
                "valid_lens or the window)");
  }
  if (params.full_lq != 0 || params.full_lk != 0 || params.query_offset != 0 ||
      params.key_offset != 0) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->full_lq / full_lk / query_offset / key_offset must be 0: the MPI calls "
                "set them for the blocks they compute");
  }
  if (ring && (params.k_scale != nullptr || params.v_scale != nullptr)) {
    return fail(MHA_ERR_UNSUPPORTED, "params->k_scale: int8 caches are not supported by the ring");
  }
  if (params.lse != nullptr) {
    const mha_tensor* lse = params.lse;
    if (mha_status s = check_tensor(lse, "params->lse", 3); s != MHA_OK) return s;
    if (lse->dtype != MHA_DTYPE_F32) {
      return fail(MHA_ERR_INVALID_DTYPE, "params->lse has dtype %s; it must be f32",
                  dtype_text(lse->dtype));
    }
    for (int32_t d = 0; d < 3; ++d) {
      if (mha_status s = same_extent(*lse, d, "params->lse", *out, d, "out"); s != MHA_OK) return s;
    }
  }
  if (const mha_tensor* sinks = params.sinks; sinks != nullptr) {
    if (mha_status s = check_tensor(sinks, "params->sinks", 1); s != MHA_OK) return s;
    if (sinks->dtype != MHA_DTYPE_F32 || sinks->shape[0] != q->shape[1]) {
      return fail(MHA_ERR_SHAPE_MISMATCH, "params->sinks must be f32 [%lld] (one logit per head)",
                  static_cast<long long>(q->shape[1]));
    }
    for (int64_t h = 0; h < sinks->shape[0]; ++h) {
      const float x = static_cast<const float*>(sinks->data)[h * sinks->strides[0]];
      if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) {
        return fail(MHA_ERR_INVALID_VALUE, "params->sinks[%lld] = %g; it must not be NaN or +inf",
                    static_cast<long long>(h), static_cast<double>(x));
      }
    }
  }
  if (params.valid_lens != nullptr) {
    if (mha_status s = check_valid_lens(params.valid_lens, q->shape[0], q->shape[2]); s != MHA_OK) {
      return s;
    }
  }
  // The results are built in place while the inputs are read: outputs may
  // not share a byte with an input or each other (checked by address range).
  const struct {
    const mha_tensor* output;
    const char* name;
  } outputs[] = {{out, "out"}, {params.lse, "params->lse"}};
  const struct {
    const mha_tensor* input;
    const char* name;
  } inputs[] = {{q, "q"}, {k, kname}, {v, vname}};
  for (const auto& o : outputs) {
    if (o.output == nullptr) continue;
    for (const auto& in : inputs) {
      if (overlap(*o.output, *in.input)) {
        return fail(MHA_ERR_OVERLAP, "%s overlaps %s; outputs must not share memory with inputs",
                    o.name, in.name);
      }
    }
  }
  if (params.lse != nullptr && overlap(*out, *params.lse)) {
    return fail(MHA_ERR_OVERLAP, "params->lse overlaps out");
  }
  if (mha_status s = check_with_libmha(*q, *k, *v, *out, params); s != MHA_OK) return s;
  *shard = Shard{MHA_OK,      q->shape[0], q->shape[1], k->shape[1], q->shape[3], v->shape[3],
                 q->shape[2], k->shape[2], q->dtype,    out->dtype,  0,           params.causal};
  return MHA_OK;
}

bool exchange_arguments(MPI_Comm comm, Call call, int rank, const mha_tensor* q,
                        const mha_tensor* k, const mha_tensor* v, const mha_tensor* out,
                        const mha_attention_params* params, const mha_mpi_params* mpi,
                        Arguments* args, mha_status* status) {
  args->mine = Shard{};
  mha_status s = read_params(params, &args->params);
  if (s == MHA_OK) s = read_mpi_params(mpi, &args->mpi);
  if (s == MHA_OK) s = check_local(call, q, k, v, out, args->params, &args->mine);
  args->mine.status = s;
  // The ring's layout must be the same on every rank (check_global).
  if (call == Call::kRing) args->mine.layout = args->mpi.layout;
  args->shards = gather_shards(comm, args->mine);
  int failed_rank = -1;
  if (first_failure(args->shards, &failed_rank) != MHA_OK) {
    *status = agree(comm, s);
    return false;
  }
  *status = check_global(call, args->shards, rank, args->params);
  return true;
}

mha_status check_global(Call call, const std::vector<Shard>& shards, int rank,
                        const mha_attention_params& params) {
  const Shard& first = shards[0];
  int64_t full_lq = 0, full_lk = 0;
  for (size_t r = 0; r < shards.size(); ++r) {
    const Shard& s = shards[r];
    const struct {
      int64_t mine, first;
      const char* what;
    } same[] = {{s.batch, first.batch, "batch size (q->shape[0])"},
                {s.heads, first.heads, "head count (q->shape[1])"},
                {s.kv_heads, first.kv_heads, "KV head count (k->shape[1])"},
                {s.d, first.d, "head size (q->shape[3])"},
                {s.dv, first.dv, "value head size (v->shape[3])"},
                {s.q_dtype, first.q_dtype, "q dtype"},
                {s.causal, first.causal, "params->causal"},
                {s.layout, first.layout, "mpi->layout"},
                {call == Call::kDecode ? s.lq : 0, call == Call::kDecode ? first.lq : 0,
                 "query count (q->shape[2]; decode: the same queries on every rank)"}};
    for (const auto& e : same) {
      if (e.mine != e.first) {
        return fail(MHA_ERR_SHAPE_MISMATCH, "rank %zu: its %s is %lld but rank 0's is %lld", r,
                    e.what, static_cast<long long>(e.mine), static_cast<long long>(e.first));
      }
    }
    if (__builtin_add_overflow(full_lq, s.lq, &full_lq) ||
        __builtin_add_overflow(full_lk, s.lk, &full_lk)) {
      return fail(MHA_ERR_SIZE_OVERFLOW, "the ranks' sequence lengths overflow 64 bits");
    }
  }
  if (call == Call::kDecode) full_lq = first.lq;
  if (full_lq > MHA_MAX_EXTENT || full_lk > MHA_MAX_EXTENT) {
    return fail(MHA_ERR_INVALID_SIZE, "the full sequence (Lq %lld, Lk %lld) exceeds %lld positions",
                static_cast<long long>(full_lq), static_cast<long long>(full_lk),
                static_cast<long long>(MHA_MAX_EXTENT));
  }
  if (const mha_tensor* vl = params.valid_lens; vl != nullptr) {
    const Shard& mine = shards[static_cast<size_t>(rank)];
    const int64_t rows = vl->ndim == 2 ? mine.lq : 1;
    for (int64_t b = 0; b < mine.batch; ++b) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t n = valid_len_at(*vl, b, i);
        if (n < 0 || n > full_lk) {
          char at[64];
          if (vl->ndim == 2) {
            std::snprintf(at, sizeof at, "[%lld, %lld]", static_cast<long long>(b),
                          static_cast<long long>(i));
          } else {
            std::snprintf(at, sizeof at, "[%lld]", static_cast<long long>(b));
          }
          return fail(MHA_ERR_INVALID_VALUE,
                      "params->valid_lens%s = %lld is outside [0, %lld] (the full key count)", at,
                      static_cast<long long>(n), static_cast<long long>(full_lk));
        }
      }
    }
  }
  return MHA_OK;
}

}  // namespace mha::mpi
