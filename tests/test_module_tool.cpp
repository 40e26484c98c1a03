// `mha-run module` as a program: the ends of ctest chains
// (tests/CMakeLists.txt) around it.  ModuleTool.Write writes weights and
// inputs into $MHA_MODULE_TOOL_DIR, ctest runs `mha-run module` on them,
// ModuleTool.Check compares its files with the reference.  Without
// MHA_MODULE_TOOL_DIR (a plain run of test_module) they skip; ctest runs them
// only in the chains.  Built only with mha-run and its npy library.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "module_case.h"
#include "npy.h"

namespace mha_test {
namespace {

std::string tool_dir() {
  const char* dir = std::getenv("MHA_MODULE_TOOL_DIR");
  return dir != nullptr ? dir : "";
}

mha_tools::NpyArray npy_of(const std::vector<float>& v, std::vector<int64_t> shape) {
  mha_tools::NpyArray a(mha_tools::NpyDtype::F32, std::move(shape));
  for (int64_t i = 0; i < a.size(); ++i)
    a.set_from_double(i, static_cast<double>(v[static_cast<size_t>(i)]));
  return a;
}

mha_tools::NpyArray random_npy(Rng& rng, std::vector<int64_t> shape, float amplitude = 1.0f) {
  mha_tools::NpyArray a(mha_tools::NpyDtype::F32, std::move(shape));
  for (int64_t i = 0; i < a.size(); ++i)
    a.set_from_double(i, static_cast<double>(rng.uniform(-amplitude, amplitude)));
  return a;
}

// The tool cases:
//   a: PyTorch names and biases, config.json with num_heads 4, batch-first
//      query [2, 5, 16], key = value [2, 7, 16], valid_lens [B], averaged weights;
//   b: q/k/v_proj_weight (Eq 12, Ek = Ev 10), no biases, --heads 2, sequence-first,
//      a bool key_padding_mask, an f32 attn_mask [Lq, Lk], causal, per-head weights;
//   c: the attention variants: --heads 4, query [2, 6, 16] (amplitude 4, so
//      that the softcap bites), key = value [2, 9, 16], --window 3,1, causal
//      bottom-right, --softcap 1.5, sinks [H] (one -inf), ALiBi slopes [B, H],
//      per-head weights.
struct ToolCase {
  const char* name;
  int64_t B, Lq, Lk, E, H, Eq, Ek, Ev;
  bool bias, seq_first;
};
const ToolCase kToolCases[] = {{"a", 2, 5, 7, 16, 4, 16, 16, 16, true, false},
                               {"b", 2, 6, 8, 8, 2, 12, 10, 10, false, true},
                               {"c", 2, 6, 9, 16, 4, 16, 16, 16, true, false}};

ModuleWeights tool_weights(const ToolCase& t, Rng& rng,
                           std::vector<std::pair<std::string, mha_tools::NpyArray>>* files) {
  ModuleWeights w;
  w.embed_dim = t.E, w.num_heads = t.H, w.query_dim = t.Eq, w.key_dim = t.Ek, w.value_dim = t.Ev;
  const auto make = [&](int64_t rows, int64_t cols, bool zero) {
    std::vector<float> v(static_cast<size_t>(rows * cols), 0.0f);
    if (!zero)
      for (float& x : v) x = rng.uniform(-0.3f, 0.3f);
    return v;
  };
  std::vector<float> wq = make(t.E, t.Eq, false), wk = make(t.E, t.Ek, false),
                     wv = make(t.E, t.Ev, false), wo = make(t.E, t.E, false),
                     bq = make(t.E, 1, !t.bias), bk = make(t.E, 1, !t.bias),
                     bv = make(t.E, 1, !t.bias), bo = make(t.E, 1, !t.bias);
  const auto d = [](const std::vector<float>& v) {
    return std::vector<double>(v.begin(), v.end());
  };
  w.w_q = d(wq), w.w_k = d(wk), w.w_v = d(wv), w.w_o = d(wo), w.b_q = d(bq), w.b_k = d(bk),
  w.b_v = d(bv), w.b_o = d(bo);
  if (files != nullptr) {
    if (t.Eq == t.E && t.Ek == t.E && t.Ev == t.E) {
      std::vector<float> in = wq;
      in.insert(in.end(), wk.begin(), wk.end());
      in.insert(in.end(), wv.begin(), wv.end());
      files->emplace_back("in_proj_weight", npy_of(in, {3 * t.E, t.E}));
    } else {
      files->emplace_back("q_proj_weight", npy_of(wq, {t.E, t.Eq}));
      files->emplace_back("k_proj_weight", npy_of(wk, {t.E, t.Ek}));
      files->emplace_back("v_proj_weight", npy_of(wv, {t.E, t.Ev}));
    }
    files->emplace_back("out_proj.weight", npy_of(wo, {t.E, t.E}));
    if (t.bias) {
      std::vector<float> in = bq;
      in.insert(in.end(), bk.begin(), bk.end());
      in.insert(in.end(), bv.begin(), bv.end());
      files->emplace_back("in_proj_bias", npy_of(in, {3 * t.E}));
      files->emplace_back("out_proj.bias", npy_of(bo, {t.E}));
    }
  }
  return w;
}

// Everything of a case but the weights, derived from its seed.
struct ToolInputs {
  mha_tools::NpyArray query, key, valid_lens, kpm, attn_mask, sinks, alibi;
};

ToolInputs tool_inputs(const ToolCase& t, Rng& rng) {
  ToolInputs in;
  const float amplitude = t.name[0] == 'c' ? 4.0f : 1.0f;
  in.query = random_npy(
      rng,
      t.seq_first ? std::vector<int64_t>{t.Lq, t.B, t.Eq} : std::vector<int64_t>{t.B, t.Lq, t.Eq},
      amplitude);
  in.key = random_npy(rng, t.seq_first ? std::vector<int64_t>{t.Lk, t.B, t.Ek}
                                       : std::vector<int64_t>{t.B, t.Lk, t.Ek});
  if (t.name[0] == 'a') {
    in.valid_lens = mha_tools::NpyArray(mha_tools::NpyDtype::I32, {t.B});
    in.valid_lens.set_from_double(0, 4);
    in.valid_lens.set_from_double(1, 7);
  } else if (t.name[0] == 'c') {
    in.sinks = mha_tools::NpyArray(mha_tools::NpyDtype::F32, {t.H});
    for (int64_t h = 0; h < t.H; ++h)
      in.sinks.set_from_double(h, h == 1 ? -HUGE_VAL : 0.5 * static_cast<double>(h));
    in.alibi = mha_tools::NpyArray(mha_tools::NpyDtype::F32, {t.B, t.H});
    for (int64_t b = 0; b < t.B; ++b)  // 2^-(h + 1) · (b + 1)
      for (int64_t h = 0; h < t.H; ++h)
        in.alibi.set_from_double(
            b * t.H + h, std::exp2(-static_cast<double>(h + 1)) * static_cast<double>(b + 1));
  } else {
    in.kpm = mha_tools::NpyArray(mha_tools::NpyDtype::Bool, {t.B, t.Lk});
    for (int64_t i = 0; i < in.kpm.size(); ++i) in.kpm.set_from_double(i, rng.chance(0.3) ? 1 : 0);
    in.attn_mask = random_npy(rng, {t.Lq, t.Lk}, 2.0f);
  }
  return in;
}

void write_file(const std::string& path, const mha_tools::NpyArray& a) {
  mha_tools::write_npy(path, a);
}

TEST(ModuleTool, Write) {
  const std::string dir = tool_dir();
  if (dir.empty()) GTEST_SKIP() << "runs in the ctest chain (MHA_MODULE_TOOL_DIR unset)";
  for (const ToolCase& t : kToolCases) {
    const std::string root = dir + "/" + t.name;
    const std::string weights_dir = root + "/weights";
    std::filesystem::create_directories(weights_dir);
    Rng rng(t.name[0]);
    std::vector<std::pair<std::string, mha_tools::NpyArray>> files;
    tool_weights(t, rng, &files);
    for (const auto& [key, array] : files) write_file(weights_dir + "/" + (key + ".npy"), array);
    if (t.name[0] == 'a') {
      std::FILE* f = std::fopen((weights_dir + "/config.json").c_str(), "w");
      ASSERT_NE(f, nullptr);
      std::fprintf(f, "{\"num_heads\": %lld, \"embed_dim\": %lld}\n", static_cast<long long>(t.H),
                   static_cast<long long>(t.E));
      std::fclose(f);
    }
    ToolInputs in = tool_inputs(t, rng);
    write_file(root + "/query.npy", in.query);
    write_file(root + "/key.npy", in.key);
    if (t.name[0] == 'a') {
      write_file(root + "/valid_lens.npy", in.valid_lens);
    } else if (t.name[0] == 'c') {
      write_file(root + "/sinks.npy", in.sinks);
      write_file(root + "/alibi.npy", in.alibi);
      write_file(root + "/sinks3.npy", random_npy(rng, {3}));  // refused: H is 4
    } else {
      write_file(root + "/kpm.npy", in.kpm);
      write_file(root + "/attn_mask.npy", in.attn_mask);
    }
  }
  // Directories the tool must refuse: a weight PyTorch has but mha does not
  // support, and no number of heads anywhere.
  std::filesystem::create_directories(dir + "/bias_kv");
  std::filesystem::create_directories(dir + "/no_heads");
  Rng rng(3);
  write_file(dir + "/bias_kv/out_proj.weight.npy", random_npy(rng, {16, 16}));
  write_file(dir + "/bias_kv/bias_k.npy", random_npy(rng, {1, 1, 16}));
  write_file(dir + "/no_heads/out_proj.weight.npy", random_npy(rng, {16, 16}));
}

TEST(ModuleTool, Check) {
  const std::string dir = tool_dir();
  const char* which = std::getenv("MHA_MODULE_TOOL_CASE");
  if (dir.empty() || which == nullptr)
    GTEST_SKIP() << "runs in the ctest chain (MHA_MODULE_TOOL_DIR unset)";
  const ToolCase* found = nullptr;
  for (const ToolCase& t : kToolCases)
    if (std::string(t.name) == which) found = &t;
  ASSERT_NE(found, nullptr) << which;
  const ToolCase& t = *found;
  const std::string root = dir + "/" + t.name;
  Rng rng(t.name[0]);
  const ModuleWeights w = tool_weights(t, rng, nullptr);
  ToolInputs in = tool_inputs(t, rng);  // regenerated: the same values as written
  mha_tools::NpyArray out = mha_tools::read_npy(root + "/out.npy");
  mha_tools::NpyArray weights = mha_tools::read_npy(root + "/weights.npy");
  const auto view = [&](mha_tools::NpyArray& a, mha_dtype dtype, bool swap) {
    std::vector<int64_t> shape = a.shape(), strides = a.strides();
    if (swap) std::swap(shape[0], shape[1]), std::swap(strides[0], strides[1]);
    return describe(a.data(), dtype, shape, strides);
  };
  ASSERT_EQ(out.shape(), (t.seq_first ? std::vector<int64_t>{t.Lq, t.B, t.E}
                                      : std::vector<int64_t>{t.B, t.Lq, t.E}));
  const mha_tensor q = view(in.query, MHA_DTYPE_F32, t.seq_first);
  const mha_tensor k = view(in.key, MHA_DTYPE_F32, t.seq_first);
  const mha_tensor o = view(out, MHA_DTYPE_F32, t.seq_first);
  ModuleInputs ri;
  ri.query = &q;
  ri.key = &k;
  ri.value = &k;
  mha_tensor vl{}, kpm{}, am{}, sinks{}, alibi{};
  if (t.name[0] == 'a') {
    vl = view(in.valid_lens, MHA_DTYPE_I32, false);
    ri.valid_lens = &vl;
  } else if (t.name[0] == 'c') {
    sinks = view(in.sinks, MHA_DTYPE_F32, false);
    alibi = view(in.alibi, MHA_DTYPE_F32, false);
    ri.sinks = &sinks;
    ri.alibi_slopes = &alibi;
    ri.window_left = 3;
    ri.window_right = 1;
    ri.softcap = 1.5;
    ri.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  } else {
    kpm = view(in.kpm, MHA_DTYPE_BOOL, false);
    am = view(in.attn_mask, MHA_DTYPE_F32, false);
    ri.key_padding_mask = &kpm;
    ri.attn_mask = &am;
    ri.causal = MHA_CAUSAL_TOP_LEFT;
  }
  const ModuleReference ref = reference_module(w, ri);
  const BoundCheck oc = check_within(o, ref.out, ref.out_bound);
  EXPECT_EQ(oc.outside, 0) << report("out.npy", oc);
  const mha_tensor wt = view(weights, MHA_DTYPE_F32, false);
  const bool average = t.name[0] == 'a';
  ASSERT_EQ(weights.rank(), average ? 3 : 4);
  const BoundCheck wc = average ? check_within(wt, ref.average, ref.average_bound)
                                : check_within(wt, ref.weights, ref.weights_bound);
  EXPECT_EQ(wc.outside, 0) << report("weights.npy", wc);
}

}  // namespace
}  // namespace mha_test
