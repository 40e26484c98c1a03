// mha_bench: mha's attention per backend against the machine's own limits and
// the textbook BLIS method, all measured in the same process.
//
//   peak/fma/<isa>/threads:<n>          FMA throughput of one ISA on n threads (GFLOPS)
//   peak/bf16dot/<isa>/threads:<n>      vdpbf16ps throughput, where the backend has the
//                                       bf16 dot-product path (GFLOPS)
//   peak/read_bw/threads:<n>            read bandwidth of a 1 GiB array (GBps): the
//                                       best of 1, 2, 4 and 8 streams per thread
//   attention/<backend>/<shape>/threads:<n>
//   blis_unfused/<shape>/threads:<n>    sgemm + softmax + sgemm per (batch, head)
//
// Google Benchmark appends "/real_time" (and "/iterations:<k>" where the count
// is fixed) to these names.  threads:<n> is the number of OpenMP threads inside
// one call (mha_set_num_threads), not Google Benchmark's concurrent callers.
// The shapes and the way FLOPs and bytes are counted are those of
// bench/README.md: useful work only.  Counters are plain values computed from
// the measured time per call, so --benchmark_format=json carries them.
//
// pct_peak divides by the FMA peak of the backend's ISA at the same thread
// count (by its bf16 dot-product peak for a call that takes that path), pct_bw (S3) by the read
// bandwidth, both measured by this process: the peak benchmarks run first (if a filter left them
// out, they are measured on demand before the figure is needed).  A peak is the best call of its
// run (interference on a shared machine only lowers a rate); the mean is reported next to it.
// blis_unfused's pct_peak uses the peak of the ISA the "auto" backend uses: the widest this CPU
// has.  The "scalar" peak is that of the baseline ISA: 128-bit vectors, mul + add (SSE2 on x86-64;
// NEON on aarch64).
//
// MHA_BENCH_BLIS_THREADING=blis switches the baseline from an OpenMP loop over
// heads (default, the faster here) to BLIS's own threads; MHA_BENCH_CHECK=1
// first compares mha with the baseline on every shape.
#include <benchmark/benchmark.h>
#include <mha/mha.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "bench_inputs.h"
#include "blis_unfused.h"
#include "common/dtype.h"
#include "common/visibility.h"
#include "host_cpu.h"
#include "peak.h"
#include "peak_loops.h"
#include "usable_backends.h"

// bench/module_bench.cpp
void register_module_benchmarks(double (*fma_peak)(const std::string& isa, int threads),
                                double (*bf16_peak)(const std::string& backend, int threads));
// bench/backward_bench.cpp
void register_backward_benchmarks(const std::vector<std::string>& backends,
                                  const std::vector<int>& threads,
                                  double (*fma_peak)(const std::string& isa, int threads));
// bench/paged_bench.cpp
void register_paged_benchmarks(const std::vector<std::string>& backends,
                               const std::vector<int>& threads, double (*read_bw)(int threads));

namespace {

using mha_bench::FmaLoop;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ------------------------------------------------------------------ shapes

struct Shape {
  const char* name;
  int64_t b, h, hkv, lq, lk, d, dv;
  mha_causal causal;
  bool valid_lens;  // S5: valid_lens [3, 2], i32 [B]
  benchmark::TimeUnit unit;
  bool heavy;  // the scalar backend runs one call only
  // Dtype variants (bench/README.md): "S1:bf16" has Q, K, V and the output
  // in bf16; "S3:bf16kv" the cache alone (K and V; i8 with row scales).
  mha_dtype q_dtype = MHA_DTYPE_F32;
  mha_dtype kv_dtype = MHA_DTYPE_F32;
  // Variant shapes (../shared/bench-shapes.md): a sliding window's left edge
  // (-1: none), a softcap (0: none), ALiBi slopes 2^(-8h/H), h = 1..H, and a
  // sink logit per head.
  int64_t window_left = -1;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  // "S1:blhd": Q, K, V and the output as [B, L, H, D] arrays seen as
  // [B, H, L, D] (PyTorch's x.transpose(1, 2), FlashAttention's layout).
  bool blhd = false;
  // S9: B sequences of their own lengths (seq_lengths()), packed without
  // padding through mha_attention_varlen; S9pad: the same batch padded to
  // Lq = Lk (the longest) with valid lengths [B] through mha_attention.
  enum class Packing { kNone, kVarlen, kPadded } packing = Packing::kNone;
};

const Shape kShapes[] = {
    {"S1", 8, 12, 12, 512, 512, 64, 64, MHA_CAUSAL_NONE, false, benchmark::kMillisecond, true},
    {"S2", 1, 32, 32, 2048, 2048, 128, 128, MHA_CAUSAL_TOP_LEFT, false, benchmark::kMillisecond,
     true},
    {"S3", 1, 32, 32, 1, 4096, 128, 128, MHA_CAUSAL_NONE, false, benchmark::kMicrosecond, false},
    // S3 at batch 4 and 16: decoding many sequences at once (512 MiB, 2 GiB of K and V).
    {"S3b4", 4, 32, 32, 1, 4096, 128, 128, MHA_CAUSAL_NONE, false, benchmark::kMicrosecond, false},
    {"S3b16", 16, 32, 32, 1, 4096, 128, 128, MHA_CAUSAL_NONE, false, benchmark::kMillisecond,
     false},
    {"S4", 32, 8, 8, 64, 64, 32, 32, MHA_CAUSAL_NONE, false, benchmark::kMicrosecond, false},
    {"S5", 2, 5, 5, 4, 6, 20, 20, MHA_CAUSAL_NONE, true, benchmark::kMicrosecond, false},
    {"S6", 1, 8, 8, 8192, 8192, 64, 64, MHA_CAUSAL_TOP_LEFT, false, benchmark::kMillisecond, true},
};
using mha_bench::kS5ValidLens;

// The dtype variants, for the SIMD backends (the scalar one widens the same way).
const Shape kDtypeShapes[] = {
    {"S1:bf16", 8, 12, 12, 512, 512, 64, 64, MHA_CAUSAL_NONE, false, benchmark::kMillisecond, true,
     MHA_DTYPE_BF16, MHA_DTYPE_BF16},
    {"S2:bf16", 1, 32, 32, 2048, 2048, 128, 128, MHA_CAUSAL_TOP_LEFT, false,
     benchmark::kMillisecond, true, MHA_DTYPE_BF16, MHA_DTYPE_BF16},
    {"S6:bf16", 1, 8, 8, 8192, 8192, 64, 64, MHA_CAUSAL_TOP_LEFT, false, benchmark::kMillisecond,
     true, MHA_DTYPE_BF16, MHA_DTYPE_BF16},
    {"S1:f16", 8, 12, 12, 512, 512, 64, 64, MHA_CAUSAL_NONE, false, benchmark::kMillisecond, true,
     MHA_DTYPE_F16, MHA_DTYPE_F16},
    {"S2:f16", 1, 32, 32, 2048, 2048, 128, 128, MHA_CAUSAL_TOP_LEFT, false, benchmark::kMillisecond,
     true, MHA_DTYPE_F16, MHA_DTYPE_F16},
    {"S6:f16", 1, 8, 8, 8192, 8192, 64, 64, MHA_CAUSAL_TOP_LEFT, false, benchmark::kMillisecond,
     true, MHA_DTYPE_F16, MHA_DTYPE_F16},
    {"S3:bf16kv", 1, 32, 32, 1, 4096, 128, 128, MHA_CAUSAL_NONE, false, benchmark::kMicrosecond,
     false, MHA_DTYPE_F32, MHA_DTYPE_BF16},
    {"S3:f16kv", 1, 32, 32, 1, 4096, 128, 128, MHA_CAUSAL_NONE, false, benchmark::kMicrosecond,
     false, MHA_DTYPE_F32, MHA_DTYPE_F16},
    {"S3:i8kv", 1, 32, 32, 1, 4096, 128, 128, MHA_CAUSAL_NONE, false, benchmark::kMicrosecond,
     false, MHA_DTYPE_F32, MHA_DTYPE_I8},
    {"S3b16:bf16kv", 16, 32, 32, 1, 4096, 128, 128, MHA_CAUSAL_NONE, false, benchmark::kMillisecond,
     false, MHA_DTYPE_F32, MHA_DTYPE_BF16},
    {"S3b16:i8kv", 16, 32, 32, 1, 4096, 128, 128, MHA_CAUSAL_NONE, false, benchmark::kMillisecond,
     false, MHA_DTYPE_F32, MHA_DTYPE_I8},
};

// The variants: S7 (Mistral 7B's sliding-window prefill) and S7d (decoding
// over its cache), S2 with a softcap or ALiBi, S3 with sinks; each costs at
// most 10 % over its plain shape (issue 15).
Shape variant_shape(const Shape& base, const char* name) {
  Shape s = base;
  s.name = name;
  return s;
}
const Shape kVariantShapes[] = {
    [] {
      Shape s{"S7",
              1,
              32,
              8,
              16384,
              16384,
              128,
              128,
              MHA_CAUSAL_TOP_LEFT,
              false,
              benchmark::kMillisecond,
              true};
      s.window_left = 4095;
      return s;
    }(),
    [] {
      Shape s{"S7d",
              1,
              32,
              8,
              1,
              16384,
              128,
              128,
              MHA_CAUSAL_BOTTOM_RIGHT,
              false,
              benchmark::kMicrosecond,
              false};
      s.window_left = 4095;
      return s;
    }(),
    [] {
      Shape s = variant_shape(kShapes[1], "S2:softcap");
      s.softcap = 50.0f;
      return s;
    }(),
    [] {
      Shape s = variant_shape(kShapes[1], "S2:alibi");
      s.alibi = true;
      return s;
    }(),
    [] {
      Shape s = variant_shape(kShapes[2], "S3:sinks");
      s.sinks = true;
      return s;
    }(),
    [] {
      Shape s = variant_shape(kShapes[0], "S1:blhd");
      s.blhd = true;
      return s;
    }(),
};

// S9's lengths (bench_inputs.h), one per sequence of the batch.
std::vector<int64_t> seq_lengths(const Shape& s) {
  return mha_bench::s9_lengths(s.b);
}

int64_t total_tokens(const Shape& s) {
  int64_t total = 0;
  for (const int64_t l : seq_lengths(s)) total += l;
  return total;
}

// S9 (packed) and S9pad (padded): prefill of 16 sequences, H 12, D 64, causal.
const Shape kVarlenShapes[] = {
    [] {
      Shape s{
          "S9", 16, 12, 12, 1024, 1024, 64, 64, MHA_CAUSAL_TOP_LEFT, false, benchmark::kMillisecond,
          true};
      s.packing = Shape::Packing::kVarlen;
      return s;
    }(),
    [] {
      Shape s{"S9pad",
              16,
              12,
              12,
              1024,
              1024,
              64,
              64,
              MHA_CAUSAL_TOP_LEFT,
              false,
              benchmark::kMillisecond,
              true};
      s.packing = Shape::Packing::kPadded;
      return s;
    }(),
};

bool is_decode(const Shape& s) {
  return s.lq == 1;
}  // S3: reported in GB/s
bool is_fixed_cost(const Shape& s) {
  return s.valid_lens;
}  // S5: reported in µs per call

// Useful FLOPs: 2·(D + Dv) per (query, key) pair that takes part, per head
// (bench/README.md), the pairs counted by the library's own visibility rule.
// Keys of (batch b, query i) that take part: the causal rule, the valid
// lengths and the window's left edge (the library's own visibility rules).
int64_t visible_pairs(const Shape& s, int64_t b, int64_t i) {
  const int64_t diagonal = mha_rules::causal_diagonal(s.causal, s.lq, s.lk);
  const int64_t valid = s.valid_lens ? kS5ValidLens[b] : s.lk;
  const int64_t end = mha_rules::visible_keys(i, s.lk, diagonal, valid);
  const int64_t first =
      mha_rules::first_visible_key(i, mha_rules::window_lower_diagonal(s.window_left, s.lq, s.lk));
  return std::max<int64_t>(0, end - first);
}

double useful_flops(const Shape& s) {
  double pairs = 0.0;
  if (s.packing != Shape::Packing::kNone) {
    // Causal self-attention of each sequence: L (L + 1) / 2 pairs, packed or
    // padded alike (padding earns nothing).
    for (const int64_t l : seq_lengths(s)) pairs += 0.5 * static_cast<double>(l * (l + 1));
    return 2.0 * static_cast<double>(s.d + s.dv) * static_cast<double>(s.h) * pairs;
  }
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t i = 0; i < s.lq; ++i) pairs += static_cast<double>(visible_pairs(s, b, i));
  }
  return 2.0 * static_cast<double>(s.d + s.dv) * static_cast<double>(s.h) * pairs;
}

int64_t element_bytes(mha_dtype dtype) {
  return dtype == MHA_DTYPE_F32 ? 4 : (dtype == MHA_DTYPE_I8 ? 1 : 2);
}

// Bytes of K and V read by one call: their elements, and an int8 cache's row
// scales.
double kv_bytes(const Shape& s) {
  // Decode (Lq = 1): the keys its one query sees (S7d: the window's).
  const double rows = static_cast<double>(s.b * s.hkv * visible_pairs(s, 0, s.lq - 1));
  const double scales = s.kv_dtype == MHA_DTYPE_I8 ? 2.0 * rows * sizeof(float) : 0.0;
  return rows * static_cast<double>((s.d + s.dv) * element_bytes(s.kv_dtype)) + scales;
}

// Inputs, uniform in [-1, 1], made once per shape and shared by every
// benchmark; the dtype variants hold the same values rounded to their dtype
// (int8: quantised by mha_quantize_kv, with its row scales).
struct Inputs {
  std::vector<float> q, k, v;
  std::vector<uint16_t> q16, k16, v16;  // bf16 or f16 bits
  std::vector<int8_t> k8, v8;
  std::vector<float> k_scale, v_scale;
};

std::vector<uint16_t> rounded(const std::vector<float>& x, mha_dtype dtype) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    bits[i] = dtype == MHA_DTYPE_BF16 ? mha_types::f32_to_bf16(x[i]) : mha_types::f32_to_f16(x[i]);
  }
  return bits;
}

std::vector<int8_t> quantised(std::vector<float>& x, int64_t rows, int64_t d,
                              std::vector<float>& scales) {
  std::vector<int8_t> q(x.size());
  scales.resize(static_cast<size_t>(rows));
  mha_tensor src{}, dst{}, sc{};
  const int64_t shape[4] = {1, 1, rows, d}, scale_shape[3] = {1, 1, rows};
  mha_tensor_init(&src, x.data(), MHA_DTYPE_F32, 4, shape, nullptr);
  mha_tensor_init(&dst, q.data(), MHA_DTYPE_I8, 4, shape, nullptr);
  mha_tensor_init(&sc, scales.data(), MHA_DTYPE_F32, 3, scale_shape, nullptr);
  if (mha_quantize_kv(&src, &dst, &sc) != MHA_OK) {
    std::fprintf(stderr, "mha_bench: mha_quantize_kv failed: %s\n", mha_last_error());
  }
  return q;
}

const Inputs& inputs(const Shape& s) {
  static std::map<std::string, std::unique_ptr<Inputs>> cache;
  auto& slot = cache[s.name];
  if (!slot) {
    slot = std::make_unique<Inputs>();
    // A packed batch holds its tokens only; every other shape B · L rows.
    const int64_t q_rows = s.packing == Shape::Packing::kVarlen ? total_tokens(s) : s.b * s.lq;
    const int64_t k_rows = s.packing == Shape::Packing::kVarlen ? total_tokens(s) : s.b * s.lk;
    slot->q.resize(static_cast<size_t>(q_rows * s.h * s.d));
    slot->k.resize(static_cast<size_t>(k_rows * s.hkv * s.d));
    slot->v.resize(static_cast<size_t>(k_rows * s.hkv * s.dv));
    mha_bench::fill_uniform(slot->q, 1);
    mha_bench::fill_uniform(slot->k, 2);
    mha_bench::fill_uniform(slot->v, 3);
    if (s.q_dtype != MHA_DTYPE_F32) slot->q16 = rounded(slot->q, s.q_dtype);
    if (s.kv_dtype == MHA_DTYPE_I8) {
      slot->k8 = quantised(slot->k, s.b * s.hkv * s.lk, s.d, slot->k_scale);
      slot->v8 = quantised(slot->v, s.b * s.hkv * s.lk, s.dv, slot->v_scale);
    } else if (s.kv_dtype != MHA_DTYPE_F32) {
      slot->k16 = rounded(slot->k, s.kv_dtype);
      slot->v16 = rounded(slot->v, s.kv_dtype);
    }
  }
  return *slot;
}

// ------------------------------------------------------------------ peaks

// The peak loops this CPU may run, by "<kind>/<backend of the same ISA>".
std::map<std::string, const FmaLoop*> g_loops;
std::string g_widest_isa;                               // the ISA of the backend "auto" picks
std::map<std::string, std::map<int, double>> g_gflops;  // kind/isa -> threads -> GFLOP/s
std::map<int, double> g_read_gbps;                      // threads -> GB/s

constexpr int64_t kFmaSteps = int64_t{1} << 21;  // a few ms per call
constexpr size_t kReadBytes = size_t{1} << 30;   // 1 GiB: far beyond any cache
constexpr int kReadPasses = 8;
// Streams per thread the read probe tries in each pass; it reports the best.
constexpr int kReadStreams[] = {1, 2, 4, 8};

float g_sink;  // keeps the loops' results alive

std::string loop_key(const FmaLoop& loop) {
  return std::string(loop.kind) + "/" + loop.isa;
}

// One call of the loop on n threads at once; returns the seconds it took.
double time_fma(const FmaLoop& loop, int n) {
  float total = 0.0f;
  const auto t0 = Clock::now();
#pragma omp parallel num_threads(n) reduction(+ : total)
  total += loop.run(kFmaSteps, 1.0f + static_cast<float>(omp_get_thread_num()));
  const double sec = seconds_since(t0);
  g_sink += total;
  return sec;
}

double fma_gflops(const FmaLoop& loop, int n, double sec_per_call) {
  return n * static_cast<double>(kFmaSteps) * loop.flops_per_step / sec_per_call * 1e-9;
}

// A peak is the best call of the run: on a shared machine, interference can
// only lower a call's rate.  GFLOPS_mean is the rate over the whole run.
void bm_peak_fma(benchmark::State& st, const FmaLoop* loop, int n) {
  time_fma(*loop, n);  // wakes the threads
  double sec = 0.0;
  double best = 1e30;
  for (auto _ : st) {  // NOLINT(clang-analyzer-deadcode.DeadStores): the idiom
    const double t = time_fma(*loop, n);
    sec += t;
    best = std::min(best, t);
  }
  const double gflops = fma_gflops(*loop, n, best);
  st.counters["GFLOPS"] = gflops;
  st.counters["GFLOPS_mean"] = fma_gflops(*loop, n, sec / static_cast<double>(st.iterations()));
  g_gflops[loop_key(*loop)][n] = gflops;
}

// A peak ("<kind>/<isa>") at n threads: as measured by its benchmark, or now.
double peak_of(const std::string& key, int n) {
  auto it = g_gflops[key].find(n);
  if (it != g_gflops[key].end()) return it->second;
  auto loop = g_loops.find(key);
  if (loop == g_loops.end()) return 0.0;
  time_fma(*loop->second, n);
  double best = 1e30;
  for (int c = 0; c < 40; ++c) best = std::min(best, time_fma(*loop->second, n));
  return g_gflops[key][n] = fma_gflops(*loop->second, n, best);
}

double fma_peak(const std::string& isa, int n) {
  return peak_of("fma/" + isa, n);
}

struct BigArray {
  explicit BigArray(int n) {
    count = kReadBytes / sizeof(float);
    data = static_cast<float*>(std::aligned_alloc(64, kReadBytes));
    if (data == nullptr) return;
      // First touch by the threads that read it, in the same split.
#pragma omp parallel for num_threads(n) schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(count); ++i)
      data[i] = static_cast<float>(i & 1023) * 1e-3f;
  }
  ~BigArray() {
    std::free(data);
  }
  BigArray(const BigArray&) = delete;
  BigArray& operator=(const BigArray&) = delete;
  float* data = nullptr;
  size_t count = 0;
};

// One pass over the array on n threads, each its contiguous slice read as
// `streams` streams.
double time_read(const BigArray& a, int n, int streams) {
  float total = 0.0f;
  const auto t0 = Clock::now();
#pragma omp parallel num_threads(n) reduction(+ : total)
  {
    const size_t t = static_cast<size_t>(omp_get_thread_num());
    const size_t unit = 64 * static_cast<size_t>(streams);
    const size_t slice = a.count / static_cast<size_t>(n) / unit * unit;
    total += mha_bench::read_sum(a.data + t * slice, slice, streams);
  }
  const double sec = seconds_since(t0);
  g_sink += total;
  return sec;
}

// The read probe's result: the best pass of the best stream count, and the
// mean over that count's passes.
struct ReadBandwidth {
  double gbps = 0.0, gbps_mean = 0.0;
  int streams = 0;
};

// One pass per stream count (kReadStreams) per call of `pass`.
class ReadProbe {
 public:
  explicit ReadProbe(int n) : array_(n), n_(n) {
    for (double& t : best_) t = 1e30;
  }
  bool ok() const { return array_.data != nullptr; }
  void pass() {
    for (size_t i = 0; i < std::size(kReadStreams); ++i) {
      const double t = time_read(array_, n_, kReadStreams[i]);
      best_[i] = std::min(best_[i], t);
      total_[i] += t;
    }
    ++passes_;
  }
  ReadBandwidth result() const {
    ReadBandwidth r;
    for (size_t i = 0; i < std::size(kReadStreams); ++i) {
      const double gbps = kReadBytes / best_[i] * 1e-9;
      if (gbps > r.gbps) {
        r = {gbps, passes_ * kReadBytes / total_[i] * 1e-9, kReadStreams[i]};
      }
    }
    return r;
  }

 private:
  BigArray array_;
  int n_;
  int passes_ = 0;
  double best_[std::size(kReadStreams)];
  double total_[std::size(kReadStreams)] = {};
};

// As for the FMA peak: the best pass (of the best stream count), and
// GBps_mean over that count's passes.
void bm_peak_read(benchmark::State& st, int n) {
  ReadProbe probe(n);
  if (!probe.ok()) {
    st.SkipWithError("cannot allocate 1 GiB");
    return;
  }
  for (auto _ : st) probe.pass();  // NOLINT(clang-analyzer-deadcode.DeadStores): the idiom
  const ReadBandwidth r = probe.result();
  st.counters["GBps"] = r.gbps;
  st.counters["GBps_mean"] = r.gbps_mean;
  st.counters["streams"] = r.streams;
  g_read_gbps[n] = r.gbps;
}

double read_bw(int n) {
  auto it = g_read_gbps.find(n);
  if (it != g_read_gbps.end()) return it->second;
  ReadProbe probe(n);
  if (!probe.ok()) return 0.0;
  for (int p = 0; p < kReadPasses; ++p) probe.pass();
  return g_read_gbps[n] = probe.result().gbps;
}

// ------------------------------------------------------------------ attention

// How the backend computes bf16 products on this CPU
// (mha_backend_get_bf16_dot): 0 widened to fp32 (where the dot-product
// instructions run below the FMA's rate), 1 by its bf16 dot-product
// instructions, 2 by the same on AMX tiles.
int32_t bf16_path(const std::string& backend) {
  const int32_t count = mha_backend_count();
  for (int32_t i = 0; i < count; ++i) {
    mha_backend_info info{};
    int32_t dot = 0;
    if (mha_backend_get_info(i, &info) == MHA_OK && info.name != nullptr && backend == info.name) {
      return mha_backend_get_bf16_dot(i, &dot) == MHA_OK ? dot : 0;
    }
  }
  return 0;
}

// The peak loop of a bf16 call on the backend: its dot products' (bf16dot),
// or the AMX tiles' (bf16amx); "" where it widens bf16.
std::string bf16_peak_kind(const std::string& backend) {
  switch (bf16_path(backend)) {
    case 1:
      return "bf16dot";
    case 2:
      return "bf16amx";
    default:
      return "";
  }
}

// The peak of the backend's bf16 products at n threads (its dot products' or
// its AMX tiles'), 0 where it widens bf16.
double bf16_products_peak(const std::string& backend, int n) {
  const std::string kind = bf16_peak_kind(backend);
  if (kind.empty() || g_loops.count(kind + "/" + backend) == 0) return 0.0;
  return peak_of(kind + "/" + backend, n);
}

// The counters every attention-like benchmark reports, from seconds per call.
// pct_peak: against the bf16 dot-product peak (vdpbf16ps, or tdpbf16ps on
// AMX tiles) where the backend takes that path on this CPU and the call is
// one it takes (bf16 Q with bf16 K and V, prefill), the FMA peak otherwise.
void report(benchmark::State& st, const Shape& s, double sec_per_call, const std::string& isa,
            int n) {
  const double gflops = useful_flops(s) / sec_per_call * 1e-9;
  st.counters["GFLOPS"] = gflops;
  std::string bf16_peak;
  if (s.q_dtype == MHA_DTYPE_BF16 && s.kv_dtype == MHA_DTYPE_BF16 && !is_decode(s)) {
    bf16_peak = bf16_peak_kind(isa);
    if (g_loops.count(bf16_peak + "/" + isa) == 0) bf16_peak.clear();
  }
  if (const double peak = !bf16_peak.empty() ? peak_of(bf16_peak + "/" + isa, n) : fma_peak(isa, n);
      peak > 0.0)
    st.counters["pct_peak"] = gflops / peak * 100;
  if (is_decode(s)) {
    const double gbps = kv_bytes(s) / sec_per_call * 1e-9;
    st.counters["GBps"] = gbps;
    if (const double bw = read_bw(n); bw > 0.0) st.counters["pct_bw"] = gbps / bw * 100;
  }
  if (is_fixed_cost(s)) st.counters["us_per_call"] = sec_per_call * 1e6;
  if (is_decode(s)) st.counters["tokens_per_s"] = static_cast<double>(s.b) / sec_per_call;
}

// One mha_attention call of a shape on the shared inputs (in the shape's
// dtypes), into its own output (F32, or Q's dtype for the half variants); an
// mha_attention_varlen call for S9.
struct ShapeCall {
  std::vector<float> out, slopes, sink_logits;
  std::vector<int32_t> offsets, seq_lens;  // S9's cu_seqlens, S9pad's valid lengths
  mha_tensor q{}, k{}, v{}, o{}, lens{}, k_scale{}, v_scale{}, slope_tensor{}, sink_tensor{};
  mha_tensor cu{};
  mha_attention_params params{};
  mha_varlen_params varlen{};
  bool packed = false;

  explicit ShapeCall(const Shape& s) : out(static_cast<size_t>(s.b * s.h * s.lq * s.dv)) {
    if (s.packing == Shape::Packing::kVarlen) {
      init_packed(s);
      return;
    }
    const Inputs& in = inputs(s);
    const int64_t qs[4] = {s.b, s.h, s.lq, s.d}, ks[4] = {s.b, s.hkv, s.lk, s.d},
                  vs[4] = {s.b, s.hkv, s.lk, s.dv}, os[4] = {s.b, s.h, s.lq, s.dv}, ls[1] = {s.b},
                  ss[3] = {s.b, s.hkv, s.lk};
    const auto data = [](const auto& typed, const std::vector<float>& f32) {
      return typed.empty() ? static_cast<void*>(const_cast<float*>(f32.data()))
                           : static_cast<void*>(
                                 const_cast<typename std::decay_t<decltype(typed)>::value_type*>(
                                     typed.data()));
    };
    // [B, L, H, D] seen as [B, H, L, D] (S1:blhd); nullptr: contiguous.
    const auto blhd = [&s](const int64_t* shape, int64_t* strides) -> const int64_t* {
      if (!s.blhd) return nullptr;
      strides[0] = shape[2] * shape[1] * shape[3];
      strides[1] = shape[3];
      strides[2] = shape[1] * shape[3];
      strides[3] = 1;
      return strides;
    };
    int64_t q_st[4], k_st[4], v_st[4], o_st[4];
    mha_tensor_init(&q, data(in.q16, in.q), s.q_dtype, 4, qs, blhd(qs, q_st));
    if (s.kv_dtype == MHA_DTYPE_I8) {
      mha_tensor_init(&k, data(in.k8, in.k), MHA_DTYPE_I8, 4, ks, nullptr);
      mha_tensor_init(&v, data(in.v8, in.v), MHA_DTYPE_I8, 4, vs, nullptr);
    } else {
      mha_tensor_init(&k, data(in.k16, in.k), s.kv_dtype, 4, ks, blhd(ks, k_st));
      mha_tensor_init(&v, data(in.v16, in.v), s.kv_dtype, 4, vs, blhd(vs, v_st));
    }
    // half: in out's first bytes
    mha_tensor_init(&o, out.data(), s.q_dtype, 4, os, blhd(os, o_st));
    mha_tensor_init(&lens, const_cast<int32_t*>(kS5ValidLens), MHA_DTYPE_I32, 1, ls, nullptr);
    mha_attention_params_init(&params);
    params.causal = s.causal;
    if (s.valid_lens) params.valid_lens = &lens;
    if (s.kv_dtype == MHA_DTYPE_I8) {
      mha_tensor_init(&k_scale, const_cast<float*>(in.k_scale.data()), MHA_DTYPE_F32, 3, ss,
                      nullptr);
      mha_tensor_init(&v_scale, const_cast<float*>(in.v_scale.data()), MHA_DTYPE_F32, 3, ss,
                      nullptr);
      params.k_scale = &k_scale;
      params.v_scale = &v_scale;
    }
    params.window_left = s.window_left;
    params.softcap = s.softcap;
    if (s.alibi) {
      for (int64_t h = 0; h < s.h; ++h) {
        slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(s.h)));
      }
      const int64_t hs[1] = {s.h};
      mha_tensor_init(&slope_tensor, slopes.data(), MHA_DTYPE_F32, 1, hs, nullptr);
      params.alibi_slopes = &slope_tensor;
    }
    if (s.sinks) {
      for (int64_t h = 0; h < s.h; ++h) sink_logits.push_back(static_cast<float>(h % 5) - 1.0f);
      const int64_t hs[1] = {s.h};
      mha_tensor_init(&sink_tensor, sink_logits.data(), MHA_DTYPE_F32, 1, hs, nullptr);
      params.sinks = &sink_tensor;
    }
    if (s.packing == Shape::Packing::kPadded) {  // S9pad: valid lengths [B]
      for (const int64_t l : seq_lengths(s)) seq_lens.push_back(static_cast<int32_t>(l));
      mha_tensor_init(&lens, seq_lens.data(), MHA_DTYPE_I32, 1, ls, nullptr);
      params.valid_lens = &lens;
    }
  }
  ShapeCall(const ShapeCall&) = delete;
  ShapeCall& operator=(const ShapeCall&) = delete;

  // S9: Q, K, V [total, H, D] and the offsets of its sequences, used for
  // both queries and keys (self-attention).
  void init_packed(const Shape& s) {
    const Inputs& in = inputs(s);
    const int64_t total = total_tokens(s);
    out.assign(static_cast<size_t>(total * s.h * s.dv), 0.0f);
    offsets.push_back(0);
    for (const int64_t l : seq_lengths(s))
      offsets.push_back(offsets.back() + static_cast<int32_t>(l));
    const int64_t qs[3] = {total, s.h, s.d}, ks[3] = {total, s.hkv, s.d},
                  vs[3] = {total, s.hkv, s.dv}, os[3] = {total, s.h, s.dv}, cs[1] = {s.b + 1};
    mha_tensor_init(&q, const_cast<float*>(in.q.data()), MHA_DTYPE_F32, 3, qs, nullptr);
    mha_tensor_init(&k, const_cast<float*>(in.k.data()), MHA_DTYPE_F32, 3, ks, nullptr);
    mha_tensor_init(&v, const_cast<float*>(in.v.data()), MHA_DTYPE_F32, 3, vs, nullptr);
    mha_tensor_init(&o, out.data(), MHA_DTYPE_F32, 3, os, nullptr);
    mha_tensor_init(&cu, offsets.data(), MHA_DTYPE_I32, 1, cs, nullptr);
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &cu;
    varlen.cu_seqlens_k = &cu;
    mha_attention_params_init(&params);
    params.causal = s.causal;
    packed = true;
  }

  mha_status run() {
    if (packed) return mha_attention_varlen(&q, &k, &v, &o, &varlen, &params);
    return mha_attention(&q, &k, &v, &o, &params);
  }
};

// The BLIS baseline's description of a shape, writing into `out`.
mha_bench::AttentionProblem blis_problem(const Shape& s, float* out) {
  const Inputs& in = inputs(s);
  return mha_bench::AttentionProblem{s.b,
                                     s.h,
                                     s.hkv,
                                     s.lq,
                                     s.lk,
                                     s.d,
                                     s.dv,
                                     in.q.data(),
                                     in.k.data(),
                                     in.v.data(),
                                     out,
                                     1.0f / std::sqrt(static_cast<float>(s.d)),
                                     s.causal == MHA_CAUSAL_TOP_LEFT,
                                     s.valid_lens ? kS5ValidLens : nullptr};
}

void bm_attention(benchmark::State& st, const std::string& backend, const Shape& s, int n) {
  if (mha_select_backend(backend.c_str()) != MHA_OK || mha_set_num_threads(n) != MHA_OK) {
    st.SkipWithError(mha_last_error());
    return;
  }
  ShapeCall call(s);

  // One untimed call (threads, scratch), except where a call takes seconds.
  const bool warm_up = !(backend == "scalar" && s.heavy);
  if (warm_up && call.run() != MHA_OK) {
    st.SkipWithError(mha_last_error());
    return;
  }
  const auto t0 = Clock::now();
  for (auto _ : st) {  // NOLINT(clang-analyzer-deadcode.DeadStores): the idiom
    if (call.run() != MHA_OK) {
      st.SkipWithError(mha_last_error());
      break;
    }
  }
  const double sec = seconds_since(t0);
  mha_set_num_threads(0);
  if (st.error_occurred()) return;
  report(st, s, sec / static_cast<double>(st.iterations()), backend, n);
}

// ------------------------------------------------------------------ BLIS

mha_bench::BlisThreading g_blis_threading = mha_bench::BlisThreading::kHeads;

void bm_blis(benchmark::State& st, const Shape& s, int n) {
  std::vector<float> out(static_cast<size_t>(s.b * s.h * s.lq * s.dv));
  mha_bench::BlisUnfused blis(blis_problem(s, out.data()), n, g_blis_threading);
  if (!s.heavy) blis.run();  // untimed: threads, BLIS's packing buffers
  const auto t0 = Clock::now();
  for (auto _ : st) blis.run();  // NOLINT(clang-analyzer-deadcode.DeadStores)
  const double sec = seconds_since(t0);
  report(st, s, sec / static_cast<double>(st.iterations()), g_widest_isa, n);
}

// MHA_BENCH_CHECK=1: before the benchmarks, each shape once through mha (auto
// backend) and through the BLIS baseline; prints the largest difference.
void check_against_blis() {
  for (const Shape& s : kShapes) {
    ShapeCall call(s);
    if (call.run() != MHA_OK) {
      std::fprintf(stderr, "check %s: mha failed: %s\n", s.name, mha_last_error());
      continue;
    }
    std::vector<float> blis_out(call.out.size());
    mha_bench::BlisUnfused(blis_problem(s, blis_out.data()), omp_get_num_procs(), g_blis_threading)
        .run();
    double diff = 0.0;
    for (size_t i = 0; i < blis_out.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(call.out[i] - blis_out[i])));
    }
    std::fprintf(stderr, "check %s: backend %s, max |mha - blis_unfused| = %.3g\n", s.name,
                 mha_selected_backend(), diff);
  }
}

// ------------------------------------------------------------------ main

std::vector<int> thread_counts() {
  int all = omp_get_num_procs();
  if (all < 1) all = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<int> counts{1};
  if (all > 1) counts.push_back(all);
  return counts;
}

std::string name_of(const std::string& prefix, int n) {
  return prefix + "/threads:" + std::to_string(n);
}

// peak/<kind>/<isa>/threads:<n> for the usable ISAs, then
// peak/read_bw/threads:<n>.
void register_peak_benchmarks(const std::vector<const FmaLoop*>& loops,
                              const std::vector<int>& threads) {
  for (const FmaLoop* loop : loops) {
    if (g_loops.count(loop_key(*loop)) == 0) continue;
    for (int n : threads) {
      benchmark::RegisterBenchmark(name_of("peak/" + loop_key(*loop), n).c_str(), bm_peak_fma, loop,
                                   n)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (int n : threads) {
    benchmark::RegisterBenchmark(name_of("peak/read_bw", n).c_str(), bm_peak_read, n)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(kReadPasses);
  }
}

// attention/<backend>/<shape>/threads:<n>: n OpenMP threads inside one call.
void register_attention_benchmarks(const std::vector<std::string>& backends,
                                   const std::vector<int>& threads) {
  for (const std::string& b : backends) {
    for (const Shape& s : kShapes) {
      for (int n : threads) {
        auto* bm = benchmark::RegisterBenchmark(name_of("attention/" + b + "/" + s.name, n).c_str(),
                                                bm_attention, b, s, n)
                       ->UseRealTime()
                       ->Unit(s.unit);
        if (b == "scalar" && s.heavy) bm->Iterations(1);
      }
    }
  }
}

// attention/<backend>/<shape>:<dtype>/threads:<n>: the dtype variants, on
// the SIMD backends (the scalar backend widens the same way, only slower).
void register_dtype_benchmarks(const std::vector<std::string>& backends,
                               const std::vector<int>& threads) {
  for (const std::string& b : backends) {
    if (b == "scalar") continue;
    for (const Shape& s : kDtypeShapes) {
      for (int n : threads) {
        benchmark::RegisterBenchmark(name_of("attention/" + b + "/" + s.name, n).c_str(),
                                     bm_attention, b, s, n)
            ->UseRealTime()
            ->Unit(s.unit);
      }
    }
  }
}

// attention/<backend>/<shape>/threads:<n> for the variant shapes, on the
// SIMD backends (S7 alone would take the scalar backend minutes): one call
// of S7 per benchmark (seconds each).
void register_variant_benchmarks(const std::vector<std::string>& backends,
                                 const std::vector<int>& threads) {
  for (const std::string& b : backends) {
    if (b == "scalar") continue;
    for (const Shape& s : kVariantShapes) {
      for (int n : threads) {
        auto* bm = benchmark::RegisterBenchmark(name_of("attention/" + b + "/" + s.name, n).c_str(),
                                                bm_attention, b, s, n)
                       ->UseRealTime()
                       ->Unit(s.unit);
        if (s.heavy && s.lq > 4096) bm->Iterations(1);
      }
    }
  }
}

// attention/<backend>/S9/threads:<n> (packed, mha_attention_varlen) and
// attention/<backend>/S9pad/threads:<n> (the same batch padded, with valid
// lengths), on the SIMD backends: the same useful FLOPs, so that the two
// figures compare.
void register_varlen_benchmarks(const std::vector<std::string>& backends,
                                const std::vector<int>& threads) {
  for (const std::string& b : backends) {
    if (b == "scalar") continue;
    for (const Shape& s : kVarlenShapes) {
      for (int n : threads) {
        benchmark::RegisterBenchmark(name_of("attention/" + b + "/" + s.name, n).c_str(),
                                     bm_attention, b, s, n)
            ->UseRealTime()
            ->Unit(s.unit);
      }
    }
  }
}

// blis_unfused/<shape>/threads:<n>: the textbook method on the same inputs.
void register_blis_benchmarks(const std::vector<int>& threads) {
  for (const Shape& s : kShapes) {
    for (int n : threads) {
      benchmark::RegisterBenchmark(name_of(std::string("blis_unfused/") + s.name, n).c_str(),
                                   bm_blis, s, n)
          ->UseRealTime()
          ->Unit(s.unit);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // BLIS picks its kernels once per process: first, before any thread exists.
  const std::string blis_arch = mha_bench::blis_setup(mha_cpu_features());
  if (const char* t = std::getenv("MHA_BENCH_BLIS_THREADING"); t != nullptr) {
    if (std::string(t) == "blis") g_blis_threading = mha_bench::BlisThreading::kBlis;
  }

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  // Usable backends, best first as "auto" would pick them.
  const std::vector<std::string> backends = mha_bench::usable_backends_best_first();

  // The peak loop of each usable backend's ISA; never one the runtime did not
  // declare usable on this CPU.
  const std::vector<const FmaLoop*> known = mha_bench::all_fma_loops();
  for (const std::string& b : backends) {
    for (const FmaLoop* loop : known) {
      // The AMX tiles' loop only where the runtime takes them (their use
      // needs the CPU, the OS and the process's permission).
      if (b == loop->isa && (std::string(loop->kind) != "bf16amx" || bf16_path(b) == 2)) {
        g_loops[loop_key(*loop)] = loop;
        if (g_widest_isa.empty()) g_widest_isa = b;
      }
    }
  }

  const std::vector<int> threads = thread_counts();
  // Peaks first: the figures after them are divided by these.
  register_peak_benchmarks(known, threads);
  register_attention_benchmarks(backends, threads);
  register_dtype_benchmarks(backends, threads);
  register_variant_benchmarks(backends, threads);
  register_paged_benchmarks(backends, threads, read_bw);
  register_varlen_benchmarks(backends, threads);
  register_blis_benchmarks(threads);
  register_backward_benchmarks(backends, threads, fma_peak);
  // The whole module (projections + attention), module/<backend>/<shape>/threads:<n>.
  register_module_benchmarks(fma_peak, bf16_products_peak);

  std::string names;
  for (const std::string& b : backends) names += (names.empty() ? "" : " ") + b;
  benchmark::AddCustomContext("mha_version", mha_version());
  benchmark::AddCustomContext("mha_cpu", mha_bench::host_cpu());
  benchmark::AddCustomContext("mha_cpu_features", mha_cpu_features());
  benchmark::AddCustomContext("mha_usable_backends", names);
  benchmark::AddCustomContext("blis_arch", blis_arch);
  benchmark::AddCustomContext("blis_threading",
                              g_blis_threading == mha_bench::BlisThreading::kHeads
                                  ? "heads: OpenMP loop over (batch, head), 1-thread BLIS"
                                  : "blis: BLIS's own threads in each sgemm");
  benchmark::AddCustomContext("peak_scalar",
                              "baseline-ISA 128-bit vectors, mul + add (SSE2 on x86-64)");
  benchmark::AddCustomContext("blis_peak_isa", g_widest_isa);

  if (const char* c = std::getenv("MHA_BENCH_CHECK"); c != nullptr && std::string(c) == "1")
    check_against_blis();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return g_sink == 12345.0f ? 1 : 0;  // never: only keeps g_sink observable
}
