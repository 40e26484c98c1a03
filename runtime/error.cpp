#include "error.h"

#include <cstdarg>
#include <cstdio>

namespace mha::rt {
namespace {
// A fixed buffer: recording an error never allocates, and a message is never
// truncated mid-character in practice (they are short ASCII).
thread_local char t_message[1024] = "";
}  // namespace

mha_status fail(mha_status status, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(t_message, sizeof t_message, format, args);
  va_end(args);
  return status;
}

std::string printable(const char* text, size_t max_chars) {
  if (text == nullptr) return "(null)";
  std::string out;
  size_t n = 0;
  for (; text[n] != '\0' && n < max_chars; ++n) {
    const auto c = static_cast<unsigned char>(text[n]);
    if (c < 0x20 || c >= 0x7f || c == '\\') {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      out += escaped;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text[n] != '\0') out += "...";
  return out;
}

void clear_error() {
  t_message[0] = '\0';
}

const char* last_error() {
  return t_message;
}

const char* status_name(mha_status status) {
  switch (status) {
    case MHA_OK:
      return "MHA_OK";
    case MHA_ERR_NULL_POINTER:
      return "MHA_ERR_NULL_POINTER";
    case MHA_ERR_INVALID_SIZE:
      return "MHA_ERR_INVALID_SIZE";
    case MHA_ERR_SHAPE_MISMATCH:
      return "MHA_ERR_SHAPE_MISMATCH";
    case MHA_ERR_INVALID_DTYPE:
      return "MHA_ERR_INVALID_DTYPE";
    case MHA_ERR_INVALID_STRIDES:
      return "MHA_ERR_INVALID_STRIDES";
    case MHA_ERR_OVERLAP:
      return "MHA_ERR_OVERLAP";
    case MHA_ERR_SIZE_OVERFLOW:
      return "MHA_ERR_SIZE_OVERFLOW";
    case MHA_ERR_INVALID_PARAMS:
      return "MHA_ERR_INVALID_PARAMS";
    case MHA_ERR_INVALID_VALUE:
      return "MHA_ERR_INVALID_VALUE";
    case MHA_ERR_BACKEND_UNAVAILABLE:
      return "MHA_ERR_BACKEND_UNAVAILABLE";
    case MHA_ERR_OUT_OF_MEMORY:
      return "MHA_ERR_OUT_OF_MEMORY";
    case MHA_ERR_INTERNAL:
      return "MHA_ERR_INTERNAL";
    case MHA_ERR_UNSUPPORTED:
      return "MHA_ERR_UNSUPPORTED";
  }
  return "MHA_ERR_UNKNOWN_STATUS";
}

}  // namespace mha::rt
