// The data caches of the CPU, as one core sees them, for the plugins' tile
// sizes (mha_plugin::choose_tiles).  Compiled without ISA flags.
#pragma once

#include <mha/plugin_abi.h>

namespace mha::rt {

// Detected once: sysconf (glibc reads CPUID leaves 4 / 0x8000001D on x86),
// else sysfs (/sys/devices/system/cpu/cpu0/cache: aarch64's glibc reports 0),
// with any size MHA_CACHE_SIZES gives (e.g. "l1d=32K,l2=1M") taking
// precedence: containers whose sysfs lies, and tests of other machines' tiles.
// A size nothing reports is 0.  A malformed MHA_CACHE_SIZES is ignored as a
// whole, with a warning on stderr (as MHA_NUM_THREADS is).
const mha_cache_sizes& cpu_caches();

}  // namespace mha::rt
