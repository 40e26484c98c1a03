// The backend plugins: where they are, which ones this CPU can run, and which
// one calls use.
#pragma once

#include <mha/mha.h>
#include <mha/plugin_abi.h>

#include <atomic>
#include <string>
#include <vector>

namespace mha::rt {

struct Backend {
  std::string name;
  std::string path;  // the plugin file (empty for backends of another architecture)
  int32_t priority = 0;
  bool usable = false;
  std::string reason;  // why not usable
  const mha_plugin* plugin = nullptr;
};

class Registry {
 public:
  // Loads and probes every plugin the first time; thread-safe.
  static Registry& instance();

  const std::vector<Backend>& backends() const { return backends_; }

  // The backend calls use, or nullptr with the reason in *why.
  const Backend* selected(const char** why) const;

  // "auto" or a backend name; fails (leaving the choice as it was) when the name
  // is unknown or its backend unusable.
  mha_status select(const char* name);

  // "scalar, avx2, avx512": the usable backends, for error messages.
  const std::string& usable_names() const { return usable_names_; }

 private:
  Registry();
  void discover(const std::string& directory);
  void probe(Backend& backend, uint32_t cpu);
  const Backend* best_usable() const;
  // The backend "auto" or a name stands for, or nullptr with *error set.
  const Backend* resolve(const char* name, std::string* error) const;

  std::vector<Backend> backends_;
  std::string usable_names_;
  // What calls use; nullptr only when MHA_BACKEND named something unusable
  // (and no mha_select_backend succeeded since), with the reason in
  // environment_error_, which is written once, before any call can read it.
  std::atomic<const Backend*> selected_{nullptr};
  std::string environment_error_;
};

}  // namespace mha::rt
