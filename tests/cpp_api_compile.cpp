// Compile-time checks of mha.hpp, compiled (never run) by ctest: see
// tests/CMakeLists.txt, tests cpp.compile.* and cpp.must_not_compile.*.
//
// Every case below writes one line through PICK(good, bad).  Built without
// MHA_MUST_NOT_COMPILE, every case takes its good form and the file must
// compile, warnings as errors: the positive control.  Built with
// -DMHA_MUST_NOT_COMPILE=<n> (and warnings allowed), only case n is compiled,
// in its bad form, and the compiler must refuse it.  As the two forms differ
// only in PICK's argument, a refusal can only come from that: a typo would
// fail the positive control too.
#include <mha/mha.hpp>

#include <type_traits>
#include <vector>

#ifdef MHA_MUST_NOT_COMPILE
#define MHA_CASE(n) (MHA_MUST_NOT_COMPILE == (n))
#define PICK(good, bad) bad
#else
#define MHA_CASE(n) 1
#define PICK(good, bad) good
#endif

namespace mha_compile_test {

// Memory seen through a mutable and through a const pointer.
struct Memory {
  float data[8] = {};
  float* p = data;
  const float* cp = data;
};

// 1: attention() writing to a tensor built over const float*.
#if MHA_CASE(1)
void output_over_const_memory() {
  Memory m;
  mha::Tensor q(m.cp, {1, 1, 1, 4});
  mha::Tensor out(PICK(m.p, m.cp), {1, 1, 1, 4});
  mha::attention(q, q, q, out);
}
#endif

// 2: a type-erased read-only tensor (an explicit dtype over const memory) as the output.
#if MHA_CASE(2)
void erased_output_over_const_memory() {
  Memory m;
  mha::Tensor q(m.cp, {1, 1, 1, 4});
  mha::Tensor out(PICK(m.p, m.cp), MHA_DTYPE_F32, {1, 1, 1, 4});
  mha::attention(q, q, q, out);
}
#endif

// 3: an input view (ConstTensor) passed back as an output.
#if MHA_CASE(3)
void const_view_as_output() {
  Memory m;
  mha::Tensor out(m.p, {1, 1, 1, 4});
  mha::ConstTensor in = out;
  mha::MutableTensor writable = out;
  mha::attention(in, in, in, PICK(writable, in));
}
#endif

// 4: the LSE output of AttentionParams over const memory.
#if MHA_CASE(4)
void lse_over_const_memory() {
  Memory m;
  mha::AttentionParams params;
  params.lse(mha::Tensor(PICK(m.p, m.cp), {1, 1, 4}));
}
#endif

// 5: Module::forward writing to const memory.
#if MHA_CASE(5)
void module_output_over_const_memory(const mha::Module& module) {
  Memory m;
  mha::Tensor x(m.cp, {1, 2, 4});
  module.forward(x, x, x, mha::Tensor(PICK(m.p, m.cp), {1, 2, 4}));
}
#endif

// 6: ModuleForwardParams::attn_weights over const memory.
#if MHA_CASE(6)
void weights_over_const_memory() {
  Memory m;
  mha::ModuleForwardParams params;
  params.attn_weights(mha::Tensor(PICK(m.p, m.cp), {1, 1, 2, 2}));
}
#endif

// 7: positional_encoding_add in place on const memory.
#if MHA_CASE(7)
void positional_encoding_on_const_memory() {
  Memory m;
  mha::positional_encoding_add(mha::Tensor(PICK(m.p, m.cp), {1, 2, 2}));
}
#endif

// 8: merge_partials writing its output to const memory.
#if MHA_CASE(8)
void merge_output_over_const_memory() {
  Memory m;
  mha::Tensor part(m.cp, {1, 1, 1, 4});
  mha::Tensor part_lse(m.cp, {1, 1, 1});
  mha::merge_partials({part}, {part_lse}, mha::Tensor(PICK(m.p, m.cp), {1, 1, 1, 4}));
}
#endif

// 9: merge_partials writing its LSE to const memory (ranges of tensors).
#if MHA_CASE(9)
void merge_lse_over_const_memory() {
  Memory m;
  std::vector<mha::Tensor<const float>> parts{mha::Tensor(m.cp, {1, 1, 1, 4})};
  std::vector<mha::Tensor<const float>> lses{mha::Tensor(m.cp, {1, 1, 1})};
  mha::merge_partials(parts, lses, mha::Tensor(m.p, {1, 1, 1, 4}),
                      mha::Tensor(PICK(m.p, m.cp), {1, 1, 1}));
}
#endif

// 10: a mutable C descriptor from a read-only tensor.
#if MHA_CASE(10)
void mutable_descriptor_of_const_tensor() {
  Memory m;
  mha::Tensor t(PICK(m.p, m.cp), {4});
  mha_tensor* desc = t.get();
  (void)desc;
}
#endif

// 11: a writable typed tensor named explicitly over const memory.
#if MHA_CASE(11)
void explicit_writable_type_over_const_memory() {
  Memory m;
  mha::Tensor<float> t(PICK(m.p, m.cp), {4});
  (void)t;
}
#endif

// 12: a read-only tensor converted to a writable one.
#if MHA_CASE(12)
void const_to_mutable_conversion() {
  Memory m;
  mha::Tensor t(PICK(m.p, m.cp), {4});
  mha::MutableTensor writable = t;
  (void)writable;
}
#endif

// 13: attention_varlen writing to a tensor built over const float*.
#if MHA_CASE(13)
void varlen_output_over_const_memory() {
  Memory m;
  const int32_t offsets[2] = {0, 1};
  mha::Tensor q(m.cp, {1, 1, 4});
  mha::Tensor cu(offsets, {2});
  mha::attention_varlen(q, q, q, mha::Tensor(PICK(m.p, m.cp), {1, 1, 4}), cu, cu);
}
#endif

// 14: attention_varlen over a paged cache writing to const memory.
#if MHA_CASE(14)
void paged_output_over_const_memory() {
  Memory m;
  const int32_t offsets[2] = {0, 1};
  const int32_t used[1] = {1};
  const int32_t table[1] = {0};
  mha::Tensor q(m.cp, {1, 1, 4});
  mha::Tensor cache(m.cp, {1, 8, 1, 1});
  mha::attention_varlen(q, cache, cache, mha::Tensor(PICK(m.p, m.cp), {1, 1, 4}),
                        mha::VarlenParams()
                            .cu_seqlens_q(mha::Tensor(offsets, {2}))
                            .seqused_k(mha::Tensor(used, {1}))
                            .block_table(mha::Tensor(table, {1, 1})));
}
#endif

// 15: kv_cache_write into a key cache over const memory.
#if MHA_CASE(15)
void cache_write_into_const_memory() {
  Memory m;
  const int64_t slots[1] = {0};
  mha::Tensor row(m.cp, {1, 1, 1});
  mha::kv_cache_write(row, row, mha::Tensor(PICK(m.p, m.cp), {1, 8, 1, 1}),
                      mha::Tensor(m.p, {1, 8, 1, 1}), mha::Tensor(slots, {1}));
}
#endif

// 16: kv_cache_write into a scale cache over const memory.
#if MHA_CASE(16)
void cache_write_scales_into_const_memory() {
  Memory m;
  const int64_t slots[1] = {0};
  signed char bytes[16] = {};
  mha::Tensor row(m.cp, {1, 1, 1});
  mha::kv_cache_write(row, row, mha::Tensor(bytes, MHA_DTYPE_I8, {1, 8, 1, 1}),
                      mha::Tensor(bytes + 8, MHA_DTYPE_I8, {1, 8, 1, 1}), mha::Tensor(slots, {1}),
                      mha::Tensor(m.p, {1, 8, 1}), mha::Tensor(PICK(m.p, m.cp), {1, 8, 1}));
}
#endif

// 17: a mutable C descriptor from a read-only tensor, its guard overridden.
#if MHA_CASE(17)
void mutable_descriptor_through_explicit_argument() {
  Memory m;
  mha::Tensor t(PICK(m.p, m.cp), {4});
  mha_tensor* desc = t.get<float>();  // Tensor<const float>: U is not T
  (void)desc;
}
#endif

// 18: a mutable module handle through a const Module.
#if MHA_CASE(18)
void mutable_handle_of_const_module(PICK(mha::Module&, const mha::Module&) module) {
  mha_module* handle = module.get();
  (void)handle;
}
#endif

// 19: quantize_kv writing its int8 rows into const memory.
#if MHA_CASE(19)
void quantize_into_const_memory() {
  Memory m;
  int8_t rows[4] = {};
  const int8_t* const_rows = rows;
  int8_t* mutable_rows = rows;
  mha::quantize_kv(mha::Tensor(m.cp, {1, 1, 1, 4}),
                   mha::Tensor(PICK(mutable_rows, const_rows), {1, 1, 1, 4}),
                   mha::Tensor(m.p, {1, 1, 1}));
  (void)const_rows;
  (void)mutable_rows;
}
#endif

#ifndef MHA_MUST_NOT_COMPILE
// What the cases above rely on, stated once more as traits.
static_assert(
    std::is_same_v<decltype(mha::Tensor(static_cast<float*>(nullptr), {1})), mha::Tensor<float>>);
static_assert(std::is_same_v<decltype(mha::Tensor(static_cast<const float*>(nullptr), {1})),
                             mha::Tensor<const float>>);
static_assert(std::is_convertible_v<mha::Tensor<float>, mha::MutableTensor>);
static_assert(std::is_convertible_v<mha::Tensor<float>, mha::ConstTensor>);
static_assert(std::is_convertible_v<mha::Tensor<const float>, mha::ConstTensor>);
static_assert(std::is_convertible_v<mha::MutableTensor, mha::ConstTensor>);
static_assert(!std::is_convertible_v<mha::Tensor<const float>, mha::MutableTensor>);
static_assert(!std::is_convertible_v<mha::ConstTensor, mha::MutableTensor>);
static_assert(!std::is_convertible_v<mha::ConstTensor, mha::Tensor<const float>>);
static_assert(!std::is_convertible_v<mha::Tensor<int32_t>, mha::Tensor<const float>>);
// Shapes from brace lists of sizes held as size_t, alone or beside int literals and
// other types: no narrowing error (an initializer_list<int64_t> refused them).
enum { kCompileTestHeads = 4 };
inline void shapes_of_size_t(float* p, std::size_t n, std::size_t d, unsigned h, long l) {
  const mha::Tensor a(p, {n, 1, 1, d});
  const mha::Tensor f(p, {n, kCompileTestHeads, l, d});  // an enumerator among them
  const mha::Tensor g(p, {kCompileTestHeads, kCompileTestHeads});
  static_cast<void>(f), static_cast<void>(g);
  const mha::Tensor b(p, {n, n});
  const mha::Tensor c(p, {n, h, l, 4}, {d, d, d, 1});
  const mha::Tensor e(p, {2, 2});
  static_cast<void>(a), static_cast<void>(b), static_cast<void>(c), static_cast<void>(e);
}
// mha.h's limits in a C++ program built with -Wold-style-cast (a C cast in a macro
// the caller expands is the caller's warning).
static_assert(MHA_MAX_EXTENT == (int64_t{1} << 40) && MHA_MAX_HEAD_DIM == 65536);
#endif

}  // namespace mha_compile_test
