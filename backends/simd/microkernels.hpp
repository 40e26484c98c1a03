// The register-blocked micro-kernels of the prefill layout, as free templates
// over the xsimd architecture: score and P·V blocks with lanes along the
// queries of a tile whose rows are kStride floats apart (the decode layout's
// are in row_kernels.hpp).  Each reads and writes plain arrays, so any kernel
// -- a backward pass too -- can call them; tests/micro checks each against
// plain loops on every ISA.
#pragma once

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>

#include "simd/blocking.hpp"
#include "simd/exp2.hpp"

namespace mha_simd {

// The fused path's bound (base 2): a key tile whose probabilities against
// the stale maximum sum to more than 2^kMaxGrowth is computed again with the
// two-pass path.  Each probability is at most the sum, so none exceeds
// 2^24: the sums and P·V stay far from overflow (a V that still overflows
// sends the tile to the careful path).
constexpr float kMaxGrowth = 24.0f;

// scores[j][q] = Σ_x qt[x][q] · K[j][x] for NV query vectors (lanes) and NK
// keys, qt and scores with rows kStride floats apart.
// kFused: store 2^(score - row_max) instead and add them to tile_sum (the
// caller checks the tile's sums against kMaxGrowth).  The maximum is taken
// off in the first FMA (score - row_max accumulates from q0·k0 - row_max),
// so the epilogue is only the exps: on CPUs whose 512-bit operations share
// two ports with the FMAs (Intel), every operation there costs products.
// kBounded (with kFused): a tile crossing the queries' limits (a causal
// diagonal, a window's edge); key `key0 + n` of the tile counts for the lanes
// whose bounds (visibility_bounds: each lane's first and last visible key)
// hold it, and is 0 for the others -- masked by lane, not element by element.
// kSetMax (with kFused, not kBounded): a query tile's first key group, before
// any maximum is known: row_max becomes each lane's maximum over these NK
// keys, and the probabilities are taken against it.  It is at most the row's
// maximum, so no probability underflows that would not against the true one;
// the caller's check on the tile's sums catches keys far above it.
template <class Arch, int kStride, int NV, int NK, bool kFused, bool kBounded = false,
          bool kSetMax = false>
inline void score_block(const float* qt, const float* k_rows, int64_t k_stride, int64_t d,
                        float* scores, float* row_max, float* tile_sum,
                        const float* first_key = nullptr, const float* last_key = nullptr,
                        int key0 = 0) {
  static_assert(!kSetMax || (kFused && !kBounded), "kSetMax is a fused, unbounded block");
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  const float* k[NK];
  for (int n = 0; n < NK; ++n) k[n] = k_rows + n * k_stride;
  // The first index initialises the accumulators (d >= 1): no zeroing, and no
  // path on which they live in memory.
  B acc[NV][NK];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const B q = B::load_aligned(qt + v * W);
    if constexpr (kFused && !kSetMax) {
      const B m = B::load_aligned(row_max + v * W);
#pragma GCC unroll 8
      for (int n = 0; n < NK; ++n) acc[v][n] = xsimd::fms(q, B(k[n][0]), m);
    } else {
#pragma GCC unroll 8
      for (int n = 0; n < NK; ++n) acc[v][n] = q * B(k[n][0]);
    }
  }
  // The next key group's rows come from L2 while this one computes (measured:
  // the score phase about 5 % faster against the unchanged P·V phase).
  // Spread over the reduction, line l of every next row at step 4 l + 1,
  // rather than all at the start (24 requests at D 64, 48 at D 128, more than
  // the L1's miss buffers): Zen 5, in-process A/B, S2 0.985 (1.017 with the
  // builds swapped), S9 0.981, S4 0.992, S1 0.997, S6 1.002; AVX2 S2 0.979,
  // S1 0.989.
  const int64_t lines = (d * 4 + 63) / 64;
  const auto step = [&](int64_t x) __attribute__((always_inline)) {
    B q[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) q[v] = B::load_aligned(qt + x * kStride + v * W);
#pragma GCC unroll 8
    for (int n = 0; n < NK; ++n) {
      const B kb(k[n][x]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[v][n] = xsimd::fma(q[v], kb, acc[v][n]);
    }
  };
  const auto fetch_line = [&](int64_t line) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int n = 0; n < NK; ++n) {
      __builtin_prefetch(reinterpret_cast<const char*>(k[n] + NK * k_stride) + line * 64, 0, 3);
    }
  };
  // Blocking::kScoreStepsPerTurn steps a turn, one test for a prefetch
  // before them (the turns of 4 steps start at x = 4 l + 1).
  constexpr int kTurn = Blocking<Arch>::kScoreStepsPerTurn;
  static_assert(kTurn == 1 || kTurn == 4, "a turn of one step, or of the 4 a line takes");
  int64_t x = 1;
  if constexpr (kTurn == 4) {
    for (; x + 4 <= d; x += 4) {
      if ((x >> 2) < lines) fetch_line(x >> 2);
      step(x);
      step(x + 1);
      step(x + 2);
      step(x + 3);
    }
  }
  for (; x < d; ++x) {
    if ((x & 3) == 1 && (x >> 2) < lines) fetch_line(x >> 2);
    step(x);
  }
  if constexpr (!kFused) {
    // Unrolled, so that acc stays in registers: a loop GCC leaves rolled
    // here keeps acc on the stack, spilled around the prefetches and stored
    // twice at the end (72 extra stores per block: S4's score blocks ran at
    // 80 % of the peak).
#pragma GCC unroll 8
    for (int n = 0; n < NK; ++n) {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[v][n].store_aligned(scores + n * kStride + v * W);
    }
  } else {
    // Unrolled, so that acc stays in registers.
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      B sum = B::load_aligned(tile_sum + v * W);
      B first(0.0f), last(0.0f);
      B m(0.0f);  // kSetMax: this group's maximum, taken off before each exp
      if constexpr (kSetMax) {
        m = acc[v][0];
#pragma GCC unroll 8
        for (int n = 1; n < NK; ++n) m = xsimd::max(m, acc[v][n]);
        m.store_aligned(row_max + v * W);
      }
      if constexpr (kBounded) {
        first = B::load_aligned(first_key + v * W);
        last = B::load_aligned(last_key + v * W);
      }
#pragma GCC unroll 8
      for (int n = 0; n < NK; ++n) {
        B e = fast_exp2<Arch>(kSetMax ? acc[v][n] - m : acc[v][n]);
        if constexpr (kBounded) {
          const B key(static_cast<float>(key0 + n));
          e = xsimd::select(key >= first && key <= last, e, B(0.0f));
        }
        e.store_aligned(scores + n * kStride + v * W);
        sum += e;
      }
      sum.store_aligned(tile_sum + v * W);
    }
  }
}

// How pv_block's sum joins the accumulators.
enum class PvJoin {
  kRescale,    // acc = acc · alpha + sum: a key tile's first run
  kOverwrite,  // acc = sum, acc neither read nor rescaled: a query tile's first
               // run, so that its accumulators need no zeroing beforehand
               // (S4's 64 × 32 zero stores per head were 3 % of its time)
  kAdd,        // acc = acc + sum: a key tile's later runs (alpha is not read)
  kOutput,     // acc = sum · alpha, acc being the output rows and alpha 1 / the
               // row's softmax sum: a query tile whose only key tile is one
               // run, written straight to the output (its values checked as
               // stored into `poison`, as write_item_rows does)
};

// acc[r][c] = acc[r][c] · alpha[r] + Σ_j P[j][r] · V[j][c] for NR rows and
// NC vectors of Dv, P with rows kStride floats apart (kJoin: PvJoin).  The
// run's sum starts from its first product and the old accumulator joins at
// the end (one FMA, the rescale riding on it): the rounding of a row grows
// with the run's width plus the number of runs, not with the number of keys.
template <class Arch, int kStride, int NR, int NC, PvJoin kJoin = PvJoin::kRescale>
inline void pv_block(const float* probs, const float* alpha, const float* v_rows, int64_t v_stride,
                     int keys, float* acc, int64_t acc_stride, float* poison = nullptr) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  // Every loop over o unrolled, so that o stays in registers: a rolled one
  // keeps it on the stack, spilled before and after the key loop (72 extra
  // stores and loads per 6 x 4 block).
  B o[NR][NC];
  {
    B vv[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) vv[c] = B::load_unaligned(v_rows + c * W);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const B pr(probs[r]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) o[r][c] = pr * vv[c];
    }
  }
  for (int j = 1; j < keys; ++j) {
    B vv[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) vv[c] = B::load_unaligned(v_rows + j * v_stride + c * W);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const B pr(probs[j * kStride + r]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) o[r][c] = xsimd::fma(pr, vv[c], o[r][c]);
    }
  }
  if constexpr (kJoin == PvJoin::kOutput) {
    B check(0.0f);  // v - v: 0 for finite v, NaN otherwise
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const B inv(alpha[r]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const B v = o[r][c] * inv;
        v.store_unaligned(acc + r * acc_stride + c * W);
        check += v - v;
      }
    }
    (B::load_aligned(poison) + check).store_aligned(poison);
    return;
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      float* out = acc + r * acc_stride + c * W;
      if constexpr (kJoin == PvJoin::kOverwrite) {
        o[r][c].store_aligned(out);
      } else if constexpr (kJoin == PvJoin::kAdd) {
        (B::load_aligned(out) + o[r][c]).store_aligned(out);
      } else {
        xsimd::fma(B::load_aligned(out), B(alpha[r]), o[r][c]).store_aligned(out);
      }
    }
  }
}

}  // namespace mha_simd
