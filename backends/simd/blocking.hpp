// Register blocking and tile sizes per instruction set.  The micro-kernels'
// accumulators fill the register file without spilling.  The prefill key tile
// is chosen from the L1d when the plugin loads (tile_choice.hpp); kKeyTile is
// the one used when the system does not say, kKeyTileMax bounds the choice.
#pragma once

#include <xsimd/xsimd.hpp>

namespace mha_simd {

template <class Arch>
struct Blocking {
  static constexpr int kVectorRegisters = 32;
  // 32 vector registers (AVX-512 zmm, Arm NEON q):
  //   scores: 4 query vectors x 6 keys = 24 accumulators + 4 Q loads + 1 broadcast
  //   P·V:    6 query rows x 4 vectors of Dv = 24 accumulators + 4 V loads + 1 broadcast
  static constexpr int kScoreQueryVectors = 4;
  static constexpr int kScoreKeys = 6;
  // Steps of the score block's reduction a turn of its loop, with one test
  // for a prefetch a turn (4), or one step and one test each (1).  On
  // AVX-512 GCC spills 2 of the 24 accumulators in a turn of 4 steps
  // (nothing in the loop of 1; NEON's code not looked at).  Zen 5 (family
  // 26 model 2), AVX-512, 4 against 1, in-process A/B, both orders: S4
  // 1.002 and 1/1.002, S1 1.003 and 1/1.002, S2 0.994 and 1/0.993 -- alike.
  static constexpr int kScoreStepsPerTurn = 1;
  static constexpr int kPvRows = 6;
  static constexpr int kPvVectors = 4;
  static constexpr int kQueryTile = 64;
  static constexpr int kKeyTile = 288;
  static constexpr int kKeyTileMax = 576;
  // Decoding streams K and V from memory: long tiles mean fewer switches
  // between the two streams (each restarts the hardware prefetcher's ramp).
  // S3 at 2 threads, A/B in one session: 1024 keys about 10 % ahead of 384;
  // 2048 no better within the noise.
  static constexpr int kDecodeKeyTile = 1024;
  // Decode: up to kDecodeRows query rows (the query heads of one KV head)
  // share each K and V load; their accumulators (rows x keys for the scores,
  // rows x vectors of Dv for P·V) take kDecodeAccumulators registers, P·V at
  // most kDecodePvVectors vectors of a row at once, in blocks of a power of
  // two vectors -- or, for fp32 rows where it is wider, as many as fit
  // kDecodePvRegistersF32 registers with their V vectors (rows_pv).
  static constexpr int kDecodeRows = 4;
  static constexpr int kDecodeAccumulators = 16;
  // fp32 rows' P·V within all 32 registers: four rows take 6 vectors of Dv
  // (24 accumulators + 6 V vectors + 1 broadcast) instead of 4, so Dv 128
  // reads each V row in two column blocks as before (6 + 2), with more
  // chains in flight.  Zen 5 (family 26 model 2), AVX-512, in-process A/B
  // against the power-of-two rule, 9 rounds, both orders: head-major GQA
  // decode from DRAM (`--hkv 8 16 32 1 4096 128 0`) 0.944 and 1/1.054 of
  // the time, in L3 (`--hkv 8 1 32 1 4096 128 0`) 0.975 and 1/1.037,
  // token-major (`--hkv 8 4 32 1 2048 128 0 blhd`) 0.991 and 1/1.022, S8
  // 0.989 and 1/1.013 at one thread, 1.007 and 1/1.006 at two.  NEON (also
  // 32 registers) takes the same rule, its speed not measured.
  static constexpr int kDecodePvRegistersF32 = kVectorRegisters;
  static constexpr int kDecodePvVectors = 8;
  // The decode score kernel holds kDecodeRows x kDecodeQVectors = 16 vectors
  // of Q in registers (+ 4 accumulators + 1 K vector): 4 of each row's
  // vectors for four rows, more for fewer (rows_scores_held, held_chunk).
  static constexpr int kDecodeQVectors = 4;
  // One or two rows per KV head (MHA decode) read their tile's keys as this many
  // streams at once where the runtime asks for streams on this CPU
  // (row_kernels.hpp, "Key streams"); 1: in address order.  Zen 5 (family 26
  // model 2), AVX-512, four streams: S3 1.30 and 1/0.79 of the time at one
  // thread, S3b16's rows 1.11 and 1/0.90 at two -- and the CPUs that gain
  // from streams (Zen 1 to 3) have no AVX-512.
  static constexpr int kDecodeKeyStreams = 1;
  // Tiny problems (rows.hpp, dot_scores): few keys take dot products along
  // the head dimension instead of a transposed K.  Measured on AVX2 only;
  // AVX-512 transposes up to 8 keys in half-width registers.
  static constexpr bool kRowsDotScores = false;
  // The backward pass's products (gemm_tile.hpp): 6 rows x 4 vectors = 24
  // accumulators + 4 B loads + 1 broadcast; tiles of 64 queries x 64 keys.
  static constexpr int kGemmRows = 6;
  static constexpr int kGemmVectors = 4;
  static constexpr int kBackwardQueryTile = 64;
  static constexpr int kBackwardKeyBlock = 64;
};

// 16 ymm registers: 2 x 6 = 12 accumulators + 2 + 1 for the scores and
// 6 x 2 = 12 + 2 + 1 for P·V.
template <>
struct Blocking<xsimd::fma3<xsimd::avx2>> {
  static constexpr int kVectorRegisters = 16;
  static constexpr int kScoreQueryVectors = 2;
  static constexpr int kScoreKeys = 6;
  // Four steps a turn (no spill: 12 accumulators + 2 + 1): a test every step
  // cost S4 (D 32) about 10 % of its score phase alone in the L1.  Zen 3
  // (family 25 model 1), in-process A/B, both orders, 11 rounds: S4 0.905
  // and 1/1.117 of the time, S1 0.874 and 1/1.145, S2 0.919 and 1/1.127.
  static constexpr int kScoreStepsPerTurn = 4;
  static constexpr int kPvRows = 6;
  static constexpr int kPvVectors = 2;
  static constexpr int kQueryTile = 64;
  static constexpr int kKeyTile = 96;
  static constexpr int kKeyTileMax = 576;
  static constexpr int kDecodeKeyTile = 1024;
  static constexpr int kDecodeRows = 4;
  static constexpr int kDecodeAccumulators = 8;
  // fp32 rows' P·V within the 16 registers: for four rows 12 accumulators
  // + 3 V vectors + 1 broadcast, 3 vectors of Dv instead of 2 (Dv 128 as
  // 3+3+3+3+2+2), 12 chains of FMAs where 8 left the two FMA pipes waiting
  // on their latency; three rows 3 instead of 2, two rows 5 instead of 4.
  // Zen 3 (family 25 model 1), in-process A/B, both orders, 11 rounds: S8
  // 0.963 and 0.988 of the time at one thread, 0.988 and 0.963 at two;
  // head-major GQA decode (`--hkv 8 1 32 1 4096 128 0`) 0.942 and 0.948,
  // two query heads per KV head 0.986 and 0.970 (docs/kernel-design.md).
  // Widened rows (bf16, f16, int8) keep 2: they hold a broadcast per row.
  static constexpr int kDecodePvRegistersF32 = 16;
  // One row's P·V (MHA decode) takes 8 vectors, 8 chains of FMAs: with 4 it
  // waited on the FMA latency (Zen 5: S3 0.83 of the time at one thread).
  static constexpr int kDecodePvVectors = 8;
  static constexpr int kDecodeQVectors = 0;  // none: Q read from L1 (rows_scores_of)
  // Four streams for one or two rows per KV head (row_kernels.hpp, "Key
  // streams") where the runtime asks for them (runtime/decode_streams.cpp):
  // Zen 3 S3 about 0.8 of the time; on Zen 5 1.6x (two rows 2x).
  static constexpr int kDecodeKeyStreams = 4;
  // Tiny problems' scores as dot products for up to half a vector of keys
  // (rows.hpp, dot_scores): S5 about 0.9 of the time on Zen 3.
  static constexpr bool kRowsDotScores = true;
  static constexpr int kGemmRows = 6;  // 12 accumulators + 2 + 1
  static constexpr int kGemmVectors = 2;
  static constexpr int kBackwardQueryTile = 64;
  static constexpr int kBackwardKeyBlock = 64;
};

}  // namespace mha_simd
