// The packed layout of mha_attention_varlen and mha_attention_varlen_backward:
// the checks of cu_seqlens, seqused_k and block_table against the tensors,
// and the views that make one sequence of the batch a B = 1 call.
#include "varlen_layout.h"

#include <cstring>
#include <string>

#include "error.h"
#include "validate.h"
#include "versioned.h"

namespace mha::rt {
namespace {

using ll = long long;

// cu_seqlens: I32 [B + 1], B >= 1, from 0, non-decreasing, ending at `total`
// (the rows of `rows_of`).  *batch is B (set by the first, checked by the
// second).
mha_status check_cu_seqlens(const mha_tensor* cu, const char* name, const char* rows_of,
                            int64_t total, int64_t* batch) {
  if (cu == nullptr) {
    return fail(MHA_ERR_NULL_POINTER, "varlen->%s is NULL; it must be I32 [B + 1]", name);
  }
  const std::string full = std::string("varlen->") + name;
  if (mha_status s = check_tensor(cu, full.c_str(), 1, 1); s != MHA_OK) return s;
  if (cu->dtype != MHA_DTYPE_I32) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be i32", full.c_str(),
                dtype_name(cu->dtype));
  }
  const int64_t n = cu->shape[0];
  if (n < 2) {
    return fail(MHA_ERR_INVALID_SIZE,
                "%s has shape %s; it must be [B + 1] with at least one sequence", full.c_str(),
                shape_text(*cu).c_str());
  }
  if (*batch != 0 && n != *batch + 1) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "%s has shape %s but varlen->cu_seqlens_q has %lld entries: both are [B + 1]",
                full.c_str(), shape_text(*cu).c_str(), static_cast<ll>(*batch) + 1);
  }
  *batch = n - 1;
  if (offset_at(*cu, 0) != 0) {
    return fail(MHA_ERR_INVALID_VALUE, "%s[0] = %d; it must be 0", full.c_str(), offset_at(*cu, 0));
  }
  for (int64_t b = 0; b + 1 < n; ++b) {
    if (offset_at(*cu, b + 1) < offset_at(*cu, b)) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "%s[%lld] = %d is below %s[%lld] = %d; the offsets must not decrease",
                  full.c_str(), static_cast<ll>(b) + 1, offset_at(*cu, b + 1), name,
                  static_cast<ll>(b), offset_at(*cu, b));
    }
  }
  if (offset_at(*cu, n - 1) != total) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "%s[%lld] = %d but %s has %lld rows; the last offset is the total", full.c_str(),
                static_cast<ll>(n - 1), offset_at(*cu, n - 1), rows_of, static_cast<ll>(total));
  }
  return MHA_OK;
}

// An I32 vector or matrix of varlen's: shape [rows] or [rows, cols] (cols
// unchecked).
mha_status check_i32(const mha_tensor* t, const char* name, int32_t ndim, int64_t rows,
                     const char* layout) {
  const std::string full = std::string("varlen->") + name;
  if (mha_status s = check_tensor(t, full.c_str(), ndim, ndim); s != MHA_OK) return s;
  if (t->dtype != MHA_DTYPE_I32) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be i32 %s", full.c_str(),
                dtype_name(t->dtype), layout);
  }
  if (t->shape[0] != rows) {
    return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must be %s with B = %lld",
                full.c_str(), shape_text(*t).c_str(), layout, static_cast<ll>(rows));
  }
  return MHA_OK;
}

int32_t i32_at(const mha_tensor& t, int64_t row, int64_t col = 0) {
  return static_cast<const int32_t*>(
      t.data)[row * t.strides[0] + col * (t.ndim > 1 ? t.strides[1] : 0)];
}

// Packed keys: cu_seqlens_k, and seqused_k if given, within each sequence's
// rows.  Paged: seqused_k within each row of block_table, every block id a
// used key addresses in [0, num_blocks), block_size a multiple of 8.
mha_status check_keys(const mha_tensor& k, const mha_varlen_params& varlen, int64_t* batch) {
  const bool paged = varlen.block_table != nullptr;
  if (!paged) {
    if (mha_status s =
            check_cu_seqlens(varlen.cu_seqlens_k, "cu_seqlens_k", "k", k.shape[0], batch);
        s != MHA_OK) {
      return s;
    }
  } else if (varlen.cu_seqlens_k != nullptr) {
    return fail(MHA_ERR_INVALID_VALUE,
                "varlen->cu_seqlens_k is given with varlen->block_table; a paged cache's "
                "lengths are varlen->seqused_k");
  }
  if (paged && varlen.seqused_k == nullptr) {
    return fail(MHA_ERR_NULL_POINTER,
                "varlen->seqused_k is NULL; with varlen->block_table it must give each "
                "sequence's number of keys, I32 [B]");
  }
  if (varlen.seqused_k != nullptr) {
    if (mha_status s = check_i32(varlen.seqused_k, "seqused_k", 1, *batch, "[B]"); s != MHA_OK) {
      return s;
    }
  }
  int64_t capacity = 0;
  const int64_t block_size = paged ? k.shape[1] : 0, num_blocks = k.shape[0];
  if (paged) {
    if (mha_status s = check_i32(varlen.block_table, "block_table", 2, *batch, "[B, max_blocks]");
        s != MHA_OK) {
      return s;
    }
    if (varlen.block_table->shape[1] > 1 && varlen.block_table->strides[1] != 1) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "varlen->block_table has stride %lld along max_blocks; its rows must be "
                  "contiguous (stride 1)",
                  static_cast<ll>(varlen.block_table->strides[1]));
    }
    if (block_size % 8 != 0) {
      return fail(MHA_ERR_INVALID_SIZE,
                  "k has block_size %lld (its shape[1], of [num_blocks, block_size, Hkv, D]); it "
                  "must be a positive multiple of 8",
                  static_cast<ll>(block_size));
    }
    capacity = varlen.block_table->shape[1] * block_size;
  }
  for (int64_t b = 0; b < *batch && varlen.seqused_k != nullptr; ++b) {
    const int64_t used = i32_at(*varlen.seqused_k, b);
    const int64_t limit = paged ? capacity : keys_available(varlen, b);
    if (used < 0 || used > limit) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "varlen->seqused_k[%lld] = %lld; it must be in [0, %lld] (%s)",
                  static_cast<ll>(b), static_cast<ll>(used), static_cast<ll>(limit),
                  paged ? "max_blocks · block_size" : "the sequence's rows in cu_seqlens_k");
    }
    if (!paged) continue;
    for (int64_t n = 0; n * block_size < used; ++n) {
      const int64_t block = i32_at(*varlen.block_table, b, n);
      if (block < 0 || block >= num_blocks) {
        return fail(MHA_ERR_INVALID_VALUE,
                    "varlen->block_table[%lld][%lld] = %lld; sequence %lld's keys need it in [0, "
                    "%lld) (num_blocks)",
                    static_cast<ll>(b), static_cast<ll>(n), static_cast<ll>(block),
                    static_cast<ll>(b), static_cast<ll>(num_blocks));
      }
    }
  }
  return MHA_OK;
}

}  // namespace

int32_t offset_at(const mha_tensor& cu, int64_t b) {
  return static_cast<const int32_t*>(cu.data)[b * cu.strides[0]];
}

// The rows of packed keys sequence b has (before seqused_k).
int64_t keys_available(const mha_varlen_params& varlen, int64_t b) {
  return offset_at(*varlen.cu_seqlens_k, b + 1) - offset_at(*varlen.cu_seqlens_k, b);
}

// The keys sequence b uses (paged: seqused_k, which is then required).
int64_t keys_used(const mha_varlen_params& varlen, int64_t b) {
  return varlen.seqused_k != nullptr ? i32_at(*varlen.seqused_k, b) : keys_available(varlen, b);
}
// Every check of mha_attention_varlen's arguments; *batch is B.
mha_status check_varlen(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                        const mha_tensor* out, const mha_varlen_params& varlen,
                        const mha_attention_params& params, int64_t* batch) {
  const bool paged = varlen.block_table != nullptr;
  const int32_t kv_ndim = paged ? 4 : 3;  // [num_blocks, block_size, ...] or [total_k, ...]
  const mha_tensor* tensors[4] = {q, k, v, out};
  const char* names[4] = {"q", "k", "v", "out"};
  for (int i = 0; i < 4; ++i) {
    const int32_t ndim = i == 1 || i == 2 ? kv_ndim : 3;
    if (mha_status s = check_tensor(tensors[i], names[i], ndim, ndim); s != MHA_OK) return s;
  }
  if (mha_status s = check_dtypes(*q, *k, *v, *out); s != MHA_OK) return s;
  const int32_t h_axis = kv_ndim - 2;  // k's and v's head axis
  const int64_t total_q = q->shape[0], heads = q->shape[1], d = q->shape[2];
  const int64_t kv_heads = k->shape[h_axis], dv = v->shape[h_axis + 1];
  if (mha_status s = check_agreements({
          {"total_q", "q", total_q, "out", out->shape[0]},
          {paged ? "num_blocks" : "total_k", "k", k->shape[0], "v", v->shape[0]},
          {"block_size", "k", k->shape[1], "v", v->shape[1]},  // (paged; else KV heads, again)
          {"KV heads", "k", kv_heads, "v", v->shape[h_axis]},
          {"heads", "q", heads, "out", out->shape[1]},
          {"head size", "q", d, "k", k->shape[h_axis + 1]},
          {"value head size", "v", dv, "out", out->shape[2]},
      });
      s != MHA_OK) {
    return s;
  }
  if (mha_status s =
          check_head_sizes({{"q->shape[2] (the head size D)", d}, {"the head size Dv of v", dv}});
      s != MHA_OK) {
    return s;
  }
  if (heads % kv_heads != 0) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "q has %lld heads, not a multiple of the %lld KV heads of k and v",
                static_cast<ll>(heads), static_cast<ll>(kv_heads));
  }
  *batch = 0;
  if (mha_status s = check_cu_seqlens(varlen.cu_seqlens_q, "cu_seqlens_q", "q", total_q, batch);
      s != MHA_OK) {
    return s;
  }
  if (mha_status s = check_keys(*k, varlen, batch); s != MHA_OK) return s;

  if (mha_status s = check_call_values(params); s != MHA_OK) return s;
  if (is_block(params)) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->query_offset, key_offset, full_lq and full_lk must be 0: "
                "mha_attention_varlen takes whole sequences (a block of one: mha_attention)");
  }
  if (params.valid_lens != nullptr) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->valid_lens is given; mha_attention_varlen takes each sequence's length "
                "from varlen->cu_seqlens_q and cu_seqlens_k");
  }
  if (params.mask != nullptr) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->mask is given; mha_attention_varlen takes no mask (causal, windows "
                "and the other variants apply per sequence)");
  }
  // An int8 cache's row scales: K's shape less the head size.
  if (mha_status s = check_kv_scales(params, k->dtype == MHA_DTYPE_I8, k->shape, k->ndim - 1,
                                     paged ? "[num_blocks, block_size, Hkv]" : "[total_k, Hkv]");
      s != MHA_OK) {
    return s;
  }
  if (mha_status s =
          check_variants(params.sinks, params.softcap, params.alibi_slopes, *batch, heads, "");
      s != MHA_OK) {
    return s;
  }
  const mha_tensor* lse = params.lse;
  if (lse != nullptr) {
    if (mha_status s = check_tensor(lse, "lse", 2, 2); s != MHA_OK) return s;
    if (mha_status s = check_f32(lse, "lse"); s != MHA_OK) return s;
    if (lse->shape[0] != heads || lse->shape[1] != total_q) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "lse has shape %s; it must be [H, total_q] = [%lld, %lld]",
                  shape_text(*lse).c_str(), static_cast<ll>(heads), static_cast<ll>(total_q));
    }
  }
  // (lse last: it is checked against the others, not itself.)
  const mha_tensor* inputs[] = {q,
                                k,
                                v,
                                varlen.cu_seqlens_q,
                                varlen.cu_seqlens_k,
                                varlen.seqused_k,
                                varlen.block_table,
                                params.k_scale,
                                params.v_scale,
                                params.sinks,
                                params.alibi_slopes,
                                lse};
  const char* input_names[] = {"q",
                               "k",
                               "v",
                               "varlen->cu_seqlens_q",
                               "varlen->cu_seqlens_k",
                               "varlen->seqused_k",
                               "varlen->block_table",
                               "k_scale",
                               "v_scale",
                               "sinks",
                               "alibi_slopes",
                               "lse"};
  if (mha_status s = check_no_overlap(*out, "out", inputs, input_names, 12); s != MHA_OK) return s;
  if (lse != nullptr) {
    if (mha_status s = check_no_overlap(*lse, "lse", inputs, input_names, 11); s != MHA_OK) {
      return s;
    }
  }
  return MHA_OK;
}

// Rows [first, first + rows) of a packed [total, heads, D] tensor as the
// [1, heads, rows, D] tensor of a one-sequence call.
mha_tensor sequence_view(const mha_tensor& t, int64_t first, int64_t rows) {
  mha_tensor view{};
  view.data = static_cast<char*>(t.data) + first * t.strides[0] * dtype_size(t.dtype);
  view.dtype = t.dtype;
  view.ndim = 4;
  const int64_t shape[4] = {1, t.shape[1], rows, t.shape[2]};
  const int64_t strides[4] = {0, t.strides[1], t.strides[0], t.strides[2]};
  std::memcpy(view.shape, shape, sizeof shape);
  std::memcpy(view.strides, strides, sizeof strides);
  return view;
}

// A paged cache [num_blocks, block_size, heads, D] as the [1, heads, rows, D]
// tensor of a one-sequence call whose stride [0] steps from block to block
// and [2] from row to row within a block: the kernel problem's paged
// addressing (plugin_abi.h), once block_table is set.
mha_tensor paged_view(const mha_tensor& t, int64_t rows) {
  mha_tensor view{};
  view.data = t.data;
  view.dtype = t.dtype;
  view.ndim = 4;
  const int64_t shape[4] = {1, t.shape[2], rows, t.shape[3]};
  const int64_t strides[4] = {t.strides[0], t.strides[2], t.strides[1], t.strides[3]};
  std::memcpy(view.shape, shape, sizeof shape);
  std::memcpy(view.strides, strides, sizeof strides);
  return view;
}

// An int8 cache's scales, [total_k, Hkv] (rows from `first`) or paged
// [num_blocks, block_size, Hkv], as the [1, Hkv, rows] scales of a
// one-sequence call (paged: stride [0] from block to block).
mha_tensor scales_view(const mha_tensor& s, bool paged, int64_t first, int64_t rows) {
  mha_tensor view = s;
  view.ndim = 3;
  if (paged) {
    const int64_t shape[3] = {1, s.shape[2], rows};
    const int64_t strides[3] = {s.strides[0], s.strides[2], s.strides[1]};
    std::memcpy(view.shape, shape, sizeof shape);
    std::memcpy(view.strides, strides, sizeof strides);
  } else {
    view.data = static_cast<float*>(s.data) + first * s.strides[0];
    const int64_t shape[3] = {1, s.shape[1], rows}, strides[3] = {0, s.strides[1], s.strides[0]};
    std::memcpy(view.shape, shape, sizeof shape);
    std::memcpy(view.strides, strides, sizeof strides);
  }
  return view;
}

// Columns [first, first + rows) of an F32 [H, total_q] LSE as the [1, H, rows]
// LSE of a one-sequence call.
mha_tensor lse_view(const mha_tensor& lse, int64_t first, int64_t rows) {
  mha_tensor view = lse;
  view.data = static_cast<float*>(lse.data) + first * lse.strides[1];
  view.ndim = 3;
  const int64_t shape[3] = {1, lse.shape[0], rows},
                strides[3] = {0, lse.strides[0], lse.strides[1]};
  std::memcpy(view.shape, shape, sizeof shape);
  std::memcpy(view.strides, strides, sizeof strides);
  return view;
}

// Row b of per-sequence ALiBi slopes [B, H] as the [H] slopes of a
// one-sequence call.
mha_tensor alibi_row_view(const mha_tensor& slopes, int64_t b) {
  mha_tensor view = slopes;
  view.data = static_cast<float*>(slopes.data) + b * slopes.strides[0];
  view.ndim = 1;
  view.shape[0] = slopes.shape[1];
  view.strides[0] = slopes.strides[1];
  return view;
}

mha_status read_varlen_params(const mha_varlen_params* given, mha_varlen_params* varlen) {
  if (given == nullptr) {
    return fail(MHA_ERR_NULL_POINTER,
                "varlen is NULL; it holds cu_seqlens_q and cu_seqlens_k (mha_varlen_params_init)");
  }
  mha_varlen_params_init(varlen);
  const mha_varlen_params defaults = *varlen;
  return read_versioned(given, defaults, kVarlenParamsSizes, "varlen", "mha_varlen_params_init",
                        varlen);
}

}  // namespace mha::rt
