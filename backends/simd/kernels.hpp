// Included once per ISA by the plugin's kernel file: picks the kernel layout
// the runtime asked for and runs it.  Only that file is compiled with the ISA's
// flags.
#pragma once

#include "simd/backward.hpp"
#include "simd/decode.hpp"
#include "simd/kernel_entry.hpp"
#include "simd/prefill.hpp"

namespace mha_simd {

// kBf16Dot: the plugin's ISA has AVX512_BF16 and its prefill layout takes
// the bf16 dot-product path for bf16 inputs (paths.hpp).
template <class Arch, bool kBf16Dot>
size_t scratch_bytes(const mha_kernel_problem& p, int64_t max_queries) {
  return p.layout == MHA_LAYOUT_DECODE ? DecodeKernel<Arch>::scratch_bytes(p, max_queries)
                                       : PrefillKernel<Arch, kBf16Dot>::scratch_bytes(p);
}

template <class Arch, bool kBf16Dot>
int attend(const mha_kernel_problem& p, const mha_work_item& item, void* scratch) {
  if (p.layout == MHA_LAYOUT_DECODE) {
    DecodeKernel<Arch>::run(p, item, scratch);
  } else {
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
