// libFuzzer target over the C API.
//
// The fuzzer's bytes go through a series of cases, each reading the bytes the
// ones before it left (FuzzedDataProvider takes integers from the end), so
// that the corpus's older entries, which end sooner, keep their meaning.  In
// order, each described at the top of the file that implements it:
//
//   run_case                  mha_attention on 4-D tensors           case_dense.cpp
//   run_varlen_case           a packed variable-length batch         case_varlen.cpp
//   run_paged_case            a paged KV cache: written, attended    case_paged.cpp
//   run_backward_case         mha_attention_backward                 case_backward.cpp
//   run_module_backward_case  mha_module_backward                    case_module.cpp
//   run_block_case            a call as a block of a larger problem  case_block.cpp
//   run_positional_case       mha_positional_encoding_add            case_positional.cpp
//   run_module_forward_case   mha_module_forward                     case_module.cpp
//   run_varlen_backward_case  mha_attention_varlen_backward          case_varlen_backward.cpp
//   run_module_half_case      mha_module_forward in bf16 and f16     case_module_half.cpp
//
// Each draws a problem (the backend and the thread count first, then shapes,
// layouts, dtypes, options and data with specials planted) and either checks
// a valid call against the float64 reference (tests/), with nothing written
// outside the outputs and the inputs left alone, or breaks the call in one
// way that must be refused with nothing written.  Anything else is a finding:
// it aborts with a description of the case (fuzz_common.h, which holds what
// the cases share; fuzz_packed.h: what the packed and paged cases share).
// MHA_FUZZ_TRACE=1 prints each case an input reaches.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>

#include "fuzz_cases.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha_fuzz;
  FuzzedDataProvider fdp(data, size);
  // Each case reads the bytes the ones before it left (older corpus entries
  // end sooner, so they keep their meaning).
  using Case = int (*)(FuzzedDataProvider&);
  static constexpr Case kCases[] = {
      run_case,
      run_varlen_case,           // a packed batch
      run_paged_case,            // writes into a paged KV cache, attention over it
      run_backward_case,         // the backward pass
      run_module_backward_case,  // the module's backward pass
      run_block_case,            // a call as a block of a larger problem
      run_positional_case,       // the positional encoding, in place
      run_module_forward_case,   // the module's forward pass
      run_varlen_backward_case,  // a packed batch's backward pass
      run_module_half_case,      // the module's forward pass in bf16 and f16
  };
  for (const Case run : kCases) {
    if (run != kCases[0] && fdp.remaining_bytes() == 0) break;
    run(fdp);
    end_case();
  }
  return 0;
}
