#include "blis_unfused.h"

#include <blis.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace mha_bench {
namespace {

#if defined(__x86_64__)
// The name of the kernel set BLIS picks by itself, asked in a child process:
// BLIS decides once per process, and this one may still have to override it.
std::string blis_native_arch() {
  int fds[2];
  if (pipe(fds) != 0) return "";
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return "";
  }
  if (pid == 0) {
    close(fds[0]);
    const char* name = bli_arch_string(bli_arch_query_id());
    const ssize_t ignored = write(fds[1], name, std::strlen(name));
    (void)ignored;
    _exit(0);
  }
  close(fds[1]);
  std::string name;
  char buf[64];
  ssize_t got;
  while ((got = read(fds[0], buf, sizeof buf)) > 0) name.append(buf, static_cast<size_t>(got));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return name;
}

bool has_feature(const std::string& features, const char* name) {
  std::istringstream in(features);
  std::string word;
  while (in >> word)
    if (word == name) return true;
  return false;
}
#endif

// Softmax with explicit 128-bit vectors (GNU vector extension, so the baseline
// ISA: SSE2 on x86-64, NEON on aarch64): the compiler's auto-vectoriser gives up
// on the exp loop, and glibc's scalar expf (about 3 ns) would make the softmax,
// not the two sgemm calls, the cost of the baseline.
typedef float V4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));

inline V4 splat(float x) {
  return V4{x, x, x, x};
}

inline V4 load4(const float* p) {
  V4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store4(float* p, V4 v) {
  std::memcpy(p, &v, sizeof v);
}

// exp(x) for x <= 0 (scores minus the row maximum): Cephes' expf polynomial,
// about 2 ulp.
inline V4 exp4(V4 x) {
  const V4 lo = splat(-87.0f);  // exp(-87) > FLT_MIN: no denormal scale below
  x = x < lo ? lo : x;
  const V4 magic = splat(12582912.0f);  // 1.5 · 2^23: adding it rounds to an integer
  const V4 n = (x * 1.44269504f + magic) - magic;
  const V4 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  V4 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I4 bits = (__builtin_convertvector(n, I4) + 127) << 23;
  V4 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// softmax over row[0, visible); row[visible, lk) = 0 (the masked entries).
void softmax_row(float* row, int64_t visible, int64_t lk) {
  int64_t j = 0;
  if (visible > 0) {
    const int64_t body = visible / 4 * 4;
    V4 vmax = splat(row[0]);
    for (j = 0; j < body; j += 4) {
      const V4 x = load4(row + j);
      vmax = vmax < x ? x : vmax;
    }
    float m = std::max(std::max(vmax[0], vmax[1]), std::max(vmax[2], vmax[3]));
    for (; j < visible; ++j) m = std::max(m, row[j]);
    const V4 vm = splat(m);
    V4 vsum = splat(0.0f);
    for (j = 0; j < body; j += 4) {
      const V4 e = exp4(load4(row + j) - vm);
      store4(row + j, e);
      vsum += e;
    }
    float sum = (vsum[0] + vsum[1]) + (vsum[2] + vsum[3]);
    for (; j < visible; ++j) {
      row[j] = exp4(splat(row[j] - m))[0];
      sum += row[j];
    }
    const V4 inv = splat(1.0f / sum);
    for (j = 0; j < body; j += 4) store4(row + j, load4(row + j) * inv);
    for (; j < visible; ++j) row[j] *= inv[0];
  }
  for (j = std::max<int64_t>(visible, 0); j < lk; ++j) row[j] = 0.0f;
}

}  // namespace

std::string blis_setup(const std::string& cpu_features) {
  std::string note;
  if (std::getenv("BLIS_ARCH_TYPE") != nullptr) {
    note = " (BLIS_ARCH_TYPE set by the user)";
  } else {
#if defined(__x86_64__)
    // libmha's own rule when it is the first to use BLIS (runtime/module/blis.cpp):
    // the "skx" kernels wherever AVX-512 F, DQ, BW and VL are usable -- BLIS 0.x
    // itself picks "haswell" on Intel CPUs whose model name it cannot read (a
    // virtual machine's "Intel(R) Xeon(R) Processor": the module's projections
    // ran 1.7x slower on Intel family 6 model 207) and "generic" on Zen 4 and 5.
    // mha_bench uses BLIS before libmha does, so it applies the rule itself:
    // the module benchmarks measure what a program gets, and the unfused
    // baseline is the best BLIS here.
    const std::string native = blis_native_arch();
    int arch = -1;
    if (has_feature(cpu_features, "avx512f") && has_feature(cpu_features, "avx512dq") &&
        has_feature(cpu_features, "avx512bw") && has_feature(cpu_features, "avx512vl")) {
      if (native != "skx") arch = BLIS_ARCH_SKX;
    } else if (native == "generic" && has_feature(cpu_features, "avx2") &&
               has_feature(cpu_features, "fma")) {
      arch = BLIS_ARCH_HASWELL;
    }
    if (arch >= 0) {
      setenv("BLIS_ARCH_TYPE", std::to_string(arch).c_str(), 1);
      note = " (chosen as libmha does: BLIS would pick '" + native + "' here)";
    }
#else
    (void)cpu_features;
#endif
  }
  bli_init();  // before anything else of BLIS: reads BLIS_ARCH_TYPE once
  return std::string(bli_arch_string(bli_arch_query_id())) + note;
}

BlisUnfused::BlisUnfused(const AttentionProblem& p, int threads, BlisThreading threading)
    : p_(p), threads_(threads), threading_(threading) {
  const size_t matrices = threading == BlisThreading::kHeads ? static_cast<size_t>(threads) : 1;
  scores_.assign(matrices, std::vector<float>(static_cast<size_t>(p.lq * p.lk)));
}

void BlisUnfused::head(int64_t bh, float* scores, bool parallel_softmax) {
  const int64_t b = bh / p_.heads;
  const int64_t h = bh % p_.heads;
  const int64_t kvh = h / (p_.heads / p_.kv_heads);
  auto* q = const_cast<float*>(p_.q + bh * p_.lq * p_.d);
  auto* k = const_cast<float*>(p_.k + (b * p_.kv_heads + kvh) * p_.lk * p_.d);
  auto* v = const_cast<float*>(p_.v + (b * p_.kv_heads + kvh) * p_.lk * p_.dv);
  float* out = p_.out + bh * p_.lq * p_.dv;
  float scale = p_.scale;
  float one = 1.0f;
  float zero = 0.0f;
  // S = scale · Q Kᵀ, in full.
  bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_TRANSPOSE, p_.lq, p_.lk, p_.d, &scale, q, p_.d, 1, k, p_.d, 1,
            &zero, scores, p_.lk, 1);
  const int64_t valid = p_.valid_lens != nullptr ? p_.valid_lens[b] : p_.lk;
  const int64_t lq = p_.lq;
  const int64_t lk = p_.lk;
  const bool causal = p_.causal_top_left;
#pragma omp parallel for num_threads(threads_) schedule(static) if (parallel_softmax)
  for (int64_t i = 0; i < lq; ++i) {
    int64_t visible = std::min(valid, lk);
    if (causal) visible = std::min(visible, i + 1);
    softmax_row(scores + i * lk, visible, lk);
  }
  // O = P V, in full.
  bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, p_.lq, p_.dv, p_.lk, &one, scores, p_.lk, 1, v,
            p_.dv, 1, &zero, out, p_.dv, 1);
}

void BlisUnfused::run() {
  const int64_t items = p_.batch * p_.heads;
  if (threading_ == BlisThreading::kHeads) {
    bli_thread_set_num_threads(1);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
    for (int64_t bh = 0; bh < items; ++bh) {
      head(bh, scores_[static_cast<size_t>(omp_get_thread_num())].data(), false);
    }
  } else {
    bli_thread_set_num_threads(threads_);
    for (int64_t bh = 0; bh < items; ++bh) head(bh, scores_[0].data(), threads_ > 1);
  }
}

}  // namespace mha_bench
