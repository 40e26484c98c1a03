// The bf16 dot-product path of the prefill layout (AVX512_BF16, vdpbf16ps),
// taken by a plugin built with it (the avx512bf16 row of cmake/MhaIsa.cmake)
// for bf16 Q with bf16 K and V.  vdpbf16ps multiplies pairs of bf16 values
// exactly and adds both products to an fp32 lane, so each operand holds pairs
// along the reduction:
//   Q·Kᵀ: Q packed as pairs along the head dimension (one register = 16
//         queries x 2 consecutive indices), each K row's 32-bit pair
//         broadcast from K in place; the scores are exact products summed in
//         fp32, and the scale (times log2 e) is applied to the fp32 score
//         afterwards -- Q is never scaled in bf16, which would cost 2^-9
//         relative on every logit.
//   P·V:  V packed as pairs of keys (one register = 16 columns x 2 keys), the
//         probabilities rounded to bf16 once, as pairs of keys, broadcast.
// Nothing else is rounded: the softmax, its running maximum and sum, the
// accumulators and the LSE are those of the fp32 path.  An odd head dimension
// or key count is padded with zeros.  (Hardware note: vdpbf16ps treats bf16
// subnormals as zero, |x| < 2^-126, below anything the tolerance can see.)
//
// Bf16Dot<Arch> is only defined where the compiler targets AVX512_BF16; the
// prefill kernel names it only when its kBf16Dot parameter is set.
#pragma once

#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <cstring>

#include "simd/exp2.hpp"
#include "simd/microkernels.hpp"
#include "simd/transpose.hpp"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace mha_simd {

// The bf16 dot-product operations of one xsimd architecture.
template <class Arch>
struct Bf16Dot;

#if defined(__AVX512BF16__)

template <class Arch>
struct Bf16Dot {
  using B = xsimd::batch<float, Arch>;
  static constexpr int W = 16;
  static_assert(B::size == W, "the bf16 dot-product path is AVX-512");

  // Two bf16 values as one 32-bit pair, the first in the low half.
  static uint32_t pair(uint16_t first, uint16_t second) {
    return static_cast<uint32_t>(first) | (static_cast<uint32_t>(second) << 16);
  }

  // The same 512 bits as 32 bf16 values, and back (vector casts: no instruction).
  static __m512bh as_bf16(__m512i bits) { return (__m512bh)bits; }
  static __m512i as_bits(__m512bh values) { return (__m512i)values; }

  // The 32-bit pair at p (two consecutive bf16 values, any alignment) in every lane.
  static __m512bh broadcast_pair(const uint16_t* p) {
    int32_t bits;
    std::memcpy(&bits, p, sizeof bits);
    return as_bf16(_mm512_set1_epi32(bits));
  }

  static __m512bh load_pairs(const uint32_t* p) { return as_bf16(_mm512_loadu_si512(p)); }

  // Lane i of `first` and lane i of `second`, rounded to bf16 (to nearest
  // even), as pair i.
  static __m512i interleave_bf16(__m512 first, __m512 second) {
    // cvtne2ps puts `first` in words 0-15 and `second` in words 16-31;
    // word 2i of the result is word i, word 2i + 1 is word 16 + i.
    const __m512i words = as_bits(_mm512_cvtne2ps_pbh(second, first));
    const __m512i order =
        _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, words);
  }

  // Words 0-15 (kHalf 0) or 16-31 (kHalf 1) of `first` and `second` (32
  // bf16 values each) as 16 pairs.
  template <int kHalf>
  static __m512i interleave_words(__m512i first, __m512i second) {
    // Indices 32-63 pick from `second`.
    constexpr short o = kHalf * 16;
    const __m512i order = _mm512_set_epi16(
        o + 47, o + 15, o + 46, o + 14, o + 45, o + 13, o + 44, o + 12, o + 43, o + 11, o + 42,
        o + 10, o + 41, o + 9, o + 40, o + 8, o + 39, o + 7, o + 38, o + 6, o + 37, o + 5, o + 36,
        o + 4, o + 35, o + 3, o + 34, o + 2, o + 33, o + 1, o + 32, o);
    return _mm512_permutex2var_epi16(first, order, second);
  }

  // ------------------------------------------------------------ packing

  // qp[x2 · kStride + r] = pair(Q[r][2·x2], Q[r][2·x2 + 1]) for the nq rows of
  // bf16 Q at q (rows rs, elements cs apart), x2 < ceil(d / 2); the odd
  // last index pairs with 0, the lanes from nq to the next whole vector are 0.
  // Whole 16 x 16 blocks of pairs go through a register transpose.
  template <int kStride>
  static void pack_queries(const uint16_t* q, int64_t rs, int64_t cs, int64_t nq, int64_t d,
                           uint32_t* qp) {
    const int64_t d2 = (d + 1) / 2;
    const int64_t whole = nq / W * W;
    if (whole < nq) {
      for (int64_t x2 = 0; x2 < d2; ++x2) {
        _mm512_store_si512(qp + x2 * kStride + whole, _mm512_setzero_si512());
      }
    }
    const auto element = [&](int64_t r, int64_t x) -> uint16_t {
      return x < d ? q[r * rs + x * cs] : uint16_t{0};
    };
    int64_t r0 = 0;
    if (cs == 1) {
      for (; r0 < whole; r0 += W) {
        int64_t x0 = 0;  // in pairs
        for (; 2 * (x0 + W) <= d; x0 += W) {
          B rows[W];
          for (int i = 0; i < W; ++i) {
            rows[i] = B(_mm512_castsi512_ps(_mm512_loadu_si512(q + (r0 + i) * rs + 2 * x0)));
          }
          transpose_square<Arch>(rows);
          for (int j = 0; j < W; ++j) {
            _mm512_store_si512(qp + (x0 + j) * kStride + r0,
                               _mm512_castps_si512(static_cast<__m512>(rows[j])));
          }
        }
        for (int i = 0; i < W; ++i) {
          for (int64_t x2 = x0; x2 < d2; ++x2) {
            qp[x2 * kStride + r0 + i] = pair(element(r0 + i, 2 * x2), element(r0 + i, 2 * x2 + 1));
          }
        }
      }
    }
    for (int64_t r = r0; r < nq; ++r) {
      for (int64_t x2 = 0; x2 < d2; ++x2) {
        qp[x2 * kStride + r] = pair(element(r, 2 * x2), element(r, 2 * x2 + 1));
      }
    }
  }

  // Rows of d bf16 values (rows rs, elements cs apart) as dense rows of
  // ceil(d / 2) pairs along the row (K, when it cannot be read in place).
  static void pack_rows(const uint16_t* src, int64_t rs, int64_t cs, int rows, int64_t d,
                        uint32_t* dst) {
    const int64_t d2 = (d + 1) / 2;
    for (int j = 0; j < rows; ++j) {
      const uint16_t* in = src + j * rs;
      for (int64_t x2 = 0; x2 < d2; ++x2) {
        const uint16_t second = 2 * x2 + 1 < d ? in[(2 * x2 + 1) * cs] : uint16_t{0};
        dst[j * d2 + x2] = pair(in[2 * x2 * cs], second);
      }
    }
  }

  // V rows as pairs of keys: dst[j2 · dvp + c] = pair(V[2·j2][c], V[2·j2 + 1][c])
  // for c < dv, j2 < ceil(keys / 2) (row j at v(j), elements cs apart); 0
  // from dv to dvp and for the missing partner of an odd last key.
  template <class Rows>
  static void pack_key_pairs(Rows v, int64_t cs, int keys, int64_t dv, int64_t dvp, uint32_t* dst) {
    for (int j = 0; j < keys; j += 2) {
      const uint16_t* a = v(j);
      const uint16_t* b = j + 1 < keys ? v(j + 1) : nullptr;
      uint32_t* out = dst + (j / 2) * dvp;
      int64_t c = 0;
      if (cs == 1) {
        // 32 columns of both rows at a time; a last 16 through half vectors.
        for (; c + 2 * W <= dv; c += 2 * W) {
          const __m512i first = _mm512_loadu_si512(a + c);
          const __m512i second = b != nullptr ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
          _mm512_storeu_si512(out + c, interleave_words<0>(first, second));
          _mm512_storeu_si512(out + c + W, interleave_words<1>(first, second));
        }
        for (; c + W <= dv; c += W) {
          const __m512i first =
              _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
          const __m512i second = b != nullptr ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                                    reinterpret_cast<const __m256i*>(b + c)))
                                              : _mm512_setzero_si512();
          _mm512_storeu_si512(out + c, interleave_words<0>(first, second));
        }
      }
      for (; c < dv; ++c) out[c] = pair(a[c * cs], b != nullptr ? b[c * cs] : uint16_t{0});
      for (; c < dvp; ++c) out[c] = 0;
    }
  }

  // The probabilities p[j · kStride + lane] of `keys` keys and nqv vectors of
  // queries, rounded to bf16 once, as pairs of keys: pairs[j2 · kStride + lane].
  template <int kStride>
  static void pair_probabilities(const float* p, int keys, int nqv, uint32_t* pairs) {
    for (int j = 0; j < keys; j += 2) {
      for (int v = 0; v < nqv; ++v) {
        const __m512 first = _mm512_load_ps(p + j * kStride + v * W);
        const __m512 second =
            j + 1 < keys ? _mm512_load_ps(p + (j + 1) * kStride + v * W) : _mm512_setzero_ps();
        _mm512_store_si512(pairs + (j / 2) * kStride + v * W, interleave_bf16(first, second));
      }
    }
  }

  // The probabilities 2^d0 and 2^d1 of two keys (d1 null: an odd last key's
  // missing partner, 0) added to sum and stored at dst as bf16 pairs.
  static void store_exp_pair(B d0, const B* d1, B& sum, uint32_t* dst) {
    const B e0 = fast_exp2<Arch>(d0);
    sum += e0;
    B e1(0.0f);
    if (d1 != nullptr) {
      e1 = fast_exp2<Arch>(*d1);
      sum += e1;
    }
    _mm512_store_si512(dst, interleave_bf16(e0, e1));
  }

  // True when none of the n pairs (a multiple of W) holds a bf16 infinity or NaN.
  static bool pairs_finite(const uint32_t* pairs, int64_t n) {
    const __m512i exponent = _mm512_set1_epi16(0x7F80);
    __mmask32 bad = 0;
    for (int64_t x = 0; x < n; x += W) {
      const __m512i e = _mm512_and_si512(_mm512_loadu_si512(pairs + x), exponent);
      bad |= _mm512_cmpeq_epi16_mask(e, exponent);
    }
    return bad == 0;
  }

  // ------------------------------------------------------------ micro-kernels

  // scores[n][lane] = c · Σ_x Q[lane][x] · K[n][x] for NV query vectors and NK
  // keys: qp holds pairs of Q (rows kStride pairs apart, d2 of them), key n's
  // bf16 row starts at k_rows + n · k_stride (2 · d2 values, read as pairs).
  // The exact products are summed in fp32; c (scale · log2 e) multiplies the
  // fp32 sum.
  // kFused: instead, p = 2^(score - row_max) -- added to tile_sum in fp32
  // (the caller checks the tile's sums against kMaxGrowth), stored rounded
  // to bf16 as pairs of keys, pairs[(n / 2) · kStride + lane] (NK odd: the
  // last key pairs with 0).
  // kSetMax (with kFused): a query tile's first key group sets row_max to each
  // lane's maximum over its keys first (as the fp32 score_block).
  template <int kStride, int NV, int NK, bool kFused, bool kSetMax = false>
  static void score_block(const uint32_t* qp, const uint16_t* k_rows, int64_t k_stride, int64_t d2,
                          float c, float* scores, uint32_t* pairs, float* row_max,
                          float* tile_sum) {
    static_assert(!kSetMax || kFused, "kSetMax is a fused block");
    const uint16_t* k[NK];
    for (int n = 0; n < NK; ++n) k[n] = k_rows + n * k_stride;
    // The first pair initialises the accumulators (d2 >= 1): as in
    // score_block, no path on which they live in memory.
    __m512 acc[NV][NK];
    {
      __m512bh q[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) q[v] = load_pairs(qp + v * W);
#pragma GCC unroll 8
      for (int n = 0; n < NK; ++n) {
        const __m512bh kb = broadcast_pair(k[n]);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[v][n] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[v], kb);
      }
    }
    // The next key group's rows, from L2 while this one computes.
    for (int n = 0; n < NK; ++n) {
      const char* next = reinterpret_cast<const char*>(k[n] + NK * k_stride);
      for (int64_t byte = 0; byte < d2 * 4; byte += 64) __builtin_prefetch(next + byte, 0, 3);
    }
    for (int64_t x2 = 1; x2 < d2; ++x2) {
      __m512bh q[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) q[v] = load_pairs(qp + x2 * kStride + v * W);
#pragma GCC unroll 8
      for (int n = 0; n < NK; ++n) {
        const __m512bh kb = broadcast_pair(k[n] + 2 * x2);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[v][n] = _mm512_dpbf16_ps(acc[v][n], q[v], kb);
      }
    }
    const B factor(c);
    if constexpr (!kFused) {
#pragma GCC unroll 8
      for (int n = 0; n < NK; ++n) {
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
          (B(acc[v][n]) * factor).store_aligned(scores + n * kStride + v * W);
        }
      }
    } else {
      // Unrolled, so that acc stays in registers.
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        B d[NK];
        if constexpr (kSetMax) {
#pragma GCC unroll 8
          for (int n = 0; n < NK; ++n) d[n] = B(acc[v][n]) * factor;
          B shift = d[0];
#pragma GCC unroll 8
          for (int n = 1; n < NK; ++n) shift = xsimd::max(shift, d[n]);
          shift.store_aligned(row_max + v * W);
#pragma GCC unroll 8
          for (int n = 0; n < NK; ++n) d[n] -= shift;
        } else {
          const B shift = B::load_aligned(row_max + v * W);
#pragma GCC unroll 8
          for (int n = 0; n < NK; ++n) d[n] = xsimd::fms(B(acc[v][n]), factor, shift);
        }
        B sum = B::load_aligned(tile_sum + v * W);
#pragma GCC unroll 3
        for (int n = 0; n < NK; n += 2) {
          store_exp_pair(d[n], n + 1 < NK ? &d[n + 1] : nullptr, sum,
                         pairs + (n / 2) * kStride + v * W);
        }
        sum.store_aligned(tile_sum + v * W);
      }
    }
  }

  // acc[r][c] = acc[r][c] · alpha[r] + Σ_j P[j][r] · V[j][c] for NR rows and
  // NC vectors of Dv, over keys2 pairs of keys: P as pairs of keys
  // (pairs[j2 · kStride + r]), V as pairs of keys (v_pairs rows v_stride
  // pairs apart).  As pv_block: the tile's sum from zero, the old accumulator
  // joining at the end.
  template <int kStride, int NR, int NC>
  static void pv_block(const uint32_t* pairs, const float* alpha, const uint32_t* v_pairs,
                       int64_t v_stride, int keys2, float* acc, int64_t acc_stride) {
    // The first pair of keys initialises the sums (keys2 >= 1).  Every loop
    // over o unrolled, so that o stays in registers (as in the fp32
    // micro-kernels: one rolled loop kept this 6 x 4 block on the stack, 48
    // stores per block).
    __m512 o[NR][NC];
    {
      __m512bh vv[NC];
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) vv[c] = load_pairs(v_pairs + c * W);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const __m512bh pr = as_bf16(_mm512_set1_epi32(static_cast<int32_t>(pairs[r])));
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) o[r][c] = _mm512_dpbf16_ps(_mm512_setzero_ps(), pr, vv[c]);
      }
    }
    for (int j2 = 1; j2 < keys2; ++j2) {
      __m512bh vv[NC];
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) vv[c] = load_pairs(v_pairs + j2 * v_stride + c * W);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const __m512bh pr =
            as_bf16(_mm512_set1_epi32(static_cast<int32_t>(pairs[j2 * kStride + r])));
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pr, vv[c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const B a(alpha[r]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        float* out = acc + r * acc_stride + c * W;
        xsimd::fma(B::load_aligned(out), a, B(o[r][c])).store_aligned(out);
      }
    }
  }
};

#endif  // __AVX512BF16__

}  // namespace mha_simd
