#include "blis.h"

#include <blis.h>
#include <mha/plugin_abi.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "env.h"
#include "error.h"
#include "registry.h"
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
// (BLIS_ARCH_TYPE unset or empty) and the BLIS is a 0.x one, mha sets
// BLIS_ARCH_TYPE to the "skx" (AVX-512) kernel set on CPUs that have what
// those kernels use (AVX-512 F, DQ, BW, VL, checked with OS support) -- the
// set BLIS picks itself on the Intel CPUs it knows.  Everywhere else BLIS
// chooses.  This sets an environment variable of the process (seen by child
// processes too); it has no effect when the program already used BLIS.
//
// BLIS 0.x reads the variable with strtol and trusts it: an empty value or a
// name ("haswell") is id 0, skx, and a kernel set this CPU cannot run ends
// the process with SIGILL at the first product.  A user's value is therefore
// checked against the CPU as BLIS will read it, and the module's calls refuse
// one that would not run (blis_arch_problem).
std::string g_blis_problem;  // empty: BLIS can run here

// The CPU features the kernels of a BLIS 0.9 kernel set (arch_t) need here (0:
// any CPU of this architecture); nullopt for a set mha does not know this CPU
// (or this BLIS, as Debian builds it) to run: another architecture's, Xeon
// Phi's, the Bulldozer family's (FMA4, which mha does not probe), SVE's.
std::optional<uint32_t> blis_arch_needs(long id) {
#if defined(__x86_64__)
  constexpr uint32_t kAvx512 =
      MHA_CPU_AVX512F | MHA_CPU_AVX512DQ | MHA_CPU_AVX512BW | MHA_CPU_AVX512VL;
  constexpr uint32_t kAvx2 = MHA_CPU_AVX | MHA_CPU_AVX2 | MHA_CPU_FMA;
  switch (id) {
    case BLIS_ARCH_SKX:
      return kAvx512;
    case BLIS_ARCH_HASWELL:
    case BLIS_ARCH_ZEN3:
    case BLIS_ARCH_ZEN2:
    case BLIS_ARCH_ZEN:
      return kAvx2;
    case BLIS_ARCH_SANDYBRIDGE:
      return MHA_CPU_AVX;
    case BLIS_ARCH_PENRYN:
      return MHA_CPU_SSE2;
    case BLIS_ARCH_GENERIC:
      return 0u;
    default:
      return std::nullopt;
  }
#elif defined(__aarch64__)
  switch (id) {
    case BLIS_ARCH_FIRESTORM:
    case BLIS_ARCH_THUNDERX2:
    case BLIS_ARCH_CORTEXA57:
    case BLIS_ARCH_CORTEXA53:
      return MHA_CPU_NEON;
    case BLIS_ARCH_GENERIC:
      return 0u;
    default:
      return std::nullopt;
  }
#else
  return id == BLIS_ARCH_GENERIC ? std::optional<uint32_t>(0u) : std::nullopt;
#endif
}

void prepare_blis() {
  const char* version = bli_info_get_version_str();
  if (version == nullptr || std::strncmp(version, "0.", 2) != 0) return;
  const uint32_t cpu = cpu_features();
  const char* given = std::getenv("BLIS_ARCH_TYPE");
  if (given == nullptr || *given == '\0') {
#if defined(__x86_64__)
    constexpr uint32_t kSkx =
        MHA_CPU_AVX512F | MHA_CPU_AVX512DQ | MHA_CPU_AVX512BW | MHA_CPU_AVX512VL;
    if ((cpu & kSkx) == kSkx) {
      setenv("BLIS_ARCH_TYPE", std::to_string(static_cast<int>(BLIS_ARCH_SKX)).c_str(), 1);
      return;
    }
#endif
    // Empty: BLIS would read id 0 (skx); let it detect the CPU instead.
    if (given != nullptr) unsetenv("BLIS_ARCH_TYPE");
    return;
  }
  char* end = nullptr;
  const long id = std::strtol(given, &end, 10);  // as BLIS reads it
  if (id == -1) return;                          // BLIS's "detect the CPU"
  const std::string shown = "BLIS_ARCH_TYPE=\"" + printable(given) + "\"";
  const std::string read_as = end != nullptr && *end == '\0'
                                  ? std::string()
                                  : " (BLIS 0.x reads it as a number: " + std::to_string(id) + ")";
  if (id < 0 || id >= BLIS_NUM_ARCHS) {
    g_blis_problem = shown + read_as + " is not a kernel set of this BLIS (0 to " +
                     std::to_string(static_cast<int>(BLIS_NUM_ARCHS) - 1) +
                     "), and BLIS would abort the process: unset it, or give a kernel set's "
                     "number (3 is haswell, 0 skx)";
    return;
  }
  const std::optional<uint32_t> needs = blis_arch_needs(id);
  if (!needs || (cpu & *needs) != *needs) {
    g_blis_problem = shown + read_as + " asks BLIS for its " +
                     bli_arch_string(static_cast<arch_t>(id)) +
                     " kernels, which this CPU (or this BLIS) cannot run -- BLIS would end the "
                     "process: unset it, or give a kernel set this CPU has (its features: " +
                     feature_names(cpu) + ")";
    return;
  }
  if (!read_as.empty() && verbose_level() >= 1) {
    std::fprintf(stderr, "mha: %s%s: BLIS uses its %s kernels\n", shown.c_str(), read_as.c_str(),
                 bli_arch_string(static_cast<arch_t>(id)));
  }
}

void prepare_blis_once() {
  static std::once_flag once;
  std::call_once(once, prepare_blis);
}

// The selected backend's micro-kernel in BLIS's framework (mha_gemm_ukernel,
// plugin_abi.h): a copy of BLIS's context whose sgemm micro-kernel calls it,
// when BLIS's kernel set packs its panels for the kernel's tile and
// orientation.  BLIS passes its micro-kernels no pointer of ours, so each
// plugin's kernel gets a slot, and each slot its own function.  Zen 5, BLIS
// 0.9's "skx" set: the module's fused QKV product 79-81 % of the FMA peak with
// BLIS's kernel, 86-88 % with the avx512 plugin's (docs/kernel-design.md).
struct UkernelSlot {
  const mha_gemm_ukernel* kernel = nullptr;
  bool usable = false;  // BLIS's kernel set packs for its tile
  cntx_t context{};
};
constexpr int kUkernelSlots = 4;  // at most one per SIMD plugin
UkernelSlot g_slots[kUkernelSlots];
int g_slot_count = 0;
std::mutex g_slots_mutex;

template <int kSlot>
void run_slot(dim_t m, dim_t n, dim_t k, float* alpha, float* a, float* b, float* beta, float* c,
              inc_t rs_c, inc_t cs_c, auxinfo_t* data, cntx_t* /*cntx*/) {
  g_slots[kSlot].kernel->run(m, n, k, *alpha, a, b, *beta, c, rs_c, cs_c,
                             static_cast<const float*>(bli_auxinfo_next_a(data)),
                             static_cast<const float*>(bli_auxinfo_next_b(data)));
}
void_fp slot_function(int slot) {
  static_assert(kUkernelSlots == 4, "one case per slot");
  switch (slot) {
    case 0:
      return reinterpret_cast<void_fp>(&run_slot<0>);
    case 1:
      return reinterpret_cast<void_fp>(&run_slot<1>);
    case 2:
      return reinterpret_cast<void_fp>(&run_slot<2>);
    default:
      return reinterpret_cast<void_fp>(&run_slot<3>);
  }
}

// The context that runs `kernel`, or nullptr (BLIS's own kernels then).
cntx_t* context_with(const mha_gemm_ukernel* kernel) {
  if (kernel == nullptr) return nullptr;
  const std::lock_guard<std::mutex> lock(g_slots_mutex);
  for (int i = 0; i < g_slot_count; ++i) {
    if (g_slots[i].kernel == kernel) return g_slots[i].usable ? &g_slots[i].context : nullptr;
  }
  if (g_slot_count == kUkernelSlots) return nullptr;
  UkernelSlot& slot = g_slots[g_slot_count];
  slot.kernel = kernel;
  slot.context = *bli_gks_query_cntx();
  cntx_t* context = &slot.context;
  const auto packs_for = [context](bszid_t id, int32_t size) {
    return bli_cntx_get_blksz_def_dt(BLIS_FLOAT, id, context) == size &&
           bli_cntx_get_blksz_max_dt(BLIS_FLOAT, id, context) == size;
  };
  slot.usable = packs_for(BLIS_MR, kernel->mr) && packs_for(BLIS_NR, kernel->nr) &&
                bli_cntx_l3_nat_ukr_prefers_rows_dt(BLIS_FLOAT, BLIS_GEMM_UKR, context) ==
                    (kernel->row_major != 0);
  if (slot.usable) {
    const void_fp run = slot_function(g_slot_count);
    bli_func_set_dt(run, BLIS_FLOAT, bli_cntx_get_l3_nat_ukrs(BLIS_GEMM_UKR, context));
    bli_func_set_dt(run, BLIS_FLOAT, bli_cntx_get_l3_vir_ukrs(BLIS_GEMM_UKR, context));
  }
  ++g_slot_count;
  return slot.usable ? context : nullptr;
}

// The selected backend when its micro-kernel runs in BLIS's framework (with
// that context in *context), else nullptr.
const Backend* selected_with_context(cntx_t** context) {
  const char* why = nullptr;
  const Backend* backend = Registry::instance().selected(&why);
  *context = backend != nullptr && backend->plugin != nullptr
                 ? context_with(backend->plugin->gemm_ukernel)
                 : nullptr;
  return *context != nullptr ? backend : nullptr;
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
  cntx_t* context = nullptr;  // nullptr: BLIS's own
  selected_with_context(&context);
  bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, m, n, k, &alpha, const_cast<float*>(a), rsa,
               csa, const_cast<float*>(b), rsb, csb, &beta, dst, rsd, csd, context, &rntm);

  if (dst != c) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t col = 0; col < n; ++col) c[r * rsc + col * csc] = dst[r * n + col];
    }
  }
}

mha_status check_blis_kernel_set() {
  prepare_blis_once();
  if (g_blis_problem.empty()) return MHA_OK;
  return fail(MHA_ERR_UNSUPPORTED, "%s", g_blis_problem.c_str());
}

const char* blis_kernel_set() {
  prepare_blis_once();
  return bli_arch_string(bli_arch_query_id());
}

const char* gemm_ukernel_in_use() {
  prepare_blis_once();
  cntx_t* context = nullptr;
  const Backend* backend = selected_with_context(&context);
  return backend != nullptr ? backend->name.c_str() : "blis";
}

}  // namespace mha::rt
