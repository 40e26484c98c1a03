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

}  // namespace mha_bench
