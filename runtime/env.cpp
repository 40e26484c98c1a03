#include "env.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>

namespace mha::rt {

int positive_env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  const bool clean_end = *end == '\0' || *end == ',';
  if (errno != 0 || end == text || !clean_end || value <= 0 || value > 4096) {
    std::fprintf(stderr, "mha: ignoring %s=\"%s\" (not a thread count in 1..4096)\n", name, text);
    return 0;
  }
  return static_cast<int>(value);
}

int verbose_level() {
  static const int level = [] {
    const char* text = std::getenv("MHA_VERBOSE");
    if (text == nullptr) return 0;
    return static_cast<int>(std::strtol(text, nullptr, 10));
  }();
  return level;
}

}  // namespace mha::rt
