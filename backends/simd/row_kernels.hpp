// The decode layout's micro-kernels: a few query rows (the query heads of
// one KV head) against a tile of keys, vector lanes along the head dimension.  Decoding is bound by
// reading K and V, so these are written for the memory system first: every K and V row is read once
// per tile, in address order, with the accumulators in registers (a loop bound known only at run
// time would keep them in memory).  K and V rows are of dtype kKv (convert.hpp), widened in
// registers as they are read. tests/micro checks each against plain loops on every ISA.
#pragma once

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd/blocking.hpp"
#include "simd/convert.hpp"
#include "simd/kv_rows.hpp"
#include "simd/row_sums.hpp"
#include "simd/tile_tools.hpp"

namespace mha_simd {

// Rows this far ahead of the one being read are requested from memory (the
// hardware prefetchers see one row at a time; a row of 256 B at D = 128 in
// bf16 is four lines).  The scores request them into L1 (prefetcht0), P·V
// into L1 or L2 as its caller says (rows_pv): on Zen 5 (family 26 model 2)
// both into L1 instead of L2 took S3 0.94 and a head-major GQA decode 0.80
// of the time at one thread (AVX2: 0.82 and 0.77), with S8 alike
// (docs/kernel-design.md).  On Zen 4, S7d ran 1.3x faster into L2 than with
// the non-temporal hint, whose loads still stalled.  The distance is about
// 4 KiB of rows, between 8 and kRowsAheadMax rows: on Intel family
// 6 model 207, S8's fp32 rows (512 B) 8 rows ahead took 0.88-0.91 of the time
// of 32 on AVX-512 and 0.86-0.88 on AVX2 (4 rows: 1.03-1.06 of 8's), and
// bf16 rows (256 B) ran fastest 16 rows ahead (8 or 32: 1.03-1.06); a
// software prefetch holds an L1 fill buffer until its line arrives, and too
// many in flight leave the loads waiting (docs/kernel-design.md).  On Zen 4,
// 24 to 96 rows of 512 B measured alike; on Zen 5 (family 26 model 2), 8 rows
// were the best or within 2 % of it on S3, S8 and head-major GQA decode.
constexpr int kRowsAheadMax = 32;

constexpr int rows_ahead(int64_t row_bytes) {
  const int64_t rows = int64_t{4096} / std::max<int64_t>(row_bytes, 1);
  return static_cast<int>(std::clamp<int64_t>(rows, 8, kRowsAheadMax));
}

// The distance for rows already in L2 (decode.hpp's read pass): an L2 hit
// needs a short lead only, and every request in flight holds an L1 miss
// buffer.
constexpr int kRowsAheadFromL2 = 2;

// Keys of each stream in turn in rows_pv (key streams, below): one or two
// rows alike in the stand-alone read.
constexpr int kPvStreamGrain = 2;

// The first `count` rows of `rows`, `elements` each.
template <class Rows>
inline void prefetch_rows(const Rows& rows, int count, int64_t elements) {
  for (int t = 0; t < count; ++t) prefetch_row(rows(t), elements);
}

// Key streams.  One query row per KV head (MHA decode: S3) -- or two --
// does little arithmetic per row it reads, and on Zen 3 (family 25 model 1) one stream
// of rows per thread reads memory at about 70 % of what the read probe's
// several streams get: a stand-alone read of S3's K and V, a tile of 1024
// rows of 512 B at a time, read 13-17 GB/s in address order and 19-23 with
// the tile read as four streams (its quarters) taking one or two rows of
// each in turn -- but 14-16 with 8 rows (4 KiB) of each in turn.  So the
// decode kernel reads a tile's first n x len keys as n = kDecodeKeyStreams
// streams of len keys, `grain` keys of each in turn (streamed_key maps the
// i-th key read to its index), the rest in address order; the scores keep
// their places and their bits, P·V sums the keys in the order read.  With
// the streams no software prefetch: the hardware prefetchers follow four
// streams (in-process A/B, S3 at one thread: none against 1 row ahead 0.94,
// 1 row against 2 0.83, 2 against 8 0.90).  S3 then took 0.81-0.84 of the
// time at one thread, 0.83-0.86 at two.  docs/kernel-design.md has the
// layouts where the streams lost (four rows per KV head, int8 rows) -- and
// the CPU where they all lose: on Zen 5 (family 26 model 2) S3 took 1.6x the
// time with them, so the runtime asks for streams only on Zen 1 to 3
// (runtime/decode_streams.cpp; mha_simd_tiles::decode_key_streams).
template <int kStreams, int kGrain>
constexpr int streamed_key(int i, int len) {
  return (i / kGrain) % kStreams * len + i / (kGrain * kStreams) * kGrain + i % kGrain;
}

// The row kernels that take key streams: one or two rows (R), not int8 rows
// (decode.hpp's rule; the others are compiled without them).
template <int32_t kKv, int R>
constexpr bool streams_for() {
  return R <= 2 && kKv != MHA_DTYPE_I8;
}

// Keys per stream: the most that are a multiple of `unit` (0: too few keys
// for whole units in every stream).
template <int kStreams>
constexpr int stream_length(int keys, int unit) {
  return keys / (kStreams * unit) * unit;
}

// The largest power of two <= n (n >= 1).
constexpr int pow2_floor(int n) {
  int p = 1;
  while (2 * p <= n) p *= 2;
  return p;
}

// Keys whose scores rows_scores_of computes in step for R rows when the rows
// are in cache: the most (a power of two dividing W, at most 8) whose R
// accumulators and K vector each, with one Q vector, fit the ISA's registers
// (AVX2, the ISA whose fp32 rows take rows_scores_of: 4 keys for one or two
// rows, 2 for three or four).
template <class Arch>
constexpr int score_keys_in_step(int R) {
  constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
  int n = std::min(W, 8);
  while (n > 1 && n * (R + 1) + 1 > Blocking<Arch>::kVectorRegisters) n /= 2;
  return n;
}

// s_r[j] = q_r · K[j] for R query rows at once and `keys` keys (K[j] at
// k_rows(j)): q_r = q + r·dp (dp floats, a multiple of W, zero-padded), s_r = s + r·s_stride (room
// for whole vectors).  Grouped-query attention's rows share their K rows, so
// every K vector is loaded once for all R rows.  W keys share one horizontal
// reduction per row.  The last group reads its last key again in place of the
// missing ones, so every group runs the same register-resident code; s beyond
// `keys` is left unspecified.  A score's chain of operations does not depend
// on R, so a row's scores do not depend on the rows grouped with it.
// (rows_scores_fixed sends fp32 rows of D 64 and 128 on the 32-register ISAs
// to rows_scores_held whatever R is, so that holds there too.)
//
// Two forms, by where the rows come from:
// - kS = 1, rows from memory: one whole row after the other, in address
//   order, each prefetching the row `ahead` rows on (rows_ahead), and two
//   partial sums per score to hide the FMA latency (one chain cost a single
//   row of int8 keys 20 % on avx2, where widening adds to each link).
//   Reading several rows in step made S3 1.4x slower on Zen 4, and head-major
//   GQA decode from DRAM 1.02x on Zen 3 (docs/kernel-design.md).
// - kS > 1 (score_keys_in_step), fp32 rows of D 64 or 128 in cache
//   (decode.hpp's read pass), AVX2 only: kS keys in step, so that each Q
//   vector is loaded once for them.  Four rows of D 128 on AVX2 load 80
//   vectors for 64 FMAs a key one key at a time, more than the two loads a
//   cycle the FMAs leave room for; two keys in step, 48.  The two chains of
//   the form above run one after the other (the even vectors, then the odd
//   ones: R x kS accumulators live, not twice that), so a score's bits are
//   those of the form above: a paged cache read first gives the bits of the
//   same keys read in place (tests/test_paged.cpp, tests/micro).  Zen 3
//   (family 25 model 1), a harness on four rows of D 128, one chain a score:
//   75 GFLOP/s against 61 in L1, 70-72 against 57-58 from L2 with the rows
//   back to back, 61-65 against 58 with S8's rows 4 KiB apart; S8 in place
//   in docs/kernel-design.md.
//
// kVectors > 0 fixes dp at kVectors·W at compile time, so that a row's FMAs
// unroll: the row kernels' usual head sizes (64 and 128) take that form
// (rows_scores below).  A loop over a run-time dp took 1.4-1.5x the time of
// the unrolled one on four rows of D 128 in L1 and L2 (Zen 5), the same
// operations in the same order.  Keys in step unroll their loop twice only:
// fully unrolled, GCC moved the K loads ahead and spilled them.
//
// streamed (kS = 1): the keys read as key streams (above), W / n keys of each
// stream a group of W, each score stored in its place.
template <class Arch, int32_t kKv, int R, int kVectors, int kS = 1, class Rows>
[[gnu::noinline]] void rows_scores_of(const float* q, int64_t dp_run_time, Rows k_rows, int keys,
                                      float* s, int64_t s_stride, int ahead,
                                      bool streamed = false) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  static_assert(kS >= 1 && W % kS == 0, "whole steps of keys");
  static_assert(kS == 1 || (kKv == MHA_DTYPE_F32 && kVectors > 0 && kVectors % 2 == 0),
                "keys in step: fp32 rows of an even number of vectors");
  const int64_t dp = kVectors > 0 ? int64_t{kVectors} * W : dp_run_time;
  B part[R][W];  // the sums of W keys, for one reduction per row
  constexpr int kStreams = kS == 1 && streams_for<kKv, R>() ? Blocking<Arch>::kDecodeKeyStreams : 1;
  constexpr int kGrain = W / kStreams;
  const int stream_len = kStreams > 1 && streamed ? stream_length<kStreams>(keys, W) : 0;
  for (int j0 = 0; j0 < keys; j0 += W) {
    const int last = std::min(W, keys - j0) - 1;
    const bool in_streams = j0 < kStreams * stream_len;
    if constexpr (kS == 1) {
      for (int t = 0; t < W; ++t) {
        const int row = in_streams ? streamed_key<kStreams, kGrain>(j0 + t, stream_len)
                                   : j0 + std::min(t, last);
        const element_t<kKv>* k = k_rows(row);
        if (ahead > 0) prefetch_row<3>(k_rows(row + ahead), dp);
        B a0[R], a1[R];
        for (int r = 0; r < R; ++r) a0[r] = a1[r] = B(0.0f);
        // Vectors x and x + W into the two chains.
        const auto pair = [&](int64_t x) {
          const B k0 = load_widen<Arch, kKv>(k + x), k1 = load_widen<Arch, kKv>(k + x + W);
          for (int r = 0; r < R; ++r) {
            a0[r] = xsimd::fma(B::load_aligned(q + r * dp + x), k0, a0[r]);
            a1[r] = xsimd::fma(B::load_aligned(q + r * dp + x + W), k1, a1[r]);
          }
        };
        int64_t x = 0;
        // Two pairs a step where the row has them: fewer loop instructions
        // per FMA (token-major GQA decode from DRAM, in-process A/B: 0.95 of
        // the time at 1 thread, 0.98 at 2).
        for (; x + 4 * W <= dp; x += 4 * W) {
          pair(x);
          pair(x + 2 * W);
        }
        for (; x + 2 * W <= dp; x += 2 * W) pair(x);
        if (x < dp) {
          const B k0 = load_widen<Arch, kKv>(k + x);
          for (int r = 0; r < R; ++r) {
            a0[r] = xsimd::fma(B::load_aligned(q + r * dp + x), k0, a0[r]);
          }
        }
        for (int r = 0; r < R; ++r) part[r][t] = a0[r] + a1[r];
      }
    } else {
      for (int t0 = 0; t0 < W; t0 += kS) {
        const element_t<kKv>* k[kS];
#pragma GCC unroll 8
        for (int u = 0; u < kS; ++u) {
          const int row = j0 + std::min(t0 + u, last);
          k[u] = k_rows(row);
          prefetch_row<3>(k_rows(row + ahead), dp);
        }
        // Q's rows are the same for every step: opaque here, or GCC keeps
        // copies of them on the stack across the steps.
        const float* qs = q;
        asm("" : "+r"(qs));
        // The two chains of the form above, one after the other: the even
        // vectors' (x = 0, 2W, ...), then the odd ones' (x = W, 3W, ...),
        // each in order from 0, so the same bits; R x kS accumulators live.
        for (int64_t half = 0; half < 2; ++half) {
          B a[kS][R];
#pragma GCC unroll 8
          for (int u = 0; u < kS; ++u) {
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) a[u][r] = B(0.0f);
          }
#pragma GCC unroll 2
          for (int64_t x = half * W; x < dp; x += 2 * W) {
            B kx[kS];
#pragma GCC unroll 8
            for (int u = 0; u < kS; ++u) kx[u] = load_widen<Arch, kKv>(k[u] + x);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const B qv = B::load_aligned(qs + r * dp + x);
#pragma GCC unroll 8
              for (int u = 0; u < kS; ++u) a[u][r] = xsimd::fma(qv, kx[u], a[u][r]);
            }
          }
#pragma GCC unroll 8
          for (int u = 0; u < kS; ++u) {
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              part[r][t0 + u] = half == 0 ? a[u][r] : part[r][t0 + u] + a[u][r];
            }
          }
        }
      }
    }
    if (kStreams > 1 && in_streams) {  // kGrain scores for each stream's place
      for (int r = 0; r < R; ++r) {
        alignas(64) float sums[W];
        sums_of<Arch>(part[r]).store_aligned(sums);
        for (int u = 0; u < kStreams; ++u) {
          std::memcpy(
              s + r * s_stride + streamed_key<kStreams, kGrain>(j0 + u * kGrain, stream_len),
              sums + u * kGrain, sizeof(float) * kGrain);
        }
      }
    } else {
      for (int r = 0; r < R; ++r) sums_of<Arch>(part[r]).store_aligned(s + r * s_stride + j0);
    }
  }
}

// Vectors of each of R query rows that rows_scores_held holds in registers:
// the most that divide the row's kVectors within `budget` registers
// (AVX-512, D 128: all 8 for one or two rows, 4 for three or four).
constexpr int held_chunk(int R, int kVectors, int budget) {
  int c = 0;
  for (int n = 1; n <= kVectors; ++n) {
    if (kVectors % n == 0 && R * n <= budget) c = n;
  }
  return c;
}

// rows_scores_of with Q held in registers: each row's kVectors vectors are
// taken C = held_chunk(...) at a time, the R x C vectors of Q loaded once
// per group of W keys and chunk, and every key's partial sums kept between
// chunks in `part` (the horizontal reductions' input, which spills to the
// stack either way).  Each score is one chain of FMAs over the row's vectors
// in order, whatever C is, so a row's scores do not depend on R; keys are
// independent, so the chains of consecutive keys overlap.  rows_scores_of
// loads its Q vectors with every FMA: with R 4 that is 40 loads for 32 FMAs
// a key, more than the two loads a cycle the FMAs leave room for; here 8 K
// loads and 4 partial sums.  Zen 5 (in-process A/B, loops aligned, both
// orders): S3 0.951 and 0.939, S8 0.964 and 0.975 (0.983 at two threads),
// head-major GQA decode 0.896, token-major GQA from DRAM 0.970; S3b16 at two
// threads 1.011.  Only for fp32 rows: bf16 rows (S8 in bf16) took 1.047 of
// the time this way.
//
// kStep keys go in step, their FMAs interleaved, so that 2 x R chains are in
// flight in program order rather than R (a key's chain of C FMAs takes 4 C
// cycles; with R 4 and C 4 one key alone left the FMA pipes half idle, and
// the out-of-order core did not fill them from the next key).
// rows_scores_fixed takes 2 for four rows (GQA, four query heads per KV
// head) whose K rows lie back to back (head-major): head-major GQA decode
// (`--hkv 8 1 32 1 4096 128 0`, Zen 5, in-process A/B) 0.909 and 0.939
// (builds swapped) at one thread, 0.968 at two, eight query heads per KV
// head 0.963; D 64 unchanged.  Not taken where no gain showed: two rows
// 1.051-1.066 and three 1.035 (but two rows moved by 1.014-1.042 with their
// code unchanged, from placement alone: docs/kernel-design.md), one row (S3)
// 1.003-1.009, token-major rows 4 KiB apart (S8's pages, read from L2 after
// the read pass) 0.978-1.018, a dense token-major batch 1.013-1.025.  The
// same chain per score either way, so the same bits.
template <class Arch, int32_t kKv, int R, int kVectors, int kStep, class Rows>
[[gnu::noinline]] void rows_scores_held(const float* q, Rows k_rows, int keys, float* s,
                                        int64_t s_stride, int ahead) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  constexpr int C =
      held_chunk(R, kVectors, Blocking<Arch>::kDecodeRows * Blocking<Arch>::kDecodeQVectors);
  static_assert(C > 0 && kVectors % C == 0, "whole chunks of the head dimension");
  static_assert(W % kStep == 0, "whole steps of keys");
  constexpr int64_t dp = int64_t{kVectors} * W;
  B part[R][W];
  for (int j0 = 0; j0 < keys; j0 += W) {
    const int last = std::min(W, keys - j0) - 1;
    for (int c0 = 0; c0 < kVectors; c0 += C) {
      B qc[R][C];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) qc[r][c] = B::load_aligned(q + r * dp + (c0 + c) * W);
      }
      for (int t = 0; t < W; t += kStep) {
        const element_t<kKv>* kp[kStep];
#pragma GCC unroll 2
        for (int u = 0; u < kStep; ++u) {
          const int row = j0 + std::min(t + u, last);
          kp[u] = k_rows(row) + c0 * W;
          if (c0 == 0) {
            prefetch_row<3>(k_rows(row + ahead), dp);
          } else {
            // This chunk's lines again: not all of the first chunk's requests
            // for them last until here (rows 4 KiB apart, token-major, put
            // line l of all W rows into one L1 set, more rows than its ways).
            // GQA decode 2-4 % faster, token- and head-major alike
            // (docs/kernel-design.md).
            prefetch_row<3>(k_rows(row + ahead) + c0 * W, int64_t{C} * W);
          }
        }
        B a[kStep][R];
#pragma GCC unroll 2
        for (int u = 0; u < kStep; ++u) {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) a[u][r] = c0 == 0 ? B(0.0f) : part[r][t + u];
        }
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
#pragma GCC unroll 2
          for (int u = 0; u < kStep; ++u) {
            const B kx = load_widen<Arch, kKv>(kp[u] + c * W);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) a[u][r] = xsimd::fma(qc[r][c], kx, a[u][r]);
          }
        }
#pragma GCC unroll 2
        for (int u = 0; u < kStep; ++u) {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) part[r][t + u] = a[u][r];
        }
      }
    }
    for (int r = 0; r < R; ++r) sums_of<Arch>(part[r]).store_aligned(s + r * s_stride + j0);
  }
}

// A fixed head size of kVectors vectors: Q held in registers for fp32 rows
// on the ISAs with 32 registers, read with each FMA otherwise (keys in step
// for rows in cache).
template <class Arch, int32_t kKv, int R, int kVectors, class Rows>
inline void rows_scores_fixed(const float* q, Rows k_rows, int keys, float* s, int64_t s_stride,
                              int ahead, bool in_cache, bool streamed) {
  if constexpr (kKv == MHA_DTYPE_F32 && Blocking<Arch>::kDecodeQVectors > 0) {
    // Two keys in step for four rows of one KV head back to back
    // (rows_scores_held).
    if constexpr (R == 4 && std::is_same<Rows, StridedRows<float>>::value) {
      if (k_rows.stride == int64_t{kVectors} * xsimd::batch<float, Arch>::size) {
        rows_scores_held<Arch, kKv, R, kVectors, 2>(q, k_rows, keys, s, s_stride, ahead);
        return;
      }
    }
    rows_scores_held<Arch, kKv, R, kVectors, 1>(q, k_rows, keys, s, s_stride, ahead);
  } else {
    constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
    if constexpr (kKv == MHA_DTYPE_F32) {
      if (in_cache) {
        rows_scores_of<Arch, kKv, R, kVectors, score_keys_in_step<Arch>(R)>(
            q, int64_t{kVectors} * W, k_rows, keys, s, s_stride, ahead);
        return;
      }
    }
    rows_scores_of<Arch, kKv, R, kVectors>(q, int64_t{kVectors} * W, k_rows, keys, s, s_stride,
                                           ahead, streamed);
  }
}

// in_cache: the rows were read into cache before (fp32 rows of D 64 or 128
// on AVX2: keys in step, rows_scores_of).  streamed: read the rows from
// memory as key streams where the ISA has them (rows_scores_of); the same
// scores either way.  ahead 0: no software prefetch.
template <class Arch, int32_t kKv, int R, class Rows>
inline void rows_scores(const float* q, int64_t dp, Rows k_rows, int keys, float* s,
                        int64_t s_stride, int ahead = kRowsAheadMax, bool in_cache = false,
                        bool streamed = false) {
  constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
  if (dp == 128) {
    rows_scores_fixed<Arch, kKv, R, 128 / W>(q, k_rows, keys, s, s_stride, ahead, in_cache,
                                             streamed);
  } else if (dp == 64) {
    rows_scores_fixed<Arch, kKv, R, 64 / W>(q, k_rows, keys, s, s_stride, ahead, in_cache,
                                            streamed);
  } else {
    rows_scores_of<Arch, kKv, R, 0>(q, dp, k_rows, keys, s, s_stride, ahead, streamed);
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

// Calls f(std::integral_constant<int, n>{}) for a column block of n <= N
// vectors (count >= 1) and returns n: N while that leaves no lone vector
// behind (whose R accumulators alone would wait on the FMA latency), else
// the largest power of two within count.
template <int N, class F>
inline int with_column_block(int count, F&& f) {
  if (count >= N && count != N + 1) {
    f(std::integral_constant<int, N>{});
    return N;
  }
  return with_block_of<pow2_floor(N)>(count, f);
}

// One column block of rows_pv: o_r = Σ_j p_rj·V_j[col, col + NB·W) over keys
// [j0, j1) -- or, with stream_len > 0, over the keys streamed_key maps them
// to, in that order --, added to total_r (row r's at total + r·dvp).  Everything it reads
// arrives as a value, so the loop keeps its pointers and bound in registers:
// written as a lambda over rows_pv's locals, the same loop reloaded them from
// the closure and ran at 0.70 of this speed in L1 (Zen 5, R 4, Dv 128).
template <class Arch, int32_t kKv, int R, int NB, int kPrefetch, class Rows>
inline void pv_block_run(const float* const* p, Rows v_rows, int j0, int j1, int64_t col,
                         int64_t dvp, int ahead, float* total, int stream_len) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  // Every loop over o unrolled, so that o stays in registers: rolled, the
  // zeroing and the final sums put o on the stack around the key loop.
  B o[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) o[r][c] = B(0.0f);
  }
  const float* pr[R];  // in registers, not reloaded through `p` every key
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) pr[r] = p[r];
  constexpr int kStreams = streams_for<kKv, R>() ? Blocking<Arch>::kDecodeKeyStreams : 1;
  for (int i = j0; i < j1; ++i) {
    const int j =
        kStreams > 1 && stream_len > 0 ? streamed_key<kStreams, kPvStreamGrain>(i, stream_len) : i;
    const element_t<kKv>* v = v_rows(j) + col;
    if constexpr (kPrefetch > 0) prefetch_row<kPrefetch>(v_rows(j + ahead), dvp);
    if constexpr (kKv == MHA_DTYPE_F32) {
      // Every load first: the rows come from L2 or memory, and the loads
      // in flight together hide that (S8 took 1.057 of the time with each
      // load next to its FMAs, Zen 5).
      B vx[NB];
      for (int c = 0; c < NB; ++c) vx[c] = load_widen<Arch, kKv>(v + c * W);
      for (int r = 0; r < R; ++r) {
        const B pj(pr[r][j]);
        for (int c = 0; c < NB; ++c) o[r][c] = xsimd::fma(pj, vx[c], o[r][c]);
      }
    } else {
      // Each vector widened and used in turn: widened all first, 8 vectors
      // of one row spilled on AVX2 (16 registers), and int8 rows ran slower
      // with 8 than with 4.  This way, against 4 vectors widened first
      // (Zen 5, alternating runs, one thread): AVX2 S3:i8kv 0.91, S3:bf16kv
      // 0.93, S3:f16kv 1.00; AVX-512 S3:i8kv 0.95, S3:bf16kv and S3:f16kv
      // 0.98-0.99, S8 in bf16 0.986 (in-process A/B).
      B pj[R];
      for (int r = 0; r < R; ++r) pj[r] = B(pr[r][j]);
      for (int c = 0; c < NB; ++c) {
        const B vx = load_widen<Arch, kKv>(v + c * W);
        for (int r = 0; r < R; ++r) o[r][c] = xsimd::fma(pj[r], vx, o[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* t = total + r * dvp + col;
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) (B::load_aligned(t + c * W) + o[r][c]).store_aligned(t + c * W);
  }
}

// acc_r = acc_r·alpha_r + Σ_j p_rj·V_j (V_j at v_rows(j)) for R rows at once: row r's
// probabilities at probs[r] (`keys` of them), its dvp floats at acc[r].
// The rows `ahead` on are requested into L1 (into_l1) or L2.
// Every V vector is loaded once for all R rows; R rows x NB vectors of Dv
// accumulate in registers (NB within kDecodePvVectors and the budget,
// blocking.hpp).
//
// Summed in two levels -- runs of kPvRun keys from zero, then the runs into
// the tile's totals (R·dvp floats of scratch at `total`) -- so that rounding
// grows with kPvRun + keys / kPvRun rather than with the number of keys
// (which matters when many keys are alike and their rounding errors do not
// cancel).  A row wider than NB vectors is cut into column blocks *inside*
// each run, not across the whole tile: the run's V rows stay in L1 while
// its blocks are summed, so memory sees one stream of rows in address order.
// Each element is the same chain of operations whatever R and NB are.
//
// streamed: the keys read as key streams where the ISA has them (above),
// kPvStreamGrain keys of each stream in turn, each run of kPvRun keys read
// taking kPvRun / n of every stream: a sum in another order, so the caller's
// rule for it must not depend on the thread count or the cache's layout.
template <class Arch, int32_t kKv, int R, class Rows>
[[gnu::noinline]] void rows_pv(const float* const* probs, const float* alpha, Rows v_rows, int keys,
                               int64_t dvp, float* const* acc, float* total,
                               int ahead = kRowsAheadMax, bool into_l1 = true,
                               bool streamed = false) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  constexpr int kPvRun = 32;
  // fp32 rows: R x n accumulators, the n V vectors and a broadcast within
  // kDecodePvRegistersF32 registers where that is wider than the rule.
  constexpr int kPow2 = pow2_floor(Blocking<Arch>::kDecodeAccumulators / R);
  constexpr int kRegisters = Blocking<Arch>::kDecodePvRegistersF32;
  constexpr int kFit = kRegisters > 0 ? (kRegisters - 1) / (R + 1) : 0;
  constexpr int NC = std::min(Blocking<Arch>::kDecodePvVectors,
                              kKv == MHA_DTYPE_F32 ? std::max(kPow2, kFit) : kPow2);
  const int vectors = static_cast<int>(dvp / W);
  constexpr int kStreams = streams_for<kKv, R>() ? Blocking<Arch>::kDecodeKeyStreams : 1;
  const int stream_len = kStreams > 1 && streamed ? stream_length<kStreams>(keys, kPvRun) : 0;
  std::fill(total, total + R * dvp, 0.0f);
  for (int j0 = 0; j0 < keys; j0 += kPvRun) {
    const int j1 = std::min(keys, j0 + kPvRun);
    const int run_stream_len = j0 < kStreams * stream_len ? stream_len : 0;
    for (int c0 = 0; c0 < vectors;) {
      const int64_t col = int64_t{c0} * W;
      c0 += with_column_block<NC>(vectors - c0, [&](auto nb) {
        constexpr int NB = decltype(nb)::value;
        // The first block requests the rows `ahead` on (if any), once per row.
        if (col == 0 && ahead > 0 && into_l1) {
          pv_block_run<Arch, kKv, R, NB, 3>(probs, v_rows, j0, j1, col, dvp, ahead, total,
                                            run_stream_len);
        } else if (col == 0 && ahead > 0) {
          pv_block_run<Arch, kKv, R, NB, 2>(probs, v_rows, j0, j1, col, dvp, ahead, total,
                                            run_stream_len);
        } else {
          pv_block_run<Arch, kKv, R, NB, 0>(probs, v_rows, j0, j1, col, dvp, ahead, total,
                                            run_stream_len);
        }
      });
    }
  }
  for (int r = 0; r < R; ++r) {
    const B a(alpha[r]);
    const float* t = total + r * dvp;
    for (int64_t x = 0; x < dvp; x += W) {
      xsimd::fma(B::load_aligned(acc[r] + x), a, B::load_aligned(t + x)).store_aligned(acc[r] + x);
    }
  }
}

}  // namespace mha_simd
