// libFuzzer target over the .npy reader of the tools (tools/npy.h), which
// reads every array a user hands mha-run: any bytes as a file.
//
// parse_npy must return an array or throw NpyError -- never another
// exception, a crash, a read past the bytes (ASan), undefined behaviour
// (UBSan) or an allocation the file cannot back (libFuzzer's malloc limit).
// An array it returns must be what the file says: nbytes = size x itemsize,
// the data the file's last nbytes, the strides those of a C- or Fortran-order
// layout of the shape, every element readable; and it must survive a round
// trip: encode_npy, then parse_npy again, gives the same dtype, shape, order
// and data.  The same bytes as a file (a memfd) through read_npy, whose
// reader takes the preamble, the header and the data in separate reads, must
// give the same outcome: refused by both, or the same array.  Anything else
// aborts with a description.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "npy.h"

namespace {

[[noreturn]] void finding(const std::string& what, const mha_tools::NpyArray& array) {
  std::fprintf(stderr, "==== npy_fuzzer finding: %s\n     array: %s\n", what.c_str(),
               array.describe().c_str());
  std::abort();
}

// The element strides of a C-order (or Fortran-order) array of this shape.
std::vector<int64_t> layout_strides(const std::vector<int64_t>& shape, bool fortran_order) {
  const size_t rank = shape.size();
  std::vector<int64_t> strides(rank, 1);
  for (size_t n = 1; n < rank; ++n) {
    if (fortran_order) {
      strides[n] = strides[n - 1] * shape[n - 1];
    } else {
      strides[rank - 1 - n] = strides[rank - n] * shape[rank - n];
    }
  }
  return strides;
}

// The same dtype, shape, order and data bytes.
bool same_array(const mha_tools::NpyArray& a, const mha_tools::NpyArray& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         a.fortran_order() == b.fortran_order() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

void check_array(const mha_tools::NpyArray& a, const uint8_t* file, size_t file_size) {
  using mha_tools::npy_itemsize;
  if (a.rank() > mha_tools::kNpyMaxRank) finding("a rank past kNpyMaxRank", a);
  int64_t size = 1;
  for (const int64_t extent : a.shape()) {
    if (extent < 0) finding("a negative dimension", a);
    size *= extent;  // cannot overflow: the data is in the file
  }
  if (size != a.size()) finding("size() is not the product of the shape", a);
  if (a.nbytes() != static_cast<size_t>(size) * npy_itemsize(a.dtype())) {
    finding("nbytes() is not size() x itemsize", a);
  }
  if (a.nbytes() > file_size) finding("more data than the file holds", a);
  if (a.nbytes() != 0 && std::memcmp(a.data(), file + file_size - a.nbytes(), a.nbytes()) != 0) {
    finding("the data is not the file's last nbytes() bytes", a);
  }
  if (a.strides() != layout_strides(a.shape(), a.fortran_order())) {
    finding("strides that are not the file's layout", a);
  }
  double sum = 0.0;  // reads every element (ASan sees a read past the data)
  for (int64_t at = 0; at < size; ++at) sum += a.value_as_double(at);
  static_cast<void>(sum);

  const std::vector<unsigned char> again = mha_tools::encode_npy(a);
  mha_tools::NpyArray b;
  try {
    b = mha_tools::parse_npy(again.data(), again.size());
  } catch (const mha_tools::NpyError& e) {
    finding(std::string("its own encoding is refused: ") + e.what(), a);
  }
  if (!same_array(a, b)) finding("the round trip changed the array", a);
}

// read_npy on the bytes as a file: the array, or false when it refuses them.
bool read_as_file(const uint8_t* data, size_t size, mha_tools::NpyArray* array) {
  const int fd = memfd_create("npy_fuzzer", MFD_CLOEXEC);
  if (fd < 0 || (size > 0 && write(fd, data, size) != static_cast<ssize_t>(size))) {
    std::fprintf(stderr, "npy_fuzzer: cannot make a memfd\n");
    std::abort();
  }
  bool read = true;
  try {
    *array = mha_tools::read_npy("/proc/self/fd/" + std::to_string(fd));
  } catch (const mha_tools::NpyError&) {
    read = false;
  }
  close(fd);
  return read;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mha_tools::NpyArray array, from_file;
  bool parsed = true;
  try {
    array = mha_tools::parse_npy(data, size);
  } catch (const mha_tools::NpyError&) {
    parsed = false;  // refused, as a malformed file must be
  }
  const bool read = read_as_file(data, size, &from_file);
  if (parsed != read) {
    finding(
        parsed ? "read_npy refuses what parse_npy reads" : "read_npy reads what parse_npy refuses",
        parsed ? array : from_file);
  }
  if (!parsed) return 0;
  check_array(array, data, size);
  if (!same_array(array, from_file)) finding("read_npy and parse_npy disagree", array);
  return 0;
}
