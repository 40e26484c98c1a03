// mha.h's dropout rule, written from its text for the references (it shares
// no code with common/dropout.h, which the library uses).
#pragma once

#include <cstdint>

namespace mha_test {

inline uint64_t reference_splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint32_t reference_fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// Whether the weight of key j in row (b, h, i) is dropped with probability p.
inline bool reference_dropped(uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j,
                              int64_t heads, int64_t lq) {
  const uint64_t row = reference_splitmix64(
      seed ^ reference_splitmix64(static_cast<uint64_t>((b * heads + h) * lq + i)));
  const auto key = static_cast<uint32_t>(row ^ (row >> 32));
  const auto below = static_cast<uint32_t>(static_cast<double>(p) * 4294967296.0);
  return reference_fmix32(key + static_cast<uint32_t>(j) * 0x9E3779B9u) < below;
}

}  // namespace mha_test
