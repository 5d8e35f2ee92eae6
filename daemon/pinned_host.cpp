#include "daemon/pinned_host.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include "shm/cuda_driver.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {
size_t PageSize() {
  static const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}
// Pointer arithmetic only (no integer-to-pointer casts): the page boundaries around `at`.
std::byte* PageStart(std::byte* at) {
  return at - reinterpret_cast<uintptr_t>(at) % PageSize();
}
std::byte* PageEnd(std::byte* at) {
  const size_t into = reinterpret_cast<uintptr_t>(at) % PageSize();
  return into == 0 ? at : at + (PageSize() - into);
}
}  // namespace

PinnedHost& PinnedHost::Instance() {
  static PinnedHost instance;
  return instance;
}

std::vector<PinnedHost::Piece> PinnedHost::Ensure(const void* data, size_t bytes) {
  // The memory is the job's segments, mapped writable; const only on the caller's side.
  auto* first = static_cast<std::byte*>(const_cast<void*>(data));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  std::lock_guard lock(mutex_);
  if (bytes != 0 && !warned_) Register(first, bytes);
  return Cut(first, bytes);
}

// Registers the pages of [first, first + bytes) outside every registered range, range by range.
void PinnedHost::Register(std::byte* first, size_t bytes) {
  std::byte* const end = PageEnd(first + bytes);
  std::byte* at = PageStart(first);
  const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
  while (at < end) {
    auto next = ranges_.upper_bound(at);
    if (next != ranges_.begin() && std::prev(next)->second > at) {  // `at` is inside a registered range
      at = std::prev(next)->second;
      continue;
    }
    std::byte* const stop = next == ranges_.end() ? end : std::min(end, next->first);
    const size_t length = stop - at;
    const cuda::CUresult result = driver.cuMemHostRegister(at, length, cuda::kMemHostRegisterPortable);
    if (result != 0) {
      warned_ = true;
      try {
        driver.Check(result, "cuMemHostRegister");
      } catch (const Error& e) {
        spdlog::warn("cannot page-lock {} bytes for GPU copies ({}); copies go through pageable memory", length,
                     e.what());
      }
      return;
    }
    ranges_.emplace(at, stop);
    pinned_bytes_ += length;
    at = stop;
  }
}

// [first, first + bytes) in pieces that each lie inside one registered range or outside all of them.
std::vector<PinnedHost::Piece> PinnedHost::Cut(std::byte* first, size_t bytes) const {
  std::vector<Piece> pieces;
  std::byte* const end = first + bytes;
  for (std::byte* at = first; at < end;) {
    auto next = ranges_.upper_bound(at);
    std::byte* stop = next == ranges_.end() ? end : std::min(end, next->first);
    if (next != ranges_.begin() && std::prev(next)->second > at) stop = std::min(end, std::prev(next)->second);
    pieces.push_back(Piece{at, static_cast<size_t>(stop - at)});
    at = stop;
  }
  return pieces;
}

void PinnedHost::Release(const void* base, size_t bytes) {
  const auto* first = static_cast<const std::byte*>(base);
  std::lock_guard lock(mutex_);
  auto it = ranges_.lower_bound(const_cast<std::byte*>(first));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  while (it != ranges_.end() && it->first < first + bytes) {
    cuda::CudaDriver::Get().cuMemHostUnregister(it->first);
    pinned_bytes_ -= it->second - it->first;
    it = ranges_.erase(it);
  }
}

uint64_t PinnedHost::pinned_bytes() {
  std::lock_guard lock(mutex_);
  return pinned_bytes_;
}

}  // namespace trainstream::daemon
