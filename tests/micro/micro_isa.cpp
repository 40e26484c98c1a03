// The micro-kernels of one ISA (MHA_MICRO_ARCH, an xsimd architecture) behind
// the function pointers of micro_kernels.h, as MHA_MICRO_NAME().  Compiled
// with that ISA's flags; the table is a constant, so taking it runs no ISA
// instruction.
#include <mha/mha.h>

#include "micro_kernels.h"
#include "simd/amx_gemm.hpp"
#include "simd/blocking.hpp"
#include "simd/convert.hpp"
#include "simd/dot_gemm.hpp"
#include "simd/microkernels.hpp"
#include "simd/packed_gemm.hpp"
#include "simd/row_kernels.hpp"
#include "simd/score_variants.hpp"
#include "simd/tile_tools.hpp"

namespace {

using Arch = MHA_MICRO_ARCH;
using Blk = mha_simd::Blocking<Arch>;
constexpr int kStride = Blk::kQueryTile;

void score(int mode, int nv, int nk, const float* qt, const float* k_rows, int64_t k_stride,
           int64_t d, float* scores, float* row_max, float* tile_sum) {
  mha_simd::with_count<Blk::kScoreQueryVectors>(nv, [&](auto NV) {
    mha_simd::with_count<Blk::kScoreKeys>(nk, [&](auto NK) {
      constexpr int kNV = decltype(NV)::value, kNK = decltype(NK)::value;
      if (mode == 2) {
        mha_simd::score_block<Arch, kStride, kNV, kNK, true, false, true>(
            qt, k_rows, k_stride, d, scores, row_max, tile_sum);
      } else if (mode == 1) {
        mha_simd::score_block<Arch, kStride, kNV, kNK, true>(qt, k_rows, k_stride, d, scores,
                                                             row_max, tile_sum);
      } else {
        mha_simd::score_block<Arch, kStride, kNV, kNK, false>(qt, k_rows, k_stride, d, scores,
                                                              row_max, tile_sum);
      }
    });
  });
}

void pv(int join, int nr, int nc, const float* probs, const float* alpha, const float* v_rows,
        int64_t v_stride, int keys, float* acc, int64_t acc_stride) {
  using mha_simd::PvJoin;
  mha_simd::with_count<Blk::kPvRows>(nr, [&](auto NR) {
    mha_simd::with_count<Blk::kPvVectors>(nc, [&](auto NC) {
      constexpr int kNR = decltype(NR)::value, kNC = decltype(NC)::value;
      if (join == 1) {
        mha_simd::pv_block<Arch, kStride, kNR, kNC, PvJoin::kOverwrite>(
            probs, alpha, v_rows, v_stride, keys, acc, acc_stride);
      } else if (join == 2) {
        mha_simd::pv_block<Arch, kStride, kNR, kNC, PvJoin::kAdd>(probs, alpha, v_rows, v_stride,
                                                                  keys, acc, acc_stride);
      } else {
        mha_simd::pv_block<Arch, kStride, kNR, kNC>(probs, alpha, v_rows, v_stride, keys, acc,
                                                    acc_stride);
      }
    });
  });
}

void rows_scores(int rows, const float* q, int64_t dp, const float* k_rows, int64_t k_stride,
                 int keys, float* s, int64_t s_stride, bool in_cache, bool streamed) {
  mha_simd::with_count<Blk::kDecodeRows>(rows, [&](auto n) {
    mha_simd::rows_scores<Arch, MHA_DTYPE_F32, decltype(n)::value>(
        q, dp, mha_simd::StridedRows<float>{k_rows, k_stride}, keys, s, s_stride,
        streamed ? 0 : mha_simd::kRowsAheadMax, in_cache, streamed);
  });
}

void rows_pv(int rows, const float* const* probs, const float* alpha, const float* v_rows,
             int64_t v_stride, int keys, int64_t dvp, float* const* acc, float* total,
             bool streamed) {
  mha_simd::with_count<Blk::kDecodeRows>(rows, [&](auto n) {
    mha_simd::rows_pv<Arch, MHA_DTYPE_F32, decltype(n)::value>(
        probs, alpha, mha_simd::StridedRows<float>{v_rows, v_stride}, keys, dvp, acc, total,
        streamed ? 0 : mha_simd::kRowsAheadMax, true, streamed);
  });
}

void narrow(int32_t dtype, const float* x, uint16_t* out) {
  const auto v = xsimd::batch<float, Arch>::load_unaligned(x);
  if (dtype == MHA_DTYPE_BF16) {
    mha_simd::store_narrow<Arch, MHA_DTYPE_BF16>(out, v);
  } else {
    mha_simd::store_narrow<Arch, MHA_DTYPE_F16>(out, v);
  }
}

void widen(int32_t dtype, const void* in, float* out) {
  mha_simd::with_dtype(dtype, [&](auto dt) {
    constexpr int32_t kDtype = decltype(dt)::value;
    mha_simd::load_widen<Arch, kDtype>(static_cast<const mha_simd::element_t<kDtype>*>(in))
        .store_unaligned(out);
  });
}

void softcap(float* s, int64_t n, float cap) {
  mha_simd::softcap_scores<Arch>(s, n, cap);
}

using Tile = mha_simd::PackedGemmTile<Arch>;
using GemmFn = void (*)(int64_t, int64_t, int64_t, float, const float*, const float*, float, float*,
                        int64_t, int64_t, const float*, const float*);
constexpr GemmFn gemm_of() {
  if constexpr (Tile::kOffered) {
    return mha_simd::packed_gemm<Arch>;
  } else {
    return nullptr;
  }
}

#if defined(MHA_HAVE_AMX_TILES)
using AmxGemm = mha_simd::AmxGemm<Arch>;
constexpr auto kBf16PackedBytes = AmxGemm::packed_bytes;
constexpr auto kBf16Pack = AmxGemm::pack;
constexpr auto kBf16ScratchBytes = AmxGemm::scratch_bytes;
constexpr auto kBf16Gemm = AmxGemm::run;
constexpr auto kBf16SplitScratchBytes = AmxGemm::split_scratch_bytes;
constexpr auto kBf16GemmSplit = AmxGemm::run_split;
constexpr auto kBf16GemmToBf16 = AmxGemm::run_to_bf16;
constexpr auto kBf16DotScratchBytes = mha_simd::DotGemm<Arch>::scratch_bytes;
constexpr auto kBf16DotGemm = mha_simd::DotGemm<Arch>::run;
#else
constexpr size_t (*kBf16PackedBytes)(int64_t, int64_t) = nullptr;
constexpr void (*kBf16Pack)(int64_t, int64_t, const float*, int64_t, void*) = nullptr;
constexpr size_t (*kBf16ScratchBytes)(int64_t, int64_t) = nullptr;
constexpr void (*kBf16Gemm)(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const void*,
                            const float*, float*, int64_t, void*, int64_t) = nullptr;
constexpr size_t (*kBf16SplitScratchBytes)(int64_t, int64_t) = nullptr;
constexpr void (*kBf16GemmSplit)(int64_t, int64_t, int64_t, const float*, int64_t, const void*,
                                 const float*, float*, int64_t, void*, int64_t) = nullptr;
constexpr void (*kBf16GemmToBf16)(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const void*,
                                  const float*, uint16_t*, int64_t, int64_t, int64_t, void*,
                                  int64_t) = nullptr;
constexpr size_t (*kBf16DotScratchBytes)(int64_t, int64_t) = nullptr;
constexpr void (*kBf16DotGemm)(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const void*,
                               const float*, float*, uint16_t*, int64_t, int64_t, int64_t, void*,
                               int64_t, int64_t) = nullptr;
#endif

}  // namespace

extern "C" const mha_micro::MicroKernels* MHA_MICRO_NAME() {
  static const mha_micro::MicroKernels kernels = {
      MHA_MICRO_BACKEND,
      static_cast<int>(xsimd::batch<float, Arch>::size),
      kStride,
      Blk::kScoreQueryVectors,
      Blk::kScoreKeys,
      Blk::kPvRows,
      Blk::kPvVectors,
      score,
      pv,
      Blk::kDecodeRows,
      rows_scores,
      rows_pv,
      narrow,
      widen,
      softcap,
      Tile::kMr,
      Tile::kNr,
      Tile::kRowMajor ? 1 : 0,
      gemm_of(),
      kBf16PackedBytes,
      kBf16Pack,
      kBf16ScratchBytes,
      kBf16Gemm,
      kBf16SplitScratchBytes,
      kBf16GemmSplit,
      kBf16GemmToBf16,
      kBf16DotScratchBytes,
      kBf16DotGemm,
  };
  return &kernels;
}
