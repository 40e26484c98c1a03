// The steps of `mha-run` (attention from .npy files), one small function each,
// so that the program's main() only parses the command line and so that other
// subcommands (`mha-run module ...`) can reuse the loading and timing parts.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "npy.h"

namespace CLI {
class App;
}

namespace mha_tools {

// A failure with a one-line message for the user (without the "mha-run: " prefix).
class ToolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct AttentionOptions {
  std::string q, k, v, out;
  std::string mask, valid_lens, lse;  // empty: not given
  std::string causal = "none";        // none | top-left | bottom-right
  std::optional<double> scale;
  std::string backend;  // empty: keep the library's choice (MHA_BACKEND or auto)
  std::optional<int> threads;
  int repeat = 0;  // 0: one call, no timing
};

// Registers the attention flags (--q, --k, ...) on a CLI11 app or subcommand.
void add_attention_options(CLI::App& app, AttentionOptions& options);

// Refuses missing required flags (done here rather than by CLI11, so that the
// flags can live on the top-level app next to subcommands).
void check_attention_options(const AttentionOptions& options);

// Applies --backend and --threads, then makes sure a backend is selected
// (MHA_BACKEND may name an unusable one): fails with the library's message.
void configure_runtime(const std::optional<std::string>& backend, std::optional<int> threads);

struct AttentionInputs {
  NpyArray q, k, v;
  std::optional<NpyArray> mask, valid_lens;
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

void write_attention_outputs(const AttentionCall& call, const AttentionOptions& options);

// The whole `mha-run` attention command: prints errors as "mha-run: ..." on
// stderr and returns the exit status.
int run_attention_command(const AttentionOptions& options);

}  // namespace mha_tools
