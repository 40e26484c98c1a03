// Packed variable-length batches (mha_attention_varlen, FlashAttention-2's
// cu_seqlens layout) on every backend: each sequence against the float64
// reference run on that sequence alone, and bit for bit against mha_attention
// called on it alone (the same plan, so the same bits); lengths 0, 1, tile
// boundaries +-1 and one long among short ones; every option per sequence
// (causal both ways, GQA, the variants, dropout, LSE, half precision, int8);
// the same bits for 1, 2, 3 and 7 threads; bad input refused by name with
// nothing written.  Buffers are sized exactly, so ASan sees a read past a
// sequence table's end.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend_param.h"
#include "packed_outputs.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

uint32_t bits(float x) {
  return float_bits(x);
}

struct Options {
  int64_t H = 4, Hkv = 2, D = 32, Dv = 24;
  int32_t causal = MHA_CAUSAL_NONE;
  int32_t dtype = MHA_DTYPE_F32;  // of q, k and v
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi_per_sequence = false;
  bool sinks = false;
  float dropout_p = 0.0f;
};

// A packed batch: q [total_q, H, D], k [total_k, Hkv, D], v [total_k, Hkv,
// Dv], out [total_q, H, Dv] (f32), lse [H, total_q], random values.
class Packed {
 public:
  Packed(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k, const Options& o,
         uint64_t seed)
      : o_(o), batch_(static_cast<int64_t>(lens_q.size())) {
    cu_q_.push_back(0);
    cu_k_.push_back(0);
    for (size_t b = 0; b < lens_q.size(); ++b) {
      cu_q_.push_back(cu_q_.back() + lens_q[b]);
      cu_k_.push_back(cu_k_.back() + lens_k[b]);
    }
    total_q_ = cu_q_.back();
    total_k_ = cu_k_.back();
    Rng rng(seed);
    q_.resize(static_cast<size_t>(total_q_ * o.H * o.D));
    k_.resize(static_cast<size_t>(total_k_ * o.Hkv * o.D));
    v_.resize(static_cast<size_t>(total_k_ * o.Hkv * o.Dv));
    for (float& x : q_) x = rng.uniform();
    for (float& x : k_) x = rng.uniform();
    for (float& x : v_) x = rng.uniform();
    slopes_.resize(static_cast<size_t>(batch_ * o.H));
    for (float& s : slopes_) s = rng.uniform(0.0f, 0.5f);
    sinks_.resize(static_cast<size_t>(o.H));
    for (float& s : sinks_) s = rng.uniform(-1.0f, 3.0f);
    tq_ = describe(q_.data(), MHA_DTYPE_F32, {total_q_, o.H, o.D});
    tk_ = describe(k_.data(), MHA_DTYPE_F32, {total_k_, o.Hkv, o.D});
    tv_ = describe(v_.data(), MHA_DTYPE_F32, {total_k_, o.Hkv, o.Dv});
    q_typed_ = std::make_unique<TypedCopy>(tq_, o.dtype);
    k_typed_ = std::make_unique<TypedCopy>(tk_, o.dtype);
    v_typed_ = std::make_unique<TypedCopy>(tv_, o.dtype);
    outputs_ = std::make_unique<PackedOutputs>(total_q_, o.H, o.Dv);
    out = outputs_->out;
    lse = outputs_->lse;
    cu_q = describe(cu_q_.data(), MHA_DTYPE_I32, {batch_ + 1});
    cu_k = describe(cu_k_.data(), MHA_DTYPE_I32, {batch_ + 1});
    slopes = describe(slopes_.data(), MHA_DTYPE_F32, {batch_, o.H});
    sinks = describe(sinks_.data(), MHA_DTYPE_F32, {o.H});
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &cu_q;
    varlen.cu_seqlens_k = &cu_k;
    mha_attention_params_init(&params);
    params.causal = o.causal;
    params.window_left = o.window_left;
    params.window_right = o.window_right;
    params.softcap = o.softcap;
    params.lse = &lse;
    params.dropout_p = o.dropout_p;
    params.dropout_seed = seed * 31;
    if (o.alibi_per_sequence) params.alibi_slopes = &slopes;
    if (o.sinks) params.sinks = &sinks;
  }
  Packed(const Packed&) = delete;  // params points into this object
  Packed& operator=(const Packed&) = delete;

  mha_tensor& q() { return q_typed_->get(); }
  mha_tensor& k() { return k_typed_->get(); }
  mha_tensor& v() { return v_typed_->get(); }
  mha_status run() { return mha_attention_varlen(&q(), &k(), &v(), &out, &varlen, &params); }

  int64_t batch() const { return batch_; }
  int64_t q_begin(int64_t b) const { return cu_q_[static_cast<size_t>(b)]; }
  int64_t q_len(int64_t b) const { return cu_q_[static_cast<size_t>(b + 1)] - q_begin(b); }
  int64_t k_begin(int64_t b) const { return cu_k_[static_cast<size_t>(b)]; }
  int64_t k_len(int64_t b) const { return cu_k_[static_cast<size_t>(b + 1)] - k_begin(b); }

  // Sequence b of a packed [total, heads, d] tensor as [1, heads, len, d].
  static mha_tensor view(const mha_tensor& t, int64_t first, int64_t len) {
    mha_tensor v = describe(
        static_cast<char*>(t.data) + first * t.strides[0] * (t.dtype == MHA_DTYPE_F32 ? 4 : 2),
        static_cast<mha_dtype>(t.dtype), {1, t.shape[1], len, t.shape[2]},
        {0, t.strides[1], t.strides[0], t.strides[2]});
    return v;
  }
  // mha_attention's params for sequence b alone: its ALiBi row, its seed.
  mha_attention_params params_of(int64_t b, mha_tensor* slope_row) const {
    mha_attention_params p = params;
    p.lse = nullptr;
    p.dropout_seed = params.dropout_seed + static_cast<uint64_t>(b);
    if (params.alibi_slopes != nullptr) {
      *slope_row = describe(const_cast<float*>(slopes_.data()) + b * o_.H, MHA_DTYPE_F32, {o_.H});
      p.alibi_slopes = slope_row;
    }
    return p;
  }

  float out_at(int64_t row, int64_t h, int64_t x) const { return outputs_->out_at(row, h, x); }
  float lse_at(int64_t h, int64_t row) const { return outputs_->lse_at(h, row); }
  bool untouched() const { return outputs_->untouched(); }
  std::vector<float> results() const { return outputs_->results(); }

  mha_tensor out{}, lse{}, cu_q{}, cu_k{}, slopes{}, sinks{};
  mha_varlen_params varlen{};
  mha_attention_params params{};
  std::vector<int32_t> cu_q_, cu_k_;

 private:
  Options o_;
  int64_t batch_, total_q_ = 0, total_k_ = 0;
  std::vector<float> q_, k_, v_, slopes_, sinks_;
  std::unique_ptr<PackedOutputs> outputs_;
  mha_tensor tq_{}, tk_{}, tv_{};
  std::unique_ptr<TypedCopy> q_typed_, k_typed_, v_typed_;
};

// Every sequence against the reference on that sequence alone.
void expect_matches_reference(Packed& p, const Options& o) {
  const char* backend = mha_selected_backend();
  ASSERT_NE(backend, nullptr) << mha_last_error();
  for (int64_t b = 0; b < p.batch(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b) + " (Lq " + std::to_string(p.q_len(b)) + ", Lk " +
                 std::to_string(p.k_len(b)) + ")");
    const int64_t lq = p.q_len(b), lk = p.k_len(b), q0 = p.q_begin(b);
    if (lq == 0) continue;
    if (lk == 0) {  // zeros, LSE the sink or -inf
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t h = 0; h < o.H; ++h) {
          for (int64_t x = 0; x < o.Dv; ++x) ASSERT_EQ(p.out_at(q0 + i, h, x), 0.0f);
          const float want = o.sinks ? static_cast<const float*>(p.sinks.data)[h] : -INFINITY;
          ASSERT_EQ(p.lse_at(h, q0 + i), want);
        }
      }
      continue;
    }
    mha_tensor slope_row{};
    const mha_attention_params alone = p.params_of(b, &slope_row);
    const mha_tensor qv = Packed::view(p.q(), q0, lq);
    const mha_tensor kv = Packed::view(p.k(), p.k_begin(b), lk);
    const mha_tensor vv = Packed::view(p.v(), p.k_begin(b), lk);
    const Reference ref = reference_attention(qv, kv, vv, &alone);
    const mha_tensor ov = Packed::view(p.out, q0, lq);
    EXPECT_LE(max_abs_error(ov, ref), tolerance_for(backend, o.dtype, o.dtype, ref, MHA_DTYPE_F32));
    for (int64_t h = 0; h < o.H; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        const double want = ref.lse[static_cast<size_t>(h * lq + i)];
        const float got = p.lse_at(h, q0 + i);
        if (std::isinf(want)) {
          EXPECT_EQ(got, want) << "lse head " << h << " row " << i;
        } else {
          EXPECT_NEAR(got, want, lse_tolerance(ref, want)) << "lse head " << h << " row " << i;
        }
      }
    }
  }
}

// Every sequence bit for bit against mha_attention on it alone (with the
// sequence's seed; the LSE too).
void expect_same_bits_as_calls_alone(Packed& p, const Options& o) {
  for (int64_t b = 0; b < p.batch(); ++b) {
    const int64_t lq = p.q_len(b), lk = p.k_len(b), q0 = p.q_begin(b);
    if (lq == 0 || lk == 0) continue;
    SCOPED_TRACE("sequence " + std::to_string(b));
    mha_tensor slope_row{};
    mha_attention_params alone = p.params_of(b, &slope_row);
    std::vector<float> out(static_cast<size_t>(lq * o.H * o.Dv)),
        lse(static_cast<size_t>(o.H * lq));
    mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, o.H, lq, o.Dv});
    mha_tensor tlse = describe(lse.data(), MHA_DTYPE_F32, {1, o.H, lq});
    alone.lse = &tlse;
    const mha_tensor qv = Packed::view(p.q(), q0, lq);
    const mha_tensor kv = Packed::view(p.k(), p.k_begin(b), lk);
    const mha_tensor vv = Packed::view(p.v(), p.k_begin(b), lk);
    ASSERT_EQ(mha_attention(&qv, &kv, &vv, &tout, &alone), MHA_OK) << mha_last_error();
    int64_t differ = 0;
    for (int64_t h = 0; h < o.H; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t x = 0; x < o.Dv; ++x) {
          const float a = out[static_cast<size_t>((h * lq + i) * o.Dv + x)];
          const float c = p.out_at(q0 + i, h, x);
          differ += bits(a) != bits(c) ? 1 : 0;
        }
        const float a = lse[static_cast<size_t>(h * lq + i)], c = p.lse_at(h, q0 + i);
        differ += bits(a) != bits(c) ? 1 : 0;
      }
    }
    EXPECT_EQ(differ, 0) << "values differ from the sequence's own mha_attention call";
  }
}

void run(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k, const Options& o,
         uint64_t seed) {
  Packed p(lens_q, lens_k, o, seed);
  ASSERT_EQ(p.run(), MHA_OK) << mha_last_error();
  if (o.dropout_p == 0.0f) expect_matches_reference(p, o);
  expect_same_bits_as_calls_alone(p, o);
}

class Varlen : public BackendTest {};

// Lengths 0 and 1, the query tile (64) and the key tiles (96, 288) +-1, one
// long sequence among short ones; self-attention (equal lengths) and
// decoding-like rows (few queries over long keys: the decode layout, split
// over the keys).
TEST_P(Varlen, LengthsAndTileBoundaries) {
  const std::vector<int32_t> lens = {5, 0, 1, 63, 64, 65, 95, 96, 97, 287, 288, 289, 1000, 3};
  for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT}) {
    SCOPED_TRACE("causal " + std::to_string(causal));
    Options o;
    o.causal = causal;
    run(lens, lens, o, 1 + static_cast<uint64_t>(causal));
  }
  // Queries and keys of different lengths per sequence, keyless sequences
  // among them; one decode-like sequence over 3000 keys (split-KV).
  const std::vector<int32_t> lens_q = {1, 2, 0, 70, 1, 9, 4};
  const std::vector<int32_t> lens_k = {3000, 0, 5, 40, 700, 0, 129};
  for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_BOTTOM_RIGHT}) {
    SCOPED_TRACE("cross, causal " + std::to_string(causal));
    Options o;
    o.causal = causal;
    o.H = 8;
    o.Hkv = 2;
    o.D = o.Dv = 64;
    run(lens_q, lens_k, o, 10 + static_cast<uint64_t>(causal));
  }
}

TEST_P(Varlen, VariantsPerSequence) {
  const std::vector<int32_t> lens_q = {200, 1, 0, 33, 90};
  const std::vector<int32_t> lens_k = {200, 900, 4, 0, 300};
  Options o;
  o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  o.window_left = 40;
  run(lens_q, lens_k, o, 21);
  o.window_right = 3;
  o.causal = MHA_CAUSAL_NONE;
  o.softcap = 5.0f;
  o.sinks = true;
  run(lens_q, lens_k, o, 22);
  o.alibi_per_sequence = true;
  o.window_left = o.window_right = -1;
  run(lens_q, lens_k, o, 23);
}

TEST_P(Varlen, HalfPrecisionInputs) {
  const std::vector<int32_t> lens = {100, 1, 300, 17};
  Options o;
  o.causal = MHA_CAUSAL_TOP_LEFT;
  o.dtype = MHA_DTYPE_BF16;
  run(lens, lens, o, 31);
  o.dtype = MHA_DTYPE_F16;
  run({1, 2, 1}, {800, 40, 1}, o, 32);
}

// Dropout: sequence b draws as its own call with the seed dropout_seed + b.
TEST_P(Varlen, DropoutPerSequenceSeeds) {
  Options o;
  o.dropout_p = 0.25f;
  o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  run({70, 3, 1, 150}, {70, 300, 640, 150}, o, 41);
}

TEST_P(Varlen, SameBitsForAnyThreadCount) {
  const std::vector<int32_t> lens_q = {2000, 50, 50, 1, 50, 300, 7};
  const std::vector<int32_t> lens_k = {2000, 50, 50, 4000, 50, 300, 7};
  Options o;
  o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  o.D = o.Dv = 64;
  std::vector<float> first;
  for (const int32_t threads : {1, 2, 3, 7}) {
    ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
    Packed p(lens_q, lens_k, o, 51);
    ASSERT_EQ(p.run(), MHA_OK) << mha_last_error();
    if (first.empty()) {
      first = p.results();
      continue;
    }
    const std::vector<float> now = p.results();
    EXPECT_EQ(std::memcmp(now.data(), first.data(), now.size() * 4), 0)
        << threads << " threads differ from 1";
  }
}

TEST_P(Varlen, Int8Cache) {
  // K and V quantised per row, scales F32 [total_k, Hkv]; the reference reads
  // the same int8 values and scales.
  const std::vector<int32_t> lens_q = {1, 40, 3};
  const std::vector<int32_t> lens_k = {600, 40, 90};
  Options o;
  Packed p(lens_q, lens_k, o, 61);
  const int64_t total_k = 730, hkv = o.Hkv;
  std::vector<int8_t> k8(static_cast<size_t>(total_k * hkv * o.D)),
      v8(static_cast<size_t>(total_k * hkv * o.Dv));
  std::vector<float> ks(static_cast<size_t>(total_k * hkv)), vs(ks.size());
  Rng rng(62);
  for (auto& x : k8) x = static_cast<int8_t>(rng.integer(-127, 127));
  for (auto& x : v8) x = static_cast<int8_t>(rng.integer(-127, 127));
  for (auto& s : ks) s = rng.uniform(0.001f, 0.02f);
  for (auto& s : vs) s = rng.uniform(0.001f, 0.02f);
  mha_tensor tk = describe(k8.data(), MHA_DTYPE_I8, {total_k, hkv, o.D});
  mha_tensor tv = describe(v8.data(), MHA_DTYPE_I8, {total_k, hkv, o.Dv});
  mha_tensor tks = describe(ks.data(), MHA_DTYPE_F32, {total_k, hkv});
  mha_tensor tvs = describe(vs.data(), MHA_DTYPE_F32, {total_k, hkv});
  p.params.k_scale = &tks;
  p.params.v_scale = &tvs;
  ASSERT_EQ(mha_attention_varlen(&p.q(), &tk, &tv, &p.out, &p.varlen, &p.params), MHA_OK)
      << mha_last_error();
  const char* backend = mha_selected_backend();
  for (int64_t b = 0; b < p.batch(); ++b) {
    const int64_t lq = p.q_len(b), lk = p.k_len(b);
    mha_attention_params alone = p.params;
    alone.lse = nullptr;
    mha_tensor kss =
        describe(ks.data() + p.k_begin(b) * hkv, MHA_DTYPE_F32, {1, hkv, lk}, {0, 1, hkv});
    mha_tensor vss =
        describe(vs.data() + p.k_begin(b) * hkv, MHA_DTYPE_F32, {1, hkv, lk}, {0, 1, hkv});
    alone.k_scale = &kss;
    alone.v_scale = &vss;
    const mha_tensor qv = Packed::view(p.q(), p.q_begin(b), lq);
    mha_tensor kv = describe(k8.data() + p.k_begin(b) * hkv * o.D, MHA_DTYPE_I8, {1, hkv, lk, o.D},
                             {0, o.D, hkv * o.D, 1});
    mha_tensor vv = describe(v8.data() + p.k_begin(b) * hkv * o.Dv, MHA_DTYPE_I8,
                             {1, hkv, lk, o.Dv}, {0, o.Dv, hkv * o.Dv, 1});
    const Reference ref = reference_attention(qv, kv, vv, &alone);
    const mha_tensor ov = Packed::view(p.out, p.q_begin(b), lq);
    EXPECT_LE(max_abs_error(ov, ref),
              tolerance_for(backend, MHA_DTYPE_F32, MHA_DTYPE_I8, ref, MHA_DTYPE_F32))
        << "sequence " << b;
  }
}

// Each bad argument is refused with a message naming it, and nothing is
// written.
TEST_P(Varlen, BadInputIsRefusedByName) {
  const std::vector<int32_t> lens = {3, 5, 2};
  Options o;
  struct Bad {
    const char* what;
    const char* named;
    std::function<void(Packed&)> spoil;
  };
  static mha_tensor wrong;  // outlives each call
  static std::vector<int32_t> wrong_values;
  static std::vector<float> wrong_floats;
  const std::vector<Bad> bad = {
      {"no varlen", "varlen", [](Packed& p) { p.varlen.struct_size = 0; }},
      {"cu_seqlens_q NULL", "cu_seqlens_q", [](Packed& p) { p.varlen.cu_seqlens_q = nullptr; }},
      {"cu_seqlens_k NULL", "cu_seqlens_k", [](Packed& p) { p.varlen.cu_seqlens_k = nullptr; }},
      {"not starting at 0", "cu_seqlens_q[0]", [](Packed& p) { p.cu_q_[0] = 1; }},
      {"decreasing", "cu_seqlens_k[2]",
       [](Packed& p) {
         p.cu_k_[1] = 6;
         p.cu_k_[2] = 4;
       }},
      {"not ending at the total", "cu_seqlens_q[3]", [](Packed& p) { p.cu_q_[3] = 9; }},
      {"i64 offsets", "cu_seqlens_k",
       [](Packed& p) {
         wrong_values.assign(8, 0);
         wrong = describe(wrong_values.data(), MHA_DTYPE_I64, {4});
         p.varlen.cu_seqlens_k = &wrong;
       }},
      {"B disagrees", "cu_seqlens_k",
       [](Packed& p) {
         wrong_values = {0, 10};
         wrong = describe(wrong_values.data(), MHA_DTYPE_I32, {2});
         p.varlen.cu_seqlens_k = &wrong;
       }},
      {"valid_lens", "valid_lens", [](Packed& p) { p.params.valid_lens = &p.cu_q; }},
      {"mask", "mask", [](Packed& p) { p.params.mask = &p.cu_q; }},
      {"lse [total_q, H]", "lse",
       [](Packed& p) {
         wrong_floats.assign(40, 0.0f);
         wrong = describe(wrong_floats.data(), MHA_DTYPE_F32, {10, 4});
         p.params.lse = &wrong;
       }},
      {"alibi [B + 1, H]", "alibi_slopes",
       [](Packed& p) {
         wrong_floats.assign(16, 0.0f);
         wrong = describe(wrong_floats.data(), MHA_DTYPE_F32, {4, 4});
         p.params.alibi_slopes = &wrong;
       }},
      {"window -2", "window_left", [](Packed& p) { p.params.window_left = -2; }},
      {"a block of a larger problem", "query_offset", [](Packed& p) { p.params.key_offset = 3; }},
      {"lse inside out", "out",
       [](Packed& p) {
         wrong = describe(p.out.data, MHA_DTYPE_F32, {4, 10});
         p.params.lse = &wrong;
       }},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    Packed p(lens, lens, o, 71);
    b.spoil(p);
    EXPECT_NE(p.run(), MHA_OK);
    EXPECT_NE(std::string(mha_last_error()).find(b.named), std::string::npos) << mha_last_error();
    EXPECT_TRUE(p.untouched()) << "written although refused";
  }
  Packed p(lens, lens, o, 72);
  EXPECT_EQ(mha_attention_varlen(&p.q(), &p.k(), &p.v(), &p.out, nullptr, &p.params),
            MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("varlen"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, Varlen, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

}  // namespace
}  // namespace mha_test
