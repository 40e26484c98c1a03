// mha_tools_case: the ends of the ctest chains that check mha-run and
// mha-info as programs, without starting child processes (which a test
// cannot do under qemu-aarch64):
//
//   mha_tools_case write CASE DIR         writes the inputs of CASE into DIR
//   mha_tools_case check <mha-run flags>  reads the inputs and mha-run's --out
//                                         (and --lse) and compares them with
//                                         the float64 reference
//   mha_tools_case check-info FILE [--selected NAME]
//                                         checks the JSON of `mha-info --json`
//   mha_tools_case same A B               two .npy files hold the same values
//                                         (bit for bit, in C order) and shapes
//                                         that differ at most by leading 1s
//   mha_tools_case write-module DIR       weight directories and inputs for
//                                         `mha-run module`
//   mha_tools_case write-dout DIR         a random dout.npy for DIR's q.npy, v.npy
//   mha_tools_case check-backward <mha-run backward flags>
//                                         compares --dq --dk --dv (and --dsinks)
//                                         with the float64 backward reference
#include <mha/mha.h>

#include <sys/stat.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_run.h"
#include "backward_run.h"
#include "common/dtype.h"
#include "npy.h"
#include "reference.h"
#include "reference_backward.h"
#include "test_util.h"

namespace {

using mha_tools::NpyArray;
using mha_tools::NpyDtype;

// ---------------------------------------------------------------- write

// splitmix64: the same numbers on every platform and standard library.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53;
  }
  bool chance(double p) { return uniform(0, 1) < p; }

 private:
  uint64_t state_;
};

NpyArray random_floats(Random& rng, std::vector<int64_t> shape, bool fortran = false) {
  NpyArray a(NpyDtype::F32, std::move(shape), fortran);
  for (int64_t i = 0; i < a.size(); ++i) a.set_from_double(i, rng.uniform(-1, 1));
  return a;
}

NpyArray filled(NpyDtype dtype, std::vector<int64_t> shape, const std::vector<double>& values) {
  NpyArray a(dtype, std::move(shape));
  for (int64_t i = 0; i < a.size(); ++i) a.set_from_double(i, values[static_cast<size_t>(i)]);
  return a;
}

using Files = std::map<std::string, NpyArray>;

// A copy of a float array as another dtype, element by element in the same
// order: float64 is exact (the tool's conversion gives the float32 values
// back), float16 rounds to nearest even (NpyArray's set_from_double).
NpyArray converted(const NpyArray& a, NpyDtype dtype) {
  NpyArray d(dtype, a.shape(), a.fortran_order());
  for (int64_t i = 0; i < a.size(); ++i) d.set_from_double(i, a.value_as_double(i));
  return d;
}
NpyArray as_f64(const NpyArray& a) {
  return converted(a, NpyDtype::F64);
}

// Q [B, H, Lq, D], K and V [B, H, Lk, D] of random values.
Files qkv_files(Random& rng, int64_t batch, int64_t heads, int64_t lq, int64_t lk, int64_t d) {
  Files f;
  f["q"] = random_floats(rng, {batch, heads, lq, d});
  f["k"] = random_floats(rng, {batch, heads, lk, d});
  f["v"] = random_floats(rng, {batch, heads, lk, d});
  return f;
}

// S5, the d2l.ai example, and files for the failure checks.
Files d2l_case() {
  Random rng(2024);
  Files f = qkv_files(rng, 2, 5, 4, 6, 20);
  f["valid_lens"] = filled(NpyDtype::I64, {2}, {3, 2});
  NpyArray q64(NpyDtype::F64, {2, 5, 4, 20});
  for (int64_t i = 0; i < q64.size(); ++i) q64.set_from_double(i, f["q"].value_as_double(i));
  f["q_f64"] = std::move(q64);
  f["q_rank3"] = random_floats(rng, {10, 4, 20});
  f["k_d19"] = random_floats(rng, {2, 5, 6, 19});
  f["vl_f32"] = filled(NpyDtype::F32, {2}, {3, 2});
  f["vl_too_long"] = filled(NpyDtype::I64, {2}, {7, 2});
  NpyArray q_i32(NpyDtype::I32, {2, 5, 4, 20});
  f["q_i32"] = std::move(q_i32);
  f["q_copy"] = f["q"];  // q.npy as written, to see that no run changed it
  // Half precision: Q, K and V as float16 files; Q with a value float16
  // cannot hold; K with a NaN (an int8 cache refuses it).
  for (const char* name : {"q", "k", "v"})
    f[std::string(name) + "_f16"] = converted(f[name], NpyDtype::F16);
  NpyArray q_big = f["q"];
  q_big.set_from_double(q_big.offset({1, 2, 3, 4}), 1e5);
  f["q_big"] = std::move(q_big);
  NpyArray k_nan = f["k"];
  k_nan.set_from_double(k_nan.offset({0, 1, 2, 3}), std::nan(""));
  f["k_nan"] = std::move(k_nan);
  // One batch as rank-3 [H, L, D] files and the same values as [1, H, L, D].
  NpyArray q3 = random_floats(rng, {5, 4, 20}), k3 = random_floats(rng, {5, 6, 20}),
           v3 = random_floats(rng, {5, 6, 12});
  const auto batch_of_one = [](const NpyArray& a) {
    std::vector<int64_t> shape = a.shape();
    shape.insert(shape.begin(), 1);
    NpyArray b(a.dtype(), shape);
    std::memcpy(b.data(), a.data(), a.nbytes());
    return b;
  };
  f["q1"] = batch_of_one(q3);
  f["k1"] = batch_of_one(k3);
  f["v1"] = batch_of_one(v3);
  f["q3"] = std::move(q3);
  f["k3"] = std::move(k3);
  f["v3"] = std::move(v3);
  return f;
}

// Grouped-query attention (6 query heads over 2 KV heads, Dv != D), Q in
// Fortran order, a bool mask [B,1,Lq,Lk] with a fully masked row; run with
// --causal bottom-right.
Files gqa_case() {
  Random rng(77);
  const int64_t batch = 2, lq = 5, lk = 9;
  Files f;
  f["q"] = random_floats(rng, {batch, 6, lq, 16}, true);
  f["k"] = random_floats(rng, {batch, 2, lk, 16});
  f["v"] = random_floats(rng, {batch, 2, lk, 12});
  NpyArray mask(NpyDtype::Bool, {batch, 1, lq, lk});
  for (int64_t i = 0; i < mask.size(); ++i) mask.set_from_double(i, rng.chance(0.7) ? 1 : 0);
  for (int64_t j = 0; j < lk; ++j) mask.set_from_double(mask.offset({0, 0, 1, j}), 0);
  f["mask"] = std::move(mask);
  return f;
}

// Grouped-query attention over a longer cache; run with --window and
// --causal bottom-right (the window cuts most keys of every row).
Files window_case() {
  Random rng(31);
  const int64_t batch = 1, lq = 40, lk = 300;
  Files f;
  f["q"] = random_floats(rng, {batch, 4, lq, 32});
  f["k"] = random_floats(rng, {batch, 2, lk, 32});
  f["v"] = random_floats(rng, {batch, 2, lk, 24});
  return f;
}

// window_case's inputs with a sink per head (one of them -inf: no sink) and
// ALiBi slopes per head; run with --sinks, --alibi, --softcap and --window.
Files variants_case() {
  Files f = window_case();
  NpyArray sinks(NpyDtype::F32, {4}), slopes(NpyDtype::F32, {4});
  for (int64_t h = 0; h < 4; ++h) {
    sinks.set_from_double(h, h == 2 ? -HUGE_VAL : 0.5 * static_cast<double>(h));
    slopes.set_from_double(h, std::exp2(-2.0 * static_cast<double>(h + 1)));
  }
  f["sinks_f64"] = as_f64(sinks);  // NumPy's default dtype: converted as Q's files are
  f["alibi_f64"] = as_f64(slopes);
  f["sinks"] = std::move(sinks);
  f["alibi"] = std::move(slopes);
  return f;
}

// Multi-query attention with an additive float mask [Lq,Lk] holding -inf,
// per-query int32 valid lengths (a zero among them); run with --causal
// top-left --scale 0.3.
Files additive_case() {
  Random rng(5);
  const int64_t batch = 2, lq = 6, lk = 7;
  Files f;
  f["q"] = random_floats(rng, {batch, 3, lq, 8});
  f["k"] = random_floats(rng, {batch, 1, lk, 8});
  f["v"] = random_floats(rng, {batch, 1, lk, 8});
  NpyArray mask(NpyDtype::F32, {lq, lk});
  for (int64_t i = 0; i < mask.size(); ++i) {
    mask.set_from_double(i, rng.chance(0.2) ? -HUGE_VAL : rng.uniform(-2, 2));
  }
  f["mask"] = std::move(mask);
  NpyArray vl(NpyDtype::I32, {batch, lq});
  for (int64_t i = 0; i < vl.size(); ++i) vl.set_from_double(i, static_cast<double>(i % (lk + 1)));
  f["valid_lens"] = std::move(vl);
  f["mask_f64"] = as_f64(f["mask"]);
  f["mask_f16"] = converted(f["mask"], NpyDtype::F16);
  return f;
}

// Fewer positions than the MPI tests' chunks: 2 queries and 3 keys, so that
// a rank of the ring (3 ranks, zigzag: 6 chunks) or of the decode (4 ranks)
// holds no rows; valid lengths and ALiBi slopes of the wrong shapes, which
// every rank would otherwise copy whole, and a valid length beyond the keys
// in the second query's row (to be named by its index in the file, not in a
// rank's shard); K and V files of the wrong shapes.
Files tiny_case() {
  Random rng(77);
  Files f = qkv_files(rng, 1, 2, 2, 3, 8);
  f["vl_wrong"] = filled(NpyDtype::I64, {3}, {1, 2, 3});
  f["alibi_wrong"] = filled(NpyDtype::F32, {3}, {0.5, 0.25, 0.125});
  f["vl_row_too_long"] = filled(NpyDtype::I32, {1, 2}, {3, 4});
  // K or V that disagree with Q or with each other, which the MPI modes would
  // cut by Q's geometry: one dimension off each.
  f["k_batch2"] = random_floats(rng, {2, 2, 3, 8});
  f["k_d4"] = random_floats(rng, {1, 2, 3, 4});
  f["v_kv1"] = random_floats(rng, {1, 1, 3, 8});
  f["v_lk2"] = random_floats(rng, {1, 2, 2, 8});
  return f;
}

// A packed variable-length batch (--cu-seqlens-q/-k): five sequences of
// different query and key lengths -- one without queries, one without keys,
// one with more queries than keys (bottom-right causal leaves rows empty) --,
// 4 query heads over 2 KV heads, Dv != D; the offsets as int32 and as int64,
// sinks [H], ALiBi slopes [B, H]; files the tool or the library must refuse.
Files varlen_case() {
  Random rng(616);
  const std::vector<int64_t> lens_q = {9, 0, 17, 9, 6}, lens_k = {4, 3, 17, 30, 0};
  const int64_t heads = 4, kv_heads = 2, d = 16, dv = 12;
  const auto offsets = [](const std::vector<int64_t>& lens, NpyDtype dtype) {
    NpyArray cu(dtype, {static_cast<int64_t>(lens.size()) + 1});
    int64_t total = 0;
    cu.set_from_double(0, 0);
    for (size_t b = 0; b < lens.size(); ++b) {
      total += lens[b];
      cu.set_from_double(static_cast<int64_t>(b) + 1, static_cast<double>(total));
    }
    return cu;
  };
  Files f;
  f["cu_q"] = offsets(lens_q, NpyDtype::I32);
  f["cu_k"] = offsets(lens_k, NpyDtype::I32);
  f["cu_k_i64"] = offsets(lens_k, NpyDtype::I64);
  const int64_t total_q = 41, total_k = 54;
  f["q"] = random_floats(rng, {total_q, heads, d});
  f["k"] = random_floats(rng, {total_k, kv_heads, d});
  f["v"] = random_floats(rng, {total_k, kv_heads, dv});
  NpyArray sinks(NpyDtype::F32, {heads}), slopes(NpyDtype::F32, {5, heads});
  for (int64_t h = 0; h < heads; ++h)
    sinks.set_from_double(h, h == 1 ? -HUGE_VAL : 0.3 * static_cast<double>(h));
  for (int64_t i = 0; i < slopes.size(); ++i) slopes.set_from_double(i, rng.uniform(0, 0.5));
  f["sinks"] = std::move(sinks);
  f["alibi"] = std::move(slopes);
  f["q_f64"] = as_f64(f["q"]);
  // Refused: offsets that decrease (the library), a float file and a rank-2
  // one (the tool), an int64 value beyond int32, offsets of another B, Q of
  // rank 4.
  f["cu_q_decreasing"] = filled(NpyDtype::I32, {6}, {0, 9, 3, 26, 35, 41});
  f["cu_q_f32"] = filled(NpyDtype::F32, {6}, {0, 9, 9, 26, 35, 41});
  f["cu_q_rank2"] = filled(NpyDtype::I32, {2, 3}, {0, 9, 9, 26, 35, 41});
  f["cu_q_huge"] = filled(NpyDtype::I64, {6}, {0, 9, 9, 26, 35, 4294967296.0});
  f["cu_q_b4"] = filled(NpyDtype::I32, {5}, {0, 9, 9, 26, 41});
  f["q_rank4"] = random_floats(rng, {1, total_q, heads, d});
  return f;
}

int write_case(const std::string& name, const std::string& dir) {
  const std::map<std::string, std::function<Files()>> cases = {
      {"d2l", d2l_case},       {"gqa", gqa_case},           {"additive", additive_case},
      {"window", window_case}, {"variants", variants_case}, {"varlen", varlen_case},
      {"tiny", tiny_case}};
  const auto it = cases.find(name);
  if (it == cases.end()) {
    std::fprintf(stderr, "mha_tools_case: unknown case '%s'\n", name.c_str());
    return 1;
  }
  std::filesystem::create_directories(dir);
  for (const auto& [file, array] : it->second()) {
    std::string path = dir;
    path += "/";
    path += file;
    path += ".npy";
    mha_tools::write_npy(path, array);
  }
  // A file that is not .npy at all.
  std::ofstream(dir + "/garbage.npy") << "this is not a NumPy file\n";
  if (name == "d2l") {
    // Inputs under other names: a FIFO (which must not block the reader), a
    // symbolic and a hard link (an output must not replace them); Q and K as
    // float64.
    namespace fs = std::filesystem;
    for (const char* file : {"fifo.npy", "q_link.npy", "v_hard.npy"}) fs::remove(dir + "/" + file);
    if (::mkfifo((dir + "/fifo.npy").c_str(), 0600) != 0) {
      std::fprintf(stderr, "mha_tools_case: mkfifo: %s\n", std::strerror(errno));
      return 1;
    }
    fs::create_symlink("q.npy", dir + "/q_link.npy");
    fs::create_hard_link(dir + "/v.npy", dir + "/v_hard.npy");
    mha_tools::write_npy(dir + "/k_f64.npy", as_f64(mha_tools::read_npy(dir + "/k.npy")));
  }
  std::printf("wrote case %s into %s\n", name.c_str(), dir.c_str());
  return 0;
}

// ---------------------------------------------------------------- check

// A C-order copy, element by element through the strides: the check does not
// rely on mha_run_core passing strides to mha correctly.
NpyArray to_c_order(const NpyArray& a) {
  NpyArray c(a.dtype(), a.shape());
  std::vector<int64_t> index(a.shape().size(), 0);
  const std::size_t itemsize = mha_tools::npy_itemsize(a.dtype());
  for (int64_t n = 0; n < a.size(); ++n) {
    const auto* from = static_cast<const unsigned char*>(a.data()) +
                       static_cast<std::size_t>(a.offset(index)) * itemsize;
    std::memcpy(static_cast<unsigned char*>(c.data()) + static_cast<std::size_t>(n) * itemsize,
                from, itemsize);
    for (std::size_t d = index.size(); d-- > 0;) {
      if (++index[d] < a.shape()[d]) break;
      index[d] = 0;
    }
  }
  return c;
}

// A C-order descriptor; `rank` > a.rank() adds leading dimensions of 1
// (rank-3 inputs and outputs are one batch).
mha_tensor c_order_tensor(NpyArray& a, mha_dtype dtype, int rank = 0) {
  std::vector<int64_t> shape = a.shape();
  while (static_cast<int>(shape.size()) < rank) shape.insert(shape.begin(), 1);
  mha_tensor t{};
  if (mha_tensor_init(&t, a.data(), dtype, static_cast<int32_t>(shape.size()), shape.data(),
                      nullptr) != MHA_OK) {
    throw std::runtime_error(std::string("mha_tensor_init: ") + mha_last_error());
  }
  return t;
}

NpyArray load_c(const std::string& path) {
  return to_c_order(mha_tools::read_npy(path));
}

// The float values of an array (float32, float16 or float64 that float32
// holds exactly, as every case writes) as a float32 array.
NpyArray as_f32(const NpyArray& a) {
  if (a.dtype() == NpyDtype::F32) return a;
  NpyArray f(NpyDtype::F32, a.shape());
  for (int64_t i = 0; i < a.size(); ++i) {
    const double value = a.value_as_double(i);
    if (static_cast<double>(static_cast<float>(value)) != value && !std::isnan(value)) {
      throw std::runtime_error("check: " + a.describe() +
                               " holds a value float32 cannot: the "
                               "checker rounds from float32 values");
    }
    f.set_from_double(i, value);
  }
  return f;
}

// K or V as an int8 cache by mha.h's rule for mha_quantize_kv, written here:
// per row of D values, scale = max|x| / 127 in fp32 and q = x / scale rounded
// to nearest even (in fp32), within +-127; a row of zeros has scale 0.
struct Quantized {
  std::vector<int8_t> values;
  std::vector<float> scales;
  mha_tensor t{}, scale{};
};
void quantize(const mha_tensor& src, Quantized& q) {
  const int64_t rows = src.shape[0] * src.shape[1] * src.shape[2], d = src.shape[3];
  q.values.assign(static_cast<size_t>(rows * d), 0);
  q.scales.assign(static_cast<size_t>(rows), 0.0f);
  const float* x = static_cast<const float*>(src.data);  // C order
  for (int64_t r = 0; r < rows; ++r) {
    float largest = 0.0f;
    for (int64_t c = 0; c < d; ++c) largest = std::max(largest, std::fabs(x[r * d + c]));
    const float scale = largest / 127.0f;
    q.scales[static_cast<size_t>(r)] = scale;
    for (int64_t c = 0; c < d; ++c) {
      const float unit = scale == 0.0f ? 0.0f : std::nearbyint(x[r * d + c] / scale);
      q.values[static_cast<size_t>(r * d + c)] =
          static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, unit)));
    }
  }
  q.t = src;
  q.t.data = q.values.data();
  q.t.dtype = MHA_DTYPE_I8;
  const int64_t scale_shape[3] = {src.shape[0], src.shape[1], src.shape[2]};
  if (mha_tensor_init(&q.scale, q.scales.data(), MHA_DTYPE_F32, 3, scale_shape, nullptr) !=
      MHA_OK) {
    throw std::runtime_error(std::string("mha_tensor_init: ") + mha_last_error());
  }
}

// The offsets of a packed batch as mha-run reads them (int32 or int64).
std::vector<int64_t> read_offsets(const std::string& path) {
  const NpyArray a = load_c(path);
  std::vector<int64_t> offsets;
  for (int64_t i = 0; i < a.size(); ++i) offsets.push_back(a.value_as_int64(i));
  return offsets;
}

// Sequence b of a packed [total, heads, d] tensor (C order) as the [1, heads,
// len, d] tensor of a call on that sequence alone.
mha_tensor sequence_of(const mha_tensor& t, int64_t first, int64_t len) {
  const int64_t row = t.shape[1] * t.shape[2];
  const int64_t bytes = t.dtype == MHA_DTYPE_I8 ? 1 : mha_types::float_bytes(t.dtype);
  mha_tensor v{};
  const int64_t shape[4] = {1, t.shape[1], len, t.shape[2]};
  const int64_t strides[4] = {row * std::max<int64_t>(len, 1), t.shape[2], row, 1};
  if (mha_tensor_init(&v, static_cast<char*>(t.data) + first * row * bytes,
                      static_cast<mha_dtype>(t.dtype), 4, shape, strides) != MHA_OK) {
    throw std::runtime_error(std::string("mha_tensor_init: ") + mha_last_error());
  }
  return v;
}

// A packed batch: every sequence against the float64 reference of that
// sequence alone -- its rows of Q, K and V (rounded to the dtypes as mha-run
// must round them), its own lengths for the causal rule, the window and ALiBi
// (its row of [B, H] slopes), its int8 row scales -- at the fp32 tolerance;
// a sequence without keys must give zero rows and LSE = its sink (or -inf).
// The output must be [total_q, H, Dv], the LSE [H, total_q].
int check_varlen_case(const mha_tools::AttentionOptions& o) {
  NpyArray q_file = load_c(o.q), out = load_c(o.out);
  const int32_t q_dtype =
      o.dtype.value_or(q_file.dtype() == NpyDtype::F16 ? MHA_DTYPE_F16 : MHA_DTYPE_F32);
  const int32_t kv_dtype = o.kv_dtype.value_or(static_cast<mha_dtype>(q_dtype));
  NpyArray q = as_f32(q_file), k = as_f32(load_c(o.k)), v = as_f32(load_c(o.v));
  const std::vector<int64_t> cu_q = read_offsets(o.cu_seqlens_q),
                             cu_k = read_offsets(o.cu_seqlens_k);
  std::printf("dtypes: q %s, k and v %s\n", mha_types::dtype_name(q_dtype),
              mha_types::dtype_name(kv_dtype));
  const int64_t total_q = q.shape()[0], heads = q.shape()[1], dv = v.shape()[2];
  if (out.dtype() != NpyDtype::F32 || out.shape() != std::vector<int64_t>{total_q, heads, dv}) {
    std::fprintf(stderr, "check: the output is %s, expected float32 [total_q, H, Dv]\n",
                 out.describe().c_str());
    return 1;
  }
  std::optional<NpyArray> lse;
  if (!o.lse.empty()) {
    lse = load_c(o.lse);
    if (lse->dtype() != NpyDtype::F32 || lse->shape() != std::vector<int64_t>{heads, total_q}) {
      std::fprintf(stderr, "check: the LSE is %s, expected float32 [H, total_q]\n",
                   lse->describe().c_str());
      return 1;
    }
  }
  std::optional<NpyArray> sinks, alibi;
  if (!o.sinks.empty()) sinks = load_c(o.sinks);
  if (!o.alibi.empty()) alibi = load_c(o.alibi);

  mha_test::TypedCopy tq(c_order_tensor(q, MHA_DTYPE_F32), q_dtype);
  std::vector<mha_test::TypedCopy> kv;
  Quantized k8, v8;
  mha_tensor tk{}, tv{};
  if (kv_dtype == MHA_DTYPE_I8) {  // [1, total_k, Hkv, D]: one scale per row of D
    quantize(c_order_tensor(k, MHA_DTYPE_F32, 4), k8);
    quantize(c_order_tensor(v, MHA_DTYPE_F32, 4), v8);
    tk = k8.t;
    tv = v8.t;
    for (mha_tensor* t : {&tk, &tv}) {  // back to [total_k, Hkv, D]
      *t = mha_test::describe(t->data, static_cast<mha_dtype>(t->dtype),
                              {t->shape[1], t->shape[2], t->shape[3]});
    }
  } else {
    kv.emplace_back(c_order_tensor(k, MHA_DTYPE_F32), kv_dtype);
    kv.emplace_back(c_order_tensor(v, MHA_DTYPE_F32), kv_dtype);
    tk = kv[0].get();
    tv = kv[1].get();
  }
  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = mha_tools::causal_mode(o.causal);
  if (!o.window.empty()) {
    const mha_tools::WindowEdges edges = mha_tools::parse_window(o.window);
    params.window_left = edges.left;
    params.window_right = edges.right;
  }
  if (o.scale) {
    params.has_scale = 1;
    params.scale = static_cast<float>(*o.scale);
  }
  if (o.softcap) params.softcap = static_cast<float>(*o.softcap);
  mha_tensor tsinks{};
  if (sinks) {
    tsinks = c_order_tensor(*sinks, MHA_DTYPE_F32);
    params.sinks = &tsinks;
  }
  if (!o.backend.empty() && mha_select_backend(o.backend.c_str()) != MHA_OK) {
    std::fprintf(stderr, "check: --backend %s: %s\n", o.backend.c_str(), mha_last_error());
    return 1;
  }
  const char* backend = mha_selected_backend();

  double worst = 0;  // error / tolerance, output and LSE
  int64_t empty_rows = 0;
  const float* got_out = out.data_as<float>();
  const auto lse_at = [&](int64_t h, int64_t row) {
    return static_cast<double>(lse->data_as<float>()[h * total_q + row]);
  };
  for (size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const int64_t q0 = cu_q[b], lq = cu_q[b + 1] - q0, k0 = cu_k[b], lk = cu_k[b + 1] - k0;
    if (lq == 0) continue;
    if (lk == 0) {  // zeros; the LSE is the sink, or -inf
      for (int64_t i = q0; i < q0 + lq; ++i) {
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t x = 0; x < dv; ++x) {
            if (got_out[(i * heads + h) * dv + x] != 0.0f) worst = HUGE_VAL;
          }
          const double sink = sinks ? sinks->value_as_double(h) : -HUGE_VAL;
          if (lse && lse_at(h, i) != sink) worst = HUGE_VAL;
          ++empty_rows;
        }
      }
      continue;
    }
    mha_attention_params alone = params;
    mha_tensor slope_row{}, k_scale{}, v_scale{};
    if (alibi) {
      const NpyArray& a = *alibi;
      const float* row = a.data_as<float>() + (a.rank() == 2 ? static_cast<int64_t>(b) * heads : 0);
      slope_row = mha_test::describe(const_cast<float*>(row), MHA_DTYPE_F32, {heads});
      alone.alibi_slopes = &slope_row;
    }
    if (kv_dtype == MHA_DTYPE_I8) {
      const int64_t kv_heads = tk.shape[1];
      k_scale = mha_test::describe(k8.scales.data() + k0 * kv_heads, MHA_DTYPE_F32,
                                   {1, kv_heads, lk}, {kv_heads * lk, 1, kv_heads});
      v_scale = mha_test::describe(v8.scales.data() + k0 * kv_heads, MHA_DTYPE_F32,
                                   {1, kv_heads, lk}, {kv_heads * lk, 1, kv_heads});
      alone.k_scale = &k_scale;
      alone.v_scale = &v_scale;
    }
    const mha_test::Reference ref = mha_test::reference_attention(
        sequence_of(tq.get(), q0, lq), sequence_of(tk, k0, lk), sequence_of(tv, k0, lk), &alone);
    double tolerance = mha_test::tolerance(ref);
    if (q_dtype == MHA_DTYPE_BF16 && backend != nullptr &&
        std::string(backend).find("bf16") != std::string::npos) {
      tolerance += 4 * 0x1.0p-9 * ref.max_abs_value;
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        const size_t row = static_cast<size_t>(h * lq + i);
        for (int64_t x = 0; x < dv; ++x) {
          const double got = static_cast<double>(got_out[((q0 + i) * heads + h) * dv + x]);
          const double want = ref.out[row * static_cast<size_t>(dv) + static_cast<size_t>(x)];
          worst =
              std::max(worst, std::isfinite(got) ? std::fabs(got - want) / tolerance : HUGE_VAL);
        }
        if (!lse) continue;
        const double want = ref.lse[row], got = lse_at(h, q0 + i);
        if (std::isinf(want) && want < 0) {
          ++empty_rows;
          if (!(std::isinf(got) && got < 0)) worst = HUGE_VAL;
          continue;
        }
        const double err = std::isfinite(got) ? std::fabs(got - want) : HUGE_VAL;
        worst = std::max(worst, err / mha_test::lse_tolerance(ref, want));
      }
    }
  }
  std::printf(
      "packed batch of %zu sequences: worst error / tolerance = %.3g (%lld rows without "
      "keys)\n",
      cu_q.size() - 1, worst, static_cast<long long>(empty_rows));
  const bool ok = worst <= 1.0;
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// Compares mha-run's outputs with the float64 reference of the values mha-run
// passed to mha: the inputs rounded to --dtype / --kv-dtype here as mha-run
// must round them (bf16 and f16 to nearest even, i8 by mha_quantize_kv's
// rule), so that the fp32 tolerance of tests/reference.h applies.
int check_case(const mha_tools::AttentionOptions& o) {
  if (!o.cu_seqlens_q.empty()) return check_varlen_case(o);
  NpyArray q_file = load_c(o.q), out = load_c(o.out);
  // The dtypes, by mha-run's documented defaults: f16 for a float16 Q file.
  const int32_t q_dtype =
      o.dtype.value_or(q_file.dtype() == NpyDtype::F16 ? MHA_DTYPE_F16 : MHA_DTYPE_F32);
  const int32_t kv_dtype = o.kv_dtype.value_or(static_cast<mha_dtype>(q_dtype));
  NpyArray q = as_f32(q_file), k = as_f32(load_c(o.k)), v = as_f32(load_c(o.v));
  std::optional<NpyArray> mask, vl, lse;
  if (!o.mask.empty()) {
    mask = load_c(o.mask);
    if (mask->dtype() != NpyDtype::Bool && mask->dtype() != NpyDtype::U8) mask = as_f32(*mask);
  }
  if (!o.valid_lens.empty()) vl = load_c(o.valid_lens);
  if (!o.lse.empty()) lse = load_c(o.lse);
  std::optional<NpyArray> sinks, alibi;
  if (!o.sinks.empty()) sinks = load_c(o.sinks);
  if (!o.alibi.empty()) alibi = load_c(o.alibi);
  std::printf("dtypes: q %s, k and v %s\n", mha_types::dtype_name(q_dtype),
              mha_types::dtype_name(kv_dtype));

  // Q (and a float mask) in Q's dtype; K and V in theirs.
  mha_test::TypedCopy tq(c_order_tensor(q, MHA_DTYPE_F32, 4), q_dtype);
  const mha_tensor k32 = c_order_tensor(k, MHA_DTYPE_F32, 4),
                   v32 = c_order_tensor(v, MHA_DTYPE_F32, 4);
  std::vector<mha_test::TypedCopy> kv;
  Quantized k8, v8;
  const mha_tensor* tk = nullptr;
  const mha_tensor* tv = nullptr;
  mha_attention_params params;
  mha_attention_params_init(&params);
  if (kv_dtype == MHA_DTYPE_I8) {
    quantize(k32, k8);
    quantize(v32, v8);
    tk = &k8.t;
    tv = &v8.t;
    params.k_scale = &k8.scale;
    params.v_scale = &v8.scale;
  } else {
    kv.emplace_back(k32, kv_dtype);
    kv.emplace_back(v32, kv_dtype);
    tk = &kv[0].get();
    tv = &kv[1].get();
  }
  mha_tensor tmask{}, tvl{};
  std::optional<mha_test::TypedCopy> mask_typed;
  if (mask) {
    if (mask->dtype() == NpyDtype::F32) {
      mask_typed.emplace(c_order_tensor(*mask, MHA_DTYPE_F32), q_dtype);
      tmask = mask_typed->get();
    } else {
      tmask = c_order_tensor(*mask, MHA_DTYPE_BOOL);
    }
    params.mask = &tmask;
  }
  if (vl) {
    tvl = c_order_tensor(*vl, vl->dtype() == NpyDtype::I64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32);
    params.valid_lens = &tvl;
  }
  if (o.causal == "top-left") params.causal = MHA_CAUSAL_TOP_LEFT;
  if (o.causal == "bottom-right") params.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  if (!o.window.empty()) {
    const mha_tools::WindowEdges edges = mha_tools::parse_window(o.window);
    params.window_left = edges.left;
    params.window_right = edges.right;
  }
  if (o.scale) {
    params.has_scale = 1;
    params.scale = static_cast<float>(*o.scale);
  }
  mha_tensor tsinks{}, talibi{};
  if (sinks) {
    tsinks = c_order_tensor(*sinks, MHA_DTYPE_F32);
    params.sinks = &tsinks;
  }
  if (alibi) {
    talibi = c_order_tensor(*alibi, MHA_DTYPE_F32);
    params.alibi_slopes = &talibi;
  }
  if (o.softcap) params.softcap = static_cast<float>(*o.softcap);
  const mha_test::Reference ref = mha_test::reference_attention(tq.get(), *tk, *tv, &params);

  const std::vector<int64_t> out_shape = {ref.batch, ref.heads, ref.lq, ref.dv};
  const bool unbatched = q.rank() == 3;
  const std::vector<int64_t> file_shape(out_shape.begin() + (unbatched ? 1 : 0), out_shape.end());
  if (out.dtype() != NpyDtype::F32 || out.shape() != file_shape) {
    std::fprintf(stderr, "check: the output is %s, expected float32 [%s%lld, %lld, %lld]\n",
                 out.describe().c_str(),
                 unbatched ? "" : (std::to_string(ref.batch) + ", ").c_str(),
                 static_cast<long long>(ref.heads), static_cast<long long>(ref.lq),
                 static_cast<long long>(ref.dv));
    return 1;
  }
  const double error = mha_test::max_abs_error(c_order_tensor(out, MHA_DTYPE_F32, 4), ref);
  double tolerance = mha_test::tolerance(ref);
  // A backend with bf16 dot products rounds P to bf16 once for P.V
  // (docs/decisions.md): 4 * 2^-9 * max|V| more.
  if (!o.backend.empty() && mha_select_backend(o.backend.c_str()) != MHA_OK) {
    std::fprintf(stderr, "check: --backend %s: %s\n", o.backend.c_str(), mha_last_error());
    return 1;
  }
  const char* backend = mha_selected_backend();
  if (q_dtype == MHA_DTYPE_BF16 && backend != nullptr &&
      std::string(backend).find("bf16") != std::string::npos) {
    tolerance += 4 * 0x1.0p-9 * ref.max_abs_value;
  }
  std::printf("output: max |out - ref| = %.3g, tolerance %.3g\n", error, tolerance);
  bool ok = error <= tolerance;

  if (lse) {
    const std::vector<int64_t> lse_shape(file_shape.begin(), file_shape.end() - 1);
    if (lse->dtype() != NpyDtype::F32 || lse->shape() != lse_shape) {
      std::fprintf(stderr, "check: the LSE is %s, expected float32 [B, H, Lq]\n",
                   lse->describe().c_str());
      return 1;
    }
    double worst = 0;  // error / tolerance
    int64_t empty_rows = 0;
    for (int64_t i = 0; i < lse->size(); ++i) {
      const double got = lse->value_as_double(i), want = ref.lse[static_cast<size_t>(i)];
      if (std::isinf(want) && want < 0) {
        ++empty_rows;
        if (!(std::isinf(got) && got < 0)) worst = HUGE_VAL;
        continue;
      }
      const double tol = mha_test::lse_tolerance(ref, want);
      const double err = std::isfinite(got) ? std::fabs(got - want) : HUGE_VAL;
      worst = std::max(worst, err / tol);
    }
    std::printf("lse: worst error / tolerance = %.3g (%lld rows without keys)\n", worst,
                static_cast<long long>(empty_rows));
    ok = ok && worst <= 1.0;
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// ---------------------------------------------------------------- check-info

int check_info(const std::string& file, const std::string& expected_selected) {
  std::ifstream in(file);
  if (!in) {
    std::fprintf(stderr, "check-info: cannot read %s\n", file.c_str());
    return 1;
  }
  const nlohmann::json j = nlohmann::json::parse(in);  // throws on bad JSON
  std::vector<std::string> problems;
  const auto expect = [&problems](bool ok, const std::string& what) {
    if (!ok) problems.push_back(what);
  };
  expect(j.is_object(), "not an object");
  expect(j.value("version", "") == mha_version(), "version differs from mha_version()");
  expect(j.contains("cpu_features") && j["cpu_features"].is_array(), "cpu_features not a list");
  if (j.contains("cpu_features") && j["cpu_features"].is_array()) {
    for (const auto& f : j["cpu_features"]) expect(f.is_string(), "a cpu feature not a string");
  }
  expect(j.contains("backends") && j["backends"].is_array() &&
             j["backends"].size() == static_cast<size_t>(mha_backend_count()),
         "backends not a list of mha_backend_count() entries");
  std::vector<std::string> usable;
  if (j.contains("backends") && j["backends"].is_array()) {
    for (const auto& b : j["backends"]) {
      const bool shaped =
          b.is_object() && b.contains("name") && b["name"].is_string() && b.contains("usable") &&
          b["usable"].is_boolean() && b.contains("reason") && b["reason"].is_string() &&
          b.contains("priority") && b["priority"].is_number_integer() && b.contains("bf16_dot") &&
          b["bf16_dot"].is_boolean() && b.contains("bf16_amx") && b["bf16_amx"].is_boolean() &&
          b.size() == 7 && b.contains("tiles");
      expect(shaped,
             "a backend is not {name, usable, reason, priority, tiles, bf16_dot, bf16_amx}: " +
                 b.dump());
      if (!shaped) continue;
      const bool is_usable = b["usable"].get<bool>();
      expect(is_usable == b["reason"].get<std::string>().empty(),
             "usable and reason disagree: " + b.dump());
      if (is_usable) usable.push_back(b["name"].get<std::string>());
      // The tiles are mha_backend_get_tiles' (null when not usable).
      mha_backend_tiles tiles{};
      int32_t streams = 0;
      const int32_t index = static_cast<int32_t>(&b - &j["backends"][0]);
      expect(mha_backend_get_tiles(index, &tiles) == MHA_OK, "mha_backend_get_tiles failed");
      expect(mha_backend_get_decode_streams(index, &streams) == MHA_OK,
             "mha_backend_get_decode_streams failed");
      int32_t bf16_dot = -1;
      expect(mha_backend_get_bf16_dot(index, &bf16_dot) == MHA_OK,
             "mha_backend_get_bf16_dot failed");
      // Where the report's process loaded the backend (this one may have
      // loaded more: the report may have been written under MHA_BACKEND).
      const bool dot = b["bf16_dot"].get<bool>(), amx = b["bf16_amx"].get<bool>();
      expect(is_usable ? dot == (bf16_dot != 0) && amx == (bf16_dot == 2) : !dot && !amx,
             "bf16_dot and bf16_amx are not mha_backend_get_bf16_dot's: " + b.dump());
      const auto& t = b["tiles"];
      if (is_usable) {
        expect(t.is_object() && t.size() == 4 && t.value("query", -1) == tiles.query_tile &&
                   t.value("key", -1) == tiles.key_tile &&
                   t.value("decode_key", -1) == tiles.decode_key_tile &&
                   t.value("decode_streams", -1) == streams && tiles.query_tile > 0 &&
                   tiles.key_tile > 0 && streams > 0,
               "tiles are not {query, key, decode_key, decode_streams} as "
               "mha_backend_get_tiles and mha_backend_get_decode_streams: " +
                   b.dump());
      } else {
        expect(t.is_null(), "an unusable backend has tiles: " + b.dump());
      }
    }
  }
  // The caches: bytes as mha_cpu_caches says, null when unknown.
  mha_cache_info caches{};
  expect(mha_cpu_caches(&caches) == MHA_OK, "mha_cpu_caches failed");
  const auto same_size = [](const nlohmann::json& size, int64_t bytes) {
    return bytes > 0 ? size.is_number_integer() && size.get<int64_t>() == bytes : size.is_null();
  };
  expect(j.contains("caches") && j["caches"].is_object() && j["caches"].size() == 3 &&
             same_size(j["caches"].value("l1d", nlohmann::json()), caches.l1d_bytes) &&
             same_size(j["caches"].value("l2", nlohmann::json()), caches.l2_bytes) &&
             same_size(j["caches"].value("l3", nlohmann::json()), caches.l3_bytes),
         "caches are not {l1d, l2, l3} as mha_cpu_caches says");
  expect(j.contains("selected"), "no selected key");
  if (j.contains("selected")) {
    const auto& s = j["selected"];
    expect(s.is_null() || s.is_string(), "selected is neither a string nor null");
    if (s.is_string()) {
      expect(std::find(usable.begin(), usable.end(), s.get<std::string>()) != usable.end(),
             "selected is not a usable backend");
    }
    if (!expected_selected.empty()) {
      expect(expected_selected == "null"
                 ? s.is_null()
                 : (s.is_string() && s.get<std::string>() == expected_selected),
             "selected is " + s.dump() + ", expected " + expected_selected);
    }
  }
  expect(
      j.contains("threads") && j["threads"].is_number_integer() && j["threads"].get<int64_t>() >= 1,
      "threads is not a positive integer");
  for (const auto& p : problems) std::fprintf(stderr, "check-info: %s\n", p.c_str());
  std::printf("%s\n", problems.empty() ? "PASS" : "FAIL");
  return problems.empty() ? 0 : 1;
}

// ---------------------------------------------------------------- same

std::vector<int64_t> without_leading_ones(std::vector<int64_t> shape) {
  while (!shape.empty() && shape.front() == 1) shape.erase(shape.begin());
  return shape;
}

int same(const std::string& a_path, const std::string& b_path) {
  const NpyArray a = load_c(a_path), b = load_c(b_path);
  std::printf("%s: %s\n%s: %s\n", a_path.c_str(), a.describe().c_str(), b_path.c_str(),
              b.describe().c_str());
  if (a.dtype() != b.dtype() ||
      without_leading_ones(a.shape()) != without_leading_ones(b.shape())) {
    std::printf("different dtypes or shapes\n");
    return 1;
  }
  if (a.nbytes() != b.nbytes() || std::memcmp(a.data(), b.data(), a.nbytes()) != 0) {
    std::printf("different values\n");
    return 1;
  }
  std::printf("same values\n");
  return 0;
}

// ---------------------------------------------------------------- write-module

// Weight directories for `mha-run module` (E = 8, 2 heads), all with the
// same weights:
//   plain/          PyTorch's four files with biases, no config.json
//   seq_first/      + config.json as the export script writes it, batch_first false
//   batch_first/    + config.json with batch_first true
//   no_out/         no out_proj.weight.npy (config.json: bias false, no bias files)
//   no_bias/        no bias files, config.json "bias": false
//   bias_missing/   no bias files, config.json "bias": true
//   zero_attn/      config.json "add_zero_attn": true
// and the inputs query.npy [2, 3, 8] (read as [B, L, E] or as [L, B, E]),
// query_f64.npy (the same values), query_f16.npy (rounded to float16) and
// query_f16_f32.npy (those values as float32), key.npy [2, 5, 8].
int write_module(const std::string& dir) {
  namespace fs = std::filesystem;
  Random rng(99);
  const int64_t e = 8;
  const NpyArray in_w = random_floats(rng, {3 * e, e}), in_b = random_floats(rng, {3 * e}),
                 out_w = random_floats(rng, {e, e}), out_b = random_floats(rng, {e});
  const auto config = [](bool bias, const char* batch_first, bool zero_attn) {
    return std::string("{\"embed_dim\": 8, \"num_heads\": 2, \"dropout\": 0.0, \"bias\": ") +
           (bias ? "true" : "false") +
           ", \"add_bias_kv\": false, \"add_zero_attn\": " + (zero_attn ? "true" : "false") +
           ", \"kdim\": 8, \"vdim\": 8, \"batch_first\": " + batch_first + "}\n";
  };
  struct Dir {
    const char* name;
    bool out_weight, biases;
    std::string config;  // empty: none
  };
  const Dir dirs[] = {{"plain", true, true, ""},
                      {"seq_first", true, true, config(true, "false", false)},
                      {"batch_first", true, true, config(true, "true", false)},
                      {"no_out", false, false, config(false, "true", false)},
                      {"no_bias", true, false, config(false, "true", false)},
                      {"bias_missing", true, false, config(true, "true", false)},
                      {"zero_attn", true, true, config(true, "true", true)}};
  for (const Dir& d : dirs) {
    const std::string path = dir + "/" + d.name;
    fs::remove_all(path);
    fs::create_directories(path);
    mha_tools::write_npy(path + "/in_proj_weight.npy", in_w);
    if (d.out_weight) mha_tools::write_npy(path + "/out_proj.weight.npy", out_w);
    if (d.biases) {
      mha_tools::write_npy(path + "/in_proj_bias.npy", in_b);
      mha_tools::write_npy(path + "/out_proj.bias.npy", out_b);
    }
    if (!d.config.empty()) std::ofstream(path + "/config.json") << d.config;
  }
  const NpyArray query = random_floats(rng, {2, 3, e});
  mha_tools::write_npy(dir + "/query.npy", query);
  mha_tools::write_npy(dir + "/query_f64.npy", as_f64(query));
  // float16 queries, and their values as float32 (what the module computes on).
  const NpyArray query_f16 = converted(query, NpyDtype::F16);
  mha_tools::write_npy(dir + "/query_f16.npy", query_f16);
  mha_tools::write_npy(dir + "/query_f16_f32.npy", converted(query_f16, NpyDtype::F32));
  mha_tools::write_npy(dir + "/key.npy", random_floats(rng, {2, 5, e}));
  std::printf("wrote the module cases into %s\n", dir.c_str());
  return 0;
}

// ------------------------------------------------------ write-dout, check-backward

int write_dout(const std::string& dir) {
  const NpyArray q = load_c(dir + "/q.npy"), v = load_c(dir + "/v.npy");
  std::vector<int64_t> shape = q.shape();
  shape.back() = v.shape().back();
  Random rng(77);
  mha_tools::write_npy(dir + "/dout.npy", random_floats(rng, shape));
  return 0;
}

// A gradient file of mha-run backward, as the values of the dtype it was
// computed in (exact when they are that dtype's values, so that the
// tolerance adds its rounding): nullopt, with the reason printed, when the
// file holds another dtype or values that dtype does not have.
std::optional<mha_test::TypedCopy> gradient_file(const std::string& path, NpyArray& got,
                                                 int32_t dtype, const char* name) {
  NpyArray file = load_c(path);
  const NpyDtype expected = dtype == MHA_DTYPE_F16 ? NpyDtype::F16 : NpyDtype::F32;
  if (file.dtype() != expected) {
    std::printf("%s: the file holds %s, expected %s for %s\n", name, file.describe().c_str(),
                expected == NpyDtype::F16 ? "float16" : "float32", mha_types::dtype_name(dtype));
    return std::nullopt;
  }
  got = as_f32(file);
  std::optional<mha_test::TypedCopy> typed;
  typed.emplace(c_order_tensor(got, MHA_DTYPE_F32), dtype);
  for (int64_t i = 0; dtype != MHA_DTYPE_F32 && i < got.size(); ++i) {
    const double stored = got.value_as_double(i);
    const double as_typed =
        mha_test::half_bits_value(static_cast<const uint16_t*>(typed->get().data)[i], dtype);
    if (stored != as_typed && !std::isnan(stored)) {
      std::printf("%s: element %lld is %.9g, not a %s value\n", name, static_cast<long long>(i),
                  stored, mha_types::dtype_name(dtype));
      return std::nullopt;
    }
  }
  return typed;
}

// The elements of the dsinks file mha-run wrote that are off `want` by more
// than `tolerance` (each printed).
int dsinks_failures(const std::string& path, const std::vector<double>& want, double tolerance) {
  const NpyArray got = as_f32(load_c(path));
  int failures = 0;
  for (int64_t h = 0; h < got.size(); ++h) {
    const double error = std::fabs(got.value_as_double(h) - want[static_cast<size_t>(h)]);
    if (!(error <= tolerance)) {
      std::printf("dsinks[%lld]: error %.3g, tolerance %.3g\n", static_cast<long long>(h), error,
                  tolerance);
      ++failures;
    }
  }
  return failures;
}

// A packed batch's gradients (mha-run backward with --cu-seqlens-q/-k): each
// sequence's rows of dq, dk and dv against reference_backward on that
// sequence alone (its rows of the inputs as the tool loads them, its row of
// [B, H] ALiBi slopes, the dropout seed + b), at test_backward's tolerance;
// key rows no query reads and the query rows of a sequence without keys must
// be zeros; dsinks against the sum of the sequences' references.
int check_varlen_backward(const mha_tools::BackwardOptions& o) {
  mha_tools::AttentionInputs in = mha_tools::load_attention_inputs(o);
  mha_tools::AttentionCall call = mha_tools::prepare_attention_call(in, o);
  NpyArray dout = as_f32(load_c(o.dout));
  mha_test::TypedCopy tdout(c_order_tensor(dout, MHA_DTYPE_F32), call.q.dtype);
  const mha_attention_params params = call.params();
  std::optional<NpyArray> out;
  mha_tensor tout{};
  if (!o.out.empty()) {
    out = as_f32(load_c(o.out));
    tout = c_order_tensor(*out, MHA_DTYPE_F32);
  }
  const std::vector<int64_t> cu_q = read_offsets(o.cu_seqlens_q),
                             cu_k = read_offsets(o.cu_seqlens_k);
  const int64_t heads = call.q.shape[1];
  std::printf("packed batch of %zu sequences; dtypes: q %s, k and v %s, gradients %s\n",
              cu_q.size() - 1, mha_types::dtype_name(call.q.dtype),
              mha_types::dtype_name(call.k.dtype), o.grad_dtype.c_str());
  const auto dtype_of = [&o](int32_t input) {
    return o.grad_dtype == "input" ? input : static_cast<int32_t>(MHA_DTYPE_F32);
  };
  NpyArray fdq, fdk, fdv;
  auto gdq = gradient_file(o.dq, fdq, dtype_of(call.q.dtype), "dq");
  auto gdk = gradient_file(o.dk, fdk, dtype_of(call.k.dtype), "dk");
  auto gdv = gradient_file(o.dv, fdv, dtype_of(call.v.dtype), "dv");
  if (!gdq || !gdk || !gdv) {
    std::printf("FAIL\n");
    return 1;
  }
  double worst = 0;  // error / tolerance over every sequence and gradient
  int64_t nonzero = 0;
  const auto count_nonzero = [&nonzero](const NpyArray& g, int64_t first, int64_t end) {
    const int64_t row = g.shape()[1] * g.shape()[2];
    for (int64_t e = first * row; e < end * row; ++e) nonzero += g.value_as_double(e) != 0.0;
  };
  std::vector<double> dsinks(static_cast<size_t>(heads), 0.0);
  double dsinks_terms = 0, max_logit = 0;
  for (size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const int64_t q0 = cu_q[b], lq = cu_q[b + 1] - q0, k0 = cu_k[b], lk = cu_k[b + 1] - k0;
    if (lq == 0 || lk == 0) {
      count_nonzero(fdk, k0, k0 + lk);
      count_nonzero(fdv, k0, k0 + lk);
      count_nonzero(fdq, q0, q0 + lq);
      continue;
    }
    mha_attention_params alone = params;
    alone.lse = nullptr;
    alone.dropout_seed = params.dropout_seed + b;
    mha_tensor slope_row{};
    if (params.alibi_slopes != nullptr && params.alibi_slopes->ndim == 2) {
      slope_row = mha_test::describe(
          static_cast<float*>(params.alibi_slopes->data) + static_cast<int64_t>(b) * heads,
          MHA_DTYPE_F32, {heads});
      alone.alibi_slopes = &slope_row;
    }
    // With --out (the forward's output mha-run handed the backward): delta
    // from it, as the backward defines it (check_backward's rule).
    const mha_tensor out_rows = out ? sequence_of(tout, q0, lq) : mha_tensor{};
    const mha_test::BackwardReference ref = mha_test::reference_backward(
        sequence_of(call.q, q0, lq), sequence_of(call.k, k0, lk), sequence_of(call.v, k0, lk),
        sequence_of(tdout.get(), q0, lq), &alone, false, out ? &out_rows : nullptr);
    worst = std::max({worst,
                      mha_test::gradient_error(sequence_of(gdq->get(), q0, lq), ref.dq,
                                               ref.terms_dq, ref.max_abs_logit),
                      mha_test::gradient_error(sequence_of(gdk->get(), k0, lk), ref.dk,
                                               ref.terms_dk, ref.max_abs_logit),
                      mha_test::gradient_error(sequence_of(gdv->get(), k0, lk), ref.dv,
                                               ref.terms_dv, ref.max_abs_logit)});
    for (size_t h = 0; h < ref.dsinks.size(); ++h) dsinks[h] += ref.dsinks[h];
    dsinks_terms += ref.terms_dsinks;
    max_logit = std::max(max_logit, ref.max_abs_logit);
  }
  int failures = nonzero > 0 ? 1 : 0;
  std::printf(
      "gradients: worst error / tolerance %.3g; %lld non-zero values where no query reads\n", worst,
      static_cast<long long>(nonzero));
  if (!(worst <= 1.0)) ++failures;
  if (!o.dsinks.empty()) {
    failures += dsinks_failures(o.dsinks, dsinks,
                                mha_test::gradient_tolerance(dsinks, dsinks_terms, max_logit));
  }
  std::printf("%s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}

// The gradients mha-run wrote against reference_backward on the same call
// (the tool's own loading builds the descriptors of Q, K and V; dout is
// rounded to Q's dtype here, as mha-run documents it; the reference is
// independent), with test_backward's tolerance for the gradients' dtype.
// Each file must hold its --grad-dtype: float16 for f16, float32 for f32,
// and for bf16 float32 values that bf16 holds exactly.
int check_backward(const mha_tools::BackwardOptions& o) {
  if (!o.cu_seqlens_q.empty()) return check_varlen_backward(o);
  mha_tools::AttentionInputs in = mha_tools::load_attention_inputs(o);
  mha_tools::AttentionCall call = mha_tools::prepare_attention_call(in, o);
  NpyArray dout = as_f32(load_c(o.dout));
  mha_test::TypedCopy tdout(c_order_tensor(dout, MHA_DTYPE_F32, 4), call.q.dtype);
  const mha_attention_params params = call.params();
  // With --out (the forward's output mha-run handed the backward): delta
  // from it, as the backward defines it -- bf16 inputs may have taken the
  // bf16 dot-product forward, whose out carries P's rounding.
  std::optional<NpyArray> out;
  mha_tensor tout{};
  if (!o.out.empty()) {
    out = as_f32(load_c(o.out));
    tout = c_order_tensor(*out, MHA_DTYPE_F32, 4);
  }
  const mha_test::BackwardReference ref = mha_test::reference_backward(
      call.q, call.k, call.v, tdout.get(), &params, false, out ? &tout : nullptr);
  std::printf("dtypes: q %s, k and v %s, dout %s, gradients %s\n",
              mha_types::dtype_name(call.q.dtype), mha_types::dtype_name(call.k.dtype),
              mha_types::dtype_name(tdout.get().dtype), o.grad_dtype.c_str());
  int failures = 0;
  const auto compare = [&](const std::string& path, const std::vector<double>& want, double terms,
                           int32_t input_dtype, const char* name) {
    const int32_t dtype = o.grad_dtype == "input" ? input_dtype : MHA_DTYPE_F32;
    NpyArray file = load_c(path);
    const NpyDtype expected = dtype == MHA_DTYPE_F16 ? NpyDtype::F16 : NpyDtype::F32;
    if (file.dtype() != expected) {
      std::printf("%s: the file holds %s, expected %s for %s\n", name, file.describe().c_str(),
                  expected == NpyDtype::F16 ? "float16" : "float32", mha_types::dtype_name(dtype));
      ++failures;
      return;
    }
    NpyArray got = as_f32(file);
    mha_tensor t = c_order_tensor(got, MHA_DTYPE_F32, 4);
    // The values as the dtype they were computed in (exact when they are
    // that dtype's values), so that the tolerance adds its rounding.
    mha_test::TypedCopy typed(t, dtype);
    for (int64_t i = 0; dtype != MHA_DTYPE_F32 && i < got.size(); ++i) {
      const double stored = got.value_as_double(i);
      const double as_typed =
          mha_test::half_bits_value(static_cast<const uint16_t*>(typed.get().data)[i], dtype);
      if (stored != as_typed && !std::isnan(stored)) {
        std::printf("%s: element %lld is %.9g, not a %s value\n", name, static_cast<long long>(i),
                    stored, mha_types::dtype_name(dtype));
        ++failures;
        return;
      }
    }
    const double error = mha_test::gradient_error(typed.get(), want, terms, ref.max_abs_logit);
    std::printf("%s (%s): worst error / tolerance %.3g\n", name, mha_types::dtype_name(dtype),
                error);
    if (!(error <= 1.0)) ++failures;
  };
  compare(o.dq, ref.dq, ref.terms_dq, call.q.dtype, "dq");
  compare(o.dk, ref.dk, ref.terms_dk, call.k.dtype, "dk");
  compare(o.dv, ref.dv, ref.terms_dv, call.v.dtype, "dv");
  if (!o.dsinks.empty()) {
    failures +=
        dsinks_failures(o.dsinks, ref.dsinks,
                        2e-5 * mha_test::max_abs(ref.dsinks) + std::ldexp(ref.terms_dsinks, -18));
  }
  std::printf("%s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}

int run(int argc, char** argv) {
  CLI::App app{"Ends of the mha-run / mha-info test chains.", "mha_tools_case"};
  app.require_subcommand(1);

  std::string case_name, dir;
  CLI::App* write = app.add_subcommand("write", "write the inputs of a case");
  write->add_option("case", case_name)->required();
  write->add_option("dir", dir)->required();

  mha_tools::AttentionOptions attention;
  CLI::App* check = app.add_subcommand("check", "compare mha-run's output with the reference");
  mha_tools::add_attention_options(*check, attention);

  std::string info_file, selected;
  CLI::App* info = app.add_subcommand("check-info", "check the JSON of mha-info --json");
  info->add_option("file", info_file)->required();
  info->add_option("--selected", selected, "the expected selected backend, or null");

  std::string same_a, same_b;
  CLI::App* same_cmd = app.add_subcommand("same", "two .npy files hold the same values");
  same_cmd->add_option("a", same_a)->required();
  same_cmd->add_option("b", same_b)->required();

  std::string module_dir;
  CLI::App* module = app.add_subcommand("write-module", "write the cases of mha-run module");
  module->add_option("dir", module_dir)->required();

  std::string dout_dir;
  CLI::App* dout_cmd = app.add_subcommand("write-dout", "write a random dout.npy for a case");
  dout_cmd->add_option("dir", dout_dir)->required();
  mha_tools::BackwardOptions backward;
  CLI::App* check_bw = app.add_subcommand(
      "check-backward", "compare mha-run backward's gradients with the reference");
  mha_tools::add_backward_options(*check_bw, backward);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (write->parsed()) return write_case(case_name, dir);
  if (dout_cmd->parsed()) return write_dout(dout_dir);
  if (check_bw->parsed()) return check_backward(backward);
  if (check->parsed()) return check_case(attention);
  if (same_cmd->parsed()) return same(same_a, same_b);
  if (module->parsed()) return write_module(module_dir);
  return check_info(info_file, selected);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mha_tools_case: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "mha_tools_case: unknown exception\n");
  }
  return 1;
}
