// What the library sees and how it runs: version, mha-info's report, the
// backends, and the process's backend and thread count.
#include <mha/mha.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <mha/mha.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bindings.h"
#include "call_settings.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

nb::list words(const char* text) {
  nb::list result;
  std::istringstream in(text != nullptr ? text : "");
  for (std::string word; in >> word;) result.append(word);
  return result;
}

// The report `mha-info --json` prints (tools/info_main.cpp), key for key,
// from the same C API.
nb::dict info() {
  nb::dict report;
  report["version"] = mha_version();
  report["cpu_features"] = words(mha_cpu_features());
  const mha_cache_info caches = mha::cpu_caches();
  const auto bytes_or_none = [](int64_t bytes) {
    return bytes > 0 ? nb::object(nb::int_(bytes)) : nb::object(nb::none());
  };
  nb::dict cache_sizes;
  cache_sizes["l1d"] = bytes_or_none(caches.l1d_bytes);
  cache_sizes["l2"] = bytes_or_none(caches.l2_bytes);
  cache_sizes["l3"] = bytes_or_none(caches.l3_bytes);
  report["caches"] = cache_sizes;
  nb::list backends;
  for (const mha::BackendInfo& b : mha::backends()) {
    nb::dict entry;
    entry["name"] = b.name;
    entry["usable"] = b.usable;
    entry["reason"] = b.reason;
    entry["priority"] = b.priority;
    if (b.usable) {
      nb::dict tiles;
      tiles["query"] = b.query_tile;
      tiles["key"] = b.key_tile;
      tiles["decode_key"] = b.decode_key_tile;
      tiles["decode_streams"] = b.decode_streams;
      entry["tiles"] = tiles;
    } else {
      entry["tiles"] = nb::none();
    }
    entry["bf16_dot"] = b.bf16_dot;  // mha-info --json's fields
    entry["bf16_amx"] = b.bf16_amx;
    backends.append(entry);
  }
  report["backends"] = backends;
  std::string why;
  std::optional<std::string> selected;
  {
    nb::gil_scoped_release without_gil;  // waits for a call with backend= to finish
    selected = CallSettings::instance().selected_backend(&why);
  }
  if (selected) {
    report["selected"] = *selected;
  } else {
    report["selected"] = nb::none();
    report["selection_error"] = why;
  }
  report["threads"] = mha_get_num_threads();
  return report;
}

std::vector<std::string> usable_backends() {
  std::vector<mha::BackendInfo> all = mha::backends();
  std::stable_sort(
      all.begin(), all.end(),
      [](const mha::BackendInfo& a, const mha::BackendInfo& b) { return a.priority > b.priority; });
  std::vector<std::string> names;
  for (const mha::BackendInfo& b : all) {
    if (b.usable) names.push_back(b.name);
  }
  return names;
}

void set_backend(const std::string& name) {
  nb::gil_scoped_release without_gil;
  CallSettings::instance().select_backend(name);
}

void set_num_threads(int32_t n) {
  nb::gil_scoped_release without_gil;
  CallSettings::instance().set_num_threads(n);
}

}  // namespace

void register_runtime(nb::module_& module) {
  module.def("version", &mha_version, "The mha library's version, \"major.minor.patch\".");
  module.def("info", &info,
             "What mha sees on this machine, as `mha-info --json` prints it: a dict with\n"
             "'version', 'cpu_features' (list of str), 'caches', 'backends' (one dict per\n"
             "backend mha knows: 'name', 'usable', 'reason' why not, 'priority', 'tiles' and\n"
             "'bf16_dot': whether it computes bf16 products by bf16 dot products on this\n"
             "CPU, 'bf16_amx': whether those run on AMX tiles), 'selected' (the backend\n"
             "calls use, or None with 'selection_error' saying why) and 'threads'.");
  module.def("backends", &usable_backends,
             "The names of the backends usable on this machine, the preferred first (auto\n"
             "picks the first).  mha.info() has every backend, with why it is not usable.");
  module.def("set_backend", &set_backend, nb::arg("name"),
             "Chooses the backend of every later call: a name from mha.backends(), or\n"
             "\"auto\" (the best usable one).  Overrides MHA_BACKEND.  An unknown or unusable\n"
             "name raises mha.Error and leaves the choice unchanged.");
  module.def("set_num_threads", &set_num_threads, nb::arg("n"),
             "Sets the number of threads one call uses (1 to 4096); 0 returns to the\n"
             "environment's (MHA_NUM_THREADS, then OMP_NUM_THREADS, then all cores).");
  module.def("get_num_threads", &mha_get_num_threads, "The number of threads one call uses.");
}

}  // namespace mha_python
