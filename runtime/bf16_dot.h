// Whether bf16 x bf16 products take the plugins' bf16 dot-product
// instructions on this CPU (mha_tile_sizes::bf16_dot).  Compiled without ISA
// flags.
#pragma once

#include <cstdint>

namespace mha::rt {

// Decided once from the CPU (AMX, vendor), unless MHA_BF16_DOT is 0, 1 or 2:
// 1 lets a plugin with a bf16 dot-product path (avx512bf16) take it for bf16
// Q with bf16 K and V, 2 the same path on AMX tiles (only where
// MHA_CPU_AMX_BF16 is detected), 0 has it widen them to fp32 as the other
// plugins do.
int32_t bf16_dot_products();

}  // namespace mha::rt
