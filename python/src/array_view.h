// An array from Python -- NumPy, PyTorch or any DLPack producer on the CPU --
// described to the library as an mha_tensor over the same memory: the
// caller's data pointer, dtype and strides, never a copy.
#pragma once

#include <mha/mha.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>

#include "buffer_hold.h"

namespace mha_python {

// Which ranks an argument may have, and how many dimensions the library is
// given: missing leading dimensions are added with size 1, as NumPy aligns
// shapes from the right when it broadcasts.
struct RankRule {
  int32_t min_rank;
  int32_t max_rank;
  int32_t library_rank;  // at least this many dimensions are passed on
};

enum class Access { read_only, writable };

class ArrayView {
 public:
  // Throws TypeError when `object` is not an array on the CPU (or a writable
  // one for Access::writable), or has a dtype mha has no name for;
  // ValueError when its rank is outside the rule's range.  `name` is the
  // Python argument's name, for the messages.
  ArrayView(nanobind::handle object, const char* name, Access access, RankRule rule);

  const mha_tensor& tensor() const { return tensor_; }
  mha_tensor& tensor() { return tensor_; }

 private:
  // Describes `object` through the buffer protocol when it exports one mha
  // can read as it is (NumPy arrays); false otherwise.
  bool read_buffer(nanobind::handle object, const char* name, Access access, RankRule rule);

  // Holds the buffer or the DLPack export (and with it the memory) for as
  // long as the view.
  BufferHold buffer_;
  nanobind::ndarray<nanobind::ro, nanobind::device::cpu> read_only_;
  nanobind::ndarray<nanobind::device::cpu> writable_;
  mha_tensor tensor_{};
};

// The view of an optional argument: none for Python's None.
std::optional<ArrayView> optional_view(nanobind::handle object, const char* name, Access access,
                                       RankRule rule);

}  // namespace mha_python
