// _mha.varlen_attention: one mha_attention_varlen call over the caller's
// arrays (a packed batch, FlashAttention-2's varlen layout, or a paged KV
// cache), without the GIL.  Arguments arrive checked for their Python types
// and with the outputs allocated (mha/_varlen.py); shapes, dtypes and the
// offsets' values are the library's to check, and its message names the
// argument.  The checks made here are FlashAttention-2's max_seqlen_q /
// max_seqlen_k (when given, no sequence may be longer) and, for a paged
// cache whose lengths come as FlashAttention-2 gives them -- cu_seqlens_k
// with the block table --, those offsets, whose differences become the
// library's seqused_k.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "array_view.h"
#include "attention_params.h"
#include "bindings.h"
#include "call_settings.h"
#include "common/dtype.h"
#include "errors.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

using namespace packed_batch;

// FlashAttention-2 sizes its work by max_seqlen_q and max_seqlen_k: a longer
// sequence would be cut short there.  Refuses a bound below the longest
// sequence of int32 offsets (offsets of another dtype or rank are left to the
// library, which refuses them by name).
void check_max_seqlen(const mha_tensor& cu, const char* offsets_name,
                      std::optional<int64_t> max_seqlen, const char* max_name, const char* tokens) {
  if (!max_seqlen || cu.dtype != MHA_DTYPE_I32 || cu.ndim != 1) return;
  const auto* offsets = static_cast<const int32_t*>(cu.data);
  for (int64_t b = 0; b + 1 < cu.shape[0]; ++b) {
    const int64_t length = static_cast<int64_t>(offsets[(b + 1) * cu.strides[0]]) -
                           static_cast<int64_t>(offsets[b * cu.strides[0]]);
    if (length <= *max_seqlen) continue;
    throw nb::value_error((std::string(max_name) + " = " + std::to_string(*max_seqlen) +
                           " but sequence " + std::to_string(b) + " of " + offsets_name + " has " +
                           std::to_string(length) + " " + tokens +
                           ": it must be at least the longest sequence's length (or None)")
                              .c_str());
  }
}

// The same for seqused_k's counts (I32 [B]; others are left to the library).
void check_max_used(const mha_tensor& used, std::optional<int64_t> max_seqlen_k) {
  if (!max_seqlen_k || used.dtype != MHA_DTYPE_I32 || used.ndim != 1) return;
  const auto* counts = static_cast<const int32_t*>(used.data);
  for (int64_t b = 0; b < used.shape[0]; ++b) {
    const int64_t count = counts[b * used.strides[0]];
    if (count <= *max_seqlen_k) continue;
    throw nb::value_error(("max_seqlen_k = " + std::to_string(*max_seqlen_k) + " but sequence " +
                           std::to_string(b) + " of seqused_k uses " + std::to_string(count) +
                           " keys: it must be at least the longest sequence's length (or None)")
                              .c_str());
  }
}

// FlashAttention-2's paged call: the keys of sequence b are the first
// cu_seqlens_k[b+1] - cu_seqlens_k[b] of its pages.  The library takes those
// counts as seqused_k (and refuses cu_seqlens_k with a block table), so they
// are computed here, once the offsets are checked as the library checks
// packed ones: I32, as many entries as cu_seqlens_q, starting at 0,
// non-decreasing.  Refusals are mha.Error, as the library's would be.
std::vector<int32_t> key_counts(const mha_tensor& cu, const mha_tensor& cu_q) {
  const char* hint = " (with block_table, its differences are each sequence's number of keys)";
  if (cu.dtype != MHA_DTYPE_I32) {
    throw library_error(MHA_ERR_INVALID_DTYPE, std::string("cu_seqlens_k has dtype ") +
                                                   mha_types::dtype_name(cu.dtype) +
                                                   "; it must be i32" + hint);
  }
  if (cu.shape[0] != cu_q.shape[0]) {
    throw library_error(MHA_ERR_SHAPE_MISMATCH,
                        "cu_seqlens_k has shape [" + std::to_string(cu.shape[0]) +
                            "] but cu_seqlens_q has " + std::to_string(cu_q.shape[0]) +
                            " entries; they must agree (B + 1)" + hint);
  }
  const auto* offsets = static_cast<const int32_t*>(cu.data);
  const auto at = [&](int64_t i) { return static_cast<int64_t>(offsets[i * cu.strides[0]]); };
  if (cu.shape[0] > 0 && at(0) != 0) {
    throw library_error(MHA_ERR_INVALID_VALUE,
                        "cu_seqlens_k[0] = " + std::to_string(at(0)) + "; it must be 0" + hint);
  }
  std::vector<int32_t> counts;
  for (int64_t b = 0; b + 1 < cu.shape[0]; ++b) {
    if (at(b + 1) < at(b)) {
      throw library_error(MHA_ERR_INVALID_VALUE, "cu_seqlens_k[" + std::to_string(b + 1) +
                                                     "] = " + std::to_string(at(b + 1)) +
                                                     " is below cu_seqlens_k[" + std::to_string(b) +
                                                     "] = " + std::to_string(at(b)) +
                                                     "; the offsets must not decrease" + hint);
    }
    counts.push_back(static_cast<int32_t>(at(b + 1) - at(b)));
  }
  return counts;
}

void varlen_attention(nb::handle q_object, nb::handle k_object, nb::handle v_object,
                      nb::handle out_object, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
                      nb::handle seqused_k, nb::handle block_table,
                      std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
                      nb::handle lse, nb::handle k_scale, nb::handle v_scale,
                      std::optional<double> scale, int32_t causal, double dropout_p,
                      uint64_t dropout_seed, int64_t window_left, int64_t window_right,
                      nb::handle sinks, double softcap, nb::handle alibi_slopes,
                      std::optional<std::string> backend, std::optional<int32_t> threads) {
  const ArrayView q(q_object, "q", Access::read_only, kPacked);
  const ArrayView k(k_object, "k", Access::read_only, kKeys);
  const ArrayView v(v_object, "v", Access::read_only, kKeys);
  ArrayView o(out_object, "out", Access::writable, kPacked);
  const ArrayView cu_q(cu_seqlens_q, "cu_seqlens_q", Access::read_only, kOffsets);
  const std::optional<ArrayView> cu_k =
      optional_view(cu_seqlens_k, "cu_seqlens_k", Access::read_only, kOffsets);
  const std::optional<ArrayView> used =
      optional_view(seqused_k, "seqused_k", Access::read_only, kLengths);
  const std::optional<ArrayView> table =
      optional_view(block_table, "block_table", Access::read_only, kTable);
  check_max_seqlen(cu_q.tensor(), "cu_seqlens_q", max_seqlen_q, "max_seqlen_q", "queries");
  if (cu_k) check_max_seqlen(cu_k->tensor(), "cu_seqlens_k", max_seqlen_k, "max_seqlen_k", "keys");
  if (used) check_max_used(used->tensor(), max_seqlen_k);
  // A paged cache with FlashAttention-2's cu_seqlens_k: its differences as seqused_k.
  std::vector<int32_t> counts;
  mha_tensor derived{};
  const bool derive = table && cu_k && !used;
  if (derive) {
    counts = key_counts(cu_k->tensor(), cu_q.tensor());
    derived.data = counts.data();
    derived.dtype = MHA_DTYPE_I32;
    derived.ndim = 1;
    derived.shape[0] = static_cast<int64_t>(counts.size());
    derived.strides[0] = 1;
  }
  const AttentionParamViews views({lse, k_scale, v_scale, sinks, alibi_slopes, scale, causal,
                                   dropout_p, dropout_seed, window_left, window_right, softcap},
                                  {kLse, kRowScales});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &cu_q.tensor();
  varlen.cu_seqlens_k = cu_k && !derive ? &cu_k->tensor() : nullptr;
  varlen.seqused_k = derive ? &derived : used ? &used->tensor() : nullptr;
  varlen.block_table = table ? &table->tensor() : nullptr;
  const mha_attention_params& params = views.params();

  const CallOverrides overrides{std::move(backend), threads};
  nb::gil_scoped_release without_gil;
  CallSettings::instance().run(overrides, [&] {
    return mha_attention_varlen(&q.tensor(), &k.tensor(), &v.tensor(), &o.tensor(), &varlen,
                                &params);
  });
}

}  // namespace

void register_varlen(nb::module_& module) {
  module.def("varlen_attention", &varlen_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
             nb::arg("out"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k").none(),
             nb::arg("seqused_k").none(), nb::arg("block_table").none(),
             nb::arg("max_seqlen_q").none(), nb::arg("max_seqlen_k").none(), nb::arg("lse").none(),
             nb::arg("k_scale").none(), nb::arg("v_scale").none(), nb::arg("scale").none(),
             nb::arg("causal"), nb::arg("dropout_p"), nb::arg("dropout_seed"),
             nb::arg("window_left"), nb::arg("window_right"), nb::arg("sinks").none(),
             nb::arg("softcap"), nb::arg("alibi_slopes").none(), nb::arg("backend").none(),
             nb::arg("threads").none(),
             "Attention over each sequence of a packed batch (q [total_q, H, D], k and v "
             "[total_k, Hkv, D], offsets cu_seqlens_q and cu_seqlens_k, optionally seqused_k) or "
             "over a paged KV cache (k and v [num_blocks, block_size, Hkv, D], block_table, "
             "seqused_k or FlashAttention-2's cu_seqlens_k), written into `out` (and the "
             "log-sum-exp [H, total_q] into `lse`).  Internal: use mha.varlen_attention.");
}

}  // namespace mha_python
