// Small pieces both kernel layouts use: carving scratch, dispatching a runtime
// count to a compile-time one, packing rows with a stride into dense rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace mha_simd {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// Hands out 64-byte aligned float arrays from one scratch block.
class ScratchCarver {
 public:
  explicit ScratchCarver(void* base) : next_(static_cast<char*>(base)) {}
  float* floats(int64_t count) {
    float* p = reinterpret_cast<float*>(next_);
    next_ += static_cast<size_t>(round_up(count * 4, 64));
    return p;
  }
  // Bytes the same sequence of requests takes (for scratch_bytes).
  static size_t bytes(std::initializer_list<int64_t> counts) {
    size_t total = 64;  // slack: the base is aligned, this is for safety
    for (int64_t c : counts) total += static_cast<size_t>(round_up(c * 4, 64));
    return total;
  }

 private:
  char* next_;
};

// Calls f(std::integral_constant<int, n>) for 1 <= n <= Max.
template <int Max, class F>
inline void with_count(int n, F&& f) {
  if constexpr (Max > 0) {
    if (n == Max) {
      f(std::integral_constant<int, Max>{});
    } else {
      with_count<Max - 1>(n, static_cast<F&&>(f));
    }
  }
}

// Copies rows of `cols` elements (element stride `col_stride`) into dense rows
// of `padded_cols`, zero-filling the padding.
inline void pack_rows(const float* src, int64_t row_stride, int64_t col_stride, int64_t rows,
                      int64_t cols, float* dst, int64_t padded_cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = src + r * row_stride;
    float* out = dst + r * padded_cols;
    if (col_stride == 1) {
      for (int64_t c = 0; c < cols; ++c) out[c] = in[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) out[c] = in[c * col_stride];
    }
    for (int64_t c = cols; c < padded_cols; ++c) out[c] = 0.0f;
  }
}

// Rows a tile will touch soon (the next query tile's Q, this tile's output),
// fetched one slice per key tile so that their cache misses overlap the
// arithmetic instead of stalling the packing or the final stores.
struct RowsToPrefetch {
  const float* first = nullptr;  // nullptr: nothing to fetch
  int64_t row_stride = 0;        // in floats
  int64_t rows = 0;
  int64_t row_floats = 0;
  bool for_write = false;

  void fetch_slice(int64_t slice, int64_t slices) const {
    if (first == nullptr || slice >= slices) return;
    const int64_t begin = rows * slice / slices, end = rows * (slice + 1) / slices;
    for (int64_t r = begin; r < end; ++r) {
      const char* row = reinterpret_cast<const char*>(first + r * row_stride);
      for (int64_t byte = 0; byte < row_floats * 4; byte += 64) {
        if (for_write) {
          __builtin_prefetch(row + byte, 1, 3);
        } else {
          __builtin_prefetch(row + byte, 0, 3);
        }
      }
    }
  }
};

}  // namespace mha_simd
