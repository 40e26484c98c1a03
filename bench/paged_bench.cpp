// S8: paged decoding with continuous batching (bench/README.md,
// ../shared/bench-shapes.md): 16 sequences, H 32, Hkv 8, D 128, one query
// each over context lengths 512·(1 + (7i mod 16)) (512 to 8192), the KV
// cache in blocks of 16 in shuffled order -- mha_attention_varlen with a
// block table.  S8dense is the same batch with the keys packed (no pages):
// the cost of paging is the difference.  Reported like S3: GB/s of K and V
// read, against the read bandwidth measured in the same process, and tokens
// per second.
//
//   attention/<backend>/S8[:bf16kv|:i8kv]/threads:<n>
//   attention/<backend>/S8dense/threads:<n>
#include <benchmark/benchmark.h>
#include <mha/mha.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "bench_inputs.h"
#include "common/dtype.h"

namespace {

using mha_bench::S8Batch;
constexpr int64_t kSequences = S8Batch::kSequences, kHeads = S8Batch::kHeads,
                  kKvHeads = S8Batch::kKvHeads, kHeadSize = S8Batch::kHeadSize;

struct Variant {
  const char* name;
  mha_dtype kv_dtype;
  bool paged;
};

constexpr Variant kVariants[] = {{"S8", MHA_DTYPE_F32, true},
                                 {"S8dense", MHA_DTYPE_F32, false},
                                 {"S8:bf16kv", MHA_DTYPE_BF16, true},
                                 {"S8:i8kv", MHA_DTYPE_I8, true}};

int64_t element_bytes(mha_dtype dtype) {
  return dtype == MHA_DTYPE_F32 ? 4 : (dtype == MHA_DTYPE_I8 ? 1 : 2);
}

// The batch, its cache (paged: blocks in shuffled order; dense: packed rows)
// in the variant's dtype, and the call's descriptors.
struct PagedCall {
  std::vector<float> q, out, k_scale, v_scale;
  // The cache's bytes, page-aligned as a serving engine allocates them (a
  // std::vector's large blocks start 16 bytes into a page: every row would
  // straddle one more cache line, which cost S8 about 12 % in one A/B run).
  class Buf {
   public:
    Buf() = default;
    Buf(const Buf&) = delete;
    Buf& operator=(const Buf&) = delete;
    ~Buf() {
      if (p_ != nullptr) munmap(p_, n_);
    }
    void resize(size_t bytes) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      p_ = static_cast<unsigned char*>(p);
      n_ = bytes;
    }
    unsigned char* data() { return p_; }
    unsigned char& operator[](size_t i) { return p_[i]; }

   private:
    unsigned char* p_ = nullptr;
    size_t n_ = 0;
  };
  Buf k, v;
  std::vector<int32_t> cu_q, cu_k, used, table;
  mha_tensor tq{}, tk{}, tv{}, tout{}, tcu_q{}, tcu_k{}, tused{}, ttable{}, tks{}, tvs{};
  mha_varlen_params varlen{};
  mha_attention_params params{};
  double bytes_read = 0.0;

  explicit PagedCall(const Variant& s) {
    const S8Batch batch;
    const int64_t total_k = batch.total_k, max_blocks = batch.max_blocks;
    const int64_t num_blocks = batch.num_blocks;
    used = batch.used;
    cu_q = batch.cu_q;
    cu_k = batch.cu_k;
    table = batch.table;
    // Values: uniform in [-1, 1], as the other shapes'.
    std::vector<float> k32(static_cast<size_t>(total_k * kKvHeads * kHeadSize));
    std::vector<float> v32(k32.size());
    mha_bench::fill_uniform(k32, 2);
    mha_bench::fill_uniform(v32, 3);
    const int64_t es = element_bytes(s.kv_dtype);
    k.resize(k32.size() * static_cast<size_t>(es));
    v.resize(v32.size() * static_cast<size_t>(es));
    const int64_t rows = total_k * kKvHeads;
    if (s.kv_dtype == MHA_DTYPE_I8) {
      k_scale.resize(static_cast<size_t>(rows));
      v_scale.resize(static_cast<size_t>(rows));
      quantise(k32, k, k_scale, rows);
      quantise(v32, v, v_scale, rows);
    } else {
      narrow(k32, k, s.kv_dtype);
      narrow(v32, v, s.kv_dtype);
    }
    q.resize(static_cast<size_t>(kSequences * kHeads * kHeadSize));
    mha_bench::fill_uniform(q, 1);
    out.resize(q.size());

    const int64_t qs[3] = {kSequences, kHeads, kHeadSize};
    mha_tensor_init(&tq, q.data(), MHA_DTYPE_F32, 3, qs, nullptr);
    mha_tensor_init(&tout, out.data(), MHA_DTYPE_F32, 3, qs, nullptr);
    const int64_t cus[1] = {kSequences + 1}, bs[1] = {kSequences};
    mha_tensor_init(&tcu_q, cu_q.data(), MHA_DTYPE_I32, 1, cus, nullptr);
    mha_tensor_init(&tcu_k, cu_k.data(), MHA_DTYPE_I32, 1, cus, nullptr);
    mha_tensor_init(&tused, used.data(), MHA_DTYPE_I32, 1, bs, nullptr);
    const int64_t ts[2] = {kSequences, max_blocks};
    mha_tensor_init(&ttable, table.data(), MHA_DTYPE_I32, 2, ts, nullptr);
    // Paged: [num_blocks, 16, Hkv, D]; dense: [total_k, Hkv, D] -- the same
    // bytes, read through the table or in order.
    const int64_t paged_shape[4] = {num_blocks, S8Batch::kBlock, kKvHeads, kHeadSize};
    const int64_t dense_shape[3] = {total_k, kKvHeads, kHeadSize};
    const int32_t ndim = s.paged ? 4 : 3;
    const int64_t* shape = s.paged ? paged_shape : dense_shape;
    mha_tensor_init(&tk, k.data(), s.kv_dtype, ndim, shape, nullptr);
    mha_tensor_init(&tv, v.data(), s.kv_dtype, ndim, shape, nullptr);
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &tcu_q;
    if (s.paged) {
      varlen.seqused_k = &tused;
      varlen.block_table = &ttable;
    } else {
      varlen.cu_seqlens_k = &tcu_k;
    }
    mha_attention_params_init(&params);
    if (s.kv_dtype == MHA_DTYPE_I8) {
      mha_tensor_init(&tks, k_scale.data(), MHA_DTYPE_F32, ndim - 1, shape, nullptr);
      mha_tensor_init(&tvs, v_scale.data(), MHA_DTYPE_F32, ndim - 1, shape, nullptr);
      params.k_scale = &tks;
      params.v_scale = &tvs;
    }
    // Bytes of K and V read: every key of every sequence, once per KV head
    // (and an int8 cache's two row scales).
    bytes_read = static_cast<double>(rows) *
                 static_cast<double>(2 * kHeadSize * es +
                                     (s.kv_dtype == MHA_DTYPE_I8 ? 2 * sizeof(float) : 0));
  }
  PagedCall(const PagedCall&) = delete;
  PagedCall& operator=(const PagedCall&) = delete;

  mha_status run() { return mha_attention_varlen(&tq, &tk, &tv, &tout, &varlen, &params); }

 private:
  static void narrow(const std::vector<float>& x, Buf& bytes, mha_dtype dtype) {
    for (size_t i = 0; i < x.size(); ++i) {
      if (dtype == MHA_DTYPE_F32) {
        std::memcpy(&bytes[4 * i], &x[i], 4);
      } else {
        const uint16_t h =
            dtype == MHA_DTYPE_BF16 ? mha_types::f32_to_bf16(x[i]) : mha_types::f32_to_f16(x[i]);
        std::memcpy(&bytes[2 * i], &h, 2);
      }
    }
  }
  // Rows of kHeadSize values to int8 with their scales (mha_quantize_kv).
  static void quantise(std::vector<float>& x, Buf& bytes, std::vector<float>& scales,
                       int64_t rows) {
    mha_tensor src{}, dst{}, sc{};
    const int64_t shape[4] = {1, 1, rows, kHeadSize}, scale_shape[3] = {1, 1, rows};
    mha_tensor_init(&src, x.data(), MHA_DTYPE_F32, 4, shape, nullptr);
    mha_tensor_init(&dst, bytes.data(), MHA_DTYPE_I8, 4, shape, nullptr);
    mha_tensor_init(&sc, scales.data(), MHA_DTYPE_F32, 3, scale_shape, nullptr);
    if (mha_quantize_kv(&src, &dst, &sc) != MHA_OK) {
      std::fprintf(stderr, "paged_bench: mha_quantize_kv failed: %s\n", mha_last_error());
    }
  }
};

double (*g_read_bw)(int threads) = nullptr;

void bm_paged(benchmark::State& st, const std::string& backend, const Variant& s, int n) {
  if (mha_select_backend(backend.c_str()) != MHA_OK || mha_set_num_threads(n) != MHA_OK) {
    st.SkipWithError(mha_last_error());
    return;
  }
  static std::map<std::string, std::unique_ptr<PagedCall>> calls;  // built once per variant
  auto& call = calls[s.name];
  if (!call) call = std::make_unique<PagedCall>(s);
  if (call->run() != MHA_OK) {  // untimed: threads, scratch
    st.SkipWithError(mha_last_error());
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {  // NOLINT(clang-analyzer-deadcode.DeadStores): the idiom
    if (call->run() != MHA_OK) {
      st.SkipWithError(mha_last_error());
      break;
    }
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  mha_set_num_threads(0);
  if (st.error_occurred()) return;
  const double per_call = sec / static_cast<double>(st.iterations());
  const double gbps = call->bytes_read / per_call * 1e-9;
  st.counters["GBps"] = gbps;
  if (const double bw = g_read_bw != nullptr ? g_read_bw(n) : 0.0; bw > 0.0) {
    st.counters["pct_bw"] = gbps / bw * 100;
  }
  st.counters["tokens_per_s"] = static_cast<double>(kSequences) / per_call;
}

}  // namespace

void register_paged_benchmarks(const std::vector<std::string>& backends,
                               const std::vector<int>& threads, double (*read_bw)(int threads)) {
  g_read_bw = read_bw;
  for (const Variant& s : kVariants) {
    for (const std::string& backend : backends) {
      if (backend == "scalar" && s.kv_dtype != MHA_DTYPE_F32) continue;
      for (const int n : threads) {
        const std::string name =
            "attention/" + backend + "/" + s.name + "/threads:" + std::to_string(n);
        benchmark::RegisterBenchmark(name.c_str(), bm_paged, backend, s, n)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}
