// Deterministic benchmark inputs: the same values on every run and machine.
#pragma once

#include <cstdint>
#include <vector>

namespace mha_bench {

// Uniform in [-amplitude, amplitude), from a splitmix64 stream seeded by `seed`.
inline void fill_uniform(std::vector<float>& x, uint64_t seed, float amplitude = 1.0f) {
  uint64_t state = seed;
  for (float& e : x) {
    state += 0x9e3779b97f4a7c15ull;  // splitmix64
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    e = amplitude * static_cast<float>(static_cast<double>(z >> 40) * 0x1p-23 - 1.0);
  }
}

// S5's valid lengths (the d2l.ai example: B 2, H 5, Lq 4, Lk 6, D 20).
inline constexpr int32_t kS5ValidLens[2] = {3, 2};

// S9's sequence lengths (bench/README.md), 64 · (1 + (5i mod 16)) for
// sequence i = 0..count-1: with 16, every multiple of 64 from 64 to 1024
// once, in a shuffled order.
inline std::vector<int64_t> s9_lengths(int64_t count) {
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < count; ++i) lengths.push_back(64 * (1 + (5 * i) % 16));
  return lengths;
}

}  // namespace mha_bench
