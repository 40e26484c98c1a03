// The FMA-throughput reference loop of one SIMD instruction set: one source,
// compiled once per SIMD row of cmake/MhaIsa.cmake with that row's flags
// (MHA_PEAK_ARCH names the xsimd architecture, MHA_PEAK_NAME the table and
// MHA_PEAK_BACKEND the backend).  mha_bench calls it only when the runtime
// reports that backend usable.
#include <xsimd/xsimd.hpp>

#include "peak.h"
#include "simd/blocking.hpp"

namespace mha_bench {
namespace {

using Arch = MHA_PEAK_ARCH;
using B = xsimd::batch<float, Arch>;

// Independent accumulator chains: 24 with 32 vector registers, 12 with 16
// (AVX2): enough to cover FMA latency times the FMA pipes, leaving room for
// the two constants.
constexpr int kChains = mha_simd::Blocking<Arch>::kScoreQueryVectors >= 4 ? 24 : 12;

float fma_loop(int64_t steps, float seed) {
  B acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = B(seed + static_cast<float>(c));
  const B m(0.999999f);
  const B a(1e-6f);
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 24
    for (int c = 0; c < kChains; ++c) acc[c] = xsimd::fma(acc[c], m, a);
  }
  B sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum += acc[c];
  return xsimd::hadd(sum);
}

}  // namespace

extern const FmaLoop MHA_PEAK_NAME = {MHA_PEAK_BACKEND,
                                      2.0 * static_cast<double>(B::size) * kChains, fma_loop};

}  // namespace mha_bench
