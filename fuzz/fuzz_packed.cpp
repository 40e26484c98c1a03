// Packed tensors and drawn variants (fuzz_packed.h).
#include "fuzz_packed.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "fuzz_common.h"
#include "test_util.h"

namespace mha_fuzz {

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

mha_tensor sequence_of(const mha_tensor& t, int64_t first, int64_t len) {
  const int64_t bytes = t.dtype == MHA_DTYPE_I8 ? 1 : mha_types::float_bytes(t.dtype);
  return mha_test::describe(static_cast<char*>(t.data) + first * t.strides[0] * bytes,
                            static_cast<mha_dtype>(t.dtype), {1, t.shape[1], len, t.shape[2]},
                            {0, t.strides[1], t.strides[0], t.strides[2]});
}

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

PackedOffsets packed_offsets(int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                             std::vector<int64_t>& lens_q, std::vector<int64_t>& lens_k) {
  const auto B = static_cast<int64_t>(lens_q.size());
  if (std::all_of(lens_q.begin(), lens_q.end(), [](int64_t l) { return l == 0; })) lens_q[0] = 1;
  if (std::all_of(lens_k.begin(), lens_k.end(), [](int64_t l) { return l == 0; })) lens_k[0] = 1;
  PackedOffsets o;
  o.cu_q.assign(static_cast<size_t>(B + 3), 0);
  o.cu_k.assign(o.cu_q.size(), 0);
  for (int64_t b = 0; b < B; ++b) {
    const auto at = static_cast<size_t>(b);
    o.cu_q[at + 1] = o.cu_q[at] + static_cast<int32_t>(lens_q[at]);
    o.cu_k[at + 1] = o.cu_k[at] + static_cast<int32_t>(lens_k[at]);
  }
  o.total_q = o.cu_q[static_cast<size_t>(B)];
  o.total_k = o.cu_k[static_cast<size_t>(B)];
  note(" B=%lld H=%lld Hkv=%lld D=%lld Dv=%lld lengths", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(Hkv), static_cast<long long>(D),
       static_cast<long long>(Dv));
  for (int64_t b = 0; b < B; ++b) {
    note(" %lld/%lld", static_cast<long long>(lens_q[static_cast<size_t>(b)]),
         static_cast<long long>(lens_k[static_cast<size_t>(b)]));
  }
  return o;
}

}  // namespace mha_fuzz
