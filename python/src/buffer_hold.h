// NumPy arrays (and any other exporter of Python's buffer protocol) read with
// one PyObject_GetBuffer call.  nanobind's generic import takes them through
// DLPack instead: a capsule made and consumed per array, and for a writable
// array on NumPy before 2.1 a failed __dlpack__(max_version=...) call first;
// at the d2l example's size (a few microseconds in C) that was most of the
// binding's cost (python/bench/overhead.py).
#pragma once

#include <Python.h>
#include <mha/mha.h>

namespace mha_python {

class BufferHold {
 public:
  BufferHold() = default;
  BufferHold(BufferHold&& other) noexcept;
  BufferHold(const BufferHold&) = delete;
  BufferHold& operator=(const BufferHold&) = delete;
  BufferHold& operator=(BufferHold&&) = delete;
  ~BufferHold();

  // Holds the buffer of `object` when it exports one mha can describe as it
  // is: a dtype the library has, in native byte order, strides in whole
  // elements (and writable when asked).  Otherwise false, nothing held and no
  // Python error set: the caller then tries the other ways, which word the
  // error if there is one.
  bool acquire(PyObject* object, bool writable);

  const Py_buffer& view() const { return view_; }
  mha_dtype dtype() const { return dtype_; }
  // Why the last acquire() refused a buffer it was given: "" when it did not,
  // or for a dtype mha does not have (the other ways name that dtype).
  const char* refusal() const { return refusal_; }

 private:
  void release();

  Py_buffer view_{};
  bool held_ = false;
  mha_dtype dtype_ = MHA_DTYPE_INVALID;
  const char* refusal_ = "";
};

}  // namespace mha_python
