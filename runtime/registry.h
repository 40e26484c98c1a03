// The backend plugins: which ones the runtime knows, where they are, which
// ones this CPU can run, and which one calls use.
#pragma once

#include <mha/mha.h>
#include <mha/plugin_abi.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace mha::rt {

struct Backend {
  std::string name;
  uint32_t arch = 0;     // mha_cpu_feature architecture bits it is built for
  int32_t priority = 0;  // the runtime's, never the plugin's own claim
  // Set once, under the registry's lock, when the plugin is probed; a backend
  // is only published (selected) after that.
  bool probed = false;
  bool usable = false;
  std::string path;         // the plugin file
  const char* reason = "";  // why not usable; valid for the process's lifetime
  const mha_plugin* plugin = nullptr;
  // What the plugin chose for this machine's caches (set with plugin).
  mha_tile_sizes tiles{};
};

// A snapshot of one backend for mha_backend_get_info.
struct BackendInfo {
  const char* name;
  bool usable;
  int32_t priority;
  const char* reason;
  mha_tile_sizes tiles;  // zero when not usable
};

class Registry {
 public:
  // Built on first use, thread-safe: finds the plugin directory and probes
  // the plugins MHA_BACKEND calls for -- all known ones for "auto" (the
  // default), only the named one otherwise.
  static Registry& instance();

  int32_t count() const { return static_cast<int32_t>(backends_.size()); }
  BackendInfo info(int32_t index) const;

  // The backend calls use, or nullptr with the reason in *why.
  const Backend* selected(const char** why) const;

  // "auto" or a backend name (probing it if it was not loaded yet); fails,
  // leaving the choice as it was, when the name is unknown or unusable.
  mha_status select(const char* name);

 private:
  Registry();
  void probe_locked(Backend& backend);
  const Backend* best_usable_locked() const;
  // The backend "auto" or a name stands for, probing as needed, or nullptr
  // with *error set.
  const Backend* resolve_locked(const char* name, std::string* error);
  std::string usable_names_locked() const;
  const char* intern(std::string text);

  mutable std::mutex mutex_;
  std::vector<Backend> backends_;    // the known backends; the vector never changes size
  std::deque<std::string> strings_;  // interned reasons (references stay valid)
  uint32_t cpu_ = 0;
  std::string directory_;        // absolute; empty when unusable
  std::string directory_error_;  // why no plugin can be loaded
  std::string requested_;        // MHA_BACKEND as given ("auto" when unset)
  // What calls use; nullptr only when MHA_BACKEND named something unusable
  // (and no mha_select_backend succeeded since), with the reason in
  // environment_error_, which is written once, before any call can read it.
  std::atomic<const Backend*> selected_{nullptr};
  std::string environment_error_;
};

}  // namespace mha::rt
