// What the command-line tools share about their command lines: exit codes,
// the errors that carry them, and the options both mha-run modes take
// (--backend, --threads, --repeat, --causal, and the attention variants'
// --window, --sinks, --softcap, --alibi), registered once here.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace CLI {
class App;
class Validator;
}  // namespace CLI

namespace mha_tools {

// The exit status of mha-run (and, 0 and 1, of mha-info); --help lists them.
// CLI11's own parse errors keep CLI11's codes (100 to 127).
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;  // the run failed: files, the library, memory, output
constexpr int kExitUsage = 2;    // the command line is wrong (found after parsing)
// The "Exit status" part of mha-run's --help.
extern const char* const kRunExitStatusHelp;

// A failure with a one-line message for the user (without the "mha-run: "
// prefix) and the exit status it gives.
class ToolError : public std::runtime_error {
 public:
  explicit ToolError(const std::string& what, int exit_status = kExitFailure)
      : std::runtime_error(what), exit_status_(exit_status) {}
  int exit_status() const { return exit_status_; }

 private:
  int exit_status_;
};
// A command line that is wrong: flags missing or contradicting, a value refused.
class UsageError : public ToolError {
 public:
  explicit UsageError(const std::string& what) : ToolError(what, kExitUsage) {}
};

// How a run uses the library, in every mode.
struct RunOptions {
  std::string backend;  // empty: keep the library's choice (MHA_BACKEND or auto)
  std::optional<int> threads;
  int repeat = 0;  // 0: one call, no timing
};

// Registers --backend, --threads and --repeat.
void add_run_options(CLI::App& app, RunOptions& options);

// The attention variants' flags, the same in both modes: --window L,R,
// --sinks S.npy, --softcap C, --alibi SLOPES.npy.
struct VariantOptions {
  std::string window;        // "L,R" (-1: unbounded side); empty: none
  std::string sinks, alibi;  // .npy files; empty: none
  std::optional<double> softcap;
};

// Registers the variants' flags (the softcap checked: a finite number > 0).
void add_variant_options(CLI::App& app, VariantOptions& options);

// --window's value "L,R": two integers >= -1 (-1: that side unbounded);
// throws UsageError.
struct WindowEdges {
  int64_t left = -1, right = -1;
};
WindowEdges parse_window(const std::string& text);

// A CLI11 validator that refuses an empty value ("--threads ''").
const CLI::Validator& non_empty();
// The --causal option of both modes: "--causal" alone is top-left,
// "--causal none|top-left|bottom-right" says which.
void add_causal_option(CLI::App& app, std::string& causal, const char* what);
// The mha_causal value of the option's text; throws UsageError.
int32_t causal_mode(const std::string& causal);

}  // namespace mha_tools
