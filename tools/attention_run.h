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

#include "cli_options.h"
#include "npy.h"
#include "output_files.h"

namespace CLI {
class App;
class Validator;
}  // namespace CLI

namespace mha_tools {

// Prints "mha-run: <message>" on stderr, the message escaped (escape()).
void print_error(const std::string& message);
// Runs the body; an exception becomes its message on stderr and its exit
// status: ToolError its own, OutputConflict 2, anything else 1.
int run_guarded(const std::function<int()>& body);

struct AttentionOptions : RunOptions {
  std::string q, k, v, out;
  std::string mask, valid_lens, lse;  // empty: not given
  std::string causal = "none";        // none | top-left | bottom-right
  std::optional<double> scale;
  std::string scale_text;  // --scale as typed
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
