#include "env.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "error.h"

namespace mha::rt {
namespace {

// A positive integer of at most 4096 at text, up to *end; 0 when there is none.
long leading_count(const char* text, const char** end) {
  long value = 0;
  const char* p = text;
  while (*p >= '0' && *p <= '9' && value <= 4096) value = value * 10 + (*p++ - '0');
  *end = p;
  return p == text || value > 4096 ? 0 : value;
}

}  // namespace

int positive_env_int(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return 0;
  // MHA_NUM_THREADS is one count; OMP_NUM_THREADS may be OpenMP's list of
  // counts per nesting level ("4,2"), of which the first applies.  Anything
  // else ("3,abc", "4 threads", "") is ignored, and said so.
  const bool list_allowed = std::strcmp(name, "OMP_NUM_THREADS") == 0;
  const char* end = nullptr;
  const long value = leading_count(text, &end);
  bool clean = value > 0 && (*end == '\0' || (list_allowed && *end == ','));
  while (clean && *end == ',') {
    const char* item_end = nullptr;
    clean = leading_count(end + 1, &item_end) > 0 && (*item_end == '\0' || *item_end == ',');
    end = item_end;
  }
  if (!clean) {
    const char* what = std::strstr(name, "THREADS") != nullptr ? "a thread count" : "a count";
    std::fprintf(stderr, "mha: ignoring %s=\"%s\" (not %s in 1..4096%s)\n", name,
                 printable(text).c_str(), what, list_allowed ? ", or a list of them" : "");
    return 0;
  }
  return static_cast<int>(value);
}

int verbose_level() {
  static const int level = [] {
    const char* text = std::getenv("MHA_VERBOSE");
    if (text == nullptr || *text == '\0') return 0;
    if (text[1] == '\0' && text[0] >= '0' && text[0] <= '2') return text[0] - '0';
    std::fprintf(stderr,
                 "mha: ignoring MHA_VERBOSE=\"%s\" (0: silent, 1: detection and choice, "
                 "2: also one line per call)\n",
                 printable(text).c_str());
    return 0;
  }();
  return level;
}

}  // namespace mha::rt
