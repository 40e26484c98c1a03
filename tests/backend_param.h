// Tests parameterised over every backend the runtime knows: the fixture
// selects the backend of the parameter (and skips one this CPU cannot run),
// the generator lists the backends, the namer makes the test name.
#pragma once

#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cctype>
#include <string>
#include <vector>

#include "test_util.h"

namespace mha_test {

class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string& name = GetParam();
    const auto backends = list_backends();
    const BackendEntry* entry = find_backend(backends, name);
    ASSERT_NE(entry, nullptr) << "backend " << name << " disappeared";
    if (!entry->usable) {
      GTEST_SKIP() << "backend '" << name << "' is not usable on this machine: " << entry->reason;
    }
    ASSERT_EQ(mha_select_backend(name.c_str()), MHA_OK) << mha_last_error();
    const char* selected = mha_selected_backend();
    ASSERT_NE(selected, nullptr) << mha_last_error();
    ASSERT_EQ(std::string(selected), name);
    ASSERT_EQ(mha_set_num_threads(0), MHA_OK);
  }
  void TearDown() override { mha_set_num_threads(0); }
};

inline std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto& entry : list_backends()) names.push_back(entry.name);
  return names;
}

inline std::string backend_param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

}  // namespace mha_test
