// Packed [total, heads, d] tensors and the attention variants (softcap,
// sinks, ALiBi) as the packed-batch and paged-cache cases draw them
// (case_varlen.cpp, case_paged.cpp).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <cstdint>
#include <vector>

#include "test_util.h"

namespace mha_fuzz {

// A packed [total, heads, d] tensor's strides: token-major or head-major,
// each run of d followed by `pad` unused elements; `zero_heads` broadcasts
// the head axis (inputs only).
struct PackedLayout {
  int64_t shape[3] = {1, 1, 1};
  int64_t strides[3] = {1, 1, 1};
  int64_t extent = 1;
};

PackedLayout packed_layout(int64_t total, int64_t heads, int64_t d, bool head_major, int64_t pad,
                           bool zero_heads);

mha_tensor describe3(void* data, mha_dtype dtype, const PackedLayout& l);

// Rows [first, first + len) of a packed [total, heads, d] tensor (any
// strides, any dtype) as the [1, heads, len, d] tensor of a call on that
// sequence alone.
mha_tensor sequence_of(const mha_tensor& t, int64_t first, int64_t len);

// A packed batch's offsets from its sequences' lengths: every length of a
// kind 0 becomes 1 for the first sequence (the packed tensors need a row);
// B + 3 entries each, the last ones 0 (slack: a broken B must not make a
// refusing runtime read outside them); the totals.  Notes the shapes and
// lengths.
struct PackedOffsets {
  std::vector<int32_t> cu_q, cu_k;
  int64_t total_q = 0, total_k = 0;
};
PackedOffsets packed_offsets(int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                             std::vector<int64_t>& lens_q, std::vector<int64_t>& lens_k);

// The attention variants a case draws -- softcap, per-head sinks, ALiBi
// slopes per head or per sequence -- with the arrays params points to (so
// they must outlive the call).  Every case draws them from the same bytes in
// the same order.
struct DrawnVariants {
  std::vector<float> sink_values, slopes;
  mha_tensor sinks{}, alibi{};
  bool alibi_per_sequence = false;
};

// Draws the variants into params and `drawn`; slopes has room for
// slope_rows rows of H.
void draw_variants(FuzzedDataProvider& fdp, mha_test::Rng& rng, int64_t B, int64_t H,
                   int64_t slope_rows, mha_attention_params& params, DrawnVariants& drawn);

}  // namespace mha_fuzz
