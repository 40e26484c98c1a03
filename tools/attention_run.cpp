#include "attention_run.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "common/visibility.h"
#include "half.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

// "--q q.npy" as messages name an input.
std::string label(const char* flag, const std::string& path) {
  return std::string(flag) + " " + path;
}

[[noreturn]] void library_error(const std::string& what, mha_status status) {
  throw ToolError(what + " failed (" + mha_status_name(status) + "): " + mha_last_error());
}

// "(2, 5, 4, 20)"
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i > 0 ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// "float32" for messages: the names of mha's dtypes as NumPy spells them.
const char* dtype_long_name(mha_dtype dtype) {
  switch (dtype) {
    case MHA_DTYPE_BF16:
      return "bfloat16";
    case MHA_DTYPE_F16:
      return "float16";
    case MHA_DTYPE_I8:
      return "int8";
    case MHA_DTYPE_BOOL:
      return "bool";
    default:
      return "float32";
  }
}

// A descriptor over data of `size` elements in a layout (element strides);
// with add_batch a leading dimension of 1 is added ([H,L,D] as [1,H,L,D]).
// `text` describes the data in messages ("float32 (2, 5, 4, 20)").
mha_tensor describe_layout(void* data, mha_dtype dtype, std::vector<int64_t> shape,
                           std::vector<int64_t> strides, int64_t size, const std::string& text,
                           const std::string& what, bool add_batch) {
  const int given_rank = static_cast<int>(shape.size());
  const int rank = given_rank + (add_batch ? 1 : 0);
  if (rank < 1 || rank > MHA_MAX_DIMS) {
    throw ToolError(what + ": " + text + " has rank " + std::to_string(given_rank) +
                    "; mha takes tensors of rank 1 to " + std::to_string(MHA_MAX_DIMS));
  }
  if (add_batch) {
    shape.insert(shape.begin(), 1);
    strides.insert(strides.begin(), std::max<int64_t>(size, 1));
  }
  mha_tensor t{};
  const mha_status status = mha_tensor_init(&t, data, dtype, rank, shape.data(), strides.data());
  if (status != MHA_OK) throw ToolError(what + ": " + mha_last_error());
  return t;
}

// A descriptor over an array, in the array's own layout (C or Fortran order).
mha_tensor describe(NpyArray& array, mha_dtype dtype, const std::string& what,
                    bool add_batch = false) {
  return describe_layout(array.data(), dtype, array.shape(), array.strides(), array.size(),
                         array.describe(), what, add_batch);
}

// A descriptor over an input in the dtype mha gets it.
mha_tensor describe(TypedInput& input, const std::string& what, bool add_batch = false) {
  return describe_layout(input.data(), input.dtype, input.shape, input.strides, input.size(),
                         std::string(dtype_long_name(input.dtype)) + " " + shape_text(input.shape),
                         what, add_batch);
}

// Reads an input file; messages name the flag ("--q q.npy: truncated data: ...").
NpyArray read_input(const char* flag, const std::string& path) {
  try {
    return read_npy(path);
  } catch (const NpyError& e) {
    throw ToolError(std::string(flag) + " " + e.what());
  }
}

bool is_float(NpyDtype dtype) {
  return dtype == NpyDtype::F32 || dtype == NpyDtype::F16 || dtype == NpyDtype::F64;
}

// Q, K or V as the file holds it (converted later, to the dtype mha gets).
NpyArray read_float_tensor(const char* flag, const std::string& path, const char* role,
                           const char* shapes) {
  NpyArray a = read_input(flag, path);
  if (!is_float(a.dtype()) || (a.rank() != 4 && a.rank() != 3)) {
    throw ToolError(label(flag, path) + ": " + role +
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
  mha_tensor src = describe(values, what, add_batch);
  mha_tensor dst = describe(q8, what, add_batch);
  mha_tensor scales = describe(scale, MHA_DTYPE_F32, what + " (its row scales)", add_batch);
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

// Elements of an int32 / int64 descriptor, or of a bool / float32 one.
int64_t integer_at(const mha_tensor& t, int64_t offset) {
  if (t.dtype == MHA_DTYPE_I64) return static_cast<const int64_t*>(t.data)[offset];
  return static_cast<const int32_t*>(t.data)[offset];
}

bool mask_allows(const mha_tensor& mask, int64_t offset) {
  if (mask.dtype == MHA_DTYPE_BOOL) return static_cast<const uint8_t*>(mask.data)[offset] != 0;
  return mha_types::load_float(mask.data, mask.dtype, offset) != -INFINITY;
}

// Keys first_key .. key_limit-1 of (batch b, query i) survive the window,
// the causal mode and valid lengths: the library's own visibility rule
// (common/visibility.h).
int64_t first_key(const AttentionCall& call, int64_t i) {
  const int64_t lq = call.q.shape[2], lk = call.k.shape[2];
  return mha_rules::first_visible_key(i,
                                      mha_rules::window_lower_diagonal(call.window_left, lq, lk));
}

int64_t key_limit(const AttentionCall& call, int64_t b, int64_t i) {
  const int64_t lq = call.q.shape[2], lk = call.k.shape[2];
  int64_t valid_length = lk;
  if (call.valid_lens) {
    const mha_tensor& vl = *call.valid_lens;
    valid_length = integer_at(vl, b * vl.strides[0] + (vl.ndim == 2 ? i * vl.strides[1] : 0));
  }
  return mha_rules::visible_keys(
      i, lk, mha_rules::upper_diagonal(call.causal, call.window_right, lq, lk), valid_length);
}

// Element offset in a mask broadcast (NumPy style, aligned right) to [B,H,Lq,Lk].
int64_t mask_offset(const mha_tensor& mask, const int64_t (&index)[4]) {
  int64_t offset = 0;
  for (int32_t d = 0; d < mask.ndim; ++d) {
    const int64_t full = index[4 - mask.ndim + d];
    if (mask.shape[d] != 1) offset += full * mask.strides[d];
  }
  return offset;
}

// Rank-3 Q, K and V leave a batch of one; anything else must be rank 4 throughout.
void check_rank(int q_rank, const NpyArray& a, const char* flag, const std::string& path,
                const AttentionOptions& o) {
  if (a.rank() == q_rank) return;
  throw ToolError(label("--q", o.q) + ": Q has rank " + std::to_string(q_rank) + " and " +
                  label(flag, path) + " has rank " + std::to_string(a.rank()) +
                  ": Q, K and V must all be rank 4 [B,H,L,D] or all rank 3 [H,L,D] (one batch)");
}

// A packed batch (--cu-seqlens-q/-k) takes Q, K and V of rank 3, [total,H,D].
void check_packed_rank(const NpyArray& a, const char* flag, const std::string& path,
                       const char* role, const char* shape, const char* offsets) {
  if (a.rank() == 3) return;
  throw ToolError(label(flag, path) + ": with " + offsets + ", " + role + " must be packed " +
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
    throw ToolError(label(flag, path) + ": " + what +
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
      throw ToolError(label(flag, path) + ": int64 value " + std::to_string(value) + " at index " +
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
    throw ToolError(what + ": a paged cache of rank " + std::to_string(t.ndim) +
                    " needs --block-size, a positive divisor of its " + std::to_string(t.shape[0]) +
                    " rows (or give it as rank " + std::to_string(rank) +
                    ", [num_blocks, block_size, ...])");
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

// Element b of an I32 [B + 1] offsets tensor.
int64_t offset_at(const mha_tensor& cu, int64_t b) {
  return static_cast<const int32_t*>(cu.data)[b * cu.strides[0]];
}

// The pairs of one head of a packed batch: each sequence with its own lengths.
int64_t count_packed_pairs_of_head(const AttentionCall& call) {
  const mha_tensor& cu_q = *call.cu_seqlens_q;
  int64_t pairs = 0;
  for (int64_t b = 0; b + 1 < cu_q.shape[0]; ++b) {
    const int64_t lq = offset_at(cu_q, b + 1) - offset_at(cu_q, b);
    const int64_t lk =
        call.seqused_k ? offset_at(*call.seqused_k, b)
                       : offset_at(*call.cu_seqlens_k, b + 1) - offset_at(*call.cu_seqlens_k, b);
    const int64_t lower = mha_rules::window_lower_diagonal(call.window_left, lq, lk);
    const int64_t upper = mha_rules::upper_diagonal(call.causal, call.window_right, lq, lk);
    for (int64_t i = 0; i < lq; ++i) {
      pairs += std::max<int64_t>(
          0, mha_rules::visible_keys(i, lk, upper, lk) - mha_rules::first_visible_key(i, lower));
    }
  }
  return pairs;
}

int64_t count_pairs_of_head(const AttentionCall& call, int64_t b, int64_t h) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < call.q.shape[2]; ++i) {
    const int64_t first = first_key(call, i), limit = key_limit(call, b, i);
    if (!call.mask) {
      pairs += std::max<int64_t>(0, limit - first);
      continue;
    }
    for (int64_t j = first; j < limit; ++j) {
      const int64_t index[4] = {b, h, i, j};
      if (mask_allows(*call.mask, mask_offset(*call.mask, index))) ++pairs;
    }
  }
  return pairs;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

// ---------------------------------------------------------------- the command's frame

const char* const kRunExitStatusHelp =
    "Exit status:\n"
    "  0        success\n"
    "  1        the run failed: an input could not be read or was refused, the library\n"
    "           refused the call or failed, memory ran out, or an output or stdout\n"
    "           could not be written (output files are replaced only when all of\n"
    "           them are written: none of them is changed then)\n"
    "  2        the command line is wrong (found by mha-run after parsing): a required\n"
    "           flag is missing, flags contradict each other or the weights'\n"
    "           config.json, --scale rounds to 0 or overflows in float32, an output\n"
    "           is named twice or names an input\n"
    "  100-127  the command line cannot be parsed (CLI11's codes): 104 a value of the\n"
    "           wrong type, 105 a value not allowed (an empty one too), 106 a required\n"
    "           option missing, 108 flags that exclude each other, 109 an unknown flag\n"
    "           or an extra argument";

void print_error(const std::string& message) {
  std::fprintf(stderr, "mha-run: %s\n", escape(message).c_str());
}

int run_guarded(const std::function<int()>& body) {
  try {
    return body();
  } catch (const ToolError& e) {
    print_error(e.what());
    return e.exit_status();
  } catch (const OutputConflict& e) {
    print_error(e.what());
    return kExitUsage;
  } catch (const std::bad_alloc&) {
    print_error("out of memory");
  } catch (const std::exception& e) {
    print_error(e.what());
  }
  return kExitFailure;
}

NpyArray read_float_input(const char* flag, const std::string& path) {
  NpyArray a = read_input(flag, path);
  if (a.dtype() != NpyDtype::F64 && a.dtype() != NpyDtype::F16) return a;
  const bool fortran = a.fortran_order();
  const TypedInput f = convert_float_input(std::move(a), MHA_DTYPE_F32, label(flag, path));
  NpyArray out(NpyDtype::F32, f.shape, fortran);  // the converted values keep the file's order
  std::memcpy(out.data(), f.data(), out.nbytes());
  return out;
}

int64_t TypedInput::size() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

namespace {

// Bytes per element of the dtypes mha gets here.
std::size_t element_bytes(mha_dtype dtype) {
  switch (dtype) {
    case MHA_DTYPE_BF16:
    case MHA_DTYPE_F16:
      return 2;
    case MHA_DTYPE_I8:
    case MHA_DTYPE_BOOL:
      return 1;
    default:
      return 4;
  }
}

NpyDtype npy_dtype_of(mha_dtype dtype) {
  return dtype == MHA_DTYPE_F16 ? NpyDtype::F16 : NpyDtype::F32;
}

// Element i of a float array, stored as `dtype` (F32, BF16, F16) at `to`;
// false when a finite value became infinite.
bool store_converted(const NpyArray& from, int64_t i, mha_dtype dtype, void* to) {
  const auto n = static_cast<std::size_t>(i);
  if (from.dtype() == NpyDtype::F32) {  // exact in binary32: the library's own rounding
    const float x = from.data_as<float>()[n];
    mha_types::store_float(to, dtype, i, x);
    return !std::isfinite(x) || std::isfinite(mha_types::load_float(to, dtype, i));
  }
  const double x = from.value_as_double(i);
  switch (dtype) {
    case MHA_DTYPE_BF16: {
      const uint16_t bits = bf16_bits_from_double(x);
      static_cast<uint16_t*>(to)[n] = bits;
      return !std::isfinite(x) || std::isfinite(bf16_bits_to_double(bits));
    }
    case MHA_DTYPE_F16: {
      const uint16_t bits = f16_bits_from_double(x);
      static_cast<uint16_t*>(to)[n] = bits;
      return !std::isfinite(x) || std::isfinite(f16_bits_to_double(bits));
    }
    default: {
      const auto f = static_cast<float>(x);
      static_cast<float*>(to)[n] = f;
      return !std::isfinite(x) || std::isfinite(f);
    }
  }
}

}  // namespace

TypedInput convert_float_input(NpyArray array, mha_dtype dtype, const std::string& what,
                               const char* hint) {
  TypedInput in;
  in.dtype = dtype;
  in.shape = array.shape();
  in.strides = array.strides();
  if (array.dtype() == npy_dtype_of(dtype) && dtype != MHA_DTYPE_BF16) {
    in.file = std::move(array);
    return in;
  }
  const std::size_t bytes = static_cast<std::size_t>(array.size()) * element_bytes(dtype);
  in.converted.assign(bytes / 8 + 1, 0);
  void* to = in.converted.data();
  for (int64_t i = 0; i < array.size(); ++i) {
    if (store_converted(array, i, dtype, to)) continue;
    char text[40];
    std::snprintf(text, sizeof text, "%.17g", array.value_as_double(i));
    const double largest =
        dtype == MHA_DTYPE_F16 ? kF16Max : (dtype == MHA_DTYPE_BF16 ? kBf16Max : double{FLT_MAX});
    char limit[40];
    std::snprintf(limit, sizeof limit, "%.8g", largest);
    throw ToolError(what + ": " + npy_dtype_name(array.dtype()) + " value " + text +
                    " does not fit in " + dtype_long_name(dtype) + " (largest " + limit + ")" +
                    hint);
  }
  if (verbose()) {
    print_error(what + ": " + npy_dtype_name(array.dtype()) + " converted to " +
                dtype_long_name(dtype));
  }
  return in;
}

std::optional<mha_dtype> parse_dtype_flag(const std::string& text, bool kv) {
  struct Name {
    const char* text;
    mha_dtype dtype;
  };
  static const Name kNames[] = {
      {"f32", MHA_DTYPE_F32},   {"fp32", MHA_DTYPE_F32},      {"float32", MHA_DTYPE_F32},
      {"bf16", MHA_DTYPE_BF16}, {"bfloat16", MHA_DTYPE_BF16}, {"f16", MHA_DTYPE_F16},
      {"fp16", MHA_DTYPE_F16},  {"float16", MHA_DTYPE_F16},   {"half", MHA_DTYPE_F16},
      {"i8", MHA_DTYPE_I8},     {"int8", MHA_DTYPE_I8}};
  for (const Name& name : kNames) {
    if (text == name.text && (kv || name.dtype != MHA_DTYPE_I8)) return name.dtype;
  }
  return std::nullopt;
}

Dtypes resolve_dtypes(const AttentionOptions& o, NpyDtype q_file_dtype) {
  Dtypes d;
  d.q = o.dtype.value_or(q_file_dtype == NpyDtype::F16 ? MHA_DTYPE_F16 : MHA_DTYPE_F32);
  d.kv = o.kv_dtype.value_or(d.q);
  return d;
}

// ---------------------------------------------------------------- options

void add_attention_options(CLI::App& app, AttentionOptions& o) {
  const CLI::Validator& filled = non_empty();
  app.add_option("--q", o.q,
                 "queries: float32 or float16 [B,H,Lq,D] .npy (C or Fortran order; float64 too; "
                 "[H,Lq,D] with K and V of rank 3 too is one batch; [total_q,H,D] with "
                 "--cu-seqlens-q); passed as --dtype")
      ->check(filled);
  app.add_option("--k", o.k,
                 "keys: float32 or float16 [B,Hkv,Lk,D] .npy (float64 too; [total_k,Hkv,D] with "
                 "--cu-seqlens-k); H must be a multiple of Hkv; passed as --kv-dtype")
      ->check(filled);
  app.add_option("--v", o.v,
                 "values: float32 or float16 [B,Hkv,Lk,Dv] .npy ([total_k,Hkv,Dv] with "
                 "--cu-seqlens-k); passed as --kv-dtype")
      ->check(filled);
  app.add_option("--out", o.out,
                 "output: float32 [B,H,Lq,Dv] .npy to write ([H,Lq,Dv] for rank-3 inputs, "
                 "[total_q,H,Dv] for a packed batch), float32 whatever --dtype; replaced only once "
                 "every output is written")
      ->check(filled);
  app.add_option("--mask", o.mask,
                 "mask .npy, bool (true = the key takes part) or float32/float16/float64 (added "
                 "to the scores, passed as --dtype), broadcastable to [B,H,Lq,Lk] (rank 2 to 4)")
      ->check(filled);
  app.add_option("--valid-lens", o.valid_lens, "valid lengths .npy, int32 or int64, [B] or [B,Lq]")
      ->check(filled);
  app.add_option("--cu-seqlens-q", o.cu_seqlens_q,
                 "a packed variable-length batch (FlashAttention-2's varlen layout, computed by "
                 "mha_attention_varlen): the query offsets .npy, int32 [B+1] (0, then the "
                 "cumulative lengths; int64 is converted). --q is then [total_q,H,D], --out "
                 "[total_q,H,Dv], --lse [H,total_q]; needs --cu-seqlens-k, excludes --valid-lens "
                 "and --mask; causal, window and ALiBi use each sequence's own lengths")
      ->check(filled);
  app.add_option("--cu-seqlens-k", o.cu_seqlens_k,
                 "the key offsets of a packed batch .npy, int32 [B+1]; --k and --v are then "
                 "[total_k,Hkv,D] and [total_k,Hkv,Dv]; needs --cu-seqlens-q")
      ->check(filled);
  app.add_option("--block-table", o.block_table,
                 "a paged KV cache (vLLM's and FlashAttention-2's layout): the block ids .npy, "
                 "int32 [B,max_blocks]; key j of sequence b is row j % block_size of block "
                 "table[b][j / block_size] of --k and --v, [num_blocks,block_size,Hkv,D] (or "
                 "[num_blocks*block_size,Hkv,D] with --block-size); needs --cu-seqlens-q and "
                 "--seqused-k")
      ->check(filled);
  app.add_option("--seqused-k", o.seqused_k,
                 "the keys each sequence uses .npy, int32 [B]: with --block-table its length; "
                 "with --cu-seqlens-k the first seqused_k[b] of its rows")
      ->check(filled);
  app.add_option("--block-size", o.block_size,
                 "rows per block of a paged cache given as [num_blocks*block_size,Hkv,D] (a "
                 "multiple of 8); checked against shape[1] of a rank-4 cache");
  const auto dtype_check = [](bool kv) {
    return CLI::Validator(
        [kv](const std::string& text) -> std::string {
          if (parse_dtype_flag(text, kv)) return {};
          if (!kv && parse_dtype_flag(text, true)) {
            return "Q cannot be int8: " + text +
                   " is for K and V only (--kv-dtype i8); --dtype must be f32, bf16 or f16";
          }
          return "'" + text + "' is not a dtype; it must be " +
                 (kv ? "f32, bf16, f16 or i8" : "f32, bf16 or f16");
        },
        kv ? "f32|bf16|f16|i8" : "f32|bf16|f16", kv ? "KV-DTYPE" : "DTYPE");
  };
  app.add_option_function<std::string>(
         "--dtype", [&o](const std::string& s) { o.dtype = parse_dtype_flag(s, false); },
         "the dtype Q (and a float --mask) is passed to mha in: f32, bf16 or f16. Default: f16 "
         "when --q holds float16, else f32. Files of another float type are converted on load, "
         "rounded to nearest even (NumPy has no bfloat16: bf16 is always a conversion). mha "
         "computes in float32; --out and --lse are float32 whatever the dtype")
      ->check(filled)
      ->check(dtype_check(false))
      ->option_text("f32|bf16|f16");
  app.add_option_function<std::string>(
         "--kv-dtype", [&o](const std::string& s) { o.kv_dtype = parse_dtype_flag(s, true); },
         "the dtype K and V are passed to mha in: f32, bf16, f16, or i8 (int8 with one float32 "
         "scale per row, made by mha_quantize_kv: scale = max|row| / 127). Default: --dtype's "
         "value")
      ->check(filled)
      ->check(dtype_check(true))
      ->option_text("f32|bf16|f16|i8");
  add_causal_option(app, o.causal,
                    "causal mask: none (the default), top-left (also --causal alone) or "
                    "bottom-right");
  add_variant_options(app, o);
  app.add_option_function<std::string>(
         "--scale",
         [&o](const std::string& s) {
           o.scale_text = s;
           double value = 0;
           CLI::detail::lexical_cast(s, value);  // checked by CLI::Number
           o.scale = value;
         },
         "scale of the scores (default 1/sqrt(D))")
      ->check(filled)
      ->check(CLI::Number)
      ->option_text("FLOAT");
  app.add_flag("--mpi-ring", o.mpi_ring,
               "under mpirun: ring attention with libmha-mpi. Rank 0 reads the files and sends "
               "each rank its slice of the queries and keys (--mpi-layout), the K/V slices "
               "travel around the ring, rank 0 gathers and writes --out and --lse; --repeat "
               "times the slowest rank. Takes --causal, --valid-lens, --window, --sinks, "
               "--softcap, --alibi, --scale, --dtype; not --mask");
  app.add_flag("--mpi-decode", o.mpi_decode,
               "under mpirun: decoding over a KV cache sharded by position across the ranks "
               "(libmha-mpi); the queries go to every rank, the partial results are merged in "
               "rank order");
  app.add_option("--mpi-layout", o.mpi_layout,
                 "how --mpi-ring cuts the sequence: zigzag (the default: 2N chunks, rank r "
                 "holds r and 2N-1-r, balanced under a causal mask) or contiguous")
      ->check(filled)
      ->option_text("zigzag|contiguous");
  app.add_option("--lse", o.lse,
                 "log-sum-exp output: float32 [B,H,Lq] .npy to write ([H,Lq] for rank-3 inputs, "
                 "[H,total_q] for a packed batch)")
      ->check(filled);
  add_run_options(app, o);
}

namespace {

// A scale that is not zero as typed but is zero (or infinite) as the float32
// the library computes with.
void check_scale(const AttentionOptions& o) {
  if (!o.scale) return;
  const double typed = *o.scale;
  const std::string text = o.scale_text.empty() ? std::to_string(typed) : o.scale_text;
  const auto scale = static_cast<float>(typed);
  if (typed != 0 && scale == 0) {
    throw UsageError("--scale " + text + ": the value was typed as " + text +
                     " and rounds to 0 in float32, the precision mha computes in (the smallest "
                     "positive float32 is 1.4e-45)");
  }
  if (std::isfinite(typed) && !std::isfinite(scale)) {
    throw UsageError("--scale " + text + ": the value was typed as " + text +
                     " and overflows float32, the precision mha computes in (the largest float32 "
                     "is 3.4028235e+38)");
  }
}

}  // namespace

void check_attention_options(const AttentionOptions& o) {
  std::string missing;
  const auto need = [&missing](const std::string& value, const char* flag) {
    if (value.empty()) missing += missing.empty() ? flag : std::string(", ") + flag;
  };
  need(o.q, "--q");
  need(o.k, "--k");
  need(o.v, "--v");
  if (o.repeat == 0) need(o.out, "--out");
  if (!missing.empty()) throw UsageError("missing " + missing + " (see --help)");
  const bool packed_q = !o.cu_seqlens_q.empty(), packed_k = !o.cu_seqlens_k.empty();
  const bool paged_kv = !o.block_table.empty();
  if (paged_kv) {
    if (!packed_q || o.seqused_k.empty()) {
      throw UsageError(std::string("--block-table needs ") +
                       (!packed_q ? "--cu-seqlens-q (the queries, packed [total_q,H,D])"
                                  : "--seqused-k (each sequence's number of keys, int32 [B])"));
    }
    if (packed_k) {
      throw UsageError(
          "--cu-seqlens-k cannot be combined with --block-table: a paged cache's lengths are "
          "--seqused-k");
    }
  } else if (!o.seqused_k.empty() && !packed_q) {
    throw UsageError("--seqused-k needs --cu-seqlens-q and --cu-seqlens-k (or --block-table)");
  } else if (o.block_size) {
    throw UsageError("--block-size needs --block-table (it cuts --k and --v into blocks)");
  }
  if (packed_q != packed_k && !paged_kv) {
    throw UsageError(std::string(packed_q ? "--cu-seqlens-q is given without --cu-seqlens-k"
                                          : "--cu-seqlens-k is given without --cu-seqlens-q") +
                     ": a packed batch needs both offsets, int32 [B + 1] each");
  }
  if (packed_q) {
    const struct {
      const char* flag;
      const std::string& value;
    } excluded[] = {{"--valid-lens", o.valid_lens}, {"--mask", o.mask}};
    for (const auto& e : excluded) {
      if (e.value.empty()) continue;
      throw UsageError(std::string(e.flag) +
                       " cannot be combined with --cu-seqlens-q/--cu-seqlens-k: in a packed "
                       "batch each sequence's offsets are its lengths, and mha_attention_varlen "
                       "takes no valid lengths or mask");
    }
  }
  (void)causal_mode(o.causal);
  if (!o.window.empty()) (void)parse_window(o.window);
  check_scale(o);
}

void configure_runtime(const std::optional<std::string>& backend, std::optional<int> threads) {
  if (backend && !backend->empty()) {
    const mha_status status = mha_select_backend(backend->c_str());
    if (status != MHA_OK)
      throw ToolError(std::string("--backend ") + *backend + ": " + mha_last_error());
  }
  if (threads) {
    const mha_status status = mha_set_num_threads(*threads);
    if (status != MHA_OK) {
      throw ToolError("--threads " + std::to_string(*threads) + ": " + mha_last_error());
    }
  }
  if (mha_selected_backend() == nullptr) throw ToolError(mha_last_error());
}

// ---------------------------------------------------------------- loading

AttentionInputs load_attention_inputs(const AttentionOptions& o) {
  // One file at a time, each converted before the next is read: the float32
  // copy of K is gone when V is read.
  NpyArray q = read_float_tensor("--q", o.q, "Q", "[B,H,Lq,D]");
  const Dtypes dtypes = resolve_dtypes(o, q.dtype());
  if (verbose() && !o.dtype && dtypes.q == MHA_DTYPE_F16) {
    print_error(label("--q", o.q) + ": float16, so --dtype defaults to f16");
  }
  AttentionInputs in;
  const bool packed = !o.cu_seqlens_q.empty();
  if (packed) check_packed_rank(q, "--q", o.q, "Q", "[total_q,H,D]", "--cu-seqlens-q");
  const int q_rank = q.rank();
  in.unbatched = q_rank == 3 && !packed;
  in.q = convert_float_input(std::move(q), dtypes.q, label("--q", o.q));
  const auto load_kv = [&](const char* flag, const std::string& path, const char* role,
                           const char* shapes, std::optional<NpyArray>& scale) {
    NpyArray a = read_float_tensor(flag, path, role, shapes);
    const bool paged_kv = !o.block_table.empty();
    if (paged_kv && a.rank() != 3 && a.rank() != 4) {
      throw ToolError(label(flag, path) + ": with --block-table, " + role +
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
      return convert_float_input(std::move(a), dtypes.kv, label(flag, path));
    NpyArray row_scales;
    // Rank 3 is quantised as [1, ...]: one scale per row of D whatever the
    // axes mean ([H,L] of one batch, or a packed batch's [total_k,Hkv]).
    const int rank = a.rank();
    TypedInput q8 = quantize_input(std::move(a), label(flag, path), row_scales, rank == 3);
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
      in.mask = convert_float_input(std::move(m), dtypes.q, label("--mask", o.mask),
                                    " (an additive mask may use -inf to remove a key)");
    } else {
      throw ToolError(label("--mask", o.mask) +
                      ": the mask must be bool (|b1, or |u1) or float32 (<f4, or float16 <f2, "
                      "float64 <f8); the file holds " +
                      m.describe());
    }
  }
  if (!o.valid_lens.empty()) {
    NpyArray vl = read_input("--valid-lens", o.valid_lens);
    if (vl.dtype() != NpyDtype::I32 && vl.dtype() != NpyDtype::I64) {
      throw ToolError(label("--valid-lens", o.valid_lens) +
                      ": valid lengths must be int32 (<i4) or int64 (<i8); the file holds " +
                      vl.describe());
    }
    in.valid_lens = std::move(vl);
  }
  const auto read_f32 = [](const char* flag, const std::string& path, const char* shapes) {
    NpyArray a = read_input(flag, path);
    if (a.dtype() != NpyDtype::F32) {
      throw ToolError(label(flag, path) + ": must be float32 (<f4) " + shapes +
                      "; the file holds " + a.describe());
    }
    return a;
  };
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
  if (!o.sinks.empty()) in.sinks = read_f32("--sinks", o.sinks, "[H]");
  if (!o.alibi.empty()) in.alibi = read_f32("--alibi", o.alibi, "[H] or [B,H]");
  return in;
}

// ---------------------------------------------------------------- calling

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
  call.q = describe(in.q, label("--q", o.q), b1);
  call.k = describe(in.k, label("--k", o.k), b1);
  call.v = describe(in.v, label("--v", o.v), b1);
  if (in.k_scale && in.v_scale) {
    call.k_scale =
        describe(*in.k_scale, MHA_DTYPE_F32, label("--k", o.k) + " (its row scales)", b1);
    call.v_scale =
        describe(*in.v_scale, MHA_DTYPE_F32, label("--v", o.v) + " (its row scales)", b1);
  }
  if (in.mask) call.mask = describe(*in.mask, label("--mask", o.mask));
  if (in.valid_lens) {
    const mha_dtype dtype = in.valid_lens->dtype() == NpyDtype::I64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
    call.valid_lens = describe(*in.valid_lens, dtype, label("--valid-lens", o.valid_lens));
  }
  call.causal = causal_mode(o.causal);
  if (!o.window.empty()) {
    const WindowEdges edges = parse_window(o.window);
    call.window_left = edges.left;
    call.window_right = edges.right;
  }
  if (o.scale) call.scale = static_cast<float>(*o.scale);
  if (in.sinks) call.sinks = describe(*in.sinks, MHA_DTYPE_F32, label("--sinks", o.sinks));
  if (in.alibi) call.alibi = describe(*in.alibi, MHA_DTYPE_F32, label("--alibi", o.alibi));
  if (o.softcap) call.softcap = static_cast<float>(*o.softcap);
  if (in.cu_seqlens_q) {
    call.cu_seqlens_q =
        describe(*in.cu_seqlens_q, MHA_DTYPE_I32, label("--cu-seqlens-q", o.cu_seqlens_q));
  }
  if (in.cu_seqlens_k) {
    call.cu_seqlens_k =
        describe(*in.cu_seqlens_k, MHA_DTYPE_I32, label("--cu-seqlens-k", o.cu_seqlens_k));
  }
  if (in.seqused_k) {
    call.seqused_k = describe(*in.seqused_k, MHA_DTYPE_I32, label("--seqused-k", o.seqused_k));
  }
  if (in.block_table) {
    call.block_table =
        describe(*in.block_table, MHA_DTYPE_I32, label("--block-table", o.block_table));
    call.k = paged(call.k, 4, o.block_size, label("--k", o.k));
    call.v = paged(call.v, 4, o.block_size, label("--v", o.v));
    if (call.k_scale && call.v_scale) {
      call.k_scale = paged(*call.k_scale, 3, o.block_size, label("--k", o.k) + " (its row scales)");
      call.v_scale = paged(*call.v_scale, 3, o.block_size, label("--v", o.v) + " (its row scales)");
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
  call.out = describe(call.out_array, MHA_DTYPE_F32, "the output", b1);
  if (!o.lse.empty()) {
    call.lse_array = NpyArray(NpyDtype::F32, lse_shape);
    call.lse = describe(call.lse_array, MHA_DTYPE_F32, "the LSE output", b1);
  }
  return call;
}

void call_attention(AttentionCall& call) {
  const mha_attention_params params = call.params();
  if (call.cu_seqlens_q) {
    mha_varlen_params varlen;
    mha_varlen_params_init(&varlen);
    varlen.cu_seqlens_q = &*call.cu_seqlens_q;
    varlen.cu_seqlens_k = call.cu_seqlens_k ? &*call.cu_seqlens_k : nullptr;
    varlen.seqused_k = call.seqused_k ? &*call.seqused_k : nullptr;
    varlen.block_table = call.block_table ? &*call.block_table : nullptr;
    const mha_status status =
        mha_attention_varlen(&call.q, &call.k, &call.v, &call.out, &varlen, &params);
    if (status != MHA_OK) library_error("mha_attention_varlen", status);
    return;
  }
  const mha_status status = mha_attention(&call.q, &call.k, &call.v, &call.out, &params);
  if (status != MHA_OK) library_error("mha_attention", status);
}

Timing time_calls(const std::function<void()>& call, int repeat) {
  std::vector<double> ms;
  ms.reserve(static_cast<std::size_t>(repeat));
  for (int r = 0; r < repeat; ++r) {
    const auto start = std::chrono::steady_clock::now();
    call();
    const auto stop = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return {median_of(ms), *std::min_element(ms.begin(), ms.end())};
}

Timing time_attention(AttentionCall& call, int repeat) {
  return time_calls([&call] { call_attention(call); }, repeat);
}

mha_tensor describe_array(NpyArray& array, mha_dtype dtype, const std::string& what,
                          bool add_batch) {
  return describe(array, dtype, what, add_batch);
}

mha_tensor describe_input(TypedInput& input, const std::string& what, bool add_batch) {
  return describe(input, what, add_batch);
}

TypedInput read_typed_input(const char* flag, const std::string& path, mha_dtype dtype,
                            const char* role) {
  NpyArray a = read_input(flag, path);
  if (!is_float(a.dtype())) {
    throw ToolError(label(flag, path) + ": " + role +
                    " must be float32 (<f4), float16 (<f2) or float64 (<f8); the file holds " +
                    a.describe());
  }
  return convert_float_input(std::move(a), dtype, label(flag, path));
}

// ---------------------------------------------------------------- counting

int64_t count_attention_pairs(const AttentionCall& call) {
  const int64_t batch = call.q.shape[0], heads = call.q.shape[1];
  if (call.cu_seqlens_q) return heads * count_packed_pairs_of_head(call);
  // Causal mode and valid lengths are the same for every head; so is a mask
  // without a head dimension.
  const bool per_head =
      call.mask && call.mask->ndim >= 3 && call.mask->shape[call.mask->ndim - 3] != 1;
  int64_t pairs = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (per_head) {
      for (int64_t h = 0; h < heads; ++h) pairs += count_pairs_of_head(call, b, h);
    } else {
      pairs += heads * count_pairs_of_head(call, b, 0);
    }
  }
  return pairs;
}

double attention_flops(const AttentionCall& call) {
  const double d = static_cast<double>(call.q.shape[call.q.ndim - 1]);
  const double dv = static_cast<double>(call.v.shape[call.v.ndim - 1]);
  return 2.0 * (d + dv) * static_cast<double>(count_attention_pairs(call));
}

std::string timing_json(const Timing& timing, double flops, const Dtypes& dtypes) {
  const char* backend = mha_selected_backend();
  nlohmann::ordered_json j;
  j["backend"] = backend != nullptr ? backend : "";
  j["threads"] = mha_get_num_threads();
  j["median_ms"] = timing.median_ms;
  j["min_ms"] = timing.min_ms;
  j["gflops"] = timing.median_ms > 0 ? flops / (timing.median_ms * 1e6) : 0.0;
  if (dtypes.q != MHA_DTYPE_F32 || dtypes.kv != MHA_DTYPE_F32) {
    j["dtype"] = mha_types::dtype_name(dtypes.q);
    j["kv_dtype"] = mha_types::dtype_name(dtypes.kv);
  }
  return j.dump();
}

// ---------------------------------------------------------------- writing

std::vector<NamedFile> attention_outputs(const AttentionOptions& o) {
  std::vector<NamedFile> files;
  if (!o.lse.empty()) files.push_back({"--lse", o.lse});
  if (!o.out.empty()) files.push_back({"--out", o.out});
  return files;
}

std::vector<NamedFile> attention_inputs(const AttentionOptions& o) {
  return {{"--q", o.q},
          {"--k", o.k},
          {"--v", o.v},
          {"--mask", o.mask},
          {"--valid-lens", o.valid_lens},
          {"--cu-seqlens-q", o.cu_seqlens_q},
          {"--cu-seqlens-k", o.cu_seqlens_k},
          {"--seqused-k", o.seqused_k},
          {"--block-table", o.block_table},
          {"--sinks", o.sinks},
          {"--alibi", o.alibi}};
}

void write_attention_outputs(const AttentionCall& call, const AttentionOptions& o,
                             OutputFiles& outputs) {
  std::vector<const NpyArray*> arrays;  // in the order of attention_outputs()
  if (!o.lse.empty()) arrays.push_back(&call.lse_array);
  if (!o.out.empty()) arrays.push_back(&call.out_array);
  outputs.commit(arrays);
}

void print_stdout_line(const std::string& line) {
  errno = 0;
  const bool ok = std::printf("%s\n", line.c_str()) >= 0 && std::fflush(stdout) == 0 &&
                  std::ferror(stdout) == 0;
  if (!ok) {
    const int err = errno;
    std::clearerr(stdout);
    throw ToolError(std::string("cannot write to stdout: ") +
                    (err != 0 ? std::strerror(err) : "write error"));
  }
}

int run_attention_command(const AttentionOptions& o) {
  return run_guarded([&o] {
    check_attention_options(o);
    OutputFiles outputs(attention_outputs(o), attention_inputs(o));
    configure_runtime(o.backend, o.threads);
    AttentionInputs inputs = load_attention_inputs(o);
    AttentionCall call = prepare_attention_call(inputs, o);
    call_attention(call);
    write_attention_outputs(call, o, outputs);
    if (o.repeat > 0) {
      const Timing timing = time_attention(call, o.repeat);
      const Dtypes dtypes{static_cast<mha_dtype>(call.q.dtype),
                          static_cast<mha_dtype>(call.k.dtype)};
      print_stdout_line(timing_json(timing, attention_flops(call), dtypes));
    }
    return kExitOk;
  });
}

}  // namespace mha_tools
