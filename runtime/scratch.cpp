#include "scratch.h"

#include <cstdlib>

namespace mha::rt {
namespace {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  void* get(size_t bytes) {
    if (bytes <= size_) return data_;
    const size_t rounded = (bytes + 4095) & ~size_t{4095};
    void* fresh = std::aligned_alloc(64, rounded);
    if (fresh == nullptr) return nullptr;
    std::free(data_);
    data_ = fresh;
    size_ = rounded;
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

thread_local AlignedBuffer t_kernel;
thread_local AlignedBuffer t_partials;

}  // namespace

void* thread_scratch(ScratchSlot slot, size_t bytes) {
  return (slot == ScratchSlot::kKernel ? t_kernel : t_partials).get(bytes == 0 ? 64 : bytes);
}

}  // namespace mha::rt
