// The neon plugin's table.
#include "simd/plugin_table.hpp"

MHA_PLUGIN_EXPORT const mha_plugin* mha_plugin_entry(void) {
  static constexpr mha_plugin kTable = mha_simd::plugin_table<xsimd::neon64>(
      "neon", "aarch64 Advanced SIMD, xsimd neon64", MHA_CPU_NEON, 20, 4);
  return &kTable;
}
