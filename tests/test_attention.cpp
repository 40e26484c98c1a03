// The correctness suite: every backend this CPU can run, against the float64
// reference, over shapes, layouts, masks and scales.  Each call also checks
// the LSE output, that nothing outside out (and lse) was written, and that the
// inputs were not modified.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "backend_param.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInfF = std::numeric_limits<float>::infinity();

enum class MaskKind { None, Bool, Additive };
enum class Lens { None, PerBatch, PerQuery };

struct Case {
  int64_t B = 1, H = 1, Hkv = 0, Lq = 1, Lk = 1, D = 16, Dv = 0;  // Hkv 0 = H, Dv 0 = D
  Layout q_layout = Layout::BHLD, k_layout = Layout::BHLD, v_layout = Layout::BHLD,
         out_layout = Layout::BHLD;
  int64_t pad = 0;                  // unused floats after every row of q, k, v and out
  bool packed_qkv = false;          // q, k, v in one [B, L, H + 2 Hkv, D] buffer
  bool kv_batch_broadcast = false;  // k and v with batch stride 0
  int32_t causal = MHA_CAUSAL_NONE;
  bool has_scale = false;
  float scale = 1.0f;
  Lens lens = Lens::None;
  mha_dtype lens_dtype = MHA_DTYPE_I32;
  bool lens_transposed = false;      // per-query lengths stored [Lq, B]
  std::vector<int64_t> lens_values;  // empty: generated, cycling Lk, 0, 1, random
  MaskKind mask = MaskKind::None;
  std::vector<int64_t> mask_shape;  // rank 2..4
  bool mask_heads_stride0 = false;  // mask_shape is [B, H, Lq, Lk] but heads have stride 0
  bool mask_dead_row = true;        // one mask row masks every key
  float q_amp = 1.0f, k_amp = 1.0f, v_amp = 1.0f;
  float qk_const = 0.0f;  // non-zero: every element of q and k is this value
  bool lse = true;
  bool null_params = false;
  uint64_t seed = 1;
  // Optional edits after the random fill: of the mask (C order of the stored
  // shape; only the vector of the mask's dtype is used), and of the q, k, v
  // and out descriptors (for strides that do not change what they reach).
  std::function<void(std::vector<uint8_t>&, std::vector<float>&)> edit_mask;
  std::function<void(mha_tensor&, mha_tensor&, mha_tensor&, mha_tensor&)> edit_views;

  int64_t hkv() const { return Hkv != 0 ? Hkv : H; }
  int64_t dv() const { return Dv != 0 ? Dv : D; }

  std::string describe() const {
    std::ostringstream os;
    os << "B=" << B << " H=" << H << " Hkv=" << hkv() << " Lq=" << Lq << " Lk=" << Lk << " D=" << D
       << " Dv=" << dv() << " layouts q/k/v/out=" << layout_name(q_layout) << '/'
       << layout_name(k_layout) << '/' << layout_name(v_layout) << '/' << layout_name(out_layout)
       << " pad=" << pad << (packed_qkv ? " packed" : "")
       << (kv_batch_broadcast ? " kv-batch-stride-0" : "") << " causal=" << causal;
    if (has_scale) os << " scale=" << scale;
    if (lens != Lens::None) {
      os << " valid_lens=" << (lens == Lens::PerBatch ? "per-batch" : "per-query")
         << (lens_dtype == MHA_DTYPE_I64 ? "/i64" : "/i32") << (lens_transposed ? "/T" : "");
    }
    if (mask != MaskKind::None) {
      os << " mask=" << (mask == MaskKind::Bool ? "bool" : "f32")
         << join_shape(mask_shape.data(), static_cast<int32_t>(mask_shape.size()))
         << (mask_heads_stride0 ? "/heads-stride-0" : "") << (mask_dead_row ? "/dead-row" : "");
    }
    if (q_amp != 1.0f || k_amp != 1.0f) os << " q_amp=" << q_amp << " k_amp=" << k_amp;
    if (qk_const != 0.0f) os << " qk_const=" << qk_const;
    os << (lse ? " lse" : "") << (null_params ? " params=NULL" : "") << " seed=" << seed;
    return os.str();
  }
};

// What a call produced, in C order, for comparisons between calls.
struct Outcome {
  bool ok = false;
  std::vector<float> out, lse;
};

std::vector<float> read_c_order(const mha_tensor& t) {
  std::vector<float> values;
  for_each_offset(
      t, [&](int64_t offset) { values.push_back(static_cast<const float*>(t.data)[offset]); });
  return values;
}

void scale_values(const mha_tensor& t, float amp) {
  if (amp == 1.0f) return;
  for_each_offset(t, [&](int64_t offset) { static_cast<float*>(t.data)[offset] *= amp; });
}

void set_values(const mha_tensor& t, float value) {
  for_each_offset(t, [&](int64_t offset) { static_cast<float*>(t.data)[offset] = value; });
}

// Runs one case on the selected backend and checks everything; returns what it produced.
Outcome run_case(const Case& c) {
  SCOPED_TRACE(c.describe());
  Outcome outcome;
  const int64_t B = c.B, H = c.H, Hkv = c.hkv(), Lq = c.Lq, Lk = c.Lk, D = c.D, Dv = c.dv();
  Rng rng(c.seed * 0x9e3779b97f4a7c15ull + 12345);

  // ---- q, k, v
  std::vector<Arena> inputs;
  inputs.reserve(3);
  mha_tensor q{}, k{}, v{};
  if (c.packed_qkv) {
    EXPECT_TRUE(Lq == Lk && D == Dv) << "packed QKV needs Lq == Lk and D == Dv";
    if (!(Lq == Lk && D == Dv)) return outcome;
    const int64_t row = (H + 2 * Hkv) * D + c.pad;
    inputs.emplace_back(B * Lq * row);
    float* base = inputs[0].base();
    q = describe(base, MHA_DTYPE_F32, {B, H, Lq, D}, {Lq * row, D, row, 1});
    k = describe(base + H * D, MHA_DTYPE_F32, {B, Hkv, Lk, D}, {Lk * row, D, row, 1});
    v = describe(base + (H + Hkv) * D, MHA_DTYPE_F32, {B, Hkv, Lk, Dv}, {Lk * row, Dv, row, 1});
  } else {
    Shape4 sq = make_shape(c.q_layout, B, H, Lq, D, c.pad);
    Shape4 sk = make_shape(c.k_layout, c.kv_batch_broadcast ? 1 : B, Hkv, Lk, D, c.pad);
    Shape4 sv = make_shape(c.v_layout, c.kv_batch_broadcast ? 1 : B, Hkv, Lk, Dv, c.pad);
    if (c.kv_batch_broadcast) {
      sk.shape[0] = sv.shape[0] = B;
      sk.strides[0] = sv.strides[0] = 0;
    }
    inputs.emplace_back(sq.extent);
    inputs.emplace_back(sk.extent);
    inputs.emplace_back(sv.extent);
    q = inputs[0].view(sq);
    k = inputs[1].view(sk);
    v = inputs[2].view(sv);
  }
  fill_uniform(q, rng);
  fill_uniform(k, rng);
  fill_uniform(v, rng);
  scale_values(q, c.q_amp);
  scale_values(k, c.k_amp);
  scale_values(v, c.v_amp);
  if (c.qk_const != 0.0f) {
    set_values(q, c.qk_const);
    set_values(k, c.qk_const);
  }

  // ---- out and lse
  const Shape4 so = make_shape(c.out_layout, B, H, Lq, Dv, c.pad);
  Arena out_arena(so.extent);
  mha_tensor out = out_arena.view(so);
  Arena lse_arena(B * H * Lq);
  mha_tensor lse = c.out_layout == Layout::BHLD
                       ? describe(lse_arena.base(), MHA_DTYPE_F32, {B, H, Lq}, {H * Lq, Lq, 1})
                       : describe(lse_arena.base(), MHA_DTYPE_F32, {B, H, Lq}, {Lq * H, 1, H});

  // ---- valid lengths
  std::vector<int64_t> lens = c.lens_values;
  const int64_t lens_count = c.lens == Lens::PerQuery ? B * Lq : B;
  if (c.lens != Lens::None && lens.empty()) {
    for (int64_t n = 0; n < lens_count; ++n) {
      const int64_t pattern[4] = {Lk, 0, std::min<int64_t>(1, Lk), rng.integer(0, Lk)};
      lens.push_back(pattern[n % 4]);
    }
  }
  std::vector<int32_t> lens32;
  std::vector<int64_t> lens64;
  mha_tensor lens_t{};
  if (c.lens != Lens::None) {
    EXPECT_EQ(static_cast<int64_t>(lens.size()), lens_count);
    if (static_cast<int64_t>(lens.size()) != lens_count) return outcome;
    // Stored C order, or [Lq, B] for transposed per-query lengths.
    std::vector<int64_t> stored(lens.size());
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < (c.lens == Lens::PerQuery ? Lq : 1); ++i) {
        const int64_t logical = c.lens == Lens::PerQuery ? b * Lq + i : b;
        const int64_t at = c.lens_transposed ? i * B + b : logical;
        stored[static_cast<size_t>(at)] = lens[static_cast<size_t>(logical)];
      }
    }
    lens32.assign(stored.begin(), stored.end());
    lens64 = stored;
    void* data = c.lens_dtype == MHA_DTYPE_I64 ? static_cast<void*>(lens64.data())
                                               : static_cast<void*>(lens32.data());
    if (c.lens == Lens::PerBatch) {
      lens_t = describe(data, c.lens_dtype, {B});
    } else if (c.lens_transposed) {
      lens_t = describe(data, c.lens_dtype, {B, Lq}, {1, B});
    } else {
      lens_t = describe(data, c.lens_dtype, {B, Lq});
    }
  }

  // ---- mask
  std::vector<uint8_t> mask_bool;
  std::vector<float> mask_f32;
  mha_tensor mask_t{};
  if (c.mask != MaskKind::None) {
    std::vector<int64_t> stored_shape = c.mask_shape;
    if (c.mask_heads_stride0) stored_shape[1] = 1;
    const int64_t count = element_count(stored_shape);
    const int64_t last = stored_shape.back();
    if (c.mask == MaskKind::Bool) {
      mask_bool.resize(static_cast<size_t>(count));
      for (auto& x : mask_bool)
        x = rng.chance(0.75) ? static_cast<uint8_t>(rng.integer(1, 255)) : 0;
      if (c.mask_dead_row) std::fill(mask_bool.end() - last, mask_bool.end(), uint8_t{0});
    } else {
      mask_f32.resize(static_cast<size_t>(count));
      for (auto& x : mask_f32) x = rng.chance(0.1) ? -kInfF : rng.uniform(-3.0f, 3.0f);
      if (c.mask_dead_row) std::fill(mask_f32.end() - last, mask_f32.end(), -kInfF);
    }
    void* data = c.mask == MaskKind::Bool ? static_cast<void*>(mask_bool.data())
                                          : static_cast<void*>(mask_f32.data());
    const mha_dtype dtype = c.mask == MaskKind::Bool ? MHA_DTYPE_BOOL : MHA_DTYPE_F32;
    std::vector<int64_t> strides = c_strides(stored_shape);
    if (c.mask_heads_stride0) strides[1] = 0;
    if (c.edit_mask) c.edit_mask(mask_bool, mask_f32);
    mask_t = describe(data, dtype, c.mask_shape, strides);
  }

  mha_attention_params params;
  mha_attention_params_init(&params);
  if (c.has_scale) {
    params.has_scale = 1;
    params.scale = c.scale;
  }
  params.causal = c.causal;
  if (c.lens != Lens::None) params.valid_lens = &lens_t;
  if (c.mask != MaskKind::None) params.mask = &mask_t;
  if (c.lse) params.lse = &lse;

  if (c.edit_views) c.edit_views(q, k, v, out);

  const Reference ref = reference_attention(q, k, v, &params);

  std::vector<std::vector<float>> input_before;
  input_before.reserve(inputs.size());
  for (const auto& arena : inputs) input_before.push_back(arena.all());
  const std::vector<uint8_t> mask_bool_before = mask_bool;
  const std::vector<float> mask_f32_before = mask_f32;
  const std::vector<int32_t> lens32_before = lens32;
  const std::vector<int64_t> lens64_before = lens64;
  const std::vector<float> out_before = out_arena.all();
  const std::vector<float> lse_before = lse_arena.all();

  const mha_status status = mha_attention(&q, &k, &v, &out, c.null_params ? nullptr : &params);
  EXPECT_EQ(status, MHA_OK) << mha_status_name(status) << ": " << mha_last_error();
  if (status != MHA_OK) return outcome;

  // ---- the output against the reference
  const double error = max_abs_error(out, ref), tol = tolerance(ref);
  EXPECT_LE(error, tol) << "max |out - ref| = " << error << " > tolerance " << tol
                        << " (max |ref| = " << ref.max_abs_out
                        << ", max |logit| = " << ref.max_abs_logit << ")";
  // Rows where no key takes part: exactly zero.
  int64_t dead_rows = 0, bad_dead = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i) {
        if (ref.lse[static_cast<size_t>((b * H + h) * Lq + i)] != -kInf) continue;
        ++dead_rows;
        for (int64_t e = 0; e < Dv; ++e) {
          const float x = static_cast<const float*>(
              out.data)[b * out.strides[0] + h * out.strides[1] + i * out.strides[2] + e];
          if (x != 0.0f) ++bad_dead;
        }
      }
  EXPECT_EQ(bad_dead, 0) << "elements of fully masked rows that are not exactly 0 (of " << dead_rows
                         << " such rows)";
  EXPECT_EQ(out_arena.changed_outside(out, out_before), 0)
      << "elements written outside out's region (guards or row padding)";
  for (size_t n = 0; n < inputs.size(); ++n) {
    EXPECT_TRUE(inputs[n].bits_equal(input_before[n])) << "input buffer " << n << " was modified";
  }
  EXPECT_TRUE(mask_bool == mask_bool_before && mask_f32 == mask_f32_before) << "mask modified";
  EXPECT_TRUE(lens32 == lens32_before && lens64 == lens64_before) << "valid_lens modified";

  // ---- lse
  if (c.lse) {
    int64_t bad = 0;
    std::ostringstream first;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Lq; ++i) {
          const double want = ref.lse[static_cast<size_t>((b * H + h) * Lq + i)];
          const double got = static_cast<double>(static_cast<const float*>(
              lse.data)[b * lse.strides[0] + h * lse.strides[1] + i * lse.strides[2]]);
          bool good;
          if (want == -kInf) {
            good = got == -kInf;
          } else {
            const double lse_tol = lse_tolerance(ref, want);
            good = std::fabs(got - want) <= lse_tol;  // false for NaN
          }
          if (!good && bad++ == 0) {
            first << "lse[" << b << "," << h << "," << i << "] = " << got << ", want " << want;
          }
        }
    EXPECT_EQ(bad, 0) << "wrong lse values; first: " << first.str();
    EXPECT_EQ(lse_arena.changed_outside(lse, lse_before), 0) << "written outside lse";
  } else {
    EXPECT_TRUE(lse_arena.bits_equal(lse_before)) << "lse written although not requested";
  }

  outcome.ok = true;
  outcome.out = read_c_order(out);
  if (c.lse) outcome.lse = read_c_order(lse);
  return outcome;
}

// ------------------------------------------------------------------ fixture

class Attention : public BackendTest {};

// Which backends exist and which of them can run, printed once per binary.
TEST(Backends, AtLeastScalarIsUsable) {
  const auto backends = list_backends();
  for (const auto& b : backends) {
    std::printf("backend %-8s %s (priority %d)%s%s\n", b.name.c_str(),
                b.usable ? "usable" : "NOT usable, skipped", b.priority, b.usable ? "" : ": ",
                b.reason.c_str());
  }
  const BackendEntry* scalar = find_backend(backends, "scalar");
  ASSERT_NE(scalar, nullptr);
  EXPECT_TRUE(scalar->usable) << scalar->reason;
}

// ------------------------------------------------------------------ the cases

TEST_P(Attention, D2lExample) {
  // d2l.ai's MultiHeadAttention example: batch 2, 5 heads of 20, 4 queries,
  // 6 key-value pairs, valid_lens [3, 2]; the heads come from [B, L, H*D].
  for (const mha_dtype dtype : {MHA_DTYPE_I32, MHA_DTYPE_I64}) {
    for (const Layout layout : {Layout::BLHD, Layout::BHLD}) {
      Case c;
      c.B = 2, c.H = 5, c.D = 20, c.Lq = 4, c.Lk = 6;
      c.q_layout = c.k_layout = c.v_layout = c.out_layout = layout;
      c.lens = Lens::PerBatch;
      c.lens_dtype = dtype;
      c.lens_values = {3, 2};
      run_case(c);
    }
  }
  Case c;
  c.B = 2, c.H = 5, c.D = 20, c.Lq = 4, c.Lk = 6;
  run_case(c);
}

// The d2l.ai example on the backend the library picks by itself: a SIMD one
// takes the rows layout here (tests/CMakeLists.txt checks MHA_VERBOSE's
// report of it).
TEST(RowsLayout, D2lExampleOnTheBestBackend) {
  const int64_t B = 2, H = 5, Lq = 4, Lk = 6, D = 20;
  Rng rng(3);
  Arena q(B * H * Lq * D), k(B * H * Lk * D), v(B * H * Lk * D), out(B * H * Lq * D);
  mha_tensor tq = q.view(make_shape(Layout::BLHD, B, H, Lq, D));
  mha_tensor tk = k.view(make_shape(Layout::BLHD, B, H, Lk, D));
  mha_tensor tv = v.view(make_shape(Layout::BLHD, B, H, Lk, D));
  mha_tensor tout = out.view(make_shape(Layout::BLHD, B, H, Lq, D));
  fill_uniform(tq, rng);
  fill_uniform(tk, rng);
  fill_uniform(tv, rng);
  std::vector<int32_t> lens = {3, 2};
  const mha_tensor tlens = describe(lens.data(), MHA_DTYPE_I32, {B});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.valid_lens = &tlens;
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, &p), MHA_OK) << mha_last_error();
  const Reference ref = reference_attention(tq, tk, tv, &p);
  EXPECT_LE(max_abs_error(tout, ref), tolerance(ref));
}

TEST_P(Attention, HeadSizes) {
  for (const int64_t d : {1, 2, 3, 8, 16, 20, 63, 64, 80, 128, 256}) {
    Case c;
    c.B = 2, c.H = 2, c.Lq = 17, c.Lk = 33, c.D = d, c.seed = static_cast<uint64_t>(d);
    run_case(c);
    c.Lq = 1, c.H = 4, c.Hkv = 2, c.Lk = 65;  // decoding
    run_case(c);
  }
}

TEST_P(Attention, Lengths) {
  for (const int64_t l : {1, 2, 7, 15, 16, 17, 33, 65, 97, 130, 257}) {
    Case c;
    c.B = 1, c.H = l > 100 ? 1 : 2, c.D = 32, c.Lq = l, c.Lk = l, c.seed = static_cast<uint64_t>(l);
    run_case(c);
  }
}

// Tiny problems (the rows layout) over head sizes that leave a partial
// vector or none, and key counts from one to two vectors of keys (AVX2 takes
// dot products along the head dimension for up to four keys, a transposed K
// past them); grouped heads, the last rows of K and V followed by the
// arena's NaN guard (a read past a row's end shows in the results).
TEST_P(Attention, TinyHeadSizesAndKeyCounts) {
  uint64_t seed = 150;
  for (const int64_t d : {1, 3, 7, 8, 9, 20, 31, 64, 128}) {
    for (const int64_t lk : {1, 2, 3, 5, 8, 9, 16}) {
      Case c;
      c.B = 2, c.H = 4, c.Hkv = 2, c.Lq = 3, c.Lk = lk, c.D = d, c.seed = ++seed;
      run_case(c);
    }
  }
}

TEST_P(Attention, UnequalLengths) {
  const std::pair<int64_t, int64_t> lengths[] = {{1, 257}, {257, 1}, {7, 130}, {130, 7},
                                                 {17, 97}, {97, 17}, {33, 65}, {65, 33},
                                                 {2, 3},   {3, 2},   {1, 2},   {2, 1}};
  uint64_t seed = 100;
  for (const auto& [lq, lk] : lengths) {
    Case c;
    c.B = 2, c.H = 2, c.D = 24, c.Lq = lq, c.Lk = lk, c.seed = ++seed;
    run_case(c);
  }
}

TEST_P(Attention, ValueHeadSizeDiffers) {
  const std::pair<int64_t, int64_t> sizes[] = {{64, 32}, {16, 80},  {1, 7},
                                               {33, 1},  {128, 64}, {20, 3}};
  uint64_t seed = 200;
  for (const auto& [d, dv] : sizes) {
    Case c;
    c.B = 2, c.H = 2, c.Lq = 9, c.Lk = 21, c.D = d, c.Dv = dv, c.seed = ++seed;
    run_case(c);
    c.Lq = 1;
    run_case(c);
  }
}

TEST_P(Attention, GroupedAndMultiQuery) {
  const std::pair<int64_t, int64_t> heads[] = {{8, 2}, {8, 1},  {6, 3},  {4, 4},
                                               {3, 1}, {32, 4}, {16, 16}};
  uint64_t seed = 300;
  for (const auto& [h, hkv] : heads) {
    for (const int64_t lq : {1, 3, 17}) {
      Case c;
      c.B = 2, c.H = h, c.Hkv = hkv, c.Lq = lq, c.Lk = 33, c.D = 16, c.seed = ++seed;
      run_case(c);
      c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
      c.q_layout = c.out_layout = Layout::BLHD;
      c.k_layout = c.v_layout = Layout::BLHD;
      run_case(c);
    }
  }
}

// The decode layout serves the query heads of one KV head as rows, in
// groups of up to kDecodeRows that share each K and V load (and the rest of
// a group): every group size and remainder, over keys long enough for the
// decode layout (more than two prefill key tiles), with a mask, the causal
// rule and valid lengths that end rows at different keys.
TEST_P(Attention, DecodeRowGroupsOfEverySize) {
  uint64_t seed = 900;
  for (int64_t group = 1; group <= 9; ++group) {
    for (const int64_t lq : {1, 2}) {
      Case c;
      c.B = 2, c.H = 2 * group, c.Hkv = 2, c.Lq = lq, c.Lk = 700, c.D = 64, c.seed = ++seed;
      run_case(c);
      c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
      c.lens = Lens::PerQuery;
      c.mask = MaskKind::Bool;
      c.mask_shape = {c.B, c.H, c.Lq, c.Lk};
      c.mask_dead_row = false;
      run_case(c);
    }
  }
}

TEST_P(Attention, Layouts) {
  uint64_t seed = 400;
  for (int combo = 0; combo < 16; ++combo) {
    for (const int64_t pad : {0, 3}) {
      Case c;
      c.B = 2, c.H = 3, c.Lq = 9, c.Lk = 13, c.D = 16, c.Dv = 12, c.pad = pad, c.seed = ++seed;
      c.q_layout = combo & 1 ? Layout::BLHD : Layout::BHLD;
      c.k_layout = combo & 2 ? Layout::BLHD : Layout::BHLD;
      c.v_layout = combo & 4 ? Layout::BLHD : Layout::BHLD;
      c.out_layout = combo & 8 ? Layout::BLHD : Layout::BHLD;
      run_case(c);
    }
  }
}

TEST_P(Attention, PackedQkv) {
  const std::pair<int64_t, int64_t> heads[] = {{4, 4}, {4, 2}, {4, 1}};
  uint64_t seed = 500;
  for (const auto& [h, hkv] : heads) {
    for (const int64_t pad : {0, 5}) {
      for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT}) {
        Case c;
        c.B = 2, c.H = h, c.Hkv = hkv, c.Lq = 19, c.Lk = 19, c.D = 16, c.pad = pad;
        c.packed_qkv = true, c.causal = causal, c.seed = ++seed;
        c.out_layout = Layout::BLHD;
        run_case(c);
      }
    }
  }
}

// fp32 K and V whose rows are not back to back are copied once per work
// item, which the runtime then gives several query tiles when there are
// enough items to balance the threads (kv_copied_per_item: here B·H = 64
// gives items of two tiles): the copy grows key tile by key tile and must
// serve every query tile of the item, whatever it saw first.
TEST_P(Attention, StridedKeysAcrossQueryTiles) {
  Case c;  // K and V as [B, L, Hkv, D] views, per-query lengths
  c.B = 4, c.H = 16, c.Hkv = 4, c.Lq = 136, c.Lk = 140, c.D = 8, c.Dv = 12, c.seed = 551;
  c.k_layout = c.v_layout = c.out_layout = Layout::BLHD;
  c.lens = Lens::PerQuery;
  run_case(c);
  Case packed;  // one [B, L, H + 2 Hkv, D] buffer with padded rows, causal
  packed.B = 4, packed.H = 16, packed.Hkv = 4, packed.Lq = packed.Lk = 136, packed.D = 8;
  packed.packed_qkv = true, packed.pad = 3, packed.seed = 552;
  packed.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  run_case(packed);
}

TEST_P(Attention, KeysAndValuesBroadcastOverBatch) {
  Case c;
  c.B = 3, c.H = 2, c.Lq = 5, c.Lk = 11, c.D = 8, c.kv_batch_broadcast = true;
  run_case(c);
  c.Lq = 1, c.H = 4, c.Hkv = 2, c.lens = Lens::PerBatch;
  run_case(c);
}

TEST_P(Attention, Causal) {
  const std::pair<int64_t, int64_t> lengths[] = {{13, 13}, {5, 21},  {21, 5},  {1, 9}, {9, 1},
                                                 {64, 64}, {33, 70}, {70, 33}, {2, 1}};
  uint64_t seed = 600;
  for (const int32_t causal : {MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT}) {
    for (const auto& [lq, lk] : lengths) {
      Case c;
      c.B = 2, c.H = 2, c.Lq = lq, c.Lk = lk, c.D = 16, c.causal = causal, c.seed = ++seed;
      run_case(c);
    }
  }
}

TEST_P(Attention, BottomRightWithMoreQueriesThanKeysHasZeroRows) {
  // Queries 0 .. Lq-Lk-1 see no key: zeros and lse -inf (checked by run_case);
  // here also check that such rows exist, so the check is not vacuous.
  Case c;
  c.B = 1, c.H = 2, c.Lq = 20, c.Lk = 6, c.D = 8, c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  const Outcome o = run_case(c);
  ASSERT_TRUE(o.ok);
  for (int64_t h = 0; h < c.H; ++h) {
    for (int64_t i = 0; i < c.Lq; ++i) {
      const float lse = o.lse[static_cast<size_t>(h * c.Lq + i)];
      if (i < c.Lq - c.Lk) {
        EXPECT_EQ(lse, -kInfF) << "row " << i;
        for (int64_t e = 0; e < c.D; ++e) {
          EXPECT_EQ(o.out[static_cast<size_t>((h * c.Lq + i) * c.D + e)], 0.0f);
        }
      } else {
        EXPECT_TRUE(std::isfinite(lse)) << "row " << i;
      }
    }
  }
}

TEST_P(Attention, ValidLensPerBatch) {
  uint64_t seed = 700;
  for (const mha_dtype dtype : {MHA_DTYPE_I32, MHA_DTYPE_I64}) {
    for (const int64_t lk : {1, 11, 40}) {
      Case c;  // B = 5: lengths Lk, 0, 1, random, Lk
      c.B = 5, c.H = 2, c.Lq = 5, c.Lk = lk, c.D = 8, c.lens = Lens::PerBatch;
      c.lens_dtype = dtype, c.seed = ++seed;
      run_case(c);
      c.Lq = 1;
      run_case(c);
    }
  }
}

TEST_P(Attention, ValidLensPerQuery) {
  uint64_t seed = 800;
  for (const mha_dtype dtype : {MHA_DTYPE_I32, MHA_DTYPE_I64}) {
    for (const bool transposed : {false, true}) {
      Case c;
      c.B = 2, c.H = 3, c.Lq = 7, c.Lk = 12, c.D = 8, c.lens = Lens::PerQuery;
      c.lens_dtype = dtype, c.lens_transposed = transposed, c.seed = ++seed;
      run_case(c);
      c.Lq = 21, c.Lk = 35;
      run_case(c);
    }
  }
}

std::vector<std::vector<int64_t>> mask_shapes(int64_t B, int64_t H, int64_t Lq, int64_t Lk) {
  return {{Lq, Lk},    {B, 1, Lq, Lk}, {1, H, Lq, Lk}, {B, H, Lq, Lk}, {B, 1, 1, Lk},
          {H, Lq, Lk}, {1, Lk},        {Lq, 1},        {1, 1, Lq, Lk}};
}

TEST_P(Attention, BoolMaskShapes) {
  uint64_t seed = 900;
  for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{6, 19}, {1, 19}, {19, 6}}) {
    for (const auto& shape : mask_shapes(2, 3, lq, lk)) {
      for (const bool dead_row : {false, true}) {
        Case c;
        c.B = 2, c.H = 3, c.Lq = lq, c.Lk = lk, c.D = 8, c.mask = MaskKind::Bool;
        c.mask_shape = shape, c.mask_dead_row = dead_row, c.seed = ++seed;
        run_case(c);
      }
    }
  }
}

TEST_P(Attention, AdditiveMaskShapes) {
  uint64_t seed = 1000;
  for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{6, 19}, {1, 19}, {19, 6}}) {
    for (const auto& shape : mask_shapes(2, 3, lq, lk)) {
      for (const bool dead_row : {false, true}) {
        Case c;
        c.B = 2, c.H = 3, c.Lq = lq, c.Lk = lk, c.D = 8, c.mask = MaskKind::Additive;
        c.mask_shape = shape, c.mask_dead_row = dead_row, c.seed = ++seed;
        run_case(c);
      }
    }
  }
}

TEST_P(Attention, MaskWithZeroStrideHeads) {
  for (const MaskKind kind : {MaskKind::Bool, MaskKind::Additive}) {
    Case c;
    c.B = 2, c.H = 3, c.Lq = 7, c.Lk = 10, c.D = 8, c.mask = kind;
    c.mask_shape = {2, 3, 7, 10}, c.mask_heads_stride0 = true;
    run_case(c);
  }
}

TEST_P(Attention, AdditiveMaskOnLongRows) {
  // -inf entries across several key tiles, and whole -inf tiles.
  Case c;
  c.B = 1, c.H = 2, c.Lq = 9, c.Lk = 300, c.D = 16, c.mask = MaskKind::Additive;
  c.mask_shape = {9, 300};
  run_case(c);
  c.Lq = 1, c.mask_shape = {1, 300}, c.mask_dead_row = false;
  run_case(c);
}

TEST_P(Attention, CombinedMasks) {
  uint64_t seed = 1100;
  for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT}) {
    for (const Lens lens : {Lens::None, Lens::PerBatch, Lens::PerQuery}) {
      for (const MaskKind kind : {MaskKind::None, MaskKind::Bool, MaskKind::Additive}) {
        for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{11, 17}, {17, 11}, {1, 23}}) {
          Case c;
          c.B = 3, c.H = 4, c.Hkv = 2, c.Lq = lq, c.Lk = lk, c.D = 8, c.causal = causal;
          c.lens = lens, c.mask = kind, c.mask_shape = {3, 1, lq, lk};
          c.mask_dead_row = (seed & 1) != 0, c.seed = ++seed;
          c.lse = (seed % 3) != 0;
          run_case(c);
        }
      }
    }
  }
}

TEST_P(Attention, EveryKeyMasked) {
  Case c;
  c.B = 2, c.H = 2, c.Lq = 4, c.Lk = 9, c.D = 8, c.lens = Lens::PerBatch, c.lens_values = {0, 0};
  const Outcome o = run_case(c);
  ASSERT_TRUE(o.ok);
  for (const float x : o.out) EXPECT_EQ(x, 0.0f);
  for (const float x : o.lse) EXPECT_EQ(x, -kInfF);
  // Per-query lengths of 0 everywhere, and a mask that is false everywhere.
  c.lens = Lens::PerQuery, c.lens_values.assign(static_cast<size_t>(c.B * c.Lq), 0);
  run_case(c);
  Case d;
  d.B = 2, d.H = 2, d.Lq = 4, d.Lk = 9, d.D = 8, d.mask = MaskKind::Bool, d.mask_shape = {1, 9};
  run_case(d);  // the dead row of a [1, Lk] mask is every row
}

TEST_P(Attention, LargeLogits) {
  uint64_t seed = 1200;
  // Large-norm q and k with the default scale: |logits| up to about 1e4.
  for (const int64_t lk : {1, 17, 130}) {
    Case c;
    c.B = 1, c.H = 2, c.Lq = 9, c.Lk = lk, c.D = 64, c.q_amp = 100.0f, c.k_amp = 100.0f;
    c.seed = ++seed;
    run_case(c);
    c.causal = MHA_CAUSAL_BOTTOM_RIGHT, c.mask = MaskKind::Additive, c.mask_shape = {9, lk};
    run_case(c);
  }
  // Explicit large scales of both signs.
  for (const float scale : {2000.0f, -2000.0f}) {
    Case c;
    c.B = 1, c.H = 2, c.Lq = 5, c.Lk = 70, c.D = 16, c.has_scale = true, c.scale = scale;
    c.seed = ++seed;
    run_case(c);
  }
  // Every logit exactly +1e4 or -1e4: uniform weights; no exp may overflow or underflow to 0/0.
  for (const float scale : {10000.0f / 16.0f, -10000.0f / 16.0f}) {
    for (const int64_t lq : {1, 8}) {
      Case c;
      c.B = 1, c.H = 1, c.Lq = lq, c.Lk = 40, c.D = 16, c.qk_const = 1.0f;
      c.has_scale = true, c.scale = scale, c.seed = ++seed;
      run_case(c);
    }
  }
}

TEST_P(Attention, ExplicitScale) {
  uint64_t seed = 1300;
  for (const float scale : {0.5f, 3.0f, -1.0f, -0.125f, 1e-3f, 1.0f}) {
    Case c;
    c.B = 2, c.H = 2, c.Lq = 6, c.Lk = 13, c.D = 16, c.has_scale = true, c.scale = scale;
    c.seed = ++seed;
    run_case(c);
    c.Lq = 1;
    run_case(c);
  }
}

TEST_P(Attention, NullParamsMeansDefaults) {
  Case c;
  c.B = 2, c.H = 2, c.Lq = 5, c.Lk = 7, c.D = 12, c.null_params = true, c.lse = false;
  run_case(c);
}

TEST_P(Attention, WithAndWithoutLseAgree) {
  Case c;
  c.B = 2, c.H = 2, c.Lq = 10, c.Lk = 50, c.D = 16, c.causal = MHA_CAUSAL_TOP_LEFT;
  const Outcome with = run_case(c);
  c.lse = false;
  const Outcome without = run_case(c);
  ASSERT_TRUE(with.ok && without.ok);
  EXPECT_TRUE(with.out == without.out) << "asking for lse changed out";
}

TEST_P(Attention, LongKeySequenceForOneQuery) {
  // Decoding against a long KV cache (split over keys by the runtime).
  uint64_t seed = 1400;
  for (const int64_t lk : {1000, 4097, 65536}) {
    Case c;
    c.B = 1, c.H = 2, c.Hkv = 1, c.Lq = 1, c.Lk = lk, c.D = 32, c.seed = ++seed;
    run_case(c);
  }
  Case c;
  c.B = 2, c.H = 2, c.Lq = 1, c.Lk = 3001, c.D = 16, c.lens = Lens::PerBatch;
  c.lens_values = {2999, 1500}, c.mask = MaskKind::Additive, c.mask_shape = {2, 1, 1, 3001};
  c.mask_dead_row = false;
  run_case(c);
}

TEST_P(Attention, SplitKeysWithEmptyChunks) {
  // Long key ranges for few queries, where whole stretches of keys take no
  // part: whatever pieces the keys are split into, empty pieces must merge away.
  {
    Case c;  // valid lengths 10, Lk, 0 and half of Lk
    c.B = 4, c.H = 2, c.Lq = 1, c.Lk = 6000, c.D = 16, c.lens = Lens::PerBatch;
    c.lens_values = {10, 6000, 0, 3001};
    run_case(c);
  }
  {
    Case c;  // -inf over keys [1000, 5000), random elsewhere
    c.B = 2, c.H = 2, c.Lq = 1, c.Lk = 6000, c.D = 16, c.mask = MaskKind::Additive;
    c.mask_shape = {2, 1, 1, 6000}, c.mask_dead_row = false;
    c.edit_mask = [](std::vector<uint8_t>&, std::vector<float>& m) {
      for (size_t b = 0; b < 2; ++b)
        for (size_t j = 1000; j < 5000; ++j) m[b * 6000 + j] = -kInfF;
    };
    run_case(c);
  }
  {
    Case c;  // only the last key takes part, or only the first
    c.B = 2, c.H = 4, c.Hkv = 2, c.Lq = 2, c.Lk = 5000, c.D = 8, c.mask = MaskKind::Bool;
    c.mask_shape = {2, 1, 1, 5000}, c.mask_dead_row = false;
    c.edit_mask = [](std::vector<uint8_t>& m, std::vector<float>&) {
      std::fill(m.begin(), m.end(), uint8_t{0});
      m[4999] = 1;    // batch 0: the last key
      m[5000] = 200;  // batch 1: the first key
    };
    run_case(c);
  }
  {
    Case c;  // decoding a few queries with 8 query heads per KV head, causal
    c.B = 1, c.H = 8, c.Hkv = 1, c.Lq = 3, c.Lk = 4500, c.D = 16;
    c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    run_case(c);
    c.causal = MHA_CAUSAL_TOP_LEFT;  // here only keys 0..2 take part
    run_case(c);
  }
}

TEST_P(Attention, StridesOfSizeOneDimensionsAreIgnored) {
  // A dimension of size 1 is never stepped along: its stride may be anything.
  Case c;
  c.B = 1, c.H = 2, c.Lq = 1, c.Lk = 9, c.D = 8;
  c.edit_views = [](mha_tensor& q, mha_tensor& k, mha_tensor& v, mha_tensor& out) {
    const int64_t huge = int64_t{1} << 40;
    q.strides[0] = q.strides[2] = huge;
    k.strides[0] = v.strides[0] = huge;
    out.strides[0] = out.strides[2] = 0;
  };
  run_case(c);
}

TEST_P(Attention, ResultsDoNotDependOnThreadCount) {
  const Case cases[] = {
      [] {
        Case c;
        c.B = 2, c.H = 3, c.Lq = 70, c.Lk = 70, c.D = 16, c.causal = MHA_CAUSAL_TOP_LEFT;
        return c;
      }(),
      [] {
        Case c;
        c.B = 1, c.H = 4, c.Hkv = 2, c.Lq = 1, c.Lk = 5000, c.D = 16, c.lens = Lens::PerBatch;
        c.lens_values = {4321};
        return c;
      }(),
      [] {
        // K and V copied per item, whose query tiles go into longer items
        // for fewer threads (16 items a thread): with whole sequences per
        // item, 16 items would also call for split-KV over these 1200 keys,
        // which must not follow the thread count.
        Case c;
        c.B = 4, c.H = 4, c.Hkv = 2, c.Lq = 320, c.Lk = 1200, c.D = 2, c.Dv = 2;
        c.k_layout = c.v_layout = Layout::BLHD;
        return c;
      }(),
      [] {
        // K and V read in place (head-major), whose query tiles also go
        // into longer items for fewer threads: whole heads of 5 tiles at 1
        // thread, 4, 2 and 1 tiles at 2, 3 and 7 (16 items a thread).
        Case c;
        c.B = 2, c.H = 8, c.Hkv = 4, c.Lq = 260, c.Lk = 260, c.D = 8;
        c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
        return c;
      }(),
  };
  for (const Case& c : cases) {
    std::vector<Outcome> outcomes;
    for (const int32_t threads : {1, 2, 3, 7, 16}) {
      ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
      ASSERT_EQ(mha_get_num_threads(), threads);
      outcomes.push_back(run_case(c));
      ASSERT_TRUE(outcomes.back().ok);
    }
    for (size_t n = 1; n < outcomes.size(); ++n) {
      EXPECT_EQ(0, std::memcmp(outcomes[n].out.data(), outcomes[0].out.data(),
                               outcomes[0].out.size() * sizeof(float)))
          << "out differs between 1 thread and run " << n << " (" << c.describe() << ")";
      EXPECT_EQ(0, std::memcmp(outcomes[n].lse.data(), outcomes[0].lse.data(),
                               outcomes[0].lse.size() * sizeof(float)))
          << "lse differs between 1 thread and run " << n << " (" << c.describe() << ")";
    }
  }
}

TEST_P(Attention, RandomProblems) {
  // A sweep of small random problems mixing every feature.
  Rng rng(4242);
  for (int trial = 0; trial < 40; ++trial) {
    Case c;
    c.Hkv = rng.integer(1, 3);
    c.H = c.Hkv * rng.integer(1, 3);
    c.B = rng.integer(1, 3), c.Lq = rng.integer(1, 40), c.Lk = rng.integer(1, 40);
    c.D = rng.integer(1, 40), c.Dv = rng.integer(1, 40);
    c.q_layout = rng.chance(0.5) ? Layout::BLHD : Layout::BHLD;
    c.k_layout = rng.chance(0.5) ? Layout::BLHD : Layout::BHLD;
    c.v_layout = rng.chance(0.5) ? Layout::BLHD : Layout::BHLD;
    c.out_layout = rng.chance(0.5) ? Layout::BLHD : Layout::BHLD;
    c.pad = rng.integer(0, 2);
    c.causal = static_cast<int32_t>(rng.integer(0, 2));
    c.lens = static_cast<Lens>(rng.integer(0, 2));
    c.lens_dtype = rng.chance(0.5) ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
    c.mask = static_cast<MaskKind>(rng.integer(0, 2));
    const auto shapes = mask_shapes(c.B, c.H, c.Lq, c.Lk);
    c.mask_shape =
        shapes[static_cast<size_t>(rng.integer(0, static_cast<int64_t>(shapes.size()) - 1))];
    c.mask_dead_row = rng.chance(0.3);
    if (rng.chance(0.3)) c.has_scale = true, c.scale = rng.uniform(-2.0f, 2.0f);
    c.lse = rng.chance(0.7);
    c.seed = static_cast<uint64_t>(trial) + 5000;
    run_case(c);
  }
}

// Scores that keep growing along the keys: every key tile holds a new row
// maximum, by a little (kernels may keep an older maximum as the exponent's
// shift) or by a lot (they must rescale).  Causal and not, so both the
// unmasked interior tiles and the masked diagonal ones see it.
TEST_P(Attention, ScoresGrowingAlongTheKeys) {
  for (const float growth : {0.002f, 0.05f, 0.6f}) {
    for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT}) {
      const int64_t B = 1, H = 2, Lq = 70, Lk = 700, D = 16;
      SCOPED_TRACE(::testing::Message() << "growth per key " << growth << " causal " << causal);
      Rng rng(7);
      std::vector<float> q(B * H * Lq * D), k(B * H * Lk * D), v(B * H * Lk * D),
          out(B * H * Lq * D, -7.0f), lse(B * H * Lq);
      for (auto& x : q) x = 1.0f + 0.1f * rng.uniform();
      for (int64_t r = 0; r < B * H * Lk; ++r) {
        const int64_t j = r % Lk;
        for (int64_t x = 0; x < D; ++x) {
          k[r * D + x] = growth * static_cast<float>(j) + 0.1f * rng.uniform();
        }
      }
      for (auto& x : v) x = rng.uniform();
      mha_tensor tq, tk, tv, tout, tlse;
      const int64_t sq[4] = {B, H, Lq, D}, sk[4] = {B, H, Lk, D}, sl[3] = {B, H, Lq};
      ASSERT_EQ(mha_tensor_init(&tq, q.data(), MHA_DTYPE_F32, 4, sq, nullptr), MHA_OK);
      ASSERT_EQ(mha_tensor_init(&tk, k.data(), MHA_DTYPE_F32, 4, sk, nullptr), MHA_OK);
      ASSERT_EQ(mha_tensor_init(&tv, v.data(), MHA_DTYPE_F32, 4, sk, nullptr), MHA_OK);
      ASSERT_EQ(mha_tensor_init(&tout, out.data(), MHA_DTYPE_F32, 4, sq, nullptr), MHA_OK);
      ASSERT_EQ(mha_tensor_init(&tlse, lse.data(), MHA_DTYPE_F32, 3, sl, nullptr), MHA_OK);
      mha_attention_params p;
      mha_attention_params_init(&p);
      p.causal = causal;
      p.lse = &tlse;
      ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, &p), MHA_OK) << mha_last_error();
      const Reference ref = reference_attention(tq, tk, tv, &p);
      EXPECT_LE(max_abs_error(tout, ref), tolerance(ref));
      double worst = 0;  // error / tolerance
      for (size_t r = 0; r < lse.size(); ++r) {
        worst = std::max(worst, std::fabs(static_cast<double>(lse[r]) - ref.lse[r]) /
                                    lse_tolerance(ref, ref.lse[r]));
      }
      EXPECT_LE(worst, 1.0) << "lse error / tolerance";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Attention, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

// ------------------------------------------------------------------ heavy (ctest label "heavy")

class AttentionHeavy : public Attention {};

TEST_P(AttentionHeavy, Long4096) {
  Case c;
  c.B = 1, c.H = 1, c.Lq = 4096, c.Lk = 4096, c.D = 64;
  run_case(c);
  c.causal = MHA_CAUSAL_BOTTOM_RIGHT, c.Lq = 4000, c.lens = Lens::PerBatch, c.lens_values = {4000};
  c.seed = 2;
  run_case(c);
}

INSTANTIATE_TEST_SUITE_P(Backends, AttentionHeavy, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

}  // namespace
}  // namespace mha_test
