// The reference loops of mha_bench: FMA throughput per ISA and read bandwidth.
//
// Each SIMD ISA's loop is peak_simd.cpp compiled with that ISA's flags (see
// CMakeLists.txt); mha_bench calls a loop only when the runtime reports the
// backend of the same ISA usable, so no instruction the CPU lacks runs.
#ifndef MHA_BENCH_PEAK_H
#define MHA_BENCH_PEAK_H

#include <cstddef>
#include <cstdint>

namespace mha_bench {

// One ISA's loop: run(steps, seed) performs steps * flops_per_step floating
// point operations on independent register accumulators and returns a value
// derived from all of them (so nothing can be optimised away).
struct FmaLoop {
  const char* isa;   // "scalar", "avx2", "avx512", "neon", ...: the backend whose peak it is
  const char* kind;  // "fma" (fp32 FMA), "bf16dot" (vdpbf16ps), "bf16amx" (tdpbf16ps on
                     // AMX tiles): peak/<kind>/<isa>
  double flops_per_step;
  float (*run)(int64_t steps, float seed);
};

// Baseline ISA (no special flags): 128-bit vectors of the GNU vector extension,
// a·b + c per element.  On x86-64 that is SSE2 mulps + addps (the baseline has
// no FMA); on aarch64 the compiler contracts it to NEON fmla.  This is the most
// a kernel built with default flags -- the scalar backend -- can reach.
extern const FmaLoop kFmaScalar;
// The SIMD instruction sets' loops (peak_simd.cpp, one per row of
// cmake/MhaIsa.cmake) are listed by the generated peak_loops.h.

// Sum of n floats (n a multiple of 64 · streams) with 128-bit vector loads
// and several independent accumulators, read as `streams` equal parts in
// step: a decode kernel reads K and V, often of several heads, at once, and
// one stream per core does not always show what memory can serve (on an
// Intel Xeon, family 6 model 207, one stream read 70-80 % of what eight did;
// bench/README.md).
float read_sum(const float* data, size_t n, int streams);

}  // namespace mha_bench

#endif  // MHA_BENCH_PEAK_H
