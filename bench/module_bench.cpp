// The multi-head attention module in mha_bench:
//
//   module/<backend>/S1/threads:<n>   E = 768, 12 heads, B = 8, L = 512, self-attention
//   module/<backend>/S1:bf16/threads:<n>  S1 with query = key = value and out in bf16
//                                     (the same values rounded; widened inside, every
//                                     product fp32)
//   module/<backend>/S1:bf16act/threads:<n>  S1:bf16 with config.activations =
//                                     MHA_ACTIVATIONS_INPUT (Q, K, V and the heads'
//                                     outputs rounded to bf16, as PyTorch's bf16
//                                     module keeps them)
//   module/<backend>/S5/threads:<n>   the d2l example: E = 100, 5 heads, queries
//                                     [2, 4, 100], keys = values [2, 6, 100],
//                                     valid_lens [3, 2]
//
// One call is mha_module_forward (inference, no masks on S1), with the same
// tensor as query, key and value on S1 (self-attention: one projection against
// the stacked [3E, E] weights).  Counters, from the measured time per call:
//   GFLOPS        (8·B·L·E² + attention FLOPs) / time: the four projections
//                 (2·B·L·E² each) plus 4·D per (query, key) pair and head that
//                 takes part (bench/README.md); on S5, E·(2·B·Lq·(Eq + E) +
//                 2·B·Lk·(Ek + Ev)) for the projections
//   pct_peak      GFLOPS over the FMA peak of the widest usable ISA at the same
//                 thread count (BLIS runs its widest kernels whatever the
//                 attention backend), when the caller passes the peak; on the
//                 bf16 shapes of a backend whose projections run as bf16
//                 products (vdpbf16ps or AMX tiles: MHA_VERBOSE=2's
//                 bf16_gemm), over the peak of those products instead, and
//                 bf16_peak = 1 says so (blis_pct and parts_pct stay against
//                 the FMA peak: BLIS's products are fp32)
//   attention_ms  mha_attention alone on the same strided views of a [B, L, 3E]
//                 buffer, timed in the same benchmark (median of 5 calls)
//   projection_ms the rest: total - attention_ms (the input and output
//                 projections, their biases included)
//   attention_share  attention_ms / total
//   blis_ms       BLIS alone on the module's products, without biases: the
//                 fused QKV projection [B·L, E] x [E, 3E] and the output
//                 projection [B·L, E] x [E, E] (median of 5)
//   blis_pct      their FLOPs over blis_ms, against the FMA peak
//   parts_pct     the module's FLOPs over blis_ms + attention_ms: what the
//                 module reaches if it adds no work of its own to the
//                 products and the attention, each as fast as alone
//   us_per_call   (S5)
//
// mha_bench registers these by calling register_module_benchmarks(fma_peak,
// bf16_peak) after its own benchmarks; fma_peak(isa, threads) returns the FMA
// peak in GFLOP/s that mha_bench measured (or 0 when unknown), bf16_peak(
// backend, threads) the peak of the backend's bf16 products (0 where it
// widens bf16).
#include <benchmark/benchmark.h>
#include <blis.h>
#include <mha/mha.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "bench_inputs.h"
#include "common/dtype.h"
#include "usable_backends.h"

using ModulePeakFn = double (*)(const std::string& isa, int threads);

// What mha_bench measured: the FMA peak of an ISA, the bf16 products' of a
// backend (either may be nullptr: no pct_peak then).
struct ModulePeaks {
  ModulePeakFn fma = nullptr;
  ModulePeakFn bf16 = nullptr;
};

namespace {

using Clock = std::chrono::steady_clock;

struct ModuleShape {
  const char* name;
  int64_t b, lq, lk, e, h;
  bool d2l;  // S5: separate query and key/value tensors, valid_lens [3, 2]
  benchmark::TimeUnit unit;
  mha_dtype dtype = MHA_DTYPE_F32;  // of the inputs and the output
  mha_activations activations = MHA_ACTIVATIONS_F32;
};

const ModuleShape kModuleShapes[] = {
    {"S1", 8, 512, 512, 768, 12, false, benchmark::kMillisecond},
    {"S1:bf16", 8, 512, 512, 768, 12, false, benchmark::kMillisecond, MHA_DTYPE_BF16},
    {"S1:bf16act", 8, 512, 512, 768, 12, false, benchmark::kMillisecond, MHA_DTYPE_BF16,
     MHA_ACTIVATIONS_INPUT},
    {"S5", 2, 4, 6, 100, 5, true, benchmark::kMicrosecond},
};

// x's values as bf16 bits (to nearest even).
std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = mha_types::f32_to_bf16(x[i]);
  return bits;
}
const std::array<int32_t, 2> kD2lValidLens = {3, 2};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double module_flops(const ModuleShape& s) {
  const double b = static_cast<double>(s.b), lq = static_cast<double>(s.lq),
               lk = static_cast<double>(s.lk), e = static_cast<double>(s.e);
  const double projections = 2.0 * e * (b * lq * (e + e) + b * lk * (e + e));
  double pairs = 0.0;
  for (int64_t n = 0; n < s.b; ++n) {
    pairs += lq * static_cast<double>(s.d2l ? kD2lValidLens.at(static_cast<size_t>(n)) : s.lk);
  }
  const double d = e / static_cast<double>(s.h);
  return projections + 4.0 * d * static_cast<double>(s.h) * pairs;
}

struct ModuleHandle {
  mha_module* m = nullptr;
  ~ModuleHandle() { mha_module_destroy(m); }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// mha_attention alone, on the views the module hands it (S1: q, k, v in one
// [B, L, 3E] buffer, the heads' outputs into [B, L, E]; bf16 ones where the
// module keeps its activations in bf16).
double attention_alone_ms(const ModuleShape& s) {
  const int64_t d = s.e / s.h;
  std::vector<float> qkv(static_cast<size_t>(s.b * s.lq * 3 * s.e)),
      o(static_cast<size_t>(s.b * s.lq * s.e));
  mha_bench::fill_uniform(qkv, 5, 1.0f);
  const bool half = s.activations == MHA_ACTIVATIONS_INPUT;
  const std::vector<uint16_t> qkv16 = half ? to_bf16(qkv) : std::vector<uint16_t>();
  const mha_dtype dtype = half ? MHA_DTYPE_BF16 : MHA_DTYPE_F32;
  const auto at = [&](int64_t offset) -> void* {
    return half ? static_cast<void*>(const_cast<uint16_t*>(qkv16.data()) + offset)
                : static_cast<void*>(qkv.data() + offset);
  };
  const int64_t row = 3 * s.e;
  const int64_t shape[4] = {s.b, s.h, s.lq, d};
  const int64_t in_strides[4] = {s.lq * row, d, row, 1};
  const int64_t out_strides[4] = {s.lq * s.e, d, s.e, 1};
  mha_tensor q, k, v, out;
  mha_tensor_init(&q, at(0), dtype, 4, shape, in_strides);
  mha_tensor_init(&k, at(s.e), dtype, 4, shape, in_strides);
  mha_tensor_init(&v, at(2 * s.e), dtype, 4, shape, in_strides);
  mha_tensor_init(&out, o.data(), dtype, 4, shape, out_strides);  // bf16: o's first half
  std::vector<double> ms;
  for (int r = 0; r < 6; ++r) {
    const auto t0 = Clock::now();
    if (mha_attention(&q, &k, &v, &out, nullptr) != MHA_OK) return 0.0;
    if (r > 0) ms.push_back(seconds_since(t0) * 1e3);  // the first call warms up
  }
  return median(ms);
}

// BLIS alone on the products of a self-attention module of shape s, on
// `threads` threads (blis_ms above).
double blis_products_ms(const ModuleShape& s, int threads) {
  const int64_t rows = s.b * s.lq, e = s.e;
  std::vector<float> x(static_cast<size_t>(rows * e)), w(static_cast<size_t>(e * 3 * e)),
      qkv(static_cast<size_t>(rows * 3 * e)), o(static_cast<size_t>(rows * e));
  mha_bench::fill_uniform(x, 21, 1.0f);
  mha_bench::fill_uniform(w, 22, 0.03f);
  rntm_t rntm;
  bli_rntm_init(&rntm);
  bli_rntm_set_num_threads(threads, &rntm);
  float one = 1.0f, zero = 0.0f;
  std::vector<double> ms;
  for (int r = 0; r < 6; ++r) {
    const auto t0 = Clock::now();
    bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, rows, 3 * e, e, &one, x.data(), e, 1,
                 w.data(), 3 * e, 1, &zero, qkv.data(), 3 * e, 1, nullptr, &rntm);
    bli_sgemm_ex(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, rows, e, e, &one, qkv.data(), 3 * e, 1,
                 w.data(), 3 * e, 1, &zero, o.data(), e, 1, nullptr, &rntm);
    if (r > 0) ms.push_back(seconds_since(t0) * 1e3);  // the first call warms up
  }
  return median(ms);
}

void bm_module(benchmark::State& st, const std::string& backend, const ModuleShape& s, int n,
               const std::string& peak_isa, ModulePeaks peaks) {
  if (mha_select_backend(backend.c_str()) != MHA_OK || mha_set_num_threads(n) != MHA_OK) {
    st.SkipWithError(mha_last_error());
    return;
  }
  mha_module_config config;
  mha_module_config_init(&config);
  config.embed_dim = s.e;
  config.num_heads = s.h;
  config.activations = s.activations;
  ModuleHandle module;
  if (mha_module_create(&config, &module.m) != MHA_OK) {
    st.SkipWithError(mha_last_error());
    return;
  }
  for (mha_bench::ModuleWeight& w : mha_bench::module_weights(s.e)) {
    // A half-precision shape models a bf16 checkpoint: its weights are bf16
    // too (PyTorch's module.to(torch.bfloat16)).
    mha_tensor t;
    const std::vector<uint16_t> w16 =
        s.dtype != MHA_DTYPE_F32 ? to_bf16(w.data) : std::vector<uint16_t>();
    if (s.dtype != MHA_DTYPE_F32) {
      mha_tensor_init(&t, const_cast<uint16_t*>(w16.data()), MHA_DTYPE_BF16, w.ndim, w.shape,
                      nullptr);
    } else {
      mha_tensor_init(&t, w.data.data(), MHA_DTYPE_F32, w.ndim, w.shape, nullptr);
    }
    if (mha_module_set_weight(module.m, w.name, &t) != MHA_OK) {
      st.SkipWithError(mha_last_error());
      return;
    }
  }

  std::vector<float> x(static_cast<size_t>(s.b * s.lq * s.e)),
      y(static_cast<size_t>(s.b * s.lk * s.e)), o(static_cast<size_t>(s.b * s.lq * s.e));
  mha_bench::fill_uniform(x, 1, 1.0f);
  mha_bench::fill_uniform(y, 2, 1.0f);
  const int64_t xs[3] = {s.b, s.lq, s.e}, ys[3] = {s.b, s.lk, s.e}, ls[1] = {s.b};
  mha_tensor xt, yt, ot, lens;
  // A half-precision shape: x, y and the output as bf16 (out in o's first bytes).
  const bool half = s.dtype != MHA_DTYPE_F32;
  std::vector<uint16_t> x16 = half ? to_bf16(x) : std::vector<uint16_t>();
  std::vector<uint16_t> y16 = half ? to_bf16(y) : std::vector<uint16_t>();
  mha_tensor_init(&xt, half ? static_cast<void*>(x16.data()) : x.data(), s.dtype, 3, xs, nullptr);
  mha_tensor_init(&yt, half ? static_cast<void*>(y16.data()) : y.data(), s.dtype, 3, ys, nullptr);
  mha_tensor_init(&ot, o.data(), s.dtype, 3, xs, nullptr);
  mha_tensor_init(&lens, const_cast<int32_t*>(kD2lValidLens.data()), MHA_DTYPE_I32, 1, ls, nullptr);
  mha_module_forward_params params;
  mha_module_forward_params_init(&params);
  if (s.d2l) params.valid_lens = &lens;
  const mha_tensor* kv = s.d2l ? &yt : &xt;

  if (mha_module_forward(module.m, &xt, kv, kv, &ot, &params) != MHA_OK) {  // warm-up
    st.SkipWithError(mha_last_error());
    return;
  }
  const auto t0 = Clock::now();
  for (auto _ : st) {  // NOLINT(clang-analyzer-deadcode.DeadStores): the idiom
    if (mha_module_forward(module.m, &xt, kv, kv, &ot, &params) != MHA_OK) {
      st.SkipWithError(mha_last_error());
      break;
    }
  }
  const double sec = seconds_since(t0) / static_cast<double>(st.iterations());
  if (st.error_occurred()) return;
  const double gflops = module_flops(s) / sec * 1e-9;
  st.counters["GFLOPS"] = gflops;
  const double fma_peak = peaks.fma != nullptr ? peaks.fma(peak_isa, n) : 0.0;
  const double bf16_peak =
      half && peaks.bf16 != nullptr ? peaks.bf16(backend, n) : 0.0;  // 0: widened
  if (bf16_peak > 0.0) {
    st.counters["pct_peak"] = gflops / bf16_peak * 100;
    st.counters["bf16_peak"] = 1;
  } else if (fma_peak > 0.0) {
    st.counters["pct_peak"] = gflops / fma_peak * 100;
  }
  if (!s.d2l) {
    const double attention_ms = attention_alone_ms(s);
    st.counters["attention_ms"] = attention_ms;
    st.counters["projection_ms"] = sec * 1e3 - attention_ms;
    st.counters["attention_share"] = attention_ms / (sec * 1e3);
    const double blis_ms = blis_products_ms(s, n);
    st.counters["blis_ms"] = blis_ms;
    const double e = static_cast<double>(s.e), rows = static_cast<double>(s.b * s.lq);
    if (fma_peak > 0.0 && blis_ms > 0.0 && attention_ms > 0.0) {
      st.counters["blis_pct"] = 2.0 * rows * e * 4.0 * e / (blis_ms * 1e-3) * 1e-9 / fma_peak * 100;
      st.counters["parts_pct"] =
          module_flops(s) / ((blis_ms + attention_ms) * 1e-3) * 1e-9 / fma_peak * 100;
    }
  } else {
    st.counters["us_per_call"] = sec * 1e6;
  }
  mha_set_num_threads(0);
}

}  // namespace

// Registers module/<backend>/<shape>/threads:<n> for every usable backend, on
// 1 thread and on every core.
void register_module_benchmarks(ModulePeakFn fma_peak, ModulePeakFn bf16_peak) {
  const std::vector<std::string> backends = mha_bench::usable_backends_best_first();
  if (backends.empty()) return;
  const std::string& widest = backends.front();
  int all = omp_get_num_procs();
  if (all < 1) all = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<int> threads{1};
  if (all > 1) threads.push_back(all);
  for (const std::string& b : backends) {
    for (const ModuleShape& s : kModuleShapes) {
      for (int n : threads) {
        const std::string name = "module/" + b + "/" + s.name + "/threads:" + std::to_string(n);
        auto* bm = benchmark::RegisterBenchmark(name.c_str(), bm_module, b, s, n, widest,
                                                ModulePeaks{fma_peak, bf16_peak})
                       ->UseRealTime()
                       ->Unit(s.unit);
        if (b == "scalar" && !s.d2l) bm->Iterations(1);  // seconds per call
      }
    }
  }
}
