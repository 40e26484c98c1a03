// The backward pass in mha_bench:
//
//   attention_backward/<backend>/S1|S2|S6/threads:<n>
//   attention_backward/<backend>/S1:bf16|S1:f16/threads:<n>
//   attention_backward/<backend>/S9|S9loop/threads:<n>
//
// One call is mha_attention_backward on the shape (fp32; S2 and S6 causal),
// given the forward's output and LSE (computed once, untimed).  The dtype
// variants (bench-shapes.md's suffixes) hold Q, K, V, the output, dO and
// the gradients in bf16 or f16 (the same values rounded): what a
// half-precision training step hands the backward and gets back.  FLOPs are
// counted as FlashAttention-2 counts them: 2.5 times the forward's useful
// FLOPs (five products of the size of the forward's two), so a figure reads
// against the forward's.  pct_peak: against the FMA peak of the backend's own
// ISA at the same thread count, measured by mha_bench in the same run.
//
// S9 is the packed prefill batch of bench-shapes.md (16 causal sequences of
// 64 to 1024 tokens, H 12, D 64) through one mha_attention_varlen_backward
// call; S9loop the same sequences as 16 mha_attention_backward calls, one
// per sequence on views of the packed arrays -- what a caller without the
// packed backward runs (PyTorch's varlen autograd loops so).  The same
// useful FLOPs (2.5 x each sequence's causal pairs), so the two compare
// directly: the packed call balances the sequences over the threads
// together, the loop waits for each sequence's last item.
//
// mha_bench registers these by calling register_backward_benchmarks.
#include <benchmark/benchmark.h>
#include <mha/mha.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bench_inputs.h"
#include "common/dtype.h"

namespace {

using Clock = std::chrono::steady_clock;

struct BackwardShape {
  const char* name;
  int64_t b, h, lq, lk, d;
  mha_causal causal;
  mha_dtype dtype = MHA_DTYPE_F32;  // of every tensor but the LSE
};

const BackwardShape kBackwardShapes[] = {
    {"S1", 8, 12, 512, 512, 64, MHA_CAUSAL_NONE},
    {"S2", 1, 32, 2048, 2048, 128, MHA_CAUSAL_TOP_LEFT},
    {"S6", 1, 8, 8192, 8192, 64, MHA_CAUSAL_TOP_LEFT},
    {"S1:bf16", 8, 12, 512, 512, 64, MHA_CAUSAL_NONE, MHA_DTYPE_BF16},
    {"S1:f16", 8, 12, 512, 512, 64, MHA_CAUSAL_NONE, MHA_DTYPE_F16},
};

// x's values rounded to a half dtype (to nearest even).
std::vector<uint16_t> rounded(const std::vector<float>& x, mha_dtype dtype) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    bits[i] = dtype == MHA_DTYPE_BF16 ? mha_types::f32_to_bf16(x[i]) : mha_types::f32_to_f16(x[i]);
  }
  return bits;
}

// 2.5 x the forward's 4 · B · H · D · pairs (bench-shapes.md's counting).
double backward_flops(const BackwardShape& s) {
  const double pairs = s.causal == MHA_CAUSAL_NONE
                           ? static_cast<double>(s.lq) * static_cast<double>(s.lk)
                           : static_cast<double>(s.lq) * static_cast<double>(s.lq + 1) / 2.0;
  return 2.5 * 4.0 * static_cast<double>(s.b * s.h * s.d) * pairs;
}

struct BackwardCall {
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
  std::vector<uint16_t> q16, k16, v16, dout16;  // the half variants' inputs
  mha_tensor tq{}, tk{}, tv{}, tdout{}, tout{}, tlse{}, tdq{}, tdk{}, tdv{};
  mha_attention_params params{};

  explicit BackwardCall(const BackwardShape& s) {
    const int64_t qn = s.b * s.h * s.lq * s.d, kn = s.b * s.h * s.lk * s.d;
    for (auto* x : {&q, &dout, &out, &dq}) x->resize(static_cast<size_t>(qn));
    for (auto* x : {&k, &v, &dk, &dv}) x->resize(static_cast<size_t>(kn));
    lse.resize(static_cast<size_t>(s.b * s.h * s.lq));
    mha_bench::fill_uniform(q, 1);
    mha_bench::fill_uniform(k, 2);
    mha_bench::fill_uniform(v, 3);
    mha_bench::fill_uniform(dout, 4);
    const int64_t qs[4] = {s.b, s.h, s.lq, s.d}, ks[4] = {s.b, s.h, s.lk, s.d},
                  ls[3] = {s.b, s.h, s.lq};
    const mha_dtype dt = s.dtype;
    const bool half = dt != MHA_DTYPE_F32;
    if (half) {
      q16 = rounded(q, dt);
      k16 = rounded(k, dt);
      v16 = rounded(v, dt);
      dout16 = rounded(dout, dt);
    }
    const auto input = [half](std::vector<uint16_t>& h, std::vector<float>& f) -> void* {
      return half ? static_cast<void*>(h.data()) : static_cast<void*>(f.data());
    };
    mha_tensor_init(&tq, input(q16, q), dt, 4, qs, nullptr);
    mha_tensor_init(&tk, input(k16, k), dt, 4, ks, nullptr);
    mha_tensor_init(&tv, input(v16, v), dt, 4, ks, nullptr);
    mha_tensor_init(&tdout, input(dout16, dout), dt, 4, qs, nullptr);
    // The outputs, half ones in their float buffers' first bytes.
    mha_tensor_init(&tout, out.data(), dt, 4, qs, nullptr);
    mha_tensor_init(&tlse, lse.data(), MHA_DTYPE_F32, 3, ls, nullptr);
    mha_tensor_init(&tdq, dq.data(), dt, 4, qs, nullptr);
    mha_tensor_init(&tdk, dk.data(), dt, 4, ks, nullptr);
    mha_tensor_init(&tdv, dv.data(), dt, 4, ks, nullptr);
    mha_attention_params_init(&params);
    params.causal = s.causal;
  }
  mha_status forward() {
    params.lse = &tlse;
    const mha_status status = mha_attention(&tq, &tk, &tv, &tout, &params);
    params.lse = nullptr;
    return status;
  }
  mha_status backward() {
    return mha_attention_backward(&tq, &tk, &tv, &tout, &tlse, &tdout, &tdq, &tdk, &tdv, &params,
                                  nullptr);
  }
};

// The forward once and a backward (untimed: threads, scratch), then the
// timed backward calls; GFLOPS from `flops` per call, pct_peak against the
// backend's FMA peak at n threads.
template <class Forward, class Backward>
void time_backward(benchmark::State& st, Forward&& forward, Backward&& backward, double flops,
                   const std::string& backend, int n,
                   double (*fma_peak)(const std::string& isa, int threads)) {
  if (forward() != MHA_OK || backward() != MHA_OK) {
    st.SkipWithError(mha_last_error());
    return;
  }
  const auto t0 = Clock::now();
  for (auto _ : st) {  // NOLINT(clang-analyzer-deadcode.DeadStores): the idiom
    if (backward() != MHA_OK) {
      st.SkipWithError(mha_last_error());
      break;
    }
  }
  const double sec = std::chrono::duration<double>(Clock::now() - t0).count() /
                     static_cast<double>(st.iterations());
  mha_set_num_threads(0);
  if (st.error_occurred()) return;
  const double gflops = flops / sec * 1e-9;
  st.counters["GFLOPS"] = gflops;
  if (const double peak = fma_peak(backend, n); peak > 0.0) {
    st.counters["pct_peak"] = gflops / peak * 100;
  }
}

void bm_backward(benchmark::State& st, const std::string& backend, const BackwardShape& s, int n,
                 double (*fma_peak)(const std::string& isa, int threads)) {
  if (mha_select_backend(backend.c_str()) != MHA_OK || mha_set_num_threads(n) != MHA_OK) {
    st.SkipWithError(mha_last_error());
    return;
  }
  BackwardCall call(s);
  time_backward(
      st, [&call] { return call.forward(); }, [&call] { return call.backward(); },
      backward_flops(s), backend, n, fma_peak);
}

// S9's packed batch (bench_inputs.h's lengths): q, k, v, dout, out and the
// gradients [total, H, D], the LSE [H, total], the forward run once.
struct PackedBackward {
  static constexpr int64_t kHeads = 12, kHeadSize = 64;
  std::vector<int64_t> lengths = mha_bench::s9_lengths(16);
  std::vector<int32_t> offsets = {0};
  int64_t total = 0;
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
  mha_tensor tq{}, tk{}, tv{}, tdout{}, tout{}, tlse{}, tdq{}, tdk{}, tdv{}, tcu{};
  mha_varlen_params varlen{};
  mha_attention_params params{};

  PackedBackward() {
    for (const int64_t l : lengths) offsets.push_back(static_cast<int32_t>(total += l));
    const auto n = static_cast<size_t>(total * kHeads * kHeadSize);
    for (auto* x : {&q, &k, &v, &dout, &out, &dq, &dk, &dv}) x->resize(n);
    lse.resize(static_cast<size_t>(kHeads * total));
    mha_bench::fill_uniform(q, 1);
    mha_bench::fill_uniform(k, 2);
    mha_bench::fill_uniform(v, 3);
    mha_bench::fill_uniform(dout, 4);
    const int64_t shape[3] = {total, kHeads, kHeadSize}, lse_shape[2] = {kHeads, total};
    const int64_t cu_shape[1] = {static_cast<int64_t>(offsets.size())};
    for (auto [t, x] : {std::pair{&tq, &q}, std::pair{&tk, &k}, std::pair{&tv, &v},
                        std::pair{&tdout, &dout}, std::pair{&tout, &out}, std::pair{&tdq, &dq},
                        std::pair{&tdk, &dk}, std::pair{&tdv, &dv}}) {
      mha_tensor_init(t, x->data(), MHA_DTYPE_F32, 3, shape, nullptr);
    }
    mha_tensor_init(&tlse, lse.data(), MHA_DTYPE_F32, 2, lse_shape, nullptr);
    mha_tensor_init(&tcu, offsets.data(), MHA_DTYPE_I32, 1, cu_shape, nullptr);
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &tcu;
    varlen.cu_seqlens_k = &tcu;
    mha_attention_params_init(&params);
    params.causal = MHA_CAUSAL_TOP_LEFT;
  }
  PackedBackward(const PackedBackward&) = delete;  // varlen points into it
  PackedBackward& operator=(const PackedBackward&) = delete;

  double flops() const {
    double pairs = 0.0;
    for (const int64_t l : lengths) pairs += 0.5 * static_cast<double>(l * (l + 1));
    return 2.5 * 4.0 * static_cast<double>(kHeads * kHeadSize) * pairs;
  }
  mha_status forward() {
    params.lse = &tlse;
    const mha_status status = mha_attention_varlen(&tq, &tk, &tv, &tout, &varlen, &params);
    params.lse = nullptr;
    return status;
  }
  mha_status backward() {
    return mha_attention_varlen_backward(&tq, &tk, &tv, &tout, &tlse, &tdout, &tdq, &tdk, &tdv,
                                         &varlen, &params, nullptr);
  }
  // Rows [first, first + len) of a packed array as [1, H, len, D].
  static mha_tensor rows(std::vector<float>& x, int64_t first, int64_t len) {
    mha_tensor t{};
    const int64_t shape[4] = {1, kHeads, len, kHeadSize};
    const int64_t strides[4] = {0, kHeadSize, kHeads * kHeadSize, 1};
    mha_tensor_init(&t, x.data() + first * kHeads * kHeadSize, MHA_DTYPE_F32, 4, shape, strides);
    return t;
  }
  // The same gradients, one mha_attention_backward call per sequence.
  mha_status backward_loop() {
    for (size_t b = 0; b < lengths.size(); ++b) {
      const int64_t first = offsets[b], len = lengths[b];
      mha_tensor sq = rows(q, first, len), sk = rows(k, first, len), sv = rows(v, first, len),
                 so = rows(out, first, len), sd = rows(dout, first, len), gq = rows(dq, first, len),
                 gk = rows(dk, first, len), gv = rows(dv, first, len);
      mha_tensor sl{};
      const int64_t shape[3] = {1, kHeads, len}, strides[3] = {0, total, 1};
      mha_tensor_init(&sl, lse.data() + first, MHA_DTYPE_F32, 3, shape, strides);
      if (const mha_status status =
              mha_attention_backward(&sq, &sk, &sv, &so, &sl, &sd, &gq, &gk, &gv, &params, nullptr);
          status != MHA_OK) {
        return status;
      }
    }
    return MHA_OK;
  }
};

void bm_packed_backward(benchmark::State& st, const std::string& backend, bool loop, int n,
                        double (*fma_peak)(const std::string& isa, int threads)) {
  if (mha_select_backend(backend.c_str()) != MHA_OK || mha_set_num_threads(n) != MHA_OK) {
    st.SkipWithError(mha_last_error());
    return;
  }
  PackedBackward call;
  time_backward(
      st, [&call] { return call.forward(); },
      [&call, loop] { return loop ? call.backward_loop() : call.backward(); }, call.flops(),
      backend, n, fma_peak);
}

}  // namespace

void register_backward_benchmarks(const std::vector<std::string>& backends,
                                  const std::vector<int>& threads,
                                  double (*fma_peak)(const std::string& isa, int threads)) {
  for (const std::string& b : backends) {
    if (b == "scalar") continue;  // minutes per call on S2 and S6
    for (const BackwardShape& s : kBackwardShapes) {
      for (int n : threads) {
        const std::string name =
            "attention_backward/" + b + "/" + s.name + "/threads:" + std::to_string(n);
        benchmark::RegisterBenchmark(name.c_str(), bm_backward, b, s, n, fma_peak)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
    for (const bool loop : {false, true}) {
      for (int n : threads) {
        const std::string name = "attention_backward/" + b + (loop ? "/S9loop" : "/S9") +
                                 "/threads:" + std::to_string(n);
        benchmark::RegisterBenchmark(name.c_str(), bm_packed_backward, b, loop, n, fma_peak)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}
