// One instantiation of the kernels' fast_exp2 for the test of its accuracy
// (test_exp2.cpp), compiled once per instruction set like the plugins:
// MHA_EXP2_ARCH names the xsimd architecture and MHA_EXP2_NAME the function.
#include <cstdint>

#include "simd/exp2.hpp"

extern "C" void MHA_EXP2_NAME(const float* x, float* y, int64_t n) {
  using B = xsimd::batch<float, MHA_EXP2_ARCH>;
  constexpr int64_t kWidth = static_cast<int64_t>(B::size);
  for (int64_t i = 0; i + kWidth <= n; i += kWidth) {
    mha_simd::fast_exp2<MHA_EXP2_ARCH>(B::load_unaligned(x + i)).store_unaligned(y + i);
  }
}
