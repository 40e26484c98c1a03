// The float64 reference of the module and its error bounds (see the header).
// It calls no mha function: only the header's types.
#include "module_reference.h"

#include "reference_access.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace mha_test {
namespace {

using reference_access::at3;

constexpr double kU = 1.0 / 16777216.0;  // 2^-24: fp32's unit roundoff
constexpr double kLambda = 4.0;
constexpr double kKernelTolerance =
    1e-5;  // docs/decisions.md: the attention kernels' relative tolerance
constexpr double kInf = std::numeric_limits<double>::infinity();

double dot_bound(int64_t k) {
  return kLambda * std::sqrt(static_cast<double>(k)) * kU;
}

void require(bool condition, const std::string& what) {
  if (!condition) throw std::invalid_argument("reference_module: " + what);
}

double f32_at(const mha_tensor& t, int64_t offset) {
  return static_cast<double>(static_cast<const float*>(t.data)[offset]);
}

// x rounded to `dtype` as mha rounds an fp32 sum: to fp32, then to nearest
// even in BF16 (8 significant bits, exponents from -126) or F16 (11 bits,
// from -14, at most 65504), written here from the formats' definitions.
double round_to(double x, int32_t dtype) {
  x = static_cast<double>(static_cast<float>(x));
  if (x == 0.0 || !std::isfinite(x)) return x;
  const bool f16 = dtype == MHA_DTYPE_F16;
  const int bits = f16 ? 11 : 8, min_exponent = f16 ? -14 : -126;
  int e = 0;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const double quantum = std::ldexp(1.0, std::max(e - 1, min_exponent) - (bits - 1));
  const double r = std::nearbyint(x / quantum) * quantum;  // to nearest even
  return f16 && std::fabs(r) > 65504.0 ? std::copysign(kInf, x) : r;
}

// y (within `bound` of what mha computes) rounded to dtype, and the bound of
// the rounded value (ModuleInputs::activations).
void round_with_bound(double& y, double& bound, int32_t dtype) {
  const double lo = round_to(y - bound, dtype), hi = round_to(y + bound, dtype);
  y = round_to(y, dtype);
  bound = lo == hi ? 0.0 : std::max(hi - y, y - lo);
}

// A projection: y[b, l, e] = Σ_k x[b, l, k]·w[e, k] + bias[e], with its bound.
struct Projected {
  int64_t batch = 0, len = 0, width = 0;
  std::vector<double> y, bound;  // [B, L, E]
  double at(int64_t b, int64_t l, int64_t e) const {
    return y[static_cast<size_t>((b * len + l) * width + e)];
  }
  double err(int64_t b, int64_t l, int64_t e) const {
    return bound[static_cast<size_t>((b * len + l) * width + e)];
  }
};

Projected project(const mha_tensor& x, const std::vector<double>& w,
                  const std::vector<double>& bias, int64_t e_dim) {
  Projected p;
  p.batch = x.shape[0];
  p.len = x.shape[1];
  p.width = e_dim;
  const int64_t k_dim = x.shape[2];
  p.y.resize(static_cast<size_t>(p.batch * p.len * e_dim));
  p.bound.resize(p.y.size());
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t l = 0; l < p.len; ++l)
      for (int64_t e = 0; e < e_dim; ++e) {
        double sum = bias[static_cast<size_t>(e)], abs_sum = std::fabs(sum);
        for (int64_t k = 0; k < k_dim; ++k) {
          const double term = at3(x, b, l, k) * w[static_cast<size_t>(e * k_dim + k)];
          sum += term;
          abs_sum += std::fabs(term);
        }
        const size_t n = static_cast<size_t>((b * p.len + l) * e_dim + e);
        p.y[n] = sum;
        p.bound[n] = dot_bound(k_dim) * abs_sum + kU * std::fabs(sum);
      }
  return p;
}

int64_t valid_length(const mha_tensor* vl, int64_t b, int64_t i) {
  const int64_t offset = b * vl->strides[0] + (vl->ndim == 2 ? i * vl->strides[1] : 0);
  if (vl->dtype == MHA_DTYPE_I64) return static_cast<const int64_t*>(vl->data)[offset];
  return static_cast<const int32_t*>(vl->data)[offset];
}

}  // namespace

// PyTorch's masks at (b, h, i, j): false when a bool mask says "not allowed";
// *add gets the f32 masks' sum.
bool pytorch_masks_allow(const ModuleInputs& in, int64_t heads, int64_t b, int64_t h, int64_t i,
                         int64_t j, double* add) {
  *add = 0.0;
  if (const mha_tensor* kpm = in.key_padding_mask; kpm != nullptr) {
    const int64_t offset = b * kpm->strides[0] + j * kpm->strides[1];
    if (kpm->dtype == MHA_DTYPE_BOOL) {
      if (static_cast<const uint8_t*>(kpm->data)[offset] != 0) return false;
    } else {
      *add += f32_at(*kpm, offset);
    }
  }
  if (const mha_tensor* am = in.attn_mask; am != nullptr) {
    const int64_t offset =
        am->ndim == 2 ? i * am->strides[0] + j * am->strides[1]
                      : (b * heads + h) * am->strides[0] + i * am->strides[1] + j * am->strides[2];
    if (am->dtype == MHA_DTYPE_BOOL) {
      if (static_cast<const uint8_t*>(am->data)[offset] != 0) return false;
    } else {
      *add += f32_at(*am, offset);
    }
  }
  return true;
}

ModuleReference reference_module(const ModuleWeights& w, const ModuleInputs& in) {
  require(in.query != nullptr && in.key != nullptr && in.value != nullptr, "missing input");
  const mha_tensor& q_in = *in.query;
  const mha_tensor& k_in = *in.key;
  const mha_tensor& v_in = *in.value;
  for (const mha_tensor* t : {in.query, in.key, in.value}) {
    require(t->ndim == 3 && t->dtype == MHA_DTYPE_F32 && t->data != nullptr, "inputs: F32 rank 3");
  }
  const int64_t e_dim = w.embed_dim, heads = w.num_heads, d = e_dim / heads;
  const int64_t batch = q_in.shape[0], lq = q_in.shape[1], lk = k_in.shape[1];
  require(
      q_in.shape[2] == w.query_dim && k_in.shape[2] == w.key_dim && v_in.shape[2] == w.value_dim,
      "feature sizes");
  require(k_in.shape[0] == batch && v_in.shape[0] == batch && v_in.shape[1] == lk, "shapes");
  require(in.dropout_p >= 0.0 && in.dropout_p < 1.0, "dropout");
  require(in.window_left >= -1 && in.window_right >= -1, "window sides are -1 or >= 0");
  require(in.softcap >= 0.0 && std::isfinite(in.softcap), "softcap");
  if (const mha_tensor* t = in.sinks; t != nullptr) {
    require(t->ndim == 1 && t->dtype == MHA_DTYPE_F32 && t->shape[0] == w.num_heads,
            "sinks: F32 [H]");
  }
  if (const mha_tensor* t = in.alibi_slopes; t != nullptr) {
    require((t->ndim == 1 || (t->ndim == 2 && t->shape[0] == q_in.shape[0])) &&
                t->dtype == MHA_DTYPE_F32 && t->shape[t->ndim - 1] == w.num_heads,
            "alibi_slopes: F32 [H] or [B, H]");
  }
  // Head h's sink (-inf: none) and ALiBi slope of batch b (0: none).
  const auto sink_of = [&in](int64_t h) {
    return in.sinks == nullptr ? -kInf : f32_at(*in.sinks, h * in.sinks->strides[0]);
  };
  const auto slope_of = [&in](int64_t b, int64_t h) {
    const mha_tensor* t = in.alibi_slopes;
    if (t == nullptr) return 0.0;
    return f32_at(*t, (t->ndim == 2 ? b * t->strides[0] : 0) + h * t->strides[t->ndim - 1]);
  };

  require(in.activations == MHA_DTYPE_F32 || in.activations == MHA_DTYPE_BF16 ||
              in.activations == MHA_DTYPE_F16,
          "activations: F32, BF16 or F16");
  const bool rounded = in.activations != MHA_DTYPE_F32;
  Projected q = project(q_in, w.w_q, w.b_q, e_dim);
  Projected k = project(k_in, w.w_k, w.b_k, e_dim);
  Projected v = project(v_in, w.w_v, w.b_v, e_dim);
  if (rounded) {
    for (Projected* p : {&q, &k, &v}) {
      for (size_t n = 0; n < p->y.size(); ++n)
        round_with_bound(p->y[n], p->bound[n], in.activations);
    }
  }
  // P rounded for P·V: its relative error.
  const double p_rounding = in.activations == MHA_DTYPE_BF16  ? std::ldexp(1.0, -8)
                            : in.activations == MHA_DTYPE_F16 ? std::ldexp(1.0, -11)
                                                              : 0.0;

  ModuleReference ref;
  ref.batch = batch;
  ref.heads = heads;
  ref.lq = lq;
  ref.lk = lk;
  ref.embed_dim = e_dim;
  const size_t weights_count = static_cast<size_t>(batch * heads * lq * lk);
  ref.weights.assign(weights_count, 0.0);
  ref.weights_bound.assign(weights_count, 0.0);
  ref.weights_before_dropout.assign(weights_count, 0.0);
  ref.sink_share.assign(static_cast<size_t>(batch * heads * lq), 0.0);

  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const double keep_scale = 1.0 / (1.0 - in.dropout_p);
  const auto p_float = static_cast<float>(in.dropout_p);

  // Attention outputs per head (the concatenation), with bounds; the kernel
  // tolerance term, which needs max |o|, is added afterwards.
  std::vector<double> concat(static_cast<size_t>(batch * lq * e_dim), 0.0);
  std::vector<double> concat_bound(concat.size(), 0.0);
  std::vector<double> logit(static_cast<size_t>(lk)), logit_err(static_cast<size_t>(lk));
  std::vector<char> used(static_cast<size_t>(lk));
  double max_abs_o = 0.0;

  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < lq; ++i) {
        // The keys of the row: the sliding window (aligned to the bottom-right
        // corner: i + Lk - Lq - left <= j <= i + Lk - Lq + right), the causal
        // rule, the valid length; the masks below remove more.
        const int64_t diagonal = i + lk - lq;  // the bottom-right-aligned diagonal's key
        int64_t end = lk;
        if (in.causal == MHA_CAUSAL_TOP_LEFT) end = std::min(end, i + 1);
        if (in.causal == MHA_CAUSAL_BOTTOM_RIGHT)
          end = std::min(end, std::max<int64_t>(0, diagonal + 1));
        if (in.valid_lens != nullptr) end = std::min(end, valid_length(in.valid_lens, b, i));
        // (A side wider than Lk + Lq cuts nothing; clamped, no huge value overflows.)
        if (in.window_right >= 0) {
          end = std::min(end,
                         std::max<int64_t>(0, diagonal + std::min(in.window_right, lk + lq) + 1));
        }
        const int64_t begin =
            in.window_left >= 0 ? std::max<int64_t>(0, diagonal - std::min(in.window_left, lk + lq))
                                : 0;
        const double slope = slope_of(b, h);
        double row_max = -kInf;
        bool any = false;
        for (int64_t j = 0; j < lk; ++j) {
          used[static_cast<size_t>(j)] = 0;
          double add = 0.0;
          if (j < begin || j >= end || !pytorch_masks_allow(in, heads, b, h, i, j, &add)) continue;
          double dot = 0.0, abs_dot = 0.0, prop = 0.0;
          for (int64_t c = 0; c < d; ++c) {
            const int64_t e = h * d + c;
            const double qe = q.at(b, i, e), ke = k.at(b, j, e);
            dot += qe * ke;
            abs_dot += std::fabs(qe * ke);
            prop += q.err(b, i, e) * std::fabs(ke) + std::fabs(qe) * k.err(b, j, e);
          }
          const double x = scale * dot;
          double err = scale * prop + scale * dot_bound(d) * abs_dot;
          // Softcap, then ALiBi, then the masks' terms (see the header's bound).
          double capped = x;
          if (in.softcap > 0.0) {
            const double t = std::tanh(x / in.softcap);
            capped = in.softcap * t;
            err = (1.0 - t * t) * (err + 4.0 * kU * std::fabs(x)) + 6.0 * kU * std::fabs(capped);
          }
          double bias = 0.0;
          if (in.alibi_slopes != nullptr) {
            bias = -slope * static_cast<double>(std::llabs(diagonal - j));
            err += 4.0 * kU * (std::fabs(capped) + std::fabs(bias));
          }
          const double s = capped + bias + add;
          if (s == -kInf) continue;
          used[static_cast<size_t>(j)] = 1;
          any = true;
          logit[static_cast<size_t>(j)] = s;
          logit_err[static_cast<size_t>(j)] = err + 4.0 * kU * std::fabs(s);
          row_max = std::max(row_max, s);
        }
        const size_t row = static_cast<size_t>(((b * heads + h) * lq + i) * lk);
        if (!any) {
          ++ref.dead_rows;
          continue;  // weights and output 0, exactly (a sink or not)
        }
        // The sink: one more term of the denominator, without a value row.
        const double sink = sink_of(h);
        row_max = std::max(row_max, sink);
        double sum = sink == -kInf ? 0.0 : std::exp(sink - row_max);
        for (int64_t j = 0; j < lk; ++j) {
          if (used[static_cast<size_t>(j)])
            sum += std::exp(logit[static_cast<size_t>(j)] - row_max);
        }
        const double p_sink = sink == -kInf ? 0.0 : std::exp(sink - row_max) / sum;
        ref.sink_share[row / static_cast<size_t>(lk)] = p_sink;
        const double sink_term =
            p_sink == 0.0 ? 0.0 : 2.0 * kU * p_sink * (1.0 + std::fabs(sink - row_max));
        double mean_err = 0.0;  // Σ p_k |δs_k|
        for (int64_t j = 0; j < lk; ++j) {
          if (!used[static_cast<size_t>(j)]) continue;
          const double p = std::exp(logit[static_cast<size_t>(j)] - row_max) / sum;
          ref.weights_before_dropout[row + static_cast<size_t>(j)] = p;
          mean_err += p * logit_err[static_cast<size_t>(j)];
        }
        // δp before dropout, then the weights after it.
        std::vector<double> p_err(static_cast<size_t>(lk), 0.0);
        for (int64_t j = 0; j < lk; ++j) {
          if (!used[static_cast<size_t>(j)]) continue;
          const double p = ref.weights_before_dropout[row + static_cast<size_t>(j)];
          p_err[static_cast<size_t>(j)] =
              p * (logit_err[static_cast<size_t>(j)] + mean_err) +
              p * kU * (4.0 + 2.0 * std::fabs(logit[static_cast<size_t>(j)] - row_max)) +
              p * sink_term;
          const bool dropped = in.dropout_p > 0.0 &&
                               reference_dropped(in.dropout_seed, p_float, b, h, i, j, heads, lq);
          const double kappa = dropped ? 0.0 : (in.dropout_p > 0.0 ? keep_scale : 1.0);
          ref.weights[row + static_cast<size_t>(j)] = kappa * p;
          ref.weights_bound[row + static_cast<size_t>(j)] =
              kappa * p_err[static_cast<size_t>(j)] + kU * kappa * p;
          p_err[static_cast<size_t>(j)] *= kappa;  // now κ_j·δp_j
        }
        for (int64_t c = 0; c < d; ++c) {
          const int64_t e = h * d + c;
          double o = 0.0, abs_o = 0.0, err = 0.0;
          for (int64_t j = 0; j < lk; ++j) {
            const double pt = ref.weights[row + static_cast<size_t>(j)];
            if (!used[static_cast<size_t>(j)]) continue;
            const double ve = v.at(b, j, e);
            o += pt * ve;
            abs_o += std::fabs(pt * ve);
            err += pt * v.err(b, j, e) + p_err[static_cast<size_t>(j)] * std::fabs(ve);
          }
          const size_t n = static_cast<size_t>((b * lq + i) * e_dim + e);
          concat[n] = o;
          // The sum over the keys, and the softmax denominator's (a relative error).
          concat_bound[n] = err + dot_bound(lk) * (abs_o + std::fabs(o)) + p_rounding * abs_o;
          max_abs_o = std::max(max_abs_o, std::fabs(o));
        }
      }
    }
  }
  const double kernel_term = kKernelTolerance * std::max(1.0, max_abs_o);
  for (double& bound : concat_bound) bound += kernel_term;
  if (rounded) {
    for (size_t n = 0; n < concat.size(); ++n) {
      round_with_bound(concat[n], concat_bound[n], in.activations);
    }
  }

  // out = concat · W_oᵀ + b_o
  ref.out.assign(static_cast<size_t>(batch * lq * e_dim), 0.0);
  ref.out_bound.assign(ref.out.size(), 0.0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t n = 0; n < e_dim; ++n) {
        double sum = w.b_o[static_cast<size_t>(n)], abs_sum = std::fabs(sum), err = 0.0;
        for (int64_t e = 0; e < e_dim; ++e) {
          const size_t at = static_cast<size_t>((b * lq + i) * e_dim + e);
          const double wo = w.w_o[static_cast<size_t>(n * e_dim + e)];
          sum += concat[at] * wo;
          abs_sum += std::fabs(concat[at] * wo);
          err += concat_bound[at] * std::fabs(wo);
        }
        const size_t at = static_cast<size_t>((b * lq + i) * e_dim + n);
        ref.out[at] = sum;
        ref.out_bound[at] = err + dot_bound(e_dim) * abs_sum + kU * std::fabs(sum);
      }

  // The mean over heads.
  ref.average.assign(static_cast<size_t>(batch * lq * lk), 0.0);
  ref.average_bound.assign(ref.average.size(), 0.0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j) {
        double sum = 0.0, err = 0.0;
        for (int64_t h = 0; h < heads; ++h) {
          const size_t at = static_cast<size_t>(((b * heads + h) * lq + i) * lk + j);
          sum += ref.weights[at];
          err += ref.weights_bound[at];
        }
        const size_t at = static_cast<size_t>((b * lq + i) * lk + j);
        ref.average[at] = sum / static_cast<double>(heads);
        ref.average_bound[at] = err / static_cast<double>(heads) +
                                dot_bound(heads) * ref.average[at] + kU * ref.average[at];
      }
  ref.concat = std::move(concat);
  ref.concat_bound = std::move(concat_bound);
  return ref;
}

BoundCheck check_within(const mha_tensor& got, const std::vector<double>& want,
                        const std::vector<double>& bound) {
  BoundCheck result;
  int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  int64_t count = 1;
  for (int32_t dim = 0; dim < got.ndim; ++dim) {
    shape[4 - got.ndim + dim] = got.shape[dim];
    strides[4 - got.ndim + dim] = got.strides[dim];
    count *= got.shape[dim];
  }
  if (got.dtype != MHA_DTYPE_F32 || static_cast<size_t>(count) != want.size() ||
      want.size() != bound.size()) {
    result.outside = 1;
    result.first = "the tensor does not match the reference's shape";
    return result;
  }
  int64_t n = 0;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t e = 0; e < shape[3]; ++e, ++n) {
          const double g =
              f32_at(got, a * strides[0] + b * strides[1] + c * strides[2] + e * strides[3]);
          const double ref = want[static_cast<size_t>(n)];
          const double tol = bound[static_cast<size_t>(n)];
          const double error = std::fabs(g - ref);
          ++result.elements;
          const bool good = error <= tol;  // false for NaN
          const double ratio = error == 0.0 ? 0.0 : (tol > 0.0 ? error / tol : kInf);
          if (!std::isnan(ratio)) result.worst_ratio = std::max(result.worst_ratio, ratio);
          if (!good) {
            if (result.outside++ == 0) {
              std::ostringstream os;
              os.precision(9);
              os << "element " << n << " [" << a << "," << b << "," << c << "," << e
                 << "] (right-aligned to rank 4) = " << g << ", reference " << ref << ", bound "
                 << tol;
              result.first = os.str();
            }
            if (std::isnan(error)) result.worst_ratio = kInf;
          }
        }
  return result;
}

}  // namespace mha_test
