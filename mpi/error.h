// The message of the last failed libmha-mpi call, per thread (mha_mpi_last_error).
#pragma once

#include <mha/mha.h>

namespace mha::mpi {

// Records the message (printf-style) and returns status.
mha_status fail(mha_status status, const char* format, ...) __attribute__((format(printf, 2, 3)));
// Records libmha's own last error, prefixed with what was being done.
mha_status fail_from_mha(mha_status status, const char* doing);
void clear_error();
const char* last_error();

}  // namespace mha::mpi
