// The packed layout of a variable-length batch (FlashAttention-2's varlen:
// cu_seqlens, seqused_k, a paged cache's block_table), shared by
// mha_attention_varlen and mha_attention_varlen_backward: its checks, and the
// views of the packed tensors that make one sequence a B = 1 call.
#pragma once

#include <mha/mha.h>

#include <cstdint>

namespace mha::rt {

// *varlen = the caller's struct as this library's version reads it (NULL or
// a bad struct_size refused by name).
mha_status read_varlen_params(const mha_varlen_params* given, mha_varlen_params* varlen);

// Every check of mha_attention_varlen's arguments (params->lse as its LSE,
// [H, total_q]); *batch is B.
mha_status check_varlen(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                        const mha_tensor* out, const mha_varlen_params& varlen,
                        const mha_attention_params& params, int64_t* batch);

// cu_seqlens[b] (a checked I32 [B + 1]).
int32_t offset_at(const mha_tensor& cu, int64_t b);
// The rows of packed keys sequence b has (before seqused_k).
int64_t keys_available(const mha_varlen_params& varlen, int64_t b);
// The keys sequence b uses (paged: seqused_k, which is then required).
int64_t keys_used(const mha_varlen_params& varlen, int64_t b);

// Rows [first, first + rows) of a packed [total, heads, D] tensor as the
// [1, heads, rows, D] tensor of a one-sequence call.
mha_tensor sequence_view(const mha_tensor& t, int64_t first, int64_t rows);
// A paged cache [num_blocks, block_size, heads, D] as the [1, heads, rows, D]
// tensor of a one-sequence call (the kernel problem's paged addressing, once
// block_table is set).
mha_tensor paged_view(const mha_tensor& t, int64_t rows);
// An int8 cache's scales ([total_k, Hkv] from row `first`, or paged) as the
// [1, Hkv, rows] scales of a one-sequence call.
mha_tensor scales_view(const mha_tensor& s, bool paged, int64_t first, int64_t rows);
// Columns [first, first + rows) of an F32 [H, total_q] LSE as [1, H, rows].
mha_tensor lse_view(const mha_tensor& lse, int64_t first, int64_t rows);
// Row b of per-sequence ALiBi slopes [B, H] as [H].
mha_tensor alibi_row_view(const mha_tensor& slopes, int64_t b);

}  // namespace mha::rt
