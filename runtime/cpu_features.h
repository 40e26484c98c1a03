// What the CPU and the operating system let us run.  Compiled without any ISA
// flags: it must run on every CPU the library can be loaded on.
#pragma once

#include <cstdint>
#include <string>

namespace mha::rt {

// mha_cpu_feature bits (plugin_abi.h), detected once.  On x86-64 the AVX and
// AVX-512 bits also require the OS to save the registers (XCR0).
uint32_t cpu_features();

// "avx2 fma avx512f ..." for a set of mha_cpu_feature bits.
std::string feature_names(uint32_t features);

// The CPU's make on x86-64 (CPUID leaves 0 and 1), for the rules that depend
// on a vendor's microarchitecture (decode_streams.cpp, bf16_dot.cpp); the
// vendor is empty and the numbers 0 elsewhere.
struct CpuIdentity {
  char vendor[13];  // "GenuineIntel", "AuthenticAMD", "HygonGenuine", ...
  unsigned family;  // the display family (base + extended)
  unsigned model;   // the display model (extended model included)
};
const CpuIdentity& cpu_identity();

}  // namespace mha::rt
