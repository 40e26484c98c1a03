// The dropout decision of one attention weight, as documented in mha.h.
//
// Counter-based: a pure function of (seed, batch, head, query, key), so the
// result is reproducible and the same for any thread count or tiling.  The
// per-row part (64-bit splitmix) is computed once per row; the per-key part is
// 32-bit arithmetic that vectorises on every ISA.
#pragma once

#include <cstdint>

namespace mha_dropout {

constexpr uint32_t kKeyStep = 0x9E3779B9u;  // 2^32 / golden ratio

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// murmur3's 32-bit finaliser: a bijection with full avalanche.
inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// The key of row (b, h, i) of a problem with `heads` query heads and `lq` queries.
inline uint32_t row_key(uint64_t seed, int64_t b, int64_t h, int64_t i, int64_t heads, int64_t lq) {
  const uint64_t row = static_cast<uint64_t>((b * heads + h) * lq + i);
  const uint64_t mixed = splitmix64(seed ^ splitmix64(row));
  return static_cast<uint32_t>(mixed ^ (mixed >> 32));
}

// Weights whose hash is below the threshold are dropped: P(drop) = p.
inline uint32_t threshold(float p) {
  const double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

inline bool keep(uint32_t row, int64_t j, uint32_t drop_below) {
  return fmix32(row + static_cast<uint32_t>(j) * kKeyStep) >= drop_below;
}

}  // namespace mha_dropout
