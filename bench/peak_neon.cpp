// NEON reference loop: 128-bit fmla.  NEON is part of the aarch64 baseline, so
// this file needs no flags; it is called when the runtime reports the neon
// backend usable.
#include <arm_neon.h>

#include "peak.h"

namespace mha_bench {
namespace {

// 24 chains of the 32 q registers: enough for 4 FMA pipes of latency 4.
constexpr int kChains = 24;

float fma_neon(int64_t steps, float seed) {
  float32x4_t acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = vdupq_n_f32(seed + static_cast<float>(c));
  const float32x4_t m = vdupq_n_f32(0.999999f);
  const float32x4_t a = vdupq_n_f32(1e-6f);
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 24
    for (int c = 0; c < kChains; ++c) acc[c] = vfmaq_f32(a, acc[c], m);
  }
  float32x4_t sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = vaddq_f32(sum, acc[c]);
  return vaddvq_f32(sum);
}

}  // namespace

extern const FmaLoop kFmaNeon = {"neon", 2.0 * 4 * kChains, fma_neon};

}  // namespace mha_bench
