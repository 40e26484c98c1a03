// mha_ab_builds: two builds of libmha in one process, timed call by call in
// alternation -- the A/B that a shared, noisy machine still answers.
//
// Separate processes run minutes apart, and on the development VMs the same
// binary moves by 20-40 % between them; within one process, rounds that
// alternate the two builds see the same machine.  Each build is loaded with
// dlmopen into a namespace of its own (its plugins come from its own folder:
// the runtime's dladdr rule), each round times both for about --seconds, in
// alternating order, and the report gives each side's minimum and median and
// the median of the per-round ratios with its quartiles.
//
//   mha_ab_builds BASE_LIB_DIR NEW_LIB_DIR [--rounds N] [--threads N]
//                 [--seconds S] [--hkv N] [--kv bf16|i8] SHAPE
//   SHAPE: s9 (bench-shapes' S9, packed through mha_attention_varlen)
//        | s8 (bench-shapes' S8: paged fp32 decode, 16 sequences, blocks of 16)
//        | s8bf16 (S8:bf16kv, the same cache in bf16)
//        | s8f16 (the same cache in f16)
//        | s8i8 (S8:i8kv, the same cache in int8 with a scale a row)
//        | s8hm (the same fp32 cache with each block holding one KV head's
//                rows after another's)
//        | s5 (bench-shapes' S5: the d2l.ai example with its valid lengths)
//        | B H LQ LK D CAUSAL [blhd|qkv]  (CAUSAL 0 or 1; blhd: [B, L, H, D]
//                                      views; qkv: Q, K and V as views of one
//                                      [B, L, 3·H·D] buffer, the module's, LQ =
//                                      LK; --hkv: KV heads, H by default;
//                                      --kv: K and V in bf16, or int8 with
//                                      one fp32 scale a row, [B, H, L, D] only)
//        | module B L E H [bf16|bf16act]  (mha_module_forward, self-attention
//                           with biases: module S1 is `module 8 512 768 12`;
//                           bf16: a bf16 checkpoint, input and output, as
//                           mha_bench's S1:bf16; bf16act: the same with
//                           MHA_ACTIVATIONS_INPUT, S1:bf16act)
//
// MHA_BACKEND applies to both builds.  Example (S4):
//   MHA_BACKEND=avx512 mha_ab_builds /tmp/old/lib build/release/lib 32 8 64 64 32 0
#include <dlfcn.h>
#include <mha/mha.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_inputs.h"
#include "common/dtype.h"

namespace {

// The entry points a round calls, from one build.
struct Build {
  decltype(&mha_tensor_init) tensor_init = nullptr;
  decltype(&mha_attention_params_init) params_init = nullptr;
  decltype(&mha_varlen_params_init) varlen_params_init = nullptr;
  decltype(&mha_attention) attention = nullptr;
  decltype(&mha_attention_varlen) attention_varlen = nullptr;
  decltype(&mha_set_num_threads) set_num_threads = nullptr;
  decltype(&mha_last_error) last_error = nullptr;
  decltype(&mha_module_config_init) module_config_init = nullptr;
  decltype(&mha_module_create) module_create = nullptr;
  decltype(&mha_module_set_weight) module_set_weight = nullptr;
  decltype(&mha_module_forward_params_init) module_params_init = nullptr;
  decltype(&mha_module_forward) module_forward = nullptr;
  mutable mha_module* module = nullptr;  // the module shape's, made by this build
};

template <class F>
void find(void* library, const char* name, F* f) {
  *f = reinterpret_cast<F>(dlsym(library, name));
  if (*f == nullptr) {
    std::fprintf(stderr, "%s: %s\n", name, dlerror());
    std::exit(2);
  }
}

Build load(const std::string& dir) {
  const std::string path = dir + "/libmha.so";
  void* library = dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    std::fprintf(stderr, "%s: %s\n", path.c_str(), dlerror());
    std::exit(2);
  }
  Build b;
  find(library, "mha_tensor_init", &b.tensor_init);
  find(library, "mha_attention_params_init", &b.params_init);
  find(library, "mha_varlen_params_init", &b.varlen_params_init);
  find(library, "mha_attention", &b.attention);
  find(library, "mha_attention_varlen", &b.attention_varlen);
  find(library, "mha_set_num_threads", &b.set_num_threads);
  find(library, "mha_last_error", &b.last_error);
  find(library, "mha_module_config_init", &b.module_config_init);
  find(library, "mha_module_create", &b.module_create);
  find(library, "mha_module_set_weight", &b.module_set_weight);
  find(library, "mha_module_forward_params_init", &b.module_params_init);
  find(library, "mha_module_forward", &b.module_forward);
  return b;
}

struct Shape {
  bool packed = false;  // S9 through mha_attention_varlen
  bool blhd = false;
  bool qkv = false;         // Q, K, V in one [B, L, 3·H·D] buffer (blhd's output)
  bool valid_lens = false;  // S5's
  int64_t b = 1, h = 12, hkv = 0, lq = 0, lk = 0, d = 64;  // hkv 0: = h
  bool causal = true;
  std::vector<int64_t> lengths;  // packed: each sequence's
  std::vector<int32_t> cu_seqlens;
  mha_bench::S8Batch* paged = nullptr;  // S8: one query a sequence over its pages
  bool bf16_cache = false;              // S8:bf16kv (or --kv bf16): K and V in bf16
  bool i8_cache = false;                // --kv i8: K and V in int8, a scale a row
  bool f16_cache = false;               // s8f16: S8's cache in f16 (in k16, v16)
  std::vector<int8_t> k8{}, v8{};
  std::vector<float> k_scale{}, v_scale{};
  std::vector<uint16_t> k16{}, v16{};  // a bf16 or f16 cache, with k's and v's slack
  bool head_major_pages = false;       // s8hm: [num_blocks, Hkv, block, D] pages
  bool module = false;                 // mha_module_forward on [B, L, E] (self-attention)
  int64_t e = 0;                       // the module's embedding
  bool module_bf16 = false;            // a bf16 checkpoint, input and output
  std::vector<uint16_t> x16{}, out16{};

  // bench-shapes' count: 4 · H · D per (query, key) pair that takes part.
  double flops() const {
    const auto pairs = [this](int64_t queries, int64_t keys) {
      return static_cast<double>(causal ? queries * (queries + 1) / 2 : queries * keys);
    };
    double n = 0.0;
    if (paged != nullptr) {
      for (const int32_t keys : paged->used) n += static_cast<double>(keys);
    } else if (packed) {
      for (const int64_t l : lengths) n += pairs(l, l);
    } else if (module) {  // the projections' products besides attention's pairs
      const double rows = static_cast<double>(b * lq), width = static_cast<double>(e);
      return 8.0 * rows * width * width + 4.0 * static_cast<double>(h * d * b) * pairs(lq, lk);
    } else if (valid_lens) {
      for (const int32_t keys : mha_bench::kS5ValidLens) n += pairs(lq, keys);  // S5: B = 2
    } else {
      n = static_cast<double>(b) * pairs(lq, lk);
    }
    return 4.0 * static_cast<double>(h * d) * n;
  }
};

// The first 4 KiB-aligned element of x (S8's pages start on a page, as a
// serving engine allocates them; x has 4 KiB of slack for it).
template <class T>
T* page_aligned(std::vector<T>& x) {
  const auto at = reinterpret_cast<uintptr_t>(x.data());
  return x.data() + ((4096 - at % 4096) % 4096) / sizeof(T);
}

// The call of one round on `build`; false (with the library's message) when
// it fails.  (Not const: mha_tensor_init takes mutable pointers, cu_seqlens
// included.)
bool call(const Build& build, Shape& s, std::vector<float>& q, std::vector<float>& k,
          std::vector<float>& v, std::vector<float>& out) {
  mha_tensor tq, tk, tv, to;
  mha_attention_params params;
  build.params_init(&params);
  params.causal = s.causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
  mha_tensor lens;
  if (s.valid_lens) {
    const int64_t lens_shape[1] = {s.b};
    build.tensor_init(&lens, const_cast<int32_t*>(mha_bench::kS5ValidLens), MHA_DTYPE_I32, 1,
                      lens_shape, nullptr);
    params.valid_lens = &lens;
  }
  mha_status status = MHA_OK;
  if (s.module) {
    const int64_t rows[3] = {s.b, s.lq, s.e};
    if (s.module_bf16) {
      build.tensor_init(&tq, s.x16.data(), MHA_DTYPE_BF16, 3, rows, nullptr);
      build.tensor_init(&to, s.out16.data(), MHA_DTYPE_BF16, 3, rows, nullptr);
    } else {
      build.tensor_init(&tq, q.data(), MHA_DTYPE_F32, 3, rows, nullptr);
      build.tensor_init(&to, out.data(), MHA_DTYPE_F32, 3, rows, nullptr);
    }
    mha_module_forward_params forward;
    build.module_params_init(&forward);
    status = build.module_forward(build.module, &tq, &tq, &tq, &to, &forward);
  } else if (s.paged != nullptr) {
    mha_bench::S8Batch& batch = *s.paged;
    using S8 = mha_bench::S8Batch;
    const int64_t rows[3] = {S8::kSequences, S8::kHeads, S8::kHeadSize};
    const int64_t pages[4] = {batch.num_blocks, S8::kBlock, S8::kKvHeads, S8::kHeadSize};
    // s8hm: each block holds one KV head's rows after the other's.
    const int64_t head_major[4] = {S8::kBlock * S8::kKvHeads * S8::kHeadSize, S8::kHeadSize,
                                   S8::kBlock * S8::kHeadSize, 1};
    const int64_t* page_strides = s.head_major_pages ? head_major : nullptr;
    const int64_t cu_shape[1] = {S8::kSequences + 1}, used_shape[1] = {S8::kSequences};
    const int64_t table_shape[2] = {S8::kSequences, batch.max_blocks};
    mha_tensor cu, used, table;
    build.tensor_init(&tq, q.data(), MHA_DTYPE_F32, 3, rows, nullptr);
    mha_tensor k_scale, v_scale;
    if (s.bf16_cache || s.f16_cache) {
      const mha_dtype half = s.bf16_cache ? MHA_DTYPE_BF16 : MHA_DTYPE_F16;
      build.tensor_init(&tk, page_aligned(s.k16), half, 4, pages, nullptr);
      build.tensor_init(&tv, page_aligned(s.v16), half, 4, pages, nullptr);
    } else if (s.i8_cache) {
      build.tensor_init(&tk, page_aligned(s.k8), MHA_DTYPE_I8, 4, pages, nullptr);
      build.tensor_init(&tv, page_aligned(s.v8), MHA_DTYPE_I8, 4, pages, nullptr);
      build.tensor_init(&k_scale, s.k_scale.data(), MHA_DTYPE_F32, 3, pages, nullptr);
      build.tensor_init(&v_scale, s.v_scale.data(), MHA_DTYPE_F32, 3, pages, nullptr);
      params.k_scale = &k_scale;
      params.v_scale = &v_scale;
    } else {
      build.tensor_init(&tk, page_aligned(k), MHA_DTYPE_F32, 4, pages, page_strides);
      build.tensor_init(&tv, page_aligned(v), MHA_DTYPE_F32, 4, pages, page_strides);
    }
    build.tensor_init(&to, out.data(), MHA_DTYPE_F32, 3, rows, nullptr);
    build.tensor_init(&cu, batch.cu_q.data(), MHA_DTYPE_I32, 1, cu_shape, nullptr);
    build.tensor_init(&used, batch.used.data(), MHA_DTYPE_I32, 1, used_shape, nullptr);
    build.tensor_init(&table, batch.table.data(), MHA_DTYPE_I32, 2, table_shape, nullptr);
    mha_varlen_params varlen;
    build.varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &cu;
    varlen.seqused_k = &used;
    varlen.block_table = &table;
    status = build.attention_varlen(&tq, &tk, &tv, &to, &varlen, &params);
  } else if (s.packed) {
    const int64_t rows[3] = {s.lq, s.h, s.d};
    const int64_t cu_shape[1] = {static_cast<int64_t>(s.cu_seqlens.size())};
    mha_tensor cu;
    build.tensor_init(&tq, q.data(), MHA_DTYPE_F32, 3, rows, nullptr);
    build.tensor_init(&tk, k.data(), MHA_DTYPE_F32, 3, rows, nullptr);
    build.tensor_init(&tv, v.data(), MHA_DTYPE_F32, 3, rows, nullptr);
    build.tensor_init(&to, out.data(), MHA_DTYPE_F32, 3, rows, nullptr);
    build.tensor_init(&cu, s.cu_seqlens.data(), MHA_DTYPE_I32, 1, cu_shape, nullptr);
    mha_varlen_params varlen;
    build.varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &cu;
    varlen.cu_seqlens_k = &cu;
    status = build.attention_varlen(&tq, &tk, &tv, &to, &varlen, &params);
  } else {
    const int64_t q_shape[4] = {s.b, s.h, s.lq, s.d}, k_shape[4] = {s.b, s.hkv, s.lk, s.d};
    const int64_t q_strides[4] = {s.lq * s.h * s.d, s.d, s.h * s.d, 1};
    const int64_t k_strides[4] = {s.lk * s.hkv * s.d, s.d, s.hkv * s.d, 1};
    mha_tensor k_scale, v_scale;
    if (s.bf16_cache || s.i8_cache) {
      const mha_dtype kv = s.bf16_cache ? MHA_DTYPE_BF16 : MHA_DTYPE_I8;
      void* k_data = s.bf16_cache ? static_cast<void*>(s.k16.data()) : s.k8.data();
      void* v_data = s.bf16_cache ? static_cast<void*>(s.v16.data()) : s.v8.data();
      build.tensor_init(&tq, q.data(), MHA_DTYPE_F32, 4, q_shape, nullptr);
      build.tensor_init(&tk, k_data, kv, 4, k_shape, nullptr);
      build.tensor_init(&tv, v_data, kv, 4, k_shape, nullptr);
      if (s.i8_cache) {
        const int64_t scale_shape[3] = {s.b, s.hkv, s.lk};
        build.tensor_init(&k_scale, s.k_scale.data(), MHA_DTYPE_F32, 3, scale_shape, nullptr);
        build.tensor_init(&v_scale, s.v_scale.data(), MHA_DTYPE_F32, 3, scale_shape, nullptr);
        params.k_scale = &k_scale;
        params.v_scale = &v_scale;
      }
    } else if (s.qkv) {
      const int64_t e = s.h * s.d;
      const int64_t qkv_strides[4] = {s.lq * 3 * e, s.d, 3 * e, 1};
      build.tensor_init(&tq, q.data(), MHA_DTYPE_F32, 4, q_shape, qkv_strides);
      build.tensor_init(&tk, q.data() + e, MHA_DTYPE_F32, 4, k_shape, qkv_strides);
      build.tensor_init(&tv, q.data() + 2 * e, MHA_DTYPE_F32, 4, k_shape, qkv_strides);
    } else {
      build.tensor_init(&tq, q.data(), MHA_DTYPE_F32, 4, q_shape, s.blhd ? q_strides : nullptr);
      build.tensor_init(&tk, k.data(), MHA_DTYPE_F32, 4, k_shape, s.blhd ? k_strides : nullptr);
      build.tensor_init(&tv, v.data(), MHA_DTYPE_F32, 4, k_shape, s.blhd ? k_strides : nullptr);
    }
    const bool out_blhd = s.blhd || s.qkv;
    build.tensor_init(&to, out.data(), MHA_DTYPE_F32, 4, q_shape, out_blhd ? q_strides : nullptr);
    status = build.attention(&tq, &tk, &tv, &to, &params);
  }
  if (status != MHA_OK) std::fprintf(stderr, "%s\n", build.last_error());
  return status == MHA_OK;
}

// The module shape's module on `build`, with module_bench's weights (in
// bf16: a bf16 checkpoint; activations: config.activations).
void make_module(const Build& build, int64_t e, int64_t h, bool bf16, int32_t activations) {
  mha_module_config config;
  build.module_config_init(&config);
  config.embed_dim = e;
  config.num_heads = h;
  config.activations = activations;
  if (build.module_create(&config, &build.module) != MHA_OK) {
    std::fprintf(stderr, "%s\n", build.last_error());
    std::exit(1);
  }
  for (mha_bench::ModuleWeight& w : mha_bench::module_weights(e)) {
    mha_tensor t;
    std::vector<uint16_t> w16(w.data.size());
    for (size_t i = 0; i < w16.size(); ++i) w16[i] = mha_types::f32_to_bf16(w.data[i]);
    if (bf16) {
      build.tensor_init(&t, w16.data(), MHA_DTYPE_BF16, w.ndim, w.shape, nullptr);
    } else {
      build.tensor_init(&t, w.data.data(), MHA_DTYPE_F32, w.ndim, w.shape, nullptr);
    }
    if (build.module_set_weight(build.module, w.name, &t) != MHA_OK) {
      std::fprintf(stderr, "%s\n", build.last_error());
      std::exit(1);
    }
  }
}

double quantile(std::vector<double> x, double at) {
  std::sort(x.begin(), x.end());
  return x[static_cast<size_t>(std::lround(at * static_cast<double>(x.size() - 1)))];
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "mha_ab_builds BASE_LIB_DIR NEW_LIB_DIR [--rounds N] [--threads N] "
               "[--seconds S] [--hkv N] [--kv bf16|i8] (s9 | s8 | s8bf16 | s8f16 | s8i8 | "
               "s8hm | s5 | "
               "B H LQ LK D CAUSAL [blhd|qkv] | module B L E H [bf16|bf16act])\n");
  std::exit(2);
}

// A whole number or a real from the command line; usage() on anything else.
int64_t whole(const std::string& text) {
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0') usage();
  return value;
}
double real(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') usage();
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) usage();
  const Build builds[2] = {load(argv[1]), load(argv[2])};
  int rounds = 20, threads = 1;
  int64_t hkv = 0;
  std::string kv = "f32";
  double seconds = 0.2;
  std::vector<std::string> shape_args;
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--rounds" || a == "--threads" || a == "--seconds" || a == "--hkv" || a == "--kv") &&
        i + 1 < argc) {
      const std::string value = argv[++i];
      if (a == "--rounds") rounds = static_cast<int>(std::clamp<int64_t>(whole(value), 1, 10000));
      if (a == "--threads") threads = static_cast<int>(std::clamp<int64_t>(whole(value), 1, 4096));
      if (a == "--seconds") seconds = real(value);
      if (a == "--hkv") hkv = whole(value);
      if (a == "--kv") kv = value;
    } else {
      shape_args.push_back(a);
    }
  }
  Shape s;
  if (shape_args.size() == 1 && shape_args[0] == "s9") {
    s.packed = true;
    s.lengths = mha_bench::s9_lengths(16);
    s.cu_seqlens.push_back(0);
    for (const int64_t l : s.lengths) {
      s.cu_seqlens.push_back(s.cu_seqlens.back() + static_cast<int32_t>(l));
    }
    s.lq = s.lk = s.cu_seqlens.back();
  } else if (shape_args.size() == 1 &&
             (shape_args[0] == "s8" || shape_args[0] == "s8bf16" || shape_args[0] == "s8i8" ||
              shape_args[0] == "s8f16" || shape_args[0] == "s8hm")) {
    static mha_bench::S8Batch batch;
    using S8 = mha_bench::S8Batch;
    s.paged = &batch;
    s.causal = false;
    s.b = S8::kSequences;
    s.h = S8::kHeads;
    s.lq = 1;
    s.lk = batch.total_k / S8::kSequences + 1;  // K and V: total_k rows, page_aligned's slack
    s.d = S8::kHeadSize;
    hkv = S8::kKvHeads;
    s.bf16_cache = shape_args[0] == "s8bf16";
    s.i8_cache = shape_args[0] == "s8i8";
    s.f16_cache = shape_args[0] == "s8f16";
    s.head_major_pages = shape_args[0] == "s8hm";
  } else if (shape_args.size() == 1 && shape_args[0] == "s5") {
    // The d2l.ai example: packed, blhd, qkv, valid_lens, B, H, Hkv, Lq, Lk, D, causal.
    const Shape s5{false, false, false, true, 2, 5, 0, 4, 6, 20, false, {}, {}};
    s = s5;
  } else if ((shape_args.size() == 5 || shape_args.size() == 6) && shape_args[0] == "module") {
    const std::string half = shape_args.size() == 6 ? shape_args[5] : "";
    if (!half.empty() && half != "bf16" && half != "bf16act") usage();
    s.module = true;
    s.module_bf16 = !half.empty();
    s.causal = false;
    s.b = whole(shape_args[1]);
    s.lq = s.lk = whole(shape_args[2]);
    s.e = whole(shape_args[3]);
    s.h = whole(shape_args[4]);
    if (s.b < 1 || s.lq < 1 || s.h < 1 || s.e < 1 || s.e % s.h != 0) usage();
    s.d = s.e / s.h;
    for (const Build& b : builds) {
      make_module(b, s.e, s.h, s.module_bf16,
                  half == "bf16act" ? MHA_ACTIVATIONS_INPUT : MHA_ACTIVATIONS_F32);
    }
  } else if (shape_args.size() == 6 || shape_args.size() == 7) {
    s.b = whole(shape_args[0]);
    s.h = whole(shape_args[1]);
    s.lq = whole(shape_args[2]);
    s.lk = whole(shape_args[3]);
    s.d = whole(shape_args[4]);
    s.causal = shape_args[5] != "0";
    s.blhd = shape_args.size() == 7 && shape_args[6] == "blhd";
    s.qkv = shape_args.size() == 7 && shape_args[6] == "qkv";
    if (shape_args.size() == 7 && !s.blhd && !s.qkv) usage();
    if (s.b < 1 || s.h < 1 || s.lq < 1 || s.lk < 1 || s.d < 1) usage();
    if (s.qkv && (s.lq != s.lk || hkv > 0)) usage();
    s.bf16_cache = kv == "bf16";
    s.i8_cache = kv == "i8";
    if ((s.bf16_cache || s.i8_cache) && (s.blhd || s.qkv)) usage();
  } else {
    usage();
  }
  if (kv != "f32" && kv != "bf16" && kv != "i8") usage();
  s.hkv = hkv > 0 && !s.packed ? hkv : s.h;  // packed: K and V rows as Q's
  if (s.h % s.hkv != 0) usage();
  std::vector<float> q(s.b * s.h * s.lq * s.d * (s.qkv ? 3 : 1)),
      k(s.module || s.qkv ? 0 : s.b * s.hkv * s.lk * s.d), v(k.size()), out(s.b * s.h * s.lq * s.d);
  mha_bench::fill_uniform(q, 1);
  mha_bench::fill_uniform(k, 2);
  mha_bench::fill_uniform(v, 3);
  if (s.module_bf16) {
    s.x16.resize(q.size());
    s.out16.resize(q.size());
    for (size_t i = 0; i < q.size(); ++i) s.x16[i] = mha_types::f32_to_bf16(q[i]);
  }
  if (s.bf16_cache || s.f16_cache) {
    const auto half = s.bf16_cache ? mha_types::f32_to_bf16 : mha_types::f32_to_f16;
    s.k16.resize(k.size());
    s.v16.resize(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      s.k16[i] = half(k[i]);
      s.v16[i] = half(v[i]);
    }
  }
  if (s.i8_cache) {  // uniform values in [-1, 1): int8 steps of 1/127
    s.k8.resize(k.size());
    s.v8.resize(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      s.k8[i] = static_cast<int8_t>(std::lround(k[i] * 127.0f));
      s.v8[i] = static_cast<int8_t>(std::lround(v[i] * 127.0f));
    }
    s.k_scale.assign(static_cast<size_t>(s.b * s.hkv * s.lk), 1.0f / 127.0f);
    s.v_scale = s.k_scale;
  }
  for (const Build& b : builds) b.set_num_threads(threads);

  using Clock = std::chrono::steady_clock;
  std::vector<double> times[2], ratios;
  for (int r = -1; r < rounds; ++r) {  // round -1 warms both up
    double per_call[2] = {0.0, 0.0};
    for (int turn = 0; turn < 2; ++turn) {
      const int side = (r & 1) != 0 ? 1 - turn : turn;
      int calls = 0;
      const auto start = Clock::now();
      double elapsed = 0.0;
      do {
        if (!call(builds[side], s, q, k, v, out)) return 1;
        ++calls;
        elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      } while (elapsed < seconds);
      per_call[side] = elapsed / calls;
    }
    if (r < 0) continue;
    times[0].push_back(per_call[0]);
    times[1].push_back(per_call[1]);
    ratios.push_back(per_call[1] / per_call[0]);
  }
  const char* names[2] = {"base", "new"};
  for (int side = 0; side < 2; ++side) {
    const double best = quantile(times[side], 0.0);
    std::printf("%-4s min %12.6f ms (%7.1f GFLOP/s)  median %12.6f ms\n", names[side], best * 1e3,
                s.flops() / best * 1e-9, quantile(times[side], 0.5) * 1e3);
  }
  std::printf("new/base per round: median %.3f (quartiles %.3f, %.3f) over %d rounds\n",
              quantile(ratios, 0.5), quantile(ratios, 0.25), quantile(ratios, 0.75), rounds);
  return 0;
}
