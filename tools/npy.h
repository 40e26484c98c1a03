// A small, strict reader and writer of NumPy .npy files (format versions 1.0,
// 2.0 and 3.0).
//
// Supported dtypes: <f4, <f8, <f2 (IEEE binary16: NumPy's float16), |b1, <i4,
// <i8 and |u1 (a byte, used as a bool).
// Arrays of any rank up to kNpyMaxRank are read, in C or Fortran order: the
// data is kept as it is in the file and the order is expressed as strides, so
// callers index elements through strides() (or offset()) and never transpose.
//
// Every malformed file -- bad magic, truncated preamble or header, a header
// dict that is not exactly {'descr', 'fortran_order', 'shape'}, an unknown or
// big-endian dtype, a data size that differs from shape x itemsize, sizes that
// overflow 64 bits -- throws NpyError with a one-line message.  Nothing is
// allocated before the data size has been checked against the file size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mha_tools {

enum class NpyDtype { F32, F64, Bool, U8, I32, I64, F16 };

// The descr string written to and accepted from files: "<f4", "|b1", ...
const char* npy_descr(NpyDtype dtype);
// A readable name: "float32", "bool", ...
const char* npy_dtype_name(NpyDtype dtype);
std::size_t npy_itemsize(NpyDtype dtype);

// Every error of this library: the message is one line, without a newline.
class NpyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr int kNpyMaxRank = 32;

class NpyArray {
 public:
  NpyArray() = default;
  // A zero-filled array.  fortran_order = true lays the data out column-major
  // (the first index varies fastest).  Throws NpyError when the rank exceeds
  // kNpyMaxRank, a dimension is negative, or the size overflows 64 bits.
  NpyArray(NpyDtype dtype, std::vector<int64_t> shape, bool fortran_order = false);

  NpyDtype dtype() const { return dtype_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  // Element strides (not bytes), derived from the shape and the order.
  const std::vector<int64_t>& strides() const { return strides_; }
  bool fortran_order() const { return fortran_order_; }
  int64_t size() const { return size_; }  // number of elements
  std::size_t nbytes() const { return nbytes_; }

  // The data, aligned to 8 bytes; never null, even for an empty array.
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  // Typed views; throw NpyError when T does not match the dtype.
  template <typename T>
  T* data_as();
  template <typename T>
  const T* data_as() const;

  // Element offset of an index (sum of index[d] * strides[d]).  The checked
  // form throws NpyError when the index has the wrong rank or is out of range.
  int64_t offset(const std::vector<int64_t>& index) const;
  int64_t offset_unchecked(const int64_t* index) const;

  // The element at an element offset, converted (bool and u1 give 0 or 1 as
  // stored; any non-zero byte reads as its value; float16 exactly).
  double value_as_double(int64_t element_offset) const;
  int64_t value_as_int64(int64_t element_offset) const;  // floats are truncated
  // Stores a value; float32 and float16 round to nearest, ties to even (a
  // finite value beyond float16's 65504 becomes an infinity).
  void set_from_double(int64_t element_offset, double value);

  // "(2, 5, 4, 20)" as NumPy prints it.
  std::string shape_string() const;
  // "float32 (2, 5, 4, 20)"
  std::string describe() const;

 private:
  NpyDtype dtype_ = NpyDtype::F32;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  bool fortran_order_ = false;
  int64_t size_ = 1;
  std::size_t nbytes_ = 0;
  std::vector<uint64_t> storage_;
};

// Parses a whole .npy file held in memory.
NpyArray parse_npy(const void* bytes, std::size_t size);
// Reads a file; messages start with the path.
NpyArray read_npy(const std::string& path);

// The bytes of a .npy file: version 1.0, or 2.0 when the header does not fit
// in 65535 bytes; the header is padded to 64 bytes as NumPy does.  The data is
// written as stored, with the array's own fortran_order flag (C order unless
// the array was made or read in Fortran order).
std::vector<unsigned char> encode_npy(const NpyArray& array);
// The magic string, version, header length and padded header: the bytes that
// precede array.data() in the file.
std::vector<unsigned char> encode_npy_header(const NpyArray& array);
void write_npy(const std::string& path, const NpyArray& array);
// Writes the file's bytes to an open descriptor (header, then the data without
// a copy); throws NpyError("write error: ...") without a path.
void write_npy_fd(int fd, const NpyArray& array);

// ---------------------------------------------------------------- templates

namespace detail {
template <typename T>
struct NpyDtypeOf;
template <>
struct NpyDtypeOf<float> {
  static constexpr NpyDtype value = NpyDtype::F32;
};
template <>
struct NpyDtypeOf<double> {
  static constexpr NpyDtype value = NpyDtype::F64;
};
template <>
struct NpyDtypeOf<int32_t> {
  static constexpr NpyDtype value = NpyDtype::I32;
};
template <>
struct NpyDtypeOf<int64_t> {
  static constexpr NpyDtype value = NpyDtype::I64;
};
template <>
struct NpyDtypeOf<uint16_t> {  // <f2, as its bits
  static constexpr NpyDtype value = NpyDtype::F16;
};
template <>
struct NpyDtypeOf<uint8_t> {  // |b1 and |u1
  static constexpr NpyDtype value = NpyDtype::U8;
};
[[noreturn]] void throw_dtype_mismatch(NpyDtype have, NpyDtype want);
}  // namespace detail

template <typename T>
T* NpyArray::data_as() {
  constexpr NpyDtype want = detail::NpyDtypeOf<T>::value;
  const bool ok = dtype_ == want || (want == NpyDtype::U8 && dtype_ == NpyDtype::Bool);
  if (!ok) detail::throw_dtype_mismatch(dtype_, want);
  return static_cast<T*>(data());
}

template <typename T>
const T* NpyArray::data_as() const {
  return const_cast<NpyArray*>(this)->data_as<T>();
}

}  // namespace mha_tools
