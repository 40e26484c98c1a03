// Deterministic benchmark inputs: the same values on every run and machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
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

// The module benchmarks' weights for embedding e, by PyTorch's names:
// in_proj_weight [3E, E], in_proj_bias [3E], out_proj.weight [E, E] and
// out_proj.bias [E], uniform in [-1/sqrt(E), 1/sqrt(E)).
struct ModuleWeight {
  const char* name;
  std::vector<float> data;
  int32_t ndim;
  int64_t shape[2];
};
inline std::vector<ModuleWeight> module_weights(int64_t e) {
  std::vector<ModuleWeight> weights = {{"in_proj_weight", {}, 2, {3 * e, e}},
                                       {"in_proj_bias", {}, 1, {3 * e, 0}},
                                       {"out_proj.weight", {}, 2, {e, e}},
                                       {"out_proj.bias", {}, 1, {e, 0}}};
  const float amplitude = 1.0f / std::sqrt(static_cast<float>(e));
  uint64_t seed = 11;
  for (ModuleWeight& w : weights) {
    w.data.resize(static_cast<size_t>(w.shape[0] * std::max<int64_t>(w.shape[1], 1)));
    fill_uniform(w.data, seed++, amplitude);
  }
  return weights;
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

// S8's batch (bench/README.md): 16 sequences, H 32, Hkv 8, D 128, one query
// each over context lengths 512 · (1 + (7i mod 16)) (512 to 8192), the cache
// in blocks of 16 handed out in a shuffled order.
struct S8Batch {
  static constexpr int64_t kSequences = 16, kHeads = 32, kKvHeads = 8, kHeadSize = 128, kBlock = 16;
  std::vector<int32_t> used;   // [kSequences]: each context's length
  std::vector<int32_t> cu_q;   // [kSequences + 1]: one query each
  std::vector<int32_t> cu_k;   // [kSequences + 1]: the contexts packed
  std::vector<int32_t> table;  // [kSequences][max_blocks], -1 past a context
  int64_t total_k = 0, max_blocks = 0, num_blocks = 0;

  static int64_t context_length(int64_t i) { return 512 * (1 + (7 * i) % 16); }

  S8Batch() {
    for (int64_t i = 0; i < kSequences; ++i) {
      used.push_back(static_cast<int32_t>(context_length(i)));
      cu_k.push_back(static_cast<int32_t>(total_k));
      total_k += context_length(i);
      max_blocks = std::max(max_blocks, (context_length(i) + kBlock - 1) / kBlock);
    }
    cu_k.push_back(static_cast<int32_t>(total_k));
    for (int32_t i = 0; i <= kSequences; ++i) cu_q.push_back(i);
    num_blocks = total_k / kBlock;  // every length is a multiple of 16
    // Block ids: a shuffled permutation, handed out in order.
    std::vector<int32_t> order(static_cast<size_t>(num_blocks));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(8));
    table.assign(static_cast<size_t>(kSequences * max_blocks), -1);
    size_t next = 0;
    for (int64_t i = 0; i < kSequences; ++i) {
      for (int64_t n = 0; n * kBlock < context_length(i); ++n) {
        table[static_cast<size_t>(i * max_blocks + n)] = order[next++];
      }
    }
  }
};

}  // namespace mha_bench
