// The table of a SIMD plugin.  Compiled without ISA flags: building it runs no
// instruction the weakest CPU lacks (the table is a constant, nothing runs).
#pragma once

#include <algorithm>

#include <mha/plugin_abi.h>

#include "simd/blocking.hpp"
#include "simd/kernel_entry.hpp"
#include "simd/packed_gemm.hpp"
#include "simd/paths.hpp"
#include "simd/tile_choice.hpp"

#define MHA_PLUGIN_EXPORT extern "C" __attribute__((visibility("default")))

namespace mha_simd {

// What the kernels read through mha_simd_chosen_tiles(); the table's tiles
// until the runtime calls choose_tiles.
template <class Arch>
mha_simd_tiles& tiles_of_this_plugin() {
  static mha_simd_tiles tiles{Blocking<Arch>::kKeyTile, amx_key_tile<Arch>(0), 0, 0, 1, 0, 0};
  return tiles;
}

template <class Arch, bool kBf16Dot>
void choose_tiles(const mha_cache_sizes* caches, mha_tile_sizes* tiles) {
  mha_simd_tiles& chosen = tiles_of_this_plugin<Arch>();
  chosen.key_tile = prefill_key_tile<Arch>(caches->l1d);
  chosen.amx_key_tile = amx_key_tile<Arch>(caches->l1d);
  chosen.l2_bytes = caches->l2;
  chosen.l1d_bytes = caches->l1d;
  chosen.pv_run_bytes = prefill_pv_run_bytes(caches->l1d);
  tiles->query_tile = Blocking<Arch>::kQueryTile;
  tiles->key_tile = chosen.key_tile;
  tiles->decode_key_tile = Blocking<Arch>::kDecodeKeyTile;
  // Streams where the runtime asks for them and this ISA's kernels have them.
  chosen.decode_key_streams = tiles->decode_key_streams > 1 ? Blocking<Arch>::kDecodeKeyStreams : 1;
  tiles->decode_key_streams = chosen.decode_key_streams;
  // The bf16 dot-product path where this plugin has it and the runtime wants
  // it on this CPU (runtime/bf16_dot.cpp), on AMX tiles (2) only where the
  // runtime asks for them: it does so only where the CPU, the OS and the
  // process's permission allow them.
  chosen.bf16_dot = kBf16Dot ? std::clamp(tiles->bf16_dot, 0, 2) : 0;
  tiles->bf16_dot = chosen.bf16_dot;
}

// The module's matrix-product micro-kernel, where this ISA has one
// (packed_gemm.hpp).
template <class Arch>
inline constexpr mha_gemm_ukernel kPackedGemm{PackedGemmTile<Arch>::kMr, PackedGemmTile<Arch>::kNr,
                                              PackedGemmTile<Arch>::kRowMajor ? 1 : 0,
                                              mha_simd_packed_gemm};

template <class Arch>
constexpr const mha_gemm_ukernel* packed_gemm_of() {
  if constexpr (PackedGemmTile<Arch>::kOffered) {
    return &kPackedGemm<Arch>;
  } else {
    return nullptr;
  }
}

// The module's bf16 matrix products: the plugins with the bf16 path on
// x86-64 build them on AMX tiles (amx_gemm.hpp) and with dot products
// (dot_gemm.hpp); the runtime calls them only where it chose one of the two
// (bf16_dot 2 or 1).
inline constexpr mha_bf16_gemm kBf16Gemm{
    mha_simd_bf16_gemm_packed_bytes,        mha_simd_bf16_gemm_pack,
    mha_simd_bf16_gemm_scratch_bytes,       mha_simd_bf16_gemm_run,
    mha_simd_bf16_gemm_split_scratch_bytes, mha_simd_bf16_gemm_run_split,
    mha_simd_bf16_gemm_run_to_bf16};

template <bool kBf16Dot>
constexpr const mha_bf16_gemm* bf16_gemm_of() {
#if defined(__x86_64__)
  if constexpr (kBf16Dot) return &kBf16Gemm;
#endif
  return nullptr;
}

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
      choose_tiles<Arch, kBf16Dot>,
      packed_gemm_of<Arch>(),
      bf16_gemm_of<kBf16Dot>(),
      mha_simd_narrow_floats,
  };
}

}  // namespace mha_simd
