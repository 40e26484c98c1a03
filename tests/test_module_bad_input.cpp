// The module's bad input: configurations, weights and forward calls refused
// with the argument named and nothing written; the verbose line's gemm
// kernel; and the C++ wrapper (RAII, moves, errors as exceptions).
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mha/mha.hpp>
#include <string>
#include <utility>
#include <vector>

#include "module_case.h"

namespace mha_test {
namespace {

::testing::AssertionResult fails_with(mha_status got, mha_status want, const std::string& text) {
  const std::string message = mha_last_error();
  if (got != want) {
    return ::testing::AssertionFailure() << "status " << mha_status_name(got) << ", want "
                                         << mha_status_name(want) << " (" << message << ")";
  }
  if (message.find(text) == std::string::npos) {
    return ::testing::AssertionFailure() << "message '" << message << "' lacks '" << text << "'";
  }
  return ::testing::AssertionSuccess();
}

TEST(ModuleConfig, BadConfigurationsAreRefused) {
  struct Bad {
    int64_t e, h, eq, ek, ev;
    float dropout;
    mha_status status;
    const char* text;
  };
  const Bad cases[] = {
      {0, 1, 0, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->embed_dim = 0; it must be positive"},
      {-8, 2, 0, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->embed_dim = -8"},
      {8, 0, 0, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->num_heads = 0"},
      {10, 3, 0, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE,
       "config->embed_dim = 10 is not a multiple of config->num_heads = 3"},
      {8, 2, -1, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->query_dim = -1"},
      {8, 2, 0, -3, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->key_dim = -3"},
      {8, 2, 0, 0, -2, 0.0f, MHA_ERR_INVALID_SIZE, "config->value_dim = -2"},
      {8, 2, 0, 0, 0, 1.0f, MHA_ERR_INVALID_VALUE, "config->dropout = 1; it must be in [0, 1)"},
      {8, 2, 0, 0, 0, -0.1f, MHA_ERR_INVALID_VALUE, "config->dropout = -0.1"},
      {8, 2, 0, 0, 0, std::numeric_limits<float>::quiet_NaN(), MHA_ERR_INVALID_VALUE,
       "config->dropout = nan"},
      {int64_t{1} << 40, 1, 0, 0, 0, 0.0f, MHA_ERR_SIZE_OVERFLOW, "overflow"},
  };
  // A pointer that is not a module, to see that a failed create leaves it alone.
  alignas(64) static char not_a_module[64];
  mha_module* const sentinel = reinterpret_cast<mha_module*>(not_a_module);
  for (const Bad& b : cases) {
    mha_module_config c;
    mha_module_config_init(&c);
    c.embed_dim = b.e, c.num_heads = b.h, c.query_dim = b.eq, c.key_dim = b.ek, c.value_dim = b.ev;
    c.dropout = b.dropout;
    mha_module* m = sentinel;  // must stay untouched
    EXPECT_TRUE(fails_with(mha_module_create(&c, &m), b.status, b.text)) << b.text;
    EXPECT_EQ(m, sentinel) << "a failed create wrote its output";
  }
  mha_module_config c;
  mha_module_config_init(&c);
  c.embed_dim = 8, c.num_heads = 2;
  mha_module* m = nullptr;
  EXPECT_TRUE(fails_with(mha_module_create(nullptr, &m), MHA_ERR_NULL_POINTER, "config is NULL"));
  EXPECT_TRUE(fails_with(mha_module_create(&c, nullptr), MHA_ERR_NULL_POINTER, "module is NULL"));
  c.struct_size = 12;
  EXPECT_TRUE(
      fails_with(mha_module_create(&c, &m), MHA_ERR_INVALID_PARAMS, "config->struct_size is 12"));
  EXPECT_EQ(m, nullptr);
  mha_module_config_init(&c);
  EXPECT_EQ(c.bias, 1) << "biases on by default, as PyTorch";
  mha_module_destroy(nullptr);  // a no-op
}

TEST(ModuleWeights, WrongWeightsAreRefused) {
  mha_module_config c;
  mha_module_config_init(&c);
  c.embed_dim = 8, c.num_heads = 2;
  ModuleHandle m;
  ASSERT_EQ(mha_module_create(&c, &m.m), MHA_OK);
  std::vector<float> data(3 * 8 * 8, 0.25f);
  std::vector<int32_t> ints(64);
  const auto t = [&](const std::vector<int64_t>& shape) {
    return describe(data.data(), MHA_DTYPE_F32, shape);
  };
  mha_tensor w = t({24, 8});
  EXPECT_EQ(mha_module_set_weight(m.m, "in_proj_weight", &w), MHA_OK) << mha_last_error();
  w = t({8, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "in_proj_weight", &w), MHA_ERR_SHAPE_MISMATCH,
                         "in_proj_weight has shape [8, 8]; it must be [3E, E] = [24, 8]"));
  w = t({8, 7});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "out_proj.weight", &w), MHA_ERR_SHAPE_MISMATCH,
                         "out_proj.weight has shape [8, 7]; it must be [E, E] = [8, 8]"));
  w = t({8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "W_q.weight", &w), MHA_ERR_INVALID_SIZE,
                         "W_q.weight must have 2 dimensions, has 1"));
  w = t({8, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "in_proj_bias", &w), MHA_ERR_INVALID_SIZE,
                         "in_proj_bias must have 1 dimensions, has 2"));
  w = t({16});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "in_proj_bias", &w), MHA_ERR_SHAPE_MISMATCH,
                         "in_proj_bias has shape [16]; it must be [3E] = [24]"));
  w = describe(ints.data(), MHA_DTYPE_I32, {8, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "W_o.weight", &w), MHA_ERR_INVALID_DTYPE,
                         "W_o.weight has dtype i32; it must be f32, bf16 or f16"));
  w = t({8, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "out_proj.weights", &w), MHA_ERR_INVALID_VALUE,
                         "unknown weight name 'out_proj.weights'"));
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "bias_k", &w), MHA_ERR_INVALID_VALUE,
                         "unknown weight name 'bias_k'"));
  EXPECT_TRUE(
      fails_with(mha_module_set_weight(m.m, nullptr, &w), MHA_ERR_NULL_POINTER, "name is NULL"));
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "W_o.weight", nullptr), MHA_ERR_NULL_POINTER,
                         "is NULL"));
  EXPECT_TRUE(fails_with(mha_module_set_weight(nullptr, "W_o.weight", &w), MHA_ERR_NULL_POINTER,
                         "module is NULL"));
  w.data = nullptr;
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "W_o.weight", &w), MHA_ERR_NULL_POINTER,
                         "W_o.weight->data is NULL"));

  // in_proj_weight needs equal sizes; biases need a module with biases.
  c.query_dim = 5, c.bias = 0;
  ModuleHandle m2;
  ASSERT_EQ(mha_module_create(&c, &m2.m), MHA_OK);
  w = t({24, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m2.m, "in_proj_weight", &w), MHA_ERR_INVALID_VALUE,
                         "'in_proj_weight' needs query_dim = key_dim = value_dim = embed_dim"));
  w = t({8, 5});
  EXPECT_EQ(mha_module_set_weight(m2.m, "q_proj_weight", &w), MHA_OK) << mha_last_error();
  w = t({8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m2.m, "out_proj.bias", &w), MHA_ERR_INVALID_VALUE,
                         "'out_proj.bias': this module has no biases"));
  EXPECT_TRUE(fails_with(mha_module_set_weight(m2.m, "W_k.bias", &w), MHA_ERR_INVALID_VALUE,
                         "has no biases"));
}

// A well-formed forward call on [2, 3, 8] inputs that a test then breaks.
struct ForwardFixture {
  ModuleHandle m;
  std::vector<float> x = std::vector<float>(2 * 3 * 8, 0.5f),
                     kv = std::vector<float>(2 * 4 * 6, 0.5f);
  std::vector<float> o = std::vector<float>(2 * 3 * 8, 42.0f);
  std::vector<float> w = std::vector<float>(2 * 2 * 3 * 4, 42.0f);
  std::vector<int32_t> lens = {4, 5};
  std::vector<uint8_t> bytes = std::vector<uint8_t>(2 * 2 * 3 * 4, 0);
  std::vector<double> doubles = std::vector<double>(16, 0.0);
  mha_tensor q{}, k{}, v{}, out{}, weights{}, lens_t{};
  mha_module_forward_params p{};

  ForwardFixture() {
    mha_module_config c;
    mha_module_config_init(&c);
    c.embed_dim = 8, c.num_heads = 2, c.key_dim = 6, c.value_dim = 6;
    EXPECT_EQ(mha_module_create(&c, &m.m), MHA_OK) << mha_last_error();
    q = describe(x.data(), MHA_DTYPE_F32, {2, 3, 8});
    k = v = describe(kv.data(), MHA_DTYPE_F32, {2, 4, 6});
    out = describe(o.data(), MHA_DTYPE_F32, {2, 3, 8});
    weights = describe(w.data(), MHA_DTYPE_F32, {2, 2, 3, 4});
    lens_t = describe(lens.data(), MHA_DTYPE_I32, {2});
    mha_module_forward_params_init(&p);
  }
  mha_status call() { return mha_module_forward(m.m, &q, &k, &v, &out, &p); }
  bool out_untouched() const {
    for (float e : o)
      if (e != 42.0f) return false;
    for (float e : w)
      if (e != 42.0f) return false;
    return true;
  }
};

// Run by ctest with MHA_VERBOSE=2 (module.verbose_gemm_kernel): a module call
// on avx512, then on avx2.  The entry's regular expression checks that the
// first call's line names avx512's micro-kernel for the products (BLIS's
// "skx" set, which mha gives BLIS on AVX-512 CPUs, packs for its 32 x 12
// tile) and the second BLIS's own (avx2 offers none for that set).
TEST(ModuleVerbose, LinesNameTheGemmKernel) {
  const char* verbose = std::getenv("MHA_VERBOSE");
  if (verbose == nullptr || std::string(verbose) != "2") GTEST_SKIP() << "runs with MHA_VERBOSE=2";
  const auto backends = list_backends();
  for (const char* name : {"avx512", "avx2"}) {
    const BackendEntry* entry = find_backend(backends, name);
    if (entry == nullptr || !entry->usable) {
      std::printf("%s is not usable here\n", name);
      continue;
    }
    ASSERT_EQ(mha_select_backend(name), MHA_OK) << mha_last_error();
    ForwardFixture f;
    ASSERT_EQ(f.call(), MHA_OK) << mha_last_error();
    std::fflush(stderr);
    std::printf("module call on %s done\n", name);
    std::fflush(stdout);
  }
  mha_select_backend("auto");
}

TEST(ModuleForward, BadCallsAreRefusedAndWriteNothing) {
  struct Bad {
    const char* what;
    std::function<void(ForwardFixture&)> edit;
    mha_status status;
    const char* text;
  };
  const Bad cases[] = {
      {"query features", [](ForwardFixture& f) { f.q.shape[2] = 7; }, MHA_ERR_SHAPE_MISMATCH,
       "query has 7 features (shape [2, 3, 7]) but the module's query_dim is 8"},
      {"key features", [](ForwardFixture& f) { f.k = f.q; }, MHA_ERR_SHAPE_MISMATCH,
       "key has 8 features (shape [2, 3, 8]) but the module's key_dim is 6"},
      {"value batch", [](ForwardFixture& f) { f.v.shape[0] = 1; }, MHA_ERR_SHAPE_MISMATCH,
       "batch: query has 2"},
      {"value length", [](ForwardFixture& f) { f.v.shape[1] = 3; }, MHA_ERR_SHAPE_MISMATCH,
       "key length: key has 4 but value has 3"},
      {"out shape", [](ForwardFixture& f) { f.out.shape[2] = 6; }, MHA_ERR_SHAPE_MISMATCH,
       "out has shape [2, 3, 6]; it must be [B, Lq, E] = [2, 3, 8]"},
      {"rank", [](ForwardFixture& f) { f.q.ndim = 4; }, MHA_ERR_INVALID_SIZE,
       "query must have 3 dimensions, has 4"},
      {"dtype", [](ForwardFixture& f) { f.k.dtype = MHA_DTYPE_I32; }, MHA_ERR_INVALID_DTYPE,
       "key has dtype i32; it must be f32"},
      {"null", [](ForwardFixture& f) { f.v.data = nullptr; }, MHA_ERR_NULL_POINTER,
       "value->data is NULL"},
      {"overlap", [](ForwardFixture& f) { f.out.data = f.x.data(); }, MHA_ERR_OVERLAP,
       "out overlaps query"},
      {"self overlap", [](ForwardFixture& f) { f.out.strides[1] = 0; }, MHA_ERR_OVERLAP,
       "out overlaps itself"},
      {"causal", [](ForwardFixture& f) { f.p.causal = 7; }, MHA_ERR_INVALID_VALUE,
       "params->causal = 7"},
      {"struct size", [](ForwardFixture& f) { f.p.struct_size = 8; }, MHA_ERR_INVALID_PARAMS,
       "params->struct_size is 8"},
      {"valid_lens value",
       [](ForwardFixture& f) {
         f.lens[1] = 5;
         f.p.valid_lens = &f.lens_t;
       },
       MHA_ERR_INVALID_VALUE, "params->valid_lens[1] = 5 is outside [0, Lk = 4]"},
      {"valid_lens shape",
       [](ForwardFixture& f) {
         f.lens_t.shape[0] = 1;
         f.p.valid_lens = &f.lens_t;
       },
       MHA_ERR_SHAPE_MISMATCH, "params->valid_lens has shape [1]"},
      {"valid_lens dtype",
       [](ForwardFixture& f) {
         f.lens_t.dtype = MHA_DTYPE_F32;
         f.p.valid_lens = &f.lens_t;
       },
       MHA_ERR_INVALID_DTYPE, "params->valid_lens has dtype f32; it must be i32 or i64"},
      {"key_padding_mask shape",
       [](ForwardFixture& f) {
         static mha_tensor t;
         t = describe(f.bytes.data(), MHA_DTYPE_BOOL, {2, 3});
         f.p.key_padding_mask = &t;
       },
       MHA_ERR_SHAPE_MISMATCH,
       "params->key_padding_mask has shape [2, 3]; it must be [B, Lk] = [2, 4]"},
      {"key_padding_mask dtype",
       [](ForwardFixture& f) {
         static mha_tensor t;
         t = describe(f.lens.data(), MHA_DTYPE_I32, {2, 1});
         f.p.key_padding_mask = &t;
       },
       MHA_ERR_INVALID_DTYPE, "params->key_padding_mask has dtype i32; it must be bool or f32"},
      {"attn_mask shape",
       [](ForwardFixture& f) {
         static mha_tensor t;
         t = describe(f.bytes.data(), MHA_DTYPE_BOOL, {2, 3, 4});
         f.p.attn_mask = &t;
       },
       MHA_ERR_SHAPE_MISMATCH,
       "params->attn_mask has shape [2, 3, 4]; it must be [Lq, Lk] = [3, 4] or [B*H, Lq, Lk] = [4, "
       "3, 4]"},
      {"attn_mask rank",
       [](ForwardFixture& f) {
         static mha_tensor t;
         t = describe(f.bytes.data(), MHA_DTYPE_BOOL, {1, 4, 3, 4});
         f.p.attn_mask = &t;
       },
       MHA_ERR_INVALID_SIZE, "params->attn_mask must have 2 to 3 dimensions, has 4"},
      {"attn_weights shape",
       [](ForwardFixture& f) {
         f.weights.shape[1] = 1;
         f.p.attn_weights = &f.weights;
       },
       MHA_ERR_SHAPE_MISMATCH,
       "params->attn_weights has shape [2, 1, 3, 4]; it must be [B, H, Lq, Lk] = [2, 2, 3, 4]"},
      {"averaged attn_weights rank",
       [](ForwardFixture& f) {
         f.p.attn_weights = &f.weights;
         f.p.average_attn_weights = 1;
       },
       MHA_ERR_INVALID_SIZE, "params->attn_weights must have 3 dimensions, has 4"},
      {"attn_weights overlap out",
       [](ForwardFixture& f) {
         f.weights.data = f.o.data();
         f.p.attn_weights = &f.weights;
       },
       MHA_ERR_OVERLAP, "out overlaps params->attn_weights"},
  };
  for (const Bad& b : cases) {
    ForwardFixture f;
    b.edit(f);
    EXPECT_TRUE(fails_with(f.call(), b.status, b.text)) << b.what;
    EXPECT_TRUE(f.out_untouched()) << b.what << ": a failed call wrote an output";
  }
  ForwardFixture f;
  EXPECT_EQ(f.call(), MHA_OK) << mha_last_error();
  EXPECT_TRUE(fails_with(mha_module_forward(nullptr, &f.q, &f.k, &f.v, &f.out, nullptr),
                         MHA_ERR_NULL_POINTER, "module is NULL"));
  EXPECT_TRUE(fails_with(mha_module_forward(f.m.m, &f.q, nullptr, &f.v, &f.out, nullptr),
                         MHA_ERR_NULL_POINTER, "key is NULL"));
}

// The variants' refusals: the status, the argument named as the core names
// it (prefixed params->), nothing written.
TEST(ModuleForward, VariantsRefusedByName) {
  struct Bad {
    const char* what;
    std::function<void(ForwardFixture&)> edit;
    mha_status status;
    const char* text;
  };
  // An F32 descriptor over `values`, kept until the next one is made (each
  // case's edit runs just before its call).  The fixture has H = 2, B = 2.
  static std::vector<float> floats;
  static mha_tensor t;
  const auto tensor = [](std::vector<float> values, const std::vector<int64_t>& shape) {
    floats = std::move(values);
    t = describe(floats.data(), MHA_DTYPE_F32, shape);
    return &t;
  };
  const Bad cases[] = {
      {"window_left -2", [](ForwardFixture& f) { f.p.window_left = -2; }, MHA_ERR_INVALID_VALUE,
       "params->window_left = -2; it must be -1 (unbounded) or a key count >= 0"},
      {"window_right -5", [](ForwardFixture& f) { f.p.window_right = -5; }, MHA_ERR_INVALID_VALUE,
       "params->window_right = -5"},
      {"softcap negative", [](ForwardFixture& f) { f.p.softcap = -1.0f; }, MHA_ERR_INVALID_VALUE,
       "params->softcap = -1; it must be 0 (off) or a finite value > 0"},
      {"softcap NaN", [](ForwardFixture& f) { f.p.softcap = NAN; }, MHA_ERR_INVALID_VALUE,
       "params->softcap = nan"},
      {"softcap inf", [](ForwardFixture& f) { f.p.softcap = INFINITY; }, MHA_ERR_INVALID_VALUE,
       "params->softcap = inf"},
      {"softcap -inf", [](ForwardFixture& f) { f.p.softcap = -INFINITY; }, MHA_ERR_INVALID_VALUE,
       "params->softcap = -inf"},
      {"sinks shape",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({0, 0, 0}, {3});
       },
       MHA_ERR_SHAPE_MISMATCH, "params->sinks has shape [3]; it must be [H] = [2]"},
      {"sinks rank",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({0, 0}, {1, 2});
       },
       MHA_ERR_INVALID_SIZE, "params->sinks must have 1 dimensions, has 2"},
      {"sinks dtype",
       [](ForwardFixture& f) {
         static mha_tensor ints;
         ints = describe(f.lens.data(), MHA_DTYPE_I32, {2});
         f.p.sinks = &ints;
       },
       MHA_ERR_INVALID_DTYPE, "params->sinks has dtype i32; it must be f32"},
      {"sinks NaN",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({0, NAN}, {2});
       },
       MHA_ERR_INVALID_VALUE, "params->sinks[1] = nan; a sink must be finite or -inf (no sink)"},
      {"sinks +inf",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({INFINITY, 0}, {2});
       },
       MHA_ERR_INVALID_VALUE, "params->sinks[0] = inf"},
      {"sinks NULL data",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({0, 0}, {2});
         t.data = nullptr;
       },
       MHA_ERR_NULL_POINTER, "params->sinks->data is NULL"},
      {"alibi_slopes shape",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({1, 1, 1}, {3});
       },
       MHA_ERR_SHAPE_MISMATCH,
       "params->alibi_slopes has shape [3]; it must be [H] = [2] or [B, H] = [2, 2]"},
      {"alibi_slopes batch",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({1, 1, 1, 1, 1, 1}, {3, 2});
       },
       MHA_ERR_SHAPE_MISMATCH, "params->alibi_slopes has shape [3, 2]"},
      {"alibi_slopes rank",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({1, 1, 1, 1}, {1, 2, 2});
       },
       MHA_ERR_INVALID_SIZE, "params->alibi_slopes must have 1 to 2 dimensions, has 3"},
      {"alibi_slopes dtype",
       [](ForwardFixture& f) {
         static mha_tensor ints;
         ints = describe(f.lens.data(), MHA_DTYPE_I32, {2});
         f.p.alibi_slopes = &ints;
       },
       MHA_ERR_INVALID_DTYPE, "params->alibi_slopes has dtype i32; it must be f32"},
      {"alibi_slopes inf",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({1, 1, 1, INFINITY}, {2, 2});
       },
       MHA_ERR_INVALID_VALUE, "params->alibi_slopes holds inf; slopes must be finite"},
      {"alibi_slopes NaN",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({NAN, 1}, {2});
       },
       MHA_ERR_INVALID_VALUE, "params->alibi_slopes holds nan"},
      {"sinks overlap out",
       [](ForwardFixture& f) {
         static mha_tensor in_out;
         in_out = describe(f.o.data() + 4, MHA_DTYPE_F32, {2});
         f.p.sinks = &in_out;
       },
       MHA_ERR_OVERLAP, "out overlaps params->sinks"},
      {"alibi_slopes overlap attn_weights",
       [](ForwardFixture& f) {
         static mha_tensor in_weights;
         in_weights = describe(f.w.data() + 6, MHA_DTYPE_F32, {2, 2});
         f.p.alibi_slopes = &in_weights;
         f.p.attn_weights = &f.weights;
       },
       MHA_ERR_OVERLAP, "params->attn_weights overlaps params->alibi_slopes"},
      {"a struct size of no version", [](ForwardFixture& f) { f.p.struct_size = 88; },
       MHA_ERR_INVALID_PARAMS, "params->struct_size is 88"},
  };
  for (const Bad& b : cases) {
    ForwardFixture f;
    b.edit(f);
    EXPECT_TRUE(fails_with(f.call(), b.status, b.text)) << b.what;
    EXPECT_TRUE(f.out_untouched()) << b.what << ": a failed call wrote an output";
  }
  // The defaults, and every variant in range, are accepted.
  ForwardFixture f;
  EXPECT_EQ(f.p.window_left, -1);
  EXPECT_EQ(f.p.window_right, -1);
  EXPECT_EQ(f.p.sinks, nullptr);
  EXPECT_EQ(f.p.softcap, 0.0f);
  EXPECT_EQ(f.p.alibi_slopes, nullptr);
  EXPECT_EQ(f.p.struct_size, sizeof(mha_module_forward_params));
  std::vector<float> sinks = {-INFINITY, 1e4f}, slopes = {0.0f, -0.5f, 0.25f, 1e3f};
  const mha_tensor sinks_t = describe(sinks.data(), MHA_DTYPE_F32, {2});
  const mha_tensor slopes_t = describe(slopes.data(), MHA_DTYPE_F32, {2, 2});
  f.p.window_left = 0, f.p.window_right = INT64_MAX, f.p.softcap = FLT_MAX;
  f.p.sinks = &sinks_t, f.p.alibi_slopes = &slopes_t, f.p.attn_weights = &f.weights;
  EXPECT_EQ(f.call(), MHA_OK) << mha_last_error();
}

// ------------------------------------------------------------------ C++ wrapper

TEST(ModuleCpp, RaiiMoveAndErrors) {
  mha::ModuleConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  config.bias = true;
  mha::Module a(config);
  std::vector<float> bias = {1, 2, 3, 4, 5, 6, 7, 8};
  a.set_weight("out_proj.bias", mha::Tensor(bias.data(), {8}));
  mha::Module b(std::move(a));
  EXPECT_EQ(a.get(), nullptr);  // NOLINT(bugprone-use-after-move,clang-analyzer-cplusplus.Move):
                                // the moved-from state is what is tested
  std::vector<float> x(2 * 3 * 8, 0.5f), o(2 * 3 * 8, 0.0f);
  mha::Tensor xt(x.data(), {2, 3, 8});
  mha::Tensor ot(o.data(), {2, 3, 8});
  b.forward(xt, xt, xt, ot);
  for (size_t n = 0; n < o.size(); ++n) EXPECT_EQ(o[n], bias[n % 8]);
  mha::Module c(4, 2);
  c = std::move(b);
  EXPECT_NE(c.get(), nullptr);
  std::vector<float> weights(2 * 2 * 3 * 3);
  mha::Tensor wt(weights.data(), {2, 2, 3, 3});
  c.forward(xt, xt, xt, ot,
            mha::ModuleForwardParams().attn_weights(wt).causal(MHA_CAUSAL_TOP_LEFT));
  EXPECT_EQ(weights[1], 0.0f);  // causal: query 0 does not see key 1
  EXPECT_FLOAT_EQ(weights[0], 1.0f);
  try {
    c.set_weight("nonsense", mha::Tensor(bias.data(), {8}));
    ADD_FAILURE() << "no exception";
  } catch (const mha::Error& e) {
    EXPECT_EQ(e.status(), MHA_ERR_INVALID_VALUE);
    EXPECT_NE(std::string(e.what()).find("unknown weight name 'nonsense'"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(mha::Module(10, 3), mha::Error);
  mha::Tensor pe(x.data(), {2, 3, 8});
  mha::positional_encoding_add(pe);
  EXPECT_EQ(x[1], 1.5f);  // position 0, column 1: cos(0) = 1
}

}  // namespace
}  // namespace mha_test
