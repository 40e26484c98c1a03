// Backend choice through MHA_BACKEND, and the thread count through
// MHA_NUM_THREADS / OMP_NUM_THREADS.  The environment is set per ctest entry
// (the ENVIRONMENT property); nothing here starts a process.
//
// Environment read by these tests (set by tests/CMakeLists.txt):
//   MHA_TEST_REQUESTED_BACKEND  what the entry put in MHA_BACKEND ("<unset>" when unset)
//   MHA_TEST_EXPECT_THREADS     the thread count the entry expects ("cores": all of them)
#include <gtest/gtest.h>
#include <mha/mha.h>
#include <sched.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "reference.h"
#include "small_call.h"
#include "test_util.h"

namespace mha_test {
namespace {

// The value of MHA_BACKEND this entry was started with; fails the test when
// the entry's ENVIRONMENT and what the process sees disagree.
std::string requested_backend() {
  const std::string declared = env("MHA_TEST_REQUESTED_BACKEND", "<not declared>");
  std::string actual = env("MHA_BACKEND", "<unset>");
  if (declared != "<not declared>") {
    EXPECT_EQ(actual, declared) << "the ctest ENVIRONMENT did not reach the test";
  }
  return actual;
}

// The backends a refusal lists as usable: its text after "usable backends: ",
// up to a parenthesis or the end.
std::string usable_list(const std::string& message) {
  const std::string tag = "usable backends: ";
  const size_t at = message.find(tag);
  if (at == std::string::npos) return {};
  const std::string rest = message.substr(at + tag.size());
  return rest.substr(0, rest.find(" ("));
}

void expect_unavailable_everywhere(const std::string& requested, const BackendEntry* known) {
  const auto backends = list_backends();
  EXPECT_EQ(mha_selected_backend(), nullptr) << "MHA_BACKEND=" << requested;
  const std::string why = mha_last_error();
  EXPECT_NE(why.find(requested), std::string::npos) << why;
  // Scalar is always usable, and the refusal says so (it probes the plugins
  // MHA_BACKEND's name had left unloaded).
  EXPECT_NE(usable_list(why).find("scalar"), std::string::npos)
      << "does not name the usable backends: " << why;
  if (known != nullptr) {
    EXPECT_FALSE(known->reason.empty());
    EXPECT_NE(why.find(known->reason), std::string::npos) << "does not say why: " << why;
  }

  SmallCall p;
  const std::vector<float> before = p.out.all();
  EXPECT_EQ(p.call(), MHA_ERR_BACKEND_UNAVAILABLE);
  const std::string message = mha_last_error();
  EXPECT_NE(message.find("scalar"), std::string::npos) << message;
  EXPECT_NE(message.find(requested), std::string::npos) << message;
  EXPECT_TRUE(p.out.bits_equal(before)) << "a failed call wrote out";
  // Calls keep failing: no silent fallback.
  EXPECT_EQ(p.call(), MHA_ERR_BACKEND_UNAVAILABLE);

  // The API overrides the environment.
  ASSERT_EQ(mha_select_backend("scalar"), MHA_OK) << mha_last_error();
  ASSERT_NE(mha_selected_backend(), nullptr);
  EXPECT_STREQ(mha_selected_backend(), "scalar");
  ASSERT_EQ(p.call(), MHA_OK) << mha_last_error();
  p.expect_correct();
}

TEST(BackendEnv, SelectionFollowsEnvironment) {
  const std::string requested = requested_backend();
  const auto backends = list_backends();
  ASSERT_FALSE(backends.empty());
  if (requested == "<unset>" || requested == "auto") {
    const BackendEntry* best = best_usable(backends);
    ASSERT_NE(best, nullptr) << "no usable backend";
    const char* selected = mha_selected_backend();
    ASSERT_NE(selected, nullptr) << mha_last_error();
    EXPECT_EQ(std::string(selected), best->name) << "auto must pick the highest priority";
    SmallCall p;
    ASSERT_EQ(p.call(), MHA_OK) << mha_last_error();
    p.expect_correct();
    return;
  }
  const BackendEntry* entry = find_backend(backends, requested);
  if (entry != nullptr && entry->usable) {
    const char* selected = mha_selected_backend();
    ASSERT_NE(selected, nullptr) << mha_last_error();
    EXPECT_EQ(std::string(selected), requested);
    SmallCall p;
    ASSERT_EQ(p.call(), MHA_OK) << mha_last_error();
    p.expect_correct();
    return;
  }
  std::printf("MHA_BACKEND=%s is %s here: expecting MHA_ERR_BACKEND_UNAVAILABLE\n",
              requested.c_str(), entry == nullptr ? "unknown" : "not usable");
  expect_unavailable_everywhere(requested, entry);
}

TEST(BackendSelection, ApiOverridesAndFailedSelectionKeepsChoice) {
  const auto backends = list_backends();
  for (const auto& b : backends) {
    if (!b.usable) continue;
    SCOPED_TRACE(b.name);
    ASSERT_EQ(mha_select_backend(b.name.c_str()), MHA_OK) << mha_last_error();
    ASSERT_NE(mha_selected_backend(), nullptr);
    EXPECT_EQ(std::string(mha_selected_backend()), b.name);
    SmallCall p;
    ASSERT_EQ(p.call(), MHA_OK) << mha_last_error();
    p.expect_correct();
    EXPECT_EQ(mha_select_backend("nonsense"), MHA_ERR_BACKEND_UNAVAILABLE);
    ASSERT_NE(mha_selected_backend(), nullptr);
    EXPECT_EQ(std::string(mha_selected_backend()), b.name) << "a failed selection changed it";
  }
  ASSERT_EQ(mha_select_backend("auto"), MHA_OK);
  const BackendEntry* best = best_usable(backends);
  ASSERT_NE(best, nullptr);
  ASSERT_NE(mha_selected_backend(), nullptr);
  EXPECT_EQ(std::string(mha_selected_backend()), best->name);
}

TEST(BackendSelection, ForeignArchitectureBackendIsRefused) {
#if defined(__x86_64__)
  const std::string foreign = "neon";
#elif defined(__aarch64__)
  const std::string foreign = "avx2";
#else
  GTEST_SKIP() << "neither x86-64 nor aarch64";
  const std::string foreign;
#endif
  const auto backends = list_backends();
  const BackendEntry* entry = find_backend(backends, foreign);
  ASSERT_NE(entry, nullptr) << foreign << " must be listed (known, installed or not)";
  EXPECT_FALSE(entry->usable);
  EXPECT_FALSE(entry->reason.empty());
  ASSERT_EQ(mha_select_backend("scalar"), MHA_OK);
  EXPECT_EQ(mha_select_backend(foreign.c_str()), MHA_ERR_BACKEND_UNAVAILABLE);
  const std::string message = mha_last_error();
  EXPECT_NE(message.find(entry->reason), std::string::npos) << message;
  EXPECT_NE(message.find("scalar"), std::string::npos) << message;
  ASSERT_NE(mha_selected_backend(), nullptr);
  EXPECT_STREQ(mha_selected_backend(), "scalar");
}

// ------------------------------------------------------------------ threads

int32_t cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int32_t>(std::thread::hardware_concurrency());
}

// A positive thread count from the environment, or 0.  OMP_NUM_THREADS may be
// a list ("4,2"): the first entry counts.
int32_t env_threads(const char* name) {
  const std::string text = env(name);
  if (text.empty()) return 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || (*end != '\0' && *end != ',') || value <= 0) return 0;
  return static_cast<int32_t>(value);
}

TEST(Threads, Precedence) {
  int32_t expected = 0;
  const std::string declared = env("MHA_TEST_EXPECT_THREADS");
  if (declared == "cores") {
    expected = cores();
  } else if (!declared.empty()) {
    expected = static_cast<int32_t>(std::strtol(declared.c_str(), nullptr, 10));
  } else {
    expected = env_threads("MHA_NUM_THREADS");
    if (expected == 0) expected = env_threads("OMP_NUM_THREADS");
    if (expected == 0) expected = cores();
  }
  ASSERT_GT(expected, 0);
  std::printf("MHA_NUM_THREADS=%s OMP_NUM_THREADS=%s: expecting %d threads\n",
              env("MHA_NUM_THREADS", "<unset>").c_str(), env("OMP_NUM_THREADS", "<unset>").c_str(),
              expected);
  EXPECT_EQ(mha_get_num_threads(), expected);

  SmallCall p;  // and calls work with that many threads
  ASSERT_EQ(p.call(), MHA_OK) << mha_last_error();
  p.expect_correct();

  // The setter outranks the environment; 0 returns to it.
  for (const int32_t n : {1, 5, expected + 1}) {
    ASSERT_EQ(mha_set_num_threads(n), MHA_OK);
    EXPECT_EQ(mha_get_num_threads(), n);
  }
  SmallCall p5;
  ASSERT_EQ(mha_set_num_threads(5), MHA_OK);
  ASSERT_EQ(p5.call(), MHA_OK) << mha_last_error();
  p5.expect_correct();
  ASSERT_EQ(mha_set_num_threads(0), MHA_OK);
  EXPECT_EQ(mha_get_num_threads(), expected);
}

}  // namespace
}  // namespace mha_test
