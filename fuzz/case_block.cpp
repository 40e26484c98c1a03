// The sixth case (run_block_case), on the bytes the module's backward case
// left: a call as a block of a larger problem -- offsets and full lengths
// that fit or do not, with the rules of positions, against the reference of
// that block.
#include "fuzz_cases.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <string>
#include <vector>

#include "fuzz_common.h"
#include "reference.h"
#include "test_util.h"

namespace mha_fuzz {

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

}  // namespace mha_fuzz
