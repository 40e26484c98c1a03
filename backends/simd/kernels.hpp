// Included once per ISA by the plugin's kernel file: picks the kernel layout
// the runtime asked for and runs it.  Only that file is compiled with the ISA's
// flags.
#pragma once

#include "simd/backward.hpp"
#include "simd/decode.hpp"
#include "simd/kernel_entry.hpp"
#include "simd/prefill.hpp"
#include "simd/rows.hpp"

namespace mha_simd {

// kBf16Dot: the plugin's ISA has AVX512_BF16 and its prefill layout takes
// the bf16 dot-product path for bf16 inputs (paths.hpp).
template <class Arch, bool kBf16Dot>
size_t scratch_bytes(const mha_kernel_problem& p, int64_t max_queries) {
  switch (p.layout) {
    case MHA_LAYOUT_DECODE:
      return DecodeKernel<Arch>::scratch_bytes(p, max_queries);
    case MHA_LAYOUT_ROWS:
      return RowsKernel<Arch, kBf16Dot>::scratch_bytes(p);
    default:
      return PrefillKernel<Arch, kBf16Dot>::scratch_bytes(p);
  }
}

template <class Arch, bool kBf16Dot>
int attend(const mha_kernel_problem& p, const mha_work_item& item, void* scratch) {
  switch (p.layout) {
    case MHA_LAYOUT_DECODE:
      DecodeKernel<Arch>::run(p, item, scratch);
      break;
    case MHA_LAYOUT_ROWS:
      RowsKernel<Arch, kBf16Dot>::run(p, item, scratch);
      break;
    default:
      PrefillKernel<Arch, kBf16Dot>::run(p, item, scratch);
  }
  return 0;
}

template <class Arch>
size_t backward_scratch_bytes(const mha_backward_problem& p) {
  return BackwardKernel<Arch>::scratch_bytes(p);
}

template <class Arch>
int backward(const mha_backward_problem& p, const mha_backward_item& item, void* scratch) {
  BackwardKernel<Arch>::run(p, item, scratch);
  return 0;
}

}  // namespace mha_simd
