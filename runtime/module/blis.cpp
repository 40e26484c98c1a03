#include "blis.h"

#include <blis.h>
#include <mha/plugin_abi.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "threads.h"

namespace mha::rt {
namespace {

static_assert(sizeof(dim_t) == sizeof(int64_t) && sizeof(inc_t) == sizeof(int64_t),
              "mha needs a BLIS with 64-bit dimensions and strides");

// BLIS picks its kernel set once per process, from BLIS_ARCH_TYPE or its own
// CPU detection, when it is first used.  BLIS 0.x predates AMD's Zen 4 and
// Zen 5: on those it falls back to its unoptimised "generic" kernels (Zen 5,
// measured: 28 GFLOP/s on one core instead of 150 with the "skx" kernels).
// So, before mha's first BLIS call and only when the user has not chosen
// (BLIS_ARCH_TYPE unset) and the BLIS is a 0.x one, mha sets BLIS_ARCH_TYPE
// to the "skx" (AVX-512) kernel set on CPUs that have what those kernels use
// (AVX-512 F, DQ, BW, VL, checked with OS support) -- the set BLIS picks itself
// on the Intel CPUs it knows.  Everywhere else BLIS chooses.  This sets an
// environment variable of the process (seen by child processes too); it has
// no effect when the program already used BLIS.
void prepare_blis() {
#if defined(__x86_64__)
  if (std::getenv("BLIS_ARCH_TYPE") != nullptr) return;
  const char* version = bli_info_get_version_str();
  if (version == nullptr || std::strncmp(version, "0.", 2) != 0) return;
  const uint32_t need = MHA_CPU_AVX512F | MHA_CPU_AVX512DQ | MHA_CPU_AVX512BW | MHA_CPU_AVX512VL;
  if ((cpu_features() & need) != need) return;
  setenv("BLIS_ARCH_TYPE", std::to_string(static_cast<int>(BLIS_ARCH_SKX)).c_str(), 0);
#endif
}

void prepare_blis_once() {
  static std::once_flag once;
  std::call_once(once, prepare_blis);
}

// Strides of size-1 dimensions are never used: give them values BLIS accepts.
void normalise(int64_t m, int64_t n, int64_t& rs, int64_t& cs) {
  if (m == 1 && n == 1) {
    rs = cs = 1;
  } else if (m == 1) {
    rs = n * cs;
  } else if (n == 1) {
    cs = m * rs;
  }
}

// A packed row-major copy of an m x n operand.
std::vector<float> pack(const float* x, int64_t m, int64_t n, int64_t rs, int64_t cs) {
  std::vector<float> packed(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) packed[static_cast<size_t>(r * n + c)] = x[r * rs + c * cs];
  }
  return packed;
}

// True when BLIS accepts an m x n operand with these strides (its
// bli_check_matrix_strides rules, after the strides of size-1 dimensions are
// normalised).
bool blis_accepts(int64_t m, int64_t n, int64_t rs, int64_t cs) {
  normalise(m, n, rs, cs);
  if (rs <= 0 || cs <= 0) return false;
  if (rs != 1 && cs != 1) {
    if (rs == cs) return m == 1 || n == 1;
    if (rs < cs) return m * rs <= cs;
    return n * cs <= rs;
  }
  if (rs == 1 && cs == 1) return m == 1 || n == 1;
  if (rs == 1) return cs >= m;
  return rs >= n;
}

}  // namespace

int32_t sgemm_threads(int64_t m, int64_t n, int64_t k, int32_t threads) {
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  if (work < 1048576.0 || threads < 1) return 1;
  return std::min(threads, std::max(1, omp_get_num_procs()));
}

void sgemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t rsa, int64_t csa,
           const float* b, int64_t rsb, int64_t csb, float beta, float* c, int64_t rsc, int64_t csc,
           int32_t threads) {
  prepare_blis_once();
  normalise(m, k, rsa, csa);
  normalise(k, n, rsb, csb);
  normalise(m, n, rsc, csc);

  std::vector<float> a_copy, b_copy, c_copy;
  if (!blis_accepts(m, k, rsa, csa)) {
    a_copy = pack(a, m, k, rsa, csa);
    a = a_copy.data();
    rsa = k, csa = 1;
  }
  if (!blis_accepts(k, n, rsb, csb)) {
    b_copy = pack(b, k, n, rsb, csb);
    b = b_copy.data();
    rsb = n, csb = 1;
  }
  float* dst = c;
  int64_t rsd = rsc, csd = csc;
  if (!blis_accepts(m, n, rsc, csc)) {
    c_copy =
        beta == 0.0f ? std::vector<float>(static_cast<size_t>(m * n)) : pack(c, m, n, rsc, csc);
    dst = c_copy.data();
    rsd = n, csd = 1;
  }

  rntm_t rntm;
  bli_rntm_init(&rntm);
  // BLIS threads with OpenMP, whose pool a forked child cannot use (threads.h).
  bli_rntm_set_num_threads(threads < 1 || in_forked_child() ? 1 : threads, &rntm);
  bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, m, n, k, &alpha, const_cast<float*>(a), rsa,
               csa, const_cast<float*>(b), rsb, csb, &beta, dst, rsd, csd, nullptr, &rntm);

  if (dst != c) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t col = 0; col < n; ++col) c[r * rsc + col * csc] = dst[r * n + col];
    }
  }
}

const char* blis_kernel_set() {
  prepare_blis_once();
  return bli_arch_string(bli_arch_query_id());
}

}  // namespace mha::rt
