// The module's products on the selected plugin's AMX tiles or with its bf16
// dot products (mha_bf16_gemm, plugin ABI 19; C in bf16: 20), where they
// compute what BLIS computes on the same values: weights that all hold bf16
// values (a bf16 checkpoint), products exact and summed in fp32 -- a bf16
// input as it is, and on the tiles an fp32 one (or the heads' concatenation,
// for the output projection) split exactly into three bf16 parts, each
// part's products taken.  Only the order of the sums differs (and subnormal
// inputs count as 0).  The tiles where the runtime granted them, the dot
// products where it chose them over widening (the plugin's bf16_dot 2 and
// 1: runtime/bf16_dot.cpp).
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

// One product C = A · wt (+ the bias row below wt, k rows down): `gemms`
// blocks of `rows` rows, A's rows lda elements apart (bf16 or fp32), C's
// ldc elements apart: fp32, or bf16 (c16; bf16 A only), each sum rounded
// once, its columns in slabs of c16_slab (0: one slab), c16_slab_stride
// elements apart (mha_bf16_gemm.run_to_bf16).
struct TileProduct {
  const void* a;
  bool a_bf16;  // else fp32, split into three bf16 parts (exactly)
  int64_t gemms, rows, lda, a_gemm_stride;
  float* c;
  int64_t ldc, c_gemm_stride;
  uint16_t* c16 = nullptr;  // C in bf16 instead of c
  int64_t c16_slab = 0, c16_slab_stride = 0;
};

// Which bf16 products the selected backend runs: "amx" (its tiles), "dot"
// (vdpbf16ps) or "none" (MHA_VERBOSE=2's bf16_gemm=).
const char* bf16_products_kind();

// Runs the product on the AMX tiles when they apply (see above): the
// selected backend has them, every weight of wt [k, n] (ld apart) is a bf16
// value, at least 32 rows and k >= 32 (smaller products are not worth the
// tiles).  Returns false, writing nothing, when they do not.
bool run_on_tiles(const mha_module& m, const TileProduct& t, const float* wt, int64_t ld, int64_t n,
                  int64_t k, bool bias, int32_t threads);

// dst rows (`width` apart) = x · wt (+ the bias row below wt): run_on_tiles
// for a bf16 or fp32 input with unit column stride.
bool project_bf16(const mha_module& m, const mha_tensor& x, const RowOrder& order, const float* wt,
                  int64_t ld, int64_t n, bool bias, float* dst, int64_t width, int32_t threads);
// The same into bf16 heads (the module's activations in bf16), a bf16
// input only: dst holds n / d slabs of [rows][d] values (rows: all of the
// product's, in `order`), each a head's projection -- the attention's
// [B, H, L, D] operands with whole rows back to back (head_major_view).
bool project_bf16_rounded(const mha_module& m, const mha_tensor& x, const RowOrder& order,
                          const float* wt, int64_t ld, int64_t n, bool bias, uint16_t* dst,
                          int64_t d, int32_t threads);

}  // namespace mha::rt
