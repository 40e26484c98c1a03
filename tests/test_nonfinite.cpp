// Non-finite data: NaN and ±Inf in q, k, v and the additive mask, on every
// backend this CPU can run, against the float64 reference (NaN-aware).
//
// The semantics these tests expect, and why:
//  1. NaN propagates, as IEEE arithmetic and PyTorch do.  A NaN in query row i
//     makes row i all NaN (and its LSE NaN); a NaN in key j makes every row in
//     which key j takes part all NaN; a NaN in value j, feature c, makes
//     feature c of those rows NaN and leaves their other features alone.
//  2. A key that does not take part -- removed by the causal mask, a valid
//     length, a false bool mask entry, or a logit of -inf -- contributes
//     nothing, whatever its k and v hold.  Padding past a valid length and the
//     unused tail of a KV cache are routinely uninitialised memory: garbage
//     there must not leak into the result (as 0 · NaN = NaN would).
//  3. The additive mask is added to the scaled score (mha.h): NaN + -inf is
//     NaN, so a -inf entry does not hide a key whose k is NaN (use a bool mask
//     or valid lengths for that), but it does hide the key's v.
//  4. ±Inf: a logit of +inf makes its row NaN (softmax's inf - inf, as
//     PyTorch); a logit of -inf is a key that takes no part, so a row whose
//     logits are all -inf is a row with no key: zeros and LSE -inf, never NaN
//     (mha.h).  An infinite v spreads to the feature it sits in (+inf, -inf,
//     or NaN when both signs meet), as long as its weight is not zero.
//  5. Whatever the data, a call returns MHA_OK (values are never validated),
//     writes only out and lse, and finishes: no crash, no hang.
// The reference (tests/reference.cpp) implements exactly these rules; each
// test also states the pattern it expects, so a reference bug cannot hide one
// in the library.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "backend_param.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

enum class MaskKind { None, Bool, Additive };

// A problem in C order ([B,H,L,D]), with every input held by value so a test
// can plant values anywhere.
struct Problem {
  int64_t B = 1, H = 1, Hkv = 1, Lq = 1, Lk = 1, D = 8, Dv = 8;
  std::vector<float> q, k, v;
  int32_t causal = MHA_CAUSAL_NONE;
  bool has_scale = false;
  float scale = 1.0f;
  std::vector<int32_t> lens;  // empty: none; B values (per batch) or B*Lq (per query)
  MaskKind mask = MaskKind::None;
  std::vector<uint8_t> mask_bool;  // [B, 1, Lq, Lk] when used
  std::vector<float> mask_f32;     // [B, 1, Lq, Lk] when used
  std::string label;

  Problem(int64_t b, int64_t h, int64_t hkv, int64_t lq, int64_t lk, int64_t d, uint64_t seed = 1)
      : B(b), H(h), Hkv(hkv), Lq(lq), Lk(lk), D(d), Dv(d) {
    Rng rng(seed);
    q.resize(static_cast<size_t>(B * H * Lq * D));
    k.resize(static_cast<size_t>(B * Hkv * Lk * D));
    v.resize(static_cast<size_t>(B * Hkv * Lk * Dv));
    for (auto* buf : {&q, &k, &v})
      for (float& x : *buf) x = rng.uniform();
  }

  float& Q(int64_t b, int64_t h, int64_t i, int64_t c) {
    return q[static_cast<size_t>(((b * H + h) * Lq + i) * D + c)];
  }
  float& K(int64_t b, int64_t g, int64_t j, int64_t c) {
    return k[static_cast<size_t>(((b * Hkv + g) * Lk + j) * D + c)];
  }
  float& V(int64_t b, int64_t g, int64_t j, int64_t c) {
    return v[static_cast<size_t>(((b * Hkv + g) * Lk + j) * Dv + c)];
  }
  void use_bool_mask() {
    mask = MaskKind::Bool;
    mask_bool.assign(static_cast<size_t>(B * Lq * Lk), 1);
  }
  void use_additive_mask() {
    mask = MaskKind::Additive;
    mask_f32.assign(static_cast<size_t>(B * Lq * Lk), 0.0f);
  }
  uint8_t& MB(int64_t b, int64_t i, int64_t j) {
    return mask_bool[static_cast<size_t>((b * Lq + i) * Lk + j)];
  }
  float& MF(int64_t b, int64_t i, int64_t j) {
    return mask_f32[static_cast<size_t>((b * Lq + i) * Lk + j)];
  }

  std::string describe() const {
    std::ostringstream os;
    os << label << " [B=" << B << " H=" << H << " Hkv=" << Hkv << " Lq=" << Lq << " Lk=" << Lk
       << " D=" << D << " causal=" << causal << (lens.empty() ? "" : " valid_lens")
       << (mask == MaskKind::Bool ? " bool-mask" : "")
       << (mask == MaskKind::Additive ? " additive-mask" : "") << "]";
    return os.str();
  }
};

struct Result {
  bool ok = false;
  int64_t B = 0, H = 0, Lq = 0, Dv = 0;
  std::vector<float> out, lse;  // C order
  Reference ref;

  float at(int64_t b, int64_t h, int64_t i, int64_t c) const {
    return out[static_cast<size_t>(((b * H + h) * Lq + i) * Dv + c)];
  }
  float lse_at(int64_t b, int64_t h, int64_t i) const {
    return lse[static_cast<size_t>((b * H + h) * Lq + i)];
  }
};

bool same_value(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= tol;  // false for NaN and infinities
}

// Calls mha_attention on the selected backend and checks it against the
// reference: out within tolerance with NaN where the reference has NaN and the
// same infinities, lse likewise, nothing written outside out and lse, inputs
// untouched; then once more without lse, for the same output.
Result run(const Problem& p) {
  SCOPED_TRACE(p.describe());
  Result r;
  r.B = p.B, r.H = p.H, r.Lq = p.Lq, r.Dv = p.Dv;
  std::vector<float> q = p.q, k = p.k, v = p.v;
  std::vector<uint8_t> mask_bool = p.mask_bool;
  std::vector<float> mask_f32 = p.mask_f32;
  std::vector<int32_t> lens = p.lens;
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.D});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {p.B, p.Hkv, p.Lk, p.D});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {p.B, p.Hkv, p.Lk, p.Dv});
  Arena out_arena(p.B * p.H * p.Lq * p.Dv), lse_arena(p.B * p.H * p.Lq);
  mha_tensor tout = describe(out_arena.base(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.Dv});
  mha_tensor tlse = describe(lse_arena.base(), MHA_DTYPE_F32, {p.B, p.H, p.Lq});
  mha_tensor tlens{}, tmask{};
  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = p.causal;
  if (p.has_scale) params.has_scale = 1, params.scale = p.scale;
  if (!lens.empty()) {
    if (static_cast<int64_t>(lens.size()) == p.B) {
      tlens = describe(lens.data(), MHA_DTYPE_I32, {p.B});
    } else {
      tlens = describe(lens.data(), MHA_DTYPE_I32, {p.B, p.Lq});
    }
    params.valid_lens = &tlens;
  }
  if (p.mask == MaskKind::Bool) {
    tmask = describe(mask_bool.data(), MHA_DTYPE_BOOL, {p.B, 1, p.Lq, p.Lk});
    params.mask = &tmask;
  } else if (p.mask == MaskKind::Additive) {
    tmask = describe(mask_f32.data(), MHA_DTYPE_F32, {p.B, 1, p.Lq, p.Lk});
    params.mask = &tmask;
  }
  params.lse = &tlse;

  r.ref = reference_attention(tq, tk, tv, &params);
  const std::vector<float> out_before = out_arena.all(), lse_before = lse_arena.all();
  const mha_status status = mha_attention(&tq, &tk, &tv, &tout, &params);
  EXPECT_EQ(status, MHA_OK) << mha_status_name(status) << ": " << mha_last_error();
  if (status != MHA_OK) return r;

  const double error = max_abs_error(tout, r.ref), tol = tolerance(r.ref);
  // Describe the first disagreement: what the reference says and what came out.
  std::ostringstream first;
  int64_t bad = 0;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t i = 0; i < p.Lq; ++i)
        for (int64_t c = 0; c < p.Dv; ++c) {
          const size_t n = static_cast<size_t>(((b * p.H + h) * p.Lq + i) * p.Dv + c);
          const double got = static_cast<double>(out_arena.base()[n]);
          if (!same_value(got, r.ref.out[n], tol) && bad++ == 0) {
            first << "out[" << b << "," << h << "," << i << "," << c << "] = " << got
                  << ", reference " << r.ref.out[n];
          }
        }
  EXPECT_LE(error, tol) << bad << " elements differ; first: " << first.str();
  EXPECT_EQ(bad, 0) << "first: " << first.str();

  int64_t bad_lse = 0;
  std::ostringstream first_lse;
  for (int64_t row = 0; row < p.B * p.H * p.Lq; ++row) {
    const double want = r.ref.lse[static_cast<size_t>(row)];
    const double got = static_cast<double>(lse_arena.base()[row]);
    const double lse_tol = lse_tolerance(r.ref, want);
    if (!same_value(got, want, lse_tol) && bad_lse++ == 0) {
      first_lse << "lse row " << row << " = " << got << ", reference " << want;
    }
  }
  EXPECT_EQ(bad_lse, 0) << "first: " << first_lse.str();
  EXPECT_EQ(out_arena.changed_outside(tout, out_before), 0) << "written outside out";
  EXPECT_EQ(lse_arena.changed_outside(tlse, lse_before), 0) << "written outside lse";
  EXPECT_TRUE(std::memcmp(q.data(), p.q.data(), q.size() * 4) == 0 &&
              std::memcmp(k.data(), p.k.data(), k.size() * 4) == 0 &&
              std::memcmp(v.data(), p.v.data(), v.size() * 4) == 0)
      << "an input was modified";

  // Without an LSE the kernels write fp32 rows on their plain path, which
  // checks the values as it writes them (a non-finite one sends the tile
  // through the careful pass): the same output, bit for bit (NaN for NaN).
  Arena plain_arena(p.B * p.H * p.Lq * p.Dv);
  mha_tensor tplain = describe(plain_arena.base(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.Dv});
  params.lse = nullptr;
  EXPECT_EQ(mha_attention(&tq, &tk, &tv, &tplain, &params), MHA_OK) << mha_last_error();
  int64_t differ = 0;
  for (int64_t n = 0; n < p.B * p.H * p.Lq * p.Dv; ++n) {
    const float a = out_arena.base()[n], b = plain_arena.base()[n];
    uint32_t a_bits = 0, b_bits = 0;
    std::memcpy(&a_bits, &a, sizeof a);
    std::memcpy(&b_bits, &b, sizeof b);
    if (!(std::isnan(a) && std::isnan(b)) && a_bits != b_bits && differ++ == 0) {
      ADD_FAILURE() << "without lse, out element " << n << " = " << b << ", with lse " << a;
    }
  }
  EXPECT_EQ(differ, 0) << "elements that differ without lse";

  r.ok = true;
  r.out.assign(out_arena.base(), out_arena.base() + p.B * p.H * p.Lq * p.Dv);
  r.lse.assign(lse_arena.base(), lse_arena.base() + p.B * p.H * p.Lq);
  return r;
}

// ------------------------------------------------------------------ row patterns

enum class RowIs { Finite, AllNaN, Zero };

const char* row_name(RowIs kind) {
  return kind == RowIs::Finite ? "finite" : kind == RowIs::AllNaN ? "all NaN" : "zero";
}

// Checks the kind of row (b, h, i) of a result, and its LSE.
void expect_row(const Result& r, int64_t b, int64_t h, int64_t i, RowIs kind) {
  if (!r.ok) return;
  int64_t wrong = 0;
  for (int64_t c = 0; c < r.Dv; ++c) {
    const float x = r.at(b, h, i, c);
    const bool good = kind == RowIs::Finite   ? std::isfinite(x)
                      : kind == RowIs::AllNaN ? std::isnan(x)
                                              : x == 0.0f;
    if (!good) ++wrong;
  }
  const float lse = r.lse_at(b, h, i);
  const bool lse_good = kind == RowIs::Finite   ? std::isfinite(lse)
                        : kind == RowIs::AllNaN ? std::isnan(lse)
                                                : lse == -kInf;
  EXPECT_EQ(wrong, 0) << "row [" << b << "," << h << "," << i << "] should be " << row_name(kind);
  EXPECT_TRUE(lse_good) << "lse of row [" << b << "," << h << "," << i << "] = " << lse
                        << "; the row should be " << row_name(kind);
}

// Geometries that reach every kernel path: query lanes over several tiles,
// the decode layout (few queries, heads sharing a KV head), and split-KV
// (long key ranges for few rows, merged by LSE), in prefill and decode form.
struct Geometry {
  const char* name;
  int64_t B, H, Hkv, Lq, Lk, D;
};
constexpr Geometry kGeometries[] = {
    {"prefill", 2, 2, 1, 21, 37, 16},
    {"decode", 2, 4, 2, 1, 50, 32},
    {"decode-split-kv", 1, 2, 1, 1, 3000, 16},
    {"prefill-split-kv", 1, 1, 1, 20, 2100, 8},
};

Problem make(const Geometry& g, uint64_t seed = 1) {
  Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, seed);
  p.label = g.name;
  return p;
}

// Keys worth planting a value in: the first, one inside a tile, the last, and
// for long rows one in a later split-KV chunk.
std::vector<int64_t> key_positions(int64_t lk) {
  std::vector<int64_t> keys = {0, lk - 1};
  if (lk > 2) keys.push_back(lk / 2 + 1);
  if (lk > 1500) keys.push_back(lk - 700);
  return keys;
}

// ------------------------------------------------------------------ fixture

class NonFinite : public BackendTest {};

// ------------------------------------------------------------------ NaN

TEST_P(NonFinite, NaNInQueryPoisonsItsRowOnly) {
  for (const auto& g : kGeometries) {
    Problem p = make(g);
    const int64_t b = g.B - 1, h = g.H - 1, i = g.Lq / 2, c = g.D - 1;
    p.Q(b, h, i, c) = kNaN;
    p.label = std::string(g.name) + " q NaN";
    const Result r = run(p);
    for (int64_t bb = 0; bb < g.B; ++bb)
      for (int64_t hh = 0; hh < g.H; ++hh)
        for (int64_t ii = 0; ii < g.Lq; ++ii)
          expect_row(r, bb, hh, ii, bb == b && hh == h && ii == i ? RowIs::AllNaN : RowIs::Finite);
  }
}

TEST_P(NonFinite, NaNInKeyPoisonsEveryRowThatSeesIt) {
  for (const auto& g : kGeometries) {
    for (const int64_t j : key_positions(g.Lk)) {
      Problem p = make(g, static_cast<uint64_t>(j) + 7);
      p.K(0, 0, j, 0) = kNaN;
      p.label = std::string(g.name) + " k NaN at key " + std::to_string(j);
      const Result r = run(p);
      const int64_t group = g.H / g.Hkv;
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t h = 0; h < g.H; ++h)
          for (int64_t i = 0; i < g.Lq; ++i)
            expect_row(r, b, h, i, b == 0 && h / group == 0 ? RowIs::AllNaN : RowIs::Finite);
    }
  }
}

TEST_P(NonFinite, NaNInValuePoisonsOneFeature) {
  for (const auto& g : kGeometries) {
    for (const int64_t j : key_positions(g.Lk)) {
      Problem p = make(g, static_cast<uint64_t>(j) + 11);
      const int64_t c = g.D / 2;
      p.V(0, 0, j, c) = kNaN;
      p.label = std::string(g.name) + " v NaN at key " + std::to_string(j);
      const Result r = run(p);
      if (!r.ok) continue;
      int64_t wrong = 0;
      for (int64_t h = 0; h < g.H / g.Hkv; ++h)
        for (int64_t i = 0; i < g.Lq; ++i)
          for (int64_t cc = 0; cc < g.D; ++cc) {
            const float x = r.at(0, h, i, cc);
            if (cc == c ? !std::isnan(x) : !std::isfinite(x)) ++wrong;
          }
      EXPECT_EQ(wrong, 0) << p.describe() << ": only feature " << c << " should be NaN";
    }
  }
}

TEST_P(NonFinite, NaNInAdditiveMaskPoisonsItsRow) {
  for (const auto& g : kGeometries) {
    for (const int64_t j : key_positions(g.Lk)) {
      Problem p = make(g, static_cast<uint64_t>(j) + 13);
      p.use_additive_mask();
      const int64_t i = g.Lq - 1;
      p.MF(0, i, j) = kNaN;
      p.label = std::string(g.name) + " mask NaN at key " + std::to_string(j);
      const Result r = run(p);
      for (int64_t h = 0; h < g.H; ++h)
        for (int64_t ii = 0; ii < g.Lq; ++ii)
          expect_row(r, 0, h, ii, ii == i ? RowIs::AllNaN : RowIs::Finite);
    }
  }
}

TEST_P(NonFinite, NaNRowWithNoKeyIsStillZero) {
  // A row that no key takes part in is zeros with LSE -inf, even if its query
  // is NaN: there is nothing to attend to, so nothing to poison.
  for (const auto& g : kGeometries) {
    Problem p = make(g);
    p.lens.assign(static_cast<size_t>(g.B), static_cast<int32_t>(g.Lk));
    p.lens[0] = 0;
    for (int64_t c = 0; c < g.D; ++c) p.Q(0, 0, 0, c) = kNaN;
    p.label = std::string(g.name) + " NaN query, valid length 0";
    const Result r = run(p);
    expect_row(r, 0, 0, 0, RowIs::Zero);
  }
}

// ------------------------------------------------------------------ keys that take no part

// Every way of removing keys, with NaN and Inf planted in the removed keys' k
// and v: the result must equal the reference, which never reads them.
TEST_P(NonFinite, RemovedKeysHideGarbage) {
  const float garbage[] = {kNaN, kInf, -kInf};
  for (const auto& g : kGeometries) {
    for (const float bad : garbage) {
      const std::string what = std::string(g.name) + " garbage " + std::to_string(bad);
      {  // past the valid length, per batch (the padding of a batch of sequences)
        Problem p = make(g, 21);
        const int64_t len = g.Lk / 2 + 1;
        p.lens.assign(static_cast<size_t>(g.B), static_cast<int32_t>(len));
        for (int64_t b = 0; b < g.B; ++b)
          for (int64_t gg = 0; gg < g.Hkv; ++gg)
            for (int64_t j = len; j < g.Lk; ++j)
              for (int64_t c = 0; c < g.D; ++c) p.K(b, gg, j, c) = p.V(b, gg, j, c) = bad;
        p.label = what + " past valid_lens";
        const Result r = run(p);
        for (int64_t i = 0; i < g.Lq; ++i) expect_row(r, 0, 0, i, RowIs::Finite);
      }
      {  // past a per-query valid length
        Problem p = make(g, 22);
        p.lens.resize(static_cast<size_t>(g.B * g.Lq));
        for (int64_t n = 0; n < g.B * g.Lq; ++n) {
          p.lens[static_cast<size_t>(n)] = static_cast<int32_t>(1 + n % g.Lk);
        }
        for (int64_t c = 0; c < g.D; ++c) p.K(0, 0, g.Lk - 1, c) = p.V(0, 0, g.Lk - 1, c) = bad;
        if (g.Lk > g.Lq + 1) {
          p.label = what + " past per-query valid_lens";
          run(p);
        }
      }
      {  // the future of a causal mask: top-left hides keys j > i
        Problem p = make(g, 23);
        p.causal = MHA_CAUSAL_TOP_LEFT;
        for (int64_t j = g.Lq; j < g.Lk; ++j)
          for (int64_t c = 0; c < g.D; ++c) p.K(0, 0, j, c) = p.V(0, 0, j, c) = bad;
        p.label = what + " causal future";
        const Result r = run(p);
        for (int64_t i = 0; i < g.Lq; ++i) expect_row(r, 0, 0, i, RowIs::Finite);
      }
      {  // bottom-right with more queries than keys: the first rows see nothing
        Problem p = make(g, 24);
        p.causal = MHA_CAUSAL_BOTTOM_RIGHT;
        // key Lk-1 is seen by the last query only
        for (int64_t c = 0; c < g.D; ++c) p.K(0, 0, g.Lk - 1, c) = p.V(0, 0, g.Lk - 1, c) = bad;
        p.label = what + " causal bottom-right";
        run(p);
      }
      {  // false entries of a bool mask
        Problem p = make(g, 25);
        p.use_bool_mask();
        for (const int64_t j : key_positions(g.Lk)) {
          for (int64_t i = 0; i < g.Lq; ++i) p.MB(0, i, j) = 0;
          for (int64_t c = 0; c < g.D; ++c) p.K(0, 0, j, c) = p.V(0, 0, j, c) = bad;
        }
        p.label = what + " bool mask false";
        const Result r = run(p);
        for (int64_t i = 0; i < g.Lq; ++i) expect_row(r, 0, 0, i, RowIs::Finite);
      }
      {  // -inf entries of an additive mask hide v (but not a NaN k: rule 3)
        Problem p = make(g, 26);
        p.use_additive_mask();
        for (const int64_t j : key_positions(g.Lk)) {
          for (int64_t i = 0; i < g.Lq; ++i) p.MF(0, i, j) = -kInf;
          for (int64_t c = 0; c < g.D; ++c) p.V(0, 0, j, c) = bad;
        }
        p.label = what + " additive mask -inf over v garbage";
        const Result r = run(p);
        for (int64_t i = 0; i < g.Lq; ++i) expect_row(r, 0, 0, i, RowIs::Finite);
      }
    }
  }
}

TEST_P(NonFinite, AdditiveMaskMinusInfDoesNotHideNaNKey) {
  // Rule 3: the mask is added to the score, and NaN + -inf is NaN.
  for (const auto& g : kGeometries) {
    Problem p = make(g, 27);
    p.use_additive_mask();
    const int64_t j = g.Lk - 1;
    for (int64_t i = 0; i < g.Lq; ++i) p.MF(0, i, j) = -kInf;
    p.K(0, 0, j, 0) = kNaN;
    p.label = std::string(g.name) + " NaN k under a -inf mask";
    const Result r = run(p);
    expect_row(r, 0, 0, 0, RowIs::AllNaN);
  }
}

// ------------------------------------------------------------------ infinities

TEST_P(NonFinite, InfiniteValueSpreadsToItsFeature) {
  // Logits stay in [-1, 1]: no weight is zero, so v's infinity reaches out.
  for (const auto& g : kGeometries) {
    for (const int64_t j : key_positions(g.Lk)) {
      Problem p = make(g, static_cast<uint64_t>(j) + 31);
      p.has_scale = true, p.scale = 1.0f / static_cast<float>(g.D);
      p.V(0, 0, j, 0) = kInf;
      p.V(0, 0, j, 1) = -kInf;
      p.V(0, 0, j, 2) = kInf;
      p.V(0, 0, (j + 1) % g.Lk, 2) = -kInf;  // both signs in feature 2: NaN
      p.label = std::string(g.name) + " infinite v at key " + std::to_string(j);
      const Result r = run(p);
      if (!r.ok) continue;
      for (int64_t i = 0; i < g.Lq; ++i) {
        EXPECT_EQ(r.at(0, 0, i, 0), kInf) << p.describe() << " row " << i;
        EXPECT_EQ(r.at(0, 0, i, 1), -kInf) << p.describe() << " row " << i;
        EXPECT_TRUE(std::isnan(r.at(0, 0, i, 2))) << p.describe() << " row " << i;
        EXPECT_TRUE(std::isfinite(r.at(0, 0, i, 3))) << p.describe() << " row " << i;
        EXPECT_TRUE(std::isfinite(r.lse_at(0, 0, i))) << p.describe() << " row " << i;
      }
    }
  }
}

TEST_P(NonFinite, PlusInfiniteLogitMakesRowNaN) {
  // q = +inf in feature 0 and k > 0 there for every key: every logit is +inf.
  // softmax is inf - inf: NaN (as PyTorch).  Mixed signs give +inf and -inf
  // logits in one row: still NaN.
  for (const auto& g : kGeometries) {
    for (const bool mixed : {false, true}) {
      Problem p = make(g, 41);
      p.Q(0, 0, 0, 0) = kInf;
      for (int64_t j = 0; j < g.Lk; ++j) {
        const float magnitude = 0.25f + 0.5f * std::fabs(p.K(0, 0, j, 0));
        p.K(0, 0, j, 0) = mixed && j % 2 ? -magnitude : magnitude;
      }
      p.label = std::string(g.name) + (mixed ? " +-inf logits" : " +inf logits");
      const Result r = run(p);
      expect_row(r, 0, 0, 0, RowIs::AllNaN);
      if (g.Lq > 1) expect_row(r, 0, 0, 1, RowIs::Finite);
    }
  }
}

TEST_P(NonFinite, MinusInfiniteLogitsRemoveKeys) {
  // q = +inf in feature 0 and k < 0 there for some keys: their logits are
  // -inf, so they take no part; when every key's logit is -inf, no key takes
  // part: zeros and LSE -inf.
  for (const auto& g : kGeometries) {
    for (const bool all : {false, true}) {
      Problem p = make(g, 43);
      p.Q(0, 0, 0, 0) = kInf;
      for (int64_t j = 0; j < g.Lk; ++j) {
        const float magnitude = 0.25f + 0.5f * std::fabs(p.K(0, 0, j, 0));
        p.K(0, 0, j, 0) = -magnitude;
      }
      if (!all) {  // one key with k = 0 there: 0 * inf = NaN, so the row is NaN
        p.K(0, 0, g.Lk / 2, 0) = 0.0f;
      }
      p.label = std::string(g.name) + (all ? " all logits -inf" : " -inf logits and one NaN");
      const Result r = run(p);
      expect_row(r, 0, 0, 0, all ? RowIs::Zero : RowIs::AllNaN);
    }
    {
      // The same through the mask: -inf everywhere in a row is a row with no key.
      Problem p = make(g, 44);
      p.use_additive_mask();
      for (int64_t j = 0; j < g.Lk; ++j) p.MF(0, 0, j) = -kInf;
      p.label = std::string(g.name) + " additive mask all -inf";
      const Result r = run(p);
      expect_row(r, 0, 0, 0, RowIs::Zero);
    }
  }
}

TEST_P(NonFinite, MinusInfiniteLogitHidesNonFiniteValue) {
  // Rule 2 without any mask: k = -inf in feature 0 against q > 0 there makes
  // a logit of -inf, a key that takes no part, so the NaN or infinity in its
  // v row must not reach the output -- in a row that has other keys (finite
  // result) and in one where every logit is -inf (zeros, LSE -inf).  No mask
  // is involved, so the kernels' masked-tile guards do not see these keys.
  for (const auto& g : kGeometries) {
    for (const bool all : {false, true}) {
      for (const float bad : {kNaN, kInf}) {
        Problem p = make(g, 49);
        for (int64_t b = 0; b < g.B; ++b)
          for (int64_t h = 0; h < g.H; ++h)
            for (int64_t i = 0; i < g.Lq; ++i) p.Q(b, h, i, 0) = 0.1f + std::fabs(p.Q(b, h, i, 0));
        const std::vector<int64_t> planted = key_positions(g.Lk);
        for (int64_t j = 0; j < g.Lk; ++j) {
          const bool hit = all || std::find(planted.begin(), planted.end(), j) != planted.end();
          if (!hit) continue;
          p.K(0, 0, j, 0) = -kInf;
        }
        for (const int64_t j : planted) {
          for (int64_t c = 0; c < g.D; ++c) p.V(0, 0, j, c) = bad;
        }
        p.label = std::string(g.name) + (all ? " every logit -inf" : " some logits -inf") +
                  (std::isnan(bad) ? ", their v NaN" : ", their v inf");
        const Result r = run(p);
        const int64_t group = g.H / g.Hkv;  // query heads of KV head 0: 0 .. group-1
        for (int64_t b = 0; b < g.B; ++b)
          for (int64_t h = 0; h < g.H; ++h)
            for (int64_t i = 0; i < g.Lq; ++i)
              expect_row(r, b, h, i, all && b == 0 && h < group ? RowIs::Zero : RowIs::Finite);
      }
    }
  }
}

TEST_P(NonFinite, MaskIsAddedToMinusInfiniteLogit) {
  // Rule 3 meets rule 4: a score of -inf (k = -inf against q > 0) plus an
  // additive mask entry of +inf or NaN is NaN, which poisons the row -- the
  // mask is added before the key counts as removed (fuzzer finding: the
  // scalar backend skipped the addition for such scores).
  for (const auto& g : kGeometries) {
    for (const float entry : {kInf, kNaN}) {
      Problem p = make(g, 53);
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t h = 0; h < g.H; ++h)
          for (int64_t i = 0; i < g.Lq; ++i) p.Q(b, h, i, 0) = 0.1f + std::fabs(p.Q(b, h, i, 0));
      p.K(0, 0, 0, 0) = -kInf;
      p.use_additive_mask();
      p.MF(0, 0, 0) = entry;
      p.label =
          std::string(g.name) + (std::isnan(entry) ? " NaN" : " +inf") + " mask on a -inf logit";
      const Result r = run(p);
      // The mask is shared by the heads: for the heads of KV head 0 the entry
      // meets the -inf logit, for the others a finite one (NaN either way).
      for (int64_t h = 0; h < g.H; ++h) expect_row(r, 0, h, 0, RowIs::AllNaN);
      if (g.Lq > 1) expect_row(r, 0, 0, 1, RowIs::Finite);
    }
  }
}

TEST_P(NonFinite, PlusInfiniteMaskMakesRowNaN) {
  for (const auto& g : kGeometries) {
    Problem p = make(g, 45);
    p.use_additive_mask();
    p.MF(0, 0, g.Lk - 1) = kInf;
    p.label = std::string(g.name) + " +inf mask entry";
    const Result r = run(p);
    expect_row(r, 0, 0, 0, RowIs::AllNaN);
  }
}

TEST_P(NonFinite, InfiniteKeyWithZeroQuery) {
  // 0 * inf = NaN: a query with a zero where a key has an infinity gets NaN.
  for (const auto& g : kGeometries) {
    Problem p = make(g, 47);
    for (int64_t i = 0; i < g.Lq; ++i) p.Q(0, 0, i, 3) = 0.0f;
    p.K(0, 0, g.Lk - 1, 3) = kInf;
    p.label = std::string(g.name) + " inf k against zero q";
    const Result r = run(p);
    for (int64_t i = 0; i < g.Lq; ++i) expect_row(r, 0, 0, i, RowIs::AllNaN);
  }
}

// ------------------------------------------------------------------ split-KV merges

TEST_P(NonFinite, NaNChunkAmongEmptyChunks) {
  // Decoding over a long cache split into chunks: the only keys taking part
  // sit in one chunk and one of them is NaN.  The NaN must survive the merge
  // of that chunk with chunks that have no key (LSE -inf), in either order.
  for (const int64_t first_key : {int64_t{0}, int64_t{1500}, int64_t{2950}}) {
    Problem p(1, 2, 1, 1, 3000, 16, 51);
    p.use_bool_mask();
    std::fill(p.mask_bool.begin(), p.mask_bool.end(), uint8_t{0});
    for (int64_t j = first_key; j < first_key + 40; ++j) p.MB(0, 0, j) = 1;
    p.K(0, 0, first_key + 20, 5) = kNaN;
    p.label = "split-kv: keys [" + std::to_string(first_key) + ", +40), one NaN";
    const Result r = run(p);
    expect_row(r, 0, 0, 0, RowIs::AllNaN);
    expect_row(r, 0, 1, 0, RowIs::AllNaN);
  }
  {
    // The same with a NaN value: only its feature is NaN after the merge.
    Problem p(1, 2, 1, 1, 3000, 16, 52);
    p.lens = {1000};
    p.V(0, 0, 999, 4) = kNaN;
    p.label = "split-kv: NaN v at the last valid key";
    const Result r = run(p);
    if (r.ok) {
      EXPECT_TRUE(std::isnan(r.at(0, 0, 0, 4)));
      EXPECT_TRUE(std::isfinite(r.at(0, 0, 0, 3)));
    }
  }
}

TEST_P(NonFinite, EverythingNaN) {
  // No crash, no hang, and NaN everywhere a key takes part.
  for (const auto& g : kGeometries) {
    Problem p = make(g, 53);
    for (auto* buf : {&p.q, &p.k, &p.v}) std::fill(buf->begin(), buf->end(), kNaN);
    p.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    p.label = std::string(g.name) + " all NaN";
    const Result r = run(p);
    const int64_t seen_from = std::max<int64_t>(0, g.Lq - g.Lk);
    for (int64_t i = 0; i < g.Lq; ++i)
      expect_row(r, 0, 0, i, i >= seen_from ? RowIs::AllNaN : RowIs::Zero);
  }
}

TEST_P(NonFinite, EverythingInfinite) {
  for (const auto& g : kGeometries) {
    for (const float x : {kInf, -kInf}) {
      Problem p = make(g, 54);
      for (auto* buf : {&p.q, &p.k, &p.v}) std::fill(buf->begin(), buf->end(), x);
      p.label = std::string(g.name) + " all " + std::to_string(x);
      run(p);  // +inf logits everywhere: NaN rows (the reference decides)
    }
  }
}

// ------------------------------------------------------------------ mha_merge_partials

// The public merge follows the same rules: a part whose LSE is NaN makes the
// row NaN; a part with LSE -inf has no key, so whatever its out holds
// (garbage, NaN) is ignored.
TEST(NonFiniteMerge, NaNAndEmptyParts) {
  const int64_t Dv = 4;
  float outs_data[3][Dv] = {{1, 2, 3, 4}, {5, 6, 7, 8}, {kNaN, kNaN, kInf, -kInf}};
  float lses_data[3] = {0.5f, 1.5f, -kInf};
  mha_tensor outs[3], lses[3];
  for (int c = 0; c < 3; ++c) {
    outs[c] = describe(outs_data[c], MHA_DTYPE_F32, {1, 1, 1, Dv});
    lses[c] = describe(&lses_data[c], MHA_DTYPE_F32, {1, 1, 1});
  }
  float out[Dv], lse = 0;
  mha_tensor tout = describe(out, MHA_DTYPE_F32, {1, 1, 1, Dv});
  mha_tensor tlse = describe(&lse, MHA_DTYPE_F32, {1, 1, 1});
  ASSERT_EQ(mha_merge_partials(3, outs, lses, &tout, &tlse), MHA_OK) << mha_last_error();
  for (int64_t c = 0; c < Dv; ++c) EXPECT_TRUE(std::isfinite(out[c])) << "feature " << c;
  EXPECT_TRUE(std::isfinite(lse));

  // A NaN part poisons the row, in any position.
  for (const int nan_at : {0, 1}) {
    float l[3] = {0.5f, 1.5f, -kInf};
    l[nan_at] = kNaN;
    for (int c = 0; c < 3; ++c) lses[c] = describe(&l[c], MHA_DTYPE_F32, {1, 1, 1});
    ASSERT_EQ(mha_merge_partials(3, outs, lses, &tout, &tlse), MHA_OK) << mha_last_error();
    for (int64_t c = 0; c < Dv; ++c)
      EXPECT_TRUE(std::isnan(out[c])) << "NaN lse at part " << nan_at;
    EXPECT_TRUE(std::isnan(lse)) << "NaN lse at part " << nan_at;
  }
  {
    // Only a NaN part and empty parts: NaN, not the zeros of an empty row.
    float l[3] = {-kInf, kNaN, -kInf};
    for (int c = 0; c < 3; ++c) lses[c] = describe(&l[c], MHA_DTYPE_F32, {1, 1, 1});
    ASSERT_EQ(mha_merge_partials(3, outs, lses, &tout, &tlse), MHA_OK) << mha_last_error();
    for (int64_t c = 0; c < Dv; ++c) EXPECT_TRUE(std::isnan(out[c])) << "NaN among empty parts";
    EXPECT_TRUE(std::isnan(lse)) << "NaN among empty parts";
  }
  {
    // A NaN feature in a part with weight: that feature only.
    float l[3] = {0.5f, 1.5f, -kInf};
    outs_data[1][2] = kNaN;
    for (int c = 0; c < 3; ++c) lses[c] = describe(&l[c], MHA_DTYPE_F32, {1, 1, 1});
    ASSERT_EQ(mha_merge_partials(3, outs, lses, &tout, &tlse), MHA_OK) << mha_last_error();
    EXPECT_TRUE(std::isnan(out[2]));
    EXPECT_TRUE(std::isfinite(out[0]) && std::isfinite(out[1]) && std::isfinite(out[3]));
    EXPECT_TRUE(std::isfinite(lse));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, NonFinite, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

}  // namespace
}  // namespace mha_test
