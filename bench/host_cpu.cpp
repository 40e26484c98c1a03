#include "host_cpu.h"

#include <fstream>

namespace mha_bench {
namespace {

std::string trimmed(const std::string& s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t") - first + 1);
}

}  // namespace

std::string host_cpu() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name, family, model, implementer, part;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) {
      if (!name.empty() || !part.empty()) break;  // the end of the first processor
      continue;
    }
    const std::string key = trimmed(line.substr(0, colon));
    const std::string value = trimmed(line.substr(colon + 1));
    if (key == "model name") name = value;
    if (key == "cpu family") family = value;
    if (key == "model") model = value;
    if (key == "CPU implementer") implementer = value;
    if (key == "CPU part") part = value;
  }
  if (!name.empty()) {
    return family.empty() ? name : name + " (family " + family + ", model " + model + ")";
  }
  if (!part.empty()) return "implementer " + implementer + " part " + part;
  return "unknown";
}

}  // namespace mha_bench
