// The third case (run_paged_case), on the bytes the packed batch left (read
// after it, likewise): a paged KV cache.  First mha_kv_cache_write: T tokens' K
// and V rows ([T, Hkv, D] and [T, Hkv, Dv], f32/bf16/f16, specials sometimes)
// through a slot mapping (i32 or i64, -1 and other negatives as padding) into
// caches [num_blocks, block_size, Hkv, D / Dv] of f32/bf16/f16/i8 (i8: scales
// [num_blocks, block_size, Hkv]), token- or head-major within a block, rows
// padded: the written rows must hold the converted values (f32 exactly,
// bf16/f16 rounded to nearest even, i8 within half a step of scale =
// max|row| / 127), every other byte its old value, the inputs theirs.  An i8 cache refuses
// a row with NaN or an infinity; other breakages to refuse with nothing
// written: duplicate slots, a slot past the cache, a block size not a multiple
// of 8, dtypes or shapes that disagree, scales missing (i8) or given (float),
// caches that overlap each other or an input.  Then mha_attention_varlen over
// the cache: B sequences of seqused_k keys (0 to several hundred, sometimes
// over a thousand: several decode tiles, split-KV) in blocks of 8/16/24/32
// taken in shuffled order, sometimes a prefix shared by two sequences; spare
// blocks and unused rows hold NaN and the table's unused entries garbage (-1,
// huge), so a kernel that reads them shows; 0..3 queries per sequence
// (decoding) or up to 70 (chunked prefill), the causal mode (often
// bottom-right), window, softcap, sinks, ALiBi [H] or [B, H], the LSE.  Each
// sequence is checked against the reference on its keys gathered densely from
// the cache (in the cache's dtype, i8 with its scales), a sequence without keys
// against zeros and its sink -- or the call is broken in one way (a used block
// id out of range or negative, seqused_k negative or past max_blocks ·
// block_size, cu_seqlens_k with a table, seqused_k missing or of another B, a
// table of the wrong dtype, rank or B or with non-contiguous rows, k or v of
// rank 3, scales of the packed layout, out over the cache ...) and must be
// refused with nothing written.
#include "fuzz_cases.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "fuzz_common.h"
#include "fuzz_packed.h"
#include "reference.h"
#include "test_util.h"

namespace mha_fuzz {
namespace {

// Bytes per element of a cache dtype (F32, BF16, F16 or I8; at least 1).
int64_t element_bytes(int32_t dtype) {
  return dtype == MHA_DTYPE_I8 ? 1 : std::max(1, mha_types::float_bytes(dtype));
}

// Element `at` of F32, BF16 or F16 data, read by the formats' definitions
// (test_util.h), not by the library's conversions.
float float_at(const void* data, int32_t dtype, int64_t at) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (dtype == MHA_DTYPE_F32) {
    float x = 0.0f;
    std::memcpy(&x, bytes + at * 4, 4);
    return x;
  }
  uint16_t b = 0;
  std::memcpy(&b, bytes + at * 2, 2);
  return static_cast<float>(mha_test::half_bits_value(b, dtype));
}

// The bytes from a descriptor's first element to one past its last.
std::vector<unsigned char> bytes_of(const mha_tensor& t) {
  int64_t extent = 1;
  for (int32_t d = 0; d < t.ndim; ++d) extent += (t.shape[d] - 1) * t.strides[d];
  const auto* first = static_cast<const unsigned char*>(t.data);
  return std::vector<unsigned char>(first, first + extent * element_bytes(t.dtype));
}

// One cache of a paged KV cache (K or V): [num_blocks, block_size, Hkv, d] of
// f32, bf16, f16 or i8, token-major or head-major within a block, each row of
// d followed by `pad` unused elements, sized exactly (ASan sees a read past
// its end); an i8 cache's row scales [num_blocks, block_size, Hkv] (C order).
// Everything starts as NaN (i8: random values with NaN scales): what no
// sequence uses stays so, and a kernel that reads it shows.
struct PagedCache {
  int32_t dtype;
  int64_t block_size, heads, d;
  int64_t strides[4] = {0, 0, 0, 1};
  std::vector<unsigned char> bytes;
  std::vector<float> scales;
  mha_tensor t{}, s{};

  PagedCache(int32_t dtype_, int64_t blocks, int64_t block_size_, int64_t heads_, int64_t d_,
             bool head_major, int64_t pad, mha_test::Rng& rng)
      : dtype(dtype_), block_size(block_size_), heads(heads_), d(d_) {
    const int64_t row = d + pad;
    strides[1] = head_major ? row : heads * row;
    strides[2] = head_major ? block_size * row : row;
    strides[0] = block_size * heads * row;
    const int64_t es = element_bytes(dtype);
    bytes.resize(static_cast<size_t>(blocks * strides[0] * es));
    scales.assign(static_cast<size_t>(blocks * block_size * heads), kNaN);
    for (int64_t at = 0; at < blocks * strides[0]; ++at) {
      if (dtype == MHA_DTYPE_I8) {
        bytes[static_cast<size_t>(at)] = static_cast<unsigned char>(rng.integer(-127, 127));
      } else {
        store(at, kNaN);
      }
    }
    t = mha_test::describe(bytes.data(), static_cast<mha_dtype>(dtype),
                           {blocks, block_size, heads, d},
                           {strides[0], strides[1], strides[2], strides[3]});
    s = mha_test::describe(scales.data(), MHA_DTYPE_F32, {blocks, block_size, heads});
  }
  PagedCache(const PagedCache&) = delete;
  PagedCache& operator=(const PagedCache&) = delete;

  // Element e of KV head h of a slot (block · block_size + row).
  int64_t at(int64_t slot, int64_t h, int64_t e) const {
    return slot / block_size * strides[0] + slot % block_size * strides[1] + h * strides[2] + e;
  }
  int64_t scale_at(int64_t slot, int64_t h) const { return slot * heads + h; }

  // x rounded to the cache's float dtype (test_util.h's rounding).
  void store(int64_t element, float x) {
    if (dtype == MHA_DTYPE_F32) {
      std::memcpy(&bytes[static_cast<size_t>(element * 4)], &x, 4);
      return;
    }
    const uint16_t b =
        dtype == MHA_DTYPE_BF16 ? mha_test::round_to_bf16_bits(x) : mha_test::round_to_f16_bits(x);
    std::memcpy(&bytes[static_cast<size_t>(element * 2)], &b, 2);
  }

  // A slot some sequence uses: random values in [-amp, amp] (i8: random
  // int8 with scales up to amp / 127).
  void fill_slot(int64_t slot, float amp, mha_test::Rng& rng) {
    for (int64_t h = 0; h < heads; ++h) {
      if (dtype == MHA_DTYPE_I8) {
        scales[static_cast<size_t>(scale_at(slot, h))] = rng.uniform(0.2f, 1.0f) * amp / 127.0f;
      }
      for (int64_t e = 0; e < d; ++e) {
        if (dtype == MHA_DTYPE_I8) {
          bytes[static_cast<size_t>(at(slot, h, e))] =
              static_cast<unsigned char>(rng.integer(-127, 127));
        } else {
          store(at(slot, h, e), rng.uniform(-amp, amp));
        }
      }
    }
  }

  // Checks what mha_kv_cache_write left: the rows of the tokens with a slot
  // hold x ([T, Hkv, d]) converted to the cache's dtype (f32 exactly, bf16 and
  // f16 rounded to nearest even, i8 within half a step of scale = max|row| /
  // 127), every other byte (padding, other slots, other scales) as `before`.
  void check_written(const mha_tensor& x, const std::vector<int64_t>& slots,
                     const std::vector<unsigned char>& before,
                     const std::vector<float>& scales_before, const char* name) const {
    const int64_t es = element_bytes(dtype);
    std::vector<char> touched(bytes.size() / static_cast<size_t>(es), 0),
        touched_scale(scales.size(), 0);
    char text[240];
    for (size_t token = 0; token < slots.size(); ++token) {
      const int64_t slot = slots[token];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = static_cast<int64_t>(token) * x.strides[0] + h * x.strides[1];
        float largest = 0.0f;
        for (int64_t e = 0; e < d; ++e) {
          largest =
              std::fmax(largest, std::fabs(float_at(x.data, x.dtype, row + e * x.strides[2])));
        }
        const float scale = scales[static_cast<size_t>(scale_at(slot, h))];
        if (dtype == MHA_DTYPE_I8) {
          touched_scale[static_cast<size_t>(scale_at(slot, h))] = 1;
          const float want = largest / 127.0f;
          if (!(std::fabs(scale - want) <=
                std::max(4e-7f * want, 4 * std::numeric_limits<float>::denorm_min()))) {
            std::snprintf(text, sizeof text,
                          "kv_cache_write: %s scale of token %zu head %lld = %.9g, max|row| / 127 "
                          "= %.9g",
                          name, token, static_cast<long long>(h), static_cast<double>(scale),
                          static_cast<double>(want));
            finding(text);
          }
        }
        for (int64_t e = 0; e < d; ++e) {
          const int64_t element = at(slot, h, e);
          touched[static_cast<size_t>(element)] = 1;
          const float value = float_at(x.data, x.dtype, row + e * x.strides[2]);
          bool ok = true;
          double got = 0.0;
          if (dtype == MHA_DTYPE_I8) {
            got = static_cast<double>(static_cast<int8_t>(bytes[static_cast<size_t>(element)])) *
                  static_cast<double>(scale);
            ok = std::fabs(got - static_cast<double>(value)) <=
                 0.5 * static_cast<double>(scale) * (1 + 1e-4) + 1e-45;
          } else if (dtype == MHA_DTYPE_F32) {
            float f = 0.0f;
            std::memcpy(&f, &bytes[static_cast<size_t>(element * 4)], 4);
            got = static_cast<double>(f);
            ok = std::isnan(value) ? std::isnan(f) : bits_of(f) == bits_of(value);
          } else {
            uint16_t b = 0;
            std::memcpy(&b, &bytes[static_cast<size_t>(element * 2)], 2);
            got = mha_test::half_bits_value(b, dtype);
            const uint16_t want = dtype == MHA_DTYPE_BF16 ? mha_test::round_to_bf16_bits(value)
                                                          : mha_test::round_to_f16_bits(value);
            ok = std::isnan(value) ? std::isnan(got) : b == want;
          }
          if (!ok) {
            std::snprintf(text, sizeof text,
                          "kv_cache_write: %s cache slot %lld head %lld element %lld = %.9g, "
                          "token %zu's value %.9g",
                          name, static_cast<long long>(slot), static_cast<long long>(h),
                          static_cast<long long>(e), got, token, static_cast<double>(value));
            finding(text);
          }
        }
      }
    }
    for (size_t n = 0; n < touched.size(); ++n) {
      if (!touched[n] &&
          std::memcmp(&bytes[n * static_cast<size_t>(es)], &before[n * static_cast<size_t>(es)],
                      static_cast<size_t>(es)) != 0) {
        std::snprintf(text, sizeof text,
                      "kv_cache_write: element %zu of the %s cache changed, no token's slot", n,
                      name);
        finding(text);
      }
    }
    for (size_t n = 0; n < touched_scale.size(); ++n) {
      if (!touched_scale[n] && bits_of(scales[n]) != bits_of(scales_before[n])) {
        std::snprintf(text, sizeof text,
                      "kv_cache_write: scale %zu of the %s cache changed, no token's slot", n,
                      name);
        finding(text);
      }
    }
  }
};

// A sequence's keys gathered from the pages through its row of the table:
// a dense [1, Hkv, lk, d] copy (token-major) in the cache's dtype, and for
// i8 its scales [1, Hkv, lk].
struct Gathered {
  std::vector<unsigned char> bytes;
  std::vector<float> scales;
  mha_tensor t{}, s{};

  Gathered(const PagedCache& c, const int32_t* row, int64_t lk) {
    const int64_t es = element_bytes(c.dtype), heads = c.heads, d = c.d;
    bytes.resize(static_cast<size_t>(lk * heads * d * es));
    scales.resize(static_cast<size_t>(lk * heads));
    for (int64_t j = 0; j < lk; ++j) {
      const int64_t slot = row[j / c.block_size] * c.block_size + j % c.block_size;
      for (int64_t h = 0; h < heads; ++h) {
        scales[static_cast<size_t>(j * heads + h)] =
            c.scales[static_cast<size_t>(c.scale_at(slot, h))];
        for (int64_t e = 0; e < d; ++e) {
          std::memcpy(&bytes[static_cast<size_t>(((j * heads + h) * d + e) * es)],
                      &c.bytes[static_cast<size_t>(c.at(slot, h, e) * es)],
                      static_cast<size_t>(es));
        }
      }
    }
    t = mha_test::describe(bytes.data(), static_cast<mha_dtype>(c.dtype), {1, heads, lk, d},
                           {0, d, heads * d, 1});
    s = mha_test::describe(scales.data(), MHA_DTYPE_F32, {1, heads, lk}, {0, 1, heads});
  }
  Gathered(const Gathered&) = delete;
  Gathered& operator=(const Gathered&) = delete;
};

// In-place Fisher-Yates shuffle driven by the case's Rng.
template <typename T>
void shuffle_in_place(std::vector<T>& values, mha_test::Rng& rng) {
  for (size_t n = values.size(); n > 1; --n) {
    std::swap(values[n - 1],
              values[static_cast<size_t>(rng.integer(0, static_cast<int64_t>(n - 1)))]);
  }
}

}  // namespace

// (A rare choice -- a breakage, specials, a window -- is taken on the top
// value of its range: a case whose bytes run out, all of them then 0, is
// valid.)
int run_paged_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "paged: ");
  mha_test::Rng rng(fdp.ConsumeIntegral<uint64_t>());

  // ---- shapes: B sequences, each with seqused_k keys in the cache and a few
  // new queries (decoding) or a chunk of them (chunked prefill)
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  // Head sizes: any, or a multiple of 8 (the decode kernel reads rows of a
  // multiple of the vector width in place, through the table of row addresses).
  static const int64_t kHeadSizes[] = {8, 16, 32, 40, 64};
  const auto head_size = [&] {
    return fdp.ConsumeBool() ? kHeadSizes[fdp.ConsumeIntegralInRange<int>(0, 4)]
                             : fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  };
  const int64_t D = head_size();
  const int64_t Dv = head_size();
  static const int64_t kBlockSizes[] = {8, 16, 24, 32};
  const int64_t bs = kBlockSizes[fdp.ConsumeIntegralInRange<int>(0, 3)];
  std::vector<int64_t> lens_q(static_cast<size_t>(B)), used(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int kind = fdp.ConsumeIntegralInRange<int>(0, 15);
    int64_t lq = fdp.ConsumeIntegralInRange<int64_t>(0, 3);  // decoding: a few new queries
    int64_t lk = 0;
    if (kind < 6) {
      lk = fdp.ConsumeIntegralInRange<int64_t>(0, 9);
    } else if (kind < 10) {  // several blocks
      lk = fdp.ConsumeIntegralInRange<int64_t>(10, 140);
    } else if (kind < 15) {  // the decode layout (twice a key tile and more)
      lk = fdp.ConsumeIntegralInRange<int64_t>(150, 900);
    } else {  // several decode tiles, split-KV
      lk = fdp.ConsumeIntegralInRange<int64_t>(1100, 1400);
    }
    if (kind == 5 || kind == 8 || kind == 9) {  // chunked prefill
      lq = fdp.ConsumeIntegralInRange<int64_t>(4, 70);
    }
    lens_q[static_cast<size_t>(b)] = lq;
    used[static_cast<size_t>(b)] = lk;
  }
  if (std::all_of(lens_q.begin(), lens_q.end(), [](int64_t l) { return l == 0; })) lens_q[0] = 1;
  // Offsets and lengths with slack: a broken B must not make a refusing
  // runtime read outside them.
  std::vector<int32_t> cu_q(static_cast<size_t>(B + 3), 0), used32(cu_q.size(), 0);
  for (int64_t b = 0; b < B; ++b) {
    cu_q[static_cast<size_t>(b + 1)] =
        cu_q[static_cast<size_t>(b)] + static_cast<int32_t>(lens_q[static_cast<size_t>(b)]);
    used32[static_cast<size_t>(b)] = static_cast<int32_t>(used[static_cast<size_t>(b)]);
  }
  const int64_t total_q = cu_q[static_cast<size_t>(B)];
  note(" B=%lld H=%lld Hkv=%lld D=%lld Dv=%lld block %lld lengths", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(Hkv), static_cast<long long>(D),
       static_cast<long long>(Dv), static_cast<long long>(bs));
  for (int64_t b = 0; b < B; ++b) {
    note(" %lld/%lld", static_cast<long long>(lens_q[static_cast<size_t>(b)]),
         static_cast<long long>(used[static_cast<size_t>(b)]));
  }

  // ---- blocks: each sequence's own in shuffled order, sometimes a prefix
  // shared by two sequences, spare blocks nobody uses; the table's entries
  // past a sequence's blocks (and its row padding) garbage
  std::vector<int64_t> need(static_cast<size_t>(B));
  int64_t max_need = 0, total_need = 0;
  for (int64_t b = 0; b < B; ++b) {
    need[static_cast<size_t>(b)] = (used[static_cast<size_t>(b)] + bs - 1) / bs;
    max_need = std::max(max_need, need[static_cast<size_t>(b)]);
    total_need += need[static_cast<size_t>(b)];
  }
  const int64_t max_blocks =
      std::max<int64_t>(1, max_need + fdp.ConsumeIntegralInRange<int64_t>(0, 2));
  int64_t share_from = 0, share_to = 0, shared = 0;
  if (B >= 2 && fdp.ConsumeIntegralInRange<int>(0, 2) == 0) {
    share_from = fdp.ConsumeIntegralInRange<int64_t>(0, B - 1);
    share_to = (share_from + 1 + fdp.ConsumeIntegralInRange<int64_t>(0, B - 2)) % B;
    shared = std::min({need[static_cast<size_t>(share_from)], need[static_cast<size_t>(share_to)],
                       fdp.ConsumeIntegralInRange<int64_t>(1, 3)});
    if (shared > 0) {
      note(" sequence %lld shares %lld blocks of %lld", static_cast<long long>(share_to),
           static_cast<long long>(shared), static_cast<long long>(share_from));
    }
  }
  const int64_t spare = fdp.ConsumeIntegralInRange<int64_t>(0, 3);
  const int64_t num_blocks = std::max<int64_t>(1, total_need - shared + spare);
  const int64_t row_stride = max_blocks + fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  for (size_t n = 0; n < order.size(); ++n) order[n] = static_cast<int32_t>(n);
  shuffle_in_place(order, rng);
  const int32_t kGarbage[] = {-1, std::numeric_limits<int32_t>::max(),
                              std::numeric_limits<int32_t>::min(), static_cast<int32_t>(num_blocks),
                              1 << 30};
  std::vector<int32_t> table(static_cast<size_t>((B - 1) * row_stride + max_blocks));
  for (int32_t& entry : table) entry = kGarbage[rng.integer(0, 4)];
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < need[static_cast<size_t>(b)]; ++n) {
      if (b == share_to && n < shared) continue;
      table[static_cast<size_t>(b * row_stride + n)] = order[next++];
    }
  }
  for (int64_t n = 0; n < shared; ++n) {
    table[static_cast<size_t>(share_to * row_stride + n)] =
        table[static_cast<size_t>(share_from * row_stride + n)];
  }
  note(" num_blocks %lld max_blocks %lld", static_cast<long long>(num_blocks),
       static_cast<long long>(max_blocks));
  // The slots some sequence reads.
  std::vector<char> live(static_cast<size_t>(num_blocks * bs), 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < used[static_cast<size_t>(b)]; ++j) {
      live[static_cast<size_t>(table[static_cast<size_t>(b * row_stride + j / bs)] * bs + j % bs)] =
          1;
    }
  }

  // ---- the caches: their dtype and layout, what the sequences read filled
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  static const mha_dtype kCacheTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16,
                                          MHA_DTYPE_I8};
  const mha_dtype cache_dtype = kCacheTypes[fdp.ConsumeIntegralInRange<int>(0, 3)];
  const bool int8 = cache_dtype == MHA_DTYPE_I8;
  const bool cache_head_major = fdp.ConsumeBool();
  const int64_t cache_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  static const float kAmps[] = {0.5f, 1.0f, 3.0f, 30.0f};
  const float qk_amp = kAmps[fdp.ConsumeIntegralInRange<int>(0, 3)];
  PagedCache kc(cache_dtype, num_blocks, bs, Hkv, D, cache_head_major, cache_pad, rng);
  PagedCache vc(cache_dtype, num_blocks, bs, Hkv, Dv, cache_head_major, cache_pad, rng);
  for (int64_t slot = 0; slot < num_blocks * bs; ++slot) {
    if (!live[static_cast<size_t>(slot)]) continue;
    kc.fill_slot(slot, qk_amp, rng);
    vc.fill_slot(slot, 1.0f, rng);
  }
  note(" cache %s%s pad %lld, q/k amplitude %g", mha_types::dtype_name(cache_dtype),
       cache_head_major ? " head-major" : "", static_cast<long long>(cache_pad),
       static_cast<double>(qk_amp));

  // ---- a step's new tokens, written into slots (mostly ones the sequences
  // read, so that attention then sees them; -1 and other negatives: padding)
  const int64_t T = fdp.ConsumeIntegralInRange<int64_t>(1, 12);
  const mha_dtype in_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const bool slots_i64 = fdp.ConsumeBool();
  std::vector<int64_t> candidates;
  const bool anywhere = fdp.ConsumeIntegralInRange<int>(0, 3) == 3;
  for (int64_t slot = 0; slot < num_blocks * bs; ++slot) {
    if (anywhere || live[static_cast<size_t>(slot)]) candidates.push_back(slot);
  }
  shuffle_in_place(candidates, rng);
  std::vector<int64_t> slots(static_cast<size_t>(T));
  size_t taken = 0;
  for (int64_t& slot : slots) {
    if (taken == candidates.size() || rng.integer(0, 5) == 0) {
      static const int64_t kPadding[] = {-1, -1, -7, std::numeric_limits<int32_t>::min()};
      slot = kPadding[rng.integer(0, 3)];
    } else {
      slot = candidates[taken++];
    }
  }
  std::vector<float> key_in(static_cast<size_t>(T * Hkv * D)),
      value_in(static_cast<size_t>(T * Hkv * Dv));
  for (float& x : key_in) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : value_in) x = rng.uniform();
  note(" T=%lld %s slots/%s%s", static_cast<long long>(T), mha_types::dtype_name(in_dtype),
       slots_i64 ? "i64" : "i32", anywhere ? " anywhere" : "");

  // ---- queries, packed [total_q, H, D]
  const bool q_head_major = fdp.ConsumeBool();
  const int64_t q_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  const PackedLayout lq_layout = packed_layout(total_q, H, D, q_head_major, q_pad, false);
  std::vector<float> qb(static_cast<size_t>(lq_layout.extent));
  for (float& x : qb) x = rng.uniform(-qk_amp, qk_amp);
  const mha_dtype q_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  note(" q %s%s pad %lld", mha_types::dtype_name(q_dtype), q_head_major ? " head-major" : "",
       static_cast<long long>(q_pad));

  // ---- specials in the queries and the new tokens
  const int specials =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 3 ? fdp.ConsumeIntegralInRange<int>(1, 4) : 0;
  for (int n = 0; n < specials; ++n) {
    const int target = fdp.ConsumeIntegralInRange<int>(0, 2);
    std::vector<float>& buf = target == 0 ? qb : (target == 1 ? key_in : value_in);
    const size_t at = fdp.ConsumeIntegral<uint32_t>() % buf.size();
    buf[at] = special_value(fdp.ConsumeIntegral<uint8_t>());
    note(" %c[%zu] = %g", "qkv"[target], at, static_cast<double>(buf[at]));
  }

  // ---- at most one way of breaking the write (decided here: one of them
  // plants a non-finite value in a row an i8 cache would quantise)
  const int write_how =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 3 ? fdp.ConsumeIntegralInRange<int>(0, 10) : -1;
  bool planted = false;
  if (write_how == 10) {
    const int64_t start = rng.integer(0, T - 1);
    for (int64_t n = 0; n < T && !planted; ++n) {
      const int64_t t = (start + n) % T;
      if (slots[static_cast<size_t>(t)] < 0) continue;
      const bool in_key = rng.chance(0.5);
      const int64_t d = in_key ? D : Dv;
      const float bad = special_value(static_cast<uint8_t>(rng.integer(0, 2)));  // NaN, ±inf
      (in_key ? key_in : value_in)[static_cast<size_t>(t * Hkv * d + rng.integer(0, Hkv * d - 1))] =
          bad;
      planted = true;
      note(" %s of token %lld = %g", in_key ? "key" : "value", static_cast<long long>(t),
           static_cast<double>(bad));
    }
  }
  bool v_has_inf = false;
  {
    bool qk_inf = false;  // as in run_case: no subnormals next to an infinity
    for (const float x : qb) qk_inf = qk_inf || std::isinf(x);
    for (const float x : key_in) qk_inf = qk_inf || std::isinf(x);
    if (qk_inf) {
      for (float& x : qb) x = is_subnormal(x) ? 0.0f : x;
      for (float& x : key_in) x = is_subnormal(x) ? 0.0f : x;
    }
    for (const float x : value_in) v_has_inf = v_has_inf || std::isinf(x);
  }

  // ---- dtypes
  mha_test::TypedCopy q_typed(describe3(qb.data(), MHA_DTYPE_F32, lq_layout), q_dtype);
  mha_test::TypedCopy key_typed(mha_test::describe(key_in.data(), MHA_DTYPE_F32, {T, Hkv, D}),
                                in_dtype);
  mha_test::TypedCopy value_typed(mha_test::describe(value_in.data(), MHA_DTYPE_F32, {T, Hkv, Dv}),
                                  in_dtype);
  bool tokens_finite = true;  // in the rows an i8 cache would take
  for (const mha_tensor* x : {&key_typed.get(), &value_typed.get()}) {
    mha_test::for_each_offset(*x, [&](int64_t at) {
      const int64_t token = at / x->strides[0];
      tokens_finite = tokens_finite && (slots[static_cast<size_t>(token)] < 0 ||
                                        std::isfinite(float_at(x->data, x->dtype, at)));
    });
  }

  // ---- mha_kv_cache_write
  std::vector<int32_t> slots32(slots.size());
  for (size_t n = 0; n < slots.size(); ++n) slots32[n] = static_cast<int32_t>(slots[n]);
  mha_tensor tkey = key_typed.get(), tvalue = value_typed.get(), tkc = kc.t, tvc = vc.t, tks = kc.s,
             tvs = vc.s;
  mha_tensor tslots = slots_i64 ? mha_test::describe(slots.data(), MHA_DTYPE_I64, {T})
                                : mha_test::describe(slots32.data(), MHA_DTYPE_I32, {T});
  mha_tensor* ks_arg = int8 ? &tks : nullptr;
  mha_tensor* vs_arg = int8 ? &tvs : nullptr;
  bool write_invalid = int8 && !tokens_finite;
  if (write_how >= 0) {
    bool applied = true;
    const size_t t = static_cast<size_t>(rng.integer(0, T - 1));
    const auto set_slot = [&](size_t at, int64_t value) {
      slots[at] = value;
      slots32[at] = static_cast<int32_t>(value);
    };
    switch (write_how) {
      case 0: {  // one slot twice
        size_t first = slots.size();
        for (size_t n = 0; n < slots.size() && first == slots.size(); ++n) {
          if (slots[n] >= 0) first = n;
        }
        if (first == slots.size() || T < 2) {
          applied = false;
        } else {
          set_slot(first == t ? (t + 1) % slots.size() : t, slots[first]);
        }
        break;
      }
      case 1:  // a slot past the cache
        set_slot(t, fdp.ConsumeBool() ? num_blocks * bs + fdp.ConsumeIntegralInRange<int64_t>(0, 2)
                                      : std::numeric_limits<int32_t>::max());
        break;
      case 2:
        tkc.shape[1] = tvc.shape[1] = bs - 4;
        break;
      case 3:
        tvalue.dtype = in_dtype == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
        break;
      case 4:
        tvc.dtype = cache_dtype == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
        break;
      case 5:
        tkey.dtype = fdp.ConsumeBool() ? MHA_DTYPE_I8 : MHA_DTYPE_BOOL;
        break;
      case 6:
        tslots.dtype = MHA_DTYPE_F32;
        break;
      case 7:
        switch (fdp.ConsumeIntegralInRange<int>(0, 3)) {
          case 0:
            tslots.shape[0] = T - 1;
            break;
          case 1:
            tkc.shape[3] = D + 1;
            break;
          case 2:
            tvc.shape[2] = Hkv + 1;
            break;
          default:
            tvc.shape[0] = num_blocks > 1 ? num_blocks - 1 : 2;
            break;
        }
        break;
      case 8:  // scales missing for an i8 cache, of the wrong shape, or given for a float one
        if (!int8) {
          ks_arg = &tks;
        } else if (fdp.ConsumeBool()) {
          (fdp.ConsumeBool() ? ks_arg : vs_arg) = nullptr;
        } else {
          tvs.shape[2] = Hkv + 1;
        }
        break;
      case 9: {  // overlaps: the caches each other, or an input inside a cache
        const int kind = fdp.ConsumeIntegralInRange<int>(0, 2);
        const size_t key_bytes = static_cast<size_t>(T * Hkv * D * element_bytes(in_dtype));
        if (kind == 0) {
          if (vc.bytes.size() <= kc.bytes.size()) {
            tvc.data = kc.bytes.data();
          } else {
            tkc.data = vc.bytes.data();
          }
        } else if (kind == 1 && int8) {
          tvs.data = kc.scales.data();
        } else if (key_bytes <= kc.bytes.size()) {
          tkey.data = kc.bytes.data();
        } else {
          tkc.data = tkey.data;
        }
        break;
      }
      default:
        applied = planted && int8;
        break;
    }
    if (applied) {
      write_invalid = true;
      note(" write broken by #%d", write_how);
    }
  }
  {
    const std::vector<unsigned char> k_before = kc.bytes, v_before = vc.bytes;
    const std::vector<float> ks_before = kc.scales, vs_before = vc.scales;
    const std::vector<unsigned char> key_before = bytes_of(key_typed.get()),
                                     value_before = bytes_of(value_typed.get());
    // Snapshots: the call sees slots through tslots.
    // NOLINTNEXTLINE(performance-unnecessary-copy-initialization)
    const std::vector<int64_t> slots_before = slots;
    // NOLINTNEXTLINE(performance-unnecessary-copy-initialization)
    const std::vector<int32_t> slots32_before = slots32;
    const mha_status status =
        mha_kv_cache_write(&tkey, &tvalue, &tkc, &tvc, &tslots, ks_arg, vs_arg);
    const std::string message = mha_last_error();
    if (bytes_of(key_typed.get()) != key_before || bytes_of(value_typed.get()) != value_before ||
        !same_bytes(slots, slots_before) || !same_bytes(slots32, slots32_before)) {
      finding("kv_cache_write: an input was modified");
    }
    if (write_invalid) {
      if (status == MHA_OK) finding("kv_cache_write: an invalid call was accepted");
      if (message.empty()) finding("kv_cache_write: a refused call left no message");
      if (!same_bytes(kc.bytes, k_before) || !same_bytes(vc.bytes, v_before) ||
          !same_bytes(kc.scales, ks_before) || !same_bytes(vc.scales, vs_before)) {
        finding("kv_cache_write: a refused call wrote into a cache");
      }
    } else {
      if (status != MHA_OK) finding("kv_cache_write: a valid call failed: " + message);
      kc.check_written(key_typed.get(), slots, k_before, ks_before, "key");
      vc.check_written(value_typed.get(), slots, v_before, vs_before, "value");
    }
  }

  // ---- mha_attention_varlen over the pages
  mha_tensor q = q_typed.get(), k = kc.t, v = vc.t, k_scale = kc.s, v_scale = vc.s;
  mha_attention_params params;
  mha_attention_params_init(&params);
  if (int8) {
    params.k_scale = &k_scale;
    params.v_scale = &v_scale;
  }
  static const int32_t kCausal[] = {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT,
                                    MHA_CAUSAL_BOTTOM_RIGHT};
  params.causal = kCausal[fdp.ConsumeIntegralInRange<int>(0, 3)];
  note(" causal %d", params.causal);
  bool expect_invalid = false;
  if (fdp.ConsumeBool()) {
    static const float kScales[] = {0.01f, 0.125f, 0.5f, 1.0f, 10.0f, -0.5f, 0.0f, kNaN};
    const int which = fdp.ConsumeIntegralInRange<int>(0, 7);
    params.has_scale = 1;
    params.scale = kScales[which];
    if (which >= 6) expect_invalid = true;
    note(" scale %g", static_cast<double>(params.scale));
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 3) {  // sometimes: a window bounds what is read
    params.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, 40);
    params.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, 40);
  }
  if (params.window_left >= 0 || params.window_right >= 0) {
    note(" window %lld,%lld", static_cast<long long>(params.window_left),
         static_cast<long long>(params.window_right));
  }
  DrawnVariants drawn;
  draw_variants(fdp, rng, B, H, B, params, drawn);

  // ---- outputs
  const bool out_head_major = fdp.ConsumeBool();
  const int64_t out_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  const PackedLayout lo_layout = packed_layout(total_q, H, Dv, out_head_major, out_pad, false);
  Guarded out_buf(lo_layout.extent);
  mha_tensor out = describe3(out_buf.base(), MHA_DTYPE_F32, lo_layout);
  const bool want_lse = fdp.ConsumeBool();
  const int64_t lse_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 1);
  Guarded lse_buf(H * (total_q + lse_pad) + 2);
  mha_tensor lse =
      mha_test::describe(lse_buf.base(), MHA_DTYPE_F32, {H, total_q}, {total_q + lse_pad, 1});
  if (want_lse) params.lse = &lse;
  mha_tensor tcu_q = mha_test::describe(cu_q.data(), MHA_DTYPE_I32, {B + 1});
  mha_tensor tused = mha_test::describe(used32.data(), MHA_DTYPE_I32, {B});
  mha_tensor ttable =
      mha_test::describe(table.data(), MHA_DTYPE_I32, {B, max_blocks}, {row_stride, 1});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &tcu_q;
  varlen.seqused_k = &tused;
  varlen.block_table = &ttable;

  // ---- at most one way of breaking the call
  std::vector<int64_t> slack(static_cast<size_t>(4 * (B + 2) * (max_blocks + 2)), 0);
  mha_tensor wrong{}, wrong_k_scale{}, wrong_v_scale{};
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 3) {
    const int how = fdp.ConsumeIntegralInRange<int>(0, 14);
    bool applied = true;
    // A sequence that has keys (a used block), from a random start.
    int64_t with_keys = -1;
    const int64_t start = rng.integer(0, B - 1);
    for (int64_t n = 0; n < B && with_keys < 0; ++n) {
      if (need[static_cast<size_t>((start + n) % B)] > 0) with_keys = (start + n) % B;
    }
    const int64_t b = rng.integer(0, B - 1);
    switch (how) {
      case 0:  // a used block id out of range or negative
      case 1:
        if (with_keys < 0) {
          applied = false;
        } else {
          static const int32_t kBadNegative[] = {-1, -2, std::numeric_limits<int32_t>::min()};
          const int32_t bad = how == 0 ? static_cast<int32_t>(num_blocks + rng.integer(0, 2))
                                       : kBadNegative[rng.integer(0, 2)];
          const int64_t n = rng.integer(0, need[static_cast<size_t>(with_keys)] - 1);
          table[static_cast<size_t>(with_keys * row_stride + n)] = bad;
          note(" block_table[%lld][%lld] = %d", static_cast<long long>(with_keys),
               static_cast<long long>(n), bad);
        }
        break;
      case 2:  // seqused_k beyond max_blocks · block_size
        used32[static_cast<size_t>(b)] = fdp.ConsumeBool()
                                             ? static_cast<int32_t>(max_blocks * bs + 1)
                                             : std::numeric_limits<int32_t>::max();
        break;
      case 3:
        used32[static_cast<size_t>(b)] =
            fdp.ConsumeBool() ? -1 : std::numeric_limits<int32_t>::min();
        break;
      case 4:
        varlen.cu_seqlens_k = &tcu_q;
        break;
      case 5:
        varlen.seqused_k = nullptr;
        break;
      case 6:  // a table of i64
        wrong = mha_test::describe(slack.data(), MHA_DTYPE_I64, {B, max_blocks});
        varlen.block_table = &wrong;
        break;
      case 7:  // a table of rank 1 or 3
        wrong = fdp.ConsumeBool()
                    ? mha_test::describe(table.data(), MHA_DTYPE_I32, {B})
                    : mha_test::describe(slack.data(), MHA_DTYPE_I32, {B, max_blocks, 1});
        varlen.block_table = &wrong;
        break;
      case 8:  // a table for another B
        wrong = mha_test::describe(slack.data(), MHA_DTYPE_I32, {B + 1, max_blocks});
        varlen.block_table = &wrong;
        break;
      case 9:  // a table whose rows are not contiguous
        wrong = mha_test::describe(slack.data(), MHA_DTYPE_I32, {B, max_blocks + 1},
                                   {2 * (max_blocks + 1), 2});
        varlen.block_table = &wrong;
        break;
      case 10:  // k or v of rank 3
        (fdp.ConsumeBool() ? k : v).ndim = 3;
        break;
      case 11:  // int8 scales of the packed layout [total_k, Hkv]; scales for a float cache
        wrong_k_scale = mha_test::describe(kc.scales.data(), MHA_DTYPE_F32, {num_blocks * bs, Hkv});
        wrong_v_scale = mha_test::describe(vc.scales.data(), MHA_DTYPE_F32, {num_blocks * bs, Hkv});
        if (int8) {
          (fdp.ConsumeBool() ? params.k_scale : params.v_scale) =
              fdp.ConsumeBool() ? &wrong_k_scale : &wrong_v_scale;
        } else {
          params.k_scale = &k_scale;
          params.v_scale = &v_scale;
        }
        break;
      case 12:  // out over a cache
        out.data = fdp.ConsumeBool() ? kc.bytes.data() : vc.bytes.data();
        break;
      case 13:
        k.shape[1] = v.shape[1] = bs - 4;
        break;
      default:  // seqused_k for another B
        wrong = mha_test::describe(used32.data(), MHA_DTYPE_I32, {B + 1});
        varlen.seqused_k = &wrong;
        break;
    }
    if (applied) {
      expect_invalid = true;
      note(" broken by #%d (sequence %lld)", how, static_cast<long long>(b));
    }
  }

  // ---- the call
  const std::vector<unsigned char> q_before = bytes_of(q_typed.get());
  const std::vector<unsigned char> k_before = kc.bytes, v_before = vc.bytes;
  const std::vector<float> ks_before = kc.scales, vs_before = vc.scales;
  const std::vector<int32_t> cu_q_before = cu_q, used_before = used32, table_before = table;
  const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
  const mha_status status = mha_attention_varlen(&q, &k, &v, &out, &varlen, &params);
  const std::string message = mha_last_error();
  if (bytes_of(q_typed.get()) != q_before || !same_bytes(kc.bytes, k_before) ||
      !same_bytes(vc.bytes, v_before) || !same_bytes(kc.scales, ks_before) ||
      !same_bytes(vc.scales, vs_before) || !same_bytes(cu_q, cu_q_before) ||
      !same_bytes(used32, used_before) || !same_bytes(table, table_before)) {
    finding("paged: an input was modified");
  }
  if (!outputs_keep_contract("paged: ", status, message, expect_invalid, out_buf, out, out_before,
                             lse_buf, lse, lse_before, want_lse)) {
    return 0;
  }

  // ---- each sequence against the reference on its keys gathered densely
  const float* lse_data = static_cast<const float*>(lse.data);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = cu_q[static_cast<size_t>(b)], lq = lens_q[static_cast<size_t>(b)];
    const int64_t lk = used[static_cast<size_t>(b)];
    if (lq == 0) continue;
    if (lk == 0) {  // zeros, LSE its sink or -inf
      for (int64_t i = q0; i < q0 + lq; ++i) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t c = 0; c < Dv; ++c) {
            const float got = static_cast<const float*>(
                out.data)[i * out.strides[0] + h * out.strides[1] + c * out.strides[2]];
            if (got != 0.0f) finding("paged: a sequence without keys has a non-zero output");
          }
          if (!want_lse) continue;
          const float want =
              params.sinks != nullptr ? drawn.sink_values[static_cast<size_t>(h)] : -kInf;
          const float got = lse_data[h * lse.strides[0] + i * lse.strides[1]];
          if (!(got == want))
            finding("paged: a sequence without keys has an LSE other than its sink");
        }
      }
      continue;
    }
    const int32_t* row = table.data() + b * row_stride;
    const Gathered gk(kc, row, lk), gv(vc, row, lk);
    mha_attention_params alone = params;
    alone.lse = nullptr;
    mha_tensor slope_row{};
    if (drawn.alibi_per_sequence) {
      slope_row = mha_test::describe(drawn.slopes.data() + b * H, MHA_DTYPE_F32, {H});
      alone.alibi_slopes = &slope_row;
    }
    if (int8) {
      alone.k_scale = &gk.s;
      alone.v_scale = &gv.s;
    }
    const Reference ref = mha_test::reference_attention(sequence_of(q, q0, lq), gk.t, gv.t, &alone);
    note(" [sequence %lld]", static_cast<long long>(b));
    const int64_t lse_strides[3] = {0, lse.strides[0], lse.strides[1]};
    compare(sequence_of(out, q0, lq), want_lse ? lse_data + q0 * lse.strides[1] : nullptr,
            lse_strides, ref, v_has_inf && ref.max_abs_logit > 40.0,
            mha_test::tolerance_for(backend, q_dtype, cache_dtype, ref, MHA_DTYPE_F32));
  }
  return 0;
}

}  // namespace mha_fuzz
