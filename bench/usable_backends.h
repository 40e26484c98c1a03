// The backends this CPU can run, best first (as MHA_BACKEND=auto ranks them):
// what mha_bench and the module benchmarks register their benchmarks for.
#pragma once

#include <mha/mha.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mha_bench {

inline std::vector<std::string> usable_backends_best_first() {
  std::vector<std::pair<int32_t, std::string>> found;
  for (int32_t i = 0; i < mha_backend_count(); ++i) {
    mha_backend_info info;
    if (mha_backend_get_info(i, &info) == MHA_OK && info.usable) {
      found.emplace_back(info.priority, info.name);
    }
  }
  std::stable_sort(found.begin(), found.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> names;
  names.reserve(found.size());
  for (auto& entry : found) names.push_back(std::move(entry.second));
  return names;
}

}  // namespace mha_bench
