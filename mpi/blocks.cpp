#include "blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "common/dtype.h"
#include "common/visibility.h"

namespace mha::mpi {

mha_tensor rows_of(const mha_tensor& t, int64_t begin, int64_t count) {
  mha_tensor view = t;
  view.data = static_cast<char*>(t.data) + begin * t.strides[2] * mha_types::float_bytes(t.dtype);
  view.shape[2] = count;
  return view;
}

mha_tensor dense(void* data, int32_t dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  mha_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = 4;
  const int64_t shape[4] = {d0, d1, d2, d3};
  const int64_t strides[4] = {d1 * d2 * d3, d2 * d3, d3, 1};
  std::memcpy(t.shape, shape, sizeof shape);
  std::memcpy(t.strides, strides, sizeof strides);
  return t;
}

mha_tensor dense3(float* data, int64_t d0, int64_t d1, int64_t d2) {
  mha_tensor t{};
  t.data = data;
  t.dtype = MHA_DTYPE_F32;
  t.ndim = 3;
  const int64_t shape[3] = {d0, d1, d2};
  const int64_t strides[3] = {d1 * d2, d2, 1};
  std::memcpy(t.shape, shape, sizeof shape);
  std::memcpy(t.strides, strides, sizeof strides);
  return t;
}

Visibility visibility_of(const mha_attention_params& params, int64_t full_lq, int64_t full_lk) {
  return Visibility{
      mha_rules::window_lower_diagonal(params.window_left, full_lq, full_lk),
      mha_rules::upper_diagonal(params.causal, params.window_right, full_lq, full_lk)};
}

int64_t visible_pairs(const Visibility& vis, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  // Quick answers for blocks wholly inside or outside the band.
  if (k0 >= k1 || q0 >= q1) return 0;
  if (k0 - (q1 - 1) > vis.upper || (k1 - 1) - q0 < vis.lower) return 0;
  if ((k1 - 1) - q0 <= vis.upper && k0 - (q1 - 1) >= vis.lower) return (q1 - q0) * (k1 - k0);
  int64_t pairs = 0;
  for (int64_t i = q0; i < q1; ++i) {
    const int64_t first = std::max(k0, i + vis.lower), last = std::min(k1 - 1, i + vis.upper);
    if (last >= first) pairs += last - first + 1;
  }
  return pairs;
}

namespace {

int64_t valid_len_at(const mha_tensor& t, int64_t b, int64_t i) {
  const int64_t at = b * t.strides[0] + (t.ndim == 2 ? i * t.strides[1] : 0);
  return t.dtype == MHA_DTYPE_I64 ? static_cast<const int64_t*>(t.data)[at]
                                  : static_cast<const int32_t*>(t.data)[at];
}

}  // namespace

const mha_tensor* block_valid_lens(const mha_tensor* full, int64_t row0, int64_t rows, int64_t key0,
                                   int64_t keys, std::vector<int64_t>* storage,
                                   mha_tensor* tensor) {
  if (full == nullptr) return nullptr;
  const int64_t batch = full->shape[0];
  const int64_t per_row = full->ndim == 2 ? rows : 1;
  storage->resize(static_cast<size_t>(batch * per_row));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < per_row; ++i) {
      const int64_t n = valid_len_at(*full, b, row0 + i);
      (*storage)[static_cast<size_t>(b * per_row + i)] = std::clamp<int64_t>(n - key0, 0, keys);
    }
  }
  *tensor = mha_tensor{};
  tensor->data = storage->data();
  tensor->dtype = MHA_DTYPE_I64;
  tensor->ndim = full->ndim;
  tensor->shape[0] = batch;
  tensor->strides[0] = per_row;
  if (full->ndim == 2) {
    tensor->shape[1] = rows;
    tensor->strides[1] = 1;
  }
  return tensor;
}

void pack(const mha_tensor& t, void* dst) {
  const int64_t bytes = mha_types::float_bytes(t.dtype);
  const int64_t row_bytes = t.shape[3] * bytes;
  char* out = static_cast<char*>(dst);
  for (int64_t a = 0; a < t.shape[0]; ++a) {
    for (int64_t h = 0; h < t.shape[1]; ++h) {
      for (int64_t i = 0; i < t.shape[2]; ++i) {
        const char* row = static_cast<const char*>(t.data) +
                          (a * t.strides[0] + h * t.strides[1] + i * t.strides[2]) * bytes;
        if (t.strides[3] == 1) {
          std::memcpy(out, row, static_cast<size_t>(row_bytes));
        } else {
          for (int64_t c = 0; c < t.shape[3]; ++c) {
            std::memcpy(out + c * bytes, row + c * t.strides[3] * bytes,
                        static_cast<size_t>(bytes));
          }
        }
        out += row_bytes;
      }
    }
  }
}

void write_out(const mha_tensor& src, const mha_tensor& dst) {
  const bool plain = dst.dtype == MHA_DTYPE_F32 && dst.strides[3] == 1 && src.strides[3] == 1;
  for (int64_t a = 0; a < src.shape[0]; ++a) {
    for (int64_t h = 0; h < src.shape[1]; ++h) {
      for (int64_t i = 0; i < src.shape[2]; ++i) {
        const float* row = static_cast<const float*>(src.data) + a * src.strides[0] +
                           h * src.strides[1] + i * src.strides[2];
        const int64_t base = a * dst.strides[0] + h * dst.strides[1] + i * dst.strides[2];
        if (plain) {
          if (static_cast<const void*>(row) != static_cast<float*>(dst.data) + base) {
            std::memcpy(static_cast<float*>(dst.data) + base, row,
                        static_cast<size_t>(src.shape[3]) * sizeof(float));
          }
          continue;
        }
        for (int64_t c = 0; c < src.shape[3]; ++c) {
          mha_types::store_float(dst.data, dst.dtype, base + c * dst.strides[3],
                                 row[c * src.strides[3]]);
        }
      }
    }
  }
}

void write_lse(const mha_tensor& src, const mha_tensor& dst) {
  for (int64_t a = 0; a < src.shape[0]; ++a) {
    for (int64_t h = 0; h < src.shape[1]; ++h) {
      for (int64_t i = 0; i < src.shape[2]; ++i) {
        static_cast<float*>(
            dst.data)[a * dst.strides[0] + h * dst.strides[1] + i * dst.strides[2]] =
            static_cast<const float*>(
                src.data)[a * src.strides[0] + h * src.strides[1] + i * src.strides[2]];
      }
    }
  }
}

void fold_sinks(const mha_tensor& out, const mha_tensor& lse, const float* sinks, int64_t stride) {
  for (int64_t a = 0; a < out.shape[0]; ++a) {
    for (int64_t h = 0; h < out.shape[1]; ++h) {
      const float sink = sinks[h * stride];
      if (std::isinf(sink)) continue;  // -inf: no sink for this head
      for (int64_t i = 0; i < out.shape[2]; ++i) {
        float& l = static_cast<float*>(
            lse.data)[a * lse.strides[0] + h * lse.strides[1] + i * lse.strides[2]];
        const float top = std::max(l, sink);
        const float merged = top + std::log(std::exp(l - top) + std::exp(sink - top));
        const float factor = std::exp(l - merged);  // 0 for a row without keys
        float* row = static_cast<float*>(out.data) + a * out.strides[0] + h * out.strides[1] +
                     i * out.strides[2];
        for (int64_t c = 0; c < out.shape[3]; ++c) row[c * out.strides[3]] *= factor;
        l = merged;
      }
    }
  }
}

void clear_partial(const mha_tensor& out, const mha_tensor& lse) {
  for (int64_t a = 0; a < out.shape[0]; ++a) {
    for (int64_t h = 0; h < out.shape[1]; ++h) {
      for (int64_t i = 0; i < out.shape[2]; ++i) {
        float* row = static_cast<float*>(out.data) + a * out.strides[0] + h * out.strides[1] +
                     i * out.strides[2];
        for (int64_t c = 0; c < out.shape[3]; ++c) row[c * out.strides[3]] = 0.0f;
        static_cast<float*>(
            lse.data)[a * lse.strides[0] + h * lse.strides[1] + i * lse.strides[2]] =
            -std::numeric_limits<float>::infinity();
      }
    }
  }
}

void merge_into(const mha_tensor& acc, const mha_tensor& acc_lse, const mha_tensor& part,
                const mha_tensor& part_lse) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t a = 0; a < acc.shape[0]; ++a) {
    for (int64_t h = 0; h < acc.shape[1]; ++h) {
      for (int64_t i = 0; i < acc.shape[2]; ++i) {
        float& l_acc = static_cast<float*>(
            acc_lse.data)[a * acc_lse.strides[0] + h * acc_lse.strides[1] + i * acc_lse.strides[2]];
        const float l_part = static_cast<const float*>(
            part_lse
                .data)[a * part_lse.strides[0] + h * part_lse.strides[1] + i * part_lse.strides[2]];
        if (l_part == minus_inf) continue;
        float* row = static_cast<float*>(acc.data) + a * acc.strides[0] + h * acc.strides[1] +
                     i * acc.strides[2];
        const float* add = static_cast<const float*>(part.data) + a * part.strides[0] +
                           h * part.strides[1] + i * part.strides[2];
        const int64_t n = acc.shape[3], sa = acc.strides[3], sp = part.strides[3];
        if (l_acc == minus_inf) {
          for (int64_t c = 0; c < n; ++c) row[c * sa] = add[c * sp];
          l_acc = l_part;
          continue;
        }
        const float m = std::max(l_acc, l_part);
        const float w_acc = std::exp(l_acc - m), w_part = std::exp(l_part - m);
        const float sum = w_acc + w_part;
        const float f_acc = w_acc / sum, f_part = w_part / sum;
        if (sa == 1 && sp == 1) {
          for (int64_t c = 0; c < n; ++c) row[c] = f_acc * row[c] + f_part * add[c];
        } else {
          for (int64_t c = 0; c < n; ++c) row[c * sa] = f_acc * row[c * sa] + f_part * add[c * sp];
        }
        l_acc = m + std::log(sum);
      }
    }
  }
}

namespace {

struct SlotMemory {
  void* data = nullptr;
  int64_t size = 0;
  SlotMemory() = default;
  SlotMemory(const SlotMemory&) = delete;
  SlotMemory& operator=(const SlotMemory&) = delete;
  ~SlotMemory() { std::free(data); }
};

}  // namespace

char* thread_buffer(Slot slot, int64_t bytes) {
  thread_local SlotMemory slots[static_cast<int>(Slot::kCount)];
  SlotMemory& m = slots[static_cast<int>(slot)];
  if (bytes > m.size) {
    const size_t rounded = (static_cast<size_t>(bytes) + 63) / 64 * 64;
    void* grown = std::aligned_alloc(64, rounded);
    if (grown == nullptr) throw std::bad_alloc();
    std::free(m.data);
    m.data = grown;
    m.size = static_cast<int64_t>(rounded);
  }
  return static_cast<char*>(m.data);
}

}  // namespace mha::mpi
