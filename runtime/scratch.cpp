#include "scratch.h"

#include <cstdlib>

namespace mha::rt {

AlignedBuffer::~AlignedBuffer() {
  std::free(data_);
}

void* AlignedBuffer::get(size_t bytes) {
  if (bytes == 0) bytes = 64;
  if (bytes <= size_) return data_;
  const size_t rounded = (bytes + 4095) & ~size_t{4095};
  if (rounded < bytes) return nullptr;  // wrapped
  void* fresh = std::aligned_alloc(64, rounded);
  if (fresh == nullptr) return nullptr;
  std::free(data_);
  data_ = fresh;
  size_ = rounded;
  return data_;
}

namespace {
thread_local AlignedBuffer t_kernel;
thread_local AlignedBuffer t_partials;
}  // namespace

void* thread_scratch(ScratchSlot slot, size_t bytes) {
  return (slot == ScratchSlot::kKernel ? t_kernel : t_partials).get(bytes);
}

}  // namespace mha::rt
