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

// A validated backward call.
struct BackwardCall {
  KernelCall forward;  // the forward's problem (and its out, as a tensor below)
  mha_backward_problem problem;
  const mha_tensor* out;
  const mha_tensor* dout;
  mha_tensor dq, dk, dv;
  const mha_tensor* dsinks;  // nullptr: not wanted
  const mha_tensor* dmask;
  const mha_tensor* mask;
};

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

mha_status check_same_shape(const mha_tensor& t, const char* name, const mha_tensor& like,
                            const char* like_name) {
  for (int32_t axis = 0; axis < 4; ++axis) {
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

  if (extra.dsinks != nullptr) {
    if (given.sinks == nullptr) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "backward->dsinks is given but params->sinks is NULL: there is no sink to "
                  "differentiate");
    }
    if (mha_status s = check_tensor(extra.dsinks, "backward->dsinks", 1, 1); s != MHA_OK) return s;
    if (mha_status s = check_f32(extra.dsinks, "backward->dsinks"); s != MHA_OK) return s;
    if (mha_status s = check_shape_equal("heads", "q", q->shape[1], "backward->dsinks",
                                         extra.dsinks->shape[0]);
        s != MHA_OK) {
      return s;
    }
  }
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

// Offset of element [b, h, i, 0] of a 4-d tensor.
int64_t row_offset(const mha_tensor& t, int64_t b, int64_t h, int64_t i) {
  return b * t.strides[0] + h * t.strides[1] + i * t.strides[2];
}

// delta[b, h, i] = Σ_x dO[b, h, i, x] · O[b, h, i, x], in fp32 from the
// widened values (exact: a half is an fp32), x ascending.
void compute_delta(const BackwardCall& call, float* delta, int64_t row) {
  const mha_kernel_problem& p = call.forward.problem;
  const int64_t i = row % p.lq;
  const int64_t bh = row / p.lq;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const mha_tensor &out = *call.out, &dout = *call.dout;
  const int64_t o = row_offset(out, b, h, i), g = row_offset(dout, b, h, i);
  float sum = 0.0f;
  for (int64_t x = 0; x < p.dv; ++x) {
    sum += mha_types::load_float(out.data, out.dtype, o + x * out.strides[3]) *
           mha_types::load_float(dout.data, dout.dtype, g + x * dout.strides[3]);
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
    for (int64_t x = 0; x < cols; ++x) {
      mha_types::store_float(dst.data, dst.dtype, at + r * row_stride + x * dst.strides[3],
                             src[r * cols + x]);
    }
  }
}

// dsinks[h] = -Σ_{b, i} e^(sink_h - lse[b, h, i]) · delta[b, h, i], b then i
// ascending, in float64 (the sink's weight in each row times the row's delta).
void compute_dsinks(const BackwardCall& call, const float* delta) {
  const mha_kernel_problem& p = call.forward.problem;
  const mha_backward_problem& bp = call.problem;
  auto* dsinks = static_cast<float*>(call.dsinks->data);
  for (int64_t h = 0; h < p.heads; ++h) {
    const double sink = static_cast<double>(p.sinks[h * p.sinks_stride]);
    double sum = 0.0;
    if (sink != -std::numeric_limits<double>::infinity()) {
      for (int64_t b = 0; b < p.batch; ++b) {
        for (int64_t i = 0; i < p.lq; ++i) {
          const double lse = static_cast<double>(
              bp.lse[b * bp.lse_strides[0] + h * bp.lse_strides[1] + i * bp.lse_strides[2]]);
          sum += std::exp(sink - lse) * static_cast<double>(delta[(b * p.heads + h) * p.lq + i]);
        }
      }
    }
    dsinks[h * call.dsinks->strides[0]] = static_cast<float>(-sum);
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

mha_status run_backward(const Backend& backend, BackwardCall& call, int32_t threads) {
  const mha_plugin& plugin = *backend.plugin;
  mha_kernel_problem& p = call.forward.problem;
  p.layout = MHA_LAYOUT_QUERY_LANES;
  mha_backward_problem& bp = call.problem;
  bp.forward = &p;
  const BackwardPlan plan = plan_backward(p);
  const int64_t rows = p.batch * p.heads * p.lq;
  const int64_t dq_floats = rows * p.d;
  const bool dmask_in_place = call.dmask != nullptr && mask_is_full(*call.dmask, p);
  const int64_t dmask_floats = call.dmask != nullptr && !dmask_in_place ? rows * p.lk : 0;
  // Half-precision gradients: dQ accumulated in an fp32 buffer; an item's
  // dK and dV in the thread's scratch, after the kernel's own.
  const bool dq_half = call.dq.dtype != MHA_DTYPE_F32;
  const int64_t dk_stage = call.dk.dtype != MHA_DTYPE_F32 ? plan.chunk_len * p.d : 0;
  const int64_t dv_stage = call.dv.dtype != MHA_DTYPE_F32 ? plan.chunk_len * p.dv : 0;

  auto delta = try_allocate<float>(rows);
  auto partials = try_allocate<float>((plan.chunks - 1) * dq_floats);
  auto dmask_full = try_allocate<float>(dmask_floats);
  auto dq_buffer = try_allocate<float>(dq_half ? dq_floats : 0);
  const size_t kernel_bytes = plugin.backward_scratch_bytes(&bp);
  const size_t stage_offset = (kernel_bytes + 63) / 64 * 64;  // 64-byte aligned floats
  const size_t scratch_bytes =
      stage_offset + static_cast<size_t>(dk_stage + dv_stage) * sizeof(float);
  if (!delta || !partials || !dmask_full || !dq_buffer) {
    return fail(MHA_ERR_OUT_OF_MEMORY,
                "cannot allocate %lld bytes for the backward pass's buffers; the outputs are "
                "untouched",
                static_cast<long long>(rows + (plan.chunks - 1) * dq_floats + dmask_floats +
                                       (dq_half ? dq_floats : 0)) *
                    4);
  }
  bp.delta = delta.get();
  bp.delta_strides[0] = p.heads * p.lq;
  bp.delta_strides[1] = p.lq;
  bp.delta_strides[2] = 1;
  // Where the kernels add dQ: dq itself, or its fp32 buffer.
  const F32View dq = f32_view(call.dq, dq_buffer.get());
  const auto dq_row = [&](int64_t row) {
    const int64_t i = row % p.lq, bh = row / p.lq;
    return dq.data + (bh / p.heads) * dq.strides[0] + (bh % p.heads) * dq.strides[1] +
           i * dq.strides[2];
  };

  const double flops = 10.0 * static_cast<double>(rows) * static_cast<double>(p.lk) *
                       static_cast<double>(p.d + p.dv) / 2.0;
  const int64_t n_items = plan.items(p);
  int32_t team = static_cast<int32_t>(std::min<int64_t>(threads, std::max<int64_t>(n_items, 1)));
  if (flops < kSerialFlops) team = 1;

  // Every thread's scratch first: a failure leaves the outputs untouched.
  bool scratch_ok = true;
  auto prepare = [&](int32_t) {
    return thread_scratch(ScratchSlot::kKernel, scratch_bytes) != nullptr;
  };
  // 1. delta, zeroed dq (or its buffer) and partials.
  const int64_t per_row = std::max<int64_t>(1, 65536 / std::max<int64_t>(p.dv, 1));
  const int64_t row_blocks = ceil_div(rows, per_row);
  scratch_ok = run_team(row_blocks, team, prepare, [&](int64_t block, int32_t) {
    const int64_t end = std::min(rows, (block + 1) * per_row);
    for (int64_t row = block * per_row; row < end; ++row) {
      compute_delta(call, delta.get(), row);
      float* dq_at = dq_row(row);
      for (int64_t x = 0; x < p.d; ++x) dq_at[x * dq.strides[3]] = 0.0f;
      for (int64_t c = 1; c < plan.chunks; ++c) {
        std::fill_n(partials.get() + (c - 1) * dq_floats + row * p.d, p.d, 0.0f);
      }
    }
  });
  if (!scratch_ok) {
    return fail(MHA_ERR_OUT_OF_MEMORY,
                "cannot allocate %zu bytes of kernel scratch per thread (or start the threads); "
                "the outputs are untouched",
                scratch_bytes);
  }

  // 2. The items: (chunk, batch, KV head), the first chunks (under a causal
  // mask the costliest) first.
  const int64_t group = p.heads / p.kv_heads;
  std::atomic<int> failed_code{0};
  run_team(n_items, team, prepare, [&](int64_t index, int32_t) {
    const int64_t chunk = index / (p.batch * p.kv_heads);
    const int64_t b = (index / p.kv_heads) % p.batch;
    const int64_t kvh = index % p.kv_heads;
    mha_backward_item item{};
    item.b = b;
    item.kv_head = kvh;
    item.k_begin = chunk * plan.chunk_len;
    item.k_end = std::min(p.lk, item.k_begin + plan.chunk_len);
    const int64_t h0 = kvh * group;
    if (chunk == 0) {
      item.dq = dq.data + b * dq.strides[0] + h0 * dq.strides[1];
      item.dq_strides[0] = dq.strides[1];
      item.dq_strides[1] = dq.strides[2];
      item.dq_strides[2] = dq.strides[3];
    } else {
      item.dq = partials.get() + (chunk - 1) * dq_floats + (b * p.heads + h0) * p.lq * p.d;
      item.dq_strides[0] = p.lq * p.d;
      item.dq_strides[1] = p.d;
      item.dq_strides[2] = 1;
    }
    void* scratch = thread_scratch(ScratchSlot::kKernel, scratch_bytes);
    float* stage = reinterpret_cast<float*>(static_cast<char*>(scratch) + stage_offset);
    const int64_t dk_at =
        b * call.dk.strides[0] + kvh * call.dk.strides[1] + item.k_begin * call.dk.strides[2];
    const int64_t dv_at =
        b * call.dv.strides[0] + kvh * call.dv.strides[1] + item.k_begin * call.dv.strides[2];
    if (dk_stage > 0) {
      item.dk = stage;
      item.dk_strides[0] = p.d;
      item.dk_strides[1] = 1;
    } else {
      item.dk = static_cast<float*>(call.dk.data) + dk_at;
      item.dk_strides[0] = call.dk.strides[2];
      item.dk_strides[1] = call.dk.strides[3];
    }
    if (dv_stage > 0) {
      item.dv = stage + dk_stage;
      item.dv_strides[0] = p.dv;
      item.dv_strides[1] = 1;
    } else {
      item.dv = static_cast<float*>(call.dv.data) + dv_at;
      item.dv_strides[0] = call.dv.strides[2];
      item.dv_strides[1] = call.dv.strides[3];
    }
    if (dmask_in_place) {
      const mha_tensor& m = *call.dmask;
      item.dmask = static_cast<float*>(m.data) + b * m.strides[0] + h0 * m.strides[1] +
                   item.k_begin * m.strides[3];
      item.dmask_strides[0] = m.strides[1];
      item.dmask_strides[1] = m.strides[2];
      item.dmask_strides[2] = m.strides[3];
    } else if (call.dmask != nullptr) {
      item.dmask = dmask_full.get() + (b * p.heads + h0) * p.lq * p.lk + item.k_begin;
      item.dmask_strides[0] = p.lq * p.lk;
      item.dmask_strides[1] = p.lk;
      item.dmask_strides[2] = 1;
    }
    if (int code = plugin.backward(&bp, &item, scratch); code != 0) {
      int expected = 0;
      failed_code.compare_exchange_strong(expected, code);
      return;
    }
    // The item owns dK and dV of its keys: they are final, round them now.
    const int64_t keys = item.k_end - item.k_begin;
    if (dk_stage > 0) round_rows(item.dk, keys, p.d, call.dk, dk_at, call.dk.strides[2]);
    if (dv_stage > 0) round_rows(item.dv, keys, p.dv, call.dv, dv_at, call.dv.strides[2]);
  });
  if (int code = failed_code.load(); code != 0) {
    return fail(MHA_ERR_INTERNAL,
                "backend %s's backward pass failed with code %d; the contents of dq, dk and dv "
                "are unspecified",
                backend.name.c_str(), code);
  }

  // 3. dq += the other chunks' shares, in chunk order; a half-precision dq
  // is that sum rounded once.
  if (plan.chunks > 1 || dq_half) {
    run_team(
        row_blocks, team, [](int32_t) { return true; },
        [&](int64_t block, int32_t) {
          const int64_t end = std::min(rows, (block + 1) * per_row);
          for (int64_t row = block * per_row; row < end; ++row) {
            float* sum = dq_row(row);
            for (int64_t c = 1; c < plan.chunks; ++c) {
              const float* part = partials.get() + (c - 1) * dq_floats + row * p.d;
              for (int64_t x = 0; x < p.d; ++x) sum[x * dq.strides[3]] += part[x];
            }
            if (dq_half) {
              const int64_t i = row % p.lq, bh = row / p.lq;
              round_rows(sum, 1, p.d, call.dq, row_offset(call.dq, bh / p.heads, bh % p.heads, i),
                         0);
            }
          }
        });
  }
  if (call.dsinks != nullptr) compute_dsinks(call, delta.get());
  if (dmask_floats > 0) reduce_dmask(call, dmask_full.get());
  return MHA_OK;
}

}  // namespace

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
  const char* why = nullptr;
  const Backend* backend = Registry::instance().selected(&why);
  if (backend == nullptr) return fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", why);
  if (backend->plugin->backward == nullptr || backend->plugin->backward_scratch_bytes == nullptr) {
    return fail(MHA_ERR_UNSUPPORTED, "backend %s has no backward pass", backend->name.c_str());
  }
  const int32_t threads = num_threads();
  const auto start = std::chrono::steady_clock::now();
  const mha_status status = run_backward(*backend, call, threads);
  if (verbose_level() >= 2) {
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const mha_kernel_problem& p = call.forward.problem;
    const BackwardPlan plan = plan_backward(p);
    std::fprintf(stderr,
                 "mha_verbose,exec,attention_backward,backend=%s,B=%lld,H=%lld,Hkv=%lld,Lq=%lld,"
                 "Lk=%lld,D=%lld,Dv=%lld,q=%s,kv=%s,out=%s,dout=%s,dq=%s,dk=%s,dv=%s,variants=%s,"
                 "chunks=%lld,items=%lld,threads=%d,ms=%.4f\n",
                 backend->name.c_str(), static_cast<long long>(p.batch),
                 static_cast<long long>(p.heads), static_cast<long long>(p.kv_heads),
                 static_cast<long long>(p.lq), static_cast<long long>(p.lk),
                 static_cast<long long>(p.d), static_cast<long long>(p.dv), dtype_name(p.q_dtype),
                 dtype_name(p.kv_dtype), dtype_name(call.out->dtype), dtype_name(call.dout->dtype),
                 dtype_name(call.dq.dtype), dtype_name(call.dk.dtype), dtype_name(call.dv.dtype),
                 variants_of(call.forward).c_str(), static_cast<long long>(plan.chunks),
                 static_cast<long long>(plan.items(p)), threads, ms);
  }
  return status;
}

}  // namespace mha::rt
