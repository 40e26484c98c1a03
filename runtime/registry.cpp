#include "registry.h"

#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu_features.h"
#include "env.h"
#include "error.h"

namespace mha::rt {
namespace {

constexpr const char* kPrefix = "libmha-backend-";
constexpr const char* kSuffix = ".so";

// Backends the runtime knows by name, so it can say "not this architecture"
// instead of "missing".
struct KnownBackend {
  const char* name;
  uint32_t arch;
};
constexpr KnownBackend kKnown[] = {
    {"scalar", MHA_CPU_ARCH_X86_64 | MHA_CPU_ARCH_AARCH64},
    {"avx2", MHA_CPU_ARCH_X86_64},
    {"avx512", MHA_CPU_ARCH_X86_64},
    {"neon", MHA_CPU_ARCH_AARCH64},
};

std::string directory_of_this_library() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&mha_version), &info) == 0 || info.dli_fname == nullptr) {
    return {};
  }
  std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string{} : path.substr(0, slash);
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Extra plugins in the directory (beyond the known names), sorted for a stable order.
std::vector<std::string> plugin_names_in(const std::string& directory) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(directory.c_str());
  if (dir == nullptr) return names;
  const size_t prefix = std::strlen(kPrefix), suffix = std::strlen(kSuffix);
  while (const dirent* entry = ::readdir(dir)) {
    const std::string file = entry->d_name;
    if (file.size() <= prefix + suffix || file.compare(0, prefix, kPrefix) != 0 ||
        file.compare(file.size() - suffix, suffix, kSuffix) != 0) {
      continue;
    }
    names.push_back(file.substr(prefix, file.size() - prefix - suffix));
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

const char* arch_name(uint32_t arch) {
  if (arch & MHA_CPU_ARCH_X86_64) return "x86-64";
  if (arch & MHA_CPU_ARCH_AARCH64) return "aarch64";
  return "another architecture";
}

}  // namespace

Registry& Registry::instance() {
  static Registry registry;
  return registry;
}

Registry::Registry() {
  const uint32_t cpu = cpu_features();
  const int verbose = verbose_level();
  if (verbose >= 1) std::fprintf(stderr, "mha: cpu features: %s\n", feature_names(cpu).c_str());

  std::string directory = directory_of_this_library();
  std::string directory_error;
  if (const char* env = std::getenv("MHA_PLUGIN_DIR"); env != nullptr && *env != '\0') {
    if (env[0] == '/') {
      directory = env;
    } else {
      directory_error = std::string("MHA_PLUGIN_DIR=\"") + env +
                        "\" is not an absolute path; plugins are only loaded from an absolute, "
                        "trusted directory";
    }
  } else if (directory.empty()) {
    directory_error = "cannot find the directory libmha.so was loaded from";
  }
  if (verbose >= 1) {
    std::fprintf(stderr, "mha: plugin directory: %s\n",
                 directory_error.empty() ? directory.c_str() : directory_error.c_str());
  }

  for (const auto& known : kKnown)
    backends_.push_back(Backend{known.name, {}, 0, false, {}, nullptr});
  if (directory_error.empty()) {
    for (const auto& name : plugin_names_in(directory)) {
      const bool listed = std::any_of(backends_.begin(), backends_.end(),
                                      [&](const Backend& b) { return b.name == name; });
      if (!listed) backends_.push_back(Backend{name, {}, 0, false, {}, nullptr});
    }
  }

  for (auto& backend : backends_) {
    const auto known = std::find_if(std::begin(kKnown), std::end(kKnown),
                                    [&](const KnownBackend& k) { return backend.name == k.name; });
    if (known != std::end(kKnown) && !(known->arch & cpu)) {
      backend.reason =
          std::string("not this architecture (built for ") + arch_name(known->arch) + " only)";
    } else if (!directory_error.empty()) {
      backend.reason = directory_error;
    } else {
      backend.path = directory + "/" + kPrefix + backend.name + kSuffix;
      probe(backend, cpu);
    }
    if (verbose >= 1) {
      if (backend.usable) {
        std::fprintf(stderr, "mha: backend %s: usable (priority %d, %s)\n", backend.name.c_str(),
                     backend.priority, backend.path.c_str());
      } else {
        std::fprintf(stderr, "mha: backend %s: not usable: %s\n", backend.name.c_str(),
                     backend.reason.c_str());
      }
    }
  }

  for (const auto& backend : backends_) {
    if (!backend.usable) continue;
    if (!usable_names_.empty()) usable_names_ += ", ";
    usable_names_ += backend.name;
  }
  if (usable_names_.empty()) usable_names_ = "none";

  const char* requested = std::getenv("MHA_BACKEND");
  if (requested == nullptr || *requested == '\0') requested = "auto";
  const Backend* initial = resolve(requested, &environment_error_);
  selected_.store(initial);
  if (verbose >= 1) {
    if (initial != nullptr) {
      std::fprintf(stderr, "mha: selected backend %s (MHA_BACKEND=%s)\n", initial->name.c_str(),
                   requested);
    } else {
      std::fprintf(stderr, "mha: no backend selected: %s\n", environment_error_.c_str());
    }
  }
}

void Registry::probe(Backend& backend, uint32_t cpu) {
  if (!file_exists(backend.path)) {
    backend.reason = "not installed (" + backend.path + " is missing)";
    return;
  }
  // RTLD_LOCAL keeps each plugin's symbols to itself; a plugin runs no code of
  // its own at load time (no ISA instructions before the feature check).
  void* handle = ::dlopen(backend.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    backend.reason = std::string("cannot be loaded: ") + (why != nullptr ? why : "dlopen failed");
    return;
  }
  auto entry = reinterpret_cast<mha_plugin_entry_fn>(::dlsym(handle, MHA_PLUGIN_ENTRY_SYMBOL));
  const mha_plugin* plugin = entry != nullptr ? entry() : nullptr;
  if (plugin == nullptr) {
    backend.reason = entry == nullptr ? "not an mha plugin (no mha_plugin_entry symbol)"
                                      : "its mha_plugin_entry returned no table";
    ::dlclose(handle);
    return;
  }
  if (plugin->abi_version != MHA_PLUGIN_ABI_VERSION) {
    backend.reason = "plugin ABI version " + std::to_string(plugin->abi_version) +
                     ", this runtime needs " + std::to_string(MHA_PLUGIN_ABI_VERSION);
    ::dlclose(handle);
    return;
  }
  if (plugin->struct_size < sizeof(mha_plugin) || plugin->name == nullptr ||
      plugin->attend == nullptr || plugin->scratch_bytes == nullptr || plugin->query_tile <= 0 ||
      plugin->key_tile <= 0 || plugin->vector_floats <= 0) {
    backend.reason = "malformed plugin table";
    ::dlclose(handle);
    return;
  }
  if (backend.name != plugin->name) {
    backend.reason = std::string("the file names backend '") + backend.name +
                     "' but the plugin calls itself '" + plugin->name + "'";
    ::dlclose(handle);
    return;
  }
  backend.priority = plugin->priority;
  const uint32_t missing = plugin->required_cpu_features & ~cpu;
  if (missing != 0) {
    backend.reason = "this CPU (or OS) lacks " + feature_names(missing);
    // Keep the handle: nothing of it runs, and unloading gains nothing.
    return;
  }
  if (plugin->init != nullptr) {
    char message[256] = "";
    if (plugin->init(message, sizeof message) != 0) {
      backend.reason = std::string("its initialisation failed: ") +
                       (message[0] != '\0' ? message : "no reason given");
      return;
    }
  }
  backend.plugin = plugin;
  backend.usable = true;
}

const Backend* Registry::best_usable() const {
  const Backend* best = nullptr;
  for (const auto& backend : backends_) {
    if (backend.usable && (best == nullptr || backend.priority > best->priority)) best = &backend;
  }
  return best;
}

const Backend* Registry::resolve(const char* name, std::string* error) const {
  if (std::strcmp(name, "auto") == 0) {
    const Backend* best = best_usable();
    if (best == nullptr) *error = "no usable backend: see mha-info";
    return best;
  }
  // A name is quoted at most 64 characters long, so the list of usable
  // backends always fits in the message.
  const auto it = std::find_if(backends_.begin(), backends_.end(),
                               [&](const Backend& b) { return b.name == name; });
  char quoted[80];
  std::snprintf(quoted, sizeof quoted, "backend '%.64s%s'", name,
                std::strlen(name) > 64 ? "..." : "");
  if (it == backends_.end()) {
    *error = std::string(quoted) + " is unknown; usable backends: " + usable_names_;
    return nullptr;
  }
  if (!it->usable) {
    *error = std::string(quoted) + " is not usable: " + it->reason +
             "; usable backends: " + usable_names_;
    return nullptr;
  }
  return &*it;
}

const Backend* Registry::selected(const char** why) const {
  const Backend* backend = selected_.load(std::memory_order_acquire);
  if (backend == nullptr && why != nullptr) *why = environment_error_.c_str();
  return backend;
}

mha_status Registry::select(const char* name) {
  std::string error;
  const Backend* backend = resolve(name, &error);
  if (backend == nullptr) return fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", error.c_str());
  selected_.store(backend, std::memory_order_release);
  if (verbose_level() >= 1) {
    std::fprintf(stderr, "mha: selected backend %s (mha_select_backend(\"%s\"))\n",
                 backend->name.c_str(), name);
  }
  return MHA_OK;
}

}  // namespace mha::rt
