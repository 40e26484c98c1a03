// mha_positional_encoding_add: the sinusoidal encoding of "Attention is all you
// need", added in place, computed in double and rounded once.
#include <mha/mha.h>

#include <cmath>
#include <vector>

#include "error.h"
#include "threads.h"
#include "validate.h"

using namespace mha::rt;

extern "C" mha_status mha_positional_encoding_add(mha_tensor* x) {
  clear_error();
  if (mha_status s = check_tensor(x, "x", 3, 3); s != MHA_OK) return s;
  if (x->dtype != MHA_DTYPE_F32) {
    return fail(MHA_ERR_INVALID_DTYPE, "x has dtype %s; it must be f32", dtype_name(x->dtype));
  }
  // In place: two indices on one element would add the encoding twice.
  if (mha_status s = check_no_overlap(*x, "x", nullptr, nullptr, 0); s != MHA_OK) return s;

  const int64_t batch = x->shape[0], len = x->shape[1], d = x->shape[2];
  std::vector<double> denominator;
  try {
    denominator.resize(static_cast<size_t>((d + 1) / 2));
  } catch (...) {
    return fail(MHA_ERR_OUT_OF_MEMORY, "out of memory");
  }
  // P[i, 2j] = sin(i / 10000^(2j/d)), P[i, 2j+1] = cos(i / 10000^(2j/d))
  for (int64_t j = 0; j < (d + 1) / 2; ++j) {
    denominator[static_cast<size_t>(j)] =
        std::pow(10000.0, static_cast<double>(2 * j) / static_cast<double>(d));
  }
  auto* data = static_cast<float*>(x->data);
  const int64_t s0 = x->strides[0], s1 = x->strides[1], s2 = x->strides[2];
  const int32_t team = len * d >= 16384 ? num_threads() : 1;
  auto no_preparation = [](int32_t /*thread*/) { return true; };
  run_team(len, team, no_preparation, [&](int64_t i, int32_t /*thread*/) {
    for (int64_t c = 0; c < d; ++c) {
      const double angle = static_cast<double>(i) / denominator[static_cast<size_t>(c / 2)];
      const double p = c % 2 == 0 ? std::sin(angle) : std::cos(angle);
      for (int64_t b = 0; b < batch; ++b) {
        float& element = data[b * s0 + i * s1 + c * s2];
        element = static_cast<float>(static_cast<double>(element) + p);
      }
    }
  });
  return MHA_OK;
}
