// The kernel entry points every SIMD plugin exports to its own table.
//
// They are defined once per plugin, in the translation unit compiled with the
// plugin's ISA flags (backends/<isa>/<isa>_kernels.cpp), by instantiating the
// shared templates of this folder for that ISA.  The table that points at them
// (plugin_table.hpp) is built in a file compiled without ISA flags, so that the
// runtime can read it on any CPU.
#pragma once

#include <mha/plugin_abi.h>

#include <cstddef>
#include <cstdint>

size_t mha_simd_scratch_bytes(const mha_kernel_problem* problem, int64_t max_queries);
int mha_simd_attend(const mha_kernel_problem* problem, const mha_work_item* item, void* scratch);
size_t mha_simd_backward_scratch_bytes(const mha_backward_problem* problem);
int mha_simd_backward(const mha_backward_problem* problem, const mha_backward_item* item,
                      void* scratch);
void mha_simd_packed_gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                          const float* b, float beta, float* c, int64_t rs_c, int64_t cs_c,
                          const float* next_a, const float* next_b);
// The module's bf16 matrix products (mha_bf16_gemm): on AMX tiles in the
// plugins that build them, refused (run returns -1) in the others.
size_t mha_simd_bf16_gemm_packed_bytes(int64_t n, int64_t k);
void mha_simd_bf16_gemm_pack(int64_t n, int64_t k, const float* wt, int64_t ld, void* packed);
size_t mha_simd_bf16_gemm_scratch_bytes(int64_t k);
int mha_simd_bf16_gemm_run(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                           const void* packed, const float* bias, float* c, int64_t ldc,
                           void* scratch);
size_t mha_simd_bf16_gemm_split_scratch_bytes(int64_t k);
int mha_simd_bf16_gemm_run_split(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                                 const void* packed, const float* bias, float* c, int64_t ldc,
                                 void* scratch);
int mha_simd_bf16_gemm_run_to_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                                   const void* packed, const float* bias, uint16_t* c, int64_t ldc,
                                   int64_t c_slab, int64_t c_slab_stride, void* scratch);

// n fp32 values rounded to bf16 or f16 (mha_plugin.narrow_floats).
void mha_simd_narrow_floats(const float* src, int64_t n, void* dst, int32_t dtype);

// The tiles this plugin chose for the machine's caches: written once by the
// table's choose_tiles (plugin_table.hpp) when the runtime loads the plugin,
// before any kernel runs; the kernels only read them.  Defined in the table's
// translation unit.
struct mha_simd_tiles {
  int32_t key_tile;            // prefill keys per tile, a multiple of kScoreKeys
  int32_t amx_key_tile;        // the same on AMX tiles (bf16_dot 2), a multiple of 32
  int64_t l2_bytes;            // the L2 the decode's token-major tiles fill (0: unknown)
  int64_t pv_run_bytes;        // prefill: V rows one P·V run keeps in the L1 (0: whole key tiles)
  int32_t decode_key_streams;  // 1, or Blocking's kDecodeKeyStreams (row_kernels.hpp)
  int32_t bf16_dot;            // bf16 x bf16 products: 0 widened, 1 the bf16 dot-product
                               // path, 2 the same on AMX tiles (paths.hpp)
  int64_t l1d_bytes;           // the L1d (0: unknown): the module's dot-product blocks
};
const mha_simd_tiles& mha_simd_chosen_tiles();
