// A small valid mha_attention call (GQA: two query heads over one KV head)
// whose result is checked against the float64 reference: what the selection
// and plugin tests run to see that a backend really computes.
#pragma once

#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cstdlib>
#include <string>

#include "reference.h"
#include "test_util.h"

namespace mha_test {

struct SmallCall {
  Arena q{2 * 2 * 5 * 8}, k{2 * 1 * 7 * 8}, v{2 * 1 * 7 * 8}, out{2 * 2 * 5 * 8};
  mha_tensor tq, tk, tv, tout;
  SmallCall() {
    Rng rng(5);
    tq = q.view(make_shape(Layout::BHLD, 2, 2, 5, 8));
    tk = k.view(make_shape(Layout::BHLD, 2, 1, 7, 8));
    tv = v.view(make_shape(Layout::BHLD, 2, 1, 7, 8));
    tout = out.view(make_shape(Layout::BHLD, 2, 2, 5, 8));
    fill_uniform(tq, rng);
    fill_uniform(tk, rng);
    fill_uniform(tv, rng);
  }
  mha_status call() { return mha_attention(&tq, &tk, &tv, &tout, nullptr); }
  void expect_correct() {
    const Reference ref = reference_attention(tq, tk, tv, nullptr);
    EXPECT_LE(max_abs_error(tout, ref), tolerance(ref));
  }
};

// An environment variable, or `fallback` when it is unset.
inline std::string env(const char* name, const char* fallback = "") {
  const char* value = std::getenv(name);
  return value != nullptr ? value : fallback;
}

}  // namespace mha_test
