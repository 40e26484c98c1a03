// A paged KV cache (mha_attention_varlen with block_table and seqused_k, the
// layout of vLLM and FlashAttention-2) on every backend: each sequence
// against the float64 reference on its keys gathered into a dense tensor, and
// bit for bit against mha_attention on that dense copy.  Blocks in shuffled
// order, a prefix shared by two sequences, partial last blocks, block sizes
// 8, 16, 24 (not a power of two) and 256; unused blocks hold NaN and the
// table's unused entries garbage, so a kernel that reads either is caught;
// decoding (with split-KV over 3000 keys) and chunked prefill; every KV dtype;
// the same bits for 1, 2, 3 and 7 threads; bad input refused by name with
// nothing written.  Buffers (the table included) are sized exactly, so ASan
// sees a read past their ends.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend_param.h"
#include "packed_outputs.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

constexpr float kSentinel = PackedOutputs::kSentinel;

uint32_t bits(float x) {
  return float_bits(x);
}

struct Options {
  int64_t H = 8, Hkv = 2, D = 64, Dv = 64, block = 16;
  int32_t causal = MHA_CAUSAL_NONE;
  int32_t kv_dtype = MHA_DTYPE_F32;
  int32_t q_dtype = MHA_DTYPE_F32;
  int64_t window_left = -1;
  float softcap = 0.0f;
  bool sinks = false, alibi = false;
  int64_t shared_blocks = 2;  // sequence 1 starts with sequence 0's first blocks
  int64_t spare_blocks = 3;   // blocks no sequence uses, full of NaN
};

int64_t element_bytes(int32_t dtype) {
  return dtype == MHA_DTYPE_I8 ? 1 : dtype == MHA_DTYPE_F32 ? 4 : 2;
}

// A batch over a paged cache: q [total_q, H, D], caches [num_blocks, block,
// Hkv, D / Dv] of kv_dtype (int8: scales [num_blocks, block, Hkv]), the
// table [B, max_blocks] and seqused_k [B], out f32 [total_q, H, Dv], lse
// [H, total_q].
class PagedBatch {
 public:
  PagedBatch(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k,
             const Options& o, uint64_t seed)
      : used_(lens_k), o_(o), batch_(static_cast<int64_t>(lens_q.size())) {
    Rng rng(seed);
    cu_q_.push_back(0);
    for (const int32_t l : lens_q) cu_q_.push_back(cu_q_.back() + l);
    total_q_ = cu_q_.back();
    // Blocks: each sequence's own, less the prefix sequence 1 shares with 0.
    std::vector<int64_t> need(static_cast<size_t>(batch_));
    int64_t max_blocks = 1, total = o.spare_blocks;
    for (int64_t b = 0; b < batch_; ++b) {
      need[static_cast<size_t>(b)] = (lens_k[static_cast<size_t>(b)] + o.block - 1) / o.block;
      max_blocks = std::max(max_blocks, need[static_cast<size_t>(b)] + 1);  // one unused column
      total += need[static_cast<size_t>(b)];
    }
    shared_ = 0;
    if (batch_ > 1) {
      shared_ = std::min({o.shared_blocks, need[0], need[1]});
      // Only whole blocks are shared (sequence 0's last may be partial).
      if (shared_ == need[0] && lens_k[0] % o.block != 0) --shared_;
      total -= std::max<int64_t>(shared_, 0);
    }
    num_blocks_ = std::max<int64_t>(total, 1);
    std::vector<int32_t> order(static_cast<size_t>(num_blocks_));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    table_.resize(static_cast<size_t>(batch_ * max_blocks));
    size_t next = 0;
    for (int64_t b = 0; b < batch_; ++b) {
      for (int64_t n = 0; n < max_blocks; ++n) {
        int32_t& entry = table_[static_cast<size_t>(b * max_blocks + n)];
        if (n >= need[static_cast<size_t>(b)]) {  // never read: garbage
          entry = b % 2 == 0 ? -1 : std::numeric_limits<int32_t>::max();
        } else if (b == 1 && n < shared_) {
          entry = table_[static_cast<size_t>(n)];
        } else {
          entry = order[next++];
        }
      }
    }
    const std::vector<int32_t> spare(order.begin() + static_cast<std::ptrdiff_t>(next),
                                     order.end());
    max_blocks_ = max_blocks;

    const int64_t rows = num_blocks_ * o.block;
    k_bytes_.resize(static_cast<size_t>(rows * o.Hkv * o.D * element_bytes(o.kv_dtype)));
    v_bytes_.resize(static_cast<size_t>(rows * o.Hkv * o.Dv * element_bytes(o.kv_dtype)));
    fill_cache(k_bytes_, rng);
    fill_cache(v_bytes_, rng);
    if (o.kv_dtype == MHA_DTYPE_I8) {
      k_scales_.resize(static_cast<size_t>(rows * o.Hkv));
      v_scales_.resize(k_scales_.size());
      for (float& s : k_scales_) s = rng.uniform(0.002f, 0.02f);
      for (float& s : v_scales_) s = rng.uniform(0.002f, 0.02f);
    }
    for (const int32_t blk : spare) poison(blk);

    std::vector<float> q(static_cast<size_t>(total_q_ * o.H * o.D));
    for (float& x : q) x = rng.uniform();
    q_f32_ = q;
    tq_f32_ = describe(q_f32_.data(), MHA_DTYPE_F32, {total_q_, o.H, o.D});
    q_typed_ = std::make_unique<TypedCopy>(tq_f32_, o.q_dtype);
    slopes_.resize(static_cast<size_t>(batch_ * o.H));
    for (float& s : slopes_) s = rng.uniform(0.0f, 0.3f);
    sinks_.resize(static_cast<size_t>(o.H));
    for (float& s : sinks_) s = rng.uniform(-1.0f, 3.0f);

    const auto kv = static_cast<mha_dtype>(o.kv_dtype);
    k = describe(k_bytes_.data(), kv, {num_blocks_, o.block, o.Hkv, o.D});
    v = describe(v_bytes_.data(), kv, {num_blocks_, o.block, o.Hkv, o.Dv});
    outputs_ = std::make_unique<PackedOutputs>(total_q_, o.H, o.Dv);
    out = outputs_->out;
    lse = outputs_->lse;
    cu_q = describe(cu_q_.data(), MHA_DTYPE_I32, {batch_ + 1});
    seqused = describe(used_.data(), MHA_DTYPE_I32, {batch_});
    table = describe(table_.data(), MHA_DTYPE_I32, {batch_, max_blocks});
    slopes = describe(slopes_.data(), MHA_DTYPE_F32, {batch_, o.H});
    sinks = describe(sinks_.data(), MHA_DTYPE_F32, {o.H});
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &cu_q;
    varlen.seqused_k = &seqused;
    varlen.block_table = &table;
    mha_attention_params_init(&params);
    params.causal = o.causal;
    params.window_left = o.window_left;
    params.softcap = o.softcap;
    params.lse = &lse;
    if (o.alibi) params.alibi_slopes = &slopes;
    if (o.sinks) params.sinks = &sinks;
    if (o.kv_dtype == MHA_DTYPE_I8) {
      k_scale = describe(k_scales_.data(), MHA_DTYPE_F32, {num_blocks_, o.block, o.Hkv});
      v_scale = describe(v_scales_.data(), MHA_DTYPE_F32, {num_blocks_, o.block, o.Hkv});
      params.k_scale = &k_scale;
      params.v_scale = &v_scale;
    }
  }
  PagedBatch(const PagedBatch&) = delete;  // params points into this object
  PagedBatch& operator=(const PagedBatch&) = delete;

  mha_tensor& q() { return q_typed_->get(); }
  mha_status run() { return mha_attention_varlen(&q(), &k, &v, &out, &varlen, &params); }

  int64_t batch() const { return batch_; }
  int64_t shared() const { return shared_; }
  int64_t q_begin(int64_t b) const { return cu_q_[static_cast<size_t>(b)]; }
  int64_t q_len(int64_t b) const { return cu_q_[static_cast<size_t>(b + 1)] - q_begin(b); }
  int64_t k_len(int64_t b) const { return used_[static_cast<size_t>(b)]; }
  float out_at(int64_t row, int64_t h, int64_t x) const { return outputs_->out_at(row, h, x); }
  float lse_at(int64_t h, int64_t row) const { return outputs_->lse_at(h, row); }
  bool untouched() const { return outputs_->untouched(); }
  std::vector<float> results() const { return outputs_->results(); }

  // Sequence b's keys gathered from the pages through the table: dense
  // [1, Hkv, lk, D] copies of K and V (and of the int8 scales), in the
  // cache's dtype.
  struct Dense {
    std::vector<unsigned char> k_bytes, v_bytes;
    std::vector<float> k_scales, v_scales;
    mha_tensor k{}, v{}, k_scale{}, v_scale{};
  };
  std::unique_ptr<Dense> gather(int64_t b) const {
    auto d = std::make_unique<Dense>();
    const int64_t lk = k_len(b), es = element_bytes(o_.kv_dtype);
    const int64_t k_row = o_.Hkv * o_.D * es, v_row = o_.Hkv * o_.Dv * es;
    d->k_bytes.resize(static_cast<size_t>(lk * k_row));
    d->v_bytes.resize(static_cast<size_t>(lk * v_row));
    const bool int8 = o_.kv_dtype == MHA_DTYPE_I8;
    if (int8) {
      d->k_scales.resize(static_cast<size_t>(lk * o_.Hkv));
      d->v_scales.resize(d->k_scales.size());
    }
    for (int64_t j = 0; j < lk; ++j) {
      const int64_t slot =
          table_[static_cast<size_t>(b * max_blocks_ + j / o_.block)] * o_.block + j % o_.block;
      std::memcpy(d->k_bytes.data() + j * k_row, k_bytes_.data() + slot * k_row,
                  static_cast<size_t>(k_row));
      std::memcpy(d->v_bytes.data() + j * v_row, v_bytes_.data() + slot * v_row,
                  static_cast<size_t>(v_row));
      for (int64_t h = 0; h < o_.Hkv && int8; ++h) {
        d->k_scales[static_cast<size_t>(j * o_.Hkv + h)] =
            k_scales_[static_cast<size_t>(slot * o_.Hkv + h)];
        d->v_scales[static_cast<size_t>(j * o_.Hkv + h)] =
            v_scales_[static_cast<size_t>(slot * o_.Hkv + h)];
      }
    }
    const auto kv = static_cast<mha_dtype>(o_.kv_dtype);
    d->k = describe(d->k_bytes.data(), kv, {1, o_.Hkv, lk, o_.D}, {0, o_.D, o_.Hkv * o_.D, 1});
    d->v = describe(d->v_bytes.data(), kv, {1, o_.Hkv, lk, o_.Dv}, {0, o_.Dv, o_.Hkv * o_.Dv, 1});
    if (int8) {
      d->k_scale = describe(d->k_scales.data(), MHA_DTYPE_F32, {1, o_.Hkv, lk}, {0, 1, o_.Hkv});
      d->v_scale = describe(d->v_scales.data(), MHA_DTYPE_F32, {1, o_.Hkv, lk}, {0, 1, o_.Hkv});
    }
    return d;
  }

  // Sequence b's queries as [1, H, lq, D].
  mha_tensor q_of(int64_t b) {
    const mha_tensor& t = q();
    return describe(static_cast<char*>(t.data) + q_begin(b) * t.strides[0] * element_bytes(t.dtype),
                    static_cast<mha_dtype>(t.dtype), {1, o_.H, q_len(b), o_.D},
                    {0, t.strides[1], t.strides[0], t.strides[2]});
  }
  // mha_attention's params for sequence b over its dense keys.
  mha_attention_params params_of(int64_t b, const Dense& d, mha_tensor* slope_row) const {
    mha_attention_params p = params;
    p.lse = nullptr;
    p.dropout_seed = params.dropout_seed + static_cast<uint64_t>(b);
    if (params.alibi_slopes != nullptr) {
      *slope_row = describe(const_cast<float*>(slopes_.data()) + b * o_.H, MHA_DTYPE_F32, {o_.H});
      p.alibi_slopes = slope_row;
    }
    p.k_scale = o_.kv_dtype == MHA_DTYPE_I8 ? &d.k_scale : nullptr;
    p.v_scale = o_.kv_dtype == MHA_DTYPE_I8 ? &d.v_scale : nullptr;
    return p;
  }

  mha_tensor k{}, v{}, out{}, lse{}, cu_q{}, seqused{}, table{}, slopes{}, sinks{}, k_scale{},
      v_scale{};
  mha_varlen_params varlen{};
  mha_attention_params params{};
  std::vector<int32_t> cu_q_, used_, table_;

 private:
  // Random values in the cache's dtype.
  void fill_cache(std::vector<unsigned char>& bytes, Rng& rng) const {
    const int64_t es = element_bytes(o_.kv_dtype);
    for (size_t at = 0; at < bytes.size(); at += static_cast<size_t>(es)) {
      const float x = rng.uniform();
      if (o_.kv_dtype == MHA_DTYPE_F32) {
        std::memcpy(&bytes[at], &x, 4);
      } else if (o_.kv_dtype == MHA_DTYPE_I8) {
        bytes[at] = static_cast<unsigned char>(static_cast<int8_t>(rng.integer(-127, 127)));
      } else {
        const uint16_t h =
            o_.kv_dtype == MHA_DTYPE_BF16 ? round_to_bf16_bits(x) : round_to_f16_bits(x);
        std::memcpy(&bytes[at], &h, 2);
      }
    }
  }
  // A block no sequence uses: NaN everywhere (int8: NaN scales).
  void poison(int32_t blk) {
    const int64_t es = element_bytes(o_.kv_dtype);
    const auto fill = [&](std::vector<unsigned char>& bytes, int64_t d) {
      const int64_t row = o_.Hkv * d * es;
      unsigned char* first = bytes.data() + blk * o_.block * row;
      for (int64_t at = 0; at < o_.block * row; at += es) {
        if (o_.kv_dtype == MHA_DTYPE_F32) {
          const float nan = std::numeric_limits<float>::quiet_NaN();
          std::memcpy(first + at, &nan, 4);
        } else if (o_.kv_dtype != MHA_DTYPE_I8) {
          const uint16_t nan = o_.kv_dtype == MHA_DTYPE_BF16 ? 0x7FC0 : 0x7E00;
          std::memcpy(first + at, &nan, 2);
        }
      }
    };
    fill(k_bytes_, o_.D);
    fill(v_bytes_, o_.Dv);
    if (o_.kv_dtype == MHA_DTYPE_I8) {
      for (int64_t at = blk * o_.block * o_.Hkv; at < (blk + 1) * o_.block * o_.Hkv; ++at) {
        k_scales_[static_cast<size_t>(at)] = std::numeric_limits<float>::quiet_NaN();
        v_scales_[static_cast<size_t>(at)] = std::numeric_limits<float>::quiet_NaN();
      }
    }
  }

  Options o_;
  int64_t batch_, total_q_ = 0, num_blocks_ = 0, max_blocks_ = 0, shared_ = 0;
  std::vector<unsigned char> k_bytes_, v_bytes_;
  std::vector<float> k_scales_, v_scales_, q_f32_, slopes_, sinks_;
  std::unique_ptr<PackedOutputs> outputs_;
  mha_tensor tq_f32_{};
  std::unique_ptr<TypedCopy> q_typed_;
};

// Every sequence against the reference on its gathered keys, and bit for bit
// against mha_attention on them (output and LSE).
void check(PagedBatch& p, const Options& o) {
  const char* backend = mha_selected_backend();
  ASSERT_NE(backend, nullptr) << mha_last_error();
  for (int64_t b = 0; b < p.batch(); ++b) {
    const int64_t lq = p.q_len(b), lk = p.k_len(b), q0 = p.q_begin(b);
    SCOPED_TRACE("sequence " + std::to_string(b) + " (Lq " + std::to_string(lq) + ", Lk " +
                 std::to_string(lk) + ")");
    if (lq == 0) continue;
    if (lk == 0) {
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t h = 0; h < o.H; ++h) {
          for (int64_t x = 0; x < o.Dv; ++x) ASSERT_EQ(p.out_at(q0 + i, h, x), 0.0f);
          const float want = o.sinks ? static_cast<const float*>(p.sinks.data)[h] : -INFINITY;
          ASSERT_EQ(p.lse_at(h, q0 + i), want);
        }
      }
      continue;
    }
    const auto dense = p.gather(b);
    mha_tensor slope_row{};
    mha_attention_params alone = p.params_of(b, *dense, &slope_row);
    const mha_tensor qv = p.q_of(b);
    const Reference ref = reference_attention(qv, dense->k, dense->v, &alone);
    const mha_tensor ov = describe(static_cast<float*>(p.out.data) + q0 * o.H * o.Dv, MHA_DTYPE_F32,
                                   {1, o.H, lq, o.Dv}, {0, o.Dv, o.H * o.Dv, 1});
    EXPECT_LE(max_abs_error(ov, ref),
              tolerance_for(backend, o.q_dtype, o.kv_dtype, ref, MHA_DTYPE_F32));

    std::vector<float> out(static_cast<size_t>(lq * o.H * o.Dv)),
        lse(static_cast<size_t>(o.H * lq));
    mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, o.H, lq, o.Dv});
    mha_tensor tlse = describe(lse.data(), MHA_DTYPE_F32, {1, o.H, lq});
    alone.lse = &tlse;
    ASSERT_EQ(mha_attention(&qv, &dense->k, &dense->v, &tout, &alone), MHA_OK) << mha_last_error();
    int64_t differ = 0;
    for (int64_t h = 0; h < o.H; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t x = 0; x < o.Dv; ++x) {
          differ += bits(out[static_cast<size_t>((h * lq + i) * o.Dv + x)]) !=
                            bits(p.out_at(q0 + i, h, x))
                        ? 1
                        : 0;
        }
        differ += bits(lse[static_cast<size_t>(h * lq + i)]) != bits(p.lse_at(h, q0 + i)) ? 1 : 0;
      }
    }
    EXPECT_EQ(differ, 0) << "values differ from mha_attention on the same keys, dense";
  }
}

void run(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k, const Options& o,
         uint64_t seed) {
  PagedBatch p(lens_q, lens_k, o, seed);
  ASSERT_EQ(p.run(), MHA_OK) << mha_last_error();
  check(p, o);
}

class Paged : public BackendTest {};

// One query per sequence over pages: lengths 0, 1, a block +-1, a decode
// tile (1024) +-1 and 3000 (split over the threads' chunks); block sizes 8,
// 16, 24 (not a power of two) and 256; head sizes read in place (64) and
// widened (40).
TEST_P(Paged, Decode) {
  const std::vector<int32_t> lens_k = {33, 0, 1, 7, 8, 15, 16, 17, 100, 1023, 1024, 1025, 3000};
  const std::vector<int32_t> lens_q(lens_k.size(), 1);
  for (const int64_t block : {8, 16, 24, 256}) {
    SCOPED_TRACE("block " + std::to_string(block));
    Options o;
    o.block = block;
    run(lens_q, lens_k, o, 100 + static_cast<uint64_t>(block));
  }
  Options o;
  o.D = o.Dv = 40;
  o.H = 4;
  o.Hkv = 4;
  run(lens_q, lens_k, o, 140);
}

// Chunked prefill: a few new queries at the end of each cache (bottom-right
// causal), with the variants per sequence.
TEST_P(Paged, ChunkedPrefill) {
  const std::vector<int32_t> lens_q = {5, 64, 1, 130, 0, 97};
  const std::vector<int32_t> lens_k = {40, 300, 17, 130, 9, 700};
  Options o;
  o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  for (const int64_t block : {16, 24}) {
    SCOPED_TRACE("block " + std::to_string(block));
    o.block = block;
    run(lens_q, lens_k, o, 200 + static_cast<uint64_t>(block));
  }
  o.D = 40;
  o.Dv = 24;
  o.window_left = 50;
  o.softcap = 4.0f;
  o.sinks = true;
  o.alibi = true;
  run(lens_q, lens_k, o, 250);
}

TEST_P(Paged, EveryKvDtype) {
  for (const int32_t dtype : {MHA_DTYPE_BF16, MHA_DTYPE_F16, MHA_DTYPE_I8}) {
    SCOPED_TRACE(std::string("kv dtype ") + std::to_string(dtype));
    Options o;
    o.kv_dtype = dtype;
    run({1, 1, 1, 1}, {1500, 16, 33, 0}, o, 300 + static_cast<uint64_t>(dtype));
    o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    if (dtype != MHA_DTYPE_I8) o.q_dtype = dtype;
    o.block = 32;
    run({70, 3, 20}, {300, 40, 20}, o, 310 + static_cast<uint64_t>(dtype));
  }
}

TEST_P(Paged, SameBitsForAnyThreadCount) {
  const std::vector<int32_t> lens_q = {1, 1, 200, 1, 30};
  const std::vector<int32_t> lens_k = {4000, 50, 900, 1000, 30};
  Options o;
  o.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  std::vector<float> first;
  for (const int32_t threads : {1, 2, 3, 7}) {
    ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
    PagedBatch p(lens_q, lens_k, o, 400);
    ASSERT_EQ(p.run(), MHA_OK) << mha_last_error();
    if (first.empty()) {
      first = p.results();
      continue;
    }
    const std::vector<float> now = p.results();
    int64_t differ = 0;
    for (size_t i = 0; i < now.size(); ++i) differ += bits(now[i]) != bits(first[i]) ? 1 : 0;
    EXPECT_EQ(differ, 0) << threads << " threads differ from 1";
  }
}

// seqused_k with packed keys: only the first seqused_k[b] of a sequence's
// rows take part (FlashAttention-2's seqused_k).
TEST_P(Paged, SequsedKWithPackedKeys) {
  const int64_t H = 4, D = 32;
  const std::vector<int32_t> cu_q_v = {0, 1, 4, 6}, cu_k_v = {0, 100, 130, 170};
  std::vector<int32_t> used_v = {60, 30, 0};
  Rng rng(500);
  std::vector<float> q(6 * H * D), k(170 * H * D), v(170 * H * D), out(6 * H * D, kSentinel);
  for (float& x : q) x = rng.uniform();
  for (float& x : k) x = rng.uniform();
  for (float& x : v) x = rng.uniform();
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {6, H, D});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {170, H, D});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {170, H, D});
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {6, H, D});
  std::vector<int32_t> cu_q_c = cu_q_v, cu_k_c = cu_k_v;
  mha_tensor cu_q = describe(cu_q_c.data(), MHA_DTYPE_I32, {4});
  mha_tensor cu_k = describe(cu_k_c.data(), MHA_DTYPE_I32, {4});
  mha_tensor used = describe(used_v.data(), MHA_DTYPE_I32, {3});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &cu_q;
  varlen.cu_seqlens_k = &cu_k;
  varlen.seqused_k = &used;
  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  ASSERT_EQ(mha_attention_varlen(&tq, &tk, &tv, &tout, &varlen, &params), MHA_OK)
      << mha_last_error();
  const char* backend = mha_selected_backend();
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t q0 = cu_q_v[static_cast<size_t>(b)], k0 = cu_k_v[static_cast<size_t>(b)];
    const int64_t lq = cu_q_v[static_cast<size_t>(b + 1)] - q0, lk = used_v[static_cast<size_t>(b)];
    const mha_tensor ov =
        describe(out.data() + q0 * H * D, MHA_DTYPE_F32, {1, H, lq, D}, {0, D, H * D, 1});
    if (lk == 0) {
      for (int64_t x = 0; x < lq * H * D; ++x)
        EXPECT_EQ(out[static_cast<size_t>(q0 * H * D + x)], 0.0f);
      continue;
    }
    const mha_tensor qv =
        describe(q.data() + q0 * H * D, MHA_DTYPE_F32, {1, H, lq, D}, {0, D, H * D, 1});
    const mha_tensor kv =
        describe(k.data() + k0 * H * D, MHA_DTYPE_F32, {1, H, lk, D}, {0, D, H * D, 1});
    const mha_tensor vv =
        describe(v.data() + k0 * H * D, MHA_DTYPE_F32, {1, H, lk, D}, {0, D, H * D, 1});
    const Reference ref = reference_attention(qv, kv, vv, &params);
    EXPECT_LE(max_abs_error(ov, ref),
              tolerance_for(backend, MHA_DTYPE_F32, MHA_DTYPE_F32, ref, MHA_DTYPE_F32))
        << "sequence " << b;
  }
  used_v[1] = 31;  // beyond the sequence's 30 rows
  EXPECT_EQ(mha_attention_varlen(&tq, &tk, &tv, &tout, &varlen, &params), MHA_ERR_INVALID_VALUE);
  EXPECT_NE(std::string(mha_last_error()).find("seqused_k[1]"), std::string::npos)
      << mha_last_error();
}

// Each bad argument is refused with a message naming it, and nothing is
// written.
TEST_P(Paged, BadInputIsRefusedByName) {
  struct Bad {
    const char* what;
    const char* named;
    std::function<void(PagedBatch&)> spoil;
  };
  static mha_tensor wrong;  // outlives each call
  static std::vector<int32_t> wrong_values;
  const std::vector<Bad> bad = {
      {"block id past the cache", "block_table[2][0]",
       [](PagedBatch& p) { p.table_[2 * p.table.shape[1]] = static_cast<int32_t>(p.k.shape[0]); }},
      {"negative block id", "block_table[0][1]", [](PagedBatch& p) { p.table_[1] = -3; }},
      {"seqused_k past the table", "seqused_k[0]",
       [](PagedBatch& p) {
         p.used_[0] = static_cast<int32_t>(p.table.shape[1] * p.k.shape[1] + 1);
       }},
      {"negative seqused_k", "seqused_k[2]", [](PagedBatch& p) { p.used_[2] = -1; }},
      {"seqused_k missing", "seqused_k", [](PagedBatch& p) { p.varlen.seqused_k = nullptr; }},
      {"cu_seqlens_k with a table", "cu_seqlens_k",
       [](PagedBatch& p) { p.varlen.cu_seqlens_k = &p.cu_q; }},
      {"block size not a multiple of 8", "block_size",
       [](PagedBatch& p) { p.k.shape[1] = p.v.shape[1] = 12; }},
      {"k and v blocks disagree", "num_blocks", [](PagedBatch& p) { p.v.shape[0] -= 1; }},
      {"k not 4-D", "k", [](PagedBatch& p) { p.k.ndim = 3; }},
      {"table of i64", "block_table",
       [](PagedBatch& p) {
         wrong_values.assign(64, 0);
         wrong = describe(wrong_values.data(), MHA_DTYPE_I64, {p.batch(), 4});
         p.varlen.block_table = &wrong;
       }},
      {"table rows for another B", "block_table",
       [](PagedBatch& p) {
         wrong_values.assign(64, 0);
         wrong = describe(wrong_values.data(), MHA_DTYPE_I32, {p.batch() + 1, 4});
         p.varlen.block_table = &wrong;
       }},
      {"table not contiguous along its rows", "block_table",
       [](PagedBatch& p) {
         wrong = p.table;
         wrong.shape[1] = p.table.shape[1] / 2;
         wrong.strides[1] = 2;
         p.varlen.block_table = &wrong;
       }},
      {"seqused_k of the wrong length", "seqused_k",
       [](PagedBatch& p) {
         wrong_values.assign(64, 1);
         wrong = describe(wrong_values.data(), MHA_DTYPE_I32, {p.batch() + 2});
         p.varlen.seqused_k = &wrong;
       }},
      {"int8 scales of the packed layout", "k_scale", [](PagedBatch& p) { p.k_scale.ndim = 2; }},
      {"output inside the K cache", "out", [](PagedBatch& p) { p.out.data = p.k.data; }},
  };
  for (const Bad& c : bad) {
    SCOPED_TRACE(c.what);
    Options o;
    if (std::string(c.named) == "k_scale") o.kv_dtype = MHA_DTYPE_I8;
    PagedBatch p({1, 1, 1}, {40, 20, 35}, o, 600);
    c.spoil(p);
    EXPECT_NE(p.run(), MHA_OK) << "accepted";
    EXPECT_NE(std::string(mha_last_error()).find(c.named), std::string::npos) << mha_last_error();
    EXPECT_TRUE(p.untouched()) << "a refused call wrote its output";
  }
}

// ------------------------------------------------------ mha_kv_cache_write

// A cache [num_blocks, block, Hkv, D] of one dtype filled with a marker, and
// T tokens' K and V rows (F32) to write through a slot mapping.
struct CacheWrite {
  int64_t T = 21, Hkv = 2, D = 24, Dv = 16, blocks = 5, block = 8;
  int32_t dtype = MHA_DTYPE_F32;
  std::vector<float> key, value;
  std::vector<unsigned char> k_cache, v_cache;
  std::vector<float> k_scales, v_scales;
  std::vector<int64_t> slots;
  mha_tensor tkey{}, tvalue{}, tk_cache{}, tv_cache{}, tslots{}, tk_scales{}, tv_scales{};
  mha_tensor* k_scale_arg = nullptr;  // what write() passes: the scales with an i8 cache
  mha_tensor* v_scale_arg = nullptr;

  explicit CacheWrite(int32_t cache_dtype, uint64_t seed) : dtype(cache_dtype) {
    Rng rng(seed);
    key.resize(static_cast<size_t>(T * Hkv * D));
    value.resize(static_cast<size_t>(T * Hkv * Dv));
    for (float& x : key) x = rng.uniform(-3.0f, 3.0f);
    for (float& x : value) x = rng.uniform(-3.0f, 3.0f);
    // Slots: a shuffled subset of the cache's, every fourth token skipped (-1).
    std::vector<int64_t> all(static_cast<size_t>(blocks * block));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), std::mt19937_64(seed));
    for (int64_t t = 0; t < T; ++t) slots.push_back(t % 4 == 3 ? -1 : all[static_cast<size_t>(t)]);
    const int64_t es = element_bytes(dtype);
    k_cache.assign(static_cast<size_t>(blocks * block * Hkv * D * es), 0xA5);
    v_cache.assign(static_cast<size_t>(blocks * block * Hkv * Dv * es), 0xA5);
    k_scales.assign(static_cast<size_t>(blocks * block * Hkv), -1.0f);
    v_scales.assign(k_scales.size(), -1.0f);
    tkey = describe(key.data(), MHA_DTYPE_F32, {T, Hkv, D});
    tvalue = describe(value.data(), MHA_DTYPE_F32, {T, Hkv, Dv});
    const auto cd = static_cast<mha_dtype>(dtype);
    tk_cache = describe(k_cache.data(), cd, {blocks, block, Hkv, D});
    tv_cache = describe(v_cache.data(), cd, {blocks, block, Hkv, Dv});
    tslots = describe(slots.data(), MHA_DTYPE_I64, {T});
    tk_scales = describe(k_scales.data(), MHA_DTYPE_F32, {blocks, block, Hkv});
    tv_scales = describe(v_scales.data(), MHA_DTYPE_F32, {blocks, block, Hkv});
    if (dtype == MHA_DTYPE_I8) {
      k_scale_arg = &tk_scales;
      v_scale_arg = &tv_scales;
    }
  }
  CacheWrite(const CacheWrite&) = delete;
  CacheWrite& operator=(const CacheWrite&) = delete;

  mha_status write() {
    return mha_kv_cache_write(&tkey, &tvalue, &tk_cache, &tv_cache, &tslots, k_scale_arg,
                              v_scale_arg);
  }
  // Element e of row (slot, h) of a cache, as a double.
  double cached(const std::vector<unsigned char>& cache, const std::vector<float>& scales,
                int64_t d, int64_t slot, int64_t h, int64_t e) const {
    const int64_t at = (slot * Hkv + h) * d + e;
    switch (dtype) {
      case MHA_DTYPE_F32: {
        float x = 0;
        std::memcpy(&x, &cache[static_cast<size_t>(at * 4)], 4);
        return static_cast<double>(x);
      }
      case MHA_DTYPE_I8:
        return static_cast<double>(static_cast<int8_t>(cache[static_cast<size_t>(at)])) *
               static_cast<double>(scales[static_cast<size_t>(slot * Hkv + h)]);
      default: {
        uint16_t b = 0;
        std::memcpy(&b, &cache[static_cast<size_t>(at * 2)], 2);
        return half_bits_value(b, dtype);
      }
    }
  }
  // What the cache should hold for input x: x rounded to the cache's dtype
  // (int8: within half a step of the row's scale, checked separately).
  double stored(float x) const {
    if (dtype == MHA_DTYPE_BF16) return half_bits_value(round_to_bf16_bits(x), dtype);
    if (dtype == MHA_DTYPE_F16) return half_bits_value(round_to_f16_bits(x), dtype);
    return static_cast<double>(x);
  }
};

// Every written row holds its token's values in the cache's dtype (int8:
// scale = max|row| / 127, each value within half a step); untouched slots
// keep their bytes; then attention over the cache matches the reference on
// the tokens themselves.
TEST(KvCacheWrite, RowsLandInTheirSlots) {
  for (const int32_t dtype : {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16, MHA_DTYPE_I8}) {
    SCOPED_TRACE(std::string("cache dtype ") + std::to_string(dtype));
    CacheWrite w(dtype, 700 + static_cast<uint64_t>(dtype));
    const std::vector<unsigned char> k_before = w.k_cache;
    ASSERT_EQ(w.write(), MHA_OK) << mha_last_error();
    std::vector<bool> written(static_cast<size_t>(w.blocks * w.block), false);
    for (int64_t t = 0; t < w.T; ++t) {
      const int64_t slot = w.slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      written[static_cast<size_t>(slot)] = true;
      for (int64_t h = 0; h < w.Hkv; ++h) {
        const struct {
          const std::vector<float>& in;
          const std::vector<unsigned char>& cache;
          const std::vector<float>& scales;
          int64_t d;
        } parts[] = {{w.key, w.k_cache, w.k_scales, w.D}, {w.value, w.v_cache, w.v_scales, w.Dv}};
        for (const auto& part : parts) {
          float largest = 0.0f;
          for (int64_t e = 0; e < part.d; ++e) {
            largest = std::max(
                largest, std::fabs(part.in[static_cast<size_t>((t * w.Hkv + h) * part.d + e)]));
          }
          const float scale = part.scales[static_cast<size_t>(slot * w.Hkv + h)];
          if (dtype == MHA_DTYPE_I8) {
            ASSERT_FLOAT_EQ(scale, largest / 127.0f);
          }
          for (int64_t e = 0; e < part.d; ++e) {
            const float x = part.in[static_cast<size_t>((t * w.Hkv + h) * part.d + e)];
            const double got = w.cached(part.cache, part.scales, part.d, slot, h, e);
            if (dtype == MHA_DTYPE_I8) {
              ASSERT_LE(std::fabs(got - static_cast<double>(x)),
                        0.5 * static_cast<double>(scale) * (1 + 1e-6))
                  << "token " << t;
            } else {
              ASSERT_EQ(got, w.stored(x)) << "token " << t << " head " << h << " element " << e;
            }
          }
        }
      }
    }
    const int64_t row = w.Hkv * w.D * element_bytes(dtype);
    for (int64_t slot = 0; slot < w.blocks * w.block; ++slot) {
      if (written[static_cast<size_t>(slot)]) continue;
      ASSERT_EQ(std::memcmp(&w.k_cache[static_cast<size_t>(slot * row)],
                            &k_before[static_cast<size_t>(slot * row)], static_cast<size_t>(row)),
                0)
          << "slot " << slot << " was not in the mapping but changed";
    }
  }
}

// A decoding step as a server runs it: each sequence's new token written
// into its next slot, then attention over the pages, against the reference
// on the tokens themselves (in the cache's precision).
TEST(KvCacheWrite, ThenAttendOverThePages) {
  const int64_t H = 4, Hkv = 2, D = 32, block = 16, blocks = 15, max_blocks = 5;
  const std::vector<int32_t> lens = {37, 1, 80};  // tokens so far, the new one included
  Rng rng(800);
  std::vector<float> k_cache(static_cast<size_t>(blocks * block * Hkv * D), 0.0f);
  std::vector<float> v_cache(k_cache.size(), 0.0f);
  mha_tensor tk = describe(k_cache.data(), MHA_DTYPE_F32, {blocks, block, Hkv, D});
  mha_tensor tv = describe(v_cache.data(), MHA_DTYPE_F32, {blocks, block, Hkv, D});
  // Pages: sequence b owns blocks table[b][..] (interleaved, out of order).
  std::vector<int32_t> table = {14, 2, 7, 0, 4, 1, 9, 3, 5, 6, 8, 10, 13, 11, 12};  // [3, 5]
  std::vector<std::vector<float>> keys(3), values(3);
  // Every token of every sequence goes in through mha_kv_cache_write, one
  // call per step, as a server appends them.
  for (int32_t step = 0; step < 80; ++step) {
    std::vector<float> key, value;
    std::vector<int32_t> slots;
    for (int64_t b = 0; b < 3; ++b) {
      if (step >= lens[static_cast<size_t>(b)]) continue;
      for (int64_t x = 0; x < Hkv * D; ++x) {
        key.push_back(rng.uniform());
        value.push_back(rng.uniform());
      }
      keys[static_cast<size_t>(b)].insert(keys[static_cast<size_t>(b)].end(), key.end() - Hkv * D,
                                          key.end());
      values[static_cast<size_t>(b)].insert(values[static_cast<size_t>(b)].end(),
                                            value.end() - Hkv * D, value.end());
      slots.push_back(static_cast<int32_t>(
          table[static_cast<size_t>(b * max_blocks + step / block)] * block + step % block));
    }
    const int64_t n = static_cast<int64_t>(slots.size());
    mha_tensor tkey = describe(key.data(), MHA_DTYPE_F32, {n, Hkv, D});
    mha_tensor tvalue = describe(value.data(), MHA_DTYPE_F32, {n, Hkv, D});
    mha_tensor tslots = describe(slots.data(), MHA_DTYPE_I32, {n});
    ASSERT_EQ(mha_kv_cache_write(&tkey, &tvalue, &tk, &tv, &tslots, nullptr, nullptr), MHA_OK)
        << mha_last_error();
  }
  std::vector<float> q(static_cast<size_t>(3 * H * D)), out(q.size());
  for (float& x : q) x = rng.uniform();
  std::vector<int32_t> cu_q = {0, 1, 2, 3};
  std::vector<int32_t> used = lens;
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {3, H, D});
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {3, H, D});
  mha_tensor tcu = describe(cu_q.data(), MHA_DTYPE_I32, {4});
  mha_tensor tused = describe(used.data(), MHA_DTYPE_I32, {3});
  mha_tensor ttable = describe(table.data(), MHA_DTYPE_I32, {3, max_blocks});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &tcu;
  varlen.seqused_k = &tused;
  varlen.block_table = &ttable;
  ASSERT_EQ(mha_attention_varlen(&tq, &tk, &tv, &tout, &varlen, nullptr), MHA_OK)
      << mha_last_error();
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t lk = lens[static_cast<size_t>(b)];
    const mha_tensor qv =
        describe(q.data() + b * H * D, MHA_DTYPE_F32, {1, H, 1, D}, {0, D, H * D, 1});
    const mha_tensor kv = describe(keys[static_cast<size_t>(b)].data(), MHA_DTYPE_F32,
                                   {1, Hkv, lk, D}, {0, D, Hkv * D, 1});
    const mha_tensor vv = describe(values[static_cast<size_t>(b)].data(), MHA_DTYPE_F32,
                                   {1, Hkv, lk, D}, {0, D, Hkv * D, 1});
    const Reference ref = reference_attention(qv, kv, vv, nullptr);
    const mha_tensor ov =
        describe(out.data() + b * H * D, MHA_DTYPE_F32, {1, H, 1, D}, {0, D, H * D, 1});
    EXPECT_LE(max_abs_error(ov, ref), tolerance(ref)) << "sequence " << b;
  }
}

TEST(KvCacheWrite, BadInputIsRefusedByName) {
  struct Bad {
    const char* what;
    const char* named;
    int32_t dtype;
    std::function<void(CacheWrite&)> spoil;
  };
  static std::vector<float> other;
  const std::vector<Bad> bad = {
      {"slot past the cache", "slot_mapping[2]", MHA_DTYPE_F32,
       [](CacheWrite& w) { w.slots[2] = w.blocks * w.block; }},
      {"slot twice", "slot_mapping[1] and slot_mapping[5]", MHA_DTYPE_F32,
       [](CacheWrite& w) { w.slots[5] = w.slots[1]; }},
      {"block size 4", "block_size", MHA_DTYPE_F32,
       [](CacheWrite& w) { w.tk_cache.shape[1] = w.tv_cache.shape[1] = 4; }},
      {"value cache of another dtype", "value_cache", MHA_DTYPE_F32,
       [](CacheWrite& w) { w.tv_cache.dtype = MHA_DTYPE_BF16; }},
      {"i8 key", "key", MHA_DTYPE_F32, [](CacheWrite& w) { w.tkey.dtype = MHA_DTYPE_I8; }},
      {"slots of f32", "slot_mapping", MHA_DTYPE_F32,
       [](CacheWrite& w) { w.tslots.dtype = MHA_DTYPE_F32; }},
      {"one token too few slots", "slot_mapping", MHA_DTYPE_F32,
       [](CacheWrite& w) { w.tslots.shape[0] -= 1; }},
      {"head size disagrees", "key_cache", MHA_DTYPE_F32,
       [](CacheWrite& w) { w.tk_cache.shape[3] -= 1; }},
      {"scales for a f32 cache", "key_scale_cache", MHA_DTYPE_F32,
       [](CacheWrite& w) { w.k_scale_arg = &w.tk_scales; }},
      {"i8 cache without scales", "value_scale_cache", MHA_DTYPE_I8,
       [](CacheWrite& w) { w.v_scale_arg = nullptr; }},
      {"i8 cache, a NaN to write", "value[4][1][3]", MHA_DTYPE_I8,
       [](CacheWrite& w) { w.value[(4 * 2 + 1) * 16 + 3] = std::nanf(""); }},
      {"key cache over the key", "key_cache", MHA_DTYPE_F32,
       [](CacheWrite& w) {
         other.assign(static_cast<size_t>(w.blocks * w.block * w.Hkv * w.D), 0.0f);
         w.tkey.data = other.data();
         w.tk_cache.data = other.data();
       }},
  };
  for (const Bad& c : bad) {
    SCOPED_TRACE(c.what);
    CacheWrite w(c.dtype, 900);
    const std::vector<unsigned char> k_before = w.k_cache, v_before = w.v_cache;
    const std::vector<float> ks_before = w.k_scales, vs_before = w.v_scales;
    c.spoil(w);
    EXPECT_NE(w.write(), MHA_OK) << "accepted";
    EXPECT_NE(std::string(mha_last_error()).find(c.named), std::string::npos) << mha_last_error();
    EXPECT_TRUE(w.k_cache == k_before && w.v_cache == v_before && w.k_scales == ks_before &&
                w.v_scales == vs_before)
        << "a refused call wrote into a cache";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Paged, ::testing::ValuesIn(backend_names()), backend_param_name);

}  // namespace
}  // namespace mha_test
