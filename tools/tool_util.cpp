#include "tool_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "npy.h"

namespace mha_tools {
namespace {

const char kHex[] = "0123456789abcdef";

void put_hex(std::string& out, unsigned char u) {
  out += "\\x";
  out += kHex[u >> 4];
  out += kHex[u & 0xf];
}

// The length of the valid UTF-8 sequence that starts at text[i] (2 to 4), or
// 0 when the bytes there are not one.  Overlong forms, surrogates and code
// points above U+10FFFF are not valid.
std::size_t utf8_length(std::string_view text, std::size_t i, uint32_t* code_point) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const unsigned char lead = byte(0);
  std::size_t n = 0;
  uint32_t cp = 0;
  if (lead >= 0xc2 && lead <= 0xdf) {
    n = 2, cp = lead & 0x1fu;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    n = 3, cp = lead & 0x0fu;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    n = 4, cp = lead & 0x07u;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((byte(k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (byte(k) & 0x3fu);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10ffff ||
      (cp >= 0xd800 && cp <= 0xdfff)) {
    return 0;
  }
  *code_point = cp;
  return n;
}

}  // namespace

std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const auto u = static_cast<unsigned char>(text[i]);
    if (u >= 0x20 && u < 0x7f) {
      out += text[i++];
      continue;
    }
    if (u == '\t' || u == '\n' || u == '\r') {
      out += u == '\t' ? "\\t" : (u == '\n' ? "\\n" : "\\r");
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const std::size_t n = u >= 0x80 ? utf8_length(text, i, &cp) : 0;
    if (n == 0 || cp < 0xa0) {  // C0, DEL, not UTF-8, or a C1 control (U+0080..U+009F)
      const std::size_t bytes = n == 0 ? 1 : n;
      for (std::size_t k = 0; k < bytes; ++k) put_hex(out, static_cast<unsigned char>(text[i + k]));
      i += bytes;
      continue;
    }
    out.append(text.substr(i, n));
    i += n;
  }
  return out;
}

void print_error(const std::string& message) {
  std::fprintf(stderr, "mha-run: %s\n", escape(message).c_str());
}

bool verbose() {
  // The library's rule (runtime/env.cpp): one digit, 0 to 2; anything else
  // the library ignores with a warning, and so does the tool's own notice.
  const char* text = std::getenv("MHA_VERBOSE");
  return text != nullptr && (text[0] == '1' || text[0] == '2') && text[1] == '\0';
}

bool secondary_mpi_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    const char* rank = std::getenv(name);
    if (rank != nullptr && *rank != '\0') return std::string_view(rank) != "0";
  }
  return false;
}

std::string read_small_file(const std::string& path, std::size_t limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw NpyError(std::string("cannot open: ") + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw NpyError(std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw NpyError("not a regular file");
  if (static_cast<uint64_t>(st.st_size) > limit) {
    throw NpyError("larger than " + std::to_string(limit) + " bytes");
  }
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, &text[got], text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw NpyError(std::string("read error: ") + std::strerror(errno));
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  text.resize(got);
  return text;
}

std::string bracketed(const std::vector<int64_t>& values) {
  std::string text = "[";
  for (std::size_t d = 0; d < values.size(); ++d) {
    text += (d > 0 ? ", " : "") + std::to_string(values[d]);
  }
  return text + "]";
}

}  // namespace mha_tools
