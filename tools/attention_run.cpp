#include "attention_run.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>

#include "common/visibility.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

// "--q q.npy" as messages name an input.
std::string label(const char* flag, const std::string& path) {
  return std::string(flag) + " " + path;
}

[[noreturn]] void library_error(const std::string& what, mha_status status) {
  throw ToolError(what + " failed (" + mha_status_name(status) + "): " + mha_last_error());
}

// A descriptor over an array, in the array's own layout (C or Fortran order);
// with add_batch a leading dimension of 1 is added ([H,L,D] as [1,H,L,D]).
mha_tensor describe(NpyArray& array, mha_dtype dtype, const std::string& what,
                    bool add_batch = false) {
  const int rank = array.rank() + (add_batch ? 1 : 0);
  if (rank < 1 || rank > MHA_MAX_DIMS) {
    throw ToolError(what + ": " + array.describe() + " has rank " + std::to_string(array.rank()) +
                    "; mha takes tensors of rank 1 to " + std::to_string(MHA_MAX_DIMS));
  }
  std::vector<int64_t> shape = array.shape(), strides = array.strides();
  if (add_batch) {
    shape.insert(shape.begin(), 1);
    strides.insert(strides.begin(), std::max<int64_t>(array.size(), 1));
  }
  mha_tensor t{};
  const mha_status status =
      mha_tensor_init(&t, array.data(), dtype, rank, shape.data(), strides.data());
  if (status != MHA_OK) throw ToolError(what + ": " + mha_last_error());
  return t;
}

// Reads an input file; messages name the flag ("--q q.npy: truncated data: ...").
NpyArray read_input(const char* flag, const std::string& path) {
  try {
    return read_npy(path);
  } catch (const NpyError& e) {
    throw ToolError(std::string(flag) + " " + e.what());
  }
}

NpyArray load_float_tensor(const char* flag, const std::string& path, const char* role,
                           const char* shapes) {
  NpyArray a = read_float_input(flag, path);
  if (a.dtype() != NpyDtype::F32 || (a.rank() != 4 && a.rank() != 3)) {
    throw ToolError(label(flag, path) + ": " + role +
                    " must be float32 (<f4) or float64 (<f8, converted) of rank 4 " + shapes +
                    " or rank 3 (one batch, B = 1); the file holds " + a.describe());
  }
  return a;
}

// Elements of an int32 / int64 descriptor, or of a bool / float32 one.
int64_t integer_at(const mha_tensor& t, int64_t offset) {
  if (t.dtype == MHA_DTYPE_I64) return static_cast<const int64_t*>(t.data)[offset];
  return static_cast<const int32_t*>(t.data)[offset];
}

bool mask_allows(const mha_tensor& mask, int64_t offset) {
  if (mask.dtype == MHA_DTYPE_BOOL) return static_cast<const uint8_t*>(mask.data)[offset] != 0;
  return static_cast<const float*>(mask.data)[offset] != -INFINITY;
}

// Keys 0 .. limit-1 of (batch b, query i) survive the causal mode and valid
// lengths: the library's own visibility rule (common/visibility.h).
int64_t key_limit(const AttentionCall& call, int64_t b, int64_t i) {
  const int64_t lq = call.q.shape[2], lk = call.k.shape[2];
  int64_t valid_length = lk;
  if (call.valid_lens) {
    const mha_tensor& vl = *call.valid_lens;
    valid_length = integer_at(vl, b * vl.strides[0] + (vl.ndim == 2 ? i * vl.strides[1] : 0));
  }
  return mha_rules::visible_keys(i, lk, mha_rules::causal_diagonal(call.causal, lq, lk),
                                 valid_length);
}

// Element offset in a mask broadcast (NumPy style, aligned right) to [B,H,Lq,Lk].
int64_t mask_offset(const mha_tensor& mask, const int64_t (&index)[4]) {
  int64_t offset = 0;
  for (int32_t d = 0; d < mask.ndim; ++d) {
    const int64_t full = index[4 - mask.ndim + d];
    if (mask.shape[d] != 1) offset += full * mask.strides[d];
  }
  return offset;
}

// Rank-3 Q, K and V leave a batch of one; anything else must be rank 4 throughout.
void check_ranks(const AttentionInputs& in, const AttentionOptions& o) {
  const NpyArray* arrays[] = {&in.k, &in.v};
  const char* flags[] = {"--k", "--v"};
  const std::string* paths[] = {&o.k, &o.v};
  for (int i = 0; i < 2; ++i) {
    if (arrays[i]->rank() == in.q.rank()) continue;
    throw ToolError(label("--q", o.q) + ": Q has rank " + std::to_string(in.q.rank()) + " and " +
                    label(flags[i], *paths[i]) + " has rank " + std::to_string(arrays[i]->rank()) +
                    ": Q, K and V must all be rank 4 [B,H,L,D] or all rank 3 [H,L,D] (one batch)");
  }
}

int64_t count_pairs_of_head(const AttentionCall& call, int64_t b, int64_t h) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < call.q.shape[2]; ++i) {
    const int64_t limit = key_limit(call, b, i);
    if (!call.mask) {
      pairs += limit;
      continue;
    }
    for (int64_t j = 0; j < limit; ++j) {
      const int64_t index[4] = {b, h, i, j};
      if (mask_allows(*call.mask, mask_offset(*call.mask, index))) ++pairs;
    }
  }
  return pairs;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

// ---------------------------------------------------------------- the command's frame

const char* const kRunExitStatusHelp =
    "Exit status:\n"
    "  0        success\n"
    "  1        the run failed: an input could not be read or was refused, the library\n"
    "           refused the call or failed, memory ran out, or an output or stdout\n"
    "           could not be written (output files are replaced only when all of\n"
    "           them are written: none of them is changed then)\n"
    "  2        the command line is wrong (found by mha-run after parsing): a required\n"
    "           flag is missing, flags contradict each other or the weights'\n"
    "           config.json, --scale rounds to 0 or overflows in float32, an output\n"
    "           is named twice or names an input\n"
    "  100-127  the command line cannot be parsed (CLI11's codes): 104 a value of the\n"
    "           wrong type, 105 a value not allowed (an empty one too), 106 a required\n"
    "           option missing, 108 flags that exclude each other, 109 an unknown flag\n"
    "           or an extra argument";

void print_error(const std::string& message) {
  std::fprintf(stderr, "mha-run: %s\n", escape(message).c_str());
}

int run_guarded(const std::function<int()>& body) {
  try {
    return body();
  } catch (const ToolError& e) {
    print_error(e.what());
    return e.exit_status();
  } catch (const OutputConflict& e) {
    print_error(e.what());
    return kExitUsage;
  } catch (const std::bad_alloc&) {
    print_error("out of memory");
  } catch (const std::exception& e) {
    print_error(e.what());
  }
  return kExitFailure;
}

NpyArray read_float_input(const char* flag, const std::string& path) {
  NpyArray a = read_input(flag, path);
  if (a.dtype() != NpyDtype::F64) return a;
  NpyArray f(NpyDtype::F32, a.shape(), a.fortran_order());
  const double* from = a.data_as<double>();
  float* to = f.data_as<float>();
  for (int64_t i = 0; i < a.size(); ++i) {
    const double value = from[i];
    to[i] = static_cast<float>(value);
    if (std::isinf(to[i]) && std::isfinite(value)) {
      char text[40];
      std::snprintf(text, sizeof text, "%.17g", value);
      throw ToolError(label(flag, path) + ": float64 value " + text +
                      " does not fit in float32 (largest 3.4028235e+38)");
    }
  }
  if (verbose()) print_error(label(flag, path) + ": float64 converted to float32");
  return f;
}

// ---------------------------------------------------------------- options

void add_attention_options(CLI::App& app, AttentionOptions& o) {
  const CLI::Validator& filled = non_empty();
  app.add_option("--q", o.q,
                 "queries: float32 [B,H,Lq,D] .npy (C or Fortran order; float64 is converted; "
                 "[H,Lq,D] with K and V of rank 3 too is one batch)")
      ->check(filled);
  app.add_option("--k", o.k, "keys: float32 [B,Hkv,Lk,D] .npy; H must be a multiple of Hkv")
      ->check(filled);
  app.add_option("--v", o.v, "values: float32 [B,Hkv,Lk,Dv] .npy")->check(filled);
  app.add_option("--out", o.out,
                 "output: float32 [B,H,Lq,Dv] .npy to write ([H,Lq,Dv] for rank-3 inputs); "
                 "replaced only once every output is written")
      ->check(filled);
  app.add_option("--mask", o.mask,
                 "mask .npy, bool (true = the key takes part) or float32/float64 (added to the "
                 "scores), broadcastable to [B,H,Lq,Lk] (rank 2 to 4)")
      ->check(filled);
  app.add_option("--valid-lens", o.valid_lens, "valid lengths .npy, int32 or int64, [B] or [B,Lq]")
      ->check(filled);
  add_causal_option(app, o.causal,
                    "causal mask: none (the default), top-left (also --causal alone) or "
                    "bottom-right");
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
  app.add_option("--lse", o.lse,
                 "log-sum-exp output: float32 [B,H,Lq] .npy to write ([H,Lq] for rank-3 inputs)")
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
  (void)causal_mode(o.causal);
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

// ---------------------------------------------------------------- loading

AttentionInputs load_attention_inputs(const AttentionOptions& o) {
  AttentionInputs in{load_float_tensor("--q", o.q, "Q", "[B,H,Lq,D]"),
                     load_float_tensor("--k", o.k, "K", "[B,Hkv,Lk,D]"),
                     load_float_tensor("--v", o.v, "V", "[B,Hkv,Lk,Dv]"),
                     {},
                     {},
                     false};
  check_ranks(in, o);
  in.unbatched = in.q.rank() == 3;
  if (!o.mask.empty()) {
    NpyArray m = read_float_input("--mask", o.mask);
    if (m.dtype() != NpyDtype::Bool && m.dtype() != NpyDtype::U8 && m.dtype() != NpyDtype::F32) {
      throw ToolError(
          label("--mask", o.mask) +
          ": the mask must be bool (|b1, or |u1) or float32 (<f4, or float64 <f8); the file "
          "holds " +
          m.describe());
    }
    in.mask = std::move(m);
  }
  if (!o.valid_lens.empty()) {
    NpyArray vl = read_input("--valid-lens", o.valid_lens);
    if (vl.dtype() != NpyDtype::I32 && vl.dtype() != NpyDtype::I64) {
      throw ToolError(label("--valid-lens", o.valid_lens) +
                      ": valid lengths must be int32 (<i4) or int64 (<i8); the file holds " +
                      vl.describe());
    }
    in.valid_lens = std::move(vl);
  }
  return in;
}

// ---------------------------------------------------------------- calling

mha_attention_params AttentionCall::params() {
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.causal = causal;
  if (scale) {
    p.has_scale = 1;
    p.scale = *scale;
  }
  p.valid_lens = valid_lens ? &*valid_lens : nullptr;
  p.mask = mask ? &*mask : nullptr;
  p.lse = lse ? &*lse : nullptr;
  return p;
}

AttentionCall prepare_attention_call(AttentionInputs& in, const AttentionOptions& o) {
  AttentionCall call;
  const bool b1 = in.unbatched;
  call.q = describe(in.q, MHA_DTYPE_F32, label("--q", o.q), b1);
  call.k = describe(in.k, MHA_DTYPE_F32, label("--k", o.k), b1);
  call.v = describe(in.v, MHA_DTYPE_F32, label("--v", o.v), b1);
  if (in.mask) {
    const mha_dtype dtype = in.mask->dtype() == NpyDtype::F32 ? MHA_DTYPE_F32 : MHA_DTYPE_BOOL;
    call.mask = describe(*in.mask, dtype, label("--mask", o.mask));
  }
  if (in.valid_lens) {
    const mha_dtype dtype = in.valid_lens->dtype() == NpyDtype::I64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
    call.valid_lens = describe(*in.valid_lens, dtype, label("--valid-lens", o.valid_lens));
  }
  call.causal = causal_mode(o.causal);
  if (o.scale) call.scale = static_cast<float>(*o.scale);

  // [B,H,Lq,Dv] and [B,H,Lq], or [H,Lq,Dv] and [H,Lq] for rank-3 inputs.
  std::vector<int64_t> lse_shape = in.q.shape();
  lse_shape.pop_back();
  std::vector<int64_t> out_shape = lse_shape;
  out_shape.push_back(in.v.shape().back());
  call.out_array = NpyArray(NpyDtype::F32, out_shape);
  call.out = describe(call.out_array, MHA_DTYPE_F32, "the output", b1);
  if (!o.lse.empty()) {
    call.lse_array = NpyArray(NpyDtype::F32, lse_shape);
    call.lse = describe(call.lse_array, MHA_DTYPE_F32, "the LSE output", b1);
  }
  return call;
}

void call_attention(AttentionCall& call) {
  const mha_attention_params params = call.params();
  const mha_status status = mha_attention(&call.q, &call.k, &call.v, &call.out, &params);
  if (status != MHA_OK) library_error("mha_attention", status);
}

Timing time_attention(AttentionCall& call, int repeat) {
  std::vector<double> ms;
  ms.reserve(static_cast<std::size_t>(repeat));
  for (int r = 0; r < repeat; ++r) {
    const auto start = std::chrono::steady_clock::now();
    call_attention(call);
    const auto stop = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return {median_of(ms), *std::min_element(ms.begin(), ms.end())};
}

// ---------------------------------------------------------------- counting

int64_t count_attention_pairs(const AttentionCall& call) {
  const int64_t batch = call.q.shape[0], heads = call.q.shape[1];
  // Causal mode and valid lengths are the same for every head; so is a mask
  // without a head dimension.
  const bool per_head =
      call.mask && call.mask->ndim >= 3 && call.mask->shape[call.mask->ndim - 3] != 1;
  int64_t pairs = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (per_head) {
      for (int64_t h = 0; h < heads; ++h) pairs += count_pairs_of_head(call, b, h);
    } else {
      pairs += heads * count_pairs_of_head(call, b, 0);
    }
  }
  return pairs;
}

double attention_flops(const AttentionCall& call) {
  const double d = static_cast<double>(call.q.shape[3]), dv = static_cast<double>(call.v.shape[3]);
  return 2.0 * (d + dv) * static_cast<double>(count_attention_pairs(call));
}

std::string timing_json(const Timing& timing, double flops) {
  const char* backend = mha_selected_backend();
  nlohmann::ordered_json j;
  j["backend"] = backend != nullptr ? backend : "";
  j["threads"] = mha_get_num_threads();
  j["median_ms"] = timing.median_ms;
  j["min_ms"] = timing.min_ms;
  j["gflops"] = timing.median_ms > 0 ? flops / (timing.median_ms * 1e6) : 0.0;
  return j.dump();
}

// ---------------------------------------------------------------- writing

std::vector<NamedFile> attention_outputs(const AttentionOptions& o) {
  std::vector<NamedFile> files;
  if (!o.lse.empty()) files.push_back({"--lse", o.lse});
  if (!o.out.empty()) files.push_back({"--out", o.out});
  return files;
}

std::vector<NamedFile> attention_inputs(const AttentionOptions& o) {
  return {
      {"--q", o.q}, {"--k", o.k}, {"--v", o.v}, {"--mask", o.mask}, {"--valid-lens", o.valid_lens}};
}

void write_attention_outputs(const AttentionCall& call, const AttentionOptions& o,
                             OutputFiles& outputs) {
  std::vector<const NpyArray*> arrays;  // in the order of attention_outputs()
  if (!o.lse.empty()) arrays.push_back(&call.lse_array);
  if (!o.out.empty()) arrays.push_back(&call.out_array);
  outputs.commit(arrays);
}

void print_stdout_line(const std::string& line) {
  errno = 0;
  const bool ok = std::printf("%s\n", line.c_str()) >= 0 && std::fflush(stdout) == 0 &&
                  std::ferror(stdout) == 0;
  if (!ok) {
    const int err = errno;
    std::clearerr(stdout);
    throw ToolError(std::string("cannot write to stdout: ") +
                    (err != 0 ? std::strerror(err) : "write error"));
  }
}

int run_attention_command(const AttentionOptions& o) {
  return run_guarded([&o] {
    check_attention_options(o);
    OutputFiles outputs(attention_outputs(o), attention_inputs(o));
    configure_runtime(o.backend, o.threads);
    AttentionInputs inputs = load_attention_inputs(o);
    AttentionCall call = prepare_attention_call(inputs, o);
    call_attention(call);
    write_attention_outputs(call, o, outputs);
    if (o.repeat > 0) {
      const Timing timing = time_attention(call, o.repeat);
      print_stdout_line(timing_json(timing, attention_flops(call)));
    }
    return kExitOk;
  });
}

}  // namespace mha_tools
