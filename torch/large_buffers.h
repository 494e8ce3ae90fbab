#ifndef GRADSUM_TORCH_LARGE_BUFFERS_H_
#define GRADSUM_TORCH_LARGE_BUFFERS_H_

// Memory for the torch binding's large kernel outputs (the CE gradient, [N, V]): anonymous
// mappings advised MADV_HUGEPAGE, and a one-slot cache that keeps the last buffer handed
// back, already touched, for the next request it fits.
//
//   LargeBuffer b = TakeLargeBuffer(bytes);   // b.data == nullptr: use another allocator
//   ... the kernel writes b.data; a tensor owns it ...
//   GiveBackLargeBuffer(b);                   // from the tensor's deleter
//
// Why: a fresh [4096, 32768] f32 gradient is 512 MiB, and on the development VM the first
// touch of 512 MiB costs 2.7 s in 4 KiB pages and 0.05-0.1 s in 2 MiB pages (transparent
// huge pages in `madvise` mode, the setting there), against ~0.06 s for the CE kernel that
// writes it; a buffer from the cache costs nothing. torch's CPU allocator maps such sizes
// afresh on every call. Training calls the loss with the same shape every micro-batch, so
// the cache hits from the second call on. It holds at most one buffer between calls;
// ReleaseCachedLargeBuffer() (gradsum_torch.empty_cache()) unmaps it. Thread-safe.

#include <cstddef>

namespace gradsum::torch_ops {

struct LargeBuffer {
  void* data = nullptr;  // 2 MiB aligned, at least the requested bytes
  void* base = nullptr;  // the mapping
  size_t mapped_bytes = 0;
  size_t usable_bytes = 0;  // from data to the mapping's end
};

// The cached buffer if it holds `bytes` and at most twice that, else a new mapping.
// data == nullptr if mmap failed.
LargeBuffer TakeLargeBuffer(size_t bytes);

// Keeps `buffer` for the next TakeLargeBuffer (unmapping the one kept before).
void GiveBackLargeBuffer(const LargeBuffer& buffer);

// Unmaps the kept buffer; returns its mapped size (0 if none was kept).
size_t ReleaseCachedLargeBuffer();

}  // namespace gradsum::torch_ops

#endif  // GRADSUM_TORCH_LARGE_BUFFERS_H_
