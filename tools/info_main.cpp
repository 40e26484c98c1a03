// mha-info's program: what the mha library sees on this machine -- version,
// CPU features, backends (usable or why not), the selected backend, threads.
//
//   mha-info [--json] [--output FILE] [--version]
#include <mha/mha.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "attention_run.h"
#include "tool_main.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

const char* const kInfoExitStatusHelp =
    "Exit status:\n"
    "  0        success\n"
    "  1        no backend can be selected (MHA_BACKEND names an unknown or unusable\n"
    "           backend, or none is usable; the report is printed all the same), or\n"
    "           the report cannot be written\n"
    "  100-127  the command line cannot be parsed (CLI11's codes, e.g. 109 an unknown\n"
    "           flag)";

struct BackendEntry {
  std::string name;
  bool usable = false;
  int32_t priority = 0;
  std::string reason;
  mha_backend_tiles tiles{};   // zero when not usable
  int32_t decode_streams = 0;  // mha_backend_get_decode_streams: 0 when not usable
  int32_t bf16_dot = 0;        // mha_backend_get_bf16_dot: 0 when not usable (2: AMX tiles)
};

struct Info {
  std::string version;
  std::vector<std::string> cpu_features;
  mha_cache_info caches{};
  std::vector<BackendEntry> backends;
  std::optional<std::string> selected;
  std::string selection_error;  // when nothing is selected
  int32_t threads = 0;
};

std::vector<std::string> split_words(const char* text) {
  std::vector<std::string> words;
  std::istringstream in(text != nullptr ? text : "");
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

Info gather_info() {
  Info info;
  info.version = mha_version();
  info.cpu_features = split_words(mha_cpu_features());
  (void)mha_cpu_caches(&info.caches);
  const int32_t count = mha_backend_count();
  for (int32_t i = 0; i < count; ++i) {
    mha_backend_info b{};
    if (mha_backend_get_info(i, &b) != MHA_OK) {
      info.backends.push_back({"#" + std::to_string(i), false, 0, mha_last_error()});
      continue;
    }
    mha_backend_tiles tiles{};
    (void)mha_backend_get_tiles(i, &tiles);
    int32_t decode_streams = 0;
    (void)mha_backend_get_decode_streams(i, &decode_streams);
    int32_t bf16_dot = 0;
    (void)mha_backend_get_bf16_dot(i, &bf16_dot);
    info.backends.push_back({b.name != nullptr ? b.name : "", b.usable != 0, b.priority,
                             b.reason != nullptr ? b.reason : "", tiles, decode_streams, bf16_dot});
  }
  if (const char* selected = mha_selected_backend(); selected != nullptr) {
    info.selected = selected;
  } else {
    info.selection_error = mha_last_error();
  }
  info.threads = mha_get_num_threads();
  return info;
}

std::string to_json(const Info& info) {
  nlohmann::ordered_json j;
  j["version"] = info.version;
  j["cpu_features"] = info.cpu_features;
  // Bytes; null when the system does not say.
  const auto bytes_or_null = [](int64_t bytes) {
    return bytes > 0 ? nlohmann::ordered_json(bytes) : nlohmann::ordered_json(nullptr);
  };
  j["caches"] = {{"l1d", bytes_or_null(info.caches.l1d_bytes)},
                 {"l2", bytes_or_null(info.caches.l2_bytes)},
                 {"l3", bytes_or_null(info.caches.l3_bytes)}};
  j["backends"] = nlohmann::ordered_json::array();
  for (const auto& b : info.backends) {
    nlohmann::ordered_json entry = {
        {"name", b.name}, {"usable", b.usable}, {"reason", b.reason}, {"priority", b.priority}};
    if (b.usable) {
      entry["tiles"] = {{"query", b.tiles.query_tile},
                        {"key", b.tiles.key_tile},
                        {"decode_key", b.tiles.decode_key_tile},
                        {"decode_streams", b.decode_streams}};
    } else {
      entry["tiles"] = nullptr;
    }
    // bf16 x bf16 products by the backend's bf16 dot-product instructions on
    // this CPU (false: widened to fp32, or not usable), and whether those are
    // AMX tiles' (mha_backend_get_bf16_dot 2).
    entry["bf16_dot"] = b.bf16_dot != 0;
    entry["bf16_amx"] = b.bf16_dot == 2;
    j["backends"].push_back(entry);
  }
  if (info.selected) {
    j["selected"] = *info.selected;
  } else {
    j["selected"] = nullptr;
    j["selection_error"] = info.selection_error;
  }
  j["threads"] = info.threads;
  // Strings from the environment (MHA_BACKEND in selection_error) may hold
  // any bytes: control characters come out as \u00XX, bytes that are not
  // UTF-8 as U+FFFD.
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

// "48 KiB", "2 MiB", or "unknown".
std::string size_text(int64_t bytes) {
  if (bytes <= 0) return "unknown";
  if (bytes % (int64_t{1} << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes % (int64_t{1} << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " bytes";
}

// escape() applied to each line, keeping the line ends.
std::string escape_lines(const std::string& text) {
  std::string out;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out += escape(std::string_view(text).substr(start, end - start));
    if (end < text.size()) out += '\n';
    start = end + 1;
  }
  return out;
}

std::string to_text(const Info& info) {
  std::ostringstream out;
  out << "mha " << info.version << "\n";
  out << "cpu features:";
  for (const auto& f : info.cpu_features) out << ' ' << f;
  out << (info.cpu_features.empty() ? " (none)\n" : "\n");
  out << "caches: l1d " << size_text(info.caches.l1d_bytes) << ", l2 "
      << size_text(info.caches.l2_bytes) << ", l3 " << size_text(info.caches.l3_bytes) << "\n";
  out << "backends:\n";
  for (const auto& b : info.backends) {
    out << "  " << b.name;
    if (b.usable) {
      out << ": usable (priority " << b.priority << "), tiles of " << b.tiles.query_tile
          << " queries x " << b.tiles.key_tile << " keys";
      if (b.tiles.decode_key_tile > 0) {
        out << ", decode tiles of " << b.tiles.decode_key_tile << " keys";
        if (b.decode_streams > 1) out << " in " << b.decode_streams << " streams";
      }
      if (b.bf16_dot != 0) out << ", bf16 by dot products";
      if (b.bf16_dot == 2) out << " on AMX tiles";
      out << "\n";
    } else {
      out << ": not usable: " << b.reason << "\n";
    }
  }
  if (info.selected) {
    out << "selected backend: " << *info.selected << "\n";
  } else {
    out << "selected backend: none: " << info.selection_error << "\n";
  }
  out << "threads: " << info.threads << "\n";
  // One line each: names and reasons may echo MHA_BACKEND or a plugin's text.
  return escape_lines(out.str());
}

// Writes to the file, or to stdout when the path is empty; false (with a
// message on stderr) on failure.
bool emit(const std::string& text, const std::string& path) {
  if (path.empty()) {
    errno = 0;
    const bool ok =
        std::fwrite(text.data(), 1, text.size(), stdout) == text.size() && std::fflush(stdout) == 0;
    if (!ok) {
      std::fprintf(stderr, "mha-info: cannot write to stdout: %s\n",
                   errno != 0 ? std::strerror(errno) : "write error");
      std::clearerr(stdout);
    }
    return ok;
  }
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << text;
  file.close();
  if (!file) {
    std::fprintf(stderr, "mha-info: cannot write %s\n", escape(path).c_str());
    return false;
  }
  return true;
}

std::string one_line_failure(const CLI::App* /*app*/, const CLI::Error& e) {
  return "mha-info: " + escape(e.what()) + " (see mha-info --help)\n";
}

int run(int argc, const char* const* argv) {
  CLI::App app{"What the mha library sees on this machine.", "mha-info"};
  app.failure_message(one_line_failure);
  app.set_version_flag("--version", std::string("mha-info ") + mha_version(),
                       "print the version of the mha library and exit");
  app.footer(kInfoExitStatusHelp);
  bool json = false;
  std::string output;
  app.add_flag("--json", json, "print one JSON object");
  app.add_option("-o,--output", output, "write to this file instead of stdout")->check(non_empty());
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const Info info = gather_info();
  if (!emit(json ? to_json(info) : to_text(info), output)) return 1;
  // The report says why no backend can be selected; the status says that one cannot.
  return info.selected ? 0 : 1;
}

}  // namespace

int mha_info_main(int argc, const char* const* argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mha-info: %s\n", escape(e.what()).c_str());
  } catch (...) {
    std::fprintf(stderr, "mha-info: unknown exception\n");
  }
  return 1;
}

}  // namespace mha_tools
