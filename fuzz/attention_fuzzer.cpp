// libFuzzer target over the C API.
//
// The fuzzer's bytes choose a problem -- shapes (dims up to 9, head sizes up to
// 40, and sometimes a key range long enough for split-KV), memory layouts
// ([B,H,L,D], [B,L,H,D], others, padded rows, zero strides that broadcast an
// input, arbitrary strides on dimensions of size 1), a mask (bool, or additive
// with -inf, NaN, +inf, ±1e4), valid lengths (per batch or per query, i32 or
// i64, sometimes out of range), the causal mode, the scale, a sliding window,
// a softcap, sinks and ALiBi slopes, whether the LSE is wanted, the backend
// and the thread count -- and the data, with NaN, ±Inf,
// zeros and subnormals planted anywhere (row padding included).  Some inputs
// then break the call in one way that must be refused (stride-0 giants among
// them: a head size or key length past the limits); some split the keys
// into parts and merge them with mha_merge_partials.
//
// A call that must be valid has to succeed and match the float64 reference
// within mha_test::tolerance (NaN where the reference has NaN, the same
// infinities), write nothing but out and lse, and leave the inputs alone.  A
// call that must be refused has to return an error and leave every buffer as
// it was.  Anything else aborts with a description of the case.
//
// Bytes left over after that case choose a packed variable-length batch
// (mha_attention_varlen): B sequences of random query and key lengths (0
// included, sometimes long enough for several key tiles or split-KV), packed
// token-major or head-major with padded rows, Q in f32/bf16/f16, K and V in
// those or int8 (row scales [total_k, Hkv]), the causal mode, scale, window,
// softcap, sinks, ALiBi [H] or [B, H], the LSE [H, total_q], specials in the
// data -- each sequence checked against the reference on that sequence alone,
// a sequence without keys against zeros and its sink -- or broken in one way
// (offsets that do not start at 0, decrease, miss the total or disagree on B;
// wrong dtypes or ranks; valid_lens or a mask; a NULL or unversioned varlen;
// overlapping outputs; missing int8 scales ...) that must be refused with
// nothing written.  (Read after the first case, so that the corpus's earlier
// entries keep their meaning.)
//
// Bytes left over after the packed batch choose a paged KV cache (read last,
// likewise).  First mha_kv_cache_write: T tokens' K and V rows ([T, Hkv, D]
// and [T, Hkv, Dv], f32/bf16/f16, specials sometimes) through a slot mapping
// (i32 or i64, -1 and other negatives as padding) into caches [num_blocks,
// block_size, Hkv, D / Dv] of f32/bf16/f16/i8 (i8: scales [num_blocks,
// block_size, Hkv]), token- or head-major within a block, rows padded: the
// written rows must hold the converted values (f32 exactly, bf16/f16 rounded
// to nearest even, i8 within half a step of scale = max|row| / 127), every
// other byte its old value, the inputs theirs.  An i8 cache refuses a row with
// NaN or an infinity; other breakages to refuse with nothing written:
// duplicate slots, a slot past the cache, a block size not a multiple of 8,
// dtypes or shapes that disagree, scales missing (i8) or given (float), caches
// that overlap each other or an input.  Then mha_attention_varlen over the
// cache: B sequences of seqused_k keys (0 to several hundred, sometimes over
// a thousand: several decode tiles, split-KV) in blocks of 8/16/24/32 taken
// in shuffled order, sometimes a prefix shared by two sequences; spare blocks
// and unused rows hold NaN and the table's unused entries garbage (-1, huge),
// so a kernel that reads them shows; 0..3 queries per sequence (decoding) or
// up to 70 (chunked prefill), the causal mode (often bottom-right), window,
// softcap, sinks, ALiBi [H] or [B, H], the LSE.  Each sequence is checked
// against the reference on its keys gathered densely from the cache (in the
// cache's dtype, i8 with its scales), a sequence without keys against zeros
// and its sink -- or the call is broken in one way (a used block id out of
// range or negative, seqused_k negative or past max_blocks · block_size,
// cu_seqlens_k with a table, seqused_k missing or of another B, a table of
// the wrong dtype, rank or B or with non-contiguous rows, k or v of rank 3,
// scales of the packed layout, out over the cache ...) and must be refused
// with nothing written.
//
// Bytes left over after that: mha_attention_backward (run_backward_case), its
// gradients against the float64 backward reference, or a broken call refused
// with the gradients untouched.
//
// Bytes left over after that: mha_module_backward (run_module_backward_case):
// any feature sizes, self-attention and key = value (summed gradients),
// either layout, every mask and variant, a random subset of the gradients --
// against the module's float64 backward reference, or a broken call refused
// with every gradient untouched.
//
// Bytes left over after that: a call as a block of a larger problem
// (run_block_case): offsets and full lengths that fit or do not, with the
// rules of positions, against the reference of that block.
//
// Bytes left over after that: mha_positional_encoding_add in place
// (run_positional_case), any axis order and padding, against the encoding in
// double, or a broken tensor refused with nothing written.
//
// Bytes left over after that: mha_module_forward (run_module_forward_case):
// the module drawn as for its backward case, the output in either layout, the
// attention weights per head, averaged or not wanted -- against the module's
// float64 reference within its error bounds, or a broken call (shapes,
// dtypes, overlaps, bad parameters, NULLs) refused with nothing written.
#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "module_reference.h"
#include "module_reference_backward.h"
#include "reference.h"
#include "reference_backward.h"
#include "test_util.h"

namespace {

using mha_test::Reference;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kInfD = std::numeric_limits<double>::infinity();
constexpr int64_t kGuard = 16;  // sentinel floats on either side of out and lse

std::string g_case;  // a description of the current case, for reports

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "\n==== attention_fuzzer finding: %s\n     case: %s\n", what.c_str(),
               g_case.c_str());
  std::fflush(stderr);
  std::abort();
}

// MHA_FUZZ_TRACE set: each case's description on stderr as it is drawn, one
// line per case -- which cases an input reaches (how the seeds of a new case
// are chosen), and what a case was when a sanitizer stops it halfway (its
// report cannot print g_case: libFuzzer keeps the death callback).
bool tracing() {
  static const bool on = std::getenv("MHA_FUZZ_TRACE") != nullptr;
  return on;
}

// Starts the description of a case.
void begin_case(const std::string& text) {
  g_case = text;
  if (tracing()) std::fprintf(stderr, "case: %s", text.c_str());
}

// Ends a case's line in the trace.
void end_case() {
  if (tracing()) std::fprintf(stderr, "\n");
}

// Appends to the description of the current case.
__attribute__((format(printf, 1, 2))) void note(const char* format, ...) {
  char text[200];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  g_case += text;
  if (tracing()) std::fprintf(stderr, "%s", text);
}

// ------------------------------------------------------------------ layouts

// Memory orders of a 4-D tensor, outermost axis first.
constexpr int kOrders[][4] = {
    {0, 1, 2, 3},  // [B, H, L, D]
    {0, 2, 1, 3},  // [B, L, H, D]: the projections' natural layout
    {2, 0, 1, 3},  // [L, B, H, D]
    {1, 0, 2, 3},  // [H, B, L, D]
    {0, 1, 3, 2},  // [B, H, D, L]: features outer (a transposed K)
};
constexpr int kOrderCount = sizeof kOrders / sizeof kOrders[0];

struct Layout {
  int64_t shape[4] = {1, 1, 1, 1};
  int64_t strides[4] = {0, 0, 0, 0};
  int64_t extent = 1;  // elements from the first to one past the last reachable
};

// Strides for `shape` in memory order `order`, each innermost run followed by
// `pad` unused elements; `zero` axes get stride 0 (inputs only); size-1 axes
// may get an arbitrary stride, which is never stepped along.
Layout make_layout(const int64_t shape[4], int order, int64_t pad, unsigned zero_mask,
                   bool odd_unit_strides) {
  Layout l;
  int64_t running = 1;
  for (int n = 3; n >= 0; --n) {
    const int axis = kOrders[order][n];
    l.shape[axis] = shape[axis];
    l.strides[axis] = running;
    running *= shape[axis] + (n == 3 ? pad : 0);
  }
  for (int axis = 0; axis < 4; ++axis) {
    if (zero_mask & (1u << axis)) l.strides[axis] = 0;
    if (odd_unit_strides && shape[axis] == 1) l.strides[axis] = int64_t{1} << 40;
  }
  l.extent = 1;
  for (int axis = 0; axis < 4; ++axis) {
    if (shape[axis] > 1) l.extent += (shape[axis] - 1) * l.strides[axis];
  }
  return l;
}

mha_tensor describe4(void* data, mha_dtype dtype, const Layout& l) {
  return mha_test::describe(data, dtype, {l.shape[0], l.shape[1], l.shape[2], l.shape[3]},
                            {l.strides[0], l.strides[1], l.strides[2], l.strides[3]});
}

// ------------------------------------------------------------------ the backend

const std::vector<std::string>& usable_backends() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> list;
    // The backend queries take an index only: each index, in range or not,
    // once per process (mha_backend_get_decode_streams: >= 1 for a usable
    // backend, 0 otherwise; mha_backend_get_tiles: positive prefill tiles for
    // a usable backend, all 0 otherwise; both an error naming the index
    // outside the range, their output untouched).
    const int32_t count = mha_backend_count();
    for (int32_t i = -1; i <= count; ++i) {
      int32_t streams = -7;
      mha_backend_info info{};
      const bool in_range = i >= 0 && i < count;
      const mha_status status = mha_backend_get_decode_streams(i, &streams);
      const bool usable = in_range && mha_backend_get_info(i, &info) == MHA_OK && info.usable != 0;
      if (in_range ? status != MHA_OK || (usable ? streams < 1 : streams != 0)
                   : status != MHA_ERR_INVALID_VALUE || streams != -7) {
        finding("mha_backend_get_decode_streams(" + std::to_string(i) + ") gave status " +
                std::to_string(status) + ", streams " + std::to_string(streams));
      }
      mha_backend_tiles tiles{-7, -7, -7};
      const mha_status tiles_status = mha_backend_get_tiles(i, &tiles);
      const bool all_zero =
          tiles.query_tile == 0 && tiles.key_tile == 0 && tiles.decode_key_tile == 0;
      const bool untouched =
          tiles.query_tile == -7 && tiles.key_tile == -7 && tiles.decode_key_tile == -7;
      const bool chosen = tiles.query_tile > 0 && tiles.key_tile > 0 && tiles.decode_key_tile >= 0;
      bool tiles_right = tiles_status == MHA_OK && (usable ? chosen : all_zero);
      if (!in_range) tiles_right = tiles_status == MHA_ERR_INVALID_VALUE && untouched;
      if (!tiles_right) {
        finding("mha_backend_get_tiles(" + std::to_string(i) + ") gave status " +
                std::to_string(tiles_status) + ", tiles " + std::to_string(tiles.query_tile) +
                " x " + std::to_string(tiles.key_tile) + ", decode " +
                std::to_string(tiles.decode_key_tile));
      }
    }
    for (const auto& b : mha_test::list_backends()) {
      if (b.usable) list.push_back(b.name);
    }
    if (list.empty()) {
      std::fprintf(stderr, "attention_fuzzer: no usable backend\n");
      std::abort();
    }
    return list;
  }();
  return names;
}

void use_backend(const std::string& name) {
  static std::string current;
  if (name == current) return;  // every selection is kept by the runtime: select only changes
  if (mha_select_backend(name.c_str()) != MHA_OK) {
    finding("mha_select_backend(\"" + name + "\") failed: " + mha_last_error());
  }
  current = name;
}

// ------------------------------------------------------------------ values

float special_value(uint8_t which) {
  static const float kSpecials[] = {
      kNaN,   kInf,    -kInf, 0.0f,  -0.0f,
      1e-40f, -3e-39f, 1e3f,  -1e3f, std::numeric_limits<float>::min()};
  return kSpecials[which % (sizeof kSpecials / sizeof kSpecials[0])];
}

bool is_subnormal(float x) {
  return x != 0.0f && std::fabs(x) < std::numeric_limits<float>::min();
}

// ------------------------------------------------------------------ comparisons

bool same_value(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= tol;
}

// Compares out (any strides) and lse with the reference.  `lenient_inf`: v
// holds infinities and the logits are large, so a weight that is tiny in
// float64 may be 0 in fp32, and 0 * inf makes NaN where the reference has an
// infinity (or the reverse): non-finite disagreements are then accepted.
void compare(const mha_tensor& out, const float* lse, const int64_t lse_strides[3],
             const Reference& ref, bool lenient_inf, double tol) {
  const int64_t B = ref.batch, H = ref.heads, Lq = ref.lq, Dv = ref.dv;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i) {
        const size_t row = static_cast<size_t>((b * H + h) * Lq + i);
        const bool dead = ref.lse[row] == -kInfD;
        for (int64_t c = 0; c < Dv; ++c) {
          const float got =
              static_cast<const float*>(out.data)[b * out.strides[0] + h * out.strides[1] +
                                                  i * out.strides[2] + c * out.strides[3]];
          const double want = ref.out[row * static_cast<size_t>(Dv) + static_cast<size_t>(c)];
          if (dead && got != 0.0f) {
            char text[200];
            std::snprintf(text, sizeof text,
                          "out[%lld,%lld,%lld,%lld] = %g in a row no key takes part in "
                          "(must be 0)",
                          static_cast<long long>(b), static_cast<long long>(h),
                          static_cast<long long>(i), static_cast<long long>(c),
                          static_cast<double>(got));
            finding(text);
          }
          if (lenient_inf && (!std::isfinite(want) || !std::isfinite(got))) continue;
          if (!same_value(static_cast<double>(got), want, tol)) {
            char text[240];
            std::snprintf(text, sizeof text,
                          "out[%lld,%lld,%lld,%lld] = %.9g, reference %.9g (tolerance %.3g, "
                          "max |logit| %.3g)",
                          static_cast<long long>(b), static_cast<long long>(h),
                          static_cast<long long>(i), static_cast<long long>(c),
                          static_cast<double>(got), want, tol, ref.max_abs_logit);
            finding(text);
          }
        }
        if (lse != nullptr) {
          const double got = static_cast<double>(
              lse[b * lse_strides[0] + h * lse_strides[1] + i * lse_strides[2]]);
          const double want = ref.lse[row];
          const double lse_tol = mha_test::lse_tolerance(ref, want);
          if (!same_value(got, want, lse_tol)) {
            char text[200];
            std::snprintf(text, sizeof text, "lse[%lld,%lld,%lld] = %.9g, reference %.9g",
                          static_cast<long long>(b), static_cast<long long>(h),
                          static_cast<long long>(i), got, want);
            finding(text);
          }
        }
      }
}

// A float buffer with sentinel guards around `payload` elements.
struct Guarded {
  std::vector<float> all;
  explicit Guarded(int64_t payload)
      : all(static_cast<size_t>(payload + 2 * kGuard), mha_test::Arena::sentinel()) {}
  float* base() { return all.data() + kGuard; }
};

// Elements of `g` that `t` does not reach and that changed since `before`.
// The bits of a float (NaN payloads and -0 included).
uint32_t bits_of(float x) {
  uint32_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// (Bytes: t may be a half-precision tensor in the guarded floats.)
int64_t changed_outside(const Guarded& g, const mha_tensor& t, const std::vector<float>& before) {
  return mha_test::changed_bytes_outside(g.all.data(), before.data(), g.all.size() * sizeof(float),
                                         t);
}

template <typename T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// The contract of a call's outputs, for a case named by `prefix` ("" or
// "varlen: "): a refused call says why and leaves out and lse as they were;
// an accepted one writes nothing outside them, and lse only when asked for.
// Returns whether the results are to be checked (the call was expected to
// be accepted).
bool outputs_keep_contract(const std::string& prefix, mha_status status, const std::string& message,
                           bool expect_invalid, const Guarded& out_buf, const mha_tensor& out,
                           const std::vector<float>& out_before, const Guarded& lse_buf,
                           const mha_tensor& lse, const std::vector<float>& lse_before,
                           bool want_lse) {
  if (expect_invalid) {
    if (status == MHA_OK) finding(prefix + "an invalid call was accepted");
    if (message.empty()) finding(prefix + "a refused call left no message");
    if (!same_bytes(out_buf.all, out_before)) finding(prefix + "a refused call modified out");
    if (!same_bytes(lse_buf.all, lse_before)) finding(prefix + "a refused call modified lse");
    return false;
  }
  if (status != MHA_OK) finding(prefix + "a valid call failed: " + message);
  if (changed_outside(out_buf, out, out_before) != 0) finding(prefix + "written outside out");
  if (want_lse && changed_outside(lse_buf, lse, lse_before) != 0) {
    finding(prefix + "written outside lse");
  }
  if (!want_lse && !same_bytes(lse_buf.all, lse_before)) {
    finding(prefix + "lse written though not wanted");
  }
  return true;
}

// ------------------------------------------------------------------ one case

// The start of every case: the backend and the thread count, drawn in the
// same order everywhere (older corpus entries keep their meaning); g_case
// names them after `kind`.
std::string start_case(FuzzedDataProvider& fdp, const char* kind) {
  const auto& backends = usable_backends();
  const std::string& backend = backends[fdp.ConsumeIntegral<uint8_t>() % backends.size()];
  const int32_t threads = fdp.ConsumeIntegralInRange<int32_t>(1, 4);
  use_backend(backend);
  if (mha_set_num_threads(threads) != MHA_OK) finding("mha_set_num_threads failed");
  begin_case(std::string(kind) + "backend " + backend);
  note(" threads %d", threads);
  return backend;
}

int run_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "");

  // ---- shapes
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int length_kind = fdp.ConsumeIntegralInRange<int>(0, 15);
  int64_t Lq = fdp.ConsumeIntegralInRange<int64_t>(1, 9);
  int64_t Lk = fdp.ConsumeIntegralInRange<int64_t>(1, 9);
  if (length_kind >= 10) Lk = fdp.ConsumeIntegralInRange<int64_t>(10, 140);  // several key tiles
  if (length_kind == 15) {  // long enough for the runtime to split the keys (split-KV)
    Lk = fdp.ConsumeIntegralInRange<int64_t>(1024, 1300);
    Lq = std::min<int64_t>(Lq, 3);
  }
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  note(" B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(Hkv), static_cast<long long>(Lq),
       static_cast<long long>(Lk), static_cast<long long>(D), static_cast<long long>(Dv));

  // mode 0: one call; 1: the keys split into parts, merged by mha_merge_partials
  const bool merge_mode = fdp.ConsumeIntegralInRange<int>(0, 7) == 0 && Lk >= 2;

  // ---- layouts
  const int64_t q_shape[4] = {B, H, Lq, D}, k_shape[4] = {B, Hkv, Lk, D},
                v_shape[4] = {B, Hkv, Lk, Dv}, o_shape[4] = {B, H, Lq, Dv};
  auto input_layout = [&](const int64_t shape[4], const char* name) {
    const int order = fdp.ConsumeIntegralInRange<int>(0, kOrderCount - 1);
    const int64_t pad = fdp.ConsumeIntegralInRange<int64_t>(0, 3);
    // Zero strides broadcast an input: rarely, and never the sequence axis of
    // k and v in merge mode (the parts are slices along it).
    unsigned zero =
        fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? fdp.ConsumeIntegral<uint8_t>() & 15u : 0u;
    if (merge_mode) zero &= ~4u;
    const bool odd = fdp.ConsumeBool();
    note(" %s(order %d pad %lld zero-strides %x%s)", name, order, static_cast<long long>(pad), zero,
         odd ? " odd-unit-strides" : "");
    return make_layout(shape, order, pad, zero, odd);
  };
  const Layout lq_layout = input_layout(q_shape, "q");
  const Layout lk_layout = input_layout(k_shape, "k");
  const Layout lv_layout = input_layout(v_shape, "v");
  const int out_order = fdp.ConsumeIntegralInRange<int>(0, kOrderCount - 1);
  const int64_t out_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  const Layout lo_layout = make_layout(o_shape, out_order, out_pad, 0u, fdp.ConsumeBool());
  note(" out(order %d pad %lld)", out_order, static_cast<long long>(out_pad));

  // ---- data
  mha_test::Rng rng(fdp.ConsumeIntegral<uint64_t>());
  static const float kAmps[] = {0.5f, 1.0f, 3.0f, 30.0f};
  const float qk_amp = kAmps[fdp.ConsumeIntegralInRange<int>(0, 3)];
  std::vector<float> qb(static_cast<size_t>(lq_layout.extent)),
      kb(static_cast<size_t>(lk_layout.extent)), vb(static_cast<size_t>(lv_layout.extent));
  for (float& x : qb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : kb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : vb) x = rng.uniform();
  note(" q/k amplitude %g", static_cast<double>(qk_amp));

  // ---- mask
  const int mask_kind = merge_mode ? 0 : fdp.ConsumeIntegralInRange<int>(0, 2);
  std::vector<uint8_t> mask_bool;
  std::vector<float> mask_f32;
  mha_tensor mask{};
  if (mask_kind != 0) {
    const int32_t rank = fdp.ConsumeIntegralInRange<int32_t>(2, 4);
    const int64_t full[4] = {B, H, Lq, Lk};
    std::vector<int64_t> shape;
    for (int axis = 4 - rank; axis < 4; ++axis) shape.push_back(fdp.ConsumeBool() ? full[axis] : 1);
    std::vector<int64_t> strides = mha_test::c_strides(shape);
    const int64_t count = mha_test::element_count(shape);
    if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {  // broadcast one axis by a zero stride
      strides[fdp.ConsumeIntegralInRange<size_t>(0, shape.size() - 1)] = 0;
    }
    const int density = fdp.ConsumeIntegralInRange<int>(0, 4);  // 0: all keys masked ... 4: none
    if (mask_kind == 1) {
      mask_bool.resize(static_cast<size_t>(count));
      for (auto& m : mask_bool) {
        m = rng.integer(0, 3) < density ? static_cast<uint8_t>(rng.integer(1, 255)) : 0;
      }
      mask = mha_test::describe(mask_bool.data(), MHA_DTYPE_BOOL, shape, strides);
    } else {
      static const float kMaskValues[] = {0.0f, 0.5f, -1.0f, 2.0f, -kInf, 1e4f, -1e4f, kNaN, kInf};
      const int chaos = fdp.ConsumeIntegralInRange<int>(0, 8);  // values drawn from [0, chaos]
      mask_f32.resize(static_cast<size_t>(count));
      for (auto& m : mask_f32) {
        m = rng.integer(0, 3) < density ? kMaskValues[rng.integer(0, std::min(chaos, 3))]
                                        : kMaskValues[rng.integer(0, chaos)];
      }
      mask = mha_test::describe(mask_f32.data(), MHA_DTYPE_F32, shape, strides);
    }
    note(" mask %s rank %d density %d/4", mask_kind == 1 ? "bool" : "f32", rank, density);
  }

  // ---- valid lengths (a slack buffer: a broken shape must not make a
  // refusing runtime read outside it)
  const int lens_kind = merge_mode ? 0 : fdp.ConsumeIntegralInRange<int>(0, 2);
  const bool lens_i64 = fdp.ConsumeBool();
  bool expect_invalid = false;
  std::vector<int32_t> lens32(static_cast<size_t>(2 * (B + 1) * (Lq + 1)), 0);
  std::vector<int64_t> lens64(lens32.size(), 0);
  mha_tensor lens{};
  if (lens_kind != 0) {
    const int64_t count = lens_kind == 1 ? B : B * Lq;
    const bool transposed = lens_kind == 2 && fdp.ConsumeBool();
    const bool out_of_range = fdp.ConsumeIntegralInRange<int>(0, 15) == 0;
    for (int64_t n = 0; n < count; ++n) {
      const int64_t len = rng.integer(0, Lk);
      lens32[static_cast<size_t>(n)] = static_cast<int32_t>(len);
      lens64[static_cast<size_t>(n)] = len;
    }
    if (out_of_range) {
      const int64_t bad = fdp.ConsumeBool() ? Lk + 1 : -1;
      const size_t at = fdp.ConsumeIntegralInRange<size_t>(0, static_cast<size_t>(count - 1));
      lens32[at] = static_cast<int32_t>(bad);
      lens64[at] = bad;
      expect_invalid = true;
    }
    void* data = lens_i64 ? static_cast<void*>(lens64.data()) : static_cast<void*>(lens32.data());
    const mha_dtype dtype = lens_i64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
    if (lens_kind == 1) {
      lens = mha_test::describe(data, dtype, {B});
    } else {
      lens = transposed ? mha_test::describe(data, dtype, {B, Lq}, {1, B})
                        : mha_test::describe(data, dtype, {B, Lq});
    }
    note(" valid_lens %s%s%s",
         lens_kind == 1 ? "per-batch" : (transposed ? "per-query/T" : "per-query"),
         lens_i64 ? "/i64" : "/i32", out_of_range ? "/out-of-range" : "");
  }

  // ---- parameters
  mha_attention_params params;
  mha_attention_params_init(&params);
  int32_t causal = merge_mode ? 0 : fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  if (!merge_mode && fdp.ConsumeIntegralInRange<int>(0, 31) == 0) {
    causal = fdp.ConsumeBool() ? 3 : -1;
    expect_invalid = true;
  }
  params.causal = causal;
  if (fdp.ConsumeBool()) {
    static const float kScales[] = {1e-3f, 0.01f, 0.125f, 0.5f, 1.0f, 2.0f, 10.0f,
                                    1e3f,  -0.5f, -1e3f,  0.0f, kNaN, kInf};
    const int which = fdp.ConsumeIntegralInRange<int>(0, 12);
    params.has_scale = 1;
    params.scale = kScales[which];
    if (which >= 10) expect_invalid = true;
    note(" scale %g", static_cast<double>(params.scale));
  }
  note(" causal %d", causal);
  if (mask_kind != 0) params.mask = &mask;
  if (lens_kind != 0) params.valid_lens = &lens;
  const bool want_lse = merge_mode || fdp.ConsumeBool();
  const int64_t lse_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 1);

  // ---- specials planted in the data (padding included)
  const int specials =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? fdp.ConsumeIntegralInRange<int>(1, 6) : 0;
  bool v_has_inf = false;
  for (int n = 0; n < specials; ++n) {
    const int target = fdp.ConsumeIntegralInRange<int>(0, 2);
    std::vector<float>& buf = target == 0 ? qb : (target == 1 ? kb : vb);
    const size_t at = fdp.ConsumeIntegral<uint32_t>() % buf.size();
    buf[at] = special_value(fdp.ConsumeIntegral<uint8_t>());
    note(" %c[%zu] = %g", "qkv"[target], at, static_cast<double>(buf[at]));
  }
  {
    // With an infinity in q or k, a subnormal there can flush differently in
    // fp32 (a pre-scaled q) than in float64: 0 * inf is NaN but 1e-40 * inf
    // is inf.  Such pairs are not compared; make them zeros instead.
    bool qk_inf = false;
    for (const float x : qb) qk_inf = qk_inf || std::isinf(x);
    for (const float x : kb) qk_inf = qk_inf || std::isinf(x);
    if (qk_inf) {
      for (float& x : qb) x = is_subnormal(x) ? 0.0f : x;
      for (float& x : kb) x = is_subnormal(x) ? 0.0f : x;
    }
    for (const float x : vb) v_has_inf = v_has_inf || std::isinf(x);
  }

  mha_tensor q = describe4(qb.data(), MHA_DTYPE_F32, lq_layout);
  mha_tensor k = describe4(kb.data(), MHA_DTYPE_F32, lk_layout);
  mha_tensor v = describe4(vb.data(), MHA_DTYPE_F32, lv_layout);

  // ---- dtypes: Q in f32/bf16/f16, K and V in those or int8 (quantised by
  // mha_quantize_kv, which must refuse non-finite rows), an additive mask in
  // f32/bf16/f16.  The reference reads the same stored values.
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  const mha_dtype q_dtype =
      merge_mode ? MHA_DTYPE_F32 : kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const int kv_pick = merge_mode ? 0 : fdp.ConsumeIntegralInRange<int>(0, 3);
  const mha_dtype mask_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  mha_test::TypedCopy q_typed(q, q_dtype);
  std::vector<mha_test::TypedCopy> kv_typed;
  std::vector<int8_t> k8, v8;
  std::vector<float> k_scales(static_cast<size_t>(B * Hkv * Lk)), v_scales(k_scales.size());
  mha_tensor k_scale{}, v_scale{};
  q = q_typed.get();
  if (kv_pick == 3) {
    // Dense int8 copies (the fuzzed layouts may broadcast, which an output
    // cannot).
    k8.assign(static_cast<size_t>(B * Hkv * Lk * D), 0);
    v8.assign(static_cast<size_t>(B * Hkv * Lk * Dv), 0);
    mha_tensor k_int8 = mha_test::describe(k8.data(), MHA_DTYPE_I8, {B, Hkv, Lk, D});
    mha_tensor v_int8 = mha_test::describe(v8.data(), MHA_DTYPE_I8, {B, Hkv, Lk, Dv});
    k_scale = mha_test::describe(k_scales.data(), MHA_DTYPE_F32, {B, Hkv, Lk});
    v_scale = mha_test::describe(v_scales.data(), MHA_DTYPE_F32, {B, Hkv, Lk});
    bool finite = true;
    for (const mha_tensor* t : {&k, &v}) {
      mha_test::for_each_offset(*t, [&](int64_t at) {
        finite = finite && std::isfinite(static_cast<const float*>(t->data)[at]);
      });
    }
    const mha_status sk = mha_quantize_kv(&k, &k_int8, &k_scale);
    const mha_status sv = mha_quantize_kv(&v, &v_int8, &v_scale);
    if (finite && (sk != MHA_OK || sv != MHA_OK)) {
      finding(std::string("mha_quantize_kv refused finite rows: ") + mha_last_error());
    }
    if (!finite && (sk == MHA_OK && sv == MHA_OK)) finding("mha_quantize_kv took a non-finite row");
    if (finite) {
      k = k_int8;
      v = v_int8;
      params.k_scale = &k_scale;
      params.v_scale = &v_scale;
      note(" kv i8");
    }
  } else if (kv_pick != 0) {
    kv_typed.emplace_back(k, kFloatTypes[kv_pick]);
    kv_typed.emplace_back(v, kFloatTypes[kv_pick]);
    k = kv_typed[0].get();
    v = kv_typed[1].get();
    note(" kv %s", mha_types::dtype_name(kFloatTypes[kv_pick]));
  }
  if (q_dtype != MHA_DTYPE_F32) note(" q %s", mha_types::dtype_name(q_dtype));
  std::vector<mha_test::TypedCopy> mask_typed;
  if (mask_kind == 2 && mask_dtype != MHA_DTYPE_F32) {
    mask_typed.emplace_back(mask, mask_dtype);
    mask = mask_typed.back().get();
    note(" mask %s", mha_types::dtype_name(mask_dtype));
  }

  // ---- outputs
  Guarded out_buf(lo_layout.extent);
  mha_tensor out = describe4(out_buf.base(), MHA_DTYPE_F32, lo_layout);
  const int64_t lse_strides[3] = {H * (Lq + lse_pad), Lq + lse_pad, 1};
  Guarded lse_buf(B * H * (Lq + lse_pad) + 2);
  mha_tensor lse = mha_test::describe(lse_buf.base(), MHA_DTYPE_F32, {B, H, Lq},
                                      {lse_strides[0], lse_strides[1], lse_strides[2]});
  if (want_lse) params.lse = &lse;

  // ---- merge mode: the keys in parts, each its own call, merged
  if (merge_mode) {
    const int32_t parts =
        static_cast<int32_t>(std::min<int64_t>(Lk, fdp.ConsumeIntegralInRange<int>(2, 4)));
    std::vector<int64_t> cuts = {0, Lk};
    while (static_cast<int32_t>(cuts.size()) < parts + 1) {
      const int64_t cut = fdp.ConsumeIntegralInRange<int64_t>(1, Lk - 1);
      if (std::find(cuts.begin(), cuts.end(), cut) == cuts.end()) {
        cuts.push_back(cut);
      } else if (fdp.remaining_bytes() == 0) {
        break;
      }
    }
    std::sort(cuts.begin(), cuts.end());
    const int32_t n = static_cast<int32_t>(cuts.size()) - 1;
    note(" merged from %d parts", n);
    std::vector<std::vector<float>> part_out(static_cast<size_t>(n)),
        part_lse(static_cast<size_t>(n));
    std::vector<mha_tensor> outs(static_cast<size_t>(n)), lses(static_cast<size_t>(n));
    for (int32_t c = 0; c < n; ++c) {
      const int64_t a = cuts[static_cast<size_t>(c)], len = cuts[static_cast<size_t>(c) + 1] - a;
      mha_tensor kc = k, vc = v;
      kc.data = kb.data() + a * k.strides[2];
      vc.data = vb.data() + a * v.strides[2];
      kc.shape[2] = vc.shape[2] = len;
      part_out[static_cast<size_t>(c)].assign(static_cast<size_t>(B * H * Lq * Dv), kNaN);
      part_lse[static_cast<size_t>(c)].assign(static_cast<size_t>(B * H * Lq), kNaN);
      outs[static_cast<size_t>(c)] = mha_test::describe(part_out[static_cast<size_t>(c)].data(),
                                                        MHA_DTYPE_F32, {B, H, Lq, Dv});
      lses[static_cast<size_t>(c)] =
          mha_test::describe(part_lse[static_cast<size_t>(c)].data(), MHA_DTYPE_F32, {B, H, Lq});
      mha_attention_params pp = params;
      pp.lse = &lses[static_cast<size_t>(c)];
      const mha_status s = mha_attention(&q, &kc, &vc, &outs[static_cast<size_t>(c)], &pp);
      if (s != MHA_OK && !expect_invalid) {
        finding(std::string("a part's valid call failed: ") + mha_last_error());
      }
      if (s != MHA_OK) return 0;
    }
    if (expect_invalid) finding("an invalid scale was accepted");
    const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
    const mha_status s = mha_merge_partials(n, outs.data(), lses.data(), &out, &lse);
    if (s != MHA_OK) finding(std::string("a valid mha_merge_partials failed: ") + mha_last_error());
    if (changed_outside(out_buf, out, out_before) != 0) finding("merge wrote outside out");
    if (changed_outside(lse_buf, lse, lse_before) != 0) finding("merge wrote outside lse");
    mha_attention_params rp = params;
    rp.lse = nullptr;
    const Reference ref = mha_test::reference_attention(q, k, v, &rp);
    compare(out, static_cast<const float*>(lse.data), lse_strides, ref,
            v_has_inf && ref.max_abs_logit > 40.0, mha_test::tolerance(ref));
    return 0;
  }

  // ---- at most one way of breaking the call
  const bool broken = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  if (broken) {
    const int how = fdp.ConsumeIntegralInRange<int>(0, 21);
    bool applied = true;
    switch (how) {
      case 0:
        q.dtype = MHA_DTYPE_I32;
        break;
      case 1:
        out.dtype = MHA_DTYPE_BOOL;
        break;
      case 2:
        k.shape[0] = B + 1;
        break;
      case 3:
        v.shape[2] = Lk + 1;
        break;
      case 4:
        out.strides[3] = -1;
        break;
      case 5:
        q.ndim = 3;
        break;
      case 6:
        params.struct_size = 12345;
        break;
      case 7:
        out.data = q.data;
        break;
      case 8: {
        int axis = -1;
        for (const int a : {2, 1, 0, 3}) {
          if (axis < 0 && out.shape[a] > 1) axis = a;
        }
        if (axis < 0)
          applied = false;
        else
          out.strides[axis] = 0;
        break;
      }
      case 9:
        if (mask_kind == 0)
          applied = false;
        else
          mask.shape[mask.ndim - 1] = Lk + 1;
        break;
      case 10:
        if (lens_kind == 0)
          applied = false;
        else
          lens.shape[0] = B + 1;
        break;
      case 11:
        if (!want_lse)
          applied = false;
        else
          lse.shape[2] = Lq + 1;
        break;
      case 12:
        k.data = nullptr;
        break;
      case 13:
        k.shape[1] = v.shape[1] = H + 1;
        break;
      case 14:
        if (mask_kind == 0)
          applied = false;
        else
          mask.dtype = MHA_DTYPE_I32;
        break;
      case 15:
        if (!want_lse)
          applied = false;
        else
          lse.data = out.data;
        break;
      case 16:
        params.dropout_p = 1.5f;
        break;
      case 17: {
        int axis = -1;
        for (const int a : {0, 2, 3}) {
          if (axis < 0 && k.shape[a] > 1) axis = a;
        }
        if (axis < 0)
          applied = false;
        else
          k.strides[axis] = std::numeric_limits<int64_t>::max();
        break;
      }
      case 18:
        q.shape[3] = D + 1;
        break;
      case 19: {
        // A stride-0 giant: Q and K broadcast along every axis with a head
        // size past MHA_MAX_HEAD_DIM (the element count stays tiny).
        const int64_t giant = fdp.ConsumeIntegralInRange<int64_t>(
            int64_t{MHA_MAX_HEAD_DIM} + 1, std::numeric_limits<int64_t>::max());
        q.shape[3] = k.shape[3] = giant;
        for (int a = 0; a < 4; ++a) q.strides[a] = k.strides[a] = 0;
        note(" D=%lld", static_cast<long long>(giant));
        break;
      }
      case 20: {
        // K and V broadcast along every axis with a key length past
        // MHA_MAX_EXTENT (up to INT64_MAX).
        const int64_t giant = fdp.ConsumeIntegralInRange<int64_t>(
            MHA_MAX_EXTENT + 1, std::numeric_limits<int64_t>::max());
        k.shape[2] = v.shape[2] = giant;
        for (int a = 0; a < 4; ++a) k.strides[a] = v.strides[a] = 0;
        note(" Lk=%lld", static_cast<long long>(giant));
        break;
      }
      default:
        params.has_scale = 1;
        params.scale = 0.0f;
        break;
    }
    if (applied) {
      expect_invalid = true;
      note(" broken by #%d", how);
    }
  }

  // ---- a sliding window (read last, so that older corpus entries, which end
  // before it, keep their meaning: no bytes left means -1, no window)
  params.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, Lk + Lq);
  params.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, Lk + Lq);
  if (params.window_left >= 0 || params.window_right >= 0) {
    note(" window %lld,%lld", static_cast<long long>(params.window_left),
         static_cast<long long>(params.window_right));
  }

  // ---- the score variants (read after the window, likewise): a softcap,
  // sinks (finite, ±1e4 or -inf), ALiBi slopes per head or per batch.
  const int variants = fdp.ConsumeIntegralInRange<int>(0, 7);
  static const float kCaps[] = {1.0f, 5.0f, 50.0f, 1e4f};
  static const float kSinks[] = {-std::numeric_limits<float>::infinity(), -1e4f, 1e4f, 0.0f};
  std::vector<float> sink_values(static_cast<size_t>(H)), slopes(static_cast<size_t>(B * H));
  mha_tensor sinks{}, alibi{};
  if (variants & 1) {
    params.softcap = kCaps[fdp.ConsumeIntegralInRange<int>(0, 3)];
    note(" softcap %g", static_cast<double>(params.softcap));
  }
  if (variants & 2) {
    for (float& x : sink_values) {
      const int pick = fdp.ConsumeIntegralInRange<int>(0, 4);
      x = pick < 4 ? kSinks[pick] : rng.uniform(-3.0f, 5.0f);
    }
    sinks = mha_test::describe(sink_values.data(), MHA_DTYPE_F32, {H});
    params.sinks = &sinks;
    note(" sinks");
  }
  if (variants & 4) {
    const bool per_batch = fdp.ConsumeBool(), zero = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
    for (float& x : slopes) x = zero ? 0.0f : rng.uniform(0.0f, 1.0f);
    alibi = per_batch ? mha_test::describe(slopes.data(), MHA_DTYPE_F32, {B, H})
                      : mha_test::describe(slopes.data(), MHA_DTYPE_F32, {H});
    params.alibi_slopes = &alibi;
    note(" alibi%s%s", per_batch ? " per batch" : "", zero ? " (slopes 0)" : "");
  }

  // ---- the call
  const std::vector<float> q_before = qb, k_before = kb, v_before = vb, mf_before = mask_f32;
  const std::vector<uint8_t> mb_before = mask_bool;
  const std::vector<int32_t> l32_before = lens32;
  const std::vector<int64_t> l64_before = lens64;
  const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
  Reference ref;
  if (!expect_invalid) ref = mha_test::reference_attention(q, k, v, &params);

  const mha_status status = mha_attention(&q, &k, &v, &out, &params);
  const std::string message = mha_last_error();

  if (!same_bytes(qb, q_before) || !same_bytes(kb, k_before) || !same_bytes(vb, v_before) ||
      !same_bytes(mask_f32, mf_before) || !same_bytes(mask_bool, mb_before) ||
      !same_bytes(lens32, l32_before) || !same_bytes(lens64, l64_before)) {
    finding("an input was modified");
  }
  if (!outputs_keep_contract("", status, message, expect_invalid, out_buf, out, out_before, lse_buf,
                             lse, lse_before, want_lse)) {
    return 0;
  }
  // avx512bf16 rounds P to bf16 for bf16 Q with bf16 K/V: its allowance.
  compare(out, want_lse ? static_cast<const float*>(lse.data) : nullptr, lse_strides, ref,
          v_has_inf && ref.max_abs_logit > 40.0,
          mha_test::tolerance_for(backend, q_dtype, k.dtype, ref, MHA_DTYPE_F32));
  return 0;
}

// ------------------------------------------------------------------ packed batches

// A packed [total, heads, d] tensor's strides: token-major or head-major,
// each run of d followed by `pad` unused elements; `zero_heads` broadcasts
// the head axis (inputs only).
struct PackedLayout {
  int64_t shape[3] = {1, 1, 1};
  int64_t strides[3] = {1, 1, 1};
  int64_t extent = 1;
};

PackedLayout packed_layout(int64_t total, int64_t heads, int64_t d, bool head_major, int64_t pad,
                           bool zero_heads) {
  PackedLayout l;
  l.shape[0] = total;
  l.shape[1] = heads;
  l.shape[2] = d;
  l.strides[2] = 1;
  if (head_major) {
    l.strides[0] = d + pad;
    l.strides[1] = total * (d + pad);
  } else {
    l.strides[1] = d + pad;
    l.strides[0] = heads * (d + pad);
  }
  if (zero_heads) l.strides[1] = 0;
  l.extent = 1;
  for (int axis = 0; axis < 3; ++axis) l.extent += (l.shape[axis] - 1) * l.strides[axis];
  return l;
}

mha_tensor describe3(void* data, mha_dtype dtype, const PackedLayout& l) {
  return mha_test::describe(data, dtype, {l.shape[0], l.shape[1], l.shape[2]},
                            {l.strides[0], l.strides[1], l.strides[2]});
}

// Rows [first, first + len) of a packed [total, heads, d] tensor (any
// strides, any dtype) as the [1, heads, len, d] tensor of a call on that
// sequence alone.
mha_tensor sequence_of(const mha_tensor& t, int64_t first, int64_t len) {
  const int64_t bytes = t.dtype == MHA_DTYPE_I8 ? 1 : mha_types::float_bytes(t.dtype);
  return mha_test::describe(static_cast<char*>(t.data) + first * t.strides[0] * bytes,
                            static_cast<mha_dtype>(t.dtype), {1, t.shape[1], len, t.shape[2]},
                            {0, t.strides[1], t.strides[0], t.strides[2]});
}

// The attention variants a case draws -- softcap, per-head sinks, ALiBi
// slopes per head or per sequence -- with the arrays params points to (so
// they must outlive the call).  Every case draws them from the same bytes in
// the same order.
struct DrawnVariants {
  std::vector<float> sink_values, slopes;
  mha_tensor sinks{}, alibi{};
  bool alibi_per_sequence = false;
};

// Draws the variants into params and `drawn`; slopes has room for
// slope_rows rows of H.
void draw_variants(FuzzedDataProvider& fdp, mha_test::Rng& rng, int64_t B, int64_t H,
                   int64_t slope_rows, mha_attention_params& params, DrawnVariants& drawn) {
  const int variants = fdp.ConsumeIntegralInRange<int>(0, 7);
  static const float kCaps[] = {1.0f, 5.0f, 50.0f, 1e4f};
  static const float kSinks[] = {-kInf, -1e4f, 1e4f, 0.0f};
  drawn.sink_values.assign(static_cast<size_t>(H), 0.0f);
  drawn.slopes.assign(static_cast<size_t>(slope_rows * H), 0.0f);
  if (variants & 1) {
    params.softcap = kCaps[fdp.ConsumeIntegralInRange<int>(0, 3)];
    note(" softcap %g", static_cast<double>(params.softcap));
  }
  if (variants & 2) {
    for (float& x : drawn.sink_values) {
      const int pick = fdp.ConsumeIntegralInRange<int>(0, 4);
      x = pick < 4 ? kSinks[pick] : rng.uniform(-3.0f, 5.0f);
    }
    drawn.sinks = mha_test::describe(drawn.sink_values.data(), MHA_DTYPE_F32, {H});
    params.sinks = &drawn.sinks;
    note(" sinks");
  }
  drawn.alibi_per_sequence = (variants & 4) != 0 && fdp.ConsumeBool();
  if (variants & 4) {
    for (float& x : drawn.slopes) x = rng.uniform(0.0f, 1.0f);
    drawn.alibi = drawn.alibi_per_sequence
                      ? mha_test::describe(drawn.slopes.data(), MHA_DTYPE_F32, {B, H})
                      : mha_test::describe(drawn.slopes.data(), MHA_DTYPE_F32, {H});
    params.alibi_slopes = &drawn.alibi;
    note(" alibi%s", drawn.alibi_per_sequence ? " per sequence" : "");
  }
}

int run_varlen_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "varlen: ");

  // ---- shapes: B sequences of their own lengths
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 6);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  std::vector<int64_t> lens_q(static_cast<size_t>(B)), lens_k(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int kind = fdp.ConsumeIntegralInRange<int>(0, 15);
    int64_t lq = fdp.ConsumeIntegralInRange<int64_t>(0, 9);
    int64_t lk = fdp.ConsumeIntegralInRange<int64_t>(0, 9);
    if (kind >= 11) lk = fdp.ConsumeIntegralInRange<int64_t>(10, 140);  // several key tiles
    if (kind >= 13) lq = lk;                                            // self-attention
    if (kind == 15) {                                                   // long enough for split-KV
      lk = fdp.ConsumeIntegralInRange<int64_t>(1024, 1300);
      lq = std::min<int64_t>(lq, 3);
    }
    lens_q[static_cast<size_t>(b)] = lq;
    lens_k[static_cast<size_t>(b)] = lk;
  }
  // The packed tensors need at least one row each (sizes must be positive).
  if (std::all_of(lens_q.begin(), lens_q.end(), [](int64_t l) { return l == 0; })) lens_q[0] = 1;
  if (std::all_of(lens_k.begin(), lens_k.end(), [](int64_t l) { return l == 0; })) lens_k[0] = 1;
  // Offsets with slack: a broken B must not make a refusing runtime read
  // outside the buffer.
  std::vector<int32_t> cu_q(static_cast<size_t>(B + 3), 0), cu_k(cu_q.size(), 0);
  for (int64_t b = 0; b < B; ++b) {
    cu_q[static_cast<size_t>(b + 1)] =
        cu_q[static_cast<size_t>(b)] + static_cast<int32_t>(lens_q[static_cast<size_t>(b)]);
    cu_k[static_cast<size_t>(b + 1)] =
        cu_k[static_cast<size_t>(b)] + static_cast<int32_t>(lens_k[static_cast<size_t>(b)]);
  }
  const int64_t total_q = cu_q[static_cast<size_t>(B)], total_k = cu_k[static_cast<size_t>(B)];
  note(" B=%lld H=%lld Hkv=%lld D=%lld Dv=%lld lengths", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(Hkv), static_cast<long long>(D),
       static_cast<long long>(Dv));
  for (int64_t b = 0; b < B; ++b) {
    note(" %lld/%lld", static_cast<long long>(lens_q[static_cast<size_t>(b)]),
         static_cast<long long>(lens_k[static_cast<size_t>(b)]));
  }

  // ---- layouts
  auto layout = [&](int64_t total, int64_t heads, int64_t d, bool input, const char* name) {
    const bool head_major = fdp.ConsumeBool();
    const int64_t pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
    const bool zero_heads = input && heads > 1 && fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
    note(" %s(%s pad %lld%s)", name, head_major ? "head-major" : "token-major",
         static_cast<long long>(pad), zero_heads ? " heads broadcast" : "");
    return packed_layout(total, heads, d, head_major, pad, zero_heads);
  };
  const PackedLayout lq_layout = layout(total_q, H, D, true, "q");
  const PackedLayout lk_layout = layout(total_k, Hkv, D, true, "k");
  const PackedLayout lv_layout = layout(total_k, Hkv, Dv, true, "v");
  const PackedLayout lo_layout = layout(total_q, H, Dv, false, "out");

  // ---- data, with specials planted (padding included)
  mha_test::Rng rng(fdp.ConsumeIntegral<uint64_t>());
  static const float kAmps[] = {0.5f, 1.0f, 3.0f, 30.0f};
  const float qk_amp = kAmps[fdp.ConsumeIntegralInRange<int>(0, 3)];
  std::vector<float> qb(static_cast<size_t>(lq_layout.extent)),
      kb(static_cast<size_t>(lk_layout.extent)), vb(static_cast<size_t>(lv_layout.extent));
  for (float& x : qb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : kb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : vb) x = rng.uniform();
  note(" q/k amplitude %g", static_cast<double>(qk_amp));
  const int specials =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? fdp.ConsumeIntegralInRange<int>(1, 4) : 0;
  for (int n = 0; n < specials; ++n) {
    const int target = fdp.ConsumeIntegralInRange<int>(0, 2);
    std::vector<float>& buf = target == 0 ? qb : (target == 1 ? kb : vb);
    const size_t at = fdp.ConsumeIntegral<uint32_t>() % buf.size();
    buf[at] = special_value(fdp.ConsumeIntegral<uint8_t>());
    note(" %c[%zu] = %g", "qkv"[target], at, static_cast<double>(buf[at]));
  }
  bool v_has_inf = false;
  {
    bool qk_inf = false;  // as in run_case: no subnormals next to an infinity
    for (const float x : qb) qk_inf = qk_inf || std::isinf(x);
    for (const float x : kb) qk_inf = qk_inf || std::isinf(x);
    if (qk_inf) {
      for (float& x : qb) x = is_subnormal(x) ? 0.0f : x;
      for (float& x : kb) x = is_subnormal(x) ? 0.0f : x;
    }
    for (const float x : vb) v_has_inf = v_has_inf || std::isinf(x);
  }

  // ---- dtypes
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  const mha_dtype q_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const int kv_pick = fdp.ConsumeIntegralInRange<int>(0, 3);
  mha_tensor q = describe3(qb.data(), MHA_DTYPE_F32, lq_layout);
  mha_tensor k = describe3(kb.data(), MHA_DTYPE_F32, lk_layout);
  mha_tensor v = describe3(vb.data(), MHA_DTYPE_F32, lv_layout);
  mha_test::TypedCopy q_typed(q, q_dtype);
  q = q_typed.get();
  std::vector<mha_test::TypedCopy> kv_typed;
  std::vector<int8_t> k8, v8;
  std::vector<float> k_scales(static_cast<size_t>(total_k * Hkv)), v_scales(k_scales.size());
  mha_tensor k_scale{}, v_scale{};
  mha_attention_params params;
  mha_attention_params_init(&params);
  if (kv_pick == 3) {
    // Dense int8 copies [total_k, Hkv, D] and their scales [total_k, Hkv],
    // quantised through [1, Hkv, total_k, D] views.
    k8.assign(static_cast<size_t>(total_k * Hkv * D), 0);
    v8.assign(static_cast<size_t>(total_k * Hkv * Dv), 0);
    const auto as4 = [](const mha_tensor& t) {
      return mha_test::describe(t.data, static_cast<mha_dtype>(t.dtype),
                                {1, t.shape[1], t.shape[0], t.shape[2]},
                                {0, t.strides[1], t.strides[0], t.strides[2]});
    };
    mha_tensor k_int8 = mha_test::describe(k8.data(), MHA_DTYPE_I8, {total_k, Hkv, D});
    mha_tensor v_int8 = mha_test::describe(v8.data(), MHA_DTYPE_I8, {total_k, Hkv, Dv});
    k_scale = mha_test::describe(k_scales.data(), MHA_DTYPE_F32, {total_k, Hkv});
    v_scale = mha_test::describe(v_scales.data(), MHA_DTYPE_F32, {total_k, Hkv});
    const auto scale4 = [&](std::vector<float>& scales) {
      return mha_test::describe(scales.data(), MHA_DTYPE_F32, {1, Hkv, total_k}, {0, 1, Hkv});
    };
    bool finite = true;
    for (const mha_tensor* t : {&k, &v}) {
      mha_test::for_each_offset(*t, [&](int64_t at) {
        finite = finite && std::isfinite(static_cast<const float*>(t->data)[at]);
      });
    }
    mha_tensor k4 = as4(k), v4 = as4(v), k84 = as4(k_int8), v84 = as4(v_int8);
    mha_tensor ks4 = scale4(k_scales), vs4 = scale4(v_scales);
    const mha_status sk = mha_quantize_kv(&k4, &k84, &ks4);
    const mha_status sv = mha_quantize_kv(&v4, &v84, &vs4);
    if (finite && (sk != MHA_OK || sv != MHA_OK)) {
      finding(std::string("mha_quantize_kv refused finite rows: ") + mha_last_error());
    }
    if (finite) {
      k = k_int8;
      v = v_int8;
      params.k_scale = &k_scale;
      params.v_scale = &v_scale;
      note(" kv i8");
    }
  } else if (kv_pick != 0) {
    kv_typed.emplace_back(k, kFloatTypes[kv_pick]);
    kv_typed.emplace_back(v, kFloatTypes[kv_pick]);
    k = kv_typed[0].get();
    v = kv_typed[1].get();
    note(" kv %s", mha_types::dtype_name(kFloatTypes[kv_pick]));
  }
  if (q_dtype != MHA_DTYPE_F32) note(" q %s", mha_types::dtype_name(q_dtype));

  // ---- parameters
  params.causal = fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  note(" causal %d", params.causal);
  bool expect_invalid = false;
  if (fdp.ConsumeBool()) {
    static const float kScales[] = {0.01f, 0.125f, 0.5f, 1.0f, 10.0f, -0.5f, 0.0f, kNaN};
    const int which = fdp.ConsumeIntegralInRange<int>(0, 7);
    params.has_scale = 1;
    params.scale = kScales[which];
    if (which >= 6) expect_invalid = true;
    note(" scale %g", static_cast<double>(params.scale));
  }
  params.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, 20);
  params.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, 20);
  if (params.window_left >= 0 || params.window_right >= 0) {
    note(" window %lld,%lld", static_cast<long long>(params.window_left),
         static_cast<long long>(params.window_right));
  }
  DrawnVariants drawn;
  draw_variants(fdp, rng, B, H, B + 1, params, drawn);

  // ---- outputs
  Guarded out_buf(lo_layout.extent);
  mha_tensor out = describe3(out_buf.base(), MHA_DTYPE_F32, lo_layout);
  const bool want_lse = fdp.ConsumeBool();
  const int64_t lse_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 1);
  Guarded lse_buf(H * (total_q + lse_pad) + 2);
  mha_tensor lse =
      mha_test::describe(lse_buf.base(), MHA_DTYPE_F32, {H, total_q}, {total_q + lse_pad, 1});
  if (want_lse) params.lse = &lse;
  mha_tensor tcu_q = mha_test::describe(cu_q.data(), MHA_DTYPE_I32, {B + 1});
  mha_tensor tcu_k = mha_test::describe(cu_k.data(), MHA_DTYPE_I32, {B + 1});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &tcu_q;
  varlen.cu_seqlens_k = &tcu_k;
  const mha_varlen_params* varlen_arg = &varlen;

  // ---- at most one way of breaking the call
  std::vector<int64_t> lens64(static_cast<size_t>(B + 3), 0);
  mha_tensor wrong{};
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    const int how = fdp.ConsumeIntegralInRange<int>(0, 19);
    std::vector<int32_t>& cu = fdp.ConsumeBool() ? cu_q : cu_k;
    const char* which = &cu == &cu_q ? "q" : "k";
    const size_t at = fdp.ConsumeIntegralInRange<size_t>(1, static_cast<size_t>(B));
    bool applied = true;
    switch (how) {
      case 0:
        cu[0] = fdp.ConsumeBool() ? 1 : -1;
        break;
      case 1:  // decreasing
        cu[at] = cu[at - 1] - 1;
        break;
      case 2:  // the last offset is not the total
        cu[static_cast<size_t>(B)] += fdp.ConsumeBool() ? 1 : -1;
        break;
      case 3:  // the two disagree on B
        (&cu == &cu_q ? tcu_q : tcu_k).shape[0] = B + 2;
        break;
      case 4:
        (&cu == &cu_q ? tcu_q : tcu_k).dtype = MHA_DTYPE_I64;
        break;
      case 5:
        (&cu == &cu_q ? varlen.cu_seqlens_q : varlen.cu_seqlens_k) = nullptr;
        break;
      case 6:
        varlen_arg = nullptr;
        break;
      case 7:
        varlen.struct_size = fdp.ConsumeBool() ? 0u : 12345u;
        break;
      case 8:
        wrong = mha_test::describe(lens64.data(), MHA_DTYPE_I64, {B});
        params.valid_lens = &wrong;
        break;
      case 9:
        wrong = mha_test::describe(lens64.data(), MHA_DTYPE_BOOL, {1, 1});
        params.mask = &wrong;
        break;
      case 10:  // the LSE as [total_q, H] or one row too long
        if (want_lse && H != total_q) {
          lse.shape[0] = total_q;
          lse.shape[1] = H;
          lse.strides[0] = 1;
          lse.strides[1] = total_q;
        } else if (want_lse) {
          lse.shape[1] = total_q + 1;
        } else {
          applied = false;
        }
        break;
      case 11:
        wrong = mha_test::describe(drawn.slopes.data(), MHA_DTYPE_F32, {B + 1, H});
        params.alibi_slopes = &wrong;
        break;
      case 12:
        v.shape[0] = total_k + 1;
        break;
      case 13:
        out.data = q.data;
        break;
      case 14:
        if (params.k_scale != nullptr) {
          params.v_scale = nullptr;
        } else {
          params.k_scale = &tcu_q;
        }
        break;
      case 15:
        (&cu == &cu_q ? tcu_q : tcu_k) = mha_test::describe(cu.data(), MHA_DTYPE_I32, {1, B + 1});
        break;
      case 16:
        q = mha_test::describe(q.data, static_cast<mha_dtype>(q.dtype),
                               {1, q.shape[0], q.shape[1], q.shape[2]},
                               {0, q.strides[0], q.strides[1], q.strides[2]});
        break;
      case 17:  // offsets beyond every total
        cu[static_cast<size_t>(B)] = std::numeric_limits<int32_t>::max();
        break;
      case 18:
        if (H % (Hkv + 1) == 0) {
          applied = false;
        } else {
          k.shape[1] = v.shape[1] = Hkv + 1;
        }
        break;
      default:
        params.window_left = -2;
        break;
    }
    if (applied) {
      expect_invalid = true;
      note(" broken by #%d (cu_seqlens_%s, at %zu)", how, which, at);
    }
  }

  // ---- the call
  const std::vector<float> q_before = qb, k_before = kb, v_before = vb;
  const std::vector<int32_t> cu_q_before = cu_q, cu_k_before = cu_k;
  const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
  const mha_status status = mha_attention_varlen(&q, &k, &v, &out, varlen_arg, &params);
  const std::string message = mha_last_error();
  if (!same_bytes(qb, q_before) || !same_bytes(kb, k_before) || !same_bytes(vb, v_before) ||
      !same_bytes(cu_q, cu_q_before) || !same_bytes(cu_k, cu_k_before)) {
    finding("varlen: an input was modified");
  }
  if (!outputs_keep_contract("varlen: ", status, message, expect_invalid, out_buf, out, out_before,
                             lse_buf, lse, lse_before, want_lse)) {
    return 0;
  }

  // ---- each sequence against the reference on that sequence alone
  const float* lse_data = static_cast<const float*>(lse.data);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = cu_q[static_cast<size_t>(b)], lq = lens_q[static_cast<size_t>(b)];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], lk = lens_k[static_cast<size_t>(b)];
    if (lq == 0) continue;
    if (lk == 0) {  // zeros, LSE its sink or -inf
      for (int64_t i = q0; i < q0 + lq; ++i) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t c = 0; c < Dv; ++c) {
            const float got = static_cast<const float*>(
                out.data)[i * out.strides[0] + h * out.strides[1] + c * out.strides[2]];
            if (got != 0.0f) finding("varlen: a sequence without keys has a non-zero output");
          }
          if (!want_lse) continue;
          const float want =
              params.sinks != nullptr ? drawn.sink_values[static_cast<size_t>(h)] : -kInf;
          const float got = lse_data[h * lse.strides[0] + i * lse.strides[1]];
          if (!(got == want)) {  // the sinks are never NaN
            finding("varlen: a sequence without keys has an LSE other than its sink");
          }
        }
      }
      continue;
    }
    mha_attention_params alone = params;
    alone.lse = nullptr;
    mha_tensor slope_row{}, ks{}, vs{};
    if (drawn.alibi_per_sequence) {
      slope_row = mha_test::describe(drawn.slopes.data() + b * H, MHA_DTYPE_F32, {H});
      alone.alibi_slopes = &slope_row;
    }
    if (params.k_scale != nullptr) {
      ks = mha_test::describe(k_scales.data() + k0 * Hkv, MHA_DTYPE_F32, {1, Hkv, lk}, {0, 1, Hkv});
      vs = mha_test::describe(v_scales.data() + k0 * Hkv, MHA_DTYPE_F32, {1, Hkv, lk}, {0, 1, Hkv});
      alone.k_scale = &ks;
      alone.v_scale = &vs;
    }
    const Reference ref = mha_test::reference_attention(
        sequence_of(q, q0, lq), sequence_of(k, k0, lk), sequence_of(v, k0, lk), &alone);
    note(" [sequence %lld]", static_cast<long long>(b));
    const int64_t lse_strides[3] = {0, lse.strides[0], lse.strides[1]};
    compare(sequence_of(out, q0, lq), want_lse ? lse_data + q0 * lse.strides[1] : nullptr,
            lse_strides, ref, v_has_inf && ref.max_abs_logit > 40.0,
            mha_test::tolerance_for(backend, q_dtype, k.dtype, ref, MHA_DTYPE_F32));
  }
  return 0;
}

// ------------------------------------------------------------------ a paged KV cache

// Bytes per element of a cache dtype (F32, BF16, F16 or I8; at least 1).
int64_t element_bytes(int32_t dtype) {
  return dtype == MHA_DTYPE_I8 ? 1 : std::max(1, mha_types::float_bytes(dtype));
}

// Element `at` of F32, BF16 or F16 data, read by the formats' definitions
// (test_util.h), not by the library's conversions.
float float_at(const void* data, int32_t dtype, int64_t at) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (dtype == MHA_DTYPE_F32) {
    float x = 0.0f;
    std::memcpy(&x, bytes + at * 4, 4);
    return x;
  }
  uint16_t b = 0;
  std::memcpy(&b, bytes + at * 2, 2);
  return static_cast<float>(mha_test::half_bits_value(b, dtype));
}

// The bytes from a descriptor's first element to one past its last.
std::vector<unsigned char> bytes_of(const mha_tensor& t) {
  int64_t extent = 1;
  for (int32_t d = 0; d < t.ndim; ++d) extent += (t.shape[d] - 1) * t.strides[d];
  const auto* first = static_cast<const unsigned char*>(t.data);
  return std::vector<unsigned char>(first, first + extent * element_bytes(t.dtype));
}

// One cache of a paged KV cache (K or V): [num_blocks, block_size, Hkv, d] of
// f32, bf16, f16 or i8, token-major or head-major within a block, each row of
// d followed by `pad` unused elements, sized exactly (ASan sees a read past
// its end); an i8 cache's row scales [num_blocks, block_size, Hkv] (C order).
// Everything starts as NaN (i8: random values with NaN scales): what no
// sequence uses stays so, and a kernel that reads it shows.
struct PagedCache {
  int32_t dtype;
  int64_t block_size, heads, d;
  int64_t strides[4] = {0, 0, 0, 1};
  std::vector<unsigned char> bytes;
  std::vector<float> scales;
  mha_tensor t{}, s{};

  PagedCache(int32_t dtype_, int64_t blocks, int64_t block_size_, int64_t heads_, int64_t d_,
             bool head_major, int64_t pad, mha_test::Rng& rng)
      : dtype(dtype_), block_size(block_size_), heads(heads_), d(d_) {
    const int64_t row = d + pad;
    strides[1] = head_major ? row : heads * row;
    strides[2] = head_major ? block_size * row : row;
    strides[0] = block_size * heads * row;
    const int64_t es = element_bytes(dtype);
    bytes.resize(static_cast<size_t>(blocks * strides[0] * es));
    scales.assign(static_cast<size_t>(blocks * block_size * heads), kNaN);
    for (int64_t at = 0; at < blocks * strides[0]; ++at) {
      if (dtype == MHA_DTYPE_I8) {
        bytes[static_cast<size_t>(at)] = static_cast<unsigned char>(rng.integer(-127, 127));
      } else {
        store(at, kNaN);
      }
    }
    t = mha_test::describe(bytes.data(), static_cast<mha_dtype>(dtype),
                           {blocks, block_size, heads, d},
                           {strides[0], strides[1], strides[2], strides[3]});
    s = mha_test::describe(scales.data(), MHA_DTYPE_F32, {blocks, block_size, heads});
  }
  PagedCache(const PagedCache&) = delete;
  PagedCache& operator=(const PagedCache&) = delete;

  // Element e of KV head h of a slot (block · block_size + row).
  int64_t at(int64_t slot, int64_t h, int64_t e) const {
    return slot / block_size * strides[0] + slot % block_size * strides[1] + h * strides[2] + e;
  }
  int64_t scale_at(int64_t slot, int64_t h) const { return slot * heads + h; }

  // x rounded to the cache's float dtype (test_util.h's rounding).
  void store(int64_t element, float x) {
    if (dtype == MHA_DTYPE_F32) {
      std::memcpy(&bytes[static_cast<size_t>(element * 4)], &x, 4);
      return;
    }
    const uint16_t b =
        dtype == MHA_DTYPE_BF16 ? mha_test::round_to_bf16_bits(x) : mha_test::round_to_f16_bits(x);
    std::memcpy(&bytes[static_cast<size_t>(element * 2)], &b, 2);
  }

  // A slot some sequence uses: random values in [-amp, amp] (i8: random
  // int8 with scales up to amp / 127).
  void fill_slot(int64_t slot, float amp, mha_test::Rng& rng) {
    for (int64_t h = 0; h < heads; ++h) {
      if (dtype == MHA_DTYPE_I8) {
        scales[static_cast<size_t>(scale_at(slot, h))] = rng.uniform(0.2f, 1.0f) * amp / 127.0f;
      }
      for (int64_t e = 0; e < d; ++e) {
        if (dtype == MHA_DTYPE_I8) {
          bytes[static_cast<size_t>(at(slot, h, e))] =
              static_cast<unsigned char>(rng.integer(-127, 127));
        } else {
          store(at(slot, h, e), rng.uniform(-amp, amp));
        }
      }
    }
  }

  // Checks what mha_kv_cache_write left: the rows of the tokens with a slot
  // hold x ([T, Hkv, d]) converted to the cache's dtype (f32 exactly, bf16 and
  // f16 rounded to nearest even, i8 within half a step of scale = max|row| /
  // 127), every other byte (padding, other slots, other scales) as `before`.
  void check_written(const mha_tensor& x, const std::vector<int64_t>& slots,
                     const std::vector<unsigned char>& before,
                     const std::vector<float>& scales_before, const char* name) const {
    const int64_t es = element_bytes(dtype);
    std::vector<char> touched(bytes.size() / static_cast<size_t>(es), 0),
        touched_scale(scales.size(), 0);
    char text[240];
    for (size_t token = 0; token < slots.size(); ++token) {
      const int64_t slot = slots[token];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = static_cast<int64_t>(token) * x.strides[0] + h * x.strides[1];
        float largest = 0.0f;
        for (int64_t e = 0; e < d; ++e) {
          largest =
              std::fmax(largest, std::fabs(float_at(x.data, x.dtype, row + e * x.strides[2])));
        }
        const float scale = scales[static_cast<size_t>(scale_at(slot, h))];
        if (dtype == MHA_DTYPE_I8) {
          touched_scale[static_cast<size_t>(scale_at(slot, h))] = 1;
          const float want = largest / 127.0f;
          if (!(std::fabs(scale - want) <=
                std::max(4e-7f * want, 4 * std::numeric_limits<float>::denorm_min()))) {
            std::snprintf(text, sizeof text,
                          "kv_cache_write: %s scale of token %zu head %lld = %.9g, max|row| / 127 "
                          "= %.9g",
                          name, token, static_cast<long long>(h), static_cast<double>(scale),
                          static_cast<double>(want));
            finding(text);
          }
        }
        for (int64_t e = 0; e < d; ++e) {
          const int64_t element = at(slot, h, e);
          touched[static_cast<size_t>(element)] = 1;
          const float value = float_at(x.data, x.dtype, row + e * x.strides[2]);
          bool ok = true;
          double got = 0.0;
          if (dtype == MHA_DTYPE_I8) {
            got = static_cast<double>(static_cast<int8_t>(bytes[static_cast<size_t>(element)])) *
                  static_cast<double>(scale);
            ok = std::fabs(got - static_cast<double>(value)) <=
                 0.5 * static_cast<double>(scale) * (1 + 1e-4) + 1e-45;
          } else if (dtype == MHA_DTYPE_F32) {
            float f = 0.0f;
            std::memcpy(&f, &bytes[static_cast<size_t>(element * 4)], 4);
            got = static_cast<double>(f);
            ok = std::isnan(value) ? std::isnan(f) : bits_of(f) == bits_of(value);
          } else {
            uint16_t b = 0;
            std::memcpy(&b, &bytes[static_cast<size_t>(element * 2)], 2);
            got = mha_test::half_bits_value(b, dtype);
            const uint16_t want = dtype == MHA_DTYPE_BF16 ? mha_test::round_to_bf16_bits(value)
                                                          : mha_test::round_to_f16_bits(value);
            ok = std::isnan(value) ? std::isnan(got) : b == want;
          }
          if (!ok) {
            std::snprintf(text, sizeof text,
                          "kv_cache_write: %s cache slot %lld head %lld element %lld = %.9g, "
                          "token %zu's value %.9g",
                          name, static_cast<long long>(slot), static_cast<long long>(h),
                          static_cast<long long>(e), got, token, static_cast<double>(value));
            finding(text);
          }
        }
      }
    }
    for (size_t n = 0; n < touched.size(); ++n) {
      if (!touched[n] &&
          std::memcmp(&bytes[n * static_cast<size_t>(es)], &before[n * static_cast<size_t>(es)],
                      static_cast<size_t>(es)) != 0) {
        std::snprintf(text, sizeof text,
                      "kv_cache_write: element %zu of the %s cache changed, no token's slot", n,
                      name);
        finding(text);
      }
    }
    for (size_t n = 0; n < touched_scale.size(); ++n) {
      if (!touched_scale[n] && bits_of(scales[n]) != bits_of(scales_before[n])) {
        std::snprintf(text, sizeof text,
                      "kv_cache_write: scale %zu of the %s cache changed, no token's slot", n,
                      name);
        finding(text);
      }
    }
  }
};

// A sequence's keys gathered from the pages through its row of the table:
// a dense [1, Hkv, lk, d] copy (token-major) in the cache's dtype, and for
// i8 its scales [1, Hkv, lk].
struct Gathered {
  std::vector<unsigned char> bytes;
  std::vector<float> scales;
  mha_tensor t{}, s{};

  Gathered(const PagedCache& c, const int32_t* row, int64_t lk) {
    const int64_t es = element_bytes(c.dtype), heads = c.heads, d = c.d;
    bytes.resize(static_cast<size_t>(lk * heads * d * es));
    scales.resize(static_cast<size_t>(lk * heads));
    for (int64_t j = 0; j < lk; ++j) {
      const int64_t slot = row[j / c.block_size] * c.block_size + j % c.block_size;
      for (int64_t h = 0; h < heads; ++h) {
        scales[static_cast<size_t>(j * heads + h)] =
            c.scales[static_cast<size_t>(c.scale_at(slot, h))];
        for (int64_t e = 0; e < d; ++e) {
          std::memcpy(&bytes[static_cast<size_t>(((j * heads + h) * d + e) * es)],
                      &c.bytes[static_cast<size_t>(c.at(slot, h, e) * es)],
                      static_cast<size_t>(es));
        }
      }
    }
    t = mha_test::describe(bytes.data(), static_cast<mha_dtype>(c.dtype), {1, heads, lk, d},
                           {0, d, heads * d, 1});
    s = mha_test::describe(scales.data(), MHA_DTYPE_F32, {1, heads, lk}, {0, 1, heads});
  }
  Gathered(const Gathered&) = delete;
  Gathered& operator=(const Gathered&) = delete;
};

// In-place Fisher-Yates shuffle driven by the case's Rng.
template <typename T>
void shuffle_in_place(std::vector<T>& values, mha_test::Rng& rng) {
  for (size_t n = values.size(); n > 1; --n) {
    std::swap(values[n - 1],
              values[static_cast<size_t>(rng.integer(0, static_cast<int64_t>(n - 1)))]);
  }
}

// (A rare choice -- a breakage, specials, a window -- is taken on the top
// value of its range: a case whose bytes run out, all of them then 0, is
// valid.)
int run_paged_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "paged: ");
  mha_test::Rng rng(fdp.ConsumeIntegral<uint64_t>());

  // ---- shapes: B sequences, each with seqused_k keys in the cache and a few
  // new queries (decoding) or a chunk of them (chunked prefill)
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  // Head sizes: any, or a multiple of 8 (the decode kernel reads rows of a
  // multiple of the vector width in place, through the table of row addresses).
  static const int64_t kHeadSizes[] = {8, 16, 32, 40, 64};
  const auto head_size = [&] {
    return fdp.ConsumeBool() ? kHeadSizes[fdp.ConsumeIntegralInRange<int>(0, 4)]
                             : fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  };
  const int64_t D = head_size();
  const int64_t Dv = head_size();
  static const int64_t kBlockSizes[] = {8, 16, 24, 32};
  const int64_t bs = kBlockSizes[fdp.ConsumeIntegralInRange<int>(0, 3)];
  std::vector<int64_t> lens_q(static_cast<size_t>(B)), used(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int kind = fdp.ConsumeIntegralInRange<int>(0, 15);
    int64_t lq = fdp.ConsumeIntegralInRange<int64_t>(0, 3);  // decoding: a few new queries
    int64_t lk = 0;
    if (kind < 6) {
      lk = fdp.ConsumeIntegralInRange<int64_t>(0, 9);
    } else if (kind < 10) {  // several blocks
      lk = fdp.ConsumeIntegralInRange<int64_t>(10, 140);
    } else if (kind < 15) {  // the decode layout (twice a key tile and more)
      lk = fdp.ConsumeIntegralInRange<int64_t>(150, 900);
    } else {  // several decode tiles, split-KV
      lk = fdp.ConsumeIntegralInRange<int64_t>(1100, 1400);
    }
    if (kind == 5 || kind == 8 || kind == 9) {  // chunked prefill
      lq = fdp.ConsumeIntegralInRange<int64_t>(4, 70);
    }
    lens_q[static_cast<size_t>(b)] = lq;
    used[static_cast<size_t>(b)] = lk;
  }
  if (std::all_of(lens_q.begin(), lens_q.end(), [](int64_t l) { return l == 0; })) lens_q[0] = 1;
  // Offsets and lengths with slack: a broken B must not make a refusing
  // runtime read outside them.
  std::vector<int32_t> cu_q(static_cast<size_t>(B + 3), 0), used32(cu_q.size(), 0);
  for (int64_t b = 0; b < B; ++b) {
    cu_q[static_cast<size_t>(b + 1)] =
        cu_q[static_cast<size_t>(b)] + static_cast<int32_t>(lens_q[static_cast<size_t>(b)]);
    used32[static_cast<size_t>(b)] = static_cast<int32_t>(used[static_cast<size_t>(b)]);
  }
  const int64_t total_q = cu_q[static_cast<size_t>(B)];
  note(" B=%lld H=%lld Hkv=%lld D=%lld Dv=%lld block %lld lengths", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(Hkv), static_cast<long long>(D),
       static_cast<long long>(Dv), static_cast<long long>(bs));
  for (int64_t b = 0; b < B; ++b) {
    note(" %lld/%lld", static_cast<long long>(lens_q[static_cast<size_t>(b)]),
         static_cast<long long>(used[static_cast<size_t>(b)]));
  }

  // ---- blocks: each sequence's own in shuffled order, sometimes a prefix
  // shared by two sequences, spare blocks nobody uses; the table's entries
  // past a sequence's blocks (and its row padding) garbage
  std::vector<int64_t> need(static_cast<size_t>(B));
  int64_t max_need = 0, total_need = 0;
  for (int64_t b = 0; b < B; ++b) {
    need[static_cast<size_t>(b)] = (used[static_cast<size_t>(b)] + bs - 1) / bs;
    max_need = std::max(max_need, need[static_cast<size_t>(b)]);
    total_need += need[static_cast<size_t>(b)];
  }
  const int64_t max_blocks =
      std::max<int64_t>(1, max_need + fdp.ConsumeIntegralInRange<int64_t>(0, 2));
  int64_t share_from = 0, share_to = 0, shared = 0;
  if (B >= 2 && fdp.ConsumeIntegralInRange<int>(0, 2) == 0) {
    share_from = fdp.ConsumeIntegralInRange<int64_t>(0, B - 1);
    share_to = (share_from + 1 + fdp.ConsumeIntegralInRange<int64_t>(0, B - 2)) % B;
    shared = std::min({need[static_cast<size_t>(share_from)], need[static_cast<size_t>(share_to)],
                       fdp.ConsumeIntegralInRange<int64_t>(1, 3)});
    if (shared > 0) {
      note(" sequence %lld shares %lld blocks of %lld", static_cast<long long>(share_to),
           static_cast<long long>(shared), static_cast<long long>(share_from));
    }
  }
  const int64_t spare = fdp.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t num_blocks = std::max<int64_t>(1, total_need - shared + spare);
  const int64_t row_stride = max_blocks + fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  for (size_t n = 0; n < order.size(); ++n) order[n] = static_cast<int32_t>(n);
  shuffle_in_place(order, rng);
  const int32_t kGarbage[] = {-1, std::numeric_limits<int32_t>::max(),
                              std::numeric_limits<int32_t>::min(), static_cast<int32_t>(num_blocks),
                              1 << 30};
  std::vector<int32_t> table(static_cast<size_t>((B - 1) * row_stride + max_blocks));
  for (int32_t& entry : table) entry = kGarbage[rng.integer(0, 4)];
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < need[static_cast<size_t>(b)]; ++n) {
      if (b == share_to && n < shared) continue;
      table[static_cast<size_t>(b * row_stride + n)] = order[next++];
    }
  }
  for (int64_t n = 0; n < shared; ++n) {
    table[static_cast<size_t>(share_to * row_stride + n)] =
        table[static_cast<size_t>(share_from * row_stride + n)];
  }
  note(" num_blocks %lld max_blocks %lld", static_cast<long long>(num_blocks),
       static_cast<long long>(max_blocks));
  // The slots some sequence reads.
  std::vector<char> live(static_cast<size_t>(num_blocks * bs), 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < used[static_cast<size_t>(b)]; ++j) {
      live[static_cast<size_t>(table[static_cast<size_t>(b * row_stride + j / bs)] * bs + j % bs)] =
          1;
    }
  }

  // ---- the caches: their dtype and layout, what the sequences read filled
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  static const mha_dtype kCacheTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16,
                                          MHA_DTYPE_I8};
  const mha_dtype cache_dtype = kCacheTypes[fdp.ConsumeIntegralInRange<int>(0, 3)];
  const bool int8 = cache_dtype == MHA_DTYPE_I8;
  const bool cache_head_major = fdp.ConsumeBool();
  const int64_t cache_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  static const float kAmps[] = {0.5f, 1.0f, 3.0f, 30.0f};
  const float qk_amp = kAmps[fdp.ConsumeIntegralInRange<int>(0, 3)];
  PagedCache kc(cache_dtype, num_blocks, bs, Hkv, D, cache_head_major, cache_pad, rng);
  PagedCache vc(cache_dtype, num_blocks, bs, Hkv, Dv, cache_head_major, cache_pad, rng);
  for (int64_t slot = 0; slot < num_blocks * bs; ++slot) {
    if (!live[static_cast<size_t>(slot)]) continue;
    kc.fill_slot(slot, qk_amp, rng);
    vc.fill_slot(slot, 1.0f, rng);
  }
  note(" cache %s%s pad %lld, q/k amplitude %g", mha_types::dtype_name(cache_dtype),
       cache_head_major ? " head-major" : "", static_cast<long long>(cache_pad),
       static_cast<double>(qk_amp));

  // ---- a step's new tokens, written into slots (mostly ones the sequences
  // read, so that attention then sees them; -1 and other negatives: padding)
  const int64_t T = fdp.ConsumeIntegralInRange<int64_t>(1, 12);
  const mha_dtype in_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const bool slots_i64 = fdp.ConsumeBool();
  std::vector<int64_t> candidates;
  const bool anywhere = fdp.ConsumeIntegralInRange<int>(0, 3) == 3;
  for (int64_t slot = 0; slot < num_blocks * bs; ++slot) {
    if (anywhere || live[static_cast<size_t>(slot)]) candidates.push_back(slot);
  }
  shuffle_in_place(candidates, rng);
  std::vector<int64_t> slots(static_cast<size_t>(T));
  size_t taken = 0;
  for (int64_t& slot : slots) {
    if (taken == candidates.size() || rng.integer(0, 5) == 0) {
      static const int64_t kPadding[] = {-1, -1, -7, std::numeric_limits<int32_t>::min()};
      slot = kPadding[rng.integer(0, 3)];
    } else {
      slot = candidates[taken++];
    }
  }
  std::vector<float> key_in(static_cast<size_t>(T * Hkv * D)),
      value_in(static_cast<size_t>(T * Hkv * Dv));
  for (float& x : key_in) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : value_in) x = rng.uniform();
  note(" T=%lld %s slots/%s%s", static_cast<long long>(T), mha_types::dtype_name(in_dtype),
       slots_i64 ? "i64" : "i32", anywhere ? " anywhere" : "");

  // ---- queries, packed [total_q, H, D]
  const bool q_head_major = fdp.ConsumeBool();
  const int64_t q_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  const PackedLayout lq_layout = packed_layout(total_q, H, D, q_head_major, q_pad, false);
  std::vector<float> qb(static_cast<size_t>(lq_layout.extent));
  for (float& x : qb) x = rng.uniform(-qk_amp, qk_amp);
  const mha_dtype q_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  note(" q %s%s pad %lld", mha_types::dtype_name(q_dtype), q_head_major ? " head-major" : "",
       static_cast<long long>(q_pad));

  // ---- specials in the queries and the new tokens
  const int specials =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 3 ? fdp.ConsumeIntegralInRange<int>(1, 4) : 0;
  for (int n = 0; n < specials; ++n) {
    const int target = fdp.ConsumeIntegralInRange<int>(0, 2);
    std::vector<float>& buf = target == 0 ? qb : (target == 1 ? key_in : value_in);
    const size_t at = fdp.ConsumeIntegral<uint32_t>() % buf.size();
    buf[at] = special_value(fdp.ConsumeIntegral<uint8_t>());
    note(" %c[%zu] = %g", "qkv"[target], at, static_cast<double>(buf[at]));
  }

  // ---- at most one way of breaking the write (decided here: one of them
  // plants a non-finite value in a row an i8 cache would quantise)
  const int write_how =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 3 ? fdp.ConsumeIntegralInRange<int>(0, 10) : -1;
  bool planted = false;
  if (write_how == 10) {
    const int64_t start = rng.integer(0, T - 1);
    for (int64_t n = 0; n < T && !planted; ++n) {
      const int64_t t = (start + n) % T;
      if (slots[static_cast<size_t>(t)] < 0) continue;
      const bool in_key = rng.chance(0.5);
      const int64_t d = in_key ? D : Dv;
      const float bad = special_value(static_cast<uint8_t>(rng.integer(0, 2)));  // NaN, ±inf
      (in_key ? key_in : value_in)[static_cast<size_t>(t * Hkv * d + rng.integer(0, Hkv * d - 1))] =
          bad;
      planted = true;
      note(" %s of token %lld = %g", in_key ? "key" : "value", static_cast<long long>(t),
           static_cast<double>(bad));
    }
  }
  bool v_has_inf = false;
  {
    bool qk_inf = false;  // as in run_case: no subnormals next to an infinity
    for (const float x : qb) qk_inf = qk_inf || std::isinf(x);
    for (const float x : key_in) qk_inf = qk_inf || std::isinf(x);
    if (qk_inf) {
      for (float& x : qb) x = is_subnormal(x) ? 0.0f : x;
      for (float& x : key_in) x = is_subnormal(x) ? 0.0f : x;
    }
    for (const float x : value_in) v_has_inf = v_has_inf || std::isinf(x);
  }

  // ---- dtypes
  mha_test::TypedCopy q_typed(describe3(qb.data(), MHA_DTYPE_F32, lq_layout), q_dtype);
  mha_test::TypedCopy key_typed(mha_test::describe(key_in.data(), MHA_DTYPE_F32, {T, Hkv, D}),
                                in_dtype);
  mha_test::TypedCopy value_typed(mha_test::describe(value_in.data(), MHA_DTYPE_F32, {T, Hkv, Dv}),
                                  in_dtype);
  bool tokens_finite = true;  // in the rows an i8 cache would take
  for (const mha_tensor* x : {&key_typed.get(), &value_typed.get()}) {
    mha_test::for_each_offset(*x, [&](int64_t at) {
      const int64_t token = at / x->strides[0];
      tokens_finite = tokens_finite && (slots[static_cast<size_t>(token)] < 0 ||
                                        std::isfinite(float_at(x->data, x->dtype, at)));
    });
  }

  // ---- mha_kv_cache_write
  std::vector<int32_t> slots32(slots.size());
  for (size_t n = 0; n < slots.size(); ++n) slots32[n] = static_cast<int32_t>(slots[n]);
  mha_tensor tkey = key_typed.get(), tvalue = value_typed.get(), tkc = kc.t, tvc = vc.t, tks = kc.s,
             tvs = vc.s;
  mha_tensor tslots = slots_i64 ? mha_test::describe(slots.data(), MHA_DTYPE_I64, {T})
                                : mha_test::describe(slots32.data(), MHA_DTYPE_I32, {T});
  mha_tensor* ks_arg = int8 ? &tks : nullptr;
  mha_tensor* vs_arg = int8 ? &tvs : nullptr;
  bool write_invalid = int8 && !tokens_finite;
  if (write_how >= 0) {
    bool applied = true;
    const size_t t = static_cast<size_t>(rng.integer(0, T - 1));
    const auto set_slot = [&](size_t at, int64_t value) {
      slots[at] = value;
      slots32[at] = static_cast<int32_t>(value);
    };
    switch (write_how) {
      case 0: {  // one slot twice
        size_t first = slots.size();
        for (size_t n = 0; n < slots.size() && first == slots.size(); ++n) {
          if (slots[n] >= 0) first = n;
        }
        if (first == slots.size() || T < 2) {
          applied = false;
        } else {
          set_slot(first == t ? (t + 1) % slots.size() : t, slots[first]);
        }
        break;
      }
      case 1:  // a slot past the cache
        set_slot(t, fdp.ConsumeBool() ? num_blocks * bs + fdp.ConsumeIntegralInRange<int64_t>(0, 2)
                                      : std::numeric_limits<int32_t>::max());
        break;
      case 2:
        tkc.shape[1] = tvc.shape[1] = bs - 4;
        break;
      case 3:
        tvalue.dtype = in_dtype == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
        break;
      case 4:
        tvc.dtype = cache_dtype == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
        break;
      case 5:
        tkey.dtype = fdp.ConsumeBool() ? MHA_DTYPE_I8 : MHA_DTYPE_BOOL;
        break;
      case 6:
        tslots.dtype = MHA_DTYPE_F32;
        break;
      case 7:
        switch (fdp.ConsumeIntegralInRange<int>(0, 3)) {
          case 0:
            tslots.shape[0] = T - 1;
            break;
          case 1:
            tkc.shape[3] = D + 1;
            break;
          case 2:
            tvc.shape[2] = Hkv + 1;
            break;
          default:
            tvc.shape[0] = num_blocks > 1 ? num_blocks - 1 : 2;
            break;
        }
        break;
      case 8:  // scales missing for an i8 cache, of the wrong shape, or given for a float one
        if (!int8) {
          ks_arg = &tks;
        } else if (fdp.ConsumeBool()) {
          (fdp.ConsumeBool() ? ks_arg : vs_arg) = nullptr;
        } else {
          tvs.shape[2] = Hkv + 1;
        }
        break;
      case 9: {  // overlaps: the caches each other, or an input inside a cache
        const int kind = fdp.ConsumeIntegralInRange<int>(0, 2);
        const size_t key_bytes = static_cast<size_t>(T * Hkv * D * element_bytes(in_dtype));
        if (kind == 0) {
          if (vc.bytes.size() <= kc.bytes.size()) {
            tvc.data = kc.bytes.data();
          } else {
            tkc.data = vc.bytes.data();
          }
        } else if (kind == 1 && int8) {
          tvs.data = kc.scales.data();
        } else if (key_bytes <= kc.bytes.size()) {
          tkey.data = kc.bytes.data();
        } else {
          tkc.data = tkey.data;
        }
        break;
      }
      default:
        applied = planted && int8;
        break;
    }
    if (applied) {
      write_invalid = true;
      note(" write broken by #%d", write_how);
    }
  }
  {
    const std::vector<unsigned char> k_before = kc.bytes, v_before = vc.bytes;
    const std::vector<float> ks_before = kc.scales, vs_before = vc.scales;
    const std::vector<unsigned char> key_before = bytes_of(key_typed.get()),
                                     value_before = bytes_of(value_typed.get());
    // Snapshots: the call sees slots through tslots.
    // NOLINTNEXTLINE(performance-unnecessary-copy-initialization)
    const std::vector<int64_t> slots_before = slots;
    // NOLINTNEXTLINE(performance-unnecessary-copy-initialization)
    const std::vector<int32_t> slots32_before = slots32;
    const mha_status status =
        mha_kv_cache_write(&tkey, &tvalue, &tkc, &tvc, &tslots, ks_arg, vs_arg);
    const std::string message = mha_last_error();
    if (bytes_of(key_typed.get()) != key_before || bytes_of(value_typed.get()) != value_before ||
        !same_bytes(slots, slots_before) || !same_bytes(slots32, slots32_before)) {
      finding("kv_cache_write: an input was modified");
    }
    if (write_invalid) {
      if (status == MHA_OK) finding("kv_cache_write: an invalid call was accepted");
      if (message.empty()) finding("kv_cache_write: a refused call left no message");
      if (!same_bytes(kc.bytes, k_before) || !same_bytes(vc.bytes, v_before) ||
          !same_bytes(kc.scales, ks_before) || !same_bytes(vc.scales, vs_before)) {
        finding("kv_cache_write: a refused call wrote into a cache");
      }
    } else {
      if (status != MHA_OK) finding("kv_cache_write: a valid call failed: " + message);
      kc.check_written(key_typed.get(), slots, k_before, ks_before, "key");
      vc.check_written(value_typed.get(), slots, v_before, vs_before, "value");
    }
  }

  // ---- mha_attention_varlen over the pages
  mha_tensor q = q_typed.get(), k = kc.t, v = vc.t, k_scale = kc.s, v_scale = vc.s;
  mha_attention_params params;
  mha_attention_params_init(&params);
  if (int8) {
    params.k_scale = &k_scale;
    params.v_scale = &v_scale;
  }
  static const int32_t kCausal[] = {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT,
                                    MHA_CAUSAL_BOTTOM_RIGHT};
  params.causal = kCausal[fdp.ConsumeIntegralInRange<int>(0, 3)];
  note(" causal %d", params.causal);
  bool expect_invalid = false;
  if (fdp.ConsumeBool()) {
    static const float kScales[] = {0.01f, 0.125f, 0.5f, 1.0f, 10.0f, -0.5f, 0.0f, kNaN};
    const int which = fdp.ConsumeIntegralInRange<int>(0, 7);
    params.has_scale = 1;
    params.scale = kScales[which];
    if (which >= 6) expect_invalid = true;
    note(" scale %g", static_cast<double>(params.scale));
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 3) {  // sometimes: a window bounds what is read
    params.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, 40);
    params.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, 40);
  }
  if (params.window_left >= 0 || params.window_right >= 0) {
    note(" window %lld,%lld", static_cast<long long>(params.window_left),
         static_cast<long long>(params.window_right));
  }
  DrawnVariants drawn;
  draw_variants(fdp, rng, B, H, B, params, drawn);

  // ---- outputs
  const bool out_head_major = fdp.ConsumeBool();
  const int64_t out_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  const PackedLayout lo_layout = packed_layout(total_q, H, Dv, out_head_major, out_pad, false);
  Guarded out_buf(lo_layout.extent);
  mha_tensor out = describe3(out_buf.base(), MHA_DTYPE_F32, lo_layout);
  const bool want_lse = fdp.ConsumeBool();
  const int64_t lse_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 1);
  Guarded lse_buf(H * (total_q + lse_pad) + 2);
  mha_tensor lse =
      mha_test::describe(lse_buf.base(), MHA_DTYPE_F32, {H, total_q}, {total_q + lse_pad, 1});
  if (want_lse) params.lse = &lse;
  mha_tensor tcu_q = mha_test::describe(cu_q.data(), MHA_DTYPE_I32, {B + 1});
  mha_tensor tused = mha_test::describe(used32.data(), MHA_DTYPE_I32, {B});
  mha_tensor ttable =
      mha_test::describe(table.data(), MHA_DTYPE_I32, {B, max_blocks}, {row_stride, 1});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &tcu_q;
  varlen.seqused_k = &tused;
  varlen.block_table = &ttable;

  // ---- at most one way of breaking the call
  std::vector<int64_t> slack(static_cast<size_t>(4 * (B + 2) * (max_blocks + 2)), 0);
  mha_tensor wrong{}, wrong_k_scale{}, wrong_v_scale{};
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 3) {
    const int how = fdp.ConsumeIntegralInRange<int>(0, 14);
    bool applied = true;
    // A sequence that has keys (a used block), from a random start.
    int64_t with_keys = -1;
    const int64_t start = rng.integer(0, B - 1);
    for (int64_t n = 0; n < B && with_keys < 0; ++n) {
      if (need[static_cast<size_t>((start + n) % B)] > 0) with_keys = (start + n) % B;
    }
    const int64_t b = rng.integer(0, B - 1);
    switch (how) {
      case 0:  // a used block id out of range or negative
      case 1:
        if (with_keys < 0) {
          applied = false;
        } else {
          static const int32_t kBadNegative[] = {-1, -2, std::numeric_limits<int32_t>::min()};
          const int32_t bad = how == 0 ? static_cast<int32_t>(num_blocks + rng.integer(0, 2))
                                       : kBadNegative[rng.integer(0, 2)];
          const int64_t n = rng.integer(0, need[static_cast<size_t>(with_keys)] - 1);
          table[static_cast<size_t>(with_keys * row_stride + n)] = bad;
          note(" block_table[%lld][%lld] = %d", static_cast<long long>(with_keys),
               static_cast<long long>(n), bad);
        }
        break;
      case 2:  // seqused_k beyond max_blocks · block_size
        used32[static_cast<size_t>(b)] = fdp.ConsumeBool()
                                             ? static_cast<int32_t>(max_blocks * bs + 1)
                                             : std::numeric_limits<int32_t>::max();
        break;
      case 3:
        used32[static_cast<size_t>(b)] =
            fdp.ConsumeBool() ? -1 : std::numeric_limits<int32_t>::min();
        break;
      case 4:
        varlen.cu_seqlens_k = &tcu_q;
        break;
      case 5:
        varlen.seqused_k = nullptr;
        break;
      case 6:  // a table of i64
        wrong = mha_test::describe(slack.data(), MHA_DTYPE_I64, {B, max_blocks});
        varlen.block_table = &wrong;
        break;
      case 7:  // a table of rank 1 or 3
        wrong = fdp.ConsumeBool()
                    ? mha_test::describe(table.data(), MHA_DTYPE_I32, {B})
                    : mha_test::describe(slack.data(), MHA_DTYPE_I32, {B, max_blocks, 1});
        varlen.block_table = &wrong;
        break;
      case 8:  // a table for another B
        wrong = mha_test::describe(slack.data(), MHA_DTYPE_I32, {B + 1, max_blocks});
        varlen.block_table = &wrong;
        break;
      case 9:  // a table whose rows are not contiguous
        wrong = mha_test::describe(slack.data(), MHA_DTYPE_I32, {B, max_blocks + 1},
                                   {2 * (max_blocks + 1), 2});
        varlen.block_table = &wrong;
        break;
      case 10:  // k or v of rank 3
        (fdp.ConsumeBool() ? k : v).ndim = 3;
        break;
      case 11:  // int8 scales of the packed layout [total_k, Hkv]; scales for a float cache
        wrong_k_scale = mha_test::describe(kc.scales.data(), MHA_DTYPE_F32, {num_blocks * bs, Hkv});
        wrong_v_scale = mha_test::describe(vc.scales.data(), MHA_DTYPE_F32, {num_blocks * bs, Hkv});
        if (int8) {
          (fdp.ConsumeBool() ? params.k_scale : params.v_scale) =
              fdp.ConsumeBool() ? &wrong_k_scale : &wrong_v_scale;
        } else {
          params.k_scale = &k_scale;
          params.v_scale = &v_scale;
        }
        break;
      case 12:  // out over a cache
        out.data = fdp.ConsumeBool() ? kc.bytes.data() : vc.bytes.data();
        break;
      case 13:
        k.shape[1] = v.shape[1] = bs - 4;
        break;
      default:  // seqused_k for another B
        wrong = mha_test::describe(used32.data(), MHA_DTYPE_I32, {B + 1});
        varlen.seqused_k = &wrong;
        break;
    }
    if (applied) {
      expect_invalid = true;
      note(" broken by #%d (sequence %lld)", how, static_cast<long long>(b));
    }
  }

  // ---- the call
  const std::vector<unsigned char> q_before = bytes_of(q_typed.get());
  const std::vector<unsigned char> k_before = kc.bytes, v_before = vc.bytes;
  const std::vector<float> ks_before = kc.scales, vs_before = vc.scales;
  const std::vector<int32_t> cu_q_before = cu_q, used_before = used32, table_before = table;
  const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
  const mha_status status = mha_attention_varlen(&q, &k, &v, &out, &varlen, &params);
  const std::string message = mha_last_error();
  if (bytes_of(q_typed.get()) != q_before || !same_bytes(kc.bytes, k_before) ||
      !same_bytes(vc.bytes, v_before) || !same_bytes(kc.scales, ks_before) ||
      !same_bytes(vc.scales, vs_before) || !same_bytes(cu_q, cu_q_before) ||
      !same_bytes(used32, used_before) || !same_bytes(table, table_before)) {
    finding("paged: an input was modified");
  }
  if (!outputs_keep_contract("paged: ", status, message, expect_invalid, out_buf, out, out_before,
                             lse_buf, lse, lse_before, want_lse)) {
    return 0;
  }

  // ---- each sequence against the reference on its keys gathered densely
  const float* lse_data = static_cast<const float*>(lse.data);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = cu_q[static_cast<size_t>(b)], lq = lens_q[static_cast<size_t>(b)];
    const int64_t lk = used[static_cast<size_t>(b)];
    if (lq == 0) continue;
    if (lk == 0) {  // zeros, LSE its sink or -inf
      for (int64_t i = q0; i < q0 + lq; ++i) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t c = 0; c < Dv; ++c) {
            const float got = static_cast<const float*>(
                out.data)[i * out.strides[0] + h * out.strides[1] + c * out.strides[2]];
            if (got != 0.0f) finding("paged: a sequence without keys has a non-zero output");
          }
          if (!want_lse) continue;
          const float want =
              params.sinks != nullptr ? drawn.sink_values[static_cast<size_t>(h)] : -kInf;
          const float got = lse_data[h * lse.strides[0] + i * lse.strides[1]];
          if (!(got == want))
            finding("paged: a sequence without keys has an LSE other than its sink");
        }
      }
      continue;
    }
    const int32_t* row = table.data() + b * row_stride;
    const Gathered gk(kc, row, lk), gv(vc, row, lk);
    mha_attention_params alone = params;
    alone.lse = nullptr;
    mha_tensor slope_row{};
    if (drawn.alibi_per_sequence) {
      slope_row = mha_test::describe(drawn.slopes.data() + b * H, MHA_DTYPE_F32, {H});
      alone.alibi_slopes = &slope_row;
    }
    if (int8) {
      alone.k_scale = &gk.s;
      alone.v_scale = &gv.s;
    }
    const Reference ref = mha_test::reference_attention(sequence_of(q, q0, lq), gk.t, gv.t, &alone);
    note(" [sequence %lld]", static_cast<long long>(b));
    const int64_t lse_strides[3] = {0, lse.strides[0], lse.strides[1]};
    compare(sequence_of(out, q0, lq), want_lse ? lse_data + q0 * lse.strides[1] : nullptr,
            lse_strides, ref, v_has_inf && ref.max_abs_logit > 40.0,
            mha_test::tolerance_for(backend, q_dtype, cache_dtype, ref, MHA_DTYPE_F32));
  }
  return 0;
}

// ------------------------------------------------------------------ backward

// mha_attention_backward on a small case: shapes (GQA, Lq != Lk, Dv != D),
// the causal mode, a window, a bool or additive mask (with dmask), valid
// lengths, dropout, softcap, ALiBi, sinks (with dsinks), inputs sometimes
// holding large values, and dtypes: q, k and v each F32, BF16 or F16, out
// and dout F32 or q's, the gradients F32 or their inputs' (drawn last, from
// bytes older corpus entries did not have: those stay all F32).  The
// forward gives out and LSE; the gradients are checked against the float64
// backward reference of the same stored values, nothing may be written
// outside dq, dk, dv -- or the call is broken in one way (a gradient of a
// dtype it cannot have among them) and must be refused with a message and
// the gradients untouched.
int run_backward_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "backward: ");
  const int64_t hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t H = hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t Lq = fdp.ConsumeIntegralInRange<int64_t>(1, 80);
  const int64_t Lk = fdp.ConsumeIntegralInRange<int64_t>(1, 150);
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  note(" B %lld H %lld/%lld Lq %lld Lk %lld D %lld Dv %lld", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(hkv), static_cast<long long>(Lq),
       static_cast<long long>(Lk), static_cast<long long>(D), static_cast<long long>(Dv));
  mha_test::Rng rng(fdp.ConsumeIntegral<uint32_t>());
  const float amplitude = fdp.ConsumeBool() ? 1.0f : 8.0f;
  std::vector<float> q(static_cast<size_t>(B * H * Lq * D)),
      k(static_cast<size_t>(B * hkv * Lk * D)), v(static_cast<size_t>(B * hkv * Lk * Dv)),
      dout(static_cast<size_t>(B * H * Lq * Dv)), out(dout.size()),
      lse(static_cast<size_t>(B * H * Lq));
  for (auto* x : {&q, &k}) {
    for (float& f : *x) f = rng.uniform(-amplitude, amplitude);
  }
  for (auto* x : {&v, &dout}) {
    for (float& f : *x) f = rng.uniform(-1.0f, 1.0f);
  }
  const mha_tensor q32 = mha_test::describe(q.data(), MHA_DTYPE_F32, {B, H, Lq, D});
  const mha_tensor k32 = mha_test::describe(k.data(), MHA_DTYPE_F32, {B, hkv, Lk, D});
  const mha_tensor v32 = mha_test::describe(v.data(), MHA_DTYPE_F32, {B, hkv, Lk, Dv});
  const mha_tensor dout32 = mha_test::describe(dout.data(), MHA_DTYPE_F32, {B, H, Lq, Dv});
  mha_tensor tlse = mha_test::describe(lse.data(), MHA_DTYPE_F32, {B, H, Lq});

  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  if (fdp.ConsumeBool()) params.window_left = fdp.ConsumeIntegralInRange<int64_t>(0, 60);
  if (fdp.ConsumeBool()) params.window_right = fdp.ConsumeIntegralInRange<int64_t>(0, 60);
  const int mask_kind = fdp.ConsumeIntegralInRange<int>(0, 2);
  std::vector<uint8_t> mask_bool;
  std::vector<float> mask_add, dmask;
  mha_tensor tmask{}, tdmask{};
  if (mask_kind == 1) {
    mask_bool.resize(static_cast<size_t>(Lq * Lk));
    for (auto& m : mask_bool) m = rng.chance(0.8) ? 1 : 0;
    tmask = mha_test::describe(mask_bool.data(), MHA_DTYPE_BOOL, {Lq, Lk});
    params.mask = &tmask;
  } else if (mask_kind == 2) {
    mask_add.resize(static_cast<size_t>(B * Lq * Lk));
    for (auto& m : mask_add) m = rng.chance(0.1) ? -kInf : rng.uniform(-2.0f, 2.0f);
    tmask = mha_test::describe(mask_add.data(), MHA_DTYPE_F32, {B, 1, Lq, Lk});
    params.mask = &tmask;
    dmask.assign(mask_add.size(), 0.0f);
    tdmask = mha_test::describe(dmask.data(), MHA_DTYPE_F32, {B, 1, Lq, Lk});
  }
  std::vector<int32_t> lens(static_cast<size_t>(B));
  mha_tensor tlens{};
  if (fdp.ConsumeBool()) {
    for (auto& l : lens) l = static_cast<int32_t>(rng.integer(0, Lk));
    tlens = mha_test::describe(lens.data(), MHA_DTYPE_I32, {B});
    params.valid_lens = &tlens;
  }
  if (fdp.ConsumeBool()) {
    params.dropout_p = 0.25f;
    params.dropout_seed = fdp.ConsumeIntegral<uint64_t>();
  }
  if (fdp.ConsumeBool()) params.softcap = fdp.ConsumeBool() ? 1.5f : 30.0f;
  std::vector<float> slopes(static_cast<size_t>(H)), sinks(static_cast<size_t>(H)),
      dsinks(static_cast<size_t>(H), 0.0f);
  mha_tensor tslopes{}, tsinks{}, tdsinks{};
  if (fdp.ConsumeBool()) {
    for (auto& s : slopes) s = rng.uniform(0.0f, 0.5f);
    tslopes = mha_test::describe(slopes.data(), MHA_DTYPE_F32, {H});
    params.alibi_slopes = &tslopes;
  }
  const bool with_sinks = fdp.ConsumeBool();
  if (with_sinks) {
    for (auto& s : sinks) s = rng.chance(0.2) ? -kInf : rng.uniform(-2.0f, 3.0f);
    tsinks = mha_test::describe(sinks.data(), MHA_DTYPE_F32, {H});
    params.sinks = &tsinks;
    tdsinks = mha_test::describe(dsinks.data(), MHA_DTYPE_F32, {H});
  }
  note(" causal %d window %lld,%lld mask %d lens %d dropout %g softcap %g alibi %d sinks %d",
       params.causal, static_cast<long long>(params.window_left),
       static_cast<long long>(params.window_right), mask_kind, params.valid_lens != nullptr,
       static_cast<double>(params.dropout_p), static_cast<double>(params.softcap),
       params.alibi_slopes != nullptr, with_sinks);
  mha_backward_params backward;
  mha_backward_params_init(&backward);
  if (mask_kind == 2 && fdp.ConsumeBool()) backward.dmask = &tdmask;
  if (with_sinks && fdp.ConsumeBool()) backward.dsinks = &tdsinks;
  const int breaking = fdp.ConsumeIntegralInRange<int>(0, 15);

  // The dtypes (0, all an older entry has left: every tensor F32).
  const uint8_t pick = fdp.ConsumeIntegral<uint8_t>();
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  const mha_dtype q_dtype = kFloatTypes[pick % 3], kv_dtype = kFloatTypes[pick / 3 % 3];
  const mha_dtype out_dtype = pick / 9 % 2 != 0 ? q_dtype : MHA_DTYPE_F32;
  const mha_dtype dout_dtype = pick / 18 % 2 != 0 ? q_dtype : MHA_DTYPE_F32;
  const bool half_grads = pick / 36 % 2 != 0;
  const mha_dtype dq_dtype = half_grads ? q_dtype : MHA_DTYPE_F32;
  const mha_dtype dkv_dtype = half_grads ? kv_dtype : MHA_DTYPE_F32;
  note(" dtypes q %s kv %s out %s dout %s grads %s", mha_types::dtype_name(q_dtype),
       mha_types::dtype_name(kv_dtype), mha_types::dtype_name(out_dtype),
       mha_types::dtype_name(dout_dtype), half_grads ? "as inputs" : "f32");
  mha_test::TypedCopy q_typed(q32, q_dtype), k_typed(k32, kv_dtype), v_typed(v32, kv_dtype),
      dout_typed(dout32, dout_dtype);
  mha_tensor tq = q_typed.get(), tk = k_typed.get(), tv = v_typed.get(), tdout = dout_typed.get();
  // out in its dtype in the float vector (a half tensor takes half its bytes).
  mha_tensor tout = mha_test::describe(out.data(), out_dtype, {B, H, Lq, Dv});

  params.lse = &tlse;
  if (mha_attention(&tq, &tk, &tv, &tout, &params) != MHA_OK) {
    finding(std::string("the forward failed: ") + mha_last_error());
  }
  params.lse = nullptr;

  Guarded dq(B * H * Lq * D), dk(B * hkv * Lk * D), dv(B * hkv * Lk * Dv);
  mha_tensor tdq = mha_test::describe(dq.base(), dq_dtype, {B, H, Lq, D});
  mha_tensor tdk = mha_test::describe(dk.base(), dkv_dtype, {B, hkv, Lk, D});
  mha_tensor tdv = mha_test::describe(dv.base(), dkv_dtype, {B, hkv, Lk, Dv});

  // At most one way of breaking the call.
  bool broken = true;
  mha_tensor wrong{};
  switch (breaking) {
    case 0:
      tdq.shape[3] += 1;
      note(" broken: dq's head size");
      break;
    case 1:
      tdk.shape[1] += 1;
      note(" broken: dk's KV heads");
      break;
    case 2:
      tdv = tdk;
      note(" broken: dv over dk");
      break;
    case 3:
      tlse.shape[2] += 1;
      note(" broken: lse's length");
      break;
    case 4:
      wrong = tq;
      wrong.data = nullptr;
      tq = wrong;
      note(" broken: q->data NULL");
      break;
    case 5:
      backward.struct_size = 5;
      note(" broken: backward->struct_size");
      break;
    case 6:
      tdq = tq;
      note(" broken: dq over q");
      break;
    default:
      broken = false;
  }
  if (!broken && pick >= 216) {  // 40 of 256: a gradient of a dtype it cannot have
    mha_tensor& grad = pick % 2 != 0 ? tdq : tdv;
    const mha_dtype input = pick % 2 != 0 ? q_dtype : kv_dtype;
    grad.dtype = input == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
    broken = true;
    note(" broken: %s of dtype %s", pick % 2 != 0 ? "dq" : "dv", mha_types::dtype_name(grad.dtype));
  }
  const std::vector<float> dq_before = dq.all, dk_before = dk.all, dv_before = dv.all;
  const mha_status status = mha_attention_backward(&tq, &tk, &tv, &tout, &tlse, &tdout, &tdq, &tdk,
                                                   &tdv, &params, &backward);
  const std::string message = mha_last_error();
  if (broken) {
    if (status == MHA_OK) finding("backward: an invalid call was accepted");
    if (message.empty()) finding("backward: a refused call left no message");
    if (!same_bytes(dq.all, dq_before) || !same_bytes(dk.all, dk_before) ||
        !same_bytes(dv.all, dv_before)) {
      finding("backward: a refused call modified a gradient");
    }
    return 0;
  }
  if (status != MHA_OK) finding("backward: a valid call failed: " + message);
  if (changed_outside(dq, tdq, dq_before) != 0 || changed_outside(dk, tdk, dk_before) != 0 ||
      changed_outside(dv, tdv, dv_before) != 0) {
    finding("backward: written outside a gradient");
  }
  // Unless every input is F32, delta is dout · the out given (the forward's
  // rounding of a half out, or of P on avx512bf16, is not the backward's
  // error: reference_backward.h, test_backward's reference_of).
  const bool all_f32 = q_dtype == MHA_DTYPE_F32 && kv_dtype == MHA_DTYPE_F32 &&
                       out_dtype == MHA_DTYPE_F32 && dout_dtype == MHA_DTYPE_F32;
  const mha_test::BackwardReference ref = mha_test::reference_backward(
      tq, tk, tv, tdout, &params, backward.dmask != nullptr, all_f32 ? nullptr : &tout);
  const auto check = [&](const mha_tensor& got, const std::vector<double>& want, double terms,
                         const char* name) {
    const double error = mha_test::gradient_error(got, want, terms, ref.max_abs_logit);
    if (!(error <= 1.0)) {
      char text[160];
      std::snprintf(text, sizeof text, "backward: %s off by %.3g times its tolerance", name, error);
      finding(text);
    }
  };
  check(tdq, ref.dq, ref.terms_dq, "dq");
  check(tdk, ref.dk, ref.terms_dk, "dk");
  check(tdv, ref.dv, ref.terms_dv, "dv");
  return 0;
}

// A [B, L, F] float tensor over a guarded buffer, batch- or sequence-first.
mha_tensor rows3(Guarded& g, int64_t b, int64_t l, int64_t f, bool seq_first) {
  return mha_test::describe(
      g.base(), MHA_DTYPE_F32, {b, l, f},
      seq_first ? std::vector<int64_t>{f, b * f, 1} : std::vector<int64_t>{l * f, f, 1});
}

// A module and the data and parameters of one call, drawn from the fuzzer's
// bytes for the forward and the backward cases alike: any feature sizes,
// self-attention (inputs 2), key = value (1) or three inputs (0), either
// layout, every mask and variant, dropout in training mode; the weights and
// the data random.  The bytes are read in one fixed order, so that the
// corpus's module entries keep their meaning.  `dout` (the backward's output
// gradient) is drawn only when asked for.
struct ModuleSetup {
  int64_t B = 0, H = 0, E = 0, Lq = 0, Lk = 0, Eq = 0, Ek = 0, Ev = 0;
  int inputs = 0;
  bool bias = false, seq_first = false, with_sinks = false;
  int kpm_kind = 0, am_kind = 0;
  mha_test::Rng rng{0};
  mha_module_config config{};
  mha_module* module = nullptr;
  mha_test::ModuleWeights w;
  Guarded xq{0}, xk{0}, xv{0}, gout{0};
  mha_tensor query{}, key{}, value{}, dout{};
  mha_module_forward_params params{};
  mha_test::ModuleInputs in;
  std::vector<uint8_t> kpm_bool, am_bool;
  std::vector<float> kpm_f32, am_f32, slopes, sinks;
  std::vector<int32_t> lens;
  mha_tensor tkpm{}, tam{}, tlens{}, tslopes{}, tsinks{};

  ModuleSetup(FuzzedDataProvider& fdp, bool with_dout) {
    B = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
    H = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
    E = H * fdp.ConsumeIntegralInRange<int64_t>(1, 8);
    inputs = fdp.ConsumeIntegralInRange<int>(0, 2);
    Lq = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
    Lk = inputs == 2 ? Lq : fdp.ConsumeIntegralInRange<int64_t>(1, 70);
    Eq = inputs == 2 || fdp.ConsumeBool() ? E : fdp.ConsumeIntegralInRange<int64_t>(1, 20);
    Ek = inputs == 2 || fdp.ConsumeBool() ? Eq : fdp.ConsumeIntegralInRange<int64_t>(1, 20);
    Ev = inputs != 0 ? Ek : fdp.ConsumeIntegralInRange<int64_t>(1, 20);
    bias = fdp.ConsumeBool();
    seq_first = fdp.ConsumeBool();
    note(" B %lld H %lld E %lld Eq/Ek/Ev %lld/%lld/%lld Lq %lld Lk %lld inputs %d bias %d seq %d",
         static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(E),
         static_cast<long long>(Eq), static_cast<long long>(Ek), static_cast<long long>(Ev),
         static_cast<long long>(Lq), static_cast<long long>(Lk), inputs, bias, seq_first);
    rng = mha_test::Rng(fdp.ConsumeIntegral<uint32_t>());

    mha_module_config_init(&config);
    config.embed_dim = E;
    config.num_heads = H;
    config.query_dim = Eq;
    config.key_dim = Ek;
    config.value_dim = Ev;
    config.bias = bias ? 1 : 0;
    config.dropout = fdp.ConsumeBool() ? 0.25f : 0.0f;
    if (mha_module_create(&config, &module) != MHA_OK) {
      finding(std::string("module create failed: ") + mha_last_error());
    }
    set_weights();
    draw_data(with_dout);
    draw_params(fdp);
  }
  ~ModuleSetup() { mha_module_destroy(module); }
  ModuleSetup(const ModuleSetup&) = delete;
  ModuleSetup& operator=(const ModuleSetup&) = delete;

 private:
  void set(const char* name, int64_t rows, int64_t cols, std::vector<double>& kept) {
    std::vector<float> values(static_cast<size_t>(rows * std::max<int64_t>(cols, 1)));
    for (float& x : values) x = rng.uniform(-0.5f, 0.5f);
    kept.assign(values.begin(), values.end());
    const mha_tensor t = cols == 0 ? mha_test::describe(values.data(), MHA_DTYPE_F32, {rows})
                                   : mha_test::describe(values.data(), MHA_DTYPE_F32, {rows, cols});
    if (mha_module_set_weight(module, name, &t) != MHA_OK) {
      finding(std::string("set_weight failed: ") + mha_last_error());
    }
  }

  void set_weights() {
    w.embed_dim = E;
    w.num_heads = H;
    w.query_dim = Eq;
    w.key_dim = Ek;
    w.value_dim = Ev;
    set("q_proj_weight", E, Eq, w.w_q);
    set("k_proj_weight", E, Ek, w.w_k);
    set("v_proj_weight", E, Ev, w.w_v);
    set("out_proj.weight", E, E, w.w_o);
    w.b_q.assign(static_cast<size_t>(E), 0.0);
    w.b_k = w.b_v = w.b_o = w.b_q;
    if (bias) {
      std::vector<double> in_bias;
      set("in_proj_bias", 3 * E, 0, in_bias);
      w.b_q.assign(in_bias.begin(), in_bias.begin() + E);
      w.b_k.assign(in_bias.begin() + E, in_bias.begin() + 2 * E);
      w.b_v.assign(in_bias.begin() + 2 * E, in_bias.end());
      set("out_proj.bias", E, 0, w.b_o);
    }
  }

  void draw_data(bool with_dout) {
    xq = Guarded(B * Lq * Eq);
    xk = Guarded(B * Lk * Ek);
    xv = Guarded(B * Lk * Ev);
    gout = Guarded(with_dout ? B * Lq * E : 0);
    query = rows3(xq, B, Lq, Eq, seq_first);
    key = inputs == 2 ? query : rows3(xk, B, Lk, Ek, seq_first);
    value = inputs != 0 ? key : rows3(xv, B, Lk, Ev, seq_first);
    if (with_dout) dout = rows3(gout, B, Lq, E, seq_first);
    for (const mha_tensor* t : {&query, &key, &value, &dout}) {
      if (t->data == nullptr) continue;
      mha_test::for_each_offset(
          *t, [&](int64_t at) { static_cast<float*>(t->data)[at] = rng.uniform(-1.0f, 1.0f); });
    }
  }

  void draw_params(FuzzedDataProvider& fdp) {
    mha_module_forward_params_init(&params);
    in.query = &query;
    in.key = &key;
    in.value = &value;
    params.causal = in.causal = fdp.ConsumeIntegralInRange<int32_t>(0, 2);
    if (fdp.ConsumeBool())
      params.window_left = in.window_left = fdp.ConsumeIntegralInRange<int64_t>(0, 30);
    if (fdp.ConsumeBool())
      params.window_right = in.window_right = fdp.ConsumeIntegralInRange<int64_t>(0, 30);
    if (config.dropout > 0.0f && fdp.ConsumeBool()) {
      params.training = 1;
      params.dropout_seed = in.dropout_seed = fdp.ConsumeIntegral<uint64_t>();
      in.dropout_p = static_cast<double>(config.dropout);
    }
    if (fdp.ConsumeBool()) {
      params.softcap = fdp.ConsumeBool() ? 1.5f : 30.0f;
      in.softcap = static_cast<double>(params.softcap);
    }
    slopes.resize(static_cast<size_t>(H));
    sinks.resize(static_cast<size_t>(H));
    lens.resize(static_cast<size_t>(B));
    kpm_kind = fdp.ConsumeIntegralInRange<int>(0, 2);
    if (kpm_kind == 1) {
      kpm_bool.resize(static_cast<size_t>(B * Lk));
      for (auto& m : kpm_bool) m = rng.chance(0.2) ? 1 : 0;
      tkpm = mha_test::describe(kpm_bool.data(), MHA_DTYPE_BOOL, {B, Lk});
    } else if (kpm_kind == 2) {
      kpm_f32.resize(static_cast<size_t>(B * Lk));
      for (auto& m : kpm_f32) m = rng.chance(0.1) ? -kInf : rng.uniform(-2.0f, 2.0f);
      tkpm = mha_test::describe(kpm_f32.data(), MHA_DTYPE_F32, {B, Lk});
    }
    if (kpm_kind != 0) params.key_padding_mask = in.key_padding_mask = &tkpm;
    am_kind = fdp.ConsumeIntegralInRange<int>(0, 2);
    if (am_kind == 1) {
      am_bool.resize(static_cast<size_t>(Lq * Lk));
      for (auto& m : am_bool) m = rng.chance(0.2) ? 1 : 0;
      tam = mha_test::describe(am_bool.data(), MHA_DTYPE_BOOL, {Lq, Lk});
    } else if (am_kind == 2) {
      am_f32.resize(static_cast<size_t>(B * H * Lq * Lk));
      for (auto& m : am_f32) m = rng.uniform(-2.0f, 2.0f);
      tam = mha_test::describe(am_f32.data(), MHA_DTYPE_F32, {B * H, Lq, Lk});
    }
    if (am_kind != 0) params.attn_mask = in.attn_mask = &tam;
    if (fdp.ConsumeBool()) {
      for (auto& l : lens) l = static_cast<int32_t>(rng.integer(0, Lk));
      tlens = mha_test::describe(lens.data(), MHA_DTYPE_I32, {B});
      params.valid_lens = in.valid_lens = &tlens;
    }
    if (fdp.ConsumeBool()) {
      for (auto& x : slopes) x = rng.uniform(0.0f, 0.5f);
      tslopes = mha_test::describe(slopes.data(), MHA_DTYPE_F32, {H});
      params.alibi_slopes = in.alibi_slopes = &tslopes;
    }
    with_sinks = fdp.ConsumeBool();
    if (with_sinks) {
      for (auto& x : sinks) x = rng.chance(0.2) ? -kInf : rng.uniform(-2.0f, 3.0f);
      tsinks = mha_test::describe(sinks.data(), MHA_DTYPE_F32, {H});
      params.sinks = in.sinks = &tsinks;
    }
    note(" causal %d window %lld,%lld dropout %d softcap %g kpm %d am %d lens %d alibi %d sinks %d",
         params.causal, static_cast<long long>(params.window_left),
         static_cast<long long>(params.window_right), params.training,
         static_cast<double>(params.softcap), kpm_kind, am_kind, params.valid_lens != nullptr,
         params.alibi_slopes != nullptr, with_sinks);
  }
};

int run_module_backward_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "module backward: ");
  ModuleSetup m(fdp, true);
  const int64_t B = m.B, H = m.H, E = m.E, Lq = m.Lq, Lk = m.Lk, Eq = m.Eq, Ek = m.Ek, Ev = m.Ev;
  const int inputs = m.inputs;
  const bool bias = m.bias, with_sinks = m.with_sinks;
  mha_tensor &query = m.query, &key = m.key, &value = m.value, &dout = m.dout;
  mha_module* module = m.module;
  const mha_module_forward_params& params = m.params;

  // The gradients: each wanted or not; the inputs' in either layout, shared
  // (summed) where the inputs are.
  const bool grads_seq = fdp.ConsumeBool();
  Guarded gq(B * Lq * Eq), gk(B * Lk * Ek), gv(B * Lk * Ev), gwq(E * Eq), gwk(E * Ek), gwv(E * Ev),
      gwo(E * E), gbq(E), gbk(E), gbv(E), gbo(E), gs(H);
  mha_tensor dq = rows3(gq, B, Lq, Eq, grads_seq);
  mha_tensor dk = inputs == 2 ? dq : rows3(gk, B, Lk, Ek, grads_seq);
  mha_tensor dv = inputs != 0 ? dk : rows3(gv, B, Lk, Ev, grads_seq);
  mha_tensor dwq = mha_test::describe(gwq.base(), MHA_DTYPE_F32, {E, Eq});
  mha_tensor dwk = mha_test::describe(gwk.base(), MHA_DTYPE_F32, {E, Ek});
  mha_tensor dwv = mha_test::describe(gwv.base(), MHA_DTYPE_F32, {E, Ev});
  mha_tensor dwo = mha_test::describe(gwo.base(), MHA_DTYPE_F32, {E, E});
  mha_tensor dbq = mha_test::describe(gbq.base(), MHA_DTYPE_F32, {E});
  mha_tensor dbk = mha_test::describe(gbk.base(), MHA_DTYPE_F32, {E});
  mha_tensor dbv = mha_test::describe(gbv.base(), MHA_DTYPE_F32, {E});
  mha_tensor dbo = mha_test::describe(gbo.base(), MHA_DTYPE_F32, {E});
  mha_tensor ds = mha_test::describe(gs.base(), MHA_DTYPE_F32, {H});
  mha_module_gradients grads;
  mha_module_gradients_init(&grads);
  const auto maybe = [&](mha_tensor* t) {
    return fdp.ConsumeProbability<float>() < 0.8f ? t : nullptr;
  };
  grads.query = maybe(&dq);
  grads.key = inputs == 2 ? grads.query : maybe(&dk);
  grads.value = inputs != 0 ? grads.key : maybe(&dv);
  grads.q_proj_weight = maybe(&dwq);
  grads.k_proj_weight = maybe(&dwk);
  grads.v_proj_weight = maybe(&dwv);
  grads.out_proj_weight = maybe(&dwo);
  if (bias) {
    grads.q_proj_bias = maybe(&dbq);
    grads.k_proj_bias = maybe(&dbk);
    grads.v_proj_bias = maybe(&dbv);
    grads.out_proj_bias = maybe(&dbo);
  }
  if (with_sinks) grads.sinks = maybe(&ds);

  // At most one way of breaking the call.
  bool broken = true;
  mha_tensor wrong{};
  switch (fdp.ConsumeIntegralInRange<int>(0, 12)) {
    case 0:
      dout.shape[2] += 1;
      note(" broken: dout's features");
      break;
    case 1:
      dwq.shape[1] += 1;
      grads.q_proj_weight = &dwq;
      note(" broken: q_proj_weight's shape");
      break;
    case 2:
      wrong = key;
      grads.key = &wrong;
      note(" broken: grads->key over key");
      break;
    case 3:
      grads.struct_size = 7;
      note(" broken: grads->struct_size");
      break;
    case 4:
      if (bias) {
        broken = false;
        break;
      }
      grads.out_proj_bias = &dbo;
      note(" broken: a bias gradient without biases");
      break;
    case 5:
      grads.out_proj_weight = &dwq;
      grads.q_proj_weight = &dwq;
      note(" broken: one buffer for two weights");
      break;
    default:
      broken = false;
  }
  std::vector<std::vector<float>> before;
  Guarded* buffers[] = {&gq, &gk, &gv, &gwq, &gwk, &gwv, &gwo, &gbq, &gbk, &gbv, &gbo, &gs};
  for (Guarded* g : buffers) before.push_back(g->all);
  const auto untouched = [&] {
    for (size_t n = 0; n < std::size(buffers); ++n) {
      if (!same_bytes(buffers[n]->all, before[n])) return false;
    }
    return true;
  };
  const mha_status status =
      mha_module_backward(module, &query, &key, &value, &dout, &params, &grads);
  const std::string message = mha_last_error();
  if (broken) {
    if (status == MHA_OK) finding("module backward: an invalid call was accepted");
    if (message.empty()) finding("module backward: a refused call left no message");
    if (!untouched()) finding("module backward: a refused call modified a gradient");
    return 0;
  }
  if (status != MHA_OK) finding("module backward: a valid call failed: " + message);
  const mha_test::ModuleBackwardReference ref =
      mha_test::reference_module_backward(m.w, m.in, dout);
  const auto check = [&](const mha_tensor* got, const Guarded& g, size_t index,
                         std::vector<const mha_test::ReferenceGradient*> want, const char* name) {
    if (got == nullptr) {
      if (!same_bytes(g.all, before[index]))
        finding(std::string("module backward: ") + name + " written but not asked for");
      return;
    }
    if (changed_outside(g, *got, before[index]) != 0) {
      finding(std::string("module backward: written outside ") + name);
    }
    std::vector<double> value = want[0]->value;
    double tol = want[0]->tolerance;
    for (size_t n = 1; n < want.size(); ++n) {
      for (size_t i = 0; i < value.size(); ++i) value[i] += want[n]->value[i];
      tol += want[n]->tolerance;
    }
    double error = 0;
    size_t i = 0;
    mha_test::for_each_offset(*got, [&](int64_t at) {
      const double diff =
          std::fabs(static_cast<double>(static_cast<const float*>(got->data)[at]) - value[i++]);
      error = std::isnan(diff) ? kInfD : std::max(error, diff);
    });
    if (!(error <= tol)) {
      char text[160];
      std::snprintf(text, sizeof text, "module backward: %s off by %.3g (tolerance %.3g)", name,
                    error, tol);
      finding(text);
    }
  };
  if (inputs == 2) {
    check(grads.query, gq, 0, {&ref.query, &ref.key, &ref.value}, "dquery (= dkey = dvalue)");
  } else {
    check(grads.query, gq, 0, {&ref.query}, "dquery");
    if (inputs == 1) {
      check(grads.key, gk, 1, {&ref.key, &ref.value}, "dkey (= dvalue)");
    } else {
      check(grads.key, gk, 1, {&ref.key}, "dkey");
      check(grads.value, gv, 2, {&ref.value}, "dvalue");
    }
  }
  check(grads.q_proj_weight, gwq, 3, {&ref.w_q}, "q_proj_weight");
  check(grads.k_proj_weight, gwk, 4, {&ref.w_k}, "k_proj_weight");
  check(grads.v_proj_weight, gwv, 5, {&ref.w_v}, "v_proj_weight");
  check(grads.out_proj_weight, gwo, 6, {&ref.w_o}, "out_proj_weight");
  check(grads.q_proj_bias, gbq, 7, {&ref.b_q}, "q_proj_bias");
  check(grads.k_proj_bias, gbk, 8, {&ref.b_k}, "k_proj_bias");
  check(grads.v_proj_bias, gbv, 9, {&ref.b_v}, "v_proj_bias");
  check(grads.out_proj_bias, gbo, 10, {&ref.b_o}, "out_proj_bias");
  if (with_sinks) check(grads.sinks, gs, 11, {&ref.sinks}, "sinks");
  return 0;
}

// mha_module_forward: the module drawn as for the backward case, the output
// in either layout, the attention weights per head, averaged over the heads,
// or not wanted -- against the module's float64 reference within its error
// bounds, with nothing written outside out and the weights and the inputs
// left alone; or the call broken in one way and refused with nothing written.
int run_module_forward_case(FuzzedDataProvider& fdp) {
  start_case(fdp, "module forward: ");
  ModuleSetup m(fdp, false);
  const int64_t B = m.B, H = m.H, Lq = m.Lq, Lk = m.Lk;
  const bool out_seq_first = fdp.ConsumeBool();
  Guarded out_buf(B * Lq * m.E);
  mha_tensor out = rows3(out_buf, B, Lq, m.E, out_seq_first);
  const int weights_kind = fdp.ConsumeIntegralInRange<int>(0, 2);  // none, per head, averaged
  Guarded weights_buf(weights_kind == 0 ? 0 : (weights_kind == 1 ? B * H : B) * Lq * Lk);
  mha_tensor weights{};
  mha_module_forward_params params = m.params;
  if (weights_kind != 0) {
    weights = weights_kind == 1
                  ? mha_test::describe(weights_buf.base(), MHA_DTYPE_F32, {B, H, Lq, Lk})
                  : mha_test::describe(weights_buf.base(), MHA_DTYPE_F32, {B, Lq, Lk});
    params.attn_weights = &weights;
    params.average_attn_weights = weights_kind == 2 ? 1 : 0;
  }
  note(" out seq %d weights %d", out_seq_first, weights_kind);

  // At most one way of breaking the call.
  bool broken = true;
  mha_module* module = m.module;
  const mha_tensor* query = &m.query;
  mha_tensor wrong{};
  // An optional input one element longer along `dim`: refused; absent, the
  // call stays valid.
  const auto grow = [&](const mha_tensor*& input, int dim, const char* name) {
    if (input == nullptr) {
      broken = false;
      return;
    }
    wrong = *input;
    wrong.shape[dim] += 1;
    input = &wrong;
    note(" broken: %s's shape", name);
  };
  switch (fdp.ConsumeIntegralInRange<int>(0, 20)) {
    case 0:
      out.shape[2] += 1;
      note(" broken: out's features");
      break;
    case 1:
      out.dtype = MHA_DTYPE_BF16;
      note(" broken: out in bf16");
      break;
    case 2:
      wrong = m.query;
      wrong.shape[2] += 1;
      query = &wrong;
      note(" broken: query's features");
      break;
    case 3:
      if (weights_kind == 0) {
        broken = false;
        break;
      }
      weights.shape[weights.ndim - 1] += 1;
      note(" broken: attn_weights' shape");
      break;
    case 4:
      grow(params.key_padding_mask, 1, "key_padding_mask");
      break;
    case 5:
      grow(params.attn_mask, 0, "attn_mask");
      break;
    case 6:
      grow(params.valid_lens, 0, "valid_lens");
      break;
    case 7:
      params.struct_size = 7;
      note(" broken: params->struct_size");
      break;
    case 8:
      out.data = m.query.data;
      note(" broken: out over query");
      break;
    case 9:
      if (weights_kind == 0) {
        broken = false;
        break;
      }
      weights.data = out.data;
      note(" broken: attn_weights over out");
      break;
    case 10:
      params.causal = 3;
      note(" broken: params->causal");
      break;
    case 11:
      params.softcap = -1.0f;
      note(" broken: a negative softcap");
      break;
    case 12:
      module = nullptr;
      note(" broken: no module");
      break;
    case 13:
      query = nullptr;
      note(" broken: no query");
      break;
    default:
      broken = false;
  }

  Guarded* buffers[] = {&out_buf, &weights_buf, &m.xq, &m.xk, &m.xv};
  std::vector<std::vector<float>> before;
  for (Guarded* g : buffers) before.push_back(g->all);
  const mha_status status = mha_module_forward(module, query, &m.key, &m.value, &out, &params);
  const std::string message = mha_last_error();
  for (size_t n = 2; n < std::size(buffers); ++n) {
    if (!same_bytes(buffers[n]->all, before[n])) finding("module forward: an input was modified");
  }
  if (broken) {
    if (status == MHA_OK) finding("module forward: an invalid call was accepted");
    if (message.empty()) finding("module forward: a refused call left no message");
    if (!same_bytes(out_buf.all, before[0]) || !same_bytes(weights_buf.all, before[1])) {
      finding("module forward: a refused call wrote its output");
    }
    return 0;
  }
  if (status != MHA_OK) finding("module forward: a valid call failed: " + message);
  if (changed_outside(out_buf, out, before[0]) != 0) finding("module forward: written outside out");
  if (weights_kind != 0 && changed_outside(weights_buf, weights, before[1]) != 0) {
    finding("module forward: written outside attn_weights");
  }
  const mha_test::ModuleReference ref = mha_test::reference_module(m.w, m.in);
  const auto check = [](const mha_tensor& got, const std::vector<double>& want,
                        const std::vector<double>& bound, const char* name) {
    const mha_test::BoundCheck c = mha_test::check_within(got, want, bound);
    if (c.outside != 0) {
      note(" %lld of %lld outside, worst %.3g of the bound; first: %s",
           static_cast<long long>(c.outside), static_cast<long long>(c.elements), c.worst_ratio,
           c.first.c_str());
      finding(std::string("module forward: ") + name + " off");
    }
  };
  check(out, ref.out, ref.out_bound, "out");
  if (weights_kind == 1) check(weights, ref.weights, ref.weights_bound, "attn_weights");
  if (weights_kind == 2) check(weights, ref.average, ref.average_bound, "averaged attn_weights");
  return 0;
}

// ------------------------------------------------------------------ blocks

// A call as one block of a larger problem (params' query_offset, key_offset,
// full_lq, full_lk): any layout, the rules of positions (causal in either
// alignment, a window, ALiBi, softcap), a block that fits or one that does
// not (refused, nothing written); the result against the float64 reference
// of that block.
int run_block_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "block: ");
  mha_test::Rng rng(fdp.ConsumeIntegral<uint16_t>());
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t Lq = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Lk = fdp.ConsumeIntegralInRange<int64_t>(1, 90);
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int order = fdp.ConsumeIntegralInRange<int>(0, kOrderCount - 1);
  note(" B%lld H%lld/%lld Lq%lld Lk%lld D%lld/%lld order %d", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(Hkv), static_cast<long long>(Lq),
       static_cast<long long>(Lk), static_cast<long long>(D), static_cast<long long>(Dv), order);
  const int64_t qs[4] = {B, H, Lq, D}, ks[4] = {B, Hkv, Lk, D}, vs[4] = {B, Hkv, Lk, Dv};
  const int64_t os[4] = {B, H, Lq, Dv};
  const Layout lq_ = make_layout(qs, order, 1, 0, false), lk_ = make_layout(ks, order, 0, 0, false);
  const Layout lv_ = make_layout(vs, order, 2, 0, false), lo_ = make_layout(os, order, 0, 0, false);
  std::vector<float> qb(static_cast<size_t>(lq_.extent)), kb(static_cast<size_t>(lk_.extent));
  std::vector<float> vb(static_cast<size_t>(lv_.extent));
  for (float& x : qb) x = rng.uniform(-2.0f, 2.0f);
  for (float& x : kb) x = rng.uniform(-2.0f, 2.0f);
  for (float& x : vb) x = rng.uniform();
  Guarded out_buf(lo_.extent), lse_buf(B * H * Lq);
  const mha_tensor q = describe4(qb.data(), MHA_DTYPE_F32, lq_);
  const mha_tensor k = describe4(kb.data(), MHA_DTYPE_F32, lk_);
  const mha_tensor v = describe4(vb.data(), MHA_DTYPE_F32, lv_);
  mha_tensor out = describe4(out_buf.base(), MHA_DTYPE_F32, lo_);
  mha_tensor lse = mha_test::describe(lse_buf.base(), MHA_DTYPE_F32, {B, H, Lq});

  mha_attention_params params;
  mha_attention_params_init(&params);
  params.lse = &lse;
  params.causal = fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  // The block: full lengths 0 (the block ends the problem) or up to 70 more.
  const bool full_q = fdp.ConsumeBool(), full_k = fdp.ConsumeBool();
  params.full_lq = full_q ? Lq + fdp.ConsumeIntegralInRange<int64_t>(0, 70) : 0;
  params.full_lk = full_k ? Lk + fdp.ConsumeIntegralInRange<int64_t>(0, 70) : 0;
  params.query_offset = fdp.ConsumeIntegralInRange<int64_t>(0, full_q ? params.full_lq - Lq : 70);
  params.key_offset = fdp.ConsumeIntegralInRange<int64_t>(0, full_k ? params.full_lk - Lk : 70);
  params.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, 60);
  params.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, 60);
  note(" causal %d block q %lld/%lld k %lld/%lld window %lld,%lld", params.causal,
       static_cast<long long>(params.query_offset), static_cast<long long>(params.full_lq),
       static_cast<long long>(params.key_offset), static_cast<long long>(params.full_lk),
       static_cast<long long>(params.window_left), static_cast<long long>(params.window_right));
  std::vector<float> slopes(static_cast<size_t>(H));
  mha_tensor alibi{};
  if (fdp.ConsumeBool()) {
    for (float& x : slopes) x = rng.uniform(0.0f, 1.0f);
    alibi = mha_test::describe(slopes.data(), MHA_DTYPE_F32, {H});
    params.alibi_slopes = &alibi;
    note(" alibi");
  }
  if (fdp.ConsumeBool()) {
    params.softcap = 5.0f;
    note(" softcap 5");
  }
  // Broken: a block that does not lie inside its problem.
  bool expect_invalid = false;
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 1:
      params.query_offset = -1 - fdp.ConsumeIntegralInRange<int64_t>(0, 5);
      expect_invalid = true;
      break;
    case 2:
      // One key short of the block's end (a block of one key at offset 0 has
      // no such length: 0 means "the block ends the problem").
      if (Lk + params.key_offset >= 2) {
        params.full_lk = Lk + params.key_offset - 1;
        expect_invalid = true;
      }
      break;
    case 3:
      params.full_lq = MHA_MAX_EXTENT + fdp.ConsumeIntegralInRange<int64_t>(1, 5);
      expect_invalid = true;
      break;
    default:
      break;
  }
  if (expect_invalid) note(" broken");

  const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
  Reference ref;
  if (!expect_invalid) ref = mha_test::reference_attention(q, k, v, &params);
  const mha_status status = mha_attention(&q, &k, &v, &out, &params);
  if (!outputs_keep_contract("block: ", status, mha_last_error(), expect_invalid, out_buf, out,
                             out_before, lse_buf, lse, lse_before, true)) {
    return 0;
  }
  compare(out, static_cast<const float*>(lse.data), lse.strides, ref, false,
          mha_test::tolerance_for(backend, MHA_DTYPE_F32, MHA_DTYPE_F32, ref, MHA_DTYPE_F32));
  return 0;
}

// ------------------------------------------------------------------ positional encoding

// mha_positional_encoding_add on an f32 [B, L, d] with its axes in any memory
// order, rows padded, size-1 axes with any stride, specials planted: every
// element must hold float(x + P) with P computed in double as the header
// states (the same libm here, so the same bits), every other byte its old
// value -- or a broken call (an axis of stride 0 that two indices share, a
// negative stride or size, another dtype or rank, no data) refused with
// nothing written.
int run_positional_case(FuzzedDataProvider& fdp) {
  begin_case("positional encoding:");
  mha_test::Rng rng(fdp.ConsumeIntegral<uint16_t>());
  const int64_t shape[3] = {fdp.ConsumeIntegralInRange<int64_t>(1, 3),
                            fdp.ConsumeIntegralInRange<int64_t>(1, 70),
                            fdp.ConsumeIntegralInRange<int64_t>(1, 41)};
  static constexpr int kAxisOrders[][3] = {{0, 1, 2}, {1, 0, 2}, {0, 2, 1},
                                           {2, 0, 1}, {1, 2, 0}, {2, 1, 0}};
  const int order = fdp.ConsumeIntegralInRange<int>(0, 5);
  const int64_t pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  int64_t strides[3] = {0, 0, 0};
  int64_t running = 1;
  for (int n = 2; n >= 0; --n) {
    const int axis = kAxisOrders[order][n];
    strides[axis] = running;
    running *= shape[axis] + (n == 2 ? pad : 0);
  }
  if (fdp.ConsumeBool()) {
    for (int axis = 0; axis < 3; ++axis) {
      if (shape[axis] == 1) strides[axis] = int64_t{1} << 40;  // never stepped along
    }
  }
  int64_t extent = 1;
  for (int axis = 0; axis < 3; ++axis) extent += (shape[axis] - 1) * strides[axis];
  note(" [%lld, %lld, %lld] order %d pad %lld", static_cast<long long>(shape[0]),
       static_cast<long long>(shape[1]), static_cast<long long>(shape[2]), order,
       static_cast<long long>(pad));

  Guarded buf(extent);
  for (int64_t i = 0; i < extent; ++i) buf.base()[i] = rng.uniform(-3.0f, 3.0f);
  for (int n = fdp.ConsumeIntegralInRange<int>(0, 3); n > 0; --n) {
    const int64_t at = fdp.ConsumeIntegralInRange<int64_t>(0, extent - 1);
    buf.base()[at] = special_value(fdp.ConsumeIntegral<uint8_t>());
    note(" x[%lld] = %g", static_cast<long long>(at), static_cast<double>(buf.base()[at]));
  }
  mha_tensor x = mha_test::describe(buf.base(), MHA_DTYPE_F32, {shape[0], shape[1], shape[2]},
                                    {strides[0], strides[1], strides[2]});
  bool expect_invalid = true, null_x = false;
  switch (fdp.ConsumeIntegralInRange<int>(0, 9)) {
    case 1: {  // two indices on one element: the encoding would be added twice
      int axis = fdp.ConsumeIntegralInRange<int>(0, 2);
      while (axis < 3 && shape[axis] == 1) ++axis;
      if (axis == 3) {
        expect_invalid = false;  // every axis has one index: nothing is shared
        break;
      }
      x.strides[axis] = 0;
      note(" broken: strides[%d] = 0", axis);
      break;
    }
    case 2:
      x.strides[fdp.ConsumeIntegralInRange<int>(0, 2)] = -1;
      note(" broken: a negative stride");
      break;
    case 3:
      x.shape[fdp.ConsumeIntegralInRange<int>(0, 2)] = fdp.ConsumeBool() ? 0 : -2;
      note(" broken: a size <= 0");
      break;
    case 4:
      x.dtype = fdp.ConsumeBool() ? MHA_DTYPE_BF16 : MHA_DTYPE_F16;
      note(" broken: dtype");
      break;
    case 5:
      x.ndim = fdp.ConsumeBool() ? 2 : 4;
      x.shape[3] = 1;
      note(" broken: rank %d", x.ndim);
      break;
    case 6:
      x.data = nullptr;
      note(" broken: no data");
      break;
    case 7:
      null_x = true;
      note(" broken: x NULL");
      break;
    default:
      expect_invalid = false;
      break;
  }

  const std::vector<float> before = buf.all;
  const mha_status status = mha_positional_encoding_add(null_x ? nullptr : &x);
  if (expect_invalid) {
    if (status == MHA_OK) finding("positional encoding: an invalid call was accepted");
    if (std::string(mha_last_error()).empty()) finding("positional encoding: no message");
    if (!same_bytes(buf.all, before)) finding("positional encoding: a refused call wrote x");
    return 0;
  }
  if (status != MHA_OK) {
    finding(std::string("positional encoding: a valid call failed: ") + mha_last_error());
  }
  if (changed_outside(buf, x, before) != 0) finding("positional encoding: written outside x");
  const int64_t d = shape[2];
  for (int64_t i = 0; i < shape[1]; ++i) {
    for (int64_t c = 0; c < d; ++c) {
      const int64_t even = c - c % 2;  // 2j of the header's formula
      const double angle = static_cast<double>(i) /
                           std::pow(10000.0, static_cast<double>(even) / static_cast<double>(d));
      const double p = c % 2 == 0 ? std::sin(angle) : std::cos(angle);
      for (int64_t b = 0; b < shape[0]; ++b) {
        const int64_t at = kGuard + b * strides[0] + i * strides[1] + c * strides[2];
        const float want =
            static_cast<float>(static_cast<double>(before[static_cast<size_t>(at)]) + p);
        const float got = buf.all[static_cast<size_t>(at)];
        if (std::isnan(want) ? !std::isnan(got) : bits_of(got) != bits_of(want)) {
          note(" at b %lld i %lld c %lld: %.9g, want %.9g", static_cast<long long>(b),
               static_cast<long long>(i), static_cast<long long>(c), static_cast<double>(got),
               static_cast<double>(want));
          finding("positional encoding: a wrong value");
        }
      }
    }
  }
  return 0;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  // Each case reads the bytes the ones before it left (older corpus entries
  // end sooner, so they keep their meaning).
  using Case = int (*)(FuzzedDataProvider&);
  static constexpr Case kCases[] = {
      run_case,
      run_varlen_case,           // a packed batch
      run_paged_case,            // writes into a paged KV cache, attention over it
      run_backward_case,         // the backward pass
      run_module_backward_case,  // the module's backward pass
      run_block_case,            // a call as a block of a larger problem
      run_positional_case,       // the positional encoding, in place
      run_module_forward_case,   // the module's forward pass
  };
  for (const Case run : kCases) {
    if (run != kCases[0] && fdp.remaining_bytes() == 0) break;
    run(fdp);
    end_case();
  }
  return 0;
}
