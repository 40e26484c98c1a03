// libmha-mpi's tests, run as `mpirun -np N test_mpi` for N = 1..4 (a ctest
// entry each).  Every rank builds the same full problem from one seed, takes
// its shard, and checks its part of the distributed result against the
// single-process call (mha_attention on the full problem) and the float64
// reference; the distributed call must also repeat itself byte for byte.
#include <gtest/gtest.h>
#include <mha/mha.h>
#include <mha/mha_mpi.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace {

using mha_test::Reference;
using mha_test::Rng;

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// True on every rank iff `ok` on every rank.
bool all_ranks(bool ok) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// ------------------------------------------------------------ shards

struct Range {
  int64_t begin, length;
};

// The global rows each rank holds (the layouts' rules, written here from
// the header's definitions, independently of mpi/layout.cpp).
std::vector<Range> rows_of_rank(int32_t layout, bool uneven, int64_t total, int rank, int ranks) {
  if (layout == MHA_MPI_ZIGZAG) {
    const int64_t chunks = 2 * ranks;
    auto begin = [&](int64_t c) { return c * total / chunks; };
    return {{begin(rank), begin(rank + 1) - begin(rank)},
            {begin(chunks - 1 - rank), begin(chunks - rank) - begin(chunks - 1 - rank)}};
  }
  // Contiguous: even slices, or uneven ones (weights r + 1, rank 1 empty).
  std::vector<int64_t> weight(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    weight[static_cast<size_t>(r)] = uneven ? (r == 1 ? 0 : r + 1) : 1;
  int64_t sum = 0, before = 0;
  for (int r = 0; r < ranks; ++r) sum += weight[static_cast<size_t>(r)];
  for (int r = 0; r < rank; ++r) before += weight[static_cast<size_t>(r)];
  const int64_t b = total * before / sum;
  const int64_t e = total * (before + weight[static_cast<size_t>(rank)]) / sum;
  return {{b, e - b}};
}

int64_t rows_in(const std::vector<Range>& ranges) {
  int64_t n = 0;
  for (const Range& r : ranges) n += r.length;
  return n;
}

// Rows `ranges` (dimension 2) of a C-order [A, B, L, C] tensor of `bytes`
// per element, stacked into a new C-order buffer.
std::vector<unsigned char> take_rows(const mha_tensor& t, const std::vector<Range>& ranges) {
  const int64_t bytes = mha_test::element_bytes(t.dtype);
  const int64_t rows = rows_in(ranges), width = t.shape[3] * bytes;
  std::vector<unsigned char> out(static_cast<size_t>(t.shape[0] * t.shape[1] * rows * width) + 1);
  unsigned char* at = out.data();
  for (int64_t a = 0; a < t.shape[0]; ++a) {
    for (int64_t h = 0; h < t.shape[1]; ++h) {
      for (const Range& r : ranges) {
        for (int64_t i = r.begin; i < r.begin + r.length; ++i) {
          const unsigned char* row =
              static_cast<const unsigned char*>(t.data) +
              (a * t.strides[0] + h * t.strides[1] + i * t.strides[2]) * bytes;
          std::memcpy(at, row, static_cast<size_t>(width));
          at += width;
        }
      }
    }
  }
  return out;
}

mha_tensor describe4(void* data, int32_t dtype, int64_t a, int64_t b, int64_t c, int64_t d) {
  return mha_test::describe(data, static_cast<mha_dtype>(dtype), {a, b, c, d});
}

// ------------------------------------------------------------ cases

struct Case {
  std::string name;
  int64_t batch = 2, heads = 4, kv_heads = 2, lq = 150, lk = 150, d = 32, dv = 24;
  int32_t causal = MHA_CAUSAL_NONE;
  int32_t layout = MHA_MPI_CONTIGUOUS;
  bool uneven = false;  // contiguous shards of unequal sizes, rank 1 empty
  int32_t dtype = MHA_DTYPE_F32;
  float dropout = 0.0f;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  int valid_lens = 0;  // 0: none, 1: [B], 2: [B, Lq]
};

std::vector<Case> ring_cases() {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, auto edit) {
    Case c;
    c.name = name;
    edit(c);
    cases.push_back(c);
  };
  add("plain", [](Case&) {});
  add("causal", [](Case& c) { c.causal = MHA_CAUSAL_TOP_LEFT; });
  add("causal_zigzag", [](Case& c) {
    c.causal = MHA_CAUSAL_TOP_LEFT;
    c.layout = MHA_MPI_ZIGZAG;
  });
  add("bottom_right_cross", [](Case& c) {  // Lq != Lk, zigzag on both
    c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    c.lq = 97;
    c.lk = 203;
    c.layout = MHA_MPI_ZIGZAG;
  });
  add("top_left_cross_uneven", [](Case& c) {
    c.causal = MHA_CAUSAL_TOP_LEFT;
    c.lq = 131;
    c.lk = 77;
    c.uneven = true;
  });
  add("uneven_shards", [](Case& c) {
    c.uneven = true;
    c.lq = 101;
    c.lk = 157;
  });
  add("mqa_one_kv_head", [](Case& c) {
    c.kv_heads = 1;
    c.causal = MHA_CAUSAL_TOP_LEFT;
  });
  add("dropout", [](Case& c) {
    c.dropout = 0.2f;
    c.causal = MHA_CAUSAL_TOP_LEFT;
    c.layout = MHA_MPI_ZIGZAG;
  });
  add("valid_lens_per_batch", [](Case& c) { c.valid_lens = 1; });
  add("valid_lens_per_query_causal", [](Case& c) {
    c.valid_lens = 2;
    c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    c.uneven = true;
  });
  add("window", [](Case& c) {
    c.causal = MHA_CAUSAL_TOP_LEFT;
    c.window_left = 40;
    c.layout = MHA_MPI_ZIGZAG;
  });
  add("softcap_alibi_sinks", [](Case& c) {
    c.softcap = 8.0f;
    c.alibi = true;
    c.sinks = true;
    c.causal = MHA_CAUSAL_TOP_LEFT;
  });
  add("bf16", [](Case& c) {
    c.dtype = MHA_DTYPE_BF16;
    c.causal = MHA_CAUSAL_TOP_LEFT;
    c.layout = MHA_MPI_ZIGZAG;
  });
  add("f16_bf16_out_long", [](Case& c) {
    c.dtype = MHA_DTYPE_F16;
    c.lq = c.lk = 700;  // several chunks per block
    c.heads = c.kv_heads = 2;
    c.causal = MHA_CAUSAL_TOP_LEFT;
  });
  return cases;
}

// The full problem every rank builds from the same seed.
struct FullProblem {
  std::vector<float> q, k, v, sinks, slopes;
  std::vector<int64_t> valid;
  mha_tensor qt{}, kt{}, vt{}, sinks_t{}, slopes_t{}, valid_t{};
  std::unique_ptr<mha_test::TypedCopy> q_typed, k_typed, v_typed;

  explicit FullProblem(const Case& c) {
    Rng rng(20261125);
    q.resize(static_cast<size_t>(c.batch * c.heads * c.lq * c.d));
    k.resize(static_cast<size_t>(c.batch * c.kv_heads * c.lk * c.d));
    v.resize(static_cast<size_t>(c.batch * c.kv_heads * c.lk * c.dv));
    for (float& x : q) x = rng.uniform(-2.0f, 2.0f);
    for (float& x : k) x = rng.uniform(-2.0f, 2.0f);
    for (float& x : v) x = rng.uniform();
    mha_tensor qf = describe4(q.data(), MHA_DTYPE_F32, c.batch, c.heads, c.lq, c.d);
    mha_tensor kf = describe4(k.data(), MHA_DTYPE_F32, c.batch, c.kv_heads, c.lk, c.d);
    mha_tensor vf = describe4(v.data(), MHA_DTYPE_F32, c.batch, c.kv_heads, c.lk, c.dv);
    q_typed = std::make_unique<mha_test::TypedCopy>(qf, c.dtype);
    k_typed = std::make_unique<mha_test::TypedCopy>(kf, c.dtype);
    v_typed = std::make_unique<mha_test::TypedCopy>(vf, c.dtype);
    qt = q_typed->get();
    kt = k_typed->get();
    vt = v_typed->get();
    for (int64_t h = 0; h < c.heads; ++h) {
      sinks.push_back(rng.uniform(-1.0f, 3.0f));
      slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(c.heads)));
    }
    sinks_t = mha_test::describe(sinks.data(), MHA_DTYPE_F32, {c.heads});
    slopes_t = mha_test::describe(slopes.data(), MHA_DTYPE_F32, {c.heads});
    if (c.valid_lens == 1) {
      for (int64_t b = 0; b < c.batch; ++b) valid.push_back(rng.integer(0, c.lk));
      valid[0] = c.lk / 3;  // keys cut inside some rank's shard
      valid_t = mha_test::describe(valid.data(), MHA_DTYPE_I64, {c.batch});
    } else if (c.valid_lens == 2) {
      for (int64_t i = 0; i < c.batch * c.lq; ++i) valid.push_back(rng.integer(0, c.lk));
      valid_t = mha_test::describe(valid.data(), MHA_DTYPE_I64, {c.batch, c.lq});
    }
  }

  mha_attention_params params(const Case& c) const {
    mha_attention_params p;
    mha_attention_params_init(&p);
    p.causal = c.causal;
    p.dropout_p = c.dropout;
    p.dropout_seed = 77;
    p.window_left = c.window_left;
    p.window_right = c.window_right;
    p.softcap = c.softcap;
    if (c.alibi) p.alibi_slopes = &slopes_t;
    if (c.sinks) p.sinks = &sinks_t;
    if (c.valid_lens != 0) p.valid_lens = &valid_t;
    return p;
  }
};

// Largest |a - b| over this rank's rows: `mine` [B, H, rows, W] (F32) holds
// rows `ranges` of `full` [B, H, L, W] (F32, C order).
double max_row_difference(const std::vector<float>& mine, const std::vector<double>& full,
                          int64_t batch, int64_t heads, int64_t length, int64_t width,
                          const std::vector<Range>& ranges) {
  double worst = 0.0;
  const int64_t rows = rows_in(ranges);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      int64_t local = 0;
      for (const Range& r : ranges) {
        for (int64_t i = r.begin; i < r.begin + r.length; ++i, ++local) {
          for (int64_t c = 0; c < width; ++c) {
            const double got = static_cast<double>(
                mine[static_cast<size_t>(((b * heads + h) * rows + local) * width + c)]);
            const double want =
                full[static_cast<size_t>(((b * heads + h) * length + i) * width + c)];
            const double diff = std::isinf(want) && got == want ? 0.0 : std::fabs(got - want);
            worst =
                std::max(worst, std::isnan(diff) ? std::numeric_limits<double>::infinity() : diff);
          }
        }
      }
    }
  }
  return worst;
}

std::vector<double> to_double(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

void run_ring_case(const Case& c, const std::string& backend) {
  const int rank = world_rank(), ranks = world_size();
  SCOPED_TRACE(c.name + " on " + backend + ", rank " + std::to_string(rank) + " of " +
               std::to_string(ranks));
  FullProblem full(c);
  const mha_attention_params params = full.params(c);

  // The single-process call and the float64 reference.
  std::vector<float> whole(static_cast<size_t>(c.batch * c.heads * c.lq * c.dv));
  std::vector<float> whole_lse(static_cast<size_t>(c.batch * c.heads * c.lq));
  mha_tensor whole_t = describe4(whole.data(), MHA_DTYPE_F32, c.batch, c.heads, c.lq, c.dv);
  mha_tensor whole_lse_t =
      mha_test::describe(whole_lse.data(), MHA_DTYPE_F32, {c.batch, c.heads, c.lq});
  mha_attention_params whole_params = params;
  whole_params.lse = &whole_lse_t;
  ASSERT_EQ(mha_attention(&full.qt, &full.kt, &full.vt, &whole_t, &whole_params), MHA_OK)
      << mha_last_error();
  mha_attention_params ref_params = params;
  ref_params.dropout_p = 0.0f;  // the reference does not model dropout
  const Reference ref = mha_test::reference_attention(full.qt, full.kt, full.vt, &ref_params);
  const double tol = mha_test::tolerance_for(backend, c.dtype, c.dtype, ref, MHA_DTYPE_F32) /
                     (1.0 - static_cast<double>(c.dropout));

  // This rank's shard.
  const std::vector<Range> q_rows = rows_of_rank(c.layout, c.uneven, c.lq, rank, ranks);
  const std::vector<Range> k_rows = rows_of_rank(c.layout, c.uneven, c.lk, rank, ranks);
  const int64_t lq_r = rows_in(q_rows), lk_r = rows_in(k_rows);
  std::vector<unsigned char> q_local = take_rows(full.qt, q_rows);
  std::vector<unsigned char> k_local = take_rows(full.kt, k_rows);
  std::vector<unsigned char> v_local = take_rows(full.vt, k_rows);
  mha_tensor qt = describe4(q_local.data(), c.dtype, c.batch, c.heads, lq_r, c.d);
  mha_tensor kt = describe4(k_local.data(), c.dtype, c.batch, c.kv_heads, lk_r, c.d);
  mha_tensor vt = describe4(v_local.data(), c.dtype, c.batch, c.kv_heads, lk_r, c.dv);
  std::vector<int64_t> valid_local;
  mha_tensor valid_local_t{};
  mha_attention_params p = params;
  if (c.valid_lens == 2) {  // this rank's rows of [B, Lq]
    for (int64_t b = 0; b < c.batch; ++b) {
      for (const Range& r : q_rows) {
        for (int64_t i = r.begin; i < r.begin + r.length; ++i) {
          valid_local.push_back(full.valid[static_cast<size_t>(b * c.lq + i)]);
        }
      }
    }
    valid_local_t = mha_test::describe(valid_local.data(), MHA_DTYPE_I64, {c.batch, lq_r});
    p.valid_lens = &valid_local_t;
  }
  std::vector<float> out(static_cast<size_t>(c.batch * c.heads * lq_r * c.dv) + 1, NAN);
  std::vector<float> lse(static_cast<size_t>(c.batch * c.heads * lq_r) + 1, NAN);
  mha_tensor out_t = describe4(out.data(), MHA_DTYPE_F32, c.batch, c.heads, lq_r, c.dv);
  mha_tensor lse_t = mha_test::describe(lse.data(), MHA_DTYPE_F32, {c.batch, c.heads, lq_r});
  p.lse = &lse_t;
  mha_mpi_params mpi;
  mha_mpi_params_init(&mpi);
  mpi.layout = c.layout;
  const mha_status status = mha_attention_mpi_ring(MPI_COMM_WORLD, &qt, &kt, &vt, &out_t, &p, &mpi);
  ASSERT_TRUE(all_ranks(status == MHA_OK)) << mha_mpi_last_error();

  const double vs_whole =
      max_row_difference(out, to_double(whole), c.batch, c.heads, c.lq, c.dv, q_rows);
  EXPECT_LE(vs_whole, tol) << "against the single-process call";
  if (c.dropout == 0.0f) {
    const double vs_ref = max_row_difference(out, ref.out, c.batch, c.heads, c.lq, c.dv, q_rows);
    EXPECT_LE(vs_ref, tol) << "against the float64 reference";
  }
  const double lse_diff =
      max_row_difference(lse, to_double(whole_lse), c.batch, c.heads, c.lq, 1, q_rows);
  EXPECT_LE(lse_diff, 4.0 * mha_test::lse_tolerance(ref, 30.0)) << "LSE";

  // The same rank count gives the same bytes.
  std::vector<float> again(out.size(), 0.0f), again_lse(lse.size(), 0.0f);
  mha_tensor again_t = out_t, again_lse_t = lse_t;
  again_t.data = again.data();
  again_lse_t.data = again_lse.data();
  p.lse = &again_lse_t;
  ASSERT_EQ(mha_attention_mpi_ring(MPI_COMM_WORLD, &qt, &kt, &vt, &again_t, &p, &mpi), MHA_OK)
      << mha_mpi_last_error();
  EXPECT_EQ(std::memcmp(again.data(), out.data(), (out.size() - 1) * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(again_lse.data(), lse.data(), (lse.size() - 1) * sizeof(float)), 0);
  EXPECT_TRUE(std::isnan(out.back())) << "wrote past out";
}

// Runs `body(backend)` on every backend this CPU can run.
template <typename Fn>
void for_each_backend(Fn&& body) {
  for (const auto& entry : mha_test::list_backends()) {
    if (!entry.usable) continue;
    ASSERT_EQ(mha_select_backend(entry.name.c_str()), MHA_OK) << mha_last_error();
    body(entry.name);
  }
  mha_select_backend(nullptr);
}

class Ring : public ::testing::TestWithParam<Case> {};

TEST_P(Ring, MatchesTheSingleProcessCall) {
  for_each_backend([&](const std::string& backend) { run_ring_case(GetParam(), backend); });
}

INSTANTIATE_TEST_SUITE_P(Cases, Ring, ::testing::ValuesIn(ring_cases()),
                         [](const ::testing::TestParamInfo<Case>& param) {
                           return param.param.name;
                         });

// ------------------------------------------------------------ decode

struct DecodeCase {
  std::string name;
  int64_t lq = 1, lk = 1000;
  int32_t causal = MHA_CAUSAL_NONE;
  bool int8 = false, sinks = false, empty_rank = false;
  int valid_lens = 0;
};

class Decode : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(Decode, MatchesTheSingleProcessCallOnEveryRank) {
  const DecodeCase& dc = GetParam();
  const int rank = world_rank(), ranks = world_size();
  Case c;
  c.batch = 2;
  c.heads = 8;
  c.kv_heads = 2;
  c.lq = dc.lq;
  c.lk = dc.lk;
  c.d = c.dv = 64;
  c.causal = dc.causal;
  c.sinks = dc.sinks;
  c.valid_lens = dc.valid_lens;
  c.uneven = dc.empty_rank;
  for_each_backend([&](const std::string& backend) {
    SCOPED_TRACE(dc.name + " on " + backend + ", rank " + std::to_string(rank));
    FullProblem full(c);
    mha_attention_params params = full.params(c);
    // int8: quantise the full cache once; each rank takes its rows and scales.
    std::vector<int8_t> k8, v8;
    std::vector<float> ks, vs;
    mha_tensor kt = full.kt, vt = full.vt, kst{}, vst{};
    if (dc.int8) {
      k8.resize(full.k.size());
      v8.resize(full.v.size());
      ks.resize(static_cast<size_t>(c.batch * c.kv_heads * c.lk));
      vs.resize(ks.size());
      kt = describe4(k8.data(), MHA_DTYPE_I8, c.batch, c.kv_heads, c.lk, c.d);
      vt = describe4(v8.data(), MHA_DTYPE_I8, c.batch, c.kv_heads, c.lk, c.dv);
      kst = mha_test::describe(ks.data(), MHA_DTYPE_F32, {c.batch, c.kv_heads, c.lk});
      vst = mha_test::describe(vs.data(), MHA_DTYPE_F32, {c.batch, c.kv_heads, c.lk});
      ASSERT_EQ(mha_quantize_kv(&full.kt, &kt, &kst), MHA_OK) << mha_last_error();
      ASSERT_EQ(mha_quantize_kv(&full.vt, &vt, &vst), MHA_OK) << mha_last_error();
      params.k_scale = &kst;
      params.v_scale = &vst;
    }
    std::vector<float> whole(static_cast<size_t>(c.batch * c.heads * c.lq * c.dv));
    std::vector<float> whole_lse(static_cast<size_t>(c.batch * c.heads * c.lq));
    mha_tensor whole_t = describe4(whole.data(), MHA_DTYPE_F32, c.batch, c.heads, c.lq, c.dv);
    mha_tensor whole_lse_t =
        mha_test::describe(whole_lse.data(), MHA_DTYPE_F32, {c.batch, c.heads, c.lq});
    mha_attention_params whole_params = params;
    whole_params.lse = &whole_lse_t;
    ASSERT_EQ(mha_attention(&full.qt, &kt, &vt, &whole_t, &whole_params), MHA_OK)
        << mha_last_error();
    const Reference ref = mha_test::reference_attention(full.qt, kt, vt, &params);
    const double tol = mha_test::tolerance_for(backend, c.dtype, kt.dtype, ref, MHA_DTYPE_F32);

    const std::vector<Range> k_rows = rows_of_rank(MHA_MPI_CONTIGUOUS, c.uneven, c.lk, rank, ranks);
    const int64_t lk_r = rows_in(k_rows);
    std::vector<unsigned char> k_local = take_rows(kt, k_rows), v_local = take_rows(vt, k_rows);
    mha_tensor k_shard = describe4(k_local.data(), kt.dtype, c.batch, c.kv_heads, lk_r, c.d);
    mha_tensor v_shard = describe4(v_local.data(), vt.dtype, c.batch, c.kv_heads, lk_r, c.dv);
    std::vector<float> ks_local, vs_local;
    mha_tensor ks_t{}, vs_t{};
    mha_attention_params p = params;
    if (dc.int8) {
      for (int64_t a = 0; a < c.batch * c.kv_heads; ++a) {
        for (const Range& r : k_rows) {
          for (int64_t j = r.begin; j < r.begin + r.length; ++j) {
            ks_local.push_back(ks[static_cast<size_t>(a * c.lk + j)]);
            vs_local.push_back(vs[static_cast<size_t>(a * c.lk + j)]);
          }
        }
      }
      ks_local.push_back(0.0f);
      vs_local.push_back(0.0f);
      ks_t = mha_test::describe(ks_local.data(), MHA_DTYPE_F32, {c.batch, c.kv_heads, lk_r});
      vs_t = mha_test::describe(vs_local.data(), MHA_DTYPE_F32, {c.batch, c.kv_heads, lk_r});
      p.k_scale = &ks_t;
      p.v_scale = &vs_t;
    }
    std::vector<float> out(whole.size(), NAN), lse(whole_lse.size(), NAN);
    mha_tensor out_t = describe4(out.data(), MHA_DTYPE_F32, c.batch, c.heads, c.lq, c.dv);
    mha_tensor lse_t = mha_test::describe(lse.data(), MHA_DTYPE_F32, {c.batch, c.heads, c.lq});
    p.lse = &lse_t;
    const mha_status status =
        mha_attention_mpi_decode(MPI_COMM_WORLD, &full.qt, &k_shard, &v_shard, &out_t, &p, nullptr);
    ASSERT_TRUE(all_ranks(status == MHA_OK)) << mha_mpi_last_error();
    const std::vector<Range> all_rows = {{0, c.lq}};
    EXPECT_LE(max_row_difference(out, to_double(whole), c.batch, c.heads, c.lq, c.dv, all_rows),
              tol);
    EXPECT_LE(max_row_difference(out, ref.out, c.batch, c.heads, c.lq, c.dv, all_rows), tol);
    EXPECT_LE(max_row_difference(lse, to_double(whole_lse), c.batch, c.heads, c.lq, 1, all_rows),
              4.0 * mha_test::lse_tolerance(ref, 30.0));
    // Every rank holds the same bytes: compare with rank 0's.
    std::vector<float> root = out;
    MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
    EXPECT_EQ(std::memcmp(root.data(), out.data(), out.size() * sizeof(float)), 0);
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Decode,
    ::testing::Values(
        DecodeCase{"one_query", 1, 1000},
        DecodeCase{"uneven_with_an_empty_shard", 1, 777, MHA_CAUSAL_NONE, false, false, true},
        DecodeCase{"chunk_bottom_right", 5, 900, MHA_CAUSAL_BOTTOM_RIGHT},
        DecodeCase{"int8_cache", 1, 1000, MHA_CAUSAL_NONE, true},
        DecodeCase{"sinks_and_valid_lens", 2, 600, MHA_CAUSAL_BOTTOM_RIGHT, false, true, false, 1}),
    [](const ::testing::TestParamInfo<DecodeCase>& param) { return param.param.name; });

// ------------------------------------------------------------ load balance

// The zigzag layout gives every rank the same causal work (within 15 %); the
// contiguous one does not (the last rank has the most).
TEST(LoadBalance, ZigzagEvensOutCausalWork) {
  const int rank = world_rank(), ranks = world_size();
  for (const int32_t layout : {MHA_MPI_ZIGZAG, MHA_MPI_CONTIGUOUS}) {
    Case c;
    c.batch = 1;
    c.heads = c.kv_heads = 1;
    c.lq = c.lk = 120 * ranks + 7;  // not divisible by the rank count
    c.d = c.dv = 16;
    c.causal = MHA_CAUSAL_TOP_LEFT;
    c.layout = layout;
    FullProblem full(c);
    const std::vector<Range> rows = rows_of_rank(layout, false, c.lq, rank, ranks);
    const int64_t n = rows_in(rows);
    std::vector<unsigned char> q = take_rows(full.qt, rows), k = take_rows(full.kt, rows),
                               v = take_rows(full.vt, rows);
    mha_tensor qt = describe4(q.data(), MHA_DTYPE_F32, 1, 1, n, c.d);
    mha_tensor kt = describe4(k.data(), MHA_DTYPE_F32, 1, 1, n, c.d);
    mha_tensor vt = describe4(v.data(), MHA_DTYPE_F32, 1, 1, n, c.dv);
    std::vector<float> out(static_cast<size_t>(n * c.dv) + 1);
    mha_tensor ot = describe4(out.data(), MHA_DTYPE_F32, 1, 1, n, c.dv);
    mha_attention_params p = full.params(c);
    mha_mpi_stats stats{};
    mha_mpi_params mpi;
    mha_mpi_params_init(&mpi);
    mpi.layout = layout;
    mpi.stats = &stats;
    ASSERT_EQ(mha_attention_mpi_ring(MPI_COMM_WORLD, &qt, &kt, &vt, &ot, &p, &mpi), MHA_OK)
        << mha_mpi_last_error();
    EXPECT_EQ(stats.steps, ranks);
    std::vector<int64_t> pairs(static_cast<size_t>(ranks));
    MPI_Allgather(&stats.visible_pairs, 1, MPI_INT64_T, pairs.data(), 1, MPI_INT64_T,
                  MPI_COMM_WORLD);
    int64_t total = 0;
    for (int64_t x : pairs) total += x;
    EXPECT_EQ(total, c.lq * (c.lq + 1) / 2) << "every visible pair computed once";
    const auto [lo, hi] = std::minmax_element(pairs.begin(), pairs.end());
    const double ratio = static_cast<double>(*hi) / static_cast<double>(*lo);
    if (layout == MHA_MPI_ZIGZAG) {
      EXPECT_LE(ratio, 1.15) << "zigzag: the busiest rank's work over the idlest's";
    } else if (ranks > 1) {
      EXPECT_GT(ratio, 1.5) << "contiguous: the test would not tell layouts apart";
    }
  }
}

// ------------------------------------------------------------ errors

// A small valid problem for the error tests, with out full of a sentinel.
struct Small {
  std::vector<float> q, k, v, out, lse;
  mha_tensor qt, kt, vt, ot, lt;
  Small()
      : q(2 * 3 * 8, 0.5f),
        k(2 * 3 * 8, 0.25f),
        v(2 * 3 * 8, 1.0f),
        out(2 * 3 * 8 + 1, -7.0f),
        lse(2 * 3 + 1, -7.0f) {
    qt = describe4(q.data(), MHA_DTYPE_F32, 1, 2, 3, 8);
    kt = describe4(k.data(), MHA_DTYPE_F32, 1, 2, 3, 8);
    vt = describe4(v.data(), MHA_DTYPE_F32, 1, 2, 3, 8);
    ot = describe4(out.data(), MHA_DTYPE_F32, 1, 2, 3, 8);
    lt = mha_test::describe(lse.data(), MHA_DTYPE_F32, {1, 2, 3});
  }
  bool untouched() const {
    return std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }) &&
           std::all_of(lse.begin(), lse.end(), [](float x) { return x == -7.0f; });
  }
};

// Calls the ring with `edit` applied on rank `bad` only; every rank must
// return `want`, with a message naming that rank and `word`, and write nothing.
template <typename Edit>
void expect_refused_everywhere(int bad, mha_status want, const std::string& word, Edit edit,
                               bool decode = false) {
  const int rank = world_rank();
  Small s;
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.lse = &s.lt;
  mha_mpi_params mpi;
  mha_mpi_params_init(&mpi);
  if (rank == bad) edit(s, p, mpi);
  const mha_status got =
      decode ? mha_attention_mpi_decode(MPI_COMM_WORLD, &s.qt, &s.kt, &s.vt, &s.ot, &p, &mpi)
             : mha_attention_mpi_ring(MPI_COMM_WORLD, &s.qt, &s.kt, &s.vt, &s.ot, &p, &mpi);
  const std::string message = mha_mpi_last_error();
  EXPECT_EQ(got, want) << message;
  EXPECT_NE(message.find("rank " + std::to_string(bad)), std::string::npos) << message;
  EXPECT_NE(message.find(word), std::string::npos) << message;
  EXPECT_TRUE(s.untouched()) << "an output was written";
}

TEST(Errors, OneRanksBadShapeStopsEveryRank) {
  const int last = world_size() - 1;
  for (const bool decode : {false, true}) {
    expect_refused_everywhere(
        last, MHA_ERR_SHAPE_MISMATCH, "shape[3]",
        [](Small& s, mha_attention_params&, mha_mpi_params&) { s.kt.shape[3] = 7; }, decode);
  }
}

TEST(Errors, OneRanksDifferentHeadCountIsNamed) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  expect_refused_everywhere(1, MHA_ERR_SHAPE_MISMATCH, "head count",
                            [](Small& s, mha_attention_params&, mha_mpi_params&) {
                              // One head on this rank: valid on its own.
                              s.qt.shape[1] = s.kt.shape[1] = s.vt.shape[1] = 1;
                              s.ot.shape[1] = s.lt.shape[1] = 1;
                            });
}

TEST(Errors, BadValidLengthOnOneRank) {
  const int last = world_size() - 1;
  static int64_t too_long = 0;
  static mha_tensor valid{};
  too_long = 3 * world_size() + 1;  // beyond the full key count
  valid = mha_test::describe(&too_long, MHA_DTYPE_I64, {1});
  expect_refused_everywhere(
      last, MHA_ERR_INVALID_VALUE, "valid_lens",
      [](Small&, mha_attention_params& p, mha_mpi_params&) { p.valid_lens = &valid; });
}

TEST(Errors, BadValuesAreCheckedBeforeTheRing) {
  // A scale of NaN, a window of -2: libmha's own checks, run by each rank on
  // its arguments before anything moves.
  const int last = world_size() - 1;
  expect_refused_everywhere(last, MHA_ERR_INVALID_VALUE, "scale",
                            [](Small&, mha_attention_params& p, mha_mpi_params&) {
                              p.has_scale = 1;
                              p.scale = NAN;
                            });
  expect_refused_everywhere(
      0, MHA_ERR_INVALID_VALUE, "window_left",
      [](Small&, mha_attention_params& p, mha_mpi_params&) { p.window_left = -2; }, true);
}

TEST(Errors, AKernelFailingMidRingIsAgreedOn) {
  // The last rank's first block fails (the tests' fault injection): the
  // others are already exchanging K/V and must not hang; every rank returns
  // MHA_ERR_INTERNAL naming the rank.
  const int last = world_size() - 1;
  ASSERT_EQ(setenv("MHA_MPI_TEST_FAIL_RANK", std::to_string(last).c_str(), 1), 0);
  Small s;
  mha_attention_params p;
  mha_attention_params_init(&p);
  const mha_status got =
      mha_attention_mpi_ring(MPI_COMM_WORLD, &s.qt, &s.kt, &s.vt, &s.ot, &p, nullptr);
  const std::string message = mha_mpi_last_error();
  unsetenv("MHA_MPI_TEST_FAIL_RANK");
  EXPECT_EQ(got, MHA_ERR_INTERNAL) << message;
  EXPECT_NE(message.find("rank " + std::to_string(last)), std::string::npos) << message;
  EXPECT_NE(message.find("partial results"), std::string::npos) << message;
  // And the next call works again.
  ASSERT_EQ(mha_attention_mpi_ring(MPI_COMM_WORLD, &s.qt, &s.kt, &s.vt, &s.ot, &p, nullptr), MHA_OK)
      << mha_mpi_last_error();
}

TEST(Errors, RefusedOptions) {
  static bool keep[9];
  static mha_tensor mask{};
  mask = mha_test::describe(keep, MHA_DTYPE_BOOL, {3, 3});
  expect_refused_everywhere(
      0, MHA_ERR_UNSUPPORTED, "params->mask",
      [](Small&, mha_attention_params& p, mha_mpi_params&) { p.mask = &mask; });
  expect_refused_everywhere(
      0, MHA_ERR_INVALID_VALUE, "full_lq",
      [](Small&, mha_attention_params& p, mha_mpi_params&) { p.full_lq = 9; });
  expect_refused_everywhere(0, MHA_ERR_INVALID_VALUE, "mpi->layout",
                            [](Small&, mha_attention_params&, mha_mpi_params& m) { m.layout = 5; });
  expect_refused_everywhere(
      0, MHA_ERR_INVALID_PARAMS, "struct_size",
      [](Small&, mha_attention_params& p, mha_mpi_params&) { p.struct_size = 3; });
  expect_refused_everywhere(
      0, MHA_ERR_NULL_POINTER, "out",
      [](Small& s, mha_attention_params&, mha_mpi_params&) { s.ot.data = nullptr; });
}

TEST(Errors, ZigzagLengthsMustFollowTheRule) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  // 3 rows on each rank: for 2 ranks the rule gives 6 positions as 1+2, 1+2
  // (chunks of 1, 2, 1, 2)... any count that breaks it on rank 0 is named.
  Small s;
  mha_attention_params p;
  mha_attention_params_init(&p);
  mha_mpi_params mpi;
  mha_mpi_params_init(&mpi);
  mpi.layout = MHA_MPI_ZIGZAG;
  if (world_rank() == 0) {  // 2 rows on rank 0, 3 elsewhere: no zigzag cut gives that
    s.qt.shape[2] = s.kt.shape[2] = s.vt.shape[2] = s.ot.shape[2] = s.lt.shape[2] = 2;
  }
  const mha_status got =
      mha_attention_mpi_ring(MPI_COMM_WORLD, &s.qt, &s.kt, &s.vt, &s.ot, &p, &mpi);
  EXPECT_EQ(got, MHA_ERR_SHAPE_MISMATCH) << mha_mpi_last_error();
  EXPECT_NE(std::string(mha_mpi_last_error()).find("zigzag"), std::string::npos)
      << mha_mpi_last_error();
  EXPECT_TRUE(s.untouched());
}

// Prints only failures, prefixed with the rank (ranks other than 0).
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_,
                   result.file_name() ? result.file_name() : "?", result.line_number(),
                   result.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = world_rank();
  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  const int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
