// The module's input projections and the [B, H, L, D] views of their heads,
// shared by the forward and the backward pass.
//
// The row order of the scratch buffers follows the caller's tensors, so that
// every product is one sgemm with one row stride: a sequence-first input
// ([L, B, E] memory, strides {E, B·E, 1}) gives projections in [L, B, ·] order;
// inputs whose rows cannot be walked with one stride take one sgemm per batch.
#pragma once

#include <mha/mha.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "module.h"
#include "scratch.h"
#include "threads.h"

namespace mha::rt {

// A buffer of scratch memory, or std::bad_alloc (which the entry points turn
// into a status before any output is written).
void* take(AlignedBuffer& buffer, size_t bytes);

inline size_t float_bytes(int64_t count) {
  return static_cast<size_t>(count) * sizeof(float);
}

// The row width (whole vectors) of k columns and a column of ones beside
// them: an input whose product also adds the bias row below its weights
// (module.h).
int64_t ones_row_width(int64_t k);

// How the B x L rows of a [B, L, F] tensor are walked by sgemm calls.
struct RowOrder {
  bool seq_major = false;   // rows in (position, batch) order: a sequence-first tensor
  int64_t gemms = 1;        // 1, or B (one product per batch)
  int64_t rows = 0;         // rows per product
  int64_t row_stride = 0;   // elements between consecutive rows of one product
  int64_t gemm_stride = 0;  // elements between the products' first rows (batch stride)
};
RowOrder row_order(const mha_tensor& t);

// The [B, H, L, D] view of head columns `offset` + h·D of a buffer of rows
// `width` wide in the given order (of fp32 values, or of `dtype`'s).
void head_view(void* base, int64_t batch, int64_t heads, int64_t len, int64_t d, int64_t width,
               bool seq_major, int64_t offset, mha_tensor* view, int32_t dtype = MHA_DTYPE_F32);

// The [B, H, L, D] view of heads stored apart, each a slab of `rows` x d
// values (rows: B·L, in the given order), the first at `offset` elements:
// the module's half-precision projections (project_bf16_rounded).
void head_major_view(void* base, int64_t batch, int64_t heads, int64_t len, int64_t d,
                     bool seq_major, int64_t offset, mha_tensor* view, int32_t dtype);

// Same data, dtype, shape and strides.
bool same_tensor(const mha_tensor& a, const mha_tensor& b);

// The projections of one call: self-attention (query, key and value the same
// tensor) is one product against the stacked W_qkvᵀ [E, 3E] into rows 3E
// wide; key = value is one product against W_kvᵀ into rows 2E wide.
struct Projections {
  bool qkv_packed = false, kv_packed = false;
  RowOrder q_order, k_order, v_order;  // of the inputs, and so of the buffers
  mha_tensor q, k, v;                  // [B, H, L, D] views
  int bf16_products = 0;               // products run on AMX tiles (bf16_products.h)
  float* data = nullptr;               // fp32 projections: the buffer the views read,
  int64_t floats = 0;                  // of `floats` values
};
// `dtype` BF16 or F16 (MHA_ACTIVATIONS_INPUT, mha.h): the projections
// rounded once to it (on the tiles where they apply, else after BLIS) and
// stored head-major (head_major_view): the attention then reads each head's
// rows back to back (S1 in bf16 on AMX: [B, L, 3E] views took 1.09x the
// time of whole rows; Intel family 6 model 167).
Projections project_inputs(const ModuleCall& call, AlignedBuffer& scratch, int32_t threads,
                           int32_t dtype = MHA_DTYPE_F32);

// mha_types::narrow_row in the selected plugin's vectors where it offers
// them (mha_plugin.narrow_floats, for a unit stride): the same roundings.
class Narrower {
 public:
  Narrower();
  void row(const float* src, int64_t n, void* data, int32_t dtype, int64_t at,
           int64_t stride) const;
  // x's n values rounded in place (kept as fp32).
  void in_place(float* x, int64_t n, int32_t dtype) const;

 private:
  void (*narrow_)(const float*, int64_t, void*, int32_t) = nullptr;
};

// row(r) for rows [0, rows), in blocks of 256 rows over `team` threads.
template <class Row>
void for_each_row(int64_t rows, int32_t team, Row&& row) {
  auto no_preparation = [](int32_t /*thread*/) { return true; };
  constexpr int64_t kBlockRows = 256;
  run_team((rows + kBlockRows - 1) / kBlockRows, team, no_preparation,
           [&](int64_t block, int32_t /*thread*/) {
             const int64_t end = std::min(rows, (block + 1) * kBlockRows);
             for (int64_t r = block * kBlockRows; r < end; ++r) row(r);
           });
}

// src's rows (n values, n / d heads of d) rounded once to `dtype` (BF16 or
// F16) into dst's heads, slabs of rows x d values (head_major_view), over
// the threads.
void round_into_heads(const float* src, int64_t rows, int64_t n, int64_t d, int32_t dtype,
                      uint16_t* dst, int32_t threads);

// n fp32 values rounded once to `dtype` (BF16 or F16): into dst's elements
// (of that dtype), or, with dst == nullptr, in place (the rounded values
// kept as fp32), over the threads.
void round_values(float* src, int64_t n, int32_t dtype, void* dst, int32_t threads);

// The attention call of the module on its heads: scale 1/sqrt(D), the
// masks in mha_attention's form (`mask`, or nullptr), and the call's
// causal rule, valid lengths, dropout and variants.
mha_attention_params module_attention_params(const ModuleCall& call, const mha_tensor* mask);

}  // namespace mha::rt
