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
#include "input_files.h"
#include "npy.h"
#include "output_files.h"

namespace CLI {
class App;
class Validator;
}  // namespace CLI

namespace mha_tools {

// Runs the body; an exception becomes its message on stderr and its exit
// status: ToolError its own, OutputConflict 2, anything else 1.
int run_guarded(const std::function<int()>& body);

struct AttentionOptions : RunOptions, VariantOptions {
  std::string q, k, v, out;
  std::string mask, valid_lens, lse;  // empty: not given
  // A packed variable-length batch (mha_attention_varlen): int32 [B + 1]
  // offsets of the queries and of the keys; both or neither.
  std::string cu_seqlens_q, cu_seqlens_k;
  // A paged KV cache (mha_attention_varlen with a block table): int32
  // [B, max_blocks] block ids and [B] keys per sequence (--seqused-k, also
  // allowed with packed keys); --k and --v are [num_blocks, block_size, Hkv,
  // D], or [num_blocks * block_size, Hkv, D] cut by --block-size.
  std::string block_table, seqused_k;
  std::optional<int64_t> block_size;
  std::string causal = "none";  // none | top-left | bottom-right
  std::optional<double> scale;
  std::string scale_text;  // --scale as typed
  // --dtype (F32, BF16 or F16) and --kv-dtype (those or I8); not given: see
  // resolve_dtypes().
  std::optional<mha_dtype> dtype, kv_dtype;
  // Under mpirun (tools/mpi_run.h): ring attention over the ranks with the
  // queries and keys sharded by --mpi-layout, or decoding over a KV cache
  // sharded by position.
  bool mpi_ring = false, mpi_decode = false;
  std::string mpi_layout;  // zigzag or contiguous; not given: zigzag
};

// A value of --dtype (kv = false) or --kv-dtype (kv = true): f32, bf16, f16
// (and i8 for K and V), or an alias (fp32, float32, fp16, float16, half,
// bfloat16, int8); nullopt for anything else.
std::optional<mha_dtype> parse_dtype_flag(const std::string& text, bool kv);

// The dtypes mha gets: --dtype, or F16 when Q's file holds float16 and F32
// otherwise; --kv-dtype, or the dtype.
struct Dtypes {
  mha_dtype q = MHA_DTYPE_F32, kv = MHA_DTYPE_F32;
};
Dtypes resolve_dtypes(const AttentionOptions& options, NpyDtype q_file_dtype);

// Registers the attention flags (--q, --k, ...) on a CLI11 app or subcommand.
void add_attention_options(CLI::App& app, AttentionOptions& options);

// Refuses missing required flags (done here rather than by CLI11, so that the
// flags can live on the top-level app next to subcommands), one of
// --cu-seqlens-q and --cu-seqlens-k without the other or with --valid-lens or
// --mask, a paged cache's flags without their companions (--block-table needs
// --cu-seqlens-q and --seqused-k, excludes --cu-seqlens-k), and a --scale that is not zero as typed
// but rounds to zero (or to infinity) in float32; throws UsageError.
void check_attention_options(const AttentionOptions& options);

// Applies --backend and --threads, then makes sure a backend is selected
// (MHA_BACKEND may name an unusable one): fails with the library's message.
void configure_runtime(const std::optional<std::string>& backend, std::optional<int> threads);

// Q, K and V all of rank 4 [B,H,L,D], or all of rank 3 [H,L,D] (one batch:
// the outputs are then of rank 3 too, [H,Lq,Dv] and [H,Lq]).  With
// --cu-seqlens-q/-k, all of rank 3 packed [total,H,D] (the outputs
// [total_q,H,Dv] and [H,total_q]).
struct AttentionInputs {
  TypedInput q, k, v;              // in the resolved dtypes (Q's, K and V's)
  std::optional<TypedInput> mask;  // BOOL, or Q's dtype
  std::optional<NpyArray> valid_lens;
  // With int8 K and V: the F32 row scales, K's (V's) shape without D.
  std::optional<NpyArray> k_scale, v_scale;
  std::optional<NpyArray> sinks, alibi;  // float32 [H]; [H] or [B,H]
  bool unbatched = false;                // rank 3 [H,L,D], one batch
  // The offsets of a packed batch, int32 [B + 1] (int64 files converted);
  // a paged cache's block table [B, max_blocks] and keys per sequence [B].
  std::optional<NpyArray> cu_seqlens_q, cu_seqlens_k, block_table, seqused_k;
};
AttentionInputs load_attention_inputs(const AttentionOptions& options);

// Descriptors over the inputs and freshly allocated outputs.  The params'
// pointers are set by params() from the members, so the struct may be moved.
struct AttentionCall {
  mha_tensor q{}, k{}, v{}, out{};
  std::optional<mha_tensor> mask, valid_lens, lse, k_scale, v_scale, sinks, alibi;
  // Set for a packed batch (cu_seqlens_q): the call is mha_attention_varlen,
  // with packed keys (cu_seqlens_k) or a paged cache (block_table).
  std::optional<mha_tensor> cu_seqlens_q, cu_seqlens_k, block_table, seqused_k;
  int32_t causal = MHA_CAUSAL_NONE;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  std::optional<float> scale;
  NpyArray out_array, lse_array;

  mha_attention_params params();
};
AttentionCall prepare_attention_call(AttentionInputs& inputs, const AttentionOptions& options);

// One call (mha_attention, or mha_attention_varlen for a packed batch);
// throws ToolError with mha_last_error() when it fails.
void call_attention(AttentionCall& call);

struct Timing {
  double median_ms = 0, min_ms = 0;
};
// `repeat` timed calls of `call` (after the caller's first, untimed one).
Timing time_calls(const std::function<void()>& call, int repeat);
Timing time_attention(AttentionCall& call, int repeat);

// The number of (batch, head, query, key) tuples that take part: the pairs
// left by the causal mode, the window, the valid lengths, a bool mask (true) and an
// additive mask (not -inf); for a packed batch, per sequence with its own
// lengths.  The descriptors must have passed mha_attention (_varlen).
int64_t count_attention_pairs(const AttentionCall& call);
// Useful FLOPs: QK^T and PV, 2 * (D + Dv) per pair (4 * D when Dv = D).
double attention_flops(const AttentionCall& call);

// {"backend":..., "threads":..., "median_ms":..., "min_ms":..., "gflops":...}
// followed by "dtype":..., "kv_dtype":... (f32, bf16, f16, i8) when either is
// not F32: a float32 run prints the line of earlier versions.
std::string timing_json(const Timing& timing, double flops, const Dtypes& dtypes = {});

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
