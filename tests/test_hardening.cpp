// Regression tests of the hardening issue: fork safety, logits near FLT_MAX,
// size limits (stride-0 giants), exact visibility past 2^24 keys, and a
// failed allocation that leaves the outputs untouched.
#include <gtest/gtest.h>
#include <mha/mha.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "backend_param.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

// ------------------------------------------------------------------ fork

// q, k, v of one problem large enough that a call with 2 threads runs on the
// OpenMP pool (above the runtime's serial threshold).
struct ForkProblem {
  static constexpr int64_t B = 1, H = 4, L = 256, D = 64;
  std::vector<float> q, k, v;
  mha_tensor tq{}, tk{}, tv{};
  ForkProblem() : q(B * H * L * D), k(q.size()), v(q.size()) {
    Rng rng(91);
    for (auto* x : {&q, &k, &v}) {
      for (float& f : *x) f = rng.uniform();
    }
    tq = describe(q.data(), MHA_DTYPE_F32, {B, H, L, D});
    tk = describe(k.data(), MHA_DTYPE_F32, {B, H, L, D});
    tv = describe(v.data(), MHA_DTYPE_F32, {B, H, L, D});
  }
  std::vector<float> run() {
    std::vector<float> out(q.size(), 0.0f);
    mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {B, H, L, D});
    mha_attention_params p;
    mha_attention_params_init(&p);
    p.causal = MHA_CAUSAL_TOP_LEFT;
    if (mha_attention(&tq, &tk, &tv, &to, &p) != MHA_OK) out.clear();
    return out;
  }
};

// Waits for a child, killing it after `seconds`: a hang fails instead of
// blocking the suite.  Returns its exit status, or -1 when it hung.
int wait_with_timeout(pid_t child, int seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    const pid_t done = waitpid(child, &status, WNOHANG);
    if (done == child) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  return -1;
}

// The child's checks, as exit codes (no gtest in a forked child).
int child_after_fork(ForkProblem& problem, const std::vector<float>& expected) {
  if (mha_get_num_threads() != 1) return 10;  // serial until it chooses
  if (problem.run() != expected) return 11;   // same bits on one thread
  if (mha_set_num_threads(2) != MHA_OK) return 12;
  if (mha_get_num_threads() != 2) return 13;
  if (problem.run() != expected) return 14;  // on threads started for the call
  // A grandchild forked from the child, after the child used threads.
  const pid_t grandchild = fork();
  if (grandchild == 0) _exit(problem.run() == expected ? 0 : 15);
  return wait_with_timeout(grandchild, 60);
}

#ifdef MHA_TEST_UNDER_EMULATOR
#define MHA_SKIP_FORK_UNDER_EMULATOR()                                                      \
  GTEST_SKIP() << "qemu-user aborts a multi-threaded process that forks (an emulator bug, " \
                  "not mha's); the fork tests run natively"
#else
#define MHA_SKIP_FORK_UNDER_EMULATOR() (void)0
#endif

TEST(Fork, ChildOfAMultiThreadedCallerComputesWithoutHanging) {
  MHA_SKIP_FORK_UNDER_EMULATOR();
  ASSERT_EQ(mha_select_backend("auto"), MHA_OK) << mha_last_error();
  ASSERT_EQ(mha_set_num_threads(2), MHA_OK);
  ForkProblem problem;
  const std::vector<float> expected = problem.run();  // starts the OpenMP pool
  ASSERT_FALSE(expected.empty()) << mha_last_error();
  ASSERT_EQ(problem.run(), expected);

  std::fflush(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(child_after_fork(problem, expected));
  const int status = wait_with_timeout(child, 120);
  EXPECT_NE(status, -1) << "the forked child hung (killed after 120 s)";
  EXPECT_EQ(status, 0) << "the forked child failed check " << status;

  // The parent's own pool still works after the fork.
  EXPECT_EQ(problem.run(), expected);
  mha_set_num_threads(0);
}

TEST(Fork, ModuleInAChildOfAMultiThreadedCaller) {
  MHA_SKIP_FORK_UNDER_EMULATOR();
  // The module's projections run on BLIS, which threads with OpenMP too.
  constexpr int64_t E = 256, H = 4, B = 2, L = 128;
  mha_module_config cfg;
  mha_module_config_init(&cfg);
  cfg.embed_dim = E;
  cfg.num_heads = H;
  mha_module* module = nullptr;
  ASSERT_EQ(mha_module_create(&cfg, &module), MHA_OK) << mha_last_error();
  std::vector<float> w_in(3 * E * E), w_out(E * E), x(B * L * E);
  Rng rng(5);
  for (auto* a : {&w_in, &w_out, &x}) {
    for (float& f : *a) f = rng.uniform(-0.1f, 0.1f);
  }
  mha_tensor tw_in = describe(w_in.data(), MHA_DTYPE_F32, {3 * E, E});
  mha_tensor tw_out = describe(w_out.data(), MHA_DTYPE_F32, {E, E});
  ASSERT_EQ(mha_module_set_weight(module, "in_proj_weight", &tw_in), MHA_OK);
  ASSERT_EQ(mha_module_set_weight(module, "out_proj.weight", &tw_out), MHA_OK);
  mha_tensor tx = describe(x.data(), MHA_DTYPE_F32, {B, L, E});
  auto forward = [&] {
    std::vector<float> y(B * L * E, 0.0f);
    mha_tensor ty = describe(y.data(), MHA_DTYPE_F32, {B, L, E});
    if (mha_module_forward(module, &tx, &tx, &tx, &ty, nullptr) != MHA_OK) y.clear();
    return y;
  };
  ASSERT_EQ(mha_set_num_threads(2), MHA_OK);
  const std::vector<float> expected = forward();
  ASSERT_FALSE(expected.empty()) << mha_last_error();

  std::fflush(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const std::vector<float> serial = forward();
    if (serial.size() != expected.size()) _exit(20);
    mha_set_num_threads(2);
    const std::vector<float> threaded = forward();
    if (threaded.size() != expected.size()) _exit(21);
    // BLIS may block the projections differently with one thread: compare
    // within fp32 rounding, not bits.
    for (size_t i = 0; i < expected.size(); ++i) {
      if (std::fabs(serial[i] - expected[i]) > 1e-5f) _exit(22);
      if (std::fabs(threaded[i] - expected[i]) > 1e-5f) _exit(23);
    }
    _exit(0);
  }
  const int status = wait_with_timeout(child, 120);
  EXPECT_NE(status, -1) << "the forked child hung (killed after 120 s)";
  EXPECT_EQ(status, 0) << "the forked child failed check " << status;
  mha_module_destroy(module);
  mha_set_num_threads(0);
}

// ------------------------------------------------------------------ logits near FLT_MAX

class Hardening : public BackendTest {};

// q, k in [0.9, 1) with D = 32: every dot product is about 29, so with
// scale 1e37 every logit is about 2.9e38 -- within fp32 (FLT_MAX = 3.4e38),
// beyond FLT_MAX / log2(e) = 2.36e38, where base-2 units overflow.  The
// partial sums grow monotonically, so no intermediate overflows either.  The
// logits differ by ~1e35, so the softmax is one-hot: the output is the value
// row of the largest logit, which the float64 reference finds.
TEST_P(Hardening, LogitsNearFltMaxAreFinite) {
  for (const float scale : {1e37f, -1e37f}) {
    for (const int64_t lq : {int64_t{1}, int64_t{3}, int64_t{70}}) {
      for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_BOTTOM_RIGHT}) {
        SCOPED_TRACE("scale " + std::to_string(scale) + " Lq " + std::to_string(lq) + " causal " +
                     std::to_string(causal));
        const int64_t B = 1, H = 2, Hkv = 1, lk = 2200, D = 32, Dv = 8;
        Rng rng(static_cast<uint64_t>(lq * 7 + causal));
        std::vector<float> q(B * H * lq * D), k(B * Hkv * lk * D), v(B * Hkv * lk * Dv),
            out(B * H * lq * Dv, -7.0f), lse(B * H * lq, -7.0f);
        for (float& f : q) f = rng.uniform(0.9f, 1.0f);
        for (float& f : k) f = rng.uniform(0.9f, 1.0f);
        for (float& f : v) f = rng.uniform(-1.0f, 1.0f);
        mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {B, H, lq, D});
        mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {B, Hkv, lk, D});
        mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {B, Hkv, lk, Dv});
        mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {B, H, lq, Dv});
        mha_tensor tl = describe(lse.data(), MHA_DTYPE_F32, {B, H, lq});
        mha_attention_params p;
        mha_attention_params_init(&p);
        p.has_scale = 1;
        p.scale = scale;
        p.causal = causal;
        ASSERT_EQ(mha_attention(&tq, &tk, &tv, &to, &p), MHA_OK) << mha_last_error();
        p.lse = &tl;
        ASSERT_EQ(mha_attention(&tq, &tk, &tv, &to, &p), MHA_OK) << mha_last_error();
        const Reference ref = reference_attention(tq, tk, tv, &p);
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_TRUE(std::isfinite(out[i])) << "out[" << i << "] = " << out[i];
          EXPECT_NEAR(out[i], ref.out[i], 1e-5) << "out[" << i << "]";
        }
        for (size_t i = 0; i < lse.size(); ++i) {
          ASSERT_TRUE(std::isfinite(lse[i])) << "lse[" << i << "] = " << lse[i];
          EXPECT_NEAR(lse[i], ref.lse[i], 1e-5 * std::fabs(ref.lse[i])) << "lse[" << i << "]";
        }
      }
    }
  }
}

// Values near FLT_MAX that join the scores, with scales below 1 (found by a
// differential sweep of mha-run: the SIMD backends' careful pass took scores
// as dot products and divided the mask by |scale|, which overflowed):
// - a mask of -FLT_MAX on every key of a row (Hugging Face's padding): every
//   logit rounds to -FLT_MAX, so the weights are uniform and the output is
//   the mean of the row's values, as in PyTorch and the float64 reference;
// - a mask of +3e38 on one key: its weight is 1;
// - an ALiBi slope of 3e38 (only the key at distance 0 keeps a weight) and a
//   softcap of 3e38 (tanh is the identity there);
// - scale 0.5 with logits of 2.5e38-3.1e38, whose dot products pass FLT_MAX.
// In every case the weights are exact in fp32 (uniform or one-hot) or the
// logits small, so the outputs must match the reference within 2e-5.  Not
// the padded rows with split-KV: its key chunks are merged by their fp32
// LSEs, which at -FLT_MAX cannot hold log(keys in the chunk), so the chunks
// weigh alike whatever their sizes -- within docs/decisions.md's tolerance
// (4 · 2^-24 · max|logit|), but not the exact mean.
TEST_P(Hardening, ValuesNearFltMaxWithScalesBelowOne) {
  struct Geometry {
    const char* name;
    int64_t H, Hkv, Lq, Lk;
  };
  for (const Geometry& g : {Geometry{"prefill", 2, 1, 19, 45}, Geometry{"decode", 4, 2, 1, 70},
                            Geometry{"split-kv", 2, 1, 2, 2500}}) {
    for (int kase = 0; kase < 5; ++kase) {
      if (kase == 0 && g.Lk > 1000) continue;  // split-KV: see above
      SCOPED_TRACE(std::string(g.name) + " case " + std::to_string(kase));
      const int64_t B = 1, D = 32, Dv = 8;
      Rng rng(static_cast<uint64_t>(kase * 31 + g.Lk));
      std::vector<float> q(B * g.H * g.Lq * D), k(B * g.Hkv * g.Lk * D), v(B * g.Hkv * g.Lk * Dv),
          out(B * g.H * g.Lq * Dv, -7.0f), lse(B * g.H * g.Lq, -7.0f), mask,
          slopes(static_cast<size_t>(g.H), 3e38f);
      const float big = 4.4e18f;  // case 4: q, k in [0.9, 1) * big
      for (float& f : q) f = kase == 4 ? big * rng.uniform(0.9f, 1.0f) : rng.uniform(-1.0f, 1.0f);
      for (float& f : k) f = kase == 4 ? big * rng.uniform(0.9f, 1.0f) : rng.uniform(-1.0f, 1.0f);
      for (float& f : v) f = rng.uniform(-1.0f, 1.0f);
      mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {B, g.H, g.Lq, D});
      mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {B, g.Hkv, g.Lk, D});
      mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {B, g.Hkv, g.Lk, Dv});
      mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {B, g.H, g.Lq, Dv});
      mha_tensor tl = describe(lse.data(), MHA_DTYPE_F32, {B, g.H, g.Lq});
      mha_tensor tm{}, ts = describe(slopes.data(), MHA_DTYPE_F32, {g.H});
      mha_attention_params p;
      mha_attention_params_init(&p);
      p.lse = &tl;
      if (kase <= 1) {  // 0: every key of the even rows at -FLT_MAX; 1: one key at +3e38
        mask.assign(static_cast<size_t>(g.Lq * g.Lk), 0.0f);
        for (int64_t i = 0; i < g.Lq; ++i) {
          for (int64_t j = 0; j < g.Lk; ++j) {
            float& m = mask[static_cast<size_t>(i * g.Lk + j)];
            if (kase == 0 && i % 2 == 0) m = -FLT_MAX;
            if (kase == 1 && j == (i * 7) % g.Lk) m = 3e38f;
          }
        }
        tm = describe(mask.data(), MHA_DTYPE_F32, {g.Lq, g.Lk});
        p.mask = &tm;
      }
      if (kase == 2) p.alibi_slopes = &ts;
      if (kase == 3) p.softcap = 3e38f;
      if (kase == 4) p.has_scale = 1, p.scale = 0.5f;
      ASSERT_EQ(mha_attention(&tq, &tk, &tv, &to, &p), MHA_OK) << mha_last_error();
      const Reference ref = reference_attention(tq, tk, tv, &p);
      for (size_t i = 0; i < out.size(); ++i) {
        EXPECT_NEAR(out[i], ref.out[i], 2e-5) << "out[" << i << "]";
      }
      for (size_t i = 0; i < lse.size(); ++i) {
        EXPECT_NEAR(lse[i], ref.lse[i], 1e-5 * std::max(1.0, std::fabs(ref.lse[i])))
            << "lse[" << i << "]";
      }
    }
  }
}

// ------------------------------------------------------------------ sizes

// Q and K broadcast along every axis (stride 0): the element count is tiny
// whatever the head size, so only the runtime's limit stands between a huge
// D and the kernels' scratch arithmetic.
TEST_P(Hardening, HugeHeadSizesAreRefusedBeforeAnyWrite) {
  float q = 0.5f, k = 0.25f;
  std::vector<float> v(4, 1.0f), out(4, -7.0f);
  for (const int64_t d : {int64_t{1} << 57, (int64_t{1} << 57) + 3, int64_t{1} << 34,
                          int64_t{MHA_MAX_HEAD_DIM} + 1}) {
    SCOPED_TRACE("D = " + std::to_string(d));
    mha_tensor tq = describe(&q, MHA_DTYPE_F32, {1, 1, 1, d}, {0, 0, 0, 0});
    mha_tensor tk = describe(&k, MHA_DTYPE_F32, {1, 1, 4, d}, {0, 0, 0, 0});
    mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 1, 4, 1});
    mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {1, 1, 1, 1});
    EXPECT_EQ(mha_attention(&tq, &tk, &tv, &to, nullptr), MHA_ERR_INVALID_SIZE);
    const std::string message = mha_last_error();
    EXPECT_NE(message.find("q->shape[3]"), std::string::npos) << message;
    EXPECT_NE(message.find(d > MHA_MAX_EXTENT ? "MHA_MAX_EXTENT" : "MHA_MAX_HEAD_DIM"),
              std::string::npos)
        << message;
    EXPECT_EQ(out[0], -7.0f);
  }
  // The same for Dv.
  {
    float vv = 1.0f;
    std::vector<float> qq(4, 0.5f), kk(4, 0.25f);
    const int64_t dv = int64_t{1} << 57;
    mha_tensor tq = describe(qq.data(), MHA_DTYPE_F32, {1, 1, 1, 4});
    mha_tensor tk = describe(kk.data(), MHA_DTYPE_F32, {1, 1, 1, 4});
    mha_tensor tv = describe(&vv, MHA_DTYPE_F32, {1, 1, 1, dv}, {0, 0, 0, 0});
    mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {1, 1, 1, dv}, {0, 0, 0, 0});
    const mha_status s = mha_attention(&tq, &tk, &tv, &to, nullptr);
    EXPECT_TRUE(s == MHA_ERR_INVALID_SIZE || s == MHA_ERR_OVERLAP) << mha_status_name(s);
  }
}

// The largest head size works.  Stride-0 Q and K rows with values whose
// products and sums are exact in fp32 (q = 2^-16, k = (j + 1) / 8), so the
// dot products over 65536 terms carry no rounding and the tolerance of
// docs/decisions.md applies unchanged.
TEST_P(Hardening, LargestHeadSizeWorks) {
  const int64_t d = MHA_MAX_HEAD_DIM, lk = 5;
  float q = 1.0f / 65536.0f;
  std::vector<float> k(lk), v(lk * 3), out(3, -7.0f);
  Rng rng(3);
  for (int64_t j = 0; j < lk; ++j) k[static_cast<size_t>(j)] = static_cast<float>(j + 1) / 8.0f;
  for (float& f : v) f = rng.uniform();
  mha_tensor tq = describe(&q, MHA_DTYPE_F32, {1, 1, 1, d}, {0, 0, 0, 0});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {1, 1, lk, d}, {0, 0, 1, 0});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 1, lk, 3});
  mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {1, 1, 1, 3});
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &to, nullptr), MHA_OK) << mha_last_error();
  const Reference ref = reference_attention(tq, tk, tv, nullptr);
  EXPECT_LE(max_abs_error(to, ref), tolerance(ref));
}

// K and V broadcast with a key length near INT64_MAX: refused (the work
// plan's arithmetic would overflow), never MHA_OK with out unwritten.
TEST_P(Hardening, HugeKeyLengthsAreRefused) {
  std::vector<float> q(8, 0.5f), out(8, -7.0f);
  float k = 0.25f, v = 1.0f;
  for (const int64_t lk :
       {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() / 2,
        int64_t{1} << 50, MHA_MAX_EXTENT + 1}) {
    SCOPED_TRACE("Lk = " + std::to_string(lk));
    mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {1, 1, 1, 8});
    mha_tensor tk = describe(&k, MHA_DTYPE_F32, {1, 1, lk, 8}, {0, 0, 0, 0});
    mha_tensor tv = describe(&v, MHA_DTYPE_F32, {1, 1, lk, 8}, {0, 0, 0, 0});
    mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {1, 1, 1, 8});
    const mha_status s = mha_attention(&tq, &tk, &tv, &to, nullptr);
    EXPECT_TRUE(s == MHA_ERR_INVALID_SIZE || s == MHA_ERR_SIZE_OVERFLOW) << mha_status_name(s);
    const std::string message = mha_last_error();
    EXPECT_EQ(message.rfind('k', 0), 0u) << "the message does not name k: " << message;
    EXPECT_EQ(out[0], -7.0f);
  }
  int64_t shape[4] = {1, 1, MHA_MAX_EXTENT + 1, 8};
  mha_tensor t{};
  EXPECT_EQ(mha_tensor_init(&t, &k, MHA_DTYPE_F32, 4, shape, nullptr), MHA_ERR_INVALID_SIZE);
}

// Visibility past 2^24 keys (where floats stop counting exactly): one query
// over 2^24 + 10 keys, all alike (stride-0 K, so the softmax is uniform), a
// valid length of 2^24 + 3 and a huge value in the first hidden key's row.
// Reading one key too many moves the mean by 1e6 / 2^24.
TEST_P(Hardening, VisibilityIsExactPast2To24Keys) {
  const int64_t lk = (int64_t{1} << 24) + 10, len = (int64_t{1} << 24) + 3, D = 4;
  std::vector<float> v(static_cast<size_t>(lk), 0.0f);
  for (int64_t j = 0; j < len; ++j) v[static_cast<size_t>(j)] = (j % 7 == 0) ? 1.0f : 0.0f;
  v[static_cast<size_t>(len)] = 1e6f;
  std::vector<float> q(D, 0.5f), out(1, -7.0f);
  float k = 0.25f;
  int32_t valid_len = static_cast<int32_t>(len);
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {1, 1, 1, D});
  mha_tensor tk = describe(&k, MHA_DTYPE_F32, {1, 1, lk, D}, {0, 0, 0, 0});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 1, lk, 1});
  mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {1, 1, 1, 1});
  mha_tensor tl = describe(&valid_len, MHA_DTYPE_I32, {1});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.valid_lens = &tl;
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &to, &p), MHA_OK) << mha_last_error();
  const int64_t ones = (len + 6) / 7;  // keys j < len with j % 7 == 0
  const double expected = static_cast<double>(ones) / static_cast<double>(len);
  EXPECT_NEAR(out[0], expected, 1e-5);
}

// ------------------------------------------------------------------ failures write nothing

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MHA_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define MHA_TEST_SANITIZED 1
#endif
#endif

// Fault injection: this executable's aligned_alloc takes the place of libc's
// for libmha too (symbol interposition), and refuses large blocks while
// g_refuse_large is set.  libmha takes its scratch with aligned_alloc.
std::atomic<bool> g_refuse_large{false};
std::atomic<int> g_refused{0};

}  // namespace
}  // namespace mha_test

extern "C" void* aligned_alloc(size_t alignment, size_t size) {
  if (mha_test::g_refuse_large.load() && size >= (size_t{1} << 20)) {
    mha_test::g_refused.fetch_add(1);
    return nullptr;
  }
  return memalign(alignment, size);
}

namespace mha_test {
namespace {

// A scratch allocation that fails fails the call before any output is
// written.  The call runs on a fresh thread, whose scratch (kept per thread)
// is still empty, so the allocation is certainly attempted.
TEST_P(Hardening, OutOfMemoryLeavesOutputsUntouched) {
#ifdef MHA_TEST_SANITIZED
  GTEST_SKIP() << "the sanitizers replace aligned_alloc themselves";
#else
  const int64_t d = 16384, lq = 64, lk = 600;  // scratch of 2 MB (scalar) and more
  float q = 0.001f, k = 0.002f, v = 0.5f;
  std::vector<float> out(lq * d, -7.0f), lse(lq, -7.0f);
  mha_tensor tq = describe(&q, MHA_DTYPE_F32, {1, 1, lq, d}, {0, 0, 0, 0});
  mha_tensor tk = describe(&k, MHA_DTYPE_F32, {1, 1, lk, d}, {0, 0, 0, 0});
  mha_tensor tv = describe(&v, MHA_DTYPE_F32, {1, 1, lk, d}, {0, 0, 0, 0});
  mha_tensor to = describe(out.data(), MHA_DTYPE_F32, {1, 1, lq, d});
  mha_tensor tl = describe(lse.data(), MHA_DTYPE_F32, {1, 1, lq});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.lse = &tl;
  for (const int32_t threads : {1, 2}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
    mha_status status = MHA_OK;
    std::string message;
    g_refused = 0;
    std::thread caller([&] {
      g_refuse_large = true;
      status = mha_attention(&tq, &tk, &tv, &to, &p);
      g_refuse_large = false;
      message = mha_last_error();
    });
    caller.join();
    mha_set_num_threads(0);
    ASSERT_GT(g_refused.load(), 0) << "no large allocation was attempted: nothing was tested";
    EXPECT_EQ(status, MHA_ERR_OUT_OF_MEMORY) << message;
    EXPECT_NE(message.find("untouched"), std::string::npos) << message;
    for (float x : out) ASSERT_EQ(x, -7.0f) << "a failed call wrote out";
    for (float x : lse) ASSERT_EQ(x, -7.0f) << "a failed call wrote lse";
  }
  // With memory available, the same call succeeds.
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &to, &p), MHA_OK) << mha_last_error();
#endif
}

INSTANTIATE_TEST_SUITE_P(Backends, Hardening, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

}  // namespace
}  // namespace mha_test
