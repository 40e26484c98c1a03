// Small pieces both kernel layouts use: carving scratch, dispatching a runtime
// count to a compile-time one, packing rows with a stride into dense rows.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace mha_simd {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The units a kernel keeps its scores in.
//
// Fast: base 2.  Q is packed times scale·log2(e), so each score is a logit in
// base-2 units and the softmax's exponential is a bare exp2 of its distance
// to the row maximum.  A logit within the fp32 range can overflow there (one
// above FLT_MAX / log2(e) ~ 2.4e38), and the row then comes out non-finite.
//
// Raw: a tile whose output came out non-finite is computed again with Q
// times the scale's sign and min(|scale|, 1), so a score is the logit divided
// by r = max(|scale|, 1); r is applied to the distances to the row maximum,
// which are never larger than the logits, and an additive mask, a softcap or
// an ALiBi slope joins divided by r.  Neither the dot product nor a value
// divided by r (r >= 1) overflows where its logit does not: logits up to
// FLT_MAX give finite results on every backend, a mask of -FLT_MAX
// (Hugging Face's padding) on every key included.  (Q times the sign alone,
// with mask / |scale|, overflowed such masks to -inf when |scale| < 1.)
struct ScoreUnits {
  bool raw;
  float q_factor;  // Q is packed times this
  float to_logit;  // raw units: a score times this is its logit (r)

  static ScoreUnits base2(float scale) { return {false, scale * 1.4426950408889634f, 0.0f}; }
  static ScoreUnits raw_units(float scale) {
    const float magnitude = std::fabs(scale);
    return {true, std::copysign(std::fmin(magnitude, 1.0f), scale), std::fmax(magnitude, 1.0f)};
  }
  // An additive mask value in these units.
  float mask(float m) const { return raw ? m / to_logit : m * 1.4426950408889634f; }
  // The exponent, in base 2, of a score's distance d (<= 0) to the row maximum.
  float exponent(float d) const { return raw ? (d * to_logit) * 1.4426950408889634f : d; }
  // A score (a row maximum) as a logit: the inverse of mask().
  float natural(float s) const { return raw ? s * to_logit : s * 0.6931471805599453f; }
};

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

// Requests every cache line of a row of `elements` elements from memory:
// kLocality 3 (prefetcht0) into L1, 2 (prefetcht1) into L2 (the decode's
// token-major V rows: rows_pv's into_l1).
template <int kLocality = 2, class T>
inline void prefetch_row(const T* row, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < elements * static_cast<int64_t>(sizeof(T)); byte += 64) {
    __builtin_prefetch(p + byte, 0, kLocality);
  }
}

// Copies rows of `cols` elements (element stride `col_stride`) into dense rows
// of `padded_cols`, zero-filling the padding.  Rows apart (a [B, L, H, D]
// view, the module's projections) come from L3 or memory, a few lines each
// at a stride the hardware prefetchers do not follow: each row of unit
// column stride requests the one kPackAhead rows on (Zen 5, in-process A/B,
// 9 and 15 rounds: S9 0.990 and 0.988 of the time, S1 as [B, L, H, D] views
// 0.992 and 1.003; 16 rows on: 0.995, 0.996).
inline void pack_rows(const float* src, int64_t row_stride, int64_t col_stride, int64_t rows,
                      int64_t cols, float* dst, int64_t padded_cols) {
  constexpr int64_t kPackAhead = 8;
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = src + r * row_stride;
    float* out = dst + r * padded_cols;
    if (col_stride == 1) {
      if (r + kPackAhead < rows) prefetch_row<3>(in + kPackAhead * row_stride, cols);
      for (int64_t c = 0; c < cols; ++c) out[c] = in[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) out[c] = in[c * col_stride];
    }
    for (int64_t c = cols; c < padded_cols; ++c) out[c] = 0.0f;
  }
}

// Rows a query tile will touch soon -- the next tile's Q (or the next head's
// Q, K and V), this tile's output -- fetched a few cache lines at a time
// between micro-kernel calls, so that their misses overlap the arithmetic
// instead of stalling the packing or the final stores, and never queue up in
// a burst that would hold back the micro-kernels' own loads.
class PrefetchQueue {
 public:
  // `rows` rows of `row_elements` elements of `element_bytes` each, rows
  // `row_stride` elements apart.
  void add(const void* first, int64_t row_stride, int64_t rows, int64_t row_elements,
           int64_t element_bytes, bool for_write) {
    if (first == nullptr || rows <= 0 || row_elements <= 0 || count_ == kMaxRanges) return;
    const int64_t lines_per_row = (row_elements * element_bytes + 63) / 64;
    ranges_[count_++] = {static_cast<const char*>(first), row_stride * element_bytes, rows,
                         lines_per_row, for_write};
    lines_left_ += rows * lines_per_row;
    back_to_back_ = back_to_back_ && (for_write || row_stride == row_elements);
  }

  // Spreads what was added over about `steps` calls of step(), at most
  // kMaxLinesPerStep a call: more at once stalls the micro-kernel's own loads
  // behind the prefetches (S4, whose short tiles have few steps for a whole
  // head's rows, 4 % faster with the bound; S1, S2, S9 unchanged).  What
  // does not fit is left to the hardware.
  //
  // A query tile with a single key tile (`short_tile`) that cannot cover its
  // lines, when the rows it reads lie back to back, requests only the first
  // range's (the next Q tile, or the next head's Q), if those fit: the
  // hardware prefetchers follow the rest, and lines requested into the L1
  // early evict the tile's own working set, which fills it.  Zen 5 (family
  // 26 model 2), in-process A/B, loops aligned, none against all within the
  // bound: S4 0.979 and 0.979 (builds swapped) at one thread, 0.958 at two,
  // AVX2 S4 0.974; S1 0.998, S5 0.998, S9 0.997.  Then Q alone against none
  // (Zen 3, family 25 model 1, AVX2, where `perf` put 10 % of S4 in Q's
  // packing, waiting on its rows; 5 % after): S4 0.972 and 1/1.037 (41
  // rounds), 0.980, 0.965, 1/1.028 and 1/0.984 (21 rounds), 0.985 and
  // 1/1.030 at two threads; S9 1.016 and 1/1.014.  On Zen 5 again (11
  // rounds): S4 1.017 and 1/0.992 against none, within that A/B's 1-2 %
  // order effect; the Q lines into L2 instead, 1.011 and 1/0.976 against
  // L1.  Giving up on every tile
  // the queue cannot cover cost S2 1.012 and S9 1.009 (their first query
  // tiles lose the next tile's Q).  Lines for writing come last and are not
  // reached anyway: they do not count.
  void pace(int64_t steps, bool short_tile = false) {
    per_step_ = steps > 0 ? (lines_left_ + steps - 1) / steps : 0;
    if (per_step_ <= kMaxLinesPerStep) return;
    per_step_ = kMaxLinesPerStep;
    if (short_tile && back_to_back_) {
      const int64_t first_lines = ranges_[0].rows * ranges_[0].lines_per_row;
      per_step_ = (first_lines + steps - 1) / steps;  // steps > 0: lines_left_ did not fit
      if (per_step_ > kMaxLinesPerStep) per_step_ = 0;
      lines_left_ = per_step_ > 0 ? first_lines : 0;
    }
  }

  // A fixed number of lines a step (into the L2: into_l2), for a queue
  // stepped over a span whose steps are not counted ahead: the thread's next
  // item, spread over this whole item (then()).
  void pace_fixed(int64_t lines_per_step, bool into_l2) {
    per_step_ = lines_per_step;
    into_l2_ = into_l2;
  }

  // `after` is stepped too on each step() of this queue.
  void then(PrefetchQueue* after) { after_ = after; }

  void step() {
    if (after_ != nullptr) after_->step();
    for (int64_t n = 0; n < per_step_ && lines_left_ > 0; ++n) {
      const Range& r = ranges_[range_];
      const char* line = r.first + row_ * r.row_bytes + line_ * 64;
      if (r.for_write) {
        __builtin_prefetch(line, 1, 3);
      } else if (into_l2_) {
        __builtin_prefetch(line, 0, 1);
      } else {
        __builtin_prefetch(line, 0, 3);
      }
      --lines_left_;
      if (++line_ < r.lines_per_row) continue;
      line_ = 0;
      if (++row_ < r.rows) continue;
      row_ = 0;
      ++range_;
    }
  }

 private:
  struct Range {
    const char* first;
    int64_t row_bytes;
    int64_t rows;
    int64_t lines_per_row;
    bool for_write;
  };
  static constexpr int kMaxRanges = 4;
  static constexpr int64_t kMaxLinesPerStep = 4;
  Range ranges_[kMaxRanges] = {};
  int count_ = 0;
  int range_ = 0;
  int64_t row_ = 0, line_ = 0;
  int64_t lines_left_ = 0, per_step_ = 0;
  bool back_to_back_ = true;  // the rows of every range read
  bool into_l2_ = false;
  PrefetchQueue* after_ = nullptr;
};

}  // namespace mha_simd
