#include "attention.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "env.h"
#include "error.h"
#include "registry.h"
#include "scheduler.h"
#include "threads.h"

namespace mha::rt {
namespace {

// Which arithmetic the backend's kernel used: the plugin's own answer, or
// (without the hook) fp32 for fp32 inputs and widening to fp32 for the others.
const char* path_of(const Backend& backend, const mha_kernel_problem& p) {
  if (backend.plugin->path != nullptr) {
    if (const char* path = backend.plugin->path(&p); path != nullptr) return path;
  }
  return p.q_dtype == MHA_DTYPE_F32 && p.kv_dtype == MHA_DTYPE_F32 ? "fp32" : "widened-to-fp32";
}

void log_call(const Backend& backend, const KernelCall& call, const WorkPlan& plan, int32_t threads,
              double ms) {
  const mha_kernel_problem& p = call.problem;
  std::fprintf(
      stderr,
      "mha_verbose,exec,attention,backend=%s,B=%lld,H=%lld,Hkv=%lld,Lq=%lld,Lk=%lld,"
      "D=%lld,Dv=%lld,q=%s,kv=%s,out=%s,path=%s,scale=%g,causal_diag=%s,valid_lens=%s,mask=%s,"
      "variants=%s,lse=%s,layout=%s,"
      "items=%lld,chunks=%lld,threads=%d,ms=%.4f\n",
      backend.name.c_str(), static_cast<long long>(p.batch), static_cast<long long>(p.heads),
      static_cast<long long>(p.kv_heads), static_cast<long long>(p.lq),
      static_cast<long long>(p.lk), static_cast<long long>(p.d), static_cast<long long>(p.dv),
      dtype_name(p.q_dtype), dtype_name(p.kv_dtype), dtype_name(call.out_dtype),
      printable(path_of(backend, p), 40).c_str(), static_cast<double>(p.scale),
      p.causal_diag >= INT64_MAX / 4 ? "none" : std::to_string(p.causal_diag).c_str(),
      p.valid_lens == nullptr ? "no" : (p.valid_lens_strides[1] != 0 ? "per-query" : "per-batch"),
      p.mask_kind == MHA_MASK_BOOL ? "bool"
                                   : (p.mask_kind == MHA_MASK_ADDITIVE ? "additive" : "no"),
      variants_of(call).c_str(), call.lse != nullptr ? "yes" : "no", layout_name(plan.layout),
      static_cast<long long>(plan.items()), static_cast<long long>(plan.chunks), threads, ms);
}

}  // namespace

std::string variants_of(const KernelCall& call) {
  const mha_kernel_problem& p = call.problem;
  std::string list;
  const auto add = [&list](const std::string& variant) {
    list += (list.empty() ? "" : "+") + variant;
  };
  if (call.window_left >= 0 || call.window_right >= 0) {
    add("window(" + std::to_string(call.window_left) + ";" + std::to_string(call.window_right) +
        ")");
  }
  if (p.softcap > 0.0f) {
    char text[32];
    std::snprintf(text, sizeof text, "softcap(%g)", static_cast<double>(p.softcap));
    add(text);
  }
  if (p.alibi_slopes != nullptr) add(p.alibi_strides[0] != 0 ? "alibi(per-batch)" : "alibi");
  if (p.sinks != nullptr) add("sinks");
  if (p.query_offset != 0 || p.key_offset != 0 || p.full_lq != p.lq ||
      p.alibi_diag != p.lk - p.lq) {  // a block of a larger problem
    add("block(q" + std::to_string(p.query_offset) + ";k" + std::to_string(p.key_offset) + ";lq" +
        std::to_string(p.full_lq) + ")");
  }
  return list.empty() ? "none" : list;
}

namespace {

// The selected backend, if it can compute the call; else null, with the
// failure in *status.
const Backend* backend_for(const KernelCall& call, mha_status* status) {
  const char* why = nullptr;
  const Backend* backend = Registry::instance().selected(&why);
  if (backend == nullptr) {
    *status = fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", why);
    return nullptr;
  }
  if (const mha_plugin& plugin = *backend->plugin; plugin.supports != nullptr) {
    char reason[256] = "";
    if (plugin.supports(&call.problem, reason, sizeof reason) == 0) {
      reason[sizeof reason - 1] = '\0';
      const std::string text = printable(reason, 200);
      if (verbose_level() >= 1) {
        std::fprintf(stderr, "mha: backend %s declines a call: %s\n", backend->name.c_str(),
                     text.c_str());
      }
      *status = fail(MHA_ERR_UNSUPPORTED, "backend %s cannot compute this call: %s",
                     backend->name.c_str(), text.empty() ? "no reason given" : text.c_str());
      return nullptr;
    }
  }
  return backend;
}

}  // namespace

mha_status attend(KernelCall* calls, int64_t count, int64_t batch) {
  const char* why = nullptr;
  const Backend* backend = Registry::instance().selected(&why);
  if (backend == nullptr) return fail(MHA_ERR_BACKEND_UNAVAILABLE, "%s", why);
  // The sequences differ only in their lengths: each is asked (a backend may
  // decline a shape).
  for (int64_t c = 0; c < count; ++c) {
    mha_status refusal = MHA_OK;
    backend = backend_for(calls[c], &refusal);
    if (backend == nullptr) return refusal;
  }
  const int32_t threads = num_threads();
  if (verbose_level() < 2 || count == 0) return run_attention(*backend, calls, count, threads);

  const auto start = std::chrono::steady_clock::now();
  const mha_status status = run_attention(*backend, calls, count, threads);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const mha_kernel_problem& p = calls[0].problem;
  int64_t total_q = 0, total_k = 0, max_q = 0, max_k = 0;
  for (int64_t c = 0; c < count; ++c) {
    total_q += calls[c].problem.lq;
    total_k += calls[c].problem.lk;
    max_q = std::max(max_q, calls[c].problem.lq);
    max_k = std::max(max_k, calls[c].problem.lk);
  }
  std::fprintf(stderr,
               "mha_verbose,exec,attention_varlen,backend=%s,B=%lld,sequences_run=%lld,H=%lld,"
               "Hkv=%lld,total_q=%lld,total_k=%lld,max_q=%lld,max_k=%lld,D=%lld,Dv=%lld,q=%s,"
               "kv=%s,out=%s,path=%s,variants=%s,lse=%s,threads=%d,ms=%.4f\n",
               backend->name.c_str(), static_cast<long long>(batch), static_cast<long long>(count),
               static_cast<long long>(p.heads), static_cast<long long>(p.kv_heads),
               static_cast<long long>(total_q), static_cast<long long>(total_k),
               static_cast<long long>(max_q), static_cast<long long>(max_k),
               static_cast<long long>(p.d), static_cast<long long>(p.dv), dtype_name(p.q_dtype),
               dtype_name(p.kv_dtype), dtype_name(calls[0].out_dtype),
               printable(path_of(*backend, p), 40).c_str(), variants_of(calls[0]).c_str(),
               calls[0].lse != nullptr ? "yes" : "no", threads, ms);
  return status;
}

mha_status attend(KernelCall& call) {
  mha_status refusal = MHA_OK;
  const Backend* backend = backend_for(call, &refusal);
  if (backend == nullptr) return refusal;
  const int32_t threads = num_threads();
  if (verbose_level() < 2) return run_attention(*backend, call, threads);

  const auto start = std::chrono::steady_clock::now();
  const mha_status status = run_attention(*backend, call, threads);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  log_call(*backend, call, plan_work(call.problem, *backend, 1, threads), threads, ms);
  return status;
}

}  // namespace mha::rt
