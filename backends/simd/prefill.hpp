// The prefill layout: vector lanes along the queries.
//
// A tile of queries is packed once, transposed and pre-multiplied by
// scale·log2(e), so one register holds one head-dimension index of W queries.
// The score micro-kernel then broadcasts K elements straight from K's rows and
// the P·V micro-kernel loads V rows as vectors: K and V are used in place (a
// tile is packed only when its rows are strided or Dv is not a multiple of W).
// All softmax state -- running max, running sum, rescale factor -- is vertical
// (one lane per query), so there are no horizontal reductions; exp is base 2.
// (docs/kernel-design.md: this layout measured 5-22 % ahead of packing Kᵀ.)
//
// kBf16Dot (a plugin built with AVX512_BF16): bf16 Q with bf16 K and V take
// the bf16 dot-product path of bf16_dot.hpp for both products -- same tiles,
// same softmax, Q and V packed as bf16 pairs, P rounded to bf16 once.  Every
// other call, and the careful pass, runs exactly the code of kBf16Dot = false.
// Where the runtime asks for AMX tiles (bf16_dot 2), that path's two
// products run on them (amx.hpp) and everything else stays the same.
//
// This file composes the pieces: micro-kernels (microkernels.hpp and
// bf16_dot.hpp), the tile softmax (softmax.hpp), masks and dropout
// (masking.hpp), the careful path (nonfinite.hpp) and the row epilogue
// (epilogue.hpp).
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/dropout.h"
#include "common/problem.h"
#include "simd/amx.hpp"
#include "simd/bf16_dot.hpp"
#include "simd/blocking.hpp"
#include "simd/convert.hpp"
#include "simd/epilogue.hpp"
#include "simd/kernel_entry.hpp"
#include "simd/kv_rows.hpp"
#include "simd/masking.hpp"
#include "simd/microkernels.hpp"
#include "simd/nonfinite.hpp"
#include "simd/paths.hpp"
#include "simd/score_variants.hpp"
#include "simd/softmax.hpp"
#include "simd/tile_tools.hpp"
#include "simd/transpose.hpp"

namespace mha_simd {

template <class Arch, bool kBf16Dot = false>
class PrefillKernel {
  using B = xsimd::batch<float, Arch>;
  using Dot = Bf16Dot<Arch>;   // named only when kBf16Dot
  using Amx = AmxTiles<Arch>;  // named only when kBf16Dot and AMX tiles are taken
  // Whether this plugin has the AMX kernels (an AVX512_BF16 build on x86-64).
#if defined(MHA_HAVE_AMX_TILES)
  static constexpr bool kAmxBuilt = kBf16Dot;
#else
  static constexpr bool kAmxBuilt = false;
#endif
  static constexpr int W = static_cast<int>(B::size);
  using Blk = Blocking<Arch>;
  static constexpr int QT = Blk::kQueryTile;
  // Keys per tile: chosen from the L1d when the plugin was loaded
  // (tile_choice.hpp), a multiple of kScoreKeys and of W.
  static int64_t chosen_key_tile() {
    return mha_simd_chosen_tiles().key_tile;
  }
  // Keys per tile on AMX tiles: whole steps of 32 keys, chosen from the L1d
  // as well (tile_choice.hpp).
  static int64_t amx_key_tile() {
    return mha_simd_chosen_tiles().amx_key_tile;
  }
  // The room a tile's buffers keep for its keys: either path's tile.
  static int64_t key_tile_room() {
    return std::max<int64_t>(chosen_key_tile(), kAmxBuilt ? amx_key_tile() : 0);
  }
  // Keys per P·V run: the key tile cut into equal runs, each within the
  // chosen budget of V rows (tile_choice.hpp) and at least two key groups of
  // the score micro-kernel.
  static int pv_run_keys(int64_t dvp, int64_t key_tile) {
    const int64_t budget = mha_simd_chosen_tiles().pv_run_bytes;
    if (budget <= 0) return static_cast<int>(key_tile);
    constexpr int64_t NK = Blk::kScoreKeys;
    const int64_t most =
        std::clamp<int64_t>(budget / (dvp * int64_t{sizeof(float)}) / NK * NK, 2 * NK, key_tile);
    const int64_t runs = (key_tile + most - 1) / most;
    return static_cast<int>((key_tile + runs * NK - 1) / (runs * NK) * NK);
  }
  static constexpr int kWarmUpKeys = 4 * Blk::kScoreKeys;
  static_assert(QT % (W * Blk::kScoreQueryVectors) == 0, "query tile must hold whole blocks");
  static_assert(!kBf16Dot || Blk::kScoreKeys % 2 == 0, "bf16 key groups are whole pairs");

  struct Tile {
    int64_t kt;          // keys per tile (chosen_key_tile)
    int pv_run;          // keys per P·V run (pv_run_keys), at most kt
    float* qt;           // [D][QT]: Q transposed, times scale·log2(e);
                         // bf16 path: [ceil(D/2)][QT] pairs of Q, unscaled
    float* q_stage;      // [QT][D]: a half-precision Q tile widened to fp32
    float* scores;       // [kt][QT]: scores, then probabilities, of one key tile
    float* acc;          // [QT][Dvp]: the unnormalised output
    float* row_max;      // [QT], in the units of the scores
    float* row_sum;      // [QT]
    float* alpha;        // [QT]: rescale factor of the current key tile
    uint8_t* removed;    // [kt][QT]: keys a mask removed, when V holds non-finite values
    float* tile_sum;     // [QT]: sums of a fused tile until it is known to be valid
    float* poison;       // [W]: the output values' v - v, when P·V writes them (kOutput)
    int64_t* first_key;  // [QT]: first visible key (window), relative to the item's first key
    int64_t* last_key;   // [QT]: last visible key, relative to the item's first key
    float* tile_bounds;  // [2][QT]: first and last relative to the current tile
    uint32_t* row_key;   // [QT]: dropout hash of each query's row
    int32_t* band;       // [2][QT / W]: per query vector, the keys [lo, hi) of the current
                         // tile its lanes see (a tile crossing a limit: work above the
                         // causal diagonal, or outside a window, is skipped)
    float* k_pack;       // [kt][D] when K rows are strided; bf16 path: [kt][ceil(D/2)] pairs
    float* v_pack;       // [kt][Dvp] when V rows are strided or Dv % W != 0;
                         // bf16 path: [kt/2][Dvp] pairs of keys, always
    uint32_t* p_pairs;   // bf16 path: [kt/2][QT] probabilities as pairs of keys
    // AMX tiles (amx.hpp; kt' = kt rounded up to whole steps of 32 keys,
    // D' = D rounded up to 32): K rows [kt'][D'] bf16, the P·V's A operand
    // [QT][p_stride] pairs (p_stride = kt'/2), V's last partial step
    // [16][Dvp] pairs.
    bool amx;
    uint16_t* k_amx;
    uint32_t* p_rows;
    int64_t p_stride;
    uint32_t* v_stage;
    // The fused tiles in rows (amx_rows: amx.hpp's "rows"): Q's rows
    // [QT][D'] bf16, and the item's K as pairs of the head dimension,
    // transposed: [D'/2][kt_stride] pairs, filled with V's pairs (widened).
    bool amx_rows;
    uint16_t* q_amx;
    uint32_t* k_pairs_t;
    int64_t kt_stride;
    // Half-precision or int8 K and V, or fp32 rows that are not back to
    // back, widened (copied) once per item for all its query tiles
    // (fp32_cache): [keys of the item][D] and [..][Dvp], the first
    // widened[0] rows filled, of KV head widened[1].  On the bf16 path
    // (pairs_cache) v_cache holds V as pairs of keys instead, [..][Dvp]
    // pairs, and K is read in place.
    float* k_cache;
    float* v_cache;
    int64_t* widened;
    // The rows of the item this thread most likely runs next (queue_next_item),
    // stepped with each query tile's queue; nullptr: none.
    PrefetchQueue* next_item;
    // Whether this item reads K and V from the cache: half precision and
    // int8 always (fp32_cache); fp32 rows apart only when the item has
    // several query tiles to share the copy (a copy per tile costs more than
    // reading the rows in place: S9's short sequences, docs/kernel-design.md).
    bool use_cache;
  };

  // Where one key tile's K and V rows are, as the arithmetic reads them:
  // fp32 rows (in place, packed or widened), or on the bf16 path (kDot) bf16
  // K rows read as pairs and V as pairs of keys.
  template <bool kDot>
  struct KeyTile {
    const std::conditional_t<kDot, uint16_t, float>* k;
    int64_t k_stride;
    const std::conditional_t<kDot, uint32_t, float>* v;
    int64_t v_stride;
    // Elements of each V row to request while the scores are computed (0:
    // none): V read in place by a thread that has not read it yet (v_is_new).
    int64_t v_fetch;
    // AMX rows (Tile::amx_rows): K's pairs transposed, from this tile's
    // first key (Tile::kt_stride pairs a row).
    const uint32_t* k_t = nullptr;
  };

  // Whether the V rows of a query tile are new to its thread, so not in
  // this core's L2: the item's first query tile of a head, when the thread
  // read other keys just before (the runtime's mha_work_item::kv_new, for the
  // item's first head) or the head before it in the item has another KV
  // head.  The first query tile of each head then waited on them in its P·V
  // phase (S1 on Zen 5: 1.42x the time of a later tile's P·V); requesting
  // them while the scores are computed takes that off.  Later tiles find V
  // in the L2, and requesting it again costs more than it saves.
  static bool v_is_new(const mha_kernel_problem& p, const mha_work_item& item, int64_t h,
                       int64_t q0) {
    if (q0 != item.q_begin) return false;
    if (h == item.h_begin) return item.kv_new != 0;
    return mha_kernel::kv_head_of(p, h) != mha_kernel::kv_head_of(p, h - 1);
  }

  // Widened K and V are cached per item when they fit in this many bytes.
  static constexpr int64_t kMaxWidenedBytes = int64_t{16} << 20;

  // K and V copied once per item (mha_kernel::kv_copied_per_item: half
  // precision, int8, fp32 rows apart) when they fit (and, for fp32, the item
  // has several query tiles: Tile::use_cache); otherwise fp32 rows with unit
  // column strides are read in place and the others packed per key tile.
  static bool widened_cache(const mha_kernel_problem& p) {
    return mha_kernel::kv_copied_per_item(p) &&
           p.lk * (p.d + round_up(p.dv, W)) * 4 <= kMaxWidenedBytes;
  }
  // What an item caches: fp32 K and V rows, or (bf16 path) V as pairs of
  // keys.  A query tile the bf16 path hands over to fp32 then packs its tiles.
  static bool pairs_cache(const mha_kernel_problem& p) {
    return bf16_dot_taken<kBf16Dot>(p) && widened_cache(p);
  }
  static bool fp32_cache(const mha_kernel_problem& p) {
    return widened_cache(p) && !pairs_cache(p);
  }
  // fp32 K rows apart stay in place when the score micro-kernel spans the
  // whole query tile (AVX-512: 4 vectors of 16 queries): each K row is then
  // read once per query tile, so a copy would only add its own traffic (S9,
  // one thread: 3-5 % faster than copying K). V, which the P·V micro-kernel
  // reads again for each block of rows, is still copied.
  static constexpr bool kKeysReadOncePerTile = QT == W * Blk::kScoreQueryVectors;
  static bool k_in_place(const mha_kernel_problem& p) {
    return kKeysReadOncePerTile && p.kv_dtype == MHA_DTYPE_F32 && !paged(p) && p.k_strides[3] == 1;
  }
  static int64_t k_cached_rows(const mha_kernel_problem& p) {
    return fp32_cache(p) && !k_in_place(p) ? p.lk : 0;
  }

 public:
  // Rows of the score tile and its probability pairs: the key tile, rounded
  // up to the AMX tiles' steps in the bf16 plugin; the Q tile's (pairs on
  // the bf16 path, rounded up to whole steps there).
  static int64_t score_rows(int64_t kt) {
    return kBf16Dot ? round_up(kt, 32) : kt;
  }
  static int64_t qt_rows(const mha_kernel_problem& p) {
    return kBf16Dot ? std::max(p.d, round_up(p.d, 32) / 2) : p.d;
  }
  // Whether the fused tiles on AMX take the rows orientation: where the
  // item caches V's pairs, K's pairs transposed are cached with them (any
  // layout: a paged cache gives the dense call's bits).
  static bool amx_rows_taken(const mha_kernel_problem& p) {
    return kAmxBuilt && amx_taken<kBf16Dot>(p) && pairs_cache(p);
  }
  // Pairs a row of the transposed K cache: the item's keys, whole steps and
  // one more (a tile starting at an even key past a step reads that far).
  static int64_t kt_stride(const mha_kernel_problem& p) {
    return round_up(p.lk, 32) + 32;
  }
  // Floats of the AMX buffers (Tile::k_amx, p_rows, v_stage, q_amx, k_pairs_t).
  static std::array<int64_t, 5> amx_floats(const mha_kernel_problem& p, int64_t kt) {
    if (!kAmxBuilt) return {0, 0, 0, 0, 0};
    const int64_t dp = round_up(p.d, 32);
    return {round_up(kt, 32) * dp / 2, QT * round_up(kt, 32) / 2, W * round_up(p.dv, W),
            QT * dp / 2, amx_rows_taken(p) ? kt_stride(p) * dp / 2 : 0};
  }

  static size_t scratch_bytes(const mha_kernel_problem& p) {
    const int64_t dvp = round_up(p.dv, W);
    const int64_t k_cached = k_cached_rows(p), v_cached = widened_cache(p) ? p.lk : 0;
    const int64_t kt = key_tile_room();
    const auto amx = amx_floats(p, kt);
    return ScratchCarver::bytes({qt_rows(p) * QT,
                                 score_rows(kt) * QT,
                                 QT * dvp,
                                 QT,
                                 QT,
                                 QT,
                                 QT,
                                 2 * QT,
                                 2 * QT,
                                 2 * QT,
                                 QT,
                                 kt * p.d,
                                 kt * dvp,
                                 kt * QT / 4,
                                 QT * p.d,
                                 k_cached * p.d,
                                 v_cached * dvp,
                                 2,
                                 kBf16Dot ? score_rows(kt) * QT / 2 : 0,
                                 2 * QT / W,
                                 W,
                                 amx[0],
                                 amx[1],
                                 amx[2],
                                 amx[3],
                                 amx[4]});
  }

  static void run(const mha_kernel_problem& p, const mha_work_item& item, void* scratch) {
    ScratchCarver carve(scratch);
    const int64_t dvp = round_up(p.dv, W);
    Tile t{};
    t.amx = kAmxBuilt && amx_taken<kBf16Dot>(p);
    t.kt = t.amx ? amx_key_tile() : chosen_key_tile();
    const int64_t kt_room = key_tile_room();
    t.pv_run = pv_run_keys(dvp, t.kt);
    t.qt = carve.floats(qt_rows(p) * QT);
    t.scores = carve.floats(score_rows(kt_room) * QT);
    t.acc = carve.floats(QT * dvp);
    t.row_max = carve.floats(QT);
    t.row_sum = carve.floats(QT);
    t.alpha = carve.floats(QT);
    t.tile_sum = carve.floats(QT);
    t.first_key = reinterpret_cast<int64_t*>(carve.floats(2 * QT));
    t.last_key = reinterpret_cast<int64_t*>(carve.floats(2 * QT));
    t.tile_bounds = carve.floats(2 * QT);
    t.row_key = reinterpret_cast<uint32_t*>(carve.floats(QT));
    t.k_pack = carve.floats(kt_room * p.d);
    t.v_pack = carve.floats(kt_room * dvp);
    t.removed = reinterpret_cast<uint8_t*>(carve.floats(kt_room * QT / 4));
    t.q_stage = carve.floats(QT * p.d);
    const int64_t k_cached = k_cached_rows(p), v_cached = widened_cache(p) ? p.lk : 0;
    t.k_cache = carve.floats(k_cached * p.d);
    t.v_cache = carve.floats(v_cached * dvp);
    t.widened = reinterpret_cast<int64_t*>(carve.floats(2));
    t.widened[0] = 0;
    t.widened[1] = -1;
    t.use_cache = fp32_cache(p) && (p.kv_dtype != MHA_DTYPE_F32 || item.q_end - item.q_begin > QT);
    if constexpr (kBf16Dot) {
      t.p_pairs = reinterpret_cast<uint32_t*>(carve.floats(score_rows(kt_room) * QT / 2));
    }
    t.band = reinterpret_cast<int32_t*>(carve.floats(2 * QT / W));
    t.poison = carve.floats(W);
    const auto amx = amx_floats(p, kt_room);
    t.k_amx = reinterpret_cast<uint16_t*>(carve.floats(amx[0]));
    t.p_rows = reinterpret_cast<uint32_t*>(carve.floats(amx[1]));
    t.p_stride = round_up(kt_room, 32) / 2;
    t.v_stage = reinterpret_cast<uint32_t*>(carve.floats(amx[2]));
    t.q_amx = reinterpret_cast<uint16_t*>(carve.floats(amx[3]));
    t.k_pairs_t = reinterpret_cast<uint32_t*>(carve.floats(amx[4]));
    t.amx_rows = t.amx && amx_rows_taken(p);
    t.kt_stride = kt_stride(p);
    if constexpr (kAmxBuilt) {
      if (t.amx) Amx::configure();  // this thread's tiles
    }
    PrefetchQueue next_rows;
    t.next_item = queue_next_item(p, item, next_rows) ? &next_rows : nullptr;
    for (int64_t h = item.h_begin; h < item.h_end; ++h) {
      for (int64_t q0 = item.q_begin; q0 < item.q_end; q0 += QT) {
        query_tile(p, item, t, h, q0, std::min<int64_t>(QT, item.q_end - q0));
      }
    }
    if constexpr (kAmxBuilt) {
      if (t.amx) Amx::release();
    }
  }

 private:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // A logit of -inf (from the data, not a mask) is a key that takes no part,
  // so its V row must not reach the output either; the fast path cannot tell
  // such a weight from an underflowed one.  And a logit near FLT_MAX overflows
  // in the fast path's base-2 units.  A tile whose output came out non-finite
  // is therefore computed again, carefully: raw units (ScoreUnits), two-pass
  // softmax and P·V skipping every -inf logit.  Finite data never pays for it.
  static void query_tile(const mha_kernel_problem& p, const mha_work_item& item, const Tile& t,
                         int64_t h, int64_t q0, int64_t nq) {
    ScoreUnits units = ScoreUnits::base2(p.scale);
    bool done = false;
    if constexpr (kBf16Dot) {
      if (bf16_dot_taken<kBf16Dot>(p)) {
        done = accumulate_tile<true>(p, item, t, h, q0, nq, units, false);
      }
    }
    bool written = false;
    if (!done) {
      accumulate_tile<false>(p, item, t, h, q0, nq, units, /*careful=*/false, &written);
    }
    // Written, and checked as written: a value that came out non-finite, or a
    // lost row, sends the tile through the careful pass, written again.
    if (written && xsimd::all(B::load_aligned(t.poison) == B::load_aligned(t.poison))) return;
    const float sink = mha_kernel::sink_logit(p, h);
    const int64_t dvp = round_up(p.dv, W);
    if (!written && !has_lost_row(t, nq) &&
        write_item_rows<Arch>(item, h - item.h_begin, q0 - item.q_begin, nq, t.acc, dvp, p.dv,
                              t.row_max, t.row_sum, sink, units)) {
      return;
    }
    units = ScoreUnits::raw_units(p.scale);
    accumulate_tile<false>(p, item, t, h, q0, nq, units, /*careful=*/true);
    write_item_rows<Arch>(item, h - item.h_begin, q0 - item.q_begin, nq, t.acc, dvp, p.dv,
                          t.row_max, t.row_sum, sink, units);
  }

  // A row with visible keys but no weight: either a mask removed every key
  // (rare, and the careful pass gives the same zeros) or its logits are so
  // negative that base-2 units overflowed them to -inf (then the careful
  // pass, in raw units, finds the row).
  static bool has_lost_row(const Tile& t, int64_t nq) {
    for (int64_t r = 0; r < nq; ++r) {
      if (t.row_sum[r] == 0.0f && t.last_key[r] >= t.first_key[r]) return true;
    }
    return false;
  }

  // Whether a query tile's output can be written by its P·V blocks (kOutput):
  // plain output rows (write_item_rows' common case), whole vectors, no
  // dropout, and every row with a softmax sum to divide by.
  static bool writes_directly(const mha_kernel_problem& p, const mha_work_item& item, int64_t h,
                              const Tile& t, int64_t nq) {
    if (!plain_output_rows(item, mha_kernel::sink_logit(p, h)) || p.dv % W != 0 ||
        p.dropout_p > 0.0f) {
      return false;
    }
    // A vector at a time: the sums were just stored as vectors, and a scalar
    // load of each waited on them (S4: 0.9 % of the time in this loop; Zen
    // 5, in-process A/B, 11 rounds, both orders: S4 0.986 and 1/1.005).
    const int64_t whole = nq / W * W;
    for (int64_t r = 0; r < whole; r += W) {
      if (!xsimd::all(B::load_aligned(t.row_sum + r) > B(0.0f))) return false;
    }
    for (int64_t r = whole; r < nq; ++r) {
      if (!(t.row_sum[r] > 0.0f)) return false;
    }
    return true;
  }

  // One query tile over the item's keys into t.acc, t.row_max, t.row_sum.
  // kDot: on the bf16 dot-product path (base-2 units, never careful); returns
  // false, leaving the tile to the fp32 path, when a masked tile's V holds
  // non-finite values (the guarded P·V is fp32 only).
  template <bool kDot>
  static bool accumulate_tile(const mha_kernel_problem& p, const mha_work_item& item, const Tile& t,
                              int64_t h, int64_t q0, int64_t nq, const ScoreUnits& units,
                              bool careful, bool* written = nullptr) {
    const int64_t b = item.b;
    const int64_t kvh = mha_kernel::kv_head_of(p, h);
    const int64_t dvp = round_up(p.dv, W);
    const int nqv = static_cast<int>((nq + W - 1) / W);

    // Which keys each query sees: the tile starts at the earliest first key
    // (a sliding window's; the item's first otherwise) and stops at the
    // furthest last one.
    int64_t min_last = item.k_end - 1, max_last = item.k_begin - 1;
    int64_t min_first = item.k_end, max_first = item.k_begin;
    // Without causal rule, window or valid lengths every query sees all the
    // item's keys (the per-query rule was 3 % of S4's time).
    const bool unlimited = p.valid_lens == nullptr && p.causal_diag >= mha_rules::kNoCausalLimit &&
                           p.lower_diag <= -mha_rules::kNoCausalLimit;
    if (unlimited) {
      min_last = max_last = item.k_end - 1;
      min_first = max_first = item.k_begin;
      std::fill(t.first_key, t.first_key + nq, int64_t{0});
      std::fill(t.last_key, t.last_key + nq, item.k_end - 1 - item.k_begin);
    }
    for (int64_t r = 0; !unlimited && r < nq; ++r) {
      const int64_t last = std::min(mha_kernel::last_visible_key(p, b, q0 + r), item.k_end - 1);
      const int64_t first = std::max(mha_kernel::first_visible_key(p, q0 + r), item.k_begin);
      min_last = std::min(min_last, last);
      max_last = std::max(max_last, last);
      min_first = std::min(min_first, first);
      max_first = std::max(max_first, first);
      t.first_key[r] = first - item.k_begin;
      t.last_key[r] = last - item.k_begin;
    }
    for (int64_t r = nq; r < int64_t{nqv} * W; ++r) {  // padding lanes
      t.first_key[r] = min_first - item.k_begin;
      t.last_key[r] = max_last - item.k_begin;
    }
    // Key tiles start an even number of keys after the item's first (the
    // bf16 path's V pairs are cached from there).
    const int64_t key_begin =
        item.k_begin + (std::max<int64_t>(min_first - item.k_begin, 0) & ~int64_t{1});

    // On AMX rows the fused tiles read Q's rows; its pairs are packed only
    // for a tile the fused path does not take.
    bool q_pairs_packed = false;
    if constexpr (kDot) {
      if (t.amx_rows) {
        if constexpr (kAmxBuilt) {
          Amx::q_rows(mha_kernel::q_row<uint16_t>(p, b, h, q0), p.q_strides[2], p.q_strides[3], nq,
                      round_up(nq, 32), p.d, t.q_amx);
        }
      } else {
        pack_query_pairs(p, t, b, h, q0, nq);
        q_pairs_packed = true;
      }
    } else {
      pack_queries(p, t, b, h, q0, nq, units.q_factor);
    }
    if (p.dropout_p > 0.0f) {
      for (int64_t r = 0; r < int64_t{nqv} * W; ++r) {
        t.row_key[r] = mha_kernel::dropout_row_key(p, b, h, q0 + r);
      }
    }
    for (int64_t r = 0; r < QT; ++r) {  // AMX rows compute whole blocks of 32 rows
      t.row_max[r] = kNegInf;
      t.row_sum[r] = 0.0f;
    }
    // The accumulators start at the first tile's P·V: it overwrites them
    // when it covers every row and column, else they are zeroed before it.
    bool acc_started = false;
    const auto start_acc = [&](bool overwritten) {
      if (!overwritten) {
        for (int64_t x = 0; x < nq * dvp; x += W) B(0.0f).store_aligned(t.acc + x);
      }
      acc_started = true;
    };

    PrefetchQueue prefetch;
    prefetch.then(t.next_item);
    queue_next_rows(p, item, h, q0, nq, prefetch);
    const bool v_new = v_is_new(p, item, h, q0);
    const int64_t key_tiles = std::max<int64_t>(0, (max_last + 1 - key_begin + t.kt - 1) / t.kt);
    {
      constexpr int QV = Blk::kScoreQueryVectors, NK = Blk::kScoreKeys;
      constexpr int R = Blk::kPvRows, C = Blk::kPvVectors;
      // (AMX rows: the fused epilogue steps the queue once a row.)
      const int64_t blocks_per_key_tile = t.amx_rows
                                              ? round_up(nq, 32)
                                              : (nqv + QV - 1) / QV * ((t.kt + NK - 1) / NK) +
                                                    (nq + R - 1) / R * ((dvp / W + C - 1) / C);
      prefetch.pace(key_tiles * blocks_per_key_tile, key_tiles == 1);
    }

    // A softcap or ALiBi changes every score before the softmax: such calls
    // take the two-pass path on every tile.
    const bool plain_scores = !mha_kernel::has_score_variants(p);
    // The fused path (scores to probabilities in registers) applies unless
    // the tile is computed carefully, or the bf16 path must keep fp32
    // probabilities for dropout.
    const bool may_fuse = !careful && !(kDot && p.dropout_p > 0.0f);
    bool lanes_have_maximum = false;
    int keys = 0;
    for (int64_t j0 = key_begin; j0 <= max_last; j0 += keys) {
      // A tile that would cross the first query's limit (the causal
      // diagonal, a window's right edge) stops before it, in whole key
      // groups, when that leaves a few groups: the keys every query sees
      // then take the fused path, and only the band takes the two-pass one.
      const auto tile_keys = [&](int64_t span) {
        int n = static_cast<int>(std::min<int64_t>(span, max_last + 1 - j0));
        if (j0 >= max_first && j0 <= min_last && j0 + n - 1 > min_last) {
          constexpr int64_t NK = Blk::kScoreKeys;
          const int64_t before = (min_last + 1 - j0) / NK * NK;
          if (before >= 2 * NK) n = static_cast<int>(before);
        }
        return n;
      };
      keys = tile_keys(t.kt);
      // The first tile sets the running maximum.  Within every query's
      // limits it takes the fused path (compute_scores' kSetMax: its first
      // key group's maximum is the reference).  Otherwise, without a mask,
      // it is short: it sets the maximum with the two-pass path, and the
      // fused path takes over from the next key on instead of from the next
      // full tile.  Keys that fit in one tile take one tile: the split would
      // pay the P·V blocks' loads and stores of the accumulators twice.
      if (j0 == key_begin && p.mask_kind == MHA_MASK_NONE && plain_scores &&
          max_last + 1 - key_begin > t.kt) {
        const bool fusable = may_fuse && j0 >= max_first && j0 + keys - 1 <= min_last;
        if (!fusable) keys = tile_keys(kWarmUpKeys);
      }
      const KeyTile<kDot> kv =
          key_tile<kDot>(p, t, b, kvh, item.k_begin, item.k_end, j0, keys, v_new);
      // Fused path: once every lane has a finite running maximum, a tile with
      // no mask to apply computes its probabilities straight from the score
      // registers against that (stale) maximum; it is exact as long as the
      // tile's probabilities sum to at most 2^kMaxGrowth (far from overflow),
      // which compute_scores checks.  Otherwise, and on the first
      // tile, the two-pass path: scores, masks, new maximum, rescale.  (The
      // bf16 path's fused kernel stores bf16 probabilities: dropout, which
      // needs them in fp32, takes the two-pass path.)
      const bool within_bounds = j0 >= max_first && j0 + keys - 1 <= min_last;
      const bool maskless = p.mask_kind == MHA_MASK_NONE && within_bounds && plain_scores;
      bool fused = maskless && may_fuse && lanes_have_maximum &&
                   compute_scores<kDot, true>(t, kv, p.d, units, nqv, keys, prefetch);
      // The first tile: each query vector's first key group sets the running
      // maximum (kSetMax), the rest of the tile is fused against it; the
      // check on the tile's sums sends it to the two-pass path as above.
      if (!fused && !acc_started && maskless && may_fuse) {
        // row_max is -inf and row_sum 0 until now
        fused = compute_scores<kDot, true, true>(t, kv, p.d, units, nqv, keys, prefetch);
        lanes_have_maximum = fused;
        if (!fused) std::fill(t.row_max, t.row_max + int64_t{nqv} * W, kNegInf);
      }
      // A tile crossing the queries' limits (the causal diagonal, a window's
      // edge) and nothing else takes the fused path too (fp32), masked by
      // lane, when V is finite there: the banded P·V then leaves each row's
      // hidden keys out or weighs them 0, as the two-pass path does.
      if constexpr (!kDot) {
        if (!within_bounds && p.mask_kind == MHA_MASK_NONE && plain_scores && !careful &&
            lanes_have_maximum && rows_finite<Arch>(kv.v, kv.v_stride, keys, dvp)) {
          set_band(t, nqv, j0 - item.k_begin, keys);
          visibility_bounds<Arch>(t.first_key, t.last_key, t.tile_bounds, nqv, j0 - item.k_begin,
                                  keys);
          fused = compute_scores<false, true>(t, kv, p.d, units, nqv, keys, prefetch, true);
        }
      }
      // A key a mask or a -inf logit removed must not pass on a NaN or
      // infinity of its V row through 0 · V; such tiles (rare) take the
      // guarded P·V (fp32: the bf16 path hands the query tile over).
      bool skip_removed = false;
      if (!fused) {
        if constexpr (kDot) {
          if (!maskless && !Dot::pairs_finite(kv.v, (keys + 1) / 2 * dvp)) return false;
        }
        // A tile crossing a limit computes, per query vector, only the keys
        // its lanes can see (the rest is masked to -inf below either way).
        const bool banded = !within_bounds;
        if (banded) set_band(t, nqv, j0 - item.k_begin, keys);
        if constexpr (kDot) {
          if (!q_pairs_packed) pack_query_pairs(p, t, b, h, q0, nq);
          q_pairs_packed = true;
        }
        compute_scores<kDot, false>(t, kv, p.d, units, nqv, keys, prefetch, banded);
        if (!plain_scores) {
          apply_score_variants_tile<Arch, QT>(p, t.scores, b, h, q0, nqv, j0, keys, units);
        }
        if (p.mask_kind != MHA_MASK_NONE) {
          apply_mask_tile<Arch, QT>(p, t.scores, b, h, q0, nq, nqv, j0, keys, units);
        }
        if (!within_bounds) {
          apply_visibility_tile<Arch, QT>(t.scores, t.first_key, t.last_key, t.tile_bounds, nqv,
                                          j0 - item.k_begin, keys);
        }
        if constexpr (!kDot) {
          skip_removed = (careful || !maskless) && !rows_finite<Arch>(kv.v, kv.v_stride, keys, dvp);
        }
        if (skip_removed) {
          for (int64_t x = 0; x < int64_t{keys} * QT; ++x) t.removed[x] = t.scores[x] == kNegInf;
        }
        lanes_have_maximum = units.raw
                                 ? update_softmax_vertical<Arch, QT, true>(
                                       t.scores, t.row_max, t.row_sum, t.alpha, nqv, keys, units)
                                 : update_softmax_vertical<Arch, QT, false>(
                                       t.scores, t.row_max, t.row_sum, t.alpha, nqv, keys, units);
      }
      if (p.dropout_p > 0.0f) {
        apply_dropout_tile<Arch, QT>(p.dropout_p, t.row_key, t.scores, nqv, j0, keys);
      }
      const bool overwrite = !acc_started && !kDot && within_bounds && !skip_removed;
      if (!acc_started) start_acc(overwrite);
      if constexpr (kDot) {
        // P rounded to bf16 once (the fused kernel stored its pairs already).
        if (!fused) Dot::template pair_probabilities<QT>(t.scores, keys, nqv, t.p_pairs);
        accumulate_pv<kDot>(t, kv, dvp, nq, keys, prefetch, !within_bounds, j0 - item.k_begin,
                            false, fused && t.amx_rows);
      } else if (skip_removed) {
        for (int64_t r = 0; r < nq; ++r) {
          pv_guarded_row(t.scores + r, t.removed + r, QT, keys, t.alpha[r], kv.v, kv.v_stride, dvp,
                         t.acc + r * dvp);
        }
      } else if (written != nullptr && overwrite && fused && j0 + keys > max_last &&
                 keys <= t.pv_run && writes_directly(p, item, h, t, nq)) {
        // The query tile's only key tile, one P·V run: the sums go straight
        // to the output rows, divided by the row sums there.
        for (int64_t r = 0; r < nq; ++r) t.alpha[r] = 1.0f / t.row_sum[r];
        B(0.0f).store_aligned(t.poison);
        float* out = static_cast<float*>(item.out) + (h - item.h_begin) * item.out_strides[0] +
                     (q0 - item.q_begin) * item.out_strides[1];
        pv_to_output(t, kv, dvp, nq, keys, prefetch, out, item.out_strides[1]);
        *written = true;
      } else {
        accumulate_pv<kDot>(t, kv, dvp, nq, keys, prefetch, !within_bounds, j0 - item.k_begin,
                            overwrite);
      }
    }
    if (!acc_started) start_acc(false);  // no key at all
    return true;
  }

  // The bf16 path's Q tile as pairs along the head dimension (t.qt), padded
  // to the AMX tiles' steps when they take them.
  static void pack_query_pairs(const mha_kernel_problem& p, const Tile& t, int64_t b, int64_t h,
                               int64_t q0, int64_t nq) {
    Dot::template pack_queries<QT>(mha_kernel::q_row<uint16_t>(p, b, h, q0), p.q_strides[2],
                                   p.q_strides[3], nq, p.d, reinterpret_cast<uint32_t*>(t.qt));
    if constexpr (kAmxBuilt) {
      if (t.amx) Amx::template pad_query_pairs<QT>(reinterpret_cast<uint32_t*>(t.qt), p.d);
    }
  }

  // The K and V rows of keys j0 .. j0 + keys of KV head kvh.  fp32 rows are
  // used in place; otherwise they are widened to fp32 (int8 rows times their
  // scales) into the item's cache, once for all its query tiles, or -- when
  // the item's keys are too many for it -- packed once per query tile.  The
  // bf16 path reads bf16 K in place (pairs along a row need unit strides and
  // an even D) and packs V as pairs of keys.
  template <bool kDot>
  static KeyTile<kDot> key_tile(const mha_kernel_problem& p, const Tile& t, int64_t b, int64_t kvh,
                                int64_t k_begin, int64_t k_end, int64_t j0, int keys, bool v_new) {
    const int64_t dvp = round_up(p.dv, W);
    if constexpr (kDot) {
      const bool k_direct = p.k_strides[3] == 1 && p.d % 2 == 0 && !paged(p);
      const uint16_t* k_first = mha_kernel::k_row<uint16_t>(p, b, kvh, j0);
      auto* k_pairs = reinterpret_cast<uint32_t*>(t.k_pack);
      if (!k_direct) {
        mha_kernel::for_each_kv_run(p, j0, keys, [&](int64_t r, int64_t n) {
          Dot::pack_rows(mha_kernel::k_row<uint16_t>(p, b, kvh, j0 + r), p.k_strides[2],
                         p.k_strides[3], static_cast<int>(n), p.d, k_pairs + r * ((p.d + 1) / 2));
        });
      }
      uint32_t* v_pairs = nullptr;
      if (pairs_cache(p)) {  // key tiles start at even offsets from k_begin
        pair_into_cache(p, t, b, kvh, k_begin, k_end, j0 + keys);
        v_pairs = reinterpret_cast<uint32_t*>(t.v_cache) + (j0 - k_begin) / 2 * dvp;
      } else {
        v_pairs = reinterpret_cast<uint32_t*>(t.v_pack);
        Dot::pack_key_pairs(value_rows<uint16_t>(p, b, kvh, j0), p.v_strides[3], keys, p.dv, dvp,
                            v_pairs);
      }
      return {k_direct ? k_first : reinterpret_cast<const uint16_t*>(k_pairs),
              k_direct ? p.k_strides[2] : 2 * ((p.d + 1) / 2),
              v_pairs,
              dvp,
              0,
              t.amx_rows ? t.k_pairs_t + (j0 - k_begin) : nullptr};
    } else {
      if (t.use_cache) {
        widen_into_cache(p, t, b, kvh, k_begin, j0 + keys);
        if (k_in_place(p)) {
          return {mha_kernel::k_row(p, b, kvh, j0), p.k_strides[2],
                  t.v_cache + (j0 - k_begin) * dvp, dvp, 0};
        }
        return {t.k_cache + (j0 - k_begin) * p.d, p.d, t.v_cache + (j0 - k_begin) * dvp, dvp, 0};
      }
      const bool fp32_kv = p.kv_dtype == MHA_DTYPE_F32 && !paged(p);
      const bool k_direct = p.k_strides[3] == 1 && fp32_kv;
      const bool v_direct = p.v_strides[3] == 1 && p.dv % W == 0 && fp32_kv;
      if (!k_direct) pack_tile(p, p.k, p.k_strides, b, kvh, j0, keys, p.d, t.k_pack, p.d, true);
      if (!v_direct) pack_tile(p, p.v, p.v_strides, b, kvh, j0, keys, p.dv, t.v_pack, dvp, false);
      return {k_direct ? mha_kernel::k_row(p, b, kvh, j0) : t.k_pack,
              k_direct ? p.k_strides[2] : p.d,
              v_direct ? mha_kernel::v_row(p, b, kvh, j0) : t.v_pack,
              v_direct ? p.v_strides[2] : dvp, v_direct && v_new ? p.dv : 0};
    }
  }

  // A paged cache's rows are packed (a tile's rows are not evenly spaced).
  static bool paged(const mha_kernel_problem& p) {
    return p.block_table != nullptr;
  }

  // V's rows from key j0 of (b, kvh): evenly spaced, or looked up in a paged
  // cache.
  template <class T>
  static ProblemRows<T> value_rows(const mha_kernel_problem& p, int64_t b, int64_t kvh,
                                   int64_t j0) {
    return {&p, static_cast<const T*>(p.v), p.v_strides, b, kvh, j0};
  }

  // Extends the item's widened K and V of KV head kvh (whose first key is
  // k_begin) to cover the keys before `end`.
  static void widen_into_cache(const mha_kernel_problem& p, const Tile& t, int64_t b, int64_t kvh,
                               int64_t k_begin, int64_t end) {
    if (t.widened[1] != kvh) {  // an item of several heads moved to another KV head
      t.widened[0] = 0;
      t.widened[1] = kvh;
    }
    const int64_t have = t.widened[0], want = end - k_begin;
    if (want <= have) return;
    const int64_t dvp = round_up(p.dv, W);
    const int rows = static_cast<int>(want - have);
    if (!k_in_place(p)) {
      pack_tile(p, p.k, p.k_strides, b, kvh, k_begin + have, rows, p.d, t.k_cache + have * p.d, p.d,
                true);
    }
    pack_tile(p, p.v, p.v_strides, b, kvh, k_begin + have, rows, p.dv, t.v_cache + have * dvp, dvp,
              false);
    t.widened[0] = want;
  }

  // The bf16 path's counterpart: extends the item's V pairs of KV head kvh
  // to cover the keys before `end`.  An odd last key was paired with zero:
  // its pair is made again with its partner.  On AMX rows K's transposed
  // pairs too, in whole groups of 16 keys (the item's keys end at k_end).
  static void pair_into_cache(const mha_kernel_problem& p, const Tile& t, int64_t b, int64_t kvh,
                              int64_t k_begin, int64_t k_end, int64_t end) {
    if constexpr (kBf16Dot) {
      if (t.widened[1] != kvh) {
        t.widened[0] = 0;
        t.widened[1] = kvh;
      }
      const int64_t want = end - k_begin;
      if (want <= t.widened[0]) return;
      const int64_t have = t.widened[0] / 2 * 2;
      const int64_t dvp = round_up(p.dv, W);
      Dot::pack_key_pairs(value_rows<uint16_t>(p, b, kvh, k_begin + have), p.v_strides[3],
                          static_cast<int>(want - have), p.dv, dvp,
                          reinterpret_cast<uint32_t*>(t.v_cache) + have / 2 * dvp);
      if constexpr (kAmxBuilt) {
        if (t.amx_rows) {
          const ProblemRows<uint16_t> k_rows{
              &p, static_cast<const uint16_t*>(p.k), p.k_strides, b, kvh, k_begin};
          Amx::key_pairs_t(k_rows, p.k_strides[3], p.d, round_up(t.widened[0], W),
                           round_up(want, W), k_end - k_begin, t.k_pairs_t, t.kt_stride);
        }
      }
      t.widened[0] = want;
    }
  }

  // Rows j0 .. j0 + keys of K or V (data, strides) of KV head kvh packed as
  // dense fp32 rows of `padded` floats: copied (fp32), or widened with the
  // int8 rows' scales folded in.
  static void pack_tile(const mha_kernel_problem& p, const void* data, const int64_t* strides,
                        int64_t b, int64_t kvh, int64_t j0, int keys, int64_t cols, float* dst,
                        int64_t padded, bool is_k) {
    // Run by run: a paged cache's rows are evenly spaced within a block.
    mha_kernel::for_each_kv_run(p, j0, keys, [&](int64_t t, int64_t n) {
      const int64_t first = mha_kernel::kv_offset(p, strides, b, kvh, j0 + t);
      float* out = dst + t * padded;
      if (p.kv_dtype == MHA_DTYPE_F32) {
        pack_rows(static_cast<const float*>(data) + first, strides[2], strides[3], n, cols, out,
                  padded);
        return;
      }
      const float* scales = nullptr;
      int64_t scale_stride = 0;
      if (p.kv_dtype == MHA_DTYPE_I8) {
        scales = is_k ? mha_kernel::k_scales(p, b, kvh, j0 + t)
                      : mha_kernel::v_scales(p, b, kvh, j0 + t);
        scale_stride = is_k ? p.k_scale_strides[2] : p.v_scale_strides[2];
      }
      with_dtype(p.kv_dtype, [&](auto kv) {
        constexpr int32_t kKv = decltype(kv)::value;
        widen_rows<Arch, kKv>(static_cast<const element_t<kKv>*>(data) + first, strides[2],
                              strides[3], n, cols, scales, scale_stride, out, padded);
      });
    });
  }

  // The byte address of row (b, head, i) of a [batch, head, row, column]
  // tensor of `bytes`-byte elements.
  static const char* row_at(const void* data, const int64_t* strides, int64_t bytes, int64_t b,
                            int64_t head, int64_t i) {
    return static_cast<const char*>(data) +
           (b * strides[0] + head * strides[1] + i * strides[2]) * bytes;
  }
  static int64_t kv_element_bytes(const mha_kernel_problem& p) {
    return p.kv_dtype == MHA_DTYPE_I8 ? 1 : mha_types::float_bytes(p.kv_dtype);
  }

  // The K and V rows of the item this thread most likely runs next
  // (mha_work_item::next: its first heads' KV head and its keys) and its
  // first Q tile, queued into the L2 a few lines a step over this whole item
  // -- on the bf16 path, which copies K and V as pairs in one burst that
  // waited on their first read from memory (S1:bf16 on AMX, one thread:
  // about 13 % of the time in the copies).  Not for fp32 K and V: read in
  // place, their hardware prefetch runs ahead of the micro-kernels, and
  // widened into the fp32 cache (half precision on the avx512 plugin, S9's
  // rows apart) the queue took as long or longer (S9 1.03).  Returns
  // whether anything was queued.
  static bool queue_next_item(const mha_kernel_problem& p, const mha_work_item& item,
                              PrefetchQueue& queue) {
    const mha_work_item* next = item.next;
    if (next == nullptr || paged(p) || !pairs_cache(p)) return false;
    const int64_t kvh = mha_kernel::kv_head_of(p, next->h_begin);
    const int64_t keys = next->k_end - next->k_begin;
    const int64_t kv_bytes = kv_element_bytes(p), q_bytes = mha_types::float_bytes(p.q_dtype);
    if (p.k_strides[3] == 1) {
      queue.add(row_at(p.k, p.k_strides, kv_bytes, next->b, kvh, next->k_begin), p.k_strides[2],
                keys, p.d, kv_bytes, false);
    }
    if (p.v_strides[3] == 1) {
      queue.add(row_at(p.v, p.v_strides, kv_bytes, next->b, kvh, next->k_begin), p.v_strides[2],
                keys, p.dv, kv_bytes, false);
    }
    if (p.q_strides[3] == 1) {
      queue.add(row_at(p.q, p.q_strides, q_bytes, next->b, next->h_begin, next->q_begin),
                p.q_strides[2], std::min<int64_t>(QT, next->q_end - next->q_begin), p.d, q_bytes,
                false);
    }
    // Two lines a step: S1:bf16 on AMX (one thread, 3 alternating rounds)
    // took the same 0.93-0.95 of the time with 1, 2 or 4.
    queue.pace_fixed(2, /*into_l2=*/true);
    return true;
  }

  // What comes next, to fetch while this tile computes: after the last tile
  // of a head in an item of several heads (short sequences), the next head's
  // Q, K and V; otherwise the item's next query tile, or after its last, the
  // Q rows just before this tile, which the runtime's order (descending
  // query tiles of one head: plugin_abi.h) most likely hands this thread
  // next; then this tile's output rows -- first instead when they lie apart
  // (a packed batch's [total, H, Dv]): each row then starts a new page, which
  // the hardware prefetchers do not follow, and the final stores waited on
  // them (S9, one thread: 0.986 of the time, and 1/1.013 with the builds
  // swapped, 9 rounds; two threads 0.985; S1 as [B, L, H, D] views 1.000).
  static void queue_next_rows(const mha_kernel_problem& p, const mha_work_item& item, int64_t h,
                              int64_t q0, int64_t nq, PrefetchQueue& prefetch) {
    const int64_t q_bytes = mha_types::float_bytes(p.q_dtype);
    const int64_t kv_bytes = kv_element_bytes(p);
    const auto row_address = [b = item.b](const void* data, const int64_t* strides, int64_t bytes,
                                          int64_t head, int64_t i) {
      return row_at(data, strides, bytes, b, head, i);
    };
    const bool out_first = item.out_strides[1] != p.dv;
    const auto add_output = [&] {  // this tile's output rows, for writing
      if (item.out_strides[2] == 1) {
        prefetch.add(mha_types::element_at(item.out, item.out_dtype,
                                           (h - item.h_begin) * item.out_strides[0] +
                                               (q0 - item.q_begin) * item.out_strides[1]),
                     item.out_strides[1], nq, p.dv, mha_types::float_bytes(item.out_dtype), true);
      }
    };
    if (out_first) add_output();
    if (q0 + nq >= item.q_end && h + 1 < item.h_end) {
      if (p.q_strides[3] == 1) {
        prefetch.add(row_address(p.q, p.q_strides, q_bytes, h + 1, item.q_begin), p.q_strides[2],
                     std::min<int64_t>(QT, item.q_end - item.q_begin), p.d, q_bytes, false);
      }
      const int64_t kvh = mha_kernel::kv_head_of(p, h + 1);
      if (kvh != mha_kernel::kv_head_of(p, h)) {
        const int64_t keys = std::min<int64_t>(chosen_key_tile(), item.k_end - item.k_begin);
        if (p.k_strides[3] == 1 && !paged(p)) {
          prefetch.add(row_address(p.k, p.k_strides, kv_bytes, kvh, item.k_begin), p.k_strides[2],
                       keys, p.d, kv_bytes, false);
        }
        if (p.v_strides[3] == 1 && !paged(p)) {
          prefetch.add(row_address(p.v, p.v_strides, kv_bytes, kvh, item.k_begin), p.v_strides[2],
                       keys, p.dv, kv_bytes, false);
        }
      }
    } else if (q0 + nq < item.q_end && p.q_strides[3] == 1) {
      // An item of several query tiles takes them in ascending order.
      prefetch.add(row_address(p.q, p.q_strides, q_bytes, h, q0 + nq), p.q_strides[2],
                   std::min<int64_t>(QT, item.q_end - q0 - nq), p.d, q_bytes, false);
    } else if (q0 >= QT && p.q_strides[3] == 1) {
      prefetch.add(row_address(p.q, p.q_strides, q_bytes, h, q0 - QT), p.q_strides[2], QT, p.d,
                   q_bytes, false);
    }
    // Last: what is needed last (and the queue may not reach).
    if (!out_first) add_output();
  }

  // qt[x][r] = Q[q0 + r][x] · c (scale · log2(e) in base-2 units); whole
  // W x W blocks go through a register transpose, the edges element by
  // element; padding lanes are 0.
  static void pack_queries(const mha_kernel_problem& p, const Tile& t, int64_t b, int64_t h,
                           int64_t q0, int64_t nq, float c) {
    // Half-precision Q is widened into a dense fp32 staging tile first.
    const float* first = nullptr;
    int64_t row_stride = p.q_strides[2], col_stride = p.q_strides[3];
    if (p.q_dtype == MHA_DTYPE_F32) {
      first = mha_kernel::q_row(p, b, h, q0);
    } else {
      with_dtype(p.q_dtype, [&](auto dt) {
        constexpr int32_t kQ = decltype(dt)::value;
        widen_rows<Arch, kQ>(mha_kernel::q_row<element_t<kQ>>(p, b, h, q0), p.q_strides[2],
                             p.q_strides[3], nq, p.d, nullptr, 0, t.q_stage, p.d);
      });
      first = t.q_stage;
      row_stride = p.d;
      col_stride = 1;
    }
    // The partial last vector is zeroed first, so its padding lanes are 0.
    const int64_t whole = nq / W * W;
    if (whole < nq) {
      for (int64_t x = 0; x < p.d; ++x) B(0.0f).store_aligned(t.qt + x * QT + whole);
    }
    int64_t r0 = 0;
    if (col_stride == 1) {
      for (; r0 < whole; r0 += W) {
        const float* q = first + r0 * row_stride;
        int64_t x0 = 0;
        for (; x0 + W <= p.d; x0 += W) {
          B rows[W];
          for (int i = 0; i < W; ++i) rows[i] = B::load_unaligned(q + i * row_stride + x0) * c;
          transpose_square<Arch>(rows);
          for (int j = 0; j < W; ++j) rows[j].store_aligned(t.qt + (x0 + j) * QT + r0);
        }
        for (int i = 0; i < W; ++i) {
          for (int64_t x = x0; x < p.d; ++x) t.qt[x * QT + r0 + i] = q[i * row_stride + x] * c;
        }
      }
    }
    for (int64_t r = r0; r < nq; ++r) {
      const float* q = first + r * row_stride;
      for (int64_t x = 0; x < p.d; ++x) t.qt[x * QT + r] = q[x * col_stride] * c;
    }
  }

  // Per query vector v, the keys [band[v], band[QT / W + v]) of the tile
  // (starting at key j_rel0 of the item) that some lane of v sees: a key
  // outside every lane's limits need not be computed.
  static void set_band(const Tile& t, int nqv, int64_t j_rel0, int keys) {
    for (int v = 0; v < nqv; ++v) {
      int64_t lo = keys, hi = 0;
      for (int r = v * W; r < (v + 1) * W; ++r) {
        lo = std::min(lo, t.first_key[r] - j_rel0);
        hi = std::max(hi, t.last_key[r] - j_rel0 + 1);
      }
      t.band[v] = static_cast<int32_t>(std::clamp<int64_t>(lo, 0, keys));
      t.band[QT / W + v] = static_cast<int32_t>(std::clamp<int64_t>(hi, 0, keys));
    }
  }

  // The score micro-kernel over a key tile.  Returns false when the fused
  // path's stale maximum was exceeded; then nothing of the tile is kept
  // (row_sum is untouched, alpha is 1 otherwise).  banded: only the query
  // vectors whose band (set_band) meets a key group compute it -- the
  // vectors of a group that need it are a run, computed together; what is
  // left out is masked to -inf afterwards.
  //
  // Fused and banded (fp32 only): each lane's probabilities are masked to 0
  // outside its limits by the micro-kernel (t.tile_bounds from
  // visibility_bounds), and the vectors left out of a key group get zeros, so
  // that the banded P·V reads only probabilities of this tile.
  //
  // kSetMax (fused, not banded): the query tile's first key tile, before any
  // maximum is known: each query vector's first key group sets row_max.
  template <bool kDot, bool kFused, bool kSetMax = false>
  static bool compute_scores(const Tile& t, const KeyTile<kDot>& kv, int64_t d,
                             const ScoreUnits& units, int nqv, int keys, PrefetchQueue& prefetch,
                             bool banded = false) {
    static_assert(!kSetMax || kFused, "kSetMax: the fused path");
    constexpr int QV = Blk::kScoreQueryVectors, NK = Blk::kScoreKeys;
    if constexpr (kFused) {
      for (int v = 0; v < nqv; ++v) B(0.0f).store_aligned(t.tile_sum + v * W);
    }
    if constexpr (kDot && kAmxBuilt) {
      if (t.amx) return amx_scores<kFused, kSetMax>(t, kv, d, units, nqv, keys, prefetch);
    }
    const float* first_bound = t.tile_bounds;
    const float* last_bound = t.tile_bounds + int64_t{nqv} * W;
    // Zero probabilities for vectors [v_begin, v_end) of keys j .. j + nk.
    const auto zero = [&](int v_begin, int v_end, int j, int nk) {
      for (int n = j; n < j + nk; ++n) {
        for (int v = v_begin; v < v_end; ++v) B(0.0f).store_aligned(t.scores + n * QT + v * W);
      }
    };
    bool within = true;
    for (int v_group = 0; v_group < nqv; v_group += QV) {
      const int group_end = std::min(QV, nqv - v_group) + v_group;
      for (int j = 0; j < keys; j += NK) {
        prefetch.step();
        const int nk = std::min(NK, keys - j);
        for (int n = 0; v_group == 0 && n < nk && kv.v_fetch > 0; ++n) {
          prefetch_row<3>(kv.v + (j + n) * kv.v_stride, kv.v_fetch);
        }
        int v0 = v_group, v_end = group_end;
        if (banded) {  // the first and last vectors of the group that see a key of j .. j + nk
          while (v0 < v_end && (t.band[v0] >= j + nk || t.band[QT / W + v0] <= j)) ++v0;
          while (v_end > v0 && (t.band[v_end - 1] >= j + nk || t.band[QT / W + v_end - 1] <= j)) {
            --v_end;
          }
          if constexpr (kFused && !kDot) {
            zero(v_group, v0, j, nk);
            zero(v_end, group_end, j, nk);
          }
          if (v0 == v_end) continue;
        }
        const int nv = v_end - v0;
        with_count<QV>(nv, [&](auto NV) {
          with_count<NK>(nk, [&](auto NKc) {
            constexpr int kNV = decltype(NV)::value, kNK = decltype(NKc)::value;
            // The first key group of a kSetMax tile sets row_max; the others
            // read it.
            const auto per_group = [&](auto block) {
              if (kSetMax && j == 0) {
                block(std::bool_constant<kSetMax>{});
              } else {
                block(std::false_type{});
              }
            };
            if constexpr (kDot) {
              per_group([&](auto set_max) {
                Dot::template score_block<QT, kNV, kNK, kFused, decltype(set_max)::value>(
                    reinterpret_cast<const uint32_t*>(t.qt) + v0 * W, kv.k + j * kv.k_stride,
                    kv.k_stride, (d + 1) / 2, units.q_factor, t.scores + j * QT + v0 * W,
                    t.p_pairs + j / 2 * QT + v0 * W, t.row_max + v0 * W, t.tile_sum + v0 * W);
              });
            } else if (kFused && banded) {  // masked by lane (kBounded = kFused, true here)
              score_block<Arch, QT, kNV, kNK, kFused, kFused>(
                  t.qt + v0 * W, kv.k + j * kv.k_stride, kv.k_stride, d, t.scores + j * QT + v0 * W,
                  t.row_max + v0 * W, t.tile_sum + v0 * W, first_bound + v0 * W,
                  last_bound + v0 * W, j);
            } else {
              per_group([&](auto set_max) {
                score_block<Arch, QT, kNV, kNK, kFused, false, decltype(set_max)::value>(
                    t.qt + v0 * W, kv.k + j * kv.k_stride, kv.k_stride, d,
                    t.scores + j * QT + v0 * W, t.row_max + v0 * W, t.tile_sum + v0 * W);
              });
            }
          });
        });
      }
    }
    if constexpr (kFused) within = take_fused_sums(t, nqv);
    return within;
  }

  // A fused tile's probabilities against the stale maximum: within bounds
  // when their sums are (NaN is not: the two-pass path sees it); then they
  // join the row sums, and the accumulators are not rescaled.
  static bool take_fused_sums(const Tile& t, int nqv) {
    const B bound(std::exp2(kMaxGrowth));
    for (int v = 0; v < nqv; ++v) {
      if (!xsimd::all(B::load_aligned(t.tile_sum + v * W) <= bound)) return false;
    }
    for (int v = 0; v < nqv; ++v) {
      (B::load_aligned(t.row_sum + v * W) + B::load_aligned(t.tile_sum + v * W))
          .store_aligned(t.row_sum + v * W);
      B(1.0f).store_aligned(t.alpha + v * W);
    }
    return true;
  }

  // compute_scores on AMX tiles: the tile's K rows packed into whole tiles,
  // every key against every query vector (a banded tile's hidden keys are
  // masked afterwards, as they are for the dot products), then the dot
  // products' epilogue over the stored scores.
  template <bool kFused, bool kSetMax>
  static bool amx_scores(const Tile& t, const KeyTile<true>& kv, int64_t d, const ScoreUnits& units,
                         int nqv, int keys, PrefetchQueue& prefetch) {
    if constexpr (kAmxBuilt) {
      if (kFused && t.amx_rows) {
        const int64_t rows = round_up(int64_t{nqv} * W, 32), s_stride = 2 * t.p_stride;
        Amx::scores_rows(t.q_amx, rows, d, kv.k_t, t.kt_stride, keys, t.scores, s_stride);
        Amx::template row_epilogue<kSetMax>(t.scores, s_stride, rows, keys, units.q_factor,
                                            t.p_rows, t.p_stride, t.row_max, t.tile_sum,
                                            [&prefetch] { prefetch.step(); });
        return take_fused_sums(t, nqv);
      }
      const auto rows = Amx::key_rows(kv.k, kv.k_stride, keys, d, t.k_amx);
      Amx::template scores<QT>(rows, keys, d, reinterpret_cast<const uint32_t*>(t.qt), nqv,
                               t.scores);
      Amx::template score_epilogue<QT, kFused, kSetMax>(t.scores, nqv, keys, units.q_factor,
                                                        t.p_pairs, t.row_max, t.tile_sum);
    }
    return !kFused || take_fused_sums(t, nqv);
  }

  // The keys [lo, hi) of a banded tile (starting at key j_rel0 of the item)
  // that some row of r0 .. r0 + nr sees; whole pairs on the bf16 path.
  template <bool kDot>
  static std::pair<int, int> keys_seen(const Tile& t, int64_t r0, int nr, int64_t j_rel0,
                                       int keys) {
    int64_t first = keys, last = -1;
    for (int64_t r = r0; r < r0 + nr; ++r) {
      first = std::min(first, t.first_key[r] - j_rel0);
      last = std::max(last, t.last_key[r] - j_rel0);
    }
    int lo = static_cast<int>(std::clamp<int64_t>(first, 0, keys));
    int hi = static_cast<int>(std::clamp<int64_t>(last + 1, 0, keys));
    if constexpr (kDot) {
      lo &= ~1;
      hi = std::min((keys + 1) & ~1, (hi + 1) & ~1);
    }
    return {lo, hi};
  }

  // The P·V micro-kernel over a query tile's only key tile, in one run,
  // written straight to the output rows (`out`, rows out_stride apart): each
  // row's sums times t.alpha (1 / the row's softmax sum), the values checked
  // as stored into t.poison.  The same operations as accumulate_pv's
  // overwrite followed by write_item_rows, so the same bits, without the
  // accumulators' stores and second pass: S4 (one 64-key tile per head)
  // 0.974 and 0.969 of the time (Zen 5, in-process A/B, builds swapped),
  // AVX2 0.980.
  // (A template, as it was measured: the plain member function GCC built
  // with pv_block inlined into it ran S4 1.10x slower.)
  template <bool kDot>
  static void pv_to_output(const Tile& t, const KeyTile<kDot>& kv, int64_t dvp, int64_t nq,
                           int keys, PrefetchQueue& prefetch, float* out, int64_t out_stride) {
    constexpr int R = Blk::kPvRows, C = Blk::kPvVectors;
    const int vectors = static_cast<int>(dvp / W);
    for (int64_t r0 = 0; r0 < nq; r0 += R) {
      const int nr = static_cast<int>(std::min<int64_t>(R, nq - r0));
      for (int c0 = 0; c0 < vectors; c0 += C) {
        prefetch.step();
        const int nc = std::min(C, vectors - c0);
        with_count<R>(nr, [&](auto NR) {
          with_count<C>(nc, [&](auto NC) {
            pv_block<Arch, QT, decltype(NR)::value, decltype(NC)::value, PvJoin::kOutput>(
                t.scores + r0, t.alpha + r0, kv.v + c0 * W, kv.v_stride, keys,
                out + r0 * out_stride + c0 * W, out_stride, t.poison);
          });
        });
      }
    }
  }

  // The P·V micro-kernel over a key tile.  banded (a tile crossing a limit,
  // starting at key j_rel0 of the item): each block of rows sums only the
  // keys its rows see -- the others' weights are 0, and on finite V (the
  // guarded path takes the rest) leaving them out changes no bit.
  //
  // The keys go in runs whose V rows stay in the L1 while every block of
  // rows sums them (pv_run_keys): the first run rescales the accumulators
  // (or overwrites them: `overwrite`, a query tile's first key tile), the
  // later ones add to them.  A banded tile, and the bf16 path, take one run.
  template <bool kDot>
  static void accumulate_pv(const Tile& t, const KeyTile<kDot>& kv, int64_t dvp, int64_t nq,
                            int keys, PrefetchQueue& prefetch, bool banded = false,
                            int64_t j_rel0 = 0, bool overwrite = false, bool p_rows_ready = false) {
    if constexpr (kDot && kAmxBuilt) {
      if (t.amx) {
        amx_pv(t, kv, dvp, nq, keys, p_rows_ready);
        return;
      }
    }
    constexpr int R = Blk::kPvRows, C = Blk::kPvVectors;
    const int vectors = static_cast<int>(dvp / W);
    const int run = banded || kDot ? keys : t.pv_run;
    for (int k0 = 0; k0 < keys; k0 += run) {
      for (int64_t r0 = 0; r0 < nq; r0 += R) {
        const int nr = static_cast<int>(std::min<int64_t>(R, nq - r0));
        int lo = k0, hi = std::min(keys, k0 + run);  // the keys these rows see
        if (banded) std::tie(lo, hi) = keys_seen<kDot>(t, r0, nr, j_rel0, keys);
        if (hi <= lo) {  // no key of this tile: only the rescale
          for (int r = 0; r < nr; ++r) {
            const B a(t.alpha[r0 + r]);
            for (int c = 0; c < vectors; ++c) {
              float* out = t.acc + (r0 + r) * dvp + c * W;
              (B::load_aligned(out) * a).store_aligned(out);
            }
          }
          continue;
        }
        for (int c0 = 0; c0 < vectors; c0 += C) {
          prefetch.step();
          const int nc = std::min(C, vectors - c0);
          float* acc = t.acc + r0 * dvp + c0 * W;
          with_count<R>(nr, [&](auto NR) {
            with_count<C>(nc, [&](auto NC) {
              constexpr int kNR = decltype(NR)::value, kNC = decltype(NC)::value;
              if constexpr (kDot) {
                Dot::template pv_block<QT, kNR, kNC>(t.p_pairs + lo / 2 * QT + r0, t.alpha + r0,
                                                     kv.v + lo / 2 * kv.v_stride + c0 * W,
                                                     kv.v_stride, (hi - lo + 1) / 2, acc, dvp);
              } else {
                const float* probs = t.scores + lo * QT + r0;
                const float* v = kv.v + lo * kv.v_stride + c0 * W;
                if (k0 > 0) {
                  pv_block<Arch, QT, kNR, kNC, PvJoin::kAdd>(probs, t.alpha + r0, v, kv.v_stride,
                                                             hi - lo, acc, dvp);
                } else if (overwrite) {  // every row and column (not banded)
                  pv_block<Arch, QT, kNR, kNC, PvJoin::kOverwrite>(probs, t.alpha + r0, v,
                                                                   kv.v_stride, hi - lo, acc, dvp);
                } else {
                  pv_block<Arch, QT, kNR, kNC>(probs, t.alpha + r0, v, kv.v_stride, hi - lo, acc,
                                               dvp);
                }
              }
            });
          });
        }
      }
    }
  }

  // accumulate_pv on AMX tiles: the accumulators rescaled, then the tile's
  // probabilities, 32 rows at a time, as the product's A operand -- the rows
  // the fused rows epilogue wrote (p_rows_ready), or the probability pairs
  // transposed into them -- multiplied with V's pairs of keys.  Every key of
  // the tile (a banded tile's hidden keys weigh 0, and their V is finite:
  // the bf16 path checked it).  Rows from nq to the block's end hold
  // whatever the padding lanes give, and are never read.
  static void amx_pv(const Tile& t, const KeyTile<true>& kv, int64_t dvp, int64_t nq, int keys,
                     bool p_rows_ready) {
    if constexpr (kAmxBuilt) {
      // A fused tile leaves alpha 1: nothing to rescale.
      bool rescale = false;
      for (int64_t r = 0; r < nq && !rescale; r += W) {
        rescale = xsimd::any(B::load_aligned(t.alpha + r) != B(1.0f));
      }
      for (int64_t r = 0; r < nq && rescale; ++r) {
        const B a(t.alpha[r]);
        for (int64_t c = 0; c < dvp; c += W) {
          float* out = t.acc + r * dvp + c;
          (B::load_aligned(out) * a).store_aligned(out);
        }
      }
      const int n_pairs = (keys + 1) / 2, row_pairs = Amx::padded_keys(keys) / 2;
      for (int64_t r0 = 0; r0 < nq; r0 += 2 * W) {
        uint32_t* rows = t.p_rows + r0 * t.p_stride;
        if (!p_rows_ready) {
          Amx::template transpose_pairs<QT>(t.p_pairs, r0, n_pairs, row_pairs, rows, t.p_stride);
        }
        Amx::pv(rows, static_cast<int>(t.p_stride), kv.v, kv.v_stride, n_pairs, t.acc + r0 * dvp,
                dvp, t.v_stage);
      }
    }
  }
};

}  // namespace mha_simd
