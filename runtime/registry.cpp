#include "registry.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "bf16_dot.h"
#include "cpu_caches.h"
#include "cpu_features.h"
#include "decode_streams.h"
#include "env.h"
#include "error.h"
#include "known_backends.h"
#include "library_dir.h"
#include "plugin_trust.h"

namespace mha::rt {
namespace {

constexpr const char* kPrefix = "libmha-backend-";
constexpr const char* kSuffix = ".so";

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

const char* arch_name(uint32_t arch) {
  if (arch & MHA_CPU_ARCH_X86_64) return "x86-64";
  if (arch & MHA_CPU_ARCH_AARCH64) return "aarch64";
  return "another architecture";
}

std::string known_names() {
  std::string names;
  for (const auto& k : kKnownBackends) names += std::string(names.empty() ? "" : ", ") + k.name;
  return names;
}

}  // namespace

Registry& Registry::instance() {
  static Registry registry;
  return registry;
}

const char* Registry::intern(std::string text) {
  strings_.push_back(std::move(text));
  return strings_.back().c_str();
}

Registry::Registry() {
  std::lock_guard<std::mutex> lock(mutex_);
  cpu_ = cpu_features();
  const mha_cache_sizes& caches = cpu_caches();  // warns once about a malformed MHA_CACHE_SIZES
  const int verbose = verbose_level();
  if (verbose >= 1) {
    std::fprintf(stderr, "mha: cpu features: %s\n", feature_names(cpu_).c_str());
    std::fprintf(stderr, "mha: caches: l1d %lld, l2 %lld, l3 %lld bytes\n",
                 static_cast<long long>(caches.l1d), static_cast<long long>(caches.l2),
                 static_cast<long long>(caches.l3));
  }

  if (const char* env = std::getenv("MHA_PLUGIN_DIR"); env != nullptr && *env != '\0') {
    if (env[0] == '/') {
      directory_ = env;
    } else {
      directory_error_ = "MHA_PLUGIN_DIR=\"" + printable(env, 256) +
                         "\" is not an absolute path; plugins are only loaded from an absolute, "
                         "trusted directory";
    }
  } else {
    directory_ = library_directory(&directory_error_);
  }
  if (directory_error_.empty()) directory_error_ = untrusted_directory(directory_);
  if (!directory_error_.empty()) directory_.clear();
  if (verbose >= 1) {
    std::fprintf(stderr, "mha: plugin directory: %s\n",
                 directory_error_.empty() ? printable(directory_.c_str(), 256).c_str()
                                          : directory_error_.c_str());
  }

  const char* env_backend = std::getenv("MHA_BACKEND");
  requested_ = env_backend != nullptr && *env_backend != '\0' ? env_backend : "auto";
  // A known name of this architecture loads only that plugin; "auto" -- and a
  // name that is no plugin here (a mistake, reported below) -- loads them all,
  // so that mha-info and the error can say what is usable.
  bool names_a_plugin = false;
  for (const auto& known : kKnownBackends) {
    names_a_plugin = names_a_plugin || (requested_ == known.name && (known.arch & cpu_) != 0);
  }
  const bool load_all = !names_a_plugin;
  backends_.reserve(std::size(kKnownBackends));
  for (const auto& known : kKnownBackends) {
    Backend backend;
    backend.name = known.name;
    backend.arch = known.arch;
    backend.priority = known.priority;
    if (!(known.arch & cpu_)) {
      backend.probed = true;
      backend.reason = intern(std::string("not this architecture (built for ") +
                              arch_name(known.arch) + " only)");
    } else if (!directory_error_.empty()) {
      backend.probed = true;
      backend.reason = intern(directory_error_);
    } else {
      backend.path = directory_ + "/" + kPrefix + known.name + kSuffix;
      if (load_all || requested_ == known.name) {
        probe_locked(backend);
      } else {
        backend.reason = intern("not loaded: MHA_BACKEND=" + printable(requested_.c_str()) +
                                " names one backend, and only that plugin is loaded "
                                "(mha_select_backend loads this one)");
      }
    }
    backends_.push_back(std::move(backend));
  }
  if (verbose >= 1) {
    for (const auto& backend : backends_) {
      if (backend.usable) {
        std::fprintf(stderr, "mha: backend %s: usable (priority %d, %s)\n", backend.name.c_str(),
                     backend.priority, printable(backend.path.c_str(), 256).c_str());
      } else {
        std::fprintf(stderr, "mha: backend %s: not usable: %s\n", backend.name.c_str(),
                     backend.reason);
      }
    }
  }

  const Backend* initial = resolve_locked(requested_.c_str(), &environment_error_);
  selected_.store(initial, std::memory_order_release);
  if (verbose >= 1) {
    if (initial != nullptr) {
      std::fprintf(stderr, "mha: selected backend %s (MHA_BACKEND=%s)\n", initial->name.c_str(),
                   printable(requested_.c_str()).c_str());
    } else {
      std::fprintf(stderr, "mha: no backend selected: %s\n", environment_error_.c_str());
    }
  }
}

void Registry::probe_locked(Backend& backend) {
  backend.probed = true;
  if (!file_exists(backend.path)) {
    backend.reason =
        intern("not installed (" + printable(backend.path.c_str(), 256) + " is missing)");
    return;
  }
  if (std::string why = untrusted_file(backend.path); !why.empty()) {
    backend.reason = intern(std::move(why));
    return;
  }
  // RTLD_LOCAL keeps each plugin's symbols to itself; a plugin runs no code of
  // its own at load time (no ISA instructions before the feature check).
  void* handle = ::dlopen(backend.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    backend.reason = intern(std::string("cannot be loaded: ") +
                            (why != nullptr ? printable(why, 512) : "dlopen failed"));
    return;
  }
  auto entry = reinterpret_cast<mha_plugin_entry_fn>(::dlsym(handle, MHA_PLUGIN_ENTRY_SYMBOL));
  const mha_plugin* plugin = entry != nullptr ? entry() : nullptr;
  auto refuse = [&](std::string why) {
    backend.reason = intern(std::move(why));
    ::dlclose(handle);
  };
  if (plugin == nullptr) {
    refuse(entry == nullptr ? "not an mha plugin (no mha_plugin_entry symbol)"
                            : "its mha_plugin_entry returned no table");
    return;
  }
  if (plugin->abi_version != MHA_PLUGIN_ABI_VERSION) {
    refuse("plugin ABI version " + std::to_string(plugin->abi_version) + ", this runtime needs " +
           std::to_string(MHA_PLUGIN_ABI_VERSION));
    return;
  }
  if (plugin->struct_size < sizeof(mha_plugin) || plugin->name == nullptr ||
      plugin->attend == nullptr || plugin->scratch_bytes == nullptr || plugin->query_tile <= 0 ||
      plugin->key_tile <= 0 || plugin->vector_floats <= 0) {
    refuse("malformed plugin table");
    return;
  }
  if (const mha_gemm_ukernel* gemm = plugin->gemm_ukernel;
      gemm != nullptr &&
      (gemm->run == nullptr || gemm->mr < 1 || gemm->mr > 64 || gemm->nr < 1 || gemm->nr > 64)) {
    refuse("malformed plugin table (its gemm_ukernel)");
    return;
  }
  if (const mha_bf16_gemm* gemm = plugin->bf16_gemm;
      gemm != nullptr &&
      (gemm->packed_bytes == nullptr || gemm->pack == nullptr || gemm->scratch_bytes == nullptr ||
       gemm->run == nullptr || gemm->split_scratch_bytes == nullptr || gemm->run_split == nullptr ||
       gemm->run_to_bf16 == nullptr)) {
    refuse("malformed plugin table (its bf16_gemm)");
    return;
  }
  if (backend.name != plugin->name) {
    refuse("the file names backend '" + backend.name + "' but the plugin calls itself '" +
           printable(plugin->name) + "'");
    return;
  }
  const uint32_t missing = plugin->required_cpu_features & ~cpu_;
  if (missing != 0) {
    // Keep the handle: nothing of it runs, and unloading gains nothing.
    backend.reason = intern("this CPU (or OS) lacks " + feature_names(missing));
    return;
  }
  if (plugin->init != nullptr) {
    char message[256] = "";
    if (plugin->init(message, sizeof message) != 0) {
      message[sizeof message - 1] = '\0';
      backend.reason = intern(std::string("its initialisation failed: ") +
                              (message[0] != '\0' ? printable(message, 200) : "no reason given"));
      return;
    }
  }
  // The tiles for this machine's caches: the runtime plans work items with
  // them, and the plugin's kernels use the same.
  // The decode's key streams and the bf16 dot products are the CPU's matter
  // (decode_streams.cpp, bf16_dot.cpp): the plugin answers with what its
  // kernels do.
  mha_tile_sizes tiles{plugin->query_tile, plugin->key_tile, 0, decode_key_streams(),
                       bf16_dot_products()};
  if (plugin->choose_tiles != nullptr) {
    plugin->choose_tiles(&cpu_caches(), &tiles);
  } else {
    tiles.decode_key_streams = 1;
    tiles.bf16_dot = 0;
  }
  if (tiles.query_tile <= 0 || tiles.key_tile <= 0 || tiles.decode_key_tile < 0 ||
      tiles.decode_key_streams <= 0 || tiles.bf16_dot < 0 || tiles.bf16_dot > 2 ||
      (tiles.bf16_dot == 2 && !(cpu_features() & MHA_CPU_AMX_BF16))) {
    backend.reason =
        intern("its chosen tile sizes are not positive (query " + std::to_string(tiles.query_tile) +
               ", key " + std::to_string(tiles.key_tile) + ", decode streams " +
               std::to_string(tiles.decode_key_streams) + ") or its bf16 dot answer (" +
               std::to_string(tiles.bf16_dot) + ") is not 0, 1 or 2 (2 only with AMX)");
    return;
  }
  if (verbose_level() >= 1) {
    std::fprintf(stderr,
                 "mha: backend %s: tiles of %d queries x %d keys, decode %d keys in %d "
                 "stream%s, bf16 products %s\n",
                 backend.name.c_str(), tiles.query_tile, tiles.key_tile, tiles.decode_key_tile,
                 tiles.decode_key_streams, tiles.decode_key_streams == 1 ? "" : "s",
                 tiles.bf16_dot == 2   ? "by bf16 dot products on AMX tiles"
                 : tiles.bf16_dot != 0 ? "by bf16 dot products"
                                       : "widened to fp32");
  }
  backend.tiles = tiles;
  backend.plugin = plugin;
  backend.usable = true;
  backend.reason = "";
}

BackendInfo Registry::info(int32_t index) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Backend& b = backends_[static_cast<size_t>(index)];
  return {b.name.c_str(), b.usable, b.priority, b.reason, b.tiles};
}

const Backend* Registry::best_usable_locked() const {
  const Backend* best = nullptr;
  for (const auto& backend : backends_) {
    if (backend.usable && (best == nullptr || backend.priority > best->priority)) best = &backend;
  }
  return best;
}

std::string Registry::usable_names_locked() const {
  std::string usable, unloaded;
  for (const auto& backend : backends_) {
    std::string& list = backend.usable ? usable : unloaded;
    if (backend.usable || !backend.probed) list += (list.empty() ? "" : ", ") + backend.name;
  }
  std::string text = "usable backends: " + (usable.empty() ? std::string("none") : usable);
  if (!unloaded.empty()) text += " (not loaded, so not known yet: " + unloaded + ")";
  return text;
}

const Backend* Registry::resolve_locked(const char* name, std::string* error) {
  if (std::strcmp(name, "auto") == 0) {
    for (auto& backend : backends_) {
      if (!backend.probed) probe_locked(backend);
    }
    const Backend* best = best_usable_locked();
    if (best == nullptr) *error = "no usable backend: see mha-info";
    return best;
  }
  const std::string quoted = "backend '" + printable(name) + "'";
  const auto it = std::find_if(backends_.begin(), backends_.end(),
                               [&](const Backend& b) { return b.name == name; });
  if (it == backends_.end()) {
    *error =
        quoted + " is unknown (known backends: " + known_names() + "); " + usable_names_locked();
    return nullptr;
  }
  if (!it->probed) probe_locked(*it);
  if (!it->usable) {
    // The error names what is usable instead: the plugins MHA_BACKEND's name
    // left unloaded are probed now (nothing of theirs runs but the table).
    for (auto& backend : backends_) {
      if (!backend.probed) probe_locked(backend);
    }
    *error = quoted + " is not usable: " + it->reason + "; " + usable_names_locked();
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
  const Backend* backend = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    backend = resolve_locked(name, &error);
  }
  if (backend == nullptr) return fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", error.c_str());
  selected_.store(backend, std::memory_order_release);
  if (verbose_level() >= 1) {
    std::fprintf(stderr, "mha: selected backend %s (mha_select_backend(\"%s\"))\n",
                 backend->name.c_str(), printable(name).c_str());
  }
  return MHA_OK;
}

}  // namespace mha::rt
