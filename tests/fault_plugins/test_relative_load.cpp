// libmha.so loaded by a relative path, then the program changes directory
// before its first call: plugins must still come from libmha's own directory,
// never from a "lib/" under the new working directory.  Traps (plugins that
// abort the process when loaded) are planted there under every known name.
//
//   test_relative_load <trap plugin> <how libmha is opened: a path or a soname>
//
// Run by ctest from the build tree with "./lib/libmha.so" (a relative path)
// and with "libmha.so.0" under LD_LIBRARY_PATH=lib.  This program does not
// link libmha: it opens it with dlopen, as ctypes and plugin hosts do.
#include <dlfcn.h>
#include <mha/mha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace {

int failed(const std::string& what) {
  std::fprintf(stderr, "test_relative_load: FAILED: %s\n", what.c_str());
  return 1;
}

bool copy_file(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary);
  out << in.rdbuf();
  return in.good() && out.good() && ::chmod(to.c_str(), 0755) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return failed("usage: test_relative_load <trap plugin> <libmha to open>");
  const std::string trap = argv[1], library = argv[2];

  void* handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return failed("dlopen(" + library + "): " + ::dlerror());
  Dl_info info{};
  auto* version = reinterpret_cast<const char* (*)()>(::dlsym(handle, "mha_version"));
  if (version == nullptr || ::dladdr(reinterpret_cast<void*>(version), &info) == 0) {
    return failed("mha_version not found");
  }
  std::printf("libmha loaded as %s\n", info.dli_fname);
  if (info.dli_fname[0] == '/') return failed("the loader resolved the path: nothing is tested");

  char scratch[] = "/tmp/mha-relative-load-XXXXXX";
  if (::mkdtemp(scratch) == nullptr) return failed("mkdtemp");
  const std::string root = scratch;
  if (::mkdir((root + "/lib").c_str(), 0755) != 0) return failed("mkdir");
  for (const char* name : {"scalar", "avx2", "avx512", "avx512bf16", "neon"}) {
    if (!copy_file(trap, root + "/lib/libmha-backend-" + name + ".so")) {
      return failed("cannot plant the trap in " + root);
    }
  }
  if (::chdir(root.c_str()) != 0) return failed("chdir");

  // The first call: the registry probes the plugins now.
  auto* selected = reinterpret_cast<const char* (*)()>(::dlsym(handle, "mha_selected_backend"));
  auto* last_error = reinterpret_cast<const char* (*)()>(::dlsym(handle, "mha_last_error"));
  if (selected == nullptr || last_error == nullptr) return failed("symbols missing");
  const char* backend = selected();
  for (const char* name : {"scalar", "avx2", "avx512", "avx512bf16", "neon"}) {
    std::remove((root + "/lib/libmha-backend-" + name + ".so").c_str());
  }
  ::rmdir((root + "/lib").c_str());
  ::rmdir(root.c_str());
  if (backend == nullptr) return failed(std::string("no backend selected: ") + last_error());
  std::printf("selected backend %s, from libmha's own directory\n", backend);
  std::printf("PASSED\n");
  return 0;
}
