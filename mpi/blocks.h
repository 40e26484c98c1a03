// The pieces each rank computes: views of rows of its tensors, which
// (query, key) pairs the causal rule and the window leave, the valid lengths
// of one block, and the copies in and out of the communication buffers.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace mha::mpi {

// Rows [begin, begin + count) of dimension 2 of a 3-D or 4-D tensor.
mha_tensor rows_of(const mha_tensor& t, int64_t begin, int64_t count);

// A C-order 4-D descriptor of `data`.
mha_tensor dense(void* data, int32_t dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
// A C-order 3-D descriptor (LSEs).
mha_tensor dense3(float* data, int64_t d0, int64_t d1, int64_t d2);

// The diagonals of the full problem between which key j_g is visible to
// query i_g: lower <= j_g - i_g <= upper (the causal rule and the window).
struct Visibility {
  int64_t lower, upper;
};
Visibility visibility_of(const mha_attention_params& params, int64_t full_lq, int64_t full_lk);
// The visible pairs of queries [q0, q1) and keys [k0, k1) (global positions).
int64_t visible_pairs(const Visibility& vis, int64_t q0, int64_t q1, int64_t k0, int64_t k1);

// The valid lengths of one block: queries = this rank's rows [row0, row0 +
// rows) (for per-query lengths), keys = global [key0, key0 + keys).  The full
// problem's length n becomes clamp(n - key0, 0, keys).  Returns NULL when
// the call has none; the tensor points into `storage`.
const mha_tensor* block_valid_lens(const mha_tensor* full, int64_t row0, int64_t rows, int64_t key0,
                                   int64_t keys, std::vector<int64_t>* storage, mha_tensor* tensor);

// Copies a 4-D floating tensor (any strides) into C order at dst.
void pack(const mha_tensor& t, void* dst);
// Writes F32 rows `src` (4-D) into `dst` (same shape, F32/BF16/F16, strided),
// rounding once; and an F32 3-D LSE likewise (dst F32).
void write_out(const mha_tensor& src, const mha_tensor& dst);
void write_lse(const mha_tensor& src, const mha_tensor& dst);
// Adds head h's sink logit sinks[h * stride] (-inf: none) to the softmax
// denominator of every row of an F32 result and its LSE, in place: the
// merge's last step, as the runtime's split-KV merge does it.
void fold_sinks(const mha_tensor& out, const mha_tensor& lse, const float* sinks, int64_t stride);
// Fills an F32 4-D tensor with zeros and its 3-D LSE with -inf (a block
// without visible keys).
void clear_partial(const mha_tensor& out, const mha_tensor& lse);
// acc = the merge of acc and part by their LSEs (F32, same shapes), in
// place: the running result of ring attention takes one more key block.
// Row by row, m = max(l_acc, l_part): acc = (e^(l_acc-m) acc + e^(l_part-m)
// part) / s, l_acc = m + log s with s the sum of the two weights; a part
// with LSE -inf leaves the row alone.  The same operations in the same order
// every time: the result is reproducible.
void merge_into(const mha_tensor& acc, const mha_tensor& acc_lse, const mha_tensor& part,
                const mha_tensor& part_lse);

// Memory the calls on one thread keep between calls, as libmha keeps its
// scratch: each slot grows to the largest request and is reused, so
// steady-state calls neither allocate nor fault pages in.  Not initialised.
enum class Slot { kKv0, kKv1, kAcc, kAccLse, kPart, kPartLse, kCount };
// At least `bytes` of slot `slot` of the calling thread (64-byte aligned);
// throws std::bad_alloc when it cannot grow.  Valid until the next call
// that grows the same slot.
char* thread_buffer(Slot slot, int64_t bytes);

}  // namespace mha::mpi
