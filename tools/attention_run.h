// The steps of `mha-run` (attention from .npy files), one small function each,
// so that the program's main() only parses the command line and so that other
// subcommands (`mha-run module ...`) can reuse the loading and timing parts.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "npy.h"
#include "output_files.h"

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

// Prints "mha-run: <message>" on stderr, the message escaped (escape()).
void print_error(const std::string& message);
// Runs the body; an exception becomes its message on stderr and its exit
// status: ToolError its own, OutputConflict 2, anything else 1.
int run_guarded(const std::function<int()>& body);

// A CLI11 validator that refuses an empty value ("--threads ''").
const CLI::Validator& non_empty();
// The --causal option of both modes: "--causal" alone is top-left,
// "--causal none|top-left|bottom-right" says which.
void add_causal_option(CLI::App& app, std::string& causal, const char* what);
// The mha_causal value of the option's text.
int32_t causal_mode(const std::string& causal);

struct AttentionOptions {
  std::string q, k, v, out;
  std::string mask, valid_lens, lse;  // empty: not given
  std::string causal = "none";        // none | top-left | bottom-right
  std::optional<double> scale;
  std::string scale_text;  // --scale as typed
  std::string backend;     // empty: keep the library's choice (MHA_BACKEND or auto)
  std::optional<int> threads;
  int repeat = 0;  // 0: one call, no timing
};

// Registers the attention flags (--q, --k, ...) on a CLI11 app or subcommand.
void add_attention_options(CLI::App& app, AttentionOptions& options);

// Refuses missing required flags (done here rather than by CLI11, so that the
// flags can live on the top-level app next to subcommands) and a --scale that
// is not zero as typed but rounds to zero (or to infinity) in float32;
// throws UsageError.
void check_attention_options(const AttentionOptions& options);

// Reads a float32 or float64 .npy input; float64 is converted to float32
// (said on stderr under MHA_VERBOSE=1) and refused when a finite value does
// not fit.  Other dtypes are left to the caller.
NpyArray read_float_input(const char* flag, const std::string& path);

// Applies --backend and --threads, then makes sure a backend is selected
// (MHA_BACKEND may name an unusable one): fails with the library's message.
void configure_runtime(const std::optional<std::string>& backend, std::optional<int> threads);

// Q, K and V all of rank 4 [B,H,L,D], or all of rank 3 [H,L,D] (one batch:
// the outputs are then of rank 3 too, [H,Lq,Dv] and [H,Lq]).
struct AttentionInputs {
  NpyArray q, k, v;
  std::optional<NpyArray> mask, valid_lens;
  bool unbatched = false;  // rank 3
};
AttentionInputs load_attention_inputs(const AttentionOptions& options);

// Descriptors over the inputs and freshly allocated outputs.  The params'
// pointers are set by params() from the members, so the struct may be moved.
struct AttentionCall {
  mha_tensor q{}, k{}, v{}, out{};
  std::optional<mha_tensor> mask, valid_lens, lse;
  int32_t causal = MHA_CAUSAL_NONE;
  std::optional<float> scale;
  NpyArray out_array, lse_array;

  mha_attention_params params();
};
AttentionCall prepare_attention_call(AttentionInputs& inputs, const AttentionOptions& options);

// One call; throws ToolError with mha_last_error() when it fails.
void call_attention(AttentionCall& call);

struct Timing {
  double median_ms = 0, min_ms = 0;
};
// `repeat` timed calls (after the caller's first, untimed one).
Timing time_attention(AttentionCall& call, int repeat);

// The number of (batch, head, query, key) tuples that take part: the pairs
// left by the causal mode, the valid lengths, a bool mask (true) and an
// additive mask (not -inf).  The descriptors must have passed mha_attention.
int64_t count_attention_pairs(const AttentionCall& call);
// Useful FLOPs: QK^T and PV, 2 * (D + Dv) per pair (4 * D when Dv = D).
double attention_flops(const AttentionCall& call);

// {"backend":..., "threads":..., "median_ms":..., "min_ms":..., "gflops":...}
std::string timing_json(const Timing& timing, double flops);

// The outputs as OutputFiles checks and writes them: --lse first, --out last.
std::vector<NamedFile> attention_outputs(const AttentionOptions& options);
std::vector<NamedFile> attention_inputs(const AttentionOptions& options);
void write_attention_outputs(const AttentionCall& call, const AttentionOptions& options,
                             OutputFiles& outputs);

// Prints one line on stdout and flushes it; throws ToolError when stdout
// cannot be written (a full disk, /dev/full, a closed pipe).
void print_stdout_line(const std::string& line);

// The whole `mha-run` attention command: prints errors as "mha-run: ..." on
// stderr and returns the exit status.
int run_attention_command(const AttentionOptions& options);

}  // namespace mha_tools
