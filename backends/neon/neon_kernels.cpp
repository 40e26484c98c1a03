// The NEON (aarch64 Advanced SIMD) instantiation of the shared SIMD kernel.
#include "simd/kernels.hpp"

using Arch = xsimd::neon64;

size_t mha_simd_scratch_bytes(const mha_kernel_problem* problem, int64_t max_queries) {
  return mha_simd::scratch_bytes<Arch>(*problem, max_queries);
}

int mha_simd_attend(const mha_kernel_problem* problem, const mha_work_item* item, void* scratch) {
  return mha_simd::attend<Arch>(*problem, *item, scratch);
}
