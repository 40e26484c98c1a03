#include "buffer_hold.h"

#include <cstring>

namespace mha_python {
namespace {

// The library's dtype of a buffer's struct-module format ("f", "<f", "=e",
// "?", "b", "i", "l", "q"), MHA_DTYPE_INVALID for any other (uint8, float64,
// a non-native byte order, a structured type).
mha_dtype buffer_dtype(const char* format, Py_ssize_t itemsize) {
  if (format == nullptr) return MHA_DTYPE_INVALID;
  if (*format == '@' || *format == '=' || *format == '<') ++format;
  if (format[0] == '\0' || format[1] != '\0') return MHA_DTYPE_INVALID;
  switch (format[0]) {
    case 'f':
      return itemsize == 4 ? MHA_DTYPE_F32 : MHA_DTYPE_INVALID;
    case 'e':
      return itemsize == 2 ? MHA_DTYPE_F16 : MHA_DTYPE_INVALID;
    case '?':
      return itemsize == 1 ? MHA_DTYPE_BOOL : MHA_DTYPE_INVALID;
    case 'b':
      return itemsize == 1 ? MHA_DTYPE_I8 : MHA_DTYPE_INVALID;
    case 'i':
    case 'l':
    case 'q':
      if (itemsize == 4) return MHA_DTYPE_I32;
      if (itemsize == 8) return MHA_DTYPE_I64;
      return MHA_DTYPE_INVALID;
    default:
      return MHA_DTYPE_INVALID;
  }
}

}  // namespace

BufferHold::BufferHold(BufferHold&& other) noexcept
    : view_(other.view_), held_(other.held_), dtype_(other.dtype_) {
  other.held_ = false;
}

BufferHold::~BufferHold() {
  release();
}

void BufferHold::release() {
  if (held_) PyBuffer_Release(&view_);
  held_ = false;
}

bool BufferHold::acquire(PyObject* object, bool writable) {
  // "<" is the native order only on a little-endian machine.
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "buffer_dtype reads '<' as native");
  refusal_ = "";
  if (!PyObject_CheckBuffer(object)) return false;
  const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(object, &view_, flags) != 0) {
    PyErr_Clear();  // e.g. a read-only array asked for writing: the caller words it
    return false;
  }
  held_ = true;
  dtype_ = buffer_dtype(view_.format, view_.itemsize);
  bool whole_elements = view_.itemsize > 0;
  for (int d = 0; whole_elements && d < view_.ndim; ++d) {
    whole_elements = view_.strides[d] % view_.itemsize == 0;
  }
  if (view_.format != nullptr && (view_.format[0] == '>' || view_.format[0] == '!')) {
    refusal_ = "its bytes are not in the machine's order (byteswap it, e.g. x.astype('=f4'))";
  } else if (dtype_ != MHA_DTYPE_INVALID && !whole_elements) {
    refusal_ = "its strides are not whole elements (a field of a structured array?)";
  }
  if (dtype_ == MHA_DTYPE_INVALID || !whole_elements) {
    release();
    return false;
  }
  return true;
}

}  // namespace mha_python
