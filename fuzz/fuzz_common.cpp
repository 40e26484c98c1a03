// The attention fuzzer's shared helpers (fuzz_common.h).
#include "fuzz_common.h"

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace mha_fuzz {
namespace {

std::string g_case;  // a description of the current case, for reports

// MHA_FUZZ_TRACE set: each case's description on stderr as it is drawn, one
// line per case -- which cases an input reaches (how the seeds of a new case
// are chosen), and what a case was when a sanitizer stops it halfway (its
// report cannot print g_case: libFuzzer keeps the death callback).
bool tracing() {
  static const bool on = std::getenv("MHA_FUZZ_TRACE") != nullptr;
  return on;
}

// ------------------------------------------------------------------ the backend

const std::vector<std::string>& usable_backends() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> list;
    // The backend queries take an index only: each index, in range or not,
    // once per process (mha_backend_get_decode_streams: >= 1 for a usable
    // backend, 0 otherwise; mha_backend_get_bf16_dot: 0, 1 or 2 (2 only with
    // amx-bf16 among the CPU features), 0 for a backend that is not usable;
    // mha_backend_get_tiles: positive prefill tiles for
    // a usable backend, all 0 otherwise; both an error naming the index
    // outside the range, their output untouched).
    const int32_t count = mha_backend_count();
    // 2 (AMX tiles) only where the runtime found them usable.
    const char* features = mha_cpu_features();
    const bool amx =
        (" " + std::string(features != nullptr ? features : "") + " ").find(" amx-bf16 ") !=
        std::string::npos;
    for (int32_t i = -1; i <= count; ++i) {
      int32_t streams = -7;
      mha_backend_info info{};
      const bool in_range = i >= 0 && i < count;
      const mha_status status = mha_backend_get_decode_streams(i, &streams);
      const bool usable = in_range && mha_backend_get_info(i, &info) == MHA_OK && info.usable != 0;
      if (in_range ? status != MHA_OK || (usable ? streams < 1 : streams != 0)
                   : status != MHA_ERR_INVALID_VALUE || streams != -7) {
        finding("mha_backend_get_decode_streams(" + std::to_string(i) + ") gave status " +
                std::to_string(status) + ", streams " + std::to_string(streams));
      }
      int32_t bf16_dot = -7;
      const mha_status dot_status = mha_backend_get_bf16_dot(i, &bf16_dot);
      if (in_range ? dot_status != MHA_OK || bf16_dot < 0 || bf16_dot > 2 ||
                         (!usable && bf16_dot) || (bf16_dot == 2 && !amx)
                   : dot_status != MHA_ERR_INVALID_VALUE || bf16_dot != -7) {
        finding("mha_backend_get_bf16_dot(" + std::to_string(i) + ") gave status " +
                std::to_string(dot_status) + ", bf16_dot " + std::to_string(bf16_dot));
      }
      mha_backend_tiles tiles{-7, -7, -7};
      const mha_status tiles_status = mha_backend_get_tiles(i, &tiles);
      const bool all_zero =
          tiles.query_tile == 0 && tiles.key_tile == 0 && tiles.decode_key_tile == 0;
      const bool untouched =
          tiles.query_tile == -7 && tiles.key_tile == -7 && tiles.decode_key_tile == -7;
      const bool chosen = tiles.query_tile > 0 && tiles.key_tile > 0 && tiles.decode_key_tile >= 0;
      bool tiles_right = tiles_status == MHA_OK && (usable ? chosen : all_zero);
      if (!in_range) tiles_right = tiles_status == MHA_ERR_INVALID_VALUE && untouched;
      if (!tiles_right) {
        finding("mha_backend_get_tiles(" + std::to_string(i) + ") gave status " +
                std::to_string(tiles_status) + ", tiles " + std::to_string(tiles.query_tile) +
                " x " + std::to_string(tiles.key_tile) + ", decode " +
                std::to_string(tiles.decode_key_tile));
      }
    }
    for (const auto& b : mha_test::list_backends()) {
      if (b.usable) list.push_back(b.name);
    }
    if (list.empty()) {
      std::fprintf(stderr, "attention_fuzzer: no usable backend\n");
      std::abort();
    }
    return list;
  }();
  return names;
}

void use_backend(const std::string& name) {
  static std::string current;
  if (name == current) return;  // every selection is kept by the runtime: select only changes
  if (mha_select_backend(name.c_str()) != MHA_OK) {
    finding("mha_select_backend(\"" + name + "\") failed: " + mha_last_error());
  }
  current = name;
}

// Whether `got` is `want` within `tol`, NaN for NaN and the same infinity.
bool same_value(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= tol;
}

}  // namespace

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "\n==== attention_fuzzer finding: %s\n     case: %s\n", what.c_str(),
               g_case.c_str());
  std::fflush(stderr);
  std::abort();
}

void begin_case(const std::string& text) {
  g_case = text;
  if (tracing()) std::fprintf(stderr, "case: %s", text.c_str());
}

void end_case() {
  if (tracing()) std::fprintf(stderr, "\n");
}

__attribute__((format(printf, 1, 2))) void note(const char* format, ...) {
  char text[200];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  g_case += text;
  if (tracing()) std::fprintf(stderr, "%s", text);
}

std::string start_case(FuzzedDataProvider& fdp, const char* kind) {
  const auto& backends = usable_backends();
  const std::string& backend = backends[fdp.ConsumeIntegral<uint8_t>() % backends.size()];
  const int32_t threads = fdp.ConsumeIntegralInRange<int32_t>(1, 4);
  use_backend(backend);
  if (mha_set_num_threads(threads) != MHA_OK) finding("mha_set_num_threads failed");
  begin_case(std::string(kind) + "backend " + backend);
  note(" threads %d", threads);
  return backend;
}

// ------------------------------------------------------------------ layouts

Layout make_layout(const int64_t shape[4], int order, int64_t pad, unsigned zero_mask,
                   bool odd_unit_strides) {
  Layout l;
  int64_t running = 1;
  for (int n = 3; n >= 0; --n) {
    const int axis = kOrders[order][n];
    l.shape[axis] = shape[axis];
    l.strides[axis] = running;
    running *= shape[axis] + (n == 3 ? pad : 0);
  }
  for (int axis = 0; axis < 4; ++axis) {
    if (zero_mask & (1u << axis)) l.strides[axis] = 0;
    if (odd_unit_strides && shape[axis] == 1) l.strides[axis] = int64_t{1} << 40;
  }
  l.extent = 1;
  for (int axis = 0; axis < 4; ++axis) {
    if (shape[axis] > 1) l.extent += (shape[axis] - 1) * l.strides[axis];
  }
  return l;
}

mha_tensor describe4(void* data, mha_dtype dtype, const Layout& l) {
  return mha_test::describe(data, dtype, {l.shape[0], l.shape[1], l.shape[2], l.shape[3]},
                            {l.strides[0], l.strides[1], l.strides[2], l.strides[3]});
}

// ------------------------------------------------------------------ values

float special_value(uint8_t which) {
  static const float kSpecials[] = {
      kNaN,   kInf,    -kInf, 0.0f,  -0.0f,
      1e-40f, -3e-39f, 1e3f,  -1e3f, std::numeric_limits<float>::min()};
  return kSpecials[which % (sizeof kSpecials / sizeof kSpecials[0])];
}

bool is_subnormal(float x) {
  return x != 0.0f && std::fabs(x) < std::numeric_limits<float>::min();
}

// ------------------------------------------------------------------ comparisons

void compare(const mha_tensor& out, const float* lse, const int64_t lse_strides[3],
             const Reference& ref, bool lenient_inf, double tol) {
  const int64_t B = ref.batch, H = ref.heads, Lq = ref.lq, Dv = ref.dv;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i) {
        const size_t row = static_cast<size_t>((b * H + h) * Lq + i);
        const bool dead = ref.lse[row] == -kInfD;
        for (int64_t c = 0; c < Dv; ++c) {
          const float got =
              static_cast<const float*>(out.data)[b * out.strides[0] + h * out.strides[1] +
                                                  i * out.strides[2] + c * out.strides[3]];
          const double want = ref.out[row * static_cast<size_t>(Dv) + static_cast<size_t>(c)];
          if (dead && got != 0.0f) {
            char text[200];
            std::snprintf(text, sizeof text,
                          "out[%lld,%lld,%lld,%lld] = %g in a row no key takes part in "
                          "(must be 0)",
                          static_cast<long long>(b), static_cast<long long>(h),
                          static_cast<long long>(i), static_cast<long long>(c),
                          static_cast<double>(got));
            finding(text);
          }
          if (lenient_inf && (!std::isfinite(want) || !std::isfinite(got))) continue;
          if (!same_value(static_cast<double>(got), want, tol)) {
            char text[240];
            std::snprintf(text, sizeof text,
                          "out[%lld,%lld,%lld,%lld] = %.9g, reference %.9g (tolerance %.3g, "
                          "max |logit| %.3g)",
                          static_cast<long long>(b), static_cast<long long>(h),
                          static_cast<long long>(i), static_cast<long long>(c),
                          static_cast<double>(got), want, tol, ref.max_abs_logit);
            finding(text);
          }
        }
        if (lse != nullptr) {
          const double got = static_cast<double>(
              lse[b * lse_strides[0] + h * lse_strides[1] + i * lse_strides[2]]);
          const double want = ref.lse[row];
          const double lse_tol = mha_test::lse_tolerance(ref, want);
          if (!same_value(got, want, lse_tol)) {
            char text[200];
            std::snprintf(text, sizeof text, "lse[%lld,%lld,%lld] = %.9g, reference %.9g",
                          static_cast<long long>(b), static_cast<long long>(h),
                          static_cast<long long>(i), got, want);
            finding(text);
          }
        }
      }
}

uint32_t bits_of(float x) {
  uint32_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

int64_t changed_outside(const Guarded& g, const mha_tensor& t, const std::vector<float>& before) {
  return mha_test::changed_bytes_outside(g.all.data(), before.data(), g.all.size() * sizeof(float),
                                         t);
}

bool outputs_keep_contract(const std::string& prefix, mha_status status, const std::string& message,
                           bool expect_invalid, const Guarded& out_buf, const mha_tensor& out,
                           const std::vector<float>& out_before, const Guarded& lse_buf,
                           const mha_tensor& lse, const std::vector<float>& lse_before,
                           bool want_lse) {
  if (expect_invalid) {
    if (status == MHA_OK) finding(prefix + "an invalid call was accepted");
    if (message.empty()) finding(prefix + "a refused call left no message");
    if (!same_bytes(out_buf.all, out_before)) finding(prefix + "a refused call modified out");
    if (!same_bytes(lse_buf.all, lse_before)) finding(prefix + "a refused call modified lse");
    return false;
  }
  if (status != MHA_OK) finding(prefix + "a valid call failed: " + message);
  if (changed_outside(out_buf, out, out_before) != 0) finding(prefix + "written outside out");
  if (want_lse && changed_outside(lse_buf, lse, lse_before) != 0) {
    finding(prefix + "written outside lse");
  }
  if (!want_lse && !same_bytes(lse_buf.all, lse_before)) {
    finding(prefix + "lse written though not wanted");
  }
  return true;
}

}  // namespace mha_fuzz
