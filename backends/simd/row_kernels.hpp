// The decode layout's micro-kernels: one query row against a tile of keys,
// vector lanes along the head dimension.  Decoding is bound by reading K and
// V, so these are written for the memory system first: every K and V row is
// read once per tile, in address order, with the accumulators in registers
// (a loop bound known only at run time would keep them in memory).  K and V
// rows are of dtype kKv (convert.hpp), widened in registers as they are read.
// tests/micro checks each against plain loops on every ISA.
#pragma once

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd/blocking.hpp"
#include "simd/convert.hpp"
#include "simd/row_sums.hpp"

namespace mha_simd {

// Rows this far ahead of the one being read are requested from memory (the
// hardware prefetchers see one row at a time; a row of 256 B at D = 128 in
// bf16 is four lines).
constexpr int kRowsAhead = 16;

template <class T>
inline void prefetch_row(const T* row, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < elements * static_cast<int64_t>(sizeof(T)); byte += 64) {
    __builtin_prefetch(p + byte, 0, 0);
  }
}

// s[j] = q · K[j] for `keys` keys; q holds dp floats (a multiple of W,
// zero-padded), s room for whole vectors.  Each key's row is read whole, in
// address order (two partial sums hide the FMA latency; the next keys' rows
// overlap it), and W keys share one horizontal reduction.  The last group
// reads its last key again in place of the missing ones, so every group runs
// the same register-resident code; s beyond `keys` is left unspecified.
// (row_scores and row_pv are not inlined: the decode kernel's two passes,
// base-2 and raw units, share one copy.  The release build kept them out of
// line anyway; under ASan this did not measurably shorten the backend's
// compile, which the next change must look at.)
template <class Arch, int32_t kKv = MHA_DTYPE_F32>
[[gnu::noinline]] void row_scores(const float* q, int64_t dp, const element_t<kKv>* k_rows,
                                  int64_t k_stride, int keys, float* s) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  for (int j0 = 0; j0 < keys; j0 += W) {
    const int last = std::min(W, keys - j0) - 1;
    B acc[W];
    for (int i = 0; i < W; ++i) {
      const element_t<kKv>* k = k_rows + (j0 + std::min(i, last)) * k_stride;
      prefetch_row(k + kRowsAhead * k_stride, dp);
      B a0(0.0f), a1(0.0f);
      int64_t x = 0;
      for (; x + 2 * W <= dp; x += 2 * W) {
        a0 = xsimd::fma(B::load_aligned(q + x), load_widen<Arch, kKv>(k + x), a0);
        a1 = xsimd::fma(B::load_aligned(q + x + W), load_widen<Arch, kKv>(k + x + W), a1);
      }
      if (x < dp) a0 = xsimd::fma(B::load_aligned(q + x), load_widen<Arch, kKv>(k + x), a0);
      acc[i] = a0 + a1;
    }
    sums_of<Arch>(acc).store_aligned(s + j0);
  }
}

// Σ_j p_j · V_j over keys [j0, j1) for NB vectors of Dv starting at v_rows,
// into o (registers: the caller's loops are unrolled over NB); `prefetch`
// elements of the row kRowsAhead ahead are requested too.
template <class Arch, int32_t kKv, int NB>
inline void pv_run(const float* probs, int j0, int j1, const element_t<kKv>* v_rows,
                   int64_t v_stride, int64_t prefetch, xsimd::batch<float, Arch> (&o)[NB]) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  for (int c = 0; c < NB; ++c) o[c] = B(0.0f);
  for (int j = j0; j < j1; ++j) {
    const B pj(probs[j]);
    const element_t<kKv>* v = v_rows + j * v_stride;
    if (prefetch > 0) prefetch_row(v + kRowsAhead * v_stride, prefetch);
    for (int c = 0; c < NB; ++c) o[c] = xsimd::fma(pj, load_widen<Arch, kKv>(v + c * W), o[c]);
  }
}

// Calls f(std::integral_constant<int, n>{}) for the largest power of two n
// <= min(count, N) (N a power of two, count >= 1) and returns n: the column
// blocks of a row are compiled for log2(N) + 1 widths only.
template <int N, class F>
inline int with_block_of(int count, F&& f) {
  if constexpr (N > 1) {
    if (count < N) return with_block_of<N / 2>(count, f);
  }
  f(std::integral_constant<int, N>{});
  return N;
}

// acc = acc · alpha + Σ_j p_j · V_j for one row of dvp floats.  Summed in two
// levels -- runs of kPvRun keys from zero, then the runs into the tile's total
// -- so that rounding grows with kPvRun + keys / kPvRun rather than with the
// number of keys (which matters when many keys are alike and their rounding
// errors do not cancel).
//
// When the row is one block (a power of two of vectors within the register
// budget, kDecodePvVectors), one pass over the keys keeps the totals in
// registers.  Otherwise the row is cut into column blocks *inside* each run,
// not across the whole tile: the run's V rows (kPvRun of them) stay in L1
// while its blocks are summed, so memory sees one stream of rows in address
// order instead of one strided pass per block; the totals then live in
// `total` (dvp floats of scratch).
template <class Arch, int32_t kKv = MHA_DTYPE_F32>
[[gnu::noinline]] void row_pv(const float* probs, int keys, float alpha,
                              const element_t<kKv>* v_rows, int64_t v_stride, int64_t dvp,
                              float* acc, float* total) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  constexpr int kPvRun = 32;
  constexpr int NC = Blocking<Arch>::kDecodePvVectors;
  static_assert((NC & (NC - 1)) == 0, "column blocks are powers of two");
  const int vectors = static_cast<int>(dvp / W);
  const B a(alpha);
  if (vectors <= NC && (vectors & (vectors - 1)) == 0) {
    with_block_of<NC>(vectors, [&](auto nb) {
      constexpr int NB = decltype(nb)::value;
      B sum[NB];
      for (int c = 0; c < NB; ++c) sum[c] = B(0.0f);
      for (int j0 = 0; j0 < keys; j0 += kPvRun) {
        B o[NB];
        pv_run<Arch, kKv, NB>(probs, j0, std::min(keys, j0 + kPvRun), v_rows, v_stride, dvp, o);
        for (int c = 0; c < NB; ++c) sum[c] += o[c];
      }
      for (int c = 0; c < NB; ++c) {
        xsimd::fma(B::load_aligned(acc + c * W), a, sum[c]).store_aligned(acc + c * W);
      }
    });
    return;
  }
  std::fill(total, total + dvp, 0.0f);
  for (int j0 = 0; j0 < keys; j0 += kPvRun) {
    const int j1 = std::min(keys, j0 + kPvRun);
    for (int c0 = 0; c0 < vectors;) {
      c0 += with_block_of<NC>(vectors - c0, [&](auto nb) {
        constexpr int NB = decltype(nb)::value;
        B o[NB];
        pv_run<Arch, kKv, NB>(probs, j0, j1, v_rows + c0 * W, v_stride, c0 == 0 ? dvp : 0, o);
        float* t = total + c0 * W;
        for (int c = 0; c < NB; ++c) (B::load_aligned(t + c * W) + o[c]).store_aligned(t + c * W);
      });
    }
  }
  for (int64_t x = 0; x < dvp; x += W) {
    xsimd::fma(B::load_aligned(acc + x), a, B::load_aligned(total + x)).store_aligned(acc + x);
  }
}

}  // namespace mha_simd
