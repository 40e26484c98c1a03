// The C++ layer (include/mha/mha.hpp) against the C API on the same inputs:
// shapes from any contiguous range, dtypes from element types, parameter
// objects that own their descriptors (built from temporaries, copied, moved),
// packed and paged variable-length batches, kv_cache_write, merge_partials,
// the backend list, threads, version and CPU features.  What must not
// compile is in cpp_api_compile.cpp (ctest cpp.must_not_compile.*).
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mha/mha.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

std::vector<float> random_values(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> values(n);
  for (float& x : values) x = rng.uniform();
  return values;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool same_descriptor(const mha_tensor& a, const mha_tensor& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int32_t d = 0; d < a.ndim; ++d) {
    if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

// The status of the mha::Error a callable throws (MHA_OK if none), and its message.
template <class Fn>
mha_status thrown_status(Fn&& fn, std::string* message = nullptr) {
  try {
    fn();
  } catch (const mha::Error& e) {
    if (message != nullptr) *message = e.what();
    return e.status();
  }
  return MHA_OK;
}

// ------------------------------------------------------------------ shapes

TEST(CppApi, ShapesFromAnyContiguousRange) {
  std::vector<float> data(2 * 3 * 4 * 5);
  mha_tensor expected{};
  const int64_t shape[4] = {2, 3, 4, 5};
  ASSERT_EQ(mha_tensor_init(&expected, data.data(), MHA_DTYPE_F32, 4, shape, nullptr), MHA_OK);

  const std::vector<int64_t> from_vector = {2, 3, 4, 5};
  const std::vector<int> from_int_vector = {2, 3, 4, 5};
  const std::vector<size_t> from_size_vector = {2, 3, 4, 5};
  const std::array<int64_t, 4> from_array = {2, 3, 4, 5};
  const std::array<int32_t, 4> from_int_array = {2, 3, 4, 5};
  const int64_t from_c_array[4] = {2, 3, 4, 5};
  const int from_int_c_array[4] = {2, 3, 4, 5};
  const int64_t b = 2, h = 3, l = 4, d = 5;

  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), {2, 3, 4, 5}).get(), expected));
  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), {b, h, l, d}).get(), expected));
  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), from_vector).get(), expected));
  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), from_int_vector).get(), expected));
  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), from_size_vector).get(), expected));
  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), from_array).get(), expected));
  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), from_int_array).get(), expected));
  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), from_c_array).get(), expected));
  EXPECT_TRUE(same_descriptor(*mha::Tensor(data.data(), from_int_c_array).get(), expected));
  EXPECT_TRUE(same_descriptor(
      *mha::Tensor(data.data(), MHA_DTYPE_F32, from_vector, std::vector<int64_t>{60, 20, 5, 1})
           .get(),
      expected));

  // Strides from any range too, and a shape decided at run time.
  std::vector<int64_t> run_time_shape;
  for (int64_t extent = 2; extent <= 5; ++extent) run_time_shape.push_back(extent);
  const std::array<int, 4> strides = {1, 2, 6, 24};  // column-major
  mha::Tensor t(static_cast<const float*>(data.data()), run_time_shape, strides);
  EXPECT_EQ(t.ndim(), 4);
  for (int32_t axis = 0; axis < 4; ++axis) {
    EXPECT_EQ(t.shape(axis), run_time_shape[static_cast<size_t>(axis)]);
    EXPECT_EQ(t.stride(axis), strides[static_cast<size_t>(axis)]);
  }
  EXPECT_EQ(t.data(), data.data());
  EXPECT_EQ(t.dtype(), MHA_DTYPE_F32);
}

TEST(CppApi, ShapesFromBraceListsOfAnyIntegerTypes) {
  std::vector<float> data(64);
  const size_t n = 2, d = 4;
  const unsigned h = 2;
  const mha::Tensor t(data.data(), {n, h, 1, d}, {d * h, d, d, 1});
  const int64_t shape[] = {2, 2, 1, 4}, strides[] = {8, 4, 4, 1};
  for (int32_t axis = 0; axis < 4; ++axis) {
    EXPECT_EQ(t.shape(axis), shape[axis]);
    EXPECT_EQ(t.stride(axis), strides[axis]);
  }
}

TEST(CppApi, BadShapesThrow) {
  std::vector<float> data(64);
  std::string message;
  EXPECT_EQ(thrown_status([&] { mha::Tensor(data.data(), std::vector<int64_t>{}); }, &message),
            MHA_ERR_INVALID_SIZE);
  EXPECT_EQ(message, "MHA_ERR_INVALID_SIZE: a tensor has 1 to 4 dimensions, not 0");
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::Tensor(data.data(), std::vector<int>{1, 1, 1, 1, 2});
                },
                &message),
            MHA_ERR_INVALID_SIZE);
  EXPECT_EQ(message, "MHA_ERR_INVALID_SIZE: a tensor has 1 to 4 dimensions, not 5");
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::Tensor(data.data(), {2, 4}, {4});
                },
                &message),
            MHA_ERR_INVALID_STRIDES);
  EXPECT_EQ(message, "MHA_ERR_INVALID_STRIDES: 1 strides for 2 dimensions");
  const std::vector<uint64_t> huge = {std::numeric_limits<uint64_t>::max()};
  EXPECT_EQ(thrown_status([&] { mha::Tensor(data.data(), huge); }, &message), MHA_ERR_INVALID_SIZE);
  EXPECT_NE(message.find("18446744073709551615 exceeds INT64_MAX"), std::string::npos) << message;
  // Brace lists of size_t, alone or mixed with other integer types, are checked alike.
  const size_t too_big = size_t{1} << 63, two = 2;
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::Tensor(data.data(), {too_big, two});
                },
                &message),
            MHA_ERR_INVALID_SIZE);
  EXPECT_NE(message.find("9223372036854775808 exceeds INT64_MAX"), std::string::npos) << message;
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::Tensor(data.data(), {two, 1, too_big});
                },
                &message),
            MHA_ERR_INVALID_SIZE);
  EXPECT_NE(message.find("9223372036854775808 exceeds INT64_MAX"), std::string::npos) << message;
  // What the C API refuses comes back with its message.
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::Tensor(data.data(), {2, -1});
                },
                &message),
            MHA_ERR_INVALID_SIZE);
  EXPECT_EQ(message.rfind("MHA_ERR_INVALID_SIZE: ", 0), 0u) << message;
  EXPECT_GT(message.size(), std::string("MHA_ERR_INVALID_SIZE: ").size());
}

// ------------------------------------------------------------------ dtypes and constness

TEST(CppApi, DtypeAndConstnessFollowThePointer) {
  float f[2] = {};
  int32_t i32[2] = {};
  int64_t i64[2] = {};
  long long ll[2] = {};  // 64 bits, not int64_t (long) on LP64
  bool flags[2] = {};
  uint8_t bytes[2] = {};
  EXPECT_EQ(mha::Tensor(f, {2}).dtype(), MHA_DTYPE_F32);
  EXPECT_EQ(mha::Tensor(i32, {2}).dtype(), MHA_DTYPE_I32);
  EXPECT_EQ(mha::Tensor(i64, {2}).dtype(), MHA_DTYPE_I64);
  EXPECT_EQ(mha::Tensor(ll, {2}).dtype(), MHA_DTYPE_I64);
  EXPECT_EQ(mha::Tensor(flags, {2}).dtype(), MHA_DTYPE_BOOL);
  EXPECT_EQ(mha::Tensor(bytes, MHA_DTYPE_BOOL, {2}).dtype(), MHA_DTYPE_BOOL);

  const float* cf = f;
  const auto typed = mha::Tensor(cf, {2});
  const auto erased = mha::Tensor(static_cast<const uint8_t*>(bytes), MHA_DTYPE_BOOL, {2});
  const auto writable = mha::Tensor(bytes, MHA_DTYPE_BOOL, {2});
  static_assert(std::is_same_v<std::remove_const_t<decltype(typed)>, mha::Tensor<const float>>);
  static_assert(std::is_same_v<std::remove_const_t<decltype(erased)>, mha::ConstTensor>);
  static_assert(std::is_same_v<std::remove_const_t<decltype(writable)>, mha::MutableTensor>);
  static_assert(!mha::Tensor<const float>::writable && mha::Tensor<float>::writable);
  static_assert(std::is_same_v<decltype(typed.data()), const float*>);
  static_assert(std::is_same_v<decltype(mha::Tensor(f, {2}).data()), float*>);
  static_assert(
      std::is_same_v<decltype(std::declval<mha::ConstTensor&>().get()), const mha_tensor*>);
  static_assert(std::is_same_v<decltype(std::declval<mha::MutableTensor&>().get()), mha_tensor*>);
  static_assert(std::is_trivially_copyable_v<mha::ConstTensor>);
  EXPECT_EQ(typed.data(), f);
  EXPECT_EQ(erased.data(), static_cast<const void*>(bytes));
  EXPECT_EQ(writable.data(), static_cast<void*>(bytes));

  // Writable converts to read-only and typed to type-erased, descriptors intact.
  mha::Tensor<float> t(f, {1, 2}, {2, 1});
  const mha::ConstTensor as_input = t;
  const mha::MutableTensor as_output = t;
  const mha::Tensor<const float> as_const_float = t;
  EXPECT_TRUE(same_descriptor(*as_input.get(), *t.get()));
  EXPECT_TRUE(same_descriptor(*as_output.get(), *t.get()));
  EXPECT_TRUE(same_descriptor(*as_const_float.get(), *t.get()));
}

// ------------------------------------------------------------------ attention

struct Problem {
  int64_t B = 2, H = 4, Hkv = 2, Lq = 5, Lk = 11, D = 8, Dv = 6;
  std::vector<float> q, k, v;
  Problem()
      : q(random_values(static_cast<size_t>(B * H * Lq * D), 1)),
        k(random_values(static_cast<size_t>(B * Hkv * Lk * D), 2)),
        v(random_values(static_cast<size_t>(B * Hkv * Lk * Dv), 3)) {}
  size_t out_size() const { return static_cast<size_t>(B * H * Lq * Dv); }
  size_t lse_size() const { return static_cast<size_t>(B * H * Lq); }
  mha_tensor cq() { return describe(q.data(), MHA_DTYPE_F32, {B, H, Lq, D}); }
  mha_tensor ck() { return describe(k.data(), MHA_DTYPE_F32, {B, Hkv, Lk, D}); }
  mha_tensor cv() { return describe(v.data(), MHA_DTYPE_F32, {B, Hkv, Lk, Dv}); }
};

TEST(CppApi, AttentionOverConstInputsMatchesTheCApi) {
  Problem p;
  const std::vector<float>& q = p.q;  // inputs seen through const pointers
  const std::vector<float>& k = p.k;
  const std::vector<float>& v = p.v;
  std::vector<float> out(p.out_size(), -1.0f), expected(p.out_size(), -2.0f);

  mha::attention(mha::Tensor(q.data(), {p.B, p.H, p.Lq, p.D}),
                 mha::Tensor(k.data(), {p.B, p.Hkv, p.Lk, p.D}),
                 mha::Tensor(v.data(), {p.B, p.Hkv, p.Lk, p.Dv}),
                 mha::Tensor(out.data(), {p.B, p.H, p.Lq, p.Dv}),
                 mha::AttentionParams()
                     .causal(MHA_CAUSAL_BOTTOM_RIGHT)
                     .scale(0.3f)
                     .window(3, 1)
                     .block(2, 1, p.Lq + 5, p.Lk + 3));

  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  params.has_scale = 1;
  params.scale = 0.3f;
  params.window_left = 3;
  params.window_right = 1;
  params.query_offset = 2;
  params.key_offset = 1;
  params.full_lq = p.Lq + 5;
  params.full_lk = p.Lk + 3;
  const mha_tensor cq = p.cq(), ck = p.ck(), cv = p.cv();
  mha_tensor cout = describe(expected.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.Dv});
  ASSERT_EQ(mha_attention(&cq, &ck, &cv, &cout, &params), MHA_OK) << mha_last_error();
  EXPECT_TRUE(same_bits(out, expected));

  const Reference ref = reference_attention(cq, ck, cv, &params);
  mha_tensor mine = describe(out.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.Dv});
  EXPECT_LE(max_abs_error(mine, ref), tolerance(ref));

  // A chain on a temporary bound to a reference: the setters called on an
  // rvalue return the object by value, so the reference keeps it alive (an
  // lvalue reference into the temporary dangled: ASan's stack-use-after-scope).
  const auto& bound = mha::AttentionParams()
                          .causal(MHA_CAUSAL_BOTTOM_RIGHT)
                          .scale(0.3f)
                          .window(3, 1)
                          .block(2, 1, p.Lq + 5, p.Lk + 3);
  static_assert(!std::is_reference_v<decltype(mha::AttentionParams().scale(0.3f))>);
  std::vector<float> again(p.out_size(), -3.0f);
  mha::attention(mha::Tensor(q.data(), {p.B, p.H, p.Lq, p.D}),
                 mha::Tensor(k.data(), {p.B, p.Hkv, p.Lk, p.D}),
                 mha::Tensor(v.data(), {p.B, p.Hkv, p.Lk, p.Dv}),
                 mha::Tensor(again.data(), {p.B, p.H, p.Lq, p.Dv}), bound);
  EXPECT_TRUE(same_bits(again, expected));
}

TEST(CppApi, QuantizeKvMatchesTheCApi) {
  const int64_t B = 2, H = 3, L = 5, D = 16;
  std::vector<float> src = random_values(static_cast<size_t>(B * H * L * D), 21);
  std::vector<int8_t> rows(src.size(), 7), expected_rows(src.size(), 9);
  std::vector<float> scales(static_cast<size_t>(B * H * L), -1.0f), expected_scales(scales.size());
  mha::quantize_kv(mha::Tensor(src.data(), {B, H, L, D}), mha::Tensor(rows.data(), {B, H, L, D}),
                   mha::Tensor(scales.data(), {B, H, L}));
  const mha_tensor csrc = describe(src.data(), MHA_DTYPE_F32, {B, H, L, D});
  mha_tensor cdst = describe(expected_rows.data(), MHA_DTYPE_I8, {B, H, L, D});
  mha_tensor cscale = describe(expected_scales.data(), MHA_DTYPE_F32, {B, H, L});
  ASSERT_EQ(mha_quantize_kv(&csrc, &cdst, &cscale), MHA_OK) << mha_last_error();
  EXPECT_EQ(rows, expected_rows);
  EXPECT_TRUE(same_bits(scales, expected_scales));
  static_assert(std::is_same_v<decltype(mha::Tensor(rows.data(), {1})), mha::Tensor<int8_t>>);
  std::vector<float> bad = src;
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(thrown_status([&] {
              mha::quantize_kv(mha::Tensor(bad.data(), {B, H, L, D}),
                               mha::Tensor(rows.data(), {B, H, L, D}),
                               mha::Tensor(scales.data(), {B, H, L}));
            }),
            MHA_ERR_INVALID_VALUE);
}

TEST(CppApi, AttentionBackwardMatchesTheCApi) {
  Problem p;
  std::vector<float> out(p.out_size()), lse(p.lse_size()), dout = random_values(p.out_size(), 4);
  std::vector<float> sinks = random_values(static_cast<size_t>(p.H), 5);
  const mha::AttentionParams params = mha::AttentionParams()
                                          .causal(MHA_CAUSAL_BOTTOM_RIGHT)
                                          .sinks(mha::Tensor(sinks.data(), {p.H}));
  mha::attention(mha::Tensor(p.q.data(), {p.B, p.H, p.Lq, p.D}),
                 mha::Tensor(p.k.data(), {p.B, p.Hkv, p.Lk, p.D}),
                 mha::Tensor(p.v.data(), {p.B, p.Hkv, p.Lk, p.Dv}),
                 mha::Tensor(out.data(), {p.B, p.H, p.Lq, p.Dv}),
                 mha::AttentionParams(params).lse(mha::Tensor(lse.data(), {p.B, p.H, p.Lq})));
  // Twice: through mha.hpp (one buffer, [dq | dk | dv | dsinks]) and the C API.
  const size_t nq = p.q.size(), nk = p.k.size(), nv = p.v.size(), ns = sinks.size();
  std::vector<float> mine(nq + nk + nv + ns, -1.0f), theirs(mine.size(), -2.0f);
  mha::attention_backward(
      mha::Tensor(p.q.data(), {p.B, p.H, p.Lq, p.D}),
      mha::Tensor(p.k.data(), {p.B, p.Hkv, p.Lk, p.D}),
      mha::Tensor(p.v.data(), {p.B, p.Hkv, p.Lk, p.Dv}),
      mha::Tensor(out.data(), {p.B, p.H, p.Lq, p.Dv}), mha::Tensor(lse.data(), {p.B, p.H, p.Lq}),
      mha::Tensor(dout.data(), {p.B, p.H, p.Lq, p.Dv}),
      mha::Tensor(mine.data(), {p.B, p.H, p.Lq, p.D}),
      mha::Tensor(mine.data() + nq, {p.B, p.Hkv, p.Lk, p.D}),
      mha::Tensor(mine.data() + nq + nk, {p.B, p.Hkv, p.Lk, p.Dv}), params,
      mha::BackwardParams().dsinks(mha::Tensor(mine.data() + nq + nk + nv, {p.H})));
  mha_tensor q = p.cq(), k = p.ck(), v = p.cv();
  mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.Dv});
  mha_tensor tl = describe(lse.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq});
  mha_tensor td = describe(dout.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.Dv});
  mha_tensor dq = describe(theirs.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.D});
  mha_tensor dk = describe(theirs.data() + nq, MHA_DTYPE_F32, {p.B, p.Hkv, p.Lk, p.D});
  mha_tensor dv = describe(theirs.data() + nq + nk, MHA_DTYPE_F32, {p.B, p.Hkv, p.Lk, p.Dv});
  mha_tensor ds = describe(theirs.data() + nq + nk + nv, MHA_DTYPE_F32, {p.H});
  mha_backward_params backward;
  mha_backward_params_init(&backward);
  backward.dsinks = &ds;
  ASSERT_EQ(
      mha_attention_backward(&q, &k, &v, &to, &tl, &td, &dq, &dk, &dv, params.get(), &backward),
      MHA_OK)
      << mha_last_error();
  EXPECT_TRUE(same_bits(mine, theirs));
  EXPECT_THROW(
      mha::attention_backward(mha::Tensor(p.q.data(), {p.B, p.H, p.Lq, p.D}),
                              mha::Tensor(p.k.data(), {p.B, p.Hkv, p.Lk, p.D}),
                              mha::Tensor(p.v.data(), {p.B, p.Hkv, p.Lk, p.Dv}),
                              mha::Tensor(out.data(), {p.B, p.H, p.Lq, p.Dv}),
                              mha::Tensor(lse.data(), {p.B, p.H, p.Lq}),
                              mha::Tensor(dout.data(), {p.B, p.H, p.Lq, p.Dv}),
                              mha::Tensor(mine.data(), {p.B, p.H, p.Lq, p.D + 1}),
                              mha::Tensor(mine.data() + nq, {p.B, p.Hkv, p.Lk, p.D}),
                              mha::Tensor(mine.data() + nq + nk, {p.B, p.Hkv, p.Lk, p.Dv})),
      mha::Error);
}

TEST(CppApi, ModuleBackwardMatchesTheCApi) {
  const int64_t B = 2, L = 6, E = 8, H = 2;
  mha::Module module(E, H);
  std::vector<float> w_in = random_values(static_cast<size_t>(3 * E * E), 6),
                     w_out = random_values(static_cast<size_t>(E * E), 7);
  module.set_weight("in_proj_weight", mha::Tensor(w_in.data(), {3 * E, E}));
  module.set_weight("out_proj.weight", mha::Tensor(w_out.data(), {E, E}));
  std::vector<float> x = random_values(static_cast<size_t>(B * L * E), 8),
                     dout = random_values(static_cast<size_t>(B * L * E), 9);
  const mha::ModuleForwardParams params = mha::ModuleForwardParams().causal(MHA_CAUSAL_TOP_LEFT);
  // Self-attention: one gradient for the three inputs (their sum), and
  // in_proj_weight's gradient as three row views of one [3E, E] buffer.
  const size_t nx = x.size(), nw = w_in.size();
  std::vector<float> mine(nx + nw + w_out.size(), -1.0f), theirs(mine.size(), -2.0f);
  const auto grads_in = [&](std::vector<float>& g) {
    return mha::ModuleGradients()
        .query(mha::Tensor(g.data(), {B, L, E}))
        .key(mha::Tensor(g.data(), {B, L, E}))
        .value(mha::Tensor(g.data(), {B, L, E}))
        .q_proj_weight(mha::Tensor(g.data() + nx, {E, E}))
        .k_proj_weight(mha::Tensor(g.data() + nx + E * E, {E, E}))
        .v_proj_weight(mha::Tensor(g.data() + nx + 2 * E * E, {E, E}))
        .out_proj_weight(mha::Tensor(g.data() + nx + nw, {E, E}));
  };
  const mha::ConstTensor input = mha::Tensor(x.data(), {B, L, E});
  module.backward(input, input, input, mha::Tensor(dout.data(), {B, L, E}), grads_in(mine), params);
  const mha::ModuleGradients copied = grads_in(theirs);  // the C struct through a copy
  mha_tensor tx = describe(x.data(), MHA_DTYPE_F32, {B, L, E});
  mha_tensor td = describe(dout.data(), MHA_DTYPE_F32, {B, L, E});
  ASSERT_EQ(mha_module_backward(module.get(), &tx, &tx, &tx, &td, params.get(), copied.get()),
            MHA_OK)
      << mha_last_error();
  EXPECT_TRUE(same_bits(mine, theirs));
  EXPECT_THROW(
      module.backward(input, input, input, mha::Tensor(dout.data(), {B, L, E - 1}), grads_in(mine)),
      mha::Error);

  // The forward call's params as they were, attention weights included: the
  // backward leaves the weights out (the C call refuses them) and gives the
  // same gradients.
  std::vector<float> weights(static_cast<size_t>(B * H * L * L));
  const mha::ModuleForwardParams with_weights =
      mha::ModuleForwardParams()
          .causal(MHA_CAUSAL_TOP_LEFT)
          .attn_weights(mha::Tensor(weights.data(), {B, H, L, L}));
  std::vector<float> again(mine.size(), -3.0f);
  module.backward(input, input, input, mha::Tensor(dout.data(), {B, L, E}), grads_in(again),
                  with_weights);
  EXPECT_TRUE(same_bits(again, theirs));
}

TEST(CppApi, ErrorsCarryTheStatusAndTheCMessage) {
  Problem p;
  std::vector<float> out(p.out_size(), -1.0f);
  const std::vector<float> before = out;
  mha::Tensor q(p.q.data(), {p.B, p.H, p.Lq, p.D});
  mha::Tensor k(p.k.data(), {p.B, p.Hkv, p.Lk, p.D});
  mha::Tensor v(p.v.data(), {p.B, p.Hkv, p.Lk - 1, p.Dv});  // one key short
  std::string message;
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::attention(q, k, v, mha::Tensor(out.data(), {p.B, p.H, p.Lq, p.Dv}));
                },
                &message),
            MHA_ERR_SHAPE_MISMATCH);
  EXPECT_EQ(message, std::string("MHA_ERR_SHAPE_MISMATCH: ") + mha_last_error());
  EXPECT_NE(message.find("v has 10"), std::string::npos) << message;
  EXPECT_TRUE(same_bits(out, before));
}

// Built from temporaries only: every tensor passed to the params object dies
// before the object is used.
mha::AttentionParams params_from_temporaries(const std::vector<int32_t>& lens,
                                             const std::vector<uint8_t>& mask,
                                             std::vector<float>& lse, int64_t B, int64_t H,
                                             int64_t Lq, int64_t Lk) {
  return mha::AttentionParams()
      .valid_lens(mha::Tensor(lens.data(), {B}))
      .mask(mha::Tensor(mask.data(), MHA_DTYPE_BOOL, {Lq, Lk}))
      .lse(mha::Tensor(lse.data(), std::vector<int64_t>{B, H, Lq}))
      .causal(MHA_CAUSAL_TOP_LEFT)
      .scale(0.5f);
}

bool points_into(const void* field, const void* object, size_t size) {
  const auto* f = static_cast<const unsigned char*>(field);
  const auto* o = static_cast<const unsigned char*>(object);
  return f >= o && f < o + size;
}

TEST(CppApi, AttentionParamsOwnTheirDescriptorsThroughCopiesAndMoves) {
  Problem p;
  const std::vector<int32_t> lens = {7, 11};
  std::vector<uint8_t> mask(static_cast<size_t>(p.Lq * p.Lk));
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = (i % 3 != 1) ? 1 : 0;

  // The C API on the same inputs.
  std::vector<float> expected(p.out_size()), expected_lse(p.lse_size());
  {
    mha_tensor c_lens = describe(const_cast<int32_t*>(lens.data()), MHA_DTYPE_I32, {p.B});
    mha_tensor c_mask = describe(mask.data(), MHA_DTYPE_BOOL, {p.Lq, p.Lk});
    mha_tensor c_lse = describe(expected_lse.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq});
    mha_attention_params params;
    mha_attention_params_init(&params);
    params.valid_lens = &c_lens;
    params.mask = &c_mask;
    params.lse = &c_lse;
    params.causal = MHA_CAUSAL_TOP_LEFT;
    params.has_scale = 1;
    params.scale = 0.5f;
    const mha_tensor cq = p.cq(), ck = p.ck(), cv = p.cv();
    mha_tensor cout = describe(expected.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.Dv});
    ASSERT_EQ(mha_attention(&cq, &ck, &cv, &cout, &params), MHA_OK) << mha_last_error();
  }

  std::vector<float> lse(p.lse_size());
  mha::Tensor q(p.q.data(), {p.B, p.H, p.Lq, p.D});
  mha::Tensor k(p.k.data(), {p.B, p.Hkv, p.Lk, p.D});
  mha::Tensor v(p.v.data(), {p.B, p.Hkv, p.Lk, p.Dv});
  auto run = [&](const mha::AttentionParams& params, const char* what) {
    std::vector<float> out(p.out_size(), -1.0f);
    std::fill(lse.begin(), lse.end(), -1.0f);
    ASSERT_NO_THROW(
        mha::attention(q, k, v, mha::Tensor(out.data(), {p.B, p.H, p.Lq, p.Dv}), params))
        << what;
    EXPECT_TRUE(same_bits(out, expected)) << what;
    EXPECT_TRUE(same_bits(lse, expected_lse)) << what;
    // Every tensor pointer points into the object itself.
    const mha_attention_params* c = params.get();
    EXPECT_TRUE(points_into(c->valid_lens, &params, sizeof params)) << what;
    EXPECT_TRUE(points_into(c->mask, &params, sizeof params)) << what;
    EXPECT_TRUE(points_into(c->lse, &params, sizeof params)) << what;
  };

  mha::AttentionParams original = params_from_temporaries(lens, mask, lse, p.B, p.H, p.Lq, p.Lk);
  run(original, "the object built from temporaries");
  mha::AttentionParams copied(original);
  run(copied, "a copy");
  mha::AttentionParams moved(std::move(copied));
  run(moved, "a moved-to object");
  mha::AttentionParams assigned;
  assigned = moved;
  run(assigned, "a copy-assigned object");
  mha::AttentionParams move_assigned;
  move_assigned = std::move(assigned);
  run(move_assigned, "a move-assigned object");
  // The copies do not lean on the original: overwrite it with other settings.
  original = mha::AttentionParams().causal(MHA_CAUSAL_NONE);
  EXPECT_EQ(original.get()->mask, nullptr);
  EXPECT_EQ(original.get()->valid_lens, nullptr);
  EXPECT_EQ(original.get()->lse, nullptr);
  run(move_assigned, "a move-assigned object after the original changed");
  const mha::AttentionParams& alias = move_assigned;
  move_assigned = alias;  // self-assignment keeps the descriptors
  run(move_assigned, "a self-assigned object");
}

// ------------------------------------------------------------------ attention_varlen

// A packed batch of four sequences, one without queries and one without
// keys: q [total_q, H, D], k and v [total_k, Hkv, D/Dv], f32 or int8 K and V
// with row scales [total_k, Hkv].
struct PackedProblem {
  int64_t H = 4, Hkv = 2, D = 8, Dv = 6;
  std::vector<int32_t> cu_q = {0, 4, 4, 11, 13}, cu_k = {0, 6, 9, 16, 16};
  int64_t B = 4, total_q = 13, total_k = 16;
  std::vector<float> q = random_values(static_cast<size_t>(total_q * H * D), 11);
  std::vector<float> k = random_values(static_cast<size_t>(total_k * Hkv * D), 12);
  std::vector<float> v = random_values(static_cast<size_t>(total_k * Hkv * Dv), 13);
  std::vector<float> slopes = random_values(static_cast<size_t>(B * H), 14);
  std::vector<int8_t> k8, v8;
  std::vector<float> k_scale, v_scale;
  PackedProblem() {
    for (float& s : slopes) s = std::fabs(s) * 0.5f;
    Rng rng(15);
    k8.resize(k.size());
    v8.resize(v.size());
    for (auto& x : k8) x = static_cast<int8_t>(rng.integer(-127, 127));
    for (auto& x : v8) x = static_cast<int8_t>(rng.integer(-127, 127));
    for (size_t i = 0; i < static_cast<size_t>(total_k * Hkv); ++i) {
      k_scale.push_back(rng.uniform(0.001f, 0.02f));
      v_scale.push_back(rng.uniform(0.001f, 0.02f));
    }
  }
  size_t out_size() const { return static_cast<size_t>(total_q * H * Dv); }
  size_t lse_size() const { return static_cast<size_t>(H * total_q); }
};

// Rows [first, first + len) of a packed C-order [total, heads, d] tensor as
// the [1, heads, len, d] tensor of a call on that sequence alone.
mha_tensor sequence_view(void* data, mha_dtype dtype, int64_t first, int64_t len, int64_t heads,
                         int64_t d) {
  const int64_t bytes = dtype == MHA_DTYPE_I8 ? 1 : 4;
  return describe(static_cast<char*>(data) + first * heads * d * bytes, dtype, {1, heads, len, d},
                  {0, d, heads * d, 1});
}

TEST(CppApi, AttentionVarlenMatchesTheCApiAndTheReference) {
  PackedProblem p;
  const mha::Tensor cu_q(static_cast<const int32_t*>(p.cu_q.data()), {p.B + 1});
  const mha::Tensor cu_k(static_cast<const int32_t*>(p.cu_k.data()), {p.B + 1});
  for (const bool int8 : {false, true}) {
    SCOPED_TRACE(int8 ? "int8 K and V" : "f32 K and V");
    const mha_dtype kv_dtype = int8 ? MHA_DTYPE_I8 : MHA_DTYPE_F32;
    void* k_data = int8 ? static_cast<void*>(p.k8.data()) : static_cast<void*>(p.k.data());
    void* v_data = int8 ? static_cast<void*>(p.v8.data()) : static_cast<void*>(p.v.data());
    std::vector<float> out(p.out_size(), -1.0f), lse(p.lse_size(), -1.0f);
    std::vector<float> expected(p.out_size(), -2.0f), expected_lse(p.lse_size(), -2.0f);

    mha::AttentionParams params = mha::AttentionParams()
                                      .causal(MHA_CAUSAL_BOTTOM_RIGHT)
                                      .window(3, 0)
                                      .softcap(4.0f)
                                      .alibi_slopes(mha::Tensor(p.slopes.data(), {p.B, p.H}))
                                      .lse(mha::Tensor(lse.data(), {p.H, p.total_q}));
    if (int8) {
      params.kv_scales(mha::Tensor(p.k_scale.data(), {p.total_k, p.Hkv}),
                       mha::Tensor(p.v_scale.data(), {p.total_k, p.Hkv}));
    }
    const mha::AttentionParams copied = params;  // the scales travel with a copy
    if (int8) {
      EXPECT_TRUE(points_into(copied.get()->k_scale, &copied, sizeof copied));
      EXPECT_TRUE(points_into(copied.get()->v_scale, &copied, sizeof copied));
    }
    mha::attention_varlen(
        mha::Tensor(static_cast<const float*>(p.q.data()), {p.total_q, p.H, p.D}),
        mha::Tensor(static_cast<const void*>(k_data), kv_dtype, {p.total_k, p.Hkv, p.D}),
        mha::Tensor(static_cast<const void*>(v_data), kv_dtype, {p.total_k, p.Hkv, p.Dv}),
        mha::Tensor(out.data(), {p.total_q, p.H, p.Dv}), cu_q, cu_k, copied);

    // The C API on the same inputs.
    mha_tensor tq = describe(p.q.data(), MHA_DTYPE_F32, {p.total_q, p.H, p.D});
    mha_tensor tk = describe(k_data, kv_dtype, {p.total_k, p.Hkv, p.D});
    mha_tensor tv = describe(v_data, kv_dtype, {p.total_k, p.Hkv, p.Dv});
    mha_tensor tout = describe(expected.data(), MHA_DTYPE_F32, {p.total_q, p.H, p.Dv});
    mha_tensor tlse = describe(expected_lse.data(), MHA_DTYPE_F32, {p.H, p.total_q});
    mha_tensor tslopes = describe(p.slopes.data(), MHA_DTYPE_F32, {p.B, p.H});
    mha_tensor tks = describe(p.k_scale.data(), MHA_DTYPE_F32, {p.total_k, p.Hkv});
    mha_tensor tvs = describe(p.v_scale.data(), MHA_DTYPE_F32, {p.total_k, p.Hkv});
    mha_tensor tcu_q = describe(p.cu_q.data(), MHA_DTYPE_I32, {p.B + 1});
    mha_tensor tcu_k = describe(p.cu_k.data(), MHA_DTYPE_I32, {p.B + 1});
    mha_varlen_params varlen;
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &tcu_q;
    varlen.cu_seqlens_k = &tcu_k;
    mha_attention_params c;
    mha_attention_params_init(&c);
    c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    c.window_left = 3;
    c.window_right = 0;
    c.softcap = 4.0f;
    c.alibi_slopes = &tslopes;
    c.lse = &tlse;
    if (int8) {
      c.k_scale = &tks;
      c.v_scale = &tvs;
    }
    ASSERT_EQ(mha_attention_varlen(&tq, &tk, &tv, &tout, &varlen, &c), MHA_OK) << mha_last_error();
    EXPECT_TRUE(same_bits(out, expected));
    EXPECT_TRUE(same_bits(lse, expected_lse));

    // Each sequence against the reference on that sequence alone.
    for (int64_t b = 0; b < p.B; ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const int64_t q0 = p.cu_q[static_cast<size_t>(b)], k0 = p.cu_k[static_cast<size_t>(b)];
      const int64_t lq = p.cu_q[static_cast<size_t>(b) + 1] - q0;
      const int64_t lk = p.cu_k[static_cast<size_t>(b) + 1] - k0;
      if (lq == 0) continue;
      if (lk == 0) {
        for (int64_t i = q0; i < q0 + lq; ++i) {
          for (int64_t h = 0; h < p.H; ++h) {
            EXPECT_EQ(lse[static_cast<size_t>(h * p.total_q + i)], -INFINITY);
            for (int64_t x = 0; x < p.Dv; ++x) {
              EXPECT_EQ(out[static_cast<size_t>((i * p.H + h) * p.Dv + x)], 0.0f);
            }
          }
        }
        continue;
      }
      mha_attention_params alone = c;
      alone.lse = nullptr;
      mha_tensor row = describe(p.slopes.data() + b * p.H, MHA_DTYPE_F32, {p.H});
      alone.alibi_slopes = &row;
      mha_tensor ks =
          describe(p.k_scale.data() + k0 * p.Hkv, MHA_DTYPE_F32, {1, p.Hkv, lk}, {0, 1, p.Hkv});
      mha_tensor vs =
          describe(p.v_scale.data() + k0 * p.Hkv, MHA_DTYPE_F32, {1, p.Hkv, lk}, {0, 1, p.Hkv});
      if (int8) {
        alone.k_scale = &ks;
        alone.v_scale = &vs;
      }
      const Reference ref =
          reference_attention(sequence_view(p.q.data(), MHA_DTYPE_F32, q0, lq, p.H, p.D),
                              sequence_view(k_data, kv_dtype, k0, lk, p.Hkv, p.D),
                              sequence_view(v_data, kv_dtype, k0, lk, p.Hkv, p.Dv), &alone);
      const mha_tensor mine = sequence_view(out.data(), MHA_DTYPE_F32, q0, lq, p.H, p.Dv);
      EXPECT_LE(max_abs_error(mine, ref), tolerance(ref));
      for (int64_t h = 0; h < p.H; ++h) {
        for (int64_t i = 0; i < lq; ++i) {
          const double want = ref.lse[static_cast<size_t>(h * lq + i)];
          const float got = lse[static_cast<size_t>(h * p.total_q + q0 + i)];
          if (std::isinf(want)) {
            EXPECT_EQ(got, want);
          } else {
            EXPECT_NEAR(got, want, lse_tolerance(ref, want));
          }
        }
      }
    }
  }
}

// attention_varlen_backward: the same bits as the C call (sinks' gradient
// included), and mha::Error naming the argument on bad input.
TEST(CppApi, AttentionVarlenBackwardMatchesTheCApi) {
  PackedProblem p;
  const size_t dq_size = p.q.size(), dk_size = p.k.size(), dv_size = p.v.size();
  std::vector<float> out(p.out_size()), lse(p.lse_size());
  const std::vector<float> dout = random_values(p.out_size(), 16);
  const std::vector<float> sinks = random_values(static_cast<size_t>(p.H), 17);
  const mha::Tensor q(static_cast<const float*>(p.q.data()), {p.total_q, p.H, p.D});
  const mha::Tensor k(static_cast<const float*>(p.k.data()), {p.total_k, p.Hkv, p.D});
  const mha::Tensor v(static_cast<const float*>(p.v.data()), {p.total_k, p.Hkv, p.Dv});
  const mha::VarlenParams varlen = mha::VarlenParams()
                                       .cu_seqlens_q(mha::Tensor(p.cu_q.data(), {p.B + 1}))
                                       .cu_seqlens_k(mha::Tensor(p.cu_k.data(), {p.B + 1}));
  const mha::AttentionParams params = mha::AttentionParams()
                                          .causal(MHA_CAUSAL_BOTTOM_RIGHT)
                                          .alibi_slopes(mha::Tensor(p.slopes.data(), {p.B, p.H}))
                                          .sinks(mha::Tensor(sinks.data(), {p.H}));
  mha::attention_varlen(
      q, k, v, mha::Tensor(out.data(), {p.total_q, p.H, p.Dv}), varlen,
      mha::AttentionParams(params).lse(mha::Tensor(lse.data(), {p.H, p.total_q})));
  std::vector<float> dq(dq_size, -1.0f), dk(dk_size, -1.0f), dv(dv_size, -1.0f), ds(4, -1.0f);
  mha::attention_varlen_backward(
      q, k, v, mha::Tensor(static_cast<const float*>(out.data()), {p.total_q, p.H, p.Dv}),
      mha::Tensor(static_cast<const float*>(lse.data()), {p.H, p.total_q}),
      mha::Tensor(dout.data(), {p.total_q, p.H, p.Dv}),
      mha::Tensor(dq.data(), {p.total_q, p.H, p.D}),
      mha::Tensor(dk.data(), {p.total_k, p.Hkv, p.D}),
      mha::Tensor(dv.data(), {p.total_k, p.Hkv, p.Dv}), varlen, params,
      mha::BackwardParams().dsinks(mha::Tensor(ds.data(), {p.H})));

  // The C API on the same inputs.
  std::vector<float> cdq(dq_size, -2.0f), cdk(dk_size, -2.0f), cdv(dv_size, -2.0f), cds(4, -2.0f);
  mha_tensor tq = describe(p.q.data(), MHA_DTYPE_F32, {p.total_q, p.H, p.D});
  mha_tensor tk = describe(p.k.data(), MHA_DTYPE_F32, {p.total_k, p.Hkv, p.D});
  mha_tensor tv = describe(p.v.data(), MHA_DTYPE_F32, {p.total_k, p.Hkv, p.Dv});
  mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {p.total_q, p.H, p.Dv});
  mha_tensor tl = describe(lse.data(), MHA_DTYPE_F32, {p.H, p.total_q});
  mha_tensor td = describe(const_cast<float*>(dout.data()), MHA_DTYPE_F32, {p.total_q, p.H, p.Dv});
  mha_tensor tdq = describe(cdq.data(), MHA_DTYPE_F32, {p.total_q, p.H, p.D});
  mha_tensor tdk = describe(cdk.data(), MHA_DTYPE_F32, {p.total_k, p.Hkv, p.D});
  mha_tensor tdv = describe(cdv.data(), MHA_DTYPE_F32, {p.total_k, p.Hkv, p.Dv});
  mha_tensor tds = describe(cds.data(), MHA_DTYPE_F32, {p.H});
  mha_backward_params backward;
  mha_backward_params_init(&backward);
  backward.dsinks = &tds;
  ASSERT_EQ(mha_attention_varlen_backward(&tq, &tk, &tv, &to, &tl, &td, &tdq, &tdk, &tdv,
                                          varlen.get(), params.get(), &backward),
            MHA_OK)
      << mha_last_error();
  EXPECT_TRUE(same_bits(dq, cdq));
  EXPECT_TRUE(same_bits(dk, cdk));
  EXPECT_TRUE(same_bits(dv, cdv));
  EXPECT_TRUE(same_bits(ds, cds));
  // Sequence 1 has no queries: its key rows get zeros.
  for (int64_t j = p.cu_k[1] * p.Hkv * p.D; j < p.cu_k[2] * p.Hkv * p.D; ++j) {
    EXPECT_EQ(dk[static_cast<size_t>(j)], 0.0f);
  }

  std::string message;
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::attention_varlen_backward(
                      q, k, v,
                      mha::Tensor(static_cast<const float*>(out.data()), {p.total_q, p.H, p.Dv}),
                      mha::Tensor(static_cast<const float*>(lse.data()), {p.H, p.total_q}),
                      mha::Tensor(dout.data(), {p.total_q, p.H, p.Dv}),
                      mha::Tensor(dq.data(), {p.total_q, p.H, p.D}),
                      mha::Tensor(dk.data(), {p.total_k, p.Hkv, p.D}),
                      mha::Tensor(dv.data(), {p.total_k, p.Hkv, p.Dv - 1}), varlen);
                },
                &message),
            MHA_ERR_SHAPE_MISMATCH);
  EXPECT_NE(message.find("dv has shape"), std::string::npos) << message;
}

TEST(CppApi, AttentionVarlenErrorsNameTheArgument) {
  PackedProblem p;
  std::vector<float> out(p.out_size(), -1.0f);
  const std::vector<float> before = out;
  mha::Tensor q(p.q.data(), {p.total_q, p.H, p.D});
  mha::Tensor k(p.k.data(), {p.total_k, p.Hkv, p.D});
  mha::Tensor v(p.v.data(), {p.total_k, p.Hkv, p.Dv});
  const std::vector<int32_t> short_total = {0, 4, 4, 11, 12};  // one query short of q's rows
  std::string message;
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::attention_varlen(q, k, v, mha::Tensor(out.data(), {p.total_q, p.H, p.Dv}),
                                        mha::Tensor(short_total.data(), {p.B + 1}),
                                        mha::Tensor(p.cu_k.data(), {p.B + 1}));
                },
                &message),
            MHA_ERR_SHAPE_MISMATCH);
  EXPECT_EQ(message, std::string("MHA_ERR_SHAPE_MISMATCH: ") + mha_last_error());
  EXPECT_NE(message.find("cu_seqlens_q[4] = 12"), std::string::npos) << message;
  const std::vector<int32_t> lens = {4, 0, 7, 2};
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::attention_varlen(
                      q, k, v, mha::Tensor(out.data(), {p.total_q, p.H, p.Dv}),
                      mha::Tensor(p.cu_q.data(), {p.B + 1}), mha::Tensor(p.cu_k.data(), {p.B + 1}),
                      mha::AttentionParams().valid_lens(mha::Tensor(lens.data(), {p.B})));
                },
                &message),
            MHA_ERR_INVALID_VALUE);
  EXPECT_NE(message.find("valid_lens"), std::string::npos) << message;
  EXPECT_TRUE(same_bits(out, before));
}

// ------------------------------------------------------------------ a paged KV cache

// Three sequences over a paged cache [num_blocks, 8, Hkv, D] whose blocks are
// shuffled: one decoding (1 query over 13 keys), one chunked prefill (5
// queries at the end of 21 keys), one with 3 queries over 8 keys (one full
// block).  Two blocks no sequence uses hold NaN (int8: NaN scales), and the
// table's unused entries garbage, so a call that reads either is caught.
struct PagedProblem {
  int64_t H = 4, Hkv = 2, D = 8, Dv = 6, block = 8, B = 3, max_blocks = 3, num_blocks = 8;
  std::vector<int32_t> cu_q = {0, 1, 6, 9}, used = {13, 21, 8};
  int64_t total_q = 9;
  std::vector<int32_t> table;  // [B, max_blocks]
  std::vector<float> q = random_values(static_cast<size_t>(total_q * H * D), 21);
  std::vector<float> k = random_values(static_cast<size_t>(num_blocks * block * Hkv * D), 22);
  std::vector<float> v = random_values(static_cast<size_t>(num_blocks * block * Hkv * Dv), 23);
  std::vector<int8_t> k8, v8;
  std::vector<float> k_scale, v_scale;  // [num_blocks, block, Hkv]
  PagedProblem() {
    // Blocks 0..7 in a shuffled order: sequence 0 gets 2, sequence 1 gets 3,
    // sequence 2 gets 1; the last two are spare.
    const std::vector<int32_t> order = {5, 2, 7, 0, 3, 6, 1, 4};
    table = {order[0], order[1], -1, order[2], order[3], order[4], order[5], 999, -7};
    Rng rng(24);
    k8.resize(k.size());
    v8.resize(v.size());
    for (auto& x : k8) x = static_cast<int8_t>(rng.integer(-127, 127));
    for (auto& x : v8) x = static_cast<int8_t>(rng.integer(-127, 127));
    for (size_t i = 0; i < static_cast<size_t>(num_blocks * block * Hkv); ++i) {
      k_scale.push_back(rng.uniform(0.001f, 0.02f));
      v_scale.push_back(rng.uniform(0.001f, 0.02f));
    }
    for (const int32_t spare : {order[6], order[7]}) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      const auto rows = static_cast<size_t>(block * Hkv);
      const auto first = static_cast<size_t>(spare) * rows;
      std::fill_n(k.begin() + static_cast<std::ptrdiff_t>(first * static_cast<size_t>(D)),
                  rows * static_cast<size_t>(D), nan);
      std::fill_n(v.begin() + static_cast<std::ptrdiff_t>(first * static_cast<size_t>(Dv)),
                  rows * static_cast<size_t>(Dv), nan);
      std::fill_n(k_scale.begin() + static_cast<std::ptrdiff_t>(first), rows, nan);
      std::fill_n(v_scale.begin() + static_cast<std::ptrdiff_t>(first), rows, nan);
    }
  }
  size_t out_size() const { return static_cast<size_t>(total_q * H * Dv); }
  size_t lse_size() const { return static_cast<size_t>(H * total_q); }
  // The cache row (block · block_size + row) of key j of sequence b.
  int64_t slot(int64_t b, int64_t j) const {
    return table[static_cast<size_t>(b * max_blocks + j / block)] * block + j % block;
  }
};

// Sequence b's keys (and, int8, their scales) gathered from the pages into a
// dense [1, Hkv, lk, d] copy, for the reference.
struct Gathered {
  std::vector<float> values;  // f32 keys, or int8 keys already times their scales
  mha_tensor tensor{};
};
Gathered gather(const PagedProblem& p, int64_t b, const std::vector<float>& cache,
                const std::vector<int8_t>& cache8, const std::vector<float>& scales, int64_t d,
                bool int8) {
  Gathered g;
  const int64_t lk = p.used[static_cast<size_t>(b)];
  g.values.resize(static_cast<size_t>(lk * p.Hkv * d));
  for (int64_t j = 0; j < lk; ++j) {
    const int64_t slot = p.slot(b, j);
    for (int64_t h = 0; h < p.Hkv; ++h) {
      for (int64_t x = 0; x < d; ++x) {
        const auto from = static_cast<size_t>((slot * p.Hkv + h) * d + x);
        g.values[static_cast<size_t>((j * p.Hkv + h) * d + x)] =
            int8 ? static_cast<float>(cache8[from]) * scales[static_cast<size_t>(slot * p.Hkv + h)]
                 : cache[from];
      }
    }
  }
  g.tensor = describe(g.values.data(), MHA_DTYPE_F32, {1, p.Hkv, lk, d}, {0, d, p.Hkv * d, 1});
  return g;
}

TEST(CppApi, AttentionVarlenOverAPagedCacheMatchesTheCApiAndTheReference) {
  PagedProblem p;
  for (const bool int8 : {false, true}) {
    SCOPED_TRACE(int8 ? "int8 cache" : "f32 cache");
    const mha_dtype kv_dtype = int8 ? MHA_DTYPE_I8 : MHA_DTYPE_F32;
    void* k_data = int8 ? static_cast<void*>(p.k8.data()) : static_cast<void*>(p.k.data());
    void* v_data = int8 ? static_cast<void*>(p.v8.data()) : static_cast<void*>(p.v.data());
    std::vector<float> out(p.out_size(), -1.0f), lse(p.lse_size(), -1.0f);
    std::vector<float> expected(p.out_size(), -2.0f), expected_lse(p.lse_size(), -2.0f);

    mha::AttentionParams params = mha::AttentionParams()
                                      .causal(MHA_CAUSAL_BOTTOM_RIGHT)
                                      .softcap(3.0f)
                                      .lse(mha::Tensor(lse.data(), {p.H, p.total_q}));
    if (int8) {
      params.kv_scales(mha::Tensor(p.k_scale.data(), {p.num_blocks, p.block, p.Hkv}),
                       mha::Tensor(p.v_scale.data(), {p.num_blocks, p.block, p.Hkv}));
    }
    mha::attention_varlen(
        mha::Tensor(static_cast<const float*>(p.q.data()), {p.total_q, p.H, p.D}),
        mha::Tensor(static_cast<const void*>(k_data), kv_dtype,
                    {p.num_blocks, p.block, p.Hkv, p.D}),
        mha::Tensor(static_cast<const void*>(v_data), kv_dtype,
                    {p.num_blocks, p.block, p.Hkv, p.Dv}),
        mha::Tensor(out.data(), {p.total_q, p.H, p.Dv}),
        mha::VarlenParams()
            .cu_seqlens_q(mha::Tensor(static_cast<const int32_t*>(p.cu_q.data()), {p.B + 1}))
            .seqused_k(mha::Tensor(static_cast<const int32_t*>(p.used.data()), {p.B}))
            .block_table(
                mha::Tensor(static_cast<const int32_t*>(p.table.data()), {p.B, p.max_blocks})),
        params);

    // The C API on the same inputs.
    mha_tensor tq = describe(p.q.data(), MHA_DTYPE_F32, {p.total_q, p.H, p.D});
    mha_tensor tk = describe(k_data, kv_dtype, {p.num_blocks, p.block, p.Hkv, p.D});
    mha_tensor tv = describe(v_data, kv_dtype, {p.num_blocks, p.block, p.Hkv, p.Dv});
    mha_tensor tout = describe(expected.data(), MHA_DTYPE_F32, {p.total_q, p.H, p.Dv});
    mha_tensor tlse = describe(expected_lse.data(), MHA_DTYPE_F32, {p.H, p.total_q});
    mha_tensor tks = describe(p.k_scale.data(), MHA_DTYPE_F32, {p.num_blocks, p.block, p.Hkv});
    mha_tensor tvs = describe(p.v_scale.data(), MHA_DTYPE_F32, {p.num_blocks, p.block, p.Hkv});
    mha_tensor tcu_q = describe(p.cu_q.data(), MHA_DTYPE_I32, {p.B + 1});
    mha_tensor tused = describe(p.used.data(), MHA_DTYPE_I32, {p.B});
    mha_tensor ttable = describe(p.table.data(), MHA_DTYPE_I32, {p.B, p.max_blocks});
    mha_varlen_params varlen;
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &tcu_q;
    varlen.seqused_k = &tused;
    varlen.block_table = &ttable;
    mha_attention_params c;
    mha_attention_params_init(&c);
    c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    c.softcap = 3.0f;
    c.lse = &tlse;
    if (int8) {
      c.k_scale = &tks;
      c.v_scale = &tvs;
    }
    ASSERT_EQ(mha_attention_varlen(&tq, &tk, &tv, &tout, &varlen, &c), MHA_OK) << mha_last_error();
    EXPECT_TRUE(same_bits(out, expected));
    EXPECT_TRUE(same_bits(lse, expected_lse));

    // Each sequence against the reference on its keys gathered densely.
    for (int64_t b = 0; b < p.B; ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const int64_t q0 = p.cu_q[static_cast<size_t>(b)];
      const int64_t lq = p.cu_q[static_cast<size_t>(b) + 1] - q0;
      const Gathered keys = gather(p, b, p.k, p.k8, p.k_scale, p.D, int8);
      const Gathered values = gather(p, b, p.v, p.v8, p.v_scale, p.Dv, int8);
      mha_attention_params alone = c;
      alone.lse = nullptr;
      alone.k_scale = nullptr;
      alone.v_scale = nullptr;
      const Reference ref =
          reference_attention(sequence_view(p.q.data(), MHA_DTYPE_F32, q0, lq, p.H, p.D),
                              keys.tensor, values.tensor, &alone);
      const mha_tensor mine = sequence_view(out.data(), MHA_DTYPE_F32, q0, lq, p.H, p.Dv);
      EXPECT_LE(max_abs_error(mine, ref), tolerance(ref));
      for (int64_t h = 0; h < p.H; ++h) {
        for (int64_t i = 0; i < lq; ++i) {
          const double want = ref.lse[static_cast<size_t>(h * lq + i)];
          EXPECT_NEAR(lse[static_cast<size_t>(h * p.total_q + q0 + i)], want,
                      lse_tolerance(ref, want));
        }
      }
    }
  }
}

// Built from temporaries only, as params_from_temporaries.
mha::VarlenParams paged_from_temporaries(const PagedProblem& p) {
  return mha::VarlenParams()
      .cu_seqlens_q(mha::Tensor(p.cu_q.data(), {p.B + 1}))
      .seqused_k(mha::Tensor(p.used.data(), {p.B}))
      .block_table(mha::Tensor(p.table.data(), std::vector<int64_t>{p.B, p.max_blocks}));
}

TEST(CppApi, VarlenParamsOwnTheirDescriptorsThroughCopiesAndMoves) {
  PagedProblem p;
  const mha::Tensor q(static_cast<const float*>(p.q.data()), {p.total_q, p.H, p.D});
  const mha::Tensor k(static_cast<const float*>(p.k.data()), {p.num_blocks, p.block, p.Hkv, p.D});
  const mha::Tensor v(static_cast<const float*>(p.v.data()), {p.num_blocks, p.block, p.Hkv, p.Dv});
  std::vector<float> expected(p.out_size());
  mha::attention_varlen(q, k, v, mha::Tensor(expected.data(), {p.total_q, p.H, p.Dv}),
                        paged_from_temporaries(p));
  auto run = [&](const mha::VarlenParams& varlen, const char* what) {
    std::vector<float> out(p.out_size(), -1.0f);
    ASSERT_NO_THROW(
        mha::attention_varlen(q, k, v, mha::Tensor(out.data(), {p.total_q, p.H, p.Dv}), varlen))
        << what;
    EXPECT_TRUE(same_bits(out, expected)) << what;
    const mha_varlen_params* c = varlen.get();
    EXPECT_EQ(c->struct_size, sizeof(mha_varlen_params)) << what;
    EXPECT_TRUE(points_into(c->cu_seqlens_q, &varlen, sizeof varlen)) << what;
    EXPECT_TRUE(points_into(c->seqused_k, &varlen, sizeof varlen)) << what;
    EXPECT_TRUE(points_into(c->block_table, &varlen, sizeof varlen)) << what;
    EXPECT_EQ(c->cu_seqlens_k, nullptr) << what;
  };
  mha::VarlenParams original = paged_from_temporaries(p);
  run(original, "the object built from temporaries");
  mha::VarlenParams copied(original);
  mha::VarlenParams moved(std::move(original));
  original = mha::VarlenParams();
  EXPECT_EQ(original.get()->block_table, nullptr);
  EXPECT_EQ(original.get()->seqused_k, nullptr);
  run(copied, "a copy");
  run(moved, "a moved-to object");
  mha::VarlenParams assigned;
  assigned = copied;
  copied = mha::VarlenParams();
  run(assigned, "a copy-assigned object");
  mha::VarlenParams move_assigned;
  move_assigned = std::move(assigned);
  run(move_assigned, "a move-assigned object");
  const mha::VarlenParams& alias = move_assigned;
  move_assigned = alias;  // self-assignment keeps the descriptors
  run(move_assigned, "a self-assigned object");

  // Packed keys through a VarlenParams: the bits of the positional overload,
  // and seqused_k as the C API takes it.
  PackedProblem packed;
  const mha::Tensor pq(static_cast<const float*>(packed.q.data()),
                       {packed.total_q, packed.H, packed.D});
  const mha::Tensor pk(static_cast<const float*>(packed.k.data()),
                       {packed.total_k, packed.Hkv, packed.D});
  const mha::Tensor pv(static_cast<const float*>(packed.v.data()),
                       {packed.total_k, packed.Hkv, packed.Dv});
  const mha::Tensor cu_q(static_cast<const int32_t*>(packed.cu_q.data()), {packed.B + 1});
  const mha::Tensor cu_k(static_cast<const int32_t*>(packed.cu_k.data()), {packed.B + 1});
  const std::vector<int64_t> out_shape = {packed.total_q, packed.H, packed.Dv};
  std::vector<float> positional(packed.out_size()), built(packed.out_size(), -1.0f);
  const auto causal = mha::AttentionParams().causal(MHA_CAUSAL_BOTTOM_RIGHT);
  mha::attention_varlen(pq, pk, pv, mha::Tensor(positional.data(), out_shape), cu_q, cu_k, causal);
  mha::attention_varlen(pq, pk, pv, mha::Tensor(built.data(), out_shape),
                        mha::VarlenParams().cu_seqlens_q(cu_q).cu_seqlens_k(cu_k), causal);
  EXPECT_TRUE(same_bits(built, positional));
  std::vector<int32_t> used = {3, 2, 5, 0};
  std::vector<float> c_out(packed.out_size(), -2.0f);
  mha::attention_varlen(pq, pk, pv, mha::Tensor(built.data(), out_shape),
                        mha::VarlenParams().cu_seqlens_q(cu_q).cu_seqlens_k(cu_k).seqused_k(
                            mha::Tensor(used.data(), {packed.B})),
                        causal);
  mha_tensor tq = describe(packed.q.data(), MHA_DTYPE_F32, {packed.total_q, packed.H, packed.D});
  mha_tensor tk = describe(packed.k.data(), MHA_DTYPE_F32, {packed.total_k, packed.Hkv, packed.D});
  mha_tensor tv = describe(packed.v.data(), MHA_DTYPE_F32, {packed.total_k, packed.Hkv, packed.Dv});
  mha_tensor tout = describe(c_out.data(), MHA_DTYPE_F32, out_shape);
  mha_tensor tcu_q = describe(packed.cu_q.data(), MHA_DTYPE_I32, {packed.B + 1});
  mha_tensor tcu_k = describe(packed.cu_k.data(), MHA_DTYPE_I32, {packed.B + 1});
  mha_tensor tused = describe(used.data(), MHA_DTYPE_I32, {packed.B});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &tcu_q;
  varlen.cu_seqlens_k = &tcu_k;
  varlen.seqused_k = &tused;
  mha_attention_params c;
  mha_attention_params_init(&c);
  c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  ASSERT_EQ(mha_attention_varlen(&tq, &tk, &tv, &tout, &varlen, &c), MHA_OK) << mha_last_error();
  EXPECT_TRUE(same_bits(built, c_out));
  EXPECT_FALSE(same_bits(built, positional));  // seqused_k changed something
}

TEST(CppApi, AttentionVarlenPagedErrorsNameTheArgument) {
  PagedProblem p;
  std::vector<float> out(p.out_size(), -1.0f);
  const std::vector<float> before = out;
  const mha::Tensor q(static_cast<const float*>(p.q.data()), {p.total_q, p.H, p.D});
  const mha::Tensor k(static_cast<const float*>(p.k.data()), {p.num_blocks, p.block, p.Hkv, p.D});
  const mha::Tensor v(static_cast<const float*>(p.v.data()), {p.num_blocks, p.block, p.Hkv, p.Dv});
  const mha::Tensor cu_q(static_cast<const int32_t*>(p.cu_q.data()), {p.B + 1});
  const mha::Tensor used(static_cast<const int32_t*>(p.used.data()), {p.B});
  std::vector<int32_t> bad_table = p.table;
  bad_table[3] = static_cast<int32_t>(p.num_blocks);  // sequence 1's first block
  struct Case {
    const char* what;
    mha_status status;
    const char* named;
    mha::VarlenParams varlen;
  };
  const mha::Tensor table(static_cast<const int32_t*>(p.table.data()), {p.B, p.max_blocks});
  const std::vector<Case> cases = {
      {"block id past the cache", MHA_ERR_INVALID_VALUE, "block_table[1][0]",
       mha::VarlenParams().cu_seqlens_q(cu_q).seqused_k(used).block_table(
           mha::Tensor(static_cast<const int32_t*>(bad_table.data()), {p.B, p.max_blocks}))},
      {"no seqused_k", MHA_ERR_NULL_POINTER, "seqused_k",
       mha::VarlenParams().cu_seqlens_q(cu_q).block_table(table)},
      {"cu_seqlens_k with a block table", MHA_ERR_INVALID_VALUE, "cu_seqlens_k",
       mha::VarlenParams().cu_seqlens_q(cu_q).cu_seqlens_k(cu_q).seqused_k(used).block_table(
           table)},
      {"no cu_seqlens_q", MHA_ERR_NULL_POINTER, "cu_seqlens_q",
       mha::VarlenParams().seqused_k(used).block_table(table)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::string message;
    const mha_status status = thrown_status(
        [&] {
          mha::attention_varlen(q, k, v, mha::Tensor(out.data(), {p.total_q, p.H, p.Dv}), c.varlen);
        },
        &message);
    EXPECT_EQ(status, c.status);
    EXPECT_EQ(message, std::string(mha_status_name(status)) + ": " + mha_last_error());
    EXPECT_NE(message.find(c.named), std::string::npos) << message;
    EXPECT_TRUE(same_bits(out, before));
  }
}

// ------------------------------------------------------------------ kv_cache_write

// T new tokens written through a shuffled slot mapping (one skipped, -1)
// into a cache of 3 blocks of 8 rows: f32 and int8 caches.
struct CacheProblem {
  int64_t T = 7, Hkv = 2, D = 8, Dv = 6, blocks = 3, block = 8;
  std::vector<float> key = random_values(static_cast<size_t>(T * Hkv * D), 31);
  std::vector<float> value = random_values(static_cast<size_t>(T * Hkv * Dv), 32);
  std::vector<int64_t> slots = {17, 3, -1, 22, 8, 0, 15};
  size_t rows() const { return static_cast<size_t>(blocks * block * Hkv); }
};

TEST(CppApi, KvCacheWriteMatchesTheCApi) {
  CacheProblem w;
  const mha::Tensor key(static_cast<const float*>(w.key.data()), {w.T, w.Hkv, w.D});
  const mha::Tensor value(static_cast<const float*>(w.value.data()), {w.T, w.Hkv, w.Dv});
  const mha::Tensor slots(static_cast<const int64_t*>(w.slots.data()), {w.T});
  const std::vector<int64_t> k_shape = {w.blocks, w.block, w.Hkv, w.D};
  const std::vector<int64_t> v_shape = {w.blocks, w.block, w.Hkv, w.Dv};
  const std::vector<int64_t> s_shape = {w.blocks, w.block, w.Hkv};
  mha_tensor tkey = describe(w.key.data(), MHA_DTYPE_F32, {w.T, w.Hkv, w.D});
  mha_tensor tvalue = describe(w.value.data(), MHA_DTYPE_F32, {w.T, w.Hkv, w.Dv});
  mha_tensor tslots = describe(w.slots.data(), MHA_DTYPE_I64, {w.T});

  // f32: every written row is its token's, untouched rows keep their marker.
  const float marker = -5.0f;
  std::vector<float> k_cache(w.rows() * static_cast<size_t>(w.D), marker);
  std::vector<float> v_cache(w.rows() * static_cast<size_t>(w.Dv), marker);
  std::vector<float> k_expected = k_cache, v_expected = v_cache;
  mha::kv_cache_write(key, value, mha::Tensor(k_cache.data(), k_shape),
                      mha::Tensor(v_cache.data(), v_shape), slots);
  mha_tensor tkc = describe(k_expected.data(), MHA_DTYPE_F32, k_shape);
  mha_tensor tvc = describe(v_expected.data(), MHA_DTYPE_F32, v_shape);
  ASSERT_EQ(mha_kv_cache_write(&tkey, &tvalue, &tkc, &tvc, &tslots, nullptr, nullptr), MHA_OK)
      << mha_last_error();
  EXPECT_TRUE(same_bits(k_cache, k_expected));
  EXPECT_TRUE(same_bits(v_cache, v_expected));
  std::vector<bool> written(static_cast<size_t>(w.blocks * w.block), false);
  for (int64_t t = 0; t < w.T; ++t) {
    const int64_t slot = w.slots[static_cast<size_t>(t)];
    if (slot < 0) continue;
    written[static_cast<size_t>(slot)] = true;
    for (int64_t x = 0; x < w.Hkv * w.D; ++x) {
      ASSERT_EQ(k_cache[static_cast<size_t>(slot * w.Hkv * w.D + x)],
                w.key[static_cast<size_t>(t * w.Hkv * w.D + x)])
          << "token " << t;
    }
    for (int64_t x = 0; x < w.Hkv * w.Dv; ++x) {
      ASSERT_EQ(v_cache[static_cast<size_t>(slot * w.Hkv * w.Dv + x)],
                w.value[static_cast<size_t>(t * w.Hkv * w.Dv + x)])
          << "token " << t;
    }
  }
  for (int64_t slot = 0; slot < w.blocks * w.block; ++slot) {
    if (written[static_cast<size_t>(slot)]) continue;
    for (int64_t x = 0; x < w.Hkv * w.D; ++x) {
      ASSERT_EQ(k_cache[static_cast<size_t>(slot * w.Hkv * w.D + x)], marker) << "slot " << slot;
    }
  }

  // int8 with the scale caches: the C API's bytes, each row within half a
  // step of its scale = max|row| / 127.
  std::vector<int8_t> k8(w.rows() * static_cast<size_t>(w.D), 0);
  std::vector<int8_t> v8(w.rows() * static_cast<size_t>(w.Dv), 0);
  std::vector<float> ks(w.rows(), -1.0f), vs(w.rows(), -1.0f);
  std::vector<int8_t> k8_expected = k8, v8_expected = v8;
  std::vector<float> ks_expected = ks, vs_expected = vs;
  mha::kv_cache_write(key, value, mha::Tensor(k8.data(), MHA_DTYPE_I8, k_shape),
                      mha::Tensor(v8.data(), MHA_DTYPE_I8, v_shape), slots,
                      mha::Tensor(ks.data(), s_shape), mha::Tensor(vs.data(), s_shape));
  mha_tensor tk8 = describe(k8_expected.data(), MHA_DTYPE_I8, k_shape);
  mha_tensor tv8 = describe(v8_expected.data(), MHA_DTYPE_I8, v_shape);
  mha_tensor tks = describe(ks_expected.data(), MHA_DTYPE_F32, s_shape);
  mha_tensor tvs = describe(vs_expected.data(), MHA_DTYPE_F32, s_shape);
  ASSERT_EQ(mha_kv_cache_write(&tkey, &tvalue, &tk8, &tv8, &tslots, &tks, &tvs), MHA_OK)
      << mha_last_error();
  EXPECT_EQ(k8, k8_expected);
  EXPECT_EQ(v8, v8_expected);
  EXPECT_TRUE(same_bits(ks, ks_expected));
  EXPECT_TRUE(same_bits(vs, vs_expected));
  for (int64_t t = 0; t < w.T; ++t) {
    const int64_t slot = w.slots[static_cast<size_t>(t)];
    if (slot < 0) continue;
    for (int64_t h = 0; h < w.Hkv; ++h) {
      float largest = 0.0f;
      for (int64_t x = 0; x < w.D; ++x) {
        largest =
            std::max(largest, std::fabs(w.key[static_cast<size_t>((t * w.Hkv + h) * w.D + x)]));
      }
      const float scale = ks[static_cast<size_t>(slot * w.Hkv + h)];
      EXPECT_FLOAT_EQ(scale, largest / 127.0f) << "token " << t;
      for (int64_t x = 0; x < w.D; ++x) {
        const double got =
            static_cast<double>(k8[static_cast<size_t>((slot * w.Hkv + h) * w.D + x)]) *
            static_cast<double>(scale);
        const double want =
            static_cast<double>(w.key[static_cast<size_t>((t * w.Hkv + h) * w.D + x)]);
        EXPECT_LE(std::fabs(got - want), 0.5 * static_cast<double>(scale) * (1 + 1e-6))
            << "token " << t;
      }
    }
  }
}

TEST(CppApi, KvCacheWriteErrorsNameTheArgument) {
  CacheProblem w;
  const mha::Tensor key(static_cast<const float*>(w.key.data()), {w.T, w.Hkv, w.D});
  const mha::Tensor value(static_cast<const float*>(w.value.data()), {w.T, w.Hkv, w.Dv});
  const std::vector<int64_t> k_shape = {w.blocks, w.block, w.Hkv, w.D};
  const std::vector<int64_t> v_shape = {w.blocks, w.block, w.Hkv, w.Dv};
  std::vector<float> k_cache(w.rows() * static_cast<size_t>(w.D), -5.0f);
  std::vector<float> v_cache(w.rows() * static_cast<size_t>(w.Dv), -5.0f);
  std::vector<int8_t> k8(k_cache.size(), 0), v8(v_cache.size(), 0);
  const std::vector<float> k_before = k_cache, v_before = v_cache;
  std::string message;

  std::vector<int64_t> past = w.slots;
  past[3] = w.blocks * w.block;
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::kv_cache_write(key, value, mha::Tensor(k_cache.data(), k_shape),
                                      mha::Tensor(v_cache.data(), v_shape),
                                      mha::Tensor(past.data(), {w.T}));
                },
                &message),
            MHA_ERR_INVALID_VALUE);
  EXPECT_EQ(message, std::string("MHA_ERR_INVALID_VALUE: ") + mha_last_error());
  EXPECT_NE(message.find("slot_mapping[3]"), std::string::npos) << message;

  const std::vector<int64_t> short_v_shape = {w.blocks, w.block, w.Hkv, w.Dv - 1};
  EXPECT_NE(thrown_status(
                [&] {
                  mha::kv_cache_write(key, value, mha::Tensor(k_cache.data(), k_shape),
                                      mha::Tensor(v_cache.data(), short_v_shape),
                                      mha::Tensor(w.slots.data(), {w.T}));
                },
                &message),
            MHA_OK);
  EXPECT_NE(message.find("value_cache"), std::string::npos) << message;
  EXPECT_TRUE(same_bits(k_cache, k_before) && same_bits(v_cache, v_before));

  // An int8 cache through the overload without scale caches.
  EXPECT_NE(thrown_status(
                [&] {
                  mha::kv_cache_write(key, value, mha::Tensor(k8.data(), MHA_DTYPE_I8, k_shape),
                                      mha::Tensor(v8.data(), MHA_DTYPE_I8, v_shape),
                                      mha::Tensor(w.slots.data(), {w.T}));
                },
                &message),
            MHA_OK);
  EXPECT_NE(message.find("key_scale_cache"), std::string::npos) << message;
  EXPECT_TRUE(std::all_of(k8.begin(), k8.end(), [](int8_t x) { return x == 0; }));
}

// ------------------------------------------------------------------ merge_partials

TEST(CppApi, MergePartialsFromListsAndRanges) {
  Problem p;
  // Keys [0, 4) and [4, Lk): views into the same K and V.
  const int64_t split = 4;
  mha::Tensor q(static_cast<const float*>(p.q.data()), {p.B, p.H, p.Lq, p.D});
  auto keys = [&](int64_t first, int64_t count) {
    return mha::Tensor(static_cast<const float*>(p.k.data()) + first * p.D,
                       {p.B, p.Hkv, count, p.D}, {p.Hkv * p.Lk * p.D, p.Lk * p.D, p.D, 1});
  };
  auto values = [&](int64_t first, int64_t count) {
    return mha::Tensor(static_cast<const float*>(p.v.data()) + first * p.Dv,
                       {p.B, p.Hkv, count, p.Dv}, {p.Hkv * p.Lk * p.Dv, p.Lk * p.Dv, p.Dv, 1});
  };
  const std::vector<int64_t> out_shape = {p.B, p.H, p.Lq, p.Dv};
  const std::vector<int64_t> lse_shape = {p.B, p.H, p.Lq};
  std::vector<float> out0(p.out_size()), out1(p.out_size()), lse0(p.lse_size()), lse1(p.lse_size());
  mha::attention(q, keys(0, split), values(0, split), mha::Tensor(out0.data(), out_shape),
                 mha::AttentionParams().lse(mha::Tensor(lse0.data(), lse_shape)));
  mha::attention(q, keys(split, p.Lk - split), values(split, p.Lk - split),
                 mha::Tensor(out1.data(), out_shape),
                 mha::AttentionParams().lse(mha::Tensor(lse1.data(), lse_shape)));

  // The C API's merge.
  std::vector<float> expected(p.out_size()), expected_lse(p.lse_size());
  {
    const mha_tensor outs[2] = {describe(out0.data(), MHA_DTYPE_F32, out_shape),
                                describe(out1.data(), MHA_DTYPE_F32, out_shape)};
    const mha_tensor lses[2] = {describe(lse0.data(), MHA_DTYPE_F32, lse_shape),
                                describe(lse1.data(), MHA_DTYPE_F32, lse_shape)};
    mha_tensor out = describe(expected.data(), MHA_DTYPE_F32, out_shape);
    mha_tensor lse = describe(expected_lse.data(), MHA_DTYPE_F32, lse_shape);
    ASSERT_EQ(mha_merge_partials(2, outs, lses, &out, &lse), MHA_OK) << mha_last_error();
  }

  const mha::Tensor o0(static_cast<const float*>(out0.data()), out_shape);
  const mha::Tensor o1(out1.data(), out_shape);  // writable parts are fine as inputs
  const mha::Tensor l0(static_cast<const float*>(lse0.data()), lse_shape);
  const mha::Tensor l1(lse1.data(), lse_shape);
  std::vector<float> out(p.out_size()), lse(p.lse_size());
  const mha::Tensor merged(out.data(), out_shape);
  const mha::Tensor merged_lse(lse.data(), lse_shape);

  mha::merge_partials({o0, o1}, {l0, l1}, merged, merged_lse);  // brace lists
  EXPECT_TRUE(same_bits(out, expected));
  EXPECT_TRUE(same_bits(lse, expected_lse));

  std::fill(out.begin(), out.end(), 0.0f);
  const std::vector<mha::ConstTensor> outs = {o0, o1}, lses = {l0, l1};
  mha::merge_partials(outs, lses, merged);  // std::vector, no LSE
  EXPECT_TRUE(same_bits(out, expected));

  std::fill(out.begin(), out.end(), 0.0f);
  std::fill(lse.begin(), lse.end(), 0.0f);
  const std::array<mha::Tensor<float>, 2> typed_outs = {mha::Tensor(out0.data(), out_shape),
                                                        mha::Tensor(out1.data(), out_shape)};
  const mha::Tensor<const float> typed_lses[2] = {l0, mha::Tensor<const float>(l1)};
  mha::merge_partials(typed_outs, typed_lses, merged, merged_lse);  // std::array, C array
  EXPECT_TRUE(same_bits(out, expected));
  EXPECT_TRUE(same_bits(lse, expected_lse));

  // Equal to attention over all keys, within the tolerance.
  const mha_tensor cq = p.cq(), ck = p.ck(), cv = p.cv();
  const Reference ref = reference_attention(cq, ck, cv, nullptr);
  EXPECT_LE(max_abs_error(*merged.get(), ref), tolerance(ref));

  std::string message;
  EXPECT_EQ(thrown_status(
                [&] {
                  mha::merge_partials({o0, o1}, {l0}, merged);
                },
                &message),
            MHA_ERR_SHAPE_MISMATCH);
  EXPECT_EQ(message, "MHA_ERR_SHAPE_MISMATCH: merge_partials: 2 partial outputs but 1 LSEs");
  const std::vector<mha::ConstTensor> none;
  EXPECT_EQ(thrown_status([&] { mha::merge_partials(none, none, merged); }, &message),
            MHA_ERR_INVALID_SIZE);
  EXPECT_NE(message.find("at least one part"), std::string::npos) << message;
}

// ------------------------------------------------------------------ the module

TEST(CppApi, ModuleForwardParamsOwnTheirDescriptors) {
  const int64_t B = 2, Lq = 3, Lk = 5, E = 8, H = 2;
  mha::Module module(E, H);
  const std::vector<float> w_in = random_values(static_cast<size_t>(3 * E * E), 11);
  const std::vector<float> b_in = random_values(static_cast<size_t>(3 * E), 12);
  const std::vector<float> w_out = random_values(static_cast<size_t>(E * E), 13);
  const std::vector<float> b_out = random_values(static_cast<size_t>(E), 14);
  module.set_weight("in_proj_weight", mha::Tensor(w_in.data(), {3 * E, E}));
  module.set_weight("in_proj_bias", mha::Tensor(b_in.data(), {3 * E}));
  module.set_weight("out_proj.weight", mha::Tensor(w_out.data(), {E, E}));
  module.set_weight("out_proj.bias", mha::Tensor(b_out.data(), {E}));

  const std::vector<float> query = random_values(static_cast<size_t>(B * Lq * E), 15);
  const std::vector<float> key = random_values(static_cast<size_t>(B * Lk * E), 16);
  const std::vector<int64_t> lens = {4, 5};
  std::vector<uint8_t> attn_mask(static_cast<size_t>(Lq * Lk), 0);  // true = not allowed
  attn_mask[1] = 1;
  attn_mask[7] = 1;
  std::vector<float> kpm(static_cast<size_t>(B * Lk), 0.0f);  // f32, added
  kpm[3] = -0.5f;
  const std::vector<float> sinks = {0.5f, -1.0f};                 // [H]
  const std::vector<float> slopes = {0.25f, 0.5f, 0.125f, 1.0f};  // [B, H]
  const std::vector<int64_t> out_shape = {B, Lq, E};
  const std::vector<int64_t> weights_shape = {B, H, Lq, Lk};
  const size_t out_size = static_cast<size_t>(B * Lq * E);
  const size_t weights_size = static_cast<size_t>(B * H * Lq * Lk);

  // The C API on the same module and inputs.
  std::vector<float> expected(out_size), expected_weights(weights_size);
  {
    mha_tensor c_query = describe(const_cast<float*>(query.data()), MHA_DTYPE_F32, {B, Lq, E});
    mha_tensor c_key = describe(const_cast<float*>(key.data()), MHA_DTYPE_F32, {B, Lk, E});
    mha_tensor c_out = describe(expected.data(), MHA_DTYPE_F32, out_shape);
    mha_tensor c_lens = describe(const_cast<int64_t*>(lens.data()), MHA_DTYPE_I64, {B});
    mha_tensor c_kpm = describe(kpm.data(), MHA_DTYPE_F32, {B, Lk});
    mha_tensor c_mask = describe(attn_mask.data(), MHA_DTYPE_BOOL, {Lq, Lk});
    mha_tensor c_weights = describe(expected_weights.data(), MHA_DTYPE_F32, weights_shape);
    mha_tensor c_sinks = describe(const_cast<float*>(sinks.data()), MHA_DTYPE_F32, {H});
    mha_tensor c_slopes = describe(const_cast<float*>(slopes.data()), MHA_DTYPE_F32, {B, H});
    mha_module_forward_params params;
    mha_module_forward_params_init(&params);
    params.valid_lens = &c_lens;
    params.key_padding_mask = &c_kpm;
    params.attn_mask = &c_mask;
    params.attn_weights = &c_weights;
    params.causal = MHA_CAUSAL_TOP_LEFT;
    params.window_left = 2;
    params.window_right = 1;
    params.sinks = &c_sinks;
    params.softcap = 1.5f;
    params.alibi_slopes = &c_slopes;
    ASSERT_EQ(mha_module_forward(module.get(), &c_query, &c_key, &c_key, &c_out, &params), MHA_OK)
        << mha_last_error();
  }

  std::vector<float> weights(weights_size);
  mha::ModuleForwardParams original =
      mha::ModuleForwardParams()
          .valid_lens(mha::Tensor(lens.data(), {B}))
          .key_padding_mask(mha::Tensor(kpm.data(), {B, Lk}))
          .attn_mask(mha::Tensor(attn_mask.data(), MHA_DTYPE_BOOL, {Lq, Lk}))
          .attn_weights(mha::Tensor(weights.data(), weights_shape))
          .causal(MHA_CAUSAL_TOP_LEFT)
          .window(2, 1)
          .sinks(mha::Tensor(sinks.data(), {H}))
          .softcap(1.5f)
          .alibi_slopes(mha::Tensor(slopes.data(), {B, H}));
  auto run = [&](const mha::ModuleForwardParams& params, const char* what) {
    std::vector<float> out(out_size, -1.0f);
    std::fill(weights.begin(), weights.end(), -1.0f);
    const mha::Tensor x(query.data(), out_shape);
    const mha::Tensor kv(key.data(), {B, Lk, E});
    ASSERT_NO_THROW(module.forward(x, kv, kv, mha::Tensor(out.data(), out_shape), params)) << what;
    EXPECT_TRUE(same_bits(out, expected)) << what;
    EXPECT_TRUE(same_bits(weights, expected_weights)) << what;
    const mha_module_forward_params* c = params.get();
    EXPECT_TRUE(points_into(c->valid_lens, &params, sizeof params)) << what;
    EXPECT_TRUE(points_into(c->key_padding_mask, &params, sizeof params)) << what;
    EXPECT_TRUE(points_into(c->attn_mask, &params, sizeof params)) << what;
    EXPECT_TRUE(points_into(c->attn_weights, &params, sizeof params)) << what;
    EXPECT_TRUE(points_into(c->sinks, &params, sizeof params)) << what;
    EXPECT_TRUE(points_into(c->alibi_slopes, &params, sizeof params)) << what;
    EXPECT_EQ(c->window_left, 2) << what;
    EXPECT_EQ(c->window_right, 1) << what;
    EXPECT_EQ(c->softcap, 1.5f) << what;
  };
  run(original, "the object built from temporaries");
  mha::ModuleForwardParams copied(original);
  mha::ModuleForwardParams moved(std::move(original));
  original = mha::ModuleForwardParams();
  EXPECT_EQ(original.get()->attn_weights, nullptr);
  run(copied, "a copy");
  run(moved, "a moved-to object");
  mha::ModuleForwardParams assigned;
  assigned = copied;
  copied = mha::ModuleForwardParams();
  run(assigned, "a copy-assigned object");

  // The positional encoding through a temporary view.
  std::vector<float> zeros(static_cast<size_t>(1 * 3 * 4), 0.0f);
  mha::positional_encoding_add(mha::Tensor(zeros.data(), {1, 3, 4}));
  EXPECT_EQ(zeros[1], 1.0f);  // position 0, column 1: cos(0)
  EXPECT_FLOAT_EQ(zeros[4], std::sin(1.0f));
}

// ------------------------------------------------------------------ backends, threads, version

TEST(CppApi, BackendsThreadsVersionAndCpuFeatures) {
  const std::vector<mha::BackendInfo> list = mha::backends();
  ASSERT_EQ(static_cast<int32_t>(list.size()), mha_backend_count());
  bool scalar_usable = false;
  for (int32_t i = 0; i < mha_backend_count(); ++i) {
    mha_backend_info info{};
    ASSERT_EQ(mha_backend_get_info(i, &info), MHA_OK);
    const mha::BackendInfo& b = list[static_cast<size_t>(i)];
    EXPECT_EQ(b.name, info.name);
    EXPECT_EQ(b.usable, info.usable != 0);
    EXPECT_EQ(b.priority, info.priority);
    EXPECT_EQ(b.reason, info.reason);
    EXPECT_EQ(b.usable, b.reason.empty()) << b.name << ": " << b.reason;
    if (b.name == "scalar") scalar_usable = b.usable;
  }
  ASSERT_TRUE(scalar_usable);

  ASSERT_NO_THROW(mha::select_backend("scalar"));
  EXPECT_EQ(mha::selected_backend(), "scalar");
  std::string message;
  EXPECT_EQ(thrown_status([] { mha::select_backend("nonsense"); }, &message),
            MHA_ERR_BACKEND_UNAVAILABLE);
  EXPECT_NE(message.find("nonsense"), std::string::npos) << message;
  EXPECT_EQ(mha::selected_backend(), "scalar");  // unchanged
  ASSERT_NO_THROW(mha::select_backend("auto"));
  EXPECT_EQ(mha::selected_backend(), mha_selected_backend());

  ASSERT_NO_THROW(mha::set_num_threads(3));
  EXPECT_EQ(mha::num_threads(), 3);
  EXPECT_EQ(thrown_status([] { mha::set_num_threads(-1); }), MHA_ERR_INVALID_VALUE);
  EXPECT_EQ(mha::num_threads(), 3);
  ASSERT_NO_THROW(mha::set_num_threads(0));
  EXPECT_EQ(mha::num_threads(), mha_get_num_threads());

  EXPECT_EQ(mha::version(), mha_version());
  EXPECT_EQ(mha::version(), std::to_string(MHA_VERSION_MAJOR) + "." +
                                std::to_string(MHA_VERSION_MINOR) + "." +
                                std::to_string(MHA_VERSION_PATCH));
  EXPECT_EQ(mha::cpu_features(), mha_cpu_features());
}

}  // namespace
}  // namespace mha_test
