#include "daemon/pinned_host.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include "shm/cuda_driver.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {
uintptr_t PageSize() {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return page;
}
}  // namespace

PinnedHost& PinnedHost::Instance() {
  static PinnedHost instance;
  return instance;
}

std::vector<PinnedHost::Piece> PinnedHost::Ensure(const void* data, size_t bytes) {
  std::lock_guard lock(mutex_);
  if (bytes != 0 && !warned_) Register(reinterpret_cast<uintptr_t>(data), bytes);
  return Cut(reinterpret_cast<uintptr_t>(data), bytes);
}

// Registers the pages of [first, first + bytes) outside every registered range, range by range.
void PinnedHost::Register(uintptr_t first, size_t bytes) {
  const uintptr_t page = PageSize();
  const uintptr_t end = (first + bytes + page - 1) / page * page;
  uintptr_t at = first / page * page;
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  while (at < end) {
    auto next = ranges_.upper_bound(at);
    if (next != ranges_.begin() && std::prev(next)->second > at) {  // `at` is inside a registered range
      at = std::prev(next)->second;
      continue;
    }
    const uintptr_t stop = next == ranges_.end() ? end : std::min(end, next->first);
    const cuda::CUresult result =
        driver.cuMemHostRegister(reinterpret_cast<void*>(at), stop - at, cuda::kMemHostRegisterPortable);
    if (result != 0) {
      warned_ = true;
      try {
        driver.Check(result, "cuMemHostRegister");
      } catch (const Error& e) {
        spdlog::warn("cannot page-lock {} bytes for GPU copies ({}); copies go through pageable memory", stop - at,
                     e.what());
      }
      return;
    }
    ranges_.emplace(at, stop);
    pinned_bytes_ += stop - at;
    at = stop;
  }
}

// [first, first + bytes) in pieces that each lie inside one registered range or outside all of them.
std::vector<PinnedHost::Piece> PinnedHost::Cut(uintptr_t first, size_t bytes) const {
  std::vector<Piece> pieces;
  const uintptr_t end = first + bytes;
  for (uintptr_t at = first; at < end;) {
    auto next = ranges_.upper_bound(at);
    uintptr_t stop = next == ranges_.end() ? end : std::min(end, next->first);
    if (next != ranges_.begin() && std::prev(next)->second > at) stop = std::min(end, std::prev(next)->second);
    pieces.push_back(Piece{reinterpret_cast<std::byte*>(at), stop - at});
    at = stop;
  }
  return pieces;
}

void PinnedHost::Release(const void* base, size_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(base);
  std::lock_guard lock(mutex_);
  auto it = ranges_.lower_bound(first);
  while (it != ranges_.end() && it->first < first + bytes) {
    cuda::CudaDriver::Get().cuMemHostUnregister(reinterpret_cast<void*>(it->first));
    pinned_bytes_ -= it->second - it->first;
    it = ranges_.erase(it);
  }
}

uint64_t PinnedHost::pinned_bytes() {
  std::lock_guard lock(mutex_);
  return pinned_bytes_;
}

}  // namespace trainstream::daemon
