// Memory (label "heavy"): one call over Lq = Lk = 32768, D = 64, one head.
// The fused kernel never builds the Lq x Lk score matrix, so the peak resident
// memory of the call beyond its inputs and output must stay below a bound that
// does not depend on the length; the unfused method would need the 4 GiB
// matrix.  Meaningless under sanitizers (their shadow memory): native only.
#include <gtest/gtest.h>
#include <mha/mha.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

constexpr int64_t kL = 32768, kD = 64;
constexpr int64_t kMiB = 1024 * 1024;
constexpr int64_t kBound = 64 * kMiB;

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"), or -1.
int64_t status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.compare(0, prefix.size(), prefix) == 0) {
      return std::stoll(line.substr(prefix.size())) * 1024;  // "  1234 kB"
    }
  }
  return -1;
}

// Resets the peak resident size (VmHWM) to the current one, where the kernel
// allows it (Linux >= 4.0: "5" into clear_refs).
bool reset_peak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good();
}

struct PeakMeter {
  bool exact = false;  // VmHWM was reset, so the peak belongs to the measured span
  int64_t start = 0;

  void begin() {
    exact = reset_peak() && status_bytes("VmHWM") > 0;
    if (exact) {
      start = status_bytes("VmRSS");
    } else {
      // Fallback: the peak so far (a lower bound of the growth afterwards).
      rusage usage{};
      getrusage(RUSAGE_SELF, &usage);
      start = static_cast<int64_t>(usage.ru_maxrss) * 1024;
    }
  }
  int64_t growth() const {
    int64_t peak = 0;
    if (exact) {
      peak = status_bytes("VmHWM");
    } else {
      rusage usage{};
      getrusage(RUSAGE_SELF, &usage);
      peak = static_cast<int64_t>(usage.ru_maxrss) * 1024;
    }
    return peak - start;
  }
};

TEST(Memory, TheMeterSeesAnAllocation) {
  // The measurement itself: 80 MiB touched inside the span must show.
  PeakMeter meter;
  meter.begin();
  {
    std::vector<char> block(static_cast<size_t>(80 * kMiB));
    for (size_t n = 0; n < block.size(); n += 4096) block[n] = static_cast<char>(n);
    volatile char sink = block[block.size() / 2];
    (void)sink;
  }
  EXPECT_GE(meter.growth(), 70 * kMiB) << "the peak-memory measurement does not work here";
}

TEST(Memory, PeakOfA32kTokenCallDoesNotGrowWithLength) {
  // Inputs and output allocated and touched before measuring: 4 x 8 MiB.
  std::vector<float> q(static_cast<size_t>(kL * kD)), k(q.size()), v(q.size()), out(q.size());
  Rng rng(32768);
  for (auto* buf : {&q, &k, &v})
    for (float& x : *buf) x = rng.uniform();
  std::fill(out.begin(), out.end(), -1.0f);
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {1, 1, kL, kD});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {1, 1, kL, kD});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 1, kL, kD});
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, 1, kL, kD});
  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = MHA_CAUSAL_TOP_LEFT;  // half the work of the full matrix: ~140 GFLOP

  // Load the plugins and start the threads first: their one-time memory is
  // not the call's.
  {
    mha_tensor sq = describe(q.data(), MHA_DTYPE_F32, {1, 1, 256, kD});
    mha_tensor sk = describe(k.data(), MHA_DTYPE_F32, {1, 1, 256, kD});
    mha_tensor sv = describe(v.data(), MHA_DTYPE_F32, {1, 1, 256, kD});
    std::vector<float> small(256 * kD);
    mha_tensor so = describe(small.data(), MHA_DTYPE_F32, {1, 1, 256, kD});
    ASSERT_EQ(mha_attention(&sq, &sk, &sv, &so, &params), MHA_OK) << mha_last_error();
  }
  const char* backend = mha_selected_backend();
  ASSERT_NE(backend, nullptr);

  PeakMeter meter;
  meter.begin();
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, &params), MHA_OK) << mha_last_error();
  const int64_t growth = meter.growth();
  std::printf(
      "backend %s, %d threads: peak resident growth during a %lld x %lld causal call: "
      "%lld KiB (%s; inputs and output: %lld MiB; the score matrix alone would be "
      "%lld MiB)\n",
      backend, mha_get_num_threads(), static_cast<long long>(kL), static_cast<long long>(kL),
      static_cast<long long>(growth / 1024),
      meter.exact ? "VmHWM after clear_refs" : "ru_maxrss, a lower bound",
      static_cast<long long>(4 * kL * kD * 4 / kMiB), static_cast<long long>(kL * kL * 4 / kMiB));
  EXPECT_LT(growth, kBound) << "the call's memory grows with the sequence length";

  // A second call reuses what the first one allocated.
  meter.begin();
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, &params), MHA_OK) << mha_last_error();
  EXPECT_LT(meter.growth(), 4 * kMiB) << "a repeated call allocates anew";

  // Spot checks: row i of causal attention is one query over keys 0..i.
  for (const int64_t i : {int64_t{0}, int64_t{777}, int64_t{16383}, kL - 1}) {
    mha_tensor rq = describe(q.data() + i * kD, MHA_DTYPE_F32, {1, 1, 1, kD});
    mha_tensor rk = describe(k.data(), MHA_DTYPE_F32, {1, 1, i + 1, kD});
    mha_tensor rv = describe(v.data(), MHA_DTYPE_F32, {1, 1, i + 1, kD});
    mha_tensor rout = describe(out.data() + i * kD, MHA_DTYPE_F32, {1, 1, 1, kD});
    const Reference ref = reference_attention(rq, rk, rv, nullptr);
    EXPECT_LE(max_abs_error(rout, ref), tolerance(ref)) << "row " << i;
  }
}

TEST(Memory, BackwardOfA32kTokenCallDoesNotGrowWithLength) {
  // The backward pass recomputes the weights tile by tile: beyond its inputs
  // and gradients (8 x 8 MiB, touched before measuring) it keeps per-row
  // deltas and at most three extra fp32 copies of dQ (its key chunks' shares:
  // runtime/backward.cpp), all linear in L -- never the 4 GiB score matrix.
  std::vector<float> q(static_cast<size_t>(kL * kD)), k(q.size()), v(q.size()), out(q.size()),
      dout(q.size()), dq(q.size()), dk(q.size()), dv(q.size()), lse(static_cast<size_t>(kL));
  Rng rng(77);
  for (auto* buf : {&q, &k, &v, &dout})
    for (float& x : *buf) x = rng.uniform();
  for (auto* buf : {&dq, &dk, &dv}) std::fill(buf->begin(), buf->end(), -1.0f);
  const auto t4 = [](std::vector<float>& x) {
    return describe(x.data(), MHA_DTYPE_F32, {1, 1, kL, kD});
  };
  mha_tensor tq = t4(q), tk = t4(k), tv = t4(v), tout = t4(out), tdout = t4(dout), tdq = t4(dq),
             tdk = t4(dk), tdv = t4(dv);
  mha_tensor tlse = describe(lse.data(), MHA_DTYPE_F32, {1, 1, kL});
  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = MHA_CAUSAL_TOP_LEFT;
  params.lse = &tlse;
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, &params), MHA_OK) << mha_last_error();
  params.lse = nullptr;

  PeakMeter meter;
  meter.begin();
  ASSERT_EQ(mha_attention_backward(&tq, &tk, &tv, &tout, &tlse, &tdout, &tdq, &tdk, &tdv, &params,
                                   nullptr),
            MHA_OK)
      << mha_last_error();
  const int64_t growth = meter.growth();
  std::printf(
      "backend %s, %d threads: peak resident growth during the backward of a %lld x %lld "
      "causal call: %lld KiB (%s; dQ alone: %lld MiB)\n",
      mha_selected_backend(), mha_get_num_threads(), static_cast<long long>(kL),
      static_cast<long long>(kL), static_cast<long long>(growth / 1024),
      meter.exact ? "VmHWM after clear_refs" : "ru_maxrss, a lower bound",
      static_cast<long long>(kL * kD * 4 / kMiB));
  EXPECT_LT(growth, 4 * kL * kD * 4 + 16 * kMiB) << "the backward's memory grows with Lq x Lk";
  // The last key is seen by the last query alone: dV's last row is that
  // query's weight of it times its dO row.
  const double p_last =
      std::exp(static_cast<double>(std::inner_product(q.end() - kD, q.end(), k.end() - kD, 0.0f) /
                                       std::sqrt(static_cast<float>(kD)) -
                                   lse.back()));
  for (int64_t c = 0; c < kD; ++c) {
    const double want = p_last * static_cast<double>(dout[static_cast<size_t>((kL - 1) * kD + c)]);
    EXPECT_NEAR(dv[static_cast<size_t>((kL - 1) * kD + c)], want,
                1e-5 * std::max(1.0, std::fabs(want)));
  }
}

TEST(Memory, LongDecodeCallsStaySmall) {
  // One query over 32768 keys in 32 heads (split-KV partials), many times.
  const int64_t H = 32, Lk = 32768, D = 64;
  std::vector<float> q(static_cast<size_t>(H * D)), k(static_cast<size_t>(Lk * D)), v(k.size());
  std::vector<float> out(q.size());
  Rng rng(5);
  for (auto* buf : {&q, &k, &v})
    for (float& x : *buf) x = rng.uniform();
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {1, H, 1, D});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {1, 1, Lk, D});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 1, Lk, D});
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, H, 1, D});
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, nullptr), MHA_OK) << mha_last_error();
  PeakMeter meter;
  meter.begin();
  for (int n = 0; n < 20; ++n) {
    ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, nullptr), MHA_OK) << mha_last_error();
  }
  EXPECT_LT(meter.growth(), 8 * kMiB);
  const Reference ref = reference_attention(tq, tk, tv, nullptr);
  EXPECT_LE(max_abs_error(tout, ref), tolerance(ref));
}

}  // namespace
}  // namespace mha_test
