// The attention fuzzer's cases, in the order LLVMFuzzerTestOneInput runs them
// (attention_fuzzer.cpp), each on the bytes the ones before it left.  Each
// returns 0; a finding aborts (fuzz_common.h).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

namespace mha_fuzz {

int run_case(FuzzedDataProvider& fdp);                  // case_dense.cpp
int run_varlen_case(FuzzedDataProvider& fdp);           // case_varlen.cpp
int run_paged_case(FuzzedDataProvider& fdp);            // case_paged.cpp
int run_backward_case(FuzzedDataProvider& fdp);         // case_backward.cpp
int run_module_backward_case(FuzzedDataProvider& fdp);  // case_module.cpp
int run_block_case(FuzzedDataProvider& fdp);            // case_block.cpp
int run_positional_case(FuzzedDataProvider& fdp);       // case_positional.cpp
int run_module_forward_case(FuzzedDataProvider& fdp);   // case_module.cpp
int run_varlen_backward_case(FuzzedDataProvider& fdp);  // case_varlen_backward.cpp
int run_module_half_case(FuzzedDataProvider& fdp);      // case_module_half.cpp

}  // namespace mha_fuzz
