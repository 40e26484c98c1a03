// Reading the environment variables mha understands, once.
#pragma once

namespace mha::rt {

// MHA_VERBOSE: 0 (default) silent, 1 detection and backend choice, 2 also one
// line per call.
int verbose_level();

// A positive integer from the environment variable, or 0 when it is unset or
// not a positive integer (OMP_NUM_THREADS="4,2" reads as 4).
int positive_env_int(const char* name);

}  // namespace mha::rt
