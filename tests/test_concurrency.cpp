// Concurrency: many caller threads, calls from inside the user's own OpenMP
// region, and backend / thread-count changes racing with calls.  Every result
// is compared bit for bit with the same call made single-threaded beforehand
// (results do not depend on the thread count: docs/decisions.md).  Run under
// ThreadSanitizer by scripts/test.sh (stage tsan, ctest label "concurrency").
#include <dirent.h>
#include <gtest/gtest.h>
#include <mha/mha.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

// One problem: inputs owned here and shared, read-only, by every caller.
struct Case {
  std::string name;
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
  Layout layout = Layout::BHLD;
  int32_t causal = MHA_CAUSAL_NONE;
  int mask = 0;  // 0 none, 1 bool [B,1,Lq,Lk], 2 additive [B,1,Lq,Lk]
  bool lens = false;
  std::vector<float> q, k, v, mask_f32;
  std::vector<uint8_t> mask_bool;
  std::vector<int32_t> lens_data;
  mha_tensor tq{}, tk{}, tv{}, tmask{}, tlens{};
  Shape4 so{};

  int64_t out_count() const { return B * H * Lq * Dv; }
  int64_t lse_count() const { return B * H * Lq; }
};

std::unique_ptr<Case> make_case(const std::string& name, int64_t B, int64_t H, int64_t Hkv,
                                int64_t Lq, int64_t Lk, int64_t D, int64_t Dv) {
  auto c = std::make_unique<Case>();
  c->name = name;
  c->B = B, c->H = H, c->Hkv = Hkv, c->Lq = Lq, c->Lk = Lk, c->D = D, c->Dv = Dv;
  return c;
}

// Fills the inputs and descriptors once the fields are set.
void finish(Case& c, uint64_t seed) {
  Rng rng(seed);
  const Shape4 sq = make_shape(c.layout, c.B, c.H, c.Lq, c.D);
  const Shape4 sk = make_shape(c.layout, c.B, c.Hkv, c.Lk, c.D);
  const Shape4 sv = make_shape(c.layout, c.B, c.Hkv, c.Lk, c.Dv);
  c.so = make_shape(c.layout, c.B, c.H, c.Lq, c.Dv);
  c.q.resize(static_cast<size_t>(sq.extent));
  c.k.resize(static_cast<size_t>(sk.extent));
  c.v.resize(static_cast<size_t>(sv.extent));
  for (auto* buf : {&c.q, &c.k, &c.v})
    for (float& x : *buf) x = rng.uniform();
  auto view = [](std::vector<float>& data, const Shape4& s) {
    return describe(data.data(), MHA_DTYPE_F32, {s.shape[0], s.shape[1], s.shape[2], s.shape[3]},
                    {s.strides[0], s.strides[1], s.strides[2], s.strides[3]});
  };
  c.tq = view(c.q, sq);
  c.tk = view(c.k, sk);
  c.tv = view(c.v, sv);
  const size_t mask_count = static_cast<size_t>(c.B * c.Lq * c.Lk);
  if (c.mask == 1) {
    c.mask_bool.resize(mask_count);
    for (auto& m : c.mask_bool) m = rng.chance(0.8) ? 1 : 0;
    c.tmask = describe(c.mask_bool.data(), MHA_DTYPE_BOOL, {c.B, 1, c.Lq, c.Lk});
  } else if (c.mask == 2) {
    c.mask_f32.resize(mask_count);
    for (auto& m : c.mask_f32) {
      m = rng.chance(0.1) ? -std::numeric_limits<float>::infinity() : rng.uniform(-2.0f, 2.0f);
    }
    c.tmask = describe(c.mask_f32.data(), MHA_DTYPE_F32, {c.B, 1, c.Lq, c.Lk});
  }
  if (c.lens) {
    for (int64_t b = 0; b < c.B; ++b) {
      c.lens_data.push_back(static_cast<int32_t>(rng.integer(0, c.Lk)));
    }
    c.tlens = describe(c.lens_data.data(), MHA_DTYPE_I32, {c.B});
  }
}

// The mixed workload: prefill and decode, GQA, masks, layouts, and
// decode-shaped calls with long key ranges, which the runtime splits over
// keys (split-KV) and merges.
std::vector<std::unique_ptr<Case>> make_cases() {
  std::vector<std::unique_ptr<Case>> cases;
  uint64_t seed = 1;
  auto add = [&](std::unique_ptr<Case> c) {
    finish(*c, ++seed);
    cases.push_back(std::move(c));
  };
  add(make_case("prefill GQA", 2, 4, 2, 17, 33, 32, 32));
  {
    auto c = make_case("prefill bool mask BLHD", 2, 3, 3, 9, 21, 16, 8);
    c->mask = 1, c->layout = Layout::BLHD;
    add(std::move(c));
  }
  {
    auto c = make_case("prefill additive mask causal", 1, 2, 1, 24, 40, 24, 24);
    c->mask = 2, c->causal = MHA_CAUSAL_BOTTOM_RIGHT;
    add(std::move(c));
  }
  {
    auto c = make_case("prefill causal valid_lens (threaded)", 2, 4, 4, 64, 64, 64, 64);
    c->causal = MHA_CAUSAL_TOP_LEFT, c->lens = true;
    add(std::move(c));
  }
  add(make_case("decode MQA", 2, 8, 1, 1, 100, 32, 32));
  add(make_case("decode GQA short", 1, 8, 2, 2, 70, 64, 64));
  add(make_case("decode split-KV", 1, 4, 1, 1, 2048, 32, 32));
  {
    auto c = make_case("decode split-KV masked", 2, 4, 2, 1, 1500, 16, 16);
    c->mask = 1, c->lens = true;
    add(std::move(c));
  }
  {
    auto c = make_case("decode split-KV additive", 1, 2, 2, 3, 3000, 8, 12);
    c->mask = 2, c->layout = Layout::BLHD;
    add(std::move(c));
  }
  add(make_case("tiny", 1, 1, 1, 1, 1, 1, 1));
  return cases;
}

struct Output {
  std::vector<float> out, lse;
};

mha_status call(const Case& c, Output& o) {
  o.out.assign(static_cast<size_t>(c.so.extent), -7.0f);
  o.lse.assign(static_cast<size_t>(c.lse_count()), -7.0f);
  mha_tensor out = describe(o.out.data(), MHA_DTYPE_F32,
                            {c.so.shape[0], c.so.shape[1], c.so.shape[2], c.so.shape[3]},
                            {c.so.strides[0], c.so.strides[1], c.so.strides[2], c.so.strides[3]});
  mha_tensor lse = describe(o.lse.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.causal = c.causal;
  if (c.mask != 0) p.mask = &c.tmask;
  if (c.lens) p.valid_lens = &c.tlens;
  p.lse = &lse;
  return mha_attention(&c.tq, &c.tk, &c.tv, &out, &p);
}

bool same_bits(const Output& a, const Output& b) {
  return a.out.size() == b.out.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

std::vector<std::string> usable_backends() {
  std::vector<std::string> names;
  for (const auto& b : list_backends()) {
    if (b.usable) names.push_back(b.name);
  }
  return names;
}

// Cases and, per usable backend, each case's single-threaded result (also
// checked against the reference, so the comparisons below compare with
// something right).
class Concurrency : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cases_ = new std::vector<std::unique_ptr<Case>>(make_cases());
    expected_ = new std::map<std::string, std::vector<Output>>();
    ASSERT_EQ(mha_set_num_threads(1), MHA_OK);
    for (const auto& backend : usable_backends()) {
      ASSERT_EQ(mha_select_backend(backend.c_str()), MHA_OK) << mha_last_error();
      auto& results = (*expected_)[backend];
      for (const auto& c : *cases_) {
        results.emplace_back();
        ASSERT_EQ(call(*c, results.back()), MHA_OK)
            << backend << " " << c->name << ": " << mha_last_error();
        mha_attention_params p;
        mha_attention_params_init(&p);
        p.causal = c->causal;
        if (c->mask != 0) p.mask = &c->tmask;
        if (c->lens) p.valid_lens = &c->tlens;
        const Reference ref = reference_attention(c->tq, c->tk, c->tv, &p);
        mha_tensor out =
            describe(results.back().out.data(), MHA_DTYPE_F32,
                     {c->so.shape[0], c->so.shape[1], c->so.shape[2], c->so.shape[3]},
                     {c->so.strides[0], c->so.strides[1], c->so.strides[2], c->so.strides[3]});
        ASSERT_LE(max_abs_error(out, ref), tolerance(ref)) << backend << " " << c->name;
      }
    }
    ASSERT_EQ(mha_set_num_threads(0), MHA_OK);
    ASSERT_EQ(mha_select_backend("auto"), MHA_OK);
  }
  static void TearDownTestSuite() {
    delete cases_;
    delete expected_;
    cases_ = nullptr;
    expected_ = nullptr;
  }
  void TearDown() override {
    mha_set_num_threads(0);
    mha_select_backend("auto");
  }

  static std::vector<std::unique_ptr<Case>>* cases_;
  static std::map<std::string, std::vector<Output>>* expected_;
};
std::vector<std::unique_ptr<Case>>* Concurrency::cases_ = nullptr;
std::map<std::string, std::vector<Output>>* Concurrency::expected_ = nullptr;

constexpr int kCallers = 8;
constexpr int kCallsPerCaller = 200;

// What a storm of calls found: failures and mismatches, with the first of each.
struct Tally {
  std::atomic<int64_t> calls{0}, failed{0}, mismatched{0};
  std::mutex mutex;
  std::string first;
  void note(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    if (first.empty()) first = what;
  }
};

TEST_F(Concurrency, ManyCallerThreadsOnEachBackend) {
  const auto& cases = *cases_;
  for (const auto& backend : usable_backends()) {
    SCOPED_TRACE(backend);
    ASSERT_EQ(mha_select_backend(backend.c_str()), MHA_OK);
    const auto& expected = expected_->at(backend);
    Tally tally;
    std::vector<std::thread> callers;
    callers.reserve(kCallers);
    for (int t = 0; t < kCallers; ++t) {
      callers.emplace_back([&, t] {
        Output o;
        for (int n = 0; n < kCallsPerCaller; ++n) {
          const size_t index = static_cast<size_t>(t * 7 + n * 3) % cases.size();
          const mha_status s = call(*cases[index], o);
          ++tally.calls;
          if (s != MHA_OK) {
            ++tally.failed;
            tally.note(cases[index]->name + ": " + mha_last_error());
          } else if (!same_bits(o, expected[index])) {
            ++tally.mismatched;
            tally.note(cases[index]->name + ": differs from the single-threaded result");
          }
        }
      });
    }
    for (auto& th : callers) th.join();
    EXPECT_EQ(tally.calls.load(), kCallers * kCallsPerCaller);
    EXPECT_EQ(tally.failed.load(), 0) << tally.first;
    EXPECT_EQ(tally.mismatched.load(), 0) << tally.first;
  }
}

// Threads of this process, from /proc/self/task (0 where there is no /proc).
int count_threads() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return 0;
  int n = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n;
}

TEST_F(Concurrency, CallsInsideTheUsersOpenMPRegion) {
  // Inside the caller's parallel region a call runs on the calling thread:
  // starting a nested team per caller thread would oversubscribe the cores.
  // Nesting is enabled here, so a runtime that did start nested teams would
  // create new threads; the thread count shows it.
  const auto& cases = *cases_;
  ASSERT_EQ(mha_select_backend("auto"), MHA_OK);
  const char* selected = mha_selected_backend();
  ASSERT_NE(selected, nullptr);
  const auto& expected = expected_->at(selected);
  ASSERT_EQ(mha_set_num_threads(4), MHA_OK);
  const int saved_levels = omp_get_max_active_levels();
  omp_set_max_active_levels(4);
  constexpr int kTeam = 4;
  // Warm up: the outer team's threads exist before counting.
#pragma omp parallel num_threads(kTeam)
  { (void)omp_get_thread_num(); }
  const int threads_before = count_threads();

  Tally tally;
  std::atomic<int> threads_inside{0};
  int team_size = 0;
#pragma omp parallel num_threads(kTeam)
  {
#pragma omp single
    team_size = omp_get_num_threads();
    Output o;
    const int t = omp_get_thread_num();
    for (int n = 0; n < 60; ++n) {
      const size_t index = static_cast<size_t>(t * 5 + n) % cases.size();
      const mha_status s = call(*cases[index], o);
      ++tally.calls;
      if (s != MHA_OK) {
        ++tally.failed;
        tally.note(cases[index]->name + ": " + mha_last_error());
      } else if (!same_bits(o, expected[index])) {
        ++tally.mismatched;
        tally.note(cases[index]->name + ": differs from the single-threaded result");
      }
    }
#pragma omp barrier
#pragma omp single
    threads_inside = count_threads();
  }
  omp_set_max_active_levels(saved_levels);
  EXPECT_EQ(team_size, kTeam) << "the test's own region did not get its team";
  EXPECT_EQ(tally.failed.load(), 0) << tally.first;
  EXPECT_EQ(tally.mismatched.load(), 0) << tally.first;
  if (threads_before > 0) {
    EXPECT_LE(threads_inside.load(), threads_before)
        << "calls inside a parallel region started new threads (nested teams): " << threads_before
        << " threads before, " << threads_inside.load() << " inside";
  }
}

TEST_F(Concurrency, SelectionAndThreadCountChangeDuringCalls) {
  // One thread keeps switching the backend and the thread count while others
  // call: each call runs wholly on one backend, so its result must be, bit for
  // bit, that backend's result.
  const auto& cases = *cases_;
  const auto backends = usable_backends();
  std::atomic<bool> done{false};
  std::atomic<int64_t> switches{0}, bad_switches{0};
  std::thread switcher([&] {
    const int32_t counts[] = {0, 1, 2, 3, 4};
    size_t n = 0;
    while (!done.load()) {
      const std::string name = n % (backends.size() + 1) == backends.size()
                                   ? std::string("auto")
                                   : backends[n % (backends.size() + 1)];
      if (mha_select_backend(name.c_str()) != MHA_OK) ++bad_switches;
      if (mha_set_num_threads(counts[n % 5]) != MHA_OK) ++bad_switches;
      if (mha_selected_backend() == nullptr) ++bad_switches;
      (void)mha_get_num_threads();
      ++switches;
      ++n;
      std::this_thread::yield();
    }
  });
  Tally tally;
  std::vector<std::thread> callers;
  callers.reserve(kCallers);
  for (int t = 0; t < kCallers - 2; ++t) {
    callers.emplace_back([&, t] {
      // The calls start once the switcher runs: on a loaded machine it could
      // otherwise be scheduled only after they all ended, and the test would
      // prove nothing.
      while (switches.load() == 0) std::this_thread::yield();
      Output o;
      for (int n = 0; n < kCallsPerCaller / 2; ++n) {
        const size_t index = static_cast<size_t>(t * 3 + n) % cases.size();
        const mha_status s = call(*cases[index], o);
        ++tally.calls;
        if (s != MHA_OK) {
          ++tally.failed;
          tally.note(cases[index]->name + ": " + mha_last_error());
          continue;
        }
        bool matches_one = false;
        for (const auto& [name, results] : *expected_) {
          matches_one = matches_one || same_bits(o, results[index]);
        }
        if (!matches_one) {
          ++tally.mismatched;
          tally.note(cases[index]->name + ": matches no backend's single-threaded result");
        }
      }
    });
  }
  for (auto& th : callers) th.join();
  done = true;
  switcher.join();
  EXPECT_GT(switches.load(), 0);
  EXPECT_EQ(bad_switches.load(), 0);
  EXPECT_EQ(tally.failed.load(), 0) << tally.first;
  EXPECT_EQ(tally.mismatched.load(), 0) << tally.first;
}

TEST_F(Concurrency, ErrorMessagesBelongToTheirThread) {
  // Each thread fails in its own way and must read its own message back, even
  // while the others fail and succeed around it.
  std::atomic<int64_t> wrong{0};
  std::mutex mutex;
  std::string first;
  std::vector<std::thread> threads;
  threads.reserve(kCallers);
  for (int t = 0; t < kCallers; ++t) {
    threads.emplace_back([&, t] {
      for (int n = 0; n < 300; ++n) {
        std::string expect;
        if (t % 2 == 0) {
          const int32_t bad = -(1000 + t);
          if (mha_set_num_threads(bad) != MHA_ERR_INVALID_VALUE) ++wrong;
          expect = std::to_string(bad);
        } else {
          mha_backend_info info{};
          const int32_t bad = 1000 + t;
          if (mha_backend_get_info(bad, &info) != MHA_ERR_INVALID_VALUE) ++wrong;
          expect = std::to_string(bad);
        }
        std::this_thread::yield();
        const std::string message = mha_last_error();
        if (message.find(expect) == std::string::npos) {
          ++wrong;
          std::lock_guard<std::mutex> lock(mutex);
          if (first.empty()) first = "thread " + std::to_string(t) + " read \"" + message + "\"";
        }
        mha_backend_info info{};
        if (mha_backend_get_info(0, &info) != MHA_OK || *mha_last_error() != '\0') ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0) << first;
}

// The backward passes from several caller threads at once, on one shared
// module: mha_module_backward runs the forward, the attention's backward
// (its plan, its per-thread scratch) and the BLIS products; every caller's
// gradients must be the single-threaded call's bits.
TEST(ConcurrentBackward, CallersShareOneModule) {
  const int64_t B = 2, Lq = 40, Lk = 70, E = 32, H = 4;
  mha_module_config config;
  mha_module_config_init(&config);
  config.embed_dim = E;
  config.num_heads = H;
  config.dropout = 0.2f;
  mha_module* module = nullptr;
  ASSERT_EQ(mha_module_create(&config, &module), MHA_OK) << mha_last_error();
  Rng rng(5);
  const auto random = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = rng.uniform(-0.5f, 0.5f);
    return v;
  };
  std::vector<float> w_in = random(3 * E * E), w_out = random(E * E), b_in = random(3 * E);
  mha_tensor tw_in = describe(w_in.data(), MHA_DTYPE_F32, {3 * E, E});
  mha_tensor tw_out = describe(w_out.data(), MHA_DTYPE_F32, {E, E});
  mha_tensor tb_in = describe(b_in.data(), MHA_DTYPE_F32, {3 * E});
  ASSERT_EQ(mha_module_set_weight(module, "in_proj_weight", &tw_in), MHA_OK);
  ASSERT_EQ(mha_module_set_weight(module, "out_proj.weight", &tw_out), MHA_OK);
  ASSERT_EQ(mha_module_set_weight(module, "in_proj_bias", &tb_in), MHA_OK);
  std::vector<float> q = random(B * Lq * E), kv = random(B * Lk * E), dout = random(B * Lq * E);
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {B, Lq, E});
  mha_tensor tkv = describe(kv.data(), MHA_DTYPE_F32, {B, Lk, E});
  mha_tensor tdout = describe(dout.data(), MHA_DTYPE_F32, {B, Lq, E});
  mha_module_forward_params params;
  mha_module_forward_params_init(&params);
  params.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  params.training = 1;
  params.dropout_seed = 3;

  // One caller's gradients: the inputs' and in_proj's, in one vector.
  const auto backward = [&](std::vector<float>& all) {
    all.assign(static_cast<size_t>(B * Lq * E + B * Lk * E + 3 * E * E + E * E), 0.0f);
    float* at = all.data();
    mha_tensor dq = describe(at, MHA_DTYPE_F32, {B, Lq, E});
    mha_tensor dkv = describe(at += B * Lq * E, MHA_DTYPE_F32, {B, Lk, E});
    mha_tensor dwq = describe(at += B * Lk * E, MHA_DTYPE_F32, {E, E});
    mha_tensor dwk = describe(at += E * E, MHA_DTYPE_F32, {E, E});
    mha_tensor dwv = describe(at += E * E, MHA_DTYPE_F32, {E, E});
    mha_tensor dwo = describe(at += E * E, MHA_DTYPE_F32, {E, E});
    mha_module_gradients grads;
    mha_module_gradients_init(&grads);
    grads.query = &dq;
    grads.key = grads.value = &dkv;
    grads.q_proj_weight = &dwq;
    grads.k_proj_weight = &dwk;
    grads.v_proj_weight = &dwv;
    grads.out_proj_weight = &dwo;
    return mha_module_backward(module, &tq, &tkv, &tkv, &tdout, &params, &grads);
  };
  std::vector<float> expected;
  ASSERT_EQ(mha_set_num_threads(1), MHA_OK);
  ASSERT_EQ(backward(expected), MHA_OK) << mha_last_error();
  ASSERT_EQ(mha_set_num_threads(2), MHA_OK);
  std::atomic<int> failed{0}, mismatched{0};
  std::vector<std::thread> callers;
  callers.reserve(3);
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([&] {
      for (int n = 0; n < 3; ++n) {
        std::vector<float> got;
        if (backward(got) != MHA_OK) {
          ++failed;
        } else if (std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) != 0) {
          ++mismatched;
        }
      }
    });
  }
  for (auto& th : callers) th.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(mismatched.load(), 0);
  mha_set_num_threads(0);
  mha_module_destroy(module);
}

}  // namespace
}  // namespace mha_test
