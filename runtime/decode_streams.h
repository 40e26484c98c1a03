// How many streams the decode kernels read a tile's K and V rows as, on this
// CPU (mha_tile_sizes::decode_key_streams).  Compiled without ISA flags.
#pragma once

#include <cstdint>

namespace mha::rt {

// Decided once from the CPU (vendor, family, features), unless
// MHA_DECODE_STREAMS names a count: 1 reads a decode tile's rows in address
// order (with software prefetch), more asks for that many streams at once
// (the plugins that have streams use their own count).
int32_t decode_key_streams();

}  // namespace mha::rt
