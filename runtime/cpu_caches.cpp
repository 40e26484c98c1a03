#include "cpu_caches.h"

#include <unistd.h>

#include "error.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace mha::rt {
namespace {

// "48K" -> 49152; 0 when the text is not a size.
int64_t parse_size(const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || value <= 0) return 0;
  int shift = 0;
  switch (*end) {
    case 'K':
    case 'k':
      shift = 10;
      ++end;
      break;
    case 'M':
    case 'm':
      shift = 20;
      ++end;
      break;
    case 'G':
    case 'g':
      shift = 30;
      ++end;
      break;
    default:
      break;
  }
  if (*end == 'B' || *end == 'b') ++end;  // "32KB" as lscpu and some sysfs entries say
  if (*end != '\0' || value > (int64_t{1} << 40) >> shift) return 0;
  return static_cast<int64_t>(value) << shift;
}

// One cache's size from sysfs: the index whose level and type match.
int64_t sysfs_cache(int level, const char* type) {
  for (int index = 0; index < 16; ++index) {
    const std::string dir =
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
    if (!level_file || !type_file || !size_file) continue;
    int found_level = 0;
    std::string found_type, size;
    level_file >> found_level;
    type_file >> found_type;
    size_file >> size;
    if (found_level == level && (found_type == type || found_type == "Unified")) {
      return parse_size(size);
    }
  }
  return 0;
}

// sysfs first: it describes the cache instance cpu0 belongs to.  glibc's
// sysconf can say otherwise -- on an AMD EPYC (family 26 model 2) under KVM
// glibc 2.36 gave an L3 of 384 MiB, the whole socket's, where sysfs and lscpu
// give the 32 MiB its cores share.
int64_t detect(int sysconf_name, int level, const char* type) {
  if (const int64_t bytes = sysfs_cache(level, type); bytes > 0) return bytes;
  const long bytes = ::sysconf(sysconf_name);
  return bytes > 0 ? bytes : 0;
}

// Parses "l1d=32K,l2=1M,l3=32M" (any subset) into the sizes it names, leaving
// the others; false with the reason in *error when the text is malformed.
bool parse_cache_sizes(const char* text, mha_cache_sizes* sizes, std::string* error) {
  mha_cache_sizes parsed = *sizes;
  const std::string all = text;
  std::string seen;  // the names given so far, each followed by ','
  size_t start = 0;
  while (true) {
    const size_t comma = all.find(',', start);
    const std::string item = all.substr(start, comma == std::string::npos ? comma : comma - start);
    const size_t equals = item.find('=');
    const std::string name = item.substr(0, equals);
    // Digits first: strtoll would also take a sign or leading spaces.
    const std::string size = equals == std::string::npos ? "" : item.substr(equals + 1);
    const bool digits_first = !size.empty() && size[0] >= '0' && size[0] <= '9';
    const int64_t bytes = digits_first ? parse_size(size) : 0;
    int64_t* slot = name == "l1d"  ? &parsed.l1d
                    : name == "l2" ? &parsed.l2
                    : name == "l3" ? &parsed.l3
                                   : nullptr;
    if (slot == nullptr || bytes == 0) {
      *error = "'" + item + "' is not l1d=, l2= or l3= with a size such as 48K or 2M";
      return false;
    }
    if (seen.find(name + ",") != std::string::npos) {
      *error = name + " is given twice";
      return false;
    }
    seen += name + ",";
    *slot = bytes;
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  *sizes = parsed;
  return true;
}

mha_cache_sizes detect_all() {
  mha_cache_sizes out{};
  out.l1d = detect(_SC_LEVEL1_DCACHE_SIZE, 1, "Data");
  out.l2 = detect(_SC_LEVEL2_CACHE_SIZE, 2, "Unified");
  out.l3 = detect(_SC_LEVEL3_CACHE_SIZE, 3, "Unified");
  if (const char* text = std::getenv("MHA_CACHE_SIZES"); text != nullptr && *text != '\0') {
    mha_cache_sizes given = out;
    std::string why;
    if (parse_cache_sizes(text, &given, &why)) {
      out = given;
    } else {
      std::fprintf(stderr, "mha: ignoring MHA_CACHE_SIZES=\"%s\" (%s)\n",
                   printable(text, 128).c_str(), printable(why.c_str(), 128).c_str());
    }
  }
  return out;
}

}  // namespace

const mha_cache_sizes& cpu_caches() {
  static const mha_cache_sizes caches = detect_all();
  return caches;
}

}  // namespace mha::rt
