// The module's input projections as bf16 products on the selected plugin's
// AMX tiles (mha_bf16_gemm, plugin ABI 19), where they compute what BLIS
// computes on the same values: a bf16 input, weights that all hold bf16
// values (a bf16 checkpoint), products exact and summed in fp32.  Only the
// order of the sums differs (and subnormal inputs count as 0).
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "projections.h"
#include "scratch.h"

namespace mha::rt {

// A module's weights packed for one plugin's bf16 products, built on first
// use (under the lock: forward calls may run concurrently) and dropped by
// mha_module_set_weight.
struct Bf16WeightCache {
  struct Packed {
    const void* plugin_gemm = nullptr;  // the mha_bf16_gemm it was packed for
    const float* wt = nullptr;          // the module's transposed weights it packs
    int64_t n = 0, k = 0;
    bool exact = false;          // every weight a bf16 value (else never used)
    AlignedBuffer panels;        // owns the packed panels
    const void* data = nullptr;  // them, once packed
  };
  std::mutex mutex;
  std::vector<std::unique_ptr<Packed>> entries;
  void clear() {
    const std::lock_guard<std::mutex> lock(mutex);
    entries.clear();
  }
};

// dst rows (`width` apart) = x · wt (+ the bias row below wt) on the AMX
// tiles, when they apply (see above; k a multiple of 32, whole steps); returns
// false, writing nothing, when they do not.
bool project_bf16(const mha_module& m, const mha_tensor& x, const RowOrder& order, const float* wt,
                  int64_t ld, int64_t n, bool bias, float* dst, int64_t width, int32_t threads);

}  // namespace mha::rt
