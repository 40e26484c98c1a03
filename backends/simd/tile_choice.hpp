// Tile sizes from the machine's caches (mha_plugin::choose_tiles).  Included
// only by the table's translation unit, which is compiled without ISA flags:
// this runs when the plugin is loaded, before the runtime knows whether the
// CPU has the ISA.  docs/kernel-design.md, "Tiles from the caches", has the
// measurements behind the rules.
#pragma once

#include <mha/plugin_abi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>

#include "simd/blocking.hpp"

namespace mha_simd {

// Prefill: the score tile (kQueryTile x key_tile fp32 -- written by the score
// micro-kernel, read back by the exp and by P·V) takes three quarters of the
// L1 data cache, the rest left to the transposed Q tile's vectors and the K
// rows in flight; K and V tiles stream from the L2.  Key tiles are whole
// groups of the score micro-kernel (kScoreKeys) and whole vectors, between
// two such steps and kKeyTileMax.  With the L1d unknown: the table's kKeyTile.
// Measured (docs/kernel-design.md, "Tiles from the caches"):
//   Zen 4, 32 KiB: 96 keys, 5-12 % ahead of larger tiles
//   Intel Xeon (Emerald Rapids), 48 KiB: 144 (S1, S2, S6: 96-144 2-8 % ahead
//   of 192, 288 behind; avx2 alike)
template <class Arch>
constexpr int32_t prefill_key_tile(int64_t l1d_bytes) {
  using Blk = Blocking<Arch>;
  // Floats per register (xsimd::batch cannot be named without the ISA's flags).
  constexpr int64_t lanes = static_cast<int64_t>(Arch::alignment() / sizeof(float));
  constexpr int64_t step = std::lcm<int64_t>(Blk::kScoreKeys, lanes);
  if (l1d_bytes <= 0) return Blk::kKeyTile;
  const int64_t keys = l1d_bytes * 3 / 4 / (int64_t{Blk::kQueryTile} * 4) / step * step;
  return static_cast<int32_t>(std::clamp<int64_t>(keys, 2 * step, Blk::kKeyTileMax / step * step));
}

// Prefill on AMX tiles (amx.hpp): key tiles of whole steps of 32 keys whose
// fp32 scores (kQueryTile x keys, stored by the tiles, read by the exps)
// take two thirds of the L1d, between 64 and 512 keys; 128 with the L1d
// unknown.  Measured on an Intel Xeon (family 6 model 167, 48 KiB: 128
// keys), S1/S2/S6:bf16 at one thread: 128 keys 18.0/67.0/164 ms, 160
// 18.2/68.1/156, 256 19.0/66.8/160, 512 19.4/70.0/161 -- and the 144 of the
// rule above (not whole steps: every tile's last step padded) 20.1/75.6/170.
template <class Arch>
constexpr int32_t amx_key_tile(int64_t l1d_bytes) {
  constexpr int64_t step = 32;
  if (l1d_bytes <= 0) return 128;
  const int64_t keys = l1d_bytes * 2 / 3 / (int64_t{Blocking<Arch>::kQueryTile} * 4) / step * step;
  return static_cast<int32_t>(std::clamp<int64_t>(keys, 2 * step, 16 * step));
}

// Prefill P·V: each block of query rows reads the key tile's V rows once, so
// a tile whose V rows outgrow the L1d brings them from the L2 again for every
// block (11 times for 64 queries).  P·V therefore runs over the tile's keys
// in equal runs whose V rows take at most half the L1d, every row block
// finishing a run before the next starts (0: the L1d is unknown, runs are
// whole tiles).  Measured (docs/kernel-design.md, "Tiles from the caches"):
// Zen 5, 48 KiB, S2 (Dv 128: a 144-key tile's V rows are 72 KiB) 0.967 of
// the time with three runs of 48 keys (half the L1d did better than three
// quarters or a third); S1 and S6 (Dv 64: two runs of 72) as before.
constexpr int64_t prefill_pv_run_bytes(int64_t l1d_bytes) {
  return l1d_bytes > 0 ? l1d_bytes / 2 : 0;
}

}  // namespace mha_simd
