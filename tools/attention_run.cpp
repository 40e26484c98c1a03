// `mha-run` attention mode: the command's frame (errors, exit statuses), the
// call, its timing and the outputs written.
#include "attention_run.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

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

void call_attention(AttentionCall& call) {
  const mha_attention_params params = call.params();
  if (call.cu_seqlens_q) {
    mha_varlen_params varlen;
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &*call.cu_seqlens_q;
    varlen.cu_seqlens_k = call.cu_seqlens_k ? &*call.cu_seqlens_k : nullptr;
    varlen.seqused_k = call.seqused_k ? &*call.seqused_k : nullptr;
    varlen.block_table = call.block_table ? &*call.block_table : nullptr;
    const mha_status status =
        mha_attention_varlen(&call.q, &call.k, &call.v, &call.out, &varlen, &params);
    if (status != MHA_OK) library_error("mha_attention_varlen", status);
    return;
  }
  const mha_status status = mha_attention(&call.q, &call.k, &call.v, &call.out, &params);
  if (status != MHA_OK) library_error("mha_attention", status);
}

Timing time_calls(const std::function<void()>& call, int repeat) {
  std::vector<double> ms;
  ms.reserve(static_cast<std::size_t>(repeat));
  for (int r = 0; r < repeat; ++r) {
    const auto start = std::chrono::steady_clock::now();
    call();
    const auto stop = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return {median_of(ms), *std::min_element(ms.begin(), ms.end())};
}

Timing time_attention(AttentionCall& call, int repeat) {
  return time_calls([&call] { call_attention(call); }, repeat);
}

std::string timing_json(const Timing& timing, double flops, const Dtypes& dtypes) {
  const char* backend = mha_selected_backend();
  nlohmann::ordered_json j;
  j["backend"] = backend != nullptr ? backend : "";
  j["threads"] = mha_get_num_threads();
  j["median_ms"] = timing.median_ms;
  j["min_ms"] = timing.min_ms;
  j["gflops"] = timing.median_ms > 0 ? flops / (timing.median_ms * 1e6) : 0.0;
  if (dtypes.q != MHA_DTYPE_F32 || dtypes.kv != MHA_DTYPE_F32) {
    j["dtype"] = mha_types::dtype_name(dtypes.q);
    j["kv_dtype"] = mha_types::dtype_name(dtypes.kv);
  }
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
  return {{"--q", o.q},
          {"--k", o.k},
          {"--v", o.v},
          {"--mask", o.mask},
          {"--valid-lens", o.valid_lens},
          {"--cu-seqlens-q", o.cu_seqlens_q},
          {"--cu-seqlens-k", o.cu_seqlens_k},
          {"--seqused-k", o.seqused_k},
          {"--block-table", o.block_table},
          {"--sinks", o.sinks},
          {"--alibi", o.alibi}};
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
      const Dtypes dtypes{static_cast<mha_dtype>(call.q.dtype),
                          static_cast<mha_dtype>(call.k.dtype)};
      print_stdout_line(timing_json(timing, attention_flops(call), dtypes));
    }
    return kExitOk;
  });
}

}  // namespace mha_tools
