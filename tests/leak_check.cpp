// A leak check, run under valgrind by scripts/test.sh (stage leaks):
//   valgrind --leak-check=full --error-exitcode=1 build/native/bin/leak_check
// 1000 calls of mixed shapes through every public entry point -- prefill and
// decode, GQA, masks, valid lengths, LSE, split-KV, failing calls,
// mha_merge_partials, backend and thread-count changes, and calls from
// short-lived threads (whose per-thread scratch must be freed when they end).
// Valgrind hides AVX-512, so this exercises the avx2 plugin (and scalar).
// A plain program: it exits non-zero if a result is wrong.
#include <mha/mha.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace {

using namespace mha_test;

int g_failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok && g_failures++ < 10) std::fprintf(stderr, "leak_check: FAILED: %s\n", what.c_str());
}

// One call of a shape drawn from rng; compares with the reference when `verify`.
void one_call(Rng& rng, bool verify) {
  const int64_t Hkv = rng.integer(1, 2), H = Hkv * rng.integer(1, 4), B = rng.integer(1, 2);
  const bool decode = rng.chance(0.4);
  const int64_t Lq = decode ? rng.integer(1, 2) : rng.integer(1, 40);
  const int64_t Lk = decode && rng.chance(0.3) ? rng.integer(1024, 1500) : rng.integer(1, 70);
  const int64_t D = rng.integer(1, 64), Dv = rng.integer(1, 64);
  const Layout layout = rng.chance(0.5) ? Layout::BHLD : Layout::BLHD;
  const Shape4 sq = make_shape(layout, B, H, Lq, D), sk = make_shape(layout, B, Hkv, Lk, D);
  const Shape4 sv = make_shape(layout, B, Hkv, Lk, Dv), so = make_shape(layout, B, H, Lq, Dv);
  Arena q(sq.extent), k(sk.extent), v(sv.extent), out(so.extent);
  mha_tensor tq = q.view(sq), tk = k.view(sk), tv = v.view(sv), tout = out.view(so);
  fill_uniform(tq, rng);
  fill_uniform(tk, rng);
  fill_uniform(tv, rng);
  std::vector<float> lse_data(static_cast<size_t>(B * H * Lq));
  mha_tensor tlse = describe(lse_data.data(), MHA_DTYPE_F32, {B, H, Lq});
  std::vector<uint8_t> mask(static_cast<size_t>(B * Lq * Lk));
  for (auto& m : mask) m = rng.chance(0.8) ? 1 : 0;
  mha_tensor tmask = describe(mask.data(), MHA_DTYPE_BOOL, {B, 1, Lq, Lk});
  std::vector<int64_t> lens(static_cast<size_t>(B));
  for (auto& l : lens) l = rng.integer(0, Lk);
  mha_tensor tlens = describe(lens.data(), MHA_DTYPE_I64, {B});

  mha_attention_params p;
  mha_attention_params_init(&p);
  p.causal = static_cast<int32_t>(rng.integer(0, 2));
  if (rng.chance(0.3)) p.mask = &tmask;
  if (rng.chance(0.3)) p.valid_lens = &tlens;
  if (rng.chance(0.5)) p.lse = &tlse;
  const mha_status status = mha_attention(&tq, &tk, &tv, &tout, &p);
  check(status == MHA_OK, std::string("a valid call failed: ") + mha_last_error());
  if (verify && status == MHA_OK) {
    const Reference ref = reference_attention(tq, tk, tv, &p);
    check(max_abs_error(tout, ref) <= tolerance(ref), "a result differs from the reference");
  }
  if (rng.chance(0.1)) {  // and a refused call on the same tensors
    tout.strides[3] = 0;
    check(mha_attention(&tq, &tk, &tv, &tout, &p) == MHA_ERR_OVERLAP, "overlap not refused");
  }
}

void merge_call(Rng& rng) {
  const int64_t B = 1, H = rng.integer(1, 3), Lq = rng.integer(1, 4), Dv = rng.integer(1, 20);
  const int32_t n = static_cast<int32_t>(rng.integer(1, 4));
  std::vector<std::vector<float>> parts(static_cast<size_t>(n)), lses(static_cast<size_t>(n));
  std::vector<mha_tensor> touts, tlses;
  for (int32_t c = 0; c < n; ++c) {
    parts[static_cast<size_t>(c)].resize(static_cast<size_t>(B * H * Lq * Dv));
    lses[static_cast<size_t>(c)].resize(static_cast<size_t>(B * H * Lq));
    for (float& x : parts[static_cast<size_t>(c)]) x = rng.uniform();
    for (float& x : lses[static_cast<size_t>(c)]) x = rng.uniform(-3.0f, 3.0f);
    touts.push_back(describe(parts[static_cast<size_t>(c)].data(), MHA_DTYPE_F32, {B, H, Lq, Dv}));
    tlses.push_back(describe(lses[static_cast<size_t>(c)].data(), MHA_DTYPE_F32, {B, H, Lq}));
  }
  std::vector<float> out(static_cast<size_t>(B * H * Lq * Dv)),
      lse(static_cast<size_t>(B * H * Lq));
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {B, H, Lq, Dv});
  mha_tensor tlse = describe(lse.data(), MHA_DTYPE_F32, {B, H, Lq});
  check(mha_merge_partials(n, touts.data(), tlses.data(), &tout, &tlse) == MHA_OK,
        std::string("merge failed: ") + mha_last_error());
  check(mha_merge_partials(0, touts.data(), tlses.data(), &tout, &tlse) == MHA_ERR_INVALID_SIZE,
        "merge of 0 parts not refused");
}

}  // namespace

int main() {
  std::vector<std::string> usable;
  for (const auto& b : list_backends()) {
    if (b.usable) usable.push_back(b.name);
  }
  std::printf("leak_check: selected %s; usable:", mha_selected_backend());
  for (const auto& name : usable) std::printf(" %s", name.c_str());
  std::printf("\n");

  Rng rng(2024);
  int calls = 0;
  for (int round = 0; round < 20; ++round) {
    // Switch the backend and the thread count now and then.
    const std::string backend = usable[static_cast<size_t>(round) % usable.size()];
    check(mha_select_backend(backend.c_str()) == MHA_OK, "select " + backend);
    check(mha_select_backend("no-such-backend") == MHA_ERR_BACKEND_UNAVAILABLE, "bad name");
    check(mha_set_num_threads(static_cast<int32_t>(round % 3)) == MHA_OK, "threads");
    for (int n = 0; n < 35; ++n, ++calls) one_call(rng, n % 7 == 0);
    for (int n = 0; n < 5; ++n, ++calls) merge_call(rng);
    // Calls from a thread that ends: its scratch must be released.
    std::thread worker([seed = rng.integer(0, 1 << 30), &calls] {
      Rng local(static_cast<uint64_t>(seed));
      for (int n = 0; n < 10; ++n, ++calls) one_call(local, n == 0);
    });
    worker.join();
  }
  check(mha_select_backend("auto") == MHA_OK, "auto");
  mha_backend_info info{};
  check(mha_backend_get_info(-1, &info) == MHA_ERR_INVALID_VALUE, "bad index");
  std::printf("leak_check: %d calls, %d failures\n", calls, g_failures);
  return g_failures == 0 ? 0 : 1;
}
