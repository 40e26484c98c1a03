// The SIMD micro-kernels of one instruction set, behind plain function
// pointers, for tests/micro/test_micro.cpp: micro_isa.cpp instantiates them
// once per SIMD row of cmake/MhaIsa.cmake, compiled with that row's flags.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mha_micro {

struct MicroKernels {
  const char* name;    // the backend's name ("avx2")
  int lanes;           // floats per vector
  int stride;          // the prefill tile's row stride (its query tile)
  int max_nv, max_nk;  // score block: query vectors x keys
  int max_nr, max_nc;  // P·V block: rows x vectors of Dv
  // score_block with nv vectors and nk keys; mode 0 plain, 1 fused (kFused),
  // 2 fused and setting row_max (kSetMax).
  void (*score)(int mode, int nv, int nk, const float* qt, const float* k_rows, int64_t k_stride,
                int64_t d, float* scores, float* row_max, float* tile_sum);
  // pv_block with nr rows and nc vectors; join: 0 rescale, 1 overwrite, 2 add
  // (mha_simd::PvJoin).
  void (*pv)(int join, int nr, int nc, const float* probs, const float* alpha, const float* v_rows,
             int64_t v_stride, int keys, float* acc, int64_t acc_stride);
  // rows_scores and rows_pv of the decode layout for 1 <= rows <= max_rows
  // query rows at once (q: rows x dp floats; total: rows x dvp floats of
  // aligned scratch); rows_scores' in_cache: rows read into cache before
  // (keys in step); streamed: the keys read as key streams (one or two rows, where
  // the ISA has them; no software prefetch).
  int max_rows;
  void (*rows_scores)(int rows, const float* q, int64_t dp, const float* k_rows, int64_t k_stride,
                      int keys, float* s, int64_t s_stride, bool in_cache, bool streamed);
  void (*rows_pv)(int rows, const float* const* probs, const float* alpha, const float* v_rows,
                  int64_t v_stride, int keys, int64_t dvp, float* const* acc, float* total,
                  bool streamed);
  // store_narrow: `lanes` floats rounded to BF16 or F16 bits.
  void (*narrow)(int32_t dtype, const float* x, uint16_t* out);
  // load_widen: `lanes` BF16 or F16 bits, or int8 values, as floats.
  void (*widen)(int32_t dtype, const void* in, float* out);
  // softcap_scores: s <- cap · tanh(s / cap) over n floats (a multiple of
  // `lanes`, aligned).
  void (*softcap)(float* s, int64_t n, float cap);
  // packed_gemm (the module's micro-kernel in BLIS's framework, plugin ABI
  // 14) and its tile, or gemm == nullptr where the ISA offers none.
  int gemm_mr, gemm_nr, gemm_row_major;
  void (*gemm)(int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b,
               float beta, float* c, int64_t rs_c, int64_t cs_c, const float* next_a,
               const float* next_b);
  // The module's bf16 products on AMX tiles (amx_gemm.hpp, plugin ABI 19 and 20),
  // or bf16_gemm == nullptr where the ISA builds none.  Only to be run where
  // the process may use AMX (mha_cpu_features() names amx-bf16).
  size_t (*bf16_packed_bytes)(int64_t n, int64_t k);
  void (*bf16_pack)(int64_t n, int64_t k, const float* wt, int64_t ld, void* packed);
  size_t (*bf16_scratch_bytes)(int64_t k, int64_t l2_bytes);
  void (*bf16_gemm)(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                    const void* packed, const float* bias, float* c, int64_t ldc, void* scratch,
                    int64_t l2_bytes);
  // The same with fp32 rows of A, split into three bf16 parts.
  size_t (*bf16_split_scratch_bytes)(int64_t k, int64_t l2_bytes);
  void (*bf16_gemm_split)(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                          const void* packed, const float* bias, float* c, int64_t ldc,
                          void* scratch, int64_t l2_bytes);
  // bf16_gemm with C in bf16 (each sum rounded once), its columns in slabs
  // of c_slab, c_slab_stride apart.
  void (*bf16_gemm_to_bf16)(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                            const void* packed, const float* bias, uint16_t* c, int64_t ldc,
                            int64_t c_slab, int64_t c_slab_stride, void* scratch, int64_t l2_bytes);
  // The same products with AVX512_BF16 dot products (dot_gemm.hpp: where the
  // runtime chose them over the tiles, on the same packed weights), C fp32
  // (c) or bf16 (c16, in slabs); any CPU with AVX512_BF16 may run them.
  size_t (*bf16_dot_scratch_bytes)(int64_t k, int64_t l2_bytes);
  void (*bf16_dot_gemm)(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                        const void* packed, const float* bias, float* c, uint16_t* c16, int64_t ldc,
                        int64_t c_slab, int64_t c_slab_stride, void* scratch, int64_t l1d_bytes,
                        int64_t l2_bytes);
};

}  // namespace mha_micro
