// Host memory that the GPUs' copy engines read and write, page-locked with the driver the first time a
// transfer touches it and unlocked before its segment is unmapped.
//
// Only what transfers touch is registered (never the moments, nor the master weights of 16-bit
// buckets): a rank's transfer registers it in the background once the rank has opened it (PinAhead),
// and a copy that comes first registers its pages itself, just before it runs.
// Invariants: registered ranges are page-aligned and disjoint (a page is registered at most once); a
// process that never uses the cuda-ipc transport never loads the driver here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "daemon/engine/host_range.h"

namespace trainstream::daemon {

// Disjoint page-aligned ranges and the arithmetic PinnedHost does on them; no driver calls, so it is
// tested alone.
class PageRanges {
 public:
  explicit PageRanges(size_t page) : page_(page) {}
  // The page-aligned parts of the pages under [first, first + bytes) that no range covers, in order.
  [[nodiscard]] std::vector<HostRange> Missing(std::byte* first, size_t bytes) const;
  // [first, first + bytes) cut where ranges begin or end: each part lies inside one range or
  // outside all of them.
  [[nodiscard]] std::vector<HostRange> Cut(std::byte* first, size_t bytes) const;
  void Add(HostRange range);
  // Removes and returns the ranges that start inside [first, first + bytes).
  std::vector<HostRange> RemoveInside(const std::byte* first, size_t bytes);
  // Bytes of the ranges that start inside [first, first + bytes).
  [[nodiscard]] uint64_t BytesInside(const std::byte* first, size_t bytes) const;
  [[nodiscard]] uint64_t bytes() const { return bytes_; }

 private:
  size_t page_;
  std::map<std::byte*, std::byte*, std::less<>> ranges_;  // start -> end
  uint64_t bytes_ = 0;
};

class PinnedHost {
 public:
  static PinnedHost& Instance();

  // Registers the pages of [data, data + bytes) that are not registered yet, and returns the range in
  // parts to copy one by one: the driver refuses a copy that spans two registrations
  // (CUDA_ERROR_INVALID_VALUE), and neighbouring buckets share pages. A refused registration is
  // logged once; the copies then go ahead from pageable memory (slower, still correct).
  std::vector<HostRange> Ensure(const void* data, size_t bytes);
  // Unregisters every range inside [base, base + bytes). Call before unmapping that memory, once no
  // copy can touch it.
  void Release(const void* base, size_t bytes);
  [[nodiscard]] uint64_t pinned_bytes();
  [[nodiscard]] uint64_t pinned_bytes(const void* base, size_t bytes);  // of the ranges inside [base, base + bytes)

 private:
  PinnedHost();

  std::mutex mutex_;
  PageRanges registered_;  // guarded by mutex_
  bool warned_ = false;
};

}  // namespace trainstream::daemon
