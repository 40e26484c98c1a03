// Plugin faults: the runtime loads plugins from MHA_PLUGIN_DIR, a directory
// the build filled with copies of the real plugins and one broken plugin (see
// CMakeLists.txt).  Each ctest entry sets the environment; nothing here starts
// a process.
//
// Environment read by these tests:
//   MHA_TEST_FAULT_BACKEND     the name under which the broken backend is listed
//   MHA_TEST_FAULT_REASON      text its reason must contain
//   MHA_TEST_FAULT_NONE_USABLE "1" when no backend at all can be usable
//   MHA_TEST_REQUESTED_BACKEND what the entry put in MHA_BACKEND ("<unset>")
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "reference.h"
#include "small_call.h"
#include "test_util.h"

namespace mha_test {
namespace {

class PluginFault : public ::testing::Test {
 protected:
  void SetUp() override {
    broken_ = env("MHA_TEST_FAULT_BACKEND");
    reason_ = env("MHA_TEST_FAULT_REASON");
    none_usable_ = env("MHA_TEST_FAULT_NONE_USABLE") == "1";
    requested_ = env("MHA_TEST_REQUESTED_BACKEND");
    ASSERT_FALSE(broken_.empty()) << "MHA_TEST_FAULT_BACKEND is not set: run through ctest";
    ASSERT_FALSE(reason_.empty());
    ASSERT_FALSE(env("MHA_PLUGIN_DIR").empty()) << "MHA_PLUGIN_DIR is not set";
    const char* actual = std::getenv("MHA_BACKEND");
    ASSERT_EQ(requested_, actual != nullptr ? actual : "<unset>")
        << "the ctest environment did not reach the test";
  }
  std::string broken_, reason_, requested_;
  bool none_usable_ = false;
};

TEST_F(PluginFault, TheBrokenBackendIsListedWithItsReason) {
  const auto backends = list_backends();
  const BackendEntry* entry = find_backend(backends, broken_);
  ASSERT_NE(entry, nullptr) << broken_ << " is not listed";
  EXPECT_FALSE(entry->usable) << broken_ << " is usable";
  EXPECT_NE(entry->reason.find(reason_), std::string::npos)
      << "reason \"" << entry->reason << "\" does not contain \"" << reason_ << "\"";
  // A reason is a sentence that says what is wrong, not one cut off before
  // the part that matters ("lacks " followed by nothing).
  ASSERT_FALSE(entry->reason.empty());
  const char last = entry->reason.back();
  EXPECT_TRUE(last != ' ' && last != ':' && last != ',')
      << "reason \"" << entry->reason << "\" ends abruptly";
  for (const auto& b : backends) {
    if (b.usable) {
      EXPECT_TRUE(b.reason.empty()) << b.name << ": " << b.reason;
    } else {
      EXPECT_FALSE(b.reason.empty()) << b.name << " is unusable without a reason";
    }
  }
  if (none_usable_) {
    for (const auto& b : backends) {
      EXPECT_FALSE(b.usable) << b.name;
    }
  }
}

TEST_F(PluginFault, AutoSkipsItAndPicksTheBestRemaining) {
  if (requested_ != "<unset>" && requested_ != "auto") GTEST_SKIP() << "a backend is named";
  const auto backends = list_backends();
  SmallCall c;
  const std::vector<float> before = c.out.all();
  if (none_usable_) {
    EXPECT_EQ(mha_selected_backend(), nullptr);
    const std::string why = mha_last_error();
    EXPECT_NE(why.find("no usable backend"), std::string::npos) << why;
    EXPECT_EQ(c.call(), MHA_ERR_BACKEND_UNAVAILABLE);
    EXPECT_FALSE(std::string(mha_last_error()).empty());
    EXPECT_TRUE(c.out.bits_equal(before)) << "a failed call wrote out";
    EXPECT_EQ(mha_select_backend("scalar"), MHA_ERR_BACKEND_UNAVAILABLE);
    EXPECT_NE(std::string(mha_last_error()).find(reason_), std::string::npos) << mha_last_error();
    return;
  }
  const BackendEntry* best = best_usable(backends);
  ASSERT_NE(best, nullptr) << "no usable backend: the real plugins were not copied?";
  EXPECT_NE(best->name, broken_);
  const char* selected = mha_selected_backend();
  ASSERT_NE(selected, nullptr) << mha_last_error();
  EXPECT_EQ(std::string(selected), best->name);
  EXPECT_NE(find_backend(backends, "scalar"), nullptr);
  EXPECT_TRUE(find_backend(backends, "scalar")->usable) << "the copied scalar plugin is unusable";
  ASSERT_EQ(c.call(), MHA_OK) << mha_last_error();
  c.expect_correct();

  // Asking for the broken one through the API fails, says why, and keeps the choice.
  EXPECT_EQ(mha_select_backend(broken_.c_str()), MHA_ERR_BACKEND_UNAVAILABLE);
  const std::string message = mha_last_error();
  EXPECT_NE(message.find(broken_), std::string::npos) << message;
  EXPECT_NE(message.find(reason_), std::string::npos) << message;
  ASSERT_NE(mha_selected_backend(), nullptr);
  EXPECT_EQ(std::string(mha_selected_backend()), best->name);
}

TEST_F(PluginFault, NamingItMakesCallsFailWithTheReason) {
  if (requested_ != broken_) GTEST_SKIP() << "MHA_BACKEND does not name the broken backend";
  EXPECT_EQ(mha_selected_backend(), nullptr);
  const std::string why = mha_last_error();
  EXPECT_NE(why.find(broken_), std::string::npos) << why;
  EXPECT_NE(why.find(reason_), std::string::npos) << why;

  SmallCall c;
  const std::vector<float> before = c.out.all();
  for (int attempt = 0; attempt < 2; ++attempt) {  // no silent fallback, ever
    EXPECT_EQ(c.call(), MHA_ERR_BACKEND_UNAVAILABLE);
    const std::string message = mha_last_error();
    EXPECT_NE(message.find(broken_), std::string::npos) << message;
    EXPECT_NE(message.find(reason_), std::string::npos) << message;
    EXPECT_TRUE(c.out.bits_equal(before)) << "a failed call wrote out";
  }
  if (none_usable_) return;
  ASSERT_EQ(mha_select_backend("auto"), MHA_OK) << mha_last_error();
  ASSERT_EQ(c.call(), MHA_OK) << mha_last_error();
  c.expect_correct();
}

}  // namespace
}  // namespace mha_test

namespace mha_test {
namespace {

// Which plugin files the runtime loads: the traps (FAULT_ABORT_ON_LOAD) abort
// the process if it ever dlopens them.
constexpr int32_t kKnownBackends = 5;  // scalar, avx2, avx512, avx512bf16, neon

TEST(PluginLoading, UnknownFilesAreNeverLoaded) {
  const std::string stray = env("MHA_TEST_STRAY");
  ASSERT_FALSE(stray.empty()) << "run through ctest";
  const auto backends = list_backends();
  EXPECT_EQ(static_cast<int32_t>(backends.size()), kKnownBackends);
  EXPECT_EQ(find_backend(backends, stray), nullptr) << stray << " is listed";
  const BackendEntry* best = best_usable(backends);
  ASSERT_NE(best, nullptr);
  ASSERT_NE(mha_selected_backend(), nullptr) << mha_last_error();
  EXPECT_EQ(std::string(mha_selected_backend()), best->name);
  EXPECT_EQ(mha_select_backend(stray.c_str()), MHA_ERR_BACKEND_UNAVAILABLE);
  EXPECT_NE(std::string(mha_last_error()).find("unknown"), std::string::npos) << mha_last_error();
  SmallCall c;
  ASSERT_EQ(c.call(), MHA_OK) << mha_last_error();
  c.expect_correct();
}

TEST(PluginLoading, OnlyTheNamedPluginIsLoaded) {
  const std::string trap = env("MHA_TEST_TRAP");
  ASSERT_FALSE(trap.empty()) << "run through ctest";
  ASSERT_STREQ(std::getenv("MHA_BACKEND"), "scalar");
  ASSERT_NE(mha_selected_backend(), nullptr) << mha_last_error();
  EXPECT_STREQ(mha_selected_backend(), "scalar");
  const auto backends = list_backends();
  const BackendEntry* trapped = find_backend(backends, trap);
  ASSERT_NE(trapped, nullptr);
  EXPECT_FALSE(trapped->usable);
  EXPECT_NE(trapped->reason.find("not loaded"), std::string::npos) << trapped->reason;
  SmallCall c;
  ASSERT_EQ(c.call(), MHA_OK) << mha_last_error();
  c.expect_correct();
#if defined(__x86_64__)
  // Another real plugin is loaded when the program asks for it.
  if (std::string(mha_cpu_features()).find("avx2") != std::string::npos) {
    ASSERT_EQ(mha_select_backend("avx2"), MHA_OK) << mha_last_error();
    EXPECT_STREQ(mha_selected_backend(), "avx2");
    SmallCall d;
    ASSERT_EQ(d.call(), MHA_OK) << mha_last_error();
    d.expect_correct();
  }
#endif
}

TEST(PluginLoading, PriorityClaimsAreIgnored) {
  const auto backends = list_backends();
  const BackendEntry* scalar = find_backend(backends, "scalar");
  ASSERT_NE(scalar, nullptr);
  ASSERT_TRUE(scalar->usable) << scalar->reason;
  EXPECT_EQ(scalar->priority, 0) << "the plugin's claim of 1000 was taken";
  const BackendEntry* best = best_usable(backends);
  ASSERT_NE(best, nullptr);
  ASSERT_NE(mha_selected_backend(), nullptr) << mha_last_error();
  EXPECT_EQ(std::string(mha_selected_backend()), best->name);
  if (best->name == "scalar") GTEST_SKIP() << "only scalar is usable on this CPU";
}

// A plugin may decline a validated call through supports(): the call fails
// with MHA_ERR_UNSUPPORTED, naming the backend and the plugin's reason, and
// writes nothing.
TEST(PluginLoading, DeclinedCallsFailWithThePluginsReason) {
  ASSERT_NE(mha_selected_backend(), nullptr) << mha_last_error();
  EXPECT_STREQ(mha_selected_backend(), "scalar");
  SmallCall c;
  const std::vector<float> before = c.out.all();
  EXPECT_EQ(c.call(), MHA_ERR_UNSUPPORTED);
  const std::string message = mha_last_error();
  EXPECT_NE(message.find("scalar"), std::string::npos) << message;
  EXPECT_NE(message.find("no kernel for this test's calls"), std::string::npos) << message;
  EXPECT_TRUE(c.out.bits_equal(before)) << "a declined call wrote out";
  EXPECT_STREQ(mha_status_name(MHA_ERR_UNSUPPORTED), "MHA_ERR_UNSUPPORTED");
}

}  // namespace
}  // namespace mha_test
