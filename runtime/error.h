// The thread-local error message behind mha_last_error().
#pragma once

#include <mha/mha.h>

namespace mha::rt {

// Records a formatted message for the calling thread and returns status, so a
// check reads `return fail(MHA_ERR_..., "q is NULL");`.
mha_status fail(mha_status status, const char* format, ...) __attribute__((format(printf, 2, 3)));

void clear_error();
const char* last_error();
const char* status_name(mha_status status);

}  // namespace mha::rt
