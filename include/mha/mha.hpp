// mha — a thin C++ layer over the C API: errors become exceptions, tensors are
// built from shapes, parameters are set by name.  Header-only; links libmha.
//
// Needs C++17 or later (-std=c++17): below that it stops with #error.  C++17
// brings class template argument deduction, by which mha::Tensor(ptr, shape)
// is read-only over a const pointer and writable over a mutable one.  The C
// API, mha.h, is plain C99 and works from any C++.
//
//   mha::Tensor q(q_ptr, {B, H, Lq, D});      // const float*: read-only, an input only
//   mha::Tensor out(out_ptr, {B, H, Lq, Dv});  // float*: writable, an input or an output
//   mha::attention(q, k, v, out);              // an output over const memory: compile error
//
// Shapes and strides are brace lists or any contiguous range of integers
// (std::vector, std::array, a C array).  Declare a const and a mutable tensor
// in separate declarations (one declaration deduces one type), and take
// mha::ConstTensor (inputs) or mha::MutableTensor (outputs) in your own
// functions: mha::Tensor alone names a template.
//
// Tensors and parameter objects describe memory, they never own it: the data
// stay the caller's and must live until the call that uses them returns.
#pragma once

#if !(__cplusplus >= 201703L || (defined(_MSVC_LANG) && _MSVC_LANG >= 201703L))
#error "mha.hpp needs C++17 or later (-std=c++17); mha.h (the C API) works with any C++"
#endif

#include <mha/mha.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mha {

// ------------------------------------------------------------------ errors

class Error : public std::runtime_error {
 public:
  Error(mha_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  mha_status status() const noexcept { return status_; }

 private:
  mha_status status_;
};

// Throws mha::Error with the C API's message when status is not MHA_OK.
inline void check(mha_status status) {
  if (status != MHA_OK) {
    throw Error(status, std::string(mha_status_name(status)) + ": " + mha_last_error());
  }
}

namespace detail {

// Errors found in this header read as the C API's: "MHA_ERR_...: message".
[[noreturn]] inline void fail(mha_status status, const std::string& message) {
  throw Error(status, std::string(mha_status_name(status)) + ": " + message);
}

// The character types (a shape or a tensor of them is a mistake).
template <class T>
constexpr bool is_character_v = std::is_same_v<T, char> || std::is_same_v<T, wchar_t> ||
                                std::is_same_v<T, char16_t> || std::is_same_v<T, char32_t>
#if defined(__cpp_char8_t)
                                || std::is_same_v<T, char8_t>
#endif
    ;

// A signed integer type that is not text (wchar_t is a 4-byte one here).
template <class T>
constexpr bool is_signed_integer_v =
    std::is_integral_v<T>&& std::is_signed_v<T> && !is_character_v<T>;

// The dtype of an element type: float, bool, int8_t, and 32- or 64-bit signed
// integers.
template <class T>
constexpr mha_dtype dtype_of() noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) {
    return MHA_DTYPE_F32;
  } else if constexpr (std::is_same_v<U, bool>) {
    return MHA_DTYPE_BOOL;
  } else if constexpr (std::is_same_v<U, int8_t>) {  // an int8 KV cache
    return MHA_DTYPE_I8;
  } else if constexpr (is_signed_integer_v<U> && sizeof(U) == 4) {
    return MHA_DTYPE_I32;
  } else if constexpr (is_signed_integer_v<U> && sizeof(U) == 8) {
    return MHA_DTYPE_I64;
  } else {
    return MHA_DTYPE_INVALID;
  }
}

// An integer type a shape can be made of (not bool, not a character type).
template <class T>
constexpr bool is_extent_type_v =
    std::is_integral_v<T> && !std::is_same_v<T, bool> && !is_character_v<T> &&
    !std::is_same_v<T, signed char> && !std::is_same_v<T, unsigned char>;

// A value of a brace list of shapes: an integer or an unscoped enumerator.
template <class T>
constexpr bool is_list_extent_v = is_extent_type_v<T> ||
                                  (std::is_enum_v<T> && std::is_convertible_v<T, int64_t>);

template <class R>
using range_value_t =
    std::remove_cv_t<std::remove_reference_t<decltype(*std::data(std::declval<const R&>()))>>;

template <class R, class = void>
struct is_contiguous_extents : std::false_type {};
template <class R>
struct is_contiguous_extents<R, std::void_t<decltype(std::data(std::declval<const R&>())),
                                            decltype(std::size(std::declval<const R&>()))>>
    : std::bool_constant<is_extent_type_v<range_value_t<R>>> {};

}  // namespace detail

// ------------------------------------------------------------------ shapes

// A shape or a list of strides, copied from a brace list ({B, H, L, D}) or any
// contiguous range of integers: std::vector, std::array, a C array.  The
// values of a brace list may be of any integer types, mixed ({n, h, 1, d} with
// size_t n: an initializer_list<int64_t> would be a narrowing error there).
// Values that do not fit in int64_t are refused (mha::Error,
// MHA_ERR_INVALID_SIZE).
class Dims {
 public:
  Dims() noexcept = default;
  // A brace list of one integer type.
  template <class I, std::enable_if_t<detail::is_extent_type_v<I>, int> = 0>
  Dims(std::initializer_list<I> values) : size_(values.size()) {
    size_t i = 0;
    for (I value : values) {
      if (i == MHA_MAX_DIMS) break;
      values_[i++] = to_int64(value);
    }
  }
  // A brace list of several integer types (no initializer_list is deduced for
  // it, so list-initialisation takes its values as arguments here), unscoped
  // enumerators among them ({B, kHeads, L, D}), as int64_t's list took them.
  template <class... I,
            std::enable_if_t<(sizeof...(I) >= 2) && (detail::is_list_extent_v<I> && ...), int> = 0>
  Dims(I... values) : size_(sizeof...(I)) {
    const int64_t converted[] = {to_int64(values)...};
    for (size_t i = 0; i < size_ && i < MHA_MAX_DIMS; ++i) values_[i] = converted[i];
  }
  template <class Range, std::enable_if_t<!std::is_same_v<std::decay_t<Range>, Dims> &&
                                              detail::is_contiguous_extents<Range>::value,
                                          int> = 0>
  Dims(const Range& values) : size_(static_cast<size_t>(std::size(values))) {  // implicit
    const auto* first = std::data(values);
    for (size_t i = 0; i < size_ && i < MHA_MAX_DIMS; ++i) values_[i] = to_int64(first[i]);
  }

  // The number of values given (a shape of more than MHA_MAX_DIMS keeps only
  // the first ones, and a tensor built from it is refused).
  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  const int64_t* data() const noexcept { return values_; }
  int64_t operator[](size_t i) const noexcept { return values_[i]; }

 private:
  template <class I>
  static int64_t to_int64(I value) {
    if constexpr (std::is_unsigned_v<I> && sizeof(I) >= sizeof(int64_t)) {
      if (value > static_cast<I>(std::numeric_limits<int64_t>::max())) {
        detail::fail(MHA_ERR_INVALID_SIZE,
                     "a shape or stride value " + std::to_string(value) + " exceeds INT64_MAX");
      }
    }
    return static_cast<int64_t>(value);
  }

  int64_t values_[MHA_MAX_DIMS] = {};
  size_t size_ = 0;
};

// ------------------------------------------------------------------ tensors

// A tensor view: a data pointer, a dtype, a shape and strides counted in
// elements (C order unless given).  It never owns the data.  The template
// argument is the element type as seen through the pointer, const or not:
//   mha::Tensor t(ptr, {2, 3});       Tensor<float> over float*, Tensor<const float>
//                                     over const float* (deduced); float, bool,
//                                     int32_t and int64_t elements name their dtype
//   mha::Tensor t(ptr, MHA_DTYPE_BOOL, {2, 3})
//                                     Tensor<void> or Tensor<const void>: any
//                                     element type, the dtype given
// Inputs take a ConstTensor (Tensor<const void>), which any tensor converts to.
// Outputs take a MutableTensor (Tensor<void>), which only tensors over non-const
// memory convert to: an output over const memory is a compile error.
template <class T>
class Tensor {
  static_assert(!std::is_reference_v<T> && !std::is_volatile_v<T>,
                "mha::Tensor<T>: T is the element type, without & or volatile");

 public:
  using element_type = T;
  static constexpr bool writable = !std::is_const_v<T>;

  // A typed view: the dtype follows from T.
  template <class U = T, std::enable_if_t<!std::is_void_v<U>, int> = 0>
  Tensor(T* data, const Dims& shape, const Dims& strides = Dims()) {
    static_assert(detail::dtype_of<U>() != MHA_DTYPE_INVALID,
                  "mha::Tensor: no mha dtype for this element type (float, bool, int8_t, int32_t "
                  "and int64_t have one); give the dtype: mha::Tensor(ptr, MHA_DTYPE_..., "
                  "shape)");
    init(const_cast<std::remove_const_t<T>*>(data), detail::dtype_of<U>(), shape, strides);
  }

  // A view of any element type with its dtype given: Tensor<void> over
  // mutable memory, Tensor<const void> over const memory.
  template <class U, std::enable_if_t<std::is_void_v<T> && std::is_convertible_v<U*, T*>, int> = 0>
  Tensor(U* data, mha_dtype dtype, const Dims& shape, const Dims& strides = Dims()) {
    init(const_cast<void*>(static_cast<const void*>(data)), dtype, shape, strides);
  }

  // Writable to read-only, typed to type-erased; never the other way.
  template <class U,
            std::enable_if_t<std::is_convertible_v<U*, T*> &&
                                 (std::is_void_v<T> ||
                                  std::is_same_v<std::remove_cv_t<U>, std::remove_cv_t<T>>),
                             int> = 0>
  Tensor(const Tensor<U>& other) noexcept : desc_(*other.get()) {}  // implicit

  // The C descriptor; a mutable one only for a writable tensor.
  const mha_tensor* get() const noexcept { return &desc_; }
  // (U is T: a caller's get<void>() on a read-only tensor does not compile.)
  template <class U = T, std::enable_if_t<std::is_same_v<U, T> && !std::is_const_v<U>, int> = 0>
  mha_tensor* get() noexcept {
    return &desc_;
  }

  T* data() const noexcept { return static_cast<T*>(desc_.data); }
  mha_dtype dtype() const noexcept { return static_cast<mha_dtype>(desc_.dtype); }
  int32_t ndim() const noexcept { return desc_.ndim; }
  int64_t shape(int32_t axis) const noexcept { return desc_.shape[axis]; }
  int64_t stride(int32_t axis) const noexcept { return desc_.strides[axis]; }

 private:
  void init(void* data, mha_dtype dtype, const Dims& shape, const Dims& strides) {
    if (shape.empty() || shape.size() > MHA_MAX_DIMS) {
      detail::fail(MHA_ERR_INVALID_SIZE, "a tensor has 1 to " + std::to_string(MHA_MAX_DIMS) +
                                             " dimensions, not " + std::to_string(shape.size()));
    }
    if (!strides.empty() && strides.size() != shape.size()) {
      detail::fail(MHA_ERR_INVALID_STRIDES, std::to_string(strides.size()) + " strides for " +
                                                std::to_string(shape.size()) + " dimensions");
    }
    check(mha_tensor_init(&desc_, data, dtype, static_cast<int32_t>(shape.size()), shape.data(),
                          strides.empty() ? nullptr : strides.data()));
  }

  mha_tensor desc_{};
};

template <class U>
Tensor(U*, mha_dtype, const Dims&) -> Tensor<void>;
template <class U>
Tensor(U*, mha_dtype, const Dims&, const Dims&) -> Tensor<void>;
template <class U>
Tensor(const U*, mha_dtype, const Dims&) -> Tensor<const void>;
template <class U>
Tensor(const U*, mha_dtype, const Dims&, const Dims&) -> Tensor<const void>;

using ConstTensor = Tensor<const void>;  // what inputs take: any tensor
using MutableTensor = Tensor<void>;      // what outputs take: tensors over non-const memory

// ------------------------------------------------ scaled dot-product attention

// A setter called on a temporary returns the object itself by value (a
// copy, which points at its own descriptors), so that
//   const auto& p = mha::AttentionParams().causal(MHA_CAUSAL_TOP_LEFT);
// keeps a live object: the lvalue setters' reference would dangle there.
#define MHA_HPP_RVALUE_SETTER(Class, name)                    \
  template <typename... Args>                                 \
  Class name(Args&&... args)&& noexcept {                     \
    name(std::forward<Args>(args)...); /* *this: an lvalue */ \
    return std::move(*this);                                  \
  }

// Parameters of attention().  Tensors given here are copied as descriptors
// (data pointer, dtype, shape, strides), so temporaries are fine:
//   mha::AttentionParams().mask(mha::Tensor(m, {Lq, Lk}))
// The data they point to are borrowed: they must live until attention()
// returns.  Copies and moves carry the descriptors along.
class AttentionParams {
 public:
  AttentionParams() noexcept { mha_attention_params_init(&params_); }
  AttentionParams(const AttentionParams& other) noexcept { assign(other); }
  AttentionParams& operator=(const AttentionParams& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  // A move is a copy: the descriptors live inside the object.
  AttentionParams(AttentionParams&& other) noexcept { assign(other); }
  AttentionParams& operator=(AttentionParams&& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  ~AttentionParams() = default;

  // Default 1/sqrt(D); must be finite and non-zero.
  AttentionParams& scale(float s) & noexcept {
    params_.has_scale = 1;
    params_.scale = s;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, scale)
  AttentionParams& causal(mha_causal mode) & noexcept {
    params_.causal = mode;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, causal)
  // Sliding window: query i sees keys i+Lk-Lq-left .. i+Lk-Lq+right; -1
  // leaves a side unbounded (the default).
  AttentionParams& window(int64_t left, int64_t right) & noexcept {
    params_.window_left = left;
    params_.window_right = right;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, window)
  // I32 or I64 [B] or [B, Lq]: key j takes part in a row iff j < valid length.
  AttentionParams& valid_lens(const ConstTensor& t) & noexcept {
    valid_lens_ = *t.get();
    params_.valid_lens = &valid_lens_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, valid_lens)
  // BOOL (true = the key takes part) or F32 (added to the scaled scores).
  AttentionParams& mask(const ConstTensor& t) & noexcept {
    mask_ = *t.get();
    params_.mask = &mask_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, mask)
  // Output: F32 [B, H, Lq], the log of each row's softmax denominator.
  AttentionParams& lse(const MutableTensor& t) & noexcept {
    lse_ = *t.get();
    params_.lse = &lse_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, lse)
  AttentionParams& dropout(float p, uint64_t seed) & noexcept {
    params_.dropout_p = p;
    params_.dropout_seed = seed;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, dropout)
  // Attention sinks: F32 [H], per-head logits in each row's denominator.
  AttentionParams& sinks(const ConstTensor& t) & noexcept {
    sinks_ = *t.get();
    params_.sinks = &sinks_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, sinks)
  // Logit softcap: s <- cap · tanh(s / cap); 0 turns it off.
  AttentionParams& softcap(float cap) & noexcept {
    params_.softcap = cap;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, softcap)
  // ALiBi: F32 slopes [H] or [B, H]; adds -slope · |i + Lk - Lq - j|.
  AttentionParams& alibi_slopes(const ConstTensor& t) & noexcept {
    alibi_slopes_ = *t.get();
    params_.alibi_slopes = &alibi_slopes_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, alibi_slopes)
  // The call as one block of a larger problem: queries [query_offset, +Lq)
  // and keys [key_offset, +Lk) of full_lq x full_lk (0: the block ends the
  // problem).  The causal rule, the window, ALiBi and dropout use full
  // positions; merge the blocks with merge_partials.
  AttentionParams& block(int64_t query_offset, int64_t key_offset, int64_t full_lq = 0,
                         int64_t full_lk = 0) & noexcept {
    params_.query_offset = query_offset;
    params_.key_offset = key_offset;
    params_.full_lq = full_lq;
    params_.full_lk = full_lk;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, block)
  // An int8 KV cache's row scales (K and V of dtype I8): F32 [B, Hkv, Lk]
  // each ([total_k, Hkv] for attention_varlen, [num_blocks, block_size, Hkv]
  // for a paged cache), value = scale · int8.
  AttentionParams& kv_scales(const ConstTensor& k_scale, const ConstTensor& v_scale) & noexcept {
    k_scale_ = *k_scale.get();
    v_scale_ = *v_scale.get();
    params_.k_scale = &k_scale_;
    params_.v_scale = &v_scale_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(AttentionParams, kv_scales)

  // The C struct; its tensor pointers point into this object.
  const mha_attention_params* get() const noexcept { return &params_; }

 private:
  void assign(const AttentionParams& other) noexcept {
    params_ = other.params_;
    valid_lens_ = other.valid_lens_;
    mask_ = other.mask_;
    lse_ = other.lse_;
    sinks_ = other.sinks_;
    alibi_slopes_ = other.alibi_slopes_;
    k_scale_ = other.k_scale_;
    v_scale_ = other.v_scale_;
    params_.valid_lens = other.params_.valid_lens != nullptr ? &valid_lens_ : nullptr;
    params_.mask = other.params_.mask != nullptr ? &mask_ : nullptr;
    params_.lse = other.params_.lse != nullptr ? &lse_ : nullptr;
    params_.sinks = other.params_.sinks != nullptr ? &sinks_ : nullptr;
    params_.alibi_slopes = other.params_.alibi_slopes != nullptr ? &alibi_slopes_ : nullptr;
    params_.k_scale = other.params_.k_scale != nullptr ? &k_scale_ : nullptr;
    params_.v_scale = other.params_.v_scale != nullptr ? &v_scale_ : nullptr;
  }

  mha_attention_params params_{};
  mha_tensor valid_lens_{};
  mha_tensor mask_{};
  mha_tensor lse_{};
  mha_tensor sinks_{};
  mha_tensor alibi_slopes_{};
  mha_tensor k_scale_{};
  mha_tensor v_scale_{};
};

// out = softmax(Q·Kᵀ·scale + mask)·V; throws mha::Error on bad input.
inline void attention(const ConstTensor& q, const ConstTensor& k, const ConstTensor& v,
                      MutableTensor out, const AttentionParams& params = AttentionParams()) {
  check(mha_attention(q.get(), k.get(), v.get(), out.get(), params.get()));
}

// The optional outputs of attention_backward (mha_backward_params): the sinks'
// gradient [H] and an additive mask's, of the mask's own shape.  Descriptors
// are copied (temporaries are fine); their data are borrowed until the call.
class BackwardParams {
 public:
  BackwardParams() noexcept { mha_backward_params_init(&params_); }
  BackwardParams(const BackwardParams& other) noexcept { assign(other); }
  BackwardParams& operator=(const BackwardParams& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  BackwardParams(BackwardParams&& other) noexcept { assign(other); }
  BackwardParams& operator=(BackwardParams&& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  ~BackwardParams() = default;

  BackwardParams& dsinks(const MutableTensor& t) & noexcept {
    dsinks_ = *t.get();
    params_.dsinks = &dsinks_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(BackwardParams, dsinks)
  BackwardParams& dmask(const MutableTensor& t) & noexcept {
    dmask_ = *t.get();
    params_.dmask = &dmask_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(BackwardParams, dmask)
  const mha_backward_params* get() const noexcept { return &params_; }

 private:
  void assign(const BackwardParams& other) noexcept {
    params_ = other.params_;
    dsinks_ = other.dsinks_;
    dmask_ = other.dmask_;
    params_.dsinks = other.params_.dsinks != nullptr ? &dsinks_ : nullptr;
    params_.dmask = other.params_.dmask != nullptr ? &dmask_ : nullptr;
  }

  mha_backward_params params_{};
  mha_tensor dsinks_{};
  mha_tensor dmask_{};
};

// The gradients of attention(q, k, v, out, params) for dout = dL/d(out):
// dq, dk, dv (overwritten), from the forward's out and its lse [B, H, Lq]
// (params.lse of the forward call; ignored here).  Throws mha::Error.
inline void attention_backward(const ConstTensor& q, const ConstTensor& k, const ConstTensor& v,
                               const ConstTensor& out, const ConstTensor& lse,
                               const ConstTensor& dout, MutableTensor dq, MutableTensor dk,
                               MutableTensor dv, const AttentionParams& params = AttentionParams(),
                               const BackwardParams& backward = BackwardParams()) {
  check(mha_attention_backward(q.get(), k.get(), v.get(), out.get(), lse.get(), dout.get(),
                               dq.get(), dk.get(), dv.get(), params.get(), backward.get()));
}

// A packed batch of sequences of different lengths (mha_attention_varlen,
// FlashAttention-2's varlen layout): sequence b's queries are rows
// cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q and out, its keys rows
// cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1 of k and v; each is computed as
// attention() would compute it alone (its own Lq and Lk for the causal rule,
// the window and ALiBi).
//   q [total_q, H, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv],
//   out [total_q, H, Dv]; cu_seqlens_q, cu_seqlens_k I32 [B + 1].
// params as for attention(), except: lse F32 [H, total_q]; alibi_slopes [H]
// or [B, H]; kv_scales [total_k, Hkv]; dropout seeds dropout_seed + b for
// sequence b; valid_lens and mask are refused.  Throws mha::Error on bad input.
inline void attention_varlen(const ConstTensor& q, const ConstTensor& k, const ConstTensor& v,
                             MutableTensor out, const ConstTensor& cu_seqlens_q,
                             const ConstTensor& cu_seqlens_k,
                             const AttentionParams& params = AttentionParams()) {
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = cu_seqlens_q.get();
  varlen.cu_seqlens_k = cu_seqlens_k.get();
  check(mha_attention_varlen(q.get(), k.get(), v.get(), out.get(), &varlen, params.get()));
}

// The batch of attention_varlen (mha_varlen_params): the query offsets, and
// the keys either packed (key offsets) or in a paged KV cache (a block table
// and each sequence's key count).  As AttentionParams: tensors are copied as
// descriptors (temporaries are fine), their data are borrowed until the call
// returns, copies and moves carry the descriptors along.
//   packed: mha::VarlenParams().cu_seqlens_q(cu_q).cu_seqlens_k(cu_k)
//   paged:  mha::VarlenParams().cu_seqlens_q(cu_q).seqused_k(used).block_table(table)
class VarlenParams {
 public:
  VarlenParams() noexcept { mha_varlen_params_init(&varlen_); }
  VarlenParams(const VarlenParams& other) noexcept { assign(other); }
  VarlenParams& operator=(const VarlenParams& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  // A move is a copy: the descriptors live inside the object.
  VarlenParams(VarlenParams&& other) noexcept { assign(other); }
  VarlenParams& operator=(VarlenParams&& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  ~VarlenParams() = default;

  // I32 [B + 1]: 0, non-decreasing, ending at total_q.  Required.
  VarlenParams& cu_seqlens_q(const ConstTensor& t) & noexcept {
    cu_seqlens_q_ = *t.get();
    varlen_.cu_seqlens_q = &cu_seqlens_q_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(VarlenParams, cu_seqlens_q)
  // I32 [B + 1], ending at total_k: packed keys.  Refused with a block table.
  VarlenParams& cu_seqlens_k(const ConstTensor& t) & noexcept {
    cu_seqlens_k_ = *t.get();
    varlen_.cu_seqlens_k = &cu_seqlens_k_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(VarlenParams, cu_seqlens_k)
  // I32 [B]: the keys sequence b uses -- the first seqused_k[b] of its rows
  // (packed keys, optional), or of its pages (a paged cache, required).
  VarlenParams& seqused_k(const ConstTensor& t) & noexcept {
    seqused_k_ = *t.get();
    varlen_.seqused_k = &seqused_k_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(VarlenParams, seqused_k)
  // I32 [B, max_blocks]: a paged KV cache; k and v are then [num_blocks,
  // block_size, Hkv, D / Dv] and key j of sequence b is row j % block_size of
  // block block_table[b][j / block_size].
  VarlenParams& block_table(const ConstTensor& t) & noexcept {
    block_table_ = *t.get();
    varlen_.block_table = &block_table_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(VarlenParams, block_table)

  // The C struct; its tensor pointers point into this object.
  const mha_varlen_params* get() const noexcept { return &varlen_; }

 private:
  void assign(const VarlenParams& other) noexcept {
    varlen_ = other.varlen_;
    cu_seqlens_q_ = other.cu_seqlens_q_;
    cu_seqlens_k_ = other.cu_seqlens_k_;
    seqused_k_ = other.seqused_k_;
    block_table_ = other.block_table_;
    varlen_.cu_seqlens_q = other.varlen_.cu_seqlens_q != nullptr ? &cu_seqlens_q_ : nullptr;
    varlen_.cu_seqlens_k = other.varlen_.cu_seqlens_k != nullptr ? &cu_seqlens_k_ : nullptr;
    varlen_.seqused_k = other.varlen_.seqused_k != nullptr ? &seqused_k_ : nullptr;
    varlen_.block_table = other.varlen_.block_table != nullptr ? &block_table_ : nullptr;
  }

  mha_varlen_params varlen_{};
  mha_tensor cu_seqlens_q_{};
  mha_tensor cu_seqlens_k_{};
  mha_tensor seqused_k_{};
  mha_tensor block_table_{};
};

// attention_varlen with the batch described by a VarlenParams: packed keys
// (with seqused_k if wanted), or a paged KV cache (vLLM's and
// FlashAttention-2's layout) for decoding and chunked prefill:
//   q [total_q, H, D], k [num_blocks, block_size, Hkv, D],
//   v [num_blocks, block_size, Hkv, Dv], out [total_q, H, Dv];
//   varlen: cu_seqlens_q, seqused_k and block_table (no cu_seqlens_k).
// params as for the packed call; an int8 cache's kv_scales are F32
// [num_blocks, block_size, Hkv].  Chunked prefill wants
// causal(MHA_CAUSAL_BOTTOM_RIGHT).  Throws mha::Error on bad input, naming
// the argument (varlen->block_table, seqused_k, ...).
inline void attention_varlen(const ConstTensor& q, const ConstTensor& k, const ConstTensor& v,
                             MutableTensor out, const VarlenParams& varlen,
                             const AttentionParams& params = AttentionParams()) {
  check(mha_attention_varlen(q.get(), k.get(), v.get(), out.get(), varlen.get(), params.get()));
}

// The gradients of attention_varlen over packed keys
// (mha_attention_varlen_backward): each sequence's as attention_backward
// gives them for that sequence alone, B = 1.
//   out, dout [total_q, H, Dv]; lse F32 [H, total_q] (the forward's);
//   dq [total_q, H, D], dk [total_k, Hkv, D], dv [total_k, Hkv, Dv]
//   (overwritten; rows no query reads get zeros); varlen: cu_seqlens_q,
//   cu_seqlens_k and optionally seqused_k (no block table).
// params as for the forward (its lse ignored); backward's dsinks receives the
// sum over the sequences.  Throws mha::Error on bad input, naming the
// argument.
inline void attention_varlen_backward(const ConstTensor& q, const ConstTensor& k,
                                      const ConstTensor& v, const ConstTensor& out,
                                      const ConstTensor& lse, const ConstTensor& dout,
                                      MutableTensor dq, MutableTensor dk, MutableTensor dv,
                                      const VarlenParams& varlen,
                                      const AttentionParams& params = AttentionParams(),
                                      const BackwardParams& backward = BackwardParams()) {
  check(mha_attention_varlen_backward(q.get(), k.get(), v.get(), out.get(), lse.get(), dout.get(),
                                      dq.get(), dk.get(), dv.get(), varlen.get(), params.get(),
                                      backward.get()));
}

// An int8 KV cache's rows (mha_quantize_kv): src F32, BF16 or F16 [B, Hkv,
// L, D] into dst I8 [B, Hkv, L, D] (an mha::Tensor<int8_t>) and scale F32
// [B, Hkv, L], one scale per row, max|row| / 127; pass them as k or v and
// AttentionParams::kv_scales.  A row with NaN or an infinity is refused
// (mha::Error), nothing written.
inline void quantize_kv(const ConstTensor& src, MutableTensor dst, MutableTensor scale) {
  check(mha_quantize_kv(src.get(), dst.get(), scale.get()));
}

// Writes new K and V rows into their slots of a paged cache (vLLM's
// reshape_and_cache, mha_kv_cache_write): key [T, Hkv, D] and value [T, Hkv,
// Dv] (F32, BF16 or F16) into key_cache [num_blocks, block_size, Hkv, D] and
// value_cache [.., Dv] (F32, BF16, F16, or I8 with the scale caches F32
// [num_blocks, block_size, Hkv]); token t goes to slot slot_mapping[t] (I32
// or I64 [T]) = block · block_size + row, a negative slot skips it.  Every
// check runs before anything is written; throws mha::Error on bad input.
inline void kv_cache_write(const ConstTensor& key, const ConstTensor& value,
                           MutableTensor key_cache, MutableTensor value_cache,
                           const ConstTensor& slot_mapping) {
  check(mha_kv_cache_write(key.get(), value.get(), key_cache.get(), value_cache.get(),
                           slot_mapping.get(), nullptr, nullptr));
}
inline void kv_cache_write(const ConstTensor& key, const ConstTensor& value,
                           MutableTensor key_cache, MutableTensor value_cache,
                           const ConstTensor& slot_mapping, MutableTensor key_scale_cache,
                           MutableTensor value_scale_cache) {
  check(mha_kv_cache_write(key.get(), value.get(), key_cache.get(), value_cache.get(),
                           slot_mapping.get(), key_scale_cache.get(), value_scale_cache.get()));
}

namespace detail {

template <class R, class = void>
struct is_tensor_range : std::false_type {};
template <class R>
struct is_tensor_range<R, std::void_t<decltype(std::begin(std::declval<const R&>())),
                                      decltype(std::end(std::declval<const R&>()))>>
    : std::is_convertible<decltype(*std::begin(std::declval<const R&>())), ConstTensor> {};

template <class Outs, class Lses>
using if_tensor_ranges =
    std::enable_if_t<is_tensor_range<Outs>::value && is_tensor_range<Lses>::value, int>;

template <class Range>
std::vector<mha_tensor> descriptors(const Range& tensors) {
  std::vector<mha_tensor> result;
  result.reserve(static_cast<size_t>(std::distance(std::begin(tensors), std::end(tensors))));
  for (const auto& t : tensors) result.push_back(*ConstTensor(t).get());
  return result;
}

inline void merge(const std::vector<mha_tensor>& outs, const std::vector<mha_tensor>& lses,
                  MutableTensor& out, mha_tensor* lse) {
  if (outs.size() != lses.size()) {
    fail(MHA_ERR_SHAPE_MISMATCH, "merge_partials: " + std::to_string(outs.size()) +
                                     " partial outputs but " + std::to_string(lses.size()) +
                                     " LSEs");
  }
  if (outs.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    fail(MHA_ERR_INVALID_SIZE, "merge_partials: " + std::to_string(outs.size()) + " parts");
  }
  check(mha_merge_partials(static_cast<int32_t>(outs.size()), outs.data(), lses.data(), out.get(),
                           lse));
}

}  // namespace detail

// Combines results of the same queries over disjoint key ranges — each
// attention() over its own keys with its LSE — into the result over all keys
// (mha_merge_partials): outs[c] F32 [B, H, Lq, Dv], lses[c] F32 [B, H, Lq],
// out [B, H, Lq, Dv], lse [B, H, Lq] (optional).  outs and lses are brace
// lists or ranges (std::vector, std::array, ...) of tensors.
inline void merge_partials(std::initializer_list<ConstTensor> outs,
                           std::initializer_list<ConstTensor> lses, MutableTensor out) {
  detail::merge(detail::descriptors(outs), detail::descriptors(lses), out, nullptr);
}
inline void merge_partials(std::initializer_list<ConstTensor> outs,
                           std::initializer_list<ConstTensor> lses, MutableTensor out,
                           MutableTensor lse) {
  detail::merge(detail::descriptors(outs), detail::descriptors(lses), out, lse.get());
}
template <class Outs, class Lses, detail::if_tensor_ranges<Outs, Lses> = 0>
void merge_partials(const Outs& outs, const Lses& lses, MutableTensor out) {
  detail::merge(detail::descriptors(outs), detail::descriptors(lses), out, nullptr);
}
template <class Outs, class Lses, detail::if_tensor_ranges<Outs, Lses> = 0>
void merge_partials(const Outs& outs, const Lses& lses, MutableTensor out, MutableTensor lse) {
  detail::merge(detail::descriptors(outs), detail::descriptors(lses), out, lse.get());
}

// ------------------------------------------------ the multi-head attention module

// The module's configuration (mha_module_config): embed_dim and num_heads are
// required; the input sizes default to embed_dim (0), biases are on as in
// PyTorch (d2l's default is off).
struct ModuleConfig {
  int64_t embed_dim = 0;
  int64_t num_heads = 0;
  int64_t query_dim = 0;  // 0: embed_dim
  int64_t key_dim = 0;    // 0: embed_dim
  int64_t value_dim = 0;  // 0: embed_dim
  bool bias = true;
  float dropout = 0.0f;  // on the attention weights in training mode, [0, 1)
};

// Parameters of Module::forward.  As AttentionParams: tensors are copied as
// descriptors (temporaries are fine), their data are borrowed until the call
// returns, copies and moves carry the descriptors along.
class ModuleForwardParams {
 public:
  ModuleForwardParams() noexcept { mha_module_forward_params_init(&params_); }
  ModuleForwardParams(const ModuleForwardParams& other) noexcept { assign(other); }
  ModuleForwardParams& operator=(const ModuleForwardParams& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  // A move is a copy: the descriptors live inside the object.
  ModuleForwardParams(ModuleForwardParams&& other) noexcept { assign(other); }
  ModuleForwardParams& operator=(ModuleForwardParams&& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  ~ModuleForwardParams() = default;

  // d2l's valid_lens: I32/I64 [B] or [B, Lq].
  ModuleForwardParams& valid_lens(const ConstTensor& t) & noexcept {
    valid_lens_ = *t.get();
    params_.valid_lens = &valid_lens_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, valid_lens)
  // PyTorch's convention: bool true = the key is ignored; or f32, added.
  ModuleForwardParams& key_padding_mask(const ConstTensor& t) & noexcept {
    key_padding_mask_ = *t.get();
    params_.key_padding_mask = &key_padding_mask_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, key_padding_mask)
  // PyTorch's convention: bool true = not allowed; or f32, added.
  ModuleForwardParams& attn_mask(const ConstTensor& t) & noexcept {
    attn_mask_ = *t.get();
    params_.attn_mask = &attn_mask_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, attn_mask)
  ModuleForwardParams& causal(mha_causal mode) & noexcept {
    params_.causal = mode;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, causal)
  // Output: [B, H, Lq, Lk], or [B, Lq, Lk] when averaged over the heads.
  ModuleForwardParams& attn_weights(const MutableTensor& t, bool average = false) & noexcept {
    attn_weights_ = *t.get();
    params_.attn_weights = &attn_weights_;
    params_.average_attn_weights = average ? 1 : 0;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, attn_weights)
  // Training mode: dropout as configured, decided by the seed.
  ModuleForwardParams& training(uint64_t dropout_seed) & noexcept {
    params_.training = 1;
    params_.dropout_seed = dropout_seed;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, training)
  // The attention variants, as AttentionParams' (H = the module's heads).
  // Sliding window: query i sees keys i+Lk-Lq-left .. i+Lk-Lq+right; -1
  // leaves a side unbounded (the default).
  ModuleForwardParams& window(int64_t left, int64_t right) & noexcept {
    params_.window_left = left;
    params_.window_right = right;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, window)
  // Attention sinks: F32 [H], per-head logits in each row's denominator.
  ModuleForwardParams& sinks(const ConstTensor& t) & noexcept {
    sinks_ = *t.get();
    params_.sinks = &sinks_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, sinks)
  // Logit softcap: s <- cap · tanh(s / cap); 0 turns it off.
  ModuleForwardParams& softcap(float cap) & noexcept {
    params_.softcap = cap;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, softcap)
  // ALiBi: F32 slopes [H] or [B, H]; adds -slope · |i + Lk - Lq - j|.
  ModuleForwardParams& alibi_slopes(const ConstTensor& t) & noexcept {
    alibi_slopes_ = *t.get();
    params_.alibi_slopes = &alibi_slopes_;
    return *this;
  }
  MHA_HPP_RVALUE_SETTER(ModuleForwardParams, alibi_slopes)

  // The C struct; its tensor pointers point into this object.
  const mha_module_forward_params* get() const noexcept { return &params_; }

 private:
  void assign(const ModuleForwardParams& other) noexcept {
    params_ = other.params_;
    valid_lens_ = other.valid_lens_;
    key_padding_mask_ = other.key_padding_mask_;
    attn_mask_ = other.attn_mask_;
    attn_weights_ = other.attn_weights_;
    sinks_ = other.sinks_;
    alibi_slopes_ = other.alibi_slopes_;
    params_.valid_lens = other.params_.valid_lens != nullptr ? &valid_lens_ : nullptr;
    params_.key_padding_mask =
        other.params_.key_padding_mask != nullptr ? &key_padding_mask_ : nullptr;
    params_.attn_mask = other.params_.attn_mask != nullptr ? &attn_mask_ : nullptr;
    params_.attn_weights = other.params_.attn_weights != nullptr ? &attn_weights_ : nullptr;
    params_.sinks = other.params_.sinks != nullptr ? &sinks_ : nullptr;
    params_.alibi_slopes = other.params_.alibi_slopes != nullptr ? &alibi_slopes_ : nullptr;
  }

  mha_module_forward_params params_{};
  mha_tensor valid_lens_{};
  mha_tensor key_padding_mask_{};
  mha_tensor attn_mask_{};
  mha_tensor attn_weights_{};
  mha_tensor sinks_{};
  mha_tensor alibi_slopes_{};
};

// The gradients Module::backward writes (mha_module_gradients): each optional
// and overwritten; named as in PyTorch's state_dict.  Descriptors are copied,
// data borrowed until the call.
class ModuleGradients {
 public:
  ModuleGradients() noexcept { mha_module_gradients_init(&grads_); }
  ModuleGradients(const ModuleGradients& other) noexcept { assign(other); }
  ModuleGradients& operator=(const ModuleGradients& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  ModuleGradients(ModuleGradients&& other) noexcept { assign(other); }
  ModuleGradients& operator=(ModuleGradients&& other) noexcept {
    if (this != &other) assign(other);
    return *this;
  }
  ~ModuleGradients() = default;

  // The inputs' gradients; one tensor given for several inputs gets their sum.
  ModuleGradients& query(const MutableTensor& t) & noexcept { return set(kQuery, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, query)
  ModuleGradients& key(const MutableTensor& t) & noexcept { return set(kKey, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, key)
  ModuleGradients& value(const MutableTensor& t) & noexcept { return set(kValue, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, value)
  ModuleGradients& q_proj_weight(const MutableTensor& t) & noexcept { return set(kWq, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, q_proj_weight)
  ModuleGradients& k_proj_weight(const MutableTensor& t) & noexcept { return set(kWk, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, k_proj_weight)
  ModuleGradients& v_proj_weight(const MutableTensor& t) & noexcept { return set(kWv, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, v_proj_weight)
  ModuleGradients& q_proj_bias(const MutableTensor& t) & noexcept { return set(kBq, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, q_proj_bias)
  ModuleGradients& k_proj_bias(const MutableTensor& t) & noexcept { return set(kBk, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, k_proj_bias)
  ModuleGradients& v_proj_bias(const MutableTensor& t) & noexcept { return set(kBv, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, v_proj_bias)
  ModuleGradients& out_proj_weight(const MutableTensor& t) & noexcept { return set(kWo, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, out_proj_weight)
  ModuleGradients& out_proj_bias(const MutableTensor& t) & noexcept { return set(kBo, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, out_proj_bias)
  ModuleGradients& sinks(const MutableTensor& t) & noexcept { return set(kSinks, t); }
  MHA_HPP_RVALUE_SETTER(ModuleGradients, sinks)

  // The C struct; its tensor pointers point into this object.
  const mha_module_gradients* get() const noexcept { return &grads_; }

 private:
  enum Slot { kQuery, kKey, kValue, kWq, kWk, kWv, kBq, kBk, kBv, kWo, kBo, kSinks, kSlots };

  static mha_tensor* mha_module_gradients::*field(int slot) noexcept {
    static constexpr mha_tensor* mha_module_gradients::*fields[kSlots] = {
        &mha_module_gradients::query,         &mha_module_gradients::key,
        &mha_module_gradients::value,         &mha_module_gradients::q_proj_weight,
        &mha_module_gradients::k_proj_weight, &mha_module_gradients::v_proj_weight,
        &mha_module_gradients::q_proj_bias,   &mha_module_gradients::k_proj_bias,
        &mha_module_gradients::v_proj_bias,   &mha_module_gradients::out_proj_weight,
        &mha_module_gradients::out_proj_bias, &mha_module_gradients::sinks};
    return fields[slot];
  }

  ModuleGradients& set(int slot, const MutableTensor& t) noexcept {
    tensors_[slot] = *t.get();
    // A tensor already given for another input is pointed to again: the
    // library sums into one tensor only when it is the same descriptor.
    grads_.*field(slot) = &tensors_[slot];
    return *this;
  }

  void assign(const ModuleGradients& other) noexcept {
    grads_ = other.grads_;
    for (int slot = 0; slot < kSlots; ++slot) {
      tensors_[slot] = other.tensors_[slot];
      grads_.*field(slot) = other.grads_.*field(slot) != nullptr ? &tensors_[slot] : nullptr;
    }
  }

  mha_module_gradients grads_{};
  mha_tensor tensors_[kSlots]{};
};

#undef MHA_HPP_RVALUE_SETTER

// An mha_module owned by this object: destroyed with it; movable, not copyable.
class Module {
 public:
  explicit Module(const ModuleConfig& config) {
    mha_module_config c;
    mha_module_config_init(&c);
    c.embed_dim = config.embed_dim;
    c.num_heads = config.num_heads;
    c.query_dim = config.query_dim;
    c.key_dim = config.key_dim;
    c.value_dim = config.value_dim;
    c.bias = config.bias ? 1 : 0;
    c.dropout = config.dropout;
    check(mha_module_create(&c, &module_));
  }
  Module(int64_t embed_dim, int64_t num_heads)
      : Module(ModuleConfig{embed_dim, num_heads, 0, 0, 0, true, 0.0f}) {}
  ~Module() { mha_module_destroy(module_); }
  Module(Module&& other) noexcept : module_(other.module_) { other.module_ = nullptr; }
  Module& operator=(Module&& other) noexcept {
    if (this != &other) {
      mha_module_destroy(module_);
      module_ = other.module_;
      other.module_ = nullptr;
    }
    return *this;
  }
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Copies a weight named as in PyTorch's state_dict ("in_proj_weight",
  // "out_proj.bias", ...) or d2l's ("W_q.weight", ...).
  void set_weight(const std::string& name, const ConstTensor& value) {
    check(mha_module_set_weight(module_, name.c_str(), value.get()));
  }

  // out [B, Lq, E] = module(query [B, Lq, Eq], key [B, Lk, Ek], value [B, Lk, Ev]).
  void forward(const ConstTensor& query, const ConstTensor& key, const ConstTensor& value,
               MutableTensor out, const ModuleForwardParams& params = ModuleForwardParams()) const {
    check(
        mha_module_forward(module_, query.get(), key.get(), value.get(), out.get(), params.get()));
  }

  // The gradients of forward(query, key, value, out, params) for dout
  // [B, Lq, E] = dL/d(out), into those `grads` names (the forward is
  // recomputed: pass the forward call's params; attention weights it asked
  // for are left out, as the backward returns none).
  void backward(const ConstTensor& query, const ConstTensor& key, const ConstTensor& value,
                const ConstTensor& dout, const ModuleGradients& grads,
                const ModuleForwardParams& params = ModuleForwardParams()) const {
    mha_module_forward_params call = *params.get();  // its tensors still point into params
    call.attn_weights = nullptr;
    check(mha_module_backward(module_, query.get(), key.get(), value.get(), dout.get(), &call,
                              grads.get()));
  }

  // The C handle: a mutable one only through a non-const Module (set_weight
  // must not run while a forward or backward of the module does).
  const mha_module* get() const noexcept { return module_; }
  mha_module* get() noexcept { return module_; }

 private:
  mha_module* module_ = nullptr;
};

// Adds the sinusoidal positional encoding to x [B, L, d] in place.
inline void positional_encoding_add(MutableTensor x) {
  check(mha_positional_encoding_add(x.get()));
}

// ------------------------------------------------ backends, threads, version

// One backend the runtime knows (mha_backend_info).
struct BackendInfo {
  std::string name;      // "scalar", "avx2", "avx512", "neon"
  bool usable = false;   // this CPU can run it and its plugin loaded
  int32_t priority = 0;  // auto picks the usable backend with the highest priority
  std::string reason;    // why it is not usable ("" when usable)
  // The tiles it chose for this machine's caches (0 when not usable).
  int32_t query_tile = 0, key_tile = 0, decode_key_tile = 0;
  // How its decode reads a tile's rows on this CPU (mha_backend_get_decode_streams).
  int32_t decode_streams = 0;
  // Whether it computes bf16 products by bf16 dot products on this CPU
  // (mha_backend_get_bf16_dot), and whether on AMX tiles (its answer 2).
  bool bf16_dot = false;
  bool bf16_amx = false;
};

// Every backend the runtime knows, installed or not.
inline std::vector<BackendInfo> backends() {
  const int32_t n = mha_backend_count();
  std::vector<BackendInfo> result;
  result.reserve(n > 0 ? static_cast<size_t>(n) : 0);
  for (int32_t i = 0; i < n; ++i) {
    mha_backend_info info{};
    mha_backend_tiles tiles{};
    int32_t decode_streams = 0;
    int32_t bf16_dot = 0;
    check(mha_backend_get_info(i, &info));
    check(mha_backend_get_tiles(i, &tiles));
    check(mha_backend_get_decode_streams(i, &decode_streams));
    check(mha_backend_get_bf16_dot(i, &bf16_dot));
    result.push_back(BackendInfo{info.name != nullptr ? info.name : "", info.usable != 0,
                                 info.priority, info.reason != nullptr ? info.reason : "",
                                 tiles.query_tile, tiles.key_tile, tiles.decode_key_tile,
                                 decode_streams, bf16_dot != 0, bf16_dot == 2});
  }
  return result;
}

// The backend calls will use; throws when the requested one is not usable.
inline std::string selected_backend() {
  const char* name = mha_selected_backend();
  if (name == nullptr) {
    throw Error(
        MHA_ERR_BACKEND_UNAVAILABLE,
        std::string(mha_status_name(MHA_ERR_BACKEND_UNAVAILABLE)) + ": " + mha_last_error());
  }
  return name;
}

// By name ("auto" = best usable), overriding MHA_BACKEND; throws (and keeps
// the choice) when the name is unknown or not usable here.
inline void select_backend(const std::string& name) {
  check(mha_select_backend(name.c_str()));
}

// Threads inside one call; 0 returns to the environment (MHA_NUM_THREADS,
// OMP_NUM_THREADS, all cores).
inline void set_num_threads(int32_t n) {
  check(mha_set_num_threads(n));
}
inline int32_t num_threads() {
  return mha_get_num_threads();
}

// The library's version ("0.1.0"), which may differ from the header's
// (MHA_VERSION_MAJOR, _MINOR, _PATCH) when another libmha is loaded.
inline std::string version() {
  return mha_version();
}

// The CPU features the runtime detected, space-separated ("avx2 fma avx512f ...").
inline std::string cpu_features() {
  return mha_cpu_features();
}

// The data caches the runtime sizes tiles from (bytes, 0 when unknown).
inline mha_cache_info cpu_caches() {
  mha_cache_info caches{};
  check(mha_cpu_caches(&caches));
  return caches;
}

}  // namespace mha
