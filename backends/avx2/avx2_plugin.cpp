// The avx2 plugin's table (compiled without ISA flags).
#include "simd/plugin_table.hpp"

MHA_PLUGIN_EXPORT const mha_plugin* mha_plugin_entry(void) {
  static constexpr mha_plugin kTable = mha_simd::plugin_table<xsimd::fma3<xsimd::avx2>>(
      "avx2", "AVX2 + FMA, xsimd fma3<avx2>", MHA_CPU_AVX | MHA_CPU_AVX2 | MHA_CPU_FMA, 20, 8);
  return &kTable;
}
