// The part of a test call that does not depend on the dtypes of Q, K and V:
// a random mask and valid lengths, the output (f32 or half) and LSE buffers,
// the params that name them, and the LSE's check against the reference.  The
// half-precision suites build their calls around it.
#pragma once

#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace mha_test {

struct CallOptions {
  int32_t causal = MHA_CAUSAL_NONE;
  // 0 none; 1 bool [Lq, Lk], 80 % of the keys kept; 2 additive [B, 1, Lq, Lk]
  // of mask_dtype, 10 % -inf and the rest in [-3, 3).
  int mask = 0;
  int32_t mask_dtype = MHA_DTYPE_F32;
  bool lens = false;  // valid lengths in [0, Lk] per batch
  int32_t out_dtype = MHA_DTYPE_F32;
};

class CheckedCall {
 public:
  // Draws the mask, then the lengths, from rng.
  CheckedCall(Rng& rng, int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t Dv,
              const CallOptions& o)
      : rows_(B * H * Lq) {
    if (o.mask == 1) {
      mask_bool_.resize(static_cast<size_t>(Lq * Lk));
      for (auto& m : mask_bool_) m = rng.chance(0.8) ? 1 : 0;
      mask_ = describe(mask_bool_.data(), MHA_DTYPE_BOOL, {Lq, Lk});
    } else if (o.mask == 2) {
      mask_f32_.resize(static_cast<size_t>(B * Lq * Lk));
      for (auto& m : mask_f32_) m = rng.chance(0.1) ? -INFINITY : rng.uniform(-3.0f, 3.0f);
      mask_typed_.emplace_back(describe(mask_f32_.data(), MHA_DTYPE_F32, {B, 1, Lq, Lk}),
                               o.mask_dtype);
      mask_ = mask_typed_.back().get();
    }
    lens_.resize(static_cast<size_t>(B));
    for (auto& l : lens_) l = static_cast<int32_t>(rng.integer(0, Lk));
    lens_tensor_ = describe(lens_.data(), MHA_DTYPE_I32, {B});

    const int64_t count = B * H * Lq * Dv;
    out_f32_.assign(static_cast<size_t>(count), -7.0f);
    out_half_.assign(static_cast<size_t>(count), 0xFFFF);
    out = o.out_dtype == MHA_DTYPE_F32
              ? describe(out_f32_.data(), MHA_DTYPE_F32, {B, H, Lq, Dv})
              : describe(out_half_.data(), static_cast<mha_dtype>(o.out_dtype), {B, H, Lq, Dv});
    lse_.assign(static_cast<size_t>(rows_), 0.0f);
    lse_tensor_ = describe(lse_.data(), MHA_DTYPE_F32, {B, H, Lq});

    mha_attention_params_init(&params);
    params.causal = o.causal;
    if (o.mask != 0) params.mask = &mask_;
    if (o.lens) params.valid_lens = &lens_tensor_;
    params.lse = &lse_tensor_;
  }
  CheckedCall(const CheckedCall&) = delete;  // params points into this object
  CheckedCall& operator=(const CheckedCall&) = delete;

  // Every row's LSE within 1e-5 relative (-inf exactly).
  void expect_lse_matches(const Reference& ref) const {
    for (int64_t r = 0; r < rows_; ++r) {
      const double want = ref.lse[static_cast<size_t>(r)];
      const double got = static_cast<double>(lse_[static_cast<size_t>(r)]);
      if (std::isinf(want)) {
        EXPECT_EQ(got, want) << "lse row " << r;
      } else {
        EXPECT_NEAR(got, want, 1e-5 * std::max(1.0, std::fabs(want))) << "lse row " << r;
      }
    }
  }

  mha_attention_params params{};
  mha_tensor out{};

 private:
  int64_t rows_;
  std::vector<uint8_t> mask_bool_;
  std::vector<float> mask_f32_;
  std::vector<TypedCopy> mask_typed_;
  mha_tensor mask_{};
  std::vector<int32_t> lens_;
  mha_tensor lens_tensor_{};
  std::vector<float> out_f32_;
  std::vector<uint16_t> out_half_;
  std::vector<float> lse_;
  mha_tensor lse_tensor_{};
};

// Q, K and V of a case, laid out as `layout` says: Q and K uniform in
// [-2, 2), V in [0, 1).
struct RandomInputs {
  Shape4 sq, sk, sv;
  Arena q, k, v;
  mha_tensor tq, tk, tv;

  RandomInputs(Rng& rng, Layout layout, int64_t B, int64_t H, int64_t Hkv, int64_t Lq, int64_t Lk,
               int64_t D, int64_t Dv)
      : sq(make_shape(layout, B, H, Lq, D)),
        sk(make_shape(layout, B, Hkv, Lk, D)),
        sv(make_shape(layout, B, Hkv, Lk, Dv)),
        q(sq.extent),
        k(sk.extent),
        v(sv.extent),
        tq(q.view(sq)),
        tk(k.view(sk)),
        tv(v.view(sv)) {
    fill_uniform(tq, rng, -2.0f, 2.0f);
    fill_uniform(tk, rng, -2.0f, 2.0f);
    fill_uniform(tv, rng);
  }
};

// A caller built against an older mha passes its older struct_size: the
// fields past it must be ignored, whatever they hold.  Runs a small call
// (B 1, H 2, L 40, D 16) with params of `size` bytes after `set_newer` has
// filled newer fields with garbage, and checks it against plain attention.
template <class SetNewer>
void expect_older_size_ignores_newer_fields(uint32_t size, SetNewer&& set_newer) {
  const int64_t L = 40, D = 16;
  Rng rng(3);
  std::vector<float> q(static_cast<size_t>(2 * L * D)), k(q.size()), v(q.size()), out(q.size());
  for (auto* x : {&q, &k, &v}) {
    for (float& f : *x) f = rng.uniform(-1.0f, 1.0f);
  }
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {1, 2, L, D});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {1, 2, L, D});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 2, L, D});
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, 2, L, D});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.struct_size = size;
  set_newer(p);
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, &p), MHA_OK) << mha_last_error();
  mha_attention_params plain;
  mha_attention_params_init(&plain);
  const Reference ref = reference_attention(tq, tk, tv, &plain);
  EXPECT_LE(max_abs_error(tout, ref), tolerance(ref));
}

}  // namespace mha_test
