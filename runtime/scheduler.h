// Splitting a validated call into work items and running them over threads.
#pragma once

#include <mha/mha.h>
#include <mha/plugin_abi.h>

#include <cstdint>

#include "registry.h"
#include "validate.h"

namespace mha::rt {

// How a call is cut into work items.  A function of the shape and the backend
// only — never of the thread count — so results are the same bits on any
// number of threads.
struct WorkPlan {
  int32_t layout;  // mha_kernel_layout
  int64_t batch;
  int64_t heads_per_item;  // the query heads sharing a KV head (decode), several heads
                           // (short sequences, the rows layout), or 1
  int64_t head_groups;     // heads / heads_per_item
  int64_t q_tile, q_tiles;
  int64_t chunk_len, chunks;  // key chunks; chunks > 1 means split-KV with a merge
  int64_t items() const;
};

// With the tiles the backend chose for this machine (Backend::tiles).
// `calls_in_team`: how many calls share one team of threads (the sequences of
// a packed batch), whose items balance the threads together; `threads`: the
// team's size (0: not known).  Neither changes a result's bits: they only
// group query tiles into items (split-KV depends on the shape alone).
WorkPlan plan_work(const mha_kernel_problem& problem, const Backend& backend,
                   int64_t calls_in_team = 1, int32_t threads = 0);

// "query-lanes", "decode" or "rows" (MHA_VERBOSE=2's layout=).
const char* layout_name(int32_t layout);

// The first key any query of a tile starting at q_begin can see: 0, or with a
// sliding window the first query's window start.  Keys before it are never
// read.
int64_t first_key_of_tile(const mha_kernel_problem& problem, int64_t q_begin);

// Runs the call on the backend with up to `threads` threads.
mha_status run_attention(const Backend& backend, KernelCall& call, int32_t threads);

// Runs `count` independent calls (the sequences of a packed batch) as one
// team: every call is planned on its own (so its items, and its results, are
// those of the call alone), the costliest calls' items handed out first.
mha_status run_attention(const Backend& backend, KernelCall* calls, int64_t count, int32_t threads);

// Combines n partial results of one row over disjoint key ranges -- each
// normalised over its own keys (outs[c][d * strides[c]]) with its log-sum-exp
// lses[c] -- into the row over all of them, in the order c = 0..n-1, in fp32,
// written to dst (d * dst_stride) as dst_dtype (F32, BF16, F16).  weights:
// scratch of n floats.  sink (-inf: none) joins the denominator as a part
// without values (an attention sink).  A row whose partials and sink are all
// -inf gets zeros and -inf.  lse may be nullptr.
void merge_row(int64_t n, const float* const* outs, const int64_t* strides, const float* lses,
               float sink, float* weights, int64_t dv, void* dst, int32_t dst_dtype,
               int64_t dst_stride, float* lse);

// The most key chunks the scheduler splits a row into.
constexpr int64_t kMaxChunks = 64;

// Below this many multiply-adds a call runs on the calling thread: waking the
// pool costs more than it saves.
constexpr double kSerialFlops = 4.0e5;

// a / b rounded up.  Every size the planners divide is at most MHA_MAX_EXTENT
// (2^40, checked by validation), so nothing overflows.
inline int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0 ? 1 : 0);
}

}  // namespace mha::rt
