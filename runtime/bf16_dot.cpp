#include "bf16_dot.h"

#include <mha/plugin_abi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu_features.h"
#include "error.h"

namespace mha::rt {
namespace {

// Whether this CPU runs vdpbf16ps (two bf16 products added to each fp32 lane)
// at a higher FLOP rate than fp32 FMAs, so that the bf16 path -- products on
// bf16 pairs, P rounded to bf16 -- beats widening bf16 to fp32.  Measured with
// mha_bench's peak loops (12 independent chains each) and the kernels on the
// same data (docs/kernel-design.md, "bf16 dot products: a CPU's matter"):
//   Zen 4 (AMD family 25): vdpbf16ps 2.0x the FMA's FLOP rate; S1:bf16
//     1.79x the fp32 speed.
//   Zen 5 (AMD family 26 model 2): S1:bf16 in 17.0-17.1 ms, about 1.7x the
//     fp32 speed.
//   Intel Xeon (family 6 model 167, AVX512_BF16 and AMX): vdpbf16ps 0.52x
//     the FMA's FLOP rate (118 against 225 GFLOP/s on one core); S1:bf16
//     on the bf16 path 0.65x the speed of the same bf16 data widened.
// Intel's cores with AVX512_BF16 (Cooper Lake, Sapphire, Emerald and Granite
// Rapids) issue it at that rate, so bf16 is widened there; AMD's Zen 4 and
// Zen 5 and any other CPU with the instructions take them.
// Where AMX tiles with bf16 products are usable (Sapphire Rapids and later,
// with the OS's support and this process's permission: MHA_CPU_AMX_BF16),
// the same products go to the tiles (2): tdpbf16ps measured 3.06 TFLOP/s on
// one core of the Intel model 167, 13.6x the FMA loop's 225 GFLOP/s
// (docs/kernel-design.md, "bf16 on AMX tiles").
int32_t detect() {
  if (cpu_features() & MHA_CPU_AMX_BF16) return 2;
  return std::strcmp(cpu_identity().vendor, "GenuineIntel") == 0 ? 0 : 1;
}

}  // namespace

int32_t bf16_dot_products() {
  static const int32_t on = [] {
    const char* given = std::getenv("MHA_BF16_DOT");
    if (given == nullptr || *given == '\0') return detect();
    if (std::strcmp(given, "0") == 0 || std::strcmp(given, "1") == 0) return given[0] - '0';
    if (std::strcmp(given, "2") == 0) {
      if (cpu_features() & MHA_CPU_AMX_BF16) return 2;
      std::fprintf(stderr,
                   "mha: ignoring MHA_BF16_DOT=2 (AMX tiles with bf16 products are not usable "
                   "here: the CPU, the OS or the process's permission lacks them)\n");
      return detect();
    }
    std::fprintf(stderr, "mha: ignoring MHA_BF16_DOT=\"%s\" (it must be 0, 1 or 2)\n",
                 printable(given).c_str());
    return detect();
  }();
  return on;
}

}  // namespace mha::rt
