// The sliding window (mha_attention_params.window_left / window_right,
// FlashAttention-2's semantics aligned to the bottom-right corner) on every
// backend: alone and with the causal rule, valid lengths, masks, GQA, half
// precision, dropout, the decode layout and split-KV, against the float64
// reference; keys before the window are never read (their pages are
// unmapped); bad windows are refused by name.
#include <gtest/gtest.h>
#include <mha/mha.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend_param.h"
#include "checked_call.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

struct WindowCase {
  const char* what = "";
  int64_t B = 1, H = 4, Hkv = 2, Lq = 70, Lk = 300, D = 32, Dv = 24;
  int64_t left = -1, right = -1;
  Layout layout = Layout::BHLD;
  int32_t dtype = MHA_DTYPE_F32;  // of Q, K and V
  CallOptions options;
  uint64_t seed = 1;
};

std::string describe_case(const WindowCase& c) {
  return std::string(c.what) + ": B" + std::to_string(c.B) + " H" + std::to_string(c.H) + "/" +
         std::to_string(c.Hkv) + " Lq" + std::to_string(c.Lq) + " Lk" + std::to_string(c.Lk) +
         " D" + std::to_string(c.D) + "/" + std::to_string(c.Dv) + " window " +
         std::to_string(c.left) + "," + std::to_string(c.right) + " causal " +
         std::to_string(c.options.causal) + " mask " + std::to_string(c.options.mask) + " lens " +
         std::to_string(c.options.lens);
}

// Runs the case on the selected backend and checks it against the reference.
void run_window_case(const WindowCase& c) {
  SCOPED_TRACE(describe_case(c));
  Rng rng(c.seed);
  RandomInputs in(rng, c.layout, c.B, c.H, c.Hkv, c.Lq, c.Lk, c.D, c.Dv);
  TypedCopy q_typed(in.tq, c.dtype), k_typed(in.tk, c.dtype), v_typed(in.tv, c.dtype);

  CheckedCall call(rng, c.B, c.H, c.Lq, c.Lk, c.Dv, c.options);
  call.params.window_left = c.left;
  call.params.window_right = c.right;
  ASSERT_EQ(mha_attention(&q_typed.get(), &k_typed.get(), &v_typed.get(), &call.out, &call.params),
            MHA_OK)
      << mha_last_error();
  const Reference ref =
      reference_attention(q_typed.get(), k_typed.get(), v_typed.get(), &call.params);
  const char* backend = mha_selected_backend();
  ASSERT_NE(backend, nullptr) << mha_last_error();
  EXPECT_LE(max_abs_error(call.out, ref),
            tolerance_for(backend, c.dtype, c.dtype, ref, c.options.out_dtype));
  call.expect_lse_matches(ref);
}

class Window : public BackendTest {};

TEST_P(Window, AloneAndWithEveryOtherOption) {
  std::vector<WindowCase> cases(14);
  cases[0].what = "window 0: only the diagonal", cases[0].Lq = cases[0].Lk = 100;
  cases[0].left = cases[0].right = 0;
  cases[1].what = "left edge and causal (Mistral)", cases[1].Lq = cases[1].Lk = 300;
  cases[1].left = 17, cases[1].options.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  cases[2].what = "both edges, no causal rule", cases[2].left = 40, cases[2].right = 25;
  cases[3].what = "right edge only", cases[3].right = 5;
  cases[4].what = "wider than Lk", cases[4].left = cases[4].right = 1000;
  cases[4].options.causal = MHA_CAUSAL_TOP_LEFT;
  cases[5].what = "Lq > Lk: early rows see nothing", cases[5].Lq = 300, cases[5].Lk = 100;
  cases[5].left = 30, cases[5].right = 0;
  cases[6].what = "valid lengths and a bool mask", cases[6].left = 50;
  cases[6].options.lens = true, cases[6].options.mask = 1;
  cases[7].what = "additive mask with -inf, bf16, GQA", cases[7].H = 6, cases[7].Hkv = 2;
  cases[7].left = 64, cases[7].right = 2, cases[7].dtype = MHA_DTYPE_BF16;
  cases[7].options.mask = 2, cases[7].options.mask_dtype = MHA_DTYPE_BF16;
  cases[8].what = "several key and query tiles, causal top-left", cases[8].H = 2;
  cases[8].Hkv = 1, cases[8].Lq = cases[8].Lk = 1000, cases[8].D = cases[8].Dv = 64;
  cases[8].left = 300, cases[8].options.causal = MHA_CAUSAL_TOP_LEFT;
  cases[9].what = "decode over a long cache (split-KV over the window)", cases[9].H = 8;
  cases[9].Lq = 1, cases[9].Lk = 6000, cases[9].D = cases[9].Dv = 64, cases[9].left = 2000;
  cases[9].options.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  cases[10].what = "decode, three queries, f16 with an f16 output", cases[10].Lq = 3;
  cases[10].Lk = 3000, cases[10].left = 1000, cases[10].right = 0;
  cases[10].dtype = MHA_DTYPE_F16, cases[10].options.out_dtype = MHA_DTYPE_F16;
  cases[11].what = "[B, L, H, D] rows, two batches, valid lengths", cases[11].B = 2;
  cases[11].layout = Layout::BLHD, cases[11].left = 33, cases[11].right = 7;
  cases[11].options.lens = true;
  cases[12].what = "bf16 prefill over several tiles (the bf16 path where there is one)";
  cases[12].Lq = 200, cases[12].Lk = 900, cases[12].D = cases[12].Dv = 64;
  cases[12].left = 250, cases[12].dtype = MHA_DTYPE_BF16;
  cases[12].options.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  cases[13].what = "odd window start on the bf16 path", cases[13].Lq = 129, cases[13].Lk = 700;
  cases[13].left = 101, cases[13].right = 3, cases[13].dtype = MHA_DTYPE_BF16;
  for (WindowCase& c : cases) {
    c.seed = static_cast<uint64_t>(&c - cases.data()) + 11;
    run_window_case(c);
  }
}

// Dropout keeps or drops a key by its absolute index, so a window and the
// same keys given as a bool mask drop the same weights.
TEST_P(Window, DropoutDropsTheSameKeysAsTheEquivalentMask) {
  const int64_t B = 1, H = 2, Lq = 90, Lk = 400, D = 32, left = 60, right = 4;
  Rng rng(5);
  Arena q(B * H * Lq * D), k(B * H * Lk * D), v(B * H * Lk * D);
  mha_tensor tq = describe(q.base(), MHA_DTYPE_F32, {B, H, Lq, D});
  mha_tensor tk = describe(k.base(), MHA_DTYPE_F32, {B, H, Lk, D});
  mha_tensor tv = describe(v.base(), MHA_DTYPE_F32, {B, H, Lk, D});
  fill_uniform(tq, rng);
  fill_uniform(tk, rng);
  fill_uniform(tv, rng);
  std::vector<uint8_t> keep(static_cast<size_t>(Lq * Lk));
  for (int64_t i = 0; i < Lq; ++i) {
    for (int64_t j = 0; j < Lk; ++j) {
      const int64_t shift = i + Lk - Lq;
      keep[static_cast<size_t>(i * Lk + j)] = j >= shift - left && j <= shift + right;
    }
  }
  const mha_tensor tkeep = describe(keep.data(), MHA_DTYPE_BOOL, {Lq, Lk});
  std::vector<float> windowed(static_cast<size_t>(B * H * Lq * D)), masked(windowed.size());
  mha_tensor tw = describe(windowed.data(), MHA_DTYPE_F32, {B, H, Lq, D});
  mha_tensor tm = describe(masked.data(), MHA_DTYPE_F32, {B, H, Lq, D});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.dropout_p = 0.3f;
  p.dropout_seed = 77;
  mha_attention_params by_mask = p;
  p.window_left = left;
  p.window_right = right;
  by_mask.mask = &tkeep;
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tw, &p), MHA_OK) << mha_last_error();
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tm, &by_mask), MHA_OK) << mha_last_error();
  // Both sum the same products, from different first keys: fp32 rounding.
  for (size_t x = 0; x < windowed.size(); ++x) {
    ASSERT_NEAR(static_cast<double>(windowed[x]), static_cast<double>(masked[x]),
                2e-5 * std::max(1.0, std::fabs(static_cast<double>(masked[x]))))
        << x;
  }
}

// K and V whose rows before a key sit on pages that cannot be read: the
// kernels (and the reference) must never touch them.
class GuardedRows {
 public:
  GuardedRows(int64_t rows, int64_t row_bytes, int64_t first_readable_row) {
    page_ = sysconf(_SC_PAGESIZE);
    bytes_ = (rows * row_bytes + page_ - 1) / page_ * page_;
    base_ = mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) base_ = nullptr;
    protected_ = first_readable_row * row_bytes / page_ * page_;
  }
  ~GuardedRows() {
    if (base_ != nullptr) munmap(base_, static_cast<size_t>(bytes_));
  }
  GuardedRows(const GuardedRows&) = delete;
  GuardedRows& operator=(const GuardedRows&) = delete;
  void* data() const { return base_; }
  int64_t protected_bytes() const { return protected_; }
  // After the data is written: the pages wholly before the first readable
  // row become unreadable.
  bool protect() const { return mprotect(base_, static_cast<size_t>(protected_), PROT_NONE) == 0; }

 private:
  int64_t page_ = 4096, bytes_ = 0, protected_ = 0;
  void* base_ = nullptr;
};

TEST_P(Window, KeysBeforeTheWindowAreNeverRead) {
  const int64_t H = 2, Hkv = 1, Lk = 8192, D = 64, left = 512;
  for (const int32_t dtype : {MHA_DTYPE_F32, MHA_DTYPE_BF16}) {
    for (const int64_t Lq : {int64_t{256}, int64_t{1}}) {
      SCOPED_TRACE(std::string(dtype == MHA_DTYPE_F32 ? "f32" : "bf16") + " Lq " +
                   std::to_string(Lq));
      // Query 0's window starts at Lk - 256 - left (or later, for Lq = 1).
      const int64_t first_key = Lk - 256 - left;
      const int64_t row_bytes = D * (dtype == MHA_DTYPE_F32 ? 4 : 2);
      GuardedRows k_rows(Lk, row_bytes, first_key), v_rows(Lk, row_bytes, first_key);
      ASSERT_NE(k_rows.data(), nullptr);
      ASSERT_NE(v_rows.data(), nullptr);
      ASSERT_GT(k_rows.protected_bytes(), 0);
      Rng rng(9);
      std::vector<float> kf(static_cast<size_t>(Lk * D)), vf(kf.size());
      for (float& x : kf) x = rng.uniform(-1.0f, 1.0f);
      for (float& x : vf) x = rng.uniform(-1.0f, 1.0f);
      const mha_tensor kf_t = describe(kf.data(), MHA_DTYPE_F32, {1, Hkv, Lk, D});
      const mha_tensor vf_t = describe(vf.data(), MHA_DTYPE_F32, {1, Hkv, Lk, D});
      TypedCopy k_typed(kf_t, dtype), v_typed(vf_t, dtype);
      std::memcpy(k_rows.data(), k_typed.get().data, static_cast<size_t>(Lk * row_bytes));
      std::memcpy(v_rows.data(), v_typed.get().data, static_cast<size_t>(Lk * row_bytes));
      ASSERT_TRUE(k_rows.protect() && v_rows.protect());
      mha_tensor tk = k_typed.get(), tv = v_typed.get();
      tk.data = k_rows.data();
      tv.data = v_rows.data();

      std::vector<float> qf(static_cast<size_t>(H * Lq * D));
      for (float& x : qf) x = rng.uniform(-1.0f, 1.0f);
      TypedCopy q_typed(describe(qf.data(), MHA_DTYPE_F32, {1, H, Lq, D}), dtype);
      std::vector<float> out(static_cast<size_t>(H * Lq * D));
      mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, H, Lq, D});
      mha_attention_params p;
      mha_attention_params_init(&p);
      p.causal = MHA_CAUSAL_BOTTOM_RIGHT;
      p.window_left = left;
      ASSERT_EQ(mha_attention(&q_typed.get(), &tk, &tv, &tout, &p), MHA_OK) << mha_last_error();
      const Reference ref = reference_attention(q_typed.get(), tk, tv, &p);
      EXPECT_LE(max_abs_error(tout, ref),
                tolerance_for(mha_selected_backend(), dtype, dtype, ref, MHA_DTYPE_F32));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Window, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

TEST(WindowBadInput, NegativeEdgesOtherThanMinusOneAreRefusedByName) {
  std::vector<float> q(4 * 8, 0.5f), k(4 * 8, 0.5f), v(4 * 8, 0.5f), out(4 * 8, -3.0f);
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {1, 1, 4, 8});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {1, 1, 4, 8});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 1, 4, 8});
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, 1, 4, 8});
  for (const bool left : {true, false}) {
    for (const int64_t value : {int64_t{-2}, int64_t{-1000}, INT64_MIN}) {
      mha_attention_params p;
      mha_attention_params_init(&p);
      (left ? p.window_left : p.window_right) = value;
      EXPECT_EQ(mha_attention(&tq, &tk, &tv, &tout, &p), MHA_ERR_INVALID_VALUE);
      EXPECT_NE(std::string(mha_last_error()).find(left ? "window_left" : "window_right"),
                std::string::npos)
          << mha_last_error();
      for (float x : out) ASSERT_EQ(x, -3.0f) << "a refused call wrote its output";
    }
  }
}

// A caller built against 0.2 passes a shorter struct: no window, whatever
// lies past its end.
TEST(WindowBadInput, OlderParamsSizeMeansNoWindow) {
  expect_older_size_ignores_newer_fields(72, [](mha_attention_params& p) {  // mha 0.2's size
    p.window_left = 0;
    p.window_right = 0;
  });
}

}  // namespace
}  // namespace mha_test
