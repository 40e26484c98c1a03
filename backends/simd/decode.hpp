// The decode layout: vector lanes along the head dimension.
//
// With one (or a few) queries per head, lanes along the queries would idle
// 15 of 16 lanes.  Here the rows are the queries of all the query heads that
// share one KV head (grouped-query attention reads each K and V row once for
// all of them), and each row is a vector along D.  Scores of W keys are
// reduced together; the softmax runs along the keys.  Decoding is bound by
// reading K and V, so the kernel streams them once per item.
//
// This file composes the pieces: the row micro-kernels (row_kernels.hpp),
// the row softmax (softmax.hpp), masks and dropout (masking.hpp), the careful
// path (nonfinite.hpp) and the row epilogue (epilogue.hpp).
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/dropout.h"
#include "common/problem.h"
#include "simd/blocking.hpp"
#include "simd/convert.hpp"
#include "simd/epilogue.hpp"
#include "simd/kernel_entry.hpp"
#include "simd/masking.hpp"
#include "simd/nonfinite.hpp"
#include "simd/row_kernels.hpp"
#include "simd/score_variants.hpp"
#include "simd/softmax.hpp"
#include "simd/tile_tools.hpp"

namespace mha_simd {

template <class Arch>
class DecodeKernel {
  using B = xsimd::batch<float, Arch>;
  static constexpr int W = static_cast<int>(B::size);
  static constexpr int KT = Blocking<Arch>::kDecodeKeyTile;
  static constexpr int KTP = (KT + W - 1) / W * W;

  struct Rows {
    int64_t count;
    float* q;            // [rows][Dp], times scale·log2(e), zero-padded
    float* acc;          // [rows][Dvp]
    float* scores;       // [rows][KTP]
    float* row_max;      // [rows]
    float* row_sum;      // [rows]
    int64_t* first_key;  // [rows], absolute key index (window, item)
    int64_t* last_key;   // [rows], absolute key index
    uint32_t* row_key;   // [rows]: dropout hash of each row
    float* k_pack;       // [KT][Dp]
    float* v_pack;       // [KT][Dvp]
    float* pv_total;     // [kDecodeRows][Dvp]: rows_pv's tile sums
    uint8_t* removed;    // [KT]: keys a mask removed from the current row
    int64_t* queued;     // [rows]: the rows whose P·V runs grouped
    float* alpha;        // [rows]: their accumulators' rescaling
    // A paged cache: the tile's K and V row addresses (with kRowsAheadMax more
    // for the prefetches) and its int8 row scales, gathered.
    const void** k_table;  // [KT + kRowsAheadMax]
    const void** v_table;  // [KT + kRowsAheadMax]
    float* k_scale;        // [KT]
    float* v_scale;        // [KT]
  };
  static constexpr int kTable = KT + kRowsAheadMax;
  // A larger L2 does not call for larger token tiles: on a 2 MiB L2 (Intel
  // family 6 model 207), 64 tokens of S8's fp32 rows (512 KiB) took 0.94-0.96
  // of the time of 128 (half the L2) at 1 and 2 threads on AVX-512 (AVX2
  // alike); 16 and 32 tokens were slower than 64 (docs/kernel-design.md).
  static constexpr int64_t kTokenTileBytes = int64_t{512} << 10;
  static constexpr int kGroup = Blocking<Arch>::kDecodeRows;

  // Calls f(r0, std::integral_constant<int, n>) for groups of n <= kGroup
  // rows covering [begin, end).
  template <class F>
  static void for_row_groups(int64_t begin, int64_t end, F&& f) {
    for (int64_t r0 = begin; r0 < end; r0 += kGroup) {
      with_count<kGroup>(static_cast<int>(std::min<int64_t>(kGroup, end - r0)),
                         [&](auto n) { f(r0, n); });
    }
  }

  // Keys per tile for an item over `kv_heads` KV heads of token-major K and V:
  // the tile's whole token rows (every KV head's K and V, and int8 scales)
  // within half the L2 cache, so that the heads after the first find the
  // lines its pass brought in, and within kTokenTileBytes; at least 64 keys,
  // at most KT.  The L2 is the runtime's (mha_cache_sizes); 512 KiB when the
  // system does not say.
  static int token_tile(const mha_kernel_problem& p, int64_t kv_heads) {
    const int64_t known = mha_simd_chosen_tiles().l2_bytes;
    const int64_t l2 = known > 0 ? known : int64_t{512} << 10;
    const int64_t token = kv_heads * mha_kernel::kv_bytes_per_key(p);
    const int64_t keys = std::min(l2 / 2, kTokenTileBytes) / token / W * W;
    return static_cast<int>(std::clamp<int64_t>(keys, 64, KT));
  }

 public:
  static size_t scratch_bytes(const mha_kernel_problem& p, int64_t max_queries) {
    const int64_t rows = mha_kernel::decode_heads_per_item(p) * max_queries;
    const int64_t dp = round_up(p.d, W), dvp = round_up(p.dv, W);
    const int64_t table = p.block_table != nullptr ? 2 * kTable : 0;  // pointers as floats
    const int64_t scales = p.block_table != nullptr ? KT : 0;
    return ScratchCarver::bytes({rows * dp, rows * dvp, rows * KTP, rows, rows, 2 * rows, 2 * rows,
                                 rows, KT * dp, KT * dvp, kGroup * dvp, KT / 4 + 1, 2 * rows, rows,
                                 table, table, scales, scales});
  }

  static void run(const mha_kernel_problem& p, const mha_work_item& item, void* scratch) {
    const int64_t nq = item.q_end - item.q_begin;
    const int64_t dp = round_up(p.d, W), dvp = round_up(p.dv, W);
    Rows rows{};
    rows.count = (item.h_end - item.h_begin) * nq;
    ScratchCarver carve(scratch);
    rows.q = carve.floats(rows.count * dp);
    rows.acc = carve.floats(rows.count * dvp);
    rows.scores = carve.floats(rows.count * KTP);
    rows.row_max = carve.floats(rows.count);
    rows.row_sum = carve.floats(rows.count);
    rows.first_key = reinterpret_cast<int64_t*>(carve.floats(2 * rows.count));
    rows.last_key = reinterpret_cast<int64_t*>(carve.floats(2 * rows.count));
    rows.row_key = reinterpret_cast<uint32_t*>(carve.floats(rows.count));
    rows.k_pack = carve.floats(KT * dp);
    rows.v_pack = carve.floats(KT * dvp);
    rows.pv_total = carve.floats(kGroup * dvp);
    rows.removed = reinterpret_cast<uint8_t*>(carve.floats(KT / 4 + 1));
    rows.queued = reinterpret_cast<int64_t*>(carve.floats(2 * rows.count));
    rows.alpha = carve.floats(rows.count);
    if (p.block_table != nullptr) {
      rows.k_table = reinterpret_cast<const void**>(carve.floats(2 * kTable));
      rows.v_table = reinterpret_cast<const void**>(carve.floats(2 * kTable));
      rows.k_scale = carve.floats(KT);
      rows.v_scale = carve.floats(KT);
    }

    // Scores in base-2 units; a row that came out non-finite (a -inf logit
    // from the data, a logit past FLT_MAX / log2 e, NaN or infinite values)
    // has the item computed again in raw units (ScoreUnits).
    ScoreUnits units = ScoreUnits::base2(p.scale);
    if (!compute(p, item, rows, nq, units)) {
      units = ScoreUnits::raw_units(p.scale);
      compute(p, item, rows, nq, units);
    }
    for (int64_t r = 0; r < rows.count; ++r) {
      const int64_t row_h = r / nq, row_i = r % nq;
      write_item_row<Arch>(item, row_h, row_i, rows.acc + r * dvp, p.dv, rows.row_max[r],
                           rows.row_sum[r], mha_kernel::sink_logit(p, item.h_begin + row_h), units);
    }
  }

 private:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  static bool compute(const mha_kernel_problem& p, const mha_work_item& item, const Rows& rows,
                      int64_t nq, const ScoreUnits& units) {
    bool ok = false;
    with_dtype(p.kv_dtype, [&](auto kv) {
      constexpr int32_t kKv = decltype(kv)::value;
      ok = p.block_table != nullptr ? compute_in<kKv, true>(p, item, rows, nq, units)
                                    : compute_in<kKv, false>(p, item, rows, nq, units);
    });
    return ok;
  }

  // The addresses of the token rows (KV head 0) of keys j0 .. in a paged
  // cache (K or V: data with its strides), up to kRowsAheadMax past the tile
  // (the last key the item reads, `last`, repeated past it: entries of the
  // block table beyond it must not be read).  No division per row.
  template <class T>
  static void fill_table(const mha_kernel_problem& p, const void* data, const int64_t* strides,
                         int64_t b, int64_t j0, int64_t last, const void** table) {
    const T* base = static_cast<const T*>(data);
    const T** row = reinterpret_cast<const T**>(table);
    const int32_t* blocks = p.block_table + b * p.block_table_stride;
    int64_t n = j0 / p.block_size, r = j0 % p.block_size;
    const T* block = base + blocks[n] * strides[0];
    const int64_t end = std::min<int64_t>(j0 + kTable, last + 1);
    for (int64_t j = j0; j < end; ++j) {
      row[j - j0] = block + r * strides[2];
      if (++r == p.block_size && j + 1 < end) {
        r = 0;
        block = base + blocks[++n] * strides[0];
      }
    }
    for (int64_t j = end; j < j0 + kTable; ++j) row[j - j0] = row[end - 1 - j0];
  }

  // The rows of keys j0 .. of (b, kvh) in `data` (K or V, with its strides):
  // evenly spaced, or in a paged cache through the tile's table (fill_table).
  template <class Rows, class T>
  static Rows kv_rows(const mha_kernel_problem& p, const void* data, const int64_t* strides,
                      int64_t b, int64_t kvh, int64_t j0, const void** table) {
    if constexpr (std::is_same_v<Rows, StridedRows<T>>) {
      return {static_cast<const T*>(data) + mha_kernel::kv_offset(p, strides, b, kvh, j0),
              strides[2]};
    } else {
      return {reinterpret_cast<const T* const*>(table), kvh * strides[1]};
    }
  }

  // Reads the token rows of keys j0 .. j0 + keys -- KV heads kvh0 .. kvh0 +
  // kv_heads of K and of V -- in address order, a 4-byte load in every
  // cache line, before the passes over them.  The passes read one KV head's
  // slice of each token row at a time (512 bytes every 4 KiB for S8), which
  // the hardware prefetchers do not follow, and each software prefetch holds
  // a miss buffer until its line arrives; whole rows in address order they
  // follow, and the passes then find the rows in L2.  Zen 5 (family 26 model
  // 2), in-process A/B: S8 0.85 of the time at one thread and at two, a
  // token-major GQA batch from DRAM 0.73-0.77, AVX2 S8 0.72.  Prefetches in place of
  // the loads: 0.98-1.00; every other line: 1.7x the time.  Only for K and V
  // that come from memory (kv_streamed): from the L3 the same loads cost
  // 1.03-1.29x; and not int8 rows (see run).  See docs/kernel-design.md.
  template <class T, bool kPaged>
  static void read_token_rows(const mha_kernel_problem& p, const Rows& rows, int64_t b,
                              int64_t kvh0, int64_t kv_heads, int64_t j0, int keys) {
    // The bytes from KV head kvh0's first element to the last KV head's last.
    const auto span_of = [&](const int64_t* strides, int64_t cols) {
      return ((kv_heads - 1) * strides[1] + (cols - 1) * strides[3] + 1) * int64_t{sizeof(T)};
    };
    const int64_t k_span = span_of(p.k_strides, p.d), v_span = span_of(p.v_strides, p.dv);
    uint32_t seen[4] = {0, 0, 0, 0};
    const auto touch = [&](const char* at, int n) {
      uint32_t word = 0;
      std::memcpy(&word, at, sizeof word);
      seen[n] |= word;
    };
    const auto touch_row = [&](const char* row, int64_t span) {
      int64_t at = 0;
      for (; at + 3 * 64 + 4 <= span; at += 4 * 64) {
        for (int n = 0; n < 4; ++n) touch(row + at + n * 64, n);
      }
      for (; at + 4 <= span; at += 64) touch(row + at, 0);
    };
    // Where a paged cache's blocks hold 64 KiB of these rows or less, key
    // j's K row and V row are read in step, a line of each in turn: the
    // hardware prefetchers start again at every block, and two streams keep
    // more lines in flight meanwhile.  Zen 5 (family 26 model 2), in-process
    // A/B against K's rows then V's, loops aligned: S8 (blocks of 16, 64 KiB)
    // 0.955 and 0.959 of the time at one thread, 0.981 at two; blocks of 64
    // 1.010, of 256 1.035, a dense token-major cache 1.084: long runs read
    // faster one at a time.
    const int64_t block_bytes = p.block_size * p.k_strides[2] * int64_t{sizeof(T)};
    const bool in_step = kPaged && block_bytes <= (int64_t{64} << 10);
    const auto row_of = [&](const void* data, const int64_t* strides, const void** table, int j) {
      const T* first = nullptr;
      if constexpr (kPaged) {
        first = reinterpret_cast<const T* const*>(table)[j] + kvh0 * strides[1];
      } else {
        first = static_cast<const T*>(data) + mha_kernel::kv_offset(p, strides, b, kvh0, j0 + j);
      }
      return reinterpret_cast<const char*>(first);
    };
    if (in_step) {
      // Keys j and j + half (another block) in step as well: four streams,
      // two lines of each a step.  Zen 5, a stand-alone loop over S8's
      // blocks: 36.2-37.1 GB/s against 35.3-36.0 a line a step and 32.9-34.8
      // with two streams; 27.8 with all eight of a tile's, 33-34 with six.
      const int64_t both = std::min(k_span, v_span);
      const int half = static_cast<int>(std::min<int64_t>(
          keys, ((keys + 1) / 2 + p.block_size - 1) / p.block_size * p.block_size));
      for (int j = 0; j < half; ++j) {
        const char* k = row_of(p.k, p.k_strides, rows.k_table, j);
        const char* v = row_of(p.v, p.v_strides, rows.v_table, j);
        int64_t at = 0;
        if (j + half < keys) {
          const char* k2 = row_of(p.k, p.k_strides, rows.k_table, j + half);
          const char* v2 = row_of(p.v, p.v_strides, rows.v_table, j + half);
          for (; at + 64 + 4 <= both; at += 2 * 64) {
            touch(k + at, 0);
            touch(v + at, 1);
            touch(k2 + at, 2);
            touch(v2 + at, 3);
            touch(k + at + 64, 0);
            touch(v + at + 64, 1);
            touch(k2 + at + 64, 2);
            touch(v2 + at + 64, 3);
          }
          touch_row(k2 + at, k_span - at);
          touch_row(v2 + at, v_span - at);
        } else {
          for (; at + 64 + 4 <= both; at += 2 * 64) {
            touch(k + at, 0);
            touch(v + at, 1);
            touch(k + at + 64, 2);
            touch(v + at + 64, 3);
          }
        }
        touch_row(k + at, k_span - at);
        touch_row(v + at, v_span - at);
      }
    } else {
      for (int j = 0; j < keys; ++j) touch_row(row_of(p.k, p.k_strides, rows.k_table, j), k_span);
      for (int j = 0; j < keys; ++j) touch_row(row_of(p.v, p.v_strides, rows.v_table, j), v_span);
    }
    // Kept, so that the loads are.
    volatile uint32_t sink = seen[0] | seen[1] | seen[2] | seen[3];
    static_cast<void>(sink);
  }

  // The int8 scales of keys j0 .. j0 + keys of (b, kvh) in a paged cache,
  // into dst[0, keys).
  static void gather_scales(const mha_kernel_problem& p, const float* scales,
                            const int64_t* strides, int64_t b, int64_t kvh, int64_t j0, int keys,
                            float* dst) {
    mha_kernel::for_each_kv_run(p, j0, keys, [&](int64_t t, int64_t n) {
      const float* src = scales + mha_kernel::kv_offset(p, strides, b, kvh, j0 + t);
      for (int64_t x = 0; x < n; ++x) dst[t + x] = src[x * strides[2]];
    });
  }

  // One pass over the item's keys; returns false when a row needs the raw
  // pass: its accumulator is not finite, or it has visible keys but no weight.
  // K and V of dtype kKv are read in place and widened in registers (int8:
  // the key's scale folded into its score, the value's into its weight), or
  // widened into packed fp32 tiles when their rows are strided.  In a paged
  // cache (kPaged) the tile's rows are found through a table of their
  // addresses, its int8 scales gathered.  The raw units (units.raw) are
  // decided per row and tile, at the softmax: as a template parameter they
  // doubled the kernel's instances (a fifth of each plugin's code, nearly a
  // third of its compile time) for one branch a row and tile.
  template <int32_t kKv, bool kPaged>
  static bool compute_in(const mha_kernel_problem& p, const mha_work_item& item, const Rows& rows,
                         int64_t nq, const ScoreUnits& units) {
    using T = element_t<kKv>;
    constexpr bool kInt8 = kKv == MHA_DTYPE_I8;
    const int64_t dp = round_up(p.d, W), dvp = round_up(p.dv, W);
    const int64_t b = item.b;
    const float c = units.q_factor;
    int64_t max_last = item.k_begin - 1, min_first = item.k_end;
    for (int64_t r = 0; r < rows.count; ++r) {
      const int64_t h = item.h_begin + r / nq, i = item.q_begin + r % nq;
      const int64_t last = std::min(mha_kernel::last_visible_key(p, b, i), item.k_end - 1);
      const int64_t first = std::max(mha_kernel::first_visible_key(p, i), item.k_begin);
      if (first <= last) {
        max_last = std::max(max_last, last);
        min_first = std::min(min_first, first);
      }
      rows.first_key[r] = first;
      rows.last_key[r] = last;
      rows.row_key[r] = mha_kernel::dropout_row_key(p, b, h, i);
      const int64_t q_at = b * p.q_strides[0] + h * p.q_strides[1] + i * p.q_strides[2];
      float* dst = rows.q + r * dp;  // widened, then scaled in vectors (once per item)
      mha_kernel::widen_row(p.q, p.q_dtype, q_at, p.q_strides[3], p.d, 1.0f, dst);
      for (int64_t x = p.d; x < dp; ++x) dst[x] = 0.0f;
      for (int64_t x = 0; x < dp; x += W) (B::load_aligned(dst + x) * B(c)).store_aligned(dst + x);
      rows.row_max[r] = kNegInf;
      rows.row_sum[r] = 0.0f;
    }
    std::fill(rows.acc, rows.acc + rows.count * dvp, 0.0f);

    const bool k_direct = p.k_strides[3] == 1 && p.d % W == 0;
    const bool v_direct = p.v_strides[3] == 1 && p.dv % W == 0;
    using Rows = std::conditional_t<kPaged, TableRows<T>, StridedRows<T>>;
    // The item's rows come in segments, one per KV head (usually one); with
    // several, each key tile is read KV head after KV head (token_tile).
    const int64_t segment_rows = (p.heads / p.kv_heads) * nq;
    const int64_t segments = rows.count / segment_rows;
    const int64_t kvh0 = mha_kernel::kv_head_of(p, item.h_begin);
    const int kt = segments > 1 ? token_tile(p, segments) : KT;
    // Each tile's token rows read whole before its passes (read_token_rows):
    // fp32 and half-precision rows.  (Zen 5, in-process A/B, both orders:
    // S8's cache in bf16 0.811 and 1/1.227 of the time at one thread, 0.862
    // at two; in f16 0.838 and 1/1.177.  Int8 rows, whose widening costs
    // more than memory gives them, 1.146: they are read in place.)
    const bool rows_read = kKv != MHA_DTYPE_I8 && segments > 1 && p.kv_streamed != 0;
    // The prefetch distance of the rows read in place (row_kernels.hpp; 0:
    // none).  Where the token rows were read first, P·V requests nothing:
    // S8 0.962-0.971 of the time at one thread and 0.961-0.977 at two, a
    // dense token-major GQA batch from DRAM 0.981, AVX2 S8 0.974 (Zen 5,
    // in-process A/B).  The scores' requests stay: without them S8 took 0.99
    // of the time at one thread but 1.03 at two.  They reach kRowsAheadFromL2
    // (2) rows ahead, not 4 KiB of rows.  Zen 5, against 8 rows (loops
    // aligned): S8 0.981 at one thread (0.978 reversed), 0.999 at two; 4 rows
    // 0.985 / 0.994; 1 row 0.991 / 1.018 against 2; a dense token-major GQA
    // batch from DRAM 0.986; AVX2 S8 1.001.  P·V's rows requested 2 ahead
    // into L1 as well: 1.037 / 1.030.
    //
    // One or two rows per KV head (MHA decode, two queries or two query
    // heads per KV head) read their rows as key streams (row_kernels.hpp)
    // where the ISA has them and the runtime asks for them on this CPU
    // (runtime/decode_streams.cpp: Zen 3 gains, Zen 5 loses).  P·V's sums
    // then run in the streams' order, so whether they do depends only on the
    // problem and the process's CPU (not on the layout, the items or the
    // cache's size): a paged call gives the dense call's bits.
    // Not for int8 rows, nor for more rows per KV head, where the streams
    // lost (Zen 3, in-process A/B: S3:i8kv 1.05x the time, head-major GQA
    // decode of four rows 1.7x; docs/kernel-design.md).  The streams go
    // without software prefetch -- for two rows only where K and V outgrow
    // the L3 (in it, two rows without requests took 1.05-1.28x the time).
    const bool streamed = Blocking<Arch>::kDecodeKeyStreams > 1 &&
                          mha_simd_chosen_tiles().decode_key_streams > 1 && segment_rows <= 2 &&
                          streams_for<kKv, 2>();
    const bool stream_in_place =
        streamed && !rows_read && (segment_rows == 1 || p.kv_streamed != 0);
    const int k_ahead = rows_read         ? kRowsAheadFromL2
                        : stream_in_place ? 0
                                          : rows_ahead(dp * static_cast<int64_t>(sizeof(T)));
    const int v_ahead =
        rows_read || stream_in_place ? 0 : rows_ahead(dvp * static_cast<int64_t>(sizeof(T)));
    // Where P·V's requests go: into L1 for one KV head's rows back to back,
    // into L2 for token-major rows (Zen 5, in-process A/B, both builds with
    // loops aligned: S8 in bf16 took 1.058 of the time with L1, a dense
    // token-major GQA decode 0.99; with the scores' requests into L1 as well,
    // head-major decode against both into L2 in docs/kernel-design.md).
    const bool v_into_l1 = segments == 1;
    for (int64_t j0 = min_first; j0 <= max_last; j0 += kt) {
      const int keys = static_cast<int>(std::min<int64_t>(kt, max_last + 1 - j0));
      if constexpr (kPaged) {
        fill_table<T>(p, p.k, p.k_strides, b, j0, max_last, rows.k_table);
        fill_table<T>(p, p.v, p.v_strides, b, j0, max_last, rows.v_table);
      }
      if (rows_read) read_token_rows<T, kPaged>(p, rows, b, kvh0, segments, j0, keys);
      for (int64_t segment = 0; segment < segments; ++segment) {
        const int64_t kvh = kvh0 + segment;
        const int64_t r_begin = segment * segment_rows, r_end = r_begin + segment_rows;
        const Rows k_typed = kv_rows<Rows, T>(p, p.k, p.k_strides, b, kvh, j0, rows.k_table);
        const Rows v_typed = kv_rows<Rows, T>(p, p.v, p.v_strides, b, kvh, j0, rows.v_table);
        const float* k_scale = nullptr;
        const float* v_scale = nullptr;
        int64_t ks = p.k_scale_strides[2], vs = p.v_scale_strides[2];
        if constexpr (kInt8 && kPaged) {
          gather_scales(p, p.k_scale, p.k_scale_strides, b, kvh, j0, keys, rows.k_scale);
          gather_scales(p, p.v_scale, p.v_scale_strides, b, kvh, j0, keys, rows.v_scale);
          k_scale = rows.k_scale;
          v_scale = rows.v_scale;
          ks = vs = 1;
        } else if constexpr (kInt8) {
          k_scale = mha_kernel::k_scales(p, b, kvh, j0);
          v_scale = mha_kernel::v_scales(p, b, kvh, j0);
        }
        // Rows of K or V widened into a packed fp32 tile (run by run in a
        // paged cache; a run's rows are evenly spaced).
        const auto widen = [&](const void* data, const int64_t* strides, int64_t cols,
                               const float* scales, int64_t scale_stride, float* dst,
                               int64_t padded) {
          mha_kernel::for_each_kv_run(p, j0, keys, [&](int64_t t, int64_t n) {
            widen_rows<Arch, kKv>(
                static_cast<const T*>(data) + mha_kernel::kv_offset(p, strides, b, kvh, j0 + t),
                strides[2], strides[3], n, cols,
                scales != nullptr ? scales + t * scale_stride : nullptr, scale_stride,
                dst + t * padded, padded);
          });
        };
        if (!k_direct) widen(p.k, p.k_strides, p.d, k_scale, ks, rows.k_pack, dp);
        const float* v_rows = nullptr;  // fp32 rows, once V is packed
        int64_t v_stride = dvp;
        if (!v_direct) {
          widen(p.v, p.v_strides, p.dv, v_scale, vs, rows.v_pack, dvp);
          v_rows = rows.v_pack;
        } else if constexpr (kKv == MHA_DTYPE_F32 && !kPaged) {
          v_rows = v_typed.first;
          v_stride = p.v_strides[2];
        }
        // The pass's first rows, which no earlier prefetch requested (the
        // row kernels prefetch `ahead` rows ahead within a pass, and past
        // its end the same KV head's next rows): token-major GQA decode
        // (16 x 4096 keys, in-process A/B) took 0.93 of the time at 1 thread,
        // 0.91 at 2.  Spreading them over the previous pass's last rows
        // instead, in place of its prefetches past the tile, took 1.3x: those
        // start the next tile's token rows, every KV head's slice of which the
        // hardware prefetcher then brings in.
        // Only token-major items (several KV heads): S3's whole rows of one KV
        // head stream without it (there it measured 1.03x).
        const bool prefetch_pass = segments > 1;
        if (prefetch_pass && k_direct) prefetch_rows(k_typed, std::min(keys, k_ahead), dp);
        // 1. Every row's scores, each K vector loaded once for a group of rows.
        for_row_groups(r_begin, r_end, [&](int64_t r0, auto n) {
          constexpr int N = decltype(n)::value;
          if (k_direct) {
            rows_scores<Arch, kKv, N>(rows.q + r0 * dp, dp, k_typed, keys, rows.scores + r0 * KTP,
                                      KTP, k_ahead, rows_read, stream_in_place);
          } else {
            rows_scores<Arch, MHA_DTYPE_F32, N>(rows.q + r0 * dp, dp,
                                                StridedRows<float>{rows.k_pack, dp}, keys,
                                                rows.scores + r0 * KTP, KTP, k_ahead);
          }
        });
        if constexpr (kInt8) {
          if (k_direct) {
            for (int64_t r = r_begin; r < r_end; ++r) {
              float* s = rows.scores + r * KTP;
              for (int j = 0; j < keys; ++j) s[j] *= k_scale[j * ks];
            }
          }
        }
        // 2. Row by row: the variants, masks, the softmax and dropout.  A row
        // whose removed keys could pass on a non-finite V takes the guarded
        // P·V at once; the others are queued for step 3.
        int v_finite = -1;  // not checked yet
        int64_t queued = 0;
        for (int64_t r = r_begin; r < r_end; ++r) {
          const int64_t h = item.h_begin + r / nq, i = item.q_begin + r % nq;
          float* s = rows.scores + r * KTP;
          if (mha_kernel::has_score_variants(p)) {
            apply_score_variants_row<Arch>(p, s, b, h, i, j0, keys, units);
          }
          if (p.mask_kind != MHA_MASK_NONE) apply_mask_row(p, b, h, i, j0, keys, s, units);
          const int64_t hidden_from = rows.last_key[r] + 1 - j0;
          const int64_t hidden_below = rows.first_key[r] - j0;  // the window's start
          for (int64_t j = std::max<int64_t>(hidden_from, 0); j < keys; ++j) s[j] = kNegInf;
          for (int64_t j = 0; j < std::min<int64_t>(hidden_below, keys); ++j) s[j] = kNegInf;
          // A key a mask or a -inf logit removed must not pass on a NaN or
          // infinity of its V row through 0 · V: rows with removed keys check
          // the tile once (the guarded P·V then reads fp32 rows: V in place is
          // widened into the packed tile first).
          const bool masked = p.mask_kind != MHA_MASK_NONE || hidden_from < keys ||
                              hidden_below > 0 || has_minus_inf<Arch>(s, keys);
          if (masked && v_finite < 0) {
            if (v_rows != nullptr) {
              v_finite = rows_finite<Arch>(v_rows, v_stride, keys, dvp) ? 1 : 0;
            } else {
              v_finite = 1;
              mha_kernel::for_each_kv_run(p, j0, keys, [&](int64_t t, int64_t n) {
                const bool finite = typed_rows_finite<Arch, kKv>(
                    v_typed(t), p.v_strides[2], static_cast<int>(n), dvp,
                    v_scale != nullptr ? v_scale + t * vs : nullptr, vs);
                if (!finite) v_finite = 0;
              });
              if (v_finite == 0) {
                widen(p.v, p.v_strides, p.dv, v_scale, vs, rows.v_pack, dvp);
                v_rows = rows.v_pack;
                v_stride = dvp;
              }
            }
          }
          const bool skip_removed = masked && v_finite == 0;
          if (skip_removed) {
            for (int j = 0; j < keys; ++j) rows.removed[j] = s[j] == kNegInf;
          }
          const float alpha = units.raw ? update_softmax_row<Arch, KTP, true>(
                                              s, keys, rows.row_max[r], rows.row_sum[r], units)
                                        : update_softmax_row<Arch, KTP, false>(
                                              s, keys, rows.row_max[r], rows.row_sum[r], units);
          if (p.dropout_p > 0.0f) {
            apply_dropout_row<Arch>(p.dropout_p, rows.row_key[r], j0, keys, s);
          }
          if (skip_removed) {  // v_rows is the packed fp32 tile here
            pv_guarded_row(s, rows.removed, 1, keys, alpha, v_rows, v_stride, dvp,
                           rows.acc + r * dvp);
          } else {
            rows.queued[queued] = r;
            rows.alpha[queued++] = alpha;
          }
        }
        if (prefetch_pass && v_direct) prefetch_rows(v_typed, std::min(keys, v_ahead), dvp);
        // 3. P·V of the queued rows, each V vector loaded once for a group.
        if constexpr (kInt8) {
          if (v_rows == nullptr) {  // V read in place: its scales go into the weights
            for (int64_t n = 0; n < queued; ++n) {
              float* s = rows.scores + rows.queued[n] * KTP;
              for (int j = 0; j < keys; ++j) s[j] *= v_scale[j * vs];  // after the row's sum
            }
          }
        }
        for_row_groups(0, queued, [&](int64_t g0, auto n) {
          constexpr int N = decltype(n)::value;
          const float* probs[N];
          float* acc[N];
          for (int g = 0; g < N; ++g) {
            probs[g] = rows.scores + rows.queued[g0 + g] * KTP;
            acc[g] = rows.acc + rows.queued[g0 + g] * dvp;
          }
          if (v_rows != nullptr) {
            rows_pv<Arch, MHA_DTYPE_F32, N>(probs, rows.alpha + g0,
                                            StridedRows<float>{v_rows, v_stride}, keys, dvp, acc,
                                            rows.pv_total, v_ahead, v_into_l1, streamed);
          } else {
            rows_pv<Arch, kKv, N>(probs, rows.alpha + g0, v_typed, keys, dvp, acc, rows.pv_total,
                                  v_ahead, v_into_l1, streamed);
          }
        });
      }
    }
    // A row with visible keys but no weight: a mask removed every key, or its
    // logits overflowed to -inf in base-2 units (the raw pass finds it).
    for (int64_t r = 0; r < rows.count; ++r) {
      if (rows.row_sum[r] == 0.0f && rows.last_key[r] >= rows.first_key[r]) return false;
    }
    return all_finite<Arch>(rows.acc, rows.count * dvp);
  }
};

}  // namespace mha_simd
