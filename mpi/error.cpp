#include "error.h"

#include <mha/mha_mpi.h>

#include <cstdarg>
#include <cstdio>
#include <string>

namespace mha::mpi {
namespace {
thread_local std::string message;
}

mha_status fail(mha_status status, const char* format, ...) {
  char buffer[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  message = buffer;
  return status;
}

mha_status fail_from_mha(mha_status status, const char* doing) {
  return fail(status, "%s: %s", doing, mha_last_error());
}

void clear_error() {
  message.clear();
}
const char* last_error() {
  return message.c_str();
}

}  // namespace mha::mpi

extern "C" const char* mha_mpi_last_error(void) {
  return mha::mpi::last_error();
}
