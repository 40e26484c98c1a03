// Which CPU the benchmark figures come from, as lscpu names it.
#pragma once

#include <string>

namespace mha_bench {

// The first processor's entry of /proc/cpuinfo: on x86 "<model name> (family
// F, model M)" (the numbers lscpu prints: the same "AMD EPYC" can be a Zen 4 or
// a Zen 5; python/bench/overhead.py prints the same words), on Arm "implementer
// 0x.. part 0x.."; "unknown" where there is none.
std::string host_cpu();

}  // namespace mha_bench
