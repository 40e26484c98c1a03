// Bad input: each call returns the most specific status code, names the
// argument at fault in mha_last_error(), and leaves out (and lse) untouched.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace mha_test {
namespace {

// True when `name` occurs in `message` as a whole word (not inside another
// identifier), e.g. "q" in "q->data is NULL" but not in "query".
bool mentions(const std::string& message, const std::string& name) {
  auto is_ident = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  for (size_t at = message.find(name); at != std::string::npos; at = message.find(name, at + 1)) {
    const bool left = at == 0 || !is_ident(message[at - 1]);
    const bool right = at + name.size() == message.size() || !is_ident(message[at + name.size()]);
    if (left && right) return true;
  }
  return false;
}

TEST(Mentions, IsWholeWord) {
  EXPECT_TRUE(mentions("q->data is NULL", "q"));
  EXPECT_TRUE(mentions("params->scale = 0", "scale"));
  EXPECT_FALSE(mentions("query length", "q"));
  EXPECT_FALSE(mentions("valid_lens", "lens"));
}

// A valid problem whose pieces each case breaks in one way.  Buffers are far
// larger than the shapes need, so a runtime that failed to validate would
// still not read or write outside them (the check would fail, not crash).
struct Problem {
  static constexpr int64_t B = 2, H = 4, Hkv = 2, Lq = 3, Lk = 5, D = 8, Dv = 6;
  static constexpr int64_t kSlack = 8;

  std::vector<float> qb, kb, vb, outb, lseb, mask_f32;
  std::vector<uint8_t> mask_bool;
  std::vector<int32_t> lens32;
  std::vector<int64_t> lens64;
  mha_tensor q{}, k{}, v{}, out{}, lse{}, mask{}, lens{};
  mha_tensor *qp = &q, *kp = &k, *vp = &v, *outp = &out;
  mha_attention_params params{};
  bool pass_params = true;

  Problem()
      : qb(static_cast<size_t>(kSlack * B * H * Lq * D)),
        kb(static_cast<size_t>(kSlack * B * Hkv * Lk * D)),
        vb(static_cast<size_t>(kSlack * B * Hkv * Lk * Dv)),
        outb(static_cast<size_t>(kSlack * B * H * Lq * Dv), Arena::sentinel()),
        lseb(static_cast<size_t>(kSlack * B * H * Lq), Arena::sentinel()),
        mask_f32(static_cast<size_t>(kSlack * B * H * Lq * Lk), 0.0f),
        mask_bool(static_cast<size_t>(kSlack * B * H * Lq * Lk), 1),
        lens32(static_cast<size_t>(kSlack * B * Lq), static_cast<int32_t>(Lk)),
        lens64(static_cast<size_t>(kSlack * B * Lq), Lk) {
    Rng rng(3);
    for (auto* buf : {&qb, &kb, &vb})
      for (auto& x : *buf) x = rng.uniform();
    q = describe(qb.data(), MHA_DTYPE_F32, {B, H, Lq, D});
    k = describe(kb.data(), MHA_DTYPE_F32, {B, Hkv, Lk, D});
    v = describe(vb.data(), MHA_DTYPE_F32, {B, Hkv, Lk, Dv});
    out = describe(outb.data(), MHA_DTYPE_F32, {B, H, Lq, Dv});
    lse = describe(lseb.data(), MHA_DTYPE_F32, {B, H, Lq});
    mask = describe(mask_bool.data(), MHA_DTYPE_BOOL, {B, 1, Lq, Lk});
    lens32[0] = 5, lens32[1] = 3;
    lens = describe(lens32.data(), MHA_DTYPE_I32, {B});
    mha_attention_params_init(&params);
    params.valid_lens = &lens;
    params.mask = &mask;
    params.lse = &lse;
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  mha_status call() { return mha_attention(qp, kp, vp, outp, pass_params ? &params : nullptr); }
};

struct BadCase {
  std::string what;
  std::function<void(Problem&)> breaks;
  mha_status expected;
  std::vector<std::string> names;  // the message must mention one of these
};

void expect_failure(const BadCase& bad) {
  SCOPED_TRACE(bad.what);
  Problem p;
  bad.breaks(p);
  const std::vector<float> out_before = p.outb, lse_before = p.lseb;
  const mha_status status = p.call();
  const std::string message = mha_last_error();
  EXPECT_EQ(status, bad.expected) << "got " << mha_status_name(status) << " (want "
                                  << mha_status_name(bad.expected) << "): " << message;
  EXPECT_FALSE(message.empty());
  bool named = bad.names.empty();
  for (const auto& name : bad.names) named = named || mentions(message, name);
  std::string wanted;
  for (const auto& name : bad.names) wanted += " '" + name + "'";
  EXPECT_TRUE(named) << "message \"" << message << "\" names none of" << wanted;
  EXPECT_EQ(0, std::memcmp(out_before.data(), p.outb.data(), out_before.size() * sizeof(float)))
      << "a failed call modified out";
  EXPECT_EQ(0, std::memcmp(lse_before.data(), p.lseb.data(), lse_before.size() * sizeof(float)))
      << "a failed call modified lse";
}

void expect_failures(const std::vector<BadCase>& cases) {
  for (const auto& bad : cases) expect_failure(bad);
}

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    // The unbroken problem must succeed, or every failure below proves nothing.
    Problem p;
    ASSERT_EQ(p.call(), MHA_OK) << mha_last_error();
    for (size_t i = 0; i < static_cast<size_t>(Problem::B * Problem::H * Problem::Lq * Problem::Dv);
         ++i) {
      ASSERT_TRUE(std::isfinite(p.outb[i])) << "the valid problem left out[" << i << "] unwritten";
    }
  }
};

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST_F(BadInput, NullPointers) {
  expect_failures({
      {"q NULL", [](Problem& p) { p.qp = nullptr; }, MHA_ERR_NULL_POINTER, {"q"}},
      {"k NULL", [](Problem& p) { p.kp = nullptr; }, MHA_ERR_NULL_POINTER, {"k"}},
      {"v NULL", [](Problem& p) { p.vp = nullptr; }, MHA_ERR_NULL_POINTER, {"v"}},
      {"out NULL", [](Problem& p) { p.outp = nullptr; }, MHA_ERR_NULL_POINTER, {"out"}},
      {"q->data NULL", [](Problem& p) { p.q.data = nullptr; }, MHA_ERR_NULL_POINTER, {"q"}},
      {"k->data NULL", [](Problem& p) { p.k.data = nullptr; }, MHA_ERR_NULL_POINTER, {"k"}},
      {"v->data NULL", [](Problem& p) { p.v.data = nullptr; }, MHA_ERR_NULL_POINTER, {"v"}},
      {"out->data NULL", [](Problem& p) { p.out.data = nullptr; }, MHA_ERR_NULL_POINTER, {"out"}},
      {"mask->data NULL",
       [](Problem& p) { p.mask.data = nullptr; },
       MHA_ERR_NULL_POINTER,
       {"mask"}},
      {"valid_lens->data NULL",
       [](Problem& p) { p.lens.data = nullptr; },
       MHA_ERR_NULL_POINTER,
       {"valid_lens"}},
      {"lse->data NULL", [](Problem& p) { p.lse.data = nullptr; }, MHA_ERR_NULL_POINTER, {"lse"}},
  });
}

TEST_F(BadInput, NonPositiveSizes) {
  expect_failures({
      {"B = 0",
       [](Problem& p) { p.q.shape[0] = p.k.shape[0] = p.v.shape[0] = p.out.shape[0] = 0; },
       MHA_ERR_INVALID_SIZE,
       {"q", "k", "v", "out"}},
      {"B = -1",
       [](Problem& p) { p.q.shape[0] = p.k.shape[0] = p.v.shape[0] = p.out.shape[0] = -1; },
       MHA_ERR_INVALID_SIZE,
       {"q", "k", "v", "out"}},
      {"H = 0",
       [](Problem& p) { p.q.shape[1] = p.out.shape[1] = 0; },
       MHA_ERR_INVALID_SIZE,
       {"q", "out"}},
      {"Hkv = 0",
       [](Problem& p) { p.k.shape[1] = p.v.shape[1] = 0; },
       MHA_ERR_INVALID_SIZE,
       {"k", "v"}},
      {"Lq = 0",
       [](Problem& p) { p.q.shape[2] = p.out.shape[2] = 0; },
       MHA_ERR_INVALID_SIZE,
       {"q", "out"}},
      {"Lk = 0",
       [](Problem& p) { p.k.shape[2] = p.v.shape[2] = 0; },
       MHA_ERR_INVALID_SIZE,
       {"k", "v"}},
      // Empty arrays of PyTorch and NumPy may have no memory at all: the size is
      // what is wrong, not the pointer.
      {"Lk = 0, data NULL",
       [](Problem& p) {
         p.k.shape[2] = p.v.shape[2] = 0;
         p.k.data = p.v.data = nullptr;
       },
       MHA_ERR_INVALID_SIZE,
       {"k", "v"}},
      {"Lk = -5",
       [](Problem& p) { p.k.shape[2] = p.v.shape[2] = -5; },
       MHA_ERR_INVALID_SIZE,
       {"k", "v"}},
      {"D = 0",
       [](Problem& p) { p.q.shape[3] = p.k.shape[3] = 0; },
       MHA_ERR_INVALID_SIZE,
       {"q", "k"}},
      {"Dv = 0",
       [](Problem& p) { p.v.shape[3] = p.out.shape[3] = 0; },
       MHA_ERR_INVALID_SIZE,
       {"v", "out"}},
      {"Dv = -1",
       [](Problem& p) { p.v.shape[3] = p.out.shape[3] = -1; },
       MHA_ERR_INVALID_SIZE,
       {"v", "out"}},
      {"mask size 0", [](Problem& p) { p.mask.shape[3] = 0; }, MHA_ERR_INVALID_SIZE, {"mask"}},
      {"valid_lens size 0",
       [](Problem& p) { p.lens.shape[0] = 0; },
       MHA_ERR_INVALID_SIZE,
       {"valid_lens"}},
      {"lse size 0", [](Problem& p) { p.lse.shape[2] = 0; }, MHA_ERR_INVALID_SIZE, {"lse"}},
  });
}

TEST_F(BadInput, WrongRank) {
  expect_failures({
      {"q 3-D", [](Problem& p) { p.q.ndim = 3; }, MHA_ERR_INVALID_SIZE, {"q"}},
      {"q 0-D", [](Problem& p) { p.q.ndim = 0; }, MHA_ERR_INVALID_SIZE, {"q"}},
      {"q 5-D", [](Problem& p) { p.q.ndim = 5; }, MHA_ERR_INVALID_SIZE, {"q"}},
      {"k 3-D", [](Problem& p) { p.k.ndim = 3; }, MHA_ERR_INVALID_SIZE, {"k"}},
      {"v 2-D", [](Problem& p) { p.v.ndim = 2; }, MHA_ERR_INVALID_SIZE, {"v"}},
      {"out -1-D", [](Problem& p) { p.out.ndim = -1; }, MHA_ERR_INVALID_SIZE, {"out"}},
      {"mask 1-D", [](Problem& p) { p.mask.ndim = 1; }, MHA_ERR_INVALID_SIZE, {"mask"}},
      {"mask 5-D", [](Problem& p) { p.mask.ndim = 5; }, MHA_ERR_INVALID_SIZE, {"mask"}},
      {"valid_lens 3-D",
       [](Problem& p) {
         p.lens = describe(p.lens32.data(), MHA_DTYPE_I32, {Problem::B, Problem::Lq, 1});
       },
       MHA_ERR_INVALID_SIZE,
       {"valid_lens"}},
      {"valid_lens 0-D", [](Problem& p) { p.lens.ndim = 0; }, MHA_ERR_INVALID_SIZE, {"valid_lens"}},
      {"lse 2-D", [](Problem& p) { p.lse.ndim = 2; }, MHA_ERR_INVALID_SIZE, {"lse"}},
      {"lse 4-D",
       [](Problem& p) {
         p.lse = describe(p.lseb.data(), MHA_DTYPE_F32, {Problem::B, Problem::H, Problem::Lq, 1});
       },
       MHA_ERR_INVALID_SIZE,
       {"lse"}},
  });
}

TEST_F(BadInput, ShapeMismatches) {
  expect_failures({
      {"k batch", [](Problem& p) { p.k.shape[0] = 3; }, MHA_ERR_SHAPE_MISMATCH, {"k"}},
      {"v batch", [](Problem& p) { p.v.shape[0] = 1; }, MHA_ERR_SHAPE_MISMATCH, {"v"}},
      {"out batch", [](Problem& p) { p.out.shape[0] = 1; }, MHA_ERR_SHAPE_MISMATCH, {"out"}},
      {"v heads != k heads",
       [](Problem& p) { p.v.shape[1] = 1; },
       MHA_ERR_SHAPE_MISMATCH,
       {"v", "k"}},
      {"out heads != q heads",
       [](Problem& p) { p.out.shape[1] = 2; },
       MHA_ERR_SHAPE_MISMATCH,
       {"out", "q"}},
      {"H not a multiple of Hkv",
       [](Problem& p) {
         p.k = describe(p.kb.data(), MHA_DTYPE_F32, {Problem::B, 3, Problem::Lk, Problem::D});
         p.v = describe(p.vb.data(), MHA_DTYPE_F32, {Problem::B, 3, Problem::Lk, Problem::Dv});
       },
       MHA_ERR_SHAPE_MISMATCH,
       {"q", "k", "v"}},
      {"Hkv > H",
       [](Problem& p) {
         p.k = describe(p.kb.data(), MHA_DTYPE_F32, {Problem::B, 8, Problem::Lk, Problem::D});
         p.v = describe(p.vb.data(), MHA_DTYPE_F32, {Problem::B, 8, Problem::Lk, Problem::Dv});
       },
       MHA_ERR_SHAPE_MISMATCH,
       {"q", "k", "v"}},
      {"v length != k length",
       [](Problem& p) { p.v.shape[2] = 4; },
       MHA_ERR_SHAPE_MISMATCH,
       {"v", "k"}},
      {"out length != q length",
       [](Problem& p) { p.out.shape[2] = 2; },
       MHA_ERR_SHAPE_MISMATCH,
       {"out", "q"}},
      {"k head size != q head size",
       [](Problem& p) { p.k.shape[3] = 7; },
       MHA_ERR_SHAPE_MISMATCH,
       {"k", "q"}},
      {"out head size != v head size",
       [](Problem& p) { p.out.shape[3] = 5; },
       MHA_ERR_SHAPE_MISMATCH,
       {"out", "v"}},
  });
}

TEST_F(BadInput, Dtypes) {
  std::vector<BadCase> cases;
  // F16 and BF16 are valid for q, k, v and out since 0.2 (test_half.cpp);
  // here each tensor alone changes, so f16/bf16 k (or v) disagrees with v (or
  // k), and f16/bf16 out with f32 q -- refused too.
  for (const int32_t dtype : std::initializer_list<int32_t>{
           0, 2, 3, 7, 99, -1, MHA_DTYPE_BOOL, MHA_DTYPE_I32, MHA_DTYPE_I64, MHA_DTYPE_I8}) {
    const std::string d = std::to_string(dtype);
    if (dtype != MHA_DTYPE_F16 && dtype != MHA_DTYPE_BF16) {
      cases.push_back({"q dtype " + d,
                       [dtype](Problem& p) { p.q.dtype = dtype; },
                       MHA_ERR_INVALID_DTYPE,
                       {"q"}});
    }
    cases.push_back({"k dtype " + std::to_string(dtype),
                     [dtype](Problem& p) { p.k.dtype = dtype; },
                     MHA_ERR_INVALID_DTYPE,
                     {"k"}});
    cases.push_back({"v dtype " + std::to_string(dtype),
                     [dtype](Problem& p) { p.v.dtype = dtype; },
                     MHA_ERR_INVALID_DTYPE,
                     {"v"}});
    cases.push_back({"out dtype " + std::to_string(dtype),
                     [dtype](Problem& p) { p.out.dtype = dtype; },
                     MHA_ERR_INVALID_DTYPE,
                     {"out"}});
    cases.push_back({"lse dtype " + std::to_string(dtype),
                     [dtype](Problem& p) { p.lse.dtype = dtype; },
                     MHA_ERR_INVALID_DTYPE,
                     {"lse"}});
  }
  for (const int32_t dtype :
       std::initializer_list<int32_t>{0, 2, 3, 99, MHA_DTYPE_F32, MHA_DTYPE_BOOL}) {
    cases.push_back({"valid_lens dtype " + std::to_string(dtype),
                     [dtype](Problem& p) { p.lens.dtype = dtype; },
                     MHA_ERR_INVALID_DTYPE,
                     {"valid_lens"}});
  }
  for (const int32_t dtype :
       std::initializer_list<int32_t>{0, 7, 99, MHA_DTYPE_I32, MHA_DTYPE_I64, MHA_DTYPE_I8}) {
    cases.push_back({"mask dtype " + std::to_string(dtype),
                     [dtype](Problem& p) { p.mask.dtype = dtype; },
                     MHA_ERR_INVALID_DTYPE,
                     {"mask"}});
  }
  expect_failures(cases);
}

TEST_F(BadInput, ValidLens) {
  expect_failures({
      {"valid length -1",
       [](Problem& p) { p.lens32[1] = -1; },
       MHA_ERR_INVALID_VALUE,
       {"valid_lens"}},
      {"valid length Lk + 1",
       [](Problem& p) { p.lens32[0] = Problem::Lk + 1; },
       MHA_ERR_INVALID_VALUE,
       {"valid_lens"}},
      {"i64 valid length huge",
       [](Problem& p) {
         p.lens64[0] = 2, p.lens64[1] = int64_t{1} << 40;
         p.lens = describe(p.lens64.data(), MHA_DTYPE_I64, {Problem::B});
       },
       MHA_ERR_INVALID_VALUE,
       {"valid_lens"}},
      {"i64 valid length negative",
       [](Problem& p) {
         p.lens64[0] = -3, p.lens64[1] = 2;
         p.lens = describe(p.lens64.data(), MHA_DTYPE_I64, {Problem::B});
       },
       MHA_ERR_INVALID_VALUE,
       {"valid_lens"}},
      {"per-query valid length out of range",
       [](Problem& p) {
         for (int64_t n = 0; n < Problem::B * Problem::Lq; ++n)
           p.lens32[static_cast<size_t>(n)] = 1;
         p.lens32[4] = Problem::Lk + 1;
         p.lens = describe(p.lens32.data(), MHA_DTYPE_I32, {Problem::B, Problem::Lq});
       },
       MHA_ERR_INVALID_VALUE,
       {"valid_lens"}},
      {"valid_lens [B+1]",
       [](Problem& p) { p.lens.shape[0] = Problem::B + 1; },
       MHA_ERR_SHAPE_MISMATCH,
       {"valid_lens"}},
      {"valid_lens [1]",
       [](Problem& p) { p.lens.shape[0] = 1; },
       MHA_ERR_SHAPE_MISMATCH,
       {"valid_lens"}},
      {"valid_lens [B, Lq+1]",
       [](Problem& p) {
         p.lens = describe(p.lens32.data(), MHA_DTYPE_I32, {Problem::B, Problem::Lq + 1});
       },
       MHA_ERR_SHAPE_MISMATCH,
       {"valid_lens"}},
      {"valid_lens [Lq, B]",
       [](Problem& p) {
         p.lens = describe(p.lens32.data(), MHA_DTYPE_I32, {Problem::Lq, Problem::B});
       },
       MHA_ERR_SHAPE_MISMATCH,
       {"valid_lens"}},
      {"valid_lens negative stride",
       [](Problem& p) {
         p.lens32[1] = 5;  // read backwards from element 1: both values valid
         p.lens = describe(p.lens32.data() + 1, MHA_DTYPE_I32, {Problem::B}, {-1});
       },
       MHA_ERR_INVALID_STRIDES,
       {"valid_lens"}},
  });
}

TEST_F(BadInput, Mask) {
  expect_failures({
      {"mask [Lq+1, Lk]",
       [](Problem& p) {
         p.mask = describe(p.mask_bool.data(), MHA_DTYPE_BOOL, {Problem::Lq + 1, Problem::Lk});
       },
       MHA_ERR_SHAPE_MISMATCH,
       {"mask"}},
      {"mask [Lq, 2]",
       [](Problem& p) {
         p.mask = describe(p.mask_bool.data(), MHA_DTYPE_BOOL, {Problem::Lq, 2});
       },
       MHA_ERR_SHAPE_MISMATCH,
       {"mask"}},
      {"mask [B+1, 1, Lq, Lk]",
       [](Problem& p) { p.mask.shape[0] = Problem::B + 1; },
       MHA_ERR_SHAPE_MISMATCH,
       {"mask"}},
      {"mask [3, Lq, Lk] with H = 4",
       [](Problem& p) {
         p.mask = describe(p.mask_bool.data(), MHA_DTYPE_BOOL, {3, Problem::Lq, Problem::Lk});
       },
       MHA_ERR_SHAPE_MISMATCH,
       {"mask"}},
      {"mask [B, Hkv, Lq, Lk]",
       [](Problem& p) { p.mask.shape[1] = Problem::Hkv; },
       MHA_ERR_SHAPE_MISMATCH,
       {"mask"}},
      {"f32 mask [Lk, Lq]",
       [](Problem& p) {
         p.mask = describe(p.mask_f32.data(), MHA_DTYPE_F32, {Problem::Lk, Problem::Lq});
       },
       MHA_ERR_SHAPE_MISMATCH,
       {"mask"}},
      {"mask negative stride",
       [](Problem& p) { p.mask.strides[3] = -1; },
       MHA_ERR_INVALID_STRIDES,
       {"mask"}},
  });
}

TEST_F(BadInput, ParamValues) {
  std::vector<BadCase> cases;
  for (const float scale : {0.0f, -0.0f, kNaN, kInf, -kInf}) {
    cases.push_back({"scale " + std::to_string(scale),
                     [scale](Problem& p) {
                       p.params.has_scale = 1;
                       p.params.scale = scale;
                     },
                     MHA_ERR_INVALID_VALUE,
                     {"scale"}});
  }
  for (const int32_t causal : {3, -1, 99}) {
    cases.push_back({"causal " + std::to_string(causal),
                     [causal](Problem& p) { p.params.causal = causal; },
                     MHA_ERR_INVALID_VALUE,
                     {"causal"}});
  }
  for (const uint32_t size : {0u, 12345u, static_cast<uint32_t>(sizeof(mha_attention_params) - 4),
                              static_cast<uint32_t>(sizeof(mha_attention_params) + 8)}) {
    cases.push_back({"struct_size " + std::to_string(size),
                     [size](Problem& p) { p.params.struct_size = size; },
                     MHA_ERR_INVALID_PARAMS,
                     {"params", "struct_size"}});
  }
  expect_failures(cases);
}

TEST_F(BadInput, ScaleIsIgnoredWithoutHasScale) {
  // has_scale = 0: the default applies, whatever scale holds.
  for (const float scale : {0.0f, kNaN, kInf}) {
    Problem p;
    p.params.has_scale = 0;
    p.params.scale = scale;
    EXPECT_EQ(p.call(), MHA_OK) << mha_last_error();
  }
}

TEST_F(BadInput, Strides) {
  expect_failures({
      {"q negative stride",
       [](Problem& p) { p.q.strides[2] = -Problem::D; },
       MHA_ERR_INVALID_STRIDES,
       {"q"}},
      {"k negative stride",
       [](Problem& p) { p.k.strides[3] = -1; },
       MHA_ERR_INVALID_STRIDES,
       {"k"}},
      {"v negative stride",
       [](Problem& p) { p.v.strides[0] = -1; },
       MHA_ERR_INVALID_STRIDES,
       {"v"}},
      {"out negative stride",
       [](Problem& p) { p.out.strides[1] = -3; },
       MHA_ERR_INVALID_STRIDES,
       {"out"}},
      {"lse negative stride",
       [](Problem& p) { p.lse.strides[2] = -1; },
       MHA_ERR_INVALID_STRIDES,
       {"lse"}},
  });
}

TEST_F(BadInput, SizeOverflow) {
  expect_failures({
      {"q reaches past 2^63 elements",
       [](Problem& p) {
         p.params.mask = nullptr, p.params.lse = nullptr;  // they would disagree in Lq
         p.q.shape[2] = p.out.shape[2] = std::numeric_limits<int64_t>::max() / 2;
       },
       MHA_ERR_SIZE_OVERFLOW,
       {"q", "out"}},
      {"k stride overflows",
       [](Problem& p) { p.k.strides[0] = std::numeric_limits<int64_t>::max(); },
       MHA_ERR_SIZE_OVERFLOW,
       {"k"}},
  });
}

TEST_F(BadInput, Overlap) {
  constexpr int64_t out_elems = Problem::B * Problem::H * Problem::Lq * Problem::Dv;
  expect_failures({
      {"out == q", [](Problem& p) { p.out.data = p.qb.data(); }, MHA_ERR_OVERLAP, {"out"}},
      {"out starts on q's last element",
       [](Problem& p) {
         p.out.data = p.qb.data() + Problem::B * Problem::H * Problem::Lq * Problem::D - 1;
       },
       MHA_ERR_OVERLAP,
       {"out"}},
      {"out ends on q's first element",
       [](Problem& p) {
         // q moves into out's buffer, after all but the last element of out.
         p.q.data = p.outb.data() + out_elems - 1;
       },
       MHA_ERR_OVERLAP,
       {"out"}},
      {"out == k", [](Problem& p) { p.out.data = p.kb.data() + 3; }, MHA_ERR_OVERLAP, {"out"}},
      {"out == v", [](Problem& p) { p.out.data = p.vb.data(); }, MHA_ERR_OVERLAP, {"out"}},
      {"out over the mask",
       [](Problem& p) { p.mask.data = p.outb.data(); },
       MHA_ERR_OVERLAP,
       {"out"}},
      {"out over valid_lens",
       [](Problem& p) {
         const int32_t three = 3;  // valid values, so only the overlap is wrong
         std::memcpy(&p.outb[5], &three, sizeof three);
         std::memcpy(&p.outb[6], &three, sizeof three);
         p.lens.data = p.outb.data() + 5;
       },
       MHA_ERR_OVERLAP,
       {"out"}},
      {"lse inside out",
       [](Problem& p) { p.lse.data = p.outb.data() + 10; },
       MHA_ERR_OVERLAP,
       {"out", "lse"}},
      {"lse over q", [](Problem& p) { p.lse.data = p.qb.data(); }, MHA_ERR_OVERLAP, {"lse"}},
      {"out zero stride on heads",
       [](Problem& p) { p.out.strides[1] = 0; },
       MHA_ERR_OVERLAP,
       {"out"}},
      {"out zero stride on features",
       [](Problem& p) { p.out.strides[3] = 0; },
       MHA_ERR_OVERLAP,
       {"out"}},
      {"out rows overlap (row stride < Dv)",
       [](Problem& p) { p.out.strides[2] = Problem::Dv - 1; },
       MHA_ERR_OVERLAP,
       {"out"}},
      {"out heads overlap batches",
       [](Problem& p) { p.out.strides[0] = Problem::Lq * Problem::Dv; },  // = one head
       MHA_ERR_OVERLAP,
       {"out"}},
      {"lse zero stride", [](Problem& p) { p.lse.strides[2] = 0; }, MHA_ERR_OVERLAP, {"lse"}},
  });
}

TEST_F(BadInput, OverlapRulesAllowedCases) {
  {
    // A zero stride on a dimension of size 1 does not overlap.
    Problem p;
    p.q.shape[0] = p.k.shape[0] = p.v.shape[0] = p.out.shape[0] = 1;
    p.lens.shape[0] = 1;
    p.mask.shape[0] = 1;
    p.lse.shape[0] = 1;
    p.out.strides[0] = 0;
    EXPECT_EQ(p.call(), MHA_OK) << mha_last_error();
  }
  {
    // Inputs may overlap each other (packed QKV); k and v may even be the same memory.
    Problem p;
    p.v = describe(p.kb.data(), MHA_DTYPE_F32, {Problem::B, Problem::Hkv, Problem::Lk, Problem::D});
    p.out =
        describe(p.outb.data(), MHA_DTYPE_F32, {Problem::B, Problem::H, Problem::Lq, Problem::D});
    p.q = describe(p.kb.data() + 1, MHA_DTYPE_F32,
                   {Problem::B, Problem::H, Problem::Lq, Problem::D}, {0, 0, Problem::D, 1});
    EXPECT_EQ(p.call(), MHA_OK) << mha_last_error();
  }
}

TEST_F(BadInput, NullParamsIsAllowed) {
  Problem p;
  p.pass_params = false;
  EXPECT_EQ(p.call(), MHA_OK) << mha_last_error();
}

// ------------------------------------------------------------------ other entry points

TEST(BadCalls, SelectUnknownBackend) {
  const char* before = mha_selected_backend();
  const std::string was = before != nullptr ? before : "";
  EXPECT_EQ(mha_select_backend("nonsense"), MHA_ERR_BACKEND_UNAVAILABLE);
  const std::string message = mha_last_error();
  EXPECT_NE(message.find("nonsense"), std::string::npos) << message;
  for (const auto& b : list_backends()) {
    if (b.usable) {
      EXPECT_TRUE(mentions(message, b.name)) << message << " does not name " << b.name;
    }
  }
  EXPECT_TRUE(mentions(message, "scalar")) << message;
  const char* after = mha_selected_backend();
  EXPECT_EQ(was, after != nullptr ? after : "") << "a failed selection changed the choice";
  EXPECT_EQ(mha_select_backend(nullptr), MHA_ERR_NULL_POINTER);
}

TEST(BadCalls, SelectUnusableBackend) {
  const auto backends = list_backends();
  const BackendEntry* unusable = nullptr;
  for (const auto& b : backends) {
    if (!b.usable) unusable = &b;
  }
  if (unusable == nullptr) GTEST_SKIP() << "every known backend is usable here";
  ASSERT_EQ(mha_select_backend("scalar"), MHA_OK);
  EXPECT_FALSE(unusable->reason.empty()) << unusable->name;
  EXPECT_EQ(mha_select_backend(unusable->name.c_str()), MHA_ERR_BACKEND_UNAVAILABLE);
  const std::string message = mha_last_error();
  EXPECT_NE(message.find(unusable->name), std::string::npos) << message;
  EXPECT_NE(message.find(unusable->reason), std::string::npos) << message;
  EXPECT_TRUE(mentions(message, "scalar")) << message;
  ASSERT_NE(mha_selected_backend(), nullptr);
  EXPECT_STREQ(mha_selected_backend(), "scalar");
}

TEST(BadCalls, TensorInit) {
  float data[64] = {};
  const int64_t shape[4] = {2, 3, 4, 2};
  const int64_t bad_shape[4] = {2, 0, 4, 2};
  const int64_t neg_shape[4] = {2, 3, -4, 2};
  const int64_t neg_strides[4] = {24, 8, -2, 1};
  const int64_t huge[4] = {int64_t{1} << 40, int64_t{1} << 40, 1, 1};
  struct Bad {
    const char* what;
    std::function<mha_status(mha_tensor*)> call;
    mha_status expected;
  };
  const Bad cases[] = {
      {"tensor NULL",
       [&](mha_tensor*) {
         return mha_tensor_init(nullptr, data, MHA_DTYPE_F32, 4, shape, nullptr);
       },
       MHA_ERR_NULL_POINTER},
      {"shape NULL",
       [&](mha_tensor* t) { return mha_tensor_init(t, data, MHA_DTYPE_F32, 4, nullptr, nullptr); },
       MHA_ERR_NULL_POINTER},
      {"ndim 0",
       [&](mha_tensor* t) { return mha_tensor_init(t, data, MHA_DTYPE_F32, 0, shape, nullptr); },
       MHA_ERR_INVALID_SIZE},
      {"ndim 5",
       [&](mha_tensor* t) { return mha_tensor_init(t, data, MHA_DTYPE_F32, 5, shape, nullptr); },
       MHA_ERR_INVALID_SIZE},
      {"ndim -1",
       [&](mha_tensor* t) { return mha_tensor_init(t, data, MHA_DTYPE_F32, -1, shape, nullptr); },
       MHA_ERR_INVALID_SIZE},
      {"dtype 0",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_INVALID, 4, shape, nullptr);
       },
       MHA_ERR_INVALID_DTYPE},
      // 7: unknown, yet inside the enum's value range (anything beyond is UB in C++).
      {"dtype 7 (unknown)",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, static_cast<mha_dtype>(7), 4, shape, nullptr);
       },
       MHA_ERR_INVALID_DTYPE},
      {"size 0",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_F32, 4, bad_shape, nullptr);
       },
       MHA_ERR_INVALID_SIZE},
      {"size -4",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_F32, 4, neg_shape, nullptr);
       },
       MHA_ERR_INVALID_SIZE},
      {"negative stride",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_F32, 4, shape, neg_strides);
       },
       MHA_ERR_INVALID_STRIDES},
      {"element count overflows",
       [&](mha_tensor* t) { return mha_tensor_init(t, data, MHA_DTYPE_F32, 4, huge, nullptr); },
       MHA_ERR_SIZE_OVERFLOW},
  };
  for (const auto& bad : cases) {
    SCOPED_TRACE(bad.what);
    mha_tensor t;
    std::memset(&t, 0xAB, sizeof t);
    mha_tensor before;
    std::memcpy(&before, &t, sizeof t);
    EXPECT_EQ(bad.call(&t), bad.expected) << mha_last_error();
    EXPECT_STRNE(mha_last_error(), "");
    EXPECT_EQ(0, std::memcmp(&t, &before, sizeof t)) << "a failed mha_tensor_init wrote the tensor";
  }
  // And the good calls: C order, or the strides given.
  mha_tensor t{};
  ASSERT_EQ(mha_tensor_init(&t, data, MHA_DTYPE_F32, 4, shape, nullptr), MHA_OK);
  EXPECT_EQ(t.data, data);
  EXPECT_EQ(t.dtype, MHA_DTYPE_F32);
  EXPECT_EQ(t.ndim, 4);
  const int64_t c_order[4] = {24, 8, 2, 1};
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(t.shape[d], shape[d]);
    EXPECT_EQ(t.strides[d], c_order[d]);
  }
  const int64_t given[4] = {1, 2, 6, 0};
  ASSERT_EQ(mha_tensor_init(&t, data, MHA_DTYPE_BOOL, 4, shape, given), MHA_OK);
  for (int d = 0; d < 4; ++d) EXPECT_EQ(t.strides[d], given[d]);
  ASSERT_EQ(mha_tensor_init(&t, data, MHA_DTYPE_I64, 1, shape, nullptr), MHA_OK);
  EXPECT_EQ(t.ndim, 1);
  EXPECT_EQ(t.strides[0], 1);
}

TEST(BadCalls, BackendInfoIndexOutOfRange) {
  const int32_t count = mha_backend_count();
  ASSERT_GE(count, 1);
  for (const int32_t index : {-1, count, count + 100}) {
    mha_backend_info info;
    std::memset(&info, 0xCD, sizeof info);
    mha_backend_info before;
    std::memcpy(&before, &info, sizeof info);
    EXPECT_NE(mha_backend_get_info(index, &info), MHA_OK) << index;
    EXPECT_STRNE(mha_last_error(), "");
    EXPECT_EQ(0, std::memcmp(&info, &before, sizeof info)) << "info written on failure";
  }
  EXPECT_EQ(mha_backend_get_info(0, nullptr), MHA_ERR_NULL_POINTER);
}

TEST(BadCalls, ThreadCountOutOfRange) {
  ASSERT_EQ(mha_set_num_threads(2), MHA_OK);
  EXPECT_EQ(mha_set_num_threads(-1), MHA_ERR_INVALID_VALUE);
  EXPECT_STRNE(mha_last_error(), "");
  EXPECT_EQ(mha_get_num_threads(), 2) << "a refused thread count changed the setting";
  ASSERT_EQ(mha_set_num_threads(0), MHA_OK);
}

TEST(BadCalls, StatusNames) {
  EXPECT_STREQ(mha_status_name(MHA_OK), "MHA_OK");
  EXPECT_STREQ(mha_status_name(MHA_ERR_SHAPE_MISMATCH), "MHA_ERR_SHAPE_MISMATCH");
  EXPECT_STREQ(mha_status_name(MHA_ERR_BACKEND_UNAVAILABLE), "MHA_ERR_BACKEND_UNAVAILABLE");
  for (int s = MHA_ERR_NULL_POINTER; s <= MHA_ERR_INTERNAL; ++s) {
    const char* name = mha_status_name(static_cast<mha_status>(s));
    ASSERT_NE(name, nullptr);
    EXPECT_EQ(std::string(name).rfind("MHA_ERR_", 0), 0u) << name;
  }
  EXPECT_NE(mha_status_name(static_cast<mha_status>(15)), nullptr);  // unknown, in range
}

// ------------------------------------------------------------------ more bad calls
// Every other public entry point, with the same three checks: the specific
// status, a message naming the argument at fault, and outputs untouched.

TEST_F(BadInput, Dropout) {
  std::vector<BadCase> cases;
  for (const float p : {-0.5f, -1e-9f, 1.0f, 1.5f, kNaN, kInf, -kInf}) {
    cases.push_back({"dropout_p " + std::to_string(p),
                     [p](Problem& pr) { pr.params.dropout_p = p; },
                     MHA_ERR_INVALID_VALUE,
                     {"dropout_p"}});
  }
  expect_failures(cases);
}

// A valid mha_merge_partials call (two parts of [B, H, Lq, Dv]) that each
// case breaks in one way.  Every buffer is checked afterwards, since a broken
// descriptor may point out or lse into another.
struct MergeProblem {
  static constexpr int64_t B = 2, H = 3, Lq = 4, Dv = 5;
  static constexpr int64_t kSlack = 4;
  std::vector<float> parts_b, part_lses_b, out_b, lse_b;
  mha_tensor outs[2]{}, lses[2]{}, out{}, lse{};
  int32_t n = 2;
  const mha_tensor* outs_p = outs;
  const mha_tensor* lses_p = lses;
  mha_tensor* out_p = &out;
  mha_tensor* lse_p = &lse;

  MergeProblem()
      : parts_b(static_cast<size_t>(kSlack * 2 * B * H * Lq * Dv)),
        part_lses_b(static_cast<size_t>(kSlack * 2 * B * H * Lq)),
        out_b(static_cast<size_t>(kSlack * B * H * Lq * Dv), Arena::sentinel()),
        lse_b(static_cast<size_t>(kSlack * B * H * Lq), Arena::sentinel()) {
    Rng rng(9);
    for (float& x : parts_b) x = rng.uniform();
    for (float& x : part_lses_b) x = rng.uniform(-2.0f, 2.0f);
    for (int c = 0; c < 2; ++c) {
      outs[c] = describe(parts_b.data() + c * B * H * Lq * Dv, MHA_DTYPE_F32, {B, H, Lq, Dv});
      lses[c] = describe(part_lses_b.data() + c * B * H * Lq, MHA_DTYPE_F32, {B, H, Lq});
    }
    out = describe(out_b.data(), MHA_DTYPE_F32, {B, H, Lq, Dv});
    lse = describe(lse_b.data(), MHA_DTYPE_F32, {B, H, Lq});
  }
  MergeProblem(const MergeProblem&) = delete;
  MergeProblem& operator=(const MergeProblem&) = delete;

  mha_status call() { return mha_merge_partials(n, outs_p, lses_p, out_p, lse_p); }
  std::vector<std::vector<float>> buffers() const { return {parts_b, part_lses_b, out_b, lse_b}; }
};

struct BadMerge {
  std::string what;
  std::function<void(MergeProblem&)> breaks;
  mha_status expected;
  std::vector<std::string> names;
};

void expect_merge_failures(const std::vector<BadMerge>& cases) {
  {
    MergeProblem good;
    ASSERT_EQ(good.call(), MHA_OK) << mha_last_error();
    for (int64_t i = 0; i < MergeProblem::B * MergeProblem::H * MergeProblem::Lq; ++i) {
      ASSERT_TRUE(std::isfinite(good.lse_b[static_cast<size_t>(i)])) << "lse not written";
    }
  }
  for (const auto& bad : cases) {
    SCOPED_TRACE(bad.what);
    MergeProblem p;
    bad.breaks(p);
    const auto before = p.buffers();
    const mha_status status = p.call();
    const std::string message = mha_last_error();
    EXPECT_EQ(status, bad.expected) << "got " << mha_status_name(status) << " (want "
                                    << mha_status_name(bad.expected) << "): " << message;
    EXPECT_FALSE(message.empty());
    bool named = bad.names.empty();
    for (const auto& name : bad.names) named = named || mentions(message, name);
    EXPECT_TRUE(named) << "message \"" << message << "\" does not name the argument";
    const auto after = p.buffers();
    for (size_t n = 0; n < before.size(); ++n) {
      EXPECT_EQ(0, std::memcmp(before[n].data(), after[n].data(), before[n].size() * 4))
          << "a failed call modified buffer " << n << " (parts, part lses, out, lse)";
    }
  }
}

TEST(BadMergePartials, Catalogue) {
  using P = MergeProblem;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  expect_merge_failures({
      {"n = 0", [](P& p) { p.n = 0; }, MHA_ERR_INVALID_SIZE, {"n"}},
      {"n = -1", [](P& p) { p.n = -1; }, MHA_ERR_INVALID_SIZE, {"n"}},
      {"n = INT32_MIN",
       [](P& p) { p.n = std::numeric_limits<int32_t>::min(); },
       MHA_ERR_INVALID_SIZE,
       {"n"}},
      {"outs NULL", [](P& p) { p.outs_p = nullptr; }, MHA_ERR_NULL_POINTER, {"outs"}},
      {"lses NULL", [](P& p) { p.lses_p = nullptr; }, MHA_ERR_NULL_POINTER, {"lses"}},
      {"out NULL", [](P& p) { p.out_p = nullptr; }, MHA_ERR_NULL_POINTER, {"out"}},
      {"out->data NULL", [](P& p) { p.out.data = nullptr; }, MHA_ERR_NULL_POINTER, {"out"}},
      {"outs[1].data NULL", [](P& p) { p.outs[1].data = nullptr; }, MHA_ERR_NULL_POINTER, {"outs"}},
      {"lses[0].data NULL", [](P& p) { p.lses[0].data = nullptr; }, MHA_ERR_NULL_POINTER, {"lses"}},
      {"lse->data NULL", [](P& p) { p.lse.data = nullptr; }, MHA_ERR_NULL_POINTER, {"lse"}},
      {"out 3-D", [](P& p) { p.out.ndim = 3; }, MHA_ERR_INVALID_SIZE, {"out"}},
      {"out 5-D", [](P& p) { p.out.ndim = 5; }, MHA_ERR_INVALID_SIZE, {"out"}},
      {"outs[0] 3-D", [](P& p) { p.outs[0].ndim = 3; }, MHA_ERR_INVALID_SIZE, {"outs"}},
      {"lses[1] 4-D",
       [](P& p) {
         p.lses[1] = describe(p.part_lses_b.data(), MHA_DTYPE_F32, {P::B, P::H, P::Lq, 1});
       },
       MHA_ERR_INVALID_SIZE,
       {"lses"}},
      {"lse 2-D", [](P& p) { p.lse.ndim = 2; }, MHA_ERR_INVALID_SIZE, {"lse"}},
      {"lse 0-D", [](P& p) { p.lse.ndim = 0; }, MHA_ERR_INVALID_SIZE, {"lse"}},
      {"out size 0", [](P& p) { p.out.shape[3] = 0; }, MHA_ERR_INVALID_SIZE, {"out"}},
      {"outs[1] size -1", [](P& p) { p.outs[1].shape[0] = -1; }, MHA_ERR_INVALID_SIZE, {"outs"}},
      {"lses[0] size 0", [](P& p) { p.lses[0].shape[2] = 0; }, MHA_ERR_INVALID_SIZE, {"lses"}},
      {"out dtype i32", [](P& p) { p.out.dtype = MHA_DTYPE_I32; }, MHA_ERR_INVALID_DTYPE, {"out"}},
      {"out dtype 0", [](P& p) { p.out.dtype = 0; }, MHA_ERR_INVALID_DTYPE, {"out"}},
      {"outs[1] dtype bool",
       [](P& p) { p.outs[1].dtype = MHA_DTYPE_BOOL; },
       MHA_ERR_INVALID_DTYPE,
       {"outs"}},
      {"lses[0] dtype 99", [](P& p) { p.lses[0].dtype = 99; }, MHA_ERR_INVALID_DTYPE, {"lses"}},
      {"lses[1] dtype f16",
       [](P& p) { p.lses[1].dtype = MHA_DTYPE_F16; },
       MHA_ERR_INVALID_DTYPE,
       {"lses"}},
      {"lse dtype i64", [](P& p) { p.lse.dtype = MHA_DTYPE_I64; }, MHA_ERR_INVALID_DTYPE, {"lse"}},
      {"outs[1] Lq + 1",
       [](P& p) { p.outs[1].shape[2] = P::Lq + 1; },
       MHA_ERR_SHAPE_MISMATCH,
       {"outs"}},
      {"outs[0] Dv - 1",
       [](P& p) { p.outs[0].shape[3] = P::Dv - 1; },
       MHA_ERR_SHAPE_MISMATCH,
       {"outs"}},
      {"lses[1] heads", [](P& p) { p.lses[1].shape[1] = 1; }, MHA_ERR_SHAPE_MISMATCH, {"lses"}},
      {"lses[0] batch", [](P& p) { p.lses[0].shape[0] = 1; }, MHA_ERR_SHAPE_MISMATCH, {"lses"}},
      {"lse Lq", [](P& p) { p.lse.shape[2] = P::Lq - 1; }, MHA_ERR_SHAPE_MISMATCH, {"lse"}},
      {"out negative stride",
       [](P& p) { p.out.strides[2] = -P::Dv; },
       MHA_ERR_INVALID_STRIDES,
       {"out"}},
      {"outs[1] negative stride",
       [](P& p) { p.outs[1].strides[3] = -1; },
       MHA_ERR_INVALID_STRIDES,
       {"outs"}},
      {"lses[0] negative stride",
       [](P& p) { p.lses[0].strides[0] = -1; },
       MHA_ERR_INVALID_STRIDES,
       {"lses"}},
      {"lse negative stride",
       [](P& p) { p.lse.strides[1] = -4; },
       MHA_ERR_INVALID_STRIDES,
       {"lse"}},
      {"out stride overflows",
       [](P& p) { p.out.strides[0] = kMax; },
       MHA_ERR_SIZE_OVERFLOW,
       {"out"}},
      {"outs[0] stride overflows",
       [](P& p) { p.outs[0].strides[1] = kMax / 2; },
       MHA_ERR_SIZE_OVERFLOW,
       {"outs"}},
      {"out == outs[0]", [](P& p) { p.out.data = p.outs[0].data; }, MHA_ERR_OVERLAP, {"out"}},
      {"out ends on outs[1]'s first element",
       [](P& p) {
         p.out.data = static_cast<float*>(p.outs[1].data) - (P::B * P::H * P::Lq * P::Dv - 1);
       },
       MHA_ERR_OVERLAP,
       {"out"}},
      {"out over lses[1]", [](P& p) { p.out.data = p.lses[1].data; }, MHA_ERR_OVERLAP, {"out"}},
      {"lse over outs[1]",
       [](P& p) { p.lse.data = static_cast<float*>(p.outs[1].data) + 7; },
       MHA_ERR_OVERLAP,
       {"lse"}},
      {"lse over lses[0]", [](P& p) { p.lse.data = p.lses[0].data; }, MHA_ERR_OVERLAP, {"lse"}},
      {"lse inside out",
       [](P& p) { p.lse.data = p.out_b.data() + 3; },
       MHA_ERR_OVERLAP,
       {"out", "lse"}},
      {"out zero stride", [](P& p) { p.out.strides[2] = 0; }, MHA_ERR_OVERLAP, {"out"}},
      {"out rows overlap", [](P& p) { p.out.strides[2] = P::Dv - 1; }, MHA_ERR_OVERLAP, {"out"}},
      {"lse zero stride", [](P& p) { p.lse.strides[0] = 0; }, MHA_ERR_OVERLAP, {"lse"}},
  });
}

TEST(BadMergePartials, ValidCornerCases) {
  // Not errors: one part, no lse, parts that overlap each other (inputs may).
  MergeProblem one;
  one.n = 1;
  ASSERT_EQ(one.call(), MHA_OK) << mha_last_error();
  const int64_t rows = MergeProblem::B * MergeProblem::H * MergeProblem::Lq * MergeProblem::Dv;
  EXPECT_TRUE(std::equal(one.out_b.begin(), one.out_b.begin() + rows, one.parts_b.begin()))
      << "one part merges to itself";
  MergeProblem no_lse;
  no_lse.lse_p = nullptr;
  EXPECT_EQ(no_lse.call(), MHA_OK) << mha_last_error();
  MergeProblem shared;
  shared.outs[1] = shared.outs[0];
  shared.lses[1] = shared.lses[0];
  EXPECT_EQ(shared.call(), MHA_OK) << mha_last_error();
}

// mha_tensor_init: each failure names the parameter at fault.
TEST(BadCalls, TensorInitNamesTheArgument) {
  float data[64] = {};
  const int64_t shape[4] = {2, 3, 4, 2};
  const int64_t zero_shape[4] = {2, 3, 0, 2};
  const int64_t neg_strides[4] = {24, 8, 2, -1};
  const int64_t huge[4] = {int64_t{1} << 32, int64_t{1} << 32, 1, 1};
  struct Bad {
    const char* what;
    std::function<mha_status(mha_tensor*)> call;
    mha_status expected;
    const char* name;
  };
  const Bad cases[] = {
      {"tensor NULL",
       [&](mha_tensor*) {
         return mha_tensor_init(nullptr, data, MHA_DTYPE_F32, 4, shape, nullptr);
       },
       MHA_ERR_NULL_POINTER, "tensor"},
      {"shape NULL",
       [&](mha_tensor* t) { return mha_tensor_init(t, data, MHA_DTYPE_F32, 2, nullptr, nullptr); },
       MHA_ERR_NULL_POINTER, "shape"},
      {"ndim 0",
       [&](mha_tensor* t) { return mha_tensor_init(t, data, MHA_DTYPE_F32, 0, shape, nullptr); },
       MHA_ERR_INVALID_SIZE, "ndim"},
      {"ndim INT32_MIN",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_F32, std::numeric_limits<int32_t>::min(), shape,
                                nullptr);
       },
       MHA_ERR_INVALID_SIZE, "ndim"},
      {"ndim MHA_MAX_DIMS + 1",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_F32, MHA_MAX_DIMS + 1, shape, nullptr);
       },
       MHA_ERR_INVALID_SIZE, "ndim"},
      {"dtype invalid",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_INVALID, 4, shape, nullptr);
       },
       MHA_ERR_INVALID_DTYPE, "dtype"},
      {"shape[2] = 0",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_F32, 4, zero_shape, nullptr);
       },
       MHA_ERR_INVALID_SIZE, "shape"},
      {"strides[3] = -1",
       [&](mha_tensor* t) {
         return mha_tensor_init(t, data, MHA_DTYPE_F32, 4, shape, neg_strides);
       },
       MHA_ERR_INVALID_STRIDES, "strides"},
      {"element count overflows",
       [&](mha_tensor* t) { return mha_tensor_init(t, data, MHA_DTYPE_F32, 4, huge, nullptr); },
       MHA_ERR_SIZE_OVERFLOW, "shape"},
  };
  for (const auto& bad : cases) {
    SCOPED_TRACE(bad.what);
    mha_tensor t;
    std::memset(&t, 0x5A, sizeof t);
    mha_tensor before;
    std::memcpy(&before, &t, sizeof t);
    EXPECT_EQ(bad.call(&t), bad.expected) << mha_last_error();
    const std::string message = mha_last_error();
    EXPECT_TRUE(mentions(message, bad.name)) << "\"" << message << "\" does not name " << bad.name;
    EXPECT_EQ(0, std::memcmp(&t, &before, sizeof t)) << "a failed mha_tensor_init wrote the tensor";
  }
}

TEST(BadCalls, BackendInfoNamesTheArgument) {
  const int32_t count = mha_backend_count();
  for (const int32_t index : {-1, count, count + 1, std::numeric_limits<int32_t>::max(),
                              std::numeric_limits<int32_t>::min()}) {
    SCOPED_TRACE(index);
    mha_backend_info info;
    std::memset(&info, 0x3C, sizeof info);
    mha_backend_info before;
    std::memcpy(&before, &info, sizeof info);
    EXPECT_EQ(mha_backend_get_info(index, &info), MHA_ERR_INVALID_VALUE);
    const std::string message = mha_last_error();
    EXPECT_TRUE(mentions(message, "index")) << message;
    EXPECT_NE(message.find(std::to_string(index)), std::string::npos) << message;
    EXPECT_EQ(0, std::memcmp(&info, &before, sizeof info)) << "info written on failure";
  }
  EXPECT_EQ(mha_backend_get_info(0, nullptr), MHA_ERR_NULL_POINTER);
  EXPECT_TRUE(mentions(mha_last_error(), "info")) << mha_last_error();
  EXPECT_EQ(mha_backend_get_info(-1, nullptr), MHA_ERR_NULL_POINTER);  // both wrong: NULL first
}

TEST(BadCalls, SelectBackendRefusals) {
  ASSERT_EQ(mha_select_backend("scalar"), MHA_OK) << mha_last_error();
  const std::string long_name(5000, 'x');
  for (const std::string& name :
       {std::string(""), std::string("AUTO"), std::string("Scalar"), std::string("scalar "),
        std::string(" auto"), std::string("avx2\n"), std::string("../scalar"),
        std::string("\x1b[31mred\x1b[0m"), std::string("caf\xc3\xa9"),
        std::string("libmha-backend-scalar.so"), long_name}) {
    SCOPED_TRACE("name \"" + name.substr(0, 40) + "\"");
    EXPECT_EQ(mha_select_backend(name.c_str()), MHA_ERR_BACKEND_UNAVAILABLE);
    const std::string message = mha_last_error();
    // Quoted with control characters (and bytes outside ASCII) escaped: a
    // message never drives the terminal.
    std::string escaped;
    for (const char c : name.substr(0, 32)) {
      const auto byte = static_cast<unsigned char>(c);
      if (byte < 0x20 || byte >= 0x7f || byte == '\\') {
        char hex[8];
        std::snprintf(hex, sizeof hex, "\\x%02x", byte);
        escaped += hex;
      } else {
        escaped += c;
      }
    }
    EXPECT_NE(message.find("'" + escaped), std::string::npos)
        << "the message does not quote the name: " << message.substr(0, 200);
    for (const char c : message) {
      const auto byte = static_cast<unsigned char>(c);
      EXPECT_TRUE(byte >= 0x20 && byte < 0x7f) << "raw byte " << int{byte} << " in the message";
    }
    EXPECT_TRUE(mentions(message, "scalar")) << "usable backends not listed: " << message;
    ASSERT_NE(mha_selected_backend(), nullptr);
    EXPECT_STREQ(mha_selected_backend(), "scalar") << "a failed selection changed the choice";
  }
  EXPECT_EQ(mha_select_backend(nullptr), MHA_ERR_NULL_POINTER);
  EXPECT_TRUE(mentions(mha_last_error(), "name")) << mha_last_error();
  ASSERT_NE(mha_selected_backend(), nullptr);
  EXPECT_STREQ(mha_selected_backend(), "scalar");
  ASSERT_EQ(mha_select_backend("auto"), MHA_OK);
}

TEST(BadCalls, ThreadCountRefusalsNameN) {
  ASSERT_EQ(mha_set_num_threads(3), MHA_OK);
  for (const int32_t n : {-1, -4096, 4097, 100000, std::numeric_limits<int32_t>::max(),
                          std::numeric_limits<int32_t>::min()}) {
    SCOPED_TRACE(n);
    EXPECT_EQ(mha_set_num_threads(n), MHA_ERR_INVALID_VALUE);
    const std::string message = mha_last_error();
    EXPECT_TRUE(mentions(message, "n")) << message;
    EXPECT_NE(message.find(std::to_string(n)), std::string::npos) << message;
    EXPECT_EQ(mha_get_num_threads(), 3) << "a refused thread count changed the setting";
  }
  ASSERT_EQ(mha_set_num_threads(4096), MHA_OK);  // the documented maximum is accepted
  EXPECT_EQ(mha_get_num_threads(), 4096);
  ASSERT_EQ(mha_set_num_threads(0), MHA_OK);
}

TEST(BadCalls, ErrorsAreClearedBySuccess) {
  // mha_last_error() describes the last failed call on this thread, and a
  // successful call clears it: a stale message would blame the wrong argument.
  EXPECT_EQ(mha_set_num_threads(-1), MHA_ERR_INVALID_VALUE);
  EXPECT_STRNE(mha_last_error(), "");
  ASSERT_EQ(mha_set_num_threads(0), MHA_OK);
  EXPECT_STREQ(mha_last_error(), "");
  EXPECT_EQ(mha_merge_partials(0, nullptr, nullptr, nullptr, nullptr), MHA_ERR_INVALID_SIZE);
  EXPECT_STRNE(mha_last_error(), "");
  mha_backend_info info{};
  ASSERT_EQ(mha_backend_get_info(0, &info), MHA_OK);
  EXPECT_STREQ(mha_last_error(), "");
}

}  // namespace
}  // namespace mha_test
