// The module's float64 backward reference (see module_reference_backward.h).
#include "module_reference_backward.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "reference_access.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_test {
namespace {

using reference_access::at3;

constexpr double kU = 0x1p-24;

double dot_bound(int64_t k) {
  return 4.0 * std::sqrt(static_cast<double>(std::max<int64_t>(k, 1))) * kU;
}

// Rows x cols, C order.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Matrix(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<size_t>(r * c), 0.0) {}
  double& operator()(int64_t r, int64_t c) { return v[static_cast<size_t>(r * cols + c)]; }
  double operator()(int64_t r, int64_t c) const { return v[static_cast<size_t>(r * cols + c)]; }
};

// A [B, L, F] tensor as a [B·L, F] matrix.
Matrix rows_of(const mha_tensor& t) {
  Matrix m(t.shape[0] * t.shape[1], t.shape[2]);
  for (int64_t b = 0; b < t.shape[0]; ++b)
    for (int64_t l = 0; l < t.shape[1]; ++l)
      for (int64_t f = 0; f < t.shape[2]; ++f) m(b * t.shape[1] + l, f) = at3(t, b, l, f);
  return m;
}

Matrix weights_of(const std::vector<double>& w, int64_t rows, int64_t cols) {
  Matrix m(rows, cols);
  m.v = w;
  return m;
}

// G = Aᵀ·B over their rows (A [R, n], B [R, m]: G [n, m]), with the bound of
// the header: A's elements off by eps_a (a scalar) or by a_bound's elements.
ReferenceGradient transposed_product(const Matrix& a, const Matrix& b, double eps_a,
                                     const Matrix* a_bound) {
  ReferenceGradient g;
  g.value.assign(static_cast<size_t>(a.cols * b.cols), 0.0);
  for (int64_t n = 0; n < a.cols; ++n) {
    for (int64_t m = 0; m < b.cols; ++m) {
      double sum = 0, abs_sum = 0, err = 0;
      for (int64_t r = 0; r < a.rows; ++r) {
        sum += a(r, n) * b(r, m);
        abs_sum += std::fabs(a(r, n) * b(r, m));
        err += (a_bound != nullptr ? (*a_bound)(r, n) : eps_a) * std::fabs(b(r, m));
      }
      g.value[static_cast<size_t>(n * b.cols + m)] = sum;
      g.tolerance = std::max(g.tolerance, err + dot_bound(a.rows) * abs_sum);
    }
  }
  return g;
}

// G = A·W (A [R, n], W [n, m]), A's elements off by a_bound's.
ReferenceGradient product(const Matrix& a, const Matrix& w, const Matrix& a_bound) {
  ReferenceGradient g;
  g.value.assign(static_cast<size_t>(a.rows * w.cols), 0.0);
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t m = 0; m < w.cols; ++m) {
      double sum = 0, abs_sum = 0, err = 0;
      for (int64_t n = 0; n < a.cols; ++n) {
        sum += a(r, n) * w(n, m);
        abs_sum += std::fabs(a(r, n) * w(n, m));
        err += a_bound(r, n) * std::fabs(w(n, m));
      }
      g.value[static_cast<size_t>(r * w.cols + m)] = sum;
      g.tolerance = std::max(g.tolerance, err + dot_bound(a.cols) * abs_sum);
    }
  }
  return g;
}

// The heads of a [B·L, E] matrix as an F32 [B, H, L, D] tensor (C order),
// rounded once; `storage` holds its values.
mha_tensor heads_of(const Matrix& m, int64_t batch, int64_t len, int64_t heads,
                    std::vector<float>& storage) {
  const int64_t d = m.cols / heads;
  storage.assign(m.v.size(), 0.0f);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t l = 0; l < len; ++l)
      for (int64_t n = 0; n < m.cols; ++n) {
        const int64_t h = n / d, c = n % d;
        storage[static_cast<size_t>(((b * heads + h) * len + l) * d + c)] =
            static_cast<float>(m(b * len + l, n));
      }
  return describe(storage.data(), MHA_DTYPE_F32, {batch, heads, len, d});
}

// A [B, H, L, D] C-order gradient of the heads as a [B·L, E] matrix.
Matrix rows_of_heads(const std::vector<double>& g, int64_t batch, int64_t heads, int64_t len,
                     int64_t d) {
  Matrix m(batch * len, heads * d);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t l = 0; l < len; ++l)
        for (int64_t c = 0; c < d; ++c)
          m(b * len + l, h * d + c) = g[static_cast<size_t>(((b * heads + h) * len + l) * d + c)];
  return m;
}

// x·Wᵀ + b over the rows.
Matrix projection(const Matrix& x, const Matrix& w, const std::vector<double>& bias) {
  Matrix p(x.rows, w.rows);
  for (int64_t r = 0; r < x.rows; ++r)
    for (int64_t n = 0; n < w.rows; ++n) {
      double sum = bias[static_cast<size_t>(n)];
      for (int64_t c = 0; c < x.cols; ++c) sum += x(r, c) * w(n, c);
      p(r, n) = sum;
    }
  return p;
}

// What the library's fp32 x·Wᵀ + b may differ by from `value` (the same
// product in float64) beyond rho·|value|, the part the terms' bound covers:
// an fp32 sum of the bias and x.cols products is off by g(x.cols + 1) times
// the magnitudes summed -- not times |value|: where the products cancel,
// the value is far smaller than they are -- and the attention reference is
// given the value rounded to fp32.
Matrix projection_excess(const Matrix& x, const Matrix& w, const std::vector<double>& bias,
                         const Matrix& value, double rho) {
  Matrix err(x.rows, w.rows);
  for (int64_t r = 0; r < x.rows; ++r)
    for (int64_t n = 0; n < w.rows; ++n) {
      double magnitude = std::fabs(bias[static_cast<size_t>(n)]);
      for (int64_t c = 0; c < x.cols; ++c) magnitude += std::fabs(x(r, c) * w(n, c));
      const double bound = dot_bound(x.cols + 1) * magnitude + kU * std::fabs(value(r, n));
      err(r, n) = std::max(0.0, bound - rho * std::fabs(value(r, n)));
    }
  return err;
}

// A [B·L, E] matrix in the C order of its heads, [B, H, L, D].
std::vector<double> in_heads_order(const Matrix& m, int64_t batch, int64_t len, int64_t heads) {
  const int64_t d = m.cols / heads;
  std::vector<double> out(m.v.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t l = 0; l < len; ++l)
      for (int64_t n = 0; n < m.cols; ++n)
        out[static_cast<size_t>(((b * heads + n / d) * len + l) * d + n % d)] = m(b * len + l, n);
  return out;
}

}  // namespace

ModuleBackwardReference reference_module_backward(const ModuleWeights& w, const ModuleInputs& in,
                                                  const mha_tensor& dout) {
  const ModuleReference forward = reference_module(w, in);
  const int64_t e = w.embed_dim, heads = w.num_heads, d = e / heads;
  const int64_t batch = in.query->shape[0], lq = in.query->shape[1], lk = in.key->shape[1];
  const Matrix xq = rows_of(*in.query), xk = rows_of(*in.key), xv = rows_of(*in.value);
  const Matrix wq = weights_of(w.w_q, e, w.query_dim), wk = weights_of(w.w_k, e, w.key_dim),
               wv = weights_of(w.w_v, e, w.value_dim), wo = weights_of(w.w_o, e, e);

  // The attention's gradients on the projected heads.
  std::vector<float> qs, ks, vs, dcs, mask_values;
  const Matrix pq = projection(xq, wq, w.b_q), pk = projection(xk, wk, w.b_k),
               pv = projection(xv, wv, w.b_v);
  const mha_tensor qt = heads_of(pq, batch, lq, heads, qs);
  const mha_tensor kt = heads_of(pk, batch, lk, heads, ks);
  const mha_tensor vt = heads_of(pv, batch, lk, heads, vs);
  // Each input of the attention is off by at most rho of itself, as far as
  // its projection's products do not cancel; the excess is propagated.
  const int64_t widest = std::max({w.query_dim, w.key_dim, w.value_dim});
  const double rho = dot_bound(e) + dot_bound(widest);
  const Matrix dy = rows_of(dout);
  Matrix dc(dy.rows, e), dc_err(dy.rows, e);  // dC = dout·W_o, and the excess of its error
  for (int64_t r = 0; r < dy.rows; ++r)
    for (int64_t m = 0; m < e; ++m) {
      double sum = 0, magnitude = 0;
      for (int64_t n = 0; n < e; ++n) {
        sum += dy(r, n) * wo(n, m);
        magnitude += std::fabs(dy(r, n) * wo(n, m));
      }
      dc(r, m) = sum;
      dc_err(r, m) =
          std::max(0.0, dot_bound(e) * magnitude + kU * std::fabs(sum) - rho * std::fabs(sum));
    }
  const mha_tensor dct = heads_of(dc, batch, lq, heads, dcs);
  InputErrors input_errors;
  input_errors.q = in_heads_order(projection_excess(xq, wq, w.b_q, pq, rho), batch, lq, heads);
  input_errors.k = in_heads_order(projection_excess(xk, wk, w.b_k, pk, rho), batch, lk, heads);
  input_errors.v = in_heads_order(projection_excess(xv, wv, w.b_v, pv, rho), batch, lk, heads);
  input_errors.dout = in_heads_order(dc_err, batch, lq, heads);

  // PyTorch's masks as one additive mask [B, H, Lq, Lk] (-inf: not allowed).
  mha_tensor mask{};
  const bool masked = in.key_padding_mask != nullptr || in.attn_mask != nullptr;
  if (masked) {
    mask_values.assign(static_cast<size_t>(batch * heads * lq * lk), 0.0f);
    size_t n = 0;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < lq; ++i)
          for (int64_t j = 0; j < lk; ++j, ++n) {
            double add = 0;
            mask_values[n] = pytorch_masks_allow(in, heads, b, h, i, j, &add)
                                 ? static_cast<float>(add)
                                 : -std::numeric_limits<float>::infinity();
          }
    mask = describe(mask_values.data(), MHA_DTYPE_F32, {batch, heads, lq, lk});
  }
  mha_attention_params ap{};  // written out: no mha function is called
  ap.struct_size = sizeof ap;
  ap.has_scale = 1;
  ap.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  ap.causal = in.causal;
  ap.valid_lens = in.valid_lens;
  ap.mask = masked ? &mask : nullptr;
  ap.dropout_p = static_cast<float>(in.dropout_p);
  ap.dropout_seed = in.dropout_seed;
  ap.window_left = in.window_left;
  ap.window_right = in.window_right;
  ap.sinks = in.sinks;
  ap.softcap = static_cast<float>(in.softcap);
  ap.alibi_slopes = in.alibi_slopes;
  const BackwardReference att =
      reference_backward(qt, kt, vt, dct, &ap, false, nullptr, &input_errors);

  // Each element of dP_x may be off by the attention's own fp32 error, its
  // inputs' relative errors rho (each term a product of two of them), and
  // twice the first-order bound of what their excess moves it (twice: a
  // margin for the second-order terms).
  const auto eps = [&](const std::vector<double>& g, double terms) {
    return gradient_tolerance(g, terms, att.max_abs_logit) + 2.0 * rho * terms;
  };
  const auto bounds = [&](const std::vector<double>& g, double terms,
                          const std::vector<double>& propagated, int64_t len) {
    const double scalar = eps(g, terms);
    std::vector<double> b(propagated.size());
    for (size_t n = 0; n < b.size(); ++n) b[n] = scalar + 2.0 * propagated[n];
    return rows_of_heads(b, batch, heads, len, d);
  };
  const Matrix bound_q = bounds(att.dq, att.terms_dq, att.propagated_dq, lq);
  const Matrix bound_k = bounds(att.dk, att.terms_dk, att.propagated_dk, lk);
  const Matrix bound_v = bounds(att.dv, att.terms_dv, att.propagated_dv, lk);
  const Matrix dpq = rows_of_heads(att.dq, batch, heads, lq, d);
  const Matrix dpk = rows_of_heads(att.dk, batch, heads, lk, d);
  const Matrix dpv = rows_of_heads(att.dv, batch, heads, lk, d);

  ModuleBackwardReference ref;
  ref.w_q = transposed_product(dpq, xq, 0.0, &bound_q);
  ref.w_k = transposed_product(dpk, xk, 0.0, &bound_k);
  ref.w_v = transposed_product(dpv, xv, 0.0, &bound_v);
  const auto ones = [](int64_t rows) {
    Matrix m(rows, 1);
    std::fill(m.v.begin(), m.v.end(), 1.0);
    return m;
  };
  ref.b_q = transposed_product(dpq, ones(dpq.rows), 0.0, &bound_q);
  ref.b_k = transposed_product(dpk, ones(dpk.rows), 0.0, &bound_k);
  ref.b_v = transposed_product(dpv, ones(dpv.rows), 0.0, &bound_v);
  ref.query = product(dpq, wq, bound_q);
  ref.key = product(dpk, wk, bound_k);
  ref.value = product(dpv, wv, bound_v);

  Matrix concat(batch * lq, e), concat_bound(batch * lq, e);
  concat.v = forward.concat;
  concat_bound.v = forward.concat_bound;
  // dW_o (n, m) = Σ_r dout (r, n) · C (r, m): C carries the error.
  ReferenceGradient wo_t = transposed_product(concat, dy, 0.0, &concat_bound);
  ref.w_o.tolerance = wo_t.tolerance;
  ref.w_o.value.assign(wo_t.value.size(), 0.0);
  for (int64_t m = 0; m < e; ++m)
    for (int64_t n = 0; n < e; ++n)
      ref.w_o.value[static_cast<size_t>(n * e + m)] = wo_t.value[static_cast<size_t>(m * e + n)];
  ref.b_o = transposed_product(dy, ones(dy.rows), 0.0, nullptr);
  ref.b_o.tolerance = 2.0 * kU * max_abs(ref.b_o.value) + 1e-30;
  if (!att.dsinks.empty()) {
    ref.sinks.value = att.dsinks;
    ref.sinks.tolerance = eps(att.dsinks, att.terms_dsinks) + 2.0 * max_abs(att.propagated_dsinks);
  }
  return ref;
}

double worst_difference(const mha_tensor& got, const std::vector<double>& want) {
  double worst = 0;
  size_t n = 0;
  for_each_offset(got, [&](int64_t offset) {
    const double diff =
        std::fabs(static_cast<double>(static_cast<const float*>(got.data)[offset]) - want[n++]);
    worst = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(worst, diff);
  });
  return worst;
}

}  // namespace mha_test
