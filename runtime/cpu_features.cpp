#include "cpu_features.h"

#include <mha/plugin_abi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace mha::rt {
namespace {

#if defined(__x86_64__)
// XGETBV by opcode, so this file needs no -mxsave.
uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t{edx} << 32) | eax;
}

// Whether this process may use AMX tiles: the CPU has them with bf16 products
// (CPUID 7.0 EDX bits 24 and 22), the OS saves their state (XCR0 bits 17 and
// 18), and Linux granted the permission a process must ask for before its
// first tile instruction (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, since
// Linux 5.16; without it the first one raises SIGILL).  Asked once, for the
// whole process: the tile state is then allocated for each thread that uses it.
// The permission is not asked for where MHA_BF16_DOT=0 or 1 rules the tiles
// out: once granted, Linux enlarges every signal frame of the process by the
// tiles' 8 KiB and refuses smaller alternate signal stacks.
bool amx_bf16_usable(unsigned leaf7_edx, uint64_t xcr0) {
  const bool cpu = ((leaf7_edx >> 24) & 1u) && ((leaf7_edx >> 22) & 1u);
  const bool os = (xcr0 & 0x60000) == 0x60000;
  if (!cpu || !os) return false;
  const char* bf16_dot = std::getenv("MHA_BF16_DOT");
  if (bf16_dot != nullptr && (std::strcmp(bf16_dot, "0") == 0 || std::strcmp(bf16_dot, "1") == 0)) {
    return false;
  }
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
#else
  return false;
#endif
}

uint32_t detect() {
  uint32_t features = MHA_CPU_ARCH_X86_64 | MHA_CPU_SSE2;  // SSE2 is part of x86-64
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return features;
  const bool osxsave = (ecx >> 27) & 1u;
  const uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  const bool ymm_state = (xcr0 & 0x6) == 0x6;    // SSE and AVX state
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;  // + opmask, ZMM_Hi256, Hi16_ZMM
  const bool avx = ((ecx >> 28) & 1u) && ymm_state;
  if (avx) features |= MHA_CPU_AVX;
  if (avx && ((ecx >> 12) & 1u)) features |= MHA_CPU_FMA;
  if (avx && ((ecx >> 29) & 1u)) features |= MHA_CPU_F16C;

  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return features;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  if (avx && ((ebx >> 5) & 1u)) features |= MHA_CPU_AVX2;
  if (zmm_state && ((ebx >> 16) & 1u) && amx_bf16_usable(edx, xcr0)) {
    features |= MHA_CPU_AMX_BF16;
  }
  if (zmm_state && ((ebx >> 16) & 1u)) {
    features |= MHA_CPU_AVX512F;
    if ((ebx >> 28) & 1u) features |= MHA_CPU_AVX512CD;
    if ((ebx >> 17) & 1u) features |= MHA_CPU_AVX512DQ;
    if ((ebx >> 30) & 1u) features |= MHA_CPU_AVX512BW;
    if ((ebx >> 31) & 1u) features |= MHA_CPU_AVX512VL;
    const unsigned max_subleaf = eax;
    if (max_subleaf >= 1) {
      __cpuid_count(7, 1, eax, ebx, ecx, edx);
      if ((eax >> 5) & 1u) features |= MHA_CPU_AVX512BF16;
    }
  }
  return features;
}
#elif defined(__aarch64__)
uint32_t detect() {
  uint32_t features = MHA_CPU_ARCH_AARCH64;
  if (getauxval(AT_HWCAP) & HWCAP_ASIMD) features |= MHA_CPU_NEON;
  return features;
}
#else
uint32_t detect() {
  return 0;
}
#endif

}  // namespace

uint32_t cpu_features() {
  static const uint32_t features = detect();
  return features;
}

const CpuIdentity& cpu_identity() {
  static const CpuIdentity identity = [] {
    CpuIdentity id{};
#if defined(__x86_64__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return id;
    std::memcpy(id.vendor, &ebx, 4);
    std::memcpy(id.vendor + 4, &edx, 4);
    std::memcpy(id.vendor + 8, &ecx, 4);
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return id;
    const unsigned base_family = (eax >> 8) & 0xfu;
    const unsigned base_model = (eax >> 4) & 0xfu;
    id.family = base_family == 0xfu ? base_family + ((eax >> 20) & 0xffu) : base_family;
    id.model = base_family == 0x6u || base_family == 0xfu ? (((eax >> 16) & 0xfu) << 4) | base_model
                                                          : base_model;
#endif
    return id;
  }();
  return identity;
}

std::string feature_names(uint32_t features) {
  static const struct {
    uint32_t bit;
    const char* name;
  } kNames[] = {
      {MHA_CPU_ARCH_X86_64, "x86_64"},
      {MHA_CPU_ARCH_AARCH64, "aarch64"},
      {MHA_CPU_SSE2, "sse2"},
      {MHA_CPU_AVX, "avx"},
      {MHA_CPU_FMA, "fma"},
      {MHA_CPU_AVX2, "avx2"},
      {MHA_CPU_AVX512F, "avx512f"},
      {MHA_CPU_AVX512CD, "avx512cd"},
      {MHA_CPU_AVX512DQ, "avx512dq"},
      {MHA_CPU_AVX512BW, "avx512bw"},
      {MHA_CPU_AVX512VL, "avx512vl"},
      {MHA_CPU_AVX512BF16, "avx512bf16"},
      {MHA_CPU_F16C, "f16c"},
      {MHA_CPU_AMX_BF16, "amx-bf16"},
      {MHA_CPU_NEON, "neon"},
  };
  std::string names;
  uint32_t unnamed = features;
  for (const auto& entry : kNames) {
    if (!(features & entry.bit)) continue;
    unnamed &= ~entry.bit;
    if (!names.empty()) names += ' ';
    names += entry.name;
  }
  if (unnamed != 0) {
    char text[48];
    std::snprintf(text, sizeof text, "unknown feature bits 0x%x", unnamed);
    if (!names.empty()) names += ' ';
    names += text;
  }
  return names;
}

}  // namespace mha::rt
