// AVX-512 reference loop: zmm FMAs.  Compiled with -mavx512f; called only when
// the runtime reports the avx512 backend usable.
#include <immintrin.h>

#include "peak.h"

namespace mha_bench {
namespace {

// 24 chains of the 32 zmm registers: enough for FMA latency 4 × 2 pipes with
// room to spare.
constexpr int kChains = 24;

float fma_avx512(int64_t steps, float seed) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(seed + static_cast<float>(c));
  const __m512 m = _mm512_set1_ps(0.999999f);
  const __m512 a = _mm512_set1_ps(1e-6f);
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 24
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], m, a);
  }
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float total = 0.0f;
  for (float x : lanes) total += x;
  return total;
}

}  // namespace

extern const FmaLoop kFmaAvx512 = {"avx512", 2.0 * 16 * kChains, fma_avx512};

}  // namespace mha_bench
