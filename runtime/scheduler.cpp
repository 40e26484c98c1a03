#include "scheduler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dtype.h"
#include "common/problem.h"
#include "common/visibility.h"
#include "cpu_caches.h"
#include "error.h"
#include "scratch.h"
#include "threads.h"

namespace mha::rt {
namespace {

// Split-KV aims for at least this many items (fixed, so the split does not
// depend on the thread count) with chunks of at least kMinChunk keys.
constexpr int64_t kTargetItems = 64;
constexpr int64_t kMinChunk = 512;
constexpr int64_t kMaxHeadsPerItem = 8;
constexpr int64_t kWidenedQueryTiles = 16;
// A prefill's items grow while each thread keeps at least this many (items
// of one head cost alike, so 16 leave a thread idle for at most 1/16 of the
// call; under a causal mask the costliest tiles of a head go first).
constexpr int64_t kItemsPerThread = 16;
// The decode layout keeps every query head of a KV-head group as a row of one
// item; beyond mha_kernel::kMaxDecodeRows rows (absurd groups) the query-lane
// layout serves.
using mha_kernel::kMaxDecodeRows;
static_assert(kTargetItems <= kMaxChunks, "a row never has more chunks than kTargetItems");

// Short sequences (one query tile per head) leave an item too little work to
// hide the misses on its inputs: an item then takes several heads, and the
// kernel fetches the next head's rows while it computes one.  Only while
// enough items remain to balance the threads; never a thread-dependent choice.
int64_t heads_per_short_item(const mha_kernel_problem& p, const mha_tile_sizes& tiles) {
  if (p.lq > tiles.query_tile) return 1;
  int64_t best = 1;
  for (int64_t g = 2; g <= kMaxHeadsPerItem && g <= p.heads; ++g) {
    if (p.heads % g == 0 && p.batch * (p.heads / g) >= kTargetItems) best = g;
  }
  return best;
}

// How many keys a query tile of q_tile queries can see at most: all of them,
// or with a sliding window's left edge, the window widened by the tile; at
// least 1.  (A block of a larger problem can lie wholly left of the window:
// its first query's first key is then past its last key, and a span below 1
// gave items whose key ranges ran backwards, over memory before K and V.)
int64_t key_span(const mha_kernel_problem& p, int64_t q_tile) {
  if (p.lower_diag <= -mha_rules::kNoCausalLimit) return p.lk;
  if (p.causal_diag >= mha_rules::kNoCausalLimit) {  // the first tile's
    return std::max<int64_t>(1, p.lk - mha_rules::first_visible_key(0, p.lower_diag));
  }
  return std::max<int64_t>(1, std::min(p.lk, q_tile + p.causal_diag - p.lower_diag));
}

// Heads per item in the rows layout: as many as keep an item within
// mha_kernel::kRowsPerItem rows (a divisor of the head count).  Rows do not
// depend on what else their item holds, so this never changes a bit.
int64_t heads_per_rows_item(const mha_kernel_problem& p) {
  int64_t best = 1;
  for (int64_t g = 2; g <= p.heads && g * p.lq <= mha_kernel::kRowsPerItem; ++g) {
    if (p.heads % g == 0) best = g;
  }
  return best;
}

}  // namespace

const char* layout_name(int32_t layout) {
  switch (layout) {
    case MHA_LAYOUT_DECODE:
      return "decode";
    case MHA_LAYOUT_ROWS:
      return "rows";
    default:
      return "query-lanes";
  }
}

int64_t first_key_of_tile(const mha_kernel_problem& p, int64_t q_begin) {
  if (p.lower_diag <= -mha_rules::kNoCausalLimit) return 0;
  return std::min(p.lk, mha_rules::first_visible_key(q_begin, p.lower_diag));
}

int64_t WorkPlan::items() const {
  return batch * head_groups * q_tiles * chunks;
}

WorkPlan plan_work(const mha_kernel_problem& p, const Backend& backend, int64_t calls_in_team,
                   int32_t threads) {
  const mha_tile_sizes& tiles = backend.tiles;
  const int32_t vector_floats = backend.plugin->vector_floats;
  WorkPlan plan{};
  plan.batch = p.batch;
  // Tiny problems (all keys in one tile of lanes): the rows layout, whose
  // items hold all the keys and queries of a few heads.
  if (vector_floats > 1 && p.lk <= mha_kernel::kRowsMaxKeys &&
      p.lq <= mha_kernel::kRowsMaxQueries) {
    plan.layout = MHA_LAYOUT_ROWS;
    plan.heads_per_item = heads_per_rows_item(p);
    plan.head_groups = p.heads / plan.heads_per_item;
    plan.q_tile = p.lq;
    plan.q_tiles = 1;
    plan.chunk_len = key_span(p, p.lq);
    plan.chunks = 1;
    return plan;
  }
  // Query lanes waste most of every vector when there are few queries; then the
  // decode layout (lanes along the head dimension) serves the heads sharing a
  // KV head together.  With one or two queries it wins over any number of
  // keys the rows layout leaves: at 17 to 287 keys, as fast to 5x faster
  // on AVX-512 and AVX2 alike, most with grouped heads (docs/kernel-design.md,
  // "Short decodes").  With more queries it pays off only over many keys:
  // there the fixed cost of its horizontal reductions can outweigh the idle
  // lanes (4 queries, D 64: up to 1.27x slower at 24 keys on AVX-512).
  const bool few_queries = p.lq * 4 <= vector_floats;
  const bool long_enough = p.lq <= 2 || key_span(p, p.lq) >= 2 * tiles.key_tile;
  const bool decode = vector_floats > 1 && few_queries && long_enough &&
                      (p.heads / p.kv_heads) * p.lq <= kMaxDecodeRows;
  plan.layout = decode ? MHA_LAYOUT_DECODE : MHA_LAYOUT_QUERY_LANES;
  plan.heads_per_item =
      decode ? mha_kernel::decode_heads_per_item(p) : heads_per_short_item(p, tiles);
  plan.head_groups = p.heads / plan.heads_per_item;
  plan.q_tile = decode ? p.lq : std::min<int64_t>(p.lq, tiles.query_tile);
  // K and V that a prefill kernel must widen (half precision, int8) or copy
  // (fp32 rows apart) are copied once per item and reused by its query tiles:
  // give an item up to kWidenedQueryTiles tiles, while enough items remain to
  // balance the threads (counting `calls` calls like this one).  Up to 16
  // rather than 4: S9's causal items copy every key up to their last query,
  // and whole heads copy each once (S9, one thread, about 3 % faster).
  const bool copied = !decode && mha_kernel::kv_copied_per_item(p);
  const auto widened_q_tile = [&](int64_t calls, int64_t enough) {
    for (int64_t m = kWidenedQueryTiles; m > 1; m /= 2) {
      const int64_t tile = tiles.query_tile * m;
      if (calls * p.batch * plan.head_groups * ceil_div(p.lq, tile) >= enough) {
        return std::min(p.lq, tile);
      }
    }
    return plan.q_tile;
  };
  if (copied) plan.q_tile = widened_q_tile(1, 2 * kTargetItems);
  plan.q_tiles = ceil_div(p.lq, plan.q_tile);
  // Key chunks split what a tile can see (the window, not the whole cache):
  // chunk c of a tile starts at first_key_of_tile + c · chunk_len.
  const int64_t span = key_span(p, plan.q_tile);
  plan.chunk_len = span;
  plan.chunks = 1;

  const int64_t base = p.batch * plan.head_groups * plan.q_tiles;
  const int64_t min_chunk = ceil_div(kMinChunk, tiles.key_tile) * tiles.key_tile;
  if (base < kTargetItems && span >= 2 * min_chunk) {
    const int64_t want = std::min(ceil_div(kTargetItems, base), span / min_chunk);
    plan.chunk_len = ceil_div(ceil_div(span, want), tiles.key_tile) * tiles.key_tile;
    plan.chunks = ceil_div(span, plan.chunk_len);
  }
  // A call that shares its team with others (a packed batch's sequences: the
  // others' items balance the threads too), or whose team is small enough
  // that fewer items balance it (kItemsPerThread a thread), takes longer
  // items still -- when that cannot change its bits, so that a call gives the
  // same bits for any thread count and each sequence the bits of the call on
  // it alone: without split-KV (whose chunks follow the tile) and without a
  // window's left edge (key tiles start from an item's first visible key).
  // (Zen 5, two threads: S1 as [B, L, H, D] views, whose items held 4 query
  // tiles, takes whole heads of 8: 0.971 of the time at one thread, 0.955 at
  // two.)  So do calls whose K and V are read in place: with a query tile an
  // item, two threads took a head's tiles in turn and each brought the head's
  // K and V into its L2 for half of them; whole heads bring them once (Zen 5,
  // dense S1 at two threads: 0.982 and 1/1.029 of the time, both orders, 15
  // rounds, AVX2 0.985 and 1/1.030; one thread, S2 and S6 alike).  Those grow
  // only as far as the team needs: no copy per item bounds them.  A lone
  // call of copied K and V whose bound is still 2 · kTargetItems gets back
  // the tile chosen above.
  int64_t enough = kItemsPerThread * std::max(threads, 0);
  if (copied) enough = threads > 0 ? std::min(enough, 2 * kTargetItems) : 2 * kTargetItems;
  if (!decode && (copied || threads > 0) && plan.chunks == 1 &&
      p.lower_diag <= -mha_rules::kNoCausalLimit) {
    plan.q_tile = widened_q_tile(calls_in_team, enough);
    plan.q_tiles = ceil_div(p.lq, plan.q_tile);
    plan.chunk_len = key_span(p, plan.q_tile);
  }
  return plan;
}

void merge_row(int64_t n, const float* const* outs, const int64_t* strides, const float* lses,
               float sink, float* weights, int64_t dv, void* dst, int32_t dst_dtype,
               int64_t dst_stride, float* lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float max_lse = sink;
  for (int64_t c = 0; c < n; ++c) {
    if (std::isnan(lses[c])) {  // a NaN anywhere in the row makes the row NaN
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t d = 0; d < dv; ++d) mha_types::store_float(dst, dst_dtype, d * dst_stride, nan);
      if (lse != nullptr) *lse = nan;
      return;
    }
    max_lse = std::max(max_lse, lses[c]);
  }
  if (max_lse == kNegInf) {
    for (int64_t d = 0; d < dv; ++d) mha_types::store_float(dst, dst_dtype, d * dst_stride, 0.0f);
    if (lse != nullptr) *lse = kNegInf;
    return;
  }
  // Each element sums the weighted parts in a fixed order, c = 0..n-1, in
  // fp32, and is rounded to dst's dtype once.  Only parts without any key
  // (LSE -inf) are skipped: a part whose weight merely underflows still passes
  // on a NaN of its values, as the same keys in one part would.
  float weights_sum = sink == kNegInf ? 0.0f : std::exp(sink - max_lse);
  for (int64_t c = 0; c < n; ++c) {
    weights[c] = lses[c] == kNegInf ? 0.0f : std::exp(lses[c] - max_lse);
    weights_sum += weights[c];
  }
  const float inv = 1.0f / weights_sum;
  for (int64_t d = 0; d < dv; ++d) {
    float sum = 0.0f;
    bool first = true;
    for (int64_t c = 0; c < n; ++c) {
      if (lses[c] == kNegInf) continue;
      const float part = weights[c] * outs[c][d * strides[c]];
      sum = first ? part : sum + part;
      first = false;
    }
    mha_types::store_float(dst, dst_dtype, d * dst_stride, sum * inv);
  }
  if (lse != nullptr) *lse = max_lse + std::log(weights_sum);
}

namespace {

// One call of a batch of calls, planned: its items are [first_item,
// first_item + plan.items()) of the batch, its split-KV partials (if any) at
// partial_out / partial_lse.
struct PlannedCall {
  // Not zeroed first: run_attention sets every member (a tiny call paid for
  // zeroing the 0.5 KiB problem it then overwrote).
  PlannedCall() {}  // NOLINT(modernize-use-equals-default): = default would zero it
  KernelCall* call = nullptr;
  WorkPlan plan;
  mha_kernel_problem item_problem;  // what its items see (split-KV: no sinks)
  int64_t first_item = 0, first_merge = 0;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  int64_t rows_per_item() const { return plan.heads_per_item * plan.q_tile; }
};

// The item a thread ran last: its planned call and keys_of_item.  A cache
// line each: every thread writes its own.
struct alignas(64) LastItem {
  const PlannedCall* call = nullptr;
  int64_t keys = -1;
};

double flops_of(const mha_kernel_problem& p) {
  return 4.0 * static_cast<double>(p.batch * p.heads * p.lq) * static_cast<double>(p.lk) *
         static_cast<double>(p.d + p.dv) / 2.0;
}

// Whether the K and V of calls outgrow the last-level cache
// (mha_kernel_problem::kv_streamed).  Without a known L3, 32 MiB.
bool kv_streamed(const KernelCall* calls, int64_t count) {
  const mha_cache_sizes& caches = cpu_caches();
  const double cache = caches.l3 > 0 ? static_cast<double>(caches.l3) : 32.0 * 1048576.0;
  double bytes = 0.0;
  for (int64_t c = 0; c < count; ++c) {
    const mha_kernel_problem& p = calls[c].problem;
    bytes += static_cast<double>(p.batch * p.kv_heads * p.lk) *
             static_cast<double>(mha_kernel::kv_bytes_per_key(p));
  }
  return bytes > cache;
}

// The planned call that holds item `index` of the batch (first_item ascending).
const PlannedCall& call_of(const std::vector<PlannedCall>& planned, int64_t index,
                           int64_t PlannedCall::*first) {
  auto it =
      std::upper_bound(planned.begin(), planned.end(), index,
                       [first](int64_t value, const PlannedCall& c) { return value < c.*first; });
  return *(it - 1);
}

// Where item `local` of a planned call sits.  Items are ordered (batch,
// head group), then query tiles from the last (the costliest under a causal
// mask) to the first, then key chunks: a thread taking consecutive items
// reuses the same K and V, and the cheap items come last, which evens out the
// finish.
struct ItemPlace {
  int64_t group_index;  // batch * head_groups + head group
  int64_t tile_rank;    // 0: the last query tile
  int64_t chunk;
};
ItemPlace place_of(const WorkPlan& plan, int64_t local) {
  return {local / (plan.chunks * plan.q_tiles), (local / plan.chunks) % plan.q_tiles,
          local % plan.chunks};
}

// The keys item `local` reads, as one number: its (batch, head group) and
// key chunk.
int64_t keys_of_item(const WorkPlan& plan, int64_t local) {
  const ItemPlace at = place_of(plan, local);
  return at.group_index * plan.chunks + at.chunk;
}

// Item `local` of a planned call; kv_new: mha_work_item::kv_new.
mha_work_item item_of(const PlannedCall& pc, int64_t local, bool kv_new) {
  const WorkPlan& plan = pc.plan;
  const KernelCall& call = *pc.call;
  const mha_kernel_problem& p = call.problem;
  const int64_t out_bytes = mha_types::float_bytes(call.out_dtype);
  const ItemPlace at = place_of(plan, local);
  const int64_t chunk = at.chunk;
  const int64_t b = at.group_index / plan.head_groups;
  const int64_t group = at.group_index % plan.head_groups;
  const int64_t q_tile = plan.q_tiles - 1 - at.tile_rank;

  mha_work_item item{};
  item.b = b;
  item.h_begin = group * plan.heads_per_item;
  item.h_end = item.h_begin + plan.heads_per_item;
  item.q_begin = q_tile * plan.q_tile;
  item.q_end = std::min(item.q_begin + plan.q_tile, p.lq);
  item.k_begin = std::min(p.lk, first_key_of_tile(p, item.q_begin) + chunk * plan.chunk_len);
  item.k_end = std::min(item.k_begin + plan.chunk_len, p.lk);
  item.kv_new = kv_new ? 1 : 0;
  if (plan.chunks > 1) {
    const int64_t rows = pc.rows_per_item();
    item.out = pc.partial_out + local * rows * p.dv;
    item.out_dtype = MHA_DTYPE_F32;
    item.out_strides[0] = plan.q_tile * p.dv;
    item.out_strides[1] = p.dv;
    item.out_strides[2] = 1;
    item.lse = pc.partial_lse + local * rows;
    item.lse_strides[0] = plan.q_tile;
    item.lse_strides[1] = 1;
  } else {
    item.out = static_cast<char*>(call.out) +
               (b * call.out_strides[0] + item.h_begin * call.out_strides[1] +
                item.q_begin * call.out_strides[2]) *
                   out_bytes;
    item.out_dtype = call.out_dtype;
    item.out_strides[0] = call.out_strides[1];
    item.out_strides[1] = call.out_strides[2];
    item.out_strides[2] = call.out_strides[3];
    if (call.lse != nullptr) {
      item.lse = call.lse + b * call.lse_strides[0] + item.h_begin * call.lse_strides[1] +
                 item.q_begin * call.lse_strides[2];
      item.lse_strides[0] = call.lse_strides[1];
      item.lse_strides[1] = call.lse_strides[2];
    }
  }
  return item;
}

// Runs item `local` of a planned call; kv_new: mha_work_item::kv_new.  The
// thread most likely runs item `local + team` next (mha_work_item::next):
// items cost about the same within a call, and each thread takes the lowest
// one left.
int run_item(const mha_plugin& plugin, const PlannedCall& pc, int64_t local, void* scratch,
             bool kv_new, int32_t team) {
  mha_work_item item = item_of(pc, local, kv_new);
  mha_work_item next{};
  const int64_t later = local + team;
  if (later < pc.plan.items() && keys_of_item(pc.plan, later) != keys_of_item(pc.plan, local)) {
    next = item_of(pc, later, true);
    item.next = &next;
  }
  return plugin.attend(&pc.item_problem, &item, scratch);
}

// Merges the split-KV partials of one (batch, head group, query tile) of a
// planned call: its chunks are consecutive items.
void merge_tile(const PlannedCall& pc, int64_t tile_index) {
  const WorkPlan& plan = pc.plan;
  const KernelCall& call = *pc.call;
  const mha_kernel_problem& p = call.problem;
  const int64_t out_bytes = mha_types::float_bytes(call.out_dtype);
  const int64_t rows_per_item = pc.rows_per_item();
  const int64_t first = tile_index * plan.chunks;
  const int64_t tile_rank = tile_index % plan.q_tiles;
  const int64_t group_index = tile_index / plan.q_tiles;
  const int64_t b = group_index / plan.head_groups;
  const int64_t h0 = (group_index % plan.head_groups) * plan.heads_per_item;
  const int64_t q0 = (plan.q_tiles - 1 - tile_rank) * plan.q_tile;
  const int64_t nq = std::min(plan.q_tile, p.lq - q0);
  const float* outs[kMaxChunks];
  float lses[kMaxChunks], weights[kMaxChunks];
  int64_t unit_strides[kMaxChunks];
  std::fill(unit_strides, unit_strides + plan.chunks, int64_t{1});
  for (int64_t h = 0; h < plan.heads_per_item; ++h) {
    const float sink = p.sinks == nullptr ? -std::numeric_limits<float>::infinity()
                                          : p.sinks[(h0 + h) * p.sinks_stride];
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t row = h * plan.q_tile + i;
      for (int64_t c = 0; c < plan.chunks; ++c) {
        outs[c] = pc.partial_out + ((first + c) * rows_per_item + row) * p.dv;
        lses[c] = pc.partial_lse[(first + c) * rows_per_item + row];
      }
      void* dst =
          static_cast<char*>(call.out) + (b * call.out_strides[0] + (h0 + h) * call.out_strides[1] +
                                          (q0 + i) * call.out_strides[2]) *
                                             out_bytes;
      float* lse = call.lse == nullptr
                       ? nullptr
                       : call.lse + b * call.lse_strides[0] + (h0 + h) * call.lse_strides[1] +
                             (q0 + i) * call.lse_strides[2];
      merge_row(plan.chunks, outs, unit_strides, lses, sink, weights, p.dv, dst, call.out_dtype,
                call.out_strides[3], lse);
    }
  }
}

}  // namespace

mha_status run_attention(const Backend& backend, KernelCall* calls, int64_t count,
                         int32_t threads) {
  const mha_plugin& plugin = *backend.plugin;
  // The costliest calls first: with items handed out one at a time, a long
  // sequence's items start early and short ones fill in around them
  // (longest-processing-time order).  Which thread runs an item never
  // changes what it computes.
  // (The lists live on with the calling thread, so a call of a tiny problem
  // does not pay for allocating them: its whole cost is a few microseconds.
  // The lambdas below run on other threads too: they use these references,
  // never the thread_local names, which would name each thread's own list.)
  thread_local std::vector<int64_t> thread_order;
  thread_local std::vector<PlannedCall> thread_planned;
  thread_local std::vector<LastItem> thread_last;
  std::vector<int64_t>& order = thread_order;
  // Lists of a large packed batch are not kept.
  struct ReleaseLarge {
    std::vector<int64_t>& order;
    std::vector<PlannedCall>& planned;
    ~ReleaseLarge() {
      if (order.capacity() > 256) std::vector<int64_t>().swap(order);
      if (planned.capacity() > 256) std::vector<PlannedCall>().swap(planned);
    }
  } release_large{thread_order, thread_planned};
  const int32_t streamed = kv_streamed(calls, count) ? 1 : 0;
  for (int64_t c = 0; c < count; ++c) calls[c].problem.kv_streamed = streamed;
  order.resize(static_cast<size_t>(count));
  for (int64_t c = 0; c < count; ++c) order[static_cast<size_t>(c)] = c;
  if (count > 1) {
    std::stable_sort(order.begin(), order.end(), [calls](int64_t a, int64_t b) {
      return flops_of(calls[a].problem) > flops_of(calls[b].problem);
    });
  }

  std::vector<PlannedCall>& planned = thread_planned;
  planned.clear();
  planned.reserve(static_cast<size_t>(count));
  int64_t n_items = 0, n_merges = 0;
  size_t scratch_bytes = 0, partial_floats = 0;
  double flops = 0.0;
  for (const int64_t c : order) {
    KernelCall& call = calls[c];
    mha_kernel_problem& p = call.problem;
    // Built in place: the struct holds a whole problem (about 0.5 KiB), and
    // a tiny call (S5) paid a few percent of its time for copying it twice.
    PlannedCall& pc = planned.emplace_back();
    pc.call = &call;
    pc.plan = plan_work(p, backend, count, threads);
    p.layout = pc.plan.layout;
    pc.item_problem = p;
    if (pc.plan.chunks > 1) pc.item_problem.sinks = nullptr;  // the merge adds each once
    pc.first_item = n_items;
    pc.first_merge = n_merges;
    n_items += pc.plan.items();
    if (pc.plan.chunks > 1) {
      n_merges += pc.plan.items() / pc.plan.chunks;
      partial_floats +=
          static_cast<size_t>(pc.plan.items() * pc.rows_per_item()) * static_cast<size_t>(p.dv + 1);
    }
    scratch_bytes = std::max(scratch_bytes, plugin.scratch_bytes(&p, pc.plan.q_tile));
    flops += flops_of(p);
  }
  if (n_items == 0) return MHA_OK;

  // Split-KV: every item of a split call writes a normalised partial and its
  // LSE, merged below.  (Few items per split call: small.)
  if (partial_floats > 0) {
    auto* buffer = static_cast<float*>(thread_scratch(ScratchSlot::kPartials, partial_floats * 4));
    if (buffer == nullptr) {
      return fail(MHA_ERR_OUT_OF_MEMORY,
                  "cannot allocate %zu bytes for split-KV partials; the outputs are untouched",
                  partial_floats * 4);
    }
    for (PlannedCall& pc : planned) {
      if (pc.plan.chunks == 1) continue;
      const int64_t rows = pc.plan.items() * pc.rows_per_item();
      pc.partial_out = buffer;
      pc.partial_lse = buffer + rows * pc.call->problem.dv;
      buffer += rows * (pc.call->problem.dv + 1);
    }
  }

  int32_t team = static_cast<int32_t>(std::min<int64_t>(threads, n_items));
  if (flops < kSerialFlops) team = 1;
  // What each thread ran last, so that an item knows whether its K and V are
  // new to the thread that runs it (mha_work_item::kv_new).
  std::vector<LastItem>& last = thread_last;
  last.assign(static_cast<size_t>(std::max(team, 1)), LastItem{});

  std::atomic<int> failed_item_code{0};
  // Every thread takes its scratch before any item runs: if one cannot, no
  // output has been touched and the call fails cleanly.
  // (thread_scratch then hands each item the same, already grown, buffer.)
  auto prepare = [&](int32_t /*thread*/) {
    return thread_scratch(ScratchSlot::kKernel, scratch_bytes) != nullptr;
  };
  auto run_one = [&](int64_t index, int32_t thread) {
    const PlannedCall& pc = call_of(planned, index, &PlannedCall::first_item);
    void* scratch = thread_scratch(ScratchSlot::kKernel, scratch_bytes);
    const int64_t local = index - pc.first_item;
    LastItem& mine = last[static_cast<size_t>(thread)];
    const LastItem now{&pc, keys_of_item(pc.plan, local)};
    const bool kv_new = now.call != mine.call || now.keys != mine.keys;
    mine = now;
    if (int code = run_item(plugin, pc, local, scratch, kv_new, team); code != 0) {
      int expected = 0;
      failed_item_code.compare_exchange_strong(expected, code);
    }
  };
  if (!run_team(n_items, team, prepare, run_one)) {
    return fail(MHA_ERR_OUT_OF_MEMORY,
                "cannot allocate %zu bytes of kernel scratch per thread (or start the threads); "
                "the outputs are untouched",
                scratch_bytes);
  }
  if (int code = failed_item_code.load(); code != 0) {
    return fail(MHA_ERR_INTERNAL,
                "backend %s failed with code %d; the contents of out and lse are unspecified",
                backend.name.c_str(), code);
  }

  if (n_merges > 0) {
    std::vector<PlannedCall> split;  // first_merge ascending, as planned
    for (const PlannedCall& pc : planned) {
      if (pc.plan.chunks > 1) split.push_back(pc);
    }
    auto merge_one = [&](int64_t index, int32_t /*thread*/) {
      const PlannedCall& pc = call_of(split, index, &PlannedCall::first_merge);
      merge_tile(pc, index - pc.first_merge);
    };
    run_team(
        n_merges, team, [](int32_t) { return true; }, merge_one);
  }
  return MHA_OK;
}

mha_status run_attention(const Backend& backend, KernelCall& call, int32_t threads) {
  return run_attention(backend, &call, 1, threads);
}

}  // namespace mha::rt
