// What the attention fuzzer's cases share (attention_fuzzer.cpp lists the
// cases): reporting a finding with a description of the current case, the
// start of every case (the backend and the thread count), 4-D layouts,
// special values, and the checks of a call's outputs against the float64
// reference and of the bytes around them.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace mha_fuzz {

using mha_test::Reference;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kInfD = std::numeric_limits<double>::infinity();
constexpr int64_t kGuard = 16;  // sentinel floats on either side of out and lse

// Reports a finding with the description of the current case and aborts.
[[noreturn]] void finding(const std::string& what);

// Starts the description of a case.
void begin_case(const std::string& text);

// Ends a case's line in the trace (MHA_FUZZ_TRACE).
void end_case();

// Appends to the description of the current case.
__attribute__((format(printf, 1, 2))) void note(const char* format, ...);

// The start of every case: the backend and the thread count, drawn in the
// same order everywhere (older corpus entries keep their meaning); the case's
// description names them after `kind`.  Returns the backend's name.
std::string start_case(FuzzedDataProvider& fdp, const char* kind);

// ------------------------------------------------------------------ layouts

// Memory orders of a 4-D tensor, outermost axis first.
constexpr int kOrders[][4] = {
    {0, 1, 2, 3},  // [B, H, L, D]
    {0, 2, 1, 3},  // [B, L, H, D]: the projections' natural layout
    {2, 0, 1, 3},  // [L, B, H, D]
    {1, 0, 2, 3},  // [H, B, L, D]
    {0, 1, 3, 2},  // [B, H, D, L]: features outer (a transposed K)
};
constexpr int kOrderCount = sizeof kOrders / sizeof kOrders[0];

struct Layout {
  int64_t shape[4] = {1, 1, 1, 1};
  int64_t strides[4] = {0, 0, 0, 0};
  int64_t extent = 1;  // elements from the first to one past the last reachable
};

// Strides for `shape` in memory order `order`, each innermost run followed by
// `pad` unused elements; `zero` axes get stride 0 (inputs only); size-1 axes
// may get an arbitrary stride, which is never stepped along.
Layout make_layout(const int64_t shape[4], int order, int64_t pad, unsigned zero_mask,
                   bool odd_unit_strides);

mha_tensor describe4(void* data, mha_dtype dtype, const Layout& l);

// ------------------------------------------------------------------ values

float special_value(uint8_t which);

bool is_subnormal(float x);

// ------------------------------------------------------------------ comparisons

// Compares out (any strides) and lse with the reference.  `lenient_inf`: v
// holds infinities and the logits are large, so a weight that is tiny in
// float64 may be 0 in fp32, and 0 * inf makes NaN where the reference has an
// infinity (or the reverse): non-finite disagreements are then accepted.
void compare(const mha_tensor& out, const float* lse, const int64_t lse_strides[3],
             const Reference& ref, bool lenient_inf, double tol);

// A float buffer with sentinel guards around `payload` elements.
struct Guarded {
  std::vector<float> all;
  explicit Guarded(int64_t payload)
      : all(static_cast<size_t>(payload + 2 * kGuard), mha_test::Arena::sentinel()) {}
  float* base() { return all.data() + kGuard; }
};

// The bits of a float (NaN payloads and -0 included).
uint32_t bits_of(float x);

// Elements of `g` that `t` does not reach and that changed since `before`.
// (Bytes: t may be a half-precision tensor in the guarded floats.)
int64_t changed_outside(const Guarded& g, const mha_tensor& t, const std::vector<float>& before);

template <typename T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// The contract of a call's outputs, for a case named by `prefix` ("" or
// "varlen: "): a refused call says why and leaves out and lse as they were;
// an accepted one writes nothing outside them, and lse only when asked for.
// Returns whether the results are to be checked (the call was expected to
// be accepted).
bool outputs_keep_contract(const std::string& prefix, mha_status status, const std::string& message,
                           bool expect_invalid, const Guarded& out_buf, const mha_tensor& out,
                           const std::vector<float>& out_before, const Guarded& lse_buf,
                           const mha_tensor& lse, const std::vector<float>& lse_before,
                           bool want_lse);

}  // namespace mha_fuzz
