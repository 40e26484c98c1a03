// Per-thread scratch memory: grows to the largest request and is reused, so
// steady-state calls allocate nothing.
#pragma once

#include <cstddef>

namespace mha::rt {

// 64-byte aligned memory of at least `bytes` owned by the calling thread, or
// nullptr when it cannot be allocated.  Valid until the next call on this
// thread with the same slot.
enum class ScratchSlot { kKernel, kPartials };
void* thread_scratch(ScratchSlot slot, size_t bytes);

}  // namespace mha::rt
