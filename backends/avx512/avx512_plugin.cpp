// The avx512 plugin's table (compiled without ISA flags).
#include "simd/plugin_table.hpp"

MHA_PLUGIN_EXPORT const mha_plugin* mha_plugin_entry(void) {
  static constexpr mha_plugin kTable = mha_simd::plugin_table<xsimd::avx512bw>(
      "avx512", "AVX-512 F/CD/DQ/BW/VL, xsimd avx512bw",
      MHA_CPU_AVX512F | MHA_CPU_AVX512CD | MHA_CPU_AVX512DQ | MHA_CPU_AVX512BW | MHA_CPU_AVX512VL |
          MHA_CPU_AVX2 | MHA_CPU_FMA,
      30, 16);
  return &kTable;
}
