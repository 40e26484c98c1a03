// How many threads one call uses.
#pragma once

#include <cstdint>

namespace mha::rt {

// Precedence: mha_set_num_threads, then MHA_NUM_THREADS, then OMP_NUM_THREADS,
// then every core.
int32_t num_threads();
void set_num_threads(int32_t n);  // 0 returns to the environment's choice

}  // namespace mha::rt
