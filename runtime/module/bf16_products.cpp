// The module's products on AMX tiles (bf16_products.h).
#include "bf16_products.h"

#include <algorithm>
#include <atomic>
#include <new>

#include "blis.h"
#include "common/dtype.h"
#include "module.h"
#include "registry.h"
#include "threads.h"

namespace mha::rt {
namespace {

// The plugin's scratch for run(), per calling thread.
thread_local AlignedBuffer t_bf16_scratch;

// Rows of one call of the plugin's run() at most: the plugin groups them by
// its L2 and reads every packed panel once per group, so calls are long.
constexpr int64_t kRowsPerCall = 1024;

// The selected backend's bf16 products: on AMX tiles where the runtime
// granted them (bf16_dot 2: CPU, OS and the process's permission), with bf16
// dot products where it chose those over widening (bf16_dot 1: Zen 4 and 5,
// which run vdpbf16ps at twice their FMA rate; runtime/bf16_dot.cpp).
// *tiles says which.
const mha_bf16_gemm* chosen_products(bool* tiles) {
  const char* why = nullptr;
  const Backend* backend = Registry::instance().selected(&why);
  if (backend == nullptr || backend->plugin == nullptr || backend->tiles.bf16_dot < 1) {
    return nullptr;
  }
  *tiles = backend->tiles.bf16_dot == 2;
  return backend->plugin->bf16_gemm;
}

bool holds_bf16_value(float x) {
  return mha_types::bf16_to_f32(mha_types::f32_to_bf16(x)) == x;  // NaN: false
}

// The weights wt [k rows, n columns, ld apart] packed for `gemm`, packed now
// if they were not; nullptr when some weight is not a bf16 value (the
// products would then differ from BLIS's) or the memory is not there.
const Bf16WeightCache::Packed* packed_for(Bf16WeightCache& cache, const mha_bf16_gemm* gemm,
                                          const float* wt, int64_t ld, int64_t n, int64_t k) {
  const std::lock_guard<std::mutex> lock(cache.mutex);
  for (const auto& e : cache.entries) {
    if (e->plugin_gemm == gemm && e->wt == wt && e->n == n && e->k == k) {
      return e->exact ? e.get() : nullptr;
    }
  }
  auto entry = std::make_unique<Bf16WeightCache::Packed>();
  entry->plugin_gemm = gemm;
  entry->wt = wt;
  entry->n = n;
  entry->k = k;
  entry->exact = true;
  for (int64_t p = 0; p < k && entry->exact; ++p) {
    for (int64_t j = 0; j < n; ++j) {
      if (!holds_bf16_value(wt[p * ld + j])) {
        entry->exact = false;
        break;
      }
    }
  }
  if (entry->exact) {
    void* panels = entry->panels.get(gemm->packed_bytes(n, k));
    if (panels == nullptr) return nullptr;  // not cached: tried again next call
    gemm->pack(n, k, wt, ld, panels);
    entry->data = panels;
  }
  cache.entries.push_back(std::move(entry));
  return cache.entries.back()->exact ? cache.entries.back().get() : nullptr;
}

}  // namespace

const char* bf16_products_kind() {
  bool tiles = false;
  if (chosen_products(&tiles) == nullptr) return "none";
  return tiles ? "amx" : "dot";
}

bool run_on_tiles(const mha_module& m, const TileProduct& t, const float* wt, int64_t ld, int64_t n,
                  int64_t k, bool bias, int32_t threads) {
  constexpr int64_t kStep = 32;  // the tiles' step along k
  // (The plugin pads rows and k to whole blocks and steps as it packs them.)
  if (t.gemms * t.rows < kStep || k < kStep) return false;
  if (t.c16 != nullptr && !t.a_bf16) return false;
  bool tiles = false;
  const mha_bf16_gemm* gemm = chosen_products(&tiles);
  // An fp32 A split into three bf16 parts takes three times the products:
  // only the tiles' rate (14x the FMAs') repays that.
  if (gemm == nullptr || (!t.a_bf16 && !tiles)) return false;
  const Bf16WeightCache::Packed* w = packed_for(*m.bf16_cache, gemm, wt, ld, n, k);
  if (w == nullptr) return false;
  const float* bias_row = bias ? wt + k * ld : nullptr;
  const size_t scratch_bytes = t.a_bf16 ? gemm->scratch_bytes(k) : gemm->split_scratch_bytes(k);
  const int32_t team = sgemm_threads(t.gemms * t.rows, n, k, threads);
  // Calls of about equal rows, at least one per thread.
  const int64_t calls_per_gemm = (t.rows + kRowsPerCall - 1) / kRowsPerCall;
  const int64_t calls = std::max<int64_t>(calls_per_gemm, (team + t.gemms - 1) / t.gemms);
  const int64_t rows_per_call = ((t.rows + calls - 1) / calls + kStep - 1) / kStep * kStep;
  const int64_t per_gemm = (t.rows + rows_per_call - 1) / rows_per_call;
  std::atomic<bool> failed{false};
  const bool ran = run_team(
      t.gemms * per_gemm, team,
      [&](int32_t /*thread*/) { return t_bf16_scratch.get(scratch_bytes) != nullptr; },
      [&](int64_t index, int32_t /*thread*/) {
        const int64_t g = index / per_gemm, r0 = index % per_gemm * rows_per_call;
        const int64_t count = std::min(rows_per_call, t.rows - r0);
        const int64_t a_at = g * t.a_gemm_stride + r0 * t.lda;
        const int64_t c_at = g * t.c_gemm_stride + r0 * t.ldc;
        void* scratch = t_bf16_scratch.get(scratch_bytes);
        const auto* a16 = static_cast<const uint16_t*>(t.a) + a_at;
        int code = 0;
        if (t.c16 != nullptr) {
          code = gemm->run_to_bf16(count, n, k, a16, t.lda, w->data, bias_row, t.c16 + c_at, t.ldc,
                                   t.c16_slab > 0 ? t.c16_slab : n, t.c16_slab_stride, scratch);
        } else if (t.a_bf16) {
          code = gemm->run(count, n, k, a16, t.lda, w->data, bias_row, t.c + c_at, t.ldc, scratch);
        } else {
          code = gemm->run_split(count, n, k, static_cast<const float*>(t.a) + a_at, t.lda, w->data,
                                 bias_row, t.c + c_at, t.ldc, scratch);
        }
        if (code != 0) failed = true;
      });
  if (!ran) throw std::bad_alloc();
  return !failed;  // a refused call: BLIS writes every row again
}

bool project_bf16(const mha_module& m, const mha_tensor& x, const RowOrder& order, const float* wt,
                  int64_t ld, int64_t n, bool bias, float* dst, int64_t width, int32_t threads) {
  if ((x.dtype != MHA_DTYPE_BF16 && x.dtype != MHA_DTYPE_F32) || x.strides[2] != 1) return false;
  const TileProduct t{x.data,
                      x.dtype == MHA_DTYPE_BF16,
                      order.gemms,
                      order.rows,
                      order.row_stride,
                      order.gemm_stride,
                      dst,
                      width,
                      order.rows * width};
  return run_on_tiles(m, t, wt, ld, n, x.shape[2], bias, threads);
}

bool project_bf16_rounded(const mha_module& m, const mha_tensor& x, const RowOrder& order,
                          const float* wt, int64_t ld, int64_t n, bool bias, uint16_t* dst,
                          int64_t d, int32_t threads) {
  if (x.dtype != MHA_DTYPE_BF16 || x.strides[2] != 1) return false;
  // Row r of the product (r = g · rows + i) at r · d within its head's slab.
  TileProduct t{x.data,  true, order.gemms,   order.rows, order.row_stride, order.gemm_stride,
                nullptr, d,    order.rows * d};
  t.c16 = dst;
  t.c16_slab = d;
  t.c16_slab_stride = order.gemms * order.rows * d;
  return run_on_tiles(m, t, wt, ld, n, x.shape[2], bias, threads);
}

}  // namespace mha::rt
