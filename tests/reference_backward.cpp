// The float64 backward reference: for each row, the weights from scratch,
// then dP = dO·Vᵀ, delta = Σ_j P_j Z_j dP_j, dS = P ∘ (Z ∘ dP - delta), and
// the chain rule through the softcap to Q and K.  Rules (window, causal,
// valid lengths, masks, ALiBi, sinks, dropout) as mha.h states them.
#include "reference_backward.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "dropout_rule.h"
#include "reference_access.h"

namespace mha_test {
using namespace reference_access;

BackwardReference reference_backward(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                                     const mha_tensor& dout, const mha_attention_params* params,
                                     bool want_dlogit, const mha_tensor* out,
                                     const InputErrors* input_errors) {
  require_tensor(q, "q", 4, 4);
  require_tensor(k, "k", 4, 4);
  require_tensor(v, "v", 4, 4);
  require_tensor(dout, "dout", 4, 4);
  if (out != nullptr) require_tensor(*out, "out", 4, 4);
  const int64_t batch = q.shape[0], heads = q.shape[1], lq = q.shape[2], d = q.shape[3];
  const int64_t kv_heads = k.shape[1], lk = k.shape[2], dv = v.shape[3];
  const int64_t group = heads / kv_heads;
  mha_attention_params none{};  // the defaults, written out: no mha function is called
  none.struct_size = sizeof none;
  none.window_left = -1;
  none.window_right = -1;
  const mha_attention_params& p = params != nullptr ? *params : none;
  const double scale =
      p.has_scale != 0 ? static_cast<double>(p.scale) : 1.0 / std::sqrt(static_cast<double>(d));
  const double softcap = static_cast<double>(p.softcap);
  const int64_t full[4] = {batch, heads, lq, lk};
  const MaskView mv = make_mask_view(p.mask, full);
  const bool bool_mask = mv.t != nullptr && mv.t->dtype == MHA_DTYPE_BOOL;
  const bool additive_mask = mv.t != nullptr && !bool_mask;
  const double drop_p = static_cast<double>(p.dropout_p);
  const double keep_scale = 1.0 / (1.0 - drop_p);

  BackwardReference ref;
  ref.dq.assign(static_cast<size_t>(batch * heads * lq * d), 0.0);
  ref.dk.assign(static_cast<size_t>(batch * kv_heads * lk * d), 0.0);
  ref.dv.assign(static_cast<size_t>(batch * kv_heads * lk * dv), 0.0);
  if (p.sinks != nullptr) ref.dsinks.assign(static_cast<size_t>(heads), 0.0);
  if (want_dlogit) ref.dlogit.assign(static_cast<size_t>(batch * heads * lq * lk), 0.0);

  std::vector<double> logit(static_cast<size_t>(lk)), slope(static_cast<size_t>(lk));
  std::vector<double> weight(static_cast<size_t>(lk)), factor(static_cast<size_t>(lk));
  std::vector<double> dp(static_cast<size_t>(lk)), dp_products(static_cast<size_t>(lk));
  std::vector<char> takes_part(static_cast<size_t>(lk));
  // Sums of the terms' magnitudes, per element of dq, dk, dv, dsinks.
  std::vector<double> mq(ref.dq.size(), 0.0), mk(ref.dk.size(), 0.0), mv_(ref.dv.size(), 0.0);
  std::vector<double> msinks(static_cast<size_t>(heads), 0.0);
  // The same with dP counted by its products' magnitudes (product_terms_*).
  std::vector<double> pq(ref.dq.size(), 0.0), pk(ref.dk.size(), 0.0);
  std::vector<double> psinks(static_cast<size_t>(heads), 0.0);
  // With input_errors: first-order bounds per element of dq, dk, dv, dsinks
  // (reference_backward.h), and per key of a row: δs, δx, δP, δdP.
  const InputErrors* errs = input_errors;
  std::vector<double> eq, ek, ev, esinks;
  std::vector<double> s_err(static_cast<size_t>(lk)), x_err(static_cast<size_t>(lk));
  std::vector<double> p_err(static_cast<size_t>(lk)), dp_err(static_cast<size_t>(lk));
  if (errs != nullptr) {
    eq.assign(ref.dq.size(), 0.0);
    ek.assign(ref.dk.size(), 0.0);
    ev.assign(ref.dv.size(), 0.0);
    esinks.assign(static_cast<size_t>(heads), 0.0);
  }
  const auto q_err = [&](int64_t b, int64_t h, int64_t i, int64_t c) {
    return errs->q[static_cast<size_t>(((b * heads + h) * lq + i) * d + c)];
  };
  const auto k_err = [&](int64_t b, int64_t h, int64_t j, int64_t c) {
    return errs->k[static_cast<size_t>(((b * kv_heads + h) * lk + j) * d + c)];
  };
  const auto v_err = [&](int64_t b, int64_t h, int64_t j, int64_t c) {
    return errs->v[static_cast<size_t>(((b * kv_heads + h) * lk + j) * dv + c)];
  };
  const auto dout_err = [&](int64_t b, int64_t h, int64_t i, int64_t c) {
    return errs->dout[static_cast<size_t>(((b * heads + h) * lq + i) * dv + c)];
  };
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t hk = h / group;
      const double sink = p.sinks == nullptr ? -kInf
                                             : static_cast<double>(static_cast<const float*>(
                                                   p.sinks->data)[h * p.sinks->strides[0]]);
      double alibi_slope = 0.0;
      if (p.alibi_slopes != nullptr) {
        const mha_tensor& s = *p.alibi_slopes;
        alibi_slope = static_cast<double>(static_cast<const float*>(
            s.data)[(s.ndim == 2 ? b * s.strides[0] : 0) + h * s.strides[s.ndim - 1]]);
      }
      for (int64_t i = 0; i < lq; ++i) {
        // Which keys take part, and their logits.
        const int64_t diagonal = i + lk - lq;
        double row_max = sink;
        for (int64_t j = 0; j < lk; ++j) {
          bool part = true;
          if (p.window_left >= 0) part = part && j >= diagonal - p.window_left;
          if (p.window_right >= 0) part = part && j <= diagonal + p.window_right;
          if (p.causal == MHA_CAUSAL_TOP_LEFT) part = part && j <= i;
          if (p.causal == MHA_CAUSAL_BOTTOM_RIGHT) part = part && j <= diagonal;
          if (p.valid_lens != nullptr) part = part && j < valid_length(p.valid_lens, b, i);
          const int64_t m =
              b * mv.strides[0] + h * mv.strides[1] + i * mv.strides[2] + j * mv.strides[3];
          if (bool_mask) part = part && static_cast<const uint8_t*>(mv.t->data)[m] != 0;
          double x = 0;
          for (int64_t c = 0; c < d; ++c) x += at4(q, b, h, i, c) * at4(k, b, hk, j, c);
          x *= scale;
          double dx = scale;
          if (softcap > 0) {
            const double c = std::cosh(x / softcap);
            x = softcap * std::tanh(x / softcap);
            dx /= c * c;  // 1 - tanh² without its cancellation near saturation
          }
          if (errs != nullptr) {
            double e = 0;
            for (int64_t c = 0; c < d; ++c) {
              e += q_err(b, h, i, c) * std::fabs(at4(k, b, hk, j, c)) +
                   std::fabs(at4(q, b, h, i, c)) * k_err(b, hk, j, c);
            }
            s_err[static_cast<size_t>(j)] = e;
            x_err[static_cast<size_t>(j)] = std::fabs(dx) * e;
          }
          x -= alibi_slope * static_cast<double>(std::llabs(diagonal - j));
          if (additive_mask) x += value_at(*mv.t, m);
          if (x == -kInf) part = false;
          takes_part[static_cast<size_t>(j)] = part ? 1 : 0;
          logit[static_cast<size_t>(j)] = x;
          slope[static_cast<size_t>(j)] = dx;
          if (part) {
            row_max = std::max(row_max, x);
            ref.max_abs_logit = std::max(ref.max_abs_logit, std::fabs(x));
          }
        }
        if (row_max == -kInf) continue;  // no key, no sink: zero gradients
        double sum = sink == -kInf ? 0.0 : std::exp(sink - row_max);
        for (int64_t j = 0; j < lk; ++j) {
          const auto u = static_cast<size_t>(j);
          weight[u] = takes_part[u] != 0 ? std::exp(logit[u] - row_max) : 0.0;
          sum += weight[u];
        }
        // delta = Σ_j P_j Z_j dP_j = dO · out.
        double delta = 0, delta_terms = 0, delta_products = 0;
        for (int64_t j = 0; j < lk; ++j) {
          const auto u = static_cast<size_t>(j);
          weight[u] /= sum;
          factor[u] =
              drop_p > 0 && reference_dropped(p.dropout_seed, p.dropout_p, b, h, i, j, heads, lq)
                  ? 0.0
                  : (drop_p > 0 ? keep_scale : 1.0);
          dp[u] = 0;
          dp_products[u] = 0;
          if (weight[u] == 0) continue;
          for (int64_t c = 0; c < dv; ++c) {
            const double product = at4(dout, b, h, i, c) * at4(v, b, hk, j, c);
            dp[u] += product;
            dp_products[u] += std::fabs(product);
          }
          delta += weight[u] * factor[u] * dp[u];
          delta_terms += std::fabs(weight[u] * factor[u] * dp[u]);
          delta_products += weight[u] * factor[u] * dp_products[u];
        }
        // The inputs' errors, to first order: weights, dP and delta.
        double x_err_mean = 0, delta_err = 0;
        if (errs != nullptr) {
          for (int64_t j = 0; j < lk; ++j) {
            const auto u = static_cast<size_t>(j);
            if (weight[u] != 0) x_err_mean += weight[u] * x_err[u];
          }
          for (int64_t j = 0; j < lk; ++j) {
            const auto u = static_cast<size_t>(j);
            p_err[u] = weight[u] * (x_err[u] + x_err_mean);
            dp_err[u] = 0;
            if (weight[u] == 0) continue;
            for (int64_t c = 0; c < dv; ++c) {
              dp_err[u] += dout_err(b, h, i, c) * std::fabs(at4(v, b, hk, j, c)) +
                           std::fabs(at4(dout, b, h, i, c)) * v_err(b, hk, j, c);
            }
            delta_err += factor[u] * (p_err[u] * std::fabs(dp[u]) + weight[u] * dp_err[u]);
          }
          if (out != nullptr) {
            delta_err = 0;
            for (int64_t c = 0; c < dv; ++c)
              delta_err += dout_err(b, h, i, c) * std::fabs(at4(*out, b, h, i, c));
          }
        }
        if (out != nullptr) {  // the backward's delta: dout · the out it is given
          double given = 0, given_terms = 0;
          for (int64_t c = 0; c < dv; ++c) {
            given += at4(dout, b, h, i, c) * at4(*out, b, h, i, c);
            given_terms += std::fabs(at4(dout, b, h, i, c) * at4(*out, b, h, i, c));
          }
          delta = given;
          delta_terms = std::max(delta_terms, given_terms);
          delta_products = std::max(delta_products, given_terms);
        }
        if (!ref.dsinks.empty() && sink != -kInf) {
          const double p_sink = std::exp(sink - row_max) / sum;
          ref.dsinks[static_cast<size_t>(h)] -= p_sink * delta;
          msinks[static_cast<size_t>(h)] += p_sink * delta_terms;
          psinks[static_cast<size_t>(h)] += p_sink * delta_products;
          if (errs != nullptr) {
            esinks[static_cast<size_t>(h)] +=
                p_sink * x_err_mean * std::fabs(delta) + p_sink * delta_err;
          }
        }
        for (int64_t j = 0; j < lk; ++j) {
          const auto u = static_cast<size_t>(j);
          if (weight[u] == 0) continue;
          const double ds = weight[u] * (factor[u] * dp[u] - delta);
          const double ds_terms = weight[u] * (std::fabs(factor[u] * dp[u]) + delta_terms);
          if (want_dlogit)
            ref.dlogit[static_cast<size_t>(((b * heads + h) * lq + i) * lk + j)] = ds;
          ref.terms_dlogit = std::max(ref.terms_dlogit, ds_terms);
          const double dscore = ds * slope[u];
          const double dscore_terms = ds_terms * std::fabs(slope[u]);
          const double dscore_products =
              weight[u] * (factor[u] * dp_products[u] + delta_products) * std::fabs(slope[u]);
          double dscore_err = 0;
          if (errs != nullptr) {
            const double ds_err = p_err[u] * std::fabs(factor[u] * dp[u] - delta) +
                                  weight[u] * (factor[u] * dp_err[u] + delta_err);
            const double slope_err = softcap > 0 ? scale * scale / softcap * s_err[u] : 0.0;
            dscore_err = ds_err * std::fabs(slope[u]) + std::fabs(ds) * slope_err;
          }
          for (int64_t c = 0; c < d; ++c) {
            const auto qi = static_cast<size_t>(((b * heads + h) * lq + i) * d + c);
            const auto kj = static_cast<size_t>(((b * kv_heads + hk) * lk + j) * d + c);
            ref.dq[qi] += dscore * at4(k, b, hk, j, c);
            mq[qi] += dscore_terms * std::fabs(at4(k, b, hk, j, c));
            pq[qi] += dscore_products * std::fabs(at4(k, b, hk, j, c));
            ref.dk[kj] += dscore * at4(q, b, h, i, c);
            mk[kj] += dscore_terms * std::fabs(at4(q, b, h, i, c));
            pk[kj] += dscore_products * std::fabs(at4(q, b, h, i, c));
            if (errs != nullptr) {
              eq[qi] += dscore_err * std::fabs(at4(k, b, hk, j, c)) +
                        std::fabs(dscore) * k_err(b, hk, j, c);
              ek[kj] += dscore_err * std::fabs(at4(q, b, h, i, c)) +
                        std::fabs(dscore) * q_err(b, h, i, c);
            }
          }
          for (int64_t c = 0; c < dv; ++c) {
            const auto vj = static_cast<size_t>(((b * kv_heads + hk) * lk + j) * dv + c);
            ref.dv[vj] += weight[u] * factor[u] * at4(dout, b, h, i, c);
            mv_[vj] += std::fabs(weight[u] * factor[u] * at4(dout, b, h, i, c));
            if (errs != nullptr) {
              ev[vj] += factor[u] * (p_err[u] * std::fabs(at4(dout, b, h, i, c)) +
                                     weight[u] * dout_err(b, h, i, c));
            }
          }
        }
      }
    }
  }
  ref.terms_dq = max_abs(mq);
  ref.terms_dk = max_abs(mk);
  ref.terms_dv = max_abs(mv_);
  ref.terms_dsinks = max_abs(msinks);
  ref.product_terms_dq = max_abs(pq);
  ref.product_terms_dk = max_abs(pk);
  ref.product_terms_dv = ref.terms_dv;  // dv = Σ P Z dO takes no dP
  ref.product_terms_dsinks = max_abs(psinks);
  ref.propagated_dq = std::move(eq);
  ref.propagated_dk = std::move(ek);
  ref.propagated_dv = std::move(ev);
  ref.propagated_dsinks = std::move(esinks);
  return ref;
}

double gradient_tolerance(const std::vector<double>& ref, double terms, double max_abs_logit) {
  return 2e-5 * max_abs(ref) + std::ldexp(terms, -18) +
         8.0 * std::ldexp(max_abs_logit, -24) * terms;
}

double gradient_error(const mha_tensor& got, const std::vector<double>& want, double terms,
                      double max_abs_logit, double underflow) {
  const double e = gradient_tolerance(want, terms, max_abs_logit) + underflow;
  const double u = got.dtype == MHA_DTYPE_BF16  ? std::ldexp(1.0, -8)
                   : got.dtype == MHA_DTYPE_F16 ? std::ldexp(1.0, -11)
                                                : 0.0;
  const double floor = got.dtype == MHA_DTYPE_BF16  ? std::ldexp(1.0, -134)
                       : got.dtype == MHA_DTYPE_F16 ? std::ldexp(1.0, -25)
                                                    : 0.0;
  // Where rounding to nearest gives infinity: the largest finite value plus
  // half an ulp (65504 + 16 for f16, (2 - 2^-8) · 2^127 for bf16, 2^128 for f32).
  const double overflow = got.dtype == MHA_DTYPE_BF16  ? std::ldexp(2.0 - std::ldexp(1.0, -8), 127)
                          : got.dtype == MHA_DTYPE_F16 ? 65520.0
                                                       : std::ldexp(1.0, 128);
  double worst = 0;
  int64_t n = 0;
  for (int64_t a = 0; a < got.shape[0]; ++a) {
    for (int64_t b = 0; b < got.shape[1]; ++b) {
      for (int64_t c = 0; c < got.shape[2]; ++c) {
        for (int64_t x = 0; x < got.shape[3]; ++x, ++n) {
          const double ref = want[static_cast<size_t>(n)];
          const double value = at4(got, a, b, c, x);
          const double tolerance = e + u * (std::fabs(ref) + e) + floor;
          // A value whose fp32 result may reach the dtype's overflow
          // threshold rounds to an infinity of its sign.
          if (std::isinf(value) && std::fabs(ref) + e >= overflow && (value > 0) == (ref > 0)) {
            continue;
          }
          const double error = std::fabs(value - ref);
          if (std::isnan(error)) return kInf;
          // (0 / 0: an exact 0 where nothing may be off.)
          if (error > 0) worst = std::max(worst, error / tolerance);
        }
      }
    }
  }
  return worst;
}

double max_abs(const std::vector<double>& values) {
  double m = 0;
  for (double x : values) m = std::max(m, std::fabs(x));
  return m;
}

double max_abs_diff(const mha_tensor& got, const std::vector<double>& want) {
  double worst = 0;
  int64_t n = 0;
  for (int64_t a = 0; a < got.shape[0]; ++a) {
    for (int64_t b = 0; b < got.shape[1]; ++b) {
      for (int64_t c = 0; c < got.shape[2]; ++c) {
        for (int64_t e = 0; e < got.shape[3]; ++e, ++n) {
          const double x = at4(got, a, b, c, e);
          const double diff = std::fabs(x - want[static_cast<size_t>(n)]);
          worst = std::isnan(diff) ? kInf : std::max(worst, diff);
        }
      }
    }
  }
  return worst;
}

}  // namespace mha_test
