// Baseline-ISA reference loops, compiled with the project's default flags.
#include <cstring>

#include "peak.h"

namespace mha_bench {
namespace {

typedef float V4 __attribute__((vector_size(16)));

// x86-64: 12 chains fit its 16 xmm registers (with 2 constants), and 12 chains
// of mul (3 cycles) + add (3 cycles) keep two multipliers and two adders busy.
// aarch64 (32 registers, a·b + c contracted to fmla): 24, as the NEON loop.
#if defined(__aarch64__)
constexpr int kChains = 24;
#else
constexpr int kChains = 12;
#endif

float fma_scalar(int64_t steps, float seed) {
  V4 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = V4{seed, seed, seed, seed} + static_cast<float>(c);
  // acc -> acc·m + a converges to a / (1 - m): no overflow, no denormals.
  const V4 m = {0.999999f, 0.999999f, 0.999999f, 0.999999f};
  const V4 a = {1e-6f, 1e-6f, 1e-6f, 1e-6f};
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 24
    for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * m + a;
  }
  V4 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum += acc[c];
  return sum[0] + sum[1] + sum[2] + sum[3];
}

}  // namespace

extern const FmaLoop kFmaScalar = {"scalar", "fma", 2.0 * 4 * kChains, fma_scalar};

float read_sum(const float* data, size_t n, int streams) {
  constexpr int kAcc = 8;
  V4 acc[kAcc] = {};
  const size_t part = n / static_cast<size_t>(streams);
  for (size_t i = 0; i < part; i += 4 * kAcc) {
    for (int s = 0; s < streams; ++s) {
      const float* at = data + static_cast<size_t>(s) * part + i;
#pragma GCC unroll 8
      for (int c = 0; c < kAcc; ++c) {
        V4 x;
        std::memcpy(&x, at + 4 * c, sizeof x);
        acc[c] += x;
      }
    }
  }
  V4 sum = acc[0];
  for (int c = 1; c < kAcc; ++c) sum += acc[c];
  return sum[0] + sum[1] + sum[2] + sum[3];
}

}  // namespace mha_bench
