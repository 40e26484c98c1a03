// mpi_fuzzer: libFuzzer over libmha-mpi's entry points on one rank
// (MPI_COMM_SELF): mha_attention_mpi_ring and mha_attention_mpi_decode with
// any shapes, layouts, dtypes and options -- against the float64 reference of
// the whole call -- or broken (a NULL tensor, shapes that disagree, an
// explicit mask, an output over an input, a bad layout or struct size), which
// must be refused with out and the LSE untouched; and mha_mpi_shard_rows,
// whose runs must cut any sequence into every rank's share exactly once.
// The ring's communication needs several ranks: tests/mpi runs 1 to 4.
//   build/fuzz/bin/mpi_fuzzer -max_total_time=30 <scratch corpus dir>
// (ASAN_OPTIONS=detect_leaks=0: OpenMPI keeps its own memory until exit.)
#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>
#include <mha/mha_mpi.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace {

std::string g_case;

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "\n==== mpi_fuzzer finding: %s\n     case: %s\n", what.c_str(),
               g_case.c_str());
  std::abort();
}

// mha_mpi_shard_rows: every position of [0, length) in exactly one rank's
// runs, each run inside the sequence; -1 for arguments out of range.
void shard_rows_case(FuzzedDataProvider& fdp) {
  const int32_t layout = fdp.ConsumeIntegralInRange<int32_t>(-1, 2);
  const int64_t length = fdp.ConsumeIntegralInRange<int64_t>(-2, 5000);
  const int32_t ranks = fdp.ConsumeIntegralInRange<int32_t>(-1, 70);
  g_case = "shard_rows layout " + std::to_string(layout) + " length " + std::to_string(length) +
           " ranks " + std::to_string(ranks);
  const bool valid =
      (layout == MHA_MPI_CONTIGUOUS || layout == MHA_MPI_ZIGZAG) && length >= 0 && ranks >= 1;
  std::vector<int> seen(static_cast<size_t>(std::max<int64_t>(length, 0)), 0);
  for (int32_t rank = -1; rank <= std::max(ranks, 0); ++rank) {
    int64_t starts[2] = {-7, -7}, lengths[2] = {-7, -7};
    const int32_t n = mha_mpi_shard_rows(layout, length, rank, ranks, starts, lengths);
    const bool in_range = valid && rank >= 0 && rank < ranks;
    if (!in_range) {
      if (n != -1 || starts[0] != -7 || lengths[0] != -7) finding("bad arguments were accepted");
      continue;
    }
    if (n != (layout == MHA_MPI_ZIGZAG ? 2 : 1)) finding("wrong number of runs");
    for (int32_t r = 0; r < n; ++r) {
      if (starts[r] < 0 || lengths[r] < 0 || starts[r] + lengths[r] > length) {
        finding("a run outside the sequence");
      }
      for (int64_t i = starts[r]; i < starts[r] + lengths[r]; ++i) ++seen[static_cast<size_t>(i)];
    }
  }
  if (!valid) return;
  for (int count : seen) {
    if (count != 1) finding("a position held by " + std::to_string(count) + " ranks");
  }
}

// One call on one rank, valid or broken.
void attention_case(FuzzedDataProvider& fdp) {
  // The options first, from one word, so that short inputs reach them all:
  // bit 0 ring or decode, 1 dtype, 2 layout, 3 ALiBi, 4 sinks, 5 softcap,
  // 6-7 causal mode, 8-9 valid lengths, 10-13 what to break, 14-19 and
  // 20-25 the window's sides (63: none), 26-28 the backend.
  const uint32_t options = fdp.ConsumeIntegral<uint32_t>();
  const auto bits = [options](int first, int count) {
    return static_cast<int>((options >> first) & ((1u << count) - 1));
  };
  const bool ring = bits(0, 1) != 0;
  // Bits 26-28: the backend, among those this CPU can run.
  static const std::vector<std::string> backends = [] {
    std::vector<std::string> names;
    for (const auto& b : mha_test::list_backends()) {
      if (b.usable) names.push_back(b.name);
    }
    return names;
  }();
  const std::string& backend = backends[static_cast<size_t>(bits(26, 3)) % backends.size()];
  if (mha_select_backend(backend.c_str()) != MHA_OK) finding("mha_select_backend failed");
  mha_test::Rng rng(fdp.ConsumeIntegral<uint16_t>());
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t Lq =
      ring ? fdp.ConsumeIntegralInRange<int64_t>(1, 70) : fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t Lk = ring ? Lq : fdp.ConsumeIntegralInRange<int64_t>(0, 90);
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int32_t dtype = bits(1, 1) != 0 ? MHA_DTYPE_BF16 : MHA_DTYPE_F32;
  mha_mpi_params mpi;
  mha_mpi_params_init(&mpi);
  mpi.layout = bits(2, 1) != 0 ? MHA_MPI_ZIGZAG : MHA_MPI_CONTIGUOUS;
  g_case = std::string(ring ? "ring" : "decode") + " on " + backend + " B" + std::to_string(B) +
           " H" + std::to_string(H) + "/" + std::to_string(Hkv) + " Lq" + std::to_string(Lq) +
           " Lk" + std::to_string(Lk) + " D" + std::to_string(D) + "/" + std::to_string(Dv) +
           (dtype == MHA_DTYPE_BF16 ? " bf16" : "") + " layout " + std::to_string(mpi.layout);

  // Inputs (f32, rounded to bf16 where asked), outputs full of a sentinel.
  std::vector<float> qf(static_cast<size_t>(B * H * Lq * D)),
      kf(static_cast<size_t>(B * Hkv * Lk * D));
  std::vector<float> vf(static_cast<size_t>(B * Hkv * Lk * Dv));
  for (float& x : qf) x = rng.uniform(-2.0f, 2.0f);
  for (float& x : kf) x = rng.uniform(-2.0f, 2.0f);
  for (float& x : vf) x = rng.uniform();
  static float stand_in;  // an empty shard's data
  const auto tensor = [](std::vector<float>& data, std::vector<int64_t> shape) {
    return mha_test::describe(data.empty() ? &stand_in : data.data(), MHA_DTYPE_F32, shape);
  };
  const mha_tensor q32 = tensor(qf, {B, H, Lq, D}), k32 = tensor(kf, {B, Hkv, Lk, D});
  const mha_tensor v32 = tensor(vf, {B, Hkv, Lk, Dv});
  mha_test::TypedCopy q(q32, dtype), k(k32, dtype), v(v32, dtype);
  std::vector<float> out(static_cast<size_t>(B * H * Lq * Dv) + 1, -7.0f);
  std::vector<float> lse(static_cast<size_t>(B * H * Lq) + 1, -7.0f);
  mha_tensor out_t = tensor(out, {B, H, Lq, Dv}), lse_t = tensor(lse, {B, H, Lq});

  mha_attention_params p;
  mha_attention_params_init(&p);
  p.lse = &lse_t;
  p.causal = bits(6, 2) % 3;
  p.window_left = bits(14, 6) == 63 ? -1 : bits(14, 6);
  p.window_right = bits(20, 6) == 63 ? -1 : bits(20, 6);
  std::vector<int64_t> lens(static_cast<size_t>(B * Lq));
  mha_tensor lens_t{};
  switch (bits(8, 2) % 3) {
    case 1:
      for (int64_t b = 0; b < B; ++b) lens[static_cast<size_t>(b)] = rng.integer(0, Lk);
      lens_t = mha_test::describe(lens.data(), MHA_DTYPE_I64, {B});
      p.valid_lens = &lens_t;
      break;
    case 2:
      for (int64_t& n : lens) n = rng.integer(0, Lk);
      lens_t = mha_test::describe(lens.data(), MHA_DTYPE_I64, {B, Lq});
      p.valid_lens = &lens_t;
      break;
    default:
      break;
  }
  std::vector<float> slopes(static_cast<size_t>(H)), sinks(static_cast<size_t>(H));
  mha_tensor slopes_t{}, sinks_t{};
  if (bits(3, 1) != 0) {
    for (float& x : slopes) x = rng.uniform(0.0f, 1.0f);
    slopes_t = mha_test::describe(slopes.data(), MHA_DTYPE_F32, {H});
    p.alibi_slopes = &slopes_t;
  }
  if (bits(4, 1) != 0) {
    for (float& x : sinks) x = rng.uniform(-2.0f, 2.0f);
    sinks_t = mha_test::describe(sinks.data(), MHA_DTYPE_F32, {H});
    p.sinks = &sinks_t;
  }
  if (bits(5, 1) != 0) p.softcap = 5.0f;
  g_case += " causal " + std::to_string(p.causal) + " window " + std::to_string(p.window_left) +
            "," + std::to_string(p.window_right) + (p.alibi_slopes ? " alibi" : "") +
            (p.sinks ? " sinks" : "") + (p.softcap > 0 ? " softcap" : "") + " lens " +
            std::to_string(bits(8, 2) % 3);

  // Broken on purpose, or not.
  const mha_tensor* qp = &q.get();
  const mha_tensor* kp = &k.get();
  mha_tensor wrong{};
  static uint8_t keep[4] = {1, 1, 1, 1};
  mha_tensor mask_t{};
  bool broken = true;
  switch (bits(10, 4)) {
    case 1:
      qp = nullptr;
      break;
    case 2:
      wrong = k.get();
      wrong.shape[3] += 1;  // D disagrees
      kp = &wrong;
      break;
    case 3:
      mask_t = mha_test::describe(keep, MHA_DTYPE_BOOL, {2, 2});
      p.mask = &mask_t;
      break;
    case 4:
      mpi.layout = 7;
      break;
    case 5:
      mpi.struct_size = 3;
      break;
    case 6:
      p.struct_size = 5;
      break;
    case 7:
      wrong = out_t;  // the output over q's bytes
      wrong.data = q.get().data;
      wrong.dtype = q.get().dtype;
      out_t = wrong;
      break;
    case 8:
      p.has_scale = 1;
      p.scale = NAN;
      break;
    default:
      broken = false;
  }
  if (broken) g_case += " broken";
  const std::vector<float> out_before = out, lse_before = lse;
  const mha_status status =
      ring ? mha_attention_mpi_ring(MPI_COMM_SELF, qp, kp, &v.get(), &out_t, &p, &mpi)
           : mha_attention_mpi_decode(MPI_COMM_SELF, qp, kp, &v.get(), &out_t, &p, &mpi);
  if (broken) {
    if (status == MHA_OK) finding("a broken call was accepted");
    if (std::string(mha_mpi_last_error()).empty()) finding("a refused call left no message");
    if (std::memcmp(out.data(), out_before.data(), out.size() * sizeof(float)) != 0 ||
        std::memcmp(lse.data(), lse_before.data(), lse.size() * sizeof(float)) != 0) {
      finding("a refused call wrote its outputs");
    }
    return;
  }
  if (status != MHA_OK) finding(std::string("a valid call failed: ") + mha_mpi_last_error());
  if (out.back() != -7.0f || lse.back() != -7.0f) finding("written past out or lse");
  if (Lk == 0) return;  // (the reference takes no empty K)
  const mha_test::Reference ref = mha_test::reference_attention(q.get(), k.get(), v.get(), &p);
  const double tol = mha_test::tolerance_for(backend, dtype, dtype, ref, MHA_DTYPE_F32);
  const double err = mha_test::max_abs_error(out_t, ref);
  if (!(err <= tol)) {
    finding("out is " + std::to_string(err) + " from the reference (tolerance " +
            std::to_string(tol) + ")");
  }
  for (size_t r = 0; r < ref.lse.size(); ++r) {
    const double want = ref.lse[r], got = static_cast<double>(lse[r]);
    const bool same = std::isinf(want)
                          ? got == want
                          : std::fabs(got - want) <= mha_test::lse_tolerance(ref, want);
    if (!same)
      finding("lse[" + std::to_string(r) + "] = " + std::to_string(got) + ", reference " +
              std::to_string(want));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  MPI_Init(argc, argv);
  mha_set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  if (fdp.ConsumeBool()) {
    shard_rows_case(fdp);
  } else {
    attention_case(fdp);
  }
  return 0;
}
