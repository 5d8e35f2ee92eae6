#include "daemon/gpu/pinned_host.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include "shm/cuda_driver.h"
#include "shm/error.h"

namespace trainstream::daemon {

namespace {
// Pointer arithmetic only (no integer-to-pointer casts): the page boundaries around `at`.
std::byte* PageStart(std::byte* at, size_t page) {
  return at - reinterpret_cast<uintptr_t>(at) % page;
}
std::byte* PageEnd(std::byte* at, size_t page) {
  const size_t into = reinterpret_cast<uintptr_t>(at) % page;
  return into == 0 ? at : at + (page - into);
}
}  // namespace

std::vector<HostRange> PageRanges::Missing(std::byte* first, size_t bytes) const {
  std::vector<HostRange> missing;
  std::byte* const end = PageEnd(first + bytes, page_);
  for (std::byte* at = PageStart(first, page_); at < end;) {
    auto next = ranges_.upper_bound(at);
    if (next != ranges_.begin() && std::prev(next)->second > at) {  // `at` is inside a range
      at = std::prev(next)->second;
      continue;
    }
    std::byte* const stop = next == ranges_.end() ? end : std::min(end, next->first);
    missing.push_back(HostRange{at, static_cast<size_t>(stop - at)});
    at = stop;
  }
  return missing;
}

std::vector<HostRange> PageRanges::Cut(std::byte* first, size_t bytes) const {
  std::vector<HostRange> parts;
  std::byte* const end = first + bytes;
  for (std::byte* at = first; at < end;) {
    auto next = ranges_.upper_bound(at);
    std::byte* stop = next == ranges_.end() ? end : std::min(end, next->first);
    if (next != ranges_.begin() && std::prev(next)->second > at) stop = std::min(end, std::prev(next)->second);
    parts.push_back(HostRange{at, static_cast<size_t>(stop - at)});
    at = stop;
  }
  return parts;
}

void PageRanges::Add(HostRange range) {
  ranges_.emplace(range.data, range.data + range.bytes);
  bytes_ += range.bytes;
}

std::vector<HostRange> PageRanges::RemoveInside(const std::byte* first, size_t bytes) {
  std::vector<HostRange> removed;
  auto it = ranges_.lower_bound(first);
  while (it != ranges_.end() && it->first < first + bytes) {
    removed.push_back(HostRange{it->first, static_cast<size_t>(it->second - it->first)});
    bytes_ -= removed.back().bytes;
    it = ranges_.erase(it);
  }
  return removed;
}

uint64_t PageRanges::BytesInside(const std::byte* first, size_t bytes) const {
  uint64_t inside = 0;
  for (auto it = ranges_.lower_bound(first); it != ranges_.end() && it->first < first + bytes; ++it) {
    inside += it->second - it->first;
  }
  return inside;
}

PinnedHost::PinnedHost() : registered_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {}

PinnedHost& PinnedHost::Instance() {
  static PinnedHost instance;
  return instance;
}

std::vector<HostRange> PinnedHost::Ensure(const void* data, size_t bytes) {
  // The memory is the job's segments, mapped writable; const only on the caller's side.
  auto* first = static_cast<std::byte*>(const_cast<void*>(data));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  std::lock_guard lock(mutex_);
  if (bytes != 0 && !warned_) {
    const cuda::CudaDriver& driver = cuda::CudaDriver::Get();
    for (const HostRange& range : registered_.Missing(first, bytes)) {
      const cuda::CUresult result = driver.cuMemHostRegister(range.data, range.bytes, cuda::kMemHostRegisterPortable);
      if (result != 0) {
        warned_ = true;
        try {
          driver.Check(result, "cuMemHostRegister");
        } catch (const Error& e) {
          spdlog::warn("cannot page-lock {} bytes for GPU copies ({}); copies go through pageable memory", range.bytes,
                       e.what());
        }
        break;
      }
      registered_.Add(range);
    }
  }
  return registered_.Cut(first, bytes);
}

void PinnedHost::Release(const void* base, size_t bytes) {
  std::lock_guard lock(mutex_);
  for (const HostRange& range : registered_.RemoveInside(static_cast<const std::byte*>(base), bytes)) {
    cuda::CudaDriver::Get().cuMemHostUnregister(range.data);
  }
}

uint64_t PinnedHost::pinned_bytes() {
  std::lock_guard lock(mutex_);
  return registered_.bytes();
}

uint64_t PinnedHost::pinned_bytes(const void* base, size_t bytes) {
  std::lock_guard lock(mutex_);
  return registered_.BytesInside(static_cast<const std::byte*>(base), bytes);
}

}  // namespace trainstream::daemon
