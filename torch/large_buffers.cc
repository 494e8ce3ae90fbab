#include "torch/large_buffers.h"

#include <sys/mman.h>

#include <cstdint>
#include <mutex>

namespace gradsum::torch_ops {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

struct Cache {
  std::mutex mu;
  LargeBuffer kept;  // data == nullptr: none
};

// Never destroyed: tensors that own large buffers may die after static destructors ran.
Cache& TheCache() {
  static Cache* cache = new Cache;
  return *cache;
}

void Unmap(const LargeBuffer& b) {
  if (b.base != nullptr) munmap(b.base, b.mapped_bytes);
}

}  // namespace

LargeBuffer TakeLargeBuffer(size_t bytes) {
  {
    Cache& c = TheCache();
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.kept.data != nullptr && c.kept.usable_bytes >= bytes &&
        c.kept.usable_bytes / 2 <= bytes) {
      LargeBuffer b = c.kept;
      c.kept = LargeBuffer();
      return b;
    }
  }
  // One huge page more than needed, so that the data can start on a 2 MiB boundary.
  const size_t len = (bytes + kHugePage - 1) / kHugePage * kHugePage + kHugePage;
  void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return LargeBuffer();
  const uintptr_t start = reinterpret_cast<uintptr_t>(base);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  LargeBuffer b;
  b.base = base;
  b.mapped_bytes = len;
  b.data = reinterpret_cast<void*>(aligned);
  b.usable_bytes = len - (aligned - start);
  madvise(b.data, b.usable_bytes, MADV_HUGEPAGE);  // advice only: no error is fatal
  return b;
}

void GiveBackLargeBuffer(const LargeBuffer& buffer) {
  LargeBuffer old;
  {
    Cache& c = TheCache();
    std::lock_guard<std::mutex> lock(c.mu);
    old = c.kept;
    c.kept = buffer;
  }
  Unmap(old);
}

size_t ReleaseCachedLargeBuffer() {
  LargeBuffer old;
  {
    Cache& c = TheCache();
    std::lock_guard<std::mutex> lock(c.mu);
    old = c.kept;
    c.kept = LargeBuffer();
  }
  Unmap(old);
  return old.mapped_bytes;
}

}  // namespace gradsum::torch_ops
