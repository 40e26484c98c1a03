#include "library_dir.h"

#include <dlfcn.h>
#include <limits.h>
#include <mha/mha.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace mha::rt {
namespace {

// Written once by the constructor below, read-only afterwards.
char g_directory[PATH_MAX] = "";
char g_error[PATH_MAX + 128] = "";

// Runs when libmha.so is loaded.  It only records a path: it loads no plugin
// and starts nothing (dladdr and realpath are plain library calls).
__attribute__((constructor)) void record_library_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&mha_version), &info) == 0 || info.dli_fname == nullptr) {
    std::snprintf(g_error, sizeof g_error, "dladdr cannot tell where libmha.so was loaded from");
    return;
  }
  char resolved[PATH_MAX];
  if (::realpath(info.dli_fname, resolved) == nullptr) {
    std::snprintf(g_error, sizeof g_error,
                  "cannot resolve the path libmha.so was loaded from (%.*s): %s", 1024,
                  info.dli_fname, std::strerror(errno));
    return;
  }
  char* slash = std::strrchr(resolved, '/');
  if (slash == nullptr || resolved[0] != '/') {
    std::snprintf(g_error, sizeof g_error, "the resolved path of libmha.so is not absolute");
    return;
  }
  *(slash == resolved ? slash + 1 : slash) = '\0';  // "/libmha.so" -> "/"
  std::snprintf(g_directory, sizeof g_directory, "%s", resolved);
}

}  // namespace

std::string library_directory(std::string* why) {
  if (g_directory[0] == '\0' && why != nullptr) {
    *why = g_error[0] != '\0' ? g_error : "the directory of libmha.so was not recorded";
  }
  return g_directory;
}

}  // namespace mha::rt
