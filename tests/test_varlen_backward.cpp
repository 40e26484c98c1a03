// mha_attention_varlen_backward on every backend: each sequence's gradients
// against the float64 analytic reference run on that sequence alone
// (reference_backward, independent of the library), and bit for bit against
// mha_attention_backward called on it alone; lengths 0 and 1, tile
// boundaries, a sequence long enough for split key chunks among short ones,
// seqused_k; GQA, both causal alignments, the variants, dropout with each
// sequence's seed, dsinks summed over the sequences; half precision; the
// same bits for 1, 2, 3 and 7 threads; zeros where no query reads a key;
// bad input refused by name with nothing written.  Buffers are sized
// exactly, so ASan sees a write past a gradient's end.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "backend_param.h"
#include "common/dtype.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_test {
namespace {

struct Options {
  int64_t H = 4, Hkv = 2, D = 32, Dv = 24;
  int32_t causal = MHA_CAUSAL_NONE;
  int32_t dtype = MHA_DTYPE_F32;       // q, k, v, out and dout
  int32_t grad_dtype = MHA_DTYPE_F32;  // dq, dk, dv
  bool out_f32 = false;                // the forward's out in F32 (dout stays in dtype)
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi_per_sequence = false;
  bool sinks = false;
  float dropout_p = 0.0f;
  std::vector<int32_t> seqused_k;  // empty: every key row
};

int64_t size_of(int32_t dtype) {
  return dtype == MHA_DTYPE_F32 ? 4 : 2;
}

// A packed tensor [rows, heads, d] of one dtype, exactly its bytes.
class PackedTensor {
 public:
  PackedTensor(int64_t rows, int64_t heads, int64_t d, int32_t dtype)
      : bytes_(static_cast<size_t>(rows * heads * d * size_of(dtype))) {
    t = describe(bytes_.data(), static_cast<mha_dtype>(dtype), {rows, heads, d});
  }
  // Random values in [lo, hi), rounded to the dtype.
  void fill(Rng& rng, float lo = -1.0f, float hi = 1.0f) {
    for (int64_t e = 0; e < count(); ++e)
      mha_types::store_float(t.data, t.dtype, e, rng.uniform(lo, hi));
  }
  // Every element NaN: what the call never writes stays NaN.
  void poison() {
    for (int64_t e = 0; e < count(); ++e) {
      mha_types::store_float(t.data, t.dtype, e, std::numeric_limits<float>::quiet_NaN());
    }
  }
  int64_t count() const { return t.shape[0] * t.shape[1] * t.shape[2]; }
  std::vector<unsigned char> snapshot() const { return bytes_; }
  bool same_as(const std::vector<unsigned char>& before) const { return bytes_ == before; }
  // The element's bits (F32: 32 bits, half: 16).
  uint32_t bits_at(int64_t row, int64_t h, int64_t x) const {
    uint32_t out = 0;
    const int64_t e = row * t.strides[0] + h * t.strides[1] + x * t.strides[2];
    std::memcpy(&out, bytes_.data() + e * size_of(t.dtype), static_cast<size_t>(size_of(t.dtype)));
    return out;
  }
  float at(int64_t row, int64_t h, int64_t x) const {
    return mha_types::load_float(t.data, t.dtype,
                                 row * t.strides[0] + h * t.strides[1] + x * t.strides[2]);
  }
  // Rows [first, first + len) as the [1, heads, len, d] tensor of a call alone.
  mha_tensor view(int64_t first, int64_t len) const {
    return describe(static_cast<char*>(t.data) + first * t.strides[0] * size_of(t.dtype),
                    static_cast<mha_dtype>(t.dtype), {1, t.shape[1], len, t.shape[2]},
                    {0, t.strides[1], t.strides[0], t.strides[2]});
  }

  mha_tensor t{};

 private:
  std::vector<unsigned char> bytes_;
};

// A packed batch with its forward run: q, k, v, out, lse [H, total_q], dout,
// and the gradients to write.
class Batch {
 public:
  Batch(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k, const Options& o,
        uint64_t seed)
      : o_(o),
        batch_(static_cast<int64_t>(lens_q.size())),
        cu_q_(offsets(lens_q)),
        cu_k_(offsets(lens_k)),
        total_q_(cu_q_.back()),
        total_k_(cu_k_.back()),
        q(total_q_, o.H, o.D, o.dtype),
        k(total_k_, o.Hkv, o.D, o.dtype),
        v(total_k_, o.Hkv, o.Dv, o.dtype),
        out(total_q_, o.H, o.Dv, o.out_f32 ? MHA_DTYPE_F32 : o.dtype),
        dout(total_q_, o.H, o.Dv, o.dtype),
        dq(total_q_, o.H, o.D, o.grad_dtype),
        dk(total_k_, o.Hkv, o.D, o.grad_dtype),
        dv(total_k_, o.Hkv, o.Dv, o.grad_dtype),
        lse_(static_cast<size_t>(o.H * total_q_)),
        dsinks_(static_cast<size_t>(o.H), std::numeric_limits<float>::quiet_NaN()) {
    Rng rng(seed);
    q.fill(rng, -1.5f, 1.5f);
    k.fill(rng, -1.5f, 1.5f);
    v.fill(rng);
    dout.fill(rng);
    slopes_.resize(static_cast<size_t>(batch_ * o.H));
    for (float& s : slopes_) s = rng.uniform(0.0f, 0.5f);
    sinks_.resize(static_cast<size_t>(o.H));
    for (float& s : sinks_) s = rng.uniform(-1.0f, 3.0f);
    lse = describe(lse_.data(), MHA_DTYPE_F32, {o.H, total_q_});
    cu_q = describe(cu_q_.data(), MHA_DTYPE_I32, {batch_ + 1});
    cu_k = describe(cu_k_.data(), MHA_DTYPE_I32, {batch_ + 1});
    slopes = describe(slopes_.data(), MHA_DTYPE_F32, {batch_, o.H});
    sinks = describe(sinks_.data(), MHA_DTYPE_F32, {o.H});
    dsinks = describe(dsinks_.data(), MHA_DTYPE_F32, {o.H});
    used_ = o.seqused_k;
    used = describe(used_.data(), MHA_DTYPE_I32, {batch_});
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &cu_q;
    varlen.cu_seqlens_k = &cu_k;
    if (!used_.empty()) varlen.seqused_k = &used;
    mha_attention_params_init(&params);
    params.causal = o.causal;
    params.window_left = o.window_left;
    params.window_right = o.window_right;
    params.softcap = o.softcap;
    params.dropout_p = o.dropout_p;
    params.dropout_seed = seed * 31;
    if (o.alibi_per_sequence) params.alibi_slopes = &slopes;
    if (o.sinks) params.sinks = &sinks;
    mha_backward_params_init(&backward);
    if (o.sinks) backward.dsinks = &dsinks;
    dq.poison();
    dk.poison();
    dv.poison();
  }
  Batch(const Batch&) = delete;  // the params point into this object
  Batch& operator=(const Batch&) = delete;

  mha_status forward() {
    mha_attention_params p = params;
    p.lse = &lse;
    return mha_attention_varlen(&q.t, &k.t, &v.t, &out.t, &varlen, &p);
  }
  mha_status run() {
    return mha_attention_varlen_backward(&q.t, &k.t, &v.t, &out.t, &lse, &dout.t, &dq.t, &dk.t,
                                         &dv.t, &varlen, &params, &backward);
  }

  int64_t batch() const { return batch_; }
  int64_t q_begin(int64_t b) const { return cu_q_[static_cast<size_t>(b)]; }
  int64_t q_len(int64_t b) const { return cu_q_[static_cast<size_t>(b + 1)] - q_begin(b); }
  int64_t k_begin(int64_t b) const { return cu_k_[static_cast<size_t>(b)]; }
  int64_t k_rows(int64_t b) const { return cu_k_[static_cast<size_t>(b + 1)] - k_begin(b); }
  // The keys sequence b uses.
  int64_t k_used(int64_t b) const {
    return used_.empty() ? k_rows(b) : used_[static_cast<size_t>(b)];
  }
  float dsinks_at(int64_t h) const { return dsinks_[static_cast<size_t>(h)]; }

  // mha_attention_backward's params for sequence b alone: its ALiBi row, its
  // seed.
  mha_attention_params params_of(int64_t b, mha_tensor* slope_row) const {
    mha_attention_params p = params;
    p.dropout_seed = params.dropout_seed + static_cast<uint64_t>(b);
    if (params.alibi_slopes != nullptr) {
      *slope_row = describe(const_cast<float*>(slopes_.data()) + b * o_.H, MHA_DTYPE_F32, {o_.H});
      p.alibi_slopes = slope_row;
    }
    return p;
  }
  // The LSE of sequence b as [1, H, lq].
  mha_tensor lse_of(int64_t b) const {
    return describe(const_cast<float*>(lse_.data()) + q_begin(b), MHA_DTYPE_F32,
                    {1, o_.H, q_len(b)}, {0, total_q_, 1});
  }

  mha_tensor lse{}, cu_q{}, cu_k{}, slopes{}, sinks{}, dsinks{}, used{};
  mha_varlen_params varlen{};
  mha_attention_params params{};
  mha_backward_params backward{};

 private:
  static std::vector<int32_t> offsets(const std::vector<int32_t>& lens) {
    std::vector<int32_t> cu = {0};
    for (const int32_t n : lens) cu.push_back(cu.back() + n);
    return cu;
  }

  Options o_;
  int64_t batch_;
  std::vector<int32_t> cu_q_, cu_k_;
  int64_t total_q_, total_k_;

 public:
  PackedTensor q, k, v, out, dout, dq, dk, dv;

 private:
  std::vector<float> lse_, slopes_, sinks_, dsinks_;
  std::vector<int32_t> used_;
};

// Rows [first, end) of a packed gradient hold exact zeros.
int64_t nonzero_rows(const PackedTensor& g, int64_t first, int64_t end) {
  int64_t bad = 0;
  for (int64_t r = first; r < end; ++r) {
    for (int64_t h = 0; h < g.t.shape[1]; ++h) {
      for (int64_t x = 0; x < g.t.shape[2]; ++x) bad += g.bits_at(r, h, x) != 0 ? 1 : 0;
    }
  }
  return bad;
}

// Elements of rows [first, first + len) of a packed gradient whose bits
// differ from a dense [1, heads, len, d] gradient of the same dtype.
int64_t differing(const PackedTensor& packed, int64_t first, const PackedTensor& alone) {
  int64_t differ = 0;
  const int64_t len = alone.t.shape[0] / packed.t.shape[1];
  for (int64_t h = 0; h < packed.t.shape[1]; ++h) {
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t x = 0; x < packed.t.shape[2]; ++x) {
        differ += packed.bits_at(first + i, h, x) != alone.bits_at(h * len + i, 0, x) ? 1 : 0;
      }
    }
  }
  return differ;
}

// Each sequence against the reference on it alone, and bit for bit against
// mha_attention_backward on it alone; zeros where no query reads; dsinks
// against the sum of the sequences' references.
void check_batch(Batch& p, const Options& o) {
  std::vector<double> dsinks_want(static_cast<size_t>(o.H), 0.0);
  double dsinks_terms = 0.0, max_logit = 0.0;
  for (int64_t b = 0; b < p.batch(); ++b) {
    const int64_t lq = p.q_len(b), lk = p.k_used(b), q0 = p.q_begin(b), k0 = p.k_begin(b);
    SCOPED_TRACE("sequence " + std::to_string(b) + " (Lq " + std::to_string(lq) + ", Lk " +
                 std::to_string(lk) + " of " + std::to_string(p.k_rows(b)) + ")");
    const int64_t reads = lq > 0 ? lk : 0;  // keys some query reads
    EXPECT_EQ(nonzero_rows(p.dk, k0 + reads, k0 + p.k_rows(b)), 0) << "dk rows no query reads";
    EXPECT_EQ(nonzero_rows(p.dv, k0 + reads, k0 + p.k_rows(b)), 0) << "dv rows no query reads";
    if (lq == 0) continue;
    if (lk == 0) {
      EXPECT_EQ(nonzero_rows(p.dq, q0, q0 + lq), 0) << "dq of a sequence without keys";
      continue;
    }
    mha_tensor slope_row{};
    const mha_attention_params alone = p.params_of(b, &slope_row);
    const mha_tensor qv = p.q.view(q0, lq), kv = p.k.view(k0, lk), vv = p.v.view(k0, lk);
    const mha_tensor ov = p.out.view(q0, lq), gv = p.dout.view(q0, lq);
    // The reference of the stored inputs; with half-precision inputs, delta
    // from the out the backward is given (reference_backward.h).
    const BackwardReference ref =
        reference_backward(qv, kv, vv, gv, &alone, false, o.dtype == MHA_DTYPE_F32 ? nullptr : &ov);
    EXPECT_LE(gradient_error(p.dq.view(q0, lq), ref.dq, ref.terms_dq, ref.max_abs_logit), 1.0)
        << "dq: worst error / tolerance";
    EXPECT_LE(gradient_error(p.dk.view(k0, lk), ref.dk, ref.terms_dk, ref.max_abs_logit), 1.0)
        << "dk: worst error / tolerance";
    EXPECT_LE(gradient_error(p.dv.view(k0, lk), ref.dv, ref.terms_dv, ref.max_abs_logit), 1.0)
        << "dv: worst error / tolerance";
    for (size_t h = 0; h < ref.dsinks.size(); ++h) dsinks_want[h] += ref.dsinks[h];
    dsinks_terms += ref.terms_dsinks;
    max_logit = std::max(max_logit, ref.max_abs_logit);

    // mha_attention_backward on the sequence alone: the same bits.
    PackedTensor dq(o.H * lq, 1, o.D, o.grad_dtype), dk(o.Hkv * lk, 1, o.D, o.grad_dtype),
        dv(o.Hkv * lk, 1, o.Dv, o.grad_dtype);
    mha_tensor tdq = describe(dq.t.data, static_cast<mha_dtype>(o.grad_dtype), {1, o.H, lq, o.D});
    mha_tensor tdk = describe(dk.t.data, static_cast<mha_dtype>(o.grad_dtype), {1, o.Hkv, lk, o.D});
    mha_tensor tdv =
        describe(dv.t.data, static_cast<mha_dtype>(o.grad_dtype), {1, o.Hkv, lk, o.Dv});
    const mha_tensor lse = p.lse_of(b);
    ASSERT_EQ(
        mha_attention_backward(&qv, &kv, &vv, &ov, &lse, &gv, &tdq, &tdk, &tdv, &alone, nullptr),
        MHA_OK)
        << mha_last_error();
    EXPECT_EQ(differing(p.dq, q0, dq), 0) << "dq differs from the sequence's own call";
    EXPECT_EQ(differing(p.dk, k0, dk), 0) << "dk differs from the sequence's own call";
    EXPECT_EQ(differing(p.dv, k0, dv), 0) << "dv differs from the sequence's own call";
  }
  if (o.sinks) {
    const double tol = gradient_tolerance(dsinks_want, dsinks_terms, max_logit);
    for (int64_t h = 0; h < o.H; ++h) {
      EXPECT_NEAR(p.dsinks_at(h), dsinks_want[static_cast<size_t>(h)], tol)
          << "dsinks[" << h << "]";
    }
  }
}

void run(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k, const Options& o,
         uint64_t seed) {
  Batch p(lens_q, lens_k, o, seed);
  ASSERT_EQ(p.forward(), MHA_OK) << mha_last_error();
  ASSERT_EQ(p.run(), MHA_OK) << mha_last_error();
  check_batch(p, o);
}

class VarlenBackward : public BackendTest {};

// Lengths 0 and 1, the query tile (64) +-1, one sequence of 1100 keys (split
// into key chunks: one KV head pair of items is too few for the threads) among
// short ones; self-attention in both causal alignments, then queries and keys
// of different lengths with GQA.
TEST_P(VarlenBackward, LengthsAndTileBoundaries) {
  const std::vector<int32_t> lens = {5, 0, 1, 63, 64, 65, 3};
  for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT}) {
    SCOPED_TRACE("causal " + std::to_string(causal));
    Options o;
    o.causal = causal;
    run(lens, lens, o, 1 + static_cast<uint64_t>(causal));
  }
  const std::vector<int32_t> lens_q = {1, 2, 0, 70, 9, 40};
  const std::vector<int32_t> lens_k = {1100, 0, 5, 40, 129, 1};
  for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_BOTTOM_RIGHT}) {
    SCOPED_TRACE("cross, causal " + std::to_string(causal));
    Options o;
    o.causal = causal;
    o.H = 4;
    o.Hkv = 1;
    o.D = o.Dv = 64;
    run(lens_q, lens_k, o, 10 + static_cast<uint64_t>(causal));
  }
}

// Every variant at once, per sequence: window, softcap, ALiBi slopes per
// sequence, sinks (dsinks summed over the sequences), dropout with the
// sequence's seed; seqused_k leaves key rows no query reads.
TEST_P(VarlenBackward, VariantsDropoutAndSeqused) {
  const std::vector<int32_t> lens_q = {90, 1, 0, 33, 20};
  const std::vector<int32_t> lens_k = {120, 300, 4, 50, 7};
  Options o;
  o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  o.window_left = 40;
  o.softcap = 5.0f;
  o.alibi_per_sequence = true;
  o.sinks = true;
  o.dropout_p = 0.2f;
  o.seqused_k = {100, 300, 2, 0, 7};
  run(lens_q, lens_k, o, 21);
  o.causal = MHA_CAUSAL_NONE;
  o.window_left = -1;
  o.window_right = 3;
  o.dropout_p = 0.0f;
  o.seqused_k.clear();
  run(lens_q, lens_k, o, 22);
}

TEST_P(VarlenBackward, HalfPrecision) {
  Options o;
  o.causal = MHA_CAUSAL_TOP_LEFT;
  o.dtype = MHA_DTYPE_BF16;
  o.grad_dtype = MHA_DTYPE_BF16;
  run({100, 1, 30, 17}, {100, 1, 30, 17}, o, 31);
  o.dtype = MHA_DTYPE_F16;
  o.grad_dtype = MHA_DTYPE_F32;
  o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  run({1, 2, 50}, {300, 40, 50}, o, 32);
  // dout in q's dtype under an F32 out (mha.h: dout F32 or q's dtype,
  // whatever out's), as mha_attention_backward takes it.
  o.dtype = MHA_DTYPE_BF16;
  o.out_f32 = true;
  run({20, 0, 7}, {20, 5, 30}, o, 33);
}

TEST_P(VarlenBackward, SameBitsForAnyThreadCount) {
  const std::vector<int32_t> lens_q = {1200, 50, 1, 50, 300, 7};
  const std::vector<int32_t> lens_k = {1200, 50, 2000, 50, 300, 7};
  Options o;
  o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  o.sinks = true;
  o.D = o.Dv = 64;
  std::vector<unsigned char> first_dq, first_dk, first_dv;
  std::vector<float> first_dsinks;
  for (const int32_t threads : {1, 2, 3, 7}) {
    ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
    Batch p(lens_q, lens_k, o, 51);
    ASSERT_EQ(p.forward(), MHA_OK) << mha_last_error();
    ASSERT_EQ(p.run(), MHA_OK) << mha_last_error();
    std::vector<float> dsinks(static_cast<size_t>(o.H));
    for (int64_t h = 0; h < o.H; ++h) dsinks[static_cast<size_t>(h)] = p.dsinks_at(h);
    if (first_dq.empty()) {
      first_dq = p.dq.snapshot();
      first_dk = p.dk.snapshot();
      first_dv = p.dv.snapshot();
      first_dsinks = dsinks;
      continue;
    }
    EXPECT_TRUE(p.dq.same_as(first_dq)) << threads << " threads: dq differs from 1";
    EXPECT_TRUE(p.dk.same_as(first_dk)) << threads << " threads: dk differs from 1";
    EXPECT_TRUE(p.dv.same_as(first_dv)) << threads << " threads: dv differs from 1";
    EXPECT_EQ(std::memcmp(dsinks.data(), first_dsinks.data(), dsinks.size() * 4), 0)
        << threads << " threads: dsinks differ from 1";
  }
}

// Each bad argument is refused with a message naming it, and nothing is
// written.
TEST_P(VarlenBackward, BadInputIsRefusedByName) {
  const std::vector<int32_t> lens = {3, 5, 2};
  Options o;
  o.sinks = true;
  struct Bad {
    const char* what;
    const char* named;
    std::function<void(Batch&)> spoil;
  };
  static mha_tensor wrong;  // outlives each call
  static std::vector<float> wrong_floats;
  static std::vector<int32_t> wrong_ints;
  const std::vector<Bad> bad = {
      {"varlen's struct size", "varlen", [](Batch& p) { p.varlen.struct_size = 0; }},
      {"cu_seqlens_k NULL", "cu_seqlens_k", [](Batch& p) { p.varlen.cu_seqlens_k = nullptr; }},
      {"a paged cache", "block_table",
       [](Batch& p) {
         wrong_ints.assign(3, 0);
         wrong = describe(wrong_ints.data(), MHA_DTYPE_I32, {3, 1});
         p.varlen.block_table = &wrong;
       }},
      {"lse [B, H, L]", "lse",
       [](Batch& p) {
         wrong_floats.assign(40, 0.0f);
         wrong = describe(wrong_floats.data(), MHA_DTYPE_F32, {1, 4, 10});
         p.lse = wrong;
       }},
      {"dq of k's shape", "dq",
       [](Batch& p) {
         p.dq.t = describe(p.dq.t.data, MHA_DTYPE_F32, {10, 2, 32});
       }},
      {"dk as f16 for f32 k", "dk", [](Batch& p) { p.dk.t.dtype = MHA_DTYPE_F16; }},
      {"dout of one row fewer", "dout",
       [](Batch& p) {
         p.dout.t = describe(p.dout.t.data, MHA_DTYPE_F32, {9, 4, 24});
       }},
      {"dv overlapping v", "dv", [](Batch& p) { p.dv.t.data = p.v.t.data; }},
      {"dq overlapping dk", "dq",
       [](Batch& p) {
         p.dq.t = describe(p.dk.t.data, MHA_DTYPE_F32, {10, 4, 32});
       }},
      {"dsinks without sinks", "dsinks", [](Batch& p) { p.params.sinks = nullptr; }},
      {"dmask", "dmask", [](Batch& p) { p.backward.dmask = &p.dsinks; }},
      {"valid_lens", "valid_lens", [](Batch& p) { p.params.valid_lens = &p.cu_q; }},
      {"backward's struct size", "backward", [](Batch& p) { p.backward.struct_size = 3; }},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    Batch p(lens, lens, o, 71);
    ASSERT_EQ(p.forward(), MHA_OK) << mha_last_error();
    const auto dq = p.dq.snapshot(), dk = p.dk.snapshot(), dv = p.dv.snapshot();
    b.spoil(p);
    EXPECT_NE(p.run(), MHA_OK);
    EXPECT_NE(std::string(mha_last_error()).find(b.named), std::string::npos) << mha_last_error();
    EXPECT_TRUE(p.dq.same_as(dq) && p.dk.same_as(dk) && p.dv.same_as(dv))
        << "written although refused";
    EXPECT_TRUE(std::isnan(p.dsinks_at(0))) << "dsinks written although refused";
  }
  // int8 K and V (their scales given): no backward pass.
  {
    Batch p(lens, lens, o, 72);
    std::vector<int8_t> k8(static_cast<size_t>(10 * 2 * 32)), v8(static_cast<size_t>(10 * 2 * 24));
    std::vector<float> scales(20, 0.01f);
    mha_tensor tk = describe(k8.data(), MHA_DTYPE_I8, {10, 2, 32});
    mha_tensor tv = describe(v8.data(), MHA_DTYPE_I8, {10, 2, 24});
    mha_tensor ts = describe(scales.data(), MHA_DTYPE_F32, {10, 2});
    p.params.k_scale = &ts;
    p.params.v_scale = &ts;
    EXPECT_EQ(mha_attention_varlen_backward(&p.q.t, &tk, &tv, &p.out.t, &p.lse, &p.dout.t, &p.dq.t,
                                            &p.dk.t, &p.dv.t, &p.varlen, &p.params, &p.backward),
              MHA_ERR_UNSUPPORTED);
    EXPECT_NE(std::string(mha_last_error()).find("I8"), std::string::npos) << mha_last_error();
  }
  Batch p(lens, lens, o, 73);
  EXPECT_EQ(
      mha_attention_varlen_backward(&p.q.t, &p.k.t, &p.v.t, &p.out.t, &p.lse, &p.dout.t, &p.dq.t,
                                    &p.dk.t, &p.dv.t, nullptr, &p.params, &p.backward),
      MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("varlen"), std::string::npos);
  EXPECT_EQ(
      mha_attention_varlen_backward(&p.q.t, &p.k.t, &p.v.t, &p.out.t, nullptr, &p.dout.t, &p.dq.t,
                                    &p.dk.t, &p.dv.t, &p.varlen, &p.params, &p.backward),
      MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("lse"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, VarlenBackward, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

}  // namespace
}  // namespace mha_test
