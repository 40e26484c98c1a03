#include "npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "half.h"
#include "tool_util.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mha_tools::npy assumes a little-endian host"
#endif

namespace mha_tools {
namespace {

constexpr unsigned char kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr std::size_t kMagicLen = 8;  // the magic string and two version bytes
// Far above any real header (rank 32 with 20-digit sizes fits in 1 KiB), far
// below anything that could hurt to read.
constexpr std::size_t kMaxHeaderLen = std::size_t{1} << 20;
constexpr std::size_t kAlign = 64;  // NumPy's ARRAY_ALIGN

struct DtypeInfo {
  NpyDtype dtype;
  const char* descr;
  const char* name;
  std::size_t itemsize;
};
constexpr DtypeInfo kDtypes[] = {
    {NpyDtype::F32, "<f4", "float32", 4}, {NpyDtype::F64, "<f8", "float64", 8},
    {NpyDtype::Bool, "|b1", "bool", 1},   {NpyDtype::U8, "|u1", "uint8", 1},
    {NpyDtype::I32, "<i4", "int32", 4},   {NpyDtype::I64, "<i8", "int64", 8},
    {NpyDtype::F16, "<f2", "float16", 2},
};

const DtypeInfo& info_of(NpyDtype dtype) {
  for (const auto& info : kDtypes) {
    if (info.dtype == dtype) return info;
  }
  return kDtypes[0];  // unreachable: every enumerator is listed
}

// Text from a file, made safe to put in a one-line message: printable ASCII,
// at most `limit` characters.
std::string printable(const std::string& text, std::size_t limit = 40) {
  std::string out;
  for (const char c : text) {
    if (out.size() >= limit) {
      out += "...";
      break;
    }
    const auto u = static_cast<unsigned char>(c);
    out += (u >= 0x20 && u < 0x7f) ? c : '?';
  }
  return out;
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

// Element count and byte count of a shape, or an error when they overflow.
struct Sizes {
  int64_t elements;
  std::size_t bytes;
};
// The product of the non-zero dimensions must fit in 63 bits even when a zero
// dimension makes the array empty, as NumPy requires: the strides are
// products of the dimensions ((0, 2^62, 4) would overflow them).
Sizes sizes_of(const std::vector<int64_t>& shape, std::size_t itemsize, const char* descr) {
  uint64_t nonzero = 1;
  bool empty = false;
  for (const int64_t d : shape) {
    if (d < 0) throw NpyError("negative dimension in shape " + shape_to_string(shape));
    if (d == 0) {
      empty = true;
      continue;
    }
    if (__builtin_mul_overflow(nonzero, static_cast<uint64_t>(d), &nonzero) ||
        nonzero > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw NpyError("shape " + shape_to_string(shape) +
                     " has dimensions whose product does not fit in 63 bits");
    }
  }
  const uint64_t elements = empty ? 0 : nonzero;
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(elements, static_cast<uint64_t>(itemsize), &bytes) ||
      bytes > std::numeric_limits<std::size_t>::max() ||
      bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    throw NpyError("shape " + shape_to_string(shape) + " of " + descr +
                   " needs more bytes than fit in 63 bits");
  }
  return {static_cast<int64_t>(elements), static_cast<std::size_t>(bytes)};
}

// ------------------------------------------------------------ the preamble

struct Preamble {
  int major = 0;
  std::size_t header_offset = 0;  // where the header text starts
  std::size_t header_len = 0;
};

// `head` holds the first min(total, 12) bytes of a file of `total` bytes.
Preamble parse_preamble(const unsigned char* head, std::size_t head_len, std::size_t total) {
  if (total == 0) throw NpyError("empty file");
  if (head_len < sizeof kMagic || std::memcmp(head, kMagic, sizeof kMagic) != 0) {
    if (total < sizeof kMagic && std::memcmp(head, kMagic, head_len) == 0) {
      throw NpyError("truncated: " + std::to_string(total) +
                     " bytes, shorter than the magic string");
    }
    throw NpyError("not a .npy file (bad magic string)");
  }
  if (head_len < kMagicLen) throw NpyError("truncated: the file ends inside the preamble");
  Preamble p;
  p.major = head[6];
  const int minor = head[7];
  if (p.major < 1 || p.major > 3 || minor != 0) {
    throw NpyError("unsupported .npy format version " + std::to_string(p.major) + "." +
                   std::to_string(minor) + " (supported: 1.0, 2.0, 3.0)");
  }
  const std::size_t len_bytes = p.major == 1 ? 2 : 4;
  if (head_len < kMagicLen + len_bytes) {
    throw NpyError("truncated: the file ends inside the preamble");
  }
  uint64_t len = 0;
  for (std::size_t i = 0; i < len_bytes; ++i) len |= uint64_t{head[kMagicLen + i]} << (8 * i);
  p.header_offset = kMagicLen + len_bytes;
  if (len > kMaxHeaderLen) {
    throw NpyError("the header length " + std::to_string(len) + " exceeds the limit of " +
                   std::to_string(kMaxHeaderLen) + " bytes");
  }
  if (len > total - p.header_offset) {
    throw NpyError("truncated: the header announces " + std::to_string(len) + " bytes, only " +
                   std::to_string(total - p.header_offset) + " follow the preamble");
  }
  if (len == 0) throw NpyError("bad header: it is empty");
  p.header_len = static_cast<std::size_t>(len);
  return p;
}

// ------------------------------------------------------------ the header dict

struct Header {
  NpyDtype dtype = NpyDtype::F32;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// A strict parser of the Python literal NumPy writes:
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// followed by spaces and one '\n'.  Keys in any order, single or double
// quotes, optional trailing commas; nothing else.
class HeaderParser {
 public:
  explicit HeaderParser(const std::string& text) : text_(text) {}

  Header parse() {
    if (text_.back() != '\n') fail("it does not end with a newline");
    for (std::size_t i = 0; i + 1 < text_.size(); ++i) {
      const auto u = static_cast<unsigned char>(text_[i]);
      if (u < 0x20 || u >= 0x7f) {
        if (u != '\t') fail("character " + std::to_string(u) + " at offset " + std::to_string(i));
      }
    }
    Header header;
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{', "it does not start with '{'");
    for (;;) {
      skip_spaces();
      if (peek() == '}') break;
      const std::string key = parse_string("a key");
      skip_spaces();
      expect(':', "':' missing after '" + printable(key) + "'");
      skip_spaces();
      if (key == "descr") {
        if (have_descr) fail("'descr' appears twice");
        have_descr = true;
        header.dtype = parse_descr();
      } else if (key == "fortran_order") {
        if (have_order) fail("'fortran_order' appears twice");
        have_order = true;
        header.fortran_order = parse_bool();
      } else if (key == "shape") {
        if (have_shape) fail("'shape' appears twice");
        have_shape = true;
        header.shape = parse_shape();
      } else {
        fail("unexpected key '" + printable(key) + "'");
      }
      skip_spaces();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != '}') fail("',' or '}' expected at offset " + std::to_string(pos_));
    }
    ++pos_;  // '}'
    while (pos_ + 1 < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t')) ++pos_;
    if (pos_ + 1 != text_.size()) fail("text after the closing '}'");
    if (!have_descr) fail("the key 'descr' is missing");
    if (!have_order) fail("the key 'fortran_order' is missing");
    if (!have_shape) fail("the key 'shape' is missing");
    return header;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { throw NpyError("bad header: " + why); }

  // The last character is the final '\n', which no token may use.
  char peek() const { return pos_ + 1 < text_.size() ? text_[pos_] : '\0'; }

  void skip_spaces() {
    while (peek() == ' ' || peek() == '\t') ++pos_;
  }

  void expect(char c, const std::string& why) {
    if (peek() != c) fail(why);
    ++pos_;
  }

  std::string parse_string(const char* what) {
    const char quote = peek();
    if (quote != '\'' && quote != '"') {
      fail(std::string(what) + " must be a quoted string (offset " + std::to_string(pos_) + ")");
    }
    ++pos_;
    std::string s;
    for (;;) {
      const char c = peek();
      if (c == '\0') fail("unterminated string");
      ++pos_;
      if (c == quote) break;
      if (c == '\\') fail("escape sequences in strings are not supported");
      s += c;
    }
    return s;
  }

  bool parse_word(const char* word) {
    const std::size_t n = std::strlen(word);
    if (text_.compare(pos_, n, word) != 0 || pos_ + n >= text_.size()) return false;
    const char next = text_[pos_ + n];
    if (std::isalnum(static_cast<unsigned char>(next)) || next == '_') return false;
    pos_ += n;
    return true;
  }

  bool parse_bool() {
    if (parse_word("True")) return true;
    if (parse_word("False")) return false;
    fail("'fortran_order' must be True or False");
  }

  NpyDtype parse_descr() {
    if (peek() == '[') fail("structured dtypes are not supported");
    const std::string descr = parse_string("'descr'");
    for (const auto& info : kDtypes) {
      if (descr == info.descr) return info.dtype;
    }
    if (descr.size() >= 2 && descr[0] == '>' && descr != ">b1" && descr != ">u1" &&
        descr != ">i1") {
      throw NpyError("big-endian data ('" + printable(descr) +
                     "') is not supported; save it as little-endian");
    }
    throw NpyError("unsupported dtype '" + printable(descr) +
                   "' (supported: <f4, <f8, <f2, |b1, |u1, <i4, <i8)");
  }

  int64_t parse_dimension() {
    if (peek() == '-') fail("negative dimension in 'shape'");
    if (!std::isdigit(static_cast<unsigned char>(peek()))) {
      fail("'shape' must hold non-negative integers (offset " + std::to_string(pos_) + ")");
    }
    if (peek() == '0' && pos_ + 2 < text_.size() &&
        std::isdigit(static_cast<unsigned char>(text_[pos_ + 1]))) {
      fail("an integer with a leading zero in 'shape'");
    }
    int64_t value = 0;
    while (std::isdigit(static_cast<unsigned char>(peek()))) {
      if (__builtin_mul_overflow(value, int64_t{10}, &value) ||
          __builtin_add_overflow(value, int64_t{peek() - '0'}, &value)) {
        fail("a dimension in 'shape' does not fit in 63 bits");
      }
      ++pos_;
    }
    if (std::isalpha(static_cast<unsigned char>(peek()))) fail("'shape' must hold plain integers");
    return value;
  }

  std::vector<int64_t> parse_shape() {
    if (peek() == '[') fail("'shape' must be a tuple, not a list");
    expect('(', "'shape' must be a tuple");
    std::vector<int64_t> shape;
    bool trailing_comma = false;
    skip_spaces();
    while (peek() != ')') {
      if (shape.size() == static_cast<std::size_t>(kNpyMaxRank)) {
        fail("more than " + std::to_string(kNpyMaxRank) + " dimensions");
      }
      shape.push_back(parse_dimension());
      skip_spaces();
      trailing_comma = false;
      if (peek() == ',') {
        ++pos_;
        trailing_comma = true;
        skip_spaces();
      } else if (peek() != ')') {
        fail("',' or ')' expected in 'shape' (offset " + std::to_string(pos_) + ")");
      }
    }
    ++pos_;  // ')'
    if (shape.size() == 1 && !trailing_comma) {
      fail("'shape' (" + std::to_string(shape[0]) + ") is not a tuple: write (" +
           std::to_string(shape[0]) + ",)");
    }
    return shape;
  }

  const std::string& text_;
  std::size_t pos_ = 0;
};

// Checks the header against the bytes that follow it; returns the data size.
std::size_t check_data_size(const Header& h, std::size_t data_available) {
  const DtypeInfo& info = info_of(h.dtype);
  const Sizes sizes = sizes_of(h.shape, info.itemsize, info.descr);
  if (sizes.bytes > data_available) {
    throw NpyError("truncated data: shape " + shape_to_string(h.shape) + " of " + info.descr +
                   " needs " + std::to_string(sizes.bytes) + " bytes, the file holds " +
                   std::to_string(data_available));
  }
  if (sizes.bytes < data_available) {
    throw NpyError("size mismatch: shape " + shape_to_string(h.shape) + " of " + info.descr +
                   " needs " + std::to_string(sizes.bytes) + " bytes, the file holds " +
                   std::to_string(data_available));
  }
  return sizes.bytes;
}

// ------------------------------------------------------------ files

std::string errno_text(int err) {
  return std::strerror(err);
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Reads exactly n bytes; false at end of file.
bool read_fully(int fd, void* buffer, std::size_t n) {
  auto* p = static_cast<unsigned char*>(buffer);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw NpyError("read error: " + errno_text(errno));
    }
    if (got == 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

NpyArray read_npy_unprefixed(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused
  // below, before anything is read.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) throw NpyError("cannot open: " + errno_text(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw NpyError("cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) throw NpyError("not a regular file");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags >= 0) (void)::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  const auto total = static_cast<std::size_t>(st.st_size);

  unsigned char head[12] = {};
  const std::size_t head_len = total < sizeof head ? total : sizeof head;
  if (!read_fully(fd.get(), head, head_len)) throw NpyError("truncated: the file shrank");
  const Preamble pre = parse_preamble(head, head_len, total);

  std::string text(pre.header_len, '\0');
  const std::size_t already = head_len - pre.header_offset;  // header bytes read with `head`
  const std::size_t copied = already < pre.header_len ? already : pre.header_len;
  std::memcpy(&text[0], head + pre.header_offset, copied);
  if (!read_fully(fd.get(), &text[copied], pre.header_len - copied)) {
    throw NpyError("truncated: the file shrank");
  }
  const Header header = HeaderParser(text).parse();

  const std::size_t data_offset = pre.header_offset + pre.header_len;
  const std::size_t bytes = check_data_size(header, total - data_offset);
  NpyArray array(header.dtype, header.shape, header.fortran_order);
  // `head` may already hold the first data bytes (tiny headers only).
  const std::size_t in_head = head_len > data_offset ? head_len - data_offset : 0;
  auto* data = static_cast<unsigned char*>(array.data());
  if (in_head > 0) std::memcpy(data, head + data_offset, in_head);
  if (!read_fully(fd.get(), data + in_head, bytes - in_head)) {
    throw NpyError("truncated: the file shrank while it was read");
  }
  return array;
}

}  // namespace

// ---------------------------------------------------------------- dtypes

const char* npy_descr(NpyDtype dtype) {
  return info_of(dtype).descr;
}
const char* npy_dtype_name(NpyDtype dtype) {
  return info_of(dtype).name;
}
std::size_t npy_itemsize(NpyDtype dtype) {
  return info_of(dtype).itemsize;
}

namespace detail {
void throw_dtype_mismatch(NpyDtype have, NpyDtype want) {
  throw NpyError(std::string("the array holds ") + npy_dtype_name(have) + ", not " +
                 npy_dtype_name(want));
}
}  // namespace detail

// ---------------------------------------------------------------- NpyArray

NpyArray::NpyArray(NpyDtype dtype, std::vector<int64_t> shape, bool fortran_order)
    : dtype_(dtype), shape_(std::move(shape)), fortran_order_(fortran_order) {
  if (shape_.size() > static_cast<std::size_t>(kNpyMaxRank)) {
    throw NpyError("rank " + std::to_string(shape_.size()) + " exceeds " +
                   std::to_string(kNpyMaxRank));
  }
  const DtypeInfo& info = info_of(dtype);
  const Sizes sizes = sizes_of(shape_, info.itemsize, info.descr);
  size_ = sizes.elements;
  nbytes_ = sizes.bytes;
  strides_.assign(shape_.size(), 0);
  int64_t running = 1;  // cannot overflow: the non-zero sizes' product fits (sizes_of)
  const int r = rank();
  for (int i = 0; i < r; ++i) {
    const int d = fortran_order_ ? i : r - 1 - i;
    strides_[static_cast<std::size_t>(d)] = running;
    running *= shape_[static_cast<std::size_t>(d)];
  }
  storage_.assign((nbytes_ + 7) / 8 + (nbytes_ == 0 ? 1 : 0), 0);  // data() is never null
}

int64_t NpyArray::offset(const std::vector<int64_t>& index) const {
  if (index.size() != shape_.size()) {
    throw NpyError("index of rank " + std::to_string(index.size()) + " into an array of rank " +
                   std::to_string(shape_.size()));
  }
  for (std::size_t d = 0; d < index.size(); ++d) {
    if (index[d] < 0 || index[d] >= shape_[d]) {
      throw NpyError("index " + std::to_string(index[d]) + " out of range for dimension " +
                     std::to_string(d) + " of shape " + shape_string());
    }
  }
  return offset_unchecked(index.data());
}

int64_t NpyArray::offset_unchecked(const int64_t* index) const {
  int64_t off = 0;
  for (std::size_t d = 0; d < shape_.size(); ++d) off += index[d] * strides_[d];
  return off;
}

double NpyArray::value_as_double(int64_t i) const {
  const auto n = static_cast<std::size_t>(i);
  switch (dtype_) {
    case NpyDtype::F32:
      return static_cast<double>(static_cast<const float*>(data())[n]);
    case NpyDtype::F64:
      return static_cast<const double*>(data())[n];
    case NpyDtype::F16:
      return f16_bits_to_double(static_cast<const uint16_t*>(data())[n]);
    case NpyDtype::Bool:
    case NpyDtype::U8:
      return static_cast<const uint8_t*>(data())[n];
    case NpyDtype::I32:
      return static_cast<const int32_t*>(data())[n];
    case NpyDtype::I64:
      return static_cast<double>(static_cast<const int64_t*>(data())[n]);
  }
  return 0;
}

int64_t NpyArray::value_as_int64(int64_t i) const {
  const auto n = static_cast<std::size_t>(i);
  switch (dtype_) {
    case NpyDtype::I64:
      return static_cast<const int64_t*>(data())[n];
    case NpyDtype::I32:
      return static_cast<const int32_t*>(data())[n];
    case NpyDtype::Bool:
    case NpyDtype::U8:
      return static_cast<const uint8_t*>(data())[n];
    case NpyDtype::F32:
    case NpyDtype::F64:
    case NpyDtype::F16: {
      const double v = value_as_double(i);
      if (!(v > -9.2e18 && v < 9.2e18))
        return v > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
      return static_cast<int64_t>(v);
    }
  }
  return 0;
}

void NpyArray::set_from_double(int64_t i, double value) {
  const auto n = static_cast<std::size_t>(i);
  switch (dtype_) {
    case NpyDtype::F32:
      static_cast<float*>(data())[n] = static_cast<float>(value);
      return;
    case NpyDtype::F64:
      static_cast<double*>(data())[n] = value;
      return;
    case NpyDtype::F16:
      static_cast<uint16_t*>(data())[n] = f16_bits_from_double(value);
      return;
    case NpyDtype::Bool:
      static_cast<uint8_t*>(data())[n] = value != 0 ? 1 : 0;
      return;
    case NpyDtype::U8:
      static_cast<uint8_t*>(data())[n] = static_cast<uint8_t>(value);
      return;
    case NpyDtype::I32:
      static_cast<int32_t*>(data())[n] = static_cast<int32_t>(value);
      return;
    case NpyDtype::I64:
      static_cast<int64_t*>(data())[n] = static_cast<int64_t>(value);
      return;
  }
}

std::string NpyArray::shape_string() const {
  return shape_to_string(shape_);
}

std::string NpyArray::describe() const {
  return std::string(npy_dtype_name(dtype_)) + " " + shape_string() +
         (fortran_order_ ? " (Fortran order)" : "");
}

// ---------------------------------------------------------------- reading

NpyArray parse_npy(const void* bytes, std::size_t size) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  if (size == 0) throw NpyError("empty file");
  if (p == nullptr) throw NpyError("no data");
  const std::size_t head_len = size < 12 ? size : 12;
  const Preamble pre = parse_preamble(p, head_len, size);
  const std::string text(reinterpret_cast<const char*>(p + pre.header_offset), pre.header_len);
  const Header header = HeaderParser(text).parse();
  const std::size_t data_offset = pre.header_offset + pre.header_len;
  const std::size_t nbytes = check_data_size(header, size - data_offset);
  NpyArray array(header.dtype, header.shape, header.fortran_order);
  if (nbytes > 0) std::memcpy(array.data(), p + data_offset, nbytes);
  return array;
}

NpyArray read_npy(const std::string& path) {
  try {
    return read_npy_unprefixed(path);
  } catch (const NpyError& e) {
    throw NpyError(escape(path) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    throw NpyError(escape(path) + ": out of memory");
  }
}

// ---------------------------------------------------------------- writing

std::vector<unsigned char> encode_npy_header(const NpyArray& array) {
  const std::string dict = std::string("{'descr': '") + npy_descr(array.dtype()) +
                           "', 'fortran_order': " + (array.fortran_order() ? "True" : "False") +
                           ", 'shape': " + array.shape_string() + ", }";
  const std::size_t hlen = dict.size() + 1;  // with the final '\n'
  std::size_t len_bytes = 2;
  std::size_t pad = kAlign - (kMagicLen + len_bytes + hlen) % kAlign;
  if (hlen + pad > 0xffff) {
    len_bytes = 4;
    pad = kAlign - (kMagicLen + len_bytes + hlen) % kAlign;
  }
  const std::size_t header_len = hlen + pad;

  std::string text(std::begin(kMagic), std::end(kMagic));
  text += static_cast<char>(len_bytes == 2 ? 1 : 2);
  text += '\0';
  for (std::size_t i = 0; i < len_bytes; ++i) {
    text += static_cast<char>((header_len >> (8 * i)) & 0xff);
  }
  text += dict;
  text.append(pad, ' ');
  text += '\n';
  return std::vector<unsigned char>(text.begin(), text.end());
}

std::vector<unsigned char> encode_npy(const NpyArray& array) {
  std::vector<unsigned char> out = encode_npy_header(array);
  const auto* data = static_cast<const unsigned char*>(array.data());
  out.insert(out.end(), data, data + array.nbytes());
  return out;
}

void write_npy_fd(int fd, const NpyArray& array) {
  const std::vector<unsigned char> header = encode_npy_header(array);
  const struct {
    const unsigned char* p;
    std::size_t n;
  } parts[2] = {{header.data(), header.size()},
                {static_cast<const unsigned char*>(array.data()), array.nbytes()}};
  for (const auto& part : parts) {
    const unsigned char* p = part.p;
    std::size_t left = part.n;
    while (left > 0) {
      const ssize_t put = ::write(fd, p, left);
      if (put < 0) {
        if (errno == EINTR) continue;
        throw NpyError("write error: " + errno_text(errno));
      }
      if (put == 0) throw NpyError("write error: nothing written");
      p += put;
      left -= static_cast<std::size_t>(put);
    }
  }
}

void write_npy(const std::string& path, const NpyArray& array) {
  const std::string where = escape(path) + ": ";
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
  if (fd.get() < 0) throw NpyError(where + "cannot create: " + errno_text(errno));
  try {
    write_npy_fd(fd.get(), array);
  } catch (const NpyError& e) {
    throw NpyError(where + e.what());
  }
  if (::close(fd.release()) != 0) throw NpyError(where + "write error: " + errno_text(errno));
}

}  // namespace mha_tools
