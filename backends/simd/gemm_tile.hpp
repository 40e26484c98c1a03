// A register-blocked product C (+)= A·B for small tiles, the one micro-kernel
// of the backward pass (all five of its products are this shape):
//   C[m][n] (+)= Σ_k A[m·a_m + k·a_k] · B[k·b_k + n]
// A is read one element at a time and broadcast, so it can be any strided
// view (a tile or its transpose); B's rows and C's rows are whole vectors
// (64-byte aligned, N a multiple of the vector width).  Each block of MR rows
// by NV vectors of C stays in registers over the whole k loop: per k, NV
// loads of B and MR broadcasts feed MR·NV FMAs.  The sum over k runs in
// order k = 0, 1, ...: the result never depends on anything but the inputs.
#pragma once

#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <utility>

namespace mha_simd {

template <class Arch, int MR, int NV, bool kAccumulate>
inline void gemm_block(const float* a, int64_t a_m, int64_t a_k, const float* b, int64_t b_k,
                       int64_t kdim, float* c, int64_t c_m) {
  using V = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(V::size);
  // Every loop over acc unrolled, so that acc stays in registers (a rolled
  // one keeps it on the stack around the k loop).
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      acc[m][v] = kAccumulate ? V::load_aligned(c + m * c_m + v * W) : V(0.0f);
    }
  }
  for (int64_t k = 0; k < kdim; ++k) {
    V bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = V::load_aligned(b + k * b_k + v * W);
    const float* ak = a + k * a_k;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const V am(ak[m * a_m]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[m][v] = xsimd::fma(am, bv[v], acc[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[m][v].store_aligned(c + m * c_m + v * W);
  }
}

// The whole product: M rows, N floats (a multiple of W), K terms, blocks of
// up to MR rows by NV vectors.
template <class Arch, int MR, int NV, bool kAccumulate>
class Gemm {
  using V = xsimd::batch<float, Arch>;
  static constexpr int W = static_cast<int>(V::size);
  using Block = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*,
                         int64_t);

  template <int... R, int... N>
  static constexpr auto table(std::integer_sequence<int, R...>, std::integer_sequence<int, N...>) {
    struct Table {
      Block blocks[sizeof...(R)][sizeof...(N)];
    };
    Table t{};
    ((row_fill<R + 1>(t.blocks[R], std::integer_sequence<int, N...>{})), ...);
    return t;
  }
  template <int Rows, int... N>
  static constexpr void row_fill(Block* row, std::integer_sequence<int, N...>) {
    ((row[N] = &gemm_block<Arch, Rows, N + 1, kAccumulate>), ...);
  }

 public:
  static void run(int64_t rows, int64_t n, int64_t kdim, const float* a, int64_t a_m, int64_t a_k,
                  const float* b, int64_t b_k, float* c, int64_t c_m) {
    static constexpr auto kBlocks =
        table(std::make_integer_sequence<int, MR>{}, std::make_integer_sequence<int, NV>{});
    const int64_t vectors = n / W;
    for (int64_t v0 = 0; v0 < vectors; v0 += NV) {
      const int nv = static_cast<int>(vectors - v0 < NV ? vectors - v0 : NV);
      for (int64_t m0 = 0; m0 < rows; m0 += MR) {
        const int mr = static_cast<int>(rows - m0 < MR ? rows - m0 : MR);
        kBlocks.blocks[mr - 1][nv - 1](a + m0 * a_m, a_m, a_k, b + v0 * W, b_k, kdim,
                                       c + m0 * c_m + v0 * W, c_m);
      }
    }
  }
};

}  // namespace mha_simd
