// Which arithmetic a SIMD plugin's kernel uses for a problem: the kernel
// decides with these, and the plugin's table reports the same answer to the
// runtime (MHA_VERBOSE=2's path=).  No ISA code: the table is compiled
// without the ISA's flags.
#pragma once

#include <mha/mha.h>
#include <mha/plugin_abi.h>

#include "simd/kernel_entry.hpp"

namespace mha_simd {

// bf16 Q with bf16 K and V in the prefill layout: the bf16 dot-product path
// of a plugin built with it (bf16_dot.hpp).  Decode keeps widening to fp32:
// it is bound by reading K and V, which bf16 already halves, not by products.
inline bool bf16_dot_applies(const mha_kernel_problem& p) {
  return p.layout == MHA_LAYOUT_QUERY_LANES && p.q_dtype == MHA_DTYPE_BF16 &&
         p.kv_dtype == MHA_DTYPE_BF16;
}

// Whether a problem takes that path: the plugin has it (kBf16Dot), the runtime
// wants it on this CPU (mha_simd_tiles::bf16_dot; runtime/bf16_dot.cpp: not
// where vdpbf16ps runs below the FMA's rate), and the problem is one it takes.
template <bool kBf16Dot>
bool bf16_dot_taken(const mha_kernel_problem& p) {
  return kBf16Dot && mha_simd_chosen_tiles().bf16_dot != 0 && bf16_dot_applies(p);
}

// Whether that path's two products run on AMX tiles (amx.hpp): the runtime
// asked for them (bf16_dot 2), which it does only where they are usable.
template <bool kBf16Dot>
bool amx_taken(const mha_kernel_problem& p) {
  return bf16_dot_taken<kBf16Dot>(p) && mha_simd_chosen_tiles().bf16_dot == 2;
}

// The name of the path (mha_plugin.path).
template <bool kBf16Dot>
const char* kernel_path(const mha_kernel_problem* p) {
  if (amx_taken<kBf16Dot>(*p)) return "bf16-amx";
  if (bf16_dot_taken<kBf16Dot>(*p)) return "bf16-dot";
  return p->q_dtype == MHA_DTYPE_F32 && p->kv_dtype == MHA_DTYPE_F32 ? "fp32" : "widened-to-fp32";
}

}  // namespace mha_simd
