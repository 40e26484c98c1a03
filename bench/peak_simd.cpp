// The FMA-throughput reference loop of one SIMD instruction set: one source,
// compiled once per SIMD row of cmake/MhaIsa.cmake with that row's flags
// (MHA_PEAK_ARCH names the xsimd architecture, MHA_PEAK_NAME the table and
// MHA_PEAK_BACKEND the backend).  A row with the bf16 dot-product path
// (MHA_PEAK_BF16_DOT_NAME defined) also gets the vdpbf16ps loop, the peak of
// that path, and the tdpbf16ps loop (MHA_PEAK_BF16_AMX_NAME), its peak on AMX
// tiles.  mha_bench calls a loop only when the runtime reports that
// backend usable.
#include <xsimd/xsimd.hpp>

#if defined(MHA_PEAK_BF16_DOT_NAME) || defined(MHA_PEAK_BF16_AMX_NAME)
#include <immintrin.h>
#endif

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

#ifdef MHA_PEAK_BF16_DOT_NAME
// vdpbf16ps: per fp32 lane two bf16 products added to the accumulator, 4
// FLOPs, on as many independent chains as the FMA loop.
float bf16_dot_loop(int64_t steps, float seed) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(seed + static_cast<float>(c));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(2e-3f), _mm512_set1_ps(2e-3f));
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 24
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  return _mm512_reduce_add_ps(sum);
}
#endif

#ifdef MHA_PEAK_BF16_AMX_NAME
// tdpbf16ps on AMX tiles: four independent 16 x 16 fp32 accumulator tiles,
// each step 16 x 16 x 32 products (two FLOPs each) per tile, as the bf16
// path's products on AMX tiles run them (backends/simd/amx.hpp).  Called only
// where the runtime reports that path (mha_backend_get_bf16_dot 2): the CPU,
// the OS and the process's permission then allow the tiles.
__attribute__((target("amx-tile,amx-bf16"))) float bf16_amx_loop(int64_t steps, float seed) {
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t columns[16];
    uint8_t rows[16], unused[16];
  } config{};
  config.palette = 1;
  for (int i = 0; i < 8; ++i) {
    config.columns[i] = 64;
    config.rows[i] = 16;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
  alignas(64) uint16_t a[16 * 32];
  alignas(64) float out[16 * 16];
  const uint16_t one = 0x3f80;  // bf16 1.0
  for (uint16_t& x : a) x = one;
  __asm__ volatile("" ::: "memory");  // the tile loads read `a`
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, a, 64);
  _tile_loadd(7, a, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float sum = seed;
  _tile_stored(0, out, 64);
  sum += out[0];
  _tile_stored(3, out, 64);
  sum += out[255];
  _tile_release();
  return sum;
}
#endif

}  // namespace

extern const FmaLoop MHA_PEAK_NAME = {MHA_PEAK_BACKEND, "fma",
                                      2.0 * static_cast<double>(B::size) * kChains, fma_loop};
#ifdef MHA_PEAK_BF16_DOT_NAME
extern const FmaLoop MHA_PEAK_BF16_DOT_NAME = {MHA_PEAK_BACKEND, "bf16dot", 4.0 * 16 * kChains,
                                               bf16_dot_loop};
#endif
#ifdef MHA_PEAK_BF16_AMX_NAME
extern const FmaLoop MHA_PEAK_BF16_AMX_NAME = {MHA_PEAK_BACKEND, "bf16amx", 4.0 * 16 * 16 * 32 * 2,
                                               bf16_amx_loop};
#endif

}  // namespace mha_bench
