// mha_attention_backward: validation, the plan, and the parts of the backward
// pass that are not the kernels' -- delta = rowsum(dO ∘ O), the zeroing of dQ,
// the fixed-order sums of split dQ, dmask and dsinks, and the one rounding of
// half-precision gradients.
//
// Half precision.  q, k, v, out and dout may be BF16 or F16 (the forward's
// rules); the kernels widen them to fp32 as they pack them, and every sum is
// fp32.  A BF16 or F16 gradient is accumulated in an fp32 buffer and rounded
// once, at the end (to nearest even, common/dtype.h): dQ in a buffer of its
// own (its rows collect every key block's share), dK and dV of an item in the
// thread's scratch, rounded into the output as soon as the item is done.  The
// kernels never see a half-precision output; the memory stays linear in L
// (one fp32 copy of dQ, a chunk of keys' dK and dV per thread).
//
// Determinism: work items are (key chunk, batch, KV head), and the chunks
// are decided from the shape alone.  An item owns dK and dV of its keys and
// adds its share of dQ to a buffer of its own chunk (chunk 0: dq itself);
// the chunks' buffers are then summed in chunk order.  No floating-point
// value depends on which thread ran what, so any thread count gives the same
// bits.  What it costs: one fp32 copy of dQ per extra chunk (only when the
// shape has too few (batch, KV head) pairs to keep threads busy), and the
// sum over them.
#include "backward.h"

#include "attention.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "common/dtype.h"
#include "env.h"
#include "error.h"
#include "registry.h"
#include "scheduler.h"
#include "scratch.h"
#include "threads.h"
#include "validate.h"
#include "versioned.h"

namespace mha::rt {
namespace {

// Split the keys while fewer (batch, KV head) items than this exist, with
// chunks of at least kMinBackwardChunk keys (multiples of kChunkAlign), into
// at most kMaxBackwardChunks (each chunk past the first costs an fp32 copy of
// dQ: the memory stays linear in L and small beside the inputs).
constexpr int64_t kBackwardTargetItems = 16;
constexpr int64_t kMaxBackwardChunks = 4;
constexpr int64_t kMinBackwardChunk = 512;
constexpr int64_t kChunkAlign = 64;

struct BackwardPlan {
  int64_t chunk_len, chunks;
  int64_t items(const mha_kernel_problem& p) const { return chunks * p.batch * p.kv_heads; }
};

BackwardPlan plan_backward(const mha_kernel_problem& p) {
  BackwardPlan plan{p.lk, 1};
  const int64_t base = p.batch * p.kv_heads;
  if (base < kBackwardTargetItems && p.lk >= 2 * kMinBackwardChunk) {
    const int64_t want = std::min(
        {ceil_div(kBackwardTargetItems, base), p.lk / kMinBackwardChunk, kMaxBackwardChunks});
    plan.chunk_len = ceil_div(ceil_div(p.lk, want), kChunkAlign) * kChunkAlign;
    plan.chunks = ceil_div(p.lk, plan.chunk_len);
  }
  return plan;
}

}  // namespace

mha_status check_same_shape(const mha_tensor& t, const char* name, const mha_tensor& like,
                            const char* like_name) {
  for (int32_t axis = 0; axis < t.ndim; ++axis) {
    if (t.shape[axis] != like.shape[axis]) {
      return fail(MHA_ERR_SHAPE_MISMATCH, "%s has shape %s; it must have %s's shape %s", name,
                  shape_text(t).c_str(), like_name, shape_text(like).c_str());
    }
  }
  return MHA_OK;
}

// A tensor that takes F32 or the dtype of `like` (a gradient: its input's
// dtype, as PyTorch's autograd returns it; dout: out's dtypes).
mha_status check_f32_or_like(const mha_tensor& t, const char* name, const mha_tensor& like,
                             const char* like_name) {
  if (t.dtype == MHA_DTYPE_F32 || t.dtype == like.dtype) return MHA_OK;
  return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be f32 or %s's dtype (%s)", name,
              dtype_name(t.dtype), like_name, dtype_name(like.dtype));
}

mha_status check_dsinks(const mha_tensor* dsinks, const mha_tensor* sinks, int64_t heads) {
  if (dsinks == nullptr) return MHA_OK;
  if (sinks == nullptr) {
    return fail(MHA_ERR_INVALID_VALUE,
                "backward->dsinks is given but params->sinks is NULL: there is no sink to "
                "differentiate");
  }
  if (mha_status s = check_tensor(dsinks, "backward->dsinks", 1, 1); s != MHA_OK) return s;
  if (mha_status s = check_f32(dsinks, "backward->dsinks"); s != MHA_OK) return s;
  return check_shape_equal("heads", "q", heads, "backward->dsinks", dsinks->shape[0]);
}

mha_status validate_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                             const mha_tensor* out, const mha_tensor* lse, const mha_tensor* dout,
                             mha_tensor* dq, mha_tensor* dk, mha_tensor* dv,
                             const mha_attention_params* params,
                             const mha_backward_params* backward, BackwardCall* call) {
  mha_attention_params given;
  if (mha_status s = read_attention_params(params, &given); s != MHA_OK) return s;
  mha_backward_params extra;
  mha_backward_params_init(&extra);
  if (backward != nullptr) {
    const mha_backward_params defaults = extra;
    if (mha_status s = read_versioned(backward, defaults, kBackwardParamsSizes, "backward",
                                      "mha_backward_params_init", &extra);
        s != MHA_OK) {
      return s;
    }
  }
  given.lse = nullptr;  // the forward's output slot; the backward reads `lse`
  if (mha_status s = validate_attention(q, k, v, out, &given, &call->forward); s != MHA_OK) {
    return s;
  }
  if (k->dtype == MHA_DTYPE_I8) {
    return fail(MHA_ERR_UNSUPPORTED, "k and v are I8: an int8 KV cache has no backward pass");
  }
  // q, k, v and out passed the forward's dtype rules; dout takes out's
  // (F32 or q's dtype).
  if (mha_status s = check_tensor(dout, "dout", 4, 4); s != MHA_OK) return s;
  if (mha_status s = check_f32_or_like(*dout, "dout", *q, "q"); s != MHA_OK) return s;
  if (mha_status s = check_same_shape(*dout, "dout", *out, "out"); s != MHA_OK) return s;
  if (mha_status s = check_tensor(lse, "lse", 3, 3); s != MHA_OK) return s;
  if (mha_status s = check_f32(lse, "lse"); s != MHA_OK) return s;
  if (mha_status s = check_agreements({{"batch", "q", q->shape[0], "lse", lse->shape[0]},
                                       {"heads", "q", q->shape[1], "lse", lse->shape[1]},
                                       {"query length", "q", q->shape[2], "lse", lse->shape[2]}});
      s != MHA_OK) {
    return s;
  }
  mha_tensor* grads[3] = {dq, dk, dv};
  const mha_tensor* likes[3] = {q, k, v};
  const char* grad_names[3] = {"dq", "dk", "dv"};
  const char* like_names[3] = {"q", "k", "v"};
  for (int g = 0; g < 3; ++g) {
    if (mha_status s = check_tensor(grads[g], grad_names[g], 4, 4); s != MHA_OK) return s;
    if (mha_status s = check_f32_or_like(*grads[g], grad_names[g], *likes[g], like_names[g]);
        s != MHA_OK) {
      return s;
    }
    if (mha_status s = check_same_shape(*grads[g], grad_names[g], *likes[g], like_names[g]);
        s != MHA_OK) {
      return s;
    }
  }

  if (mha_status s = check_dsinks(extra.dsinks, given.sinks, q->shape[1]); s != MHA_OK) return s;
  if (extra.dmask != nullptr) {
    const mha_tensor* mask = given.mask;
    if (mask == nullptr || mask->dtype == MHA_DTYPE_BOOL) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "backward->dmask is given but params->mask is %s: only an additive mask has a "
                  "gradient",
                  mask == nullptr ? "NULL" : "BOOL");
    }
    if (mha_status s = check_tensor(extra.dmask, "backward->dmask", 2, 4); s != MHA_OK) return s;
    if (mha_status s = check_f32(extra.dmask, "backward->dmask"); s != MHA_OK) return s;
    bool same = extra.dmask->ndim == mask->ndim;
    for (int32_t axis = 0; same && axis < mask->ndim; ++axis) {
      same = extra.dmask->shape[axis] == mask->shape[axis];
    }
    if (!same) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "backward->dmask has shape %s; it must have params->mask's shape %s",
                  shape_text(*extra.dmask).c_str(), shape_text(*mask).c_str());
    }
  }
  // Every output against every input and every other output.
  const mha_tensor* inputs[] = {
      q, k, v, out, lse, dout, given.mask, given.valid_lens, given.sinks, given.alibi_slopes};
  const char* input_names[] = {"q",    "k",    "v",          "out",   "lse",
                               "dout", "mask", "valid_lens", "sinks", "alibi_slopes"};
  constexpr int kInputs = 10;
  const mha_tensor* outputs[] = {dq, dk, dv, extra.dsinks, extra.dmask};
  const char* output_names[] = {"dq", "dk", "dv", "backward->dsinks", "backward->dmask"};
  for (int o = 0; o < 5; ++o) {
    if (outputs[o] == nullptr) continue;
    if (mha_status s = check_no_overlap(*outputs[o], output_names[o], inputs, input_names, kInputs);
        s != MHA_OK) {
      return s;
    }
    if (mha_status s = check_no_overlap(*outputs[o], output_names[o], outputs + o + 1,
                                        output_names + o + 1, 4 - o);
        s != MHA_OK) {
      return s;
    }
  }

  call->out = out;
  call->dout = dout;
  call->dq = *dq;
  call->dk = *dk;
  call->dv = *dv;
  call->dsinks = extra.dsinks;
  call->dmask = extra.dmask;
  call->mask = given.mask;
  mha_backward_problem& b = call->problem;
  std::memset(&b, 0, sizeof b);
  b.struct_size = sizeof b;
  b.dout = dout->data;
  std::memcpy(b.dout_strides, dout->strides, sizeof b.dout_strides);
  b.dout_dtype = dout->dtype;
  b.lse = static_cast<const float*>(lse->data);
  std::memcpy(b.lse_strides, lse->strides, sizeof b.lse_strides);
  return MHA_OK;
}

namespace {

// Offset of element [b, h, i, 0] of a 4-d tensor.
int64_t row_offset(const mha_tensor& t, int64_t b, int64_t h, int64_t i) {
  return b * t.strides[0] + h * t.strides[1] + i * t.strides[2];
}

// delta[b, h, i] = Σ_x dO[b, h, i, x] · O[b, h, i, x], in fp32 from the
// widened values (exact: a half is an fp32), x ascending; the rows widened
// kRun elements at a time.
void compute_delta(const BackwardCall& call, float* delta, int64_t row) {
  const mha_kernel_problem& p = call.forward.problem;
  const int64_t i = row % p.lq;
  const int64_t bh = row / p.lq;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const mha_tensor &out = *call.out, &dout = *call.dout;
  const int64_t o = row_offset(out, b, h, i), g = row_offset(dout, b, h, i);
  constexpr int64_t kRun = 256;
  float a[kRun], c[kRun];
  float sum = 0.0f;
  for (int64_t x0 = 0; x0 < p.dv; x0 += kRun) {
    const int64_t n = std::min(kRun, p.dv - x0);
    mha_types::widen_row(out.data, out.dtype, o + x0 * out.strides[3], out.strides[3], n, a);
    mha_types::widen_row(dout.data, dout.dtype, g + x0 * dout.strides[3], dout.strides[3], n, c);
    for (int64_t x = 0; x < n; ++x) sum += a[x] * c[x];
  }
  delta[row] = sum;
}

// A 4-d fp32 view: the caller's F32 gradient, or the fp32 buffer a
// half-precision one is accumulated in (C order).
struct F32View {
  float* data;
  int64_t strides[4];
};
F32View f32_view(const mha_tensor& t, float* buffer) {
  if (t.dtype == MHA_DTYPE_F32) {
    return {static_cast<float*>(t.data), {t.strides[0], t.strides[1], t.strides[2], t.strides[3]}};
  }
  const int64_t* n = t.shape;
  return {buffer, {n[1] * n[2] * n[3], n[2] * n[3], n[3], 1}};
}

// Rows [0, rows) of `cols` fp32 values (dense) rounded once into a
// half-precision gradient: row r at element at + r · row_stride, its columns
// dst.strides[3] apart.
void round_rows(const float* src, int64_t rows, int64_t cols, const mha_tensor& dst, int64_t at,
                int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    mha_types::narrow_row(src + r * cols, cols, dst.data, dst.dtype, at + r * row_stride,
                          dst.strides[3]);
  }
}

// sums[h] += Σ_{b, i} e^(sink_h - lse[b, h, i]) · delta[b, h, i], b then i
// ascending, in float64 (the sink's weight in each row times the row's
// delta); dsinks[h] is -sums[h] over every call of a run.
void add_dsinks(const BackwardCall& call, const float* delta, double* sums) {
  const mha_kernel_problem& p = call.forward.problem;
  const mha_backward_problem& bp = call.problem;
  for (int64_t h = 0; h < p.heads; ++h) {
    const double sink = static_cast<double>(p.sinks[h * p.sinks_stride]);
    if (sink == -std::numeric_limits<double>::infinity()) continue;
    double sum = sums[h];
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t i = 0; i < p.lq; ++i) {
        const double lse = static_cast<double>(
            bp.lse[b * bp.lse_strides[0] + h * bp.lse_strides[1] + i * bp.lse_strides[2]]);
        sum += std::exp(sink - lse) * static_cast<double>(delta[(b * p.heads + h) * p.lq + i]);
      }
    }
    sums[h] = sum;
  }
}

// Whether the additive mask covers every (b, h, i, j) with its own element
// (no axis broadcast): the kernels then write dmask in place.
bool mask_is_full(const mha_tensor& mask, const mha_kernel_problem& p) {
  const int64_t full[4] = {p.batch, p.heads, p.lq, p.lk};
  if (mask.ndim != 4) return false;
  for (int32_t axis = 0; axis < 4; ++axis) {
    if (mask.shape[axis] != full[axis]) return false;
  }
  return true;
}

// dmask = the full [B, H, Lq, Lk] gradient summed over the axes the mask
// broadcasts, each element's terms in (b, h, i, j) order.
void reduce_dmask(const BackwardCall& call, const float* full) {
  const mha_kernel_problem& p = call.forward.problem;
  const mha_tensor& dmask = *call.dmask;
  int64_t strides[4];  // dmask's strides, 0 on broadcast axes (the mask's rule)
  const int32_t offset = 4 - dmask.ndim;
  for (int32_t axis = 0; axis < 4; ++axis) {
    strides[axis] =
        axis < offset || dmask.shape[axis - offset] == 1 ? 0 : dmask.strides[axis - offset];
  }
  auto* dst = static_cast<float*>(dmask.data);
  // Zero every element (a broadcast axis of size 1 included).
  int64_t count = 1;
  for (int32_t axis = 0; axis < dmask.ndim; ++axis) count *= dmask.shape[axis];
  for (int64_t e = 0; e < count; ++e) {
    int64_t at = 0, rest = e;
    for (int32_t axis = dmask.ndim - 1; axis >= 0; --axis) {
      at += (rest % dmask.shape[axis]) * dmask.strides[axis];
      rest /= dmask.shape[axis];
    }
    dst[at] = 0.0f;
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads; ++h) {
      for (int64_t i = 0; i < p.lq; ++i) {
        const float* row = full + ((b * p.heads + h) * p.lq + i) * p.lk;
        float* out = dst + b * strides[0] + h * strides[1] + i * strides[2];
        for (int64_t j = 0; j < p.lk; ++j) out[j * strides[3]] += row[j];
      }
    }
  }
}

template <class T>
std::unique_ptr<T[]> try_allocate(int64_t count) {
  return std::unique_ptr<T[]>(new (std::nothrow)
                                  T[static_cast<size_t>(std::max<int64_t>(count, 1))]);
}

// The query-key pairs of keys [kb, ke) under the causal rule and the
// window's edges (valid lengths and masks ignored): an item's cost, for the
// order items are handed out in.
double pairs_of_keys(const mha_kernel_problem& p, int64_t kb, int64_t ke) {
  double pairs = 0.0;
  for (int64_t j = kb; j < ke; ++j) {
    // Query i sees key j iff i + lower_diag <= j <= i + causal_diag.
    const int64_t first = std::max<int64_t>(0, j - p.causal_diag);
    const int64_t last = std::min<int64_t>(p.lq - 1, j - p.lower_diag);
    if (last >= first) pairs += static_cast<double>(last - first + 1);
  }
  return pairs;
}

// One call of a run, planned, with its places in the run's buffers.
struct PlannedBackward {
  BackwardCall* call = nullptr;
  BackwardPlan plan{};
  int64_t rows = 0;         // batch · heads · lq: delta's and dQ's rows
  int64_t per_row = 1;      // rows in a block of phases 1 and 3
  int64_t first_block = 0;  // its first row block in the run
  int64_t first_item = 0;   // its first item in the run
  float* delta = nullptr;
  float* partials = nullptr;    // (chunks - 1) · rows · d: the other chunks' dQ
  float* dq_buffer = nullptr;   // a half-precision dq's fp32 sums
  float* dmask_full = nullptr;  // a broadcast dmask's full [B, H, Lq, Lk] gradient
  bool dmask_in_place = false;
  F32View dq{};                                 // where the kernels add dQ: dq itself, or dq_buffer
  size_t stage_offset = 0;                      // bytes of the kernel's scratch, 64-byte aligned
  int64_t dk_stage = 0, dv_stage = 0;           // floats of a half-precision dK / dV after them
  double chunk_pairs[kMaxBackwardChunks] = {};  // the cost of an item of each chunk

  int64_t blocks() const { return ceil_div(rows, per_row); }
  float* dq_row(int64_t row) const {
    const mha_kernel_problem& p = call->forward.problem;
    const int64_t i = row % p.lq, bh = row / p.lq;
    return dq.data + (bh / p.heads) * dq.strides[0] + (bh % p.heads) * dq.strides[1] +
           i * dq.strides[2];
  }
};

// The planned call holding run-wide index `index` (first ascending).
const PlannedBackward& holder(const std::vector<PlannedBackward>& planned, int64_t index,
                              int64_t PlannedBackward::*first) {
  auto it = std::upper_bound(
      planned.begin(), planned.end(), index,
      [first](int64_t value, const PlannedBackward& c) { return value < c.*first; });
  return *(it - 1);
}

// Runs item `local` of a planned call (chunk, batch, KV head) on the thread's
// scratch; false when the kernel failed (*code: its code).
bool run_item(const mha_plugin& plugin, const PlannedBackward& pc, int64_t local, void* scratch,
              int* code) {
  const BackwardCall& call = *pc.call;
  const mha_kernel_problem& p = call.forward.problem;
  const BackwardPlan& plan = pc.plan;
  const int64_t chunk = local / (p.batch * p.kv_heads);
  const int64_t b = (local / p.kv_heads) % p.batch;
  const int64_t kvh = local % p.kv_heads;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t dq_floats = pc.rows * p.d;
  mha_backward_item item{};
  item.b = b;
  item.kv_head = kvh;
  item.k_begin = chunk * plan.chunk_len;
  item.k_end = std::min(p.lk, item.k_begin + plan.chunk_len);
  const int64_t h0 = kvh * group;
  if (chunk == 0) {
    item.dq = pc.dq.data + b * pc.dq.strides[0] + h0 * pc.dq.strides[1];
    item.dq_strides[0] = pc.dq.strides[1];
    item.dq_strides[1] = pc.dq.strides[2];
    item.dq_strides[2] = pc.dq.strides[3];
  } else {
    item.dq = pc.partials + (chunk - 1) * dq_floats + (b * p.heads + h0) * p.lq * p.d;
    item.dq_strides[0] = p.lq * p.d;
    item.dq_strides[1] = p.d;
    item.dq_strides[2] = 1;
  }
  float* stage = reinterpret_cast<float*>(static_cast<char*>(scratch) + pc.stage_offset);
  const int64_t dk_at =
      b * call.dk.strides[0] + kvh * call.dk.strides[1] + item.k_begin * call.dk.strides[2];
  const int64_t dv_at =
      b * call.dv.strides[0] + kvh * call.dv.strides[1] + item.k_begin * call.dv.strides[2];
  if (pc.dk_stage > 0) {
    item.dk = stage;
    item.dk_strides[0] = p.d;
    item.dk_strides[1] = 1;
  } else {
    item.dk = static_cast<float*>(call.dk.data) + dk_at;
    item.dk_strides[0] = call.dk.strides[2];
    item.dk_strides[1] = call.dk.strides[3];
  }
  if (pc.dv_stage > 0) {
    item.dv = stage + pc.dk_stage;
    item.dv_strides[0] = p.dv;
    item.dv_strides[1] = 1;
  } else {
    item.dv = static_cast<float*>(call.dv.data) + dv_at;
    item.dv_strides[0] = call.dv.strides[2];
    item.dv_strides[1] = call.dv.strides[3];
  }
  if (pc.dmask_in_place) {
    const mha_tensor& m = *call.dmask;
    item.dmask = static_cast<float*>(m.data) + b * m.strides[0] + h0 * m.strides[1] +
                 item.k_begin * m.strides[3];
    item.dmask_strides[0] = m.strides[1];
    item.dmask_strides[1] = m.strides[2];
    item.dmask_strides[2] = m.strides[3];
  } else if (pc.dmask_full != nullptr) {
    item.dmask = pc.dmask_full + (b * p.heads + h0) * p.lq * p.lk + item.k_begin;
    item.dmask_strides[0] = p.lq * p.lk;
    item.dmask_strides[1] = p.lk;
    item.dmask_strides[2] = 1;
  }
  if (int c = plugin.backward(&call.problem, &item, scratch); c != 0) {
    *code = c;
    return false;
  }
  // The item owns dK and dV of its keys: they are final, round them now.
  const int64_t keys = item.k_end - item.k_begin;
  if (pc.dk_stage > 0) round_rows(item.dk, keys, p.d, call.dk, dk_at, call.dk.strides[2]);
  if (pc.dv_stage > 0) round_rows(item.dv, keys, p.dv, call.dv, dv_at, call.dv.strides[2]);
  return true;
}

mha_status run_backward(const Backend& backend, BackwardCall* calls, int64_t count,
                        int32_t threads) {
  const mha_plugin& plugin = *backend.plugin;
  std::vector<PlannedBackward> planned(static_cast<size_t>(count));
  int64_t delta_floats = 0, partial_floats = 0, dmask_floats = 0, dq_buffer_floats = 0;
  int64_t n_blocks = 0, n_items = 0;
  size_t scratch_bytes = 0;
  double flops = 0.0;
  for (int64_t c = 0; c < count; ++c) {
    PlannedBackward& pc = planned[static_cast<size_t>(c)];
    BackwardCall& call = calls[c];
    pc.call = &call;
    mha_kernel_problem& p = call.forward.problem;
    p.layout = MHA_LAYOUT_QUERY_LANES;
    call.problem.forward = &p;
    pc.plan = plan_backward(p);
    pc.rows = p.batch * p.heads * p.lq;
    pc.per_row = std::max<int64_t>(1, 65536 / std::max<int64_t>(p.dv, 1));
    pc.first_block = n_blocks;
    pc.first_item = n_items;
    n_blocks += pc.blocks();
    n_items += pc.plan.items(p);
    pc.dmask_in_place = call.dmask != nullptr && mask_is_full(*call.dmask, p);
    delta_floats += pc.rows;
    partial_floats += (pc.plan.chunks - 1) * pc.rows * p.d;
    if (call.dmask != nullptr && !pc.dmask_in_place) dmask_floats += pc.rows * p.lk;
    if (call.dq.dtype != MHA_DTYPE_F32) dq_buffer_floats += pc.rows * p.d;
    // Half-precision dK and dV: an item's in the thread's scratch, after the
    // kernel's own.
    pc.dk_stage = call.dk.dtype != MHA_DTYPE_F32 ? pc.plan.chunk_len * p.d : 0;
    pc.dv_stage = call.dv.dtype != MHA_DTYPE_F32 ? pc.plan.chunk_len * p.dv : 0;
    pc.stage_offset = (plugin.backward_scratch_bytes(&call.problem) + 63) / 64 * 64;
    scratch_bytes =
        std::max(scratch_bytes,
                 pc.stage_offset + static_cast<size_t>(pc.dk_stage + pc.dv_stage) * sizeof(float));
    for (int64_t chunk = 0; chunk < pc.plan.chunks; ++chunk) {
      const int64_t kb = chunk * pc.plan.chunk_len;
      pc.chunk_pairs[chunk] = pairs_of_keys(p, kb, std::min(p.lk, kb + pc.plan.chunk_len));
    }
    flops += 10.0 * static_cast<double>(pc.rows) * static_cast<double>(p.lk) *
             static_cast<double>(p.d + p.dv) / 2.0;
  }

  auto delta = try_allocate<float>(delta_floats);
  auto partials = try_allocate<float>(partial_floats);
  auto dmask_full = try_allocate<float>(dmask_floats);
  auto dq_buffer = try_allocate<float>(dq_buffer_floats);
  // The items in the order they are handed out: the costliest first (under a
  // causal mask a sequence's first key chunks), so that a long sequence's
  // items start early and short ones fill in around them.  Which thread runs
  // an item never changes what it computes.
  std::vector<int64_t> order;
  std::vector<double> cost;
  try {
    order.resize(static_cast<size_t>(n_items));
    cost.resize(static_cast<size_t>(n_items));
  } catch (const std::bad_alloc&) {
    order.clear();
  }
  if (!delta || !partials || !dmask_full || !dq_buffer ||
      order.size() != static_cast<size_t>(n_items)) {
    return fail(MHA_ERR_OUT_OF_MEMORY,
                "cannot allocate %lld bytes for the backward pass's buffers; the outputs are "
                "untouched",
                static_cast<long long>(delta_floats + partial_floats + dmask_floats +
                                       dq_buffer_floats + n_items * 4) *
                    4);
  }
  {
    int64_t at_delta = 0, at_partials = 0, at_dmask = 0, at_dq = 0;
    for (PlannedBackward& pc : planned) {
      BackwardCall& call = *pc.call;
      const mha_kernel_problem& p = call.forward.problem;
      pc.delta = delta.get() + at_delta;
      pc.partials = partials.get() + at_partials;
      at_delta += pc.rows;
      at_partials += (pc.plan.chunks - 1) * pc.rows * p.d;
      if (call.dmask != nullptr && !pc.dmask_in_place) {
        pc.dmask_full = dmask_full.get() + at_dmask;
        at_dmask += pc.rows * p.lk;
      }
      float* buffer = nullptr;
      if (call.dq.dtype != MHA_DTYPE_F32) {
        buffer = dq_buffer.get() + at_dq;
        at_dq += pc.rows * p.d;
      }
      pc.dq = f32_view(call.dq, buffer);
      mha_backward_problem& bp = call.problem;
      bp.delta = pc.delta;
      bp.delta_strides[0] = p.heads * p.lq;
      bp.delta_strides[1] = p.lq;
      bp.delta_strides[2] = 1;
    }
  }
  for (const PlannedBackward& pc : planned) {
    const mha_kernel_problem& p = pc.call->forward.problem;
    const int64_t group = p.heads / p.kv_heads;
    for (int64_t local = 0; local < pc.plan.items(p); ++local) {
      const int64_t chunk = local / (p.batch * p.kv_heads);
      const auto at = static_cast<size_t>(pc.first_item + local);
      order[at] = pc.first_item + local;
      cost[at] = pc.chunk_pairs[chunk] * static_cast<double>(group);
    }
  }
  std::stable_sort(order.begin(), order.end(), [&cost](int64_t a, int64_t b) {
    return cost[static_cast<size_t>(a)] > cost[static_cast<size_t>(b)];
  });

  int32_t team = static_cast<int32_t>(std::min<int64_t>(threads, std::max<int64_t>(n_items, 1)));
  if (flops < kSerialFlops) team = 1;

  // Every thread's scratch first: a failure leaves the outputs untouched.
  auto prepare = [&](int32_t) {
    return thread_scratch(ScratchSlot::kKernel, scratch_bytes) != nullptr;
  };
  // 1. delta, zeroed dq (or its buffer) and partials.
  const bool scratch_ok = run_team(n_blocks, team, prepare, [&](int64_t block, int32_t) {
    const PlannedBackward& pc = holder(planned, block, &PlannedBackward::first_block);
    const mha_kernel_problem& p = pc.call->forward.problem;
    const int64_t first = (block - pc.first_block) * pc.per_row;
    const int64_t end = std::min(pc.rows, first + pc.per_row);
    for (int64_t row = first; row < end; ++row) {
      compute_delta(*pc.call, pc.delta, row);
      float* dq_at = pc.dq_row(row);
      for (int64_t x = 0; x < p.d; ++x) dq_at[x * pc.dq.strides[3]] = 0.0f;
      for (int64_t c = 1; c < pc.plan.chunks; ++c) {
        std::fill_n(pc.partials + ((c - 1) * pc.rows + row) * p.d, p.d, 0.0f);
      }
    }
  });
  if (!scratch_ok) {
    return fail(MHA_ERR_OUT_OF_MEMORY,
                "cannot allocate %zu bytes of kernel scratch per thread (or start the threads); "
                "the outputs are untouched",
                scratch_bytes);
  }

  // 2. The items.
  std::atomic<int> failed_code{0};
  run_team(n_items, team, prepare, [&](int64_t position, int32_t) {
    const int64_t index = order[static_cast<size_t>(position)];
    const PlannedBackward& pc = holder(planned, index, &PlannedBackward::first_item);
    void* scratch = thread_scratch(ScratchSlot::kKernel, scratch_bytes);
    int code = 0;
    if (!run_item(plugin, pc, index - pc.first_item, scratch, &code)) {
      int expected = 0;
      failed_code.compare_exchange_strong(expected, code);
    }
  });
  if (int code = failed_code.load(); code != 0) {
    return fail(MHA_ERR_INTERNAL,
                "backend %s's backward pass failed with code %d; the contents of dq, dk and dv "
                "are unspecified",
                backend.name.c_str(), code);
  }

  // 3. dq += the other chunks' shares, in chunk order; a half-precision dq
  // is that sum rounded once.
  run_team(
      n_blocks, team, [](int32_t) { return true; },
      [&](int64_t block, int32_t) {
        const PlannedBackward& pc = holder(planned, block, &PlannedBackward::first_block);
        const BackwardCall& call = *pc.call;
        const mha_kernel_problem& p = call.forward.problem;
        const bool dq_half = call.dq.dtype != MHA_DTYPE_F32;
        if (pc.plan.chunks == 1 && !dq_half) return;
        const int64_t first = (block - pc.first_block) * pc.per_row;
        const int64_t end = std::min(pc.rows, first + pc.per_row);
        for (int64_t row = first; row < end; ++row) {
          float* sum = pc.dq_row(row);
          for (int64_t c = 1; c < pc.plan.chunks; ++c) {
            const float* part = pc.partials + ((c - 1) * pc.rows + row) * p.d;
            for (int64_t x = 0; x < p.d; ++x) sum[x * pc.dq.strides[3]] += part[x];
          }
          if (dq_half) {
            const int64_t i = row % p.lq, bh = row / p.lq;
            round_rows(sum, 1, p.d, call.dq, row_offset(call.dq, bh / p.heads, bh % p.heads, i), 0);
          }
        }
      });
  // dsinks: every call's share, in call order (the calls share one tensor).
  if (count > 0 && calls[0].dsinks != nullptr) {
    const int64_t heads = calls[0].forward.problem.heads;
    std::vector<double> sums(static_cast<size_t>(heads), 0.0);
    for (const PlannedBackward& pc : planned) add_dsinks(*pc.call, pc.delta, sums.data());
    const mha_tensor& dsinks = *calls[0].dsinks;
    for (int64_t h = 0; h < heads; ++h) {
      static_cast<float*>(dsinks.data)[h * dsinks.strides[0]] =
          static_cast<float>(-sums[static_cast<size_t>(h)]);
    }
  }
  for (const PlannedBackward& pc : planned) {
    if (pc.dmask_full != nullptr) reduce_dmask(*pc.call, pc.dmask_full);
  }
  return MHA_OK;
}

}  // namespace

mha_status run_backward_calls(BackwardCall* calls, int64_t count, int64_t varlen_batch) {
  const char* why = nullptr;
  const Backend* backend = Registry::instance().selected(&why);
  if (backend == nullptr) return fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", why);
  if (backend->plugin->backward == nullptr || backend->plugin->backward_scratch_bytes == nullptr) {
    return fail(MHA_ERR_UNSUPPORTED, "backend %s has no backward pass", backend->name.c_str());
  }
  const int32_t threads = num_threads();
  const auto start = std::chrono::steady_clock::now();
  const mha_status status = run_backward(*backend, calls, count, threads);
  if (verbose_level() >= 2 && count > 0) {
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    // One call: its shape; a packed batch: its first sequence's heads and
    // sizes, with the batch's rows.
    const BackwardCall& call = calls[0];
    const mha_kernel_problem& p = call.forward.problem;
    int64_t chunks = 0, items = 0, lq = 0, lk = 0;
    for (int64_t c = 0; c < count; ++c) {
      const mha_kernel_problem& pc = calls[c].forward.problem;
      const BackwardPlan plan = plan_backward(pc);
      chunks = std::max(chunks, plan.chunks);
      items += plan.items(pc);
      lq += pc.lq;
      lk += pc.lk;
    }
    const long long batch = varlen_batch >= 0 ? varlen_batch : static_cast<long long>(p.batch);
    std::fprintf(stderr,
                 "mha_verbose,exec,%s,backend=%s,B=%lld,H=%lld,Hkv=%lld,%s=%lld,%s=%lld,D=%lld,"
                 "Dv=%lld,q=%s,kv=%s,out=%s,dout=%s,dq=%s,dk=%s,dv=%s,variants=%s,chunks=%lld,"
                 "items=%lld,threads=%d,ms=%.4f\n",
                 varlen_batch >= 0 ? "attention_varlen_backward" : "attention_backward",
                 backend->name.c_str(), batch, static_cast<long long>(p.heads),
                 static_cast<long long>(p.kv_heads), varlen_batch >= 0 ? "total_q" : "Lq",
                 static_cast<long long>(lq), varlen_batch >= 0 ? "keys" : "Lk",
                 static_cast<long long>(lk), static_cast<long long>(p.d),
                 static_cast<long long>(p.dv), dtype_name(p.q_dtype), dtype_name(p.kv_dtype),
                 dtype_name(call.out->dtype), dtype_name(call.dout->dtype),
                 dtype_name(call.dq.dtype), dtype_name(call.dk.dtype), dtype_name(call.dv.dtype),
                 variants_of(call.forward).c_str(), static_cast<long long>(chunks),
                 static_cast<long long>(items), threads, ms);
  }
  return status;
}

mha_status attention_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                              const mha_tensor* out, const mha_tensor* lse, const mha_tensor* dout,
                              mha_tensor* dq, mha_tensor* dk, mha_tensor* dv,
                              const mha_attention_params* params,
                              const mha_backward_params* backward) {
  BackwardCall call{};
  if (mha_status s =
          validate_backward(q, k, v, out, lse, dout, dq, dk, dv, params, backward, &call);
      s != MHA_OK) {
    return s;
  }
  return run_backward_calls(&call, 1, -1);
}

}  // namespace mha::rt
