// The steps of mha-run, in process: pair counting (against brute force), the
// timing line, option checks, and the command's failure paths (each must
// return 1, or 2 for a wrong command line, with a message, never crash).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "attention_run.h"
#include "common/dtype.h"
#include "npy.h"

namespace {

using mha_tools::AttentionCall;
using mha_tools::AttentionOptions;
using mha_tools::NpyArray;
using mha_tools::NpyDtype;

mha_tensor shape_only(int64_t a, int64_t b, int64_t c, int64_t d) {
  mha_tensor t{};
  t.dtype = MHA_DTYPE_F32;
  t.ndim = 4;
  const int64_t shape[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) t.shape[i] = shape[i];
  return t;
}

mha_tensor describe(NpyArray& a, mha_dtype dtype) {
  mha_tensor t{};
  EXPECT_EQ(mha_tensor_init(&t, a.data(), dtype, a.rank(), a.shape().data(), a.strides().data()),
            MHA_OK)
      << mha_last_error();
  return t;
}

struct Problem {
  int64_t batch, heads, lq, lk, d, dv;
  int32_t causal = MHA_CAUSAL_NONE;
  std::optional<NpyArray> valid_lens, mask;
};

AttentionCall call_of(Problem& p) {
  AttentionCall call;
  call.q = shape_only(p.batch, p.heads, p.lq, p.d);
  call.k = shape_only(p.batch, 1, p.lk, p.d);
  call.v = shape_only(p.batch, 1, p.lk, p.dv);
  call.causal = p.causal;
  if (p.valid_lens) {
    call.valid_lens = describe(
        *p.valid_lens, p.valid_lens->dtype() == NpyDtype::I64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32);
  }
  if (p.mask) {
    call.mask =
        describe(*p.mask, p.mask->dtype() == NpyDtype::F32 ? MHA_DTYPE_F32 : MHA_DTYPE_BOOL);
  }
  return call;
}

// Straight from the definitions, one (b, h, i, j) at a time.
int64_t brute_force_pairs(const Problem& p) {
  int64_t pairs = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < p.lq; ++i)
        for (int64_t j = 0; j < p.lk; ++j) {
          if (p.causal == MHA_CAUSAL_TOP_LEFT && j > i) continue;
          if (p.causal == MHA_CAUSAL_BOTTOM_RIGHT && j > i + p.lk - p.lq) continue;
          if (p.valid_lens) {
            const auto& vl = *p.valid_lens;
            const int64_t len = vl.rank() == 1 ? vl.value_as_int64(vl.offset({b}))
                                               : vl.value_as_int64(vl.offset({b, i}));
            if (j >= len) continue;
          }
          if (p.mask) {
            const auto& m = *p.mask;
            const int64_t full[4] = {b, h, i, j};
            std::vector<int64_t> index;
            index.reserve(static_cast<size_t>(m.rank()));
            for (int d = 0; d < m.rank(); ++d) {
              index.push_back(full[4 - m.rank() + d] % m.shape()[static_cast<size_t>(d)]);
            }
            const double value = m.value_as_double(m.offset(index));
            if (m.dtype() == NpyDtype::F32 ? value == -HUGE_VAL : value == 0) continue;
          }
          ++pairs;
        }
  return pairs;
}

TEST(MhaRun, PairsOfTheStandardShapes) {
  // S5, the d2l example: valid lengths [3, 2] over 5 heads and 4 queries.
  Problem d2l{2, 5, 4, 6, 20, 20, MHA_CAUSAL_NONE, NpyArray(NpyDtype::I64, {2}), {}};
  d2l.valid_lens->set_from_double(0, 3);
  d2l.valid_lens->set_from_double(1, 2);
  AttentionCall call = call_of(d2l);
  EXPECT_EQ(mha_tools::count_attention_pairs(call), 5 * 4 * (3 + 2));
  EXPECT_DOUBLE_EQ(mha_tools::attention_flops(call), 4.0 * 20 * 100);

  // S2: causal with Lq = Lk counts Lq (Lq + 1) / 2 per head.
  Problem s2{1, 32, 2048, 2048, 128, 128, MHA_CAUSAL_TOP_LEFT, {}, {}};
  EXPECT_EQ(mha_tools::count_attention_pairs(call_of(s2)), 32 * 2048 * 2049 / 2);
  s2.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  EXPECT_EQ(mha_tools::count_attention_pairs(call_of(s2)), 32 * 2048 * 2049 / 2);

  // S3: one query over 4096 keys; bottom-right causal keeps them all, top-left keeps one.
  Problem s3{1, 32, 1, 4096, 128, 128, MHA_CAUSAL_BOTTOM_RIGHT, {}, {}};
  EXPECT_EQ(mha_tools::count_attention_pairs(call_of(s3)), 32 * 4096);
  s3.causal = MHA_CAUSAL_TOP_LEFT;
  EXPECT_EQ(mha_tools::count_attention_pairs(call_of(s3)), 32);

  // D != Dv: 2 (D + Dv) per pair.
  Problem s{1, 1, 2, 3, 8, 4, MHA_CAUSAL_NONE, {}, {}};
  EXPECT_DOUBLE_EQ(mha_tools::attention_flops(call_of(s)), 2.0 * (8 + 4) * 6);
}

TEST(MhaRun, PairsMatchBruteForce) {
  std::mt19937_64 rng(12345);
  const auto pick = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 400; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    Problem p{
        pick(1, 3), pick(1, 4), pick(1, 7), pick(1, 9), 4, 4, static_cast<int32_t>(pick(0, 2)),
        {},         {}};
    const int64_t vl_kind = pick(0, 2);  // none, [B], [B, Lq]
    if (vl_kind > 0) {
      std::vector<int64_t> shape = {p.batch};
      if (vl_kind == 2) shape.push_back(p.lq);
      p.valid_lens = NpyArray(pick(0, 1) ? NpyDtype::I64 : NpyDtype::I32, shape, pick(0, 1) == 1);
      for (int64_t e = 0; e < p.valid_lens->size(); ++e) {
        p.valid_lens->set_from_double(e, static_cast<double>(pick(0, p.lk)));
      }
    }
    const int64_t mask_kind = pick(0, 3);  // none, bool, u1-as-bool, float
    if (mask_kind > 0) {
      const int64_t full[4] = {p.batch, p.heads, p.lq, p.lk};
      const int rank = static_cast<int>(pick(2, 4));
      std::vector<int64_t> shape;
      for (int d = 4 - rank; d < 4; ++d) shape.push_back(pick(0, 2) == 0 ? 1 : full[d]);
      const NpyDtype dtype =
          mask_kind == 1 ? NpyDtype::Bool : (mask_kind == 2 ? NpyDtype::U8 : NpyDtype::F32);
      p.mask = NpyArray(dtype, shape, pick(0, 1) == 1);
      for (int64_t e = 0; e < p.mask->size(); ++e) {
        const bool keep = pick(0, 3) != 0;
        double value = keep ? static_cast<double>(pick(1, 9)) : 0.0;
        if (dtype == NpyDtype::F32) value = keep ? static_cast<double>(pick(-5, 5)) : -HUGE_VAL;
        p.mask->set_from_double(e, value);
      }
    }
    EXPECT_EQ(mha_tools::count_attention_pairs(call_of(p)), brute_force_pairs(p));
  }
}

// A packed batch: each sequence's pairs with its own lengths (the causal
// rule, the window), against brute force from the definitions.
TEST(MhaRun, PackedPairsMatchBruteForce) {
  std::mt19937_64 rng(777);
  const auto pick = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int64_t batch = pick(1, 5), heads = pick(1, 4);
    std::vector<int32_t> cu_q = {0}, cu_k = {0};
    for (int64_t b = 0; b < batch; ++b) {
      cu_q.push_back(cu_q.back() + static_cast<int32_t>(pick(0, 9)));
      cu_k.push_back(cu_k.back() + static_cast<int32_t>(pick(0, 9)));
    }
    AttentionCall call;
    call.q.ndim = call.k.ndim = call.v.ndim = 3;
    call.q.shape[0] = cu_q.back();
    call.q.shape[1] = heads;
    call.q.shape[2] = 8;
    call.v.shape[2] = 4;
    call.causal = static_cast<int32_t>(pick(0, 2));
    call.window_left = pick(0, 2) == 0 ? -1 : pick(0, 6);
    call.window_right = pick(0, 2) == 0 ? -1 : pick(0, 6);
    mha_tensor tq{}, tk{};
    const int64_t n = batch + 1;
    ASSERT_EQ(mha_tensor_init(&tq, cu_q.data(), MHA_DTYPE_I32, 1, &n, nullptr), MHA_OK);
    ASSERT_EQ(mha_tensor_init(&tk, cu_k.data(), MHA_DTYPE_I32, 1, &n, nullptr), MHA_OK);
    call.cu_seqlens_q = tq;
    call.cu_seqlens_k = tk;
    int64_t pairs = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t lq = cu_q[b + 1] - cu_q[b], lk = cu_k[b + 1] - cu_k[b];
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) {
          const int64_t diagonal = i + lk - lq;  // bottom-right: the window's too
          if (call.causal == MHA_CAUSAL_TOP_LEFT && j > i) continue;
          if (call.causal == MHA_CAUSAL_BOTTOM_RIGHT && j > diagonal) continue;
          if (call.window_left >= 0 && j < diagonal - call.window_left) continue;
          if (call.window_right >= 0 && j > diagonal + call.window_right) continue;
          ++pairs;
        }
    }
    EXPECT_EQ(mha_tools::count_attention_pairs(call), heads * pairs);
    EXPECT_DOUBLE_EQ(mha_tools::attention_flops(call),
                     2.0 * (8 + 4) * static_cast<double>(heads * pairs));
  }
}

TEST(MhaRun, TimingLine) {
  const std::string line = mha_tools::timing_json({2.0, 1.5}, 8000.0);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  const auto j = nlohmann::json::parse(line);
  ASSERT_TRUE(j.is_object());
  EXPECT_TRUE(j.at("backend").is_string());
  EXPECT_TRUE(j.at("threads").is_number_integer());
  EXPECT_DOUBLE_EQ(j.at("median_ms").get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(j.at("min_ms").get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(j.at("gflops").get<double>(), 8000.0 / 2e6);
  EXPECT_EQ(j.size(), 5u);
  EXPECT_EQ(line.rfind("{\"backend\":", 0), 0u) << line;

  // Half precision adds the dtypes, after the figures.
  const std::string half =
      mha_tools::timing_json({2.0, 1.5}, 8000.0, {MHA_DTYPE_BF16, MHA_DTYPE_I8});
  const auto h = nlohmann::json::parse(half);
  EXPECT_EQ(h.size(), 7u);
  EXPECT_EQ(h.at("dtype"), "bf16");
  EXPECT_EQ(h.at("kv_dtype"), "i8");
  EXPECT_EQ(half.rfind(line.substr(0, line.size() - 1) + ",\"dtype\":", 0), 0u) << half;
  EXPECT_EQ(mha_tools::timing_json({2.0, 1.5}, 8000.0, {MHA_DTYPE_F32, MHA_DTYPE_F16})
                .find("\"dtype\":\"f32\",\"kv_dtype\":\"f16\"}"),
            line.size());  // after the figures and a comma
}

TEST(MhaRun, DtypeFlags) {
  using mha_tools::parse_dtype_flag;
  EXPECT_EQ(parse_dtype_flag("f32", false), MHA_DTYPE_F32);
  EXPECT_EQ(parse_dtype_flag("bf16", false), MHA_DTYPE_BF16);
  EXPECT_EQ(parse_dtype_flag("f16", false), MHA_DTYPE_F16);
  EXPECT_EQ(parse_dtype_flag("fp16", false), MHA_DTYPE_F16);
  EXPECT_EQ(parse_dtype_flag("float32", false), MHA_DTYPE_F32);
  EXPECT_EQ(parse_dtype_flag("bfloat16", true), MHA_DTYPE_BF16);
  EXPECT_EQ(parse_dtype_flag("i8", true), MHA_DTYPE_I8);
  EXPECT_FALSE(parse_dtype_flag("i8", false));  // Q cannot be int8
  EXPECT_FALSE(parse_dtype_flag("F16", false));
  EXPECT_FALSE(parse_dtype_flag("", true));
  EXPECT_FALSE(parse_dtype_flag("f64", true));
  for (const mha_dtype d : {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16, MHA_DTYPE_I8}) {
    EXPECT_EQ(parse_dtype_flag(mha_types::dtype_name(d), true), d);
  }

  // Defaults: f16 for a float16 Q file, f32 otherwise; K and V follow.
  AttentionOptions o;
  auto d = mha_tools::resolve_dtypes(o, NpyDtype::F32);
  EXPECT_EQ(d.q, MHA_DTYPE_F32);
  EXPECT_EQ(d.kv, MHA_DTYPE_F32);
  d = mha_tools::resolve_dtypes(o, NpyDtype::F16);
  EXPECT_EQ(d.q, MHA_DTYPE_F16);
  EXPECT_EQ(d.kv, MHA_DTYPE_F16);
  o.kv_dtype = MHA_DTYPE_I8;
  d = mha_tools::resolve_dtypes(o, NpyDtype::F64);
  EXPECT_EQ(d.q, MHA_DTYPE_F32);
  EXPECT_EQ(d.kv, MHA_DTYPE_I8);
  o.dtype = MHA_DTYPE_BF16;
  o.kv_dtype.reset();
  d = mha_tools::resolve_dtypes(o, NpyDtype::F16);
  EXPECT_EQ(d.q, MHA_DTYPE_BF16);
  EXPECT_EQ(d.kv, MHA_DTYPE_BF16);
}

// Conversions on load keep the file's layout (Fortran order too), round once
// (from float64 as well) and refuse a finite value that does not fit.
TEST(MhaRun, ConvertFloatInput) {
  NpyArray f64(NpyDtype::F64, {2, 3}, true);
  for (int64_t i = 0; i < f64.size(); ++i) f64.set_from_double(i, 1.0 + static_cast<double>(i));
  f64.set_from_double(1, 1.0 + 0x1p-8 + 0x1p-40);  // float32 first would make it a tie
  const mha_tools::TypedInput b = mha_tools::convert_float_input(f64, MHA_DTYPE_BF16, "x");
  EXPECT_EQ(b.dtype, MHA_DTYPE_BF16);
  EXPECT_EQ(b.shape, f64.shape());
  EXPECT_EQ(b.strides, f64.strides());
  EXPECT_FALSE(b.file);
  const auto* bits = static_cast<const uint16_t*>(b.data());
  EXPECT_EQ(bits[0], 0x3F80u);  // 1
  EXPECT_EQ(bits[1], 0x3F81u);  // above the tie: up
  EXPECT_EQ(bits[5], 0x40C0u);  // 6

  NpyArray f32(NpyDtype::F32, {4});
  f32.set_from_double(0, -HUGE_VAL);  // infinities and NaN pass
  f32.set_from_double(1, std::nan(""));
  f32.set_from_double(2, 65504);
  f32.set_from_double(3, 1e-9);  // underflows to 0: no refusal
  const mha_tools::TypedInput h = mha_tools::convert_float_input(f32, MHA_DTYPE_F16, "x");
  const auto* hb = static_cast<const uint16_t*>(h.data());
  EXPECT_EQ(hb[0], 0xFC00u);
  EXPECT_EQ(hb[1] & 0x7E00u, 0x7E00u);
  EXPECT_EQ(hb[2], 0x7BFFu);
  EXPECT_EQ(hb[3], 0u);
  // The same dtype is kept as read, without a copy.
  EXPECT_TRUE(mha_tools::convert_float_input(f32, MHA_DTYPE_F32, "x").file);

  f32.set_from_double(2, 70000);
  try {
    (void)mha_tools::convert_float_input(f32, MHA_DTYPE_F16, "--q q.npy", " (a hint)");
    ADD_FAILURE() << "70000 does not fit in float16";
  } catch (const mha_tools::ToolError& e) {
    EXPECT_STREQ(e.what(),
                 "--q q.npy: float32 value 70000 does not fit in float16 (largest 65504) (a hint)");
  }
  NpyArray big(NpyDtype::F64, {1});
  big.set_from_double(0, -1e300);
  EXPECT_THROW((void)mha_tools::convert_float_input(big, MHA_DTYPE_BF16, "x"),
               mha_tools::ToolError);
  EXPECT_THROW((void)mha_tools::convert_float_input(big, MHA_DTYPE_F32, "x"), mha_tools::ToolError);
}

TEST(MhaRun, RequiredOptions) {
  AttentionOptions o;
  EXPECT_THROW(mha_tools::check_attention_options(o), mha_tools::ToolError);
  o.q = "q.npy";
  o.k = "k.npy";
  o.v = "v.npy";
  EXPECT_THROW(mha_tools::check_attention_options(o), mha_tools::ToolError);  // --out
  o.repeat = 3;
  EXPECT_NO_THROW(mha_tools::check_attention_options(o));
  o.repeat = 0;
  o.out = "o.npy";
  EXPECT_NO_THROW(mha_tools::check_attention_options(o));
}

// ---------------------------------------------------------------- the command

class MhaRunCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "mha_run_test_" + std::to_string(::getpid()) + "_";
    write("q", NpyArray(NpyDtype::F32, {1, 2, 3, 4}), 0.1);
    write("k", NpyArray(NpyDtype::F32, {1, 1, 5, 4}), 0.2);
    write("v", NpyArray(NpyDtype::F32, {1, 1, 5, 3}), 0.3);
    write("k_bad_d", NpyArray(NpyDtype::F32, {1, 1, 5, 6}), 0.2);
    write("q_f64", NpyArray(NpyDtype::F64, {1, 2, 3, 4}), 0.1);
    write("q_rank3", NpyArray(NpyDtype::F32, {2, 3, 4}), 0.1);
    write("q_rank2", NpyArray(NpyDtype::F32, {3, 4}), 0.1);
    write("q_i32", NpyArray(NpyDtype::I32, {1, 2, 3, 4}), 1);
    write("q_empty", NpyArray(NpyDtype::F32, {1, 0, 3, 4}), 0.1);
    write("vl_f32", NpyArray(NpyDtype::F32, {1}), 2);
    write("vl_too_long", NpyArray(NpyDtype::I32, {1}), 0, 6);  // Lk is 5
    write("mask_i64", NpyArray(NpyDtype::I64, {3, 5}), 1);
    write("mask_rank5", NpyArray(NpyDtype::Bool, {1, 1, 1, 3, 5}), 1);
    write("mask_f32", NpyArray(NpyDtype::F32, {3, 5}), 0.7, -1);
    NpyArray k_nan(NpyDtype::F32, {1, 1, 5, 4});
    k_nan.set_from_double(7, std::nan(""));
    mha_tools::write_npy(path("k_nan"), k_nan);
    written_.push_back(path("k_nan"));
    write("q_big", NpyArray(NpyDtype::F32, {1, 2, 3, 4}), 0, 1e5);
    o_.q = path("q");
    o_.k = path("k");
    o_.v = path("v");
    o_.out = path("out");
    o_.lse = path("lse");
  }
  void TearDown() override {
    for (const auto& p : written_) std::remove(p.c_str());
    std::remove(path("out").c_str());
    std::remove(path("lse").c_str());
  }
  std::string path(const std::string& name) const { return dir_ + name + ".npy"; }
  // Element i holds offset + (step * i mod 3).
  void write(const std::string& name, NpyArray a, double step, double offset = 0) {
    for (int64_t i = 0; i < a.size(); ++i) {
      a.set_from_double(i, offset + std::fmod(step * static_cast<double>(i), 3.0));
    }
    mha_tools::write_npy(path(name), a);
    written_.push_back(path(name));
  }

  std::string dir_;
  std::vector<std::string> written_;
  AttentionOptions o_;
};

TEST_F(MhaRunCommand, Succeeds) {
  ASSERT_EQ(mha_tools::run_attention_command(o_), 0);
  const NpyArray out = mha_tools::read_npy(path("out"));
  EXPECT_EQ(out.shape(), (std::vector<int64_t>{1, 2, 3, 3}));
  EXPECT_EQ(out.dtype(), NpyDtype::F32);
  const NpyArray lse = mha_tools::read_npy(path("lse"));
  EXPECT_EQ(lse.shape(), (std::vector<int64_t>{1, 2, 3}));
}

// Every dtype combination runs and writes a float32 output of the same shape.
TEST_F(MhaRunCommand, HalfPrecision) {
  for (const mha_dtype q : {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    for (const mha_dtype kv : {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16, MHA_DTYPE_I8}) {
      SCOPED_TRACE(std::string(mha_types::dtype_name(q)) + " " + mha_types::dtype_name(kv));
      AttentionOptions o = o_;
      o.dtype = q;
      o.kv_dtype = kv;
      o.mask = path("mask_f32");
      ASSERT_EQ(mha_tools::run_attention_command(o), 0);
      const NpyArray out = mha_tools::read_npy(path("out"));
      EXPECT_EQ(out.shape(), (std::vector<int64_t>{1, 2, 3, 3}));
      EXPECT_EQ(out.dtype(), NpyDtype::F32);
      EXPECT_EQ(mha_tools::read_npy(path("lse")).dtype(), NpyDtype::F32);
    }
  }
}

TEST_F(MhaRunCommand, FailuresReturnOne) {
  const auto fails = [this](const char* what, auto change, int status = 1) {
    AttentionOptions o = o_;
    change(o);
    ::testing::internal::CaptureStderr();
    const int rc = mha_tools::run_attention_command(o);
    std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(rc, status) << what;
    EXPECT_EQ(err.rfind("mha-run: ", 0), 0u) << what << ": " << err;
    EXPECT_EQ(err.find('\n'), err.size() - 1) << what << ": " << err;
    return err;
  };
  EXPECT_NE(fails("missing", [&](AttentionOptions& o) { o.q = path("nope"); }).find("--q "),
            std::string::npos);
  EXPECT_NE(fails("dtype", [&](AttentionOptions& o) { o.q = path("q_i32"); }).find("float32"),
            std::string::npos);
  // Q of rank 3 with K and V of rank 4.
  EXPECT_NE(fails("rank", [&](AttentionOptions& o) { o.q = path("q_rank3"); }).find("all rank 3"),
            std::string::npos);
  fails("rank 2", [&](AttentionOptions& o) { o.q = path("q_rank2"); });
  EXPECT_NE(fails("empty", [&](AttentionOptions& o) { o.q = path("q_empty"); }).find("shape[1]"),
            std::string::npos);
  EXPECT_NE(fails("shape", [&](AttentionOptions& o) { o.k = path("k_bad_d"); })
                .find("MHA_ERR_SHAPE_MISMATCH"),
            std::string::npos);
  fails("vl dtype", [&](AttentionOptions& o) { o.valid_lens = path("vl_f32"); });
  EXPECT_NE(fails("vl value", [&](AttentionOptions& o) { o.valid_lens = path("vl_too_long"); })
                .find("MHA_ERR_INVALID_VALUE"),
            std::string::npos);
  fails("mask dtype", [&](AttentionOptions& o) { o.mask = path("mask_i64"); });
  fails("mask rank", [&](AttentionOptions& o) { o.mask = path("mask_rank5"); });
  fails("not npy", [&](AttentionOptions& o) { o.mask = dir_ + "none"; });
  EXPECT_NE(fails("backend", [](AttentionOptions& o) { o.backend = "nonsense"; }).find("scalar"),
            std::string::npos);
  fails("threads", [](AttentionOptions& o) { o.threads = -1; });
  EXPECT_NE(fails("i8 NaN",
                  [&](AttentionOptions& o) {
                    o.k = path("k_nan");
                    o.kv_dtype = MHA_DTYPE_I8;
                  })
                .find("mha_quantize_kv failed (MHA_ERR_INVALID_VALUE)"),
            std::string::npos);
  EXPECT_NE(fails("f16 overflow",
                  [&](AttentionOptions& o) {
                    o.q = path("q_big");
                    o.dtype = MHA_DTYPE_F16;
                  })
                .find("does not fit in float16"),
            std::string::npos);
  fails("scale", [](AttentionOptions& o) { o.scale = 0.0; });
  fails("scale inf", [](AttentionOptions& o) { o.scale = HUGE_VAL; });
  fails("out dir", [&](AttentionOptions& o) { o.out = dir_ + "no/such/dir/out.npy"; });
  // The command line is wrong: 2.
  fails(
      "nothing", [](AttentionOptions& o) { o = AttentionOptions(); }, 2);
  fails(
      "same output", [&](AttentionOptions& o) { o.lse = o.out; }, 2);
  fails(
      "output is input", [&](AttentionOptions& o) { o.out = o.k; }, 2);
}

}  // namespace
