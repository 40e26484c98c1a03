#include "attention_run.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <new>
#include <nlohmann/json.hpp>

namespace mha_tools {
namespace {

// "--q q.npy" as messages name an input.
std::string label(const char* flag, const std::string& path) {
  return std::string(flag) + " " + path;
}

[[noreturn]] void library_error(const std::string& what, mha_status status) {
  throw ToolError(what + " failed (" + mha_status_name(status) + "): " + mha_last_error());
}

// A descriptor over an array, in the array's own layout (C or Fortran order).
mha_tensor describe(NpyArray& array, mha_dtype dtype, const std::string& what) {
  if (array.rank() < 1 || array.rank() > MHA_MAX_DIMS) {
    throw ToolError(what + ": " + array.describe() + " has rank " + std::to_string(array.rank()) +
                    "; mha takes tensors of rank 1 to " + std::to_string(MHA_MAX_DIMS));
  }
  mha_tensor t{};
  const mha_status status = mha_tensor_init(&t, array.data(), dtype, array.rank(),
                                            array.shape().data(), array.strides().data());
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

NpyArray load_float_tensor(const char* flag, const std::string& path, const char* role) {
  NpyArray a = read_input(flag, path);
  if (a.dtype() != NpyDtype::F32 || a.rank() != 4) {
    throw ToolError(label(flag, path) + ": " + role +
                    " must be float32 (<f4) of rank 4; the file " + "holds " + a.describe());
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

// Keys 0 .. limit-1 of (batch b, query i) survive the causal mode and valid lengths.
int64_t key_limit(const AttentionCall& call, int64_t b, int64_t i) {
  const int64_t lq = call.q.shape[2], lk = call.k.shape[2];
  int64_t limit = lk;
  if (call.causal == MHA_CAUSAL_TOP_LEFT) limit = std::min(limit, i + 1);
  if (call.causal == MHA_CAUSAL_BOTTOM_RIGHT) limit = std::min(limit, i + lk - lq + 1);
  if (call.valid_lens) {
    const mha_tensor& vl = *call.valid_lens;
    int64_t offset = b * vl.strides[0];
    if (vl.ndim == 2) offset += i * vl.strides[1];
    limit = std::min(limit, integer_at(vl, offset));
  }
  return std::max<int64_t>(limit, 0);
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

// ---------------------------------------------------------------- options

void add_attention_options(CLI::App& app, AttentionOptions& o) {
  app.add_option("--q", o.q, "queries: float32 [B,H,Lq,D] .npy (C or Fortran order)");
  app.add_option("--k", o.k, "keys: float32 [B,Hkv,Lk,D] .npy; H must be a multiple of Hkv");
  app.add_option("--v", o.v, "values: float32 [B,Hkv,Lk,Dv] .npy");
  app.add_option("--out", o.out, "output: float32 [B,H,Lq,Dv] .npy to write");
  app.add_option("--mask", o.mask,
                 "mask .npy, bool (true = the key takes part) or float32 (added to the scores), "
                 "broadcastable to [B,H,Lq,Lk] (rank 2 to 4)");
  app.add_option("--valid-lens", o.valid_lens, "valid lengths .npy, int32 or int64, [B] or [B,Lq]");
  app.add_option("--causal", o.causal, "causal mask: none, top-left or bottom-right")
      ->check(CLI::IsMember({"none", "top-left", "bottom-right"}));
  app.add_option_function<double>(
      "--scale", [&o](const double& s) { o.scale = s; }, "scale of the scores (default 1/sqrt(D))");
  app.add_option("--lse", o.lse, "log-sum-exp output: float32 [B,H,Lq] .npy to write");
  app.add_option("--backend", o.backend, "backend to use (default: MHA_BACKEND, else auto)");
  app.add_option_function<int>(
      "--threads", [&o](const int& n) { o.threads = n; }, "threads inside one call");
  app.add_option("--repeat", o.repeat,
                 "time N calls after the first and print one JSON line with the median")
      ->check(CLI::Range(1, 1000000000));
}

void check_attention_options(const AttentionOptions& o) {
  std::string missing;
  const auto need = [&missing](const std::string& value, const char* flag) {
    if (value.empty()) missing += missing.empty() ? flag : std::string(", ") + flag;
  };
  need(o.q, "--q");
  need(o.k, "--k");
  need(o.v, "--v");
  if (o.repeat == 0) need(o.out, "--out");
  if (!missing.empty()) throw ToolError("missing " + missing + " (see --help)");
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
  AttentionInputs in{load_float_tensor("--q", o.q, "Q [B,H,Lq,D]"),
                     load_float_tensor("--k", o.k, "K [B,Hkv,Lk,D]"),
                     load_float_tensor("--v", o.v, "V [B,Hkv,Lk,Dv]"),
                     {},
                     {}};
  if (!o.mask.empty()) {
    NpyArray m = read_input("--mask", o.mask);
    if (m.dtype() != NpyDtype::Bool && m.dtype() != NpyDtype::U8 && m.dtype() != NpyDtype::F32) {
      throw ToolError(label("--mask", o.mask) +
                      ": the mask must be bool (|b1, or |u1) or float32 (<f4); the file holds " +
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
  call.q = describe(in.q, MHA_DTYPE_F32, label("--q", o.q));
  call.k = describe(in.k, MHA_DTYPE_F32, label("--k", o.k));
  call.v = describe(in.v, MHA_DTYPE_F32, label("--v", o.v));
  if (in.mask) {
    const mha_dtype dtype = in.mask->dtype() == NpyDtype::F32 ? MHA_DTYPE_F32 : MHA_DTYPE_BOOL;
    call.mask = describe(*in.mask, dtype, label("--mask", o.mask));
  }
  if (in.valid_lens) {
    const mha_dtype dtype = in.valid_lens->dtype() == NpyDtype::I64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
    call.valid_lens = describe(*in.valid_lens, dtype, label("--valid-lens", o.valid_lens));
  }
  if (o.causal == "top-left") call.causal = MHA_CAUSAL_TOP_LEFT;
  if (o.causal == "bottom-right") call.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  if (o.scale) call.scale = static_cast<float>(*o.scale);

  const std::vector<int64_t>& q = in.q.shape();
  call.out_array = NpyArray(NpyDtype::F32, {q[0], q[1], q[2], in.v.shape()[3]});
  call.out = describe(call.out_array, MHA_DTYPE_F32, "the output");
  if (!o.lse.empty()) {
    call.lse_array = NpyArray(NpyDtype::F32, {q[0], q[1], q[2]});
    call.lse = describe(call.lse_array, MHA_DTYPE_F32, "the LSE output");
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

void write_attention_outputs(const AttentionCall& call, const AttentionOptions& o) {
  try {
    if (!o.out.empty()) write_npy(o.out, call.out_array);
    if (!o.lse.empty()) write_npy(o.lse, call.lse_array);
  } catch (const NpyError& e) {
    throw ToolError(e.what());
  }
}

int run_attention_command(const AttentionOptions& o) {
  try {
    check_attention_options(o);
    configure_runtime(o.backend, o.threads);
    AttentionInputs inputs = load_attention_inputs(o);
    AttentionCall call = prepare_attention_call(inputs, o);
    call_attention(call);
    write_attention_outputs(call, o);
    if (o.repeat > 0) {
      const Timing timing = time_attention(call, o.repeat);
      std::printf("%s\n", timing_json(timing, attention_flops(call)).c_str());
    }
    return 0;
  } catch (const ToolError& e) {
    std::fprintf(stderr, "mha-run: %s\n", e.what());
  } catch (const NpyError& e) {
    std::fprintf(stderr, "mha-run: %s\n", e.what());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "mha-run: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mha-run: %s\n", e.what());
  }
  return 1;
}

}  // namespace mha_tools
