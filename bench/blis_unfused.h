// The textbook baseline: attention with BLIS, unfused.  Per (batch, head):
//   S = scale · Q·Kᵀ (sgemm, the full Lq×Lk matrix), a row softmax with the mask
//   applied, O = P·V (sgemm).
// The score matrix is written and read in full, masked entries included.
#ifndef MHA_BENCH_BLIS_UNFUSED_H
#define MHA_BENCH_BLIS_UNFUSED_H

#include <cstdint>
#include <string>
#include <vector>

namespace mha_bench {

// Chooses BLIS's kernel set and initialises BLIS; call once, first thing in
// main, before any thread exists.  BLIS_ARCH_TYPE, when the user set it, is
// respected.  Otherwise, if BLIS does not recognise this CPU (BLIS 0.9 runs its
// slow "generic" kernels on AMD family 1Ah, Zen 5) but the CPU has AVX-512 or
// AVX2, the matching BLIS kernels (skx, haswell) are chosen.  Returns a
// description for the report ("skx (chosen by mha_bench: BLIS 0.9 ...)").
std::string blis_setup(const std::string& cpu_features);

enum class BlisThreading {
  kHeads,  // an OpenMP loop over (batch, head), single-threaded BLIS inside
  kBlis    // one (batch, head) after the other, BLIS's own threads in each sgemm
};

struct AttentionProblem {  // every tensor C order: [B,H,L,D]
  int64_t batch, heads, kv_heads, lq, lk, d, dv;
  const float* q;
  const float* k;
  const float* v;
  float* out;
  float scale;
  bool causal_top_left;
  const int32_t* valid_lens;  // [batch] or nullptr
};

class BlisUnfused {
 public:
  BlisUnfused(const AttentionProblem& p, int threads, BlisThreading threading);
  void run();

 private:
  void head(int64_t bh, float* scores, bool parallel_softmax);
  AttentionProblem p_;
  int threads_;
  BlisThreading threading_;
  std::vector<std::vector<float>> scores_;  // one Lq×Lk matrix per thread
};

}  // namespace mha_bench

#endif  // MHA_BENCH_BLIS_UNFUSED_H
