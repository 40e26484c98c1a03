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
// respected.  Otherwise libmha's rule applies (it sets the same when it is the
// first to use BLIS): the skx kernels on a CPU with AVX-512 F, DQ, BW and VL
// (BLIS 0.9 itself picks "haswell" on Intel CPUs it cannot name, "generic" on
// Zen 4 and 5), the haswell ones where BLIS would run "generic" on an AVX2
// CPU.  Returns a description for the report ("skx (chosen as libmha does:
// ...)").
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
