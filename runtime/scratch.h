// Scratch memory: buffers that grow to the largest request and are reused,
// so steady-state calls allocate nothing.
#pragma once

#include <cstddef>

namespace mha::rt {

// One growing, 64-byte aligned buffer.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  // At least `bytes` (64 when 0), or nullptr when it cannot be allocated (the
  // old contents are then kept).  Valid until the next get() that grows it.
  void* get(size_t bytes);

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// The calling thread's buffer of one slot: the kernels' scratch, and the
// split-KV partial results.
enum class ScratchSlot { kKernel, kPartials };
void* thread_scratch(ScratchSlot slot, size_t bytes);

}  // namespace mha::rt
