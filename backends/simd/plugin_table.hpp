// The table of a SIMD plugin.  Compiled without ISA flags: building it runs no
// instruction the weakest CPU lacks (the table is a constant, nothing runs).
#pragma once

#include <mha/plugin_abi.h>

#include "simd/blocking.hpp"
#include "simd/kernel_entry.hpp"
#include "simd/paths.hpp"

#define MHA_PLUGIN_EXPORT extern "C" __attribute__((visibility("default")))

namespace mha_simd {

template <class Arch, bool kBf16Dot>
constexpr mha_plugin plugin_table(const char* name, const char* description, uint32_t features,
                                  int32_t priority, int32_t vector_floats) {
  return mha_plugin{
      MHA_PLUGIN_ABI_VERSION,
      sizeof(mha_plugin),
      name,
      description,
      features,
      priority,
      vector_floats,
      Blocking<Arch>::kQueryTile,
      Blocking<Arch>::kKeyTile,
      nullptr,
      mha_simd_scratch_bytes,
      mha_simd_attend,
      nullptr,  // supports: every problem the runtime validates
      kernel_path<kBf16Dot>,
      mha_simd_backward_scratch_bytes,
      mha_simd_backward,
  };
}

}  // namespace mha_simd
