// AVX2 reference loop: ymm FMAs.  Compiled with -mavx2 -mfma; called only when
// the runtime reports the avx2 backend usable.
#include <immintrin.h>

#include "peak.h"

namespace mha_bench {
namespace {

// 12 chains: 16 ymm registers hold 12 accumulators and 2 constants; FMA
// latency 4 × 2 pipes needs at least 8.
constexpr int kChains = 12;

float fma_avx2(int64_t steps, float seed) {
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(seed + static_cast<float>(c));
  const __m256 m = _mm256_set1_ps(0.999999f);
  const __m256 a = _mm256_set1_ps(1e-6f);
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], m, a);
  }
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.0f;
  for (float x : lanes) total += x;
  return total;
}

}  // namespace

extern const FmaLoop kFmaAvx2 = {"avx2", 2.0 * 8 * kChains, fma_avx2};

}  // namespace mha_bench
