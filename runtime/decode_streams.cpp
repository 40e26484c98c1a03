#include "decode_streams.h"

#include <mha/plugin_abi.h>

#include <cstdio>
#include <cstring>

#include "cpu_features.h"
#include "env.h"

namespace mha::rt {
namespace {

// Whether this CPU's hardware prefetchers bring one stream of rows at well
// below what several streams get, so that a decode over one row per KV head
// (little arithmetic per row) reads faster as several streams.  Measured
// (docs/kernel-design.md, "Decode on Zen 3: key streams"; in-process A/B of
// the AVX2 plugin with four streams against one, S3 at one thread):
//   Zen 3 (AMD family 25 model 1): one stream 13-14 GB/s, four 19-22;
//     S3 0.81 of the time with four streams.
//   Zen 5 (AMD family 26 model 2): four streams 1.6x the time (1.3x with
//     their rows requested ahead as well); the AVX-512 plugin's S3 1.3x.
// So four streams on AMD's Zen 1 to Zen 3 (families 23 and 25 without
// AVX-512, as Zen 4 in family 25 has it; Hygon's family 24 is Zen 1) --
// Zen 1 and 2 not measured (issue 17's Zen 1 read S3 at 57 % of the probe,
// as one stream on Zen 3 did) -- and one
// stream elsewhere, where the earlier sessions' Intel and Zen 4 / Zen 5
// figures were taken.
int32_t detect() {
  const CpuIdentity& cpu = cpu_identity();
  const bool amd = std::strcmp(cpu.vendor, "AuthenticAMD") == 0;
  const bool hygon = std::strcmp(cpu.vendor, "HygonGenuine") == 0;
  if (!amd && !hygon) return 1;
  const unsigned family = cpu.family;
  const bool zen_1_to_3 =
      family == 23 || family == 24 || (family == 25 && (cpu_features() & MHA_CPU_AVX512F) == 0);
  return zen_1_to_3 ? 4 : 1;
}

}  // namespace

int32_t decode_key_streams() {
  static const int32_t streams = [] {
    const int given = positive_env_int("MHA_DECODE_STREAMS");
    if (given == 1 || given == 4) return static_cast<int32_t>(given);
    // The plugins have one stream or four (AVX2's): a count of 2 would have
    // been taken as four, without a word.
    if (given > 0) {
      std::fprintf(stderr, "mha: ignoring MHA_DECODE_STREAMS=%d (it must be 1 or 4)\n", given);
    }
    return detect();
  }();
  return streams;
}

}  // namespace mha::rt
