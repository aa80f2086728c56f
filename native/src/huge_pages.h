// Memory for the large buffers the engine streams through (scratch activations, the bandwidth probe's buffer): 2 MB
// aligned and advised MADV_HUGEPAGE, so that the kernel backs them with transparent huge pages where it can (the
// host's THP setting "madvise", the common default, gives them only to memory that asks).
//
// Why: on a KVM guest every 4 KB page of a streamed buffer costs a two-level page walk. On a 2-core Xeon guest
// (docs/benchmarks.md, session 23) the model file's pages in 2 MB folios read 1.5x faster than a fresh 4 KB-page
// buffer, and with the scratch on huge pages E2B prefill 1024 ran 1.09-1.12x and decode B=8/B=32 1.12-1.20x the
// speed of the same build on 4 KB pages (alternated runs).
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>

namespace sg {

constexpr size_t kHugePageBytes = size_t(2) << 20;

// Blocks of at least kHugePageBytes: on transparent huge pages where the kernel gives them (advised MADV_HUGEPAGE; a
// kernel without THP refuses, which costs nothing), each starting kColourBytes × (a counter mod kColours) past a 2 MB
// boundary. Without that offset every block would start at the same cache sets and 4 KB alias, so that two read in
// step (gate and up, the FFN's two outputs) would meet in them; a precaution, not a measured gain (the B=32 FFN
// slowdown first suspected of it came with the arena's huge pages: docs/benchmarks.md, session 23). Smaller blocks:
// on a 64-byte line.
constexpr size_t kColourBytes = 4096 + 64 * 5;
constexpr unsigned kColours = 16;

inline void* stream_alloc(size_t bytes) {
  if (bytes < kHugePageBytes) return ::operator new(bytes ? bytes : 1, std::align_val_t(64));
  static std::atomic<unsigned> next{0};
  const size_t offset = kColourBytes * (next.fetch_add(1, std::memory_order_relaxed) % kColours);
  const size_t rounded = (bytes + offset + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  char* base = static_cast<char*>(::operator new(rounded, std::align_val_t(kHugePageBytes)));
  madvise(base, rounded, MADV_HUGEPAGE);
  return base + offset;
}

// Frees a block of stream_alloc(bytes), with the same `bytes`: its 2 MB boundary is the block's start rounded down
// (the offset is below 2 MB).
inline void stream_free(void* p, size_t bytes) {
  if (bytes < kHugePageBytes) {
    ::operator delete(p, std::align_val_t(64));
    return;
  }
  void* base = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) / kHugePageBytes * kHugePageBytes);
  ::operator delete(base, std::align_val_t(kHugePageBytes));
}

}  // namespace sg
