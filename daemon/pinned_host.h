// Host memory that the GPUs' copy engines read and write, page-locked with the driver the first time a
// transfer touches it and unlocked before its segment is unmapped.
//
// Registration costs about 2 GiB/s (DESIGN.md "Memory"), so nothing is registered when a job starts:
// a copy thread registers the pages of a bucket just before its first copy, and memory no transfer
// touches (the moments, the master weights of 16-bit buckets) is never registered.
// Invariants: registered ranges are page-aligned and disjoint (a page is registered at most once); a
// process that never uses the cuda-ipc transport never loads the driver here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace trainstream::daemon {

class PinnedHost {
 public:
  static PinnedHost& Instance();

  // One copy's host range, cut where registrations begin or end: the driver refuses a copy that
  // spans two registrations (CUDA_ERROR_INVALID_VALUE), and neighbouring buckets share pages.
  struct Piece {
    std::byte* data;
    size_t bytes;
  };
  // Registers the pages of [data, data + bytes) that are not registered yet, and returns the range in
  // pieces to copy one by one. A refused registration is logged once; the copies then go ahead from
  // pageable memory (slower, still correct).
  std::vector<Piece> Ensure(const void* data, size_t bytes);
  // Unregisters every range inside [base, base + bytes). Call before unmapping that memory, once no
  // copy can touch it.
  void Release(const void* base, size_t bytes);
  [[nodiscard]] uint64_t pinned_bytes();

 private:
  void Register(std::byte* first, size_t bytes);                               // requires mutex_
  [[nodiscard]] std::vector<Piece> Cut(std::byte* first, size_t bytes) const;  // requires mutex_

  std::mutex mutex_;
  std::map<std::byte*, std::byte*, std::less<>> ranges_;  // start -> end, page-aligned
  uint64_t pinned_bytes_ = 0;
  bool warned_ = false;
};

}  // namespace trainstream::daemon
