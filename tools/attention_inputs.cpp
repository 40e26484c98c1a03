// mha-run's attention inputs: Q, K and V (converted or quantised to the
// dtypes mha gets), the masks, lengths, offsets and block tables, and the
// call's descriptors over them and over the outputs.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attention_run.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

// Q, K or V as the file holds it (converted later, to the dtype mha gets).
NpyArray read_float_tensor(const char* flag, const std::string& path, const char* role,
                           const char* shapes) {
  NpyArray a = read_input(flag, path);
  if (!is_float(a.dtype()) || (a.rank() != 4 && a.rank() != 3)) {
    throw ToolError(input_label(flag, path) + ": " + role +
                    " must be float32 (<f4), float16 (<f2) or float64 (<f8) of rank 4 " + shapes +
                    " or rank 3 (one batch, B = 1); the file holds " + a.describe());
  }
  return a;
}

// K or V quantised to int8 with one scale per row (mha_quantize_kv), from
// its float32 values; the scales are K's (V's) shape without the last dimension.
TypedInput quantize_input(NpyArray array, const std::string& what, NpyArray& scale,
                          bool add_batch) {
  const NpyDtype file_dtype = array.dtype();
  // Named here, in the file's own axes (the library would see them shifted
  // by the batch axis added below).
  for (size_t d = 0; d < array.shape().size(); ++d) {
    if (array.shape()[d] == 0) {
      throw ToolError(what + ": shape[" + std::to_string(d) + "] = 0; sizes must be positive");
    }
  }
  TypedInput values = convert_float_input(std::move(array), MHA_DTYPE_F32, what);
  TypedInput q8;
  q8.dtype = MHA_DTYPE_I8;
  q8.shape = values.shape;
  q8.strides = values.strides;
  q8.converted.assign((static_cast<std::size_t>(values.size()) + 7) / 8 + 1, 0);
  std::vector<int64_t> scale_shape = values.shape;
  scale_shape.pop_back();
  scale = NpyArray(NpyDtype::F32, scale_shape);
  mha_tensor src = describe_input(values, what, add_batch);
  mha_tensor dst = describe_input(q8, what, add_batch);
  mha_tensor scales = describe_array(scale, MHA_DTYPE_F32, what + " (its row scales)", add_batch);
  const mha_status status = mha_quantize_kv(&src, &dst, &scales);
  if (status != MHA_OK) {
    throw ToolError(what + ": mha_quantize_kv failed (" + mha_status_name(status) +
                    "): " + mha_last_error());
  }
  if (verbose()) {
    print_error(what + ": " + npy_dtype_name(file_dtype) +
                " quantised to int8 with one float32 scale per row (mha_quantize_kv)");
  }
  return q8;
}

// Rank-3 Q, K and V leave a batch of one; anything else must be rank 4 throughout.
void check_rank(int q_rank, const NpyArray& a, const char* flag, const std::string& path,
                const AttentionOptions& o) {
  if (a.rank() == q_rank) return;
  throw ToolError(input_label("--q", o.q) + ": Q has rank " + std::to_string(q_rank) + " and " +
                  input_label(flag, path) + " has rank " + std::to_string(a.rank()) +
                  ": Q, K and V must all be rank 4 [B,H,L,D] or all rank 3 [H,L,D] (one batch)");
}

// A packed batch (--cu-seqlens-q/-k) takes Q, K and V of rank 3, [total,H,D].
void check_packed_rank(const NpyArray& a, const char* flag, const std::string& path,
                       const char* role, const char* shape, const char* offsets) {
  if (a.rank() == 3) return;
  throw ToolError(input_label(flag, path) + ": with " + offsets + ", " + role + " must be packed " +
                  shape + " (rank 3); the file holds " + a.describe());
}

// The multi-index of the n-th element in C order.
std::vector<int64_t> c_order_index(const std::vector<int64_t>& shape, int64_t n) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = n % shape[d];
    n /= shape[d];
  }
  return index;
}

// An int32 input as the library takes it (--cu-seqlens-q/-k [B + 1],
// --seqused-k [B], --block-table [B, max_blocks]); int64 files (NumPy's
// default integer) are converted, a value outside int32 refused.  The library
// checks the values themselves (offsets from 0, not decreasing, ending at the
// total; block ids within the cache).
NpyArray read_int32_input(const char* flag, const std::string& path, int rank, const char* what,
                          const char* shape) {
  NpyArray a = read_input(flag, path);
  if ((a.dtype() != NpyDtype::I32 && a.dtype() != NpyDtype::I64) || a.rank() != rank) {
    throw ToolError(input_label(flag, path) + ": " + what +
                    " must be int32 (<i4, or int64 <i8) of rank " + std::to_string(rank) + ", " +
                    shape + "; the file holds " + a.describe());
  }
  if (a.dtype() == NpyDtype::I32 && (rank == 1 || !a.fortran_order())) return a;
  // Copied into int32 in C order (the library takes a block table's rows
  // contiguous), element by element through the file's own order.
  NpyArray converted(NpyDtype::I32, a.shape());
  for (int64_t n = 0; n < a.size(); ++n) {
    const std::vector<int64_t> index = c_order_index(a.shape(), n);
    const int64_t value = a.value_as_int64(a.offset(index));
    if (value < INT32_MIN || value > INT32_MAX) {
      throw ToolError(input_label(flag, path) + ": int64 value " + std::to_string(value) +
                      " at index " +
                      (index.size() == 1 ? std::to_string(index[0]) : bracketed(index)) +
                      " does not fit in int32, the dtype of the " + what);
    }
    converted.set_from_double(n, static_cast<double>(value));
  }
  return converted;
}

NpyArray read_offsets(const char* flag, const std::string& path) {
  return read_int32_input(flag, path, 1, "cumulative sequence lengths", "[B + 1]");
}

// K, V or their int8 row scales as a paged cache: of rank `rank` ([num_blocks,
// block_size, ...]) as given, or one less ([num_blocks * block_size, ...])
// with its rows cut into blocks of --block-size.
mha_tensor paged(mha_tensor t, int rank, std::optional<int64_t> block_size,
                 const std::string& what) {
  if (t.ndim == rank) {
    if (block_size && *block_size != t.shape[1]) {
      throw ToolError(what + ": its blocks hold " + std::to_string(t.shape[1]) +
                      " rows (shape[1]) but --block-size is " + std::to_string(*block_size));
    }
    return t;
  }
  if (!block_size || *block_size <= 0 || t.shape[0] % *block_size != 0) {
    const std::string given =
        block_size ? " (it is " + std::to_string(*block_size) + ")" : std::string(" (not given)");
    throw ToolError(what + ": a paged cache of rank " + std::to_string(t.ndim) +
                    " needs --block-size, a positive divisor of its " + std::to_string(t.shape[0]) +
                    " rows" + given + "; or give the cache as rank " + std::to_string(rank) +
                    ", [num_blocks, block_size, ...]");
  }
  mha_tensor blocks = t;
  blocks.ndim = t.ndim + 1;
  blocks.shape[0] = t.shape[0] / *block_size;
  blocks.shape[1] = *block_size;
  blocks.strides[0] = t.strides[0] * *block_size;
  blocks.strides[1] = t.strides[0];
  for (int32_t d = 1; d < t.ndim; ++d) {
    blocks.shape[d + 1] = t.shape[d];
    blocks.strides[d + 1] = t.strides[d];
  }
  return blocks;
}

}  // namespace

AttentionInputs load_attention_inputs(const AttentionOptions& o) {
  // One file at a time, each converted before the next is read: the float32
  // copy of K is gone when V is read.
  NpyArray q = read_float_tensor("--q", o.q, "Q", "[B,H,Lq,D]");
  const Dtypes dtypes = resolve_dtypes(o, q.dtype());
  if (verbose() && !o.dtype && dtypes.q == MHA_DTYPE_F16) {
    print_error(input_label("--q", o.q) + ": float16, so --dtype defaults to f16");
  }
  AttentionInputs in;
  const bool packed = !o.cu_seqlens_q.empty();
  if (packed) check_packed_rank(q, "--q", o.q, "Q", "[total_q,H,D]", "--cu-seqlens-q");
  const int q_rank = q.rank();
  in.unbatched = q_rank == 3 && !packed;
  in.q = convert_float_input(std::move(q), dtypes.q, input_label("--q", o.q));
  const auto load_kv = [&](const char* flag, const std::string& path, const char* role,
                           const char* shapes, std::optional<NpyArray>& scale) {
    NpyArray a = read_float_tensor(flag, path, role, shapes);
    const bool paged_kv = !o.block_table.empty();
    if (paged_kv && a.rank() != 3 && a.rank() != 4) {
      throw ToolError(input_label(flag, path) + ": with --block-table, " + role +
                      " must be a paged cache [num_blocks,block_size,Hkv,D] (or "
                      "[num_blocks*block_size,Hkv,D] with --block-size); the file holds " +
                      a.describe());
    }
    if (packed && !paged_kv) {
      check_packed_rank(a, flag, path, role,
                        flag == std::string("--k") ? "[total_k,Hkv,D]" : "[total_k,Hkv,Dv]",
                        "--cu-seqlens-k");
    }
    if (!paged_kv) check_rank(q_rank, a, flag, path, o);
    if (dtypes.kv != MHA_DTYPE_I8)
      return convert_float_input(std::move(a), dtypes.kv, input_label(flag, path));
    NpyArray row_scales;
    // Rank 3 is quantised as [1, ...]: one scale per row of D whatever the
    // axes mean ([H,L] of one batch, or a packed batch's [total_k,Hkv]).
    const int rank = a.rank();
    TypedInput q8 = quantize_input(std::move(a), input_label(flag, path), row_scales, rank == 3);
    scale = std::move(row_scales);
    return q8;
  };
  in.k = load_kv("--k", o.k, "K", "[B,Hkv,Lk,D]", in.k_scale);
  in.v = load_kv("--v", o.v, "V", "[B,Hkv,Lk,Dv]", in.v_scale);
  if (!o.mask.empty()) {
    NpyArray m = read_input("--mask", o.mask);
    if (m.dtype() == NpyDtype::Bool || m.dtype() == NpyDtype::U8) {
      TypedInput mask;
      mask.dtype = MHA_DTYPE_BOOL;
      mask.shape = m.shape();
      mask.strides = m.strides();
      mask.file = std::move(m);
      in.mask = std::move(mask);
    } else if (is_float(m.dtype())) {
      in.mask = convert_float_input(std::move(m), dtypes.q, input_label("--mask", o.mask),
                                    " (an additive mask may use -inf to remove a key)");
    } else {
      throw ToolError(input_label("--mask", o.mask) +
                      ": the mask must be bool (|b1, or |u1) or float32 (<f4, or float16 <f2, "
                      "float64 <f8); the file holds " +
                      m.describe());
    }
  }
  if (!o.valid_lens.empty()) {
    NpyArray vl = read_input("--valid-lens", o.valid_lens);
    if (vl.dtype() != NpyDtype::I32 && vl.dtype() != NpyDtype::I64) {
      throw ToolError(input_label("--valid-lens", o.valid_lens) +
                      ": valid lengths must be int32 (<i4) or int64 (<i8); the file holds " +
                      vl.describe());
    }
    in.valid_lens = std::move(vl);
  }
  if (packed) {
    in.cu_seqlens_q = read_offsets("--cu-seqlens-q", o.cu_seqlens_q);
    if (!o.cu_seqlens_k.empty()) in.cu_seqlens_k = read_offsets("--cu-seqlens-k", o.cu_seqlens_k);
    if (!o.seqused_k.empty()) {
      in.seqused_k = read_int32_input("--seqused-k", o.seqused_k, 1, "keys per sequence", "[B]");
    }
    if (!o.block_table.empty()) {
      in.block_table =
          read_int32_input("--block-table", o.block_table, 2, "block ids", "[B, max_blocks]");
    }
  }
  if (!o.sinks.empty()) in.sinks = load_float_vector("--sinks", o.sinks, 1, "[H]");
  if (!o.alibi.empty()) in.alibi = load_float_vector("--alibi", o.alibi, 2, "[H] or [B,H]");
  return in;
}

mha_attention_params AttentionCall::params() {
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
  if (scale) {
    p.has_scale = 1;
    p.scale = *scale;
  }
  p.valid_lens = valid_lens ? &*valid_lens : nullptr;
  p.mask = mask ? &*mask : nullptr;
  p.lse = lse ? &*lse : nullptr;
  p.k_scale = k_scale ? &*k_scale : nullptr;
  p.v_scale = v_scale ? &*v_scale : nullptr;
  p.sinks = sinks ? &*sinks : nullptr;
  p.alibi_slopes = alibi ? &*alibi : nullptr;
  p.softcap = softcap;
  return p;
}

AttentionCall prepare_attention_call(AttentionInputs& in, const AttentionOptions& o) {
  AttentionCall call;
  const bool b1 = in.unbatched;
  call.q = describe_input(in.q, input_label("--q", o.q), b1);
  call.k = describe_input(in.k, input_label("--k", o.k), b1);
  call.v = describe_input(in.v, input_label("--v", o.v), b1);
  if (in.k_scale && in.v_scale) {
    call.k_scale = describe_array(*in.k_scale, MHA_DTYPE_F32,
                                  input_label("--k", o.k) + " (its row scales)", b1);
    call.v_scale = describe_array(*in.v_scale, MHA_DTYPE_F32,
                                  input_label("--v", o.v) + " (its row scales)", b1);
  }
  if (in.mask) call.mask = describe_input(*in.mask, input_label("--mask", o.mask));
  if (in.valid_lens) {
    const mha_dtype dtype = in.valid_lens->dtype() == NpyDtype::I64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
    call.valid_lens =
        describe_array(*in.valid_lens, dtype, input_label("--valid-lens", o.valid_lens));
  }
  call.causal = causal_mode(o.causal);
  if (!o.window.empty()) {
    const WindowEdges edges = parse_window(o.window);
    call.window_left = edges.left;
    call.window_right = edges.right;
  }
  if (o.scale) call.scale = static_cast<float>(*o.scale);
  if (in.sinks)
    call.sinks = describe_array(*in.sinks, MHA_DTYPE_F32, input_label("--sinks", o.sinks));
  if (in.alibi)
    call.alibi = describe_array(*in.alibi, MHA_DTYPE_F32, input_label("--alibi", o.alibi));
  if (o.softcap) call.softcap = static_cast<float>(*o.softcap);
  if (in.cu_seqlens_q) {
    call.cu_seqlens_q = describe_array(*in.cu_seqlens_q, MHA_DTYPE_I32,
                                       input_label("--cu-seqlens-q", o.cu_seqlens_q));
  }
  if (in.cu_seqlens_k) {
    call.cu_seqlens_k = describe_array(*in.cu_seqlens_k, MHA_DTYPE_I32,
                                       input_label("--cu-seqlens-k", o.cu_seqlens_k));
  }
  if (in.seqused_k) {
    call.seqused_k =
        describe_array(*in.seqused_k, MHA_DTYPE_I32, input_label("--seqused-k", o.seqused_k));
  }
  if (in.block_table) {
    call.block_table =
        describe_array(*in.block_table, MHA_DTYPE_I32, input_label("--block-table", o.block_table));
    call.k = paged(call.k, 4, o.block_size, input_label("--k", o.k));
    call.v = paged(call.v, 4, o.block_size, input_label("--v", o.v));
    if (call.k_scale && call.v_scale) {
      call.k_scale =
          paged(*call.k_scale, 3, o.block_size, input_label("--k", o.k) + " (its row scales)");
      call.v_scale =
          paged(*call.v_scale, 3, o.block_size, input_label("--v", o.v) + " (its row scales)");
    }
  }

  // [B,H,Lq,Dv] and [B,H,Lq], or [H,Lq,Dv] and [H,Lq] for rank-3 inputs; a
  // packed batch's [total_q,H,Dv] and [H,total_q].
  std::vector<int64_t> lse_shape = in.q.shape;
  lse_shape.pop_back();
  std::vector<int64_t> out_shape = lse_shape;
  out_shape.push_back(in.v.shape.back());
  if (call.cu_seqlens_q) lse_shape = {in.q.shape[1], in.q.shape[0]};
  call.out_array = NpyArray(NpyDtype::F32, out_shape);
  call.out = describe_array(call.out_array, MHA_DTYPE_F32, "the output", b1);
  if (!o.lse.empty()) {
    call.lse_array = NpyArray(NpyDtype::F32, lse_shape);
    call.lse = describe_array(call.lse_array, MHA_DTYPE_F32, "the LSE output", b1);
  }
  return call;
}

}  // namespace mha_tools
