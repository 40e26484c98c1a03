// F32 stand-ins for a module backward call's half-precision tensors
// (f32_standins.h).
#include "f32_standins.h"

#include <algorithm>
#include <cstdint>

#include "common/dtype.h"
#include "projections.h"
#include "threads.h"
#include "validate.h"

namespace mha::rt {
namespace {

// Calls f(offset) for every element of a tensor of rank 1 to 3 (strides are
// non-negative: validated), its rows (all axes but the last) in blocks over
// `threads` threads: a module's inputs and gradients hold millions of
// elements (S1's: 3 M each), and one thread converting them cost a 2-thread
// backward 6 % of its time.
template <typename F>
void for_each_element(const mha_tensor& t, int32_t threads, F&& f) {
  int64_t shape[3] = {1, 1, 1}, strides[3] = {0, 0, 0};
  for (int32_t d = 0; d < t.ndim; ++d) {
    shape[3 - t.ndim + d] = t.shape[d];
    strides[3 - t.ndim + d] = t.strides[d];
  }
  const int64_t rows = shape[0] * shape[1];
  constexpr int64_t kBlockElements = 1 << 16;
  const int64_t block_rows = std::max<int64_t>(1, kBlockElements / std::max<int64_t>(shape[2], 1));
  const int64_t blocks = (rows + block_rows - 1) / block_rows;
  // An input may address one element from several indices (a broadcast
  // batch, stride 0): it is then converted on one thread, so that no two
  // threads write the same stand-in element.
  const int32_t team = blocks > 1 && elements_distinct(t) ? threads : 1;
  const auto no_preparation = [](int32_t /*thread*/) { return true; };
  run_team(blocks, team, no_preparation, [&](int64_t block, int32_t) {
    const int64_t end = std::min(rows, (block + 1) * block_rows);
    for (int64_t r = block * block_rows; r < end; ++r) {
      const int64_t base = (r / shape[1]) * strides[0] + (r % shape[1]) * strides[1];
      for (int64_t c = 0; c < shape[2]; ++c) f(base + c * strides[2]);
    }
  });
}

// Elements from the first to one past the last the tensor reaches.
int64_t extent_of(const mha_tensor& t) {
  int64_t extent = 1;
  for (int32_t d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return 0;
    extent += (t.shape[d] - 1) * t.strides[d];
  }
  return extent;
}

}  // namespace

F32Standins::Copy* F32Standins::find(const mha_tensor& t) {
  for (Copy& c : copies_) {
    if (same_tensor(*c.original, t)) return &c;
  }
  return nullptr;
}

F32Standins::Copy& F32Standins::add(const mha_tensor& t, mha_tensor* written) {
  Copy& c = copies_.emplace_back();
  c.original = &t;
  c.written = written;
  c.values.reset(new float[static_cast<size_t>(extent_of(t))]);
  c.f32 = t;
  c.f32.data = c.values.get();
  c.f32.dtype = MHA_DTYPE_F32;
  return c;
}

const mha_tensor* F32Standins::input(const mha_tensor* t) {
  if (t == nullptr || t->dtype == MHA_DTYPE_F32) return t;
  if (Copy* c = find(*t)) return &c->f32;
  Copy& c = add(*t, nullptr);
  for_each_element(*t, num_threads(), [&](int64_t at) {
    c.values[static_cast<size_t>(at)] = mha_types::load_float(t->data, t->dtype, at);
  });
  return &c.f32;
}

mha_tensor* F32Standins::gradient(mha_tensor* t) {
  if (t == nullptr || t->dtype == MHA_DTYPE_F32) return t;
  if (Copy* c = find(*t)) return &c->f32;
  return &add(*t, t).f32;
}

void F32Standins::round_gradients() const {
  for (const Copy& c : copies_) {
    if (c.written == nullptr) continue;
    mha_tensor& t = *c.written;
    for_each_element(t, num_threads(), [&](int64_t at) {
      mha_types::store_float(t.data, t.dtype, at, c.values[static_cast<size_t>(at)]);
    });
  }
}

}  // namespace mha::rt
