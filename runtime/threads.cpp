#include "threads.h"

#include <omp.h>
#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "env.h"

namespace mha::rt {
namespace {

std::atomic<int32_t> g_api_threads{0};
// Set in a forked child; cleared again by mha_set_num_threads in the child
// (only the count, not the ban on OpenMP: g_forked stays set).
std::atomic<bool> g_forked{false};
std::atomic<bool> g_child_chose_threads{false};

void on_fork_child() {
  g_forked.store(true, std::memory_order_relaxed);
  g_child_chose_threads.store(false, std::memory_order_relaxed);
}

// Registered when libmha is loaded, before any thread exists: registering
// runs no other code, loads nothing, and covers a fork at any later time.
[[maybe_unused]] const int g_fork_handler = pthread_atfork(nullptr, nullptr, on_fork_child);

int32_t environment_threads() {
  static const int32_t threads = [] {
    if (int n = positive_env_int("MHA_NUM_THREADS")) return n;
    if (int n = positive_env_int("OMP_NUM_THREADS")) return n;
    return omp_get_num_procs();
  }();
  return threads;
}

// A team of fresh std::threads (the calling thread is thread 0), for a forked
// child: the same contract as the OpenMP team.
bool run_fresh_threads(int64_t n, int32_t team, TeamWork& work) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> ok{true};
  std::mutex mutex;
  std::condition_variable all_prepared;
  int32_t members = team, prepared = 0;  // guarded by mutex
  auto member = [&](int32_t thread) {
    if (!work.prepare(thread)) ok.store(false);
    {
      std::unique_lock<std::mutex> lock(mutex);
      ++prepared;
      all_prepared.notify_all();
      all_prepared.wait(lock, [&] { return prepared == members; });
    }
    if (!ok.load()) return;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work.run(i, thread);
  };
  std::vector<std::thread> helpers;
  try {
    helpers.reserve(static_cast<size_t>(team - 1));
    for (int32_t t = 1; t < team; ++t) helpers.emplace_back(member, t);
  } catch (...) {
    // A thread could not be started: the team is the ones that were, and no
    // item runs (the call reports it rather than running short-handed).
    ok.store(false);
    std::lock_guard<std::mutex> lock(mutex);
    members = 1 + static_cast<int32_t>(helpers.size());
    all_prepared.notify_all();
  }
  member(0);
  for (auto& t : helpers) t.join();
  return ok.load();
}

}  // namespace

int32_t num_threads() {
  if (g_forked.load(std::memory_order_relaxed) &&
      !g_child_chose_threads.load(std::memory_order_relaxed)) {
    return 1;
  }
  const int32_t api = g_api_threads.load(std::memory_order_relaxed);
  return api > 0 ? api : environment_threads();
}

void set_num_threads(int32_t n) {
  g_api_threads.store(n, std::memory_order_relaxed);
  if (g_forked.load(std::memory_order_relaxed)) {
    g_child_chose_threads.store(n > 0, std::memory_order_relaxed);
  }
}

bool in_forked_child() {
  return g_forked.load(std::memory_order_relaxed);
}

bool run_team(int64_t n, int32_t team, TeamWork& work) {
  if (team > n) team = static_cast<int32_t>(n);
  if (team <= 1 || omp_in_parallel()) {
    if (!work.prepare(0)) return false;
    for (int64_t i = 0; i < n; ++i) work.run(i, 0);
    return true;
  }
  if (in_forked_child()) return run_fresh_threads(n, team, work);

  std::atomic<bool> ok{true};
#pragma omp parallel num_threads(team)
  {
    const int32_t thread = omp_get_thread_num();
    if (!work.prepare(thread)) ok.store(false);
#pragma omp barrier
    // Every thread reads the same value here: nothing writes it after the barrier.
    if (ok.load()) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i) work.run(i, thread);
    }
  }
  return ok.load();
}

}  // namespace mha::rt
