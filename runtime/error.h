// The thread-local error message behind mha_last_error().
#pragma once

#include <mha/mha.h>

#include <cstddef>
#include <exception>
#include <new>
#include <string>

namespace mha::rt {

// Records a formatted message for the calling thread and returns status, so a
// check reads `return fail(MHA_ERR_..., "q is NULL");`.
mha_status fail(mha_status status, const char* format, ...) __attribute__((format(printf, 2, 3)));

void clear_error();

// Text from the user (an environment variable, a name) made safe to print:
// control characters, DEL and bytes outside ASCII become \xNN escapes, so a
// message can never drive the terminal; longer than max_chars, it is cut and
// ends in "...".
std::string printable(const char* text, size_t max_chars = 64);
const char* last_error();
const char* status_name(mha_status status);

// Runs an entry point's body so that no exception crosses the C API: out of
// memory and anything else thrown become a status and a message.
template <typename Body>
mha_status guarded(Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return fail(MHA_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return fail(MHA_ERR_INTERNAL, "internal error: %s", e.what());
  } catch (...) {
    return fail(MHA_ERR_INTERNAL, "internal error");
  }
}

}  // namespace mha::rt
