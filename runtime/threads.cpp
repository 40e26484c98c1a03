#include "threads.h"

#include <omp.h>

#include <atomic>

#include "env.h"

namespace mha::rt {
namespace {
std::atomic<int32_t> g_api_threads{0};

int32_t environment_threads() {
  static const int32_t threads = [] {
    if (int n = positive_env_int("MHA_NUM_THREADS")) return n;
    if (int n = positive_env_int("OMP_NUM_THREADS")) return n;
    return omp_get_num_procs();
  }();
  return threads;
}
}  // namespace

int32_t num_threads() {
  const int32_t api = g_api_threads.load(std::memory_order_relaxed);
  return api > 0 ? api : environment_threads();
}

void set_num_threads(int32_t n) {
  g_api_threads.store(n, std::memory_order_relaxed);
}

}  // namespace mha::rt
