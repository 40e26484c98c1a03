// The seventh case (run_positional_case), on the bytes the block case left:
// mha_positional_encoding_add in place, any axis order and padding, against
// the encoding in double, or a broken tensor refused with nothing written.
#include "fuzz_cases.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <cmath>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "test_util.h"

namespace mha_fuzz {

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

}  // namespace mha_fuzz
