// mha-run's attention flags: registered on the command line, checked
// against each other, and the dtypes and runtime settings they choose.
#include <CLI/CLI.hpp>
#include <cmath>
#include <string>

#include "attention_run.h"

namespace mha_tools {

std::optional<mha_dtype> parse_dtype_flag(const std::string& text, bool kv) {
  struct Name {
    const char* text;
    mha_dtype dtype;
  };
  static const Name kNames[] = {
      {"f32", MHA_DTYPE_F32},   {"fp32", MHA_DTYPE_F32},      {"float32", MHA_DTYPE_F32},
      {"bf16", MHA_DTYPE_BF16}, {"bfloat16", MHA_DTYPE_BF16}, {"f16", MHA_DTYPE_F16},
      {"fp16", MHA_DTYPE_F16},  {"float16", MHA_DTYPE_F16},   {"half", MHA_DTYPE_F16},
      {"i8", MHA_DTYPE_I8},     {"int8", MHA_DTYPE_I8}};
  for (const Name& name : kNames) {
    if (text == name.text && (kv || name.dtype != MHA_DTYPE_I8)) return name.dtype;
  }
  return std::nullopt;
}

Dtypes resolve_dtypes(const AttentionOptions& o, NpyDtype q_file_dtype) {
  Dtypes d;
  d.q = o.dtype.value_or(q_file_dtype == NpyDtype::F16 ? MHA_DTYPE_F16 : MHA_DTYPE_F32);
  d.kv = o.kv_dtype.value_or(d.q);
  return d;
}

void add_attention_options(CLI::App& app, AttentionOptions& o) {
  const CLI::Validator& filled = non_empty();
  app.add_option("--q", o.q,
                 "queries: float32 or float16 [B,H,Lq,D] .npy (C or Fortran order; float64 too; "
                 "[H,Lq,D] with K and V of rank 3 too is one batch; [total_q,H,D] with "
                 "--cu-seqlens-q); passed as --dtype")
      ->check(filled);
  app.add_option("--k", o.k,
                 "keys: float32 or float16 [B,Hkv,Lk,D] .npy (float64 too; [total_k,Hkv,D] with "
                 "--cu-seqlens-k); H must be a multiple of Hkv; passed as --kv-dtype")
      ->check(filled);
  app.add_option("--v", o.v,
                 "values: float32 or float16 [B,Hkv,Lk,Dv] .npy ([total_k,Hkv,Dv] with "
                 "--cu-seqlens-k); passed as --kv-dtype")
      ->check(filled);
  app.add_option("--out", o.out,
                 "output: float32 [B,H,Lq,Dv] .npy to write ([H,Lq,Dv] for rank-3 inputs, "
                 "[total_q,H,Dv] for a packed batch), float32 whatever --dtype; replaced only once "
                 "every output is written")
      ->check(filled);
  app.add_option("--mask", o.mask,
                 "mask .npy, bool (true = the key takes part) or float32/float16/float64 (added "
                 "to the scores, passed as --dtype), broadcastable to [B,H,Lq,Lk] (rank 2 to 4)")
      ->check(filled);
  app.add_option("--valid-lens", o.valid_lens, "valid lengths .npy, int32 or int64, [B] or [B,Lq]")
      ->check(filled);
  app.add_option("--cu-seqlens-q", o.cu_seqlens_q,
                 "a packed variable-length batch (FlashAttention-2's varlen layout, computed by "
                 "mha_attention_varlen): the query offsets .npy, int32 [B+1] (0, then the "
                 "cumulative lengths; int64 is converted). --q is then [total_q,H,D], --out "
                 "[total_q,H,Dv], --lse [H,total_q]; needs --cu-seqlens-k, excludes --valid-lens "
                 "and --mask; causal, window and ALiBi use each sequence's own lengths")
      ->check(filled);
  app.add_option("--cu-seqlens-k", o.cu_seqlens_k,
                 "the key offsets of a packed batch .npy, int32 [B+1]; --k and --v are then "
                 "[total_k,Hkv,D] and [total_k,Hkv,Dv]; needs --cu-seqlens-q")
      ->check(filled);
  app.add_option("--block-table", o.block_table,
                 "a paged KV cache (vLLM's and FlashAttention-2's layout): the block ids .npy, "
                 "int32 [B,max_blocks]; key j of sequence b is row j % block_size of block "
                 "table[b][j / block_size] of --k and --v, [num_blocks,block_size,Hkv,D] (or "
                 "[num_blocks*block_size,Hkv,D] with --block-size); needs --cu-seqlens-q and "
                 "--seqused-k")
      ->check(filled);
  app.add_option("--seqused-k", o.seqused_k,
                 "the keys each sequence uses .npy, int32 [B]: with --block-table its length; "
                 "with --cu-seqlens-k the first seqused_k[b] of its rows")
      ->check(filled);
  app.add_option("--block-size", o.block_size,
                 "rows per block of a paged cache given as [num_blocks*block_size,Hkv,D] (a "
                 "multiple of 8); checked against shape[1] of a rank-4 cache");
  const auto dtype_check = [](bool kv) {
    return CLI::Validator(
        [kv](const std::string& text) -> std::string {
          if (parse_dtype_flag(text, kv)) return {};
          if (!kv && parse_dtype_flag(text, true)) {
            return "Q cannot be int8: " + text +
                   " is for K and V only (--kv-dtype i8); --dtype must be f32, bf16 or f16";
          }
          return "'" + text + "' is not a dtype; it must be " +
                 (kv ? "f32, bf16, f16 or i8" : "f32, bf16 or f16");
        },
        kv ? "f32|bf16|f16|i8" : "f32|bf16|f16", kv ? "KV-DTYPE" : "DTYPE");
  };
  app.add_option_function<std::string>(
         "--dtype", [&o](const std::string& s) { o.dtype = parse_dtype_flag(s, false); },
         "the dtype Q (and a float --mask) is passed to mha in: f32, bf16 or f16. Default: f16 "
         "when --q holds float16, else f32. Files of another float type are converted on load, "
         "rounded to nearest even (NumPy has no bfloat16: bf16 is always a conversion). mha "
         "computes in float32; --out and --lse are float32 whatever the dtype")
      ->check(filled)
      ->check(dtype_check(false))
      ->option_text("f32|bf16|f16");
  app.add_option_function<std::string>(
         "--kv-dtype", [&o](const std::string& s) { o.kv_dtype = parse_dtype_flag(s, true); },
         "the dtype K and V are passed to mha in: f32, bf16, f16, or i8 (int8 with one float32 "
         "scale per row, made by mha_quantize_kv: scale = max|row| / 127). Default: --dtype's "
         "value")
      ->check(filled)
      ->check(dtype_check(true))
      ->option_text("f32|bf16|f16|i8");
  add_causal_option(app, o.causal,
                    "causal mask: none (the default), top-left (also --causal alone) or "
                    "bottom-right");
  add_variant_options(app, o);
  app.add_option_function<std::string>(
         "--scale",
         [&o](const std::string& s) {
           o.scale_text = s;
           double value = 0;
           CLI::detail::lexical_cast(s, value);  // checked by CLI::Number
           o.scale = value;
         },
         "scale of the scores (default 1/sqrt(D))")
      ->check(filled)
      ->check(CLI::Number)
      ->option_text("FLOAT");
  app.add_flag("--mpi-ring", o.mpi_ring,
               "under mpirun: ring attention with libmha-mpi. Rank 0 reads the files and sends "
               "each rank its slice of the queries and keys (--mpi-layout), the K/V slices "
               "travel around the ring, rank 0 gathers and writes --out and --lse; --repeat "
               "times the slowest rank. Takes --causal, --valid-lens, --window, --sinks, "
               "--softcap, --alibi, --scale, --dtype; not --mask");
  app.add_flag("--mpi-decode", o.mpi_decode,
               "under mpirun: decoding over a KV cache sharded by position across the ranks "
               "(libmha-mpi); the queries go to every rank, the partial results are merged in "
               "rank order");
  app.add_option("--mpi-layout", o.mpi_layout,
                 "how --mpi-ring cuts the sequence: zigzag (the default: 2N chunks, rank r "
                 "holds r and 2N-1-r, balanced under a causal mask) or contiguous "
                 "(--mpi-decode always shards the cache contiguously)")
      ->check(filled)
      ->option_text("zigzag|contiguous");
  app.add_option("--lse", o.lse,
                 "log-sum-exp output: float32 [B,H,Lq] .npy to write ([H,Lq] for rank-3 inputs, "
                 "[H,total_q] for a packed batch)")
      ->check(filled);
  add_run_options(app, o);
}

namespace {

// A scale that is not zero as typed but is zero (or infinite) as the float32
// the library computes with.
void check_scale(const AttentionOptions& o) {
  if (!o.scale) return;
  const double typed = *o.scale;
  const std::string text = o.scale_text.empty() ? std::to_string(typed) : o.scale_text;
  const auto scale = static_cast<float>(typed);
  if (typed != 0 && scale == 0) {
    throw UsageError("--scale " + text + ": the value was typed as " + text +
                     " and rounds to 0 in float32, the precision mha computes in (the smallest "
                     "positive float32 is 1.4e-45)");
  }
  if (std::isfinite(typed) && !std::isfinite(scale)) {
    throw UsageError("--scale " + text + ": the value was typed as " + text +
                     " and overflows float32, the precision mha computes in (the largest float32 "
                     "is 3.4028235e+38)");
  }
}

}  // namespace

void check_attention_options(const AttentionOptions& o) {
  std::string missing;
  const auto need = [&missing](const std::string& value, const char* flag) {
    if (value.empty()) missing += missing.empty() ? flag : std::string(", ") + flag;
  };
  need(o.q, "--q");
  need(o.k, "--k");
  need(o.v, "--v");
  if (o.repeat == 0) need(o.out, "--out");
  if (!missing.empty()) throw UsageError("missing " + missing + " (see --help)");
  const bool packed_q = !o.cu_seqlens_q.empty(), packed_k = !o.cu_seqlens_k.empty();
  const bool paged_kv = !o.block_table.empty();
  if (paged_kv) {
    if (!packed_q || o.seqused_k.empty()) {
      throw UsageError(std::string("--block-table needs ") +
                       (!packed_q ? "--cu-seqlens-q (the queries, packed [total_q,H,D])"
                                  : "--seqused-k (each sequence's number of keys, int32 [B])"));
    }
    if (packed_k) {
      throw UsageError(
          "--cu-seqlens-k cannot be combined with --block-table: a paged cache's lengths are "
          "--seqused-k");
    }
  } else if (!o.seqused_k.empty() && !packed_q) {
    throw UsageError("--seqused-k needs --cu-seqlens-q and --cu-seqlens-k (or --block-table)");
  } else if (o.block_size) {
    throw UsageError("--block-size needs --block-table (it cuts --k and --v into blocks)");
  }
  if (packed_q != packed_k && !paged_kv) {
    throw UsageError(std::string(packed_q ? "--cu-seqlens-q is given without --cu-seqlens-k"
                                          : "--cu-seqlens-k is given without --cu-seqlens-q") +
                     ": a packed batch needs both offsets, int32 [B + 1] each");
  }
  if (packed_q) {
    const struct {
      const char* flag;
      const std::string& value;
    } excluded[] = {{"--valid-lens", o.valid_lens}, {"--mask", o.mask}};
    for (const auto& e : excluded) {
      if (e.value.empty()) continue;
      throw UsageError(std::string(e.flag) +
                       " cannot be combined with --cu-seqlens-q/--cu-seqlens-k: in a packed "
                       "batch each sequence's offsets are its lengths, and mha_attention_varlen "
                       "takes no valid lengths or mask");
    }
  }
  if (!o.mpi_layout.empty() && !o.mpi_ring && !o.mpi_decode) {
    throw UsageError("--mpi-layout " + o.mpi_layout +
                     ": it says how --mpi-ring cuts the sequence over the ranks, and this run "
                     "has no --mpi-ring");
  }
  (void)causal_mode(o.causal);
  if (!o.window.empty()) (void)parse_window(o.window);
  check_scale(o);
}

void configure_runtime(const std::optional<std::string>& backend, std::optional<int> threads) {
  if (backend && !backend->empty()) {
    const mha_status status = mha_select_backend(backend->c_str());
    if (status != MHA_OK)
      throw ToolError(std::string("--backend ") + *backend + ": " + mha_last_error());
  }
  if (threads) {
    const mha_status status = mha_set_num_threads(*threads);
    if (status != MHA_OK) {
      throw ToolError("--threads " + std::to_string(*threads) + ": " + mha_last_error());
    }
  }
  if (mha_selected_backend() == nullptr) throw ToolError(mha_last_error());
}

}  // namespace mha_tools
